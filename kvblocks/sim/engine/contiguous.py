"""The contrast: the same workload under contiguous max-length reservation.

Before paging, engines (FasterTransformer, Orca) gave each sequence one contiguous KV region
sized for the longest sequence they accept, reserved at admission. Nothing is shared (no
prefix cache; each parallel sample gets its own region) and nothing is ever preempted, so the
replay needs no allocator: a request of ``n`` samples takes ``n`` of the
``floor(KV slots / max length)`` regions.

It needs no allocator, so it is its own, simpler engine (:class:`ContiguousEngine`), not the
paged one (:mod:`kvblocks.sim.engine.paged`), in the paged engine's shape: the same replay loop
(:func:`~kvblocks.sim.engine.replay.replay`: arrivals, idle gaps, steps), a step in the same
phases (decode, prefill, admit, time, finish), one method each. It shares with it the engine's
knobs (:class:`SchedulerConfig`: token budget, sequence limit), the
chunked prefill (:meth:`StepBudget.take_chunk`: decodes first, then running prompts, then
admissions), the :class:`TimeModel` and the progress reports. It differs where reservation
does: a request's ``n`` samples run as one job, admitted first come first served while regions
and the sequence limit allow (no watermark, no ``can_add``); a request longer than the
reservation, or with more samples than there are regions, is rejected when it reaches the
head of the queue; there is no preemption or swap. Steps in which only decoding happens and nothing can change are fast-forwarded in one
jump (their duration is summed exactly), which keeps replays of long traces short even when
the reservation admits only a handful of sequences (not for hybrid models, whose reads and
rings do not grow by one token a step).

Three reservation policies, the baselines of the PagedAttention paper (``policy``):

- ``max`` (the default): every sequence reserves ``max_len`` slots at admission;
- ``pow2``: a sequence reserves the next power of two of its length (at most ``max_len``) and,
  when a decode outgrows it, re-reserves the next power of two elsewhere and copies (the copy
  is counted, ``regrow_copies`` / ``regrow_copied_tokens``, not timed); when no hole fits the
  larger region, the most recently admitted job is preempted (recompute: freed and queued at
  the head again);
- ``oracle``: a sequence reserves exactly its final length, ``prompt + output - 1`` (the last
  token's K/V is never written), known in advance.

Reservations are placed by a first-fit contiguous allocator over the KV slots
(:class:`FirstFit`). The waste of allocated memory splits into *reserved* (slots a sequence
will still write: its final length, within its reservation, minus what it holds now) and
*internal fragmentation* (slots of a reservation it will never write); *external
fragmentation* is free memory while the head of the queue is blocked although enough memory is
free in total (no hole fits its reservation). Time-weighted, the first two as shares of the
allocated slots (they sum to ``internal_fragmentation``, the report's "all waste"), the third
as a share of the pool: keys ``waste_reserved``, ``waste_internal``, ``waste_external``. Under
``max`` all regions are one size, so no hole is ever too small: external fragmentation is 0.

A hybrid model's region (``cfg.layout``) reserves ``max_len`` slots in each full-attention
group, a ring of the window or chunk in each such group, and its blocks in each state group.
"""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Deque, List, Optional, Tuple

import numpy as np

from ..errors import SimulationError
from ..workload.traces import Request, Workload
from .batching import SchedulerConfig, StepBudget
from .metrics import Recorder, SimResult
from .progress import Progress
from .replay import replay
from .timing import TimeModel

__all__ = ["ContiguousEngine", "FirstFit", "POLICIES", "simulate_contiguous"]

POLICIES = ("max", "pow2", "oracle")


