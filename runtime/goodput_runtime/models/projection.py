"""The compact decoder's projections and norms: several linears fused into one, a product in each form the
step plan chooses (F.linear, the transposed product, oneDNN over a packed weight, the runtime's skinny
product, Triton's GEMV), the packed copy oneDNN reads, and transformers' RMS norm."""

from __future__ import annotations

import torch
from torch import nn

from goodput_runtime.layers import native_attention, triton_linear
from goodput_runtime.layers.step_plan import LINEAR, NATIVE, ONEDNN
from goodput_runtime.models.graph_ops import NATIVE_OP, ONEDNN_OP, onednn_linear_op, skinny_linear_op


def linear_of(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """nn.Linear holding these tensors, built without first initialising weights it would throw away (random
    values the size of the layer; on the meta device that imports torch's compiler: most of a second)."""
    out = nn.Linear.__new__(nn.Linear)
    nn.Module.__init__(out)
    out.out_features, out.in_features = weight.shape
    out.weight = nn.Parameter(weight, requires_grad=False)
    out.register_parameter("bias", None if bias is None else nn.Parameter(bias, requires_grad=False))
    return out


def fuse(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing the given ones' outputs side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    if all(lin.bias is None for lin in linears):
        return linear_of(weight)
    biases = [
        weight.new_zeros(lin.out_features) if lin.bias is None else lin.bias.detach()  # a part without one adds zeros
        for lin in linears
    ]
    return linear_of(weight, torch.cat(biases))


def project(x: torch.Tensor, linear: nn.Module, form: str = LINEAR) -> torch.Tensor:
    """linear(x) [T, out] for x [T, in]; for a plain nn.Linear in the given form (layers/step_plan.py):
    F.linear, the same product as W @ x^T, oneDNN's matmul over the weight packed by `pack` (ONEDNN_OP:
    the same through its custom operator, as the compiled graph calls it), or the runtime's skinny
    product (NATIVE_OP: through its operator; F.linear where it does not run). A one-row product on a
    projection layers/triton_linear.py marked (on a GPU) runs its Triton GEMV instead of cuBLAS."""
    if form == LINEAR and x.shape[0] == 1 and type(linear) is nn.Linear and getattr(linear, "gemv", False):
        return triton_linear.gemv_op(x, linear.weight, linear.bias)
    if form == LINEAR or type(linear) is not nn.Linear:
        return linear(x)
    if form == NATIVE:
        out = native_attention.skinny_linear(x, linear.weight, linear.bias)
        return linear(x) if out is None else out
    if form == NATIVE_OP:
        return skinny_linear_op(x, linear.weight, linear.bias)
    if form in (ONEDNN, ONEDNN_OP):
        packed = getattr(linear, "packed", None)
        if packed is None:
            return linear(x)
        if form == ONEDNN_OP:  # inside the compiled graph
            return onednn_linear_op(x.contiguous(), packed, linear.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, linear.bias, "none", [], "")
    if linear.bias is None:
        return torch.mm(linear.weight, x.t()).t().contiguous()
    return torch.addmm(linear.bias[:, None], linear.weight, x.t()).t().contiguous()


def pack(linear: nn.Module) -> bool:
    """Keep beside a plain nn.Linear's weight a copy in oneDNN's blocked layout (its `packed`), for
    project's onednn form; False where oneDNN cannot take it (no oneDNN build, another dtype)."""
    if type(linear) is not nn.Linear or linear.weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if linear.weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), PACK_ROWS)
    except RuntimeError:
        return False
    linear.packed = packed  # a plain attribute: not a parameter, never in a state dict
    return True


PACK_ROWS = 16  # the row count oneDNN lays the packed weight out for (it serves any count)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: computed in float32, scaled in the model's dtype."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
