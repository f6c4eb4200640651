"""One decode step's attention over all layers, native kernel against the torch path, for SmolLM2-135M's shape.

    python -m bench.decode_attention                     # B 1,16,64 x context ~64,~300,~1000, 7 rounds
    python -m bench.decode_attention --batch 16 --context 300 --rounds 9
    python -m bench.decode_attention --engine                 # whole decode steps of the real model
    python -m bench.decode_attention --folds scalar           # the kernel's narrower folds beside its best

SmolLM2-135M: 30 layers, 9 query heads over 3 kv heads of 64 (fp32); the engine's default block size
(16). Each row gets a seeded context length within 10 % of the nominal one, its blocks scattered over
the cache and its table padded (as the model runner pads a group to its widest row). A step is
``attention.attend_decode`` once per layer, each layer over its own cache where memory allows (at
most --cache-mib of caches; beyond that layers share, still far past the last-level cache); the
torch path's step includes its mask, made once per step as the engine makes it. Kernel and torch
take turns step by step, the order flipping each round. Reported: the median over all steps of
wall ms and of CPU ms (this process's CPU time) per step, and torch / kernel. Writes
bench/results/decode_attention.json. With --folds, the kernel's narrower folds (GOODPUT_DECODE_FOLD:
``avx2``, ``scalar``) take their turns too, reported as their CPU time over the best fold's.

With --engine, whole decode forward passes of the model runner instead (SmolLM2-135M-Instruct,
prepared, as bench/decode_step.py builds it: compact modules, eager, or compiled with --compiled),
one runner stepped with the kernel and without in turn, B sequences with seeded contexts (30-400
prompt tokens plus up to 96 generated, as decode_step draws them, or --context when given). Writes
bench/results/decode_attention-engine.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LAYERS, HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64
VARIANTS = ["native", "torch"]  # with --folds, "native-<fold>" after "native"


def make_case(b: int, context: int, block_size: int, cache_mib: int, seed: int):
    import torch

    from goodput_runtime.layers.attention import DecodeGroup

    rng = random.Random(seed)
    lens = [max(1, round(context * rng.uniform(0.9, 1.1))) for _ in range(b)]
    need = [-(-n // block_size) for n in lens]
    width = max(need)
    num_blocks = sum(need) + 1
    order = list(range(num_blocks))
    rng.shuffle(order)
    rows, taken = [], 0
    for n in need:
        rows.append(order[taken : taken + n] + [order[-1]] * (width - n))
        taken += n
    group = DecodeGroup(slice(0, b), torch.tensor(rows), torch.tensor(lens), block_size)
    layer_bytes = 2 * num_blocks * block_size * KV_HEADS * HEAD_DIM * 4
    distinct = max(1, min(LAYERS, cache_mib * 2**20 // layer_bytes))
    g = torch.Generator().manual_seed(seed)
    caches = [
        (
            torch.randn(num_blocks * block_size, KV_HEADS, HEAD_DIM, generator=g),
            torch.randn(num_blocks * block_size, KV_HEADS, HEAD_DIM, generator=g),
        )
        for _ in range(distinct)
    ]
    queries = [torch.randn(b, HEADS, HEAD_DIM, generator=g) for _ in range(LAYERS)]
    return group, caches, queries


def select(variant: str) -> None:
    """The decode path a variant names: native (its best fold), native-<fold>, or torch."""
    from goodput_runtime.layers import attention

    attention.DECODE_KERNEL = variant.partition("-")[0]
    if variant.startswith("native-"):
        os.environ["GOODPUT_DECODE_FOLD"] = variant.partition("-")[2]
    else:
        os.environ.pop("GOODPUT_DECODE_FOLD", None)


def step(variant: str, group, caches, queries) -> None:
    from goodput_runtime.layers import attention

    select(variant)
    mask = None
    if variant == "torch":
        j = group.lens.new_tensor(range(group.width))[None, :]
        mask = (j < group.lens[:, None])[:, None, None, :]
    for layer, query in enumerate(queries):
        k, v = caches[layer % len(caches)]
        attention.attend_decode(query, k, v, group, mask, None, True, None)  # type: ignore[arg-type]


def micro(args, cases: list[tuple[int, int]], block_size: int) -> dict:
    """Attention alone over every layer, kernel and torch path in turn: samples."""
    import torch

    samples: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    with torch.inference_mode():
        for b, c in cases:
            case = make_case(b, c, block_size, args.cache_mib, seed=b * 10007 + c)
            for variant in VARIANTS:
                step(variant, *case)  # untimed: first touch
            for r in range(args.rounds):
                order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
                for _ in range(args.steps):
                    for variant in order:
                        wall, cpu = time.perf_counter(), time.process_time()
                        step(variant, *case)
                        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                        samples.setdefault((variant, b, c), []).append((wall * 1e3, cpu * 1e3))
            print(f"B={b} context~{c} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    return samples


def engine(args) -> tuple[list[dict], dict]:
    """Model runner decode steps, kernel and torch path in turn: rows and samples."""
    import torch

    from bench.decode_step import BLOCK, build
    from goodput_runtime.engine.step import StepItem
    from goodput_runtime.tools import smollm2

    cache = REPO / smollm2.DEFAULT_CACHE
    model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    batches = [int(b) for b in args.batch.split(",")]
    contexts = [int(c) for c in args.context.split(",")] if args.context else [0]
    rng = random.Random(0)
    # longest first, as plan_step orders a step's decodes (the runner groups them in that order)
    lens = {
        (b, c): sorted((c if c else rng.randint(30, 400) + rng.randint(0, 96) for _ in range(b)), reverse=True)
        for b in batches
        for c in contexts
    }
    blocks_each = -(-(max(max(x) for x in lens.values()) + 1) // BLOCK)
    runner, startup = build(model, "compiled" if args.compiled else "compact", max(batches) * blocks_each)
    print(f"runner ready (compile and warm-up {startup:.1f} s)", flush=True)
    samples: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for (b, c), ctx in lens.items():
                items = [
                    StepItem(
                        [rng.randrange(100, 40000)], n - 1, list(range(i * blocks_each, (i + 1) * blocks_each)), True
                    )
                    for i, n in enumerate(ctx)
                ]
                for variant in order:
                    select(variant)
                    runner.execute(items)  # untimed
                for _ in range(args.steps):
                    for variant in order:
                        select(variant)
                        wall, cpu = time.perf_counter(), time.process_time()
                        runner.execute(items)
                        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                        samples.setdefault((variant, b, c), []).append((wall * 1e3, cpu * 1e3))
            print(f"round {r + 1} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    return [{"batch": b, "context": c} for b, c in lens], samples


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,16,64")
    p.add_argument(
        "--context",
        default=None,
        help="nominal context lengths (default 64,300,1000; with --engine, "
        "drawn per sequence as bench/decode_step.py draws them)",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="steps per variant, case and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache-mib", type=int, default=1024)
    p.add_argument("--engine", action="store_true", help="whole decode steps of the model runner")
    p.add_argument("--compiled", action="store_true", help="with --engine: the layers compiled")
    p.add_argument("--folds", default="", help="the kernel's narrower folds to time too: avx2, scalar")
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args(argv)
    folds = [f for f in args.folds.split(",") if f]
    if any(f not in ("avx2", "scalar") for f in folds):
        p.error("--folds takes avx2 and scalar")
    VARIANTS[:] = ["native", *(f"native-{f}" for f in folds), "torch"]
    name = "decode_attention-engine" if args.engine else "decode_attention"
    args.output = args.output or REPO / "bench" / "results" / f"{name}.json"
    import torch

    from goodput_runtime.config import EngineConfig
    from goodput_runtime.layers import native_attention

    torch.set_num_threads(args.threads)
    block_size = EngineConfig(model="").block_size
    started = time.monotonic()
    if not native_attention.available():
        raise SystemExit("the native kernel cannot be built here")
    load_s = time.monotonic() - started
    print(f"kernel ready in {load_s:.1f} s (a build when not cached); block size {block_size}", flush=True)
    load_before = [round(x, 2) for x in os.getloadavg()]
    if args.engine:
        cases_rows, samples = engine(args)
        cases = [(row["batch"], row["context"]) for row in cases_rows]
    else:
        contexts = args.context or "64,300,1000"
        cases = [(b, c) for b in map(int, args.batch.split(",")) for c in map(int, contexts.split(","))]
        samples = micro(args, cases, block_size)
    rows = []
    for b, c in cases:
        row: dict[str, float | int] = {"batch": b, "context": c}
        for variant in VARIANTS:
            s = samples[(variant, b, c)]
            row[f"{variant}_wall_ms"] = statistics.median(w for w, _ in s)
            row[f"{variant}_cpu_ms"] = statistics.median(x for _, x in s)
            row[f"{variant}_cpu_ms_min"] = min(x for _, x in s)
        row["wall_ratio"] = row["torch_wall_ms"] / row["native_wall_ms"]
        row["cpu_ratio"] = row["torch_cpu_ms"] / row["native_cpu_ms"]
        for f in folds:
            row[f"{f}_cpu_ratio"] = row[f"native-{f}_cpu_ms"] / row["native_cpu_ms"]
        rows.append(row)
    load_after = [round(x, 2) for x in os.getloadavg()]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "block_size": block_size,
                "shape": {
                    "layers": LAYERS,
                    "heads": HEADS,
                    "kv_heads": KV_HEADS,
                    "head_dim": HEAD_DIM,
                    "dtype": "float32",
                },
                "rows": rows,
                "samples": {f"{v}@{b}x{c}": s for (v, b, c), s in samples.items()},
                "loadavg_before": load_before,
                "loadavg_after": load_after,
            },
            indent=1,
        )
    )
    what = "decode forward passes of the model runner" if args.engine else f"attention alone, {LAYERS} layers"
    print(
        f"\n{what} per step; {args.rounds} rounds x {args.steps} steps per variant; {args.threads} threads; "
        f"load average before {load_before}, after {load_after}"
    )
    print(
        "| B | context | native wall ms | torch wall ms | torch/native wall | native CPU ms | torch CPU ms "
        "| torch/native CPU | CPU min native / torch |" + "".join(f" {f}/native CPU |" for f in folds)
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(folds))
    for row in rows:
        context = f"~{row['context']}" if row["context"] else "30-496"
        print(
            f"| {row['batch']} | {context} | {row['native_wall_ms']:.2f} | {row['torch_wall_ms']:.2f} | "
            f"{row['wall_ratio']:.2f}x | {row['native_cpu_ms']:.2f} | {row['torch_cpu_ms']:.2f} | "
            f"{row['cpu_ratio']:.2f}x | {row['native_cpu_ms_min']:.2f} / {row['torch_cpu_ms_min']:.2f} |"
            + "".join(f" {row[f'{f}_cpu_ratio']:.2f}x |" for f in folds)
        )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
