"""A replica larger than a node: a group of pods per replica, against a real API server.

A StatefulSet per replica beside a headless Service (or one LeaderWorkerSet where its CRD is
installed); each pod told the node count and the leader's address; scaling adds and removes whole
groups; and shapes that cannot fit are refused naming the field.
"""

import pytest
from harness import wait_for

TINY = {"model": {"source": "file:///models/tiny"}}
# 4 GPUs per replica (TP 2 x PP 2) on nodes of 2: two pods per replica
SPEC = {
    **TINY,
    "parallelism": {"tensor": 2, "pipeline": 2},
    "resources": {"gpu": 4, "gpusPerNode": 2, "memory": "2Gi"},
    "replicas": 2,
}
LAYERS_28 = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "torch_dtype": "bfloat16",
}
LWS_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {
        "group": "leaderworkerset.x-k8s.io",
        "scope": "Namespaced",
        "names": {"kind": "LeaderWorkerSet", "plural": "leaderworkersets", "singular": "leaderworkerset"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                "subresources": {"status": {}},
            }
        ],
    },
}


def statefulset(cluster, namespace, name):
    return cluster.get_or_none(cluster.apps.read_namespaced_stateful_set, name, namespace)


def env_of(container):
    return {e.name: e.value or (e.value_from.field_ref.field_path if e.value_from else None) for e in container.env}


def groups(cluster, namespace, service):
    items = cluster.apps.list_namespaced_stateful_set(
        namespace, label_selector=f"serving.goodput.dev/service={service}"
    )
    return sorted(s.metadata.name for s in items.items)


def test_a_replica_larger_than_a_node_is_a_statefulset_group_and_scales_by_whole_groups(cluster, operator, namespace):
    cluster.create_service(namespace, "big", SPEC)
    group = wait_for(lambda: statefulset(cluster, namespace, "big-runtime-1"), 60, "the second group")
    assert group.spec.replicas == 2  # pods per replica
    assert group.spec.service_name == "big-ranks"
    assert group.spec.pod_management_policy == "Parallel"
    container = group.spec.template.spec.containers[0]
    env = env_of(container)
    assert env["GOODPUT_NNODES"] == "2"
    # the pods meet at the ClusterIP of the group's leader Service, which selects pod -0, ready or not
    leader = cluster.wait_kube_service(namespace, "big-runtime-1")
    assert leader.spec.selector["statefulset.kubernetes.io/pod-name"] == "big-runtime-1-0"
    assert leader.spec.publish_not_ready_addresses is True
    assert env["GOODPUT_LEADER_ADDRESS"] == f"{leader.spec.cluster_ip}:29500"
    assert env["GOODPUT_POD_NAME"] == "metadata.name"  # the ordinal ending it is the node rank
    args = container.args
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--pipeline-parallel-size") + 1] == "2"
    assert container.resources.limits["nvidia.com/gpu"] == "2"  # the replica's 4 GPUs over 2 pods
    assert container.readiness_probe.http_get.path == "/health?serving"  # workers never take requests
    assert {p.container_port for p in container.ports} >= {8000, 29500, 29501}

    ranks = cluster.wait_kube_service(namespace, "big-ranks")
    assert ranks.spec.cluster_ip == "None" and ranks.spec.publish_not_ready_addresses is True
    assert cluster.wait_deployment(namespace, "big").spec.replicas == 0  # no one-pod replicas beside the groups
    status = wait_for(lambda: cluster.get_service(namespace, "big").get("status", {}).get("placement"), 30, "placement")
    assert status == {"mode": "StatefulSet", "podsPerReplica": 2, "ranksPerPod": 2}
    if cluster.has_controllers:  # the StatefulSet controller makes each group's pods, the leader -0 among them
        pods = wait_for(
            lambda: (
                len(
                    p := cluster.core.list_namespaced_pod(
                        namespace, label_selector="serving.goodput.dev/replica=0"
                    ).items
                )
                == 2
                and p
            ),
            60,
            "the first group's pods",
        )
        assert sorted(p.metadata.name for p in pods) == ["big-runtime-0-0", "big-runtime-0-1"]

    cluster.patch_service(namespace, "big", {"spec": {"replicas": 1}})
    wait_for(lambda: groups(cluster, namespace, "big") == ["big-runtime-0"], 60, "one group left")
    wait_for(
        lambda: cluster.get_or_none(cluster.core.read_namespaced_service, "big-runtime-1", namespace) is None,
        60,
        "the removed group's leader Service gone",
    )
    cluster.patch_service(namespace, "big", {"spec": {"replicas": 3}})
    wait_for(
        lambda: groups(cluster, namespace, "big") == ["big-runtime-0", "big-runtime-1", "big-runtime-2"], 60, "three"
    )
    cluster.patch_service(namespace, "big", {"spec": {"parallelism": {"pipeline": 1}, "resources": {"gpu": 2}}})
    wait_for(lambda: groups(cluster, namespace, "big") == [], 60, "the groups gone once a replica fits one node")
    assert wait_for(lambda: cluster.deployment(namespace, "big").spec.replicas == 3, 60, "one-pod replicas")
    wait_for(lambda: cluster.get_service(namespace, "big")["status"]["placement"]["mode"] == "Pod", 30, "mode Pod")
    assert cluster.get_or_none(cluster.core.read_namespaced_service, "big-ranks", namespace) is None
    assert cluster.get_or_none(cluster.core.read_namespaced_service, "big-runtime-0", namespace) is None
    assert "Traceback" not in operator.log()


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"resources": {"gpu": 4, "gpusPerNode": 3}}, "spec.resources.gpusPerNode", "ShapeDoesNotFit"),
        ({"parallelism": {"tensor": 2, "pipeline": 2, "nodes": 3}}, "spec.parallelism.nodes", "ShapeDoesNotFit"),
        ({"parallelism": {"tensor": 2, "pipeline": 2, "nodes": 1}}, "spec.parallelism.nodes", "ShapeDoesNotFit"),
        ({"resources": {"gpu": 2, "gpusPerNode": 2}}, "spec.resources.gpu", "GPUCountMismatch"),
        ({"engine": {"kind": "vllm"}}, "spec.parallelism.pipeline", "EngineUnsupportedField"),
    ],
    ids=["node-size-does-not-divide", "nodes-do-not-divide", "pod-over-node", "gpus-not-tensor-x-pipeline", "vllm"],
)
def test_a_shape_that_cannot_fit_is_refused_naming_the_field(cluster, operator, namespace, change, field, reason):
    spec = {**SPEC, **{k: {**SPEC.get(k, {}), **v} for k, v in change.items()}}
    cluster.create_service(namespace, "misfit", spec)
    valid = cluster.wait_condition(namespace, "misfit", "Valid", "False")
    assert valid["reason"] == reason and field in valid["message"], valid
    assert statefulset(cluster, namespace, "misfit-runtime-0") is None


