"""Tool calls out of model text in each format, whole and streamed as OpenAI streams them."""

from __future__ import annotations

import json

import pytest

from goodput_runtime.structured.tool_parsers import ToolStream, parse, parse_forced, parser_for_template

NAMES = frozenset({"get_weather", "get_time"})
PARIS = {"city": "Paris", "unit": "celsius"}

WHOLE = [
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>",
        "Let me look.",
    ),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', None),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]', None),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}', None),
]


@pytest.mark.parametrize(("fmt", "text", "content"), WHOLE)
def test_each_format_gives_the_call_with_json_arguments_and_the_text_around_it(fmt, text, content):
    got_content, calls = parse(text, fmt, NAMES)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", PARIS)]
    assert calls[0].as_openai()["id"].startswith("call_")


def test_several_hermes_calls_come_out_in_order_with_distinct_ids():
    text = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    )
    content, calls = parse(text, "hermes", NAMES)
    assert content is None
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "The weather in Paris is mild.",
        '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>',  # not an offered tool
        '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',  # broken JSON
    ],
)
def test_text_without_a_well_formed_call_of_an_offered_tool_stays_content(text):
    assert parse(text, "hermes", NAMES) == (text, [])


def test_a_forced_output_is_the_named_functions_arguments_or_an_array_of_calls():
    assert [c.name for c in parse_forced('{"city": "Rome"}', "get_weather", NAMES)] == ["get_weather"]
    array = '[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_weather", "parameters": {}}]'
    assert [c.name for c in parse_forced(array, None, NAMES)] == ["get_time", "get_weather"]
    assert parse_forced('{"city": "Ro', "get_weather", NAMES) == []  # cut by max_tokens


def test_the_parser_follows_the_chat_templates_format():
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{%- if message.role == 'ipython' %}") == "llama3_json"
    assert parser_for_template(None) == "hermes"


def stream(fmt: str, pieces: list[str], **kwargs) -> list[dict]:
    s = ToolStream(fmt, NAMES, kwargs.get("forced", False), kwargs.get("named"), kwargs.get("parallel", True))
    deltas = [d for piece in pieces for d in s.feed(piece)]
    return deltas + s.finish()


def test_a_streamed_call_sends_the_text_before_it_then_id_and_name_then_arguments():
    pieces = [
        "I will ",
        "check.<tool",
        "_call>\n",
        '{"name": "get_weather", "arguments": ',
        '{"city": "Paris", ',
        '"unit": "celsius"}}\n</tool_call>',
    ]
    deltas = stream("hermes", pieces)
    content = "".join(d.get("content", "") for d in deltas)
    assert content == "I will check."  # nothing of the marker leaks into the content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""} and calls[0]["id"].startswith("call_")
    assert json.loads("".join(c["function"].get("arguments", "") for c in calls)) == PARIS
    assert all(c["index"] == 0 for c in calls)


def test_a_named_function_streams_its_arguments_as_they_are_generated():
    deltas = stream("hermes", ['{"city"', ': "Paris"', ', "unit": "celsius"}'], forced=True, named="get_weather")
    calls = [d["tool_calls"][0] for d in deltas]
    assert calls[0]["function"]["name"] == "get_weather" and "id" in calls[0]
    assert [c["function"]["arguments"] for c in calls[1:]] == ['{"city"', ': "Paris"', ', "unit": "celsius"}']


def test_a_streamed_answer_without_a_call_is_all_content_including_a_held_back_tail():
    deltas = stream("hermes", ["It is sunny <", "tool"])
    assert "".join(d["content"] for d in deltas) == "It is sunny <tool"


def test_the_tool_call_parser_flag_reaches_the_config():
    from goodput_runtime.__main__ import engine_config, parse_args

    assert engine_config(parse_args(["--model", "m", "--tool-call-parser", "mistral"])).tool_call_parser == "mistral"
    assert engine_config(parse_args(["--model", "m"])).tool_call_parser is None  # the chat template's format


def test_a_required_call_streams_id_and_name_then_its_arguments_as_they_are_generated():
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "days": [1, {"a": 2}]}}, '
        '{"name": "get_time", "parameters": {}}]'
    )
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]
    deltas = stream("hermes", pieces, forced=True)
    calls = [d["tool_calls"][0] for d in deltas]
    assert [(c["index"], c["function"]["name"]) for c in calls if "id" in c] == [(0, "get_weather"), (1, "get_time")]
    first = [c["function"]["arguments"] for c in calls if c["index"] == 0 and "id" not in c]
    assert len(first) > 5  # in pieces, not one delta at the end
    assert json.loads("".join(first)) == {"city": 'Pa"ris}', "days": [1, {"a": 2}]}  # a brace in a string is text
    assert json.loads("".join(c["function"]["arguments"] for c in calls if c["index"] == 1 and "id" not in c)) == {}


def test_a_required_output_cut_before_any_call_is_content():
    assert stream("hermes", ['[{"name": "get_w'], forced=True) == [{"content": '[{"name": "get_w'}]


@pytest.mark.parametrize(
    "pieces",
    [
        [
            "Sure. ",
            "<tool_call>",
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
            "</tool_call>",
            " Done.",
        ],
        [
            "<tool_call>",
            '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>',
            "\nDone.",
        ],
    ],
)
def test_text_after_an_auto_call_streams_as_the_whole_answer_has_it(pieces):
    deltas = stream("hermes", pieces)
    whole, _ = parse("".join(pieces), "hermes", NAMES)
    assert "".join(d.get("content", "") for d in deltas) == whole
    assert [
        json.loads(d["tool_calls"][0]["function"]["arguments"])
        for d in deltas
        if "tool_calls" in d and d["tool_calls"][0]["function"]["arguments"]
    ] == [PARIS]
