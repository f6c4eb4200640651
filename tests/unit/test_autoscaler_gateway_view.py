"""What the autoscaler reads from the gateway pods' /metrics, as the gateway's own series write it, and
how that demand joins the pods' signals."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from goodput_gateway.batch.dispatcher import BatchMetrics
from goodput_gateway.metrics import GatewayMetrics
from goodput_operator.autoscaling.gateway import (
    GatewayView,
    RefusalRate,
    merge,
    parse_gateway_metrics,
    with_gateway_demand,
)
from goodput_operator.autoscaling.law import decide
from goodput_operator.autoscaling.state import Memory, Observation, Policy, Signals


def gateway_text(pending: dict[tuple[str, str], int]) -> str:
    registry = CollectorRegistry()
    metrics = BatchMetrics(registry)
    metrics.pending.set(sum(pending.values()))
    for key, count in pending.items():
        metrics.service_pending.labels(*key).set(count)
    return generate_latest(registry).decode()


def test_pending_batch_lines_are_read_per_service_and_gateways_sharing_a_store_are_not_double_counted():
    one = parse_gateway_metrics(gateway_text({("team-a", "chat"): 700, ("team-b", "embed"): 0}))
    assert one[("team-a", "chat")].batch_pending == 700
    assert one[("team-b", "embed")].batch_pending == 0
    # a second gateway pod reads the same shared store a moment later
    merged = merge([one, parse_gateway_metrics(gateway_text({("team-a", "chat"): 690}))])
    assert merged[("team-a", "chat")] == GatewayView(held=0, last_request=None, batch_pending=700)
    assert merged.get(("team-c", "other"), GatewayView()).batch_pending == 0


def refusing_gateway(refusals: dict[str, int], held: int = 0) -> str:
    """The /metrics of a gateway pod that turned away requests for team-a/chat, as its own series write it."""
    metrics = GatewayMetrics()
    metrics.service_seen("team-a", "chat")
    for reason, count in refusals.items():
        metrics.refused.labels("team-a", "chat", reason).inc(count)
    metrics.waiting.labels("team-a", "chat").set(held)
    return generate_latest(metrics.registry).decode()


def test_requests_the_gateways_turned_away_are_summed_over_reasons_and_pods():
    one = parse_gateway_metrics(refusing_gateway({"queue_full": 30, "hold_timeout": 2}, held=5))
    two = parse_gateway_metrics(refusing_gateway({"upstream_unavailable": 1}, held=3))
    merged = merge([one, two])[("team-a", "chat")]
    assert (merged.refused, merged.held) == (33, 8)


def test_the_refusal_rate_is_the_counter_over_the_window_and_survives_a_gateway_restart():
    rate = RefusalRate()
    assert rate.observe(0.0, 100.0, window=60) == 0.0  # one reading: no rate yet
    assert rate.observe(15.0, 130.0, window=60) == pytest.approx(2.0)
    assert rate.observe(30.0, 160.0, window=60) == pytest.approx(2.0)
    assert rate.observe(90.0, 160.0, window=60) == pytest.approx(0.0)  # none turned away for a minute
    assert rate.observe(105.0, 10.0, window=60) == 0.0  # a gateway pod restarted: its counter began again
    assert rate.observe(120.0, 40.0, window=60) == pytest.approx(2.0)


POLICY = Policy(min_replicas=1, max_replicas=10, attainment_target=0.95, ttft_target=0.5, scale_down_window=300)
KNOWN = Memory(capacity_per_replica=4.0)


def test_demand_only_the_gateway_saw_scales_the_service_up():
    """Two replicas serve their own load within the SLO, but the gateway holds requests and turns
    others away: the pods cannot see that demand, the autoscaler does."""
    pods = Signals(arrival_rate=4.0, attainment=0.99, arrival_rate_now=4.0)
    alone = decide(POLICY, Observation(1000.0, 2, 2, pods), KNOWN)
    assert alone.desired == 2
    seen = with_gateway_demand(pods, held=6, refused_rate=6.0)
    assert (seen.arrival_rate, seen.arrival_rate_now, seen.waiting) == (10.0, 10.0, 6)
    decision = decide(POLICY, Observation(1000.0, 2, 2, seen, held=6), KNOWN)
    assert decision.desired == 4 and decision.cause == "capacity", decision
    assert "6 queued" in decision.reason
    assert with_gateway_demand(pods, held=0, refused_rate=0.0) is pods
