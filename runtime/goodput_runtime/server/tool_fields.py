"""A chat request's tools and tool_choice: the functions it may call, and the grammar a forced call follows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goodput_runtime.server.errors import invalid, wrong_type
from goodput_runtime.server.fields import shown
from goodput_runtime.server.guide_fields import schema_spec
from goodput_runtime.structured.grammar import GrammarSpec


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # a JSON Schema for the arguments object
    raw: dict  # as sent, for the chat template


def tool_list(value: Any) -> tuple[Tool, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise wrong_type("tools", "a list of tool objects")
    tools: list[Tool] = []
    for i, item in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(where, "an object")
        if item.get("type") != "function":
            raise invalid(f"'{where}.type' must be 'function', got {shown(item.get('type'))}", f"{where}.type")
        function = item.get("function")
        if not isinstance(function, dict):
            raise wrong_type(f"{where}.function", "an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise wrong_type(f"{where}.function.name", "a non-empty string")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise wrong_type(f"{where}.function.description", "a string")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        schema_spec(parameters, f"{where}.function.parameters")
        if any(t.name == name for t in tools):
            raise invalid(f"'{where}.function.name' repeats the tool name {shown(name)}", f"{where}.function.name")
        tools.append(Tool(name, description, parameters, item))
    return tuple(tools)


def tool_choice(value: Any, tools: tuple[Tool, ...]) -> str:
    if value is None:
        return "auto" if tools else "none"
    if not tools and value != "none":
        raise invalid("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise invalid(
                f"'tool_choice' must be none, auto, required or a function object, got {shown(value)}", "tool_choice"
            )
        return value
    if not isinstance(value, dict) or value.get("type") != "function" or not isinstance(value.get("function"), dict):
        raise wrong_type("tool_choice", 'none, auto, required or {"type": "function", "function": {"name": ...}}')
    name = value["function"].get("name")
    if not any(t.name == name for t in tools):
        raise invalid(
            f"'tool_choice.function.name' names no tool in 'tools': {shown(name)}", "tool_choice.function.name"
        )
    return name


def tool_call_spec(tools: tuple[Tool, ...], choice: str, parallel: bool) -> GrammarSpec:
    """The grammar of a forced call, as vLLM forces one: a named function's output is its arguments
    object; a required call is a JSON array of {"name", "parameters"} objects, one at least."""
    if choice != "required":
        return GrammarSpec.json_schema(next(t.parameters for t in tools if t.name == choice))
    calls = [
        {
            "type": "object",
            "properties": {"name": {"enum": [t.name]}, "parameters": t.parameters},
            "required": ["name", "parameters"],
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
    }
    if not parallel:
        schema["maxItems"] = 1
    return GrammarSpec.json_schema(schema)
