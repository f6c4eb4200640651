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
    """Arrival rate (req/s) over time, in units of one replica's capacity `base`: the grid's six Poisson
    traces, then the over-dispersed ones (BURST_TRACES) and those with heavy-tailed request sizes
    (TRACE_SIZES)."""
    return {
        "steady": lambda t: 4 * base,
        "ramp": lambda t: base * (1 + 7 * min(1.0, t / (0.6 * duration))),
        "spike": lambda t: base * (6 if 0.4 * duration <= t < 0.4 * duration + 300 else 3),
        "diurnal": lambda t: base * (4.5 - 3.5 * math.cos(2 * math.pi * t / duration)),
        "bursty": mmpp(base, duration, seed),
        "flash": lambda t: base * flash_crowd(t, duration),
        "burst": bursts(base, duration, seed),
        "heavy": lambda t: base * (4.5 - 3.5 * math.cos(2 * math.pi * t / duration)),
        "burst-heavy": bursts(base, duration, seed),
    }


POISSON_TRACES = ("steady", "ramp", "spike", "diurnal", "bursty", "flash")
BURST_TRACES = ("burst", "burst-heavy")  # sub-minute bursts: over-dispersed counts at the control period's scale
TRACE_SIZES = {"heavy": "lognormal", "burst-heavy": "lognormal"}  # every other trace: "uniform"
# the burst traces: a Poisson background at BURST_BASE x the capacity, and bursts arriving as a Poisson
# process (one every BURST_EVERY seconds on average) that each add BURST_HEIGHT x the capacity for a
# duration uniform in BURST_SPAN seconds: a Poisson cluster process (compound Poisson in bursts), its
# counts over-dispersed at every scale from a few seconds up (index of dispersion: bench/README.md)
BURST_BASE, BURST_HEIGHT, BURST_EVERY, BURST_SPAN = 3.0, 4.0, 60.0, (5.0, 30.0)


def bursts(
    base: float,
    duration: float,
    seed: int,
    background: float = BURST_BASE,
    height: float = BURST_HEIGHT,
    every: float = BURST_EVERY,
    span: tuple[float, float] = BURST_SPAN,
) -> Callable[[float], float]:
    """The rate of a Poisson cluster process: `background` x base, plus `height` x base during each burst;
    bursts start as a Poisson process of mean gap `every` seconds and last uniform(`span`) seconds (they
    may overlap). Seeded, so every policy sees the same bursts; the rate function itself is what the
    yardsticks know."""
    rng = random.Random(seed * 104729 + 3)
    edges: list[tuple[float, int]] = []
    t = rng.expovariate(1 / every)
    while t < duration:
        edges += [(t, 1), (t + rng.uniform(*span), -1)]
        t += rng.expovariate(1 / every)
    edges.sort()
    times, levels, active = [0.0], [0], 0
    for at, step in edges:
        active += step
        times.append(at)
        levels.append(active)

    def rate(t: float) -> float:
        return base * (background + height * levels[bisect_right(times, t) - 1])

    rate.peak = base * (background + height * max(levels))  # type: ignore[attr-defined]
    return rate


# request sizes, in units of the mean request's work (decode tokens plus an eighth of the prompt's, as a
# replayed log's are). uniform: ±50 %, the grid's. lognormal: prompt and output tokens drawn from
# lognormals (medians and sigmas below, capped at 32k and 8k tokens), a heavy tail
# in the manner of recorded chat traffic: squared coefficient of variation of the work about 1.4
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_CAP = 1000.0, 1.0, 32768.0
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CAP = 150.0, 1.2, 8192.0


def lognormal_tokens(rng: random.Random) -> tuple[float, float]:
    """(prompt tokens, output tokens) of one request of the heavy-tailed mix."""
    prompt = min(PROMPT_CAP, PROMPT_MEDIAN * math.exp(rng.gauss(0, PROMPT_SIGMA)))
    output = min(OUTPUT_CAP, OUTPUT_MEDIAN * math.exp(rng.gauss(0, OUTPUT_SIGMA)))
    return round(prompt), max(1, round(output))


