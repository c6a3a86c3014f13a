"""The paged engine's sequences and the moves between its queues.

:class:`SequenceQueues` holds the manager, the queues (``waiting``, ``swapped``, ``running``,
``prefilling``, the decode set), the recorder and the counters those moves update; its methods
are the moves themselves, each one ``BlockManager`` call (timed into ``alloc_s``): admit a
queued sequence (``_add``), swap one back in, preempt the newest running one (swap or
recompute), fork parallel samples, free a finished sequence, reject one that cannot fit.
:class:`~kvblocks.sim.engine.paged.PagedEngine` decides when, a step at a time.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, List, TypeVar

import numpy as np

from ... import BlockManager, OutOfBlocksError
from ..workload.tokens import stream
from ..workload.traces import Workload
from .batching import SchedulerConfig
from .metrics import Recorder
from .sequences import Decoding, Seq

__all__ = ["SequenceQueues"]

_perf = time.perf_counter
_T = TypeVar("_T")


class SequenceQueues:
    """A manager, its sequences' queues, the recorder, and the moves between the queues."""

    def __init__(self, mgr: BlockManager, workload: Workload, cfg: SchedulerConfig) -> None:
        self.workload = workload
        self.cfg = cfg
        self.mgr = mgr
        self.host_tier = cfg.host_cache_blocks > 0
        self.pool = self.mgr.pool
        self.usable = self.pool.num_blocks - 1  # blocks a sequence can get (not the null block)
        reqs = workload.requests
        self.rec = Recorder(
            np.array([r.arrival for r in reqs], dtype=np.float64),
            self.usable * cfg.block_size,
            np.array([r.output_len * r.n for r in reqs], dtype=np.int64),
            np.array([r.n for r in reqs], dtype=np.int64),
            (cfg.slo_ttft_s, cfg.slo_tpot_s),
        )
        self.remaining_samples = np.array([r.n for r in reqs], dtype=np.int64)  # per request
        self.now = reqs[0].arrival if reqs else 0.0  # simulated seconds
        self.steps = 0
        self.finished_reqs = 0  # requests done or rejected
        # queues
        self.waiting: Deque[Seq] = deque()  # arrival order; preempted (recompute) ones first
        self.swapped: Deque[Seq] = deque()
        self.running: List[Seq] = []  # admission order; the tail is preempted first
        self.prefilling: List[Seq] = []  # running sequences still in prefill, admission order
        self.decoding = Decoding()  # running sequences past their prefill
        self.forked_live = 0  # live sequences of requests with n > 1 (copy-on-write possible)
        self.next_uid = 0
        self.waiting_tokens = 0  # tokens of the sequences in ``waiting`` (to add, then compute)
        # counters of the report
        self.alloc_s = 0.0  # seconds inside BlockManager calls
        self.preempt_recompute = 0
        self.preempt_swap = 0
        self.cow_copies = 0
        self.swapped_blocks = 0  # blocks moved either way
        self.readds = 0  # re-admissions after recompute preemption
        self.fork_requeued = 0  # siblings queued because their state copy found no room
        self.readd_cached = 0  # their tokens served by the prefix cache
        self.host_hit_tokens = 0  # first-admission prompt tokens served from the host tier

    def _pop_waiting(self) -> None:
        s = self.waiting.popleft()
        self.waiting_tokens -= s.prompt_len + s.gen

    def _timed(self, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, its wall time (exception or not) added to ``alloc_s``."""
        t0 = _perf()
        try:
            return fn(*args)
        finally:
            self.alloc_s += _perf() - t0

    def _tokens(self, s: Seq) -> np.ndarray:
        """What ``s`` holds: its prompt, then the tokens it generated."""
        base = self.workload.prompt_tokens(s.req)
        if s.gen == 0:
            return base
        return np.concatenate([base, stream(s.seed, 0, s.gen)])

    def _add(self, s: Seq) -> bool:
        """Admit queued ``s`` into the manager if ``can_add`` and ``add`` let it; records the hit."""
        ntok = s.prompt_len + s.gen
        if not self._timed(self.mgr.can_add, ntok):
            return False
        rec = self.rec
        i = s.req.index
        first = s.sample == 0 and s.gen == 0 and not np.isfinite(rec.admit[i])
        tokens = self._tokens(s)
        onloads_before = self.mgr.num_pending_onloads if self.host_tier else 0
        t0 = _perf()
        try:
            cached = int(self.mgr.add(s.uid, tokens, recompute=not first))
        except OutOfBlocksError:
            return False
        finally:
            self.alloc_s += _perf() - t0
        host = 0
        if self.host_tier:  # the prefix's host part: (host, device) copies for the drain
            host = (self.mgr.num_pending_onloads - onloads_before) * self.cfg.block_size
        if first:
            rec.admit[i] = self.now
            rec.prompt_tokens[i] = ntok
            rec.cached_tokens[i] = cached
            self.host_hit_tokens += host
        else:
            self.readds += 1
            self.readd_cached += cached
        s.ctx = ntok
        s.prefill_left = ntok - cached
        s.q0 = min(cached, ntok - 1)
        return True

    def _swap_in(self, s: Seq) -> bool:
        """Bring the head of ``swapped`` back to the device; False when the pool cannot hold it."""
        try:
            pairs = self._timed(self.mgr.swap_in, s.uid)
        except OutOfBlocksError:
            return False
        self.swapped.popleft()
        self.swapped_blocks += len(pairs)
        self.running.append(s)
        return True

    def _preempt(self, victim: Seq) -> int:
        """Preempt ``victim``, the tail of ``running``; returns its decode index or -1.

        A victim that was the only running sequence outgrew the whole pool: swapping it out
        and back would repeat forever, so it is recomputed (and rejected when re-added)."""
        self.running.pop()
        idx = -1
        if victim.prefill_left > 0:
            self.prefilling.remove(victim)
        else:
            idx = self.decoding.remove(victim)
        if self.cfg.preemption == "swap" and self.running:
            try:
                pairs = self._timed(self.mgr.swap_out, victim.uid)
            except OutOfBlocksError:
                pairs = None  # host memory full: fall back to recompute
            if pairs is not None:
                self.swapped_blocks += len(pairs)
                self.swapped.append(victim)
                self.preempt_swap += 1
                return idx
        self._timed(self.mgr.free, victim.uid)
        victim.prefill_left = 0
        self.waiting.appendleft(victim)
        self.waiting_tokens += victim.prompt_len + victim.gen
        self.preempt_recompute += 1
        return idx

    def _fork(self, s: Seq) -> List[Seq]:
        """Fork the ``n - 1`` siblings of ``s`` after its prefill (they share every block).

        A fork copies state groups' blocks at once (hybrid models with recurrent state); a
        sibling whose copy finds no free blocks is queued first in line instead, to prefill
        its prompt again like a recompute-preempted sequence."""
        self.forked_live += 1 + s.forks
        children = []
        for k in range(1, s.forks + 1):
            child = Seq(self.next_uid, s.req, k)
            self.next_uid += 1
            try:
                self._timed(self.mgr.fork, s.uid, child.uid)
            except OutOfBlocksError:
                self.waiting.appendleft(child)
                self.waiting_tokens += child.prompt_len
                self.fork_requeued += 1
                continue
            child.gen, child.ctx, child.q0 = s.gen, s.ctx, s.q0
            self.running.append(child)
            children.append(child)
        s.forks = 0
        return children

    def _free(self, s: Seq, t: float) -> None:
        """``s`` produced all its tokens at time ``t``: free it; its request may be done."""
        s.done = True
        self._timed(self.mgr.free, s.uid)
        if s.req.n > 1:
            self.forked_live -= 1
        i = s.req.index
        self.remaining_samples[i] -= 1
        if self.remaining_samples[i] == 0:
            self.rec.finish[i] = t
            self.finished_reqs += 1

    def _reject(self, s: Seq) -> None:
        """``s`` cannot fit even in an empty cache: its request is rejected."""
        i = s.req.index
        self.rec.rejected[i] = True
        self.remaining_samples[i] -= 1 + s.forks
        if self.remaining_samples[i] <= 0:
            self.finished_reqs += 1
