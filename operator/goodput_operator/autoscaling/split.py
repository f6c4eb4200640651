"""When to split prefill from decode: a DistServe-style model of the two phases, torch-free.

Per-phase step times come from a profile of the runtime (bench/pd_profile.py writes the fit to
bench/pd_profile.json; `StepModel` evaluates it):

    prefill(P)     = a + b·P + c·P²                  one prompt of P tokens
    decode(B, L)   = d0 + d1·B + d2·B·L               one step of B sequences at context L
    mixed(B, L, C) = decode(B, L) + m·(b·C + c·C²)    a decode step carrying a prefill chunk of C tokens
    hand-off(P)    = h0 + P · bytes per token / measured bandwidth

For a length mix (prompt and output tokens of sampled requests) and an SLO (TTFT and TPOT targets,
attainment quantile), `goodput` finds the largest request rate per replica that meets both:

- aggregated: one replica runs chunked prefill: every step decodes its running batch and carries up
  to C prompt tokens (C searched). The step grows by the chunk's cost (interference: TPOT suffers)
  and prompts queue behind each other's chunks (TTFT suffers);
- disaggregated: prefill replicas run prompts one at a time (M/G/1 queue for TTFT, net of the hand-off
  and the first decode step), decode replicas run batches as large as the TPOT target and KV memory
  allow; for each prefill:decode ratio the system rate is min(p·λ_prefill, d·λ_decode), per replica
  divided by p + d.

`dynamo_ratio` is the ratio NVIDIA Dynamo's SLA planner would choose from the same profiles. Its docs
("SLA-based Planner", docs.nvidia.com/dynamo/latest/architecture/sla_planner.html, "Calculating Number
of Replicas"; "Pre-Deployment Profiling", .../architecture/pre_deployment_profiling.html) set prefill
replicas = predicted requests × ISL / the prefill throughput per replica, profiled as the TTFT of one
request of that ISL (no in-flight batching, so no queueing), and decode replicas = predicted requests ×
OSL / the decode throughput per replica at the largest in-flight count whose ITL meets the target at
that context. Its live correction factors (observed TTFT and ITL over the profiled ones) start at 1,
so this is the ratio it starts from.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPLIT_MARGIN = 0.10  # the best split must beat aggregated serving by this share to be recommended
CHUNKS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)  # token budgets per aggregated step, searched
MAX_POOL = 8  # prefill and decode replica counts searched, each 1..MAX_POOL
DEFAULT_KV_TOKENS = 262_144  # KV cache tokens one decode replica holds when the caller does not say
DEFAULT_PROFILE = Path(__file__).resolve().parents[3] / "bench" / "pd_profile.json"


@dataclass(frozen=True)
class StepModel:
    a: float
    b: float
    c: float
    d0: float
    d1: float
    d2: float
    m: float  # a chunk's share of its own prefill cost when a decode step carries it
    bytes_per_token: int
    bandwidth: float  # bytes per second of the hand-off (copy out, wire, copy in)
    h0: float = 0.0

    @classmethod
    def from_profile(cls, doc: dict[str, Any]) -> StepModel:
        fit = doc["fit"]
        p, d, h = fit["prefill"], fit["decode"], fit["handoff"]
        return cls(
            p["a"],
            p["b"],
            p["c"],
            d["d0"],
            d["d1"],
            d["d2"],
            fit["mixed"]["m"],
            int(doc["bytes_per_token"]),
            h["bytes_per_second"],
            h.get("h0", 0.0),
        )

    @classmethod
    def load(cls, path: Path = DEFAULT_PROFILE) -> StepModel:
        return cls.from_profile(json.loads(Path(path).read_text()))

    @classmethod
    def reference(cls) -> StepModel:
        """The profile committed with the operator (pd_fit.py, written by bench/pd_profile.py with its JSON)."""
        from goodput_operator.autoscaling.pd_fit import PROFILE

        return cls.from_profile(PROFILE)

    @staticmethod
    def reference_machine() -> str:
        from goodput_operator.autoscaling.pd_fit import PROFILE

        return str(PROFILE["machine"])

    def prefill(self, tokens: float) -> float:
        return self.a + self.b * tokens + self.c * tokens * tokens

    def decode(self, batch: float, context: float) -> float:
        return self.d0 + self.d1 * batch + self.d2 * batch * context

    def chunk(self, tokens: float, prompt: float | None = None) -> float:
        """What a prefill chunk of `tokens` adds to the decode step that carries it; each of its tokens
        attends over its prompt (a prompt's chunks together cost m × its whole prefill, less the fixed part)."""
        return self.m * tokens * (self.b + self.c * (tokens if prompt is None else prompt))

    def mixed(self, batch: float, context: float, chunk: float) -> float:
        return self.decode(batch, context) + self.chunk(chunk)

    def handoff(self, tokens: float) -> float:
        return self.h0 + tokens * self.bytes_per_token / self.bandwidth


@dataclass(frozen=True)
class Slo:
    ttft: float  # seconds
    tpot: float  # seconds
    attainment: float = 0.9  # the share of requests that must meet both


@dataclass(frozen=True)
class Mix:
    """Request lengths: (prompt tokens, output tokens) pairs, equally likely."""

    name: str
    requests: tuple[tuple[int, int], ...]

    @property
    def prompt(self) -> float:
        return sum(p for p, _ in self.requests) / len(self.requests)

    @property
    def output(self) -> float:
        return sum(o for _, o in self.requests) / len(self.requests)

    @classmethod
    def fixed(cls, name: str, prompt: int, output: int) -> Mix:
        return cls(name, ((prompt, output),))


@dataclass(frozen=True)
class Capacity:
    rate: float  # requests per second within the SLO
    detail: str


@dataclass(frozen=True)
class Recommendation:
    mix: str
    prompt_tokens: float
    output_tokens: float
    aggregated: float  # goodput per replica, requests/s
    aggregated_detail: str
    disaggregated: float  # at the best ratio
    prefill: int
    decode: int
    prefill_rate: float  # requests/s one prefill replica serves within the TTFT target
    decode_rate: float  # requests/s one decode replica serves within the TPOT target
    dynamo_prefill: int
    dynamo_decode: int
    dynamo_goodput: float  # goodput per replica at Dynamo's ratio under this model
    split: bool  # the recommendation: disaggregated serving

    @property
    def gain(self) -> float:
        return self.disaggregated / self.aggregated if self.aggregated > 0 else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {
            "mix": self.mix,
            "promptTokens": round(self.prompt_tokens, 1),
            "outputTokens": round(self.output_tokens, 1),
            "recommended": "disaggregated" if self.split else "aggregated",
            "aggregatedGoodputPerReplica": round(self.aggregated, 4),
            "disaggregatedGoodputPerReplica": round(self.disaggregated, 4),
            "ratio": f"{self.prefill}:{self.decode}",
            "dynamoRatio": f"{self.dynamo_prefill}:{self.dynamo_decode}",
            "dynamoGoodputPerReplica": round(self.dynamo_goodput, 4),
        }


def _bisect(ok: Any, high: float) -> float:
    """The largest rate in (0, high] for which ok(rate) holds, assuming it holds below some rate; 0 if none."""
    low = 0.0
    if not ok(high * 1e-6):
        return 0.0
    for _ in range(60):
        mid = (low + high) / 2
        if ok(mid):
            low = mid
        else:
            high = mid
    return low


def _within(waits: Sequence[tuple[float, float]], rho: float, mean_wait: float) -> float:
    """The share of requests whose queueing wait stays within each one's slack: M/G/1 waits, taken as
    P(W > t) = ρ·exp(−ρ·t / E[W]) (exact for M/M/1), over (weight, slack) pairs."""
    total = 0.0
    for weight, slack in waits:
        if slack < 0:
            continue
        tail = rho * math.exp(-rho * slack / mean_wait) if mean_wait > 0 else 0.0
        total += weight * (1 - tail)
    return total


def prefill_rate(model: StepModel, mix: Mix, slo: Slo) -> Capacity:
    """Requests/s one prefill replica serves with the mix's TTFT within target, net of hand-off and first step."""
    n = len(mix.requests)
    service = [model.prefill(p) for p, _ in mix.requests]
    s1, s2 = sum(service) / n, sum(s * s for s in service) / n
    slack = [
        (1 / n, slo.ttft - s - model.handoff(p) - model.decode(1, p))
        for s, (p, _) in zip(service, mix.requests, strict=True)
    ]

    def ok(rate: float) -> bool:
        rho = rate * s1
        if rho >= 1:
            return False
        return _within(slack, rho, rate * s2 / (2 * (1 - rho))) >= slo.attainment

    rate = _bisect(ok, 1 / s1)
    return Capacity(rate, f"{rate * mix.prompt:.0f} prompt tokens/s at {rate * s1:.0%} busy")


def decode_rate(model: StepModel, mix: Mix, slo: Slo, kv_tokens: int = DEFAULT_KV_TOKENS) -> Capacity:
    """Requests/s one decode replica serves: the largest batch whose step meets the TPOT target and whose
    contexts fit its KV cache, each request holding a slot for its output's steps (Little's law)."""
    context = mix.prompt + mix.output / 2
    per_step = model.d1 + model.d2 * context
    batch = (slo.tpot - model.d0) / per_step if per_step > 0 else math.inf
    batch = min(batch, kv_tokens / (mix.prompt + mix.output))
    if batch < 1:
        return Capacity(0.0, "one sequence's step misses the TPOT target")
    step = model.decode(batch, context)
    return Capacity(batch / (mix.output * step), f"batch {batch:.1f} at {step * 1e3:.1f} ms per step")


def aggregated_rate(model: StepModel, mix: Mix, slo: Slo, kv_tokens: int = DEFAULT_KV_TOKENS) -> Capacity:
    """Requests/s one replica serves mixing both phases (chunked prefill, the chunk budget that serves most).

    At rate λ the step time τ solves τ = decode(λ·O·τ, L) + chunk(λ·P·τ) (each step decodes the running
    batch and carries the prompt tokens that arrived meanwhile); TPOT is τ. A prompt's chunks take
    ⌈P / C⌉ steps of decode(B, L) + chunk(C) each; prompts queue behind each other's chunks (M/G/1)."""
    context = mix.prompt + mix.output / 2
    weighted = sum(p * p for p, _ in mix.requests) / sum(p for p, _ in mix.requests)  # a prompt token's prompt
    # past this rate the step time grows without bound: each request's decode and prompt work per second
    saturation = 1 / (mix.output * (model.d1 + model.d2 * context) + model.chunk(mix.prompt, weighted))
    best = Capacity(0.0, "no chunk budget meets the SLO")
    for budget in CHUNKS:
        rate = _bisect(lambda r, c=budget: _aggregated_ok(model, mix, slo, kv_tokens, c, r, weighted), saturation)
        if rate > best.rate:
            tau = _step_time(model, mix, budget, rate, weighted) or 0.0
            best = Capacity(rate, f"chunk {budget} tokens, {tau * 1e3:.1f} ms per step")
    return best


def _step_time(model: StepModel, mix: Mix, budget: int, rate: float, weighted: float) -> float | None:
    """The aggregated step time at `rate` (fixed point of τ = decode(λOτ, L) + chunk(min(C, λPτ)))."""
    context = mix.prompt + mix.output / 2
    tau = model.d0
    for _ in range(200):
        carried = min(budget, rate * mix.prompt * tau)
        nxt = model.decode(rate * mix.output * tau, context) + model.chunk(carried, weighted)
        if nxt > 1e3:
            return None
        if abs(nxt - tau) < 1e-9:
            return nxt
        tau = nxt
    return tau


def _poisson_cdf(k: int, mean: float) -> float:
    """P(K ≤ k) for K Poisson with this mean."""
    if k < 0:
        return 0.0
    if mean <= 0 or k > mean + 12 * math.sqrt(mean) + 12:
        return 1.0
    log_mean = math.log(mean)
    return min(1.0, sum(math.exp(i * log_mean - mean - math.lgamma(i + 1)) for i in range(k + 1)))


def _aggregated_ok(
    model: StepModel, mix: Mix, slo: Slo, kv_tokens: int, budget: int, rate: float, weighted: float
) -> bool:
    """Whether one aggregated replica at `rate` meets the attainment target. A request meets TTFT when its
    wait behind other prompts' chunks (M/G/1) and its own ⌈P / C⌉ chunk steps fit; it meets TPOT when its
    decode steps, each decode(B, L), plus the chunk steps that land among them (Poisson: other prompts'
    chunk steps arrive at λ·E⌈P / C⌉ per second over its O·τ̄ seconds of decoding), average within target.
    This is the interference: a long prompt's chunk stalls every decode of the step that carries it."""
    tau = _step_time(model, mix, budget, rate, weighted)
    if tau is None or tau > slo.tpot:
        return False
    batch = rate * mix.output * tau
    if batch * (mix.prompt + mix.output) > kv_tokens:
        return False
    base = model.decode(batch, mix.prompt + mix.output / 2)
    # a prompt's ⌈P / C⌉ chunks each ride a step of the running batch's decode
    service = [math.ceil(p / budget) * base + model.chunk(p, p) for p, _ in mix.requests]
    n = len(service)
    s1, s2 = sum(service) / n, sum(s * s for s in service) / n
    rho = rate * s1
    if rho >= 1:
        return False
    mean_wait = rate * s2 / (2 * (1 - rho))
    chunk_steps = rate * sum(math.ceil(p / budget) for p, _ in mix.requests) / n  # per second
    chunk_cost = model.chunk(min(budget, weighted), weighted)  # what one chunk step adds
    met = 0.0
    for s, (_, out) in zip(service, mix.requests, strict=True):
        ttft = _within([(1.0, slo.ttft - s)], rho, mean_wait)
        allowed = math.floor((slo.tpot - base) * out / chunk_cost) if chunk_cost > 0 else 10**9
        met += ttft * _poisson_cdf(allowed, chunk_steps * out * tau)
    return met / n >= slo.attainment


def disaggregated_rate(prefill: Capacity, decode: Capacity, p: int, d: int) -> float:
    """Goodput per replica of p prefill and d decode replicas."""
    return min(p * prefill.rate, d * decode.rate) / (p + d)


def dynamo_ratio(model: StepModel, mix: Mix, slo: Slo, kv_tokens: int = DEFAULT_KV_TOKENS) -> tuple[int, int]:
    """The prefill:decode counts Dynamo's SLA planner picks for a load of one request per second,
    scaled to the smallest whole counts: prompt tokens/s over the single-request prefill throughput,
    output tokens/s over the decode throughput at the largest batch meeting ITL."""
    prefill_throughput = mix.prompt / model.prefill(mix.prompt)  # tokens/s, no queueing
    context = mix.prompt + mix.output / 2
    per_step = model.d1 + model.d2 * context
    batch = max(1.0, min((slo.tpot - model.d0) / per_step, kv_tokens / (mix.prompt + mix.output)))
    decode_throughput = batch / model.decode(batch, context)  # tokens/s
    need_p, need_d = mix.prompt / prefill_throughput, mix.output / decode_throughput
    return _whole_ratio(need_p, need_d)


def _whole_ratio(p: float, d: float) -> tuple[int, int]:
    """The ratio p:d as whole counts within MAX_POOL each, nearest in share of prefill."""
    share = p / (p + d)
    pairs = [(i, j) for i in range(1, MAX_POOL + 1) for j in range(1, MAX_POOL + 1)]
    return min(pairs, key=lambda ij: (abs(ij[0] / (ij[0] + ij[1]) - share), ij[0] + ij[1]))


def recommend(model: StepModel, mix: Mix, slo: Slo, kv_tokens: int = DEFAULT_KV_TOKENS) -> Recommendation:
    agg = aggregated_rate(model, mix, slo, kv_tokens)
    pre, dec = prefill_rate(model, mix, slo), decode_rate(model, mix, slo, kv_tokens)
    p, d = max(
        ((i, j) for i in range(1, MAX_POOL + 1) for j in range(1, MAX_POOL + 1)),
        key=lambda ij: (round(disaggregated_rate(pre, dec, *ij), 9), -(ij[0] + ij[1])),
    )
    dis = disaggregated_rate(pre, dec, p, d)
    dp, dd = dynamo_ratio(model, mix, slo, kv_tokens)
    return Recommendation(
        mix.name,
        mix.prompt,
        mix.output,
        agg.rate,
        agg.detail,
        dis,
        p,
        d,
        pre.rate,
        dec.rate,
        dp,
        dd,
        disaggregated_rate(pre, dec, dp, dd),
        dis > agg.rate * (1 + SPLIT_MARGIN),
    )


# DistServe (Zhong et al., OSDI 2024) sets its targets per application, not one for all: its chatbot
# (ShareGPT, OPT-13B) TTFT 0.25 s and TPOT 0.1 s, code completion (HumanEval, OPT-66B) 0.125 s and 0.2 s,
# summarisation (LongBench, OPT-66B) 15 s and 0.15 s. Against its models' unloaded latencies that reads,
# roughly, as TTFT about 4× and TPOT about 4× for the interactive ones, and a loose TTFT (about 15×) with a
# tight TPOT (about 2.5×) for long documents. The classes below are those multiples.
SLO_CLASSES: dict[str, tuple[float, float]] = {"interactive": (4.0, 4.0), "long-context": (15.0, 2.5)}
LONG_CONTEXT_RATIO = 20.0  # a service whose TTFT target is this many TPOT targets or more is long-context


def slo_class(ttft: float | None, tpot: float | None) -> str:
    """The class a service's own targets are shaped like: a TTFT target many times its TPOT target (a
    reader waits for a summary, then reads it streaming) is long-context, the rest interactive."""
    if ttft is None or tpot is None or tpot <= 0:
        return "interactive"
    return "long-context" if ttft / tpot >= LONG_CONTEXT_RATIO else "interactive"


def slo_for(model: StepModel, mix: Mix, klass: str = "interactive", scale: float = 1.0, attainment: float = 0.9) -> Slo:
    """Targets for a mix as DistServe sets them across workloads: multiples (SLO_CLASSES) of the unloaded
    latencies on one replica (the mean prompt's prefill and hand-off; one sequence's decode step at the
    mean context), times `scale` (smaller is stricter)."""
    ttft_x, tpot_x = SLO_CLASSES[klass]
    ttft = ttft_x * (model.prefill(mix.prompt) + model.handoff(mix.prompt) + model.decode(1, mix.prompt))
    tpot = tpot_x * model.decode(1, mix.prompt + mix.output / 2)
    return Slo(ttft * scale, tpot * scale, attainment)
