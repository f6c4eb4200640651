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
RECONCILING, STALLED = "Reconciling", "Stalled"  # kstatus's (what Flux's wait and health checks read)
ORDER = (READY, VALID, MODEL_FITS, AVAILABLE, RECONCILING, STALLED)
# reasons of Available=False that a wait does not end: they need a change to the spec, the image or
# the node (pods.py's failures, a missed rollout deadline, a child owned by something else)
STALLING = frozenset(
    {"RuntimeFailing", "ImagePullFailed", "ContainerConfigError", "ProgressDeadlineExceeded", "ChildConflict"}
)


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


def derive_kstatus(conditions: Iterable[Condition], replicas: int, ready: int, desired: int) -> list[Condition]:
    """kstatus's two abnormal-true conditions, from the others and the runtime's pods: `Stalled` while
    the service cannot get where its spec asks without a change (an invalid spec, a failure in
    STALLING), else `Reconciling` while it is on its way (pods starting, rolling, or scaling: fewer
    ready than desired, or more pods than desired). A suspended or scaled-to-zero service with no
    pod left is neither: it is where its spec asks."""
    by_type = {c.type: c for c in conditions}
    valid, available = by_type.get(VALID), by_type.get(AVAILABLE)
    stalled = None
    if valid is not None and valid.status == FALSE:
        stalled = valid
    elif available is not None and available.status == FALSE and available.reason in STALLING:
        stalled = available
    if stalled is not None:
        return [
            Condition(RECONCILING, FALSE, "Stalled", "waiting for a change to the spec or its surroundings"),
            Condition(STALLED, TRUE, stalled.reason, stalled.message),
        ]
    moving = ready < desired or replicas > desired
    reconciling = (
        Condition(RECONCILING, TRUE, "Progressing", f"{ready}/{desired} replicas ready, {replicas} running")
        if moving
        else Condition(RECONCILING, FALSE, "Reconciled", f"{ready}/{desired} replicas ready")
    )
    return [reconciling, Condition(STALLED, FALSE, "NotStalled", "nothing stands in its way")]


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
