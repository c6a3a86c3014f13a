"""The host tier of the prefix cache (docs/host-tier.md): demotion on eviction, host hits
with onloads, host LRU, write-through, the drain order, swap sharing the host pool, stats,
CPU events, bad input; and the K/V bytes read back through kvblocks.ops in every case."""

import numpy as np
import pytest
from helpers import KEY

import kvblocks
import kvblocks._core
from kvblocks import (
    BlockManager,
    BlockRemoved,
    BlockStored,
    CorruptionError,
    HostStats,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    OutOfBlocksError,
    ops,
)
from kvblocks.events import encode_batch
from kvblocks.testing import EngineMachine, KVReadback


def tier(num_blocks=5, block_size=2, host=4, **kw):
    kw.setdefault("host_prefix_cache", True)
    return BlockManager(num_blocks, block_size, num_host_blocks=host, hash_key=KEY, **kw)


def computed(mgr, seq, n):
    """Declare the step that computes seq's n committed tokens (no offloads may be pending)."""
    mgr.schedule([seq], [n])


# -- demotion ----------------------------------------------------------------------------------
def test_eviction_demotes_to_the_host_and_queues_an_offload():
    mgr = tier()
    mgr.add("a", [1, 2, 3, 4, 5])  # blocks 1, 2 full, 3 partial
    computed(mgr, "a", 5)
    mgr.free("a")  # 1, 2 evictable (tail), 3 reused first
    assert mgr.pool.num_evictable == 2
    mgr.add("b", [9, 9, 9, 9, 9, 9, 9])  # 4 blocks: 3, 4, then evicts 1 and 2
    pairs = mgr.take_offloads()
    assert pairs[:, 0].tolist() == [2, 1]  # device blocks, in eviction order (tail first)
    assert sorted(pairs[:, 1].tolist()) == [1, 2]  # fresh host blocks
    s = mgr.host_stats
    assert (s.demotions, s.offloads, s.dropped, s.stored) == (2, 2, 0, 2)
    assert mgr.host_pool.num_cached == 2 and mgr.host_pool.num_evictable == 2
    assert mgr.pool.stats.evictions == 2
    mgr.check()


def test_offload_holds_its_host_block_until_drained():
    mgr = tier()
    mgr.add("a", [1, 2, 3])
    computed(mgr, "a", 3)
    mgr.free("a")
    mgr.add("b", [5, 6, 7, 8, 9, 10, 11])  # evicts a's block
    assert mgr.num_pending_offloads == 1
    host_block = 1
    assert mgr.host_pool.ref_count(host_block) == 1  # the hold: never evicted or reused
    assert mgr.host_pool.num_free == 2
    mgr.check()
    with pytest.raises(InvalidStateError, match="offloads"):
        mgr.metadata(["b"], [7])  # the forward would run before the offload
    with pytest.raises(InvalidStateError, match="take_offloads"):
        mgr.take_onloads()
    with pytest.raises(InvalidStateError, match="take_offloads"):
        mgr.take_copies()
    mgr.take_offloads()
    assert mgr.host_pool.ref_count(host_block) == 0 and mgr.host_pool.num_evictable == 1
    mgr.metadata(["b"], [7])
    mgr.check()


def test_a_hash_already_on_the_host_costs_no_copy():
    mgr = tier(num_blocks=4, host=6)
    for _ in range(2):  # the same prompt twice, evicted twice
        mgr.add("a", [1, 2, 3])
        mgr.take_offloads(), mgr.take_onloads()
        computed(mgr, "a", 3)
        mgr.free("a")
        mgr.add("x", [7, 7, 7, 7, 7, 7])  # takes every device block: evicts a's
        mgr.take_offloads()
        mgr.free("x")
    s = mgr.host_stats
    assert s.demotions == 2 and s.offloads == 1 and s.onloads == 1
    mgr.check()


