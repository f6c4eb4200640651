"""An InferenceService becomes a Deployment and a Service, and stays that way."""

import time

import pytest
from harness import RUNTIME_IMAGE, wait_for

SPEC = {
    "model": {"source": "hf://acme/tiny-chat", "servedName": "chat", "maxModelLen": 2048},
    "engine": {"maxNumSeqs": 16, "prefixCaching": True},
    "resources": {"gpu": 1, "cpu": "2", "memory": "8Gi"},
    "slo": {"ttft": "500ms", "tpot": "50ms"},
}


def _args(deployment):
    return deployment.spec.template.spec.containers[0].args


def test_service_becomes_deployment_and_service(cluster, operator, namespace):
    cluster.create_service(namespace, "chat", SPEC)
    deployment = cluster.wait_deployment(namespace, "chat")
    pod = deployment.spec.template.spec
    container = pod.containers[0]
    assert deployment.spec.replicas == 1
    assert container.image == RUNTIME_IMAGE
    assert _args(deployment)[:4] == ["--model", "acme/tiny-chat", "--served-model-name", "chat"]
    assert "--slo-ttft" in container.args and "0.5" in container.args
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    assert container.readiness_probe.http_get.path == "/health"
    assert container.security_context.allow_privilege_escalation is False
    assert pod.security_context.seccomp_profile.type == "RuntimeDefault"
    owner = deployment.metadata.owner_references[0]
    assert (owner.kind, owner.name, owner.controller) == ("InferenceService", "chat", True)

    service = cluster.wait_kube_service(namespace, "chat")
    assert {p.name: p.port for p in service.spec.ports} == {"http": 80, "metrics": 8000}
    assert service.spec.selector == {"serving.goodput.dev/service": "chat"}

    cluster.wait_condition(namespace, "chat", "Valid", "True")
    status = cluster.get_service(namespace, "chat")["status"]
    assert status["url"] == f"http://chat.{namespace}.svc"
    assert status["selector"] == "serving.goodput.dev/service=chat"
    assert status["observedGeneration"] == 1
    # no nodes in this cluster: pods never become ready
    available = next(c for c in status["conditions"] if c["type"] == "Available")
    assert (available["status"], available["reason"]) == ("False", "ReplicasNotReady")
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False"
    reasons = {e.reason for e in cluster.events(namespace, "chat")}
    assert "Created" in reasons


def test_invalid_spec_is_reported_and_builds_nothing(cluster, operator, namespace):
    spec = {**SPEC, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}
    cluster.create_service(namespace, "inverted", spec)
    valid = cluster.wait_condition(namespace, "inverted", "Valid", "False")
    assert valid["reason"] == "ReplicaBoundsInverted"
    assert "spec.autoscaling.maxReplicas" in valid["message"]
    warnings = wait_for(
        lambda: [e for e in cluster.events(namespace, "inverted") if e.type == "Warning"], what="a Warning event"
    )
    assert "spec.autoscaling.maxReplicas" in warnings[0].message
    assert cluster.deployment(namespace, "inverted") is None
    assert cluster.get_or_none(cluster.core.read_namespaced_service, "inverted", namespace) is None


def test_invalid_update_leaves_children_alone_until_fixed(cluster, operator, namespace):
    cluster.create_service(namespace, "edit", SPEC)
    before = cluster.wait_deployment(namespace, "edit")
    cluster.patch_service(namespace, "edit", {"spec": {"parallelism": {"tensor": 2}, "resources": {"gpu": 1}}})
    valid = cluster.wait_condition(namespace, "edit", "Valid", "False")
    assert valid["reason"] == "GPUCountMismatch" and "spec.resources.gpu" in valid["message"]
    time.sleep(1)
    assert cluster.deployment(namespace, "edit").metadata.generation == before.metadata.generation
    cluster.patch_service(namespace, "edit", {"spec": {"resources": {"gpu": 2}}})
    cluster.wait_condition(namespace, "edit", "Valid", "True")
    rolled = wait_for(
        lambda: (
            "--tensor-parallel-size" in _args(d := cluster.deployment(namespace, "edit"))
            and _args(d)[_args(d).index("--tensor-parallel-size") + 1] == "2"
            and d
        ),
        what="the Deployment to roll to tensor parallel 2",
    )
    assert rolled.spec.template.spec.containers[0].resources.limits["nvidia.com/gpu"] == "2"


