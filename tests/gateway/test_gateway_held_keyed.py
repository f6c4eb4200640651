"""Held routing for a service whose runtimes ask for an API key (spec.auth.apiKeySecretRef).

Two runtime processes started with ``--api-key`` behind a gateway that discovers them from a real API
server: the gateway's KV index subscribes to each runtime's ``/kv/events`` and asks ``/kv/digests`` with
the service's own key, as it proxies requests, so requests go to the replica holding their prefix.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request

from gateway_helpers import Started, metric, post_json, publish, tiny_spec, wait_ready
from harness import wait_for

from goodput_contract import metrics as names

RUNTIME_KEY, CLIENT_KEY = "sk-runtime-5d20e1", "sk-client-b7c431"  # the Secret holds both; the runtimes one
FLAGS = ("--block-size", "4", "--max-model-len", "128", "--api-key", RUNTIME_KEY)
WORDS = ["river", "stone", "cloud", "lamp", "orchard", "harbor", "violet", "engine", "quiet", "signal"]


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def held(url: str) -> dict[str, set[str]]:
    request = urllib.request.Request(f"{url}/kv/events", headers={"Authorization": f"Bearer {RUNTIME_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return {tier: set(blocks) for tier, blocks in json.loads(response.readline())["tiers"].items()}


def complete(url: str, model: str, prompt: str, key: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 1}
    status, _, answer = post_json(f"{url}/v1/completions", body, {"Authorization": f"Bearer {key}"})
    assert status == 200, answer


def test_a_keyed_service_is_routed_by_what_its_replicas_hold(cluster, tiny_model_dir, tmp_path):
    namespace = f"gwheld-{int(time.time()) % 100000}"
    with Started() as started:
        started.namespaces(cluster, namespace)
        a = started.replica("keyed-a", tiny_model_dir, tmp_path, *FLAGS)
        b = started.replica("keyed-b", tiny_model_dir, tmp_path, *FLAGS)
        cluster.core.create_namespaced_secret(
            namespace, {"metadata": {"name": "keys"}, "stringData": {"apiKey": f"{RUNTIME_KEY},{CLIENT_KEY}"}}
        )
        cluster.create_service(namespace, "chat", tiny_spec(auth={"apiKeySecretRef": {"name": "keys"}}))
        wait_ready(a, b)
        ua, ub = (f"http://127.0.0.1:{p.port}" for p in (a, b))
        p_prompt, q_prompt = text(21, 14), text(22, 14)
        complete(ua, "tiny", p_prompt, RUNTIME_KEY)  # A holds P, B holds Q, each on its device
        complete(ub, "tiny", q_prompt, RUNTIME_KEY)
        publish(cluster, namespace, "chat", "a", a.port)
        publish(cluster, namespace, "chat", "b", b.port)
        g = started.gateway(cluster.kubeconfig, tmp_path / "gateway.log", "--scrape-seconds", "0.3")
        model = f"{namespace}/tiny"

        def index_synced() -> bool:  # the runtimes answer /kv/events only with the key
            device = len(held(ua)["device"]) + len(held(ub)["device"])
            return device > 0 and g.metric("goodput_gateway_kv_index_blocks", tier="device") >= device

        wait_for(index_synced, 60, "the gateway's index to hold what the keyed runtimes hold")

        def ask(prompt: str) -> tuple[float, float]:
            before = (metric(ua, names.REQUESTS), metric(ub, names.REQUESTS))
            complete(g.url, model, prompt, CLIENT_KEY)
            return metric(ua, names.REQUESTS) - before[0], metric(ub, names.REQUESTS) - before[1]

        assert ask(p_prompt + " and more") == (1, 0)
        assert ask(q_prompt + " and more") == (0, 1)
        labels = {"namespace": namespace, "service": "chat"}
        assert g.metric(names.GATEWAY_ROUTING_DECISIONS, decision="held_device", **labels) == 2
        assert g.metric("goodput_gateway_held_lookups_total", result="hit", **labels) == 2
        assert g.metric("goodput_gateway_held_lookups_total", result="stale", **labels) == 0
        assert "Traceback" not in g.log()
