"""The serving engines an InferenceService can run, one row each: Goodput's own runtime, vLLM and SGLang.

A row says everything the pod builder needs to know about an engine: its default image (from the
operator's settings, pinned by tag), its command, how each CR field becomes one of its flags, its
health and metrics endpoints, probes sized for model load, the prefix of its metric names, and what
it needs mounted. A second table, REFUSALS, names the fields an engine cannot honour. `builders.py`
builds every pod from these tables; adding an engine means adding a row (and its flag mapping) here,
and its kind to the REFUSALS rows it cannot honour.

Flags were checked against each engine's own parser: Goodput's from `goodput_contract.flags`,
vLLM 0.32.0's `vllm.entrypoints.openai.api_server --help`, SGLang's `ServerArgs`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from goodput_contract import api_keys, flags
from goodput_contract.api.spec import LoraAdapter, ModelSource, ServiceSpec, SpecError
from goodput_operator.settings import Settings

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

# The SLO is put on a bucket boundary of the engines' latency histograms, so the share of requests
# within it is read exactly rather than interpolated. The rest are each engine's own defaults.
VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
SGLANG_TTFT_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
)
SGLANG_TPOT_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)


@dataclass(frozen=True)
class Probe:
    period_seconds: int
    failure_threshold: int


@dataclass(frozen=True)
class Engine:
    kind: str
    name: str  # as messages spell it
    image: Callable[[Settings, bool], str]  # (settings, on_gpu) -> the default image
    command: tuple[str, ...]
    args: Callable[[ServiceSpec], list[str]]  # the command line from the CR (after validate passed)
    health_path: str
    metrics_path: str
    metric_prefix: str  # what its /metrics names start with
    # Loading weights (and, for vLLM and SGLang, compiling kernels) can take many minutes: the
    # startup probe allows period × failures; liveness starts only after the first success.
    startup: Probe
    readiness: Probe
    liveness: Probe
    shared_memory: bool  # /dev/shm as a memory volume, for the engine's worker processes
    pre_stop_sleep: bool  # no drain flag of its own: sleep before SIGTERM so endpoints drop the pod first
    env: Callable[[ServiceSpec], list[dict[str, str]]] = lambda svc: []
    port: int = RUNTIME_PORT
    api_key_env: str | None = None  # the variable the engine reads its API key from (spec.auth)


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


def lora_path(adapter: LoraAdapter) -> str:
    """Where the engine reads an adapter of spec.model.lora: under its claim's mount, or its file:// path."""
    source = adapter.source
    if source.scheme == "pvc":
        return f"{LORA_MOUNT}/{adapter.name}" + (source.path if source.path != "/" else "")
    return source.path


def lora_args(svc: ServiceSpec) -> list[str]:
    """spec.model.lora as the flags Goodput's runtime and vLLM share (--enable-lora, --lora-modules
    NAME=PATH..., --max-loras, --max-lora-rank, --max-cpu-loras); none without it."""
    lora = svc.model.lora
    if lora is None:
        return []
    args = [flags.ENABLE_LORA]
    if lora.adapters:
        args += [flags.LORA_MODULES, *(f"{a.name}={lora_path(a)}" for a in lora.adapters)]
    args += [flags.MAX_LORAS, str(lora.max_adapters), flags.MAX_LORA_RANK, str(lora.max_rank)]
    if lora.max_cpu_adapters is not None:
        args += [flags.MAX_CPU_LORAS, str(lora.max_cpu_adapters)]
    return args


def runtime_lora_updates(svc: ServiceSpec) -> bool:
    """Whether the engine serves /v1/load_lora_adapter and /v1/unload_lora_adapter (LoraAdapter resources)."""
    return svc.model.lora is not None and svc.model.lora.runtime_updates


def with_boundary(buckets: tuple[float, ...], *extra: float | None) -> list[float]:
    """The buckets with each SLO value added as a boundary."""
    return sorted(set(buckets) | {e for e in extra if e is not None and e > 0})


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
    args += lora_args(svc)  # vLLM's flags of the same names
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


# --- the table ------------------------------------------------------------------------------------

_LOAD = Probe(period_seconds=10, failure_threshold=180)  # up to 30 minutes to download, load and warm up
_READY = Probe(period_seconds=5, failure_threshold=3)
_LIVE = Probe(period_seconds=10, failure_threshold=6)

