"""Token and id lists take a one-pass native conversion (exact ints only); everything else
takes numpy's path. Both must agree: same hashes, same refusals, nothing changed on error."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
from kvblocks import BlockManager

KEY = b"0123456789abcdef"
I32 = st.integers(-(2**31), 2**31 - 1)


@settings(max_examples=200, deadline=None)
@given(st.lists(I32, max_size=64))
def test_list_hashes_equal_array_hashes(toks):
    got = kvblocks.hash_blocks(toks, 4, key=KEY)
    want = kvblocks.hash_blocks(np.asarray(toks, dtype=np.int64).astype(np.int32), 4, key=KEY)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1, 2**64, -(2**70)])
def test_out_of_int32_items_are_refused_and_change_nothing(bad):
    mgr = BlockManager(16, 4)
    with pytest.raises(kvblocks.InvalidArgumentError, match="outside int32"):
        mgr.add("s", [1, 2, 3, bad, 5])
    assert mgr.num_seqs == 0 and mgr.pool.num_free == 15
    mgr.check()


def test_items_that_are_not_exact_ints_take_numpys_path():
    # numpy integers and int subclasses convert as numpy converts them; floats are refused
    a = kvblocks.hash_blocks([np.int64(7)] * 4, 4, key=KEY)
    b = kvblocks.hash_blocks([7] * 4, 4, key=KEY)
    assert np.array_equal(a, b)
    with pytest.raises(kvblocks.InvalidTypeError):
        kvblocks.hash_blocks([1, 2, 3, 4.0], 4, key=KEY)
    with pytest.raises(kvblocks.InvalidTypeError):
        kvblocks.hash_blocks([1, 2, "3", 4], 4, key=KEY)


def test_free_takes_a_list_of_ids():
    pool = kvblocks.BlockPool(8)
    ids = pool.allocate(3)
    pool.free([int(x) for x in ids])
    assert pool.num_free == 7
    with pytest.raises(kvblocks.InvalidArgumentError):
        pool.free([1, 2**40])
    assert pool.num_free == 7
