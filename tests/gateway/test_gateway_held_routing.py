"""Routing by what each replica holds, against real runtime processes behind a real gateway process.

- A runtime's ``POST /kv/digests`` names a prompt's blocks exactly as the runtime keys them: after
  the prompt is served, every digest it gave is in the runtime's own ``/kv/events`` snapshot, for a
  chat prompt (through the chat template) and a plain one; a request generation would refuse is
  refused alike (a 400 naming the field).
- Three runtimes of the tiny model behind a gateway: A holds prefix P on its device; B holds P and
  Q in its offload tier only (evicted by other prompts); C holds neither. P's continuation goes to A
  (device beats offload), Q's to B (offload beats nothing), and a new prompt is left to the ring.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request
from pathlib import Path

from gateway_helpers import Started, metric, post_json, wait_ready

from goodput_contract import metrics as names

BLOCKS = 48
FLAGS = ("--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", str(BLOCKS * 4 * 512))
WORDS = ["river", "stone", "cloud", "lamp", "orchard", "harbor", "violet", "engine", "quiet", "signal"]


def text(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def snapshot(url: str) -> dict[str, set[str]]:
    with urllib.request.urlopen(f"{url}/kv/events", timeout=30) as response:
        return {tier: set(blocks) for tier, blocks in json.loads(response.readline())["tiers"].items()}


def digests(url: str, body: dict, api: str | None = None) -> dict:
    status, _, answer = post_json(f"{url}/kv/digests" + (f"?api={api}" if api else ""), body)
    assert status == 200, answer
    return answer


def served(url: str) -> float:
    return metric(url, names.REQUESTS)


def test_the_runtime_names_a_prompts_blocks_as_it_keys_them(tiny_model_dir, tmp_path):
    with Started() as started:
        pod = started.replica("digests", tiny_model_dir, tmp_path, *FLAGS)
        wait_ready(pod)
        url = f"http://127.0.0.1:{pod.port}"
        chat = {
            "model": "tiny",
            "messages": [{"role": "system", "content": text(1, 16)}, {"role": "user", "content": "hi"}],
        }
        plain = {"model": "tiny", "prompt": text(2, 16)}
        for body, path in ((chat, "/v1/chat/completions"), (plain, "/v1/completions")):
            named = digests(url, body)
            assert named["block_size"] == 4 and len(named["digests"]) == named["num_tokens"] // 4 > 3
            status, _, answer = post_json(url + path, {**body, "max_tokens": 2, "temperature": 0})
            assert status == 200, answer
            assert answer["usage"]["prompt_tokens"] == named["num_tokens"]
            assert set(named["digests"]) <= snapshot(url)["device"]
        # the same prompt through the other API is another token sequence: other digests
        assert digests(url, {"model": "tiny", "prompt": text(1, 16)})["digests"] != digests(url, chat)["digests"]
        assert digests(url, {"model": "tiny", "prompt": "a"})["digests"] == []
        status, _, answer = post_json(f"{url}/kv/digests", {"model": "tiny", "prompt": 5})
        assert status == 400 and answer["error"]["param"] == "prompt", answer
        status, _, answer = post_json(f"{url}/kv/digests", {"model": "other", "prompt": "x"})
        assert status == 400 and answer["error"]["param"] == "model", answer
        status, _, answer = post_json(f"{url}/kv/digests?api=embeddings", plain)
        assert status == 400 and answer["error"]["param"] == "api", answer


def wait_until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (found := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return found


def test_requests_go_to_the_replica_holding_their_prefix_device_then_offload_then_none(tiny_model_dir, tmp_path):
    with Started() as started:
        a = started.replica("a", tiny_model_dir, tmp_path, *FLAGS)
        b = started.replica("b", tiny_model_dir, tmp_path, *FLAGS, "--kv-offload-bytes", str(1024 * 1024))
        c = started.replica("c", tiny_model_dir, tmp_path, *FLAGS)
        wait_ready(a, b, c)
        urls = [f"http://127.0.0.1:{p.port}" for p in (a, b, c)]
        ua, ub, uc = urls
        p_prompt, q_prompt = text(11, 12), text(12, 12)

        def complete(url: str, prompt: str) -> None:
            status, _, answer = post_json(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1})
            assert status == 200, answer

        complete(ua, p_prompt)
        complete(ub, p_prompt)
        complete(ub, q_prompt)
        p_blocks = digests(ua, {"model": "tiny", "prompt": p_prompt})["digests"]
        q_blocks = digests(ub, {"model": "tiny", "prompt": q_prompt})["digests"]
        filler = iter(range(100, 200))

        def b_holds_both_offloaded_only() -> bool:
            held = snapshot(ub)
            if set(p_blocks + q_blocks) <= held["offload"] and not set(p_blocks + q_blocks) & held["device"]:
                return True
            complete(ub, text(next(filler), 12))  # other prompts push P and Q out of B's device cache
            return False

        wait_until(b_holds_both_offloaded_only, 120, "P and Q evicted into B's offload tier")
        assert set(p_blocks) <= snapshot(ua)["device"]

        g = started.gateway(
            tmp_path / "no-kubeconfig",
            tmp_path / "gateway.log",
            "--static-model",
            "tiny=" + ",".join(urls),
            "--scrape-seconds",
            "0.3",
            "--shutdown-delay",
            "0",
            "--shutdown-grace",
            "2",
        )

        def index_synced() -> bool:
            held = [snapshot(u) for u in urls]
            return all(
                g.metric("goodput_gateway_kv_index_blocks", tier=tier) == sum(len(h[tier]) for h in held)
                for tier in ("device", "offload")
            )

        wait_until(index_synced, 60, "the gateway's index to hold what the runtimes hold")

        def ask(prompt: str) -> dict[str, float]:
            before = {u: served(u) for u in urls}
            status, _, answer = post_json(
                f"{g.url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 1}
            )
            assert status == 200, answer
            return {u: served(u) - before[u] for u in urls}

        def decisions(kind: str) -> float:
            return g.metric(names.GATEWAY_ROUTING_DECISIONS, decision=kind)

        assert ask(p_prompt + " and more") == {ua: 1, ub: 0, uc: 0}  # device beats the offload tier
        assert decisions("held_device") == 1
        assert ask(q_prompt + " and more") == {ua: 0, ub: 1, uc: 0}  # the offload tier beats nothing
        assert decisions("held_offload") == 1
        assert sum(ask(text(77, 12)).values()) == 1  # held nowhere: the ring decides
        assert g.metric("goodput_gateway_held_lookups_total", result="miss") == 1
        assert g.metric("goodput_gateway_held_lookups_total", result="hit") == 2
        assert decisions("affinity") == 1
        assert "Traceback" not in g.log()


def test_held_routing_off_is_the_ring(tiny_model_dir, tmp_path: Path):
    with Started() as started:
        pods = [started.replica(n, tiny_model_dir, tmp_path, *FLAGS) for n in ("r1", "r2")]
        wait_ready(*pods)
        urls = [f"http://127.0.0.1:{p.port}" for p in pods]
        g = started.gateway(
            tmp_path / "no-kubeconfig",
            tmp_path / "gateway-off.log",
            "--static-model",
            "tiny=" + ",".join(urls),
            "--held-routing",
            "off",
            "--shutdown-delay",
            "0",
        )
        for i in range(3):
            status, _, answer = post_json(
                f"{g.url}/v1/completions", {"model": "tiny", "prompt": text(i, 8), "max_tokens": 1}
            )
            assert status == 200, answer
        assert sum(g.metric("goodput_gateway_held_lookups_total", result=r) for r in ("hit", "miss", "stale")) == 0
        assert g.metric(names.GATEWAY_ROUTING_DECISIONS, decision="affinity") == 3
