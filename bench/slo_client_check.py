"""vLLM's own benchmark client against both servers, as bench.slo_capacity's cross-check
(`--vllm-client-check RATE`): vllm.benchmarks.serve through its own argparse parser and main, from the vLLM
venv, on the `random` dataset with the rung's mean lengths, Poisson arrivals and `--goodput ttft:MS tpot:MS`."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from bench.server_process import Server, settle
from bench.slo_judge import OUTPUT_MEDIAN, PROMPT_MEDIAN, Slo

SERVED = "bench"  # the name every bench.slo_capacity server serves its model under
SETTLE_LIMIT_S = 60.0  # the longest wait for the servers to be quiet before a run

CLIENT = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser()
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def client_command(
    python: str, base_url: str, model: str, slo: Slo, rate: float, prompts: int, lengths: tuple[int, int], seed: int
) -> list[str]:
    return [
        python,
        "-c",
        CLIENT,
        *("--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions"),
        *("--model", model, "--served-model-name", SERVED, "--tokenizer", model),
        *("--dataset-name", "random", "--random-input-len", str(lengths[0])),
        *("--random-output-len", str(lengths[1]), "--random-range-ratio", "0"),
        *("--num-prompts", str(prompts), "--request-rate", f"{rate:g}", "--burstiness", "1"),
        *("--seed", str(seed), "--ignore-eos", "--temperature", "0", "--disable-tqdm"),
        *("--goodput", f"ttft:{slo.ttft_s * 1000:g}", f"tpot:{slo.tpot_s * 1000:g}"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90"),
    ]


def run_client(command: list[str], timeout_s: float, log_dir: Path, name: str) -> dict:
    """Runs vLLM's client; its result file's figures, or the error."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"vllm-client-{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.log"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # its own packages, not this checkout's
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [*command, "--save-result", "--result-dir", tmp, "--result-filename", "result.json"]
        try:
            with open(log, "wb") as out:
                done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": f"vLLM's client ran past {timeout_s:.0f} s; see {log}", "log": str(log)}
        result_path = Path(tmp) / "result.json"
        if done.returncode != 0 or not result_path.exists():
            return {"error": f"vLLM's client exited with {done.returncode}; see {log}", "log": str(log)}
        result = json.loads(result_path.read_text())
    sent = result.get("num_prompts") or 0
    goodput = result.get("request_goodput")
    duration = result.get("duration")
    return {
        "goodput_rps": goodput,
        "attainment": goodput * duration / sent if goodput is not None and duration and sent else None,
        "duration_s": duration,
        "num_prompts": sent,
        "completed": result.get("completed"),
        "failed": result.get("failed"),
        "output_tok_s": result.get("output_throughput"),
        "tpot_p50_s": ms_to_s(result.get("median_tpot_ms")),
        "tpot_p90_s": ms_to_s(result.get("p90_tpot_ms")),
        "ttft_p50_s": ms_to_s(result.get("median_ttft_ms")),
        "ttft_p90_s": ms_to_s(result.get("p90_ttft_ms")),
        "log": str(log),
    }


def ms_to_s(value: float | None) -> float | None:
    return None if value is None else value / 1000


def client_check(
    args, vpy: str, model: str, slo: Slo, servers: dict[str, Server], pids: list[int], items, names, drain: float
) -> dict:
    rate = args.vllm_client_check
    prompts = args.vllm_client_prompts or max(1, round(rate * args.window))
    lengths = (
        max(1, round(statistics.fmean(len(i.prompt_ids) for i in items))) if items else PROMPT_MEDIAN,
        max(1, round(statistics.fmean(i.max_tokens for i in items))) if items else OUTPUT_MEDIAN,
    )
    out: dict = {"rate": rate, "num_prompts": prompts, "input_len": lengths[0], "output_len": lengths[1], "servers": {}}
    for name in names:
        settle(pids, limit_s=SETTLE_LIMIT_S)
        command = client_command(vpy, servers[name].base_url, model, slo, rate, prompts, lengths, args.seed)
        # its import and tokenizer take a minute at most; then the arrivals and the drain
        result = run_client(command, 180 + prompts / rate + drain, args.log_dir, name)
        out["servers"][name] = result
        print(f"  [{slo.label}] vLLM's client at {rate:g} req/s, {name}: {result}", flush=True)
    return out
