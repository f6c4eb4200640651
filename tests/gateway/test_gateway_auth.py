"""Per-service API keys at the gateway, under its own ServiceAccount: clients need the key in the
service's Secret, and the runtime behind it gets its own key, whatever key the client sent."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from gateway_helpers import Started, post_json, publish, tiny_spec, wait_ready
from harness import service_account_kubeconfig, wait_for

RUNTIME_KEY, CLIENT_KEY = "sk-runtime-0a41c9", "sk-client-77e2d0"  # the Secret holds both; the runtime only one


def post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    status, _, answer = post_json(url, body, {"Authorization": f"Bearer {key}"} if key else None)
    return status, answer


def models(url: str, key: str | None = None) -> set[str]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/v1/models", headers=headers), timeout=10) as r:
        return {m["id"] for m in json.loads(r.read())["data"]}


@pytest.fixture(scope="module")
def env(cluster, tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("gateway-auth")
    ns = {which: f"gwauth-{which}-{int(time.time()) % 100000}" for which in ("locked", "open", "broken")}
    kubeconfig = service_account_kubeconfig(
        cluster, ("namespace.yaml", "gateway-rbac.yaml"), "goodput-gateway", workdir / "gateway.kubeconfig"
    )
    with Started() as started:
        started.namespaces(cluster, *ns.values())
        locked = started.replica("locked", tiny_model_dir, workdir, "--api-key", RUNTIME_KEY)
        unlocked = started.replica("open", tiny_model_dir, workdir)
        cluster.core.create_namespaced_secret(
            ns["locked"], {"metadata": {"name": "keys"}, "stringData": {"apiKey": f"{RUNTIME_KEY},{CLIENT_KEY}"}}
        )
        auth = {"auth": {"apiKeySecretRef": {"name": "keys"}}}
        cluster.create_service(ns["locked"], "chat", tiny_spec(**auth))
        cluster.create_service(ns["open"], "chat", tiny_spec())
        cluster.create_service(ns["broken"], "chat", tiny_spec(auth={"apiKeySecretRef": {"name": "none"}}))
        wait_ready(locked, unlocked)
        publish(cluster, ns["locked"], "chat", "p0", locked.port)
        publish(cluster, ns["open"], "chat", "p0", unlocked.port)
        publish(cluster, ns["broken"], "chat", "p0", unlocked.port)
        gateway = started.gateway(kubeconfig, workdir / "gateway.log")
        gateway.models_of = {which: f"{name}/tiny" for which, name in ns.items()}  # type: ignore[attr-defined]
        wait_for(
            lambda: {f"{ns['locked']}/tiny", f"{ns['open']}/tiny"} <= models(gateway.url, CLIENT_KEY),
            30,
            "the services at the gateway",
        )
        yield gateway


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


def test_either_key_of_the_secret_serves_and_the_runtime_gets_its_own(env):
    for key in (CLIENT_KEY, RUNTIME_KEY):  # the runtime itself accepts RUNTIME_KEY only
        client = openai.OpenAI(base_url=env.url + "/v1", api_key=key, max_retries=0, timeout=60)
        reply = client.chat.completions.create(model=env.models_of["locked"], **CHAT)
        assert reply.choices[0].finish_reason in ("length", "stop")
        stream = client.completions.create(model=env.models_of["locked"], prompt="Once", max_tokens=3, stream=True)
        assert list(stream)


def test_a_missing_or_wrong_key_gets_an_openai_401_at_the_gateway(env):
    status, body = post(env.url + "/v1/chat/completions", {"model": env.models_of["locked"], **CHAT})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert body["error"]["type"] == "invalid_request_error" and "didn't provide" in body["error"]["message"]
    for wrong in ("sk-client-77e2d1", CLIENT_KEY + "x", RUNTIME_KEY[:-1]):
        status, body = post(env.url + "/v1/chat/completions", {"model": env.models_of["locked"], **CHAT}, wrong)
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        assert wrong not in body["error"]["message"]
    refused = openai.OpenAI(base_url=env.url + "/v1", api_key="sk-nope", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError):
        refused.chat.completions.create(model=env.models_of["locked"], **CHAT)


def test_a_service_without_auth_stays_open_and_models_lists_what_the_caller_may_use(env):
    status, body = post(env.url + "/v1/chat/completions", {"model": env.models_of["open"], **CHAT})
    assert status == 200, body
    locked, unlocked = env.models_of["locked"], env.models_of["open"]
    assert unlocked in models(env.url) and locked not in models(env.url)
    assert {unlocked, locked} <= models(env.url, CLIENT_KEY)
    assert locked not in models(env.url, "sk-nope")


def test_a_secret_that_cannot_be_read_refuses_requests_rather_than_opening_them(env):
    status, body = post(env.url + "/v1/chat/completions", {"model": env.models_of["broken"], **CHAT}, CLIENT_KEY)
    assert status == 503 and body["error"]["code"] == "api_key_unavailable"
    assert env.models_of["broken"] not in models(env.url, CLIENT_KEY)


def test_keys_stay_out_of_the_gateway_log(env):
    assert RUNTIME_KEY not in env.log() and CLIENT_KEY not in env.log()
    assert 'User "system:serviceaccount:goodput-system:goodput-gateway" cannot' not in env.log()
