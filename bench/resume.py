"""What a replica's death costs a streaming client: the time from the kill to the stream's next token.

N `python -m goodput_runtime` replicas (CPU, one thread each) sit behind one `python -m goodput_gateway`
(replicas given with --static-model, no cluster). C greedy chat streams (the `openai` SDK, `ignore_eos`)
go through the gateway; the client stamps every chunk that carries text on one monotonic clock. The streams
start one after another, each once a replica's `goodput_prompt_tokens_total` rose (that replica serves it).
Once every stream has `--kill-after` tokens (mid-answer), after a seeded random pause, the replica running
the most requests (`goodput_requests_running` on each one's /metrics) is SIGKILLed and the kill stamped on
the same clock. The gateway takes its streams up on the others (gateway/goodput_gateway/resume.py).

Per stream that was mid-answer on the killed replica: the longest gap between its tokens at the client
from its last one before the kill through the STALL_WINDOW_S after, against its own TPOT before the kill
(the mean gap until then); the resume latency, kill → the token ending that gap (the first of the new
replica: tokens already on their way when the replica died may come first, more of them the further the
client lags), and kill → its very next token; its TPOT after (the other replicas are busier). The other
streams' longest gap in the same window is the yardstick. Per round: streams resumed (the gateway's
`goodput_gateway_streams_resumed_total`), lost (errors the client saw), the gateway's own mean time from the
loss to the new replica's first bytes (`goodput_gateway_stream_resume_seconds`), and whether each resumed
stream's text equals its unbroken run's: the killed replica is restarted on its port and the same prompts
run again, with no kill, on the same replicas. Each round has its own seed (prompts, kill pause).

No row with resumption off: the gateway has no switch for it.

    python -m bench.resume --tiny             # the tests' random-weight model, made on the fly: about 2 min
    python -m bench.resume                    # SmolLM2-135M-Instruct (goodput_runtime.tools.smollm2)
    python -m bench.resume --model DIR [--replicas 3] [--streams 16] [--rounds 3] [--max-tokens N]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.server_process import REPO, ensure_model, free_port, gateway_process, machine, wait_ready
from bench.stats import percentile

RUNNING = "goodput_requests_running"
PROMPT_TOKENS = "goodput_prompt_tokens_total"
RESUMED = "goodput_gateway_streams_resumed_total"
LOST = "goodput_gateway_streams_lost_total"
RESUME_SECONDS = "goodput_gateway_stream_resume_seconds"
STALL_WINDOW_S = 2.0  # after a kill: where a stream's longest gap between tokens is looked for
TOPICS = ["a lighthouse", "a river", "the moon", "a clockmaker", "a fox", "a storm", "a library", "a glacier"]
TOPICS += ["a market", "a violin", "a desert", "a bridge", "a comet", "a garden", "a ship", "a mountain"]


@dataclass
class Stream:
    index: int
    prompt: str
    times: list[float] = field(default_factory=list)  # monotonic arrival of each chunk carrying text
    parts: list[str] = field(default_factory=list)
    replica: int | None = None  # the replica that served its first token
    error: str | None = None


def stream_gaps(times: list[float], kill: float) -> dict[str, float | None] | None:
    """One stream's timeline around a kill at `kill` (same clock); None without a token before it or after it.
    next_s: kill → its next token. stall_s: the longest gap between its tokens from its last one before the
    kill through those of the STALL_WINDOW_S after (tokens already on their way when the replica died may
    come first); resume_s: kill → the token that ends that gap, the first one the new replica sent (at most
    that). tpot_before_s, tpot_after_s: the mean gap between tokens before the kill, and from the next token
    on (None for fewer than two)."""
    before = [t for t in times if t <= kill]
    after = [t for t in times if t > kill]
    if not before or not after:
        return None
    window = [t for t in after if t <= kill + STALL_WINDOW_S] or after[:1]
    stall, ends = max((b - a, b) for a, b in itertools.pairwise([before[-1], *window]))

    def tpot(ts: list[float]) -> float | None:
        return (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else None

    return {
        "resume_s": ends - kill,
        "next_s": after[0] - kill,
        "stall_s": stall,
        "tpot_before_s": tpot(before),
        "tpot_after_s": tpot(after),
        "tokens_before": len(before),
        "tokens_after": len(after),
    }


def stream_rows(streams: list[Stream], kill: float, victim: int, unbroken: list[str] | None) -> list[dict]:
    """Per stream: its replica, whether that was the killed one, its error, its gaps, and (given the
    unbroken run's texts) whether its text equals the unbroken one."""
    return [
        {"index": s.index, "replica": s.replica, "on_killed": s.replica == victim, "error": s.error}
        | {"gaps": stream_gaps(s.times, kill)}
        | ({} if unbroken is None else {"same_text": s.error is None and "".join(s.parts) == unbroken[s.index]})
        for s in streams
    ]


def spread(values: list[float]) -> dict[str, float | int | None]:
    p50, p90 = percentile(values, 50), percentile(values, 90)
    mean = sum(values) / len(values) if values else None
    return {"n": len(values), "mean": mean, "p50": p50, "p90": p90, "max": max(values, default=None)}


def figures(rows: list[dict]) -> dict:
    """The figures of stream rows (a round's or every round's): the killed replica's streams that were
    mid-answer, against the other streams."""
    whole = [r for r in rows if r["gaps"] and not r["error"]]
    killed = [r["gaps"] for r in whole if r["on_killed"]]
    others = [r["gaps"] for r in whole if not r["on_killed"]]

    def over(gaps: list[dict], key: str) -> dict:
        return spread([g[key] for g in gaps if g[key] is not None])

    def count(subset: list[dict]) -> list[int] | None:
        seen = [r["same_text"] for r in subset if "same_text" in r]
        return [sum(seen), len(seen)] if seen else None

    ratios = [g["stall_s"] / g["tpot_before_s"] for g in killed if g["tpot_before_s"]]
    on_killed = [r for r in rows if r["on_killed"]]
    return {
        "on_killed_replica": len(on_killed),
        "mid_answer_on_killed": len(killed),
        "finished_before_kill": sum(1 for r in on_killed if r["gaps"] is None and not r["error"]),
        "client_errors": sum(1 for r in rows if r["error"]),
        **{key: over(killed, key) for key in ("resume_s", "next_s", "stall_s", "tpot_before_s", "tpot_after_s")},
        "stall_over_tpot": spread(ratios),
        "others_stall_s": over(others, "stall_s"),
        "same_text_resumed": count(on_killed),
        "same_text_all": count(rows),
    }


def pooled(rounds: list[dict]) -> dict:
    """Every round's streams together (the headline percentiles), the gateway's counts summed."""
    seconds, count = (sum(x["gateway_resume_seconds_sum_count"][i] for x in rounds) for i in (0, 1))
    return {
        **figures([r for x in rounds for r in x["streams"]]),
        "rounds": len(rounds),
        "resumed": sum(x["resumed"] for x in rounds),
        "gateway_lost": sum(x["gateway_lost"] for x in rounds),
        "gateway_resume_seconds": seconds / count if count else None,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def table(rounds: list[dict], total: dict | None) -> str:
    lines = [
        "| round | load avg | streams mid-answer on the killed replica | resumed | lost | resume p50 / p90 / max (ms) "
        "| kill → next token p50 (ms) | longest gap p50 / p90 (ms) | TPOT before / after p50 (ms) | longest gap / "
        "TPOT p50 | other streams' longest gap p50 (ms) | gateway: loss → first bytes, mean (ms) | same text as "
        "unbroken |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, x in [*((str(x["round"]), x) for x in rounds), *([("all", total)] if total else [])]:
        r, g, same, ratio = x["resume_s"], x["stall_s"], x["same_text_resumed"], x["stall_over_tpot"]["p50"]
        lines.append(
            f"| {label} | {x.get('load', '')} | {x['mid_answer_on_killed']} | {x['resumed']:.0f} | "
            f"{x['client_errors']} | {_ms(r['p50'])} / {_ms(r['p90'])} / {_ms(r['max'])} | "
            f"{_ms(x['next_s']['p50'])} | {_ms(g['p50'])} / "
            f"{_ms(g['p90'])} | {_ms(x['tpot_before_s']['p50'])} / {_ms(x['tpot_after_s']['p50'])} | "
            f"{'-' if ratio is None else f'{ratio:.1f}x'} | {_ms(x['others_stall_s']['p50'])} | "
            f"{_ms(x['gateway_resume_seconds'])} | {'-' if not same else f'{same[0]}/{same[1]}'} |"
        )
    return "\n".join(lines)


def metric(url: str, name: str) -> float:
    """The sum of a series' samples at url/metrics."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    ok = (name + "{", name + " ")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(ok))


class Replica:
    """A runtime process on a fixed loopback port, so that one restarted is the same URL to the gateway."""

    def __init__(self, index: int, model: str, flags: list[str], log_dir: Path) -> None:
        self.index, self.model, self.flags, self.port = index, model, flags, free_port()
        self.url, self.log = f"http://127.0.0.1:{self.port}", log_dir / f"resume-replica{index}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [sys.executable, "-m", "goodput_runtime", "--model", self.model, "--served-model-name", "model"]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32", "--device", "cpu"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "runtime"), env.get("PYTHONPATH")]))
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([*cmd, "--log-level", "warning", *self.flags], stdout=log, stderr=log, env=env)

    def ready(self) -> None:
        assert self.proc is not None
        wait_ready(self.proc, self.url, 600, f"replica {self.index}", self.log, every=0.5)

    def kill(self) -> float:
        """SIGKILL; the monotonic time right after the signal went. Not waited for here: the process takes
        a while to go (its memory unmapped), and the client's loop must not stall meanwhile."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        return time.monotonic()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()  # nothing of it is measured any more
            self.proc.wait(30)


async def run_streams(
    url: str, replicas: list[Replica], prompts: list[str], args: argparse.Namespace, rng: random.Random | None
) -> tuple[list[Stream], dict | None]:
    """The prompts' streams through the gateway at `url`, started one by one; with `rng`, the busiest replica
    killed once every stream has `args.kill_after` tokens. The streams and the kill's record."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=url + "/v1",
        api_key="none",
        max_retries=0,
        timeout=args.timeout,
        http_client=openai.DefaultAsyncHttpxClient(trust_env=False, timeout=args.timeout),
    )
    streams = [Stream(i, p) for i, p in enumerate(prompts)]

    async def one(s: Stream) -> None:
        try:
            response = await client.chat.completions.create(
                model="model",
                messages=[{"role": "user", "content": s.prompt}],
                stream=True,
                temperature=0,
                max_tokens=args.max_tokens,
                extra_body={"ignore_eos": True},
            )
            async for chunk in response:
                now = time.monotonic()
                if chunk.choices and chunk.choices[0].delta.content:
                    s.times.append(now)
                    s.parts.append(chunk.choices[0].delta.content)
        except openai.APIError as err:
            s.error = f"{type(err).__name__}: {err}"

    async def scrape(name: str) -> list[float]:
        return await asyncio.gather(*(asyncio.to_thread(metric, r.url, name) for r in replicas))

    tasks = []
    seen = await scrape(PROMPT_TOKENS)
    for s in streams:  # one at a time: the replica whose prompt tokens rise is the stream's
        tasks.append(asyncio.create_task(one(s)))
        while s.replica is None and not tasks[-1].done():
            now = await scrape(PROMPT_TOKENS)
            s.replica, seen = attribute(seen, now), now
    kill = None
    if rng is not None:
        while any(
            len(s.times) < args.kill_after and s.error is None and not t.done()
            for s, t in zip(streams, tasks, strict=True)
        ):
            await asyncio.sleep(0.002)
        await asyncio.sleep(rng.uniform(0, args.kill_jitter))
        loads = await scrape(RUNNING)
        victim = loads.index(max(loads))
        at = replicas[victim].kill()
        kill = {"at": at, "victim": victim, "running": loads, "tokens_at_kill": [len(s.times) for s in streams]}
    await asyncio.gather(*tasks)
    await client.close()
    return streams, kill


def attribute(before: list[float], after: list[float]) -> int | None:
    """The replica whose counter rose most between two scrapes, None where none rose."""
    rise = [b - a for a, b in zip(before, after, strict=True)]
    return rise.index(max(rise)) if max(rise) > 0 else None


def prompts_for(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Tell me a long story about {rng.choice(TOPICS)} and {rng.choice(TOPICS)}, part {i}." for i in range(count)
    ]


def one_round(r: int, url: str, replicas: list[Replica], args: argparse.Namespace) -> dict:
    seed = args.seed + r
    prompts = prompts_for(seed, args.streams)
    load_before = os.getloadavg()
    before = {k: metric(url, k) for k in (RESUMED, LOST, RESUME_SECONDS + "_sum", RESUME_SECONDS + "_count")}
    streams, kill = asyncio.run(run_streams(url, replicas, prompts, args, random.Random(seed)))
    after = {k: metric(url, k) for k in before}
    assert kill is not None
    victim = replicas[kill["victim"]]
    assert victim.proc is not None
    victim.proc.wait(30)
    victim.start()  # the same port: the same replica to the gateway
    victim.ready()
    time.sleep(args.settle)  # the gateway's next scrape sees it, its failure's cool-down is over
    unbroken, _ = asyncio.run(run_streams(url, replicas, prompts, args, None))
    texts = ["".join(s.parts) for s in unbroken] if all(s.error is None for s in unbroken) else None
    rows = stream_rows(streams, kill["at"], kill["victim"], texts)
    seconds, count = (after[RESUME_SECONDS + k] - before[RESUME_SECONDS + k] for k in ("_sum", "_count"))
    result = figures(rows)
    result.update(
        round=r,
        seed=seed,
        kill={k: v for k, v in kill.items() if k != "at"},
        resumed=after[RESUMED] - before[RESUMED],
        gateway_lost=after[LOST] - before[LOST],
        gateway_resume_seconds=seconds / count if count else None,
        gateway_resume_seconds_sum_count=[seconds, count],
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
        unbroken_errors=[s.error for s in unbroken if s.error],
        streams=rows,
    )
    result["load"] = f"{max(load_before[0], result['loadavg_after'][0]):.1f}"
    return result


def model_dir(args: argparse.Namespace) -> tuple[str, str]:
    if args.model:
        return args.model, Path(args.model).name
    if args.tiny:
        path = str(REPO / ".cache" / "models" / "tiny")
        ensure_model(path, "tiny")
        return path, "tiny"
    from goodput_runtime.tools import smollm2

    cache = REPO / ".cache" / "smollm2"
    return str(smollm2.prepare(smollm2.fetch(cache), smollm2.prepared_dir(cache))), "smollm2"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tiny", action="store_true", help="the tests' random-weight model, made if missing")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--streams", type=int, default=16, help="concurrent streams")
    p.add_argument("--rounds", type=int, default=3, help="kills, each with its own seed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-tokens", type=int, help="per stream (default 1800 with --tiny, else 128)")
    p.add_argument("--kill-after", type=int, default=8, help="tokens every stream has before the kill")
    p.add_argument("--kill-jitter", type=float, default=0.2, help="then a seeded random pause up to this, s")
    p.add_argument("--kv-cache-memory", default="256Mi", help="per replica")
    p.add_argument("--settle", type=float, default=4.0, help="s after a restart before the unbroken run")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, s")
    p.add_argument("--out", type=Path, help="default bench/results/resume-<model>.json")
    args = p.parse_args()
    model, label = model_dir(args)
    args.max_tokens = args.max_tokens or (1800 if args.tiny else 128)
    log_dir = REPO / "bench" / "results" / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = ["--kv-cache-memory", args.kv_cache_memory, "--max-model-len", "2048"]
    replicas = [Replica(i, model, flags, log_dir) for i in range(args.replicas)]
    load_before, git = os.getloadavg(), [["rev-parse", "HEAD"], ["status", "--porcelain", "runtime", "gateway"]]
    commit, dirty = (subprocess.run(["git", *a], capture_output=True, text=True).stdout for a in git)
    report: dict = {"model": label, "commit": commit.strip(), "uncommitted_runtime_gateway": dirty.splitlines()}
    report["args"] = {k: str(v) for k, v in vars(args).items()}
    report["comparison_without_resumption"] = "not measured: the gateway has no switch to turn resumption off"
    rounds: list[dict] = []
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.ready()
        static = "model=" + ",".join(r.url for r in replicas)
        gateway_args = ("--attempts", str(args.replicas), "--shutdown-delay", "0", "--log-level", "warning")
        with gateway_process(static, log_dir, "resume", *gateway_args) as (url, _pid):
            warm = argparse.Namespace(**{**vars(args), "max_tokens": 4})
            asyncio.run(run_streams(url, replicas, prompts_for(-1, 2 * args.replicas), warm, None))
            for r in range(args.rounds):
                rounds.append(one_round(r, url, replicas, args))
                print(table(rounds[-1:], None).splitlines()[-1], flush=True)
    finally:
        for replica in replicas:
            replica.stop()
    report["machine"] = machine(load_before, os.getloadavg())
    report["rounds"], report["all"] = rounds, pooled(rounds)
    out = args.out or REPO / "bench" / "results" / f"resume-{label}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"\n{label}, {args.replicas} replicas, {args.streams} streams, {args.max_tokens} tokens each\n")
    print(table(rounds, report["all"]))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
