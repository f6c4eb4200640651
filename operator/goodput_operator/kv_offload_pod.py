"""spec.engine.kvOffload in the pod: the runtime's flags, the volume the tier's file lives in, the
resources that volume takes, and the tier's place in the capacity plan.

The runtime keeps the tier in one file of fixed-size slots, at most --kv-offload-bytes long
(engine/kv_offload.py), under --kv-offload-dir. That directory is an emptyDir sized to the tier:
- medium memory: a memory-backed emptyDir. Its pages count against the container's memory, so the
  memory request (and the limit, where resources.memory sets one) grows by the tier's bytes, and the
  scheduler places the pod where that much host memory is free.
- medium disk: an emptyDir on the node's local disk; the pod's ephemeral-storage request grows by
  the tier's bytes, so the pod lands on a node with that much room.
"""

from __future__ import annotations

from typing import Any

from goodput_contract import flags
from goodput_contract.api.disaggregation_spec import block_size
from goodput_contract.api.quantity import quantity_bytes
from goodput_contract.api.spec import ServiceSpec, SpecError

OFFLOAD_DIR = "/var/cache/goodput-kv-offload"
VOLUME = "kv-offload"
# Each slot of the runtime's file: the block's digest, the payload's CRC-32 and length (engine/kv_offload.py)
SLOT_HEADER_BYTES = 16 + 4 + 8


def offload_args(svc: ServiceSpec) -> list[str]:
    """The runtime's flags for the tier; none without one."""
    offload = svc.engine.kv_offload
    if offload is None:
        return []
    return [flags.KV_OFFLOAD_BYTES, str(offload.bytes), flags.KV_OFFLOAD_DIR, OFFLOAD_DIR]


def add_volume(svc: ServiceSpec, volumes: list[dict[str, Any]], mounts: list[dict[str, Any]]) -> None:
    """The tier's emptyDir, of its medium, no larger than the tier."""
    offload = svc.engine.kv_offload
    if offload is None:
        return
    empty_dir: dict[str, Any] = {"sizeLimit": str(offload.bytes)}
    if offload.in_memory:
        empty_dir["medium"] = "Memory"
    volumes.append({"name": VOLUME, "emptyDir": empty_dir})
    mounts.append({"name": VOLUME, "mountPath": OFFLOAD_DIR})


def add_resources(svc: ServiceSpec, requests: dict[str, Any], limits: dict[str, Any]) -> None:
    """The tier's bytes on top of the runtime's own: host memory for medium memory, local disk for disk."""
    offload = svc.engine.kv_offload
    if offload is None:
        return
    if not offload.in_memory:
        requests["ephemeral-storage"] = str(offload.bytes)
        return
    for amounts in (requests, limits) if "memory" in limits else (requests,):
        amounts["memory"] = str(quantity_bytes(amounts.get("memory") or 0) + offload.bytes)


def entry_bytes(kv_bytes_per_token: int, svc: ServiceSpec) -> int:
    """Bytes one block takes in the tier's file: every layer's keys and values of its tokens, and a header."""
    return kv_bytes_per_token * block_size(svc.engine.extra_args) + SLOT_HEADER_BYTES


def plan_status(svc: ServiceSpec, kv_bytes_per_token: int) -> dict[str, Any]:
    """status.capacity's view of the tier: its bytes and the prompt tokens it holds (whole blocks of them).
    SpecError naming engine.kvOffload.bytes when it holds no block of this model."""
    offload = svc.engine.kv_offload
    if offload is None:
        return {}
    slot = entry_bytes(kv_bytes_per_token, svc)
    blocks = offload.bytes // slot
    if blocks < 1:
        raise SpecError(
            "engine.kvOffload.bytes",
            f"is {offload.bytes} bytes, less than one KV block of this model ({slot} bytes)",
            reason="TooSmall",
        )
    return {"kvOffloadBytes": offload.bytes, "kvOffloadTokens": blocks * block_size(svc.engine.extra_args)}
