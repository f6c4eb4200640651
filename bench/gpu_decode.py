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

`--reference static` (the default) adds a third contender in the same rounds: transformers' model
over its static KV cache with the decode step under `torch.compile(mode="reduce-overhead")`
(`bench/static_reference.py`), on the same prompts. The table gives ours over it per batch size.
`--prefill-len` (default 2048) times one prefill of that many tokens in both and reports MFU
against the card's dense bf16 peak.
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


# datasheet dense bf16 tensor-core FLOP/s (no sparsity)
PEAK_FLOPS = {
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H200": 989e12,
    "A100": 312e12,
    "L4": 121e12,
}


def peak_bandwidth(name: str) -> float | None:
    return next((bw for key, bw in PEAK_BANDWIDTH.items() if key in name), None)


def peak_flops(name: str) -> float | None:
    return next((f for key, f in PEAK_FLOPS.items() if key in name), None)


def prefill_flops(config: object, weights: int, element_size: int, tokens: int) -> float:
    """Multiply-adds of one causal prefill, as FLOPs: 2 per weight per token, and the attention
    scores and values over the causal half of the square."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    width = heads * (getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2.0 * (weights / element_size) * tokens + 2.0 * 2 * layers * width * tokens * tokens / 2


def prompts_for(vocab: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(prompt_len)] for _ in range(batch)]


def weight_bytes_per_step(core: EngineCore) -> int:
    model = core.runner.model
    embed = model.get_input_embeddings().weight
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()] if t is not embed)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode_round(core: EngineCore, prompts: list[list[int]], steps: int, seed: int) -> dict:
    batch = len(prompts)
    params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{seed}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts, strict=True):
        core.add(rid, prompt, params)
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


def prefill_seconds(core: EngineCore, prompt: list[int]) -> float:
    """One prefill of the whole prompt (it fits one step's token budget), first token out."""
    core.add(f"prefill-{len(prompt)}-{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    sync()
    started = time.perf_counter()
    while core.has_unfinished():
        core.step()
    sync()
    return time.perf_counter() - started


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean share of each sequence's greedy tokens that agree before the first difference (random
    weights in bfloat16 have near-ties, so two correct implementations may part after a while)."""
    shares = []
    for x, y in zip(a, b, strict=False):
        n = min(len(x), len(y))
        same = next((i for i in range(n) if x[i] != y[i]), n)
        shares.append(same / max(1, n))
    return statistics.mean(shares) if shares else 0.0


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
    parser.add_argument(
        "--reference", choices=["static", "none"], default="static", help="transformers static-cache reference"
    )
    parser.add_argument("--reference-compile", default="reduce-overhead", help="torch.compile mode for it, or none")
    parser.add_argument("--prefill-len", type=int, default=2048, help="tokens of the timed prefill (0: none)")
    parser.add_argument("--out", default="bench/results/gpu_decode.json")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    peak = args.peak_bandwidth or peak_bandwidth(name)
    flops_peak = peak_flops(name)
    max_len = max(args.prompt_len + args.steps + 64, args.prefill_len + 8)

    engines: dict[str, EngineCore] = {}
    load_s = {}
    for mode in ("graphs", "eager"):
        started = time.monotonic()
        engines[mode] = build_core(
            EngineConfig(
                model=args.model,
                device=args.device,
                dtype=args.dtype,
                max_model_len=max_len,
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(2048, args.prefill_len, args.prompt_len * max(batches)),
                kv_cache_memory=args.kv_cache_memory,
                enforce_eager=mode == "eager",
                quantization=args.quantization,
                compile=args.compile,
            )
        )
        load_s[mode] = time.monotonic() - started
    if args.device == "cpu":
        engines["graphs"].runner.enable_decode_graphs(max(batches), max_len, capture=False)
    graphs = engines["graphs"].runner.graphs
    assert graphs is not None
    weights = weight_bytes_per_step(engines["graphs"])
    layout = engines["graphs"].runner.layout
    vocab = engines["graphs"].runner.model.config.vocab_size
    reference = None
    if args.reference == "static":
        from bench.static_reference import StaticReference

        mode = None if args.reference_compile == "none" else args.reference_compile
        reference = StaticReference(args.model, args.device, args.dtype, max_len, compile_mode=mode)
        load_s["reference"] = reference.load_s
    modes = ("graphs", "eager", "reference") if reference else ("graphs", "eager")

    samples: dict[tuple[str, int], list[float]] = {}
    same_tokens = True
    agree: dict[int, list[float]] = {}
    for r in range(args.rounds):
        for batch in batches:
            order = modes if r % 2 == 0 else modes[::-1]
            outputs = {}
            prompts = prompts_for(vocab, batch, args.prompt_len, seed=1000 * r + batch)
            for mode in order:
                if mode == "reference":
                    assert reference is not None
                    result = reference.run(prompts, args.steps)
                else:
                    result = decode_round(engines[mode], prompts, args.steps, seed=1000 * r + batch)
                samples.setdefault((mode, batch), []).append(result["step_s"])
                outputs[mode] = result["tokens"]
            same_tokens &= outputs["graphs"] == outputs["eager"]
            if reference:
                agree.setdefault(batch, []).append(agreement(outputs["graphs"], outputs["reference"]))

    prefill: dict = {}
    if args.prefill_len:
        prompt = prompts_for(vocab, 1, args.prefill_len, seed=7)[0]
        config = engines["graphs"].runner.model.config
        element = next(engines["graphs"].runner.model.parameters()).element_size()
        flops = prefill_flops(config, weights, element, args.prefill_len)
        times: dict[str, list[float]] = {"ours": []}
        prefill_seconds(engines["graphs"], prompt)  # warm: the prefill's kernels for this length
        if reference:
            times["reference"] = []
            reference.run([prompt], 0, warm=0)
        for _ in range(max(2, args.rounds)):
            times["ours"].append(prefill_seconds(engines["graphs"], prompt))
            if reference:
                times["reference"].append(reference.run([prompt], 0, warm=0)["prefill_s"])
        for who, ts in times.items():
            t = statistics.median(ts)
            prefill[who] = {
                "seconds": t,
                "tokens_per_s": args.prefill_len / t,
                "mfu": flops / t / flops_peak if flops_peak else None,
            }
        prefill["tokens"] = args.prefill_len
        prefill["flops"] = flops

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
        if reference:
            step = statistics.median(samples[("reference", batch)])
            row["reference_step_ms"] = step * 1e3
            row["reference_tokens_per_s"] = batch / step
            row["reference_mbu"] = (weights + kv) / step / peak if peak else None
            row["ours_over_reference"] = row["reference_step_ms"] / row["graphs_step_ms"]
            row["greedy_agreement_with_reference"] = statistics.mean(agree[batch])
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
        "reference": None
        if not reference
        else {
            "compile_mode": reference.compile_mode,
            "fullgraph": reference.fullgraph,
            "compile_s": reference.compile_s,
        },
        "peak_flops": flops_peak,
        "prefill": prefill,
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
    if reference:
        print(f"\nreference: transformers static cache, torch.compile mode {reference.compile_mode}")
        print("| batch | ours step ms | reference step ms | reference MBU | ours / reference | greedy agreement |")
        print("|---:|---:|---:|---:|---:|---:|")
        for row in rows:
            mbu = f"{row['reference_mbu'] * 100:.0f} %" if row["reference_mbu"] is not None else "n/a"
            print(
                f"| {row['batch']} | {row['graphs_step_ms']:.2f} | {row['reference_step_ms']:.2f} | {mbu} | "
                f"{row['ours_over_reference']:.2f}x | {row['greedy_agreement_with_reference']:.2f} |"
            )
    if prefill:
        print(f"\nprefill of {prefill['tokens']} tokens ({prefill['flops'] / 1e12:.2f} TFLOP):")
        for who in ("ours", "reference"):
            if who in prefill:
                p = prefill[who]
                mfu = f"{p['mfu'] * 100:.0f} %" if p["mfu"] is not None else "n/a"
                print(f"  {who}: {p['seconds'] * 1e3:.1f} ms, {p['tokens_per_s']:.0f} tok/s, MFU {mfu}")


if __name__ == "__main__":
    main()
