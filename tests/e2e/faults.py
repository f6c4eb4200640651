"""Helpers of the e2e `faults` tier: a steady load through the gateway that keeps every outcome,
the gateway's retry counter, and a node component restarted with hack/cluster.sh."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import openai
from node import CLUSTER_SCRIPT, OPERATOR_NAMESPACE, Node, condition

from goodput_contract.metrics import REQUESTS_RUNNING


@dataclass
class Outcome:
    stream: bool
    ok: bool
    chunks: int = 0  # content chunks the client had received when it finished or failed
    error: str = ""
    at: float = 0.0  # time.monotonic() when it finished or failed


@dataclass
class SteadyLoad:
    """`clients` threads sending chat completions through `base_url` one after another, half of
    them streamed, with the official `openai` SDK and no client-side retries: every failure the
    gateway did not absorb reaches the outcome list with the error the client saw."""

    base_url: str
    model: str
    clients: int = 3
    max_tokens: int = 12
    streamed_only: bool = False  # every request streamed (else half of them)
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.clients)]
        self._lock = threading.Lock()

    def _one(self, client: openai.OpenAI, stream: bool, n: int) -> Outcome:
        messages = [{"role": "user", "content": f"steady request {n}"}]
        chunks = 0
        try:
            if stream:
                finished = False
                for chunk in client.chat.completions.create(
                    model=self.model, messages=messages, stream=True, max_tokens=self.max_tokens, temperature=0
                ):
                    if chunk.choices and chunk.choices[0].delta.content:
                        chunks += 1
                    if chunk.choices and chunk.choices[0].finish_reason:
                        finished = True
                if not finished:
                    return Outcome(stream, False, chunks, "the stream ended without a finish_reason")
            else:
                answer = client.chat.completions.create(
                    model=self.model, messages=messages, max_tokens=self.max_tokens, temperature=0
                )
                assert answer.choices[0].message.content is not None
            return Outcome(stream, True, chunks)
        except openai.APIStatusError as err:  # the answer's status and its body, which names the cause
            try:
                body = err.response.read().decode(errors="replace")
            except Exception:  # a stream's body may be gone already
                body = ""
            server = err.response.headers.get("server", "")  # who answered: the gateway, or what else
            return Outcome(stream, False, chunks, f"{type(err).__name__}: {err} {body} server={server!r}"[:400])
        except Exception as err:  # every other kind of failure is what this load counts, with its message
            return Outcome(stream, False, chunks, f"{type(err).__name__}: {err}"[:300])

    def _run(self, index: int) -> None:
        client = openai.OpenAI(base_url=self.base_url, api_key="unused", max_retries=0, timeout=120)
        n = 0
        while not self._stop.is_set():
            outcome = self._one(client, stream=self.streamed_only or (n + index) % 2 == 0, n=n)
            outcome.at = time.monotonic()
            with self._lock:
                self.outcomes.append(outcome)
            n += 1
            time.sleep(0.05)

    @property
    def answered(self) -> int:
        return sum(o.ok for o in self.outcomes)

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def __enter__(self) -> SteadyLoad:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=150)


def gateway_pods(node: Node) -> list[dict[str, Any]]:
    pods = node.get("pods", namespace=OPERATOR_NAMESPACE, selector="app.kubernetes.io/name=goodput-gateway") or []
    return [
        p for p in pods if condition(p, "Ready").get("status") == "True" and not p["metadata"].get("deletionTimestamp")
    ]


def gateway_retries(node: Node, namespace: str, service: str) -> Counter[str]:
    """The failures the gateway absorbed for the service, summed over the gateway pods (each pod's
    /metrics, read from the node, which routes to pod IPs): goodput_gateway_retries_total by reason,
    and under "resumed" goodput_gateway_streams_resumed_total, the streams taken up on another
    replica after their first byte."""
    total: Counter[str] = Counter()
    for pod in gateway_pods(node):
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            match = re.match(r"^goodput_gateway_(retries|streams_resumed)_total\{(.*)\} (\S+)$", line)
            if match and f'namespace="{namespace}"' in match[2] and f'service="{service}"' in match[2]:
                reason = re.search(r'reason="([^"]*)"', match[2])
                label = "resumed" if match[1] == "streams_resumed" else reason[1] if reason else ""
                total[label] += int(float(match[3]))
    return total


def restart_component(node: Node, component: str, signal: str = "KILL", pause: float = 0) -> None:
    """Kill one of the node's processes (kubelet, kube-proxy, containerd, ...) and start it again."""
    subprocess.run(
        [str(CLUSTER_SCRIPT), "restart", component, "--signal", signal, "--pause", str(pause), "--dir", str(node.dir)],
        check=True,
        capture_output=True,
        timeout=120,
    )


def requests_running(pod: dict[str, Any]) -> float:
    """The runtime's running requests, from the pod's own /metrics (read from the node, which routes to
    pod IPs); 0 where the page cannot be read."""
    try:
        with urllib.request.urlopen(f"http://{pod['status']['podIP']}:8000/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.split("{", 1)[0].split(" ", 1)[0] == REQUESTS_RUNNING
    )


def serving_pod(pods: list[dict[str, Any]], timeout: float = 60) -> dict[str, Any]:
    """The pod with the most requests running now, polled until one has any: the replica whose crash a
    request in flight meets (the gateway's routing may leave a replica idle for a while)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [(requests_running(p), i) for i, p in enumerate(pods)]
        best, index = max(running)
        if best > 0:
            return pods[index]
        if time.monotonic() > deadline:
            raise AssertionError(f"no replica had a request running within {timeout:.0f} s")
        time.sleep(0.05)


def kill_runtime_process(node: Node, pod: dict[str, Any]) -> int:
    """SIGKILL the `python -m goodput_runtime` process of `pod` on this machine (the node): a crash,
    which the kubelet answers by restarting the container. Returns the PID killed."""
    uid = pod["metadata"]["uid"]
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
            cgroup = Path(f"/proc/{entry}/cgroup").read_text()
        except OSError:
            continue
        if b"goodput_runtime" in cmdline and f"pod{uid}" in cgroup:
            os.kill(int(entry), signal.SIGKILL)
            return int(entry)
    raise AssertionError(f"no goodput_runtime process in the cgroup of pod {pod['metadata']['name']} ({uid})")


def report(row: dict[str, Any]) -> None:
    """The line bench/faults.py collects into its table."""
    print("FAULT-ROW " + json.dumps(row))
