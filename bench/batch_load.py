"""The measurement of bench.batch_priority: the online request shape, one streamed request's TTFT and TPOT,
the replica's closed-loop capacity, a batch created through the gateway's API, and one round of online
Poisson load with or without that batch running beside it."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import time

import aiohttp

WORDS = (
    "river",
    "market",
    "engine",
    "garden",
    "winter",
    "signal",
    "planet",
    "library",
    "thunder",
    "canvas",
    "harbor",
    "circuit",
    "meadow",
    "lantern",
    "glacier",
    "orchard",
    "compass",
    "velvet",
    "falcon",
    "quartz",
)


def question(rng: random.Random) -> str:
    return "Write one sentence about " + " ".join(rng.choice(WORDS) for _ in range(12)) + "."


def chat_body(text: str, max_tokens: int, stream: bool) -> dict:
    return {
        "model": "smollm2",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        **({"stream": True} if stream else {}),
    }


def first_text(raw: bytes) -> bool:
    """Whether an event carries generated text (the first event only names the role, with empty content)."""
    choices = json.loads(raw[len(b"data: ") :]).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def one_online(
    session: aiohttp.ClientSession, url: str, text: str, max_tokens: int
) -> tuple[float, float | None, bool]:
    """(TTFT in seconds, TPOT in seconds, success) of one streamed chat request. TPOT is the time from
    the first text to the end of the stream over the tokens after the first (ignore_eos: every
    request generates max_tokens), as the runtime's TPOT histogram counts it; None below 2 tokens."""
    started = time.perf_counter()
    ttft = None
    try:
        async with session.post(url + "/v1/chat/completions", json=chat_body(text, max_tokens, True)) as r:
            if r.status != 200:
                await r.read()
                return time.perf_counter() - started, None, False
            async for raw in r.content:
                if ttft is None and raw.startswith(b"data: {") and first_text(raw):
                    ttft = time.perf_counter() - started
        if ttft is None:
            return time.perf_counter() - started, None, False
        tpot = (time.perf_counter() - started - ttft) / (max_tokens - 1) if max_tokens > 1 else None
        return ttft, tpot, True
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return time.perf_counter() - started, None, False


async def capacity(url: str, max_tokens: int, seconds: float, concurrency: int, warmup: float) -> float:
    """Online requests/s the replica completes with `concurrency` clients in a closed loop, counted
    over `seconds` after `warmup` seconds of the same load."""
    rng = random.Random(7)
    finished: list[float] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        started = time.perf_counter()
        end = started + warmup + seconds

        async def client() -> None:
            while time.perf_counter() < end:
                if (await one_online(session, url, question(rng), max_tokens))[2]:
                    finished.append(time.perf_counter())

        await asyncio.gather(*(client() for _ in range(concurrency)))
    counted = [t for t in finished if started + warmup <= t < end]
    return len(counted) / seconds


async def create_batch(session: aiohttp.ClientSession, url: str, lines: int, max_tokens: int, seed: int) -> str:
    rng = random.Random(1000 + seed)
    data = "".join(
        json.dumps(
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": chat_body(question(rng), max_tokens, False),
            }
        )
        + "\n"
        for i in range(lines)
    )
    form = aiohttp.FormData()
    form.add_field("purpose", "batch")
    form.add_field("file", io.BytesIO(data.encode()), filename="batch.jsonl")
    async with session.post(url + "/v1/files", data=form) as r:
        file_id = (await r.json())["id"]
    async with session.post(
        url + "/v1/batches",
        json={"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ) as r:
        return str((await r.json())["id"])


async def batch_state(session: aiohttp.ClientSession, url: str, batch_id: str) -> dict:
    async with session.get(f"{url}/v1/batches/{batch_id}") as r:
        return dict(await r.json())


async def runtime_gauge(session: aiohttp.ClientSession, runtime_url: str, name: str) -> float | None:
    async with session.get(runtime_url + "/metrics") as r:
        values = [
            float(line.rsplit(" ", 1)[1]) for line in (await r.text()).splitlines() if line.startswith(name + "{")
        ]
    return values[0] if values else None


def percentile(values: list[float], q: float) -> float | None:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))] if ordered else None


async def run_round(
    url: str, runtime_url: str, args: argparse.Namespace, rate: float, with_batch: bool, seed: int
) -> dict:
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= args.duration:
            break
        arrivals.append((t, question(rng)))
    online: list[tuple[float, float, float | None, bool]] = []  # (start offset, ttft, tpot, ok)
    # (offset, lines completed, the gateway's AIMD limit, the runtime's batch cap, batch sequences running)
    batch_timeline: list[tuple[float, int, float, float | None, float | None]] = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        batch_id = None
        if with_batch:
            batch_id = await create_batch(session, url, args.batch_lines, args.max_tokens, seed)
            while (await batch_state(session, url, batch_id))["status"] == "validating":
                await asyncio.sleep(0.2)
            await asyncio.sleep(args.warmup)  # the dispatcher's concurrency settles before measuring
        started = time.perf_counter()

        async def send(offset: float, text: str) -> None:
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            ttft, tpot, ok = await one_online(session, url, text, args.max_tokens)
            online.append((offset, ttft, tpot, ok))

        async def watch() -> None:
            while batch_id and time.perf_counter() - started < args.duration:
                state = await batch_state(session, url, batch_id)
                async with session.get(url + "/metrics") as r:
                    limit = sum(
                        float(line.rsplit(" ", 1)[1])
                        for line in (await r.text()).splitlines()
                        if line.startswith("goodput_batch_concurrency_limit{")
                    )
                cap = await runtime_gauge(session, runtime_url, "goodput_batch_running_cap")
                running = await runtime_gauge(session, runtime_url, "goodput_batch_running")
                batch_timeline.append(
                    (time.perf_counter() - started, state["request_counts"]["completed"], limit, cap, running)
                )
                await asyncio.sleep(1.0)

        await asyncio.gather(watch(), *(send(o, q) for o, q in arrivals))
        wall = time.perf_counter() - started
        if batch_id:
            async with session.post(f"{url}/v1/batches/{batch_id}/cancel") as r:
                await r.read()
            while (await batch_state(session, url, batch_id))["status"] != "cancelled":
                await asyncio.sleep(0.5)
    ttfts = [x[1] for x in online if x[3]]
    tpots = [x[2] for x in online if x[3] and x[2] is not None]
    ttft_met = [x for x in online if x[3] and x[1] <= args.slo_ttft]
    good = sum(1 for x in ttft_met if x[2] is None or x[2] <= args.slo_tpot)
    batch_rps = 0.0
    if len(batch_timeline) > 1:
        first, last = batch_timeline[0], batch_timeline[-1]
        batch_rps = (last[1] - first[1]) / max(1e-9, last[0] - first[0])
    caps = [x[3] for x in batch_timeline if x[3] is not None]
    return {
        "with_batch": with_batch,
        "online_requests": len(online),
        "online_rate_rps": len(online) / wall,
        "attainment": good / max(1, len(online)),
        "ttft_attainment": len(ttft_met) / max(1, len(online)),
        "ttft_p50_s": percentile(ttfts, 0.5),
        "ttft_p90_s": percentile(ttfts, 0.9),
        "tpot_p50_s": percentile(tpots, 0.5),
        "tpot_p90_s": percentile(tpots, 0.9),
        "batch_rps": batch_rps,
        "batch_cap_mean": statistics.fmean(caps) if caps else None,
        "online": online,
        "batch_timeline": batch_timeline,
    }
