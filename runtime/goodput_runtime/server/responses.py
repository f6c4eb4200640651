"""Response bodies and stream chunks, shaped exactly like OpenAI's."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Shape:
    """One response's identity; subclasses say how its text is wrapped."""

    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.prefix}-{uuid.uuid4().hex}"

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def chunk_envelope(self, choices: list[dict]) -> dict:
        body = self.envelope(self.chunk_object, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, counts: dict) -> dict:
        return {**self.chunk_envelope([]), "usage": counts}

    def first_chunks(self) -> list[dict]:
        return []

    def chunk(self, text: str, finish_reason: str | None = None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self.chunk_envelope([choice])

    def response(self, text: str, finish_reason: str | None, counts: dict) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self.envelope(self.object_name, [choice]), "usage": counts}


class CompletionShape(Shape):
    pass


class ChatShape(Shape):
    prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def delta(self, delta: dict, finish_reason: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self.chunk_envelope([choice])

    def first_chunks(self) -> list[dict]:
        return [self.delta({"role": "assistant", "content": ""})]

    def chunk(self, text: str, finish_reason: str | None = None) -> dict:
        return self.delta({"content": text} if text else {}, finish_reason)

    def response(self, text: str, finish_reason: str | None, counts: dict) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                  "logprobs": None, "finish_reason": finish_reason}
        return {**self.envelope(self.object_name, [choice]), "usage": counts}
