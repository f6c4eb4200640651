"""Streams with logprobs survive their replica: real runtime processes behind one gateway, the replica
serving a greedy stream SIGKILLed mid-stream. The continuation asks for its tokens' logprobs, in the chat
shape for a chat stream (token, logprob, bytes, top_logprobs), and a completion stream's text offsets go on
past the text the client had: the client's text, tokens and logprobs equal an unbroken run's (the openai
SDK's chat and completion streams)."""

from __future__ import annotations

import openai
import pytest
from resume_env import MESSAGES, kill_the_serving_replica, replicas_behind_a_gateway, resumed

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 300}
CLOSE = 1e-5


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume-logprobs")
    with replicas_behind_a_gateway(tiny_model_dir, workdir) as (gateway, pods):
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
        yield gateway, pods, client


def logprob_values(entries: list[dict]) -> list[float]:
    return [e["logprob"] for e in entries] + [t["logprob"] for e in entries for t in e["top_logprobs"]]


def without_values(entries: list[dict]) -> list[dict]:
    """The entries' tokens and bytes, their own and their top logprobs', in order."""
    return [
        {
            "token": e["token"],
            "bytes": e["bytes"],
            "top": [(t["token"], t["bytes"]) for t in e["top_logprobs"]],
        }
        for e in entries
    ]


def test_a_chat_stream_with_logprobs_goes_on_with_the_same_tokens_and_logprobs(env):
    gateway, pods, client = env

    def run(kill_after: int | None = None) -> tuple[str, list[dict]]:
        parts, entries = [], []
        stream = client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            stream=True,
            logprobs=True,
            top_logprobs=3,
            **GREEDY,
            extra_body={"ignore_eos": True},
        )
        for seen, chunk in enumerate(stream, 1):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                if chunk.choices[0].logprobs is not None:
                    entries.extend(e.model_dump() for e in chunk.choices[0].logprobs.content or [])
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts), entries

    text, entries = run()
    assert len(entries) == 300 and all(len(e["top_logprobs"]) == 3 for e in entries)
    before = resumed(gateway)
    text_after, entries_after = run(kill_after=5)
    assert resumed(gateway) == before + 1
    assert text_after == text
    assert without_values(entries_after) == without_values(entries)
    assert logprob_values(entries_after) == pytest.approx(logprob_values(entries), abs=CLOSE)
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 0


def test_an_echoed_completion_stream_with_logprobs_goes_on_with_its_offsets(env):
    gateway, pods, client = env
    body = {"model": "tiny", "prompt": "Once upon a time", "stream": True, "echo": True, "logprobs": 2, **GREEDY}
    extra = {"ignore_eos": True, "return_token_ids": True}

    def run(kill_after: int | None = None) -> tuple[str, list[int], dict[str, list]]:
        parts, ids, logprobs = [], [], {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for seen, chunk in enumerate(client.completions.create(**body, extra_body=extra), 1):
            if chunk.choices:
                parts.append(chunk.choices[0].text)
                ids.extend(chunk.choices[0].model_extra["token_ids"])
                if chunk.choices[0].logprobs is not None:
                    for key, values in chunk.choices[0].logprobs.model_dump().items():
                        logprobs.setdefault(key, []).extend(values or [])
            if seen == kill_after:
                kill_the_serving_replica(pods)
        return "".join(parts), ids, logprobs

    text, ids, logprobs = run()
    assert len(ids) == 300 and len(logprobs["tokens"]) > 300  # the echoed prompt's come first
    assert logprobs["text_offset"][-1] + len(logprobs["tokens"][-1]) == len("".join(logprobs["tokens"]))
    before = resumed(gateway)
    text_after, ids_after, logprobs_after = run(kill_after=5)
    assert resumed(gateway) == before + 1
    assert (text_after, ids_after) == (text, ids)
    assert logprobs_after["tokens"] == logprobs["tokens"]
    assert logprobs_after["text_offset"] == logprobs["text_offset"]
    assert logprobs_after["token_logprobs"][1:] == pytest.approx(logprobs["token_logprobs"][1:], abs=CLOSE)
    assert [list(top) for top in logprobs_after["top_logprobs"][1:]] == [
        list(top) for top in logprobs["top_logprobs"][1:]
    ]
    for top_after, top in zip(logprobs_after["top_logprobs"][1:], logprobs["top_logprobs"][1:], strict=True):
        assert list(top_after.values()) == pytest.approx(list(top.values()), abs=CLOSE)
