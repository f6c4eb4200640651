"""The two roles' manifests as plain dicts: the goodput runtime's own parser takes each role's command line,
and each role's capacity plan is its own."""

from dataclasses import replace

from goodput_contract.api.spec import parse
from goodput_operator import capacity, roles
from goodput_operator.builders import build_deployment, owner_reference
from goodput_operator.settings import Settings
from goodput_runtime.__main__ import build_parser

OWNER = owner_reference("chat", "0000-uid")
SETTINGS = Settings(runtime_image="registry.local/goodput-runtime:test")
SPEC = {
    "model": {"source": "hf://acme/tiny", "servedName": "chat"},
    "resources": {"gpu": 1},
    "disaggregation": {"prefill": {"minReplicas": 2, "maxReplicas": 4}, "decode": {"minReplicas": 1}},
}


def _container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


def test_the_runtime_parses_each_roles_command_line():
    svc = parse("chat", "ns", SPEC)
    for role, (deployment, _) in (
        (roles.PREFILL, roles.build_prefill(svc, SETTINGS, OWNER)),
        (roles.DECODE, roles.build_decode(svc, SETTINGS, OWNER)),
    ):
        args = build_parser().parse_args(_container(deployment)["args"])
        assert (args.kv_transfer_role, args.kv_transfer_port) == (role, roles.KV_PORT)
        assert args.kv_transfer_transport == "tcp"  # spec.disaggregation.transport, the runtime's default
        assert args.kv_transfer_host is None  # the runtime advertises $POD_IP, which the pod is given
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in (
            _container(deployment)["env"]
        )


def test_an_aggregated_service_takes_no_part_in_hand_offs():
    spec = {k: v for k, v in SPEC.items() if k != "disaggregation"}
    deployment = build_deployment(parse("chat", "ns", spec), SETTINGS, OWNER)
    container = _container(deployment)
    assert build_parser().parse_args(container["args"]).kv_transfer_role == "none"
    assert [p["name"] for p in container["ports"]] == ["http"]
    assert "serving.goodput.dev/role" not in deployment["spec"]["template"]["metadata"]["labels"]


def test_a_role_with_its_own_tensor_size_gets_its_gpus_and_its_plan():
    spec = {**SPEC, "engine": {"kind": "vllm"}}
    spec["disaggregation"] = {**SPEC["disaggregation"], "prefill": {"minReplicas": 1, "tensor": 2}}
    svc = parse("chat", "ns", spec)
    prefill, _ = roles.build_prefill(svc, SETTINGS, OWNER)
    decode, _ = roles.build_decode(svc, SETTINGS, OWNER)
    assert _container(prefill)["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert _container(decode)["resources"]["limits"]["nvidia.com/gpu"] == "1"

    config = capacity.ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": 32000,
            "hidden_size": 2048,
            "intermediate_size": 5632,
            "num_hidden_layers": 22,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048,
        }
    )

    def plan(tensor):
        return capacity.plan(
            config,
            dtype="bfloat16",
            quantization="none",
            tensor=tensor,
            max_model_len=2048,
            device_memory_bytes=24 * capacity.GIB,
            utilization=0.9,
        )

    pools = capacity.Pools({"prefill": (2, plan(2)), "decode": (1, plan(1))})
    status = pools.as_status()
    assert status["pools"]["prefill"]["tensor"] == 2 and status["pools"]["decode"]["tensor"] == 1
    assert status["pools"]["prefill"]["kvBytesPerToken"] * 2 == status["kvBytesPerToken"]  # the decode role's
    assert status["fits"] is True
    assert "prefill (2 GPUs per replica)" in pools.describe(0.9)
    too_small = capacity.Pools({"prefill": (2, plan(2)), "decode": (1, replace(plan(1), fits=False))})
    assert too_small.fits is False and too_small.as_status()["fits"] is False


def test_the_prefill_replicas_by_autoscaling_mode():
    def prefill(**spec):
        deployment, _ = roles.build_prefill(parse("chat", "ns", {**SPEC, **spec}), SETTINGS, OWNER)
        return deployment["spec"].get("replicas")

    assert prefill() == 2  # prefill.minReplicas
    assert prefill(autoscaling={"mode": "hpa", "minReplicas": 1, "maxReplicas": 3}) == 2
    # goodput mode: left out of the operator's apply, the autoscaler's (set at creation by the reconcile)
    assert prefill(autoscaling={"mode": "goodput", "minReplicas": 1, "maxReplicas": 3}) is None
    assert prefill(autoscaling={"mode": "goodput", "minReplicas": 1, "maxReplicas": 3}, suspend=True) == 0
    assert prefill(suspend=True) == 0
