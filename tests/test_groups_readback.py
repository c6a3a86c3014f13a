"""Byte-level read-back with KV cache groups: every live sequence reads back, per group,
exactly the history its next step reads (kvblocks.testing.KVReadback): all computed
positions of a full group, those from the first one the next query reads of a window or
chunk group (never a released entry), a state group's blocks as the last step wrote them.

GroupsEngineMachine runs random engine steps over random group configurations; the named
tests walk every operation once per configuration and show that the check catches what it
is meant to catch."""

import numpy as np
import pytest

from kvblocks import BlockManager, KVGroup
from kvblocks.errors import InvalidStateError
from kvblocks.testing import KVReadback, ReadbackError
from kvblocks.testing.machines import GroupsEngineMachine
from kvblocks.testing.readback import first_needed

TestGroupsEngine = GroupsEngineMachine.TestCase

BS = 4
CONFIGS = {
    "full+window3": (KVGroup("full"), KVGroup("sliding_window", window=3)),
    "full+window6": (KVGroup("full"), KVGroup("sliding_window", window=6)),
    "full+chunk4": (KVGroup("full"), KVGroup("chunked_local", chunk=4)),
    "full+chunk5": (KVGroup("full"), KVGroup("chunked_local", chunk=5)),
    "full+state": (KVGroup("full"), KVGroup("state", blocks=2)),
    "window5": (KVGroup("sliding_window", window=5),),
    "all": (
        KVGroup("sliding_window", window=2),
        KVGroup("full"),
        KVGroup("state", blocks=1),
        KVGroup("chunked_local", chunk=8),
    ),
}


def engine(groups, num_blocks=96, host=96):
    mgr = BlockManager(num_blocks, BS, groups=groups, num_host_blocks=host)
    return mgr, KVReadback(mgr)


def settle(rb):
    rb.drain()
    rb.assert_all()
    rb.mgr.check()


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_operation_reads_back(name):
    """Prefix hits, chunked prefill, decode, fork (copy-on-write per group, the state copied),
    swap out and in, speculative verify with accepted and rejected drafts, truncate, a
    recompute of the newest token: the bytes after every step."""
    groups = CONFIGS[name]
    has_state = any(g.kind == "state" for g in groups)
    mgr, rb = engine(groups)
    prompt = list(range(1, 20))
    rb.add("a", prompt[:7])  # chunked prefill: 7, then the rest
    rb.forward(["a"])
    settle(rb)
    rb.append("a", prompt[7:])
    rb.forward(["a"])
    settle(rb)
    for t in range(5):
        rb.append_batch(["a"], [30 + t])
        rb.forward(["a"])
        settle(rb)
    cached = rb.add("b", prompt + [40, 41])  # a prefix hit in every group (or none: state)
    assert cached == (0 if has_state else 16)
    settle(rb)
    rb.forward(["b"])
    settle(rb)
    rb.fork("b", "c")  # shares b's partial block; a state group copies at once
    assert mgr.num_pending_copies == (sum(g.span for g in groups if g.kind == "state"))
    settle(rb)
    rb.append_batch(["b", "c"], [50, 51])  # copy-on-write of the shared block, per group
    settle(rb)
    rb.forward(["b", "c"])
    settle(rb)
    rb.swap_out("c")
    settle(rb)  # c reads back from its host tables
    rb.append_batch(["a", "b"], [52, 53])
    rb.forward(["a", "b"])
    settle(rb)
    rb.swap_in("c")
    settle(rb)
    rb.reserve("a", 3)  # speculative: 3 drafts verified, 2 accepted
    settle(rb)
    rb.forward(["a"], drafts=[[60, 61, 62]])
    settle(rb)
    rb.append("a", [60, 61], computed=True)
    settle(rb)
    rb.reserve("b", 2)  # both drafts rejected: roll back
    rb.forward(["b"], drafts=[[70, 71]])
    settle(rb)
    rb.append("b", [72])  # the bonus token only
    rb.truncate("b", rb.mgr.num_tokens("b") - 1)  # and dropped again: uncomputed
    settle(rb)
    rb.forward(["a", "b", "c"], [1, 1, 1])  # recompute each newest token
    settle(rb)
    rb.free("b")
    settle(rb)
    assert mgr.num_tokens("a") == 19 + 5 + 1 + 2


