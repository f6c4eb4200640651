"""bench.vs_vllm's verdicts: each concurrency's median over rounds against the peer, the targets met, the
markdown table, and the greedy texts compared request by request."""

from __future__ import annotations

import statistics

from bench.stats import RequestRecord

# ours / peer: output tok/s at least this (by concurrency; 1.1 beyond 1); TPOT p50 and TTFT p90 at most
THROUGHPUT_TARGET = {1: 1.0}
THROUGHPUT_TARGET_DEFAULT = 1.1
TPOT_TARGET = 1.0
TTFT_TARGET = 0.7


def same_text(a: str, b: str) -> bool:
    # a trailing incomplete UTF-8 sequence may be held back at the end of a stream
    return a.rstrip("\ufffd") == b.rstrip("\ufffd")


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def compare_outputs(ours: list[RequestRecord], peer: list[RequestRecord]) -> dict:
    """Request by request: equal greedy texts, and where they part for those that differ."""
    differing = []
    for a, b in zip(ours, peer, strict=True):
        if not same_text(a.text, b.text):
            at = first_difference(a.text, b.text)
            differing.append(
                {
                    "index": a.index,
                    "prompt_tokens": a.prompt_tokens,
                    "first_diff_char": at,
                    "ours": a.text[max(0, at - 20) : at + 40],
                    "peer": b.text[max(0, at - 20) : at + 40],
                }
            )
    return {"requests": len(ours), "equal": len(ours) - len(differing), "differing": differing}


def median_of(summaries: list[dict], path: tuple[str, ...]) -> float | None:
    values = []
    for s in summaries:
        v = s
        for key in path:
            v = v[key]
        if v is not None:
            values.append(v)
    return statistics.median(values) if values else None


def table_rows(samples: dict[tuple[str, int], list[dict]], levels: list[int], peer: str) -> list[dict]:
    rows = []
    for c in levels:
        ours, theirs = samples[("ours", c)], samples[(peer, c)]
        row = {"concurrency": c}
        for name, runs in (("ours", ours), (peer, theirs)):
            row[f"{name}_tok_s"] = median_of(runs, ("output_tokens_per_s",))
            row[f"{name}_tpot_p50_s"] = median_of(runs, ("tpot_s", "p50"))
            row[f"{name}_ttft_p90_s"] = median_of(runs, ("ttft_s", "p90"))
        row["tok_s_ratio"] = row["ours_tok_s"] / row[f"{peer}_tok_s"]
        row["tpot_p50_ratio"] = row["ours_tpot_p50_s"] / row[f"{peer}_tpot_p50_s"]
        row["ttft_p90_ratio"] = row["ours_ttft_p90_s"] / row[f"{peer}_ttft_p90_s"]
        # within each round: ours over the peer measured next to it
        row["tok_s_ratio_per_round"] = [
            a["output_tokens_per_s"] / b["output_tokens_per_s"] for a, b in zip(ours, theirs, strict=True)
        ]
        target = THROUGHPUT_TARGET.get(c, THROUGHPUT_TARGET_DEFAULT)
        row["targets"] = {
            f"tok/s >= {target}x": row["tok_s_ratio"] >= target,
            f"TPOT p50 <= {TPOT_TARGET}x": row["tpot_p50_ratio"] <= TPOT_TARGET,
            f"TTFT p90 <= {TTFT_TARGET}x": row["ttft_p90_ratio"] <= TTFT_TARGET,
        }
        rows.append(row)
    return rows


def markdown(rows: list[dict], peer: str) -> str:
    lines = [
        f"| concurrency | ours tok/s | {peer} tok/s | ratio | ours TPOT p50 | {peer} TPOT p50 | ratio "
        f"| ours TTFT p90 | {peer} TTFT p90 | ratio | targets met |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        met = ", ".join(f"{'yes' if ok else 'NO'} ({name})" for name, ok in r["targets"].items())
        lines.append(
            f"| {r['concurrency']} | {r['ours_tok_s']:.1f} | {r[f'{peer}_tok_s']:.1f} | {r['tok_s_ratio']:.2f}x | "
            f"{r['ours_tpot_p50_s'] * 1e3:.0f} ms | {r[f'{peer}_tpot_p50_s'] * 1e3:.0f} ms | "
            f"{r['tpot_p50_ratio']:.2f}x | {r['ours_ttft_p90_s']:.2f} s | {r[f'{peer}_ttft_p90_s']:.2f} s | "
            f"{r['ttft_p90_ratio']:.2f}x | {met} |"
        )
    return "\n".join(lines)
