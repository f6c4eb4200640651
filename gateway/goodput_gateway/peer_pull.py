"""Pulling a prompt's prefix from a peer replica instead of recomputing it (held-aware routing's last step).

After the pick (held_routing.py), the chosen replica may hold less of the prompt than another: the
holder was past the load bound, or the chosen replica just joined and holds nothing yet. When another
ready replica holds at least ``min_blocks`` more of the prompt's leading blocks on its device than the
chosen one holds in any tier, the request goes to the chosen replica with a ``kv_transfer_params`` that
names the holder and those blocks' digests::

    {"do_remote_prefill": true, "remote_host": H, "remote_port": P, "block_digests": [...], "num_tokens": N}

The chosen replica takes the blocks it already holds, pulls the rest from the holder's prefix cache over
the KV transfer path (engine/kv_transfer/, op "pull by prefix"), bounded by its
``--kv-transfer-timeout``, and computes the tail. Any failure there (the holder evicted a block, died,
or does not answer in time) is a recompute on the receiver, never a failed request.

Opt-in per runtime: a replica receives pulls only where its ``--kv-transfer-role`` is ``decode`` or
``both``, and is named as a holder only where it is ``prefill`` or ``both``. The gateway learns each
replica's role and transfer address from its ``GET /debug/state`` (``kv_transfer``; asked with the
request's own Authorization, which for a keyed service is its runtime key), once a minute, so a fleet
of role ``none`` never sees the field. The holder's read happens between its forward passes
and costs it no queue slot: a holder past the load bound still serves it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Counter

from goodput_gateway.held_routing import Held, hit_of
from goodput_gateway.prompt_digests import PromptBlocks

logger = logging.getLogger(__name__)

FIELD = "kv_transfer_params"
PATHS = ("/v1/completions", "/v1/chat/completions")
MIN_BLOCKS = 4  # a pull is worth its round trip past this many blocks (64 tokens at block size 16)
ENDPOINT_TTL_S = 60.0  # how long a replica's role and transfer address are trusted
ENDPOINT_RETRY_S = 10.0  # how long an unanswered /debug/state is not asked again
ENDPOINT_TIMEOUT_S = 1.0
SERVES, RECEIVES = ("prefill", "both"), ("decode", "both")


@dataclass(frozen=True)
class Endpoint:
    role: str  # the replica's --kv-transfer-role
    host: str
    port: int | None  # where it serves blocks; None where it serves none


@dataclass(frozen=True)
class Plan:
    holder: str
    blocks: int  # leading blocks the holder holds on its device
    have: int  # leading blocks the chosen replica holds (device, then offload)


def plan(
    chosen: str, replicas: Sequence[str], digests: Sequence[str], held_of: Callable[[str], Held | None], min_blocks: int
) -> Plan | None:
    """The replica holding the most of `digests` on its device, when that is at least `min_blocks` more
    than `chosen` holds (None where no such replica is known)."""
    mine = held_of(chosen)
    have = 0
    if mine is not None:
        hit = hit_of(digests, mine)
        have = hit.device + hit.offload
    best: Plan | None = None
    for r in replicas:
        held = held_of(r) if r != chosen else None
        if held is None:
            continue
        device = hit_of(digests, held).device
        if device - have >= min_blocks and (best is None or device > best.blocks):
            best = Plan(r, device, have)
    return best


class PeerPulls:
    def __init__(
        self, session: aiohttp.ClientSession, registry: CollectorRegistry, min_blocks: int = MIN_BLOCKS
    ) -> None:
        self.session, self.min_blocks = session, min_blocks
        self.endpoints: dict[str, tuple[float, Endpoint | None]] = {}  # replica -> (until, endpoint)
        self.pulls = Counter(
            "goodput_gateway_peer_pulls",
            "Requests sent with a peer pull: the chosen replica pulls the prompt's prefix from a holder.",
            ["namespace", "service"],
            registry=registry,
        )
        self.blocks = Counter(
            "goodput_gateway_peer_pull_blocks",
            "Prompt blocks named in peer pulls beyond what the chosen replica held (at most what moves).",
            ["namespace", "service"],
            registry=registry,
        )

    async def endpoint(self, replica: str, headers: Mapping[str, str] | None = None) -> Endpoint | None:
        """The replica's role and transfer address from its /debug/state (cached; None: not known), asked
        with the request's Authorization header (a keyed runtime's own key)."""
        now = time.monotonic()
        cached = self.endpoints.get(replica)
        if cached is not None and cached[0] > now:
            return cached[1]
        found: Endpoint | None = None
        try:
            timeout = aiohttp.ClientTimeout(total=ENDPOINT_TIMEOUT_S)
            auth = {k: v for k, v in (headers or {}).items() if k.lower() == "authorization"}
            async with self.session.get(replica + "/debug/state", timeout=timeout, headers=auth) as response:
                state = await response.json(content_type=None) if response.status == 200 else {}
            kv = state.get("kv_transfer") if isinstance(state, dict) else None
            if isinstance(kv, dict) and isinstance(kv.get("role"), str):
                port = kv.get("port")
                found = Endpoint(kv["role"], str(kv.get("host") or ""), port if isinstance(port, int) else None)
            else:
                found = Endpoint("none", "", None)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as err:
            logger.info("No KV transfer address from %s: %r", replica, err)
        self.endpoints[replica] = (now + (ENDPOINT_TTL_S if found is not None else ENDPOINT_RETRY_S), found)
        return found

    def forget(self, keep: set[str]) -> None:
        for replica in [r for r in self.endpoints if r not in keep]:
            del self.endpoints[replica]

    async def body(
        self,
        service: tuple[str, str],
        chosen: str,
        path: str,
        raw: bytes,
        body: Mapping[str, Any],
        blocks: PromptBlocks | None,
        replicas: Sequence[str],
        held_of: Callable[[str], Held | None],
        headers: Mapping[str, str] | None = None,
    ) -> bytes:
        """What `chosen` is sent: `raw`, or `raw` with a peer pull where one pays (see the module's doc)."""
        if blocks is None or path not in PATHS or FIELD in body or body.get("prompt_logprobs") is not None:
            return raw
        if len(self.endpoints) > 2 * len(replicas) + 64:  # replicas come and go: keep the cache bounded
            self.forget(set(replicas))
        found = plan(chosen, replicas, blocks.digests, held_of, self.min_blocks)
        if found is None:
            return raw
        receiver, holder = await self.endpoint(chosen, headers), await self.endpoint(found.holder, headers)
        if receiver is None or receiver.role not in RECEIVES:
            return raw
        if holder is None or holder.role not in SERVES or holder.port is None or not holder.host:
            return raw
        digests = list(blocks.digests[: found.blocks])
        params = {
            "do_remote_prefill": True,
            "remote_host": holder.host,
            "remote_port": holder.port,
            "block_digests": digests,
            "num_tokens": len(digests) * blocks.block_size,
        }
        sent = json.loads(raw)
        sent[FIELD] = params
        self.pulls.labels(*service).inc()
        self.blocks.labels(*service).inc(found.blocks - found.have)
        return json.dumps(sent).encode()
