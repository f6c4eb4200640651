"""What the engine hands back to its callers."""

from __future__ import annotations

from dataclasses import dataclass


class EngineError(Exception):
    """Base for errors a caller can act on."""


class QueueFullError(EngineError):
    """The waiting queue holds --max-queue requests already: answer 429."""


class InvalidPromptError(EngineError, ValueError):
    """The prompt cannot be served as given."""


class PromptTooLongError(InvalidPromptError):
    """The prompt plus at least one generated token does not fit --max-model-len."""


class EngineStoppedError(EngineError):
    """The engine is shutting down and admits no new work."""


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    text: str  # text produced since the previous output of this request
    token_ids: list[int]  # tokens produced since the previous output
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0


__all__ = ["EngineError", "EngineStoppedError", "InvalidPromptError", "PromptTooLongError", "QueueFullError",
           "RequestOutput"]
