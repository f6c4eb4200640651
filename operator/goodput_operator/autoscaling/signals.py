"""From the runtime pods' /metrics text to the law's Signals: rates, attainment and p90s over windows.

Counters are differenced per pod between two scrapes a window apart (a pod that became ready
within the window from its first scrape; a pod gone from the newest scrape is left out; a counter
that went down restarted from zero). Gauges come
from the newest scrape. Names are the runtime's, vLLM's or SGLang's (goodput_contract.metrics
ENGINE_METRICS); for the engines without a good counter, good requests are estimated from the
TTFT and TPOT histograms against the SLO (share_within, estimated_good).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from goodput_contract.metrics import E2E_LATENCY, ENGINE_METRICS, GENERATION_TOKENS, PROMPT_TOKENS, EngineMetrics
from goodput_operator.autoscaling.dispersion import DISPERSION_PERIODS, index_of_dispersion, size_spread
from goodput_operator.autoscaling.state import Signals

Buckets = tuple[tuple[float, float], ...]  # (le, cumulative count)
# each engine's histogram of end-to-end request latency, from which the spread of request sizes is read
E2E_HISTOGRAMS = {
    "goodput": (E2E_LATENCY,),
    "vllm": ("vllm:e2e_request_latency_seconds",),
    "sglang": ("sglang:e2e_request_latency_seconds",),
}
# each engine's counters of prompt and generated tokens, for a disaggregated service's pools (pools.py)
TOKEN_COUNTERS = {
    "goodput": (PROMPT_TOKENS, GENERATION_TOKENS),
    "vllm": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    "sglang": ("sglang:prompt_tokens_total", "sglang:generation_tokens_total"),
}
HANDOFF_SECONDS = "goodput_kv_transfer_seconds"  # the decode side's pull of a hand-off, histogram


@dataclass(frozen=True)
class PodSample:
    requests: float = 0.0  # finished, any outcome
    good: float = 0.0  # met the SLO (when counts_good)
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    ttft_buckets: Buckets = ()
    tpot_buckets: Buckets = ()
    engine: str = "goodput"  # whose names the text used
    failed: float = 0.0  # finished without success (aborted, errors)
    counts_good: bool = True  # False: the engine has no good counter; it is estimated against the SLO
    rejected: float = 0.0  # refused before being queued (admission's 429s): arrivals the pod never served
    e2e_buckets: Buckets = ()  # end-to-end latency, for the spread of request sizes
    prompt_tokens: float = 0.0  # counters: prompt tokens computed, tokens generated
    output_tokens: float = 0.0
    handoff_seconds: float = 0.0  # the KV hand-offs' summed seconds and their count (decode side)
    handoffs: float = 0.0


def _detect(names: set[str]) -> EngineMetrics:
    for metrics in ENGINE_METRICS.values():
        if metrics.requests[0] in names:
            return metrics
    raise ValueError(
        f"no {' or '.join(m.requests[0] for m in ENGINE_METRICS.values())} series: "
        "not a Goodput runtime nor a known engine"
    )


def parse_pod_metrics(text: str) -> PodSample:
    """One pod's exposition text, from our runtime, vLLM or SGLang (told apart by their names);
    raises ValueError for any other exporter."""
    samples = [sample for family in text_string_to_metric_families(text) for sample in family.samples]
    m = _detect({sample.name for sample in samples})
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for sample in samples:
        by_name.setdefault(sample.name, []).append((sample.labels, sample.value))

    def total(name: str, **match: str) -> float:
        return sum(
            value
            for labels, value in by_name.get(name, ())
            if all(labels.get(k, v) == v for k, v in match.items())  # a series without the label counts
        )

    def first(names: tuple[str, ...], suffix: str = "") -> str | None:
        return next((n for n in names if n + suffix in by_name), None)

    def gauge(names: tuple[str, ...], average: bool = False) -> float:
        name = first(names)
        if name is None:
            return 0.0
        values = [value for _, value in by_name[name]]
        return sum(values) / len(values) if average else sum(values)

    def buckets(names: tuple[str, ...]) -> Buckets:
        name = first(names, "_bucket")
        table: dict[float, float] = {}
        for labels, value in by_name.get(f"{name}_bucket", ()):
            le = float(labels["le"])
            table[le] = table.get(le, 0.0) + value
        return tuple(sorted(table.items()))

    failed = sum(
        value
        for counter, label, values in m.failed
        for labels, value in by_name.get(counter, ())
        if not label or labels.get(label) in values
    )
    return PodSample(
        requests=sum(total(name) for name in m.requests),
        good=total(m.good) if m.good else 0.0,
        running=gauge(m.running),
        waiting=gauge(m.waiting),
        kv_usage=gauge(m.kv_usage, average=True),
        ttft_buckets=buckets(m.ttft),
        tpot_buckets=buckets(m.tpot),
        engine=m.engine,
        failed=failed,
        counts_good=m.good is not None,
        rejected=sum(total(name) for name in m.rejected),
        e2e_buckets=buckets(E2E_HISTOGRAMS.get(m.engine, ())),
        prompt_tokens=total(TOKEN_COUNTERS[m.engine][0]),
        output_tokens=total(TOKEN_COUNTERS[m.engine][1]),
        handoff_seconds=total(HANDOFF_SECONDS + "_sum", role="decode"),  # peer pulls are role peer
        handoffs=total(HANDOFF_SECONDS + "_count", role="decode"),
    )


def share_within(buckets: list[tuple[float, float]] | Buckets, target: float | None) -> float | None:
    """The share of a histogram's observations at or below `target`: exact when `target` is a bucket
    boundary (the operator makes the SLO one), else linearly interpolated inside its bucket as
    Prometheus does. 1 without a target; None without observations."""
    if target is None:
        return 1.0
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if le >= target - 1e-12:
            if math.isinf(le) or le <= target + 1e-12:
                return (count if not math.isinf(le) else prev_count) / total
            return (prev_count + (count - prev_count) * (target - prev_le) / (le - prev_le)) / total
        prev_le, prev_count = le, count
    return prev_count / total


def estimated_good(successes: float, ttft_share: float | None, tpot_share: float | None) -> float:
    """Requests within both targets, from the shares within each: the smaller share is an upper bound of
    the share within both, exact when the requests that miss one target also miss the other (or none
    misses one of them)."""
    shares = [s for s in (ttft_share, tpot_share) if s is not None]
    return successes * min(shares) if shares else successes


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


def _bucket_pair_delta(new: Buckets, old: Buckets) -> list[tuple[float, float]]:
    before = dict(old)
    if new and before and new[-1][1] < before.get(new[-1][0], 0.0):
        before = {}  # restarted pod
    return [(le, count - before.get(le, 0.0)) for le, count in new]


@dataclass
class History:
    """Scrapes of one service's ready pods, oldest first, kept for the long window."""

    keep_seconds: float
    slo_ttft: float | None = None  # the targets good requests are estimated against, for engines
    slo_tpot: float | None = None  # without a good counter of their own
    scrapes: deque[tuple[float, dict[str, PodSample]]] = field(default_factory=deque)
    # (seconds, arrivals) between consecutive scrapes: the counts whose dispersion says how bursty arrivals are
    periods: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=DISPERSION_PERIODS))

    def add(self, now: float, pods: dict[str, PodSample]) -> None:
        self.scrapes.append((now, pods))
        if len(self.scrapes) >= 2:
            before = self.scrapes[-2]
            span = now - before[0]
            self.periods.append((span, self._arrival_rate(before) * span))
        while self.scrapes and now - self.scrapes[0][0] > self.keep_seconds:
            self.scrapes.popleft()

    def _base(self, now: float, window: float) -> tuple[float, dict[str, PodSample]] | None:
        """The newest scrape at least `window` old, else the oldest one (None if that is the newest)."""
        older = [s for s in self.scrapes if now - s[0] >= window - 1e-6]
        base = older[-1] if older else self.scrapes[0]
        return None if base is self.scrapes[-1] else base

    def _pairs(self, base: tuple[float, dict[str, PodSample]]) -> list[tuple[PodSample, PodSample]]:
        """(newest, older) samples of each pod in the newest scrape: the older one from `base`, or for a pod
        not in it from the first scrape that read it. Such a pod was not ready at `base` and served nothing
        before, so its counters since then are its part of the window: left out instead, the rate read one
        pod short for a window after every scale-up (half the load, after 1 → 2). A pod read only now has
        nothing to difference yet."""
        then, old = base
        latest = self.scrapes[-1][1]
        pairs = []
        for pod, sample in latest.items():
            if pod in old:
                pairs.append((sample, old[pod]))
                continue
            first = next((pods[pod] for t, pods in list(self.scrapes)[:-1] if t > then and pod in pods), None)
            if first is not None:
                pairs.append((sample, first))
        return pairs

    def finished(self, now: float, window: float) -> tuple[float, float]:
        """(finished, good) requests over the window."""
        base = self._base(now, window)
        if base is None:
            return 0.0, 0.0
        pairs = self._pairs(base)
        total = sum(_delta(new.requests, old.requests) for new, old in pairs)
        good = sum(self._good(new, old) for new, old in pairs)
        return total, good

    def _good(self, new: PodSample, old: PodSample) -> float:
        if new.counts_good:
            return _delta(new.good, old.good)
        successes = max(0.0, _delta(new.requests, old.requests) - _delta(new.failed, old.failed))
        ttft = _bucket_pair_delta(new.ttft_buckets, old.ttft_buckets)
        tpot = _bucket_pair_delta(new.tpot_buckets, old.tpot_buckets)
        return estimated_good(successes, share_within(ttft, self.slo_ttft), share_within(tpot, self.slo_tpot))

    def attainment(self, now: float, window: float) -> float | None:
        total, good = self.finished(now, window)
        return min(1.0, good / total) if total > 0 else None

    def _arrival_rate(self, base: tuple[float, dict[str, PodSample]]) -> float:
        """Finished and refused requests plus the growth of those running and waiting, per second since
        `base`: a request admission refused with 429 was demand all the same, and the count that would
        have served it is what the autoscaler must find."""
        elapsed = max(self.scrapes[-1][0] - base[0], 1e-9)
        arrived = sum(
            _delta(new.requests, old.requests)
            + _delta(new.rejected, old.rejected)
            + new.running
            + new.waiting
            - old.running
            - old.waiting
            for new, old in self._pairs(base)
        )
        return max(0.0, arrived / elapsed)

    def signals(self, now: float, window: float, long_window: float) -> Signals | None:
        """None until two scrapes exist: a rate needs an interval."""
        base = self._base(now, window)
        if base is None:
            return None
        latest = self.scrapes[-1][1]
        pairs = self._pairs(base)
        ttft = self._bucket_delta(pairs, "ttft_buckets")
        tpot = self._bucket_delta(pairs, "tpot_buckets")
        dispersion = index_of_dispersion(list(self.periods))
        long_base = self._base(now, long_window)
        long_pairs = self._pairs(long_base) if long_base is not None else []
        sizes = size_spread(
            self._bucket_delta(long_pairs, "e2e_buckets"), self._bucket_delta(long_pairs, "ttft_buckets")
        )
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
            dispersion=None if dispersion is None else dispersion.index,
            peakedness=1.0 if dispersion is None else dispersion.peakedness,
            size_cv2=sizes,
            ttft_within=share_within(ttft, self.slo_ttft) if self.slo_ttft is not None else None,
            tpot_within=share_within(tpot, self.slo_tpot) if self.slo_tpot is not None else None,
            **self._tokens(pairs, base),
        )

    def _tokens(self, pairs: list[tuple[PodSample, PodSample]], base: tuple[float, dict[str, PodSample]]) -> dict:
        """Token rates over the window, and the hand-off's mean seconds (None where nothing was counted)."""
        elapsed = max(self.scrapes[-1][0] - base[0], 1e-9)
        prompt = sum(_delta(new.prompt_tokens, old.prompt_tokens) for new, old in pairs)
        output = sum(_delta(new.output_tokens, old.output_tokens) for new, old in pairs)
        seconds = sum(_delta(new.handoff_seconds, old.handoff_seconds) for new, old in pairs)
        count = sum(_delta(new.handoffs, old.handoffs) for new, old in pairs)
        return {
            "prompt_tokens_rate": prompt / elapsed,
            "output_tokens_rate": output / elapsed,
            "handoff_seconds": seconds / count if count > 0 else None,
        }

    @staticmethod
    def _bucket_delta(pairs: list[tuple[PodSample, PodSample]], attr: str) -> list[tuple[float, float]]:
        table: dict[float, float] = {}
        for new, old in pairs:
            before = dict(getattr(old, attr))
            for le, count in getattr(new, attr):
                table[le] = table.get(le, 0.0) + _delta(count, before.get(le, 0.0))
        return sorted(table.items())
