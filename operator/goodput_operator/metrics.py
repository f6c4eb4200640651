"""The operator's own metrics, served on its /metrics endpoint."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

RECONCILES = Counter(
    "goodput_operator_reconciles_total", "Reconcile passes by result (ok, invalid, error).", ["result"]
)
RECONCILE_SECONDS = Histogram(
    "goodput_operator_reconcile_duration_seconds", "Time one reconcile pass took.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)
CHILD_WRITES = Counter(
    "goodput_operator_child_writes_total", "Children created or updated, by kind and action.", ["kind", "action"]
)
RECONCILE_ERRORS = Counter(
    "goodput_operator_reconcile_errors_total", "Reconcile passes that failed and will be retried.", ["reason"]
)
