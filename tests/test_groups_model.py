"""Model-based test of KV cache groups: BlockManager(groups=...) side by side with the
executable spec (ReferenceManager(groups=...), kvblocks/testing/reference_groups.py), for
random workloads over random group configurations: full + sliding window, full + chunked
local, full + state, several windows, windows smaller and larger than a block, a window
group alone.

The rules are those of tests/test_reference_model.py (every call on both, same result or an
allowed error, a failed call changes nothing) plus per-group metadata; the invariant compares
every group's block table (released entries read the null block), computed counts, blocks in
use, ref counts, the free list, the prefix cache and pending copies, then runs check().
"""

from helpers import KEY
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule
from test_reference_model import ReferenceMachine, as_list, both

import kvblocks
from kvblocks import KVGroup
from kvblocks.testing import ReferenceManager

SPANS = st.integers(1, 9)  # block sizes below are 1..4: windows smaller and larger than a block
OTHER = st.one_of(
    SPANS.map(lambda w: KVGroup("sliding_window", window=w)),
    SPANS.map(lambda c: KVGroup("chunked_local", chunk=c)),
    st.integers(1, 2).map(lambda b: KVGroup("state", blocks=b)),
    st.just(KVGroup("full")),
)
GROUPS = st.one_of(
    st.lists(OTHER, min_size=1, max_size=3).map(lambda gs: (KVGroup("full"), *gs)),
    SPANS.map(lambda w: (KVGroup("sliding_window", window=w),)),
    st.lists(OTHER, min_size=2, max_size=3).map(tuple),
)


class GroupsMachine(ReferenceMachine):
    @initialize(
        num_blocks=st.integers(4, 40),
        bs=st.sampled_from([1, 2, 3, 4]),
        caching=st.sampled_from([True, True, False]),
        host=st.sampled_from([0, 0, 24]),
        watermark=st.sampled_from([0.0, 0.0, 0.2]),
        groups=GROUPS,
    )
    def setup(self, num_blocks, bs, caching, host, watermark, groups):
        kw = dict(
            enable_prefix_caching=caching,
            num_host_blocks=host,
            hash_key=KEY,
            watermark=watermark,
            groups=groups,
        )
        self.mgr = kvblocks.BlockManager(num_blocks, bs, **kw)
        self.ref = ReferenceManager(num_blocks, bs, **kw)
        self.ng = len(groups)
        self.bs = bs
        self.next_id = 0
        self.salts = {}

    @rule(data=st.data())
    def metadata_of_one_group(self, data):
        """metadata(group=g): the step declared for that group only."""
        sids, q, drafts = self._step_args(data)
        g = data.draw(st.integers(0, self.ng - 1), label="group")
        kw = {"group": g} if drafts is None else {"group": g, "draft_lens": drafts}
        ok, want, got = both(
            lambda: self.ref.metadata(sids, q, **kw), lambda: self.mgr.metadata(sids, q, **kw)
        )
        if ok:
            self.same_metadata(
                want, got, lambda row: int(want.kv_indptr[row + 1] - want.kv_indptr[row])
            )

    @invariant()
    def same_state(self):
        if not hasattr(self, "mgr"):
            return
        for sid in self.ref.seq_ids():
            for g in range(self.ng):
                want = as_list(self.ref.block_table(sid, group=g))
                assert as_list(self.mgr.block_table(sid, group=g)) == want, (sid, g)
            assert self.mgr.blocks_in_use(sid) == self.ref.blocks_in_use(sid), sid
            if any(0 in as_list(self.ref.block_table(sid, group=g)) for g in range(self.ng)):
                event("a window group released blocks")
        super().same_state()


TestGroupsMachine = GroupsMachine.TestCase
TestGroupsMachine.settings = TestGroupsMachine.settings  # the profile in conftest.py decides
