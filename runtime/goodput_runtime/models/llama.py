"""A compact decoder for Llama, Mistral and Qwen2: fused projections, paged attention called directly.

transformers' generic modules pay per layer for what a serving step never uses (a batch
dimension of one, masks built and checked, the attention interface's dispatch, keyword
arguments threaded through every call). These modules compute the same thing with fewer
operations: one matrix multiply for the query, key and value projections and one for the
MLP's gate and up projections, the rotary embedding applied to queries and keys together,
the step kept as a flat [tokens, hidden] matrix, and ``attention.attend`` called on it.

They are built from a model transformers has loaded (from safetensors or a GGUF file), taking
its weights, or from the same tree of weights read straight from safetensors (models/direct.py):
the fused weights are the concatenation of the separate ones, every other module (embeddings,
norms' weights, the LM head, the rotary embedding with its scaling rules) is the loaded one. The
output is transformers' up to floating-point summation order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

from goodput_runtime.layers import fused, lora
from goodput_runtime.layers.attention import PagedBatch
from goodput_runtime.layers.step_plan import LINEAR, StepPlan
from goodput_runtime.models.decoder_layer import DecoderLayer
from goodput_runtime.models.graph_ops import STEP, run_layers
from goodput_runtime.models.projection import RMSNorm, pack, project, rms_norm
from goodput_runtime.models.support import sliding_windows

# the engine and the tests import these from here
__all__ = ["COMPILED_MAX_TOKENS", "CausalLM", "from_transformers", "project", "rms_norm"]

COMPILED_MAX_TOKENS = 256  # steps of more tokens run eagerly: their matrix products dominate them


@dataclass
class DecoderOutput:
    last_hidden_state: torch.Tensor  # [1, T, hidden]


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # [1, N, vocab]


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
