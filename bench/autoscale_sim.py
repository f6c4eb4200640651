"""Trace-driven simulation of a Goodput service under five scaling policies.

    python -m bench.autoscale_sim [--plots] [--startup 60] [--duration 3600]
    python -m bench.autoscale_sim --grid [--seeds 1-5]   # the law without a hint vs the concurrency HPA
    python -m bench.autoscale_sim --surface              # attainment of static counts against load

Replicas follow the capacity curve measured from our runtime (bench/autoscale_capacity.json:
throughput, TTFT and TPOT against concurrency) and become ready `--startup` seconds after
they are asked for. Arrivals are Poisson on six traces (steady, ramp, spike, diurnal, bursty,
flash), seeded. The same traces go to:

- goodput: the operator's own law (goodput_operator.autoscaling.law.decide), every 15 s;
  goodput-no-hint: the same with no capacity per replica given;
- queue-hpa: a Kubernetes HPA on requests waiting per replica, target 2 (the queue-length
  signal KServe/KubeAI-style setups scale on), with the same HPA behaviour as below;
- concurrency-hpa: what KServe and KubeAI do, a Kubernetes HPA on requests in flight per
  replica, its target the concurrency at which one replica meets the SLO (10 % tolerance,
  scale-up max(4 pods, 100 %) per period, 300 s scale-down stabilisation);
- static-peak: the replicas the trace's peak needs at the same 80 % target utilisation.

--grid adds two yardsticks, bounds rather than policies: both know the capacity exactly (from the
static attainment surface) and the trace's true rate; `reactive-bound` sizes for the rate now,
`clairvoyant` for the highest rate until a pod asked for now would be ready.

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

from bench.autoscale_model import DT, Curve, Replica, Request, Service, arrivals, traces
from bench.autoscale_surface import surface_table, yardstick_policy
from goodput_operator.autoscaling.law import decide
from goodput_operator.autoscaling.state import Observation, Policy, Signals, start_memory

RESULTS = Path(__file__).resolve().parent / "results"
PERIOD = 15.0  # control period of every autoscaler
WINDOW = 60.0  # metrics window the autoscalers read


def signals(svc: Service, now: float, arrived: deque[float]) -> Signals:
    recent = [f for f in svc.finished[-5000:] if f[0] > now - WINDOW]
    long = [f[1] for f in svc.finished[-20000:] if f[0] > now - 5 * WINDOW]
    ttfts = sorted(f[2] for f in recent)
    tpots = sorted(f[3] for f in recent)
    ready = svc.ready(now)
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
    )


def goodput_policy(
    curve: Curve, low: int, high: int, target: float, capacity: float | None, startup: float = 60.0
) -> Callable[..., int]:
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

    def law(svc: Service, now: float, arrived: deque[float]) -> int:
        nonlocal memory
        obs = Observation(now, len(svc.replicas), len(svc.ready(now)), signals(svc, now, arrived))
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
) -> dict:
    """One policy on one trace. `replay`: recorded arrival times and each request's work instead."""
    times = replay[0] if replay else arrivals(trace, duration, seed)
    works = replay[1] if replay else None
    base, concurrency = curve.capacity_point(target)
    static = min(high, math.ceil(peak_minute(times) / (base * 0.8)))
    start = max(low, math.ceil(trace(0) / (base * 0.8)))
    svc = Service(curve, static if policy == "static-peak" else start, startup, max_num_seqs)
    laws = {
        "goodput": lambda: goodput_policy(curve, low, high, target, base, startup),
        "goodput-no-hint": lambda: goodput_policy(curve, low, high, target, None, startup),
        "queue-hpa": lambda: hpa_policy(low, high, 2.0, lambda r: len(r.queue)),
        "concurrency-hpa": lambda: hpa_policy(low, high, concurrency, Replica.load),
        "clairvoyant": lambda: yardstick_policy(trace, base, startup, target, low, high, max_num_seqs, True, PERIOD),
        "reactive-bound": lambda: yardstick_policy(
            trace, base, startup, target, low, high, max_num_seqs, False, PERIOD
        ),
    }
    law = laws[policy]() if policy in laws else None
    rng = random.Random(seed + 1)
    arrived: deque[float] = deque()
    timeline, i, now, replica_seconds, next_control = [], 0, 0.0, 0.0, PERIOD
    while now < duration or any(r.load() for r in [*svc.replicas, *svc.draining]):
        while i < len(times) and times[i] <= now:
            work = works[i] if works else rng.uniform(0.5, 1.5)
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
    return {
        "attainment": good / max(1, len(times)),
        "replica_seconds": replica_seconds,
        "requests": len(times),
        "timeline": timeline,
    }


