"""The LoRA adapters' series: vLLM's adapter info gauge and its twin, loads, tiers, per-adapter goodput."""

from __future__ import annotations

import contextlib
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from goodput_contract import metrics as names

LORA_LABELS_CAP = 64  # adapters named in the per-adapter series; requests on others count as "other"
LORA_LOAD_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class LoraMetrics:
    """The LoRA adapters' series.

    ``vllm:lora_requests_info`` is vLLM's gauge, in the format the Gateway API Inference Extension's
    LoRA-affinity scorer reads: one series whose labels name the adapters of running and waiting
    requests (comma-separated) and ``max_lora``, its value the time it was set. ``goodput_lora_requests_info``
    is its twin. Only the current series is kept (the scorer reads the newest), so its labels never pile up.

    ``goodput_lora_loading{adapter}`` is 1 while an adapter this server does not serve yet is being loaded
    (on first use, or through the load route); the series goes when the load ends, loaded or refused.
    The gateway reads it to hold requests for that adapter until a replica lists it.
    """

    def __init__(self, registry: CollectorRegistry, model: str, max_loras: int) -> None:
        r = registry
        self.model = model
        self.max_loras = max_loras
        info_labels = ["running_lora_adapters", "waiting_lora_adapters", "max_lora"]
        self.info = Gauge(
            names.VLLM_LORA_REQUESTS_INFO, "Running and waiting LoRA adapters (vLLM's format).", info_labels, registry=r
        )
        self.info_twin = Gauge(
            names.LORA_REQUESTS_INFO, "Running and waiting LoRA adapters (vLLM's format).", info_labels, registry=r
        )
        self.loads = Counter(
            names.LORA_LOADS.removesuffix("_total"), "Adapter loads by result.", ["model", "result"], registry=r
        )
        self.load_seconds = Histogram(
            names.LORA_LOAD_SECONDS,
            "Time to read and check an adapter.",
            ["model"],
            buckets=LORA_LOAD_BUCKETS,
            registry=r,
        ).labels(model)
        self.resident = Gauge(
            names.LORA_ADAPTERS,
            "Adapters by tier: slot (usable by steps), cpu (in memory), registered.",
            ["model", "tier"],
            registry=r,
        )
        self.evictions = Counter(
            names.LORA_EVICTIONS.removesuffix("_total"),
            "Adapters dropped from a tier to make room.",
            ["model", "tier"],
            registry=r,
        )
        self.requests = Counter(
            names.LORA_REQUESTS.removesuffix("_total"),
            "Finished online requests per adapter, by outcome.",
            ["model", "adapter", "outcome"],
            registry=r,
        )
        self.good = Counter(
            names.LORA_REQUESTS_GOOD.removesuffix("_total"),
            "Requests per adapter that met both SLOs.",
            ["model", "adapter"],
            registry=r,
        )
        self.loading = Gauge(
            names.LORA_LOADING, "Adapters being loaded, not served yet.", ["model", "adapter"], registry=r
        )
        self.loads_running: Tally[str] = Tally()
        self.named: set[str] = set()
        for result in ("ok", "error"):
            self.loads.labels(model, result)
        for tier in ("slot", "cpu"):
            self.evictions.labels(model, tier)
        self.last: tuple[str, str] | None = None
        self.record_adapters([], [], (0, 0, 0))

    def label(self, adapter: str) -> str:
        if adapter in self.named or len(self.named) < LORA_LABELS_CAP:
            self.named.add(adapter)
            return adapter
        return "other"

    def record_adapters(self, running: list[str], waiting: list[str], tiers: tuple[int, int, int]) -> None:
        """The adapters of running and waiting requests, and the adapters per tier (slot, cpu, registered)."""
        key = (",".join(sorted(set(running))), ",".join(sorted(set(waiting))))
        if key != self.last:
            self.last = key
            for gauge in (self.info, self.info_twin):
                gauge.clear()
                gauge.labels(key[0], key[1], str(self.max_loras)).set_to_current_time()
        for tier, count in zip(("slot", "cpu", "registered"), tiers, strict=True):
            self.resident.labels(self.model, tier).set(count)

    def record_load(self, result: str, seconds: float) -> None:
        self.loads.labels(self.model, result).inc()
        if result == "ok":
            self.load_seconds.observe(seconds)

    @contextlib.contextmanager
    def record_loading(self, adapter: str) -> Iterator[None]:
        """`adapter` shown as loading while the block runs (requests sharing one load counted once)."""
        self.loads_running[adapter] += 1
        self.loading.labels(self.model, adapter).set(1)
        try:
            yield
        finally:
            self.loads_running[adapter] -= 1
            if self.loads_running[adapter] <= 0:
                del self.loads_running[adapter]
                self.loading.remove(self.model, adapter)

    def record_eviction(self, tier: str) -> None:
        self.evictions.labels(self.model, tier).inc()

    def record_finished(self, adapter: str, outcome: str, good: bool) -> None:
        name = self.label(adapter)
        self.requests.labels(self.model, name, outcome).inc()
        if good:
            self.good.labels(self.model, name).inc()
