"""Trace-driven simulation of a Goodput service under five scaling policies and two yardsticks.

    python -m bench.autoscale_sim [--plots] [--startup 60] [--duration 3600]
    python -m bench.autoscale_sim --grid [--seeds 1-5]   # the law without a hint vs the concurrency HPA
    python -m bench.autoscale_sim --surface              # attainment of static counts against load
    python -m bench.autoscale_sim --replay log.csv       # every policy and both yardsticks on a recorded log
    python -m bench.autoscale_sim --write-trace burst burst.csv   # a trace in that log format

Replicas follow the capacity curve measured from our runtime (bench/autoscale_capacity.json:
throughput, TTFT and TPOT against concurrency) and become ready `--startup` seconds after
they are asked for. Arrivals are Poisson on six traces (steady, ramp, spike, diurnal, bursty,
flash), then over-dispersed on two (burst, burst-heavy: sub-minute bursts, autoscale_model.bursts),
request sizes ±50 % except on heavy and burst-heavy (lognormal prompt and output tokens), seeded.
The same traces go to:

- goodput: the operator's own law (goodput_operator.autoscaling.law.decide), every 15 s;
  goodput-no-hint: the same with no capacity per replica given; goodput-poisson: the same with the
  arrivals' dispersion never measured (the law as it was before it read burstiness);
- queue-hpa: a Kubernetes HPA on requests waiting per replica, target 2 (the queue-length
  signal KServe/KubeAI-style setups scale on), with the same HPA behaviour as below;
- concurrency-hpa: what KServe and KubeAI do, a Kubernetes HPA on requests in flight per
  replica, its target the concurrency at which one replica meets the SLO (10 % tolerance,
  scale-up max(4 pods, 100 %) per period, 300 s scale-down stabilisation);
- static-peak: the replicas the trace's peak needs at the same 80 % target utilisation.

Two yardsticks, bounds rather than policies (autoscale_surface.yardstick_policy): both know the capacity
exactly (from the static attainment surface, for the trace's size mix) and the trace's true rate;
`reactive-bound` sizes for the rate now, `clairvoyant` for the highest rate until a pod asked for now
would be ready. On the burst traces both run the static count that holds the target through the bursts;
on a replayed log they know its rate per minute and its request sizes.

Prints SLO attainment and replica-seconds per trace and policy; writes the table as JSON
(and PNGs with --plots) under bench/results/.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from collections.abc import Callable
from pathlib import Path

from bench.autoscale_grid import grid, grid_table, parse_seeds, targets_text
from bench.autoscale_model import (
    BURST_TRACES,
    DT,
    TRACE_SIZES,
    Curve,
    Replica,
    Request,
    Service,
    arrivals,
    traces,
    write_trace,
)
from bench.autoscale_report import plot, table
from bench.autoscale_surface import Sizes, surface_table, work_sampler, yardstick_policy
from goodput_operator.autoscaling.dispersion import DISPERSION_PERIODS, index_of_dispersion
from goodput_operator.autoscaling.law import decide
from goodput_operator.autoscaling.state import Observation, Policy, Signals, start_memory

RESULTS = Path(__file__).resolve().parent / "results"
PERIOD = 15.0  # control period of every autoscaler
WINDOW = 60.0  # metrics window the autoscalers read
SETTLED = 600.0  # attainment_settled: requests that arrived after this many seconds (learning done, counts kept)


def signals(
    svc: Service, now: float, arrived: deque[float], periods: deque[tuple[float, float]] | None = None
) -> Signals:
    """What the operator reads from the pods, here read off the simulated service. `periods`: the arrivals
    counted per control period so far (None: dispersion not measured, the law plans as for Poisson)."""
    recent = [f for f in svc.finished[-5000:] if f[0] > now - WINDOW]
    long_finished = [f for f in svc.finished[-20000:] if f[0] > now - 5 * WINDOW]
    long = [f[1] for f in long_finished]
    ttfts = sorted(f[2] for f in recent)
    tpots = sorted(f[3] for f in recent)
    ready = svc.ready(now)
    dispersion = index_of_dispersion(list(periods)) if periods is not None else None
    return Signals(
        arrival_rate=sum(1 for a in arrived if a > now - WINDOW) / min(WINDOW, max(now, DT)),
        arrival_rate_now=sum(1 for a in arrived if a > now - PERIOD) / min(PERIOD, max(now, DT)),
        attainment=sum(f[1] for f in recent) / len(recent) if recent else None,
        attainment_long=sum(long) / len(long) if long else None,
        finished_long=len(long),
        waiting=sum(len(r.queue) for r in ready),
        running=sum(len(r.running) for r in ready),
        ttft_p90=ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else None,
        tpot_p90=tpots[int(0.9 * (len(tpots) - 1))] if tpots else None,
        finished=len(recent),
        dispersion=dispersion.index if dispersion else None,
        peakedness=dispersion.peakedness if dispersion else 1.0,
        size_cv2=spread(long_finished),
    )


def spread(finished: list[tuple[float, bool, float, float, float]]) -> float | None:
    """Request sizes' squared coefficient of variation as the operator reads it (dispersion.size_spread):
    the variance of the time after the first token over its mean squared, here from exact moments."""
    if len(finished) < 30:
        return None

    def moments(xs: list[float]) -> tuple[float, float]:
        m = sum(xs) / len(xs)
        return m, sum((x - m) ** 2 for x in xs) / len(xs)

    (m1, v1), (m2, v2) = moments([f[4] for f in finished]), moments([f[2] for f in finished])
    return max(0.0, v1 - v2) / (m1 - m2) ** 2 if m1 > m2 else None


def goodput_policy(
    curve: Curve,
    low: int,
    high: int,
    target: float,
    capacity: float | None,
    startup: float = 60.0,
    dispersion: bool = True,
) -> Callable[..., int]:
    """The operator's law every PERIOD; `dispersion`: it measures the arrivals' index of dispersion from
    the counts per period, as the operator does (False: it is never read, and the law plans as for Poisson)."""
    policy = Policy(
        min_replicas=low,
        max_replicas=high,
        attainment_target=target,
        ttft_target=curve.slo_ttft,
        tpot_target=curve.slo_tpot,
        scale_down_window=120.0,
        startup_seconds=startup,
        window_seconds=WINDOW,
    )
    memory = start_memory(capacity)
    periods: deque[tuple[float, float]] = deque(maxlen=DISPERSION_PERIODS)

    def law(svc: Service, now: float, arrived: deque[float]) -> int:
        nonlocal memory
        periods.append((PERIOD, float(sum(1 for a in arrived if now - PERIOD < a <= now))))
        obs = Observation(
            now, len(svc.replicas), len(svc.ready(now)), signals(svc, now, arrived, periods if dispersion else None)
        )
        decision = decide(policy, obs, memory)
        memory = decision.memory
        return decision.desired

    return law


def hpa_policy(low: int, high: int, target: float, metric: Callable[[Replica], int]) -> Callable[..., int]:
    """A Kubernetes HPA (autoscaling/v2 behaviour) on a per-pod metric: 10 % tolerance, pods not ready
    counted as zero, scale-up max(4 pods, 100 %) per period, 300 s scale-down stabilisation."""
    history: deque[tuple[float, int]] = deque()

    def law(svc: Service, now: float, arrived: deque[float]) -> int:
        current = len(svc.replicas)
        total = sum(metric(r) for r in svc.ready(now))
        ratio = total / max(1, current) / target
        want = current if abs(ratio - 1) <= 0.1 else math.ceil(total / target)
        want = max(low, min(high, want))
        history.append((now, want))
        while history and history[0][0] < now - 300:
            history.popleft()
        if want > current:
            return min(want, current + max(4, current))
        return min(current, max(w for _, w in history))

    return law


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
    svc = Service(curve, static if policy == "static-peak" else start, startup, max_num_seqs)
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
    settled = [f[1] for f in svc.finished if f[0] - f[4] >= SETTLED]
    return {
        "attainment": good / max(1, len(times)),
        "attainment_settled": sum(settled) / max(1, len(settled)),
        "replica_seconds": replica_seconds,
        "requests": len(times),
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
) -> dict[str, dict[str, dict]]:
    """Every policy on every trace (or those `names`), each with its own size mix and, for the yardsticks,
    its own arrival process."""
    curve = curve or Curve.load()
    out: dict[str, dict[str, dict]] = {}
    for name in names or tuple(traces(curve.capacity_point(target)[0], duration, seed)):
        out[name] = {
            p: trace_run(curve, name, duration, p, startup, seed, target, max_num_seqs, low, high) for p in policies
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
) -> dict:
    """One policy on the named trace, with the trace's size mix (TRACE_SIZES) and arrival process (the burst
    traces' yardsticks know theirs)."""
    trace = traces(curve.capacity_point(target)[0], duration, seed)[name]
    process = "burst" if name in BURST_TRACES else "poisson"
    sizes = TRACE_SIZES.get(name, "uniform")
    return run(
        curve, trace, duration, policy, startup, seed, low, high, target, max_num_seqs, sizes=sizes, process=process
    )


