"""Renders the Grafana autoscaling dashboard and the two objects that ship it.

    python manifests/monitoring/render.py

writes goodput-autoscaling.json (import it by hand), dashboard-configmap.yaml (a ConfigMap
labelled grafana_dashboard: "1" for kube-prometheus-stack's sidecar) and
grafana-dashboard.yaml (a GrafanaDashboard for grafana-operator v5). A test checks the
committed files match this script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # the sibling modules, also when a test loads this file by its path

from dashboard_kv import kv_panels  # noqa: E402
from dashboard_panels import DS, OPERATOR, RATE, RUNTIME, UID, panel, q, quantiles, variable  # noqa: E402
from dashboard_sections import batch_panels, gateway_panels, pipeline_panels, pool_panels  # noqa: E402


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
        *pool_panels(72),
        *kv_panels(96),
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
