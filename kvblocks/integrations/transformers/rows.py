"""Rows of a :class:`PagedKVCache` as kvblocks sequences: setup, the row state, forks and row
selection (beam search), memory accounting, and the failure state a forward pass that raised
leaves (every use but ``reset()`` / ``prepare()`` refused)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ...errors import InvalidArgumentError, InvalidStateError, InvalidTypeError
from ...groups import GroupPlan, plan_groups
from .config import _count, _device, _ModelSpec
from .layers import _PagedLayer
from .storage import PagedStorage, _Shared, _torch_dtype


class PagedRows(PagedStorage):
    """The row state of a :class:`PagedKVCache`: one sequence per batch row, in one
    :class:`kvblocks.BlockManager` (a KV cache group per kind of layer)."""

    def _setup(
        self,
        spec: _ModelSpec,
        num_blocks: Any,
        block_size: Any,
        device: Any,
        dtype: Any,
        enable_prefix_caching: Any,
    ) -> None:
        from ... import BlockManager  # the allocator (C core)

        num_blocks = _count(num_blocks, "num_blocks")
        block_size = _count(block_size, "block_size")
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise InvalidTypeError(
                f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}"
            )
        store_dtype = None if dtype is None else _torch_dtype(dtype)
        self.device = _device(device)
        self.num_layers = spec.num_layers
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._encoder_decoder = False
        self._plan: GroupPlan = plan_groups(spec.windows)
        #: layers one block holds K and V for (all of them when every layer is full attention)
        self.layers_per_block = self._plan.layers_per_block
        # the manager checks the ranges; nothing is allocated before every check passed
        self._shared = _Shared(
            BlockManager(
                num_blocks,
                block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                groups=self._plan.groups or None,  # None: the default single full group
            )
        )
        if store_dtype is not None:
            self._allocate(store_dtype)
        super().__init__(layers=self._make_layers())
        self._init_rows()
        #: prompt tokens per row reused from the prefix cache (not recomputed) by the last prepare()
        self.cached_tokens = 0
        self._stats = {
            "prompts": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "hit_tokens": 0,
            "copy_on_write_blocks": 0,
            "forks": 0,
        }

    def _make_layers(self) -> List[Any]:
        return [_PagedLayer(self, i) for i in range(self.num_layers)]

    @property
    def groups(self) -> Tuple[Any, ...]:
        """The :class:`kvblocks.KVGroup` of the manager, in group-index order (one full group
        when every layer is full attention)."""
        return tuple(self.manager.groups)

    @property
    def _windowed(self) -> bool:
        return any(w is not None for w in self._plan.windows)

    def _init_rows(self) -> None:
        self._rows: List[int] = []  # sequence id of each batch row (a prompt's
        # copies share its id until the prompt is written)
        self._write_from: List[int] = []  # positions below this are not written (shared)
        self._layer_len = [0] * self.num_layers  # tokens per row, per layer (all layers agree
        # between forward passes)
        self._prompt: Optional[Dict[str, Any]] = None  # prompts registered by prepare(), until
        # their last token is fed
        self._candidates: Dict[int, int] = {}  # row -> representative row (first pass only)
        self._step: Optional[Dict[str, Any]] = None  # the current forward pass
        self._failed: Optional[str] = None  # why the rows are unusable (a forward raised)

    # ------------------------------------------------------------------------------------------
    # memory accounting
    # ------------------------------------------------------------------------------------------
    def block_tables(self, group: int = 0) -> List[np.ndarray]:
        """The block table of every row (int32 arrays) in one KV cache group (:attr:`groups`);
        entries a sliding-window group released read the null block 0."""
        return [self.manager.block_table(seq, group=group) for seq in self._rows]

    def num_blocks_held(self) -> int:
        """Distinct blocks referenced by the rows in every group (shared blocks count once;
        blocks a sliding-window group released are not held)."""
        tables = [t for g in range(len(self.groups)) for t in self.block_tables(g)]
        if not tables:
            return 0
        held = np.unique(np.concatenate(tables))
        return int(np.count_nonzero(held))

    def kv_bytes_held(self) -> int:
        """K/V bytes of the blocks the rows hold (compare with :func:`dynamic_cache_bytes`).
        With sliding-window layers only the blocks of their windows are held."""
        return self.num_blocks_held() * self.bytes_per_block

    # ------------------------------------------------------------------------------------------
    # failure and state checks
    # ------------------------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._failed is not None:
            raise InvalidStateError(
                f"PagedKVCache: a forward pass failed ({self._failed}); its rows are not usable. "
                "Call cache.reset() or cache.prepare(...) before the next generate call"
            )

    def _check_idle(self, what: str) -> None:
        if self._step is not None or self._prompt is not None:
            raise InvalidStateError(
                f"{what} in the middle of a forward pass, or before generate fed the prepared "
                "prompts"
            )

    def _fail(self, exc: BaseException) -> None:
        """A forward pass raised: keep the rows as they are (inspectable) but refuse to serve them
        until reset() / prepare(). A cache left without rows has nothing to protect."""
        self._drop_hook()
        if self._failed is None and (self._rows or self._prompt is not None):
            self._failed = f"{type(exc).__name__}: {exc}"
        self._step = None
        self._candidates = {}

    def _fail_with(self, why: str) -> None:
        self._fail(InvalidStateError(why))
        self._check_usable()

    def _drop_hook(self) -> None:
        prompt = self._prompt
        if prompt is not None and prompt["hook"] is not None:
            prompt["hook"].remove()
            prompt["hook"] = None

    # ------------------------------------------------------------------------------------------
    # rows
    # ------------------------------------------------------------------------------------------
    def _fork(self, seq: int) -> int:
        child = next(self._shared.ids)
        self.manager.fork(seq, child)
        self._stats["forks"] += 1
        return child

    def _select_rows(self, indices: Any) -> None:
        """New row ``i`` = old row ``indices[i]``: the first user of an old row keeps its
        sequence (the row itself when it stays in place), other users fork it, unused rows are freed."""
        self._check_usable()
        self._check_idle("reordering rows")
        if isinstance(indices, torch.Tensor):
            idx = indices.detach().to("cpu").numpy()
        else:
            idx = np.asarray(indices)
        idx = idx.astype(np.int64).reshape(-1)
        old = self._rows
        if idx.size and (idx.min() < 0 or idx.max() >= len(old)):
            raise InvalidArgumentError(f"row index out of range [0, {len(old)})")
        if len(old) == 0:
            return
        users: Dict[int, List[int]] = {}
        for new_i, old_j in enumerate(idx.tolist()):
            users.setdefault(old_j, []).append(new_i)
        rows: List[Optional[int]] = [None] * idx.size
        write_from = [0] * idx.size
        for old_j, seq in enumerate(old):
            us = users.get(old_j)
            if not us:
                continue
            owner = old_j if old_j in us else us[0]
            for u in us:
                rows[u] = seq if u == owner else self._fork(seq)
                write_from[u] = self._write_from[old_j]
        for old_j, seq in enumerate(old):
            if old_j not in users:
                self.manager.free(seq)
        self._rows = rows  # type: ignore[assignment]
        self._write_from = write_from

    def _check_crop_window(self, new_len: int) -> None:
        """Refuse (before any row changes) a crop whose shorter rows would need K/V a window
        group released. The manager keeps, for rows of ``n`` computed tokens, the window of
        position ``n - 1`` (a step may recompute the newest token)."""
        bs = self.block_size
        for g, group in enumerate(self._plan.groups):
            if group.window is None:
                continue
            first = max(new_len - 1 - group.window + 1, 0) // bs if new_len > 0 else -1
            for seq in dict.fromkeys(self._rows):
                table = self.manager.block_table(seq, group=g)
                released = int(np.argmax(table != 0)) if (table != 0).any() else table.size
                if released and first < released:
                    raise InvalidStateError(
                        f"crop to {new_len} tokens: the sliding-window layers (window "
                        f"{group.window}) already released positions below {released * bs} "
                        "that the shorter rows would attend to"
                    )
