"""The peer pull's plan (peer_pull.py): which holder the chosen replica pulls a prompt's prefix from."""

from goodput_gateway.peer_pull import Plan, plan

R = ("http://a:8000", "http://b:8000", "http://c:8000")
D = [f"{i:032x}" for i in range(12)]  # a prompt's 12 block digests


def held(device=(), offload=()):
    return {"device": set(device), "offload": set(offload)}


def test_the_holder_with_the_longest_device_run_lends_what_the_chosen_replica_lacks():
    index = {R[0]: held(D[:10]), R[1]: held(D[:2]), R[2]: held(D[:6])}
    assert plan(R[1], R, D, index.get, 4) == Plan(R[0], 10, 2)


def test_the_chosen_replicas_offload_run_counts_as_held():
    index = {R[0]: held(D[:10]), R[1]: held(D[:2], D[2:8])}
    assert plan(R[1], R, D, index.get, 4) is None  # 10 - 8 < 4
    assert plan(R[1], R, D, index.get, 2) == Plan(R[0], 10, 8)


def test_a_new_replica_unknown_to_the_index_pulls_from_a_holder():
    index = {R[0]: held(D[:5])}
    assert plan(R[2], R, D, index.get, 4) == Plan(R[0], 5, 0)


def test_no_pull_below_the_minimum_or_from_an_offload_tier_or_a_stale_replica():
    assert plan(R[1], R, D, {R[0]: held(D[:3]), R[1]: held()}.get, 4) is None
    assert plan(R[1], R, D, {R[0]: held((), D), R[1]: held()}.get, 4) is None  # offload only: not lent
    assert plan(R[1], R, D, {R[1]: held()}.get, 4) is None  # the holder's index is stale (None)
