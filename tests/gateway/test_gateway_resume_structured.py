"""Streams with structured output survive their replica: real runtime processes behind one gateway, the
replica serving a greedy stream held to a JSON Schema SIGKILLed mid-stream. The continuation carries the
request's `response_format` (or guided field) and names the ids produced so far as earlier output
(`resume_output_ids`), so the next replica's grammar goes on from where they left it: the client's text
equals an unbroken run's and parses against the schema (the openai SDK's chat and completion streams). A
stream with tools is still not resumed, and its error names the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from resume_env import MESSAGES, kill_the_serving_replica, replicas_behind_a_gateway, resumed

from goodput_gateway.resume_choice import Choice

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 1500}
SCHEMA = {  # long enough an answer for a kill to land well inside it
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 300},
        "lines": {"type": "array", "items": {"type": "string", "maxLength": 80}, "minItems": 8, "maxItems": 8},
        "mood": {"enum": ["happy", "sad", "calm"]},
    },
    "required": ["title", "lines", "mood"],
}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": SCHEMA, "strict": True}}


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume-structured")
    with replicas_behind_a_gateway(tiny_model_dir, workdir) as (gateway, pods):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
        yield gateway, pods, client


def test_a_chat_stream_held_to_a_schema_goes_on_with_the_same_text(env):
    gateway, pods, client = env

    def run(kill_after: int | None = None) -> tuple[str, str | None, int | None]:
        parts, reason, tokens = [], None, None
        stream = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            stream=True,
            stream_options={"include_usage": True},
            response_format=RESPONSE_FORMAT,
            **GREEDY,
        )
        for seen, chunk in enumerate(stream, 1):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts), reason, tokens

    unbroken = run()
    assert unbroken[1] == "stop" and unbroken[2] is not None and unbroken[2] > 200
    jsonschema.validate(json.loads(unbroken[0]), SCHEMA)
    before = resumed(gateway)
    assert run(kill_after=5) == unbroken
    assert resumed(gateway) == before + 1
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 0


def test_a_guided_completion_stream_goes_on_with_the_same_ids(env):
    gateway, pods, client = env
    body = {"model": "tiny", "prompt": "Once upon a time", "stream": True, **GREEDY}
    extra = {"guided_json": SCHEMA, "return_token_ids": True}

    def run(kill_after: int | None = None) -> tuple[str, list[int], str | None]:
        parts, ids, reason = [], [], None
        for seen, chunk in enumerate(client.completions.create(**body, extra_body=extra), 1):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                ids.extend(chunk.choices[0].model_extra["token_ids"])
                reason = chunk.choices[0].finish_reason or reason
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts), ids, reason

    unbroken = run()
    assert unbroken[2] == "stop" and len(unbroken[1]) > 200
    jsonschema.validate(json.loads(unbroken[0]), SCHEMA)
    before = resumed(gateway)
    assert run(kill_after=5) == unbroken
    assert resumed(gateway) == before + 1


def test_a_stream_with_tools_is_not_resumed_and_its_error_says_why(env):
    gateway, pods, client = env
    lost = gateway.metric("goodput_gateway_streams_lost_total", service="tiny")
    tool = {"type": "function", "function": {"name": "look_up", "parameters": {"type": "object", "properties": {}}}}
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        stream=True,
        tools=[tool],
        temperature=0,
        max_tokens=900,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError) as info:
        for seen, _ in enumerate(stream, 1):
            if seen == 5:
                kill_the_serving_replica(pods)
    assert info.value.code == "upstream_lost"
    assert "a stream with 'tools' is not resumed" in info.value.message
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == lost + 1


def test_a_replica_that_does_not_say_it_took_the_state_is_not_used():
    """A runtime that does not know a field ignores it: a continuation's grammar that did not go on from the
    earlier output, or logprobs not in the chat shape, are not taken up."""
    choice = Choice(0, produced=[7, 8, 9], shown=3)
    rest = choice.rest({"messages": [], "max_tokens": 10, "response_format": RESPONSE_FORMAT}, [1, 2], "tiny")
    assert rest["resume_output_ids"] == 3 and rest["response_format"] == RESPONSE_FORMAT
    penalties_only = {"x-goodput-resume-output-ids": "3"}
    assert not choice.taken_up(rest, penalties_only)
    assert choice.taken_up(rest, {**penalties_only, "x-goodput-resume-grammar": "3"})
    rest = choice.rest({"messages": [], "logprobs": True, "top_logprobs": 2}, [1, 2], "tiny")
    assert rest["logprobs"] == 2 and rest["chat_logprobs"] is True
    assert not choice.taken_up(rest, {}) and choice.taken_up(rest, {"x-goodput-chat-logprobs": "true"})
    rest = choice.rest({"prompt": "x", "logprobs": 2, "response_format": {"type": "text"}}, [1, 2], "tiny")
    assert rest["logprobs"] == 2 and "chat_logprobs" not in rest and "resume_output_ids" not in rest
    assert choice.taken_up(rest, {})
