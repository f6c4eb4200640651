"""Each ready replica's queue and KV usage, scraped from its /metrics every period; with them, its LoRA
adapters: those of its running and waiting requests (``vllm:lora_requests_info``, from the same page) and
those it serves (the cards of its /v1/models whose parent is another model), and those it is loading
(``goodput_lora_loading``, from the same page: lora_holding.py), which count among its cards marked
``loading`` so that their names resolve while they load."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import aiohttp

from goodput_contract.metrics import ENGINE_METRICS
from goodput_gateway.lora_holding import loading_adapters, loading_cards
from goodput_gateway.routing import AdapterState, lora_state

# every engine's series for the same two signals (a replica exports one engine's names)
WAITING = frozenset(name for m in ENGINE_METRICS.values() for name in m.waiting)
KV_USAGE = frozenset(name for m in ENGINE_METRICS.values() for name in m.kv_usage)

logger = logging.getLogger(__name__)


def parse_load(text: str) -> tuple[float, float]:
    """(waiting requests, KV cache usage) from exposition text, summed over the series' labels; our
    runtime's names, vLLM's or SGLang's (where vLLM exports both generations of its KV gauge, the larger)."""
    waiting = 0.0
    kv: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in WAITING or name in KV_USAGE:
            try:
                value = float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
            if name in WAITING:
                waiting += value
            else:
                kv[name] = kv.get(name, 0.0) + value
    return waiting, max(kv.values(), default=0.0)


class LoadScraper:
    """Keeps `scraped[url] = (waiting, kv usage)` for the replicas `targets()` names; a replica whose
    /metrics cannot be read counts as neither queued nor full (its outstanding requests still count)."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        targets: Callable[[], Iterable[str]],
        period: float,
        scraped_all: Callable[[], None] | None = None,
        authorization: Callable[[str], Awaitable[str | None]] | None = None,
    ) -> None:
        self.session, self.targets, self.period = session, targets, period
        # a replica's Authorization header for its /v1/models (its service's runtime key; None: no header)
        self.authorization = authorization
        self.scraped: dict[str, tuple[float, float]] = {}
        self.lora: dict[str, AdapterState] = {}  # replicas that export the adapters' gauge
        self.cards: dict[str, list[dict[str, Any]]] = {}  # each replica's adapter cards from /v1/models
        self.loading: dict[str, frozenset[str]] = {}  # each replica's adapters being loaded
        self.round = asyncio.Event()  # set and replaced at the end of each round
        self.scraped_all = scraped_all  # called after each round (the registry learns adapters from `cards`)

    async def _scrape(self, url: str) -> None:
        timeout = aiohttp.ClientTimeout(total=self.period)
        try:
            async with self.session.get(url + "/metrics", timeout=timeout) as r:
                if r.status == 200:
                    text = await r.text()
                    self.scraped[url] = parse_load(text)
                    self.loading[url] = loading_adapters(text)
                    state = lora_state(text)
                    if state is None:
                        self.lora.pop(url, None)
                    else:
                        self.lora[url] = state
                        await self._scrape_models(url, timeout)
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        self.scraped.pop(url, None)
        self.lora.pop(url, None)
        self.loading.pop(url, None)

    async def _scrape_models(self, url: str, timeout: aiohttp.ClientTimeout) -> None:
        """The adapters a replica serving LoRA lists, asked with its service's runtime key where it has one;
        those kept from before where it cannot be read now."""
        header = await self.authorization(url) if self.authorization is not None else None
        headers = {"Authorization": header} if header else None
        try:
            async with self.session.get(url + "/v1/models", timeout=timeout, headers=headers) as r:
                if r.status == 200:
                    data = (await r.json()).get("data")
                    if isinstance(data, list):
                        cards = [m for m in data if isinstance(m, dict) and m.get("parent") and m.get("id")]
                        base = next((str(m["id"]) for m in data if isinstance(m, dict) and not m.get("parent")), "")
                        self.cards[url] = cards + loading_cards(self.loading.get(url, frozenset()), cards, base or "?")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError):
            pass

    def serving(self, url: str, adapter: str) -> bool:
        """Whether the replica's /v1/models listed `adapter` at the latest scrape (loaded, not loading)."""
        return any(m["id"] == adapter and not m.get("loading") for m in self.cards.get(url, ()))

    async def run_forever(self) -> None:
        while True:
            urls = set(self.targets())
            for table in (self.scraped, self.lora, self.cards, self.loading):
                for gone in set(table) - urls:
                    table.pop(gone, None)
            await asyncio.gather(*(self._scrape(u) for u in urls))
            if self.scraped_all is not None:
                self.scraped_all()
            self.round.set()
            self.round = asyncio.Event()
            await asyncio.sleep(self.period)

    def extra(self, url: str) -> float:
        waiting, kv = self.scraped.get(url, (0.0, 0.0))
        return waiting + min(max(kv, 0.0), 0.999)
