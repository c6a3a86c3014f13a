"""KV cache groups: the release boundary, prefix hits across groups, state groups, bad input."""

import contextlib
import itertools

import numpy as np
import pytest

from kvblocks import BlockManager, KVGroup, hash_blocks
from kvblocks._core import siphash128
from kvblocks.errors import (
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    OutOfBlocksError,
)

BS = 4


def swa(w):
    return (KVGroup("full"), KVGroup("sliding_window", window=w))


def model_lo(ncomputed, ntokens, window):
    """Released leading blocks per the documented rule (docs: the next query q0)."""
    q0 = min(ncomputed, ntokens - 1)
    return max(0, q0 - window + 1) // BS


@pytest.mark.parametrize("window", [1, 3, 4, 5, 8, 9])
@pytest.mark.parametrize("prompt", range(1, 2 * BS + 1))
def test_release_boundary_every_offset(window, prompt):
    mgr = BlockManager(128, BS, groups=swa(window))
    mgr.add("s", list(range(prompt)))
    mgr.schedule(["s"], [prompt])
    for t in range(3 * BS):
        n = prompt + t + 1
        mgr.append("s", [t])
        table = mgr.block_table("s", group=1)
        lo = model_lo(n - 1, n, window)
        assert (table[:lo] == 0).all() and (table[lo:] > 0).all(), (n, table)
        # the full group never releases
        assert (mgr.block_table("s", group=0) > 0).all()
        mgr.metadata(["s"], [1], group=0)
        mgr.metadata(["s"], [1], group=1)
        mgr.check()
    mgr.free("s")
    mgr.check()
    assert mgr.pool.num_free == 127


def test_no_hit_without_a_cached_block():
    """Regression: a chunk boundary (or a window of one) reads none of the prefix, which once
    let add() claim a hit of blocks nothing had computed."""
    for g in (KVGroup("chunked_local", chunk=8), KVGroup("sliding_window", window=1)):
        mgr = BlockManager(64, BS, groups=(g,))
        assert mgr.add("s", list(range(16))) == 0
        assert (mgr.block_table("s") > 0).all()
        assert mgr.probe(list(range(16)))[0] == 0
        mgr.check()


def test_chunked_local_releases_previous_chunks():
    mgr = BlockManager(64, BS, groups=(KVGroup("chunked_local", chunk=8),))
    mgr.add("s", list(range(16)))
    mgr.schedule(["s"], [16])
    mgr.append("s", [1])  # the query at 16 starts a chunk: blocks 0..3 are unreadable
    assert mgr.block_table("s").tolist()[:4] == [0, 0, 0, 0]
    mgr.check()


def test_prefill_chunks_keep_what_the_step_reads():
    mgr = BlockManager(64, BS, groups=swa(4))
    mgr.add("s", list(range(8)))
    mgr.schedule(["s"], [8])  # first chunk: positions 0..7
    mgr.append("s", list(range(8, 20)))  # the rest of the prompt
    assert (mgr.block_table("s", group=1)[1:] > 0).all()
    meta = mgr.metadata(["s"], [12], group=1)  # the chunk from 8 reads from 5 on
    assert meta.block_tables[0].tolist()[:1] == [0]
    assert (meta.block_tables[0][1:5] > 0).all()
    mgr.check()


def test_truncate_and_recompute_into_released_blocks_refused():
    mgr = BlockManager(64, BS, groups=swa(4))
    mgr.add("s", list(range(16)))
    mgr.schedule(["s"], [16])
    mgr.append("s", [1])
    before = mgr.block_table("s", group=1).tolist()
    with pytest.raises(InvalidStateError):
        mgr.truncate("s", 2)
    with pytest.raises(InvalidStateError):
        mgr.metadata(["s"], [17], group=1)
    assert mgr.block_table("s", group=1).tolist() == before
    assert mgr.num_tokens("s") == 17
    mgr.truncate("s", 16)  # still inside the window
    mgr.check()


