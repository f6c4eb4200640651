"""Our server against vLLM's CPU server: one machine, one model, one workload, alternating rounds.

    python -m bench.vs_vllm                 # SmolLM2-135M-Instruct in float32, concurrency 1, 16, 64
    python -m bench.vs_vllm --quick         # one short round per concurrency
    python -m bench.vs_vllm --dtype bfloat16  # both servers in bf16 (a CPU with AVX-512 BF16 or AMX)

Both servers start once and stay up; only one is under load at a time. Each round drives both,
one after the other, at every concurrency, the order flipping from round to round. Every
(round, concurrency) pair gets its own seeded prompts (so no prefix cache helps the second
system or round), the same for both systems: streamed completions with token-id prompts, greedy,
`ignore_eos`, a fixed number of output tokens. Both compute on the same number of threads. Before
each run both servers must be quiet (under a tenth of a core over half a second): vLLM's worker
keeps polling for about a second after its load ends, which would take a core from the run after it.

The table shows each system's median over rounds of output tok/s, TPOT p50 and TTFT p90, our
ratio against the peer, and the targets; greedy texts are compared request by request.

`--peer ours` compares our server with another of our servers started with `--peer-arg` flags
(an A/B of one runtime setting) instead of vLLM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from bench.serve import default_output, run_load, write_json
from bench.server_process import REPO, kv_cache_bytes, machine, settle, start_server
from bench.stats import RequestRecord, summarize
from bench.vllm_server import VLLM_VENV, prepared_model, start_vllm, vllm_python
from bench.vs_verdicts import compare_outputs, markdown, table_rows
from bench.workload import WorkItem, WorkloadSpec, describe, make_workload, parse_range, prompt_vocabulary

# the tests and bench.engine_vs_vllm import these from here
__all__ = ["compare_outputs", "main", "markdown", "table_rows", "vllm_python"]

# requests per round by concurrency: enough for two waves at 16, one full wave at 64
REQUESTS = {1: 4, 16: 32, 64: 64}
QUICK_REQUESTS = {1: 2, 16: 16, 64: 64}


def round_items(args, vocabulary: list[int], round_: int, concurrency: int) -> list[WorkItem]:
    """This (round, concurrency)'s requests: the same for both systems, new prompts for every pair."""
    counts = QUICK_REQUESTS if args.quick else REQUESTS
    n = args.num_requests or counts.get(concurrency, 2 * concurrency)
    spec = WorkloadSpec(
        n,
        parse_range(args.prompt_len),
        (args.output_len, args.output_len),
        float("inf"),
        args.seed + 1000 * round_ + concurrency,
    )
    return make_workload(spec, vocabulary)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct, prepared)")
    p.add_argument("--concurrency", default="1,16,64")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="per round and concurrency (default: 4, 32, 64 for 1, 16, 64; --quick: 2, 16, 64)",
    )
    p.add_argument("--prompt-len", default="30-400")
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--rounds", type=int, default=None, help="default 2; --quick: 1")
    p.add_argument("--quick", action="store_true", help="one round, fewer requests")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="both servers' --dtype (bfloat16: weights, activations and KV cache; ours falls back to float32, "
        "with a warning in its log, on a CPU without AVX-512 BF16 or AMX)",
    )
    p.add_argument("--peer", choices=["vllm", "ours"], default="vllm")
    p.add_argument("--server-arg", action="append", default=[], help="extra flag for our server, repeatable")
    p.add_argument("--peer-arg", action="append", default=[], help="extra flag for the peer server, repeatable")
    p.add_argument("--vllm-python", default=None, help=f"default {VLLM_VENV}/bin/python (hack/vllm-venv.sh)")
    p.add_argument(
        "--vllm-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: the first --threads CPUs; 'auto' is vLLM's own)",
    )
    p.add_argument("--output", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=REPO / "bench" / "results" / "logs")
    return p


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    # stopped with SIGTERM: unwind, so both servers are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rounds = args.rounds or (1 if args.quick else 2)
    levels = [int(c) for c in args.concurrency.split(",")]
    model = prepared_model(args.model)
    peer = "vllm" if args.peer == "vllm" else "ours-peer"
    vocabulary = prompt_vocabulary(model)
    plan = {(r, c): round_items(args, vocabulary, r, c) for r in range(rounds) for c in levels}
    longest = max(len(i.prompt_ids) + i.max_tokens for items in plan.values() for i in items)
    if longest > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the longest request ({longest})")
    # room for the largest round at once, for both systems
    kv = max(kv_cache_bytes(model, items[: max(levels)], 16) for items in plan.values())
    shared = [
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--max-model-len",
        str(args.max_model_len),
    ]
    # after start_server's own --dtype float32: the last one counts
    dtype = ["--dtype", args.dtype]
    ours_args = [*shared, *dtype, "--kv-cache-memory", str(kv), "--num-threads", str(args.threads), *args.server_arg]
    load_before = [round(x, 2) for x in os.getloadavg()]
    print(
        f"model {model} in {args.dtype}; {rounds} round(s) at concurrency {levels}; {args.threads} threads each; "
        f"load average {load_before}",
        flush=True,
    )
    started = time.monotonic()
    samples: dict[tuple[str, int], list[dict]] = {}
    outputs: dict[str, list[dict]] = {}
    per_round: list[dict] = []
    startup_s: dict[str, float] = {}
    with ExitStack() as stack:
        t = time.monotonic()
        servers = {"ours": stack.enter_context(start_server(model, "bench", args.threads, ours_args, args.log_dir))}
        startup_s["ours"] = time.monotonic() - t
        t = time.monotonic()
        if args.peer == "vllm":
            servers[peer] = stack.enter_context(
                start_vllm(
                    vllm_python(args.vllm_python),
                    model,
                    "bench",
                    args.threads,
                    kv,
                    [*shared, *args.peer_arg],
                    args.log_dir,
                    args.vllm_bind,
                    dtype=args.dtype,
                )
            )
        else:
            peer_args = [
                *shared,
                *dtype,
                "--kv-cache-memory",
                str(kv),
                "--num-threads",
                str(args.threads),
                *args.peer_arg,
            ]
            servers[peer] = stack.enter_context(start_server(model, "bench", args.threads, peer_args, args.log_dir))
        startup_s[peer] = time.monotonic() - t
        warm = plan[(0, levels[0])]
        for server in servers.values():
            asyncio.run(run_load(server.base_url, "bench", warm[:2], concurrency=2, warmup=2))
        for r in range(rounds):
            order = ["ours", peer] if r % 2 == 0 else [peer, "ours"]
            for c in levels:
                items = plan[(r, c)]
                got: dict[str, list[RequestRecord]] = {}
                for name in order:
                    waited = settle([server.pid for server in servers.values()])
                    before = os.getloadavg()[0]
                    records, duration = asyncio.run(run_load(servers[name].base_url, "bench", items, concurrency=c))
                    failed = [x for x in records if not x.ok]
                    if failed:
                        raise RuntimeError(f"{len(failed)} requests to {name} failed, first: {failed[0].error}")
                    summary = summarize(records, duration, None, None)
                    summary["loadavg_1m_before_after"] = [round(before, 2), round(os.getloadavg()[0], 2)]
                    summary["settled_s"] = round(waited, 2)
                    samples.setdefault((name, c), []).append(summary)
                    got[name] = records
                    print(
                        f"  round {r + 1} c={c} {name}: {summary['output_tokens_per_s']:.1f} tok/s, TPOT p50 "
                        f"{summary['tpot_s']['p50'] * 1e3:.0f} ms, TTFT p90 {summary['ttft_s']['p90']:.2f} s, "
                        f"load {summary['loadavg_1m_before_after']}",
                        flush=True,
                    )
                agree = compare_outputs(got["ours"], got[peer])
                outputs.setdefault(str(c), []).append(agree)
                per_round.append(
                    {
                        "round": r + 1,
                        "concurrency": c,
                        "order": order,
                        "outputs_equal": f"{agree['equal']}/{agree['requests']}",
                    }
                )
    load_after = [round(x, 2) for x in os.getloadavg()]
    rows = table_rows(samples, levels, peer)
    payload = {
        "kind": "vs_vllm",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"rounds": rounds},
        "model": model,
        "peer": peer,
        "server_args": {"ours": ours_args, peer: args.peer_arg},
        "workload": {str(c): describe(plan[(0, c)]) for c in levels},
        "machine": machine(load_before, load_after),
        "startup_s": startup_s,
        "wall_s": time.monotonic() - started,
        "rows": rows,
        "rounds": per_round,
        "samples": {f"{name}@{c}": runs for (name, c), runs in samples.items()},
        "greedy_outputs": outputs,
    }
    path = write_json(args.output or default_output("vs_vllm" if args.peer == "vllm" else "vs_ours"), payload)
    print()
    print(markdown(rows, peer))
    print(f"\nmedian over {rounds} round(s); load average before {load_before}, after {load_after}")
    for c, checks in outputs.items():
        equal = sum(x["equal"] for x in checks)
        total = sum(x["requests"] for x in checks)
        print(f"- greedy outputs at concurrency {c}: {equal}/{total} equal", end="")
        differing = [d["index"] for x in checks for d in x["differing"]]
        print(f" (differing requests {differing[:10]}{' ...' if len(differing) > 10 else ''})" if differing else "")
    print(f"\nwrote {path}")
    return payload


if __name__ == "__main__":
    main()
