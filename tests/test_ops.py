"""kvblocks.ops on the CPU (numpy) path, checked against plain numpy indexing.

Every layout kind (NHD/HND), joint and split storage and every dtype; random pair sets from
seeded numpy and hypothesis; every error path asserts the storage is unchanged afterwards.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from subproc import run_python

import kvblocks
from kvblocks import (
    DeviceError,
    InvalidArgumentError,
    InvalidTypeError,
    KVBlocksError,
    KVCache,
    KVLayout,
    ops,
)

DTYPES = ["bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2"]
LAYOUTS = [(kind, joint) for kind in ("NHD", "HND") for joint in (True, False)]


def make_cache(
    dtype="fp16",
    kind="NHD",
    joint=True,
    num_blocks=12,
    seed=0,
    layers=3,
    heads=2,
    dim=8,
    block_size=4,
) -> KVCache:
    lay = KVLayout(layers, heads, dim, block_size, dtype, kind=kind, joint=joint)
    cache = KVCache(lay, num_blocks, pin_memory=False)
    rng = np.random.default_rng(seed)
    cache.planes[...] = rng.integers(0, 256, cache.planes.shape, dtype=np.uint8)
    return cache


def ref_copy(storage: np.ndarray, joint: bool, src, dst, into: np.ndarray = None) -> np.ndarray:
    """Plain numpy reference: blocks src -> dst on the layout's block axis."""
    out = (storage if into is None else into).copy()
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    if joint:
        out[:, dst] = storage[:, src]
    else:
        out[:, :, dst] = storage[:, :, src]
    return out


def random_pairs(rng, num_blocks, n, *, disjoint=True, n_dst_blocks=None):
    """n pairs: distinct dsts; srcs (with repeats) outside the dsts when disjoint."""
    n_dst_blocks = n_dst_blocks or num_blocks
    dst = rng.choice(n_dst_blocks, size=n, replace=False)
    pool = np.setdiff1d(np.arange(num_blocks), dst) if disjoint else np.arange(num_blocks)
    src = rng.choice(pool, size=n, replace=True)
    return np.stack([src, dst], axis=1)


def token_index(lay: KVLayout, layer: int, kv: int, block: int, off: int):
    """Index into cache.storage of one token's [H, D] (K: kv=0, V: kv=1), by hand."""
    if lay.joint:
        head = (layer, block, kv)
    else:
        head = (layer, kv, block)
    if lay.kind == "NHD":
        return head + (off,)
    return head + (slice(None), off)


# ---------------------------------------------------------------------------------------------
# layout and storage
# ---------------------------------------------------------------------------------------------
def test_layout_sizes():
    lay = KVLayout(32, 8, 128, 16, "bfloat16")
    assert lay.dtype == "bf16" and lay.storage_dtype == np.uint16
    assert lay.bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert lay.bytes_per_block == lay.bytes_per_token * 16
    assert lay.bytes_per_block == lay.num_planes * lay.plane_block_bytes
    split = KVLayout(32, 8, 128, 16, "bf16", joint=False)
    assert split.bytes_per_block == lay.bytes_per_block and split.num_planes == 64
    assert KVLayout(1, 1, 1, 1, "fp8").storage_dtype == np.uint8
    assert KVLayout(1, 1, 1, 1, np.float32).dtype == "fp32"
    assert KVLayout(1, 2, 3, 4, "fp16", kind="hnd").block_shape == (2, 4, 3)


@pytest.mark.parametrize(
    "args, exc",
    [
        ((0, 8, 128, 16, "fp16"), InvalidArgumentError),
        ((1, -1, 128, 16, "fp16"), InvalidArgumentError),
        ((1, 8, 128.0, 16, "fp16"), InvalidTypeError),
        ((1, 8, 128, True, "fp16"), InvalidTypeError),
        ((1, 8, 128, 16, "int8"), InvalidTypeError),
        ((1, 8, 128, 16, np.int32), InvalidTypeError),
    ],
)
def test_layout_rejects(args, exc):
    with pytest.raises(exc):
        KVLayout(*args)


