"""The Batch API relayed to the gateway that owns the store.

A SQLite store lives on a ReadWriteOnce volume that one pod can open. The serving gateways roll
and spread across nodes, so they do not open it: they pass /v1/files and /v1/batches to the
batch-owning gateway (--batch-url), which keeps the store and runs the batches' lines. The
request's method, path, query, headers and body go as they came, and the answer comes back as
it was sent, streamed both ways (a file's content may be 200 MB)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from goodput_gateway.errors import APIError

logger = logging.getLogger(__name__)

# hop-by-hop headers (RFC 9110, 7.6.1) and the ones aiohttp sets itself for the new connection
DROPPED = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
CONNECT_SECONDS = 5
CHUNK = 64 * 1024


class Forward:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def running(self, app: web.Application) -> AsyncIterator[None]:
        self.session = aiohttp.ClientSession(
            auto_decompress=False,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_SECONDS),
        )
        logger.info("Batch API relayed to %s", self.base_url)
        yield
        await self.session.close()

    async def handle(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED}
        body = request.content if request.body_exists else None
        try:
            upstream = await self.session.request(
                request.method, self.base_url + request.path_qs, headers=headers, data=body, allow_redirects=False
            )
        except (aiohttp.ClientError, TimeoutError) as err:
            logger.warning("Batch API at %s unreachable: %s", self.base_url, err)
            raise APIError(
                503,
                "The batch API's gateway cannot be reached right now; try again shortly",
                code="batch_api_unavailable",
            ) from None
        async with upstream:
            response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
            for name, value in upstream.headers.items():
                if name.lower() not in DROPPED:
                    response.headers.add(name, value)
            await response.prepare(request)
            async for chunk in upstream.content.iter_chunked(CHUNK):
                await response.write(chunk)
            await response.write_eof()
            return response
