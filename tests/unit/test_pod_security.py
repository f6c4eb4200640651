"""Every pod Goodput makes meets the restricted Pod Security profile, with a read-only root.

Checked on the operator's builders across specs drawn from the CRD's schema, and on every
workload in manifests/ and in the hack/ scripts (the demo's model Job).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from crd_specs import specs
from hypothesis import HealthCheck, given, settings
from pod_security import pod_specs, violations

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import builders, engines
from goodput_operator.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
OWNER = builders.owner_reference("svc", "uid-1")
CACHE_VARIABLES = ("HOME", "HF_HOME", "XDG_CACHE_HOME", "TORCHINDUCTOR_CACHE_DIR")


def writable(pod: dict[str, Any], path: str) -> bool:
    """A path under a mount of a volume the pod can write: an emptyDir or a read-write claim."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in pod["containers"][0]["volumeMounts"]:
        volume = volumes[mount["name"]]
        if (
            (path + "/").startswith(mount["mountPath"].rstrip("/") + "/")
            and not mount.get("readOnly")
            and ("emptyDir" in volume or "persistentVolumeClaim" in volume)
        ):
            return True
    return False


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=specs())
def test_runtime_pods_of_every_spec_are_restricted_with_writable_caches(spec: dict[str, Any]) -> None:
    try:
        svc = parse("svc", "team", spec)
        engines.validate(svc)
    except SpecError:
        return  # refused: no pod at all
    pod = builders.build_deployment(svc, Settings(), OWNER)["spec"]["template"]["spec"]
    assert violations(pod) == [], spec
    assert pod["automountServiceAccountToken"] is False
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    for name in CACHE_VARIABLES:
        if name in env:
            assert writable(pod, env[name]), (name, env[name], pod["volumes"])
    assert writable(pod, "/tmp")


def test_template_volumes_outside_the_profile_are_refused_naming_the_field() -> None:
    spec = {
        "model": {"source": "hf://org/m"},
        "template": {"volumes": [{"name": "ok", "emptyDir": {}}, {"name": "host", "hostPath": {"path": "/"}}]},
    }
    with pytest.raises(SpecError) as caught:
        parse("svc", "team", spec)
    assert caught.value.field == "spec.template.volumes[1]"
    assert "hostPath" in str(caught.value) and "restricted" in str(caught.value)


def workloads(documents: list[Any]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (f"{d['kind']} {d['metadata']['name']}", pod) for d in documents if isinstance(d, dict) for pod in pod_specs(d)
    ]


def strategic_merge(base: Any, patch: Any) -> Any:
    """`kubectl patch`'s strategic merge, as far as our patches use it: maps merge key by key, lists of
    named items (containers, volumes, env, mounts) merge by name, a null deletes."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            else:
                merged[key] = strategic_merge(base.get(key), value)
        return merged
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(i, dict) and "name" in i for i in [*base, *patch])
    ):
        by_name = {i["name"]: i for i in base}
        for item in patch:
            by_name[item["name"]] = strategic_merge(by_name.get(item["name"]), item)
        return list(by_name.values())
    return patch


def manifest_workloads() -> list[tuple[str, dict[str, Any]]]:
    """Every workload under manifests/; a `*-patch.yaml` is checked as the workload it patches would be."""
    documents: dict[Path, list[Any]] = {
        path: [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        for path in sorted((ROOT / "manifests").rglob("*.yaml"))
    }
    bases = {
        (d["kind"], d["metadata"]["name"]): d
        for path, docs in documents.items()
        if not path.name.endswith("-patch.yaml")
        for d in docs
        if "kind" in d and "metadata" in d
    }
    found = []
    for path, docs in documents.items():
        if path.name.endswith("-patch.yaml"):
            docs = [strategic_merge(bases[(d["kind"], d["metadata"]["name"])], d) for d in docs]
        found += [(f"{path.relative_to(ROOT)}: {name}", pod) for name, pod in workloads(docs)]
    return found


def script_workloads() -> list[tuple[str, dict[str, Any]]]:
    """Workloads the hack/ scripts apply from here-documents (`cat <<EOF | kubectl apply -f -`)."""
    found = []
    for path in sorted((ROOT / "hack").glob("*.sh")):
        for block in re.findall(r"<<'?EOF'?[^\n]*\n(.*?)\nEOF\n", path.read_text(), re.S):
            try:
                documents = list(yaml.safe_load_all(block))
            except yaml.YAMLError:
                continue  # not YAML (a script or a config file)
            found += [(f"{path.relative_to(ROOT)}: {name}", pod) for name, pod in workloads(documents)]
    return found


def test_the_installed_operator_and_gateway_are_restricted() -> None:
    found = dict(manifest_workloads())
    assert {
        "manifests/operator.yaml: Deployment goodput-operator",
        "manifests/gateway.yaml: Deployment goodput-gateway",
        "manifests/gateway-batch.yaml: Deployment goodput-gateway-batch",
    } <= set(found)
    for name, pod in found.items():
        assert violations(pod) == [], name


def test_the_demo_model_job_is_restricted_and_writes_only_to_volumes() -> None:
    found = dict(script_workloads())
    job = found["hack/demo.sh: Job make-model"]
    assert violations(job) == []
    env = {e["name"]: e["value"] for e in job["containers"][0]["env"]}
    for name in ("HOME", "HF_HOME", "XDG_CACHE_HOME"):
        assert writable(job, env[name]), name
    for name, pod in found.items():
        assert violations(pod) == [], name


def test_the_checker_names_each_broken_rule() -> None:
    pod = {
        "hostNetwork": True,
        "securityContext": {"seccompProfile": {"type": "Unconfined"}},
        "volumes": [{"name": "h", "hostPath": {"path": "/"}}],
        "containers": [
            {
                "name": "c",
                "ports": [{"containerPort": 80, "hostPort": 80}],
                "securityContext": {"privileged": True, "capabilities": {"add": ["SYS_ADMIN"]}},
            }
        ],
    }
    found = " | ".join(violations(pod))
    for rule in (
        "hostNetwork",
        "hostPath",
        "privileged",
        "allowPrivilegeEscalation",
        "drop ALL",
        "SYS_ADMIN",
        "runAsNonRoot",
        "seccompProfile",
        "hostPort",
        "readOnlyRootFilesystem",
    ):
        assert rule in found, rule
