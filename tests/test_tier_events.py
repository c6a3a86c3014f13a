"""KV events of a host tier as a router sees them (issue 24, findings 3 and 4), and the host
pool's counters.

A ``Subscriber`` is a router's index of one engine, fed ``mgr.take_events()`` (both pools, in
the order recorded): per medium, the hashes it holds. Like llm-d and Dynamo it skips a
``BlockStored`` whose parent it does not know; a host (``"CPU"``) block may chain on a device
block (a host hit continues the device prefix). The skipped hashes are kept apart, so that
known + skipped must equal each pool's cached set exactly (checked through ``num_cached``
and a lookup of every hash), and every skip must be one the documents allow:

* a parent stored earlier and removed since (the duplicate rule of docs/prefix-caching.md:
  a sequence's uncached copy of a block whose cached twin was evicted), for either medium;
* for the host, never a parent stored later in the same drain (that is the child-first
  order of finding 3, which a router cannot undo).
"""

import numpy as np
import pytest
from helpers import KEY
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import (
    AllBlocksCleared,
    BlockManager,
    BlockRemoved,
    BlockStored,
    InvalidStateError,
    hash_from_int,
)
from kvblocks.errors import KVBlocksError

MEDIA = ("GPU", "CPU")


class Subscriber:
    """A router's index of one engine built from its KV events alone (see the module)."""

    def __init__(self):
        self.known = {m: set() for m in MEDIA}
        self.skipped = {m: set() for m in MEDIA}  # held by the pool, unknown to the router
        self.removed = {m: set() for m in MEDIA}  # stored once, removed since
        self.skips = []  # (medium, parent) of each skipped chain, for the rules above

    def parent_known(self, medium, parent):
        if parent is None or parent in self.known[medium]:
            return True
        return medium == "CPU" and parent in self.known["GPU"]

    def apply(self, events):
        """Apply one drained batch; return the skips that break the rules (empty: fine)."""
        bad = []
        for i, ev in enumerate(events):
            if isinstance(ev, BlockStored):
                m, parent = ev.medium, ev.parent_block_hash
                ok = self.parent_known(m, parent)
                if not ok:
                    cascade = any(parent in self.skipped[x] for x in MEDIA)
                    gone = parent in self.removed["GPU"] or (
                        m == "CPU" and parent in self.removed["CPU"]
                    )
                    later = m == "CPU" and any(
                        isinstance(e, BlockStored)
                        and e.medium == "CPU"
                        and parent in e.block_hashes
                        for e in events[i + 1 :]
                    )
                    if not (cascade or (gone and not later)):
                        bad.append((m, parent, i))
                into = self.known[m] if ok else self.skipped[m]
                for h in ev.block_hashes:
                    assert h not in self.known[m] and h not in self.skipped[m], "stored twice"
                    into.add(h)
                    self.removed[m].discard(h)
            elif isinstance(ev, BlockRemoved):
                m = ev.medium
                for h in ev.block_hashes:
                    assert h in self.known[m] or h in self.skipped[m], "removed, never stored"
                    self.known[m].discard(h)
                    self.skipped[m].discard(h)
                    self.removed[m].add(h)
            else:
                assert isinstance(ev, AllBlocksCleared)
                for m in MEDIA:
                    self.removed[m] |= self.known[m] | self.skipped[m]
                    self.known[m].clear()
                    self.skipped[m].clear()
        return bad

    def assert_matches(self, mgr):
        """Known + skipped hashes are exactly each pool's cached set."""
        pools = [("GPU", mgr.pool)] + ([("CPU", mgr.host_pool)] if mgr.host_prefix_cache else [])
        for m, pool in pools:
            held = self.known[m] | self.skipped[m]
            assert pool.num_cached == len(held), m
            for h in held:
                assert len(pool.lookup(hash_from_int(h)[None])) == 1, (m, h)
        for m in MEDIA:  # nothing removed is still cached
            pool = dict(pools).get(m)
            for h in list(self.removed[m])[:50]:
                if pool is not None:
                    assert len(pool.lookup(hash_from_int(h)[None])) == 0, (m, h)


