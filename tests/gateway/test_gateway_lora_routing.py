"""LoRA adapters behind the gateway: two real runtime processes, each serving a different adapter (made
with peft on the tiny model), behind one gateway that serves them as one model. A request naming an
adapter goes to the replica that serves it; an adapter no replica serves is a 404 in OpenAI's shape."""

from __future__ import annotations

import sys
from pathlib import Path

import openai
import pytest
from gateway_helpers import Started, metric, wait_ready
from harness import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
from lora_adapters import make_adapter

pytestmark = pytest.mark.slow
ADAPTERS = {"left": 0, "right": 1}  # adapter name -> its replica's index


@pytest.fixture(scope="module")
def env(tiny_model_dir, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lora-routing")
    paths = {
        name: make_adapter(tiny_model_dir, f"gw-{name}", 4, ["q_proj", "v_proj"], steps=5, seed=seed)
        for name, seed in ADAPTERS.items()
    }
    with Started() as started:
        pods = [
            started.replica(
                f"r-{name}", tiny_model_dir, workdir, "--lora-modules", f"{name}={paths[name]}", "--max-loras", "2"
            )
            for name in ADAPTERS
        ]
        wait_ready(*pods)
        urls = [f"http://127.0.0.1:{p.port}" for p in pods]
        gateway = started.gateway(
            workdir / "no-kubeconfig",
            workdir / "gateway.log",
            "--static-model",
            "tiny=" + ",".join(urls),
            "--scrape-seconds",
            "0.5",
            "--shutdown-delay",
            "0",
        )
        client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0, timeout=60)

        def learned() -> bool:
            try:
                client.completions.create(model="right", prompt="x", max_tokens=1)
                return True
            except openai.NotFoundError:
                return False

        wait_for(learned, 30, "the gateway to learn the replicas' adapters")
        yield gateway, urls, client


def served(url: str, adapter: str) -> float:
    return metric(url, "goodput_lora_requests_total", adapter=adapter)


def test_a_request_naming_an_adapter_goes_to_the_replica_serving_it(env):
    gateway, urls, client = env
    before = {(u, a): served(u, a) for u in urls for a in ADAPTERS}
    for i in range(8):  # different prompts: the prefix ring alone would spread them over both replicas
        for name in ADAPTERS:
            out = client.completions.create(model=name, prompt=f"prompt number {i} " * (i + 1), max_tokens=3)
            assert out.model == name and out.usage.completion_tokens >= 1
        chat = client.chat.completions.create(
            model="left", messages=[{"role": "user", "content": f"hi {i}"}], max_tokens=2
        )
        assert chat.model == "left"
    for name, index in ADAPTERS.items():
        own, other = urls[index], urls[1 - index]
        wanted = 16 if name == "left" else 8
        assert served(own, name) - before[(own, name)] == wanted
        assert served(other, name) == before[(other, name)] == 0
    decisions = sum(
        gateway.metric("goodput_gateway_routing_decisions_total", decision=d)
        for d in ("lora_warm", "lora_free_slot", "lora_no_slot")
    )
    assert decisions >= 24


def test_the_base_model_is_still_served_by_either_replica(env):
    client = env[2]
    out = client.completions.create(model="tiny", prompt="hello", max_tokens=2)
    assert out.model == "tiny" and out.usage.completion_tokens >= 1


def test_an_unknown_adapter_is_a_404_in_openais_shape(env):
    client = env[2]
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nowhere", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert caught.value.code == "model_not_found" and caught.value.body["type"] == "invalid_request_error"
    assert "nowhere" in caught.value.message and "127.0.0.1" not in caught.value.message
