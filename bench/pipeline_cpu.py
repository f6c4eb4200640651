"""Pipeline parallelism on CPU: decode tokens/s at batch 16 for PP 1 and PP 2 over the same cores,
PP 2 with the whole step passing through the stages in turn (one micro-batch) and with the step split
into micro-batches (engine/pipeline_schedule.py), and the bubble each schedule leaves, measured.

    python -m bench.pipeline_cpu                  # 12 layers, hidden 512, 2 cores in all
    python -m bench.pipeline_cpu --cores 2 --tokens 48 --rounds 2 --microbatches 1 2 4

A random Llama (hidden 512, 12 layers, 8 heads, 4 KV heads, the test tokenizer's 1024 tokens) is
served by one process with --cores threads, and by two stage processes (gloo) with cores / 2
threads each, so both use the same cores. 16 requests of 32 prompt tokens decode --tokens tokens
each; decode tokens/s is timed from the first step after every prompt is in. A second table does the same
at batch 128 (16 decode tokens each) for PP 1 on one thread and PP 2: micro-batches pay where a forward's
time grows with its rows, which at batch 16 on this CPU it barely does. Last, the machine itself: the
layer products' rate of two processes at once against one alone (``concurrency``), the most any overlap of
two stages can gain on these cores: 2.0 on two free cores, about 1 where they are one core's worth.

The bubble is measured from the ranks' trace (GOODPUT_PIPELINE_TRACE): over the decode steps, each
stage's compute (its forwards, and rank 0's LM head) against the time from rank 0's start of the
step's forward to its last piece's end: bubble = 1 - busy / (stages × that span). GPipe's fill and
drain leave (P - 1) / (M + P - 1) of it idle in theory (50% at M = 1, 33% at M = 2, 20% at M = 4 for
P = 2); ``idle_of_step`` is the same busy time against the whole decode step (scheduling, the plan's
broadcast and sampling on rank 0 included). PP 2 cannot be faster than PP 1 here: it exists to fit a
model larger than a node. The machine may be shared: only ratios within one run count, and a
traced interval is wall time, so a rank descheduled mid-forward counts as busy. JSON to
bench/results/pipeline_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.engine.pipeline_schedule import TRACE_ENV, bubble, decode_only, read_trace
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


def run(
    model: Path, pipeline: int, threads: int, batch: int, tokens: int, impl: str, microbatches: int | None, trace: Path
) -> dict:
    if pipeline > 1:
        shutil.rmtree(trace, ignore_errors=True)
        os.environ[TRACE_ENV] = str(trace)  # the stage processes inherit it
    try:
        core = build_core(
            EngineConfig(
                model=str(model),
                device="cpu",
                dtype="float32",
                kv_cache_memory=256 << 20,
                max_model_len=256,
                max_num_seqs=batch,
                max_num_batched_tokens=batch * 32,  # every prompt in one step
                pipeline_parallel_size=pipeline,
                pipeline_microbatches=microbatches,
                num_threads=threads,
                model_impl=impl,
                step_tuning="off",
                cpu_contention="off",
            )
        )
    finally:
        os.environ.pop(TRACE_ENV, None)
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
    count = (microbatches or pipeline) if pipeline > 1 else 1
    row = {
        "pipeline": pipeline,
        "microbatches": count,
        "modules": impl,
        "threads_per_rank": threads,
        "decode_tokens": produced,
        "decode_steps": steps,
        "seconds": round(elapsed, 3),
        "tokens_per_s": round(produced / elapsed, 1),
        "ms_per_step": round(1000 * elapsed / steps, 2),
        "bubble_theory": round((pipeline - 1) / (count + pipeline - 1), 3),
    }
    if pipeline > 1:
        traced = read_trace(trace)
        decodes = [traced[k] for k in sorted(traced) if decode_only(traced[k])]
        measured = bubble(decodes)
        row["bubble"] = round(measured["bubble"], 3)
        row["forward_ms_per_step"] = round(1000 * measured["span_s"] / max(measured["steps"], 1), 2)
        row["busy_ms_per_stage"] = round(1000 * measured["busy_s"] / (pipeline * max(measured["steps"], 1)), 2)
        row["idle_of_step"] = round(1 - measured["busy_s"] / (pipeline * elapsed * measured["steps"] / steps), 3)
    else:
        row["bubble"] = row["idle_of_step"] = 0.0
    return row


def _products(rows: int, seconds: float, out) -> None:
    """One thread's rate of this model's layer products (hidden 512, MLP 1792) over `rows` rows."""
    torch.set_num_threads(1)
    shapes = [(1792, 512), (1792, 512), (512, 1792), (512, 512), (256, 512), (256, 512), (512, 512)]
    weights = [torch.randn(*shape) for shape in shapes]
    inputs = {n: torch.randn(rows, n) for n in (512, 1792)}
    started, layers = time.perf_counter(), 0
    while time.perf_counter() - started < seconds:
        for w in weights:
            inputs[w.shape[1]] @ w.T
        layers += 1
    out.put(layers / (time.perf_counter() - started))


def concurrency(rows: int, seconds: float = 3.0) -> dict:
    """What two processes computing at once get from these cores, against one alone: the most any overlap of
    two stages can give here (2.0 on two free cores)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    rates = {}
    for procs in (1, 2):
        out = context.Queue()
        workers = [context.Process(target=_products, args=(rows, seconds, out)) for _ in range(procs)]
        for w in workers:
            w.start()
        rates[procs] = [out.get() for _ in workers]
        for w in workers:
            w.join()
    return {
        "rows": rows,
        "layers_per_s_one_process": round(rates[1][0], 1),
        "layers_per_s_each_of_two": [round(r, 1) for r in rates[2]],
        "two_over_one": round(sum(rates[2]) / rates[1][0], 2),
    }


