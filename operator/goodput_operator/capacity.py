"""Memory math for a model on a GPU: weights, KV cache per token, concurrent sequences.

Pure functions of a Hugging Face `config.json` (as a dict) and the spec's numbers.
Dense decoder-only transformers in the Llama/Qwen/Mistral shape; mixture-of-experts
configs count every expert's MLP. Weight-only quantization (int8, fp8) stores each
transformer-layer linear weight in one byte plus one float32 scale per output channel (as
the runtime does); embeddings, norms, biases and the LM head stay in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goodput_contract import architectures as arch
from goodput_contract import parallel
from goodput_contract import quantization as quant
from goodput_contract.api.quantity import quantity_bytes
from goodput_contract.api.spec import Resources

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZED_BYTES = quant.WEIGHT_BYTES
SCALE_BYTES = quant.SCALE_BYTES  # the runtime keeps one float32 scale per output channel
# CUDA context, activations and allocator slack, per GPU, kept out of the KV budget.
RESERVED_BYTES_PER_GPU = 512 * 2**20
GIB = 2**30

# Nominal memory of common GPUs by their `nvidia.com/gpu.product` label.
GPU_MEMORY_BYTES = {
    "NVIDIA-H200": 141 * GIB,
    "NVIDIA-H100-80GB-HBM3": 80 * GIB,
    "NVIDIA-H100-PCIe": 80 * GIB,
    "NVIDIA-A100-SXM4-80GB": 80 * GIB,
    "NVIDIA-A100-80GB-PCIe": 80 * GIB,
    "NVIDIA-A100-SXM4-40GB": 40 * GIB,
    "NVIDIA-L40S": 48 * GIB,
    "NVIDIA-A10G": 24 * GIB,
    "NVIDIA-L4": 24 * GIB,
    "Tesla-T4": 16 * GIB,
}

# CUDA compute capability by product label; fp8 weights need 8.9 (Ada) or newer.
GPU_COMPUTE_CAPABILITY = {
    "NVIDIA-H200": (9, 0),
    "NVIDIA-H100-80GB-HBM3": (9, 0),
    "NVIDIA-H100-PCIe": (9, 0),
    "NVIDIA-A100-SXM4-80GB": (8, 0),
    "NVIDIA-A100-80GB-PCIe": (8, 0),
    "NVIDIA-A100-SXM4-40GB": (8, 0),
    "NVIDIA-L40S": (8, 9),
    "NVIDIA-A10G": (8, 6),
    "NVIDIA-L4": (8, 9),
    "Tesla-T4": (7, 5),
}
FP8_MIN_CAPABILITY = quant.FP8_MIN_CAPABILITY


def quantization_problem(method: str, r: Resources) -> str | None:
    """Why the spec's quantization cannot run on its GPUs, when that is known before any pod starts
    (no GPU, or a GPU product of known compute capability); the runtime checks the rest at start."""
    if problem := quant.method_problem(method):
        return problem
    if r.gpu == 0:
        return quant.capability_problem(method, None, "resources.gpu is 0")
    capability = GPU_COMPUTE_CAPABILITY.get(r.gpu_product or "")
    if capability is None:
        return None
    return quant.capability_problem(
        method, capability, f"resources.gpuProduct {r.gpu_product} has {capability[0]}.{capability[1]}"
    )


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int
    torch_dtype: str
    max_position_embeddings: int | None
    architectures: tuple[str, ...] = ()

    @property
    def shape(self) -> parallel.ModelShape:
        """What tensor parallelism splits."""
        return parallel.ModelShape(self.num_heads, self.num_kv_heads, self.intermediate_size)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> ModelConfig:
        """ValueError naming the missing key when the config is not a decoder we can size."""
        if "text_config" in config and "hidden_size" not in config:
            config = {**config["text_config"], "tie_word_embeddings": config.get("tie_word_embeddings", False)}

        def need(key: str) -> int:
            if key not in config:
                raise ValueError(f"config.json has no {key!r}")
            return int(config[key])

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        model_type = str(config.get("model_type", ""))
        return cls(
            model_type=model_type,
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            num_layers=need("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            intermediate_size=need("intermediate_size"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", model_type == "qwen2")),
            num_experts=int(config.get("num_local_experts") or config.get("num_experts") or 1),
            torch_dtype=str(config.get("torch_dtype") or config.get("dtype") or "bfloat16"),
            max_position_embeddings=config.get("max_position_embeddings"),
            architectures=tuple(str(a) for a in config.get("architectures") or ()),
        )


def resolve_dtype(config: ModelConfig, dtype: str) -> str:
    """The compute dtype: the spec's, or for "auto" the checkpoint's (bfloat16 if unknown)."""
    if dtype != "auto":
        return dtype
    return config.torch_dtype if config.torch_dtype in DTYPE_BYTES else "bfloat16"


def _attention_out_features(c: ModelConfig) -> tuple[int, int, int, int]:
    """Output features of q, k, v and o projections."""
    return c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.hidden_size


def layer_linear_params(c: ModelConfig) -> int:
    """Weights of one layer's linear projections (the quantizable part), biases excluded."""
    q, k, v, o = _attention_out_features(c)
    attention = c.hidden_size * (q + k + v) + c.num_heads * c.head_dim * o
    mlp = 3 * c.hidden_size * c.intermediate_size * c.num_experts
    router = c.hidden_size * c.num_experts if c.num_experts > 1 else 0
    return attention + mlp + router


