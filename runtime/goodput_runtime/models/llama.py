"""A compact decoder for Llama, Mistral and Qwen2: fused projections, paged attention called directly.

transformers' generic modules pay per layer for what a serving step never uses (a batch
dimension of one, masks built and checked, the attention interface's dispatch, keyword
arguments threaded through every call). These modules compute the same thing with fewer
operations: one matrix multiply for the query, key and value projections and one for the
MLP's gate and up projections, the rotary embedding applied to queries and keys together,
the step kept as a flat [tokens, hidden] matrix, and ``attention.attend`` called on it.

They are built from a model transformers has loaded (from safetensors or a GGUF file), taking
its weights: the fused weights are the concatenation of the separate ones, every other module
(embeddings, norms' weights, the LM head, the rotary embedding with its scaling rules) is the
loaded one. The output is transformers' up to floating-point summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from goodput_runtime.layers import fused, lora, triton_linear
from goodput_runtime.layers.attention import PagedBatch, attend
from goodput_runtime.layers.fused import rotate
from goodput_runtime.layers.step_plan import LINEAR, ONEDNN, StepPlan
from goodput_runtime.models.support import sliding_windows


@dataclass
class DecoderOutput:
    last_hidden_state: torch.Tensor  # [1, T, hidden]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [1, N, vocab]


def fuse(linears: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing the given ones' outputs side by side."""
    weight = torch.cat([lin.weight.detach() for lin in linears])
    has_bias = [lin.bias is not None for lin in linears]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=any(has_bias), device=weight.device, dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if any(has_bias):
        bias = torch.cat(
            [
                lin.bias.detach()
                if lin.bias is not None
                else torch.zeros(lin.out_features, dtype=weight.dtype, device=weight.device)
                for lin in linears
            ]
        )
        fused.bias = nn.Parameter(bias, requires_grad=False)
    return fused


def project(x: torch.Tensor, linear: nn.Module, form: str = LINEAR) -> torch.Tensor:
    """linear(x) [T, out] for x [T, in]; for a plain nn.Linear in the given form (layers/step_plan.py):
    F.linear, the same product as W @ x^T, or oneDNN's matmul over the weight packed by `pack` (ONEDNN_OP:
    the same through its custom operator, as the compiled graph calls it). A one-row product on a
    projection layers/triton_linear.py marked (on a GPU) runs its Triton GEMV instead of cuBLAS."""
    if form == LINEAR and x.shape[0] == 1 and type(linear) is nn.Linear and getattr(linear, "gemv", False):
        return triton_linear.gemv_op(x, linear.weight, linear.bias)
    if form == LINEAR or type(linear) is not nn.Linear:
        return linear(x)
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


# A compiled step (``CausalLM.compile_layers``) is one graph for the whole stack of layers, as vLLM
# compiles its models: the per-operation cost of a step's several hundred small operations, which
# dominates a decode step beside its matrix products, is paid once per step instead. Inside the
# graph two operations stay opaque to the compiler, as custom operators: the paged attention, which
# reads the step's layout (a PagedBatch: Python lists of groups) from STEP, set around the call, and
# writes the cache; and oneDNN's matmul over a packed weight, which inductor would only take as a
# frozen constant.
STEP: list[PagedBatch] = []  # the step the compiled graph runs; set by Decoder.forward around the call
COMPILED_MAX_TOKENS = 256  # steps of more tokens run eagerly: their matrix products dominate them
ONEDNN_OP = "onednn-op"  # the onednn form as the compiled graph runs it (project)


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


def run_layers(layers: Any, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, form: str) -> torch.Tensor:
    """Every decoder layer on the step's hidden states h [T, hidden]: what the compiled graph holds. The
    layers' own forward, with no batch (attention through its operator, which reads STEP) and oneDNN's
    products through theirs."""
    form = ONEDNN_OP if form == ONEDNN else form
    for layer in layers:
        h = layer(h, cos, sin, None, form)
    return h


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


class Decoder(nn.Module):
    def __init__(self, source: Any, config: Any, windows: list[int | None]) -> None:
        super().__init__()
        self.embed_tokens = source.embed_tokens
        self.rotary_emb = source.rotary_emb
        self.layers = nn.ModuleList(DecoderLayer(layer, i, config, windows[i]) for i, layer in enumerate(source.layers))
        self.norm = RMSNorm(source.norm.weight, source.norm.variance_epsilon)
        self.plan: StepPlan | None = None  # set by the runner (layers/step_plan.py)
        self.compiled: Any = None  # run_layers through torch.compile (CausalLM.compile_layers)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, paged: PagedBatch, **_: Any
    ) -> DecoderOutput:
        """input_ids, position_ids [1, T]: one flat step; its projections in the form the step plan
        gives steps of T tokens (``F.linear`` without a plan), through the compiled graph when there
        is one and the step is not too large for it to pay."""
        h = self.embed_tokens(input_ids[0])
        cos, sin = self.rotary_emb(h, position_ids)  # [1, T, D]
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]
        form = LINEAR if self.plan is None else self.plan.layer_form(h.shape[0])
        if self.compiled is not None and h.shape[0] <= COMPILED_MAX_TOKENS:
            STEP.append(paged)
            try:
                h = self.compiled(self.layers, h, cos, sin, form)
            finally:
                STEP.pop()
        elif fused.enabled(h):
            x, residual = h, None
            for layer in self.layers:
                x, residual = cast(DecoderLayer, layer).forward_fused(x, residual, cos, sin, paged, form)
            return DecoderOutput(fused.rms_norm(x, self.norm.weight, self.norm.eps, residual)[0][None])
        else:
            for layer in self.layers:
                h = layer(h, cos, sin, paged, form)
        return DecoderOutput(self.norm(h)[None])


