"""Regression tests for the round-2 reliability audit (issue 10) and commit-vs-compute
(issue 17), one per finding, named for it. Each states the class of bug it belongs to; the
property tests (test_hostile.py, test_kv_readback.py, the fuzzer) look for the rest."""

import threading

import numpy as np
import pytest
from helpers import KEY

import kvblocks
from kvblocks import (
    AttentionMetadata,
    BlockManager,
    BlockPool,
    BlockStored,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    KVCache,
    KVLayout,
    OutOfBlocksError,
    UnknownSequenceError,
    hash_blocks,
    ops,
)

BS = 4


# ---------------------------------------------------------------------------------------------
# a tiny engine: K/V of a token is a function of (position, token), written through the ops
# ---------------------------------------------------------------------------------------------
class Engine:
    def __init__(self, num_blocks=32, host=16):
        self.mgr = BlockManager(num_blocks, BS, num_host_blocks=host, hash_key=KEY)
        layout = KVLayout(1, 1, 2, BS, "float32")
        self.dev = KVCache(layout, num_blocks)
        self.host = KVCache(layout, host) if host else None

    @staticmethod
    def kv(tokens, start):
        pos = np.arange(start, start + len(tokens), dtype=np.float32)
        k = np.stack([pos, np.asarray(tokens, np.float32)], 1)[:, None, :]
        return k, -k

    def drain(self):
        ops.copy_blocks(self.dev, self.mgr.take_copies())

    def step(self, ids):
        """Drain copies, build metadata computing every uncomputed token, write their K/V."""
        self.drain()
        q = [self.mgr.num_tokens(s) - self.mgr.num_computed(s) for s in ids]
        meta = self.mgr.metadata(ids, q)
        off = 0
        for s, n in zip(ids, q):
            toks = self.mgr.token_ids(s)
            k, v = self.kv(toks[len(toks) - n :], len(toks) - n)
            ops.write_slots(self.dev, 0, k, v, meta.slot_mapping[off : off + n])
            off += n

    def assert_reads_back(self, seq):
        toks = self.mgr.token_ids(seq)
        k, v = ops.gather(self.dev, 0, self.mgr.block_table(seq), len(toks))
        ek, ev = self.kv(toks, 0)
        np.testing.assert_array_equal(np.asarray(k), ek, err_msg=f"K of {seq!r}")
        np.testing.assert_array_equal(np.asarray(v), ev, err_msg=f"V of {seq!r}")


# ---------------------------------------------------------------------------------------------
# 1-2. copy-on-write pairs: data loss in swap, pair lists refused by copy_blocks
#      (class: a pending pair's blocks changing hands before the pair runs)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("drain_first", [False, True])
def test_swap_out_with_pending_copy_keeps_kv(drain_first):
    e = Engine()
    e.mgr.add("p", [1, 2, 3, 4, 5, 6])  # last block partial
    e.step(["p"])
    e.mgr.fork("p", "c")
    e.mgr.append_batch(["c"], [9])  # copy-on-write pair queued
    if drain_first:
        e.drain()
    pairs = e.mgr.swap_out("c")
    ops.swap_blocks(e.dev, e.host, pairs)
    e.drain()  # after the swap: the pair was redirected
    ops.swap_blocks(e.host, e.dev, e.mgr.swap_in("c"))
    e.step(["c"])
    e.assert_reads_back("c")
    e.assert_reads_back("p")
    e.mgr.check()


def test_take_copies_chain_is_one_copy_blocks_call():
    e = Engine()
    e.mgr.add("a", [1, 2, 3, 4, 5, 6])
    e.step(["a"])
    e.mgr.fork("a", "b")
    e.mgr.append_batch(["b"], [7])  # copy a's block -> b's
    e.mgr.fork("b", "c")
    e.mgr.append_batch(["c"], [8])  # b's block is itself a pending destination
    pairs = e.mgr.take_copies()
    assert not set(pairs[:, 0]) & set(pairs[:, 1]), pairs
    ops.copy_blocks(e.dev, pairs)  # one call, any order
    e.step(["b", "c"])
    for s in "abc":
        e.assert_reads_back(s)
    e.mgr.check()


