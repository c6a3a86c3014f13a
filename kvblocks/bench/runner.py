"""Running suites: which exist, building their state, timing them, the JSON document.

The document (``schema: "kvblocks-bench/1"``) is what ``--json`` writes and ``--compare``
reads: the machine and build, the calibration, and per suite a list of ops, each with per
implementation ``p50_ns``, ``p99_ns``, ``ns_per_unit``... and ``speedup`` (baseline p50 over
kvblocks p50) for every baseline it has.
"""

from __future__ import annotations

import datetime as _dt
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO

import numpy as np

from ..errors import KVBlocksError
from .errors import BenchError
from .machine import describe_machine
from .timing import Settings, calibrate, run_ops

__all__ = ["SCHEMA", "SUITES", "BenchRun", "resolve_suites", "run"]

SCHEMA = "kvblocks-bench/1"
SUITES = ("alloc", "prefix", "metadata", "groups", "tier")
WARMUP_NOTE = (
    "warm-up: each operation ran untimed samples first (>= {ms:g} ms), and each of the "
    "{rounds} interleaved rounds starts with one untimed sample; pool builds are timed cold"
)
OVERHEAD_NOTE = (
    "timer overhead (per sample) and harness overhead (per call), measured before the run "
    "and in every round, are subtracted (their medians; values on each suite's line)"
)
P99_NOTE = (
    "p50/p99 are over samples; a sample is the mean of `inner` back-to-back calls "
    "(1 for single-call operations: metadata, pool build)"
)
BASELINES = {
    "python": "the bundled pure-Python vLLM-style pool (kvblocks.bench.pybaseline), same harness",
    "numpy-list": "numpy from one block-table array per sequence",
    "numpy-2d": "numpy from a padded [B, max_blocks] table (vLLM InputBatch style)",
    "device-only": "the same call on a BlockManager without a host tier (suite tier)",
    "single-group": "the same call on a BlockManager with the one default full group (suite groups)",
}


def _ratios_over(ops: List[dict], baseline: str) -> dict:
    """Per operation, kvblocks' p50 and p99 over the ``baseline`` case's, timed in the same run
    (the tier and groups suites compare each call with itself without the feature)."""
    out = {}
    for o in ops:
        k, d = o["results"]["kvblocks"], o["results"].get(baseline)
        if d and d["p50_ns"] > 0 and d["p99_ns"] > 0:
            out[o["id"]] = {
                "p50": round(k["p50_ns"] / d["p50_ns"], 3),
                "p99": round(k["p99_ns"] / d["p99_ns"], 3),
            }
    return out


def resolve_suites(names: Sequence[str]) -> List[str]:
    """Suite names (``all`` expanded, duplicates dropped); BenchError for unknown ones."""
    out: List[str] = []
    for name in names or ["all"]:
        if name == "all":
            todo = list(SUITES)
        elif name in SUITES:
            todo = [name]
        else:
            raise BenchError(f"unknown suite {name!r} (choose from {', '.join(SUITES)}, all)")
        out += [t for t in todo if t not in out]
    return out


def _builder(name: str) -> Callable:
    if name == "alloc":
        from .alloc import build
    elif name == "prefix":
        from .prefix import build
    elif name == "tier":
        from .tier import build
    elif name == "groups":
        from .groups import build
    else:
        from .metadata import build
    return build


@dataclass
class BenchRun:
    """A finished run: ``doc`` (the JSON document) and the raw per-call samples by
    ``samples[suite][op_id][impl]`` (ns, for plots)."""

    doc: dict
    samples: Dict[str, Dict[str, Dict[str, np.ndarray]]] = field(default_factory=dict)


def run(
    suites: Sequence[str] = ("all",),
    *,
    quick: bool = False,
    max_samples: Optional[int] = None,
    progress: bool = False,
    stream: Optional[TextIO] = None,
    use_vllm: bool = True,
    command: str = "",
) -> BenchRun:
    """Time ``suites`` and return the run; ``progress`` draws a bar on ``stream`` (stderr)."""
    from .progress import ProgressBar
    from .vllm_pool import load

    names = resolve_suites(suites)
    settings = Settings(quick=quick, max_samples=max_samples)
    make_vllm, vllm_desc = load() if use_vllm else (None, "vllm not timed (disabled)")
    load_start = _loadavg()
    cal = calibrate(800 if quick else 3000)
    doc: Dict[str, Any] = {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "settings": {"quick": quick, "max_samples": max_samples, "rounds": settings.rounds},
        "machine": describe_machine(),
        "timing": {
            "before_run": cal.as_dict(),
            "gc": "off while timing",
            "warmup": WARMUP_NOTE.format(ms=settings.warmup_ns / 1e6, rounds=settings.rounds),
            "overhead": OVERHEAD_NOTE,
            "percentiles": P99_NOTE,
        },
        "baselines": {**BASELINES, "vllm": vllm_desc},
        "vllm_timed": make_vllm is not None,
        "suites": {},
    }
    result = BenchRun(doc)
    for name in names:
        t0 = time.perf_counter()
        bar = ProgressBar(f"bench {name}", stream) if progress else None
        try:
            ops, facts = _builder(name)(settings, make_vllm)
            stats, used = run_ops(ops, settings, cal, progress=bar)
        except KVBlocksError as e:  # a bug of the suite, not the user's input: keep the traceback
            raise RuntimeError(f"bench suite {name!r} failed: {type(e).__name__}: {e}") from e
        finally:
            if bar is not None:
                bar.close()
        rows = []
        raw: Dict[str, Dict[str, np.ndarray]] = {}
        for op in ops:
            res = {c.impl: stats[id(c)].as_dict(op.units) for c in op.cases}
            raw[op.id] = {c.impl: stats[id(c)].samples for c in op.cases}
            ref = res["kvblocks"]["p50_ns"]
            speedup = {
                k: (v["p50_ns"] / ref if ref > 0 else None)
                for k, v in res.items()
                if k != "kvblocks"
            }
            rows.append(
                {
                    "id": op.id,
                    "label": op.label,
                    "unit": op.unit,
                    "units": op.units,
                    "note": op.note,
                    "results": res,
                    "speedup": speedup,
                }
            )
        doc["suites"][name] = {
            "seconds": round(time.perf_counter() - t0, 2),
            "overhead": used.as_dict(),
            "ops": rows,
            **facts,
        }
        if name == "tier":  # the targets compare these with 2.0
            doc["suites"][name]["ratio_vs_device"] = _ratios_over(rows, "device-only")
        elif name == "groups":
            from .groups import release_scaling

            doc["suites"][name]["ratio_vs_single"] = _ratios_over(rows, "single-group")
            doc["suites"][name]["release_scaling"] = release_scaling(rows)
        result.samples[name] = raw
        del ops
    doc["load_average"] = {"start": load_start, "end": _loadavg()}
    return result


def _loadavg() -> Optional[List[float]]:
    """1, 5 and 15-minute load averages (None where the OS has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None
