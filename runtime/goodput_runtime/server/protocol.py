"""Validation of OpenAI request bodies into plain dataclasses; every error names its field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.errors import invalid, missing, wrong_type

ROLES = ("system", "developer", "user", "assistant", "tool")
SEED_RANGE = (-(2**63), 2**64 - 1)


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int | None  # None: whatever room the context leaves
    max_tokens_param: str
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool

    def params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=self.stop,
                              stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]
    sampling: Sampling
    stream: bool
    include_usage: bool


@dataclass(frozen=True, slots=True)
class ChatRequest:
    model: str
    messages: list[dict[str, str]]
    sampling: Sampling
    stream: bool
    include_usage: bool


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object", None, "invalid_json")
    return body


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def optional_int(body: dict, name: str, minimum: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        raise wrong_type(name, "an integer")
    if minimum is not None and value < minimum:
        raise invalid(f"'{name}' must be at least {minimum}, got {value}", name)
    return value


def number(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not is_number(value):
        raise wrong_type(name, "a number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}", name)
    return float(value)


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise wrong_type(name, "a boolean")
    return value


def int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(is_int(v) for v in value):
        raise wrong_type(name, "a list of integers")
    return value


def stop_strings(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise wrong_type("stop", "a string or a list of strings")
    return tuple(v for v in value if v)


def reject_unsupported(body: dict, names: dict[str, Any]) -> None:
    """Fields we do not implement are refused unless they hold their do-nothing value."""
    for name, harmless in names.items():
        value = body.get(name)
        if value is not None and value not in harmless:
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def sampling(body: dict, max_tokens_names: tuple[str, ...]) -> Sampling:
    max_tokens, max_tokens_param = None, max_tokens_names[-1]
    for name in max_tokens_names:
        value = optional_int(body, name)
        if value is not None:
            if value <= 0:
                raise invalid(f"'{name}' must be at least 1, got {value}", name)
            max_tokens, max_tokens_param = value, name
            break
    n = optional_int(body, "n")
    if n is not None and n != 1:
        raise invalid(f"'n' must be 1: this server returns one choice per request, got {n}", "n")
    seed = optional_int(body, "seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise invalid("'seed' must fit in 64 bits", "seed")
    stop_ids = body.get("stop_token_ids")
    return Sampling(
        max_tokens=max_tokens,
        max_tokens_param=max_tokens_param,
        temperature=number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=max(optional_int(body, "top_k", minimum=-1) or 0, 0),
        seed=seed,
        stop=stop_strings(body),
        stop_token_ids=() if stop_ids is None else tuple(int_list(stop_ids, "stop_token_ids")),
        ignore_eos=boolean(body, "ignore_eos"),
    )


def model_name(body: dict) -> str:
    value = body.get("model")
    if value is None:
        raise missing("model")
    if not isinstance(value, str):
        raise wrong_type("model", "a string")
    return value


def include_usage(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise wrong_type("stream_options", "an object")
    value = options.get("include_usage")
    if value is not None and not isinstance(value, bool):
        raise wrong_type("stream_options.include_usage", "a boolean")
    return bool(value)


COMMON_UNSUPPORTED = {"best_of": (1,), "logit_bias": ({},), "presence_penalty": (0, 0.0),
                      "frequency_penalty": (0, 0.0)}


def parse_completion(body: dict) -> CompletionRequest:
    reject_unsupported(body, {**COMMON_UNSUPPORTED, "echo": (False,), "logprobs": (), "suffix": ("",)})
    stream = boolean(body, "stream")
    return CompletionRequest(model_name(body), completion_prompt(body.get("prompt")),
                             sampling(body, ("max_tokens",)), stream, include_usage(body, stream))


def completion_prompt(value: Any) -> str | list[int]:
    if value is None:
        raise missing("prompt")
    if isinstance(value, list) and value and not all(is_int(v) for v in value):
        if len(value) > 1:
            raise invalid("Only one prompt per request is supported", "prompt", "unsupported_value")
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise invalid("'prompt' must not be empty", "prompt")
        return value
    if isinstance(value, list) and all(is_int(v) for v in value):
        if not value:
            raise invalid("'prompt' must not be empty", "prompt")
        return value
    raise wrong_type("prompt", "a string or a list of token ids")


def parse_chat(body: dict) -> ChatRequest:
    reject_unsupported(body, {**COMMON_UNSUPPORTED, "logprobs": (False,), "top_logprobs": (0,),
                              "tools": ([],), "response_format": ({"type": "text"},)})
    stream = boolean(body, "stream")
    return ChatRequest(model_name(body), chat_messages(body.get("messages")),
                       sampling(body, ("max_completion_tokens", "max_tokens")), stream,
                       include_usage(body, stream))


def chat_messages(value: Any) -> list[dict[str, str]]:
    if value is None:
        raise missing("messages")
    if not isinstance(value, list):
        raise wrong_type("messages", "a list of message objects")
    if not value:
        raise invalid("'messages' must not be empty", "messages")
    return [chat_message(m, f"messages[{i}]") for i, m in enumerate(value)]


def chat_message(message: Any, where: str) -> dict[str, str]:
    if not isinstance(message, dict):
        raise wrong_type(where, "an object")
    role = message.get("role")
    if role is None:
        raise missing(f"{where}.role")
    if role not in ROLES:
        raise invalid(f"'{where}.role' must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
    return {"role": role, "content": message_content(message.get("content"), role, f"{where}.content")}


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
                raise invalid(f"'{where}[{i}]' must be a text part: only text content is supported",
                              f"{where}[{i}]", "unsupported_value")
            texts.append(part["text"])
        return "".join(texts)
    raise wrong_type(where, "a string or a list of text parts")

