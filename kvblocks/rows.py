"""Per-token row indices of one step (``BlockManager.row_indices``).

Some engines keep the KV cache as one flat tensor of rows and address it with per-token
indices instead of block tables: transformers' continuous batching writes the new K/V with
``index_copy_(write_index)`` and reads the context back with ``index_select(read_index)``. With
blocks of ``block_size`` rows placed ``stride`` rows apart, token ``p`` of a sequence is row
``block_table[p // block_size] * stride + offset + p % block_size``.
``row_indices`` writes those rows for a whole batch in one native call:

    >>> from kvblocks import BlockManager, RowIndices
    >>> mgr = BlockManager(16, 4)
    >>> _ = mgr.add("a", [1, 2, 3, 4, 5, 6])
    >>> mgr.block_table("a").tolist()
    [1, 2]
    >>> rows = mgr.row_indices(["a"], [6], stride=16)
    >>> rows.write_index.tolist()
    [16, 17, 18, 19, 32, 33]
    >>> mgr.append("a", [7])
    >>> rows = mgr.row_indices(["a"], [1], stride=16, offset=8, block_tables=True)
    >>> rows.write_index.tolist(), rows.read_offsets.tolist(), rows.block_tables.tolist()
    ([42], [0, 7], [[6, 10]])

The arrays are numpy (``torch.from_numpy`` and DLPack share them without a copy). For a fixed
set of buffers reused every step, pass ``out=RowIndices.allocate(...)``, or a ``RowIndices``
over arrays of your own (views of an engine's index storage); a field left ``None`` there is not
built.
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np

from .errors import InvalidArgumentError

__all__ = ["RowIndices"]


class RowIndices:
    """Row indices of one step.

    - ``read_index`` int64 ``[num_read]``: every context row, sequence after sequence;
    - ``write_index`` int64 ``[num_write]``: the rows of the step's query tokens;
    - ``read_offsets`` / ``write_offsets`` int32 ``[B + 1]``: where each sequence starts in
      them (``cu_seq_lens_k`` / ``cu_seq_lens_q``);
    - ``block_tables`` int32 ``[B, max_blocks]`` or None: ``(block * stride + offset) //
      block_size`` per block (the page index of its first row), padded with the null block's.
    """

    __slots__ = (
        "read_index",
        "write_index",
        "read_offsets",
        "write_offsets",
        "block_tables",
        "num_read",
        "num_write",
        "num_seqs",
    )

    def __init__(
        self,
        read_index: Optional[np.ndarray],
        write_index: Optional[np.ndarray],
        read_offsets: np.ndarray,
        write_offsets: np.ndarray,
        block_tables: Optional[np.ndarray] = None,
        num_read: int = 0,
        num_write: int = 0,
        num_seqs: int = 0,
    ) -> None:
        self.read_index = read_index
        self.write_index = write_index
        self.read_offsets = read_offsets
        self.write_offsets = write_offsets
        self.block_tables = block_tables
        self.num_read = num_read
        self.num_write = num_write
        self.num_seqs = num_seqs

    @classmethod
    def allocate(
        cls, max_batch: int, max_write: int, max_read: int, max_blocks_per_seq: int = 0
    ) -> "RowIndices":
        """Fixed buffers for ``row_indices(..., out=)``: ``max_batch`` sequences,
        ``max_write`` query rows, ``max_read`` context rows, and a block table of
        ``max_blocks_per_seq`` columns (0: none).

        >>> buf = RowIndices.allocate(8, 64, 1024)
        >>> buf.read_index.shape, buf.read_offsets.shape, buf.block_tables is None
        ((1024,), (9,), True)
        """
        for name, v, lo in (
            ("max_batch", max_batch, 1),
            ("max_write", max_write, 0),
            ("max_read", max_read, 0),
            ("max_blocks_per_seq", max_blocks_per_seq, 0),
        ):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < lo:
                raise InvalidArgumentError(f"RowIndices.allocate: {name} must be an int >= {lo}")
        bt = (
            np.zeros((max_batch, max_blocks_per_seq), dtype=np.int32)
            if max_blocks_per_seq
            else None
        )
        return cls(
            np.zeros(max_read, dtype=np.int64),
            np.zeros(max_write, dtype=np.int64),
            np.zeros(max_batch + 1, dtype=np.int32),
            np.zeros(max_batch + 1, dtype=np.int32),
            bt,
        )

    def __repr__(self) -> str:
        return (
            f"RowIndices(seqs={self.num_seqs}, read={self.num_read}, write={self.num_write}, "
            f"block_tables={self.block_tables is not None})"
        )

    def as_torch(self) -> Any:
        """The arrays as torch tensors sharing their memory (``torch.from_numpy``): a dict of
        the fields that are set."""
        import torch

        return {
            name: torch.from_numpy(getattr(self, name))
            for name in (
                "read_index",
                "write_index",
                "read_offsets",
                "write_offsets",
                "block_tables",
            )
            if getattr(self, name) is not None
        }
