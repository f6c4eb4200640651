"""`python -m goodput_operator`: the operator, run by kopf.

Cluster-wide unless --namespace (or WATCH_NAMESPACE) names one namespace. Uses the
in-cluster service account when there is one, else the current kubeconfig. SIGUSR1 writes every
thread's stack to stderr (`kubectl exec ... -- kill -USR1 1`, then the pod's log), and the process
goes on.

kopf stops the whole operator when one of its watches gets an error from the API server it does
not retry: a 404 for a custom resource, say, while a restarted API server has not yet served the
CRDs again. The process then starts kopf again after a pause (`run_with_restarts`), a few times
within ten minutes, before it gives up and exits for its pod to be restarted.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import logging
import os
import signal
import socket
import time
from collections.abc import Callable
from typing import Any, cast

import kopf
import prometheus_client
from kopf._cogs.clients.errors import APIError  # what a watch raises on the API server's error answers

from goodput_contract.version import VERSION
from goodput_operator.handlers import operator_settings, register
from goodput_operator.settings import Settings

log = logging.getLogger("goodput_operator")
RESTARTS = 5  # kopf runs ended by the API server's errors within RESTART_WINDOW before the process exits
RESTART_WINDOW = 600.0
RESTART_PAUSE = 2.0


def run_with_restarts(
    run: Callable[[], None],
    restarts: int = RESTARTS,
    pause: float = RESTART_PAUSE,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """run() until it returns. Where it ends with an error from the API server, it is called again
    after `pause` seconds, up to `restarts` times within RESTART_WINDOW; the next is raised."""
    ended: list[float] = []
    while True:
        try:
            run()
            return
        except APIError as e:
            now = clock()
            ended = [t for t in ended if now - t < RESTART_WINDOW] + [now]
            if len(ended) > restarts:
                raise
            log.warning(
                "kopf stopped on an error from the API server (%s %s); starting it again in %.0f s (%d of %d)",
                e.status,
                e,
                pause,
                len(ended),
                restarts,
            )
            sleep(pause)


def parse_args(argv: list[str] | None, defaults: Settings) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m goodput_operator", description=__doc__)
    parser.add_argument("--version", action="version", version=f"goodput-operator {VERSION}")
    parser.add_argument(
        "--namespace", default=defaults.namespace, help="watch one namespace (default: all; env WATCH_NAMESPACE)"
    )
    parser.add_argument("--runtime-image", default=defaults.runtime_image, help="env RUNTIME_IMAGE")
    parser.add_argument("--vllm-image", default=defaults.vllm_image, help="engine.kind vllm (env VLLM_IMAGE)")
    parser.add_argument(
        "--vllm-cpu-image",
        default=defaults.vllm_cpu_image,
        help="engine.kind vllm with resources.gpu 0 (env VLLM_CPU_IMAGE)",
    )
    parser.add_argument("--sglang-image", default=defaults.sglang_image, help="engine.kind sglang (env SGLANG_IMAGE)")
    parser.add_argument(
        "--liveness-port",
        type=int,
        default=defaults.liveness_port,
        help="port of /healthz, 0 for none (env LIVENESS_PORT)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=defaults.metrics_port,
        help="port of /metrics, 0 for none (env METRICS_PORT)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=defaults.resync_seconds,
        help="reconcile every service at least this often (env RESYNC_SECONDS)",
    )
    parser.add_argument(
        "--autoscaler-period-seconds",
        type=float,
        default=defaults.autoscaler_period_seconds,
        help="goodput autoscaler period (env AUTOSCALER_PERIOD_SECONDS)",
    )
    parser.add_argument(
        "--autoscaler-window-seconds",
        type=float,
        default=defaults.autoscaler_window_seconds,
        help="window for rates and attainment, the long one 5x (env AUTOSCALER_WINDOW_SECONDS)",
    )
    parser.add_argument(
        "--autoscaler-dispersion",
        choices=("on", "off"),
        default="on" if defaults.autoscaler_dispersion else "off",
        help="size the headroom with the arrivals' measured index of dispersion; off: plan as for Poisson "
        "arrivals, the dispersion still measured and shown (env AUTOSCALER_DISPERSION)",
    )
    parser.add_argument("--verbose", action="store_true", help="debug logging")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    defaults = Settings.from_env()
    args = parse_args(argv, defaults)
    settings = dataclasses.replace(
        defaults,
        namespace=args.namespace or None,
        runtime_image=args.runtime_image,
        vllm_image=args.vllm_image,
        vllm_cpu_image=args.vllm_cpu_image,
        sglang_image=args.sglang_image,
        liveness_port=args.liveness_port,
        metrics_port=args.metrics_port,
        resync_seconds=args.resync_seconds,
        autoscaler_period_seconds=args.autoscaler_period_seconds,
        autoscaler_window_seconds=args.autoscaler_window_seconds,
        autoscaler_dispersion=args.autoscaler_dispersion == "on",
    )
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck operator shows where it waits
    kopf.configure(verbose=args.verbose, log_prefix=True)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    if not args.verbose:  # kopf's line per handler call ("Handler 'child' succeeded") for every event, at scale
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    registry = kopf.OperatorRegistry()
    register(registry, settings)
    if settings.metrics_port:  # once per process: it outlives a restart of kopf
        prometheus_client.start_http_server(settings.metrics_port)
    run_with_restarts(
        lambda: kopf.run(
            registry=registry,
            settings=operator_settings(),
            standalone=True,
            clusterwide=settings.namespace is None,
            namespaces=[settings.namespace] if settings.namespace else (),
            liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz" if settings.liveness_port else None,
            memo=kopf.Memo(),
            # Named here: kopf's own guess asks the password database for the user, and a
            # non-root UID in a container usually has no entry there.
            identity=cast(Any, os.environ.get("POD_NAME") or f"{socket.gethostname()}@{os.getpid()}"),
        )
    )


if __name__ == "__main__":
    main()
