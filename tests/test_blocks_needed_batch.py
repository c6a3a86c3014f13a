"""BlockManager.blocks_needed_batch: the blocks a scheduler's step takes for a batch (decode
tokens or prefill chunks, draft slots, forks), counted by the core exactly as the calls take
them and checked against the executable spec, in every group kind and order; and the three
documented facts about draft-slot reservations (docs/engine-integration.md)."""

import itertools

import pytest
from helpers import KEY
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import BlockManager, KVGroup
from kvblocks.errors import (
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    UnknownSequenceError,
)
from kvblocks.testing import ReferenceManager

KINDS = {
    "full": KVGroup("full"),
    "sliding_window": KVGroup("sliding_window", window=3),
    "chunked_local": KVGroup("chunked_local", chunk=4),
    "state": KVGroup("state", blocks=2),
}
CONFIGS = [None, ("sliding_window",), ("state",)] + [
    order for n in (2, 3) for order in itertools.permutations(KINDS, n)
]


def make(cls, kinds, bs, num_blocks=400):
    groups = None if kinds is None else tuple(KINDS[k] for k in kinds)
    return cls(num_blocks, bs, groups=groups, hash_key=KEY, num_host_blocks=64)


def outcome(call):
    try:
        return call(), None
    except KVBlocksError as e:
        return None, type(e)


OPS = st.lists(
    st.tuples(
        st.sampled_from(["add", "fork", "append", "step", "truncate", "reserve", "swap", "free"]),
        st.integers(0, 50),
        st.integers(0, 9),
    ),
    max_size=12,
)


def run_ops(mgrs, ops):
    """The same calls on the core and the spec; both must agree on each outcome."""
    ids = []
    for k, (op, pick, n) in enumerate(ops):
        live = [s for s in ids if s in mgrs[0].seq_ids()]
        sid = live[pick % len(live)] if live else None

        def call(m, op=op, sid=sid, n=n, k=k):
            if op == "add" or sid is None:
                return m.add(f"s{k}", [k * 10 + i for i in range(n + 1)])
            if op == "fork":
                return m.fork(sid, f"s{k}")
            if op == "append":
                return m.append(sid, list(range(n)))
            if op == "step":
                if m.num_pending_copies:
                    m.take_copies()
                return m.schedule([sid], [m.num_tokens(sid) - m.num_computed(sid)])
            if op == "truncate":
                return m.truncate(sid, max(0, m.num_tokens(sid) - n))
            if op == "reserve":
                return m.reserve(sid, n)
            if op == "swap":
                return m.swap_out(sid) if not m.is_swapped(sid) else m.swap_in(sid)
            return m.free(sid)

        got = [outcome(lambda m=m: call(m))[1] for m in mgrs]
        assert got[0] is got[1], (op, got)
        if op in ("add", "fork") or sid is None:
            ids.append(f"s{k}")


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(CONFIGS),
    st.integers(1, 4),
    OPS,
    st.data(),
)
def test_step_count_is_exact_and_the_specs(kinds, bs, ops, data):
    mgr, ref = make(BlockManager, kinds, bs), make(ReferenceManager, kinds, bs)
    run_ops((mgr, ref), ops)
    live = [s for s in mgr.seq_ids() if not mgr.is_swapped(s)]
    batch = data.draw(st.lists(st.sampled_from(live), unique=True) if live else st.just([]))
    B = len(batch)
    n = data.draw(st.one_of(st.integers(0, 9), st.lists(st.integers(0, 9), min_size=B, max_size=B)))
    d = data.draw(st.none() | st.lists(st.integers(0, 9), min_size=B, max_size=B))
    f = data.draw(st.none() | st.lists(st.integers(0, 3), min_size=B, max_size=B))
    want = ref.blocks_needed_batch(batch, n, draft_lens=d, forks=f)
    got = mgr.blocks_needed_batch(batch, n, draft_lens=d, forks=f)
    assert got == want
    assert mgr.blocks_needed_batch(batch, n, draft_lens=d, forks=f, watermark=True) == got
    # the calls it counts take exactly that many blocks
    ns = [n] * B if isinstance(n, int) else list(n)
    ds = [0] * B if d is None else d
    fs = [0] * B if f is None else f
    free = mgr.pool.num_free
    if got > free:
        return
    for sid, a, b in zip(batch, ns, ds):
        mgr.reserve(sid, a + b)
    for sid, a, k in zip(batch, ns, fs):
        for c in range(k):
            mgr.fork(sid, f"{sid}/{c}")
            mgr.reserve(f"{sid}/{c}", a)  # a child's first tokens (its drafts come later)
    assert free - mgr.pool.num_free == got
    mgr.take_copies()
    mgr.check()


