"""The runtime's chat completions under the gateway's translated APIs (Responses, Messages).

A translated request becomes one streamed chat completion on a replica of its service (through the
proxy: replica choice, retries before the first byte, holding at zero); `events` reads the runtime's
server-sent chunks as a flat sequence of what happened (text, a tool call begun, its arguments, the
finish, the usage), which each API renders in its own shape, streamed or whole.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from goodput_gateway.proxy import Upstream

logger = logging.getLogger(__name__)

# A replica lost after the stream began: the translated stream ends with the API's own error event
STREAM_LOST = (aiohttp.ClientError, ConnectionResetError, OSError)


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class ToolStart:
    index: int
    call_id: str
    name: str


@dataclass(frozen=True)
class ToolArgs:
    index: int
    delta: str


@dataclass(frozen=True)
class Finish:
    reason: str  # stop, length, tool_calls


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class Tokens:
    """Output tokens the last chunk carried (from its `token_ids`: only where they were asked for)."""

    count: int


@dataclass(frozen=True)
class Failed:
    """The runtime reported an error in the stream, or the replica went away mid-stream."""

    message: str
    type: str = "server_error"
    code: str | None = None


Event = Text | ToolStart | ToolArgs | Finish | Usage | Tokens | Failed

# opens one streamed chat completion for a translated request: (model, chat body) -> the replica's answer
Opener = Callable[[str, dict[str, Any]], contextlib.AbstractAsyncContextManager[Upstream]]


async def sse_payloads(upstream: Upstream) -> AsyncIterator[str]:
    """The `data:` payloads of a server-sent event stream, `[DONE]` ending it."""
    buffer = b""
    async for chunk in upstream.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            block, buffer = buffer.split(b"\n\n", 1)
            for line in block.decode("utf-8", "replace").splitlines():
                if line.startswith("data:"):
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    yield data


async def events(upstream: Upstream) -> AsyncIterator[Event]:
    """The runtime's chat chunks (one choice) as events. A stream cut short yields `Failed` last."""
    finished = False
    try:
        async for data in sse_payloads(upstream):
            chunk = json.loads(data)
            if "error" in chunk:
                err = chunk["error"] or {}
                yield Failed(
                    str(err.get("message", "The runtime failed")), err.get("type", "server_error"), err.get("code")
                )
                return
            if chunk.get("usage"):
                u = chunk["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                yield Usage(int(u.get("prompt_tokens", 0)), int(u.get("completion_tokens", 0)), int(cached))
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if choice.get("token_ids"):
                    yield Tokens(len(choice["token_ids"]))
                if delta.get("content"):
                    yield Text(delta["content"])
                for call in delta.get("tool_calls") or ():
                    function = call.get("function") or {}
                    if call.get("id") is not None or function.get("name") is not None:
                        yield ToolStart(
                            int(call.get("index", 0)), str(call.get("id") or ""), str(function.get("name") or "")
                        )
                    if function.get("arguments"):
                        yield ToolArgs(int(call.get("index", 0)), function["arguments"])
                if choice.get("finish_reason"):
                    finished = True
                    yield Finish(choice["finish_reason"])
    except STREAM_LOST as err:
        logger.info("A replica's chat stream broke off: %r", err)
    if not finished:
        yield Failed("The replica serving this request went away before it finished", "server_error", "upstream_lost")


@dataclass
class Turn:
    """One answer gathered whole: its text, its tool calls, why it ended and what it cost."""

    text: str = ""
    calls: list[dict[str, str]] = field(default_factory=list)  # {"id", "name", "arguments"}
    finish: str = ""
    usage: Usage = field(default_factory=lambda: Usage(0, 0))
    failed: Failed | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, Text):
            self.text += event.text
        elif isinstance(event, ToolStart):
            self.calls.append({"id": event.call_id, "name": event.name, "arguments": ""})
        elif isinstance(event, ToolArgs) and self.calls:
            self.calls[-1]["arguments"] += event.delta
        elif isinstance(event, Finish):
            self.finish = event.reason
        elif isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, Failed):
            self.failed = event


async def gather(upstream: Upstream) -> Turn:
    turn = Turn()
    async for event in events(upstream):
        turn.add(event)
    return turn


def caller_authorization(headers: Mapping[str, str]) -> str | None:
    """The caller's key as an Authorization header: its own, or Anthropic's `x-api-key` as a bearer token."""
    if authorization := headers.get("Authorization"):
        return authorization
    key = headers.get("x-api-key")
    return f"Bearer {key}" if key else None


def owner_of(headers: Mapping[str, str]) -> str:
    """Whom stored objects belong to: a digest of the caller's key ("" for a caller that sent none)."""
    authorization = caller_authorization(headers)
    if not authorization:
        return ""
    return hashlib.sha256(authorization.strip().encode()).hexdigest()[:32]


async def error_body(upstream: Upstream) -> dict[str, Any]:
    """A replica's error answer ({"error": {...}}), whatever it sent."""
    raw = await upstream.read()
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return dict(body["error"])
    return {"message": raw.decode("utf-8", "replace")[:500] or f"HTTP {upstream.status}", "type": "server_error"}


Writer = Callable[[bytes], Awaitable[None]]