def test_pending_copy_source_is_not_handed_out_again():
    e = Engine(num_blocks=8)
    e.mgr.add("a", [1, 2, 3, 4, 5, 6])
    e.step(["a"])
    e.mgr.fork("a", "b")
    e.mgr.append_batch(["b"], [7])  # pending (a's block 2 -> fresh)
    src = int(e.mgr.block_table("a")[1])
    e.mgr.free("a")  # the source's last table reference goes
    assert e.mgr.pool.ref_count(src) == 1  # held by the pending pair
    e.mgr.add("x", [50, 51, 52])
    e.mgr.fork("x", "y")
    e.mgr.append_batch(["y"], [53])  # a new pair: src must not be its destination
    pairs = e.mgr.take_copies()
    assert src not in pairs[:, 1].tolist()
    ops.copy_blocks(e.dev, pairs)
    e.step(["b", "x", "y"])
    for s in "bxy":
        e.assert_reads_back(s)
    e.mgr.check()


# ---------------------------------------------------------------------------------------------
# 3-7. hostile Python objects (class: Python code running between validation and mutation)
# ---------------------------------------------------------------------------------------------
def test_batch_of_generator_keeps_its_ids():
    mgr = BlockManager(16, BS)
    for i in range(3):
        mgr.add(i, [1, 2])
    sb = mgr.batch(i for i in range(3))
    assert sb.seq_ids == (0, 1, 2) and len(sb) == 3
    mgr.free(1)
    with pytest.raises(UnknownSequenceError, match="1"):
        mgr.append_batch(sb, [5, 5, 5])
    with pytest.raises(UnknownSequenceError):
        mgr.metadata(sb, [1, 1, 1])
    mgr.check()


class EvilStr(str):
    calls = 0

    def __hash__(self):
        EvilStr.calls += 1
        raise KeyboardInterrupt

    def __eq__(self, other):
        EvilStr.calls += 1
        raise KeyboardInterrupt


def test_str_subclass_id_callbacks_never_run():
    mgr = BlockManager(16, BS)
    mgr.add("a", [1, 2, 3])
    ids = [EvilStr("a")]
    mgr.append_batch(ids, [4])  # normalized to the exact str "a"
    mgr.free(EvilStr("a"))
    assert EvilStr.calls == 0 and "a" not in mgr
    with pytest.raises(UnknownSequenceError):
        mgr.free(EvilStr("a"))
    mgr.check()


@pytest.mark.parametrize("alias", [1.0, True, None, b"1", 1 + 0j])
def test_alias_ids_are_refused(alias):
    mgr = BlockManager(16, BS)
    mgr.add(1, [1, 2, 3])
    with pytest.raises(InvalidTypeError):
        mgr.free(alias)
    with pytest.raises(InvalidTypeError):
        mgr.append_batch([alias], [4])
    assert mgr.num_tokens(1) == 3
    mgr.check()


def test_numpy_int_id_is_the_int_and_clears_the_fast_map():
    mgr = BlockManager(16, BS)
    mgr.add(1, [1, 2, 3])
    mgr.free(np.int64(1))  # frees sequence 1 (and its fast-map entry)
    assert 1 not in mgr
    mgr.add("other", [7, 7])  # reuses the slot
    with pytest.raises(UnknownSequenceError):
        mgr.append_batch([1], [4])
    assert mgr.token_ids("other").tolist() == [7, 7]
    mgr.add(np.uint16(3), [5])
    assert 3 in mgr and mgr.seq_ids().count(3) == 1 and type(mgr.seq_ids()[-1]) is int
    mgr.check()


class Reenter:
    """A token argument whose __array__ runs code against the manager."""

    def __init__(self, fn):
        self.fn = fn

    def __array__(self, dtype=None, copy=None):
        self.fn()
        return np.array([9], dtype=np.int32)


def test_array_callback_that_frees_the_sequence():
    mgr = BlockManager(16, BS)
    mgr.add("a", [1, 2, 3])
    with pytest.raises(UnknownSequenceError):
        mgr.append("a", Reenter(lambda: mgr.free("a")))
    mgr.add("b", [1])  # would have reused a's slot
    assert mgr.token_ids("b").tolist() == [1]
    mgr.check()


def test_array_callback_that_adds_the_same_id():
    mgr = BlockManager(16, BS)
    with pytest.raises(DuplicateSequenceError):
        mgr.add("a", Reenter(lambda: mgr.add("a", [5])))
    assert mgr.token_ids("a").tolist() == [5] and mgr.pool.num_free == 14
    mgr.check()


