"""An adapter's traffic is its service's demand in the signals the autoscaler reads: requests for an
adapter count in the runtime's request and good counters under the base model's `model` label (the
label the operator's Prometheus queries select on), and a request waiting for its adapter's load on
first use counts in the waiting gauge at once, though no step sees it. Read through the operator's own
parser of a pod's /metrics, from a real server; the Hub is the local stand-in (hub_standin.py)."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from helpers import wait_for
from hub_standin import HubStandIn
from lora_adapters import make_adapter
from prometheus_client.parser import text_string_to_metric_families
from server_thread import MODEL_NAME

from goodput_operator.autoscaling.signals import parse_pod_metrics


@pytest.fixture
def hub(tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandIn]:
    running = HubStandIn().start()
    running.add("org/qvd4", make_adapter(tiny_model_dir, "qvd4", 4, ["q_proj", "v_proj", "down_proj"], seed=1))
    monkeypatch.setenv("HF_ENDPOINT", running.url)
    monkeypatch.setenv("GOODPUT_LORA_CACHE", str(tmp_path / "lora-cache"))
    yield running
    running.stop()


def scrape(url: str) -> str:
    return httpx.get(f"{url}/metrics", timeout=10).text


def test_adapter_requests_count_as_the_services_arrivals_and_a_load_wait_as_its_queue(make_server, hub):
    server = make_server(lora_source="hf://org", max_lora_rank=8, slo_ttft=30.0, slo_tpot=5.0)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    before = parse_pod_metrics(scrape(server.url))
    assert before.requests == 0 and before.waiting == 0

    hub.delay = 1.5  # each answer of the Hub: the first-use load takes seconds
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        jobs = [pool.submit(client.completions.create, model="qvd4", prompt="hi", max_tokens=3) for _ in range(2)]
        # both requests wait for the one load: queued demand before any step has run them
        loading = wait_for(
            lambda: (s := parse_pod_metrics(scrape(server.url))).waiting == 2 and s, 30, "2 waiting", every=0.2
        )
        assert loading.running == 0 and loading.requests == 0
        assert all(len(job.result(timeout=120).choices[0].text) >= 0 for job in jobs)
    hub.delay = 0.0
    client.completions.create(model="qvd4", prompt="again", max_tokens=3)  # loaded: straight to the queue

    text = scrape(server.url)
    after = parse_pod_metrics(text)
    assert after.waiting == 0
    assert after.requests == 3 and after.good == 3  # every adapter request arrived and met the loose SLO
    # the series the operator's Prometheus queries select (model="<served name>") hold them
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = [s for s in families["goodput_requests"].samples if s.name == "goodput_requests_total"]
    assert {s.labels["model"] for s in requests} == {MODEL_NAME}
    assert sum(s.value for s in requests) == 3
