"""Capacity math against hand-computed figures for two published model configs."""

import pytest

from goodput_contract.api.spec import Resources
from goodput_operator import capacity
from goodput_operator.capacity import ModelConfig

# meta-llama/Meta-Llama-3-8B config.json (the fields that size it)
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "torch_dtype": "bfloat16",
}

# Qwen/Qwen2.5-7B-Instruct config.json (q/k/v projections carry biases)
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

GIB = 2**30


def test_llama3_8b_parameters_match_the_published_count():
    # embed 128256*4096 = 525,336,576, twice (untied head); per layer: attention
    # 4096*(4096+1024+1024) + 4096*4096 = 41,943,040, MLP 3*4096*14336 = 176,160,768,
    # norms 8,192 -> 218,112,000 x 32 = 6,979,584,000; final norm 4,096.
    assert capacity.parameter_count(ModelConfig.from_dict(LLAMA3_8B)) == 8_030_261_248


def test_qwen25_7b_parameters_match_the_published_count():
    # embed 152064*3584 = 544,997,376 twice; per layer: attention 3584*(3584+512+512)
    # + 3584*3584 = 29,360,128, q/k/v biases 4,608, MLP 3*3584*18944 = 203,685,888,
    # norms 7,168 -> 233,057,792 x 28 = 6,525,618,176; final norm 3,584.
    assert capacity.parameter_count(ModelConfig.from_dict(QWEN25_7B)) == 7_615_616_512


def test_kv_bytes_per_token_is_two_layers_heads_dim_bytes_over_tensor():
    llama, qwen = ModelConfig.from_dict(LLAMA3_8B), ModelConfig.from_dict(QWEN25_7B)
    assert capacity.kv_bytes_per_token(llama, "auto") == 2 * 32 * 8 * 128 * 2 == 131_072
    assert capacity.kv_bytes_per_token(qwen, "bfloat16") == 2 * 28 * 4 * 128 * 2 == 57_344
    assert capacity.kv_bytes_per_token(qwen, "bfloat16", tensor=2) == 28_672
    assert capacity.kv_bytes_per_token(llama, "float32") == 262_144


def test_weight_bytes_by_dtype_and_int8_quantization():
    llama = ModelConfig.from_dict(LLAMA3_8B)
    assert capacity.weight_bytes(llama, "bfloat16") == 16_060_522_496
    assert capacity.weight_bytes(llama, "float32") == 32_121_044_992
    # int8: 32 layers x 218,103,808 linear weights at 1 byte, plus one float32 scale per
    # output channel (4096+1024+1024+4096+14336+14336+4096 = 43,008 per layer), plus
    # embeddings, head and norms (1,050,939,392) at 2 bytes.
    assert (
        capacity.weight_bytes(llama, "bfloat16", "int8")
        == (6_979_321_856 + 32 * 43_008 * 4 + 1_050_939_392 * 2)
        == 9_086_705_664
    )
    assert capacity.weight_bytes(llama, "bfloat16", "fp8") == 9_086_705_664


def test_llama3_8b_on_one_80gib_gpu_holds_56_full_length_sequences():
    plan = capacity.plan(
        ModelConfig.from_dict(LLAMA3_8B),
        dtype="auto",
        quantization="none",
        tensor=1,
        max_model_len=8192,
        device_memory_bytes=80 * GIB,
        utilization=0.9,
    )
    # 80 GiB x 0.9 = 77,309,411,328; minus weights 16,060,522,496 and 512 MiB reserve
    # = 60,712,017,920 bytes of KV; one 8192-token sequence takes 131,072 x 8192 = 1 GiB.
    assert plan.kv_budget_bytes == 60_712_017_920
    assert plan.max_concurrent_sequences == 56
    assert plan.fits is True
    assert plan.as_status() == {
        "weightBytes": 16_060_522_496,
        "kvBytesPerToken": 131_072,
        "maxModelLen": 8192,
        "kvCacheBytes": 60_712_017_920,
        "maxConcurrentSequences": 56,
        "fits": True,
    }
    assert "56 sequences of 8192 tokens" in plan.describe(0.9)


def test_qwen25_7b_on_two_24gib_gpus_at_full_context():
    plan = capacity.plan(
        ModelConfig.from_dict(QWEN25_7B),
        dtype="bfloat16",
        quantization="none",
        tensor=2,
        max_model_len=None,
        device_memory_bytes=24 * GIB,
        utilization=0.9,
    )
    # weights 15,231,233,024 / 2 = 7,615,616,512 per GPU; 24 GiB x 0.9 = 23,192,823,398
    # minus weights and reserve = 15,040,335,974; a 32768-token sequence at 28,672 B/token
    # per GPU = 939,524,096 -> 16 sequences.
    assert plan.weight_bytes_per_gpu == 7_615_616_512
    assert plan.max_model_len == 32768
    assert plan.kv_budget_bytes == 15_040_335_974
    assert plan.max_concurrent_sequences == 16


