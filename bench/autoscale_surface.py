"""What N static replicas of the simulated service attain at a steady load, and the simulator's two
yardsticks, which size with that surface knowing the capacity and the trace's true rate exactly.

Used by bench/autoscale_sim.py (`--surface`, and the yardsticks in `--grid`).
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from bench.autoscale_model import DT, Curve, Request, Service, arrivals


def static_attainment(
    curve: Curve,
    replicas: int,
    load: float,
    seed: int,
    duration: float = 3600.0,
    target: float = 0.95,
    max_num_seqs: int = 8,
    warmup: float = 300.0,
) -> float:
    """SLO attainment of a fixed `replicas` at a steady Poisson load of `load` × the measured capacity per
    replica each, requests finished after `warmup`: the surface any sizing rule has to fit."""
    base = curve.capacity_point(target)[0]
    times = arrivals(lambda t: load * replicas * base, duration, seed)
    svc, rng, i, now = Service(curve, replicas, 0.0, max_num_seqs), random.Random(seed + 1), 0, 0.0
    while now < duration or any(r.load() for r in svc.replicas):
        while i < len(times) and times[i] <= now:
            svc.route(Request(times[i], rng.uniform(0.5, 1.5), rng.gauss(0, 1), rng.gauss(0, 1)), now)
            i += 1
        svc.step(now)
        now += DT
    done = [f[1] for f in svc.finished if f[0] > warmup]
    return sum(done) / max(1, len(done))


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
def load_limits(target: float, max_num_seqs: int = 8) -> tuple[tuple[int, float], ...]:
    """(N, the most load per replica, in units of the measured capacity, at which N static replicas meet
    `target` + YARDSTICK_MARGIN): the --surface read the other way, by bisection on two seeds of 30 minutes.
    The yardstick policies size with it, knowing the capacity exactly rather than learning it."""
    curve = Curve.load()
    limits = []
    for n in (1, 2, 3, 4, 6, 9, 12, 16, 20):
        low, high = 0.3, 1.3
        for _ in range(7):
            mid = (low + high) / 2
            met = min(
                static_attainment(curve, n, mid, seed, duration=1800.0, target=target, max_num_seqs=max_num_seqs)
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
) -> Callable[..., int]:
    """Not policies anyone can run, but bounds to read the others against. Both know the capacity exactly
    (load_limits) and the trace's true rate, so no Poisson noise and no learning:
    `clairvoyant` sizes for the highest rate until a pod asked for now would be ready (it sees the future);
    `reactive-bound` for the rate now (the best a policy seeing only the present can do at its cost)."""
    limits = load_limits(target, max_num_seqs)
    horizon = startup + period if ahead else 0.0

    def law(svc: Service, now: float, arrived: object) -> int:
        steps = max(1, int(horizon // period))
        rate = max(trace(now + horizon * i / steps) for i in range(steps + 1)) if ahead else trace(now)
        return max(low, replicas_for(rate, base, limits, high))

    return law
