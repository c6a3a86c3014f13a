"""Every step validation in every group kind (issue 24, finding 5).

A step (``schedule``, ``metadata(group=g)``, ``row_indices(group=g)``) validates the same rules
whatever the kind of the group it declares the step for: each case below builds a state
where one rule is broken, then runs every step entry point of every group of a manager with
one group of each kind alone and with all four kinds in every order. Where a rule applies to
the group(s) the call validates, the call raises its typed exception and changes nothing;
where it does not (a window rule in a full group, a shared-block rule in a state group,
whose blocks are never shared or cached), the call succeeds. The executable spec
(ReferenceManager) is run side by side and must agree, raise for raise.

Finding 5 was the draft-slot rule: a state group let ``metadata(group=<state>,
draft_lens=[50])`` through with nothing reserved. A state group now keeps the blocks a token
group's table of the sequence would hold (its tokens, grown by ``reserve``, cut by
``truncate``) and draft slots must lie within them, as in every kind.
"""

import itertools

import numpy as np
import pytest
from helpers import KEY

from kvblocks import BlockManager, KVGroup
from kvblocks.errors import (
    InvalidArgumentError,
    InvalidStateError,
    UnknownSequenceError,
)
from kvblocks.testing import ReferenceManager

BS = 4
KINDS = {
    "full": KVGroup("full"),
    "sliding_window": KVGroup("sliding_window", window=4),
    "chunked_local": KVGroup("chunked_local", chunk=8),
    "state": KVGroup("state", blocks=1),
}
TOKEN_KINDS = ("full", "sliding_window", "chunked_local")
WINDOWED = ("sliding_window", "chunked_local")
CONFIGS = [(k,) for k in KINDS] + list(itertools.permutations(KINDS))


def make(cls, kinds):
    return cls(64, BS, groups=tuple(KINDS[k] for k in kinds), num_host_blocks=32, hash_key=KEY)


def prompt(mgr, sid="a", n=10):
    mgr.add(sid, list(range(100, 100 + n)))
    mgr.schedule([sid], [n])


# -- the cases: (set-up, step arguments, the rule's exception, the kinds it applies to) --------
def setup_plain(mgr):
    prompt(mgr)


def setup_gap(mgr):  # three committed tokens nobody computed: a query of one leaves a gap
    prompt(mgr)
    mgr.append("a", [1, 2, 3])


def setup_swapped(mgr):
    prompt(mgr)
    mgr.swap_out("a")


def setup_copies(mgr):  # fork: a state group copies at once, a token group on the write
    prompt(mgr)
    mgr.fork("a", "b")
    mgr.append_batch(["b"], [7])


def setup_released(mgr):  # the windows move on: a query from 0 reads released blocks
    prompt(mgr)
    mgr.append_batch(["a"], [1])
    mgr.schedule(["a"], [1])


def setup_shared(mgr):  # a's write block (positions 8..11) is shared with its child
    prompt(mgr)
    mgr.fork("a", "b")
    mgr.take_copies()


def setup_cached(mgr):
    """add, compute, truncate into a full cached block: block 1 is private but still holds
    its cache entry (the prefix cache serves it), so drafts there would overwrite cached K/V.
    A state group cannot drop computed tokens: every other group computes, it does not."""
    mgr.add("a", list(range(100, 108)))
    for g, grp in enumerate(mgr.groups):
        if grp.kind != "state":
            mgr.metadata(["a"], [8], group=g)
    mgr.truncate("a", 6)


def setup_reserved_then_truncated(mgr):
    """reserve makes room for three draft slots; truncate(seq, num_tokens(seq)) gives it
    back (every kind), so the same drafts need a new reserve."""
    prompt(mgr)
    mgr.reserve("a", 3)
    mgr.truncate("a", mgr.num_tokens("a"))


