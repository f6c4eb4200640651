"""A chat request's messages: roles, content and the assistant's earlier tool calls, each checked."""

from __future__ import annotations

import json
from typing import Any

from goodput_runtime.server.errors import invalid, missing, wrong_type
from goodput_runtime.server.fields import shown

ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        raise missing("messages")
    if not isinstance(value, list):
        raise wrong_type("messages", "a list of message objects")
    if not value:
        raise invalid("'messages' must not be empty", "messages")
    return [chat_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def chat_message(message: Any, where: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise wrong_type(where, "an object")
    role = message.get("role")
    if role is None:
        raise missing(f"{where}.role")
    if role not in ROLES:
        raise invalid(f"'{where}.role' must be one of {', '.join(ROLES)}, got {shown(role)}", f"{where}.role")
    parsed: dict[str, Any] = {
        "role": role,
        "content": message_content(message.get("content"), role, f"{where}.content"),
    }
    if role == "assistant" and message.get("tool_calls") is not None:
        parsed["tool_calls"] = message_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is None:
            raise missing(f"{where}.tool_call_id")
        if not isinstance(call_id, str):
            raise wrong_type(f"{where}.tool_call_id", "a string")
        parsed["tool_call_id"] = call_id
    if isinstance(message.get("name"), str):
        parsed["name"] = message["name"]
    return parsed


def message_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant's earlier calls, their arguments as objects (as chat templates expect them)."""
    if not isinstance(value, list):
        raise wrong_type(where, "a list of tool calls")
    calls = []
    for i, call in enumerate(value):
        at = f"{where}[{i}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise wrong_type(at, "an object with function.name and function.arguments")
        arguments = function.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError:
                raise invalid(
                    f"'{at}.function.arguments' must be a JSON object's text", f"{at}.function.arguments"
                ) from None
        if not isinstance(arguments, dict):
            raise wrong_type(f"{at}.function.arguments", "a JSON object's text")
        calls.append(
            {
                "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{i}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return calls


def message_content(content: Any, role: str, where: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise missing(where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            is_text = isinstance(part, dict) and part.get("type") == "text"
            if not (is_text and isinstance(part.get("text"), str)):
                raise invalid(
                    f"'{where}[{i}]' must be a text part: only text content is supported",
                    f"{where}[{i}]",
                    "unsupported_value",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise wrong_type(where, "a string or a list of text parts")
