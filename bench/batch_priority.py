"""Batch work beside an online load: does the online SLO hold, and how much idle capacity does the batch use?

One runtime process (the real SmolLM2-135M-Instruct by default) behind a gateway process with the
batch API on (SQLite). First the replica's capacity C is measured (closed loop, requests/s of the
online request shape). Then, in alternating rounds:

- A: an online Poisson load at --load × C alone, for --duration seconds;
- B: the same load (same seed) while a --batch-lines batch of the same request shape runs through
  the gateway's batch API; the batch is cancelled at the end of the round;
- C (with --compare-uncapped): as B, on a second runtime (its own gateway) started with
  ``--batch-cap off``, idle in the other rounds.

Online attainment is the share of online requests that met both targets: TTFT within --slo-ttft and
TPOT (time per output token after the first, as the runtime counts it) within --slo-tpot; the
runtime gets both targets, and caps the batch sequences running beside online ones from the TPOT
target (``--batch-cap``). Each pair of rounds gives a ratio, B's attainment over A's, so a slow
patch on a shared machine weighs on both sides of one ratio. The batch's share of the idle capacity
is its throughput over (C − online rate). Writes JSON and a PNG (online TTFT p90 and batch
throughput over time, both runs) under bench/results/.

    python -m bench.batch_priority --duration 60 --rounds 2
    python -m bench.batch_priority --compare-uncapped --rate 0.4   # B and C against the same A rounds
"""

from __future__ import annotations

import argparse
import asyncio
import io
import itertools
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import aiohttp

from bench.server_process import REPO, gateway_process, start_server

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


@contextmanager
def batch_gateway(static: str, database: str, log_dir: Path, cap: int, name: str = "batch") -> Iterator[str]:
    with gateway_process(
        static,
        log_dir,
        name,
        "--database",
        database,
        "--batch-max-per-replica",
        str(cap),
        "--shutdown-delay",
        "0",
        "--shutdown-grace",
        "2",
        ready_seconds=60,
        stop_seconds=20,
    ) as (url, _pid):
        yield url


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


