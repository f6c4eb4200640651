"""The dashboard's building blocks: selectors, queries, a time-series panel, a template variable."""

from __future__ import annotations

from typing import Any

UID = "goodput-autoscaling"
RUNTIME = 'namespace=~"$namespace", model=~"$model"'
OPERATOR = 'namespace=~"$namespace", name=~"$service"'
GATEWAY = 'namespace=~"$namespace", service=~"$service"'
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


def q(expr: str, legend: str) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend, "datasource": DS, "range": True}


def quantiles(recorded: str, slo_gauge: str) -> list[dict[str, Any]]:
    """p50/p90/p99 of a recorded bucket rate, which every engine's histogram feeds (prometheus-rule.yaml)."""
    targets = [
        q(f"histogram_quantile({p}, sum by (le) ({recorded}{{{RUNTIME}}}))", f"p{p * 100:g}") for p in (0.5, 0.9, 0.99)
    ]
    return [*targets, q(f"max({slo_gauge}{{{RUNTIME}}})", "SLO target")]


def panel(
    title: str,
    targets: list[dict[str, Any]],
    unit: str,
    x: int,
    y: int,
    w: int = 12,
    step: bool = False,
    threshold: float | None = None,
    description: str = "",
) -> dict[str, Any]:
    custom: dict[str, Any] = {"lineWidth": 2, "fillOpacity": 0, "showPoints": "never"}
    if step:
        custom["lineInterpolation"] = "stepAfter"
    thresholds: dict[str, Any] = {"mode": "absolute", "steps": [{"color": "green", "value": None}]}
    if threshold is not None:
        custom["thresholdsStyle"] = {"mode": "line+area"}
        thresholds["steps"] = [{"color": "red", "value": None}, {"color": "transparent", "value": threshold}]
    refs = "ABCDEFGH"
    return {
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom, "thresholds": thresholds}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [{**t, "refId": refs[i]} for i, t in enumerate(targets)],
    }


def variable(name: str, query: str, label: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": name},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {},
        "sort": 1,
    }
