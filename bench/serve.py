"""Load generator for any OpenAI-compatible server: streaming /v1/completions with token-id prompts.

    python -m bench.serve --base-url http://127.0.0.1:8000 --model llama-60m \\
        --tokenizer .cache/models/llama-60m --num-requests 64 --rate 4 \\
        --prompt-len 16-256 --output-len 8-256 --slo-ttft 0.5 --slo-tpot 0.05

Arrivals follow a seeded Poisson process at --rate requests/s (inf: all at t=0), optionally
capped at --concurrency requests in flight. Every latency is measured here, at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from bench.stats import RequestRecord, format_table, summarize
from bench.workload import WorkItem, WorkloadSpec, describe, make_workload, parse_range, prompt_vocabulary


def completion_payload(model: str, item: WorkItem, extra: dict | None = None) -> dict:
    return {
        "model": model,
        "prompt": item.prompt_ids,
        "max_tokens": item.max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


async def send_one(
    session: aiohttp.ClientSession, url: str, model: str, item: WorkItem, t0: float, extra: dict | None = None
) -> RequestRecord:
    start = time.perf_counter()
    record = RequestRecord(item.index, len(item.prompt_ids), item.max_tokens, start - t0)
    events = 0
    usage_tokens: int | None = None
    last = start
    pieces: list[str] = []
    try:
        async with session.post(url, json=completion_payload(model, item, extra)) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return record
            for header, attr in (
                ("x-goodput-predicted-ttft", "predicted_ttft_s"),
                ("x-goodput-predicted-tpot", "predicted_tpot_s"),
            ):
                if header in resp.headers:
                    setattr(record, attr, float(resp.headers[header]))
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"
                    return record
                now = time.perf_counter()
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for choice in chunk.get("choices") or []:
                    text = choice.get("text") or ""
                    # a closing chunk with only finish_reason carries no token
                    if not text and choice.get("finish_reason") is not None:
                        continue
                    pieces.append(text)
                    if events == 0:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    events += 1
                    last = now
        record.e2e_s = time.perf_counter() - start
        record.output_tokens = usage_tokens if usage_tokens is not None else events
        record.text = "".join(pieces)
        if events == 0 and record.output_tokens > 0:
            record.ttft_s = record.e2e_s
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def run_load(
    base_url: str,
    model: str,
    items: list[WorkItem],
    concurrency: int | None = None,
    max_duration_s: float = 1800.0,
    request_timeout_s: float = 600.0,
    warmup: int = 0,
    extra: dict | None = None,
) -> tuple[list[RequestRecord], float]:
    """Send every item at its arrival time; returns the records and the run's wall time. `extra`: more
    request fields (logprobs, n, ...), sent with every measured request."""
    url = base_url.rstrip("/") + "/v1/completions"
    limit = concurrency or len(items)
    connector = aiohttp.TCPConnector(limit=limit)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, trust_env=False) as session:
        for i in range(warmup):
            probe = WorkItem(-1, items[i % len(items)].prompt_ids[:16], 4, 0.0)
            record = await send_one(session, url, model, probe, time.perf_counter())
            if record.error:
                raise RuntimeError(f"warm-up request failed: {record.error}")
        gate = asyncio.Semaphore(limit)
        t0 = time.perf_counter()

        async def arrive(item: WorkItem) -> RequestRecord:
            delay = t0 + item.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            async with gate:
                return await send_one(session, url, model, item, t0, extra)

        tasks = [asyncio.create_task(arrive(item)) for item in items]
        await asyncio.wait(tasks, timeout=max_duration_s)
        records = []
        for item, task in zip(items, tasks, strict=True):
            if task.done():
                records.append(task.result())
            else:
                task.cancel()
                records.append(
                    RequestRecord(
                        item.index,
                        len(item.prompt_ids),
                        item.max_tokens,
                        item.arrival_s,
                        error="cut off by --max-duration",
                    )
                )
        ends = [r.start_s + r.e2e_s for r in records if r.e2e_s is not None]
        duration = max(ends) if ends else time.perf_counter() - t0
    return records, duration


def check_address(base_url: str) -> None:
    parts = urlsplit(base_url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SystemExit(f"--base-url must be http(s)://HOST:PORT, got {base_url!r}")


def default_output(kind: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    return Path(__file__).resolve().parent / "results" / f"{kind}-{stamp}.json"


def write_json(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1))
    return path


def record_dict(record: RequestRecord, keep_text: bool) -> dict:
    out = asdict(record)
    out["tpot_s"] = record.tpot_s
    if not keep_text:
        out.pop("text")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    parser.add_argument("--model", required=True, help="model name the server expects in requests")
    parser.add_argument("--tokenizer", required=True, help="model directory whose vocabulary prompts use")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", default="16-256", help="uniform range of prompt tokens, LOW-HIGH")
    parser.add_argument("--output-len", default="8-256", help="uniform range of max_tokens, LOW-HIGH")
    parser.add_argument("--rate", type=float, default=math.inf, help="Poisson req/s; inf: all at t=0")
    parser.add_argument("--concurrency", type=int, default=None, help="cap on requests in flight")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=None, help="seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="seconds")
    parser.add_argument("--warmup", type=int, default=2, help="short requests sent before the measured run")
    parser.add_argument("--max-duration", type=float, default=1800.0, help="seconds; later requests fail")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--output", type=Path, default=None, help="JSON file (default bench/results/)")
    parser.add_argument("--keep-text", action="store_true", help="store generated text in the JSON")
    parser.add_argument("--logprobs", type=int, default=None, help="ask for this many top logprobs per token")
    parser.add_argument("--n", type=int, default=None, help="choices per request (output tokens count all)")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    check_address(args.base_url)
    if args.num_requests < 1 or args.num_requests > 100_000:
        raise SystemExit("--num-requests must be between 1 and 100000")
    spec = WorkloadSpec(
        args.num_requests, parse_range(args.prompt_len), parse_range(args.output_len), args.rate, args.seed
    )
    items = make_workload(spec, prompt_vocabulary(args.tokenizer))
    extra = {k: v for k, v in (("logprobs", args.logprobs), ("n", args.n)) if v is not None}
    load = run_load(
        args.base_url, args.model, items, args.concurrency, args.max_duration, args.request_timeout, args.warmup, extra
    )
    try:
        records, duration = asyncio.run(load)
    except RuntimeError as exc:
        raise SystemExit(str(exc)) from None
    summary = summarize(records, duration, args.slo_ttft, args.slo_tpot)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["rate"] = "inf" if math.isinf(args.rate) else args.rate
    payload = {
        "kind": "serve",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "workload": describe(items),
        "summary": summary,
        "requests": [record_dict(r, args.keep_text) for r in records],
    }
    path = write_json(args.output or default_output("serve"), payload)
    print(format_table(summary))
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