@pytest.mark.parametrize("kinds", CONFIGS, ids=lambda k: "-".join(k or ("default",)))
def test_a_child_takes_a_block_per_token_group_and_a_state_groups_blocks(kinds):
    """docs/engine-integration.md's "one free block per child" is one group's rule: with G
    groups a child of a sequence with a partly filled last block takes one copy in each
    token group, and a state group's fork copies all its blocks."""
    mgr = make(BlockManager, kinds, 4)
    mgr.add("a", list(range(10)))
    mgr.schedule(["a"], [10])
    groups = mgr.groups
    per_child = sum(g.span if g.kind == "state" else 1 for g in groups)
    assert mgr.blocks_needed_batch(["a"], 1, forks=[3]) == 3 * per_child
    assert mgr.blocks_needed_batch(["a"], 0, forks=[3]) == 3 * sum(
        g.span for g in groups if g.kind == "state"
    )


def snapshot(mgr):
    return (
        mgr.pool.free_list().tolist(),
        mgr.pool.ref_counts().tolist(),
        {s: mgr.blocks_in_use(s) for s in mgr.seq_ids()},
    )


@pytest.mark.parametrize("cls", [BlockManager, ReferenceManager])
def test_bad_input_is_refused_and_changes_nothing(cls):
    mgr = make(cls, ("full", "state"), 4)
    mgr.add("a", list(range(10)))
    mgr.add("b", list(range(5)))
    mgr.schedule(["a", "b"], [10, 5])
    mgr.add("c", [1, 2])
    mgr.swap_out("c")
    before = snapshot(mgr)
    bad = [
        (UnknownSequenceError, (["zz"],), {}),
        (InvalidArgumentError, (["a", "a"],), {}),
        (InvalidStateError, (["c"],), {}),
        (InvalidArgumentError, (["a"], -1), {}),
        (InvalidArgumentError, (["a"], [1, 2]), {}),
        (InvalidArgumentError, (["a"],), {"draft_lens": [-1]}),
        (InvalidArgumentError, (["a", "b"],), {"draft_lens": [1]}),
        (InvalidArgumentError, (["a"],), {"forks": [-1]}),
        (InvalidArgumentError, (["a"],), {"forks": [1, 1]}),
        (InvalidTypeError, (["a"], 1.5), {}),
        (InvalidTypeError, (["a"],), {"forks": ["x"]}),
    ]
    for exc, args, kw in bad:
        with pytest.raises(exc):
            mgr.blocks_needed_batch(*args, **kw)
        assert snapshot(mgr) == before, (args, kw)
    assert mgr.blocks_needed_batch([]) == 0


@pytest.mark.parametrize("kinds", CONFIGS, ids=lambda k: "-".join(k or ("default",)))
def test_reserved_draft_slots(kinds):
    """The three facts docs/engine-integration.md states: (1) slots already reserved count
    as held: blocks_needed / blocks_needed_batch ask nothing more for them; (2) unused
    reserved slots (rejected drafts) stay in the table, held, for the next step; (3)
    truncate(seq, num_tokens(seq)) releases them (as free does)."""
    mgr = make(BlockManager, kinds, 4)
    mgr.add("a", list(range(10)))
    mgr.schedule(["a"], [10])
    need = mgr.blocks_needed("a", 1 + 6)
    assert mgr.blocks_needed_batch(["a"], 1, draft_lens=[6]) == need
    free = mgr.pool.num_free
    mgr.reserve("a", 1 + 6)  # the next token and six drafts
    assert mgr.pool.num_free == free - need
    assert mgr.blocks_needed("a", 7) == 0  # (1)
    assert mgr.blocks_needed_batch(["a"], 1, draft_lens=[6]) == 0
    mgr.schedule(["a"], [1], draft_lens=[6])  # (the token of the last step and 6 drafts)
    mgr.append("a", [1, 2], computed=True)  # two drafts accepted
    token_groups = [g for g, grp in enumerate(mgr.groups) if grp.kind != "state"]
    for g in token_groups:  # (2) the rest stays reserved: 17 positions' blocks
        assert len(mgr.block_table("a", group=g)) == 5
    assert mgr.blocks_needed("a", 5) == 0
    free = mgr.pool.num_free
    lens = [len(mgr.block_table("a", group=g)) for g in range(len(mgr.groups))]
    mgr.truncate("a", mgr.num_tokens("a"))  # (3)
    for g in token_groups:
        assert len(mgr.block_table("a", group=g)) == 3  # 12 tokens: the reserved blocks went
    assert mgr.pool.num_free == free + sum(lens[g] - 3 for g in token_groups)
    assert mgr.blocks_needed("a", 5) == 2 * len(token_groups)
    with pytest.raises(InvalidStateError):  # and the drafts need a new reserve, in every kind
        mgr.schedule(["a"], [1], draft_lens=[5])
    mgr.check()
