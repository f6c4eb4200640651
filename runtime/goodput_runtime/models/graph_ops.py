"""The custom operators a compiled step's graph keeps opaque, and the function the graph holds.

A compiled step (``CausalLM.compile_layers``) is one graph for the whole stack of layers, as vLLM
compiles its models: the per-operation cost of a step's several hundred small operations, which
dominates a decode step beside its matrix products, is paid once per step instead. Inside the
graph two operations stay opaque to the compiler, as custom operators: the paged attention, which
reads the step's layout (a PagedBatch: Python lists of groups) from STEP, set around the call, and
writes the cache; oneDNN's matmul over a packed weight, which inductor would only take as a
frozen constant; and the runtime's skinny product (the native form), a C++ extension's function.
"""

from __future__ import annotations

from typing import Any

import torch

from goodput_runtime.layers import native_attention
from goodput_runtime.layers.attention import PagedBatch, attend
from goodput_runtime.layers.step_plan import NATIVE, ONEDNN

STEP: list[PagedBatch] = []  # the step the compiled graph runs; set by Decoder.forward around the call
ONEDNN_OP = "onednn-op"  # the onednn form as the compiled graph runs it (project)
NATIVE_OP = "native-op"  # the native form as the compiled graph runs it


@torch.library.custom_op("goodput::paged_attention", mutates_args=())
def paged_attention_op(
    qk: torch.Tensor,
    qkv: torch.Tensor,
    heads: int,
    layer: int,
    scaling: float,
    window: int,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """attention.attend on STEP's batch (window < 0: none); writes the step's keys and values to the cache.

    qk [T, H + KVH, D]: the queries and keys after the rotary embedding (before it, with cos and sin:
    attend applies it); qkv [T, (H + 2 KVH) D]: the projection, whose tail holds the values. The
    operator takes these whole buffers and slices them itself: given the slices, inductor copied each
    into a new tensor first (two copies a layer).
    """
    t, width, dim = qk.shape
    value = qkv[:, width * dim :].view(t, width - heads, dim)
    return attend(
        STEP[-1],
        layer,
        qk[:, :heads],
        qk[:, heads:],
        value,
        scaling,
        None if window < 0 else window,
        None if cos is None or sin is None else (cos, sin),
    ).contiguous()


@paged_attention_op.register_fake
def _(
    qk: torch.Tensor,
    qkv: torch.Tensor,
    heads: int,
    layer: int,
    scaling: float,
    window: int,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    return qk.new_empty(qk.shape[0], heads, qk.shape[2])


@torch.library.custom_op("goodput::onednn_linear", mutates_args=())
def onednn_linear_op(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


@torch.library.custom_op("goodput::skinny_linear", mutates_args=())
def skinny_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = native_attention.skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias) if out is None else out


@skinny_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def run_layers(layers: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str) -> torch.Tensor:
    """Every decoder layer on the step's hidden states h [T, hidden]: what the compiled graph holds. The
    layers' own forward, with no batch (attention through its operator, which reads STEP) and oneDNN's
    and the native form's products through theirs."""
    form = {ONEDNN: ONEDNN_OP, NATIVE: NATIVE_OP}.get(form, form)
    for layer in layers:
        h = layer(h, cos, sin, None, form)
    return h