def _lognormal_mean_work() -> float:
    rng = random.Random(12345)
    works = [o + p / 8 for p, o in (lognormal_tokens(rng) for _ in range(200_000))]
    return sum(works) / len(works)


LOGNORMAL_MEAN_WORK = _lognormal_mean_work()


def size_sampler(mix: str, seed: int) -> Callable[[], float]:
    """Each request's work, in units of the mix's mean: `uniform` (the grid's ±50 %) or `lognormal`."""
    rng = random.Random(seed)
    if mix == "uniform":
        return lambda: rng.uniform(0.5, 1.5)
    if mix == "lognormal":

        def draw() -> float:
            prompt, output = lognormal_tokens(rng)
            return (output + prompt / 8) / LOGNORMAL_MEAN_WORK

        return draw
    raise ValueError(f"unknown size mix {mix!r}")


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
    peak = getattr(rate, "peak", None) or max(rate(i * duration / 1000) for i in range(1001))
    t, out = 0.0, list[float]()
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            return out
        if rng.random() < rate(t) / peak:
            out.append(t)


ADMISSION_MARGIN = 0.1  # the runtime's: refused when a prediction passes target × (1 − margin)


class Service:
    def __init__(self, curve: Curve, replicas: int, startup: float, max_num_seqs: int, admission: bool = False) -> None:
        self.curve, self.startup, self.max_num_seqs = curve, startup, max_num_seqs
        self.admission = admission
        self.replicas = [Replica(ready_at=0.0) for _ in range(replicas)]
        self.draining: list[Replica] = []  # removed from routing, finishing what they hold (SIGTERM drain)
        self.finished: list[tuple[float, bool, float, float, float]] = []  # (time, good, ttft, tpot, e2e)
        self.refused: list[float] = []  # when admission answered 429: a miss, and demand all the same

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
        replica = min(ready, key=Replica.load)
        if self.admission and replica.ready_at <= now and not self.admits(replica):
            self.refused.append(now)
            return
        replica.queue.append(req)

    def admits(self, replica: Replica) -> bool:
        """The runtime's SLO-aware admission (server/admission.py) on the curve: a newcomer is refused when
        the running decodes' TPOT with it, or its own TTFT (the wait for a seat at the measured throughput,
        then the TTFT at that batch), would pass its target less the margin."""
        c, keep = self.curve, 1.0 - ADMISSION_MARGIN
        in_flight = min(replica.load() + 1, self.max_num_seqs)
        if c._at(c.tpot, in_flight) > c.slo_tpot * keep:
            return False
        ahead = max(0, replica.load() + 1 - self.max_num_seqs)  # requests that must finish before it is seated
        wait = ahead / c._at(c.throughput, self.max_num_seqs)
        return wait + c._at(c.ttft, in_flight) <= c.slo_ttft * keep

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
                    self.finished.append((now, good, req.ttft, mean_tpot, now - req.arrival))
                else:
                    still.append(req)
            rep.running = still
        self.draining = [r for r in self.draining if r.load()]

    def replica_count(self) -> int:
        return len(self.replicas) + len(self.draining)


def write_trace(name: str, path: Path, duration: float = 3600.0, seed: int = 7, base: float | None = None) -> int:
    """A trace's arrivals and request sizes in the replay format (`timestamp,prompt_tokens,output_tokens`), so
    that `--replay` runs any policy on exactly these requests: the heavy-tailed mix's drawn tokens, or for the
    uniform mix 200 output tokens ±50 % and no prompt. Returns the number of rows."""
    base = base if base is not None else Curve.load().capacity_point(0.95)[0]
    times = arrivals(traces(base, duration, seed)[name], duration, seed)
    rng = random.Random(seed + 2)
    rows = ["timestamp,prompt_tokens,output_tokens"]
    for t in times:
        if TRACE_SIZES.get(name, "uniform") == "lognormal":
            prompt, output = lognormal_tokens(rng)
        else:
            prompt, output = 0, round(200 * rng.uniform(0.5, 1.5))
        rows.append(f"{t:.3f},{prompt},{output}")
    path.write_text("\n".join(rows) + "\n")
    return len(times)