def test_host_full_of_swapped_blocks_drops_the_demotion():
    """Swapped-out sequences and the host cache share the host pool; swapped blocks are
    referenced, never evicted: with no host block free an eviction is dropped, counted."""
    mgr = tier(num_blocks=6, host=3)
    mgr.add("s", [1, 2, 3])
    computed(mgr, "s", 3)
    mgr.swap_out("s")  # both host blocks
    mgr.add("a", [4, 5, 6])
    computed(mgr, "a", 3)
    mgr.free("a")
    mgr.add("b", [8] * 10)  # evicts a's cached block (and s's, cached on the device)
    s = mgr.host_stats
    assert s.offloads == 0 and s.dropped == 2
    assert mgr.host_pool.num_cached == 0
    assert mgr.block_table("s").tolist() == [1, 2]  # host blocks, untouched
    mgr.check()


def test_swap_out_evicts_host_cache_entries_but_never_swapped_blocks():
    mgr = tier(num_blocks=6, host=4)
    mgr.add("a", [1, 2, 3, 4, 5])
    computed(mgr, "a", 5)
    mgr.free("a")
    mgr.add("x", [9] * 10)  # demotes a's two blocks: the host is full (3 usable)
    mgr.take_offloads()
    assert mgr.host_pool.num_cached == 2
    mgr.free("x")
    mgr.add("s", [6, 7])
    computed(mgr, "s", 2)
    mgr.swap_out("s")  # 1 host block: the never-cached one first
    assert mgr.host_pool.num_cached == 2
    for i, seq in enumerate(["t", "u"]):  # each evicts the LRU host entry
        mgr.add(seq, [3, 3 + i])
        computed(mgr, seq, 2)
        mgr.swap_out(seq)
        assert mgr.host_pool.num_cached == 1 - i and mgr.host_stats.evictions == 1 + i
    mgr.add("v", [4, 4])
    with pytest.raises(OutOfBlocksError):  # swapped blocks are never taken
        mgr.swap_out("v")
    assert [mgr.is_swapped(s) for s in "stuv"] == [True, True, True, False]
    mgr.check()


# -- host hits -----------------------------------------------------------------------------------
def demoted_prompt(mgr, tokens):
    """Compute tokens as "a", free it and push its blocks to the host; drains everything."""
    mgr.add("a", tokens)
    computed(mgr, "a", len(tokens))
    mgr.free("a")
    mgr.add("x", [99] * (2 * (mgr.pool.num_blocks - 1)))
    mgr.take_offloads()
    mgr.free("x")


def test_a_prompt_continues_on_the_host():
    mgr = tier(num_blocks=5, host=6)
    demoted_prompt(mgr, [1, 2, 3, 4, 5])
    assert mgr.probe([1, 2, 3, 4, 5, 6]) == (4, 3)
    cached = mgr.add("b", [1, 2, 3, 4, 5, 6])
    assert cached == 4 and mgr.num_computed("b") == 4
    pairs = mgr.take_onloads()
    table = mgr.block_table("b").tolist()
    assert pairs[:, 1].tolist() == table[:2]  # fresh device blocks for the two host hits
    s = mgr.host_stats
    assert (s.hits, s.hit_tokens, s.onloads) == (2, 4, 2)
    assert mgr.pool.stats.hit_tokens == 0  # device-tier hits are counted apart
    assert s.hit_rate == 4 / mgr.pool.stats.query_tokens
    mgr.metadata(["b"], [2])
    mgr.check()


def test_onload_holds_both_blocks_until_drained():
    mgr = tier(num_blocks=5, host=6)
    demoted_prompt(mgr, [1, 2, 3])
    mgr.add("b", [1, 2, 3])
    h, d = mgr_pair(mgr)  # drained: both holds released
    assert mgr.host_pool.ref_count(h) == 0 and mgr.pool.ref_count(d) == 1
    mgr.check()


