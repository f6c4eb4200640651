"""Response bodies and stream chunks, shaped exactly like OpenAI's."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from goodput_runtime.engine.outputs import TokenLogprob

LOGPROB_FLOOR = -9999.0  # -inf (a token the request ruled out) is not JSON; reported as this, like vLLM


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's table), mapped back to the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


BYTE_LEVEL = byte_level_alphabet()
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenText:
    """Each token's own text, as logprobs name it (decoded alone, special tokens included), and its
    bytes; cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.byte_cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False) or ""
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's UTF-8 bytes; for a token holding part of a character (its text alone is U+FFFD),
        the raw bytes of a byte-level or byte-fallback vocabulary."""
        found = self.byte_cache.get(token_id)
        if found is not None:
            return found
        text = self(token_id)
        raw = list(text.encode("utf-8", "replace"))
        if "\ufffd" in text:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and (match := BYTE_FALLBACK.fullmatch(piece)):
                raw = [int(match.group(1), 16)]
            elif isinstance(piece, str) and piece and all(c in BYTE_LEVEL for c in piece):
                raw = [BYTE_LEVEL[c] for c in piece]
        self.byte_cache[token_id] = raw
        return raw


def floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


@dataclass
class Choice:
    """One choice of a whole (non-streamed) response."""

    index: int
    text: str | None  # None: a chat message that holds tool calls only
    finish_reason: str | None
    logprobs: dict | None = None
    tool_calls: list[dict] | None = None  # a chat message's, as OpenAI shapes them
    token_ids: list[int] | None = None  # the choice's tokens, where the request asked for them


@dataclass
class Shape:
    """One response's identity; subclasses say how its text and logprobs are wrapped."""

    model: str
    include_usage: bool = False
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1
    token_text: TokenText | None = None  # needed when logprobs are asked for
    # vLLM's return_token_ids: `prompt_token_ids` on the first chunk (and a whole response), `token_ids`
    # on each choice
    return_token_ids: bool = False
    prompt_token_ids: list[int] | None = None

    prefix = "cmpl"
    object_name = "text_completion"
    chunk_object = "text_completion"

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.prefix}-{uuid.uuid4().hex}"

    def envelope(self, obj: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
        }

    def chunk_envelope(self, choices: list[dict]) -> dict:
        body = self.envelope(self.chunk_object, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, counts: dict) -> dict:
        return {**self.chunk_envelope([]), "usage": counts}

    def first_chunks(self) -> list[dict]:
        return []

    def logprobs(self, index: int, entries: list[tuple[int, TokenLogprob | None]], text: str) -> dict | None:
        """The logprobs of one piece of a choice: (token id, its logprob or None) per token; text is
        the piece's text. None for no tokens."""
        return None

    def chunk(self, text: str, finish_reason: str | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.chunk_envelope([choice])

    def with_token_ids(self, body: dict, choices: list[Choice]) -> dict:
        """A whole response with the token ids, where the request asked for them."""
        if self.return_token_ids:
            body["prompt_token_ids"] = self.prompt_token_ids
            for c, out in zip(choices, body["choices"], strict=True):
                out["token_ids"] = c.token_ids or []
        return body

    def response(self, choices: list[Choice], counts: dict) -> dict:
        body = [
            {"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            for c in choices
        ]
        return self.with_token_ids({**self.envelope(self.object_name, body), "usage": counts}, choices)


@dataclass
class CompletionShape(Shape):
    """Legacy completions: logprobs as parallel lists, top_logprobs holding the chosen token too."""

    offsets: dict[int, int] = field(default_factory=dict)  # per choice: characters reported so far

    def logprobs(self, index: int, entries: list[tuple[int, TokenLogprob | None]], text: str) -> dict | None:
        assert self.token_text is not None
        name = self.token_text
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float] | None] = []
        text_offset: list[int] = []
        offset = self.offsets.get(index, 0)
        for token_id, entry in entries:
            token = name(token_id)
            tokens.append(token)
            text_offset.append(offset)
            offset += len(token)
            if entry is None:  # the prompt's first token: nothing before it to predict it from
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(floor(entry.logprob))
            top = {name(t): floor(lp) for t, lp in entry.top}
            top.setdefault(token, floor(entry.logprob))
            top_logprobs.append(top)
        self.offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


@dataclass
class ChatShape(Shape):
    prefix = "chatcmpl"
    object_name = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def delta(
        self, delta: dict, finish_reason: str | None = None, index: int = 0, logprobs: dict | None = None
    ) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return self.chunk_envelope([choice])

    def first_chunks(self) -> list[dict]:
        return [self.delta({"role": "assistant", "content": ""}, index=i) for i in range(self.n)]

    def logprobs(self, index: int, entries: list[tuple[int, TokenLogprob | None]], text: str) -> dict | None:
        assert self.token_text is not None
        name = self.token_text

        def item(token_id: int, logprob: float) -> dict:
            return {"token": name(token_id), "logprob": floor(logprob), "bytes": name.bytes(token_id)}

        content = [
            {**item(token_id, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top]}
            for token_id, entry in entries
            if entry is not None
        ]
        return {"content": content, "refusal": None}

    def chunk(self, text: str, finish_reason: str | None = None, index: int = 0, logprobs: dict | None = None) -> dict:
        return self.delta({"content": text} if text or logprobs else {}, finish_reason, index, logprobs)

    def response(self, choices: list[Choice], counts: dict) -> dict:
        body = [
            {"index": c.index, "message": message(c), "logprobs": c.logprobs, "finish_reason": c.finish_reason}
            for c in choices
        ]
        return self.with_token_ids({**self.envelope(self.object_name, body), "usage": counts}, choices)


def message(choice: Choice) -> dict:
    body: dict[str, Any] = {"role": "assistant", "content": choice.text, "refusal": None}
    if choice.tool_calls:
        body["tool_calls"] = choice.tool_calls
    return body
