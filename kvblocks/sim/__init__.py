"""Simulator and capacity planner: the "memory bill" of serving a workload.

* :func:`simulate_paged` replays a :class:`Workload` through the real
  :class:`kvblocks.BlockManager` under a continuous-batching scheduler model
  (:class:`PagedEngine`, one engine advanced a step at a time);
* :func:`simulate_contiguous` replays it under contiguous max-length reservation;
* :func:`make_plan` counts what fits for length distributions.

The command line (``kvblocks simulate`` / ``kvblocks plan``) lives in :mod:`kvblocks.sim.cli`.
The subpackages, by concern: ``engine`` (the replay: paged engine, contiguous baseline, step
budget, time model, recorder), ``tier`` (the host tier), ``cluster`` (engines behind a
router), ``plan`` (the planner), ``report`` (text, JSON, plots), ``models`` (model presets,
memory bill, GPU catalog), ``workload`` (requests, traces, token streams).
"""

from .engine.batching import SchedulerConfig
from .engine.contiguous import simulate_contiguous
from .engine.metrics import SimResult
from .engine.paged import PagedEngine, simulate_paged
from .engine.timing import TimeModel
from .errors import SimulationError, WorkloadError
from .models.spec import PRESETS, MemoryBill, ModelSpec, custom_model, get_model, memory_bill
from .plan.lengths import LengthDist, make_plan, parse_dist
from .workload.traces import Request, Workload, builtin_workload, load_workload, prefix_reuse

__all__ = [
    "simulate_paged",
    "simulate_contiguous",
    "PagedEngine",
    "SchedulerConfig",
    "SimResult",
    "TimeModel",
    "Workload",
    "Request",
    "load_workload",
    "builtin_workload",
    "prefix_reuse",
    "ModelSpec",
    "MemoryBill",
    "PRESETS",
    "get_model",
    "custom_model",
    "memory_bill",
    "LengthDist",
    "parse_dist",
    "make_plan",
    "SimulationError",
    "WorkloadError",
]