ALL = tuple(KINDS)
CASES = {
    # name: (set-up, seq_ids, query_lens, draft_lens, exception, kinds the rule applies to)
    "unknown": (setup_plain, ["zz"], [1], None, UnknownSequenceError, ALL),
    "twice": (setup_plain, ["a", "a"], [1, 1], None, InvalidArgumentError, ALL),
    "lengths": (setup_plain, ["a"], [1, 1], None, InvalidArgumentError, ALL),
    "draft_lengths": (setup_plain, ["a"], [1], [1, 1], InvalidArgumentError, ALL),
    "query_too_long": (setup_plain, ["a"], [11], None, InvalidArgumentError, ALL),
    "query_negative": (setup_plain, ["a"], [-1], None, InvalidArgumentError, ALL),
    "draft_negative": (setup_plain, ["a"], [1], [-1], InvalidArgumentError, ALL),
    "gap": (setup_gap, ["a"], [1], None, InvalidStateError, ALL),
    "swapped": (setup_swapped, ["a"], [1], None, InvalidStateError, ALL),
    "pending_copies": (setup_copies, ["a"], [1], None, InvalidStateError, ALL),
    "drafts_not_reserved": (setup_plain, ["a"], [1], [50], InvalidStateError, ALL),
    "drafts_past_the_block": (setup_plain, ["a"], [1], [3], InvalidStateError, ALL),
    "drafts_within_the_block": (setup_plain, ["a"], [1], [2], None, ()),
    "reserve_given_back": (setup_reserved_then_truncated, ["a"], [1], [3], InvalidStateError, ALL),
    "released_positions": (setup_released, ["a"], [11], None, InvalidStateError, WINDOWED),
    "drafts_in_a_shared_block": (setup_shared, ["a"], [1], [1], InvalidStateError, TOKEN_KINDS),
    "drafts_in_a_cached_block": (setup_cached, ["a"], [6], [1], InvalidStateError, TOKEN_KINDS),
}


def snapshot(mgr):
    seqs = sorted(mgr.seq_ids(), key=str)
    return (
        [
            (mgr.num_tokens(s), mgr.num_computed(s), mgr.is_swapped(s))
            + tuple(mgr.block_table(s, group=g).tolist() for g in range(len(mgr.groups)))
            for s in seqs
        ],
        mgr.pool.free_list().tolist(),
        mgr.pool.ref_counts().tolist(),
        mgr.num_pending_copies,
    )


def targets(kinds):
    """Every step entry point: (name, group or None, the kinds it validates)."""
    yield "schedule", None, kinds
    for g, k in enumerate(kinds):
        yield "metadata", g, (k,)
        if k != "state":
            yield "row_indices", g, (k,)


def step(mgr, name, g, sids, q, d):
    kw = {} if d is None else {"draft_lens": d}
    if name == "schedule":
        return mgr.schedule(sids, q, **kw)
    if name == "metadata":
        return mgr.metadata(sids, q, group=g, **kw)
    return mgr.row_indices(sids, q, stride=BS, group=g, **kw)


def outcome(call, *args, **kw):
    try:
        call(*args, **kw)
    except Exception as e:  # noqa: BLE001 - compared by type below
        return type(e)
    return None


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("kinds", CONFIGS, ids=lambda ks: "-".join(ks))
def test_every_step_validation_in_every_kind(kinds, case):
    setup, sids, q, d, exc, applies = CASES[case]
    for name, g, checked in targets(kinds):
        mgr, ref = make(BlockManager, kinds), make(ReferenceManager, kinds)
        setup(mgr)
        setup(ref)
        want = exc if any(k in applies for k in checked) else None
        before = snapshot(mgr)
        got = outcome(step, mgr, name, g, sids, q, d)
        assert got is want, (name, g, got)
        if want is not None:
            assert snapshot(mgr) == before, (name, g)  # a refused step changes nothing
        if name != "row_indices":  # (the reference builds no rows)
            assert outcome(step, ref, name, g, sids, q, d) is want, (name, g)
            assert snapshot(ref) == snapshot(mgr), (name, g)
        mgr.check()


