"""The dashboard's rows beyond the autoscaler's own: the gateway, the batch API, pipelines, and a
disaggregated service's prefill and decode pools."""

from __future__ import annotations

from typing import Any

from dashboard_panels import GATEWAY, OPERATOR, RATE, RUNTIME, panel, q


def gateway_panels(y: int) -> list[dict[str, Any]]:
    """The goodput-gateway's view: how it routes, what it holds for services at zero, how long clients wait."""
    hold = "goodput_gateway_hold_duration_seconds"
    return [
        panel(
            "Gateway routing decisions",
            [
                q(
                    f"sum by (decision) (rate(goodput_gateway_routing_decisions_total{{{GATEWAY}}}[{RATE}]))",
                    "{{decision}}",
                ),
            ],
            "reqps",
            0,
            y,
            w=8,
            description="affinity: the prompt prefix's own replica; overflow: it was over the load bound; "
            "retry: a replica failed before answering.",
        ),
        panel(
            "Gateway held requests",
            [
                q(f"sum by (service) (goodput_gateway_requests_waiting{{{GATEWAY}}})", "held: {{service}}"),
                q(
                    f'sum by (code) (rate(goodput_gateway_requests_total{{{GATEWAY}, code=~"429|503"}}[{RATE}]))',
                    "refused {{code}}/s",
                ),
            ],
            "short",
            8,
            y,
            w=8,
            description="Requests waiting for a ready replica (a service at zero waking, or between pods).",
        ),
        panel(
            "Gateway cold start (time held)",
            [
                q(f"histogram_quantile({p}, sum by (le) (rate({hold}_bucket{{{GATEWAY}}}[{RATE}])))", f"p{p * 100:g}")
                for p in (0.5, 0.9)
            ],
            "s",
            16,
            y,
            w=8,
            description="How long held requests waited for the first ready replica.",
        ),
    ]


def batch_panels(y: int) -> list[dict[str, Any]]:
    """The batch API: lines waiting and done (every gateway together), how much batch work each service
    is given, and the replicas' online vs batch requests (batch work yields to online)."""
    return [
        panel(
            "Batch lines",
            [
                q("max(goodput_batch_lines_pending)", "pending"),
                q(f"sum by (state) (rate(goodput_batch_requests_total[{RATE}]))", "{{state}}/s"),
            ],
            "short",
            0,
            y,
            w=8,
            description="Lines of running batches not yet done, and lines finished per second.",
        ),
        panel(
            "Batch concurrency (AIMD)",
            [
                q('sum by (service) (goodput_batch_concurrency_limit{service=~"$service"})', "{{service}}"),
            ],
            "short",
            8,
            y,
            w=8,
            step=True,
            description="Lines a service may have in flight: +1 a second while its online requests meet the SLO "
            "and none waits, halved otherwise.",
        ),
        panel(
            "Online vs batch requests",
            [
                q(
                    "sum by (priority) "
                    f'(rate(goodput_requests_by_priority_total{{{RUNTIME}, outcome="success"}}[{RATE}]))',
                    "{{priority}} req/s",
                ),
                q(f"sum by (priority) (goodput_requests_waiting_by_priority{{{RUNTIME}}})", "{{priority}} waiting"),
            ],
            "short",
            16,
            y,
            w=8,
            description="The replicas' finished requests and queue by priority class.",
        ),
    ]


def pipeline_panels(y: int) -> list[dict[str, Any]]:
    """InferencePipelines at the gateway: outcomes, end-to-end goodput, what each step costs, what guards block."""
    sel = 'namespace=~"$namespace", pipeline=~"$pipeline"'
    step = "goodput_pipeline_step_duration_seconds_bucket"
    return [
        panel(
            "Pipeline requests and goodput",
            [
                q(f"sum by (outcome) (rate(goodput_pipeline_requests_total{{{sel}}}[{RATE}]))", "{{outcome}}"),
                q(
                    f"sum(rate(goodput_pipeline_requests_good_total{{{sel}}}[{RATE}]))",
                    "goodput (met the SLO end to end)",
                ),
            ],
            "reqps",
            0,
            y,
            w=8,
            description="served, refused (an input guard), filtered (an output guard ended the stream), error; "
            "goodput counts guards' time against the generate service's TTFT target.",
        ),
        panel(
            "Pipeline step latency (p90)",
            [
                q(
                    f"histogram_quantile(0.9, sum by (le, step, kind) (rate({step}{{{sel}}}[{RATE}])))",
                    "{{step}} ({{kind}})",
                ),
                q(
                    f"histogram_quantile(0.9, sum by (le) (rate(goodput_pipeline_time_to_first_token_seconds_bucket"
                    f"{{{sel}}}[{RATE}])))",
                    "end-to-end TTFT",
                ),
            ],
            "s",
            8,
            y,
            w=8,
            description="Rules take microseconds; a classifier one short forward pass; generate is its TTFT.",
        ),
        panel(
            "Guard blocks by rule",
            [
                q(f"sum by (rule) (rate(goodput_guard_blocks_total{{{sel}}}[{RATE}]))", "blocked: {{rule}}"),
                q(f"sum by (rule) (rate(goodput_guard_redactions_total{{{sel}}}[{RATE}]))", "redacted: {{rule}}"),
            ],
            "reqps",
            16,
            y,
            w=8,
        ),
    ]


