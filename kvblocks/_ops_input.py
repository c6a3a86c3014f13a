"""The input side of :mod:`kvblocks.ops`: normalisation and validation on the host, before any
byte moves (integer arrays from numpy, lists or CuPy checked against int64, (src, dst) pairs in
range, without duplicate destinations or a destination that is also a source), and the runs of
consecutive blocks a small pair set merges into."""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import numpy as np

from . import _cuda
from .errors import DeviceError, InvalidArgumentError, InvalidTypeError
from .storage import KVCache

PairsLike = Union[np.ndarray, Sequence[Tuple[int, int]], Any]

# fewer pairs than this are validated in Python (lists, no numpy temporaries)
_SMALL_PAIRS = 32
_INT64_MAX = (1 << 63) - 1


# ---------------------------------------------------------------------------------------------
# input normalisation and validation (host side, before anything moves)
# ---------------------------------------------------------------------------------------------
def _is_cuda_array(a: Any) -> bool:
    return hasattr(a, "__cuda_array_interface__")


def _to_host_ints(a: Any, what: str, fn: str) -> np.ndarray:
    """Any integer array-like (numpy, list, CuPy) -> host numpy int64 array, checked.

    Floats, bools and objects are refused (InvalidTypeError); so are values no int64 holds
    (InvalidArgumentError): an unsigned 2**64 - 1 must not wrap to -1, nor a list holding
    2**63 turn into floats that round. Nothing here mutates anything.
    """
    if _is_cuda_array(a):
        try:
            a = _cuda.get_cupy().asnumpy(a)
        except DeviceError:
            raise
        except Exception as exc:  # e.g. a torch CUDA tensor of an exotic dtype
            raise InvalidTypeError(f"{fn}: cannot read {what}: {exc}") from None
    try:
        arr = np.asarray(a)
    except Exception as exc:
        raise InvalidTypeError(f"{fn}: {what} must be an integer array: {exc}") from None
    if arr.size == 0:
        return arr.astype(np.int64)
    kind = arr.dtype.kind
    if kind in "fO" and not isinstance(a, np.ndarray):
        # a Python sequence numpy could not type as integers: huge ints become float64 or
        # object; name the value int64 cannot hold rather than the dtype numpy picked
        try:
            np.asarray(a, dtype=np.int64)
        except OverflowError:
            raise InvalidArgumentError(f"{fn}: {what} holds a value outside int64") from None
        except Exception:
            pass
    if kind not in "iu":
        raise InvalidTypeError(f"{fn}: {what} must have an integer dtype, got {arr.dtype}")
    if kind == "u" and arr.dtype.itemsize >= 8:
        top = int(arr.max())
        if top > _INT64_MAX:
            raise InvalidArgumentError(f"{fn}: {what} value {top} is beyond int64 (it would wrap)")
    return arr.astype(np.int64, copy=False)


def _check_cache(cache: Any, fn: str, name: str = "cache") -> KVCache:
    if not isinstance(cache, KVCache):
        raise InvalidTypeError(f"{fn}: {name} must be a KVCache, got {type(cache).__name__}")
    return cache


def _pairs_array(pairs: PairsLike, fn: str) -> np.ndarray:
    """pairs -> host integer array of shape (n, 2) (n may be 0)."""
    if isinstance(pairs, np.ndarray) and (
        pairs.dtype.kind == "i" or (pairs.dtype.kind == "u" and pairs.dtype.itemsize < 8)
    ):
        arr = pairs  # fast path: no conversion (no value of these dtypes wraps in int64)
    else:
        arr = _to_host_ints(pairs, "pairs", fn)
    if arr.size == 0:
        return np.empty((0, 2), np.int64)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise InvalidArgumentError(f"{fn}: pairs must have shape (n, 2), got {arr.shape}")
    return arr


def _validate_small(lst: list, n_src: int, n_dst: int, same: bool, fn: str) -> None:
    """Python-level checks for a few pairs (cheaper than a dozen numpy calls)."""
    srcs = [p[0] for p in lst]
    dsts = [p[1] for p in lst]
    if min(srcs) < 0 or max(srcs) >= n_src:
        bad = next(x for x in srcs if not 0 <= x < n_src)
        raise InvalidArgumentError(f"{fn}: src block {bad} out of range [0, {n_src})")
    if min(dsts) < 0 or max(dsts) >= n_dst:
        bad = next(x for x in dsts if not 0 <= x < n_dst)
        raise InvalidArgumentError(f"{fn}: dst block {bad} out of range [0, {n_dst})")
    seen = set(dsts)
    if len(seen) != len(dsts):
        _check_unique(np.array(dsts), "dst block", fn)
    if same and not seen.isdisjoint(srcs):
        bad = next(x for x in srcs if x in seen)
        raise InvalidArgumentError(
            f"{fn}: block {bad} is both a src and a dst; chain copies in separate calls"
        )


def _runs_small(lst: list) -> list:
    """[(src_start, dst_start, length)] for a few pairs (see merge_runs)."""
    runs: list = []
    for s, d in sorted(lst):
        if runs and s == runs[-1][0] + runs[-1][2] and d == runs[-1][1] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([s, d, 1])
    return runs


def _validated_pairs(
    pairs: PairsLike, n_src: int, n_dst: int, same: bool, fn: str
) -> Tuple[np.ndarray, np.ndarray, Optional[list]]:
    """Validate everything about ``pairs``: (src, dst, pairs as a list when there are few)."""
    arr = _pairs_array(pairs, fn)
    n = arr.shape[0]
    if n == 0:
        return arr[:, 0], arr[:, 1], []
    if n <= _SMALL_PAIRS:
        lst = arr.tolist()
        _validate_small(lst, n_src, n_dst, same, fn)
        return arr[:, 0], arr[:, 1], lst
    src = arr[:, 0].astype(np.int64)
    dst = arr[:, 1].astype(np.int64)
    _check_range(src, n_src, "src block", fn)
    _check_range(dst, n_dst, "dst block", fn)
    mark = np.zeros(n_dst, dtype=bool)
    mark[dst] = True
    if np.count_nonzero(mark) != n:
        _check_unique(dst, "dst block", fn)  # finds and names the duplicate
    if same:
        clash = mark[src]
        if clash.any():
            b = int(src[np.argmax(clash)])
            raise InvalidArgumentError(
                f"{fn}: block {b} is both a src and a dst; chain copies in separate calls"
            )
    return src, dst, None


def _few_runs(
    src: np.ndarray, dst: np.ndarray, lst: Optional[list], max_runs: int
) -> Optional[list]:
    """Runs [(src_start, dst_start, length)] of the pairs in the given order, or None if more
    than ``max_runs`` (then a fancy-index copy is cheaper). No sort: cheap on every call."""
    if lst is not None:
        runs = _runs_small(lst)
        return runs if len(runs) <= max_runs else None
    brk = (np.diff(src) != 1) | (np.diff(dst) != 1)
    if np.count_nonzero(brk) + 1 > max_runs:
        return None
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    lens = np.diff(np.append(starts, src.size))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lens.tolist()))


def _check_range(idx: np.ndarray, n: int, what: str, fn: str) -> None:
    if idx.size == 0:
        return
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise InvalidArgumentError(f"{fn}: {what} {bad} out of range [0, {n})")


def _check_unique(idx: np.ndarray, what: str, fn: str) -> None:
    if idx.size < 2:
        return
    s = np.sort(idx)
    dup = np.flatnonzero(s[1:] == s[:-1])
    if dup.size:
        raise InvalidArgumentError(f"{fn}: {what} {int(s[dup[0]])} appears more than once")
