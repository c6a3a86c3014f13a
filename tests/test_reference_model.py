"""Model-based test: BlockManager side by side with the executable spec
(kvblocks.testing.ReferenceManager, written from the documents, not from the C code).

Every rule makes the same call on both. The reference decides success or the error (any of
the types it allows, see ``same_error``); results must be equal. The invariant compares
block tables, tokens, computed counts, ref counts, the free list (as a set where the
documents leave its order open), the prefix cache, eviction counts, pending copies and the
host pool, then runs the native ``check()``. A failed call must change nothing: the
reference did not change either.
"""

import numpy as np
from helpers import KEY
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

import kvblocks
from kvblocks import BlockManager, KVBlocksError
from kvblocks.testing import ReferenceManager, same_error, strategies

# few distinct prefixes so that prompts share blocks and the cache gets hits
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]
TOKENS = st.integers(0, 50)


def both(ref_call, real_call):
    """Run the reference; the core must succeed with the same result or fail alike.
    Returns (ok, reference result, core result)."""
    try:
        want = ref_call()
    except KVBlocksError as expected:
        try:
            real_call()
        except Exception as got:  # noqa: BLE001 - compared below
            assert same_error(expected, got), (
                f"reference raised {type(expected).__name__}({expected}), core raised "
                f"{type(got).__name__}({got})"
            )
            return False, None, None
        raise AssertionError(
            f"reference raised {type(expected).__name__}({expected}); the core succeeded"
        )
    got = real_call()
    return True, want, got


def as_list(x):
    return np.asarray(x).tolist()


class ReferenceMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(
        num_blocks=st.integers(4, 28),
        bs=st.sampled_from([1, 2, 3, 4]),
        caching=st.sampled_from([True, True, False]),
        host=st.sampled_from([0, 0, 12]),
        watermark=st.sampled_from([0.0, 0.0, 0.2]),
    )
    def setup(self, num_blocks, bs, caching, host, watermark):
        kw = dict(
            enable_prefix_caching=caching, num_host_blocks=host, hash_key=KEY, watermark=watermark
        )
        self.mgr = kvblocks.BlockManager(num_blocks, bs, **kw)
        self.ref = ReferenceManager(num_blocks, bs, **kw)
        self.bs = bs
        self.next_id = 0
        self.salts = {}  # salt of each sequence (for pool lookups)

    def _new_id(self, as_str):
        self.next_id += 1
        return f"s{self.next_id}" if as_str else self.next_id

    def _live(self, swapped=None):
        return [
            s for s in self.ref.seq_ids() if swapped is None or self.ref.is_swapped(s) == swapped
        ]

    # -- lifecycle -----------------------------------------------------------------------------
    @rule(
        target=seqs,
        prefix=st.sampled_from(range(len(PREFIXES))),
        cut=st.integers(0, 12),
        tail=st.lists(TOKENS, max_size=6),
        salt=st.sampled_from([None, "t1"]),
        as_str=st.booleans(),
    )
    def add(self, prefix, cut, tail, salt, as_str):
        sid = self._new_id(as_str)
        tokens = PREFIXES[prefix][:cut] + tail
        ok, want, got = both(
            lambda: self.ref.add(sid, tokens, salt=salt),
            lambda: self.mgr.add(sid, np.array(tokens, dtype=np.int64), salt=salt),
        )
        if ok:
            assert want == got
            self.salts[sid] = salt
        return sid  # also when the add failed: rules must then see an unknown sequence

    @rule(sid=seqs)
    def add_duplicate(self, sid):
        both(lambda: self.ref.add(sid, [1, 2]), lambda: self.mgr.add(sid, [1, 2]))

    @rule(sid=seqs, tokens=st.lists(TOKENS, max_size=9))
    def append(self, sid, tokens):
        both(lambda: self.ref.append(sid, tokens), lambda: self.mgr.append(sid, tokens))

    @rule(data=st.data())
    def append_batch(self, data):
        live = self._live()
        sids = data.draw(st.lists(st.sampled_from(live), max_size=6) if live else st.just([]))
        tokens = data.draw(st.lists(TOKENS, min_size=len(sids), max_size=len(sids)))
        real_ids = sids
        if data.draw(st.booleans()):  # a pre-resolved SeqBatch
            real_ids = self.mgr.batch(list(dict.fromkeys(sids)))
            sids = list(real_ids.seq_ids)
            tokens = tokens[: len(sids)]
        both(
            lambda: self.ref.append_batch(sids, tokens),
            lambda: self.mgr.append_batch(real_ids, np.array(tokens, dtype=np.int32)),
        )

    @rule(sid=seqs, n=st.integers(0, 7))
    def reserve(self, sid, n):
        both(lambda: self.ref.reserve(sid, n), lambda: self.mgr.reserve(sid, n))

    @rule(sid=seqs, back=st.integers(-1, 6))
    def truncate(self, sid, back):
        n = (self.ref.num_tokens(sid) if sid in self.ref else 0) - back
        both(lambda: self.ref.truncate(sid, n), lambda: self.mgr.truncate(sid, n))

    @rule(target=seqs, parent=seqs, as_str=st.booleans())
    def fork(self, parent, as_str):
        child = self._new_id(as_str)
        ok, _, _ = both(lambda: self.ref.fork(parent, child), lambda: self.mgr.fork(parent, child))
        if ok:
            self.salts[child] = self.salts.get(parent)
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid):
        both(lambda: self.ref.free(sid), lambda: self.mgr.free(sid))

    @rule(sid=seqs)
    def swap_out(self, sid):
        ok, want, got = both(lambda: self.ref.swap_out(sid), lambda: self.mgr.swap_out(sid))
        if ok:
            assert as_list(got) == as_list(want)

    @rule(sid=seqs)
    def swap_in(self, sid):
        ok, want, got = both(lambda: self.ref.swap_in(sid), lambda: self.mgr.swap_in(sid))
        if ok:
            assert as_list(got) == as_list(want)

    @rule()
    def take_copies(self):
        assert as_list(self.mgr.take_copies()) == as_list(self.ref.take_copies())

    # -- the step --------------------------------------------------------------------------------
    def _step_args(self, data):
        """A batch with query lengths that are mostly right (every uncomputed token), some
        too short (a gap) or too long, and sometimes draft lengths (reserved slots)."""
        live = self._live()
        sids = data.draw(
            st.lists(st.sampled_from(live), max_size=4) if live else st.just([]), label="seq_ids"
        )
        q, d = [], []
        for s in sids:
            n, c = self.ref.num_tokens(s), self.ref.num_computed(s)
            q.append(
                data.draw(
                    st.sampled_from([n - c, n - c, n, max(0, n - c - 1), n + 1]), label="query_len"
                )
            )
            slack = len(self.ref.block_table(s)) * self.bs - n
            d.append(data.draw(st.sampled_from([0, max(0, slack), 1]), label="draft_len"))
        drafts = d if data.draw(st.booleans(), label="with drafts") else None
        return sids, q, drafts

    @rule(data=st.data())
    def metadata(self, data):
        sids, q, drafts = self._step_args(data)
        kw = {} if drafts is None else {"draft_lens": drafts}
        ok, want, got = both(
            lambda: self.ref.metadata(sids, q, **kw), lambda: self.mgr.metadata(sids, q, **kw)
        )
        if ok:
            self.same_metadata(want, got, lambda row: -(-int(want.seq_lens[row]) // self.bs))

    def same_metadata(self, want, got, used):
        """Every metadata array equal; block-table rows equal over their ``used(row)`` entries
        (the padding past them is not specified)."""
        for name in ("slot_mapping", "seq_lens", "kv_indptr", "kv_indices", "kv_last_page_len"):
            assert as_list(getattr(got, name)) == as_list(getattr(want, name)), name
        for row, table in enumerate(want.block_tables.tolist()):
            assert as_list(got.block_tables[row][: used(row)]) == table[: used(row)]

    @rule(data=st.data())
    def schedule(self, data):
        sids, q, drafts = self._step_args(data)
        both(
            lambda: self.ref.schedule(sids, q, draft_lens=drafts),
            lambda: self.mgr.schedule(sids, q, draft_lens=drafts),
        )

    @rule(sid=seqs, data=st.data())
    def append_accepted_drafts(self, sid, data):
        """Commit drafts the last step wrote (computed=True); sometimes more than it wrote."""
        tokens = data.draw(st.lists(TOKENS, min_size=1, max_size=4))
        both(
            lambda: self.ref.append(sid, tokens, computed=True),
            lambda: self.mgr.append(sid, tokens, computed=True),
        )

    # -- scheduling queries ------------------------------------------------------------------------
    @rule(sid=seqs, n=st.integers(0, 9))
    def blocks_needed(self, sid, n):
        ok, want, got = both(
            lambda: self.ref.blocks_needed(sid, n), lambda: self.mgr.blocks_needed(sid, n)
        )
        assert not ok or want == got

    @rule(data=st.data(), n=st.integers(0, 5))
    def can_append(self, data, n):
        live = self._live()
        sids = data.draw(
            st.lists(st.sampled_from(live), unique=True, max_size=4) if live else st.just([])
        )
        ok, want, got = both(
            lambda: self.ref.can_append(sids, n), lambda: self.mgr.can_append(sids, n)
        )
        assert not ok or want == got

    @rule(n=st.integers(0, 40))
    def can_add(self, n):
        assert self.mgr.can_add(n) == self.ref.can_add(n)

    # -- block level -------------------------------------------------------------------------------
    @precondition(lambda self: self.ref.pool.enable_prefix_caching)
    @rule(sid=seqs, pin=st.booleans())
    def lookup(self, sid, pin):
        """Pool-level lookup of a live sequence's hashes; pinned hits are released at once."""
        if sid not in self.ref:
            return
        toks = self.ref.token_ids(sid)
        hashes = kvblocks.hash_blocks(toks, self.bs, salt=self.salts.get(sid), key=KEY)
        if not pin:
            assert as_list(self.mgr.pool.lookup(hashes)) == as_list(self.ref.pool.lookup(hashes))
            return
        got = self.mgr.pool.lookup_and_pin(hashes)
        want = self.ref.pool.lookup_and_pin(hashes)
        assert as_list(got) == as_list(want)
        self.mgr.pool.check()  # the manager check would see the extra references
        self.compare_pools()
        self.mgr.pool.free(got[::-1])
        self.ref.pool.free(want[::-1])

    @rule()
    def reset_prefix_cache(self):
        both(self.ref.pool.reset_prefix_cache, self.mgr.pool.reset_prefix_cache)

    # -- invariant ---------------------------------------------------------------------------------
    def compare_pools(self):
        for name, real, ref in [
            ("device", self.mgr.pool, self.ref.pool),
            ("host", self.mgr.host_pool, self.ref.host_pool),
        ]:
            if ref is None:
                continue
            assert as_list(real.ref_counts()) == as_list(ref.ref_counts()), f"{name} ref counts"
            free = as_list(real.free_list())
            if ref.free_order_known:
                assert free == as_list(ref.free_list()), f"{name} free list"
            else:
                ref.adopt_free_order(free)  # same set, order not documented
            assert real.num_free == ref.num_free

    @invariant()
    def same_state(self):
        if not hasattr(self, "mgr"):
            return
        mgr, ref = self.mgr, self.ref
        assert len(mgr) == len(ref)
        for sid in ref.seq_ids():
            assert as_list(mgr.block_table(sid)) == as_list(ref.block_table(sid)), sid
            assert as_list(mgr.token_ids(sid)) == as_list(ref.token_ids(sid)), sid
            assert mgr.num_tokens(sid) == ref.num_tokens(sid)
            assert mgr.num_computed(sid) == ref.num_computed(sid), sid
            assert mgr.is_swapped(sid) == ref.is_swapped(sid)
        self.compare_pools()
        pool = mgr.pool
        assert {
            b: pool.block_hash(b) for b in range(pool.num_blocks) if pool.is_cached(b)
        } == ref.pool.cached()
        assert pool.num_cached == ref.pool.num_cached
        assert pool.num_evictable == ref.pool.num_evictable
        assert pool.stats.evictions == ref.pool.evictions
        assert mgr.num_pending_copies == ref.num_pending_copies
        ref.check()
        mgr.check()


TestReferenceMachine = ReferenceMachine.TestCase


@settings(max_examples=40, deadline=None)
@given(workload=strategies.workloads([list(range(1, 17)), [7] * 12], max_requests=8))
def test_workload_prefix_hits_match_the_reference(workload):
    """Requests of a serving workload admitted, computed and finished in order: the core and
    the executable specification agree on every prefix hit and block table."""
    real = BlockManager(64, 4, hash_key=KEY)
    spec = ReferenceManager(64, 4, hash_key=KEY)
    for i, req in enumerate(workload):
        for m in (real, spec):
            cached = m.add(i, req["prompt"])
            m.schedule([i], [len(req["prompt"]) - cached])
        assert real.block_table(i).tolist() == spec.block_table(i).tolist()
        assert real.num_computed(i) == spec.num_computed(i)
        if i % 3 == 2:  # finish some: their blocks stay cached for later requests
            real.free(i)
            spec.free(i)
    real.check()
