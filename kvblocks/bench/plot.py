"""``--plot FILE``: latency histograms and CDFs per operation (optional matplotlib)."""

from __future__ import annotations

import os
from typing import Dict

import numpy as np

from .errors import BenchError

__all__ = ["check_plot", "plot_run"]

_COLORS = {"kvblocks": "C0", "python": "C1", "vllm": "C2", "numpy-list": "C3", "numpy-2d": "C4"}


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("--plot needs matplotlib: pip install 'kvblocks[plot]'") from None
    return plt


def check_plot(path: str) -> None:
    """Before any timing: matplotlib importable, a format it writes, the file's folder present."""
    plt = _pyplot()
    ext = os.path.splitext(path)[1][1:].lower()
    fig = plt.figure()
    try:
        formats = fig.canvas.get_supported_filetypes()
    finally:
        plt.close(fig)
    if ext and ext not in formats:
        raise BenchError(
            f"--plot {path}: matplotlib cannot write .{ext} (try {', '.join(sorted(formats))})"
        )
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise BenchError(f"--plot {path}: no such folder {folder}")


def plot_run(doc: dict, samples: Dict[str, Dict[str, Dict[str, np.ndarray]]], path: str) -> None:
    """One row per operation: a histogram (log time axis) and the CDF of per-call latency."""
    plt = _pyplot()
    from matplotlib.ticker import NullFormatter

    rows = [(suite, o) for suite, body in doc["suites"].items() for o in body["ops"]]
    fig, axes = plt.subplots(len(rows), 2, figsize=(11, 2.1 * len(rows) + 0.6), squeeze=False)
    for (suite, o), (ax_h, ax_c) in zip(rows, axes):
        data = samples[suite][o["id"]]
        pos = [a[a > 0] for a in data.values() if (a > 0).any()]
        lo = min(float(a.min()) for a in pos) if pos else 1.0
        hi = max(float(a.max()) for a in pos) if pos else 10.0
        bins = np.geomspace(lo, max(hi, lo * 1.01), 50)
        for impl, a in data.items():
            a = a[a > 0]
            if not a.size:
                continue
            color = _COLORS.get(impl)
            ax_h.hist(a, bins=bins, histtype="step", color=color, label=f"{impl} (n={a.size})")
            xs = np.sort(a)
            ax_c.step(
                xs,
                np.arange(1, xs.size + 1) / xs.size,
                where="post",
                color=color,
                label=impl,
                linewidth=1.2,
            )
            ax_c.axvline(np.percentile(a, 99), color=color, linestyle=":", linewidth=0.8)
        for ax in (ax_h, ax_c):
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.tick_params(labelsize=7)
        ax_h.set_title(f"{suite}: {o['label']}", fontsize=8, loc="left")
        ax_h.legend(fontsize=6, loc="upper right")
        ax_c.set_ylim(0, 1.01)
        ax_c.set_title("CDF (dotted: p99)", fontsize=8, loc="left")
    for ax in axes[-1]:
        ax.set_xlabel("ns per call (overhead subtracted)", fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise BenchError(f"cannot write plot {path}: {e}") from None
    finally:
        plt.close(fig)
