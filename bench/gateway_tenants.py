"""The gateway's tenant layers: what they add to a request, how many streams one process holds with them
on, and fairness between two tenants on one saturated service.

  python -m bench.gateway_tenants [--model DIR] [--pairs 300] [--streams 600] [--seconds 20]

1. Added latency: p50 of the same small request sent directly to a runtime and through gateways with
   tenants on (a table, limits checked, tokens metered, SLOs judged) and the fair-turn cap on, for
   `/tokenize`, a one-token chat completion, and the same through `/v1/responses` and `/v1/messages`
   (translation included); and `/tokenize` through a gateway with every layer off.
2. Streams: `--streams` concurrent streams through one gateway process with the layers on, to a trivial
   upstream (bench.gateway_routing's: 20 events 0.5 s apart).
3. Fairness: a light tenant at `--light-rate` req/s (default C/5, C the capped service's measured
   capacity) alone, then beside a heavy tenant at 10x its rate (2C: saturated), on one runtime behind a
   gateway with `--max-in-flight-per-replica 1`. Goodput: the light tenant's requests per second within 4x its
   median latency alone; each tenant's mean wait for a turn.
Without --model the tiny random-weight model of the tests is made (its speed, not its words, matters).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.gateway_routing import concurrent_streams
from bench.server_process import REPO, free_port, gateway_process, start_server

TABLE = """
tenants:
  anonymous: {keys: [], requestsPerMinute: 10000000, tokensPerMinute: 1000000000, concurrency: 100000}
  light: {keys: [sk-light]}
  heavy: {keys: [sk-heavy]}
"""
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "How far is the moon?"}], "max_tokens": 1}


async def added_latency(direct: str, layered: str, plain: str, pairs: int) -> dict:
    calls = {
        "tokenize direct": (direct, "/tokenize", {"model": "tiny", "prompt": "How far is the moon?"}),
        "tokenize plain gateway": (plain, "/tokenize", {"model": "tiny", "prompt": "How far is the moon?"}),
        "tokenize layered gateway": (layered, "/tokenize", {"model": "tiny", "prompt": "How far is the moon?"}),
        "chat direct": (direct, "/v1/chat/completions", CHAT),
        "chat layered gateway": (layered, "/v1/chat/completions", CHAT),
        "responses layered gateway": (
            layered,
            "/v1/responses",
            {"model": "tiny", "input": "How far is the moon?", "max_output_tokens": 1, "store": False},
        ),
        "messages layered gateway": (
            layered,
            "/v1/messages",
            {"model": "tiny", "messages": CHAT["messages"], "max_tokens": 1},
        ),
    }
    times: dict[str, list[float]] = {name: [] for name in calls}
    async with aiohttp.ClientSession() as session:
        for i in range(pairs + 10):
            for name, (url, path, body) in calls.items():
                started = time.perf_counter()
                async with session.post(url + path, json=body) as r:
                    await r.read()
                    assert r.status == 200, (name, r.status, await r.text())
                if i >= 10:
                    times[name].append(time.perf_counter() - started)
    p50 = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    return {
        "pairs": pairs,
        "p50_ms": p50,
        "added_p50_ms": {
            "tokenize, every layer off": p50["tokenize plain gateway"] - p50["tokenize direct"],
            "tokenize, layers on": p50["tokenize layered gateway"] - p50["tokenize direct"],
            "chat completion, layers on": p50["chat layered gateway"] - p50["chat direct"],
            "responses (translated), layers on": p50["responses layered gateway"] - p50["chat direct"],
            "messages (translated), layers on": p50["messages layered gateway"] - p50["chat direct"],
        },
    }


async def load(url: str, key: str, rate: float, seconds: float) -> list[float]:
    """Open-loop chat completions at `rate` per second; each one's latency (inf for a failure)."""
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True}
    latencies: list[float] = []

    async def one(session: aiohttp.ClientSession) -> None:
        started = time.perf_counter()
        async with session.post(
            url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as r:
            await r.read()
            latencies.append(time.perf_counter() - started if r.status == 200 else float("inf"))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        tasks = []
        start = time.perf_counter()
        n = 0
        while (at := n / rate) < seconds:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(session)))
            n += 1
        await asyncio.gather(*tasks)
    return latencies