class FirstFit:
    """A first-fit contiguous allocator over ``capacity`` slots: the free holes, by offset."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.holes: List[List[int]] = [[0, capacity]] if capacity > 0 else []  # [offset, size]
        self.free = capacity

    def alloc(self, size: int) -> Optional[int]:
        """The offset of the first hole of at least ``size`` slots, taken; None if none fits."""
        for i, h in enumerate(self.holes):
            if h[1] >= size:
                off = h[0]
                if h[1] == size:
                    del self.holes[i]
                else:
                    h[0] += size
                    h[1] -= size
                self.free -= size
                return off
        return None

    def release(self, off: int, size: int) -> None:
        """Give ``size`` slots at ``off`` back, merging with the neighbouring holes."""
        holes = self.holes
        i = 0
        while i < len(holes) and holes[i][0] < off:
            i += 1
        holes.insert(i, [off, size])
        if i + 1 < len(holes) and off + size == holes[i + 1][0]:
            holes[i][1] += holes[i + 1][1]
            del holes[i + 1]
        if i > 0 and holes[i - 1][0] + holes[i - 1][1] == off:
            holes[i - 1][1] += holes[i][1]
            del holes[i]
        self.free += size


def _pow2(n: int) -> int:
    """The least power of two >= n (n >= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


class _Job:
    __slots__ = ("req", "n", "prompt_len", "output_len", "gen", "ctx", "prefill_left",
                 "final", "res", "slots", "offs")  # fmt: skip

    def __init__(self, req: Request) -> None:
        self.req = req
        self.n = req.n
        self.prompt_len = req.prompt_len
        self.output_len = req.output_len
        self.gen = 0
        self.ctx = req.prompt_len
        self.prefill_left = req.prompt_len
        self.final = req.prompt_len + req.output_len - 1  # K/V slots it ever writes
        self.res = 0  # tokens reserved per sample
        self.slots = 0  # slots that reservation takes per sample (hybrid: rings, states)
        self.offs: List[int] = []  # one region per sample


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


class ContiguousEngine:
    """One engine under contiguous max-length reservation, advanced a step at a time.

    State: the queue of jobs (a request's samples run as one job), the running jobs in admission
    order, the regions reserved, the clock ``now`` and the recorder."""

    def __init__(
        self,
        workload: Workload,
        cfg: SchedulerConfig,
        tm: TimeModel,
        max_len: int,
        policy: str = "max",
    ) -> None:
        if policy not in POLICIES:
            raise SimulationError(
                f"unknown contiguous policy {policy!r} (choose from {', '.join(POLICIES)})"
            )
        self.policy = policy
        self.wall0 = time.perf_counter()
        self.workload = workload
        self.cfg = cfg
        self.tm = tm
        self.max_len = max_len
        capacity = cfg.num_blocks * cfg.block_size  # the same KV memory as the paged run
        lay = cfg.layout if cfg.layout is not None and cfg.layout.hybrid else None
        self.lay = lay
        # a hybrid model's region: max_len slots per full group, a ring of its span per window
        # or chunk group, its blocks per state group (GroupLayout.reserve_slots)
        self.region = lay.reserve_slots(max_len) if lay is not None else max_len
        self.regions = capacity // self.region
        self.capacity = capacity
        self.mem = FirstFit(capacity)
        self._w = [0.0, 0.0, 0.0]  # time-weighted reserved, internal, external slots
        self.blocked_external = False  # this step's head of queue found no hole (enough free)
        self.preemptions = 0
        self.copies = 0
        self.copied_tokens = 0
        self.windowed = tm.windowed_reads
        reqs = workload.requests
        self.rec = Recorder(
            np.array([r.arrival for r in reqs], dtype=np.float64),
            capacity,
            np.array([r.output_len * r.n for r in reqs], dtype=np.int64),
            np.array([r.n for r in reqs], dtype=np.int64),
            (cfg.slo_ttft_s, cfg.slo_tpot_s),
        )
        self.waiting: Deque[_Job] = deque()
        self.running: List[_Job] = []
        self.in_use = 0  # regions reserved
        self.n_seqs = 0  # sequences running (samples count one each)
        self.n_waiting = 0  # sequences queued
        self.now = reqs[0].arrival if reqs else 0.0
        self.finished_reqs = 0  # requests done or rejected
        self.steps = 0
        self.horizon = math.inf  # the next arrival (replay): a fast-forward stops there

    @property
    def idle(self) -> bool:
        """Nothing running or queued."""
        return not self.running and not self.waiting

    def submit(self, req: Request) -> None:
        """A request arrives: its samples queue as one job."""
        self.waiting.append(_Job(req))
        self.n_waiting += req.n

    def step(self) -> float:
        """Run one step, or fast-forward over steps in which only decoding happens (stopping at
        the next finish or at ``horizon``, the next arrival); returns the time it took."""
        if self.policy == "pow2":
            self._grow()
        self.blocked_external = False
        decoders = [j for j in self.running if j.prefill_left == 0]
        n_dec = sum(j.n for j in decoders)
        budget = StepBudget(self.cfg.token_budget - n_dec)
        self._prefill(budget)
        admitted = self._admit(budget)
        k, dt = self._advance(decoders, n_dec, budget, admitted)
        self._finish(decoders, budget.completed, k)
        return dt

    def run(self, progress: Optional[Progress] = None) -> SimResult:
        """Replay the whole workload (:func:`~kvblocks.sim.engine.replay.replay`)."""
        replay(self, self.workload.requests, progress)
        return self.result()

    def result(self) -> SimResult:
        """The summary and the recorder, with the reservation's figures."""
        busy = self.rec._busy
        used = self.rec._w_used
        w_res, w_int, w_ext = self._w
        self.rec.counters.update(
            {
                "policy": self.policy,
                "waste_reserved": w_res / used if used else 0.0,
                "waste_internal": w_int / used if used else 0.0,
                "waste_external": w_ext / busy / max(1, self.capacity) if busy else 0.0,
                "regrow_copies": self.copies,
                "regrow_copied_tokens": self.copied_tokens,
                "preemptions": self.preemptions,
                "evictions": 0,
                "max_len": self.max_len,
                "region_slots": self.region,
                "regions": self.regions,
                "wall_s": time.perf_counter() - self.wall0,
            }
        )
        return SimResult("contiguous", self.rec.summary(), self.rec)

    # ----------------------------------------------------------------------------- the phases

    def _reserve_len(self, j: _Job, length: int) -> int:
        """Tokens per sample the policy reserves for a sequence of ``length`` tokens."""
        if self.policy == "max":
            return self.max_len
        if self.policy == "oracle":
            return max(1, j.final)
        return min(self.max_len, _pow2(max(1, length)))

    def _slots_of(self, tokens: int) -> int:
        return self.lay.reserve_slots(tokens) if self.lay is not None else tokens

    def _place(self, j: _Job, tokens: int) -> bool:
        """Reserve ``j.n`` regions of ``tokens`` tokens (all or none)."""
        size = self._slots_of(tokens)
        offs: List[int] = []
        for _ in range(j.n):
            off = self.mem.alloc(size)
            if off is None:
                for o in offs:
                    self.mem.release(o, size)
                return False
            offs.append(off)
        j.res, j.slots, j.offs = tokens, size, offs
        return True

    def _release(self, j: _Job) -> None:
        for o in j.offs:
            self.mem.release(o, j.slots)
        j.offs = []

    def _grow(self) -> None:
        """pow2: before the step, each decoding job whose next token does not fit re-reserves
        the next power of two and copies; with no hole for it, the youngest job is preempted."""
        for j in list(self.running):
            if j.prefill_left or j.ctx + 1 <= j.res or j not in self.running:
                continue
            want = self._reserve_len(j, j.ctx + 1)
            self._release(j)  # a hole may merge with its own region (grow in place)
            while not self._place(j, want):
                victim = self.running[-1]
                if victim is j:
                    self._preempt(j, released=True)
                    break
                self._preempt(victim)
            else:
                self.copies += j.n
                self.copied_tokens += j.n * j.ctx

    def _preempt(self, j: _Job, released: bool = False) -> None:
        """Recompute preemption: free ``j``'s regions and queue it at the head again."""
        if not released:
            self._release(j)
        self.running.remove(j)
        self.in_use -= j.n
        self.n_seqs -= j.n
        self.waiting.appendleft(j)
        self.n_waiting += j.n
        self.preemptions += 1
        j.gen, j.ctx, j.prefill_left, j.res, j.slots = 0, j.prompt_len, j.prompt_len, 0, 0

    def _prefill(self, budget: StepBudget) -> None:
        """2. Chunks of the budget for running prompts, in admission order (1, the decodes,
        took theirs first)."""
        for j in self.running:
            if j.prefill_left and budget.left > 0:
                budget.take_chunk(j)

    def _admit(self, budget: StepBudget) -> bool:
        """3. Queued jobs first come first served while regions, seats and budget allow; a job
        that can never fit is rejected at the head of the queue. Returns whether one joined."""
        admitted = False
        waiting, rec = self.waiting, self.rec
        while waiting and budget.left > 0:
            j = waiting[0]
            if (
                j.final > self.max_len
                or j.n * self._slots_of(self._reserve_len(j, j.final)) > self.capacity
                or (self.policy == "max" and j.n > self.regions)
            ):
                waiting.popleft()
                self.n_waiting -= j.n
                rec.rejected[j.req.index] = True
                self.finished_reqs += 1
                continue
            if self.running and self.n_seqs + j.n > self.cfg.max_num_seqs:
                break
            want = self._reserve_len(j, j.ctx)
            if not self._place(j, want):
                self.blocked_external = self.mem.free >= j.n * self._slots_of(want)
                break
            waiting.popleft()
            self.n_waiting -= j.n
            self.running.append(j)
            self.in_use += j.n
            self.n_seqs += j.n
            admitted = True
            i = j.req.index
            if math.isnan(rec.admit[i]):
                rec.admit[i] = self.now
                rec.prompt_tokens[i] = j.prompt_len
            budget.take_chunk(j)
        return admitted

    def _advance(
        self, decoders: List[_Job], n_dec: int, budget: StepBudget, admitted: bool
    ) -> Tuple[int, float]:
        """4. The step's duration (``k`` steps of it when only decoding happens) and its
        sample; the clock moves. Returns ``(k, seconds)``."""
        tm, lay = self.tm, self.lay
        pf_tokens = budget.prefill_tokens
        if self.windowed:
            kv_read = tm.kv_tokens_read(
                np.repeat([j.ctx for j in decoders], [j.n for j in decoders])
            )
        else:
            kv_read = sum(j.n * j.ctx for j in decoders)
        if lay is not None:
            live = sum(j.n * lay.live_slots(j.ctx) for j in self.running)
        else:
            live = sum(j.n * j.ctx for j in self.running)
        k = 1
        if (decoders and not pf_tokens and not admitted and len(decoders) == len(self.running)
                and not self.windowed and lay is None):  # fmt: skip
            # nothing but decoding: jump to the next finish or the next admissible arrival
            k = min(j.output_len - j.gen for j in decoders)
            if self.policy == "pow2":  # stop where the next one outgrows its reservation
                k = max(1, min(k, min(j.res - j.ctx for j in decoders)))
            base = tm.step(0, n_dec, kv_read + n_dec)
            slope = tm.step(0, n_dec, kv_read + 2 * n_dec) - base
            until = self.horizon
            room = self.mem.free >= self.region if self.policy == "max" else self.mem.free > 0
            if math.isfinite(until) and room and not self.waiting:
                k = _steps_until(until - self.now, base, slope, k)
            dt = k * base + slope * k * (k - 1) / 2.0
        else:
            pairs, reads = tm.prefill_attention(budget.chunks) if budget.chunks else (0.0, 0.0)
            dt = tm.step(pf_tokens, n_dec, kv_read + n_dec, 0, pairs, reads)
        reserved = self.capacity - self.mem.free
        live_mid = live + n_dec * (k + 1) / 2.0 if lay is None else live
        if lay is not None:
            final = sum(j.n * min(j.slots, lay.live_slots(j.final)) for j in self.running)
        else:
            final = sum(j.n * min(j.slots, j.final) for j in self.running)
        w = self._w
        w[0] += (final - live_mid) * dt
        w[1] += (reserved - final) * dt
        if self.blocked_external:
            w[2] += self.mem.free * dt
        self.rec.step(self.now, dt, reserved, reserved - live_mid, self.n_seqs, self.n_waiting,
                      steps=k)  # fmt: skip
        self.now += dt
        self.steps += k
        return k, dt

    def _finish(self, decoders: List[_Job], completed: List[_Job], k: int) -> None:
        """5. Decodes advance ``k`` tokens; completed prefills yield their first token; finished
        jobs give their regions back."""
        now, rec = self.now, self.rec
        done: List[_Job] = []
        for j in decoders:
            j.gen += k
            j.ctx += k
            if j.gen >= j.output_len:
                done.append(j)
        for j in completed:
            j.gen += 1
            if math.isnan(rec.first_token[j.req.index]):
                rec.first_token[j.req.index] = now
            if j.gen >= j.output_len:
                done.append(j)
        if done:
            for j in done:
                rec.finish[j.req.index] = now
                self._release(j)
                self.in_use -= j.n
                self.n_seqs -= j.n
                self.finished_reqs += 1
            self.running = [j for j in self.running if j.gen < j.output_len]


def simulate_contiguous(
    workload: Workload,
    cfg: SchedulerConfig,
    tm: TimeModel,
    max_len: int,
    progress: Optional[Progress] = None,
    policy: str = "max",
) -> SimResult:
    """Replay ``workload`` with each sequence reserving contiguous KV slots: ``max_len`` each
    (``policy="max"``), powers of two (``"pow2"``) or its exact final length (``"oracle"``)."""
    return ContiguousEngine(workload, cfg, tm, max_len, policy).run(progress)
