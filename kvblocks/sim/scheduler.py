"""Discrete-event replay of a workload through the real :class:`kvblocks.BlockManager`.

The scheduler models a continuous-batching engine (vLLM-style), one engine step at a time:

1. **Decode.** Every sequence past its prefill commits the token it produced last step:
   one ``mgr.append_batch(seq_ids, tokens)`` call for the whole batch. When the pool cannot
   grow them (``OutOfBlocksError``, which changes nothing), the most recently admitted
   running sequence is preempted and the call retried: *recompute* frees it (its full
   blocks stay in the prefix cache) and queues it first in line, to be re-added later with
   its prompt plus the tokens it had generated; *swap* moves its blocks to host memory
   (``mgr.swap_out``) and brings them back (``mgr.swap_in``) before any new admission.
2. **Prefill.** Running prompts take chunks of what is left of the step's token budget.
3. **Admit.** Queued sequences, first come first served, while the token budget, the
   sequence limit and ``mgr.can_add`` (free blocks above the watermark) allow; ``mgr.add``
   allocates the whole prompt and reports the prefix-cache hit, which needs no compute.
4. **Time.** The step lasts what :class:`TimeModel` says; the clock advances.
5. **Finish.** A prefill that completes yields the first token (forking ``n - 1`` siblings
   for parallel sampling: ``mgr.fork`` shares every block, copy-on-write on the first
   append); a sequence that has produced all its tokens is freed.

A request of prompt length P and output length O holds P + O - 1 tokens at its end (the
last token is returned, never fed back). Time inside ``BlockManager`` calls is measured.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Optional

import numpy as np

from . import limits
from .errors import SimulationError
from .metrics import Recorder
from .timing import TimeModel
from .tokens import seed_keys, stream, tokens_at
from .workload import Request, Workload

__all__ = ["SchedulerConfig", "SimResult", "simulate_paged"]


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the modelled engine (defaults follow vLLM's)."""

    num_blocks: int  # usable KV blocks (the null block comes on top)
    block_size: int = 16
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # fraction of blocks admission keeps free (vLLM v0 default)
    max_num_seqs: int = 256  # sequences per batch
    token_budget: int = 8192  # tokens per step (max_num_batched_tokens)
    preemption: str = "recompute"  # or "swap"
    host_blocks: int = 0  # swap space in blocks
    block_bytes: int = 0  # bytes per block (swap time)

    def validate(self) -> None:
        if self.preemption not in ("recompute", "swap"):
            raise SimulationError(f"--preemption must be 'recompute' or 'swap', got {self.preemption!r}")
        limits.WATERMARK.check(self.watermark)
        limits.MAX_NUM_SEQS.check(self.max_num_seqs)
        limits.TOKEN_BUDGET.check(self.token_budget)


@dataclass
class SimResult:
    """What a replay produced: the summary numbers and the recorder with its series."""

    name: str
    summary: Dict[str, object]
    recorder: Recorder


class _Seq:
    """One sequence (a request's sample) as the scheduler sees it."""

    __slots__ = ("uid", "req", "sample", "seed", "prompt_len", "output_len", "gen", "ctx", "prefill_left", "forks", "done")

    def __init__(self, uid: int, req: Request, sample: int) -> None:
        self.uid = uid
        self.req = req
        self.sample = sample
        self.seed = req.output_seed(sample)
        self.prompt_len = req.prompt_len
        self.output_len = req.output_len
        self.gen = 0  # tokens generated so far
        self.ctx = 0  # tokens in its KV (block table)
        self.prefill_left = 0  # prompt tokens still to compute
        self.forks = req.n - 1 if sample == 0 else 0  # siblings to fork when the prefill ends
        self.done = False


Progress = Callable[[int, float], None]


def _stat(stats: object, key: str) -> float:
    try:
        return float(stats[key])  # type: ignore[index]
    except (TypeError, KeyError, IndexError):
        return float(getattr(stats, key, 0) or 0)


