"""spec.model: where the weights come from, how they load, and the LoRA adapters served with them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from goodput_contract.api.errors import SpecError

_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)(?:/(?P<file>[\w.-]+\.gguf))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>/.*)?$")
_FILE = re.compile(r"^file://(?P<path>/.+)$")


@dataclass(frozen=True)
class ModelSource:
    scheme: str  # "hf" | "pvc" | "file"
    repo: str = ""  # hf: the Hub repository id
    file: str = ""  # hf: one GGUF file of the repository (hf://org/name/file.gguf), else ""
    claim: str = ""  # pvc: the claim name
    path: str = ""  # pvc: the path inside the claim; file: the absolute path


@dataclass(frozen=True)
class TokenSecretRef:
    name: str
    key: str = "token"


@dataclass(frozen=True)
class LoraAdapter:
    name: str  # what requests send as "model"
    source: ModelSource  # pvc:// (mounted read-only) or file://


@dataclass(frozen=True)
class Lora:
    """spec.model.lora: LoRA adapters of the model, fixed at deploy time, and the runtime's limits."""

    adapters: tuple[LoraAdapter, ...] = ()
    max_adapters: int = 4  # slots a step can use
    max_rank: int = 16
    max_cpu_adapters: int | None = None  # adapters held in memory; None: the engine's default
    runtime_updates: bool = False  # the engine loads and unloads adapters through its API (LoraAdapter)


@dataclass(frozen=True)
class Model:
    source: ModelSource
    revision: str = "main"
    served_name: str = ""
    max_model_len: int | None = None
    dtype: str = "auto"
    quantization: str = "none"
    token_secret: TokenSecretRef | None = None
    cache_claim: str | None = None
    lora: Lora | None = None
    node_cache: str | None = None  # a ModelCache of the namespace: the pods read its copy on their node


def parse_source(uri: str) -> ModelSource:
    if match := _HF.match(uri):
        return ModelSource("hf", repo=match["repo"], file=match["file"] or "")
    if match := _PVC.match(uri):
        return ModelSource("pvc", claim=match["claim"], path=(match["path"] or "/").rstrip("/") or "/")
    if match := _FILE.match(uri):
        return ModelSource("file", path=match["path"])
    raise SpecError(
        "model.source", f"{uri!r} is not hf://org/name, hf://org/name/file.gguf, pvc://claim/path or file:///path"
    )


def _model(raw: dict[str, Any], name: str) -> Model:
    if "source" not in raw:
        raise SpecError("model.source", "is required")
    secret = raw.get("tokenSecretRef")
    return Model(
        source=parse_source(raw["source"]),
        revision=raw.get("revision") or "main",
        served_name=raw.get("servedName") or name,
        max_model_len=raw.get("maxModelLen"),
        dtype=raw.get("dtype", "auto"),
        quantization=raw.get("quantization", "none"),
        token_secret=TokenSecretRef(secret["name"], secret.get("key") or "token") if secret else None,
        cache_claim=raw.get("cacheClaimName"),
        lora=_lora(raw["lora"], raw.get("servedName") or name) if raw.get("lora") is not None else None,
        node_cache=raw.get("nodeCache"),
    )


_LORA_NAME = re.compile(r"^[A-Za-z0-9][-_.A-Za-z0-9]*$")


def _lora(raw: dict[str, Any], served_name: str) -> Lora:
    """spec.model.lora; adapter sources the runtime reads from the pod's filesystem (pvc://, file://)."""
    adapters: list[LoraAdapter] = []
    for i, entry in enumerate(raw.get("adapters") or []):
        where = f"model.lora.adapters[{i}]"
        name = entry.get("name")
        if not isinstance(name, str) or not _LORA_NAME.match(name) or len(name) > 253:
            raise SpecError(f"{where}.name", f"{name!r} is not a name of letters, digits, '-', '_' and '.'")
        if name == served_name:
            raise SpecError(f"{where}.name", f"{name!r} is the model's own served name")
        if any(a.name == name for a in adapters):
            raise SpecError(f"{where}.name", f"{name!r} names another adapter too")
        uri = entry.get("source")
        if not isinstance(uri, str):
            raise SpecError(f"{where}.source", "is required")
        try:
            source = parse_source(uri)
        except SpecError:
            raise SpecError(f"{where}.source", f"{uri!r} is not pvc://claim/path or file:///path") from None
        if source.scheme == "hf" or source.file:
            raise SpecError(
                f"{where}.source",
                f"{uri!r}: the runtime reads adapters from the pod's filesystem; give pvc://claim/path or file:///path",
            )
        adapters.append(LoraAdapter(name, source))
    max_adapters = raw.get("maxAdapters", 4)
    max_rank = raw.get("maxRank", 16)
    max_cpu = raw.get("maxCpuAdapters")
    for field_name, value in (("maxAdapters", max_adapters), ("maxRank", max_rank), ("maxCpuAdapters", max_cpu)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise SpecError(f"model.lora.{field_name}", f"{value!r} is not a whole number of at least 1")
    if max_cpu is not None and max_cpu < max_adapters:
        raise SpecError("model.lora.maxCpuAdapters", f"{max_cpu} is below maxAdapters ({max_adapters})")
    runtime_updates = raw.get("runtimeUpdates", False)
    if not isinstance(runtime_updates, bool):
        raise SpecError("model.lora.runtimeUpdates", f"{runtime_updates!r} is not true or false")
    return Lora(tuple(adapters), max_adapters, max_rank, max_cpu, runtime_updates)
