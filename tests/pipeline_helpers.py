"""InferencePipelines in the test cluster: the CRD installed beside the InferenceService one."""

from __future__ import annotations

import shutil
from typing import Any

from harness import GROUP, ROOT, VERSION, Cluster, wait_for

PIPELINE_CRD = ROOT / "crds" / "serving.goodput.dev_inferencepipelines.yaml"
PIPELINES = "inferencepipelines"


def install_pipeline_crd(cluster: Cluster) -> None:
    cluster.kubectl("apply", "-f", str(PIPELINE_CRD))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{PIPELINES}.{GROUP}")
    shutil.rmtree(cluster.dir / "kubectl-cache", ignore_errors=True)
    wait_for(
        lambda: cluster.kubectl("explain", "inferencepipeline", check=False).returncode == 0,
        60,
        "the pipeline CRD in the OpenAPI document",
    )


def create_pipeline(cluster: Cluster, namespace: str, name: str, steps: list[dict[str, Any]]) -> dict[str, Any]:
    body = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferencePipeline",
        "metadata": {"name": name},
        "spec": {"steps": steps},
    }
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PIPELINES, body)


def delete_pipeline(cluster: Cluster, namespace: str, name: str) -> None:
    cluster.custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PIPELINES, name)


def pipeline_condition(cluster: Cluster, namespace: str, name: str, type_: str) -> dict[str, Any] | None:
    body = cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PIPELINES, name)
    return next((c for c in (body.get("status") or {}).get("conditions") or () if c["type"] == type_), None)
