"""A typed view of a LoraAdapter: one LoRA adapter loaded at run time on an InferenceService's replicas.

The adapter's name is the resource's own name (what requests send as "model"). Parsing raises
SpecError naming the field for what the schema cannot check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from goodput_contract.api.model_spec import _HF_ADAPTER
from goodput_contract.api.spec import ModelSource, SpecError, parse_source

ALL = "all"
_NAME = re.compile(r"^[A-Za-z0-9][-_.A-Za-z0-9]*$")
_SERVICE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
PHASES = ("Pending", "Loading", "Ready", "Failed")


@dataclass(frozen=True)
class LoraAdapterSpec:
    name: str  # the adapter's name: metadata.name
    service: str  # the InferenceService in the same namespace
    source: ModelSource  # file:///path (in the pod), pvc://claim/path (a claim the service's pods mount), hf://
    replicas: int | None = None  # None: every ready replica
    pinned: bool = False
    revision: str | None = None  # hf: hf://org/repo@revision; None: the default branch

    @property
    def hub_uri(self) -> str:
        """hf://org/repo[@revision] for an hf:// adapter (the engine fetches it, with the pod's HF_TOKEN)."""
        return f"hf://{self.source.repo}" + (f"@{self.revision}" if self.revision else "")

    def wanted(self, ready: int) -> int:
        """How many of `ready` replicas should hold the adapter."""
        return ready if self.replicas is None else min(self.replicas, ready)


def parse_lora_adapter(name: str, spec: dict[str, Any]) -> LoraAdapterSpec:
    if not _NAME.match(name) or len(name) > 253:
        raise SpecError("metadata.name", f"{name!r} is not a name of letters, digits, '-', '_' and '.'")
    service = spec.get("service")
    if not isinstance(service, str) or not _SERVICE.match(service):
        raise SpecError("service", f"{service!r} is not the name of an InferenceService")
    uri = spec.get("source")
    if not isinstance(uri, str):
        raise SpecError("source", "is required")
    revision = None
    if uri.startswith("hf://"):
        match = _HF_ADAPTER.match(uri)
        if match is None or ".." in uri:
            raise SpecError("source", f"{uri!r} is not hf://org/repo or hf://org/repo@revision")
        source, revision = ModelSource("hf", repo=match["repo"]), match["revision"]
    else:
        try:
            source = parse_source(uri)
        except SpecError:
            raise SpecError("source", f"{uri!r} is not file:///path, pvc://claim/path or hf://org/repo") from None
    raw_replicas = spec.get("replicas", ALL)
    replicas: int | None
    if raw_replicas == ALL:
        replicas = None
    elif isinstance(raw_replicas, int) and not isinstance(raw_replicas, bool) and raw_replicas >= 1:
        replicas = raw_replicas
    elif isinstance(raw_replicas, str) and raw_replicas.isdigit() and int(raw_replicas) >= 1:
        replicas = int(raw_replicas)
    else:
        raise SpecError("replicas", f"{raw_replicas!r} is neither 'all' nor a whole number of at least 1")
    pinned = spec.get("pinned", False)
    if not isinstance(pinned, bool):
        raise SpecError("pinned", f"{pinned!r} is not true or false")
    return LoraAdapterSpec(name, service, source, replicas, pinned, revision)
