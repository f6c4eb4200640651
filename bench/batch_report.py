"""The report of bench.batch_priority: the summary over rounds (each with-batch round's attainment over the
online-alone round before it), the markdown tables, and the plot of online TTFT p90 and batch throughput."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

LABELS = {"alone": "A online alone", "batch": "B online + batch", "batch-uncapped": "C online + batch, no cap"}
KEYS = ("attainment", "ttft_attainment", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "tpot_p90_s")


def fmt(value: float | None, digits: int = 3) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def plot(report: dict, path: Path, window: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for r in report["rounds"]:
        label = f"round {r['round']} {LABELS[r.get('variant', 'batch' if r['with_batch'] else 'alone')]}"
        style = "-" if r["with_batch"] else "--"
        xs, ys = [], []
        t = 0.0
        while t < report["args"]["duration"]:
            inside = sorted(x[1] for x in r["online"] if t <= x[0] < t + window and x[3])
            if inside:
                xs.append(t + window / 2)
                ys.append(inside[int(0.9 * (len(inside) - 1))])
            t += window
        top.plot(xs, ys, style, label=label)
        if r["with_batch"] and len(r["batch_timeline"]) > 1:
            tl = r["batch_timeline"][:: max(1, round(window))]  # samples about a second apart: windows
            rates = [(b[1] - a[1]) / max(1e-9, b[0] - a[0]) for a, b in itertools.pairwise(tl)]
            bottom.plot([(a[0] + b[0]) / 2 for a, b in itertools.pairwise(tl)], rates, label=label)
    top.axhline(report["args"]["slo_ttft"], color="grey", linewidth=0.8, label="TTFT SLO")
    top.set_ylabel(f"online TTFT p90 (s, {window:g} s windows)")
    top.legend(fontsize=7)
    bottom.axhline(
        report["summary"]["idle_capacity_rps"],
        color="grey",
        linewidth=0.8,
        label="capacity the online load leaves idle",
    )
    bottom.set_ylabel(f"batch lines/s ({window:g} s windows)")
    bottom.set_xlabel("seconds into the round")
    bottom.legend(fontsize=7)
    summary = report["summary"]
    share = summary["online_rate_rps"] / max(1e-9, summary["capacity_rps"])
    fig.suptitle(
        f"online load {summary['online_rate_rps']:.2f} req/s ({share:.0%} "
        f"of capacity {summary['capacity_rps']:.2f} req/s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(report: dict, cap: float, rate: float, variants: list[str]) -> dict:
    """Means per run over the rounds, ratios to the online-alone rounds, and the idle capacity used."""

    def mean(variant: str, key: str) -> float:
        values = [x[key] for x in report["rounds"] if x["variant"] == variant and x[key] is not None]
        return statistics.fmean(values) if values else float("nan")

    def round_ratios(variant: str) -> list[float]:
        """Per round: the variant's attainment over the online-alone round just before it."""
        alone = {x["round"]: x["attainment"] for x in report["rounds"] if x["variant"] == "alone"}
        return [x["attainment"] / max(1e-9, alone[x["round"]]) for x in report["rounds"] if x["variant"] == variant]

    idle = cap - rate
    summary: dict = {
        "capacity_rps": cap,
        "online_rate_rps": rate,
        "idle_capacity_rps": idle,
        "alone": {k: mean("alone", k) for k in KEYS},
    }
    for variant in variants[1:]:
        ratios = round_ratios(variant)
        part: dict = {k: mean(variant, k) for k in (*KEYS, "batch_rps")}
        part.update(
            round_ratios=ratios,
            round_ratio_median=statistics.median(ratios),
            attainment_ratio=part["attainment"] / max(1e-9, summary["alone"]["attainment"]),
            idle_capacity_used=part["batch_rps"] / max(1e-9, idle),
        )
        summary[variant] = part
    summary["with_batch"] = summary["batch"]
    summary["attainment_ratio"] = summary["batch"]["attainment_ratio"]
    summary["idle_capacity_used"] = summary["batch"]["idle_capacity_used"]
    return summary


def print_tables(report: dict, variants: list[str]) -> None:
    """Each round, then each run over the rounds, as markdown tables."""
    summary = report["summary"]
    print(
        "\n| round | run | attainment (TTFT+TPOT) | TTFT only | TTFT p90 (s) | TPOT p50 (s) | TPOT p90 (s) "
        "| batch lines/s | batch cap (mean) | ÷ alone |\n|---|---|---|---|---|---|---|---|---|---|"
    )
    for x in report["rounds"]:
        ratio = "" if x["variant"] == "alone" else f"{x['attainment'] / max(1e-9, alone_of(report, x)):.3f}"
        print(
            f"| {x['round']} | {LABELS[x['variant']]} | {x['attainment']:.3f} | "
            f"{x['ttft_attainment']:.3f} | {fmt(x['ttft_p90_s'])} | {fmt(x['tpot_p50_s'])} | "
            f"{fmt(x['tpot_p90_s'])} | {x['batch_rps']:.2f} | {fmt(x['batch_cap_mean'], 1)} | {ratio} |"
        )
    print(
        "\n| run | online attainment | TTFT p90 (s) | TPOT p90 (s) | batch lines/s | ÷ alone (median of rounds) "
        "| share of idle capacity |\n|---|---|---|---|---|---|---|"
    )
    a = summary["alone"]
    print(f"| {LABELS['alone']} | {a['attainment']:.3f} | {fmt(a['ttft_p90_s'])} | {fmt(a['tpot_p90_s'])} | – | | |")
    for variant in variants[1:]:
        b = summary[variant]
        print(
            f"| {LABELS[variant]} | {b['attainment']:.3f} | {fmt(b['ttft_p90_s'])} | {fmt(b['tpot_p90_s'])} | "
            f"{b['batch_rps']:.2f} | {b['attainment_ratio']:.3f} ({b['round_ratio_median']:.3f}; target ≥ 0.98) | "
            f"{b['idle_capacity_used']:.0%} |"
        )


def alone_of(report: dict, x: dict) -> float:
    return next(y["attainment"] for y in report["rounds"] if y["variant"] == "alone" and y["round"] == x["round"])