def test_array_callback_batch_ids_resolved_after_conversion():
    mgr = BlockManager(16, BS)
    mgr.add("a", [1])
    mgr.add("b", [2])

    def swap():
        mgr.free("a")
        mgr.add("c", [3])  # takes a's slot

    with pytest.raises(UnknownSequenceError):
        mgr.append_batch(["a", "b"], _LateTokens(swap))
    assert mgr.token_ids("c").tolist() == [3] and mgr.token_ids("b").tolist() == [2]
    mgr.check()


class _LateTokens:
    def __init__(self, fn):
        self.fn = fn

    def __array__(self, dtype=None, copy=None):
        self.fn()
        return np.array([8, 8], dtype=np.int32)


def test_reentrant_call_from_inside_a_call_is_refused():
    mgr = BlockManager(16, BS)
    mgr.add("a", [1, 2, 3])

    class EvilBuffers(AttentionMetadata):
        __slots__ = ("_sm",)

        @property
        def slot_mapping(self):  # read inside the call: re-enters the manager
            mgr.free("a")
            return self._sm

        @slot_mapping.setter
        def slot_mapping(self, value):
            self._sm = value

    buf = AttentionMetadata.allocate(4, 64, 16, 4)
    evil = EvilBuffers(
        *(
            getattr(buf, f)
            for f in (
                "slot_mapping",
                "block_tables",
                "seq_lens",
                "qo_indptr",
                "kv_indptr",
                "kv_indices",
                "kv_last_page_len",
            )
        )
    )
    with pytest.raises(InvalidStateError, match="re-entrantly"):
        mgr.metadata(["a"], [3], out=evil)
    assert mgr.num_tokens("a") == 3 and mgr.num_computed("a") == 0
    mgr.free("a")  # the guard was released
    mgr.check()


def test_threads_on_disjoint_sequences_keep_their_tokens():
    mgr = BlockManager(4096, BS)
    nthreads, nseq, steps = 4, 16, 150

    def work(t):
        ids = [f"t{t}-{i}" for i in range(nseq)]
        for s in ids:
            mgr.add(s, [t])
        mgr.schedule(ids, [1] * nseq)
        for k in range(steps):
            mgr.append_batch(list(ids), [t * 1000 + k] * nseq)  # list tokens: converted
            mgr.schedule(list(ids), [1] * nseq)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(nthreads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t in range(nthreads):
        for i in range(nseq):
            assert mgr.token_ids(f"t{t}-{i}").tolist() == [t] + [t * 1000 + k for k in range(steps)]
    mgr.check()


# ---------------------------------------------------------------------------------------------
# 8-10. block counting (class: a count that disagrees with what the mutation does)
# ---------------------------------------------------------------------------------------------
def test_shared_partial_block_batch_needs_one_copy_not_two():
    mgr = BlockManager(5, BS)  # 4 usable blocks
    mgr.add("p", [1, 2, 3, 4, 5])  # 2 blocks, the last one partial
    mgr.fork("p", "c")
    mgr.add("x", [9])  # 1 block: 1 free left
    assert mgr.can_append(["p", "c"])  # p copies, c writes in place: 1 block
    mgr.append_batch(["p", "c"], [6, 7])
    assert mgr.pool.num_free == 0
    assert len(mgr.take_copies()) == 1
    mgr.check()


def test_blocks_needed_of_swapped_sequence_counts_reserved_blocks():
    mgr = BlockManager(32, BS, num_host_blocks=16)
    mgr.add("a", [1, 2, 3])
    mgr.reserve("a", 6)  # 3 blocks held
    mgr.swap_out("a")
    assert mgr.blocks_needed("a", 0) == 3
    assert mgr.blocks_needed("a", 1) == 3 and mgr.blocks_needed("a", 7) == 3
    assert mgr.blocks_needed("a", 10) == 4
    assert not mgr.can_append(["a"])
    with pytest.raises(InvalidStateError, match="swapped out"):
        mgr.append_batch(["a"], [1])
    free = mgr.pool.num_free
    mgr.swap_in("a")
    assert free - mgr.pool.num_free == 3


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.reserve("a", 2**63 - 1),
        lambda m: m.reserve("a", 2**62),
        lambda m: m.append("a", np.zeros(0, np.int32)) or m.reserve("a", 10**12),
    ],
)
def test_huge_counts_are_refused_not_wrapped(call):
    mgr = BlockManager(16, BS)
    mgr.add("a", [1, 2, 3])
    before = (mgr.block_table("a").tolist(), mgr.pool.num_free)
    with pytest.raises(OutOfBlocksError):
        call(mgr)
    assert (mgr.block_table("a").tolist(), mgr.pool.num_free) == before
    mgr.check()


