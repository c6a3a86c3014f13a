"""The ``transformers`` ``Cache`` API of :class:`PagedKVCache` (``model.generate(...,
cache=cache)``): construction, the per-layer ``update``, lengths and mask sizes, beam-search row
moves, crop, copies. The work is done by the classes below it: :mod:`.prompts` (``prepare``),
:mod:`.step` (a forward pass), :mod:`.rows` (rows and failure state), :mod:`.storage`."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np
import torch
from transformers.cache_utils import Cache

from ...errors import InvalidArgumentError, NotSupportedError
from .config import _ModelSpec
from .prompts import PromptCache
from .step import _query_length


class PagedKVCache(PromptCache):
    """A transformers ``Cache`` backed by kvblocks: K/V in paged blocks, rows as block tables.

    Args:
        config: the model's config (``model.config``) of a decoder-only model; its text config
            gives the number of layers, K/V heads and head size. Layers are full attention or
            sliding-window attention (``layer_types`` / ``sliding_window``: Gemma 2/3, Mistral,
            Qwen2, gpt-oss); each kind is a KV cache group (:attr:`groups`) whose window layers
            hold only their window. Other layer types are refused.
            Encoder-decoder models: :meth:`encoder_decoder`.
        num_blocks: blocks in the pool (block 0 is kvblocks' reserved null block). One block
            holds ``block_size`` tokens of K and V for ``layers_per_block`` layers of one group
            (every layer when all are full attention).
        block_size: tokens per block.
        device: ``"cpu"`` or ``"cuda[:N]"`` (CUDA storage needs CuPy). The attention still runs on
            the model's device; K/V move to and from the storage device when the two differ.
        dtype: storage dtype (torch dtype or name); ``None`` stores K/V in the dtype of the first
            ``update`` (the model's compute dtype), which keeps outputs bit-for-bit the same as
            transformers' ``DynamicCache``. A different dtype rounds the stored K/V.
        enable_prefix_caching: reuse full blocks of earlier prompts registered with :meth:`prepare`.

    Every refusal (an unsupported model, a bad argument) is a typed kvblocks error raised before
    any storage is allocated.

    Usage::

        cache = PagedKVCache(model.config, num_blocks=1024)
        out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=32)
        out = cache.generate(model, next_ids, attention_mask=next_mask, max_new_tokens=32)
        cache.cached_tokens        # prompt tokens per row the last prepared batch did not recompute

    Like a ``DynamicCache``, a cache that still holds rows continues them on the next
    ``generate`` call; call :meth:`prepare` (or :meth:`reset`) to start a new batch. After a
    forward pass that raised, every use but :meth:`reset` / :meth:`prepare` raises
    :class:`~kvblocks.InvalidStateError`.
    """

    def __init__(
        self,
        config: Any,
        num_blocks: int,
        block_size: int = 16,
        *,
        device: Any = "cpu",
        dtype: Any = None,
        enable_prefix_caching: bool = True,
    ) -> None:
        spec = _ModelSpec(config)
        if spec.encoder_decoder:
            raise NotSupportedError(
                "PagedKVCache holds a decoder's self-attention; this is an encoder-decoder model, "
                "whose cross-attention would write into it too. Use "
                "PagedKVCache.encoder_decoder(config, num_blocks, ...), an EncoderDecoderCache "
                "of a PagedKVCache (self-attention) and a DynamicCache (cross-attention)"
            )
        self._setup(spec, num_blocks, block_size, device, dtype, enable_prefix_caching)

    @classmethod
    def encoder_decoder(
        cls,
        config: Any,
        num_blocks: int,
        block_size: int = 16,
        *,
        device: Any = "cpu",
        dtype: Any = None,
    ) -> Any:
        """An ``EncoderDecoderCache`` for encoder-decoder models (BART, T5, ...): the decoder's
        self-attention K/V in a PagedKVCache (``.self_attention_cache``), the cross-attention
        K/V (computed once from the encoder output) in a ``DynamicCache``.

        Prefix caching is off and :meth:`prepare` refused: a decoder's K/V depend on the encoder
        input through cross-attention, so decoder token ids alone cannot key them.
        """
        from transformers.cache_utils import DynamicCache, EncoderDecoderCache

        spec = _ModelSpec(config)
        if not spec.encoder_decoder:
            raise InvalidArgumentError(
                "PagedKVCache.encoder_decoder needs an encoder-decoder config; "
                "use PagedKVCache(config, ...)"
            )
        self = cls.__new__(cls)
        self._setup(spec, num_blocks, block_size, device, dtype, False)
        self._encoder_decoder = True
        return EncoderDecoderCache(self, DynamicCache())

    # ------------------------------------------------------------------------------------------
    # the Cache API
    # ------------------------------------------------------------------------------------------
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V of ``layer_idx`` and return every row's whole K/V.

        ``key_states`` / ``value_states`` are ``[batch, kv_heads, new_tokens, head_dim]``; the
        result is ``[batch, kv_heads, cached + new_tokens, head_dim]``.
        """
        return self._update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        self._check_usable()
        if layer_idx >= self.num_layers:
            return 0
        return self._layer_len[layer_idx]

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> Tuple[int, int]:
        """``(kv_length, kv_offset)`` for the attention mask. transformers 5 passes the query
        length, 4.x the ``cache_position`` tensor (its length is the query length).

        A sliding-window layer of window ``W`` whose rows hold ``c`` tokens returns the K/V of
        positions ``[max(c - W + 1, 0), c + q)`` (what transformers' ``DynamicSlidingWindowLayer``
        returns): the window of the step's first query and the new tokens."""
        c = self.get_seq_length(layer_idx)
        q = _query_length(query_length)
        w = self._plan.windows[layer_idx] if layer_idx < self.num_layers else None
        if w is None:
            return c + q, 0
        return min(c, w - 1) + q, max(c - w + 1, 0)

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return -1

    # transformers < 5 names
    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return -1

    def get_usable_length(self, new_seq_length: int, layer_idx: int = 0) -> int:
        return self.get_seq_length(layer_idx)

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        return len(self._rows) if self._rows else -1

    @property
    def max_batch_size(self) -> int:  # transformers 4.x name
        return self.batch_size

    # transformers' generate() marks a cache the caller passed in by setting this attribute:
    # the first thing a generate call does to it, so a cache that cannot serve refuses here,
    # before generate slices its inputs by get_seq_length()
    @property
    def _is_user_defined(self) -> bool:
        return self.__dict__.get("_user_defined", False)

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        if self._step is not None:
            self._fail_with("a forward pass stopped before its last layer")
        self._check_usable()
        self.__dict__["_user_defined"] = value

    def reset(self) -> None:
        """Free every row. Full computed prompt blocks stay in the prefix cache (evictable).
        Also the way back after a forward pass that raised."""
        self._drop_hook()
        for seq in dict.fromkeys(self._rows):
            self.manager.free(seq)
        self._init_rows()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` becomes old row ``beam_idx[i]`` (fork / free, no K/V copy)."""
        self._select_rows(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (in that order)."""
        self._select_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` times in place (children fork their row's blocks)."""
        self._select_rows(np.repeat(np.arange(len(self._rows)), int(repeats)))

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last ``-tokens_to_remove`` tokens of every row (``tokens_to_remove <= 0``).

        A positive value is the transformers 4.x meaning: keep that many tokens.
        """
        self._check_usable()
        n = int(tokens_to_remove)
        new_len = self._layer_len[0] + n if n <= 0 else min(n, self._layer_len[0])
        if new_len == self._layer_len[0]:
            return
        self._check_idle("crop")
        if new_len < 0:
            raise InvalidArgumentError(
                f"crop({n}): the cache holds only {self._layer_len[0]} tokens per row"
            )
        self._check_crop_window(new_len)
        for seq in self._rows:
            self.manager.truncate(seq, new_len)
        self._write_from = [min(w, new_len) for w in self._write_from]
        self._layer_len = [new_len] * self.num_layers

    def __deepcopy__(self, memo: Dict[int, Any]) -> "PagedKVCache":
        """transformers' prompt-reuse recipe (``copy.deepcopy(prompt_cache)``): a new cache on
        the same manager and storage whose rows fork this cache's rows. No K/V is copied; a row
        that writes into a shared, partly filled block gets its own copy of that block. Each
        cache frees only its own rows; the prefix cache is shared."""
        self._check_usable()
        self._check_idle("copy.deepcopy")
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for name in (
            "device",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "block_size",
            "num_blocks",
            "enable_prefix_caching",
            "_encoder_decoder",
            "_plan",
            "layers_per_block",
            "_shared",
            "cached_tokens",
        ):
            setattr(new, name, getattr(self, name))
        Cache.__init__(new, layers=new._make_layers())
        new._init_rows()
        new._stats = dict(self._stats)
        rows = []
        try:
            for seq in self._rows:
                rows.append(self._fork(seq))
        except BaseException:
            for seq in rows:
                self.manager.free(seq)
            raise
        new._rows = rows
        new._write_from = list(self._write_from)
        new._layer_len = list(self._layer_len)
        return new

    def __copy__(self) -> "PagedKVCache":
        """Like :meth:`__deepcopy__`: two caches can never share rows (each frees its own)."""
        return self.__deepcopy__({})

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise NotSupportedError(
            "a PagedKVCache cannot be pickled (its K/V live in kvblocks blocks); copy.deepcopy "
            "forks it on the same manager, and prepare() reuses prompts through the prefix cache"
        )

    @property
    def stats(self) -> Dict[str, Any]:
        """Counters since creation, and the current memory use.

        ``prompts`` / ``prompt_tokens``: registered by :meth:`prepare`; ``cached_tokens``: prompt
        tokens not recomputed; ``hit_tokens``: prompt tokens found in the prefix cache (a row can
        find more than the batch minimum that ``generate`` skips); ``forks``; ``copy_on_write_blocks``;
        ``rows``; ``blocks_held``; ``kv_bytes_held``; ``last_cached_tokens``.
        """
        out = dict(self._stats)
        out["last_cached_tokens"] = self.cached_tokens
        out["rows"] = len(self._rows)
        out["blocks_held"] = self.num_blocks_held()
        out["kv_bytes_held"] = self.kv_bytes_held()
        return out

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, groups={len(self.groups)}, "
            f"num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, device={self.device!r}, rows={len(self._rows)}, "
            f"tokens={self._layer_len[0]})"
        )
