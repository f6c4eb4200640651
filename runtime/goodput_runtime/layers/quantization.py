"""Weight quantization at load time: int8 and fp8 weights with per-output-channel scales.

Every ``nn.Linear`` of the decoder layers (attention q/k/v/o, MLP gate/up/down) becomes a
``QuantizedLinear`` holding the weight as int8 (or float8 e4m3) ``[out, in]`` plus one
float32 scale per output channel, symmetric: ``w ≈ q * scale[:, None]``. The LM head is
quantized only when asked for. The original weights are dropped, so memory really shrinks.

How a quantized linear computes, per method and device (the kernel is picked once, at load time):

- ``int8`` (weight-only), every device: ``dequant``: the int8 weight is widened to the
  activations' dtype inside the matmul; activations are never rounded. On a real model
  (SmolLM2-135M, this repository's docs) it stays within 0.5 % of fp32's perplexity with 97 %
  top-1 agreement, where per-token int8 activations lose 3 % and 88 %. It saves memory,
  not time: on CPU it is slower than fp32, and on CUDA there is no fused eager kernel (torch's
  CUDA ``_weight_int8pack_mm`` takes float32 activations only).
- ``int8-w8a8``, CPU: ``int_mm``. Each token's activations are quantized on the fly to int8
  with their own scale, multiplied by the int8 weight with ``torch._int_mm`` (int32
  accumulation, exact), and rescaled. Faster than fp32 at every batch size and, being exact
  per row, gives a request the same tokens whatever it is batched with; its cost is the
  activation rounding. Elsewhere it falls back to ``dequant`` (logged). The measurements are
  in bench/README.md.
- ``fp8``, CUDA with compute capability ≥ 8.9: ``scaled_mm``: per-token e4m3 activations and
  ``torch._scaled_mm`` with row-wise scales, checked on a small problem at load time, else
  ``dequant``. Elsewhere fp8 is refused with a ``QuantizationError``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from goodput_contract import flags
from goodput_contract import quantization as rules

log = logging.getLogger(__name__)

METHODS = rules.METHODS
KERNELS = ("int_mm", "scaled_mm", "dequant")
FP8_MIN_CAPABILITY = rules.FP8_MIN_CAPABILITY
INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
EPS = 1e-12


class QuantizationError(ValueError):
    """The quantization method is unknown or cannot run on this machine."""


@dataclass(frozen=True)
class QuantizationReport:
    method: str
    num_linears: int
    weight_bytes_before: int  # every parameter and buffer of the model
    weight_bytes_after: int
    kernel: str = "none"

    def __str__(self) -> str:
        if self.method == "none":
            return f"Weights not quantized: {self.weight_bytes_before / 2**20:.1f} MiB"
        return (
            f"Quantized {self.num_linears} linear layers to {self.method} ({self.kernel} kernel): weights "
            f"{self.weight_bytes_before / 2**20:.1f} MiB -> {self.weight_bytes_after / 2**20:.1f} MiB"
        )


def quantize_weight(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight -> (int8 or float8_e4m3fn [out, in], float32 scales [out]), symmetric per row."""
    w = weight.detach().float()
    limit = INT8_MAX if dtype == torch.int8 else FP8_MAX
    scale = w.abs().amax(dim=1).clamp(min=EPS) / limit
    scaled = w / scale[:, None]
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.clamp(-limit, limit).to(dtype), scale


class QuantizedLinear(nn.Module):
    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kernel: str) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # int8 or float8_e4m3fn [out, in]
        self.register_buffer("scale", scale)  # float32 [out]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernel = kernel

    @classmethod
    def of(cls, linear: nn.Linear, dtype: torch.dtype, kernel: str) -> QuantizedLinear:
        weight, scale = quantize_weight(linear.weight, dtype)
        return cls(weight, scale, linear.bias, kernel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # [T, in]
        if self.kernel == "int_mm":
            y = _int8_int_mm(x2, self.weight, self.scale).to(x.dtype)
        elif self.kernel == "scaled_mm":
            y = _fp8_scaled_mm(x2, self.weight, self.scale, x.dtype)
        else:
            y = F.linear(x2, self.weight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"weight={self.weight.dtype}, kernel={self.kernel}"
        )


def _int8_int_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x: [T, in] float; weight: int8 [out, in]; per-token activation scales: [T, 1]
    act_scale = x.abs().amax(dim=1, keepdim=True).float().clamp_(min=EPS).div_(INT8_MAX)
    xq = (x.float() / act_scale).round_().to(torch.int8)
    return torch._int_mm(xq, weight.t()).float().mul_(act_scale).mul_(scale)


def _fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3 activations and their float32 scales [T, 1]."""
    act_scale = x.abs().amax(dim=1, keepdim=True).float().clamp(min=EPS) / FP8_MAX
    return (x.float() / act_scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), act_scale


_compiled_fp8_activations: Any = None


def fp8_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_fp8_activations as one inductor kernel on CUDA (eagerly it is eight, for every projection of
    every layer: at batch 1 they cost more than the halved weight reads save), compiled on first use."""
    global _compiled_fp8_activations
    if not x.is_cuda:
        return _fp8_activations(x)
    if _compiled_fp8_activations is None:
        _compiled_fp8_activations = torch.compile(_fp8_activations, dynamic=True)
    return _compiled_fp8_activations(x)


def _fp8_scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype):
    rows = x.shape[0]
    pad = -rows % 16  # _scaled_mm wants every dimension a multiple of 16
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
    xq, act_scale = fp8_activations(x)
    y = torch._scaled_mm(xq, weight.t(), scale_a=act_scale, scale_b=scale[None, :], out_dtype=out_dtype)
    return y[:rows]