def _layer_other_params(c: ModelConfig) -> int:
    """Per layer: two norms, plus q/k/v biases where the architecture has them."""
    q, k, v, _ = _attention_out_features(c)
    return 2 * c.hidden_size + ((q + k + v) if c.attention_bias else 0)


def _layer_output_channels(c: ModelConfig) -> int:
    q, k, v, o = _attention_out_features(c)
    return q + k + v + o + (2 * c.intermediate_size + c.hidden_size) * c.num_experts


def parameter_count(c: ModelConfig) -> int:
    embeddings = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_layers * (layer_linear_params(c) + _layer_other_params(c)) + embeddings + c.hidden_size


def weight_bytes(c: ModelConfig, dtype: str, quantization: str = "none") -> int:
    """Bytes of weights for the whole model (before tensor-parallel sharding)."""
    width = DTYPE_BYTES[resolve_dtype(c, dtype)]
    if quantization == "none":
        return parameter_count(c) * width
    linear = c.num_layers * layer_linear_params(c)
    scales = c.num_layers * _layer_output_channels(c) * SCALE_BYTES
    rest = parameter_count(c) - linear
    return linear * QUANTIZED_BYTES[quantization] + scales + rest * width


def kv_heads_per_gpu(c: ModelConfig, tensor: int) -> int:
    """KV heads each GPU holds: an even share (ValueError where `tensor` does not divide them;
    `tensor_parallel_problem` says so first)."""
    return parallel.kv_heads_per_rank(c.shape, tensor)


def kv_bytes_per_token(c: ModelConfig, dtype: str, tensor: int = 1) -> int:
    """K and V for every layer, per GPU: 2 × layers × kv_heads × head_dim × dtype bytes ÷ tensor."""
    width = DTYPE_BYTES[resolve_dtype(c, dtype)]
    return 2 * c.num_layers * kv_heads_per_gpu(c, tensor) * c.head_dim * width


def tensor_parallel_problem(c: ModelConfig, tensor: int) -> str | None:
    """Why `tensor` GPUs cannot split this model (the runtime's rule: the tensor-parallel size divides
    the attention heads, the KV heads and the MLP's intermediate size), or None when they can."""
    return parallel.tensor_parallel_problem(c.shape, tensor, "parallelism.tensor")


def pipeline_problem(c: ModelConfig, pipeline: int) -> str | None:
    """Why `pipeline` stages cannot split this model (each stage needs at least one layer), naming the field."""
    return parallel.pipeline_problem(c.num_layers, pipeline, "parallelism.pipeline")


def architecture_problem(c: ModelConfig) -> str | None:
    """Why the runtime cannot serve this model's architecture, or None when it can."""
    return arch.architecture_problem(c.architectures, "config.json")