def measure(model: Path, trace: Path, variants: list[tuple], batch: int, tokens: int, rounds: int) -> dict:
    """Each variant `rounds` times, alternating, so drift on a shared machine hits every one; the best run of
    each, and its tokens/s over PP 1's on one thread (the stages' modules, a stage's threads)."""
    rows = []
    for _ in range(rounds):
        for name, pipeline, threads, impl, microbatches in variants:
            row = run(model, pipeline, threads, batch, tokens, impl, microbatches, trace)
            rows.append({"variant": name, "batch": batch, **row})
            print(json.dumps(rows[-1]), flush=True)
    names = [v[0] for v in variants]
    best = {n: max((r for r in rows if r["variant"] == n), key=lambda r: r["tokens_per_s"]) for n in names}
    base = best["pp1-transformers-1-thread"]["tokens_per_s"]
    ratios = {n: round(best[n]["tokens_per_s"] / base, 3) for n in names}
    return {"batch": batch, "decode_tokens_each": tokens, "runs": rows, "best": best, "over_pp1_1_thread": ratios}


def print_table(section: dict) -> None:
    print(
        f"\n| variant | PP | micro-batches | threads per rank | decode tokens/s (batch {section['batch']}) "
        "| vs PP 1, 1 thread | ms per step | stage busy ms per step | bubble (theory) | bubble (measured) "
        "| idle of whole step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in section["best"].items():
        print(
            f"| {name} | {r['pipeline']} | {r['microbatches']} | {r['threads_per_rank']} | {r['tokens_per_s']} "
            f"| {section['over_pp1_1_thread'][name]:.2f}x | {r['ms_per_step']} | {r.get('busy_ms_per_stage', '-')} "
            f"| {r['bubble_theory']:.0%} | {r['bubble']:.0%} | {r['idle_of_step']:.0%} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 2, 4], help="PP 2's micro-batch counts")
    parser.add_argument(
        "--large-batch", type=int, default=128, help="a second table at this batch, PP 2 alone (0: none)"
    )
    parser.add_argument("--large-tokens", type=int, default=16)
    args = parser.parse_args()
    stages = [(f"pp2-mb{m}", 2, max(1, args.cores // 2), "auto", m) for m in args.microbatches]
    one_thread = ("pp1-transformers-1-thread", 1, 1, "transformers", None)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp))
        trace = Path(tmp) / "trace"
        # PP 1 on the compact modules (what a one-process replica runs) and on transformers' modules (what
        # the stages run), with all the cores and with one; PP 2 with cores / 2 threads per stage
        variants = [
            ("pp1-compact", 1, args.cores, "auto", None),
            ("pp1-transformers", 1, args.cores, "transformers", None),
            one_thread,
            *stages,
        ]
        sections = [measure(model, trace, variants, args.batch, args.tokens, args.rounds)]
        if args.large_batch:
            sections.append(
                measure(model, trace, [one_thread, *stages], args.large_batch, args.large_tokens, args.rounds)
            )
    machine = [concurrency(rows) for rows in (args.batch // 2, args.batch)]
    result = {"cores": args.cores, "load_average_at_end": os.getloadavg(), "concurrency": machine, "sections": sections}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    for section in sections:
        print_table(section)
    for check in machine:
        print(
            f"\ntwo processes at once, {check['rows']} rows: {check['two_over_one']}x one process's product rate "
            f"({check['layers_per_s_one_process']} layers/s alone, {check['layers_per_s_each_of_two']} each of two)"
        )


if __name__ == "__main__":
    main()
