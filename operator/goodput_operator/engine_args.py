"""Each engine's command line and environment from the CR: Goodput's runtime, vLLM and SGLang.

Flags were checked against each engine's own parser: Goodput's from `goodput_contract.flags`,
vLLM 0.32.0's `vllm.entrypoints.openai.api_server --help`, SGLang's `ServerArgs`.
"""

from __future__ import annotations

import json

from goodput_contract import flags
from goodput_contract.api.spec import LoraAdapter, ModelSource, ServiceSpec
from goodput_contract.latency_buckets import (
    SGLANG_TPOT_BUCKETS,
    SGLANG_TTFT_BUCKETS,
    VLLM_TPOT_BUCKETS,
    VLLM_TTFT_BUCKETS,
    with_boundary,
)
from goodput_operator.kv_offload_pod import offload_args

GOODPUT, VLLM, SGLANG = "goodput", "vllm", "sglang"
RUNTIME_PORT = 8000  # every engine listens here, serving the API, its health check and /metrics
MODEL_CACHE_DIR = "/var/cache/goodput"
SOURCE_MOUNT = "/mnt/models"
NODE_CACHE_MOUNT = "/mnt/node-cache"  # spec.model.nodeCache: the node's copy of the model, read-only
LORA_MOUNT = "/mnt/loras"  # a pvc:// adapter's claim is mounted at LORA_MOUNT/<adapter name>
# After SIGTERM our runtime keeps admitting requests (Connection: close) with /health at 503
# for SHUTDOWN_DELAY_SECONDS, so endpoints drop the pod before it stops accepting. Engines
# without such a flag get the same delay from a preStop sleep.
SHUTDOWN_DELAY_SECONDS = 5
# spec.disaggregation: the KV hand-off's port, the runtime's --kv-transfer-port or vLLM's NIXL side channel
KV_PORT = 8001


def model_path(svc: ServiceSpec, source: ModelSource | None = None) -> str:
    """Where the engine finds the weights (of `source`, by default the model's): the Hub id
    (downloaded by the engine itself into the model cache), or the path the source claim is
    mounted at, or a path in the image."""
    if svc.model.node_cache and source in (None, svc.model.source):
        return NODE_CACHE_MOUNT
    source = source or svc.model.source
    if source.scheme == "hf":
        return f"hf://{source.repo}/{source.file}" if source.file else source.repo
    if source.scheme == "pvc":
        return SOURCE_MOUNT + (source.path if source.path != "/" else "")
    return source.path


def lora_path(adapter: LoraAdapter, hub_uri: bool = True) -> str:
    """Where the engine reads an adapter of spec.model.lora: under its claim's mount, its file:// path, or
    on the Hub: hf://org/repo[@revision] (Goodput's runtime), org/repo (vLLM, `hub_uri` False)."""
    source = adapter.source
    if source.scheme == "hf":
        return adapter.uri if hub_uri else source.repo
    if source.scheme == "pvc":
        return f"{LORA_MOUNT}/{adapter.name}" + (source.path if source.path != "/" else "")
    return source.path


def lora_args(svc: ServiceSpec, hub_uri: bool = True) -> list[str]:
    """spec.model.lora as the flags Goodput's runtime and vLLM share (--enable-lora, --lora-modules
    NAME=PATH..., --max-loras, --max-lora-rank, --max-cpu-loras); none without it. An hf:// adapter's
    PATH is its hf:// source, or (`hub_uri` False, vLLM) its repository id, which vLLM fetches."""
    lora = svc.model.lora
    if lora is None:
        return []
    args = [flags.ENABLE_LORA]
    if lora.adapters:
        args += [flags.LORA_MODULES, *(f"{a.name}={lora_path(a, hub_uri)}" for a in lora.adapters)]
    args += [flags.MAX_LORAS, str(lora.max_adapters), flags.MAX_LORA_RANK, str(lora.max_rank)]
    if lora.max_cpu_adapters is not None:
        args += [flags.MAX_CPU_LORAS, str(lora.max_cpu_adapters)]
    return args


def runtime_lora_updates(svc: ServiceSpec) -> bool:
    """Whether the engine serves /v1/load_lora_adapter and /v1/unload_lora_adapter (LoraAdapter resources)."""
    return svc.model.lora is not None and svc.model.lora.runtime_updates


# --- Goodput's runtime ----------------------------------------------------------------------------