class CausalLM(nn.Module):
    """The runtime's decoder with transformers' model interface as the runner uses it."""

    def __init__(self, source: Any) -> None:
        super().__init__()
        self.config = source.config
        self.generation_config = getattr(source, "generation_config", None)
        self.model = Decoder(source.model, source.config, sliding_windows(source))
        self.lm_head = source.lm_head
        for linear in self.linears():  # project reads it each call: a missing attribute costs ~1 µs to look up
            linear.__dict__["gemv"] = False  # (layers/triton_linear.mark sets it on a GPU)

    def get_input_embeddings(self) -> nn.Module:
        return self.model.embed_tokens

    def compile_layers(self) -> str | None:
        """Run the stack of decoder layers as one ``torch.compile`` (inductor) graph per step of up to
        COMPILED_MAX_TOKENS tokens, the step's token count dynamic: a graph for one token and one for
        any other count, per form of the projections the step plan uses. Compiled lazily, at the
        first step of each kind (the runner warms them up). None when done, else why not."""
        if getattr(self.config, "hidden_act", "silu") != "silu":
            return f"activation {self.config.hidden_act}"
        layers: list[Any] = list(self.model.layers)
        for layer in layers:
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
            if any(type(lin) is not nn.Linear for lin in linears):
                return "quantized projections"
        self.model.compiled = torch.compile(run_layers, dynamic=True, fullgraph=True)
        return None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        paged: PagedBatch,
        logits_to_keep: int | torch.Tensor = 0,
        **_: Any,
    ) -> CausalLMOutput:
        """Logits of the rows `logits_to_keep` names: the last N for an int N (0: all), or an index tensor."""
        h = self.model(input_ids, position_ids, paged).last_hidden_state
        h = h[:, -logits_to_keep:] if isinstance(logits_to_keep, int) else h[:, logits_to_keep]
        return CausalLMOutput(self.logits(h[0])[None])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over hidden states [N, hidden], in the form the step plan gives N rows."""
        plan = self.model.plan
        return project(hidden, self.lm_head, LINEAR if plan is None else plan.head_form(hidden.shape[0]))

    def linears(self) -> list[Any]:
        """Every projection the step plan's forms apply to: the layers' four and the LM head."""
        found: list[Any] = [self.lm_head]
        layers: list[Any] = list(self.model.layers)
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            found += [a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj]
        return found

    def enable_lora(self, slots: int, max_rank: int) -> dict[tuple[int, str], tuple[lora.LoraStack, int]]:
        """A LoRA stack of `slots` slots (slot 0 the base model) on each layer's projections; by (layer,
        PEFT's module name: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), the stack
        holding that module's adapter and its part of it."""
        targets: dict[tuple[int, str], tuple[lora.LoraStack, int]] = {}
        layers: list[Any] = list(self.model.layers)
        weight: torch.Tensor = self.model.embed_tokens.weight
        dtype, device = weight.dtype, weight.device
        for i, layer in enumerate(layers):
            a, mlp = layer.self_attn, layer.mlp
            hidden = a.heads * a.head_dim
            q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
            a.lora_qkv = lora.LoraStack(slots, self.config.hidden_size, [q, kv, kv], max_rank, dtype, device)
            a.lora_o = lora.LoraStack(slots, hidden, [self.config.hidden_size], max_rank, dtype, device)
            inter = mlp.intermediate
            mlp.lora_gate_up = lora.LoraStack(slots, self.config.hidden_size, [inter, inter], max_rank, dtype, device)
            mlp.lora_down = lora.LoraStack(slots, inter, [self.config.hidden_size], max_rank, dtype, device)
            for part, name in enumerate(("q_proj", "k_proj", "v_proj")):
                targets[i, name] = (a.lora_qkv, part)
            targets[i, "o_proj"] = (a.lora_o, 0)
            targets[i, "gate_proj"] = (mlp.lora_gate_up, 0)
            targets[i, "up_proj"] = (mlp.lora_gate_up, 1)
            targets[i, "down_proj"] = (mlp.lora_down, 0)
        return targets

    def normed_linears(self) -> list[Any]:
        """The projections an RMS norm precedes (layers/triton_linear.py tunes them with it)."""
        layers: list[Any] = list(self.model.layers)
        return [lin for layer in layers for lin in (layer.self_attn.qkv_proj, layer.mlp.gate_up_proj)]

    def pack_weights(self) -> int:
        """oneDNN's packed copy of every plain projection's weight (see pack); how many got one."""
        return sum(pack(linear) for linear in self.linears())

    def drop_unpacked_weights(self) -> int:
        """Free the weights that have a packed copy (the LM head's too unless the embeddings share it),
        once every step runs in the onednn form; the bytes freed. F.linear and the transposed form
        cannot run on these projections afterwards."""
        shared = self.model.embed_tokens.weight.data_ptr()
        freed = 0
        for linear in self.linears():
            weight = linear.weight
            if "packed" in linear.__dict__ and weight.numel() and weight.data_ptr() != shared:
                freed += weight.numel() * weight.element_size()
                linear.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
        return freed

    def unpack_weights(self) -> None:
        """Drop the packed copies (when the step plan never uses them)."""
        for linear in self.linears():
            linear.__dict__.pop("packed", None)


def from_transformers(model: Any) -> CausalLM:
    """The compact model holding `model`'s weights (which it shares or concatenates)."""
    with torch.no_grad():
        own = CausalLM(model)
    own.eval()
    return own