def test_layout_rejects_kind_and_joint():
    with pytest.raises(InvalidArgumentError):
        KVLayout(1, 1, 1, 1, "fp16", kind="NDH")
    with pytest.raises(InvalidTypeError):
        KVLayout(1, 1, 1, 1, "fp16", joint="yes")


@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_views(dtype, kind, joint):
    cache = make_cache(dtype, kind, joint)
    lay = cache.layout
    assert cache.storage.dtype == lay.storage_dtype
    assert cache.storage.shape == lay.storage_shape(cache.num_blocks)
    assert cache.nbytes == cache.planes.nbytes == cache.num_blocks * lay.bytes_per_block
    assert np.shares_memory(cache.storage, cache.planes)
    for layer in range(lay.num_layers):
        k, v = cache.kv(layer)
        assert k.shape == v.shape == (cache.num_blocks,) + lay.block_shape
        assert np.shares_memory(k, cache.storage) and not np.shares_memory(k, v)
        if not joint:
            assert k.flags.c_contiguous and v.flags.c_contiguous
        else:
            assert cache.layer(layer).shape == (cache.num_blocks, 2) + lay.block_shape
    assert cache.device == "cpu" and not cache.is_cuda and cache.xp is np
    assert "KVCache(" in repr(cache)


def test_cache_rejects():
    lay = KVLayout(1, 1, 8, 4, "fp16")
    with pytest.raises(InvalidArgumentError):
        KVCache(lay, 0)
    with pytest.raises(InvalidTypeError):
        KVCache(lay, 2.0)
    with pytest.raises(InvalidTypeError):
        KVCache("layout", 2)
    with pytest.raises(InvalidArgumentError):
        KVCache(lay, 2, device="tpu")
    with pytest.raises(InvalidTypeError):
        KVCache(lay, 2, device=0)
    cache = KVCache(lay, 2, pin_memory=False)
    with pytest.raises(InvalidArgumentError):
        cache.key(1)
    with pytest.raises(InvalidTypeError):
        cache.value("0")


def test_cuda_without_cupy_raises_device_error():
    if kvblocks._cuda.cuda_available():
        pytest.skip("CuPy and a CUDA device are present")
    lay = KVLayout(1, 1, 8, 4, "fp16")
    with pytest.raises(DeviceError, match="CuPy and a CUDA device"):
        KVCache(lay, 2, device="cuda")
    with pytest.raises(DeviceError):
        KVCache(lay, 2, pin_memory=True)
    assert not KVCache(lay, 2).pinned  # auto: pageable without CuPy


def test_import_does_not_import_cupy():
    code = "import sys, kvblocks; assert 'cupy' not in sys.modules; print('ok')"
    out = run_python(["-c", code])
    assert out.returncode == 0, out.stderr


# ---------------------------------------------------------------------------------------------
# copy_blocks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_numpy(dtype, kind, joint):
    rng = np.random.default_rng(hash((dtype, kind, joint)) & 0xFFFF)
    cache = make_cache(dtype, kind, joint, num_blocks=16)
    for n in (1, 3, 7):
        pairs = random_pairs(rng, 16, n)
        want = ref_copy(cache.storage, joint, pairs[:, 0], pairs[:, 1])
        ops.copy_blocks(cache, pairs.astype(rng.choice([np.int32, np.int64])))
        np.testing.assert_array_equal(cache.storage, want)


def test_copy_blocks_accepts_sequences_and_empty():
    cache = make_cache()
    before = cache.storage.copy()
    ops.copy_blocks(cache, [])
    ops.copy_blocks(cache, np.empty((0, 2), np.int64))
    np.testing.assert_array_equal(cache.storage, before)
    ops.copy_blocks(cache, [(1, 2), (1, 3)])  # one src forked to two dsts
    np.testing.assert_array_equal(cache.storage, ref_copy(before, True, [1, 1], [2, 3]))


