"""Hugging Face ``transformers`` generation on a kvblocks paged KV cache.

:class:`PagedKVCache` is a ``transformers`` ``Cache`` whose keys and values live in the blocks of
a :class:`kvblocks.KVCache`, with block tables kept by a :class:`kvblocks.BlockManager`:

* every batch row of ``generate`` is one kvblocks sequence;
* ``update(k, v, layer)`` scatters the new tokens' K/V into their slots (:func:`kvblocks.ops.write_slots`)
  and returns each row's whole K/V read back from its blocks (:func:`kvblocks.ops.gather`);
* beam search and ``num_return_sequences`` reorder, select and repeat rows with
  :meth:`BlockManager.fork` / ``free`` (block-table moves): rows share blocks, and a row that writes
  into a shared, partly filled block first gets a private copy (copy-on-write through
  :meth:`BlockManager.take_copies` and :func:`kvblocks.ops.copy_blocks`). No K/V tensor is copied
  to reorder beams;
* prefix caching across ``generate`` calls: :meth:`PagedKVCache.prepare` registers the prompts
  (token ids and attention mask) before ``generate``; full blocks already in the prefix cache are
  reused and ``generate`` computes only the rest (``cache.cached_tokens``, ``cache.stats``).

Left padding is stored like any other token (its positions are masked by the attention mask),
so generated tokens are the same as with transformers' default ``DynamicCache``.

Prefix-cache rule for padded rows: a row's blocks are hashed from its token ids, salted with its
padding. A row without padding (attention mask all ones) is hashed unsalted, so it matches any
earlier unpadded prompt with the same leading tokens, whatever batch it came in. A left-padded row
is salted with its number of pad tokens and matches only rows with the same padding and the same
tokens (pad positions included), because the K/V of a padded row depend on where its real tokens
start. Any other mask pattern gets a salt derived from the whole mask. Generated tokens are not
seen by the cache (transformers passes it K/V, not token ids): their blocks are hashed from a
placeholder id that no real prompt contains, so they never serve prefix hits.

Needs ``torch`` and ``transformers`` (the layered ``Cache`` API, transformers >= 4.56).

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> from kvblocks.integrations.transformers import PagedKVCache
>>> model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
>>> cache = PagedKVCache(model.config, num_blocks=64, block_size=16)
>>> out = model.generate(torch.tensor([[5, 6, 7]]), cache=cache, max_new_tokens=4, do_sample=False)
>>> cache.get_seq_length()
6
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
from transformers.cache_utils import Cache

try:  # the layered Cache API (transformers >= 4.56)
    from transformers.cache_utils import CacheLayerMixin
except ImportError as exc:  # pragma: no cover - depends on the installed version
    raise ImportError(
        "kvblocks.integrations.transformers needs transformers >= 4.56 (the layered Cache API)"
    ) from exc

from .. import ops
from ..errors import InvalidArgumentError, InvalidStateError, InvalidTypeError, OutOfBlocksError
from ..layout import KVLayout
from ..storage import KVCache

__all__ = ["PagedKVCache", "dynamic_cache_bytes"]

#: token id recorded for generated tokens (int32 max: never a real vocabulary id)
PLACEHOLDER_TOKEN = 2**31 - 1

# torch dtype -> (kvblocks dtype name, torch dtype of the raw storage view)
_TORCH_DTYPES: Dict[torch.dtype, Tuple[str, torch.dtype]] = {
    torch.float32: ("fp32", torch.float32),
    torch.float16: ("fp16", torch.float16),
    torch.bfloat16: ("bf16", torch.int16),
}
for _name, _kv in (("float8_e4m3fn", "fp8_e4m3"), ("float8_e5m2", "fp8_e5m2")):
    if hasattr(torch, _name):
        _TORCH_DTYPES[getattr(torch, _name)] = (_kv, torch.uint8)
_NUMPY_OF_RAW = {torch.int16: np.uint16, torch.uint8: np.uint8}


def _torch_dtype(dtype: Any) -> torch.dtype:
    """A torch dtype from a torch dtype or its name (``"float16"``, ``"bf16"``, ...)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _TORCH_DTYPES:
            raise InvalidTypeError(f"unsupported KV dtype {dtype}")
        return dtype
    if isinstance(dtype, str):
        names = {"fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16",
                 "bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn",
                 "fp8_e5m2": "float8_e5m2"}
        t = getattr(torch, names.get(dtype.lower(), dtype.lower()), None)
        if isinstance(t, torch.dtype) and t in _TORCH_DTYPES:
            return t
    raise InvalidTypeError(f"unsupported KV dtype {dtype!r}")


