"""The contention watch: steps move to one thread while other processes take the cores, and back.

The kernel's run-delay counter and the clock are given as plain functions here; the last test
reads the real counter of this process.
"""

from __future__ import annotations

import itertools
import os
import threading

import pytest

from goodput_runtime.engine.contention import ContentionWatch, compute_threads_delay


class Machine:
    """A clock and a run-delay counter that steps of `seconds` on `threads` threads advance, with
    `waiting` of each thread's time spent runnable but without a CPU."""

    def __init__(self) -> None:
        self.now = 0.0
        self.delay_ns = 0
        self.waiting = 0.0

    def step(self, watch: ContentionWatch, planned: int, seconds: float = 0.05) -> int:
        threads = watch.begin(planned)
        self.now += seconds
        self.delay_ns += int(seconds * threads * self.waiting * 1e9)
        watch.end()
        return threads


def make(machine: Machine, **kwargs) -> ContentionWatch:
    return ContentionWatch(read=lambda: machine.delay_ns, clock=lambda: machine.now, **kwargs)


def test_a_quiet_machine_keeps_the_planned_threads():
    machine = Machine()
    machine.waiting = 0.02
    watch = make(machine)
    assert all(machine.step(watch, 2) == 2 for _ in range(200))
    assert not watch.contended and watch.switches == 0
    assert watch.last_share == pytest.approx(0.02, abs=0.005)


def test_lasting_contention_moves_steps_to_one_thread_and_a_probe_brings_them_back_once_the_cores_are_free():
    machine = Machine()
    watch = make(machine, window=1.0, confirm=2, probe=2.0, probe_max=20.0)
    for _ in range(40):
        machine.step(watch, 2)
    machine.waiting = 0.45  # a busy process takes one of the two cores
    threads = [machine.step(watch, 2) for _ in range(80)]
    assert threads[-1] == 1 and watch.contended
    assert 20 <= threads.index(1) <= 45  # two one-second windows of ~20 steps (the first may hold quiet steps)
    # one thread while contended; the planned threads are tried 2 s later, then 4, 8, 16, 20, 20 s apart
    threads = [machine.step(watch, 2) for _ in range(1400)]  # 70 s
    probes = [i for i, n in enumerate(threads) if n == 2]
    assert watch.contended and 5 <= len(probes) <= 7, probes
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps == sorted(gaps) and max(gaps) <= 20 / 0.05 + 3, gaps
    machine.waiting = 0.01  # the busy process is gone
    threads = [machine.step(watch, 2) for _ in range(500)]
    assert not watch.contended and threads[-50:] == [2] * 50
    assert watch.switches == 2


def test_a_burst_of_waiting_shorter_than_the_confirming_windows_moves_nothing():
    # e.g. the event loop parsing a burst of arrivals beside one long prefill
    machine = Machine()
    watch = make(machine, window=1.0, confirm=2)
    for waiting in ([0.02] * 40 + [0.5] * 20 + [0.02] * 40) * 3:
        machine.waiting = waiting
        assert machine.step(watch, 2) == 2
    assert not watch.contended and watch.switches == 0


def test_steps_planned_on_one_thread_are_neither_watched_nor_changed():
    machine = Machine()
    machine.waiting = 0.9
    reads = []
    watch = ContentionWatch(read=lambda: reads.append(1) or machine.delay_ns, clock=lambda: machine.now)
    assert all(machine.step(watch, 1) == 1 for _ in range(100))
    assert not reads and not watch.contended


def test_without_the_kernels_figures_nothing_changes():
    machine = Machine()
    watch = ContentionWatch(read=lambda: None, clock=lambda: machine.now)
    assert all(machine.step(watch, 4) == 4 for _ in range(100))
    assert not watch.contended


def test_the_counter_sums_the_caller_and_native_threads_but_not_other_python_threads(tmp_path, monkeypatch):
    other = threading.Thread(target=threading.Event().wait, args=(5,), daemon=True)  # a Python thread
    other.start()
    native = 4_000_000  # a thread Python did not start: OpenMP's, say
    for tid, waited in ((threading.get_native_id(), 1), (other.native_id, 10), (native, 100)):
        (tmp_path / str(tid)).mkdir()
        (tmp_path / str(tid) / "schedstat").write_text(f"5000 {waited} 7\n")
    (tmp_path / "4000001").mkdir()  # a thread that ended between the listing and the read
    monkeypatch.setattr("goodput_runtime.engine.contention.TASKS", str(tmp_path))
    assert compute_threads_delay() == 101
    monkeypatch.setattr("goodput_runtime.engine.contention.TASKS", str(tmp_path / "missing"))
    assert compute_threads_delay() is None


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs Linux's /proc")
def test_this_process_has_the_kernels_figures():
    assert isinstance(compute_threads_delay(), int)
