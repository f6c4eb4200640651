"""Decode forward-pass time of the model runner alone, for A/B comparisons of the model paths.

    python -m bench.decode_step --batch 1,16,64 --steps 8 --rounds 3
    python -m bench.decode_step --variants transformers,compact      # leave compilation out
    python -m bench.decode_step --variants compact,onednn,native --batch 1,2,4,8,16,32,64   # the product forms

In one process, one model runner per variant: transformers' modules (`transformers`), the
runtime's compact modules (`compact`), and the compact modules with their layers compiled
(`compiled`, whose start-up compile time is reported), and the compact modules with every
projection in one form of layers/step_plan.py (`transposed`, `onednn`, `native`; `compact` is
F.linear). Each batch size gets decode steps of
B sequences with seeded context lengths (30-400 prompt tokens plus up to 96 generated) over
a KV cache whose values do not matter for speed; variants take turns step by step, the order
flipping each round. Reported per variant and batch: the median over every step of wall ms
and of CPU ms (this process's CPU time: less sensitive to other load on a shared machine), the
least CPU ms of any step (the figure other load disturbs least), and CPU ratios against the
first variant.
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
BLOCK = 16


def build(model_dir: str, variant: str, num_blocks: int, threads: int = 2):
    import torch

    from goodput_runtime.engine.model_runner import ModelRunner
    from goodput_runtime.layers import attention
    from goodput_runtime.layers.step_plan import FORMS, ONEDNN, StepPlan
    from goodput_runtime.loader import load_model
    from goodput_runtime.models import implementation

    model = load_model(Path(model_dir), torch.float32, torch.device("cpu"), attention.register())
    model = implementation.choose(model, "transformers" if variant == "transformers" else "auto")
    runner = ModelRunner(model, num_blocks, BLOCK)
    startup = 0.0
    if variant in FORMS:  # every projection in this form, on the bench's threads
        if variant == ONEDNN and not model.pack_weights():
            raise SystemExit("cannot pack weights for oneDNN here")
        runner.set_plan(StepPlan.uniform(threads, variant, limit=1 << 20))
    if variant == "compiled":
        reason = model.compile_layers()
        if reason:
            raise SystemExit(f"cannot compile: {reason}")
        started = time.monotonic()
        runner.warm_up()
        startup = time.monotonic() - started
    return runner, startup


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--steps", type=int, default=8, help="forward passes per variant, batch and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variants", default="transformers,compact,compiled")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "decode_step.json")
    args = p.parse_args(argv)
    import torch

    from goodput_runtime.engine.step import StepItem

    torch.set_num_threads(args.threads)
    if args.model is None:
        from goodput_runtime.tools import smollm2

        cache = REPO / smollm2.DEFAULT_CACHE
        args.model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    batches = [int(b) for b in args.batch.split(",")]
    names = args.variants.split(",")
    rng = random.Random(0)
    contexts = {b: [rng.randint(30, 400) + rng.randint(0, 96) for _ in range(b)] for b in batches}
    blocks_each = -(-(400 + 97) // BLOCK)
    num_blocks = max(batches) * blocks_each
    load_before = [round(x, 2) for x in os.getloadavg()]
    runners, startup = {}, {}
    for name in names:
        runners[name], startup[name] = build(args.model, name, num_blocks, args.threads)
        print(f"{name}: ready (compile and warm-up {startup[name]:.1f} s)", flush=True)
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with torch.inference_mode():
        for r in range(args.rounds):
            order = names if r % 2 == 0 else list(reversed(names))
            for b in batches:
                items = [
                    StepItem(
                        [rng.randrange(100, 40000)], ctx - 1, list(range(i * blocks_each, (i + 1) * blocks_each)), True
                    )
                    for i, ctx in enumerate(contexts[b])
                ]
                for name in order:
                    runners[name].execute(items)  # one untimed pass: this shape's first
                for _ in range(args.steps):
                    for name in order:  # step by step in turn: other load on the machine hits every variant
                        wall, cpu = time.perf_counter(), time.process_time()
                        runners[name].execute(items)
                        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                        samples.setdefault((name, b), []).append((wall * 1e3, cpu * 1e3))
            print(f"round {r + 1} done, load average {os.getloadavg()[0]:.2f}", flush=True)
    load_after = [round(x, 2) for x in os.getloadavg()]
    rows = [
        {
            "variant": name,
            "batch": b,
            "wall_ms": statistics.median(w for w, _ in samples[(name, b)]),
            "cpu_ms": statistics.median(c for _, c in samples[(name, b)]),
            "cpu_ms_min": min(c for _, c in samples[(name, b)]),
            "startup_s": startup[name],
        }
        for name in names
        for b in batches
    ]
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "rows": rows,
                "samples": {f"{n}@{b}": s for (n, b), s in samples.items()},
                "loadavg_before": load_before,
                "loadavg_after": load_after,
            },
            indent=1,
        )
    )
    print(
        f"\n{args.steps} forward passes per variant, batch and round; {args.rounds} rounds; {args.threads} threads; "
        f"load average before {load_before}, after {load_after}"
    )
    print(
        f"| variant | batch | wall ms/step p50 | CPU ms/step p50 | CPU ms/step min | CPU p50 vs {names[0]} "
        f"| CPU min vs {names[0]} | compile + warm-up |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        base = next(x for x in rows if x["variant"] == names[0] and x["batch"] == row["batch"])
        print(
            f"| {row['variant']} | {row['batch']} | {row['wall_ms']:.0f} | {row['cpu_ms']:.0f} | "
            f"{row['cpu_ms_min']:.0f} | {row['cpu_ms'] / base['cpu_ms']:.2f}x | "
            f"{row['cpu_ms_min'] / base['cpu_ms_min']:.2f}x | {row['startup_s']:.1f} s |"
        )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
