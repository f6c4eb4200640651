"""Decode speed with a competing busy process on the same cores, against the same server undisturbed.

    python -m bench.contention --model .cache/models/llama-60m --shape 60m

On a shared Kubernetes node other pods take cores away from ours. For each server setting,
one server is started and driven at a fixed concurrency in alternating rounds: quiet, then
with one busy-looping process beside it, and again. The figure that matters is the ratio of
TPOT with the competitor to TPOT without (1.0 = unaffected).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from bench.serve import run_load
from bench.server_process import ensure_model, kv_cache_bytes, start_server
from bench.stats import summarize
from bench.workload import WorkloadSpec, make_workload, prompt_vocabulary

# name -> (environment for the server, extra runtime flags)
SETTINGS: dict[str, tuple[dict[str, str], list[str]]] = {
    "runtime default (OpenMP's short spin, contention watch)": ({}, []),
    "short spin, --cpu-contention off": ({}, ["--cpu-contention", "off"]),
    "OMP_WAIT_POLICY=PASSIVE, contention watch": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "OMP_WAIT_POLICY=PASSIVE, --cpu-contention off": ({"OMP_WAIT_POLICY": "PASSIVE"}, ["--cpu-contention", "off"]),
    "OMP_WAIT_POLICY=ACTIVE (spin without end)": ({"OMP_WAIT_POLICY": "ACTIVE"}, []),
    "runtime default, --num-threads 1": ({}, ["--num-threads", "1"]),
}


@contextmanager
def busy_process():
    """One process spinning on a core until the block ends (bounded: it exits after 15 minutes)."""
    spin = "import time\nend = time.time() + 900\nwhile time.time() < end: pass"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.kill()
        proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=".cache/models/llama-60m")
    parser.add_argument("--shape", default="60m")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", default="32-256")
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="quiet + busy pairs per setting")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--settings", default=None, help="comma-separated setting numbers to run (1-based)")
    parser.add_argument("--out", default="bench/results/contention.json")
    args = parser.parse_args(argv)

    ensure_model(args.model, args.shape)
    low, high = (int(x) for x in args.prompt_len.split("-"))
    spec = WorkloadSpec(
        num_requests=args.num_requests, prompt_len=(low, high), output_len=(args.output_len, args.output_len)
    )
    items = make_workload(spec, prompt_vocabulary(args.model))
    kv = kv_cache_bytes(args.model, items, 16)
    results: dict[str, dict[str, list[dict]]] = {}
    chosen = list(SETTINGS.items())
    if args.settings:
        chosen = [chosen[int(i) - 1] for i in args.settings.split(",")]
    for name, (env, flags) in chosen:
        print(f"== {name}", flush=True)
        extra = [
            "--kv-cache-memory",
            str(kv),
            "--max-num-seqs",
            str(args.concurrency),
            "--max-model-len",
            str(high + args.output_len),
            *flags,
        ]
        with start_server(
            args.model, "bench", args.threads, extra, Path("bench/results/logs"), env_overrides=env
        ) as server:
            asyncio.run(run_load(server.base_url, "bench", items[:4], concurrency=4, warmup=2))
            for r in range(args.rounds):
                for phase in ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"):
                    if phase == "busy":
                        with busy_process():
                            records, duration = asyncio.run(
                                run_load(server.base_url, "bench", items, concurrency=args.concurrency)
                            )
                    else:
                        records, duration = asyncio.run(
                            run_load(server.base_url, "bench", items, concurrency=args.concurrency)
                        )
                    summary = summarize(records, duration, None, None)
                    results.setdefault(name, {}).setdefault(phase, []).append(summary)
                    print(
                        f"   {phase}: TPOT p50 {summary['tpot_s']['p50'] * 1e3:.0f} ms, "
                        f"{summary['output_tokens_per_s']:.1f} tok/s",
                        flush=True,
                    )

    rows = []
    for name, phases in results.items():
        quiet = statistics.median(s["tpot_s"]["p50"] for s in phases["quiet"])
        busy = statistics.median(s["tpot_s"]["p50"] for s in phases["busy"])
        rows.append(
            {
                "setting": name,
                "quiet_tpot_p50_ms": quiet * 1e3,
                "busy_tpot_p50_ms": busy * 1e3,
                "ratio": busy / quiet,
                "quiet_tok_s": statistics.median(s["output_tokens_per_s"] for s in phases["quiet"]),
                "busy_tok_s": statistics.median(s["output_tokens_per_s"] for s in phases["busy"]),
            }
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows, "rounds": results}, indent=2))
    print(
        f"\nconcurrency {args.concurrency}, {args.threads} threads, {args.num_requests} requests x "
        f"{args.output_len} tokens per round, {args.rounds} rounds each"
    )
    print("| setting | TPOT p50 quiet | TPOT p50 busy | busy/quiet | tok/s quiet | tok/s busy |")
    print("|---|---:|---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['setting']} | {row['quiet_tpot_p50_ms']:.0f} ms | {row['busy_tpot_p50_ms']:.0f} ms | "
            f"{row['ratio']:.2f}x | {row['quiet_tok_s']:.1f} | {row['busy_tok_s']:.1f} |"
        )


if __name__ == "__main__":
    main()
