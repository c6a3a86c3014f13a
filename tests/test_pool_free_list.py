"""The pool's free list against a model written from its documented order (BlockPool.free):
never-cached blocks join at the head (reused first), cached ones at the tail (least recently
released evicted first), allocation pops the head and evicts a popped block's entry, a cache hit
unlinks an evictable block, and a failing free (an id out of range, or more drops than
references, repeats included) changes nothing at all. After every operation the whole order,
the counters and the stats must match: this pins the allocation and free loops (one pass with an
undo, a register-held head) against every reordering and off-by-one."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
from kvblocks import BlockPool

KEY = b"0123456789abcdef"
N = 12


class Model:
    def __init__(self, n):
        self.order = list(range(1, n))  # the free list, head first
        self.ref = [0] * n
        self.cached = {}  # block -> hash int
        self.evictions = self.frees = self.allocations = 0

    def allocate(self, k):
        if k > len(self.order):
            return None
        out = self.order[:k]
        del self.order[:k]
        for b in out:
            self.ref[b] = 1
            if b in self.cached:
                del self.cached[b]
                self.evictions += 1
        self.allocations += k
        return out

    def free(self, ids):
        ref = list(self.ref)
        for b in ids:
            if not 0 < b < len(ref) or ref[b] <= 0:
                return False
            ref[b] -= 1
        for b in ids:
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.frees += 1
                if b in self.cached:
                    self.order.append(b)
                else:
                    self.order.insert(0, b)
        return True

    def pin(self, b):
        if self.ref[b] == 0:
            self.order.remove(b)
        self.ref[b] += 1


def _state(pool):
    s = pool.stats
    return (
        list(pool.free_list()),
        pool.num_free,
        pool.num_evictable,
        pool.num_cached,
        list(pool.ref_counts()),
        s.evictions,
        s.frees,
        s.allocations,
    )


def _expect(m):
    ev = sum(1 for b in m.order if b in m.cached)
    return (m.order, len(m.order), ev, len(m.cached), m.ref, m.evictions, m.frees, m.allocations)


op = st.one_of(
    st.tuples(st.just("alloc"), st.integers(0, N)),
    st.tuples(st.just("free"), st.lists(st.integers(-1, N), max_size=6)),
    st.tuples(st.just("free_held"), st.integers(0, 5)),
    st.tuples(st.just("cache"), st.integers(0, 3)),
    st.tuples(st.just("hit"), st.integers(0, 7)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40))
def test_free_list_order_matches_the_model(ops):
    pool = BlockPool(N, enable_prefix_caching=True, hash_key=KEY)
    m = Model(N)
    held = []  # one entry per reference we hold
    hashes = {}  # hash int -> block
    serial = 0
    for name, arg in ops:
        if name == "alloc":
            want = m.allocate(arg)
            if want is None:
                with pytest.raises(kvblocks.OutOfBlocksError):
                    pool.allocate(arg)
            else:
                assert list(pool.allocate(arg)) == want
                held += want
                hashes = {h: b for h, b in hashes.items() if b not in want}
        elif name in ("free", "free_held"):
            ids = arg if name == "free" else held[-arg:] if arg else []
            ids = [b for b in ids]
            if m.free(ids):
                pool.free(np.asarray(ids, dtype=np.int32))
                for b in ids:
                    held.remove(b)
            else:
                with pytest.raises((kvblocks.InvalidArgumentError, kvblocks.InvalidStateError)):
                    pool.free(np.asarray(ids, dtype=np.int32))
        elif name == "cache":  # register some held, uncached blocks under fresh hashes
            cand = [b for b in dict.fromkeys(held) if b not in m.cached][:arg]
            if cand:
                serial += 1
                toks = np.arange(serial * 100, serial * 100 + 4 * len(cand), dtype=np.int32)
                hs = kvblocks.hash_blocks(toks, 4, key=KEY)
                assert pool.cache(np.asarray(cand, dtype=np.int32), hs, token_ids=toks) == len(cand)
                for b, h in zip(cand, hs):
                    hv = kvblocks.hash_to_int(h)
                    m.cached[b] = hv
                    hashes[hv] = b
        else:  # a cache hit on one entry: lookup_and_pin unlinks an evictable block
            if hashes:
                hv = sorted(hashes)[arg % len(hashes)]
                b = hashes[hv]
                got = pool.lookup_and_pin(kvblocks.hash_from_int(hv)[None])
                assert list(got) == [b]
                m.pin(b)
                held.append(b)
        assert _state(pool) == _expect(m)
        pool.check()


def test_failed_free_midway_restores_head_tail_and_counters():
    pool = BlockPool(8, enable_prefix_caching=True, hash_key=KEY)
    ids = pool.allocate(5)  # 1..5
    toks = np.arange(8, dtype=np.int32)
    pool.cache(ids[:2], kvblocks.hash_blocks(toks, 4, key=KEY), token_ids=toks)
    pool.free(ids[4:])  # 5 back at the head
    before = _state(pool)
    # cached 1 (tail), uncached 3 (head), 3 again (over-freed: the failure)
    with pytest.raises(kvblocks.InvalidStateError):
        pool.free(np.asarray([1, 3, 2, 3], dtype=np.int32))
    assert _state(pool) == before
    with pytest.raises(kvblocks.InvalidArgumentError):
        pool.free(np.asarray([4, 1, 8], dtype=np.int32))
    assert _state(pool) == before
    pool.check()
    pool.free(np.asarray([1, 3, 2, 4], dtype=np.int32))
    assert list(pool.free_list()) == [4, 3, 5, 6, 7, 1, 2]
    pool.check()


def test_the_scalar_path_matches_the_array_path_and_refuses_what_free_refuses():
    a = BlockPool(N, enable_prefix_caching=True, hash_key=KEY)
    b = BlockPool(N, enable_prefix_caching=True, hash_key=KEY)
    got = [a.allocate_one() for _ in range(N - 1)]
    assert got == list(b.allocate(N - 1))
    with pytest.raises(kvblocks.OutOfBlocksError):
        a.allocate_one()
    assert _state(a) == _state(b)
    for x in got[::-1]:
        a.free_one(x)
    b.free(np.asarray(got[::-1], dtype=np.int32))
    assert _state(a) == _state(b)
    for bad, exc in (
        (0, kvblocks.InvalidArgumentError),
        (N, kvblocks.InvalidArgumentError),
        (-1, kvblocks.InvalidArgumentError),
        (1, kvblocks.InvalidStateError),
        (2**40, kvblocks.InvalidArgumentError),
        (1.0, kvblocks.InvalidTypeError),
        (True, kvblocks.InvalidTypeError),
        ("1", kvblocks.InvalidTypeError),
    ):
        with pytest.raises(exc):
            a.free_one(bad)  # block 1 is free now: dropping a reference it lacks is refused
        assert _state(a) == _state(b)
    x = a.allocate_one()
    a.free_one(np.int64(x))  # numpy integers are ints
    a.check()
