"""The dashboard's peer-pull panels return data from a run that pulls: two runtime processes of
--kv-transfer-role both behind a gateway, scraped by a real Prometheus.

Replica A holds a long prompt P on its device and is kept past the load bound by two long requests on P;
P's continuation through the gateway goes to B, which holds none of it, and B pulls P's blocks from A
(as in test_gateway_peer_pull.py). Every query of the "Peer pulls" panels (the gateway's pulls and blocks
per service, the pulls made and served, blocks and bytes by role, the time a pull takes) then has data.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from gateway_helpers import Started, metric, post_json, wait_ready
from harness import wait_for
from prometheus_process import PROMETHEUS, Prometheus, dashboard_queries

from goodput_contract import metrics as names

pytestmark = pytest.mark.skipif(not PROMETHEUS, reason="prometheus missing (make prometheus installs it)")

BOTH = ("--kv-transfer-role", "both", "--kv-transfer-host", "127.0.0.1", "--kv-transfer-port", "0")
FLAGS = ("--max-model-len", "2048", "--kv-cache-memory", "8Mi", "--step-tuning", "off", *BOTH)
P = "a system prompt that one replica computed and another pulls instead of computing it again " * 6


def body(prompt: str, max_tokens: int = 8) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def device_blocks(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/kv/events", timeout=30) as response:
        return set(json.loads(response.readline())["tiers"]["device"])


def test_every_peer_pull_panel_of_the_dashboard_returns_data(tiny_model_dir, tmp_path):
    with Started() as started:
        a = started.replica("pull-a", tiny_model_dir, tmp_path, *FLAGS)
        b = started.replica("pull-b", tiny_model_dir, tmp_path, *FLAGS)
        wait_ready(a, b, timeout=600)
        ua, ub = (f"http://127.0.0.1:{p.port}" for p in (a, b))
        question = body(P + "and one more question")
        status, _, answer = post_json(f"{ua}/v1/completions", body(P, 1))  # A holds P
        assert status == 200, answer
        named = post_json(f"{ua}/kv/digests?api=completions", question)[2]["digests"]
        p_blocks = [d for d in named if d in device_blocks(ua)]
        assert len(p_blocks) >= 8

        g = started.gateway(
            tmp_path / "no-kubeconfig",
            tmp_path / "gateway.log",
            "--static-model",
            f"tiny={ua},{ub}",
            "--scrape-seconds",
            "0.2",
            "--shutdown-delay",
            "0",
            "--shutdown-grace",
            "2",
        )
        prometheus = started.stops(Prometheus(tmp_path, "peer-panels", None, (int(g.url.rsplit(":", 1)[1]),)))
        prometheus.set_targets([(a.name, a.port), (b.name, b.port)])
        begun = prometheus.now()
        wait_for(lambda: prometheus.query_range("up", begun, time.time()), 30, "Prometheus's first scrapes")
        wait_for(
            lambda: g.metric("goodput_gateway_kv_index_blocks", tier="device") >= len(p_blocks),
            60,
            "the gateway's index to hold A's blocks",
        )

        # A past the load bound: two long requests on P through the gateway (held routing sends both to A)
        busy = [
            threading.Thread(target=post_json, args=(f"{g.url}/v1/completions", body(P + word, 1200), None, 300))
            for word in ("busy", "work")
        ]
        for t in busy:
            t.start()
        wait_for(lambda: metric(ua, names.REQUESTS_RUNNING) >= 2, 60, "A busy")
        status, _, answer = post_json(f"{g.url}/v1/completions", question)
        assert status == 200, answer
        assert g.metric("goodput_gateway_peer_pulls_total") == 1
        assert metric(ub, "goodput_kv_transfers_total", role="peer", outcome="success") == 1
        assert metric(ua, "goodput_kv_transfers_total", role="holder", outcome="success") == 1
        for t in busy:
            t.join(300)

        values = {"$namespace": ".*", "$model": "tiny", "$service": "tiny", "$__rate_interval": "10s"}
        queries = [q for q in dashboard_queries(values, lambda expr: True) if q[0].startswith("Peer pulls: ")]
        assert len(queries) == 8, queries
        empty = prometheus.panels_without_data(queries, begun, wait=40)
        assert not empty, f"no data for: {empty}"
        assert "Traceback" not in g.log()
