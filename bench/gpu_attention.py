"""Decode attention on a GPU: the torch path against the Triton kernel, per layer.

    python -m bench.gpu_attention                 # a 1B Llama's attention shape, bf16

The torch path of a decode step, per layer: two ``index_copy_`` cache writes, two block gathers and
``scaled_dot_product_attention``. The Triton kernel (``layers/triton_attention.py``) stores the new
keys and values and attends over the blocks where they lie, in one launch. Each variant is
captured as one CUDA graph of ``--layers`` calls, each on its own layer's cache as in a model, and
the graph replayed; the figure is the replay time over the calls. Each variant's output is
checked against the torch path's (largest absolute difference) and the GB/s counts the keys and
values read. ``--tiles`` sweeps the kernel's keys per loop iteration with one program per sequence
and kv head; the last column is the kernel as the engine runs it (its tile, and the context split
across programs where ``splits_for`` says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from goodput_runtime.layers import attention, triton_attention
from goodput_runtime.layers.attention import DecodeGroup, KVCache, PagedBatch


def case(
    batch: int,
    context: int,
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    block_size: int,
    seed: int,
) -> tuple[PagedBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decode step of `batch` sequences at about `context` tokens (±25 %), blocks shuffled."""
    g = torch.Generator().manual_seed(seed)
    lens = [max(1, int(context * (0.75 + 0.5 * torch.rand(1, generator=g).item()))) for _ in range(batch)]
    width = -(-max(lens) // block_size)
    num_blocks = batch * width + 1
    cache = KVCache.allocate(layers, num_blocks * block_size, kv_heads, head_dim, dtype, torch.device("cuda"))
    for t in cache.keys + cache.values:
        t.normal_()
    order = torch.randperm(num_blocks, generator=g)
    blocks = order[: batch * width].view(batch, width).cuda()
    lens_t = torch.tensor(lens).cuda()
    slots = torch.tensor(
        [int(blocks[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size for i, n in enumerate(lens)]
    ).cuda()
    group = DecodeGroup(slice(0, batch), blocks, lens_t, block_size)
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype).cuda()
    k = torch.randn(batch, kv_heads, head_dim, generator=g).to(dtype).cuda()
    v = torch.randn(batch, kv_heads, head_dim, generator=g).to(dtype).cuda()
    return PagedBatch(cache, slots, decodes=[group]), q, k, v


def timed(batch: PagedBatch, q, k, v, layers: int, replays: int) -> tuple[float, torch.Tensor]:
    """Seconds per call (graph replays of `layers` calls), and layer 0's output."""

    def step():
        return [attention.attend(batch, layer, q, k, v) for layer in range(layers)]

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / replays / layers)
    return statistics.median(times), outs[0].float().clone()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", default="1,16,64")
    parser.add_argument("--contexts", default="256,1024,4096")
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiles", default="64,128,256")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--out", default="bench/results/gpu_attention.json")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        for context in (int(x) for x in args.contexts.split(",")):
            batch, q, k, v = case(
                b, context, args.layers, args.heads, args.kv_heads, args.head_dim, dtype, 16, seed=b * 7919 + context
            )
            kv_bytes = (
                sum(int(n) for n in batch.decodes[0].lens.tolist())
                * args.kv_heads
                * args.head_dim
                * 2
                * q.element_size()
            )
            row: dict = {"batch": b, "context": context, "kv_bytes": kv_bytes}
            attention.DECODE_KERNEL = "torch"
            row["torch_us"], reference = timed(batch, q, k, v, args.layers, args.replays)
            attention.DECODE_KERNEL = "auto"
            variants = [(f"triton{t}", t, 1) for t in (int(x) for x in args.tiles.split(","))]
            for name, tile, splits in [*variants, ("engine", None, None)]:
                triton_attention.TILE, triton_attention.SPLITS = tile, splits
                seconds, out = timed(batch, q, k, v, args.layers, args.replays)
                row[f"{name}_us"] = seconds
                row[f"{name}_err"] = (out - reference).abs().max().item()
            triton_attention.TILE = triton_attention.SPLITS = None
            width = batch.decodes[0].width
            row["engine_tile"] = triton_attention.tile()
            row["engine_splits"] = triton_attention.splits_for(b, args.kv_heads, width)
            rows.append(row)
    for row in rows:
        for key in list(row):
            if key.endswith("_us"):
                row[key] *= 1e6
    device = torch.cuda.get_device_name()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(
            {
                "device": device,
                "dtype": args.dtype,
                "layers": args.layers,
                "heads": args.heads,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "rows": rows,
            },
            indent=2,
        )
    )
    tiles = [int(x) for x in args.tiles.split(",")]
    print(
        f"{device}; {args.dtype}; {args.heads} heads on {args.kv_heads} kv heads of {args.head_dim}; "
        f"us per layer (graph replays of {args.layers} layers)"
    )
    names = [f"triton{t}" for t in tiles] + ["engine"]
    print(
        "| batch | context | torch path us | "
        + " | ".join(f"tile {t}, 1 split us" for t in tiles)
        + " | as the engine runs it us | its speed-up | its GB/s | max abs diff |"
    )
    print("|---:|---:|---:|" + "---:|" * len(tiles) + "---:|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['batch']} | {row['context']} | {row['torch_us']:.1f} | "
            + " | ".join(f"{row[f'triton{t}_us']:.1f}" for t in tiles)
            + f" | {row['engine_us']:.1f} (tile {row['engine_tile']}, {row['engine_splits']} splits) | "
            f"{row['torch_us'] / row['engine_us']:.2f}x | {row['kv_bytes'] / row['engine_us'] / 1e3:.0f} | "
            f"{max(row[f'{n}_err'] for n in names):.3g} |"
        )


if __name__ == "__main__":
    main()
