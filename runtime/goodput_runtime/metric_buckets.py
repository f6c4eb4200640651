"""Histogram boundaries of the runtime's latency series.

TTFT and TPOT follow vLLM's (``goodput_contract.latency_buckets``), so dashboards and the
operator's metric reader treat ``goodput_*`` and ``vllm:*`` series alike; ``with_boundary`` adds a
boundary exactly at an SLO so attainment can be read straight off the buckets.
"""

from __future__ import annotations

from goodput_contract.latency_buckets import VLLM_TPOT_BUCKETS, VLLM_TTFT_BUCKETS, with_boundary

TTFT_BUCKETS = VLLM_TTFT_BUCKETS
TPOT_BUCKETS = VLLM_TPOT_BUCKETS
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


__all__ = [
    "GRAMMAR_COMPILE_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "TPOT_BUCKETS",
    "TTFT_BUCKETS",
    "with_boundary",
]
