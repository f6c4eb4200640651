"""The TCP transport: asyncio streams, one small framed protocol, whole blocks.

A request frame is ``GPKV``, a version byte, an op byte (1 pull, 2 release, 3 pull by prefix), a
4-byte length and that many bytes of JSON: ``{"request_id", "block_ids", "layout_digest"}`` for a pull,
``{"request_id"}`` for a release, ``{"digests", "layout_digest"}`` for a peer pull (blocks found by
digest in the serving runtime's prefix cache, under no lease).
An answer frame is ``GPKV``, a status byte (0 ok, 1 refused), a 4-byte length and JSON
(``{"layout_digest", "block_bytes", "num_blocks"}``, or ``{"reason", "message"}`` when refused), then,
for a pull, an 8-byte length and the blocks' bytes, concatenated in the order asked. Lengths are
big-endian. A connection carries any number of requests, one at a time; the pulling side opens one per
hand-off. The layout digest travels in both directions: a server whose layout differs refuses the pull,
and a client checks the answer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import struct
from typing import Any

from goodput_runtime.engine.kv_transfer.base import BlockSource, KVTransferError, Transport
from goodput_runtime.engine.kv_transfer.params import HandoffParams

log = logging.getLogger(__name__)

MAGIC = b"GPKV"
VERSION = 1
PULL, RELEASE, PULL_PREFIX = 1, 2, 3
REQUEST = struct.Struct(">4sBBI")
ANSWER = struct.Struct(">4sBI")
PAYLOAD = struct.Struct(">Q")
MAX_HEADER = 1 << 24  # a header's JSON: block ids and digests, never near this
CHUNK = 1 << 20  # bytes per write, so a large pull does not build one huge buffer in the stream


def answer(status: int, header: dict[str, Any]) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    return ANSWER.pack(MAGIC, status, len(body)) + body


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, port: int, bind: str = "0.0.0.0") -> None:
        self.port = port
        self.bind = bind
        self.server: asyncio.Server | None = None
        self.source: BlockSource | None = None
        self.connections: set[asyncio.Task] = set()

    async def start(self, source: BlockSource | None) -> int | None:
        if source is None:
            return None
        self.source = source
        self.server = await asyncio.start_server(self._serve, self.bind, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            for task in list(self.connections):
                task.cancel()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 5)
            self.server = None

    # serving (the prefill side)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None and self.source is not None
        self.connections.add(task)
        try:
            while True:
                try:
                    magic, version, op, length = REQUEST.unpack(await reader.readexactly(REQUEST.size))
                except asyncio.IncompleteReadError:
                    return  # the client is done
                if magic != MAGIC or version != VERSION or length > MAX_HEADER:
                    writer.write(answer(1, {"reason": "protocol", "message": "not a goodput KV request"}))
                    return
                header = json.loads(await reader.readexactly(length))
                await self._one(op, header, writer)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            log.info("KV transfer connection ended: %s", exc)
        finally:
            self.connections.discard(task)
            writer.close()

    async def _one(self, op: int, header: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        assert self.source is not None
        request_id = str(header.get("request_id", ""))
        if op == RELEASE:
            writer.write(answer(0, {"released": self.source.serve_release(request_id)}))
            return
        if op not in (PULL, PULL_PREFIX):
            writer.write(answer(1, {"reason": "protocol", "message": f"unknown op {op}"}))
            return
        layout = str(header.get("layout_digest", ""))
        try:
            if op == PULL:
                count = len(block_ids := [int(b) for b in header.get("block_ids", [])])
                data = await self.source.serve_read(request_id, block_ids, layout)
            else:
                count = len(digests := [str(d) for d in header.get("digests", [])])
                data = await self.source.serve_prefix(digests, layout)
        except KVTransferError as exc:
            writer.write(answer(1, {"reason": exc.reason, "message": str(exc)}))
            return
        meta = {"layout_digest": self.source.layout_digest, "block_bytes": self.source.block_bytes}
        writer.write(answer(0, {**meta, "num_blocks": count}) + PAYLOAD.pack(len(data)))
        for start in range(0, len(data), CHUNK):
            writer.write(data[start : start + CHUNK])
            await writer.drain()

    # pulling (the decode side)

    async def _request(self, params: HandoffParams, op: int, header: dict[str, Any]) -> tuple[dict, bytearray]:
        try:
            reader, writer = await asyncio.open_connection(params.remote_host, params.remote_port)
        except OSError as exc:
            raise KVTransferError(
                "unreachable", f"cannot reach {params.remote_host}:{params.remote_port}: {exc}"
            ) from None
        try:
            body = json.dumps(header, separators=(",", ":")).encode()
            writer.write(REQUEST.pack(MAGIC, VERSION, op, len(body)) + body)
            await writer.drain()
            magic, status, length = ANSWER.unpack(await reader.readexactly(ANSWER.size))
            if magic != MAGIC or length > MAX_HEADER:
                raise KVTransferError("protocol", "the prefill side's answer is not a goodput KV answer")
            meta = json.loads(await reader.readexactly(length))
            if status != 0:
                raise KVTransferError(str(meta.get("reason")), f"the prefill side refused: {meta.get('message')}")
            payload = bytearray()
            if op in (PULL, PULL_PREFIX):
                (size,) = PAYLOAD.unpack(await reader.readexactly(PAYLOAD.size))
                payload = bytearray(size)
                view, got = memoryview(payload), 0
                while got < size:
                    piece = await reader.read(min(size - got, 4 * CHUNK))
                    if not piece:
                        raise KVTransferError("unreachable", f"the connection closed after {got} of {size} bytes")
                    view[got : got + len(piece)] = piece
                    got += len(piece)
            return meta, payload
        except (ConnectionError, asyncio.IncompleteReadError) as exc:
            raise KVTransferError("unreachable", f"the prefill side closed the connection: {exc}") from None
        finally:
            writer.close()

    async def pull(self, params: HandoffParams, block_ids: list[int], layout: str) -> bytearray:
        header = {"request_id": params.remote_request_id, "block_ids": block_ids, "layout_digest": layout}
        meta, payload = await self._request(params, PULL, header)
        if meta.get("layout_digest") != layout:
            raise KVTransferError("layout_mismatch", "the prefill side's blocks are of another layout")
        if meta.get("num_blocks") != len(block_ids) or len(payload) != len(block_ids) * int(meta["block_bytes"]):
            raise KVTransferError("protocol", "the prefill side sent a different number of bytes than asked")
        return payload

    async def pull_prefix(self, params: HandoffParams, digests: list[str], layout: str) -> bytearray:
        meta, payload = await self._request(params, PULL_PREFIX, {"digests": digests, "layout_digest": layout})
        if meta.get("layout_digest") != layout:
            raise KVTransferError("layout_mismatch", "the holder's blocks are of another layout")
        if meta.get("num_blocks") != len(digests) or len(payload) != len(digests) * int(meta["block_bytes"]):
            raise KVTransferError("protocol", "the holder sent a different number of bytes than asked")
        return payload

    async def release(self, params: HandoffParams) -> bool:
        meta, _ = await self._request(params, RELEASE, {"request_id": params.remote_request_id})
        return bool(meta.get("released"))
