"""spec.engine.kvOffload: the runtime's offload flags, the tier's volume and resources in the pod, and
refusals naming the field (engines without the tier, bad sizes, shapes the tier does not run with)."""

import pytest

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import engines
from goodput_operator.builders import build_deployment, owner_reference
from goodput_operator.kv_offload_pod import OFFLOAD_DIR, plan_status
from goodput_operator.settings import Settings
from goodput_runtime.__main__ import build_parser

OWNER = owner_reference("chat", "0000-uid")
SETTINGS = Settings(runtime_image="registry.local/goodput-runtime:test")


def _svc(offload, **spec):
    body = {"model": {"source": "hf://org/m"}, "resources": {"gpu": 1, "memory": "16Gi"}, **spec}
    body["engine"] = {**body.get("engine", {}), "kvOffload": offload}
    svc = parse("chat", "ns", body)
    engines.validate(svc)
    return svc


def _pod(svc):
    return build_deployment(svc, SETTINGS, OWNER)["spec"]["template"]["spec"]


def test_a_gpu_replica_gets_a_host_memory_tier_and_the_memory_it_takes():
    svc = _svc({"bytes": "8Gi"})
    pod = _pod(svc)
    (container,) = pod["containers"]
    parsed = build_parser().parse_args(container["args"])
    assert (parsed.kv_offload_bytes, parsed.kv_offload_dir) == (8 << 30, OFFLOAD_DIR)
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-offload")
    assert volume["emptyDir"] == {"medium": "Memory", "sizeLimit": str(8 << 30)}
    assert {"name": "kv-offload", "mountPath": OFFLOAD_DIR} in container["volumeMounts"]
    # the tier's pages count against the container: its memory grows by the tier's bytes
    assert container["resources"]["requests"]["memory"] == str(24 << 30)
    assert container["resources"]["limits"]["memory"] == str(24 << 30)
    assert "ephemeral-storage" not in container["resources"]["requests"]


def test_without_a_memory_request_the_tier_alone_is_requested():
    svc = parse("chat", "ns", {"model": {"source": "hf://org/m"}, "engine": {"kvOffload": {"bytes": "2Gi"}}})
    resources = _pod(svc)["containers"][0]["resources"]
    assert resources["requests"]["memory"] == str(2 << 30)
    assert "memory" not in resources.get("limits", {})


def test_a_disk_tier_asks_for_local_disk_and_leaves_memory_alone():
    svc = _svc({"bytes": "20Gi", "medium": "disk"})
    pod = _pod(svc)
    volume = next(v for v in pod["volumes"] if v["name"] == "kv-offload")
    assert volume["emptyDir"] == {"sizeLimit": str(20 << 30)}
    requests = pod["containers"][0]["resources"]["requests"]
    assert requests["ephemeral-storage"] == str(20 << 30) and requests["memory"] == "16Gi"


def test_a_cpu_replica_defaults_to_disk():
    svc = parse(
        "chat",
        "ns",
        {"model": {"source": "hf://org/m"}, "resources": {"gpu": 0}, "engine": {"kvOffload": {"bytes": "1Gi"}}},
    )
    assert svc.engine.kv_offload.medium == "disk"


def test_without_kv_offload_nothing_changes():
    svc = parse("chat", "ns", {"model": {"source": "hf://org/m"}, "resources": {"gpu": 1, "memory": "16Gi"}})
    pod = _pod(svc)
    assert "--kv-offload-bytes" not in pod["containers"][0]["args"]
    assert all(v["name"] != "kv-offload" for v in pod["volumes"])
    assert pod["containers"][0]["resources"]["requests"]["memory"] == "16Gi"


@pytest.mark.parametrize(
    ("offload", "spec", "field", "words"),
    [
        ({"bytes": "lots"}, {}, "spec.engine.kvOffload.bytes", "not a Kubernetes quantity"),
        ({"bytes": "512Ki"}, {}, "spec.engine.kvOffload.bytes", "below the least tier of 1Mi"),
        ({"bytes": "1.5"}, {}, "spec.engine.kvOffload.bytes", "whole number of bytes"),
        ({"bytes": "2Ei"}, {}, "spec.engine.kvOffload.bytes", "above 1Pi"),
        ({}, {}, "spec.engine.kvOffload.bytes", "is required"),
        ({"bytes": "1Gi", "medium": "tape"}, {}, "spec.engine.kvOffload.medium", "not one of memory, disk"),
        ({"bytes": "1Gi", "medium": "memory"}, {"resources": {"gpu": 0}}, "spec.engine.kvOffload.medium", "CPU"),
        (
            {"bytes": "1Gi"},
            {"parallelism": {"tensor": 2}, "resources": {"gpu": 2}},
            "spec.engine.kvOffload",
            "one rank per replica",
        ),
        ({"bytes": "1Gi"}, {"engine": {"prefixCaching": False}}, "spec.engine.kvOffload", "engine.prefixCaching"),
        ({"bytes": "1Gi"}, {"engine": {"kind": "vllm"}}, "spec.engine.kvOffload", "engine.kind vllm"),
        ({"bytes": "1Gi"}, {"engine": {"kind": "sglang"}}, "spec.engine.kvOffload", "engine.kind sglang"),
    ],
)
def test_what_the_tier_cannot_be_is_refused_naming_the_field(offload, spec, field, words):
    with pytest.raises(SpecError) as err:
        _svc(offload, **spec)
    assert err.value.field == field
    assert str(err.value).startswith(field + ":") and words in str(err.value)


def test_the_capacity_plan_counts_whole_blocks_and_refuses_a_tier_below_one():
    # Qwen2.5-7B: 57,344 bytes of KV per token; 16-token blocks of 917,504 bytes plus each slot's header
    svc = _svc({"bytes": "1Gi"})
    status = plan_status(svc, 57_344)
    assert status == {"kvOffloadBytes": 1 << 30, "kvOffloadTokens": (1 << 30) // (917_504 + 28) * 16}
    with pytest.raises(SpecError) as err:
        plan_status(_svc({"bytes": "1Gi"}, engine={"extraArgs": ["--block-size", "32"]}), 40 << 20)
    assert err.value.field == "spec.engine.kvOffload.bytes" and "less than one KV block" in str(err.value)
