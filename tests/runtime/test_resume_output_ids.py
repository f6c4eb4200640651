"""`resume_output_ids` on /v1/completions: the prompt's last K ids are the request's own earlier output (a
stream taken up on another replica), counted as output by the presence and frequency penalties. A greedy
run with penalties continued from a break with the field gives the unbroken run's tokens; the answer says it
took the field in `x-goodput-resume-output-ids`; values it cannot take are refused by name."""

from __future__ import annotations

import dataclasses

import aiohttp
import openai
import pytest
import torch

from goodput_runtime.engine.sampler import Sampler, SampleRow
from goodput_runtime.sampling import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10]
PENALTIES = {"temperature": 0, "presence_penalty": 1.5, "frequency_penalty": 2.0}
HEADER = "x-goodput-resume-output-ids"


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def ids_of(client, server, prompt: list[int], max_tokens: int, **extra) -> tuple[list[int], dict[str, str]]:
    answer = client.completions.with_raw_response.create(
        model=server.model,
        prompt=prompt,
        max_tokens=max_tokens,
        **PENALTIES,
        extra_body={"ignore_eos": True, "return_token_ids": True, **extra},
    )
    return answer.parse().model_dump()["choices"][0]["token_ids"], dict(answer.headers)


def test_penalties_count_the_ids_named_as_earlier_output():
    """The sampler alone: with the prompt's last K tokens named as output, the penalties fall on them as on
    tokens generated, and the other prompt tokens keep their logits."""
    logits = torch.zeros(2, 8)
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=1.0)
    rows = [
        SampleRow(params, ("plain", 0), [1, 2, 3, 3, 4], num_prompt_tokens=4),
        SampleRow(dataclasses.replace(params, output_in_prompt=2), ("resumed", 0), [1, 2, 3, 3, 4], 4),
    ]
    out = Sampler().process(logits, rows)
    assert out[0].tolist() == [0, 0, 0, 0, -1.5, 0, 0, 0]  # token 4, generated once
    assert out[1].tolist() == [0, 0, 0, -2.5, -1.5, 0, 0, 0]  # token 3 (once as output) and 4


def test_a_greedy_run_with_penalties_continues_from_a_break_as_unbroken(client, server):
    whole, headers = ids_of(client, server, PROMPT, 24)
    assert HEADER.lower() not in {k.lower() for k in headers}
    for cut in (1, 9, 17):
        rest, headers = ids_of(client, server, PROMPT + whole[:cut], 24 - cut, resume_output_ids=cut)
        assert rest == whole[cut:], f"broken after {cut} tokens"
        assert headers[HEADER] == str(cut)
    # the same continuation with the earlier output counted as prompt: the penalties differ, and so do the tokens
    naive, _ = ids_of(client, server, PROMPT + whole[:9], 15)
    assert naive != whole[9:]


async def test_a_streamed_continuation_says_it_took_the_field(server):
    body = {"model": server.model, "prompt": [*PROMPT, 11, 12], "max_tokens": 3, "stream": True, **PENALTIES}
    async with (
        aiohttp.ClientSession() as http,
        http.post(server.url + "/v1/completions", json={**body, "resume_output_ids": 2}) as response,
    ):
        assert response.status == 200 and response.headers[HEADER] == "2"
        assert (await response.read()).rstrip().endswith(b"data: [DONE]")


async def test_values_it_cannot_take_are_refused_by_name(server):
    cases = [
        ("/v1/completions", {"prompt": PROMPT, "resume_output_ids": len(PROMPT) + 1}, "exceeds the prompt's 6 tokens"),
        ("/v1/completions", {"prompt": PROMPT, "resume_output_ids": -1}, "at least 0"),
        ("/v1/completions", {"prompt": PROMPT, "resume_output_ids": "2"}, "integer"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "resume_output_ids": 1}, "only"),
    ]
    async with aiohttp.ClientSession() as http:
        for path, extra, says in cases:
            body = {"model": server.model, "max_tokens": 2, **extra}
            async with http.post(server.url + path, json=body) as response:
                error = (await response.json())["error"]
                assert response.status == 400 and error["param"] == "resume_output_ids", error
                assert says in error["message"], error