def test_scheduling_helpers_never_wrap():
    mgr = BlockManager(16, BS)
    mgr.add("a", [1, 2, 3])
    assert not mgr.can_add(2**63 - 1)
    assert mgr.blocks_needed("a", 2**63 - 1) > 0
    assert not mgr.can_append(["a"], 2**62)
    for bad in (-5, 2**63, 2**64):
        with pytest.raises(InvalidArgumentError):
            mgr.can_append(["a"], bad)
        with pytest.raises(InvalidArgumentError):
            mgr.can_add(bad)
        with pytest.raises(InvalidArgumentError):
            mgr.blocks_needed("a", bad)


# ---------------------------------------------------------------------------------------------
# 11. scalar arguments (class: implicit C coercion)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda: hash_blocks([1, 2, 3], 1.5), InvalidTypeError),
        (lambda: hash_blocks([1, 2, 3], True), InvalidTypeError),
        (lambda: hash_blocks([1, 2, 3], 2**40), InvalidArgumentError),
        (lambda: BlockPool(2.5), InvalidTypeError),
        (lambda: BlockPool(2**40), InvalidArgumentError),
        (lambda: BlockPool(8).allocate(1.0), InvalidTypeError),
        (lambda: BlockPool(8).allocate(-1), InvalidArgumentError),
        (lambda: BlockPool(8).ref_count(2**70), InvalidArgumentError),
        (lambda: BlockManager(8, 4.0), InvalidTypeError),
        (lambda: BlockManager(8, 4, watermark=float("nan")), InvalidArgumentError),
        (lambda: BlockManager(8, 4, num_host_blocks=2**40), InvalidArgumentError),
        (lambda: hash_blocks([1, 2], 1, salt="\ud800"), InvalidArgumentError),
        (lambda: hash_blocks([1, 2], 1, salt=7), InvalidTypeError),
        (lambda: BlockManager(8, 4).metadata([], [], out=object()), InvalidTypeError),
    ],
)
def test_scalar_arguments_are_checked(call, exc):
    with pytest.raises(exc):
        call()
    assert issubclass(exc, KVBlocksError)


# ---------------------------------------------------------------------------------------------
# 14. smaller findings
# ---------------------------------------------------------------------------------------------
def test_pool_cache_event_has_no_parent_and_needs_the_tokens():
    pool = BlockPool(8, enable_kv_events=True, block_size=16, hash_key=KEY)
    ids = pool.allocate(1)
    h = hash_blocks(np.arange(16), 16, key=KEY)
    with pytest.raises(InvalidArgumentError, match="token_ids"):
        pool.cache(ids, h)  # a BlockStored without tokens: routers drop it
    assert pool.num_cached == 0 and pool.take_events() == []
    pool.cache(ids, h, token_ids=np.arange(16))
    (ev,) = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert ev.parent_block_hash is None and ev.block_size == 16


def test_salts_of_different_types_never_share():
    toks = np.arange(8)
    hs = [hash_blocks(toks, 4, salt=s, key=KEY)[0].tolist() for s in ("7", b"7", "", None)]
    assert len({tuple(h) for h in hs}) == 4


def test_long_salts_follow_the_one_formula():
    # the root is SipHash128("kvb" 0x01 || tag || salt) at every length: a 61-byte salt and
    # its 60-byte prefix differ, and the root of a long salt chains like a short one
    a = hash_blocks(np.arange(4), 4, salt="x" * 60, key=KEY)
    b = hash_blocks(np.arange(4), 4, salt="x" * 61, key=KEY)
    assert not np.array_equal(a, b)
    root = kvblocks._core.siphash128(KEY, b"kvb\x01s" + b"x" * 61)
    parent = int.from_bytes(root[:8], "little") | int.from_bytes(root[8:], "little") << 64
    assert np.array_equal(hash_blocks(np.arange(4), 4, parent=parent, key=KEY), b)


def test_returned_metadata_can_be_passed_back_as_out():
    mgr = BlockManager(64, BS)
    mgr.add("a", list(range(10)))
    buf = AttentionMetadata.allocate(4, 64, 32, 8)
    meta = mgr.metadata(["a"], [10], out=buf)
    mgr.append_batch(["a"], [1])
    mgr.add("b", list(range(20)))
    meta2 = mgr.metadata(["a", "b"], [1, 20], out=meta)  # the full buffers, not the views
    assert meta2.num_tokens == 21 and np.shares_memory(meta2.slot_mapping, buf.slot_mapping)


