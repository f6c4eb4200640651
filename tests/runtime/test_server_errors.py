"""Every bad input gets an OpenAI-shaped error naming its field, and the server carries on."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

GOOD_COMPLETION = {"model": "tiny", "prompt": "Hello", "max_tokens": 4}
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
ERROR_KEYS = {"message", "type", "param", "code"}

COMPLETION_CASES = [
    ({"model": None}, "model"),
    ({"model": 123}, "model"),
    ({"model": "gpt-4o"}, "model"),
    ({"prompt": None}, "prompt"),
    ({"prompt": 12}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["one", "two"]}, "prompt"),
    ({"prompt": [1, 2, 10**9]}, "prompt"),
    ({"prompt": list(range(1, 300))}, "prompt"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 1000}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": "many"}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"seed": "lucky"}, "seed"),
    ({"seed": 2**70}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": ["ok", 1]}, "stop"),
    ({"stop_token_ids": "4"}, "stop_token_ids"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"n": 17}, "n"),
    ({"n": 0}, "n"),
    ({"n": "1"}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"logprobs": 21}, "logprobs"),
]

CHAT_CASES = [
    ({"model": "other"}, "model"),
    ({"messages": None}, "messages"),
    ({"messages": "Hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": ["Hello"]}, "messages[0]"),
    ({"messages": [{"content": "Hello"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "Hello"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0]",
    ),
    ({"messages": [{"role": "user", "content": "word " * 400}]}, "messages"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"n": 17}, "n"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
        "response_format.json_schema.schema",
    ),
]


def assert_openai_error(body: dict, status: int, param: str | None) -> dict:
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == ERROR_KEYS
    assert error["param"] == param
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]
    if status == 400:
        assert error["type"] == "invalid_request_error"
    return error


async def post(server, path: str, **kwargs) -> tuple[int, dict, dict]:
    async with aiohttp.ClientSession() as http, http.post(f"{server.url}{path}", **kwargs) as response:
        return response.status, dict(response.headers), await response.json()


@pytest.mark.parametrize(("change", "param"), COMPLETION_CASES, ids=[p for _, p in COMPLETION_CASES])
async def test_bad_completion_request_is_a_400_naming_the_field(server, change, param) -> None:
    body = {k: v for k, v in {**GOOD_COMPLETION, **change}.items() if v is not None}
    status, _, payload = await post(server, "/v1/completions", json=body)
    assert status == 400, payload
    assert_openai_error(payload, 400, param)


@pytest.mark.parametrize(("change", "param"), CHAT_CASES, ids=[p for _, p in CHAT_CASES])
async def test_bad_chat_request_is_a_400_naming_the_field(server, change, param) -> None:
    body = {k: v for k, v in {**GOOD_CHAT, **change}.items() if v is not None}
    status, _, payload = await post(server, "/v1/chat/completions", json=body)
    assert status == 400, payload
    assert_openai_error(payload, 400, param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b'"text"'])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_malformed_body_is_a_400(server, path, raw) -> None:
    status, _, payload = await post(server, path, data=raw, headers={"Content-Type": "application/json"})
    assert status == 400
    assert "JSON" in assert_openai_error(payload, 400, None)["message"]


async def test_unknown_route_and_method_are_openai_shaped(server) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{server.url}/v1/engines") as response:
            assert response.status == 404
            assert_openai_error(await response.json(), 404, None)
        async with http.get(f"{server.url}/v1/completions") as response:
            assert response.status == 405
            assert_openai_error(await response.json(), 405, None)


def test_openai_client_sees_a_bad_request_error_with_its_param(openai_client, server) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.completions.create(model=server.model, prompt="Hello", max_tokens=0)
    assert caught.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert caught.value.param == "model" and caught.value.code == "model_not_found"


async def test_bad_requests_do_not_disturb_a_running_stream(server, read_sse) -> None:
    body = {
        "model": server.model,
        "prompt": "Keep going",
        "max_tokens": 120,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as http:

        async def good() -> list[str]:
            async with http.post(f"{server.url}/v1/completions", json=body) as response:
                return await read_sse(response)

        async def bad(i: int) -> int:
            change, _ = COMPLETION_CASES[i % len(COMPLETION_CASES)]
            async with http.post(f"{server.url}/v1/completions", json={**GOOD_COMPLETION, **change}) as r:
                return r.status

        stream = asyncio.ensure_future(good())
        statuses = await asyncio.gather(*(bad(i) for i in range(len(COMPLETION_CASES))))
        events = await stream
    assert set(statuses) == {400}
    assert '"usage":{"prompt_tokens"' in events[-2] and '"completion_tokens":120' in events[-2]
    assert events[-1] == "[DONE]"


async def test_full_queue_is_a_429_with_retry_after(make_server) -> None:
    busy = make_server(max_num_seqs=1, max_queue=1)
    body = {"model": busy.model, "prompt": "Long answer", "max_tokens": 240, "ignore_eos": True}
    results = await asyncio.gather(*(post(busy, "/v1/completions", json=body) for _ in range(4)))
    refused = [(headers, payload) for status, headers, payload in results if status == 429]
    served = [payload for status, _, payload in results if status == 200]
    assert refused and served and len(refused) + len(served) == 4
    for headers, payload in refused:
        assert int(headers["Retry-After"]) >= 1
        assert_openai_error(payload, 429, None)
    assert all(p["usage"]["completion_tokens"] == 240 for p in served)
    client = openai.OpenAI(base_url=f"{busy.url}/v1", api_key="unused", max_retries=0)
    assert client.completions.create(model=busy.model, prompt="after", max_tokens=2).usage.completion_tokens


async def test_unexpected_engine_failure_is_a_500_and_frees_the_request(make_server, read_sse) -> None:
    class Failing:
        """The real engine, except that requests asking for 13 tokens blow up inside it."""

        def __init__(self, engine) -> None:
            self.engine = engine

        def __getattr__(self, name: str):
            return getattr(self.engine, name)

        def add_request(self, request_id, prompt_token_ids, params):
            if params.max_tokens == 13:
                raise RuntimeError("injected failure")
            stream = self.engine.add_request(request_id, prompt_token_ids, params)
            return self.fail_midway(stream) if params.max_tokens == 17 else stream

        async def fail_midway(self, stream):
            async for output in stream:
                yield output
                raise RuntimeError("injected failure mid-stream")

    from goodput_runtime.server.lifecycle import load_engine

    flaky = make_server(engine_factory=lambda config, metrics: Failing(load_engine(config, metrics)))
    body = {"model": flaky.model, "prompt": "Hello", "max_tokens": 13, "ignore_eos": True}
    status, _, payload = await post(flaky, "/v1/completions", json=body)
    assert status == 500
    assert assert_openai_error(payload, 500, None)["type"] == "server_error"
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{flaky.url}/v1/completions", json={**body, "max_tokens": 17, "stream": True}) as response,
    ):
        events = await read_sse(response)
    assert '"error"' in events[-2] and events[-1] == "[DONE]"
    status, _, payload = await post(flaky, "/v1/completions", json={**body, "max_tokens": 5})
    assert status == 200 and payload["usage"]["completion_tokens"] == 5
    await asyncio.to_thread(flaky.wait_idle)
