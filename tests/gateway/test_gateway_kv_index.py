"""The gateway's KV index (goodput_gateway/kv_index.py) against real runtime processes: after a burst
of stores and evictions it holds exactly what each runtime's /kv/events snapshot and /debug/state
say, including after the index reconnects midway and after a runtime restarts on the same address;
a runtime that dies leaves the index at once (its connection breaks), well within a scrape period.

Two runtimes of the tiny model, KV caches of 48 blocks of 4 tokens, one with a 256 KiB offload tier.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import aiohttp
from gateway_helpers import start_replica, wait_ready

from goodput_gateway.kv_index import KvIndex

FLAGS = ("--block-size", "4", "--max-model-len", "128", "--kv-cache-memory", str(48 * 4 * 512))
WORDS = ["river", "stone", "cloud", "lamp", "orchard", "harbor", "violet", "engine", "quiet", "signal"]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.readline())


def burst(url: str, seed: int, n: int = 12) -> None:
    rng = random.Random(seed)
    shared = " ".join(rng.choice(WORDS) for _ in range(8))

    def ask(i: int) -> None:
        tail = " ".join(rng.choice(WORDS) for _ in range(2 + i % 7))
        body = {"model": "tiny", "prompt": f"{shared} {tail}" if i % 2 else tail, "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            assert response.status == 200

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(ask, range(n)))


async def matches(index: KvIndex, url: str, timeout: float = 20.0) -> dict:
    """Wait (bounded) until the index holds what a fresh snapshot and /debug/state say `url` holds."""
    deadline = time.monotonic() + timeout
    while True:
        snapshot = await asyncio.to_thread(get_json, f"{url}/kv/events")
        counts = (await asyncio.to_thread(get_json, f"{url}/debug/state"))["kv_prefix_blocks"]
        want = {tier: set(blocks) for tier, blocks in snapshot["tiers"].items()}
        if index.held(url) == want and counts == {t: len(b) for t, b in want.items()}:
            return snapshot
        assert time.monotonic() < deadline, (url, counts, index.held(url) and index.size())
        await asyncio.sleep(0.1)


async def test_the_index_holds_what_each_runtime_holds_through_reconnects_restarts_and_deaths(tiny_model_dir, tmp_path):
    tiered = start_replica("tiered", tiny_model_dir, tmp_path, *FLAGS, "--kv-offload-bytes", str(256 * 1024))
    plain = start_replica("plain", tiny_model_dir, tmp_path, *FLAGS)
    pods = [tiered, plain]
    try:
        wait_ready(tiered, plain)
        urls = [f"http://127.0.0.1:{p.port}" for p in pods]
        async with aiohttp.ClientSession() as session:
            index = KvIndex(session, heartbeat=0.2)
            index.sync(urls)
            await asyncio.gather(*(asyncio.to_thread(burst, u, i) for i, u in enumerate(urls)))
            await index.close()  # the gateway goes away midway ...
            await asyncio.gather(*(asyncio.to_thread(burst, u, 10 + i) for i, u in enumerate(urls)))
            index = KvIndex(session, heartbeat=0.2)  # ... and comes back
            index.sync(urls)
            await asyncio.gather(*(asyncio.to_thread(burst, u, 20 + i) for i, u in enumerate(urls)))
            first = await matches(index, urls[0])
            await matches(index, urls[1])
            assert first["tiers"]["offload"], "the burst moved blocks into the offload tier"
            assert index.held(urls[1])["offload"] == set()

            # the plain runtime restarts on the same address: the index follows the new instance
            before = index.replicas[urls[1]].instance
            plain.stop()
            plain = start_replica("plain2", tiny_model_dir, tmp_path, *FLAGS, "--port", str(pods[1].port))
            pods[1] = plain
            await asyncio.to_thread(wait_ready, plain)
            await asyncio.to_thread(burst, urls[1], 30, 4)
            restarted = await matches(index, urls[1])
            assert restarted["instance"] != before
            assert index.resyncs >= 1

            # the tiered runtime dies: its entries leave the index within a heartbeat's bound
            tiered.process.kill()
            deadline = time.monotonic() + 3 * 0.2 + 1.0
            while index.held(urls[0]) is not None:
                assert time.monotonic() < deadline, "a dead replica stayed in the index"
                await asyncio.sleep(0.05)
            assert index.held(urls[1]) is not None  # the other one is unaffected
            index.sync(urls[1:])  # and discovery dropping it forgets it
            assert urls[0] not in index.replicas and urls[0] not in index.tasks
            await index.close()
    finally:
        for pod in pods:
            pod.stop()
