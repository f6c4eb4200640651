"""KV cache events: which prefix blocks this runtime holds, per tier, as they are stored and removed.

The block manager reports every block it publishes to the prefix cache and every one it hands out
again (tier ``device``); the offload tier reports every entry written and every one dropped (tier
``offload``, engine/kv_offload.py). Blocks are named by their prefix digest (engine/prefix_digest.py),
so a consumer can compare them with the digests of a prompt it computes itself.

Each change gets the next sequence number. The log keeps the set of blocks held per tier (what a
snapshot sends) and a bounded backlog of recent changes: a subscriber reads the backlog from its own
cursor; one that fell behind the backlog (or connects) is sent a snapshot instead, so every consumer
converges on what is held however many events it lost. ``instance`` names this process: a consumer
that sees a new one knows the runtime restarted and its old blocks are gone.

The wire format is in docs/kv-cache.md; server/kv_events_routes.py streams it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from goodput_runtime.engine.prefix_digest import DIGEST_BYTES

TIERS = ("device", "offload")
BACKLOG = 65536  # changes kept for subscribers that are behind; past it they get a snapshot


def hex_digest(digest: int) -> str:
    """A digest as it goes on the wire: its 16 little-endian bytes in hex."""
    return digest.to_bytes(DIGEST_BYTES, "little").hex()


@dataclass
class Change:
    seq: int
    tier: str
    digest: int
    stored: bool


@dataclass
class KvEvents:
    block_size: int
    instance: str = field(default_factory=lambda: uuid.uuid4().hex)
    seq: int = 0
    held: dict[str, set[int]] = field(default_factory=lambda: {t: set() for t in TIERS})
    backlog: deque[Change] = field(default_factory=lambda: deque(maxlen=BACKLOG))
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = field(default_factory=list)

    def record(self, tier: str, digest: int, stored: bool) -> None:
        """A block of `tier` was stored (True) or removed; from any thread."""
        with self.lock:
            held = self.held[tier]
            if stored == (digest in held):
                return  # no change: nothing to tell
            if stored:
                held.add(digest)
            else:
                held.discard(digest)
            self.seq += 1
            self.backlog.append(Change(self.seq, tier, digest, stored))
            waiters, self.waiters = self.waiters, []
        for loop, event in waiters:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # its loop is closed: the subscriber is gone
                pass

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {
                "type": "snapshot",
                "seq": self.seq,
                "instance": self.instance,
                "block_size": self.block_size,
                "tiers": {t: sorted(hex_digest(d) for d in self.held[t]) for t in TIERS},
            }

    def counts(self) -> dict[str, int]:
        with self.lock:
            return {t: len(self.held[t]) for t in TIERS}

    def since(self, seq: int) -> list[Change] | None:
        """The changes after `seq`; None when the backlog no longer reaches back to it."""
        with self.lock:
            if seq == self.seq:
                return []
            if not self.backlog or self.backlog[0].seq > seq + 1 or seq > self.seq:
                return None
            start = seq + 1 - self.backlog[0].seq
            return [self.backlog[i] for i in range(start, len(self.backlog))]

    async def wait(self, seq: int, timeout: float) -> None:
        """Return once there is a change after `seq`, or after `timeout` seconds."""
        event = asyncio.Event()
        with self.lock:
            if self.seq != seq:
                return
            self.waiters.append((asyncio.get_running_loop(), event))
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except TimeoutError:
            pass


def batches(changes: list[Change]) -> list[dict[str, Any]]:
    """Changes as wire events: consecutive changes of one kind and tier in one event, which carries
    the first and last sequence numbers it covers."""
    out: list[dict[str, Any]] = []
    for change in changes:
        kind = "stored" if change.stored else "removed"
        last = out[-1] if out else None
        if last is not None and last["type"] == kind and last["tier"] == change.tier:
            last["blocks"].append(hex_digest(change.digest))
            last["seq"] = change.seq
        else:
            out.append(
                {
                    "type": kind,
                    "first_seq": change.seq,
                    "seq": change.seq,
                    "tier": change.tier,
                    "blocks": [hex_digest(change.digest)],
                }
            )
    return out


__all__ = ["TIERS", "Change", "KvEvents", "batches", "hex_digest"]
