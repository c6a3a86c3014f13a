"""Recording a replay: per-step samples (memory, concurrency) and per-request timings.

Time-weighted means weigh each step's state by the step's duration, so a long idle gap
between arrivals counts as idle. "Internal fragmentation" is the share of allocated KV
slots holding no token: for paging, the empty tail of each sequence's last block; for the
contiguous baseline, everything reserved up to the maximum length and not yet written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["Recorder", "SimResult", "percentile", "DEFAULT_TTFT_SLO_S", "DEFAULT_TPOT_SLO_S"]

DEFAULT_TTFT_SLO_S = 2.0  # goodput targets unless --ttft-slo / --tpot-slo say otherwise
DEFAULT_TPOT_SLO_S = 0.1


def percentile(values: np.ndarray, q: float) -> Optional[float]:
    """The q-th percentile of the finite values, or None when there are none."""
    v = values[np.isfinite(values)]
    return float(np.percentile(v, q)) if v.size else None


class Recorder:
    """Collects the samples and timings one simulation produces."""

    def __init__(
        self,
        arrivals: np.ndarray,
        capacity_slots: int,
        output_tokens: np.ndarray,
        samples: Optional[np.ndarray] = None,
        slo: Tuple[float, float] = (DEFAULT_TTFT_SLO_S, DEFAULT_TPOT_SLO_S),
    ) -> None:
        n = arrivals.shape[0]
        self.capacity_slots = max(1, capacity_slots)
        self.arrival = arrivals
        self.output_tokens = output_tokens  # per request, all samples
        self.samples = samples if samples is not None else np.ones(n, dtype=np.int64)
        self.slo = slo  # (TTFT, TPOT) seconds a request must meet to count as goodput
        self.admit = np.full(n, np.nan)  # first time any of its work was scheduled
        self.first_token = np.full(n, np.nan)
        self.finish = np.full(n, np.nan)
        self.prompt_tokens = np.zeros(n, dtype=np.int64)  # prompt tokens at first admission
        self.cached_tokens = np.zeros(n, dtype=np.int64)  # of which served by the prefix cache
        self.rejected = np.zeros(n, dtype=bool)
        # per-step series (state while the step runs)
        self.t: List[float] = []
        self.used: List[int] = []  # KV slots allocated (blocks x block size, or reservations)
        self.running: List[int] = []  # sequences in the batch
        self.waiting: List[int] = []  # sequences queued (arrived, not running)
        self._busy = 0.0
        self._w_used = 0.0
        self._w_running = 0.0
        self._w_waste = 0.0
        self._peak_used = 0
        self._peak_running = 0
        self.steps = 0
        self.counters: Dict[str, Any] = {}

    def step(
        self,
        now: float,
        dt: float,
        used_slots: int,
        waste_slots: float,
        running: int,
        waiting: int,
        steps: int = 1,
    ) -> None:
        """One step (or ``steps`` identical-shape steps) lasting ``dt`` seconds in all."""
        self.t.append(now)
        self.used.append(used_slots)
        self.running.append(running)
        self.waiting.append(waiting)
        self._busy += dt
        self._w_used += used_slots * dt
        self._w_running += running * dt
        self._w_waste += waste_slots * dt
        if used_slots > self._peak_used:
            self._peak_used = used_slots
        if running > self._peak_running:
            self._peak_running = running
        self.steps += steps

    def summary(self, mask: Optional[np.ndarray] = None) -> Dict[str, Any]:
        """The numbers of the report table (seconds, fractions, counts).

        ``mask`` (bool per request) restricts the request figures to some requests (a
        cluster replica's own); the per-step figures are the recorder's in any case."""
        sel = slice(None) if mask is None else mask
        arrival = self.arrival[sel]
        admit, first, finish = self.admit[sel], self.first_token[sel], self.finish[sel]
        prompt_tokens, cached_tokens = self.prompt_tokens[sel], self.cached_tokens[sel]
        done = np.isfinite(finish)
        start = float(arrival.min()) if arrival.size else 0.0
        end = float(np.nanmax(finish)) if done.any() else start
        makespan = max(end - start, 0.0)
        busy = self._busy or 1.0
        out_tokens = int(self.output_tokens[sel][done].sum())
        prompt = int(prompt_tokens.sum())
        queue = admit - arrival
        ttft = first - arrival
        e2e = finish - arrival
        # time per output token after the first, per request (one-token outputs: 0)
        per_sample = self.output_tokens[sel] // np.maximum(self.samples[sel], 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(per_sample > 1, (finish - first) / np.maximum(per_sample - 1, 1), 0.0)
        tpot[~done] = np.nan
        good = done & (ttft <= self.slo[0]) & (tpot <= self.slo[1])
        res: Dict[str, Any] = {
            "requests": int(arrival.size),
            "completed": int(done.sum()),
            "rejected": int(self.rejected[sel].sum()),
            "steps": int(self.steps),
            "makespan_s": makespan,
            "peak_kv_usage": self._peak_used / self.capacity_slots,
            "mean_kv_usage": self._w_used / busy / self.capacity_slots,
            "peak_concurrency": int(self._peak_running),
            "mean_concurrency": self._w_running / busy,
            "internal_fragmentation": (self._w_waste / self._w_used) if self._w_used else 0.0,
            "prefix_hit_rate": (float(cached_tokens.sum()) / prompt) if prompt else 0.0,
            "prompt_tokens": prompt,
            "cached_tokens": int(cached_tokens.sum()),
            "output_tokens": out_tokens,
            "throughput_tok_s": out_tokens / makespan if makespan > 0 else 0.0,
            "throughput_req_s": int(done.sum()) / makespan if makespan > 0 else 0.0,
            "queue_p50_s": percentile(queue, 50),
            "queue_p99_s": percentile(queue, 99),
            "ttft_p50_s": percentile(ttft, 50),
            "ttft_p99_s": percentile(ttft, 99),
            "latency_p50_s": percentile(e2e, 50),
            "latency_p99_s": percentile(e2e, 99),
            "tpot_p50_s": percentile(tpot, 50),
            "tpot_p99_s": percentile(tpot, 99),
            "goodput": float(good.sum()) / arrival.size if arrival.size else 0.0,
            "goodput_req_s": float(good.sum()) / makespan if makespan > 0 else 0.0,
            "slo_ttft_s": self.slo[0],
            "slo_tpot_s": self.slo[1],
        }
        res.update(self.counters)
        return res

    def series(self, max_points: int = 4000) -> Dict[str, np.ndarray]:
        """Per-step series, thinned to at most ``max_points`` (for plots)."""
        t = np.asarray(self.t, dtype=np.float64)
        stride = max(1, t.size // max_points)
        return {
            "t": t[::stride],
            "kv_usage": np.asarray(self.used, dtype=np.float64)[::stride] / self.capacity_slots,
            "running": np.asarray(self.running, dtype=np.int64)[::stride],
            "waiting": np.asarray(self.waiting, dtype=np.int64)[::stride],
        }


@dataclass
class SimResult:
    """What a replay produced: the summary numbers and the recorder with its series."""

    name: str  # "paged" or "contiguous"
    summary: Dict[str, Any]  # numbers, strings and nested dicts, as the JSON has them
    recorder: Recorder
