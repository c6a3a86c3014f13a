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
  (token ids and attention mask) and the model before ``generate`` (or :meth:`PagedKVCache.generate`
  does both); full blocks already in the prefix cache are reused and ``generate`` computes only
  the rest (``cache.cached_tokens``, ``cache.stats``). A hook on the model checks that the forward
  passes feed the prepared prompts, since a cache sees K/V, never token ids;
* tokens are committed by the forward pass that computes them and declared computed after its
  last layer, so only written K/V ever enter the prefix cache; a step's blocks are counted
  exactly before anything changes (all or nothing), and after a forward pass that raised the
  cache refuses every use but ``reset()`` / ``prepare()``;
* sliding-window layers (Gemma 2/3, Mistral, Qwen2, gpt-oss): each kind of layer is a
  :class:`kvblocks.KVGroup` of one manager; a window layer is handed the K/V of the window of
  the step's first query plus the new tokens, as transformers' ``DynamicSlidingWindowLayer``,
  and the blocks the window left behind are released (``kv_bytes_held`` shows it);
* ``copy.deepcopy`` forks the rows into a new cache on the same manager (prompt reuse);
  :meth:`PagedKVCache.encoder_decoder` serves encoder-decoder models' self-attention.

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
import weakref
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

import transformers

from ... import ops
from ...errors import (
    DeviceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    NotSupportedError,
    OutOfBlocksError,
)
from ...layout import KVLayout
from ...storage import KVCache, parse_device
from .._layer_groups import GroupPlan, layer_windows, plan_groups

__all__ = ["PagedKVCache", "dynamic_cache_bytes"]

#: token id recorded for generated tokens (int32 max: never a real vocabulary id)
PLACEHOLDER_TOKEN = 2**31 - 1

# the keyword generate() takes a Cache by: `cache` in transformers >= 5, `past_key_values` before
_CACHE_KW = "cache" if int(transformers.__version__.split(".")[0]) >= 5 else "past_key_values"

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
        names = {
            "fp32": "float32",
            "float": "float32",
            "fp16": "float16",
            "half": "float16",
            "bf16": "bfloat16",
            "fp8": "float8_e4m3fn",
            "fp8_e4m3": "float8_e4m3fn",
            "fp8_e5m2": "float8_e5m2",
        }
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


class _Shared:
    """What the caches made from one another by ``copy.deepcopy`` share: one BlockManager (so
    one prefix cache), one K/V storage and one counter of sequence ids."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.kv: Optional[KVCache] = None  # allocated on the first update (dtype None)
        self.ids = itertools.count()  # sequence ids, unique in the manager
        self.store_dtype: Optional[torch.dtype] = None
        self.raw_dtype: Optional[torch.dtype] = None  # torch dtype of the raw storage view


class _ModelSpec:
    """What a cache needs from a model config: decoder self-attention layers, K/V heads and
    head size; a model the cache cannot hold is refused here, before anything is allocated."""

    def __init__(self, config: Any) -> None:
        if isinstance(config, torch.nn.Module):
            raise InvalidTypeError(
                "PagedKVCache takes the model's config (model.config), not the model"
            )
        if not hasattr(config, "num_hidden_layers") and not hasattr(config, "get_text_config"):
            raise InvalidTypeError(
                f"PagedKVCache needs a transformers model config, got {type(config).__name__}"
            )
        text = (
            config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        )
        self.model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        if getattr(text, "kv_lora_rank", None) is not None:
            raise NotSupportedError(
                "PagedKVCache does not support multi-head latent attention "
                f"({self.model_type or 'MLA'}: kv_lora_rank is set): it caches a compressed "
                "latent and a rotary key of different sizes, not K and V of one head size"
            )
        layers = getattr(text, "num_decoder_layers", None) if self.encoder_decoder else None
        self.num_layers = int(layers or text.num_hidden_layers)
        heads = int(text.num_attention_heads)
        self.num_kv_heads = _kv_heads(text, heads, self.model_type)
        self.head_dim = int(getattr(text, "head_dim", None) or int(text.hidden_size) // heads)
        # full-attention and sliding-window layers (anything else is refused here)
        self.windows = layer_windows(text, self.num_layers)


def _kv_heads(text: Any, heads: int, model_type: str) -> int:
    """K/V heads the attention of this family hands the cache (not always
    ``num_key_value_heads``)."""
    if model_type == "falcon":
        # FalconAttention: the new decoder architecture broadcasts its K/V groups to every
        # head before caching; multi-query (Falcon-7B) caches one head
        if getattr(text, "new_decoder_architecture", False):
            return heads
        if getattr(text, "multi_query", False):
            return 1
        return int(getattr(text, "num_kv_heads", None) or heads)
    kv = getattr(text, "num_key_value_heads", None)
    if kv:
        return int(kv)
    if getattr(text, "multi_query", False):  # GPT-BigCode and other multi-query layouts
        return 1
    return heads


def _count(value: Any, name: str) -> int:
    """An int argument, refused (not coerced) when it is a float, str or bool."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise InvalidTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _device(device: Any) -> str:
    """The canonical storage device (``"cpu"`` or ``"cuda:N"``), checked before any allocation."""
    if isinstance(device, torch.device):
        device = str(device)
    kind, index = parse_device(device)
    if kind == "cpu":
        return "cpu"
    if not torch.cuda.is_available():
        raise DeviceError(f"device {device!r}: torch sees no CUDA device")
    return f"cuda:{index}"


