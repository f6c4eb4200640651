"""Where a GPU decode step's time goes: kernels per step and their device time, per variant.

    python -m bench.gpu_profile --model .cache/models/llama-1b

A variant names, joined by `+`, how decode attends: `triton` (the Triton kernel over the paged
cache, the CUDA default), or the torch path with the cache's blocks read by `index_select` or
`index` (advanced indexing over 8-byte words), then `cublas` (batch 1's products through cuBLAS, not
the Triton GEMV of layers/triton_linear.py), `nofuse` (the GEMV for the products alone: norms, SiLU
x up and residual sums as their own kernels, not folded into the products), `nopdl` (the GEMVs
launched without programmatic dependent launch; `pdlearly`: each also lets the next start at once),
`attnpdl` (the attention kernel launched with it as well), `compile` (`--compile`: the compact
modules' norms, rotary embedding and MLP activation fused by inductor) and `fp8` (fp8 weights). For
each: the replayed CUDA-graph step time at each batch size, its MBU, and one step run eagerly over
the same static buffers under torch.profiler, counting its kernels and summing their device time.
The step time less the kernel time is what the graph still loses between kernels; the kernel time
over the bytes is what the kernels themselves lose.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.gpu_decode import agreement, decode_round, peak_bandwidth, prompts_for, weight_bytes_per_step
from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.layers import attention, triton_attention, triton_linear


def kernel_profile(core, batch: int, context: int) -> tuple[int, float, str]:
    """Kernels of one static-buffer decode step run eagerly: count, device ms, the top of the table."""
    graphs = core.runner.graphs
    shape = graphs.shape_for(batch, context)
    with torch.inference_mode():
        graphs._run(shape)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs._run(shape)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.device_time for e in kernels)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    return len(kernels), total_us / 1e3, table


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="index,triton,index+compile,triton+compile")
    p.add_argument("--batch-sizes", default="1,64")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results/gpu_profile.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    name = torch.cuda.get_device_name()
    peak = peak_bandwidth(name)
    rows, tables = [], {}
    firsts: dict[int, list[list[int]]] = {}  # the first variant's greedy tokens, per batch
    for variant in args.variants.split(","):
        parts = variant.split("+")
        # captured into this engine's graphs
        attention.DECODE_KERNEL = "auto" if parts[0] == "triton" else "torch"
        attention.GATHER = "auto" if parts[0] == "triton" else parts[0]
        triton_linear.ENABLED = "cublas" not in parts  # one-row products: the Triton GEMV unless named
        triton_linear.FUSE = "nofuse" not in parts  # the layer as a chain of four GEMVs, unless named
        # the GEMVs launched with programmatic dependent launch (layers/triton_linear.PDL)
        triton_linear.PDL = "off" if "nopdl" in parts else "early" if "pdlearly" in parts else "wait"
        triton_attention.PDL = "attnpdl" in parts  # the attention kernel too (layers/triton_attention.PDL)
        core = build_core(
            EngineConfig(
                model=args.model,
                device="cuda",
                dtype=args.dtype,
                max_model_len=args.prompt_len + args.steps + 64,
                max_num_seqs=max(batches),
                max_num_batched_tokens=max(2048, args.prompt_len * max(batches)),
                kv_cache_memory=2 << 30,
                compile="compile" in parts,
                quantization="fp8" if "fp8" in parts else "none",
            )
        )
        weights = weight_bytes_per_step(core)
        layout = core.runner.layout
        for batch in batches:
            vocab = core.runner.model.config.vocab_size
            done = [
                decode_round(core, prompts_for(vocab, batch, args.prompt_len, seed=r), args.steps, seed=r)
                for r in range(args.rounds)
            ]
            step = statistics.median(d["step_s"] for d in done)
            firsts.setdefault(batch, done[0]["tokens"])
            count, kernel_ms, table = kernel_profile(core, batch, args.prompt_len + args.steps)
            kv = batch * (args.prompt_len + args.steps / 2) * layout.bytes_per_token()
            rows.append(
                {
                    "variant": variant,
                    "batch": batch,
                    "step_ms": step * 1e3,
                    "tokens_per_s": batch / step,
                    "mbu": (weights + kv) / step / peak if peak else None,
                    "kernels": count,
                    "kernel_ms": kernel_ms,
                    "floor_ms": (weights + kv) / peak * 1e3 if peak else None,
                    "agreement_with_first": agreement(done[0]["tokens"], firsts[batch]),
                }
            )
            tables[f"{variant}-{batch}"] = table
        del core
        torch.cuda.empty_cache()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps({"device": name, "model": args.model, "dtype": args.dtype, "rows": rows, "tables": tables}, indent=2)
    )
    for key, table in tables.items():
        print(f"--- {key}\n{table}")
    print(f"{name}, {args.dtype}, prompt {args.prompt_len}, {args.steps} decode steps")
    print(
        "| variant | batch | graph step ms | floor ms | MBU | tok/s | kernels/step | kernel ms "
        "| tokens as the first's |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        mbu = f"{r['mbu'] * 100:.0f} %" if r["mbu"] is not None else "n/a"
        print(
            f"| {r['variant']} | {r['batch']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | {mbu} | "
            f"{r['tokens_per_s']:.0f} | {r['kernels']} | {r['kernel_ms']:.2f} | {r['agreement_with_first']:.0%} |"
        )


if __name__ == "__main__":
    main()
