"""Trace-driven simulation of a Goodput service under five scaling policies and two yardsticks.

    python -m bench.autoscale_sim [--plots] [--startup 60] [--duration 3600]
    python -m bench.autoscale_sim --grid [--seeds 1-5]   # the law without a hint vs the concurrency HPA
    python -m bench.autoscale_sim --surface              # attainment of static counts against load
    python -m bench.autoscale_sim --replay log.csv       # every policy and both yardsticks on a recorded log
    python -m bench.autoscale_sim --write-trace burst burst.csv   # a trace in that log format
    python -m bench.autoscale_sim --admission            # replicas refuse past their SLO as the runtime does

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

With --admission each replica answers 429 where the runtime's SLO-aware admission would: when the
running decodes' TPOT with the newcomer, or the newcomer's TTFT (its wait for a seat at the measured
throughput, then the TTFT at that batch), passes its target less 10 %. A refused request is a miss;
the laws see it as the operator does, in the arrival rate and not in attainment (of served requests).

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
from pathlib import Path

from bench.autoscale_grid import grid, grid_table, parse_seeds, targets_text
from bench.autoscale_model import Curve, write_trace
from bench.autoscale_replay import load_replay, replay_rate
from bench.autoscale_report import plot, table
from bench.autoscale_run import POISSON_LAW, POLICIES, YARDSTICKS, run, simulate
from bench.autoscale_surface import surface_table

RESULTS = Path(__file__).resolve().parent / "results"


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
    parser.add_argument(
        "--admission",
        action="store_true",
        help="replicas refuse with 429 as the runtime's SLO-aware admission does (a miss, and demand all the same)",
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
                    admission=args.admission,
                )
                for p in (*POLICIES, POISSON_LAW, *YARDSTICKS)
            }
        }
        print(table(replayed))
        return
    results = simulate(
        args.duration,
        args.startup,
        args.seed,
        max_num_seqs=args.max_num_seqs,
        policies=(*POLICIES, POISSON_LAW),
        admission=args.admission,
    )
    print(table(results))
    summary = {
        t: {p: {k: v for k, v in r.items() if k != "timeline"} for p, r in by.items()} for t, by in results.items()
    }
    (RESULTS / ("autoscale-sim-admission.json" if args.admission else "autoscale-sim.json")).write_text(
        json.dumps(summary, indent=2)
    )
    if args.plots:
        for path in plot(results, RESULTS):
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
