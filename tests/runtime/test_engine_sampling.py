"""Sampling and stopping as a client sees them through the engine."""

from __future__ import annotations

import json
import shutil

import pytest

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def core(tiny_model_dir):
    return build_core(EngineConfig(model=str(tiny_model_dir), kv_cache_memory=4 << 20, max_model_len=256))


def run(core, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        core.add(rid, prompt, params)
    results = {rid: {"tokens": [], "text": "", "reason": None} for rid in requests}
    while core.has_unfinished():
        for out in core.step():
            r = results[out.request_id]
            r["tokens"] += out.token_ids
            r["text"] += out.text
            r["reason"] = out.finish_reason
    return results


PROMPT = [11, 12, 13, 14, 15, 16]


def test_a_seed_makes_a_sampled_request_reproducible_whatever_runs_beside_it(core):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=42, ignore_eos=True)
    alone = run(core, {"a": (PROMPT, params)})["a"]["tokens"]
    crowd = run(
        core,
        {
            "x": (PROMPT, SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)),
            "a": (PROMPT, params),
            "y": ([7, 8, 9], SamplingParams(max_tokens=10, temperature=0.7, seed=1, ignore_eos=True)),
        },
    )
    assert crowd["a"]["tokens"] == alone
    other_seed = run(core, {"b": (PROMPT, SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True))})
    assert other_seed["b"]["tokens"] != alone


def test_top_k_of_one_is_greedy_and_a_hot_temperature_is_not(core):
    greedy = run(core, {"g": (PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))})
    top1 = run(core, {"k": (PROMPT, SamplingParams(max_tokens=20, temperature=1.5, top_k=1, ignore_eos=True))})
    hot = run(core, {"h": (PROMPT, SamplingParams(max_tokens=20, temperature=5.0, seed=3, ignore_eos=True))})
    assert top1["k"]["tokens"] == greedy["g"]["tokens"]
    assert hot["h"]["tokens"] != greedy["g"]["tokens"]


def test_top_p_keeps_sampling_to_the_likeliest_tokens(core):
    # top_p so small that only the most likely token survives: the same as greedy
    greedy = run(core, {"g": (PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))})
    narrow = run(
        core, {"p": (PROMPT, SamplingParams(max_tokens=16, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True))}
    )
    assert narrow["p"]["tokens"] == greedy["g"]["tokens"]


def test_a_stop_string_ends_the_request_and_is_cut_from_the_text(core):
    full = run(core, {"f": (PROMPT, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))})["f"]
    text = full["text"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    cut = run(core, {"s": (PROMPT, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=(stop,)))})["s"]
    assert cut["reason"] == "stop"
    assert cut["text"] == text[: text.index(stop)]
    assert len(cut["tokens"]) < len(full["tokens"])


def test_a_stop_token_id_ends_the_request(core):
    full = run(core, {"f": (PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))})["f"]
    target = full["tokens"][5]
    first = full["tokens"].index(target)
    cut = run(
        core, {"s": (PROMPT, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(target,)))}
    )["s"]
    assert cut["reason"] == "stop"
    assert cut["tokens"] == full["tokens"][: first + 1]


def test_eos_from_the_generation_config_ends_a_request_unless_ignored(core, tiny_model_dir, tmp_path):
    full = run(core, {"f": (PROMPT, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))})["f"]
    # a copy of the model whose generation config names a token greedy decoding reaches as EOS
    target = full["tokens"][6]
    model_dir = tmp_path / "eos"
    shutil.copytree(tiny_model_dir, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen["eos_token_id"] = [gen["eos_token_id"], target]
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    eos_core = build_core(EngineConfig(model=str(model_dir), kv_cache_memory=4 << 20, max_model_len=256))
    stopped = run(eos_core, {"e": (PROMPT, SamplingParams(max_tokens=30, temperature=0.0))})["e"]
    assert stopped["reason"] == "stop"
    assert stopped["tokens"] == full["tokens"][: full["tokens"].index(target) + 1]
    ignored = run(eos_core, {"i": (PROMPT, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))})["i"]
    assert ignored["reason"] == "length" and ignored["tokens"] == full["tokens"]


def test_aborting_frees_every_block(core):
    core.add("long", PROMPT, SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        core.step()
    assert core.block_manager.num_free_blocks < core.block_manager.num_blocks
    [out] = core.abort("long")
    assert out.finished and out.finish_reason == "abort"
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    assert not core.has_unfinished()
