"""The compact modules loaded straight from a model directory's safetensors, without transformers' model code.

Importing transformers' model classes costs about three seconds of a server's start (its modeling code pulls
in torch's compiler, its distributed tensors and scipy), and building its module tree costs more before the
compact modules (models/llama.py) take its weights. Where the compact modules serve the model anyway, the
runtime reads the tensors itself and hands llama.py the same tree of weights transformers would have built:
the same names, shapes, biases, tied embeddings, dtype and rotary embedding, so the served model is the one
``--model-impl transformers`` loads (the tests compare the logits). transformers still reads the config, the
generation config and the tokenizer.

Anything else loads through transformers: GGUF files, checkpoints with a ``quantization_config``, rotary
scalings that change with the sequence's length (``dynamic``, ``longrope``), tensor or pipeline parallelism,
``--model-impl transformers``, and a checkpoint whose tensors are not named as transformers names them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from goodput_runtime.models.llama import CausalLM
from goodput_runtime.models.projection import linear_of
from goodput_runtime.models.support import ARCHITECTURES

log = logging.getLogger(__name__)

ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # fixed frequencies; the others change with the length
INDEX = "model.safetensors.index.json"


class RotaryEmbedding(nn.Module):
    """transformers' rotary embedding of these architectures with a fixed scaling: (cos, sin) [1, T, D] of
    positions [1, T], computed in float32 and scaled by the scaling's attention factor."""

    def __init__(self, config: Any, device: torch.device) -> None:
        super().__init__()
        rope = config.rope_parameters
        if rope["rope_type"] == "default":
            dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
            inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config)
        self.inv_freq = nn.Buffer(inv_freq.to(device), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def shards(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX
    if index.exists():
        return sorted({model_dir / name for name in json.loads(index.read_text())["weight_map"].values()})
    return sorted(model_dir.glob("*.safetensors"))


def biases(architecture: str, config: Any) -> tuple[bool, bool, bool]:
    """Whether the q/k/v, o and MLP projections have biases, as transformers' modules of the architecture build them."""
    if architecture == "Qwen2ForCausalLM":
        return True, False, False
    if architecture == "LlamaForCausalLM":
        return bool(config.attention_bias), bool(config.attention_bias), bool(getattr(config, "mlp_bias", False))
    return False, False, False


def reason(model_dir: Path, config: Any, implementation: str, world: int) -> str | None:
    """Why this model loads through transformers rather than straight into the compact modules; None if it need not."""
    architecture = (getattr(config, "architectures", None) or ["?"])[0]
    if implementation == "transformers" or world > 1:
        return "--model-impl transformers" if world == 1 else "more than one rank"
    if model_dir.is_file() or not (model_dir / "config.json").exists() or not shards(model_dir):
        return "not a directory of safetensors"
    if architecture not in ARCHITECTURES:
        return f"no compact modules for {architecture}"
    if getattr(config, "quantization_config", None) is not None:
        return "a quantized checkpoint"
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r}"
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") not in ROPE_TYPES or "rope_theta" not in rope:
        return f"rotary scaling {rope.get('rope_type')!r}"
    return None


def layer_names(config: Any, architecture: str) -> set[str]:
    """Every tensor transformers' module tree loads (a tied LM head is the embeddings: a stored copy is not read)."""
    qkv_bias, o_bias, mlp_bias = biases(architecture, config)
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names |= {p + "input_layernorm.weight", p + "post_attention_layernorm.weight"}
        for proj, bias in [("q", qkv_bias), ("k", qkv_bias), ("v", qkv_bias), ("o", o_bias)]:
            names |= {p + f"self_attn.{proj}_proj.{part}" for part in ("weight", "bias")[: 1 + bias]}
        for proj in ("gate", "up", "down"):
            names |= {p + f"mlp.{proj}_proj.{part}" for part in ("weight", "bias")[: 1 + mlp_bias]}
    return names


def read_tensors(model_dir: Path, names: set[str], dtype: torch.dtype, device: torch.device):
    """{name: tensor} in dtype on device, or None when a tensor the tree needs is missing."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for shard in shards(model_dir):
        with safe_open(str(shard), framework="pt") as f:
            stored = f.keys()  # a safetensors file is not iterable itself
            for name in stored:
                if name in names:
                    found[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return found if names <= found.keys() else None


def linear(tensors: dict[str, torch.Tensor], name: str) -> nn.Linear:
    return linear_of(tensors[name + ".weight"], tensors.get(name + ".bias"))


def norm(tensors: dict[str, torch.Tensor], name: str, eps: float) -> SimpleNamespace:
    return SimpleNamespace(weight=nn.Parameter(tensors[name + ".weight"], requires_grad=False), variance_epsilon=eps)


def generation_config(model_dir: Path) -> Any:
    """The generation config transformers' ``from_pretrained`` gives the model: generation_config.json, else
    the one config.json implies."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir)
    except OSError:
        return GenerationConfig.from_pretrained(model_dir, config_file_name="config.json", _from_model_config=True)


def load(model_dir: Path, config: Any, dtype: torch.dtype, device: torch.device) -> CausalLM | None:
    """The compact model of the directory's weights; None when a tensor is not where transformers' names put it."""
    architecture = config.architectures[0]
    names = layer_names(config, architecture)
    tensors = read_tensors(model_dir, names, dtype, device)
    if tensors is None:
        return None
    weight = tensors["model.embed_tokens.weight"]
    embed = nn.Embedding(weight.shape[0], weight.shape[1], _weight=weight, _freeze=True)
    head = linear_of(weight if config.tie_word_embeddings else tensors["lm_head.weight"])
    if config.tie_word_embeddings:
        head.weight = embed.weight  # one parameter, as transformers ties them
    eps = config.rms_norm_eps
    layers = []
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = SimpleNamespace(**{f"{x}_proj": linear(tensors, p + f"self_attn.{x}_proj") for x in "qkvo"})
        if architecture == "Qwen2ForCausalLM":  # transformers' Qwen2 attention holds its window, by layer type
            sliding = config.layer_types[i] == "sliding_attention"
            attn.sliding_window = config.sliding_window if sliding else None
        mlp = SimpleNamespace(**{f"{x}_proj": linear(tensors, p + f"mlp.{x}_proj") for x in ("gate", "up", "down")})
        mlp.act_fn = nn.SiLU()
        layers.append(
            SimpleNamespace(
                self_attn=attn,
                mlp=mlp,
                input_layernorm=norm(tensors, p + "input_layernorm", eps),
                post_attention_layernorm=norm(tensors, p + "post_attention_layernorm", eps),
            )
        )
    decoder = SimpleNamespace(
        embed_tokens=embed,
        rotary_emb=RotaryEmbedding(config, device),
        layers=layers,
        norm=norm(tensors, "model.norm", eps),
    )
    source = SimpleNamespace(
        architecture=architecture,
        config=config,
        generation_config=generation_config(model_dir),
        model=decoder,
        lm_head=head,
    )
    with torch.no_grad():
        model = CausalLM(source)
    model.eval()
    return model
