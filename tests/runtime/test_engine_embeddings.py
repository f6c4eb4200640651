"""Embedding requests inside the engine: mixed with generation in one batch, chunked, preempted and
recomputed, their vectors still equal transformers' final hidden states pooled the same way (fp32)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.engine.sequence import PoolingParams
from goodput_runtime.sampling import SamplingParams

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_embeddings_survive_preemption_beside_generation(tiny_model_dir: Path, mode: str) -> None:
    # 40 blocks of 4 tokens: two long generations and an 80-token input cannot all fit
    config = EngineConfig(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_memory=40 * 4 * BYTES_PER_TOKEN,
        max_model_len=128,
        max_num_batched_tokens=12,
    )
    core = build_core(config)
    rng = random.Random(3)
    inputs = {f"emb{i}": [rng.randrange(5, 1000) for _ in range(n)] for i, n in enumerate((80, 9, 33))}
    generating = {f"gen{i}": [rng.randrange(5, 1000) for _ in range(30)] for i in range(2)}
    for rid, prompt in generating.items():
        core.add(rid, prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    seqs = {}
    for rid, prompt in inputs.items():
        core.add(rid, prompt, SamplingParams(max_tokens=1), PoolingParams(mode, normalize=False))
        seqs[rid] = core.requests[rid].seq
    mixed_steps = 0
    vectors: dict[str, list[float]] = {}
    generated: dict[str, list[int]] = {rid: [] for rid in generating}
    while core.has_unfinished():
        out = core.schedule()
        kinds = {s.seq.pooling is None for s in out.scheduled}
        mixed_steps += kinds == {True, False}
        for output in core.update(out, core.execute(out)):
            if output.request_id in generated:
                generated[output.request_id].extend(output.token_ids)
            elif output.finished:
                assert output.embedding is not None and output.num_output_tokens == 0
                vectors[output.request_id] = output.embedding
    assert mixed_steps > 0
    assert sum(s.num_preemptions for s in seqs.values()) > 0  # the long input was recomputed at least once
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert core.runner.pool_sums == {}  # nothing left behind
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.inference_mode():
        for rid, prompt in inputs.items():
            states = model.model(torch.tensor([prompt])).last_hidden_state[0]
            want = states[-1] if mode == "last" else states.mean(0)
            assert (torch.tensor(vectors[rid]) - want).abs().max() < 1e-4, rid
        for rid, prompt in generating.items():
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=60, do_sample=False, eos_token_id=None)
            assert generated[rid] == ids[0, len(prompt) :].tolist()
