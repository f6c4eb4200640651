"""The shipped monitoring objects: promtool accepts and unit-tests the rules; the dashboard ships as rendered."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (make prometheus installs it)")


def rule_groups() -> list[dict]:
    rule = yaml.safe_load((MONITORING / "prometheus-rule.yaml").read_text())
    assert (rule["apiVersion"], rule["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    return rule["spec"]["groups"]


def render_module():
    spec = importlib.util.spec_from_file_location("render", MONITORING / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def rules_dir(tmp_path: Path) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": rule_groups()}))
    shutil.copy(MONITORING / "tests" / "goodput.test.yaml", tmp_path)
    return tmp_path


@needs_promtool
def test_promtool_checks_the_rules(rules_dir):
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules_dir / "rules.yaml")], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_promtool
def test_promtool_unit_tests_pass(rules_dir):
    """Recorded attainment and goodput values, and which burn-rate alert fires when."""
    result = subprocess.run(
        [PROMTOOL, "test", "rules", str(rules_dir / "goodput.test.yaml")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=rules_dir,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_burn_rate_alerts_pair_a_long_and_a_short_window():
    alerts = [r for g in rule_groups() for r in g["rules"] if r.get("alert", "").startswith("GoodputSLOBurnRate")]
    assert len(alerts) == 4
    for alert in alerts:
        windows = [w for w in ("5m", "30m", "1h", "2h", "6h", "1d", "3d") if f"ratio_rate{w} " in alert["expr"]]
        assert len(windows) == 2, alert["expr"]
        assert alert["labels"]["severity"] in ("critical", "warning")


def test_committed_dashboard_objects_match_render_py():
    for name, content in render_module().render().items():
        assert (MONITORING / name).read_text() == content, f"{name} is stale: run python manifests/monitoring/render.py"


def test_dashboard_ships_to_both_grafana_installs():
    configmap = yaml.safe_load((MONITORING / "dashboard-configmap.yaml").read_text())
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    board = json.loads(configmap["data"]["goodput-autoscaling.json"])
    titles = [p["title"] for p in board["panels"]]
    for wanted in (
        "SLO attainment vs target",
        "Goodput vs throughput",
        "Time to first token",
        "Time per output token",
        "Replicas: desired vs ready",
        "Queue depth",
        "KV cache usage",
        "Preemptions",
        "Pod start-up",
    ):
        assert wanted in titles
    assert board["annotations"]["list"][0]["name"] == "Scale events"
    grafana = yaml.safe_load((MONITORING / "grafana-dashboard.yaml").read_text())
    assert grafana["kind"] == "GrafanaDashboard"
    assert grafana["spec"]["configMapRef"] == {"name": configmap["metadata"]["name"], "key": "goodput-autoscaling.json"}
