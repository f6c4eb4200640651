"""LoRA adapters in the engine: greedy tokens equal transformers + peft's (float32), alone and in mixed
steps of several adapters and the base model, decodes and prefill chunks together; slots, prefix
isolation and the adapters' checks."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from lora_adapters import ALL, make_adapter, peft_greedy

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import EngineConfigError, build_core
from goodput_runtime.engine.lora_manager import LoraError, LoraNotFound
from goodput_runtime.layers import lora
from goodput_runtime.sampling import SamplingParams

BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path) -> dict[str, Path]:
    """Three adapters: rank 8 on every projection, rank 4 (rsLoRA) on q, v and down, rank 16 on the MLP."""
    return {
        "all8": make_adapter(tiny_model_dir, "all8", 8, ALL),
        "qvd4": make_adapter(tiny_model_dir, "qvd4", 4, ["q_proj", "v_proj", "down_proj"], rslora=True, seed=1),
        "mlp16": make_adapter(tiny_model_dir, "mlp16", 16, ["gate_proj", "up_proj", "down_proj"], seed=2),
    }


def config(model_dir: Path, adapters: dict[str, Path], **kw) -> EngineConfig:
    settings = dict(
        model=str(model_dir),
        dtype="float32",
        block_size=4,
        kv_cache_memory=160 * 4 * BYTES_PER_TOKEN,
        max_model_len=128,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        lora_modules=tuple((name, str(path)) for name, path in adapters.items()),
        max_loras=3,
        max_lora_rank=16,
    )
    settings.update(kw)
    return EngineConfig(**settings)


def greedy(max_tokens: int, adapter: str | None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=adapter)


def run(core, cases: list[tuple[list[int], int, str | None]]) -> list[list[int]]:
    for i, (prompt, max_tokens, adapter) in enumerate(cases):
        core.add(str(i), prompt, greedy(max_tokens, adapter))
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    while core.has_unfinished():
        for output in core.step():
            produced[output.request_id].extend(output.token_ids)
    return [produced[str(i)] for i in range(len(cases))]


def test_adapter_tokens_equal_peft_and_a_mixed_batch_gives_each_its_own(tiny_model_dir, adapters):
    rng = random.Random(3)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (45, 7, 30, 19, 52, 3)]
    names = [None, "all8", "qvd4", "mlp16", "all8", None]
    expected = [
        peft_greedy(tiny_model_dir, adapters[n] if n else None, p, 10) for p, n in zip(prompts, names, strict=True)
    ]
    assert len({tuple(e) for e in expected[:4]}) == 4  # each adapter says something else than the base model

    core = build_core(config(tiny_model_dir, adapters))
    alone = [run(core, [(p, 10, n)])[0] for p, n in zip(prompts, names, strict=True)]
    assert alone == expected
    # every request at once: decodes of several adapters beside prefill chunks of others, in one step
    seen_mixed: list[set[int]] = []
    original = lora.LoraBatch.of

    def spy(spans, device):
        seen_mixed.append({slot for slot, _, _ in spans})
        return original(spans, device)

    lora.LoraBatch.of = spy  # type: ignore[method-assign]
    try:
        mixed = run(core, [(p, 10, n) for p, n in zip(prompts, names, strict=True)])
    finally:
        lora.LoraBatch.of = original  # type: ignore[method-assign]
    assert mixed == expected
    assert max(len(s) for s in seen_mixed) == 4  # a step held the base model and all three adapters


@pytest.mark.parametrize("path", ["bmm", "dense"])
def test_the_other_decode_paths_give_the_same_tokens(tiny_model_dir, adapters, monkeypatch, path):
    monkeypatch.setattr(lora, "DECODE_PATH", path)
    rng = random.Random(4)
    prompts = [[rng.randrange(5, 1000) for _ in range(n)] for n in (12, 20, 9)]
    names = ["all8", "qvd4", "all8"]
    core = build_core(config(tiny_model_dir, adapters))
    expected = [peft_greedy(tiny_model_dir, adapters[n], p, 8) for p, n in zip(prompts, names, strict=True)]
    assert run(core, [(p, 8, n) for p, n in zip(prompts, names, strict=True)]) == expected


def test_two_slots_three_adapters_every_request_completes_with_its_own_tokens(tiny_model_dir, adapters):
    core = build_core(config(tiny_model_dir, adapters, max_loras=2))
    rng = random.Random(5)
    cases = [([rng.randrange(5, 1000) for _ in range(rng.randint(4, 30))], 6, list(adapters)[i % 3]) for i in range(9)]
    alone = [run(core, [case])[0] for case in cases]
    steps_adapters: list[int] = []
    original = lora.LoraBatch.of

    def spy(spans, device):
        steps_adapters.append(len({slot for slot, _, _ in spans if slot}))
        return original(spans, device)

    lora.LoraBatch.of = spy  # type: ignore[method-assign]
    try:
        together = run(core, cases)
    finally:
        lora.LoraBatch.of = original  # type: ignore[method-assign]
    assert together == alone
    assert max(steps_adapters) == 2  # never more adapters in a step than slots


def test_prefix_cache_is_not_shared_between_base_and_adapter_nor_across_a_reload(tiny_model_dir, adapters, tmp_path):
    core = build_core(config(tiny_model_dir, adapters))
    prompt = list(range(100, 140))
    base = run(core, [(prompt, 4, None)])[0]
    hits_before = core.block_manager.cached.copy()
    on_adapter = run(core, [(prompt, 4, "all8")])[0]
    assert on_adapter == peft_greedy(tiny_model_dir, adapters["all8"], prompt, 4) != base
    assert core.requests == {} and core.block_manager.cached.keys() > hits_before.keys()  # new blocks, none reused
    # the same prompt on the same adapter again does reuse them
    core.add("again", prompt, greedy(4, "all8"))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert outputs[-1].num_cached_tokens > 0
    # reloaded under its name with other weights: the old blocks are not served to it
    other = tmp_path / "all8-v2"
    shutil.copytree(adapters["mlp16"], other)
    manager = core.lora
    manager.add(manager.read("all8", other))
    core.add("reloaded", prompt, greedy(4, "all8"))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert outputs[-1].num_cached_tokens == 0
    assert [t for o in outputs for t in o.token_ids] == peft_greedy(tiny_model_dir, adapters["mlp16"], prompt, 4)


def test_unknown_adapter_and_bad_adapters_are_refused_naming_the_cause(tiny_model_dir, adapters, tmp_path):
    core = build_core(config(tiny_model_dir, {"all8": adapters["all8"]}, max_lora_rank=8))
    with pytest.raises(LoraNotFound, match="nope"):
        core.add("x", [1, 2, 3], greedy(2, "nope"))
    manager = core.lora
    with pytest.raises(LoraError, match="rank 16, above the maximum of 8"):
        manager.read("big", adapters["mlp16"])
    lacking = tmp_path / "lacking"
    shutil.copytree(adapters["all8"], lacking)
    cfg = json.loads((lacking / "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "fc1"]
    (lacking / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoraError, match="targets fc1, which the model lacks"):
        manager.read("lacking", lacking)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(adapters["all8"], corrupt)
    data = (corrupt / "adapter_model.safetensors").read_bytes()
    (corrupt / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoraError, match="corrupt"):
        manager.read("corrupt", corrupt)
    # an adapter of another model: the shapes give it away
    other_model = tmp_path / "wide"
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapters["all8"], other_model)
    tensors = load_file(other_model / "adapter_model.safetensors")
    save_file(
        {k: torch.cat([v, v], dim=-1) if "lora_A" in k else v for k, v in tensors.items()},
        other_model / "adapter_model.safetensors",
    )
    with pytest.raises(LoraError, match="made for another base model"):
        manager.read("wide", other_model)


def test_lora_with_compile_is_refused_at_start(tiny_model_dir, adapters):
    with pytest.raises(EngineConfigError, match="--compile"):
        build_core(config(tiny_model_dir, adapters, compile=True))


def test_speculative_decoding_and_several_choices_keep_the_adapters_tokens(tiny_model_dir, adapters):
    # prompt lookup proposes from the prompt's own repeats; the adapter's rows verify them
    prompt = [11, 12, 13, 14, 15] * 6
    expected = peft_greedy(tiny_model_dir, adapters["qvd4"], prompt, 12)
    core = build_core(
        config(tiny_model_dir, adapters, speculative_method="ngram", num_speculative_tokens=3, speculative_max_batch=8)
    )
    assert run(core, [(prompt, 12, "qvd4")])[0] == expected
    plain = build_core(config(tiny_model_dir, adapters))
    plain.add("n2", prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, n=2, lora="qvd4"))
    produced: dict[int, list[int]] = {0: [], 1: []}
    while plain.has_unfinished():
        for output in plain.step():
            produced[output.index].extend(output.token_ids)
    assert produced[0] == produced[1] == expected[:6]


def test_logits_with_an_adapter_equal_peft_and_the_merged_weights(tiny_model_dir, adapters):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from goodput_runtime.engine.step import StepItem

    core = build_core(config(tiny_model_dir, adapters))
    manager = core.lora
    prompt = list(range(30, 60))
    for name in ("all8", "qvd4"):
        slot = manager.acquire(manager.get(name).key, set())
        step = [StepItem(prompt, 0, list(range(8)), True, lora_slot=slot)]
        ours = core.runner.execute(step)[-1]
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, adapters[name]).eval()
        with torch.inference_mode():
            reference = peft_model(input_ids=torch.tensor([prompt])).logits[0, -1]
            merged = peft_model.merge_and_unload()(input_ids=torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)
        torch.testing.assert_close(ours, merged, atol=1e-4, rtol=0)
