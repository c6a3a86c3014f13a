"""Suite ``metadata``: ``BlockManager.metadata`` (the native attention-metadata builder).

Cases (block size 16, metadata written into preallocated :class:`AttentionMetadata` buffers):

- decode: 256 sequences x 4,096 tokens of context, 1 query token each; also with every row
  rewritten (``invalidate``), with real decode steps between calls (one ``append_batch``,
  untimed, before each call: about 256/16 tables gain a block per step), and into fresh arrays;
- prefill: 32 sequences x 2,048 new tokens (whole prompts).

Each case is also built by two numpy baselines in the same run, from block tables the engine
already holds as numpy arrays (nothing of kvblocks timed there): ``numpy-list`` (one int32
array per sequence: concatenate, repeat, fancy indexing) and ``numpy-2d`` (a persistent padded
``[B, max_blocks]`` table, vLLM InputBatch style: masking). Every call is timed on its own.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from .._core import BlockManager
from ..metadata import AttentionMetadata
from .timing import Case, Op, Settings

__all__ = ["build", "numpy_list", "numpy_2d"]

BS = 16


def numpy_list(tables, lens, qlens, bs, out):
    """From one block-table array per sequence; writes the same arrays into ``out``."""
    B = len(tables)
    nb = (lens + bs - 1) // bs
    kv_indptr = out["kv_indptr"][: B + 1]
    kv_indptr[0] = 0
    np.cumsum(nb, out=kv_indptr[1:])
    kv_indices = np.concatenate([t[:n] for t, n in zip(tables, nb)])
    out["kv_indices"][: len(kv_indices)] = kv_indices
    bt = out["block_tables"]
    bt[:B] = 0
    for i in range(B):
        bt[i, : nb[i]] = tables[i][: nb[i]]
    qo = out["qo_indptr"][: B + 1]
    qo[0] = 0
    np.cumsum(qlens, out=qo[1:])
    ntok = int(qo[-1])
    start = np.repeat(lens - qlens - qo[:-1], qlens)
    pos = np.arange(ntok) + start
    blk = kv_indices[np.repeat(kv_indptr[:-1], qlens) + pos // bs]
    sm = out["slot_mapping"]
    sm[:ntok] = blk.astype(np.int64) * bs + pos % bs
    sm[ntok:] = -1
    out["seq_lens"][:B] = lens
    out["kv_last_page_len"][:B] = lens - (nb - 1) * bs
    return ntok


def numpy_2d(table2d, lens, qlens, bs, out):
    """From a persistent padded [B, max_blocks] table (vLLM's InputBatch keeps one)."""
    B = table2d.shape[0]
    nb = (lens + bs - 1) // bs
    kv_indptr = out["kv_indptr"][: B + 1]
    kv_indptr[0] = 0
    np.cumsum(nb, out=kv_indptr[1:])
    mask = np.arange(table2d.shape[1])[None, :] < nb[:, None]
    kv_indices = table2d[mask]
    out["kv_indices"][: len(kv_indices)] = kv_indices
    out["block_tables"][:B] = np.where(mask, table2d, 0)
    qo = out["qo_indptr"][: B + 1]
    qo[0] = 0
    np.cumsum(qlens, out=qo[1:])
    ntok = int(qo[-1])
    seq = np.repeat(np.arange(B), qlens)
    pos = np.arange(ntok) + np.repeat(lens - qlens - qo[:-1], qlens)
    sm = out["slot_mapping"]
    sm[:ntok] = table2d[seq, pos // bs].astype(np.int64) * bs + pos % bs
    sm[ntok:] = -1
    out["seq_lens"][:B] = lens
    out["kv_last_page_len"][:B] = lens - (nb - 1) * bs
    return ntok


def _case(key: str, label: str, num_seqs: int, context: int, query: int, s: Settings) -> List[Op]:
    nb = -(-context // BS)
    mgr = BlockManager(num_seqs * (nb + 1) + 8, BS, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    ids = list(range(num_seqs))
    for i in ids:
        mgr.add(i, rng.integers(0, 32000, size=context, dtype=np.int32))
    if query < context:  # all computed once; each timed call then rebuilds the last query tokens
        mgr.schedule(ids, [context] * num_seqs)
    qlens = np.full(num_seqs, query, dtype=np.int32)
    buf = AttentionMetadata.allocate(
        max_batch=num_seqs,
        max_tokens=num_seqs * query,
        max_indices=num_seqs * nb,
        max_blocks_per_seq=nb,
    )
    sb = mgr.batch(ids)
    tables = [mgr.block_table(i) for i in ids]
    lens = np.array([mgr.num_tokens(i) for i in ids], dtype=np.int32)
    table2d = np.zeros((num_seqs, nb), dtype=np.int32)
    for i, t in enumerate(tables):
        table2d[i, : len(t)] = t
    np_out = {k: np.empty_like(v) for k, v in buf.as_dict().items()}

    meta = mgr.metadata(sb, qlens, out=buf)  # the three constructions agree
    for fn in (
        lambda: numpy_list(tables, lens, qlens, BS, np_out),
        lambda: numpy_2d(table2d, lens, qlens, BS, np_out),
    ):
        fn()
        for k in buf.as_dict():
            v = getattr(meta, k)
            assert np.array_equal(np_out[k][: len(v)], v), k

    few = max(s.min_samples, s.samples // 4)
    base = [
        Case(
            "numpy-list", lambda: numpy_list(tables, lens, qlens, BS, np_out), inner=1, samples=few
        ),
        Case("numpy-2d", lambda: numpy_2d(table2d, lens, qlens, BS, np_out), inner=1, samples=few),
    ]
    units = num_seqs * nb

    def op(suffix, text, fn, **kw):
        return Op(
            f"metadata/{key}/{suffix}",
            f"{label}: {text}",
            "block",
            units,
            [Case("kvblocks", fn, inner=1, **kw)] + base,
        )

    ops = [
        op("seqbatch_out", "SeqBatch, out=", lambda: mgr.metadata(sb, qlens, out=buf)),
        op("list_out", "list of ids, out=", lambda: mgr.metadata(ids, qlens, out=buf)),
    ]
    if query == 1:

        def cold():  # every row rewritten: what a reused buffer costs when all tables changed
            buf.invalidate()
            mgr.metadata(sb, qlens, out=buf)

        ops.append(op("rewrite_all", "out=, all rows rewritten", cold))
        ops.append(_advancing(key, label, num_seqs, context, units, base, s))
    ops.append(
        op("seqbatch_fresh", "SeqBatch, fresh arrays", lambda: mgr.metadata(sb, qlens), samples=few)
    )
    return ops


def _advancing(key, label, num_seqs, context, units, base, s: Settings) -> Op:
    """Real decode steps: one append_batch (untimed) before each timed metadata call; the
    contexts are staggered so that about num_seqs / BS tables gain a block every step."""
    steps = s.cap(s.samples) + 200 + 4 * s.rounds + 8  # samples, warm-up, untimed per round
    nb = -(-(context + BS + steps) // BS)
    mgr = BlockManager(num_seqs * (nb + 1) + 8, BS, enable_prefix_caching=False)
    rng = np.random.default_rng(1)
    ids = list(range(num_seqs))
    for i in ids:
        mgr.add(i, rng.integers(0, 32000, size=context + i % BS, dtype=np.int32))
    sb = mgr.batch(ids)
    mgr.schedule(sb, [mgr.num_tokens(i) for i in ids])
    qlens = np.ones(num_seqs, dtype=np.int32)
    toks = np.zeros(num_seqs, dtype=np.int32)
    buf = AttentionMetadata.allocate(num_seqs, num_seqs, num_seqs * nb, nb)

    def check():  # the incremental buffers hold exactly the fresh result
        fresh = mgr.metadata(sb, qlens)
        inc = mgr.metadata(sb, qlens, out=buf)
        for k, v in fresh.as_dict().items():
            got = getattr(inc, k)
            if k == "block_tables":  # the buffer's rows are wider: the rest is null-block padding
                assert not got[:, v.shape[1] :].any()
                got = got[:, : v.shape[1]]
            assert np.array_equal(got, v), k

    case = Case(
        "kvblocks",
        lambda: mgr.metadata(sb, qlens, out=buf),
        inner=1,
        setup=lambda: mgr.append_batch(sb, toks),
        check=check,
    )
    return Op(
        f"metadata/{key}/advancing",
        f"{label}: out=, decode advancing",
        "block",
        units,
        [case] + base,
        note="one append_batch (untimed) before each call",
    )


def build(s: Settings, vllm=None) -> Tuple[List[Op], dict]:
    ops = _case("decode", "decode 256x4096", 256, 4096, 1, s)
    ops += _case("prefill", "prefill 32x2048", 32, 2048, 2048, s)
    return ops, {}
