"""Streams with stop strings survive their replica: real runtime processes behind one gateway, the replica
serving a greedy stream SIGKILLed mid-stream while text is held back for a possible stop string. The runtime
reports a token's id only once its text has been sent, so the gateway takes the stream up from those ids on
another replica, which generates the held-back tokens again: the client's text and finish reason equal an
unbroken run's (the openai SDK's chat and completion streams). A stream that cannot be resumed ends with the
`upstream_lost` error event naming the field (test_gateway_resume_structured.py, with tools)."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest
from resume_env import MESSAGES, kill_the_serving_replica, replicas_behind_a_gateway, resumed
from transformers import AutoTokenizer

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 900}
PROMPT = "Once upon a time"
STOP_CHARS = 12  # the last 11 characters of the text are always held back while the stream runs


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume-stops")
    with replicas_behind_a_gateway(tiny_model_dir, workdir) as (gateway, pods):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
        yield gateway, pods, client


def stop_in(whole: str) -> str:
    """A stop string first found two thirds of the way into `whole`: the stream ends there, well after a kill."""
    for start in range(len(whole) * 2 // 3, len(whole) - STOP_CHARS):
        stop = whole[start : start + STOP_CHARS]
        if whole.find(stop) == start and stop.strip():
            return stop
    raise AssertionError("no stop string found in the unbroken text")


def test_the_ids_a_stream_reports_are_the_tokens_of_the_text_sent(env, tiny_model_dir):
    """Straight to a replica: at every chunk but the last text, the ids reported so far decode to the text
    sent so far. The last text ends where the stop string begins, inside a token it may be, and its chunk
    carries the ids of the stop string's tokens too (as vLLM's does)."""
    _, pods, client = env
    whole = client.completions.create(model="tiny", prompt=PROMPT, **GREEDY, extra_body={"ignore_eos": True})
    whole = whole.choices[0].text
    stop = stop_in(whole)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    body = {"model": "tiny", "prompt": PROMPT, **GREEDY, "stream": True, "stop": [stop], "ignore_eos": True}
    body["return_token_ids"] = True
    request = urllib.request.Request(
        f"http://127.0.0.1:{pods[0].port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    prompt, ids, text, seen, reason = [], [], "", [], None
    with urllib.request.urlopen(request, timeout=60) as answer:
        assert answer.headers["x-goodput-token-ids"] == "shown"
        for line in answer:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            prompt = chunk.get("prompt_token_ids", prompt)
            for choice in chunk["choices"]:
                ids += choice["token_ids"]
                text += choice["text"]
                reason = choice["finish_reason"] or reason
                if choice["finish_reason"] is None:
                    seen.append((len(ids), len(text)))
    assert reason == "stop" and text == whole[: whole.find(stop)]
    head = tokenizer.decode(prompt, skip_special_tokens=True)
    for num_ids, num_chars in seen[:-1]:
        assert tokenizer.decode(prompt + ids[:num_ids], skip_special_tokens=True)[len(head) :] == text[:num_chars]
    assert len(seen) > 10
    # the last chunks: every output token's id has come, the stop string's included
    assert tokenizer.decode(prompt + ids, skip_special_tokens=True)[len(head) :].startswith(text)


def test_a_chat_stream_with_a_stop_string_goes_on_with_the_same_text(env):
    gateway, pods, client = env

    def run(kill_after: int | None = None, **extra) -> tuple[str, str | None]:
        parts, reason = [], None
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True, **GREEDY, **extra)
        for seen, chunk in enumerate(stream, 1):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts), reason

    whole, _ = run(extra_body={"ignore_eos": True})
    stop = stop_in(whole)
    unbroken, reason = run(stop=[stop], extra_body={"ignore_eos": True})
    assert unbroken == whole[: whole.find(stop)] and reason == "stop"
    before = resumed(gateway)
    text, resumed_reason = run(kill_after=5, stop=[stop], extra_body={"ignore_eos": True})
    assert (text, resumed_reason) == (unbroken, "stop")
    assert resumed(gateway) == before + 1
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 0


def test_a_completion_stream_with_stop_strings_and_usage_goes_on_with_the_same_text(env):
    gateway, pods, client = env
    body = {"model": "tiny", "prompt": PROMPT, "stream": True, **GREEDY, "stream_options": {"include_usage": True}}

    def run(kill_after: int | None = None, **extra) -> tuple[str, str | None, int | None]:
        parts, reason, tokens = [], None, None
        for seen, chunk in enumerate(client.completions.create(**body, **extra), 1):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts), reason, tokens

    whole, _, _ = run(extra_body={"ignore_eos": True})
    stops = [stop_in(whole), "never in this text, a stop string"]
    unbroken = run(stop=stops, extra_body={"ignore_eos": True})
    assert unbroken[:2] == (whole[: whole.find(stops[0])], "stop")
    before = resumed(gateway)
    assert run(kill_after=5, stop=stops, extra_body={"ignore_eos": True}) == unbroken
    assert resumed(gateway) == before + 1
