"""``python -m goodput_runtime --model <dir or org/name>``: serve a model over OpenAI's API."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn, TypeVar

from goodput_contract import quantization as quantization_rules
from goodput_runtime.config import EngineConfig
from goodput_runtime.server.auth import API_KEY_ENV, split_keys

if TYPE_CHECKING:
    from goodput_runtime.server.admission import AdmissionSettings

BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
log = logging.getLogger("goodput_runtime")
N = TypeVar("N", int, float)
TERMINATION_MESSAGE_PATH = "/dev/termination-log"
TERMINATION_MESSAGE_BYTES = 4000  # Kubernetes keeps 4 KiB of it


def write_termination_message(path: str, reason: str) -> None:
    """Why the runtime exits, in one line, where Kubernetes shows it (``kubectl describe pod``).

    Writes only to an existing regular file, or a new file in an existing directory other than
    /dev, so on a host outside Kubernetes the default path creates nothing. Never raises.
    """
    try:
        target = Path(path)
        if not (
            target.is_file()
            or (not target.exists() and target.parent.is_dir() and target.parent.resolve() != Path("/dev"))
        ):
            return
        line = " ".join(reason.split()).encode()[:TERMINATION_MESSAGE_BYTES].decode(errors="ignore")
        target.write_text(line + "\n")
    except Exception as exc:  # a reason we cannot record must not hide the real exit
        log.warning("Cannot write the termination message to %s: %s", path, exc)


def termination_message_path(argv: list[str] | None) -> str:
    """``--termination-message-path`` from a command line that may not parse as a whole."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--termination-message-path", default=TERMINATION_MESSAGE_PATH)
    try:
        known, _ = pre.parse_known_args(sys.argv[1:] if argv is None else argv)
    except (argparse.ArgumentError, SystemExit):
        return TERMINATION_MESSAGE_PATH
    return str(known.termination_message_path)


class ReasonedArgumentParser(argparse.ArgumentParser):
    """Writes why the command line was refused to the termination message file, then exits 2."""

    termination_path = TERMINATION_MESSAGE_PATH

    def error(self, message: str) -> NoReturn:
        write_termination_message(self.termination_path, f"Invalid arguments: {message}")
        super().error(message)


def default(name: str):
    return EngineConfig.__dataclass_fields__[name].default


def byte_size(text: str) -> int:
    """``536870912``, ``512Mi``, ``2Gi``, ``1.5G`` (Kubernetes quantity suffixes)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KkMmGgTt]i?|[Bb])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (examples: 536870912, 512Mi, 2Gi)")
    value = float(match.group(1)) * BYTE_UNITS[(match.group(2) or "").lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least one byte: {text!r}")
    return int(value)


def seconds(text: str) -> float:
    """``0.5``, ``0.5s`` or ``500ms``."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a duration in seconds: {text!r} (examples: 0.5, 500ms)")
    return float(match.group(1)) / (1000 if match.group(2) == "ms" else 1)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows a flag's default only when it has one; unset flags explain themselves in their help."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


