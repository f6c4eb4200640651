"""GET /kv/events from a real runtime process: a subscriber that applies the snapshot and the
stored/removed events holds exactly the blocks the runtime holds per tier, after a burst of stores
and evictions into the offload tier, after reconnecting midway, and after the runtime restarts.

The tiny random-weight model, a KV cache of 48 blocks of 4 tokens and an offload tier of 256 KiB:
the burst's prompts overflow the device, so blocks move to the tier and out of it.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

FLAGS = ("--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", str(48 * 4 * 512))


class Subscriber:
    """Reads /kv/events on a thread and keeps the blocks held per tier, checking sequence numbers."""

    def __init__(self, url: str) -> None:
        self.held: dict[str, set[str]] = {}
        self.seq = -1
        self.instance = ""
        self.lines = 0
        self.gaps = 0
        self.lock = threading.Lock()
        self.response = urllib.request.urlopen(f"{url}/kv/events?heartbeat=0.2", timeout=30)
        assert self.response.headers["Content-Type"].startswith("application/x-ndjson")
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for line in self.response:
                self.apply(json.loads(line))
        except (OSError, ValueError, AttributeError):
            pass  # closed (http.client reports a response closed mid-read as an AttributeError)

    def apply(self, event: dict) -> None:
        with self.lock:
            self.lines += 1
            if event["type"] == "snapshot":
                self.held = {tier: set(blocks) for tier, blocks in event["tiers"].items()}
                self.instance = event["instance"]
            elif event["type"] in ("stored", "removed"):
                if event["first_seq"] != self.seq + 1:
                    self.gaps += 1
                blocks = self.held[event["tier"]]
                if event["type"] == "stored":
                    blocks.update(event["blocks"])
                else:
                    blocks.difference_update(event["blocks"])
            self.seq = event["seq"]

    def close(self) -> None:
        self.response.close()

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {tier: len(blocks) for tier, blocks in self.held.items()}


def snapshot(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/kv/events", timeout=30) as response:
        return json.loads(response.readline())


def debug_state(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/debug/state", timeout=30) as response:
        return json.loads(response.read())


def burst(url: str, seed: int, n: int = 16) -> None:
    rng = random.Random(seed)
    words = ["river", "stone", "cloud", "lamp", "orchard", "harbor", "violet", "engine", "quiet", "signal"]
    shared = " ".join(rng.choice(words) for _ in range(8))  # ~28 tokens

    def ask(i: int) -> None:
        tail = " ".join(rng.choice(words) for _ in range(2 + i % 7))
        body = {"model": "tiny", "prompt": f"{shared} {tail}" if i % 2 else tail, "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, range(n)))


def converged(url: str, subscriber: Subscriber, timeout: float = 20.0) -> dict:
    """Wait (bounded) until the subscriber's blocks equal a fresh snapshot's and /debug/state's counts."""
    deadline = time.monotonic() + timeout
    while True:
        fresh = snapshot(url)
        want = {tier: set(blocks) for tier, blocks in fresh["tiers"].items()}
        with subscriber.lock:
            got = {tier: set(blocks) for tier, blocks in subscriber.held.items()}
        counts = debug_state(url)["kv_prefix_blocks"]
        if got == want and counts == {tier: len(b) for tier, b in want.items()}:
            return fresh
        assert time.monotonic() < deadline, (counts, {t: len(b) for t, b in got.items()})
        time.sleep(0.1)


def test_a_subscriber_holds_what_the_runtime_holds_through_reconnects_and_restarts(runtime, tmp_path):
    flags = (*FLAGS, "--kv-offload-bytes", str(256 * 1024), "--kv-offload-dir", str(tmp_path / "tier"))
    server = runtime(*flags)
    server.wait_for_log(r"Ready: serving", timeout=120)
    try:
        urllib.request.urlopen(f"{server.url}/kv/events?heartbeat=0", timeout=10)
    except urllib.error.HTTPError as e:
        assert e.code == 400
        assert "heartbeat" in e.read().decode()
    else:
        raise AssertionError("heartbeat=0 was accepted")
    first = Subscriber(server.url)
    burst(server.url, 0)
    first.close()  # the consumer goes away midway ...
    burst(server.url, 1)
    second = Subscriber(server.url)  # ... and comes back: a snapshot, then events
    burst(server.url, 2)
    fresh = converged(server.url, second)
    state = debug_state(server.url)
    assert state["kv_offload"]["stored_blocks"] > 0  # the burst evicted blocks into the tier
    assert fresh["tiers"]["offload"] and fresh["tiers"]["device"]
    assert second.gaps == 0
    assert fresh["block_size"] == 4
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as response:
        exposition = response.read().decode()
    offloaded = re.search(
        r'^goodput_kv_offload_bytes_total\{direction="offload",model="tiny"\} (\S+)$', exposition, re.M
    )
    assert offloaded and float(offloaded[1]) > 0, exposition
    assert re.search(r'^goodput_kv_tier_blocks\{model="tiny",tier="offload"\} [1-9]', exposition, re.M), exposition

    server.close()  # the runtime restarts: a new instance, none of the old blocks
    restarted = runtime(*flags)
    restarted.wait_for_log(r"Ready: serving", timeout=120)
    third = Subscriber(restarted.url)
    burst(restarted.url, 3, n=6)
    again = converged(restarted.url, third)
    assert again["instance"] != fresh["instance"]
    assert third.instance == again["instance"]
    third.close()
    second.close()