def mgr_pair(mgr):
    """The one pending onload, checked for its holds before it is drained."""
    assert mgr.num_pending_onloads == 1
    seq_block = int(mgr.block_table("b")[0])
    assert mgr.pool.ref_count(seq_block) == 2  # the sequence + the onload's hold
    hb = [b for b in range(1, mgr.host_pool.num_blocks) if mgr.host_pool.ref_count(b)]
    assert len(hb) == 1  # pinned: the host LRU cannot evict it
    mgr.check()
    pairs = mgr.take_onloads()
    assert pairs.tolist() == [[hb[0], seq_block]]
    return hb[0], seq_block


def test_host_hits_enter_the_device_cache_at_once():
    """A second prompt in the same step shares the onloaded blocks instead of loading again."""
    mgr = tier(num_blocks=8, host=6)
    demoted_prompt(mgr, [1, 2, 3, 4, 5])
    assert mgr.add("b", [1, 2, 3, 4, 5]) == 4
    assert mgr.add("c", [1, 2, 3, 4, 9]) == 4  # device hits now
    assert mgr.num_pending_onloads == 2
    assert mgr.block_table("c").tolist()[:2] == mgr.block_table("b").tolist()[:2]
    assert mgr.pool.stats.hit_tokens == 4 and mgr.host_stats.hit_tokens == 4
    mgr.check()


def test_out_of_blocks_with_host_hits_changes_nothing():
    mgr = tier(num_blocks=5, host=6)
    demoted_prompt(mgr, [1, 2, 3, 4, 5])
    mgr.add("y", [7, 7, 7])
    before = (mgr.host_stats, mgr.pool.num_free, mgr.host_pool.ref_counts().tolist())
    with pytest.raises(OutOfBlocksError):
        mgr.add("b", [1, 2, 3, 4, 5, 6, 7])  # 4 blocks, 2 free: after the host match
    assert (mgr.host_stats, mgr.pool.num_free, mgr.host_pool.ref_counts().tolist()) == before
    assert mgr.num_pending_onloads == 0 and "b" not in mgr
    mgr.check()


def test_host_lru_evicts_the_least_recently_used_entry():
    mgr = tier(num_blocks=4, block_size=2, host=3)  # two host blocks
    for seq, toks in (("a", [1, 2, 0]), ("b", [3, 4, 0]), ("c", [5, 6, 0])):
        mgr.add(seq, toks)
        mgr.take_offloads(), mgr.take_onloads()
        computed(mgr, seq, 3)
        mgr.free(seq)
        mgr.add("x", [9] * 6)  # evicts seq's full block: demoted
        mgr.take_offloads()
        mgr.free("x")
        if seq == "b":  # touch a on the host: b becomes the LRU entry
            assert mgr.add("a2", [1, 2, 0]) == 2
            mgr.take_onloads()
            mgr.free("a2")
            mgr.add("x", [9] * 6)
            mgr.take_offloads()
            mgr.free("x")
    assert mgr.probe([1, 2, 0])[0] == 2  # a survived
    assert mgr.probe([3, 4, 0])[0] == 0  # b was evicted
    assert mgr.probe([5, 6, 0])[0] == 2
    assert mgr.host_stats.evictions == 1
    mgr.check()


# -- write-through -------------------------------------------------------------------------------
def test_write_through_copies_each_new_cached_block_at_once():
    mgr = tier(num_blocks=6, host=6, host_write_through=True)
    assert mgr.host_write_through
    mgr.add("a", [1, 2, 3, 4, 5])
    mgr.metadata(["a"], [5])  # blocks 1, 2 become cached: both written through
    pairs = mgr.take_offloads()
    assert pairs[:, 0].tolist() == mgr.block_table("a").tolist()[:2]
    mgr.free("a")
    mgr.add("x", [9] * 10)  # evicts them: already on the host, no copy
    assert mgr.num_pending_offloads == 0
    s = mgr.host_stats
    assert (s.offloads, s.demotions) == (2, 2)
    mgr.check()