def test_event_log_is_bounded():
    pool = BlockPool(64, enable_kv_events=True, hash_key=KEY)
    pool.max_pending_events = 3
    ids = pool.allocate(5)
    pool.cache(ids, hash_blocks(np.arange(20), 4, key=KEY), token_ids=np.arange(20))
    assert pool.events_dropped == 2
    assert sum(len(e.block_hashes) for e in pool.take_events()) == 3


def test_int_id_fast_map_is_bounded():
    mgr = BlockManager(16, BS)
    mgr.add(10**6, [1])  # far beyond the fast map: a dict entry only
    mgr.add(2**80, [1])
    mgr.append_batch([10**6, 2**80], [2, 2])
    assert mgr.token_ids(2**80).tolist() == [1, 2]
    mgr.check()


# ---------------------------------------------------------------------------------------------
# issue 17: commit is not compute
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("preempt", ["free", "swap_out", "truncate"])
def test_uncomputed_block_is_never_a_prefix_hit(preempt):
    e = Engine()
    e.mgr.add("s", [1, 2, 3, 4, 5, 6, 7])
    e.step(["s"])
    e.mgr.append_batch(["s"], [8])  # block 1 full, committed, not computed
    if preempt == "swap_out":
        ops.swap_blocks(e.dev, e.host, e.mgr.swap_out("s"))
    elif preempt == "truncate":
        e.mgr.truncate("s", 7)
    if preempt != "swap_out":
        e.mgr.free("s")
    cached = e.mgr.add("t", list(range(1, 11)))
    assert cached == 4  # block 0 only: block 1 was never computed
    e.step(["t"])
    e.assert_reads_back("t")
    e.mgr.check()


def test_step_misuse_names_the_missing_step():
    mgr = BlockManager(32, BS)
    mgr.add("a", [1, 2, 3, 4, 5, 6])
    with pytest.raises(InvalidStateError, match="never computed"):
        mgr.metadata(["a"], [1])
    mgr.metadata(["a"], [6])
    mgr.fork("a", "b")
    mgr.append_batch(["b"], [7])
    with pytest.raises(InvalidStateError, match="take_copies"):
        mgr.metadata(["b"], [1])
    mgr.take_copies()
    with pytest.raises(InvalidArgumentError, match="twice"):
        mgr.metadata(["b", "b"], [1, 1])
    mgr.metadata(["b"], [1])
    assert mgr.num_computed("b") == 7 and mgr.num_computed("a") == 6


def test_speculative_drafts_are_addressed_but_never_cached():
    e = Engine()
    e.mgr.add("s", [1, 2, 3])
    e.step(["s"])
    e.mgr.append_batch(["s"], [4])
    e.mgr.reserve("s", 4)
    with pytest.raises(InvalidStateError):
        e.mgr.metadata(["s"], [1], draft_lens=[9])  # beyond the reserved slots
    meta = e.mgr.metadata(["s"], [1], draft_lens=[4])
    assert meta.num_tokens == 5 and meta.seq_lens.tolist() == [8]
    drafts = [5, 6, 7, 8]
    k, v = e.kv([4] + drafts, 3)
    ops.write_slots(e.dev, 0, k, v, meta.slot_mapping)
    assert e.mgr.pool.num_cached == 1  # block 0; block 1 holds only drafts
    with pytest.raises(InvalidStateError):
        e.mgr.append("s", [5, 6, 7, 8, 9], computed=True)  # more than was drafted
    e.mgr.append("s", [5, 6, 7, 8], computed=True)  # all accepted: block 1 is full
    assert e.mgr.num_computed("s") == 8 and e.mgr.pool.num_cached == 2
    e.assert_reads_back("s")
    e.mgr.append_batch(["s"], [60])  # the bonus token, computed next step
    with pytest.raises(InvalidStateError):
        e.mgr.append("s", [61], computed=True)  # no draft slots scheduled now
    e.step(["s"])
    e.assert_reads_back("s")
    e.mgr.check()


def test_swap_in_reshares_blocks_still_cached_on_the_device():
    e = Engine()
    e.mgr.add("a", list(range(1, 11)))
    e.step(["a"])
    e.mgr.fork("a", "b")  # b keeps the device blocks alive
    pairs = e.mgr.swap_out("a")
    ops.swap_blocks(e.dev, e.host, pairs)
    back = e.mgr.swap_in("a")
    assert len(back) == 1  # the 2 full blocks are shared again
    ops.swap_blocks(e.host, e.dev, back)
    e.assert_reads_back("a")
    e.mgr.check()


