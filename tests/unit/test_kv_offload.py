"""The KV offload tier's store (engine/kv_offload.py): exact entries back, the byte bound, and
entries that are gone, corrupt or truncated never served.

Real files on local disk; no model. The engine with the tier on is tested in
tests/runtime/test_kv_offload_engine.py.
"""

from __future__ import annotations

import os

import pytest

from goodput_runtime.engine.kv_offload import HEADER, OffloadStore, ReloadPolicy

ENTRY = 256


def payload(i: int) -> bytes:
    return bytes((i * 7 + k) % 251 for k in range(ENTRY))


@pytest.fixture
def store(tmp_path):
    s = OffloadStore(str(tmp_path), 4 * (HEADER.size + ENTRY) + 10, ENTRY)
    yield s
    s.close()


def test_entries_come_back_exactly_and_the_oldest_goes_first(store):
    for i in range(6):
        store.put(i, payload(i))
    assert store.num_slots == 4
    assert sorted(store.digests()) == [2, 3, 4, 5]  # 0 and 1, least recently used, were evicted
    assert store.get(0) is None
    assert store.get(3) == payload(3)
    store.put(6, payload(6))  # evicts 2: 3 was just used
    assert sorted(store.digests()) == [3, 4, 5, 6]
    assert all(store.get(i) == payload(i) for i in (3, 4, 5, 6))
    assert store.stats.evicted_blocks == 3


def test_the_byte_bound_holds_on_disk_and_in_the_count(tmp_path):
    bound = 10 * (HEADER.size + ENTRY) - 1  # room for 9 entries, not 10
    s = OffloadStore(str(tmp_path), bound, ENTRY)
    try:
        for i in range(50):
            assert s.save_async(i, payload(i))
        s.flush()
        assert len(s) == 9
        assert s.used_bytes <= bound
        assert os.path.getsize(s.path) <= bound
    finally:
        s.close()
    assert not os.path.exists(s.path)  # closing removes the file


def test_a_bound_below_one_block_is_refused(tmp_path):
    with pytest.raises(ValueError, match="holds no block"):
        OffloadStore(str(tmp_path), HEADER.size + ENTRY - 1, ENTRY)


def test_a_corrupt_entry_is_detected_dropped_and_never_served(store):
    store.put(1, payload(1))
    store.put(2, payload(2))
    slot = store.index[1]
    with open(store.path, "r+b") as f:
        f.seek(slot * store.slot_bytes + HEADER.size + 100)
        f.write(b"\xff\xfe")  # two bytes flipped inside the payload
    assert store.get(1) is None
    assert store.stats.corrupt == 1
    assert not store.contains(1)  # dropped: the next lookup is a plain miss
    assert store.get(2) == payload(2)  # the others are untouched


def test_an_entry_under_another_digest_is_not_served(store):
    store.put(1, payload(1))
    store.put(2, payload(2))
    store.index[1], store.index[2] = store.index[2], store.index[1]  # slots crossed
    assert store.get(1) is None and store.get(2) is None
    assert store.stats.corrupt == 2


def test_a_truncated_file_is_detected_and_never_served(store):
    for i in range(3):
        store.put(i, payload(i))
    last = max(store.index, key=store.index.__getitem__)
    os.truncate(store.path, store.index[last] * store.slot_bytes + HEADER.size + ENTRY // 2)
    assert store.get(last) is None
    assert store.stats.corrupt == 1
    others = [i for i in range(3) if i != last]
    assert all(store.get(i) == payload(i) for i in others)


def test_a_wrong_sized_block_is_refused(store):
    with pytest.raises(ValueError, match="bytes"):
        store.put(1, b"x" * (ENTRY - 1))


def test_the_policy_loads_only_when_predicted_faster_than_prefill(store):
    policy = ReloadPolicy(store)
    assert policy.should_load(4, 16)  # nothing measured yet: load, which measures it
    store.stats.reload_bytes, store.stats.reload_seconds = 100 * ENTRY, 1.0  # 100 blocks/s
    policy.observe_prefill(16 * 1000, 1.0)  # 1000 blocks' tokens/s: prefill is faster
    assert not policy.should_load(4, 16)
    policy.prefill_tokens_per_s = 16 * 10.0  # 10 blocks/s: loading is faster
    assert policy.should_load(4, 16)


def test_a_block_loaded_and_handed_out_again_before_its_step_is_neither_loaded_nor_saved(tmp_path):
    """A request admitted with loaded blocks and preempted in the same step gives them back before
    their payloads reach the cache: the next owner must not get the payload, nor the tier a copy."""
    from goodput_runtime.engine.block_manager import BlockManager, block_hash
    from goodput_runtime.engine.sequence import Sequence
    from goodput_runtime.sampling import SamplingParams

    bm = BlockManager(4, 4, model_salt="m")
    bm.offload = OffloadStore(str(tmp_path), 8 * (HEADER.size + ENTRY), ENTRY)
    try:
        prompt = list(range(1, 10))
        seq = Sequence.new("a", prompt, SamplingParams(), 0.0)
        first = block_hash(bm.root(seq), tuple(prompt[:4]))
        second = block_hash(first, tuple(prompt[4:8]))
        bm.offload.put(first, payload(1))
        bm.offload.put(second, payload(2))
        loads = bm.match_offloaded(seq, 0)
        assert [h for h, _ in loads] == [first, second]
        assert bm.allocate(seq, 1, [], loads)
        assert seq.num_computed_tokens == 8 and len(bm.pending_loads) == 2
        bm.free_seq(seq)  # preempted before the step ran
        other = Sequence.new("b", list(range(100, 116)), SamplingParams(), 0.0)
        assert bm.allocate(other, 16)  # every block, the two loaded ones included
        assert bm.take_transfers() == ([], [])
    finally:
        bm.offload.close()
