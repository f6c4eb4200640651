"""``python -m goodput_runtime`` as a real process: SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import asyncio
import json
import signal

import aiohttp


async def open_stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> aiohttp.ClientResponse:
    body = {
        "model": "tiny",
        "prompt": "Drain me",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await http.post(f"{url}/v1/completions", json=body)
    assert response.status == 200
    await response.content.readuntil(b"\n\n")
    return response


async def rest_of_stream(response: aiohttp.ClientResponse) -> list[dict]:
    events = (await response.read()).decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: ") :]) for e in events[:-1]]


async def test_sigterm_finishes_in_flight_requests_then_exits_0(runtime) -> None:
    server = runtime("--shutdown-grace", "60")
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        stream = await open_stream(http, server.url, 1000)
        server.process.send_signal(signal.SIGTERM)
        await server.wait_health(http, 503)
        async with http.post(
            f"{server.url}/v1/completions", json={"model": "tiny", "prompt": "late", "max_tokens": 2}
        ) as late:
            assert late.status == 503
            assert (await late.json())["error"]["code"] == "shutting_down"
        chunks = await rest_of_stream(stream)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 1000
    assert await asyncio.to_thread(server.process.wait, 60) == 0
    assert "Drained" in server.log()


async def test_second_sigterm_aborts_at_once_and_still_exits_0(runtime) -> None:
    server = runtime("--shutdown-grace", "600")
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        stream = await open_stream(http, server.url, 2000)
        server.process.send_signal(signal.SIGTERM)
        await server.wait_health(http, 503)
        server.process.send_signal(signal.SIGTERM)
        chunks = await rest_of_stream(stream)
    assert chunks[-2]["choices"][0]["finish_reason"] == "abort"
    assert chunks[-1]["usage"]["completion_tokens"] < 2000
    assert await asyncio.to_thread(server.process.wait, 60) == 0