def test_write_back_copies_only_on_eviction():
    mgr = tier(num_blocks=6, host=6)
    mgr.add("a", [1, 2, 3, 4, 5])
    mgr.metadata(["a"], [5])
    assert mgr.num_pending_offloads == 0
    mgr.free("a")
    mgr.add("x", [9] * 10)
    assert mgr.num_pending_offloads == 2
    mgr.check()


# -- bytes read back -----------------------------------------------------------------------------
def engine(num_blocks=6, block_size=2, host=8, **kw):
    mgr = tier(num_blocks, block_size, host, **kw)
    return mgr, KVReadback(mgr)


@pytest.mark.parametrize("write_through", [False, True])
def test_a_prompt_served_from_the_host_reads_back_its_kv(write_through):
    mgr, rb = engine(host=12, host_write_through=write_through)
    rb.add("a", [1, 2, 3, 4, 5, 6, 7])
    rb.drain()
    rb.forward(["a"])
    rb.free("a")
    rb.add("x", [50 + i for i in range(10)])  # evicts every block of a
    rb.drain()
    rb.forward(["x"])
    rb.free("x")
    cached = rb.add("b", [1, 2, 3, 4, 5, 6, 7, 8])
    assert cached == 6 and mgr.host_stats.hits == 3
    rb.drain()  # offloads, onloads: b's first blocks arrive from the host
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


def test_block_offloaded_and_reused_as_onload_destination_in_one_step():
    """Device block X is evicted (offload X -> h) and handed out again in the same step as
    the destination of an onload. The offload list runs first: h gets X's old bytes, then
    X gets the onloaded ones, and both read back."""
    mgr, rb = engine(num_blocks=4, block_size=2, host=8)
    rb.add("a", [1, 2, 3])  # block 1 full, 2 partial
    rb.drain()
    rb.forward(["a"])
    rb.free("a")
    rb.add("x", [7, 8, 9, 10, 11, 12])  # 3 blocks: evicts a's block 1
    rb.drain()
    rb.forward(["x"])
    rb.free("x")  # x's three full blocks evictable, its last one first
    rb.add("b", [1, 2, 5])  # a's block is on the host: onload into a fresh block, which
    offloads = mgr.take_offloads()  # evicts one of x's cached blocks: offloaded first
    onloads = mgr.take_onloads()
    assert len(offloads) == 2 and len(onloads) == 1
    assert onloads[0, 1] == offloads[0, 0]  # the same device block, both ways
    assert onloads[0, 1] == mgr.block_table("b")[0]
    ops.swap_blocks(rb.cache, rb.host, offloads)  # the drain: offloads, then onloads
    ops.swap_blocks(rb.host, rb.cache, onloads)
    rb.assert_all()
    rb.forward(["b"])
    rb.assert_all()
    rb.free("b")
    assert rb.add("y", [7, 8, 9, 10, 0]) == 4  # x's 1st block on the device, 2nd on the host
    rb.drain()
    rb.forward(["y"])
    rb.assert_all()
    mgr.check()


