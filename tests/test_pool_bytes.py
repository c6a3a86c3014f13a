"""BlockPool's calls over vLLM's bytes block hashes: lookup_bytes, cache_bytes,
num_unreferenced, touch, free_to, uncache (the vLLM adapter's native path)."""

import numpy as np
import pytest

from kvblocks import BlockPool, InvalidArgumentError, InvalidStateError, InvalidTypeError


def _keys(hs):
    """The (n, 2) uint64 keys lookup() takes for bytes hashes: their first 16 bytes."""
    return np.array([np.frombuffer(h[:16].ljust(16, b"\0"), dtype=np.uint64) for h in hs])


def _h(i, width=32):
    return bytes([i]) * width


def test_cache_bytes_and_lookup_bytes_match_the_array_keys():
    pool = BlockPool(16)
    hs = [_h(i) for i in range(1, 6)]
    full = np.zeros((16, 4), dtype=np.uint64)
    mark = np.zeros(16, dtype=np.bool_)
    ids = pool.allocate(4)
    assert pool.cache_bytes(ids, hs, full=full, mark=mark) == 4
    assert mark.tolist() == [False, True, True, True, True] + [False] * 11
    assert full[ids].tobytes() == b"".join(hs[:4])
    assert pool.lookup(_keys(hs)).tolist() == ids.tolist()
    assert pool.lookup_bytes(hs, full=full).tolist() == ids.tolist()
    assert pool.lookup_bytes(hs, 2).tolist() == ids[:2].tolist()
    assert pool.lookup_bytes(hs, start=2, full=full).tolist() == ids[2:].tolist()
    assert pool.lookup_bytes(hs, 3, start=3).tolist() == []
    assert pool.lookup_bytes(hs, group=1).tolist() == []


def test_lookup_bytes_checks_the_full_width():
    pool = BlockPool(8)
    full = np.zeros((8, 4), dtype=np.uint64)
    hs = [_h(1), _h(2), _h(3)]
    ids = pool.allocate(3)
    pool.cache_bytes(ids, hs, full=full)
    other = [hs[0], hs[1][:16] + b"\x09" * 16, hs[2]]  # same key, other tail
    assert pool.lookup_bytes(other).tolist() == ids.tolist()  # keys only
    assert pool.lookup_bytes(other, full=full).tolist() == ids[:1].tolist()
    full[ids[0]] = 0  # the caller drops an entry: no hit from there
    assert pool.lookup_bytes(hs, full=full).tolist() == []


def test_short_hashes_are_zero_padded():
    pool = BlockPool(8)
    hs = [b"\x01" * 8, b"\x02" * 20]
    ids = pool.allocate(2)
    assert pool.cache_bytes(ids, hs) == 2
    assert pool.lookup(_keys(hs)).tolist() == ids.tolist()
    assert pool.lookup_bytes(hs).tolist() == ids.tolist()


def test_cache_bytes_keeps_the_first_block_of_a_key_and_fills_full_of_all():
    pool = BlockPool(8)
    full = np.zeros((8, 4), dtype=np.uint64)
    mark = np.zeros(8, dtype=np.uint8)
    a, b = pool.allocate(2).tolist()
    assert pool.cache_bytes([a], [_h(1)], full=full, mark=mark) == 1
    assert pool.cache_bytes([b], [_h(7), _h(1)], 1, full=full, mark=mark) == 0
    assert not pool.is_cached(b) and mark[b] == 1 and full[b].tobytes() == _h(1)
    assert pool.lookup_bytes([_h(1)]).tolist() == [a]


