"""A stream that survives its replica: six real runtime processes behind one gateway; the replica serving
a greedy stream is SIGKILLed mid-stream, and the client (the openai SDK, or the anthropic SDK for
Messages) receives one unbroken stream whose text equals an uninterrupted run's, taken up on another
replica from the tokens already produced. With no other replica left the stream ends with the clean
`upstream_lost` error event, as a stream that cannot be resumed always did."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import openai
import pytest
from gateway_helpers import metric
from resume_env import MESSAGES, kill_the_serving_replica, replicas_behind_a_gateway

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 900, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume")
    with replicas_behind_a_gateway(tiny_model_dir, workdir, replicas=6) as (gateway, pods):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
        yield gateway, pods, client


def chat_text(client, *, kill_after: int | None = None, pods=None, **extra) -> tuple[str, int, float, list]:
    """The streamed text; the largest gap between chunks after the kill; the chunks' ids."""
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY, **extra)
    parts, ids, chunks, gap, last = [], set(), 0, 0.0, time.monotonic()
    for chunk in stream:
        now = time.monotonic()
        chunks += 1
        ids.add(chunk.id)
        if kill_after is not None and chunks > kill_after:
            gap = max(gap, now - last)
        last = now
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            assert not hasattr(chunk.choices[0], "token_ids") or chunk.choices[0].model_extra.get("token_ids") is None
        assert "prompt_token_ids" not in (chunk.model_extra or {})
        if chunks == kill_after:
            kill_the_serving_replica(pods)
            last = time.monotonic()
    return "".join(parts), chunks, gap, sorted(ids)


def test_a_chat_stream_goes_on_on_another_replica_with_the_same_text(env):
    gateway, pods, client = env
    whole, _, _, _ = chat_text(client)
    assert len(whole) > 200
    text, chunks, gap, ids = chat_text(client, kill_after=5, pods=pods)
    assert text == whole and len(ids) == 1 and chunks > 5
    assert gateway.metric("goodput_gateway_streams_resumed_total", service="tiny") == 1
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 0
    print(f"chat: largest gap between chunks after the kill {gap * 1000:.0f} ms")


def test_a_completion_stream_with_usage_goes_on_with_the_same_text_and_counts(env):
    gateway, pods, client = env
    body = {"model": "tiny", "prompt": "Once upon a time", "stream": True, "stream_options": {"include_usage": True}}
    asked = {**GREEDY, "extra_body": {"ignore_eos": True, "return_token_ids": True}}  # the client's own ids
    whole = "".join(c.choices[0].text for c in client.completions.create(**body, **asked) if c.choices)
    parts, ids, prompts, usage = [], [], [], None
    for seen, chunk in enumerate(client.completions.create(**body, **asked), 1):
        extra = chunk.model_extra or {}
        if "prompt_token_ids" in extra:
            prompts.append(extra["prompt_token_ids"])
        if chunk.choices:
            parts.append(chunk.choices[0].text)
            ids.extend(chunk.choices[0].model_extra["token_ids"])
        if chunk.usage is not None:
            usage = chunk.usage
        if seen == 5:
            kill_the_serving_replica(pods)
    assert "".join(parts) == whole
    assert len(prompts) == 1 and len(ids) == 900
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(prompts[0]), 900)
    assert gateway.metric("goodput_gateway_streams_resumed_total", service="tiny") == 2


def test_a_responses_stream_goes_on_with_the_same_text(env):
    gateway, pods, client = env

    def events(kill_after: int | None = None) -> tuple[str, list[str]]:
        deltas, kinds = [], []
        stream = client.responses.create(
            model="tiny", input="Tell me a long story", stream=True, max_output_tokens=900, temperature=0, store=False
        )
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
                if len(deltas) == kill_after:
                    kill_the_serving_replica(pods)
        return "".join(deltas), kinds

    whole, unbroken = events()
    assert len(whole) > 100
    text, kinds = events(kill_after=5)
    assert text == whole and kinds[-1] == unbroken[-1] and "response.failed" not in kinds
    assert gateway.metric("goodput_gateway_streams_resumed_total", service="tiny") == 3


def test_a_messages_stream_goes_on_with_the_same_text(env):
    gateway, pods, _ = env
    client = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=60)

    def events(kill_after: int | None = None) -> tuple[str, list[str], str | None]:
        deltas, kinds = [], []
        with client.messages.stream(
            model="tiny", max_tokens=900, messages=MESSAGES, extra_body={"temperature": 0}
        ) as stream:
            for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    deltas.append(event.delta.text)
                    if len(deltas) == kill_after:
                        kill_the_serving_replica(pods)
            final = stream.get_final_message()
        return "".join(deltas), kinds, final.stop_reason

    whole, unbroken, reason = events()
    assert len(whole) > 100
    text, kinds, resumed_reason = events(kill_after=5)
    assert text == whole and resumed_reason == reason and kinds[-1] == unbroken[-1] == "message_stop"
    assert "error" not in kinds
    assert gateway.metric("goodput_gateway_streams_resumed_total", service="tiny") == 4


def test_sixteen_concurrent_streams_lose_nothing_when_one_of_two_replicas_dies(env):
    gateway, pods, client = env
    assert sum(p.process.poll() is None for p in pods) == 2
    prompts = [f"Story number {i}: " * (1 + i % 4) for i in range(16)]
    body = {"model": "tiny", "stream": True, "temperature": 0, "max_tokens": 300, "extra_body": {"ignore_eos": True}}
    started = threading.Semaphore(0)

    def run(prompt: str, count: bool) -> str:
        parts = []
        for seen, chunk in enumerate(client.completions.create(prompt=prompt, **body), 1):
            parts.append(chunk.choices[0].text if chunk.choices else "")
            if count and seen == 3:
                started.release()
        return "".join(parts)

    with ThreadPoolExecutor(16) as pool:
        unbroken = list(pool.map(lambda p: run(p, False), prompts))
        before = gateway.metric("goodput_gateway_streams_resumed_total", service="tiny")
        jobs = [pool.submit(run, p, True) for p in prompts]
        for _ in range(8):  # half the streams have their first chunks
            assert started.acquire(timeout=60)
        live = [p for p in pods if p.process.poll() is None]
        running = [metric(f"http://127.0.0.1:{p.port}", "goodput_requests_running") for p in live]
        victim = live[running.index(max(running))]
        victim.process.kill()
        outputs = [j.result(timeout=120) for j in jobs]  # any error the client saw raises here
    assert outputs == unbroken
    resumed = gateway.metric("goodput_gateway_streams_resumed_total", service="tiny") - before
    assert 1 <= resumed <= 16
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 0
    print(f"16 streams: {resumed:.0f} resumed, none lost")


def test_a_stream_with_no_other_replica_ends_with_the_lost_error(env):
    gateway, pods, client = env
    assert sum(p.process.poll() is None for p in pods) == 1
    with pytest.raises(openai.APIError) as info:
        chat_text(client, kill_after=5, pods=pods)
    assert info.value.code == "upstream_lost" and "went away" in info.value.message
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 1
    resumed = gateway.metric("goodput_gateway_streams_resumed_total", service="tiny")
    seconds = gateway.metric("goodput_gateway_stream_resume_seconds_sum", service="tiny")
    assert gateway.metric("goodput_gateway_stream_resume_seconds_count", service="tiny") == resumed
    print(f"resume: loss to the new replica's first bytes, mean of {resumed:.0f}: {seconds / resumed * 1000:.0f} ms")
