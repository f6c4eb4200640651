"""spec.engine.kvOffload: a second KV cache tier behind each replica (off when absent).

Prefix blocks evicted from the KV cache are kept in the tier, up to `bytes`, and loaded back on a
prefix hit instead of being recomputed (the runtime's --kv-offload-bytes; docs/kv-cache.md). The
tier is one file in a volume the operator adds to the pod: `memory` puts it in host memory (a
memory-backed emptyDir, which the pod's memory request and limit grow by), `disk` on the node's
local disk (an emptyDir the pod's ephemeral-storage request grows by).

The checks here are the ones a schema cannot make: a size in whole bytes of at least MIN_BYTES, a
medium that fits the replica, and a replica shape and cache the runtime's tier runs with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goodput_contract.api.errors import SpecError
from goodput_contract.api.quantity import parse_quantity

MEDIA = ("memory", "disk")
MIN_BYTES = 1 << 20  # 1Mi: below it the tier holds few blocks of any model
MAX_BYTES = 1 << 50  # 1Pi: beyond any node's memory or local disk
FIELD = "engine.kvOffload"


@dataclass(frozen=True)
class KvOffload:
    bytes: int  # the tier's bound
    medium: str  # memory | disk: where its file lives

    @property
    def in_memory(self) -> bool:
        return self.medium == "memory"


def parse_kv_offload(raw: dict[str, Any], gpu: int, ranks: int, prefix_caching: bool | None) -> KvOffload:
    """The tier of a replica of `gpu` GPUs running `ranks` processes, or SpecError naming the field."""
    value = raw.get("bytes")
    if value is None:
        raise SpecError(f"{FIELD}.bytes", "is required: the tier's size, such as 8Gi")
    try:
        amount = parse_quantity(value)
    except ValueError:
        raise SpecError(f"{FIELD}.bytes", f"{value!r} is not a Kubernetes quantity") from None
    if amount != int(amount):
        raise SpecError(f"{FIELD}.bytes", f"{value!r} is not a whole number of bytes")
    if amount < MIN_BYTES:
        raise SpecError(f"{FIELD}.bytes", f"{value!r} is below the least tier of 1Mi", reason="TooSmall")
    if amount > MAX_BYTES:
        raise SpecError(f"{FIELD}.bytes", f"{value!r} is above 1Pi, more than any node holds", reason="TooLarge")
    medium = raw.get("medium") or ("memory" if gpu else "disk")
    if medium not in MEDIA:
        raise SpecError(f"{FIELD}.medium", f"{medium!r} is not one of {', '.join(MEDIA)}")
    if medium == "memory" and not gpu:
        raise SpecError(
            f"{FIELD}.medium",
            "is memory, but a CPU replica's KV cache already lives in host memory: use disk, or give the "
            "cache more memory (resources.memory)",
            reason="OffloadMediumUnsupported",
        )
    if ranks > 1:
        raise SpecError(
            FIELD,
            f"runs on one rank per replica; this replica runs {ranks} (parallelism.tensor × parallelism.pipeline)",
            reason="OffloadUnsupported",
        )
    if prefix_caching is False:
        raise SpecError(
            FIELD, "keeps prefix blocks, so it needs engine.prefixCaching (it is false)", reason="OffloadUnsupported"
        )
    return KvOffload(bytes=int(amount), medium=medium)
