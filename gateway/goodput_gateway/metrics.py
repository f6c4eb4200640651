"""The gateway's Prometheus series, labelled by the InferenceService (namespace, service)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from goodput_contract import metrics as names
from goodput_contract.version import VERSION
from goodput_gateway.held_routing import DECISIONS as HELD_DECISIONS
from goodput_gateway.held_routing import LOOKUP_RESULTS
from goodput_gateway.kv_index import KvIndex

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
HOLD_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
SERVICE = ("namespace", "service")
DISAGG_PATHS = ("disaggregated", "local", "fallback")  # disagg.py's paths


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge(
            "goodput_gateway_build_info", "The gateway's version, as a label (always 1).", ["version"], registry=r
        ).labels(VERSION).set(1)
        self.requests = Counter(
            names.GATEWAY_REQUESTS, "Requests answered, by HTTP status code", [*SERVICE, "code"], registry=r
        )
        self.duration = Histogram(
            names.GATEWAY_REQUEST_DURATION,
            "Seconds from a request's arrival to the end of its response, holding included",
            SERVICE,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            names.GATEWAY_ROUTING_DECISIONS,
            "Replica choices: affinity (the prefix's own replica), overflow (it was over the "
            "load bound), least_load, random, retry (after a failure before response headers)",
            [*SERVICE, "decision"],
            registry=r,
        )
        self.retries = Counter(
            names.GATEWAY_RETRIES,
            "Requests sent on to another replica after one failed before the client got a byte: "
            "connect (refused), reset (dropped before the body's first byte), unavailable (503)",
            [*SERVICE, "reason"],
            registry=r,
        )
        self.refused = Counter(
            names.GATEWAY_REQUESTS_REFUSED,
            "Requests the gateway turned away unserved: queue_full (429, the held queue is "
            "full), hold_timeout (503, no replica became ready in time), upstream_unavailable "
            "(503, no replica answered after every attempt); demand the autoscaler counts",
            [*SERVICE, "reason"],
            registry=r,
        )
        self.waiting = Gauge(
            names.GATEWAY_REQUESTS_WAITING,
            "Requests held: the service has no ready replica (at zero, or starting), or their LoRA adapter is loading",
            SERVICE,
            registry=r,
        )
        self.hold = Histogram(
            names.GATEWAY_HOLD_DURATION,
            "Seconds a held request waited for a ready replica (a cold start, seen by a client)",
            SERVICE,
            buckets=HOLD_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge(
            names.GATEWAY_REQUESTS_IN_FLIGHT, "Requests being answered now, held ones included", SERVICE, registry=r
        )
        self.slo_requests = Counter(
            "goodput_gateway_slo_requests_total",
            "Answered requests (2xx) judged against their TTFT and TPOT targets (the request's headers, else "
            "its tenant's, else the service's): good or missed; requests with no target are not counted",
            [*SERVICE, "result"],
            registry=r,
        )
        self.streams_lost = Counter(
            "goodput_gateway_streams_lost_total",
            "Streamed responses whose replica went away after the client got its first byte: the stream "
            "ends with an error event",
            SERVICE,
            registry=r,
        )
        self.streams_resumed = Counter(
            "goodput_gateway_streams_resumed_total",
            "Streamed completions whose replica went away mid-stream and that went on on another replica "
            "(each resume counted)",
            SERVICE,
            registry=r,
        )
        self.resume_seconds = Histogram(
            "goodput_gateway_stream_resume_seconds",
            "Seconds from a stream's replica going away to the first bytes of the replica that took it up",
            SERVICE,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.held_lookups = Counter(
            "goodput_gateway_held_lookups_total",
            "Held-aware routing's lookups of a prompt's blocks in the replicas' KV index: hit (a replica "
            "within the load bound held its leading blocks), miss (none did; the ring chose), stale (no "
            "replica's index was synced; the ring chose), no_digests (the prompt's digests could not be had)",
            [*SERVICE, "result"],
            registry=r,
        )
        self.disaggregation = Counter(
            "goodput_gateway_disaggregation_total",
            "Requests of a disaggregated service by path: disaggregated (prefilled on the prefill pool, "
            "decoded with the hand-off), local (served whole on the decode replica), fallback (the prefill "
            "phase failed or timed out; served whole on the decode replica)",
            [*SERVICE, "path"],
            registry=r,
        )
        self.handoff_seconds = Histogram(
            "goodput_gateway_handoff_seconds",
            "Seconds the prefill phase of a disaggregated request took before its decode request was sent",
            SERVICE,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_index_blocks = Gauge(
            "goodput_gateway_kv_index_blocks",
            "Prefix blocks the gateway's KV index holds, over every synced replica, by tier",
            ["tier"],
            registry=r,
        )
        self.kv_index_staleness = Gauge(
            "goodput_gateway_kv_index_staleness_seconds",
            "Seconds since the least recently heard replica's KV events (0 with none)",
            registry=r,
        )
        self.last_request = Gauge(
            names.GATEWAY_LAST_REQUEST,
            "Unix time of the service's latest request at this gateway (the idle signal)",
            SERVICE,
            registry=r,
        )

    def service_seen(self, namespace: str, service: str) -> None:
        """Series a dashboard or the autoscaler reads exist at zero from the service's first appearance."""
        self.waiting.labels(namespace, service)
        self.in_flight.labels(namespace, service)
        for decision in (*names.GATEWAY_ROUTING_DECISION_KINDS, *HELD_DECISIONS):
            self.decisions.labels(namespace, service, decision)
        for result in LOOKUP_RESULTS:
            self.held_lookups.labels(namespace, service, result)
        for reason in names.GATEWAY_RETRY_REASONS:
            self.retries.labels(namespace, service, reason)
        for reason in names.GATEWAY_REFUSAL_REASONS:
            self.refused.labels(namespace, service, reason)

    def kv_index_seen(self, index: KvIndex) -> None:
        """The index's size and staleness, set after each scrape round."""
        for tier, count in index.size().items():
            self.kv_index_blocks.labels(tier).set(count)
        self.kv_index_staleness.set(max(index.staleness().values(), default=0.0))

    def disaggregated_seen(self, namespace: str, service: str) -> None:
        for path in DISAGG_PATHS:
            self.disaggregation.labels(namespace, service, path)
