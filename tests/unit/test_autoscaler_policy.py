"""The law's policy as a user writes it in spec.slo and spec.autoscaling."""

import pytest

from goodput_contract.api.spec import SpecError, parse
from goodput_operator.autoscaling.loop import policy_for

BASE = {"model": {"source": "hf://org/model"}, "resources": {"gpu": 1}}


def test_slo_and_bounds_come_from_the_spec():
    raw = {
        **BASE,
        "slo": {"ttft": "500ms", "tpot": "50ms", "attainment": 0.99},
        "autoscaling": {
            "mode": "goodput",
            "minReplicas": 2,
            "maxReplicas": 9,
            "scaleDownWindow": "2m",
            "capacityPerReplica": 3.5,
            "targetUtilization": 0.7,
        },
    }
    policy, capacity = policy_for(parse("chat", "ns", raw))
    assert (policy.min_replicas, policy.max_replicas, policy.scale_down_window) == (2, 9, 120.0)
    assert (policy.attainment_target, policy.ttft_target, policy.tpot_target) == (0.99, 0.5, 0.05)
    assert (policy.target_utilization, capacity, policy.idle_period) == (0.7, 3.5, None)


def test_defaults_plan_for_80_percent_and_learn_capacity():
    raw = {**BASE, "autoscaling": {"mode": "goodput", "maxReplicas": 3}}
    policy, capacity = policy_for(parse("chat", "ns", raw))
    assert (policy.target_utilization, capacity) == (0.8, None)


def test_idle_period_is_what_lets_min_zero_reach_zero():
    raw = {**BASE, "autoscaling": {"mode": "goodput", "minReplicas": 0, "maxReplicas": 3, "idlePeriod": "15m"}}
    policy, _ = policy_for(parse("chat", "ns", raw))
    assert policy.idle_period == 900.0


def test_a_bad_idle_period_is_a_spec_error_naming_the_field():
    raw = {**BASE, "autoscaling": {"mode": "goodput", "minReplicas": 0, "maxReplicas": 3, "idlePeriod": "soon"}}
    with pytest.raises(SpecError) as err:
        parse("chat", "ns", raw)
    assert err.value.field == "spec.autoscaling.idlePeriod"
