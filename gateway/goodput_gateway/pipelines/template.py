"""Request bodies as the pipeline's steps see and change them: the text to check, templates, defaults.

A chat request's text is its messages' contents; a completion's is its prompt. Pure: each
function returns a new body and leaves the client's alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from goodput_contract.api.pipeline_spec import INPUT_PLACEHOLDER, Step
from goodput_gateway.errors import invalid

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def texts(path: str, body: dict[str, Any]) -> list[str]:
    """Every piece of text the client sent, in order (one per message, or the prompt)."""
    if path == CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("'messages' must be a non-empty list of message objects", "messages")
        return [_content_text(m.get("content")) if isinstance(m, dict) else "" for m in messages]
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise invalid(
            "A pipeline takes a completion's prompt as one string (its guards read text, not token ids)", "prompt"
        )
    return [prompt]


def last_user_text(path: str, body: dict[str, Any]) -> str:
    if path != CHAT:
        return texts(path, body)[0]
    for message in reversed(body["messages"]):
        if isinstance(message, dict) and message.get("role") == "user":
            return _content_text(message.get("content"))
    return ""


def map_texts(path: str, body: dict[str, Any], change: Callable[[str], str]) -> dict[str, Any]:
    """The body with every text replaced by change(text) (content parts become one text)."""
    out = copy.deepcopy(body)
    if path == CHAT:
        for message in out["messages"]:
            if isinstance(message, dict) and message.get("content") is not None:
                message["content"] = change(_content_text(message["content"]))
    else:
        out["prompt"] = change(texts(path, body)[0])
    return out


def apply_template(step: Step, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The system prompt first (in place of the client's), the last user message through the prompt template.

    A completion has no messages: the system prompt and a blank line go before its prompt."""
    out = copy.deepcopy(body)
    prompt = step.prompt
    if path == CHAT:
        messages = [
            m for m in out["messages"] if not (isinstance(m, dict) and m.get("role") in ("system", "developer"))
        ]
        if prompt is not None:
            for message in reversed(messages):
                if isinstance(message, dict) and message.get("role") == "user":
                    message["content"] = prompt.replace(INPUT_PLACEHOLDER, _content_text(message.get("content")))
                    break
        if step.system is not None:
            messages.insert(0, {"role": "system", "content": step.system})
        out["messages"] = messages
        return out
    text = texts(path, body)[0]
    if prompt is not None:
        text = prompt.replace(INPUT_PLACEHOLDER, text)
    if step.system is not None:
        text = f"{step.system}\n\n{text}"
    out["prompt"] = text
    return out


def apply_defaults(step: Step, body: dict[str, Any]) -> dict[str, Any]:
    out = dict(body)
    for name, value in step.defaults:
        if name == "max_tokens" and out.get("max_completion_tokens") is not None:
            continue
        if out.get(name) is None:
            out[name] = value
    return out
