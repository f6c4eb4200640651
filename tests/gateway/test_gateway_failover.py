"""A replica killed mid-stream, behind the gateway: the client's stream ends with a clear error event in its
API's shape, never a silent cut, and the loss is counted. (Resuming the stream on another replica is not
built: it needs the runtime to continue from the produced tokens.) Real runtime processes, SIGKILLed."""

from __future__ import annotations

import anthropic
import openai
import pytest
from gateway_helpers import Started, wait_ready

pytestmark = pytest.mark.slow

LONG = {"max_tokens": 400, "extra_body": {"ignore_eos": True}}


@pytest.fixture
def env(tiny_model_dir, tmp_path):
    with Started() as started:
        replica = started.replica("victim", tiny_model_dir, tmp_path)
        wait_ready(replica)
        gateway = started.gateway(
            tmp_path / "no-kubeconfig",
            tmp_path / "gateway.log",
            "--static-model",
            f"tiny=http://127.0.0.1:{replica.port}",
            "--shutdown-delay",
            "0",
        )
        yield gateway, replica


def test_chat_completions_stream_ends_with_an_error_event(env):
    gateway, replica = env
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], stream=True, **LONG
    )
    seen = 0
    with pytest.raises(openai.APIError) as info:
        for _chunk in stream:
            seen += 1
            if seen == 5:
                replica.process.kill()
    assert 5 <= seen < 400
    assert "went away" in info.value.message and info.value.code == "upstream_lost"
    assert gateway.metric("goodput_gateway_streams_lost_total", service="tiny") == 1


def test_responses_stream_ends_with_response_failed(env):
    gateway, replica = env
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
    kinds = []
    stream = client.responses.create(
        model="tiny", input="Hi", stream=True, max_output_tokens=400, temperature=0, store=False
    )
    for event in stream:
        kinds.append(event.type)
        if kinds.count("response.output_text.delta") == 5:
            replica.process.kill()
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds
    assert "went away" in event.response.error.message


def test_messages_stream_ends_with_an_error_event(env):
    gateway, replica = env
    client = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=60)
    deltas = 0
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(
            model="tiny", max_tokens=400, messages=[{"role": "user", "content": "Hi"}], extra_body={"temperature": 0}
        ) as stream,
    ):
        for event in stream:
            if event.type == "content_block_delta":
                deltas += 1
                if deltas == 5:
                    replica.process.kill()
    assert deltas >= 5 and "went away" in str(info.value)
