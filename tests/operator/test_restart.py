"""Restarting the operator: no duplicates, and no writes when nothing changed."""

import time

from harness import wait_for

SPEC = {"model": {"source": "file:///models/tiny"}, "resources": {"gpu": 0, "memory": "2Gi"}}
NAMES = ("alpha", "beta", "gamma")


def _versions(cluster, namespace):
    versions = {}
    for name in NAMES:
        versions[f"gsvc/{name}"] = cluster.get_service(namespace, name)["metadata"]["resourceVersion"]
        versions[f"deploy/{name}"] = cluster.deployment(namespace, name).metadata.resource_version
        service = cluster.core.read_namespaced_service(name, namespace)
        versions[f"svc/{name}"] = service.metadata.resource_version
    return versions


def test_restart_creates_no_duplicates_and_writes_nothing(cluster, operator, namespace):
    for name in NAMES:
        cluster.create_service(namespace, name, SPEC)
    for name in NAMES:
        cluster.wait_condition(namespace, name, "Valid", "True")
        cluster.wait_deployment(namespace, name)
        cluster.wait_settled(namespace, name)
    time.sleep(1)
    before = _versions(cluster, namespace)

    operator.stop()
    offset = len(operator.log())
    operator.start()

    def resumed():
        lines = operator.log()[offset:].splitlines()
        return sum(f"Resumed {namespace}/" in line for line in lines)

    wait_for(lambda: resumed() >= len(NAMES), 60, "the restarted operator to resume every service")
    time.sleep(3)

    assert _versions(cluster, namespace) == before
    deployments = cluster.apps.list_namespaced_deployment(namespace).items
    services = cluster.core.list_namespaced_service(namespace).items
    assert sorted(d.metadata.name for d in deployments) == [f"{n}-runtime" for n in NAMES]
    assert sorted(s.metadata.name for s in services) == sorted(NAMES)
