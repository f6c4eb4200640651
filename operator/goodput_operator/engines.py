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

from collections.abc import Callable
from dataclasses import dataclass

from goodput_contract import api_keys
from goodput_contract.api.spec import ServiceSpec, SpecError
from goodput_contract.latency_buckets import (
    SGLANG_TPOT_BUCKETS,
    SGLANG_TTFT_BUCKETS,
    VLLM_TPOT_BUCKETS,
    VLLM_TTFT_BUCKETS,
    with_boundary,
)
from goodput_operator.engine_args import (
    GOODPUT,
    KV_PORT,
    LORA_MOUNT,
    MODEL_CACHE_DIR,
    NODE_CACHE_MOUNT,
    RUNTIME_PORT,
    SGLANG,
    SGLANG_FLAGS,
    SHUTDOWN_DELAY_SECONDS,
    SOURCE_MOUNT,
    VLLM,
    VLLM_FLAGS,
    _sglang_env,
    _vllm_env,
    goodput_args,
    goodput_kv_args,
    lora_args,
    lora_path,
    model_path,
    runtime_lora_updates,
    sglang_args,
    vllm_args,
    vllm_kv_args,
    vllm_kv_env,
)
from goodput_operator.settings import Settings

__all__ = [
    "GOODPUT",
    "KV_PORT",
    "LORA_MOUNT",
    "MODEL_CACHE_DIR",
    "NODE_CACHE_MOUNT",
    "RUNTIME_PORT",
    "SGLANG",
    "SGLANG_FLAGS",
    "SGLANG_TPOT_BUCKETS",
    "SGLANG_TTFT_BUCKETS",
    "SHUTDOWN_DELAY_SECONDS",
    "SOURCE_MOUNT",
    "VLLM",
    "VLLM_FLAGS",
    "VLLM_TPOT_BUCKETS",
    "VLLM_TTFT_BUCKETS",
    "Engine",
    "Probe",
    "engine_of",
    "goodput_args",
    "image",
    "lora_args",
    "lora_path",
    "model_path",
    "refusals",
    "runtime_lora_updates",
    "sglang_args",
    "validate",
    "vllm_args",
    "with_boundary",
]


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
    # spec.disaggregation: the flags of a role (prefill, decode) in the KV hand-off, and what its
    # environment adds; None where they are not rendered (the contract refuses such an engine)
    kv_args: Callable[[ServiceSpec, str], list[str]] | None = None
    kv_env: Callable[[ServiceSpec], list[dict[str, str]]] = lambda svc: []


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
        kv_args=goodput_kv_args,
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
        kv_args=vllm_kv_args,
        kv_env=vllm_kv_env,
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
        "model.lora.adapters",
        (VLLM,),
        lambda svc: svc.model.lora is not None and any(a.revision for a in svc.model.lora.adapters),
        "names an hf:// adapter at a revision (@...); {engine} fetches an adapter's default branch only",
    ),
    Refusal(
        "model.lora",
        (GOODPUT,),
        lambda svc: svc.model.lora is not None and svc.disaggregation is not None,
        "with spec.disaggregation: the KV hand-off does not carry a request's adapter yet; "
        "serve adapters from a service without it",
    ),
    Refusal(
        "engine.speculative",
        (SGLANG,),
        lambda svc: svc.engine.speculative is not None,
        "is Goodput's runtime's; for {engine} pass --speculative-algorithm and its flags in engine.extraArgs",
    ),
    Refusal(
        "engine.kvOffload",
        (VLLM, SGLANG),
        lambda svc: svc.engine.kv_offload is not None,
        "is Goodput's runtime's KV offload tier; for {engine} pass its own offloading flags in engine.extraArgs "
        "(and size the pod for them with resources.memory)",
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
