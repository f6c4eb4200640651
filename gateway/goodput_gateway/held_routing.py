"""Routing by what each replica holds: the longest run of a prompt's leading blocks in its KV tiers.

The policy ``prefix`` uses this whenever it can, and falls back to the hash ring (routing.py) when
it cannot. For a request it has the prompt's block digests (prompt_digests.py) and each replica's
held blocks per tier (kv_index.py, from the replicas' own cache events). A replica's hit is the
run a runtime would itself find: the prompt's leading blocks in its device KV cache, then the
blocks after those in its offload tier (engine/block_manager.py matches in that order). Its score
is ``device blocks + offload_weight × offload blocks``: a device hit costs nothing, a reload from
the tier costs a read (docs/kv-cache.md measures it about 9× cheaper than the prefill it replaces),
and a miss costs the prefill.

Bounded load still applies: only replicas within ⌈(1 + ε) × the mean⌉ compete, as on the ring.
Among them the highest score wins; equal scores go to the first of them clockwise on the ring from
the prompt's key, so a prefix held twice keeps going to the same one. When no replica within the
bound holds a leading block, or no replica's index is synced (stale, or a fleet that publishes no
events), the ring decides, exactly as before.

A replica that joins holds nothing, so it takes no prefix another replica holds: it gets the ring's
share of prefixes nobody holds, and overflow once the others pass the load bound. Where the chosen
replica holds less of the prompt than another (overflow, a new replica), peer_pull.py may have it pull
the prefix from the holder instead of computing it. Scale-out moves
no cached prefix away from its holder, and the new replica warms at the rate new prefixes and
overflow arrive, not in a herd.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from goodput_gateway import routing
from goodput_gateway.kv_index import KvIndex
from goodput_gateway.prompt_digests import PromptBlocks, PromptDigests

HELD_DEVICE, HELD_OFFLOAD = "held_device", "held_offload"  # decisions: where the winner's hit starts
DECISIONS = (HELD_DEVICE, HELD_OFFLOAD)
OFFLOAD_WEIGHT = 0.5
# lookups: a replica held a leading block (hit), none within the bound did (miss), no replica's index
# was synced (stale), or the prompt's digests could not be had (no_digests)
LOOKUP_RESULTS = ("hit", "miss", "stale", "no_digests")

Held = Mapping[str, set[str]]  # tier -> digests


@dataclass(frozen=True)
class Hit:
    device: int  # leading blocks in the device tier
    offload: int  # the blocks after those in the offload tier

    def score(self, offload_weight: float) -> float:
        return self.device + offload_weight * self.offload


def hit_of(digests: Sequence[str], held: Held) -> Hit:
    """The run of `digests` a replica holding `held` would find: device first, then the offload tier."""
    device, offload = held.get("device", set()), held.get("offload", set())
    d = 0
    while d < len(digests) and digests[d] in device:
        d += 1
    o = 0
    while d + o < len(digests) and digests[d + o] in offload:
        o += 1
    return Hit(d, o)


def cached_tokens(blocks: PromptBlocks, held: Held | None) -> int:
    """The prompt's tokens a replica holding `held` would not compute (None: unknown, counted as none)."""
    if held is None:
        return 0
    hit = hit_of(blocks.digests, held)
    return (hit.device + hit.offload) * blocks.block_size


@dataclass(frozen=True)
class Outcome:
    choice: routing.Choice | None  # None: the ring decides
    result: str  # one of LOOKUP_RESULTS


def choose_held(
    replicas: Sequence[str],
    loads: Mapping[str, float],
    digests: Sequence[str],
    held_of: Callable[[str], Held | None],
    key: int,
    ring: routing.Ring,
    *,
    epsilon: float = routing.EPSILON,
    offload_weight: float = OFFLOAD_WEIGHT,
) -> Outcome:
    """The replica holding the longest run of `digests` within the load bound; see the module's doc."""
    helds = {r: held_of(r) for r in replicas}
    if all(h is None for h in helds.values()):
        return Outcome(None, "stale")
    bound = routing.load_bound(loads, replicas, epsilon)
    hits: dict[str, Hit] = {}
    for r, held in helds.items():
        if held is not None and routing.within(loads.get(r, 0.0), bound):
            hits[r] = hit_of(digests, held)
    best = max((h.score(offload_weight) for h in hits.values()), default=0.0)
    if best <= 0:
        return Outcome(None, "miss")
    order = {r: i for i, r in enumerate(ring.walk(key))}
    winner = min(
        (r for r, h in hits.items() if h.score(offload_weight) == best), key=lambda r: order.get(r, len(order))
    )
    return Outcome(routing.Choice(winner, HELD_DEVICE if hits[winner].device else HELD_OFFLOAD), "hit")


