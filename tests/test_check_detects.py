"""check() notices every kind of corruption (issue 24, mutation testing: its lookup of each
cached block under its own hash was the only detector of hash-table corruption, and untested).

BlockManager._debug_corrupt (csrc/debug.c, compiled in debug builds only) breaks one
invariant on purpose; check() must raise CorruptionError naming it. Release builds skip the
detection tests (CI runs this file in its debug-build stage, .ci/run).
"""

import pytest
from helpers import KEY, compute

from kvblocks import BlockManager, KVGroup, _core
from kvblocks.errors import CorruptionError, InvalidArgumentError, InvalidStateError

debug_only = pytest.mark.skipif(
    not _core.BUILD_DEBUG_LEVEL, reason="the corruption hooks are compiled in debug builds only"
)

# kind: (the message check() must give, sequence, group)
KINDS = {
    "cache_slot": ("cached block not found under its hash", None, 0),
    "table_entry": ("hash table holds an uncached or bad block", None, 0),
    "unwritten": ("cached block whose K/V were never written", None, 0),
    "free_link": ("free list prev link broken", None, 0),
    "ref_count": ("ref count != references held", None, 0),
    "seq_hash": ("block hash does not match its tokens", "a", 0),
    "computed": ("computed tokens outside", "a", 0),
    "table_block": ("table holds an out-of-range block", "a", 0),
    "state_room": ("a state group's room short of its tokens", "a", 1),
}


def busy(groups=None):
    """Cached held blocks, a held uncached block, evictable and never-cached free blocks."""
    mgr = BlockManager(64, 4, hash_key=KEY, groups=groups)
    mgr.add("a", list(range(10)))
    compute(mgr, "a")
    mgr.add("b", list(range(50, 56)))
    compute(mgr, "b")
    mgr.free("b")
    mgr.check()
    return mgr


@debug_only
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize(
    "groups",
    [None, (KVGroup("state", blocks=1), KVGroup("full"), KVGroup("sliding_window", window=4))],
    ids=["one-group", "state-full-window"],
)
def test_check_names_each_kind_of_corruption(kind, groups):
    what, seq, group = KINDS[kind]
    if groups is None and kind == "state_room":
        pytest.skip("no state group")
    if groups is not None:
        group = 0 if kind == "state_room" else 1  # the full group holds the cached blocks
    mgr = busy(groups)
    mgr._debug_corrupt(kind, seq, group=group)
    with pytest.raises(CorruptionError, match=what):
        mgr.check()


@debug_only
def test_nothing_to_corrupt_is_refused():
    mgr = BlockManager(8, 4)
    with pytest.raises(InvalidStateError, match="nothing to corrupt"):
        mgr._debug_corrupt("cache_slot")  # no cached block
    mgr.check()


@pytest.mark.skipif(bool(_core.BUILD_DEBUG_LEVEL), reason="a release build's refusal")
def test_release_builds_corrupt_nothing():
    mgr = busy()
    with pytest.raises(InvalidStateError, match="debug builds only"):
        mgr._debug_corrupt("cache_slot")
    mgr.check()


def test_unknown_kind():
    with pytest.raises(InvalidArgumentError, match="unknown kind"):
        busy()._debug_corrupt("everything")
