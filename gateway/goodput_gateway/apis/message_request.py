"""A Messages API request as a chat completion's body: its fields checked, `system` and `messages` (text,
`tool_use` and `tool_result` blocks) as chat messages, its tools and tool choice; and errors in Anthropic's
shape (``{"type": "error", "error": {"type", "message"}}``)."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

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
    if stops:  # each chunk names its tokens: the usage of an answer cut here (and a stream may be resumed)
        out["return_token_ids"] = True
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
