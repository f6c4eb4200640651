"""The pipeline series, in the gateway's registry beside its own (labels namespace, pipeline)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from goodput_contract import metrics as names

PIPELINE = ("namespace", "pipeline")
# from well under a millisecond (rules) to a model's answer
STEP_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class PipelineMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            names.PIPELINE_REQUESTS,
            "Pipeline requests by outcome: served, refused (an input "
            "guard), filtered (an output guard ended the stream), error",
            [*PIPELINE, "outcome"],
            registry=r,
        )
        self.good = Counter(
            names.PIPELINE_REQUESTS_GOOD,
            "Served or filtered pipeline requests that met the generate "
            "service's TTFT and TPOT targets end to end (guards' time included)",
            PIPELINE,
            registry=r,
        )
        self.ttft = Histogram(
            names.PIPELINE_TTFT,
            "Seconds from a request's arrival to the first generated text "
            "released to the client (every step before it, and the hold-back, included)",
            PIPELINE,
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step = Histogram(
            names.PIPELINE_STEP_DURATION,
            "Seconds per step: guards and templates their own work, "
            "generate its time to first token, an output guard its filtering over the whole stream",
            [*PIPELINE, "step", "kind"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.blocks = Counter(
            names.GUARD_BLOCKS,
            "Requests refused or streams ended by a guard, by rule (a rule's "
            "name, pii-<type>, max-length or classifier)",
            [*PIPELINE, "rule"],
            registry=r,
        )
        self.redactions = Counter(
            names.GUARD_REDACTIONS, "Texts in which a guard rule redacted matches", [*PIPELINE, "rule"], registry=r
        )

    def seen(self, namespace: str, pipeline: str) -> None:
        """Series a dashboard reads exist at zero from the pipeline's first request."""
        for outcome in names.PIPELINE_OUTCOMES:
            self.requests.labels(namespace, pipeline, outcome)
        self.good.labels(namespace, pipeline)
