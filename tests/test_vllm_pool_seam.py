"""The native pool calls behind vLLM's BlockPool seam, beside vLLM's own pool: duplicate
entries under one key, ``move_block_hashes``, ``reset_prefix_cache() -> False`` and a pool of
the null block alone; skipped unless vllm (0.34) is importable."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_manager")
pytest.importorskip("torch")

from test_vllm_integration import managers, request  # noqa: E402


def _free_ids(m):
    return [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]


def test_duplicates_hit_the_earliest_block_and_survive_its_eviction():
    """A prompt computed again while its blocks are cached (the second request misses them:
    the hit is capped one token short) caches duplicate blocks; lookups give the earliest,
    and evicting it leaves the duplicate hitting, as vLLM's map does."""
    ref, kvb = managers(32, enable_kv_cache_events=True)
    toks = list(range(1, 14))  # 3 full blocks of 4
    for m in (ref, kvb):
        for rid in ("a", "b"):
            r = request(rid, toks)
            m.allocate_slots(r, r.num_tokens)  # no lookup: both compute every block
    a = kvb.get_block_ids("a")[0]
    b = kvb.get_block_ids("b")[0]
    assert a == ref.get_block_ids("a")[0] and b == ref.get_block_ids("b")[0]
    assert kvb.block_pool.native.num_cached == 6  # every block its own entry
    for m in (ref, kvb):
        blocks, hit, _ = m.get_computed_blocks(request("p", toks))
        assert hit == 12 and blocks.get_block_ids()[0] == a[:3]
        m.evict_blocks({a[0]})
        blocks, hit, _ = m.get_computed_blocks(request("q", toks))
        assert blocks.get_block_ids()[0][:1] == [b[0]]
    assert [m.get_computed_blocks(request("s", toks))[1] for m in (ref, kvb)] == [12, 12]
    for m in (ref, kvb):
        m.free(request("a", toks))
        m.free(request("b", toks))
    assert _free_ids(ref) == _free_ids(kvb)
    assert ref.take_events() == kvb.take_events()
    kvb.block_pool.native.check()


def test_move_block_hashes_as_in_vllm():
    ref, kvb = managers(16, enable_kv_cache_events=True)
    toks = list(range(1, 14))
    for m in (ref, kvb):
        r = request("x", toks)
        m.allocate_slots(r, r.num_tokens)
    ids = kvb.get_block_ids("x")[0]
    assert ids == ref.get_block_ids("x")[0]
    hashes = request("x", toks).block_hashes
    moved = []
    for m in (ref, kvb):
        pool = m.block_pool
        cow, spare = pool.get_new_blocks(2)
        pool.move_block_hashes(pool.blocks[ids[1]], cow)
        pool.move_block_hashes(pool.blocks[ids[3]], spare)  # uncached source: nothing moves
        moved.append(cow.block_id)
        assert pool.blocks[ids[1]].block_hash is None and spare.block_hash is None
        pool.free_blocks([spare])
        assert pool.get_cached_block(hashes[1], [0])[0].block_id == cow.block_id
    assert moved[0] == moved[1]
    got = [m.get_computed_blocks(request("y", toks))[0].get_block_ids()[0] for m in (ref, kvb)]
    assert got[0] == got[1] == [ids[0], moved[0], ids[2]]
    for m in (ref, kvb):
        blocks = m.block_pool.blocks
        with pytest.raises(AssertionError):  # vLLM's: the destination holds no hash
            m.block_pool.move_block_hashes(blocks[ids[0]], blocks[moved[0]])
    for m in (ref, kvb):
        m.free(request("x", toks))
        m.block_pool.free_blocks([m.block_pool.blocks[moved[0]]])
    assert _free_ids(ref) == _free_ids(kvb)
    assert ref.take_events() == kvb.take_events()  # no event for a move
    kvb.block_pool.native.check()


def test_reset_prefix_cache_returns_false_while_blocks_are_in_use(caplog):
    ref, kvb = managers(16, enable_kv_cache_events=True)
    toks = list(range(1, 10))
    for m in (ref, kvb):
        r = request("r", toks)
        m.allocate_slots(r, r.num_tokens)
    with caplog.at_level(logging.WARNING):
        assert [m.reset_prefix_cache() for m in (ref, kvb)] == [False, False]
    assert kvb.block_pool.native.num_cached == 2
    for m in (ref, kvb):
        m.free(request("r", toks))
    assert [m.reset_prefix_cache() for m in (ref, kvb)] == [True, True]
    assert kvb.block_pool.native.num_cached == 0
    assert _free_ids(ref) == _free_ids(kvb)
    assert ref.take_events() == kvb.take_events()


def test_a_pool_of_the_null_block_alone_is_native():
    ref, kvb = managers(1)
    assert kvb.native
    for m in (ref, kvb):
        r = request("n", list(range(1, 6)))
        assert m.get_computed_blocks(r)[1] == 0
        assert m.allocate_slots(r, r.num_tokens) is None
        assert m.block_pool.get_num_free_blocks() == 0
        assert m.reset_prefix_cache()
    assert kvb.usage == ref.usage == 0
