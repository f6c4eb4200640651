"""Renders the Grafana autoscaling dashboard and the two objects that ship it.

    python manifests/monitoring/render.py

writes goodput-autoscaling.json (import it by hand), dashboard-configmap.yaml (a ConfigMap
labelled grafana_dashboard: "1" for kube-prometheus-stack's sidecar) and
grafana-dashboard.yaml (a GrafanaDashboard for grafana-operator v5). A test checks the
committed files match this script.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
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


def gateway_panels(y: int) -> list[dict[str, Any]]:
    """The goodput-gateway's view: how it routes, what it holds for services at zero, how long clients wait."""
    hold = "goodput_gateway_hold_duration_seconds"
    return [
        panel(
            "Gateway routing decisions",
            [
                q(
                    f"sum by (decision) (rate(goodput_gateway_routing_decisions_total{{{GATEWAY}}}[{RATE}]))",
                    "{{decision}}",
                ),
            ],
            "reqps",
            0,
            y,
            w=8,
            description="affinity: the prompt prefix's own replica; overflow: it was over the load bound; "
            "retry: a replica failed before answering.",
        ),
        panel(
            "Gateway held requests",
            [
                q(f"sum by (service) (goodput_gateway_requests_waiting{{{GATEWAY}}})", "held: {{service}}"),
                q(
                    f'sum by (code) (rate(goodput_gateway_requests_total{{{GATEWAY}, code=~"429|503"}}[{RATE}]))',
                    "refused {{code}}/s",
                ),
            ],
            "short",
            8,
            y,
            w=8,
            description="Requests waiting for a ready replica (a service at zero waking, or between pods).",
        ),
        panel(
            "Gateway cold start (time held)",
            [
                q(f"histogram_quantile({p}, sum by (le) (rate({hold}_bucket{{{GATEWAY}}}[{RATE}])))", f"p{p * 100:g}")
                for p in (0.5, 0.9)
            ],
            "s",
            16,
            y,
            w=8,
            description="How long held requests waited for the first ready replica.",
        ),
    ]


def batch_panels(y: int) -> list[dict[str, Any]]:
    """The batch API: lines waiting and done (every gateway together), how much batch work each service
    is given, and the replicas' online vs batch requests (batch work yields to online)."""
    return [
        panel(
            "Batch lines",
            [
                q("max(goodput_batch_lines_pending)", "pending"),
                q(f"sum by (state) (rate(goodput_batch_requests_total[{RATE}]))", "{{state}}/s"),
            ],
            "short",
            0,
            y,
            w=8,
            description="Lines of running batches not yet done, and lines finished per second.",
        ),
        panel(
            "Batch concurrency (AIMD)",
            [
                q('sum by (service) (goodput_batch_concurrency_limit{service=~"$service"})', "{{service}}"),
            ],
            "short",
            8,
            y,
            w=8,
            step=True,
            description="Lines a service may have in flight: +1 a second while its online requests meet the SLO "
            "and none waits, halved otherwise.",
        ),
        panel(
            "Online vs batch requests",
            [
                q(
                    "sum by (priority) "
                    f'(rate(goodput_requests_by_priority_total{{{RUNTIME}, outcome="success"}}[{RATE}]))',
                    "{{priority}} req/s",
                ),
                q(f"sum by (priority) (goodput_requests_waiting_by_priority{{{RUNTIME}}})", "{{priority}} waiting"),
            ],
            "short",
            16,
            y,
            w=8,
            description="The replicas' finished requests and queue by priority class.",
        ),
    ]


def pipeline_panels(y: int) -> list[dict[str, Any]]:
    """InferencePipelines at the gateway: outcomes, end-to-end goodput, what each step costs, what guards block."""
    sel = 'namespace=~"$namespace", pipeline=~"$pipeline"'
    step = "goodput_pipeline_step_duration_seconds_bucket"
    return [
        panel(
            "Pipeline requests and goodput",
            [
                q(f"sum by (outcome) (rate(goodput_pipeline_requests_total{{{sel}}}[{RATE}]))", "{{outcome}}"),
                q(
                    f"sum(rate(goodput_pipeline_requests_good_total{{{sel}}}[{RATE}]))",
                    "goodput (met the SLO end to end)",
                ),
            ],
            "reqps",
            0,
            y,
            w=8,
            description="served, refused (an input guard), filtered (an output guard ended the stream), error; "
            "goodput counts guards' time against the generate service's TTFT target.",
        ),
        panel(
            "Pipeline step latency (p90)",
            [
                q(
                    f"histogram_quantile(0.9, sum by (le, step, kind) (rate({step}{{{sel}}}[{RATE}])))",
                    "{{step}} ({{kind}})",
                ),
                q(
                    f"histogram_quantile(0.9, sum by (le) (rate(goodput_pipeline_time_to_first_token_seconds_bucket"
                    f"{{{sel}}}[{RATE}])))",
                    "end-to-end TTFT",
                ),
            ],
            "s",
            8,
            y,
            w=8,
            description="Rules take microseconds; a classifier one short forward pass; generate is its TTFT.",
        ),
        panel(
            "Guard blocks by rule",
            [
                q(f"sum by (rule) (rate(goodput_guard_blocks_total{{{sel}}}[{RATE}]))", "blocked: {{rule}}"),
                q(f"sum by (rule) (rate(goodput_guard_redactions_total{{{sel}}}[{RATE}]))", "redacted: {{rule}}"),
            ],
            "reqps",
            16,
            y,
            w=8,
        ),
    ]


