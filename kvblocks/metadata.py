"""Attention metadata for one forward step (``BlockManager.metadata``).

The arrays are what the kernels take: vLLM-style ``slot_mapping`` (int64), FlashAttention's
padded ``block_tables`` (int32, padded with the null block 0) with ``seq_lens``, and
FlashInfer's CSR page layout ``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len`` (int32). They are numpy arrays, so they export through DLPack
(``np.from_dlpack``, ``torch.from_dlpack``, ``cupy.from_dlpack``).

For CUDA graphs, allocate fixed buffers once and pass them every step::

    >>> from kvblocks import BlockManager, AttentionMetadata
    >>> mgr = BlockManager(64, 16)
    >>> _ = mgr.add("a", list(range(20)))
    >>> buf = AttentionMetadata.allocate(max_batch=8, max_tokens=256, max_indices=64,
    ...                                  max_blocks_per_seq=8)
    >>> meta = mgr.metadata(["a"], [20], out=buf)
    >>> meta.slot_mapping[:3].tolist(), meta.kv_indptr.tolist(), meta.kv_last_page_len.tolist()
    ([16, 17, 18], [0, 2], [4])
    >>> int(buf.slot_mapping[20])   # the unused tail of the fixed buffer is padding
    -1
"""

from __future__ import annotations

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["AttentionMetadata"]

_FIELDS = (
    "slot_mapping",
    "block_tables",
    "seq_lens",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
)


class AttentionMetadata:
    """Metadata arrays of one step; ``allocate`` makes fixed-capacity buffers to reuse.

    Buffers from ``allocate`` remember which sequence each row held: on the next step a row
    whose block table only grew gets just its new blocks written (decode steps then copy a
    few blocks instead of every table). Do not write into them yourself, or call
    ``invalidate()`` after you do.
    """

    __slots__ = _FIELDS + ("num_tokens", "num_seqs", "_row_cache", "_valid_rows", "_owner", "_base")

    def __init__(
        self,
        slot_mapping,
        block_tables,
        seq_lens,
        qo_indptr,
        kv_indptr,
        kv_indices,
        kv_last_page_len,
        num_tokens=0,
        num_seqs=0,
    ):
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.qo_indptr = qo_indptr
        self.kv_indptr = kv_indptr
        self.kv_indices = kv_indices
        self.kv_last_page_len = kv_last_page_len
        self.num_tokens = num_tokens
        self.num_seqs = num_seqs
        self._row_cache = None  # buffers from allocate(): what each row held last step
        self._valid_rows = 0
        self._owner = None
        self._base = None  # views returned by metadata(): the buffers they came from

    @classmethod
    def allocate(
        cls,
        max_batch: int,
        max_tokens: int,
        max_indices: int,
        max_blocks_per_seq: int,
        *,
        kv_indices: bool = True,
    ) -> "AttentionMetadata":
        """Fixed buffers for batches of up to ``max_batch`` sequences, ``max_tokens`` query
        tokens, ``max_indices`` pages in all and ``max_blocks_per_seq`` pages per sequence.

        ``kv_indices=False`` leaves FlashInfer's page list out (``kv_indices`` is None; its
        ``kv_indptr`` offsets are still written): for engines whose kernels read the padded
        ``block_tables`` (FlashAttention). A decode step then rewrites no CSR segment that
        moved, so its cost per sequence stays flat as the batch grows; ``max_indices`` is
        ignored."""
        for name, v in (
            ("max_batch", max_batch),
            ("max_tokens", max_tokens),
            ("max_indices", max_indices if kv_indices else 1),
            ("max_blocks_per_seq", max_blocks_per_seq),
        ):
            if int(v) < 0 or (name != "max_tokens" and int(v) < 1):
                raise InvalidArgumentError(f"{name} must be positive, got {v}")
        meta = cls(
            slot_mapping=np.full(max_tokens, -1, dtype=np.int64),
            block_tables=np.zeros((max_batch, max_blocks_per_seq), dtype=np.int32),
            seq_lens=np.zeros(max_batch, dtype=np.int32),
            qo_indptr=np.zeros(max_batch + 1, dtype=np.int32),
            kv_indptr=np.zeros(max_batch + 1, dtype=np.int32),
            kv_indices=np.zeros(max_indices, dtype=np.int32) if kv_indices else None,
            kv_last_page_len=np.zeros(max_batch, dtype=np.int32),
        )
        meta._row_cache = np.full(4 * max_batch, -1, dtype=np.int64)
        return meta

    @property
    def buffers(self) -> "AttentionMetadata":
        """The fixed buffers behind this object: itself for ``allocate``'s result, the
        buffers it views for one returned by ``BlockManager.metadata(..., out=...)``."""
        return self if self._base is None else self._base

    def view_of(self, buffers: "AttentionMetadata") -> "AttentionMetadata":
        """Mark this object as a view of the used part of ``buffers`` (the builder's call)."""
        self._base = buffers.buffers
        return self

    def row_cache(self, owner: object):
        """``(array, valid_rows)`` for an incremental fill by ``owner``: the int64 row cache
        (4 entries per row) of fixed buffers, or None, and how many leading rows still
        describe ``owner``'s tables (0 for another owner, or after ``invalidate()``)."""
        return self._row_cache, (self._valid_rows if self._owner is owner else 0)

    def remember_rows(self, owner: object, valid_rows: int) -> None:
        """Record that ``owner`` just filled the buffers and ``valid_rows`` rows are cached."""
        self._owner = owner
        self._valid_rows = valid_rows

    def invalidate(self) -> None:
        """Forget what the buffers held: the next fill rewrites every row. Needed only after
        writing into the buffers yourself (metadata() does it for another manager)."""
        self._valid_rows = 0

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in _FIELDS}

    def __repr__(self) -> str:
        return (
            f"AttentionMetadata(num_seqs={self.num_seqs}, num_tokens={self.num_tokens}, "
            f"kv_indices={None if self.kv_indices is None else len(self.kv_indices)})"
        )