class PagedKVCache(Cache):
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
    # storage
    # ------------------------------------------------------------------------------------------
    @property
    def manager(self) -> Any:
        """The :class:`kvblocks.BlockManager` (shared with deep copies of this cache)."""
        return self._shared.manager

    @property
    def kv(self) -> Optional[KVCache]:
        """The :class:`kvblocks.KVCache` storage (``None`` until the first forward pass when
        ``dtype`` is None)."""
        return self._shared.kv

    def _allocate(self, dtype: torch.dtype) -> None:
        name, raw = _TORCH_DTYPES[dtype]
        layout = KVLayout(
            self.layers_per_block, self.num_kv_heads, self.head_dim, self.block_size, name
        )
        sh = self._shared
        sh.kv = KVCache(layout, self.num_blocks, device=self.device)
        sh.store_dtype = dtype
        sh.raw_dtype = raw

    @property
    def _storage(self) -> KVCache:
        """The K/V storage, allocated by the first update."""
        kv = self._shared.kv
        assert kv is not None, "storage is allocated by the first update"
        return kv

    def _to_storage(self, t: torch.Tensor) -> Any:
        """[N, H, D] torch tensor -> array accepted by kvblocks.ops (numpy / CuPy, storage dtype)."""
        sh = self._shared
        assert sh.store_dtype is not None and sh.raw_dtype is not None
        t = t.detach().to(device=self.device, dtype=sh.store_dtype)
        raw = t.view(sh.raw_dtype) if sh.raw_dtype is not sh.store_dtype else t
        if self._storage.is_cuda:
            from ..._cuda import get_cupy

            cp = get_cupy()
            a = cp.from_dlpack(raw.contiguous())
            return a.view(_NUMPY_OF_RAW[sh.raw_dtype]) if raw.dtype in _NUMPY_OF_RAW else a
        a = raw.numpy()
        return a.view(_NUMPY_OF_RAW[sh.raw_dtype]) if raw.dtype in _NUMPY_OF_RAW else a

    def _from_storage(self, a: Any) -> torch.Tensor:
        """numpy / CuPy array in the storage dtype -> torch tensor of the storage dtype."""
        sh = self._shared
        assert sh.store_dtype is not None and sh.raw_dtype is not None
        if sh.raw_dtype is not sh.store_dtype:
            a = a.view(np.int16 if sh.raw_dtype is torch.int16 else np.uint8)
        t = torch.from_dlpack(a) if self._storage.is_cuda else torch.from_numpy(a)
        return t.view(sh.store_dtype) if sh.raw_dtype is not sh.store_dtype else t

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

    # ------------------------------------------------------------------------------------------
    # prefix caching
    # ------------------------------------------------------------------------------------------
    def prepare(self, input_ids: Any, attention_mask: Any = None, *, model: Any = None) -> int:
        """Start a new batch of prompts: free the rows, look the prompts up in the prefix cache.

        Call it right before ``model.generate(input_ids, attention_mask=..., cache=cache)`` with
        the same (unexpanded) ``input_ids`` and ``attention_mask`` and the ``model`` that will
        generate (or call :meth:`generate`, which does both). The cache checks, on every forward
        pass of ``model`` that feeds prompt tokens, that they are the prepared ones (a hook on
        ``model``, removed once the prompts are fed): a cache sees K/V, not token ids, so without
        this check a different prompt of the same shape would silently be given the cached K/V
        of the prepared one.

        Prompt blocks already in the prefix cache are shared; the returned count of leading
        tokens per row (the minimum over rows, a multiple of ``block_size``) is what ``generate``
        will not recompute; it is also ``cache.cached_tokens``. ``num_return_sequences`` /
        ``num_beams`` copies of each prompt share its blocks. A prompt's own blocks are taken,
        and enter the prefix cache, as the forward passes compute them (chunked prefill too).

        Raises OutOfBlocksError when the prompts do not fit the pool (nothing is kept).
        """
        if self._encoder_decoder:
            raise NotSupportedError(
                "prepare() is for decoder-only models: an encoder-decoder decoder's K/V depend on "
                "the encoder input, so they cannot be reused by decoder token ids"
            )
        if model is None or not isinstance(model, torch.nn.Module):
            raise InvalidArgumentError(
                "prepare(input_ids, attention_mask, model=model): the model that will generate is "
                "needed to check that generate is fed these prompts (or call "
                "cache.generate(model, input_ids, attention_mask=..., ...))"
            )
        ids = _as_2d_int(input_ids, "input_ids")
        mask = None if attention_mask is None else _as_2d_int(attention_mask, "attention_mask")
        if mask is not None and mask.shape != ids.shape:
            raise InvalidArgumentError(
                f"attention_mask shape {mask.shape} does not match input_ids {ids.shape}"
            )
        P, L = ids.shape
        if P == 0 or L == 0:
            raise InvalidArgumentError("prepare: empty prompts")
        if ids.min() < 0 or ids.max() >= PLACEHOLDER_TOKEN:
            raise InvalidArgumentError("prepare: token ids must be in [0, 2**31 - 1)")
        if mask is not None and ((mask != 0) & (mask != 1)).any():
            raise InvalidArgumentError("prepare: attention_mask must hold 0 and 1 only")
        self.reset()
        ids32 = ids.astype(np.int32)
        salts = [_padding_salt(None if mask is None else mask[r]) for r in range(P)]
        if self._windowed:
            seqs, hits = self._add_prompts_windowed(ids32, salts)
        else:
            seqs, hits = self._add_prompts(ids32, salts)
        common = min(hits)
        self._rows = seqs
        self._write_from = list(hits)
        self._layer_len = [common] * self.num_layers
        self._prompt = {
            "ids": ids32,
            "mask": None if mask is None or mask.all() else mask.astype(np.int8),
            "owners": seqs,
            "hits": hits,
            "k": None,
            "checked": None,
            "hook": None,
        }
        self._prompt["hook"] = _ForwardCheck.attach(self, model)
        self.cached_tokens = common
        st = self._stats
        st["prompts"] += P
        st["prompt_tokens"] += P * L
        st["cached_tokens"] += P * common
        st["hit_tokens"] += sum(hits)
        return common

    def _add_prompts(
        self, ids: np.ndarray, salts: List[Optional[str]]
    ) -> Tuple[List[int], List[int]]:
        """One sequence per prompt holding its prefix-cache hit; returns (sequences, hits)."""
        mgr = self.manager
        seqs: List[int] = []
        hits: List[int] = []
        try:
            # add() takes every prompt's blocks at once (all of them fit, or OutOfBlocksError);
            # only the hits stay committed: the rest is committed by the forward passes that
            # compute it, so no block ever enters the prefix cache before its K/V are written
            for r in range(ids.shape[0]):
                seq = next(self._shared.ids)
                n = int(mgr.add(seq, ids[r], salt=salts[r]))
                seqs.append(seq)
                hits.append(n)
            for seq, n in zip(seqs, hits):
                mgr.truncate(seq, n)
        except BaseException:
            for seq in seqs:
                mgr.free(seq)
            raise
        return seqs, hits

    def _add_prompts_windowed(
        self, ids: np.ndarray, salts: List[Optional[str]]
    ) -> Tuple[List[int], List[int]]:
        """:meth:`_add_prompts` for a model with sliding-window layers: every row gets the same
        hit. The first pass recomputes from the smallest hit on, and its queries read the window
        before that point, which a window group holds only for a row's own hit point; so each row
        is added with its prompt cut one token past a common hit (lowered until every row finds
        it), then grown by the rest of its prompt (all of them fit, or OutOfBlocksError) and cut
        back, leaving the hit and the next token committed."""
        mgr = self.manager
        P, L = ids.shape
        target = min(int(mgr.probe(ids[r], salt=salts[r])[0]) for r in range(P))
        seqs: List[int] = []
        try:
            while True:
                hits = []
                for r in range(P):
                    seq = next(self._shared.ids)
                    hits.append(int(mgr.add(seq, ids[r, : target + 1], salt=salts[r])))
                    seqs.append(seq)
                if min(hits) == target:
                    break
                for seq in seqs:  # a row found less (a window block was evicted): retry lower
                    mgr.free(seq)
                seqs, target = [], min(hits)
            if target + 1 < L:
                for r, seq in enumerate(seqs):
                    mgr.append(seq, ids[r, target + 1 :])
                for seq in seqs:
                    mgr.truncate(seq, target + 1)
        except BaseException:
            for seq in seqs:
                mgr.free(seq)
            raise
        return seqs, hits

    def generate(
        self, model: Any, input_ids: Any, attention_mask: Any = None, **kwargs: Any
    ) -> Any:
        """``prepare(input_ids, attention_mask, model=model)`` then ``model.generate`` on this cache
        with the same inputs (and ``kwargs``): prefix caching without passing the prompts twice."""
        self.prepare(input_ids, attention_mask, model=model)
        kwargs[_CACHE_KW] = self
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        return model.generate(input_ids, **kwargs)

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

    @property
    def bytes_per_block(self) -> int:
        """K and V bytes of one block: ``layers_per_block`` layers (every layer when all are full
        attention); 0 before the storage dtype is known."""
        return 0 if self.kv is None else self.kv.layout.bytes_per_block

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
    # internals
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
                seq = next(self._shared.ids)
                self.manager.add(seq, tokens, salt=f"kvblocks-anonymous-{seq}-{id(self._shared)}")
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
            if not (
                torch.equal(key_states[r], key_states[rep])
                and torch.equal(value_states[r], value_states[rep])
            ):
                del self._candidates[r]

    def _dedupe(self) -> None:
        """End of the first pass: candidates equal in every layer fork their representative."""
        candidates, self._candidates = self._candidates, {}
        for r, rep in candidates.items():
            self.manager.free(self._rows[r])
            self._rows[r] = self._fork(self._rows[rep])

    def _commit(self, appends: List[Tuple[int, np.ndarray]], want: int) -> None:
        """Append tokens to sequences, all or nothing: ``want`` (the exact count of blocks the
        appends take, copy-on-write included) is checked first, and if an append still fails
        the ones before it are rolled back."""
        mgr = self.manager
        if want > mgr.num_free_blocks:
            raise OutOfBlocksError(
                f"PagedKVCache: this forward pass needs {want} blocks, {mgr.num_free_blocks} free"
            )
        done: List[Tuple[int, int]] = []
        try:
            for seq, toks in appends:
                before = int(mgr.num_tokens(seq))
                mgr.append(seq, toks)
                done.append((seq, before))
        except BaseException:
            for seq, before in reversed(done):
                mgr.truncate(seq, before)
            raise
        finally:
            copies = mgr.take_copies()
            if len(copies):
                ops.copy_blocks(self._storage, copies)  # before any layer writes this step
                self._stats["copy_on_write_blocks"] += len(copies)

    def _begin_prompt_step(self, B: int, q: int) -> int:
        """Layer 0 of a forward pass that feeds prepared prompt tokens (checked by the hook).

        Each prompt's sequence commits the prompt tokens this pass computes (and placeholders for
        tokens past the prompt, e.g. speculative candidates); its ``num_return_sequences`` /
        beam copies are the same sequence until the prompt's last token is fed, then fork it.
        Returns the first position of the pass.
        """
        pr = self._prompt
        assert pr is not None
        checked, pr["checked"] = pr["checked"], None
        start = self._layer_len[0]
        if checked != (B, q, start):
            raise InvalidStateError(
                "a forward pass fed prepared prompts without going through the model given to "
                "prepare(model=...); call generate on that model (or cache.generate(model, ...))"
            )
        owners = pr["owners"]
        P, L = pr["ids"].shape
        if pr["k"] is None:  # first pass: generate repeated each prompt k times
            k = B // P
            pr["k"] = k
            self._rows = [seq for seq in owners for _ in range(k)]
            self._write_from = [h if j == 0 else L for h in pr["hits"] for j in range(k)]
        k = pr["k"]
        end = start + q
        if end > L and k > 1:
            raise NotSupportedError(
                "tokens past the prompt in the prompt's forward pass (speculative candidates) with "
                f"{k} copies of each prompt (num_return_sequences / num_beams)"
            )
        mgr = self.manager
        appends = []
        want = 0
        for p, seq in enumerate(owners):
            nt = int(mgr.num_tokens(seq))
            if nt < end:
                toks = pr["ids"][p, nt : min(end, L)]
                if end > max(nt, L):
                    toks = np.concatenate(
                        [toks, np.full(end - max(nt, L), PLACEHOLDER_TOKEN, dtype=np.int32)]
                    )
                appends.append((seq, toks))
                # a prompt's last block is never shared while it is being written
                want += int(mgr.blocks_needed(seq, len(toks)))
        self._commit(appends, want)
        if end >= L:  # the prompts are fed: copies become sequences sharing their blocks
            self._drop_hook()
            self._prompt = None
            if k > 1:
                rows = list(self._rows)
                try:
                    for r in range(len(rows)):
                        if r % k:
                            rows[r] = self._fork(rows[r])
                except BaseException:
                    for r in range(len(rows)):
                        if r % k and rows[r] != self._rows[r]:
                            mgr.free(rows[r])
                    raise
                self._rows = rows
        return start

    def _begin_step(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Layer 0 of a forward pass: grow every row by the new tokens, copy-on-write, slots."""
        self._check_usable()
        if self._step is not None:
            raise InvalidStateError("the previous forward pass stopped before its last layer")
        B, H, q, D = key_states.shape
        if tuple(value_states.shape) != tuple(key_states.shape):
            raise NotSupportedError(
                f"keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} differ in "
                "shape: PagedKVCache stores K and V of one head count and head size"
            )
        if (H, D) != (self.num_kv_heads, self.head_dim):
            raise InvalidArgumentError(
                f"key_states have {H} heads of size {D}; the config says "
                f"{self.num_kv_heads} x {self.head_dim}"
            )
        if self.kv is None:
            self._allocate(key_states.dtype)
        mgr = self.manager
        if self._prompt is not None:
            start = self._begin_prompt_step(B, q)
        elif not self._rows:
            if self._layer_len[0] != 0:  # pragma: no cover - defensive
                raise InvalidStateError("cache has a length but no rows")
            self._create_rows(key_states)  # commits the q tokens
            start = 0
        else:
            if B != len(self._rows):
                raise InvalidStateError(
                    f"the cache holds {len(self._rows)} rows but the model fed {B}; call "
                    "cache.prepare(...) or cache.reset() before a new generate call"
                )
            start = self._layer_len[0]
            if q == 1:
                mgr.append_batch(self._rows, np.full(B, PLACEHOLDER_TOKEN, dtype=np.int32))
                copies = mgr.take_copies()
                if len(copies):
                    ops.copy_blocks(self._storage, copies)
                    self._stats["copy_on_write_blocks"] += len(copies)
            else:
                toks = np.full(q, PLACEHOLDER_TOKEN, dtype=np.int32)
                # can_append counts copy-on-write exactly (a block shared by m rows of this
                # step takes m - 1 copies when nothing else holds it)
                need = sum(int(mgr.blocks_needed(s, q)) for s in self._rows)
                if not mgr.can_append(self._rows, q):
                    raise OutOfBlocksError(
                        f"PagedKVCache: {B} rows x {q} new tokens do not fit "
                        f"({mgr.num_free_blocks} blocks free, up to {need} needed)"
                    )
                # with window groups the appends are counted without what the window releases
                # (an upper bound): a failed append could not be rolled back past a release
                self._commit([(s, toks) for s in self._rows], need if self._windowed else 0)
        end = start + q
        tables = []
        slots = []
        src = []
        for g in range(max(len(self._plan.groups), 1)):
            t, sl, sr = self._step_tables(g, start, end)
            tables.append(t)
            slots.append(sl)
            src.append(sr)
        self._step = {
            "B": B,
            "q": q,
            "start": start,
            "end": end,
            "slots": slots,
            "tables": tables,
            "src": src,
        }

    def _step_tables(
        self, group: int, start: int, end: int
    ) -> Tuple[List[np.ndarray], np.ndarray, List[int]]:
        """One group's block tables, write slots and gather sources for a pass over positions
        ``[start, end)``. A sliding-window group's layers read from the window of the first
        query on (``[start - W + 1, end)``): the blocks below are never read, released or not."""
        mgr = self.manager
        bs = self.block_size
        groups = self._plan.groups
        window = groups[group].window if groups else None
        first = 0 if window is None else max(start - window + 1, 0)
        tables = [mgr.block_table(seq, group=group) for seq in self._rows]
        pos = np.arange(start, end, dtype=np.int64)
        slots = np.empty((len(tables), end - start), dtype=np.int64)
        for r, table in enumerate(tables):
            if not (table[first // bs : -(-end // bs)] > 0).all():
                raise InvalidStateError(  # the manager released what the window still reads
                    f"PagedKVCache: group {group} released positions in [{first}, {end})"
                )
            s = table[pos // bs].astype(np.int64) * bs + pos % bs
            s[pos < self._write_from[r]] = -1  # shared: written by its owner
            slots[r] = s
        # rows with the same table read the same K/V: gather them once
        seen: Dict[bytes, int] = {}
        src = []
        for r, table in enumerate(tables):
            key = table[first // bs : -(-end // bs)].tobytes()
            src.append(seen.setdefault(key, r))
        return tables, slots.reshape(-1), src

    def _update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        try:
            return self._update_layer(key_states, value_states, layer_idx)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _update_layer(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        B, H, q, D = key_states.shape
        if layer_idx == 0 or self._step is None:
            if layer_idx != 0:
                raise InvalidStateError(f"a forward pass started at layer {layer_idx}, not 0")
            self._begin_step(key_states, value_states)
        step = self._step
        assert step is not None
        if (B, q) != (step["B"], step["q"]) or tuple(value_states.shape) != tuple(key_states.shape):
            raise InvalidStateError(
                f"layer {layer_idx} got {B} rows x {q} tokens, layer 0 had {step['B']} x {step['q']}"
            )
        kv = self._storage
        plan = self._plan
        g, slot = plan.layer_group[layer_idx], plan.layer_slot[layer_idx]
        k_new = self._to_storage(key_states.transpose(1, 2).reshape(B * q, H, D))
        v_new = self._to_storage(value_states.transpose(1, 2).reshape(B * q, H, D))
        ops.write_slots(kv, slot, k_new, v_new, step["slots"][g])
        end = step["end"]
        window = plan.windows[layer_idx]
        # a sliding-window layer returns positions [start - W + 1, end) (get_mask_sizes)
        first = 0 if window is None else max(step["start"] - window + 1, 0)
        lo, skip = divmod(first, self.block_size)
        keys: List[torch.Tensor] = []
        values: List[torch.Tensor] = []
        for r in range(B):
            s = step["src"][g][r]
            if s != r:
                keys.append(keys[s])
                values.append(values[s])
                continue
            k, v = ops.gather(kv, slot, step["tables"][g][r][lo:], end - lo * self.block_size)
            keys.append(self._from_storage(k[skip:]))
            values.append(self._from_storage(v[skip:]))
        out_dtype, out_device = key_states.dtype, key_states.device
        k_all = (
            torch.stack(keys).transpose(1, 2).to(device=out_device, dtype=out_dtype).contiguous()
        )
        v_all = (
            torch.stack(values).transpose(1, 2).to(device=out_device, dtype=out_dtype).contiguous()
        )
        self._layer_len[layer_idx] = end
        if self._candidates:
            self._check_candidates(key_states, value_states)
        if layer_idx == self.num_layers - 1:
            # every layer wrote this step's K/V: only now do full blocks enter the prefix
            # cache (a forward that fails half-way leaves nothing cached that was not written)
            mgr = self.manager
            seqs = list(dict.fromkeys(self._rows))
            mgr.schedule(seqs, [int(mgr.num_tokens(s)) - int(mgr.num_computed(s)) for s in seqs])
            self._step = None
            if self._candidates:
                self._dedupe()
        return k_all, v_all

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, groups={len(self.groups)}, "
            f"num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, device={self.device!r}, rows={len(self._rows)}, "
            f"tokens={self._layer_len[0]})"
        )


class _ForwardCheck:
    """A forward pre-hook on the model given to :meth:`PagedKVCache.prepare`: checks that each
    forward pass feeding prompt tokens to the cache feeds the prepared ones, before the model
    computes anything. It holds the cache weakly and is removed once the prompts are fed."""

    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = weakref.ref(cache)
        self.detach: Any = None

    @classmethod
    def attach(cls, cache: PagedKVCache, model: torch.nn.Module) -> "_ForwardCheck":
        check = cls(cache)
        handle = model.register_forward_pre_hook(check, with_kwargs=True)
        check.detach = weakref.finalize(cache, handle.remove)  # also if the cache is dropped
        return check

    def remove(self) -> None:
        self.detach()

    def __call__(self, module: Any, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        alive = self.cache()
        if alive is None:
            return None
        cache: "PagedKVCache" = alive
        passed = kwargs.get("cache")
        if passed is None:
            passed = kwargs.get("past_key_values")  # transformers 4.x name
        if passed is not cache:
            return None
        if cache._prompt is None or cache._failed is not None:
            return None  # the cache refuses or serves this pass itself
        try:
            self._check(cache, args, kwargs)
        except BaseException as exc:
            cache._fail(exc)
            raise
        return None

    @staticmethod
    def _check(cache: PagedKVCache, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        pr = cache._prompt
        assert pr is not None
        ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(ids, torch.Tensor):
            raise NotSupportedError(
                "after prepare(), generate must feed input_ids (inputs_embeds cannot be checked "
                "against the prepared prompts)"
            )
        fed = ids.detach().to("cpu").numpy()
        prompts, pmask = pr["ids"], pr["mask"]
        P, L = prompts.shape
        if fed.ndim != 2:
            raise NotSupportedError(f"after prepare(), input_ids of shape {tuple(fed.shape)}")
        B, q = fed.shape
        rows = len(cache._rows) if pr["k"] is not None else None
        if B % P or (rows is not None and B != rows) or q == 0:
            raise InvalidStateError(
                f"generate fed {B} rows, but prepare() registered {P} prompts: pass generate the "
                "input_ids and attention_mask given to prepare()"
            )
        k = B // P
        start = cache._layer_len[0]
        # where the model puts these tokens: a 2-D attention mask covers every position up to
        # the end of this pass; without one (no padding), position ids or the cache length say
        mask = kwargs.get("attention_mask")
        pos = kwargs.get("position_ids")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            s = int(mask.shape[1]) - q
        elif isinstance(pos, torch.Tensor) and pos.ndim == 2 and pos.shape[1] == q:
            s = int(pos[0, 0])
        else:
            s = start
        if s != start and not (s == 0 and pr["k"] is None):
            raise InvalidStateError(
                f"generate fed positions {s}..{s + q - 1} of the prepared prompts, but the cache "
                f"holds {start} tokens per row: pass generate the input_ids and attention_mask "
                "given to prepare()"
            )
        n = min(s + q, L) - s
        if n <= 0:
            raise InvalidStateError("generate fed tokens past the prepared prompts' end")
        want = np.repeat(prompts[:, s : s + n], k, axis=0)
        bad = np.nonzero((fed[:, :n] != want).any(axis=1))[0]
        if bad.size:
            r = int(bad[0])
            j = int(np.nonzero(fed[r, :n] != want[r])[0][0])
            raise InvalidStateError(
                f"generate was not fed the prompts given to prepare(): row {r} has token "
                f"{int(fed[r, j])} at position {s + j} where the prepared prompt has "
                f"{int(want[r, j])}. Call prepare() with the input_ids passed to generate "
                "(or cache.generate(model, input_ids, ...))"
            )
        want_mask = None if pmask is None else np.repeat(pmask, k, axis=0)
        if isinstance(mask, torch.Tensor) and mask.ndim == 2:
            m = mask.detach().to("cpu").numpy() != 0
            w = min(m.shape[1], L)
            exp = np.ones((B, w), dtype=bool) if want_mask is None else want_mask[:, :w] != 0
            if not np.array_equal(m[:, :w], exp) or not m[:, w:].all():
                raise InvalidStateError(
                    "generate was fed an attention_mask other than the one given to prepare(); "
                    "the prefix cache keys padded rows by their padding"
                )
        elif want_mask is not None and mask is None:
            raise InvalidStateError(
                "prepare() was given a padded attention_mask but generate was fed none"
            )
        if s == 0 and start > 0 and cache._windowed:
            raise NotSupportedError(
                "a pass feeding the whole prompt again after prepare() found prefix hits "
                "(assisted generation, prompt lookup) on a model with sliding-window layers: "
                "their blocks before the hit point were never held; call cache.reset() instead "
                "of prepare() for this generate call"
            )
        if s == 0 and start > 0:
            # the whole prompt again (assisted generation's first pass): nothing is skipped,
            # rows still share the blocks they found (positions below a row's hit are not written)
            cache._layer_len = [0] * cache.num_layers
            cache._stats["cached_tokens"] -= P * cache.cached_tokens
            cache.cached_tokens = 0
        pr["checked"] = (B, q, s)


def _query_length(q: Any) -> int:
    return int(q) if isinstance(q, (int, np.integer)) else int(q.shape[0])


def _as_2d_int(a: Any, name: str) -> np.ndarray:
    if isinstance(a, torch.Tensor):
        a = a.detach().to("cpu").numpy()
    a = np.asarray(a)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.dtype.kind not in "iub":
        raise InvalidTypeError(
            f"{name} must be a 2-D integer array/tensor, got {a.dtype} {a.shape}"
        )
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
    return (
        "kvblocks-mask-"
        + hashlib.sha256(np.packbits(m).tobytes() + str(m.size).encode()).hexdigest()
    )