def test_cache_bytes_failures_change_nothing():
    pool = BlockPool(8)
    full = np.zeros((8, 4), dtype=np.uint64)
    mark = np.zeros(8, dtype=np.bool_)
    ids = pool.allocate(2)
    hs = [_h(1), _h(2)]
    bad = [
        (InvalidTypeError, dict(hashes=tuple(hs))),
        (InvalidTypeError, dict(hashes=[_h(1), "x" * 32])),
        (InvalidArgumentError, dict(hashes=hs[:1])),
        (InvalidArgumentError, dict(start=1)),
        (InvalidArgumentError, dict(start=-1)),
        (InvalidArgumentError, dict(hashes=[_h(1), _h(2, 16)], full=full)),
        (InvalidArgumentError, dict(full=np.zeros((7, 4), dtype=np.uint64))),
        (InvalidArgumentError, dict(full=np.zeros((8, 2), dtype=np.uint64))),
        (InvalidArgumentError, dict(full=np.zeros((8, 4), dtype=np.int64))),
        (InvalidArgumentError, dict(mark=np.zeros(8, dtype=np.int32))),
        (InvalidArgumentError, dict(mark=np.zeros(7, dtype=np.bool_))),
        (InvalidArgumentError, dict(ids=[1, 99])),
        (InvalidStateError, dict(ids=[1, 5])),  # block 5 is free
    ]
    for exc, kw in bad:
        args = dict(ids=ids, hashes=hs, start=0, full=full, mark=mark)
        args.update(kw)
        with pytest.raises(exc):
            pool.cache_bytes(args.pop("ids"), args.pop("hashes"), args.pop("start"), **args)
        assert pool.num_cached == 0 and not mark.any() and not full.any()
    pool.record_events = True
    with pytest.raises(InvalidStateError):
        pool.cache_bytes(ids, hs)
    assert BlockPool(4, enable_prefix_caching=False).lookup_bytes([_h(1)]).tolist() == []
    with pytest.raises(InvalidStateError):
        nc = BlockPool(4, enable_prefix_caching=False)
        nc.cache_bytes(nc.allocate(1), [_h(1)])
    pool.check()


def test_lookup_bytes_failures():
    pool = BlockPool(8)
    with pytest.raises(InvalidTypeError):
        pool.lookup_bytes((_h(1),))
    with pytest.raises(InvalidTypeError):
        pool.lookup_bytes([_h(1), 3])
    with pytest.raises(InvalidArgumentError):
        pool.lookup_bytes([_h(1)], 2)
    with pytest.raises(InvalidArgumentError):
        pool.lookup_bytes([_h(1)], start=2)
    with pytest.raises(InvalidArgumentError):
        pool.lookup_bytes([_h(1, 16)], full=np.zeros((8, 4), dtype=np.uint64))
    with pytest.raises(InvalidArgumentError):
        pool.lookup_bytes([_h(1)], full=np.zeros((8, 3), dtype=np.uint64))
    with pytest.raises(InvalidArgumentError):
        pool.lookup_bytes([_h(1)], group=255)
    assert pool.lookup_bytes([]).tolist() == []


def test_num_unreferenced():
    pool = BlockPool(8)
    ids = pool.allocate(3)
    pool.free(ids[:1])
    assert pool.num_unreferenced([0, 1, 2, 3, 4]) == 2  # 1 (freed) and 4
    assert pool.num_unreferenced([]) == 0
    with pytest.raises(InvalidArgumentError):
        pool.num_unreferenced([1, 8])
    with pytest.raises(InvalidArgumentError):
        pool.num_unreferenced([-1])


def test_touch_takes_any_free_block_off_the_list():
    pool = BlockPool(8)
    ids = pool.allocate(3)  # 1, 2, 3
    pool.cache(ids[:1], np.array([[5, 5]], dtype=np.uint64))
    pool.free(ids)  # 2, 3 to the head (uncached), 1 to the tail (cached)
    order = pool.free_list().tolist()
    with pytest.raises(InvalidStateError):
        pool.incref([2])  # incref refuses a free uncached block
    pool.touch([2, 1, 5, 5])
    assert [pool.ref_count(b) for b in (1, 2, 5)] == [1, 1, 2]
    assert pool.free_list().tolist() == [b for b in order if b not in (1, 2, 5)]
    assert pool.num_evictable == 0 and pool.num_free == 4 and pool.is_cached(1)
    pool.check()
    pool.free([2, 1, 5, 5])
    pool.check()
    assert pool.num_free == 7 and pool.num_evictable == 1


def test_touch_failures_change_nothing():
    pool = BlockPool(8)
    before = pool.free_list().tolist()
    for bad in ([3, 0], [3, 8], [3, -1]):
        with pytest.raises(InvalidArgumentError):
            pool.touch(bad)
        assert pool.free_list().tolist() == before and pool.ref_count(3) == 0
    with pytest.raises(InvalidTypeError):
        pool.touch([1.5])
    pool.touch([])
    pool.check()


def test_reset_prefix_cache_keep_order():
    for keep in (False, True):
        pool = BlockPool(8)
        ids = pool.allocate(4)
        pool.cache(ids[1:3], np.array([[1, 1], [2, 2]], dtype=np.uint64))
        pool.free(ids)  # 4, 1 at the head; 2, 3 (cached) at the tail
        before = pool.free_list().tolist()
        pool.reset_prefix_cache(keep_order=keep)
        assert pool.num_cached == 0 and pool.num_evictable == 0 and pool.num_free == 7
        after = pool.free_list().tolist()
        assert after == (before if keep else [3, 2] + [b for b in before if b not in (2, 3)])
        pool.check()


