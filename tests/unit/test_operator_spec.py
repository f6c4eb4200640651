"""Parsing an InferenceService spec: defaults, and errors that name the field."""

import pytest

from goodput_contract.api.spec import SpecError, parse, parse_duration, parse_source

MINIMAL = {"model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct"}}


def test_minimal_spec_gets_the_documented_defaults():
    svc = parse("chat", "ns", MINIMAL)
    assert svc.model.source.repo == "Qwen/Qwen2.5-7B-Instruct"
    assert svc.model.revision == "main"
    assert svc.model.served_name == "chat"
    assert svc.tensor_parallel == 1 and svc.resources.gpu == 1
    assert svc.resources.gpu_resource_name == "nvidia.com/gpu"
    assert svc.autoscaling.mode == "none"
    assert svc.replicas is None and svc.desired_replicas == 1
    assert svc.routing.policy == "prefix"


def test_batch_max_replicas_is_read_and_defaults_to_none():
    assert parse("chat", "ns", MINIMAL).batch.max_replicas == 0
    spec = {
        **MINIMAL,
        "autoscaling": {"mode": "goodput", "minReplicas": 0, "maxReplicas": 4},
        "batch": {"maxReplicas": 2},
    }
    assert parse("chat", "ns", spec).batch.max_replicas == 2


def test_routing_policy_is_read_and_an_unknown_one_named():
    assert parse("chat", "ns", {**MINIMAL, "routing": {"policy": "least-load"}}).routing.policy == "least-load"
    with pytest.raises(SpecError) as err:
        parse("chat", "ns", {**MINIMAL, "routing": {"policy": "round-robin"}})
    assert err.value.field == "spec.routing.policy"


def test_scale_subresource_value_wins_over_min_replicas():
    spec = {**MINIMAL, "replicas": 3, "autoscaling": {"minReplicas": 1, "maxReplicas": 8}}
    assert parse("chat", "ns", spec).desired_replicas == 3
    spec = {**MINIMAL, "autoscaling": {"mode": "goodput", "minReplicas": 2, "maxReplicas": 8}}
    assert parse("chat", "ns", spec).desired_replicas == 2


@pytest.mark.parametrize(
    ("text", "seconds"), [("500ms", 0.5), ("2s", 2.0), ("0.25s", 0.25), ("1m", 60.0), ("50ms", 0.05)]
)
def test_durations(text, seconds):
    assert parse_duration(text, "slo.ttft") == pytest.approx(seconds)


def test_sources():
    assert parse_source("pvc://weights/llama/8b").claim == "weights"
    assert parse_source("pvc://weights/llama/8b").path == "/llama/8b"
    assert parse_source("pvc://weights").path == "/"
    assert parse_source("file:///models/tiny").path == "/models/tiny"
    assert parse_source("hf://gpt2").repo == "gpt2"
    gguf = parse_source("hf://acme/tiny-GGUF/tiny.Q4_K_M.gguf")
    assert (gguf.repo, gguf.file) == ("acme/tiny-GGUF", "tiny.Q4_K_M.gguf")
    assert parse_source("hf://acme/tiny").file == ""
    with pytest.raises(SpecError) as err:
        parse_source("s3://bucket/model")
    assert err.value.field == "spec.model.source"


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        (
            {"autoscaling": {"minReplicas": 4, "maxReplicas": 2}},
            "spec.autoscaling.maxReplicas",
            "ReplicaBoundsInverted",
        ),
        ({"parallelism": {"tensor": 2}, "resources": {"gpu": 1}}, "spec.resources.gpu", "GPUCountMismatch"),
        ({"slo": {"ttft": "0ms"}}, "spec.slo.ttft", "InvalidSpec"),
        ({"slo": {"tpot": "fast"}}, "spec.slo.tpot", "InvalidSpec"),
        ({"resources": {"memory": "lots"}}, "spec.resources.memory", "InvalidSpec"),
        ({"model": {"source": "pvc://w/m", "cacheClaimName": "w"}}, "spec.model.cacheClaimName", "CacheClaimIsSource"),
        (
            {"autoscaling": {"mode": "goodput", "maxReplicas": 2}, "batch": {"maxReplicas": 3}},
            "spec.batch.maxReplicas",
            "BatchReplicasAboveMax",
        ),
        ({"batch": {"maxReplicas": 1}}, "spec.batch.maxReplicas", "BatchReplicasWithoutAutoscaling"),
        (
            {"autoscaling": {"mode": "goodput", "maxReplicas": 2}, "batch": {"maxReplicas": "2"}},
            "spec.batch.maxReplicas",
            "InvalidSpec",
        ),
    ],
)
def test_invalid_specs_name_the_field(spec, field, reason):
    with pytest.raises(SpecError) as err:
        parse("chat", "ns", {**MINIMAL, **spec})
    assert err.value.field == field
    assert err.value.reason == reason
    assert str(err.value).startswith(field + ": ")


def test_names_too_long_for_children_are_refused():
    with pytest.raises(SpecError) as err:
        parse("a" * 56, "ns", MINIMAL)
    assert err.value.field == "metadata.name"


def test_cpu_mode_takes_zero_gpus():
    svc = parse("cpu", "ns", {**MINIMAL, "parallelism": {"tensor": 2}, "resources": {"gpu": 0}})
    assert svc.resources.gpu == 0 and svc.tensor_parallel == 2
