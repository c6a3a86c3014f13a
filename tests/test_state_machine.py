"""Model-based test: BlockManager against the pure-Python model in tests/model.py.

Every rule performs the same call on both; the model predicts success or the exception, and
the invariant compares block tables, tokens, ref counts, the free-list order, the prefix
cache and pending copies, then runs the native check. A failed call must change nothing,
which the invariant proves since the model did not change either.
"""

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize, invariant,
                                 rule)

import kvblocks
from kvblocks import (DuplicateSequenceError, InvalidArgumentError, InvalidStateError,
                      OutOfBlocksError, UnknownSequenceError)

from model import ManagerModel, OutOfBlocks

KEY = b"kvblocks-test-k!"
# few distinct prefixes so that prompts share blocks and the cache gets hits
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]


def expect(model_call, real_call, exc_map):
    """Run the model; on a model exception the real call must raise the mapped type."""
    try:
        result = model_call()
    except tuple(exc_map) as e:
        with pytest.raises(exc_map[type(e)]):
            real_call()
        return None, False
    return (result, real_call()), True


class ManagerMachine(RuleBasedStateMachine):
    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(4, 28), bs=st.sampled_from([1, 2, 3, 4]),
                caching=st.booleans(), host=st.sampled_from([0, 0, 12]))
    def setup(self, num_blocks, bs, caching, host):
        self.mgr = kvblocks.BlockManager(num_blocks, bs, enable_prefix_caching=caching,
                                         num_host_blocks=host, hash_key=KEY)
        self.model = ManagerModel(num_blocks, bs, caching, host, KEY)
        self.next_id = 0

    def _new_id(self, as_str):
        self.next_id += 1
        return f"s{self.next_id}" if as_str else self.next_id

    # -- lifecycle -----------------------------------------------------------------------------
    @rule(target=seqs, prefix=st.sampled_from(range(len(PREFIXES))), cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, 50), max_size=6), salt=st.sampled_from([None, "t1"]),
          as_str=st.booleans())
    def add(self, prefix, cut, tail, salt, as_str):
        sid = self._new_id(as_str)
        tokens = PREFIXES[prefix][:cut] + tail
        res, ok = expect(lambda: self.model.add(sid, tokens, salt),
                         lambda: self.mgr.add(sid, np.array(tokens, dtype=np.int64), salt=salt),
                         {OutOfBlocks: OutOfBlocksError})
        if ok:
            assert res[0] == res[1]
            return sid
        return sid  # not live: rules below tolerate ids that were never added

    @rule(sid=seqs)
    def add_duplicate(self, sid):
        if sid in self.model.seqs:
            with pytest.raises(DuplicateSequenceError):
                self.mgr.add(sid, [1, 2])

    @rule(sid=seqs, tokens=st.lists(st.integers(0, 50), min_size=0, max_size=9))
    def append(self, sid, tokens):
        if sid not in self.model.seqs:
            with pytest.raises(UnknownSequenceError):
                self.mgr.append(sid, tokens)
            return
        expect(lambda: self.model.append(sid, tokens), lambda: self.mgr.append(sid, tokens),
               {OutOfBlocks: OutOfBlocksError, RuntimeError: InvalidStateError})

    @rule(data=st.data())
    def append_batch(self, data):
        live = list(self.model.seqs)
        sids = data.draw(st.lists(st.sampled_from(live), max_size=6) if live else st.just([]))
        tokens = data.draw(st.lists(st.integers(0, 50), min_size=len(sids),
                                    max_size=len(sids)))
        if data.draw(st.booleans()):
            sids_real = self.mgr.batch(list(dict.fromkeys(sids)))
            sids = list(sids_real.seq_ids)
            tokens = tokens[: len(sids)]
        else:
            sids_real = sids
        expect(lambda: self.model.append_batch(sids, tokens),
               lambda: self.mgr.append_batch(sids_real, np.array(tokens, dtype=np.int32)),
               {OutOfBlocks: OutOfBlocksError, ValueError: InvalidArgumentError,
                RuntimeError: InvalidStateError})

    @rule(sid=seqs, n=st.integers(0, 7))
    def reserve(self, sid, n):
        if sid not in self.model.seqs:
            return
        expect(lambda: self.model.reserve(sid, n), lambda: self.mgr.reserve(sid, n),
               {OutOfBlocks: OutOfBlocksError, RuntimeError: InvalidStateError})

    @rule(sid=seqs, back=st.integers(-1, 6))
    def truncate(self, sid, back):
        if sid not in self.model.seqs:
            return
        n = len(self.model.seqs[sid].tokens) - back
        expect(lambda: self.model.truncate(sid, n), lambda: self.mgr.truncate(sid, n),
               {ValueError: InvalidArgumentError, RuntimeError: InvalidStateError})

    @rule(target=seqs, parent=seqs, as_str=st.booleans())
    def fork(self, parent, as_str):
        child = self._new_id(as_str)
        if parent not in self.model.seqs:
            with pytest.raises(UnknownSequenceError):
                self.mgr.fork(parent, child)
            return child
        expect(lambda: self.model.fork(parent, child), lambda: self.mgr.fork(parent, child),
               {RuntimeError: InvalidStateError})
        return child

    @rule(sid=consumes(seqs))
    def free(self, sid):
        if sid not in self.model.seqs:
            with pytest.raises(UnknownSequenceError):
                self.mgr.free(sid)
            return
        self.model.free(sid)
        self.mgr.free(sid)

    @rule(sid=seqs)
    def swap_out(self, sid):
        if sid not in self.model.seqs:
            return
        res, ok = expect(lambda: self.model.swap_out(sid), lambda: self.mgr.swap_out(sid),
                         {OutOfBlocks: OutOfBlocksError, RuntimeError: InvalidStateError})
        if ok:
            assert res[1].tolist() == [list(p) for p in res[0]]

    @rule(sid=seqs)
    def swap_in(self, sid):
        if sid not in self.model.seqs:
            return
        res, ok = expect(lambda: self.model.swap_in(sid), lambda: self.mgr.swap_in(sid),
                         {OutOfBlocks: OutOfBlocksError, RuntimeError: InvalidStateError})
        if ok:
            assert res[1].tolist() == [list(p) for p in res[0]]

    @rule()
    def take_copies(self):
        assert self.mgr.take_copies().tolist() == [list(p) for p in self.model.take_copies()]

    @rule(sid=seqs, pin=st.booleans())
    def lookup(self, sid, pin):
        """Pool-level lookup of a live sequence's hashes; pinned hits are released at once."""
        if sid not in self.model.seqs or not self.model.pool.caching:
            return
        s = self.model.seqs[sid]
        hashes = self.mgr.block_hashes(sid)
        if s.swapped:
            hashes = kvblocks.hash_blocks(np.array(s.tokens, dtype=np.int32), self.model.bs,
                                          salt=s.salt, key=KEY)
        hs = [int(lo) | (int(hi) << 64) for lo, hi in hashes]
        expected = self.model.pool.match(hs)
        if pin:
            got = self.mgr.pool.lookup_and_pin(hashes)
            for b in expected:
                self.model.pool.pin(b)
            assert got.tolist() == expected
            self.mgr.pool.check()  # the manager check would see the extra references
            assert self.mgr.pool.ref_counts().tolist() == self.model.pool.ref
            assert self.mgr.pool.free_list().tolist() == self.model.pool.free
            self.mgr.pool.free(got[::-1])
            for b in reversed(expected):
                self.model.pool.release(b)
        else:
            assert self.mgr.pool.lookup(hashes).tolist() == expected

    @rule()
    def reset_prefix_cache(self):
        try:
            self.model.pool.reset()
        except RuntimeError:
            with pytest.raises(InvalidStateError):
                self.mgr.pool.reset_prefix_cache()
            return
        self.mgr.pool.reset_prefix_cache()

    @rule(sid=seqs)
    def metadata(self, sid):
        if sid not in self.model.seqs or self.model.seqs[sid].swapped:
            return
        n = len(self.model.seqs[sid].tokens)
        meta = self.mgr.metadata([sid], [n])
        s = self.model.seqs[sid]
        bs = self.model.bs
        assert meta.slot_mapping.tolist() == [s.blocks[i // bs] * bs + i % bs for i in range(n)]
        assert meta.kv_indices.tolist() == s.blocks[: -(-n // bs)]

    # -- invariant -----------------------------------------------------------------------------
    @invariant()
    def check(self):
        if not hasattr(self, "mgr"):
            return
        mgr, model = self.mgr, self.model
        assert len(mgr) == len(model.seqs)
        for sid, s in model.seqs.items():
            assert mgr.block_table(sid).tolist() == s.blocks, sid
            assert mgr.token_ids(sid).tolist() == s.tokens, sid
            assert mgr.num_tokens(sid) == len(s.tokens)
            assert mgr.is_swapped(sid) == s.swapped
        pool = mgr.pool
        assert pool.ref_counts().tolist() == model.pool.ref
        assert pool.free_list().tolist() == model.pool.free
        assert pool.num_free == len(model.pool.free)
        assert pool.num_cached == len(model.pool.cached)
        for h, b in model.pool.cached.items():
            assert pool.block_hash(b) == h
        # no block is both evictable and referenced; counts add up
        refs = pool.ref_counts()
        assert pool.num_evictable == sum(1 for b in model.pool.hash_of if refs[b] == 0)
        assert pool.num_free + int((refs[1:] > 0).sum()) == pool.num_blocks - 1
        assert pool.stats.evictions == model.pool.evictions
        if model.host is not None:
            assert mgr.host_pool.free_list().tolist() == model.host.free
            assert mgr.host_pool.ref_counts().tolist() == model.host.ref
        mgr.check()


TestManagerMachine = ManagerMachine.TestCase
