"""A LoraAdapter pass's outcome and the status it writes: phase, the replicas holding the adapter, lastError,
the Valid and Ready conditions, the generation loaded."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from goodput_contract.api import GROUP, LORA_PLURAL, VERSION
from goodput_contract.api.spec import SpecError
from goodput_operator import conditions
from goodput_operator.conditions import FALSE, READY, VALID, Condition
from goodput_operator.context import Context
from goodput_operator.k8s import now_timestamp

logger = logging.getLogger("goodput_operator.lora_adapters")


def adapter_path(namespace: str, name: str | None = None) -> str:
    base = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{LORA_PLURAL}"
    return f"{base}/{name}" if name else base


@dataclass
class Outcome:
    phase: str
    replicas: list[str]
    wanted: int
    error: str = ""
    valid: Condition | None = None
    ready: Condition | None = None
    loaded_generation: int | None = None


def refused(err: SpecError) -> Outcome:
    return Outcome(
        "Failed",
        [],
        0,
        str(err),
        Condition(VALID, FALSE, err.reason, str(err)),
        Condition(READY, FALSE, err.reason, "the spec is not valid"),
    )


def status_body(body: dict[str, Any], outcome: Outcome) -> dict[str, Any]:
    meta, status = body["metadata"], body.get("status") or {}
    generation = int(meta.get("generation") or 0)
    current = [c for c in (outcome.valid, outcome.ready) if c is not None]
    new: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": outcome.phase,
        "replicas": outcome.replicas,
        "replicaCount": f"{len(outcome.replicas)}/{outcome.wanted}",
        "lastError": outcome.error or None,
        "conditions": conditions.merge(status.get("conditions"), current, generation, now_timestamp()),
    }
    if outcome.loaded_generation is not None:
        new["loadedGeneration"] = outcome.loaded_generation
    return new


async def write_status(ctx: Context, body: dict[str, Any], outcome: Outcome) -> None:
    meta, status = body["metadata"], body.get("status") or {}
    new = status_body(body, outcome)
    if all(status.get(k) == v for k, v in new.items()):
        return
    answer = await ctx.kube.request(
        "PATCH",
        adapter_path(meta["namespace"], meta["name"]) + "/status",
        body={"status": new},
        content_type="application/merge-patch+json",
    )
    body["status"] = (answer or {}).get("status") or new
    if status.get("phase") != outcome.phase:
        logger.info(
            "LoraAdapter %s/%s: %s (%s)", meta["namespace"], meta["name"], outcome.phase, outcome.error or "no error"
        )