def dynamic_cache_bytes(cache: Any) -> int:
    """K/V bytes held by a transformers ``DynamicCache`` (the baseline for :meth:`PagedKVCache.kv_bytes_held`)."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


class _PagedLayer(CacheLayerMixin):
    """One layer's view of a :class:`PagedKVCache` (all state lives in the parent)."""

    is_compileable = False
    is_croppable = True
    is_sliding = False

    def __init__(self, parent: "PagedKVCache", layer_idx: int) -> None:
        super().__init__()
        self._parent = parent
        self._layer_idx = layer_idx
        self.is_initialized = True  # storage is allocated lazily by the parent

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return self._parent._update(key_states, value_states, self._layer_idx)

    def get_seq_length(self) -> int:
        return self._parent._layer_len[self._layer_idx]

    def get_mask_sizes(self, query_length: Any) -> Tuple[int, int]:
        return self.get_seq_length() + _query_length(query_length), 0

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


class PagedKVCache(Cache):
    """A transformers ``Cache`` backed by kvblocks: K/V in paged blocks, rows as block tables.

    Args:
        config: the model's config (``model.config``); its decoder text config gives the number
            of layers, KV heads and head size. Every layer must be full attention.
        num_blocks: blocks in the pool (block 0 is kvblocks' reserved null block). One block
            holds ``block_size`` tokens of K and V for every layer.
        block_size: tokens per block.
        device: ``"cpu"`` or ``"cuda[:N]"`` (CUDA storage needs CuPy). The attention still runs on
            the model's device; K/V move to and from the storage device when the two differ.
        dtype: storage dtype (torch dtype or name); ``None`` stores K/V in the dtype of the first
            ``update`` (the model's compute dtype), which keeps outputs bit-for-bit the same as
            transformers' ``DynamicCache``. A different dtype rounds the stored K/V.
        enable_prefix_caching: reuse full blocks of earlier prompts registered with :meth:`prepare`.

    Usage::

        cache = PagedKVCache(model.config, num_blocks=1024)
        out = model.generate(input_ids, attention_mask=mask, cache=cache, max_new_tokens=32)
        cache.prepare(next_ids, next_mask)     # next request batch: frees the rows, finds prefix hits
        out = model.generate(next_ids, attention_mask=next_mask, cache=cache, max_new_tokens=32)
        cache.cached_tokens                    # prompt tokens per row that were not recomputed

    Like a ``DynamicCache``, a cache that still holds rows continues them on the next
    ``generate`` call; call :meth:`prepare` (or :meth:`reset`) to start a new batch.
    """

    def __init__(self, config: Any, num_blocks: int, block_size: int = 16, *,
                 device: str = "cpu", dtype: Any = None,
                 enable_prefix_caching: bool = True) -> None:
        from .. import BlockManager  # the allocator (C core)

        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = int(text.num_hidden_layers)
        layer_types = getattr(text, "layer_types", None)
        if layer_types is not None:
            bad = sorted({t for t in layer_types if t != "full_attention"})
            if bad:
                raise NotImplementedError(
                    f"PagedKVCache supports full-attention layers only; this model has {bad}"
                )
        elif getattr(text, "sliding_window", None) is not None and getattr(
                text, "use_sliding_window", True):
            raise NotImplementedError(
                "PagedKVCache supports full-attention layers only; this config sets sliding_window "
                f"={text.sliding_window} (set it to None to use full attention)"
            )
        heads = int(text.num_attention_heads)
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // heads
        self.num_layers = num_layers
        self.num_kv_heads = int(kv_heads)
        self.head_dim = int(head_dim)
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.device = str(device)
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._store_dtype: Optional[torch.dtype] = None if dtype is None else _torch_dtype(dtype)

        self.manager = BlockManager(self.num_blocks, self.block_size,
                                    enable_prefix_caching=self.enable_prefix_caching)
        #: the kvblocks storage; allocated on the first update when ``dtype`` is None
        self.kv: Optional[KVCache] = None
        if self._store_dtype is not None:
            self._allocate(self._store_dtype)

        super().__init__(layers=[_PagedLayer(self, i) for i in range(num_layers)])
        self._ids = itertools.count()
        self._rows: List[int] = []             # sequence id of each batch row
        self._write_from: List[int] = []       # positions below this are not written (shared)
        self._layer_len = [0] * num_layers     # tokens per row, per layer (all layers agree
                                               # between forward passes)
        self._pending: Optional[Dict[str, Any]] = None  # prompts registered by prepare()
        self._candidates: Dict[int, int] = {}  # row -> representative row (first pass only)
        self._step: Optional[Dict[str, Any]] = None     # the current forward pass
        #: prompt tokens per row reused from the prefix cache (not recomputed) by the last prepare()
        self.cached_tokens = 0
        self._stats = {"prompts": 0, "prompt_tokens": 0, "cached_tokens": 0,
                       "hit_tokens": 0, "copy_on_write_blocks": 0, "forks": 0}

    # ------------------------------------------------------------------------------------------
    # storage
    # ------------------------------------------------------------------------------------------
    def _allocate(self, dtype: torch.dtype) -> None:
        name, raw = _TORCH_DTYPES[dtype]
        layout = KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, name)
        self.kv = KVCache(layout, self.num_blocks, device=self.device)
        self._store_dtype = dtype
        self._raw_dtype = raw
        self._torch_device = torch.device(self.device)

    def _to_storage(self, t: torch.Tensor) -> Any:
        """[N, H, D] torch tensor -> array accepted by kvblocks.ops (numpy / CuPy, storage dtype)."""
        t = t.detach().to(device=self._torch_device, dtype=self._store_dtype)
        raw = t.view(self._raw_dtype) if self._raw_dtype is not self._store_dtype else t
        if self.kv.is_cuda:
            from .._cuda import get_cupy

            cp = get_cupy()
            a = cp.from_dlpack(raw.contiguous())
            return a.view(_NUMPY_OF_RAW[self._raw_dtype]) if raw.dtype in _NUMPY_OF_RAW else a
        a = raw.numpy()
        return a.view(_NUMPY_OF_RAW[self._raw_dtype]) if raw.dtype in _NUMPY_OF_RAW else a

    def _from_storage(self, a: Any) -> torch.Tensor:
        """numpy / CuPy array in the storage dtype -> torch tensor of ``self._store_dtype``."""
        if self._raw_dtype is not self._store_dtype:
            a = a.view(np.int16 if self._raw_dtype is torch.int16 else np.uint8)
        t = torch.from_dlpack(a) if self.kv.is_cuda else torch.from_numpy(a)
        return t.view(self._store_dtype) if self._raw_dtype is not self._store_dtype else t

    # ------------------------------------------------------------------------------------------
    # the Cache API
    # ------------------------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' K/V of ``layer_idx`` and return every row's whole K/V.

        ``key_states`` / ``value_states`` are ``[batch, kv_heads, new_tokens, head_dim]``; the
        result is ``[batch, kv_heads, cached + new_tokens, head_dim]``.
        """
        return self._update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= self.num_layers:
            return 0
        return self._layer_len[layer_idx]

    def get_mask_sizes(self, query_length: Any, layer_idx: int = 0) -> Tuple[int, int]:
        """``(kv_length, kv_offset)`` for the attention mask. transformers 5 passes the query
        length, 4.x the ``cache_position`` tensor (its length is the query length)."""
        return self.get_seq_length(layer_idx) + _query_length(query_length), 0

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

    def reset(self) -> None:
        """Free every row. Full prompt blocks stay in the prefix cache (evictable)."""
        for seq in self._rows:
            self.manager.free(seq)
        self._rows = []
        self._write_from = []
        self._layer_len = [0] * self.num_layers
        self._pending = None
        self._step = None
        self._candidates = {}

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
        n = int(tokens_to_remove)
        new_len = self._layer_len[0] + n if n <= 0 else min(n, self._layer_len[0])
        if new_len < 0:
            raise InvalidArgumentError(
                f"crop({n}): the cache holds only {self._layer_len[0]} tokens per row")
        if new_len == self._layer_len[0]:
            return
        for seq in self._rows:
            self.manager.truncate(seq, new_len)
        self._write_from = [min(w, new_len) for w in self._write_from]
        self._layer_len = [new_len] * self.num_layers

    # ------------------------------------------------------------------------------------------
    # prefix caching
    # ------------------------------------------------------------------------------------------
    def prepare(self, input_ids: Any, attention_mask: Any = None) -> int:
        """Start a new batch of prompts: free the current rows, register ``input_ids``.

        Call it right before ``model.generate(input_ids, attention_mask=..., cache=cache)`` with
        the same (unexpanded) ``input_ids`` and ``attention_mask``. Prompt blocks already in the
        prefix cache are reused; the returned count of leading tokens per row (the minimum over
        rows, a multiple of ``block_size``) is what ``generate`` will not recompute; it is also
        ``cache.cached_tokens``. ``num_return_sequences`` / ``num_beams`` copies of each prompt
        share its blocks.
        """
        self.reset()
        ids = _as_2d_int(input_ids, "input_ids")
        mask = None if attention_mask is None else _as_2d_int(attention_mask, "attention_mask")
        if mask is not None and mask.shape != ids.shape:
            raise InvalidArgumentError(
                f"attention_mask shape {mask.shape} does not match input_ids {ids.shape}")
        P, L = ids.shape
        if L == 0:
            raise InvalidArgumentError("prepare: empty prompts")
        if ids.min() < 0 or ids.max() >= PLACEHOLDER_TOKEN:
            raise InvalidArgumentError("prepare: token ids must be in [0, 2**31 - 1)")
        seqs, hits = [], []
        try:
            for r in range(P):
                seq = next(self._ids)
                n = self.manager.add(seq, ids[r].astype(np.int32),
                                     salt=_padding_salt(None if mask is None else mask[r]))
                seqs.append(seq)
                hits.append(int(n))
        except BaseException:
            for seq in seqs:
                self.manager.free(seq)
            raise
        common = min(hits)
        self._rows = seqs
        self._write_from = hits
        self._layer_len = [common] * self.num_layers
        self._pending = {"prompts": P, "length": L}
        self.cached_tokens = common
        st = self._stats
        st["prompts"] += P
        st["prompt_tokens"] += P * L
        st["cached_tokens"] += P * common
        st["hit_tokens"] += sum(hits)
        return common

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

    # ------------------------------------------------------------------------------------------
    # memory accounting
    # ------------------------------------------------------------------------------------------
    def block_tables(self) -> List[np.ndarray]:
        """The block table of every row (int32 arrays)."""
        return [self.manager.block_table(seq) for seq in self._rows]

    def num_blocks_held(self) -> int:
        """Distinct blocks referenced by the rows (shared blocks count once)."""
        tables = self.block_tables()
        if not tables:
            return 0
        return int(np.unique(np.concatenate(tables)).size)

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block over all layers (0 before the storage dtype is known)."""
        return 0 if self.kv is None else self.kv.layout.bytes_per_block

    def kv_bytes_held(self) -> int:
        """K/V bytes of the blocks the rows hold (compare with :func:`dynamic_cache_bytes`)."""
        return self.num_blocks_held() * self.bytes_per_block

    # ------------------------------------------------------------------------------------------
    # internals
    # ------------------------------------------------------------------------------------------
    def _fork(self, seq: int) -> int:
        child = next(self._ids)
        self.manager.fork(seq, child)
        self._stats["forks"] += 1
        return child

    def _select_rows(self, indices: Any) -> None:
        """New row ``i`` = old row ``indices[i]``: the first user of an old row keeps its
        sequence (the row itself when it stays in place), other users fork it, unused rows are freed."""
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

    def _create_rows(self, key_states: torch.Tensor) -> None:
        """First forward of a cache nobody prepared: one sequence per row, token ids unknown.

        Rows are registered with placeholder ids and a unique salt (no prefix-cache hits). A row
        whose layer-0 keys equal the previous row's (``num_return_sequences`` / beam copies of
        one prompt) becomes a dedup candidate: it is written like any row, and if its K and V
        equal its representative's bit for bit in every layer, its blocks are released at the end
        of the pass and it forks the representative instead (:meth:`_dedupe`).
        """
        B, _, q, _ = key_states.shape
        tokens = np.full(q, PLACEHOLDER_TOKEN, dtype=np.int32)
        rows: List[int] = []
        candidates: Dict[int, int] = {}
        try:
            for r in range(B):
                seq = next(self._ids)
                self.manager.add(seq, tokens, salt=f"kvblocks-anonymous-{seq}-{id(self)}")
                rows.append(seq)
                if r:
                    rep = candidates.get(r - 1, r - 1)
                    if torch.equal(key_states[r], key_states[rep]):
                        candidates[r] = rep
        except BaseException:
            for seq in rows:
                self.manager.free(seq)
            raise
        self._rows = rows
        self._write_from = [0] * B
        self._candidates = candidates

    def _check_candidates(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Keep only the dedup candidates whose K and V equal their representative's."""
        for r, rep in list(self._candidates.items()):
            if not (torch.equal(key_states[r], key_states[rep])
                    and torch.equal(value_states[r], value_states[rep])):
                del self._candidates[r]

    def _dedupe(self) -> None:
        """End of the first pass: candidates equal in every layer fork their representative."""
        candidates, self._candidates = self._candidates, {}
        for r, rep in candidates.items():
            self.manager.free(self._rows[r])
            self._rows[r] = self._fork(self._rows[rep])

    def _expand_prepared(self, B: int, q: int) -> None:
        """First forward after prepare(): expand P prompts to the B = P * k rows generate feeds."""
        pend = self._pending
        self._pending = None
        P = pend["prompts"]
        expected = pend["length"] - self._layer_len[0]
        if B % P or q != expected:
            raise InvalidStateError(
                f"generate fed {B} rows of {q} new tokens, but prepare() registered {P} prompts of "
                f"{pend['length']} tokens ({self._layer_len[0]} cached): pass generate the same "
                "input_ids and attention_mask as prepare()"
            )
        k = B // P
        if k == 1:
            return
        rows: List[int] = []
        write_from: List[int] = []
        for p in range(P):
            seq = self._rows[p]
            rows.append(seq)
            write_from.append(self._write_from[p])
            for _ in range(k - 1):
                rows.append(self._fork(seq))
                write_from.append(pend["length"])  # the prompt is written by row p
        self._rows = rows
        self._write_from = write_from

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Layer 0 of a forward pass: grow every row by the new tokens, copy-on-write, slots."""
        B, H, q, D = key_states.shape
        if (H, D) != (self.num_kv_heads, self.head_dim):
            raise InvalidArgumentError(
                f"key_states have {H} heads of size {D}; the config says "
                f"{self.num_kv_heads} x {self.head_dim}")
        if self.kv is None:
            self._allocate(key_states.dtype)
        if self._pending is not None:
            self._expand_prepared(B, q)
        elif not self._rows:
            if self._layer_len[0] != 0:  # pragma: no cover - defensive
                raise InvalidStateError("cache has a length but no rows")
            self._create_rows(key_states)
            self._layer_len = [0] * self.num_layers
            # _create_rows committed the q prompt tokens already
            start = 0
            return self._finish_begin(B, q, start, appended=True)
        if B != len(self._rows):
            raise InvalidStateError(
                f"the cache holds {len(self._rows)} rows but the model fed {B}; call "
                "cache.prepare(input_ids, attention_mask) or cache.reset() before a new generate call")
        return self._finish_begin(B, q, self._layer_len[0], appended=False)

    def _finish_begin(self, B: int, q: int, start: int, appended: bool) -> None:
        mgr = self.manager
        end = start + q
        if not appended:
            # tokens already committed (prepare() registered the prompt) need no append
            need = [end - int(mgr.num_tokens(seq)) for seq in self._rows]
            if q == 1 and all(n == 1 for n in need):
                mgr.append_batch(self._rows, np.full(B, PLACEHOLDER_TOKEN, dtype=np.int32))
            else:
                # all-or-nothing: count first (copy-on-write included, conservatively)
                want = sum(mgr.blocks_needed(seq, n) for seq, n in zip(self._rows, need) if n > 0)
                if want > mgr.num_free_blocks:
                    raise OutOfBlocksError(
                        f"PagedKVCache: {B} rows x {q} new tokens need {want} blocks, "
                        f"{mgr.num_free_blocks} free")
                for seq, n in zip(self._rows, need):
                    if n > 0:
                        mgr.append(seq, np.full(n, PLACEHOLDER_TOKEN, dtype=np.int32))
            copies = mgr.take_copies()
            if len(copies):
                ops.copy_blocks(self.kv, copies)  # before any layer writes this step
                self._stats["copy_on_write_blocks"] += len(copies)
        bs = self.block_size
        tables = [mgr.block_table(seq) for seq in self._rows]
        pos = np.arange(start, end, dtype=np.int64)
        slots = np.empty((B, q), dtype=np.int64)
        for r, table in enumerate(tables):
            s = table[pos // bs].astype(np.int64) * bs + pos % bs
            s[pos < self._write_from[r]] = -1  # shared: written by its owner
            slots[r] = s
        # rows with the same table read the same K/V: gather them once
        groups: Dict[bytes, int] = {}
        src = []
        for r, table in enumerate(tables):
            key = table[: -(-end // bs)].tobytes()
            src.append(groups.setdefault(key, r))
        self._step = {"B": B, "q": q, "end": end, "slots": slots.reshape(-1),
                      "tables": tables, "src": src}

    def _update(self, key_states: torch.Tensor, value_states: torch.Tensor,
                layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        B, H, q, D = key_states.shape
        if layer_idx == 0 or self._step is None:
            self._begin_step(key_states, value_states)
        step = self._step
        if (B, q) != (step["B"], step["q"]):
            raise InvalidStateError(
                f"layer {layer_idx} got {B} rows x {q} tokens, layer 0 had {step['B']} x {step['q']}")
        kv = self.kv
        k_new = self._to_storage(key_states.transpose(1, 2).reshape(B * q, H, D))
        v_new = self._to_storage(value_states.transpose(1, 2).reshape(B * q, H, D))
        ops.write_slots(kv, layer_idx, k_new, v_new, step["slots"])
        end = step["end"]
        keys: List[torch.Tensor] = []
        values: List[torch.Tensor] = []
        for r in range(B):
            s = step["src"][r]
            if s != r:
                keys.append(keys[s])
                values.append(values[s])
                continue
            k, v = ops.gather(kv, layer_idx, step["tables"][r], end)
            keys.append(self._from_storage(k))
            values.append(self._from_storage(v))
        out_dtype, out_device = key_states.dtype, key_states.device
        k_all = torch.stack(keys).transpose(1, 2).to(device=out_device, dtype=out_dtype).contiguous()
        v_all = torch.stack(values).transpose(1, 2).to(device=out_device, dtype=out_dtype).contiguous()
        self._layer_len[layer_idx] = end
        if self._candidates:
            self._check_candidates(key_states, value_states)
        if layer_idx == self.num_layers - 1:
            # every layer wrote this step's K/V: only now do full blocks enter the prefix
            # cache (a forward that fails half-way leaves nothing cached that was not written)
            mgr = self.manager
            mgr.schedule(self._rows, [int(mgr.num_tokens(r)) - int(mgr.num_computed(r))
                                      for r in self._rows])
            self._step = None
            if self._candidates:
                self._dedupe()
        return k_all, v_all

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, device={self.device!r}, rows={len(self._rows)}, "
                f"tokens={self._layer_len[0]})")


def _query_length(q: Any) -> int:
    return int(q) if isinstance(q, (int, np.integer)) else int(q.shape[0])


def _as_2d_int(a: Any, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().to("cpu").numpy()
    a = np.asarray(a)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.dtype.kind not in "iub":
        raise InvalidTypeError(f"{name} must be a 2-D integer array/tensor, got {a.dtype} {a.shape}")
    return a.astype(np.int64)


def _padding_salt(mask: Optional[np.ndarray]) -> Optional[str]:
    """Prefix-cache salt of one row (see the module docstring): None when unpadded."""
    if mask is None:
        return None
    m = mask != 0
    if m.all():
        return None
    npad = int(np.argmax(m)) if m.any() else m.size
    if m[npad:].all():
        return f"kvblocks-leftpad-{npad}"
    return "kvblocks-mask-" + hashlib.sha256(np.packbits(m).tobytes() + str(m.size).encode()).hexdigest()
