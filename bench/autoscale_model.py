"""The simulated service: replicas that follow a measured capacity curve, and its arrival traces.

Used by bench/autoscale_sim.py. A replica at n requests in flight completes requests at
the measured throughput X(n); each request's TTFT and TPOT come from lognormals through
the measured p50 and p90 at n.
"""

from __future__ import annotations

import json
import math
import random
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CURVE = Path(__file__).resolve().parent / "autoscale_capacity.json"
DT = 0.5  # simulation step, seconds


@dataclass(frozen=True)
class Curve:
    """One replica: throughput (req/s), TTFT and TPOT (s) against requests in flight."""

    concurrency: tuple[int, ...]
    throughput: tuple[float, ...]
    ttft: tuple[float, ...]  # p50
    tpot: tuple[float, ...]  # p50
    ttft_p90: tuple[float, ...]
    tpot_p90: tuple[float, ...]
    slo_ttft: float
    slo_tpot: float

    @classmethod
    def load(cls, path: Path = CURVE) -> Curve:
        data = json.loads(path.read_text())
        points = data["points"]

        def col(key: str) -> tuple[float, ...]:
            """The monotone envelope: single points on a shared machine are noisy; more load never helps."""
            out, top = [], 0.0
            for p in points:
                top = max(top, float(p[key]))
                out.append(top)
            return tuple(out)

        return cls(
            tuple(p["concurrency"] for p in points),
            col("requests_per_s"),
            col("ttft_p50_s"),
            col("tpot_p50_s"),
            col("ttft_p90_s"),
            col("tpot_p90_s"),
            data["slo"]["ttft_s"],
            data["slo"]["tpot_s"],
        )

    def _at(self, values: tuple[float, ...], n: float) -> float:
        xs = self.concurrency
        if n <= xs[0]:
            return values[0]
        if n >= xs[-1]:
            return values[-1]
        i = bisect_left(xs, n)
        f = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return values[i - 1] + f * (values[i] - values[i - 1])

    def rate_per_request(self, n: float) -> float:
        return self._at(self.throughput, n) / max(n, 1)

    def ttft_at(self, n: int, z: float) -> float:
        """A request's TTFT at `n` in flight: lognormal through the measured p50 and p90, z its quantile."""
        return self._lognormal(self.ttft, self.ttft_p90, n, z)

    def tpot_at(self, n: int, z: float) -> float:
        return self._lognormal(self.tpot, self.tpot_p90, n, z)

    def _lognormal(self, p50s: tuple[float, ...], p90s: tuple[float, ...], n: float, z: float) -> float:
        p50, p90 = self._at(p50s, n), self._at(p90s, n)
        sigma = math.log(max(p90, p50) / p50) / 1.2816
        return p50 * math.exp(sigma * z)

    def share_within_slo(self, n: float) -> float:
        """Share of requests at `n` in flight that meet both targets, from the lognormals."""
        share = 1.0
        for p50s, p90s, slo in ((self.ttft, self.ttft_p90, self.slo_ttft), (self.tpot, self.tpot_p90, self.slo_tpot)):
            p50, p90 = self._at(p50s, n), self._at(p90s, n)
            sigma = max(math.log(max(p90, p50) / p50) / 1.2816, 1e-9)
            share *= 0.5 * (1 + math.erf(math.log(slo / p50) / (sigma * math.sqrt(2))))
        return share

    def capacity_point(self, target: float) -> tuple[float, float]:
        """(requests/s, requests in flight) at the most load one replica carries with `target` of requests
        inside both SLO targets: the measured capacity per replica."""
        best = (self._at(self.throughput, 1), 1.0)
        n = 1.0
        while n <= self.concurrency[-1]:
            if self.share_within_slo(n) >= target:
                best = max(best, (self._at(self.throughput, n), n))
            n += 0.25
        return best


@dataclass
class Request:
    arrival: float
    work: float  # 1.0 is a typical request
    z_ttft: float  # where this request falls in the latency distributions (standard normal)
    z_tpot: float
    started: float | None = None
    ttft: float = 0.0
    tpot_sum: float = 0.0
    steps: int = 0
    done: float = 0.0


@dataclass
class Replica:
    ready_at: float
    draining: bool = False
    queue: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)

    def load(self) -> int:
        return len(self.queue) + len(self.running)