POLICIES = ("goodput", "goodput-no-hint", "queue-hpa", "concurrency-hpa", "static-peak")
YARDSTICKS = ("clairvoyant", "reactive-bound")


def simulate(
    duration: float = 3600.0,
    startup: float = 60.0,
    seed: int = 7,
    target: float = 0.95,
    low: int = 1,
    high: int = 20,
    curve: Curve | None = None,
    max_num_seqs: int = 8,
) -> dict[str, dict[str, dict]]:
    curve = curve or Curve.load()
    out: dict[str, dict[str, dict]] = {}
    for name, trace in traces(curve.capacity_point(target)[0], duration, seed).items():
        out[name] = {
            p: run(curve, trace, duration, p, startup, seed, low, high, target, max_num_seqs) for p in POLICIES
        }
    return out


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


def grid(
    seeds: list[int],
    startups: list[float],
    duration: float = 3600.0,
    target: float = 0.95,
    curve: Curve | None = None,
    max_num_seqs: int = 8,
) -> list[dict]:
    """The goodput law (no capacity hint) against the hindsight-tuned concurrency HPA on every trace,
    start-up time and seed: per trace and start-up, attainment (worst seed, mean) and replica-seconds
    as a ratio to the HPA's (mean, worst seed)."""
    curve = curve or Curve.load()
    base = curve.capacity_point(target)[0]
    rows = []
    for name in traces(base, duration):
        for startup in startups:
            ours, hpa, ratios = [], [], []
            bounds: dict[str, tuple[list[float], list[float]]] = {y: ([], []) for y in YARDSTICKS}
            for seed in seeds:
                trace = traces(base, duration, seed)[name]
                g = run(curve, trace, duration, "goodput-no-hint", startup, seed, 1, 20, target, max_num_seqs)
                h = run(curve, trace, duration, "concurrency-hpa", startup, seed, 1, 20, target, max_num_seqs)
                ours.append(g["attainment"])
                hpa.append(h["attainment"])
                ratios.append(g["replica_seconds"] / h["replica_seconds"])
                for y in YARDSTICKS:
                    r = run(curve, trace, duration, y, startup, seed, 1, 20, target, max_num_seqs)
                    bounds[y][0].append(r["attainment"])
                    bounds[y][1].append(r["replica_seconds"] / h["replica_seconds"])
            row = {
                "trace": name,
                "startup_s": startup,
                "seeds": seeds,
                "goodput_attainment_min": min(ours),
                "goodput_attainment_mean": sum(ours) / len(ours),
                "hpa_attainment_min": min(hpa),
                "hpa_attainment_mean": sum(hpa) / len(hpa),
                "replica_s_ratio_mean": sum(ratios) / len(ratios),
                "replica_s_ratio_max": max(ratios),
            }
            for y, (att, rat) in bounds.items():
                key = y.replace("-", "_")
                row.update(
                    {f"{key}_attainment_mean": sum(att) / len(att), f"{key}_replica_s_ratio_mean": sum(rat) / len(rat)}
                )
            rows.append(row)
    return rows


def parse_seeds(text: str) -> list[int]:
    """`1-5` or `1,3,8`."""
    if "-" in text:
        first, last = text.split("-", 1)
        return list(range(int(first), int(last) + 1))
    return [int(x) for x in text.split(",") if x]


