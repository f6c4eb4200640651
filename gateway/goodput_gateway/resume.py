"""Streams that survive their replica: a streamed completion or chat completion whose replica goes away
after the client got its first byte continues on another ready replica.

The gateway asks the runtime for token ids on every stream it may resume (`return_token_ids`, vLLM's
field, stripped from what the client sees unless it asked for it), and keeps the prompt's ids and the
ids produced so far. When the replica's connection breaks mid-stream, it sends the rest to another
replica as a `/v1/completions` request whose prompt is those ids (nothing is re-tokenized), with
`max_tokens` and `min_tokens` less what was produced and the same sampling fields, and turns that
stream's chunks into the original's shape: the same id, created time and model, chat deltas for a chat
stream, usage counting the whole answer. The client sees one stream.

Greedy requests continue token for token as an unbroken run would. A seeded sampled request continues
from the same tokens, deterministically for a given break point, but not with the tokens the unbroken run
would have drawn (the rest is sampled from the seed afresh). Streams that carry state the runtime cannot
take up from token ids are not resumed and end with the `upstream_lost` error event as before: `n` > 1,
tools, structured output, logprobs, presence and frequency penalties, and fields the gateway does not know.

Stop strings are resumed where the replica reports each token's id only once its text has been sent (its
response says `x-goodput-token-ids: shown`): text held back while it may begin a stop string belongs to
tokens the gateway has not been told of, so the next replica generates them again and sends their text.
The stop strings go with the rest, and none can straddle the break: one beginning in the text sent ends
within the text the first replica had, which it searched. A replica that does not say so (an older
runtime) leaves such a stream unresumed, as before.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

from goodput_gateway.errors import APIError

logger = logging.getLogger(__name__)

PATHS = {"/v1/completions": False, "/v1/chat/completions": True}  # path -> whether it is a chat stream
# request fields a resumed stream keeps as they came
SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "repetition_penalty",
    "priority",
    "user",
    "stop",  # resumed only from a replica that reports ids once their text is sent (IDS_SHOWN)
)
# fields allowed only at the value that makes them do nothing
HARMLESS: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False, True),  # the prompt went with the first chunk; the rest carries none
    "suffix": (None, ""),
}
HOLDS_NOTHING: tuple[Any, ...] = (None, "", [])
OTHER = frozenset(
    {
        "model",
        "messages",
        "prompt",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "min_tokens",
    }
)
MAX_RESUMES = 2
IDS_SHOWN = ("x-goodput-token-ids", "shown")  # the runtime's header: each token's id comes with its text


def ids_shown(headers: Mapping[str, str]) -> bool:
    return headers.get(IDS_SHOWN[0]) == IDS_SHOWN[1]


def resumable(path: str, body: Mapping[str, Any]) -> bool:
    """Whether a request's stream can be taken up on another replica from its token ids."""
    if path not in PATHS or body.get("stream") is not True:
        return False
    return why_not(body) is None


def why_not(body: Mapping[str, Any]) -> str | None:
    """The field that keeps a stream from being taken up elsewhere (the lost stream's error names it); None
    where none does."""
    if not isinstance(body.get("return_token_ids", False), bool):  # the runtime refuses it, by name
        return "return_token_ids"
    for name, value in body.items():
        if name == "return_token_ids":
            continue
        if name in SAMPLING or name in OTHER:
            continue
        if name not in HARMLESS or value not in HARMLESS[name]:
            return name
    return None


def with_token_ids(raw: bytes) -> bytes:
    """The body sent upstream for a stream the gateway may resume: token ids asked for."""
    body = json.loads(raw)
    if body.get("return_token_ids") is True:
        return raw
    return json.dumps({**body, "return_token_ids": True}).encode()