def positive_seconds(text: str) -> float:
    value = seconds(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than zero: {text!r}")
    return value


def bounded(
    parse: Callable[[str], N], kind: str, low: N, high: N | None = None, low_open: bool = False, high_open: bool = False
) -> Callable[[str], N]:
    """An argparse type: the text as `parse` reads it ("not <kind>" where it cannot), at least `low` (more
    than it where `low_open`) and at most `high` (less than it where `high_open`)."""
    if high is None:
        bounds = f"{'more than' if low_open else 'at least'} {low:g}"
    else:
        bounds = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def check(text: str) -> N:
        try:
            value = parse(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {kind}: {text!r}") from None
        above = value > low if low_open else value >= low
        below = high is None or (value < high if high_open else value <= high)
        if not (above and below):
            raise argparse.ArgumentTypeError(f"must be {bounds}: {text!r}")
        return value

    return check


positive_int = bounded(int, "an integer", 1)
non_negative_int = bounded(int, "an integer", 0)
fraction = bounded(float, "a number", 0.0, 1.0, low_open=True)
margin_fraction = bounded(float, "a number", 0.0, 1.0, high_open=True)


def port_number(text: str) -> int:
    value = int(text) if text.isdigit() else -1
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text!r}")
    return value


def build_parser() -> ReasonedArgumentParser:
    p = ReasonedArgumentParser(
        prog="python -m goodput_runtime", description=__doc__, formatter_class=DefaultsHelpFormatter
    )
    model = p.add_argument_group("model")
    model.add_argument(
        "--model",
        required=True,
        help="local model directory, a .gguf file (or a directory holding one), a Hugging Face id "
        "(org/name) or one GGUF file of a Hub repository (hf://org/name/file.gguf)",
    )
    model.add_argument("--served-model-name", help="the name clients send as 'model' (default: --model)")
    model.add_argument("--revision", help="Hugging Face revision (branch, tag or commit)")
    model.add_argument(
        "--dtype",
        default=default("dtype"),
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights, activations and KV cache; auto: float32 on CPU, the checkpoint's bf16/fp16 on GPU. "
        "bfloat16 on CPU needs AVX-512 BF16 or AMX and runs in float32, with a warning, where the CPU has neither",
    )
    model.add_argument("--device", default=default("device"), choices=["auto", "cpu", "cuda"])
    model.add_argument("--max-model-len", type=positive_int, help="context length (default: the model's)")
    model.add_argument(
        "--quantization",
        default="none",
        choices=list(quantization_rules.METHODS),
        help="int8: weight-only int8 with per-channel scales (closest to the unquantized model); "
        "int8-w8a8: int8 weights and per-token int8 activations (faster on CPU, less accurate); "
        "fp8: e4m3 weights (GPUs of compute capability 8.9+)",
    )
    model.add_argument("--quantize-lm-head", action="store_true", help="quantize the LM head too")
    model.add_argument(
        "--tensor-parallel-size",
        type=positive_int,
        default=1,
        help="ranks the model is split over, one process each (gloo on CPU, NCCL on GPU)",
    )
    model.add_argument(
        "--pipeline-parallel-size",
        type=positive_int,
        default=1,
        help="stages the decoder's layers are split into, each of --tensor-parallel-size ranks; a step passes "
        "through the stages in turn",
    )
    model.add_argument(
        "--node-rank",
        type=non_negative_int,
        default=None,
        help="this pod's index in a replica spanning pods: 0 serves HTTP, the others serve /health and run their "
        "ranks (default: $GOODPUT_NODE_RANK, $LWS_WORKER_INDEX, the ordinal ending $GOODPUT_POD_NAME, else 0)",
    )
    model.add_argument(
        "--nnodes",
        type=positive_int,
        default=None,
        help="pods of the replica, each running tensor × pipeline / nnodes ranks "
        "(default: $GOODPUT_NNODES, $LWS_GROUP_SIZE, else 1)",
    )
    model.add_argument(
        "--leader-address",
        default=None,
        help="HOST:PORT of pod 0, where the ranks meet (torch.distributed's store; PORT+1 carries the pods' "
        "heartbeats) (default: $GOODPUT_LEADER_ADDRESS, $LWS_LEADER_ADDRESS)",
    )
    engine = p.add_argument_group("engine")
    engine.add_argument(
        "--max-num-seqs", type=positive_int, default=default("max_num_seqs"), help="most requests running at once"
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=default("max_num_batched_tokens"),
        help="token budget of one step",
    )
    engine.add_argument(
        "--block-size", type=positive_int, default=default("block_size"), help="tokens per KV cache block"
    )
    engine.add_argument(
        "--kv-cache-memory",
        type=byte_size,
        help="KV cache size on CPU, in bytes (512Mi, 2Gi); default a quarter of free memory "
        "(within the container's memory limit), at most 4Gi",
    )
    engine.add_argument(
        "--gpu-memory-utilization",
        type=fraction,
        default=default("gpu_memory_utilization"),
        help="share of GPU memory for weights, activations and KV cache",
    )
    engine.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=default("enable_prefix_caching"),
        help="share KV blocks of common prefixes",
    )
    engine.add_argument(
        "--kv-offload-bytes",
        type=byte_size,
        default=default("kv_offload_bytes"),
        help="a second KV tier on local disk of this many bytes (8Gi): blocks evicted from the KV cache "
        "are kept there and loaded back on a prefix hit instead of recomputed; 0: none",
    )
    engine.add_argument(
        "--kv-offload-dir",
        default=default("kv_offload_dir"),
        metavar="DIR",
        help="local directory of the KV offload tier's file (default: the system's temporary directory)",
    )
    engine.add_argument(
        "--max-queue",
        type=positive_int,
        default=default("max_queue"),
        help="most requests waiting; beyond it requests get 429",
    )
    engine.add_argument("--seed", type=int, default=default("seed"))
    engine.add_argument(
        "--num-threads",
        type=positive_int,
        help="CPU threads per forward pass (per rank under tensor parallelism); default: the "
        "container's CPU limit (cgroup quota), else every usable core",
    )
    engine.add_argument(
        "--step-tuning",
        default=default("step_tuning"),
        choices=["auto", "off"],
        help="on CPU with the compact modules: time decode steps of 1 to 64 sequences at start "
        "(about a second per 100 ms of step) and run each size with the threads (all or one) "
        "and matrix-product form that ran it fastest; off: all threads, F.linear",
    )
    engine.add_argument(
        "--cpu-contention",
        default=default("cpu_contention"),
        choices=["auto", "off"],
        help="on CPU with the compact modules: run steps on one thread while other processes take "
        "the cores (the kernel's run delay of the compute threads over 20%% of their time for "
        "3 s), trying the planned threads again after 2 s, then at doubling gaps up to 20 s; off: "
        "always the planned threads",
    )
    engine.add_argument(
        "--pooling",
        choices=["last", "mean"],
        help="how /v1/embeddings pools the model's final hidden states: the last token's, or the "
        "mean over every token (default: last, as for every decoder-only causal LM)",
    )
    engine.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json", "mistral"],
        help="the format of the model's tool calls (default: the one its chat template teaches, else hermes)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on GPU, run decode steps eagerly instead of replaying captured CUDA graphs",
    )
    engine.add_argument(
        "--model-impl",
        default=default("model_impl"),
        choices=["auto", "transformers"],
        help="auto: the runtime's compact modules for Llama, Mistral and Qwen2 (fused projections), "
        "transformers' modules for the rest; transformers: transformers' modules always",
    )
    engine.add_argument(
        "--compile",
        action="store_true",
        default=default("compile"),
        help="compile the compact modules' stack of decoder layers into one torch.compile graph "
        "per step of up to 256 tokens (inductor; on a GPU under the decode CUDA graphs) and warm "
        "it up at start",
    )
    adapters = p.add_argument_group("LoRA adapters")
    adapters.add_argument(
        "--enable-lora",
        action="store_true",
        default=default("enable_lora"),
        help="serve LoRA adapters in PEFT's format (on by itself with --lora-modules): a request's 'model' "
        "names the adapter",
    )
    adapters.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=list(default("lora_modules")),
        metavar="NAME=PATH",
        help="adapters loaded at start: a name and a directory with adapter_config.json and "
        "adapter_model.safetensors (file:// accepted)",
    )
    adapters.add_argument(
        "--max-loras", type=positive_int, default=default("max_loras"), help="adapter slots a step can use"
    )
    adapters.add_argument(
        "--max-cpu-loras",
        type=positive_int,
        default=default("max_cpu_loras"),
        help="adapters whose weights are held in memory, least recently used dropped first (default: 4 x --max-loras)",
    )
    adapters.add_argument(
        "--max-lora-rank", type=positive_int, default=default("max_lora_rank"), help="the largest rank served"
    )
    adapters.add_argument(
        "--pinned-loras",
        nargs="+",
        default=list(default("pinned_loras")),
        metavar="NAME",
        help="adapters of --lora-modules never dropped from memory, their slots reused last",
    )
    adapters.add_argument(
        "--lora-source",
        default=default("lora_source"),
        metavar="DIR",
        help="a directory of adapters, one per subdirectory: a request naming one not loaded yet loads it "
        "(the request waits for the load); with it LoRA is enabled",
    )
    adapters.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=default("allow_runtime_lora_updating"),
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind --api-key when set)",
    )
    spec = p.add_argument_group("speculative decoding")
    spec.add_argument(
        "--speculative-method",
        choices=["ngram", "draft"],
        help="propose tokens for the target model to verify: ngram (prompt lookup in the request's "
        "own tokens) or draft (--speculative-model); default: off",
    )
    spec.add_argument(
        "--num-speculative-tokens",
        type=positive_int,
        default=default("num_speculative_tokens"),
        help="tokens proposed per step and request",
    )
    spec.add_argument(
        "--speculative-model",
        help="the draft model for --speculative-method draft (a directory, .gguf or Hub id), with "
        "the target's tokenizer",
    )
    spec.add_argument(
        "--ngram-min", type=positive_int, default=default("ngram_min"), help="shortest suffix prompt lookup matches"
    )
    spec.add_argument(
        "--ngram-max", type=positive_int, default=default("ngram_max"), help="longest suffix prompt lookup matches"
    )
    spec.add_argument(
        "--speculative-max-batch",
        type=non_negative_int,
        help="speculate only while at most this many requests run (0: never); default: timed at "
        "start-up, the largest batch at which verifying the proposals costs less than it saves",
    )
    serving = p.add_argument_group("serving")
    serving.add_argument("--host", default="0.0.0.0")
    serving.add_argument("--port", type=port_number, default=8000, help="0 picks a free port")
    serving.add_argument("--slo-ttft", type=positive_seconds, help="time-to-first-token target, seconds")
    serving.add_argument("--slo-tpot", type=positive_seconds, help="time-per-output-token target, seconds")
    serving.add_argument(
        "--slo-scheduling",
        choices=["on", "off"],
        default=default("slo_scheduling"),
        help="on (with --slo-ttft or --slo-tpot): waiting prompts by TTFT deadline (those that can still "
        "make it first), and online prefill chunks beside running decodes sized to what keeps their step "
        "within --slo-tpot; off by default: measured on open-loop traffic it cost TTFT and goodput "
        "(bench/README.md, SLO capacity)",
    )
    serving.add_argument(
        "--batch-cap",
        choices=["auto", "off"],
        default=default("batch_cap"),
        help="cap the batch (priority above 0) sequences that step beside online ones so a step, "
        "timed as it runs, stays within --slo-tpot × (1 − --batch-cap-margin); the others "
        "pause until the online ones leave; auto: on when --slo-tpot is set",
    )
    serving.add_argument(
        "--batch-cap-margin",
        type=margin_fraction,
        default=default("batch_cap_margin"),
        help="share of --slo-tpot the batch cap keeps free (steps that admit an online request run longer)",
    )
    serving.add_argument(
        "--admission",
        choices=["auto", "on", "off"],
        default="auto",
        help="refuse with 429 and Retry-After, at once, a request whose predicted time to first "
        "token (from the measured prefill and decode rates, the queue ahead and the free KV "
        "cache) exceeds --slo-ttft, or that would take the running decodes' time per output token "
        "past --slo-tpot; auto: on when either is set",
    )
    serving.add_argument(
        "--admission-margin",
        type=margin_fraction,
        default=0.1,
        help="safety margin of admission: refuse when the predicted TTFT exceeds --slo-ttft × (1 − margin)",
    )
    serving.add_argument(
        "--shutdown-grace",
        type=seconds,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (after --shutdown-delay)",
    )
    serving.add_argument(
        "--shutdown-delay",
        type=seconds,
        default=0.0,
        help="seconds after SIGTERM during which /health is 503 but new requests are still "
        "served, each with Connection: close, while Kubernetes removes the pod from its "
        "endpoints; then new requests get 503 and --shutdown-grace begins",
    )
    serving.add_argument(
        "--termination-message-path",
        default=TERMINATION_MESSAGE_PATH,
        help="file that gets a one-line reason when the runtime cannot start; written only "
        "if it exists, or if its directory exists and is not /dev",
    )
    serving.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="ask every request but /health and /metrics for 'Authorization: Bearer KEY' "
        "(repeatable; default: the comma-separated keys in $GOODPUT_API_KEY, if set). "
        "The environment keeps keys out of the process list",
    )
    serving.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    parser.termination_path = termination_message_path(argv)
    args = parser.parse_args(argv)
    args.api_keys = split_keys(args.api_key or [os.environ.get(API_KEY_ENV, "")])
    if args.admission == "on" and args.slo_ttft is None and args.slo_tpot is None:
        parser.error("--admission on needs --slo-ttft or --slo-tpot: admission refuses requests predicted to miss them")
    if args.speculative_method == "draft" and not args.speculative_model:
        parser.error("--speculative-method draft needs --speculative-model")
    if args.speculative_model and args.speculative_method != "draft":
        parser.error("--speculative-model is only used with --speculative-method draft")
    if args.ngram_min > args.ngram_max:
        parser.error(f"--ngram-min {args.ngram_min} exceeds --ngram-max {args.ngram_max}")
    names = [name for name, _ in args.lora_modules]
    if len(set(names)) != len(names):
        parser.error("--lora-modules names an adapter twice")
    unknown = sorted(set(args.pinned_loras) - set(names))
    if unknown:
        parser.error(f"--pinned-loras {' '.join(unknown)}: not among --lora-modules")
    return args


