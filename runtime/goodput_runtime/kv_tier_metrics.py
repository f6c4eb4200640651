"""The KV cache tiers' series, collected at scrape time."""

from __future__ import annotations

from typing import Any

from goodput_contract import metrics as names


class KvTierCollector:
    """The KV cache's tiers, read at scrape time from the block manager's event log and the offload
    tier's counters (engine/kv_events.py, engine/kv_offload.py): nothing on the step loop."""

    def __init__(self, model: str, block_manager: Any) -> None:
        self.model = model
        self.block_manager = block_manager

    def describe(self) -> list[Any]:
        return []  # collected only when scraped

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        m = self.model
        events = self.block_manager.events
        if events is not None:
            held = GaugeMetricFamily(names.KV_TIER_BLOCKS, "Prefix blocks held per KV tier.", labels=["model", "tier"])
            for tier, count in events.counts().items():
                held.add_metric([m, tier], count)
            yield held
        store = self.block_manager.offload
        if store is None:
            return
        s = store.stats

        def counter(name: str, doc: str, value: float) -> Any:
            family = CounterMetricFamily(name.removesuffix("_total"), doc, labels=["model"])
            family.add_metric([m], value)
            return family

        def gauge(name: str, doc: str, value: float) -> Any:
            family = GaugeMetricFamily(name, doc, labels=["model"])
            family.add_metric([m], value)
            return family

        yield counter(names.KV_OFFLOAD_HIT_TOKENS, "Prompt tokens loaded from the KV offload tier.", s.loaded_tokens)
        moved = CounterMetricFamily(
            names.KV_OFFLOAD_BYTES.removesuffix("_total"),
            "Bytes written to and read back from the KV offload tier.",
            labels=["model", "direction"],
        )
        moved.add_metric([m, "offload"], s.offload_bytes)
        moved.add_metric([m, "reload"], s.reload_bytes)
        yield moved
        spent = CounterMetricFamily(
            names.KV_OFFLOAD_SECONDS.removesuffix("_total"),
            "Seconds spent writing to (on its writer thread) and reloading from the KV offload tier.",
            labels=["model", "direction"],
        )
        spent.add_metric([m, "offload"], s.offload_seconds)
        spent.add_metric([m, "reload"], s.reload_seconds)
        yield spent
        yield gauge(names.KV_OFFLOAD_USED_BYTES, "Bytes of the KV offload tier in use.", store.used_bytes)
        yield gauge(names.KV_OFFLOAD_CAPACITY_BYTES, "The KV offload tier's bound in bytes.", store.capacity)
        yield counter(names.KV_OFFLOAD_CORRUPT, "KV offload entries that failed their check (recomputed).", s.corrupt)
        yield counter(
            names.KV_OFFLOAD_DROPPED_SAVES, "Evicted blocks not saved: the tier's writer was behind.", s.dropped_saves
        )
