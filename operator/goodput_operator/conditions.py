"""Status conditions per the Kubernetes API conventions.

`type/status/reason/message/observedGeneration/lastTransitionTime`; reasons are
CamelCase; the transition time moves only when the status flips; `Ready` is derived.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"
VALID, MODEL_FITS, AVAILABLE, READY = "Valid", "ModelFits", "Available", "Ready"
ORDER = (READY, VALID, MODEL_FITS, AVAILABLE)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str = ""


def derive_ready(conditions: Iterable[Condition]) -> Condition:
    """Ready when the spec is valid and pods serve. ModelFits is an estimate: it warns, never gates."""
    by_type = {c.type: c for c in conditions}
    valid = by_type.get(VALID)
    if valid is None or valid.status != TRUE:
        return Condition(READY, FALSE, valid.reason if valid else "Unknown", "the spec is not valid")
    available = by_type.get(AVAILABLE)
    if available is None or available.status != TRUE:
        reason = available.reason if available else "Pending"
        return Condition(READY, FALSE, reason, available.message if available else "")
    return Condition(READY, TRUE, "Serving", available.message)


def merge(
    existing: list[dict[str, Any]] | None, current: Iterable[Condition], generation: int, now: str
) -> list[dict[str, Any]]:
    """The new condition list; a condition keeps its lastTransitionTime unless its status flipped."""
    previous = {c.get("type"): c for c in existing or ()}
    out = []
    for c in sorted(current, key=lambda c: ORDER.index(c.type) if c.type in ORDER else len(ORDER)):
        before = previous.get(c.type)
        flipped = before is None or before.get("status") != c.status
        out.append(
            {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "observedGeneration": generation,
                "lastTransitionTime": now if flipped or before is None else before.get("lastTransitionTime", now),
            }
        )
    return out


def find(conditions: list[dict[str, Any]] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in conditions or () if c.get("type") == type_), None)
