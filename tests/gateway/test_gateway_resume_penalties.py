"""Streams with presence and frequency penalties survive their replica: real runtime processes behind one
gateway, the replica serving a greedy penalized stream SIGKILLed mid-stream. The continuation names the ids
produced so far as the request's own earlier output (`resume_output_ids`), so the next replica's penalties
count them as output, as the unbroken run's did: the client's text, token ids and usage equal an unbroken
run's, token for token (the openai SDK's chat and completion streams)."""

from __future__ import annotations

import openai
import pytest
from resume_env import MESSAGES, kill_the_serving_replica, replicas_behind_a_gateway, resumed

from goodput_gateway.resume_choice import Choice

pytestmark = pytest.mark.slow

PENALTIES = {"temperature": 0, "max_tokens": 400, "presence_penalty": 1.5, "frequency_penalty": 1.0}


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume-penalties")
    with replicas_behind_a_gateway(tiny_model_dir, workdir) as (gateway, pods):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
        yield gateway, pods, client


def test_a_penalized_chat_stream_goes_on_with_the_same_text(env):
    gateway, pods, client = env

    def run(kill_after: int | None = None, **sampling) -> str:
        parts = []
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, stream=True, **sampling, extra_body={"ignore_eos": True}
        )
        for seen, chunk in enumerate(stream, 1):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts)

    unbroken = run(**PENALTIES)
    assert len(unbroken) > 200
    assert run(temperature=0, max_tokens=400) != unbroken  # the penalties change this model's text
    before = resumed(gateway)
    assert run(kill_after=5, **PENALTIES) == unbroken
    assert resumed(gateway) == before + 1
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 0


def test_a_penalized_completion_stream_goes_on_with_the_same_ids_and_usage(env):
    gateway, pods, client = env
    body = {"model": "tiny", "prompt": "Once upon a time", "stream": True, "stream_options": {"include_usage": True}}
    extra = {"ignore_eos": True, "return_token_ids": True}  # the client's own ids

    def run(kill_after: int | None = None) -> tuple[str, list[int], tuple[int, int] | None]:
        parts, ids, usage = [], [], None
        for seen, chunk in enumerate(client.completions.create(**body, **PENALTIES, extra_body=extra), 1):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                ids.extend(chunk.choices[0].model_extra["token_ids"])
            if chunk.usage is not None:
                usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts), ids, usage

    unbroken = run()
    assert len(unbroken[1]) == 400 and unbroken[2] is not None and unbroken[2][1] == 400
    before = resumed(gateway)
    assert run(kill_after=5) == unbroken
    assert resumed(gateway) == before + 1


def test_a_replica_that_does_not_say_it_took_the_earlier_output_is_not_used():
    """A runtime that does not know `resume_output_ids` ignores it, and would count the produced ids as
    prompt: its answer, without the header saying it took them, is not taken up."""
    choice = Choice(0, produced=[7, 8, 9], shown=3)
    rest = choice.rest({"max_tokens": 10, "frequency_penalty": 0.5}, [1, 2], "tiny")
    assert rest["prompt"] == [1, 2, 7, 8, 9] and rest["resume_output_ids"] == 3 and rest["max_tokens"] == 7
    assert not choice.taken_up(rest, {})
    assert not choice.taken_up(rest, {"x-goodput-resume-output-ids": "2"})
    assert choice.taken_up(rest, {"x-goodput-resume-output-ids": "3"})
    plain = choice.rest({"max_tokens": 10}, [1, 2], "tiny")
    assert "resume_output_ids" not in plain and choice.taken_up(plain, {})
