"""Which prefix blocks each replica holds, per KV tier, from the replicas' own cache events.

One subscription per replica to its ``GET /kv/events`` (docs/kv-cache.md): a snapshot replaces what
the index held for the replica, ``stored`` and ``removed`` events change it, and sequence numbers
show lost events. A gap, a new ``instance`` (the runtime restarted) or a broken connection drops
the replica's entries and subscribes again, which starts with a fresh snapshot. A replica that says
nothing (no event, no heartbeat) for ``stale_after`` seconds is stale. ``held`` then gives nothing
for it, so a router falls back to its other signals, and the connection is dropped and made again.
Replicas that leave discovery are unsubscribed and forgotten at once.

A replica whose runtime asks for an API key (its service's ``auth.apiKeySecretRef``) is subscribed to
with its service's own key, as proxied requests are: ``authorization`` gives the Authorization header
for a replica's URL, asked again at each subscription, so a rotated key is used from the next one.

Blocks are the runtime's prefix digests as 32 hex characters. This module keeps the index and nothing
else: computing a prompt's digests and routing by them are not part of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field

import aiohttp

logger = logging.getLogger(__name__)

TIERS = ("device", "offload")
HEARTBEAT_S = 2.0
RETRY_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # waits between subscription attempts, the last repeated
# a replica's base URL -> the Authorization header its runtime asks for (None: none)
Authorization = Callable[[str], Awaitable[str | None]]


@dataclass
class ReplicaBlocks:
    instance: str = ""
    seq: int = -1
    block_size: int = 0
    tiers: dict[str, set[str]] = field(default_factory=lambda: {t: set() for t in TIERS})
    heard: float = 0.0  # monotonic time of the last line read
    synced: bool = False  # a snapshot was applied and nothing was lost since


class KvIndex:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        heartbeat: float = HEARTBEAT_S,
        stale_after: float | None = None,
        headers: Mapping[str, str] | None = None,
        authorization: Authorization | None = None,
    ) -> None:
        self.session = session
        self.heartbeat = heartbeat
        self.stale_after = stale_after if stale_after is not None else 3 * heartbeat
        self.headers = dict(headers or {})
        self.authorization = authorization
        self.replicas: dict[str, ReplicaBlocks] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.resyncs = 0  # subscriptions made again after a gap, a restart, silence or an error

    # -- what a router reads ---------------------------------------------------------------------

    def held(self, replica: str) -> dict[str, set[str]] | None:
        """The blocks `replica` holds per tier; None while it is unknown, unsynced or stale."""
        blocks = self.replicas.get(replica)
        if blocks is None or not blocks.synced or time.monotonic() - blocks.heard > self.stale_after:
            return None
        return blocks.tiers

    def size(self) -> dict[str, int]:
        """Blocks indexed per tier, over every synced replica."""
        out = dict.fromkeys(TIERS, 0)
        for blocks in self.replicas.values():
            if blocks.synced:
                for tier in TIERS:
                    out[tier] += len(blocks.tiers[tier])
        return out

    def staleness(self) -> dict[str, float]:
        """Seconds since each replica was last heard from."""
        now = time.monotonic()
        return {url: now - b.heard for url, b in self.replicas.items()}

    # -- subscriptions ---------------------------------------------------------------------------

    def sync(self, replicas: Iterable[str]) -> None:
        """Subscribe to each of `replicas` (base URLs) not yet subscribed; forget those gone."""
        wanted = set(replicas)
        for url in list(self.tasks):
            if url not in wanted:
                self.tasks.pop(url).cancel()
                self.replicas.pop(url, None)
        for url in wanted - set(self.tasks):
            self.tasks[url] = asyncio.create_task(self._follow(url), name=f"kv-events {url}")

    async def close(self) -> None:
        tasks = list(self.tasks.values())
        self.tasks.clear()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.replicas.clear()

    async def _follow(self, url: str) -> None:
        attempt = 0
        while True:
            try:
                await self._subscribe(url)
                attempt = 0
            except asyncio.CancelledError:
                raise
            except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, OSError) as e:
                logger.debug("KV events of %s: %s", url, e)
            self.replicas.pop(url, None)  # what it held is unknown until the next snapshot
            self.resyncs += 1
            await asyncio.sleep(RETRY_S[min(attempt, len(RETRY_S) - 1)])
            attempt += 1

    async def _subscribe(self, url: str) -> None:
        """Read one subscription until it breaks, falls silent or loses events."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=self.stale_after)
        headers = dict(self.headers)
        if self.authorization is not None and (key := await self.authorization(url)) is not None:
            headers["Authorization"] = key
        async with self.session.get(
            f"{url}/kv/events", params={"heartbeat": str(self.heartbeat)}, headers=headers, timeout=timeout
        ) as response:
            if response.status != 200:
                raise aiohttp.ClientResponseError(
                    response.request_info, (), status=response.status, message="no KV events"
                )
            blocks = ReplicaBlocks()
            while True:
                line = await response.content.readline()  # sock_read bounds the wait: silence ends it
                if not line:
                    return  # closed
                if not self._apply(url, blocks, json.loads(line)):
                    return  # lost events or a new instance: subscribe again for a snapshot

    def _apply(self, url: str, blocks: ReplicaBlocks, event: dict) -> bool:
        blocks.heard = time.monotonic()
        kind = event["type"]
        if kind == "snapshot":
            if blocks.instance and event["instance"] != blocks.instance:
                return False
            blocks.instance, blocks.seq, blocks.block_size = event["instance"], event["seq"], event["block_size"]
            blocks.tiers = {t: set(event["tiers"].get(t, ())) for t in TIERS}
            blocks.synced = True
            self.replicas[url] = blocks
            return True
        if not blocks.synced:
            return False
        if kind == "heartbeat":
            return event["instance"] == blocks.instance and event["seq"] == blocks.seq
        if kind in ("stored", "removed"):
            if event["first_seq"] != blocks.seq + 1 or event["tier"] not in blocks.tiers:
                return False
            target = blocks.tiers[event["tier"]]
            if kind == "stored":
                target.update(event["blocks"])
            else:
                target.difference_update(event["blocks"])
            blocks.seq = event["seq"]
        return True


__all__ = ["KvIndex", "ReplicaBlocks"]
