"""Flux's reading of Goodput's kinds: the healthCheckExprs of gitops/flux/kustomization.yaml, evaluated by a
real CEL interpreter (cel-python) on the fixtures the Argo CD checks use (built by the operator's own status
code): inProgress, then failed, then current, else InProgress (failed and current never both hold, so the
order of those two does not matter). Each state reads as the Argo CD check reads it: Progressing is
InProgress, Degraded is Failed, Healthy and Suspended are Current."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
HEALTH = ROOT / "gitops" / "argocd" / "resource_customizations" / "serving.goodput.dev"
EXPRS = yaml.safe_load((ROOT / "gitops" / "flux" / "kustomization.yaml").read_text())["spec"]["healthCheckExprs"]
AS_FLUX = {"Progressing": "InProgress", "Degraded": "Failed", "Healthy": "Current", "Suspended": "Current"}


def flux_status(obj: dict[str, Any]) -> str:
    (exprs,) = [e for e in EXPRS if e["kind"] == obj["kind"] and e["apiVersion"] == obj["apiVersion"]]
    env = celpy.Environment()
    activation = {
        key: celpy.json_to_cel(obj.get(key) or {}) for key in ("apiVersion", "kind", "metadata", "spec", "status")
    }
    values = {}
    for field in ("inProgress", "failed", "current"):
        value = env.program(env.compile(exprs[field])).evaluate(activation)
        assert isinstance(value, celpy.celtypes.BoolType), f"{field}: {value!r}"
        values[field] = bool(value)
    assert not (values["failed"] and values["current"]), values
    if values["inProgress"]:
        return "InProgress"
    return "Failed" if values["failed"] else "Current" if values["current"] else "InProgress"


def cases() -> list[tuple[str, str, str]]:
    out = []
    for kind in ("InferenceService", "InferencePipeline", "LoraAdapter", "ModelCache"):
        for test in yaml.safe_load((HEALTH / kind / "health_test.yaml").read_text())["tests"]:
            out.append((kind, test["inputPath"], AS_FLUX[test["healthStatus"]["status"]]))
    return out


@pytest.mark.parametrize(("kind", "path", "wanted"), cases())
def test_flux_reads_each_state_as_argo_cd_does(kind, path, wanted):
    obj = yaml.safe_load((HEALTH / kind / path).read_text())
    assert flux_status(obj) == wanted


def kstatus(obj: dict[str, Any]) -> str:
    """kstatus's generic reading of a custom resource (sigs.k8s.io/cli-utils, pkg/kstatus/status: the
    generation check, then the abnormal-true conditions), what Flux's `wait` applies with no
    healthCheckExprs."""
    status = obj.get("status") or {}
    observed = status.get("observedGeneration")
    if observed is not None and observed != obj["metadata"].get("generation"):
        return "InProgress"
    by_type = {c["type"]: c for c in status.get("conditions") or ()}
    if by_type.get("Reconciling", {}).get("status") == "True":
        return "InProgress"
    if by_type.get("Stalled", {}).get("status") == "True":
        return "Failed"
    return "Current"


@pytest.mark.parametrize(
    ("path", "wanted"), [(p, w) for kind, p, w in cases() if kind == "InferenceService" and "no_status" not in p]
)
def test_kstatus_alone_reads_each_state_of_a_service(path, wanted):
    """The operator writes Reconciling and Stalled, so Flux's plain kstatus reading (a HelmRelease or a
    Kustomization without the expressions) gets each state right too: a crash-looping service is
    Failed, not Current once its generation is seen."""
    obj = yaml.safe_load((HEALTH / "InferenceService" / path).read_text())
    assert kstatus(obj) == wanted


def test_before_the_operators_first_write_only_the_expressions_wait():
    """An object the operator has not written yet has nothing kstatus reads, so it is Current to
    kstatus; the expressions read it as in progress. That window is the operator's first pass."""
    obj = yaml.safe_load((HEALTH / "InferenceService" / "testdata" / "no_status.yaml").read_text())
    assert (kstatus(obj), flux_status(obj)) == ("Current", "InProgress")
