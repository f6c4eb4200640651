"""Which replica serves a request: prefix affinity with bounded loads, least load, or random.

Pure: replicas are names (base URLs), loads are numbers the caller measured. A replica's
load is the requests this gateway has outstanding on it plus its waiting queue as scraped
from its /metrics, plus its KV cache usage (a share, 0..1, from the same scrape), which
breaks ties between replicas carrying as many requests.

Prefix affinity is consistent hashing with bounded loads (Mirrokni et al.; KubeAI's
PrefixHash): the prompt's leading characters pick a point on a ring of virtual nodes, and
the first replica clockwise from it whose load stays within (1 + ε) × the mean takes the
request. Requests that share a prefix land on the same replica, whose prefix cache then
holds it, until that replica is overloaded; then the next one on the ring takes the
overflow, the same next one for the same prefix.

A request for a LoRA adapter (``choose_adapter``) goes first to the replicas where the adapter is
loaded, next to those with a free adapter slot, and only when every replica is full to one without
a slot: the Gateway API Inference Extension's LoRA-affinity order, read from each replica's
``vllm:lora_requests_info`` (``lora_state``). Within a tier the policy picks as for any request, the
ring keyed on (adapter, prefix), and a tier whose replicas are all past the load bound passes the
request to the next.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

POLICIES = ("prefix", "least-load", "random")
AFFINITY, OVERFLOW, LEAST_LOAD, RANDOM, RETRY = "affinity", "overflow", "least_load", "random", "retry"
LORA_WARM, LORA_FREE_SLOT, LORA_NO_SLOT = "lora_warm", "lora_free_slot", "lora_no_slot"
CHUNK_CHARS = 256  # the gateway has no tokenizer: prefixes are compared in characters
PREFIX_CHUNKS = 2  # leading whole chunks that make the key
VIRTUAL_NODES = 100  # ring points per replica
EPSILON = 0.25


def _hash(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prompt_text(body: Mapping[str, Any]) -> str:
    """The prompt as the runtime would see its start: chat messages rendered role by role, or the prompt.

    A token-id prompt counts as its digits; an input list (embeddings) as its first item.
    """
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: the text ones
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
            parts.append(f"<{m.get('role', '')}>{content if content is not None else ''}\n")
        return "".join(parts)
    for name in ("prompt", "input"):
        value = body.get(name)
        if isinstance(value, list) and value:
            value = value[0]
        if value is not None:
            return value if isinstance(value, str) else str(value)
    return ""


def prefix_key(text: str, chunk_chars: int = CHUNK_CHARS, chunks: int = PREFIX_CHUNKS) -> int:
    """A hash of the text's leading whole chunks (up to `chunks` of them); a text shorter than
    one chunk hashes whole. A conversation that grows keeps its key once it is long enough."""
    whole = min(chunks, len(text) // chunk_chars)
    lead = text[: whole * chunk_chars] if whole else text
    return _hash(lead.encode("utf-8", "surrogatepass"))


class Ring:
    """A consistent-hash ring of `VIRTUAL_NODES` points per replica."""

    def __init__(self, replicas: Sequence[str], virtual_nodes: int = VIRTUAL_NODES) -> None:
        self.replicas = tuple(sorted(set(replicas)))
        points = sorted((_hash(f"{r}#{i}".encode()), r) for r in self.replicas for i in range(virtual_nodes))
        self._hashes = [h for h, _ in points]
        self._owners = [r for _, r in points]

    def walk(self, key: int) -> Iterator[str]:
        """Each replica once, clockwise from the key's point."""
        if not self._owners:
            return
        start = bisect.bisect(self._hashes, key)
        seen: set[str] = set()
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self.replicas):
                    return


@dataclass(frozen=True)
class Choice:
    replica: str
    decision: str  # affinity | overflow | least_load | random


def requests_of(load: float) -> int:
    """The whole requests in a load; the fraction is KV usage, which only breaks ties."""
    return int(load)


def load_bound(loads: Mapping[str, float], replicas: Sequence[str], epsilon: float) -> int:
    """The most requests one replica may carry after taking this one: ⌈(1 + ε) × the mean⌉, this one counted."""
    total = sum(requests_of(loads.get(r, 0.0)) for r in replicas) + 1
    return math.ceil((1.0 + epsilon) * total / len(replicas))


def within(load: float, bound: int) -> bool:
    return requests_of(load) + 1 <= bound


def least_loaded(replicas: Sequence[str], loads: Mapping[str, float], rng: random.Random) -> str:
    low = min(loads.get(r, 0.0) for r in replicas)
    return rng.choice([r for r in replicas if loads.get(r, 0.0) == low])


