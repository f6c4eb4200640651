"""Fifty services at once, each reconciled into its children."""

import time

from harness import wait_for

COUNT = 50


def test_fifty_services_are_reconciled(cluster, operator, namespace):
    started = time.monotonic()
    for i in range(COUNT):
        spec = {
            "model": {"source": f"file:///models/m{i}"},
            "resources": {"gpu": 0, "memory": "1Gi"},
            "replicas": 1 + i % 2,
        }
        cluster.create_service(namespace, f"svc-{i:02d}", spec)

    def all_deployed():
        deployments = cluster.apps.list_namespaced_deployment(namespace).items
        return len(deployments) == COUNT and deployments

    deployments = wait_for(all_deployed, 240, f"{COUNT} Deployments")
    assert {d.metadata.name: d.spec.replicas for d in deployments} == {
        f"svc-{i:02d}-runtime": 1 + i % 2 for i in range(COUNT)
    }

    def all_valid():
        items = cluster.custom.list_namespaced_custom_object(
            "serving.goodput.dev", "v1alpha1", namespace, "inferenceservices"
        )["items"]
        return all(
            any(c["type"] == "Valid" and c["status"] == "True" for c in (i.get("status") or {}).get("conditions") or ())
            for i in items
        )

    wait_for(all_valid, 240, "every service to be Valid")
    print(f"{COUNT} services reconciled in {time.monotonic() - started:.1f}s")
    assert len(cluster.core.list_namespaced_service(namespace).items) == COUNT
