"""spec.disaggregation against a real API server and the operator process: both roles rendered for the
goodput and vllm engines, what cannot be honoured refused with the field named, the prefill Deployment's
replicas left to the autoscaler in goodput mode, and status per role."""

import json
import time

import pytest
from harness import wait_for

ROLE = "serving.goodput.dev/role"
SERVICE = "serving.goodput.dev/service"
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(autouse=True)
def configs(hub):
    hub.configs["acme/pd-7b"] = QWEN25_7B


def _spec(engine="goodput", **disaggregation):
    return {
        "model": {"source": "hf://acme/pd-7b", "servedName": "chat", "maxModelLen": 8192},
        "engine": {"kind": engine},
        "resources": {"gpu": 1, "gpuMemory": "80Gi"},
        "disaggregation": {
            "prefill": {"minReplicas": 2, "maxReplicas": 4},
            "decode": {"minReplicas": 1, "maxReplicas": 3},
            **disaggregation,
        },
    }


def _container(deployment):
    return deployment.spec.template.spec.containers[0]


def _env(deployment):
    return {e.name: e for e in _container(deployment).env}


def _prefill(cluster, namespace, name):
    return cluster.get_or_none(cluster.apps.read_namespaced_deployment, f"{name}-prefill", namespace)


def test_goodput_engine_renders_both_roles(cluster, operator, namespace):
    cluster.create_service(namespace, "pd", _spec())
    decode = cluster.wait_deployment(namespace, "pd")
    prefill = wait_for(lambda: _prefill(cluster, namespace, "pd"), what="Deployment pd-prefill")

    # the decode role keeps the aggregated names; each role's pods say their role and run the hand-off
    assert decode.spec.template.metadata.labels[ROLE] == "decode"
    assert prefill.spec.template.metadata.labels[ROLE] == "prefill"
    assert prefill.spec.selector.match_labels == {SERVICE: "pd", ROLE: "prefill"}
    for role, deployment in (("decode", decode), ("prefill", prefill)):
        args = _container(deployment).args
        assert args[args.index("--kv-transfer-role") + 1] == role
        assert args[args.index("--kv-transfer-port") + 1] == "8001"
        assert {p.name: p.container_port for p in _container(deployment).ports} == {"http": 8000, "kv": 8001}
        assert _env(deployment)["POD_IP"].value_from.field_ref.field_path == "status.podIP"
    assert prefill.spec.replicas == 2  # prefill.minReplicas, outside goodput mode
    assert decode.spec.replicas == 1  # decode.minReplicas while spec.replicas is unset

    # one Service per role, both with the aggregated Service's labels, each selecting its role
    services = {name: cluster.wait_kube_service(namespace, name) for name in ("pd", "pd-prefill")}
    for name, role in (("pd", "decode"), ("pd-prefill", "prefill")):
        assert services[name].spec.selector == {SERVICE: "pd", ROLE: role}
        assert services[name].metadata.labels[SERVICE] == "pd" and services[name].metadata.labels[ROLE] == role
        assert {p.name for p in services[name].spec.ports} == {"http", "metrics"}

    # decode pods reach the prefill pods' kv port through the NetworkPolicy
    policy = wait_for(
        lambda: cluster.raw("GET", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/pd-runtime"),
        what="NetworkPolicy pd-runtime",
    )
    kv_rule = next(r for r in policy["spec"]["ingress"] if r["ports"] == [{"protocol": "TCP", "port": 8001}])
    assert kv_rule["from"] == [{"podSelector": {"matchLabels": {SERVICE: "pd", ROLE: "decode"}}}]

    # a PodDisruptionBudget for the prefill pool (its floor is two pods), none for decode's single pod
    path = cluster.path("policy", namespace, "poddisruptionbudgets", "pd-prefill")
    pdb = wait_for(lambda: cluster.raw("GET", path), what="PodDisruptionBudget pd-prefill")
    assert pdb["spec"]["selector"]["matchLabels"] == {SERVICE: "pd", ROLE: "prefill"}

    # status per role, and the scale subresource's selector names the decode pods
    status = wait_for(
        lambda: (s := cluster.get_service(namespace, "pd").get("status") or {}).get("disaggregation") and s,
        what="status.disaggregation",
    )
    assert status["selector"] == f"{SERVICE}=pd,{ROLE}=decode"
    if cluster.has_controllers:  # the ReplicaSet controller makes the pods (no node runs them here)

        def counted():
            pools = cluster.get_service(namespace, "pd")["status"]["disaggregation"]
            return pools if (pools["prefill"]["replicas"], pools["decode"]["replicas"]) == (2, 1) else None

        pools = wait_for(counted, what="status.disaggregation counting each role's pods")
        assert pools["prefill"]["readyReplicas"] == pools["decode"]["readyReplicas"] == 0
    assert set(status["disaggregation"]) == {"prefill", "decode"}
    # Available is the decode pool's (no node runs pods here); its message counts the prefill pool too
    available = cluster.wait_condition(namespace, "pd", "Available", "False")
    assert "prefill 0/2 replicas ready" in available["message"]
    capacity = (
        cluster.wait_condition(namespace, "pd", "ModelFits", "True")
        and (cluster.get_service(namespace, "pd")["status"]["capacity"])
    )
    assert set(capacity["pools"]) == {"prefill", "decode"} and capacity["pools"]["prefill"]["fits"] is True

    # scaling the service scales the decode pool, within its bounds; the prefill pool stays at its floor
    cluster.patch_service(namespace, "pd", {"spec": {"replicas": 5}})
    wait_for(lambda: cluster.deployment(namespace, "pd").spec.replicas == 3, what="decode clamped to maxReplicas 3")
    assert _prefill(cluster, namespace, "pd").spec.replicas == 2

    # turning disaggregation off removes the prefill role and gives the Service back all the pods
    cluster.patch_service(namespace, "pd", {"spec": {"disaggregation": None}})
    wait_for(lambda: _prefill(cluster, namespace, "pd") is None, what="Deployment pd-prefill deleted")
    wait_for(
        lambda: cluster.core.read_namespaced_service("pd", namespace).spec.selector == {SERVICE: "pd"},
        what="Service pd selecting every pod of the service",
    )
    args = _container(cluster.deployment(namespace, "pd")).args
    assert "--kv-transfer-role" not in args and cluster.deployment(namespace, "pd").spec.replicas == 5
    wait_for(lambda: "disaggregation" not in cluster.get_service(namespace, "pd")["status"], what="status cleared")


def test_vllm_engine_renders_its_nixl_connector_per_role(cluster, operator, namespace):
    # NIXL maps KV heads between tensor sizes that divide each other: prefill on 2 GPUs, decode on 1
    cluster.create_service(namespace, "vpd", _spec("vllm", prefill={"minReplicas": 1, "tensor": 2}))
    decode = cluster.wait_deployment(namespace, "vpd")
    prefill = wait_for(lambda: _prefill(cluster, namespace, "vpd"), what="Deployment vpd-prefill")
    for role, deployment, gpus in (("decode", decode, "1"), ("prefill", prefill, "2")):
        container = _container(deployment)
        config = json.loads(container.args[container.args.index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "NixlConnector" and config["kv_role"] == "kv_both"
        assert container.args[container.args.index("--tensor-parallel-size") + 1] == gpus
        assert container.resources.limits["nvidia.com/gpu"] == gpus
        env = _env(deployment)
        assert env["VLLM_NIXL_SIDE_CHANNEL_HOST"].value == "$(POD_IP)"  # the pod's address, from the downward API
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"].value == "8001"
        assert {p.name: p.container_port for p in container.ports}["kv"] == 8001
        assert "--kv-transfer-role" not in container.args  # the goodput runtime's flag, not vLLM's
        assert deployment.spec.template.metadata.labels[ROLE] == role
    # NIXL's UCX transfers use ports it picks: the service's own pods reach each other on every port
    policy = wait_for(
        lambda: cluster.raw("GET", f"/apis/networking.k8s.io/v1/namespaces/{namespace}/networkpolicies/vpd-runtime"),
        what="NetworkPolicy vpd-runtime",
    )
    assert {"from": [{"podSelector": {"matchLabels": {SERVICE: "vpd"}}}]} in policy["spec"]["ingress"]
    cluster.wait_condition(namespace, "vpd", "ModelFits", "True")
    pools = cluster.get_service(namespace, "vpd")["status"]["capacity"]["pools"]
    assert (pools["prefill"]["tensor"], pools["decode"]["tensor"]) == (2, 1)
    # a GPU of two holds half the KV heads of each token
    assert pools["prefill"]["kvBytesPerToken"] * 2 == pools["decode"]["kvBytesPerToken"]


@pytest.mark.parametrize(
    ("name", "engine", "disaggregation", "field", "reason"),
    [
        ("sgl", "sglang", {}, "spec.disaggregation", "EngineUnsupportedField"),
        ("tp", "goodput", {"prefill": {"tensor": 2}}, "spec.disaggregation.prefill.tensor", "TensorSizeMismatch"),
        (
            "vtp",
            "vllm",
            {"prefill": {"tensor": 2}, "decode": {"tensor": 3}},
            "spec.disaggregation.prefill.tensor",
            "TensorSizeMismatch",
        ),
        ("thr", "goodput", {"threshold": 8}, "spec.disaggregation.threshold", "ThresholdBelowBlock"),
        (
            "inv",
            "goodput",
            {"prefill": {"minReplicas": 5, "maxReplicas": 4}},
            "spec.disaggregation.prefill.minReplicas",
            "ReplicaBoundsInverted",
        ),
        ("nixl", "goodput", {"transport": "nixl"}, "spec.disaggregation.transport", "TransportUnsupported"),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_the_field(
    cluster, operator, namespace, name, engine, disaggregation, field, reason
):
    cluster.create_service(namespace, name, _spec(engine, **disaggregation))
    valid = cluster.wait_condition(namespace, name, "Valid", "False")
    assert valid["message"].startswith(f"{field}: ") and valid["reason"] == reason
    assert _prefill(cluster, namespace, name) is None and cluster.deployment(namespace, name) is None


def test_goodput_mode_leaves_the_prefill_replicas_to_the_autoscaler(cluster, operator, namespace):
    spec = _spec()
    spec["autoscaling"] = {"mode": "goodput", "minReplicas": 1, "maxReplicas": 8}
    cluster.create_service(namespace, "auto", spec)
    prefill = wait_for(lambda: _prefill(cluster, namespace, "auto"), what="Deployment auto-prefill")
    assert prefill.spec.replicas == 2  # created at prefill.minReplicas

    # the autoscaler writes the prefill count through the Deployment's scale subresource
    wait_for(
        lambda: (
            "serving.goodput.dev/replicas-manager" in (_prefill(cluster, namespace, "auto").metadata.annotations or {})
        ),
        what="the prefill replicas handed to the autoscaler",
    )
    cluster.apps.patch_namespaced_deployment_scale(
        "auto-prefill", namespace, {"spec": {"replicas": 3}}, field_manager="goodput-autoscaler"
    )
    # a spec change makes the operator apply the prefill Deployment again: its new args, the same count
    cluster.patch_service(namespace, "auto", {"spec": {"engine": {"maxNumSeqs": 7}}})

    def reapplied():
        d = _prefill(cluster, namespace, "auto")
        return d if "--max-num-seqs" in _container(d).args else None

    prefill = wait_for(reapplied, what="the prefill Deployment applied with the new spec")
    assert prefill.spec.replicas == 3
    generation = cluster.get_service(namespace, "auto")["metadata"]["generation"]
    wait_for(
        lambda: cluster.get_service(namespace, "auto")["status"]["observedGeneration"] == generation,
        what="the pass over the new spec to finish",
    )
    assert _prefill(cluster, namespace, "auto").spec.replicas == 3

    # leaving goodput mode hands the count back to the reconcile: prefill.minReplicas again
    cluster.patch_service(namespace, "auto", {"spec": {"autoscaling": {"mode": "none"}}})
    wait_for(lambda: _prefill(cluster, namespace, "auto").spec.replicas == 2, what="prefill back at minReplicas")
    wait_for(
        lambda: (
            not (_prefill(cluster, namespace, "auto").metadata.annotations or {}).get(
                "serving.goodput.dev/replicas-manager"
            )
        ),
        what="the hand-over withdrawn",
    )


def test_a_prefill_name_held_by_another_object_is_left_alone(cluster, operator, namespace):
    foreign = {
        "metadata": {"name": "held-prefill", "labels": {"app": "other"}},
        "spec": {
            "replicas": 0,
            "selector": {"matchLabels": {"app": "other"}},
            "template": {
                "metadata": {"labels": {"app": "other"}},
                "spec": {"containers": [{"name": "c", "image": "registry.test/other:1"}]},
            },
        },
    }
    cluster.apps.create_namespaced_deployment(namespace, foreign)
    spec = _spec()
    spec["autoscaling"] = {"mode": "goodput", "minReplicas": 1, "maxReplicas": 8}
    cluster.create_service(namespace, "held", spec)
    available = cluster.wait_condition(namespace, "held", "Available", "False")
    wait_for(
        lambda: cluster.condition(namespace, "held", "Available")["reason"] == "ChildConflict",
        what="Available=False ChildConflict",
    )
    assert "held-prefill" in cluster.condition(namespace, "held", "Available")["message"], available
    other = cluster.apps.read_namespaced_deployment("held-prefill", namespace)
    assert other.spec.replicas == 0 and not (other.metadata.annotations or {}).get(
        "serving.goodput.dev/replicas-manager"
    )
    assert other.spec.template.spec.containers[0].image == "registry.test/other:1"


def test_a_steady_disaggregated_service_is_not_written_again(cluster, operator, namespace):
    spec = _spec("vllm")
    spec["autoscaling"] = {"mode": "goodput", "minReplicas": 1, "maxReplicas": 8}
    cluster.create_service(namespace, "calm", spec)

    def handed_over():
        prefill = _prefill(cluster, namespace, "calm")
        return prefill is not None and "serving.goodput.dev/replicas-manager" in (prefill.metadata.annotations or {})

    wait_for(handed_over, what="the prefill replicas handed to the autoscaler")
    cluster.wait_condition(namespace, "calm", "ModelFits", "True")

    def writes():
        """The children's generations and the Services' versions, and the operator's write Events."""
        deployments = [cluster.deployment(namespace, "calm"), _prefill(cluster, namespace, "calm")]
        services = [cluster.core.read_namespaced_service(name, namespace) for name in ("calm", "calm-prefill")]
        events = sum(e.count or 1 for e in cluster.events(namespace, "calm") if e.reason in ("Created", "Updated"))
        return [d.metadata.generation for d in deployments] + [s.metadata.resource_version for s in services] + [events]

    time.sleep(3)
    before = writes()
    time.sleep(25)  # the operator resyncs every 10 s here: two passes over an unchanged spec at least
    assert writes() == before
