"""Decode speed on a GPU with and without CUDA graphs: tokens/s at several batch sizes and MBU at batch 1.

    python -m goodput_runtime.tools.make_model --out .cache/models/llama-1b --shape 1b --dtype bfloat16
    python -m bench.gpu_decode --model .cache/models/llama-1b

Both engines (graphs on, and `--enforce-eager`) are loaded side by side in one process, on the
same model and the same requests, and measured in alternating rounds. For each batch size B,
B requests with random prompts are prefilled, then a fixed number of decode steps is timed.

MBU (model bandwidth utilisation) at batch 1 is the bytes one decode step must read (every
weight but the input embedding table, plus the KV cache it attends to) over the step time,
as a share of the GPU's peak memory bandwidth (`--peak-bandwidth`, or the card's datasheet
figure when its name is known).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.engine.core import EngineCore
from goodput_runtime.sampling import SamplingParams

# datasheet HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name()
PEAK_BANDWIDTH = {
    "H100 80GB HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "H200": 4.8e12,
    "A100-SXM4-80GB": 2.039e12,
    "A100-SXM4-40GB": 1.555e12,
    "L4": 0.3e12,
}


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def weight_bytes_per_step(core: EngineCore) -> int:
    model = core.runner.model
    embed = model.get_input_embeddings().weight
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t is not embed)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_round(core: EngineCore, batch: int, prompt_len: int, steps: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = core.runner.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    for rid in ids:
        core.add(rid, [rng.randrange(10, vocab) for _ in range(prompt_len)], params)
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    while any(not tokens[rid] for rid in ids):  # prefills, and the first token of each
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
    sync()
    elapsed = time.perf_counter() - started
    while core.has_unfinished():
        for out in core.step():
            tokens[out.request_id].extend(out.token_ids)
    return {"step_s": elapsed / steps, "tokens_per_s": batch * steps / elapsed, "tokens": [tokens[rid] for rid in ids]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda", help="cpu runs the static path without capture (a smoke test)")
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=128, help="decode steps timed per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-memory", type=int, default=4 << 30, help="bytes of KV cache per engine")
    parser.add_argument("--quantization", default="none", help="none, int8, int8-w8a8 or fp8 weights")
    parser.add_argument("--compile", action="store_true", help="--compile for both engines")
    parser.add_argument("--peak-bandwidth", type=float, help="bytes/s (default: the card's datasheet figure)")
    parser.add_argument("--out", default="bench/results/gpu_decode.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = args.peak_bandwidth or peak_bandwidth(name)

    engines: dict[str, EngineCore] = {}
    load_s = {}
    for mode in ("graphs", "eager"):
        started = time.monotonic()
        engines[mode] = build_core(
            EngineConfig(
                model=args.model,
                device=args.device,
                dtype=args.dtype,
                max_model_len=args.prompt_len + args.steps + 64,
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(2048, args.prompt_len * max(batches)),
                kv_cache_memory=args.kv_cache_memory,
                enforce_eager=mode == "eager",
                quantization=args.quantization,
                compile=args.compile,
            )
        )
        load_s[mode] = time.monotonic() - started
    if args.device == "cpu":
        engines["graphs"].runner.enable_decode_graphs(max(batches), args.prompt_len + args.steps + 64, capture=False)
    graphs = engines["graphs"].runner.graphs
    assert graphs is not None
    weights = weight_bytes_per_step(engines["graphs"])
    layout = engines["graphs"].runner.layout

    samples: dict[tuple[str, int], list[float]] = {}
    same_tokens = True
    for r in range(args.rounds):
        for batch in batches:
            order = ("graphs", "eager") if r % 2 == 0 else ("eager", "graphs")
            outputs = {}
            for mode in order:
                result = decode_round(engines[mode], batch, args.prompt_len, args.steps, seed=1000 * r + batch)
                samples.setdefault((mode, batch), []).append(result["step_s"])
                outputs[mode] = result["tokens"]
            same_tokens &= outputs["graphs"] == outputs["eager"]

    rows = []
    for batch in batches:
        row: dict = {"batch": batch}
        for mode in ("graphs", "eager"):
            step = statistics.median(samples[(mode, batch)])
            row[f"{mode}_step_ms"] = step * 1e3
            row[f"{mode}_tokens_per_s"] = batch / step
            # bytes read per step: the weights once, and each sequence's KV cache at its mean context
            kv = batch * (args.prompt_len + args.steps / 2) * layout.bytes_per_token()
            row[f"{mode}_mbu"] = (weights + kv) / step / peak if peak else None
        row["speedup"] = row["eager_step_ms"] / row["graphs_step_ms"]
        rows.append(row)

    report = {
        "device": name,
        "peak_bandwidth": peak,
        "weight_bytes": weights,
        "dtype": args.dtype,
        "quantization": args.quantization,
        "compile": args.compile,
        "model": args.model,
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "rounds": args.rounds,
        "graphs_captured": len(graphs.graphs),
        "capture_s": graphs.capture_seconds,
        "capture_mib": graphs.capture_bytes / 2**20,
        "load_s": load_s,
        "greedy_tokens_equal": same_tokens,
        "rows": rows,
        "samples": {f"{m}-{b}": v for (m, b), v in samples.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))

    print(
        f"{name}; {weights / 1e9:.2f} GB of weights read per step ({args.dtype}); peak "
        f"{peak / 1e12 if peak else float('nan'):.2f} TB/s; {len(graphs.graphs)} graphs captured in "
        f"{graphs.capture_seconds:.1f} s ({graphs.capture_bytes / 2**20:.0f} MiB); "
        f"weights {args.dtype if args.quantization == 'none' else args.quantization}; compile {args.compile}; "
        f"greedy tokens equal: {same_tokens}"
    )
    print("| batch | graphs step ms | eager step ms | graphs tok/s | eager tok/s | graphs MBU | eager MBU | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        mbu = [f"{row[k] * 100:.0f} %" if row[k] is not None else "n/a" for k in ("graphs_mbu", "eager_mbu")]
        print(
            f"| {row['batch']} | {row['graphs_step_ms']:.2f} | {row['eager_step_ms']:.2f} | "
            f"{row['graphs_tokens_per_s']:.0f} | {row['eager_tokens_per_s']:.0f} | {mbu[0]} | {mbu[1]} | "
            f"{row['speedup']:.2f}x |"
        )


if __name__ == "__main__":
    main()
