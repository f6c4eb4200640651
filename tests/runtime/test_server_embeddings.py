"""/v1/embeddings over real HTTP with the official openai client: vectors equal transformers' final
hidden states pooled the same way, computed through the engine's steps beside generation."""

from __future__ import annotations

import base64
import threading
from pathlib import Path

import aiohttp
import numpy as np
import openai
import pytest
import torch
from helpers import wait_for

TOLERANCE = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """transformers' own model and tokenizer: the final hidden states (after the last norm) of an input."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def hidden(ids: list[int]) -> np.ndarray:
        with torch.inference_mode():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        return out.hidden_states[-1][0].numpy()  # [tokens, hidden]: the same as model.model(...).last_hidden_state

    hidden.tokenizer = tokenizer  # type: ignore[attr-defined]
    return hidden


def expected(reference, ids: list[int], pooling: str = "last", normalize: bool = True) -> np.ndarray:
    states = reference(ids)
    vector = states[-1] if pooling == "last" else states.mean(axis=0)
    return vector / np.linalg.norm(vector) if normalize else vector


def ids_of(reference, text: str) -> list[int]:
    return list(reference.tokenizer(text).input_ids)


def client_for(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


async def post(server, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http, http.post(f"{server.url}{path}", json=body) as response:
        return response.status, await response.json()


def test_sdk_embedding_equals_transformers_last_token_normalized(server, openai_client, reference) -> None:
    # the SDK asks for base64 unless told otherwise, and decodes it itself
    result = openai_client.embeddings.create(model=server.model, input=TEXT)
    [item] = result.data
    assert item.index == 0 and item.object == "embedding" and result.object == "list"
    assert result.model == server.model
    ids = ids_of(reference, TEXT)
    assert result.usage.prompt_tokens == result.usage.total_tokens == len(ids)
    vector = np.array(item.embedding)
    assert vector.shape == (64,)  # the tiny model's hidden size
    assert np.abs(vector - expected(reference, ids)).max() < TOLERANCE
    assert abs(np.linalg.norm(vector) - 1.0) < 1e-5
    floats = openai_client.embeddings.create(model=server.model, input=TEXT, encoding_format="float").data[0]
    assert np.abs(np.array(floats.embedding) - vector).max() < 1e-6


async def test_base64_is_little_endian_float32(server, reference) -> None:
    status, b64 = await post(
        server, "/v1/embeddings", {"model": server.model, "input": TEXT, "encoding_format": "base64"}
    )
    assert status == 200
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert len(raw) == 64 * 4
    decoded = np.frombuffer(raw, dtype="<f4")
    status, floats = await post(server, "/v1/embeddings", {"model": server.model, "input": TEXT})
    assert status == 200 and isinstance(floats["data"][0]["embedding"], list)
    assert np.array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))
    assert set(floats["usage"]) == {"prompt_tokens", "total_tokens"}


def test_lists_of_strings_and_token_ids_keep_their_order(server, openai_client, reference) -> None:
    texts = ["Hello", "A much longer input that spans more tokens than the first one", "ok"]
    result = openai_client.embeddings.create(model=server.model, input=texts, encoding_format="float")
    assert [d.index for d in result.data] == [0, 1, 2]
    ids = [ids_of(reference, t) for t in texts]
    for item, one in zip(result.data, ids, strict=True):
        assert np.abs(np.array(item.embedding) - expected(reference, one)).max() < TOLERANCE
    assert result.usage.prompt_tokens == sum(len(i) for i in ids)
    by_ids = openai_client.embeddings.create(model=server.model, input=ids[1], encoding_format="float")
    assert np.abs(np.array(by_ids.data[0].embedding) - np.array(result.data[1].embedding)).max() < 1e-6
    many = openai_client.embeddings.create(model=server.model, input=ids, encoding_format="float")
    for a, b in zip(many.data, result.data, strict=True):
        assert np.abs(np.array(a.embedding) - np.array(b.embedding)).max() < 1e-6


def test_normalize_false_returns_the_raw_hidden_state(server, openai_client, reference) -> None:
    result = openai_client.embeddings.create(
        model=server.model, input=TEXT, encoding_format="float", extra_body={"normalize": False}
    )
    vector = np.array(result.data[0].embedding)
    raw = expected(reference, ids_of(reference, TEXT), normalize=False)
    assert np.abs(vector - raw).max() < TOLERANCE
    assert abs(np.linalg.norm(vector) - 1.0) > 0.1  # it was not normalized


def test_last_token_pooling_reuses_the_prefix_cache_and_stays_exact(server, openai_client, reference) -> None:
    text = "shared prefix " * 12 + "then something else"
    ids = ids_of(reference, text)
    assert len(ids) > 32
    hits = server.metric("goodput_prefix_cache_hits_total")
    first = openai_client.embeddings.create(model=server.model, input=text, encoding_format="float")
    second = openai_client.embeddings.create(model=server.model, input=text, encoding_format="float")
    assert server.metric("goodput_prefix_cache_hits_total") > hits  # the second reused cached blocks
    for result in (first, second):
        assert np.abs(np.array(result.data[0].embedding) - expected(reference, ids)).max() < TOLERANCE
    server.wait_idle()  # every input finished and gave its blocks back


def test_mean_pooling_over_chunked_prefill_equals_transformers(make_server, reference) -> None:
    # a 16-token step budget: a long input is prefilled in many chunks whose sums are accumulated
    meaned = make_server(pooling="mean", max_num_batched_tokens=16)
    client = client_for(meaned)
    text = "Averaging every position of a long input " * 6
    ids = ids_of(reference, text)
    assert len(ids) > 3 * 16
    hits = meaned.metric("goodput_prefix_cache_hits_total")
    for normalize in (True, False, True):  # the third is the same input again: the cache is not used
        result = client.embeddings.create(
            model=meaned.model, input=text, encoding_format="float", extra_body={"normalize": normalize}
        )
        vector = np.array(result.data[0].embedding)
        assert np.abs(vector - expected(reference, ids, "mean", normalize)).max() < TOLERANCE
    assert meaned.metric("goodput_prefix_cache_hits_total") == hits
    meaned.wait_idle()


def test_embeddings_share_steps_with_generation(make_server, reference) -> None:
    busy = make_server(max_num_batched_tokens=24, max_model_len=512, kv_cache_memory=2 << 20)
    core = busy.engine.core
    steps: list[tuple[bool, bool]] = []  # per step: (an embedding input ran, a generation ran)
    execute = core.execute

    def recording(out):
        kinds = [s.seq.pooling is not None for s in out.scheduled]
        steps.append((any(kinds), not all(kinds)))
        return execute(out)

    core.execute = recording  # the async engine looks it up on each step
    client = client_for(busy)
    prompt = "Tell me a long story about"
    solo = (
        client.completions.create(
            model=busy.model, prompt=prompt, max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
    )
    texts = [f"Embedding input number {i}, with a few more words to prefill in chunks" for i in range(6)]
    results: dict[str, object] = {}

    def generate() -> None:
        results["text"] = (
            client.completions.create(
                model=busy.model, prompt=prompt, max_tokens=60, temperature=0, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .text
        )

    steps.clear()
    thread = threading.Thread(target=generate)
    thread.start()
    wait_for(lambda: any(gen for _, gen in steps), 30, "the generation to start stepping", every=0.005)
    embedded = client.embeddings.create(model=busy.model, input=texts, encoding_format="float")
    thread.join(60)
    assert any(emb and gen for emb, gen in steps), steps  # one forward pass held both kinds
    assert results["text"] == solo  # generation was not disturbed
    for item, text in zip(embedded.data, texts, strict=True):
        assert np.abs(np.array(item.embedding) - expected(reference, ids_of(reference, text))).max() < TOLERANCE
    busy.wait_idle()


def test_dimensions_equal_to_the_model_size_is_accepted(server, openai_client) -> None:
    result = openai_client.embeddings.create(model=server.model, input="Hi", dimensions=64)
    assert len(result.data[0].embedding) == 64


GOOD = {"model": "tiny", "input": "Hello"}
BAD_REQUESTS = [
    ({"dimensions": 8}, "dimensions"),
    ({"dimensions": "8"}, "dimensions"),
    ({"encoding_format": "int8"}, "encoding_format"),
    ({"encoding_format": 1}, "encoding_format"),
    ({"input": None}, "input"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input[1]"),
    ({"input": ["ok", [1, "a"]]}, "input[1]"),
    ({"input": [1, 2, 10**9]}, "input"),
    ({"input": [[1, 2], [10**9]]}, "input[1]"),
    ({"input": [[]]}, "input[0]"),
    ({"input": 42}, "input"),
    ({"input": ["x"] * 2049}, "input"),
    ({"input": "word " * 400}, "input"),
    ({"input": list(range(1, 300))}, "input"),
    ({"model": "other"}, "model"),
    ({"model": None}, "model"),
    ({"normalize": "yes"}, "normalize"),
    ({"user": 5}, "user"),
    ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ({"messages": [{"role": "user", "content": "Hi"}]}, "messages"),
]


@pytest.mark.parametrize(("change", "param"), BAD_REQUESTS, ids=[p for _, p in BAD_REQUESTS])
async def test_bad_embedding_request_is_a_400_naming_the_field(server, change, param) -> None:
    body = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    status, payload = await post(server, "/v1/embeddings", body)
    assert status == 400, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param.split("[")[0] in error["message"]


def test_sdk_sees_the_refused_field(server, openai_client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=server.model, input="Hi", dimensions=16)
    assert caught.value.param == "dimensions"
    with pytest.raises(openai.BadRequestError) as caught:
        openai_client.embeddings.create(model=server.model, input="word " * 400)
    assert caught.value.code == "context_length_exceeded"
    server.wait_idle()  # nothing refused holds a block