def drain(mgr):
    """The engine's drain, in the documented order (the pairs themselves are not run)."""
    mgr.take_offloads()
    mgr.take_onloads()
    mgr.take_copies()


def compute(mgr, sid):
    drain(mgr)
    mgr.schedule([sid], [mgr.num_tokens(sid) - mgr.num_computed(sid)])


def feed(sub, mgr):
    bad = sub.apply(mgr.take_events())
    assert not bad, bad
    sub.assert_matches(mgr)


def tier(num_blocks, block_size=2, host=8, **kw):
    return BlockManager(
        num_blocks,
        block_size,
        num_host_blocks=host,
        host_prefix_cache=True,
        enable_kv_events=True,
        hash_key=KEY,
        **kw,
    )


# -- finding 3: host events parent first -----------------------------------------------------
def test_one_allocation_evicting_a_chain_stores_it_on_the_host_parent_first():
    """Regression (fails on 2a8a32e): a freed sequence's chain is evicted tail first by one
    allocation; the host's BlockStored came child first, so a router skipping unknown
    parents kept one block of three."""
    mgr = tier(5, host=4)
    mgr.add("a", [1, 2, 3, 4, 5, 6, 7])
    compute(mgr, "a")
    chain = [int(h) for h in mgr.pool.take_events()[0].block_hashes]
    mgr.free("a")
    mgr.add("b", [9] * 8)  # four blocks: the partial one, then a's chain, tail first
    pairs = mgr.take_offloads()
    assert pairs[:, 0].tolist() == [3, 2, 1]  # the pairs stay in eviction order
    host = mgr.host_pool.take_events()
    assert len(host) == 1 and host[0].parent_block_hash is None
    assert host[0].block_hashes == chain and host[0].token_ids == [1, 2, 3, 4, 5, 6]
    # the host's LRU order is still the eviction order: the chain's tail goes first
    compute(mgr, "b")
    mgr.free("b")
    mgr.add("c", [7] * 8)  # evicts b's four blocks: the host (4 blocks) evicts a's chain
    mgr.take_offloads()
    gone = [
        h
        for e in mgr.host_pool.take_events()
        if isinstance(e, BlockRemoved)
        for h in e.block_hashes
    ]
    assert gone == chain[::-1]
    mgr.check()


def test_parents_first_keeps_unrelated_entries_in_eviction_order():
    """Two chains evicted by one allocation: each comes parent first, the chains in the
    order their first entries were evicted; a repeated parent (fork) is stored once."""
    mgr = tier(9, host=12)
    mgr.add("a", [1, 2, 3, 4, 5])
    compute(mgr, "a")
    mgr.add("b", [6, 7, 8, 9, 10])
    compute(mgr, "b")
    a, b = [[int(h) for h in e.block_hashes] for e in mgr.pool.take_events()]
    mgr.free("a")
    mgr.free("b")
    mgr.add("x", [0] * 16)  # evicts b's chain after a's (LRU), each tail first
    mgr.take_offloads()
    stored = [e for e in mgr.host_pool.take_events() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [a, b]
    assert [e.parent_block_hash for e in stored] == [None, None]
    mgr.check()


def test_merged_events_keep_a_host_block_whose_device_parent_is_evicted_later():
    """A host entry stored while its parent is on the device, the parent evicted later in
    the same step: the recording order (mgr.take_events) names the parent before removing
    it. Draining the pools apart, device first, shows the removal first: the router would
    skip the host entry though [1] and [1, 2] are both host hits."""

    def run(merged):
        mgr = tier(6, block_size=1, host=8)
        sub = Subscriber()
        mgr.add("a", [1, 2])
        compute(mgr, "a")
        mgr.add("k", [1, 3])  # hits a's first block: held on the device
        feed(sub, mgr)
        mgr.free("a")  # a's block [1, 2] evictable; [1] held by k
        mgr.add("y", [5, 6, 7])  # evicts [1, 2]: demoted, chains on [1] (device)
        mgr.take_offloads()
        mgr.free("k")
        mgr.free("y")
        mgr.add("z", [9, 9, 9, 9, 9])  # evicts [1] after its child went to the host
        mgr.take_offloads()
        events = (
            mgr.take_events() if merged else mgr.pool.take_events() + mgr.host_pool.take_events()
        )
        bad = sub.apply(events)
        sub.assert_matches(mgr)
        mgr.free("z")
        assert mgr.add("w", [1, 2, 3]) == 2  # [1] and [1, 2]: host hits
        mgr.check()
        return bad

    assert run(merged=True) == []
    assert run(merged=False) != []


# -- the class: random workloads, tight pools --------------------------------------------------
ops = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "prefill",
                "prefill",
                "prefill",
                "add",
                "compute",
                "append",
                "free",
                "free",
                "drain",
                "swap",
                "reset",
                "pool_reset",
            ]
        ),
        st.integers(0, 3),
        st.integers(1, 9),
    ),
    min_size=20,
    max_size=50,
)