def test_probe_and_can_add_prompt_count_hits_without_pinning():
    mgr = BlockManager(6, BS, hash_key=KEY)  # 5 usable
    mgr.add("a", list(range(12)))
    mgr.schedule(["a"], [12])
    mgr.free("a")
    assert mgr.probe(list(range(13))) == (12, 4)  # 3 evictable hits pinned + 1 new
    assert mgr.probe(list(range(12))) == (8, 3)
    assert mgr.pool.num_free == 5 and mgr.pool.stats.queries == 1
    mgr.add("x", [99])
    assert not mgr.can_add(17) and mgr.can_add_prompt(list(range(13)))
    assert mgr.add("b", list(range(13))) == 12


def test_watermark_rounds_up():
    mgr = BlockManager(11, BS, watermark=0.01)
    assert mgr.watermark_blocks == 1
    assert not mgr.can_add(40) and mgr.can_add(36)


def test_recompute_readds_are_not_counted_as_reuse():
    mgr = BlockManager(32, BS, hash_key=KEY)
    mgr.add("a", list(range(12)))
    mgr.schedule(["a"], [12])
    mgr.free("a")  # preempted by recompute
    assert mgr.add("a", list(range(13)), recompute=True) == 12
    st = mgr.pool.stats
    assert (st.query_tokens, st.hit_tokens) == (12, 0)
    assert (st.recompute_query_tokens, st.recompute_hit_tokens) == (13, 12)
    assert mgr.add("b", list(range(13))) == 12  # real reuse
    assert mgr.pool.stats.hit_tokens == 12 and mgr.pool.stats.hit_rate == 12 / 25


def test_drafts_never_overwrite_another_sequences_kv():
    """Found by the reference-model machine: after a truncate into a block shared with
    another sequence, draft slots lay in that shared block."""
    e = Engine()
    e.mgr.add("a", list(range(1, 9)))  # 2 full blocks
    e.step(["a"])
    e.mgr.fork("a", "b")  # b shares both
    e.mgr.truncate("a", 6)  # a's write block is b's full block 1
    with pytest.raises(InvalidStateError, match="reserve"):
        e.mgr.metadata(["a"], [0], draft_lens=[2])
    e.mgr.reserve("a", 2)  # copy-on-write: a's own block
    e.drain()
    meta = e.mgr.metadata(["a"], [0], draft_lens=[2])
    k, v = e.kv([70, 71], 6)
    ops.write_slots(e.dev, 0, k, v, meta.slot_mapping)
    e.assert_reads_back("b")
    e.mgr.check()


@pytest.mark.parametrize("bs", [1, 2, 3, 16])
def test_blocks_needed_saturates_instead_of_overflowing(bs):
    """Found by the CI fuzz stage twice. First (UBSan, signed overflow in blocks_after): with
    block size 1 the block count of 2**63 - 1 more tokens does not fit in int64. Then
    (model mismatch): the saturated cover less the table length answered 2**63 - 1 - 3.
    Queries are exact where int64 holds the answer and saturate only beyond it; compared
    with the reference model at and next to every boundary."""
    from kvblocks.testing import ReferenceManager

    mgr, ref = BlockManager(16, bs, num_host_blocks=8), ReferenceManager(16, bs, num_host_blocks=8)
    for m in (mgr, ref):
        m.add("a", [1, 2, 3])
        m.add("s", [4, 5, 6])
        m.add("f", [7, 8, 9, 10])
        m.fork("f", "g")  # f's write block is shared: one copy-on-write on top
        m.swap_out("s")
    top = 2**63 - 1
    for n in (top, top - 1, top - 2, top - 3, top - bs, top - 2 * bs, top // 2, 2**62):
        for sid in ("a", "s", "f"):
            assert mgr.blocks_needed(sid, n) == ref.blocks_needed(sid, n), (sid, n)
        assert mgr.can_append(["a", "f"], n) == ref.can_append(["a", "f"], n) is False
    for n in (2**31 - 1, 2**31 - 2):  # a step's counts are int32
        got = mgr.blocks_needed_batch(["a", "f", "g"], n, forks=[0, 2, 0])
        assert got == ref.blocks_needed_batch(["a", "f", "g"], n, forks=[0, 2, 0]), n
    with pytest.raises(OutOfBlocksError):
        mgr.reserve("a", top)
    mgr.check()
