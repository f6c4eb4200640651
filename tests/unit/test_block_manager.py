from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.sampling import SamplingParams


def seq(tokens: list[int], rid: str = "r") -> Sequence:
    return Sequence.new(rid, tokens, SamplingParams(), 0.0)


def compute_all(bm: BlockManager, s: Sequence) -> None:
    """What a step does once the model has run: tokens are in the cache, full blocks are published."""
    s.num_computed_tokens = s.num_tokens
    bm.commit(s)


def test_allocation_takes_ceil_blocks_and_free_returns_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = seq(list(range(10)))
    assert bm.allocate(s, 10)
    assert len(s.block_table) == 3
    assert bm.num_free_blocks == 5
    bm.free_seq(s)
    assert bm.num_free_blocks == 8
    assert s.block_table == []


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=2, block_size=4)
    s = seq(list(range(12)))
    assert not bm.allocate(s, 12)
    assert bm.num_free_blocks == 2
    assert s.block_table == []


def test_growing_by_one_token_adds_a_block_only_at_a_boundary():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(list(range(4)))
    assert bm.allocate(s, 4)
    s.num_computed_tokens = 4
    s.token_ids.append(99)
    assert bm.allocate(s, 1)
    assert len(s.block_table) == 2
    s.num_computed_tokens = 5
    s.token_ids.append(100)
    assert bm.allocate(s, 1)
    assert len(s.block_table) == 2


def test_shared_prefix_reuses_full_blocks_and_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq(list(range(12)), "a")
    assert bm.allocate(first, 12)
    compute_all(bm, first)
    # same 8 leading tokens, then different ones
    second = seq([*range(8), 50, 51, 52], "b")
    hits = bm.match_prefix(second)
    assert hits == first.block_table[:2]
    assert bm.allocate(second, second.num_tokens - 8, hits)
    assert second.num_computed_tokens == 8
    assert second.block_table[:2] == first.block_table[:2]
    assert bm.blocks[hits[0]].ref_count == 2
    # an identical prompt of exactly three blocks reuses two: its last token must be computed
    third = seq(list(range(12)), "c")
    assert len(bm.match_prefix(third)) == 2


def test_equal_block_after_a_different_parent_is_not_a_hit():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = seq([1, 2, 3, 4, 5, 6, 7, 8, 9], "a")
    bm.allocate(first, 9)
    compute_all(bm, first)
    other = seq([9, 9, 9, 9, 5, 6, 7, 8, 9], "b")
    assert bm.match_prefix(other) == []


def test_freed_blocks_stay_cached_until_handed_out_again_oldest_first():
    bm = BlockManager(num_blocks=3, block_size=4)
    first = seq([*range(8), 0], "a")
    bm.allocate(first, 9)
    compute_all(bm, first)
    bm.free_seq(first)
    assert bm.num_free_blocks == 3
    again = seq([*range(8), 1], "b")
    assert len(bm.match_prefix(again)) == 2
    # a request that needs every block evicts the cached ones
    big = seq(list(range(100, 112)), "c")
    assert bm.allocate(big, 12)
    assert bm.match_prefix(again) == []


def test_prefix_caching_off_never_hits():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    first = seq(list(range(9)), "a")
    bm.allocate(first, 9)
    compute_all(bm, first)
    assert bm.match_prefix(seq(list(range(9)), "b")) == []


def test_usage_reports_the_share_of_blocks_in_use():
    bm = BlockManager(num_blocks=4, block_size=4)
    s = seq(list(range(8)))
    bm.allocate(s, 8)
    assert bm.usage == 0.5
