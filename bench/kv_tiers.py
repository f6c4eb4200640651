"""The KV offload tier against prefill: how fast a 1,000-token prefix comes back from the tier
compared with computing it again.

    python -m bench.kv_tiers                     # SmolLM2-135M (prepared by the tests' fixture)
    python -m bench.kv_tiers --model DIR --tokens 1000 --rounds 5

One process, one engine (no server), fp32 on the CPU. The KV cache holds one such prompt and a
little more, so each new prompt evicts the one before into the offload tier (a file in --dir). Each
round runs, in an order that alternates between rounds:

- prefill: a fresh random prompt of --tokens tokens (no block cached anywhere), max_tokens 1;
- reload: the same prompt P each round, last evicted from the device (so it sits in the tier only);
  its full blocks are loaded back and the few tokens after them computed, max_tokens 1.

Reported: the median seconds to the first token of each, their ratio, the tier's own cost (read,
CRC-checked and copied into the cache: seconds and bytes/s) and whether every reload was served from
the tier. The machine may be shared: only ratios within one run count. JSON to
bench/results/kv-tiers.json.
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


def first_token_seconds(core, request_id: str, prompt: list[int]) -> tuple[float, int]:
    """Seconds from adding the request to its first token, and its prompt tokens found cached."""
    from goodput_runtime.sampling import SamplingParams

    started = time.perf_counter()
    core.add(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    cached = 0
    seconds = None
    while core.has_unfinished():
        for output in core.step():
            if output.token_ids and seconds is None:
                seconds = time.perf_counter() - started
            cached = output.num_cached_tokens
    assert seconds is not None
    return seconds, cached


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(SMOLLM2))
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dir", default=None, help="the tier's directory (default: a temporary one)")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "kv-tiers.json"))
    args = parser.parse_args(argv)

    import torch

    from goodput_runtime.config import EngineConfig
    from goodput_runtime.engine.builder import build_core
    from goodput_runtime.engine.step import KVLayout
    from goodput_runtime.loader import load_config

    model_config = load_config(Path(args.model))
    per_token = KVLayout.of(model_config, torch.float32, 1).bytes_per_token()
    cache_tokens = (-(-args.tokens // args.block_size) + 4) * args.block_size  # one prompt and a little more
    with tempfile.TemporaryDirectory(dir=args.dir) as tier:
        config = EngineConfig(
            model=args.model,
            dtype="float32",
            block_size=args.block_size,
            kv_cache_memory=cache_tokens * per_token,
            max_model_len=cache_tokens,
            max_num_batched_tokens=2048,
            max_num_seqs=4,
            kv_offload_bytes=16 * args.tokens * per_token,  # the prompts of several rounds
            kv_offload_dir=tier,
        )
        core = build_core(config)
        store = core.block_manager.offload
        vocab = model_config.vocab_size
        rng = random.Random(0)
        fresh = lambda: [rng.randrange(10, vocab - 10) for _ in range(args.tokens)]  # noqa: E731
        p = fresh()
        first_token_seconds(core, "warm-p", p)  # P computed once (its blocks cached)
        first_token_seconds(core, "warm-q", fresh())  # and evicted into the tier
        store.flush()
        rows: dict[str, list[float]] = {"prefill": [], "reload": []}
        cached: list[int] = []
        for r in range(args.rounds):
            order = ["prefill", "reload"] if r % 2 == 0 else ["reload", "prefill"]
            for variant in order:
                if variant == "prefill":
                    seconds, _ = first_token_seconds(core, f"q{r}", fresh())
                else:
                    seconds, hit = first_token_seconds(core, f"p{r}", p)
                    cached.append(hit)
                    first_token_seconds(core, f"evict{r}", fresh())  # P back to the tier only
                store.flush()
                rows[variant].append(seconds)
        stats = store.stats
        result = {
            "model": "SmolLM2-135M-Instruct" if Path(args.model) == SMOLLM2 else Path(args.model).name,
            "tokens": args.tokens,
            "block_size": args.block_size,
            "rounds": args.rounds,
            "kv_bytes_per_token": per_token,
            "threads": torch.get_num_threads(),
            "prefill_s": statistics.median(rows["prefill"]),
            "reload_s": statistics.median(rows["reload"]),
            "reload_cached_tokens": cached,
            "tier_reload_bytes_per_s": stats.reload_bytes / stats.reload_seconds if stats.reload_seconds else None,
            "tier_offload_bytes_per_s": stats.offload_bytes / stats.offload_seconds if stats.offload_seconds else None,
            "tier_reload_s_per_prefix": stats.reload_seconds / max(1, len(cached)),
            # on the step loop: the copy of evicted blocks out of the cache, per prompt evicted
            "save_copy_s_per_prefix": stats.save_copy_seconds
            / max(1, stats.stored_blocks)
            * (args.tokens // args.block_size),
            "tier_corrupt": stats.corrupt,
            "tier_dropped_saves": stats.dropped_saves,
            "rounds_s": rows,
        }
        result["speedup"] = result["prefill_s"] / result["reload_s"]
        core.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        "| model | tokens | prefill s (median) | reload s (median) | prefill / reload | "
        "tier read+copy MB/s | save copy on the step, s per prefix |"
    )
    print("|---|---|---|---|---|---|---|")
    rate = result["tier_reload_bytes_per_s"]
    print(
        f"| {result['model']} | {args.tokens} | {result['prefill_s']:.3f} | {result['reload_s']:.3f} | "
        f"{result['speedup']:.1f}x | {rate / 1e6 if rate else float('nan'):.0f} | "
        f"{result['save_copy_s_per_prefix']:.4f} |"
    )
    print(f"cached tokens per reload: {cached}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