LABELS = {"alone": "A online alone", "batch": "B online + batch", "batch-uncapped": "C online + batch, no cap"}
KEYS = ("attainment", "ttft_attainment", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def plot(report: dict, path: Path, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in report["rounds"]:
        label = f"round {r['round']} {LABELS[r.get('variant', 'batch' if r['with_batch'] else 'alone')]}"
        style = "-" if r["with_batch"] else "--"
        xs, ys = [], []
        t = 0.0
        while t < report["args"]["duration"]:
            inside = sorted(x[1] for x in r["online"] if t <= x[0] < t + window and x[3])
            if inside:
                xs.append(t + window / 2)
                ys.append(inside[int(0.9 * (len(inside) - 1))])
            t += window
        top.plot(xs, ys, style, label=label)
        if r["with_batch"] and len(r["batch_timeline"]) > 1:
            tl = r["batch_timeline"][:: max(1, round(window))]  # samples about a second apart: windows
            rates = [(b[1] - a[1]) / max(1e-9, b[0] - a[0]) for a, b in itertools.pairwise(tl)]
            bottom.plot([(a[0] + b[0]) / 2 for a, b in itertools.pairwise(tl)], rates, label=label)
    top.axhline(report["args"]["slo_ttft"], color="grey", linewidth=0.8, label="TTFT SLO")
    top.set_ylabel(f"online TTFT p90 (s, {window:g} s windows)")
    top.legend(fontsize=7)
    bottom.axhline(
        report["summary"]["idle_capacity_rps"],
        color="grey",
        linewidth=0.8,
        label="capacity the online load leaves idle",
    )
    bottom.set_ylabel(f"batch lines/s ({window:g} s windows)")
    bottom.set_xlabel("seconds into the round")
    bottom.legend(fontsize=7)
    summary = report["summary"]
    share = summary["online_rate_rps"] / max(1e-9, summary["capacity_rps"])
    fig.suptitle(
        f"online load {summary['online_rate_rps']:.2f} req/s ({share:.0%} "
        f"of capacity {summary['capacity_rps']:.2f} req/s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.batch_priority", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct, prepared under .cache)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of online load per round")
    p.add_argument("--rounds", type=int, default=2, help="pairs of rounds (A: online alone, B: with the batch)")
    p.add_argument("--load", type=float, default=0.6, help="online rate as a share of the measured capacity")
    p.add_argument(
        "--rate",
        type=float,
        help="online rate in requests/s instead of --load × capacity: the same load in runs compared "
        "on a machine whose capacity moves with other work",
    )
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--slo-ttft", type=float, default=3.0, help="seconds")
    p.add_argument("--slo-tpot", type=float, default=0.3, help="seconds")
    p.add_argument(
        "--runtime-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more runtime flag (repeatable), e.g. --runtime-arg=--batch-cap=off",
    )
    p.add_argument("--capacity-seconds", type=float, default=30.0, help="closed-loop seconds counted")
    p.add_argument("--capacity-concurrency", type=int, default=16)
    p.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds of load before counting: the capacity loop's, and the batch's before a B round",
    )
    p.add_argument("--max-per-replica", type=int, default=16, help="the gateway's batch concurrency cap")
    p.add_argument(
        "--compare-uncapped",
        action="store_true",
        help="also run each round's batch on a second runtime started with --batch-cap off (C), "
        "beside the first, so both are measured against the same online-alone round",
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "batch_priority.json")
    args = p.parse_args()
    if args.model:
        model = args.model
    else:
        from goodput_runtime.tools import smollm2

        cache = REPO / ".cache" / "smollm2"
        model = str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache)))
    log_dir = REPO / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "machine": f"{os.cpu_count()} CPUs, shared",
        "model": model,
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "rounds": [],
    }
    flags = [
        "--slo-ttft",
        str(args.slo_ttft),
        "--slo-tpot",
        str(args.slo_tpot),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "32",
    ]
    with ExitStack() as stack:

        def replica(name: str, extra: list[str]) -> tuple[str, str]:
            """(gateway URL, runtime URL) of one runtime behind one gateway with its own batch store."""
            server = stack.enter_context(start_server(model, "smollm2", os.cpu_count() or 1, [*flags, *extra], log_dir))
            database = log_dir / f"{name}-{time.strftime('%H%M%S')}.db"
            return stack.enter_context(
                batch_gateway(
                    f"smollm2={server.base_url}", f"sqlite:///{database}", log_dir, args.max_per_replica, name
                )
            ), server.base_url

        urls = {"batch": replica("batch", args.runtime_arg)}
        if args.compare_uncapped:
            urls["batch-uncapped"] = replica("batch-uncapped", [*args.runtime_arg, "--batch-cap", "off"])
        cap = asyncio.run(
            capacity(urls["batch"][0], args.max_tokens, args.capacity_seconds, args.capacity_concurrency, args.warmup)
        )
        rate = args.rate or args.load * cap
        print(f"  capacity {cap:.2f} req/s; online load {rate:.2f} req/s", flush=True)
        variants = ["alone", *(["batch-uncapped"] if args.compare_uncapped else []), "batch"]
        for r in range(args.rounds):
            for variant in variants:
                url, runtime_url = urls["batch" if variant == "alone" else variant]
                result = asyncio.run(run_round(url, runtime_url, args, rate, variant != "alone", seed=r))
                result["round"], result["variant"] = r, variant
                if variant == "batch-uncapped":
                    result["batch_cap_mean"] = None  # the gauge stays at 0 on a runtime without the cap
                report["rounds"].append(result)
                print(
                    f"  round {r} {LABELS[variant]}: attainment {result['attainment']:.3f} (TTFT alone "
                    f"{result['ttft_attainment']:.3f}), TTFT p90 {fmt(result['ttft_p90_s'])} s, TPOT p90 "
                    f"{fmt(result['tpot_p90_s'])} s, batch {result['batch_rps']:.2f} lines/s",
                    flush=True,
                )

    def mean(variant: str, key: str) -> float:
        values = [x[key] for x in report["rounds"] if x["variant"] == variant and x[key] is not None]
        return statistics.fmean(values) if values else float("nan")

    def round_ratios(variant: str) -> list[float]:
        """Per round: the variant's attainment over the online-alone round just before it."""
        alone = {x["round"]: x["attainment"] for x in report["rounds"] if x["variant"] == "alone"}
        return [x["attainment"] / max(1e-9, alone[x["round"]]) for x in report["rounds"] if x["variant"] == variant]

    idle = cap - rate
    summary: dict = {
        "capacity_rps": cap,
        "online_rate_rps": rate,
        "idle_capacity_rps": idle,
        "alone": {k: mean("alone", k) for k in KEYS},
    }
    for variant in variants[1:]:
        ratios = round_ratios(variant)
        part = {k: mean(variant, k) for k in (*KEYS, "batch_rps")}
        part.update(
            round_ratios=ratios,
            round_ratio_median=statistics.median(ratios),
            attainment_ratio=part["attainment"] / max(1e-9, summary["alone"]["attainment"]),
            idle_capacity_used=part["batch_rps"] / max(1e-9, idle),
        )
        summary[variant] = part
    summary["with_batch"] = summary["batch"]
    summary["attainment_ratio"] = summary["batch"]["attainment_ratio"]
    summary["idle_capacity_used"] = summary["batch"]["idle_capacity_used"]
    report["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    png = args.out.with_suffix(".png")
    plot(report, png, window=max(5.0, args.duration / 12))
    print(
        f"\ncapacity {cap:.2f} req/s, online {rate:.2f} req/s ({rate / max(cap, 1e-9):.0%}), idle {idle:.2f} req/s; "
        f"SLO TTFT {args.slo_ttft:g} s, TPOT {args.slo_tpot:g} s; runtime flags {args.runtime_arg or 'default'}; "
        f"{args.rounds} rounds of {args.duration:g} s each"
    )
    print(
        "\n| round | run | attainment (TTFT+TPOT) | TTFT only | TTFT p90 (s) | TPOT p50 (s) | TPOT p90 (s) "
        "| batch lines/s | batch cap (mean) | ÷ alone |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for x in report["rounds"]:
        ratio = "" if x["variant"] == "alone" else f"{x['attainment'] / max(1e-9, alone_of(report, x)):.3f}"
        print(
            f"| {x['round']} | {LABELS[x['variant']]} | {x['attainment']:.3f} | "
            f"{x['ttft_attainment']:.3f} | {fmt(x['ttft_p90_s'])} | {fmt(x['tpot_p50_s'])} | "
            f"{fmt(x['tpot_p90_s'])} | {x['batch_rps']:.2f} | {fmt(x['batch_cap_mean'], 1)} | {ratio} |"
        )
    print(
        "\n| run | online attainment | TTFT p90 (s) | TPOT p90 (s) | batch lines/s | ÷ alone (median of rounds) "
        "| share of idle capacity |\n|---|---|---|---|---|---|---|"
    )
    a = summary["alone"]
    print(f"| {LABELS['alone']} | {a['attainment']:.3f} | {fmt(a['ttft_p90_s'])} | {fmt(a['tpot_p90_s'])} | – | | |")
    for variant in variants[1:]:
        b = summary[variant]
        print(
            f"| {LABELS[variant]} | {b['attainment']:.3f} | {fmt(b['ttft_p90_s'])} | {fmt(b['tpot_p90_s'])} | "
            f"{b['batch_rps']:.2f} | {b['attainment_ratio']:.3f} ({b['round_ratio_median']:.3f}; target ≥ 0.98) | "
            f"{b['idle_capacity_used']:.0%} |"
        )
    print(f"wrote {args.out} and {png}")
    return 0


def alone_of(report: dict, x: dict) -> float:
    return next(y["attainment"] for y in report["rounds"] if y["variant"] == "alone" and y["round"] == x["round"])


if __name__ == "__main__":
    raise SystemExit(main())
