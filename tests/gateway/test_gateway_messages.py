"""Anthropic's Messages API at the gateway, through the real `anthropic` SDK and LangChain's ChatAnthropic,
in front of a real runtime process (a tiny random-weight model)."""

from __future__ import annotations

import anthropic
import pytest
from gateway_helpers import Started, post_json, wait_ready

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
        "required": ["city"],
    },
}
GREEDY = {"temperature": 0}  # this SDK no longer names the sampling fields; the API still takes them
ASK = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def gateway(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("messages")
    with Started() as started:
        replica = started.replica("r0", tiny_model_dir, workdir)
        wait_ready(replica)
        yield started.gateway(
            workdir / "no-kubeconfig",
            workdir / "gateway.log",
            "--static-model",
            f"tiny=http://127.0.0.1:{replica.port}",
            "--shutdown-delay",
            "0",
        )


def client(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="sk-ant-test", max_retries=0, timeout=60)


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_text_whole_and_streamed_with_system_and_usage(gateway):
    c = client(gateway)
    whole = c.messages.create(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY)
    assert whole.type == "message" and whole.role == "assistant" and whole.content[0].type == "text"
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert 0 < whole.usage.output_tokens <= 8 and whole.usage.input_tokens > 0
    told = c.messages.create(model="tiny", max_tokens=8, messages=ASK, system="Answer in one word.", extra_body=GREEDY)
    assert told.usage.input_tokens > whole.usage.input_tokens  # the system prompt reached the model

    kinds = []
    with c.messages.stream(model="tiny", max_tokens=8, messages=ASK, extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(kinds)
    assert text_of(final) == text_of(whole)  # greedy: the same words streamed or whole
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.stop_reason == whole.stop_reason


def test_stop_sequences_end_the_answer_and_are_named(gateway):
    c = client(gateway)
    full = text_of(c.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY))
    assert len(full) > 12, full
    stop = full[8:11]
    expected = full[: full.find(stop)]
    cut = c.messages.create(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY, stop_sequences=["@@@", stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert text_of(cut) == expected
    assert 0 < cut.usage.output_tokens < 24 and cut.usage.input_tokens > 0
    with c.messages.stream(model="tiny", max_tokens=24, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]) as s:
        streamed = s.get_final_message()
    assert text_of(streamed) == expected and streamed.stop_sequence == stop
    assert streamed.usage.output_tokens == cut.usage.output_tokens
    assert streamed.usage.input_tokens == cut.usage.input_tokens


def test_a_tool_use_and_its_result(gateway):
    c = client(gateway)
    forced = {"type": "tool", "name": "get_weather"}
    asked = [{"role": "user", "content": "Weather in Paris?"}]
    called = c.messages.create(
        model="tiny", max_tokens=64, messages=asked, tools=[WEATHER], tool_choice=forced, extra_body=GREEDY
    )
    use = next(block for block in called.content if block.type == "tool_use")
    assert called.stop_reason == "tool_use" and use.name == "get_weather" and use.input["city"] in ("Paris", "Oslo")

    answered = c.messages.create(
        model="tiny",
        max_tokens=6,
        tools=[WEATHER],
        messages=[
            *asked,
            {"role": "assistant", "content": [block.model_dump() for block in called.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]},
        ],
        tool_choice={"type": "none"},
    )
    assert answered.content[0].type == "text"
    assert answered.usage.input_tokens > called.usage.input_tokens  # the call and its result reached the model

    with c.messages.stream(
        model="tiny", max_tokens=64, messages=asked, tools=[WEATHER], tool_choice=forced, extra_body=GREEDY
    ) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert "input_json" in kinds or any(k == "content_block_delta" for k in kinds)
    streamed_use = next(block for block in final.content if block.type == "tool_use")
    assert streamed_use.input == use.input and final.stop_reason == "tool_use"


def test_errors_come_in_anthropics_shape(gateway):
    status, _, body = post_json(gateway.url + "/v1/messages", {"model": "tiny", "messages": ASK})
    assert status == 400 and body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    for extra, named in (
        ({"metadata": {"user_id": "u"}}, "metadata"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ):
        status, _, body = post_json(
            gateway.url + "/v1/messages", {"model": "tiny", "max_tokens": 4, "messages": ASK, **extra}
        )
        assert status == 400 and body["error"]["type"] == "invalid_request_error", body
        assert body["error"]["message"].startswith(named), body
    with pytest.raises(anthropic.NotFoundError) as info:
        client(gateway).messages.create(model="nope", max_tokens=4, messages=ASK)
    assert info.value.body["error"]["type"] == "not_found_error"


def test_langchain_chat_anthropic_at_the_gateway(gateway):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    model = langchain_anthropic.ChatAnthropic(
        model="tiny", base_url=gateway.url, api_key="sk-ant-test", max_tokens=8, temperature=0, max_retries=0
    )
    reply = model.invoke("Hello there")
    assert isinstance(reply.content, str) and reply.usage_metadata["output_tokens"] > 0
    chunks = list(model.stream("Hello there"))
    assert "".join(c.content if isinstance(c.content, str) else "" for c in chunks) == reply.content
