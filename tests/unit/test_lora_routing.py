"""The gateway's side of LoRA adapters: adapter names resolve to their service (from the CR and from
the replicas' /v1/models), a replica's adapters are read from the runtime's own /metrics exposition, and
a request goes to a replica where its adapter is loaded, else one with a free slot, else any, within the
load bound, the same (adapter, prefix) to the same replica."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, generate_latest

from goodput_gateway import routing
from goodput_gateway.discovery import Registry, service_of
from goodput_gateway.routing import AdapterState, choose_adapter, lora_state
from goodput_runtime.lora_metrics import LoraMetrics


def exposition(running: list[str], waiting: list[str], max_lora: int = 2) -> str:
    registry = CollectorRegistry()
    metrics = LoraMetrics(registry, "base", max_lora)
    metrics.record_adapters(["old"], [], (1, 1, 1))  # replaced: only the newest series is kept
    metrics.record_adapters(running, waiting, (2, 2, 2))
    return generate_latest(registry).decode()


def test_the_runtimes_gauge_reads_back_as_the_replicas_adapters():
    state = lora_state(exposition(["a", "b"], ["c"], 3))
    assert state == AdapterState(frozenset({"a", "b"}), frozenset({"c"}), 3)
    assert state.loaded("c") and not state.loaded("d") and not state.free_slot
    assert lora_state(exposition([], [])).free_slot
    vllm = (
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="x",waiting_lora_adapters=""} 1.7e9\n'
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="y",waiting_lora_adapters=""} 1.8e9\n'
    )
    assert lora_state(vllm).running == {"y"}  # the newest sample
    assert lora_state("goodput_requests_running 3\n") is None


STATES = {
    "http://warm": AdapterState(frozenset({"sql"}), frozenset(), 1),  # its one slot holds sql
    "http://free": AdapterState(frozenset({"other"}), frozenset(), 2),
    "http://full": AdapterState(frozenset({"x", "y"}), frozenset(), 2),
}
REPLICAS = sorted(STATES)


def test_warm_first_then_a_free_slot_then_a_full_replica():
    rng = random.Random(0)
    loads = dict.fromkeys(REPLICAS, 0.0)
    assert choose_adapter("prefix", REPLICAS, loads, 1, "sql", STATES, rng=rng) == routing.Choice(
        "http://warm", routing.LORA_WARM
    )
    assert choose_adapter("prefix", REPLICAS, loads, 1, "new", STATES, rng=rng).replica == "http://free"
    # past the load bound the warm replica hands over to the next tier
    busy = {"http://warm": 6.0, "http://free": 0.0, "http://full": 0.0}
    assert choose_adapter("prefix", REPLICAS, busy, 1, "sql", STATES, rng=rng).decision == routing.LORA_FREE_SLOT
    # every replica full: one without a slot gets it
    full = {r: AdapterState(frozenset({"x", "y"}), frozenset(), 2) for r in REPLICAS}
    assert choose_adapter("prefix", REPLICAS, loads, 1, "new", full, rng=rng).decision == routing.LORA_NO_SLOT
    # a replica not scraped yet counts as having a free slot
    assert choose_adapter("prefix", ["http://a"], {}, 1, "sql", {}, rng=rng).decision == routing.LORA_FREE_SLOT


def test_the_same_adapter_and_prefix_stay_on_one_replica_among_the_warm_ones():
    warm = {f"http://r{i}": AdapterState(frozenset({"sql"}), frozenset(), 4) for i in range(4)}
    replicas = sorted(warm)
    loads = dict.fromkeys(replicas, 0.0)
    picks = {choose_adapter("prefix", replicas, loads, 42, "sql", warm).replica for _ in range(20)}
    assert len(picks) == 1
    spread = {choose_adapter("prefix", replicas, loads, key, "sql", warm).replica for key in range(200)}
    assert len(spread) == 4  # other prefixes spread over the warm replicas


def isvc(name: str, lora: dict | None) -> dict:
    model = {"source": "hf://org/model", "servedName": name, **({"lora": lora} if lora else {})}
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": {"model": model}}


def test_adapter_names_resolve_to_their_service_from_the_cr_and_from_its_replicas():
    registry = Registry()
    registry.services.fill(
        {
            ("ns", "chat"): service_of(isvc("chat", {"adapters": [{"name": "sql", "source": "file:///a"}]})),
            ("ns", "other"): service_of(isvc("other", None)),
        }
    )
    chat = registry.resolve("sql")
    assert [s.name for s in chat] == ["chat"] and chat[0].max_adapters == 4
    assert registry.adapter_of(chat[0], "sql") == "sql" and registry.adapter_of(chat[0], "chat") is None
    assert registry.resolve("ns/sql") == chat
    assert registry.resolve("loaded-later") == []
    registry.learn_adapters(
        ("ns", "other"), [{"id": "other", "parent": None}, {"id": "loaded-later", "parent": "other"}]
    )
    assert [s.name for s in registry.resolve("loaded-later")] == ["other"]
    assert [s.name for s in registry.resolve("chat")] == ["chat"]  # a served name wins over an adapter's
