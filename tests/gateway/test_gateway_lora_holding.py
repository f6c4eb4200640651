"""A request for a LoRA adapter that a replica is loading waits in the gateway's holding queue.

Two real runtime processes serve the tiny model with run-time adapter loading on, behind real gateway
processes (one holding up to a minute, one up to 2 s); a test loads an adapter on the first replica
through its load route from an hf:// source, or on the second on first use (its --lora-source
hf://org). The Hub cannot be reached from here: a local stand-in (hub_standin.py) answers its file
routes, reached through HF_ENDPOINT as the Hub would be, and answers each repository only once the test
lets it, so a load lasts exactly as long as the test wants (a slow Hub). Clients are the official
`openai` SDK over HTTP."""

from __future__ import annotations

import concurrent.futures
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import openai
import pytest
from gateway_helpers import GatewayProcess, Started, metric, wait_ready
from harness import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from hub_standin import HubStandIn
from lora_adapters import make_adapter

pytestmark = pytest.mark.slow
GATE_SECONDS = 60  # the longest the stand-in keeps a repository's answer back


class GatedHub(HubStandIn):
    """The stand-in, answering a repository's files only once its gate is open."""

    def __init__(self) -> None:
        super().__init__()
        self.gates: dict[str, threading.Event] = {}

    def gate(self, repo: str) -> threading.Event:
        return self.gates.setdefault(repo, threading.Event())

    def answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        repo = "/".join(handler.path.strip("/").split("/")[:2])
        self.gate(repo).wait(GATE_SECONDS)
        super().answer(handler, body)


@dataclass
class Env:
    hub: GatedHub
    urls: list[str]
    gateway: GatewayProcess  # holds up to a minute
    brief: GatewayProcess  # holds up to 2 s


