"""Fixtures for the tiers that run against a real Kubernetes API server (operator, gateway).

The session starts its own control plane with hack/cluster.sh (etcd, kube-apiserver
and kube-controller-manager on free ports), installs the CRDs, and tears it all down
after. Each test module runs its own operator process (`python -m goodput_operator`),
so a module can restart it or run it under another identity: such a module's own `operator`
fixture starts one with `with OperatorProcess(...) as process`, and a module-wide namespace
comes from `cluster.scratch_namespace()`. The root conftest loads this
module as a plugin, so the operator and gateway directories share one control plane a session.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import kubernetes
import pytest
from harness import CRD, GROUP, PLURAL, ROOT, Cluster, HubHandler, OperatorProcess, wait_for


def _start_cluster(workdir: Path) -> tuple[Path, Path]:
    result = subprocess.run(
        [str(ROOT / "hack" / "cluster.sh"), "up", "--dir", str(workdir)], capture_output=True, text=True, timeout=1800
    )
    if result.returncode != 0:
        raise RuntimeError(f"hack/cluster.sh up failed:\n{result.stdout}\n{result.stderr[-4000:]}")
    match = re.search(r"export KUBECONFIG=(\S+)", result.stdout)
    assert match, result.stdout
    return Path(match[1]), Path((workdir / "bin").read_text().strip())


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    workdir = tmp_path_factory.mktemp("cluster")
    try:
        kubeconfig, bin_dir = _start_cluster(workdir)
        api = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        cluster = Cluster(workdir, kubeconfig, bin_dir, api)
        cluster.kubectl(
            "apply",
            "-f",
            str(CRD),
            "-f",
            str(CRD.with_name(f"{GROUP}_inferencepipelines.yaml")),
            "-f",
            str(CRD.with_name(f"{GROUP}_loraadapters.yaml")),
        )
        cluster.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            f"crd/{PLURAL}.{GROUP}",
            f"crd/inferencepipelines.{GROUP}",
            f"crd/loraadapters.{GROUP}",
        )
        # kubectl's discovery cache predates the CRD; the OpenAPI document lags it by seconds
        shutil.rmtree(workdir / "kubectl-cache", ignore_errors=True)
        wait_for(
            lambda: cluster.kubectl("explain", "inferenceservice", check=False).returncode == 0,
            60,
            "the CRD in the OpenAPI document",
        )
        yield cluster
    finally:
        subprocess.run(
            [str(ROOT / "hack" / "cluster.sh"), "down", "--dir", str(workdir)],
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture
def namespace(cluster: Cluster) -> Iterator[str]:
    with cluster.scratch_namespace() as name:
        yield name


@pytest.fixture(scope="session")
def hub() -> Iterator[type[HubHandler]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), HubHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    HubHandler.endpoint = f"http://127.0.0.1:{server.server_address[1]}"  # type: ignore[attr-defined]
    yield HubHandler
    server.shutdown()


@pytest.fixture(scope="module")
def operator(
    cluster: Cluster, hub: type[HubHandler], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    with OperatorProcess(cluster.kubeconfig, log, hub.endpoint) as process:  # type: ignore[attr-defined]
        yield process