def test_swap_in_destination_evicted_before_the_drain_is_dropped_not_offloaded():
    """A swap-in destination's bytes arrive with the swap pair, after the offloads: if it is
    evicted in the same step, offloading it would copy whatever the block held before to the
    host, under s's hash. The assertion is the hazard itself: s's prefix is on no cache tier
    but the one that block would fill, so a prompt of the same tokens reads back the bytes
    the host block holds (a garbage offload would serve x's K/V as s's)."""
    mgr, rb = engine(num_blocks=8, block_size=2, host=8)
    rb.add("s", [1, 2, 3, 4, 5])
    rb.drain()
    rb.forward(["s"])
    rb.swap_out("s")
    rb.drain()
    mgr.pool.reset_prefix_cache()  # s's device copies lose their entries (none demoted)
    rb.add("x", list(range(50, 64)))  # every device block now holds x's K/V ...
    rb.drain()
    rb.forward(["x"])
    rb.free("x")
    mgr.pool.reset_prefix_cache()  # ... and none is a cache entry
    assert mgr.host_pool.num_cached == 0  # s's prefix is on no tier
    rb.swap_in("s")  # fresh device blocks (x's bytes until the drain), cached again at once
    rb.free("s")  # ... and evictable before the drain
    rb.add("z", [7] * 14)  # takes every device block: evicts them (not demoted: in flight)
    rb.drain()
    rb.forward(["z"])
    rb.assert_all()
    mgr.check()
    rb.free("z")
    rb.add("s2", [1, 2, 3, 4, 0])  # whatever a tier serves of s's prefix must be s's K/V
    rb.drain()
    rb.forward(["s2"])
    rb.assert_all()
    mgr.check()


def test_swap_in_destination_evicted_before_the_drain_reads_back():
    """The same hazard with s's prefix also demoted to the host before: the host entry stays
    the first copy, and every prompt of s's tokens reads back exactly."""
    mgr, rb = engine(num_blocks=5, block_size=2, host=8)
    rb.add("s", [1, 2, 3, 4])
    rb.drain()
    rb.forward(["s"])
    rb.swap_out("s")
    rb.drain()
    rb.add("x", [9, 9, 9, 9, 9, 9, 9, 9])  # evicts s's device copies: demoted to the host
    rb.drain()
    rb.forward(["x"])
    rb.free("x")
    rb.swap_in("s")  # fresh device blocks, cached again at once
    rb.free("s")  # ... and evictable before the drain
    rb.add("z", [5, 5, 5, 5, 5, 5, 5, 5])  # evicts them
    rb.drain()
    rb.forward(["z"])
    rb.assert_all()
    mgr.check()
    rb.free("z")
    rb.add("s2", [1, 2, 3, 4, 0])
    rb.drain()
    rb.forward(["s2"])
    rb.assert_all()


def test_host_blocks_released_by_swap_in_are_held_until_the_drain():
    """swap_in's pairs read its host blocks in this drain; a demotion of the same step must
    not take one of them as an offload destination (the offload runs before the swap)."""
    mgr, rb = engine(num_blocks=6, block_size=2, host=4)  # 3 usable host blocks
    rb.add("s", [1, 2, 3, 4, 5])
    rb.drain()
    rb.forward(["s"])
    rb.swap_out("s")  # all 3 host blocks
    rb.drain()
    rb.add("a", [6, 7, 8])
    rb.drain()
    rb.forward(["a"])
    rb.free("a")
    rb.swap_in("s")  # releases the 3 host blocks (held until the drain)
    assert mgr.host_pool.num_free == 0
    rb.add("b", [9, 9, 9])  # evicts a's cached block: no host block to demote to
    assert mgr.host_stats.dropped >= 1 and mgr.num_pending_offloads == 0
    mgr.check()
    rb.drain()
    assert mgr.host_pool.num_free == 3
    rb.assert_all()
    rb.forward(["s", "b"])
    rb.assert_all()
    mgr.check()


