"""The tenants' metrics: requests, tokens, throttles, good requests and queueing, labelled by tenant up to a cap."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

OTHER = "other"  # the metrics label of tenants past the cardinality cap
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry, cap: int) -> None:
        self.cap, self.named = cap, set[str]()
        r = registry
        self.requests = Counter(
            "goodput_gateway_tenant_requests_total",
            "Requests by tenant and HTTP status",
            ["tenant", "code"],
            registry=r,
        )
        self.tokens = Counter(
            "goodput_gateway_tenant_tokens_total",
            "Tokens charged to the tenant (input and output)",
            ["tenant"],
            registry=r,
        )
        self.throttled = Counter(
            "goodput_gateway_tenant_throttled_total",
            "Requests refused with a 429 at a tenant's limit: requests, tokens, concurrency",
            ["tenant", "limit"],
            registry=r,
        )
        self.good = Counter(
            "goodput_gateway_tenant_good_requests_total",
            "The tenant's answered requests that met their TTFT and TPOT targets (the request's, else the "
            "tenant's, else the service's)",
            ["tenant"],
            registry=r,
        )
        self.queued = Histogram(
            "goodput_gateway_tenant_queue_seconds",
            "Seconds a tenant's request waited for a turn at a saturated service",
            ["tenant"],
            buckets=QUEUE_BUCKETS,
            registry=r,
        )

    def label(self, tenant: str) -> str:
        """The tenant's own name for the first `cap` tenants seen, `other` past them."""
        if tenant in self.named:
            return tenant
        if len(self.named) < self.cap:
            self.named.add(tenant)
            return tenant
        return OTHER
