"""The processes bench.operator_scale measures: a control plane of the project's own (hack/cluster.sh: etcd,
kube-apiserver, kube-controller-manager; no nodes) with the API server's write counters, and one operator
process with its metrics, CPU time and RSS."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import kubernetes

ROOT = Path(__file__).resolve().parents[1]
SERVICE_CIDR = "10.0.0.0/16"  # a ClusterIP for every service (the default /24 holds 254)
WRITE_VERBS = {"POST", "PUT", "PATCH", "DELETE", "CREATE", "UPDATE", "APPLY"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ControlPlane:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        for attempt in range(5):  # on a busy machine the controller-manager may give up waiting for RBAC
            out = subprocess.run(
                [str(ROOT / "hack" / "cluster.sh"), "up", "--dir", str(workdir)],
                capture_output=True,
                text=True,
                timeout=1800,
                env={**os.environ, "GOODPUT_SERVICE_CIDR": SERVICE_CIDR},
            )
            if out.returncode == 0:
                break
            self.down()
            if attempt == 4:
                raise SystemExit(f"hack/cluster.sh up failed:\n{out.stdout}\n{out.stderr[-3000:]}")
        match = re.search(r"export KUBECONFIG=(\S+)", out.stdout)
        assert match, out.stdout
        self.kubeconfig = Path(match[1])
        bin_dir = Path((workdir / "bin").read_text().strip())
        self.kubectl_bin = str(bin_dir / "kubectl") if (bin_dir / "kubectl").exists() else "kubectl"
        self.api = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        self.api.configuration.connection_pool_maxsize = 32
        self.custom = kubernetes.client.CustomObjectsApi(self.api)
        self.apps = kubernetes.client.AppsV1Api(self.api)
        self.core = kubernetes.client.CoreV1Api(self.api)

    def kubectl(self, *args: str, input_text: str | None = None) -> str:
        cmd = [self.kubectl_bin, "--kubeconfig", str(self.kubeconfig), "--cache-dir", str(self.dir / "kcache"), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, input=input_text, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {out.stderr}")
        return out.stdout

    def down(self) -> None:
        subprocess.run(
            [str(ROOT / "hack" / "cluster.sh"), "down", "--dir", str(self.dir)],
            capture_output=True,
            text=True,
            timeout=300,
        )

    def write_counts(self) -> dict[str, float]:
        """Writes the API server has served so far, per resource (apiserver_request_total, every client)."""
        request = self.api.param_serialize(
            "GET", "/metrics", header_params={"Accept": "text/plain"}, auth_settings=["BearerToken"]
        )
        text = self.api.call_api(*request, _request_timeout=60).read().decode()
        counts: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith("apiserver_request_total{"):
                continue
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            if labels.get("verb", "").upper() not in WRITE_VERBS:
                continue
            key = labels.get("resource", "") + (f"/{labels['subresource']}" if labels.get("subresource") else "")
            counts[key] = counts.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return counts


class Operator:
    def __init__(self, plane: ControlPlane, log: Path, resync: float) -> None:
        self.metrics_port = free_port()
        env = {
            **os.environ,
            "KUBECONFIG": str(plane.kubeconfig),
            "RUNTIME_IMAGE": "registry.test/goodput:bench",
            "RESYNC_SECONDS": str(resync),
            "HF_ENDPOINT": "http://127.0.0.1:9",
        }
        env.pop("KUBERNETES_SERVICE_HOST", None)
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(ROOT / "operator"), str(ROOT / "contract"), env.get("PYTHONPATH")])
        )
        self.log = log
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "goodput_operator",
                "--liveness-port",
                "0",
                "--metrics-port",
                str(self.metrics_port),
            ],
            env=env,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
        )
        self.rss_peak = 0
        self.rss_last = 0
        self._stop = threading.Event()
        threading.Thread(target=self._sample, daemon=True).start()

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        while not self._stop.is_set() and self.proc.poll() is None:
            try:
                status = Path(f"/proc/{self.proc.pid}/status").read_text()
                kib = int(re.search(r"VmRSS:\s+(\d+)", status)[1])  # type: ignore[index]
                self.rss_last = kib * 1024
                self.rss_peak = max(self.rss_peak, self.rss_last)
            except (OSError, TypeError):
                pass
            self._stop.wait(1.0)

    def metric(self, name: str, having: str = "") -> float:
        """The sum of `name`'s series (those whose labels contain `having`, e.g. 'trigger="resync"')."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text = r.read().decode()
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#") and line[len(name)] in " {" and having in line
        )

    def wait_started(self) -> None:
        deadline = time.monotonic() + 120
        while "Watching InferenceServices" not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the operator did not start; see {self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        self._stop.set()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
