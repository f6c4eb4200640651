"""Held-aware routing's choice (held_routing.py): the run a runtime would find, device over offload over
none, bounded load, the ring's order for ties, the ring when the index is stale, and scale-out."""

from collections import Counter

from goodput_gateway import routing
from goodput_gateway.held_routing import HELD_DEVICE, HELD_OFFLOAD, Hit, choose_held, hit_of, pick
from goodput_gateway.prompt_digests import PromptBlocks


def key(k: int) -> int:
    return routing.prefix_key(f"conversation {k}")


R = ("http://a:8000", "http://b:8000", "http://c:8000")
D = [f"{i:032x}" for i in range(8)]  # a prompt's 8 block digests


def held(device=(), offload=()):
    return {"device": set(device), "offload": set(offload)}


def test_the_hit_is_the_device_run_then_the_offload_run_after_it():
    assert hit_of(D, held(D[:3], D[3:6])) == Hit(3, 3)
    assert hit_of(D, held(D[1:], D)) == Hit(0, 8)  # the first block is not on the device: the tier serves all
    assert hit_of(D, held(D[:2] + D[3:])) == Hit(2, 0)  # a hole ends the run: later blocks are useless
    assert hit_of(D, held((), D[1:])) == Hit(0, 0)


def test_device_beats_offload_beats_none_and_the_ring_decides_a_miss():
    ring = routing.Ring(R)
    tables = {R[0]: held(D[:4]), R[1]: held((), D[:4]), R[2]: held()}
    loads = dict.fromkeys(R, 0.0)
    out = choose_held(R, loads, D, tables.get, 1, ring)
    assert (out.choice.replica, out.choice.decision, out.result) == (R[0], HELD_DEVICE, "hit")
    tables[R[0]] = held()
    out = choose_held(R, loads, D, tables.get, 1, ring)
    assert (out.choice.replica, out.choice.decision) == (R[1], HELD_OFFLOAD)
    # the offload tier's longer run wins once it outweighs the device's shorter one
    tables[R[0]] = held(D[:1])
    assert choose_held(R, loads, D, tables.get, 1, ring).choice.replica == R[1]
    assert choose_held(R, loads, D, tables.get, 1, ring, offload_weight=0.2).choice.replica == R[0]
    tables = {r: held() for r in R}
    assert choose_held(R, loads, D, tables.get, 1, ring).result == "miss"
    assert choose_held(R, loads, D, lambda r: None, 1, ring).result == "stale"


def test_bounded_load_passes_an_overloaded_holder_over():
    ring = routing.Ring(R)
    tables = {R[0]: held(D), R[1]: held(D[:2]), R[2]: held()}
    loads = {R[0]: 6.0, R[1]: 0.0, R[2]: 0.0}  # bound: ceil(1.25 * 7 / 3) = 3
    out = choose_held(R, loads, D, tables.get, 1, ring)
    assert out.choice.replica == R[1]
    loads[R[1]] = 6.0
    assert choose_held(R, loads, D, tables.get, 1, ring).result == "miss"  # only the one holding none is within


def test_equal_holders_keep_to_the_rings_order():
    ring = routing.Ring(R)
    tables = dict.fromkeys(R, held(D))
    loads = dict.fromkeys(R, 0.0)
    for key in (1, 2**40, 2**63):
        assert choose_held(R, loads, D, tables.get, key, ring).choice.replica == next(ring.walk(key))


def test_pick_falls_back_to_the_ring_with_the_lookups_result():
    ring = routing.Ring(R)
    loads = dict.fromkeys(R, 0.0)
    choice, result = pick("prefix", R, loads, 7, ring, None, lambda r: None)
    assert (choice.replica, result) == (next(ring.walk(7)), "stale")
    choice, result = pick("prefix", R, loads, 7, ring, None, lambda r: held())
    assert result == "no_digests" and choice.decision == routing.AFFINITY
    choice, result = pick("prefix", R, loads, 7, ring, PromptBlocks(4, 3, ()), lambda r: held())
    assert result == "miss"


def test_scale_out_keeps_held_prefixes_with_their_holders_and_the_newcomer_gets_no_herd():
    """100 prefixes held where the ring put them on three replicas; a fourth joins holding nothing. Held
    routing sends every held prefix to its holder (the ring alone would move about a quarter to the
    newcomer, which holds none of them), and new prefixes spread over all four as the ring spreads them."""
    three, four = R, (*R, "http://d:8000")
    ring3, ring4 = routing.Ring(three), routing.Ring(four)
    prompts = {k: [f"{k:08x}{i:024x}" for i in range(6)] for k in range(1, 101)}
    tables = {r: held() for r in four}
    for k, digests in prompts.items():
        tables[next(ring3.walk(key(k)))]["device"].update(digests)
    loads = dict.fromkeys(four, 0.0)
    moved = sum(next(ring4.walk(key(k))) != next(ring3.walk(key(k))) for k in prompts)
    assert 10 < moved < 45  # what the ring alone costs at scale-out
    for k, digests in prompts.items():
        out = choose_held(four, loads, digests, tables.get, key(k), ring4)
        assert out.choice.replica == next(ring3.walk(key(k)))
    fresh = Counter(
        pick("prefix", four, loads, key(k), ring4, PromptBlocks(4, 24, (f"{k:032x}",)), tables.get)[0].replica
        for k in range(1000, 1400)
    )
    assert set(fresh) == set(four) and max(fresh.values()) < 0.45 * 400


def test_the_digest_cache_keys_on_the_prompt_or_on_the_bytes_where_the_body_is_not_given():
    from goodput_gateway.prompt_digests import cache_key

    svc, path = ("ns", "m"), "/v1/completions"
    a = cache_key(svc, path, {"prompt": "x", "max_tokens": 3}, b"one")
    assert a == cache_key(svc, path, {"prompt": "x", "max_tokens": 9, "stream": True}, b"two")
    assert a != cache_key(svc, path, {"prompt": "y"}, b"one")
    assert a != cache_key(("ns", "other"), path, {"prompt": "x"}, b"one")
    assert cache_key(svc, path, {}, b'{"prompt": [1, 2]}') != cache_key(svc, path, {}, b'{"prompt": [1, 3]}')
