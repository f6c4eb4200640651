"""The fields of a resumable stream that carry state across the break (resume.py): its logprobs and its
structured output.

Logprobs: the continuation asks for the logprobs of its own tokens. A completion stream's come in the
completions shape, their `text_offset` counted from the continuation's start, moved on here past the text
the client had. A chat stream's continuation asks the runtime for them in the chat shape (`chat_logprobs`,
the runtime's field): token, logprob, bytes and top_logprobs, built by the same code as an unbroken chat
stream's (a completions-shaped answer could not give them back: it names tokens by their text alone, with no
bytes, and top logprobs of tokens with the same text fold into one).

Structured output: the continuation carries `response_format` or the guided_* field as sent (the runtime's
completions take the same fields as its chat), and names the produced ids as earlier output
(`resume_output_ids`): the runtime's grammar goes on from where those ids left it, which its answer says
with a header; a replica that does not say so is not used."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GUIDED = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
# the runtime's field (/v1/completions): logprobs in the chat shape; its answer says it took it in the header
CHAT_LOGPROBS = ("chat_logprobs", "x-goodput-chat-logprobs")
# the runtime's answer to `resume_output_ids` with a grammar: the grammar went on from those K ids
RESUME_GRAMMAR = "x-goodput-resume-grammar"


def is_chat(body: Mapping[str, Any]) -> bool:
    return "messages" in body


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def carries(name: str, value: Any, body: Mapping[str, Any]) -> bool:
    """Whether a continuation takes the field up at this value (the runtime checked its value when the
    stream began)."""
    if name in GUIDED:
        return True
    if name == "logprobs":
        return value in (None, False, True) if is_chat(body) else value is None or is_int(value)
    if name == "top_logprobs":
        return is_chat(body) and (value is None or is_int(value))
    return False


def guided(body: Mapping[str, Any]) -> bool:
    """Whether the request's output follows a grammar (a `response_format` of type text does not)."""
    for name in GUIDED:
        value = body.get(name)
        if value is not None and not (
            name == "response_format" and isinstance(value, dict) and value.get("type") == "text"
        ):
            return True
    return False


def logprobs_asked(body: Mapping[str, Any]) -> bool:
    return body.get("logprobs") is True if is_chat(body) else is_int(body.get("logprobs"))


def carried(body: Mapping[str, Any]) -> dict[str, Any]:
    """The continuation's fields for the request's logprobs and structured output."""
    rest = {name: body[name] for name in GUIDED if body.get(name) is not None}
    if logprobs_asked(body) and is_chat(body):
        rest["logprobs"] = body.get("top_logprobs") or 0
        rest[CHAT_LOGPROBS[0]] = True
    elif logprobs_asked(body):
        rest["logprobs"] = body["logprobs"]
    return rest


def confirmed(rest: Mapping[str, Any], headers: Mapping[str, str], earlier: int | None) -> bool:
    """Whether the replica answering `rest` says it took the state it carries: logprobs in the chat shape,
    and a grammar gone on from the `earlier` ids of output it names."""
    if rest.get(CHAT_LOGPROBS[0]) and headers.get(CHAT_LOGPROBS[1]) != "true":
        return False
    return earlier is None or not guided(rest) or headers.get(RESUME_GRAMMAR) == str(earlier)


def echoed(body: Mapping[str, Any], prompt: list[int] | None) -> int:
    """The logprobs entries of the echoed prompt (completions' `echo` with `logprobs`), which come first."""
    if is_chat(body) or body.get("echo") is not True or not logprobs_asked(body):
        return 0
    return len(prompt or ())
