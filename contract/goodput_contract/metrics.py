"""Series names shared by the runtime (which exports them), the autoscaler and the dashboards (which read them).

Names follow Prometheus conventions with the ``goodput_`` prefix; each runtime series carries the
label ``model``. vLLM exports the same signals under ``vllm:``; ``ENGINE_ALIASES`` maps them.
"""

from __future__ import annotations

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

# the operator's autoscaler series, read by the dashboards (and by HPA/KEDA in those modes)
AUTOSCALER_DESIRED_REPLICAS = PREFIX + "autoscaler_desired_replicas"
AUTOSCALER_SLO_ATTAINMENT = PREFIX + "autoscaler_slo_attainment_ratio"
AUTOSCALER_SCALE_EVENTS = PREFIX + "autoscaler_scale_events_total"
AUTOSCALER_METRIC_ERRORS = PREFIX + "autoscaler_metric_errors_total"
AUTOSCALER_WRITE_ERRORS = PREFIX + "autoscaler_write_errors_total"
AUTOSCALER_REPLICAS = PREFIX + "autoscaler_replicas"
AUTOSCALER_CAPACITY_PER_REPLICA = PREFIX + "autoscaler_capacity_per_replica"

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

# another engine's prefix -> ours, for the same signal
ENGINE_ALIASES = {"vllm:": PREFIX}