def goodput_args(svc: ServiceSpec) -> list[str]:
    """The runtime's command line: each CR field under the flag the contract
    (goodput_contract.flags) names for it; unset fields leave the runtime's default."""
    m, e = svc.model, svc.engine
    args = flags.to_args(
        {
            "model.source": model_path(svc),
            "model.servedName": m.served_name,
            "model.revision": m.revision if m.source.scheme == "hf" and not m.node_cache else None,
        }
    )
    args += [flags.HOST, "0.0.0.0", flags.PORT, str(RUNTIME_PORT)]
    args += flags.to_args(
        {
            "resources.gpu": "cuda" if svc.resources.gpu else "cpu",
            "model.dtype": m.dtype,
            "model.maxModelLen": m.max_model_len,
            "engine.maxNumSeqs": e.max_num_seqs,
            "engine.maxBatchedTokens": e.max_batched_tokens,
            "engine.gpuMemoryUtilization": e.gpu_memory_utilization,
            "engine.prefixCaching": e.prefix_caching,
            "engine.maxQueue": e.max_queue,
            "slo.ttft": svc.slo.ttft_seconds,
            "slo.tpot": svc.slo.tpot_seconds,
            "parallelism.tensor": svc.tensor_parallel,
            "model.quantization": m.quantization,
        }
    )
    if e.speculative is not None:  # the draft model is fetched into the same cache, with the same token
        draft = e.speculative.draft_model
        args += flags.to_args(
            {
                "engine.speculative.method": e.speculative.method,
                "engine.speculative.tokens": e.speculative.tokens,
                "engine.speculative.draftModel": model_path(svc, draft) if draft else None,
            }
        )
    args += lora_args(svc)
    if runtime_lora_updates(svc):
        args.append(flags.ALLOW_RUNTIME_LORA_UPDATING)
    args += offload_args(svc)  # spec.engine.kvOffload (kv_offload_pod.py)
    args += [flags.SHUTDOWN_DELAY, str(SHUTDOWN_DELAY_SECONDS)]
    return args + list(e.extra_args)


# --- vLLM -----------------------------------------------------------------------------------------

# CR field -> vLLM flag (vLLM 0.32.0). Fields absent here are refused for vLLM, or set otherwise (below).
VLLM_FLAGS: dict[str, str] = {
    "model.source": "--model",
    "model.servedName": "--served-model-name",
    "model.revision": "--revision",
    "model.dtype": "--dtype",
    "model.maxModelLen": "--max-model-len",
    "model.quantization": "--quantization",  # fp8 only: online dynamic fp8 of an unquantized checkpoint
    "parallelism.tensor": "--tensor-parallel-size",
    "engine.maxNumSeqs": "--max-num-seqs",
    "engine.maxBatchedTokens": "--max-num-batched-tokens",
    "engine.gpuMemoryUtilization": "--gpu-memory-utilization",
    "engine.prefixCaching": "--enable-prefix-caching",  # false: --no-enable-prefix-caching
    "slo.ttft": "--custom-histogram-buckets",  # the SLOs become histogram boundaries (JSON, both at once)
    "slo.tpot": "--custom-histogram-buckets",
}


def _value(value: object) -> str:
    return f"{value:.12g}" if isinstance(value, float) else str(value)


def _common_args(svc: ServiceSpec, f: dict[str, str], *more: tuple[str, object]) -> list[str]:
    """The model, its served name and revision, the address, and every set field both engines map alike."""
    m, e = svc.model, svc.engine
    args = [f["model.source"], model_path(svc), f["model.servedName"], m.served_name]
    if m.source.scheme == "hf" and not m.node_cache:
        args += [f["model.revision"], m.revision]
    args += ["--host", "0.0.0.0", "--port", str(RUNTIME_PORT)]
    optional: list[tuple[str, object]] = [
        ("model.dtype", m.dtype),
        ("model.maxModelLen", m.max_model_len),
        ("engine.maxNumSeqs", e.max_num_seqs),
        ("engine.maxBatchedTokens", e.max_batched_tokens),
        ("engine.gpuMemoryUtilization", e.gpu_memory_utilization),
        *more,
        ("parallelism.tensor", svc.tensor_parallel),
        ("model.quantization", None if m.quantization == "none" else m.quantization),
    ]
    for field, value in optional:
        if value is not None:
            args += [f[field], _value(value)]
    return args


