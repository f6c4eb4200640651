"""Routing by what each replica holds, against the hash ring and random spreading, including scale-out.

Four `python -m goodput_runtime` replicas of SmolLM2-135M-Instruct (CPU, one thread each) and one
`python -m goodput_gateway` per measured phase (replicas given with --static-model, no cluster). The
workload is prefix groups: `--groups` system prompts of about `--prompt-words` words each (about 1.3
SmolLM2 tokens per word), short user turns, streamed chat completions sent open loop (Poisson
arrivals at `--rate` per second, each request sent at its time whatever is still running).

Each run is one routing setup, with its own system prompts (no run inherits another's cache):

- `random`: the gateway's random policy (spreading without affinity, as round-robin does);
- `ring`: policy prefix with --held-routing off (today's hash ring of the prompt's leading characters);
- `held`: policy prefix with held-aware routing (the replicas' /kv/events and /kv/digests).

A run sends each system prompt once (steady state), measures `--requests` requests on three
replicas ("before"), then starts a gateway over all four, the fourth holding none of the run's
prompts (a replica the autoscaler just added), and measures `--requests` more ("after"). Runs
alternate between setups over `--rounds` rounds. Reported per setup and phase: the prefix-cache hit
rate from the runtimes' own counters (tokens found cached / tokens looked up), TTFT p50 and p90 as
the clients saw them, and goodput (requests per second with TTFT within `--slo-ttft`).

    python -m bench.kv_routing [--rounds 1] [--requests 40] [--rate 1.5] [--out bench/results/kv_routing.json]

The machine has two cores shared by the four replicas and the gateway: only ratios within one run count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from bench.gateway_routing import QUESTIONS, WORDS, counters
from bench.server_process import REPO, gateway_process, machine, start_server

SETUPS = {
    "random": ("--static-policy", "random", "--held-routing", "off"),
    "ring": ("--static-policy", "prefix", "--held-routing", "off"),
    "held": ("--static-policy", "prefix", "--held-routing", "on"),
}
DECISIONS = ("affinity", "overflow", "random", "held_device", "held_offload")


def system_prompt(rng: random.Random, index: int, words: int) -> str:
    return f"Assistant profile {index}-{rng.randrange(10**9)}. Rules: " + " ".join(
        rng.choice(WORDS) for _ in range(words)
    )


async def one_chat(
    session: aiohttp.ClientSession, url: str, system: str, question: str, max_tokens: int
) -> tuple[float, int]:
    """(TTFT, status) of one streamed chat completion."""
    body = {
        "model": "smollm2",
        "stream": True,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    started = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return time.perf_counter() - started, r.status
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
    return (first or time.perf_counter()) - started, 200


async def decisions(session: aiohttp.ClientSession, gateway: str) -> dict[str, float]:
    out = dict.fromkeys(DECISIONS, 0.0)
    async with session.get(gateway + "/metrics") as r:
        for line in (await r.text()).splitlines():
            if line.startswith("goodput_gateway_routing_decisions_total{"):
                for kind in DECISIONS:
                    if f'decision="{kind}"' in line:
                        out[kind] += float(line.rsplit(" ", 1)[1])
    return out


async def phase(
    gateway: str, replicas: list[str], prompts: list[str], args: argparse.Namespace, seed: int, warm: bool
) -> dict:
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        if warm:  # steady state: each system prompt seen once, wherever the setup sent it
            for i in range(0, len(prompts), 3):
                await asyncio.gather(*(one_chat(session, gateway, p, QUESTIONS[0], 1) for p in prompts[i : i + 3]))
        await asyncio.sleep(1.0)  # the gateway's index hears the last stores
        hits0, queries0 = await counters(session, replicas)
        before = await decisions(session, gateway)
        started = time.perf_counter()
        at = 0.0
        tasks = []
        for _ in range(args.requests):
            at += rng.expovariate(args.rate)
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            system, question = rng.choice(prompts), rng.choice(QUESTIONS)
            tasks.append(asyncio.create_task(one_chat(session, gateway, system, question, args.max_tokens)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
        hits1, queries1 = await counters(session, replicas)
        after = await decisions(session, gateway)
    ttfts = sorted(t for t, status in results if status == 200)
    good = sum(1 for t, status in results if status == 200 and t <= args.slo_ttft)
    return {
        "requests": len(results),
        "errors": sum(1 for _, status in results if status != 200),
        "wall_s": wall,
        "hit_rate": (hits1 - hits0) / max(1.0, queries1 - queries0),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "goodput_rps": good / wall,
        "attainment": good / len(results),
        "decisions": {k: after[k] - before[k] for k in DECISIONS if after[k] - before[k]},
    }


def run(setup: str, replicas: list[str], log_dir: Path, args: argparse.Namespace, rng: random.Random, r: int) -> dict:
    prompts = [system_prompt(rng, i, args.prompt_words) for i in range(args.groups)]
    flags = (*SETUPS[setup], "--scrape-seconds", "0.5", "--log-level", "warning")
    out = {"setup": setup, "round": r}
    with gateway_process("smollm2=" + ",".join(replicas[:3]), log_dir, f"{setup}-3", *flags) as (url, _):
        out["before"] = asyncio.run(phase(url, replicas[:3], prompts, args, seed=100 * r + 1, warm=True))
    with gateway_process("smollm2=" + ",".join(replicas), log_dir, f"{setup}-4", *flags) as (url, _):
        out["after"] = asyncio.run(phase(url, replicas, prompts, args, seed=100 * r + 2, warm=False))
    for name in ("before", "after"):
        p = out[name]
        print(
            f"  round {r} {setup:>6} {name:>6}: hit rate {p['hit_rate']:.2f}, TTFT p50 {p['ttft_p50_s']:.2f} s "
            f"p90 {p['ttft_p90_s']:.2f} s, goodput {p['goodput_rps']:.2f} req/s, decisions {p['decisions']}",
            flush=True,
        )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1, help="runs per setup, alternating")
    p.add_argument("--setups", default="random,ring,held")
    p.add_argument("--groups", type=int, default=12, help="prefix groups (system prompts) per run")
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--requests", type=int, default=40, help="per phase")
    p.add_argument("--rate", type=float, default=1.5, help="arrivals per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--slo-ttft", type=float, default=1.0, help="seconds")
    p.add_argument("--kv-cache-memory", default="96Mi", help="per replica: about 6 of the system prompts")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv_routing.json")
    args = p.parse_args()
    setups = args.setups.split(",")

    from goodput_runtime.tools import smollm2

    cache = REPO / ".cache" / "smollm2"
    model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    log_dir = REPO / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    flags = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "1024"]
    with ExitStack() as stack:
        replicas = [stack.enter_context(start_server(model, "smollm2", 1, flags, log_dir)).base_url for _ in range(4)]
        rng = random.Random(7)
        for r in range(args.rounds):
            order = setups if r % 2 == 0 else setups[::-1]
            for setup in order:
                report["runs"].append(run(setup, replicas, log_dir, args, rng, r))
    report["machine"] = machine(load_before, os.getloadavg())

    def mean(setup: str, name: str, key: str) -> float:
        return statistics.fmean(x[name][key] for x in report["runs"] if x["setup"] == setup)

    keys = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "goodput_rps")
    summary = {s: {n: {k: mean(s, n, k) for k in keys} for n in ("before", "after")} for s in setups}
    report["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"\n| setup | replicas | hit rate | TTFT p50 (s) | TTFT p90 (s) | goodput (req/s, TTFT ≤ {args.slo_ttft:g} s) |"
        "\n|---|---|---|---|---|---|"
    )
    for s in setups:
        for n, count in (("before", 3), ("after", 4)):
            m = summary[s][n]
            print(
                f"| {s} | {count}{' (one new)' if count == 4 else ''} | {m['hit_rate']:.2f} | {m['ttft_p50_s']:.2f} | "
                f"{m['ttft_p90_s']:.2f} | {m['goodput_rps']:.2f} |"
            )
    for s in setups:
        b, a = summary[s]["before"], summary[s]["after"]
        print(f"{s}: TTFT p90 after scale-out / before = {a['ttft_p90_s'] / b['ttft_p90_s']:.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
