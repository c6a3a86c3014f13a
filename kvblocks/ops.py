"""Device block operations on a :class:`~kvblocks.KVCache`: same semantics on CPU and CUDA.

* :func:`copy_blocks` - copy (src, dst) blocks across all layers (copy-on-write);
* :func:`swap_blocks` - move blocks between two caches (device <-> pinned host swap);
* :func:`write_slots` - scatter one layer's new K/V tokens into their slots;
* :func:`gather` - read one sequence's K/V of one layer back, contiguous.

CPU caches use numpy (vectorised fancy indexing, no per-block Python loop); CUDA caches use
CuPy: one kernel launch per call for copies and token ops, batched ``cudaMemcpy2DAsync`` (one
per run of consecutive blocks, covering every layer) or one zero-copy kernel for swaps.

Every call validates all of its input first (ranges, duplicate destinations, a destination that
is also a source, dtypes, shapes, devices, layouts) and raises a typed kvblocks error before any
byte moves: bad input changes nothing.

>>> import numpy as np
>>> from kvblocks import KVLayout, KVCache, ops
>>> cache = KVCache(KVLayout(2, 2, 4, 4, "fp32"), num_blocks=8, pin_memory=False)
>>> k = np.arange(6 * 2 * 4, dtype=np.float32).reshape(6, 2, 4)
>>> ops.write_slots(cache, 0, k, -k, np.array([4, 5, 6, 7, 8, 9]))   # blocks 1 and 2
>>> ops.copy_blocks(cache, [(1, 5), (2, 6)])
>>> k2, v2 = ops.gather(cache, 0, np.array([5, 6], dtype=np.int32), 6)
>>> bool((k2 == k).all() and (v2 == -k).all())
True
>>> ops.copy_blocks(cache, [(1, 9)])
Traceback (most recent call last):
...
kvblocks.errors.InvalidArgumentError: copy_blocks: dst block 9 out of range [0, 8)
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _cuda
from ._ops_input import (
    PairsLike,
    _check_cache,
    _check_range,
    _check_unique,
    _few_runs,
    _is_cuda_array,
    _to_host_ints,
    _validated_pairs,
)
from .errors import DeviceError, InvalidArgumentError, InvalidTypeError
from .storage import KVCache

__all__ = ["copy_blocks", "swap_blocks", "write_slots", "gather", "merge_runs"]

# CPU copies move at most this many bytes per fancy-index step, so the gather temporary stays
# in cache (measured ~1.4x faster than one whole-array fancy copy on a 2-core machine).
_CPU_CHUNK_BYTES = 1 << 20
# below this many bytes in all, one whole-cache fancy-index copy is cheaper than the plane loop
_CPU_WHOLE_BYTES = 4 << 20
# a pair set that merges into at most max(_MAX_SLICE_RUNS, n / _RUN_RATIO) runs is copied run
# by run with slices (no temporary); fewer pairs than _ops_input._SMALL_PAIRS are validated in
# Python
_RUN_RATIO = 4
_MAX_SLICE_RUNS = 4
# within one buffer, a run moving at least this many bytes per plane is copied plane by plane
_PLANE_SLICE_BYTES = 32 << 10
# CUDA swaps with more runs than this use the zero-copy kernel when both sides allow it
_SWAP_KERNEL_MIN_RUNS = 32
_THREADS = 256


def merge_runs(src: np.ndarray, dst: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge pairs into runs of consecutive src and dst blocks: ``(src_start, dst_start, length)``.

    Pairs are ordered by src first (the order of pairs with distinct destinations does not matter).

    >>> s, d, n = merge_runs(np.array([7, 3, 4, 5, 9]), np.array([1, 10, 11, 12, 2]))
    >>> s.tolist(), d.tolist(), n.tolist()
    ([3, 7, 9], [10, 1, 2], [3, 1, 1])
    """
    src = _to_host_ints(src, "src", "merge_runs")
    dst = _to_host_ints(dst, "dst", "merge_runs")
    if src.shape != dst.shape or src.ndim != 1:
        raise InvalidArgumentError(
            f"merge_runs: src and dst must be 1-D of one length, got {src.shape} and {dst.shape}"
        )
    if src.size == 0:
        e = np.empty(0, np.int64)
        return e, e, e
    if src.size > 1 and not (np.diff(src) > 0).all():
        order = np.argsort(src, kind="stable")
        src, dst = src[order], dst[order]
    brk = (np.diff(src) != 1) | (np.diff(dst) != 1)
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    lengths = np.diff(np.append(starts, src.size))
    return src[starts], dst[starts], lengths


