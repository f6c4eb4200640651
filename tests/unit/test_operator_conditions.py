"""Conditions follow the API conventions: transition time moves only on flips, Ready is derived."""

from goodput_operator.conditions import (
    AVAILABLE,
    FALSE,
    MODEL_FITS,
    READY,
    TRUE,
    UNKNOWN,
    VALID,
    Condition,
    derive_ready,
    find,
    merge,
)


def test_transition_time_moves_only_when_status_flips():
    first = merge(None, [Condition(VALID, TRUE, "SpecValid")], 1, "2026-01-01T00:00:00Z")
    again = merge(first, [Condition(VALID, TRUE, "SpecValid", "new message")], 2, "2026-01-01T00:05:00Z")
    assert again[0]["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert again[0]["observedGeneration"] == 2 and again[0]["message"] == "new message"
    flipped = merge(again, [Condition(VALID, FALSE, "InvalidSpec")], 3, "2026-01-01T00:09:00Z")
    assert flipped[0]["lastTransitionTime"] == "2026-01-01T00:09:00Z"


def test_ready_needs_a_valid_spec_and_serving_pods():
    valid = Condition(VALID, TRUE, "SpecValid")
    available = Condition(AVAILABLE, TRUE, "MinimumReplicasAvailable", "2/2 replicas ready")
    assert derive_ready([valid, available, Condition(MODEL_FITS, UNKNOWN, "GPUMemoryUnknown")]).status == TRUE
    # the fit is an estimate: pods that serve are Ready even when it says otherwise
    too_big = Condition(MODEL_FITS, FALSE, "ModelTooLarge", "weights 15 GiB")
    assert derive_ready([valid, available, too_big]) == Condition(READY, TRUE, "Serving", "2/2 replicas ready")
    invalid = Condition(VALID, FALSE, "ReplicaBoundsInverted")
    assert derive_ready([invalid, available]).reason == "ReplicaBoundsInverted"
    waiting = Condition(AVAILABLE, FALSE, "ReplicasNotReady", "0/1 replicas ready")
    assert derive_ready([valid, waiting]).reason == "ReplicasNotReady"


def test_conditions_are_listed_ready_first_and_found_by_type():
    merged = merge(
        None, [Condition(AVAILABLE, FALSE, "X"), Condition(VALID, TRUE, "Y"), Condition(READY, FALSE, "X")], 1, "t"
    )
    assert [c["type"] for c in merged] == [READY, VALID, AVAILABLE]
    assert find(merged, VALID)["reason"] == "Y"
    assert find(merged, MODEL_FITS) is None


def test_kstatus_conditions_follow_the_service_toward_its_spec():
    from goodput_operator.conditions import RECONCILING, STALLED, derive_kstatus

    valid = Condition(VALID, TRUE, "SpecValid")

    def read(available: Condition, replicas: int, ready: int, desired: int) -> tuple[str, str]:
        by_type = {c.type: c for c in derive_kstatus([valid, available], replicas, ready, desired)}
        return by_type[RECONCILING].status, by_type[STALLED].status

    serving = Condition(AVAILABLE, TRUE, "MinimumReplicasAvailable")
    assert read(serving, 2, 2, 2) == ("False", "False")  # where the spec asks
    assert read(serving, 3, 2, 3) == ("True", "False")  # scaling up: one pod not ready yet
    assert read(serving, 3, 3, 2) == ("True", "False")  # scaling down: a pod still draining
    assert read(Condition(AVAILABLE, FALSE, "RuntimeFailing"), 1, 0, 1) == ("False", "True")
    assert read(Condition(AVAILABLE, FALSE, "ReplicasNotReady"), 1, 0, 1) == ("True", "False")
    assert read(Condition(AVAILABLE, FALSE, "ScaledToZero"), 0, 0, 0) == ("False", "False")
    invalid = derive_kstatus([Condition(VALID, FALSE, "InvalidSpec", "spec.x: bad")], 0, 0, 0)
    assert [(c.type, c.status, c.reason) for c in invalid][1] == (STALLED, "True", "InvalidSpec")
