"""The KV hand-off's transport: its throughput, and its share of the time to first token, at 1k and 4k
prompt tokens, between two runtime processes on this machine (tcp over loopback).

    python -m bench.kv_transfer                          # SmolLM2-135M (prepared by the tests' fixture)
    python -m bench.kv_transfer --lengths 1024 4096 --rounds 3

Two runtimes (``--kv-transfer-role prefill`` and ``decode``), fp32 on the CPU. Each round, in an order
that alternates between rounds, for each prompt length:

- aggregated: a fresh random prompt (no block cached anywhere) sent whole to the decode runtime,
  max_tokens 1: its time to first token;
- disaggregated: another fresh prompt through both phases (prefill runtime, then the decode runtime
  with the returned hand-off), max_tokens 1: the two phases' time together, and the transfer's own
  seconds and bytes as the decode runtime's metrics count them (``goodput_kv_transfer_seconds``: from
  the hand-off's start to its blocks landing in the cache, the prefill side's read included).

Reported per length: the medians, the transport's throughput (bytes / transfer seconds) and its share
of the disaggregated time to first token. Both processes share the machine's cores, so a prefill here
competes with nothing but the transfer; the figures say what the hand-off costs, not what splitting
gains (that needs separate machines: see docs/disaggregation.md). JSON to bench/results/kv-transfer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import time
import urllib.request
from pathlib import Path

from bench.server_process import free_port, machine, start_server

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / ".cache" / "smollm2" / "0.1.2" / "hf"


def post(url: str, body: dict) -> tuple[float, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        answer = json.loads(response.read())
    return time.perf_counter() - started, answer


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


def prompt(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(100, 30000) for _ in range(length)]


def aggregated(decode: str, tokens: list[int]) -> dict:
    seconds, _ = post(f"{decode}/v1/completions", {"model": "m", "prompt": tokens, "max_tokens": 1, "temperature": 0})
    return {"ttft_s": seconds}


def disaggregated(prefill: str, decode: str, tokens: list[int]) -> dict:
    body = {"model": "m", "prompt": tokens, "max_tokens": 1, "temperature": 0}
    moved, spent = metric(decode, "goodput_kv_transfer_bytes_total"), metric(decode, "goodput_kv_transfer_seconds_sum")
    first, answer = post(f"{prefill}/v1/completions", {**body, "kv_transfer_params": {"do_remote_decode": True}})
    params = answer["kv_transfer_params"]
    second, _ = post(f"{decode}/v1/completions", {**body, "kv_transfer_params": params})
    transfer_bytes = metric(decode, "goodput_kv_transfer_bytes_total") - moved
    transfer_s = metric(decode, "goodput_kv_transfer_seconds_sum") - spent
    return {
        "ttft_s": first + second,
        "prefill_phase_s": first,
        "decode_phase_s": second,
        "transfer_s": transfer_s,
        "transfer_bytes": transfer_bytes,
        "blocks": len(params["remote_block_ids"]),
    }


def summary(length: int, plain: list[dict], split: list[dict]) -> dict:
    def median(rows: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rows)

    transfer_s, ttft = median(split, "transfer_s"), median(split, "ttft_s")
    return {
        "prompt_tokens": length,
        "aggregated_ttft_s": median(plain, "ttft_s"),
        "disaggregated_ttft_s": ttft,
        "prefill_phase_s": median(split, "prefill_phase_s"),
        "decode_phase_s": median(split, "decode_phase_s"),
        "transfer_s": transfer_s,
        "transfer_bytes": median(split, "transfer_bytes"),
        "blocks": median(split, "blocks"),
        "throughput_bytes_per_s": median(split, "transfer_bytes") / transfer_s if transfer_s else None,
        "transfer_share_of_ttft": transfer_s / ttft if ttft else None,
        "rounds": {"aggregated": plain, "disaggregated": split},
    }


def table(rows: list[dict]) -> str:
    lines = [
        f"{'prompt':>7} {'blocks':>6} {'MiB':>7} {'transfer ms':>11} {'MiB/s':>8} {'agg TTFT ms':>11} "
        f"{'disagg TTFT ms':>14} {'share':>6}"
    ]
    for r in rows:
        lines.append(
            f"{r['prompt_tokens']:>7} {r['blocks']:>6.0f} {r['transfer_bytes'] / 2**20:>7.1f} "
            f"{r['transfer_s'] * 1e3:>11.1f} "
            f"{(r['throughput_bytes_per_s'] or 0) / 2**20:>8.0f} {r['aggregated_ttft_s'] * 1e3:>11.0f} "
            f"{r['disaggregated_ttft_s'] * 1e3:>14.0f} {100 * (r['transfer_share_of_ttft'] or 0):>5.1f}%"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per runtime")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "kv-transfer.json"))
    args = parser.parse_args(argv)
    longest = max(args.lengths) + 64
    common = ["--max-model-len", str(longest), "--kv-cache-memory", "1Gi", "--max-num-batched-tokens", str(longest)]
    common += ["--kv-transfer-host", "127.0.0.1", "--kv-transfer-timeout", "60"]
    logs = REPO / "bench" / "results" / "logs" / "kv-transfer"
    load_before = os.getloadavg()
    rng = random.Random(33)
    with (
        start_server(
            args.model,
            "m",
            args.threads,
            [*common, "--kv-transfer-role", "prefill", "--kv-transfer-port", str(free_port())],
            logs / "prefill",
        ) as prefill,
        start_server(
            args.model, "m", args.threads, [*common, "--kv-transfer-role", "decode"], logs / "decode"
        ) as decode,
    ):
        aggregated(decode.base_url, prompt(rng, 64))  # first requests pay for lazy set-up: not measured
        disaggregated(prefill.base_url, decode.base_url, prompt(rng, 64))
        rows = []
        for length in args.lengths:
            plain: list[dict] = []
            split: list[dict] = []
            for i in range(args.rounds):
                order = [0, 1] if i % 2 == 0 else [1, 0]
                for which in order:
                    if which == 0:
                        plain.append(aggregated(decode.base_url, prompt(rng, length)))
                    else:
                        split.append(disaggregated(prefill.base_url, decode.base_url, prompt(rng, length)))
                print(
                    f"  {length} tokens, round {i + 1}: aggregated {plain[-1]['ttft_s']:.2f}s, "
                    f"disaggregated {split[-1]['ttft_s']:.2f}s (transfer {split[-1]['transfer_s'] * 1e3:.0f} ms)",
                    flush=True,
                )
            rows.append(summary(length, plain, split))
    result = {
        "benchmark": "kv-transfer",
        "model": args.model,
        "transport": "tcp (loopback)",
        "threads_per_runtime": args.threads,
        "machine": machine(load_before, os.getloadavg()),
        "results": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
