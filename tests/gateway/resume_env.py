"""What the stream-resumption tests share: real runtime processes of the tiny model behind one gateway that
serves them as the static model `tiny`, the replica serving a stream SIGKILLed, and the gateway's count of
resumed streams."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gateway_helpers import GatewayProcess, Started, metric, wait_ready

FLAGS = ("--max-model-len", "2048", "--kv-cache-memory", "8Mi")
MESSAGES = [{"role": "user", "content": "Tell me a long story"}]


@contextlib.contextmanager
def replicas_behind_a_gateway(model_dir: Path, workdir: Path, replicas: int = 3) -> Iterator[tuple[Any, list]]:
    """(the gateway, the replicas); the gateway tries as many replicas as there are (the static list keeps
    a killed one, which a new request may meet first)."""
    with Started() as started:
        pods = [started.replica(f"r{i}", model_dir, workdir, *FLAGS) for i in range(replicas)]
        wait_ready(*pods, timeout=600)
        urls = ",".join(f"http://127.0.0.1:{p.port}" for p in pods)
        gateway: GatewayProcess = started.gateway(
            workdir / "no-kubeconfig",
            workdir / "gateway.log",
            "--static-model",
            f"tiny={urls}",
            "--shutdown-delay",
            "0",
            "--attempts",
            str(replicas),
        )
        yield gateway, pods


def kill_the_serving_replica(pods: list) -> None:
    """SIGKILL the live replica running a request (the stream's)."""
    live = [p for p in pods if p.process.poll() is None]
    serving = [p for p in live if metric(f"http://127.0.0.1:{p.port}", "goodput_requests_running") > 0]
    assert len(serving) == 1, "the stream's replica should be the one running a request"
    serving[0].process.kill()
    serving[0].process.wait(10)


def resumed(gateway: GatewayProcess) -> float:
    return gateway.metric("goodput_gateway_streams_resumed_total", service="tiny")