@pytest.mark.parametrize("plane_by_plane", [True, False])
@pytest.mark.parametrize("joint", [True, False])
def test_copy_blocks_runs_and_chunks(monkeypatch, joint, plane_by_plane):
    """The run-merging (slices) and chunked fancy-index paths agree with numpy."""
    if plane_by_plane:
        monkeypatch.setattr(ops, "_PLANE_SLICE_BYTES", 0)
    rng = np.random.default_rng(7)
    cache = make_cache("fp32", "HND", joint, num_blocks=64)
    runs = np.array([[0, 40], [1, 41], [2, 42], [3, 43], [10, 50], [11, 51], [12, 52], [13, 53]])
    want = ref_copy(cache.storage, joint, runs[:, 0], runs[:, 1])
    ops.copy_blocks(cache, runs[rng.permutation(len(runs))])
    np.testing.assert_array_equal(cache.storage, want)
    monkeypatch.setattr(ops, "_CPU_WHOLE_BYTES", 0)  # plane by plane,
    monkeypatch.setattr(ops, "_CPU_CHUNK_BYTES", 1)  # one pair per fancy step
    pairs = random_pairs(rng, 64, 20)
    want = ref_copy(cache.storage, joint, pairs[:, 0], pairs[:, 1])
    ops.copy_blocks(cache, pairs)
    np.testing.assert_array_equal(cache.storage, want)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.sampled_from(LAYOUTS),
    dtype=st.sampled_from(DTYPES),
    pairs=st.lists(st.tuples(st.integers(-1, 10), st.integers(-1, 10)), max_size=8),
)
def test_copy_blocks_property(layout, dtype, pairs):
    """Any pair list either copies exactly like numpy or raises and changes nothing."""
    kind, joint = layout
    cache = make_cache(dtype, kind, joint, num_blocks=10, layers=2, dim=4)
    before = cache.storage.copy()
    arr = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    src, dst = arr[:, 0], arr[:, 1]
    valid = (
        ((arr >= 0) & (arr < 10)).all()
        and len(set(dst.tolist())) == len(dst)
        and not set(dst.tolist()) & set(src.tolist())
    )
    if valid:
        ops.copy_blocks(cache, pairs)
        np.testing.assert_array_equal(cache.storage, ref_copy(before, joint, src, dst))
    else:
        with pytest.raises(InvalidArgumentError):
            ops.copy_blocks(cache, pairs)
        np.testing.assert_array_equal(cache.storage, before)


@pytest.mark.parametrize(
    "pairs, exc, match",
    [
        # each list starts with a valid pair (5, 6): nothing of a bad batch may be applied
        ([(5, 6), (0, 12)], InvalidArgumentError, "dst block 12 out of range"),
        ([(5, 6), (12, 0)], InvalidArgumentError, "src block 12 out of range"),
        ([(5, 6), (-1, 0)], InvalidArgumentError, "out of range"),
        ([(5, 6), (1, 2), (3, 2)], InvalidArgumentError, "dst block 2 appears more than once"),
        ([(5, 6), (1, 2), (2, 3)], InvalidArgumentError, "both a src and a dst"),
        ([(5, 6), (4, 4)], InvalidArgumentError, "both a src and a dst"),
        ([(1, 2, 3)], InvalidArgumentError, r"shape \(n, 2\)"),
        ([1, 2], InvalidArgumentError, r"shape \(n, 2\)"),
        (np.array([[1.0, 2.0]]), InvalidTypeError, "integer dtype"),
        ("ab", InvalidTypeError, "integer dtype"),
    ],
)
def test_copy_blocks_rejects_and_changes_nothing(pairs, exc, match):
    cache = make_cache()
    before = cache.storage.copy()
    with pytest.raises(exc, match=match):
        ops.copy_blocks(cache, pairs)
    np.testing.assert_array_equal(cache.storage, before)


