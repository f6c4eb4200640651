"""/v1/completions over real HTTP: whole and streamed, with aiohttp and the official openai client."""

from __future__ import annotations

import asyncio
import json

import aiohttp


async def test_completion_returns_text_and_usage(server) -> None:
    async with aiohttp.ClientSession() as http:
        body = {
            "model": server.model,
            "prompt": "The quick brown fox",
            "max_tokens": 7,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with http.post(f"{server.url}/v1/completions", json=body) as response:
            assert response.status == 200
            result = await response.json()
    assert result["object"] == "text_completion"
    assert result["id"].startswith("cmpl-")
    assert result["model"] == server.model
    assert isinstance(result["created"], int)
    [choice] = result["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["text"]
    usage = result["usage"]
    assert usage["completion_tokens"] == 7
    assert usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + 7


async def test_stream_chunks_concatenate_to_the_whole_answer(server, read_sse) -> None:
    body = {
        "model": server.model,
        "prompt": "Return the value of",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v1/completions", json=body) as response:
            whole = (await response.json())["choices"][0]["text"]
        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        async with http.post(f"{server.url}/v1/completions", json=stream_body) as response:
            assert response.status == 200
            events = await read_sse(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1
    *text_chunks, usage_chunk = chunks
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in text_chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in text_chunks[:-1])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 12
    assert usage_chunk["usage"]["total_tokens"] == usage_chunk["usage"]["prompt_tokens"] + 12


async def test_stream_without_usage_option_has_no_usage_chunk(server, read_sse) -> None:
    body = {"model": server.model, "prompt": "abc", "max_tokens": 3, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as http, http.post(f"{server.url}/v1/completions", json=body) as response:
        events = await read_sse(response)
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("usage" not in c and c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_openai_client_completion(openai_client, server) -> None:
    result = openai_client.completions.create(
        model=server.model, prompt="Hello there", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage.completion_tokens == 5
    assert result.model == server.model


def test_openai_client_streaming_completion(openai_client, server) -> None:
    stream = openai_client.completions.create(
        model=server.model,
        prompt="Hello there",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    whole = openai_client.completions.create(
        model=server.model, prompt="Hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_prompt_as_token_ids_matches_prompt_as_text(openai_client, server) -> None:
    ids = server.engine.tokenizer("Hello there").input_ids
    by_text = openai_client.completions.create(
        model=server.model, prompt="Hello there", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    by_ids = openai_client.completions.create(
        model=server.model, prompt=ids, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_stop_string_ends_the_text_before_it(openai_client, server) -> None:
    free = openai_client.completions.create(
        model=server.model, prompt="Once upon", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    stop = text[len(text) // 2 :][:3]
    assert stop.strip(), f"need a visible stop string in {text!r}"
    stopped = openai_client.completions.create(
        model=server.model,
        prompt="Once upon",
        max_tokens=20,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_stop_token_ids_end_the_request(openai_client, server) -> None:
    ask = {"model": server.model, "prompt": [5, 6, 7], "max_tokens": 10, "temperature": 0}
    free = openai_client.completions.create(**ask, extra_body={"ignore_eos": True})
    assert free.choices[0].finish_reason == "length"
    every_token = list(range(len(server.engine.tokenizer)))
    stopped = openai_client.completions.create(**ask, extra_body={"ignore_eos": True, "stop_token_ids": every_token})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens <= 1


def test_seed_makes_sampling_reproducible(openai_client, server) -> None:
    def sample(seed: int) -> str:
        result = openai_client.completions.create(
            model=server.model,
            prompt="Random",
            max_tokens=12,
            temperature=1.0,
            top_p=0.9,
            seed=seed,
            extra_body={"ignore_eos": True, "top_k": 50},
        )
        return result.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_missing_max_tokens_fills_the_context(openai_client, server) -> None:
    result = openai_client.completions.create(
        model=server.model, prompt="Fill the context", extra_body={"ignore_eos": True}
    )
    assert result.choices[0].finish_reason == "length"
    assert result.usage.total_tokens == server.engine.max_model_len


def test_models_lists_the_served_name(openai_client, server) -> None:
    [model] = openai_client.models.list().data
    assert model.id == server.model
    assert openai_client.models.retrieve(server.model).id == server.model


def test_streamed_text_also_stops_before_the_stop_string(openai_client, server) -> None:
    ask = {
        "model": server.model,
        "prompt": "Once upon",
        "max_tokens": 20,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    text = openai_client.completions.create(**ask).choices[0].text
    stop = text[len(text) // 2 :][:2]
    chunks = list(openai_client.completions.create(**ask, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[: text.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_repeated_prompt_reports_cached_tokens(openai_client, server) -> None:
    prompt = list(range(300, 364))  # four full 16-token blocks
    first, second = (
        openai_client.completions.create(
            model=server.model, prompt=prompt, max_tokens=2, extra_body={"ignore_eos": True}
        )
        for _ in range(2)
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens >= 48


async def test_concurrent_requests_get_the_answers_they_get_alone(server) -> None:
    prompts = [f"Question number {i} is about" + " more" * (i % 5) for i in range(12)]

    async def ask(http: aiohttp.ClientSession, i: int) -> dict:
        body = {
            "model": server.model,
            "prompt": prompts[i],
            "max_tokens": 4 + 3 * i,
            "temperature": 0,
            "ignore_eos": True,
        }
        async with http.post(f"{server.url}/v1/completions", json=body) as response:
            assert response.status == 200
            return await response.json()

    async with aiohttp.ClientSession() as http:
        alone = [await ask(http, i) for i in range(len(prompts))]
        together = await asyncio.gather(*(ask(http, i) for i in range(len(prompts))))
    for i, (one, many) in enumerate(zip(alone, together, strict=True)):
        assert many["usage"]["completion_tokens"] == 4 + 3 * i
        assert many["choices"][0]["text"] == one["choices"][0]["text"]
    await asyncio.to_thread(server.wait_idle)