def traces(base: float, duration: float, seed: int = 7) -> dict[str, Callable[[float], float]]:
    """Arrival rate (req/s) over time, in units of one replica's capacity `base`."""
    return {
        "steady": lambda t: 4 * base,
        "ramp": lambda t: base * (1 + 7 * min(1.0, t / (0.6 * duration))),
        "spike": lambda t: base * (6 if 0.4 * duration <= t < 0.4 * duration + 300 else 3),
        "diurnal": lambda t: base * (4.5 - 3.5 * math.cos(2 * math.pi * t / duration)),
        "bursty": mmpp(base, duration, seed),
        "flash": lambda t: base * flash_crowd(t, duration),
    }


def mmpp(
    base: float,
    duration: float,
    seed: int,
    rates: tuple[float, float] = (3.0, 5.0),
    holds: tuple[float, float] = (60.0, 30.0),
) -> Callable[[float], float]:
    """A Markov-modulated Poisson process's rate: a quiet and a busy state (`rates` × base), each held for an
    exponential time of mean `holds` seconds, switching at random; seeded, so every policy sees the same bursts."""
    rng = random.Random(seed * 7919 + 1)
    switches, t, state = [0.0], 0.0, 0
    states = [0]
    while t < duration:
        t += rng.expovariate(1 / holds[state])
        state = 1 - state
        switches.append(t)
        states.append(state)

    def rate(t: float) -> float:
        return base * rates[states[bisect_right(switches, t) - 1]]

    return rate


def flash_crowd(t: float, duration: float, start: float = 0.5, peak: float = 10.0) -> float:
    """One replica's capacity, then a crowd: ×`peak` within a minute, held five minutes, gone over ten."""
    t0 = start * duration
    if t < t0:
        return 1.0
    if t < t0 + 60:
        return 1 + (peak - 1) * (t - t0) / 60
    if t < t0 + 360:
        return peak
    return max(1.0, peak - (peak - 1) * (t - t0 - 360) / 600)


def arrivals(rate: Callable[[float], float], duration: float, seed: int) -> list[float]:
    """A Poisson process of time-varying rate, by thinning."""
    rng = random.Random(seed)
    peak = max(rate(i * duration / 1000) for i in range(1001))
    t, out = 0.0, list[float]()
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() < rate(t) / peak:
            out.append(t)


class Service:
    def __init__(self, curve: Curve, replicas: int, startup: float, max_num_seqs: int) -> None:
        self.curve, self.startup, self.max_num_seqs = curve, startup, max_num_seqs
        self.replicas = [Replica(ready_at=0.0) for _ in range(replicas)]
        self.draining: list[Replica] = []  # removed from routing, finishing what they hold (SIGTERM drain)
        self.finished: list[tuple[float, bool, float, float]] = []  # (time, good, ttft, tpot)

    def ready(self, now: float) -> list[Replica]:
        return [r for r in self.replicas if r.ready_at <= now]

    def scale_to(self, n: int, now: float) -> None:
        while len(self.replicas) < n:
            self.replicas.append(Replica(ready_at=now + self.startup))
        while len(self.replicas) > n:
            # starting pods go first, then the least loaded ready one
            victim = min(self.replicas, key=lambda r: (r.ready_at <= now, r.load()))
            self.replicas.remove(victim)
            if victim.ready_at <= now and victim.load():
                victim.draining = True
                self.draining.append(victim)

    def route(self, req: Request, now: float) -> None:
        ready = self.ready(now) or self.replicas
        min(ready, key=Replica.load).queue.append(req)

    def step(self, now: float) -> None:
        c = self.curve
        for rep in [*self.ready(now), *self.draining]:
            while rep.queue and len(rep.running) < self.max_num_seqs:
                req = rep.queue.popleft()
                req.started = now
                req.ttft = now - req.arrival + c.ttft_at(len(rep.running) + 1, req.z_ttft)
                rep.running.append(req)
            n = len(rep.running)
            if not n:
                continue
            progress = c.rate_per_request(n) * DT
            still = []
            for req in rep.running:
                req.done += progress / req.work
                req.tpot_sum += c.tpot_at(n, req.z_tpot)
                req.steps += 1
                if req.done >= 1.0:
                    mean_tpot = req.tpot_sum / req.steps
                    good = req.ttft <= c.slo_ttft and mean_tpot <= c.slo_tpot
                    self.finished.append((now, good, req.ttft, mean_tpot))
                else:
                    still.append(req)
            rep.running = still
        self.draining = [r for r in self.draining if r.load()]

    def replica_count(self) -> int:
        return len(self.replicas) + len(self.draining)
