"""Runs batches: validates new ones, claims their lines, sends each to a replica of the model's
service at batch priority, records the result, and writes the output files at the end.

A line goes to the service's ready replicas only: batch work never wakes a service or adds a
replica through the hold queue. The pending lines are exported per service, and the autoscaler
keeps `spec.batch.maxReplicas` replicas while there are any (none when it is 0, the default).
How many lines a service has in flight is the AIMD limit of control.py, driven by its replicas'
online signals.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client import Counter as MetricCounter

from goodput_contract import metrics as names
from goodput_gateway.batch.control import AIMD, ReplicaSignals, parse_signals
from goodput_gateway.batch.store import Claimed, Store
from goodput_gateway.batch.validate import parse_input
from goodput_gateway.discovery import Key, Registry, Service
from goodput_gateway.errors import APIError
from goodput_gateway.proxy import Proxy, served_model

logger = logging.getLogger(__name__)

PRIORITY_HEADER = "X-Goodput-Priority"
BATCH_PRIORITY = "batch"
RETRY_STATUS = (429, 502, 503, 504)
RETRYABLE = (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError)


@dataclass(frozen=True)
class DispatchSettings:
    lease_seconds: float = 30.0  # a claimed line returns to the pool this long after its gateway stops renewing
    poll_seconds: float = 0.5
    control_seconds: float = 1.0
    max_attempts: int = 5
    request_timeout: float = 600.0
    target_attainment: float = 0.99
    per_replica_cap: int = 32


class BatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lines = MetricCounter(
            names.BATCH_REQUESTS.removesuffix("_total"),
            "Batch lines finished by this gateway (completed: a 2xx answer; failed: "
            "another answer or none after every attempt), and attempts given back to retry",
            ["state"],
            registry=registry,
        )
        for state in ("completed", "failed", "retried"):
            self.lines.labels(state)
        self.pending = Gauge(
            names.BATCH_LINES_PENDING, "Lines of running batches not yet done (all gateways)", registry=registry
        )
        self.service_pending = Gauge(
            names.BATCH_SERVICE_LINES_PENDING,
            "Lines of running batches not yet done, by the service their model resolves to "
            "(all gateways): what spec.batch.maxReplicas scales on",
            ["namespace", "service"],
            registry=registry,
        )
        self.limit = Gauge(
            names.BATCH_CONCURRENCY,
            "Batch lines a service may have in flight (the AIMD limit)",
            ["namespace", "service"],
            registry=registry,
        )


class Dispatcher:
    def __init__(
        self, store: Store, registry: Registry, proxy: Proxy, settings: DispatchSettings, metrics: BatchMetrics
    ) -> None:
        self.store, self.registry, self.proxy, self.settings, self.metrics = store, registry, proxy, settings, metrics
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.wake = asyncio.Event()
        self.controls: dict[Key, AIMD] = {}
        self.in_flight: Counter[Key] = Counter()
        self.tasks: set[asyncio.Task[None]] = set()
        self.reported: set[Key] = set()  # services with pending lines at the last count

    @property
    def session(self) -> aiohttp.ClientSession:
        assert isinstance(self.proxy.session, aiohttp.ClientSession)
        return self.proxy.session

    def woken(self) -> None:
        self.wake.set()

    async def run_forever(self) -> None:
        loops = [
            asyncio.create_task(self._every(self.settings.lease_seconds / 3, self._renew)),
            asyncio.create_task(self._every(self.settings.control_seconds, self._control)),
        ]
        try:
            while True:
                try:
                    await self._round()
                except Exception:
                    logger.exception("Batch dispatch round failed; trying again")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), self.settings.poll_seconds)
                self.wake.clear()
        finally:
            for task in loops:
                task.cancel()

    async def stop(self) -> None:
        """Cancel lines in flight and give them back, so a restart (or another gateway) takes them at once."""
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _every(self, period: float, work: Any) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await work()
            except Exception:
                logger.exception("Batch background work failed")

    async def _renew(self) -> None:
        if self.tasks:
            await self.store.renew(self.owner, self.settings.lease_seconds)

    async def _round(self) -> None:
        if not self.registry.synced:
            return
        for batch_id, input_file_id, endpoint in await self.store.take_validating(self.settings.lease_seconds):
            await self._validate(batch_id, input_file_id, endpoint)
        for batch_id, final in await self.store.to_finalize():
            if await self.store.finalize(batch_id, final, self.settings.lease_seconds):
                logger.info("Batch %s %s", batch_id, final)
        for batch_id, model, endpoint, _expires in await self.store.running():
            svc = self._service(model)
            if svc is None:
                continue
            key = (svc.namespace, svc.name)
            control = self._control_of(svc)
            room = int(control.limit) - self.in_flight[key]
            if room <= 0 or not self.registry.ready(key):
                continue
            for line in await self.store.claim(batch_id, self.owner, room, self.settings.lease_seconds):
                self.in_flight[key] += 1
                task = asyncio.create_task(self._send(line, svc, endpoint))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
        await self._report_pending()

    async def _report_pending(self) -> None:
        by_model = await self.store.pending_lines()
        self.metrics.pending.set(sum(by_model.values()))
        by_service: Counter[Key] = Counter()
        for model, count in by_model.items():
            svc = self._service(model)
            if svc is not None:
                by_service[(svc.namespace, svc.name)] += count
        for key in self.reported - set(by_service):  # drained: back to zero
            self.metrics.service_pending.labels(*key).set(0)
        for key, count in by_service.items():
            self.metrics.service_pending.labels(*key).set(count)
        self.reported = set(by_service)

    def _service(self, model: str) -> Service | None:
        found = self.registry.resolve(model)
        return found[0] if len(found) == 1 else None

    def _control_of(self, svc: Service) -> AIMD:
        key = (svc.namespace, svc.name)
        control = self.controls.get(key)
        if control is None:
            control = self.controls[key] = AIMD(
                target_attainment=self.settings.target_attainment, per_replica_cap=self.settings.per_replica_cap
            )
            self.metrics.limit.labels(*key).set(control.limit)
        return control

    async def _validate(self, batch_id: str, input_file_id: str, endpoint: str) -> None:
        data = await self.store.file_content(input_file_id)
        errors: list[dict[str, Any]] = []
        if data is None:
            errors.append(
                {
                    "code": "file_not_found",
                    "message": f"The input file {input_file_id} was deleted",
                    "param": "input_file_id",
                    "line": None,
                }
            )
        else:
            try:
                parsed = parse_input(data)
            except APIError as err:
                errors.append({"code": err.code, "message": err.message, "param": "input_file_id", "line": None})
            else:
                if parsed.url != endpoint:
                    errors.append(
                        {
                            "code": "invalid_url",
                            "message": f"The lines' url {parsed.url} is not the batch's endpoint {endpoint}",
                            "param": "url",
                            "line": 1,
                        }
                    )
                elif len(self.registry.resolve(parsed.model)) != 1:
                    errors.append(
                        {
                            "code": "model_not_found",
                            "message": f"The model '{parsed.model}' is not "
                            "served here (or is served in several namespaces; name it namespace/model)",
                            "param": "body.model",
                            "line": 1,
                        }
                    )
                elif await self.store.start_batch(batch_id, parsed.model, parsed.lines):
                    logger.info("Batch %s in progress: %d lines for %s", batch_id, len(parsed.lines), parsed.model)
                    return
                else:
                    return
        await self.store.fail_batch(batch_id, errors)
        logger.info("Batch %s failed validation: %s", batch_id, errors[0]["message"])

    async def _send(self, line: Claimed, svc: Service, endpoint: str) -> None:
        key = (svc.namespace, svc.name)
        try:
            await self._attempt(line, svc, endpoint)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.store.release(line, self.owner))
            raise
        except Exception:
            logger.exception("Batch line %s/%d failed in the gateway", line.batch_id, line.idx)
            await self._retry_or_fail(line, {"code": "gateway_error", "message": "The gateway failed this line"})
        finally:
            self.in_flight[key] -= 1
            self.wake.set()

    async def _attempt(self, line: Claimed, svc: Service, endpoint: str) -> None:
        key = (svc.namespace, svc.name)
        ready = self.registry.ready(key)
        if not ready:
            await self.store.release(line, self.owner)
            return
        body = json.loads(line.body)
        body["model"] = served_model(self.registry, svc, str(body.get("model", "")))
        url = self.proxy.pick(svc, ready, set(), 0).replica
        outstanding = self.proxy.outstanding
        outstanding[url] += 1
        try:
            async with self.session.post(
                url + endpoint,
                json=body,
                headers={PRIORITY_HEADER: BATCH_PRIORITY},
                timeout=aiohttp.ClientTimeout(total=self.settings.request_timeout),
            ) as r:
                raw = await r.read()
                status = r.status
                request_id = r.headers.get("x-request-id", "")
        except RETRYABLE as err:
            await self._retry_or_fail(line, {"code": "upstream_unavailable", "message": f"{url}: {err!r}"})
            return
        finally:
            outstanding[url] -= 1
        try:
            response: Any = json.loads(raw)
        except ValueError:
            response = {"error": {"message": raw.decode(errors="replace")[:2000], "type": "upstream_error"}}
        if status in RETRY_STATUS and line.attempts < self.settings.max_attempts:
            await self._retry_or_fail(line, None)
            return
        if not request_id and isinstance(response, dict):
            request_id = str(response.get("id", ""))
        if await self.store.finish_line(line, self.owner, status, request_id, response, None):
            self.metrics.lines.labels("completed" if 200 <= status < 300 else "failed").inc()

    async def _retry_or_fail(self, line: Claimed, error: dict[str, str] | None) -> None:
        if line.attempts < self.settings.max_attempts:
            await asyncio.sleep(min(5.0, 0.2 * 2**line.attempts))
            await self.store.release(line, self.owner)
            self.metrics.lines.labels("retried").inc()
            return
        error = error or {"code": "upstream_unavailable", "message": "No replica took the request"}
        if await self.store.finish_line(line, self.owner, None, None, None, error):
            self.metrics.lines.labels("failed").inc()

    async def _control(self) -> None:
        for key, control in list(self.controls.items()):
            ready = self.registry.ready(key)
            signals = await asyncio.gather(*(self._signals(u) for u in ready))
            current = {u: s for u, s in zip(ready, signals, strict=True) if s is not None}
            if current:
                self.metrics.limit.labels(*key).set(control.update(current, self.in_flight[key]))

    async def _signals(self, url: str) -> ReplicaSignals | None:
        try:
            async with self.session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=2)) as r:
                if r.status == 200:
                    return parse_signals(await r.text())
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            pass
        return None
