"""What logprobs and n cost on the real model: throughput and latency with and without them.

    python -m bench.api_fields            # SmolLM2-135M-Instruct, fetched and prepared once

One server on the prepared SmolLM2 directory (float32, CPU) is driven at each concurrency with
three kinds of request in alternating rounds: plain greedy completions, the same with
`logprobs: 5` (top-5 per token), and `n: 4` (four choices sharing the prompt's KV blocks; its
output tokens count all four). Every request generates exactly `--output-len` tokens per choice.
Prefix caching is off, since every kind sends the same prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from bench.serve import run_load
from bench.server_process import kv_cache_bytes, start_server
from bench.stats import summarize
from bench.workload import WorkloadSpec, make_workload, prompt_vocabulary

KINDS = {"plain": {}, "logprobs=5": {"logprobs": 5}, "n=4": {"n": 4}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2, prepared here)")
    parser.add_argument("--concurrency", default="1,16")
    parser.add_argument("--num-requests", type=int, default=16, help="per round at the highest concurrency")
    parser.add_argument("--prompt-len", default="32-256")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="bench/results/api_fields.json")
    args = parser.parse_args(argv)
    model = args.model
    if model is None:
        from goodput_runtime.tools import smollm2

        cache = smollm2.DEFAULT_CACHE
        model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    levels = [int(c) for c in args.concurrency.split(",")]
    low, high = (int(x) for x in args.prompt_len.split("-"))
    spec = WorkloadSpec(
        num_requests=args.num_requests, prompt_len=(low, high), output_len=(args.output_len, args.output_len)
    )
    items = make_workload(spec, prompt_vocabulary(model))
    kv = 4 * kv_cache_bytes(model, items, 16)  # room for n=4 at once
    samples: dict[tuple[str, int], list[dict]] = {}
    # every kind sends the same prompts: without prefix caching each one computes them afresh
    extra = [
        "--kv-cache-memory",
        str(kv),
        "--max-num-seqs",
        str(4 * max(levels)),
        "--max-model-len",
        "1024",
        "--no-enable-prefix-caching",
    ]
    with start_server(model, "bench", args.threads, extra, Path("bench/results/logs")) as server:
        asyncio.run(run_load(server.base_url, "bench", items[:2], concurrency=2, warmup=2))
        for r in range(args.rounds):
            order = list(KINDS) if r % 2 == 0 else list(reversed(KINDS))
            for concurrency in levels:
                batch = items if concurrency > 1 else items[: max(4, args.num_requests // 4)]
                for kind in order:
                    records, duration = asyncio.run(
                        run_load(server.base_url, "bench", batch, concurrency=concurrency, extra=KINDS[kind])
                    )
                    summary = summarize(records, duration, None, None)
                    assert summary["failed"] == 0, [x.error for x in records if x.error][:3]
                    samples.setdefault((kind, concurrency), []).append(summary)
                    print(
                        f"  round {r} c={concurrency} {kind}: {summary['output_tokens_per_s']:.1f} tok/s, "
                        f"TTFT p50 {summary['ttft_s']['p50'] * 1e3:.0f} ms",
                        flush=True,
                    )
    rows = []
    for (kind, concurrency), runs in samples.items():
        rows.append(
            {
                "kind": kind,
                "concurrency": concurrency,
                "tokens_per_s": statistics.median(s["output_tokens_per_s"] for s in runs),
                "requests_per_s": statistics.median(s["requests_per_s"] for s in runs),
                "ttft_p50_ms": statistics.median(s["ttft_s"]["p50"] for s in runs) * 1e3,
                "e2e_p50_ms": statistics.median(s["e2e_s"]["p50"] for s in runs) * 1e3,
            }
        )
    rows.sort(key=lambda row: (row["concurrency"], list(KINDS).index(row["kind"])))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "model": model, "rows": rows}, indent=2))
    print(f"\n{model}: {args.output_len} tokens per choice, prompts {args.prompt_len}, {args.rounds} rounds")
    print("| concurrency | request | output tok/s | requests/s | TTFT p50 | e2e p50 | vs plain tok/s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for row in rows:
        plain = next(x for x in rows if x["kind"] == "plain" and x["concurrency"] == row["concurrency"])
        print(
            f"| {row['concurrency']} | {row['kind']} | {row['tokens_per_s']:.1f} | {row['requests_per_s']:.2f} | "
            f"{row['ttft_p50_ms']:.0f} ms | {row['e2e_p50_ms']:.0f} ms | "
            f"{row['tokens_per_s'] / plain['tokens_per_s']:.2f}x |"
        )


if __name__ == "__main__":
    main()
