"""spec.slo, spec.autoscaling and spec.batch: the latency objective and who sizes the replicas to it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from goodput_contract.api.errors import SpecError

_DURATION = re.compile(r"^(?P<value>[0-9]+(?:\.[0-9]+)?)(?P<unit>ms|s|m)$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0}


@dataclass(frozen=True)
class Slo:
    ttft_seconds: float | None = None
    tpot_seconds: float | None = None
    attainment: float = 0.95


@dataclass(frozen=True)
class Autoscaling:
    mode: str = "none"
    min_replicas: int = 1
    max_replicas: int = 1
    scale_up_window_seconds: float = 0.0
    scale_down_window_seconds: float = 300.0
    prometheus_address: str | None = None  # keda: where its trigger queries
    # goodput law (all deciding modes)
    capacity_per_replica: float | None = None  # requests/s one replica serves within the SLO, a starting point
    target_utilization: float = 0.8  # share of that capacity to plan for
    idle_period_seconds: float | None = None  # with minReplicas 0: no requests this long removes the last one


@dataclass(frozen=True)
class Batch:
    max_replicas: int = 0  # replicas kept while batch lines are pending (0: batch work adds none)


def parse_duration(value: str, field_path: str) -> float:
    """'500ms', '0.5s' or '1m' in seconds."""
    match = _DURATION.match(str(value))
    if not match:
        raise SpecError(field_path, f"{value!r} is not a duration like 500ms, 2s or 1m")
    return float(match["value"]) * _UNIT_SECONDS[match["unit"]]


def _slo(raw: dict[str, Any]) -> Slo:
    ttft = parse_duration(raw["ttft"], "slo.ttft") if "ttft" in raw else None
    tpot = parse_duration(raw["tpot"], "slo.tpot") if "tpot" in raw else None
    for path, seconds in (("slo.ttft", ttft), ("slo.tpot", tpot)):
        if seconds is not None and seconds <= 0:
            raise SpecError(path, "must be longer than zero")
    return Slo(ttft_seconds=ttft, tpot_seconds=tpot, attainment=float(raw.get("attainment", 0.95)))


def _autoscaling(raw: dict[str, Any]) -> Autoscaling:
    mode = raw.get("mode", "none")
    capacity, idle = raw.get("capacityPerReplica"), raw.get("idlePeriod")
    low = int(raw.get("minReplicas", 1))
    high = int(raw.get("maxReplicas", max(low, 1)))
    if high < low:
        raise SpecError(
            "autoscaling.maxReplicas",
            f"is {high}, below autoscaling.minReplicas={low}",
            reason="ReplicaBoundsInverted",
        )
    if mode == "hpa" and low < 1:
        raise SpecError(
            "autoscaling.minReplicas",
            "must be at least 1 in hpa mode (use keda to scale to zero)",
            reason="HPACannotScaleToZero",
        )
    if mode == "keda" and not raw.get("prometheusAddress"):
        raise SpecError("autoscaling.prometheusAddress", "is required in keda mode", reason="PrometheusAddressMissing")
    return Autoscaling(
        mode=mode,
        min_replicas=low,
        max_replicas=high,
        scale_up_window_seconds=parse_duration(raw.get("scaleUpWindow", "0s"), "autoscaling.scaleUpWindow"),
        scale_down_window_seconds=parse_duration(raw.get("scaleDownWindow", "5m"), "autoscaling.scaleDownWindow"),
        prometheus_address=raw.get("prometheusAddress"),
        capacity_per_replica=float(capacity) if capacity is not None else None,
        target_utilization=float(raw.get("targetUtilization", 0.8)),
        idle_period_seconds=parse_duration(idle, "autoscaling.idlePeriod") if idle else None,
    )


def _batch(raw: dict[str, Any], autoscaling: Autoscaling) -> Batch:
    value = raw.get("maxReplicas", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SpecError("batch.maxReplicas", f"is {value!r}, not a whole number of replicas")
    if value and autoscaling.mode == "none":
        raise SpecError(
            "batch.maxReplicas",
            "needs an autoscaling.mode that decides replicas (goodput, hpa or keda)",
            reason="BatchReplicasWithoutAutoscaling",
        )
    if value > autoscaling.max_replicas:
        raise SpecError(
            "batch.maxReplicas",
            f"is {value}, above autoscaling.maxReplicas={autoscaling.max_replicas}",
            reason="BatchReplicasAboveMax",
        )
    return Batch(max_replicas=value)