def pool_panels(y: int) -> list[dict[str, Any]]:
    """A disaggregated service (spec.disaggregation): a row per pool, each against its own target, and the
    hand-off between them. The prefill pool is sized on prompt tokens/s against TTFT net of the hand-off,
    the decode pool on output tokens/s against TPOT and on KV memory."""
    rows: list[dict[str, Any]] = []
    for i, (pool, tokens, target) in enumerate(
        (("prefill", "prompt", "TTFT net of the hand-off"), ("decode", "output", "TPOT"))
    ):
        sel = f'{OPERATOR}, pool="{pool}"'
        row = y + 8 * i
        rows += [
            panel(
                f"{pool.capitalize()} pool: replicas",
                [
                    q(
                        f'sum by (name) (goodput_autoscaler_pool_replicas{{{sel}, kind="desired"}})',
                        "desired: {{name}}",
                    ),
                    q(f'sum by (name) (goodput_autoscaler_pool_replicas{{{sel}, kind="ready"}})', "ready: {{name}}"),
                ],
                "short",
                0,
                row,
                w=8,
                step=True,
                description=f"The {pool} pool's replicas: what the autoscaler wants and what serves. "
                "status.autoscaler.pools and the Events name the term that decided.",
            ),
            panel(
                f"{pool.capitalize()} pool: {tokens} tokens/s, demand vs capacity",
                [
                    q(f"sum by (name) (goodput_autoscaler_pool_demand_tokens_per_second{{{sel}}})", "demand: {{name}}"),
                    q(
                        f"max by (name) (goodput_autoscaler_pool_capacity_tokens_per_second{{{sel}}})"
                        f" * on (namespace, name) group_left sum by (namespace, name) "
                        f'(goodput_autoscaler_pool_replicas{{{sel}, kind="ready"}})',
                        "learnt capacity × ready: {{name}}",
                    ),
                ],
                "short",
                8,
                row,
                w=8,
                description=f"{tokens.capitalize()} tokens per second asked of the pool, against what its ready "
                "replicas serve within the target at the learnt capacity per replica.",
            ),
            panel(
                f"{pool.capitalize()} pool: attainment of {target}",
                [q(f"goodput_autoscaler_pool_attainment{{{sel}}}", "{{name}}")],
                "percentunit",
                16,
                row,
                w=8,
                threshold=0.9,
                description=f"Share of the pool's recent requests within its own target ({target}); a miss with "
                f"requests queued wakes the {pool} pool's guard.",
            ),
        ]
    handoff = "goodput_kv_transfer_seconds_bucket"
    rows += [
        panel(
            "Hand-off: paths and added time",
            [
                q(
                    f"sum by (path) (rate(goodput_gateway_disaggregation_total{{{GATEWAY}}}[{RATE}]))",
                    "{{path}}",
                ),
                q(
                    f'histogram_quantile(0.9, sum by (le) (rate({handoff}{{{RUNTIME}, role="decode"}}[{RATE}])))',
                    "p90 KV pull (s)",
                ),
            ],
            "short",
            0,
            y + 16,
            w=12,
            description="The gateway's paths (disaggregated, local: under the threshold, fallback: the prefill "
            "phase failed) and the decode side's pull of the KV blocks, which the prefill pool's TTFT budget is "
            "net of.",
        ),
        panel(
            "Hand-off: failures and bytes",
            [
                q(f"sum by (reason) (rate(goodput_kv_transfer_failures_total{{{RUNTIME}}}[{RATE}]))", "{{reason}}"),
                q(f"sum(rate(goodput_kv_transfer_bytes_total{{{RUNTIME}}}[{RATE}]))", "bytes/s"),
            ],
            "short",
            12,
            y + 16,
            w=12,
            description="Failed hand-offs by reason (each served by local recompute or failed, per "
            "--kv-failure-policy) and the bytes moved.",
        ),
    ]
    return rows
