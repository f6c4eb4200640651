"""Readiness, metrics, clients that leave early, and draining at shutdown."""

from __future__ import annotations

import asyncio
import gc
import json
import threading

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_thread import MODEL_NAME, ServerThread

from goodput_runtime.server.lifecycle import load_engine

LONG = {"prompt": "Tell me everything", "max_tokens": 1800, "ignore_eos": True}


def test_health_is_503_until_the_engine_is_warm(make_server) -> None:
    gate = threading.Event()

    def slow_load(config, metrics):
        gate.wait(60)
        return load_engine(config, metrics)

    loading = make_server(engine_factory=slow_load, wait_ready=False)
    try:
        status, body = loading.get("/health")
        assert (status, body) == (503, {"status": "loading"})
        status, body = loading.get("/metrics")
        assert status == 200 and "goodput_requests_total" in body
    finally:
        gate.set()
    loading.wait_ready()
    assert loading.get("/health") == (200, {"status": "ready"})


async def test_requests_while_loading_get_503(make_server) -> None:
    gate = threading.Event()
    loading = make_server(engine_factory=lambda c, m: gate.wait(60) and load_engine(c, m), wait_ready=False)
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{loading.url}/v1/completions", json={"model": loading.model, "prompt": "hi"}) as response,
        ):
            assert response.status == 503
            assert response.headers["Retry-After"]
            assert (await response.json())["error"]["code"] == "model_loading"
        # a stop while the model loads ends the server at once, and cleanly
        assert await asyncio.to_thread(loading.stop) == 0
    finally:
        gate.set()


def test_metrics_count_requests_and_time_to_first_token(openai_client, server) -> None:
    def samples() -> dict[tuple[str, tuple], float]:
        status, text = server.get("/metrics")
        assert status == 200
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    model = (("model", server.model),)
    success = ("goodput_requests_total", (*model, ("outcome", "success")))
    ttft_count = ("goodput_time_to_first_token_seconds_count", model)
    before = samples()
    openai_client.completions.create(
        model=server.model, prompt="Count me", max_tokens=3, extra_body={"ignore_eos": True}
    )
    after = samples()
    assert after[success] == before.get(success, 0) + 1
    assert after[ttft_count] == before.get(ttft_count, 0) + 1
    assert (
        after[("goodput_generation_tokens_total", model)]
        >= before.get(("goodput_generation_tokens_total", model), 0) + 3
    )
    # a bucket boundary sits exactly at the configured TTFT objective (0.5 s)
    assert ("goodput_time_to_first_token_seconds_bucket", (("le", "0.5"), *model)) in after
    assert after[("goodput_slo_ttft_seconds", model)] == 0.5


async def test_client_leaving_a_stream_aborts_it_and_frees_its_blocks(long_server) -> None:
    aborted = long_server.metric("goodput_requests_total", outcome="abort")
    generated = long_server.metric("goodput_generation_tokens_total")
    body = {"model": long_server.model, **LONG, "stream": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{long_server.url}/v1/completions", json=body)
        first = await response.content.readuntil(b"\n\n")
        assert json.loads(first[len(b"data: ") :])["object"] == "text_completion"
        assert long_server.engine.num_free_blocks < long_server.engine.num_total_blocks
        response.close()
    await asyncio.to_thread(long_server.wait_idle, 10)
    assert long_server.metric("goodput_requests_total", outcome="abort") == aborted + 1
    assert long_server.metric("goodput_generation_tokens_total") - generated < LONG["max_tokens"]


async def test_client_giving_up_on_a_whole_response_aborts_it(long_server) -> None:
    aborted = long_server.metric("goodput_requests_total", outcome="abort")
    body = {"model": long_server.model, **LONG}
    async with aiohttp.ClientSession() as http:

        async def ask() -> None:
            async with http.post(f"{long_server.url}/v1/completions", json=body) as response:
                await response.read()

        waiting = asyncio.ensure_future(ask())
        while not long_server.engine.num_streams:
            await asyncio.sleep(0.01)
        waiting.cancel()  # the client hangs up before the answer is ready
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await asyncio.to_thread(long_server.wait_idle, 10)
    assert long_server.metric("goodput_requests_total", outcome="abort") == aborted + 1


async def test_stop_turns_health_503_and_aborts_what_outlives_the_grace(make_server, read_sse) -> None:
    closing = make_server(shutdown_grace=0.3, max_model_len=2048, kv_cache_memory=2 << 20)
    body = {"model": closing.model, **LONG, "stream": True}
    async with aiohttp.ClientSession() as http:
        response = await http.post(f"{closing.url}/v1/completions", json=body)
        await response.content.readuntil(b"\n\n")
        closing.request_stop()
        while (health := await asyncio.to_thread(closing.get, "/health"))[0] == 200:
            await asyncio.sleep(0.01)
        assert health == (503, {"status": "draining"})
        async with http.post(f"{closing.url}/v1/completions", json={**body, "stream": False}) as refused:
            assert refused.status == 503
            assert (await refused.json())["error"]["code"] == "shutting_down"
        events = await read_sse(response)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
    await asyncio.to_thread(closing.thread.join, 30)
    assert closing.exit_code == 0


class FreezingServer(ServerThread):
    """The server as the command line starts it: the heap frozen once the engine is up."""

    def serve_options(self) -> dict:
        return {"freeze_heap": True}


def test_a_started_server_keeps_the_model_out_of_the_collectors_scans(tiny_model_dir) -> None:
    gc.unfreeze()
    running = FreezingServer(tiny_model_dir).start()
    try:
        assert gc.get_freeze_count() > 10_000
        # a full collection while serving walks what requests create, not the model's modules,
        # parameters and tokenizer
        scanned = {id(obj) for obj in gc.get_objects()}
        model = running.engine.core.runner.model
        assert id(model) not in scanned and not any(id(m) in scanned for m in model.modules())
        client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0, timeout=60)
        answer = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4)
        assert answer.usage.completion_tokens == 4
    finally:
        running.stop()
        gc.unfreeze()  # the objects of this test process go back to the collector
