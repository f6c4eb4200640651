"""The two-pool law (goodput_operator.autoscaling.pools) driven by the split model's pools, over a day-shaped trace.

    python -m bench.pd_pools_sim [--mix long-prompt] [--peak 8] [--hours 2] [--startup 60]

A fluid simulation, period by period (15 s): requests arrive at a rate that follows a diurnal curve
(trough 20 % of the peak) plus noise; the mix's lengths and SLO are bench/pd_sim.py's. Each pool's
replicas are servers whose goodput comes from goodput_operator.autoscaling.split on the profile
measured here (bench/pd_profile.json): a prefill replica is an M/G/1 queue against the TTFT target
net of the hand-off, a decode replica runs the batch its share of the load makes, its step from the
fitted decode time (requests' TPOT spread lognormally around it, σ 0.15). Each period the law
reads what the pods would export (requests and tokens per
second, the share within the pool's own target, requests queued when the pool runs past its
capacity), decides both counts with `decide_pools`, and replicas asked for serve `--startup` seconds
later. Reported: attainment per pool over the trace, replica-seconds per pool, the prefill:decode
ratio the law held at the peak against the model's best ratio and Dynamo's.

Writes bench/results/pd-pools.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import math
import random
from collections import deque
from pathlib import Path

from bench import pd_sim
from goodput_operator.autoscaling.pools import DECODE, PREFILL, PoolMemory, PoolReading, decide_pools
from goodput_operator.autoscaling.split import (
    StepModel,
    _within,
    decode_rate,
    dynamo_ratio,
    prefill_rate,
    recommend,
    slo_for,
)
from goodput_operator.autoscaling.state import Policy, Signals

REPO = Path(__file__).resolve().parents[1]
PERIOD = 15.0
WINDOW = 60.0
TPOT_SPREAD = 0.15  # σ of log(a request's mean TPOT / the mean step)


def prefill_attainment(model: StepModel, mix: pd_sim.Mix, ttft: float, rate: float) -> tuple[float, float]:
    """(share within the net TTFT target, utilisation) of one prefill replica at `rate` requests/s."""
    n = len(mix.requests)
    service = [model.prefill(p) for p, _ in mix.requests]
    s1, s2 = sum(service) / n, sum(s * s for s in service) / n
    rho = rate * s1
    if rho >= 1:
        return 0.0, rho
    slack = [
        (1 / n, ttft - s - model.handoff(p) - model.decode(1, p))
        for s, (p, _) in zip(service, mix.requests, strict=True)
    ]
    return _within(slack, rho, rate * s2 / (2 * (1 - rho))) if rate > 0 else 1.0, rho


def decode_attainment(model: StepModel, mix: pd_sim.Mix, tpot: float, rate: float) -> tuple[float, float]:
    """(share within TPOT, utilisation) of one decode replica at `rate` requests/s: the batch B = λ·O·τ with
    τ = decode(B, L); past the batch the step allows, every request misses."""
    context = mix.prompt + mix.output / 2
    per = rate * mix.output * (model.d1 + model.d2 * context)
    if per >= 1:
        return 0.0, per
    step = model.d0 / (1 - per)
    # requests' mean TPOT spreads around the mean step (batch composition, lengths): lognormal, σ TPOT_SPREAD
    z = math.log(tpot / step) / TPOT_SPREAD
    return 0.5 * (1 + math.erf(z / math.sqrt(2))), per


def _in_flight(model: StepModel, mix: pd_sim.Mix, pool: str, rate: float) -> float:
    """Requests one replica holds at `rate`: a prefill replica its utilisation, a decode replica its batch."""
    if pool == PREFILL:
        return min(1.0, rate * model.prefill(mix.prompt))
    context = mix.prompt + mix.output / 2
    per = rate * mix.output * (model.d1 + model.d2 * context)
    return rate * mix.output * model.d0 / (1 - per) if per < 1 else float(len(mix.requests))


def trace(hours: float, peak: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    steps = int(hours * 3600 / PERIOD)
    out = []
    for i in range(steps):
        phase = 2 * math.pi * i / steps
        level = peak * (0.6 - 0.4 * math.cos(phase))  # trough 20 % of the peak, at the start and end
        out.append(max(0.0, level * (1 + rng.gauss(0, 0.05))))
    return out


def run(mix_name: str, peak: float, hours: float, startup: float, seed: int = 1) -> dict:
    model = StepModel.load()
    mix = next(m for m in pd_sim.mixes() if m.name == mix_name)
    slo = slo_for(model, mix, pd_sim.CLASSES.get(mix_name, "interactive"))
    base = Policy(1, 32, attainment_target=0.9, ttft_target=slo.ttft, tpot_target=slo.tpot, window_seconds=WINDOW)
    policies = {PREFILL: base, DECODE: base}
    ready = {PREFILL: 1, DECODE: 1}
    asked = {PREFILL: 1, DECODE: 1}
    coming: dict[str, deque[tuple[float, int]]] = {PREFILL: deque(), DECODE: deque()}
    memories: dict[str, PoolMemory] = {}
    queue = {PREFILL: 0.0, DECODE: 0.0}
    rows, good, total, replica_s = [], {PREFILL: 0.0, DECODE: 0.0}, 0.0, {PREFILL: 0.0, DECODE: 0.0}
    peak_ratio: tuple[int, int] | None = None
    last_down: dict[str, float] = {}
    reversals = {PREFILL: 0, DECODE: 0}  # a scale-up within the scale-down window after a scale-down
    rates = trace(hours, peak, seed)
    for i, rate in enumerate(rates):
        now = i * PERIOD
        for pool in (PREFILL, DECODE):
            while coming[pool] and coming[pool][0][0] <= now:
                ready[pool] = coming[pool].popleft()[1]
        readings = {}
        for pool in (PREFILL, DECODE):
            per = rate / max(1, ready[pool])
            if pool == PREFILL:
                met, rho = prefill_attainment(model, mix, slo.ttft, per)
                tokens = mix.prompt
            else:
                met, rho = decode_attainment(model, mix, slo.tpot, per)
                tokens = mix.output
            # past capacity the excess queues (and drains once capacity returns)
            queue[pool] = max(0.0, queue[pool] + (rate - rate / max(rho, 1e-9)) * PERIOD) if rho >= 1 else 0.0
            good[pool] += met * rate * PERIOD
            replica_s[pool] += asked[pool] * PERIOD
            signals = Signals(
                arrival_rate=rate,
                attainment=met,
                waiting=round(queue[pool]) if met < 0.9 else 0,
                running=round(_in_flight(model, mix, pool, per) * ready[pool]),
                finished=rate * WINDOW,
            )
            readings[pool] = PoolReading(asked[pool], ready[pool], signals, rate * tokens, tokens)
        total += rate * PERIOD
        decisions = decide_pools(policies, readings, memories, now)
        memories = {pool: d.memory for pool, d in decisions.items()}
        for pool, d in decisions.items():
            if d.desired > asked[pool] and now - last_down.get(pool, -math.inf) < base.scale_down_window:
                reversals[pool] += 1
            if d.desired < asked[pool]:
                last_down[pool] = now
            if d.desired > asked[pool]:
                coming[pool].append((now + startup, d.desired))
            elif d.desired < asked[pool]:
                ready[pool] = min(ready[pool], d.desired)
                coming[pool] = deque((t, min(n, d.desired)) for t, n in coming[pool])
            asked[pool] = d.desired
        if rate == max(rates):
            peak_ratio = (asked[PREFILL], asked[DECODE])
        rows.append({"t": now, "rate": round(rate, 4), **{f"{p}_replicas": asked[p] for p in asked}})
    best = recommend(model, mix, slo)
    pre, dec = prefill_rate(model, mix, slo), decode_rate(model, mix, slo)
    return {
        "mix": mix_name,
        "slo": {"ttftSeconds": round(slo.ttft, 3), "tpotSeconds": round(slo.tpot, 4)},
        "peakRate": peak,
        "attainment": {pool: round(good[pool] / total, 4) for pool in good},
        "replicaSeconds": {pool: round(v) for pool, v in replica_s.items()},
        "reversals": reversals,
        "ratioAtPeak": f"{peak_ratio[0]}:{peak_ratio[1]}" if peak_ratio else None,
        "modelRatio": f"{best.prefill}:{best.decode}",
        "dynamoRatio": "{}:{}".format(*dynamo_ratio(model, mix, slo)),
        "replicasForPeak": {PREFILL: math.ceil(peak / pre.rate), DECODE: math.ceil(peak / dec.rate)},
        "timeline": rows,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mix", action="append", default=None, help="a mix of bench/pd_sim.py (repeatable)")
    p.add_argument("--peak", type=float, default=None, help="peak requests/s (default: 8 replicas' worth)")
    p.add_argument("--hours", type=float, default=2.0)
    p.add_argument("--startup", type=float, default=60.0)
    p.add_argument("--output", type=Path, default=REPO / "bench" / "results" / "pd-pools.json")
    args = p.parse_args(argv)
    model = StepModel.load()
    results = []
    for name in args.mix or ["long-prompt", "production-chat"]:
        mix = next(m for m in pd_sim.mixes() if m.name == name)
        slo = slo_for(model, mix, pd_sim.CLASSES.get(name, "interactive"))
        peak = args.peak or 8 * prefill_rate(model, mix, slo).rate  # what eight prefill replicas serve
        results.append(run(name, peak, args.hours, args.startup))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"hours": args.hours, "startup": args.startup, "runs": results}, indent=1))
    print(
        "| mix | peak req/s | prefill attainment | decode attainment | prefill replica-h | decode replica-h | "
        "ratio at peak | needed at peak | model's best ratio | Dynamo's |"
    )
    print("|---|---:|---:|---:|---:|---:|---|---|---|---|")
    for r in results:
        need = r["replicasForPeak"]
        print(
            f"| {r['mix']} | {r['peakRate']:.3f} | {r['attainment'][PREFILL]:.3f} | {r['attainment'][DECODE]:.3f} | "
            f"{r['replicaSeconds'][PREFILL] / 3600:.1f} | {r['replicaSeconds'][DECODE] / 3600:.1f} | "
            f"{r['reversals'][PREFILL]}, {r['reversals'][DECODE]} | {r['ratioAtPeak']} | "
            f"{need[PREFILL]}:{need[DECODE]} | {r['modelRatio']} | {r['dynamoRatio']} |"
        )
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
