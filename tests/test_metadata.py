"""Attention metadata, scheduling helpers and preemption (issue 5, engine integration).

* ``BlockManager.metadata`` is compared array by array with a straightforward numpy
  construction from ``block_table()`` / ``num_tokens()``, by a hypothesis state machine that
  drives the manager (add with shared prefixes, append, append_batch, fork, reserve, truncate,
  free, swap) and builds metadata with and without fixed ``out`` buffers reused across steps.
* Failing metadata calls raise typed errors and leave both the ``out`` buffers and the manager
  exactly as they were.
* can_add (watermark), blocks_needed, can_append.
* Preemption: swap out / swap in moving the real bytes with ops.swap_blocks between a device
  KVCache and a host KVCache (both "cpu" here), with shared (forked) blocks, and recompute
  (free, add again: the full blocks come back from the prefix cache).
"""

import numpy as np
import pytest
from helpers import KEY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvblocks import (
    AttentionMetadata,
    BlockManager,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    KVCache,
    KVLayout,
    OutOfBlocksError,
    UnknownSequenceError,
    ops,
)

PREFIXES = [list(range(1, 40)), [1, 2, 3, 4, 9, 9, 9, 9] * 4, [7] * 30]
FIELDS = (
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
)


# ---------------------------------------------------------------------------------------------
# reference construction
# ---------------------------------------------------------------------------------------------
def reference_metadata(mgr, seq_ids, query_lens, max_blocks=None):
    """The metadata arrays built the obvious way from block_table() and num_tokens()."""
    bs = mgr.block_size
    tables = [mgr.block_table(s) for s in seq_ids]
    lens = np.array([mgr.num_tokens(s) for s in seq_ids], dtype=np.int64)
    q = np.asarray(query_lens, dtype=np.int64)
    nb = -(-lens // bs)
    slots = []
    for t, L, n in zip(tables, lens, q):
        pos = np.arange(L - n, L)
        slots.append(t[pos // bs].astype(np.int64) * bs + pos % bs)
    width = max_blocks if max_blocks is not None else max(int(nb.max(initial=0)), 1)
    bt = np.zeros((len(seq_ids), width), dtype=np.int32)
    for i, (t, n) in enumerate(zip(tables, nb)):
        bt[i, :n] = t[:n]
    return {
        "slot_mapping": np.concatenate(slots) if slots else np.zeros(0, np.int64),
        "block_tables": bt,
        "seq_lens": lens.astype(np.int32),
        "qo_indptr": np.concatenate([[0], np.cumsum(q)]).astype(np.int32),
        "kv_indptr": np.concatenate([[0], np.cumsum(nb)]).astype(np.int32),
        "kv_indices": (
            np.concatenate([t[:n] for t, n in zip(tables, nb)]).astype(np.int32)
            if len(seq_ids)
            else np.zeros(0, np.int32)
        ),
        # an empty sequence has no page at all: 0 (the only value outside 1..block_size)
        "kv_last_page_len": np.where(nb > 0, lens - (nb - 1) * bs, 0).astype(np.int32),
    }


def assert_meta_equal(meta, ref, block_size):
    assert meta.slot_mapping.dtype == np.int64
    for name in FIELDS[1:]:
        assert getattr(meta, name).dtype == np.int32, name
    for name in FIELDS:
        got = getattr(meta, name)
        assert got.shape == ref[name].shape, (name, got.shape, ref[name].shape)
        assert np.array_equal(got, ref[name]), (name, got, ref[name])
    nonempty = meta.seq_lens > 0
    assert (
        (meta.kv_last_page_len[nonempty] >= 1) & (meta.kv_last_page_len[nonempty] <= block_size)
    ).all()
    assert meta.num_tokens == len(meta.slot_mapping)
    assert meta.num_seqs == len(meta.seq_lens)


def snapshot_manager(mgr):
    """Everything observable about the manager without draining anything."""
    seqs = {}
    for s in mgr.seq_ids():
        seqs[s] = (
            mgr.block_table(s).tolist(),
            mgr.token_ids(s).tolist(),
            mgr.num_tokens(s),
            mgr.is_swapped(s),
        )
    host = mgr.host_pool.ref_counts().copy() if mgr.host_pool is not None else None
    return (
        seqs,
        mgr.pool.ref_counts().copy().tolist(),
        mgr.pool.num_free,
        mgr.pool.num_cached,
        mgr.pool.num_evictable,
        None if host is None else host.tolist(),
    )


def snapshot_buffers(buf):
    return {name: getattr(buf, name).copy() for name in FIELDS}


def assert_buffers_unchanged(buf, snap):
    for name in FIELDS:
        assert np.array_equal(getattr(buf, name), snap[name]), name


# ---------------------------------------------------------------------------------------------
# the state machine
# ---------------------------------------------------------------------------------------------


# preconditions of the machine's rules, named
def has_sequences(machine) -> bool:
    return len(machine.mgr) > 0


def has_resident(machine) -> bool:
    """Some sequence is on the device (not swapped out)."""
    return any(not machine.mgr.is_swapped(s) for s in machine.mgr.seq_ids())


def can_swap(machine) -> bool:
    return len(machine.mgr) > 0 and machine.mgr.host_pool is not None


class MetadataMachine(RuleBasedStateMachine):
    """Random manager histories; every metadata step is checked against the reference."""

    @initialize(
        num_blocks=st.integers(6, 40),
        bs=st.sampled_from([1, 2, 3, 4, 16]),
        caching=st.booleans(),
        host=st.sampled_from([0, 24]),
    )
    def setup(self, num_blocks, bs, caching, host):
        self.mgr = BlockManager(
            num_blocks, bs, enable_prefix_caching=caching, num_host_blocks=host, hash_key=KEY
        )
        self.bs = bs
        self.next_id = 0
        # fixed buffers reused by every step, as an engine with CUDA graphs would
        self.max_batch, self.max_tokens, self.max_blocks = 6, 48, 24
        self.buf = AttentionMetadata.allocate(
            self.max_batch, self.max_tokens, self.max_batch * self.max_blocks, self.max_blocks
        )

    # -- helpers ---------------------------------------------------------------------------
    def live(self):
        return sorted(self.mgr.seq_ids(), key=str)

    def resident(self):
        return [s for s in self.live() if not self.mgr.is_swapped(s)]

    def _try(self, fn):
        try:
            fn()
        except OutOfBlocksError:
            pass

    # -- manager history -------------------------------------------------------------------
    @rule(
        prefix=st.integers(0, len(PREFIXES) - 1),
        cut=st.integers(0, 30),
        tail=st.lists(st.integers(0, 50), max_size=5),
        as_str=st.booleans(),
    )
    def add(self, prefix, cut, tail, as_str):
        self.next_id += 1
        sid = f"s{self.next_id}" if as_str else self.next_id
        tokens = PREFIXES[prefix][:cut] + tail
        self._try(lambda: self.mgr.add(sid, tokens))

    @precondition(has_resident)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 50), min_size=1, max_size=7))
    def append(self, data, tokens):
        live = self.resident()
        sid = data.draw(st.sampled_from(live))
        self._try(lambda: self.mgr.append(sid, tokens))

    @precondition(has_resident)
    @rule(data=st.data())
    def append_batch(self, data):
        live = self.resident()
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, unique=True))
        toks = data.draw(st.lists(st.integers(0, 50), min_size=len(ids), max_size=len(ids)))
        self._try(lambda: self.mgr.append_batch(ids, toks))

    @precondition(has_resident)
    @rule(data=st.data())
    def fork(self, data):
        live = self.resident()
        self.next_id += 1
        self._try(lambda: self.mgr.fork(data.draw(st.sampled_from(live)), self.next_id))

    @precondition(has_resident)
    @rule(data=st.data(), n=st.integers(1, 6))
    def reserve(self, data, n):
        live = self.resident()
        sid = data.draw(st.sampled_from(live))
        self._try(lambda: self.mgr.reserve(sid, n))

    @precondition(has_resident)
    @rule(data=st.data())
    def truncate(self, data):
        live = self.resident()
        sid = data.draw(st.sampled_from(live))
        self.mgr.truncate(sid, data.draw(st.integers(0, self.mgr.num_tokens(sid))))

    @precondition(has_sequences)
    @rule(data=st.data())
    def free(self, data):
        live = self.live()
        self.mgr.free(data.draw(st.sampled_from(live)))

    @precondition(can_swap)
    @rule(data=st.data())
    def swap(self, data):
        live = self.live()
        sid = data.draw(st.sampled_from(live))
        self.mgr.take_copies()  # an engine executes them before swapping
        self._try(
            lambda: self.mgr.swap_in(sid) if self.mgr.is_swapped(sid) else self.mgr.swap_out(sid)
        )

    # -- metadata ----------------------------------------------------------------------------
    def _draw_batch(self, data, max_seqs):
        live = self.resident()
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=max_seqs, unique=True))
        self.mgr.take_copies()  # the documented order: drain copies, then metadata
        q = []
        for s in ids:  # a step computes at least every token not yet computed
            lo = self.mgr.num_tokens(s) - self.mgr.num_computed(s)
            q.append(data.draw(st.integers(lo, max(lo, min(self.mgr.num_tokens(s), 12)))))
        return ids, q

    @precondition(has_resident)
    @rule(data=st.data(), use_batch=st.booleans())
    def metadata_fresh(self, data, use_batch):
        ids, q = self._draw_batch(data, 8)
        seq_arg = self.mgr.batch(ids) if use_batch else ids
        meta = self.mgr.metadata(seq_arg, np.array(q, dtype=np.int32))
        assert_meta_equal(meta, reference_metadata(self.mgr, ids, q), self.bs)

    @precondition(has_resident)
    @rule(data=st.data())
    def metadata_into_buffers(self, data):
        ids, q = self._draw_batch(data, self.max_batch)
        nbs = [-(-self.mgr.num_tokens(s) // self.bs) for s in ids]
        if not (
            sum(q) <= self.max_tokens
            and sum(nbs) <= len(self.buf.kv_indices)
            and max(nbs) <= self.max_blocks
        ):
            return
        ref = reference_metadata(self.mgr, ids, q, self.max_blocks)
        before = snapshot_manager(self.mgr)[0]
        meta = self.mgr.metadata(ids, q, out=self.buf)
        assert_meta_equal(meta, ref, self.bs)
        # views into the fixed buffers, full row width kept for the block tables
        for name in FIELDS:
            assert (
                np.shares_memory(getattr(meta, name), getattr(self.buf, name))
                or getattr(meta, name).size == 0
            ), name
        assert meta.block_tables.shape == (len(ids), self.max_blocks)
        # the unused tail of slot_mapping is padding
        assert (self.buf.slot_mapping[sum(q) :] == -1).all()
        assert snapshot_manager(self.mgr)[0] == before  # tables untouched (blocks may be cached)

    @precondition(has_resident)
    @rule(
        data=st.data(),
        kind=st.sampled_from(
            [
                "unknown",
                "qlen_big",
                "qlen_neg",
                "tokens_cap",
                "indices_cap",
                "blocks_cap",
                "batch_cap",
                "swapped",
                "len_mismatch",
                "freed_batch",
            ]
        ),
    )
    def metadata_error(self, data, kind):
        live = self.resident()
        ids = data.draw(st.lists(st.sampled_from(live), min_size=1, max_size=3, unique=True))
        self.mgr.take_copies()
        q = [
            max(self.mgr.num_tokens(s) - self.mgr.num_computed(s), min(self.mgr.num_tokens(s), 1))
            for s in ids
        ]
        # buffers with room to spare, holding a valid step, so that only the planted error
        # fails; the capacity kinds below replace them with buffers one entry too small
        buf = AttentionMetadata.allocate(8, 512, 2048, 512)
        self.mgr.metadata(ids, q, out=buf)
        expected = InvalidArgumentError
        if kind == "unknown":
            ids = ids + ["never-added"]
            q = q + [0]
            expected = UnknownSequenceError
        elif kind == "qlen_big":
            q[-1] = self.mgr.num_tokens(ids[-1]) + data.draw(st.integers(1, 5))
        elif kind == "qlen_neg":
            q[-1] = -data.draw(st.integers(1, 5))
        elif kind == "tokens_cap":
            if not (sum(q) > 0):
                return
            buf = AttentionMetadata.allocate(self.max_batch, sum(q) - 1, 64, 64)
        elif kind == "indices_cap":
            nb = sum(-(-self.mgr.num_tokens(s) // self.bs) for s in ids)
            if not (nb > 1):
                return
            buf = AttentionMetadata.allocate(self.max_batch, 64, nb - 1, 64)
        elif kind == "blocks_cap":
            nb = max(-(-self.mgr.num_tokens(s) // self.bs) for s in ids)
            if not (nb > 1):
                return
            buf = AttentionMetadata.allocate(self.max_batch, 64, 256, nb - 1)
        elif kind == "batch_cap":
            if not (len(ids) > 1):
                return
            buf = AttentionMetadata.allocate(len(ids) - 1, 64, 256, 64)
        elif kind == "swapped":
            sw = [s for s in self.live() if self.mgr.is_swapped(s)]
            if not (sw):
                return
            ids, q = ids + [sw[0]], q + [0]
            expected = InvalidStateError
        elif kind == "len_mismatch":
            q = q + [0]
        elif kind == "freed_batch":
            try:
                self.mgr.add("victim", [1, 2, 3])
            except OutOfBlocksError:
                return
            sb = self.mgr.batch(ids + ["victim"])
            self.mgr.free("victim")
            ids, q, expected = sb, q + [0], UnknownSequenceError
        before = snapshot_manager(self.mgr)
        bufsnap = snapshot_buffers(buf)
        with pytest.raises(expected):
            self.mgr.metadata(ids, q, out=buf)
        assert_buffers_unchanged(buf, bufsnap)
        assert snapshot_manager(self.mgr) == before
        if kind not in ("tokens_cap", "indices_cap", "blocks_cap", "batch_cap"):
            with pytest.raises(expected):
                self.mgr.metadata(ids, q)
            assert snapshot_manager(self.mgr) == before

    @invariant()
    def consistent(self):
        if hasattr(self, "mgr"):
            self.mgr.check()


TestMetadataMachine = MetadataMachine.TestCase
TestMetadataMachine.settings = settings(
    stateful_step_count=30,
    suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
)


# ---------------------------------------------------------------------------------------------
# direct checks
# ---------------------------------------------------------------------------------------------
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=8),
    bs=st.sampled_from([1, 3, 4, 16]),
    data=st.data(),
)
def test_metadata_matches_reference(lens, bs, data):
    mgr = BlockManager(600, bs, hash_key=KEY)
    ids = []
    for i, n in enumerate(lens):
        mgr.add(i, [(7 * i + t) % 50 for t in range(n)])
        ids.append(i)
    q = [data.draw(st.integers(n - mgr.num_computed(i), n)) for i, n in enumerate(lens)]
    meta = mgr.metadata(ids, q)
    assert_meta_equal(meta, reference_metadata(mgr, ids, q), bs)
    # a SeqBatch gives the same arrays as the list of ids
    meta2 = mgr.metadata(mgr.batch(ids), q)
    for name in FIELDS:
        assert np.array_equal(getattr(meta, name), getattr(meta2, name))


def test_buffers_reused_across_decode_steps():
    mgr = BlockManager(64, 4, hash_key=KEY)
    buf = AttentionMetadata.allocate(
        max_batch=4, max_tokens=40, max_indices=64, max_blocks_per_seq=16
    )
    mgr.add("a", list(range(10)))
    mgr.add("b", list(range(100, 107)))
    # step 1: prefill both (17 query tokens)
    meta = mgr.metadata(["a", "b"], [10, 7], out=buf)
    assert_meta_equal(meta, reference_metadata(mgr, ["a", "b"], [10, 7], 16), 4)
    assert (buf.slot_mapping[17:] == -1).all()
    # decode steps: one token each, the stale prefill slots of the buffer become padding
    for step in range(9):
        mgr.append_batch(["a", "b"], [step, step + 1])
        meta = mgr.metadata(["a", "b"], [1, 1], out=buf)
        assert_meta_equal(meta, reference_metadata(mgr, ["a", "b"], [1, 1], 16), 4)
        assert (buf.slot_mapping[2:] == -1).all()
        assert meta.block_tables.shape == (2, 16)
    # a smaller batch in the same buffers
    meta = mgr.metadata(["b"], [1], out=buf)
    assert_meta_equal(meta, reference_metadata(mgr, ["b"], [1], 16), 4)
    assert (buf.slot_mapping[1:] == -1).all()


def test_dlpack_export_is_zero_copy():
    mgr = BlockManager(32, 4, hash_key=KEY)
    mgr.add(1, list(range(9)))
    mgr.add(2, list(range(5)))
    buf = AttentionMetadata.allocate(4, 32, 32, 8)
    meta = mgr.metadata([1, 2], [9, 5], out=buf)
    for name in FIELDS:
        arr = getattr(meta, name)
        ext = np.from_dlpack(arr)
        assert ext.dtype == arr.dtype and ext.shape == arr.shape
        assert np.array_equal(ext, arr)
        assert np.shares_memory(ext, getattr(buf, name))
    fresh = mgr.metadata([1, 2], [1, 1])
    for name in FIELDS:
        assert np.array_equal(np.from_dlpack(getattr(fresh, name)), getattr(fresh, name))
    assert set(meta.as_dict()) == set(FIELDS)


def test_metadata_bad_types():
    mgr = BlockManager(16, 4, hash_key=KEY)
    mgr.add("a", [1, 2, 3])
    with pytest.raises(InvalidTypeError):
        mgr.metadata(["a"], [1.5])
    with pytest.raises(InvalidArgumentError):
        mgr.metadata(["a"], [[1]])
    with pytest.raises(KVBlocksError):
        mgr.metadata([object()], [1])


def test_metadata_empty_batch_into_buffers():
    mgr = BlockManager(16, 4, hash_key=KEY)
    buf = AttentionMetadata.allocate(2, 8, 8, 4)
    meta = mgr.metadata([], [], out=buf)
    assert meta.num_seqs == 0 and meta.num_tokens == 0
    assert meta.qo_indptr.tolist() == [0] and meta.kv_indptr.tolist() == [0]
    assert (buf.slot_mapping == -1).all()


# ---------------------------------------------------------------------------------------------
# scheduling helpers
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("watermark", [0.0, 0.1, 0.25])
def test_can_add_honours_watermark(watermark):
    num_blocks, bs = 41, 4  # 40 usable blocks
    mgr = BlockManager(num_blocks, bs, watermark=watermark, hash_key=KEY)
    reserve = int(watermark * (num_blocks - 1))
    # whole blocks here; partial blocks: test_can_add_rounds_partial_blocks_up
    for n_tokens in range(0, 45 * bs, bs):
        need = n_tokens // bs
        assert mgr.can_add(n_tokens) == (mgr.pool.num_free - need >= reserve), n_tokens
    # fill up to the watermark exactly
    usable = 40 - reserve
    mgr.add("fill", list(range(1000, 1000 + (usable - 2) * bs)))
    assert mgr.can_add(bs) and mgr.can_add(2 * bs) and not mgr.can_add(3 * bs)
    mgr.add("two", [5] * (2 * bs))
    mgr.schedule(["two"], [2 * bs])  # computed: its full blocks are cached
    assert mgr.can_add(0) and not mgr.can_add(bs)
    assert mgr.pool.num_free == reserve
    # can_add is conservative: it does not count prefix-cache hits, add itself may still fit
    if reserve == 0:
        mgr.free("two")
        assert mgr.add("again", [5] * (2 * bs)) == bs


def test_can_add_rounds_partial_blocks_up():
    """Regression: blocks_for_tokens used -(-n // bs), which rounds down under cdivision."""
    mgr = BlockManager(3, 4)  # 2 usable blocks
    assert [mgr.blocks_for_tokens(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    assert mgr.can_add(8) and not mgr.can_add(9)
    with pytest.raises(OutOfBlocksError):
        mgr.add("a", list(range(9)))


def test_blocks_needed_and_can_append():
    bs = 4
    mgr = BlockManager(12, bs, hash_key=KEY)  # 11 usable
    mgr.add("a", list(range(6)))  # 2 blocks, 2 slots left in the last one
    assert mgr.blocks_needed("a", 0) == 0
    assert mgr.blocks_needed("a", 1) == 0
    assert mgr.blocks_needed("a", 2) == 0
    assert mgr.blocks_needed("a", 3) == 1
    assert mgr.blocks_needed("a", 11) == 3
    mgr.fork("a", "b")  # the last block is shared now: writing it needs a copy
    assert mgr.blocks_needed("b", 1) == 1
    assert mgr.blocks_needed("b", 3) == 2
    free0 = mgr.pool.num_free
    mgr.append("b", [1])
    assert mgr.pool.num_free == free0 - 1
    assert mgr.take_copies().tolist() == [[mgr.block_table("a")[1], mgr.block_table("b")[1]]]
    assert mgr.blocks_needed("a", 1) == 0  # a's last block is private again
    mgr.reserve("a", 5)  # lookahead slots count as already there
    assert mgr.blocks_needed("a", 5) == 0 and mgr.blocks_needed("a", 7) == 1
    with pytest.raises(UnknownSequenceError):
        mgr.blocks_needed("zz", 1)
    with pytest.raises(InvalidArgumentError):
        mgr.blocks_needed("a", -1)
    # can_append sums what every sequence needs for n more tokens
    free = mgr.pool.num_free
    assert mgr.can_append(["a", "b"], 1)
    need = mgr.blocks_needed("a", 30) + mgr.blocks_needed("b", 30)
    assert mgr.can_append(["a", "b"], 30) == (need <= free)
    need = lambda n: mgr.blocks_needed("a", n) + mgr.blocks_needed("b", n)  # noqa: E731
    n = 1
    while need(n) <= free:
        n += 1
    assert mgr.can_append(["a", "b"], n - 1) and not mgr.can_append(["a", "b"], n)
    with pytest.raises(UnknownSequenceError):
        mgr.can_append(["a", "nope"])
    mgr.check()


@given(
    prompt=st.integers(1, 30),
    forked=st.booleans(),
    n=st.integers(0, 20),
    bs=st.sampled_from([1, 2, 4, 8]),
)
def test_blocks_needed_predicts_append(prompt, forked, n, bs):
    mgr = BlockManager(64, bs, hash_key=KEY)
    mgr.add("p", list(range(prompt)))
    if forked:
        mgr.fork("p", "c")
    sid = "c" if forked else "p"
    need = mgr.blocks_needed(sid, n)
    free = mgr.pool.num_free
    assert mgr.can_append([sid], n) == (need <= free)
    mgr.append(sid, [3] * n)
    assert free - mgr.pool.num_free == need
    mgr.check()


def test_can_append_is_all_or_nothing_with_append_batch():
    mgr = BlockManager(5, 2, hash_key=KEY)  # 4 usable blocks
    mgr.add("a", [1, 2])
    mgr.add("b", [3, 4])
    mgr.add("c", [5, 6])
    assert mgr.can_append(["a"]) and not mgr.can_append(["a", "b"])
    before = snapshot_manager(mgr)
    with pytest.raises(OutOfBlocksError):
        mgr.append_batch(["a", "b"], [7, 8])
    assert snapshot_manager(mgr) == before
    mgr.append_batch(["a"], [7])
    mgr.check()


# ---------------------------------------------------------------------------------------------
# preemption with real bytes
# ---------------------------------------------------------------------------------------------
BS = 4
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=BS, dtype="fp32")


def kv_for(tokens, positions, layer):
    """Deterministic K/V of tokens at positions (a function of token, position, layer)."""
    t = np.asarray(tokens, dtype=np.float32)[:, None, None]
    p = np.asarray(positions, dtype=np.float32)[:, None, None]
    base = np.arange(LAYOUT.num_kv_heads * LAYOUT.head_dim, dtype=np.float32).reshape(
        1, LAYOUT.num_kv_heads, LAYOUT.head_dim
    )
    k = t * 1000 + p + base / 100 + layer * 0.5
    return k, -k


def compute(mgr, cache, seq_ids, query_lens):
    """One forward step: write the queries' K/V into their slots (all layers)."""
    meta = mgr.metadata(seq_ids, query_lens)
    toks, pos = [], []
    for s, q in zip(seq_ids, query_lens):
        L = mgr.num_tokens(s)
        toks.append(mgr.token_ids(s)[L - q :])
        pos.append(np.arange(L - q, L))
    toks, pos = np.concatenate(toks), np.concatenate(pos)
    for layer in range(LAYOUT.num_layers):
        k, v = kv_for(toks, pos, layer)
        ops.write_slots(cache, layer, k, v, meta.slot_mapping)


def gathered(mgr, cache, sid):
    n = mgr.num_tokens(sid)
    return [ops.gather(cache, layer, mgr.block_table(sid), n) for layer in range(LAYOUT.num_layers)]


def expected_kv(mgr, sid):
    toks = mgr.token_ids(sid)
    return [kv_for(toks, np.arange(len(toks)), layer) for layer in range(LAYOUT.num_layers)]


def assert_kv_equal(a, b):
    for (k1, v1), (k2, v2) in zip(a, b):
        assert np.array_equal(k1, k2) and np.array_equal(v1, v2)


def scribble(mgr, cache, n_blocks):
    """Allocate and overwrite free device blocks so that stale bytes cannot pass a test."""
    ids = mgr.pool.allocate(n_blocks)
    for layer in range(LAYOUT.num_layers):
        cache.layer(layer)[ids] = 12345.0
    mgr.pool.free(ids)


@pytest.fixture
def engine():
    mgr = BlockManager(24, BS, num_host_blocks=16, hash_key=KEY)
    dev = KVCache(LAYOUT, 24, device="cpu", pin_memory=False)
    host = KVCache(LAYOUT, 16, device="cpu", pin_memory=False)
    return mgr, dev, host


def test_swap_round_trip_moves_the_bytes(engine):
    mgr, dev, host = engine
    mgr.add("a", list(range(10)))
    mgr.add("b", list(range(50, 57)))
    compute(mgr, dev, ["a", "b"], [10, 7])
    mgr.append_batch(["a", "b"], [11, 12])
    compute(mgr, dev, ["a", "b"], [1, 1])
    kv_a = gathered(mgr, dev, "a")
    assert_kv_equal(kv_a, expected_kv(mgr, "a"))
    table_before = mgr.block_table("a")
    free_before = mgr.pool.num_free

    pairs = mgr.swap_out("a")
    assert pairs.dtype == np.int64 and pairs.shape == (len(table_before), 2)
    assert pairs[:, 0].tolist() == table_before.tolist()
    ops.swap_blocks(dev, host, pairs)
    assert mgr.is_swapped("a") and mgr.pool.num_free == free_before + len(table_before)
    assert mgr.block_table("a").tolist() == pairs[:, 1].tolist()  # host block ids now
    with pytest.raises(InvalidStateError):
        mgr.metadata(["a"], [1])
    with pytest.raises(InvalidStateError):
        mgr.append_batch(["a", "b"], [1, 2])
    assert mgr.blocks_needed("a", 1) == -(-(mgr.num_tokens("a") + 1) // BS)
    # the device blocks are reused by someone else meanwhile
    scribble(mgr, dev, mgr.pool.num_free)
    mgr.check()

    back = mgr.swap_in("a")
    assert back[:, 0].tolist() == pairs[:, 1].tolist()
    ops.swap_blocks(host, dev, back)
    assert not mgr.is_swapped("a")
    assert_kv_equal(gathered(mgr, dev, "a"), kv_a)
    # decoding continues where it stopped
    mgr.append_batch(["a", "b"], [13, 14])
    compute(mgr, dev, ["a", "b"], [1, 1])
    for s in ("a", "b"):
        assert_kv_equal(gathered(mgr, dev, s), expected_kv(mgr, s))
    assert mgr.host_pool.num_free == mgr.host_pool.num_blocks - 1
    mgr.check()


def test_swap_out_keeps_shared_blocks_for_the_others(engine):
    mgr, dev, host = engine
    mgr.add("p", list(range(9)))  # 3 blocks, last one partial
    compute(mgr, dev, ["p"], [9])
    mgr.fork("p", "c1")
    mgr.fork("p", "c2")
    table = mgr.block_table("p")
    assert mgr.pool.ref_count(int(table[0])) == 3
    mgr.append_batch(["p", "c1", "c2"], [100, 101, 102])
    copies = mgr.take_copies()
    ops.copy_blocks(dev, copies)
    compute(mgr, dev, ["p", "c1", "c2"], [1, 1, 1])

    kv_c1 = gathered(mgr, dev, "c1")
    pairs = mgr.swap_out("c1")
    ops.swap_blocks(dev, host, pairs)
    # shared full blocks stay on the device for p and c2 (one reference less)
    for b in table[:2]:
        assert mgr.pool.ref_count(int(b)) == 2
    assert set(table[:2].tolist()) <= set(mgr.block_table("p").tolist())
    scribble(mgr, dev, mgr.pool.num_free)
    mgr.append_batch(["p", "c2"], [7, 8])
    ops.copy_blocks(dev, mgr.take_copies())
    compute(mgr, dev, ["p", "c2"], [1, 1])
    for s in ("p", "c2"):
        assert_kv_equal(gathered(mgr, dev, s), expected_kv(mgr, s))

    back = mgr.swap_in("c1")
    ops.swap_blocks(host, dev, back)
    assert_kv_equal(gathered(mgr, dev, "c1"), kv_c1)
    mgr.append_batch(["c1"], [55])
    compute(mgr, dev, ["c1"], [1])
    assert_kv_equal(gathered(mgr, dev, "c1"), expected_kv(mgr, "c1"))
    for s in ("p", "c1", "c2"):
        mgr.free(s)
    assert mgr.pool.num_used == 0 and mgr.host_pool.num_used == 0
    mgr.check()


def test_swap_failures_change_nothing(engine):
    mgr, dev, host = engine
    mgr.add("big", list(range(4 * 16)))  # 16 blocks; the host pool holds 15
    mgr.add("small", [1, 2, 3])
    before = snapshot_manager(mgr)
    with pytest.raises(OutOfBlocksError):
        mgr.swap_out("big")
    assert snapshot_manager(mgr) == before
    with pytest.raises(InvalidStateError):
        mgr.swap_in("small")
    pairs = mgr.swap_out("small")
    with pytest.raises(InvalidStateError):
        mgr.swap_out("small")
    # the device pool cannot take it back while full
    filler = mgr.pool.allocate(mgr.pool.num_free)
    before = snapshot_manager(mgr)
    with pytest.raises(OutOfBlocksError):
        mgr.swap_in("small")
    assert snapshot_manager(mgr) == before
    mgr.pool.free(filler)
    assert len(mgr.swap_in("small")) == len(pairs)
    no_host = BlockManager(8, 4)
    no_host.add(1, [1])
    with pytest.raises(InvalidStateError):
        no_host.swap_out(1)
    mgr.check()


def test_recompute_preemption_hits_the_full_blocks(engine):
    mgr, dev, host = engine
    prompt = list(range(200, 214))  # 3 full blocks + 2 tokens
    mgr.add("r", prompt)
    compute(mgr, dev, ["r"], [14])
    for t in range(3):
        mgr.append_batch(["r"], [300 + t])
        compute(mgr, dev, ["r"], [1])
    tokens = mgr.token_ids("r")  # 17 tokens: 4 full blocks + 1
    table = mgr.block_table("r")
    kv = gathered(mgr, dev, "r")
    mgr.free("r")  # recompute preemption: drop everything, keep the tokens
    assert mgr.pool.num_evictable == 4
    n_cached = mgr.add("r", tokens)
    assert n_cached == 16
    assert mgr.block_table("r")[:4].tolist() == table[:4].tolist()
    # only the last token is computed again; the cached blocks still hold their K/V
    compute(mgr, dev, ["r"], [len(tokens) - n_cached])
    assert_kv_equal(gathered(mgr, dev, "r"), kv)
    # a prompt ending on a block boundary still computes one token (its logits)
    mgr.free("r")
    assert mgr.add("r", tokens[:16]) == 12
    mgr.check()


def test_recompute_of_a_forked_sequence_keeps_siblings(engine):
    mgr, dev, host = engine
    mgr.add("p", list(range(8)))  # 2 full blocks
    compute(mgr, dev, ["p"], [8])
    mgr.fork("p", "c")
    mgr.append_batch(["p", "c"], [1, 2])
    ops.copy_blocks(dev, mgr.take_copies())
    compute(mgr, dev, ["p", "c"], [1, 1])
    tokens_c = mgr.token_ids("c")
    mgr.free("c")
    assert_kv_equal(gathered(mgr, dev, "p"), expected_kv(mgr, "p"))
    assert mgr.add("c", tokens_c) == 8  # the shared prompt blocks, still in use by p
    assert mgr.block_table("c")[:2].tolist() == mgr.block_table("p")[:2].tolist()
    compute(mgr, dev, ["c"], [1])
    assert_kv_equal(gathered(mgr, dev, "c"), expected_kv(mgr, "c"))
    mgr.check()


def test_metadata_empty_batch_fresh():
    """Regression: metadata([], []) without out= asked for a zero-row buffer."""
    meta = BlockManager(16, 4).metadata([], [])
    assert meta.num_seqs == 0 and meta.qo_indptr.tolist() == [0]


def test_pool_usage_fraction():
    """Regression: BlockPool.usage divided C ints under cdivision and returned 0."""
    mgr = BlockManager(11, 4)
    mgr.add("a", list(range(20)))
    assert mgr.pool.usage == pytest.approx(0.5)
