"""The gateway's picture of the cluster, built from InferenceService and EndpointSlice objects."""

from goodput_gateway.discovery import Registry, ready_urls
from goodput_gateway.loads import parse_load
from goodput_gateway.pipelines import PipelineTable


def isvc(namespace: str, name: str, spec: dict | None = None) -> dict:
    return {
        "metadata": {"namespace": namespace, "name": name},
        "spec": {"model": {"source": "file:///models/m"}, **(spec or {})},
    }


def endpoint_slice(namespace: str, name: str, service: str, endpoints: list[tuple[str, dict]]) -> dict:
    return {
        "metadata": {
            "namespace": namespace,
            "name": name,
            "labels": {"kubernetes.io/service-name": service, "serving.goodput.dev/service": service},
        },
        "ports": [{"name": "metrics", "port": 8000}, {"name": "http", "port": 8000}],
        "endpoints": [{"addresses": [a], "conditions": c} for a, c in endpoints],
    }


def test_ready_urls_leave_out_starting_and_terminating_endpoints():
    piece = endpoint_slice(
        "ns",
        "chat-abc",
        "chat",
        [
            ("10.0.0.1", {"ready": True}),
            ("10.0.0.2", {"ready": False}),
            ("10.0.0.3", {"ready": True, "terminating": True}),
            ("fd00::4", {}),
        ],
    )
    assert ready_urls(piece) == ("http://10.0.0.1:8000", "http://[fd00::4]:8000")


def test_a_model_resolves_by_served_name_across_namespaces_and_by_namespace_where_shared():
    r = Registry()
    r.services.reset(
        [
            isvc("a", "chat", {"model": {"source": "file:///m", "servedName": "llama"}}),
            isvc("b", "embed"),
            isvc("c", "llama"),
        ]
    )
    r.slices.reset(
        [
            endpoint_slice("a", "chat-1", "chat", [("10.0.0.1", {"ready": True})]),
            endpoint_slice("a", "chat-2", "chat", [("10.0.0.2", {"ready": True})]),
        ]
    )
    assert [s.name for s in r.resolve("embed")] == ["embed"]
    assert len(r.resolve("llama")) == 2  # ambiguous: the gateway asks for a namespace
    assert [s.namespace for s in r.resolve("c/llama")] == ["c"]
    assert r.resolve("nothing") == []
    assert r.ready(("a", "chat")) == ("http://10.0.0.1:8000", "http://10.0.0.2:8000")
    assert r.ready(("b", "embed")) == ()
    assert r.model_id(r.services[("b", "embed")]) == "embed"
    assert r.model_id(r.services[("c", "llama")]) == "c/llama"


def test_watch_events_update_services_and_endpoints():
    r = Registry()
    r.services.reset([])
    r.slices.reset([])
    r.services.event(
        "ADDED",
        isvc("ns", "chat", {"routing": {"policy": "least-load"}, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}),
    )
    svc = r.services[("ns", "chat")]
    assert (svc.policy, svc.min_replicas, svc.replicas) == ("least-load", 0, 0)
    r.slices.event("ADDED", endpoint_slice("ns", "chat-1", "chat", [("10.0.0.1", {"ready": True})]))
    assert r.ready(("ns", "chat")) == ("http://10.0.0.1:8000",)
    r.slices.event("MODIFIED", endpoint_slice("ns", "chat-1", "chat", [("10.0.0.1", {"ready": False})]))
    assert r.ready(("ns", "chat")) == ()
    r.slices.event("DELETED", {"metadata": {"namespace": "ns", "name": "chat-1"}})
    r.services.event("DELETED", {"metadata": {"namespace": "ns", "name": "chat"}})
    assert r.resolve("chat") == []


def test_a_service_whose_spec_does_not_parse_is_not_routed_to():
    r = Registry()
    r.services.reset([isvc("ns", "bad", {"routing": {"policy": "round-robin"}})])
    assert r.resolve("bad") == []


def test_a_slice_that_loses_its_service_label_no_longer_counts():
    r = Registry()
    r.slices.reset([endpoint_slice("ns", "chat-1", "chat", [("10.0.0.1", {"ready": True})])])
    assert r.ready(("ns", "chat")) == ("http://10.0.0.1:8000",)
    r.slices.event(
        "MODIFIED", {**endpoint_slice("ns", "chat-1", "chat", []), "metadata": {"namespace": "ns", "name": "chat-1"}}
    )
    assert r.ready(("ns", "chat")) == () and len(r.slices) == 0


def test_the_registry_is_synced_once_both_resources_are_listed():
    r = Registry()
    r.services.reset([])
    assert not r.synced
    r.slices.reset([])
    assert r.synced


def pipeline(namespace: str, name: str, steps: list) -> dict:
    return {"metadata": {"namespace": namespace, "name": name}, "spec": {"steps": steps}}


def test_the_pipeline_table_keeps_a_bad_spec_with_its_error_and_follows_watch_events():
    table = PipelineTable()
    generate = {"kind": "generate", "service": "chat"}
    table.reset([pipeline("a", "p", [generate]), pipeline("b", "p", [generate]), pipeline("a", "bad", [])])
    assert table.synced and [e.namespace for e in table.resolve("p")] == ["a", "b"]
    assert table.model_id(table[("a", "p")]) == "a/p"
    assert table.resolve("a/bad")[0].spec is None and "spec.steps" in table[("a", "bad")].error
    table.event("DELETED", {"metadata": {"namespace": "b", "name": "p"}})
    assert table.model_id(table[("a", "p")]) == "p"
    table.event("MODIFIED", pipeline("a", "bad", [generate]))
    assert table[("a", "bad")].spec is not None


def test_parse_load_sums_the_queue_and_kv_usage():
    text = """# HELP goodput_requests_waiting Requests waiting
# TYPE goodput_requests_waiting gauge
goodput_requests_waiting{model="m"} 3.0
goodput_requests_waiting_other 7
goodput_kv_cache_usage_ratio{model="m"} 0.25
goodput_requests_running{model="m"} 2.0
"""
    assert parse_load(text) == (3.0, 0.25)


def test_parse_load_reads_vllm_and_sglang_replicas_too():
    """A kind: vllm or sglang service's replicas are routed on their own engine's queue and KV series."""
    vllm = """vllm:num_requests_waiting{model_name="m"} 4.0
vllm:num_requests_running{model_name="m"} 2.0
vllm:kv_cache_usage_perc{model_name="m"} 0.5
vllm:gpu_cache_usage_perc{model_name="m"} 0.5
"""
    assert parse_load(vllm) == (4.0, 0.5)  # both generations of the KV gauge: counted once
    sglang = """sglang:num_queue_reqs{model_name="m"} 2
sglang:token_usage{model_name="m"} 0.75
"""
    assert parse_load(sglang) == (2.0, 0.75)