def event(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


Reopen = Callable[[bytes, set[str]], contextlib.AbstractAsyncContextManager[Any]]


class Resumption:
    """One resumable stream's state and its translation; `run` yields the client's events."""

    def __init__(
        self,
        path: str,
        body: Mapping[str, Any],
        served_model: str,
        reopen: Reopen,
        lost: tuple[type[BaseException], ...],
        on_resume: Callable[[float], None] | None = None,
    ) -> None:
        self.chat = PATHS[path]
        self.body, self.served_model, self.reopen, self.lost = body, served_model, reopen, lost
        self.on_resume = on_resume
        self.client_ids = body.get("return_token_ids") is True
        self.include_usage = isinstance(body.get("stream_options"), dict) and bool(
            body["stream_options"].get("include_usage")
        )
        self.prompt: list[int] | None = None
        self.produced: list[int] = []
        # produced tokens whose text the client has: those after it are held back by the runtime (a
        # character's first bytes), and are generated again on a resume rather than sent as prompt
        self.shown = 0
        self.repeated = 0  # ids of tokens generated again that the client already got (when it asked)
        self.template: dict[str, Any] = {}
        self.finished = False  # the choice's finish_reason was sent
        self.usage_sent = False
        self.done = False  # [DONE] was sent
        # the replica reports a token's id only once its text is sent (IDS_SHOWN): every id is shown
        self.ids_shown = False
        self.stops = body.get("stop") not in HOLDS_NOTHING  # text may be held back for a stop string

    async def run(self, first: AsyncIterator[bytes], replica: str) -> AsyncGenerator[bytes, None]:
        """The client's stream: the first replica's events, then, after a loss, another's translated.
        Raises the loss where the stream cannot be resumed."""
        try:
            async for data in self.events(first, original=True):
                yield data
            return
        except self.lost as err:
            loss: BaseException = err
        dead = {replica}
        for _ in range(MAX_RESUMES):
            lost_at = time.monotonic()
            if self.prompt is None or (self.stops and not self.ids_shown):
                raise loss
            self.repeated = len(self.produced) - self.shown
            del self.produced[self.shown :]
            if self.finished or self.budget() <= 0:  # nothing left to generate: the stream's end, made here
                for data in self.ending():
                    yield data
                return
            logger.info("Resuming a stream after %d tokens: %r", len(self.produced), loss)
            try:
                async with self.reopen(json.dumps(self.rest()).encode(), dead) as upstream:
                    if upstream.status != 200:
                        raise loss
                    self.ids_shown = ids_shown(upstream.headers)
                    if self.on_resume is not None:
                        self.on_resume(time.monotonic() - lost_at)
                    try:
                        async for data in self.events(upstream.iter_any(), original=False):
                            yield data
                        return
                    except self.lost as err:
                        loss = err
                        dead.add(upstream.replica)
            except APIError:  # no other replica answered
                raise loss from None
        raise loss

    def budget(self) -> int:
        limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        return limit - len(self.produced) if isinstance(limit, int) else 1

    def rest(self) -> dict[str, Any]:
        assert self.prompt is not None
        body: dict[str, Any] = {
            "model": self.served_model,
            "prompt": self.prompt + self.produced,
            "stream": True,
            "return_token_ids": True,
        }
        body.update({k: self.body[k] for k in SAMPLING if k in self.body})
        limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        if isinstance(limit, int):
            body["max_tokens"] = limit - len(self.produced)
        min_tokens = self.body.get("min_tokens")
        if isinstance(min_tokens, int) and min_tokens > len(self.produced):
            body["min_tokens"] = min_tokens - len(self.produced)
        if self.include_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    def usage(self) -> dict[str, Any]:
        prompt = len(self.prompt or ())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": len(self.produced),
            "total_tokens": prompt + len(self.produced),
        }

    def ending(self) -> list[bytes]:
        """What the stream still owes when the loss came after its last token."""
        out = []
        if not self.finished:
            out.append(event(self.envelope([self.choice("", "length", [])])))
        if self.include_usage and not self.usage_sent:
            out.append(event({**self.envelope([]), "usage": self.usage()}))
        out.append(event("[DONE]"))
        return out

    def envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = {**self.template, "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return body

    def choice(self, text: str, finish_reason: str | None, ids: list[int]) -> dict[str, Any]:
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "delta": {"content": text} if text else {},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.client_ids:
            choice["token_ids"] = ids
        return choice

    async def events(self, chunks: AsyncIterator[bytes], original: bool) -> AsyncIterator[bytes]:
        """Whole events, recorded and (after a resume) translated; a loss mid-event drops its start."""
        pending = b""
        async for chunk in chunks:
            pending += chunk
            cut = pending.rfind(b"\n\n")
            if cut < 0:
                continue
            whole, pending = pending[: cut + 2], pending[cut + 2 :]
            out = b"".join(self.translate(e + b"\n\n", original) for e in whole.split(b"\n\n") if e.strip())
            if out:
                yield out
        if pending.strip():
            yield self.translate(pending, original)

    def translate(self, raw: bytes, original: bool) -> bytes:
        if not raw.startswith(b"data:"):
            return raw
        data = raw[5:].strip()
        if data == b"[DONE]":
            self.done = True
            return raw
        try:
            chunk = json.loads(data)
        except ValueError:
            return raw
        if not isinstance(chunk, dict) or "error" in chunk:
            return raw
        if original:
            return self.record(chunk, raw)
        return self.resumed(chunk)

    def record(self, chunk: dict[str, Any], raw: bytes) -> bytes:
        """An event of the first replica: its ids kept, and stripped unless the client asked for them."""
        changed = False
        if "prompt_token_ids" in chunk:
            self.prompt = chunk["prompt_token_ids"] if self.client_ids else chunk.pop("prompt_token_ids")
            changed = not self.client_ids
        if not self.template and "id" in chunk:
            keys = ("id", "object", "created", "model", "system_fingerprint")
            self.template = {k: chunk[k] for k in keys if k in chunk}
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") if self.client_ids else choice.pop("token_ids", None)
            changed = changed or not self.client_ids
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            self.took(ids or [], text or "", choice.get("finish_reason"))
        if chunk.get("usage"):
            self.usage_sent = True
        return event(chunk) if changed else raw

    def took(self, ids: list[int], text: str, finish_reason: str | None) -> None:
        """A choice's chunk: tokens produced, and whether their text came with them."""
        self.produced.extend(ids)
        if text or finish_reason is not None or self.ids_shown:
            self.shown = len(self.produced)
        if finish_reason is not None:
            self.finished = True

    def resumed(self, chunk: dict[str, Any]) -> bytes:
        """An event of the replica that took over, in the original stream's shape."""
        choices = []
        for choice in chunk.get("choices") or ():
            ids = choice.get("token_ids") or []
            self.took(ids, choice.get("text") or "", choice.get("finish_reason"))
            skip = min(self.repeated, len(ids))
            ids, self.repeated = ids[skip:], self.repeated - skip
            choices.append(self.choice(choice.get("text") or "", choice.get("finish_reason"), ids))
        body = self.envelope(choices)
        if chunk.get("usage"):
            body["usage"] = self.usage()
            self.usage_sent = True
        return event(body)
