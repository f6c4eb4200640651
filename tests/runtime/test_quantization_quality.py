"""int8 quality on a fixed text, memory, and the engine serving a quantized model.

The bounds are the figures measured when the test was written (``int8-w8a8``, the int_mm
kernel with per-token int8 activations, the less accurate of the two int8 methods; torch 2.13,
x86 with AVX-512), with a margin; a real model's figures are in test_real_model_quantization.py.
Two kinds of random model are used: the suite's own (initializer range 0.1) is chaotic, in that
a small change to one layer's output grows through the layers, so it bounds the worst case; a
model made here with range 0.02 (what real checkpoints are initialized with) behaves more like
a trained one, and gets tighter bounds.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.builder import build_core
from goodput_runtime.layers.quantization import QuantizedLinear, quantize_model
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.sampling import SamplingParams

CPU = torch.device("cpu")
TEXT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result "
    "in descending order. This module provides access to some objects used or maintained by the "
    "interpreter and to functions that interact strongly with the interpreter. The quick brown fox "
    "jumps over the lazy dog while the standard library keeps its promises about text and numbers."
)
NUM_TOKENS = 128
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head dim 16, fp32


@dataclass(frozen=True)
class Closeness:
    top1_agreement: float  # share of positions whose greedy token is unchanged
    max_abs_diff: float  # largest change of any logit, over every position and vocabulary entry
    mean_abs_diff: float


def fixed_text_ids(model_dir: Path) -> torch.Tensor:
    ids = AutoTokenizer.from_pretrained(model_dir)(TEXT)["input_ids"][:NUM_TOKENS]
    assert len(ids) == NUM_TOKENS
    return torch.tensor([ids])


@torch.inference_mode()
def closeness(model, ids: torch.Tensor, method: str = "int8-w8a8", **quantization) -> Closeness:
    """Quantize the model in place and compare its logits on ids with those before."""
    want = model(ids).logits[0]
    quantize_model(model, method, CPU, **quantization)
    got = model(ids).logits[0]
    diff = (got - want).abs()
    agreement = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    return Closeness(agreement, diff.max().item(), diff.mean().item())


def load(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def narrow_init_model(model_dir: Path):
    config = AutoConfig.from_pretrained(model_dir)
    config.initializer_range = 0.02
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# measured: top-1 / max |Δlogit| / mean |Δlogit|
#   llama (range 0.1): 93.8 % / 0.153 / 0.0186; with the LM head: 93.0 % / 0.158 / 0.0195
#   qwen2 (range 0.1): 96.1 % / 0.146 / 0.0198 (its logits spread about as wide: std 0.8)
@pytest.mark.parametrize("include_lm_head", [False, True])
def test_int8_logits_stay_close_on_a_wide_init_model(tiny_model_dir, include_lm_head):
    ids = fixed_text_ids(tiny_model_dir)
    result = closeness(load(tiny_model_dir), ids, include_lm_head=include_lm_head)
    assert result.top1_agreement >= 0.90, result
    assert result.max_abs_diff <= 0.25, result
    assert result.mean_abs_diff <= 0.03, result


def test_int8_logits_stay_close_with_biased_projections(tiny_qwen2_dir):
    result = closeness(load(tiny_qwen2_dir), fixed_text_ids(tiny_qwen2_dir))
    assert result.top1_agreement >= 0.90, result
    assert result.max_abs_diff <= 0.25, result
    assert result.mean_abs_diff <= 0.03, result


# measured: 97.7 % / 0.0066 / 0.0008 (logits' std 0.16); weight-only dequantize 98.4 % / 0.0050 / 0.0006
def test_int8_logits_stay_close_on_a_narrow_init_model(tiny_model_dir):
    result = closeness(narrow_init_model(tiny_model_dir), fixed_text_ids(tiny_model_dir))
    assert result.top1_agreement >= 0.95, result
    assert result.max_abs_diff <= 0.012, result
    assert result.mean_abs_diff <= 0.0015, result


def test_weight_only_int8_is_at_least_as_close(tiny_model_dir):
    ids = fixed_text_ids(tiny_model_dir)
    fast = closeness(load(tiny_model_dir), ids)
    weight_only = closeness(load(tiny_model_dir), ids, method="int8")
    assert weight_only.mean_abs_diff <= fast.mean_abs_diff
    assert weight_only.top1_agreement >= 0.95, weight_only


def test_a_quantized_model_holds_less_memory(tiny_model_dir):
    model = load(tiny_model_dir)
    report = quantize_model(model, "int8", CPU)
    linears = [m for m in model.model.layers.modules() if isinstance(m, QuantizedLinear)]
    assert report.num_linears == len(linears) == 14  # q, k, v, o, gate, up, down in 2 layers
    # each fp32 weight (4 bytes a value) is now int8 plus a 4-byte scale per output channel
    saved = sum(3 * m.weight.numel() - 4 * m.out_features for m in linears)
    assert report.weight_bytes_before - report.weight_bytes_after == saved
    assert report.weight_bytes_after < 0.75 * report.weight_bytes_before
    with_head = quantize_model(load(tiny_model_dir), "int8", CPU, include_lm_head=True)
    assert with_head.weight_bytes_after < 0.55 * with_head.weight_bytes_before


@pytest.mark.parametrize("method", ["int8", "int8-w8a8"])
def test_the_engine_serves_a_quantized_model_like_transformers_does(tiny_model_dir, method):
    # concurrency, preemption and chunked prefill change nothing: each request gets the tokens the
    # same quantized model gives it alone under transformers' generate
    rng = random.Random(4)
    cases = [([rng.randrange(5, 1000) for _ in range(rng.randint(3, 60))], rng.randint(4, 30)) for _ in range(8)]
    # 40 blocks of 4 tokens: too few for every request at once, so some are preempted
    config = EngineConfig(
        model=str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_memory=40 * 4 * KV_BYTES_PER_TOKEN,
        max_model_len=128,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        quantization=method,
    )
    metrics = RuntimeMetrics("tiny", None, None)
    core = build_core(config, metrics)
    assert isinstance(core.runner.model.model.layers[0].mlp.down_proj, QuantizedLinear)
    for i, (prompt, max_tokens) in enumerate(cases):
        core.add(str(i), prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    produced: list[list[int]] = [[] for _ in cases]
    while core.has_unfinished():
        for output in core.step():
            produced[int(output.request_id)].extend(output.token_ids)
    assert metrics.preemptions._value.get() > 0

    model = load(tiny_model_dir)
    quantize_model(model, method, CPU)
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        for (prompt, max_tokens), tokens in zip(cases, produced, strict=True):
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False)
            assert tokens == ids[0, len(prompt) :].tolist()
