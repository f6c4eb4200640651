"""Fuzzing InferenceService specs against a real API server.

Specs are drawn from the CRD's own schema. Many go through the operator's parsing and builders
in-process, and the children it would apply are sent to the API server with dryRun=All: a spec
the CRD admits must never build a child the server refuses (the operator would fail on it at
every pass). A few go the whole way, as objects the real operator reconciles: each ends
Valid=True with its Deployment, or Valid=False naming a field of the schema.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from crd_specs import schema_at, specs
from harness import GROUP, PLURAL, VERSION, wait_for
from hypothesis import HealthCheck, Phase, event, given, reject, settings
from kubernetes.client.exceptions import ApiException

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import builders, engines, network
from goodput_operator.k8s import resource_path
from goodput_operator.settings import Settings

# each example costs API calls: no shrinking (a failure prints its spec whole)
SLOW_EXAMPLES = settings(
    deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, phases=[Phase.explicit, Phase.generate]
)


@pytest.fixture(scope="module")
def fuzz_namespace(cluster) -> str:
    with cluster.scratch_namespace("fuzz") as name:
        yield name


def dry_run_create(cluster, manifest: dict[str, Any]) -> tuple[int, str]:
    path = resource_path(manifest["apiVersion"], manifest["kind"], manifest["metadata"]["namespace"])
    request = cluster.api.param_serialize(
        "POST",
        path,
        query_params=[("dryRun", "All")],
        body=manifest,
        auth_settings=["BearerToken"],
        header_params={"Accept": "application/json", "Content-Type": "application/json"},
    )
    response = cluster.api.call_api(*request, _request_timeout=30)
    return response.status, response.read().decode(errors="replace")


@settings(SLOW_EXAMPLES, max_examples=60)
@given(spec=specs())
def test_no_admitted_spec_builds_a_child_the_server_refuses(cluster, fuzz_namespace, spec) -> None:
    try:
        svc = parse("fuzz", fuzz_namespace, spec)
        engines.validate(svc)
    except SpecError as err:
        assert schema_at(err.field) is not None, err.field
        return
    owner = builders.owner_reference("fuzz", str(uuid.uuid4()))
    children = [
        builders.build_deployment(svc, Settings(), owner),
        builders.build_service(svc, owner),
        builders.build_pdb(svc, owner, "policy/v1beta1"),
        network.build_network_policy(svc, Settings(), owner),
    ]
    for child in filter(None, children):
        status, body = dry_run_create(cluster, child)
        assert 200 <= status < 300, (child["kind"], status, body[:2000], json.dumps(spec)[:2000])


def reconciled(cluster, namespace: str, name: str) -> dict[str, Any] | None:
    body = cluster.get_service(namespace, name)
    status = body.get("status") or {}
    if status.get("observedGeneration") != body["metadata"]["generation"]:
        return None
    return next((c for c in status.get("conditions") or () if c["type"] == "Valid"), None)


@settings(SLOW_EXAMPLES, max_examples=12)
@given(spec=specs())
def test_the_operator_reconciles_each_admitted_spec_or_names_the_field(cluster, operator, fuzz_namespace, spec) -> None:
    name = f"f{uuid.uuid4().hex[:8]}"
    # no pods: the controller manager would start as many as the drawn replica count
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": {**spec, "replicas": 0},
    }
    try:
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, fuzz_namespace, PLURAL, body)
    except ApiException as err:
        if err.status != 422:
            raise
        event(f"refused by the schema: {json.loads(err.body)['message'].split(': ', 1)[-1][:80]}")
        reject()  # the schema refused it after all (a rule the drawing does not model): not an admitted spec
    try:
        valid = wait_for(
            lambda: reconciled(cluster, fuzz_namespace, name), 30, f"{name} reconciled (spec {json.dumps(spec)[:1500]})"
        )
        event(f"Valid={valid['status']} {valid['reason']}")  # --hypothesis-show-statistics
        if valid["status"] == "True":
            assert cluster.deployment(fuzz_namespace, name) is not None
        else:
            field = valid["message"].split(":", 1)[0]
            assert schema_at(field) is not None, valid
    finally:
        cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, fuzz_namespace, PLURAL, name)
    assert "Traceback" not in operator.log(), operator.log()[-4000:]