# ---------------------------------------------------------------------------------------------
# CPU (numpy) movers
# ---------------------------------------------------------------------------------------------
def _np_move_blocks(
    src_planes: np.ndarray,
    dst_planes: np.ndarray,
    src: np.ndarray,
    dst: np.ndarray,
    lst: Optional[list],
) -> None:
    """dst_planes[:, dst] = src_planes[:, src] for [P, N, B] byte planes, cache-friendly."""
    n = len(src)
    num_planes, _, width = src_planes.shape
    runs = _few_runs(src, dst, lst, max(_MAX_SLICE_RUNS, n // _RUN_RATIO))
    if runs is not None:
        # few runs: slice copies. Within one buffer numpy sees the [:, a:a+r] and [:, b:b+r]
        # views' bounds overlap and copies through a temporary, so long runs go plane by plane.
        per_plane = src_planes is dst_planes
        for a, b, r in runs:
            if per_plane and r * width >= _PLANE_SLICE_BYTES:
                for p in range(num_planes):
                    dst_planes[p, b : b + r] = src_planes[p, a : a + r]
            else:
                dst_planes[:, b : b + r] = src_planes[:, a : a + r]
        return
    if num_planes * n * width <= _CPU_WHOLE_BYTES:
        dst_planes[:, dst] = src_planes[:, src]
        return
    per = max(1, _CPU_CHUNK_BYTES // width)  # gather temporary stays in cache
    for p in range(num_planes):
        sp, dp = src_planes[p], dst_planes[p]
        if per >= n:
            dp[dst] = sp[src]
        else:
            for i in range(0, n, per):
                dp[dst[i : i + per]] = sp[src[i : i + per]]


# ---------------------------------------------------------------------------------------------
# CUDA helpers
# ---------------------------------------------------------------------------------------------
def _cuda_stream(cp: Any, stream: Any) -> Any:
    if stream is None:
        return cp.cuda.get_current_stream()
    if isinstance(stream, int):
        return cp.cuda.ExternalStream(stream)
    return stream


def _launch_copy(
    cp: Any,
    op: str,
    src_ptr: int,
    dst_ptr: int,
    src_pitch: int,
    dst_pitch: int,
    width: int,
    num_planes: int,
    pairs_dev: Any,
    n: int,
) -> None:
    """One launch of kvb_{op}_{W}: grid (pairs, planes, chunks), W = widest aligned word."""
    w = _cuda.vector_width(src_ptr, dst_ptr, src_pitch, dst_pitch, width)
    kernel = _cuda.get_kernel(f"kvb_{op}_{w}")
    words = width // w
    ctas = n * num_planes
    chunks = 1
    if ctas < 1024:  # few pairs: split each block so the whole GPU takes part
        chunks = int(min(max(1, -(-1024 // ctas)), max(1, words // (_THREADS * 4)), 65535))
    kernel(
        (n, num_planes, chunks),
        (_THREADS,),
        (
            np.uint64(src_ptr),
            np.uint64(dst_ptr),
            pairs_dev,
            np.int64(src_pitch),
            np.int64(dst_pitch),
            np.int64(width),
        ),
    )


def _pairs_dev(cp: Any, src: np.ndarray, dst: np.ndarray) -> Any:
    """Validated pairs as a contiguous int64 [n, 2] device array (uploaded on the current stream)."""
    return cp.asarray(np.ascontiguousarray(np.stack([src, dst], axis=1), dtype=np.int64))


def _device_accessible(cache: KVCache) -> bool:
    return cache.is_cuda or cache.pinned


# ---------------------------------------------------------------------------------------------
# public operations
# ---------------------------------------------------------------------------------------------
def copy_blocks(cache: KVCache, pairs: PairsLike, *, stream: Any = None) -> None:
    """Copy every ``(src, dst)`` block pair across all layers (K and V) of ``cache``.

    ``pairs``: int32/int64 array of shape ``(n, 2)`` (numpy, CuPy or a sequence of pairs).
    A src may appear many times (one block forked to many); a dst only once, and never as a src.
    On CUDA: one kernel launch on ``stream`` (default: CuPy's current stream), asynchronous.
    """
    fn = "copy_blocks"
    _check_cache(cache, fn)
    src, dst, lst = _validated_pairs(pairs, cache.num_blocks, cache.num_blocks, True, fn)
    if src.size == 0:
        return
    if not cache.is_cuda:
        _np_move_blocks(cache.planes, cache.planes, src, dst, lst)
        return
    cp = _cuda.get_cupy()
    lay = cache.layout
    pitch = cache.num_blocks * lay.plane_block_bytes
    with cp.cuda.Device(cache.device_index), _cuda_stream(cp, stream):
        pairs_dev = _pairs_dev(cp, src, dst)
        _launch_copy(
            cp,
            "copy_blocks",
            cache.data_ptr,
            cache.data_ptr,
            pitch,
            pitch,
            lay.plane_block_bytes,
            lay.num_planes,
            pairs_dev,
            int(src.size),
        )


def swap_blocks(
    src_cache: KVCache,
    dst_cache: KVCache,
    pairs: PairsLike,
    *,
    stream: Any = None,
    method: str = "auto",
) -> None:
    """Copy block ``src`` of ``src_cache`` to block ``dst`` of ``dst_cache`` for every pair, all layers.

    Both caches must have the same layout (block counts may differ). Typical use: swap out
    device -> pinned host, swap in host -> device; CPU <-> CPU and device <-> device work too.
    On CUDA the copy is asynchronous on ``stream`` (default: CuPy's current stream) with no
    host round trip per block: pairs are merged into runs of consecutive src and dst blocks and
    each run is one ``cudaMemcpy2DAsync`` spanning every layer (``method="memcpy"``); with many
    short runs and both sides device-accessible (device or pinned host) one zero-copy kernel
    moves all of them (``method="kernel"``). ``"auto"`` picks. A pageable (unpinned) host cache
    makes the copy synchronous. Keep both caches alive until the stream is synchronised.
    """
    fn = "swap_blocks"
    _check_cache(src_cache, fn, "src_cache")
    _check_cache(dst_cache, fn, "dst_cache")
    if src_cache.layout != dst_cache.layout:
        raise InvalidArgumentError(
            f"{fn}: layouts differ: {src_cache.layout} vs {dst_cache.layout}"
        )
    if method not in ("auto", "memcpy", "kernel"):
        raise InvalidArgumentError(
            f"{fn}: method must be 'auto', 'memcpy' or 'kernel', got {method!r}"
        )
    src, dst, lst = _validated_pairs(
        pairs, src_cache.num_blocks, dst_cache.num_blocks, src_cache is dst_cache, fn
    )
    kernel_ok = (
        _device_accessible(src_cache)
        and _device_accessible(dst_cache)
        and not (
            src_cache.is_cuda
            and dst_cache.is_cuda
            and src_cache.device_index != dst_cache.device_index
        )
    )  # no peer access assumed between two devices: memcpy handles that
    if method == "kernel" and not kernel_ok:
        raise DeviceError(
            f"{fn}: method='kernel' needs device or pinned host caches on both sides, one device"
        )
    if src.size == 0:
        return
    if not src_cache.is_cuda and not dst_cache.is_cuda:
        _np_move_blocks(src_cache.planes, dst_cache.planes, src, dst, lst)
        return
    cp = _cuda.get_cupy()
    lay = src_cache.layout
    width = lay.plane_block_bytes
    s_pitch = src_cache.num_blocks * width
    d_pitch = dst_cache.num_blocks * width
    dev = (dst_cache if dst_cache.is_cuda else src_cache).device_index
    s0, d0, lens = merge_runs(src, dst)  # sorted by src: the fewest memcpy calls
    runs = list(zip(s0.tolist(), d0.tolist(), lens.tolist()))
    use_kernel = method == "kernel" or (
        method == "auto" and len(runs) > _SWAP_KERNEL_MIN_RUNS and kernel_ok
    )
    st = _cuda_stream(cp, stream)
    with cp.cuda.Device(dev), st:
        if use_kernel:
            pairs_dev = _pairs_dev(cp, src, dst)
            _launch_copy(
                cp,
                "swap_blocks",
                src_cache.data_ptr,
                dst_cache.data_ptr,
                s_pitch,
                d_pitch,
                width,
                lay.num_planes,
                pairs_dev,
                int(src.size),
            )
            return
        rt = cp.cuda.runtime
        kind = getattr(rt, "memcpyDefault", 4)
        max_pitch = _max_pitch(cp, dev)
        sp, dpp = src_cache.data_ptr, dst_cache.data_ptr
        planes = lay.num_planes
        one_2d = max(s_pitch, d_pitch) <= max_pitch
        for a, b, r in runs:
            if one_2d:
                rt.memcpy2DAsync(
                    dpp + b * width,
                    d_pitch,
                    sp + a * width,
                    s_pitch,
                    r * width,
                    planes,
                    kind,
                    st.ptr,
                )
            else:  # pitch beyond cudaMemcpy2D's limit: one 1-D copy per plane
                for p in range(planes):
                    rt.memcpyAsync(
                        dpp + p * d_pitch + b * width,
                        sp + p * s_pitch + a * width,
                        r * width,
                        kind,
                        st.ptr,
                    )


_MAX_PITCH: dict = {}


def _max_pitch(cp: Any, dev: int) -> int:
    v = _MAX_PITCH.get(dev)
    if v is None:
        try:
            v = int(cp.cuda.runtime.deviceGetAttribute(11, dev))  # cudaDevAttrMaxPitch
        except Exception:
            v = (1 << 31) - 1
        _MAX_PITCH[dev] = v
    return v


def _token_array(cache: KVCache, a: Any, name: str, fn: str) -> Any:
    """k / v input on the cache's device with the layout's storage dtype, C-contiguous."""
    if cache.is_cuda:
        if not _is_cuda_array(a):
            raise DeviceError(f"{fn}: {name} must be a CUDA array for a {cache.device} cache")
        try:
            a = _cuda.get_cupy().asarray(a)
        except Exception as exc:  # e.g. a torch bfloat16 tensor: pass .view(torch.uint16)
            raise InvalidTypeError(f"{fn}: cannot use {name} as a CuPy array: {exc}") from None
    else:
        if _is_cuda_array(a):
            raise DeviceError(f"{fn}: {name} is a CUDA array but the cache is on the CPU")
        if not isinstance(a, np.ndarray):
            raise InvalidTypeError(f"{fn}: {name} must be a numpy array, got {type(a).__name__}")
    want = cache.layout.storage_dtype
    if a.dtype != want:
        raise InvalidTypeError(
            f"{fn}: {name} dtype {a.dtype} does not match the cache ({cache.layout.dtype} "
            f"stored as {want})"
        )
    shape = (None,) + cache.layout.token_shape
    if a.ndim != 3 or tuple(a.shape[1:]) != shape[1:]:
        raise InvalidArgumentError(
            f"{fn}: {name} must have shape [num_tokens, {shape[1]}, {shape[2]}], got {tuple(a.shape)}"
        )
    return a


def _layer_geometry(cache: KVCache, layer: int) -> Tuple[int, int, int, int, int, int]:
    """(k_ptr, v_ptr, row_bytes, block_stride, token_stride, head_stride) of one layer, bytes."""
    lay = cache.layout
    width = lay.plane_block_bytes
    plane = cache.num_blocks * width
    row = lay.head_dim * lay.itemsize
    if lay.joint:
        k_ptr = cache.data_ptr + layer * plane
        v_ptr = k_ptr + lay.half_block_bytes
    else:
        k_ptr = cache.data_ptr + 2 * layer * plane
        v_ptr = k_ptr + plane
    if lay.kind == "NHD":
        token_stride, head_stride = lay.num_kv_heads * row, row
    else:
        token_stride, head_stride = row, lay.block_size * row
    return k_ptr, v_ptr, row, width, token_stride, head_stride


def write_slots(
    cache: KVCache,
    layer: int,
    k: Any,
    v: Any,
    slot_mapping: Any,
    *,
    check: bool = True,
    stream: Any = None,
) -> None:
    """Scatter ``k``, ``v`` (``[num_tokens, num_kv_heads, head_dim]``) of ``layer`` into their slots.

    ``slot_mapping[t] = block * block_size + offset`` (any integer dtype whose values fit int64;
    -1 = skip the token; floats are refused, and so is an unsigned 2**64 - 1, never read as -1). k and v
    live on the cache's device and have its storage dtype (raw ``uint16`` for bf16, ``uint8``
    for fp8). Slots must be in range and distinct. On CUDA, ``check=False`` skips the slot checks
    (which read a device slot mapping back to the host, a sync); use it only with trusted slot
    mappings, e.g. ``BlockManager.metadata``'s. The CPU path always checks.
    """
    fn = "write_slots"
    _check_cache(cache, fn)
    layer = cache._check_layer(layer)
    k = _token_array(cache, k, "k", fn)
    v = _token_array(cache, v, "v", fn)
    if k.shape != v.shape:
        raise InvalidArgumentError(
            f"{fn}: k {tuple(k.shape)} and v {tuple(v.shape)} differ in shape"
        )
    n = int(k.shape[0])
    lay = cache.layout
    num_slots = cache.num_blocks * lay.block_size
    dev_slots = slot_mapping if cache.is_cuda and _is_cuda_array(slot_mapping) else None
    if dev_slots is not None and not check:
        shape = tuple(slot_mapping.shape)
        sdt = np.dtype(slot_mapping.dtype)
        if sdt.kind not in "iu":
            raise InvalidTypeError(f"{fn}: slot_mapping must have an integer dtype, got {sdt}")
        if (
            sdt.kind == "u" and sdt.itemsize >= 8
        ):  # unread values: 2**64 - 1 would wrap to -1 (skip)
            raise InvalidTypeError(
                f"{fn}: an unchecked slot_mapping must not be {sdt} (values beyond int64 would wrap "
                f"to padding); pass int32/int64 or check=True"
            )
        if len(shape) != 1 or shape[0] != n:
            raise InvalidArgumentError(f"{fn}: slot_mapping must have shape [{n}], got {shape}")
        slots = None
    else:
        slots = _to_host_ints(slot_mapping, "slot_mapping", fn)
        if slots.ndim != 1 or slots.shape[0] != n:
            raise InvalidArgumentError(
                f"{fn}: slot_mapping must have shape [{n}], got {slots.shape}"
            )
        if (check or not cache.is_cuda) and n:  # always checked on the CPU (cheap there)
            lo, hi = int(slots.min()), int(slots.max())
            if lo < -1 or hi >= num_slots:
                bad = lo if lo < -1 else hi
                raise InvalidArgumentError(f"{fn}: slot {bad} out of range [-1, {num_slots})")
            _check_unique(slots[slots >= 0], "slot", fn)
    if n == 0:
        return
    if not cache.is_cuda:
        assert slots is not None  # host caches always check (and convert) their slots
        kview, vview = cache.kv(layer)
        valid = slots >= 0
        if not valid.all():
            slots, k, v = slots[valid], k[valid], v[valid]
        blk, off = np.divmod(slots, lay.block_size)
        if lay.kind == "NHD":
            kview[blk, off] = k
            vview[blk, off] = v
        else:
            kview[blk, :, off] = k
            vview[blk, :, off] = v
        return
    cp = _cuda.get_cupy()
    with cp.cuda.Device(cache.device_index), _cuda_stream(cp, stream):
        k = cp.ascontiguousarray(k)
        v = cp.ascontiguousarray(v)
        dslots = cp.asarray(dev_slots if dev_slots is not None else slots, dtype=cp.int64)
        _launch_tokens(cp, "write_slots", cache, layer, k.data.ptr, v.data.ptr, dslots, n)


def _launch_tokens(
    cp: Any, op: str, cache: KVCache, layer: int, k_ptr: int, v_ptr: int, index_dev: Any, n: int
) -> None:
    ck, cv, row, block_stride, token_stride, head_stride = _layer_geometry(cache, layer)
    w = _cuda.vector_width(ck, cv, k_ptr, v_ptr, row, block_stride, token_stride, head_stride)
    words = cache.layout.num_kv_heads * row // w
    threads = int(min(_THREADS, max(32, -(-words // 32) * 32)))
    kernel = _cuda.get_kernel(f"kvb_{op}_{w}")
    if op == "write_slots":
        ptrs = (np.uint64(k_ptr), np.uint64(v_ptr), np.uint64(ck), np.uint64(cv))
    else:
        ptrs = (np.uint64(ck), np.uint64(cv), np.uint64(k_ptr), np.uint64(v_ptr))
    lay = cache.layout
    kernel(
        (n,),
        (threads,),
        ptrs
        + (
            index_dev,
            np.int64(lay.block_size),
            np.int64(lay.num_kv_heads),
            np.int64(row),
            np.int64(block_stride),
            np.int64(token_stride),
            np.int64(head_stride),
        ),
    )


def gather(
    cache: KVCache, layer: int, block_table: Any, num_tokens: int, *, stream: Any = None
) -> Tuple[Any, Any]:
    """One sequence's K and V of ``layer``: new contiguous arrays ``[num_tokens, H, D]`` each.

    Token ``t`` is read from block ``block_table[t // block_size]`` at offset ``t % block_size``;
    ``block_table`` needs at least ``ceil(num_tokens / block_size)`` entries, all in range.
    """
    fn = "gather"
    _check_cache(cache, fn)
    layer = cache._check_layer(layer)
    if isinstance(num_tokens, (bool, np.bool_)) or not isinstance(num_tokens, (int, np.integer)):
        raise InvalidTypeError(f"{fn}: num_tokens must be an int, got {type(num_tokens).__name__}")
    if num_tokens < 0:
        raise InvalidArgumentError(f"{fn}: num_tokens must be >= 0, got {num_tokens}")
    lay = cache.layout
    bt = _to_host_ints(block_table, "block_table", fn)
    if bt.ndim != 1:
        raise InvalidArgumentError(f"{fn}: block_table must be 1-D, got shape {bt.shape}")
    nb = -(-int(num_tokens) // lay.block_size)
    if bt.size < nb:
        raise InvalidArgumentError(
            f"{fn}: {num_tokens} tokens need {nb} blocks, block_table has {bt.size}"
        )
    bt = bt[:nb]
    _check_range(bt, cache.num_blocks, "block", fn)
    n = int(num_tokens)
    shape = (n,) + lay.token_shape
    if not cache.is_cuda:
        kview, vview = cache.kv(layer)
        out = []
        for view in (kview, vview):
            g = view[bt]  # [nb, *block_shape], a fresh array
            if lay.kind == "HND":
                g = g.transpose(0, 2, 1, 3)
            out.append(
                np.ascontiguousarray(g.reshape((nb * lay.block_size,) + lay.token_shape)[:n])
            )
        return out[0], out[1]
    cp = _cuda.get_cupy()
    with cp.cuda.Device(cache.device_index), _cuda_stream(cp, stream):
        k_out = cp.empty(shape, dtype=lay.storage_dtype)
        v_out = cp.empty(shape, dtype=lay.storage_dtype)
        if n:
            bt_dev = cp.asarray(bt)
            _launch_tokens(cp, "gather", cache, layer, k_out.data.ptr, v_out.data.ptr, bt_dev, n)
    return k_out, v_out
