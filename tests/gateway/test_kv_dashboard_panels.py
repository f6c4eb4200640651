"""The dashboard's KV row returns data from a run that exercises it: two runtime processes (one with an
offload tier) behind a gateway routing by what they hold, scraped by a real Prometheus.

B holds prompts P and Q in its offload tier only (evicted from its device cache), A holds P on its
device: P's continuation goes to A (held_device), Q's to B (held_offload), which loads Q's blocks back
from its tier. Every query of the row (held decisions and lookups, the index's size and staleness,
hits by tier, the offload tier's traffic, occupancy, failures and bytes resident) then has data.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
from gateway_helpers import Started, metric, post_json, wait_ready
from harness import wait_for
from prometheus_process import PROMETHEUS, Prometheus, dashboard_queries

from goodput_contract import metrics as names

pytestmark = pytest.mark.skipif(not PROMETHEUS, reason="prometheus missing (make prometheus installs it)")

FLAGS = ("--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", str(48 * 4 * 512))
WORDS = ["river", "stone", "cloud", "lamp", "orchard", "harbor", "violet", "engine", "quiet", "signal"]
KV_ROW = (
    "held_",
    "kv_index",
    "goodput_kv_offload_",
    "goodput_kv_tier_",
    "prefix_cache_hits",
)  # what the row's queries read


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def held(url: str) -> dict[str, set[str]]:
    with urllib.request.urlopen(f"{url}/kv/events", timeout=30) as response:
        return {tier: set(blocks) for tier, blocks in json.loads(response.readline())["tiers"].items()}


def complete(url: str, prompt: str) -> None:
    status, _, answer = post_json(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
    assert status == 200, answer


def test_every_kv_panel_of_the_dashboard_returns_data(tiny_model_dir, tmp_path):
    with Started() as started:
        a = started.replica("kv-a", tiny_model_dir, tmp_path, *FLAGS)
        b = started.replica("kv-b", tiny_model_dir, tmp_path, *FLAGS, "--kv-offload-bytes", str(1 << 20))
        wait_ready(a, b)
        ua, ub = (f"http://127.0.0.1:{p.port}" for p in (a, b))
        g = started.gateway(
            tmp_path / "no-kubeconfig",
            tmp_path / "gateway.log",
            "--static-model",
            f"tiny={ua},{ub}",
            "--scrape-seconds",
            "0.3",
            "--shutdown-delay",
            "0",
        )
        prometheus = started.stops(Prometheus(tmp_path, "kv-panels", None, (int(g.url.rsplit(":", 1)[1]),)))
        prometheus.set_targets([(a.name, a.port), (b.name, b.port)])
        begun = prometheus.now()
        wait_for(lambda: prometheus.query_range("up", begun, time.time()), 30, "Prometheus's first scrapes")

        p_prompt, q_prompt = text(31, 12), text(32, 12)
        complete(ua, p_prompt)
        complete(ub, p_prompt)
        complete(ub, q_prompt)
        p_blocks = post_json(f"{ua}/kv/digests", {"model": "tiny", "prompt": p_prompt})[2]["digests"]
        q_blocks = post_json(f"{ub}/kv/digests", {"model": "tiny", "prompt": q_prompt})[2]["digests"]
        filler = iter(range(100, 200))

        def b_holds_both_offloaded_only() -> bool:
            tiers = held(ub)
            blocks = set(p_blocks + q_blocks)
            if blocks <= tiers["offload"] and not blocks & tiers["device"]:
                return True
            complete(ub, text(next(filler), 12))  # other prompts push P and Q out of B's device cache
            return False

        wait_for(b_holds_both_offloaded_only, 120, "P and Q evicted into B's offload tier")

        def index_synced() -> bool:
            tiers = [held(u) for u in (ua, ub)]
            return all(
                g.metric("goodput_gateway_kv_index_blocks", tier=tier) == sum(len(h[tier]) for h in tiers)
                for tier in ("device", "offload")
            )

        wait_for(index_synced, 60, "the gateway's index to hold what the runtimes hold")
        reloaded = metric(ub, names.KV_OFFLOAD_HIT_TOKENS)
        complete(g.url, p_prompt + " and more")
        complete(g.url, q_prompt + " and more")
        assert g.metric(names.GATEWAY_ROUTING_DECISIONS, decision="held_device") == 1
        assert g.metric(names.GATEWAY_ROUTING_DECISIONS, decision="held_offload") == 1
        assert metric(ub, names.KV_OFFLOAD_HIT_TOKENS) > reloaded  # Q's blocks came back from B's tier

        values = {"$namespace": ".*", "$model": "tiny", "$service": "tiny", "$__rate_interval": "10s"}
        queries = dashboard_queries(values, lambda expr: any(series in expr for series in KV_ROW))
        assert len(queries) == 14
        empty = prometheus.panels_without_data(queries, begun, wait=40)
        assert not empty, f"no data for: {empty}"
