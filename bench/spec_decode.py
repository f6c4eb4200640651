"""Speculative decoding on the real model (SmolLM2-135M-Instruct, fp32, this CPU): with and without.

    python -m bench.spec_decode --rounds 3

One process, one engine per configuration: no speculation (the baseline), prompt lookup (ngram)
with k = 3 and k = 5 (any k with ngram-k<K>), and a draft model (the first --draft-layers layers of
the same model, made with goodput_runtime.tools.truncate_model). Every speculating engine keeps the switch its start-up
timing learned. Workloads, greedy: `rewrite` asks for a passage and a code snippet back with small
edits, one request at a time (batch 1); `concurrent` sends 16 such requests at once. Configurations
take turns, the order flipping each round; reported per configuration and workload: median over
rounds of output tokens/s (wall and this process's CPU time, the latter less sensitive to other
load), mean TPOT, the acceptance rate, the share of steps that speculated, the ratio to the
baseline, and whether every output equals the baseline's token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PASSAGE = (
    "The Kubernetes scheduler watches for newly created pods that have no node assigned. For every pod "
    "that the scheduler discovers, the scheduler becomes responsible for finding the best node for that "
    "pod to run on. The scheduler reaches this placement decision taking into account the scheduling "
    "principles described below. Nodes that meet the scheduling requirements for a pod are called feasible "
    "nodes. If none of the nodes are suitable, the pod remains unscheduled until the scheduler is able to "
    "place it."
)
CODE = """def total_price(items, tax_rate):
    total = 0
    for item in items:
        total = total + item.price * item.quantity
    total = total + total * tax_rate
    return round(total, 2)
