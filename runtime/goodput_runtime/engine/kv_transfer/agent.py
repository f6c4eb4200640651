"""The engine's side of a KV hand-off, in both roles (``--kv-transfer-role``).

Prefill (``prefill`` or ``both``): a request carrying ``do_remote_decode`` keeps its full prompt blocks
under a lease at its finish (leases.py) and answers the hand-off's fields; the transport serves pulls of
leased blocks (read on the step thread, between forward passes) and releases.

Decode (``decode`` or ``both``): a request carrying a hand-off is parked (no step waits for it) while
``handoff`` checks the layout digest and the blocks' prefix digests against its own prompt, takes the
blocks it already holds by prefix, reserves fresh ones for the rest, pulls those, lands them (on the
step thread) and counts them computed; the partly filled last block and the prompt's last token are
computed here as usual. The prefill side's lease is then released in the background. The whole
hand-off is bounded by ``--kv-transfer-timeout``; any failure raises KVTransferError, and the caller
frees the reserved blocks and recomputes or fails the request (``--kv-failure-policy``).

A peer pull (a hand-off naming no lease, params.py) takes the same path: the blocks are asked for by
digest and served from the holder's prefix cache (``serve_prefix``), looked up and read in one call on
its step thread, so no step can reuse a block between the two; there is no lease to release.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine import prefix_digest
from goodput_runtime.engine.block_manager import block_hash
from goodput_runtime.engine.core import EngineCore
from goodput_runtime.engine.kv_transfer import worker
from goodput_runtime.engine.kv_transfer.base import KVTransferError, Transport
from goodput_runtime.engine.kv_transfer.leases import Lease, LeaseTable
from goodput_runtime.engine.kv_transfer.local import LocalTransport
from goodput_runtime.engine.kv_transfer.metrics import KVTransferMetrics
from goodput_runtime.engine.kv_transfer.params import HandoffParams, layout_digest
from goodput_runtime.engine.kv_transfer.tcp import TcpTransport
from goodput_runtime.engine.sequence import Sequence

log = logging.getLogger(__name__)

ROLES = ("none", "prefill", "decode", "both")
POLICIES = ("recompute", "fail")


def host_address() -> str:
    """This host's address as peers would reach it: POD_IP where Kubernetes sets it, else the host name's."""
    pod_ip = os.environ.get("POD_IP")
    if pod_ip:
        return pod_ip
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass
class TransferStats:
    """Counts since start, for /debug/state and tests (the metrics carry the same)."""

    pulls: int = 0  # hand-offs that landed here
    failures: int = 0
    blocks_pulled: int = 0
    bytes_pulled: int = 0
    blocks_reused: int = 0  # blocks a hand-off found here by prefix and did not pull
    reads_served: int = 0
    bytes_served: int = 0
    releases_served: int = 0
    peer_pulls: int = 0  # of `pulls`: peer pulls (blocks found by digest in a holder's prefix cache)
    peer_failures: int = 0  # of `failures`: peer pulls, each then served by recomputing (or a 503 under fail)
    prefix_reads_served: int = 0  # peer pulls served from this runtime's prefix cache


class KVTransferAgent:
    def __init__(self, core: EngineCore, config: EngineConfig, executor: Executor) -> None:
        if config.kv_transfer_role not in ROLES:
            raise ValueError(f"--kv-transfer-role must be one of {', '.join(ROLES)}")
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ValueError("--kv-transfer-role does not run with tensor or pipeline parallelism yet")
        self.core = core
        self.role = config.kv_transfer_role
        self.executor = executor
        self.timeout = config.kv_transfer_timeout
        self.policy = config.kv_failure_policy
        runner, bm = core.runner, core.block_manager
        shape = runner.layout
        dtype = str(runner.dtype).removeprefix("torch.")
        self.layout_digest = layout_digest(
            bm.model_salt, dtype, shape.num_layers, shape.kv_heads, shape.head_dim, bm.block_size
        )
        self.block_bytes = worker.block_bytes(runner)
        self.engine_id = uuid.uuid4().hex
        self.host = config.kv_transfer_host or host_address()
        self.port = config.kv_transfer_port
        self.lease_seconds = config.kv_lease_seconds
        self.stats = TransferStats()
        self.metrics = KVTransferMetrics(core.metrics.registry, core.metrics.model) if core.metrics else None
        self.leases = LeaseTable(bm, config.kv_lease_seconds, self.describe)
        self.leases.on_change = self._lease_gauge
        self.leases.on_expired = self._expired
        if self.serves:
            core.scheduler.leases = self.leases
        self.transport: Transport = (
            LocalTransport(self.engine_id) if config.kv_transfer_transport == "local" else TcpTransport(self.port)
        )
        self.tasks: set[asyncio.Task] = set()

    @property
    def serves(self) -> bool:
        return self.role in ("prefill", "both")

    @property
    def pulls(self) -> bool:
        return self.role in ("decode", "both")

    async def start(self) -> None:
        port = await self.transport.start(self if self.serves else None)
        if port is not None:
            self.port = port
            log.info(
                "KV transfer (%s, role %s): serving blocks on port %d as %s",
                self.transport.name,
                self.role,
                port,
                self.host,
            )
        if self.serves:
            self._spawn(self._reap(), "kv-lease-reaper")

    async def stop(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await self.transport.stop()
        self.leases.clear()

    def _spawn(self, coro, name: str) -> None:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reap(self) -> None:
        period = max(0.05, min(1.0, self.lease_seconds / 4))
        while True:
            await asyncio.sleep(period)
            self.leases.reap()

    def _lease_gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.lease_blocks.set(self.leases.num_blocks)

    def _expired(self, count: int) -> None:
        log.info("%d KV lease(s) expired before a decode runtime released them", count)
        if self.metrics is not None:
            self.metrics.expiries.inc(count)

    # the prefill side

    def describe(self, lease: Lease) -> dict:
        return HandoffParams(
            remote_engine_id=self.engine_id,
            remote_host=self.host,
            remote_port=self.port,
            remote_request_id=lease.request_id,
            remote_block_ids=list(lease.block_ids),
            num_tokens=lease.num_tokens,
            layout_digest=self.layout_digest,
            lease_seconds=self.lease_seconds,
            block_digests=list(lease.digests),
        ).as_dict()

    async def serve_read(self, request_id: str, block_ids: list[int], layout: str) -> memoryview:
        if layout != self.layout_digest:
            raise KVTransferError("layout_mismatch", f"layout {layout} is not this runtime's {self.layout_digest}")
        lease = self.leases.get(request_id)
        if lease is None:
            raise KVTransferError("lease_gone", f"no lease is held for request {request_id}")
        if not set(block_ids) <= set(lease.block_ids):
            raise KVTransferError("lease_gone", f"blocks asked for are not under request {request_id}'s lease")
        data = await asyncio.get_running_loop().run_in_executor(
            self.executor, worker.read_blocks, self.core.runner, block_ids
        )
        self.stats.reads_served += 1
        self.stats.bytes_served += len(data)
        if self.metrics is not None:
            self.metrics.transfer("prefill", "success", len(data), len(block_ids))
        return data

    async def serve_prefix(self, digests: list[str], layout: str) -> memoryview:
        if layout != self.layout_digest:
            raise KVTransferError("layout_mismatch", f"layout {layout} is not this runtime's {self.layout_digest}")
        try:
            hashes = [int.from_bytes(bytes.fromhex(d), "little") for d in digests]
        except ValueError:
            raise KVTransferError("protocol", "a peer pull's digests must be hex") from None
        data = await asyncio.get_running_loop().run_in_executor(self.executor, self._read_held, hashes)
        self.stats.prefix_reads_served += 1
        self.stats.bytes_served += len(data)
        if self.metrics is not None:
            self.metrics.transfer("holder", "success", len(data), len(hashes))
        return data

    def _read_held(self, hashes: list[int]) -> memoryview:
        """On the step thread: the device blocks cached under `hashes`, read before any step can reuse them."""
        bm = self.core.block_manager
        loading = {block_id for block_id, _ in bm.pending_loads}  # cached, their bytes not copied in yet
        ids = []
        for i, h in enumerate(hashes):
            block_id = bm.cached.get(h)
            if block_id is None or block_id in loading or bm.blocks[block_id].hash != h:
                raise KVTransferError("not_held", f"block {i} of the peer pull is not held here")
            ids.append(block_id)
        return worker.read_blocks(self.core.runner, ids)

    def serve_release(self, request_id: str) -> bool:
        released = self.leases.release(request_id)
        self.stats.releases_served += released
        return released

    # the decode side

    async def handoff(self, seq: Sequence, params: HandoffParams) -> None:
        """Land the blocks `params` describes that seq lacks, within --kv-transfer-timeout; seq then
        counts them computed. KVTransferError on any failure (seq may hold reserved blocks then)."""
        started = time.monotonic()
        role = "peer" if params.by_prefix else "decode"
        try:
            moved = await asyncio.wait_for(self._handoff(seq, params), self.timeout)
        except asyncio.TimeoutError:
            error = KVTransferError(
                "timeout", f"the KV hand-off took longer than --kv-transfer-timeout {self.timeout:g}s"
            )
        except KVTransferError as exc:
            error = exc
        else:
            self.stats.pulls += 1
            self.stats.peer_pulls += params.by_prefix
            if self.metrics is not None:
                self.metrics.transfer(role, "success", moved, moved // self.block_bytes)
                self.metrics.pulled(role, time.monotonic() - started)
            if not params.by_prefix:
                self._release_later(params)
            return
        self.stats.failures += 1
        self.stats.peer_failures += params.by_prefix
        if self.metrics is not None:
            self.metrics.transfer(role, "failure")
            self.metrics.failure(error.reason)
        if error.reason != "unreachable" and not params.by_prefix:
            self._release_later(params)
        log.warning("KV hand-off for %s failed (%s): %s", seq.request_id, error.reason, error)
        raise error

    async def _handoff(self, seq: Sequence, params: HandoffParams) -> int:
        if params.layout_digest != self.layout_digest and not (params.by_prefix and not params.layout_digest):
            raise KVTransferError(
                "layout_mismatch",
                f"the prefill side's layout {params.layout_digest} is not this runtime's {self.layout_digest}",
            )
        bm = self.core.block_manager
        bs = bm.block_size
        # the prompt's last token is always computed here (its logits give the first token)
        usable = min(len(params.block_digests), (seq.num_prompt_tokens - 1) // bs, params.num_tokens // bs)
        parent = bm.root(seq)
        for i in range(usable):
            parent = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            if prefix_digest.to_bytes(parent).hex() != params.block_digests[i]:
                raise KVTransferError("digest_mismatch", f"block {i} of the hand-off is not this prompt's prefix")
        hits = bm.match_prefix(seq)[:usable]
        fresh = bm.reserve(seq, hits, usable - len(hits))
        if fresh is None:
            raise KVTransferError("no_blocks", f"no {usable - len(hits)} free KV blocks to land the hand-off in")
        wanted = usable - len(hits)
        data = bytearray()
        if wanted and params.by_prefix:  # asked for by digest from the holder's prefix cache
            data = await self.transport.pull_prefix(
                params, params.block_digests[len(hits) : usable], self.layout_digest
            )
        elif wanted:
            data = await self.transport.pull(params, params.remote_block_ids[len(hits) : usable], self.layout_digest)
        if wanted:
            if len(data) != wanted * self.block_bytes:
                raise KVTransferError("protocol", f"{len(data)} bytes came for {wanted} blocks of {self.block_bytes}")
            if seq.is_finished:
                return 0  # aborted meanwhile: its blocks are already free
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self.executor, worker.write_blocks, self.core.runner, fresh, data)
        if seq.is_finished:
            return 0
        seq.num_computed_tokens = usable * bs
        bm.commit(seq)  # findable by prefix from now on, as if computed here
        self.stats.blocks_pulled += wanted
        self.stats.blocks_reused += len(hits)
        self.stats.bytes_pulled += len(data)
        return len(data)

    def _release_later(self, params: HandoffParams) -> None:
        """Tell the prefill side to end the lease, off the request's path; bounded, failures only logged
        (the lease then expires on its own)."""

        async def release() -> None:
            try:
                await asyncio.wait_for(self.transport.release(params), self.timeout)
            except (KVTransferError, asyncio.TimeoutError, OSError) as exc:
                log.info("Could not release the KV lease of %s: %s", params.remote_request_id, exc)

        self._spawn(release(), "kv-release")