def choose(
    policy: str,
    replicas: Sequence[str],
    loads: Mapping[str, float],
    key: int,
    *,
    ring: Ring | None = None,
    epsilon: float = EPSILON,
    rng: random.Random | None = None,
) -> Choice:
    """The replica for one request under `policy`; `replicas` must not be empty."""
    rng = rng or random.Random()
    if policy == "least-load":
        return Choice(least_loaded(replicas, loads, rng), LEAST_LOAD)
    bound = load_bound(loads, replicas, epsilon)
    if policy == "random":
        pick = rng.choice(list(replicas))
        if not within(loads.get(pick, 0.0), bound):
            return Choice(least_loaded(replicas, loads, rng), OVERFLOW)
        return Choice(pick, RANDOM)
    ring = ring if ring is not None and set(ring.replicas) == set(replicas) else Ring(replicas)
    for i, replica in enumerate(ring.walk(key)):
        if within(loads.get(replica, 0.0), bound):
            return Choice(replica, AFFINITY if i == 0 else OVERFLOW)
    return Choice(least_loaded(replicas, loads, rng), OVERFLOW)


# --- LoRA adapters ---------------------------------------------------------------------------------

LORA_INFO_SERIES = ("vllm:lora_requests_info", "goodput_lora_requests_info")
_SAMPLE = re.compile(r"^(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)\{(?P<labels>.*)\}\s+(?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class AdapterState:
    """One replica's adapters, from its newest ``vllm:lora_requests_info`` sample."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_lora: int

    def loaded(self, adapter: str) -> bool:
        return adapter in self.running or adapter in self.waiting

    @property
    def free_slot(self) -> bool:
        return len(self.running | self.waiting) < self.max_lora


def lora_state(metrics_text: str) -> AdapterState | None:
    """The replica's adapters from a /metrics scrape: the newest sample (its value is the time it was
    set) of vLLM's gauge, or of the runtime's twin; None where there is neither."""
    best: tuple[float, dict[str, str]] | None = None
    for line in metrics_text.splitlines():
        if not line.startswith(LORA_INFO_SERIES):
            continue
        match = _SAMPLE.match(line)
        if match is None or match["name"] not in LORA_INFO_SERIES:
            continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if best is None or value > best[0]:
            best = (value, dict(_LABEL.findall(match["labels"])))
    if best is None:
        return None
    labels = best[1]

    def names(label: str) -> frozenset[str]:
        return frozenset(n for n in labels.get(label, "").split(",") if n)

    try:
        max_lora = int(labels.get("max_lora", "0"))
    except ValueError:
        max_lora = 0
    return AdapterState(names("running_lora_adapters"), names("waiting_lora_adapters"), max_lora)


def adapter_key(adapter: str, key: int) -> int:
    """The ring key of a request for `adapter` with prefix key `key`: (adapter, prefix)."""
    return _hash(adapter.encode() + b"\0" + key.to_bytes(8, "big"))


def adapter_tiers(
    replicas: Sequence[str], states: Mapping[str, AdapterState | None], adapter: str
) -> list[tuple[str, list[str]]]:
    """(decision, replicas) in the LoRA-affinity order: the adapter loaded; a free slot (or no state
    scraped yet); no slot. Empty tiers left out."""
    warm, free, full = [], [], []
    for r in replicas:
        state = states.get(r)
        if state is not None and state.loaded(adapter):
            warm.append(r)
        elif state is None or state.free_slot:
            free.append(r)
        else:
            full.append(r)
    return [(d, t) for d, t in ((LORA_WARM, warm), (LORA_FREE_SLOT, free), (LORA_NO_SLOT, full)) if t]


def choose_adapter(
    policy: str,
    replicas: Sequence[str],
    loads: Mapping[str, float],
    key: int,
    adapter: str,
    states: Mapping[str, AdapterState | None],
    *,
    epsilon: float = EPSILON,
    rng: random.Random | None = None,
) -> Choice:
    """The replica for a request on LoRA `adapter`: the first tier of ``adapter_tiers`` with a replica
    within the load bound (over every replica), the policy choosing among those; the least loaded
    replica when none is within it. `replicas` must not be empty."""
    rng = rng or random.Random()
    bound = load_bound(loads, replicas, epsilon)
    ring_key = adapter_key(adapter, key)
    for decision, tier in adapter_tiers(replicas, states, adapter):
        candidates = [r for r in tier if within(loads.get(r, 0.0), bound)]
        if candidates:
            picked = choose(policy, candidates, loads, ring_key, epsilon=epsilon, rng=rng)
            return Choice(picked.replica, decision)
    return Choice(least_loaded(replicas, loads, rng), OVERFLOW)
