"""Weight quantization modes side by side: one model, one workload, the engine driven in-process.

    python -m bench.quantization            # 59M Llama; fp32, int8 (weight-only), int8-w8a8 (+ bf16, fp8 on a GPU)

Per mode: weight memory, KV bytes per token, output tokens/s at concurrency 1 and 32, p90 TTFT
and TPOT, and how much of each request's greedy output matches the first mode's. Every mode's
engine is built first; then the modes take turns, `--repeats` times, and the fastest repeat of
each is kept (on a shared machine, the one least disturbed by other load).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.compare import source_revision
from bench.serve import default_output, write_json
from bench.server_process import REPO, ensure_model
from bench.stats import percentile
from bench.workload import WorkItem, WorkloadSpec, describe, make_workload, parse_range, prompt_vocabulary
from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.engine.core import EngineCore
from goodput_runtime.layers.quantization import FP8_MIN_CAPABILITY, QuantizedLinear, model_bytes, quantize_model
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.tools.make_model import SHAPES

MODELS = REPO / ".cache" / "models"
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Mode:
    name: str
    dtype: str
    method: str
    kernel: str | None = None  # None: what quantize_model picks for the device


CPU_MODES = [
    Mode("fp32", "float32", "none"),
    Mode("int8", "float32", "int8"),
    Mode("int8-w8a8", "float32", "int8-w8a8"),
]
GPU_MODES = [
    Mode("fp32", "float32", "none"),
    Mode("bf16", "bfloat16", "none"),
    Mode("int8", "bfloat16", "int8"),
    Mode("fp8", "bfloat16", "fp8"),
]


def default_model_dir() -> Path:
    """The 60m shape: the usual directory if it holds today's shape, else a fresh copy beside it."""
    usual = MODELS / "llama-60m"
    info = usual / "goodput-model.json"
    if info.exists() and json.loads(info.read_text())["shape"] == dataclasses.asdict(SHAPES["60m"]):
        return usual
    return MODELS / "llama-60m-v2"


def available_modes(device: torch.device) -> list[Mode]:
    if device.type != "cuda":
        return CPU_MODES
    fp8 = torch.cuda.get_device_capability(device) >= FP8_MIN_CAPABILITY
    return [m for m in GPU_MODES if fp8 or m.method != "fp8"]


def run_closed_loop(core, items: list[WorkItem], concurrency: int) -> dict:
    """Keep `concurrency` requests in flight until all are done; latencies per request, tokens/s."""
    pending = list(reversed(items))
    added: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter()
    while pending or core.has_unfinished():
        while pending and len(added) - len(done) < concurrency:
            item = pending.pop()
            rid = str(item.index)
            core.add(rid, item.prompt_ids, SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True))
            added[rid], tokens[rid] = time.perf_counter(), []
        for output in core.step():
            now = time.perf_counter()
            if output.token_ids and output.request_id not in first:
                first[output.request_id] = now
            tokens[output.request_id].extend(output.token_ids)
            if output.finished:
                done[output.request_id] = now
    wall = time.perf_counter() - start
    ttft = [first[r] - added[r] for r in added]
    tpot = [(done[r] - first[r]) / (len(tokens[r]) - 1) for r in added if len(tokens[r]) > 1]
    return {
        "concurrency": concurrency,
        "wall_s": wall,
        "output_tokens": sum(map(len, tokens.values())),
        "output_tokens_per_s": sum(map(len, tokens.values())) / wall,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p90_s": percentile(tpot, 90),
        "tokens": {r: tokens[r] for r in sorted(tokens, key=int)},
    }


def engine_config(args, mode: Mode, items: list[WorkItem], quantization: str) -> EngineConfig:
    longest = max(len(i.prompt_ids) + i.max_tokens for i in items)
    # every request of the concurrency-32 run at its longest, fp32, in whole blocks
    model_config = json.loads((args.model_dir / "config.json").read_text())
    head_dim = model_config["hidden_size"] // model_config["num_attention_heads"]
    per_token = 2 * model_config["num_hidden_layers"] * model_config["num_key_value_heads"] * head_dim * 4
    kv = args.concurrency * (longest + 2 * BLOCK_SIZE) * per_token
    return EngineConfig(
        model=str(args.model_dir),
        dtype=mode.dtype,
        device=args.device,
        max_model_len=longest,
        max_num_seqs=args.concurrency,
        block_size=BLOCK_SIZE,
        kv_cache_memory=kv,
        enable_prefix_caching=False,  # repeats send the same prompts
        quantization=quantization,
        quantize_lm_head=args.include_lm_head,
        seed=args.seed,
    )


