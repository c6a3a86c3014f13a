"""kvblocks.ops on CUDA (CuPy), compared bit for bit with the numpy implementation.

Skipped cleanly without CuPy or a CUDA device. Run: ``pytest -m gpu tests/test_ops_gpu.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvblocks import DeviceError, InvalidArgumentError, InvalidTypeError, KVCache, KVLayout, ops

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy")
try:
    if cp.cuda.runtime.getDeviceCount() < 1:
        pytest.skip("no CUDA device", allow_module_level=True)
except Exception as exc:  # CUDA driver missing or broken
    pytest.skip(f"no CUDA device: {exc}", allow_module_level=True)

DTYPES = ["bf16", "fp16", "fp32", "fp8_e4m3"]
LAYOUTS = [(kind, joint) for kind in ("NHD", "HND") for joint in (True, False)]
# head_dim 8 gives 16-byte rows (vectorised path) for 16-bit dtypes; 3 forces narrow words
GEOMETRIES = [
    dict(layers=3, heads=2, dim=8, block_size=4),
    dict(layers=2, heads=3, dim=3, block_size=5),
]


def twins(dtype="fp16", kind="NHD", joint=True, num_blocks=24, seed=0, geometry=None, pinned=False):
    """(cpu cache, cuda cache) with identical random bytes."""
    g = geometry or GEOMETRIES[0]
    lay = KVLayout(
        g["layers"], g["heads"], g["dim"], g["block_size"], dtype, kind=kind, joint=joint
    )
    cpu = KVCache(lay, num_blocks, pin_memory=pinned)
    rng = np.random.default_rng(seed)
    cpu.planes[...] = rng.integers(0, 256, cpu.planes.shape, dtype=np.uint8)
    gpu = KVCache(lay, num_blocks, device="cuda")
    gpu.planes[...] = cp.asarray(cpu.planes)
    return cpu, gpu


def same(cpu: KVCache, gpu: KVCache) -> None:
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(cp.asnumpy(gpu.planes), cpu.planes)


def random_pairs(rng, num_blocks, n, n_dst_blocks=None, disjoint=True):
    n_dst_blocks = n_dst_blocks or num_blocks
    dst = rng.choice(n_dst_blocks, size=n, replace=False)
    pool = np.setdiff1d(np.arange(num_blocks), dst) if disjoint else np.arange(num_blocks)
    return np.stack([rng.choice(pool, size=n), dst], axis=1)


def test_cuda_cache_basics():
    cpu, gpu = twins()
    assert gpu.is_cuda and gpu.device == "cuda:0" and gpu.xp is cp
    assert isinstance(gpu.storage, cp.ndarray) and gpu.storage.shape == cpu.storage.shape
    assert KVCache(cpu.layout, 2).pinned  # CuPy + device: CPU caches are page-locked by default
    assert not KVCache(cpu.layout, 2, pin_memory=False).pinned


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_matches_numpy(dtype, kind, joint, geometry):
    rng = np.random.default_rng(1)
    cpu, gpu = twins(dtype, kind, joint, geometry=geometry)
    for n in (1, 2, 11):
        pairs = random_pairs(rng, 24, n)
        ops.copy_blocks(cpu, pairs)
        ops.copy_blocks(gpu, pairs)
        same(cpu, gpu)
    pairs = random_pairs(rng, 24, 5)
    ops.copy_blocks(gpu, cp.asarray(pairs.astype(np.int32)))  # device-resident pairs
    ops.copy_blocks(cpu, pairs)
    same(cpu, gpu)


def test_copy_blocks_many_pairs_large_blocks():
    rng = np.random.default_rng(2)
    g = dict(layers=4, heads=8, dim=128, block_size=16)  # 64 KiB per plane block: chunked grid
    cpu, gpu = twins("bf16", geometry=g, num_blocks=64)
    for n in (1, 3, 30):
        pairs = random_pairs(rng, 64, n)
        ops.copy_blocks(cpu, pairs)
        ops.copy_blocks(gpu, pairs)
        same(cpu, gpu)


def test_copy_blocks_errors_change_nothing():
    cpu, gpu = twins()
    before = cp.asnumpy(gpu.planes)
    for bad in ([(0, 24)], [(1, 2), (3, 2)], [(1, 2), (2, 3)]):
        with pytest.raises(InvalidArgumentError):
            ops.copy_blocks(gpu, bad)
    np.testing.assert_array_equal(cp.asnumpy(gpu.planes), before)


@pytest.mark.parametrize("method", ["memcpy", "kernel", "auto"])
@pytest.mark.parametrize("kind, joint", LAYOUTS)
def test_swap_blocks_matches_numpy(kind, joint, method):
    rng = np.random.default_rng(3)
    cpu_dev, gpu_dev = twins("bf16", kind, joint, num_blocks=40, seed=1)
    host_ref = KVCache(cpu_dev.layout, 16, pin_memory=False)
    host = KVCache(cpu_dev.layout, 16, pin_memory=True)
    host.planes[...] = host_ref.planes
    stream = cp.cuda.Stream(non_blocking=True)
    for n in (1, 6, 16):
        out = random_pairs(rng, 40, n, n_dst_blocks=16, disjoint=False)
        if n == 6:
            out[:, 0] = np.arange(10, 16)  # consecutive runs merge
            out[:, 1] = np.arange(3, 9)
        ops.swap_blocks(gpu_dev, host, out, stream=stream, method=method)
        ops.swap_blocks(cpu_dev, host_ref, out)
        stream.synchronize()
        np.testing.assert_array_equal(host.planes, host_ref.planes)
        back = np.stack([out[:, 1], rng.choice(40, size=n, replace=False)], axis=1)
        ops.swap_blocks(host, gpu_dev, back, stream=stream, method=method)
        ops.swap_blocks(host_ref, cpu_dev, back)
        stream.synchronize()
        same(cpu_dev, gpu_dev)


def test_swap_blocks_device_to_device_and_pitch_fallback(monkeypatch):
    rng = np.random.default_rng(4)
    cpu_a, gpu_a = twins(seed=1, num_blocks=20)
    cpu_b, gpu_b = twins(seed=2, num_blocks=12)
    pairs = random_pairs(rng, 20, 7, n_dst_blocks=12, disjoint=False)
    ops.swap_blocks(gpu_a, gpu_b, pairs)
    ops.swap_blocks(cpu_a, cpu_b, pairs)
    same(cpu_b, gpu_b)
    monkeypatch.setitem(ops._MAX_PITCH, 0, 1)  # force one 1-D memcpy per plane
    pairs = random_pairs(rng, 20, 5, n_dst_blocks=12, disjoint=False)
    ops.swap_blocks(gpu_a, gpu_b, pairs, method="memcpy")
    ops.swap_blocks(cpu_a, cpu_b, pairs)
    same(cpu_b, gpu_b)


def test_swap_blocks_pageable_host_memcpy():
    rng = np.random.default_rng(5)
    cpu_dev, gpu_dev = twins(num_blocks=10)
    host = KVCache(cpu_dev.layout, 10, pin_memory=False)
    ref = KVCache(cpu_dev.layout, 10, pin_memory=False)
    pairs = random_pairs(rng, 10, 4, disjoint=False)
    ops.swap_blocks(gpu_dev, host, pairs)  # auto -> memcpy (pageable host is not device-mapped)
    ops.swap_blocks(cpu_dev, ref, pairs)
    cp.cuda.get_current_stream().synchronize()
    np.testing.assert_array_equal(host.planes, ref.planes)
    with pytest.raises(DeviceError):
        ops.swap_blocks(gpu_dev, host, pairs, method="kernel")


@pytest.mark.parametrize("geometry", GEOMETRIES)
@pytest.mark.parametrize("kind, joint", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_slots_and_gather_match_numpy(dtype, kind, joint, geometry):
    rng = np.random.default_rng(6)
    cpu, gpu = twins(dtype, kind, joint, geometry=geometry, num_blocks=8)
    lay = cpu.layout
    n = 13
    slots = rng.choice(8 * lay.block_size, size=n, replace=False)
    slots[[0, 7]] = -1
    raw = rng.integers(0, 256, (2, n) + lay.token_shape + (lay.itemsize,), dtype=np.uint8)
    k, v = raw.view(lay.storage_dtype).reshape((2, n) + lay.token_shape)
    for layer in range(lay.num_layers):
        ops.write_slots(cpu, layer, k, v, slots)
        ops.write_slots(
            gpu, layer, cp.asarray(k), cp.asarray(v), cp.asarray(slots), check=(layer == 0)
        )
        same(cpu, gpu)
    table = rng.permutation(8)[:4].astype(np.int32)
    for num_tokens in (0, 1, lay.block_size, 3 * lay.block_size + 1):
        for layer in range(lay.num_layers):
            kc, vc = ops.gather(cpu, layer, table, num_tokens)
            kg, vg = ops.gather(gpu, layer, cp.asarray(table), num_tokens)
            assert isinstance(kg, cp.ndarray) and kg.flags.c_contiguous
            np.testing.assert_array_equal(cp.asnumpy(kg), kc)
            np.testing.assert_array_equal(cp.asnumpy(vg), vc)


def test_write_slots_non_contiguous_input():
    rng = np.random.default_rng(7)
    cpu, gpu = twins("fp32", num_blocks=4)
    lay = cpu.layout
    big = rng.standard_normal((6,) + lay.token_shape).astype(np.float32)
    k, v = big[::2], big[1::2]
    slots = np.array([0, 5, 9])
    ops.write_slots(cpu, 0, k, v, slots)
    gbig = cp.asarray(big)
    ops.write_slots(gpu, 0, gbig[::2], gbig[1::2], slots)
    same(cpu, gpu)


def test_device_mismatch_and_errors_change_nothing():
    cpu, gpu = twins("fp16", num_blocks=4)
    lay = cpu.layout
    k = np.zeros((2,) + lay.token_shape, np.float16)
    before = cp.asnumpy(gpu.planes)
    with pytest.raises(DeviceError):
        ops.write_slots(gpu, 0, k, k, np.array([0, 1]))
    with pytest.raises(DeviceError):
        ops.write_slots(cpu, 0, cp.asarray(k), cp.asarray(k), np.array([0, 1]))
    with pytest.raises(InvalidTypeError):
        ops.write_slots(gpu, 0, cp.asarray(k, dtype=cp.float32), cp.asarray(k), np.array([0, 1]))
    with pytest.raises(InvalidArgumentError):
        ops.write_slots(gpu, 0, cp.asarray(k), cp.asarray(k), cp.asarray([1, 1]))
    with pytest.raises(InvalidArgumentError):
        ops.swap_blocks(gpu, KVCache(KVLayout(2, 2, 8, 4, "fp16"), 4), [(0, 0)])
    np.testing.assert_array_equal(cp.asnumpy(gpu.planes), before)


def test_write_slots_unchecked_uint64_device_slots_are_refused():
    """check=False never reads the slots: a uint64 2**64 - 1 would wrap to -1 (padding)."""
    cpu, gpu = twins("fp16", num_blocks=4)
    lay = cpu.layout
    k = cp.zeros((2,) + lay.token_shape, cp.float16)
    before = cp.asnumpy(gpu.planes)
    bad = cp.asarray(np.array([2**64 - 1, 1], np.uint64))
    with pytest.raises(InvalidTypeError, match="uint64"):
        ops.write_slots(gpu, 0, k, k, bad, check=False)
    with pytest.raises(InvalidArgumentError, match="beyond int64"):
        ops.write_slots(gpu, 0, k, k, bad)
    np.testing.assert_array_equal(cp.asnumpy(gpu.planes), before)
    ops.write_slots(gpu, 0, k + 1, k + 1, cp.asarray([3, 1], dtype=cp.uint32), check=False)
    ops.write_slots(cpu, 0, cp.asnumpy(k) + 1, cp.asnumpy(k) + 1, np.array([3, 1]))
    same(cpu, gpu)
