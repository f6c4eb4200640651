"""Soak: a bounded run of mixed traffic on the real model, then a look for leaks.

    python -m bench.soak --duration 600

One server (``python -m goodput_runtime``, SmolLM2-135M-Instruct unless --model-dir) gets
--workers clients at once for --duration seconds, each sending in turn:

- stream: a streamed chat completion read to its end;
- cancel: a streamed chat completion dropped after its first chunks (the client hangs up);
- disconnect: a whole completion whose client gives up before the answer (a read timeout);
- bad: a malformed or invalid request (bad JSON, a negative max_tokens, an unknown model), answered 4xx;
- n: a chat completion with n = 3 choices.

The first --warmup share of the run is warm-up. At its end and again after the run, once the
server is idle, the script reads the server's RSS (/proc), and from ``GET /debug/state`` its
asyncio tasks, open files, free KV blocks and requests in flight. It passes when RSS grew less
than --max-rss-growth after warm-up, every KV block is free, no task or file descriptor is left
over, nothing is in flight, no request got a 5xx, and /health answers 200.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from bench.serve import write_json
from bench.server_process import start_server

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
MODEL = "soak"
KINDS = ("stream", "cancel", "disconnect", "bad", "n")
PROMPTS = (
    "Name three colours.",
    "What is the capital of France?",
    "Count from one to ten.",
    "Write a haiku about the sea.",
    "Explain what a cache is in one sentence.",
)


def default_model_dir() -> str:
    from goodput_runtime.tools import smollm2

    return str(smollm2.prepared_dir(ROOT / ".cache" / "smollm2"))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic, warm-up included")
    p.add_argument("--warmup", type=float, default=0.2, help="share of --duration that is warm-up")
    p.add_argument("--workers", type=int, default=4, help="clients at once")
    p.add_argument("--threads", type=int, default=2, help="the server's CPU threads")
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", type=Path, default=None)
    return p


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def get_json(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, None


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 24, **extra}


async def one(session: aiohttp.ClientSession, base: str, kind: str, rng: random.Random) -> str:
    """Send one request of `kind`; the outcome as a short label ("ok", "429", "5xx", ...)."""
    url = f"{base}/v1/chat/completions"
    prompt = rng.choice(PROMPTS)
    if kind == "stream":
        async with session.post(url, json=chat(prompt, stream=True)) as r:
            if r.status != 200:
                return str(r.status)
            body = await r.read()
            return "ok" if body.rstrip().endswith(b"data: [DONE]") else "truncated"
    if kind == "cancel":
        async with session.post(url, json=chat(prompt, stream=True, max_tokens=200)) as r:
            if r.status != 200:
                return str(r.status)
            chunks = 0
            async for _ in r.content:
                chunks += 1
                if chunks >= 3:
                    break
            r.close()  # hang up mid-stream
            return "ok"
    if kind == "disconnect":
        try:
            async with session.post(
                url, json=chat(prompt, max_tokens=200), timeout=aiohttp.ClientTimeout(total=rng.uniform(0.05, 0.5))
            ) as r:
                await r.read()
                return "ok" if r.status == 200 else str(r.status)
        except asyncio.TimeoutError:
            return "ok"  # gave up before the answer, as intended
    if kind == "bad":
        choice = rng.randrange(3)
        if choice == 0:
            r_ctx = session.post(
                url, data=b'{"model": "soak", "messages": [', headers={"Content-Type": "application/json"}
            )
        elif choice == 1:
            r_ctx = session.post(url, json=chat(prompt, max_tokens=-1))
        else:
            r_ctx = session.post(url, json={**chat(prompt), "model": "no-such-model"})
        async with r_ctx as r:
            await r.read()
            return "ok" if 400 <= r.status < 500 else str(r.status)
    async with session.post(url, json=chat(prompt, n=3)) as r:
        body = await r.json()
        return "ok" if r.status == 200 and len(body["choices"]) == 3 else str(r.status)


async def traffic(base: str, seconds: float, workers: int, seed: int, outcomes: Counter) -> None:
    deadline = time.monotonic() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:

        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            turn = index
            while time.monotonic() < deadline:
                kind = KINDS[turn % len(KINDS)]  # in turn, so even a short run sends every kind
                turn += 1
                try:
                    label = await one(session, base, kind, rng)
                except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                    label = type(err).__name__
                outcomes[f"{kind}:{label}"] += 1

        await asyncio.gather(*(worker(i) for i in range(workers)))


def idle_state(base: str, timeout: float = 60.0) -> dict[str, Any]:
    """/debug/state once nothing is in flight and every KV block is free (or the timeout passes)."""
    deadline = time.monotonic() + timeout
    while True:
        _, state = get_json(f"{base}/debug/state")
        idle = state["requests_in_flight"] == 0 and state["kv_blocks_free"] == state["kv_blocks_total"]
        if idle or time.monotonic() > deadline:
            time.sleep(1.0)  # let closed connections' handlers and sockets go
            return get_json(f"{base}/debug/state")[1]
        time.sleep(0.2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = args.model_dir or default_model_dir()
    outcomes: Counter = Counter()
    warm_s = args.duration * args.warmup
    server_args = ["--max-model-len", "1024", "--kv-cache-memory", "256Mi", "--max-num-seqs", "16"]
    with start_server(model_dir, MODEL, args.threads, server_args, RESULTS / "logs") as server:
        base = server.base_url
        print(f"warm-up: {warm_s:.0f} s of mixed traffic ...", flush=True)
        asyncio.run(traffic(base, warm_s, args.workers, args.seed, outcomes))
        before = idle_state(base)
        rss_before = rss_bytes(server.pid)
        print(f"  after warm-up: RSS {rss_before / 2**20:.1f} MiB, {before}", flush=True)
        print(f"soak: {args.duration - warm_s:.0f} s ...", flush=True)
        started = time.monotonic()
        asyncio.run(traffic(base, args.duration - warm_s, args.workers, args.seed + 1, outcomes))
        soak_s = time.monotonic() - started
        after = idle_state(base)
        rss_after = rss_bytes(server.pid)
        health, _ = get_json(f"{base}/health")
        print(f"  after the soak: RSS {rss_after / 2**20:.1f} MiB, {after}", flush=True)
    growth = (rss_after - rss_before) / rss_before
    server_errors = {k: v for k, v in outcomes.items() if k.split(":")[1].startswith("5")}
    checks = {
        "rss_growth_under_limit": growth < args.max_rss_growth,
        "kv_blocks_all_free": after["kv_blocks_free"] == after["kv_blocks_total"],
        "no_task_leaked": after["asyncio_tasks"] <= before["asyncio_tasks"],
        "no_fd_leaked": after["open_files"] <= before["open_files"],
        "nothing_in_flight": after["requests_in_flight"] == 0 and after["engine_streams"] == 0,
        "no_5xx": not server_errors,
        "health_200": health == 200,
    }
    return {
        "kind": "soak",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "model_dir": model_dir,
        "soak_s": soak_s,
        "requests": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "rss_before_mib": rss_before / 2**20,
        "rss_after_mib": rss_after / 2**20,
        "rss_growth": growth,
        "state_before": before,
        "state_after": after,
        "health": health,
        "checks": checks,
        "passed": all(checks.values()),
    }


def render(r: dict[str, Any]) -> str:
    b, a = r["state_before"], r["state_after"]
    lines = [
        f"{r['requests']} requests over {r['config']['duration']:.0f} s (warm-up included)",
        "outcomes: " + ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()),
        f"{'measure':<26}{'after warm-up':>15}{'after soak':>15}",
        f"{'RSS (MiB)':<26}{r['rss_before_mib']:>15.1f}{r['rss_after_mib']:>15.1f}"
        f"   growth {r['rss_growth'] * 100:+.2f} %",
    ]
    for key in (
        "asyncio_tasks",
        "open_files",
        "kv_blocks_free",
        "kv_blocks_total",
        "requests_in_flight",
        "engine_streams",
    ):
        lines.append(f"{key:<26}{b[key]:>15}{a[key]:>15}")
    lines.append(f"/health {r['health']}")
    lines += [f"  {'PASS' if ok else 'FAIL'}  {name}" for name, ok in r["checks"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    result = run(args)
    path = write_json(args.output or RESULTS / f"soak-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json", result)
    print(render(result))
    print(f"\nwrote {path}")
    return result


if __name__ == "__main__":
    main()