def dashboard() -> dict[str, Any]:
    # the recording rules read our runtime's, vLLM's and SGLang's series alike: every engine shows here
    good = f"sum(goodput:goodput:rate1m{{{RUNTIME}}})"
    total = f"sum(goodput:requests:rate1m{{{RUNTIME}}})"
    panels = [
        panel(
            "SLO attainment vs target",
            [
                q(f"{good} / {total}", "attainment"),
                q(f"goodput:slo_attainment:ratio_rate5m{{{RUNTIME}}}", "attainment 5m (recorded)"),
                q(f"goodput_autoscaler_slo_attainment_ratio{{{OPERATOR}}}", "autoscaler's window: {{name}}"),
            ],
            "percentunit",
            0,
            0,
            threshold=0.95,
            description="Share of requests that met both TTFT and TPOT targets; red below the 0.95 target.",
        ),
        panel(
            "Goodput vs throughput",
            [
                q(good, "goodput (good requests/s)"),
                q(total, "throughput (requests/s)"),
                q(f"goodput:goodput:rate5m{{{RUNTIME}}}", "goodput 5m (recorded)"),
            ],
            "reqps",
            12,
            0,
        ),
        panel(
            "Time to first token",
            quantiles("goodput:ttft_seconds_bucket:rate1m", "goodput_slo_ttft_seconds"),
            "s",
            0,
            8,
            description="p50/p90/p99 against the service's TTFT target.",
        ),
        panel(
            "Time per output token",
            quantiles("goodput:tpot_seconds_bucket:rate1m", "goodput_slo_tpot_seconds"),
            "s",
            12,
            8,
            description="p50/p90/p99 against the service's TPOT target.",
        ),
        panel(
            "Replicas: desired vs ready",
            [
                q(f"goodput_autoscaler_desired_replicas{{{OPERATOR}}}", "desired"),
                q(f'goodput_autoscaler_replicas{{{OPERATOR}, kind=~"current|ready|min|max"}}', "{{kind}}"),
            ],
            "none",
            0,
            16,
            step=True,
        ),
        panel(
            "Arrival rate and per-replica load vs capacity",
            [
                q(total, "arrival (requests/s)"),
                q(f"{total} / sum(goodput:replicas_reporting:count{{{RUNTIME}}})", "load per replica"),
                q(f"goodput_autoscaler_capacity_per_replica{{{OPERATOR}}}", "capacity per replica (learnt)"),
            ],
            "reqps",
            12,
            16,
        ),
        panel(
            "Arrival rate: forecast vs actual",
            [
                q(f'goodput_autoscaler_arrival_rate{{{OPERATOR}, kind="observed"}}', "actual (1-minute window)"),
                q(f'goodput_autoscaler_arrival_rate{{{OPERATOR}, kind="smoothed"}}', "smoothed (Holt level)"),
                q(f'goodput_autoscaler_arrival_rate{{{OPERATOR}, kind="forecast"}}', "forecast at start-up horizon"),
            ],
            "reqps",
            0,
            40,
            description=(
                "The rate the autoscaler plans for when a replica asked for now would be ready "
                "(goodput_autoscaler_startup_seconds ahead), against the rate that came: a right forecast leads the "
                "actual line by that horizon."
            ),
        ),
        panel(
            "Queue depth",
            [
                q(f"sum(goodput:requests_waiting:sum{{{RUNTIME}}})", "waiting"),
                q(f"sum(goodput:requests_running:sum{{{RUNTIME}}})", "running"),
                q(
                    f"histogram_quantile(0.9, sum by (le) (rate(goodput_request_queue_time_seconds_bucket{{{RUNTIME}}}"
                    f"[{RATE}])))",
                    "p90 queue time (s)",
                ),
            ],
            "short",
            0,
            24,
        ),
        panel(
            "KV cache usage",
            [
                q(f"avg(goodput:kv_cache_usage:avg{{{RUNTIME}}})", "mean"),
                q(f"max(goodput:kv_cache_usage:max{{{RUNTIME}}})", "fullest pod"),
            ],
            "percentunit",
            12,
            24,
        ),
        panel(
            "Preemptions",
            [q(f"sum(rate(goodput_preemptions_total{{{RUNTIME}}}[{RATE}]))", "preemptions/s")],
            "short",
            0,
            32,
            w=8,
        ),
        panel(
            "Pod start-up",
            [q(f'goodput_autoscaler_replicas{{{OPERATOR}, kind="starting"}}', "starting: {{name}}")],
            "none",
            8,
            32,
            w=8,
            step=True,
            description="Replicas asked for whose endpoints are not ready yet: capacity on its way.",
        ),
        panel(
            "Error budget burn rate",
            [
                q(f"goodput:slo_errors:ratio_rate5m{{{RUNTIME}}} / 0.05", "5m"),
                q(f"goodput:slo_errors:ratio_rate1h{{{RUNTIME}}} / 0.05", "1h"),
                q(f"goodput:slo_errors:ratio_rate6h{{{RUNTIME}}} / 0.05", "6h"),
            ],
            "short",
            16,
            32,
            w=8,
            threshold=None,
            description="1 spends the budget (0.05 for a 0.95 target) exactly over the SLO period; 14.4 pages.",
        ),
        *gateway_panels(48),
        *batch_panels(56),
        *pipeline_panels(64),
    ]
    return {
        "uid": UID,
        "title": "Goodput / Autoscaling",
        "tags": ["goodput", "slo", "autoscaling"],
        "timezone": "browser",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "editable": True,
        "time": {"from": "now-3h", "to": "now"},
        "annotations": {
            "list": [
                {
                    "name": "Scale events",
                    "enable": True,
                    "iconColor": "orange",
                    "datasource": DS,
                    "expr": "sum by (direction, reason) (increase(goodput_autoscaler_scale_events_total[1m])) > 0",
                    "step": "30s",
                    "titleFormat": "scaled {{direction}}",
                    "textFormat": "{{reason}}",
                    "tagKeys": "direction,reason",
                }
            ]
        },
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "refresh": 1,
                },
                variable("namespace", "label_values(goodput:requests:rate5m, namespace)", "Namespace"),
                variable("model", 'label_values(goodput:requests:rate5m{namespace=~"$namespace"}, model)', "Model"),
                variable(
                    "service",
                    'label_values(goodput_autoscaler_desired_replicas{namespace=~"$namespace"}, name)',
                    "InferenceService",
                ),
                variable(
                    "pipeline",
                    'label_values(goodput_pipeline_requests_total{namespace=~"$namespace"}, pipeline)',
                    "InferencePipeline",
                ),
            ]
        },
        "panels": panels,
    }


