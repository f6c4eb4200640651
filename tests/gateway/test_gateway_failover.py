"""A replica killed mid-stream, behind the gateway: the client's stream ends with a clear error event in its
API's shape, never a silent cut, and the loss is counted, where no other replica can take the stream up
(test_gateway_resume.py covers resumption). Real runtime processes, SIGKILLed."""

from __future__ import annotations

import anthropic
import openai
import pytest
from gateway_helpers import Started, wait_ready

pytestmark = pytest.mark.slow

# The tiny model makes about a thousand tokens a second: a stream of 2,000 outlasts a client slowed by a
# busy machine, and each test kills its replica at the first delta, while most of the stream is still to come.
TOKENS = 2000
LONG = {"max_tokens": TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def replicas(tiny_model_dir, tmp_path_factory):
    """One gateway and a replica for each test to kill, started together; each serves its own model name."""
    workdir = tmp_path_factory.mktemp("failover")
    with Started() as started:
        pods = {
            name: started.replica(
                name, tiny_model_dir, workdir, "--served-model-name", name, "--max-model-len", str(TOKENS + 64)
            )
            for name in ("chat", "responses", "messages")
        }
        wait_ready(*pods.values())
        args = [a for name, pod in pods.items() for a in ("--static-model", f"{name}=http://127.0.0.1:{pod.port}")]
        gateway = started.gateway(workdir / "no-kubeconfig", workdir / "gateway.log", *args, "--shutdown-delay", "0")
        yield gateway, pods


@pytest.fixture
def env(replicas, request):
    gateway, pods = replicas
    return gateway, pods[request.param]


@pytest.mark.parametrize("env", ["chat"], indirect=True)
def test_chat_completions_stream_ends_with_an_error_event(env):
    gateway, replica = env
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "Hi"}], stream=True, **LONG
    )
    seen = 0
    with pytest.raises(openai.APIError) as info:
        for _chunk in stream:
            seen += 1
            if seen == 1:
                replica.process.kill()
    assert 1 <= seen < TOKENS
    assert "went away" in info.value.message and info.value.code == "upstream_lost"
    assert gateway.metric("goodput_gateway_streams_lost_total", service="chat") == 1


@pytest.mark.parametrize("env", ["responses"], indirect=True)
def test_responses_stream_ends_with_response_failed(env):
    gateway, replica = env
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)
    kinds = []
    stream = client.responses.create(
        model="responses", input="Hi", stream=True, max_output_tokens=TOKENS, temperature=0, store=False
    )
    for event in stream:
        kinds.append(event.type)
        if kinds.count("response.output_text.delta") == 1:
            replica.process.kill()
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds
    assert "went away" in event.response.error.message


@pytest.mark.parametrize("env", ["messages"], indirect=True)
def test_messages_stream_ends_with_an_error_event(env):
    gateway, replica = env
    client = anthropic.Anthropic(base_url=gateway.url, api_key="k", max_retries=0, timeout=60)
    deltas = 0
    with (
        pytest.raises(anthropic.APIStatusError) as info,
        client.messages.stream(
            model="messages",
            max_tokens=TOKENS,
            messages=[{"role": "user", "content": "Hi"}],
            extra_body={"temperature": 0},
        ) as stream,
    ):
        for event in stream:
            if event.type == "content_block_delta":
                deltas += 1
                if deltas == 1:
                    replica.process.kill()
    assert 1 <= deltas < TOKENS and "went away" in str(info.value)
