"""spec.engine.kvOffload against a real API server and operator: the Deployment's runtime gets the
offload flags, the tier's volume and the memory it takes; the capacity plan counts the tier; a bad
value is refused naming the field, before or after the API server's schema."""

import pytest
from kubernetes.client.exceptions import ApiException

from goodput_runtime.__main__ import build_parser

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
    hub.configs["acme/offload-7b"] = QWEN25_7B


def _spec(offload, **engine):
    return {
        "model": {"source": "hf://acme/offload-7b", "maxModelLen": 8192},
        "engine": {"kvOffload": offload, **engine},
        "resources": {"gpu": 1, "gpuMemory": "80Gi", "memory": "16Gi"},
    }


def test_the_runtime_gets_the_tier_its_volume_and_its_memory(cluster, operator, namespace):
    cluster.create_service(namespace, "tiered", _spec({"bytes": "8Gi"}))
    deployment = cluster.wait_deployment(namespace, "tiered")
    pod = deployment.spec.template.spec
    container = pod.containers[0]
    parsed = build_parser().parse_args(container.args)
    assert parsed.kv_offload_bytes == 8 << 30
    mount = next(m for m in container.volume_mounts if m.name == "kv-offload")
    assert parsed.kv_offload_dir == mount.mount_path
    volume = next(v for v in pod.volumes if v.name == "kv-offload")
    assert volume.empty_dir.medium == "Memory" and volume.empty_dir.size_limit == str(8 << 30)
    # 16Gi for the runtime plus 8Gi for the tier's pages
    assert container.resources.requests["memory"] == container.resources.limits["memory"] == str(24 << 30)
    cluster.wait_condition(namespace, "tiered", "ModelFits", "True")
    capacity = cluster.get_service(namespace, "tiered")["status"]["capacity"]
    # 57,344 bytes of KV per token: 16-token blocks of 917,504 bytes, each slot with a 28-byte header
    assert capacity["kvOffloadBytes"] == 8 << 30
    assert capacity["kvOffloadTokens"] == (8 << 30) // (917_504 + 28) * 16


def test_a_bad_value_is_refused_naming_the_field(cluster, operator, namespace):
    with pytest.raises(ApiException) as err:  # the schema: not a quantity, not a medium
        cluster.create_service(namespace, "tape", _spec({"bytes": "1Gi", "medium": "tape"}))
    assert err.value.status == 422 and "spec.engine.kvOffload.medium" in err.value.body
    with pytest.raises(ApiException) as err:
        cluster.create_service(namespace, "lots", _spec({"bytes": "lots"}))
    assert err.value.status == 422 and "spec.engine.kvOffload.bytes" in err.value.body

    cluster.create_service(namespace, "tiny-tier", _spec({"bytes": "512Ki"}))  # the operator: below 1Mi
    valid = cluster.wait_condition(namespace, "tiny-tier", "Valid", "False")
    assert valid["message"].startswith("spec.engine.kvOffload.bytes:")
    assert cluster.deployment(namespace, "tiny-tier") is None

    # 1Mi holds no 32-token block of this model (1,835,008 bytes each): only the model's config shows it
    cluster.create_service(namespace, "one-block", _spec({"bytes": "1Mi"}, extraArgs=["--block-size", "32"]))
    valid = cluster.wait_condition(namespace, "one-block", "Valid", "False")
    assert valid["message"].startswith("spec.engine.kvOffload.bytes:") and "less than one KV block" in valid["message"]

    cluster.create_service(namespace, "vllm-tier", {**_spec({"bytes": "1Gi"}, kind="vllm")})
    valid = cluster.wait_condition(namespace, "vllm-tier", "Valid", "False")
    assert valid["reason"] == "EngineUnsupportedField"
    assert valid["message"].startswith("spec.engine.kvOffload: cannot be honoured by engine.kind vllm")
    assert cluster.deployment(namespace, "vllm-tier") is None