@pytest.mark.parametrize("n", [5, 33, 60, 200])  # both the Python (<= 32) and numpy checks
@pytest.mark.parametrize("joint", [True, False])
def test_copy_blocks_sizes_and_corruptions(n, joint):
    rng = np.random.default_rng(n)
    cache = make_cache("fp8_e5m2", "NHD", joint, num_blocks=2 * n + 3, layers=2)
    nb = cache.num_blocks
    for trial in range(3):
        pairs = random_pairs(rng, nb, n)
        if trial == 2:  # consecutive runs: the slice path
            start = rng.integers(0, nb - 2 * n)
            pairs = np.stack([np.arange(n) + start, np.arange(n) + start + n], axis=1)
        want = ref_copy(cache.storage, joint, pairs[:, 0], pairs[:, 1])
        ops.copy_blocks(cache, pairs)
        np.testing.assert_array_equal(cache.storage, want)
    pairs = random_pairs(rng, nb, n)
    i, j = rng.choice(n, size=2, replace=False)
    corruptions = {
        "src out of range": lambda p: p.__setitem__((i, 0), nb),
        "dst out of range": lambda p: p.__setitem__((i, 1), nb + 7),
        "negative": lambda p: p.__setitem__((j, 0), -3),
        "dup dst": lambda p: p.__setitem__((i, 1), p[j, 1]),
        "dst is src": lambda p: p.__setitem__((i, 0), p[j, 1]),
    }
    for name, corrupt in corruptions.items():
        bad = pairs.copy()
        corrupt(bad)
        before = cache.storage.copy()
        with pytest.raises(InvalidArgumentError):
            ops.copy_blocks(cache, bad)
        with pytest.raises(InvalidArgumentError):
            ops.swap_blocks(cache, cache, bad)
        np.testing.assert_array_equal(cache.storage, before, err_msg=name)


def test_copy_blocks_rejects_non_cache():
    with pytest.raises(InvalidTypeError):
        ops.copy_blocks(np.zeros((4, 4)), [(0, 1)])


# ---------------------------------------------------------------------------------------------
# swap_blocks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_blocks_matches_numpy(dtype, kind, joint):
    rng = np.random.default_rng(3)
    dev = make_cache(dtype, kind, joint, num_blocks=16, seed=1)
    host = make_cache(dtype, kind, joint, num_blocks=9, seed=2)
    for n in (1, 5, 9):
        out = random_pairs(rng, 16, n, disjoint=False, n_dst_blocks=9)
        want_host = ref_copy(dev.storage, joint, out[:, 0], out[:, 1], into=host.storage)
        want_dev = dev.storage.copy()
        ops.swap_blocks(dev, host, out)
        np.testing.assert_array_equal(host.storage, want_host)
        np.testing.assert_array_equal(dev.storage, want_dev)
        back = out[:, ::-1]  # swap in to other blocks than they came from
        back = np.stack([back[:, 0], rng.permutation(16)[:n]], axis=1)
        want_dev = ref_copy(host.storage, joint, back[:, 0], back[:, 1], into=dev.storage)
        ops.swap_blocks(host, dev, back)
        np.testing.assert_array_equal(dev.storage, want_dev)


def test_swap_blocks_consecutive_runs():
    dev = make_cache("bf16", num_blocks=32, seed=1)
    host = make_cache("bf16", num_blocks=32, seed=2)
    pairs = np.array([[i, 31 - 8 + i] for i in range(8)] + [[20 + i, i] for i in range(6)])
    want = ref_copy(dev.storage, True, pairs[:, 0], pairs[:, 1], into=host.storage)
    ops.swap_blocks(dev, host, pairs)
    np.testing.assert_array_equal(host.storage, want)


def test_swap_blocks_same_cache_follows_copy_rules():
    cache = make_cache()
    before = cache.storage.copy()
    ops.swap_blocks(cache, cache, [(1, 2)])
    np.testing.assert_array_equal(cache.storage, ref_copy(before, True, [1], [2]))
    before = cache.storage.copy()
    with pytest.raises(InvalidArgumentError, match="both a src and a dst"):
        ops.swap_blocks(cache, cache, [(1, 2), (2, 3)])
    np.testing.assert_array_equal(cache.storage, before)


