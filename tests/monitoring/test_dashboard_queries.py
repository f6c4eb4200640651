"""The dashboard's queries: every one parses as PromQL (promtool), and the KV row (held routing, the
gateway's KV index, the runtimes' KV tiers, peer pulls) reads only series the gateway's and the runtime's
code export, by labels those series carry, and leaves none of them out."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.peer_pull import PeerPulls
from goodput_runtime.engine.kv_offload import OffloadStats
from goodput_runtime.engine.kv_transfer.metrics import KVTransferMetrics
from goodput_runtime.kv_tier_metrics import KvTierCollector
from goodput_runtime.metrics import RuntimeMetrics

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "manifests" / "monitoring"
PROMTOOL = shutil.which("promtool")
VALUES = {"$namespace": ".*", "$model": ".*", "$service": ".*", "$pipeline": ".*", "$__rate_interval": "1m"}
SCRAPED = {"job", "instance", "namespace", "pod"}  # what Prometheus adds to a scraped series
# a disaggregated service's leases; failures by reason are in the hand-off panel; KV usage is read through
# the recording rules (goodput:kv_cache_usage:*)
NOT_READ = {
    "goodput_kv_lease_blocks",
    "goodput_kv_lease_expiries",
    "goodput_kv_transfer_failures",
    "goodput_kv_cache_usage_ratio",
}
SELECTOR = re.compile(r"\b(goodput_[a-z0-9_]+)\b\s*(?:\{([^}]*)\})?")


def board() -> dict:
    return json.loads((MONITORING / "goodput-autoscaling.json").read_text())


def filled(expr: str) -> str:
    for name, value in VALUES.items():
        expr = expr.replace(name, value)
    return expr


def kv_row() -> list[tuple[str, str]]:
    """(panel / legend, query) of the shipped dashboard's KV row (the panels dashboard_kv.py makes)."""
    spec = importlib.util.spec_from_file_location("render", MONITORING / "render.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))  # puts render.py's siblings on the path
    titles = {p["title"] for p in importlib.import_module("dashboard_kv").kv_panels(0)}
    panels = [p for p in board()["panels"] if p["title"] in titles]
    assert len(panels) == len(titles)
    return [(f"{p['title']} / {t['legendFormat']}", t["expr"]) for p in panels for t in p["targets"]]


def exported() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """What the gateway's held routing, KV index and peer pulls and the runtime's prefix cache, KV tiers and
    transfers export: sample name -> its labels, and each family -> its sample names. Every labelled
    metric is touched once; the tier collector reads a block manager with both tiers."""
    gateway = GatewayMetrics()
    PeerPulls(None, gateway.registry)  # type: ignore[arg-type]  # the session is used only to ask replicas
    runtime = CollectorRegistry()
    RuntimeMetrics("tiny", None, None, runtime)
    KVTransferMetrics(runtime, "tiny")
    store = SimpleNamespace(stats=OffloadStats(), used_bytes=0, capacity=1 << 20)
    events = SimpleNamespace(counts=lambda: {"device": 1, "offload": 1})
    runtime.register(KvTierCollector("tiny", SimpleNamespace(events=events, offload=store)))
    samples: dict[str, set[str]] = {}
    families: dict[str, set[str]] = {}
    kv = re.compile(r"goodput_gateway_(routing_decisions|held_|kv_index|peer_pull)|goodput_(kv_|prefix_cache_hits)")
    for registry in (gateway.registry, runtime):
        for collector in list(registry._collector_to_names):
            if isinstance(collector, MetricWrapperBase) and collector._labelnames:
                collector.labels(*("x" for _ in collector._labelnames))
        for family in registry.collect():
            if not kv.match(family.name):
                continue
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    samples.setdefault(sample.name, set()).update(sample.labels)
                    families.setdefault(family.name, set()).add(sample.name)
    return samples, families


@pytest.mark.skipif(PROMTOOL is None, reason="promtool missing (make prometheus installs it)")
def test_every_dashboard_query_parses_as_promql(tmp_path):
    data = board()
    queries = {
        f"dashboard:panel{i}_{t['refId']}": (f"{p['title']} / {t['legendFormat']}", t["expr"])
        for i, p in enumerate(data["panels"])
        for t in p["targets"]
    }
    queries.update(
        {f"dashboard:annotation{i}": (a["name"], a["expr"]) for i, a in enumerate(data["annotations"]["list"])}
    )
    rules = [{"record": record, "expr": filled(expr)} for record, (_, expr) in queries.items()]
    (tmp_path / "queries.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(tmp_path / "queries.yaml")], capture_output=True, text=True, timeout=60
    )
    output = result.stdout + result.stderr
    named = [f"{queries[r][0]}: {queries[r][1]}" for r in queries if r in output]
    assert result.returncode == 0, f"{output}\n{named}"
    assert f"SUCCESS: {len(rules)} rules found" in output


def test_the_kv_row_reads_exported_series_by_their_own_labels():
    samples, _ = exported()
    row = kv_row()
    assert len(row) >= 20
    wrong = []
    for name, expr in row:
        used = SELECTOR.findall(expr)
        assert used, name
        for series, matchers in used:
            if series not in samples:
                wrong.append(f"{name}: {series} is not exported")
                continue
            labels = samples[series] | SCRAPED
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                if label not in labels:
                    wrong.append(f"{name}: {series} has no label {label}")
        for by in re.findall(r"\bby \(([^)]*)\)", expr):
            for label in (b.strip() for b in by.split(",")):
                missing = [s for s, _ in used if s in samples and label not in samples[s] | SCRAPED]
                if missing:
                    wrong.append(f"{name}: by ({label}) over {missing}, which lack it")
    assert not wrong, "\n".join(wrong)


def test_the_dashboard_shows_every_held_routing_tier_and_peer_pull_series():
    _, families = exported()
    text = json.dumps(board())
    unseen = [f for f, names in families.items() if f not in NOT_READ and not any(n in text for n in names)]
    assert not unseen, f"no panel reads {unseen}"
    peer = {t["expr"] for p in board()["panels"] if p["title"].startswith("Peer pulls") for t in p["targets"]}
    for series in (
        "goodput_gateway_peer_pulls_total",
        "goodput_gateway_peer_pull_blocks_total",
        "goodput_kv_transfers_total",
        "goodput_kv_transfer_blocks_total",
        "goodput_kv_transfer_bytes_total",
        "goodput_kv_transfer_seconds_bucket",
    ):
        assert any(series in expr for expr in peer), series
