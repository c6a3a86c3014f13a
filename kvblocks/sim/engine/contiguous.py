"""The contrast: the same workload under contiguous max-length reservation.

Before paging, engines (FasterTransformer, Orca) gave each sequence one contiguous KV region
sized for the longest sequence they accept, reserved at admission. Nothing is shared (no
prefix cache; each parallel sample gets its own region) and nothing is ever preempted, so the
replay needs no allocator: a request of ``n`` samples takes ``n`` of the
``floor(KV slots / max length)`` regions.

This is its own, simpler loop, not the paged engine (:mod:`kvblocks.sim.engine.paged`). It shares
with it the engine's knobs (:class:`SchedulerConfig`: token budget, sequence limit), the
chunked prefill (:meth:`StepBudget.take_chunk`: decodes first, then running prompts, then
admissions), the :class:`TimeModel` and the progress reports. It differs where reservation
does: a request's ``n`` samples run as one job, admitted first come first served while regions
and the sequence limit allow (no watermark, no ``can_add``); a request longer than the
reservation, or with more samples than there are regions, is rejected when it reaches the
head of the queue; there is no preemption or swap. Steps in which only decoding happens and nothing can change are fast-forwarded in one
jump (their duration is summed exactly), which keeps replays of long traces short even when
the reservation admits only a handful of sequences (not for hybrid models, whose reads and
rings do not grow by one token a step).

A hybrid model's region (``cfg.layout``) reserves ``max_len`` slots in each full-attention
group, a ring of the window or chunk in each such group, and its blocks in each state group.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Deque, List, Optional

import numpy as np

from ..workload.traces import Request, Workload
from .batching import SchedulerConfig, StepBudget
from .metrics import Recorder, SimResult
from .progress import Progress, ProgressThrottle
from .timing import TimeModel

__all__ = ["simulate_contiguous"]


class _Job:
    __slots__ = ("req", "n", "prompt_len", "output_len", "gen", "ctx", "prefill_left")

    def __init__(self, req: Request) -> None:
        self.req = req
        self.n = req.n
        self.prompt_len = req.prompt_len
        self.output_len = req.output_len
        self.gen = 0
        self.ctx = req.prompt_len
        self.prefill_left = req.prompt_len


def _steps_until(elapsed: float, base: float, slope: float, limit: int) -> int:
    """Fewest k >= 1 with k*base + slope*k*(k-1)/2 >= elapsed (at most ``limit``)."""

    def total(k: int) -> float:
        return k * base + slope * k * (k - 1) / 2.0

    if elapsed <= 0:
        return 1
    if slope <= 0:
        if base <= 0:
            return limit
        k = math.ceil(elapsed / base)
    else:
        a, b = slope / 2.0, base - slope / 2.0
        k = math.ceil((-b + math.sqrt(b * b + 4 * a * elapsed)) / (2 * a))
    k = max(1, min(limit, k))
    while k > 1 and total(k - 1) >= elapsed:
        k -= 1
    while k < limit and total(k) < elapsed:
        k += 1
    return k


def simulate_contiguous(
    workload: Workload,
    cfg: SchedulerConfig,
    tm: TimeModel,
    max_len: int,
    progress: Optional[Progress] = None,
) -> SimResult:
    """Replay ``workload`` with each sequence reserving ``max_len`` contiguous KV slots."""
    wall0 = time.perf_counter()
    capacity = cfg.num_blocks * cfg.block_size  # the same KV memory as the paged run
    lay = cfg.layout if cfg.layout is not None and cfg.layout.hybrid else None
    # a hybrid model's region: max_len slots per full group, a ring of its span per window or
    # chunk group, its blocks per state group (GroupLayout.reserve_slots)
    region = lay.reserve_slots(max_len) if lay is not None else max_len
    regions = capacity // region
    windowed = tm.windowed_reads
    reqs = workload.requests
    n_req = len(reqs)
    rec = Recorder(
        np.array([r.arrival for r in reqs], dtype=np.float64),
        capacity,
        np.array([r.output_len * r.n for r in reqs], dtype=np.int64),
        np.array([r.n for r in reqs], dtype=np.int64),
        (cfg.slo_ttft_s, cfg.slo_tpot_s),
    )
    waiting: Deque[_Job] = deque()
    running: List[_Job] = []
    in_use = 0  # regions reserved
    n_seqs = 0  # sequences running (samples count one each)
    n_waiting = 0  # sequences queued
    nxt = 0
    now = reqs[0].arrival if n_req else 0.0
    finished = 0
    steps = 0
    tick = ProgressThrottle(progress) if progress is not None else None

    while True:
        while nxt < n_req and reqs[nxt].arrival <= now:
            waiting.append(_Job(reqs[nxt]))
            n_waiting += reqs[nxt].n
            nxt += 1
        if not running and not waiting:
            if nxt >= n_req:
                break
            now = reqs[nxt].arrival
            continue
        decoders = [j for j in running if j.prefill_left == 0]
        n_dec = sum(j.n for j in decoders)
        budget = StepBudget(cfg.token_budget - n_dec)
        for j in running:
            if j.prefill_left and budget.left > 0:
                budget.take_chunk(j)
        admitted = False
        while waiting and budget.left > 0:
            j = waiting[0]
            if j.prompt_len + j.output_len - 1 > max_len or j.n > regions:
                waiting.popleft()
                n_waiting -= j.n
                rec.rejected[j.req.index] = True
                finished += 1
                continue
            if in_use + j.n > regions or (running and n_seqs + j.n > cfg.max_num_seqs):
                break
            waiting.popleft()
            n_waiting -= j.n
            running.append(j)
            in_use += j.n
            n_seqs += j.n
            admitted = True
            i = j.req.index
            rec.admit[i] = now
            rec.prompt_tokens[i] = j.prompt_len
            budget.take_chunk(j)

        pf_tokens = budget.prefill_tokens
        if windowed:
            kv_read = tm.kv_tokens_read(
                np.repeat([j.ctx for j in decoders], [j.n for j in decoders])
            )
        else:
            kv_read = sum(j.n * j.ctx for j in decoders)
        if lay is not None:
            live = sum(j.n * lay.live_slots(j.ctx) for j in running)
        else:
            live = sum(j.n * j.ctx for j in running)
        k = 1
        if (decoders and not pf_tokens and not admitted and len(decoders) == len(running)
                and not windowed and lay is None):  # fmt: skip
            # nothing but decoding: jump to the next finish or the next admissible arrival
            k = min(j.output_len - j.gen for j in decoders)
            base = tm.step(0, n_dec, kv_read + n_dec)
            slope = tm.step(0, n_dec, kv_read + 2 * n_dec) - base
            if nxt < n_req and in_use < regions and not waiting:
                k = _steps_until(reqs[nxt].arrival - now, base, slope, k)
            dt = k * base + slope * k * (k - 1) / 2.0
        else:
            pairs, reads = tm.prefill_attention(budget.chunks) if budget.chunks else (0.0, 0.0)
            dt = tm.step(pf_tokens, n_dec, kv_read + n_dec, 0, pairs, reads)
        reserved = in_use * region
        live_mid = live + n_dec * (k + 1) / 2.0 if lay is None else live
        rec.step(now, dt, reserved, reserved - live_mid, n_seqs, n_waiting, steps=k)
        now += dt
        steps += k

        done: List[_Job] = []
        for j in decoders:
            j.gen += k
            j.ctx += k
            if j.gen >= j.output_len:
                done.append(j)
        for j in budget.completed:
            j.gen += 1
            rec.first_token[j.req.index] = now
            if j.gen >= j.output_len:
                done.append(j)
        if done:
            for j in done:
                rec.finish[j.req.index] = now
                in_use -= j.n
                n_seqs -= j.n
                finished += 1
            running = [j for j in running if j.gen < j.output_len]
        if tick is not None:
            tick.step(steps, finished, now)

    if tick is not None:
        tick.close(finished, now)
    rec.counters.update(
        {
            "preemptions": 0,
            "evictions": 0,
            "max_len": max_len,
            "region_slots": region,
            "regions": regions,
            "wall_s": time.perf_counter() - wall0,
        }
    )
    return SimResult("contiguous", rec.summary(), rec)
