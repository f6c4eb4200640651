"""Tool calls on the real model (SmolLM2-135M-Instruct) with real clients: the openai SDK's two-turn
weather round trip, whole and streamed, and LangChain's bind_tools. tool_choice required (or a named
function) makes the call deterministic: a grammar forces it, so its arguments validate."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from helpers import wait_for
from server_thread import ServerThread

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": WEATHER},
    }
]
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def smollm2_tools_server(smollm2_dir: Path):
    running = ServerThread(smollm2_dir, max_model_len=1024, kv_cache_memory=64 << 20).start(wait_ready=False)
    # loading and warming a real model on a busy shared CPU may take longer than the usual minute
    wait_for(lambda: running.get("/health")[0] == 200, 300, "the server to become ready", every=0.2)
    yield running
    running.stop()


@pytest.fixture
def client(smollm2_tools_server):
    return openai.OpenAI(base_url=f"{smollm2_tools_server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def answer_with_weather(client, model: str, call: dict) -> str:
    """The second turn: the call and its result go back, and the model answers in text."""
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "22 degrees celsius and sunny"},
    ]
    result = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert result.choices[0].message.tool_calls is None
    return result.choices[0].message.content


def test_the_weather_round_trip_with_the_openai_sdk(client, smollm2_tools_server):
    model = smollm2_tools_server.model
    result = client.chat.completions.create(
        model=model, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=60, temperature=0
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "Paris" in arguments["city"]
    answer = answer_with_weather(client, model, call.model_dump())
    assert "22" in answer, answer


def test_the_weather_round_trip_streamed_sends_id_and_name_first_then_argument_fragments(client, smollm2_tools_server):
    model = smollm2_tools_server.model
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].id and calls[0].function.name == "get_weather"
    assert all(c.id is None and c.function.name is None for c in calls[1:])
    assert len(calls) > 2  # the arguments arrive in pieces, as they are generated
    arguments = "".join(c.function.arguments or "" for c in calls)
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert deltas[-1].finish_reason == "tool_calls"
    call = {"id": calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    assert "22" in answer_with_weather(client, model, call)


def test_langchain_bind_tools_with_required_returns_a_valid_call(smollm2_tools_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str, unit: str) -> str:
        """The current weather in a city; unit is celsius or fahrenheit."""
        return "22"

    llm = ChatOpenAI(
        model=smollm2_tools_server.model,
        base_url=f"{smollm2_tools_server.url}/v1",
        api_key="unused",
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=600,
    )
    # one call: with parallel calls allowed, the greedy 135M model repeats the same call until max_tokens
    message = llm.bind_tools([get_weather], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is the weather in Tokyo?"
    )
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    assert set(call["args"]) == {"city", "unit"} and "Tokyo" in call["args"]["city"]
    assert get_weather.invoke(call["args"]) == "22"