def test_released_positions_are_never_read():
    """A window group's released entries are not read back (their blocks are someone else's
    now), but an entry the next step still reads must not be null."""
    mgr, rb = engine(CONFIGS["full+window3"], num_blocks=12)
    rb.add("a", list(range(13)))
    rb.forward(["a"])
    rb.append_batch(["a"], [7])
    rb.forward(["a"])
    table = mgr.block_table("a", group=1)
    assert table.tolist()[:2] == [0, 0]  # the next query (13) reads [11, 13]
    rb.add("x", list(range(50, 58)))  # reuses the released blocks
    rb.forward(["x"])
    settle(rb)

    class Early:
        """block_table with one entry released too early."""

        groups = mgr.groups

        def block_table(self, sid, group=0):
            t = mgr.block_table(sid, group=group)
            if group == 1 and sid == "a":
                t[first_needed(mgr.groups[1], 14, 14) // BS] = 0
            return t

    with pytest.raises(ReadbackError, match=r"reads positions from 11 on .* null block"):
        rb.assert_reads_back(Early(), "a")


def test_a_missing_state_copy_is_caught():
    """A fork whose state copy never runs: the child's state blocks hold another state."""
    mgr, rb = engine(CONFIGS["full+state"])
    rb.add("a", list(range(9)))
    rb.forward(["a"])
    rb.fork("a", "b")
    mgr.take_copies()  # drained but never run
    with pytest.raises(ReadbackError, match=r"sequence 'b' reads back wrong K/V in group 1"):
        rb.assert_all()


def test_a_block_two_groups_write_is_caught():
    """All groups share the cache's layers: one group's bytes in another group's block are
    reported with the group that wrote them."""
    mgr, rb = engine(CONFIGS["full+window6"])
    rb.add("a", list(range(10)))
    rb.forward(["a"])
    rb.assert_all()
    b0, b1 = mgr.block_table("a", group=0)[1], mgr.block_table("a", group=1)[1]
    rb.cache.planes[:, b1] = rb.cache.planes[:, b0]  # same tokens, written for group 0
    with pytest.raises(
        ReadbackError,
        match=r"in group 1 .*position 4 \(token 4\).*written for sequence 'a' position 4 "
        r"\(token 4\) in group 0",
    ):
        rb.assert_reads_back(mgr, "a")


def test_one_step_writing_a_slot_from_two_groups_is_refused():
    """Two groups whose metadata map the same slot in one step: a ReadbackError before
    anything is written."""
    mgr, rb = engine(CONFIGS["full+chunk4"])
    rb.add("a", list(range(6)))

    class SameSlots:
        groups = mgr.groups
        pool = mgr.pool
        block_size = BS

        def metadata(self, *args, group=0, **kw):
            return mgr.metadata(*args, group=0, **kw)

    rb.mgr = SameSlots()
    before = rb.cache.planes.copy()
    with pytest.raises(ReadbackError, match="two different K/V into slot"):
        rb.forward(["a"])
    assert np.array_equal(rb.cache.planes, before)


def test_state_group_holds_the_last_steps_state():
    """A state group's blocks are written by every step that computes something (drafts
    included), not by a step with nothing to compute; swapped out and in, they come back."""
    mgr, rb = engine(CONFIGS["full+state"])
    rb.add("a", [1, 2, 3])
    settle(rb)  # no step yet: nothing to read back in the state
    rb.forward(["a"])
    first = rb.expected["a"].state
    settle(rb)
    rb.forward(["a"], [0])  # nothing computed: the state stays
    assert rb.expected["a"].state == first
    settle(rb)
    rb.reserve("a", 2)
    rb.forward(["a"], [0], drafts=[[8, 9]])  # the verify writes the state after its drafts
    assert rb.expected["a"].state != first
    settle(rb)
    rb.swap_out("a")
    settle(rb)
    rb.swap_in("a")
    settle(rb)
    with pytest.raises(InvalidStateError):
        rb.truncate("a", 2)  # a state cannot drop computed tokens
    settle(rb)
