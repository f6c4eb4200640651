"""LoraAdapter's spec and the operator's decisions about it, without a cluster: what is refused (naming
the field), where the pods read the adapter, and which replicas load or unload it."""

from __future__ import annotations

import pytest

from goodput_contract.api.lora_adapter_spec import parse_lora_adapter
from goodput_contract.api.spec import SpecError, parse
from goodput_operator.engines import ENGINES, VLLM
from goodput_operator.lora_adapters import Outcome, Replica, check_service, error_message, plan, status_body

BASE = {"model": {"source": "file:///models/tiny", "servedName": "tiny"}, "resources": {"gpu": 0}}


def service(lora=None, source="file:///models/tiny", engine=None):
    spec = {**BASE, "model": {**BASE["model"], "source": source, **({"lora": lora} if lora is not None else {})}}
    if engine:
        spec["engine"] = {"kind": engine}
    return parse("chat", "ns", spec)


def refusal(name, spec, svc=None):
    with pytest.raises(SpecError) as err:
        adapter = parse_lora_adapter(name, spec)
        check_service(adapter, svc or service({"runtimeUpdates": True}))
    return str(err.value)


def test_the_spec_is_read_with_its_defaults():
    adapter = parse_lora_adapter("sql", {"service": "chat", "source": "file:///a/sql"})
    assert (adapter.replicas, adapter.pinned, adapter.source.path) == (None, False, "/a/sql")
    assert adapter.wanted(3) == 3
    two = parse_lora_adapter("sql", {"service": "chat", "source": "file:///a", "replicas": 2, "pinned": True})
    assert (two.wanted(3), two.wanted(1), two.pinned) == (2, 1, True)
    assert parse_lora_adapter("sql", {"service": "chat", "source": "file:///a", "replicas": "2"}).replicas == 2


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"service": "chat", "source": "hf://sql"}, "spec.source: "),
        ({"service": "chat", "source": "hf://acme/sql@"}, "spec.source: "),
        ({"service": "chat", "source": "s3://bucket/sql"}, "spec.source: "),
        ({"service": "chat", "source": "file:///a", "replicas": 0}, "spec.replicas: "),
        ({"service": "chat", "source": "file:///a", "replicas": "some"}, "spec.replicas: "),
        ({"service": "Chat", "source": "file:///a"}, "spec.service: "),
    ],
)
def test_what_the_schema_lets_through_is_refused_naming_the_field(spec, field):
    assert refusal("sql", spec).startswith(field)


def test_the_service_must_allow_run_time_updates_and_leave_the_name_free():
    spec = {"service": "chat", "source": "file:///a"}
    assert "runtimeUpdates" in refusal("sql", spec, service({"maxAdapters": 2}))
    assert "runtimeUpdates" in refusal("sql", spec, service(None))
    assert refusal("tiny", spec).startswith("metadata.name: 'tiny' is the served name")
    fixed = service({"runtimeUpdates": True, "adapters": [{"name": "sql", "source": "file:///b"}]})
    assert refusal("sql", spec, fixed).startswith("metadata.name: 'sql' is an adapter of")
    vllm = service({"runtimeUpdates": True}, engine=VLLM)
    assert refusal("sql", {**spec, "pinned": True}, vllm).startswith("spec.pinned: ")


def test_a_claim_is_read_where_the_service_mounts_it():
    svc = service({"runtimeUpdates": True, "adapters": [{"name": "base", "source": "pvc://loras/base"}]})
    assert check_service(parse_lora_adapter("sql", {"service": "chat", "source": "pvc://loras/sql"}), svc) == (
        "/mnt/loras/base/sql"
    )
    on_model_claim = service({"runtimeUpdates": True}, source="pvc://weights/tiny")
    adapter = parse_lora_adapter("sql", {"service": "chat", "source": "pvc://weights/adapters/sql"})
    assert check_service(adapter, on_model_claim) == "/mnt/models/adapters/sql"
    assert refusal("sql", {"service": "chat", "source": "pvc://other/sql"}, svc).startswith(
        "spec.source: claim 'other' is not mounted"
    )


def test_the_runtime_is_started_to_take_adapters_at_run_time_only_when_asked():
    on, off = service({"runtimeUpdates": True}), service({"maxAdapters": 2})
    assert "--allow-runtime-lora-updating" in ENGINES["goodput"].args(on)
    assert "--allow-runtime-lora-updating" not in ENGINES["goodput"].args(off)
    vllm_on, vllm_off = service({"runtimeUpdates": True}, engine=VLLM), service({"maxAdapters": 2}, engine=VLLM)
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"} in ENGINES[VLLM].env(vllm_on)
    assert all(e["name"] != "VLLM_ALLOW_RUNTIME_LORA_UPDATING" for e in ENGINES[VLLM].env(vllm_off))
    with pytest.raises(SpecError, match=r"spec\.model\.lora\.runtimeUpdates"):
        service({"runtimeUpdates": "yes"})


def replicas(*names):
    return [Replica(n, f"http://{n}") for n in names]


def test_the_plan_keeps_holders_loads_the_rest_in_name_order_and_unloads_extras():
    every = parse_lora_adapter("sql", {"service": "chat", "source": "file:///a"})
    keep, load, unload = plan(every, replicas("c", "a", "b"), {"b"})
    assert ([r.name for r in keep], [r.name for r in load], unload) == (["b"], ["a", "c"], [])
    one = parse_lora_adapter("sql", {"service": "chat", "source": "file:///a", "replicas": 1})
    keep, load, unload = plan(one, replicas("a", "b", "c"), {"b", "c"})
    assert ([r.name for r in keep], load, [r.name for r in unload]) == (["b"], [], ["c"])
    keep, load, unload = plan(one, replicas("b", "a"), set())
    assert (keep, [r.name for r in load], unload) == ([], ["a"], [])
    assert plan(every, [], set()) == ([], [], [])


def test_errors_are_read_in_openai_and_vllm_shapes():
    assert error_message('{"error": {"message": "rank 32 is above 16"}}') == "rank 32 is above 16"
    assert error_message('{"message": "The lora adapter was not found", "code": 404}') == (
        "The lora adapter was not found"
    )
    assert error_message("upstream connect error") == "upstream connect error"


def test_the_status_counts_replicas_and_clears_the_error():
    body = {"metadata": {"generation": 3}, "status": {"lastError": "old"}}
    status = status_body(body, Outcome("Ready", ["a", "b"], 2, loaded_generation=3))
    assert status["replicaCount"] == "2/2" and status["lastError"] is None and status["loadedGeneration"] == 3
    assert status["observedGeneration"] == 3 and status["phase"] == "Ready"


def test_an_hf_adapter_goes_to_the_runtime_as_is_and_to_vllm_as_a_repository_id():
    adapter = parse_lora_adapter("sql", {"service": "chat", "source": "hf://acme/sql-lora@v2"})
    assert check_service(adapter, service({"runtimeUpdates": True})) == "hf://acme/sql-lora@v2"
    plain = parse_lora_adapter("sql", {"service": "chat", "source": "hf://acme/sql-lora"})
    on_vllm = parse(
        "chat",
        "ns",
        {
            "model": {"source": "hf://org/m", "servedName": "chat", "lora": {"runtimeUpdates": True}},
            "engine": {"kind": "vllm"},
            "resources": {"gpu": 1},
        },
    )
    assert check_service(plain, on_vllm) == "acme/sql-lora"
    with pytest.raises(SpecError) as caught:
        check_service(adapter, on_vllm)
    assert caught.value.field == "spec.source" and "revision" in str(caught.value)
