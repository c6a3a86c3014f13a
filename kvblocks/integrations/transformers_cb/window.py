"""Sliding-window layers under :mod:`kvblocks.integrations.transformers_cb`.

transformers 5.24 serves a model's ``"sliding_attention"`` layers with one allocator whose blocks
form a ring of ``ceil(window / page_size)`` blocks per request: position ``p`` lives in slot
``p % window``. For a step that computes positions ``[past, past + q)`` a sliding layer is given
the K/V of ``min(past, window - 1)`` cached positions followed by the ``q`` new ones
(``get_seqlen_k``), and its mask lets position ``p`` attend to ``[p - window + 1, p]``.

Here those layers read the block tables of a ``KVGroup("sliding_window", window=W)`` of the
request's :class:`kvblocks.BlockManager` (``W = config.sliding_window``, the window transformers'
mask uses). Blocks are not a ring: position ``p`` is row ``table[p // page] * stride + p % page``,
and a block entirely below the window of the step's first query position is released as the
request moves on (its table entry becomes the null block 0; a cached one stays evictable). The
step reads exactly the rows transformers' own allocator reads, in the same order: positions
``[past - min(past, W - 1), past + q)``, all in blocks the window still holds. So attention sees
the same keys and values, the same mask and the same sequence lengths, and generates the same
tokens. The K/V are written before they are read (as for full attention): no slot is reused
inside the window, so nothing is overwritten.

Stage 2 builds the rows from the step's plan (``StepPlan.rows(group)``: every context row, released ones
on the null block), then keeps each request's last ``min(L, q + W - 1)`` rows with one numpy
gather into transformers' read index. Stage 1 builds them in transformers' per-request loop
(:meth:`KVBlocksWindowAllocator.get_read_indices`).

What is held: a request holds, in its window group, the blocks of its last ``W - 1`` positions and
of the step's query: at most ``ceil((W - 1 + q) / page) + 1`` blocks, against one block per page of
context in a full-attention group. A long prompt holds all its blocks during its prefill step (its
first query position is 0) and releases the ones below the window at the next step.
"""

from __future__ import annotations

from typing import Any, List

import numpy as np

from ... import KVGroup, RowIndices, StepPlan
from ...errors import InvalidStateError
from ...groups import layer_group
from .context import refused
from .step import KVBlocksStepAllocator

__all__ = ["KVBlocksWindowAllocator", "keep_window_rows"]


def keep_window_rows(
    rows: np.ndarray,
    read_offsets: np.ndarray,
    write_offsets: np.ndarray,
    window: int,
    out: np.ndarray,
) -> int:
    """Keep, of each sequence's context rows, the last ``min(L, q + window - 1)`` (its query rows
    and the ``window - 1`` positions before them); write them packed into ``out`` and return how
    many. ``read_offsets`` / ``write_offsets`` are the plan's CSR offsets (``L`` and ``q``
    per sequence).

    >>> rows = np.arange(10, dtype=np.int64)            # one sequence: 10 positions, query 2
    >>> out = np.zeros(10, dtype=np.int64)
    >>> n = keep_window_rows(rows, np.array([0, 10]), np.array([0, 2]), 4, out)
    >>> out[:n].tolist()                                # positions 5..9: 3 before, 2 new
    [5, 6, 7, 8, 9]
    """
    lens = np.diff(read_offsets)
    keep = np.minimum(lens, np.diff(write_offsets) + (window - 1))
    n = int(keep.sum())
    if n > out.shape[0]:
        raise InvalidStateError(
            f"transformers_cb: the window rows of the step ({n}) overflow transformers' read "
            f"index ({out.shape[0]} rows)"
        )
    packed = np.zeros(len(keep) + 1, dtype=np.int64)
    np.cumsum(keep, out=packed[1:])
    shift = np.repeat(read_offsets[1:] - keep - packed[:-1], keep)
    np.take(rows, shift + np.arange(n), out=out[:n])
    return n


class KVBlocksWindowAllocator(KVBlocksStepAllocator):
    """transformers' allocator for ``"sliding_attention"`` layers, reading its KV cache group
    (``KVGroup("sliding_window", window=config.sliding_window)``) of kvblocks' manager."""

    layer_type = "sliding_attention"
    supports_block_sharing = True  # kvblocks' prefix hits serve window groups
    supports_block_table = False  # transformers' decode kernel call has no window argument

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        window = getattr(kwargs.get("config"), "sliding_window", None)
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise refused(
                f"transformers_cb: sliding-window layers need a positive config.sliding_window, "
                f"got {window!r}"
            )
        self.sliding_window = window
        super().__init__(*args, **kwargs)

    @property
    def kv_group(self) -> KVGroup:
        return layer_group(self.sliding_window)  # KVGroup("sliding_window", window=W)

    # -- transformers' per-request questions ---------------------------------------------------
    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        """Keys a query reads: the ``window - 1`` positions before it and itself (as
        transformers' own sliding allocator)."""
        return query_length + min(past_length, self.sliding_window - 1)

    def _rows(self, request_id: str, start: int, end: int) -> List[int]:
        table = self.mgr.block_table(request_id, group=self.index).astype(np.int64)
        p = np.arange(start, end, dtype=np.int64)
        ps = self.tokens_per_page
        return (table[p // ps] * self.block_physical_stride + p % ps).tolist()

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> List[int]:
        """Stage 1: rows of positions ``[past - min(past, W - 1), past + q)``."""
        start = past_length - min(past_length, self.sliding_window - 1)
        return self._rows(request_id, start, past_length + query_length)

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> List[int]:
        """Stage 1: rows of the query positions."""
        return self._rows(request_id, past_length, past_length + query_length)

    def fill_block_table(self, request_id: str, past_length: int, query_length: int, block_table):
        raise InvalidStateError("transformers_cb: sliding-window layers have no decode block table")

    # -- stage 2 -------------------------------------------------------------------------------
    def build_indices(self, io: Any, step: StepPlan, context: int = 0) -> None:
        """The planned step's write rows into transformers' storage; its context rows from
        the plan into scratch, then each request's window packed into the read index."""
        if io.use_block_table:
            raise InvalidStateError("transformers_cb: sliding-window layers have no decode path")
        B = len(step)
        ro, wo = self._scratch("ro", (B + 1,), np.int32), self._scratch("wo", (B + 1,), np.int32)
        w_t = io.write_index_storage[self.index]
        w, w_stage = self._host(w_t, "w")
        r_t = io.read_index_storage[self.index] if io.max_kv_read > 0 else None
        scratch = self._scratch("rows", (context,), np.int64) if r_t is not None else None
        rows = step.rows(
            self.index, stride=self.block_physical_stride, out=RowIndices(scratch, w, ro, wo)
        )
        io.true_write_sizes[self.index] = rows.num_write
        if w_stage is not None:
            w_t[: rows.num_write].copy_(w_stage[: rows.num_write])
        if r_t is not None and scratch is not None:
            r, r_stage = self._host(r_t, "r")
            n = keep_window_rows(scratch, ro, wo, self.sliding_window, r)
            io.true_read_sizes[self.index] = n
            if r_stage is not None:
                r_t[:n].copy_(r_stage[:n])
        self.steps += 1