def _yaml_block(text: str, indent: int) -> str:
    pad = " " * indent
    return "\n".join(pad + line if line else line for line in text.splitlines())


def render() -> dict[str, str]:
    text = json.dumps(dashboard(), indent=2) + "\n"
    configmap = f"""# Generated by render.py; kube-prometheus-stack's Grafana sidecar loads ConfigMaps with this label.
apiVersion: v1
kind: ConfigMap
metadata:
  name: goodput-autoscaling-dashboard
  labels:
    grafana_dashboard: "1"
    app.kubernetes.io/name: goodput
data:
  goodput-autoscaling.json: |
{_yaml_block(text, 4)}
"""
    grafana_dashboard = """# Generated by render.py; for grafana-operator v5: the JSON in the ConfigMap beside it.
apiVersion: grafana.integreatly.org/v1beta1
kind: GrafanaDashboard
metadata:
  name: goodput-autoscaling
  labels:
    app.kubernetes.io/name: goodput
spec:
  instanceSelector:
    matchLabels:
      dashboards: grafana
  allowCrossNamespaceImport: true
  configMapRef:
    name: goodput-autoscaling-dashboard
    key: goodput-autoscaling.json
"""
    return {
        "goodput-autoscaling.json": text,
        "dashboard-configmap.yaml": configmap,
        "grafana-dashboard.yaml": grafana_dashboard,
    }


if __name__ == "__main__":
    for name, content in render().items():
        (HERE / name).write_text(content)
        print(f"wrote {HERE / name}")
