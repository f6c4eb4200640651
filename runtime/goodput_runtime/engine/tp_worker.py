"""Ranks other than the serving one: ``python -m goodput_runtime.engine.tp_worker`` and worker pods.

A follower rank process is started by its pod's first rank, never by hand: it loads its share
of the model like rank 0 (its tensor shard of its pipeline stage), then runs every step rank 0
sends until told to stop. A worker pod of a replica spanning pods (``--node-rank`` above 0)
runs ``serve_node``: it serves /health alone, joins the leader, starts its pod's other ranks and
is itself the first of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine import parallel, pipeline, rendezvous
from goodput_runtime.engine.config_error import EngineConfigError
from goodput_runtime.engine.model_runner import ModelRunner

log = logging.getLogger("goodput_runtime.tp_worker")


def die_with_parent() -> None:
    """Exit when the serving process is gone, however it went (a kill -9 leaves no one to say so)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.error("The serving process is gone; exiting")
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def follow(
    config: EngineConfig,
    model_dir: Path,
    rank: int,
    world: int,
    init_method: str,
    local_rank: int = 0,
    on_ready: Callable[[], None] | None = None,
) -> None:
    """Load this rank's share, then run each step rank 0 sends until it sends None."""
    from goodput_runtime.engine.rank_model import load_for_rank

    model, device = load_for_rank(config, model_dir, rank, world, init_method, local_rank)
    num_blocks = parallel.broadcast()
    runner = ModelRunner(model, num_blocks, config.block_size, config.seed, config.tensor_parallel_size)
    log.info("Rank %d of %d ready on %s with %d KV blocks", rank, world, device, num_blocks)
    if on_ready is not None:
        on_ready()
    while True:
        items = parallel.broadcast()
        if items is None:
            break
        runner.execute(items, logits=False)
    rendezvous.stop_watching()
    torch.distributed.destroy_process_group()


def serve_node(config: EngineConfig, group: rendezvous.Group, host: str, port: int) -> int:
    """A worker pod: /health on host:port, its ranks joined to the leader's, until the leader stops."""
    from goodput_runtime.loader import resolve_model_path

    if refused := pipeline.microbatch_problem(config.pipeline_microbatches, config.pipeline_parallel_size):
        raise EngineConfigError(refused)
    health = rendezvous.HealthServer(host, port)
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    per_node = group.ranks_per_node(world)
    first = group.first_rank(world)
    model_dir = resolve_model_path(config.model, config.revision)
    log.info("Pod %d of %d: ranks %d..%d of %d", group.node_rank, group.nnodes, first, first + per_node - 1, world)
    rendezvous.join(group)
    followers = parallel.Followers(
        list(range(first + 1, first + per_node)),
        world,
        group.init_method,
        model_dir,
        json.dumps(dataclasses.asdict(config)),
    )

    def ready() -> None:
        health.ready = True

    follow(config, model_dir, first, world, group.init_method, 0, ready)
    followers.stop(tell=False)
    health.server.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True, help="its index among its pod's ranks")
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--init-method", required=True, help="tcp://host:port of the group's store")
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--config", required=True, help="the engine config as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    die_with_parent()
    config = EngineConfig(**json.loads(args.config))
    follow(config, Path(args.model_dir), args.rank, args.world_size, args.init_method, args.local_rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
