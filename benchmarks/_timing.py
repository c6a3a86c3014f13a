"""Shared timing helpers for the benches: batches inside one process, GC off, p50/p99."""

from __future__ import annotations

import gc
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def timer_overhead_ns(samples: int = 2000) -> float:
    t = time.perf_counter_ns
    d = [-(t() - t()) for _ in range(samples)]
    return float(np.median(d))


def measure(fn, *, inner: int, repeats: int, setup=None, teardown=None) -> dict:
    """Time ``inner`` calls of fn() per sample, ``repeats`` samples; ns per call."""
    samples = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            if setup:
                setup()
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                fn()
            t1 = time.perf_counter_ns()
            if teardown:
                teardown()
            samples.append((t1 - t0) / inner)
    finally:
        if gc_was:
            gc.enable()
    a = np.asarray(samples)
    return {
        "p50_ns": float(np.percentile(a, 50)),
        "p99_ns": float(np.percentile(a, 99)),
        "min_ns": float(a.min()),
        "samples": len(a),
        "inner": inner,
    }


def commit() -> str:
    try:
        return subprocess.check_output(
            ["git", "rev-parse", "--short", "HEAD"],
            text=True,
            stderr=subprocess.DEVNULL,
            cwd=Path(__file__).parent,
        ).strip()
    except Exception:
        return "unknown"


def save(name: str, rows: list, extra: dict | None = None) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": name,
        "commit": commit(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "timer_overhead_ns": timer_overhead_ns(),
        "rows": rows,
        **(extra or {}),
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    return path


def table(rows: list, cols: list) -> str:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in cols]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths))]
    for r in rows:
        lines.append("  ".join(_fmt(r.get(c)).rjust(w) for c, w in zip(cols, widths)))
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.1f}"
    return str(v)
