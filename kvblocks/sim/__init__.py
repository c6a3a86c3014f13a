"""Simulator and capacity planner: the "memory bill" of serving a workload.

* :func:`simulate_paged` replays a :class:`Workload` through the real
  :class:`kvblocks.BlockManager` under a continuous-batching scheduler model
  (:class:`PagedEngine`, one engine advanced a step at a time);
* :func:`simulate_contiguous` replays it under contiguous max-length reservation;
* :func:`make_plan` counts what fits for length distributions.

The command line (``kvblocks simulate`` / ``kvblocks plan``) lives in :mod:`kvblocks.sim.cli`.
"""

from .batching import SchedulerConfig
from .contiguous import simulate_contiguous
from .errors import SimulationError, WorkloadError
from .metrics import SimResult
from .models import PRESETS, MemoryBill, ModelSpec, custom_model, get_model, memory_bill
from .plan import LengthDist, make_plan, parse_dist
from .scheduler import PagedEngine, simulate_paged
from .timing import TimeModel
from .workload import Request, Workload, builtin_workload, load_workload, prefix_reuse

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
