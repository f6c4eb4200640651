"""What N static replicas of the simulated service attain at a steady load, and the simulator's two
yardsticks, which size with that surface knowing the capacity and the trace's true rate exactly.

Used by bench/autoscale_sim.py (`--surface`, and the yardsticks in `--grid`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
from collections.abc import Callable
from pathlib import Path

from bench import autoscale_model
from bench.autoscale_model import CURVE, DT, Curve, Request, Service, arrivals, bursts, size_sampler

Sizes = str | tuple[float, ...]  # a size mix by name (autoscale_model.size_sampler), or a log's works to resample


def work_sampler(sizes: Sizes, seed: int) -> Callable[[], float] | None:
    """Each request's work: None for the grid's uniform ±50 % (drawn from the run's own generator, as
    before), a named mix's sampler, or a draw with replacement from a replayed log's works."""
    if sizes == "uniform":
        return None
    if isinstance(sizes, str):
        return size_sampler(sizes, seed + 2)
    rng = random.Random(seed + 2)
    return lambda: rng.choice(sizes)


def static_attainment(
    curve: Curve,
    replicas: int,
    load: float,
    seed: int,
    duration: float = 3600.0,
    target: float = 0.95,
    max_num_seqs: int = 8,
    warmup: float = 300.0,
    sizes: Sizes = "uniform",
) -> float:
    """SLO attainment of a fixed `replicas` at a steady Poisson load of `load` × the measured capacity per
    replica each, requests finished after `warmup`: the surface any sizing rule has to fit. `sizes`: the
    request size mix (the capacity unit stays the uniform mix's)."""
    base = curve.capacity_point(target)[0]
    times = arrivals(lambda t: load * replicas * base, duration, seed)
    svc, rng, i, now = Service(curve, replicas, 0.0, max_num_seqs), random.Random(seed + 1), 0, 0.0
    draw = work_sampler(sizes, seed)
    while now < duration or any(r.load() for r in svc.replicas):
        while i < len(times) and times[i] <= now:
            work = draw() if draw else rng.uniform(0.5, 1.5)
            svc.route(Request(times[i], work, rng.gauss(0, 1), rng.gauss(0, 1)), now)
            i += 1
        svc.step(now)
        now += DT
    done = [f[1] for f in svc.finished if f[0] > warmup]
    return sum(done) / max(1, len(done))


def static_burst_attainment(
    curve: Curve,
    replicas: int,
    seed: int,
    duration: float = 3600.0,
    max_num_seqs: int = 8,
    warmup: float = 300.0,
    sizes: Sizes = "uniform",
) -> float:
    """SLO attainment of a fixed `replicas` on the burst traces' arrival process (autoscale_model.bursts:
    a Poisson background and bursts of 5-30 s), requests finished after `warmup`."""
    base = curve.capacity_point(0.95)[0]
    times = arrivals(bursts(base, duration, seed), duration, seed)
    svc, rng, i, now = Service(curve, replicas, 0.0, max_num_seqs), random.Random(seed + 1), 0, 0.0
    draw = work_sampler(sizes, seed)
    while now < duration or any(r.load() for r in svc.replicas):
        while i < len(times) and times[i] <= now:
            work = draw() if draw else rng.uniform(0.5, 1.5)
            svc.route(Request(times[i], work, rng.gauss(0, 1), rng.gauss(0, 1)), now)
            i += 1
        svc.step(now)
        now += DT
    done = [f[1] for f in svc.finished if f[0] > warmup]
    return sum(done) / max(1, len(done))


@functools.cache
def burst_replicas(target: float, max_num_seqs: int = 8, sizes: Sizes = "uniform", high: int = 20) -> int:
    """The fewest static replicas that meet `target` + YARDSTICK_MARGIN on the burst process (an hour on each
    of two seeds the grid does not use): what the yardsticks run on a burst trace, whose mean rate is
    constant. Knowing the present, or the future rate, adds nothing there: each burst is over before a pod
    asked for at its start is ready, as Poisson noise is, so the best either bound can do is the count that
    holds the target through the bursts, known exactly."""
    curve = Curve.load()
    for n in range(1, high + 1):
        if min(
            static_burst_attainment(curve, n, seed, max_num_seqs=max_num_seqs, sizes=sizes) for seed in (101, 102)
        ) >= (target + YARDSTICK_MARGIN):
            return n
    return high


def surface_table(replicas: list[int], loads: list[float], seeds: list[int], max_num_seqs: int = 8) -> str:
    """Attainment (mean over seeds) of N static replicas against the load per replica, in units of the
    measured capacity: where each N meets the target, to compare with the law's planned(N)."""
    curve = Curve.load()
    lines = ["replicas " + " ".join(f"{x:>6.2f}" for x in loads)]
    for n in replicas:
        cells = [
            sum(static_attainment(curve, n, x, s, max_num_seqs=max_num_seqs) for s in seeds) / len(seeds) for x in loads
        ]
        lines.append(f"{n:>8d} " + " ".join(f"{a:>6.3f}" for a in cells))
    return "\n".join(lines)


YARDSTICK_MARGIN = 0.005  # the yardsticks size for static attainment this far above the target


@functools.cache
def load_limits(target: float, max_num_seqs: int = 8, sizes: Sizes = "uniform") -> tuple[tuple[int, float], ...]:
    """(N, the most load per replica, in units of the measured capacity, at which N static replicas meet
    `target` + YARDSTICK_MARGIN): the --surface read the other way, by bisection on two seeds of 30 minutes.
    The yardstick policies size with it, knowing the capacity exactly rather than learning it: the
    capacity for the trace's own size mix (`sizes`), under Poisson arrivals at the rate they are told.
    Half a minute of simulation on 2 cores, so kept on disk, keyed by the arguments, the curve and this
    simulator's source: any change to them computes it again."""
    key = hashlib.sha256(
        json.dumps([target, max_num_seqs, sizes]).encode()
        + CURVE.read_bytes()
        + Path(autoscale_model.__file__).read_bytes()
        + Path(__file__).read_bytes()
    ).hexdigest()[:16]
    cached = LIMITS_CACHE / f"{key}.json"
    if cached.exists():
        return tuple((int(n), float(x)) for n, x in json.loads(cached.read_text()))
    limits = _bisect_limits(target, max_num_seqs, sizes)
    cached.parent.mkdir(parents=True, exist_ok=True)
    tmp = cached.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(limits))
    tmp.replace(cached)
    return limits


