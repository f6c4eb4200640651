"""Quantization on small modules built in the test: refusals, layer choice, memory, numerics."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from goodput_runtime.layers.quantization import (
    QuantizationError,
    QuantizedLinear,
    check_method,
    model_bytes,
    quantize_model,
    quantize_weight,
)

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.q_proj = nn.Linear(hidden, hidden, bias=True)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)
        self.norm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.o_proj(torch.tanh(self.q_proj(self.norm(x))))


class Decoder(nn.Module):
    def __init__(self, hidden: int, num_layers: int, vocab: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(Block(hidden) for _ in range(num_layers))


class ToyLM(nn.Module):
    """The shape quantize_model expects of a causal LM: model.layers and lm_head."""

    def __init__(self, hidden: int = 32, num_layers: int = 2, vocab: int = 64, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Decoder(hidden, num_layers, vocab)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x)
        return self.lm_head(x)


def test_an_unknown_method_is_refused_naming_the_choices():
    with pytest.raises(QuantizationError, match=r"unknown quantization method 'int4'.*none, int8, int8-w8a8, fp8"):
        quantize_model(ToyLM(), "int4", CPU)
    assert issubclass(QuantizationError, ValueError)


def test_fp8_on_cpu_is_refused_naming_the_gpu_requirement():
    model = ToyLM()
    before = model_bytes(model)
    with pytest.raises(QuantizationError, match=r"fp8 weights need an NVIDIA GPU with compute capability 8\.9"):
        quantize_model(model, "fp8", CPU)
    assert model_bytes(model) == before
    assert isinstance(model.model.layers[0].q_proj, nn.Linear)


def test_none_leaves_the_model_as_it_is():
    model = ToyLM()
    report = quantize_model(model, "none", CPU)
    assert (report.num_linears, report.weight_bytes_after) == (0, report.weight_bytes_before)
    assert isinstance(model.model.layers[0].q_proj, nn.Linear)


def linear_saving(linear: nn.Linear) -> int:
    """fp32 weight out*in*4 bytes -> int8 out*in bytes plus one fp32 scale per output channel."""
    return 3 * linear.weight.numel() - 4 * linear.out_features


def test_int8_replaces_decoder_linears_only_and_memory_shrinks_by_exactly_the_weights():
    model = ToyLM()
    linears = [m for layer in model.model.layers for m in (layer.q_proj, layer.o_proj)]
    report = quantize_model(model, "int8", CPU)
    assert (report.num_linears, report.kernel) == (4, "dequant")  # weight-only: activations stay float
    assert report.weight_bytes_before - report.weight_bytes_after == sum(map(linear_saving, linears))
    assert report.weight_bytes_after == model_bytes(model)
    assert all(isinstance(layer.q_proj, QuantizedLinear) for layer in model.model.layers)
    assert model.model.layers[0].q_proj.weight.dtype == torch.int8
    assert isinstance(model.lm_head, nn.Linear)  # the LM head only on request
    assert "int8" in str(report) and "MiB" in str(report)


def test_int8_w8a8_computes_with_int8_activations_on_cpu():
    model = ToyLM()
    report = quantize_model(model, "int8-w8a8", CPU)
    assert (report.num_linears, report.kernel) == (4, "int_mm")
    assert model.model.layers[0].q_proj.weight.dtype == torch.int8
    assert quantize_model(ToyLM(), "int8", CPU).weight_bytes_after == report.weight_bytes_after  # same storage


def test_the_lm_head_is_quantized_on_request_unless_tied_to_the_embeddings():
    model = ToyLM()
    head_saving = linear_saving(model.lm_head)
    plain = quantize_model(ToyLM(), "int8", CPU)
    report = quantize_model(model, "int8", CPU, include_lm_head=True)
    assert isinstance(model.lm_head, QuantizedLinear)
    assert plain.weight_bytes_after - report.weight_bytes_after == head_saving

    tied = ToyLM(tied=True)
    report = quantize_model(tied, "int8", CPU, include_lm_head=True)
    assert report.num_linears == 4 and isinstance(tied.lm_head, nn.Linear)


def test_forward_hooks_stay_with_a_quantized_layer():
    # tensor parallelism adds its all-reduce as a hook on the row-parallel projections
    model = ToyLM()
    calls = []
    model.model.layers[0].o_proj.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    quantize_model(model, "int8", CPU)
    model(torch.tensor([[1, 2, 3]]))
    assert calls == [torch.Size([1, 3, 32])]


def test_a_subclassed_linear_is_refused_rather_than_losing_its_forward():
    class Parallel(nn.Linear):
        pass

    model = ToyLM()
    model.model.layers[1].o_proj = Parallel(32, 32)
    with pytest.raises(QuantizationError, match="Parallel"):
        quantize_model(model, "int8", CPU)


def test_int8_weights_are_symmetric_per_output_channel():
    weight = torch.randn(48, 40) * torch.logspace(-2, 1, 48)[:, None]  # rows of very different range
    q, scale = quantize_weight(weight, torch.int8)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert torch.equal(q.abs().amax(dim=1), torch.full((48,), 127, dtype=torch.int8))
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("kernel", ["int_mm", "dequant"])
def test_int8_linear_matches_float_and_each_row_is_independent_of_its_batch(kernel):
    torch.manual_seed(1)
    linear = nn.Linear(96, 80)
    x = torch.randn(1, 32, 96)  # [B, T, in]
    layer = QuantizedLinear.of(linear, torch.int8, kernel)
    want, got = linear(x), layer(x)
    assert got.shape == want.shape
    assert (got - want).norm() / want.norm() < 0.02
    # a request's output does not depend on the requests batched with it
    alone = torch.cat([layer(x[:, i : i + 1]) for i in range(32)], dim=1)
    if kernel == "int_mm":
        assert torch.equal(alone, got)
    else:
        torch.testing.assert_close(alone, got)


@pytest.mark.parametrize("kernel", ["scaled_mm", "dequant"])
def test_fp8_linear_numerics_on_cpu(kernel):
    # fp8 is refused on CPU by quantize_model, but torch runs both fp8 kernels here, so the GPU code is checked
    torch.manual_seed(2)
    linear = nn.Linear(64, 48, bias=False)
    x = torch.randn(5, 64, dtype=torch.bfloat16)  # 5 rows: padded to 16 for _scaled_mm
    layer = QuantizedLinear.of(linear, torch.float8_e4m3fn, kernel)
    assert layer.weight.dtype == torch.float8_e4m3fn
    got, want = layer(x).float(), F.linear(x.float(), linear.weight)
    assert got.shape == (5, 48)
    assert (got - want).norm() / want.norm() < 0.08


def test_a_kernel_override_must_exist_and_suit_the_method():
    with pytest.raises(QuantizationError, match="unknown quantization kernel 'fast'"):
        quantize_model(ToyLM(), "int8", CPU, kernel="fast")
    with pytest.raises(QuantizationError, match="scaled_mm kernel cannot run int8"):
        quantize_model(ToyLM(), "int8", CPU, kernel="scaled_mm")
    model = ToyLM()
    assert quantize_model(model, "int8", CPU, kernel="dequant").kernel == "dequant"
    assert model.model.layers[0].q_proj.kernel == "dequant"


@pytest.mark.parametrize(("capability", "refused"), [((8, 0), True), ((8, 6), True), ((8, 9), False), ((9, 0), False)])
def test_fp8_needs_compute_capability_8_9(monkeypatch, capability, refused):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Test GPU")
    monkeypatch.setattr(torch.version, "hip", None)
    if refused:
        major, minor = capability
        expected = rf"8\.9 or newer.*this machine has NVIDIA Test GPU \(compute capability {major}\.{minor}\)"
        with pytest.raises(QuantizationError, match=expected):
            check_method("fp8", torch.device("cuda"))
    else:
        check_method("fp8", torch.device("cuda"))
