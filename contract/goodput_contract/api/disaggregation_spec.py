"""spec.disaggregation: prefill and decode served by separate pools of replicas (off when absent).

The prefill pool computes prompts and hands their KV cache to the decode pool over a transport;
the decode pool generates. Each pool has its own replica bounds, and may have its own tensor-parallel
size where the transport maps KV heads between them. The checks here are the ones a schema cannot
make: the transport the engine has, a threshold of at least one KV block, and bounds that are ordered.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from goodput_contract.api.errors import SpecError

# The KV hand-off each engine has: Goodput's runtime moves blocks over its own tcp transport; vLLM
# over its NIXL connector (--kv-transfer-config). SGLang's disaggregation flags are not rendered.
TRANSPORTS: dict[str, tuple[str, ...]] = {"goodput": ("tcp",), "vllm": ("nixl",), "sglang": ()}
# Transports that map KV heads between different tensor-parallel sizes (one must divide the other)
HETEROGENEOUS_TENSOR = frozenset({"nixl"})
# Tokens per KV cache block when engine.extraArgs does not set --block-size: both engines' default
DEFAULT_BLOCK_SIZE = 16
DEFAULT_THRESHOLD = 512
ROLES = ("prefill", "decode")
_BLOCK_SIZE = re.compile(r"^--block-size(?:=(?P<value>\d+))?$")


@dataclass(frozen=True)
class Pool:
    """One role's replicas: between min_replicas and max_replicas, each of `tensor` GPUs (None: parallelism.tensor)."""

    min_replicas: int
    max_replicas: int
    tensor: int | None = None

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True)
class Disaggregation:
    prefill: Pool
    decode: Pool
    threshold_tokens: int = DEFAULT_THRESHOLD  # uncached prompt tokens below which a decode replica prefills itself
    transport: str = "tcp"

    def pool(self, role: str) -> Pool:
        return self.prefill if role == "prefill" else self.decode


def block_size(extra_args: tuple[str, ...]) -> int:
    """The KV block size the engine runs with: --block-size in engine.extraArgs, else the default."""
    for i, arg in enumerate(extra_args):
        if match := _BLOCK_SIZE.match(arg):
            value = match["value"] or (extra_args[i + 1] if i + 1 < len(extra_args) else "")
            if value.isdigit() and int(value) > 0:
                return int(value)
    return DEFAULT_BLOCK_SIZE


def _count(raw: dict[str, Any], key: str, where: str, default: int | None, least: int) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SpecError(f"{where}.{key}", f"is {value!r}, not a whole number of at least {least}")
    return value


def _pool(raw: Any, role: str) -> Pool:
    where = f"disaggregation.{role}"
    if not isinstance(raw, dict):
        raise SpecError(where, "is required with disaggregation: {minReplicas, maxReplicas}")
    low = _count(raw, "minReplicas", where, 1, 0)
    assert low is not None
    high = _count(raw, "maxReplicas", where, max(low, 1), 1)
    assert high is not None
    if high < low:
        raise SpecError(
            f"{where}.minReplicas", f"is {low}, above spec.{where}.maxReplicas={high}", reason="ReplicaBoundsInverted"
        )
    return Pool(low, high, _count(raw, "tensor", where, None, 1))


def parse_disaggregation(
    raw: Any,
    engine_kind: str,
    tensor: int,
    extra_args: tuple[str, ...],
    pipeline: int = 1,
    pods_per_replica: int = 1,
    gpus_per_node: int | None = None,
) -> Disaggregation | None:
    """spec.disaggregation for a service of `engine_kind` whose replicas run `tensor` GPUs (a GPU node
    offering `gpus_per_node`, where resources.gpusPerNode says so); None when absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise SpecError("disaggregation", f"is {raw!r}, not an object")
    have = TRANSPORTS.get(engine_kind, ())
    if not have:
        raise SpecError(
            "disaggregation",
            f"cannot be honoured by engine.kind {engine_kind}: its prefill/decode flags are not rendered; "
            f"use engine.kind {' or '.join(k for k, t in TRANSPORTS.items() if t)}",
            reason="EngineUnsupportedField",
        )
    transport = raw.get("transport") or have[0]
    if transport not in have:
        raise SpecError(
            "disaggregation.transport",
            f"is {transport!r}, which engine.kind {engine_kind} does not have (it has {', '.join(have)})",
            reason="TransportUnsupported",
        )
    if pipeline > 1 or pods_per_replica > 1:
        field = "parallelism.pipeline" if pipeline > 1 else "parallelism.nodes"
        raise SpecError(
            field,
            "is not served with disaggregation: the KV hand-off moves one replica's blocks from one pod",
            reason="DisaggregationShapeUnsupported",
        )
    prefill, decode = _pool(raw.get("prefill"), "prefill"), _pool(raw.get("decode"), "decode")
    p, d = prefill.tensor or tensor, decode.tensor or tensor
    if p != d and (transport not in HETEROGENEOUS_TENSOR or max(p, d) % min(p, d)):
        role = "prefill" if prefill.tensor not in (None, tensor) else "decode"
        can = (
            "maps KV heads only when one size divides the other"
            if transport in HETEROGENEOUS_TENSOR
            else "moves whole blocks of one layout, so both roles must run the same tensor-parallel size"
        )
        raise SpecError(
            f"disaggregation.{role}.tensor",
            f"is {p if role == 'prefill' else d}, the other role {d if role == 'prefill' else p}: "
            f"the {transport} transport {can}",
            reason="TensorSizeMismatch",
        )
    for role, size in (("prefill", p), ("decode", d)):
        if gpus_per_node is not None and size > gpus_per_node:
            raise SpecError(
                f"disaggregation.{role}.tensor",
                f"is {size}, more GPUs than resources.gpusPerNode ({gpus_per_node}): a role's replica is one pod",
                reason="ShapeDoesNotFit",
            )
    threshold = _count(raw, "threshold", "disaggregation", DEFAULT_THRESHOLD, 0)
    assert threshold is not None
    block = block_size(extra_args)
    if threshold < block:
        raise SpecError(
            "disaggregation.threshold",
            f"is {threshold} tokens, below one KV block ({block} tokens): a hand-off moves whole blocks",
            reason="ThresholdBelowBlock",
        )
    return Disaggregation(prefill, decode, threshold, transport)
