"""Whether other processes take the cores a CPU forward pass runs on, and one thread while they do.

A step with several intra-op threads waits at every parallel region for its slowest thread. When
another process takes one of the cores, the thread sharing that core runs a fraction of the time,
and every step stalls on it: measured on 2 cores with one busy process beside it, a SmolLM2 decode
step of 16 sequences (F.linear, two threads) went from 101 ms to 311 ms with OpenMP's default spin
and to 174 ms with passive waits, where steps tuned and run on one thread took about 100 ms.
Passive waits cost a quiet machine 25-40 % on every tuned step instead (OpenMP wakes its sleeping
threads at each of a step's hundreds of parallel regions), so the runtime keeps OpenMP's default
short spin and watches for contention instead.

The kernel keeps, per thread, the time it was runnable but waiting for a CPU
(``/proc/self/task/<tid>/schedstat``, its second field). ContentionWatch sums it over the threads
that run forward passes (the step thread and the native threads that are not Python's: OpenMP's
pool) across steps: when that delay exceeds ``enter`` of the thread-seconds the steps were given
over ``confirm`` windows in a row of at least ``window`` seconds each, steps run on one thread (a
burst of arrivals parsed beside one step is not enough). ``probe`` seconds later one step runs with
its planned threads again, and once such a step waits under ``leave`` the planned threads are back;
while probes still find the cores taken, the gap between them doubles up to ``probe_max``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

TASKS = "/proc/self/task"


def compute_threads_delay() -> int | None:
    """Nanoseconds the calling thread and every native non-Python thread of this process have waited
    for a CPU since they started, or None where the kernel does not say."""
    python_threads = {t.native_id for t in threading.enumerate()} - {threading.get_native_id()}
    total = 0
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return None
    for tid in tids:
        if int(tid) in python_threads:
            continue
        try:
            with open(f"{TASKS}/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile
    return total


class ContentionWatch:
    """Decides each step's threads from the planned count and the run delay the last steps saw."""

    def __init__(
        self,
        enter: float = 0.2,
        leave: float = 0.08,
        window: float = 1.5,
        confirm: int = 2,
        probe: float = 2.0,
        probe_max: float = 20.0,
        read: Callable[[], int | None] = compute_threads_delay,
        clock: Callable[[], float] = time.monotonic,
        on_switch: Callable[[bool], None] | None = None,
    ) -> None:
        self.enter, self.leave, self.window, self.confirm = enter, leave, window, confirm
        self.probe, self.probe_max = probe, probe_max
        self.read, self.clock = read, clock
        self.on_switch = on_switch  # called with the new state (True: contended) at each switch
        self.contended = False
        self.switches = 0  # times the watch moved steps to one thread or back
        self.last_share: float | None = None  # the waiting share of the last window (or probe step)
        self._next_probe = 0.0
        self._probe_gap = probe
        self._over = 0  # consecutive windows over `enter`
        self._start: tuple[float, int, int] | None = None  # the running step's (clock, delay) at its start, threads
        self._probing = False
        self._delay = 0  # over the current window: ns waited, and thread-seconds given
        self._given = 0.0

    def begin(self, planned: int) -> int:
        """The threads for the next step, planned for `planned`; call end() after it."""
        self._start = None
        if planned <= 1:
            return planned
        now = self.clock()
        self._probing = self.contended and now >= self._next_probe
        if self.contended and not self._probing:
            return 1
        delay = self.read()
        if delay is None:  # no kernel figures: nothing to watch
            return planned
        self._start = (now, delay, planned)
        return planned

    def end(self) -> None:
        if self._start is None:
            return
        started, before, threads = self._start
        self._start = None
        after = self.read()
        if after is None:
            return
        now = self.clock()
        if self._probing:
            share = (after - before) / 1e9 / max((now - started) * threads, 1e-9)
            self.last_share = share
            if share < self.leave:
                self._switch(False, share)
            else:  # still contended: the next probe waits longer, up to probe_max
                self._probe_gap = min(self._probe_gap * 2, self.probe_max)
                self._next_probe = now + self._probe_gap
            return
        self._delay += after - before
        self._given += (now - started) * threads
        if self._given < self.window * threads:
            return
        share = self._delay / 1e9 / self._given
        self.last_share = share
        self._delay, self._given = 0, 0.0
        # a burst of arrivals that the event loop parses beside a step reads as a window of waiting too:
        # only waiting that lasts `confirm` windows moves the steps
        self._over = self._over + 1 if share > self.enter else 0
        if self._over >= self.confirm:
            self._over = 0
            self._probe_gap = self.probe
            self._next_probe = now + self.probe
            self._switch(True, share)

    def _switch(self, contended: bool, share: float) -> None:
        self.contended = contended
        self.switches += 1
        if self.on_switch is not None:
            self.on_switch(contended)
        if contended:
            log.warning(
                "Other processes take this runtime's cores: its compute threads waited for a CPU %.0f%% "
                "of their time; steps run on one thread, and their planned threads are tried again "
                "after %g s, then less often",
                100 * share,
                self.probe,
            )
        else:
            log.warning(
                "The cores are free again (a step's threads waited %.0f%% of their time); steps run "
                "with their planned threads",
                100 * share,
            )
