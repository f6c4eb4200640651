"""One Responses exchange: the chat completion a request becomes, and the response object and output items
its answer forms."""

from __future__ import annotations

import secrets
import time
from typing import Any

from goodput_gateway.apis import chat
from goodput_gateway.apis.response_request import (
    chat_tool_choice,
    chat_tools,
    check_fields,
    input_messages,
    response_format,
    wrong_type,
)


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


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