async def queue_seconds(url: str) -> dict[str, tuple[float, float]]:
    """Each tenant's (sum, count) of goodput_gateway_tenant_queue_seconds."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as r:
        text = await r.text()
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for part, index in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("goodput_gateway_tenant_queue_seconds" + part):
                tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
                out.setdefault(tenant, [0.0, 0.0])[index] = float(line.rsplit(" ", 1)[1])
    return {t: (v[0], v[1]) for t, v in out.items()}


async def capacity(url: str, seconds: float = 5.0) -> float:
    """Requests per second the capped service completes, from two closed-loop clients."""
    body = {**CHAT, "max_tokens": 200, "ignore_eos": True}
    done: list[float] = []
    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while time.perf_counter() - started < seconds:
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    await r.read()
                done.append(time.perf_counter())

        await asyncio.gather(client(), client())
    return len(done) / (max(done) - started)


async def fairness(url: str, light_rate: float | None, seconds: float, slo: float | None) -> dict:
    measured = await capacity(url)
    light_rate = light_rate or measured / 5
    alone = await load(url, "sk-light", light_rate, seconds)
    slo = slo or 4 * statistics.median(alone)
    before = await queue_seconds(url)
    heavy_task = asyncio.create_task(load(url, "sk-heavy", 10 * light_rate, seconds + 4))
    await asyncio.sleep(2)
    shared = await load(url, "sk-light", light_rate, seconds)
    heavy = await heavy_task
    after = await queue_seconds(url)

    def mean_wait(tenant: str) -> float | None:
        s0, c0 = before.get(tenant, (0.0, 0.0))
        s1, c1 = after.get(tenant, (0.0, 0.0))
        return (s1 - s0) / (c1 - c0) if c1 > c0 else None

    def goodput(latencies: list[float], span: float) -> float:
        return sum(x <= slo for x in latencies) / span

    return {
        "capacity_rps": measured,
        "light_rate_rps": light_rate,
        "heavy_rate_rps": 10 * light_rate,
        "light_mean_queue_s": mean_wait("light"),
        "heavy_mean_queue_s": mean_wait("heavy"),
        "slo_s": slo,
        "light_alone_goodput_rps": goodput(alone, seconds),
        "light_shared_goodput_rps": goodput(shared, seconds),
        "light_ratio": goodput(shared, seconds) / max(goodput(alone, seconds), 1e-9),
        "light_alone_p50_s": statistics.median(alone),
        "light_shared_p50_s": statistics.median(shared),
        "heavy_done": sum(x != float("inf") for x in heavy),
        "heavy_sent": len(heavy),
        "heavy_p50_s": statistics.median(heavy),
        "heavy_goodput_rps": goodput(heavy, seconds + 4),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: the tests' tiny random-weight model)")
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--streams", type=int, default=600)
    p.add_argument("--light-rate", type=float, help="req/s (default: a fifth of the capped service's capacity)")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--parts", default="latency,fairness,streams", help="which parts to run, comma-separated")
    p.add_argument("--out", default="bench/results/gateway_tenants.json")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    work = Path(tempfile.mkdtemp(prefix="gateway-tenants-"))
    table = work / "tenants.yaml"
    table.write_text(TABLE)
    model = args.model
    if model is None:
        model = str(work / "tiny")
        subprocess.run([sys.executable, "-m", "goodput_runtime.tools.make_model", "--out", model], check=True, cwd=REPO)
    layers = ["--tenants-file", str(table), "--log-level", "warning"]
    uncapped = ["--max-in-flight-per-replica", "100000"]  # the gate's path taken, never a wait
    report: dict = {"machine": f"{os.cpu_count()} CPUs, shared", "args": vars(args)}
    with start_server(model, "tiny", 1, ["--max-model-len", "512"], work) as server:
        static = f"tiny={server.base_url}"
        if "latency" in parts:
            with (
                gateway_process(static, work, "layered", *layers, *uncapped) as (layered, _),
                gateway_process(static, work, "plain", "--log-level", "warning") as (plain, _),
            ):
                report["added_latency"] = asyncio.run(added_latency(server.base_url, layered, plain, args.pairs))
            print(json.dumps(report["added_latency"]["added_p50_ms"], indent=1), flush=True)
        if "fairness" in parts:
            fair = [*layers, "--max-in-flight-per-replica", "1", "--queue-seconds", "600"]
            with gateway_process(static, work, "fair", *fair) as (url, _):
                report["fair"] = asyncio.run(fairness(url, args.light_rate, args.seconds, None))
            print("fair", json.dumps(report["fair"], indent=1), flush=True)
    if "streams" in parts:
        upstream_port = free_port()
        upstream = subprocess.Popen(
            [sys.executable, "-m", "bench.gateway_routing", "--trivial-upstream", str(upstream_port)], cwd=REPO
        )
        try:
            time.sleep(2)
            trivial = f"trivial=http://127.0.0.1:{upstream_port}"
            with gateway_process(trivial, work, "streams", *layers, *uncapped) as (url, pid):
                report["concurrent_streams"] = asyncio.run(concurrent_streams(url, pid, args.streams))
        finally:
            upstream.terminate()
            upstream.wait(10)
        print("streams", json.dumps(report["concurrent_streams"], indent=1), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
