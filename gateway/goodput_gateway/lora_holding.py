"""Requests for a LoRA adapter held while a replica loads it.

A runtime shows each adapter it is loading and does not serve yet in ``goodput_lora_loading{adapter}``
on its /metrics (a load on first use from ``--lora-source``, or through ``POST /v1/load_lora_adapter``),
until the load ends, loaded or refused. The gateway's scrape reads it (loads.py), and a replica's
loading adapters join its /v1/models cards, marked ``loading``, so their names resolve to the service
while they load (where that page can be read: not a keyed replica's).

A request for an adapter that some ready replica of its service is loading, and that no ready replica
lists in /v1/models or has requests on (``vllm:lora_requests_info``), waits in the service's holding
queue (holding.py) with the requests held at zero replicas: the same bound on their number (429) and
on their wait (503), both with Retry-After, counted in ``goodput_gateway_requests_waiting``. It goes
on at the first scrape after the load ends: to the replicas that list the adapter, or, where the load
failed, by the service's policy to a replica that answers it (a 404 for a name it does not serve, or
the cause of a failed load on first use). A request for an adapter no replica is loading and none
lists is never held: it goes by the policy, so a runtime with ``--lora-source`` loads it on first use.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from goodput_contract.metrics import LORA_LOADING
from goodput_gateway.routing import AdapterState

LOADING_SERIES = LORA_LOADING
_SAMPLE = re.compile(rf"^{re.escape(LORA_LOADING)}\{{(?P<labels>[^}}]*)\}}\s+(?P<value>\S+)")
_ADAPTER = re.compile(r'(?:^|,)\s*adapter="((?:[^"\\]|\\.)*)"')


def loading_adapters(metrics_text: str) -> frozenset[str]:
    """The adapters a replica's /metrics shows loading."""
    names = set()
    for line in metrics_text.splitlines():
        if not line.startswith(LOADING_SERIES + "{"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            if float(match["value"]) <= 0:
                continue
        except ValueError:
            continue
        adapter = _ADAPTER.search(match["labels"])
        if adapter is not None and adapter[1]:
            names.add(adapter[1])
    return frozenset(names)


def loading_cards(loading: frozenset[str], cards: Sequence[Mapping[str, Any]], base: str) -> list[dict[str, Any]]:
    """Model cards, marked ``loading``, for the adapters of `loading` that `cards` does not list."""
    listed = {m.get("id") for m in cards}
    return [{"id": name, "object": "model", "parent": base, "loading": True} for name in sorted(loading - listed)]


class Scrape(Protocol):
    """What the load scraper knows of each replica (loads.LoadScraper)."""

    lora: dict[str, AdapterState]
    loading: dict[str, frozenset[str]]
    round: asyncio.Event

    def serving(self, url: str, adapter: str) -> bool: ...


class AdapterLoad:
    """One request's adapter, as the holding queue asks about it: whether its load holds the request
    (`pending`) and what wakes a held request to ask again (`changed`: each scrape's end)."""

    def __init__(self, scrape: Scrape, adapter: str) -> None:
        self.scrape, self.adapter = scrape, adapter

    def pending(self, ready: Sequence[str]) -> bool:
        """Some replica of `ready` is loading the adapter, and none lists it or has requests on it."""
        adapter = self.adapter
        if not any(adapter in self.scrape.loading.get(r, ()) for r in ready):
            return False
        for r in ready:
            state = self.scrape.lora.get(r)
            if self.scrape.serving(r, adapter) or (state is not None and state.loaded(adapter)):
                return False
        return True

    def changed(self) -> asyncio.Event:
        return self.scrape.round