def test_swap_blocks_rejects_and_changes_nothing():
    a = make_cache(num_blocks=8, seed=1)
    b = make_cache(num_blocks=4, seed=2)
    other = make_cache("fp32", num_blocks=4, seed=3)
    other_kind = make_cache(kind="HND", num_blocks=4, seed=3)
    snap = [c.storage.copy() for c in (a, b, other, other_kind)]
    cases = [
        ((a, other, [(0, 0)]), InvalidArgumentError, "layouts differ"),
        ((a, other_kind, [(0, 0)]), InvalidArgumentError, "layouts differ"),
        ((a, b, [(0, 0), (7, 4)]), InvalidArgumentError, "dst block 4 out of range"),
        ((b, a, [(5, 0)]), InvalidArgumentError, "src block 5 out of range"),
        ((a, b, [(0, 1), (2, 1)]), InvalidArgumentError, "appears more than once"),
        ((a, b, [(0, 1)], "fast"), InvalidArgumentError, "method"),
        ((a, b, [(0, 1)], "kernel"), DeviceError, "pinned"),
        ((a, "b", [(0, 1)]), InvalidTypeError, "KVCache"),
    ]
    for args, exc, match in cases:
        call_args, method = args[:3], (args[3] if len(args) > 3 else "auto")
        with pytest.raises(exc, match=match):
            ops.swap_blocks(*call_args, method=method)
        for c, s in zip((a, b, other, other_kind), snap):
            np.testing.assert_array_equal(c.storage, s)


def test_merge_runs():
    s, d, n = ops.merge_runs(np.array([5, 6, 7, 1, 2]), np.array([0, 1, 2, 9, 3]))
    assert s.tolist() == [1, 2, 5] and d.tolist() == [9, 3, 0] and n.tolist() == [1, 1, 3]
    s, d, n = ops.merge_runs(np.arange(100), np.arange(100) + 200)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0], [200], [100])
    assert ops.merge_runs(np.array([], np.int64), np.array([], np.int64))[2].size == 0


# ---------------------------------------------------------------------------------------------
# write_slots and gather
# ---------------------------------------------------------------------------------------------
def random_tokens(rng, lay: KVLayout, n: int) -> np.ndarray:
    raw = rng.integers(0, 256, (n,) + lay.token_shape + (lay.itemsize,), dtype=np.uint8)
    return raw.view(lay.storage_dtype).reshape((n,) + lay.token_shape)


@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_slots_matches_numpy(dtype, kind, joint):
    rng = np.random.default_rng(11)
    cache = make_cache(dtype, kind, joint, num_blocks=6)
    lay = cache.layout
    n = 15
    slots = rng.choice(6 * lay.block_size, size=n, replace=False)
    slots[[2, 9]] = -1  # padding tokens are skipped
    slots = slots.astype(rng.choice([np.int32, np.int64]))
    k, v = random_tokens(rng, lay, n), random_tokens(rng, lay, n)
    for layer in (0, lay.num_layers - 1):
        want = cache.storage.copy()
        for t, s in enumerate(slots.tolist()):
            if s >= 0:
                b, o = divmod(s, lay.block_size)
                want[token_index(lay, layer, 0, b, o)] = k[t]
                want[token_index(lay, layer, 1, b, o)] = v[t]
        ops.write_slots(cache, layer, k, v, slots)
        np.testing.assert_array_equal(cache.storage, want)


