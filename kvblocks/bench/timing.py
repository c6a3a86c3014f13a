"""Timing harness of ``kvblocks bench``: calibration, warm-up, interleaved rounds, percentiles.

Method (the same for kvblocks and every baseline, so ratios compare like with like):

- **Samples.** A sample times ``inner`` back-to-back calls of a zero-argument function with
  ``time.perf_counter_ns`` and divides by ``inner``. ``inner`` is 1 for single-call cases
  (metadata, pool build) and otherwise chosen so a sample lasts about ``target_sample_ns``;
  p50 and p99 are percentiles over samples, so for ``inner > 1`` the p99 is the p99 of
  short-window means, not of single calls.
- **Overhead subtracted.** :func:`calibrate` measures an empty sample (two clock reads and the
  loop set-up: ``timer_ns``) and the harness cost of one iteration calling a no-op Python
  function (``call_ns``), once before and once inside every round (so under the same load as
  the cases; the median of these blocks is used). Each sample has ``timer_ns / inner +
  call_ns`` taken off (never below 0): what remains is the cost of the calls the case makes.
- **Warm-up.** Before its first round each case runs untimed samples for at least
  ``warmup_ns`` (caches, branch predictors, lazily built buffers); each later round starts
  with one untimed sample. Cases marked ``warmup=False`` (building a pool) are timed cold.
- **Interleaved rounds.** The samples of every case are split into ``rounds`` chunks run
  round-robin across the cases of a suite, so a burst of load from another process spreads
  over all cases instead of landing on one; medians then agree better from run to run.
- **GC off** for the whole timed part (collected once before).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["Settings", "Calibration", "Case", "Op", "Stats", "calibrate", "run_ops"]
__all__ += ["measure", "timer_overhead_ns"]  # the standalone scripts (benchmarks/)

_clock = time.perf_counter_ns


@dataclass(frozen=True)
class Settings:
    """How long to time each case. ``quick`` trades precision for a run in seconds."""

    quick: bool = False
    max_samples: Optional[int] = None  # cap on samples per case (``--samples``)

    @property
    def rounds(self) -> int:
        return 2 if self.quick else 20

    @property
    def samples(self) -> int:  # default samples per case
        n = 150 if self.quick else 3000
        return min(n, self.max_samples) if self.max_samples else n

    @property
    def min_samples(self) -> int:
        n = 5 if self.quick else 20
        return min(n, self.max_samples) if self.max_samples else n

    @property
    def case_budget_ns(self) -> float:  # timed time per case (before min_samples)
        return 0.08e9 if self.quick else 2.0e9

    @property
    def target_sample_ns(self) -> float:
        return 20e3

    @property
    def warmup_ns(self) -> float:
        return 1e6 if self.quick else 5e6

    def cap(self, n: int) -> int:
        return max(1, min(n, self.max_samples)) if self.max_samples else max(1, n)


@dataclass(frozen=True)
class Calibration:
    """The harness's own cost, measured on this machine at the start of the run."""

    timer_ns: float  # one empty sample: two perf_counter_ns reads and the loop set-up
    call_ns: float  # one loop iteration calling a no-op Python function
    resolution_ns: float  # perf_counter resolution the OS reports
    slowdown: float = 1.0  # median over quietest call_ns of the blocks: > 1 when others were busy

    def as_dict(self) -> dict:
        return {
            "timer_overhead_ns": self.timer_ns,
            "call_overhead_ns": self.call_ns,
            "clock_resolution_ns": self.resolution_ns,
            "subtracted": True,
            "probe_slowdown": round(self.slowdown, 3),
        }


def _sample(fn: Callable[[], object], inner: int) -> int:
    t0 = _clock()
    for _ in range(inner):
        fn()
    return _clock() - t0


def _noop() -> None:
    return None


