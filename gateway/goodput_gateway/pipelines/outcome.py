"""What one pipeline request did, and how it counts: its outcome, a guard's block, and its goodput end to
end (the time to the first text released to the client held against the generate service's SLO)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from goodput_contract.api.pipeline_spec import GENERATE, GUARD, INPUT, Step
from goodput_gateway.discovery import Registry
from goodput_gateway.errors import APIError
from goodput_gateway.pipelines.metrics import PipelineMetrics
from goodput_gateway.pipelines.table import Entry

logger = logging.getLogger(__name__)
CONTENT_FILTER = "content_filter"


def refused(pipeline: str, step: str, what: str) -> APIError:
    return APIError(
        400,
        f"The pipeline '{pipeline}' refused this request: {what} in step '{step}' matched",
        "invalid_request_error",
        None,
        CONTENT_FILTER,
    )


@dataclass
class Outcome:
    """What one request did, for its metrics."""

    outcome: str = "error"
    first_text: float | None = None  # monotonic time the first generated text went to the client
    tokens: int = 0
    generate_ttft: float | None = None
    output_seconds: dict[str, float] = field(default_factory=dict)  # output guard -> time spent filtering


def record_block(metrics: PipelineMetrics, entry: Entry, step: Step, rule: str, result: Outcome) -> None:
    result.outcome = "refused" if step.stage == INPUT else "filtered"
    metrics.blocks.labels(entry.namespace, entry.name, rule).inc()
    logger.info(
        "Pipeline %s/%s: step %s blocked a %s by rule %s",
        entry.namespace,
        entry.name,
        step.name,
        "request" if step.stage == INPUT else "stream",
        rule,
    )


def account(
    metrics: PipelineMetrics,
    registry: Registry,
    entry: Entry,
    generate: Step,
    body: dict[str, Any],
    started: float,
    result: Outcome,
) -> None:
    labels = (entry.namespace, entry.name)
    metrics.requests.labels(*labels, result.outcome).inc()
    if result.generate_ttft is not None:
        metrics.step.labels(*labels, generate.name, GENERATE).observe(result.generate_ttft)
    for name, seconds in result.output_seconds.items():
        metrics.step.labels(*labels, name, GUARD).observe(seconds)
    if result.first_text is None or result.outcome not in ("served", "filtered"):
        return
    ttft = result.first_text - started
    metrics.ttft.labels(*labels).observe(ttft)
    svc = registry.services.get((entry.namespace, generate.service))
    if svc is None:
        return
    elapsed = time.monotonic() - started
    tokens = max(1, result.tokens)
    if body.get("stream") is True:
        tpot = (elapsed - ttft) / (tokens - 1) if tokens > 1 else 0.0
        good = (svc.ttft_slo is None or ttft <= svc.ttft_slo) and (svc.tpot_slo is None or tpot <= svc.tpot_slo)
    else:  # a whole answer: its latency against the budget of its length
        good = elapsed <= (svc.ttft_slo or float("inf")) + (svc.tpot_slo or 0.0) * (tokens - 1)
    if good:
        metrics.good.labels(*labels).inc()
