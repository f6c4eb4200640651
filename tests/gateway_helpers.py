"""The gateway tier: a real `python -m goodput_gateway` process discovering real runtime processes.

There is no kubelet in the test cluster, so the tests publish each runtime process as an
EndpointSlice endpoint themselves, labelled as the EndpointSlice controller labels a
Service's slices (it copies the Service's labels, the operator's included). `Started` holds
what a test or module fixture starts, and stops it in the reverse order when its block ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Protocol, TypeVar

from autoscaling_helpers import host_address, put_endpoint
from harness import ROOT, Cluster, wait_for
from helpers import stop_process
from live_pods import Pod


def tiny_spec(served_name: str = "tiny", **extra: Any) -> dict[str, Any]:
    return {
        "model": {"source": "file:///models/tiny", "servedName": served_name},
        "resources": {"gpu": 0, "memory": "2Gi"},
        **extra,
    }


def publish(
    cluster: Cluster,
    namespace: str,
    service: str,
    pod: str,
    port: int,
    ready: bool = True,
    terminating: bool = False,
    address: str | None = None,
) -> None:
    """What the EndpointSlice controller writes for one pod of the service, on its serving port."""
    put_endpoint(
        cluster,
        namespace,
        service,
        pod,
        address or host_address(),
        port,
        ready,
        port_name="http",
        terminating=terminating,
    )


def start_replica(name: str, model_dir: Path, log_dir: Path, *flags: str) -> Pod:
    return Pod(name, model_dir, log_dir / f"{name}.log", flags)


def wait_ready(*pods: Pod, timeout: float = 180) -> None:
    for pod in pods:
        wait_for(lambda p=pod: p.poll_ready() or p.process.poll() is not None, timeout, f"runtime {pod.name}")
        assert pod.process.poll() is None, pod.log_path.read_text()[-3000:]


def post_json(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, dict[str, str], Any]:
    """The status, headers and JSON body of the answer to a JSON POST, an error's as any other's."""
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of a series' samples at url/metrics whose labels include `labels`."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not (line.startswith(name + "{") or line.startswith(name + " ")):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class GatewayProcess:
    """`python -m goodput_gateway` as its own process, logging to a file."""

    def __init__(self, kubeconfig: Path, log: Path, *args: str) -> None:
        self.kubeconfig, self.log_path, self.args = kubeconfig, log, args
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self) -> GatewayProcess:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        env.pop("KUBERNETES_SERVICE_HOST", None)
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "goodput_gateway", "--port", "0", *self.args],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )

        def listening() -> bool:
            match = re.search(r"Listening on http://[^:]+:(\d+)", self.log())
            if match:
                self.url = f"http://127.0.0.1:{match[1]}"
            return bool(match) or self.process.poll() is not None  # type: ignore[union-attr]

        wait_for(listening, 60, "the gateway to listen")
        assert self.process.poll() is None, self.log()[-4000:]
        wait_for(
            lambda: urllib.request.urlopen(self.url + "/health", timeout=2).status == 200,
            30,
            "the gateway to read the cluster",
        )
        return self

    def stop(self) -> None:
        if self.process:
            stop_process(self.process, timeout=10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def tracebacks(self) -> str:
        """The log's tail where the gateway logged a traceback, else nothing."""
        log = self.log()
        return log[-6000:] if "Traceback" in log else ""

    def models(self) -> list[dict[str, Any]]:
        data: list[dict[str, Any]] = json.loads(urllib.request.urlopen(self.url + "/v1/models", timeout=5).read())[
            "data"
        ]
        return data

    def metric(self, name: str, **labels: str) -> float:
        return metric(self.url, name, **labels)


class Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


class Started(contextlib.ExitStack):
    """What a test or module fixture starts, stopped in the reverse order when its block ends, each only if
    it started: a gateway before the replicas behind it, namespaces deleted last."""

    def namespaces(self, cluster: Cluster, *names: str) -> None:
        for name in names:
            cluster.core.create_namespace({"metadata": {"name": name}})
            self.callback(cluster.core.delete_namespace, name)

    def replica(self, name: str, model_dir: Path, log_dir: Path, *flags: str) -> Pod:
        return self.stops(start_replica(name, model_dir, log_dir, *flags))

    def gateway(self, kubeconfig: Path, log: Path, *args: str) -> GatewayProcess:
        """A gateway started and listening; stopped at the end, with its log's tail printed where it logged
        a traceback."""
        gateway = GatewayProcess(kubeconfig, log, *args)
        self.callback(stop_and_report, gateway)  # before start: one that never listens is stopped too
        return gateway.start()

    def stops(self, running: S) -> S:
        self.callback(running.stop)
        return running


def stop_and_report(gateway: GatewayProcess) -> None:
    gateway.stop()
    if tracebacks := gateway.tracebacks():
        print(tracebacks)