@pytest.mark.parametrize("write_through", [False, True])
def test_onloads_never_overwrite_a_block_a_swap_out_pair_reads(write_through):
    """Found by WriteThroughMachine: the drain runs the onloads before the swap pairs, so an
    onload into a device block that swap_out just released overwrote what its swap pair was
    about to copy to the host (the swapped sequence read another position's K/V back). Such
    blocks now go to positions the forward computes; with no other block the host hit ends."""
    mgr, rb = engine(num_blocks=4, block_size=1, host=6, host_write_through=write_through)
    rb.add("a", [0, 0])
    rb.drain()
    rb.forward(["a"])  # a's blocks are cached (and, write-through, on the host)
    if not write_through:
        rb.free("a")
        rb.add("x", [5, 6, 7])  # demotes a's blocks
        rb.drain()
        rb.forward(["x"])
        rb.free("x")
        rb.add("a", [0, 0, 1])  # a's first block from the host
        rb.drain()
        rb.forward(["a"])
    sources = set(rb.swap_out("a")[:, 0].tolist())
    mgr.pool.reset_prefix_cache()  # the device copies are gone: [0, 0] is on the host only
    # [0, 0] is on the host, but every fresh device block is one a swap pair still reads
    assert rb.add("b", [0, 0]) == 0  # the host hit ends at once (those tokens are recomputed)
    assert set(mgr.block_table("b").tolist()) <= sources and mgr.num_pending_onloads == 0
    rb.drain()
    rb.assert_all()
    mgr.check()
    rb.free("b")
    rb.swap_in("a")
    rb.drain()
    rb.forward(["a"])
    rb.assert_all()


def test_onload_destinations_avoid_swap_out_sources_and_keep_the_hit():
    mgr, rb = engine(num_blocks=12, block_size=2, host=16)
    rb.add("a", [1, 2, 3, 4, 5])
    rb.drain()
    rb.forward(["a"])
    rb.free("a")
    rb.add("y", list(range(20, 40)))  # evicts a's blocks: demoted to the host
    rb.drain()
    rb.forward(["y"])
    rb.free("y")
    rb.add("x", [50, 51, 52])
    rb.drain()
    rb.forward(["x"])
    sources = set(rb.swap_out("x")[:, 0].tolist())  # its partial block heads the free list
    assert rb.add("b", [1, 2, 3, 4, 9, 9, 9]) == 4  # [1, 2], [3, 4] from the host
    table = mgr.block_table("b").tolist()
    assert set(table) & sources and not set(table[:2]) & sources  # traded to a computed one
    rb.drain()
    rb.forward(["b"])
    rb.assert_all()
    mgr.check()


class HostTierMachine(EngineMachine):
    """The engine state machine over a manager whose host pool is a prefix-cache tier (small,
    so the host LRU evicts too): K/V read back after every step, check() after every rule."""

    write_through = False

    def make_manager(self, num_blocks, block_size, *, num_host_blocks, enable_prefix_caching):
        return BlockManager(
            num_blocks,
            block_size,
            num_host_blocks=num_host_blocks or 6,
            enable_prefix_caching=True,
            host_prefix_cache=True,
            host_write_through=self.write_through,
        )


class WriteThroughMachine(HostTierMachine):
    write_through = True


TestHostTierEngine = HostTierMachine.TestCase
TestWriteThroughEngine = WriteThroughMachine.TestCase


# -- events and stats ----------------------------------------------------------------------------
def test_host_events_carry_medium_cpu_and_go_on_the_wire():
    mgr = tier(num_blocks=4, host=2, enable_kv_events=True)  # one host block
    mgr.add("a", [1, 2, 3])
    computed(mgr, "a", 3)
    mgr.free("a")
    mgr.add("x", [9] * 6)  # demotes a's block
    mgr.take_offloads()
    dev = mgr.pool.take_events()
    host = mgr.host_pool.take_events()
    assert [type(e) for e in dev] == [BlockStored, BlockRemoved]
    assert all(e.medium == "GPU" for e in dev)
    (stored,) = host
    assert isinstance(stored, BlockStored) and stored.medium == "CPU"
    assert stored.block_hashes == dev[0].block_hashes and stored.token_ids == [1, 2]
    assert stored.parent_block_hash is None  # the first block of its chain
    wire = encode_batch(host, ts=0.0)
    assert b"CPU" in wire
    mgr.free("x")
    mgr.add("y", [5, 5, 5])
    computed(mgr, "y", 3)
    mgr.free("y")
    mgr.add("x", [8] * 6)  # demotes y's block: the host LRU evicts a's entry
    (removed, stored) = mgr.host_pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.medium == "CPU"
    assert removed.block_hashes == dev[0].block_hashes
    assert mgr.host_pool.medium == "CPU" and mgr.pool.medium == "GPU"


