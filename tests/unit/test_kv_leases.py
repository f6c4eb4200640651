"""The prefill side's leases (engine/kv_transfer/leases.py) on a real block manager, and the hand-off
fields' parse (engine/kv_transfer/params.py): a lease keeps exactly the full prompt blocks, gives them
back on release or expiry (counted), and never leaks a block; a malformed hand-off names its field."""

from __future__ import annotations

import pytest

from goodput_runtime.engine import prefix_digest
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.kv_transfer.leases import LeaseTable
from goodput_runtime.engine.kv_transfer.params import HandoffParams, ParamsError, layout_digest
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.sampling import SamplingParams


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prefilled(bm: BlockManager, request_id: str, prompt: list[int]) -> Sequence:
    """A sequence whose prompt is computed and whose first token is sampled, as at a prefill phase's end."""
    seq = Sequence.new(request_id, prompt, SamplingParams(max_tokens=1), 0.0)
    assert bm.allocate(seq, len(prompt))
    seq.num_computed_tokens = len(prompt)
    bm.commit(seq)
    seq.token_ids.append(7)
    return seq


def test_a_lease_holds_the_full_prompt_blocks_until_released_or_expired():
    bm = BlockManager(num_blocks=16, block_size=4, model_salt="m")
    clock = Clock()
    expired: list[int] = []
    leases = LeaseTable(bm, 5.0, clock=clock)
    leases.on_expired = expired.append
    a = prefilled(bm, "a", list(range(10, 21)))  # 11 tokens: two full blocks and a partial one
    held = bm.num_free_blocks
    leases.hold(a)
    assert leases.get("a") is not None and len(leases.get("a").block_ids) == 2  # type: ignore[union-attr]
    assert bm.num_free_blocks == held + 1 and leases.num_blocks == 2 and a.block_table == []
    digests = leases.get("a").digests  # type: ignore[union-attr]
    first = prefix_digest.block_digest(bm.root(a), (10, 11, 12, 13))
    assert digests[0] == prefix_digest.to_bytes(first).hex()
    assert leases.release("a") and not leases.release("a")
    assert bm.num_free_blocks == 16

    b = prefilled(bm, "b", list(range(30, 39)))
    leases.hold(b)
    clock.now += 4.9
    assert leases.reap() == 0 and bm.num_free_blocks < 16
    clock.now += 0.2
    assert leases.get("b") is None  # past its time: ended on sight
    assert expired == [1] and leases.expired == 1 and bm.num_free_blocks == 16


def test_a_leased_block_shared_with_a_running_request_stays_with_it():
    bm = BlockManager(num_blocks=16, block_size=4, model_salt="m")
    leases = LeaseTable(bm, 5.0)
    prompt = list(range(50, 59))
    a = prefilled(bm, "a", prompt)
    leases.hold(a)
    b = Sequence.new("b", prompt, SamplingParams(max_tokens=4), 0.0)
    hits = bm.match_prefix(b)
    assert len(hits) == 2 and bm.allocate(b, len(prompt) - 8, hits)
    leases.release("a")
    assert all(bm.blocks[i].ref_count == 1 for i in b.block_table)  # b's hold remains
    bm.free_seq(b)
    assert bm.num_free_blocks == 16


def params(**change) -> dict:
    base = HandoffParams("e", "127.0.0.1", 8001, "r", [3, 4], 32, "ab" * 16, 30.0, ["0" * 32, "f" * 32]).as_dict()
    return {**base, **change}


def test_hand_off_fields_parse_and_name_what_is_wrong():
    parsed = HandoffParams.parse(params())
    assert parsed.remote_block_ids == [3, 4] and parsed.as_dict()["do_remote_prefill"] is True
    for bad, field in (
        ({"remote_port": 0}, "remote_port"),
        ({"remote_block_ids": [1, "x"]}, "remote_block_ids"),
        ({"block_digests": ["0" * 32]}, "block_digests"),
        ({"block_digests": ["z" * 32, "0" * 32]}, "block_digests"),
        ({"remote_host": None}, "remote_host"),
        ({"num_tokens": True}, "num_tokens"),
    ):
        with pytest.raises(ParamsError, match=field):
            HandoffParams.parse(params(**bad))


def test_the_layout_digest_names_every_part_of_a_blocks_meaning():
    base = ("model=m", "float32", 30, 3, 64, 16)
    digest = layout_digest(*base)
    assert digest == layout_digest(*base) and len(digest) == 32
    for i, other in enumerate(("model=n", "bfloat16", 31, 4, 32, 8)):
        changed = list(base)
        changed[i] = other
        assert layout_digest(*changed) != digest
