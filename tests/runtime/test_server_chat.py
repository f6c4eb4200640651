"""/v1/chat/completions over real HTTP: the tokenizer's chat template, whole and streamed."""

from __future__ import annotations

import json

import aiohttp
import openai
import pytest

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]


def test_chat_uses_the_models_chat_template(openai_client, server) -> None:
    result = openai_client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.object == "chat.completion"
    assert result.id.startswith("chatcmpl-")
    message = result.choices[0].message
    assert message.role == "assistant" and message.content
    assert result.choices[0].finish_reason == "length"
    templated = server.engine.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected_prompt = len(server.engine.tokenizer(templated, add_special_tokens=False).input_ids)
    assert result.usage.prompt_tokens == expected_prompt
    assert result.usage.completion_tokens == 5


def test_chat_answer_equals_completion_of_the_templated_prompt(openai_client, server) -> None:
    chat = openai_client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    tokenizer = server.engine.tokenizer
    templated = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(templated, add_special_tokens=False).input_ids
    completion = openai_client.completions.create(
        model=server.model, prompt=ids, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.content == completion.choices[0].text


def test_openai_client_streaming_chat(openai_client, server) -> None:
    stream = openai_client.chat.completions.create(
        model=server.model,
        messages=MESSAGES,
        max_completion_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    whole = openai_client.chat.completions.create(
        model=server.model, messages=MESSAGES, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == whole.choices[0].message.content


async def test_chat_stream_chunks_are_shaped_like_openais(server, read_sse) -> None:
    body = {"model": server.model, "messages": MESSAGES, "max_tokens": 4, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http, http.post(f"{server.url}/v1/chat/completions", json=body) as response:
        events = await read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        assert set(chunk) >= {"id", "object", "created", "model", "choices"}
        [choice] = chunk["choices"]
        assert set(choice) >= {"index", "delta", "finish_reason"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])


def test_text_parts_are_accepted_as_content(openai_client, server) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hi"}]}]
    plain = [{"role": "user", "content": "Say hi"}]
    by_parts = openai_client.chat.completions.create(
        model=server.model, messages=parts, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    by_text = openai_client.chat.completions.create(
        model=server.model, messages=plain, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_parts.choices[0].message.content == by_text.choices[0].message.content


def test_chat_against_a_model_without_template_is_a_clear_400(no_chat_server) -> None:
    client = openai.OpenAI(base_url=f"{no_chat_server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=no_chat_server.model, messages=MESSAGES, max_tokens=4)
    error = caught.value.body
    assert error["param"] == "messages"
    assert "chat template" in error["message"]
    # the same model still completes plain prompts
    result = client.completions.create(
        model=no_chat_server.model, prompt="Hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert result.usage.completion_tokens == 3
