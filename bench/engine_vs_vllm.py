"""Our engine against vLLM's, without the servers: the same steps timed in-process, alternating rounds.

    python -m bench.engine_vs_vllm                # SmolLM2-135M-Instruct, fp32, 2 threads, 2 rounds
    python -m bench.engine_vs_vllm --rounds 3 --threads 1

Each round starts one fresh process per system, the order flipping from round to round; each process
loads the model once and times, three times each (the table keeps the least):

- `decode`: a step of `--seqs` sequences with 16 tokens of context (64 steps, less a 2-step run);
- `decode_long`: the same with 300-token prompts (context 300-366);
- `prefill`: `--seqs` prompts of 300 tokens, one output token;
- `wave`: `2 × --seqs` requests of 30-400 prompt tokens and 96 output tokens, `--seqs` at a time.

Ours is `EngineCore` from `build_core` (step tuning on, as the server starts it), built and stepped
on a thread of its own as the server runs it (on a process's main thread glibc's main arena returns
freed memory to the system and steps run slower), its heap frozen out of the collector's scans as
the server freezes it. vLLM's is `vllm.LLM` from the venv
`hack/vllm-venv.sh` caches, with `VLLM_ENABLE_V1_MULTIPROCESSING=0` (the engine in this process) and
its OpenMP threads bound to the first `--threads` CPUs. Both get the same seeded token-id prompts,
greedy, `ignore_eos`, the same `--max-num-seqs`, token budget and maximum length. The servers
themselves are compared by `bench/vs_vllm.py`; this script says how much of that gap the engines
carry. Writes `bench/results/engine_vs_vllm-*.json`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MEASURES = ("decode", "decode_long", "prefill", "wave")
REPEATS = 3
BUDGET = 2048
MAX_LEN = 1024
OUTPUT = 96


def prompts(n: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(low, high))] for _ in range(n)]


def measure(run, seqs: int) -> dict[str, list[float]]:
    """run(prompts, max_tokens) -> seconds; the figures of every measure, REPEATS times each."""
    run(prompts(4, 20, 40, seed=99), 8)  # untimed: lazy set-up, caches
    out: dict[str, list[float]] = {m: [] for m in MEASURES}
    for i in range(REPEATS):
        short2 = run(prompts(seqs, 16, 16, seed=10 + i), 2)
        short66 = run(prompts(seqs, 16, 16, seed=20 + i), 66)
        out["decode"].append((short66 - short2) / 64)
        long2 = run(prompts(seqs, 300, 300, seed=30 + i), 2)
        long66 = run(prompts(seqs, 300, 300, seed=40 + i), 66)
        out["decode_long"].append((long66 - long2) / 64)
        out["prefill"].append(run(prompts(seqs, 300, 300, seed=50 + i), 1))
        wave = run(prompts(2 * seqs, 30, 400, seed=60 + i), OUTPUT)
        out["wave"].append(2 * seqs * OUTPUT / wave)
    return out


def worker_ours(model: str, threads: int, seqs: int) -> dict[str, list[float]]:
    from goodput_runtime.config import EngineConfig
    from goodput_runtime.engine.builder import build_core
    from goodput_runtime.sampling import SamplingParams

    result: dict[str, list[float]] = {}

    def body() -> None:
        core = build_core(
            EngineConfig(
                model=model,
                dtype="float32",
                max_num_seqs=seqs,
                max_num_batched_tokens=BUDGET,
                max_model_len=MAX_LEN,
                kv_cache_memory=2 << 30,
                num_threads=threads,
            )
        )
        gc.collect()
        gc.freeze()  # as the server does once its engine is up
        counter = iter(range(1 << 30))

        def run(batch: list[list[int]], max_tokens: int) -> float:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            for p in batch:
                core.add(f"r{next(counter)}", p, params)
            started = time.perf_counter()
            while core.has_unfinished():
                core.step()
            return time.perf_counter() - started

        result.update(measure(run, seqs))

    thread = threading.Thread(target=body, name="engine-step")  # as the server steps it
    thread.start()
    thread.join()
    return result


def worker_vllm(model: str, threads: int, seqs: int) -> dict[str, list[float]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model, dtype="float32", max_num_seqs=seqs, max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN)

    def run(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return time.perf_counter() - started

    return measure(run, seqs)


def run_worker(system: str, python: str, model: str, threads: int, seqs: int) -> dict[str, list[float]]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "MKL_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    if system == "vllm":
        env.update(
            VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", VLLM_CPU_KVCACHE_SPACE="2"
        )
    done = subprocess.run(
        [
            python,
            "-m",
            "bench.engine_vs_vllm",
            "--worker",
            system,
            "--model",
            model,
            "--threads",
            str(threads),
            "--seqs",
            str(seqs),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"{system} worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(results: dict[str, dict[str, list[float]]], seqs: int) -> str:
    rows = [
        ("decode", f"decode step, {seqs} sequences, 16-80 tokens of context (ms)", 1000.0, False, 1),
        ("decode_long", f"decode step, {seqs} sequences, 300-366 tokens of context (ms)", 1000.0, False, 1),
        ("prefill", f"{seqs} prompts of 300 tokens, prefill (s)", 1.0, False, 2),
        ("wave", f"{2 * seqs} requests of 30-400 + {OUTPUT} tokens, {seqs} at a time (output tok/s)", 1.0, True, 1),
    ]
    lines = ["| measure | ours | vLLM | ours / vLLM (speed) |", "|---|---:|---:|---:|"]
    for key, label, scale, higher_better, digits in rows:
        ours = (max if higher_better else min)(results["ours"][key]) * scale
        peer = (max if higher_better else min)(results["vllm"][key]) * scale
        speed = ours / peer if higher_better else peer / ours
        lines.append(f"| {label} | {ours:.{digits}f} | {peer:.{digits}f} | {speed:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seqs", type=int, default=16, help="sequences per step (--max-num-seqs of both)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vllm-python", default=None, help="default: the venv hack/vllm-venv.sh caches")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--worker", choices=["ours", "vllm"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        work = worker_ours if args.worker == "ours" else worker_vllm
        figures = work(args.model, args.threads, args.seqs)
        print(json.dumps(figures), flush=True)
        return figures

    from bench.vs_vllm import vllm_python  # the parent only: workers run in either venv

    model = args.model
    if model is None:
        from goodput_runtime.tools import smollm2

        cache = REPO / ".cache" / "smollm2"
        model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    pythons = {"ours": sys.executable, "vllm": vllm_python(args.vllm_python)}
    merged: dict[str, dict[str, list[float]]] = {s: {m: [] for m in MEASURES} for s in pythons}
    rounds = []
    for r in range(args.rounds):
        order = ["ours", "vllm"] if r % 2 == 0 else ["vllm", "ours"]
        for system in order:
            load = os.getloadavg()[0]
            figures = run_worker(system, pythons[system], model, args.threads, args.seqs)
            rounds.append({"round": r + 1, "system": system, "loadavg_1m_before": load, "figures": figures})
            for key, values in figures.items():
                merged[system][key] += values
            print(
                f"  round {r + 1} {system}: decode {1000 * min(figures['decode']):.1f} ms, "
                f"decode_long {1000 * min(figures['decode_long']):.1f} ms, prefill {min(figures['prefill']):.2f} s, "
                f"wave {max(figures['wave']):.1f} tok/s (load {load:.2f})",
                flush=True,
            )
    text = table(merged, args.seqs)
    print()
    print(text)
    best = {s: {k: (max(v) if k == "wave" else min(v)) for k, v in figs.items()} for s, figs in merged.items()}
    payload = {
        "kind": "engine_vs_vllm",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model,
        "threads": args.threads,
        "seqs": args.seqs,
        "rounds": rounds,
        "best": best,
        "median": {s: {k: statistics.median(v) for k, v in figs.items()} for s, figs in merged.items()},
        "table": text,
    }
    out = args.output or REPO / "bench" / "results" / f"engine_vs_vllm-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    print(f"\nwrote {out}")
    return payload


if __name__ == "__main__":
    main()