def admission_settings(args: argparse.Namespace) -> AdmissionSettings | None:
    """SLO-aware admission: on by default wherever a TTFT or TPOT target is set."""
    from goodput_runtime.server.admission import AdmissionSettings

    if args.admission == "off" or (args.slo_ttft is None and args.slo_tpot is None):
        return None
    return AdmissionSettings(args.slo_ttft, args.admission_margin, args.slo_tpot)


def lora_module(value: str) -> tuple[str, str]:
    """NAME=PATH of --lora-modules."""
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{value!r}: expected NAME=PATH")
    return name, path


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings: every EngineConfig field from the flag of the same name."""
    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(EngineConfig)}
    values["lora_modules"] = tuple(values["lora_modules"])
    values["pinned_loras"] = tuple(values["pinned_loras"])
    return EngineConfig(**values)


async def run(args: argparse.Namespace) -> int:
    from goodput_runtime.metrics import RuntimeMetrics
    from goodput_runtime.server.lifecycle import serve

    config = engine_config(args)
    metrics = RuntimeMetrics(config.model_name, args.slo_ttft, args.slo_tpot)
    stop, force = asyncio.Event(), asyncio.Event()

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set():
            log.warning("Received %s again: aborting in-flight requests now", sig.name)
            force.set()
        else:
            log.info("Received %s: shutting down", sig.name)
            stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    return await serve(
        config,
        metrics,
        args.host,
        args.port,
        args.shutdown_grace,
        stop,
        force,
        shutdown_delay=args.shutdown_delay,
        api_keys=args.api_keys,
        admission=admission_settings(args),
        freeze_heap=True,
        on_failure=lambda reason: write_termination_message(args.termination_message_path, reason),
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        from goodput_runtime.engine import rendezvous

        group = rendezvous.group_of(args.node_rank, args.nnodes, args.leader_address)
        if group.node_rank > 0:  # a worker pod of a replica spanning pods
            from goodput_runtime.engine.tp_worker import serve_node

            return serve_node(engine_config(args), group, args.host, args.port)
        return asyncio.run(run(args))
    except Exception as exc:
        write_termination_message(args.termination_message_path, f"Runtime crashed: {type(exc).__name__}: {exc}")
        raise


if __name__ == "__main__":
    sys.exit(main())
