"""From the spec to the law's Policy, and what the loop's writes share: its field manager, its failure."""

from __future__ import annotations

from goodput_contract.api.spec import ServiceSpec
from goodput_operator.autoscaling.state import Policy

FIELD_MANAGER = "goodput-autoscaler"


def policy_for(svc: ServiceSpec) -> tuple[Policy, float | None]:
    """The law's policy from the spec, and the configured starting capacity per replica (requests/s)."""
    a = svc.autoscaling
    policy = Policy(
        min_replicas=a.min_replicas,
        max_replicas=a.max_replicas,
        attainment_target=svc.slo.attainment,
        ttft_target=svc.slo.ttft_seconds,
        tpot_target=svc.slo.tpot_seconds,
        target_utilization=a.target_utilization,
        scale_down_window=a.scale_down_window_seconds,
        idle_period=a.idle_period_seconds,
        batch_max_replicas=svc.batch.max_replicas,
    )
    return policy, a.capacity_per_replica


class WriteFailed(Exception):
    """The API server refused or did not answer a write of replicas or status (counted apart from reads)."""
