"""OpenAI's Batch API at the gateway: input files, batches, and a dispatcher that runs their lines
on the services' replicas at batch priority, durably (see store.py) and without hurting online
requests (see control.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from goodput_gateway.batch.api import BatchAPI, add_routes
from goodput_gateway.batch.db import Database
from goodput_gateway.batch.dispatcher import BatchMetrics, Dispatcher, DispatchSettings
from goodput_gateway.batch.forward import Forward
from goodput_gateway.batch.store import Store
from goodput_gateway.discovery import Registry
from goodput_gateway.errors import APIError
from goodput_gateway.proxy import Proxy

__all__ = ["BatchSettings", "DispatchSettings", "install"]

logger = logging.getLogger(__name__)
ROUTES = ("/v1/files", "/v1/files/{tail:.*}", "/v1/batches", "/v1/batches/{tail:.*}")


@dataclass(frozen=True)
class BatchSettings:
    database: str = ""  # empty: the batch API is off, or relayed (forward_url)
    forward_url: str = ""  # without a database: relay the batch API to the gateway at this URL
    file_dir: Path | None = None  # where file bytes go; None: in the database
    dispatch: DispatchSettings = field(default_factory=DispatchSettings)


async def _off(request: web.Request) -> web.Response:
    raise APIError(
        404,
        "The batch API is off at this gateway: start it with --database (sqlite:///PATH or postgresql://...) "
        "or --batch-url (the gateway that owns the store)",
        code="batch_api_disabled",
    )


def install(
    app: web.Application, registry: Registry, proxy: Proxy, metrics: CollectorRegistry, settings: BatchSettings
) -> None:
    """The Files and Batches routes, and the dispatcher running for the application's lifetime: it sends
    lines to the registry's replicas through the gateway's proxy, and counts them in `metrics`."""
    if settings.forward_url and not settings.database:
        forward = Forward(settings.forward_url)
        for path in ROUTES:
            app.router.add_route("*", path, forward.handle)
        app.cleanup_ctx.append(forward.running)
        return
    if not settings.database:
        for path in ROUTES:
            app.router.add_route("*", path, _off)
        return
    db = Database(settings.database)
    store = Store(db, settings.file_dir)
    dispatcher = Dispatcher(store, registry, proxy, settings.dispatch, BatchMetrics(metrics))
    add_routes(app, BatchAPI(store, dispatcher.woken))

    async def running(app: web.Application) -> Any:
        await db.open()
        task = asyncio.create_task(dispatcher.run_forever())
        logger.info("Batch API on, store %s", "PostgreSQL" if db.postgres else "SQLite")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await dispatcher.stop()
        db.close()

    app.cleanup_ctx.append(running)