def test_reset_prefix_cache_keep_order_refuses_referenced_cached_blocks():
    pool = BlockPool(8)
    ids = pool.allocate(2)
    pool.cache(ids, np.array([[1, 1], [2, 2]], dtype=np.uint64))
    pool.free(ids[:1])
    before = pool.free_list().tolist()
    with pytest.raises(InvalidStateError):
        pool.reset_prefix_cache(keep_order=True)
    assert pool.num_cached == 2 and pool.free_list().tolist() == before
    pool.check()


def test_key_salt_keys_one_hash_once_per_salt():
    """key_salt XORs into the key's second 8 bytes (the vLLM adapter's per-group keys): the
    same hash caches one block per salt, found only with its salt, and the array keys are
    the salted ones."""
    pool = BlockPool(16)
    hs = [_h(i) for i in range(1, 4)]
    full = np.zeros((16, 4), dtype=np.uint64)
    a, b = pool.allocate(3), pool.allocate(3)
    assert pool.cache_bytes(a, hs, full=full) == 3
    assert pool.cache_bytes(b, hs, full=full, group=1, key_salt=0x1234) == 3
    assert full[b].tobytes() == b"".join(hs)  # the full hash is unsalted
    assert pool.lookup_bytes(hs, full=full).tolist() == a.tolist()
    assert pool.lookup_bytes(hs, full=full, group=1, key_salt=0x1234).tolist() == b.tolist()
    assert pool.lookup_bytes(hs, full=full, group=1).tolist() == []
    salted = _keys(hs)
    salted[:, 1] ^= np.uint64(0x1234)
    assert pool.lookup(salted, group=1).tolist() == b.tolist()


def test_free_to_places_every_block_at_the_head_or_the_tail():
    pool = BlockPool(8)
    ids = pool.allocate(4)  # 1, 2, 3, 4; free list 5, 6, 7
    pool.cache(ids[:2], np.array([[1, 1], [2, 2]], dtype=np.uint64))
    pool.incref([3])
    # head: the blocks reaching 0 in front, in the given order (vLLM's evict_first), the
    # cached one keeping its entry; 3 keeps a reference
    pool.free_to([2, 3, 1], "head")
    assert pool.free_list().tolist() == [2, 1, 5, 6, 7]
    assert pool.is_cached(2) and pool.num_evictable == 2 and pool.ref_count(3) == 1
    # tail: in order, uncached ones too; a repeated id is placed where it reaches 0
    pool.incref([4])
    pool.free_to([4, 3, 4], "tail")
    assert pool.free_list().tolist() == [2, 1, 5, 6, 7, 3, 4]
    pool.check()
    assert pool.allocate(1).tolist() == [2] and not pool.is_cached(2)  # evicted when popped


def test_free_to_failures_change_nothing():
    pool = BlockPool(8)
    ids = pool.allocate(2)
    before = pool.free_list().tolist()
    for bad in ([1, 0], [1, 9], [1, 1], [1, 3]):  # null, range, one reference short, free
        with pytest.raises((InvalidArgumentError, InvalidStateError)):
            pool.free_to(bad, "head")
        assert pool.free_list().tolist() == before and pool.ref_count(1) == 1
    with pytest.raises(InvalidArgumentError):
        pool.free_to(ids, "front")
    assert pool.ref_count(2) == 1
    pool.check()


def test_uncache_drops_entries_and_free_blocks_keep_their_place():
    pool = BlockPool(8)
    hs = [_h(i) for i in (1, 2, 3)]
    full = np.zeros((8, 4), dtype=np.uint64)
    ids = pool.allocate(3).tolist()  # 1, 2, 3
    assert pool.cache_bytes(ids, hs, full=full) == 3
    pool.free(ids[:2])  # 1, 2 cached: to the tail
    assert pool.free_list().tolist() == [4, 5, 6, 7, 1, 2] and pool.num_evictable == 2
    # 1 free (keeps its place, no longer evictable), 3 held, 5 without an entry: 2 dropped
    assert pool.uncache([1, 3, 5]) == 2
    assert pool.free_list().tolist() == [4, 5, 6, 7, 1, 2] and pool.num_evictable == 1
    assert pool.lookup_bytes(hs, full=full).tolist() == []
    pool.free([3])  # without an entry now: to the head
    assert pool.free_list().tolist()[0] == 3
    with pytest.raises(InvalidArgumentError):
        pool.uncache([2, 0])  # the null block: nothing changed
    assert pool.is_cached(2)
    pool.check()
