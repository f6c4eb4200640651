"""Per-request latency records -> percentiles, throughput and goodput; the printed table."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

QUANTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    prompt_tokens: int
    max_tokens: int
    start_s: float  # offsets from the start of the run
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    itl_s: list[float] = field(default_factory=list)
    error: str | None = None
    text: str = ""
    # what our runtime's admission predicted for it (response headers x-goodput-predicted-*), seconds
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.e2e_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)  # type: ignore[operator]

    def meets(self, slo_ttft: float | None, slo_tpot: float | None) -> bool:
        """Succeeded and met both objectives; TPOT counts as met with at most one output token."""
        if not self.ok:
            return False
        if slo_ttft is not None and (self.ttft_s is None or self.ttft_s > slo_ttft):
            return False
        tpot = self.tpot_s
        return slo_tpot is None or tpot is None or tpot <= slo_tpot


def prediction_error(records: list[RequestRecord]) -> dict:
    """Admission's predictions against what was measured, over the requests that carried them:
    the measured value less the predicted one (seconds), as a distribution, and the mean ratio."""
    out: dict = {}
    for name, pairs in (
        ("ttft", [(r.predicted_ttft_s, r.ttft_s) for r in records if r.ok and r.predicted_ttft_s is not None]),
        ("tpot", [(r.predicted_tpot_s, r.tpot_s) for r in records if r.ok and r.predicted_tpot_s is not None]),
    ):
        known = [(p, m) for p, m in pairs if p is not None and m is not None]
        if not known:
            out[name] = None
            continue
        errors = [m - p for p, m in known]
        ratios = [m / p for p, m in known if p > 0]
        out[name] = {
            "requests": len(known),
            "error_s": distribution(errors),
            "mean_abs_error_s": sum(abs(e) for e in errors) / len(errors),
            "mean_measured_over_predicted": sum(ratios) / len(ratios) if ratios else None,
        }
    return out


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: list[float]) -> dict[str, float | None]:
    out: dict[str, float | None] = {"mean": sum(values) / len(values) if values else None}
    for q in QUANTILES:
        out[f"p{q}"] = percentile(values, q)
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft: float | None, slo_tpot: float | None) -> dict:
    done = [r for r in records if r.ok]
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(r.meets(slo_ttft, slo_tpot) for r in records)
    return {
        "duration_s": duration_s,
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "short_outputs": sum(r.output_tokens < r.max_tokens for r in done),
        "prompt_tokens": sum(r.prompt_tokens for r in done),
        "output_tokens": output_tokens,
        "requests_per_s": len(done) / duration_s if duration_s > 0 else None,
        "output_tokens_per_s": output_tokens / duration_s if duration_s > 0 else None,
        "ttft_s": distribution([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_s": distribution([t for r in done if (t := r.tpot_s) is not None]),
        "itl_s": distribution([gap for r in done for gap in r.itl_s]),
        "e2e_s": distribution([r.e2e_s for r in done if r.e2e_s is not None]),
        "slo": {"ttft_s": slo_ttft, "tpot_s": slo_tpot},
        "good_requests": good,
        "goodput_share": good / len(records) if records else None,
        "goodput_requests_per_s": good / duration_s if duration_s > 0 else None,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_table(summary: dict) -> str:
    lines = [
        f"requests      {summary['completed']}/{summary['requests']} completed, "
        f"{summary['failed']} failed, {summary['short_outputs']} shorter than max_tokens",
        f"duration      {summary['duration_s']:.2f} s",
        f"throughput    {summary['requests_per_s'] or 0:.2f} req/s, "
        f"{summary['output_tokens_per_s'] or 0:.1f} output tok/s "
        f"({summary['output_tokens']} output, {summary['prompt_tokens']} prompt tokens)",
        "",
        f"{'metric (ms)':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        dist = summary[f"{name}_s"]
        cells = "".join(f"{_ms(dist[k]):>10}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name.upper():<12}{cells}")
    slo = summary["slo"]
    share = summary["goodput_share"]
    lines += [
        "",
        f"goodput       {summary['good_requests']}/{summary['requests']} requests "
        f"({(share or 0) * 100:.1f}%), {summary['goodput_requests_per_s'] or 0:.2f} good req/s "
        f"against TTFT <= {_ms(slo['ttft_s'])} ms, TPOT <= {_ms(slo['tpot_s'])} ms",
    ]
    return "\n".join(lines)
