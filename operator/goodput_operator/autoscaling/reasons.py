"""The words of a scaling decision's reason: the SLO miss, the arrival rate and its trend, the arrivals'
dispersion."""

from __future__ import annotations

import math

from goodput_operator.autoscaling.state import Memory, Policy, Signals


def slo_miss_text(policy: Policy, s: Signals) -> str:
    parts = [f"attainment {s.attainment:.2f} < {policy.attainment_target:.2f} target"]
    if s.ttft_p90 is not None and policy.ttft_target is not None and s.ttft_p90 > policy.ttft_target:
        parts.append(f"p90 TTFT {s.ttft_p90:.2f} s > {policy.ttft_target:.2f} s target")
    if s.tpot_p90 is not None and policy.tpot_target is not None and s.tpot_p90 > policy.tpot_target:
        parts.append(f"p90 TPOT {s.tpot_p90 * 1000:.0f} ms > {policy.tpot_target * 1000:.0f} ms target")
    parts.append(f"{s.waiting} requests queued")
    return ", ".join(parts)


def dispersion_text(s: Signals, peakedness: float) -> str:
    """The arrivals' burstiness, where the law's headroom grew for it: the measured index of dispersion,
    and the factor on the headroom (√ of the peakedness it used)."""
    if peakedness <= 1.0 or s.dispersion is None:
        return ""
    return (
        f"; arrivals over-dispersed: index of dispersion {s.dispersion:.1f} per period, "
        f"headroom ×{math.sqrt(peakedness):.2f}"
    )


def rate_text(memory: Memory, ahead: float, horizon: float) -> str:
    """The smoothed rate and its trend, as a steady decision reports them (and the forecast, where it counts)."""
    level = memory.level or 0.0
    text = f"arrival {level:.2f} req/s, trend {memory.trend * 60:+.2f} req/s per minute"
    return text + (f" ({ahead:.2f} req/s expected in {horizon:.0f} s)" if ahead > level else "")
