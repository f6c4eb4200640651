"""Each ready replica's queue and KV usage, scraped from its /metrics every period."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import aiohttp

from goodput_contract.metrics import ENGINE_METRICS

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

    def __init__(self, session: aiohttp.ClientSession, targets: Callable[[], Iterable[str]], period: float) -> None:
        self.session, self.targets, self.period = session, targets, period
        self.scraped: dict[str, tuple[float, float]] = {}

    async def _scrape(self, url: str) -> None:
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=self.period)) as r:
                if r.status == 200:
                    self.scraped[url] = parse_load(await r.text())
                    return
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        self.scraped.pop(url, None)

    async def run_forever(self) -> None:
        while True:
            urls = set(self.targets())
            for gone in set(self.scraped) - urls:
                self.scraped.pop(gone, None)
            await asyncio.gather(*(self._scrape(u) for u in urls))
            await asyncio.sleep(self.period)

    def extra(self, url: str) -> float:
        waiting, kv = self.scraped.get(url, (0.0, 0.0))
        return waiting + min(max(kv, 0.0), 0.999)
