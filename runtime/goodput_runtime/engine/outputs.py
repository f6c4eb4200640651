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
    """The prompt plus at least one generated token (an embedding request's input alone) does not fit
    --max-model-len."""


class EngineStoppedError(EngineError):
    """The engine is shutting down and admits no new work."""


@dataclass(slots=True)
class TokenLogprob:
    """One token's log probability, with the likeliest tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), likeliest first, as many as the request asked for


@dataclass(slots=True)
class RequestOutput:
    """What one choice of a request produced since its previous output."""

    request_id: str
    text: str  # text produced since the previous output of this choice
    token_ids: list[int]  # tokens produced since the previous output of this choice
    finished: bool = False  # the request's last output: every choice has finished
    finish_reason: str | None = None  # this choice's, once it has finished: stop | length | abort | error
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # this choice's, so far
    num_cached_tokens: int = 0
    index: int = 0  # the choice
    logprobs: list[TokenLogprob] | None = None  # of token_ids, when the request asked for them
    # the prompt's tokens, the first without a logprob (None), on a choice's first output when asked for
    prompt_logprobs: list[TokenLogprob | None] | None = None
    embedding: list[float] | None = None  # an embedding request's vector, on its finished output
    # a prefill runtime's request (kv_transfer_params do_remote_decode): on its finished output, the
    # hand-off a decode runtime pulls its prompt's blocks by (kv_transfer/params.py)
    kv_transfer_params: dict | None = None
    # this choice's output tokens whose whole text has been handed out (in this output's text or before):
    # a stream reports a token's id once its text is sent (server/generate.py); None: every one so far
    num_shown_tokens: int | None = None


__all__ = [
    "EngineError",
    "EngineStoppedError",
    "InvalidPromptError",
    "PromptTooLongError",
    "QueueFullError",
    "RequestOutput",
    "TokenLogprob",
]
