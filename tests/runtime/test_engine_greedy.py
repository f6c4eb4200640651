"""Greedy outputs under concurrency equal transformers' own generate, token for token (fp32).

The engine runs with a KV cache small enough to force preemption, a token budget small
enough to chunk prefills, prompts that share prefixes, and requests arriving mid-batch.
"""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.async_engine import AsyncEngine
from goodput_runtime.engine.builder import build_core
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32


def workload(seed: int = 0, n: int = 12) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(5, 1000) for _ in range(40)]
    cases = []
    for i in range(n):
        if i % 3 == 0:  # a long shared prefix: prefix-cache hits
            prompt = shared + [rng.randrange(5, 1000) for _ in range(rng.randint(1, 10))]
        else:
            prompt = [rng.randrange(5, 1000) for _ in range(rng.randint(3, 70))]
        cases.append((prompt, rng.randint(4, 40)))
    return cases


def reference(model_dir: Path, cases) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    outputs = []
    with torch.inference_mode():
        for prompt, max_tokens in cases:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False, min_new_tokens=0)
            outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


def small_config(model_dir: Path, blocks: int = 40) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir),
        block_size=4,
        kv_cache_memory=blocks * 4 * BYTES_PER_TOKEN,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=8,
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_all(core, cases) -> list[list[int]]:
    """Submit every case at once and step until all finish; the tokens each produced."""
    for i, (prompt, max_tokens) in enumerate(cases):
        core.add(str(i), prompt, greedy(max_tokens))
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    while core.has_unfinished():
        for output in core.step():
            produced[output.request_id].extend(output.token_ids)
    return [produced[str(i)] for i in range(len(cases))]


def test_greedy_outputs_match_transformers_generate_under_preemption_chunking_and_prefix_hits(tiny_model_dir):
    cases = workload()
    metrics = RuntimeMetrics("tiny", None, None)
    core = build_core(small_config(tiny_model_dir), metrics)
    produced: dict[str, list[int]] = {}
    pending = list(enumerate(cases))
    steps = 0
    while pending or core.has_unfinished():
        if steps % 3 == 0:  # two new requests every third step join a batch already running
            for i, (prompt, max_tokens) in pending[:2]:
                core.add(str(i), prompt, greedy(max_tokens))
                produced[str(i)] = []
            pending = pending[2:]
        for output in core.step():
            produced[output.request_id].extend(output.token_ids)
        steps += 1
        assert steps < 5000

    expected = reference(tiny_model_dir, cases)
    for i, want in enumerate(expected):
        assert produced[str(i)] == want, f"request {i} diverged from transformers' generate"
    # the run really exercised what it claims to
    assert metrics.preemptions._value.get() > 0
    assert metrics.prefix_hits._value.get() > 0
    assert max(len(p) for p, _ in cases) > 24  # longer than the token budget: chunked
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks


async def test_greedy_outputs_match_under_concurrent_async_requests(tiny_model_dir):
    cases = workload(seed=1, n=10)
    engine = AsyncEngine(build_core(small_config(tiny_model_dir, blocks=60)), small_config(tiny_model_dir))
    await engine.start()

    async def one(i: int, prompt: list[int], max_tokens: int) -> list[int]:
        await asyncio.sleep(0.01 * i)  # arrivals spread over the run
        tokens = []
        async for output in engine.add_request(f"r{i}", prompt, greedy(max_tokens)):
            tokens.extend(output.token_ids)
        return tokens

    try:
        produced = await asyncio.gather(*(one(i, p, m) for i, (p, m) in enumerate(cases)))
    finally:
        await engine.shutdown()
    assert produced == reference(tiny_model_dir, cases)


def test_qwen2_architecture_matches_transformers(tiny_qwen2_dir):
    cases = workload(seed=2, n=6)
    core = build_core(small_config(tiny_qwen2_dir, blocks=200))
    assert run_all(core, cases) == reference(tiny_qwen2_dir, cases)


def test_mistral_sliding_window_matches_transformers(tiny_model_dir, tmp_path):
    # the same weights as a Mistral whose window (8 tokens) is far shorter than the prompts
    model_dir = tmp_path / "mistral"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=8)
    (model_dir / "config.json").write_text(json.dumps(config))
    cases = workload(seed=3, n=6)
    core = build_core(small_config(model_dir, blocks=200))
    assert run_all(core, cases) == reference(model_dir, cases)


def test_one_token_prefill_chunks_beside_longer_decodes_match_transformers(tiny_model_dir):
    # a budget of three tokens with two requests decoding leaves one token per step for a long
    # new prompt: its chunks are single tokens, like decodes, but of a much shorter context
    config = EngineConfig(
        model=str(tiny_model_dir),
        block_size=4,
        kv_cache_memory=400 * 4 * BYTES_PER_TOKEN,
        max_model_len=128,
        max_num_batched_tokens=3,
        max_num_seqs=8,
    )
    core = build_core(config)
    cases = [([7 + i for i in range(12)], 40), ([300, 301, 302, 303, 304], 40), ([500 + i for i in range(40)], 5)]
    produced: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    for i in (0, 1):
        core.add(str(i), cases[i][0], greedy(cases[i][1]))
    while not (produced["0"] and produced["1"]):
        for output in core.step():
            produced[output.request_id].extend(output.token_ids)
    core.add("2", cases[2][0], greedy(cases[2][1]))
    out = core.scheduler.schedule()
    assert sorted(s.num_tokens for s in out.scheduled) == [1, 1, 1]  # two decodes and a one-token chunk
    for output in core.update(out, core.runner.run(out)):
        produced[output.request_id].extend(output.token_ids)
    while core.has_unfinished():
        for output in core.step():
            produced[output.request_id].extend(output.token_ids)
    assert [produced[str(i)] for i in range(3)] == reference(tiny_model_dir, cases)


@pytest.mark.parametrize("trial", range(4))
def test_random_budgets_block_sizes_and_arrivals_match_transformers(tiny_model_dir, trial):
    rng = random.Random(100 + trial)
    cases = workload(seed=trial, n=8)
    block_size = rng.choice([1, 2, 4, 8, 16])
    longest = max(len(p) + m for p, m in cases)
    blocks = -(-longest // block_size) + rng.randint(0, 3 * longest // block_size)  # from tight to roomy
    config = EngineConfig(
        model=str(tiny_model_dir),
        block_size=block_size,
        max_model_len=128,
        kv_cache_memory=blocks * block_size * BYTES_PER_TOKEN,
        max_num_batched_tokens=rng.randint(2, 40),
        max_num_seqs=rng.randint(1, 8),
        enable_prefix_caching=rng.random() < 0.8,
    )
    core = build_core(config)
    arrivals = sorted(rng.randint(0, 40) for _ in cases)
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    step = added = 0
    while added < len(cases) or core.has_unfinished():
        while added < len(cases) and arrivals[added] <= step:
            core.add(str(added), cases[added][0], greedy(cases[added][1]))
            added += 1
        for output in core.step():
            produced[output.request_id].extend(output.token_ids)
        step += 1
        assert step < 20_000
    assert [produced[str(i)] for i in range(len(cases))] == reference(tiny_model_dir, cases), config
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
