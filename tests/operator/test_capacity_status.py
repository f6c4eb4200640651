"""ModelFits and status.capacity from a config.json fetched over HTTP (a Hub stand-in)."""

import pytest

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
    hub.configs["Qwen/Qwen2.5-7B-Instruct"] = QWEN25_7B
    hub.configs["acme/private-7b"] = QWEN25_7B
    hub.gated["acme/private-7b"] = "hf_s3cret"


def _spec(**overrides):
    spec = {
        "model": {"source": "hf://Qwen/Qwen2.5-7B-Instruct", "maxModelLen": 8192},
        "resources": {"gpu": 1, "gpuMemory": "80Gi"},
    }
    spec.update(overrides)
    return spec


def test_model_that_fits_reports_its_numbers(cluster, operator, namespace):
    cluster.create_service(namespace, "qwen", _spec())
    fits = cluster.wait_condition(namespace, "qwen", "ModelFits", "True")
    capacity = cluster.get_service(namespace, "qwen")["status"]["capacity"]
    assert capacity["weightBytes"] == 15_231_233_024
    assert capacity["kvBytesPerToken"] == 57_344
    # (80 GiB x 0.9 - 15,231,233,024 - 512 MiB) // (57,344 x 8192) = 131
    assert capacity["maxConcurrentSequences"] == 131
    assert "131 sequences of 8192 tokens" in fits["message"]


def test_model_too_large_warns(cluster, operator, namespace):
    cluster.create_service(namespace, "small-gpu", _spec(resources={"gpu": 1, "gpuMemory": "16Gi"}))
    fits = cluster.wait_condition(namespace, "small-gpu", "ModelFits", "False")
    assert fits["reason"] == "ModelTooLarge"
    assert cluster.get_service(namespace, "small-gpu")["status"]["capacity"]["fits"] is False


def test_tensor_parallel_that_does_not_divide_the_heads_is_refused(cluster, operator, namespace):
    spec = _spec(parallelism={"tensor": 8}, resources={"gpu": 8, "gpuMemory": "80Gi"})
    cluster.create_service(namespace, "tp8", spec)
    valid = cluster.wait_condition(namespace, "tp8", "Valid", "False")
    assert valid["reason"] == "TensorParallelMismatch"
    assert "28 attention heads" in valid["message"]
    assert cluster.wait_condition(namespace, "tp8", "ModelFits", "False")["reason"] == "TensorParallelMismatch"
    assert cluster.deployment(namespace, "tp8") is None


def test_an_architecture_the_runtime_cannot_serve_is_refused_before_any_pod(cluster, operator, namespace, hub):
    hub.configs["acme/neox-7b"] = {**QWEN25_7B, "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"}
    cluster.create_service(namespace, "neox", _spec(model={"source": "hf://acme/neox-7b"}))
    valid = cluster.wait_condition(namespace, "neox", "Valid", "False")
    assert valid["reason"] == "ArchitectureUnsupported"
    assert "GPTNeoXForCausalLM" in valid["message"] and "LlamaForCausalLM" in valid["message"]
    assert cluster.wait_condition(namespace, "neox", "ModelFits", "False")["reason"] == "ArchitectureUnsupported"
    assert cluster.wait_condition(namespace, "neox", "Ready", "False")["reason"]


def test_fp8_on_a_gpu_older_than_ada_is_refused_before_any_pod(cluster, operator, namespace):
    spec = _spec(
        model={"source": "hf://Qwen/Qwen2.5-7B-Instruct", "quantization": "fp8"},
        resources={"gpu": 1, "gpuProduct": "NVIDIA-A100-SXM4-80GB"},
    )
    cluster.create_service(namespace, "fp8-a100", spec)
    valid = cluster.wait_condition(namespace, "fp8-a100", "Valid", "False")
    assert valid["reason"] == "QuantizationUnsupported"
    assert "compute capability 8.9 or newer" in valid["message"]
    assert "NVIDIA-A100-SXM4-80GB has 8.0" in valid["message"]
    fits = cluster.wait_condition(namespace, "fp8-a100", "ModelFits", "False")
    assert fits["reason"] == "QuantizationUnsupported"
    assert cluster.deployment(namespace, "fp8-a100") is None


def test_gated_model_uses_the_token_secret(cluster, operator, namespace):
    spec = _spec(model={"source": "hf://acme/private-7b", "maxModelLen": 8192, "tokenSecretRef": {"name": "hf-token"}})
    cluster.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "hf-token"}, "stringData": {"token": "hf_s3cret"}}
    )
    cluster.create_service(namespace, "private", spec)
    cluster.wait_condition(namespace, "private", "ModelFits", "True")
    env = cluster.wait_deployment(namespace, "private").spec.template.spec.containers[0].env
    token = next(e for e in env if e.name == "HF_TOKEN")
    assert (token.value_from.secret_key_ref.name, token.value_from.secret_key_ref.key) == ("hf-token", "token")


def test_unknown_model_leaves_the_fit_unknown_but_serves(cluster, operator, namespace):
    cluster.create_service(namespace, "mystery", _spec(model={"source": "hf://acme/not-there"}))
    fits = cluster.wait_condition(namespace, "mystery", "ModelFits", "Unknown")
    cluster.wait_deployment(namespace, "mystery")
    fits = cluster.wait_condition(namespace, "mystery", "ModelFits", "Unknown")
    assert fits["reason"] in ("FetchingConfig", "ConfigUnavailable")