def test_prefix_hits_need_every_group():
    mgr = BlockManager(256, BS, groups=swa(8))
    prompt = list(range(40))
    mgr.add("a", prompt)
    mgr.schedule(["a"], [40])
    mgr.free("a")
    assert mgr.add("b", prompt + [99]) == 40
    # the window group pins only what the query at 40 reads: [33, 40]
    assert mgr.block_table("b", group=1).tolist()[:8] == [0] * 8
    mgr.check()
    mgr.free("b")
    # evict the window group's needed blocks: hits fall back to what both groups hold
    mgr2 = BlockManager(256, BS, groups=swa(8))
    mgr2.add("a", prompt)
    mgr2.schedule(["a"], [40])
    assert mgr2.add("c", prompt[:12] + [7] * 30) == 12
    mgr2.check()


def test_identical_tokens_in_two_groups_never_share():
    mgr = BlockManager(64, BS, groups=(KVGroup("full"), KVGroup("full")))
    mgr.add("a", list(range(9)))
    mgr.schedule(["a"], [9])
    t0, t1 = mgr.block_table("a", group=0), mgr.block_table("a", group=1)
    assert not set(t0.tolist()) & set(t1.tolist())
    h0, h1 = (set(map(tuple, mgr.block_hashes("a", group=g).tolist())) for g in (0, 1))
    assert len(h0) == len(h1) == 2 and not h0 & h1
    mgr.check()


