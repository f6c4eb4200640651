"""The judging half of bench.slo_capacity: SLO pairs, request lengths (the built-in production-shaped mix
or a trace), one rung's Poisson requests, attainment against an SLO pair, the capacity rule and goodput
beyond capacity. Pure functions over request records; bench.slo_capacity runs the servers."""

from __future__ import annotations

import argparse
import csv
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from bench.stats import RequestRecord, prediction_error, summarize
from bench.workload import WorkItem, items_for, window_arrivals

ATTAINMENT = 0.9
MULTIPLES = (1.5, 2.0)
# the built-in mix: lognormal (median, sigma) and clip range, tokens
PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_CLIP = 250, 1.0, (16, 1000)
OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CLIP = 60, 0.7, (8, 256)
METRICS = (
    "offered_rps",
    "attainment",
    "goodput_rps",
    "output_tok_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "tpot_p50_s",
    "tpot_p90_s",
    # admission's predictions (our runtime's x-goodput-predicted-* headers) against the measurement
    "ttft_pred_mae_s",
    "ttft_measured_over_predicted",
    "tpot_pred_mae_s",
    "tpot_measured_over_predicted",
)
COUNTS = ("sent", "met", "refused", "failed")


# ---- SLO pairs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float

    @property
    def label(self) -> str:
        return f"TTFT <= {seconds_text(self.ttft_s)}, TPOT <= {seconds_text(self.tpot_s)}"


def seconds_text(value: float) -> str:
    return f"{value:g} s" if value >= 1 else f"{value * 1000:g} ms"


def parse_seconds(text: str) -> float:
    """'0.5', '0.5s' or '500ms' -> 0.5."""
    text = text.strip().lower()
    value = float(text[:-2]) / 1000 if text.endswith("ms") else float(text.removesuffix("s"))
    if not value > 0 or math.isinf(value):
        raise ValueError(f"not a positive time: {text!r}")
    return value


def parse_slo(text: str) -> Slo:
    """'TTFT:TPOT' in seconds (or with an ms suffix): '2:0.1', '500ms:200ms'."""
    ttft, sep, tpot = text.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError(f"--slo wants TTFT:TPOT, got {text!r}")
    try:
        return Slo(parse_seconds(ttft), parse_seconds(tpot))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--slo {text!r}: {exc}") from None


def parse_rates(text: str) -> list[float]:
    rates = sorted({float(r) for r in text.split(",") if r.strip()})
    if not rates or rates[0] <= 0 or math.isinf(rates[-1]):
        raise argparse.ArgumentTypeError(f"--rates wants positive finite rates, got {text!r}")
    return rates


# ---- lengths -------------------------------------------------------------------------------------

PROMPT_COLUMNS = ("prompt_tokens", "contexttokens", "context_tokens", "input_tokens")
OUTPUT_COLUMNS = ("output_tokens", "generatedtokens", "generated_tokens")


