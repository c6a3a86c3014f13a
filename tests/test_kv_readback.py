"""Every sequence reads back exactly its own K/V, through kvblocks.ops, as an engine runs it.

The state machine (kvblocks.testing.EngineMachine) drives a BlockManager and numpy caches in
the documented step order and checks the bytes after every step; the named tests below are
the scenarios that corrupted K/V silently (each one a shrunk failure or an audit finding).
"""

import numpy as np
import pytest

from kvblocks import BlockManager, InvalidArgumentError
from kvblocks.testing import EngineMachine, KVReadback
from kvblocks.testing.readback import prefix_hashes

TestEngine = EngineMachine.TestCase


def engine(num_blocks=16, block_size=4, host=16):
    mgr = BlockManager(num_blocks, block_size, num_host_blocks=host)
    return mgr, KVReadback(mgr)


@pytest.mark.parametrize(
    "order", ["copy_then_swap_out", "swap_out_then_drain", "swap_out_then_drain_swaps_first"]
)
def test_swap_out_with_pending_copy_reads_back(order):
    """A child forked from a sequence whose last block is partial writes into it: the
    copy-on-write copy is pending when the child is swapped out. The swap pair must read the
    copy's source (the destination was never filled), whatever order the engine drains in."""
    mgr, rb = engine()
    rb.add("parent", [1, 2, 3, 4, 5, 6])
    rb.forward(["parent"])
    rb.fork("parent", "child")
    rb.append_batch(["child"], [7])  # copy-on-write of the shared block
    assert mgr.num_pending_copies == 1
    if order == "copy_then_swap_out":
        rb.drain()
        rb.swap_out("child")
        rb.drain()
    else:
        rb.swap_out("child")
        rb.drain(swaps_first=order.endswith("swaps_first"))
    rb.assert_all()  # the host copy holds the child's K/V
    rb.swap_in("child")
    rb.drain()
    rb.assert_all()
    rb.forward(["child"])  # its committed token, computed now
    rb.assert_all()
    assert rb.num_computed("child") == 7
    mgr.check()


def test_take_copies_safe_for_one_copy_blocks_call():
    """fork, append, fork, append makes a chain of copies (the second reads the first's
    destination); and the source of a pending copy, once its sequence is freed, must not be
    handed out as another copy's destination. take_copies() must be one valid copy_blocks
    call (no block both a source and a destination) and everyone must read back."""
    mgr, rb = engine(num_blocks=12)
    rb.add("p", [1, 2, 3, 4, 5])
    rb.add("g", [30, 31, 32, 33, 34])
    rb.forward(["p", "g"])
    rb.fork("g", "h")  # g's partial block is shared
    rb.fork("p", "c")
    rb.append_batch(["c"], [6])  # copy (p's block -> c's)
    rb.fork("c", "d")  # d shares c's block, still being copied
    rb.append_batch(["d"], [7])  # a chain: must read p's block
    rb.free("p")  # the chain's source loses its owner
    rb.append_batch(["h"], [8])  # a new copy needs a fresh destination
    try:
        copies = rb.drain()  # take_copies -> one copy_blocks call
    except InvalidArgumentError as exc:
        pytest.fail(f"take_copies() is not one valid copy_blocks call: {exc}")
    assert not set(copies[:, 0].tolist()) & set(copies[:, 1].tolist())
    rb.assert_all()
    rb.forward(["c", "d", "h"])
    rb.assert_all()
    mgr.check()


@pytest.mark.parametrize("preempt", ["free", "swap_out", "truncate_then_free"])
def test_uncomputed_block_is_never_a_prefix_hit(preempt):
    """docs/engine-integration.md, *Committed vs computed*: 7 prompt tokens (block size 4)
    computed, an 8th committed but never computed fills block 1. Preempted before the step that computes it, block 1 must not be a
    prefix hit: a longer prompt with the same 8 tokens hits 4 tokens, not 8."""
    mgr, rb = engine(host=8)
    rb.add("a", [1, 2, 3, 4, 5, 6, 7])
    rb.forward(["a"])  # metadata q=7 and the K/V writes
    rb.append_batch(["a"], [8])  # block 1 is full, position 7 unwritten
    if preempt == "free":
        rb.free("a")
    elif preempt == "swap_out":
        rb.swap_out("a")
    else:
        rb.truncate("a", 7)
        rb.free("a")
    cached = rb.add("b", list(range(1, 11)))
    rb.drain()
    rb.assert_all()  # no hit reads an unwritten slot
    assert cached == 4
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


def test_swap_out_then_copy_on_write_before_the_drain():
    """Found by EngineMachine (deep profile): in one schedule phase a sequence is swapped out
    and another one reserves lookahead slots in a block it shares (copy-on-write). The copy's
    destination is a block the swap-out just released, and the documented drain runs the
    copies before the swap pairs, so the swap-out reads bytes the copy already overwrote.

    The documented drain order is therefore swap pairs first (in the order the calls
    returned them), copies last; copies first is the misuse that reads overwritten bytes."""
    mgr, rb = engine(num_blocks=5, host=8)  # 4 usable blocks
    rb.add("p", [1, 2, 3, 4, 5])
    rb.add("q", [9, 9])
    rb.forward(["p", "q"])
    rb.fork("q", "r")  # after the step, as engines fork
    rb.swap_out("p")  # schedule phase: preempt p ...
    rb.reserve("r", 1)  # ... and give r a lookahead slot
    rb.drain()  # swap pairs, then copies (documented)
    rb.assert_all()
    rb.swap_in("p")
    rb.drain()
    rb.assert_all()
    mgr.check()


def test_readback_reports_the_first_wrong_position():
    """The checker itself: a block overwritten behind the manager's back is reported with
    the position, the block and what the bytes were written for."""
    mgr, rb = engine()
    rb.add("a", [1, 2, 3, 4, 5])
    rb.add("b", [6, 7, 8, 9, 10])
    rb.forward(["a", "b"])
    rb.assert_all()
    a1, b1 = mgr.block_table("a")[1], mgr.block_table("b")[1]
    rb.cache.planes[:, a1] = rb.cache.planes[:, b1]
    with pytest.raises(
        AssertionError,
        match=r"sequence 'a' reads back wrong K/V: position 4 "
        r"\(token 5\).*sequence 'b' position 4 \(token 10\)",
    ):
        rb.assert_reads_back(mgr, "a")
    rb.cache.planes[:, a1] = 0xA5
    with pytest.raises(AssertionError, match="never written"):
        rb.assert_reads_back(mgr, "a")


def test_identical_prefixes_have_identical_kv():
    _, rb = engine()
    a = prefix_hashes([1, 2, 3, 4])
    b = prefix_hashes([1, 2, 3, 5])
    c = prefix_hashes([9, 2, 3, 4])
    assert a[:3] == b[:3] and a[3] != b[3]
    assert all(x != y for x, y in zip(a, c))  # a different first token changes all
    ka, va = rb.kv(a, 1)
    kb, vb = rb.kv(b, 1)
    assert np.array_equal(ka[:3], kb[:3]) and not np.array_equal(ka[3], kb[3])
    assert not np.array_equal(ka, va)
