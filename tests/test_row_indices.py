"""BlockManager.row_indices: per-token cache rows of a step, against a pure-Python model of the
layout (row = table[p // block_size] * stride + offset + p % block_size), its buffers, and the
calls that must fail without changing anything."""

import numpy as np
import pytest
from helpers import KEY
from hypothesis import given, settings
from hypothesis import strategies as st

from kvblocks import (
    BlockManager,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    RowIndices,
    UnknownSequenceError,
)

FIELDS = ("read_index", "write_index", "read_offsets", "write_offsets", "block_tables")


def model_rows(mgr, seq_ids, qlens, drafts, stride, offset, max_blocks=None):
    """The layout written out token by token: what row_indices must return."""
    bs = mgr.block_size
    read, write, ro, wo, tables = [], [], [0], [0], []
    for sid, q, d in zip(seq_ids, qlens, drafts):
        table = mgr.block_table(sid).tolist()
        n = mgr.num_tokens(sid) + d
        rows = [table[p // bs] * stride + offset + p % bs for p in range(n)]
        read += rows
        write += rows[n - q - d :]
        ro.append(len(read))
        wo.append(len(write))
        tables.append([(b * stride + offset) // bs for b in table[: -(-n // bs)]])
    width = max_blocks if max_blocks is not None else max([len(t) for t in tables] or [0])
    pad = offset // bs
    bt = [t + [pad] * (width - len(t)) for t in tables]
    return read, write, ro, wo, bt


def assert_rows(rows, ref):
    read, write, ro, wo, bt = ref
    assert rows.read_index.tolist() == read
    assert rows.write_index.tolist() == write
    assert rows.read_offsets.tolist() == ro
    assert rows.write_offsets.tolist() == wo
    if rows.block_tables is not None:
        assert rows.block_tables.tolist() == bt
    assert rows.num_read == len(read) and rows.num_write == len(write)


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    bs=st.sampled_from([1, 3, 4, 16]),
    pages=st.integers(1, 6),
    off_pages=st.integers(0, 3),
    data=st.data(),
)
def test_rows_match_the_layout_model(lens, bs, pages, off_pages, data):
    mgr = BlockManager(400, bs, hash_key=KEY)
    stride, offset = pages * bs, off_pages * bs
    ids = []
    for i, n in enumerate(lens):
        mgr.add(i, [(5 * i + t) % 30 for t in range(n)])
        ids.append(i)
    drafts = [data.draw(st.integers(0, 3)) for _ in ids]
    for i, d in zip(ids, drafts):
        mgr.reserve(i, d)
    q = [data.draw(st.integers(n - mgr.num_computed(i), n)) for i, n in zip(ids, lens)]
    ref = model_rows(mgr, ids, q, drafts, stride, offset)
    rows = mgr.row_indices(
        ids, q, stride=stride, offset=offset, draft_lens=drafts, block_tables=True
    )
    assert_rows(rows, ref)
    # the step is declared: every committed token is computed
    assert all(mgr.num_computed(i) == n for i, n in zip(ids, lens))


def test_any_stride_without_tables_and_decode_steps_into_buffers():
    mgr = BlockManager(64, 4, hash_key=KEY)
    mgr.add("a", list(range(10)))
    mgr.add("b", list(range(100, 107)))
    buf = RowIndices.allocate(4, 32, 64, 8)
    no_tables = RowIndices(buf.read_index, buf.write_index, buf.read_offsets, buf.write_offsets)
    rows = mgr.row_indices(["a", "b"], [10, 7], stride=7, offset=3, out=no_tables)
    assert_rows(rows, model_rows(mgr, ["a", "b"], [10, 7], [0, 0], 7, 3))
    assert rows.block_tables is None
    for step in range(6):
        mgr.append_batch(["a", "b"], [step, step + 1])
        rows = mgr.row_indices(["a", "b"], [1, 1], stride=8, out=buf)
        assert_rows(rows, model_rows(mgr, ["a", "b"], [1, 1], [0, 0], 8, 0, 8))
        assert np.shares_memory(rows.read_index, buf.read_index)
        assert np.shares_memory(rows.block_tables, buf.block_tables)


def test_fields_left_none_are_not_built():
    mgr = BlockManager(32, 4, hash_key=KEY)
    mgr.add(1, list(range(9)))
    ro, wo = np.zeros(2, np.int32), np.zeros(2, np.int32)
    write = np.full(16, -7, np.int64)
    rows = mgr.row_indices([1], [9], stride=4, out=RowIndices(None, write, ro, wo))
    assert rows.read_index is None and rows.block_tables is None
    assert rows.write_index.tolist() == model_rows(mgr, [1], [9], [0], 4, 0)[1]
    assert (write[9:] == -7).all() and ro.tolist() == [0, 9]


def test_zero_copy_to_torch():
    torch = pytest.importorskip("torch")
    mgr = BlockManager(32, 4, hash_key=KEY)
    mgr.add(1, list(range(9)))
    storage = torch.zeros(64, dtype=torch.int64)
    ro, wo = torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    out = RowIndices(storage.numpy(), None, ro.numpy(), wo.numpy())
    mgr.row_indices([1], [9], stride=8, out=out)
    assert storage[:9].tolist() == model_rows(mgr, [1], [9], [0], 8, 0)[0]
    t = mgr.row_indices([1], [0], stride=8).as_torch()
    assert t["read_index"].dtype == torch.int64 and t["read_offsets"].tolist() == [0, 9]


def test_empty_batch():
    mgr = BlockManager(16, 4, hash_key=KEY)
    rows = mgr.row_indices([], [], stride=4, block_tables=True)
    assert rows.num_read == 0 and rows.read_offsets.tolist() == [0]
    assert rows.block_tables.shape == (0, 0)


def snapshot(mgr):
    return (
        {
            s: (mgr.block_table(s).tolist(), mgr.num_tokens(s), mgr.num_computed(s))
            for s in mgr.seq_ids()
        },
        mgr.pool.ref_counts().tolist(),
        mgr.pool.num_cached,
    )


def test_hostile_inputs_change_nothing():
    mgr = BlockManager(32, 4, hash_key=KEY)
    mgr.add("a", list(range(9)))
    mgr.add("b", list(range(5)))
    buf = RowIndices.allocate(2, 4, 8, 2)
    bufsnap = {f: getattr(buf, f).copy() for f in FIELDS}
    before = snapshot(mgr)
    bad = [
        (InvalidArgumentError, dict(stride=3)),  # stride < block_size: blocks would overlap
        (InvalidArgumentError, dict(stride=4, offset=-1)),
        (InvalidArgumentError, dict(stride=2**62)),  # rows past int64
        (InvalidArgumentError, dict(stride=6, block_tables=True)),  # pages need multiples
        (InvalidArgumentError, dict(stride=4, offset=2, block_tables=True)),
        (InvalidArgumentError, dict(stride=4 * 2**28, block_tables=True)),  # past int32
        (InvalidTypeError, dict(stride=4.0)),
        (InvalidTypeError, dict(stride=True)),
        (InvalidTypeError, dict(stride=4, out=object())),
        (InvalidArgumentError, dict(stride=4, out=buf)),  # 14 rows do not fit
        (InvalidArgumentError, dict(stride=4, block_tables=True, max_blocks=1)),
        (
            InvalidTypeError,
            dict(stride=4, out=RowIndices([0] * 20, None, buf.read_offsets, buf.write_offsets)),
        ),
        (
            InvalidTypeError,
            dict(
                stride=4,
                out=RowIndices(np.zeros(20, np.int32), None, buf.read_offsets, buf.write_offsets),
            ),
        ),
        (
            InvalidArgumentError,
            dict(
                stride=4, out=RowIndices(None, None, np.zeros(2, np.int32), np.zeros(3, np.int32))
            ),
        ),
        (InvalidStateError, dict(stride=4, draft_lens=[4, 0])),  # draft slots not reserved
        (InvalidArgumentError, dict(stride=4, draft_lens=[0])),
    ]
    for exc, kw in bad:
        with pytest.raises(exc):
            mgr.row_indices(["a", "b"], [9, 5], **kw)
            pytest.fail(f"no error for {kw}")
        assert snapshot(mgr) == before, kw
    for f in FIELDS:
        assert np.array_equal(getattr(buf, f), bufsnap[f]), f
    with pytest.raises(UnknownSequenceError):
        mgr.row_indices(["a", "zz"], [9, 1], stride=4)
    with pytest.raises(InvalidArgumentError):
        mgr.row_indices(["a", "a"], [9, 9], stride=4)  # a sequence twice
    with pytest.raises(InvalidArgumentError):
        mgr.row_indices(["a"], [10], stride=4)  # more queries than committed tokens
    with pytest.raises(InvalidArgumentError):
        mgr.row_indices(["a"], [9, 1], stride=4)
    with pytest.raises(InvalidStateError):
        mgr.row_indices(["a"], [1], stride=4)  # 8 committed tokens never computed: a gap
    assert snapshot(mgr) == before
    mgr.fork("a", "c")
    mgr.append("c", [1])  # copy-on-write of the shared partial block
    with pytest.raises(InvalidStateError, match="copy"):
        mgr.row_indices(["c"], [10], stride=4)
    mgr.take_copies()
    assert mgr.row_indices(["c"], [10], stride=4).num_write == 10


def test_group_rows_follow_that_groups_table():
    """row_indices(group=g) reads group g's table: released window positions map to the null
    block's rows, the step is declared for that group only, and a state group is refused."""
    from kvblocks import KVGroup

    groups = (KVGroup("full"), KVGroup("sliding_window", window=4), KVGroup("state", blocks=1))
    mgr = BlockManager(64, 4, groups=groups, hash_key=KEY)
    mgr.add("a", list(range(14)))
    mgr.schedule(["a"], [14])
    mgr.append("a", [99])
    for g in (0, 1):
        r = mgr.row_indices(["a"], [1], stride=8, offset=2, group=g)
        table = mgr.block_table("a", group=g).tolist()
        want = [table[p // 4] * 8 + 2 + p % 4 for p in range(15)]
        assert r.read_index.tolist() == want
        assert r.write_index.tolist() == want[-1:]
    assert mgr.block_table("a", group=1).tolist()[:2] == [0, 0]  # released below the window
    before = [mgr.block_table("a", group=g).tolist() for g in (0, 1, 2)]
    with pytest.raises(InvalidArgumentError, match="state group"):
        mgr.row_indices(["a"], [1], stride=8, group=2)
    with pytest.raises(InvalidArgumentError):
        mgr.row_indices(["a"], [1], stride=8, group=3)
    assert [mgr.block_table("a", group=g).tolist() for g in (0, 1, 2)] == before
    mgr.check()
