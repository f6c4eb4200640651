"""Two-phase routing for a disaggregated service: prefill on the prefill pool, decode with the hand-off.

A service with ``spec.disaggregation`` has two pools: its own Service's replicas decode (and serve
whole requests), the ``<name>-prefill`` Service's replicas prefill. The proxy picks the decode
replica first, as for any request (held-aware, within the load bound); then ``TwoPhase.prepare``
decides what that replica is sent:

- ``local``: the request whole, when the prompt's uncached part on that replica (its tokens less
  the leading blocks the replica holds, from the KV index) is under the threshold, or the prefill
  pool has no ready replica, or its least loaded one has more than ``max_prefill_queue`` requests
  (this gateway's outstanding plus its scraped queue);
- ``disaggregated``: first the prefill request to the least loaded prefill replica (the client's
  body with ``"kv_transfer_params": {"do_remote_decode": true}``, ``max_tokens`` 1, not streamed,
  ``n`` 1), then the client's own request with the ``kv_transfer_params`` the prefill answered
  (vLLM's NIXL connector's names, so a vLLM fleet is driven the same way);
- ``fallback``: the request whole, when the prefill phase failed (a refused connection, a non-200
  answer, no ``kv_transfer_params``) or passed ``prefill_timeout``.

The prefill phase's time is the hand-off's added time (``goodput_gateway_handoff_seconds``). A
client that goes away during it cancels it (the prefill runtime aborts the request, and a lease it
granted expires); during the decode phase the proxy's usual close aborts the decode request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from goodput_gateway import routing
from goodput_gateway.discovery import Registry, Service
from goodput_gateway.held_routing import HeldRouter, cached_tokens
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.prompt_digests import PromptBlocks

logger = logging.getLogger(__name__)

DISAGGREGATED, LOCAL, FALLBACK = "disaggregated", "local", "fallback"
PATHS = ("/v1/completions", "/v1/chat/completions")
FIELD = "kv_transfer_params"
DROPPED_IN_PREFILL = ("stream_options", "max_completion_tokens", "min_tokens", "best_of")


@dataclass(frozen=True)
class DisaggSettings:
    prefill_timeout: float = 30.0  # seconds the prefill phase may take before the decode replica serves whole
    max_prefill_queue: int = 8  # requests on the least loaded prefill replica past which it serves whole


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill phase's request: the client's prompt, one token, not streamed, one choice."""
    out = {k: v for k, v in body.items() if k not in DROPPED_IN_PREFILL}
    out.update({FIELD: {"do_remote_decode": True}, "max_tokens": 1, "stream": False, "n": 1})
    return out


def decode_body(body: Mapping[str, Any], params: Mapping[str, Any]) -> dict[str, Any]:
    """The decode phase's request: the client's own, with the prefill's hand-off."""
    return {**body, FIELD: dict(params)}


def uncached(blocks: PromptBlocks | None, held: Mapping[str, set[str]] | None, body: Mapping[str, Any]) -> int:
    """The prompt's tokens the decode replica would compute: its tokens less the leading blocks it holds.
    Without digests, the prompt's characters / 4 (nothing counted as held)."""
    if blocks is None:
        return len(routing.prompt_text(body)) // 4
    return max(0, blocks.num_tokens - cached_tokens(blocks, held))


class Cooldown(Protocol):
    @property
    def cooldown(self) -> float: ...


class Replicas(Protocol):
    """What the two phases use of the proxy (proxy.Proxy): its replicas' loads, cooling and session."""

    metrics: GatewayMetrics
    registry: Registry
    held: HeldRouter | None
    outstanding: Counter[str]
    cooling: dict[str, float]
    session: aiohttp.ClientSession

    @property
    def settings(self) -> Cooldown: ...

    def loads(self, replicas: tuple[str, ...]) -> dict[str, float]: ...


class TwoPhase:
    def __init__(self, proxy: Replicas, settings: DisaggSettings) -> None:
        self.proxy, self.settings = proxy, settings

    def count(self, svc: Service, path: str, started: float | None = None) -> None:
        metrics = self.proxy.metrics
        metrics.disaggregated_seen(svc.namespace, svc.name)
        metrics.disaggregation.labels(svc.namespace, svc.name, path).inc()
        if started is not None:
            metrics.handoff_seconds.labels(svc.namespace, svc.name).observe(time.monotonic() - started)

    def prefill_replica(self, svc: Service) -> str | None:
        """The least loaded ready, not cooling prefill replica within the queue bound; None: serve whole."""
        now = time.monotonic()
        ready = [r for r in self.proxy.registry.ready(svc.prefill_key) if self.proxy.cooling.get(r, 0.0) <= now]
        if not ready:
            return None
        loads = self.proxy.loads(tuple(ready))
        best = min(ready, key=lambda r: loads[r])
        return best if routing.requests_of(loads[best]) < self.settings.max_prefill_queue else None

    async def prepare(
        self,
        svc: Service,
        decode: str,
        path: str,
        raw: bytes,
        body: Mapping[str, Any],
        headers: Mapping[str, str],
        blocks: PromptBlocks | None,
    ) -> bytes:
        """What the decode replica `decode` is sent for this request (see the module's doc)."""
        split = svc.disaggregation
        if split is None or path not in PATHS or FIELD in body:
            return raw
        held = self.proxy.held.index.held(decode) if self.proxy.held is not None else None
        prefill = self.prefill_replica(svc)
        if prefill is None or uncached(blocks, held, body) < split.threshold_tokens:
            self.count(svc, LOCAL)
            return raw
        started = time.monotonic()
        sent = json.loads(raw)
        params = await self.prefill(prefill, path, sent, headers)
        if params is None:
            self.count(svc, FALLBACK)
            return raw
        self.count(svc, DISAGGREGATED, started)
        return json.dumps(decode_body(sent, params)).encode()

    async def prefill(
        self, replica: str, path: str, body: Mapping[str, Any], headers: Mapping[str, str]
    ) -> dict[str, Any] | None:
        """The prefill phase on `replica`: its ``kv_transfer_params``, or None on any failure (logged)."""
        proxy = self.proxy
        proxy.outstanding[replica] += 1
        timeout = aiohttp.ClientTimeout(total=self.settings.prefill_timeout)
        try:
            async with proxy.session.post(
                replica + path, data=json.dumps(prefill_body(body)).encode(), headers=headers, timeout=timeout
            ) as response:
                if response.status != 200:
                    failure = f"{response.status}: {(await response.text())[:300]}"
                else:
                    answer = await response.json(content_type=None)
                    params = answer.get(FIELD) if isinstance(answer, dict) else None
                    if isinstance(params, dict) and params.get("do_remote_prefill"):
                        return params
                    failure = "the answer carries no kv_transfer_params"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as err:
            failure = repr(err)
            if isinstance(err, (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError)):
                proxy.cooling[replica] = time.monotonic() + proxy.settings.cooldown
        finally:
            proxy.outstanding[replica] -= 1
        logger.info("Prefill on %s failed, the decode replica serves whole: %s", replica, failure)
        return None
