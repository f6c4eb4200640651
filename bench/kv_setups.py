"""The KV tiers' four setups (issue #35): the hash ring, + the offload tier, + held routing, + peer pulls.

`python -m goodput_runtime` replicas of SmolLM2-135M-Instruct or `--model DIR` (CPU, one thread each) behind one
`python -m goodput_gateway` per phase (replicas given with --static-model, no cluster). The workload is
prefix groups: `--groups` system prompts of about `--prompt-words` words each (~1,000 SmolLM2 tokens),
short user turns, streamed chat completions sent open loop (Poisson arrivals at `--rate` per second,
each request sent at its time whatever is still running). Each replica's device KV cache
(`--kv-cache-memory`) holds about two of the prompts, so the groups overflow the fleet's device KV;
the offload tier (`--kv-offload-bytes` per replica) holds all of them.

Setups, each run with its own system prompts (no run inherits another's cache):

1. `ring`: policy prefix, --held-routing off, replicas without an offload tier;
2. `ring_offload`: the same gateway, replicas with the offload tier;
3. `held_offload`: held-aware routing (the replicas' /kv/events and /kv/digests), --peer-pulls off;
4. `held_pulls`: held-aware routing with peer pulls (replicas of --kv-transfer-role both); after the
   first phase one more replica joins (a new gateway over all of them, the new replica holding none
   of the run's prompts: what the autoscaler adds).

A run sends each system prompt once (steady state), then `--requests` requests ("before"), then
`--requests` more ("after"; over the larger fleet in setup 4). Runs alternate between setups over
`--rounds` rounds. Reported per setup and phase: the prompt tokens found cached (device, offload
tier, pulled from a peer) over all prompt tokens, from the answers' usage and the runtimes' counters;
TTFT p50 and p90 as the clients saw them; output tokens/s; goodput (requests per second with TTFT
within `--slo-ttft`).

    python -m bench.kv_setups [--rounds 2] [--requests 12] [--rate 0.4] [--out bench/results/kv_setups.json]
    python -m bench.kv_setups --model .cache/test-models/tiny-llama-* --prompt-words 275 \
        --kv-cache-memory 1200Ki --kv-offload-bytes 6Mi ...     # the random-weight tiny model
    python -m bench.kv_setups --summarize bench/results/kv_setups.json   # the table of a (cut) run

The machine is shared: only ratios within one run count.
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
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import aiohttp

from bench.gateway_routing import QUESTIONS, WORDS
from bench.server_process import REPO, gateway_process, machine, start_server

SETUPS = ("ring", "ring_offload", "held_offload", "held_pulls")
GATEWAY = {
    "ring": ("--static-policy", "prefix", "--held-routing", "off"),
    "ring_offload": ("--static-policy", "prefix", "--held-routing", "off"),
    "held_offload": ("--static-policy", "prefix", "--held-routing", "on", "--peer-pulls", "off"),
    "held_pulls": ("--static-policy", "prefix", "--held-routing", "on", "--peer-pulls", "on"),
}
BLOCK = 16
SERVED = "kvbench"


def system_prompt(rng: random.Random, index: int, words: int) -> str:
    return f"Assistant profile {index}-{rng.randrange(10**9)}. Rules: " + " ".join(
        rng.choice(WORDS) for _ in range(words)
    )


async def one_chat(session: aiohttp.ClientSession, url: str, system: str, question: str, max_tokens: int) -> dict:
    """One streamed chat completion: its TTFT, status, prompt and cached tokens, output tokens."""
    body = {
        "model": SERVED,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
    }
    started = time.perf_counter()
    first: float | None = None
    usage: dict = {}
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            await r.read()
            return {"ttft": time.perf_counter() - started, "status": r.status}
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = time.perf_counter()
            usage = chunk.get("usage") or usage
    return {
        "ttft": (first or time.perf_counter()) - started,
        "status": 200,
        "prompt": usage.get("prompt_tokens", 0),
        "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        "output": usage.get("completion_tokens", 0),
    }


async def tiers(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, float]:
    """Tokens loaded from the offload tier and blocks pulled from peers, summed over `urls`."""
    out = {"offload": 0.0, "peer_blocks": 0.0, "peer_failures": 0.0}
    for url in urls:
        async with session.get(url + "/metrics") as r:
            for line in (await r.text()).splitlines():
                value = line.rsplit(" ", 1)[-1]
                if line.startswith("goodput_kv_offload_hit_tokens_total"):
                    out["offload"] += float(value)
                elif line.startswith("goodput_kv_transfer_blocks_total{") and 'role="peer"' in line:
                    out["peer_blocks"] += float(value)
                elif line.startswith("goodput_kv_transfers_total{") and 'role="peer"' in line and "failure" in line:
                    out["peer_failures"] += float(value)
    return out


async def phase(
    gateway: str, replicas: list[str], prompts: list[str], args: argparse.Namespace, seed: int, warm: bool
) -> dict:
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900)) as session:
        if warm:  # steady state: each system prompt seen once, wherever the setup sent it
            for p in prompts:
                await one_chat(session, gateway, p, QUESTIONS[0], 1)
        await asyncio.sleep(1.0)  # the gateway's index hears the last stores
        before = await tiers(session, replicas)
        started = time.perf_counter()
        at, tasks = 0.0, []
        for _ in range(args.requests):
            at += rng.expovariate(args.rate)
            delay = started + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            system, question = rng.choice(prompts), rng.choice(QUESTIONS)
            tasks.append(asyncio.create_task(one_chat(session, gateway, system, question, args.max_tokens)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
        after = await tiers(session, replicas)
    ok = [x for x in results if x["status"] == 200]
    ttfts = sorted(x["ttft"] for x in ok) or [float("nan")]
    prompt = max(1, sum(x["prompt"] for x in ok))
    cached = sum(x["cached"] for x in ok)
    offload = after["offload"] - before["offload"]
    peer = (after["peer_blocks"] - before["peer_blocks"]) * BLOCK
    good = sum(1 for x in ok if x["ttft"] <= args.slo_ttft)
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall,
        "hit_rate": cached / prompt,
        "hit_rate_by_tier": {
            "device": max(0.0, cached - offload - peer) / prompt,
            "offload": offload / prompt,
            "peer": peer / prompt,
        },
        "peer_fallbacks": after["peer_failures"] - before["peer_failures"],
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": ttfts[int(0.9 * (len(ttfts) - 1))],
        "output_tokens_per_s": sum(x["output"] for x in ok) / wall,
        "goodput_rps": good / wall,
        "attainment": good / len(results),
    }


def run(setup: str, fleets: dict[str, list[str]], log_dir: Path, args: argparse.Namespace, r: int) -> dict:
    rng = random.Random(1000 * r + SETUPS.index(setup))
    prompts = [system_prompt(rng, i, args.prompt_words) for i in range(args.groups)]
    fleet = fleets["plain" if setup == "ring" else "tiers"]
    first, later = fleet[:2], (fleet if setup == "held_pulls" else fleet[:2])
    flags = (*GATEWAY[setup], "--scrape-seconds", "0.5", "--log-level", "warning")
    flags += ("--shutdown-delay", "0", "--shutdown-grace", "2")  # a phase's requests are all answered
    out: dict = {"setup": setup, "round": r}
    with gateway_process(
        f"{SERVED}=" + ",".join(first), log_dir, setup, *flags, ready_seconds=180, stop_seconds=60
    ) as (url, _):
        out["before"] = asyncio.run(phase(url, first, prompts, args, seed=100 * r + 1, warm=True))
        if later == first:
            out["after"] = asyncio.run(phase(url, first, prompts, args, seed=100 * r + 2, warm=False))
    if later != first:  # one more replica joins: a gateway over all three, the new one holding nothing
        with gateway_process(
            f"{SERVED}=" + ",".join(later), log_dir, setup + "-3", *flags, ready_seconds=180, stop_seconds=60
        ) as (
            url,
            _,
        ):
            out["after"] = asyncio.run(phase(url, later, prompts, args, seed=100 * r + 2, warm=False))
    for name in ("before", "after"):
        p = out[name]
        t = p["hit_rate_by_tier"]
        print(
            f"  round {r} {setup:>12} {name:>6}: hit {p['hit_rate']:.2f} (device {t['device']:.2f}, offload "
            f"{t['offload']:.2f}, peer {t['peer']:.2f}), TTFT p50 {p['ttft_p50_s']:.2f} s p90 {p['ttft_p90_s']:.2f} s, "
            f"{p['output_tokens_per_s']:.1f} tok/s, goodput {p['goodput_rps']:.2f} req/s, errors {p['errors']}",
            flush=True,
        )
    return out


def start_fleets(stack: ExitStack, model: str, args: argparse.Namespace, log_dir: Path) -> dict[str, list[str]]:
    """Two replicas without an offload tier; three with one and --kv-transfer-role both (started at once)."""
    base = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048"]
    tiers = [*base, "--kv-offload-bytes", args.kv_offload_bytes]
    tiers += ["--kv-transfer-role", "both", "--kv-transfer-host", "127.0.0.1", "--kv-transfer-port", "0"]
    plans = [("plain", base)] * 2 + [("tiers", tiers)] * 3
    managers = [
        start_server(model, SERVED, 1, flags, log_dir / f"kv-setups-{i}", ready_timeout_s=900)
        for i, (_, flags) in enumerate(plans)
    ]
    servers, failure = [], None
    with ThreadPoolExecutor(len(managers)) as pool:
        futures = [pool.submit(m.__enter__) for m in managers]
        for m, future in zip(managers, futures, strict=True):
            try:
                servers.append(future.result())
                stack.push(m.__exit__)  # each started replica is stopped, whatever else failed
            except Exception as exc:  # raised below, once every started replica is registered
                failure = exc
    if failure is not None:
        raise failure
    fleets: dict[str, list[str]] = {"plain": [], "tiers": []}
    for (kind, _), server in zip(plans, servers, strict=True):
        fleets[kind].append(server.base_url)
    return fleets


def summarize(report: dict, setups: list[str]) -> dict:
    def mean(setup: str, name: str, key: str) -> float:
        return statistics.fmean(x[name][key] for x in report["runs"] if x["setup"] == setup)

    keys = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "goodput_rps")
    out: dict = {}
    for s in setups:
        out[s] = {}
        for n in ("before", "after"):
            out[s][n] = {k: mean(s, n, k) for k in keys}
            by_tier = [x[n]["hit_rate_by_tier"] for x in report["runs"] if x["setup"] == s]
            out[s][n]["hit_rate_by_tier"] = {t: statistics.fmean(b[t] for b in by_tier) for t in by_tier[0]}
    return out


def table(report: dict, setups: list[str], slo_ttft: float) -> dict:
    """The summary of `report`'s runs (those present: a cut run counts what it measured), printed."""
    setups = [s for s in setups if any(x["setup"] == s for x in report["runs"])]
    report["summary"] = summary = summarize(report, setups)
    print(
        "\n| setup | phase | hit rate (device / offload / peer) | TTFT p50 (s) | TTFT p90 (s) | output tok/s | "
        f"goodput (req/s, TTFT ≤ {slo_ttft:g} s) |\n|---|---|---|---|---|---|---|"
    )
    for s in setups:
        for n in ("before", "after"):
            m, t = summary[s][n], summary[s][n]["hit_rate_by_tier"]
            label = n + (" (3 replicas, one new)" if s == "held_pulls" and n == "after" else "")
            print(
                f"| {s} | {label} | {m['hit_rate']:.2f} ({t['device']:.2f} / {t['offload']:.2f} / {t['peer']:.2f}) | "
                f"{m['ttft_p50_s']:.2f} | {m['ttft_p90_s']:.2f} | {m['output_tokens_per_s']:.1f} | "
                f"{m['goodput_rps']:.2f} |"
            )
    if "held_pulls" in summary:
        b, a = summary["held_pulls"]["before"], summary["held_pulls"]["after"]
        print(f"held_pulls: TTFT p90 after the new replica / before = {a['ttft_p90_s'] / b['ttft_p90_s']:.2f}")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2 (SmolLM2-135M-Instruct), or a model directory")
    p.add_argument("--rounds", type=int, default=2, help="runs per setup, alternating")
    p.add_argument("--setups", default=",".join(SETUPS))
    p.add_argument("--groups", type=int, default=6, help="prefix groups (system prompts) per run")
    p.add_argument("--prompt-words", type=int, default=750, help="about 1,000 SmolLM2 tokens")
    p.add_argument("--requests", type=int, default=12, help="per phase")
    p.add_argument("--rate", type=float, default=0.4, help="arrivals per second (Poisson)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    p.add_argument("--kv-cache-memory", default="100Mi", help="per replica: about two of the system prompts")
    p.add_argument("--kv-offload-bytes", default="400Mi", help="per replica: every system prompt")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv_setups.json")
    p.add_argument("--summarize", type=Path, help="print the table of a run's JSON (a cut run's included) and exit")
    args = p.parse_args()
    setups = args.setups.split(",")
    if args.summarize:
        cut: dict = json.loads(args.summarize.read_text())
        cut.setdefault("machine", {"cut_run": True, "load_at_summary": os.getloadavg(), "cpus": os.cpu_count()})
        table(cut, setups, float(cut["args"]["slo_ttft"]))
        args.summarize.write_text(json.dumps(cut, indent=2))
        return 0

    if args.model == "smollm2":
        from goodput_runtime.tools import smollm2

        cache = REPO / ".cache" / "smollm2"
        model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    else:
        model = args.model
    log_dir = REPO / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with ExitStack() as stack:
        fleets = start_fleets(stack, model, args, log_dir)
        report["start_s"] = time.monotonic() - started
        print(f"replicas ready after {report['start_s']:.0f} s", flush=True)
        for r in range(args.rounds):
            for setup in setups if r % 2 == 0 else setups[::-1]:
                report["runs"].append(run(setup, fleets, log_dir, args, r))
                args.out.write_text(json.dumps(report, indent=2))  # a partial run keeps what it measured
    report["machine"] = machine(load_before, os.getloadavg())
    table(report, setups, args.slo_ttft)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
