"""Which loaded models the compact modules (models/llama.py) can stand in for, and their layers'
sliding attention windows as transformers' modules apply them."""

from __future__ import annotations

from typing import Any

from torch import nn

ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def sliding_windows(source: Any) -> list[int | None]:
    """Each layer's sliding attention window as transformers' modules apply it (None: full attention); source is
    transformers' model or models/direct.py's tree of weights, which names its architecture."""
    config = source.config
    windows: list[int | None] = []
    for layer in source.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "sliding_window"):  # Qwen2: per layer, by its layer type
            windows.append(attn.sliding_window)
        elif getattr(source, "architecture", type(source).__name__) == "MistralForCausalLM":
            windows.append(getattr(config, "sliding_window", None))
        else:
            windows.append(None)
    return windows


def unsupported_reason(model: Any) -> str | None:
    """Why the compact modules cannot stand in for this loaded model; None when they can."""
    name = type(model).__name__
    if name not in ARCHITECTURES:
        return f"no compact modules for {name}"
    config = model.config
    act = getattr(config, "hidden_act", "silu")
    if not isinstance(act, str):
        return f"activation {act!r}"
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if any(type(lin) is not nn.Linear for lin in linears):
            return "projections other than plain nn.Linear"
        if any(hasattr(attn, n) for n in ("q_norm", "k_norm")) or not hasattr(mlp, "act_fn"):
            return "an attention or MLP layout the compact modules do not have"
    return None
