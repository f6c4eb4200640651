"""Our server vs transformers' continuous batching vs a static padded batch: one machine, one model, one workload.

    python -m bench.compare                 # 60m Llama, 64 requests, prompts 16-256, outputs 8-256

The workload is an offline batch (all requests available at t=0): our server is driven by the
load generator at concurrency = number of requests, the baselines get the whole list at once.
Every system runs greedy, EOS ignored, fp32, with the same torch thread count.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from bench.baselines import SystemRun, cb_cache_blocks, load_model, run_static, run_transformers_cb
from bench.serve import default_output, run_load, write_json
from bench.server_process import REPO, cpu_seconds, ensure_model, kv_cache_bytes, start_server
from bench.stats import distribution, summarize
from bench.workload import WorkloadSpec, describe, make_workload, parse_range, prompt_vocabulary

SYSTEMS = ("ours", "transformers-cb", "static-batch")
TARGETS = {"transformers-cb": 1.5, "static-batch": 1.2}  # ours / baseline, output tokens/s


def run_ours(args, items, threads: int) -> tuple[SystemRun, dict]:
    longest = max(len(i.prompt_ids) + i.max_tokens for i in items)
    extra = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_batched_tokens),
        "--kv-cache-memory",
        str(kv_cache_bytes(args.model_dir, items, args.block_size)),
        "--block-size",
        str(args.block_size),
        "--max-model-len",
        str(longest),
        *args.server_arg,
    ]
    with start_server(args.model_dir, "bench-model", threads, extra, args.log_dir) as server:
        load = run_load(
            server.base_url,
            "bench-model",
            items,
            concurrency=len(items),
            warmup=args.warmup,
            max_duration_s=args.max_duration,
        )
        client_cpu, server_cpu = time.process_time(), cpu_seconds(server.pid)
        records, duration = asyncio.run(load)
        client_cpu = time.process_time() - client_cpu
        server_cpu = None if server_cpu is None else (cpu_seconds(server.pid) or server_cpu) - server_cpu
    failed = [r for r in records if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests to our server failed, first: {failed[0].error}")
    summary = summarize(records, duration, args.slo_ttft, args.slo_tpot)
    run = SystemRun(
        system="ours",
        wall_s=duration,
        useful_output_tokens=sum(min(r.output_tokens, r.max_tokens) for r in records),
        computed_output_tokens=sum(r.output_tokens for r in records),
        ttft_s=[r.ttft_s for r in records if r.ttft_s is not None],
        e2e_s=[r.start_s + r.e2e_s for r in records if r.e2e_s is not None],
        outputs=[],
        config={"server_args": extra, "concurrency": len(items), "cpu_s": {"server": server_cpu, "client": client_cpu}},
        cpu_s=None if server_cpu is None else server_cpu + client_cpu,
        notes="python -m goodput_runtime as a subprocess, measured at the client over streaming HTTP "
        "(the client shares the machine's cores); wall = first request sent to last response done",
        texts=[r.text for r in records],
    )
    return run, summary


def run_system(name: str, args, items, model, pad_id: int) -> SystemRun:
    before = [round(x, 2) for x in os.getloadavg()]
    if name == "ours":
        run, summary = run_ours(args, items, args.threads)
        run.config["serve_summary"] = summary
    elif name == "transformers-cb":
        run = run_transformers_cb(model, items, args.max_batched_tokens, args.cb_page_size, args.max_num_seqs)
    else:
        run = run_static(model, items, args.static_batch_size, pad_id)
    run.config["loadavg_before_after"] = [*before, *(round(x, 2) for x in os.getloadavg())]
    return run


def median_run(runs: list[SystemRun]) -> SystemRun:
    """The round with the median throughput (the lower middle one for an even count)."""
    ordered = sorted(runs, key=lambda r: r.output_tokens_per_s)
    return ordered[(len(ordered) - 1) // 2]


def round_ratios(all_runs: dict[str, list[SystemRun]]) -> list[dict]:
    """Per round: ours over each baseline measured next to it, and the round's highest 1-minute load."""
    rounds = []
    for i in range(len(next(iter(all_runs.values())))):
        here = {name: done[i] for name, done in all_runs.items()}
        entry: dict = {"max_loadavg_1m": max(max(r.config["loadavg_before_after"][0::3]) for r in here.values())}
        if "ours" in here:
            for name in TARGETS:
                if name in here:
                    entry[name] = here["ours"].output_tokens_per_s / here[name].output_tokens_per_s
        rounds.append(entry)
    return rounds


def agreement(ours_texts: list[str], reference: SystemRun, tokenizer) -> float:
    """Share of requests whose text equals the decoded reference tokens (greedy outputs should match).

    A trailing incomplete UTF-8 sequence is left out of both: a stream may hold it back at the end.
    """
    same = sum(
        text.rstrip("\ufffd") == tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
        for text, ids in zip(ours_texts, reference.outputs, strict=True)
    )
    return same / len(ours_texts)


def system_row(run: SystemRun) -> dict:
    return {
        "system": run.system,
        "wall_s": run.wall_s,
        "useful_output_tokens": run.useful_output_tokens,
        "computed_output_tokens": run.computed_output_tokens,
        "output_tokens_per_s": run.output_tokens_per_s,
        "cpu_s": run.cpu_s,  # CPU time of every process involved; / wall = cores kept busy
        "cores_busy": None if run.cpu_s is None else run.cpu_s / run.wall_s,
        "ttft_s": distribution(run.ttft_s),
        "e2e_s": distribution(run.e2e_s),
        "config": run.config,
        "notes": run.notes,
    }