ENGINES: dict[str, Engine] = {
    GOODPUT: Engine(
        kind=GOODPUT,
        name="Goodput",
        image=lambda s, gpu: s.runtime_image,
        command=("python3", "-m", "goodput_runtime"),
        args=goodput_args,
        health_path="/health",
        metrics_path="/metrics",
        metric_prefix="goodput_",
        startup=_LOAD,
        readiness=_READY,
        liveness=_LIVE,
        shared_memory=False,  # only tensor-parallel workers share memory (added below)
        pre_stop_sleep=False,  # --shutdown-delay does it
        api_key_env=api_keys.RUNTIME_VARIABLE,
    ),
    VLLM: Engine(
        kind=VLLM,
        name="vLLM",
        image=lambda s, gpu: s.vllm_image if gpu else s.vllm_cpu_image,
        # the module, not the `vllm` script: the same in the official images and in a pip install
        command=("python3", "-m", "vllm.entrypoints.openai.api_server"),
        args=vllm_args,
        health_path="/health",
        metrics_path="/metrics",
        metric_prefix="vllm:",
        startup=_LOAD,
        readiness=_READY,
        liveness=_LIVE,
        shared_memory=True,  # the API server and the engine core talk through shared memory
        pre_stop_sleep=True,
        env=_vllm_env,
        api_key_env="VLLM_API_KEY",
    ),
    SGLANG: Engine(
        kind=SGLANG,
        name="SGLang",
        image=lambda s, gpu: s.sglang_image,
        command=("python3", "-m", "sglang.launch_server"),
        args=sglang_args,
        health_path="/health",
        metrics_path="/metrics",
        metric_prefix="sglang:",
        startup=_LOAD,
        readiness=_READY,
        liveness=_LIVE,
        shared_memory=True,
        pre_stop_sleep=True,
        env=_sglang_env,
    ),
}
KINDS = tuple(ENGINES)


def engine_of(svc: ServiceSpec) -> Engine:
    return ENGINES[svc.engine.kind]


# --- what an engine cannot honour -----------------------------------------------------------------


@dataclass(frozen=True)
class Refusal:
    """A field `engines` cannot honour when `asked` holds for the service; `why` is formatted with
    the engine's name as {engine} and the service as {svc}."""

    field: str
    engines: tuple[str, ...]
    asked: Callable[[ServiceSpec], bool]
    why: str


# Our runtime honours every field (the fit checks refuse what a model rules out). For each other engine
# the first row that holds is the one reported, so the order is the order fields are checked in.
REFUSALS = (
    Refusal(
        "model.quantization",
        (VLLM, SGLANG),
        lambda svc: svc.model.quantization not in ("none", "fp8"),
        "{svc.model.quantization} is Goodput's own load-time quantization; "
        "{engine} quantizes at load time only to fp8 (or serves a checkpoint quantized beforehand)",
    ),
    Refusal(
        "engine.maxQueue",
        (VLLM,),
        lambda svc: svc.engine.max_queue is not None,
        "{engine} has no bounded queue; leave it out or use engine.kind goodput or sglang",
    ),
    Refusal(
        "resources.gpu",
        (SGLANG,),
        lambda svc: not svc.resources.gpu,
        "is 0 (CPU), but {engine}'s published images serve on GPUs only",
    ),
    Refusal(
        "model.source",
        (VLLM, SGLANG),
        lambda svc: bool(svc.model.source.file),
        "names one GGUF file; {engine} needs a model directory or a Hub repository here",
    ),
    Refusal(
        "engine.speculative",
        (VLLM,),
        lambda svc: svc.engine.speculative is not None,
        "is Goodput's runtime's; for {engine} pass --speculative-config in engine.extraArgs",
    ),
    Refusal(
        "model.lora",
        (SGLANG,),
        lambda svc: svc.model.lora is not None,
        "is served by engine.kind goodput and vllm; for {engine} pass --lora-paths and its flags in engine.extraArgs",
    ),
    Refusal(
        "engine.speculative",
        (SGLANG,),
        lambda svc: svc.engine.speculative is not None,
        "is Goodput's runtime's; for {engine} pass --speculative-algorithm and its flags in engine.extraArgs",
    ),
)


def refusals(svc: ServiceSpec) -> list[tuple[str, str]]:
    """(field under spec, why) for each field the service's engine cannot honour, in the table's order."""
    engine = engine_of(svc)
    return [
        (r.field, r.why.format(engine=engine.name, svc=svc))
        for r in REFUSALS
        if engine.kind in r.engines and r.asked(svc)
    ]


def validate(svc: ServiceSpec) -> None:
    """SpecError naming the first field the service's engine cannot honour."""
    if svc.engine.kind not in ENGINES:
        raise SpecError("engine.kind", f"{svc.engine.kind!r} is not one of {', '.join(KINDS)}", reason="EngineUnknown")
    if svc.image and svc.engine.image and svc.image != svc.engine.image:
        raise SpecError(
            "engine.image",
            f"is {svc.engine.image!r} but spec.image is {svc.image!r}; set one of them",
            reason="ImageConflict",
        )
    if svc.auth.api_key_secret and engine_of(svc).api_key_env is None:
        raise SpecError(
            "auth.apiKeySecretRef",
            f"cannot be honoured by engine.kind {svc.engine.kind}: it takes "
            "its API key only on the command line, where the pod spec would show it",
            reason="EngineUnsupportedField",
        )
    for field, why in refusals(svc):
        raise SpecError(
            field, f"cannot be honoured by engine.kind {svc.engine.kind}: {why}", reason="EngineUnsupportedField"
        )


def image(svc: ServiceSpec, settings: Settings) -> str:
    return svc.engine.image or svc.image or engine_of(svc).image(settings, bool(svc.resources.gpu))
