"""Decode step time of the engine alone (no HTTP), at a few batch sizes, for A/B runs of runtime settings.

    python -m bench.decode_step --batch 1,16,64 --steps 20                  # the default settings
    python -m bench.decode_step --variant impl=transformers --variant impl=auto --rounds 3

Each variant builds an engine in its own process (so settings that change imports or
compilation do not leak between them), prefills the same seeded prompts (30-400 tokens), and
times decode steps at each batch size; variants alternate round by round. Reported per
variant and batch: the median over rounds of wall ms per step and CPU ms per step (the
process's CPU time, less sensitive to other load on a shared machine), and tokens/s.
A variant is `NAME=ARGS`, ARGS being engine flags in `key:value` form joined by `,`
(e.g. `impl=model_impl:transformers`) or empty for the defaults; `tree:DIR` runs the runtime of
another checkout (an export of an earlier commit, say) for a before/after comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def measure(model: str, batches: list[int], steps: int, threads: int, settings: dict[str, str]) -> dict:
    import torch

    from goodput_runtime.config import EngineConfig
    from goodput_runtime.engine.builder import build_core
    from goodput_runtime.sampling import SamplingParams

    fields = EngineConfig.__dataclass_fields__
    typed = {k: (v == "true" if fields[k].type in ("bool", bool) else v) for k, v in settings.items()}
    config = EngineConfig(model=model, dtype="float32", device="cpu", max_model_len=1024, max_num_seqs=max(batches),
                          max_num_batched_tokens=2048, kv_cache_memory=(1 << 30) + (1 << 29), num_threads=threads,
                          enable_prefix_caching=False, **typed)
    started = time.monotonic()
    core = build_core(config)
    out: dict = {"startup_s": time.monotonic() - started, "batches": {}}
    rng = random.Random(0)
    for b in batches:
        for i in range(b):
            prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(30, 400))]
            core.add(f"{b}-{i}", prompt, SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True))
        while any(s.num_tokens == s.num_prompt_tokens for s in core.scheduler.running) or core.scheduler.waiting:
            core.step()
        for _ in range(3):
            core.step()
        wall, cpu = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for _ in range(steps):
                core.step()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        out["batches"][str(b)] = {"wall_ms": wall / steps * 1e3, "cpu_ms": cpu / steps * 1e3,
                                  "tok_s": b * steps / wall}
        while core.has_unfinished():
            core.step()
    return out


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, args = text.partition("=")
    settings = dict(pair.split(":", 1) for pair in args.split(",") if pair)
    return name, settings


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--batch", default="1,16,64")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--variant", action="append", default=[], help="NAME=key:value,... (repeatable)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child process: one variant's settings
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "decode_step.json")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",")]
    if args.model is None:
        from goodput_runtime.tools import smollm2

        cache = REPO / smollm2.DEFAULT_CACHE
        args.model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    if args.one is not None:
        print(json.dumps(measure(args.model, batches, args.steps, args.threads, json.loads(args.one))))
        return
    variants = [parse_variant(v) for v in args.variant] or [("default", {})]
    results: dict[str, list[dict]] = {name: [] for name, _ in variants}
    load_before = [round(x, 2) for x in os.getloadavg()]
    for r in range(args.rounds):
        order = variants if r % 2 == 0 else list(reversed(variants))
        for name, settings in order:
            settings = dict(settings)
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            tree = settings.pop("tree", None)  # another checkout's runtime (e.g. an export of an earlier commit)
            if tree:
                env["PYTHONPATH"] = os.pathsep.join([str(Path(tree) / "runtime"), env.get("PYTHONPATH", "")])
            cmd = [sys.executable, "-m", "bench.decode_step", "--model", args.model, "--batch", args.batch,
                   "--steps", str(args.steps), "--threads", str(args.threads), "--one", json.dumps(settings)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=False)
            if done.returncode != 0:
                raise SystemExit(f"variant {name} failed:\n{done.stderr[-3000:]}")
            run = json.loads(done.stdout.strip().splitlines()[-1])
            run["loadavg_1m"] = round(os.getloadavg()[0], 2)
            results[name].append(run)
            cells = ", ".join(f"b={b}: {v['wall_ms']:.0f} ms wall, {v['cpu_ms']:.0f} ms CPU"
                              for b, v in run["batches"].items())
            print(f"round {r + 1} {name}: start-up {run['startup_s']:.1f} s; {cells}", flush=True)
    load_after = [round(x, 2) for x in os.getloadavg()]
    rows = []
    for name, runs in results.items():
        for b in batches:
            cell = [run["batches"][str(b)] for run in runs]
            rows.append({"variant": name, "batch": b,
                         "wall_ms": statistics.median(c["wall_ms"] for c in cell),
                         "cpu_ms": statistics.median(c["cpu_ms"] for c in cell),
                         "tok_s": statistics.median(c["tok_s"] for c in cell),
                         "startup_s": statistics.median(run["startup_s"] for run in runs)})
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
                                       "runs": results, "loadavg_before": load_before,
                                       "loadavg_after": load_after}, indent=1))
    first = variants[0][0]
    print(f"\n{args.steps} decode steps per batch, {args.rounds} rounds, {args.threads} threads; "
          f"load average before {load_before}, after {load_after}")
    print("| variant | batch | wall ms/step | CPU ms/step | tok/s | CPU vs " + first + " | start-up |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        base = next(x for x in rows if x["variant"] == first and x["batch"] == row["batch"])
        print(f"| {row['variant']} | {row['batch']} | {row['wall_ms']:.0f} | {row['cpu_ms']:.0f} | "
              f"{row['tok_s']:.1f} | {row['cpu_ms'] / base['cpu_ms']:.2f}x | {row['startup_s']:.1f} s |")
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
