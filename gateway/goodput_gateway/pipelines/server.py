"""One request through a pipeline: input steps, the generate step through the proxy, output guards.

Input guards and templates change the request body in turn; a guard that blocks ends the
request with a 400 in OpenAI's shape whose code is content_filter, naming the step and the
rule (or the classifier), never the text. The generate step is an ordinary proxied request;
its answer comes back through the output guards (relay.py): a stream chunk by chunk with a
hold-back window, a whole answer at once. The pipeline's goodput is end to end: the time to the
first text released to the client is held against the generate service's SLO (outcome.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from goodput_contract.api.pipeline_spec import BLOCK, GENERATE, GUARD, OUTPUT, TEMPLATE, Step
from goodput_gateway.auth import ServiceKeys
from goodput_gateway.discovery import Registry, Service
from goodput_gateway.errors import APIError, invalid, unavailable
from goodput_gateway.pipelines import classifier as classify
from goodput_gateway.pipelines.metrics import PipelineMetrics
from goodput_gateway.pipelines.outcome import Outcome, account, record_block, refused
from goodput_gateway.pipelines.relay import OutputGuards, relay_stream, relay_whole
from goodput_gateway.pipelines.rules import MAX_LENGTH_RULE
from goodput_gateway.pipelines.table import Entry, PipelineTable
from goodput_gateway.pipelines.template import (
    CHAT,
    COMPLETIONS,
    apply_defaults,
    apply_template,
    last_user_text,
    map_texts,
    texts,
)
from goodput_gateway.proxy import Proxy

logger = logging.getLogger(__name__)
# fields whose answer would show generated text before the output guards saw it
HIDDEN_BY_OUTPUT_GUARDS = ("logprobs", "top_logprobs", "echo")


class PipelineServer:
    def __init__(
        self,
        table: PipelineTable,
        registry: Registry,
        proxy: Proxy,
        metrics: PipelineMetrics,
        keys: ServiceKeys | None = None,
    ) -> None:
        self.table, self.registry, self.proxy, self.metrics = table, registry, proxy, metrics
        self.keys = keys or ServiceKeys(None)

    def find(self, model: str) -> Entry | None:
        found = self.table.resolve(model)
        if len(found) > 1:
            names = ", ".join(f"{e.namespace}/{e.name}" for e in found)
            raise invalid(
                f"The pipeline '{model}' exists in several namespaces; name one of {names}", "model", "ambiguous_model"
            )
        return found[0] if found else None

    def card(self, entry: Entry, created: int) -> dict[str, Any]:
        spec = entry.spec
        return {
            "id": self.table.model_id(entry),
            "object": "model",
            "created": created,
            "owned_by": "goodput",
            "root": spec.generate.service if spec else None,
            "parent": None,
            "namespace": entry.namespace,
            "pipeline": entry.name,
            "steps": spec.summary if spec else None,
            "ready": spec is not None and all(self.registry.ready((entry.namespace, s)) for s in spec.services),
        }

    async def cards(self, created: int, authorization: str | None = None) -> list[dict[str, Any]]:
        """The pipelines the caller may use: a pipeline asks for its generate service's key."""
        entries = sorted(self.table.values(), key=lambda e: (e.name, e.namespace))
        visible = []
        for entry in entries:
            try:
                await self.authorize(entry, authorization)
            except APIError:
                continue
            visible.append(self.card(entry, created))
        return visible

    async def authorize(self, entry: Entry, authorization: str | None) -> str | None:
        """The generate service's key for its runtime, once the client's key is checked against it (401
        otherwise): a pipeline is open to exactly those who may call the service it generates with."""
        spec = entry.spec
        svc = self.registry.services.get((entry.namespace, spec.generate.service)) if spec else None
        if svc is None:
            return None
        return await self.keys.upstream_authorization(svc, authorization)

    async def own_key(self, svc: Service) -> str | None:
        """The gateway's own call to a service (a classifier): with that service's key, if it asks for one."""
        keys = await self.keys.keys(svc)
        return f"Bearer {keys[0]}" if keys else None

    def service(self, entry: Entry, name: str) -> Service:
        svc = self.registry.services.get((entry.namespace, name))
        if svc is None:
            raise unavailable(
                f"The pipeline '{entry.name}' calls the InferenceService '{name}', which does not exist",
                "pipeline_not_ready",
            )
        return svc

    async def serve(
        self, request: web.Request, entry: Entry, body: dict[str, Any], slo: Mapping[str, str] | None = None
    ) -> web.StreamResponse:
        """`slo`: the request's own targets (its headers', else its tenant's), sent with the generate step."""
        started = time.monotonic()
        path = request.path
        if path not in (CHAT, COMPLETIONS):
            raise invalid(
                f"The pipeline '{entry.name}' answers {CHAT} and {COMPLETIONS} only", "model", "unsupported_endpoint"
            )
        spec = entry.spec
        if spec is None:
            raise unavailable(f"The pipeline '{entry.name}' is not valid: {entry.error}", "pipeline_invalid", 30)
        outputs = [s for s in spec.steps if s.kind == GUARD and s.stage == OUTPUT]
        if outputs:
            for name in HIDDEN_BY_OUTPUT_GUARDS:
                if body.get(name) not in (None, False):
                    raise invalid(
                        f"'{name}' is not supported by the pipeline '{entry.name}': its output guards "
                        "check the text before the client sees it",
                        name,
                        "unsupported_parameter",
                    )
            for name in ("n", "best_of"):
                if body.get(name) not in (None, 1):
                    raise invalid(
                        f"'{name}' must be 1 for the pipeline '{entry.name}', which filters one answer",
                        name,
                        "unsupported_value",
                    )
        upstream_auth = await self.authorize(entry, request.headers.get("Authorization"))
        labels = (entry.namespace, entry.name)
        self.metrics.seen(*labels)
        result = Outcome()
        try:
            current = body
            texts(path, body)  # a body whose text cannot be read is refused before any step
            for step in spec.steps:
                if step.kind == GENERATE:
                    break
                step_started = time.monotonic()
                if step.kind == TEMPLATE:
                    current = apply_template(step, path, current)
                else:
                    current = await self.input_guard(entry, step, path, current, result)
                self.metrics.step.labels(*labels, step.name, step.kind).observe(time.monotonic() - step_started)
            response = await self.generate(request, entry, spec.generate, current, outputs, result, upstream_auth, slo)
            if result.outcome == "error" and response.status == 200:
                result.outcome = "served"
            return response
        finally:
            account(self.metrics, self.registry, entry, spec.generate, body, started, result)

    async def input_guard(
        self, entry: Entry, step: Step, path: str, body: dict[str, Any], result: Outcome
    ) -> dict[str, Any]:
        rules = entry.rules[step.name]
        blocked: str | None = None
        redacted: set[str] = set()
        if rules.max_length is not None and sum(len(t) for t in texts(path, body)) > rules.max_length:
            blocked = MAX_LENGTH_RULE  # the whole prompt's length; the patterns run message by message
        elif rules.patterns:

            def check(text: str) -> str:
                nonlocal blocked
                verdict = rules.check(text, length=False)
                blocked = blocked or verdict.blocked_by
                redacted.update(verdict.redacted)
                return verdict.text

            body = map_texts(path, body, check)
        for rule in sorted(redacted):
            self.metrics.redactions.labels(entry.namespace, entry.name, rule).inc()
        if blocked:
            record_block(self.metrics, entry, step, blocked, result)
            raise refused(entry.name, step.name, f"the rule '{blocked}'")
        if step.classifier is not None:
            await self.classify(entry, step, path, body, result)
        return body

    async def classify(self, entry: Entry, step: Step, path: str, body: dict[str, Any], result: Outcome) -> None:
        guard = step.classifier
        assert guard is not None
        svc = self.service(entry, guard.service)
        payload = classify.request_body(guard, svc.served_name, last_user_text(path, body))
        authorization = await self.own_key(svc)

        async def ask() -> tuple[int, bytes]:
            async with self.proxy.open(
                "POST",
                CHAT,
                {"Content-Type": "application/json"},
                svc,
                guard.service,
                json.dumps(payload).encode(),
                payload,
                authorization,
            ) as upstream:
                return upstream.status, await upstream.read()

        try:
            status, answer = await asyncio.wait_for(ask(), guard.timeout_seconds)
        except asyncio.TimeoutError:
            raise unavailable(
                f"The classifier '{guard.service}' of the pipeline '{entry.name}' did not answer "
                f"within {guard.timeout_seconds:g} s",
                "classifier_unavailable",
            ) from None
        except aiohttp.ClientError as err:
            raise unavailable(
                f"The classifier '{guard.service}' of the pipeline '{entry.name}' failed: {err}",
                "classifier_unavailable",
            ) from None
        if status != 200:
            logger.warning(
                "Classifier %s/%s answered %d for pipeline %s", entry.namespace, guard.service, status, entry.name
            )
            raise unavailable(
                f"The classifier '{guard.service}' of the pipeline '{entry.name}' answered {status}",
                "classifier_unavailable",
            )
        decision, _answer = classify.decide(guard, json.loads(answer))
        if decision == BLOCK:
            record_block(self.metrics, entry, step, "classifier", result)
            raise refused(entry.name, step.name, f"the classifier '{guard.service}'")

    async def generate(
        self,
        request: web.Request,
        entry: Entry,
        step: Step,
        body: dict[str, Any],
        outputs: list[Step],
        result: Outcome,
        authorization: str | None = None,
        slo: Mapping[str, str] | None = None,
    ) -> web.StreamResponse:
        svc = self.service(entry, step.service)
        headers = CIMultiDict(request.headers)
        headers.update(slo or {})  # the runtime's admission judges the request by them
        payload = apply_defaults(step, {**body, "model": svc.served_name})
        sent = time.monotonic()
        guards = OutputGuards(entry, outputs, self.metrics, result)
        async with self.proxy.open(
            "POST",
            request.path_qs,
            headers,
            svc,
            step.service,
            json.dumps(payload).encode(),
            payload,
            authorization,
        ) as upstream:
            content_type = upstream.headers.get("Content-Type", "")
            if upstream.status != 200 or not content_type.startswith(("text/event-stream", "application/json")):
                data = await upstream.read()
                kept = {k: upstream.headers[k] for k in ("Retry-After",) if k in upstream.headers}  # a 429's
                return web.Response(
                    status=upstream.status, body=data, content_type=content_type.split(";")[0] or None, headers=kept
                )
            if content_type.startswith("text/event-stream"):
                return await relay_stream(request, upstream, self.table.model_id(entry), guards, sent, result)
            return await relay_whole(upstream, self.table.model_id(entry), guards, sent, result)
