"""Fuzzing the operator's spec handling: any spec the CRD admits is built into children or
refused naming a field of the schema, never an exception of another kind."""

from __future__ import annotations

import json
from typing import Any

from crd_specs import NAMES, schema_at, specs
from hypothesis import HealthCheck, given, settings

from goodput_operator import builders, engines, network
from goodput_operator.autoscaling import external
from goodput_operator.settings import Settings
from goodput_operator.spec import SpecError, parse

OWNER = builders.owner_reference("svc", "uid-1")


def children(spec: dict[str, Any], name: str = "svc") -> list[dict[str, Any]]:
    """What one reconcile would apply (every optional child included), or SpecError."""
    svc = parse(name, "team", spec)
    engines.validate(svc)
    built = [builders.build_deployment(svc, Settings(), OWNER), builders.build_service(svc, OWNER),
             builders.build_pdb(svc, OWNER), builders.build_service_monitor(svc, OWNER),
             builders.build_pod_monitor(svc, OWNER), external.build_hpa(svc, OWNER),
             external.build_scaled_object(svc, OWNER), network.build_network_policy(svc, Settings(), OWNER)]
    return [c for c in built if c is not None]


def assert_names_a_field(err: SpecError) -> None:
    assert err.field.startswith("metadata.") or schema_at(err.field) is not None, err.field
    assert str(err).startswith(err.field + ": ") and len(str(err)) > len(err.field) + 5
    assert err.reason and err.reason[0].isupper() and " " not in err.reason


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
