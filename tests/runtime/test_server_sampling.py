"""logprobs, echo, n, penalties and the model's sampling defaults over real HTTP with the openai client."""

from __future__ import annotations

import json
import logging
import random
import shutil

import aiohttp
import openai
import pytest
from reference_sampling import Reference
from test_server_errors import GOOD_CHAT, GOOD_COMPLETION, assert_openai_error, post
from transformers import AutoTokenizer

PROMPT_IDS = [random.Random(3).randrange(5, 1000) for _ in range(40)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> Reference:
    return Reference(tiny_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def names(tokenizer, ids: list[int]) -> list[str]:
    return [tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def assert_top(top: dict[str, float], want, tokenizer, k: int) -> None:
    """A completions top_logprobs entry against the reference row: the k likeliest, by name."""
    values, ids = want.topk(k)
    for token, value in zip(names(tokenizer, ids.tolist()), values.tolist(), strict=True):
        assert top[token] == pytest.approx(value, abs=1e-4)


def test_completion_echo_logprobs_equal_transformers_log_softmax(openai_client, server, reference, tokenizer):
    # what lm-evaluation-harness's local-completions sends for loglikelihood
    result = openai_client.completions.create(
        model=server.model,
        prompt=[PROMPT_IDS],
        max_tokens=5,
        logprobs=3,
        echo=True,
        temperature=0,
        seed=1234,
        extra_body={"ignore_eos": True},
    )
    [choice] = result.choices
    generated, _ = reference.greedy(PROMPT_IDS, 5)
    ids = PROMPT_IDS + generated
    logprobs = reference.logits(ids).log_softmax(-1)
    lp = choice.logprobs
    assert lp.tokens == names(tokenizer, ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(logprobs[i - 1, ids[i]]), abs=1e-4)
        assert_top(lp.top_logprobs[i], logprobs[i - 1], tokenizer, 3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert choice.text.startswith(tokenizer.decode(PROMPT_IDS))
    assert result.usage.completion_tokens == 5


def test_echo_with_max_tokens_zero_scores_the_prompt_only(openai_client, server, reference):
    result = openai_client.completions.create(
        model=server.model, prompt=PROMPT_IDS, max_tokens=0, logprobs=0, echo=True
    )
    lp = result.choices[0].logprobs
    logprobs = reference.logits(PROMPT_IDS).log_softmax(-1)
    want = [None] + [float(logprobs[i - 1, PROMPT_IDS[i]]) for i in range(1, len(PROMPT_IDS))]
    assert lp.token_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(want[1:], abs=1e-4)
    assert result.usage.completion_tokens == 0 and result.choices[0].finish_reason == "length"


def test_prompt_logprobs_stay_right_under_chunked_prefill_and_a_cached_prefix(make_server, reference):
    chunked = make_server(max_num_batched_tokens=16, block_size=4)
    client = openai.OpenAI(base_url=f"{chunked.url}/v1", api_key="unused", max_retries=0)
    want = reference.logits(PROMPT_IDS).log_softmax(-1)
    for _ in range(2):  # the second time every full block of the prompt is in the prefix cache
        lp = (
            client.completions.create(model="tiny", prompt=PROMPT_IDS, max_tokens=0, logprobs=1, echo=True)
            .choices[0]
            .logprobs
        )
        assert lp.token_logprobs[1:] == pytest.approx(
            [float(want[i - 1, PROMPT_IDS[i]]) for i in range(1, len(PROMPT_IDS))], abs=1e-4
        )


def test_penalties_and_bias_change_greedy_output_as_the_reference_says(openai_client, server, reference, tokenizer):
    settings = {
        "repetition_penalty": 1.4,
        "presence_penalty": 0.8,
        "frequency_penalty": 1.1,
        "logit_bias": {7: 4.0, 99: 150.0},
    }
    plain = openai_client.completions.create(
        model=server.model, prompt=PROMPT_IDS, max_tokens=12, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    result = openai_client.completions.create(
        model=server.model,
        prompt=PROMPT_IDS,
        max_tokens=12,
        temperature=0,
        logprobs=2,
        presence_penalty=0.8,
        frequency_penalty=1.1,
        logit_bias={"7": 4, "99": 150},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.4},
    )
    tokens, steps = reference.greedy(PROMPT_IDS, 12, **settings)
    lp = result.choices[0].logprobs
    assert lp.tokens == names(tokenizer, tokens)
    assert lp.tokens != plain.choices[0].logprobs.tokens
    for k, (token, step) in enumerate(zip(tokens, steps, strict=True)):
        assert lp.token_logprobs[k] == pytest.approx(float(step[token]), abs=1e-4)
        assert_top(lp.top_logprobs[k], step, tokenizer, 2)


def test_min_p_of_one_leaves_only_the_likeliest_token(openai_client, server):
    greedy = openai_client.completions.create(
        model=server.model, prompt="Once upon", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    hot = openai_client.completions.create(
        model=server.model,
        prompt="Once upon",
        max_tokens=10,
        temperature=2,
        seed=9,
        extra_body={"ignore_eos": True, "min_p": 1.0},
    )
    free = openai_client.completions.create(
        model=server.model, prompt="Once upon", max_tokens=10, temperature=2, seed=9, extra_body={"ignore_eos": True}
    )
    assert hot.choices[0].text == greedy.choices[0].text != free.choices[0].text


def test_chat_logprobs_have_openais_shape_and_values(openai_client, server, reference, tokenizer):
    messages = [{"role": "user", "content": "Name a colour"}]
    result = openai_client.chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=4,
        extra_body={"ignore_eos": True},
    )
    prompt = tokenizer(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    ).input_ids
    tokens, steps = reference.greedy(prompt, 6)
    content = result.choices[0].logprobs.content
    assert [c.token for c in content] == names(tokenizer, tokens)
    for item, token, step in zip(content, tokens, steps, strict=True):
        assert item.logprob == pytest.approx(float(step[token]), abs=1e-4)
        values, ids = step.topk(4)
        assert [t.token for t in item.top_logprobs] == names(tokenizer, ids.tolist())
        assert [t.logprob for t in item.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
    # the tokens' bytes, joined, are the answer's text, even where a token holds part of a character; a
    # character the answer's last token leaves unfinished (a random model's greedy tokens may) reads U+FFFD.
    # A special token (ignore_eos lets the greedy walk pass <|im_end|>) is listed with its logprob but
    # left out of the text, as skip_special_tokens does
    special = set(tokenizer.all_special_tokens)
    joined = bytes(b for c in content if c.token not in special for b in c.bytes)
    assert joined.decode("utf-8", errors="replace") == result.choices[0].message.content
    bare = openai_client.chat.completions.create(
        model=server.model, messages=messages, max_tokens=2, logprobs=True, extra_body={"ignore_eos": True}
    )
    assert all(c.top_logprobs == [] for c in bare.choices[0].logprobs.content)
    assert len(bare.choices[0].logprobs.content) == 2


def test_streamed_logprobs_equal_the_whole_answer(openai_client, server):
    kwargs = {
        "model": server.model,
        "prompt": "Logprobs in chunks",
        "max_tokens": 9,
        "temperature": 0,
        "logprobs": 2,
        "echo": True,
        "extra_body": {"ignore_eos": True},
    }
    whole = openai_client.completions.create(**kwargs).choices[0].logprobs
    tokens, values, offsets = [], [], []
    for chunk in openai_client.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            values += chunk.choices[0].logprobs.token_logprobs
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset
    assert values == whole.token_logprobs
    chat = openai_client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    streamed = [
        c for chunk in chat if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content
    ]
    assert len(streamed) == 5 and all(len(c.top_logprobs) == 1 for c in streamed)


def test_n_choices_are_indexed_reproducible_and_seeded_per_choice(openai_client, server):
    kwargs = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Tell me"}],
        "max_tokens": 10,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True},
    }
    result = openai_client.chat.completions.create(n=4, seed=42, **kwargs)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in result.choices]
    assert len(set(texts)) == 4
    assert result.usage.completion_tokens == 40
    again = openai_client.chat.completions.create(n=4, seed=42, **kwargs)
    assert [c.message.content for c in again.choices] == texts
    for i in (0, 3):  # choice i is what seed + i gives alone
        single = openai_client.chat.completions.create(n=1, seed=42 + i, **kwargs)
        assert single.choices[0].message.content == texts[i]
    same_best = openai_client.completions.create(
        model=server.model, prompt="Tell me", max_tokens=3, n=2, best_of=2, extra_body={"ignore_eos": True}
    )
    assert len(same_best.choices) == 2


async def test_n_choices_stream_interleaved_with_their_index(server, read_sse):
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Go"}],
        "max_tokens": 8,
        "n": 3,
        "seed": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{server.url}/v1/chat/completions", json=body) as response:
            events = await read_sse(response)
        async with http.post(
            f"{server.url}/v1/chat/completions", json={**body, "stream": False, "stream_options": None}
        ) as response:
            whole = await response.json()
    chunks = [json.loads(e) for e in events[:-1]]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    order = []
    for chunk in chunks[:-1]:
        [choice] = chunk["choices"]
        order.append(choice["index"])
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finishes[choice["index"]] = choice["finish_reason"]
    assert [c["index"] for c in (ch["choices"][0] for ch in chunks[:3])] == [0, 1, 2]  # a role chunk each
    assert order != sorted(order)  # interleaved, not one choice after another
    assert finishes == {0: "length", 1: "length", 2: "length"}
    assert texts == {c["index"]: c["message"]["content"] for c in whole["choices"]}
    assert chunks[-1]["usage"]["completion_tokens"] == 24


REFUSED = [
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": 2, "best_of": 3}, "best_of"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"logit_bias": {"word": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "up"}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": [1, 2]}, "logit_bias"),
    ("/v1/completions", {"suffix": "tail"}, "suffix"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"best_of": 3}, "best_of"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": False, "top_logprobs": 0}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 4, "min_tokens": 9}, "min_tokens"),
]


