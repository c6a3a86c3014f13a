"""The paged engine's sequences: one record per sequence (:class:`Seq`) and the decode set
(:class:`Decoding`), whose state is kept as parallel arrays so one native call serves the batch."""

from __future__ import annotations

from typing import Any, List

import numpy as np

from ..workload.tokens import seed_keys
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
    """The decoding sequences, their state as parallel arrays: one native call a step for all."""

    __slots__ = ("seqs", "uid", "key", "gen", "out", "ctx", "batch", "fresh")

    def __init__(self) -> None:
        self.seqs: List[Seq] = []  # in the order of the arrays
        self.uid: np.ndarray = np.empty(0, dtype=np.int64)  # sequence ids
        self.key: np.ndarray = np.empty(0, dtype=np.uint64)  # generated-token stream keys
        self.gen: np.ndarray = np.empty(0, dtype=np.int64)  # tokens generated so far
        self.out: np.ndarray = np.empty(0, dtype=np.int64)  # tokens to generate in all
        self.ctx: np.ndarray = np.empty(0, dtype=np.int64)  # tokens in the KV
        self.batch: Any = None  # mgr.batch(...) of the set; None when the set changed
        self.fresh: set = set()  # ids that joined since the last append_batch (not yet decoded)

    def __len__(self) -> int:
        return len(self.seqs)

    def remove(self, s: Seq) -> int:
        """Take ``s`` out, writing its state back to it; returns the index it had."""
        self.batch = None
        idx = self.seqs.index(s)
        s.gen = int(self.gen[idx])
        s.ctx = int(self.ctx[idx])
        if s.uid not in self.fresh:  # it decoded: that step queried its newest token
            s.q0 = s.ctx - 1
        del self.seqs[idx]
        self.uid, self.key, self.gen, self.out, self.ctx = (
            np.delete(a, idx) for a in (self.uid, self.key, self.gen, self.out, self.ctx)
        )
        return idx

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the sequences where ``mask`` is true."""
        self.seqs = [s for s, k in zip(self.seqs, mask.tolist()) if k]
        self.batch = None
        self.uid, self.key, self.gen, self.out, self.ctx = (
            self.uid[mask],
            self.key[mask],
            self.gen[mask],
            self.out[mask],
            self.ctx[mask],
        )

    def extend(self, seqs: List[Seq]) -> None:
        """Add sequences whose prefill is done (their ``gen`` and ``ctx`` are current)."""
        self.batch = None
        self.fresh.update(s.uid for s in seqs)
        self.seqs.extend(seqs)
        self.uid = np.concatenate([self.uid, np.array([s.uid for s in seqs], dtype=np.int64)])
        self.key = np.concatenate([self.key, seed_keys([s.seed for s in seqs])])
        self.gen = np.concatenate([self.gen, np.array([s.gen for s in seqs], dtype=np.int64)])
        self.out = np.concatenate(
            [self.out, np.array([s.output_len for s in seqs], dtype=np.int64)]
        )
        self.ctx = np.concatenate([self.ctx, np.array([s.ctx for s in seqs], dtype=np.int64)])
