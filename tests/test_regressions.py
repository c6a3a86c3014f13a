"""Named regression tests: one per bug found (the sanitizer run in .ci/run covers the UB ones)."""

import numpy as np
import pytest
from helpers import compute

import kvblocks
from kvblocks import (
    BlockManager,
    BlockPool,
    BlockStored,
    InvalidArgumentError,
    InvalidStateError,
    UnknownSequenceError,
)


def test_fork_and_metadata_of_an_empty_sequence():
    """UBSan: memcpy(dst, NULL, 0) in kvb_mgr_fork and the metadata writer (then kvb_mgr_metadata) for a sequence with
    no tokens and no blocks (fixed with kvb_copy)."""
    mgr = BlockManager(8, 4, num_host_blocks=4)
    mgr.add("e", [])
    mgr.fork("e", "f")
    meta = mgr.metadata(["e", "f"], [0, 0])
    assert meta.kv_indptr.tolist() == [0, 0, 0] and meta.kv_last_page_len.tolist() == [0, 0]
    assert mgr.swap_out("f").shape == (0, 2)
    assert mgr.swap_in("f").shape == (0, 2)
    mgr.append("f", [1, 2])
    assert mgr.block_table("f").tolist() == [1]
    mgr.check()


def test_take_events_groups_a_chain():
    """take_events indexed cur.block_hashes[-1] under wraparound=False (undefined in Cython):
    it crashed on the second stored block of a chain."""
    mgr = BlockManager(16, 4, enable_kv_events=True)
    mgr.add("a", np.arange(12, dtype=np.int32))
    compute(mgr, "a")
    (ev,) = mgr.pool.take_events()
    assert isinstance(ev, BlockStored) and len(ev.block_hashes) == 3
    assert ev.token_ids == list(range(12))


def test_append_batch_validates_in_order():
    """Found by the state machine: a swapped sequence listed before a duplicate reports the
    swap (the C core validates element by element); both leave the state unchanged."""
    mgr = BlockManager(8, 1, num_host_blocks=4)
    mgr.add(1, [5])
    mgr.swap_out(1)
    with pytest.raises(InvalidStateError):
        mgr.append_batch([1, 1], [0, 0])
    mgr.check()


def test_pending_copy_into_a_released_block_is_dropped():
    """Found while writing examples/engine_loop.py: a copy-on-write copy still pending when
    its sequence was freed kept naming the released dst block; once reallocated, the late
    copy would overwrite its new owner's KV. Such copies are now dropped."""
    mgr = BlockManager(8, 4)
    mgr.add("a", [1, 2, 3, 4, 5])
    mgr.fork("a", "b")
    mgr.append("b", [6])  # copy-on-write of the shared partial block
    assert mgr.num_pending_copies == 1
    mgr.free("b")  # its private copy is released
    assert mgr.num_pending_copies == 0 and mgr.take_copies().shape == (0, 2)
    mgr.fork("a", "c")
    mgr.append("c", [7])
    mgr.truncate("c", 4)  # the copied block is released again
    assert mgr.num_pending_copies == 0
    mgr.check()


def test_can_add_counts_partial_blocks():
    """blocks_for_tokens rounded down (-(-n // bs) under cdivision): can_add said yes to a
    prompt that add then refused."""
    mgr = BlockManager(3, 4)  # 2 usable blocks
    assert mgr.blocks_for_tokens(5) == 2 and mgr.blocks_for_tokens(8) == 2
    assert not mgr.can_add(9)
    assert mgr.can_add(8)
    mgr.add("a", list(range(8)))
    assert mgr.pool.usage == 1.0


def test_huge_int_ids_are_unknown_not_overflow():
    """The small-int fast path of append_batch used PyLong_AsLong, which raised
    OverflowError for ids beyond a C long instead of UnknownSequenceError."""
    mgr = BlockManager(8, 4)
    mgr.add(2**70, [1])
    mgr.append_batch([2**70], [2])
    assert mgr.num_tokens(2**70) == 2
    with pytest.raises(UnknownSequenceError):
        mgr.append_batch([2**71], [3])
    with pytest.raises(UnknownSequenceError):
        mgr.append_batch([-5], [3])
    mgr.add(-5, [1])
    mgr.append_batch([-5, 2**70], [3, 4])
    mgr.check()


def test_cache_validates_repeated_blocks_in_linear_time():
    """BlockPool.cache compared every pair of ids to find a block given twice (quadratic:
    0.66 ms for 2,048 blocks); it now marks blocks in one pass and clears the marks."""
    pool = BlockPool(8)
    h = kvblocks.hash_blocks(list(range(8)), 4)
    b = pool.allocate(2)
    with pytest.raises(InvalidArgumentError):
        pool.cache([b[0], b[1], b[0]], [h[0], h[1], h[1]])  # b[0] under two hashes
    assert pool.num_cached == 0
    pool.check()  # no mark left behind
    assert pool.cache([b[0], b[0], b[1]], [h[0], h[0], h[1]]) == 2  # same hash twice is fine
    pool.check()


@pytest.mark.parametrize("batch", [False, True])
def test_two_window_groups_releasing_do_not_saturate_the_block_count(batch):
    """groups.c summed growth with add_sat after subtracting the first window group's release
    gain: with the count negative, add_sat's overflow check saturated it to INT64_MAX, so an
    append that releases a block in two or more window groups without growing failed with
    "need 9223372036854... blocks" (found by the simulator's Gemma-3 preset, 26 window groups)."""
    w = kvblocks.KVGroup("sliding_window", window=6)
    mgr = BlockManager(13, 4, groups=(kvblocks.KVGroup("full"), w, w))
    mgr.add("a", list(range(12)))  # 3 blocks per group
    mgr.schedule(["a"], [12])
    mgr.append("a", [12])  # q0 = 12 reads [7, 12]: block 0 released in each window group
    mgr.schedule(["a"], [1])
    assert mgr.blocks_in_use("a") == 4 + 3 + 3
    # the pool is almost full, so append_batch counts exactly too
    assert mgr.pool.num_free == 2
    # token 13 fits block 3; q0 = 13 reads [8, 13]: block 1 released in each window group
    if batch:
        mgr.append_batch(["a"], [5])
    else:
        mgr.append("a", [5])
    assert mgr.blocks_in_use("a") == 4 + 2 + 2 and mgr.pool.num_free == 4
    mgr.check()
