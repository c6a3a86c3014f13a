"""Prefix caching: SipHash known answers, chained keyed hashes, salts, LRU eviction order,
atomic lookup-and-pin, first-block-wins, reset, stats and KV events."""

import numpy as np
import pytest
from helpers import KEY, compute
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
from kvblocks import (
    AllBlocksCleared,
    BlockManager,
    BlockPool,
    BlockRemoved,
    BlockStored,
    hash_blocks,
)
from kvblocks._core import siphash128


def as_int(h):
    return int(h[0]) | (int(h[1]) << 64)


def test_siphash_known_answers():
    # SipHash-2-4 with 128-bit output, key 00..0f, message 00..(n-1): the reference vectors
    key = bytes(range(16))
    assert siphash128(key, b"").hex() == "a3817f04ba25a8e66df67214c7550293"
    assert siphash128(key, bytes([0])).hex() == "da87c1d86b99af44347659119b22fc45"
    assert siphash128(key, bytes([0, 1])).hex() == "8177228da4a45dc7fca38bdef60affe4"


def spec_chain(key, tokens, bs, salt=None, parent=None):
    """docs/prefix-caching.md's block hash from the byte-wise SipHash (known answers above):
    h[i] = SipHash128_key(h[i-1] || block i's tokens as little-endian int32), from the root
    SipHash128_key("kvb" 0x00) (no salt) or ("kvb" 0x01 "s" salt) (a str salt)."""
    if parent is None:
        head = b"kvb\x00" if salt is None else b"kvb\x01s" + salt.encode()
        parent = siphash128(key, head)
    out = []
    for i in range(len(tokens) // bs):
        block = np.array(tokens[i * bs : (i + 1) * bs], dtype="<i4").tobytes()
        parent = siphash128(key, parent + block)
        out.append(parent)
    return out


INT32 = st.one_of(
    st.integers(-(2**31), 2**31 - 1),
    st.sampled_from([0, 65535, 65536, 65537, 2**31 - 1, -1, -(2**31), -65536, 2**16 + 2**15]),
)


@settings(max_examples=120, deadline=None)
@given(
    st.integers(1, 9).flatmap(
        lambda bs: st.tuples(st.just(bs), st.lists(INT32, min_size=bs, max_size=4 * bs))
    ),
    st.sampled_from([None, "t", "tenant-" + "x" * 20]),
)
def test_block_hash_is_the_spec_for_token_ids_across_int32(bs_tokens, salt):
    """Token ids across the whole int32 range, odd block sizes among them: the word-at-a-time
    block hash (csrc/hash.c: an odd-sized block's last token goes in the final word) equals
    the byte-wise formula. A hash that dropped any bits of the last odd token (ids of 65,536
    and more; negative ids) differs here, and so does the manager's chain."""
    bs, tokens = bs_tokens
    want = spec_chain(KEY, tokens, bs, salt=salt)
    got = hash_blocks(tokens, bs, key=KEY, salt=salt, digests=True)[1]
    assert [d.tobytes() for d in got] == want
    mgr = BlockManager(4 * len(tokens) + 8, bs, hash_key=KEY)
    mgr.add("s", tokens, salt=salt)
    compute(mgr, "s")
    cached = [mgr.pool.block_hash(b) for b in mgr.block_table("s")[: len(want)]]
    assert cached == [int.from_bytes(h, "little") for h in want]
    mgr.check()


def test_odd_block_last_token_high_bits_regression():
    """Issue 24 (mutation testing): two odd-sized blocks that differ only in the high 16 bits
    of their last token hash differently, in the chain and in the prefix cache."""
    a, b = [1, 2, 3], [1, 2, 3 + 65536]
    assert spec_chain(KEY, a, 3) != spec_chain(KEY, b, 3)
    for toks in (a, b, [1, 2, -(2**31)], [1, 2, 2**31 - 1]):
        got = hash_blocks(toks, 3, key=KEY, digests=True)[1]
        assert [d.tobytes() for d in got] == spec_chain(KEY, toks, 3)
    mgr = BlockManager(16, 3, hash_key=KEY)
    mgr.add("a", a + [0])
    compute(mgr, "a")
    assert mgr.probe(b + [0])[0] == 0  # no false prefix hit
    assert mgr.probe(a + [0])[0] == 3


def test_hashes_stable_for_a_key_and_different_across_keys():
    toks = np.arange(64, dtype=np.int32)
    a = hash_blocks(toks, 16, key=KEY)
    assert a.shape == (4, 2) and a.dtype == np.uint64
    assert np.array_equal(a, hash_blocks(toks.tolist(), 16, key=KEY))
    assert np.array_equal(a, hash_blocks(toks.astype(np.int64), 16, key=KEY))
    b = hash_blocks(toks, 16, key=b"another-16-bytes")
    assert not np.any(a == b)
    # the default key is random per process but fixed within it
    assert np.array_equal(hash_blocks(toks, 16), hash_blocks(toks, 16, key=None))
    assert np.array_equal(
        hash_blocks(toks, 16), hash_blocks(toks, 16, key=kvblocks.default_hash_key())
    )


def test_chaining_partial_blocks_and_parent():
    toks = np.arange(70, dtype=np.int32)
    h = hash_blocks(toks, 16, key=KEY)
    assert len(h) == 4  # the partial block is not hashed
    tail = hash_blocks(toks[32:64], 16, parent=h[1], key=KEY)
    assert np.array_equal(tail, h[2:4])
    assert np.array_equal(hash_blocks(toks[32:64], 16, parent=as_int(h[1]), key=KEY), h[2:4])
    # a change in block 0 changes every later hash (chaining)
    toks2 = toks.copy()
    toks2[3] += 1
    assert not np.any(hash_blocks(toks2, 16, key=KEY) == h)
    # same block content at another position hashes differently
    rep = np.tile(np.arange(16, dtype=np.int32), 2)
    r = hash_blocks(rep, 16, key=KEY)
    assert as_int(r[0]) != as_int(r[1])


def test_salt_changes_every_block():
    toks = np.arange(64, dtype=np.int32)
    plain = hash_blocks(toks, 16, key=KEY)
    a = hash_blocks(toks, 16, salt="tenant-a", key=KEY)
    b = hash_blocks(toks, 16, salt=b"tenant-b", key=KEY)
    assert not np.any(plain == a) and not np.any(a == b)
    assert not np.any(hash_blocks(toks, 16, salt="", key=KEY) == plain)  # "" is a salt
    long_salt = "x" * 200
    assert not np.any(hash_blocks(toks, 16, salt=long_salt, key=KEY) == plain)


def test_manager_hashes_match_hash_blocks():
    mgr = BlockManager(64, 4, hash_key=KEY)
    mgr.add("a", list(range(10)), salt="t")
    compute(mgr, "a")
    mgr.append("a", [10, 11, 12])
    compute(mgr, "a")
    mgr.append_batch(["a"], [13])
    compute(mgr, "a")
    assert np.array_equal(mgr.block_hashes("a"), hash_blocks(list(range(12)), 4, salt="t", key=KEY))
    mgr.append_batch(["a"], [14])
    compute(mgr, "a")
    mgr.append_batch(["a"], [15])
    compute(mgr, "a")
    assert np.array_equal(mgr.block_hashes("a"), hash_blocks(list(range(16)), 4, salt="t", key=KEY))
    for i, b in enumerate(mgr.block_table("a")):
        assert mgr.pool.block_hash(int(b)) == as_int(mgr.block_hashes("a")[i])


def test_hits_are_capped_to_compute_one_token():
    mgr = BlockManager(64, 4, hash_key=KEY)
    assert mgr.add("a", list(range(12))) == 0
    compute(mgr, "a")
    assert mgr.add("b", list(range(12))) == 8  # not 12: the last token is computed
    compute(mgr, "b")
    assert mgr.add("c", list(range(13))) == 12
    compute(mgr, "c")
    assert mgr.add("d", list(range(6)) + [99]) == 4
    compute(mgr, "d")
    assert mgr.block_table("c").tolist()[:3] == mgr.block_table("a").tolist()
    assert mgr.block_table("b").tolist()[:2] == mgr.block_table("a").tolist()[:2]
    s = mgr.pool.stats
    assert s.queries == 4 and s.hit_tokens == 24 and s.query_tokens == 12 + 12 + 13 + 7
    assert s.hit_rate == pytest.approx(24 / 44)
    mgr.check()


def test_salts_never_share():
    mgr = BlockManager(64, 4, hash_key=KEY)
    prompt = list(range(20))
    mgr.add("a", prompt, salt="tenant-a")
    compute(mgr, "a")
    assert mgr.add("b", prompt, salt="tenant-b") == 0
    compute(mgr, "b")
    assert mgr.add("c", prompt) == 0
    compute(mgr, "c")
    assert mgr.add("d", prompt, salt="tenant-a") == 16
    compute(mgr, "d")
    tables = [set(mgr.block_table(s).tolist()) for s in "abc"]
    assert not (tables[0] & tables[1]) and not (tables[0] & tables[2])


def test_lru_eviction_order_and_never_cached_first():
    mgr = BlockManager(10, 4, hash_key=KEY)  # 9 usable blocks
    mgr.add("a", list(range(12)))  # blocks 1,2,3 full and cached
    compute(mgr, "a")
    mgr.add("x", [1, 2])  # block 4, never cached
    compute(mgr, "x")
    mgr.free("a")  # tail first: 3, 2, 1 join the LRU tail
    mgr.free("x")  # uncached: head, reused first
    pool = mgr.pool
    assert pool.num_evictable == 3 and pool.num_free == 9
    assert pool.free_list().tolist()[0] == 4
    assert pool.free_list().tolist()[-3:] == [3, 2, 1]
    # allocating the 6 never-cached blocks evicts nothing
    mgr.add("y", list(range(100, 124)))
    compute(mgr, "y")
    assert pool.stats.evictions == 0 and pool.num_evictable == 3
    mgr.free("y")  # y's 6 full blocks are now cached too
    got = pool.allocate(7)  # 6 oldest cached of y... LRU order
    assert pool.stats.evictions == 7
    # the least recently released go first: a's tail block (3) before its head (1)
    assert got.tolist()[:3] == [3, 2, 1]
    pool.free(got)
    mgr.check()


def test_lookup_and_pin_survives_eviction_pressure():
    pool = BlockPool(9, hash_key=KEY)
    h = hash_blocks(list(range(32)), 4, key=KEY)  # 8 blocks
    ids = pool.allocate(8)
    pool.cache(ids, h)
    pool.free(ids[::-1])
    assert pool.num_evictable == 8
    hit = pool.lookup_and_pin(h[:3])  # atomic pin of the prefix
    assert hit.tolist() == ids[:3].tolist()
    assert pool.num_free == 5
    other = pool.allocate(5)  # evicts all the rest...
    assert not set(other.tolist()) & set(hit.tolist())  # ...but never a pinned hit
    with pytest.raises(kvblocks.OutOfBlocksError):
        pool.allocate(1)
    assert pool.lookup(h).tolist() == hit.tolist()  # the pinned prefix is cached
    assert pool.stats.evictions == 5
    pool.free(other)
    pool.free(hit[::-1])
    pool.check()


def test_lookup_is_not_pinned_and_lookup_stats():
    pool = BlockPool(6, hash_key=KEY)
    h = hash_blocks(list(range(8)), 4, key=KEY)
    ids = pool.allocate(2)
    pool.cache(ids, h)
    pool.free(ids)
    assert pool.lookup(h).tolist() == ids.tolist()
    assert pool.num_evictable == 2 and pool.ref_count(int(ids[0])) == 0
    assert pool.lookup(hash_blocks(list(range(1, 9)), 4, key=KEY)).tolist() == []
    s = pool.stats
    assert (s.queries, s.query_blocks, s.hit_blocks, s.hits) == (2, 4, 2, 2)
    assert s.hit_rate == 0.5 and s["evictions"] == 0


def test_identical_block_cached_twice_keeps_the_first():
    mgr = BlockManager(16, 4, hash_key=KEY)
    mgr.add("a", [1, 2, 3])
    compute(mgr, "a")
    mgr.add("b", [1, 2, 3])  # no full block yet: nothing shared
    compute(mgr, "b")
    mgr.append("a", [4])  # a's block 1 becomes full: cached
    compute(mgr, "a")
    mgr.append("b", [4])  # same content: the entry keeps a's block
    compute(mgr, "b")
    a0, b0 = int(mgr.block_table("a")[0]), int(mgr.block_table("b")[0])
    assert a0 != b0
    assert mgr.pool.is_cached(a0) and not mgr.pool.is_cached(b0)
    assert mgr.pool.num_cached == 1
    mgr.free("b")  # uncached: back at the head, reused first
    assert mgr.pool.free_list().tolist()[0] == b0
    assert mgr.add("c", [1, 2, 3, 4, 5]) == 4
    compute(mgr, "c")
    assert int(mgr.block_table("c")[0]) == a0
    mgr.check()


def test_duplicate_stays_uncached_after_the_first_copy_is_evicted():
    """Pins today's rule (docs/prefix-caching.md, "Duplicate full blocks"): the second copy
    of a full block never takes the entry, not even once the first copy is evicted, so the
    hash is gone while the second copy still holds its K/V, and the second sequence's next
    block is stored under a parent a router was told is removed. vLLM caches both copies
    (its chain stays reachable); its integration will need that behaviour."""
    mgr = BlockManager(6, 2, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", [1, 2, 3])
    mgr.add("b", [1, 2, 3])  # nothing cached yet: b computes its own copy
    mgr.schedule(["a", "b"], [3, 3])  # one step: a's block 0 first, b's is a duplicate
    a0, b0 = int(mgr.block_table("a")[0]), int(mgr.block_table("b")[0])
    assert mgr.pool.is_cached(a0) and not mgr.pool.is_cached(b0)
    (stored,) = mgr.pool.take_events()
    h0 = stored.block_hashes[0]
    mgr.free("a")
    mgr.add("x", [9] * 6)  # evicts a0, the entry's only block
    assert mgr.pool.take_events() == [BlockRemoved([h0])]
    assert not mgr.pool.is_cached(b0)  # the duplicate did not take the entry over
    assert len(mgr.pool.lookup(kvblocks.hash_from_int(h0)[None])) == 0
    mgr.free("x")
    mgr.append("b", [4])
    compute(mgr, "b")  # b's block 1 is cached, chained on the removed hash
    (ev,) = mgr.pool.take_events()
    assert ev.parent_block_hash == h0 and not mgr.pool.is_cached(b0)
    assert mgr.add("c", [1, 2, 3, 4, 5]) == 0  # the chain is unreachable from its start
    mgr.check()


def test_truncate_then_rewrite_drops_a_private_cached_block():
    mgr = BlockManager(16, 4, hash_key=KEY)
    mgr.add("a", list(range(8)))
    compute(mgr, "a")
    b1 = int(mgr.block_table("a")[1])
    assert mgr.pool.is_cached(b1)
    mgr.truncate("a", 6)  # block 1 partial again, entry still valid
    assert mgr.pool.is_cached(b1)
    mgr.append("a", [42])  # content changes: entry dropped, no copy
    compute(mgr, "a")
    assert not mgr.pool.is_cached(b1) and mgr.take_copies().size == 0
    mgr.add("b", list(range(8)) + [9])  # only block 0 hits now
    compute(mgr, "b")
    assert mgr.num_tokens("b") == 9 and mgr.pool.stats.hit_tokens == 4
    mgr.check()


def test_truncate_of_shared_block_copies_on_write():
    mgr = BlockManager(16, 4, hash_key=KEY)
    mgr.add("a", list(range(8)))
    compute(mgr, "a")
    mgr.add("b", list(range(9)))  # shares both full blocks of a
    compute(mgr, "b")
    assert mgr.block_table("b").tolist()[:2] == mgr.block_table("a").tolist()
    mgr.truncate("a", 6)
    mgr.append("a", [42])  # block 1 is shared with b: copy-on-write
    old = int(mgr.block_table("b")[1])
    new = int(mgr.block_table("a")[1])
    assert mgr.take_copies().tolist() == [[old, new]]
    assert mgr.pool.is_cached(old)  # b's block keeps its entry
    mgr.check()


def test_reset_prefix_cache():
    mgr = BlockManager(16, 4, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", list(range(8)))
    compute(mgr, "a")
    with pytest.raises(kvblocks.InvalidStateError):
        mgr.pool.reset_prefix_cache()
    mgr.free("a")
    mgr.pool.take_events()
    mgr.pool.reset_prefix_cache()
    assert mgr.pool.num_cached == 0 and mgr.pool.num_evictable == 0
    assert mgr.pool.take_events() == [AllBlocksCleared()]
    assert mgr.add("b", list(range(8))) == 0
    compute(mgr, "b")
    mgr.check()


def test_kv_events():
    mgr = BlockManager(6, 4, hash_key=KEY)
    mgr.add("a", list(range(8)))
    compute(mgr, "a")
    assert mgr.pool.take_events() == []  # off by default
    mgr.free("a")
    mgr.pool.reset_prefix_cache()
    mgr.pool.record_events = True
    mgr.add("a", list(range(9)), salt="t")
    compute(mgr, "a")
    h = [as_int(x) for x in mgr.block_hashes("a")]
    ev = mgr.pool.take_events()
    assert len(ev) == 1 and isinstance(ev[0], BlockStored)
    assert ev[0].block_hashes == h and ev[0].token_ids == list(range(8))
    assert ev[0].block_size == 4 and ev[0].medium == "GPU" and ev[0].lora_id is None
    assert ev[0].parent_block_hash is None  # a sequence's first block: nil
    assert ev[0].lora_name is None and ev[0].group_idx == 0
    mgr.append("a", [9, 10, 11])  # block 2 fills: chains on block 1
    compute(mgr, "a")
    ev = mgr.pool.take_events()
    assert ev[0].parent_block_hash == h[1] and ev[0].token_ids == [8, 9, 10, 11]
    all_h = [as_int(x) for x in mgr.block_hashes("a")]
    mgr.free("a")
    mgr.add("b", list(range(100, 120)))  # 5 blocks: evicts the 3 cached
    compute(mgr, "b")
    ev = mgr.pool.take_events()
    removed = [e for e in ev if isinstance(e, BlockRemoved)]
    assert len(removed) == 1  # consecutive removals are grouped
    assert removed[0].block_hashes == all_h[::-1]  # LRU: the tail block goes first
    assert [type(e) for e in ev] == [BlockRemoved, BlockStored]
    assert mgr.pool.take_events() == []
    mgr.check()


def test_events_of_a_prefix_hit_chain_on_the_hit():
    """A sequence that hits the cache stores only its new blocks, chained on the last hit."""
    mgr = BlockManager(16, 4, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", list(range(9)))
    compute(mgr, "a")
    (first,) = mgr.pool.take_events()
    assert first.parent_block_hash is None and len(first.block_hashes) == 2
    assert mgr.add("b", list(range(13))) == 8
    compute(mgr, "b")
    (ev,) = mgr.pool.take_events()
    assert ev.parent_block_hash == first.block_hashes[-1]
    assert ev.token_ids == list(range(8, 12)) and ev.block_size == 4


def test_cache_needs_token_ids_while_recording_events():
    pool = BlockPool(8, hash_key=KEY, enable_kv_events=True)
    ids = pool.allocate(2)
    h = hash_blocks(list(range(8)), 4, key=KEY)
    with pytest.raises(kvblocks.InvalidArgumentError, match="token_ids"):
        pool.cache(ids, h)
    assert pool.num_cached == 0 and pool.take_events() == []  # nothing changed
    assert pool.cache(ids, h, token_ids=list(range(8))) == 2
    (ev,) = pool.take_events()
    assert ev.parent_block_hash is None and ev.block_size == 4
    pool.record_events = False
    ids2 = pool.allocate(1)
    assert pool.cache(ids2, hash_blocks(list(range(4)), 4, key=KEY, salt="x")) == 1
    pool.check()


def test_coalesce_merges_chains_across_drains():
    from kvblocks.events import coalesce

    mgr = BlockManager(16, 4, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", list(range(4)))
    compute(mgr, "a")
    ev = mgr.pool.take_events()
    mgr.append("a", [4, 5, 6, 7])
    compute(mgr, "a")
    ev += mgr.pool.take_events()
    assert len(ev) == 2
    (one,) = coalesce(ev)
    assert one.block_hashes == ev[0].block_hashes + ev[1].block_hashes
    assert one.token_ids == list(range(8)) and one.parent_block_hash is None
    assert len(ev[0].block_hashes) == 1  # inputs untouched
    rm = [BlockRemoved([1]), BlockRemoved([2], group_idx=1), BlockRemoved([3], group_idx=1)]
    assert coalesce(rm) == [BlockRemoved([1]), BlockRemoved([2, 3], group_idx=1)]
    assert coalesce([AllBlocksCleared(), AllBlocksCleared()]) == [AllBlocksCleared()] * 2
    with pytest.raises(kvblocks.InvalidTypeError):
        coalesce([object()])


def test_pool_level_engine_flow():
    """vLLM-style use: hash, lookup_and_pin, allocate the rest, cache, free in reverse."""
    pool = BlockPool(32, hash_key=KEY)
    prompt = np.arange(50, dtype=np.int32)
    h = hash_blocks(prompt, 16, key=KEY)
    assert pool.lookup_and_pin(h).size == 0
    ids = pool.allocate(4)
    assert pool.cache(ids[:3], h, token_ids=prompt[:48]) == 3
    pool.free(ids[::-1])
    hit = pool.lookup_and_pin(h)
    assert hit.tolist() == ids[:3].tolist()
    assert pool.cache(pool.allocate(1), h[:1]) == 0  # present already: first block wins
    pool.check()


@pytest.mark.slow
def test_no_collision_among_ten_million_blocks():
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 2**31 - 1, size=10_000_000, dtype=np.int32)
    h = hash_blocks(toks, 1, key=KEY)  # 10M chained one-token blocks
    lo = np.sort(h[:, 0])
    assert not np.any(lo[1:] == lo[:-1])  # even the low 64 bits never collide
    hi = np.sort(h[:, 1])
    assert not np.any(hi[1:] == hi[:-1])