def load_replay(path: Path) -> tuple[list[float], list[float], float]:
    """A recorded log: CSV rows `timestamp,prompt_tokens,output_tokens` (a header row is skipped; timestamps
    in seconds, any origin). Each request's work is its decode tokens plus an eighth of its prompt tokens
    (prefill runs batched, about that much cheaper per token), scaled so the log's mean request is 1.0."""
    rows = []
    for line in path.read_text().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0] or not parts[0].replace(".", "", 1).isdigit():
            continue
        rows.append((float(parts[0]), float(parts[1]), float(parts[2])))
    if not rows:
        raise SystemExit(f"{path}: no rows of timestamp,prompt_tokens,output_tokens")
    rows.sort()
    origin = rows[0][0]
    costs = [out + prompt / 8 for _, prompt, out in rows]
    mean = sum(costs) / len(costs) or 1.0
    times = [t - origin for t, _, _ in rows]
    return times, [c / mean for c in costs], times[-1] + 1.0


def replay_rate(times: list[float]) -> Callable[[float], float]:
    """The log's arrival rate per minute, as a step function (for the static and starting sizes)."""
    counts: dict[int, int] = {}
    for t in times:
        counts[int(t // 60)] = counts.get(int(t // 60), 0) + 1
    return lambda t: counts.get(int(t // 60), 0) / 60.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds per trace")
    parser.add_argument("--startup", type=float, default=60.0, help="seconds from asking for a pod to it serving")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="the engine's running-sequence cap per replica")
    parser.add_argument("--plots", action="store_true", help="PNG per trace (needs matplotlib)")
    parser.add_argument(
        "--grid",
        action="store_true",
        help="every trace at start-ups 60 and 180 s, seeds 1-5: the law against the concurrency HPA",
    )
    parser.add_argument(
        "--seeds",
        default="1-5",
        type=parse_seeds,
        help="the grid's seeds, `1-20` or `1,3,8`; only the default 1-5 writes autoscale-grid.json",
    )
    parser.add_argument(
        "--surface",
        action="store_true",
        help="attainment of static replica counts against the load per replica (seeds 1-3)",
    )
    parser.add_argument(
        "--replay",
        type=Path,
        help="CSV of timestamp,prompt_tokens,output_tokens: run every policy and both yardsticks on that log",
    )
    parser.add_argument(
        "--write-trace",
        nargs=2,
        metavar=("TRACE", "CSV"),
        help="write a trace's arrivals and request sizes (seed --seed) in the replay format",
    )
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.grid:
        rows = grid(args.seeds, [60.0, 180.0], args.duration, max_num_seqs=args.max_num_seqs)
        print(grid_table(rows))
        print(targets_text(rows))
        if args.seeds == [1, 2, 3, 4, 5]:
            (RESULTS / "autoscale-grid.json").write_text(json.dumps(rows, indent=2))
        return
    if args.write_trace:
        name, path = args.write_trace
        write_trace(name, Path(path), args.duration, args.seed)
        print(f"wrote {path}")
        return
    if args.surface:
        print(
            surface_table(
                [1, 2, 3, 4, 6, 9, 12, 16], [0.7, 0.8, 0.85, 0.9, 0.95, 1.0, 1.1], [1, 2, 3], args.max_num_seqs
            )
        )
        return
    if args.replay:
        curve = Curve.load()
        times, works, duration = load_replay(args.replay)
        rate = replay_rate(times)
        replayed = {
            args.replay.stem: {
                p: run(
                    curve,
                    rate,
                    duration,
                    p,
                    args.startup,
                    args.seed,
                    1,
                    20,
                    0.95,
                    args.max_num_seqs,
                    replay=(times, works),
                )
                for p in (*POLICIES, POISSON_LAW, *YARDSTICKS)
            }
        }
        print(table(replayed))
        return
    results = simulate(
        args.duration, args.startup, args.seed, max_num_seqs=args.max_num_seqs, policies=(*POLICIES, POISSON_LAW)
    )
    print(table(results))
    summary = {
        t: {p: {k: v for k, v in r.items() if k != "timeline"} for p, r in by.items()} for t, by in results.items()
    }
    (RESULTS / "autoscale-sim.json").write_text(json.dumps(summary, indent=2))
    if args.plots:
        for path in plot(results, RESULTS):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