def test_host_stats_without_a_tier_are_zero():
    mgr = BlockManager(8, 2, num_host_blocks=4)
    assert mgr.host_stats == HostStats() and not mgr.host_prefix_cache
    assert mgr.take_offloads().shape == (0, 2) and mgr.take_onloads().shape == (0, 2)
    assert mgr.num_pending_offloads == mgr.num_pending_onloads == 0
    assert mgr.host_stats["hit_rate"] == 0.0


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, exc, match",
    [
        ({"host_prefix_cache": True}, InvalidArgumentError, "num_host_blocks"),
        ({"num_host_blocks": 4, "host_write_through": True}, InvalidArgumentError, "needs"),
        (
            {"num_host_blocks": 4, "host_prefix_cache": True, "enable_prefix_caching": False},
            InvalidArgumentError,
            "enable_prefix_caching",
        ),
        ({"num_host_blocks": 4, "host_prefix_cache": 1}, InvalidTypeError, "bool"),
        ({"num_host_blocks": 4, "host_prefix_cache": "yes"}, InvalidTypeError, "bool"),
        ({"num_host_blocks": -1, "host_prefix_cache": True}, InvalidArgumentError, "host"),
        ({"num_host_blocks": 1, "host_prefix_cache": True}, InvalidArgumentError, "host"),
        ({"num_host_blocks": 2**31, "host_prefix_cache": True}, InvalidArgumentError, "host"),
        ({"num_host_blocks": 4.0, "host_prefix_cache": True}, InvalidTypeError, "host"),
    ],
)
def test_bad_host_tier_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        BlockManager(8, 2, **kw)


@pytest.mark.skipif(
    kvblocks._core.BUILD_DEBUG_LEVEL >= 2, reason="that build aborts on the broken invariant"
)
def test_check_catches_a_broken_host_hold():
    mgr = tier()
    mgr.add("a", [1, 2, 3])
    computed(mgr, "a", 3)
    mgr.free("a")
    mgr.add("b", [5, 6, 7, 8, 9, 10, 11])  # demotes a's block
    mgr.check()
    assert mgr.num_pending_offloads == 1  # its offload holds host block 1
    mgr.check()
    mgr.host_pool.incref(np.array([1], dtype=np.int32))  # a reference nobody holds
    with pytest.raises(CorruptionError, match="host ref count"):
        mgr.check()


@pytest.mark.parametrize("algo", ["siphash", "vllm_sha256_cbor_v030", "sglang_sha256"])
def test_host_hits_keep_the_hash_mode_and_the_adapter(algo):
    """A prompt served from the host in a vLLM hash mode: the onloaded blocks are cached
    under the same hashes as the device computed them, and their BlockStored events carry
    the sequence's adapter."""
    mgr = BlockManager(
        5, 2, num_host_blocks=6, host_prefix_cache=True, hash_algo=algo, enable_kv_events=True
    )
    mgr.add("a", [1, 2, 3, 4, 5], lora_name="ad")
    computed(mgr, "a", 5)
    first = [e for e in mgr.pool.take_events() if isinstance(e, BlockStored)]
    mgr.free("a")
    mgr.add("x", [99] * 8)
    mgr.take_offloads()
    mgr.free("x")
    mgr.pool.take_events()
    assert mgr.add("b", [1, 2, 3, 4, 5, 6], lora_name="ad") == 4
    mgr.take_onloads()
    again = [e for e in mgr.pool.take_events() if isinstance(e, BlockStored)]
    hashes = lambda evs: [h for e in evs for h in e.block_hashes]  # noqa: E731
    assert hashes(again) == hashes(first)
    assert {e.lora_name for e in again} == {"ad"}
    mgr.check()


