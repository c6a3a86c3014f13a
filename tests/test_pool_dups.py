"""The pool's vLLM semantics against the reference (kvblocks.testing.ReferencePool): duplicate
entries under one key (``cache(..., dup=True)``: lookups give the earliest, removing one
leaves the others), re-keying a cached block (``move_entry``, vLLM's move_block_hashes),
``free(ids, order="vllm")``, ``try_reset_prefix_cache`` and the pool of the null block
alone. After every operation the free list's order, the ref counts, every block's entry,
each key's blocks in order and the lookups must match, and a failing call changes nothing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
from kvblocks import BlockPool, InvalidArgumentError, InvalidStateError
from kvblocks.testing import ReferencePool

KEY = b"0123456789abcdef"
N = 10
HASHES = kvblocks.hash_blocks(np.arange(12, dtype=np.int32), 4, key=KEY)  # 3 keys
TOKENS = np.arange(12, dtype=np.int32).reshape(3, 4)


def _state(p):
    blocks = range(p.num_blocks)
    return (
        p.free_list().tolist(),
        p.ref_counts().tolist(),
        [p.block_hash(b) for b in blocks],
        p.num_free,
        p.num_cached,
        p.num_evictable,
        [p.cached_blocks(h).tolist() for h in HASHES],
        [p.lookup(HASHES[i:]).tolist() for i in range(3)],
    )


def _same_failure(pool, ref, call):
    """Both refuse with the same error class and neither changes."""
    before = _state(pool)
    with pytest.raises((InvalidArgumentError, InvalidStateError)) as real:
        call(pool)
    with pytest.raises((InvalidArgumentError, InvalidStateError)) as model:
        call(ref)
    assert isinstance(real.value, type(model.value)) or isinstance(model.value, type(real.value))
    assert _state(pool) == before


op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, 4)),
    st.tuples(st.just("free"), st.integers(0, 4), st.booleans()),
    st.tuples(st.just("bad_free"), st.integers(-1, N)),
    st.tuples(st.just("cache"), st.integers(0, 2), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("uncache"), st.lists(st.integers(1, N - 1), max_size=3)),
    st.tuples(st.just("move"), st.integers(-1, N), st.integers(-1, N)),
    st.tuples(st.just("reset"), st.booleans()),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40))
def test_duplicates_moves_and_vllm_frees_match_the_reference(ops):
    pool = BlockPool(N, hash_key=KEY)
    ref = ReferencePool(N)
    held: list = []  # one entry per reference held
    for o in ops:
        name = o[0]
        if name == "alloc":
            if o[1] <= pool.num_free:
                got = pool.allocate(o[1]).tolist()
                assert got == ref.allocate(o[1]).tolist()
                held += got
        elif name == "free":
            ids = held[-o[1] :] if o[1] else []
            order = "vllm" if o[2] else None
            pool.free(np.asarray(ids, dtype=np.int32), order=order)
            ref.free(np.asarray(ids, dtype=np.int32), order=order)
            del held[len(held) - len(ids) :]
        elif name == "bad_free":  # out of range, the null block, or a free block
            b = o[1]
            if 0 < b < N and pool.ref_count(b) > 0:
                continue
            _same_failure(pool, ref, lambda p, b=b: p.free([b], order="vllm"))
        elif name == "cache":  # held blocks without an entry, under key o[1]
            cand = [b for b in dict.fromkeys(held) if not pool.is_cached(b)][o[2] : o[2] + 1]
            if cand:
                k = o[1]
                ids = np.asarray(cand, dtype=np.int32)
                got = pool.cache(ids, HASHES[k : k + 1], token_ids=TOKENS[k], dup=o[3])
                assert got == ref.cache(ids, HASHES[k : k + 1], dup=o[3])
        elif name == "uncache":
            assert pool.uncache(o[1]) == ref.uncache(o[1])
        elif name == "move":
            s, d = o[1], o[2]
            ok = (
                0 < s < N
                and 0 < d < N
                and s != d
                and pool.is_cached(s)
                and not pool.is_cached(d)
                and pool.ref_count(d) > 0
            )
            if ok:
                pool.move_entry(s, d)
                ref.move_entry(s, d)
            else:
                _same_failure(pool, ref, lambda p, s=s, d=d: p.move_entry(s, d))
        else:
            want = ref.try_reset_prefix_cache(keep_order=o[1])
            assert pool.try_reset_prefix_cache(keep_order=o[1]) == want
            if not ref.free_order_known:
                ref.adopt_free_order(pool.free_list())
        assert _state(pool) == _state(ref)
        pool.check()
        ref.check()


def test_lookups_give_the_earliest_duplicate_and_removal_leaves_the_others():
    pool = BlockPool(8, hash_key=KEY)
    ids = pool.allocate(4)
    h = HASHES[:1]
    assert pool.cache(ids[:1], h) == 1
    assert pool.cache(ids[1:2], h) == 0  # without dup: the first keeps the key, alone
    assert [pool.cache(ids[i : i + 1], h, dup=True) for i in (1, 2, 3)] == [1, 1, 1]
    assert pool.num_cached == 4 and pool.cached_blocks(h[0]).tolist() == [1, 2, 3, 4]
    assert pool.uncache([2]) == 1  # a later one leaves: the first still answers
    assert pool.lookup(h).tolist() == [1] and pool.cached_blocks(h[0]).tolist() == [1, 3, 4]
    assert pool.uncache([1]) == 1  # the first leaves: the next earliest answers
    assert pool.lookup(h).tolist() == [3]
    pool.free(ids)  # 3, 4 evictable at the tail; allocation evicts them in order
    assert pool.allocate(6).tolist()[-1] == 3 and pool.lookup(h).tolist() == [4]
    pool.check()


def test_duplicate_events_are_one_stored_and_one_removed_per_block():
    pool = BlockPool(4, hash_key=KEY, enable_kv_events=True)
    ids = pool.allocate(2)
    pool.cache(ids[:1], HASHES[:1], token_ids=TOKENS[0])
    pool.cache(ids[1:], HASHES[:1], token_ids=TOKENS[0], dup=True)
    pool.free(ids)
    pool.allocate(3)  # evicts both: a removal each (consecutive ones share one event)
    per_block = [(type(e).__name__, h) for e in pool.take_events() for h in e.block_hashes]
    h = kvblocks.hash_to_int(HASHES[0])
    assert [n for n, _ in per_block] == ["BlockStored"] * 2 + ["BlockRemoved"] * 2
    assert {x for _, x in per_block} == {h & (2**64 - 1)} or {x for _, x in per_block} == {h}


def test_cache_bytes_dup_keeps_every_block_and_lookup_bytes_gives_the_earliest():
    pool = BlockPool(8)
    full = np.zeros((8, 4), dtype=np.uint64)
    mark = np.zeros(8, dtype=np.bool_)
    hs = [bytes([7]) * 32, bytes([8]) * 32]
    a, b = pool.allocate(2), pool.allocate(2)
    assert pool.cache_bytes(a, hs, full=full, mark=mark) == 2
    assert pool.cache_bytes(b, hs, full=full, mark=mark) == 0  # no dup: left uncached
    assert pool.cache_bytes(b, hs, full=full, mark=mark, dup=True) == 2
    assert pool.num_cached == 4 and mark[1:5].all()
    pool.uncache(a[1:])
    assert pool.lookup_bytes(hs, full=full).tolist() == [a[0], b[1]]
    pool.check()


def test_move_entry_takes_the_last_place_and_keeps_free_blocks_in_place():
    pool = BlockPool(8, hash_key=KEY)
    ids = pool.allocate(4)
    h = HASHES[:1]
    pool.cache(ids[:2], np.repeat(h, 2, axis=0), dup=True)
    pool.move_entry(1, 3)  # the first block's entry goes behind block 2
    assert pool.cached_blocks(h[0]).tolist() == [2, 3] and not pool.is_cached(1)
    pool.free(ids[1:2])  # 2 evictable
    pool.move_entry(2, 4)  # a free source keeps its place, no longer evictable
    assert pool.free_list().tolist() == [5, 6, 7, 2] and pool.num_evictable == 0
    assert pool.lookup(h).tolist() == [3]
    pool.check()


def test_move_entry_and_free_order_failures_change_nothing():
    pool = BlockPool(6, hash_key=KEY)
    ids = pool.allocate(3)
    pool.cache(ids[:1], HASHES[:1])
    pool.free(ids[2:])  # block 3 free
    before = _state(pool)
    for src, dst, err in [
        (1, 1, InvalidArgumentError),
        (0, 2, InvalidArgumentError),
        (1, 6, InvalidArgumentError),
        (2, 1, InvalidStateError),  # src holds no entry
        (1, 3, InvalidStateError),  # dst is free
    ]:
        with pytest.raises(err):
            pool.move_entry(src, dst)
        assert _state(pool) == before
    with pytest.raises(kvblocks.InvalidTypeError):
        pool.move_entry(1.5, 2)
    for bad in ([0], [6], [3], [2, 2]):
        with pytest.raises((InvalidArgumentError, InvalidStateError)):
            pool.free(bad, order="vllm")
        assert _state(pool) == before
    with pytest.raises(InvalidArgumentError):
        pool.free([2], order="lru")
    assert _state(pool) == before


def test_try_reset_prefix_cache_is_vllms_rule():
    pool = BlockPool(6, hash_key=KEY)
    ids = pool.allocate(2)
    pool.cache(ids[:1], HASHES[:1])
    pool.free(ids[:1])  # the cached block is free: an uncached one is still in use
    before = _state(pool)
    assert pool.try_reset_prefix_cache(keep_order=True) is False
    assert _state(pool) == before
    pool.free(ids[1:])
    order = pool.free_list().tolist()
    assert pool.try_reset_prefix_cache(keep_order=True) is True
    assert pool.num_cached == 0 and pool.free_list().tolist() == order
    pool.check()


def test_a_pool_of_the_null_block_alone():
    for cls in (BlockPool, ReferencePool):
        pool = cls(1)
        assert (pool.num_free, pool.num_cached, pool.free_list().tolist()) == (0, 0, [])
        assert pool.allocate(0).tolist() == []
        with pytest.raises(kvblocks.OutOfBlocksError):
            pool.allocate(1)
        with pytest.raises(InvalidArgumentError):
            pool.free([0])
        assert pool.try_reset_prefix_cache() is True
        pool.check()
    assert BlockPool(1).usage == 0.0
    with pytest.raises(InvalidArgumentError):
        BlockPool(0)
