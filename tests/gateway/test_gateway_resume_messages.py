"""A Messages stream with `stop_sequences` survives its replica: real runtime processes behind one gateway,
the replica serving a greedy Messages stream (the anthropic SDK) SIGKILLed mid-stream. The gateway matches
the stop sequences itself and counts the tokens of an answer cut there from their ids; after the stream is
taken up on another replica the client's text, stop reason, matched sequence and usage equal an unbroken
run's."""

from __future__ import annotations

import anthropic
import pytest
from resume_env import MESSAGES, kill_the_serving_replica, replicas_behind_a_gateway

pytestmark = pytest.mark.slow

STOP_CHARS = 12


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("resume-messages")
    with replicas_behind_a_gateway(tiny_model_dir, workdir, replicas=2) as (gateway, pods):
        client = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=60)
        yield gateway, pods, client


def stop_in(whole: str) -> str:
    """A sequence first found two thirds of the way into `whole`: the stream ends there, well after a kill."""
    for start in range(len(whole) * 2 // 3, len(whole) - STOP_CHARS):
        stop = whole[start : start + STOP_CHARS]
        if whole.find(stop) == start and stop.strip():
            return stop
    raise AssertionError("no stop sequence found in the unbroken text")


def test_a_messages_stream_with_stop_sequences_goes_on_with_the_same_answer(env):
    gateway, pods, client = env

    def run(kill_after: int | None = None, **extra) -> tuple[str, str | None, str | None, int, list[str]]:
        deltas, kinds = [], []
        with client.messages.stream(
            model="tiny", max_tokens=600, messages=MESSAGES, extra_body={"temperature": 0}, **extra
        ) as stream:
            for event in stream:
                kinds.append(event.type)
                if event.type == "content_block_delta" and event.delta.type == "text_delta":
                    deltas.append(event.delta.text)
                    if len(deltas) == kill_after:
                        kill_the_serving_replica(pods)
            final = stream.get_final_message()
        return "".join(deltas), final.stop_reason, final.stop_sequence, final.usage.output_tokens, kinds

    whole = run()[0]
    assert len(whole) > 200
    stop = stop_in(whole)
    unbroken = run(stop_sequences=["never in this text, a sequence", stop])
    assert unbroken[:3] == (whole[: whole.find(stop)], "stop_sequence", stop) and unbroken[3] > 0
    lost = gateway.metric("goodput_gateway_streams_lost_total", service="tiny")
    text, reason, sequence, tokens, kinds = run(kill_after=5, stop_sequences=["never in this text, a sequence", stop])
    assert (text, reason, sequence, tokens) == unbroken[:4]
    assert "error" not in kinds and kinds[-1] == "message_stop"
    assert gateway.metric("goodput_gateway_streams_resumed_total", service="tiny") == 1
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == lost
