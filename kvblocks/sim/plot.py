"""``--plot FILE``: KV memory use and concurrency over simulated time (optional matplotlib)."""

from __future__ import annotations

from typing import Sequence

from .errors import SimulationError
from .metrics import SimResult

__all__ = ["plot_results"]


def plot_results(results: Sequence[SimResult], path: str, title: str = "") -> None:
    """Write a two-panel figure (KV usage, running/waiting sequences); format from the suffix."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimulationError("--plot needs matplotlib: pip install 'kvblocks[plot]'") from None
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True)
    for n, res in enumerate(results):
        color = f"C{n}"
        s = res.recorder.series()
        label = "paged (kvblocks)" if res.name == "paged" else "contiguous (max-length)"
        ax1.plot(s["t"], 100.0 * s["kv_usage"], label=label, linewidth=1, color=color)
        ax2.plot(s["t"], s["running"], label=f"{label}: running", linewidth=1, color=color)
        ax2.plot(
            s["t"],
            s["waiting"],
            label=f"{label}: waiting",
            linewidth=1,
            linestyle="--",
            color=color,
        )
    ax1.set_ylabel("KV memory allocated (%)")
    ax1.set_ylim(0, 105)
    ax1.legend(loc="upper right", fontsize=8)
    ax2.set_ylabel("sequences")
    ax2.set_xlabel("simulated time (s)")
    ax2.legend(loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise SimulationError(f"cannot write plot {path}: {e}") from None
    finally:
        plt.close(fig)
