"""Real runtime processes standing in for a service's pods, and the load that drives them.

There is no kubelet in the test cluster, so `Actuator` plays the part the Deployment,
the kubelet and the EndpointSlice controller play in a cluster: it follows the replica
count the autoscaler wrote through the scale subresource, starts or stops that many
`python -m goodput_runtime` processes, and publishes each one as an EndpointSlice
endpoint (not ready while it boots, ready once /health answers 200).
"""

from __future__ import annotations

import bisect
import json
import random
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from autoscaling_helpers import delete_endpoint, free_port, host_address, put_endpoint, scale_replicas
from harness import Cluster, OperatorProcess, wait_for
from helpers import stop_process


class Pod:
    def __init__(
        self, name: str, model_dir: Path, log: Path, flags: tuple[str, ...], boot_seconds: float = 0.0
    ) -> None:
        self.name, self.log_path = name, log
        self.ready_after = time.monotonic() + boot_seconds  # scheduling, image pull: before the process itself
        self._log = log.open("wb")
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "goodput_runtime",
                "--model",
                str(model_dir),
                "--served-model-name",
                "tiny",
                "--host",
                "0.0.0.0",
                "--port",
                "0",
                "--device",
                "cpu",
                "--dtype",
                "float32",
                "--max-model-len",
                "512",
                "--kv-cache-memory",
                "2Mi",
                "--shutdown-grace",
                "1",
                *flags,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self.port = 0
        self.ready = False
        self.published = False  # an EndpointSlice endpoint exists for it

    def poll_ready(self) -> bool:
        if time.monotonic() < self.ready_after:
            return False
        if not self.port:
            match = re.search(r"Listening on http://[^:]+:(\d+)", self.log_path.read_text(errors="replace"))
            if not match:
                return False
            self.port = int(match[1])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as response:
                self.ready = response.status == 200
        except OSError:
            self.ready = False
        return self.ready

    def stop(self) -> None:
        stop_process(self.process, timeout=15)
        self._log.close()


@dataclass
class Actuator:
    cluster: Cluster
    namespace: str
    service: str
    model_dir: Path
    log_dir: Path
    flags: tuple[str, ...]
    on_targets: Callable[[list[tuple[str, int]]], None] | None = None  # told the ready (name, port)s on change
    boot_seconds: float = 0.0  # a new pod is ready no sooner than this: a GPU pod's scheduling and image pull
    pods: list[Pod] = field(default_factory=list)
    history: list[tuple[float, int]] = field(default_factory=list)  # (time, replicas asked for)
    _stop: threading.Event = field(default_factory=threading.Event)
    _count: int = 0

    def start(self) -> Actuator:
        self._thread = threading.Thread(target=self._run, daemon=True, name="actuator")
        self._thread.start()
        return self

    def _run(self) -> None:
        address = host_address()
        while not self._stop.is_set():
            try:
                wanted = scale_replicas(self.cluster, self.namespace, self.service)
            except Exception:
                time.sleep(0.3)
                continue
            if not self.history or self.history[-1][1] != wanted:
                self.history.append((time.monotonic(), wanted))
            changed = False
            while len(self.pods) < wanted:
                self._count += 1
                name = f"pod-{self._count}"
                self.pods.append(Pod(name, self.model_dir, self.log_dir / f"{name}.log", self.flags, self.boot_seconds))
            while len(self.pods) > wanted:
                pod = self.pods.pop()
                delete_endpoint(self.cluster, self.namespace, self.service, pod.name)
                pod.stop()
                changed = True
            for pod in self.pods:
                was = pod.ready
                if pod.poll_ready() != was or (pod.port and not pod.published):
                    put_endpoint(self.cluster, self.namespace, self.service, pod.name, address, pod.port, pod.ready)
                    pod.published = True
                    changed = True
            if changed and self.on_targets is not None:
                self.on_targets([(p.name, p.port) for p in self.pods if p.ready])
            time.sleep(0.3)

    def ready_ports(self) -> list[int]:
        return [p.port for p in list(self.pods) if p.ready]

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        for pod in self.pods:
            pod.stop()


