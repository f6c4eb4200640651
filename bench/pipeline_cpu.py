"""Pipeline parallelism on CPU: decode tokens/s at batch 16 for PP 1 and PP 2 over the same cores.

    python -m bench.pipeline_cpu                  # 12 layers, hidden 512, 2 cores in all
    python -m bench.pipeline_cpu --cores 2 --tokens 48 --rounds 2

A random Llama (hidden 512, 12 layers, 8 heads, 4 KV heads, the test tokenizer's 1024 tokens) is
served by one process with --cores threads, and by two stage processes (gloo) with cores / 2
threads each, so both use the same cores. 16 requests of 32 prompt tokens decode --tokens tokens
each; decode tokens/s is timed from the first step after every prompt is in. The runtime's schedule
passes each step through the stages one after another, so each stage idles (P - 1) / P of a step
(the bubble; 50% at PP 2) and PP 2 cannot be faster than PP 1 here: it exists to fit a model larger
than a node, and its cost is the activations sent between stages and the idle stages. The machine
may be shared: only ratios within one run count. JSON to bench/results/pipeline_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "pipeline_cpu.json"


def make_model(out: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import made_model

    tiny = made_model("tiny-llama")
    for item in tiny.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            shutil.copy(item, out / item.name)
    config = AutoConfig.from_pretrained(tiny)
    config.update(
        {
            "hidden_size": 512,
            "num_hidden_layers": 12,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "intermediate_size": 1792,
            "head_dim": 64,
        }
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def run(model: Path, pipeline: int, threads: int, batch: int, tokens: int, impl: str) -> dict:
    core = build_core(
        EngineConfig(
            model=str(model),
            device="cpu",
            dtype="float32",
            kv_cache_memory=256 << 20,
            max_model_len=256,
            max_num_seqs=batch,
            max_num_batched_tokens=batch * 32,
            pipeline_parallel_size=pipeline,
            num_threads=threads,
            model_impl=impl,
            step_tuning="off",
            cpu_contention="off",
        )
    )
    try:
        for i in range(batch):
            prompt = [(i * 31 + j * 7) % 1000 + 5 for j in range(32)]
            core.add(str(i), prompt, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        produced, steps, started = 0, 0, None
        while core.has_unfinished():
            outs = core.step()
            if started is None:  # the prompts' step: decode is timed from here
                started = time.perf_counter()
                continue
            produced += sum(len(o.token_ids) for o in outs)
            steps += 1
        elapsed = time.perf_counter() - (started or 0.0)
    finally:
        core.close()
    return {
        "pipeline": pipeline,
        "modules": impl,
        "threads_per_rank": threads,
        "decode_tokens": produced,
        "decode_steps": steps,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(produced / elapsed, 1),
        "ms_per_step": round(1000 * elapsed / steps, 2),
        "bubble": round((pipeline - 1) / pipeline, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        rows = []
        # PP 1 on the compact modules (what a one-process replica runs) and on transformers' modules (what
        # the stages run), with all the cores and with one; PP 2 with cores / 2 threads per stage
        variants = [
            ("pp1-compact", 1, args.cores, "auto"),
            ("pp1-transformers", 1, args.cores, "transformers"),
            ("pp1-transformers-1-thread", 1, 1, "transformers"),
            ("pp2", 2, max(1, args.cores // 2), "auto"),
        ]
        for _ in range(args.rounds):  # alternating, so drift on a shared machine hits every variant
            for name, pipeline, threads, impl in variants:
                rows.append({"variant": name, **run(model, pipeline, threads, args.batch, args.tokens, impl)})
    names = [v[0] for v in variants]
    best = {n: max((r for r in rows if r["variant"] == n), key=lambda r: r["tokens_per_s"]) for n in names}
    result = {"batch": args.batch, "cores": args.cores, "runs": rows, "best": best}
    result["pp2_over_pp1_transformers"] = round(
        best["pp2"]["tokens_per_s"] / best["pp1-transformers"]["tokens_per_s"], 3
    )
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print("| variant | PP | modules | threads per rank | decode tokens/s (batch 16) | ms per step | bubble |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in names:
        r = best[name]
        print(
            f"| {name} | {r['pipeline']} | {r['modules']} | {r['threads_per_rank']} | {r['tokens_per_s']} | "
            f"{r['ms_per_step']} | {r['bubble']:.0%} |"
        )
    print(f"PP 2 / PP 1 (transformers' modules, same cores): {result['pp2_over_pp1_transformers']}")


if __name__ == "__main__":
    main()
