"""The model architectures the runtime serves, as named in a config.json's ``architectures``.

Each maps to its transformers ``model_type``. The runtime serves these because their
transformers model code routes attention through the attention interface, where its paged
attention drops in; each is exercised by the runtime's test suite. The operator refuses a
model of any other architecture before a pod starts; the runtime refuses it at load.
"""

from __future__ import annotations

from collections.abc import Sequence

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "MistralForCausalLM": "mistral",
}


def is_supported(architectures: Sequence[str]) -> bool:
    """Whether any of a config's ``architectures`` is one the runtime serves."""
    return any(a in SUPPORTED_ARCHITECTURES for a in architectures)


def architecture_problem(architectures: Sequence[str], where: str) -> str | None:
    """Why a model whose config.json (``where``) lists ``architectures`` cannot be served; None when it can."""
    if is_supported(architectures):
        return None
    return (
        f"unsupported architecture {', '.join(architectures) or '(none given)'} in {where}; "
        f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )
