"""Two defects fuzzing found: deeply nested JSON answered 500, and a completion cut by max_tokens
inside a multi-byte character lost that character's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

POST_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"]


async def post_raw(server, path: str, data: bytes) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{server.url}{path}", data=data, headers={"Content-Type": "application/json"}) as response,
    ):
        return response.status, await response.json()


@pytest.mark.parametrize("path", POST_PATHS)
async def test_five_thousand_nested_brackets_are_a_400(server, path) -> None:
    for raw in (
        b'{"model": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # well formed, too deep
        b'{"model": ' + b"[" * 5000,  # cut off as well
        b"[" * 5000 + b"]" * 5000,
        b'{"a":' * 5000 + b"1" + b"}" * 5000,
    ):
        status, payload = await post_raw(server, path, raw)
        assert status == 400, (path, payload)
        assert payload["error"]["type"] == "invalid_request_error"
        assert payload["error"]["code"] == "invalid_json"
        assert "nest" in payload["error"]["message"] or "JSON" in payload["error"]["message"]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


DEEP_FIELDS = [
    ("/v1/completions", '{"model": "tiny", "prompt": %s}', "prompt"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "logit_bias": {"1": %s}}', "logit_bias"),
    ("/v1/completions", '{"model": "tiny", "prompt": "x", "stop": %s}', "stop"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": %s, "content": "x"}]}', "messages[0].role"),
    (
        "/v1/chat/completions",
        '{"model": "tiny", "messages": [{"role": "user", "content": %s}]}',
        "messages[0].content[0]",
    ),
    ("/v1/embeddings", '{"model": "tiny", "input": %s}', "input[0]"),
    ("/v1/embeddings", '{"model": "tiny", "input": "x", "encoding_format": %s}', "encoding_format"),
    ("/tokenize", '{"model": %s, "prompt": "x"}', "model"),
    ("/detokenize", '{"model": "tiny", "tokens": %s}', "tokens"),
]


@pytest.mark.parametrize(("path", "template", "param"), DEEP_FIELDS, ids=[f"{p}-{f}" for p, _, f in DEEP_FIELDS])
async def test_deep_values_that_still_parse_are_a_400_naming_the_field(server, path, template, param) -> None:
    raw = (template % nested(900)).encode()
    json.loads(raw)  # within the parser's limit: the field's own check must refuse it
    status, payload = await post_raw(server, path, raw)
    assert status == 400, payload
    assert payload["error"]["param"] == param
    assert len(payload["error"]["message"]) < 400


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def completion_texts(server, read_sse, path: str, body: dict) -> tuple[str, str, str, str]:
    """(whole text, streamed text concatenated, whole finish reason, streamed finish reason)."""

    def text_of(choice: dict) -> str:
        return choice["text"] if "text" in choice else (choice.get("message") or choice["delta"]).get("content") or ""

    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}{path}", json=body) as response:
            assert response.status == 200
            [choice] = (await response.json())["choices"]
        async with http.post(f"{server.url}{path}", json={**body, "stream": True}) as response:
            events = await read_sse(response)
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    return text_of(choice), "".join(text_of(c) for c in chunks), choice["finish_reason"], chunks[-1]["finish_reason"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_a_cut_inside_a_character_ends_in_replacement_characters(server, read_sse, tokenizer, path) -> None:
    # the byte-level token of 0xE4 alone: the first byte of a three-byte character (U+4000 to U+4FFF)
    lead = tokenizer.convert_tokens_to_ids(chr(0xE4))
    assert tokenizer.decode([lead]) == "\ufffd"
    prompt = {"prompt": "Hello"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    for max_tokens in (1, 2, 5):
        body = {
            "model": server.model,
            **prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logit_bias": {str(lead): 100},
            "ignore_eos": True,
        }
        whole, streamed, reason, streamed_reason = await completion_texts(server, read_sse, path, body)
        # what transformers' decode of the generated tokens gives: the cut bytes as U+FFFD, none dropped
        assert whole == tokenizer.decode([lead] * max_tokens) == "\ufffd" * max_tokens
        assert streamed == whole
        assert reason == streamed_reason == "length"
