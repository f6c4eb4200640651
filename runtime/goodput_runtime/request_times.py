"""The timestamps of one request: written by the engine, read by the metrics. Imports nothing
of the runtime, so both can depend on it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestTimes:
    """Monotonic timestamps of one request, in seconds; the source of its latency metrics."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    outcome: str = "success"  # success | abort | error
    priority: int = 0  # the request's; above 0 is batch work (metrics split by it)
    lora: str | None = None  # the LoRA adapter it named (metrics count requests per adapter)
    slo_ttft: float | None = None  # its own targets, seconds, its goodput is judged by; None: the server's
    slo_tpot: float | None = None
