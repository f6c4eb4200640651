"""The reporting half of bench.slo_capacity: the markdown table and the goodput-against-rate plot."""

from __future__ import annotations

import math
from pathlib import Path

from bench.slo_judge import ATTAINMENT

# ---- the table and the plot ----------------------------------------------------------------------


def fmt(value: float | None, spec: str, scale: float = 1.0, unit: str = "") -> str:
    return "-" if value is None else f"{value * scale:{spec}}{unit}"


def markdown(report: dict) -> str:
    peer = report["peer"]
    names = ["ours", peer]
    lines: list[str] = []
    for pair in report["slo_pairs"]:
        lines += [
            f"### SLO {pair['label']} (drain {pair['drain_s']:.1f} s, {len(report['config']['seed_list'])} seed(s), "
            f"{report['config']['window']:g} s windows)",
            "",
            "| rate req/s | server | attainment | goodput req/s | output tok/s | TTFT p50 | TTFT p90 "
            "| TPOT p50 | TPOT p90 | sent | 429 | failed |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for rate in report["config"]["rate_list"]:
            for name in names:
                r = pair["rungs"][name][str(rate)]
                lines.append(
                    f"| {rate:g} | {name} | {fmt(r['attainment'], '.1%')} | {fmt(r['goodput_rps'], '.2f')} | "
                    f"{fmt(r['output_tok_s'], '.1f')} | {fmt(r['ttft_p50_s'], '.2f', 1, ' s')} | "
                    f"{fmt(r['ttft_p90_s'], '.2f', 1, ' s')} | {fmt(r['tpot_p50_s'], '.0f', 1000, ' ms')} | "
                    f"{fmt(r['tpot_p90_s'], '.0f', 1000, ' ms')} | {r['sent_total']} | {r['refused_total']} | "
                    f"{r['failed_total']} |"
                )
        lines.append("")
        caps = pair["capacity"]
        parts = []
        for name in names:
            c = caps[name]
            note = []
            if c["below_ladder"]:
                note.append("below the ladder")
            if c["top_of_ladder"]:
                note.append("top of the ladder: a lower bound")
            if c["non_monotone"]:
                note.append(
                    f"non-monotone: passes again at {', '.join(f'{r:g}' for r in c['passing_above_first_failure'])}"
                )
            parts.append(f"{name} {fmt(c['rps'], 'g', 1, ' req/s')}" + (f" ({'; '.join(note)})" if note else ""))
        lines.append(
            f"- capacity (attainment >= {ATTAINMENT:.0%}): {', '.join(parts)}; "
            f"ours / {peer}: {fmt(caps['ratio'], '.2f', 1, 'x')}"
        )
        for name in names:
            cells = []
            for k, b in pair["beyond_capacity"][name].items():
                if b is None:
                    cells.append(f"at {k}: -")
                else:
                    rung = f"rung {b['rung_rps']:g}" + ("" if b["exact"] else f", nearest to {b['target_rps']:g}")
                    cells.append(f"at {k} ({rung}): {fmt(b['goodput_rps'], '.2f', 1, ' req/s')}")
            lines.append(f"- {name} goodput beyond capacity: {'; '.join(cells)}")
        for name in names:  # admission's predictions against what was measured, where the server gave them
            errors = []
            for rate in report["config"]["rate_list"]:
                r = pair["rungs"][name][str(rate)]
                if r["ttft_pred_mae_s"] is not None or r["tpot_pred_mae_s"] is not None:
                    errors.append(
                        f"{rate:g}: TTFT {fmt(r['ttft_pred_mae_s'], '.2f', 1, ' s')} "
                        f"(x{fmt(r['ttft_measured_over_predicted'], '.2f')}), "
                        f"TPOT {fmt(r['tpot_pred_mae_s'], '.0f', 1000, ' ms')} "
                        f"(x{fmt(r['tpot_measured_over_predicted'], '.2f')})"
                    )
            if errors:
                lines.append(
                    f"- {name} admission's prediction error (mean |measured - predicted|, mean measured/predicted), "
                    f"by rate: {'; '.join(errors)}"
                )
        check = pair.get("vllm_client_check")
        if check:
            cells = []
            for name in names:
                c = check["servers"][name]
                if "error" in c:
                    cells.append(f"{name}: {c['error']}")
                else:
                    cells.append(
                        f"{name} goodput {fmt(c['goodput_rps'], '.2f', 1, ' req/s')} "
                        f"(attainment {fmt(c['attainment'], '.1%')}), "
                        f"TPOT p50 {fmt(c['tpot_p50_s'], '.0f', 1000, ' ms')} "
                        f"p90 {fmt(c['tpot_p90_s'], '.0f', 1000, ' ms')}"
                    )
            lines.append(
                f"- vLLM's client at {check['rate']:g} req/s ({check['num_prompts']} prompts of "
                f"{check['input_len']}+{check['output_len']} tokens): {'; '.join(cells)}"
            )
        lines.append("")
    return "\n".join(lines).rstrip()


def plot(report: dict, path: Path) -> Path | None:
    """Goodput against rate per server, one panel per SLO pair; None where matplotlib is missing."""
    try:
        import matplotlib  # optional: only for the PNG
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = report["slo_pairs"]
    fig, axes = plt.subplots(1, len(pairs), figsize=(5.5 * len(pairs), 4.2), squeeze=False)
    rates = report["config"]["rate_list"]
    for ax, pair in zip(axes[0], pairs, strict=True):
        offered = [pair["rungs"]["ours"][str(r)]["offered_rps"] for r in rates]  # the same requests for all
        ax.plot(rates, offered, linestyle=":", marker=".", color="grey", label="arrived (req/s)")
        for name, runs in pair["rungs"].items():
            ys = [runs[str(r)]["goodput_rps"] for r in rates]
            (line,) = ax.plot(rates, [math.nan if y is None else y for y in ys], marker="o", label=name)
            cap = pair["capacity"][name]["rps"]
            if cap is not None:
                ax.axvline(cap, color=line.get_color(), linestyle="--", linewidth=0.8)
        ax.set_title(f"SLO {pair['label']}", fontsize=9)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("goodput (req/s meeting both targets)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
