"""Shape and dtype of a paged KV cache: :class:`KVLayout`.

A layout fixes everything about the bytes of one cache block except where it lives:

* ``num_layers``, ``num_kv_heads``, ``head_dim``, ``block_size`` (tokens per block);
* ``dtype``: ``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``;
* ``kind``: the order inside one block of one layer, ``"NHD"`` = ``[block_size, heads, dim]``
  (FlashInfer / vLLM default) or ``"HND"`` = ``[heads, block_size, dim]``;
* ``joint``: K and V of a layer in one tensor ``[blocks, 2, ...]`` (FlashInfer) or, when
  ``False``, two tensors ``[blocks, ...]`` (vLLM / FlashAttention style).

numpy has no bfloat16 and no fp8, and neither has CuPy: ``bf16`` is stored as raw ``uint16``
and both fp8 formats as raw ``uint8``. kvblocks only moves these bytes and never does
arithmetic on them, so the raw storage is exact; view them with ``torch`` / ``ml_dtypes``.

>>> lay = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bf16")
>>> lay.bytes_per_token          # 2 (K, V) x 32 x 8 x 128 x 2 bytes = 128 KiB
131072
>>> lay.bytes_per_block // 2**20
2
>>> lay.storage_dtype
dtype('uint16')
>>> lay.block_shape
(16, 8, 128)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import numpy as np

from .errors import InvalidArgumentError, InvalidTypeError

__all__ = ["KVLayout", "DTYPES"]

# canonical name -> (storage numpy dtype, bytes per element)
DTYPES: Dict[str, np.dtype] = {
    "bf16": np.dtype(np.uint16),
    "fp16": np.dtype(np.float16),
    "fp32": np.dtype(np.float32),
    "fp8_e4m3": np.dtype(np.uint8),
    "fp8_e5m2": np.dtype(np.uint8),
}

_ALIASES = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "e4m3": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
    "e5m2": "fp8_e5m2",
}


def dtype_bytes() -> Dict[str, int]:
    """Bytes per element of every accepted spelling: the one dtype table (``DTYPES``), which
    the simulator's memory bill and the integrations read too."""
    return {alias: DTYPES[name].itemsize for alias, name in _ALIASES.items()}


KINDS = ("NHD", "HND")


def canonical_dtype(dtype: Any) -> str:
    """Map a dtype spelling (``"bfloat16"``, ``np.float16``, ``torch.float16``...) to its canonical name.

    >>> canonical_dtype("bfloat16"), canonical_dtype(np.float32), canonical_dtype("fp8")
    ('bf16', 'fp32', 'fp8_e4m3')
    """
    if isinstance(dtype, str):
        key = dtype.lower()
    else:
        try:
            key = np.dtype(dtype).name  # numpy dtype or scalar type
        except TypeError:
            key = str(dtype).lower().rsplit(".", 1)[-1]  # e.g. torch.bfloat16
    if key.startswith("torch."):
        key = key[6:]
    name = _ALIASES.get(key)
    if name is None:
        raise InvalidTypeError(f"unsupported KV dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return name


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise InvalidArgumentError(f"{name} must be > 0, got {value}")
    return int(value)


@dataclass(frozen=True)
class KVLayout:
    """Geometry and dtype of a paged KV cache (see the module docstring).

    Invalid arguments raise :class:`~kvblocks.InvalidArgumentError` or
    :class:`~kvblocks.InvalidTypeError`:

    >>> KVLayout(2, 8, 128, 16, "int8")
    Traceback (most recent call last):
    ...
    kvblocks.errors.InvalidTypeError: unsupported KV dtype 'int8'; expected one of ['bf16', 'fp16', 'fp32', 'fp8_e4m3', 'fp8_e5m2']
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "bf16"
    kind: str = "NHD"
    joint: bool = True

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            object.__setattr__(self, name, _positive_int(name, getattr(self, name)))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        kind = self.kind.upper() if isinstance(self.kind, str) else self.kind
        if kind not in KINDS:
            raise InvalidArgumentError(f"kind must be 'NHD' or 'HND', got {self.kind!r}")
        object.__setattr__(self, "kind", kind)
        if not isinstance(self.joint, (bool, np.bool_)):
            raise InvalidTypeError(f"joint must be a bool, got {type(self.joint).__name__}")
        object.__setattr__(self, "joint", bool(self.joint))

    # -- element geometry ---------------------------------------------------------------
    @property
    def storage_dtype(self) -> np.dtype:
        """numpy/CuPy dtype of the stored elements (raw ``uint16`` for bf16, ``uint8`` for fp8)."""
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPES[self.dtype].itemsize

    @property
    def block_shape(self) -> Tuple[int, int, int]:
        """Shape of K (or V) of one block of one layer: NHD ``(bs, H, D)``, HND ``(H, bs, D)``."""
        if self.kind == "NHD":
            return (self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def token_shape(self) -> Tuple[int, int]:
        """Shape of one token's K (or V) in one layer: ``(num_kv_heads, head_dim)``."""
        return (self.num_kv_heads, self.head_dim)

    # -- sizes -----------------------------------------------------------------------------
    @property
    def bytes_per_token(self) -> int:
        """K and V bytes of one token over all layers: 2 x L x H x D x itemsize."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers: ``bytes_per_token * block_size``."""
        return self.bytes_per_token * self.block_size

    @property
    def half_block_bytes(self) -> int:
        """Bytes of K (or V) of one block in one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    # -- storage planes ----------------------------------------------------------------------
    # Storage of every layout is one buffer seen as ``[num_planes, num_blocks, plane_block_bytes]``
    # bytes: joint has one plane per layer (K then V inside each block), split has two per layer
    # (K of layer l is plane 2l, V is plane 2l+1). Copies and swaps move whole plane rows.
    @property
    def num_planes(self) -> int:
        """Planes of the storage buffer: ``num_layers`` (joint) or ``2 * num_layers`` (split)."""
        return self.num_layers if self.joint else 2 * self.num_layers

    @property
    def plane_block_bytes(self) -> int:
        """Bytes of one block in one plane (``bytes_per_block == num_planes * plane_block_bytes``)."""
        return self.half_block_bytes * (2 if self.joint else 1)

    def storage_shape(self, num_blocks: int) -> Tuple[int, ...]:
        """Shape of the whole storage array.

        joint: ``[L, num_blocks, 2, *block_shape]``; split: ``[L, 2, num_blocks, *block_shape]``.

        >>> KVLayout(4, 2, 64, 16, "fp16", kind="HND", joint=False).storage_shape(10)
        (4, 2, 10, 2, 16, 64)
        """
        if self.joint:
            return (self.num_layers, num_blocks, 2) + self.block_shape
        return (self.num_layers, 2, num_blocks) + self.block_shape