def grid_table(rows: list[dict]) -> str:
    lines = [
        "| trace | start-up | goodput attainment (min / mean) | HPA attainment (min / mean) "
        "| replica-s vs HPA (mean / max) | reactive bound: attainment, replica-s | clairvoyant: attainment, "
        "replica-s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['startup_s']:.0f} s | {r['goodput_attainment_min']:.3f} / "
            f"{r['goodput_attainment_mean']:.3f} | {r['hpa_attainment_min']:.3f} / "
            f"{r['hpa_attainment_mean']:.3f} | {r['replica_s_ratio_mean']:.2f}× / "
            f"{r['replica_s_ratio_max']:.2f}× | {r['reactive_bound_attainment_mean']:.3f}, "
            f"{r['reactive_bound_replica_s_ratio_mean']:.2f}× | {r['clairvoyant_attainment_mean']:.3f}, "
            f"{r['clairvoyant_replica_s_ratio_mean']:.2f}× |"
        )
    lines.append("")
    for label, key in (
        ("the goodput law", "replica_s_ratio_mean"),
        ("the reactive bound", "reactive_bound_replica_s_ratio_mean"),
        ("the clairvoyant", "clairvoyant_replica_s_ratio_mean"),
    ):
        mean = sum(r[key] for r in rows) / len(rows)
        lines.append(f"replica-seconds vs the concurrency HPA, mean over traces and start-ups, {label}: {mean:.3f}×")
    return "\n".join(lines)


def table(results: dict[str, dict[str, dict]]) -> str:
    lines = [
        f"{'trace':<8} {'policy':<16} {'attainment':>10} {'replica-s':>9} {'/static':>7} {'/queue':>7} {'/conc':>7}",
        "-" * 70,
    ]
    for name, by_policy in results.items():
        for policy, r in by_policy.items():
            rs = r["replica_seconds"]
            ratios = [rs / by_policy[p]["replica_seconds"] for p in ("static-peak", "queue-hpa", "concurrency-hpa")]
            lines.append(
                f"{name:<8} {policy:<16} {r['attainment']:>10.3f} {rs:>9.0f} " + " ".join(f"{x:>7.2f}" for x in ratios)
            )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, dict]], out: Path) -> list[Path]:
    import matplotlib  # optional: only for --plots

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, by_policy in results.items():
        fig, (ax_load, ax_rep, ax_att) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
        first = next(iter(by_policy.values()))["timeline"]
        ax_load.plot([p[0] for p in first], [p[1] for p in first], color="black")
        ax_load.set_ylabel("arrivals (req/s)")
        for policy, r in by_policy.items():
            t = [p[0] for p in r["timeline"]]
            ax_rep.step(t, [p[2] for p in r["timeline"]], where="post", label=policy)
            ax_att.plot(t, [p[4] if p[4] is not None else float("nan") for p in r["timeline"]], label=policy)
        ax_rep.set_ylabel("replicas")
        ax_rep.legend()
        ax_att.set_ylabel("attainment (1 min)")
        ax_att.set_xlabel("seconds")
        ax_att.set_ylim(0, 1.02)
        fig.suptitle(f"trace: {name}")
        path = out / f"autoscale-{name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


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
        "--replay", type=Path, help="CSV of timestamp,prompt_tokens,output_tokens: run every policy on that log"
    )
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.grid:
        rows = grid(args.seeds, [60.0, 180.0], args.duration, max_num_seqs=args.max_num_seqs)
        print(grid_table(rows))
        if args.seeds == [1, 2, 3, 4, 5]:
            (RESULTS / "autoscale-grid.json").write_text(json.dumps(rows, indent=2))
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
        results = {
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
                for p in POLICIES
            }
        }
        print(table(results))
        return
    results = simulate(args.duration, args.startup, args.seed, max_num_seqs=args.max_num_seqs)
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