@pytest.mark.parametrize("kinds", CONFIGS, ids=lambda ks: "-".join(ks))
def test_reserved_drafts_are_accepted_in_every_kind(kinds):
    """The other side of the draft rule: what reserve made room for passes in every group,
    with one slot per draft in a token group and none in a state group."""
    for name, g, checked in targets(kinds):
        mgr = make(BlockManager, kinds)
        prompt(mgr)
        mgr.reserve("a", 50)
        got = step(mgr, name, g, ["a"], [1], [50])
        if name == "metadata":
            slots = np.asarray(got.slot_mapping)
            assert len(slots) == 51
            assert (slots == -1).all() if checked == ("state",) else (slots >= 0).all()
        mgr.check()


@pytest.mark.parametrize("kinds", CONFIGS, ids=lambda ks: "-".join(ks))
def test_computed_appends_need_each_groups_draft_slots(kinds):
    """append(computed=True) commits only draft slots the last step of every group
    scheduled: a step declared for one group (metadata(group=g)) does not license the others;
    more tokens than the slots are refused and change nothing, in every kind."""
    for g in range(len(kinds)):
        for cls in (BlockManager, ReferenceManager):
            mgr = make(cls, kinds)
            prompt(mgr)
            mgr.metadata(["a"], [1], group=g, draft_lens=[2])
            if len(kinds) > 1:  # the other groups scheduled no draft slots
                before = snapshot(mgr)
                got = outcome(mgr.append, "a", [1, 2], computed=True)
                assert got is InvalidStateError, (cls, g)
                assert snapshot(mgr) == before
                mgr.schedule(["a"], [1], draft_lens=[2])
            before = snapshot(mgr)
            assert outcome(mgr.append, "a", [1, 2, 3], computed=True) is InvalidStateError
            assert snapshot(mgr) == before
            mgr.append("a", [1, 2], computed=True)
            assert mgr.num_computed("a") == 12
            mgr.check()


def test_row_indices_of_a_state_group_is_refused():
    mgr = make(BlockManager, ("full", "state"))
    prompt(mgr)
    before = snapshot(mgr)
    with pytest.raises(InvalidArgumentError, match="state group"):
        mgr.row_indices(["a"], [1], stride=BS, group=1)
    assert snapshot(mgr) == before


def test_state_group_metadata_with_unreserved_drafts_regression():
    """Issue 24, finding 5, as reported: metadata(group=<state>, draft_lens=[50]) with
    nothing reserved returned a 51-entry slot mapping."""
    mgr = make(BlockManager, ("full", "state"))
    prompt(mgr)
    with pytest.raises(InvalidStateError, match="reserve"):
        mgr.metadata(["a"], [1], group=1, draft_lens=[50])
    with pytest.raises(InvalidStateError, match="reserve"):
        mgr.metadata(["a"], [1], group=0, draft_lens=[50])


def test_state_room_follows_the_table_a_token_group_would_hold():
    """A state group's room for drafts: the tokens' blocks, grown by reserve, kept by
    appends into it, cut by truncate; a fork's child starts from its tokens' blocks."""
    mgr = make(BlockManager, ("state",))
    prompt(mgr)  # 10 tokens: 3 blocks, room for 2 draft slots

    def ok(sid, d):
        return outcome(lambda: mgr.schedule([sid], [1], draft_lens=[d])) is None

    assert ok("a", 2) and not ok("a", 3)
    mgr.reserve("a", 7)  # 17 positions: 5 blocks
    assert ok("a", 10) and not ok("a", 11)
    mgr.fork("a", "b")
    mgr.take_copies()
    assert ok("b", 2) and not ok("b", 3)
    mgr.append("a", [1, 2, 3], computed=True)  # within the reserved blocks
    assert ok("a", 7) and not ok("a", 8)
    mgr.truncate("a", mgr.num_tokens("a"))  # 13 tokens: 4 blocks
    assert ok("a", 3) and not ok("a", 4)
    mgr.append_batch(["a"], [9])  # 14 tokens: still 4 blocks
    assert ok("a", 2) and not ok("a", 3)
    mgr.check()