def run_workload(mgr, script, vocab, seed):
    rng = np.random.default_rng(seed)
    cap = (mgr.pool.num_blocks - 1) * mgr.block_size  # a prompt of n/9 of the pool: tight
    prefixes = [rng.integers(0, vocab + 1, cap).tolist() for _ in range(2)]
    sub = Subscriber()
    live = set()
    for op, i, n in script:
        sid = f"s{i}"
        try:
            if op in ("add", "prefill") and sid not in live:
                size = max(1, n * cap // 9)
                shared = prefixes[n % 2][: size * (n % 3) // 3]
                toks = shared + rng.integers(0, vocab + 1, size - len(shared)).tolist()
                mgr.add(sid, toks)
                live.add(sid)
                if op == "prefill":
                    compute(mgr, sid)
            elif op == "compute" and sid in live and not mgr.is_swapped(sid):
                compute(mgr, sid)
            elif op == "append" and sid in live and not mgr.is_swapped(sid):
                mgr.append(sid, rng.integers(0, vocab + 1, n % 3 + 1).tolist())
            elif op == "free" and sid in live:
                mgr.free(sid)
                live.discard(sid)
            elif op == "drain":
                drain(mgr)
            elif op == "swap" and sid in live and mgr.host_pool is not None:
                drain(mgr)
                (mgr.swap_in if mgr.is_swapped(sid) else mgr.swap_out)(sid)
            elif op == "reset":
                mgr.reset_prefix_cache()
            elif op == "pool_reset":
                pool = mgr.host_pool if (n % 2 and mgr.host_prefix_cache) else mgr.pool
                pool.reset_prefix_cache()
        except KVBlocksError:
            pass
        feed(sub, mgr)
        mgr.check()
    return sub


@settings(deadline=None)
@given(
    st.integers(3, 10),
    st.sampled_from([1, 2]),
    st.integers(2, 10),
    st.booleans(),
    ops,
    st.integers(0, 3),
    st.integers(0, 2**16),
)
def test_host_tier_events_keep_every_parent_known(nb, bs, nh, wt, script, vocab, seed):
    """Finding 3's class, both media: on random workloads over tight pools (allocations
    that evict chains, host evictions, write-through, swaps, both resets), every
    BlockStored's parent is None or held by the router, except the documented cases, and
    the router's index equals the pools' cached sets after every call."""
    mgr = tier(nb, block_size=bs, host=nh, host_write_through=wt)
    run_workload(mgr, script, vocab, seed)


@settings(deadline=None)
@given(st.integers(3, 10), st.sampled_from([1, 2]), ops, st.integers(0, 3), st.integers(0, 2**16))
def test_device_events_keep_every_parent_known(nb, bs, script, vocab, seed):
    """The same for a device pool alone (resets are AllBlocksCleared there)."""
    mgr = BlockManager(nb, bs, enable_kv_events=True, hash_key=KEY)
    run_workload(mgr, script, vocab, seed)


def test_subscriber_flags_a_child_before_its_parent():
    """The rule the class test applies can fail: a host child stored before its parent in
    one batch is a violation."""
    sub = Subscriber()
    p, c = 11, 12
    sub.apply([BlockStored([5], None, [0, 0], 2, medium="GPU")])
    sub.apply([BlockStored([p], 5, [1, 1], 2, medium="GPU")])
    sub.apply([BlockRemoved([p], medium="GPU")])
    bad = sub.apply(
        [BlockStored([c], p, [2, 2], 2, medium="CPU"), BlockStored([p], 5, [1, 1], 2, medium="CPU")]
    )
    assert bad == [("CPU", p, 0)]


# -- finding 4: a reset with a host tier -------------------------------------------------------
def warm(mgr):
    """Two host entries (a's chain, demoted) and four device entries (b's), all evictable
    (with tier(5)); a subscriber fed everything so far."""
    sub = Subscriber()
    mgr.add("a", [1, 2, 3, 4, 5])
    compute(mgr, "a")
    mgr.free("a")
    mgr.add("b", [7, 8, 9, 10, 11, 12, 13, 14])  # evicts a's chain: on the host
    compute(mgr, "b")
    mgr.free("b")
    feed(sub, mgr)
    assert (mgr.pool.num_cached, mgr.host_pool.num_cached) == (4, 2)
    return sub


def test_manager_reset_clears_both_tiers_and_names_each_medium():
    mgr = tier(5, host=6)
    sub = warm(mgr)
    gpu, cpu = set(sub.known["GPU"]), set(sub.known["CPU"])
    mgr.reset_prefix_cache()
    events = mgr.take_events()
    assert not any(isinstance(e, AllBlocksCleared) for e in events)
    removed = {m: {h for e in events if e.medium == m for h in e.block_hashes} for m in MEDIA}
    assert all(isinstance(e, BlockRemoved) for e in events)
    assert removed == {"GPU": gpu, "CPU": cpu}
    assert not sub.apply(events)
    assert sub.known == {"GPU": set(), "CPU": set()}
    sub.assert_matches(mgr)
    assert (mgr.pool.num_cached, mgr.host_pool.num_cached) == (0, 0)
    assert mgr.add("c", [1, 2, 3, 4, 5]) == 0 and mgr.num_pending_onloads == 0
    mgr.check()


def test_manager_reset_without_a_host_tier_is_all_blocks_cleared():
    mgr = BlockManager(6, 2, enable_kv_events=True, hash_key=KEY)
    mgr.add("a", [1, 2, 3, 4, 5])
    compute(mgr, "a")
    mgr.free("a")
    mgr.take_events()
    mgr.reset_prefix_cache()
    assert mgr.take_events() == [AllBlocksCleared()]
    assert mgr.pool.num_cached == 0 and mgr.add("b", [1, 2, 3]) == 0
    mgr.check()


def test_device_pool_reset_with_a_host_tier_names_its_medium():
    """Regression (fails on 2a8a32e): it recorded AllBlocksCleared, so a router dropped the
    host entries too, which the host tier went on serving."""
    mgr = tier(5, host=6)
    sub = warm(mgr)
    cpu = set(sub.known["CPU"])
    mgr.pool.reset_prefix_cache()
    events = mgr.take_events()
    assert [(type(e), e.medium) for e in events] == [(BlockRemoved, "GPU")]
    assert not sub.apply(events)
    assert sub.known["CPU"] == cpu and not sub.known["GPU"]
    sub.assert_matches(mgr)
    assert mgr.add("c", [1, 2, 3, 4, 5]) == 4  # the host entries still serve
    mgr.check()


def test_host_pool_reset_keeps_the_routers_device_entries():
    """Regression (fails on 2a8a32e): the host pool's AllBlocksCleared wiped the router's
    device entries as well."""
    mgr = tier(5, host=6)
    sub = warm(mgr)
    gpu = set(sub.known["GPU"])
    mgr.host_pool.reset_prefix_cache()
    events = mgr.take_events()
    assert [(type(e), e.medium) for e in events] == [(BlockRemoved, "CPU")]
    assert not sub.apply(events)
    assert sub.known["GPU"] == gpu and not sub.known["CPU"]
    sub.assert_matches(mgr)
    mgr.check()


def refused(mgr, match):
    """reset_prefix_cache raises InvalidStateError and changes nothing."""
    before = (
        mgr.pool.num_cached,
        mgr.host_pool.num_cached,
        mgr.pool.num_free,
        mgr.host_pool.num_free,
        mgr.num_pending_offloads,
        mgr.num_pending_onloads,
    )
    mgr.take_events()
    with pytest.raises(InvalidStateError, match=match):
        mgr.reset_prefix_cache()
    assert mgr.take_events() == []
    assert before == (
        mgr.pool.num_cached,
        mgr.host_pool.num_cached,
        mgr.pool.num_free,
        mgr.host_pool.num_free,
        mgr.num_pending_offloads,
        mgr.num_pending_onloads,
    )
    mgr.check()


def test_manager_reset_refuses_while_a_cached_block_is_referenced():
    mgr = tier(5, host=6)
    warm(mgr)
    mgr.add("c", [7, 8, 9, 10, 11])  # holds b's cached blocks
    drain(mgr)
    refused(mgr, "cached device blocks are referenced")
    mgr.free("c")
    mgr.reset_prefix_cache()
    assert mgr.pool.num_cached == 0


def test_manager_reset_refuses_while_offloads_are_pending():
    """Evictions since the last drain are demoted first: their offloads are pending."""
    mgr = tier(5, host=6)
    warm(mgr)
    mgr.add("x", [0] * 8)  # evicts b's blocks: offloads pending (not drained)
    mgr.free("x")
    refused(mgr, "offloads and 0 onloads are pending")
    mgr.take_offloads()
    mgr.reset_prefix_cache()
    assert (mgr.pool.num_cached, mgr.host_pool.num_cached) == (0, 0)
    mgr.check()


def test_manager_reset_refuses_while_onloads_are_pending():
    mgr = tier(5, host=6)
    warm(mgr)
    assert mgr.add("c", [1, 2, 3, 4, 5]) == 4  # host hits: onloads pending (and held)
    mgr.take_offloads()
    mgr.free("c")  # the onload still holds its device block and host block
    refused(mgr, "0 offloads and 2 onloads are pending")
    mgr.take_onloads()
    mgr.reset_prefix_cache()
    mgr.check()


def test_manager_reset_leaves_swapped_sequences_alone():
    mgr = tier(5, host=8)
    warm(mgr)
    mgr.add("s", [3, 3, 3])
    compute(mgr, "s")
    mgr.swap_out("s")
    mgr.take_offloads()
    mgr.reset_prefix_cache()
    assert mgr.is_swapped("s") and mgr.host_pool.num_cached == 0
    drain(mgr)
    mgr.swap_in("s")
    assert mgr.num_tokens("s") == 3
    mgr.check()


@settings(deadline=None)
@given(st.integers(4, 10), st.integers(2, 10), st.booleans(), ops, st.integers(0, 2**16))
def test_resets_keep_the_subscriber_consistent(nb, nh, wt, script, seed):
    """Finding 4's class: any mix of manager and per-pool resets among random calls keeps
    the subscriber's index equal to both pools' cached sets (the workload feeds it after
    every call and compares)."""
    mgr = tier(nb, block_size=1, host=nh, host_write_through=wt)
    reset_heavy = [("reset" if k % 5 == 4 else op, i, n) for k, (op, i, n) in enumerate(script)]
    run_workload(mgr, reset_heavy, 2, seed)


# -- host-pool counters ------------------------------------------------------------------------
def test_host_pool_counters_are_current_after_an_evicting_add():
    """Regression (fails on 2a8a32e): add() looks the host up before it allocates, so the
    evictions of its own allocation reached the host counters only at the next host
    lookup or drain."""
    mgr = tier(5, host=4)
    mgr.add("a", [1, 2, 3, 4, 5])
    compute(mgr, "a")
    mgr.free("a")
    mgr.add("b", [9] * 7)  # evicts a's two cached blocks after its host lookup
    h = mgr.host_pool
    assert h.num_cached == 2 and h.num_free == 1 and h.num_used == 2
    assert [h.is_cached(b) for b in range(1, 4)] == [True, True, False]
    assert h.block_hash(1) is not None and h.ref_count(1) == 1  # the offload's hold
    assert mgr.num_pending_offloads == 2
    mgr.check()
