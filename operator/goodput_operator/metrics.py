"""The operator's own metrics, served on its /metrics endpoint."""

from __future__ import annotations

import contextvars

from prometheus_client import Counter, Gauge, Histogram

from goodput_contract import metrics as names
from goodput_contract.version import VERSION

BUILD_INFO = Gauge("goodput_operator_build_info", "The operator's version, as a label (always 1).", ["version"])
BUILD_INFO.labels(VERSION).set(1)

RECONCILES = Counter(
    "goodput_operator_reconciles_total",
    "Reconcile passes by result (ok, invalid, error, skipped: the namespace is being deleted).",
    ["result"],
)
RECONCILE_SECONDS = Histogram(
    "goodput_operator_reconcile_duration_seconds",
    "Time one reconcile pass took.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
CHILD_WRITES = Counter(
    "goodput_operator_child_writes_total", "Children created or updated, by kind and action.", ["kind", "action"]
)
RECONCILE_ERRORS = Counter(
    "goodput_operator_reconcile_errors_total", "Reconcile passes that failed and will be retried.", ["reason"]
)
API_WRITES = Counter(
    "goodput_operator_api_writes_total",
    "Writes the operator sent to the API server, by verb and by what started the pass that sent them: change (a "
    "user's create or update), resume (start-up), side (a child, pod or config fetch), resync, other (the "
    "autoscaler, pipelines, events outside a pass).",
    ["verb", "trigger"],
)
# what started the pass now running in this task (the label above); set by reconcile.reconcile
TRIGGER: contextvars.ContextVar[str] = contextvars.ContextVar("trigger", default="other")


def count_write(verb: str) -> None:
    """The operator's `Kube.on_write`: one write, labelled with the pass that sent it."""
    API_WRITES.labels(verb=verb, trigger=TRIGGER.get()).inc()


RESYNCS = Counter("goodput_operator_resyncs_total", "Resyncs of every service finished.")
RESYNC_SECONDS = Gauge("goodput_operator_resync_duration_seconds", "Time the last resync of every service took.")
RUNTIME_FAILURES = Counter(
    "goodput_operator_runtime_failures_total",
    "Distinct pod failures reported (one Warning Event each), by reason.",
    ["reason"],
)

AUTOSCALER_DESIRED = Gauge(
    names.AUTOSCALER_DESIRED_REPLICAS, "Replicas the goodput autoscaler wants, per service.", ["namespace", "name"]
)
AUTOSCALER_ATTAINMENT = Gauge(
    names.AUTOSCALER_SLO_ATTAINMENT,
    "SLO attainment the autoscaler saw over its short window.",
    ["namespace", "name"],
)
AUTOSCALER_SCALE_EVENTS = Counter(
    names.AUTOSCALER_SCALE_EVENTS,
    "Replica changes the autoscaler wrote, by direction and cause.",
    ["direction", "reason"],
)
AUTOSCALER_METRIC_ERRORS = Counter(
    names.AUTOSCALER_METRIC_ERRORS, "Periods in which a service's metrics could not be read (held)."
)
AUTOSCALER_WRITE_ERRORS = Counter(
    names.AUTOSCALER_WRITE_ERRORS,
    "Autoscaler writes the API server refused or did not answer, by target: replicas (the scale subresource) "
    "or status.",
    ["target"],
)
AUTOSCALER_REPLICAS = Gauge(
    names.AUTOSCALER_REPLICAS,
    "Replica counts the autoscaler works with: current, ready, starting, min, max.",
    ["namespace", "name", "kind"],
)
AUTOSCALER_CAPACITY = Gauge(
    names.AUTOSCALER_CAPACITY_PER_REPLICA,
    "Requests per second one replica serves within the SLO, as learnt.",
    ["namespace", "name"],
)
AUTOSCALER_ARRIVAL = Gauge(
    names.AUTOSCALER_ARRIVAL_RATE,
    "Arrival rate (requests/s) as the autoscaler sees it: observed over the short window, smoothed (Holt's "
    "level), and forecast (the rate planned for when a replica asked for now would be ready).",
    ["namespace", "name", "kind"],
)
AUTOSCALER_DISPERSION = Gauge(
    names.AUTOSCALER_DISPERSION,
    "How bursty a service's traffic is: the index of dispersion of arrival counts per control period "
    "(arrivals; 1 for Poisson), the peakedness the law's headroom used (peakedness; the index less its noise, "
    "at least 1), and request sizes' squared coefficient of variation (sizes).",
    ["namespace", "name", "kind"],
)
AUTOSCALER_STARTUP = Gauge(
    names.AUTOSCALER_STARTUP_SECONDS,
    "Seconds from a replica asked for to it ready, averaged: the forecast horizon.",
    ["namespace", "name"],
)