def start_mode(args, mode: Mode, items: list[WorkItem]) -> tuple[EngineCore, dict]:
    # the engine quantizes at load (--quantization); a kernel other than its choice is applied afterwards
    wired = mode.kernel is None
    core = build_core(engine_config(args, mode, items, mode.method if wired else "none"))
    model = core.runner.model
    if not wired:
        quantize_model(model, mode.method, core.runner.device, args.include_lm_head, mode.kernel)
    run_closed_loop(core, [WorkItem(-1, items[0].prompt_ids[:16], 4, 0.0)], 1)  # warm-up
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    row = {
        "mode": mode.name,
        "dtype": mode.dtype,
        "method": mode.method,
        "kernel": quantized[0].kernel if quantized else "none",
        "num_quantized_linears": len(quantized),
        "weight_bytes": model_bytes(model),
        "kv_bytes_per_token": core.runner.layout.bytes_per_token(),
        "repeats": [],
    }
    return core, row


def best(runs: list[dict]) -> dict:
    """The repeat least disturbed by other load on the machine: the highest output tokens/s."""
    return max(runs, key=lambda run: run["output_tokens_per_s"])


def greedy_prefix_kept(row: dict, reference: dict) -> float:
    """Mean share of each request's greedy tokens produced before it first differs from the reference mode."""
    shares = []
    for run, ref_run in zip(row["runs"], reference["runs"], strict=True):
        for tokens, ref in zip(run["tokens"].values(), ref_run["tokens"].values(), strict=True):
            common = next((i for i, (a, b) in enumerate(zip(tokens, ref, strict=True)) if a != b), len(ref))
            shares.append(common / len(ref))
    return sum(shares) / len(shares)


def markdown(rows: list[dict], concurrency: int) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.0f}"

    c = concurrency
    lines = [
        f"| mode | kernel | weights (MiB) | KV bytes/token | tok/s c=1 | tok/s c={c} | p90 TTFT c=1 / c={c} (ms) "
        f"| p90 TPOT c=1 / c={c} (ms) | greedy prefix kept |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        one, many = row["runs"]
        lines.append(
            f"| {row['mode']} | {row['kernel']} | {row['weight_bytes'] / 2**20:.1f} | "
            f"{row['kv_bytes_per_token']} | {one['output_tokens_per_s']:.1f} | "
            f"{many['output_tokens_per_s']:.1f} | {ms(one['ttft_p90_s'])} / {ms(many['ttft_p90_s'])} | "
            f"{ms(one['tpot_p90_s'])} / {ms(many['tpot_p90_s'])} | "
            f"{row['greedy_prefix_kept'] * 100:.0f} % |"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=None, help="default: the 60m shape, made if missing")
    p.add_argument("--device", default="auto")
    p.add_argument("--modes", default=None, help="comma-separated subset of the modes, in order")
    p.add_argument("--include-lm-head", action="store_true", help="quantize the LM head too")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--single-requests", type=int, default=4, help="requests of the concurrency-1 run")
    p.add_argument("--batch-requests", type=int, default=32, help="requests of the concurrency-N run")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode, modes taking turns; the best is kept")
    p.add_argument("--prompt-len", default="16-256")
    p.add_argument("--output-len", default="16-96")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--output", type=Path, default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    args.model_dir = args.model_dir or default_model_dir()
    ensure_model(str(args.model_dir), "60m")
    torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    modes = available_modes(device)
    if args.modes:
        wanted = args.modes.split(",")
        modes = [m for name in wanted for m in modes if m.name == name]
    vocabulary = prompt_vocabulary(str(args.model_dir))
    lengths = parse_range(args.prompt_len), parse_range(args.output_len)
    single = make_workload(WorkloadSpec(args.single_requests, *lengths, seed=args.seed), vocabulary)
    batch = make_workload(WorkloadSpec(args.batch_requests, *lengths, seed=args.seed + 1), vocabulary)
    print(f"model {args.model_dir}, device {device}, torch threads {args.threads}", flush=True)
    started = [start_mode(args, mode, single + batch) for mode in modes]
    for repeat in range(args.repeats):  # modes take turns, so a burst of load elsewhere hits one repeat
        for core, row in started:
            print(f"repeat {repeat + 1}/{args.repeats}: {row['mode']} ...", flush=True)
            load_before = os.getloadavg()
            row["repeats"].append(
                {
                    "runs": [run_closed_loop(core, single, 1), run_closed_loop(core, batch, args.concurrency)],
                    "loadavg_1_5_15_before_after": [*load_before, *os.getloadavg()],
                }
            )
    rows = [row for _, row in started]
    for row in rows:
        row["runs"] = [best([r["runs"][i] for r in row["repeats"]]) for i in range(2)]
    for row in rows:
        row["greedy_prefix_kept"] = greedy_prefix_kept(row, rows[0])
    table = markdown(rows, args.concurrency)
    payload = {
        "kind": "quantization",
        "model_dir": str(args.model_dir),
        "model": json.loads((args.model_dir / "goodput-model.json").read_text()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "threads": args.threads,
        "include_lm_head": args.include_lm_head,
        "revision": source_revision(),
        "workloads": {"concurrency_1": describe(single), f"concurrency_{args.concurrency}": describe(batch)},
        "rows": rows,
        "table": table,
    }
    path = write_json(args.output or default_output("quantization"), payload)
    print(table)
    print(f"wrote {path}")
    return payload


if __name__ == "__main__":
    main()
