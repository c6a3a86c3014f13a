"""Formatting shared by the simulation report and the capacity plan: byte sizes, JSON values."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["fmt_bytes", "json_safe"]


def fmt_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def json_safe(v: Any) -> Any:
    """``v`` with every NaN or infinite float (in nested dicts and lists too) replaced by None
    (JSON null), and numpy scalars by Python numbers.

    >>> json_safe({"a": [float("nan"), np.int64(3)], "b": np.float64(0.5)})
    {'a': [None, 3], 'b': 0.5}
    """
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v
