"""What a LoraAdapter asks of its InferenceService, decided without the cluster: the path the service's
pods read the adapter from (SpecError naming the field when they cannot), and which ready replicas
keep, load and unload it."""

from __future__ import annotations

from dataclasses import dataclass

from goodput_contract.api.lora_adapter_spec import LoraAdapterSpec
from goodput_contract.api.spec import ServiceSpec, SpecError
from goodput_operator.engines import LORA_MOUNT, SOURCE_MOUNT, VLLM, runtime_lora_updates


@dataclass(frozen=True)
class Replica:
    name: str  # the pod's name (the endpoint's targetRef), else address:port
    url: str  # http://host:port


def resolve_path(adapter: LoraAdapterSpec, svc: ServiceSpec) -> str:
    """Where the service's pods read the adapter; SpecError when they cannot."""
    source = adapter.source
    if source.scheme == "file":
        return source.path
    if source.scheme == "hf":  # fetched by the engine with the pod's HF_TOKEN: vLLM takes the repository id
        return adapter.hub_uri if svc.engine.kind != VLLM else source.repo
    inner = source.path if source.path != "/" else ""
    for mounted in svc.model.lora.adapters if svc.model.lora else ():
        if mounted.source.scheme == "pvc" and mounted.source.claim == source.claim:
            # the claim is mounted at LORA_MOUNT/<that adapter's name>, its path relative to the claim's root
            return f"{LORA_MOUNT}/{mounted.name}{inner}"
    if svc.model.source.scheme == "pvc" and svc.model.source.claim == source.claim:
        return SOURCE_MOUNT + inner
    raise SpecError(
        "source",
        f"claim {source.claim!r} is not mounted in InferenceService {svc.name!r}'s pods (mount it through "
        "its spec.model.lora.adapters or spec.model.source, or give file:///path)",
        reason="ClaimNotMounted",
    )


def check_service(adapter: LoraAdapterSpec, svc: ServiceSpec) -> str:
    """The path the pods read, after the checks that need the service; SpecError naming the field."""
    if not runtime_lora_updates(svc):
        raise SpecError(
            "service",
            f"InferenceService {svc.name!r} does not load adapters at run time: set its "
            "spec.model.lora.runtimeUpdates to true",
            reason="RuntimeUpdatesOff",
        )
    if adapter.name == svc.model.served_name:
        raise SpecError("metadata.name", f"{adapter.name!r} is the served name of InferenceService {svc.name!r}")
    if svc.model.lora and any(a.name == adapter.name for a in svc.model.lora.adapters):
        raise SpecError(
            "metadata.name", f"{adapter.name!r} is an adapter of InferenceService {svc.name!r}'s spec.model.lora"
        )
    if adapter.pinned and svc.engine.kind == VLLM:
        raise SpecError("pinned", "vLLM does not pin adapters; leave pinned false for engine.kind vllm")
    if adapter.revision and svc.engine.kind == VLLM:
        raise SpecError("source", "vLLM fetches an adapter's default branch only; leave out @revision for vllm")
    return resolve_path(adapter, svc)


def plan(
    adapter: LoraAdapterSpec, replicas: list[Replica], holding: set[str]
) -> tuple[list[Replica], list[Replica], list[Replica]]:
    """(keep, load, unload) among the replicas that answered: those holding the adapter stay while
    `replicas` allows; the rest needed come first in name order."""
    ordered = sorted(replicas, key=lambda r: r.name)
    wanted = adapter.wanted(len(ordered))
    held = [r for r in ordered if r.name in holding]
    keep, unload = held[:wanted], held[wanted:]
    load = [r for r in ordered if r.name not in holding][: max(0, wanted - len(keep))]
    return keep, load, unload
