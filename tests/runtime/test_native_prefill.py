"""The native prefill attention kernel (C++, causal over each prompt chunk's context in the paged
cache) against the torch path (the context gathered, then scaled_dot_product_attention), and the
engine's greedy tokens with it on and off."""

from __future__ import annotations

import pytest
import torch
from test_engine_greedy import run_all, small_config, workload
from test_models import mistral_dir

from goodput_runtime.engine.builder import build_core
from goodput_runtime.layers import attention, native_attention
from goodput_runtime.layers.attention import KVCache, PagedBatch, PrefillChunk


def prefill_step(
    chunks: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PagedBatch]:
    """A step of prompt chunks (start, n): each sequence's context in shuffled cache slots among
    other data; the chunk's cached part already there, its new keys and values given to attend."""
    g = torch.Generator().manual_seed(seed)
    total = sum(start + n for start, n in chunks)
    num_slots = total + 64
    cache = KVCache(
        [torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)],
        [torch.randn(num_slots, kv_heads, head_dim, generator=g).to(dtype)],
    )
    order = torch.randperm(num_slots, generator=g)
    prefills, new_slots, taken, row = [], [], 0, 0
    for start, n in chunks:
        slots = order[taken : taken + start + n]
        taken += start + n
        new_slots.append(slots[start:])
        prefills.append(PrefillChunk(slice(row, row + n), start, slots if start else None))
        row += n
    batch = PagedBatch(cache, torch.cat(new_slots), prefills=prefills)
    query = torch.randn(row, heads, head_dim, generator=g).to(dtype)
    key = torch.randn(row, kv_heads, head_dim, generator=g).to(dtype)
    value = torch.randn(row, kv_heads, head_dim, generator=g).to(dtype)
    return query, key, value, batch


def both(query, key, value, batch, scaling, window, monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    native = attention.attend(batch, 0, query, key, value, scaling, window)
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "torch")
    batch.masks.clear()
    expected = attention.attend(batch, 0, query, key, value, scaling, window)
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "auto")
    return native, expected


def count_calls(monkeypatch) -> list[bool]:
    """A list that grows at each call of native_attention.prefill: whether the kernel took it."""
    calls: list[bool] = []
    real = native_attention.prefill

    def counted(*args):
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(native_attention, "prefill", counted)
    return calls


SHAPES = [(9, 3, 64), (4, 4, 16), (8, 2, 128), (12, 4, 48)]  # SmolLM2's GQA; plain MHA; wider heads; 3 x 16
STEPS = [[(0, 300)], [(0, 1)], [(0, 17), (5, 1), (37, 20), (100, 64), (0, 70)], [(250, 3), (3, 250)]]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}-kv{}-d{}".format(*s))
@pytest.mark.parametrize("chunks", STEPS, ids=lambda c: "chunks-" + "-".join(f"{s}+{n}" for s, n in c))
@pytest.mark.parametrize("window", [None, 8, 40])
def test_fp32_matches_the_torch_path(avx512_kernel, shape, chunks, window, monkeypatch):
    query, key, value, batch = prefill_step(chunks, *shape, torch.float32, seed=len(chunks) + shape[0])
    calls = count_calls(monkeypatch)
    native, expected = both(query, key, value, batch, None, window, monkeypatch)
    assert calls == [True] * len(chunks)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


def test_a_given_scale_and_a_query_sliced_from_a_wider_projection(avx512_kernel, monkeypatch):
    query, key, value, batch = prefill_step([(0, 40), (12, 30)], 9, 3, 64, torch.float32, seed=3)
    wide = torch.randn(query.shape[0], 12, 64)
    wide[:, :9] = query
    native, expected = both(wide[:, :9], key, value, batch, 0.3, None, monkeypatch)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 24])
def test_bf16_matches_the_torch_path(avx512_kernel, window, monkeypatch):
    query, key, value, batch = prefill_step([(0, 90), (30, 40)], 9, 3, 64, torch.bfloat16, seed=5)
    native, expected = both(query, key, value, batch, None, window, monkeypatch)
    # the kernel rounds once at its output; the torch path rounds its products and softmax in bf16
    torch.testing.assert_close(native.float(), expected.float(), rtol=2e-2, atol=2e-2)


def test_head_dims_it_has_no_code_for_and_other_dtypes_take_the_torch_path(avx512_kernel, monkeypatch):
    for heads, kv_heads, head_dim, dtype in [(6, 2, 40, torch.float32), (9, 3, 64, torch.float16)]:
        query, key, value, batch = prefill_step([(0, 30), (8, 9)], heads, kv_heads, head_dim, dtype, seed=6)
        calls = count_calls(monkeypatch)
        native, expected = both(query, key, value, batch, None, None, monkeypatch)
        assert calls == [False, False]
        torch.testing.assert_close(native, expected, rtol=0, atol=0)


def test_the_switch_turns_it_off(avx512_kernel, monkeypatch):
    query, key, value, batch = prefill_step([(0, 30)], 9, 3, 64, torch.float32, seed=7)
    calls = count_calls(monkeypatch)
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "torch")
    attention.attend(batch, 0, query, key, value)
    assert calls == []


def test_without_a_compiler_prefill_says_none_and_attend_takes_the_torch_path(monkeypatch):
    monkeypatch.setattr(native_attention, "_state", {})  # as in a fresh process
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native_attention.shutil, "which", lambda name: None)
    query, key, value, batch = prefill_step([(0, 30), (8, 9)], 9, 3, 64, torch.float32, seed=8)
    assert (
        native_attention.prefill(
            query[:30], batch.cache.keys[0], batch.cache.values[0], batch.slot_mapping[:30], 0, None, None
        )
        is None
    )
    native, expected = both(query, key, value, batch, None, None, monkeypatch)
    torch.testing.assert_close(native, expected, rtol=0, atol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_greedy_tokens_are_the_same_with_the_kernel_on_and_off(
    avx512_kernel, arch, tiny_model_dir, tmp_path, monkeypatch
):
    # small_config's 24-token budget chunks the prompts, and the workload's shared prefix hits the
    # cache: chunks start at 0 and after cached tokens
    model_dir = tiny_model_dir if arch == "llama" else mistral_dir(tiny_model_dir, tmp_path)
    cases = workload(seed=12, n=10)
    calls = count_calls(monkeypatch)
    with_kernel = run_all(build_core(small_config(model_dir, blocks=200)), cases)
    assert calls and all(calls)  # every prompt chunk went through the kernel
    monkeypatch.setattr(attention, "PREFILL_KERNEL", "torch")
    calls.clear()
    without = run_all(build_core(small_config(model_dir, blocks=200)), cases)
    assert not calls
    assert with_kernel == without
