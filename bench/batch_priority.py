"""Batch work beside an online load: does the online SLO hold, and how much idle capacity does the batch use?

One runtime process (the real SmolLM2-135M-Instruct by default) behind a gateway process with the
batch API on (SQLite). First the replica's capacity C is measured (closed loop, requests/s of the
online request shape). Then, in alternating rounds:

- A: an online Poisson load at --load × C alone, for --duration seconds;
- B: the same load (same seed) while a --batch-lines batch of the same request shape runs through
  the gateway's batch API; the batch is cancelled at the end of the round;
- C (with --compare-uncapped): as B, on a second runtime (its own gateway) started with
  ``--batch-cap off``, idle in the other rounds.

Online attainment is the share of online requests that met both targets: TTFT within --slo-ttft and
TPOT (time per output token after the first, as the runtime counts it) within --slo-tpot; the
runtime gets both targets, and caps the batch sequences running beside online ones from the TPOT
target (``--batch-cap``). Each pair of rounds gives a ratio, B's attainment over A's, so a slow
patch on a shared machine weighs on both sides of one ratio. The batch's share of the idle capacity
is its throughput over (C − online rate). Writes JSON and a PNG (online TTFT p90 and batch
throughput over time, both runs) under bench/results/.

    python -m bench.batch_priority --duration 60 --rounds 2
    python -m bench.batch_priority --compare-uncapped --rate 0.4   # B and C against the same A rounds
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.batch_load import capacity, run_round
from bench.batch_report import LABELS, fmt, plot, print_tables, summarize
from bench.server_process import REPO, gateway_process, start_server


@contextmanager
def batch_gateway(static: str, database: str, log_dir: Path, cap: int, name: str = "batch") -> Iterator[str]:
    with gateway_process(
        static,
        log_dir,
        name,
        "--database",
        database,
        "--batch-max-per-replica",
        str(cap),
        "--shutdown-delay",
        "0",
        "--shutdown-grace",
        "2",
        ready_seconds=60,
        stop_seconds=20,
    ) as (url, _pid):
        yield url


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.batch_priority", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct, prepared under .cache)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of online load per round")
    p.add_argument("--rounds", type=int, default=2, help="pairs of rounds (A: online alone, B: with the batch)")
    p.add_argument("--load", type=float, default=0.6, help="online rate as a share of the measured capacity")
    p.add_argument(
        "--rate",
        type=float,
        help="online rate in requests/s instead of --load × capacity: the same load in runs compared "
        "on a machine whose capacity moves with other work",
    )
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.3, help="seconds")
    p.add_argument(
        "--runtime-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more runtime flag (repeatable), e.g. --runtime-arg=--batch-cap=off",
    )
    p.add_argument("--capacity-seconds", type=float, default=30.0, help="closed-loop seconds counted")
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds of load before counting: the capacity loop's, and the batch's before a B round",
    )
    p.add_argument("--max-per-replica", type=int, default=16, help="the gateway's batch concurrency cap")
    p.add_argument(
        "--compare-uncapped",
        action="store_true",
        help="also run each round's batch on a second runtime started with --batch-cap off (C), "
        "beside the first, so both are measured against the same online-alone round",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "batch_priority.json")
    args = p.parse_args()
    if args.model:
        model = args.model
    else:
        from goodput_runtime.tools import smollm2

        cache = REPO / ".cache" / "smollm2"
        model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    log_dir = REPO / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "machine": f"{os.cpu_count()} CPUs, shared",
        "model": model,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rounds": [],
    }
    flags = [
        "--slo-ttft",
        str(args.slo_ttft),
        "--slo-tpot",
        str(args.slo_tpot),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "32",
    ]
    with ExitStack() as stack:

        def replica(name: str, extra: list[str]) -> tuple[str, str]:
            """(gateway URL, runtime URL) of one runtime behind one gateway with its own batch store."""
            server = stack.enter_context(start_server(model, "smollm2", os.cpu_count() or 1, [*flags, *extra], log_dir))
            database = log_dir / f"{name}-{time.strftime('%H%M%S')}.db"
            return stack.enter_context(
                batch_gateway(
                    f"smollm2={server.base_url}", f"sqlite:///{database}", log_dir, args.max_per_replica, name
                )
            ), server.base_url

        urls = {"batch": replica("batch", args.runtime_arg)}
        if args.compare_uncapped:
            urls["batch-uncapped"] = replica("batch-uncapped", [*args.runtime_arg, "--batch-cap", "off"])
        cap = asyncio.run(
            capacity(urls["batch"][0], args.max_tokens, args.capacity_seconds, args.capacity_concurrency, args.warmup)
        )
        rate = args.rate or args.load * cap
        print(f"  capacity {cap:.2f} req/s; online load {rate:.2f} req/s", flush=True)
        variants = ["alone", *(["batch-uncapped"] if args.compare_uncapped else []), "batch"]
        for r in range(args.rounds):
            for variant in variants:
                url, runtime_url = urls["batch" if variant == "alone" else variant]
                result = asyncio.run(run_round(url, runtime_url, args, rate, variant != "alone", seed=r))
                result["round"], result["variant"] = r, variant
                if variant == "batch-uncapped":
                    result["batch_cap_mean"] = None  # the gauge stays at 0 on a runtime without the cap
                report["rounds"].append(result)
                print(
                    f"  round {r} {LABELS[variant]}: attainment {result['attainment']:.3f} (TTFT alone "
                    f"{result['ttft_attainment']:.3f}), TTFT p90 {fmt(result['ttft_p90_s'])} s, TPOT p90 "
                    f"{fmt(result['tpot_p90_s'])} s, batch {result['batch_rps']:.2f} lines/s",
                    flush=True,
                )

    summary = summarize(report, cap, rate, variants)
    report["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    png = args.out.with_suffix(".png")
    plot(report, png, window=max(5.0, args.duration / 12))
    idle = summary["idle_capacity_rps"]
    print(
        f"\ncapacity {cap:.2f} req/s, online {rate:.2f} req/s ({rate / max(cap, 1e-9):.0%}), idle {idle:.2f} req/s; "
        f"SLO TTFT {args.slo_ttft:g} s, TPOT {args.slo_tpot:g} s; runtime flags {args.runtime_arg or 'default'}; "
        f"{args.rounds} rounds of {args.duration:g} s each"
    )
    print_tables(report, variants)
    print(f"wrote {args.out} and {png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
