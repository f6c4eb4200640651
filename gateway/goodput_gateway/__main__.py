"""`python -m goodput_gateway`: one OpenAI endpoint for every InferenceService in the cluster."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from goodput_contract.version import VERSION
from goodput_gateway import batch, held_routing, peer_pull, prompt_digests, routing
from goodput_gateway.app import FairSettings, Gateway, build_app
from goodput_gateway.auth import ServiceKeys
from goodput_gateway.disagg import DisaggSettings, TwoPhase
from goodput_gateway.discovery import Registry, Split, start_watches
from goodput_gateway.held_routing import HeldRouter
from goodput_gateway.holding import Holds
from goodput_gateway.kv_index import KvIndex
from goodput_gateway.kv_index_keys import ReplicaKeys
from goodput_gateway.loads import LoadScraper
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.peer_pull import PeerPulls
from goodput_gateway.pipelines import PipelineMetrics, PipelineServer, PipelineTable, start_watch
from goodput_gateway.prompt_digests import PromptDigests
from goodput_gateway.proxy import Proxy, ProxySettings
from goodput_gateway.tenants import TENANTS_KEY, Tenants
from goodput_operator.k8s import Kube, load_config

logger = logging.getLogger("goodput_gateway")


def _env(name: str, default: str) -> str:
    return os.environ.get(name) or default


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m goodput_gateway", description=__doc__)
    p.add_argument("--version", action="version", version=f"goodput-gateway {VERSION}")
    p.add_argument("--host", default=_env("GATEWAY_HOST", "0.0.0.0"))
    p.add_argument("--port", type=int, default=int(_env("GATEWAY_PORT", "8000")), help="0 picks a free port")
    p.add_argument(
        "--max-held-requests",
        type=int,
        default=int(_env("GATEWAY_MAX_HELD_REQUESTS", "100")),
        help="per service: requests held while it has no ready replica; more get 429",
    )
    p.add_argument(
        "--hold-seconds",
        type=float,
        default=float(_env("GATEWAY_HOLD_SECONDS", "600")),
        help="how long a held request waits for a ready replica before a 503",
    )
    p.add_argument(
        "--scrape-seconds",
        type=float,
        default=float(_env("GATEWAY_SCRAPE_SECONDS", "1.5")),
        help="how often each replica's queue and KV usage are read from its /metrics",
    )
    p.add_argument(
        "--load-epsilon",
        type=float,
        default=float(_env("GATEWAY_LOAD_EPSILON", str(routing.EPSILON))),
        help="a replica above (1 + this) x the mean load loses its turn",
    )
    p.add_argument(
        "--attempts",
        type=int,
        default=int(_env("GATEWAY_ATTEMPTS", "3")),
        help="replicas tried for a request that fails before response headers",
    )
    p.add_argument(
        "--shutdown-delay",
        type=float,
        default=float(_env("GATEWAY_SHUTDOWN_DELAY", "5")),
        help="after SIGTERM: seconds of serving on with /health at 503, while endpoints drop this pod",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=float(_env("GATEWAY_SHUTDOWN_GRACE", "45")),
        help="then: seconds in-flight requests (streams) get to finish",
    )
    p.add_argument(
        "--held-routing",
        choices=("on", "off"),
        default=_env("GATEWAY_HELD_ROUTING", "on"),
        help="policy prefix: route by the prefix blocks each replica reports holding (its /kv/events), the "
        "hash ring where none is known; off: the ring alone",
    )
    p.add_argument(
        "--held-offload-weight",
        type=float,
        default=float(_env("GATEWAY_HELD_OFFLOAD_WEIGHT", str(held_routing.OFFLOAD_WEIGHT))),
        help="what a prompt block in a replica's offload tier is worth against one in its device KV cache",
    )
    p.add_argument(
        "--peer-pulls",
        choices=("on", "off"),
        default=_env("GATEWAY_PEER_PULLS", "on"),
        help="held routing: where the chosen replica holds less of a prompt than another, have it pull the "
        "prefix from that one (replicas of --kv-transfer-role both only; docs/kv-cache.md)",
    )
    p.add_argument(
        "--peer-pull-min-blocks",
        type=int,
        default=int(_env("GATEWAY_PEER_PULL_MIN_BLOCKS", str(peer_pull.MIN_BLOCKS))),
        help="the fewest blocks a holder must hold beyond the chosen replica for a peer pull",
    )
    p.add_argument(
        "--digest-timeout",
        type=float,
        default=float(_env("GATEWAY_DIGEST_TIMEOUT", str(prompt_digests.TIMEOUT_S))),
        help="seconds a replica gets to answer a prompt's block digests before the ring decides",
    )
    p.add_argument(
        "--static-prefill",
        action="append",
        default=[],
        metavar="NAME=URL[,URL...]",
        help="with --static-model: NAME is disaggregated, these URLs its prefill pool (repeatable)",
    )
    p.add_argument(
        "--static-threshold",
        type=int,
        default=512,
        help="with --static-prefill: uncached prompt tokens below which the decode replica prefills itself",
    )
    p.add_argument("--prefix-chunk-chars", type=int, default=routing.CHUNK_CHARS)
    p.add_argument("--prefix-chunks", type=int, default=routing.PREFIX_CHUNKS)
    p.add_argument(
        "--static-model",
        action="append",
        default=[],
        metavar="NAME=URL[,URL...]",
        help="serve NAME from these replica URLs instead of discovering InferenceServices (no cluster "
        "needed; repeatable)",
    )
    p.add_argument(
        "--static-pipeline",
        action="append",
        default=[],
        metavar="FILE",
        help="with --static-model: serve the InferencePipelines in this YAML file (repeatable)",
    )
    p.add_argument(
        "--static-policy",
        choices=routing.POLICIES,
        default="prefix",
        help="the routing policy of --static-model services",
    )
    p.add_argument(
        "--database",
        default=_env("GATEWAY_DATABASE", ""),
        help="the batch API's store: sqlite:///PATH (one gateway, or several sharing the file on one "
        "node) or postgresql://... (any number of gateways); unset: the batch API is off, or relayed "
        "(--batch-url)",
    )
    p.add_argument(
        "--batch-url",
        default=_env("GATEWAY_BATCH_URL", ""),
        help="without --database: relay the batch API (/v1/files, /v1/batches) to the gateway at this URL, "
        "the one that owns the store (e.g. http://goodput-gateway-batch)",
    )
    p.add_argument(
        "--batch-file-dir",
        default=_env("GATEWAY_BATCH_FILE_DIR", ""),
        help="keep the bytes of batch files here instead of in the database",
    )
    p.add_argument(
        "--batch-lease-seconds",
        type=float,
        default=float(_env("GATEWAY_BATCH_LEASE_SECONDS", "30")),
        help="a batch line claimed by a gateway that stopped returns to the others after this long",
    )
    p.add_argument(
        "--batch-target-attainment",
        type=float,
        default=float(_env("GATEWAY_BATCH_TARGET_ATTAINMENT", "0.99")),
        help="batch concurrency halves while the replicas' online SLO attainment is below this",
    )
    p.add_argument(
        "--batch-max-per-replica",
        type=int,
        default=int(_env("GATEWAY_BATCH_MAX_PER_REPLICA", "32")),
        help="the most batch lines in flight per ready replica",
    )
    p.add_argument(
        "--api-key-ttl",
        type=float,
        default=float(_env("GATEWAY_API_KEY_TTL", "30")),
        help="seconds a service's API keys, read from its Secret, are kept before reading it again",
    )
    p.add_argument(
        "--tenants-secret",
        default=_env("GATEWAY_TENANTS_SECRET", ""),
        metavar="NAMESPACE/NAME",
        help="tenants on: their keys and limits, YAML under the key tenants.yaml of this Secret",
    )
    p.add_argument(
        "--tenants-file",
        default=_env("GATEWAY_TENANTS_FILE", ""),
        help="tenants on: their keys and limits in this YAML file (read again every --api-key-ttl seconds)",
    )
    p.add_argument(
        "--tenant-metrics-cap",
        type=int,
        default=int(_env("GATEWAY_TENANT_METRICS_CAP", "100")),
        help="tenants with their own label in the per-tenant series; the rest count as 'other'",
    )
    p.add_argument(
        "--max-in-flight-per-replica",
        type=int,
        default=int(_env("GATEWAY_MAX_IN_FLIGHT_PER_REPLICA", "0")),
        help="requests in flight per ready replica of a service before the rest wait, served by priority "
        "class and weighted fair turn across tenants; 0: no cap",
    )
    p.add_argument(
        "--queue-seconds",
        type=float,
        default=float(_env("GATEWAY_QUEUE_SECONDS", "60")),
        help="how long a request waits for its turn at a capped service before a 429",
    )
    p.add_argument("--log-level", default=_env("LOG_LEVEL", "INFO"))
    return p


async def serve(args: argparse.Namespace, stop: asyncio.Event) -> None:
    metrics = GatewayMetrics()
    registry = Registry()
    pipelines = PipelineTable()
    watches = []
    kube = None
    if args.static_model:
        split = Split(threshold_tokens=args.static_threshold)
        registry.set_static(
            parse_static(args.static_model), args.static_policy, parse_static(args.static_prefill), split
        )
        pipelines.load_files(args.static_pipeline, "static")
    else:
        api = load_config()
        api.user_agent = "goodput-gateway"
        kube = Kube(api, "goodput-gateway")
        watches = [*await start_watches(kube=kube, registry=registry), *await start_watch(kube, pipelines)]
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=30)
    session = aiohttp.ClientSession(
        connector=connector, auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, sock_connect=5)
    )

    def replicas() -> set[str]:  # every ready replica, the prefill pools' included
        keys = [*registry.services, *(s.prefill_key for s in registry.services.values() if s.disaggregation)]
        return {u for k in keys for u in registry.ready(k)}

    keys = ServiceKeys(kube, args.api_key_ttl)
    replica_keys = ReplicaKeys(keys)  # a replica's KV subscription and /v1/models carry its service's runtime key
    scraper = LoadScraper(session, replicas, args.scrape_seconds, authorization=replica_keys)
    index = KvIndex(session, authorization=replica_keys)

    def learn_adapters() -> None:  # each service serves the adapters any of its ready replicas lists
        for key in list(registry.services):
            registry.learn_adapters(key, [c for u in registry.ready(key) for c in scraper.cards.get(u, ())])
        replicas_now = replica_keys.learn(registry)  # the next round's keys, for replicas that joined
        if args.held_routing == "on":
            index.sync(replicas_now)
            metrics.kv_index_seen(index)

    scraper.scraped_all = learn_adapters
    holds = Holds(registry, metrics, args.max_held_requests, args.hold_seconds)
    settings = ProxySettings(
        epsilon=args.load_epsilon,
        attempts=max(1, args.attempts),
        chunk_chars=args.prefix_chunk_chars,
        prefix_chunks=args.prefix_chunks,
    )
    held = None
    if args.held_routing == "on":
        held = HeldRouter(index, PromptDigests(session, args.digest_timeout), args.held_offload_weight)
        if args.peer_pulls == "on":
            held.pulls = PeerPulls(session, metrics.registry, args.peer_pull_min_blocks)
    proxy = Proxy(registry, holds, scraper, session, metrics, settings, held)
    proxy.disagg = TwoPhase(proxy, DisaggSettings())
    pipeline_server = PipelineServer(pipelines, registry, proxy, PipelineMetrics(metrics.registry), keys)
    gateway = Gateway(
        registry,
        proxy,
        metrics,
        pipeline_server,
        keys,
        tenants_from(args, kube, metrics),
        FairSettings(max(0, args.max_in_flight_per_replica), args.queue_seconds),
    )
    batch_settings = batch.BatchSettings(
        database=args.database,
        forward_url=args.batch_url,
        file_dir=Path(args.batch_file_dir) if args.batch_file_dir else None,
        dispatch=batch.DispatchSettings(
            lease_seconds=args.batch_lease_seconds,
            target_attainment=args.batch_target_attainment,
            per_replica_cap=args.batch_max_per_replica,
        ),
    )
    runner = web.AppRunner(
        build_app(gateway, batch_settings),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=args.shutdown_grace,
    )
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, backlog=2048).start()
    logger.info("Listening on http://%s:%d", args.host, runner.addresses[0][1])
    scraping = asyncio.create_task(scraper.run_forever())
    try:
        await stop.wait()
        gateway.stopping = True
        logger.info("Stopping: serving on for %.0f s while endpoints drop this pod", args.shutdown_delay)
        await asyncio.sleep(args.shutdown_delay)
        logger.info("Draining: up to %.0f s for requests in flight", args.shutdown_grace)
    finally:
        scraping.cancel()
        await index.close()
        for w in watches:
            w.stopping.set()
        await runner.cleanup()
        await session.close()


def tenants_from(args: argparse.Namespace, kube: Kube | None, metrics: GatewayMetrics) -> Tenants:
    read: Callable[[], Awaitable[str | None]] | None = None
    where = ""
    if args.tenants_secret:
        namespace, _, name = args.tenants_secret.partition("/")
        if not namespace or not name:
            raise SystemExit(f"--tenants-secret {args.tenants_secret!r}: expected NAMESPACE/NAME")
        if kube is None:
            raise SystemExit("--tenants-secret needs a cluster; with --static-model use --tenants-file")
        cluster = kube

        async def read_secret() -> str | None:
            return await cluster.secret_value(namespace, name, TENANTS_KEY)

        read, where = read_secret, f"Secret {namespace}/{name}, key {TENANTS_KEY}"
    elif args.tenants_file:
        path = Path(args.tenants_file)

        async def read_file() -> str | None:
            return await asyncio.to_thread(path.read_text)

        read, where = read_file, str(path)
    return Tenants(read, where, metrics.registry, args.api_key_ttl, args.tenant_metrics_cap)


def parse_static(values: list[str]) -> dict[str, tuple[str, ...]]:
    models: dict[str, tuple[str, ...]] = {}
    for value in values:
        name, _, urls = value.partition("=")
        if not name or not urls:
            raise SystemExit(f"--static-model {value!r}: expected NAME=URL[,URL...]")
        models[name] = tuple(u.rstrip("/") for u in urls.split(",") if u)
    return models


def main() -> None:
    p = parser()
    args = p.parse_args()
    if args.database and args.batch_url:
        p.error(
            "--database and --batch-url: give one (this gateway owns the batch store, or relays to the one that does)"
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await serve(args, stop)

    asyncio.run(run())


if __name__ == "__main__":
    main()