def _gpu_description(device: torch.device) -> str:
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"no CUDA GPU (device {device})"
    if torch.version.hip:
        return f"an AMD GPU ({torch.cuda.get_device_name(device)})"
    major, minor = torch.cuda.get_device_capability(device)
    return f"{torch.cuda.get_device_name(device)} (compute capability {major}.{minor})"


def nvidia_capability(device: torch.device) -> tuple[int, int] | None:
    """The CUDA compute capability of an NVIDIA GPU device; None for the CPU or an AMD GPU."""
    if device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip:
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major, minor


def check_method(method: str, device: torch.device) -> None:
    """Refuse an unknown method, or one this device cannot run (the contract's rule: fp8 needs 8.9+)."""
    problem = rules.method_problem(method)
    if problem is None and rules.requirement(method) is not None:
        others = [m for m in METHODS if rules.supported(m, None)]
        problem = rules.capability_problem(
            method,
            nvidia_capability(device),
            f"this machine has {_gpu_description(device)}; use {flags.QUANTIZATION} {' or '.join(reversed(others))}",
        )
    if problem:
        raise QuantizationError(problem)


def _kernel_works(kernel: str, weight_dtype: torch.dtype, act_dtype: torch.dtype, device: torch.device) -> bool:
    """Run the kernel on a small problem and compare it with the dequantizing reference."""
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    linear.weight.data = torch.randn(32, 64, generator=generator).to(device)
    x = torch.randn(5, 64, generator=generator).to(device, act_dtype)
    try:
        got = QuantizedLinear.of(linear, weight_dtype, kernel)(x).float()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        log.info("The %s kernel cannot run on %s with %s activations: %s", kernel, device, act_dtype, exc)
        return False
    want = QuantizedLinear.of(linear, weight_dtype, "dequant")(x).float()
    return bool(torch.allclose(got, want, rtol=0.1, atol=0.1 * float(want.abs().max())))


def pick_kernel(method: str, device: torch.device, act_dtype: torch.dtype) -> str:
    if method == rules.INT8_W8A8:
        if device.type == "cpu" and _kernel_works("int_mm", torch.int8, act_dtype, device):
            return "int_mm"
        log.warning("%s: no int8 x int8 kernel on %s; computing weight-only (dequant)", method, device)
    if method == rules.FP8 and _kernel_works("scaled_mm", torch.float8_e4m3fn, act_dtype, device):
        return "scaled_mm"
    return "dequant"


def model_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied weights counted once)."""
    seen: dict[int, int] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        seen[tensor.data_ptr()] = max(seen.get(tensor.data_ptr(), 0), tensor.numel() * tensor.element_size())
    return sum(seen.values())


def _targets(model: nn.Module, include_lm_head: bool) -> list[tuple[nn.Module, str, nn.Linear]]:
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise QuantizationError(f"{type(model).__name__} has no decoder layers at model.model.layers")
    targets = [
        (parent, name, child)
        for parent in layers.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    head = getattr(model, "lm_head", None)
    if include_lm_head and isinstance(head, nn.Linear):
        input_embeddings = getattr(model, "get_input_embeddings", None)
        if callable(input_embeddings) and input_embeddings().weight is head.weight:
            log.info("The LM head shares its weight with the embeddings; left unquantized")
        else:
            targets.append((model, "lm_head", head))
    return targets


def _replace(parent: nn.Module, name: str, old: nn.Linear, new: QuantizedLinear) -> None:
    # hooks (an all-reduce after a row-parallel projection, say) stay with the layer
    new._forward_hooks.update(old._forward_hooks)
    new._forward_pre_hooks.update(old._forward_pre_hooks)
    setattr(parent, name, new)


def quantize_model(
    model: nn.Module, method: str, device: torch.device, include_lm_head: bool = False, kernel: str | None = None
) -> QuantizationReport:
    """Quantize the decoder's linear layers in place (and the LM head if asked); the weight memory.

    ``kernel`` overrides the automatic choice (``int_mm``, ``scaled_mm`` or ``dequant``), for comparisons.
    """
    check_method(method, device)
    if kernel not in (None, *KERNELS):
        raise QuantizationError(f"unknown quantization kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if (kernel == "int_mm" and method == rules.FP8) or (kernel == "scaled_mm" and method != rules.FP8):
        raise QuantizationError(f"the {kernel} kernel cannot run {method} weights")
    before = model_bytes(model)
    if method == "none":
        return QuantizationReport(method, 0, before, before)
    targets = _targets(model, include_lm_head)
    unsupported = sorted({type(child).__name__ for _, _, child in targets if type(child) is not nn.Linear})
    if unsupported:
        raise QuantizationError(f"cannot quantize {', '.join(unsupported)} layers: only plain nn.Linear")
    act_dtype = next(model.parameters()).dtype
    kernel = kernel or pick_kernel(method, device, act_dtype)
    weight_dtype = torch.float8_e4m3fn if method == rules.FP8 else torch.int8
    with torch.no_grad():
        for parent, name, child in targets:
            fits = kernel != "scaled_mm" or all(size % 16 == 0 for size in child.weight.shape)
            _replace(parent, name, child, QuantizedLinear.of(child, weight_dtype, kernel if fits else "dequant"))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the KV cache is sized from the memory the driver reports free
    report = QuantizationReport(method, len(targets), before, model_bytes(model), kernel)
    log.info("%s", report)
    return report


__all__ = ["METHODS", "QuantizationError", "QuantizationReport", "QuantizedLinear", "quantize_model"]