def test_an_eviction_is_on_the_host_for_the_next_lookup_of_the_same_step():
    """Demotions are recorded on the allocation path and given host blocks later; a lookup
    right after the eviction (probe, add) still finds the prefix on the host, and the drain
    lists the offload before the onload that reads the same host block."""
    mgr = tier(num_blocks=5, host=6)
    mgr.add("a", [1, 2, 3, 4, 5])
    computed(mgr, "a", 5)
    mgr.free("a")
    mgr.add("x", [9] * 8)  # evicts a's two cached blocks: demotions recorded
    mgr.free("x")
    assert mgr.probe([1, 2, 3, 4, 5, 6]) == (4, 3)
    assert mgr.add("b", [1, 2, 3, 4, 5, 6]) == 4
    off = mgr.take_offloads()
    on = mgr.take_onloads()
    assert sorted(off[:, 1].tolist()) == sorted(on[:, 0].tolist())  # written, then read
    assert mgr.host_stats.demotions == 2 and mgr.host_stats.hits == 2
    mgr.check()


def test_write_through_copies_of_the_step_do_not_block_its_next_metadata():
    """metadata/schedule queue write-through offloads for the blocks the step computes; they
    run at the next drain, so a second metadata call of the same step (another batch or
    group) goes on, while an eviction's offload still has to be drained first."""
    mgr = tier(num_blocks=9, host=12, host_write_through=True)
    mgr.add("a", [1, 2, 3, 4, 5])
    mgr.add("b", [7, 8, 9])
    mgr.metadata(["a"], [5])  # a's two full blocks: written through
    assert mgr.num_pending_offloads == 2
    mgr.metadata(["b"], [3])  # the same step's second batch
    assert mgr.num_pending_offloads == 3
    mgr.check()
    mgr.take_offloads()
    mgr.free("a")
    mgr.free("b")
    mgr.add("c", [20] * 16)  # evicts cached blocks already on the host: no copies
    assert mgr.num_pending_offloads == 0
    mgr.schedule(["c"], [16])
    mgr.check()
    mgr.free("c")
    mgr.take_offloads()
    mgr.add("d", [1, 2, 3, 4, 30] + [31] * 10)  # a's prefix onloaded from the host
    with pytest.raises(InvalidStateError, match="pending"):
        mgr.metadata(["d"], [11])  # its onloads must be drained first
    mgr.take_offloads()
    mgr.take_onloads()
    mgr.metadata(["d"], [11])
    mgr.check()


@pytest.mark.parametrize("grouped", [False, True])
def test_a_host_hit_sees_the_evictions_of_the_calls_just_before(grouped):
    """Evictions are records in the pool's log that the tier drains lazily: a prompt whose
    blocks the previous call evicted is a host hit at once, with no drain, counter or event
    read in between, for one group and with KV cache groups (a mutation-testing survivor: a
    host lookup that did not flush first passed every test, since the engine loops drain
    between steps)."""
    if grouped:
        groups = (kvblocks.KVGroup("full"), kvblocks.KVGroup("sliding_window", window=8))
        mgr = BlockManager(9, 4, num_host_blocks=16, host_prefix_cache=True, groups=groups)
    else:
        mgr = BlockManager(5, 4, num_host_blocks=8, host_prefix_cache=True)
    a = list(range(100, 108))
    mgr.add("a", a)
    mgr.plan_step(["a"], [8])
    mgr.free("a")  # two cached blocks, evictable
    mgr.add("b", list(range(16)))  # takes every block: a's are evicted (demotion records)
    mgr.free("b")
    assert mgr.add("c", a) == 4  # block 0 from the host: (8 - 1) // 4 blocks at most
    assert len(mgr.take_offloads()) == (4 if grouped else 2)
    assert len(mgr.take_onloads()) == (2 if grouped else 1)
    mgr.check()