def load_trace(path: Path, scale: float, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) per row of a CSV trace, times `scale`, rounded, at least 1, capped."""
    if scale <= 0:
        raise ValueError(f"--scale must be positive, got {scale}")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        names = {name.strip().lower(): name for name in reader.fieldnames or []}
        prompt_col = next((names[c] for c in PROMPT_COLUMNS if c in names), None)
        output_col = next((names[c] for c in OUTPUT_COLUMNS if c in names), None)
        if prompt_col is None or output_col is None:
            raise ValueError(
                f"{path}: want a header naming timestamp,prompt_tokens,output_tokens, got {reader.fieldnames}"
            )
        rows = []
        for line, row in enumerate(reader, start=2):
            try:
                prompt, output = float(row[prompt_col]), float(row[output_col])
            except (TypeError, ValueError):
                raise ValueError(f"{path}:{line}: not a number in {row}") from None
            rows.append(
                (
                    min(max_prompt, max(1, round(prompt * scale))),
                    min(max_output, max(1, round(output * scale))),
                )
            )
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def builtin_lengths(n: int, seed: int, max_prompt: int, max_output: int) -> list[tuple[int, int]]:
    """`n` (prompt, output) lengths of the built-in chat mix (the module docstring's numbers)."""
    rng = random.Random(seed)

    def draw(median: int, sigma: float, clip: tuple[int, int], cap: int) -> int:
        return min(cap, clip[1], max(clip[0], round(rng.lognormvariate(math.log(median), sigma))))

    return [
        (
            draw(PROMPT_MEDIAN, PROMPT_SIGMA, PROMPT_CLIP, max_prompt),
            draw(OUTPUT_MEDIAN, OUTPUT_SIGMA, OUTPUT_CLIP, max_output),
        )
        for _ in range(n)
    ]


def rung_seed(seed: int, rate: float) -> int:
    return 1_000_003 * seed + round(rate * 1000)


def rung_items(
    rate: float,
    seed: int,
    window_s: float,
    vocabulary: list[int],
    trace: list[tuple[int, int]] | None,
    max_prompt: int,
    max_output: int,
) -> list[WorkItem]:
    """One rung's requests: Poisson arrivals within the window, lengths from the trace or the mix."""
    key = rung_seed(seed, rate)
    arrivals = window_arrivals(rate, window_s, key)
    if trace is None:
        lengths = builtin_lengths(len(arrivals), key + 5, max_prompt, max_output)
    else:
        pick = random.Random(key + 5)
        lengths = [pick.choice(trace) for _ in arrivals]
    return items_for(lengths, arrivals, vocabulary, key + 7)


def drain_s(slo: Slo, max_output: int) -> float:
    """After the window: the longest any request can still take and meet the SLO, plus a second."""
    return slo.ttft_s + slo.tpot_s * (max_output - 1) + 1.0


# ---- judging -------------------------------------------------------------------------------------


def refused(record: RequestRecord) -> bool:
    return record.error is not None and record.error.startswith("HTTP 429")


def judge(records: list[RequestRecord], window_s: float, slo: Slo) -> dict:
    """One run against one SLO pair: attainment over every request sent (429s and failures not met),
    rates per second of window, latency percentiles of the completed requests."""
    s = summarize(records, window_s, slo.ttft_s, slo.tpot_s)
    n_refused = sum(refused(r) for r in records)
    predicted = prediction_error(records)
    ttft, tpot = predicted["ttft"] or {}, predicted["tpot"] or {}
    return {
        "ttft_pred_mae_s": ttft.get("mean_abs_error_s"),
        "ttft_measured_over_predicted": ttft.get("mean_measured_over_predicted"),
        "tpot_pred_mae_s": tpot.get("mean_abs_error_s"),
        "tpot_measured_over_predicted": tpot.get("mean_measured_over_predicted"),
        "sent": len(records),
        "met": s["good_requests"],
        "refused": n_refused,
        "failed": s["failed"] - n_refused,
        "offered_rps": len(records) / window_s,
        "attainment": s["goodput_share"],
        "goodput_rps": s["goodput_requests_per_s"],
        "output_tok_s": s["output_tokens_per_s"],
        "ttft_p50_s": s["ttft_s"]["p50"],
        "ttft_p90_s": s["ttft_s"]["p90"],
        "tpot_p50_s": s["tpot_s"]["p50"],
        "tpot_p90_s": s["tpot_s"]["p90"],
        "errors": sorted({r.error[:80] for r in records if r.error and not refused(r)})[:5],
    }


def mean_or_none(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.fmean(present) if present else None


def aggregate(runs: list[dict]) -> dict:
    """A rung's runs over seeds: the mean of each figure, each seed's value, counts summed."""
    out: dict = {k: mean_or_none([r[k] for r in runs]) for k in METRICS}
    out["seeds"] = [r["seed"] for r in runs]
    out["per_seed"] = {k: [r[k] for r in runs] for k in METRICS}
    for k in COUNTS:
        out[f"{k}_total"] = sum(r[k] for r in runs)
    return out


def capacity(attainment: dict[float, float | None], threshold: float = ATTAINMENT) -> dict:
    """The highest rate whose rung and every rung below it reach `threshold` (rungs with no requests are
    not judged); a ladder passing again above a failure is flagged, the highest passing rate named."""
    rates = sorted(r for r, a in attainment.items() if a is not None)
    passing = [r for r in rates if attainment[r] >= threshold]  # type: ignore[operator]
    first_fail = next((r for r in rates if attainment[r] < threshold), None)  # type: ignore[operator]
    below = [r for r in passing if first_fail is None or r < first_fail]
    above = [r for r in passing if first_fail is not None and r > first_fail]
    return {
        "rps": below[-1] if below else None,
        "highest_passing_rps": passing[-1] if passing else None,
        "first_failing_rps": first_fail,
        "non_monotone": bool(above),
        "passing_above_first_failure": above,
        "below_ladder": bool(rates) and not below,
        "top_of_ladder": bool(rates) and first_fail is None,
        "threshold": threshold,
    }


def nearest_rung(rates: list[float], target: float) -> float:
    """The rung at `target`, else the nearest one; a tie goes to the higher rung."""
    return min(rates, key=lambda r: (abs(r - target), -r))


def beyond_capacity(cap_rps: float | None, rungs: dict[float, dict], multiples=MULTIPLES) -> dict:
    """Goodput at each multiple of the capacity, from the rung at or nearest that rate."""
    out: dict = {}
    for k in multiples:
        if cap_rps is None:
            out[f"{k:g}x"] = None
            continue
        target = k * cap_rps
        rung = nearest_rung(sorted(rungs), target)
        out[f"{k:g}x"] = {
            "target_rps": target,
            "rung_rps": rung,
            "exact": math.isclose(rung, target),
            "goodput_rps": rungs[rung]["goodput_rps"],
            "goodput_per_seed": rungs[rung]["per_seed"]["goodput_rps"],
            "attainment": rungs[rung]["attainment"],
        }
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
