"""The engine with a KV offload tier: a prefix evicted from the KV cache comes back from the tier,
and the greedy output with the reloaded prefix equals the output without a tier, token for token.
Entries that are gone or corrupt are recomputed, never served.

A random-weight model (tests/conftest.py's made_model), fp32, a KV cache of 30 blocks of 4 tokens:
three 60-token prompts do not fit it together, so each evicts the one before.
"""

from __future__ import annotations

import random
from pathlib import Path

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.sampling import SamplingParams

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32
BLOCK = 4


def config(model_dir: Path, tier: Path | None, blocks: int = 30) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        block_size=BLOCK,
        kv_cache_memory=blocks * BLOCK * BYTES_PER_TOKEN,
        max_model_len=96,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        step_tuning="off",  # both engines run the same step plans: equal numerics, not only close
        cpu_contention="off",
        kv_offload_bytes=(1 << 20) if tier is not None else 0,
        kv_offload_dir=str(tier) if tier is not None else None,
    )


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(60)] for _ in range(3)]


def run(core, cases: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    """Every case at once; each one's tokens and prompt tokens found cached."""
    produced: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for i, (prompt, max_tokens) in enumerate(cases):
        core.add(
            f"r{i}-{id(prompt)}-{len(produced)}",
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
        )
    steps = 0
    while core.has_unfinished():
        for output in core.step():
            produced.setdefault(output.request_id, []).extend(output.token_ids)
            cached[output.request_id] = output.num_cached_tokens
        steps += 1
        assert steps < 2000
    keys = sorted(produced, key=lambda k: int(k.split("-")[0][1:]))
    return [(produced[k], cached[k]) for k in keys]


def evict_and_return(core, a: list[int], others: list[list[int]]) -> list[tuple[list[int], int]]:
    """Run a, then the others (evicting a's blocks), then a again and a with another ending beside
    one of the others."""
    run(core, [(a, 16)])
    run(core, [(p, 8) for p in others])
    store = core.block_manager.offload
    if store is not None:
        store.flush()
    return run(core, [(a, 16), ([*a[:44], 7, 8, 9], 12), (others[0], 4)])


def test_a_reloaded_prefix_gives_the_same_greedy_tokens_as_recomputing_it(tiny_model_dir, tmp_path):
    a, *others = prompts(0)
    plain = evict_and_return(build_core(config(tiny_model_dir, None)), a, others)
    core = build_core(config(tiny_model_dir, tmp_path))
    store = core.block_manager.offload
    try:
        tiered = evict_and_return(core, a, others)
        assert [t for t, _ in tiered] == [t for t, _ in plain]
        assert plain[0][1] == 0  # without the tier a's prefix was gone from the device
        assert tiered[0][1] >= 48  # with it, a's full blocks came back (all but the last token's)
        assert store.stats.loaded_tokens >= 48
        assert store.stats.corrupt == 0
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    finally:
        core.close()
    assert not Path(store.path).exists()


def test_gone_and_corrupt_entries_are_recomputed_with_the_same_tokens(tiny_model_dir, tmp_path):
    a, *others = prompts(1)
    plain = evict_and_return(build_core(config(tiny_model_dir, None)), a, others)
    core = build_core(config(tiny_model_dir, tmp_path))
    store = core.block_manager.offload
    try:
        run(core, [(a, 16)])
        run(core, [(p, 8) for p in others])
        store.flush()
        held = store.digests()
        assert held
        # every entry's payload damaged on disk: none may be served
        with open(store.path, "r+b") as f:
            for slot in list(store.index.values()):
                f.seek(slot * store.slot_bytes + store.slot_bytes - 3)
                f.write(b"\x00\x01\x02")
        first_reads: dict[int, bool] = {}  # digest -> whether its first read after the damage was served
        get = store.get

        def recording_get(digest: int) -> bytes | None:
            found = get(digest)
            first_reads.setdefault(digest, found is not None)
            return found

        store.get = recording_get
        again = run(core, [(a, 16), ([*a[:44], 7, 8, 9], 12), (others[0], 4)])
        assert [t for t, _ in again] == [t for t, _ in plain]
        damaged = set(held) & set(first_reads)
        assert damaged  # a's prefix was looked up in the tier
        assert not any(first_reads[d] for d in damaged)  # and no damaged entry was served
        assert store.stats.corrupt >= 1
        # and an entry that is gone (the tier emptied) is simply recomputed
        run(core, [(p, 8) for p in others])
        store.flush()
        store.clear()
        loaded = store.stats.loaded_tokens
        assert run(core, [(a, 16)])[0] == (plain[0][0], 0)
        assert store.stats.loaded_tokens == loaded
    finally:
        core.close()


def test_the_real_model_reloads_a_prefix_with_the_same_greedy_tokens(smollm2_dir, tmp_path):
    """SmolLM2-135M (fp32): a KV cache of 12 blocks of 16 tokens, prompts of 96 tokens."""
    per_token = 2 * 30 * 3 * 64 * 4  # k and v, 30 layers, 3 kv heads, head dim 64, fp32

    def real(tier: Path | None) -> EngineConfig:
        return EngineConfig(
            model=str(smollm2_dir),
            dtype="float32",
            block_size=16,
            kv_cache_memory=12 * 16 * per_token,
            max_model_len=128,
            max_num_batched_tokens=128,
            max_num_seqs=4,
            step_tuning="off",
            cpu_contention="off",
            kv_offload_bytes=(64 << 20) if tier is not None else 0,
            kv_offload_dir=str(tier) if tier is not None else None,
        )

    rng = random.Random(5)
    a, *others = [[rng.randrange(100, 40000) for _ in range(96)] for _ in range(3)]
    plain = evict_and_return(build_core(real(None)), a, others)
    core = build_core(real(tmp_path))
    try:
        tiered = evict_and_return(core, a, others)
        assert [t for t, _ in tiered] == [t for t, _ in plain]
        assert plain[0][1] == 0 and tiered[0][1] >= 80
    finally:
        core.close()
