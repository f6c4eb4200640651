"""A response's SLO: its TTFT and TPOT targets (its headers', else its tenant's, else the service's), and the
meter that reads the response as it passes, charges its tenant and judges it against them."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping
from typing import Any

from goodput_gateway.errors import APIError
from goodput_gateway.tenant_spend import Lease
from goodput_gateway.tenant_table import Tenant

TTFT_HEADERS = ("x-goodput-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-goodput-slo-tpot-ms", "x-llm-d-slo-tpot-ms")


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


def own_slo_headers(headers: Mapping[str, str], tenant: Tenant | None) -> dict[str, str]:
    """The request's own targets (its headers', else its tenant's) as the runtime's admission reads them:
    `x-goodput-slo-ttft-ms` and `x-goodput-slo-tpot-ms`. The service's targets are the runtime's flags."""
    ttft = header_ms(headers, TTFT_HEADERS)
    tpot = header_ms(headers, TPOT_HEADERS)
    if ttft is None and tenant is not None:
        ttft = tenant.slo_ttft
    if tpot is None and tenant is not None:
        tpot = tenant.slo_tpot
    out = {}
    for name, seconds in ((TTFT_HEADERS[0], ttft), (TPOT_HEADERS[0], tpot)):
        if seconds is not None:
            out[name] = f"{seconds * 1000:g}"
    return out


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