def vllm_args(svc: ServiceSpec) -> list[str]:
    e, f = svc.engine, VLLM_FLAGS
    args = _common_args(svc, f)
    if e.prefix_caching is not None:
        args.append(f["engine.prefixCaching"] if e.prefix_caching else flags.negated(f["engine.prefixCaching"]))
    ttft, tpot = svc.slo.ttft_seconds, svc.slo.tpot_seconds
    if ttft is not None or tpot is not None:
        buckets = {}
        if ttft is not None:
            buckets["time_to_first_token"] = with_boundary(VLLM_TTFT_BUCKETS, ttft)
        if tpot is not None:  # the family of both inter_token_latency and request_time_per_output_token
            buckets["inter_token_latency"] = with_boundary(VLLM_TPOT_BUCKETS, tpot)
        args += ["--custom-histogram-buckets", json.dumps(buckets, separators=(",", ":"))]
    args += lora_args(svc, hub_uri=False)  # vLLM's flags of the same names
    return args + list(e.extra_args)


def _vllm_env(svc: ServiceSpec) -> list[dict[str, str]]:
    return [
        {"name": "VLLM_NO_USAGE_STATS", "value": "1"},
        {"name": "VLLM_CACHE_ROOT", "value": f"{MODEL_CACHE_DIR}/vllm"},
        # vLLM serves its load and unload endpoints on this variable, not a flag
        *([{"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "True"}] if runtime_lora_updates(svc) else []),
    ]


# --- SGLang ---------------------------------------------------------------------------------------

SGLANG_FLAGS: dict[str, str] = {
    "model.source": "--model-path",
    "model.servedName": "--served-model-name",
    "model.revision": "--revision",
    "model.dtype": "--dtype",
    "model.maxModelLen": "--context-length",
    "model.quantization": "--quantization",  # fp8 only
    "parallelism.tensor": "--tp-size",
    "engine.maxNumSeqs": "--max-running-requests",
    "engine.maxBatchedTokens": "--chunked-prefill-size",
    "engine.gpuMemoryUtilization": "--mem-fraction-static",
    "engine.prefixCaching": "--disable-radix-cache",  # prefix caching is on by default; false adds this flag
    "engine.maxQueue": "--max-queued-requests",
    "slo.ttft": "--bucket-time-to-first-token",  # the SLO becomes a histogram boundary
    "slo.tpot": "--bucket-inter-token-latency",
}


def sglang_args(svc: ServiceSpec) -> list[str]:
    e, f = svc.engine, SGLANG_FLAGS
    args = _common_args(svc, f, ("engine.maxQueue", e.max_queue))
    port = args.index("--port") + 2
    args[port:port] = ["--enable-metrics"]
    if e.prefix_caching is False:
        args.append(f["engine.prefixCaching"])
    if svc.slo.ttft_seconds is not None:
        args += [f["slo.ttft"], *map(_value, with_boundary(SGLANG_TTFT_BUCKETS, svc.slo.ttft_seconds))]
    if svc.slo.tpot_seconds is not None:
        args += [f["slo.tpot"], *map(_value, with_boundary(SGLANG_TPOT_BUCKETS, svc.slo.tpot_seconds))]
    return args + list(e.extra_args)


def _sglang_env(svc: ServiceSpec) -> list[dict[str, str]]:
    return [{"name": "SGLANG_CACHE_DIR", "value": f"{MODEL_CACHE_DIR}/sglang"}]


# --- the KV hand-off (spec.disaggregation) ---------------------------------------------------------


def goodput_kv_args(svc: ServiceSpec, role: str) -> list[str]:
    """The runtime's role in the hand-off and its tcp transport's port (it advertises $POD_IP)."""
    return ["--kv-transfer-role", role, "--kv-transfer-port", str(KV_PORT)]


def vllm_kv_args(svc: ServiceSpec, role: str) -> list[str]:
    """vLLM's P/D with its NIXL connector: both roles run kv_both, and each request's kv_transfer_params
    say which side it is; a decode side that cannot load the blocks recomputes, as our runtime does."""
    config: dict[str, object] = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    if role == "decode":
        config["kv_load_failure_policy"] = "recompute"
    return ["--kv-transfer-config", json.dumps(config, separators=(",", ":"))]


def vllm_kv_env(svc: ServiceSpec) -> list[dict[str, str]]:
    """NIXL's handshake (side channel) on the pod's address and the kv port."""
    return [
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(KV_PORT)},
    ]
