"""Tenants: who is calling, what each may spend, and a fair turn for each when a service is saturated.

A tenant is a name, its API keys, and its limits: requests per minute, tokens per minute (input plus
output, charged as the tokens are produced and settled to the runtime's usage at the end), concurrent
requests; a priority class (`critical`, `standard`, `sheddable`) and a weight. The table is YAML, read
from a Secret (`--tenants-secret NAMESPACE/NAME`, its key `tenants.yaml`, read again every `ttl`
seconds) or a file (`--tenants-file`). With tenants on, every caller is one: a key no tenant holds gets
the `anonymous` tenant where the table has one, else a 401.

Past a limit a request gets a 429 with `Retry-After` and OpenAI's `x-ratelimit-*` headers. Limits are
this gateway process's: each gateway replica enforces them on its own, and a restart forgets the
minute's counts and the requests in flight.

A service whose `--max-in-flight-per-replica` caps what the gateway sends it admits by fair turns
(`fair_gate.py`); a response is metered and judged against its SLO as it passes (`slo.py`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from goodput_gateway.errors import APIError
from goodput_gateway.fair_gate import FairGate, NoTurn
from goodput_gateway.slo import Meter, slo_targets
from goodput_gateway.tenant_metrics import TenantMetrics
from goodput_gateway.tenant_spend import WINDOW, Lease, Spend, reset_text
from goodput_gateway.tenant_table import ANONYMOUS, Tenant, digest, parse_table

# The gateway's app and entry point import these from here: the fair gate and the SLO meter live beside it.
__all__ = ["ANONYMOUS", "TENANTS_KEY", "FairGate", "Lease", "Meter", "NoTurn", "Tenant", "Tenants", "slo_targets"]

logger = logging.getLogger(__name__)

TENANTS_KEY = "tenants.yaml"  # the Secret's key holding the table


class Tenants:
    def __init__(
        self,
        read: Callable[[], Awaitable[str | None]] | None,
        where: str,
        registry: CollectorRegistry,
        ttl: float = 30.0,
        metrics_cap: int = 100,
    ) -> None:
        self.read, self.where, self.ttl = read, where, ttl
        self.metrics = TenantMetrics(registry, metrics_cap)
        self.by_key: dict[str, Tenant] = {}
        self.by_name: dict[str, Tenant] = {}
        self.loaded_until = 0.0
        self.spend: dict[str, Spend] = {}
        self.lock = asyncio.Lock()

    @property
    def on(self) -> bool:
        return self.read is not None

    async def load(self) -> None:
        if self.read is None or self.loaded_until > time.monotonic():
            return
        async with self.lock:
            if self.loaded_until > time.monotonic():
                return
            try:
                text = await self.read()
                if text is None:
                    raise ValueError(f"{self.where}: not found")
                table = parse_table(text, self.where)
            except Exception as err:  # keep the last good table; none yet refuses every request
                logger.warning("Cannot read the tenants (%s): %s", self.where, err)
                self.loaded_until = time.monotonic() + min(self.ttl, 5.0)
                if not self.by_name:
                    raise APIError(
                        503,
                        "The gateway cannot read its tenants; retry shortly",
                        "service_unavailable_error",
                        None,
                        "tenants_unavailable",
                        5,
                    ) from None
                return
            self.by_name = table
            self.by_key = {digest(k): t for t in table.values() for k in t.keys}
            self.loaded_until = time.monotonic() + self.ttl

    async def identify(self, authorization: str | None) -> Tenant | None:
        """The caller's tenant (None with tenants off); a key no tenant holds gets `anonymous` or a 401."""
        if not self.on:
            return None
        await self.load()
        key = ""
        if authorization and authorization[:7].lower() == "bearer ":
            key = authorization[7:].strip()
        tenant = self.by_key.get(digest(key)) if key else None
        if tenant is None:
            tenant = self.by_name.get(ANONYMOUS)
        if tenant is None:
            message = "Incorrect API key provided" if key else "You didn't provide an API key"
            raise APIError(
                401, f"{message}: no tenant of this gateway holds it", "invalid_request_error", None, "invalid_api_key"
            )
        return tenant

    def admit(self, tenant: Tenant, estimate: int = 0) -> Lease:
        """A lease on the tenant's limits, or a 429 naming the one reached (with OpenAI's headers)."""
        spend = self.spend.setdefault(tenant.name, Spend())
        now = time.monotonic()
        spend.requests.trim(now)
        spend.tokens.trim(now)
        headers: dict[str, str] = {}
        refusal: tuple[str, str, float] | None = None
        if tenant.requests_per_minute is not None:
            limit = tenant.requests_per_minute
            reset = spend.requests.frees_below(now, limit) if spend.requests.total >= limit else 0.0
            headers |= {
                "x-ratelimit-limit-requests": str(limit),
                "x-ratelimit-remaining-requests": str(max(0, limit - spend.requests.total - 1)),
                "x-ratelimit-reset-requests": reset_text(reset or WINDOW / limit),
            }
            if spend.requests.total >= limit:
                refusal = ("requests", f"{limit} requests per minute", reset)
        if tenant.tokens_per_minute is not None:
            limit = tenant.tokens_per_minute
            reset = spend.tokens.frees_below(now, limit) if spend.tokens.total >= limit else 0.0
            headers |= {
                "x-ratelimit-limit-tokens": str(limit),
                "x-ratelimit-remaining-tokens": str(max(0, limit - spend.tokens.total)),
                "x-ratelimit-reset-tokens": reset_text(reset or 1),
            }
            if refusal is None and spend.tokens.total >= limit:
                refusal = ("tokens", f"{limit} tokens per minute", reset)
        if refusal is None and tenant.concurrency is not None and spend.in_flight >= tenant.concurrency:
            refusal = ("concurrency", f"{tenant.concurrency} concurrent requests", 1.0)
        if refusal is not None:
            kind, what, wait = refusal
            label = self.metrics.label(tenant.name)
            self.metrics.throttled.labels(label, kind).inc()
            self.metrics.requests.labels(label, "429").inc()
            raise APIError(
                429,
                f"Rate limit reached for tenant '{tenant.name}': {what}. Retry after {math.ceil(wait)} s.",
                "rate_limit_error" if kind != "tokens" else "tokens",
                None,
                "rate_limit_exceeded",
                max(1, math.ceil(wait)),
                headers,
            )
        spend.requests.add(now, 1)
        spend.in_flight += 1
        lease = Lease(self.metrics, tenant, spend)
        lease.charge(estimate)
        return lease