@pytest.fixture(scope="module")
def env(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    workdir = tmp_path_factory.mktemp("lora-holding")
    adapter = make_adapter(tiny_model_dir, "gw-held", 4, ["q_proj", "v_proj"], steps=3, seed=7)
    hub = GatedHub().start()
    for repo in ("slow", "stuck", "lazy"):
        hub.add(f"org/{repo}", adapter)
    hub.add("org/broken", adapter, files={"adapter_model.safetensors": b"\x10\0not a safetensors file"})
    with Started() as started, pytest.MonkeyPatch.context() as env_vars:
        started.callback(hub.stop)
        env_vars.setenv("HF_ENDPOINT", hub.url)
        env_vars.setenv("GOODPUT_LORA_CACHE", str(workdir / "lora-cache"))
        env_vars.setenv("HF_HUB_ETAG_TIMEOUT", str(GATE_SECONDS + 30))  # the stand-in's wait is no failure
        env_vars.setenv("HF_HUB_DOWNLOAD_TIMEOUT", str(GATE_SECONDS + 30))
        flags = ("--enable-lora", "--allow-runtime-lora-updating", "--max-loras", "2")
        pods = [
            started.replica("r0", tiny_model_dir, workdir, *flags),
            started.replica("r1", tiny_model_dir, workdir, *flags, "--lora-source", "hf://org"),  # loads on first use
        ]
        wait_ready(*pods)
        started.callback(lambda: [g.set() for g in hub.gates.values()])  # no load left waiting at the end
        urls = [f"http://127.0.0.1:{p.port}" for p in pods]
        common = ("--static-model", "tiny=" + ",".join(urls), "--scrape-seconds", "0.5", "--shutdown-delay", "0")
        gateway = started.gateway(workdir / "no-kubeconfig", workdir / "gateway.log", *common, "--hold-seconds", "60")
        brief = started.gateway(workdir / "no-kubeconfig", workdir / "brief.log", *common, "--hold-seconds", "2")
        yield Env(hub, urls, gateway, brief)


def client_of(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=120)


def post(url: str, body: dict) -> tuple[int, str]:
    """The status and text of the answer to a JSON POST."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=GATE_SECONDS + 60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def start_load(env: Env, name: str, pool: concurrent.futures.Executor) -> concurrent.futures.Future:
    """A load of hf://org/NAME on the first replica, under way (the Hub stand-in keeps it waiting)."""
    body = {"lora_name": name, "lora_path": f"hf://org/{name}"}
    loading = pool.submit(post, env.urls[0] + "/v1/load_lora_adapter", body)
    wait_for(lambda: metric(env.urls[0], "goodput_lora_loading", adapter=name) == 1, 30, f"{name} loading")
    return loading


def resolves(gateway: GatewayProcess, model: str) -> bool:
    """Whether the gateway routes `model` (GET /v1/models/MODEL answers it)."""
    try:
        client_of(gateway).models.retrieve(model)
        return True
    except openai.NotFoundError:
        return False


def waiting(gateway: GatewayProcess) -> float:
    return gateway.metric("goodput_gateway_requests_waiting", service="tiny")


def test_a_request_for_a_loading_adapter_is_held_then_served_by_the_replica_that_loaded_it(env):
    client = client_of(env.gateway)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        loading = start_load(env, "slow", pool)
        wait_for(lambda: resolves(env.gateway, "slow"), 30, "the gateway to learn the adapter being loaded")
        asked = pool.submit(client.completions.create, model="slow", prompt="hello there", max_tokens=3)
        wait_for(lambda: waiting(env.gateway) == 1, 30, "the request held at the gateway")
        time.sleep(1.0)  # two scrapes more: still held, and no replica has seen it
        assert not asked.done() and waiting(env.gateway) == 1
        assert [metric(u, "goodput_lora_requests_total", adapter="slow") for u in env.urls] == [0, 0]

        env.hub.gate("org/slow").set()  # the Hub answers: the load ends
        assert loading.result(timeout=GATE_SECONDS + 60)[0] == 200
        out = asked.result(timeout=60)
    assert out.model == "slow" and out.usage.completion_tokens >= 1
    assert metric(env.urls[0], "goodput_lora_loading", adapter="slow") == 0
    assert [metric(u, "goodput_lora_requests_total", adapter="slow") for u in env.urls] == [1, 0]
    assert waiting(env.gateway) == 0
    assert env.gateway.metric("goodput_gateway_hold_duration_seconds_count", service="tiny") >= 1
    # once it is served, requests for it go straight to that replica
    again = client.chat.completions.create(model="slow", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert again.model == "slow"
    assert [metric(u, "goodput_lora_requests_total", adapter="slow") for u in env.urls] == [2, 0]


def test_a_request_for_an_adapter_loading_on_first_use_is_held_then_served_there(env):
    """The second replica loads an adapter of its --lora-source on a request sent to it directly; the
    gateway's request for it waits for that load, then goes to that replica."""
    direct = openai.OpenAI(base_url=env.urls[1] + "/v1", api_key="k", max_retries=0, timeout=120)
    client = client_of(env.gateway)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(direct.completions.create, model="lazy", prompt="hello", max_tokens=2)
        wait_for(lambda: metric(env.urls[1], "goodput_lora_loading", adapter="lazy") == 1, 30, "lazy loading")
        wait_for(lambda: resolves(env.gateway, "lazy"), 30, "the gateway to learn the adapter being loaded")
        asked = pool.submit(client.completions.create, model="lazy", prompt="hello there", max_tokens=3)
        wait_for(lambda: waiting(env.gateway) == 1, 30, "the request held at the gateway")
        assert not first.done() and not asked.done()
        env.hub.gate("org/lazy").set()
        assert first.result(timeout=60).model == "lazy"
        assert asked.result(timeout=60).model == "lazy"
    assert [metric(u, "goodput_lora_requests_total", adapter="lazy") for u in env.urls] == [0, 2]
    assert metric(env.urls[1], "goodput_lora_loading", adapter="lazy") == 0
    assert waiting(env.gateway) == 0


def test_a_hold_that_outlasts_the_bound_is_a_503_with_retry_after(env):
    client = client_of(env.brief)
    before = env.brief.metric("goodput_gateway_requests_refused_total", service="tiny", reason="hold_timeout")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        loading = start_load(env, "stuck", pool)
        wait_for(lambda: resolves(env.brief, "stuck"), 30, "the gateway to learn the adapter being loaded")
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as late:
            client.completions.create(model="stuck", prompt="hello", max_tokens=2)
        held = time.monotonic() - started
        assert late.value.status_code == 503 and late.value.code == "lora_loading"
        assert "stuck" in late.value.message and "still loading" in late.value.message
        assert int(late.value.response.headers["Retry-After"]) >= 1
        assert 2.0 <= held < 30
        assert waiting(env.brief) == 0
        refused = env.brief.metric("goodput_gateway_requests_refused_total", service="tiny", reason="hold_timeout")
        assert refused == before + 1
        assert metric(env.urls[0], "goodput_lora_loading", adapter="stuck") == 1, "the load ended: nothing was held"
        env.hub.gate("org/stuck").set()
        assert loading.result(timeout=GATE_SECONDS + 60)[0] == 200


def test_a_held_request_whose_adapter_fails_to_load_gets_a_404_not_a_hang(env):
    client = client_of(env.gateway)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        loading = start_load(env, "broken", pool)
        wait_for(lambda: resolves(env.gateway, "broken"), 30, "the gateway to learn the adapter being loaded")
        asked = pool.submit(client.completions.create, model="broken", prompt="hello", max_tokens=2)
        wait_for(lambda: waiting(env.gateway) == 1, 30, "the request held at the gateway")
        env.hub.gate("org/broken").set()  # the Hub answers with a corrupt file: the replica refuses it
        status, refusal = loading.result(timeout=GATE_SECONDS + 60)
        assert status == 400 and "broken" in json.loads(refusal)["error"]["message"]
        with pytest.raises(openai.APIStatusError) as refused:
            asked.result(timeout=60)
    # the replica the policy picks answers: the first has no such adapter (404), the second tries its
    # --lora-source and refuses the corrupt file (400), each naming it
    error = refused.value
    assert (error.status_code, error.code) in ((404, "model_not_found"), (400, "invalid_lora_adapter")), error
    assert "broken" in error.message
    assert metric(env.urls[0], "goodput_lora_loading", adapter="broken") == 0
    assert waiting(env.gateway) == 0


def test_an_unknown_adapter_is_a_404_in_openais_shape(env):
    client = client_of(env.gateway)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nowhere", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.code == "model_not_found" and caught.value.body["type"] == "invalid_request_error"
    assert "nowhere" in caught.value.message and "127.0.0.1" not in caught.value.message
    assert waiting(env.gateway) == 0
