"""Which module tree serves a loaded model: the compact modules of llama.py where they apply (``--model-impl
auto``, the default), else transformers' own modules with the paged attention behind their attention interface
(``--model-impl transformers``, any architecture support.py does not list, or tensor parallelism)."""

from __future__ import annotations

import logging
from typing import Any

from goodput_runtime.models.llama import from_transformers
from goodput_runtime.models.support import unsupported_reason

log = logging.getLogger(__name__)


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
