"""From the runtime pods' /metrics text to the law's Signals: rates, attainment and p90s over windows.

Counters are differenced per pod between two scrapes a window apart (a pod seen in only
one of them is left out; a counter that went down restarted from zero). Gauges come
from the newest scrape. Names are the runtime's; vLLM's `vllm:` names map onto them.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from goodput_contract.metrics import (
    ENGINE_ALIASES,
    KV_CACHE_USAGE,
    REQUESTS,
    REQUESTS_GOOD,
    REQUESTS_RUNNING,
    REQUESTS_WAITING,
    TPOT,
    TTFT,
)
from goodput_operator.autoscaling.law import Signals

# runtime series -> the PodSample field it adds up into
_SUMMED = {REQUESTS: "requests", REQUESTS_GOOD: "good", REQUESTS_RUNNING: "running", REQUESTS_WAITING: "waiting",
           KV_CACHE_USAGE: "kv_usage"}


@dataclass(frozen=True)
class PodSample:
    requests: float = 0.0  # finished, any outcome
    good: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    ttft_buckets: tuple[tuple[float, float], ...] = ()  # (le, cumulative count)
    tpot_buckets: tuple[tuple[float, float], ...] = ()


def parse_pod_metrics(text: str) -> PodSample:
    """One pod's exposition text; raises ValueError when it is not the runtime's."""
    values: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {TTFT: {}, TPOT: {}}
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            for old, new in ENGINE_ALIASES.items():
                name = name.replace(old, new, 1) if name.startswith(old) else name
            if name in _SUMMED:
                seen = seen or name == REQUESTS
                key = _SUMMED[name]
                values[key] = values.get(key, 0.0) + sample.value
            elif name.endswith("_bucket") and name[: -len("_bucket")] in buckets:
                le = float(sample.labels["le"])
                table = buckets[name[: -len("_bucket")]]
                table[le] = table.get(le, 0.0) + sample.value
    if not seen:
        raise ValueError(f"no {REQUESTS} series: not a Goodput runtime")
    return PodSample(values.get("requests", 0.0), values.get("good", 0.0), values.get("running", 0.0),
                     values.get("waiting", 0.0), values.get("kv_usage", 0.0),
                     tuple(sorted(buckets[TTFT].items())), tuple(sorted(buckets[TPOT].items())))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (le, count) pairs; None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def _delta(new: float, old: float) -> float:
    return new - old if new >= old else new  # restarted pod: its counter began again at zero


@dataclass
class History:
    """Scrapes of one service's ready pods, oldest first, kept for the long window."""

    keep_seconds: float
    scrapes: deque[tuple[float, dict[str, PodSample]]] = field(default_factory=deque)

    def add(self, now: float, pods: dict[str, PodSample]) -> None:
        self.scrapes.append((now, pods))
        while self.scrapes and now - self.scrapes[0][0] > self.keep_seconds:
            self.scrapes.popleft()

    def _base(self, now: float, window: float) -> tuple[float, dict[str, PodSample]] | None:
        """The newest scrape at least `window` old, else the oldest one (None if that is the newest)."""
        older = [s for s in self.scrapes if now - s[0] >= window - 1e-6]
        base = older[-1] if older else self.scrapes[0]
        return None if base is self.scrapes[-1] else base

    def finished(self, now: float, window: float) -> tuple[float, float]:
        """(finished, good) requests over the window."""
        base = self._base(now, window)
        if base is None:
            return 0.0, 0.0
        latest = self.scrapes[-1][1]
        pods = latest.keys() & base[1].keys()
        total = sum(_delta(latest[p].requests, base[1][p].requests) for p in pods)
        good = sum(_delta(latest[p].good, base[1][p].good) for p in pods)
        return total, good

    def attainment(self, now: float, window: float) -> float | None:
        total, good = self.finished(now, window)
        return min(1.0, good / total) if total > 0 else None

    def _arrival_rate(self, base: tuple[float, dict[str, PodSample]]) -> float:
        """Finished requests plus the growth of those running and waiting, per second since `base`."""
        then, old = base
        latest = self.scrapes[-1][1]
        pods = latest.keys() & old.keys()
        elapsed = max(self.scrapes[-1][0] - then, 1e-9)
        finished = sum(_delta(latest[p].requests, old[p].requests) for p in pods)
        in_flight = sum(latest[p].running + latest[p].waiting - old[p].running - old[p].waiting for p in pods)
        return max(0.0, (finished + in_flight) / elapsed)

    def signals(self, now: float, window: float, long_window: float) -> Signals | None:
        """None until two scrapes exist: a rate needs an interval."""
        base = self._base(now, window)
        if base is None:
            return None
        old = base[1]
        latest = self.scrapes[-1][1]
        pods = latest.keys() & old.keys()
        ttft = self._bucket_delta(pods, latest, old, "ttft_buckets")
        tpot = self._bucket_delta(pods, latest, old, "tpot_buckets")
        return Signals(
            arrival_rate=self._arrival_rate(base),
            arrival_rate_now=self._arrival_rate(self.scrapes[-2]),
            attainment=self.attainment(now, window),
            attainment_long=self.attainment(now, long_window),
            waiting=round(sum(s.waiting for s in latest.values())),
            running=round(sum(s.running for s in latest.values())),
            kv_usage=sum(s.kv_usage for s in latest.values()) / max(1, len(latest)),
            ttft_p90=histogram_quantile(0.9, ttft),
            tpot_p90=histogram_quantile(0.9, tpot),
            finished_long=self.finished(now, long_window)[0],
            finished=self.finished(now, window)[0],
        )

    @staticmethod
    def _bucket_delta(pods: set[str], latest: dict[str, PodSample], old: dict[str, PodSample],
                      attr: str) -> list[tuple[float, float]]:
        table: dict[float, float] = {}
        for pod in pods:
            before = dict(getattr(old[pod], attr))
            for le, count in getattr(latest[pod], attr):
                table[le] = table.get(le, 0.0) + _delta(count, before.get(le, 0.0))
        return sorted(table.items())
