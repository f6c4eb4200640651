"""A Responses API request as a chat completion's parts: its fields checked (the unsupported refused with a
400 naming them), its `input` items as chat messages, its function tools, tool choice and text format."""

from __future__ import annotations

import json
from typing import Any

from goodput_gateway.errors import APIError, invalid

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
