"""What the autoscaler reads from the gateway pods' /metrics, as the gateway's own gauges write it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from goodput_gateway.batch.dispatcher import BatchMetrics
from goodput_operator.autoscaling.gateway import GatewayView, merge, parse_gateway_metrics


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