@pytest.mark.parametrize(("path", "change", "param"), REFUSED, ids=[f"{p}-{f}" for p, _, f in REFUSED])
async def test_sampling_fields_out_of_range_are_a_400_naming_the_field(server, path, change, param) -> None:
    good = GOOD_COMPLETION if path == "/v1/completions" else GOOD_CHAT
    status, _, payload = await post(server, path, json={**good, **change})
    assert status == 400, payload
    assert_openai_error(payload, 400, param)


def test_the_same_limit_under_both_names_is_accepted(openai_client, server):
    result = openai_client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "a"}],
        max_tokens=3,
        max_completion_tokens=3,
        extra_body={"ignore_eos": True},
    )
    assert result.usage.completion_tokens == 3


def test_generation_config_defaults_apply_where_the_request_is_silent(make_server, tiny_model_dir, tmp_path, caplog):
    model_dir = tmp_path / "with-defaults"
    shutil.copytree(tiny_model_dir, model_dir)
    gen = json.loads((model_dir / "generation_config.json").read_text())
    gen.update(temperature=0.0, repetition_penalty=1.8, max_new_tokens=7)
    (model_dir / "generation_config.json").write_text(json.dumps(gen))
    with caplog.at_level(logging.INFO, logger="goodput_runtime"):
        running = make_server(model_dir=model_dir)
    client = openai.OpenAI(base_url=f"{running.url}/v1", api_key="unused", max_retries=0)
    extra = {"ignore_eos": True}
    silent = client.completions.create(model="tiny", prompt=PROMPT_IDS, extra_body=extra)
    explicit = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=7, temperature=0, extra_body={**extra, "repetition_penalty": 1.8}
    )
    unpenalized = client.completions.create(
        model="tiny", prompt=PROMPT_IDS, max_tokens=7, temperature=0, extra_body={**extra, "repetition_penalty": 1.0}
    )
    assert silent.usage.completion_tokens == 7
    assert silent.choices[0].text == explicit.choices[0].text != unpenalized.choices[0].text
    assert "temperature=0.0, repetition_penalty=1.8, max_tokens=7" in caplog.text


def test_token_bytes_rebuild_characters_split_across_tokens(tokenizer):
    from goodput_runtime.server.responses import TokenText

    text = "naïve café ☕ 数"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    token_text = TokenText(tokenizer)
    assert any(token_text(i) == "\ufffd" for i in ids)  # some tokens hold part of a character
    assert bytes(b for i in ids for b in token_text.bytes(i)).decode() == text
