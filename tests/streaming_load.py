"""Open-loop arrivals drawn once and replayed, each request streamed so that its client times its tokens; and
the CPU weight a CPU-bound live test may ask for while it runs. For the live autoscaler tests (live_pods.py)."""

from __future__ import annotations

import random
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from live_pods import Actuator, OpenLoad


def schedule(rate: Callable[[float], float], top: float, end: float, seed: int) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process of rate `rate(t)` up to `end`, by thinning one
    of rate `top` (at least every rate(t)): the same arrivals for every run, and a low rate's long gap never runs
    into a high phase, as drawing each gap at the rate where it starts would."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(top)
        if t >= end:
            return out
        if rng.random() * top < rate(t):
            out.append(t)


@dataclass
class Answer:
    at: float  # monotonic, when sent
    ttft: float | None  # seconds to the first streamed token, from `at`
    tpot: float | None  # seconds per output token after it
    status: int  # HTTP status; 0: no answer

    def good(self, ttft: float, tpot: float) -> bool:
        """Within an SLO of `ttft` and `tpot` seconds, as its client saw it."""
        return self.status == 200 and self.ttft is not None and self.ttft <= ttft and (self.tpot or 0.0) <= tpot


class StreamingLoad(OpenLoad):
    """OpenLoad sending at the times of `arrivals` (seconds from its start), each request streamed: its client times
    the first token and those after (`max_tokens` of them, the body asking ignore_eos)."""

    def __init__(self, actuator: Actuator, body: dict[str, object], arrivals: list[float], max_tokens: int) -> None:
        super().__init__(actuator, lambda _: 0.0, {**body, "stream": True})
        self.schedule, self.max_tokens = arrivals, max_tokens
        self.answers: list[Answer] = []

    def _arrivals(self) -> None:
        for offset in self.schedule:
            due = self.started + offset
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            self.arrivals.append(due)
            self._pool.submit(self._send, due)

    def _send(self, at: float) -> None:
        ports = self.actuator.ready_ports()
        first = end = None
        status = 0
        if ports:
            self._turn += 1
            request = urllib.request.Request(
                f"http://127.0.0.1:{ports[self._turn % len(ports)]}/v1/completions",
                data=self.body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=60) as response:
                    for line in response:
                        if first is None and line.startswith(b"data:") and b"[DONE]" not in line:
                            first = time.monotonic()
                    end = time.monotonic()
                    status = response.status
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError:
                status = 0
        ttft = None if first is None else first - at
        tpot = None if first is None or end is None else (end - first) / max(1, self.max_tokens - 1)
        self.answers.append(Answer(at, ttft, tpot, status))


@contextmanager
def cpu_weight(nice: int) -> Iterator[None]:
    """This test session's CPU weight against other sessions' work on the machine (its Linux autogroup), set to
    `nice` while the block runs and restored after; unchanged where the kernel has no autogroups or refuses."""
    path = Path("/proc/self/autogroup")
    try:
        before = int(path.read_text().rsplit("nice", 1)[1])
        path.write_text(str(nice))
    except (OSError, ValueError, IndexError):
        yield
        return
    try:
        yield
    finally:
        path.write_text(str(before))
