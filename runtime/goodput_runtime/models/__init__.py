"""The runtime's own model modules, standing in for transformers' where they apply.

``--model-impl auto`` (the default) serves Llama, Mistral and Qwen2 models through the compact
modules of ``goodput_runtime.models.llama``; any other architecture, a model under tensor
parallelism, or ``--model-impl transformers`` runs on transformers' own modules with the paged
attention behind its attention interface.
"""

from __future__ import annotations

import logging
from typing import Any

from goodput_runtime.models.llama import from_transformers
from goodput_runtime.models.support import ARCHITECTURES, unsupported_reason

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "transformers")


def choose(model: Any, implementation: str, tensor_parallel: int = 1) -> Any:
    """The module tree to serve `model` (loaded by transformers) with: the compact one where it applies."""
    name = type(model).__name__
    if implementation == "transformers":
        log.info("%s runs on transformers' modules (--model-impl transformers)", name)
        return model
    reason = unsupported_reason(model)
    if reason is None and tensor_parallel > 1:
        reason = "tensor parallelism shards transformers' separate projections"
    if reason is not None:
        log.info("%s runs on transformers' modules: %s", name, reason)
        return model
    log.info("%s runs on the runtime's compact modules (fused projections)", name)
    return from_transformers(model)


__all__ = ["ARCHITECTURES", "IMPLEMENTATIONS", "choose"]