def test_kubectl_scale_reaches_the_deployment_and_adds_a_pdb(cluster, operator, namespace):
    cluster.create_service(namespace, "scale", SPEC)
    cluster.wait_deployment(namespace, "scale")
    cluster.kubectl("scale", "gsvc/scale", "--replicas=3", "-n", namespace)
    wait_for(lambda: cluster.deployment(namespace, "scale").spec.replicas == 3, what="3 replicas")
    pdb_path = cluster.path("policy", namespace, "poddisruptionbudgets", "scale-runtime")
    pdb = wait_for(lambda: cluster.get_or_none(cluster.raw, "GET", pdb_path), what="a PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1
    cluster.kubectl("scale", "gsvc/scale", "--replicas=1", "-n", namespace)
    wait_for(lambda: cluster.deployment(namespace, "scale").spec.replicas == 1, what="1 replica")
    wait_for(lambda: cluster.get_or_none(cluster.raw, "GET", pdb_path) is None, what="the PDB to go")


def test_deleting_the_service_removes_its_children(cluster, operator, namespace):
    if not cluster.has_controllers:
        pytest.skip("garbage collection needs kube-controller-manager")
    cluster.create_service(namespace, "gone", SPEC)
    cluster.wait_deployment(namespace, "gone")
    cluster.custom.delete_namespaced_custom_object(
        "serving.goodput.dev", "v1alpha1", namespace, "inferenceservices", "gone"
    )
    # the garbage collector follows owner references; it may first need to learn the CRD
    wait_for(lambda: cluster.deployment(namespace, "gone") is None, 120, "the Deployment to be collected")
    wait_for(
        lambda: cluster.get_or_none(cluster.core.read_namespaced_service, "gone", namespace) is None,
        120,
        "the Service to be collected",
    )


def test_deleted_child_comes_back(cluster, operator, namespace):
    cluster.create_service(namespace, "phoenix", SPEC)
    first = cluster.wait_deployment(namespace, "phoenix")
    cluster.kubectl("delete", "deployment", "phoenix-runtime", "-n", namespace)
    again = wait_for(
        lambda: (d := cluster.deployment(namespace, "phoenix")) and d.metadata.uid != first.metadata.uid and d,
        30,
        "the Deployment to be recreated",
    )
    assert again.spec.template.spec.containers[0].image == RUNTIME_IMAGE
    cluster.kubectl("delete", "service", "phoenix", "-n", namespace)
    wait_for(
        lambda: cluster.get_or_none(cluster.core.read_namespaced_service, "phoenix", namespace),
        30,
        "the Service to be recreated",
    )


def test_hand_edited_child_is_restored(cluster, operator, namespace):
    cluster.create_service(namespace, "drift", SPEC)
    cluster.wait_deployment(namespace, "drift")
    cluster.apps.patch_namespaced_deployment("drift-runtime", namespace, {"spec": {"replicas": 5}})
    patch = {"spec": {"template": {"spec": {"containers": [{"name": "runtime", "image": "evil:latest"}]}}}}
    cluster.apps.patch_namespaced_deployment("drift-runtime", namespace, patch)
    wait_for(
        lambda: (
            (d := cluster.deployment(namespace, "drift")).spec.replicas == 1
            and d.spec.template.spec.containers[0].image == RUNTIME_IMAGE
        ),
        30,
        "the edits to be undone",
    )


def test_unchanged_service_causes_no_writes(cluster, operator, namespace):
    cluster.create_service(namespace, "still", SPEC)
    cluster.wait_condition(namespace, "still", "Valid", "True")
    cluster.wait_deployment(namespace, "still")
    cluster.wait_settled(namespace, "still")
    time.sleep(1)

    def versions():
        return (
            cluster.get_service(namespace, "still")["metadata"]["resourceVersion"],
            cluster.deployment(namespace, "still").metadata.resource_version,
            cluster.core.read_namespaced_service("still", namespace).metadata.resource_version,
        )

    before = versions()
    time.sleep(12)  # longer than the operator's 10 s resync in tests
    assert versions() == before


def test_a_name_taken_by_someone_elses_object_is_reported_not_overwritten(cluster, operator, namespace):
    cluster.core.create_namespaced_service(
        namespace,
        {
            "metadata": {"name": "taken"},
            "spec": {"selector": {"app": "theirs"}, "ports": [{"port": 1234}]},
        },
    )
    cluster.create_service(namespace, "taken", SPEC)
    available = wait_for(
        lambda: (c := cluster.condition(namespace, "taken", "Available")) and c["reason"] == "ChildConflict" and c,
        what="Available=False ChildConflict",
    )
    assert "Service taken already exists" in available["message"]
    assert cluster.condition(namespace, "taken", "Ready")["status"] == "False"
    theirs = cluster.core.read_namespaced_service("taken", namespace)
    assert theirs.spec.selector == {"app": "theirs"} and not theirs.metadata.owner_references
    assert any(e.reason == "ChildConflict" for e in cluster.events(namespace, "taken"))
    assert cluster.deployment(namespace, "taken") is None  # nothing half-built
