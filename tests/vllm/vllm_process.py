"""The vLLM server of tests/vllm/test_vllm_engine.py as the operator's table starts it, a real Prometheus
scraping it as the PodMonitor says, and the module's one load run read by the autoscaler's direct source."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import stop_process, wait_for
from vllm_reading import Client, cache_config, ttft_sum

from goodput_contract.api.spec import parse
from goodput_operator import builders, engines
from goodput_operator.autoscaling.signals import History
from goodput_operator.autoscaling.sources import DirectSource, Endpoints, Reading

ROOT = Path(__file__).resolve().parents[2]
MAX_NUM_SEQS = 2
SLO_TTFT, SLO_TPOT = 1.0, 0.5
START_SECONDS = 900  # a cold start compiles the model; a warm compile cache makes it a minute or two
KV_CACHE_GIB = 1
PROMETHEUS = shutil.which("prometheus")
RULE = ROOT / "manifests" / "monitoring" / "prometheus-rule.yaml"


def spec(model_dir: Path) -> dict:
    return {
        "model": {"source": f"file://{model_dir}", "servedName": "smollm2", "maxModelLen": 1024, "dtype": "float32"},
        # --enforce-eager: no torch.compile warm-up, which takes minutes on two CPU cores
        "engine": {
            "kind": "vllm",
            "maxNumSeqs": MAX_NUM_SEQS,
            "maxBatchedTokens": 1024,
            "prefixCaching": False,
            "gpuMemoryUtilization": 0.1,
            "extraArgs": ["--enforce-eager"],
        },
        "resources": {"gpu": 0, "memory": "4Gi"},
        "slo": {"ttft": f"{SLO_TTFT:g}s", "tpot": f"{SLO_TPOT:g}s"},
    }


@functools.cache
def vllm_python() -> str:
    """The cached venv's python (built once by the script; `make test` builds it beforehand)."""
    out = subprocess.run([str(ROOT / "hack" / "vllm-venv.sh")], capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        pytest.fail(f"hack/vllm-venv.sh failed: {out.stderr[-2000:]}")
    return out.stdout.strip().splitlines()[-1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    def __init__(self, process: subprocess.Popen, url: str, log: Path, started_in: float) -> None:
        self.process, self.url, self.log, self.started_in = process, url, log, started_in

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            return response.read().decode()


def command_line(model_dir: Path, python: str, port: int) -> tuple[list[str], dict[str, str]]:
    """What the operator's pod would run, on this machine: the table's command and args and env."""
    svc = parse("chat", "ns", spec(model_dir))
    engines.validate(svc)
    engine = engines.engine_of(svc)
    args = engine.args(svc)
    args[args.index("--port") + 1] = str(port)
    args[args.index("--host") + 1] = "127.0.0.1"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for item in engine.env(svc):
        if not item["value"].startswith(engines.MODEL_CACHE_DIR):  # the pod's cache volume; here the default
            env[item["name"]] = item["value"]
    # vLLM on CPU: its KV cache size in GiB (the pod's settings come from template.env), no Hub access here
    env.update(VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return [python, *engine.command[1:], *args], env


@contextmanager
def running_vllm(model_dir: Path, workdir: Path) -> Iterator[Server]:
    python = vllm_python()
    port = free_port()
    cmd, env = command_line(model_dir, python, port)
    log = workdir / "vllm.log"
    started = time.monotonic()
    with log.open("w") as out:
        process = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"vLLM exited with {process.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        wait_for(healthy, START_SECONDS, "vLLM's /health", every=2.0, explain=lambda: log.read_text()[-3000:])
        started_in = time.monotonic() - started
        print(f"\nvLLM started in {started_in:.0f}s")
        yield Server(process, url, log, started_in)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)  # the server and the engine processes it started
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@contextmanager
def running_prometheus(server: Server, model_dir: Path, workdir: Path) -> Iterator[str]:
    """A real Prometheus scraping the vLLM server as the operator's PodMonitor says (its metric relabelings),
    with the shipped recording rules (evaluated every second instead of every 30 s)."""
    svc = parse("chat", "ns", spec(model_dir))
    relabel = [{snake(k): v for k, v in r.items()} for r in builders.metric_relabelings(svc)]
    groups = yaml.safe_load(RULE.read_text())["spec"]["groups"]
    for group in groups:
        group["interval"] = "1s"
    (workdir / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(workdir / "rules.yaml")],
        "scrape_configs": [
            {
                "job_name": "vllm",
                "metric_relabel_configs": relabel,
                "static_configs": [
                    {"targets": [server.url.removeprefix("http://")], "labels": {"namespace": "ns", "pod": "chat-0"}}
                ],
            }
        ],
    }
    (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with (workdir / "prometheus.log").open("wb") as log:
        process = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        assert process.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as response:
                return response.status == 200
        except OSError:
            return False

    try:
        wait_for(ready, 60, "Prometheus to be ready")
        wait_for(lambda: query(url, 'up{job="vllm"} == 1'), 30, "Prometheus to scrape vLLM")
        yield url
    finally:
        stop_process(process, timeout=20)


def snake(key: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in key)


def query(url: str, expr: str) -> list[dict]:
    with urllib.request.urlopen(
        f"{url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=30
    ) as response:
        return list(json.loads(response.read())["data"]["result"])


@dataclass
class Run:
    """What the module's one load run saw, from the clients and from the autoscaler's direct reading."""

    client: Client
    before: Reading
    after: Reading
    history: History
    seen: list[tuple[int, int, int, float]]
    blocks: int
    block_size: int
    tokens: int
    requests: int
    server_ttft: float  # the sum of the TTFTs vLLM itself measured for these requests


def load_run(server: Server) -> Run:
    """Eight streamed requests at once, the autoscaler's direct source reading the server all along."""
    requests, tokens = 8, 24
    prompt = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 4
    text = server.metrics()
    blocks, block_size = cache_config(text)
    ttft_before = ttft_sum(text)
    source = DirectSource(window=3600, long_window=3600)
    key, endpoints = ("ns", "chat"), Endpoints(ready=(f"{server.url}/metrics",))
    slo = (SLO_TTFT, SLO_TPOT)
    seen: list[tuple[int, int, int, float]] = []  # (client in flight, running, waiting, kv) at matching scrapes

    async def load():
        before = await source.read(key, "smollm2", endpoints, time.monotonic(), engine="vllm", slo=slo)
        client = Client(server.url)

        async def all_requests() -> None:
            await asyncio.gather(*(client.one(prompt, tokens) for _ in range(requests)))

        task = asyncio.create_task(all_requests())
        while not task.done():
            flying = client.in_flight
            reading = await source.read(key, "smollm2", endpoints, time.monotonic(), engine="vllm", slo=slo)
            if reading.signals and flying == client.in_flight and flying:
                s = reading.signals
                seen.append((flying, s.running, s.waiting, s.kv_usage))
            await asyncio.sleep(0.2)
        await task
        after = await source.read(key, "smollm2", endpoints, time.monotonic(), engine="vllm", slo=slo)
        await source.close()
        return before, after, client

    before, after, client = asyncio.run(load())
    return Run(
        client,
        before,
        after,
        source._history[key],
        seen,
        blocks,
        block_size,
        tokens,
        requests,
        ttft_sum(server.metrics()) - ttft_before,
    )
