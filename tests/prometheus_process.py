"""A real Prometheus (Debian's package) scraping the runtime pods and the operator, with our rules loaded."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from autoscaling_helpers import free_port
from harness import ROOT, wait_for
from helpers import stop_process

PROMETHEUS = shutil.which("prometheus")
RULE = ROOT / "manifests" / "monitoring" / "prometheus-rule.yaml"


class Prometheus:
    def __init__(
        self, workdir: Path, namespace: str, operator_metrics_port: int | None, gateway_ports: tuple[int, ...] = ()
    ) -> None:
        self.dir, self.namespace = workdir, namespace
        self.port = free_port()
        groups = yaml.safe_load(RULE.read_text())["spec"]["groups"]
        for group in groups:
            group["interval"] = "1s"  # the shipped 30s would leave a short test with few evaluations
        (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
        self.set_targets([])
        config: dict[str, Any] = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(workdir / "rules.yaml")],
            "scrape_configs": [
                {
                    "job_name": "goodput-runtime",
                    "file_sd_configs": [{"files": [str(workdir / "targets.json")], "refresh_interval": "1s"}],
                },
            ],
        }
        if operator_metrics_port is not None:
            config["scrape_configs"].append(
                {
                    "job_name": "goodput-operator",
                    "static_configs": [{"targets": [f"127.0.0.1:{operator_metrics_port}"]}],
                }
            )
        if gateway_ports:  # as the gateway's ServiceMonitor: the series' own namespace label wins
            config["scrape_configs"].append(
                {
                    "job_name": "goodput-gateway",
                    "honor_labels": True,
                    "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in gateway_ports]}],
                }
            )
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log = (workdir / "prometheus.log").open("wb")
        assert PROMETHEUS, "prometheus missing (make prometheus installs Debian's package)"
        self.process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        wait_for(lambda: self._ready(), 60, "Prometheus to be ready")

    def _ready(self) -> bool:
        assert self.process.poll() is None, (self.dir / "prometheus.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    def set_targets(self, pods: list[tuple[str, int]]) -> None:
        """File service discovery: what a PodMonitor would find, labelled the way it labels."""
        groups = [
            {"targets": [f"127.0.0.1:{port}"], "labels": {"namespace": self.namespace, "pod": name}}
            for name, port in pods
        ]
        tmp = self.dir / "targets.json.tmp"
        tmp.write_text(json.dumps(groups))
        tmp.replace(self.dir / "targets.json")

    def query_range(self, expr: str, start: float, end: float, step: str = "2s") -> list[dict[str, Any]]:
        params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.port}/api/v1/query_range?{params}", timeout=30
        ) as response:
            body = json.loads(response.read())
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def panels_without_data(self, queries: list[tuple[str, str]], start: float, wait: float = 30.0) -> list[str]:
        """The (panel, expr) queries with no data since `start`, once every one has some or `wait` seconds
        have passed: rate() needs two scrapes after the last request, and a quick test can end within
        Prometheus's first few seconds."""
        deadline = time.time() + wait
        while True:
            empty = [name for name, expr in queries if not self.query_range(expr, start, time.time())]
            if not empty or time.time() > deadline:
                return empty
            time.sleep(1)

    def stop(self) -> None:
        stop_process(self.process, timeout=20)
        self.log.close()

    @staticmethod
    def now() -> float:
        return time.time()


def dashboard_queries(values: dict[str, str], keep: Callable[[str], bool]) -> list[tuple[str, str]]:
    """The dashboard's panel queries that `keep` selects, as (panel / legend, PromQL) with the template
    variables in `values` filled in."""
    board = json.loads((ROOT / "manifests" / "monitoring" / "goodput-autoscaling.json").read_text())
    out = []
    for panel in board["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            if not keep(expr):
                continue
            for name, value in values.items():
                expr = expr.replace(name, value)
            out.append((f"{panel['title']} / {target['legendFormat']}", expr))
    return out
