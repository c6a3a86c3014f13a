"""The paged engine's sequences: one record per sequence (:class:`Seq`) and the decode set
(:class:`Decoding`), whose state is kept as parallel arrays so one native call serves the batch."""

from __future__ import annotations

from typing import Any, List

import numpy as np

from ..workload.tokens import seed_keys, tokens_at
from ..workload.traces import Request

__all__ = ["Seq", "Decoding"]


class Seq:
    """One sequence (a request's sample) as the scheduler sees it."""

    __slots__ = (
        "uid",
        "req",
        "sample",
        "seed",
        "prompt_len",
        "output_len",
        "gen",
        "ctx",
        "prefill_left",
        "forks",
        "done",
        "q0",
    )

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
        self.q0 = 0  # first position the next step queries, while not decoding (group usage)


class Decoding:
    """The decoding sequences, their state as parallel arrays: one native call a step for all.

    **Generated tokens.** A sequence's generated tokens are a pure function of its stream key
    and position (:func:`~kvblocks.sim.workload.tokens.tokens_at`), so they are computed once,
    for all of its remaining decode steps, when it joins the set (one vectorised call per
    join, not one per step), into one flat buffer ``tok``: the token a sequence feeds back in
    a step, position ``gen - 1``, sits at ``tok[base + gen]``. The buffer is compacted to the
    live sequences' remaining tokens when it fills. ``left`` is a lower bound on the fewest
    decode steps any sequence has left (exact after :meth:`keep`, conservative after
    :meth:`remove`), so the step looks for finished sequences only when one can be."""

    __slots__ = ("seqs", "uid", "base", "gen", "out", "ctx", "batch", "fresh", "tok", "used",
                 "left")  # fmt: skip

    def __init__(self) -> None:
        self.seqs: List[Seq] = []  # in the order of the arrays
        self.uid: np.ndarray = np.empty(0, dtype=np.int64)  # sequence ids
        self.base: np.ndarray = np.empty(0, dtype=np.int64)  # tok index of position gen-1, - gen
        self.gen: np.ndarray = np.empty(0, dtype=np.int64)  # tokens generated so far
        self.out: np.ndarray = np.empty(0, dtype=np.int64)  # tokens to generate in all
        self.ctx: np.ndarray = np.empty(0, dtype=np.int64)  # tokens in the KV
        self.batch: Any = None  # mgr.batch(...) of the set; None when the set changed
        self.fresh: set = set()  # ids that joined since the last append_batch (not yet decoded)
        self.tok: np.ndarray = np.empty(4096, dtype=np.int32)  # generated tokens, see above
        self.used = 0  # entries of tok written
        self.left = _NEVER  # <= min(out - gen) over the set

    def __len__(self) -> int:
        return len(self.seqs)

    def tokens(self) -> np.ndarray:
        """The tokens the set feeds back this step (position ``gen - 1`` of each stream)."""
        return self.tok[self.base + self.gen]

    def remove(self, s: Seq) -> int:
        """Take ``s`` out, writing its state back to it; returns the index it had."""
        self.batch = None
        idx = self.seqs.index(s)
        s.gen = int(self.gen[idx])
        s.ctx = int(self.ctx[idx])
        if s.uid not in self.fresh:  # it decoded: that step queried its newest token
            s.q0 = s.ctx - 1
        del self.seqs[idx]
        self.uid, self.base, self.gen, self.out, self.ctx = (
            np.delete(a, idx) for a in (self.uid, self.base, self.gen, self.out, self.ctx)
        )
        return idx

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the sequences where ``mask`` is true."""
        self.seqs = [s for s, k in zip(self.seqs, mask.tolist()) if k]
        self.batch = None
        self.uid, self.base, self.gen, self.out, self.ctx = (
            self.uid[mask],
            self.base[mask],
            self.gen[mask],
            self.out[mask],
            self.ctx[mask],
        )
        self.left = int((self.out - self.gen).min()) if self.seqs else _NEVER

    def extend(self, seqs: List[Seq]) -> None:
        """Add sequences whose prefill is done (their ``gen`` and ``ctx`` are current)."""
        self.batch = None
        self.fresh.update(s.uid for s in seqs)
        self.seqs.extend(seqs)
        gen = np.array([s.gen for s in seqs], dtype=np.int64)
        out = np.array([s.output_len for s in seqs], dtype=np.int64)
        base = self._write(seed_keys([s.seed for s in seqs]), gen, out)
        self.uid = np.concatenate([self.uid, np.array([s.uid for s in seqs], dtype=np.int64)])
        self.base = np.concatenate([self.base, base])
        self.gen = np.concatenate([self.gen, gen])
        self.out = np.concatenate([self.out, out])
        self.ctx = np.concatenate([self.ctx, np.array([s.ctx for s in seqs], dtype=np.int64)])
        if seqs:
            self.left = min(self.left, int((out - gen).min()))

    def _write(self, keys: np.ndarray, gen: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Write positions ``gen - 1 .. out - 2`` of each stream to ``tok``; their bases."""
        cnt = np.maximum(out - gen, 0)
        total = int(cnt.sum())
        if self.used + total > self.tok.shape[0]:
            self._compact(total)
        first = self.used + np.cumsum(cnt) - cnt  # where each stream's tokens start
        if total:
            pos = np.arange(total, dtype=np.int64) + np.repeat(gen - 1 - (first - self.used), cnt)
            self.tok[self.used : self.used + total] = tokens_at(
                np.repeat(keys, cnt), pos.astype(np.uint64)
            )
        self.used += total
        return first - gen

    def _compact(self, extra: int) -> None:
        """Keep only the live sequences' tokens still to feed back, with room for ``extra``."""
        cnt = np.maximum(self.out - self.gen, 0)
        live = int(cnt.sum())
        size = max(4096, 2 * (live + extra))
        tok = np.empty(size, dtype=np.int32)
        first = np.cumsum(cnt) - cnt
        if live:
            src = np.arange(live, dtype=np.int64) + np.repeat(self.base + self.gen - first, cnt)
            tok[:live] = self.tok[src]
        self.tok, self.used = tok, live
        self.base = first - self.gen


_NEVER = 1 << 62  # no sequence: no finish to look for
