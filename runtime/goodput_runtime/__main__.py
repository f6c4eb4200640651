"""``python -m goodput_runtime --model <dir or org/name>``: serve a model over OpenAI's API."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from goodput_runtime.cli_flags import build_parser
from goodput_runtime.cli_types import (
    TERMINATION_MESSAGE_PATH as TERMINATION_MESSAGE_PATH,  # re-exported: tests and tools import them from here
)
from goodput_runtime.cli_types import byte_size as byte_size
from goodput_runtime.cli_types import termination_message_path, write_termination_message
from goodput_runtime.config import EngineConfig
from goodput_runtime.server.auth import API_KEY_ENV, split_keys

if TYPE_CHECKING:
    from goodput_runtime.server.admission import AdmissionSettings

log = logging.getLogger("goodput_runtime")


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
    """SLO-aware admission: on by default; without --slo-ttft or --slo-tpot it judges only the requests
    that carry their own targets (server/request_slo.py)."""
    from goodput_runtime.server.admission import AdmissionSettings

    if args.admission == "off":
        return None
    return AdmissionSettings(args.slo_ttft, args.admission_margin, args.slo_tpot)


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
