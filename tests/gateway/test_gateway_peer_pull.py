"""Peer pulls through the gateway, against real runtime processes (tiny model, --kv-transfer-role both).

Replica A holds a long prompt P on its device; A is then kept past the load bound by two long requests
on P (held routing sends both to A). P's continuation through the gateway goes to B, which holds none of it: the gateway
has B pull P's blocks from A. B's answer equals a fresh replica's (recomputed) token for token, B reports
the pulled tokens as cached (its prefill shrank by them), and both sides count the blocks that moved.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from gateway_helpers import Started, metric, post_json, wait_ready

from goodput_contract import metrics as names

BOTH = ("--kv-transfer-role", "both", "--kv-transfer-host", "127.0.0.1", "--kv-transfer-port", "0")
FLAGS = ("--max-model-len", "2048", "--kv-cache-memory", "8Mi", "--step-tuning", "off", *BOTH)
P = "a system prompt that one replica computed and another pulls instead of computing it again " * 6


def body(prompt: str, max_tokens: int = 8) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def snapshot(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/kv/events", timeout=30) as response:
        return set(json.loads(response.readline())["tiers"]["device"])


def wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


def cached(answer: dict) -> int:
    return (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def test_a_replica_past_the_bound_lends_its_prefix_to_the_chosen_one(tiny_model_dir, tmp_path):
    with Started() as started:
        a = started.replica("a", tiny_model_dir, tmp_path, *FLAGS)
        b = started.replica("b", tiny_model_dir, tmp_path, *FLAGS)
        fresh = started.replica("fresh", tiny_model_dir, tmp_path, *FLAGS)
        wait_ready(a, b, fresh, timeout=600)
        ua, ub, uf = (f"http://127.0.0.1:{p.port}" for p in (a, b, fresh))
        question = body(P + "and one more question")
        status, _, reference = post_json(f"{uf}/v1/completions", question)  # computed from scratch
        assert status == 200 and cached(reference) == 0
        status, _, answer = post_json(f"{ua}/v1/completions", body(P, 1))  # A holds P
        assert status == 200
        status, _, named = post_json(f"{ua}/kv/digests?api=completions", question)
        p_blocks = [d for d in named["digests"] if d in snapshot(ua)]
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
        wait_until(lambda: g.metric("goodput_gateway_kv_index_blocks", tier="device") >= len(p_blocks), 60, "index")

        # A past the load bound: two long requests on P through the gateway (held routing sends both to A)
        busy = [
            threading.Thread(target=post_json, args=(f"{g.url}/v1/completions", body(P + word, 1200), None, 300))
            for word in ("busy", "work")
        ]
        for t in busy:
            t.start()
        wait_until(lambda: metric(ua, names.REQUESTS_RUNNING) >= 2, 60, "A busy")

        status, _, answer = post_json(f"{g.url}/v1/completions", question)
        assert status == 200, answer
        assert answer["choices"][0]["text"] == reference["choices"][0]["text"]
        assert metric(ub, "goodput_kv_transfers_total", role="peer", outcome="success") == 1
        assert cached(answer) >= len(p_blocks) * 16 - 16  # B computed only the tail
        pulled = metric(ub, "goodput_kv_transfer_blocks_total", role="peer")
        assert pulled >= len(p_blocks) - 1
        assert metric(ua, "goodput_kv_transfer_blocks_total", role="holder") == pulled
        assert g.metric("goodput_gateway_peer_pulls_total") == 1
        for t in busy:
            t.join(300)
        assert "Traceback" not in g.log()
