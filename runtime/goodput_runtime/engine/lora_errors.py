"""An adapter that cannot be served, with the HTTP status the API answers with."""

from __future__ import annotations


class LoraError(ValueError):
    """An adapter that cannot be served; `status` is the HTTP status the API answers with."""

    status = 400
    code = "invalid_lora_adapter"


class LoraNotFound(LoraError):
    status = 404
    code = "model_not_found"
