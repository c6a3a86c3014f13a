"""KV cache storage: :class:`KVCache`, the K and V bytes of every block of every layer.

One contiguous buffer holds the whole cache, numpy on ``"cpu"``, CuPy on ``"cuda"``:

* joint (default): ``storage`` is ``[num_layers, num_blocks, 2, *block_shape]``, so
  ``cache.layer(l)`` is the FlashInfer paged tensor ``[num_blocks, 2, *block_shape]``;
* split (``KVLayout(..., joint=False)``): ``storage`` is ``[num_layers, 2, num_blocks, *block_shape]``,
  so ``cache.key(l)`` and ``cache.value(l)`` are contiguous vLLM-style ``[num_blocks, *block_shape]``.

``block_shape`` is ``[block_size, H, D]`` (NHD) or ``[H, block_size, D]`` (HND). Every per-layer
accessor returns a zero-copy view. The same buffer seen as ``planes`` ``[P, num_blocks, B]``
bytes (P = layers for joint, 2 x layers for split) is what block copies and swaps move.

A ``"cpu"`` cache is page-locked (CuPy's pinned allocator) when CuPy and a CUDA device are
present, so device <-> host swaps run asynchronously; pass ``pin_memory=False`` to opt out.

>>> from kvblocks import KVLayout, KVCache
>>> cache = KVCache(KVLayout(2, 4, 8, 16, "fp16"), num_blocks=10, pin_memory=False)
>>> cache.storage.shape, cache.layer(1).shape, cache.key(0).shape
((2, 10, 2, 16, 4, 8), (10, 2, 16, 4, 8), (10, 16, 4, 8))
>>> cache.nbytes == 10 * cache.layout.bytes_per_block
True
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _cuda
from .errors import DeviceError, InvalidArgumentError, InvalidTypeError
from .layout import KVLayout

__all__ = ["KVCache", "parse_device"]


def parse_device(device: Any) -> Tuple[str, int]:
    """``"cpu"`` -> ("cpu", -1); ``"cuda"`` -> ("cuda", 0); ``"cuda:1"`` -> ("cuda", 1).

    >>> parse_device("cuda:1")
    ('cuda', 1)
    """
    if not isinstance(device, str):
        raise InvalidTypeError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    dev = device.strip().lower()
    if dev == "cpu":
        return "cpu", -1
    if dev == "cuda":
        return "cuda", 0
    if dev.startswith("cuda:") and dev[5:].isdigit():
        return "cuda", int(dev[5:])
    raise InvalidArgumentError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")


class KVCache:
    """K and V storage for ``num_blocks`` blocks of ``layout`` on ``device`` (zero-filled).

    ``device="cuda"`` without CuPy or a CUDA device raises :class:`~kvblocks.DeviceError`.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: str = "cpu",
        *,
        pin_memory: Optional[bool] = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise InvalidTypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if isinstance(num_blocks, (bool, np.bool_)) or not isinstance(
            num_blocks, (int, np.integer)
        ):
            raise InvalidTypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks <= 0:
            raise InvalidArgumentError(f"num_blocks must be > 0, got {num_blocks}")
        kind, index = parse_device(device)
        self.layout = layout
        self.num_blocks = int(num_blocks)
        self.device_kind = kind
        self.device_index = index
        nbytes = layout.bytes_per_block * self.num_blocks
        self.pinned = False
        if kind == "cuda":
            cp = _cuda.get_cupy()
            if index >= cp.cuda.runtime.getDeviceCount():
                raise DeviceError(f"device {device!r} does not exist")
            with cp.cuda.Device(index):
                raw = cp.zeros(nbytes, dtype=np.uint8)
        else:
            raw = None
            if pin_memory is not False:
                raw = _cuda.pinned_empty(nbytes)
                if raw is None and pin_memory:
                    raise DeviceError("pin_memory=True needs CuPy and a CUDA device")
                if raw is not None:
                    raw[:] = 0
                    self.pinned = True
            if raw is None:
                raw = np.zeros(nbytes, dtype=np.uint8)
        self._raw = raw
        #: the whole cache in the layout's dtype (see the module docstring for its shape)
        self.storage = raw.view(layout.storage_dtype).reshape(layout.storage_shape(self.num_blocks))
        #: the same bytes as ``[num_planes, num_blocks, plane_block_bytes]`` uint8
        self.planes = raw.reshape(layout.num_planes, self.num_blocks, layout.plane_block_bytes)

    # -- description ---------------------------------------------------------------------
    @property
    def device(self) -> str:
        """``"cpu"`` or ``"cuda:N"``."""
        return "cpu" if self.device_kind == "cpu" else f"cuda:{self.device_index}"

    @property
    def is_cuda(self) -> bool:
        return self.device_kind == "cuda"

    @property
    def xp(self) -> Any:
        """The array module of the storage: numpy or cupy."""
        return _cuda.get_cupy() if self.is_cuda else np

    @property
    def nbytes(self) -> int:
        return self.layout.bytes_per_block * self.num_blocks

    @property
    def data_ptr(self) -> int:
        """Address of the first byte (device pointer on CUDA, host pointer on CPU)."""
        return int(self._raw.data.ptr) if self.is_cuda else int(self._raw.ctypes.data)

    def __repr__(self) -> str:
        lay = self.layout
        return (
            f"KVCache(layers={lay.num_layers}, kv_heads={lay.num_kv_heads}, head_dim={lay.head_dim}, "
            f"block_size={lay.block_size}, dtype={lay.dtype}, kind={lay.kind}, joint={lay.joint}, "
            f"num_blocks={self.num_blocks}, device={self.device!r}, pinned={self.pinned})"
        )

    # -- per-layer views ---------------------------------------------------------------------
    def _check_layer(self, layer: Any) -> int:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise InvalidTypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.layout.num_layers:
            raise InvalidArgumentError(f"layer {layer} out of range [0, {self.layout.num_layers})")
        return int(layer)

    def layer(self, layer: int) -> Any:
        """Storage of one layer: joint ``[N, 2, *block_shape]``, split ``[2, N, *block_shape]``."""
        return self.storage[self._check_layer(layer)]

    def key(self, layer: int) -> Any:
        """K of one layer, ``[num_blocks, *block_shape]`` (a strided view when joint)."""
        li = self._check_layer(layer)
        return self.storage[li, :, 0] if self.layout.joint else self.storage[li, 0]

    def value(self, layer: int) -> Any:
        """V of one layer, ``[num_blocks, *block_shape]`` (a strided view when joint)."""
        li = self._check_layer(layer)
        return self.storage[li, :, 1] if self.layout.joint else self.storage[li, 1]

    def kv(self, layer: int) -> Tuple[Any, Any]:
        """``(key(layer), value(layer))``."""
        return self.key(layer), self.value(layer)
