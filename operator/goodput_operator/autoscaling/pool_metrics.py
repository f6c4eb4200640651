"""The autoscaler's series for a disaggregated service's pools (pool_loop.py), labelled by pool."""

from __future__ import annotations

from prometheus_client import Gauge

POOL_REPLICAS = Gauge(
    "goodput_autoscaler_pool_replicas",
    "A disaggregated service's replicas per pool: desired (the autoscaler's decision) and ready.",
    ["namespace", "name", "pool", "kind"],
)
POOL_ATTAINMENT = Gauge(
    "goodput_autoscaler_pool_attainment",
    "Share of a pool's recent requests within its own target: TTFT net of the hand-off (prefill), TPOT (decode).",
    ["namespace", "name", "pool"],
)
POOL_CAPACITY = Gauge(
    "goodput_autoscaler_pool_capacity_tokens_per_second",
    "Tokens per second one replica of the pool serves within its target, as learnt: prompt (prefill), output (decode).",
    ["namespace", "name", "pool"],
)
POOL_DEMAND = Gauge(
    "goodput_autoscaler_pool_demand_tokens_per_second",
    "Tokens per second the pool is asked for: prompt tokens (prefill), output tokens (decode).",
    ["namespace", "name", "pool"],
)
ALL = (POOL_REPLICAS, POOL_ATTAINMENT, POOL_CAPACITY, POOL_DEMAND)


def forget(namespace: str, name: str) -> None:
    """A service gone from goodput mode, or no longer disaggregated, leaves no stale series."""
    for gauge in ALL:
        for labels in [key for key in list(gauge._metrics) if key[:2] == (namespace, name)]:
            gauge.remove(*labels)