def markdown(rows: dict[str, dict], ratios: dict[str, dict]) -> str:
    lines = [
        "| system | wall (s) | useful output tok/s | TTFT p50 (s) | TTFT p90 (s) | ours / system (tok/s) "
        "| cores busy |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        ratio = ratios.get(name, {}).get("throughput")
        busy = row["cores_busy"]
        lines.append(
            f"| {name} | {row['wall_s']:.1f} | {row['output_tokens_per_s']:.1f} | "
            f"{row['ttft_s']['p50']:.2f} | {row['ttft_s']['p90']:.2f} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {'-' if busy is None else f'{busy:.2f}'} |"
        )
    return "\n".join(lines)


def source_revision() -> dict:
    """The commit measured, and whether the runtime had uncommitted changes."""

    def git(*cmd: str) -> str:
        done = subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=REPO, check=False)
        return done.stdout.strip()

    return {"commit": git("rev-parse", "HEAD"), "runtime_dirty": bool(git("status", "--porcelain", "runtime"))}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", default=".cache/models/llama-60m", help="made with --shape if missing")
    p.add_argument("--shape", default="60m", help="make_model shape used when --model-dir is missing")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", default="16-256")
    p.add_argument("--output-len", default="8-256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for every system")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset, run in this order")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=2048, help="per-step token budget (ours and CB)")
    p.add_argument("--block-size", type=int, default=16, help="our KV block size")
    p.add_argument("--cb-page-size", type=int, default=256, help="transformers CB page size (its default)")
    p.add_argument("--static-batch-size", type=int, default=64)
    p.add_argument("--repeat", type=int, default=1, help="rounds; each system's median round is reported")
    p.add_argument("--warmup", type=int, default=2, help="short requests to our server before timing")
    p.add_argument("--slo-ttft", type=float, default=None)
    p.add_argument("--slo-tpot", type=float, default=None)
    p.add_argument("--max-duration", type=float, default=1800.0, help="seconds our server gets for the batch")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for our server, repeatable")
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    ensure_model(args.model_dir, args.shape)
    torch.set_num_threads(args.threads)
    spec = WorkloadSpec(
        args.num_requests, parse_range(args.prompt_len), parse_range(args.output_len), float("inf"), args.seed
    )
    items = make_workload(spec, prompt_vocabulary(args.model_dir))
    print(f"workload: {describe(items)}; torch threads {args.threads}", flush=True)

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    all_runs: dict[str, list[SystemRun]] = {name: [] for name in systems}
    model = None
    for round_ in range(args.repeat):
        for name in systems:
            print(f"running {name} (round {round_ + 1}/{args.repeat}) ...", flush=True)
            if name != "ours":
                model = model or load_model(args.model_dir)
            run = run_system(name, args, items, model, tokenizer.pad_token_id)
            all_runs[name].append(run)
            print(
                f"  {name}: {run.wall_s:.1f} s, {run.output_tokens_per_s:.1f} useful tok/s, "
                f"load average {run.config['loadavg_before_after']}",
                flush=True,
            )
    runs = {name: median_run(done) for name, done in all_runs.items()}
    serve_summary = runs["ours"].config.get("serve_summary") if "ours" in runs else None

    rows = {name: system_row(run) for name, run in runs.items()}
    ratios: dict[str, dict] = {}
    if "ours" in runs:
        for name in TARGETS:
            if name in runs:
                ratios[name] = {
                    "throughput": runs["ours"].output_tokens_per_s / runs[name].output_tokens_per_s,
                    "target": TARGETS[name],
                    "p90_ttft": rows["ours"]["ttft_s"]["p90"] / rows[name]["ttft_s"]["p90"],
                    "outputs_agree": agreement(runs["ours"].texts, runs[name], tokenizer),
                }
    checks = {f"ours >= {t}x {n} tok/s": ratios[n]["throughput"] >= t for n, t in TARGETS.items() if n in ratios}
    if "static-batch" in ratios:
        checks["ours p90 TTFT < static-batch p90 TTFT"] = ratios["static-batch"]["p90_ttft"] < 1
    payload = {
        "kind": "compare",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "workload": describe(items),
        "source": source_revision(),
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "systems": rows,
        "all_rounds": {name: [system_row(r) for r in done] for name, done in all_runs.items()},
        "ratios_ours_over": ratios,
        "ratios_per_round": round_ratios(all_runs),
        "targets_met": checks,
        "ours_serve_summary": serve_summary,
        "cb_cache_blocks": cb_cache_blocks(items, args.cb_page_size),
    }
    path = write_json(args.output or default_output("compare"), payload)
    print()
    print(markdown(rows, ratios))
    if args.repeat > 1:
        print("\nmedian round per system; ours over each baseline within each round:")
        for i, entry in enumerate(payload["ratios_per_round"]):
            cells = ", ".join(f"{k} {v:.2f}" for k, v in entry.items())
            print(f"- round {i + 1}: {cells}")
    print()
    for check, ok in checks.items():
        print(f"- {'met' if ok else 'NOT met'}: {check}")
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
