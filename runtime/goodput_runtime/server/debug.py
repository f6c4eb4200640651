"""``GET /debug/state``: what a leak would show — asyncio tasks, KV blocks, requests in flight, open files;
the prefix blocks held per KV tier and the offload tier's counters; the KV hand-off's leases and parked
requests; the step-time model that admission, the batch cap and the SLO's scheduling predict with.

Read by the soak benchmark (bench/soak.py) before and after a long run of mixed traffic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from goodput_runtime.engine.client import EngineClient


def open_files() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def state_of(engine: EngineClient | None, phase: str, requests_in_flight: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "phase": phase,
        "asyncio_tasks": len(asyncio.all_tasks()),
        "open_files": open_files(),
        "requests_in_flight": requests_in_flight,
    }
    if engine is not None:
        out.update(
            kv_blocks_free=engine.num_free_blocks,
            kv_blocks_total=engine.num_total_blocks,
            requests_waiting=engine.num_waiting,
            engine_streams=engine.num_streams,
        )
        out.update(kv_tiers(engine))
        model = step_time_model(engine)
        if model is not None:
            out["step_time_model"] = model
        agent = getattr(engine, "kv_transfer", None)
        if agent is not None:
            out["kv_transfer"] = kv_transfer(agent)
    return out


def kv_transfer(agent: Any) -> dict[str, Any]:
    """The KV hand-off's state (engine/kv_transfer/): leases held and the blocks under them, requests
    parked while their blocks arrive, and the counts since start."""
    return {
        "role": agent.role,
        "host": agent.host,  # where its transport listens (a gateway names it in peer pulls)
        "port": agent.port if agent.serves else None,
        "leases": len(agent.leases.leases),
        "lease_blocks": agent.leases.num_blocks,
        "lease_expiries": agent.leases.expired,
        "parked": len(agent.core.scheduler.parked),
        **dataclasses.asdict(agent.stats),
    }


def kv_tiers(engine: EngineClient) -> dict[str, Any]:
    """The prefix blocks held per tier (what GET /kv/events publishes) and the offload tier's state."""
    block_manager = engine.scheduler.block_manager
    out: dict[str, Any] = {}
    if block_manager.events is not None:
        out["kv_prefix_blocks"] = block_manager.events.counts()
    store = block_manager.offload
    if store is not None:
        stats = dataclasses.asdict(store.stats)
        stats.update(capacity_bytes=store.capacity, used_bytes=store.used_bytes, entries=len(store))
        out["kv_offload"] = stats
    return out


def step_time_model(engine: EngineClient) -> dict[str, Any] | None:
    """The step-time model (engine/batch_cap.py) of the SLO's scheduling or the batch cap, where one is
    kept: ``fixed + per_seq · n + per_token · p`` seconds, and the decode steps' averages by size."""
    scheduler = engine.scheduler
    slo, cap = getattr(scheduler, "slo", None), getattr(scheduler, "batch_cap", None)
    model = slo.model if slo is not None else cap.model if cap is not None else None
    if model is None:
        return None
    return {
        "fixed_s": model.fixed,
        "per_seq_s": model.per_seq,
        "per_token_s": model.per_token,
        "decode_s_by_size": {str(n): round(a.seconds, 6) for n, a in sorted(model.sizes.items())},
    }
