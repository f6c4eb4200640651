"""The prefill side's leases: a finished prefill request's full prompt blocks, held for a decode runtime.

At a normal finish the scheduler hands the request's blocks here instead of freeing them: the full
prompt blocks keep their reference (and stay findable by prefix for other requests); the partly filled
last block and the generated token's go back at once. A lease ends when the decode side releases it or
when ``--kv-lease-seconds`` pass (an expiry, counted); either way its references are dropped, so the
blocks return to the free list unless another request shares them. Pure Python, on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from goodput_runtime.engine import prefix_digest
from goodput_runtime.engine.block_manager import BlockManager, block_hash
from goodput_runtime.engine.sequence import Sequence


@dataclass(slots=True)
class Lease:
    request_id: str
    block_ids: list[int]
    digests: list[str]  # each block's prefix digest, hex
    num_tokens: int
    expires: float


class LeaseTable:
    def __init__(
        self,
        block_manager: BlockManager,
        seconds: float,
        describe: Callable[[Lease], dict] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_manager = block_manager
        self.seconds = seconds
        self.describe = describe  # the hand-off fields a lease is answered with (agent.py)
        self.clock = clock
        self.leases: dict[str, Lease] = {}
        self.expired = 0  # leases that ran out before the decode side released them
        self.on_change: Callable[[], None] | None = None  # the lease gauge's update
        self.on_expired: Callable[[int], None] | None = None  # the expiry counter's

    @property
    def num_blocks(self) -> int:
        return sum(len(lease.block_ids) for lease in self.leases.values())

    def hold(self, seq: Sequence) -> dict | None:
        """Take over seq's blocks at its finish: lease the full prompt blocks, free the rest. The
        hand-off fields (describe), or None without a describe."""
        bm = self.block_manager
        bs = bm.block_size
        full = min(seq.num_prompt_tokens, seq.num_computed_tokens) // bs
        kept, rest = seq.block_table[:full], seq.block_table[full:]
        bm.release_blocks(rest)
        digests, parent = [], bm.root(seq)
        for i in range(full):
            parent = block_hash(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            digests.append(prefix_digest.to_bytes(parent).hex())
        seq.block_table, seq.block_hashes, seq.block_copies = [], [], []
        seq.num_computed_tokens = 0
        lease = Lease(seq.request_id, kept, digests, full * bs, self.clock() + self.seconds)
        old = self.leases.pop(seq.request_id, None)
        if old is not None:
            bm.release_blocks(old.block_ids)
        self.leases[seq.request_id] = lease
        self._changed()
        return self.describe(lease) if self.describe is not None else None

    def get(self, request_id: str) -> Lease | None:
        lease = self.leases.get(request_id)
        if lease is not None and lease.expires <= self.clock():
            self.reap()
            return None
        return lease

    def release(self, request_id: str) -> bool:
        """End a lease now (the decode side has its blocks, or gave up); False when none is held."""
        lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self.block_manager.release_blocks(lease.block_ids)
        self._changed()
        return True

    def reap(self) -> int:
        """End every lease past its time; how many ended."""
        now = self.clock()
        gone = [rid for rid, lease in self.leases.items() if lease.expires <= now]
        for request_id in gone:
            self.block_manager.release_blocks(self.leases.pop(request_id).block_ids)
        if gone:
            self.expired += len(gone)
            if self.on_expired is not None:
                self.on_expired(len(gone))
            self._changed()
        return len(gone)

    def clear(self) -> None:
        for request_id in list(self.leases):
            self.release(request_id)

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()