def test_more_stages_than_layers_are_refused_from_the_config(cluster, operator, hub, namespace):
    hub.configs["acme/layers-28"] = LAYERS_28
    spec = {
        "model": {"source": "hf://acme/layers-28", "maxModelLen": 4096},
        "parallelism": {"tensor": 1, "pipeline": 32},
        "resources": {"gpu": 32, "gpusPerNode": 8, "gpuMemory": "80Gi"},
    }
    cluster.create_service(namespace, "deep", spec)
    valid = cluster.wait_condition(namespace, "deep", "Valid", "False")
    assert valid["reason"] == "PipelineMismatch"
    assert "parallelism.pipeline 32 exceeds the model's 28 layers" in valid["message"]
    # 4 stages of 7 layers: each GPU holds a quarter of the weights and of the KV cache per token
    cluster.patch_service(namespace, "deep", {"spec": {"parallelism": {"pipeline": 4}, "resources": {"gpu": 4}}})
    fits = cluster.wait_condition(namespace, "deep", "ModelFits", "True")
    capacity = cluster.get_service(namespace, "deep")["status"]["capacity"]
    assert capacity["kvBytesPerToken"] == 57_344 // 4
    assert "weights 3.5 GiB per GPU" in fits["message"]


@pytest.fixture
def leader_worker_set_crd(cluster):
    cluster.raw("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", LWS_CRD)
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{LWS_CRD['metadata']['name']}")
    yield
    cluster.raw("DELETE", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{LWS_CRD['metadata']['name']}")


def test_with_the_leaderworkerset_crd_a_replica_is_a_leaderworkerset_group(
    cluster, operator, leader_worker_set_crd, namespace
):
    """The CRD alone (no LWS controller runs here): the object the operator writes, and the status."""
    cluster.create_service(namespace, "lws", SPEC)
    path = f"/apis/leaderworkerset.x-k8s.io/v1/namespaces/{namespace}/leaderworkersets/lws-runtime"
    lws = wait_for(lambda: cluster.get_or_none(cluster.raw, "GET", path), 60, "a LeaderWorkerSet")
    assert lws["spec"]["replicas"] == 2
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    container = template["workerTemplate"]["spec"]["containers"][0]
    assert {"name": "GOODPUT_NNODES", "value": "2"} in container["env"]  # LWS_LEADER_ADDRESS comes from LWS
    # the status follows the pass that wrote the LeaderWorkerSet (a pass before the operator's discovery
    # saw the new CRD may have written a StatefulSet's placement first)
    wait_for(
        lambda: (
            (cluster.get_service(namespace, "lws").get("status", {}).get("placement") or {}).get("mode")
            == "LeaderWorkerSet"
        ),
        30,
        "status.placement naming the LeaderWorkerSet",
    )
    assert groups(cluster, namespace, "lws") == []
    cluster.patch_service(namespace, "lws", {"spec": {"replicas": 3}})
    wait_for(lambda: cluster.raw("GET", path)["spec"]["replicas"] == 3, 60, "three groups")
