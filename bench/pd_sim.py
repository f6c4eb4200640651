"""When to split prefill from decode: goodput per replica, aggregated against the best prefill:decode ratio.

    python -m bench.pd_sim [--profile bench/pd_profile.json] [--scale 1.0] [--csv trace.csv ...]

The model (goodput_operator.autoscaling.split, DistServe-style) runs on the per-phase step times
fitted to our runtime on this machine (bench/pd_profile.py). For each length mix it reports the
goodput per replica (requests/s meeting both targets at the attainment quantile) of aggregated
serving (chunked prefill, the best chunk budget) and of disaggregated serving at the best ratio,
the ratio NVIDIA Dynamo's SLA planner would choose from the same profiles and the goodput there,
and its recommendation (disaggregated only when the split beats aggregated by more than 10 %).

SLO: DistServe sets targets per application (split.SLO_CLASSES, split.slo_for): multiples of the
unloaded latencies on one replica (the mean prompt's prefill plus hand-off; a single sequence's decode
step). Interactive mixes (chat, code completion, reasoning) take TTFT 4× and TPOT 4×, as its chatbot
and code targets do; the long-document mix takes a loose TTFT (15×) and a tight TPOT (2.5×), as its
summarisation targets do. A CSV's mix takes --slo-class (default interactive). --scale multiplies
both; explicit --ttft/--tpot (seconds) override them for every mix.

Mixes (seeded lognormal lengths around the means, σ 0.5, except the two fixed references):
- short-chat: 200 in / 200 out (reference: aggregated);
- long-prompt: 8,000 in / 256 out (reference: disaggregated; summarisation, RAG);
- production-chat: prompts ~1,000 / outputs ~250 tokens, shaped like the conversation split of Azure's
  public LLM inference trace (AzurePublicDataset, AzureLLMInferenceTrace_conv, 2023; described in
  Splitwise, Patel et al., ISCA 2024: prompts around 1,000 tokens, outputs long-tailed);
- code-completion: 2,000 in / 30 out (the trace's code split: long prompts, very short outputs);
- reasoning: 300 in / 2,000 out (short question, long generated answer);
- and each `timestamp,prompt_tokens,output_tokens` CSV given with --csv (a header line is skipped).

Writes bench/results/pd-split.json and prints the table.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import random
from pathlib import Path

from goodput_operator.autoscaling.split import DEFAULT_PROFILE, SLO_CLASSES, Mix, Slo, StepModel, recommend, slo_for

REPO = Path(__file__).resolve().parents[1]
SIGMA = 0.5
SAMPLES = 400
CSV_LIMIT = 5000  # rows of a user's CSV used (evenly spaced), enough for the mix's shape


def lognormal_mix(name: str, prompt: float, output: float, seed: int = 1, sigma: float = SIGMA) -> Mix:
    """Lengths lognormal with these means (σ of the log), seeded; at least one token each."""
    rng = random.Random(seed)
    shift = sigma * sigma / 2

    def draw(mean: float) -> int:
        return max(1, round(rng.lognormvariate(math.log(mean) - shift, sigma)))

    return Mix(name, tuple((draw(prompt), draw(output)) for _ in range(SAMPLES)))


# each built-in mix's application, for its SLO class (split.SLO_CLASSES); a CSV's mix takes --slo-class
CLASSES = {
    "short-chat": "interactive",
    "long-prompt": "long-context",
    "production-chat": "interactive",
    "code-completion": "interactive",
    "reasoning": "interactive",
}


def mixes() -> list[Mix]:
    return [
        Mix.fixed("short-chat", 200, 200),
        Mix.fixed("long-prompt", 8000, 256),
        lognormal_mix("production-chat", 1000, 250),
        lognormal_mix("code-completion", 2000, 30),
        lognormal_mix("reasoning", 300, 2000),
    ]


def csv_mix(path: Path) -> Mix:
    """A mix from `timestamp,prompt_tokens,output_tokens` rows; a first row that is not numbers is a header."""
    rows: list[tuple[int, int]] = []
    with path.open(newline="") as f:
        for i, row in enumerate(csv.reader(f)):
            if not row or row[0].startswith("#"):
                continue
            try:
                _, prompt, output = float(row[0]), int(row[1]), int(row[2])
            except (ValueError, IndexError) as err:
                if i == 0:
                    continue  # header
                raise SystemExit(f"{path}:{i + 1}: expected timestamp,prompt_tokens,output_tokens ({err})") from err
            if prompt < 1 or output < 1:
                raise SystemExit(f"{path}:{i + 1}: token counts must be at least 1")
            rows.append((prompt, output))
    if not rows:
        raise SystemExit(f"{path}: no rows")
    step = max(1, len(rows) // CSV_LIMIT)
    return Mix(path.stem, tuple(rows[::step]))


def run(
    model: StepModel,
    mix_list: list[Mix],
    scale: float,
    ttft: float | None,
    tpot: float | None,
    default_class: str = "interactive",
) -> list[dict]:
    out = []
    for mix in mix_list:
        klass = CLASSES.get(mix.name, default_class)
        slo = slo_for(model, mix, klass, scale)
        if ttft is not None or tpot is not None:
            slo = Slo(ttft or slo.ttft, tpot or slo.tpot, slo.attainment)
        r = recommend(model, mix, slo)
        row = r.as_dict()
        row.update(
            {
                "requests": len(mix.requests),
                "sloClass": klass if ttft is None and tpot is None else "explicit",
                "slo": {
                    "ttftSeconds": round(slo.ttft, 4),
                    "tpotSeconds": round(slo.tpot, 5),
                    "attainment": slo.attainment,
                },
                "aggregatedDetail": r.aggregated_detail,
                "prefillReplicaRate": round(r.prefill_rate, 4),
                "decodeReplicaRate": round(r.decode_rate, 4),
                "gain": round(r.gain, 3) if math.isfinite(r.gain) else None,
            }
        )
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, default=DEFAULT_PROFILE)
    p.add_argument("--scale", type=float, default=1.0, help="SLO scale (smaller: stricter)")
    p.add_argument("--ttft", type=float, default=None, help="TTFT target, seconds (every mix)")
    p.add_argument("--tpot", type=float, default=None, help="TPOT target, seconds (every mix)")
    p.add_argument("--csv", type=Path, action="append", default=[], help="timestamp,prompt_tokens,output_tokens")
    p.add_argument("--slo-class", choices=sorted(SLO_CLASSES), default="interactive", help="for the CSV mixes")
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "pd-split.json")
    args = p.parse_args(argv)
    doc = json.loads(args.profile.read_text())
    model = StepModel.from_profile(doc)
    mix_list = mixes() + [csv_mix(path) for path in args.csv]
    for path in args.csv:
        if path.stem in CLASSES:
            raise SystemExit(f"{path}: name the file other than a built-in mix ({', '.join(CLASSES)})")
    rows = run(model, mix_list, args.scale, args.ttft, args.tpot, args.slo_class)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "profile": str(args.profile.relative_to(REPO) if args.profile.is_relative_to(REPO) else args.profile),
                "machine": doc["measured"]["machine"],
                "scale": args.scale,
                "rows": rows,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"step times: {args.profile} ({doc['measured']['machine']}); SLO scale {args.scale}")
    print(
        "| mix | in | out | SLO class | TTFT target s | TPOT target ms | aggregated req/s/replica | best split | "
        "split req/s/replica | gain | Dynamo's ratio | at Dynamo's ratio | recommended |"
    )
    print("|---|---:|---:|---|---:|---:|---:|---|---:|---:|---|---:|---|")
    for r in rows:
        print(
            f"| {r['mix']} | {r['promptTokens']:.0f} | {r['outputTokens']:.0f} | {r['sloClass']} | "
            f"{r['slo']['ttftSeconds']:.2f} | "
            f"{r['slo']['tpotSeconds'] * 1e3:.1f} | {r['aggregatedGoodputPerReplica']:.3f} | {r['ratio']} | "
            f"{r['disaggregatedGoodputPerReplica']:.3f} | {r['gain'] or 0:.2f}x | {r['dynamoRatio']} | "
            f"{r['dynamoGoodputPerReplica']:.3f} | {r['recommended']} |"
        )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
