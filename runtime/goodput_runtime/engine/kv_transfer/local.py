"""The in-process transport: runtimes in one process (tests) find each other by engine id.

Each engine may run its own event loop on its own thread; a pull runs on the serving engine's loop
(where its block manager and leases live) and is awaited from the pulling one's.
"""

from __future__ import annotations

import asyncio

from goodput_runtime.engine.kv_transfer.base import BlockSource, KVTransferError, Transport
from goodput_runtime.engine.kv_transfer.params import HandoffParams

SOURCES: dict[str, tuple[BlockSource, asyncio.AbstractEventLoop]] = {}


class LocalTransport(Transport):
    name = "local"

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id

    async def start(self, source: BlockSource | None) -> int | None:
        if source is not None:
            SOURCES[self.engine_id] = (source, asyncio.get_running_loop())
        return None

    async def stop(self) -> None:
        SOURCES.pop(self.engine_id, None)

    def _source(self, params: HandoffParams) -> tuple[BlockSource, asyncio.AbstractEventLoop]:
        found = SOURCES.get(params.remote_engine_id)
        if found is None or found[1].is_closed():
            raise KVTransferError("unreachable", f"no engine {params.remote_engine_id} in this process")
        return found

    async def pull(self, params: HandoffParams, block_ids: list[int], layout: str) -> bytearray:
        source, loop = self._source(params)
        read = source.serve_read(params.remote_request_id, block_ids, layout)
        future = asyncio.run_coroutine_threadsafe(read, loop)
        try:
            data: memoryview = await asyncio.wrap_future(future)
            return bytearray(data)
        finally:
            future.cancel()

    async def pull_prefix(self, params: HandoffParams, digests: list[str], layout: str) -> bytearray:
        source, loop = self._source(params)
        future = asyncio.run_coroutine_threadsafe(source.serve_prefix(digests, layout), loop)
        try:
            data: memoryview = await asyncio.wrap_future(future)
            return bytearray(data)
        finally:
            future.cancel()

    async def release(self, params: HandoffParams) -> bool:
        source, loop = self._source(params)

        async def release() -> bool:
            return source.serve_release(params.remote_request_id)

        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(release(), loop))
