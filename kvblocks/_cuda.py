"""CuPy loading and the compiled CUDA kernels of kvblocks (private).

Nothing here runs at ``import kvblocks``: CuPy is imported on the first call that needs it,
and ``kvblocks/cuda/kvblocks_ops.cu`` is compiled with NVRTC (``cupy.RawModule``) on first
use, once per device, then cached. Installing kvblocks needs neither nvcc nor a GPU.

>>> from kvblocks import _cuda
>>> isinstance(_cuda.cuda_available(), bool)
True
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any, Dict, Optional

from .errors import DeviceError

__all__ = ["get_cupy", "cuda_available", "get_kernel", "vector_width", "pinned_empty"]

_lock = threading.Lock()
_cupy: Any = None
_modules: Dict[int, Any] = {}
_SOURCE = "kvblocks_ops.cu"


def get_cupy() -> Any:
    """Return the ``cupy`` module, or raise :class:`DeviceError` if CuPy or a device is missing."""
    global _cupy
    if _cupy is not None:
        return _cupy
    try:
        import cupy  # noqa: PLC0415 (lazy on purpose)
    except Exception as exc:  # ImportError, or a broken CUDA install failing at import
        raise DeviceError(
            "device='cuda' needs CuPy and a CUDA device; install kvblocks[cuda] "
            f"(cupy-cuda12x). CuPy import failed: {exc}"
        ) from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        raise DeviceError(
            f"device='cuda' needs CuPy and a CUDA device; CUDA reports no device: {exc}"
        ) from None
    if count < 1:
        raise DeviceError("device='cuda' needs CuPy and a CUDA device; no CUDA device found")
    _cupy = cupy
    return cupy


def cuda_available() -> bool:
    """True when CuPy imports and at least one CUDA device is visible (imports CuPy if installed)."""
    if _cupy is not None:
        return True
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        get_cupy()
    except DeviceError:
        return False
    return True


def pinned_empty(nbytes: int) -> Optional[Any]:
    """A page-locked host ``uint8`` numpy array of ``nbytes``, or None without CuPy/device."""
    if not cuda_available():
        return None
    import numpy as np  # noqa: PLC0415

    cp = _cupy
    mem = cp.cuda.alloc_pinned_memory(max(nbytes, 1))
    arr = np.frombuffer(mem, dtype=np.uint8, count=nbytes)  # keeps `mem` alive via .base
    return arr


def _read_source() -> str:
    from importlib import resources  # noqa: PLC0415

    try:
        return resources.files("kvblocks").joinpath("cuda", _SOURCE).read_text()
    except AttributeError:  # Python < 3.9 fallback (not supported, but be kind)
        import os  # noqa: PLC0415

        with open(os.path.join(os.path.dirname(__file__), "cuda", _SOURCE)) as f:
            return f.read()


def _module() -> Any:
    cp = get_cupy()
    dev = cp.cuda.runtime.getDevice()
    mod = _modules.get(dev)
    if mod is None:
        with _lock:
            mod = _modules.get(dev)
            if mod is None:
                mod = cp.RawModule(code=_read_source(), options=("--std=c++14",))
                _modules[dev] = mod
    return mod


def get_kernel(name: str) -> Any:
    """The compiled kernel ``name`` (a ``cupy.RawKernel``) for the current device."""
    return _module().get_function(name)


def vector_width(*values: int) -> int:
    """Largest of 16, 8, 4, 2, 1 bytes dividing every value (sizes, strides, pointers).

    >>> vector_width(4096, 256, 1 << 20)
    16
    >>> vector_width(4096, 6)
    2
    """
    for w in (16, 8, 4, 2):
        if all(int(v) % w == 0 for v in values):
            return w
    return 1