@dataclass(frozen=True)
class Capacity:
    weight_bytes: int  # whole model
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int  # per GPU
    max_model_len: int
    device_memory_bytes: int | None
    kv_budget_bytes: int | None  # per GPU
    max_concurrent_sequences: int | None
    fits: bool | None

    def as_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "weightBytes": self.weight_bytes,
            "kvBytesPerToken": self.kv_bytes_per_token,
            "maxModelLen": self.max_model_len,
        }
        if self.max_concurrent_sequences is not None:
            out["maxConcurrentSequences"] = self.max_concurrent_sequences
            out["kvCacheBytes"] = self.kv_budget_bytes
        if self.fits is not None:
            out["fits"] = self.fits
        return out

    def describe(self, utilization: float) -> str:
        weights = f"weights {gib(self.weight_bytes_per_gpu)} per GPU, KV {self.kv_bytes_per_token} B per token"
        if self.device_memory_bytes is None:
            return f"{weights}; set resources.gpuMemory or resources.gpuProduct to check the fit"
        budget = f"{gib(self.device_memory_bytes)} x {utilization:g}"
        if not self.fits:
            return f"{weights}; no {self.max_model_len}-token sequence fits in {budget}"
        return f"{weights}; {self.max_concurrent_sequences} sequences of {self.max_model_len} tokens fit in {budget}"


@dataclass(frozen=True)
class Pools:
    """The plan of each role's replicas with spec.disaggregation: role -> (tensor-parallel size, plan).
    Both roles hold the whole model; the decode pool's KV cache holds the running contexts, the prefill
    pool's the prompts it computes and the blocks it keeps under lease until decode pulls them."""

    plans: dict[str, tuple[int, Capacity]]

    @property
    def fits(self) -> bool | None:
        """Whether every role's replica fits; None while one is unknown."""
        each = [plan.fits for _, plan in self.plans.values()]
        return None if None in each else all(each)

    def as_status(self) -> dict[str, Any]:
        """status.capacity: the decode role's plan (the pods behind the service's own Service), each role's
        under pools, and fits for both."""
        out = self.plans["decode"][1].as_status()
        out["pools"] = {role: {"tensor": tensor, **plan.as_status()} for role, (tensor, plan) in self.plans.items()}
        if self.fits is not None:
            out["fits"] = self.fits
        return out

    def describe(self, utilization: float) -> str:
        described = {role: plan.describe(utilization) for role, (_, plan) in self.plans.items()}
        if len(set(described.values())) == 1:
            return f"each role: {next(iter(described.values()))}"
        parts = []
        for role, text in described.items():
            gpus = self.plans[role][0]
            parts.append(f"{role} ({gpus} GPU{'' if gpus == 1 else 's'} per replica): {text}")
        return "; ".join(parts)


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def plan(
    c: ModelConfig,
    *,
    dtype: str,
    quantization: str,
    tensor: int,
    max_model_len: int | None,
    device_memory_bytes: int | None,
    utilization: float,
    reserved_bytes: int = RESERVED_BYTES_PER_GPU,
    draft: ModelConfig | None = None,
    pipeline: int = 1,
) -> Capacity:
    """The fit of the model (and of speculative decoding's draft model, which the runtime loads
    unquantized and unsharded beside the first rank, with a KV cache of as many tokens as the model's).
    With `pipeline` stages a GPU holds its stage's share of the weights and its stage's layers' KV
    cache; the first stage, with the most layers (and the embeddings), is the one sized."""
    weights = weight_bytes(c, dtype, quantization)
    per_gpu = -(-weights // (tensor * pipeline))
    per_token = kv_bytes_per_token(c, dtype, tensor)
    if pipeline > 1 and c.num_layers:
        per_token = per_token // c.num_layers * -(-c.num_layers // pipeline)
    if draft is not None:
        draft_weights = weight_bytes(draft, dtype)
        weights += draft_weights
        per_gpu += draft_weights
        per_token += kv_bytes_per_token(draft, dtype)
    length = max_model_len or c.max_position_embeddings or 2048
    if device_memory_bytes is None:
        return Capacity(weights, per_gpu, per_token, length, None, None, None, None)
    budget = int(device_memory_bytes * utilization) - per_gpu - reserved_bytes
    sequences = max(0, budget) // (per_token * length)
    return Capacity(weights, per_gpu, per_token, length, device_memory_bytes, budget, sequences, sequences >= 1)


def device_memory_bytes(r: Resources) -> int | None:
    """Memory one GPU offers (spec'd, else looked up by product); host memory when running on CPU."""
    if r.gpu == 0:
        return quantity_bytes(r.memory) if r.memory else None
    if r.gpu_memory:
        return quantity_bytes(r.gpu_memory)
    return GPU_MEMORY_BYTES.get(r.gpu_product or "")
