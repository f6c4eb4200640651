"""A stream taken up on another replica keeps its structured output and its logprobs (the gateway's
resume): with `resume_output_ids: K` a request's grammar goes on from the prompt's last K ids, its earlier
output, so a greedy guided run continued from a break gives the unbroken run's tokens and its text parses
against the schema; ids the grammar refuses are a 400 naming the field. `chat_logprobs` gives a completion's
logprobs in the chat shape, and a stream with token ids sends each token's logprobs with its id."""

from __future__ import annotations

import json

import aiohttp
import jsonschema
import openai
import pytest

PROMPT = [5, 6, 7, 8, 9, 10]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "size", "tags"],
}
GRAMMAR_HEADER = "x-goodput-resume-grammar"


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def guided(client, server, prompt: list[int], **extra) -> tuple[str, list[int], str | None, dict[str, str]]:
    answer = client.completions.with_raw_response.create(
        model=server.model,
        prompt=prompt,
        max_tokens=120,
        temperature=0,
        extra_body={"guided_json": SCHEMA, "return_token_ids": True, **extra},
    )
    choice = answer.parse().model_dump()["choices"][0]
    return choice["text"], choice["token_ids"], choice["finish_reason"], dict(answer.headers)


def test_a_guided_greedy_run_continues_from_a_break_as_unbroken(client, server):
    text, whole, reason, headers = guided(client, server, PROMPT)
    assert reason == "stop" and len(whole) > 6
    jsonschema.validate(json.loads(text), SCHEMA)
    assert GRAMMAR_HEADER not in {k.lower() for k in headers}
    for cut in (1, len(whole) // 2, len(whole) - 1):
        rest, ids, reason, headers = guided(client, server, PROMPT + whole[:cut], resume_output_ids=cut)
        assert ids == whole[cut:] and reason == "stop", f"broken after {cut} tokens"
        assert headers[GRAMMAR_HEADER] == str(cut)
        assert text.endswith(rest)
    # without the field the grammar starts afresh: the continuation is a whole object of its own
    rest, ids, _, _ = guided(client, server, PROMPT + whole[:3])
    assert ids != whole[3:] and rest.startswith("{")


async def test_earlier_output_the_grammar_refuses_is_refused_by_name(client, server):
    _, whole, _, _ = guided(client, server, PROMPT)
    body = {"model": server.model, "max_tokens": 5, "guided_json": SCHEMA}
    async with aiohttp.ClientSession() as http:
        # not JSON; a token after the object was complete
        for prompt, earlier in ((PROMPT, 2), (PROMPT + whole + whole[:1], len(whole) + 1)):
            async with http.post(
                server.url + "/v1/completions", json={**body, "prompt": prompt, "resume_output_ids": earlier}
            ) as response:
                answer = await response.json()
                assert response.status == 400 and answer["error"]["param"] == "resume_output_ids", (earlier, answer)
                assert "does not accept" in answer["error"]["message"]


async def test_chat_logprobs_shape_a_completions_logprobs_as_a_chat_stream_has_them(server):
    body = {"model": server.model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3}
    async with aiohttp.ClientSession() as http:
        async with http.post(server.url + "/v1/completions", json=body) as response:
            plain = (await response.json())["choices"][0]["logprobs"]
        async with http.post(server.url + "/v1/completions", json={**body, "chat_logprobs": True}) as response:
            assert response.headers["x-goodput-chat-logprobs"] == "true"
            shaped = (await response.json())["choices"][0]["logprobs"]
    content = shaped["content"]
    assert [e["token"] for e in content] == plain["tokens"]
    assert [e["logprob"] for e in content] == pytest.approx(plain["token_logprobs"], abs=1e-5)
    for entry, top in zip(content, plain["top_logprobs"], strict=True):
        assert len(entry["top_logprobs"]) == 3
        if "\ufffd" not in entry["token"]:  # a character's part has its own bytes, which its text cannot give
            assert entry["bytes"] == list(entry["token"].encode())
        assert {t["token"]: t["logprob"] for t in entry["top_logprobs"]}.items() <= top.items()
    async with aiohttp.ClientSession() as http:
        for path, extra in (
            ("/v1/completions", {"logprobs": None}),
            ("/v1/completions", {"echo": True}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}),
        ):
            async with http.post(server.url + path, json={**body, "chat_logprobs": True, **extra}) as response:
                error = (await response.json())["error"]
                assert response.status == 400 and error["param"] == "chat_logprobs", error


async def test_a_stream_with_token_ids_sends_each_tokens_logprobs_with_its_id(server):
    """Text held back (a possible stop string) holds its tokens' ids, and their logprobs with them: the
    logprobs a client has are always those of the tokens it has."""
    body = {
        "model": server.model,
        "prompt": PROMPT,
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 1,
        "stream": True,
        "return_token_ids": True,
        "ignore_eos": True,
        "stop": ["a stop string this text never holds"],
    }
    async with aiohttp.ClientSession() as http, http.post(server.url + "/v1/completions", json=body) as response:
        events = [line[6:] for line in (await response.text()).splitlines() if line.startswith("data: {")]
    chunks = [json.loads(e)["choices"][0] for e in events if json.loads(e)["choices"]]
    for chunk in chunks:
        tokens = (chunk["logprobs"] or {}).get("tokens", [])
        assert len(tokens) == len(chunk["token_ids"]), chunk
    assert sum(len(c["token_ids"]) for c in chunks) == 40
    assert len([c for c in chunks if c["token_ids"]]) < 40  # text was held back, and its logprobs with it
