"""What LoRA adapters cost on CPU: decode and prefill steps of the base model, one adapter, and four
adapters mixed in one step, for each compute path of the decode rows; adapter load and swap times; the
prefix digest against Python's hash.

    python -m bench.lora                       # SmolLM2-135M (prepared by the tests' fixture), rank 16
    python -m bench.lora --batch 1,16 --steps 6 --rounds 3 --rank 16

In one process, one engine (no server): adapters of rank --rank on all seven projections, made with
peft with random non-zero weights (speed does not depend on their values), placed in four slots.
Each variant runs the model runner's forward pass on the same StepItems, only their slots differ:

- base: every row slot 0 (no adapter; the stacks exist but cost nothing);
- one: every row on one adapter;
- mixed4: rows spread over four adapters.

Decode rows run ``dense`` (every slot's columns at once, a one-hot mask per row), gathered (``bmm``:
each row's A and B gathered, one batched product) or ``grouped`` (one product per adapter); prompts
always run grouped. Variants take turns step by step (one step of each, then the next), their order
rotating each round; reported per shape: the median wall ms per step over all rounds, tokens/s, and
the cost against base within the same run. The machine may be shared: only ratios within a run count.
JSON to bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / ".cache" / "smollm2" / "0.1.2" / "hf"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_dir: Path, out: Path, rank: int, count: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(count):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=MODULES, init_lora_weights=False)
        path = out / f"adapter{i}"
        get_peft_model(model, config).save_pretrained(path)
        paths.append(path)
    return paths


def digest_vs_hash(tokens: int = 2048, block: int = 16, repeats: int = 200) -> dict[str, float]:
    from goodput_runtime.engine.prefix_digest import block_digest, root

    rng = random.Random(0)
    ids = [rng.randrange(50_000) for _ in range(tokens)]
    blocks = [tuple(ids[i : i + block]) for i in range(0, tokens, block)]

    def with_hash() -> None:
        parent = None
        for b in blocks:
            parent = hash((parent, b))

    def with_digest() -> None:
        parent = root("model")
        for b in blocks:
            parent = block_digest(parent, b)

    out = {}
    for name, fn in (("hash", with_hash), ("blake2b", with_digest)):
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(repeats):
                fn()
            best = min(best, (time.perf_counter() - started) / repeats)
        out[name] = best * 1e6
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--context", type=int, default=256, help="decode rows' context length")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: least disturbed by others)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "lora.json"))
    args = parser.parse_args(argv)

    import torch

    from goodput_runtime.config import EngineConfig
    from goodput_runtime.engine.builder import build_core
    from goodput_runtime.engine.step import StepItem
    from goodput_runtime.layers import lora

    model_dir = Path(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    paths = make_adapters(model_dir, tmp, args.rank, 5)
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    block = 16
    tokens_needed = max(batches) * (args.context + 2 * block) + args.prefill + 4 * block
    core = build_core(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=block,
            kv_cache_memory=tokens_needed * per_token + 8 * block * per_token,
            max_model_len=max(args.context + 8, args.prefill + 8),
            step_tuning="off",
            cpu_contention="off",
            lora_modules=tuple((f"a{i}", str(p)) for i, p in enumerate(paths[:4])),
            max_loras=4,
            max_lora_rank=args.rank,
        )
    )
    manager, runner = core.lora, core.runner
    assert manager is not None
    slots = [manager.acquire(manager.get(f"a{i}").key, set()) for i in range(4)]
    assert slots == [1, 2, 3, 4], slots

    # load times: disk -> CPU (read and check), CPU -> slot (placing the weights), a swap of a slot
    started = time.perf_counter()
    cold = manager.add(manager.read("a4", paths[4]))
    read_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    manager.acquire(cold.key, {manager.get(f"a{i}").key for i in range(1, 4)})  # evicts a0's slot
    place_ms = (time.perf_counter() - started) * 1e3
    started = time.perf_counter()
    manager.acquire(manager.get("a0").key, {manager.get(f"a{i}").key for i in range(1, 4)})  # a0 back from CPU
    swap_ms = (time.perf_counter() - started) * 1e3
    slot_of = [manager.slot_of(manager.get(f"a{i}").key) for i in range(4)]

    rng = random.Random(0)
    next_block = 0

    def table(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-n_tokens // block)
        blocks = list(range(next_block, next_block + n))
        next_block += n
        return blocks

    shapes: dict[str, list[StepItem]] = {}
    for b in batches:
        shapes[f"decode x{b}"] = [
            StepItem([rng.randrange(100, 1000)], args.context, table(args.context + 1), True) for _ in range(b)
        ]
    quarter = args.prefill // 4
    shapes[f"prefill {args.prefill}"] = [
        StepItem([rng.randrange(100, 1000) for _ in range(quarter)], 0, table(quarter), True) for _ in range(4)
    ]

    def with_slots(items: list[StepItem], kind: str) -> list[StepItem]:
        out = []
        for i, item in enumerate(items):
            slot = 0 if kind == "base" else slot_of[0] if kind == "one" else slot_of[i % 4]
            out.append(StepItem(item.token_ids, item.start, item.block_table, item.samples, lora_slot=slot))
        return out

    variants = [("base", "grouped")] + [(kind, path) for path in lora.DECODE_PATHS for kind in ("one", "mixed4")]
    times: dict[tuple[str, str, str], list[float]] = {}
    runner.plan = runner.model.model.plan = None  # every step on the threads set here
    torch.set_num_threads(args.threads)
    for shape, items in shapes.items():
        chosen = variants if shape.startswith("decode") else variants[:3]  # prompts run grouped on every path
        for kind, path in chosen:  # one untimed pass each: first-call costs
            lora.DECODE_PATH = path
            runner.execute(with_slots(items, kind))
        for r in range(args.rounds):
            order = chosen[r % len(chosen) :] + chosen[: r % len(chosen)]
            for _ in range(args.steps):
                for kind, path in order:
                    lora.DECODE_PATH = path
                    step = with_slots(items, kind)
                    started = time.perf_counter()
                    runner.execute(step)
                    times.setdefault((shape, kind, path), []).append(time.perf_counter() - started)
    lora.DECODE_PATH = "grouped"

    rows = []
    for shape, items in shapes.items():
        tokens = sum(len(i.token_ids) for i in items)
        base = statistics.median(times[shape, "base", "grouped"])
        for (s, kind, path), values in times.items():
            if s != shape:
                continue
            ms = statistics.median(values) * 1e3
            rows.append(
                {
                    "shape": shape,
                    "variant": kind,
                    "decode_path": path if shape.startswith("decode") else "grouped",
                    "ms_per_step": round(ms, 2),
                    "tokens_per_s": round(tokens / (ms / 1e3), 1),
                    "cost_vs_base": round(ms / (base * 1e3) - 1, 3),
                    "steps": len(values),
                }
            )
    digest = digest_vs_hash()
    result = {
        "model": str(model_dir),
        "rank": args.rank,
        "threads": torch.get_num_threads(),
        "context": args.context,
        "rows": rows,
        "load_ms": {
            "disk_to_cpu": round(read_ms, 1),
            "cpu_to_slot_cold": round(place_ms, 1),
            "cpu_to_slot_swap": round(swap_ms, 1),
        },
        "slot_mib": round(manager.slot_bytes / 2**20, 1),
        "prefix_digest_us_per_2048_tokens": {k: round(v, 1) for k, v in digest.items()},
        "note": "a shared machine: only ratios within one run count",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print("| shape | variant | decode path | ms/step | tokens/s | cost vs base |\n|---|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['shape']} | {row['variant']} | {row['decode_path']} | {row['ms_per_step']} | "
            f"{row['tokens_per_s']} | {100 * row['cost_vs_base']:+.1f} % |"
        )
    print(f"\nload: {result['load_ms']}; slots: {result['slot_mib']} MiB")
    print(f"prefix digest per 2,048-token prompt (µs): {result['prefix_digest_us_per_2048_tokens']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