class Load:
    """`workers` clients, each sending one completion of `max_tokens` after another to the ready pods in turn."""

    def __init__(self, actuator: Actuator, max_tokens: int = 12) -> None:
        self.actuator = actuator
        self.max_tokens = max_tokens
        self.workers = 0
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._turn = 0

    def set_workers(self, n: int) -> None:
        with self._lock:
            self.workers = n
            while len(self._threads) < n:
                index = len(self._threads)
                thread = threading.Thread(target=self._work, args=(index,), daemon=True)
                self._threads.append(thread)
                thread.start()
            if n == 0:
                self._threads = []

    def _work(self, index: int) -> None:
        body = json.dumps(
            {
                "model": "tiny",
                "prompt": "the quick brown fox jumps over the lazy dog " * 4,
                "max_tokens": self.max_tokens,
                "ignore_eos": True,
            }
        ).encode()
        while index < self.workers:
            ports = self.actuator.ready_ports()
            if not ports:
                time.sleep(0.1)
                continue
            self._turn += 1
            port = ports[self._turn % len(ports)]
            request = urllib.request.Request(
                f"http://127.0.0.1:{port}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                urllib.request.urlopen(request, timeout=30).read()
            except OSError:
                time.sleep(0.1)


@dataclass
class Sent:
    at: float  # monotonic, when sent
    latency: float
    status: int  # HTTP status; 0: no answer


class OpenLoad:
    """Open-loop arrivals: a Poisson process whose rate `rate(t)` (t: seconds since start) the test sets,
    each request sent at its time whatever the answers before it, to the ready pods in turn, as users
    arrive regardless of how the service is doing. `evenly`: the arrivals are spaced 1 / rate(t) apart
    instead, a smooth ramp without Poisson noise."""

    def __init__(
        self,
        actuator: Actuator,
        rate: Callable[[float], float],
        body: dict[str, object],
        seed: int = 7,
        evenly: bool = False,
    ) -> None:
        self.actuator, self.rate, self.body = actuator, rate, json.dumps(body).encode()
        self.evenly = evenly
        self.sent: list[Sent] = []
        self.arrivals: list[float] = []  # monotonic send times, in order (sent: in the order answered)
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._turn = 0
        self._pool = ThreadPoolExecutor(64, thread_name_prefix="open-load")
        self.started = 0.0

    def start(self) -> OpenLoad:
        self.started = time.monotonic()
        self._thread = threading.Thread(target=self._arrivals, daemon=True, name="open-load")
        self._thread.start()
        return self

    def _arrivals(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            rate = self.rate(due - self.started)
            if rate > 0:
                due += 1 / rate if self.evenly else self._rng.expovariate(rate)
            else:
                due += 0.1
            self._stop.wait(max(0.0, due - time.monotonic()))
            if rate > 0 and not self._stop.is_set():
                self.arrivals.append(due)
                self._pool.submit(self._send, due)

    def sent_rate(self, now: float, window: float) -> float:
        """Requests sent per second over the `window` seconds before `now`."""
        arrivals = self.arrivals
        return (bisect.bisect_right(arrivals, now) - bisect.bisect_right(arrivals, now - window)) / window

    def _send(self, at: float) -> None:
        ports = self.actuator.ready_ports()
        status = 0
        if ports:
            self._turn += 1
            request = urllib.request.Request(
                f"http://127.0.0.1:{ports[self._turn % len(ports)]}/v1/completions",
                data=self.body,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    response.read()
                    status = response.status
            except urllib.error.HTTPError as err:
                status = err.code
            except OSError:
                status = 0
        self.sent.append(Sent(at, time.monotonic() - at, status))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._pool.shutdown(wait=True, cancel_futures=True)


def autoscaling_operator(
    cluster: Cluster, hub, workdir: Path, period: float, window: float
) -> tuple[OperatorProcess, int]:
    """A real operator process with a fast autoscaler (control period and window in seconds), started;
    and the port of its metrics."""
    port = free_port()
    operator = OperatorProcess(
        cluster.kubeconfig,
        workdir / "operator.log",
        hub.endpoint,
        "--metrics-port",
        str(port),
        "--autoscaler-period-seconds",
        str(period),
        "--autoscaler-window-seconds",
        str(window),
    ).start()
    return operator, port


# Requests per second one replica should serve in the live autoscaler tests. Their signals are counts over a
# 10 s window: at a few requests a second Poisson noise hides the forecast's trend (its test asks 4 deviations)
# and the index of dispersion, so on a slower CPU the requests are made shorter until one replica serves
# about this many (C = 4.5 req/s at 100 tokens on a 2-core AVX2 EPYC: the forecast's trend never cleared the
# test, and the capacity term scaled up first).
TARGET_CAPACITY = 9.0
SHORTEST = 20  # tokens: below this a request is mostly its HTTP round trip and prompt
# C is timed with a queue, as a replica serves a burst (timed one request after another it leaves out the
# client's round trip, and a CI run's one replica then served 1.18 C with a p90 TTFT of 1.2 s), and is the
# best of a few rounds: the same process timed twice on this shared machine read 6.7 and 9.2 req/s, and a
# round slowed by other work reads a C the replica beats once it is quiet.
ROUNDS, PER_ROUND = 4, 16


def calibrate(model_dir: Path, log: Path, flags: tuple[str, ...], body: dict) -> tuple[float, dict]:
    """(C, the body to send): the requests per second one runtime process serves of `body` with the next
    request always waiting (two clients, back to back), the best of ROUNDS rounds; where C falls under 0.8
    TARGET_CAPACITY the body's max_tokens is cut in proportion (not under SHORTEST) and C measured again."""
    pod = Pod("calibrate", model_dir, log, flags)
    try:
        wait_for(pod.poll_ready, 120, "the calibration runtime to be ready")

        def served_per_second(body: dict) -> float:
            request = urllib.request.Request(
                f"http://127.0.0.1:{pod.port}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )

            def send(_: int) -> None:
                urllib.request.urlopen(request, timeout=30).read()

            with ThreadPoolExecutor(2) as clients:
                list(clients.map(send, range(6)))  # warm-up
                rates = []
                for _ in range(ROUNDS):
                    started = time.monotonic()
                    list(clients.map(send, range(PER_ROUND)))
                    rates.append(PER_ROUND / (time.monotonic() - started))
            return max(rates)

        capacity = served_per_second(body)
        if capacity < 0.8 * TARGET_CAPACITY:
            tokens = max(SHORTEST, round(body["max_tokens"] * capacity / TARGET_CAPACITY))
            body = {**body, "max_tokens": tokens}
            capacity = served_per_second(body)
        return capacity, body
    finally:
        pod.stop()
