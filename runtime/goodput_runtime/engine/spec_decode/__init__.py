"""Speculative decoding: proposers guess a request's next k tokens cheaply, the target model checks
all k in the step's one forward pass, and the accepted prefix (plus the target's own next token) is
kept.

- ``ngram``: prompt lookup, pure Python; ``draft``: a small model with its own paged KV cache;
- ``rejection``: greedy acceptance and rejection sampling, so outputs keep the target's distribution;
- ``switch``: whether a step speculates at all, from the running batch and a threshold timed at start-up.

The scheduler gives a sequence's proposals their KV slots and verifies them as extra tokens of its
decode; what the target rejects is rolled back there (see ``Scheduler.update``).
"""

from __future__ import annotations

from typing import Any, Protocol

from goodput_runtime.sampling import SamplingParams

METHODS = ("ngram", "draft")


def can_speculate(params: SamplingParams, seq: Any) -> bool:
    """Whether a sequence's next tokens may be proposed: not for logprobs (each accepted token would
    need its own), penalties, logit bias or a minimum length (the logits of a later position depend on
    the tokens before it), a grammar, or an embedding request."""
    return (
        params.logprobs is None
        and not params.penalized
        and params.max_tokens > 0
        and getattr(seq, "grammar", None) is None
        and getattr(seq, "pooling", None) is None
    )


class Proposer(Protocol):
    def propose(self, requests: list[tuple[tuple[str, int], list[int]]]) -> list[list[int]]:
        """Up to k proposed tokens for each (sequence key, its tokens so far); may be empty."""
        ...

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request's sequences."""
        ...
