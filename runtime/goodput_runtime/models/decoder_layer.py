"""The compact decoder's layer: attention on the fused QKV projection (paged attention called directly, or
through its operator inside the compiled graph), the MLP on the fused gate-up projection, and the layer's
three ways through a step: plain, with the residual sums folded into the norms, and one token as four
GEMV launches."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from goodput_runtime.layers import fused, lora, triton_linear
from goodput_runtime.layers.attention import PagedBatch, attend
from goodput_runtime.layers.fused import rotate
from goodput_runtime.layers.step_plan import LINEAR
from goodput_runtime.models.graph_ops import paged_attention_op
from goodput_runtime.models.projection import RMSNorm, fuse, project


class Attention(nn.Module):
    def __init__(
        self, source: Any, layer_idx: int, heads: int, kv_heads: int, head_dim: int, sliding_window: int | None
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.scaling = getattr(source, "scaling", head_dim**-0.5)
        self.sliding_window = sliding_window
        self.qkv_proj = fuse([source.q_proj, source.k_proj, source.v_proj])
        self.o_proj = source.o_proj
        # LoRA adapters' updates of the two projections (layers/lora.py), once adapters are enabled
        self.lora_qkv: lora.LoraStack | None = None
        self.lora_o: lora.LoraStack | None = None

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch | None, form: str = LINEAR
    ) -> torch.Tensor:
        """batch None: inside the compiled graph, attention through its operator (on STEP's batch)."""
        qkv = lora.apply_(project(x, self.qkv_proj, form), x, self.lora_qkv)
        out = self.attend(qkv, cos, sin, batch)
        return lora.apply_(project(out, self.o_proj, form), out, self.lora_o)

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch | None,
        rotary_in_attention: bool = False,
    ) -> torch.Tensor:
        """The attention's output [T, heads * head_dim] from the qkv projection [T, (H + 2 KVH) D].
        rotary_in_attention: the rotary embedding left to attention.attend (the decode kernel on CUDA
        applies it as it reads the query and key: one launch fewer a layer)."""
        t = qkv.shape[0]
        qk_width = (self.heads + self.kv_heads) * self.head_dim
        qk = qkv[:, :qk_width].view(t, self.heads + self.kv_heads, self.head_dim)
        rotary = (cos, sin) if rotary_in_attention else None
        if rotary is None:  # eagerly, in place and fused (layers/fused.py); compiled, as inductor fuses it
            qk = rotate(qk, cos, sin) if batch is None else fused.rotary_(qk, cos, sin)
        if batch is None:
            window = -1 if self.sliding_window is None else self.sliding_window
            out = paged_attention_op(
                qk, qkv, self.heads, self.layer_idx, float(self.scaling), window, *(rotary or (None, None))
            )
        else:
            q, k = qk[:, : self.heads], qk[:, self.heads :]
            v = qkv[:, qk_width:].view(t, self.kv_heads, self.head_dim)
            out = attend(batch, self.layer_idx, q, k, v, self.scaling, self.sliding_window, rotary)
        return out.reshape(t, self.heads * self.head_dim)


class MLP(nn.Module):
    def __init__(self, source: Any) -> None:
        super().__init__()
        self.gate_up_proj = fuse([source.gate_proj, source.up_proj])
        self.down_proj = source.down_proj
        self.act = source.act_fn
        self.silu = fused.is_silu(self.act)
        self.intermediate = source.gate_proj.out_features
        self.lora_gate_up: lora.LoraStack | None = None
        self.lora_down: lora.LoraStack | None = None

    def forward(self, x: torch.Tensor, form: str = LINEAR, fuse_act: bool = False) -> torch.Tensor:
        gate_up = lora.apply_(project(x, self.gate_up_proj, form), x, self.lora_gate_up)
        if fuse_act:
            act = fused.silu_mul(gate_up, self.intermediate, self.act)
        else:
            act = self.act(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return lora.apply_(project(act, self.down_proj, form), act, self.lora_down)


class DecoderLayer(nn.Module):
    def __init__(self, source: Any, layer_idx: int, config: Any, sliding_window: int | None) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.self_attn = Attention(
            source.self_attn, layer_idx, config.num_attention_heads, kv_heads, head_dim, sliding_window
        )
        self.mlp = MLP(source.mlp)
        self.input_layernorm = RMSNorm(source.input_layernorm.weight, source.input_layernorm.variance_epsilon)
        self.post_attention_layernorm = RMSNorm(
            source.post_attention_layernorm.weight, source.post_attention_layernorm.variance_epsilon
        )

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch | None, form: str = LINEAR
    ) -> torch.Tensor:
        if h.shape[0] == 1 and not lora.ACTIVE and self.gemv_chain():
            return self.forward_gemv(h, cos, sin, batch)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, batch, form)
        return h + self.mlp(self.post_attention_layernorm(h), form)

    def gemv_chain(self) -> bool:
        """Whether a one-token step runs as forward_gemv: the layer's four projections marked for the GPU's
        GEMV (layers/triton_linear.py), its activation SiLU, the fusion on."""
        attn, mlp = self.self_attn, self.mlp
        return (
            triton_linear.FUSE
            and mlp.silu
            and all(
                getattr(lin, "gemv", False) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            )
        )

    def forward_gemv(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: PagedBatch | None
    ) -> torch.Tensor:
        """``forward`` for one token as four GEMV launches with the work between them folded in: each
        norm into the product after it, the residual sums into the output and down projections, SiLU x
        up into the down projection, the rotary embedding into attention's kernel; only attention runs
        between them."""
        attn, mlp, norm1, norm2 = self.self_attn, self.mlp, self.input_layernorm, self.post_attention_layernorm
        gemv = triton_linear.gemv_op
        qkv = gemv(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm1.weight, norm1.eps)
        h = gemv(
            attn.attend(qkv, cos, sin, batch, rotary_in_attention=True),
            attn.o_proj.weight,
            attn.o_proj.bias,
            residual=h,
        )
        gate_up = gemv(h, mlp.gate_up_proj.weight, mlp.gate_up_proj.bias, norm2.weight, norm2.eps)
        return gemv(gate_up, mlp.down_proj.weight, mlp.down_proj.bias, silu=True, residual=h)

    def forward_fused(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: PagedBatch,
        form: str,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward`` with the residual sums folded into the norms (layers/fused.py): x is the previous
        layer's MLP output (the embeddings at the first layer, residual None), residual the stream
        before it; returns this layer's MLP output and the stream before it. The stream's tensor is
        summed into in place."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        h, residual = fused.rms_norm(x, norm1.weight, norm1.eps, residual)
        h, residual = fused.rms_norm(self.self_attn(h, cos, sin, batch, form), norm2.weight, norm2.eps, residual)
        return self.mlp(h, form, fuse_act=True), residual
