"""Structured output's request fields: response_format and the guided_* fields, as a grammar to follow."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from goodput_runtime.server.errors import invalid, missing, wrong_type
from goodput_runtime.server.fields import shown
from goodput_runtime.structured.grammar import GrammarError, GrammarSpec
from goodput_runtime.structured.schema import check_schema


@dataclass(frozen=True, slots=True)
class Guide:
    """The grammar a request's output must follow, and the field that asked for it."""

    spec: GrammarSpec
    param: str  # named by the 400 when the engine cannot compile it
    kind: str  # json_object, json_schema, regex, choice, grammar or tool_call (the metric's label)


GUIDED_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


def guide(body: dict) -> Guide | None:
    """The grammar asked for by response_format or one of vLLM's guided_* fields (at most one of them)."""
    given = [
        name
        for name in GUIDED_FIELDS
        if body.get(name) is not None
        and not (name == "response_format" and isinstance(body[name], dict) and body[name].get("type") == "text")
    ]
    if len(given) > 1:
        raise invalid(f"'{given[0]}' and '{given[1]}' both constrain the output; send one", given[1])
    if not given:
        if body.get("response_format") is not None:
            response_format(body["response_format"])  # checks {"type": "text"} has nothing else wrong
        return None
    name = given[0]
    value = body[name]
    if name == "response_format":
        return response_format(value)
    if name == "guided_json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                raise invalid("'guided_json' must be a JSON Schema (an object or its JSON text)", name) from None
        return Guide(schema_spec(value, name), name, "json_schema")
    if name == "guided_regex":
        if not isinstance(value, str) or not value:
            raise wrong_type(name, "a non-empty string (a regular expression)")
        return Guide(GrammarSpec("regex", value), name, "regex")
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
            raise wrong_type(name, "a non-empty list of non-empty strings")
        return Guide(GrammarSpec("choice", json.dumps(value)), name, "choice")
    if not isinstance(value, str) or not value.strip():
        raise wrong_type(name, "a non-empty string (an EBNF or Lark grammar)")
    return Guide(GrammarSpec("grammar", value), name, "grammar")


def response_format(value: Any) -> Guide | None:
    if not isinstance(value, dict):
        raise wrong_type("response_format", "an object")
    kind = value.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise invalid(
            f"'response_format.type' must be one of text, json_object, json_schema, got {shown(kind)}",
            "response_format.type",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide(GrammarSpec("json_object"), "response_format", "json_object")
    spec = value.get("json_schema")
    if spec is None:
        raise missing("response_format.json_schema")
    if not isinstance(spec, dict):
        raise wrong_type("response_format.json_schema", "an object")
    name = spec.get("name")
    if name is None:
        raise missing("response_format.json_schema.name")
    if not isinstance(name, str):
        raise wrong_type("response_format.json_schema.name", "a string")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise wrong_type("response_format.json_schema.strict", "a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise wrong_type("response_format.json_schema.description", "a string")
    # strict or not, the schema is enforced: a grammar can only make outputs more conformant
    schema = spec.get("schema")
    if schema is None:
        return Guide(GrammarSpec("json_object"), "response_format.json_schema", "json_schema")
    param = "response_format.json_schema.schema"
    return Guide(schema_spec(schema, param), param, "json_schema")


def schema_spec(schema: Any, param: str) -> GrammarSpec:
    try:
        check_schema(schema)
    except GrammarError as exc:
        raise invalid(f"'{param}' cannot be enforced: {exc}", param, "unsupported_schema") from None
    return GrammarSpec.json_schema(schema)
