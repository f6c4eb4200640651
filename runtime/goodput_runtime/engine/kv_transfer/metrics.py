"""The hand-off's metrics, in the runtime's registry (label ``model`` like every runtime metric).

- ``goodput_kv_transfers_total{role,outcome}``: hand-offs; role ``decode`` counts pulls made (outcome
  ``success`` or ``failure``), role ``prefill`` pulls served; role ``peer`` peer pulls made (a failure
  is a fallback to recomputing), role ``holder`` peer pulls served from the prefix cache;
- ``goodput_kv_transfer_bytes_total{role}``: block bytes received (decode, peer) and sent (prefill, holder);
- ``goodput_kv_transfer_blocks_total{role}``: the same in blocks;
- ``goodput_kv_transfer_seconds{role}``: a successful pull, from its start to its blocks landing: role
  ``decode`` a disaggregated hand-off, ``peer`` a peer pull;
- ``goodput_kv_transfer_failures_total{reason}``: failed hand-offs by reason (base.REASONS);
- ``goodput_kv_lease_blocks``: blocks a prefill side holds under lease;
- ``goodput_kv_lease_expiries_total``: leases that ran out before the decode side released them.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class KVTransferMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        self.transfers = Counter(
            "goodput_kv_transfers", "KV hand-offs by role and outcome.", ["model", "role", "outcome"], registry=registry
        )
        self.bytes = Counter(
            "goodput_kv_transfer_bytes",
            "KV block bytes moved by hand-offs, by role.",
            ["model", "role"],
            registry=registry,
        )
        self.blocks = Counter(
            "goodput_kv_transfer_blocks",
            "KV blocks moved by hand-offs and peer pulls, by role.",
            ["model", "role"],
            registry=registry,
        )
        self.seconds = Histogram(
            "goodput_kv_transfer_seconds",
            "A pull of KV blocks, from its start to its blocks landing in the cache: role decode a "
            "disaggregated hand-off, role peer a prefix pulled from a peer.",
            ["model", "role"],
            buckets=SECONDS_BUCKETS,
            registry=registry,
        )
        self.failures = Counter(
            "goodput_kv_transfer_failures", "Failed KV hand-offs by reason.", ["model", "reason"], registry=registry
        )
        self.lease_blocks = Gauge(
            "goodput_kv_lease_blocks", "KV blocks held under lease for decode runtimes.", ["model"], registry=registry
        ).labels(model)
        self.expiries = Counter(
            "goodput_kv_lease_expiries",
            "Leases that ran out before a decode runtime released them.",
            ["model"],
            registry=registry,
        ).labels(model)

    def transfer(self, role: str, outcome: str, num_bytes: int = 0, num_blocks: int = 0) -> None:
        self.transfers.labels(self.model, role, outcome).inc()
        if num_bytes:
            self.bytes.labels(self.model, role).inc(num_bytes)
        if num_blocks:
            self.blocks.labels(self.model, role).inc(num_blocks)

    def pulled(self, role: str, seconds: float) -> None:
        self.seconds.labels(self.model, role).observe(seconds)

    def failure(self, reason: str) -> None:
        self.failures.labels(self.model, reason).inc()
