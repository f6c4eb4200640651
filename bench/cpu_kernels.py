"""The CPU prompt-attention kernel and the fused element-wise functions, each against what it replaces.

    python -m bench.cpu_kernels                  # both parts, 7 rounds of attention, 3 of engine steps
    python -m bench.cpu_kernels --part attention --rounds 9
    python -m bench.cpu_kernels --part engine

`attention`: one layer's attention of one prompt chunk, SmolLM2-135M's shape (9 query heads over 3
kv heads of 64, fp32, block size 16), through ``attention.attend`` with the native kernel and with
``GOODPUT_PREFILL_ATTENTION=torch``'s path (SDPA, causal; after cached tokens the context gathered
first, with a mask), in turns, the order flipping each round: prompts of 64, 300 and 1000 tokens
from position 0, and 256 tokens after 512 cached. Reported: median ms per layer and GFLOP/s (the
causal product's 2 x 2 x heads x D x n x (start + (n + 1) / 2) flops).

`engine`: whole steps of the real model (SmolLM2-135M-Instruct, prepared; `EngineCore` on a thread of
its own, as the server steps it), one fresh process per setting, the settings in turns, the order
flipping each round: a decode step of 16 sequences (16-token prompts; the median of 40 steps) and a
prompt step of 2048 tokens (8 prompts of 256; the least of 3). Settings: everything on; the fused
functions off (``GOODPUT_FUSED_OPS=off``); the prompt kernel off (``GOODPUT_PREFILL_ATTENTION=torch``);
both off. Writes bench/results/cpu_kernels.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CHUNKS = ((0, 64), (0, 300), (0, 1000), (512, 256))  # (cached tokens, chunk tokens)
SETTINGS = {
    "on": {},
    "fused off": {"GOODPUT_FUSED_OPS": "off"},
    "prompt kernel off": {"GOODPUT_PREFILL_ATTENTION": "torch"},
    "both off": {"GOODPUT_FUSED_OPS": "off", "GOODPUT_PREFILL_ATTENTION": "torch"},
}


def attention_part(rounds: int, threads: int) -> list[dict]:
    import torch

    from goodput_runtime.layers import attention, native_attention
    from goodput_runtime.layers.attention import KVCache, PagedBatch, PrefillChunk

    torch.set_num_threads(threads)
    if not native_attention.available():
        raise SystemExit("the native extension cannot be built here")
    rows = []
    for start, n in CHUNKS:
        g = torch.Generator().manual_seed(start + n)
        slots = torch.randperm(start + n + 64, generator=g)[: start + n]
        cache = KVCache(
            [torch.randn(start + n + 64, KV_HEADS, HEAD_DIM, generator=g)],
            [torch.randn(start + n + 64, KV_HEADS, HEAD_DIM, generator=g)],
        )
        batch = PagedBatch(cache, slots[start:], prefills=[PrefillChunk(slice(0, n), start, slots if start else None)])
        q = torch.randn(n, HEADS, HEAD_DIM, generator=g)
        k, v = torch.randn(n, KV_HEADS, HEAD_DIM, generator=g), torch.randn(n, KV_HEADS, HEAD_DIM, generator=g)
        times: dict[str, list[float]] = {"native": [], "torch": []}
        repeats = max(3, int(3000 / n))
        for r in range(rounds):
            for variant in ("native", "torch") if r % 2 == 0 else ("torch", "native"):
                attention.PREFILL_KERNEL = "auto" if variant == "native" else "torch"
                attention.attend(batch, 0, q, k, v)  # untimed: caches, masks
                started = time.perf_counter()
                for _ in range(repeats):
                    batch.masks.clear()  # made once per step, as the engine makes them
                    attention.attend(batch, 0, q, k, v)
                times[variant].append((time.perf_counter() - started) / repeats)
        flops = 4 * HEADS * HEAD_DIM * n * (start + (n + 1) / 2)
        row = {"cached": start, "tokens": n}
        for variant, values in times.items():
            ms = statistics.median(values) * 1e3
            row[variant] = {"ms": round(ms, 3), "gflops": round(flops / ms / 1e6, 1)}
        rows.append(row)
        print(f"  {start}+{n}: kernel {row['native']['ms']:.3f} ms, torch {row['torch']['ms']:.3f} ms", flush=True)
    attention.PREFILL_KERNEL = "auto"
    return rows


def engine_worker(model: str, threads: int) -> dict[str, float]:
    from goodput_runtime.config import EngineConfig
    from goodput_runtime.engine.builder import build_core
    from goodput_runtime.sampling import SamplingParams

    out: dict[str, float] = {}

    def body() -> None:
        core = build_core(
            EngineConfig(
                model=model,
                dtype="float32",
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                max_model_len=1024,
                kv_cache_memory=2 << 30,
                num_threads=threads,
            )
        )
        rng = random.Random(0)
        counter = iter(range(1 << 30))

        def prompt(n: int) -> list[int]:
            return [rng.randrange(1000, 40000) for _ in range(n)]

        prefill = []
        for _ in range(4):  # the first untimed
            for _ in range(8):
                core.add(f"p{next(counter)}", prompt(256), SamplingParams(max_tokens=1, temperature=0.0))
            started = time.perf_counter()
            core.step()
            prefill.append(time.perf_counter() - started)
            while core.has_unfinished():
                core.step()
        for _ in range(16):
            core.add(f"d{next(counter)}", prompt(16), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        for _ in range(10):  # the prompts, then untimed decodes
            core.step()
        steps = []
        for _ in range(40):
            started = time.perf_counter()
            core.step()
            steps.append(time.perf_counter() - started)
        out.update(prefill_s=min(prefill[1:]), decode_ms=statistics.median(steps) * 1e3)

    thread = threading.Thread(target=body, name="engine-step")
    thread.start()
    thread.join()
    return out


def engine_part(rounds: int, threads: int, model: str) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    names = list(SETTINGS)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            env = {
                **os.environ,
                **SETTINGS[name],
                "OMP_NUM_THREADS": str(threads),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            }
            done = subprocess.run(
                [sys.executable, "-m", "bench.cpu_kernels", "--worker", "--model", model, "--threads", str(threads)],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise SystemExit(f"{name} worker failed:\n{done.stderr[-3000:]}")
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            results[name].append(figures)
            print(
                f"  round {r + 1} {name}: decode {figures['decode_ms']:.1f} ms, prompt step "
                f"{figures['prefill_s']:.3f} s",
                flush=True,
            )
    return results


def tables(attention_rows: list[dict] | None, engine: dict[str, list[dict]] | None) -> str:
    lines = []
    if attention_rows:
        lines += [
            "| cached + chunk tokens | kernel ms | GFLOP/s | torch ms | GFLOP/s | torch / kernel |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for row in attention_rows:
            kernel, torch_ = row["native"], row["torch"]
            lines.append(
                f"| {row['cached']} + {row['tokens']} | {kernel['ms']:.3f} | {kernel['gflops']:.0f} | "
                f"{torch_['ms']:.3f} | {torch_['gflops']:.0f} | {torch_['ms'] / kernel['ms']:.2f}x |"
            )
    if engine:
        if lines:
            lines.append("")
        base = engine["on"]
        decode0 = statistics.median(x["decode_ms"] for x in base)
        prefill0 = statistics.median(x["prefill_s"] for x in base)
        lines += [
            "| setting | decode step of 16 (ms) | vs on | prompt step of 2048 tokens (s) | vs on |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, runs in engine.items():
            decode = statistics.median(x["decode_ms"] for x in runs)
            prefill = statistics.median(x["prefill_s"] for x in runs)
            lines.append(
                f"| {name} | {decode:.1f} | {decode / decode0:.2f}x | {prefill:.3f} | {prefill / prefill0:.2f}x |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["attention", "engine", "both"], default="both")
    p.add_argument("--rounds", type=int, default=None, help="default: 7 for attention, 3 for engine steps")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "cpu_kernels.json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        figures = engine_worker(args.model, args.threads)
        print(json.dumps(figures), flush=True)
        return figures
    payload: dict = {
        "kind": "cpu_kernels",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "threads": args.threads,
        "loadavg_before": os.getloadavg(),
    }
    attention_rows = engine = None
    if args.part in ("attention", "both"):
        attention_rows = payload["attention"] = attention_part(args.rounds or 7, args.threads)
    if args.part in ("engine", "both"):
        model = args.model
        if model is None:
            from goodput_runtime.tools import smollm2

            cache = REPO / smollm2.DEFAULT_CACHE
            model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
        engine = payload["engine"] = engine_part(args.rounds or 3, args.threads, model)
    payload["loadavg_after"] = os.getloadavg()
    payload["table"] = tables(attention_rows, engine)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=1))
    print()
    print(payload["table"])
    print(f"\nwrote {args.output}")
    return payload


if __name__ == "__main__":
    main()
