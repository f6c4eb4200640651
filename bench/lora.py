"""What LoRA adapters cost on CPU: decode and prefill steps of the base model, one adapter, and four
adapters mixed in one step, for each compute path of the decode rows; adapter load and swap times; the
prefix digest against Python's hash.

    python -m bench.lora                       # SmolLM2-135M (prepared by the tests' fixture), ranks 4 and 16
    python -m bench.lora --batch 1,16 --steps 6 --rounds 3 --ranks 4,16

In one process, one engine per rank of --ranks (no server; its stacks sized to that rank): adapters on
all seven projections, made with peft with random non-zero weights (speed does not depend on their
values), placed in four slots.
Each variant runs the model runner's forward pass on the same StepItems, only their slots differ:

- base: every row slot 0 (no adapter; the stacks exist but cost nothing);
- one: every row on one adapter;
- mixed4: rows spread over four adapters.

Decode rows run ``dense`` (every slot's columns at once, a one-hot mask per row), gathered (``bmm``:
each row's A and B gathered, one batched product) or ``grouped`` (one product per adapter); prompts
always run grouped. Variants take turns step by step (one step of each, then the next), their order
rotating each round, and the ranks' engines alternate round by round; reported per rank and shape: the
median wall ms per step over all rounds, tokens/s, and the cost against base within the same run, and
the target (four adapters mixed at batch 16 within +25 % of base) per rank; and the ATen operations
each variant's step dispatches (grouped), a count no other load on the machine moves. The machine may be
shared: only ratios within a run count. JSON to bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

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
        get_peft_model(model, config).save_pretrained(str(path))
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


def aten_ops(runner: Any, step: list[Any]) -> int:
    """ATen operations the forward pass of `step` dispatches: on a CPU a small step's cost follows their count."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        runner.execute(step)
    return Count.n


TARGET = 0.25  # four adapters mixed at batch 16 cost at most this share of the base model's step time


def build_engine(model_dir: Path, tmp: Path, rank: int, tokens_needed: int, max_len: int):
    """An engine with four adapters of rank `rank` in its four slots (and a fifth read for the load
    times): (core, the four adapters' slots, load times in ms)."""
    from goodput_runtime.config import EngineConfig
    from goodput_runtime.engine.builder import build_core

    paths = make_adapters(model_dir, tmp / f"r{rank}", rank, 5)
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 4
    core = build_core(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            block_size=BLOCK,
            kv_cache_memory=tokens_needed * per_token + 8 * BLOCK * per_token,
            max_model_len=max_len,
            step_tuning="off",
            cpu_contention="off",
            lora_modules=tuple((f"a{i}", str(p)) for i, p in enumerate(paths[:4])),
            max_loras=4,
            max_lora_rank=rank,
        )
    )
    manager = core.lora
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
    loads = {
        "disk_to_cpu": round(read_ms, 1),
        "cpu_to_slot_cold": round(place_ms, 1),
        "cpu_to_slot_swap": round(swap_ms, 1),
    }
    core.runner.plan = core.runner.model.model.plan = None  # every step on the threads set here
    return core, slot_of, loads


