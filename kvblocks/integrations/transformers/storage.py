"""Storage conversion for :class:`PagedKVCache`: torch dtypes to kvblocks storage dtypes, torch
tensors to and from the arrays :mod:`kvblocks.ops` reads and writes (numpy, or CuPy for CUDA
storage), and the :class:`kvblocks.KVCache` the caches made from one another share."""

from __future__ import annotations

import itertools
from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from transformers.cache_utils import Cache

from ...errors import InvalidTypeError
from ...layout import KVLayout
from ...storage import KVCache

# torch dtype -> (kvblocks dtype name, torch dtype of the raw storage view)
_TORCH_DTYPES: Dict[torch.dtype, Tuple[str, torch.dtype]] = {
    torch.float32: ("fp32", torch.float32),
    torch.float16: ("fp16", torch.float16),
    torch.bfloat16: ("bf16", torch.int16),
}
for _name, _kv in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):
    if hasattr(torch, _name):
        _TORCH_DTYPES[getattr(torch, _name)] = (_kv, torch.uint8)
_NUMPY_OF_RAW = {torch.int16: np.uint16, torch.uint8: np.uint8}


def _torch_dtype(dtype: Any) -> torch.dtype:
    """A torch dtype from a torch dtype or its name (``"float16"``, ``"bf16"``, ...)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES:
            raise InvalidTypeError(f"unsupported KV dtype {dtype}")
        return dtype
    if isinstance(dtype, str):
        names = {
            "fp32": "float32",
            "float": "float32",
            "fp16": "float16",
            "half": "float16",
            "bf16": "bfloat16",
            "fp8": "float8_e4m3fn",
            "fp8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2",
        }
        t = getattr(torch, names.get(dtype.lower(), dtype.lower()), None)
        if isinstance(t, torch.dtype) and t in _TORCH_DTYPES:
            return t
    raise InvalidTypeError(f"unsupported KV dtype {dtype!r}")


def dynamic_cache_bytes(cache: Any) -> int:
    """K/V bytes held by a transformers ``DynamicCache`` (the baseline for :meth:`PagedKVCache.kv_bytes_held`)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class _Shared:
    """What the caches made from one another by ``copy.deepcopy`` share: one BlockManager (so
    one prefix cache), one K/V storage and one counter of sequence ids."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.kv: Optional[KVCache] = None  # allocated on the first update (dtype None)
        self.ids = itertools.count()  # sequence ids, unique in the manager
        self.store_dtype: Optional[torch.dtype] = None
        self.raw_dtype: Optional[torch.dtype] = None  # torch dtype of the raw storage view


class PagedStorage(Cache):
    """The storage side of a :class:`PagedKVCache`: its manager, its K/V storage (allocated in
    the dtype of the first update when none was given) and the conversions to and from it."""

    device: str  #: "cpu" or "cuda:N"
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int  #: tokens per block
    num_blocks: int
    layers_per_block: int  #: layers one block holds K and V for
    _shared: _Shared

    @property
    def manager(self) -> Any:
        """The :class:`kvblocks.BlockManager` (shared with deep copies of this cache)."""
        return self._shared.manager

    @property
    def kv(self) -> Optional[KVCache]:
        """The :class:`kvblocks.KVCache` storage (``None`` until the first forward pass when
        ``dtype`` is None)."""
        return self._shared.kv

    def _allocate(self, dtype: torch.dtype) -> None:
        name, raw = _TORCH_DTYPES[dtype]
        layout = KVLayout(
            self.layers_per_block, self.num_kv_heads, self.head_dim, self.block_size, name
        )
        sh = self._shared
        sh.kv = KVCache(layout, self.num_blocks, device=self.device)
        sh.store_dtype = dtype
        sh.raw_dtype = raw

    @property
    def _storage(self) -> KVCache:
        """The K/V storage, allocated by the first update."""
        kv = self._shared.kv
        assert kv is not None, "storage is allocated by the first update"
        return kv

    def _to_storage(self, t: torch.Tensor) -> Any:
        """[N, H, D] torch tensor -> array accepted by kvblocks.ops (numpy / CuPy, storage dtype)."""
        sh = self._shared
        assert sh.store_dtype is not None and sh.raw_dtype is not None
        t = t.detach().to(device=self.device, dtype=sh.store_dtype)
        raw = t.view(sh.raw_dtype) if sh.raw_dtype is not sh.store_dtype else t
        if self._storage.is_cuda:
            from ..._cuda import get_cupy

            cp = get_cupy()
            a = cp.from_dlpack(raw.contiguous())
            return a.view(_NUMPY_OF_RAW[sh.raw_dtype]) if raw.dtype in _NUMPY_OF_RAW else a
        a = raw.numpy()
        return a.view(_NUMPY_OF_RAW[sh.raw_dtype]) if raw.dtype in _NUMPY_OF_RAW else a

    def _from_storage(self, a: Any) -> torch.Tensor:
        """numpy / CuPy array in the storage dtype -> torch tensor of the storage dtype."""
        sh = self._shared
        assert sh.store_dtype is not None and sh.raw_dtype is not None
        if sh.raw_dtype is not sh.store_dtype:
            a = a.view(np.int16 if sh.raw_dtype is torch.int16 else np.uint8)
        t = torch.from_dlpack(a) if self._storage.is_cuda else torch.from_numpy(a)
        return t.view(sh.store_dtype) if sh.raw_dtype is not sh.store_dtype else t

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block: ``layers_per_block`` layers (every layer when all are full
        attention); 0 before the storage dtype is known."""
        return 0 if self.kv is None else self.kv.layout.bytes_per_block