def pick(
    policy: str,
    replicas: Sequence[str],
    loads: Mapping[str, float],
    key: int,
    ring: routing.Ring,
    blocks: PromptBlocks | None,
    held_of: Callable[[str], Held | None],
    *,
    epsilon: float = routing.EPSILON,
    offload_weight: float = OFFLOAD_WEIGHT,
    rng: random.Random | None = None,
) -> tuple[routing.Choice, str]:
    """(the choice, the lookup's result) for a request under the held-aware ``prefix`` policy."""
    if blocks is None:
        synced = any(held_of(r) is not None for r in replicas)
        outcome = Outcome(None, "no_digests" if synced else "stale")
    elif blocks.digests:
        outcome = choose_held(
            replicas, loads, blocks.digests, held_of, key, ring, epsilon=epsilon, offload_weight=offload_weight
        )
    else:
        outcome = Outcome(None, "miss")  # shorter than a block: nothing to hold
    if outcome.choice is not None:
        return outcome.choice, outcome.result
    return routing.choose(policy, replicas, loads, key, ring=ring, epsilon=epsilon, rng=rng), outcome.result


class HeldRouter:
    """The proxy's side of held-aware routing: a prompt's digests (when any replica's index is synced)
    and the pick. `index` is the gateway's KvIndex (kv_index.py), `digests` a PromptDigests."""

    def __init__(self, index: KvIndex, digests: PromptDigests, offload_weight: float = OFFLOAD_WEIGHT) -> None:
        self.index, self.digests, self.offload_weight = index, digests, offload_weight
        self.pulls: Any = None  # a peer_pull.PeerPulls where peer pulls are on

    async def with_pull(
        self,
        service: tuple[str, str],
        chosen: str,
        path: str,
        raw: bytes,
        body: Mapping[str, Any],
        blocks: PromptBlocks | None,
        ready: Sequence[str],
        headers: Mapping[str, str] | None = None,
    ) -> bytes:
        """What the chosen replica is sent: `raw`, or with a peer pull from a replica that holds more of the
        prompt (peer_pull.py)."""
        if self.pulls is None:
            return raw
        held = self.index.held
        sent: bytes = await self.pulls.body(service, chosen, path, raw, body, blocks, ready, held, headers)
        return sent

    def applies(self, policy: str, adapter: str | None, method: str, path: str) -> bool:
        """Generation requests on a ``prefix`` service's base model (LoRA requests route by adapter)."""
        return policy == "prefix" and adapter is None and self.digests.handles(method, path)

    async def blocks(
        self,
        service: tuple[str, str],
        path: str,
        raw: bytes,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        ready: Sequence[str],
        loads: Mapping[str, float],
    ) -> PromptBlocks | None:
        """The prompt's digests, asked of the least loaded ready replica; None where no replica's index is
        synced (the ring decides without the call) or none could answer."""
        synced = [r for r in ready if self.index.held(r) is not None]
        if not synced:
            return None
        asked = min(synced, key=lambda r: loads.get(r, 0.0))
        return await self.digests.of(service, path, raw, body, asked, headers)

    def pick(
        self,
        policy: str,
        replicas: Sequence[str],
        loads: Mapping[str, float],
        key: int,
        ring: routing.Ring,
        blocks: PromptBlocks | None,
        epsilon: float,
        rng: random.Random,
    ) -> tuple[routing.Choice, str]:
        return pick(
            policy,
            replicas,
            loads,
            key,
            ring,
            blocks,
            self.index.held,
            epsilon=epsilon,
            offload_weight=self.offload_weight,
            rng=rng,
        )
