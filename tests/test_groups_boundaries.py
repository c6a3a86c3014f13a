"""Window and chunk rules at every block boundary, core against the reference.

Mutation testing of the group-native reference (issue 25, item 6) found the stateful model
tests weak on these rules at the default profile: a window's longest hit requiring one more
leading block, or a release one block short at a boundary, survived 60 examples. This test
walks the boundaries directly instead of hoping a random run lands on them: for each window
or chunk around the block size and each prompt length around a multiple of it, a prompt is
computed and freed (cached), then prompts sharing a prefix of every length around the
boundaries are added; the hit, the null (released) entries of every table and the free count
must agree with the reference after every call.
"""

import numpy as np
import pytest

from kvblocks import BlockManager, KVGroup
from kvblocks.testing import ReferenceManager

BS = 4


def _kinds():
    for w in (1, BS - 1, BS, BS + 1, 2 * BS, 3 * BS - 1):
        yield KVGroup("sliding_window", window=w)
    for c in (BS, 2 * BS, 3 * BS):
        yield KVGroup("chunked_local", chunk=c)


def _lengths():
    return sorted({max(1, k * BS + d) for k in range(1, 5) for d in (-1, 0, 1)})


def _same(mgr, ref, sids, groups):
    assert mgr.num_free_blocks == ref.num_free_blocks
    for sid in sids:
        for g in range(len(groups)):
            got = np.asarray(mgr.block_table(sid, g)) == 0
            want = np.asarray(ref.block_table(sid, g)) == 0
            assert got.tolist() == want.tolist(), (sid, g)


@pytest.mark.parametrize("alone", [False, True], ids=["with-full", "alone"])
@pytest.mark.parametrize("kind", list(_kinds()), ids=repr)
def test_hits_and_releases_at_every_boundary(kind, alone):
    groups = (kind,) if alone else (KVGroup("full"), kind)
    base = list(range(1, 6 * BS))
    for plen in _lengths():
        mgr = BlockManager(96, BS, groups=groups)
        ref = ReferenceManager(96, BS, groups=groups)
        for m in (mgr, ref):
            m.add("a", base[:plen])
            m.schedule(["a"], [plen])
            m.append("a", [500])  # one decode step: the window moves on
            m.schedule(["a"], [1])
        _same(mgr, ref, ["a"], groups)
        for m in (mgr, ref):
            m.free("a")
        for qlen in _lengths():
            q = base[:qlen] + [900 + qlen]  # shares a prefix of min(qlen, plen) tokens
            hit = mgr.add("b", q)
            assert hit == ref.add("b", q), (plen, qlen)
            _same(mgr, ref, ["b"], groups)
            for m in (mgr, ref):
                m.schedule(["b"], [len(q) - hit])
            _same(mgr, ref, ["b"], groups)
            for m in (mgr, ref):
                m.free("b")
        mgr.check()
