"""``GET /kv/events``: the prefix blocks this runtime holds per tier, streamed as they change.

One JSON object per line (``application/x-ndjson``), behind the API key like every route: first a
snapshot of every block held per tier, then ``stored`` and ``removed`` events as blocks come and go,
and a ``heartbeat`` when nothing happened for ``heartbeat`` seconds (the query parameter, 0.1 to 60,
default 2), so a consumer can tell a quiet runtime from a dead connection. A subscriber too far
behind the runtime's backlog gets a new snapshot. The format is documented in docs/kv-cache.md.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from goodput_runtime.engine.kv_events import KvEvents, batches
from goodput_runtime.server import kv_digests_routes
from goodput_runtime.server.errors import APIError
from goodput_runtime.server.state import STATE

DEFAULT_HEARTBEAT_S = 2.0


def heartbeat_of(request: web.Request) -> float:
    raw = request.query.get("heartbeat")
    if raw is None:
        return DEFAULT_HEARTBEAT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 60:
        raise APIError(400, f"heartbeat={raw!r}: expected seconds from 0.1 to 60", param="heartbeat")
    return value


def events_of(request: web.Request) -> KvEvents:
    engine = request.app[STATE].serving_engine()
    events = engine.scheduler.block_manager.events
    if events is None:
        raise APIError(404, "this runtime publishes no KV cache events: prefix caching is off", code="not_found")
    return events


async def kv_events(request: web.Request) -> web.StreamResponse:
    heartbeat = heartbeat_of(request)
    events = events_of(request)
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(item: dict[str, Any]) -> None:
        await response.write(json.dumps(item, separators=(",", ":")).encode() + b"\n")

    snapshot = events.snapshot()
    seq = snapshot["seq"]
    await send(snapshot)
    state = request.app[STATE]
    while not state.closing:
        await events.wait(seq, heartbeat)
        changes = events.since(seq)
        if changes is None:  # fell behind the backlog: start again from what is held now
            snapshot = events.snapshot()
            seq = snapshot["seq"]
            await send(snapshot)
        elif changes:
            for item in batches(changes):
                await send(item)
            seq = changes[-1].seq
        else:
            await send({"type": "heartbeat", "seq": seq, "instance": events.instance})
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_get("/kv/events", kv_events)
    kv_digests_routes.add_routes(app)  # POST /kv/digests: a prompt's digests, for the same consumers
