"""A tenant's spend against its limits: requests and tokens summed over a sliding minute, requests in flight,
and each admitted request's lease on it."""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

from goodput_gateway.tenant_metrics import TenantMetrics
from goodput_gateway.tenant_table import Tenant

WINDOW = 60.0


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


def reset_text(seconds: float) -> str:
    """OpenAI's reset format: 1s, 6m0s."""
    seconds = max(1, math.ceil(seconds))
    return f"{seconds // 60}m{seconds % 60}s" if seconds >= 60 else f"{seconds}s"


class Lease:
    """One admitted request's hold on its tenant: tokens charged as they flow, released once."""

    def __init__(self, metrics: TenantMetrics, tenant: Tenant, spend: Spend) -> None:
        self.metrics, self.tenant, self.spend, self.charged, self.released = metrics, tenant, spend, 0, False
        self.label = metrics.label(tenant.name)

    def charge(self, tokens: int) -> None:
        if tokens:
            self.spend.tokens.add(time.monotonic(), tokens)
            self.charged += tokens
            if tokens > 0:
                self.metrics.tokens.labels(self.label).inc(tokens)

    def settle(self, total: int) -> None:
        """The runtime's usage is known: the charge becomes exactly it."""
        self.charge(total - self.charged)

    def release(self, status: int) -> None:
        if not self.released:
            self.released = True
            self.spend.in_flight -= 1
            self.metrics.requests.labels(self.label, str(status)).inc()
