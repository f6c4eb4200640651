"""The gateway's replica choice: prefix keys, the consistent-hash ring, bounded loads, the policies."""

import random
from collections import Counter

import pytest

from goodput_gateway import routing
from goodput_gateway.routing import Ring, choose, prefix_key, prompt_text

REPLICAS = ("http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000")
SYSTEM = "You are a careful assistant for the billing team. " * 20  # ~1,000 characters


def chat(system: str, user: str) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def test_conversations_sharing_a_long_system_prompt_share_a_key():
    a = prefix_key(prompt_text(chat(SYSTEM, "What is my balance?")))
    b = prefix_key(prompt_text(chat(SYSTEM, "Cancel my order 1234, please.")))
    assert a == b
    assert a != prefix_key(prompt_text(chat(SYSTEM.replace("billing", "support"), "What is my balance?")))


def test_short_prompts_hash_whole_and_a_completion_prompt_counts_too():
    assert prefix_key("hello") != prefix_key("hello there")
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"input": "embed me"}) == "embed me"
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert "hi" in prompt_text(parts)


def test_the_ring_walks_every_replica_once_and_moves_few_keys_when_one_goes():
    ring = Ring(REPLICAS)
    assert sorted(ring.walk(12345)) == sorted(REPLICAS)
    keys = [prefix_key(f"prompt {i}") for i in range(600)]
    before = {k: next(ring.walk(k)) for k in keys}
    shares = Counter(before.values())
    assert min(shares.values()) > 600 / 3 * 0.6, shares  # virtual nodes spread keys roughly evenly
    smaller = Ring(REPLICAS[:2])
    moved = [k for k in keys if before[k] != REPLICAS[2] and next(smaller.walk(k)) != before[k]]
    assert not moved  # only the departed replica's keys find a new home


def test_prefix_policy_keeps_a_prefix_on_its_replica_while_loads_are_even():
    key = prefix_key(SYSTEM)
    home = next(Ring(REPLICAS).walk(key))
    loads = {r: 2.0 for r in REPLICAS}
    choice = choose("prefix", REPLICAS, loads, key)
    assert choice == routing.Choice(home, routing.AFFINITY)


def test_an_overloaded_home_replica_hands_the_request_to_the_next_on_the_ring():
    key = prefix_key(SYSTEM)
    walk = list(Ring(REPLICAS).walk(key))
    loads = {walk[0]: 9.0, walk[1]: 1.0, walk[2]: 0.0}  # mean with this request 11/3; bound ⌈1.25 × 11/3⌉ = 5
    choice = choose("prefix", REPLICAS, loads, key)
    assert choice == routing.Choice(walk[1], routing.OVERFLOW)


def test_bounded_loads_hold_every_replica_within_the_bound_under_one_hot_prefix():
    key = prefix_key(SYSTEM)
    loads = dict.fromkeys(REPLICAS, 0.0)
    for _ in range(30):  # 30 concurrent requests, all with the same prefix
        loads[choose("prefix", REPLICAS, loads, key, epsilon=0.25).replica] += 1
    assert max(loads.values()) <= 13  # ⌈1.25 × 30 / 3⌉
    assert sum(loads.values()) == 30


def test_kv_usage_only_breaks_ties():
    key = prefix_key(SYSTEM)
    home = next(Ring(REPLICAS).walk(key))
    loads = {r: 0.0 for r in REPLICAS}
    loads[home] = 0.9  # nearly full cache, no requests: still its turn
    assert choose("prefix", REPLICAS, loads, key).replica == home
    others = {r: (0.2 if r != home else 0.1) for r in REPLICAS}
    assert choose("least-load", REPLICAS, others, key).replica == home


def test_least_load_picks_the_replica_with_fewest_requests():
    loads = {REPLICAS[0]: 3.0, REPLICAS[1]: 1.0, REPLICAS[2]: 2.0}
    assert choose("least-load", REPLICAS, loads, 0) == routing.Choice(REPLICAS[1], routing.LEAST_LOAD)


def test_random_spreads_and_an_overloaded_pick_loses_its_turn():
    rng = random.Random(7)
    picks = Counter(choose("random", REPLICAS, {}, 0, rng=rng).replica for _ in range(300))
    assert set(picks) == set(REPLICAS)
    loads = {REPLICAS[0]: 10.0, REPLICAS[1]: 0.0, REPLICAS[2]: 0.0}
    decisions = Counter()
    for _ in range(50):
        choice = choose("random", REPLICAS, loads, 0, rng=rng)
        decisions[choice.decision] += 1
        assert choice.replica != REPLICAS[0]
    assert decisions[routing.OVERFLOW] > 0


@pytest.mark.parametrize("policy", routing.POLICIES)
def test_one_replica_always_serves(policy):
    assert choose(policy, REPLICAS[:1], {REPLICAS[0]: 50.0}, 1).replica == REPLICAS[0]
