"""Tool calls over HTTP with the openai SDK on the tiny random-weight model, whole and streamed: the
grammar alone makes a required call well formed, and a stream carries what the whole answer has."""

from __future__ import annotations

import json

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ZONE = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": CITY}},
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
MESSAGES = [{"role": "user", "content": "Weather?"}]


def test_a_required_call_streams_its_arguments_in_fragments_and_matches_the_whole_answer(openai_client, server):
    ask = {
        "model": server.model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "max_tokens": 80,
        "temperature": 1.0,
    }
    for seed in range(3):
        whole = openai_client.chat.completions.create(**ask, seed=seed).choices[0]
        assert whole.finish_reason == "tool_calls"
        (call,) = whole.message.tool_calls
        chunks = [
            c.choices[0] for c in openai_client.chat.completions.create(**ask, seed=seed, stream=True) if c.choices
        ]
        deltas = [d.delta.tool_calls[0] for d in chunks if d.delta.tool_calls]
        assert deltas[0].id and deltas[0].function.name == call.function.name  # id and name first
        assert all(d.id is None and d.function.name is None and d.index == 0 for d in deltas[1:])
        fragments = [d.function.arguments for d in deltas[1:]]
        assert len(fragments) >= 3, fragments  # as they are generated, not in one delta at the end
        assert json.loads("".join(fragments)) == json.loads(call.function.arguments)
        assert chunks[-1].finish_reason == "tool_calls"


def test_text_after_an_auto_call_is_content_whole_and_streamed(openai_client, server):
    # a regex makes the random model answer with text, a hermes call, and more text
    answer = (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris", "unit": "celsius"\}\}'
        r"</tool_call> Done\."
    )
    ask = {
        "model": server.model,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 120,
        "extra_body": {"guided_regex": answer},
    }
    whole = openai_client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    assert whole.message.content == "Sure.  Done."
    assert json.loads(whole.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    chunks = [c.choices[0] for c in openai_client.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join(c.delta.content or "" for c in chunks) == whole.message.content
    calls = [c.delta.tool_calls[0] for c in chunks if c.delta.tool_calls]
    assert calls[0].function.name == "get_weather"
    assert json.loads("".join(c.function.arguments or "" for c in calls)) == {"city": "Paris", "unit": "celsius"}
    assert chunks[-1].finish_reason == "tool_calls"
