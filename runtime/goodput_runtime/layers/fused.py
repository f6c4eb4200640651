"""The compact decoder's element-wise operations fused, on CPU: one pass and one call each.

A decoder layer runs about twenty element-wise torch operations besides its four matrix
products (the RMS norm's power, mean, sum, reciprocal root and two products, twice; the rotary
embedding's negation, concatenation, two products and sum; the MLP's SiLU and product; two
residual sums). In a decode step each costs a dispatch of a few microseconds for almost no
work; in a prompt step each is a pass over the step's activations. Here they are three C++
functions (layers/native_ops_source.py, in the native attention extension):

- ``rms_norm``: the residual sum and the RMS norm after it (``residual += h`` in place, then the
  norm of the sum times the weight), as vLLM's fused_add_rms_norm;
- ``rotary_``: the rotary embedding applied in place to the step's queries and keys;
- ``silu_mul``: SiLU of the gate times the up projection.

float32 and bfloat16 on CPU with AVX-512, float32 with AVX2 and FMA (on an AVX2-only EPYC a decode step
of one sequence of SmolLM2-135M took 29 ms against 36 with the torch operations); elsewhere (CUDA,
float16, bfloat16 without AVX-512, no compiler) and with
``GOODPUT_FUSED_OPS=off`` each falls back to the torch operations it replaces. The results are the
torch operations' up to the order of the norm's sum of squares and the exponential's last bit; in
bfloat16 the functions compute in fp32 and round to bfloat16 wherever torch's operations store an
intermediate result, so that holds there too.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from goodput_runtime.layers import native_attention

# "auto": the fused functions wherever they run; "off": always the torch operations
FUSED = os.environ.get("GOODPUT_FUSED_OPS", "auto")
if FUSED not in ("auto", "off"):
    raise ValueError(f"GOODPUT_FUSED_OPS={FUSED!r}: expected auto or off")

_NONE = torch.empty(0)
DTYPES = (torch.float32, torch.bfloat16)


def _ext(x: torch.Tensor):
    if FUSED == "off" or x.device.type != "cpu" or x.dtype not in DTYPES:
        return None
    return native_attention.module()


def enabled(x: torch.Tensor) -> bool:
    """Whether the fused functions run for steps like x (else each call falls back to torch)."""
    return _ext(x) is not None


def rms_norm(
    h: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s) * weight, s) with s = h + residual, written into residual in place (s = h when
    residual is None): the residual stream's sum and the norm that reads it, transformers' LlamaRMSNorm
    (float32) on the sum."""
    ext = _ext(h)
    if ext is not None and h.dim() == 2 and h.stride(1) == 1:
        out = ext.rms_norm(h, _NONE if residual is None else residual, residual is not None, weight, eps)
        if out is not None:
            return out, h if residual is None else residual
    s = h if residual is None else residual.add_(h)
    x = s.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(s.dtype), s


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding on x [T, heads, D] with cos, sin [T, 1, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``rotate`` of x [T, heads, D] (rows and heads may be strided, D contiguous): x itself, rotated in
    place, where the fused function runs; a new tensor from the torch operations elsewhere."""
    ext = _ext(x)
    if ext is not None and x.stride(-1) == 1:
        c, s = cos.reshape(cos.shape[0], -1), sin.reshape(sin.shape[0], -1)
        if c.shape[1] == x.shape[-1] and c.is_contiguous() and s.is_contiguous() and ext.rotary_(x, c, s):
            return x
    return rotate(x, cos, sin)


def is_silu(act: nn.Module) -> bool:
    """Whether act is SiLU: torch's module, or transformers' (``ACT2FN["silu"]``)."""
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def silu_mul(gate_up: torch.Tensor, width: int, act: nn.Module) -> torch.Tensor:
    """act(gate) * up of gate_up [T, 2 * width] (gate first); fused where act is SiLU."""
    ext = _ext(gate_up)
    if ext is not None and is_silu(act) and gate_up.stride(-1) == 1:
        out = ext.silu_mul(gate_up, width)
        if out is not None:
            return out
    return act(gate_up[:, :width]) * gate_up[:, width:]