def test_a_model_too_big_for_the_gpu_does_not_fit():
    plan = capacity.plan(
        ModelConfig.from_dict(LLAMA3_8B),
        dtype="bfloat16",
        quantization="none",
        tensor=1,
        max_model_len=8192,
        device_memory_bytes=16 * GIB,
        utilization=0.9,
    )
    assert plan.fits is False
    assert plan.max_concurrent_sequences == 0
    assert "no 8192-token sequence fits" in plan.describe(0.9)


def test_unknown_gpu_memory_leaves_the_fit_unknown():
    plan = capacity.plan(
        ModelConfig.from_dict(QWEN25_7B),
        dtype="auto",
        quantization="none",
        tensor=1,
        max_model_len=4096,
        device_memory_bytes=None,
        utilization=0.9,
    )
    assert plan.fits is None
    assert "fits" not in plan.as_status()
    assert "gpuMemory" in plan.describe(0.9)


@pytest.mark.parametrize(("tensor", "problem"), [(1, False), (2, False), (4, False), (7, True), (8, True)])
def test_tensor_parallel_must_divide_qwen_attention_heads(tensor, problem):
    message = capacity.tensor_parallel_problem(ModelConfig.from_dict(QWEN25_7B), tensor)
    assert (message is not None) == problem
    if problem:
        assert "heads" in message


def test_llama_tensor_parallel_beyond_its_kv_heads_is_refused_as_the_runtime_refuses_it():
    # the runtime splits KV heads evenly and never replicates them: 16 ranks cannot split 8
    llama = ModelConfig.from_dict(LLAMA3_8B)
    message = capacity.tensor_parallel_problem(llama, 16)
    assert message is not None
    assert "KV heads (8) is not divisible by parallelism.tensor 16" in message
    assert "must be 1, 2, 4 or 8" in message
    assert capacity.tensor_parallel_problem(llama, 8) is None
    assert capacity.kv_bytes_per_token(llama, "bfloat16", tensor=8) == 2 * 32 * 1 * 128 * 2


def test_tensor_parallel_must_divide_the_mlp_intermediate_size():
    # heads and KV heads split 4 ways, the MLP's 1002 columns do not
    config = ModelConfig.from_dict({**LLAMA3_8B, "intermediate_size": 1002})
    message = capacity.tensor_parallel_problem(config, 4)
    assert message is not None and "MLP intermediate size (1002) is not divisible by parallelism.tensor 4" in message
    assert capacity.tensor_parallel_problem(config, 2) is None


def test_an_architecture_the_runtime_does_not_serve_is_named():
    assert capacity.architecture_problem(ModelConfig.from_dict(LLAMA3_8B)) is None
    gpt2 = ModelConfig.from_dict({**LLAMA3_8B, "architectures": ["GPT2LMHeadModel"]})
    message = capacity.architecture_problem(gpt2)
    assert message is not None
    assert "unsupported architecture GPT2LMHeadModel" in message
    assert "LlamaForCausalLM" in message


def test_config_without_a_needed_key_names_it():
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_dict({k: v for k, v in LLAMA3_8B.items() if k != "num_hidden_layers"})


def test_device_memory_from_spec_product_or_host_memory():
    assert capacity.device_memory_bytes(Resources(gpu=1, gpu_memory="40Gi")) == 40 * GIB
    assert capacity.device_memory_bytes(Resources(gpu=1, gpu_product="NVIDIA-H100-80GB-HBM3")) == 80 * GIB
    assert capacity.device_memory_bytes(Resources(gpu=1, gpu_product="Unknown-GPU")) is None
    assert capacity.device_memory_bytes(Resources(gpu=0, memory="8Gi")) == 8 * GIB


def test_fp8_needs_ada_or_newer_when_the_gpu_is_known():
    from goodput_contract.api.spec import Resources
    from goodput_operator.capacity import quantization_problem

    assert quantization_problem("fp8", Resources(gpu=1, gpu_product="NVIDIA-H100-80GB-HBM3")) is None
    assert quantization_problem("fp8", Resources(gpu=1, gpu_product="NVIDIA-L4")) is None
    assert quantization_problem("fp8", Resources(gpu=1)) is None  # unknown GPU: the runtime decides at start
    assert "Tesla-T4 has 7.5" in quantization_problem("fp8", Resources(gpu=1, gpu_product="Tesla-T4"))
    assert "resources.gpu is 0" in quantization_problem("fp8", Resources(gpu=0))
    assert quantization_problem("int8", Resources(gpu=0)) is None
