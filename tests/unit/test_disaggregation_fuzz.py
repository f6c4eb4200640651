"""Fuzzing spec.disaggregation: any spec the CRD admits with a disaggregation block drawn from its schema
builds both roles' children, whose goodput command lines the runtime's own parser takes, or is refused
naming a field of the schema; never an exception of another kind."""

from __future__ import annotations

import json
from typing import Any

from crd_specs import NAMES, schema_at, spec_schema, strategy, with_defaults
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import builders, engines, network, roles
from goodput_operator.settings import Settings
from goodput_runtime.__main__ import build_parser

OWNER = builders.owner_reference("svc", "uid-1")


def disaggregated_specs() -> st.SearchStrategy[dict[str, Any]]:
    """Specs the CRD admits that always carry spec.disaggregation, as the operator reads them."""
    schema = spec_schema()
    block = strategy(schema["properties"]["disaggregation"], "spec.disaggregation")
    return st.tuples(strategy(schema), block).map(
        lambda pair: with_defaults(schema, {**pair[0], "disaggregation": pair[1]})
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=disaggregated_specs(), name=NAMES)
def test_every_admitted_disaggregation_builds_both_roles_or_is_refused_naming_a_field(
    spec: dict[str, Any], name: str
) -> None:
    try:
        svc = parse(name, "team", spec)
        engines.validate(svc)
    except SpecError as err:
        assert err.field.startswith("metadata.") or schema_at(err.field) is not None, err.field
        assert str(err).startswith(err.field + ": ")
        return
    assert svc.disaggregation is not None
    pools = svc.disaggregation
    assert pools.prefill.min_replicas <= pools.prefill.max_replicas
    assert pools.decode.min_replicas <= svc.desired_replicas <= pools.decode.max_replicas or svc.suspend
    built = [
        *roles.build_prefill(svc, Settings(), OWNER),
        *roles.build_decode(svc, Settings(), OWNER),
        roles.build_role_pdb(svc, OWNER, roles.PREFILL, "policy/v1"),
        roles.build_role_pdb(svc, OWNER, roles.DECODE, "policy/v1"),
        network.build_network_policy(svc, Settings(), OWNER),
    ]
    for child in (c for c in built if c is not None):
        json.dumps(child)
        assert child["metadata"]["ownerReferences"] == [OWNER]
    for deployment in built[0], built[2]:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert all(labels.get(k) == v for k, v in deployment["spec"]["selector"]["matchLabels"].items())
        if svc.engine.kind == engines.GOODPUT and not svc.engine.extra_args:  # those are passed as they are
            args = build_parser().parse_args(deployment["spec"]["template"]["spec"]["containers"][0]["args"])
            assert args.kv_transfer_role == labels[roles.ROLE_LABEL]
