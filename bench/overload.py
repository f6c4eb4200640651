"""Goodput under overload: one replica at 1×, 2× and 5× its capacity, SLO-aware admission on and off.

    python -m bench.overload --model-dir .cache/models/llama-60m --duration 20

First the replica's capacity is measured: requests/s it completes with exactly --max-num-seqs
requests in flight (every request gets a seat at once, none queues). The TTFT and TPOT targets
are then set from that run (--ttft-factor × its p90 TTFT, --tpot-factor × its p90 TPOT) unless
given. Then Poisson arrivals at each multiple of the capacity, for --duration seconds, against a
fresh server with ``--admission on`` and one with ``--admission off``, alternating rounds.

Goodput is the requests/s that completed within both targets, over the arrival window; a
request still unanswered --drain seconds after the last arrival counts as a miss, and a 429
as a refusal (never a success). Every latency is measured at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

from bench.serve import run_load, write_json
from bench.server_process import ensure_model, kv_cache_bytes, start_server
from bench.stats import percentile
from bench.workload import WorkloadSpec, make_workload, parse_range, prompt_vocabulary

RESULTS = Path(__file__).resolve().parent / "results"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=".cache/models/llama-60m")
    p.add_argument("--shape", default="llama-60m", help="shape to make the model from when it is missing")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of the server's forward pass")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--prompt-len", default="64-128")
    p.add_argument("--output-len", default="16-32")
    p.add_argument("--loads", default="1,2,5", help="multiples of the measured capacity")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per load")
    p.add_argument("--drain", type=float, default=10.0, help="seconds after the last arrival before cutting off")
    p.add_argument("--rounds", type=int, default=1, help="alternating on/off rounds per load")
    p.add_argument("--slo-ttft", type=float, default=None, help="seconds; default from the capacity run")
    p.add_argument("--slo-tpot", type=float, default=None, help="seconds; default from the capacity run")
    p.add_argument("--ttft-factor", type=float, default=3.0)
    p.add_argument("--tpot-factor", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None)
    return p


def server_args(
    args: argparse.Namespace, kv_bytes: int, ttft: float | None, tpot: float | None, admission: str
) -> list[str]:
    out = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        "512",
        "--max-model-len",
        "512",
        "--kv-cache-memory",
        str(kv_bytes),
        "--admission",
        admission,
        "--no-enable-prefix-caching",
    ]
    if ttft is not None:
        out += ["--slo-ttft", str(ttft)]
    if tpot is not None:
        out += ["--slo-tpot", str(tpot)]
    return out


def measure_capacity(args: argparse.Namespace, vocab: list[int], kv_bytes: int) -> dict:
    spec = WorkloadSpec(
        args.max_num_seqs * 6, parse_range(args.prompt_len), parse_range(args.output_len), float("inf"), args.seed + 100
    )
    items = make_workload(spec, vocab)
    with start_server(
        args.model_dir, "overload", args.threads, server_args(args, kv_bytes, None, None, "off"), RESULTS / "logs"
    ) as server:
        records, duration = asyncio.run(run_load(server.base_url, "overload", items, args.max_num_seqs, warmup=2))
    done = [r for r in records if r.ok]
    return {
        "requests_per_s": len(done) / duration,
        "ttft_p90_s": percentile([r.ttft_s for r in done if r.ttft_s is not None], 90),
        "tpot_p90_s": percentile([t for r in done if (t := r.tpot_s) is not None], 90),
        "completed": len(done),
        "requests": len(records),
        "duration_s": duration,
    }


def run_phase(
    args: argparse.Namespace,
    vocab: list[int],
    kv_bytes: int,
    rate: float,
    admission: str,
    ttft: float,
    tpot: float,
    seed: int,
) -> dict:
    count = max(1, round(rate * args.duration))
    spec = WorkloadSpec(count, parse_range(args.prompt_len), parse_range(args.output_len), rate, seed)
    items = make_workload(spec, vocab)
    with start_server(
        args.model_dir, "overload", args.threads, server_args(args, kv_bytes, ttft, tpot, admission), RESULTS / "logs"
    ) as server:
        records, _ = asyncio.run(
            run_load(server.base_url, "overload", items, None, max_duration_s=args.duration + args.drain, warmup=2)
        )
    window = max(args.duration, items[-1].arrival_s)
    good = [r for r in records if r.meets(ttft, tpot)]
    served = [r for r in records if r.ok]
    refused = [r for r in records if r.error and r.error.startswith("HTTP 429")]
    return {
        "admission": admission,
        "rate": rate,
        "requests": len(records),
        "served": len(served),
        "good": len(good),
        "refused": len(refused),
        "other_errors": len(records) - len(served) - len(refused),
        "goodput_requests_per_s": len(good) / window,
        "throughput_requests_per_s": len(served) / window,
        "served_attainment": len(good) / len(served) if served else None,
        "ttft_p50_s": percentile([r.ttft_s for r in served if r.ttft_s is not None], 50),
        "ttft_p99_s": percentile([r.ttft_s for r in served if r.ttft_s is not None], 99),
    }


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    ensure_model(args.model_dir, args.shape)
    vocab = prompt_vocabulary(args.model_dir)
    high = parse_range(args.prompt_len)[1] + parse_range(args.output_len)[1]
    kv_bytes = kv_cache_bytes(
        args.model_dir, make_workload(WorkloadSpec(args.max_num_seqs * 2, (high, high), (1, 1)), vocab), 16
    )
    print("measuring capacity ...", flush=True)
    capacity = measure_capacity(args, vocab, kv_bytes)
    ttft = args.slo_ttft or round(args.ttft_factor * (capacity["ttft_p90_s"] or 0.1), 3)
    tpot = args.slo_tpot or round(args.tpot_factor * (capacity["tpot_p90_s"] or 0.05), 4)
    print(f"capacity {capacity['requests_per_s']:.2f} req/s; SLO TTFT <= {ttft}s, TPOT <= {tpot}s", flush=True)
    phases = []
    for load in [float(x) for x in args.loads.split(",")]:
        rate = load * capacity["requests_per_s"]
        for r in range(args.rounds):
            order = ("on", "off") if r % 2 == 0 else ("off", "on")
            for admission in order:
                result = run_phase(args, vocab, kv_bytes, rate, admission, ttft, tpot, args.seed + r)
                result["load"] = load
                phases.append(result)
                print(
                    f"  {load:g}x admission {admission}: goodput {result['goodput_requests_per_s']:.2f} req/s, "
                    f"{result['good']}/{result['requests']} good, {result['refused']} refused",
                    flush=True,
                )
    table = summarize(phases)
    payload = {
        "kind": "overload",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "capacity": capacity,
        "slo": {"ttft_s": ttft, "tpot_s": tpot},
        "phases": phases,
        "table": table,
    }
    path = write_json(
        args.output or RESULTS / f"overload-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json", payload
    )
    print(render(table, capacity["requests_per_s"]))
    print(f"\nwrote {path}")
    return payload


def summarize(phases: list[dict]) -> list[dict]:
    """Mean per (load, admission) over the rounds; each goodput also as a share of its mode's peak."""
    rows: dict[tuple[float, str], list[dict]] = {}
    for p in phases:
        rows.setdefault((p["load"], p["admission"]), []).append(p)
    table = []
    for (load, admission), group in sorted(rows.items()):

        def mean(key: str, g: list[dict] = group) -> float | None:
            values = [p[key] for p in g if p[key] is not None]
            return sum(values) / len(values) if values else None

        table.append(
            {
                "load": load,
                "admission": admission,
                "goodput_requests_per_s": mean("goodput_requests_per_s"),
                "throughput_requests_per_s": mean("throughput_requests_per_s"),
                "served_attainment": mean("served_attainment"),
                "refused": mean("refused"),
                "requests": mean("requests"),
                "ttft_p99_s": mean("ttft_p99_s"),
            }
        )
    for admission in {row["admission"] for row in table}:
        mine = [row for row in table if row["admission"] == admission]
        peak = max(row["goodput_requests_per_s"] or 0.0 for row in mine)
        for row in mine:
            row["share_of_peak"] = (row["goodput_requests_per_s"] or 0.0) / peak if peak else None
    return table


def render(table: list[dict], capacity: float) -> str:
    lines = [
        f"capacity {capacity:.2f} req/s per replica",
        f"{'load':>5} {'admission':>9} {'goodput/s':>10} {'of peak':>8} {'served/s':>9} "
        f"{'attain':>7} {'refused':>8} {'TTFT p99':>9}",
    ]
    for row in table:
        lines.append(
            f"{row['load']:>4g}x {row['admission']:>9} {fmt(row['goodput_requests_per_s']):>10} "
            f"{fmt(row['share_of_peak']):>8} {fmt(row['throughput_requests_per_s']):>9} "
            f"{fmt(row['served_attainment']):>7} {fmt(row['refused'], 0):>8} "
            f"{fmt(row['ttft_p99_s']):>9}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
