"""n choices fork from one prefill and share its KV blocks; logprobs and penalties in the engine
equal an independent computation over transformers' logits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from reference_sampling import Reference
from test_engine_greedy import BYTES_PER_TOKEN

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

LONG_PROMPT = [random.Random(7).randrange(5, 1000) for _ in range(201)]  # 12 full blocks of 16 and 9 tokens


def config(model_dir: Path, blocks: int = 200, block_size: int = 16, **kw) -> EngineConfig:
    settings = {"max_model_len": 512, "max_num_batched_tokens": 512, "max_num_seqs": 16, **kw}
    return EngineConfig(
        model=str(model_dir), block_size=block_size, kv_cache_memory=blocks * block_size * BYTES_PER_TOKEN, **settings
    )


def run(core, requests: dict[str, tuple[list[int], SamplingParams]]) -> tuple[dict, int]:
    """Every request to the end: tokens and finish reason per (request, choice); the most blocks in use."""
    for rid, (prompt, params) in requests.items():
        core.add(rid, prompt, params)
    results: dict[tuple[str, int], dict] = {}
    peak = 0
    while core.has_unfinished():
        for out in core.step():
            r = results.setdefault((out.request_id, out.index), {"tokens": [], "logprobs": [], "reason": None})
            r["tokens"] += out.token_ids
            r["logprobs"] += out.logprobs or []
            r["reason"] = out.finish_reason
        peak = max(peak, core.block_manager.num_blocks - core.block_manager.num_free_blocks)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return results, peak


def sampled(max_tokens: int, seed: int | None = 11, n: int = 1, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, n=n, ignore_eos=True, **kw)


def test_n_choices_share_the_prompt_blocks(tiny_model_dir):
    # prefix caching off: the sharing is the fork's own
    _, peak_one = run(build_core(config(tiny_model_dir, enable_prefix_caching=False)), {"a": (LONG_PROMPT, sampled(8))})
    four, peak_four = run(
        build_core(config(tiny_model_dir, enable_prefix_caching=False)), {"b": (LONG_PROMPT, sampled(8, n=4))}
    )
    _, peak_apart = run(
        build_core(config(tiny_model_dir, enable_prefix_caching=False)),
        {f"c{i}": (LONG_PROMPT, sampled(8, seed=i)) for i in range(4)},
    )
    assert sorted(four) == [("b", i) for i in range(4)]
    assert all(len(r["tokens"]) == 8 and r["reason"] == "length" for r in four.values())
    # 13 blocks hold the prompt and its first tokens; each further choice adds only its copy of the
    # partly filled last block, where four separate requests take four times as many
    assert peak_one == 13
    assert peak_four == 13 + 3
    assert peak_apart == 4 * 13
    assert peak_four < 1.5 * peak_one


def test_each_choice_equals_a_single_request_seeded_with_seed_plus_its_index(tiny_model_dir):
    core = build_core(config(tiny_model_dir))
    four, _ = run(core, {"r": (LONG_PROMPT, sampled(12, seed=100, n=4))})
    singles, _ = run(core, {f"s{i}": (LONG_PROMPT, sampled(12, seed=100 + i)) for i in range(4)})
    for i in range(4):
        assert four[("r", i)]["tokens"] == singles[(f"s{i}", 0)]["tokens"]
    assert len({tuple(r["tokens"]) for r in four.values()}) == 4  # the choices differ
    again, _ = run(core, {"r": (LONG_PROMPT, sampled(12, seed=100, n=4))})
    assert again == four


@pytest.mark.parametrize("block_size", [4, 16])
def test_forked_choices_stay_correct_under_preemption_and_the_static_decode_path(tiny_model_dir, block_size):
    prompt = LONG_PROMPT[:45]
    roomy = build_core(config(tiny_model_dir, block_size=block_size))
    expected, _ = run(roomy, {f"s{i}": (prompt, sampled(30, seed=5 + i)) for i in range(3)})
    metrics = RuntimeMetrics("tiny", None, None)
    # room for the prompt and a little more: the choices preempt each other and are recomputed
    tight = build_core(
        config(
            tiny_model_dir, blocks=96 // block_size, block_size=block_size, max_model_len=80, max_num_batched_tokens=16
        ),
        metrics,
    )
    tight.runner.enable_decode_graphs(8, 80, capture=False, min_width=16)
    got, _ = run(tight, {"r": (prompt, sampled(30, seed=5, n=3))})
    assert metrics.preemptions._value.get() > 0
    assert tight.runner.graphs is not None and tight.runner.graphs.replays > 0
    for i in range(3):
        assert got[("r", i)]["tokens"] == expected[(f"s{i}", 0)]["tokens"]


def test_greedy_choices_are_identical_and_equal_transformers(tiny_model_dir):
    core = build_core(config(tiny_model_dir))
    params = SamplingParams(max_tokens=10, temperature=0.0, n=3, ignore_eos=True)
    got, _ = run(core, {"g": (LONG_PROMPT, params)})
    want, _ = Reference(tiny_model_dir).greedy(LONG_PROMPT, 10)
    assert [got[("g", i)]["tokens"] for i in range(3)] == [want] * 3


def test_sampled_logprobs_are_of_the_penalized_tempered_distribution(tiny_model_dir):
    core = build_core(config(tiny_model_dir))
    prompt = LONG_PROMPT[:30]
    settings = {
        "repetition_penalty": 1.3,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.6,
        "logit_bias": {17: 3.0, 40: -2.5},
    }
    params = SamplingParams(
        max_tokens=16,
        temperature=0.7,
        seed=3,
        ignore_eos=True,
        logprobs=5,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.6,
        logit_bias=((17, 3.0), (40, -2.5)),
        n=2,
    )
    got, _ = run(core, {"p": (prompt, params)})
    reference = Reference(tiny_model_dir)
    for i in range(2):
        tokens, entries = got[("p", i)]["tokens"], got[("p", i)]["logprobs"]
        assert len(entries) == len(tokens) == 16
        logits = reference.logits(prompt + tokens)
        for k, (token, entry) in enumerate(zip(tokens, entries, strict=True)):
            want = reference.processed(logits[len(prompt) + k - 1], prompt, tokens[:k], temperature=0.7, **settings)
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(want[token]), abs=1e-4)
            top_values, top_ids = want.topk(5)
            assert [t for t, _ in entry.top] == top_ids.tolist()
            assert [lp for _, lp in entry.top] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_min_tokens_holds_off_eos_and_stop_tokens(tiny_model_dir):
    core = build_core(config(tiny_model_dir))
    eos = next(iter(core.scheduler.eos_token_ids))
    pushed = SamplingParams(max_tokens=20, temperature=0.0, logit_bias=((eos, 100.0),))
    got, _ = run(core, {"e": (LONG_PROMPT[:20], pushed)})
    assert got[("e", 0)]["tokens"] == [eos] and got[("e", 0)]["reason"] == "stop"
    held = SamplingParams(
        max_tokens=20, temperature=0.0, logit_bias=((eos, 100.0), (33, 90.0)), min_tokens=6, stop_token_ids=(33,)
    )
    got, _ = run(core, {"m": (LONG_PROMPT[:20], held)})
    tokens = got[("m", 0)]["tokens"]
    assert len(tokens) == 7 and eos not in tokens[:6] and 33 not in tokens[:6]
    assert tokens[6] == eos and got[("m", 0)]["reason"] == "stop"
