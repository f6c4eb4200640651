"""API keys on a real runtime process: /v1/* wants one, probes and Prometheus do not."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from goodput_runtime.server.auth import key_matches, split_keys

KEY, SECOND_KEY = "sk-goodput-first-7c1d", "sk-goodput-second-93ab"
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


async def post(url: str, body: dict, key: str | None = None, raw_auth: str | None = None) -> tuple[int, dict, dict]:
    headers = {"Authorization": raw_auth if raw_auth is not None else f"Bearer {key}"} if key or raw_auth else {}
    async with aiohttp.ClientSession() as http, http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(), dict(response.headers)


def assert_unauthorized(status: int, payload: dict, headers: dict, *secrets: str) -> None:
    assert status == 401, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_api_key"
    assert headers["WWW-Authenticate"].startswith("Bearer")
    for secret in secrets:
        assert secret not in error["message"]


async def test_requests_without_the_key_get_an_openai_401_and_probes_stay_open(runtime) -> None:
    server = runtime("--api-key", KEY, "--api-key", SECOND_KEY)
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)  # /health needs no key
        async with http.get(f"{server.url}/metrics") as response:
            assert response.status == 200
            assert "goodput_requests" in await response.text()
        async with http.get(f"{server.url}/v1/models") as response:
            assert_unauthorized(response.status, await response.json(), dict(response.headers))
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/tokenize"):
        status, payload, headers = await post(f"{server.url}{path}", {"model": "tiny", "prompt": "x"})
        assert_unauthorized(status, payload, headers)
        assert "didn't provide" in payload["error"]["message"]
    wrong = "sk-goodput-first-7c1e"  # one character off
    for auth in (f"Bearer {wrong}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", f"Basic {KEY}", KEY, "Bearer "):
        status, payload, headers = await post(f"{server.url}/v1/chat/completions", CHAT, raw_auth=auth)
        assert_unauthorized(status, payload, headers, wrong, KEY)
    assert KEY not in server.log() and SECOND_KEY not in server.log()


async def test_each_configured_key_serves_through_the_openai_client(runtime) -> None:
    server = runtime("--api-key", KEY, "--api-key", SECOND_KEY)
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
    for key in (KEY, SECOND_KEY):
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
        assert reply.choices[0].finish_reason in ("length", "stop")
        streamed = list(client.completions.create(model="tiny", prompt="Hello", max_tokens=3, stream=True))
        assert streamed and streamed[-1].choices[0].finish_reason in ("length", "stop")
        assert [m.id for m in client.models.list().data] == ["tiny"]
    refused = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as caught:
        refused.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.code == "invalid_api_key"


async def test_keys_come_from_the_environment_and_stay_out_of_the_log(runtime, monkeypatch) -> None:
    monkeypatch.setenv("GOODPUT_API_KEY", f" {KEY} ,{SECOND_KEY}")
    server = runtime("--log-level", "debug")
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
    status, payload, headers = await post(f"{server.url}/v1/chat/completions", CHAT)
    assert_unauthorized(status, payload, headers)
    for key in (KEY, SECOND_KEY):
        status, payload, _ = await post(f"{server.url}/v1/chat/completions", CHAT, key=key)
        assert status == 200, payload
    assert KEY not in server.log() and SECOND_KEY not in server.log()


async def test_without_a_key_configured_nothing_is_asked(runtime, monkeypatch) -> None:
    monkeypatch.delenv("GOODPUT_API_KEY", raising=False)
    server = runtime()
    async with aiohttp.ClientSession() as http:
        await server.wait_health(http, 200)
    status, payload, _ = await post(f"{server.url}/v1/chat/completions", CHAT)
    assert status == 200, payload


def test_keys_split_on_commas_and_a_key_matches_only_whole() -> None:
    assert split_keys(["a, b", "", "b,c,"]) == ("a", "b", "c")
    keys = ("alpha", "beta")
    assert key_matches("beta", keys) and key_matches("alpha", keys)
    for wrong in ("alph", "alphaa", "", "ALPHA", "beta "):
        assert not key_matches(wrong, keys)