LIMITS_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "goodput" / "autoscale-limits"


def _bisect_limits(target: float, max_num_seqs: int, sizes: Sizes) -> tuple[tuple[int, float], ...]:
    curve = Curve.load()
    limits = []
    for n in (1, 2, 3, 4, 6, 9, 12, 16, 20):
        low, high = 0.3, 1.3
        for _ in range(7):
            mid = (low + high) / 2
            met = min(
                static_attainment(
                    curve, n, mid, seed, duration=1800.0, target=target, max_num_seqs=max_num_seqs, sizes=sizes
                )
                for seed in (1, 2)
            )
            low, high = (mid, high) if met >= target + YARDSTICK_MARGIN else (low, mid)
        limits.append((n, low))
    return tuple(limits)


def replicas_for(rate: float, base: float, limits: tuple[tuple[int, float], ...], high: int) -> int:
    """The fewest replicas whose load per replica stays within the static limit (interpolated in N)."""
    for n in range(1, high + 1):
        below = max((x for x in limits if x[0] <= n), default=limits[0])
        above = min((x for x in limits if x[0] >= n), default=limits[-1])
        share = (
            below[1]
            if above[0] == below[0]
            else (below[1] + (above[1] - below[1]) * (n - below[0]) / (above[0] - below[0]))
        )
        if rate <= n * base * share:
            return n
    return high


def yardstick_policy(
    trace: Callable[[float], float],
    base: float,
    startup: float,
    target: float,
    low: int,
    high: int,
    max_num_seqs: int,
    ahead: bool,
    period: float,
    sizes: Sizes = "uniform",
    process: str = "poisson",
) -> Callable[..., int]:
    """Not policies anyone can run, but bounds to read the others against. Both know the capacity exactly
    (load_limits, for the trace's size mix) and the trace's true rate, so no Poisson noise and no learning
    (on a replayed log, its rate per minute and its own request sizes):
    `clairvoyant` sizes for the highest rate until a pod asked for now would be ready (it sees the future);
    `reactive-bound` for the rate now (the best a policy seeing only the present can do at its cost).
    On a burst trace (`process` "burst") both run the count burst_replicas finds, all the time."""
    if process == "burst":
        fixed = max(low, min(high, burst_replicas(target, max_num_seqs, sizes)))
        return lambda svc, now, arrived: fixed
    limits = load_limits(target, max_num_seqs, sizes)
    horizon = startup + period if ahead else 0.0

    def law(svc: Service, now: float, arrived: object) -> int:
        steps = max(1, int(horizon // period))
        rate = max(trace(now + horizon * i / steps) for i in range(steps + 1)) if ahead else trace(now)
        return max(low, replicas_for(rate, base, limits, high))

    return law