def test_events_carry_group_kind_and_window():
    mgr = BlockManager(64, BS, groups=swa(8), enable_kv_events=True)
    mgr.add("a", list(range(9)))
    mgr.schedule(["a"], [9])
    evs = mgr.pool.take_events()
    kinds = {(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in evs}
    assert kinds == {(0, "full_attention", None), (1, "sliding_window", 8)}


def test_state_group_fork_copies_and_refuses_truncate():
    mgr = BlockManager(64, BS, groups=(KVGroup("full"), KVGroup("state", blocks=2)))
    mgr.add("a", list(range(6)))
    assert len(mgr.block_table("a", group=1)) == 2
    mgr.schedule(["a"], [6])
    mgr.append("a", [1] * 10)  # the state does not grow
    assert len(mgr.block_table("a", group=1)) == 2
    mgr.fork("a", "b")
    pairs = mgr.take_copies().tolist()
    assert [p[0] for p in pairs] == mgr.block_table("a", group=1).tolist()
    assert [p[1] for p in pairs] == mgr.block_table("b", group=1).tolist()
    with pytest.raises(InvalidStateError):
        mgr.truncate("a", 2)
    meta = mgr.metadata(["a"], [10], group=1)
    assert (meta.slot_mapping == -1).all()
    mgr.check()


def test_swap_round_trip_with_released_entries():
    mgr = BlockManager(64, BS, groups=swa(4), num_host_blocks=64)
    mgr.add("s", list(range(16)))
    mgr.schedule(["s"], [16])
    mgr.append("s", [1])
    held = mgr.blocks_in_use("s")
    out = mgr.swap_out("s")
    assert len(out) == held
    back = mgr.swap_in("s")
    assert len(back) <= held
    assert mgr.block_table("s", group=1).tolist()[:3] == [0, 0, 0]
    mgr.check()


def test_out_of_blocks_changes_nothing():
    mgr = BlockManager(8, BS, groups=swa(4))
    with pytest.raises(OutOfBlocksError):
        mgr.add("s", list(range(16)))  # 4 + 4 blocks > 7
    assert len(mgr) == 0 and mgr.pool.num_free == 7
    mgr.check()


@pytest.mark.parametrize(
    "make, exc",
    [
        (lambda: KVGroup("dense"), InvalidArgumentError),
        (lambda: KVGroup("sliding_window", window=0), InvalidArgumentError),
        (lambda: KVGroup("sliding_window", window=-3), InvalidArgumentError),
        (lambda: KVGroup("sliding_window", window=2.0), InvalidTypeError),
        (lambda: KVGroup("sliding_window", window=True), InvalidTypeError),
        (lambda: KVGroup("sliding_window"), InvalidArgumentError),
        (lambda: KVGroup("chunked_local", chunk=0), InvalidArgumentError),
        (lambda: KVGroup("state", blocks=0), InvalidArgumentError),
        (lambda: KVGroup("full", window=4), InvalidArgumentError),
        (lambda: KVGroup(3), InvalidTypeError),
        (lambda: BlockManager(8, BS, groups=()), InvalidArgumentError),
        (lambda: BlockManager(8, BS, groups=[object()]), InvalidTypeError),
        (lambda: BlockManager(8, BS, groups=KVGroup("full")), InvalidTypeError),
        (lambda: BlockManager(8, BS, groups=[KVGroup("full")] * 256), InvalidArgumentError),
    ],
)
def test_bad_groups(make, exc):
    with pytest.raises(exc):
        make()


def test_group_index_out_of_range():
    mgr = BlockManager(16, BS, groups=swa(4))
    mgr.add("s", [1, 2, 3])
    for bad in (2, -1):
        with pytest.raises(InvalidArgumentError):
            mgr.block_table("s", group=bad)
        with pytest.raises(InvalidArgumentError):
            mgr.metadata(["s"], [3], group=bad)
        with pytest.raises(InvalidArgumentError):
            mgr.block_hashes("s", group=bad)
    with pytest.raises(InvalidTypeError):
        mgr.block_table("s", group=1.0)
    with pytest.raises(InvalidTypeError):
        mgr.block_hashes("s", group="1")
    with pytest.raises(InvalidArgumentError):
        hash_blocks([1, 2, 3, 4], BS, group=255)  # at most 255 groups: indices 0-254
    assert mgr.num_computed("s") == 0
    mgr.check()


def test_kvgroup_is_immutable_and_hashable():
    g = KVGroup("sliding_window", window=8)
    with pytest.raises(AttributeError):
        g.window = 9
    assert g == KVGroup("sliding_window", window=8) and len({g, KVGroup("full")}) == 2
    assert np.int64(0) == 0  # numpy scalars are accepted as group indices below
    mgr = BlockManager(16, BS, groups=(g,))
    mgr.add("s", [1])
    assert mgr.block_table("s", group=np.int64(0)).tolist() == [1]


@pytest.mark.parametrize("order", list(itertools.permutations(("full", "window", "state"))))
def test_release_gain_before_a_later_group_counts_right(order):
    """Regression: a window group's release gain, counted before a later group's need, made
    the saturating sum overflow and append/append_batch refuse with 2**63 - 1 blocks. Every
    order of the groups must give the same answer."""
    make = {
        "full": KVGroup("full"),
        "window": KVGroup("sliding_window", window=4),
        "state": KVGroup("state", blocks=1),
    }
    mgr = BlockManager(64, 4, groups=tuple(make[k] for k in order))
    for sid in ("a", "b"):
        mgr.add(sid, list(range(14)))
    mgr.schedule(["a", "b"], [14, 14])
    mgr.append("a", [99])
    mgr.append_batch(["a", "b"], [7, 8])
    w = order.index("window")
    assert mgr.block_table("a", group=w).tolist()[:2] == [0, 0]
    mgr.check()


@pytest.mark.parametrize("batch", [False, True])
def test_release_gain_before_another_group_is_counted(batch):
    """Regression: append / append_batch subtract a window group's release gain from the
    running block count; a negative count then went through the saturating add of the next
    group (INT64_MAX - a overflowed), which reported an absurd need and refused the append.
    Only configurations with a window group before another group showed it."""
    for groups in (
        (KVGroup("sliding_window", window=4), KVGroup("full")),
        (KVGroup("sliding_window", window=4), KVGroup("sliding_window", window=4)),
    ):
        # a pool so small that append_batch counts exactly (its bound does not fit)
        mgr = BlockManager(8, BS, groups=groups)
        mgr.add("s", list(range(10)))
        mgr.schedule(["s"], [10])
        before = mgr.blocks_in_use("s")
        if batch:
            mgr.append_batch(["s"], [1])
        else:
            mgr.append("s", [1])
        assert mgr.num_tokens("s") == 11
        assert mgr.blocks_in_use("s") < before  # the window moved past block 0


def test_refused_append_keeps_the_recompute_window():
    """Regression: a refused append released the blocks of the longer sequence first, so the
    block the newest token's recompute reads was gone (check() reported corruption)."""
    mgr = BlockManager(4, BS, groups=(KVGroup("sliding_window", window=4),))
    mgr.add("s", list(range(11)))
    mgr.schedule(["s"], [11])
    with pytest.raises(OutOfBlocksError):
        mgr.append("s", list(range(10)))  # 3 more blocks; releasing would free only 2
    assert mgr.block_table("s").tolist() == [1, 2, 3] and mgr.num_tokens("s") == 11
    mgr.check()
    mgr.metadata(["s"], [1])  # the newest token recomputed reads [7, 10]: block 1


@pytest.mark.parametrize("batch", [False, True])
def test_append_counts_release_of_later_groups(batch):
    """Regression: with (full, full, window) the window's release made the call fit, but the
    full groups allocated before it released: the second full group ran out after the first
    had appended, and the groups disagreed on the sequence's tokens."""
    groups = (KVGroup("full"), KVGroup("full"), KVGroup("sliding_window", window=4))
    mgr = BlockManager(11, BS, groups=groups)
    mgr.add("s", list(range(12)))
    mgr.schedule(["s"], [12])
    assert mgr.pool.num_free == 1  # 3 blocks needed, window release frees 2
    if batch:
        mgr.append_batch(["s"], [5])
    else:
        mgr.append("s", [5])
    assert mgr.num_tokens("s") == 13
    assert [len(mgr.block_table("s", group=j)) for j in range(3)] == [4, 4, 4]
    assert mgr.block_table("s", group=2).tolist()[:2] == [0, 0]
    mgr.check()


def test_two_window_groups_append_that_fits_is_not_refused():
    """Regression: the blocks release frees were subtracted from a saturating sum, which
    overflowed when a group freed more than it took: an append that fits was refused with a
    block count near 2**63."""
    g = KVGroup("sliding_window", window=4)
    mgr = BlockManager(7, BS, groups=(g, g))
    mgr.add("s", list(range(11)))
    mgr.schedule(["s"], [11])
    assert mgr.pool.num_free == 0
    mgr.append("s", [5, 6])  # each group frees 2 blocks and takes 1
    assert mgr.pool.num_free == 2
    mgr.check()


def test_add_that_can_never_fit_keeps_the_groups_in_step():
    """Regression: a prompt too long for a full group was refused after a state group had
    already grown its slot array, and check() then reported the groups out of step."""
    for groups in [
        (KVGroup("state", blocks=1), KVGroup("full")),
        (KVGroup("full"), KVGroup("state", blocks=1)),
    ]:
        mgr = BlockManager(6, 1, groups=groups)
        with pytest.raises(OutOfBlocksError):
            mgr.add("s", list(range(14)))
        mgr.check()
        assert mgr.add("t", [1, 2]) == 0
        mgr.check()


def test_shared_write_blocks_are_counted_exactly_across_groups():
    """Regression: each group's quick bound counts one copy per sharer of a shared write
    block, and is exact only against the whole pool; summed over groups it refused
    append_batch (and made can_append say False) for a step that fits. A fork's two
    sequences writing into their shared block take one copy per group."""
    groups = (
        KVGroup("full"),
        KVGroup("sliding_window", window=1),
        KVGroup("sliding_window", window=1),
    )
    mgr = BlockManager(7, 2, groups=groups)
    mgr.add("a", [0])
    mgr.fork("a", "b")
    assert mgr.can_append(["a", "b"], 1)
    mgr.append_batch(["a", "b"], [5, 6])
    assert mgr.pool.num_free == 0 and len(mgr.take_copies()) == 3
    mgr.check()
    groups = (KVGroup("full"), KVGroup("chunked_local", chunk=5), KVGroup("full"))
    mgr = BlockManager(13, 3, groups=groups)
    mgr.add("a", [0, 0])
    mgr.fork("a", "b")
    assert mgr.can_append(["a", "b"], 2)


KEY = b"0123456789abcdef"


def group_tag(g):
    """docs/hybrid-models.md: group g's tag, SipHash-128(key, b"kvblocks:group:" + g)."""
    raw = siphash128(KEY, b"kvblocks:group:" + bytes([g]))
    return np.array([int.from_bytes(raw[i : i + 8], "little") for i in (0, 8)], dtype=np.uint64)


@pytest.mark.parametrize("g", [1, 2, 9, 254])
@pytest.mark.parametrize("salt", [None, "tenant"])
def test_group_hash_is_the_group0_chain_xor_a_keyed_tag(g, salt):
    toks = np.arange(5 * BS + 1, dtype=np.int32)
    h0 = hash_blocks(toks, BS, key=KEY, salt=salt)
    hg, dg = hash_blocks(toks, BS, key=KEY, salt=salt, group=g, digests=True)
    assert (hg == h0 ^ group_tag(g)).all() and len(hg) == 5
    for parent in (hg[1], dg[1], int(hg[1, 0]) | int(hg[1, 1]) << 64):  # the chain continues
        assert (hash_blocks(toks[2 * BS :], BS, key=KEY, parent=parent, group=g) == hg[2:]).all()
    assert (hash_blocks(toks, BS, key=KEY, salt=salt, group=0) == h0).all()


ORDERS = {
    "full,window": (KVGroup("full"), KVGroup("sliding_window", window=5)),
    "window,full": (KVGroup("sliding_window", window=5), KVGroup("full")),
    "state,full,window": (
        KVGroup("state", blocks=2),
        KVGroup("full"),
        KVGroup("sliding_window", window=3),
    ),
    "chunk,state,full": (
        KVGroup("chunked_local", chunk=8),
        KVGroup("state", blocks=1),
        KVGroup("full"),
    ),
    "full,full,window": (
        KVGroup("full"),
        KVGroup("full"),
        KVGroup("sliding_window", window=1),
    ),
}


@pytest.mark.parametrize("order", ORDERS)
def test_every_groups_hashes_are_hash_blocks_of_its_tokens(order):
    """A group derives its hashes from an earlier group's (one SipHash per block for all
    groups): through add with hits, append, append_batch, fork, truncate and swap, each
    group's hashes stay hash_blocks(tokens, group=g) of the sequence's own tokens."""
    groups = ORDERS[order]
    mgr = BlockManager(512, BS, groups=groups, hash_key=KEY, num_host_blocks=128)
    salts = {}

    def expect_all():
        for sid in mgr.seq_ids():
            if mgr.is_swapped(sid):
                continue
            toks = mgr.token_ids(sid)
            for g, grp in enumerate(groups):
                got = mgr.block_hashes(sid, group=g)
                if grp.kind == "state":
                    assert got.shape == (0, 2)
                    continue
                want = hash_blocks(toks, BS, key=KEY, salt=salts.get(sid), group=g)
                assert got.tolist() == want.tolist(), (sid, g)
        mgr.check()

    rng = np.random.default_rng(1)
    prompt = rng.integers(0, 1000, 23, dtype=np.int32)
    mgr.add("a", prompt)
    salts["s"] = "tenant"
    mgr.add("s", prompt, salt="tenant")  # another tenant: same tokens, another chain
    mgr.schedule(["a", "s"], [23, 23])
    expect_all()
    for _ in range(11):  # decode: blocks fill in every group
        mgr.append_batch(["a", "s"], rng.integers(0, 1000, 2, dtype=np.int32))
        mgr.schedule(["a", "s"], [1, 1])
    expect_all()
    stateless = all(g.kind != "state" for g in groups)
    hit = mgr.add("b", mgr.token_ids("a")[:30])
    assert (hit > 0) == stateless  # hits every group serves (a state group serves none)
    mgr.append("b", rng.integers(0, 1000, 9, dtype=np.int32))
    mgr.fork("a", "c")
    mgr.append("c", [7] * 6)
    mgr.take_copies()  # (the engine copies the blocks here)
    mgr.schedule(["b", "c"], [mgr.num_tokens("b") - mgr.num_computed("b"), 6])
    expect_all()
    if stateless:
        mgr.truncate("c", 38)  # refused with a state group (it cannot roll back)
        mgr.append("c", [8] * 7)
        expect_all()
    mgr.swap_out("b")
    mgr.append_batch(["a", "c"], [1, 2])
    mgr.swap_in("b")
    mgr.append("b", [3] * 5)
    expect_all()


@pytest.mark.parametrize(
    "other",
    [
        KVGroup("state", blocks=1),
        KVGroup("sliding_window", window=1),
        KVGroup("chunked_local", chunk=2),
        KVGroup("full"),
    ],
)
def test_exact_count_of_a_tight_step_in_every_kind(other):
    """Found by the deep group model run: the exact count (taken when the quick bound does
    not fit) billed a state group's table as if it grew with the tokens, so a step that fits
    was refused. Every kind, forked (a shared write block), at the smallest pool the
    executable spec says fits, and one block below it."""
    from kvblocks.testing import ReferenceManager

    groups = (KVGroup("full"), KVGroup("full"), KVGroup("sliding_window", window=1), other)

    def pair(cls, nb):
        m = cls(nb, 3, groups=groups)
        m.add("a", [1, 2, 3, 4])
        m.fork("a", "b")
        return m

    def smallest(fits):
        for nb in range(4, 64):
            try:
                m = pair(ReferenceManager, nb)
            except OutOfBlocksError:
                continue
            if fits(m):
                return nb
        raise AssertionError("never fits")

    nb = smallest(lambda m: m.can_append(["a", "b"], 3))
    assert pair(BlockManager, nb).can_append(["a", "b"], 3)
    with contextlib.suppress(OutOfBlocksError):  # (the fork itself may not fit)
        assert not pair(BlockManager, nb - 1).can_append(["a", "b"], 3)

    def steps(m):
        try:
            m.append_batch(["a", "b"], [5, 6])
            m.append_batch(["a", "b"], [7, 8])
        except OutOfBlocksError:
            return False
        return True

    nb = smallest(steps)
    mgr = pair(BlockManager, nb)
    assert steps(mgr)
    mgr.check()
    with contextlib.suppress(OutOfBlocksError):
        assert not steps(pair(BlockManager, nb - 1))


TWIN_ORDERS = [
    order for n in (2, 3) for order in itertools.permutations(("full", "window", "state")[:n])
]


def twin_groups(order):
    kinds = {
        "full": KVGroup("full"),
        "window": KVGroup("sliding_window", window=4),
        "state": KVGroup("state", blocks=1),
    }
    return tuple(kinds[k] for k in order)


@pytest.mark.parametrize("order", TWIN_ORDERS, ids="-".join)
def test_window_blocks_with_a_cached_full_twin_get_a_second_chance(order):
    """docs/hybrid-models.md, eviction: a's window blocks were released early (oldest in the
    LRU) while its full blocks are held; plain LRU would evict them first and lose every hit
    on a's prefix (a hit needs both groups). They move to the tail instead, y's blocks go, and
    the executable spec evicts exactly the same blocks. Every group order: the twin is found
    relative to the first full-attention group, which need not be group 0 (a core that looks
    it up relative to group 0 gives no second chance when a state group comes first)."""
    from kvblocks.testing import ReferenceManager

    groups = twin_groups(order)
    win = order.index("window")
    nb = 16 + 3 * ("state" in order)  # a state group takes a block per live sequence
    hits = []
    for cls in (BlockManager, ReferenceManager):
        m = cls(nb, 4, groups=groups)
        m.add("a", list(range(16)))
        m.schedule(["a"], [16])
        for t in range(4):  # the window moves on: a's window blocks 0-3 are released
            m.append_batch(["a"], [50 + t])
            m.schedule(["a"], [1])
        m.add("y", list(range(100, 108)))
        m.schedule(["y"], [8])
        m.free("y")  # y's blocks: evictable, after a's released ones
        assert m.block_table("a", group=win).tolist()[:4] == [0, 0, 0, 0]
        m.add("x", list(range(200, 212)))  # evicts 5 cached blocks
        hits.append((m.pool.free_list().tolist(), sorted(m.pool.ref_counts().tolist())))
        m.free("a")
        m.free("x")
        hits[-1] += (m.add("b", list(range(12)) + [99, 99]),)
        if cls is BlockManager:
            m.check()
    assert hits[0] == hits[1]
    if "state" in order:
        assert hits[0][2] == 0  # a state group serves no hit
    elif order == ("full", "window"):  # (window first: y's window blocks get theirs first)
        assert hits[0][2] == 12


@pytest.mark.parametrize("order", TWIN_ORDERS, ids="-".join)
def test_an_allocation_that_evicts_a_full_block_then_reaches_its_window_twin(order):
    """Issue 24: each evicted block's cache entry goes as allocation takes it, before the
    next block is chosen. One allocation that evicts a full block and then reaches its
    window twin at the head of the free list finds the twin's full block gone: no second
    chance (the spec once dropped the entries after the whole allocation and moved the twin
    to the tail). The core and the spec must agree block for block, in every group order."""
    from kvblocks.testing import ReferenceManager

    groups = twin_groups(order)
    state = "state" in order
    results = []
    for cls in (BlockManager, ReferenceManager):
        m = cls(16, 4, groups=groups)
        m.add("a", list(range(8)))  # two full blocks in the full and the window group
        m.add("z", list(range(500, 504)))  # one more, freed after a's
        m.schedule(["a", "z"], [8, 4])
        m.free("a")  # group after group, tail first: evictable, in that order
        m.free("z")
        never = m.pool.num_free - m.pool.num_evictable  # taken first
        free = m.pool.free_list().tolist()
        per_group = -(-(never + 3 - state) // 2)  # x reaches three of a's cached blocks
        m.add("x", list(range(300, 300 + 4 * per_group)))
        results.append((free, m.pool.free_list().tolist(), m.pool.num_evictable))
        if cls is BlockManager:
            m.check()
    assert results[0] == results[1]


def test_second_chances_are_bounded():
    """When every evictable block is a window block whose full twin is held, allocation still
    evicts (each block has one second chance per stay in the free list): the rule never makes
    a fitting call fail, and costs at most one move per release."""
    groups = (KVGroup("full"), KVGroup("sliding_window", window=1))
    mgr = BlockManager(100, 1, groups=groups)
    mgr.add("a", list(range(40)))
    mgr.schedule(["a"], [40])
    mgr.append_batch(["a"], [1])  # the window group releases 40 blocks, all with a held twin
    mgr.schedule(["a"], [1])
    assert mgr.pool.num_evictable == 40 and mgr.blocks_in_use("a") == 41 + 1
    free = mgr.pool.num_free
    mgr.add("x", [7] * (free // 2))  # every free block but one: evicts 39 of the 40
    assert mgr.pool.num_free == free % 2 and mgr.pool.num_evictable == free % 2
    mgr.check()
