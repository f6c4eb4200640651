"""The compact decoder's fused element-wise operations (layers/fused.py) against the torch operations
they replace, and the engine's greedy tokens with them on and off."""

from __future__ import annotations

import pytest
import torch
from test_engine_greedy import run_all, small_config, workload
from test_models import mistral_dir
from torch import nn
from transformers.activations import ACT2FN

from goodput_runtime.engine.builder import build_core
from goodput_runtime.layers import fused, native_attention


def torch_only(monkeypatch) -> None:
    monkeypatch.setattr(fused, "FUSED", "off")


@pytest.mark.parametrize("rows, width", [(1, 576), (16, 576), (300, 576), (5, 100), (3, 8)])
def test_rms_norm_with_and_without_the_residual_sum(fused_kernel, rows, width, monkeypatch):
    g = torch.Generator().manual_seed(rows + width)
    h, residual, weight = (torch.randn(rows, width, generator=g) for _ in range(3))
    weight = weight[0]
    assert native_attention.module().rms_norm(h, h, False, weight, 1e-5) is not None  # the fused function ran
    stream = residual.clone()
    out, summed = fused.rms_norm(h, weight, 1e-5, stream)
    assert summed is stream  # the stream is summed into in place
    plain, same = fused.rms_norm(h, weight, 1e-6)
    assert same is h
    torch_only(monkeypatch)
    expected, expected_sum = fused.rms_norm(h, weight, 1e-5, residual.clone())
    torch.testing.assert_close(summed, expected_sum, rtol=0, atol=0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # the sum of squares in another order
    torch.testing.assert_close(plain, fused.rms_norm(h, weight, 1e-6)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows, heads, head_dim", [(1, 12, 64), (300, 12, 64), (4, 3, 80), (2, 2, 16)])
def test_rotary_in_place_on_the_queries_and_keys_inside_the_fused_projection(
    fused_kernel, rows, heads, head_dim, monkeypatch
):
    g = torch.Generator().manual_seed(rows * heads)
    qkv = torch.randn(rows, heads * head_dim + 3 * head_dim, generator=g)  # values after them: untouched
    cos, sin = (torch.randn(1, rows, head_dim, generator=g)[0, :, None, :] for _ in range(2))
    before = qkv.clone()
    qk = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    expected = fused.rotate(qk.clone(), cos, sin)
    assert fused.rotary_(qk, cos, sin) is qk
    torch.testing.assert_close(qk, expected, rtol=0, atol=0)  # the same products and sums, rounded alike
    torch.testing.assert_close(qkv[:, heads * head_dim :], before[:, heads * head_dim :], rtol=0, atol=0)


@pytest.mark.parametrize("rows, width", [(1, 1536), (16, 1536), (200, 1536), (3, 40)])
def test_silu_times_up(fused_kernel, rows, width):
    gate_up = torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)) * 6
    gate_up[0, :4] = torch.tensor([-100.0, -88.5, 88.5, 100.0])  # e^-x past float32's range both ways
    assert native_attention.module().silu_mul(gate_up, width) is not None  # the fused function ran
    out = fused.silu_mul(gate_up, width, ACT2FN["silu"])
    expected = nn.functional.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)  # the exponential's last bits


def test_other_activations_dtypes_and_the_switch_take_the_torch_operations(kernel, monkeypatch):
    gate_up = torch.randn(4, 64)
    gelu = ACT2FN["gelu"]
    torch.testing.assert_close(
        fused.silu_mul(gate_up, 32, gelu), gelu(gate_up[:, :32]) * gate_up[:, 32:], rtol=0, atol=0
    )
    half = torch.randn(3, 2, 16, dtype=torch.float16)
    cos, sin = torch.randn(3, 1, 16, dtype=torch.float16), torch.randn(3, 1, 16, dtype=torch.float16)
    expected = fused.rotate(half, cos, sin)
    torch.testing.assert_close(fused.rotary_(half, cos, sin), expected, rtol=0, atol=0)
    assert fused.enabled(torch.zeros(1)) and not fused.enabled(torch.zeros(1, dtype=torch.float16))
    torch_only(monkeypatch)
    assert not fused.enabled(torch.zeros(1))


def test_without_a_compiler_the_torch_operations_serve(monkeypatch):
    monkeypatch.setattr(native_attention, "_state", {})  # as in a fresh process
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(native_attention.shutil, "which", lambda name: None)
    h, residual, weight = torch.randn(4, 32), torch.randn(4, 32), torch.randn(32)
    assert not fused.enabled(h)
    out, summed = fused.rms_norm(h, weight, 1e-5, residual.clone())
    torch.testing.assert_close(summed, residual + h, rtol=0, atol=0)
    x = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out, weight * x, rtol=0, atol=0)


def count_calls(monkeypatch) -> list[str]:
    """The fused functions' names, one per call."""
    calls: list[str] = []
    for name in ("rms_norm", "rotary_", "silu_mul"):
        real = getattr(fused, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused, name, counted)
    return calls


@pytest.mark.parametrize("arch", ["llama", "mistral"])
def test_engine_greedy_tokens_are_the_same_with_the_fused_operations_on_and_off(
    kernel, arch, tiny_model_dir, tmp_path, monkeypatch
):
    model_dir = tiny_model_dir if arch == "llama" else mistral_dir(tiny_model_dir, tmp_path)
    cases = workload(seed=13, n=10)
    calls = count_calls(monkeypatch)
    with_fused = run_all(build_core(small_config(model_dir, blocks=200)), cases)
    assert {"rms_norm", "rotary_", "silu_mul"} <= set(calls)  # the compact modules served, fused
    torch_only(monkeypatch)
    without = run_all(build_core(small_config(model_dir, blocks=200)), cases)
    assert with_fused == without
