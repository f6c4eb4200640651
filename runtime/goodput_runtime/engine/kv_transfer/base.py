"""The transport interface: how a decode runtime pulls blocks from a prefill runtime and ends its lease.

Pull semantics: the prefill side only serves (``BlockSource``); the decode side asks for the blocks it
lacks by id and tells the prefill side when it is done. A transport moves whole blocks, each one's bytes
in the cache's layout (every layer's keys, then every layer's values, of the block's tokens: what
``ModelRunner.block_payload_shape`` describes), and never interprets them. A transport that reads
device memory directly (NIXL, UCX) would implement the same two calls on the decode side and publish
the prefill side's memory instead of serving reads.
"""

from __future__ import annotations

import abc
from typing import Protocol

from goodput_runtime.engine.kv_transfer.params import HandoffParams

# why a hand-off failed: the label of goodput_kv_transfer_failures_total
REASONS = (
    "timeout",  # a wait passed --kv-transfer-timeout
    "unreachable",  # the prefill runtime could not be reached, or closed the connection
    "layout_mismatch",  # the two runtimes' blocks do not mean the same (model, dtype, shape, block size)
    "lease_gone",  # the prefill side holds no such lease (released, expired, or restarted)
    "digest_mismatch",  # the blocks are not this prompt's prefix
    "no_blocks",  # no free blocks here to land them in
    "not_held",  # a peer pull: the holder no longer holds a block asked for (evicted meanwhile)
    "protocol",  # a malformed answer
)


class KVTransferError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason if reason in REASONS else "protocol"


class BlockSource(Protocol):
    """The prefill side, as a transport serves it."""

    layout_digest: str
    block_bytes: int

    async def serve_read(self, request_id: str, block_ids: list[int], layout_digest: str) -> memoryview:
        """The blocks' bytes, concatenated in the order asked; KVTransferError when the lease is gone,
        a block is not part of it, or the layouts differ."""
        ...

    def serve_release(self, request_id: str) -> bool:
        """End the lease; False when none was held."""
        ...

    async def serve_prefix(self, digests: list[str], layout_digest: str) -> memoryview:
        """A peer pull: the bytes of the blocks this runtime's prefix cache holds under `digests` (hex),
        concatenated in the order asked; KVTransferError ``not_held`` when one is not held."""
        ...


class Transport(abc.ABC):
    name = ""

    @abc.abstractmethod
    async def start(self, source: BlockSource | None) -> int | None:
        """Serve `source` (None: this runtime only pulls); the port it listens on, if any."""

    @abc.abstractmethod
    async def stop(self) -> None: ...

    @abc.abstractmethod
    async def pull(self, params: HandoffParams, block_ids: list[int], layout: str) -> bytearray:
        """The remote blocks `block_ids` of the lease `params` names, concatenated; KVTransferError."""

    @abc.abstractmethod
    async def release(self, params: HandoffParams) -> bool:
        """End the lease on the prefill side; False when it was not held any more."""

    @abc.abstractmethod
    async def pull_prefix(self, params: HandoffParams, digests: list[str], layout: str) -> bytearray:
        """A peer pull: the blocks the remote runtime holds under `digests`, concatenated; KVTransferError."""
