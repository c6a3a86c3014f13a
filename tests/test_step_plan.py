"""BlockManager.plan_step: a step validated, released and declared once for every group, with
writers per group. Against the v1 calls on a twin manager (the documented equivalence: plan_step
is schedule, and its writers are metadata / row_indices of each group without declaring again),
for random hybrid steps; staleness after every kind of change; failures change nothing."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvblocks
from kvblocks import AttentionMetadata, BlockManager, KVGroup, RowIndices

KEY = b"0123456789abcdef"
BS = 4
GROUPS = {
    "full": (KVGroup("full"),),
    "window": (KVGroup("full"), KVGroup("sliding_window", window=6)),
    "chunk": (KVGroup("full"), KVGroup("chunked_local", chunk=8)),
    "state": (KVGroup("full"), KVGroup("sliding_window", window=5), KVGroup("state", blocks=1)),
}


def _pair(kind):
    return [BlockManager(400, BS, hash_key=KEY, groups=GROUPS[kind]) for _ in range(2)]


def _meta(m):
    names = ("slot_mapping", "block_tables", "seq_lens", "qo_indptr", "kv_indptr", "kv_indices")
    names += ("kv_last_page_len",)
    return {k: None if getattr(m, k) is None else getattr(m, k).tolist() for k in names}


def _rows(r):
    return (
        r.read_index.tolist(),
        r.write_index.tolist(),
        r.read_offsets.tolist(),
        r.write_offsets.tolist(),
    )


def _state(mgr, ids):
    return (
        [mgr.num_computed(i) for i in ids],
        [mgr.num_tokens(i) for i in ids],
        [[mgr.block_table(i, group=g).tolist() for g in range(len(mgr.groups))] for i in ids],
        mgr.pool.num_free,
        mgr.pool.num_cached,
    )


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(GROUPS)), data=st.data())
def test_plan_equals_the_v1_calls(kind, data):
    a, b = _pair(kind)  # a: plan_step; b: v1 metadata per group
    prompts = data.draw(
        st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=30), min_size=1, max_size=4)
    )
    ids = list(range(len(prompts)))
    for i, p in enumerate(prompts):
        assert a.add(i, p) == b.add(i, p)
    q = [a.num_tokens(i) - a.num_computed(i) for i in ids]
    for _ in range(data.draw(st.integers(1, 12))):
        plan = a.plan_step(ids, q)
        G = len(a.groups)
        for g in range(G):
            if a.groups[g].kind == "state":
                continue
            want = b.metadata(ids, q, group=g)
            assert _meta(plan.metadata(g)) == _meta(want)
            assert plan.size(g).tokens == want.num_tokens
        for g in range(G):
            if b.groups[g].kind == "state":
                b.metadata(ids, q, group=g)  # declares the state group's step too
        assert _state(a, ids) == _state(b, ids)
        toks = data.draw(st.lists(st.integers(0, 5), min_size=len(ids), max_size=len(ids)))
        a.append_batch(ids, toks)
        b.append_batch(ids, toks)
        q = [1] * len(ids)
        a.check()
        b.check()


def test_rows_from_the_plan_equal_row_indices():
    a, b = _pair("window")
    for m in (a, b):
        m.add("x", list(range(13)))
        m.add("y", list(range(7)))
    plan = a.plan_step(["x", "y"], [13, 7])
    for g in (0, 1):
        r1 = plan.rows(g, stride=8, offset=4)
        r2 = b.row_indices(["x", "y"], [13, 7], stride=8, offset=4, group=g)
        assert _rows(r1) == _rows(r2)
    # into fixed buffers, twice (writers may run as often as asked)
    out = RowIndices.allocate(2, 64, 64)
    assert _rows(plan.rows(0, stride=8, out=out)) == _rows(plan.rows(0, stride=8, out=out))


def test_a_plan_is_stale_after_any_change_and_valid_after_reads():
    mgr = BlockManager(64, BS, hash_key=KEY, groups=GROUPS["window"])
    mgr.add("a", list(range(9)))
    mgr.add("b", list(range(5)))
    plan = mgr.plan_step(["a", "b"], [9, 5])
    for read in (
        lambda: mgr.probe(list(range(9))),
        mgr.check,
        mgr.take_events,
        lambda: mgr.blocks_needed("a", 3),
        lambda: mgr.num_tokens("a"),
        lambda: mgr.block_table("a"),
    ):
        read()
        assert not plan.stale
        plan.metadata(0)
    changes = [
        lambda: mgr.append("a", [1]),
        lambda: mgr.append_batch(["a", "b"], [1, 2]),
        lambda: mgr.add("c", [1, 2, 3]),
        lambda: mgr.fork("a", "a2"),
        lambda: mgr.reserve("a2", 2),
        lambda: mgr.free("a2"),
        lambda: mgr.schedule(["a"], [1]),
        lambda: mgr.metadata(["b"], [1]),
    ]
    for change in changes:
        mgr.take_copies()  # (a fork's copy-on-write, drained: a real engine copies them)
        q = [mgr.num_tokens(i) - mgr.num_computed(i) for i in ("a", "b")]
        plan = mgr.plan_step(["a", "b"], q)
        change()
        assert plan.stale
        with pytest.raises(kvblocks.InvalidStateError, match="changed since plan_step"):
            plan.metadata(0)
        with pytest.raises(kvblocks.InvalidStateError, match="changed since plan_step"):
            plan.rows(1, stride=BS)
        mgr.check()


def test_plan_keeps_its_own_copies_of_the_batch():
    mgr = BlockManager(64, BS, hash_key=KEY)
    mgr.add("a", list(range(10)))
    q = np.array([10], dtype=np.int32)
    plan = mgr.plan_step(["a"], q)
    q[0] = 1000  # the caller's array changes afterwards: the plan does not
    assert plan.metadata().num_tokens == 10


def test_failed_plans_change_nothing():
    mgr = BlockManager(64, BS, hash_key=KEY, groups=GROUPS["window"])
    mgr.add("a", list(range(9)))
    mgr.add("b", list(range(5)))
    before = _state(mgr, ["a", "b"])
    bad = [
        (lambda: mgr.plan_step(["a", "a"], [9, 9]), kvblocks.InvalidArgumentError),
        (lambda: mgr.plan_step(["a", "zz"], [9, 1]), kvblocks.UnknownSequenceError),
        (lambda: mgr.plan_step(["a", "b"], [1, 5]), kvblocks.InvalidStateError),  # a gap
        (lambda: mgr.plan_step(["a"], [10]), kvblocks.InvalidArgumentError),
        (lambda: mgr.plan_step(["a"], [9, 1]), kvblocks.InvalidArgumentError),
        (lambda: mgr.plan_step(["a"], [9], draft_lens=[4]), kvblocks.InvalidStateError),
        (lambda: mgr.plan_step(["a"], [2.0]), kvblocks.InvalidTypeError),
    ]
    for call, exc in bad:
        with pytest.raises(exc):
            call()
        assert _state(mgr, ["a", "b"]) == before
        mgr.check()


def test_a_buffer_too_small_fails_and_the_plan_stays_usable():
    mgr = BlockManager(64, BS, hash_key=KEY)
    mgr.add("a", list(range(10)))
    plan = mgr.plan_step(["a"], [10])
    small = AttentionMetadata.allocate(1, 4, 8, 8)
    with pytest.raises(kvblocks.InvalidArgumentError):
        plan.metadata(out=small)
    with pytest.raises(kvblocks.InvalidArgumentError):
        plan.rows(stride=BS, out=RowIndices.allocate(1, 4, 4))
    assert plan.metadata().num_tokens == 10
    with pytest.raises(kvblocks.InvalidTypeError):
        plan.metadata(out=object())
    with pytest.raises(kvblocks.InvalidArgumentError):
        plan.metadata(group=3)


def test_state_groups_have_metadata_but_no_rows():
    mgr = BlockManager(64, BS, hash_key=KEY, groups=GROUPS["state"])
    mgr.add("a", list(range(9)))
    plan = mgr.plan_step(["a"], [9])
    assert plan.metadata(2).slot_mapping.tolist()[:9] == [-1] * 9
    with pytest.raises(kvblocks.InvalidArgumentError, match="state group"):
        plan.rows(2, stride=BS)


def test_plan_step_declares_once_and_caches():
    mgr = BlockManager(64, BS, hash_key=KEY, enable_kv_events=True)
    mgr.add("a", list(range(8)))
    mgr.plan_step(["a"], [8])
    stored = [e for e in mgr.take_events() if isinstance(e, kvblocks.BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 2
    assert mgr.num_computed("a") == 8
    with pytest.raises(kvblocks.InvalidArgumentError):
        mgr.plan_step(["a"], [9])


def test_a_deferred_commit_declares_after_the_forward():
    a, b = _pair("window")
    for m in (a, b):
        m.add("x", list(range(13)))
    plan = a.plan_step(["x"], [13], commit=False)
    assert not plan.committed and a.num_computed("x") == 0
    got = _meta(plan.metadata(1))
    assert got == _meta(b.metadata(["x"], [13], group=1))
    assert a.pool.num_cached == 0  # nothing declared: nothing cached yet
    plan.commit()
    b.metadata(["x"], [13], group=0)
    assert plan.committed and not plan.stale
    assert _state(a, ["x"]) == _state(b, ["x"])
    assert _meta(plan.metadata(1)) == got  # the writers stay valid after the commit
    with pytest.raises(kvblocks.InvalidStateError, match="committed already"):
        plan.commit()
    late = a.plan_step(["x"], [0], commit=False)
    a.append("x", [7])
    with pytest.raises(kvblocks.InvalidStateError, match="changed since plan_step"):
        late.commit()
    assert not late.committed
    a.check()


def test_a_deferred_commit_releases_at_plan_time():
    """The release is part of the plan, not of its commit: between plan_step(commit=False)
    and commit(), a window or chunk group's blocks that no query reads any more are free and
    read as the null block, in the tables and in the metadata the forward gets. The step
    releases beyond what the appends did once its sequence's tokens are all computed (here a
    step with no query: the next query is the newest token's recompute). A mutation-testing
    survivor: a plan that left the release to its commit passed every test."""
    for kind in ("window", "chunk"):
        a, b = _pair(kind)
        for m in (a, b):
            m.add("x", list(range(13)))
            m.plan_step(["x"], [13])  # all 13 computed; the prefill's query read from 0
            assert 0 not in m.block_table("x", group=1).tolist(), kind
        plan = a.plan_step(["x"], [0], commit=False)
        want = _meta(b.metadata(["x"], [0], group=1))  # v1: check, release, write, commit
        assert 0 in b.block_table("x", group=1).tolist(), kind  # the step released a block
        assert a.block_table("x", group=1).tolist() == b.block_table("x", group=1).tolist()
        assert a.pool.num_free == b.pool.num_free, kind
        assert _meta(plan.metadata(1)) == want
        plan.commit()
        b.metadata(["x"], [0], group=0)
        assert _state(a, ["x"]) == _state(b, ["x"])
        a.check()


def test_metadata_without_the_flashinfer_page_list():
    """AttentionMetadata.allocate(kv_indices=False): everything else equal, no page list."""
    a, b = _pair("window")
    for m in (a, b):
        for i in range(3):
            m.add(i, list(range(5 + 4 * i)))
    q = [a.num_tokens(i) for i in range(3)]
    for step in range(6):
        for g in (0, 1):
            full = a.metadata(range(3), q, group=g, out=AttentionMetadata.allocate(3, 64, 64, 16))
            lean = b.metadata(
                range(3), q, group=g, out=AttentionMetadata.allocate(3, 64, 0, 16, kv_indices=False)
            )
            assert lean.kv_indices is None
            want, got = _meta(full), _meta(lean)
            del want["kv_indices"], got["kv_indices"]
            assert got == want
        for m in (a, b):
            m.append_batch(range(3), [step] * 3)
        q = [1, 1, 1]
    with pytest.raises(kvblocks.InvalidArgumentError):
        AttentionMetadata.allocate(3, 64, 0, 16)  # a page list needs room


@pytest.mark.parametrize("path", ["v1", "plan", "rows"])
def test_a_window_steps_tables_read_the_null_block_where_it_released(path):
    """Every path writes the window group's table as the manager holds it: positions the
    step's queries cannot read (released when the token was appended) read the null block 0."""
    mgr = BlockManager(64, BS, hash_key=KEY, groups=GROUPS["window"])  # window 6, BS 4
    mgr.add("s", list(range(20)))
    mgr.schedule(["s"], [20])
    mgr.append("s", [7])  # the query: position 20, which reads positions 15..20
    held = mgr.block_table("s", group=1).tolist()
    if path == "rows":
        rows = mgr.row_indices(["s"], [1], stride=BS, block_tables=True, group=1)
        table = rows.block_tables[0].tolist()
    elif path == "plan":
        table = mgr.plan_step(["s"], [1]).metadata(1).block_tables[0].tolist()
    else:
        table = mgr.metadata(["s"], [1], group=1).block_tables[0].tolist()
    assert held[:3] == [0, 0, 0] and 0 not in held[3:6]  # blocks 0-2: positions 0-11
    assert table[:6] == held[:6]
    mgr.check()


def test_a_plan_not_made_by_plan_step_refuses_instead_of_crashing():
    with pytest.raises(TypeError):
        kvblocks.StepPlan()
    bare = kvblocks.StepPlan.__new__(kvblocks.StepPlan)
    for call in (
        bare.metadata,
        bare.commit,
        lambda: bare.rows(stride=4),
        bare.size,
        lambda: bare.stale,
    ):
        with pytest.raises(kvblocks.InvalidStateError, match="not made by"):
            call()
    assert len(bare) == 0
