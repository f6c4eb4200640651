"""/tokenize and /detokenize in vLLM's shapes, and /v1/models carrying max_model_len."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def post(server, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(f"{server.url}{path}", json=body) as response:
        return response.status, await response.json()


async def test_tokenize_a_prompt(server, tokenizer) -> None:
    status, result = await post(server, "/tokenize", {"model": server.model, "prompt": "Hello world, again"})
    assert status == 200
    expected = tokenizer("Hello world, again").input_ids
    assert result == {"count": len(expected), "max_model_len": 256, "tokens": expected, "token_strs": None}
    status, named = await post(server, "/tokenize", {"prompt": "Hello world, again", "return_token_strs": True})
    assert status == 200  # the model may be left out, as with vLLM
    assert named["token_strs"] == tokenizer.convert_ids_to_tokens(expected)


async def test_tokenized_messages_are_what_chat_completions_sends(server, openai_client, tokenizer) -> None:
    status, result = await post(server, "/tokenize", {"model": server.model, "messages": MESSAGES})
    assert status == 200
    chat = openai_client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1)
    assert result["count"] == chat.usage.prompt_tokens == len(result["tokens"])
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert result["tokens"] == tokenizer(text, add_special_tokens=False).input_ids
    status, bare = await post(
        server, "/tokenize", {"model": server.model, "messages": MESSAGES, "add_generation_prompt": False}
    )
    assert status == 200
    assert bare["count"] < result["count"]  # without the assistant's opening
    assert result["tokens"][: bare["count"]] == bare["tokens"]
    continued = [*MESSAGES, {"role": "assistant", "content": "Hi, I am"}]
    status, cont = await post(
        server,
        "/tokenize",
        {"model": server.model, "messages": continued, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert status == 200
    status, text = await post(server, "/detokenize", {"model": server.model, "tokens": cont["tokens"]})
    assert text["prompt"].endswith("Hi, I am")  # left open for the model to go on


async def test_detokenize_round_trip(server, tokenizer) -> None:
    prompt = "Ünïcödé and plain text"
    status, tokens = await post(server, "/tokenize", {"model": server.model, "prompt": prompt})
    assert status == 200
    status, result = await post(server, "/detokenize", {"model": server.model, "tokens": tokens["tokens"]})
    assert status == 200
    assert result == {"prompt": prompt}


async def test_models_carry_max_model_len(server) -> None:
    status, listing = server.get("/v1/models")
    assert status == 200
    assert [m["max_model_len"] for m in listing["data"]] == [256]
    status, card = server.get(f"/v1/models/{server.model}")
    assert card["max_model_len"] == 256


BAD = [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "messages": MESSAGES}, "messages"),
    ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt"),
    ("/tokenize", {"messages": "Hello"}, "messages"),
    ("/tokenize", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, "continue_final_message"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ 1 }}"}, "chat_template"),
    ("/tokenize", {"messages": MESSAGES, "tools": []}, "tools"),
    ("/detokenize", {}, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": [1], "model": 3}, "model"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "skip_special_tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD, ids=[f"{p}-{f}" for p, _, f in BAD])
async def test_bad_request_is_a_400_naming_the_field(server, path, body, param) -> None:
    status, payload = await post(server, path, body)
    assert status == 400, payload
    assert payload["error"]["param"] == param
    assert payload["error"]["type"] == "invalid_request_error"
    assert param.split("[")[0] in payload["error"]["message"]
