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

`FairGate` is a service's admission when `--max-in-flight-per-replica` caps what the gateway sends it:
past the cap requests wait, and each free slot goes to the highest priority class with a waiting
request, within it to the tenant that has had the least service for its weight (start-time fair
queueing: a tenant that was idle starts level with the others, not with banked credit), so a flooding
tenant's queue never stands in front of another tenant's requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram

from goodput_gateway.errors import APIError

logger = logging.getLogger(__name__)

TENANTS_KEY = "tenants.yaml"  # the Secret's key holding the table
WINDOW = 60.0
TTFT_HEADERS = ("x-goodput-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-goodput-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
PRIORITIES = {"critical": 0, "standard": 1, "sheddable": 2}
ANONYMOUS = "anonymous"
OTHER = "other"  # the metrics label of tenants past the cardinality cap
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LIMIT_FIELDS = {"requestsPerMinute", "tokensPerMinute", "concurrency"}


@dataclass(frozen=True)
class Tenant:
    name: str
    keys: tuple[str, ...] = ()
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrency: int | None = None
    priority: str = "standard"
    weight: float = 1.0
    slo_ttft: float | None = None  # seconds: the tenant's default targets, before the service's
    slo_tpot: float | None = None


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_table(text: str, where: str) -> dict[str, Tenant]:
    """`tenants:` mapping names to {keys, requestsPerMinute, tokensPerMinute, concurrency, priority, weight}."""
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), dict):
        raise ValueError(f"{where}: expected a mapping 'tenants: {{name: {{keys: [...], ...}}}}'")
    tenants = {}
    seen: dict[str, str] = {}
    for name, spec in doc["tenants"].items():
        at = f"{where}: tenants.{name}"
        if not isinstance(spec, dict):
            raise ValueError(f"{at}: expected a mapping")
        for key in spec:
            if key not in {*LIMIT_FIELDS, "keys", "priority", "weight", "slo"}:
                raise ValueError(f"{at}.{key}: unknown field")
        keys = spec.get("keys") or []
        if not isinstance(keys, list) or not all(isinstance(k, str) and k for k in keys):
            raise ValueError(f"{at}.keys: expected a list of non-empty strings")
        for k in keys:
            if digest(k) in seen:
                raise ValueError(f"{at}.keys: a key of tenant {seen[digest(k)]} too")
            seen[digest(k)] = str(name)
        limits = {}
        for field_name in LIMIT_FIELDS:
            value = spec.get(field_name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{at}.{field_name}: expected a positive integer")
            limits[field_name] = value
        priority = spec.get("priority", "standard")
        if priority not in PRIORITIES:
            raise ValueError(f"{at}.priority: expected one of {', '.join(PRIORITIES)}")
        weight = spec.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ValueError(f"{at}.weight: expected a positive number")
        slo = spec.get("slo") or {}
        if not isinstance(slo, dict) or set(slo) - {"ttftMs", "tpotMs"}:
            raise ValueError(f"{at}.slo: expected {{ttftMs: N, tpotMs: N}}")
        for target in slo.values():
            if isinstance(target, bool) or not isinstance(target, (int, float)) or not target > 0:
                raise ValueError(f"{at}.slo: targets are positive numbers of milliseconds")
        tenants[str(name)] = Tenant(
            str(name),
            tuple(keys),
            limits["requestsPerMinute"],
            limits["tokensPerMinute"],
            limits["concurrency"],
            priority,
            float(weight),
            slo["ttftMs"] / 1000 if "ttftMs" in slo else None,
            slo["tpotMs"] / 1000 if "tpotMs" in slo else None,
        )
    return tenants


class Window:
    """A sum over the last minute."""

    def __init__(self) -> None:
        self.entries: deque[tuple[float, int]] = deque()
        self.total = 0

    def trim(self, now: float) -> None:
        while self.entries and self.entries[0][0] <= now - WINDOW:
            self.total -= self.entries.popleft()[1]

    def add(self, now: float, amount: int) -> None:
        self.entries.append((now, amount))
        self.total += amount

    def frees_below(self, now: float, limit: int) -> float:
        """Seconds until the sum falls below `limit`."""
        total = self.total
        for at, amount in self.entries:
            total -= amount
            if total < limit:
                return max(0.0, at + WINDOW - now)
        return WINDOW


@dataclass
class Spend:
    requests: Window = field(default_factory=Window)
    tokens: Window = field(default_factory=Window)
    in_flight: int = 0


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


def reset_text(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s."""
    seconds = max(1, math.ceil(seconds))
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


class Lease:
    """One admitted request's hold on its tenant: tokens charged as they flow, released once."""

    def __init__(self, tenants: Tenants, tenant: Tenant, spend: Spend) -> None:
        self.tenants, self.tenant, self.spend, self.charged, self.released = tenants, tenant, spend, 0, False
        self.label = tenants.metrics.label(tenant.name)

    def charge(self, tokens: int) -> None:
        if tokens:
            self.spend.tokens.add(time.monotonic(), tokens)
            self.charged += tokens
            if tokens > 0:
                self.tenants.metrics.tokens.labels(self.label).inc(tokens)

    def settle(self, total: int) -> None:
        """The runtime's usage is known: the charge becomes exactly it."""
        self.charge(total - self.charged)

    def release(self, status: int) -> None:
        if not self.released:
            self.released = True
            self.spend.in_flight -= 1
            self.tenants.metrics.requests.labels(self.label, str(status)).inc()


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
        lease = Lease(self, tenant, spend)
        lease.charge(estimate)
        return lease


class Meter:
    """A response as it passes through: each streamed chunk with text charges the tenant one token (the usage,
    where the response carries it, settles the charge to the runtime's count), and the times of its first
    and last tokens judge it against its SLO."""

    def __init__(self, lease: Lease | None, streamed: bool, started: float) -> None:
        self.lease, self.streamed, self.started = lease, streamed, started
        self.buffer, self.body = b"", bytearray()
        self.first: float | None = None
        self.last: float | None = None
        self.ended: float | None = None
        self.chunks = 0
        self.completion_tokens: int | None = None

    def feed(self, chunk: bytes) -> None:
        if not self.streamed:
            if len(self.body) < 4 << 20:
                self.body += chunk
            return
        self.buffer += chunk
        while b"\n\n" in self.buffer:
            block, self.buffer = self.buffer.split(b"\n\n", 1)
            if not block.startswith(b"data: {"):
                continue
            try:
                payload = json.loads(block[6:])
            except ValueError:
                continue
            self.observe(payload)

    def observe(self, payload: dict[str, Any]) -> None:
        usage = payload.get("usage")
        if isinstance(usage, dict) and "total_tokens" in usage:
            self.completion_tokens = int(usage.get("completion_tokens", 0))
            if self.lease is not None:
                self.lease.settle(int(usage["total_tokens"]))
            return
        for choice in payload.get("choices") or ():
            delta = choice.get("delta") or {}
            if choice.get("text") or delta.get("content") or delta.get("tool_calls"):
                now = time.monotonic()
                self.first = self.first or now
                self.last = now
                self.chunks += 1
                if self.lease is not None and self.streamed:
                    self.lease.charge(1)

    def finish(self) -> None:
        self.ended = time.monotonic()
        if not self.streamed and self.body:
            with contextlib.suppress(ValueError):
                payload = json.loads(bytes(self.body))
                if isinstance(payload, dict):
                    self.observe(payload)

    def good(self, ttft: float | None, tpot: float | None) -> bool:
        """Whether the response met its targets: a stream by its first token and its mean time per output
        token after it; a whole response by its total time against the two together."""
        if self.streamed:
            if self.first is None:
                return False
            if ttft is not None and self.first - self.started > ttft:
                return False
            tokens = self.completion_tokens or self.chunks
            if tpot is not None and tokens > 1 and self.last is not None:
                return (self.last - self.first) / (tokens - 1) <= tpot
            return True
        tokens = self.completion_tokens or 1
        total = (self.ended or time.monotonic()) - self.started
        return total <= (ttft or 0.0) + (tpot or 0.0) * (tokens - 1) if ttft is not None or tpot is not None else True


def header_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    for name in names:
        value = headers.get(name)
        if value is None:
            continue
        try:
            ms = float(value)
        except ValueError:
            ms = -1.0
        if not ms > 0 or not math.isfinite(ms):
            raise APIError(
                400,
                f"The header {name} must be a positive number of milliseconds, got {value[:40]!r}",
                param=name,
                code="invalid_value",
            )
        return ms / 1000
    return None


def slo_targets(
    headers: Mapping[str, str], tenant: Tenant | None, ttft: float | None, tpot: float | None
) -> tuple[float | None, float | None]:
    """A request's TTFT and TPOT targets (seconds): its headers', else its tenant's, else the service's."""
    own_ttft = header_ms(headers, TTFT_HEADERS)
    own_tpot = header_ms(headers, TPOT_HEADERS)
    if own_ttft is None and tenant is not None:
        own_ttft = tenant.slo_ttft
    if own_tpot is None and tenant is not None:
        own_tpot = tenant.slo_tpot
    return (ttft if own_ttft is None else own_ttft), (tpot if own_tpot is None else own_tpot)


class NoTurn(Exception):
    """No turn came within the wait allowed."""


class FairGate:
    """A service's in-flight cap, with waiting requests served by priority class, then by weighted fair turn."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.waiting: dict[int, dict[str, deque[asyncio.Future[None]]]] = {}
        self.served: dict[str, float] = {}  # a tenant's next start tag: service received / weight
        self.weights: dict[str, float] = {}
        self.virtual = 0.0  # the start tag of the request last given a place

    def _activate(self, name: str) -> None:
        """A tenant with nothing waiting becomes active: its next start is no earlier than the start of the
        request last given a place (start-time fair queueing), so idle time banks no credit."""
        self.served[name] = max(self.served.get(name, 0.0), self.virtual)

    def _give(self, name: str) -> None:
        self.virtual = self.served[name]
        self.served[name] += 1 / self.weights.get(name, 1.0)
        self.in_flight += 1

    @contextlib.asynccontextmanager
    async def turn(self, tenant: Tenant, limit: int, timeout: float) -> AsyncIterator[float]:
        """Held while the request runs; yields the seconds it waited. Past `timeout` waiting: NoTurn."""
        started = time.monotonic()
        self.weights[tenant.name] = tenant.weight
        if self.in_flight >= limit or self.waiting:
            prio = PRIORITIES[tenant.priority]
            queues = self.waiting.setdefault(prio, {})
            if tenant.name not in queues:
                self._activate(tenant.name)
            future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            queues.setdefault(tenant.name, deque()).append(future)
            self.dispatch(limit)
            try:
                await asyncio.wait_for(asyncio.shield(future), timeout)
            except BaseException as err:
                if future.done() and not future.cancelled():
                    self.release(limit)  # the turn came as the wait ended: give it to the next
                else:
                    future.cancel()
                    self.forget(prio, tenant.name, future)
                if isinstance(err, TimeoutError):
                    raise NoTurn from None
                raise
        else:
            self._activate(tenant.name)
            self._give(tenant.name)
        try:
            yield time.monotonic() - started
        finally:
            self.release(limit)

    def forget(self, prio: int, name: str, future: asyncio.Future[None]) -> None:
        queue = self.waiting.get(prio, {}).get(name)
        if queue is not None and future in queue:
            queue.remove(future)
            if not queue:
                del self.waiting[prio][name]
                if not self.waiting[prio]:
                    del self.waiting[prio]

    def release(self, limit: int) -> None:
        self.in_flight -= 1
        self.dispatch(limit)

    def dispatch(self, limit: int) -> None:
        while self.in_flight < limit and self.waiting:
            prio = min(self.waiting)
            queues = self.waiting[prio]
            name = min(queues, key=lambda t: self.served.get(t, 0.0))
            future = queues[name].popleft()
            if not queues[name]:
                del queues[name]
                if not queues:
                    del self.waiting[prio]
            if future.done():
                continue
            self._give(name)
            future.set_result(None)
