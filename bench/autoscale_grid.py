"""The simulator's grid: the goodput law without a capacity hint against the hindsight-tuned concurrency HPA
and the two yardsticks, on every trace, start-up and seed; and the issue's targets read off it.

    python -m bench.autoscale_sim --grid [--seeds 1-5]

Used by bench/autoscale_sim.py; the table is the one bench/README.md and docs/autoscaling.md show.
"""

from __future__ import annotations

from collections.abc import Iterable

from bench.autoscale_model import BURST_TRACES, Curve, traces
from bench.autoscale_run import trace_run

LAW, HPA = "goodput-no-hint", "concurrency-hpa"
YARDSTICKS = ("clairvoyant", "reactive-bound")
# the restated targets (docs/autoscaling.md): per trace and start-up, the law's mean attainment at least the HPA's
# at no more than its replica-seconds; over the grid, mean replica-seconds within this share of the clairvoyant's;
# on the burst traces, attainment at least the reactive bound's less this much
CLAIRVOYANT_SHARE, REACTIVE_SLACK = 0.04, 0.01


def grid(
    seeds: list[int],
    startups: list[float],
    duration: float = 3600.0,
    target: float = 0.95,
    curve: Curve | None = None,
    max_num_seqs: int = 8,
    names: tuple[str, ...] | None = None,
    law: str = LAW,
) -> list[dict]:
    """The goodput law (no capacity hint) against the hindsight-tuned concurrency HPA on every trace
    (or those `names`), start-up time and seed: per trace and start-up, attainment (worst seed, mean; and
    the mean over requests that arrived after the first ten minutes, `settled`) and replica-seconds as a
    ratio to the HPA's (mean, worst seed); the same for each yardstick."""
    curve = curve or Curve.load()
    base = curve.capacity_point(target)[0]
    rows = []
    for name in names or tuple(traces(base, duration)):
        for startup in startups:
            runs: dict[str, list[dict]] = {p: [] for p in (law, HPA, *YARDSTICKS)}
            for seed in seeds:
                for policy, out in runs.items():
                    out.append(trace_run(curve, name, duration, policy, startup, seed, target, max_num_seqs))
            ours, hpa = runs[law], runs[HPA]
            ratios = [g["replica_seconds"] / h["replica_seconds"] for g, h in zip(ours, hpa, strict=True)]
            row = {
                "trace": name,
                "startup_s": startup,
                "seeds": seeds,
                "goodput_attainment_min": min(r["attainment"] for r in ours),
                "goodput_attainment_mean": _mean(r["attainment"] for r in ours),
                "goodput_attainment_settled_mean": _mean(r["attainment_settled"] for r in ours),
                "hpa_attainment_min": min(r["attainment"] for r in hpa),
                "hpa_attainment_mean": _mean(r["attainment"] for r in hpa),
                "replica_s_ratio_mean": _mean(ratios),
                "replica_s_ratio_max": max(ratios),
                "goodput_replicas_mean": _mean(r["replica_seconds"] / duration for r in ours),
                "hpa_replicas_mean": _mean(r["replica_seconds"] / duration for r in hpa),
            }
            for y in YARDSTICKS:
                key = y.replace("-", "_")
                row[f"{key}_attainment_mean"] = _mean(r["attainment"] for r in runs[y])
                row[f"{key}_replica_s_ratio_mean"] = _mean(
                    r["replica_seconds"] / h["replica_seconds"] for r, h in zip(runs[y], hpa, strict=True)
                )
            rows.append(row)
    return rows


def _mean(values: Iterable[float]) -> float:
    xs = list(values)
    return sum(xs) / len(xs)


def parse_seeds(text: str) -> list[int]:
    """`1-5` or `1,3,8`."""
    if "-" in text:
        first, last = text.split("-", 1)
        return list(range(int(first), int(last) + 1))
    return [int(x) for x in text.split(",") if x]


def grid_table(rows: list[dict]) -> str:
    lines = [
        "| trace | start-up | goodput attainment (min / mean) | HPA attainment (min / mean) "
        "| replica-s vs HPA (mean / max) | reactive bound: attainment, replica-s | clairvoyant: attainment, "
        "replica-s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['trace']} | {r['startup_s']:.0f} s | {r['goodput_attainment_min']:.3f} / "
            f"{r['goodput_attainment_mean']:.3f} | {r['hpa_attainment_min']:.3f} / "
            f"{r['hpa_attainment_mean']:.3f} | {r['replica_s_ratio_mean']:.2f}× / "
            f"{r['replica_s_ratio_max']:.2f}× | {r['reactive_bound_attainment_mean']:.3f}, "
            f"{r['reactive_bound_replica_s_ratio_mean']:.2f}× | {r['clairvoyant_attainment_mean']:.3f}, "
            f"{r['clairvoyant_replica_s_ratio_mean']:.2f}× |"
        )
    lines.append("")
    for label, key in (
        ("the goodput law", "replica_s_ratio_mean"),
        ("the reactive bound", "reactive_bound_replica_s_ratio_mean"),
        ("the clairvoyant", "clairvoyant_replica_s_ratio_mean"),
    ):
        mean = sum(r[key] for r in rows) / len(rows)
        lines.append(f"replica-seconds vs the concurrency HPA, mean over traces and start-ups, {label}: {mean:.3f}×")
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict[str, object]:
    """The restated targets, read off the grid's rows: each row's misses, and the mean cost against the
    clairvoyant's (the law's mean ratio to the HPA over the clairvoyant's, less 1)."""
    misses: dict[str, list[str]] = {}
    for r in rows:
        key = f"{r['trace']} {r['startup_s']:.0f} s"
        row_misses = []
        if r["goodput_attainment_mean"] < r["hpa_attainment_mean"]:
            row_misses.append(
                f"attainment {r['goodput_attainment_mean']:.4f} < the HPA's {r['hpa_attainment_mean']:.4f}"
            )
        if r["replica_s_ratio_mean"] > 1.0:
            row_misses.append(f"replica-seconds {r['replica_s_ratio_mean']:.3f}× the HPA's")
        floor = r["reactive_bound_attainment_mean"] - REACTIVE_SLACK
        if r["trace"] in BURST_TRACES and r["goodput_attainment_mean"] < floor:
            row_misses.append(
                f"attainment {r['goodput_attainment_mean']:.4f} < the reactive bound's − 0.01 ({floor:.4f})"
            )
        if row_misses:
            misses[key] = row_misses
    law = sum(r["replica_s_ratio_mean"] for r in rows) / len(rows)
    seer = sum(r["clairvoyant_replica_s_ratio_mean"] for r in rows) / len(rows)
    return {"misses": misses, "over_clairvoyant": law / seer - 1, "rows": len(rows)}


def targets_text(rows: list[dict]) -> str:
    t = targets(rows)
    over = float(t["over_clairvoyant"])  # type: ignore[arg-type]
    misses: dict[str, list[str]] = t["misses"]  # type: ignore[assignment]
    lines = [
        f"mean replica-seconds {over:+.1%} against the clairvoyant's "
        f"({'met' if over <= CLAIRVOYANT_SHARE else 'missed'}: within {CLAIRVOYANT_SHARE:.0%})",
        f"rows meeting every per-trace target: {len(rows) - len(misses)} of {len(rows)}",
    ]
    lines += [f"  {row}: {'; '.join(why)}" for row, why in misses.items()]
    return "\n".join(lines)