BLOCK = 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--ranks", default="4,16", help="one engine per rank (its stacks sized to it)")
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--context", type=int, default=256, help="decode rows' context length")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (1: least disturbed by others)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "lora.json"))
    args = parser.parse_args(argv)

    import torch

    from goodput_runtime.engine.step import StepItem
    from goodput_runtime.layers import lora

    model_dir = Path(args.model)
    batches = [int(b) for b in args.batch.split(",")]
    ranks = [int(r) for r in args.ranks.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-lora-"))
    tokens_needed = max(batches) * (args.context + 2 * BLOCK) + args.prefill + 4 * BLOCK
    max_len = max(args.context + 8, args.prefill + 8)
    engines = {rank: build_engine(model_dir, tmp, rank, tokens_needed, max_len) for rank in ranks}

    rng = random.Random(0)
    next_block = 0

    def table(n_tokens: int) -> list[int]:
        nonlocal next_block
        n = -(-n_tokens // BLOCK)
        blocks = list(range(next_block, next_block + n))
        next_block += n
        return blocks

    shapes: dict[str, list[StepItem]] = {}  # the same steps (and block tables) on every engine
    for b in batches:
        shapes[f"decode x{b}"] = [
            StepItem([rng.randrange(100, 1000)], args.context, table(args.context + 1), True) for _ in range(b)
        ]
    quarter = args.prefill // 4
    shapes[f"prefill {args.prefill}"] = [
        StepItem([rng.randrange(100, 1000) for _ in range(quarter)], 0, table(quarter), True) for _ in range(4)
    ]

    def with_slots(items: list[StepItem], kind: str, slot_of: list[int]) -> list[StepItem]:
        out = []
        for i, item in enumerate(items):
            slot = 0 if kind == "base" else slot_of[0] if kind == "one" else slot_of[i % 4]
            out.append(StepItem(item.token_ids, item.start, item.block_table, item.samples, lora_slot=slot))
        return out

    variants = [("base", "grouped")] + [(kind, path) for path in lora.DECODE_PATHS for kind in ("one", "mixed4")]
    times: dict[tuple[int, str, str, str], list[float]] = {}
    torch.set_num_threads(args.threads)

    def chosen(shape: str) -> list[tuple[str, str]]:
        return variants if shape.startswith("decode") else variants[:3]  # prompts run grouped on every path

    for core, slot_of, _ in engines.values():
        for shape, items in shapes.items():
            for kind, path in chosen(shape):  # one untimed pass each: first-call costs
                lora.DECODE_PATH = path
                core.runner.execute(with_slots(items, kind, slot_of))
    for r in range(args.rounds):  # rounds alternate: every rank, shape and variant in each, the order rotating
        for rank in ranks[r % len(ranks) :] + ranks[: r % len(ranks)]:
            core, slot_of, _ = engines[rank]
            for shape, items in shapes.items():
                order = chosen(shape)[r % len(chosen(shape)) :] + chosen(shape)[: r % len(chosen(shape))]
                for _ in range(args.steps):
                    for kind, path in order:
                        lora.DECODE_PATH = path
                        step = with_slots(items, kind, slot_of)
                        started = time.perf_counter()
                        core.runner.execute(step)
                        times.setdefault((rank, shape, kind, path), []).append(time.perf_counter() - started)
    lora.DECODE_PATH = "grouped"
    ops = {  # per rank and shape, the grouped path's operations per step of each variant (no timing noise)
        f"{rank} {shape}": {
            kind: aten_ops(core.runner, with_slots(items, kind, slot_of)) for kind in ("base", "one", "mixed4")
        }
        for rank, (core, slot_of, _) in engines.items()
        for shape, items in shapes.items()
    }

    rows: list[dict[str, Any]] = []
    for (rank, shape, kind, path), values in times.items():
        tokens = sum(len(i.token_ids) for i in shapes[shape])
        base = statistics.median(times[rank, shape, "base", "grouped"])
        ms = statistics.median(values) * 1e3
        rows.append(
            {
                "rank": rank,
                "shape": shape,
                "variant": kind,
                "decode_path": path if shape.startswith("decode") else "grouped",
                "ms_per_step": round(ms, 2),
                "tokens_per_s": round(tokens / (ms / 1e3), 1),
                "cost_vs_base": round(ms / (base * 1e3) - 1, 3),
                "steps": len(values),
            }
        )
    headline = [
        {"rank": row["rank"], "cost_vs_base": row["cost_vs_base"], "met": row["cost_vs_base"] <= TARGET}
        for row in rows
        if row["shape"] == "decode x16" and row["variant"] == "mixed4" and row["decode_path"] == "grouped"
    ]
    digest = digest_vs_hash()
    result = {
        "model": str(model_dir),
        "ranks": ranks,
        "threads": torch.get_num_threads(),
        "context": args.context,
        "rounds": args.rounds,
        "rows": rows,
        "target": {"mixed4_decode_x16_cost_at_most": TARGET, "measured": headline},
        "aten_ops_per_step": ops,
        "load_ms": {rank: loads for rank, (_, _, loads) in engines.items()},
        "slot_mib": {rank: round(core.lora.slot_bytes / 2**20, 1) for rank, (core, _, _) in engines.items()},
        "prefix_digest_us_per_2048_tokens": {k: round(v, 1) for k, v in digest.items()},
        "note": "a shared machine: only ratios within one run count",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{model_dir}: {args.rounds} alternating rounds of {args.steps} steps per variant, {args.threads} thread(s)")
    print("| rank | shape | variant | decode path | ms/step | tokens/s | cost vs base |")
    print("|---:|---|---|---|---:|---:|---:|")
    for row in rows:
        print(
            f"| {row['rank']} | {row['shape']} | {row['variant']} | {row['decode_path']} | {row['ms_per_step']} | "
            f"{row['tokens_per_s']} | {100 * row['cost_vs_base']:+.1f} % |"
        )
    for h in headline:
        verdict = "met" if h["met"] else "MISSED"
        print(
            f"target: rank {h['rank']}, four adapters mixed at batch 16: {100 * h['cost_vs_base']:+.1f} % "
            f"against the base model (at most +{100 * TARGET:.0f} %): {verdict}"
        )
    print("ATen operations per step (grouped): " + "; ".join(f"{k}: {v}" for k, v in ops.items()))
    print(f"\nload (ms): {result['load_ms']}; slots (MiB): {result['slot_mib']}")
    print(f"prefix digest per 2,048-token prompt (µs): {result['prefix_digest_us_per_2048_tokens']}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
