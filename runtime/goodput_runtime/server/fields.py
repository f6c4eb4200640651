"""Reading one field of a request body: types, bounds and refusals, each naming its field."""

from __future__ import annotations

import json
import math
from typing import Any

from goodput_runtime.server.errors import invalid, wrong_type


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise invalid(f"The request body is not valid JSON: {exc}", None, "invalid_json") from None
    except RecursionError:  # the parser recurses once per level of nesting
        raise invalid(
            "The request body is not valid JSON: its arrays and objects nest too deeply", None, "invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object", None, "invalid_json")
    return body


def shown(value: Any, limit: int = 60) -> str:
    """A client's value as an error message quotes it: a scalar's repr, cut short; a container's kind
    alone (a deeply nested one has no repr within the interpreter's recursion limit)."""
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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
    value = optional_number(body, name, low, high, low_open)
    return default if value is None else value


def optional_number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_number(value) or not math.isfinite(value):
        raise wrong_type(name, "a finite number")
    if value < low or value > high or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise invalid(f"'{name}' must be in {bracket}{low}, {high}], got {value}", name)
    return float(value)


def int_in(body: dict, name: str, low: int, high: int) -> int | None:
    value = optional_int(body, name)
    if value is not None and not low <= value <= high:
        raise invalid(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


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


def reject_unknown(body: dict, known: frozenset[str]) -> None:
    """Every field outside `known` is refused, naming it: none is accepted and ignored."""
    for name in body:
        if name not in known:
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def reject_unsupported(body: dict, names: dict[str, Any]) -> None:
    """Fields we do not implement are refused unless they hold their do-nothing value."""
    for name, harmless in names.items():
        value = body.get(name)
        if value is not None and value not in harmless:
            raise invalid(f"'{name}' is not supported by this server", name, "unsupported_parameter")


def logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    """{"token id": bias}; each bias clamped to [-100, 100] as OpenAI and vLLM do."""
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise wrong_type("logit_bias", "an object mapping token ids to numbers")
    pairs = []
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"'logit_bias' keys must be token ids, got {shown(key)}", "logit_bias") from None
        if not is_number(bias) or not math.isfinite(bias):
            raise invalid(f"'logit_bias' values must be numbers, got {shown(bias)} for {shown(key)}", "logit_bias")
        pairs.append((token, max(-100.0, min(100.0, float(bias)))))
    return tuple(pairs)


def max_tokens_field(body: dict, names: tuple[str, ...], allow_zero: bool) -> tuple[int | None, str]:
    """The output limit under any of its names; two names with different values are refused."""
    given = [(name, value) for name in names if (value := optional_int(body, name)) is not None]
    if len({value for _, value in given}) > 1:
        raise invalid(
            f"'max_completion_tokens' and 'max_tokens' name the same limit and differ "
            f"({body['max_completion_tokens']} and {body['max_tokens']}); send one",
            "max_completion_tokens",
        )
    if not given:
        return None, names[0]
    name, value = given[0]
    if value < 0 or (value == 0 and not allow_zero):
        least = "0" if allow_zero else "1"
        raise invalid(f"'{name}' must be at least {least}, got {value}", name)
    return value, name
