"""Every metric the runtime exports: one module, one prefix, base units, label ``model``.

The names come from ``goodput_contract.metrics``, which the autoscaler and dashboards read too.

Bucket boundaries are in ``metric_buckets``; the KV tiers' series in ``kv_tier_metrics``; the
LoRA adapters' in ``lora_metrics``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from goodput_contract import metrics as names
from goodput_runtime.kv_tier_metrics import KvTierCollector
from goodput_runtime.lora_metrics import LoraMetrics
from goodput_runtime.metric_buckets import (
    GRAMMAR_COMPILE_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TPOT_BUCKETS,
    TTFT_BUCKETS,
    with_boundary,
)
from goodput_runtime.request_times import RequestTimes

# 429 error codes, and the reason label each is counted under
REJECT_REASONS = {"slo_unattainable": "ttft_slo", "tpot_unattainable": "tpot_slo", "rate_limit_exceeded": "queue_full"}
STRUCTURED_TYPES = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")


def time_per_output_token(times: RequestTimes) -> float | None:
    """(e2e − ttft) / (output tokens − 1); None when there is no second token to time."""
    if times.first_token is None or times.finished is None or times.num_output_tokens <= 1:
        return None
    return (times.finished - times.first_token) / (times.num_output_tokens - 1)


PRIORITY_CLASSES = ("online", "batch")


def priority_class(priority: int) -> str:
    return "batch" if priority > 0 else "online"


class RuntimeMetrics:
    def __init__(
        self, model: str, slo_ttft: float | None, slo_tpot: float | None, registry: CollectorRegistry | None = None
    ) -> None:
        self.model = model
        self.slo_ttft = slo_ttft
        self.slo_tpot = slo_tpot
        self.registry = registry or CollectorRegistry()
        r, labels = self.registry, ["model"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model)

        # a counter's name carries _total, which prometheus_client appends to the name it is given
        def counter_name(name: str) -> str:
            return name.removesuffix("_total")

        def counter(name: str, doc: str) -> Counter:
            return Counter(counter_name(name), doc, labels, registry=r).labels(model)

        self.ttft = histogram(
            names.TTFT, "Time from arrival to the first output token.", with_boundary(TTFT_BUCKETS, slo_ttft)
        )
        self.tpot = histogram(
            names.TPOT,
            "Mean time per output token after the first, per request.",
            with_boundary(TPOT_BUCKETS, slo_tpot),
        )
        self.e2e = histogram(names.E2E_LATENCY, "Time from arrival to the last token.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(names.QUEUE_TIME, "Time from arrival to first scheduling.", REQUEST_LATENCY_BUCKETS)
        self.running = gauge(names.REQUESTS_RUNNING, "Requests in the running batch.")
        self.waiting = gauge(names.REQUESTS_WAITING, "Online requests waiting to be scheduled.")
        # the waiting gauge's two parts: the scheduler's online queue (record_step), and requests for a
        # LoRA adapter waiting for its load on first use (record_lora_wait), which no step sees
        self.queued_online = 0
        self.lora_load_waiting = 0
        self.kv_usage = gauge(names.KV_CACHE_USAGE, "Share of KV cache blocks in use (0-1).")
        self.requests = Counter(
            counter_name(names.REQUESTS), "Finished online requests by outcome.", ["model", "outcome"], registry=r
        )
        self.good = counter(names.REQUESTS_GOOD, "Requests that succeeded and met both the TTFT and TPOT SLOs.")
        self.violations = Counter(
            counter_name(names.SLO_VIOLATIONS),
            "Successful requests that missed an SLO target.",
            ["model", "slo"],
            registry=r,
        )
        self.by_priority = Counter(
            counter_name(names.REQUESTS_BY_PRIORITY),
            "Finished requests by priority class (online: priority <= 0, batch: above) and outcome.",
            ["model", "priority", "outcome"],
            registry=r,
        )
        self.good_by_priority = Counter(
            counter_name(names.REQUESTS_GOOD_BY_PRIORITY),
            "Requests that met both SLOs, by priority class.",
            ["model", "priority"],
            registry=r,
        )
        self.waiting_by_priority = Gauge(
            names.REQUESTS_WAITING_BY_PRIORITY,
            "Requests waiting to be scheduled, by priority class.",
            ["model", "priority"],
            registry=r,
        )
        self.rejected = Counter(
            counter_name(names.REQUESTS_REJECTED),
            "Requests answered 429 before they were queued, by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.own_slo = Counter(
            counter_name(names.REQUESTS_OWN_SLO),
            "Online requests carrying their own TTFT or TPOT target, by admission's decision.",
            ["model", "decision"],
            registry=r,
        )
        self.prompt_tokens = counter(names.PROMPT_TOKENS, "Prompt tokens processed (prefill).")
        self.generation_tokens = counter(names.GENERATION_TOKENS, "Tokens generated.")
        self.preemptions = counter(names.PREEMPTIONS, "Requests preempted for lack of KV cache blocks.")
        self.prefix_queries = counter(names.PREFIX_CACHE_QUERIES, "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter(names.PREFIX_CACHE_HITS, "Prompt tokens found in the prefix cache.")
        self.structured = Counter(
            counter_name(names.STRUCTURED_OUTPUT_REQUESTS),
            "Requests whose output a grammar constrained, by what asked for it.",
            ["model", "type"],
            registry=r,
        )
        self.tool_calls = counter(names.TOOL_CALLS, "Tool calls returned to clients.")
        self.grammar_compile = histogram(
            names.GRAMMAR_COMPILE_TIME, "Time to compile a grammar not in the cache.", GRAMMAR_COMPILE_BUCKETS
        )
        self.spec_drafts = counter(names.SPEC_DECODE_DRAFTS, "Proposals verified by speculative decoding.")
        self.spec_draft_tokens = counter(names.SPEC_DECODE_DRAFT_TOKENS, "Proposed tokens verified.")
        self.spec_accepted = counter(names.SPEC_DECODE_ACCEPTED_TOKENS, "Proposed tokens the target model accepted.")
        self.spec_accepted_per_pos = Counter(
            counter_name(names.SPEC_DECODE_ACCEPTED_TOKENS_PER_POS),
            "Accepted proposed tokens by their position in the proposal (0 first).",
            ["model", "position"],
            registry=r,
        )
        self.spec_emitted = counter(
            names.SPEC_DECODE_EMITTED_TOKENS,
            "Tokens emitted by verification steps: the accepted ones and the target's own.",
        )
        self.spec_steps = Counter(
            counter_name(names.SPEC_DECODE_STEPS),
            "Engine steps by whether speculative decoding was on for them.",
            ["model", "speculated"],
            registry=r,
        )
        self.cpu_contended = gauge(
            names.CPU_CONTENDED,
            "1 while other processes take the runtime's cores and its CPU steps run on one thread (--cpu-contention).",
        )
        self.cpu_contention_switches = counter(
            names.CPU_CONTENTION_SWITCHES, "Moves of the CPU steps to one thread under contention, and back."
        )
        self.spec_active = gauge(names.SPEC_DECODE_ACTIVE, "1 while speculative decoding is on for the running batch.")
        self.spec_max_batch = gauge(
            names.SPEC_DECODE_MAX_BATCH, "The running batch up to which speculative decoding is on (absent when off)."
        )
        self.batch_running_cap = gauge(
            names.BATCH_RUNNING_CAP,
            "Batch sequences allowed to step beside the online ones in the last step, "
            "from the TPOT target and the measured step time (--max-num-seqs while no "
            "online sequence runs).",
        )
        self.batch_running = gauge(names.BATCH_RUNNING, "Batch sequences in the last step.")
        self.batch_paused = gauge(
            names.BATCH_PAUSED, "Running batch sequences the cap kept out of the last step (their blocks kept)."
        )
        self.batch_pauses = counter(
            names.BATCH_PAUSES, "Steps batch sequences sat out for the cap beside online work, summed over them."
        )
        for name, value in ((names.SLO_TTFT, slo_ttft), (names.SLO_TPOT, slo_tpot)):
            g = gauge(name, "Configured SLO target in seconds (absent when no target is set).")
            if value is not None:
                g.set(value)
        for kind in STRUCTURED_TYPES:
            self.structured.labels(model, kind)
        for outcome in ("success", "abort", "error"):
            self.requests.labels(model, outcome)
        for slo in ("ttft", "tpot"):
            self.violations.labels(model, slo)
        for cls in PRIORITY_CLASSES:
            self.good_by_priority.labels(model, cls)
            self.waiting_by_priority.labels(model, cls)
            for outcome in ("success", "abort", "error"):
                self.by_priority.labels(model, cls, outcome)
        for reason in REJECT_REASONS.values():
            self.rejected.labels(model, reason)
        for decision in ("admitted", "refused"):
            self.own_slo.labels(model, decision)
        for speculated in ("true", "false"):
            self.spec_steps.labels(model, speculated)
        self.spec_accepted_per_pos.labels(model, "0")
        self.lora: LoraMetrics | None = None  # set by enable_lora

    def enable_lora(self, max_loras: int) -> LoraMetrics:
        """The LoRA adapters' series, registered once adapters are enabled."""
        self.lora = LoraMetrics(self.registry, self.model, max_loras)
        return self.lora

    def record_lora_load(self, result: str, seconds: float) -> None:
        if self.lora is not None:
            self.lora.record_load(result, seconds)

    def record_rejected(self, code: str | None) -> None:
        """A request answered 429: counted by why (the error's code names it)."""
        self.rejected.labels(self.model, REJECT_REASONS.get(code or "", "other")).inc()

    def record_own_slo(self, admitted: bool) -> None:
        """Admission's decision on an online request carrying its own SLO targets."""
        self.own_slo.labels(self.model, "admitted" if admitted else "refused").inc()

    def cpu_contention_changed(self, contended: bool) -> None:
        self.cpu_contended.set(1 if contended else 0)
        self.cpu_contention_switches.inc()

    def speculation_configured(self, max_batch: int, num_tokens: int) -> None:
        """Speculative decoding is configured: k positions, on up to a running batch of max_batch."""
        self.spec_max_batch.set(max_batch)
        for position in range(num_tokens):
            self.spec_accepted_per_pos.labels(self.model, str(position))

    def record_finished(self, times: RequestTimes) -> bool:
        """Observe one finished request; return whether it counted as good. Batch work (priority above
        0) is counted apart, in the by-priority series only: the SLO series, and the autoscaler reading
        them, see online requests, so a batch neither adds replicas nor hides an online SLO miss."""
        cls = priority_class(times.priority)
        online = cls == "online"
        self.by_priority.labels(self.model, cls, times.outcome).inc()
        if online:
            self.requests.labels(self.model, times.outcome).inc()
            if self.lora is not None and times.lora is not None and times.outcome != "success":
                self.lora.record_finished(times.lora, times.outcome, False)
            if times.first_scheduled is not None:
                self.queue_time.observe(times.first_scheduled - times.arrival)
        if times.outcome != "success" or times.finished is None:
            return False
        ttft = None if times.first_token is None else times.first_token - times.arrival
        tpot = time_per_output_token(times)
        # a request's own targets (server/request_slo.py) before the server's
        slo_ttft = self.slo_ttft if times.slo_ttft is None else times.slo_ttft
        slo_tpot = self.slo_tpot if times.slo_tpot is None else times.slo_tpot
        ttft_met = ttft is not None and (slo_ttft is None or ttft <= slo_ttft)
        tpot_met = tpot is None or slo_tpot is None or tpot <= slo_tpot
        if online:
            self.e2e.observe(times.finished - times.arrival)
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            if not ttft_met:
                self.violations.labels(self.model, "ttft").inc()
            if not tpot_met:
                self.violations.labels(self.model, "tpot").inc()
        if self.lora is not None and times.lora is not None and online:
            self.lora.record_finished(times.lora, times.outcome, ttft_met and tpot_met)
        if ttft_met and tpot_met:
            if online:
                self.good.inc()
            self.good_by_priority.labels(self.model, cls).inc()
            return True
        return False

    def _set_waiting(self) -> None:
        online = self.queued_online + self.lora_load_waiting  # the queue the autoscaler reads
        self.waiting.set(online)
        self.waiting_by_priority.labels(self.model, "online").set(online)

    def record_lora_wait(self, delta: int) -> None:
        """A request began (+1) or ended (-1) waiting for its adapter's load: queued demand at once."""
        self.lora_load_waiting += delta
        self._set_waiting()

    def record_step(
        self,
        running: int,
        waiting: int,
        kv_usage: float,
        prompt_tokens: int,
        generation_tokens: int,
        preemptions: int,
        waiting_batch: int = 0,
    ) -> None:
        self.running.set(running)
        self.queued_online = waiting - waiting_batch
        self._set_waiting()
        self.waiting_by_priority.labels(self.model, "batch").set(waiting_batch)
        self.kv_usage.set(kv_usage)
        if prompt_tokens:
            self.prompt_tokens.inc(prompt_tokens)
        if generation_tokens:
            self.generation_tokens.inc(generation_tokens)
        if preemptions:
            self.preemptions.inc(preemptions)

    def record_batch_cap(self, cap: int, running: int, paused: int) -> None:
        """The last step's cap on batch sequences beside online ones, the batch sequences in it and those
        the cap paused."""
        self.batch_running_cap.set(cap)
        self.batch_running.set(running)
        self.batch_paused.set(paused)
        if paused:
            self.batch_pauses.inc(paused)

    def record_speculation(self, speculated: bool, verified: list[tuple[int, int]]) -> None:
        """One step's switch decision and its verifications, each (tokens proposed, tokens accepted)."""
        self.spec_steps.labels(self.model, "true" if speculated else "false").inc()
        self.spec_active.set(1 if speculated else 0)
        for proposed, accepted in verified:
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(proposed)
            self.spec_emitted.inc(accepted + 1)
            if accepted:
                self.spec_accepted.inc(accepted)
                for position in range(accepted):
                    self.spec_accepted_per_pos.labels(self.model, str(position)).inc()

    def watch_kv_tiers(self, block_manager: Any) -> None:
        """Export the KV tiers of `block_manager` (KvTierCollector) from now on."""
        self.registry.register(KvTierCollector(self.model, block_manager))

    def record_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries.inc(queried_tokens)
        if hit_tokens:
            self.prefix_hits.inc(hit_tokens)

    def record_structured(self, kind: str) -> None:
        self.structured.labels(self.model, kind).inc()

    def record_tool_calls(self, count: int) -> None:
        if count:
            self.tool_calls.inc(count)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
