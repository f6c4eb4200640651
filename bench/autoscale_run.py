"""One simulated run: a policy or yardstick scaling a service through a trace, and every policy on
every trace."""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable

from bench.autoscale_model import BURST_TRACES, DT, TRACE_SIZES, Curve, Replica, Request, Service, arrivals, traces
from bench.autoscale_policies import PERIOD, WINDOW, goodput_policy, hpa_policy
from bench.autoscale_surface import Sizes, work_sampler, yardstick_policy

SETTLED = 600.0  # attainment_settled: requests that arrived after this many seconds (learning done, counts kept)


def peak_minute(times: list[float]) -> float:
    """The busiest minute's arrival rate: what provisioning from observed traffic sizes for."""
    counts: dict[int, int] = {}
    for t in times:
        counts[int(t // 60)] = counts.get(int(t // 60), 0) + 1
    return max(counts.values()) / 60.0


def run(
    curve: Curve,
    trace: Callable[[float], float],
    duration: float,
    policy: str,
    startup: float,
    seed: int,
    low: int,
    high: int,
    target: float,
    max_num_seqs: int,
    replay: tuple[list[float], list[float]] | None = None,
    sizes: str = "uniform",
    process: str = "poisson",
    admission: bool = False,
) -> dict:
    """One policy on one trace. `replay`: recorded arrival times and each request's work instead; `sizes`:
    the request size mix otherwise (autoscale_model.size_sampler)."""
    times = replay[0] if replay else arrivals(trace, duration, seed)
    works = replay[1] if replay else None
    draw = work_sampler(sizes, seed) if not replay else None
    yardstick_sizes: Sizes = tuple(works) if works else sizes
    base, concurrency = curve.capacity_point(target)
    static = min(high, math.ceil(peak_minute(times) / (base * 0.8)))
    start = max(low, math.ceil(trace(0) / (base * 0.8)))
    svc = Service(curve, static if policy == "static-peak" else start, startup, max_num_seqs, admission)
    laws = {
        "goodput": lambda: goodput_policy(curve, low, high, target, base, startup),
        "goodput-no-hint": lambda: goodput_policy(curve, low, high, target, None, startup),
        "goodput-poisson": lambda: goodput_policy(curve, low, high, target, None, startup, dispersion=False),
        "queue-hpa": lambda: hpa_policy(low, high, 2.0, lambda r: len(r.queue)),
        "concurrency-hpa": lambda: hpa_policy(low, high, concurrency, Replica.load),
        "clairvoyant": lambda: yardstick_policy(
            trace, base, startup, target, low, high, max_num_seqs, True, PERIOD, yardstick_sizes, process
        ),
        "reactive-bound": lambda: yardstick_policy(
            trace, base, startup, target, low, high, max_num_seqs, False, PERIOD, yardstick_sizes, process
        ),
    }
    law = laws[policy]() if policy in laws else None
    rng = random.Random(seed + 1)
    arrived: deque[float] = deque()
    timeline, i, now, replica_seconds, next_control = [], 0, 0.0, 0.0, PERIOD
    while now < duration or any(r.load() for r in [*svc.replicas, *svc.draining]):
        while i < len(times) and times[i] <= now:
            work = works[i] if works else (draw() if draw else rng.uniform(0.5, 1.5))
            svc.route(Request(times[i], work, rng.gauss(0, 1), rng.gauss(0, 1)), now)
            arrived.append(times[i])
            i += 1
        while arrived and arrived[0] < now - WINDOW:
            arrived.popleft()
        svc.step(now)
        if law is not None and now >= next_control and now < duration:
            svc.scale_to(law(svc, now, arrived), now)
            next_control += PERIOD
        if now < duration:
            replica_seconds += svc.replica_count() * DT
            if int(now / DT) % int(PERIOD / DT) == 0:
                recent = [f[1] for f in svc.finished[-3000:] if f[0] > now - WINDOW]
                timeline.append(
                    (
                        now,
                        trace(now),
                        len(svc.replicas),
                        len(svc.ready(now)),
                        sum(recent) / len(recent) if recent else None,
                    )
                )
        now += DT
        if now > duration * 2:
            break
    good = sum(f[1] for f in svc.finished)
    settled = [f[1] for f in svc.finished if f[0] - f[4] >= SETTLED] + [False for t in svc.refused if t >= SETTLED]
    return {
        "attainment": good / max(1, len(times)),
        "attainment_settled": sum(settled) / max(1, len(settled)),
        "replica_seconds": replica_seconds,
        "requests": len(times),
        "refused": len(svc.refused),
        "timeline": timeline,
    }


POLICIES = ("goodput", "goodput-no-hint", "queue-hpa", "concurrency-hpa", "static-peak")
YARDSTICKS = ("clairvoyant", "reactive-bound")
# the law without a hint with the arrivals' dispersion never read: the law as it was before it measured burstiness
POISSON_LAW = "goodput-poisson"


def simulate(
    duration: float = 3600.0,
    startup: float = 60.0,
    seed: int = 7,
    target: float = 0.95,
    low: int = 1,
    high: int = 20,
    curve: Curve | None = None,
    max_num_seqs: int = 8,
    policies: tuple[str, ...] = POLICIES,
    names: tuple[str, ...] | None = None,
    admission: bool = False,
) -> dict[str, dict[str, dict]]:
    """Every policy on every trace (or those `names`), each with its own size mix and, for the yardsticks,
    its own arrival process."""
    curve = curve or Curve.load()
    out: dict[str, dict[str, dict]] = {}
    for name in names or tuple(traces(curve.capacity_point(target)[0], duration, seed)):
        out[name] = {
            p: trace_run(curve, name, duration, p, startup, seed, target, max_num_seqs, low, high, admission)
            for p in policies
        }
    return out


def trace_run(
    curve: Curve,
    name: str,
    duration: float,
    policy: str,
    startup: float,
    seed: int,
    target: float = 0.95,
    max_num_seqs: int = 8,
    low: int = 1,
    high: int = 20,
    admission: bool = False,
) -> dict:
    """One policy on the named trace, with the trace's size mix (TRACE_SIZES) and arrival process (the burst
    traces' yardsticks know theirs)."""
    trace = traces(curve.capacity_point(target)[0], duration, seed)[name]
    process = "burst" if name in BURST_TRACES else "poisson"
    sizes = TRACE_SIZES.get(name, "uniform")
    return run(
        curve,
        trace,
        duration,
        policy,
        startup,
        seed,
        low,
        high,
        target,
        max_num_seqs,
        sizes=sizes,
        process=process,
        admission=admission,
    )
