"""Which engine options the LoRA path serves, checked by name before any weight is loaded.

Served with adapters: speculative decoding (ngram and draft: proposals are checked on the request's
adapter), ``n`` > 1, logprobs, structured output, quantized weights (the adapters' products are added to
the quantized projection's output), prefix caching (salted per adapter), and on a GPU eager decode steps
(the decode CUDA graphs are left off; engine/builder.py). Refused, naming the option: ``--compile`` (the
compiled layers would bake in the base model's products), tensor and pipeline parallelism (the adapters'
stacks are not sharded nor cut into stages), the KV hand-off (``--kv-transfer-role``: a hand-off does not
carry the request's adapter), ``--model-impl transformers`` (the adapters live on the runtime's own
modules) and a ``--lora-source`` that is neither a directory nor ``hf://ORG``.
"""

from __future__ import annotations

from typing import Any

from goodput_runtime.engine import lora_sources


def wanted(config: Any) -> bool:
    return bool(config.enable_lora or config.lora_modules or config.lora_source)


def refusal(config: Any) -> str | None:
    """Why these options cannot serve LoRA adapters (None: they can, or adapters are off)."""
    if not wanted(config):
        return None
    flag = "--lora-modules" if config.lora_modules else "--lora-source" if config.lora_source else "--enable-lora"
    if config.compile:
        return f"{flag} with --compile: the compiled decoder layers do not run LoRA adapters yet; leave one off"
    for option, size in (
        ("--tensor-parallel-size", config.tensor_parallel_size),
        ("--pipeline-parallel-size", config.pipeline_parallel_size),
    ):
        if size > 1:
            return f"{flag} with {option} {size}: LoRA adapters are served on one rank only (size 1) yet"
    if config.kv_transfer_role != "none":
        return (
            f"{flag} with --kv-transfer-role {config.kv_transfer_role}: the KV hand-off does not carry a "
            "request's adapter yet; serve adapters from an undivided pool"
        )
    if config.model_impl == "transformers":
        return f"{flag} with --model-impl transformers: LoRA adapters run on the runtime's own modules (auto)"
    source = config.lora_source
    if source is not None and lora_sources.scheme(source) not in (None, "file", "hf"):
        return f"--lora-source {source}: expected a directory (a path or file://) or hf://ORG"
    if source is not None and source.startswith(lora_sources.HF) and "/" in source[5:].strip("/"):
        return f"--lora-source {source}: expected hf://ORG (each adapter is the repository ORG/NAME)"
    return None
