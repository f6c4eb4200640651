"""spec.model: where the weights come from, how they load, and the LoRA adapters served with them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from goodput_contract.api import names
from goodput_contract.api.errors import SpecError

_HF = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)(?:/(?P<file>[\w.-]+\.gguf))?$")
_PVC = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>/.*)?$")
_FILE = re.compile(r"^file://(?P<path>/.+)$")
# an adapter on the Hub, as the runtime's --lora-modules reads it: hf://ORG/REPO or hf://ORG/REPO@REVISION
_HF_ADAPTER = re.compile(
    r"^hf://(?P<repo>[A-Za-z0-9][-_.A-Za-z0-9]*/[A-Za-z0-9][-_.A-Za-z0-9]*)(?:@(?P<revision>[-_./A-Za-z0-9]+))?$"
)


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
    source: ModelSource  # pvc:// (mounted read-only), file://, or hf:// (fetched by the engine)
    revision: str | None = None  # hf: a branch, tag or commit (hf://org/repo@revision); None: the default branch
    token_secret: TokenSecretRef | None = None  # hf: the Secret key holding a Hub token (HF_TOKEN in the pod)

    @property
    def uri(self) -> str:
        """hf://org/repo[@revision] for an hf:// adapter."""
        return f"hf://{self.source.repo}" + (f"@{self.revision}" if self.revision else "")


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
        lora=_lora(raw["lora"], raw.get("servedName") or name, secret) if raw.get("lora") is not None else None,
        node_cache=raw.get("nodeCache"),
    )


_LORA_NAME = re.compile(r"^[A-Za-z0-9][-_.A-Za-z0-9]*$")


def _lora(raw: dict[str, Any], served_name: str, model_secret: dict[str, Any] | None = None) -> Lora:
    """spec.model.lora; adapter sources the runtime reads from the pod's filesystem (pvc://, file://) or
    fetches from the Hub (hf://org/repo[@revision]), with the one Hub token the pod has (HF_TOKEN)."""
    adapters: list[LoraAdapter] = []
    model_ref = _token_ref(model_secret) if model_secret else None
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
        adapters.append(_adapter(where, name, uri, entry.get("tokenSecretRef"), model_ref, adapters))
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


def _token_ref(raw: Any, where: str = "model.tokenSecretRef") -> TokenSecretRef:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not raw["name"]:
        raise SpecError(where, f"{raw!r} is not a Secret key reference {{name, key}}")
    key = raw.get("key") or "token"
    if not isinstance(key, str):
        raise SpecError(f"{where}.key", f"{key!r} is not a key name")
    if problem := names.secret_key(key):
        raise SpecError(f"{where}.key", problem)
    if problem := names.dns_subdomain(raw["name"]):
        raise SpecError(f"{where}.name", problem, reason="InvalidName")
    return TokenSecretRef(raw["name"], key)


def _adapter(
    where: str,
    name: str,
    uri: str,
    raw_secret: Any,
    model_ref: TokenSecretRef | None,
    before: list[LoraAdapter],
) -> LoraAdapter:
    """One entry of spec.model.lora.adapters (its name checked): its source and Hub token."""
    if uri.startswith("hf://"):
        match = _HF_ADAPTER.match(uri)
        if match is None or ".." in uri:
            raise SpecError(f"{where}.source", f"{uri!r} is not hf://org/repo or hf://org/repo@revision")
        ref = _token_ref(raw_secret, f"{where}.tokenSecretRef") if raw_secret is not None else None
        # the runtime (and vLLM) fetch every hf:// source with the pod's one HF_TOKEN
        others = [("model.tokenSecretRef", model_ref)] if model_ref else []
        others += [(f"the adapter {a.name!r}", a.token_secret) for a in before if a.token_secret]
        for whose, other in others:
            if ref is not None and other != ref:
                raise SpecError(
                    f"{where}.tokenSecretRef",
                    f"{ref.name}/{ref.key} differs from {whose}'s ({other.name}/{other.key}): "
                    "the engine fetches every hf:// source with one token",
                )
        return LoraAdapter(name, ModelSource("hf", repo=match["repo"]), match["revision"], ref)
    if raw_secret is not None:
        raise SpecError(f"{where}.tokenSecretRef", f"only an hf:// source is fetched with a token; {uri!r} is read")
    try:
        source = parse_source(uri)
    except SpecError:
        raise SpecError(
            f"{where}.source", f"{uri!r} is not pvc://claim/path, file:///path or hf://org/repo[@revision]"
        ) from None
    return LoraAdapter(name, source)


def lora_token(lora: Lora | None) -> TokenSecretRef | None:
    """The Hub token spec.model.lora's hf:// adapters name (one at most: _adapter refuses two)."""
    return next((a.token_secret for a in lora.adapters if a.token_secret), None) if lora else None
