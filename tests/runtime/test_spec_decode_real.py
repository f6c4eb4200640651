"""Speculative decoding on the real SmolLM2-135M-Instruct: greedy answers to rewrite requests are the
same token for token with prompt lookup as without, under concurrency, chunked prefill and preemption,
and a good share of proposals is accepted (the answers copy their prompts)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

PASSAGE = (
    "The scheduler watches for newly created pods that have no node assigned. For every pod that the "
    "scheduler discovers, it becomes responsible for finding the best node for that pod to run on."
)
REQUESTS = [
    f"Repeat this passage exactly:\n\n{PASSAGE}",
    f"Rewrite this passage, replacing 'pod' with 'workload':\n\n{PASSAGE}",
]
KV_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 4  # k and v, 30 layers, 3 KV heads, head dim 64, fp32


def answers(model_dir: Path, prompts: list[list[int]], **spec) -> tuple[list[list[int]], RuntimeMetrics]:
    # room for 160 tokens: the two requests (about 220 tokens at their longest) preempt one another
    config = EngineConfig(
        model=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_model_len=160,
        kv_cache_memory=160 * KV_BYTES_PER_TOKEN,
        max_num_batched_tokens=48,
        **spec,
    )
    metrics = RuntimeMetrics("tiny", None, None)
    core = build_core(config, metrics)
    for i, prompt in enumerate(prompts):
        core.add(str(i), prompt, SamplingParams(max_tokens=32, temperature=0.0))
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while core.has_unfinished():
        for output in core.step():
            out[output.request_id].extend(output.token_ids)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return [out[str(i)] for i in range(len(prompts))], metrics


def test_smollm2_greedy_answers_with_prompt_lookup_equal_those_without(smollm2_dir):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for text in REQUESTS
    ]
    assert max(len(p) for p in prompts) > 48  # chunked prefill
    plain, plain_metrics = answers(smollm2_dir, prompts)
    spec, metrics = answers(
        smollm2_dir, prompts, speculative_method="ngram", num_speculative_tokens=4, speculative_max_batch=4
    )
    assert spec == plain
    assert "scheduler watches" in tokenizer.decode(plain[0])  # the model does copy the passage
    proposed = metrics.registry.get_sample_value("goodput_spec_decode_num_draft_tokens_total", {"model": "tiny"})
    accepted = metrics.registry.get_sample_value("goodput_spec_decode_num_accepted_tokens_total", {"model": "tiny"})
    assert proposed and accepted / proposed > 0.3  # 29 of 62 when written
    assert (plain_metrics.registry.get_sample_value("goodput_preemptions_total", {"model": "tiny"}) or 0) > 0
