"""Structured output over HTTP with the openai SDK (tiny random-weight model: the grammar alone makes
its output conform), and the 400s that name what cannot be enforced."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 2},
    },
    "required": ["color", "size", "flags"],
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "Describe a thing."}]


def test_json_schema_choices_parse_and_validate_whole_and_streamed(openai_client, server):
    result = openai_client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=60, n=2, temperature=1.0, seed=5, response_format=JSON_SCHEMA
    )
    for choice in result.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    stream = openai_client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_tokens=60,
        temperature=1.0,
        seed=6,
        response_format=JSON_SCHEMA,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_guided_regex_and_choice_hold_in_completions_and_a_cut_output_says_length(openai_client, server):
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    result = openai_client.completions.create(
        model=server.model, prompt="Code:", max_tokens=20, temperature=1.0, extra_body={"guided_regex": regex}
    )
    assert re.fullmatch(regex, result.choices[0].text) and result.choices[0].finish_reason == "stop"
    choice = openai_client.completions.create(
        model=server.model,
        prompt="Pick:",
        max_tokens=10,
        n=3,
        seed=1,
        extra_body={"guided_choice": ["alpha", "beta", "gamma"]},
    )
    assert {c.text for c in choice.choices} <= {"alpha", "beta", "gamma"}
    cut = openai_client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=3, response_format=JSON_SCHEMA
    )
    assert cut.choices[0].finish_reason == "length" and cut.choices[0].message.content.startswith("{")
    # JSON mode answers with an object, as OpenAI's does, never another JSON value
    for seed in range(4):
        mode = openai_client.chat.completions.create(
            model=server.model,
            messages=MESSAGES,
            max_tokens=3,
            seed=seed,
            temperature=1.0,
            response_format={"type": "json_object"},
        )
        assert mode.choices[0].message.content.startswith("{"), mode.choices[0].message.content


def test_a_grammar_in_ebnf_or_lark_is_followed(openai_client, server):
    for grammar in ('root ::= "yes" | "no" | "maybe"', 'start: "yes" | "no" | "maybe"'):
        result = openai_client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=8, extra_body={"guided_grammar": grammar}
        )
        assert result.choices[0].message.content in ("yes", "no", "maybe")


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {"type": "object", "properties": {"a": {"type": "string", "not": {"const": "b"}}}},
                    },
                }
            },
            "response_format.json_schema.schema",
            'Unimplemented keys: ["not"]',
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "x",
                        "schema": {
                            "type": "object",
                            "properties": {"a": {"type": "string", "contentEncoding": "base64"}},
                        },
                    },
                }
            },
            "response_format.json_schema.schema",
            "'contentEncoding' at '#/properties/a'",
        ),
        (
            {"guided_json": {"type": "string", "format": "uri-reference"}},
            "guided_json",
            "Unknown format: uri-reference",
        ),
        ({"guided_regex": "(?<=a)b"}, "guided_regex", "look-behind"),
        ({"guided_grammar": "root ::= missing_rule"}, "guided_grammar", "missing_rule"),
        ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
            "response_format.json_schema.name",
            "name",
        ),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "send one"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "tool_choice.function.name",
            "'g'",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "array", "uniqueItems": True}},
                            },
                        },
                    }
                ],
                "tool_choice": "required",
            },
            "tools",
            "uniqueItems",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {
                                "type": "object",
                                "properties": {"a": {"type": "string", "contentMediaType": "text/html"}},
                            },
                        },
                    }
                ]
            },
            "tools[0].function.parameters",
            "'contentMediaType' at '#/properties/a'",
        ),
        ({"guided_regex": "[a-z]+", "min_tokens": 4}, "min_tokens", "guided_regex"),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required", "min_tokens": 2},
            "min_tokens",
            "'tools'",
        ),
    ],
)
def test_what_cannot_be_enforced_gets_a_400_naming_the_field(openai_client, server, extra, param, words):
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=5, extra_body=extra)
    error = caught.value.body
    assert error["param"] == param, error
    assert words in error["message"], error


def test_structured_requests_are_counted_by_type_and_compile_time_is_observed(openai_client, server):
    import httpx

    openai_client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=4, response_format={"type": "json_object"}
    )
    metrics = httpx.get(f"{server.url}/metrics").text
    assert re.search(r'goodput_structured_output_requests_total\{model="[^"]+",type="json_object"\} [1-9]', metrics)
    assert re.search(r"goodput_grammar_compile_seconds_count\{[^}]*\} [1-9]", metrics)
