"""``python -m goodput_runtime`` as a real process: SIGTERM drains in-flight work and exits 0."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

pytestmark = pytest.mark.runtime


class Runtime:
    def __init__(self, model_dir: Path, log_path: Path, *flags: str) -> None:
        self.log_path = log_path
        self.log_file = log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "goodput_runtime", "--model", str(model_dir), "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", "0", "--device", "cpu", "--dtype", "float32",
             "--max-model-len", "2048", "--kv-cache-memory", "2Mi", *flags],
            stdout=self.log_file, stderr=subprocess.STDOUT)
        port = self.wait_for_log(r"Listening on http://127\.0\.0\.1:(\d+)")
        self.url = f"http://127.0.0.1:{port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, pattern: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while not (match := re.search(pattern, self.log())):
            assert self.process.poll() is None, f"the runtime exited early:\n{self.log()}"
            assert time.monotonic() < deadline, f"no {pattern!r} in the log:\n{self.log()}"
            time.sleep(0.05)
        return match.group(1) if match.groups() else match.group(0)

    async def health(self, http: aiohttp.ClientSession) -> int:
        async with http.get(f"{self.url}/health") as response:
            return response.status

    async def wait_health(self, http: aiohttp.ClientSession, status: int) -> None:
        deadline = time.monotonic() + 60
        while await self.health(http) != status:
            assert time.monotonic() < deadline, self.log()
            await asyncio.sleep(0.05)

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log_file.close()


@pytest.fixture
def runtime(tiny_model_dir: Path, tmp_path: Path) -> Iterator:
    started: list[Runtime] = []

    def start(*flags: str) -> Runtime:
        started.append(Runtime(tiny_model_dir, tmp_path / f"runtime-{len(started)}.log", *flags))
        return started[-1]

    yield start
    for process in started:
        process.close()


async def open_stream(http: aiohttp.ClientSession, url: str, max_tokens: int) -> aiohttp.ClientResponse:
    body = {"model": "tiny", "prompt": "Drain me", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    response = await http.post(f"{url}/v1/completions", json=body)
    assert response.status == 200
    await response.content.readuntil(b"\n\n")
    return response


async def rest_of_stream(response: aiohttp.ClientResponse) -> list[dict]:
    events = (await response.read()).decode().strip().split("\n\n")
    assert events[-1] == "data: [DONE]"
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


async def test_sigterm_finishes_in_flight_requests_then_exits_0(runtime) -> None:
    server = runtime("--shutdown-grace", "60")
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
        stream = await open_stream(http, server.url, 1000)
        server.process.send_signal(signal.SIGTERM)
        await server.wait_health(http, 503)
        async with http.post(f"{server.url}/v1/completions",
                             json={"model": "tiny", "prompt": "late", "max_tokens": 2}) as late:
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
