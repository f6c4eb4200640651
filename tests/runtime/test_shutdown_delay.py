"""``--shutdown-delay``: after SIGTERM, health turns 503 at once but new requests are still served
(each told ``Connection: close``) until the delay is over; then the usual drain begins."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time

import aiohttp

SHORT = {"model": "tiny", "prompt": "Still here?", "max_tokens": 2}
# the tiny model decodes a token in about a millisecond: room for a 4000-token stream that outlasts a delay
LONG = ("--max-model-len", "4096", "--kv-cache-memory", "4Mi")


async def open_stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> aiohttp.ClientResponse:
    body = {"model": "tiny", "prompt": "Keep going", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    response = await http.post(f"{url}/v1/completions", json=body)
    assert response.status == 200
    await response.content.readuntil(b"\n\n")
    return response


async def finish_reason(response: aiohttp.ClientResponse) -> str:
    events = (await response.read()).decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    return json.loads(events[-2][len("data: ") :])["choices"][0]["finish_reason"]


async def test_during_the_delay_new_requests_are_served_with_connection_close(runtime) -> None:
    server = runtime("--shutdown-delay", "2", "--shutdown-grace", "120", *LONG)
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        async with http.post(f"{server.url}/v1/completions", json=SHORT) as before:
            assert before.status == 200
            assert before.headers.get("Connection", "").lower() != "close"
        signalled = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        await server.wait_health(http, 503)
        # admitted during the delay and still running when the drain begins, so the process stays up
        stream = await open_stream(http, server.url, 4000)
        assert stream.headers["Connection"].lower() == "close"
        streamed = asyncio.ensure_future(finish_reason(stream))
        async with http.get(f"{server.url}/health") as health:
            assert (health.status, await health.json()) == (503, {"status": "stopping"})
        async with http.post(f"{server.url}/v1/completions", json=SHORT) as during:
            assert during.status == 200, await during.text()
            assert during.headers["Connection"].lower() == "close"
            assert (await during.json())["usage"]["completion_tokens"] == 2
        async with http.post(
            f"{server.url}/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        ) as chat:
            assert chat.status == 200
            assert chat.headers["Connection"].lower() == "close"
        async with http.get(f"{server.url}/metrics") as scrape:
            assert scrape.status == 200
            assert "goodput_requests_total" in await scrape.text()
        assert time.monotonic() - signalled < 2, "the checks above ran past the delay; the test proves nothing"
        await asyncio.to_thread(server.wait_for_log, r"Draining")
        assert not streamed.done(), "the stream ended before the drain began; the test proves nothing"
        async with http.post(f"{server.url}/v1/completions", json=SHORT) as after:
            assert after.status == 503
            assert after.headers["Connection"].lower() == "close"
            assert (await after.json())["error"]["code"] == "shutting_down"
        server.process.send_signal(signal.SIGTERM)  # no need to wait out the stream
        assert await streamed == "abort"
    assert await asyncio.to_thread(server.process.wait, 60) == 0
    assert time.monotonic() - signalled >= 2  # the whole delay was served before the process left
    log = server.log()
    assert log.index("Stopping: health is 503") < log.index("Shutdown delay over") < log.index("Draining")


async def test_idle_keep_alive_connections_are_closed_when_the_drain_begins(runtime) -> None:
    server = runtime("--shutdown-delay", "1", "--shutdown-grace", "60", *LONG)
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        stream = await open_stream(http, server.url, 4000)  # keeps the drain, and the process, going
        port = int(server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as idle:
            idle.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\n\r\n")
            first = idle.recv(65536)
            assert first.startswith(b"HTTP/1.1 200") and b"Connection: close" not in first
            server.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert idle.recv(65536) == b""  # the server hung up on the idle connection
            closed_after = time.monotonic() - signalled
        assert closed_after >= 0.9, "closed before the shutdown delay was over"
        assert not stream.content.at_eof() and server.process.poll() is None
        server.process.send_signal(signal.SIGTERM)  # no need to wait out the stream
        assert await finish_reason(stream) == "abort"
    assert await asyncio.to_thread(server.process.wait, 60) == 0


async def test_a_second_sigterm_during_the_delay_aborts_at_once_and_exits_0(runtime) -> None:
    server = runtime("--shutdown-delay", "600", "--shutdown-grace", "600", *LONG)
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        stream = await open_stream(http, server.url, 4000)
        server.process.send_signal(signal.SIGTERM)
        await server.wait_health(http, 503)
        server.process.send_signal(signal.SIGTERM)
        assert await finish_reason(stream) == "abort"
    assert await asyncio.to_thread(server.process.wait, 60) == 0
    assert "Shutdown delay cut short" in server.log()
