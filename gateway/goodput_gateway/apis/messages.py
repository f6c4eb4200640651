"""Anthropic's Messages API (`POST /v1/messages`) on the runtime's chat completions.

`system` becomes the system message; `messages` the conversation (text blocks, the assistant's `tool_use`
blocks as its tool calls, the user's `tool_result` blocks as tool turns); `tools` and `tool_choice` the
runtime's tool calls; `max_tokens` (required), `temperature`, `top_p` and `top_k` its sampling. The
answer comes back as a message with `text` and `tool_use` blocks, whole or streamed as Anthropic's
events, and errors in Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``).

`stop_sequences` are matched here, on the text as it comes (a sequence split across chunks included),
so the answer can name the one that ended it: the matched text is cut, the replica's stream closed (the
runtime aborts the request), and its usage counted from the tokens received (their logprobs) and the
prompt's tokens (the runtime's `/tokenize`, which counts the conversation without the tool definitions).
Every other field is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiohttp import web

from goodput_gateway.apis import chat
from goodput_gateway.errors import APIError
from goodput_gateway.proxy import parse_body

FIELDS = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "stop_sequences",
        "stream",
        "temperature",
        "top_p",
        "top_k",
        "tools",
        "tool_choice",
        "service_tier",
        "thinking",
    }
)
HARMLESS: dict[str, tuple[Any, ...]] = {"service_tier": ("auto", "standard_only"), "thinking": ({"type": "disabled"},)}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}

ChatOpener = Callable[..., Any]  # (request, model, body[, path]) -> an async context manager of an Upstream


class MessagesError(Exception):
    def __init__(
        self, status: int, message: str, retry_after: int | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after, self.headers = status, message, retry_after, headers or {}

    def response(self) -> web.Response:
        kind = ERROR_TYPES.get(self.status, "api_error")
        body = {"type": "error", "error": {"type": kind, "message": self.message}}
        headers = {**self.headers, **({"Retry-After": str(self.retry_after)} if self.retry_after is not None else {})}
        return web.json_response(body, status=self.status, headers=headers)


def bad(message: str) -> MessagesError:
    return MessagesError(400, message)


def block_text(content: Any, where: str) -> str:
    """A string, or text blocks' text (a tool result's content, the system prompt)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}: expected a string or a list of text blocks")
    texts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad(f"{where}.{j}.type: only text blocks are supported here, got {kind!r}")
        check_cache_control(block, f"{where}.{j}")
        texts.append(block["text"])
    return "".join(texts)


def check_cache_control(block: dict[str, Any], where: str) -> None:
    """Prompt caching needs no marker here (the runtime caches every prompt's prefix); one is accepted in
    its one form."""
    value = block.get("cache_control")
    if value is not None and (not isinstance(value, dict) or value.get("type") != "ephemeral"):
        raise bad(f"{where}.cache_control: only {{'type': 'ephemeral'}} is supported")


