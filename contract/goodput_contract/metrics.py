"""Series names shared by the runtime (which exports them), the autoscaler and the dashboards (which read them).

Names follow Prometheus conventions with the ``goodput_`` prefix; each runtime series carries the
label ``model``. vLLM and SGLang export the same signals under names of their own; ``ENGINE_METRICS``
says which of their series carries each signal.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "goodput_"

TTFT = PREFIX + "time_to_first_token_seconds"
TPOT = PREFIX + "time_per_output_token_seconds"
E2E_LATENCY = PREFIX + "e2e_request_latency_seconds"
QUEUE_TIME = PREFIX + "request_queue_time_seconds"
REQUESTS_RUNNING = PREFIX + "requests_running"
REQUESTS_WAITING = PREFIX + "requests_waiting"
KV_CACHE_USAGE = PREFIX + "kv_cache_usage_ratio"
SLO_TTFT = PREFIX + "slo_ttft_seconds"
SLO_TPOT = PREFIX + "slo_tpot_seconds"
REQUESTS = PREFIX + "requests_total"  # label outcome
REQUESTS_GOOD = PREFIX + "requests_good_total"
SLO_VIOLATIONS = PREFIX + "slo_violations_total"  # label slo
PROMPT_TOKENS = PREFIX + "prompt_tokens_total"
GENERATION_TOKENS = PREFIX + "generation_tokens_total"
PREEMPTIONS = PREFIX + "preemptions_total"
PREFIX_CACHE_QUERIES = PREFIX + "prefix_cache_queries_total"
PREFIX_CACHE_HITS = PREFIX + "prefix_cache_hits_total"
# the KV cache's tiers (docs/kv-cache.md): prefix blocks held per tier (label tier: device | offload);
# the offload tier's hits (prompt tokens loaded from it, also counted in PREFIX_CACHE_HITS), its bytes
# and seconds (label direction: offload | reload), occupancy, and entries that failed their check
KV_TIER_BLOCKS = PREFIX + "kv_tier_blocks"
KV_OFFLOAD_HIT_TOKENS = PREFIX + "kv_offload_hit_tokens_total"
KV_OFFLOAD_BYTES = PREFIX + "kv_offload_bytes_total"
KV_OFFLOAD_SECONDS = PREFIX + "kv_offload_seconds_total"
KV_OFFLOAD_USED_BYTES = PREFIX + "kv_offload_used_bytes"
KV_OFFLOAD_CAPACITY_BYTES = PREFIX + "kv_offload_capacity_bytes"
KV_OFFLOAD_CORRUPT = PREFIX + "kv_offload_corrupt_total"
KV_OFFLOAD_DROPPED_SAVES = PREFIX + "kv_offload_dropped_saves_total"
REQUESTS_REJECTED = PREFIX + "requests_rejected_total"  # label reason: ttft_slo | tpot_slo | queue_full
# online requests carrying their own TTFT or TPOT target (headers), by admission's decision: admitted | refused
REQUESTS_OWN_SLO = PREFIX + "requests_own_slo_total"
# the same requests split by priority class (label priority: online | batch), so batch work
# never hides or inflates the online SLO signals
REQUESTS_BY_PRIORITY = PREFIX + "requests_by_priority_total"  # labels priority, outcome
REQUESTS_GOOD_BY_PRIORITY = PREFIX + "requests_good_by_priority_total"  # label priority
REQUESTS_WAITING_BY_PRIORITY = PREFIX + "requests_waiting_by_priority"  # label priority
# the runtime's cap on batch sequences stepping beside online ones (from --slo-tpot and the measured
# step time; --max-num-seqs while no online sequence runs), and the batch sequences of the last step
BATCH_RUNNING_CAP = PREFIX + "batch_running_cap"
BATCH_RUNNING = PREFIX + "batch_running"  # batch sequences in the last step
BATCH_PAUSED = PREFIX + "batch_paused"  # running batch sequences the cap kept out of the last step
BATCH_PAUSES = PREFIX + "batch_pauses_total"  # steps a batch sequence sat out for the cap, summed over sequences

# the gateway's batch API
BATCH_REQUESTS = PREFIX + "batch_requests_total"  # label state: completed | failed | retried
BATCH_LINES_PENDING = PREFIX + "batch_lines_pending"
# the same per service ({namespace, service}): what spec.batch.maxReplicas scales on
BATCH_SERVICE_LINES_PENDING = PREFIX + "batch_service_lines_pending"
BATCH_CONCURRENCY = PREFIX + "batch_concurrency_limit"  # labels namespace, service
STRUCTURED_OUTPUT_REQUESTS = PREFIX + "structured_output_requests_total"  # label type
TOOL_CALLS = PREFIX + "tool_calls_total"
GRAMMAR_COMPILE_TIME = PREFIX + "grammar_compile_seconds"
# speculative decoding, in vLLM's vocabulary (vllm:spec_decode_num_drafts, ...)
SPEC_DECODE_DRAFTS = PREFIX + "spec_decode_num_drafts_total"
SPEC_DECODE_DRAFT_TOKENS = PREFIX + "spec_decode_num_draft_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS = PREFIX + "spec_decode_num_accepted_tokens_total"
SPEC_DECODE_ACCEPTED_TOKENS_PER_POS = PREFIX + "spec_decode_num_accepted_tokens_per_pos_total"  # label position
SPEC_DECODE_EMITTED_TOKENS = PREFIX + "spec_decode_num_emitted_tokens_total"
SPEC_DECODE_STEPS = PREFIX + "spec_decode_steps_total"  # label speculated: true | false
SPEC_DECODE_ACTIVE = PREFIX + "spec_decode_active"  # the switch's last decision, 1 or 0
SPEC_DECODE_MAX_BATCH = PREFIX + "spec_decode_max_batch"  # the running batch up to which it speculates
CPU_CONTENDED = PREFIX + "cpu_contended"  # 1 while other processes take the cores and steps run on one thread
CPU_CONTENTION_SWITCHES = PREFIX + "cpu_contention_switches_total"  # moves to one thread and back
# LoRA adapters: the running and waiting adapters (labels running_lora_adapters, waiting_lora_adapters,
# max_lora; the value the time it was set), in vLLM's format, which the runtime also exports under vLLM's
# own name for the Gateway API Inference Extension's LoRA-affinity scorer
VLLM_LORA_REQUESTS_INFO = "vllm:lora_requests_info"
LORA_REQUESTS_INFO = PREFIX + "lora_requests_info"
LORA_LOADS = PREFIX + "lora_loads_total"  # label result: ok | error
LORA_LOAD_SECONDS = PREFIX + "lora_load_seconds"
LORA_ADAPTERS = PREFIX + "lora_adapters"  # label tier: slot | cpu | registered
LORA_EVICTIONS = PREFIX + "lora_evictions_total"  # label tier: slot | cpu
LORA_REQUESTS = PREFIX + "lora_requests_total"  # labels adapter (capped; "other" beyond), outcome
LORA_REQUESTS_GOOD = PREFIX + "lora_requests_good_total"  # label adapter
LORA_LOADING = PREFIX + "lora_loading"  # labels model, adapter: 1 while a name not yet served loads

# the operator's autoscaler series, read by the dashboards (and by HPA/KEDA in those modes)
AUTOSCALER_DESIRED_REPLICAS = PREFIX + "autoscaler_desired_replicas"
AUTOSCALER_SLO_ATTAINMENT = PREFIX + "autoscaler_slo_attainment_ratio"
AUTOSCALER_SCALE_EVENTS = PREFIX + "autoscaler_scale_events_total"
AUTOSCALER_METRIC_ERRORS = PREFIX + "autoscaler_metric_errors_total"
AUTOSCALER_WRITE_ERRORS = PREFIX + "autoscaler_write_errors_total"
AUTOSCALER_REPLICAS = PREFIX + "autoscaler_replicas"
AUTOSCALER_CAPACITY_PER_REPLICA = PREFIX + "autoscaler_capacity_per_replica"
AUTOSCALER_STARTUP_SECONDS = PREFIX + "autoscaler_startup_seconds"
AUTOSCALER_ARRIVAL_RATE = PREFIX + "autoscaler_arrival_rate"
AUTOSCALER_DISPERSION = PREFIX + "autoscaler_dispersion"  # label kind: arrivals | peakedness | sizes


@dataclass(frozen=True)
class EngineMetrics:
    """One engine's series for each signal the autoscaler and dashboards read.

    A tuple of alternatives is read in order and the first series present wins (an engine that
    renamed a series exports one generation or the other, sometimes both); ``requests`` is summed.
    """

    engine: str
    model_label: str  # the label naming the served model
    requests: tuple[str, ...]  # counters of finished requests, any outcome, summed
    good: str | None  # a counter of requests that met the SLO; None: estimated from the histograms
    failed: tuple[tuple[str, str, tuple[str, ...]], ...]  # (counter, label, values) of unsuccessful requests
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    kv_usage: tuple[str, ...]  # a 0..1 ratio
    ttft: tuple[str, ...]  # histograms, seconds
    tpot: tuple[str, ...]  # per request where the engine has it, else per token
    rejected: tuple[str, ...] = ()  # counters of requests refused before they were queued (429): demand too


ENGINE_METRICS: dict[str, EngineMetrics] = {
    "goodput": EngineMetrics(
        "goodput",
        "model",
        requests=(REQUESTS,),
        good=REQUESTS_GOOD,
        failed=((REQUESTS, "outcome", ("error",)),),
        running=(REQUESTS_RUNNING,),
        waiting=(REQUESTS_WAITING,),
        kv_usage=(KV_CACHE_USAGE,),
        ttft=(TTFT,),
        tpot=(TPOT,),
        rejected=(REQUESTS_REJECTED,),
    ),
    # vLLM 0.32.0 checked by scraping it; older names kept so an upgrade or downgrade breaks nothing
    "vllm": EngineMetrics(
        "vllm",
        "model_name",
        requests=("vllm:request_success_total",),
        good=None,
        failed=(("vllm:request_success_total", "finished_reason", ("abort", "error")),),
        running=("vllm:num_requests_running",),
        waiting=("vllm:num_requests_waiting",),
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ttft=("vllm:time_to_first_token_seconds",),
        # per-request mean TPOT first (vLLM >= 0.11); the older per-token histograms after it
        tpot=(
            "vllm:request_time_per_output_token_seconds",
            "vllm:time_per_output_token_seconds",
            "vllm:inter_token_latency_seconds",
        ),
    ),
    # SGLang counts aborted requests apart from the finished ones
    "sglang": EngineMetrics(
        "sglang",
        "model_name",
        requests=("sglang:num_requests_total", "sglang:num_aborted_requests_total"),
        good=None,
        failed=(("sglang:num_aborted_requests_total", "", ()),),
        running=("sglang:num_running_reqs",),
        waiting=("sglang:num_queue_reqs",),
        kv_usage=("sglang:token_usage",),
        ttft=("sglang:time_to_first_token_seconds",),
        tpot=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
    ),
}

# the gateway's series (labels namespace, service), read by the dashboards and by the autoscaler
# (requests held for a service at zero wake it; the last request's time is its idle signal)
GATEWAY_REQUESTS = PREFIX + "gateway_requests_total"  # label code
GATEWAY_REQUEST_DURATION = PREFIX + "gateway_request_duration_seconds"
GATEWAY_ROUTING_DECISIONS = PREFIX + "gateway_routing_decisions_total"  # label decision
GATEWAY_REQUESTS_WAITING = PREFIX + "gateway_requests_waiting"  # held while the service has no ready replica
GATEWAY_HOLD_DURATION = PREFIX + "gateway_hold_duration_seconds"  # how long held requests waited (cold starts)
GATEWAY_REQUESTS_IN_FLIGHT = PREFIX + "gateway_requests_in_flight"
GATEWAY_LAST_REQUEST = PREFIX + "gateway_last_request_timestamp_seconds"
GATEWAY_ROUTING_DECISION_KINDS = ("affinity", "overflow", "least_load", "random", "retry")
# a replica failing before the client got a byte, the request sent on to another: label reason
GATEWAY_RETRIES = PREFIX + "gateway_retries_total"
GATEWAY_RETRY_REASONS = ("connect", "reset", "unavailable")  # refused; reset before the body's first byte; 503
# requests the gateway itself turned away, unserved: demand the pods never saw, which the autoscaler counts
GATEWAY_REQUESTS_REFUSED = PREFIX + "gateway_requests_refused_total"  # label reason
# held queue full (429); held past the hold limit (503); no replica answered after every attempt (503)
GATEWAY_REFUSAL_REASONS = ("queue_full", "hold_timeout", "upstream_unavailable")

# the gateway's InferencePipeline series (labels namespace, pipeline)
PIPELINE_REQUESTS = PREFIX + "pipeline_requests_total"  # label outcome
PIPELINE_OUTCOMES = ("served", "refused", "filtered", "error")
PIPELINE_REQUESTS_GOOD = PREFIX + "pipeline_requests_good_total"  # met the generate service's SLO end to end
PIPELINE_TTFT = PREFIX + "pipeline_time_to_first_token_seconds"  # arrival to the first text released
PIPELINE_STEP_DURATION = PREFIX + "pipeline_step_duration_seconds"  # labels step, kind
GUARD_BLOCKS = PREFIX + "guard_blocks_total"  # label rule
GUARD_REDACTIONS = PREFIX + "guard_redactions_total"  # label rule
