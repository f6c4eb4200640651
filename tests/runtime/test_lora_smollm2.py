"""LoRA adapters on the real SmolLM2-135M-Instruct: two adapters trained here with peft on all seven
projections (rank 4, and rank 16 with rsLoRA scaling), served in one mixed batch with the base model.
Each sequence's greedy tokens equal peft's (PeftModel, and the merged weights) run in torch, float32."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from lora_adapters import make_smollm2_adapter

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.sampling import SamplingParams

MAX_TOKENS = 12
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then",
    "Write a short poem about the sea:",
    "In 1905 Albert Einstein published",
]


@pytest.fixture(scope="module")
def adapters(smollm2_dir: Path) -> dict[str, Path]:
    return {
        "r4": make_smollm2_adapter(smollm2_dir, "r4", 4, rslora=False, seed=3),
        "r16rs": make_smollm2_adapter(smollm2_dir, "r16rs", 16, rslora=True, seed=4),
    }


@pytest.fixture(scope="module")
def prompts(smollm2_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def torch_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        ids = model.generate(
            input_ids=torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=0
        )
    return ids[0, len(prompt) :].tolist()


def references(model_dir: Path, adapter: Path | None, prompts: list[list[int]]) -> tuple[list, list]:
    """(PeftModel's greedy tokens, the merged model's) for each prompt; the base model's twice without one."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.eval()
    if adapter is None:
        tokens = [torch_greedy(model, p) for p in prompts]
        return tokens, tokens
    peft_model = PeftModel.from_pretrained(model, adapter).eval()
    unmerged = [torch_greedy(peft_model, p) for p in prompts]
    merged_model = peft_model.merge_and_unload().eval()
    merged_model.generation_config.eos_token_id = None
    return unmerged, [torch_greedy(merged_model, p) for p in prompts]


def test_a_mixed_batch_of_two_adapters_and_the_base_model_equals_peft_token_for_token(smollm2_dir, adapters, prompts):
    core = build_core(
        EngineConfig(
            model=str(smollm2_dir),
            dtype="float32",
            block_size=16,
            kv_cache_memory=48 << 20,
            max_model_len=256,
            max_num_batched_tokens=24,  # prompts arrive in chunks beside the others' decodes
            max_num_seqs=16,
            lora_modules=tuple((name, str(path)) for name, path in adapters.items()),
            max_loras=2,
            max_lora_rank=16,
        )
    )
    rsl = core.lora.get("r16rs")
    assert rsl.rank == 16 and math.isclose(rsl.scaling, 32 / math.sqrt(16))  # rsLoRA: alpha / sqrt(r)
    assert math.isclose(core.lora.get("r4").scaling, 8 / 4)

    cases = [(p, name) for name in (None, "r4", "r16rs") for p in prompts]
    for i, (prompt, name) in enumerate(cases):
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, lora=name)
        core.add(str(i), prompt, params)
    produced: dict[str, list[int]] = {str(i): [] for i in range(len(cases))}
    adapters_per_step = []
    while core.has_unfinished():
        outputs = core.step()
        adapters_per_step.append({cases[int(o.request_id)][1] for o in outputs})
        for output in outputs:
            produced[output.request_id].extend(output.token_ids)
    assert any(len(names) == 3 for names in adapters_per_step), "no step carried both adapters and the base model"

    ours = {name: [produced[str(i)] for i, (_, n) in enumerate(cases) if n == name] for name in (None, "r4", "r16rs")}
    for name in (None, "r4", "r16rs"):
        unmerged, merged = references(smollm2_dir, adapters[name] if name else None, prompts)
        assert ours[name] == unmerged, f"{name or 'base'}: ours differ from PeftModel's"
        assert ours[name] == merged, f"{name or 'base'}: ours differ from the merged weights'"
    # the adapters change what the model says, so the comparison above covers their weights
    assert ours["r4"] != ours[None] and ours["r16rs"] != ours[None] and ours["r4"] != ours["r16rs"]
