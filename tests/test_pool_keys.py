"""Secondary keys in the native pool's prefix cache (``BlockPool.add_key``: vLLM 0.34's
``cached_block_hashes_by_block``) against a pure-Python model of vLLM's map: key -> the blocks
under it in insertion order (lookups give the earliest), block -> its keys (the primary
first). Every path that drops a block's entry drops all its keys (allocation's eviction,
``uncache``, resets), ``move_entry`` moves all of them, and a hit through any key is a hit on
the block (pinned, it leaves the free list as through its primary). After every rule the
pool's free list, ref counts, keys and lookups match the model and ``check()`` passes; a
failing call raises its typed error and changes nothing."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvblocks
from kvblocks import (
    BlockPool,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
)

N = 8  # a small table (16 slots): the second secondary key already grows it
# keys whose low words share a home slot (probe runs, backward shifts), and spread ones
KEYS = [(16 * i + 3) | ((7 * i + 1) << 64) for i in range(6)] + [
    ((0x9E3779B97F4A7C15 * (i + 1)) % 2**64) | (i << 64) for i in range(6)
]
ERRORS = (InvalidArgumentError, InvalidStateError, InvalidTypeError)


def row(k):
    """A key as hash_blocks gives one: a [lo, hi] uint64 row."""
    return np.array([k & (2**64 - 1), k >> 64], dtype=np.uint64)


def as_int(r):
    return int(r[0]) | (int(r[1]) << 64)


class Model:
    """vLLM's BlockPool with secondary keys; the free list as the pool orders it (a block
    without an entry reaching 0 refs goes to the head, a cached one to the tail)."""

    def __init__(self, n):
        self.n = n
        self.ref = [0] * n
        self.free = list(range(1, n))
        self.keys = {}  # cached block -> [primary, secondaries...]
        self.map = {}  # key -> blocks under it, in insertion order

    def _link(self, b, k):
        self.map.setdefault(k, []).append(b)

    def _drop(self, b):
        for k in self.keys.pop(b):
            self.map[k].remove(b)
            if not self.map[k]:
                del self.map[k]

    def allocate(self, n):
        out, self.free = self.free[:n], self.free[n:]
        for b in out:
            if b in self.keys:  # lazy eviction: every key goes
                self._drop(b)
            self.ref[b] = 1
        return out

    def release(self, b):
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self.keys:
                self.free.append(b)
            else:
                self.free.insert(0, b)

    def cache(self, b, k, dup):
        if b in self.keys or (k in self.map and not dup):
            return 0
        self.keys[b] = [k]
        self._link(b, k)
        return 1

    def add_key(self, b, k):
        if k in self.keys[b]:
            return False
        self.keys[b].append(k)
        self._link(b, k)
        return True

    def uncache(self, ids):
        dropped = 0
        for b in ids:
            if b in self.keys:
                self._drop(b)
                dropped += 1
        return dropped

    def move(self, s, d):
        keys = self.keys.pop(s)
        for k in keys:
            self.map[k].remove(s)
            self.map[k].append(d)  # the last place among the key's blocks
        self.keys[d] = keys

    def reset(self, keep_order):
        if not keep_order:  # the pool moves each cached block to the head, lowest id first
            cached = sorted(self.keys)
            self.free = cached[::-1] + [b for b in self.free if b not in self.keys]
        self.keys.clear()
        self.map.clear()

    def lookup(self, ks):
        out = []
        for k in ks:
            if k not in self.map:
                break
            out.append(self.map[k][0])
        return out

    def pin(self, b):
        if self.ref[b] == 0:
            self.free.remove(b)
        self.ref[b] += 1


def snapshot(pool):
    return (
        pool.free_list().tolist(),
        pool.ref_counts().tolist(),
        [pool.keys_of(b).tolist() for b in range(pool.num_blocks)],
        pool.num_free,
        pool.num_cached,
        pool.num_evictable,
        pool.num_entries,
        [pool.cached_blocks(k).tolist() for k in KEYS],
    )


def fails(pool, call, errors=ERRORS):
    """call(pool) raises one of ``errors`` and changes nothing."""
    before = snapshot(pool)
    with pytest.raises(errors):
        call(pool)
    assert snapshot(pool) == before
    pool.check()


keys = st.sampled_from(KEYS)


class KeysMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(N)
        self.model = Model(N)

    def held(self):
        return [b for b in range(1, N) if self.model.ref[b] > 0]

    @initialize(n=st.integers(0, N - 1), data=st.data())
    def seed(self, n, data):
        """Start from cached blocks with secondary keys, some held, some evictable."""
        ids = self.pool.allocate(n).tolist()
        self.model.allocate(n)
        for b in ids:
            k, dup = data.draw(keys), data.draw(st.booleans())
            assert self.pool.cache([b], [k], dup=dup) == self.model.cache(b, k, dup)
            if b in self.model.keys:
                for k2 in data.draw(st.lists(keys, max_size=4)):
                    assert self.pool.add_key(b, k2) == self.model.add_key(b, k2)
        for b in data.draw(st.lists(st.sampled_from(ids), unique=True)) if ids else []:
            self.pool.free([b])
            self.model.release(b)

    # -- calls that succeed -------------------------------------------------------------------
    @rule(n=st.integers(0, 5))
    def allocate(self, n):
        if n > len(self.model.free):
            fails(self.pool, lambda p: p.allocate(n), kvblocks.OutOfBlocksError)
            return
        assert self.pool.allocate(n).tolist() == self.model.allocate(n)

    @precondition(lambda self: self.held())
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(self.held()))
        self.pool.free([b])
        self.model.release(b)

    @precondition(lambda self: self.held())
    @rule(data=st.data(), k=keys, dup=st.booleans())
    def cache(self, data, k, dup):
        b = data.draw(st.sampled_from(self.held()))
        if b in self.model.keys and self.model.keys[b][0] != k:  # under two hashes
            fails(self.pool, lambda p: p.cache([b], [k], dup=dup))
            return
        assert self.pool.cache([b], [k], dup=dup) == self.model.cache(b, k, dup)

    @precondition(lambda self: self.model.keys)
    @rule(data=st.data(), k=keys, as_row=st.booleans())
    def add_key(self, data, k, as_row):
        b = data.draw(st.sampled_from(sorted(self.model.keys)))
        assert self.pool.add_key(b, row(k) if as_row else k) == self.model.add_key(b, k)

    @rule(ids=st.lists(st.integers(1, N - 1), max_size=3))
    def uncache(self, ids):
        assert self.pool.uncache(ids) == self.model.uncache(ids)

    def movable(self):
        m = self.model
        dst = [b for b in range(1, N) if m.ref[b] > 0 and b not in m.keys]
        return [(s, d) for s in sorted(m.keys) for d in dst]

    @precondition(lambda self: self.movable())
    @rule(data=st.data())
    def move_entry(self, data):
        s, d = data.draw(st.sampled_from(self.movable()))
        self.pool.move_entry(s, d)
        self.model.move(s, d)

    @rule(s=st.integers(-1, N), d=st.integers(-1, N))
    def move_entry_any(self, s, d):
        m = self.model
        ok = 0 < s < N and 0 < d < N and s != d and s in m.keys and d not in m.keys and m.ref[d] > 0
        if not ok:
            fails(self.pool, lambda p: p.move_entry(s, d))
            return
        self.pool.move_entry(s, d)
        m.move(s, d)

    @rule(keep_order=st.booleans(), tried=st.booleans())
    def reset(self, keep_order, tried):
        m = self.model
        if tried:
            ok = not self.held()
            assert self.pool.try_reset_prefix_cache(keep_order=keep_order) == ok
        else:
            ok = not any(m.ref[b] for b in m.keys)
            if not ok:
                fails(self.pool, lambda p: p.reset_prefix_cache(keep_order=keep_order))
                return
            self.pool.reset_prefix_cache(keep_order=keep_order)
        if ok:
            m.reset(keep_order)

    @rule(ks=st.lists(keys, max_size=4), pin=st.booleans())
    def lookup(self, ks, pin):
        want = self.model.lookup(ks)
        if pin:
            got = self.pool.lookup_and_pin([row(k) for k in ks] or np.zeros((0, 2), np.uint64))
            for b in want:
                self.model.pin(b)
        else:
            got = self.pool.lookup([row(k) for k in ks] or np.zeros((0, 2), np.uint64))
        assert got.tolist() == want

    # -- calls that fail ----------------------------------------------------------------------
    @rule(b=st.integers(-2, N + 1), k=keys)
    def add_key_to_a_block_without_an_entry(self, b, k):
        if b in self.model.keys:
            return
        fails(self.pool, lambda p: p.add_key(b, k))

    @precondition(lambda self: self.model.keys)
    @rule(
        data=st.data(),
        key=st.sampled_from(
            [
                -1,
                2**128,
                1.5,
                True,
                np.array([1, 2], dtype=np.int64),
                np.zeros(3, np.uint64),
                "k",
                None,
            ]
        ),
    )
    def add_a_bad_key(self, data, key):
        b = data.draw(st.sampled_from(sorted(self.model.keys)))
        fails(self.pool, lambda p: p.add_key(b, key))

    @rule(b=st.sampled_from([-1, N, 2**40, 1.0, True, "1", None]))
    def a_bad_id(self, b):
        fails(self.pool, lambda p: p.keys_of(b))
        fails(self.pool, lambda p: p.add_key(b, KEYS[0]))

    # -- what must match after every rule ---------------------------------------------------
    @invariant()
    def matches_the_model(self):
        p, m = self.pool, self.model
        p.check()
        assert p.free_list().tolist() == m.free
        assert p.ref_counts().tolist() == m.ref
        for b in range(N):
            assert [as_int(r) for r in p.keys_of(b)] == m.keys.get(b, [])
            assert p.is_cached(b) == (b in m.keys)
        assert p.num_cached == len(m.keys)
        assert p.num_entries == sum(map(len, m.keys.values()))
        assert p.num_evictable == sum(1 for b in m.keys if m.ref[b] == 0)
        for k in KEYS:
            assert p.cached_blocks(k).tolist() == m.map.get(k, [])


KeysMachine.TestCase.settings = settings(settings.default, stateful_step_count=50, deadline=None)
TestKeysMachine = KeysMachine.TestCase


# ---- directed tests --------------------------------------------------------------------------
def cached_pool(n=8, k=3):
    """A pool with blocks 1..k cached under KEYS[0..k), still referenced."""
    pool = BlockPool(n)
    ids = pool.allocate(k)
    assert pool.cache(ids, [row(KEYS[i]) for i in range(k)]) == k
    return pool, ids


def test_a_secondary_hit_returns_its_owner_and_chains_on():
    pool, _ = cached_pool()
    assert pool.add_key(2, KEYS[5])
    # the chain KEYS[0], KEYS[5] (block 2's secondary), KEYS[2]
    assert pool.lookup([row(KEYS[i]) for i in (0, 5, 2)]).tolist() == [1, 2, 3]
    assert pool.cached_blocks(KEYS[5]).tolist() == [2]
    assert pool.keys_of(2).tolist() == [row(KEYS[1]).tolist(), row(KEYS[5]).tolist()]
    assert (pool.num_cached, pool.num_entries) == (3, 4)
    pool.check()


def test_a_secondary_on_a_key_another_block_holds_goes_behind_it():
    pool, ids = cached_pool()
    assert pool.add_key(3, KEYS[0])  # block 1's primary: block 3 comes second
    assert pool.cached_blocks(KEYS[0]).tolist() == [1, 3]
    assert pool.lookup([row(KEYS[0])]).tolist() == [1]
    # a duplicate primary (cache(dup=True)) behind the secondary, a plain cache() refused
    more = pool.allocate(2)
    assert pool.cache(more[:1], [row(KEYS[0])], dup=True) == 1
    assert pool.cache(more[1:], [row(KEYS[0])]) == 0 and not pool.is_cached(more[1])
    assert pool.cached_blocks(KEYS[0]).tolist() == [1, 3, more[0]]
    pool.uncache([1])
    assert pool.lookup([row(KEYS[0])]).tolist() == [3]  # the secondary answers now
    # a key held only as a secondary: cache() keeps it, dup=True chains behind it
    assert pool.add_key(2, KEYS[7])
    assert pool.cache(more[1:], [row(KEYS[7])]) == 0
    assert pool.cache(more[1:], [row(KEYS[7])], dup=True) == 1
    assert pool.cached_blocks(KEYS[7]).tolist() == [2, more[1]]
    pool.check()


def test_eviction_drops_every_key_of_the_block():
    pool, ids = cached_pool(n=4)
    for k in KEYS[3:9]:
        assert pool.add_key(1, k)
    pool.free(ids)  # all three evictable, block 1 least recently released
    assert pool.lookup([row(KEYS[4])]).tolist() == [1]
    assert pool.allocate(1).tolist() == [1]  # evicts block 1
    for k in [KEYS[0], *KEYS[3:9]]:
        assert pool.lookup([row(k)]).tolist() == []
        assert pool.cached_blocks(k).tolist() == []
    assert pool.keys_of(1).shape == (0, 2)
    assert (pool.num_cached, pool.num_entries) == (2, 2)
    pool.check()
    # a freed record is reused: the next block's keys
    assert pool.add_key(2, KEYS[4]) and pool.lookup([row(KEYS[4])]).tolist() == [2]
    pool.check()


def test_uncache_and_reset_drop_every_key():
    pool, ids = cached_pool()
    pool.add_key(1, KEYS[6])
    pool.add_key(2, KEYS[7])
    assert pool.uncache([1]) == 1
    assert pool.lookup([row(KEYS[6])]).tolist() == []
    assert pool.num_entries == 3
    pool.free(ids)
    pool.reset_prefix_cache()
    assert pool.num_entries == 0 and pool.lookup([row(KEYS[7])]).tolist() == []
    pool.check()


def test_move_entry_moves_every_key_in_order():
    pool, ids = cached_pool()
    pool.add_key(1, KEYS[6])
    pool.add_key(1, KEYS[2])  # block 3's primary too: block 1 comes second
    pool.add_key(1, KEYS[7])
    dst = pool.allocate(1)[0]
    pool.move_entry(1, dst)
    assert [as_int(r) for r in pool.keys_of(dst)] == [KEYS[0], KEYS[6], KEYS[2], KEYS[7]]
    assert pool.keys_of(1).shape == (0, 2)
    assert pool.lookup([row(KEYS[0]), row(KEYS[6]), row(KEYS[7])]).tolist() == [dst] * 3
    assert pool.cached_blocks(KEYS[2]).tolist() == [3, dst]
    pool.check()


def test_a_secondary_hit_pins_an_evictable_block_as_its_primary_would():
    pool, ids = cached_pool()
    pool.add_key(2, KEYS[8])
    pool.free(ids)
    assert pool.free_list().tolist()[-3:] == [1, 2, 3]  # cached blocks at the tail
    assert pool.lookup_and_pin([row(KEYS[8])]).tolist() == [2]
    assert pool.ref_count(2) == 1 and 2 not in pool.free_list().tolist()
    assert pool.num_evictable == 2
    pool.check()
    pool.free([2])
    assert pool.free_list().tolist()[-3:] == [1, 3, 2] and pool.num_evictable == 3


def test_growth_past_the_half_full_table():
    pool = BlockPool(8)
    ids = pool.allocate(6)
    base = 1 << 80
    pool.cache(ids, [row(base + i) for i in range(6)])
    before = pool.metadata_bytes
    for b in ids.tolist():
        for j in range(20):
            assert pool.add_key(b, base + 1000 * b + 16 * j)  # shared home slots
    pool.check()
    assert pool.num_entries == 6 + 120 and pool.metadata_bytes > before
    for b in ids.tolist():
        assert pool.lookup([row(base + 1000 * b + 16 * j) for j in range(20)]).tolist() == [b] * 20
        assert [as_int(r) for r in pool.keys_of(b)] == [base + b - 1] + [
            base + 1000 * b + 16 * j for j in range(20)
        ]
    pool.free(ids)
    pool.allocate(7)  # evicts all six
    assert pool.num_entries == 0
    pool.check()


def test_lookup_bytes_checks_a_secondary_hit_against_its_own_32_bytes():
    pool = BlockPool(8)
    h = [bytes([i]) * 32 for i in range(1, 5)]
    full = np.zeros((8, 4), dtype=np.uint64)
    pool.cache_bytes(pool.allocate(2), h[:2], full=full)
    assert pool.add_key_bytes(2, h[2])
    assert pool.lookup_bytes(h[:3], full=full).tolist() == [1, 2, 2]
    # same first 16 bytes, other last 16: the key hits, the full check refuses
    other = h[3][:16] + bytes([9]) * 16
    assert pool.add_key_bytes(1, h[3][:16] + bytes([7]) * 16)
    assert pool.lookup_bytes([h[0], other], full=full).tolist() == [1]
    assert pool.lookup_bytes([other]).tolist() == [1]  # without full: the key alone
    # a short hash keeps zeros: never a full-width hit
    assert pool.add_key_bytes(1, bytes([5]) * 16)
    assert pool.lookup_bytes([bytes([5]) * 16 + bytes(16)], full=full).tolist() == []
    # key_salt, group
    assert pool.add_key_bytes(2, h[3], key_salt=7)
    assert pool.lookup_bytes([h[3]], full=full, key_salt=7).tolist() == [2]
    fails(pool, lambda p: p.add_key_bytes(2, h[0], group=1), InvalidArgumentError)
    fails(pool, lambda p: p.add_key_bytes(2, "x"), InvalidTypeError)
    pool.check()


def test_add_key_records_its_events_and_add_key_bytes_refuses():
    pool = BlockPool(4, enable_kv_events=True, block_size=4)
    ids = pool.allocate(1)
    pool.cache(ids, [row(KEYS[0])], token_ids=np.arange(4, dtype=np.int32))
    pool.take_events()
    assert pool.add_key(1, KEYS[6]) and pool.add_key(1, KEYS[7])
    assert not pool.add_key(1, KEYS[7])  # nothing new: no event
    fails(pool, lambda p: p.add_key_bytes(1, b"x" * 32), InvalidStateError)
    ev = pool.take_events()
    stored = [(type(e).__name__, h, e.parent_block_hash) for e in ev for h in e.block_hashes]
    assert stored == [("BlockStored", KEYS[6], None), ("BlockStored", KEYS[7], None)]
    pool.uncache(ids)  # the primary's removal first, then each secondary's
    ev = pool.take_events()
    assert [(type(e).__name__, h) for e in ev for h in e.block_hashes] == [
        ("BlockRemoved", KEYS[0]),
        ("BlockRemoved", KEYS[6]),
        ("BlockRemoved", KEYS[7]),
    ]


def test_errors_change_nothing():
    pool, ids = cached_pool()
    pool.add_key(1, KEYS[6])
    free_block = pool.allocate(1)[0]
    pool.free([free_block])
    for b in (0, -1, N, 2**31, 2**70):
        fails(pool, lambda p, b=b: p.add_key(b, KEYS[7]), InvalidArgumentError)
    for b in (1.0, True, "1", None):
        fails(pool, lambda p, b=b: p.add_key(b, KEYS[7]), InvalidTypeError)
    fails(pool, lambda p: p.add_key(free_block, KEYS[7]), InvalidStateError)
    for k in (-1, 2**128):
        fails(pool, lambda p, k=k: p.add_key(1, k), InvalidArgumentError)
    for k in (1.5, False, np.array([1, 2], dtype=np.int64), "k"):
        fails(pool, lambda p, k=k: p.add_key(1, k), InvalidTypeError)
    fails(pool, lambda p: p.add_key(1, np.zeros(3, np.uint64)), InvalidArgumentError)
    for b in (-1, N):
        fails(pool, lambda p, b=b: p.keys_of(b), InvalidArgumentError)
    fails(pool, lambda p: p.keys_of(1.0), InvalidTypeError)
    assert pool.add_key(np.int64(2), np.uint64(5)) and pool.lookup([5]).tolist() == [2]
    off = BlockPool(4, enable_prefix_caching=False)
    off.allocate(1)
    fails(off, lambda p: p.add_key(1, 5), InvalidStateError)


def test_a_host_tier_pool_takes_no_secondary_keys():
    mgr = kvblocks.BlockManager(16, 4, num_host_blocks=8, host_prefix_cache=True)
    mgr.add("a", np.arange(8, dtype=np.int32))
    mgr.metadata(["a"], [8])
    pool = mgr.pool
    b = next(b for b in range(1, 16) if pool.is_cached(b))
    fails(pool, lambda p: p.add_key(b, KEYS[0]), InvalidStateError)
    mgr.free("a")
    mgr.add("b", np.arange(100, 156, dtype=np.int32))  # demotes "a" to the host pool
    host = mgr.host_pool
    hb = next((b for b in range(1, 8) if host.is_cached(b)), None)
    if hb is not None:
        fails(host, lambda p: p.add_key(hb, KEYS[0]), InvalidStateError)
