"""``--plot FILE``: KV memory use and concurrency over simulated time (optional matplotlib)."""

from __future__ import annotations

from typing import Any, Sequence

from ..engine.metrics import SimResult
from ..errors import SimulationError

__all__ = ["plot_results", "plot_capacity"]


def plot_results(results: Sequence[SimResult], path: str, title: str = "") -> None:
    """Write a two-panel figure (KV usage, running/waiting sequences); format from the suffix."""
    plt = _pyplot()
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
    _save(plt, fig, path, title)


def plot_capacity(points: Sequence[Any], target_s: float, path: str, title: str = "") -> None:
    """``kvblocks plan --trace ... --plot FILE``: TTFT p50/p99 and hit rate against GPUs, one
    line per host-cache size, with the target as a horizontal line."""
    plt = _pyplot()
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    sizes = sorted({p.host_cache_gib for p in points})
    for n, g in enumerate(sizes):
        pts = sorted((p for p in points if p.host_cache_gib == g), key=lambda p: p.gpus)
        xs = [p.gpus for p in pts]
        label = f"host cache {g:g} GiB/replica" if g else "no host cache"
        color = f"C{n}"
        ax1.plot(xs, [p.ttft_p99_s for p in pts], marker="o", color=color, label=f"{label}: p99")
        ax1.plot(xs, [p.ttft_p50_s for p in pts], marker=".", linestyle="--", color=color,
                 label=f"{label}: p50")  # fmt: skip
        ax2.plot(xs, [100.0 * p.hit_rate for p in pts], marker="o", color=color, label=label)
    ax1.axhline(target_s, color="k", linewidth=0.8, linestyle=":", label="target p99")
    ax1.set_yscale("log")
    ax1.set_ylabel("time to first token (s)")
    ax1.legend(loc="upper right", fontsize=8)
    ax2.set_ylabel("prefix hit rate (%)")
    ax2.set_xlabel("GPUs (replicas)")
    ax2.legend(loc="lower right", fontsize=8)
    _save(plt, fig, path, title)


def plot_gpu_plan(plan: Any, path: str, title: str = "") -> None:
    """``kvblocks plan --gpu ... --plot FILE``: TTFT p99 of every replay against GPUs (or
    $/hour with ``--cost``), one series per GPU x TP x PP x KV dtype (x host cache, x
    disaggregated), the target dotted; replays stopped early have no p99 and are not drawn."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    series: dict = {}
    for c in plan.replayed:
        f = c.family
        if c.ttft_p99_s is None:
            continue  # stopped early or not replayed: no p99 to draw
        key = (f.gpu, f.tp, f.pp, f.kv_dtype, f.host_cache_gib, c.prefill > 0)
        series.setdefault(key, []).append(c)
    for n, (k, cs) in enumerate(sorted(series.items())):
        cs.sort(key=lambda c: c.gpus)
        xs = [c.usd_per_hour if plan.by_cost else c.gpus for c in cs]
        ax.plot(xs, [c.ttft_p99_s for c in cs], marker="o", color=f"C{n % 10}",
                label=f"{k[0]} TP{k[1]} PP{k[2]} KV {k[3]}" + (f" +{k[4]:g}G" if k[4] else "")
                + (" P:D" if k[5] else ""))  # fmt: skip
    ax.axhline(plan.ttft_p99_s, color="k", linewidth=0.8, linestyle=":", label="target TTFT p99")
    ax.set_yscale("log")
    ax.set_ylabel("time to first token p99 (s)")
    ax.set_xlabel("$/hour" if plan.by_cost else "GPUs (replicas x TP x PP)")
    ax.legend(loc="upper right", fontsize=8)
    _save(plt, fig, path, title)


def _pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or SimulationError naming the extra."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SimulationError("--plot needs matplotlib: pip install 'kvblocks[plot]'") from None
    return plt


def _save(plt: Any, fig: Any, path: str, title: str) -> None:
    """Title, lay out and write ``fig`` to ``path`` (closed in any case)."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except (OSError, ValueError) as e:
        raise SimulationError(f"cannot write plot {path}: {e}") from None
    finally:
        plt.close(fig)
