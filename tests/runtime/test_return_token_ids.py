"""vLLM's `return_token_ids` on /v1/completions and /v1/chat/completions, whole and streamed, through the
openai SDK: the prompt's ids and each choice's ids, which decode to the text and continue it exactly when
sent back as a token-id prompt (what the gateway does to resume a stream on another replica)."""

from __future__ import annotations

import aiohttp
import openai
import pytest

MESSAGES = [{"role": "user", "content": "Count with me"}]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def detokenize(server, ids: list[int]) -> str:
    import httpx

    response = httpx.post(f"{server.url}/detokenize", json={"model": server.model, "tokens": ids}, timeout=10)
    return str(response.json()["prompt"])


def test_a_whole_completion_carries_the_prompts_ids_and_the_choices(client, server):
    out = client.completions.create(model=server.model, prompt=[5, 6, 7, 8], **GREEDY)
    body = out.model_dump()
    assert body["prompt_token_ids"] == [5, 6, 7, 8]
    ids = body["choices"][0]["token_ids"]
    assert len(ids) == 12 == out.usage.completion_tokens
    assert detokenize(server, ids) == out.choices[0].text
    plain = client.completions.create(model=server.model, prompt=[5, 6, 7, 8], temperature=0, max_tokens=12)
    assert "prompt_token_ids" not in plain.model_dump() and "token_ids" not in plain.choices[0].model_dump()


def test_streamed_chat_ids_continue_as_a_token_prompt_to_the_same_text(client, server):
    whole = client.chat.completions.create(model=server.model, messages=MESSAGES, **GREEDY)
    prompt_ids = whole.model_dump()["prompt_token_ids"]
    assert len(prompt_ids) == whole.usage.prompt_tokens
    chunks = [
        c.model_dump()
        for c in client.chat.completions.create(model=server.model, messages=MESSAGES, stream=True, **GREEDY)
    ]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert ids == whole.model_dump()["choices"][0]["token_ids"] and len(ids) == 12
    assert text == whole.choices[0].message.content
    # the first 5 produced tokens as part of the prompt: the other 7 follow as in the run unbroken
    rest = client.completions.create(model=server.model, prompt=prompt_ids + ids[:5], **{**GREEDY, "max_tokens": 7})
    assert rest.model_dump()["choices"][0]["token_ids"] == ids[5:]


def test_streamed_completion_ids_with_two_choices(client, server):
    chunks = [
        c.model_dump()
        for c in client.completions.create(
            model=server.model,
            prompt="one two",
            stream=True,
            n=2,
            seed=3,
            temperature=1.0,
            max_tokens=6,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
    ]
    for index in (0, 1):
        ids = [t for c in chunks for ch in c["choices"] if ch["index"] == index for t in ch["token_ids"]]
        text = "".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == index)
        assert len(ids) == 6 and detokenize(server, ids) == text


async def test_a_field_that_is_not_a_boolean_is_refused_by_name(server):
    async with aiohttp.ClientSession() as http:
        for path, extra in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES})):
            body = {"model": server.model, "max_tokens": 2, "return_token_ids": "yes", **extra}
            async with http.post(server.url + path, json=body) as response:
                error = (await response.json())["error"]
                assert response.status == 400 and error["param"] == "return_token_ids", error
        body = {"model": server.model, "input": "hi", "return_token_ids": True}
        async with http.post(server.url + "/v1/embeddings", json=body) as response:
            error = (await response.json())["error"]
            assert response.status == 400 and error["param"] == "return_token_ids", error
