"""A follower rank of tensor parallelism: ``python -m goodput_runtime.engine.tp_worker``.

Started by the serving process, never by hand. It loads and shards the model like rank 0,
then runs every step rank 0 sends until told to stop.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine import parallel
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--config", required=True, help="the engine config as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{args.rank} %(levelname)s %(message)s")
    die_with_parent()

    from goodput_runtime.engine.builder import load_for_rank

    config = EngineConfig(**json.loads(args.config))
    model, device = load_for_rank(config, Path(args.model_dir), args.rank, args.world_size, args.port)
    num_blocks = parallel.broadcast()
    runner = ModelRunner(model, num_blocks, config.block_size, config.seed, args.world_size)
    log.info("Rank %d of %d ready on %s with %d KV blocks", args.rank, args.world_size, device, num_blocks)
    while True:
        items = parallel.broadcast()
        if items is None:
            break
        runner.execute(items, logits=False)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