@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_matches_numpy(dtype, kind, joint):
    rng = np.random.default_rng(5)
    cache = make_cache(dtype, kind, joint, num_blocks=10)
    lay = cache.layout
    table = rng.permutation(10)[:4].astype(np.int32)
    for num_tokens in (0, 1, 4, 11, 16):
        for layer in range(lay.num_layers):
            k, v = ops.gather(cache, layer, table, num_tokens)
            assert k.shape == v.shape == (num_tokens,) + lay.token_shape
            assert k.flags.c_contiguous and v.flags.c_contiguous and k.dtype == lay.storage_dtype
            assert not np.shares_memory(k, cache.storage)
            for t in range(num_tokens):
                b, o = int(table[t // lay.block_size]), t % lay.block_size
                np.testing.assert_array_equal(k[t], cache.storage[token_index(lay, layer, 0, b, o)])
                np.testing.assert_array_equal(v[t], cache.storage[token_index(lay, layer, 1, b, o)])


@pytest.mark.parametrize("kind, joint", LAYOUTS)
def test_write_then_gather_round_trip(kind, joint):
    rng = np.random.default_rng(2)
    cache = make_cache("bf16", kind, joint, num_blocks=8)
    lay = cache.layout
    table = np.array([6, 2, 5], dtype=np.int64)
    n = 10
    slots = table[np.arange(n) // lay.block_size] * lay.block_size + np.arange(n) % lay.block_size
    k, v = random_tokens(rng, lay, n), random_tokens(rng, lay, n)
    ops.write_slots(cache, 1, k, v, slots)
    k2, v2 = ops.gather(cache, 1, table, n)
    np.testing.assert_array_equal(k2, k)
    np.testing.assert_array_equal(v2, v)


class FakeCudaArray:
    """Stands for a CuPy/torch CUDA array: has __cuda_array_interface__."""

    __cuda_array_interface__ = {"shape": (1,), "typestr": "<f2", "data": (0, False), "version": 3}


def test_write_slots_rejects_and_changes_nothing():
    rng = np.random.default_rng(0)
    cache = make_cache("fp16", num_blocks=4)
    lay = cache.layout
    k, v = random_tokens(rng, lay, 3), random_tokens(rng, lay, 3)
    ok = np.array([0, 5, -1])
    before = cache.storage.copy()
    cases = [
        ((0, k.astype(np.float32), v, ok), InvalidTypeError, "dtype float32"),
        ((0, k, v.view(np.uint16), ok), InvalidTypeError, "does not match"),
        ((0, k[:, :1], v, ok), InvalidArgumentError, "shape"),
        ((0, k, v[:2], ok), InvalidArgumentError, "differ in shape"),
        ((0, k[None], v, ok), InvalidArgumentError, "shape"),
        ((0, k.tolist(), v, ok), InvalidTypeError, "numpy array"),
        ((0, FakeCudaArray(), v, ok), DeviceError, "CUDA array"),
        ((0, k, v, np.array([0, 16, 1])), InvalidArgumentError, "slot 16 out of range"),
        ((0, k, v, np.array([0, -2, 1])), InvalidArgumentError, "slot -2 out of range"),
        ((0, k, v, np.array([3, -1, 3])), InvalidArgumentError, "slot 3 appears more than once"),
        ((0, k, v, np.array([0, 1])), InvalidArgumentError, "slot_mapping must have shape"),
        ((0, k, v, np.array([0.0, 1.0, 2.0])), InvalidTypeError, "integer dtype"),
        ((3, k, v, ok), InvalidArgumentError, "layer 3 out of range"),
        ((None, k, v, ok), InvalidTypeError, "layer must be an int"),
    ]
    for args, exc, match in cases:
        with pytest.raises(exc, match=match):
            ops.write_slots(cache, *args)
        np.testing.assert_array_equal(cache.storage, before)
    with pytest.raises(InvalidArgumentError):  # check=False only relaxes the CUDA path
        ops.write_slots(cache, 0, k, v, np.array([0, 99, 1]), check=False)
    np.testing.assert_array_equal(cache.storage, before)
    ops.write_slots(cache, 0, k[:0], v[:0], np.array([], np.int64))  # empty is a no-op
    ops.write_slots(cache, 0, k, v, np.array([-1, -1, -1]))
    np.testing.assert_array_equal(cache.storage, before)


# regressions: integer inputs that wrapped or truncated on the way to int64
U64_MAX = 2**64 - 1


@pytest.mark.parametrize(
    "slot_mapping, exc, match",
    [
        (
            np.array([0, U64_MAX, 1], np.uint64),
            InvalidArgumentError,
            "18446744073709551615 is beyond int64",
        ),
        (np.array([0, 2**63, 1], np.uint64), InvalidArgumentError, "beyond int64"),
        ([0, 2**63, 1], InvalidArgumentError, "outside int64"),  # numpy would make these floats
        ([-1, 2**63, 1], InvalidArgumentError, "outside int64"),
        ([0, 2**70, 1], InvalidArgumentError, "outside int64"),  # numpy would make these objects
        ([0.0, 1.0, 2.0], InvalidTypeError, "integer dtype"),
        (np.array([0, 1.5, 2]), InvalidTypeError, "integer dtype"),
        (np.array([0, 1, 2], np.float32), InvalidTypeError, "integer dtype"),
        (np.array([True, False, True]), InvalidTypeError, "integer dtype"),
        (np.array([0, 16, 1], np.uint64), InvalidArgumentError, "slot 16 out of range"),
        (np.array([0, 2**31, 1], np.uint32), InvalidArgumentError, "slot 2147483648 out of range"),
    ],
)
def test_write_slots_uint64_max_is_refused(slot_mapping, exc, match):
    """2**64 - 1 in a uint64 slot mapping wrapped to -1 and was skipped as padding."""
    rng = np.random.default_rng(1)
    cache = make_cache("fp16", num_blocks=4)
    k, v = random_tokens(rng, cache.layout, 3), random_tokens(rng, cache.layout, 3)
    before = cache.storage.copy()
    with pytest.raises(exc, match=match):
        ops.write_slots(cache, 0, k, v, slot_mapping)
    np.testing.assert_array_equal(cache.storage, before)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64, np.int8, np.int16])
def test_write_slots_accepts_unsigned_and_narrow_slot_mappings(dtype):
    rng = np.random.default_rng(2)
    cache, want = make_cache("fp32", num_blocks=4), make_cache("fp32", num_blocks=4)
    k, v = random_tokens(rng, cache.layout, 3), random_tokens(rng, cache.layout, 3)
    ops.write_slots(want, 1, k, v, np.array([15, 2, 7], np.int64))
    ops.write_slots(cache, 1, k, v, np.array([15, 2, 7], dtype))
    np.testing.assert_array_equal(cache.storage, want.storage)


@pytest.mark.parametrize("n", [1, 40])  # the Python (few pairs) and the numpy checks
@pytest.mark.parametrize("big", [U64_MAX, 2**63])
def test_copy_and_swap_uint64_beyond_int64_are_refused(n, big):
    """uint64 pairs beyond int64 were cast to negative blocks (refused, naming a wrong block)."""
    cache = make_cache(num_blocks=100)
    pairs = np.stack([np.arange(n), np.arange(n) + 50], axis=1).astype(np.uint64)
    pairs[-1, 0] = big
    before = cache.storage.copy()
    with pytest.raises(InvalidArgumentError, match=f"{big} is beyond int64"):
        ops.copy_blocks(cache, pairs)
    with pytest.raises(InvalidArgumentError, match=f"{big} is beyond int64"):
        ops.swap_blocks(cache, make_cache(num_blocks=100), pairs)
    with pytest.raises(InvalidArgumentError, match="outside int64"):
        ops.copy_blocks(cache, pairs.tolist())
    np.testing.assert_array_equal(cache.storage, before)
    pairs[-1, 0] = 99  # in range: unsigned pairs still work, same as signed ones
    ops.copy_blocks(cache, pairs)
    np.testing.assert_array_equal(cache.storage, ref_copy(before, True, pairs[:, 0], pairs[:, 1]))


def test_gather_uint64_block_table_beyond_int64_is_refused():
    """A uint64 block table entry 2**64 - 1 was reported as block -1."""
    cache = make_cache(num_blocks=4)
    with pytest.raises(InvalidArgumentError, match="18446744073709551615 is beyond int64"):
        ops.gather(cache, 0, np.array([1, U64_MAX], np.uint64), 5)
    with pytest.raises(InvalidArgumentError, match="outside int64"):
        ops.gather(cache, 0, [1, 2**64], 5)
    with pytest.raises(InvalidTypeError, match="integer dtype"):
        ops.gather(cache, 0, np.array([1.0, 2.0]), 5)
    k, _ = ops.gather(cache, 0, np.array([1, 2], np.uint64), 5)
    k2, _ = ops.gather(cache, 0, np.array([1, 2]), 5)
    np.testing.assert_array_equal(k, k2)


def test_merge_runs_refuses_wrapping_and_float_input():
    """merge_runs cast with np.asarray(dtype=int64): uint64 wrapped, floats truncated."""
    with pytest.raises(InvalidArgumentError, match="beyond int64"):
        ops.merge_runs(np.array([U64_MAX], np.uint64), np.array([1]))
    with pytest.raises(InvalidTypeError, match="integer dtype"):
        ops.merge_runs(np.array([1.5]), np.array([1]))
    with pytest.raises(InvalidArgumentError, match="1-D of one length"):
        ops.merge_runs(np.array([1, 2]), np.array([1]))
    s, d, n = ops.merge_runs(np.array([3, 4], np.uint64), np.array([7, 8], np.uint32))
    assert (s.tolist(), d.tolist(), n.tolist()) == ([3], [7], [2])


def test_gather_rejects():
    cache = make_cache(num_blocks=4)
    before = cache.storage.copy()
    with pytest.raises(InvalidArgumentError, match="need 2 blocks"):
        ops.gather(cache, 0, np.array([1]), 5)
    with pytest.raises(InvalidArgumentError, match="block 4 out of range"):
        ops.gather(cache, 0, np.array([1, 4]), 5)
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        ops.gather(cache, 0, np.array([1]), -1)
    with pytest.raises(InvalidTypeError):
        ops.gather(cache, 0, np.array([1]), 2.5)
    with pytest.raises(InvalidArgumentError, match="1-D"):
        ops.gather(cache, 0, np.array([[1]]), 1)
    with pytest.raises(InvalidArgumentError, match="layer"):
        ops.gather(cache, 7, np.array([1]), 1)
    k, _ = ops.gather(cache, 0, np.array([1, 99]), 4)  # unused padding entries are not read
    assert k.shape[0] == 4
    np.testing.assert_array_equal(cache.storage, before)


def test_errors_are_kvblocks_errors():
    cache = make_cache()
    with pytest.raises(KVBlocksError):
        ops.copy_blocks(cache, [(0, 99)])
    with pytest.raises(ValueError):
        ops.copy_blocks(cache, [(0, 99)])


# ---------------------------------------------------------------------------------------------
# CUDA kernel arguments, checked on the CPU: replay the kernels' byte arithmetic in Python
# with the geometry ops._layer_geometry passes them, and compare with the numpy path.
# ---------------------------------------------------------------------------------------------
def emulate_token_kernel(cache, layer, k, v, index, num_tokens, op):
    ck, cv, row, block_stride, token_stride, head_stride = ops._layer_geometry(cache, layer)
    lay, buf, base = cache.layout, cache._raw, cache.data_ptr
    w = kvblocks._cuda.vector_width(ck, cv, row, block_stride, token_stride, head_stride)
    assert row % w == 0 and head_stride % w == 0  # what the kernel's word indexing relies on
    kb = k.view(np.uint8).reshape(num_tokens, lay.num_kv_heads, row)
    vb = v.view(np.uint8).reshape(num_tokens, lay.num_kv_heads, row)
    for t in range(num_tokens):
        if op == "write_slots":
            if index[t] < 0:
                continue
            blk, off = divmod(int(index[t]), lay.block_size)
        else:
            blk, off = int(index[t // lay.block_size]), t % lay.block_size
        for h in range(lay.num_kv_heads):
            o = blk * block_stride + off * token_stride + h * head_stride
            for ptr, tok in ((ck, kb), (cv, vb)):
                at = ptr - base + o
                if op == "write_slots":
                    buf[at : at + row] = tok[t, h]
                else:
                    tok[t, h] = buf[at : at + row]


@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", ["bf16", "fp32", "fp8_e4m3"])
def test_cuda_token_geometry_emulated(dtype, kind, joint):
    rng = np.random.default_rng(9)
    cache = make_cache(dtype, kind, joint, num_blocks=6, heads=3, dim=5)
    twin = make_cache(dtype, kind, joint, num_blocks=6, heads=3, dim=5)
    lay = cache.layout
    n = 9
    slots = rng.choice(6 * lay.block_size, size=n, replace=False)
    slots[4] = -1
    k, v = random_tokens(rng, lay, n), random_tokens(rng, lay, n)
    for layer in range(lay.num_layers):
        ops.write_slots(cache, layer, k, v, slots)
        emulate_token_kernel(twin, layer, k, v, slots, n, "write_slots")
        np.testing.assert_array_equal(twin.storage, cache.storage)
        table = rng.permutation(6)[:3]
        kg, vg = np.empty_like(k), np.empty_like(v)
        emulate_token_kernel(cache, layer, kg, vg, table, n, "gather")
        kc, vc = ops.gather(cache, layer, table, n)
        np.testing.assert_array_equal(kg, kc)
        np.testing.assert_array_equal(vg, vc)
