"""The paged replay: a continuous-batching engine driving the real :class:`kvblocks.BlockManager`.

:class:`PagedEngine` models one engine (vLLM-style) with a fresh ``BlockManager``, its queues
and its clock. :meth:`PagedEngine.step` runs one engine step, in six phases, one method each:

1. **Decode** (``_decode``). Every sequence past its prefill commits the token it produced last
   step: one ``mgr.append_batch(batch, tokens)`` call for the whole batch. When the pool cannot
   grow them (``OutOfBlocksError``, which changes nothing), the most recently admitted running
   sequence is preempted and the call retried: *recompute* frees it (its computed full blocks
   stay in the prefix cache) and queues it first in line, to be re-added later
   (``mgr.add(..., recompute=True)``) with its prompt plus the tokens it had generated; *swap*
   moves its blocks to host memory (``mgr.swap_out``), falling back to recompute when host
   memory is full, and brings them back (``mgr.swap_in``) before any new admission.
2. **Prefill** (``_prefill``). Running prompts take chunks of what is left of the step's token
   budget (:meth:`StepBudget.take_chunk`).
3. **Admit** (``_admit``). Swapped sequences first, then queued ones first come first served,
   while the token budget, the sequence limit (pending forks included) and ``mgr.can_add``
   (free blocks above the watermark) allow; ``mgr.add`` allocates the whole prompt, commits its
   tokens and reports the prefix-cache hit, which needs no compute. A prompt that cannot fit
   even in an empty cache is rejected.
4. **Compute** (``_compute``). ``mgr.schedule`` declares what the step computes: the decodes'
   newest tokens and the rest of every prompt whose prefill completes in it. Only computed
   full blocks enter the prefix cache.
5. **Time** (``_advance``). The step lasts what :class:`TimeModel` says; the recorder samples
   it and the clock advances.
6. **Finish** (``_finish``). A prefill that completes yields the first token (forking ``n - 1``
   siblings for parallel sampling: ``mgr.fork`` shares every block, copy-on-write on the first
   append); a sequence that has produced all its tokens is freed.

:meth:`PagedEngine.run` is the single-engine loop (:func:`~kvblocks.sim.engine.replay.replay`,
shared with the contiguous baseline): it hands the workload's arrivals in
(:meth:`PagedEngine.submit`), jumps the clock over idle gaps and steps until every request is
done, then :meth:`PagedEngine.result` checks the pool and returns the :class:`SimResult`. A
cluster simulator can run several engines side by side through ``submit``, ``now``, ``idle``
and ``step``. :func:`simulate_paged` is ``PagedEngine(workload, cfg, tm).run(progress)``.

Between admission and compute, every step drains the manager's copy lists in the order the
host tier requires (:mod:`kvblocks.sim.tier.drain`: offloads, onloads, then copy-on-write
pairs); with a host tier (``cfg.host_cache_blocks``, :mod:`kvblocks.sim.tier.host`) the step
also waits for its PCIe copies, and the report splits the prefix hits by tier.

A cluster (:mod:`kvblocks.sim.cluster.cluster`) reads two load figures a real router gets from an
engine's metrics: ``queued_tokens`` (prompt tokens waiting or still to prefill) and
``blocks_in_use`` (blocks referenced by running sequences); with ``enable_kv_events=True`` it
drains ``pool.take_events()`` (and the host pool's) after every step.

The sequences (:mod:`~kvblocks.sim.engine.sequences`) and the moves between the queues, one
manager call each (:class:`~kvblocks.sim.engine.queues.SequenceQueues`: admit, swap, preempt,
fork, free, reject), live in their own modules; this one holds the step and the result.

**Decode-only steps in a row** (:meth:`PagedEngine._decode_only`): while nothing prefills or is
swapped out, the queue is empty or its head cannot be admitted, and no sequence can finish,
``step`` runs the steps that start before ``horizon`` (the next arrival, set by the driver; with
a blocked head, :func:`~kvblocks.sim.engine.replay.replay`'s ``feed`` queues arrivals and the run
goes on) back to back, each with the same manager calls, time and sample as a full step.

A request of prompt length P and output length O holds P + O - 1 tokens at its end (the last
token is returned, never fed back). Time inside ``BlockManager`` calls is measured
(``allocator_s``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ... import BlockManager, OutOfBlocksError
from ..errors import SimulationError
from ..tier.drain import StepCopies
from ..tier.host import host_manager_kwargs, host_stats_dict
from ..workload.traces import Request, Workload
from .batching import SchedulerConfig, StepBudget
from .metrics import SimResult
from .progress import Progress
from .queues import SequenceQueues
from .replay import replay
from .sequences import Seq
from .timing import TimeModel

__all__ = ["PagedEngine", "SchedulerConfig", "SimResult", "simulate_paged"]

_perf = time.perf_counter


class PagedEngine(SequenceQueues):
    """One continuous-batching engine over a fresh ``BlockManager``, advanced a step at a time.

    State: the manager and its pool, the queues (``waiting``, ``swapped``, ``running`` in
    admission order, ``prefilling``, the decode set), the clock ``now`` (simulated seconds),
    the recorder and the counters of the report.
    """

    def __init__(
        self,
        workload: Workload,
        cfg: SchedulerConfig,
        tm: TimeModel,
        *,
        enable_kv_events: bool = False,
        hash_key: Optional[bytes] = None,
    ) -> None:
        cfg.validate()
        self.wall0 = _perf()
        if cfg.preemption == "swap" and cfg.host_blocks <= 0:
            raise SimulationError(
                "--preemption swap needs host memory for swapped blocks (--host-mem GiB)"
            )
        self.tm = tm
        mgr = BlockManager(
            cfg.num_blocks + 1,
            cfg.block_size,
            enable_prefix_caching=cfg.enable_prefix_caching,
            watermark=cfg.watermark,
            hash_key=hash_key,
            enable_kv_events=enable_kv_events,
            groups=cfg.kv_groups,
            **host_manager_kwargs(cfg),
        )
        SequenceQueues.__init__(self, mgr, workload, cfg)
        # hybrid models: blocks held per layer kind, sampled every step (see _group_held)
        lay = cfg.layout
        self.shares = lay.shares if lay is not None and lay.hybrid else ()
        self.g_peak = np.zeros(len(self.shares), dtype=np.int64)
        self.g_time = np.zeros(len(self.shares), dtype=np.float64)  # blocks x seconds
        self._joined: List[Seq] = []  # swapped in this step, decoding from the next
        # groups with a partly filled last block per sequence (all but state groups)
        self.tail_groups = sum(sh.copies for sh in self.shares if sh.group.kind != "state") or 1
        self.copies = StepCopies(cfg.block_bytes, tm.swap_bytes_per_s)  # the step's copy lists
        # the next arrival, set by the driver before each step (replay, Cluster.run): steps that
        # start before it may run in one call (_decode_only); -inf: one step a call
        self.horizon = -math.inf
        self.kv_events = enable_kv_events  # events are taken after every step: one step a call
        # set by replay(): feed(t) queues the arrivals up to t and returns the next one's time,
        # so a decode-only run behind a blocked queue goes on past arrivals
        self.feed: Optional[Callable[[float], float]] = None
        # a cluster router's pool.lookup calls on this engine (calls, blocks, hits): the pool
        # counts them with the engine's own, the report does not
        self.router_lookups = [0, 0, 0]
        self._ones = np.ones(cfg.max_num_seqs, np.int32)  # a decode batch's query lengths

    # ----------------------------------------------------------------------------- driving

    @property
    def idle(self) -> bool:
        """Nothing to run, queued or swapped out."""
        return not self.running and not self.waiting and not self.swapped

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens not computed yet: queued sequences' and running prefills' rest."""
        return self.waiting_tokens + sum(s.prefill_left for s in self.prefilling)

    @property
    def blocks_in_use(self) -> int:
        """Device blocks referenced by sequences (cached evictable blocks are free)."""
        return self.usable - self.pool.num_free

    def submit(self, req: Request) -> None:
        """A request arrives (its first sample queues; siblings fork after its prefill)."""
        self.waiting.append(Seq(self.next_uid, req, 0))
        self.waiting_tokens += req.prompt_len
        self.next_uid += 1

    def step(self) -> float:
        """Run one engine step (it must not be idle), or, while only decoding can happen, the
        steps that start before ``horizon`` (:meth:`_decode_only`); returns the time taken."""
        if self.now < self.horizon and self._only_decoding():
            k, dt = self._decode_only()
            if k:
                return dt
        swapped_before = self.swapped_blocks
        n_dec = self._decode()
        budget = StepBudget(self.cfg.token_budget - n_dec)
        self._prefill(budget)
        joined = self._admit(budget)
        self._joined = joined
        self._drain()
        self._compute(n_dec, budget.completed)
        dt = self._advance(n_dec, budget, self.swapped_blocks - swapped_before)
        self._finish(n_dec, budget.completed, joined)
        return dt

    def run(self, progress: Optional[Progress] = None) -> SimResult:
        """Replay the whole workload: arrivals in order, idle gaps skipped, until all is done."""
        replay(self, self.workload.requests, progress)
        return self.result()

    def result(self) -> SimResult:
        """Check the pool (every block must be free) and return the summary and the recorder."""
        if self.host_tier:  # the last step's write-through offloads are still queued
            self._drain()
        wall = _perf() - self.wall0
        t0 = _perf()
        if self.host_tier:
            self.mgr.check()  # both pools and the tier's references
        else:
            self.pool.check()
        check_s = _perf() - t0
        stats = self.pool.stats
        leaked = self.usable - self.pool.num_free
        self.rec.counters.update(
            {
                "preemptions": self.preempt_recompute + self.preempt_swap,
                "preemptions_recompute": self.preempt_recompute,
                "preemptions_swap": self.preempt_swap,
                "evictions": stats.evictions,
                # the pool's own prefix-cache counters; re-admissions after recompute are
                # counted apart in the token numbers, so token_hit_rate equals prefix_hit_rate
                # BlockManager.add calls that looked up the cache
                "cache_lookups": stats.queries - self.router_lookups[0],
                # full blocks they looked up (re-admissions too)
                "lookup_blocks": stats.query_blocks - self.router_lookups[1],
                "block_hits": stats.hit_blocks - self.router_lookups[2],  # of which found
                "token_hit_rate": self._hit_tokens(stats.hit_tokens) / stats.query_tokens
                if stats.query_tokens
                else 0.0,
                "recompute_readds": self.readds,
                "recompute_cached_tokens": self.readd_cached,
                "cow_copies": self.cow_copies,
                "fork_requeued": self.fork_requeued,
                **self._host_counters(),
                "swapped_blocks": self.swapped_blocks,
                "blocks_in_use_at_end": int(leaked),
                "cached_blocks_at_end": int(self.pool.num_cached),
                "wall_s": wall,
                "allocator_s": self.alloc_s,
                "allocator_share": self.alloc_s / wall if wall > 0 else 0.0,
                "check_s": check_s,
            }
        )
        if self.shares:
            self.rec.counters["groups"] = self._group_summary()
        if leaked:
            raise SimulationError(
                f"internal error: {leaked} blocks still referenced after the replay"
            )
        return SimResult("paged", self.rec.summary(), self.rec)

    def _group_summary(self) -> List[Dict[str, Any]]:
        """Per layer kind: peak and time-weighted mean blocks its groups held, and bytes."""
        busy = self.rec._busy or 1.0
        bb = self.cfg.block_bytes
        out = []
        for k, sh in enumerate(self.shares):
            peak, mean = int(self.g_peak[k]), float(self.g_time[k]) / busy
            out.append(
                {
                    "kind": sh.group.kind,
                    "span": sh.group.span,
                    "layers": sh.kind.layers,
                    "kvblocks_groups": sh.copies,
                    "peak_blocks": peak,
                    "mean_blocks": mean,
                    "peak_gib": peak * bb / (1 << 30),
                    "mean_gib": mean * bb / (1 << 30),
                }
            )
        return out

    def _group_held(self) -> np.ndarray:
        """Blocks each layer kind's groups hold now, summed over device-resident sequences
        (a block shared by k sequences counts k times, as in ``mgr.blocks_in_use``).

        The core's release rule gives it from each sequence's length and the first position
        its next step queries (``q0``): a decoding sequence's newest token after ``schedule``;
        for one in prefill ``min(prefix hit, tokens - 1)`` (the simulator schedules a prompt
        when its prefill completes)."""
        d = self.decoding
        ntok, q0 = d.ctx, d.ctx - 1
        extra = self.prefilling + self._joined
        if extra:
            ntok = np.concatenate([ntok, np.array([s.ctx for s in extra], dtype=np.int64)])
            q0 = np.concatenate([q0, np.array([s.q0 for s in extra], dtype=np.int64)])
        bs = self.cfg.block_size
        return np.array(
            [sh.copies * int(sh.held_blocks(ntok, q0, bs).sum()) for sh in self.shares],
            dtype=np.int64,
        )

    def _hit_tokens(self, device_hit_tokens: int) -> int:
        """First admissions' prompt tokens served from any tier."""
        return device_hit_tokens + self.host_hit_tokens

    def _host_counters(self) -> Dict[str, Any]:
        """Per-tier hits, the tier's counters and its PCIe copies (only with a host tier)."""
        if not self.host_tier:
            return {}
        prompt = int(self.rec.prompt_tokens.sum())
        cached = int(self.rec.cached_tokens.sum())
        hs = host_stats_dict(self.mgr)
        return {
            "prefix_hit_rate_device": (cached - self.host_hit_tokens) / prompt if prompt else 0.0,
            "prefix_hit_rate_host": self.host_hit_tokens / prompt if prompt else 0.0,
            "device_hit_tokens": cached - self.host_hit_tokens,
            "host_hit_tokens": self.host_hit_tokens,
            **self.copies.counters(),
            "host_demotions": hs["demotions"],
            "host_evictions": hs["evictions"],
            "host_dropped": hs["dropped"],
            "host_stats": hs,
        }

    # ----------------------------------------------------------- decode-only steps, in a row

    def _only_decoding(self) -> bool:
        """Whether the next step can only decode: nothing swapped or prefilling, the queue
        empty or its head blocked (:meth:`_head_blocked`), and none of the per-step work
        :meth:`_decode_only` leaves out (host tier, copy-on-write drains, hybrid groups and
        windowed reads, KV events)."""
        return not (self.prefilling or self.swapped or self.host_tier or self.forked_live
                    or self.shares or self.tm.read_kinds or self.kv_events
                    or not self.decoding.seqs or self.decoding.left <= 1
                    or len(self.decoding) > self._ones.shape[0]
                    or (self.waiting and not self._head_blocked()))  # fmt: skip

    def _head_blocked(self) -> bool:
        """Whether the head of the queue cannot be admitted now, nor in any decode-only step
        after this one (:meth:`_admit`'s checks): the step's budget is spent on decodes, the
        seats are taken (they free only when a sequence finishes), or ``can_add`` refuses it
        (it counts free blocks only, and decode steps free none)."""
        cfg, seats = self.cfg, len(self.running)
        if cfg.token_budget <= len(self.decoding) or seats >= cfg.max_num_seqs:
            return True
        s = self.waiting[0]
        if seats + 1 + s.forks > cfg.max_num_seqs:
            return True
        return not self._timed(self.mgr.can_add, s.prompt_len + s.gen)

    def _decode_only(self) -> "tuple[int, float]":
        """Steps in which every running sequence decodes and nothing else happens, while they
        start before ``horizon`` (the next arrival) and no sequence can finish, each exactly as
        :meth:`step` runs it (the same manager calls, time and sample; its phases 2, 3 and 6
        have nothing to do) with less Python around it. Stops before a step whose
        ``append_batch`` finds no block (``OutOfBlocksError`` changes nothing): :meth:`step`
        preempts. Returns ``(steps, seconds)``."""
        d, mgr, rec = self.decoding, self.mgr, self.rec
        n = len(d.seqs)
        bs, usable, pool, tail = self.cfg.block_size, self.usable, self.pool, self.tail_groups
        running = len(self.running)
        ones = self._ones[:n]
        horizon = self.horizon
        queued = len(self.waiting)  # > 0: its head stays blocked, arrivals only join the tail
        feed = self.feed if queued else None
        self._joined = []
        step_s = self.tm.decode_step(n)
        kv = int(d.ctx.sum())
        # the step's waste sum((-ctx) % bs), kept from the contexts' residues: a step moves
        # every context one on, and a context at a block edge (ctx % bs == 0) reopens a block
        edge = Counter((d.ctx % bs).tolist())  # residue -> contexts (0 for the others)
        waste = int(((-d.ctx) % bs).sum())
        at = d.base + d.gen  # tok index of each stream's next token; ctx, gen catch up at the end
        left = d.left
        k, total = 0, 0.0
        while left > 1:
            if self.now >= horizon:
                if feed is None:
                    break
                horizon = feed(self.now)  # the arrivals up to now queue, as replay() does
                queued = len(self.waiting)
            toks = d.tok[at]
            t0 = _perf()
            try:
                if d.batch is None:
                    d.batch = mgr.batch(d.uid.tolist())
                mgr.append_batch(d.batch, toks)
            except OutOfBlocksError:
                self.alloc_s += _perf() - t0
                break
            self.alloc_s += _perf() - t0
            if d.fresh:
                d.fresh.clear()
            kv += n
            waste += bs * edge[-k % bs] - n
            t0 = _perf()
            mgr.schedule(d.batch, ones)
            self.alloc_s += _perf() - t0
            dt = step_s(kv)
            rec.step(self.now, dt, (usable - pool.num_free) * bs, waste * tail, running, queued)
            self.now += dt
            self.steps += 1
            at += 1
            left -= 1
            k += 1
            total += dt
        if k:
            d.ctx += k
            d.gen += k
            d.left = left
        return k, total

    # ----------------------------------------------------------------------------- the phases

    def _decode(self) -> int:
        """1. One ``append_batch`` for all decoding sequences, preempting until it fits.

        Returns how many sequences decode in this step."""
        d = self.decoding
        if not d.seqs:
            return 0
        toks = d.tokens()
        mgr = self.mgr
        while True:
            t0 = _perf()
            try:
                if d.batch is None:
                    d.batch = mgr.batch(d.uid.tolist())
                mgr.append_batch(d.batch, toks)
                self.alloc_s += _perf() - t0
                if d.fresh:
                    d.fresh.clear()
                break
            except OutOfBlocksError:
                self.alloc_s += _perf() - t0
                idx = self._preempt(self.running[-1])
                if idx >= 0:
                    toks = np.delete(toks, idx)
                if not d.seqs:
                    break
        n_dec = len(d.seqs)
        if n_dec:
            d.ctx += 1
        return n_dec

    def _prefill(self, budget: StepBudget) -> None:
        """2. Chunks of the budget for running prompts, in admission order."""
        for s in self.prefilling:
            if budget.left <= 0:
                break
            budget.take_chunk(s)

    def _admit(self, budget: StepBudget) -> List[Seq]:
        """3. Swapped sequences back first, then the queue in order, while budget and seats last.

        Returns the swapped-in sequences that decode from the next step on."""
        cfg = self.cfg
        joined: List[Seq] = []
        seats = len(self.running) + sum(s.forks for s in self.prefilling)  # pending forks included
        while budget.left > 0 and seats < cfg.max_num_seqs:
            if self.swapped:
                s = self.swapped[0]
                if not self._swap_in(s):
                    break
                seats += 1 + s.forks
                if s.prefill_left > 0:
                    self.prefilling.append(s)
                    budget.take_chunk(s)
                else:
                    joined.append(s)
                continue
            if not self.waiting:
                break
            s = self.waiting[0]
            if self.running and seats + 1 + s.forks > cfg.max_num_seqs:
                break
            if not self._add(s):
                if not self.running and not self.swapped:
                    self._pop_waiting()  # cannot fit even in an empty cache
                    self._reject(s)
                    continue
                break
            self._pop_waiting()
            self.running.append(s)
            seats += 1 + s.forks
            self.prefilling.append(s)
            budget.take_chunk(s)
        return joined

    def _drain(self) -> None:
        """Between 3 and 4: the step's copy lists, in order (offloads, onloads, copy-on-write
        pairs; :mod:`kvblocks.sim.tier.drain`). Without a tier only the copies, when a forked
        sequence can have made some."""
        if not self.host_tier and not self.forked_live:
            return
        c = self.copies
        t0 = _perf()
        c.drain(self.mgr, self.host_tier, self.forked_live > 0)
        self.alloc_s += _perf() - t0
        self.cow_copies += c.cow

    def _compute(self, n_dec: int, completed: List[Seq]) -> None:
        """4. Declare what the step computes, so that its full blocks enter the prefix cache.

        One ``schedule`` call for the whole step, as an engine makes one ``metadata`` call:
        with write-through, the first call queues offloads and the core refuses another
        ``schedule`` until they are drained."""
        mgr = self.mgr
        t0 = _perf()
        d = self.decoding
        if completed:
            ids = d.uid.tolist() if n_dec else []
            qlens = [1] * n_dec
            for s in completed:
                ids.append(s.uid)
                qlens.append(mgr.num_tokens(s.uid) - mgr.num_computed(s.uid))
            mgr.schedule(ids, np.array(qlens, np.int32))
        elif n_dec:
            ones = self._ones if n_dec <= self._ones.shape[0] else np.ones(n_dec, np.int32)
            mgr.schedule(d.batch if d.batch is not None else d.uid.tolist(), ones[:n_dec])
        if self.host_tier and self.cfg.host_write_through:
            self.copies.after_schedule(mgr)
        self.alloc_s += _perf() - t0

    def _advance(self, n_dec: int, budget: StepBudget, swapped_blocks: int) -> float:
        """5. The step's duration and its sample (KV in use, waste, batch, queue); the clock moves."""
        bs = self.cfg.block_size
        ctx = self.decoding.ctx
        tm = self.tm
        kv_read = (tm.kv_tokens_read(ctx) if tm.read_kinds else int(ctx.sum())) if n_dec else 0
        prefill_tokens = budget.prefill_tokens
        pairs, reads = tm.prefill_attention(budget.chunks) if budget.chunks else (0.0, 0.0)
        moved = swapped_blocks
        if self.host_tier:  # the drained copies, then the forward pass (hostdrain)
            fwd = tm.step(prefill_tokens, n_dec, kv_read, 0, pairs, reads)
            dt = self.copies.step_seconds(fwd, moved)
        else:
            dt = tm.step(prefill_tokens, n_dec, kv_read, moved * self.cfg.block_bytes, pairs, reads)
        waste = int(((-ctx) % bs).sum()) if n_dec else 0
        for s in self.prefilling:
            waste += -s.ctx % bs
        waste *= self.tail_groups
        used = (self.usable - self.pool.num_free) * bs
        if self.shares:
            held = self._group_held()
            np.maximum(self.g_peak, held, out=self.g_peak)
            self.g_time += held * dt
        self.rec.step(
            self.now, dt, used, waste, len(self.running), len(self.waiting) + len(self.swapped)
        )
        self.now += dt
        self.steps += 1
        return dt

    def _finish(self, n_dec: int, completed: List[Seq], joined: List[Seq]) -> None:
        """6. Finished decodes freed; completed prefills yield their first token and fork."""
        now = self.now
        any_done = False
        d = self.decoding
        if n_dec:
            d.gen += 1
            d.left -= 1
            if d.left <= 0:  # a sequence may be done: look (else none is)
                fin = np.flatnonzero(d.gen >= d.out)
                if fin.size:
                    any_done = True
                    for k in fin.tolist():
                        self._free(d.seqs[k], now)
                d.keep(d.gen < d.out)
        if completed:
            self.prefilling = [s for s in self.prefilling if s.prefill_left > 0]
            for s in completed:
                s.gen += 1
                i = s.req.index
                if s.sample == 0 and not np.isfinite(self.rec.first_token[i]):
                    self.rec.first_token[i] = now
                if s.gen >= s.output_len:
                    any_done = True
                    if s.forks:  # n samples of one token each: nothing to fork
                        self.remaining_samples[i] -= s.forks
                        s.forks = 0
                    self._free(s, now)
                    continue
                joined.append(s)
                if s.forks:
                    joined.extend(self._fork(s))
        if any_done:
            self.running = [s for s in self.running if not s.done]
        if joined:
            d.extend(joined)


def simulate_paged(
    workload: Workload,
    cfg: SchedulerConfig,
    tm: TimeModel,
    progress: Optional[Progress] = None,
) -> SimResult:
    """Replay ``workload`` through a fresh ``BlockManager`` and return the measurements."""
    return PagedEngine(workload, cfg, tm).run(progress)