def _calibration_block(per: int, inner: int = 200) -> tuple:
    empty = np.array([_sample(_noop, 0) for _ in range(per)], dtype=np.float64)
    timer = float(np.median(empty))
    loops = np.array([_sample(_noop, inner) for _ in range(max(10, per // 10))], dtype=np.float64)
    return timer, max(0.0, (float(np.median(loops)) - timer) / inner)


def calibrate(samples: int = 3000, blocks: int = 5) -> Calibration:
    """Measure ``timer_ns`` and ``call_ns``: medians over ``blocks`` blocks of samples (GC off)."""
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(200):
            _sample(_noop, 0)
        got = [_calibration_block(max(50, samples // blocks)) for _ in range(blocks)]
    finally:
        if was:
            gc.enable()
    return _combine(got)


def _combine(blocks: List[tuple]) -> Calibration:
    """The median of the blocks; how much slower that is than the quietest block says how
    much other processes slowed this one (the no-op loop is a fixed amount of work)."""
    res = time.get_clock_info("perf_counter").resolution * 1e9
    calls = [b[1] for b in blocks]
    call = float(np.median(calls))
    quiet = min(calls)
    return Calibration(
        timer_ns=float(np.median([b[0] for b in blocks])),
        call_ns=call,
        resolution_ns=res,
        slowdown=call / quiet if quiet > 0 else 1.0,
    )


@dataclass(eq=False)
class Case:
    """One implementation of one operation: ``fn()`` is a call (or a batch) to time.

    ``inner=None`` picks the calls per sample from the warm-up; a case whose state allows
    only so many calls between resets fixes ``inner`` and restores the state in ``teardown``
    (run after every sample, untimed). ``setup`` runs before every sample, untimed.
    """

    impl: str  # "kvblocks", "python", "vllm", "numpy-2d", ...
    fn: Callable[[], object]
    inner: Optional[int] = None
    setup: Optional[Callable[[], object]] = None
    teardown: Optional[Callable[[], object]] = None
    samples: Optional[int] = None  # None: Settings.samples
    min_samples: Optional[int] = None  # None: Settings.min_samples
    warmup: bool = True
    check: Optional[Callable[[], object]] = None  # run once after timing (a correctness check)
    # filled by the runner
    _inner: int = 0
    _want: int = 0
    _got: List[np.ndarray] = field(default_factory=list)

    def one(self, inner: int) -> int:
        if self.setup is not None:
            self.setup()
        ns = _sample(self.fn, inner)
        if self.teardown is not None:
            self.teardown()
        return ns


@dataclass
class Op:
    """An operation as the tables show it: one row, one case per implementation.

    ``unit`` names what ``units`` counts per call ("block", "seq", "call"), giving the
    ns-per-unit column. Several ops may share a baseline case (it is timed once).
    """

    id: str  # stable key across runs and JSON files, e.g. "allocate_free/n=16"
    label: str
    unit: str
    units: int
    cases: List[Case]
    note: str = ""


@dataclass(frozen=True)
class Stats:
    """Per-call ns of one case, overhead subtracted."""

    samples: np.ndarray  # float64 ns per call, one per sample
    inner: int

    def as_dict(self, units: int) -> dict:
        a = self.samples
        p50 = float(np.percentile(a, 50))
        return {
            "p50_ns": p50,
            "p99_ns": float(np.percentile(a, 99)),
            "mean_ns": float(a.mean()),
            "min_ns": float(a.min()),
            "max_ns": float(a.max()),
            "ns_per_unit": p50 / units,
            "samples": int(a.size),
            "inner": self.inner,
        }


def _prepare(case: Case, s: Settings, cal: Calibration) -> None:
    """Warm up, fix ``inner`` and the number of samples wanted."""
    inner = case.inner or 1
    spent = 0.0
    per_call = None
    if case.warmup:
        warm: List[float] = []
        while spent < s.warmup_ns and len(warm) < 200:
            ns = case.one(inner)
            spent += ns
            warm.append(max(ns - cal.timer_ns, 0.0) / inner)
            if case.inner is None and len(warm) == 1:  # grow the batch towards the target
                inner = int(min(10_000, max(1, s.target_sample_ns // max(warm[0], 1.0))))
        per_call = float(np.median(warm[1:] if len(warm) > 1 else warm))
    if case.inner is None and per_call is not None:
        inner = int(min(10_000, max(1, s.target_sample_ns // max(per_call, 1.0))))
    case._inner = inner
    want = s.cap(case.samples) if case.samples is not None else s.samples
    floor = case.min_samples if case.min_samples is not None else s.min_samples
    if per_call is not None:  # cap by the time budget, keeping a floor
        by_budget = int(s.case_budget_ns // max(per_call * inner, 1.0))
        want = max(min(want, by_budget), min(floor, want))
    case._want = max(1, want)
    case._got = []


def run_ops(
    ops: List[Op],
    s: Settings,
    cal: Calibration,
    progress: Optional[Callable[[int, int], None]] = None,
) -> Tuple[Dict[int, Stats], Calibration]:
    """Time every distinct case of ``ops``; returns ``{id(case): Stats}`` and the calibration
    subtracted (``cal``'s blocks and one more per round, combined)."""
    cases: List[Case] = []
    seen = set()
    for op in ops:
        for c in op.cases:
            if id(c) not in seen:
                seen.add(id(c))
                cases.append(c)
    rounds = s.rounds
    total = len(cases) * (rounds + 1)
    done = 0
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        for c in cases:
            _prepare(c, s, cal)
            done += 1
            if progress:
                progress(done, total)
        blocks = [(cal.timer_ns, cal.call_ns)]
        for r in range(rounds):
            blocks.append(_calibration_block(300))
            for c in cases:
                n = c._want // rounds + (1 if r < c._want % rounds else 0)
                if n:
                    if c.warmup and r > 0:
                        c.one(c._inner)  # one untimed sample after the other cases ran
                    c._got.append(np.array([c.one(c._inner) for _ in range(n)], dtype=np.float64))
                done += 1
                if progress:
                    progress(done, total)
        for c in cases:
            if c.check is not None:
                c.check()
    finally:
        if was:
            gc.enable()
    cal = _combine(blocks)
    out = {}
    for c in cases:
        raw = np.concatenate(c._got)
        per_call = np.maximum(raw / c._inner - cal.timer_ns / c._inner - cal.call_ns, 0.0)
        out[id(c)] = Stats(samples=per_call, inner=c._inner)
        c._got = []
    return out, cal


# ---------------------------------------------------------------------------------------------
# the simple loop of the standalone scripts (benchmarks/): batches, GC off, p50/p99
# ---------------------------------------------------------------------------------------------
def timer_overhead_ns(samples: int = 2000) -> float:
    """Median cost of one ``perf_counter_ns`` pair (what the standalone scripts report)."""
    t = _clock
    d = [-(t() - t()) for _ in range(samples)]
    return float(np.median(d))


def measure(
    fn: Callable[[], object],
    *,
    inner: int,
    repeats: int,
    setup: Optional[Callable[[], object]] = None,
    teardown: Optional[Callable[[], object]] = None,
) -> dict:
    """Time ``inner`` calls of ``fn()`` per sample, ``repeats`` samples, GC off; ns per call
    (``setup`` / ``teardown`` run around each sample, untimed). For a standalone script that
    times one thing; the suites of ``kvblocks bench`` use :func:`run_ops`."""
    samples = []
    gc_was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(repeats):
            if setup:
                setup()
            t0 = _clock()
            for _ in range(inner):
                fn()
            t1 = _clock()
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