def chat_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise bad("messages: Field required (a non-empty list of messages)")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(value):
        where = f"messages.{i}"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise bad(f"{where}.role: must be 'user' or 'assistant'")
        role, content = message["role"], message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad(f"{where}.content: expected a string or a list of content blocks")
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in ("text", "tool_use", "tool_result") or (
                (kind == "tool_use" and role != "assistant") or (kind == "tool_result" and role != "user")
            ):
                raise bad(f"{at}.type: {kind!r} blocks are not supported in a {role} message by this gateway")
            assert isinstance(block, dict)
            check_cache_control(block, at)
            if kind == "text":
                if not isinstance(block.get("text"), str):
                    raise bad(f"{at}.text: Field required")
                texts.append(block["text"])
            elif kind == "tool_use":
                if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                    raise bad(f"{at}: a tool_use block needs 'id' and 'name'")
                arguments = json.dumps(block.get("input") or {})
                calls.append(
                    {"id": block["id"], "type": "function", "function": {"name": block["name"], "arguments": arguments}}
                )
            else:
                if not isinstance(block.get("tool_use_id"), str):
                    raise bad(f"{at}.tool_use_id: Field required")
                result = block_text(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    result = f"Error: {result}"
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        if role == "assistant":
            reply: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
            if calls:
                reply["tool_calls"] = calls
            out.append(reply)
        elif texts:
            out.append({"role": "user", "content": "".join(texts)})
    return out


def chat_tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise bad("tools: expected a list of tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict):
            raise bad(f"tools.{i}: expected an object")
        if tool.get("type") not in (None, "custom"):
            raise bad(f"tools.{i}.type: the server tool {tool.get('type')!r} is not supported by this gateway")
        if not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            raise bad(f"tools.{i}: a tool needs 'name' and 'input_schema'")
        check_cache_control(tool, f"tools.{i}")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if isinstance(tool.get("description"), str):
            function["description"] = tool["description"]
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(value: Any, body: dict[str, Any]) -> None:
    if not isinstance(value, dict):
        raise bad("tool_choice: expected an object")
    kind = value.get("type")
    if kind == "auto":
        body["tool_choice"] = "auto"
    elif kind == "any":
        body["tool_choice"] = "required"
    elif kind == "none":
        body["tool_choice"] = "none"
    elif kind == "tool" and isinstance(value.get("name"), str):
        body["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    else:
        raise bad("tool_choice.type: must be auto, any, tool (with name) or none")
    if value.get("disable_parallel_tool_use") is not None:
        body["parallel_tool_calls"] = not value["disable_parallel_tool_use"]


def translate(body: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The chat completion's body, and the stop sequences the gateway matches."""
    for name, value in body.items():
        if name not in FIELDS:
            raise bad(f"{name}: Extra inputs are not permitted (not supported by this gateway)")
        if name in HARMLESS and value is not None and value not in HARMLESS[name]:
            raise bad(f"{name}: {json.dumps(value)[:60]} is not supported by this gateway")
    if not isinstance(body.get("model"), str):
        raise bad("model: Field required")
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise bad("max_tokens: Field required (an integer of at least 1)")
    messages = chat_messages(body.get("messages"))
    if body.get("system") is not None:
        messages.insert(0, {"role": "system", "content": block_text(body["system"], "system")})
    stops = body.get("stop_sequences") or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop_sequences: expected a list of non-empty strings")
    out: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if stops:
        out["logprobs"] = True  # each chunk names its tokens: the usage of an answer cut here
    for name in ("temperature", "top_p", "top_k"):
        if body.get(name) is not None:
            out[name] = body[name]
    if body.get("tools") is not None:
        out["tools"] = chat_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat_tool_choice(body["tool_choice"], out)
    if body.get("stream") is not None and not isinstance(body["stream"], bool):
        raise bad("stream: expected a boolean")
    return out, tuple(stops)


class Stopped:
    def __init__(self, sequence: str) -> None:
        self.sequence = sequence


async def with_stops(events: AsyncIterator[chat.Event], stops: tuple[str, ...]) -> AsyncIterator[chat.Event | Stopped]:
    """The events with the stop sequences applied to the text: text that could still begin one is held back
    until it cannot; a match ends the events with `Stopped` (the text before it passed on)."""
    if not stops:
        async for event in events:
            yield event
        return
    hold = max(len(s) for s in stops) - 1
    pending = ""
    async for event in events:
        if not isinstance(event, chat.Text):
            if pending and isinstance(event, (chat.ToolStart, chat.Finish, chat.Failed)):
                yield chat.Text(pending)
                pending = ""
            yield event
            continue
        pending += event.text
        found = [(at, s) for s in stops if (at := pending.find(s)) != -1]
        if found:
            at, sequence = min(found)
            if at:
                yield chat.Text(pending[:at])
            yield Stopped(sequence)
            return
        if len(pending) > hold:
            yield chat.Text(pending[: len(pending) - hold])
            pending = pending[len(pending) - hold :]
    if pending:
        yield chat.Text(pending)


class Answer:
    """What one answer gathered: content blocks, the stop, the usage."""

    def __init__(self) -> None:
        self.blocks: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = chat.Usage(0, 0)
        self.tokens = 0
        self.failed: chat.Failed | None = None

    def add(self, event: chat.Event | Stopped) -> None:
        if isinstance(event, chat.Text):
            if not self.blocks or self.blocks[-1]["type"] != "text":
                self.blocks.append({"type": "text", "text": ""})
            self.blocks[-1]["text"] += event.text
        elif isinstance(event, chat.ToolStart):
            self.blocks.append({"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}, "json": ""})
        elif isinstance(event, chat.ToolArgs) and self.blocks and self.blocks[-1]["type"] == "tool_use":
            self.blocks[-1]["json"] += event.delta
        elif isinstance(event, chat.Finish):
            self.stop_reason = STOP_REASONS.get(event.reason, "end_turn")
        elif isinstance(event, chat.Usage):
            self.usage = event
        elif isinstance(event, chat.Tokens):
            self.tokens += event.count
        elif isinstance(event, chat.Failed):
            self.failed = event
        elif isinstance(event, Stopped):
            self.stop_reason, self.stop_sequence = "stop_sequence", event.sequence

    def content(self) -> list[dict[str, Any]]:
        out = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                try:
                    arguments = json.loads(block["json"] or "{}")
                except ValueError:
                    arguments = {}
                block = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": arguments}
            out.append(block)
        return out

    def usage_object(self) -> dict[str, int]:
        return {
            "input_tokens": self.usage.prompt_tokens,
            "output_tokens": self.usage.completion_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": self.usage.cached_tokens,
        }


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload}, separators=(',', ':'))}\n\n".encode()


class MessagesAPI:
    def __init__(self, open_chat: ChatOpener) -> None:
        self.open_chat = open_chat

    async def create(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._create(request)
        except APIError as err:  # the gateway's own errors (routing, keys, holding)
            return MessagesError(err.status, err.message, err.retry_after, err.headers).response()
        except MessagesError as err:
            return err.response()

    async def _create(self, request: web.Request) -> web.StreamResponse:
        try:
            body = parse_body(await request.read())
        except APIError as err:
            raise bad(err.message) from None
        chat_body, stops = translate(body)
        model = body["model"]
        message_id = f"msg_{secrets.token_hex(12)}"
        answer = Answer()
        out: web.StreamResponse | None = None
        async with self.open_chat(request, model, chat_body) as upstream:
            if upstream.status != 200:
                failure = await chat.error_body(upstream)
                raise MessagesError(upstream.status, str(failure.get("message")))
            events = with_stops(chat.events(upstream), stops)
            if body.get("stream"):
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await out.prepare(request)
                start = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": []}
                start |= {"stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 0, "output_tokens": 0}}
                await out.write(sse("message_start", {"message": start}))
                await self.stream(out, events, answer)
            else:
                async for event in events:
                    answer.add(event)
        if answer.stop_sequence is not None:  # cut here: the runtime never sent its usage
            answer.usage = chat.Usage(await self.prompt_tokens(request, model, chat_body), answer.tokens)
        if out is not None:
            if answer.failed is not None:
                error = {"type": "api_error", "message": answer.failed.message}
                await out.write(sse("error", {"error": error}))
            else:
                delta = {"stop_reason": answer.stop_reason, "stop_sequence": answer.stop_sequence}
                await out.write(sse("message_delta", {"delta": delta, "usage": answer.usage_object()}))
                await out.write(sse("message_stop", {}))
            await out.write_eof()
            return out
        if answer.failed is not None:
            raise MessagesError(500, answer.failed.message)
        return web.json_response(
            {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": answer.content(),
                "stop_reason": answer.stop_reason,
                "stop_sequence": answer.stop_sequence,
                "usage": answer.usage_object(),
            }
        )

    async def stream(
        self, out: web.StreamResponse, events: AsyncIterator[chat.Event | Stopped], answer: Answer
    ) -> None:
        index = -1
        open_kind: str | None = None

        async def close() -> None:
            nonlocal open_kind
            if open_kind is not None:
                await out.write(sse("content_block_stop", {"index": index}))
                open_kind = None

        async for event in events:
            answer.add(event)
            if isinstance(event, chat.Text):
                if open_kind != "text":
                    await close()
                    index, open_kind = index + 1, "text"
                    await out.write(
                        sse("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                    )
                await out.write(
                    sse("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": event.text}})
                )
            elif isinstance(event, chat.ToolStart):
                await close()
                index, open_kind = index + 1, "tool_use"
                block = {"type": "tool_use", "id": event.call_id, "name": event.name, "input": {}}
                await out.write(sse("content_block_start", {"index": index, "content_block": block}))
            elif isinstance(event, chat.ToolArgs) and open_kind == "tool_use":
                delta = {"type": "input_json_delta", "partial_json": event.delta}
                await out.write(sse("content_block_delta", {"index": index, "delta": delta}))
        await close()

    async def prompt_tokens(self, request: web.Request, model: str, chat_body: dict[str, Any]) -> int:
        async with self.open_chat(request, model, {"messages": chat_body["messages"]}, "/tokenize") as upstream:
            if upstream.status != 200:
                return 0
            return int(json.loads(await upstream.read()).get("count", 0))