def simulate_paged(
    workload: Workload,
    cfg: SchedulerConfig,
    tm: TimeModel,
    progress: Optional[Progress] = None,
) -> SimResult:
    """Replay ``workload`` through a fresh ``BlockManager`` and return the measurements."""
    from .. import BlockManager, OutOfBlocksError

    cfg.validate()
    perf = time.perf_counter
    wall0 = perf()
    bs = cfg.block_size
    host = cfg.host_blocks
    if cfg.preemption == "swap" and host <= 0:
        raise SimulationError("--preemption swap needs host memory for swapped blocks (--host-mem GiB)")
    mgr = BlockManager(
        cfg.num_blocks + 1,
        bs,
        enable_prefix_caching=cfg.enable_prefix_caching,
        watermark=cfg.watermark,
        num_host_blocks=host if cfg.preemption == "swap" else 0,
    )
    pool = mgr.pool
    usable = pool.num_blocks - 1
    reqs = workload.requests
    n_req = len(reqs)
    rec = Recorder(
        np.array([r.arrival for r in reqs], dtype=np.float64),
        usable * bs,
        np.array([r.output_len * r.n for r in reqs], dtype=np.int64),
    )
    alloc = 0.0  # seconds inside BlockManager calls
    preempt_recompute = 0
    preempt_swap = 0
    cow_copies = 0
    swapped_blocks = 0
    readds = 0
    readd_cached = 0
    finished_reqs = 0
    remaining_samples = np.array([r.n for r in reqs], dtype=np.int64)

    waiting: Deque[_Seq] = deque()
    swapped: Deque[_Seq] = deque()
    running: List[_Seq] = []  # admission order; the tail is preempted first
    prefilling: List[_Seq] = []  # running sequences still in prefill, admission order
    dec: List[_Seq] = []  # running sequences decoding, parallel to the arrays below
    d_uid = np.empty(0, dtype=np.int64)
    d_key = np.empty(0, dtype=np.uint64)
    d_gen = np.empty(0, dtype=np.int64)
    d_out = np.empty(0, dtype=np.int64)
    d_ctx = np.empty(0, dtype=np.int64)
    d_batch = None  # mgr.batch(...) of the decode set; None when the set changed
    forked_live = 0
    next_uid = 0
    nxt = 0
    now = reqs[0].arrival if n_req else 0.0
    last_report = wall0
    steps = 0

    def seq_tokens(s: _Seq) -> np.ndarray:
        base = workload.prompt_tokens(s.req)
        if s.gen == 0:
            return base
        return np.concatenate([base, stream(s.seed, 0, s.gen)])

    def finish(s: _Seq, t: float) -> None:
        nonlocal alloc, finished_reqs, forked_live
        s.done = True
        t0 = perf()
        mgr.free(s.uid)
        alloc += perf() - t0
        if s.req.n > 1:
            forked_live -= 1
        i = s.req.index
        remaining_samples[i] -= 1
        if remaining_samples[i] == 0:
            rec.finish[i] = t
            finished_reqs += 1

    def reject(s: _Seq) -> None:
        nonlocal finished_reqs
        i = s.req.index
        if not rec.rejected[i]:
            rec.rejected[i] = True
        remaining_samples[i] -= 1 + s.forks
        if remaining_samples[i] <= 0:
            finished_reqs += 1

    def drop_decoder(s: _Seq) -> int:
        """Remove ``s`` from the decode arrays (writing its state back); its index."""
        nonlocal d_uid, d_key, d_gen, d_out, d_ctx, d_batch
        d_batch = None
        idx = dec.index(s)
        s.gen = int(d_gen[idx])
        s.ctx = int(d_ctx[idx])
        del dec[idx]
        d_uid, d_key, d_gen, d_out, d_ctx = (np.delete(a, idx) for a in (d_uid, d_key, d_gen, d_out, d_ctx))
        return idx

    def preempt(victim: _Seq) -> int:
        """Preempt the tail of ``running``; returns its decode index or -1."""
        nonlocal alloc, preempt_recompute, preempt_swap, swapped_blocks
        running.pop()
        idx = -1
        if victim.prefill_left > 0:
            prefilling.remove(victim)
        else:
            idx = drop_decoder(victim)
        if cfg.preemption == "swap":
            t0 = perf()
            try:
                pairs = mgr.swap_out(victim.uid)
            except OutOfBlocksError:
                pairs = None  # host memory full: fall back to recompute
            finally:
                alloc += perf() - t0
            if pairs is not None:
                swapped_blocks += len(pairs)
                swapped.append(victim)
                preempt_swap += 1
                return idx
        t0 = perf()
        mgr.free(victim.uid)
        alloc += perf() - t0
        victim.prefill_left = 0
        waiting.appendleft(victim)
        preempt_recompute += 1
        return idx

    def take_chunk(s: _Seq) -> None:
        """Give s the next prefill chunk out of this step's token budget."""
        nonlocal budget, pf_tokens
        c = s.prefill_left if s.prefill_left < budget else budget
        s.prefill_left -= c
        budget -= c
        pf_tokens += c
        if s.prefill_left == 0:
            completed.append(s)

    while True:
        while nxt < n_req and reqs[nxt].arrival <= now:
            waiting.append(_Seq(next_uid, reqs[nxt], 0))
            next_uid += 1
            nxt += 1
        if not running and not waiting and not swapped:
            if nxt >= n_req:
                break
            now = reqs[nxt].arrival
            continue
        budget = cfg.token_budget
        swap_blocks_step = swapped_blocks

        # 1. decode: one native call appends one token to every decoding sequence
        n_dec = len(dec)
        if n_dec:
            toks = tokens_at(d_key, d_gen - 1)
            while True:
                t0 = perf()
                try:
                    if d_batch is None:
                        d_batch = mgr.batch(d_uid.tolist())
                    mgr.append_batch(d_batch, toks)
                    alloc += perf() - t0
                    break
                except OutOfBlocksError:
                    alloc += perf() - t0
                    idx = preempt(running[-1])
                    if idx >= 0:
                        toks = np.delete(toks, idx)
                    if not dec:
                        break
            n_dec = len(dec)
            if n_dec:
                d_ctx += 1
                if forked_live:
                    t0 = perf()
                    cow_copies += len(mgr.take_copies())
                    alloc += perf() - t0
            budget -= n_dec

        # 2. prefill chunks for running prompts
        pf_tokens = 0
        completed: List[_Seq] = []
        for s in prefilling:
            if budget <= 0:
                break
            take_chunk(s)

        # 3. admit: swapped sequences first, then the queue in order
        joined: List[_Seq] = []
        seats = len(running) + sum(s.forks for s in prefilling)  # batch seats, pending forks included
        while budget > 0 and seats < cfg.max_num_seqs:
            if swapped:
                s = swapped[0]
                t0 = perf()
                try:
                    pairs = mgr.swap_in(s.uid)
                except OutOfBlocksError:
                    alloc += perf() - t0
                    break
                alloc += perf() - t0
                swapped.popleft()
                swapped_blocks += len(pairs)
                running.append(s)
                seats += 1 + s.forks
                if s.prefill_left > 0:
                    prefilling.append(s)
                    take_chunk(s)
                else:
                    joined.append(s)
                continue
            if not waiting:
                break
            s = waiting[0]
            if running and seats + 1 + s.forks > cfg.max_num_seqs:
                break
            ntok = s.prompt_len + s.gen
            t0 = perf()
            ok = mgr.can_add(ntok)
            alloc += perf() - t0
            cached = -1
            if ok:
                tokens = seq_tokens(s)
                t0 = perf()
                first = s.sample == 0 and s.gen == 0 and not np.isfinite(rec.admit[s.req.index])
                try:
                    cached = int(mgr.add(s.uid, tokens, recompute=not first))
                except OutOfBlocksError:
                    cached = -1
                alloc += perf() - t0
            if cached < 0:
                if not running and not swapped:
                    waiting.popleft()  # cannot fit even in an empty cache
                    reject(s)
                    continue
                break
            waiting.popleft()
            running.append(s)
            seats += 1 + s.forks
            i = s.req.index
            if s.sample == 0 and s.gen == 0 and not np.isfinite(rec.admit[i]):
                rec.admit[i] = now
                rec.prompt_tokens[i] = ntok
                rec.cached_tokens[i] = cached
            else:
                readds += 1
                readd_cached += cached
            s.ctx = ntok
            s.prefill_left = ntok - cached
            prefilling.append(s)
            take_chunk(s)

        # 4. the step computes the decodes' newest tokens and the prompts whose prefill
        # completes: declare it, so that their full blocks enter the prefix cache
        t0 = perf()
        if n_dec:
            mgr.schedule(d_batch if d_batch is not None else d_uid.tolist(), np.ones(n_dec, np.int32))
        for s in completed:
            mgr.schedule([s.uid], [mgr.num_tokens(s.uid) - mgr.num_computed(s.uid)])
        alloc += perf() - t0

        # the step's duration and its sample
        kv_read = int(d_ctx.sum()) if n_dec else 0
        swap_bytes = (swapped_blocks - swap_blocks_step) * cfg.block_bytes
        dt = tm.step(pf_tokens, n_dec, kv_read, swap_bytes)
        waste = int(((-d_ctx) % bs).sum()) if n_dec else 0
        for s in prefilling:
            waste += -s.ctx % bs
        rec.step(now, dt, (usable - pool.num_free) * bs, waste, len(running), len(waiting) + len(swapped))
        now += dt
        steps += 1

        # 5. finish decodes, complete prefills, fork samples
        any_done = False
        if n_dec:
            d_gen += 1
            fin = np.flatnonzero(d_gen >= d_out)
            if fin.size:
                any_done = True
                for k in fin.tolist():
                    finish(dec[k], now)
                keep = d_gen < d_out
                dec = [s for s, k in zip(dec, keep.tolist()) if k]
                d_batch = None
                d_uid, d_key, d_gen, d_out, d_ctx = d_uid[keep], d_key[keep], d_gen[keep], d_out[keep], d_ctx[keep]
        if completed:
            prefilling = [s for s in prefilling if s.prefill_left > 0]
            for s in completed:
                s.gen += 1
                i = s.req.index
                if s.sample == 0 and not np.isfinite(rec.first_token[i]):
                    rec.first_token[i] = now
                if s.gen >= s.output_len:
                    any_done = True
                    if s.forks:  # n samples of one token each: nothing to fork
                        remaining_samples[i] -= s.forks
                        s.forks = 0
                    finish(s, now)
                    continue
                joined.append(s)
                if s.forks:
                    forked_live += 1 + s.forks
                    for k in range(1, s.forks + 1):
                        child = _Seq(next_uid, s.req, k)
                        next_uid += 1
                        child.gen, child.ctx = s.gen, s.ctx
                        t0 = perf()
                        mgr.fork(s.uid, child.uid)
                        alloc += perf() - t0
                        running.append(child)
                        joined.append(child)
                    s.forks = 0
        if any_done:
            running = [s for s in running if not s.done]
        if joined:
            d_batch = None
            dec.extend(joined)
            d_uid = np.concatenate([d_uid, np.array([s.uid for s in joined], dtype=np.int64)])
            d_key = np.concatenate([d_key, seed_keys([s.seed for s in joined])])
            d_gen = np.concatenate([d_gen, np.array([s.gen for s in joined], dtype=np.int64)])
            d_out = np.concatenate([d_out, np.array([s.output_len for s in joined], dtype=np.int64)])
            d_ctx = np.concatenate([d_ctx, np.array([s.ctx for s in joined], dtype=np.int64)])

        if progress is not None and (steps & 255) == 0:
            w = perf()
            if w - last_report > 0.2:
                last_report = w
                progress(finished_reqs, now)

    if progress is not None:
        progress(finished_reqs, now)
    wall = perf() - wall0
    t0 = perf()
    pool.check()
    check_s = perf() - t0
    stats = pool.stats
    leaked = usable - pool.num_free
    rec.counters.update(
        {
            "preemptions": preempt_recompute + preempt_swap,
            "preemptions_recompute": preempt_recompute,
            "preemptions_swap": preempt_swap,
            "evictions": int(_stat(stats, "evictions")),
            "block_queries": int(_stat(stats, "queries")),
            "block_hits": int(_stat(stats, "hits")),
            "block_hit_rate": _stat(stats, "hit_rate"),
            "recompute_readds": readds,
            "recompute_cached_tokens": readd_cached,
            "cow_copies": cow_copies,
            "swapped_blocks": swapped_blocks,
            "blocks_in_use_at_end": int(leaked),
            "cached_blocks_at_end": int(pool.num_cached),
            "wall_s": wall,
            "allocator_s": alloc,
            "allocator_share": alloc / wall if wall > 0 else 0.0,
            "check_s": check_s,
        }
    )
    if leaked:
        raise SimulationError(f"internal error: {leaked} blocks still referenced after the replay")
    return SimResult("paged", rec.summary(), rec)
