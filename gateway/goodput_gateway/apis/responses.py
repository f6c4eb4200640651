"""OpenAI's Responses API (`POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`) on the runtime's chat
completions.

A request becomes one chat completion: `instructions` the system message, `input` (a string, or message,
`function_call` and `function_call_output` items) the conversation, function `tools` and `tool_choice`
the runtime's tool calls, `text.format` its structured output (`response_format`),
`max_output_tokens` its `max_tokens`. The answer comes back as a response object with `message` and
`function_call` output items, whole or streamed as the Responses events. With `store` (the default, as
OpenAI's) the response and its conversation are kept per caller (store.py), so `previous_response_id`
continues it. Every other field, and every tool other than a function (web_search, file_search, ...),
is refused with a 400 naming it.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from goodput_gateway.apis import chat
from goodput_gateway.apis.store import ResponseStore
from goodput_gateway.errors import APIError, invalid
from goodput_gateway.proxy import parse_body

# fields refused unless they hold the value that asks for nothing (None always passes)
HARMLESS: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled",),
    "background": (False,),
    "service_tier": ("auto", "default"),
    "include": ([],),
    "stream_options": ({}, {"include_obfuscation": False}),
    "parallel_tool_calls": (True, False),
}
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "tools",
        "tool_choice",
        "text",
        "stream",
        "store",
        "previous_response_id",
        "metadata",
        *HARMLESS,
    }
)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")

ChatOpener = Callable[[web.Request, str, dict[str, Any]], Any]  # an async context manager of an Upstream


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


def unsupported(name: str, why: str = "") -> APIError:
    return invalid(f"'{name}' is not supported by this gateway's Responses API{why}", name, "unsupported_parameter")


def wrong_type(name: str, what: str) -> APIError:
    return invalid(f"'{name}' must be {what}", name, "invalid_type")


def parts_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(where, "a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(
                f"'{where}[{j}]' must be a text part (input_text or output_text), got {kind!r}",
                f"{where}[{j}].type",
                "unsupported_value",
            )
        texts.append(part["text"])
    return "".join(texts)


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: message items by role, calls on the assistant turn, outputs as tool turns."""
    if value is None:
        raise invalid("'input' is a required property", "input", "missing_required_parameter")
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise wrong_type("input", "a string or a list of input items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(where, "an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise invalid(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
            messages.append({"role": role, "content": parts_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise wrong_type(f"{where}.{name}", "a string")
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise wrong_type(f"{where}.call_id", "a string")
            output = parts_text(item.get("output"), f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        else:
            raise invalid(
                f"Input items of type {kind!r} are not supported by this gateway: send message, function_call "
                "and function_call_output items",
                f"{where}.type",
                "unsupported_value",
            )
    return messages


def chat_tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise wrong_type("tools", "a list of tools")
    tools = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(where, "an object")
        if tool.get("type") != "function":
            raise invalid(
                f"The built-in tool {tool.get('type')!r} is not supported by this gateway: only function tools",
                f"{where}.type",
                "unsupported_value",
            )
        function: dict[str, Any] = {"name": tool.get("name")}
        for name in ("description", "parameters"):
            if tool.get(name) is not None:
                function[name] = tool[name]
        # `strict` needs nothing more: a forced call's arguments always follow the schema (a grammar)
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise wrong_type(f"{where}.strict", "a boolean")
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(value: Any) -> Any:
    if isinstance(value, str) and value in ("auto", "none", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid(
        '\'tool_choice\' must be auto, none, required or {"type": "function", "name": ...}: hosted and '
        "allowed-tools choices are not supported by this gateway",
        "tool_choice",
        "unsupported_value",
    )


def response_format(text: Any) -> dict[str, Any] | None:
    if not isinstance(text, dict):
        raise wrong_type("text", "an object")
    for name in text:
        if name not in ("format", "verbosity") or (name == "verbosity" and text[name] is not None):
            raise unsupported(f"text.{name}")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise wrong_type("text.format", "an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
        return {"type": "json_schema", "json_schema": spec}
    raise invalid("'text.format.type' must be text, json_object or json_schema", "text.format.type")


def check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        if name not in FIELDS:
            raise unsupported(name)
        if name in HARMLESS and value is not None and value not in HARMLESS[name]:
            raise unsupported(name, f" with the value {json.dumps(value)[:60]}")


def usage_object(usage: chat.Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class Exchange:
    """One request: its chat body, and the response object as it forms."""

    def __init__(self, body: dict[str, Any], history: list[dict[str, Any]]) -> None:
        check_fields(body)
        self.body = body
        self.model: str = body["model"]
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise wrong_type("instructions", "a string")
        self.conversation = history + input_messages(body.get("input"))
        messages = ([{"role": "system", "content": instructions}] if instructions else []) + self.conversation
        self.chat: dict[str, Any] = {"messages": messages, "stream": True, "stream_options": {"include_usage": True}}
        if body.get("max_output_tokens") is not None:
            self.chat["max_tokens"] = body["max_output_tokens"]
        for name in ("temperature", "top_p", "parallel_tool_calls"):
            if body.get(name) is not None:
                self.chat[name] = body[name]
        if body.get("tools") is not None:
            self.chat["tools"] = chat_tools(body["tools"])
        if body.get("tool_choice") is not None:
            self.chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
        fmt = response_format(body["text"]) if body.get("text") is not None else None
        # the format shapes message text: an answer forced to a call has none, so it applies to the next
        # turn's answer, not this one (the runtime's chat refuses the two together)
        if fmt is not None and self.chat.get("tool_choice", "auto") in ("auto", "none"):
            self.chat["response_format"] = fmt
        metadata = body.get("metadata")
        if metadata is not None and not (
            isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values()) and len(metadata) <= 16
        ):
            raise wrong_type("metadata", "an object of up to 16 string values")
        self.store = body.get("store") is not False
        if not isinstance(body.get("store", True), bool):
            raise wrong_type("store", "a boolean")
        self.id = new_id("resp_")
        self.created = int(time.time())

    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: chat.Usage | None = None,
        error: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        b = self.body
        text = b.get("text") if isinstance(b.get("text"), dict) else {}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True),
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
            "store": self.store,
            "temperature": b.get("temperature", 1.0),
            "text": {"format": (text or {}).get("format") or {"type": "text"}},
            "tool_choice": b.get("tool_choice", "auto"),
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": None if usage is None else usage_object(usage),
            "user": None,
        }

    def finished(self, turn: chat.Turn, output: list[dict[str, Any]]) -> dict[str, Any]:
        if turn.failed is not None:
            error = {"code": "server_error", "message": turn.failed.message}
            return self.response("failed", output, turn.usage, error)
        return self.response("incomplete" if turn.finish == "length" else "completed", output, turn.usage)

    def stored_conversation(self, turn: chat.Turn) -> list[dict[str, Any]]:
        reply: dict[str, Any] = {"role": "assistant", "content": turn.text}
        if turn.calls:
            reply["tool_calls"] = [
                {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in turn.calls
            ]
        return [*self.conversation, reply]


def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = (
        [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" else []
    )
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call: dict[str, str], status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call["id"],
        "name": call["name"],
        "arguments": call["arguments"] if status == "completed" else "",
        "status": status,
    }


def output_items(turn: chat.Turn) -> list[dict[str, Any]]:
    items = []
    if turn.text or not turn.calls:
        items.append(message_item(new_id("msg_"), turn.text))
    items.extend(call_item(new_id("fc_"), c) for c in turn.calls)
    return items


class EventStream:
    """The Responses events of one streamed answer, each numbered."""

    def __init__(self, response: web.StreamResponse, exchange: Exchange) -> None:
        self.out, self.exchange, self.seq = response, exchange, 0
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written
        self.text = ""

    async def send(self, kind: str, **payload: Any) -> None:
        data = json.dumps({"type": kind, "sequence_number": self.seq, **payload}, separators=(",", ":"))
        self.seq += 1
        await self.out.write(f"event: {kind}\ndata: {data}\n\n".encode())

    async def begin(self) -> None:
        started = self.exchange.response("in_progress", [])
        await self.send("response.created", response=started)
        await self.send("response.in_progress", response=started)

    async def text_delta(self, delta: str) -> None:
        if self.open is None or self.open["type"] != "message":
            await self.close()
            self.open = message_item(new_id("msg_"), "", "in_progress")
            self.text = ""
            await self.send("response.output_item.added", output_index=len(self.items), item=self.open)
            await self.send(
                "response.content_part.added",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
            )
        self.text += delta
        await self.send(
            "response.output_text.delta",
            item_id=self.open["id"],
            output_index=len(self.items),
            content_index=0,
            delta=delta,
            logprobs=[],
        )

    async def call_start(self, event: chat.ToolStart) -> None:
        await self.close()
        self.open = call_item(new_id("fc_"), {"id": event.call_id, "name": event.name, "arguments": ""}, "in_progress")
        await self.send("response.output_item.added", output_index=len(self.items), item=self.open)

    async def call_args(self, delta: str) -> None:
        if self.open is None or self.open["type"] != "function_call":
            return
        self.open["arguments"] += delta
        await self.send(
            "response.function_call_arguments.delta", item_id=self.open["id"], output_index=len(self.items), delta=delta
        )

    async def close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        index = len(self.items)
        if item["type"] == "message":
            done = message_item(item["id"], self.text)
            part = done["content"][0]
            await self.send(
                "response.output_text.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                text=self.text,
                logprobs=[],
            )
            await self.send(
                "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
            )
        else:
            done = {**item, "status": "completed"}
            await self.send(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            )
        self.items.append(done)
        await self.send("response.output_item.done", output_index=index, item=done)

    async def run(self, upstream: Any, keep: Callable[[chat.Turn, dict[str, Any]], Any]) -> chat.Turn:
        """The events of the whole answer; `keep` stores it before the last event tells the client it is done."""
        turn = chat.Turn()
        await self.begin()
        async for event in chat.events(upstream):
            turn.add(event)
            if isinstance(event, chat.Text):
                await self.text_delta(event.text)
            elif isinstance(event, chat.ToolStart):
                await self.call_start(event)
            elif isinstance(event, chat.ToolArgs):
                await self.call_args(event.delta)
        if turn.failed is None and not self.items and self.open is None and not turn.calls:
            await self.text_delta("")  # an empty answer still has its message item
        await self.close()
        final = self.exchange.finished(turn, self.items)
        await keep(turn, final)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            final["status"], "response.failed"
        )
        await self.send(kind, response=final)
        return turn


class ResponsesAPI:
    def __init__(
        self, open_chat: ChatOpener, store: ResponseStore, owner: Callable[[web.Request], Awaitable[str]]
    ) -> None:
        self.open_chat, self.store, self.owner = open_chat, store, owner

    async def history(self, owner: str, body: dict[str, Any]) -> list[dict[str, Any]]:
        previous = body.get("previous_response_id")
        if previous is None:
            return []
        if not isinstance(previous, str):
            raise wrong_type("previous_response_id", "a string")
        found = await self.store.get(owner, previous)
        if found is None:
            raise APIError(
                404,
                f"Previous response with id '{previous}' not found.",
                "invalid_request_error",
                "previous_response_id",
                "previous_response_not_found",
            )
        return found[1]

    async def create(self, request: web.Request) -> web.StreamResponse:
        body = parse_body(await request.read())
        owner = await self.owner(request)
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise wrong_type("stream", "a boolean")
        if not isinstance(body.get("model"), str):
            raise invalid("'model' is a required property and must be a string", "model", "missing_required_parameter")
        exchange = Exchange(body, await self.history(owner, body))

        async def keep(turn: chat.Turn, final: dict[str, Any]) -> None:
            if exchange.store and turn.failed is None:
                await self.store.put(owner, final, exchange.stored_conversation(turn))

        async with self.open_chat(request, exchange.model, exchange.chat) as upstream:
            if upstream.status != 200:
                err = await chat.error_body(upstream)
                raise APIError(
                    upstream.status,
                    str(err.get("message")),
                    err.get("type", "invalid_request_error"),
                    err.get("param"),
                    err.get("code"),
                )
            if stream:
                out = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
                await out.prepare(request)
                await EventStream(out, exchange).run(upstream, keep)
                await out.write_eof()
                return out
            turn = await chat.gather(upstream)
        final = exchange.finished(turn, output_items(turn))
        await keep(turn, final)
        if turn.failed is not None:
            raise APIError(502, turn.failed.message, "server_error", None, turn.failed.code)
        return web.json_response(final)

    async def retrieve(self, request: web.Request) -> web.Response:
        found = await self.store.get(await self.owner(request), request.match_info["id"])
        if found is None:
            raise not_found(request.match_info["id"])
        return web.json_response(found[0])

    async def delete(self, request: web.Request) -> web.Response:
        response_id = request.match_info["id"]
        if not await self.store.delete(await self.owner(request), response_id):
            raise not_found(response_id)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})


def not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", None, "not_found")
