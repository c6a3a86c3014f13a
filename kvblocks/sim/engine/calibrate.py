"""``--calibrate FILE``: fit the roofline's efficiencies and host overhead to measured steps.

The file is a CSV with a header naming at least ``prefill_tokens``, ``decode_tokens``,
``kv_tokens_read`` (cached tokens the step's decodes read, summed over them) and ``ms`` (the
step's measured time); an optional ``prefill_start`` gives the position of the first prefill
token (0 = a fresh prompt; its prefix is attended to and read). One row per measured step,
e.g. from an engine's profiler, or a benchmark's prefill-only and decode-only runs.

The fit minimizes the squared *relative* error over the rows (short decode steps and long
prefills weigh alike): the GEMM compute efficiency, the HBM bandwidth efficiency and the
attention efficiency are searched on a grid refined around the best point, the host
overhead is then the weighted mean residual (exact for an additive constant). What the rows
do not exercise stays at the default (e.g. the attention efficiency without long prompts);
the report says how well each row is predicted.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Tuple

import numpy as np

from ..errors import WorkloadError
from .timing import Efficiency, TimeModel

__all__ = ["Calibration", "read_profile", "fit", "calibrate"]

REQUIRED = ("prefill_tokens", "decode_tokens", "kv_tokens_read", "ms")
COLUMNS = REQUIRED + ("prefill_start",)


@dataclass(frozen=True)
class Calibration:
    """The fitted constants and how well they predict the measured steps."""

    eff: Efficiency
    rows: int
    rms_rel_error: float  # root mean square of (predicted - measured) / measured
    mean_abs_rel_error: float
    max_abs_rel_error: float
    default_mean_abs_rel_error: float  # the uncalibrated model on the same rows
    path: str = ""

    def as_dict(self) -> Dict[str, Any]:
        e = self.eff
        return {
            "file": self.path,
            "rows": self.rows,
            "compute_eff": e.compute,
            "bandwidth_eff": e.bandwidth,
            "attention_eff": e.attention,
            "host_ms": e.host_ms,
            "rms_rel_error": self.rms_rel_error,
            "mean_abs_rel_error": self.mean_abs_rel_error,
            "max_abs_rel_error": self.max_abs_rel_error,
            "default_mean_abs_rel_error": self.default_mean_abs_rel_error,
        }

    def describe(self) -> str:
        e = self.eff
        return (
            f"calibrated on {self.rows} steps of {self.path or 'the profile'}: compute {e.compute:.3f}, "
            f"bandwidth {e.bandwidth:.3f}, attention {e.attention:.3f}, host {e.host_ms:.3f} ms; "
            f"fit error {100 * self.mean_abs_rel_error:.1f}% mean, {100 * self.max_abs_rel_error:.1f}% max "
            f"(defaults: {100 * self.default_mean_abs_rel_error:.1f}% mean)"
        )


def read_profile(path: str) -> np.ndarray:
    """The rows of a profile CSV as an (n, 5) float array (columns :data:`COLUMNS`);
    WorkloadError naming the file and line for anything malformed."""
    try:
        f = open(path, newline="")
    except OSError as e:
        raise WorkloadError(f"cannot read the calibration file: {e.strerror or e}", path) from None
    with f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise WorkloadError("empty calibration file (a header naming prefill_tokens, "
                                "decode_tokens, kv_tokens_read, ms is needed)", path) from None  # fmt: skip
        except (csv.Error, UnicodeDecodeError) as e:
            raise WorkloadError(f"not a CSV file: {e}", path, 1) from None
        names = [h.strip().lower() for h in header]
        missing = [c for c in REQUIRED if c not in names]
        if missing:
            raise WorkloadError(
                f"the header lacks column(s) {', '.join(missing)} (has {', '.join(names)})", path, 1
            )
        idx = [names.index(c) if c in names else -1 for c in COLUMNS]
        out: List[List[float]] = []
        try:
            for line, row in enumerate(reader, start=2):
                if not row or all(not c.strip() for c in row):
                    continue
                vals = []
                for col, i in zip(COLUMNS, idx):
                    if i < 0:
                        vals.append(0.0)
                        continue
                    if i >= len(row):
                        raise WorkloadError(f"{len(row)} fields, no {col}", path, line)
                    try:
                        v = float(row[i])
                    except ValueError:
                        raise WorkloadError(
                            f"{col} {row[i].strip()!r} is not a number", path, line
                        ) from None
                    if not math.isfinite(v) or v < 0 or (col == "ms" and v <= 0):
                        need = "> 0" if col == "ms" else ">= 0"
                        raise WorkloadError(
                            f"{col} must be a finite number {need}, got {row[i].strip()!r}",
                            path,
                            line,
                        )
                    vals.append(v)
                if vals[0] + vals[1] <= 0:
                    raise WorkloadError(
                        "a step needs prefill_tokens or decode_tokens > 0", path, line
                    )
                out.append(vals)
        except (csv.Error, UnicodeDecodeError) as e:
            raise WorkloadError(f"not a CSV file: {e}", path) from None
    if len(out) < 2:
        raise WorkloadError(f"{len(out)} measured step(s); the fit needs at least 2", path)
    return np.asarray(out, dtype=np.float64)


def _parts(tm: TimeModel, rows: np.ndarray) -> Tuple[np.ndarray, ...]:
    """Per row: weight bytes, GEMM FLOPs, KV bytes, attention FLOPs, fixed seconds."""
    pf, dec, kv, _ms, start = rows.T
    t = pf + dec
    wb = tm.dense_bytes + tm.expert_bytes * (1.0 - tm.expert_skip**t)
    flops = t * tm.flops_per_token
    pairs = np.zeros_like(pf)
    reads = np.zeros_like(pf)
    for i in np.flatnonzero(pf):
        pairs[i], reads[i] = tm.prefill_attention([(int(start[i]), int(pf[i]))])
    kvb = (kv + reads + t) * tm.kv_bytes_per_token
    af = kv * tm.decode_pair_flops + pairs * tm.prefill_pair_flops
    fixed = tm.comm_s_per_step + t * tm.comm_s_per_token
    return wb, flops, kvb, af, fixed


def _predict(tm: TimeModel, parts: Tuple[np.ndarray, ...], c: Any, b: Any, a: Any) -> np.ndarray:
    """Seconds per row without the host overhead, for efficiencies c, b, a (broadcast)."""
    wb, flops, kvb, af, fixed = parts
    e = tm.eff
    mem = tm.mem_bytes_per_s / e.bandwidth * b
    peak = tm.gemm_flops_per_s / e.compute * c
    apeak = tm.attn_flops_per_s / e.attention * a
    return np.maximum(wb / mem, flops / peak) + np.maximum(kvb / mem, af / apeak) + fixed


def fit(tm: TimeModel, rows: np.ndarray, path: str = "") -> Calibration:
    """The efficiencies and host overhead that best predict ``rows`` (see the module docstring)."""
    parts = _parts(tm, rows)
    meas = rows[:, 3] * 1e-3
    w = 1.0 / meas**2

    def score(c: np.ndarray, b: np.ndarray, a: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
        pred = _predict(tm, tuple(p[..., None] if p.ndim else p for p in parts), c, b, a)
        host = np.clip(((meas[:, None] - pred) * w[:, None]).sum(0) / w.sum(), 0.0, None)
        err = ((pred + host - meas[:, None]) / meas[:, None]) ** 2
        return err.sum(0), host

    lo, hi = np.full(3, 0.02), np.ones(3)
    best = np.array([tm.eff.compute, tm.eff.bandwidth, tm.eff.attention])
    for _ in range(6):  # a grid over the box, then a smaller box around the best point
        axes = [np.linspace(lo[k], hi[k], 13) for k in range(3)]
        C, B, A = (x.ravel() for x in np.meshgrid(*axes, indexing="ij"))
        err, host = score(C, B, A)
        k = int(np.argmin(err))
        best = np.array([C[k], B[k], A[k]])
        span = (hi - lo) / 6.0
        lo, hi = np.maximum(best - span, 1e-3), np.minimum(best + span, 1.0)
    err, host = score(best[:1], best[1:2], best[2:])
    eff = replace(tm.eff, compute=float(best[0]), bandwidth=float(best[1]), attention=float(best[2]),
                  host_ms=float(host[0]) * 1e3)  # fmt: skip
    pred = _predict(tm, parts, best[0], best[1], best[2]) + host[0]
    rel = (pred - meas) / meas
    e0 = tm.eff
    base = _predict(tm, parts, e0.compute, e0.bandwidth, e0.attention) + e0.host_ms * 1e-3
    rel0 = (base - meas) / meas
    return Calibration(eff, int(rows.shape[0]), float(np.sqrt(np.mean(rel**2))), float(np.mean(np.abs(rel))),
                       float(np.max(np.abs(rel))), float(np.mean(np.abs(rel0))), path)  # fmt: skip


def calibrate(tm: TimeModel, path: str) -> Calibration:
    """:func:`fit` on the rows of the CSV at ``path``."""
    return fit(tm, read_profile(path), path)
