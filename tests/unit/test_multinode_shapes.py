"""A replica spanning pods, without a cluster: who each pod is, how layers split into stages, what
the spec admits, the memory plan per stage, and the manifests of a group."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest

from goodput_contract.api.spec import SpecError, parse
from goodput_operator import builders, capacity
from goodput_operator.settings import Settings
from goodput_runtime.engine import rendezvous
from goodput_runtime.engine.pipeline import Topology, stage_layers

ENV = (
    "GOODPUT_NODE_RANK",
    "GOODPUT_NNODES",
    "GOODPUT_LEADER_ADDRESS",
    "GOODPUT_POD_NAME",
    "LWS_WORKER_INDEX",
    "LWS_GROUP_SIZE",
    "LWS_LEADER_ADDRESS",
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def test_a_pod_alone_when_nothing_says_more():
    assert rendezvous.group_of(None, None, None) == rendezvous.Group()


def test_flags_then_the_operators_variables_then_leaderworkersets(monkeypatch):
    assert rendezvous.group_of(1, 2, "lead:7000") == rendezvous.Group(1, 2, "lead", 7000)
    monkeypatch.setenv("GOODPUT_NNODES", "4")
    monkeypatch.setenv("GOODPUT_LEADER_ADDRESS", "big-runtime-0-0.big-ranks.ns.svc:29500")
    monkeypatch.setenv("GOODPUT_POD_NAME", "big-runtime-0-3")  # a StatefulSet pod: its ordinal is its rank
    group = rendezvous.group_of(None, None, None)
    assert (group.node_rank, group.nnodes, group.leader_host, group.leader_port) == (
        3,
        4,
        "big-runtime-0-0.big-ranks.ns.svc",
        29500,
    )
    assert group.watch_port == 29501 and group.init_method == "tcp://big-runtime-0-0.big-ranks.ns.svc:29500"
    for name in ("GOODPUT_NNODES", "GOODPUT_LEADER_ADDRESS", "GOODPUT_POD_NAME"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("LWS_WORKER_INDEX", "1")
    monkeypatch.setenv("LWS_GROUP_SIZE", "2")
    monkeypatch.setenv("LWS_LEADER_ADDRESS", "lws-runtime-0.lws-runtime.ns")  # LWS gives a host alone
    assert rendezvous.group_of(None, None, None) == rendezvous.Group(1, 2, "lws-runtime-0.lws-runtime.ns", 29500)


@pytest.mark.parametrize(
    ("rank", "nodes", "address", "words"),
    [
        (2, 2, "lead:1", "--node-rank 2 must be in [0, --nnodes 2)"),
        (1, 2, None, "--nnodes above 1 needs --leader-address"),
        (0, 2, "lead:notaport", "expected HOST:PORT"),
    ],
)
def test_a_group_that_cannot_form_is_refused_with_the_flag(rank, nodes, address, words):
    with pytest.raises(rendezvous.RendezvousError, match=words.replace("[", r"\[").replace(")", r"\)")):
        rendezvous.group_of(rank, nodes, address)


def test_ranks_spread_evenly_over_pods():
    group = rendezvous.Group(1, 2, "lead", 29500)
    assert group.ranks_per_node(4) == 2 and group.first_rank(4) == 2
    with pytest.raises(rendezvous.RendezvousError, match="evenly"):
        group.ranks_per_node(3)


def test_layers_split_into_contiguous_stages_earlier_ones_larger():
    assert [list(stage_layers(5, 2, s)) for s in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(stage_layers(30, 4, s)) for s in range(4)] == [8, 8, 7, 7]
    assert [r for s in range(3) for r in stage_layers(7, 3, s)] == list(range(7))
    with pytest.raises(ValueError, match="cannot be split"):
        stage_layers(2, 3, 0)
    t = Topology(rank=5, tensor=2, pipeline=3)
    assert (t.world, t.stage, t.tensor_rank, t.first, t.last) == (6, 2, 1, False, True)
    assert t.stage_ranks(1) == [2, 3]


def test_a_workers_health_says_loading_then_ok_and_never_ready_to_serve():
    server = rendezvous.HealthServer("127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.server.server_address[1]}"

    def status(path: str) -> int:
        try:
            return urllib.request.urlopen(url + path, timeout=5).status
        except urllib.error.HTTPError as err:
            return err.code

    try:
        assert status("/health") == 503
        server.ready = True
        assert status("/health") == 200  # liveness
        assert status("/health?serving") == 503  # readiness: the leader alone takes requests
        assert status("/v1/models") == 404
    finally:
        server.server.shutdown()


BIG = {
    "model": {"source": "hf://meta-llama/Llama-3.1-405B-Instruct"},
    "parallelism": {"tensor": 8, "pipeline": 2},
    "resources": {"gpu": 16, "gpusPerNode": 8},
}


def test_the_spec_maps_a_replica_to_pods():
    svc = parse("big", "ns", BIG)
    assert (svc.ranks, svc.pods_per_replica, svc.multi_node) == (16, 2, True)
    assert parse("one", "ns", {**BIG, "resources": {"gpu": 16, "gpusPerNode": 16}}).pods_per_replica == 1
    cpu = parse("cpu", "ns", {**BIG, "parallelism": {"tensor": 2, "nodes": 2}, "resources": {"gpu": 0}})
    assert (cpu.ranks, cpu.pods_per_replica) == (2, 2)
    assert parse("nap", "ns", {**BIG, "replicas": 3, "suspend": True}).desired_replicas == 0


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"resources": {"gpu": 8, "gpusPerNode": 8}}, "resources.gpu"),
        ({"resources": {"gpu": 16, "gpusPerNode": 6}}, "resources.gpusPerNode"),
        ({"resources": {"gpu": 16, "gpusPerNode": 0}}, "resources.gpusPerNode"),
        ({"parallelism": {"tensor": 8, "pipeline": 2, "nodes": 5}}, "parallelism.nodes"),
        ({"parallelism": {"tensor": 8, "pipeline": 2, "nodes": 1}}, "parallelism.nodes"),
        ({"parallelism": {"tensor": 8, "pipeline": 0}}, "parallelism.pipeline"),
    ],
)
def test_a_shape_that_cannot_fit_names_its_field(change, field):
    with pytest.raises(SpecError) as err:
        parse("big", "ns", {**BIG, **change})
    assert err.value.field == f"spec.{field}"


LLAMA_405B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16384,
    "intermediate_size": 53248,
    "num_hidden_layers": 126,
    "num_attention_heads": 128,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_pipeline_stages_share_out_the_weights_and_the_kv_cache():
    config = capacity.ModelConfig.from_dict(LLAMA_405B)
    common = {"dtype": "bfloat16", "quantization": "none", "max_model_len": 8192, "utilization": 0.9}
    one_node = capacity.plan(config, tensor=8, device_memory_bytes=80 * 2**30, **common)
    two_nodes = capacity.plan(config, tensor=8, pipeline=2, device_memory_bytes=80 * 2**30, **common)
    assert not one_node.fits  # 405B in bf16 is ~756 GiB: more than 8 x 80 GiB
    assert two_nodes.fits and two_nodes.max_concurrent_sequences > 0
    assert two_nodes.weight_bytes_per_gpu * 2 == pytest.approx(one_node.weight_bytes_per_gpu, abs=1)
    assert two_nodes.kv_bytes_per_token == one_node.kv_bytes_per_token // 126 * 63
    assert capacity.pipeline_problem(config, 127) is not None and capacity.pipeline_problem(config, 126) is None


def test_a_group_statefulset_tells_each_pod_the_group():
    svc = parse("big", "ns", BIG)
    owner = builders.owner_reference("big", "uid-1")
    group = builders.build_group_statefulset(svc, Settings(), owner, 1, "10.0.0.17")
    assert group["metadata"]["name"] == "big-runtime-1"
    spec = group["spec"]
    assert (spec["replicas"], spec["serviceName"], spec["podManagementPolicy"]) == (2, "big-ranks", "Parallel")
    container = spec["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["GOODPUT_NNODES"] == "2"
    assert env["GOODPUT_LEADER_ADDRESS"] == "10.0.0.17:29500"  # the leader Service's ClusterIP: no DNS needed
    leader = builders.build_leader_service(svc, owner, 1)
    assert leader["metadata"]["name"] == "big-runtime-1" and leader["spec"]["publishNotReadyAddresses"] is True
    assert leader["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "big-runtime-1-0"
    assert [p["port"] for p in leader["spec"]["ports"]] == [29500, 29501]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert container["args"][-2:] == ["--pipeline-parallel-size", "2"]
    assert builders.build_pdb(parse("big", "ns", {**BIG, "replicas": 3}), owner) is None
    lws = builders.build_leader_worker_set(svc, Settings(), owner)
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2


def test_the_network_policy_lets_a_groups_pods_reach_each_other_and_no_one_else_past_the_serving_port():
    from goodput_operator.network import build_network_policy

    owner = builders.owner_reference("big", "uid-1")
    rules = build_network_policy(parse("big", "ns", BIG), Settings(), owner)["spec"]["ingress"]
    # the serving port for the gateways, the operator, the namespace and monitoring; every port for the
    # service's own pods (the leader's store and heartbeat, then gloo's or NCCL's connections between ranks)
    assert [r.get("ports") for r in rules] == [[{"protocol": "TCP", "port": 8000}], None]
    assert rules[1]["from"] == [{"podSelector": {"matchLabels": builders.selector_labels(parse("big", "ns", BIG))}}]
    one_pod = {**BIG, "parallelism": {"tensor": 8}, "resources": {"gpu": 8}}
    assert len(build_network_policy(parse("small", "ns", one_pod), Settings(), owner)["spec"]["ingress"]) == 1
