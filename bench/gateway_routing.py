"""The gateway's routing, measured: prefix affinity against random spreading over 3 real replicas.

Three `python -m goodput_runtime` replicas of SmolLM2-135M-Instruct (CPU, one thread each)
sit behind one `python -m goodput_gateway` (replicas given with --static-model, no cluster).
The workload shares prefixes: 8 system prompts of about 1,000 tokens each and many short
user turns, sent by concurrent streaming clients. Rounds alternate between `prefix` and
`random` routing, each round with its own 8 system prompts so no round inherits another's
cache, and each system prompt sent once before measuring (steady state, not the first
sight of a prompt). Per policy: the prefix-cache hit rate from the runtimes' own counters (tokens found
cached / tokens looked up), p50/p90 time to first token, and goodput (requests per second
meeting the TTFT SLO) as the clients saw them.

Then what the gateway itself costs: p50 added latency (the same small request sent directly
to a runtime and through the gateway, alternately) and how many concurrent streams one
gateway process holds (against a trivial upstream that streams one event every 0.5 s).

    python -m bench.gateway_routing [--rounds 2] [--requests 48] [--out bench/results/gateway_routing.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path

import aiohttp

from bench.server_process import REPO, free_port, gateway_process, start_server

WORDS = [
    "account",
    "billing",
    "customer",
    "invoice",
    "payment",
    "refund",
    "order",
    "shipment",
    "policy",
    "warranty",
    "product",
    "service",
    "support",
    "request",
    "ticket",
    "escalation",
    "priority",
    "response",
    "resolution",
    "schedule",
    "delivery",
    "address",
    "contract",
    "renewal",
    "subscription",
    "discount",
    "region",
    "warehouse",
    "inventory",
    "carrier",
    "tracking",
    "return",
    "exchange",
    "credit",
    "balance",
    "statement",
    "tax",
    "compliance",
    "audit",
    "record",
    "history",
    "note",
    "summary",
    "detail",
    "update",
    "status",
    "review",
]
QUESTIONS = [
    "What is my balance?",
    "Where is my order?",
    "Can I get a refund?",
    "How do I change my address?",
    "When does my contract renew?",
    "Why was I charged twice?",
    "Is this covered by warranty?",
    "How long does delivery take?",
    "Can you escalate this?",
    "What is the return policy?",
]


def policy_gateway(static: str, log_dir: Path, policy: str) -> AbstractContextManager[tuple[str, int]]:
    return gateway_process(static, log_dir, policy, "--static-policy", policy, "--log-level", "warning")


def system_prompt(rng: random.Random, index: int) -> str:
    """About 1,000 SmolLM2 tokens of instructions; each prompt differs from its first word."""
    words = [rng.choice(WORDS) for _ in range(1000)]
    return f"Assistant profile {index}-{rng.randrange(10**9)}. Rules: " + " ".join(words)


async def counters(session: aiohttp.ClientSession, urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        async with session.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                if line.startswith("goodput_prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("goodput_prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits, queries


async def one_chat(
    session: aiohttp.ClientSession, url: str, system: str, question: str, max_tokens: int
) -> tuple[float, float, int]:
    """(TTFT, end-to-end seconds, tokens) of one streamed chat completion."""
    body = {
        "model": "smollm2",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    started = time.perf_counter()
    first, tokens = None, 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    tokens += 1
                    first = first or time.perf_counter()
    end = time.perf_counter()
    return (first or end) - started, end - started, tokens


async def run_round(url: str, replicas: list[str], prompts: list[str], args: argparse.Namespace, seed: int) -> dict:
    rng = random.Random(seed)
    work = [(rng.choice(prompts), rng.choice(QUESTIONS)) for _ in range(args.requests)]
    results: list[tuple[float, float, int]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        # steady state: each system prompt has been seen once (wherever the policy sent it) before measuring
        await asyncio.gather(*(one_chat(session, url, system, QUESTIONS[0], 1) for system in prompts))
        hits0, queries0 = await counters(session, replicas)
        started = time.perf_counter()

        async def client() -> None:
            while work:
                system, question = work.pop()
                results.append(await one_chat(session, url, system, question, args.max_tokens))

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
        wall = time.perf_counter() - started
        hits1, queries1 = await counters(session, replicas)
    ttfts = sorted(r[0] for r in results)
    good = sum(1 for r in results if r[0] <= args.slo_ttft)
    return {
        "requests": len(results),
        "wall_s": wall,
        "hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "goodput_rps": good / wall,
        "attainment": good / len(results),
    }


async def added_latency(gateway: str, direct: str, pairs: int) -> dict:
    """p50 of the same /tokenize request sent directly and through the gateway, alternately."""
    body = {"model": "smollm2", "prompt": "How far is the moon?"}
    times: dict[str, list[float]] = {"direct": [], "gateway": []}
    async with aiohttp.ClientSession() as session:
        for i in range(pairs + 10):
            for name, url in (("direct", direct), ("gateway", gateway)):
                started = time.perf_counter()
                async with session.post(url + "/tokenize", json=body) as r:
                    await r.read()
                if i >= 10:  # the first few warm the connections
                    times[name].append(time.perf_counter() - started)
    direct_p50, gateway_p50 = statistics.median(times["direct"]), statistics.median(times["gateway"])
    return {
        "pairs": pairs,
        "direct_p50_ms": direct_p50 * 1e3,
        "gateway_p50_ms": gateway_p50 * 1e3,
        "added_p50_ms": (gateway_p50 - direct_p50) * 1e3,
    }


# --- concurrent streams against a trivial upstream ------------------------------------------

EVENTS, EVERY = 20, 0.5


async def trivial_upstream(port: int) -> None:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(EVENTS):
            await response.write(f'data: {{"i": {i}}}\n\n'.encode())
            await asyncio.sleep(EVERY)
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", stream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
    await asyncio.Event().wait()


def rss_mib(pid: int) -> float:
    match = re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text())
    return int(match[1]) / 1024 if match else 0.0


async def concurrent_streams(gateway: str, pid: int, streams: int) -> dict:
    done = 0
    peak = 0.0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def one() -> None:
            nonlocal done
            events = 0
            async with session.post(gateway + "/v1/completions", json={"model": "trivial", "prompt": "x"}) as r:
                async for line in r.content:
                    if line.startswith(b"data: "):
                        events += 1
            done += events == EVENTS + 1

        async def watch() -> None:
            nonlocal peak
            while True:
                await asyncio.sleep(1.0)
                async with session.get(gateway + "/metrics") as r:
                    for line in (await r.text()).splitlines():
                        if line.startswith("goodput_gateway_requests_in_flight{"):
                            peak = max(peak, float(line.rsplit(" ", 1)[1]))

        watcher = asyncio.create_task(watch())
        started = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(streams)), return_exceptions=True)
        wall = time.perf_counter() - started
        watcher.cancel()
    errors = [repr(r) for r in results if isinstance(r, BaseException)]
    return {
        "streams": streams,
        "completed": done,
        "peak_in_flight": peak,
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "wall_s": wall,
        "ideal_wall_s": EVENTS * EVERY,
        "gateway_rss_mib": rss_mib(pid),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2, help="rounds per policy, alternating")
    p.add_argument("--requests", type=int, default=48, help="requests per round")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument(
        "--kv-cache-memory",
        default="160Mi",
        help="per replica: room for about 3 of the 8 system prompts, as a cache smaller than the working set is",
    )
    p.add_argument("--streams", type=int, default=600)
    p.add_argument("--trivial-upstream", type=int, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "gateway_routing.json")
    args = p.parse_args()
    if args.trivial_upstream:
        asyncio.run(trivial_upstream(args.trivial_upstream))
        return 0

    from goodput_runtime.tools import smollm2

    cache = REPO / ".cache" / "smollm2"
    model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    log_dir = REPO / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "machine": f"{os.cpu_count()} CPUs, shared",
        "args": {k: str(v) for k, v in vars(args).items()},
        "rounds": [],
    }
    with ExitStack() as stack:
        replicas = [
            stack.enter_context(
                start_server(
                    model, "smollm2", 1, ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048"], log_dir
                )
            ).base_url
            for _ in range(3)
        ]
        static = "smollm2=" + ",".join(replicas)
        rng = random.Random(1)
        for r in range(args.rounds):
            for policy in ("prefix", "random"):
                prompts = [system_prompt(rng, i) for i in range(8)]
                with policy_gateway(static, log_dir, policy) as (url, _pid):
                    result = asyncio.run(run_round(url, replicas, prompts, args, seed=r))
                result.update(policy=policy, round=r)
                report["rounds"].append(result)
                print(
                    f"  round {r} {policy:>6}: hit rate {result['hit_rate']:.2f}, TTFT p50 "
                    f"{result['ttft_p50_s']:.3f} s p90 {result['ttft_p90_s']:.3f} s, goodput "
                    f"{result['goodput_rps']:.2f} req/s",
                    flush=True,
                )
        with policy_gateway(static, log_dir, "prefix") as (url, _pid):
            report["added_latency"] = asyncio.run(added_latency(url, replicas[0], 300))
    upstream_port = free_port()
    upstream = subprocess.Popen(
        [sys.executable, "-m", "bench.gateway_routing", "--trivial-upstream", str(upstream_port)], cwd=REPO
    )
    try:
        while not _listening(upstream_port):
            time.sleep(0.1)
        with policy_gateway(f"trivial=http://127.0.0.1:{upstream_port}", log_dir, "random") as (url, pid):
            report["concurrent_streams"] = asyncio.run(concurrent_streams(url, pid, args.streams))
    finally:
        upstream.terminate()
        upstream.wait(10)

    def mean(policy: str, key: str) -> float:
        return statistics.fmean(x[key] for x in report["rounds"] if x["policy"] == policy)

    summary = {
        policy: {k: mean(policy, k) for k in ("hit_rate", "ttft_p50_s", "ttft_p90_s", "goodput_rps", "attainment")}
        for policy in ("prefix", "random")
    }
    summary["ratio"] = {
        "hit_rate": summary["prefix"]["hit_rate"] / max(1e-9, summary["random"]["hit_rate"]),
        "ttft_p90": summary["prefix"]["ttft_p90_s"] / summary["random"]["ttft_p90_s"],
        "goodput": summary["prefix"]["goodput_rps"] / max(1e-9, summary["random"]["goodput_rps"]),
    }
    report["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"\n| policy | prefix-cache hit rate | TTFT p50 (s) | TTFT p90 (s) | goodput (req/s, TTFT ≤ "
        f"{args.slo_ttft:g} s) |\n|---|---|---|---|---|"
    )
    for policy in ("prefix", "random"):
        s = summary[policy]
        print(
            f"| {policy} | {s['hit_rate']:.2f} | {s['ttft_p50_s']:.3f} | {s['ttft_p90_s']:.3f} | "
            f"{s['goodput_rps']:.2f} |"
        )
    ratio = summary["ratio"]
    print(f"| prefix / random | {ratio['hit_rate']:.2f}× | | {ratio['ttft_p90']:.2f}× | {ratio['goodput']:.2f}× |")
    a, c = report["added_latency"], report["concurrent_streams"]
    print(
        f"\ngateway added p50 latency: {a['added_p50_ms']:.2f} ms (direct {a['direct_p50_ms']:.2f} ms, "
        f"through the gateway {a['gateway_p50_ms']:.2f} ms, {a['pairs']} pairs)"
    )
    print(
        f"concurrent streams: {c['completed']}/{c['streams']} completed, peak {c['peak_in_flight']:.0f} in flight, "
        f"{c['wall_s']:.1f} s for a {c['ideal_wall_s']:.0f} s stream, gateway RSS {c['gateway_rss_mib']:.0f} MiB"
    )
    print(f"wrote {args.out}")
    return 0


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


if __name__ == "__main__":
    sys.exit(main())
