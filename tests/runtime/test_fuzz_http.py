"""Fuzzing the HTTP API's request parsing against a real runtime server on a random-weight model.

Any JSON body, on any POST route, gets a 2xx or an error in OpenAI's shape with a 4xx status,
never a 5xx. Bodies are drawn from arbitrary JSON and from objects built of the API's own field
names, with values both plausible and arbitrary, so parsing goes past the first check.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"]
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "best_of",
    "stream",
    "stream_options",
    "stop",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "echo",
    "seed",
    "logit_bias",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "ignore_eos",
    "response_format",
    "suffix",
    "tools",
    "user",
    "input",
    "encoding_format",
    "dimensions",
    "tokens",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
]

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.integers(-3, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
any_json = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "robot"])},
        optional={
            "content": st.one_of(
                st.text(max_size=20),
                any_json,
                st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=10)}
                    ),
                    max_size=2,
                ),
            )
        },
    ),
    max_size=3,
)
plausible = {
    "model": st.one_of(st.just("tiny"), any_json),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(-5, 600), max_size=6), any_json),
    "input": st.one_of(st.text(max_size=30), st.lists(st.text(max_size=10), max_size=3), any_json),
    "messages": st.one_of(messages, any_json),
    "tokens": st.one_of(st.lists(st.integers(-5, 600), max_size=6), any_json),
    "max_tokens": st.one_of(st.integers(-2, 8), any_json),
    "n": st.one_of(st.integers(-1, 3), any_json),
    "stream": st.one_of(st.booleans(), any_json),
}
objects = st.dictionaries(st.sampled_from(FIELDS), any_json, max_size=6).flatmap(
    lambda body: st.fixed_dictionaries({k: plausible.get(k, st.one_of(st.just(v), any_json)) for k, v in body.items()})
)
# a valid request of each route, with a few fields drawn as above on top
VALID = {
    "/v1/completions": {"model": "tiny", "prompt": "Hello", "max_tokens": 2},
    "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    "/v1/embeddings": {"model": "tiny", "input": "Hello"},
    "/tokenize": {"model": "tiny", "prompt": "Hello"},
    "/detokenize": {"model": "tiny", "tokens": [1, 2, 3]},
}
extras = st.dictionaries(st.sampled_from(FIELDS), st.just(None), max_size=2).flatmap(
    lambda chosen: st.fixed_dictionaries(
        {k: st.one_of(plausible.get(k, scalars), any_json) for k in chosen if k != "model"}
    )
)
requests = st.one_of(
    st.tuples(st.sampled_from(PATHS), st.one_of(any_json, objects)),
    st.sampled_from(PATHS).flatmap(lambda path: st.tuples(st.just(path), extras.map(lambda e: {**VALID[path], **e}))),
)


def is_openai_error(payload: Any) -> bool:
    error = payload.get("error") if isinstance(payload, dict) else None
    return (
        isinstance(error, dict)
        and {"message", "type", "param", "code"} <= set(error)
        and isinstance(error["message"], str)
        and bool(error["message"])
    )


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(request=requests)
def test_any_json_gets_a_2xx_or_an_openai_4xx_never_a_5xx(http, request: tuple[str, Any]) -> None:
    path, body = request
    raw = json.dumps(body).encode()
    response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    event(f"{response.status_code // 100}xx")  # --hypothesis-show-statistics: how many got past parsing
    described = f"{path} {raw[:500]!r} -> {response.status_code} {response.text[:500]}"
    assert response.status_code < 500, described
    if response.status_code >= 300:
        assert 400 <= response.status_code < 500 and is_openai_error(response.json()), described
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), described
        assert '"error"' not in response.text, described
    else:
        assert "error" not in response.json(), described
