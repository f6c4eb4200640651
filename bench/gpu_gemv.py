"""Batch-1 projections on a GPU: cuBLAS (F.linear) against the Triton GEMV, per shape and per tile.

    python -m bench.gpu_gemv [--shapes 2560x2048,...] [--dtype bfloat16]

The default shapes are a 1B Llama's (TinyLlama's: hidden 2048, 256-wide kv projections, MLP 5632,
vocabulary 32,000): fused qkv, output, fused gate-up, down, LM head. Each product is timed as a
decode step runs it: launches captured into a CUDA graph over copies of the weight that together
exceed the L2 cache (layers/triton_linear.replay_seconds), so each reads its weight from memory.
For each shape: cuBLAS, every tile of a grid, and the tile `triton_linear.tune` picks from its
candidates (what the engine would use), as µs per call and the weight's bytes over that time. The
last row weighs each shape by its count in a step (22 layers and one head).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
from pathlib import Path

import torch
from torch.nn import functional as F

from goodput_runtime.layers import triton_linear

ONE_B = "2560x2048,2048x2048,11264x2048,2048x5632,32000x2048"
GRID = [c for c in itertools.product((1, 2, 4, 8, 16, 32), (256, 512, 1024, 2048), (4, 8)) if c[0] * c[1] <= 8192]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=ONE_B, help="NxK,... (weight rows x columns)")
    p.add_argument("--layers", type=int, default=22, help="each shape but the last counts this many times a step")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", default="bench/results/gpu_gemv.json")
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = torch.device("cuda")
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    size = dtype.itemsize
    rows = []
    picked = triton_linear.tune(shapes, dtype, device)
    for n, k in shapes:
        weights = triton_linear.weight_copies(n, k, dtype, device)
        x = torch.randn(1, k, dtype=dtype, device=device)
        expected = F.linear(x.double(), weights[0].double())
        tuned, tuned_s = picked.get((n, k), (triton_linear.DEFAULT, float("nan")))  # (a small weight: untimed)
        error = (
            (triton_linear.gemv(x, weights[0], None, tuned).double() - expected).abs().max() / expected.abs().max()
        ).item()
        cublas = triton_linear.replay_seconds([functools.partial(F.linear, x, w) for w in weights])
        grid = {
            c: triton_linear.replay_seconds([functools.partial(triton_linear.gemv, x, w, None, c) for w in weights])
            for c in GRID
        }
        best = min(grid, key=grid.__getitem__)
        tuned_s = grid.get(tuned, tuned_s)
        bytes_ = n * k * size
        rows.append(
            {
                "shape": [n, k],
                "bytes": bytes_,
                "cublas_us": cublas * 1e6,
                "tuned": list(tuned),
                "tuned_us": tuned_s * 1e6,
                "best": list(best),
                "best_us": grid[best] * 1e6,
                "relative_error": error,
                "grid_us": {"{}x{}-w{}".format(*c): t * 1e6 for c, t in grid.items()},
            }
        )
        del weights
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"device": name, "dtype": args.dtype, "rows": rows}, indent=2))
    print(f"{name}, {args.dtype}, one-row products, CUDA-graph replays over weights beyond L2")
    print("| weight N x K | MB | cuBLAS µs (TB/s) | GEMV tuned µs (TB/s) | tile | best of grid µs | tile | speed-up |")
    print("|---|---:|---:|---:|---|---:|---|---:|")
    for r in rows:
        mb = r["bytes"] / 1e6  # MB per µs is TB/s
        print(
            f"| {r['shape'][0]} x {r['shape'][1]} | {mb:.1f} | {r['cublas_us']:.1f} ({mb / r['cublas_us']:.2f}) | "
            f"{r['tuned_us']:.1f} ({mb / r['tuned_us']:.2f}) | {'x'.join(map(str, r['tuned']))} | "
            f"{r['best_us']:.1f} | {'x'.join(map(str, r['best']))} | {r['cublas_us'] / r['tuned_us']:.2f}x |"
        )
    counts = [args.layers] * (len(rows) - 1) + [1]
    cublas_step = sum(c * r["cublas_us"] for c, r in zip(counts, rows, strict=True))
    tuned_step = sum(c * r["tuned_us"] for c, r in zip(counts, rows, strict=True))
    step_bytes = sum(c * r["bytes"] for c, r in zip(counts, rows, strict=True))
    print(
        f"a step's products ({args.layers} layers and the head, {step_bytes / 1e9:.2f} GB): cuBLAS "
        f"{cublas_step / 1e3:.3f} ms ({step_bytes / cublas_step / 1e6:.2f} TB/s), GEMV {tuned_step / 1e3:.3f} ms "
        f"({step_bytes / tuned_step / 1e6:.2f} TB/s), {cublas_step / tuned_step:.2f}x"
    )
    print(
        "max relative error of the tuned GEMV against float64:", ", ".join(f"{r['relative_error']:.1e}" for r in rows)
    )


if __name__ == "__main__":
    main()
