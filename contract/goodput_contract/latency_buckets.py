"""Latency histogram buckets of the engines, with each SLO target added as a boundary.

The goodput runtime uses vLLM's boundaries for its TTFT and TPOT series, so dashboards and the
operator's metric reader treat ``goodput_*`` and ``vllm:*`` series alike. The runtime, which labels
its own series, and the operator, which passes the boundaries to vLLM and SGLang, read them here.
"""

from __future__ import annotations

# The SLO is put on a bucket boundary of the engines' latency histograms, so the share of requests
# within it is read exactly rather than interpolated. The rest are each engine's own defaults.
VLLM_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
VLLM_TPOT_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
SGLANG_TTFT_BUCKETS = (
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
    10.0,
    20.0,
    40.0,
    60.0,
    80.0,
    100.0,
    200.0,
    400.0,
)
SGLANG_TPOT_BUCKETS = (
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1.0,
    2.0,
    4.0,
    6.0,
    8.0,
)


def with_boundary(buckets: tuple[float, ...], *extra: float | None) -> tuple[float, ...]:
    """The buckets with each SLO value added as a boundary."""
    return tuple(sorted(set(buckets) | {e for e in extra if e is not None and e > 0}))
