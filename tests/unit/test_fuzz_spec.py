"""Fuzzing the operator's spec handling: any spec the CRD admits is built into children or
refused naming a field of the schema, never an exception of another kind."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from crd_specs import NAMES, schema_at, specs
from hypothesis import HealthCheck, example, given, settings

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import builders, engines, network
from goodput_operator.autoscaling import external
from goodput_operator.k8s import apply_body
from goodput_operator.settings import Settings

OWNER = builders.owner_reference("svc", "uid-1")


def children(spec: dict[str, Any], name: str = "svc") -> list[dict[str, Any]]:
    """What one reconcile would apply (every optional child included), or SpecError."""
    svc = parse(name, "team", spec)
    engines.validate(svc)
    built = [
        builders.build_deployment(svc, Settings(), OWNER),
        builders.build_service(svc, OWNER),
        builders.build_pdb(svc, OWNER),
        builders.build_service_monitor(svc, OWNER),
        builders.build_pod_monitor(svc, OWNER),
        external.build_hpa(svc, OWNER),
        external.build_scaled_object(svc, OWNER),
        network.build_network_policy(svc, Settings(), OWNER),
    ]
    return [c for c in built if c is not None]


def assert_names_a_field(err: SpecError) -> None:
    assert err.field.startswith("metadata.") or schema_at(err.field) is not None, err.field
    assert str(err).startswith(err.field + ": ") and len(str(err)) > len(err.field) + 5
    assert err.reason and err.reason[0].isupper() and " " not in err.reason


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@example(spec={"model": {"source": "file:///m"}, "resources": {"cpu": "0E1000000"}}, name="a")
@example(spec={"model": {"source": "file:///m", "tokenSecretRef": {"name": ":"}}}, name="a")
@given(spec=specs(), name=NAMES)
def test_every_admitted_spec_builds_or_is_refused_naming_a_field(spec: dict[str, Any], name: str) -> None:
    try:
        built = children(spec, name)
    except SpecError as err:
        assert_names_a_field(err)
        return
    for child in built:
        json.dumps(child)  # plain data, as the API takes it
        assert child["metadata"]["ownerReferences"] == [OWNER]
        assert child["metadata"]["namespace"] == "team"


# Defects the fuzzing found, kept as plain examples


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"resources": {"cpu": "0E1000000"}}, "spec.resources.cpu"),  # was decimal.Overflow
        ({"resources": {"memory": "-1Gi"}}, "spec.resources.memory"),
        ({"model": {"source": "file:///m", "tokenSecretRef": {"name": ":"}}}, "spec.model.tokenSecretRef.name"),
        ({"auth": {"apiKeySecretRef": {"name": "keys", "key": "a key"}}}, "spec.auth.apiKeySecretRef.key"),
        ({"resources": {"gpu": 1, "gpuResourceName": "gpu"}}, "spec.resources.gpuResourceName"),
        ({"image": " runtime:1"}, "spec.image"),
        ({"replicas": 2**31}, "spec.replicas"),
        ({"template": {"nodeSelector": {"zone": "a b"}}}, "spec.template.nodeSelector[zone]"),
        ({"template": {"volumes": [{"name": "tmp", "emptyDir": {}}]}}, "spec.template.volumes[0].name"),
        (
            {
                "template": {
                    "volumes": [{"name": "x", "emptyDir": {}}],
                    "volumeMounts": [{"name": "y", "mountPath": "/y"}],
                }
            },
            "spec.template.volumeMounts[0].name",
        ),
        (
            {
                "template": {
                    "volumes": [{"name": "x", "emptyDir": {}}],
                    "volumeMounts": [{"name": "x", "mountPath": "/tmp"}],
                }
            },
            "spec.template.volumeMounts[0].mountPath",
        ),
    ],
)
def test_names_the_api_server_would_refuse_in_a_child_are_refused_naming_the_field(spec, field) -> None:
    with pytest.raises(SpecError) as caught:
        children({"model": {"source": "file:///m"}, **spec})
    assert caught.value.field == field


def test_characters_beyond_the_bmp_reach_server_side_apply_as_yaml_escapes() -> None:
    manifest = {"args": ["\U0001f600 smile", "\\ud83d\\ude00 (written out)", "\u00e9\u0085"]}
    body = apply_body(manifest).decode()
    assert "\\U0001f600" in body and "\\ud83d\\ude00" not in body.replace("\\\\", "")
    assert yaml.safe_load(body) == manifest  # what the API server's YAML reader sees
