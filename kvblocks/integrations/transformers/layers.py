"""The per-layer objects transformers' layered ``Cache`` API expects: views of one layer of a
:class:`PagedKVCache`, whose state (rows, storage, step) lives in the cache."""

from __future__ import annotations

from typing import Any, Tuple

import torch

try:  # the layered Cache API (transformers >= 4.56)
    from transformers.cache_utils import CacheLayerMixin
except ImportError as exc:  # pragma: no cover - depends on the installed version
    raise ImportError(
        "kvblocks.integrations.transformers needs transformers >= 4.56 (the layered Cache API)"
    ) from exc

from ...errors import InvalidStateError


class _PagedLayer(CacheLayerMixin):
    """One layer's view of a :class:`PagedKVCache` (all state lives in the parent)."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, parent: Any, layer_idx: int) -> None:
        super().__init__()
        self._parent = parent
        self._layer_idx = layer_idx
        self.is_initialized = True  # storage is allocated lazily by the parent
        # transformers builds the sliding-window mask from the sizes of a layer marked sliding
        self.is_sliding = parent._plan.windows[layer_idx] is not None

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._parent._update(key_states, value_states, self._layer_idx)

    def get_seq_length(self) -> int:
        return self._parent.get_seq_length(self._layer_idx)

    def get_mask_sizes(self, query_length: Any) -> Tuple[int, int]:
        return self._parent.get_mask_sizes(query_length, self._layer_idx)

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:  # transformers 4.x name
        return -1

    # Cache-level operations act on the block tables once, not per layer.
    def reset(self) -> None:  # pragma: no cover - the parent overrides every caller
        pass

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:  # pragma: no cover
        raise InvalidStateError("reorder a PagedKVCache through the cache, not one layer")

    def crop(self, tokens_to_remove: int) -> None:  # pragma: no cover
        raise InvalidStateError("crop a PagedKVCache through the cache, not one layer")

    def batch_repeat_interleave(self, repeats: int) -> None:  # pragma: no cover
        raise InvalidStateError("repeat a PagedKVCache through the cache, not one layer")

    def batch_select_indices(self, indices: torch.Tensor) -> None:  # pragma: no cover
        raise InvalidStateError("select rows of a PagedKVCache through the cache, not one layer")

    def offload(self) -> None:
        pass

    def prefetch(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"_PagedLayer({self._layer_idx})"