"""
PROMPTS = [
    f"Rewrite the following passage exactly, word for word, but replace 'pod' with 'workload':\n\n{PASSAGE}",
    f"Rename the function total_price to order_total in this code and return the whole code:\n\n{CODE}",
    f"Repeat this passage back to me exactly as written:\n\n{PASSAGE}",
    f"Add a docstring to this function and return the whole code:\n\n{CODE}",
]


def build(model_dir: str, settings: dict, threads: int, device: str = "cpu", dtype: str = "float32"):
    from goodput_runtime.config import EngineConfig
    from goodput_runtime.engine.builder import build_core
    from goodput_runtime.metrics import RuntimeMetrics

    config = EngineConfig(
        model=model_dir,
        device=device,
        dtype=dtype,
        max_model_len=1024,
        kv_cache_memory=512 << 20,
        max_num_seqs=32,
        num_threads=threads,
        **settings,
    )
    metrics = RuntimeMetrics("bench", None, None)
    started = time.monotonic()
    core = build_core(config, metrics)
    return core, metrics, time.monotonic() - started


def run(core, prompts: list[list[int]], max_tokens: int, concurrent: bool) -> dict:
    """Greedy outputs of every prompt, one at a time or all at once; throughput and TPOT."""
    from goodput_runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}
    tpots: list[float] = []
    wall = cpu = 0.0
    batches = [list(enumerate(prompts))] if concurrent else [[(i, p)] for i, p in enumerate(prompts)]
    for batch in batches:
        first: dict[str, float] = {}
        started, cpu_started = time.perf_counter(), time.process_time()
        for i, prompt in batch:
            core.add(str(i), prompt, params)
            outputs[str(i)] = []
        while core.has_unfinished():
            for out in core.step():
                now = time.perf_counter()
                first.setdefault(out.request_id, now)
                outputs[out.request_id].extend(out.token_ids)
                if out.finished:
                    tpots.append((now - first[out.request_id]) / max(len(outputs[out.request_id]) - 1, 1))
        wall += time.perf_counter() - started
        cpu += time.process_time() - cpu_started
    tokens = sum(len(t) for t in outputs.values())
    return {
        "outputs": [outputs[str(i)] for i in range(len(prompts))],
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "tokens_per_cpu_s": tokens / cpu,
        "tpot_ms": 1000 * statistics.mean(tpots),
    }


def counters(metrics) -> dict[str, float]:
    def get(name: str, **labels: str) -> float:
        return metrics.registry.get_sample_value(name, {"model": "bench", **labels}) or 0.0

    return {
        "proposed": get("goodput_spec_decode_num_draft_tokens_total"),
        "accepted": get("goodput_spec_decode_num_accepted_tokens_total"),
        "steps_on": get("goodput_spec_decode_steps_total", speculated="true"),
        "steps_off": get("goodput_spec_decode_steps_total", speculated="false"),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (decode CUDA graphs on, as served)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--draft-layers", type=int, default=4, help="layers of the truncated draft model (0: none)")
    p.add_argument(
        "--configs",
        default="baseline,ngram-k3,ngram-k5,draft-k3",
        help="also ngram-k<K>-n<MIN>: k proposed tokens, suffixes of at least MIN tokens matched; "
        "any config with -always: speculating on every step, whatever the switch would decide",
    )
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "spec_decode.json")
    args = p.parse_args(argv)
    from transformers import AutoTokenizer

    from goodput_runtime.tools.truncate_model import truncated_copy

    if args.model is None:
        from goodput_runtime.tools import smollm2

        cache = REPO / smollm2.DEFAULT_CACHE
        args.model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for text in PROMPTS
    ]
    concurrent_prompts = [prompts[i % len(prompts)] for i in range(args.concurrency)]
    draft_dir = Path(tempfile.mkdtemp(prefix="draft-"))
    settings = {
        "baseline": {},
        "ngram-k3": {"speculative_method": "ngram", "num_speculative_tokens": 3},
        "ngram-k5": {"speculative_method": "ngram", "num_speculative_tokens": 5},
        "draft-k3": {"speculative_method": "draft", "num_speculative_tokens": 3, "speculative_model": str(draft_dir)},
    }
    names = args.configs.split(",")
    for name in names:  # ngram-k<K>[-n<MIN>]: prompt lookup with k tokens, matching suffixes of at least MIN
        base = name.removesuffix("-always")
        parts = base.split("-")
        if base not in settings and parts[0] == "ngram" and parts[1].startswith("k"):
            settings[base] = {"speculative_method": "ngram", "num_speculative_tokens": int(parts[1][1:])}
            if len(parts) > 2 and parts[2].startswith("n"):
                settings[base]["ngram_min"] = int(parts[2][1:])
        if name != base:  # <config>-always: the switch forced on (no start-up timing), for acceptance figures
            settings[name] = {**settings[base], "speculative_max_batch": 32}  # max_num_seqs
    if any(n.startswith("draft") for n in names):
        truncated_copy(Path(args.model), draft_dir, args.draft_layers)
    engines = {}
    for name in names:
        core, metrics, startup = build(args.model, settings[name], args.threads, args.device, args.dtype)
        switch = core.scheduler.switch
        engines[name] = (
            core,
            metrics,
            {
                "startup_s": round(startup, 1),
                "max_batch": switch.max_batch if switch else None,
                # prompt lookup's timed cost of a step of 1..k+1 tokens (a decode: 1)
                "step_costs": getattr(core.runner.proposer, "step_costs", None),
            },
        )
    load_before = [round(x, 2) for x in os.getloadavg()]
    results: dict[str, dict[str, list[dict]]] = {n: {"batch1": [], "concurrent": []} for n in names}
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]
        for workload, work, concurrent in (("batch1", prompts, False), ("concurrent", concurrent_prompts, True)):
            for name in order:
                core, metrics, _ = engines[name]
                before = counters(metrics)
                result = run(core, work, args.max_tokens, concurrent)
                after = counters(metrics)
                result.update({k: after[k] - before[k] for k in after})
                results[name][workload].append(result)
    table = []
    for workload in ("batch1", "concurrent"):
        base = results[names[0]][workload]
        base_tps = statistics.median(x["tokens_per_s"] for x in base)
        base_cpu = statistics.median(x["tokens_per_cpu_s"] for x in base)
        for name in names:
            runs = results[name][workload]
            proposed = sum(x["proposed"] for x in runs)
            steps = sum(x["steps_on"] + x["steps_off"] for x in runs)
            row = {
                "config": name,
                "workload": workload,
                "tokens_per_s": round(statistics.median(x["tokens_per_s"] for x in runs), 1),
                "tokens_per_cpu_s": round(statistics.median(x["tokens_per_cpu_s"] for x in runs), 1),
                "tpot_ms": round(statistics.median(x["tpot_ms"] for x in runs), 1),
                "acceptance": round(sum(x["accepted"] for x in runs) / proposed, 3) if proposed else None,
                "speculated_steps": round(sum(x["steps_on"] for x in runs) / steps, 3) if steps else None,
                "identical_outputs": all(x["outputs"] == b["outputs"] for x, b in zip(runs, base, strict=True)),
            }
            row["speedup"] = round(row["tokens_per_s"] / base_tps, 2)
            row["cpu_speedup"] = round(row["tokens_per_cpu_s"] / base_cpu, 2)
            table.append(row)
    report = {
        "model": args.model,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "draft_layers": args.draft_layers,
        "load_before": load_before,
        "load_after": [round(x, 2) for x in os.getloadavg()],
        "engines": {n: e[2] for n, e in engines.items()},
        "table": table,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    cols = [
        "workload",
        "config",
        "tokens_per_s",
        "speedup",
        "tokens_per_cpu_s",
        "cpu_speedup",
        "tpot_ms",
        "acceptance",
        "speculated_steps",
        "identical_outputs",
    ]
    print(" | ".join(cols))
    for row in table:
        print(" | ".join(str(row[c]) for c in cols))
    print("engines:", json.dumps(report["engines"]), "load:", load_before, "->", report["load_after"])


if __name__ == "__main__":
    main()
