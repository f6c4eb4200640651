"""OpenAI's Responses API at the gateway, through the real `openai` SDK and the OpenAI Agents SDK, in front
of a real runtime process (a tiny random-weight model: its words are noise, their shape is not).

The gateway serves the runtime as a static model and keeps stored responses in SQLite on disk.
"""

from __future__ import annotations

import asyncio
import json
from typing import Literal

import openai
import pytest
from gateway_helpers import Started, post_json, wait_ready
from pydantic import BaseModel

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


class Forecast(BaseModel):
    sunny: bool


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("responses")
    with Started() as started:
        replica = started.replica("r0", tiny_model_dir, workdir)
        wait_ready(replica)
        yield started.gateway(
            workdir / "no-kubeconfig",
            workdir / "gateway.log",
            "--static-model",
            f"tiny=http://127.0.0.1:{replica.port}",
            "--database",
            f"sqlite:///{workdir}/gateway.db",
            "--shutdown-delay",
            "0",
        )


def client(gateway, key: str = "sk-alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=key, max_retries=0, timeout=60)


def test_whole_and_streamed_text_with_instructions_and_usage(gateway):
    c = client(gateway)
    whole = c.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0)
    assert whole.object == "response" and whole.status in ("completed", "incomplete")
    assert whole.output[0].type == "message" and whole.output_text == whole.output[0].content[0].text
    assert 0 < whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 0
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    if whole.status == "incomplete":
        assert whole.incomplete_details.reason == "max_output_tokens"

    told = c.responses.create(
        model="tiny", input="Hello there", instructions="Answer in one word.", max_output_tokens=8, temperature=0
    )
    assert told.usage.input_tokens > whole.usage.input_tokens  # the instructions reached the prompt
    assert told.instructions == "Answer in one word."

    events = list(
        c.responses.create(model="tiny", input="Hello there", max_output_tokens=8, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert "response.output_item.added" in kinds and "response.output_text.done" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == whole.output_text  # greedy: the same words streamed or whole
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stored_responses_chain_and_stay_with_their_caller(gateway):
    alice, bob = client(gateway, "sk-alice"), client(gateway, "sk-bob")
    first = alice.responses.create(model="tiny", input="My name is Ada.", max_output_tokens=6, temperature=0)
    second = alice.responses.create(
        model="tiny", input="What is my name?", previous_response_id=first.id, max_output_tokens=6, temperature=0
    )
    assert second.previous_response_id == first.id
    # the first exchange, question and answer, came before the second question
    alone = alice.responses.create(model="tiny", input="What is my name?", max_output_tokens=6, store=False)
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens + 3
    assert alice.responses.retrieve(first.id).output_text == first.output_text

    with pytest.raises(openai.NotFoundError):
        bob.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        bob.responses.create(model="tiny", input="and mine?", previous_response_id=first.id, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        bob.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(alone.id)  # store: false kept nothing

    alice.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(first.id)
    assert alice.responses.retrieve(second.id).id == second.id  # the chain's later link stands alone


def test_a_function_tool_round_trip_whole_and_streamed(gateway):
    c = client(gateway)
    forced = {"type": "function", "name": "get_weather"}
    called = c.responses.create(model="tiny", input="Weather in Paris?", tools=[WEATHER], tool_choice=forced)
    call = next(item for item in called.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments)["city"] in ("Paris", "Oslo")
    assert call.call_id and call.status == "completed"

    answer = c.responses.create(
        model="tiny",
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=6,
    )
    assert answer.output[0].type == "message"
    # the call and its output both reached the prompt
    assert answer.usage.input_tokens > called.usage.input_tokens + len("Sunny, 21 C") // 4

    events = list(
        c.responses.create(model="tiny", input="Weather in Oslo?", tools=[WEATHER], tool_choice=forced, stream=True)
    )
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args)["city"] in ("Paris", "Oslo")
    assert events[-1].response.output[-1].type == "function_call"


def test_text_format_json_schema_is_followed(gateway):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    }
    reply = client(gateway).responses.create(
        model="tiny",
        input="How many legs has a cat?",
        text={"format": {"type": "json_schema", "name": "legs", "schema": schema, "strict": True}},
        max_output_tokens=200,
    )
    assert reply.status == "completed", reply.output_text
    parsed = json.loads(reply.output_text)
    assert set(parsed) == {"answer", "sure"} and isinstance(parsed["answer"], int)
    assert reply.text.format.type == "json_schema"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools[1].type"),
        ({"prompt_cache_key": "k"}, "prompt_cache_key"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ],
)
def test_what_is_not_supported_gets_an_openai_400_naming_it(gateway, extra, param):
    status, _, body = post_json(gateway.url + "/v1/responses", {"model": "tiny", "input": "Hi", **extra})
    assert status == 400, body
    assert body["error"]["param"] == param and body["error"]["type"] == "invalid_request_error"


def test_an_agents_sdk_agent_calls_its_function_tool_through_the_gateway(gateway):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny in {city}"

    model = agents.OpenAIResponsesModel(
        model="tiny", openai_client=openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="sk-agent", max_retries=0)
    )
    agent = agents.Agent(
        name="weather",
        instructions="Use the tool, then answer.",
        model=model,
        tools=[get_weather],
        # the tiny model has no skill: the first turn is forced to the tool, and the answer after it to a
        # schema (text.format), which ends it where a trained model would stop by itself
        model_settings=agents.ModelSettings(tool_choice="get_weather", max_tokens=200, temperature=0),
        output_type=Forecast,
    )
    result = asyncio.run(asyncio.wait_for(agents.Runner.run(agent, "Weather in Paris?", max_turns=4), 120))
    assert calls in (["Paris"], ["Oslo"])
    assert isinstance(result.final_output, Forecast)
    kinds = [item.type for item in result.new_items]
    assert kinds[:2] == ["tool_call_item", "tool_call_output_item"] and kinds[-1] == "message_output_item"
