"""kvblocks' KV cache manager for vLLM 0.34's scheduler (``vllm.v1.core``).

``KVCacheManager`` has vLLM's constructor and methods. For a configuration kvblocks serves
natively (see ``native_unsupported``) the block pool, the free list, the ref counts and the
prefix-cache table live in one ``kvblocks.BlockPool``, and each scheduler call is a few
batched native calls over a request's whole hash chain:

- ``get_computed_blocks``: one ``lookup_bytes`` over the request's block hashes (vLLM's own
  bytes hashes, computed in its ``Request``, passed as the list they are: the native key is
  their first 128 bits; every hit is checked against the full 32-byte hash kept beside it,
  natively; other widths take a numpy path);
- ``allocate_slots``: one ``incref`` of the hit (vLLM's ``touch``), one ``allocate`` of the
  new blocks, one ``cache_bytes`` of the newly full blocks;
- ``free``: one ``free`` call (blocks without a cache entry go to the head of the free list
  in vLLM's order, cached ones to the tail for LRU eviction, as vLLM's ``free_blocks``).

Block tables are lists of int ids; ``KVCacheBlock``-shaped objects (``_BlockView``) are made
only when something reads them (``KVCacheBlocks.blocks``, ``block_pool.blocks[i]``,
``req_to_blocks``), once per block id, and read their ref count and hash from the native
pool. Models of full-attention, sliding-window, chunked-local and Mamba groups (hybrid, or
one such group alone) run on ``hybrid.HybridKVCacheManager`` (this class turns an instance
into it). EAGLE / MTP drops a hit's last block (``_drop``). Any other configuration
(other attention kinds, partial-block hashes, multi-module MTP, context parallelism,
lookahead hashes, a metrics collector, KV zeroing) runs vLLM's own coordinator and
single-type managers unchanged, and says so in the log.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import numpy as np
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_coordinator import UnitaryKVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VLLMKVCacheBlocks
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMKVCacheManager
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from .builds import FALLBACK_REASONS, NATIVE_BUILDS
from .pool_view import NativeBlockPoolView
from .state import (  # noqa: F401  (NativeKVCacheBlocks, _NativeState: names tests import)
    _ADMITTING,
    _EMPTY_I32,
    NativeKVCacheBlocks,
    _ids_of,
    _NativeState,
)

logger = logging.getLogger(__name__)

# VLLMKVCacheManager: vLLM's own class (this module is imported before enable() patches)

# (NATIVE_BUILDS, FALLBACK_REASONS: builds.py, names kept here for tests and tools)
# one group of these kinds alone runs on the group adapter (hybrid.py) too
_GROUP_KINDS = (SlidingWindowSpec, SlidingWindowMLASpec, ChunkedLocalAttentionSpec, MambaSpec)
# full attention on the one-group path: plain, or MLA's latent cache (DeepSeek V2/V3, Kimi:
# vLLM's FullAttentionManager rules, the spec differs only in the memory layout)
_FULL_KINDS = (FullAttentionSpec, MLAAttentionSpec)


def native_unsupported(mgr: VLLMKVCacheManager, opts: dict) -> Optional[str]:
    """Why a configuration runs on vLLM's own managers, or None when kvblocks serves it."""
    coord = mgr.coordinator
    groups = mgr.kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        return f"{len(groups)} KV cache groups (hybrid model)"
    spec = groups[0].kv_cache_spec
    if type(spec) not in _FULL_KINDS:
        return f"attention kind {type(spec).__name__}"
    if mgr.enable_caching and type(coord) is not UnitaryKVCacheCoordinator:
        return f"coordinator {type(coord).__name__}"
    if opts.get("dcp_world_size", 1) != 1 or opts.get("pcp_world_size", 1) != 1:
        return "decode/prefill context parallelism"
    if getattr(coord, "num_reprefillable_tokens", 0):
        return "re-prefillable tokens (multi-module MTP)"
    if opts.get("num_prefill_lookahead", 0):
        return "prefill lookahead (multi-module MTP)"
    if opts.get("metrics_collector") is not None:
        return "KV cache residency metrics"
    stm = coord.single_type_managers[0]
    if stm.block_size != coord.block_pool.hash_block_size:
        return "hash block size differs from the block size (partial-block hits)"
    if getattr(stm, "_record_new_block_ids", False):
        return "KV cache zeroing of new blocks"
    # (a retention interval changes nothing for full attention: vLLM's mask keeps every block)
    return None


class _GroupView:
    """vLLM's single-type manager of the one group, with the native request tables; other
    attributes (block_size, kv_cache_spec, kv_cache_group_id, ...) are vLLM's."""

    def __init__(self, inner: Any, state: _NativeState, pool: NativeBlockPoolView) -> None:
        self._inner = inner
        self._s = state
        self.block_pool = pool

    @property
    def _null_block(self) -> Any:
        return self.block_pool.null_block

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def req_to_blocks(self) -> dict:
        view = self._s.view
        return {rid: [view(b) for b in ids] for rid, ids in self._s.req.items()}

    @property
    def num_cached_block(self) -> dict:
        return self._s.num_cached


class _CoordinatorView:
    """vLLM's coordinator, with the calls that touch blocks answered natively."""

    def __init__(self, inner: Any, mgr: KVCacheManager) -> None:
        self._inner = inner
        self._m = mgr
        self.block_pool = mgr.block_pool
        self.single_type_managers = (
            _GroupView(inner.single_type_managers[0], mgr._native, mgr.block_pool),
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[Any],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return self._m._blocks_to_allocate(request_id, num_tokens, _ids_of(new_computed_blocks[0]))

    def get_blocks(self, request_id: str) -> tuple:
        return self._m.get_blocks(request_id).blocks

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple:
        s = self._m._native
        hit = s.lookup(block_hashes, min(max_cache_hit_length // s.block_size, len(block_hashes)))
        if self._m._drop and len(hit):  # (EAGLE)
            hit = hit[:-1]
        return ([s.view(b) for b in hit.tolist()],), len(hit) * s.block_size, 0

    def free(self, request_id: str) -> None:
        self._m._free_id(request_id)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._m.cache_blocks(request, num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        return self._m._native.reset()

    def remove_skipped_blocks(self, *args: Any, **kwargs: Any) -> None:
        return None  # full attention skips nothing


class KVCacheManager(VLLMKVCacheManager):
    """vLLM's ``KVCacheManager`` (same constructor and methods), on kvblocks' native pool
    for full-attention models; on vLLM's own managers otherwise (logged)."""

    native: bool  # True when kvblocks' pool serves this configuration
    block_pool: Any  # NativeBlockPoolView when native, else vLLM's BlockPool
    coordinator: Any  # _CoordinatorView when native, else vLLM's coordinator
    _native: _NativeState
    _bs: int

    def __init__(
        self,
        kv_cache_config: Any,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            kv_cache_config, max_model_len, scheduler_block_size, hash_block_size, *args, **kwargs
        )
        opts = dict(kwargs)
        names = (
            "max_in_flight_tokens",
            "enable_caching",
            "use_eagle",
            "num_hash_lookahead_tokens",
            "num_prefill_lookahead",
            "log_stats",
            "enable_kv_cache_events",
            "dcp_world_size",
            "pcp_world_size",
            "metrics_collector",
            "watermark",
            "enable_mamba_shared_prefix_checkpoint",
        )
        opts.update(zip(names, args))
        why = native_unsupported(self, opts)
        groups = self.kv_cache_config.kv_cache_groups
        if why is not None and (len(groups) > 1 or type(groups[0].kv_cache_spec) in _GROUP_KINDS):
            from .hybrid import HybridKVCacheManager, hybrid_unsupported

            why = hybrid_unsupported(self, opts)
            if why is None:  # full attention, window and chunk groups: the group adapter
                self.native = True
                self._fallback_cls = type(self)  # (what _to_vllm turns it back into)
                self.__class__ = HybridKVCacheManager
                self._init_hybrid()
                NATIVE_BUILDS["hybrid"] += 1
                logger.debug("kvblocks: native hybrid KV cache manager")
                return
        self.native = why is None
        if not self.native:
            NATIVE_BUILDS["fallback"] += 1
            FALLBACK_REASONS[why] += 1
            logger.info("kvblocks: vLLM's own KV cache managers serve this model (%s)", why)
            return
        NATIVE_BUILDS["full"] += 1
        vpool = self.coordinator.block_pool
        stm = self.coordinator.single_type_managers[0]
        self._native = _NativeState(
            vpool.num_gpu_blocks,
            stm.block_size,
            self.enable_caching,
            self.enable_kv_cache_events,
            vpool.medium,
        )
        self._bs = stm.block_size
        # EAGLE / MTP: a hit drops its last block (vLLM's drop_eagle_block: the draft
        # model recomputes the tokens before the generation point)
        self._drop = 0 in getattr(self.coordinator, "drop_eagle_group_ids", ())
        self._native.lookahead = getattr(vpool, "num_hash_lookahead_tokens", 0)
        self.block_pool = NativeBlockPoolView(self._native, vpool.hash_block_size)
        self._vllm_coordinator = self.coordinator
        self.coordinator = _CoordinatorView(self.coordinator, self)
        logger.debug(
            "kvblocks: native KV cache manager, %d blocks of %d tokens",
            self._native.num_blocks,
            self._bs,
        )

    # -- the scheduler's API ------------------------------------------------------------------
    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: Optional[int] = None
    ) -> tuple:
        if not self.native:
            return super().get_computed_blocks(request, max_cache_hit_length)
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        max_len = request.get_max_cache_hit_length(max_cache_hit_length)
        s = self._native
        hashes = request.block_hashes
        n = min(max_len // self._bs, len(hashes))
        # keys of the whole chain, once: allocate_slots caches the blocks past the hit
        if n <= 0:
            return self.empty_kv_cache_blocks, 0, 0
        if type(hashes) is list and len(hashes[0]) == 32:
            hit = s.lookup(hashes, n)  # keys and the full-width check natively
        else:
            keys, tails = s.request_keys(request, len(hashes))
            hit = s.lookup(hashes, n, keys[:n], None if tails is None else tails[:n])
        if self._drop and len(hit):
            hit = hit[:-1]
        if not len(hit):
            return self.empty_kv_cache_blocks, 0, 0
        if (
            self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            s.events.append(s._stored(request, 0, len(hit)))
        return NativeKVCacheBlocks(s, (hit,)), len(hit) * self._bs, 0

    def get_num_cached_tokens(self, request: Any) -> int:
        if not self.native:
            return super().get_num_cached_tokens(request)
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        hashes = request.block_hashes
        n = min((request.num_tokens - 1) // self._bs, len(hashes))
        k = len(self._native.lookup(hashes, n))
        return (k - 1 if self._drop and k else k) * self._bs

    def _blocks_to_allocate(self, request_id: str, num_tokens: int, new_ids: np.ndarray) -> int:
        s = self._native
        required = cdiv(num_tokens, self._bs)
        have = len(s.req.get(request_id, ()))
        if request_id in s.num_cached:
            assert len(new_ids) == 0
            return max(required - have, 0)
        new = max(required - len(new_ids) - have, 0)
        if len(new_ids):
            new += s.pool.num_unreferenced(new_ids)
        return new

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple = (),
    ) -> Any:
        if not self.native:
            return super().allocate_slots(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                new_computed_blocks,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                has_scheduled_reqs,
                skip_zeroing_group_ids,
            )
        if (
            num_new_tokens == 0
            and num_external_computed_tokens == 0
            and num_new_computed_tokens == 0
        ):
            raise ValueError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        s = self._native
        rid = request.request_id
        table = s.req.get(rid)
        if (
            table is not None
            and new_computed_blocks is None
            and num_external_computed_tokens == 0
            and not full_sequence_must_fit
            and rid in s.num_cached
        ):  # a running request (decode, next chunk): the same rules, fewer steps
            max_len = self.max_model_len
            bs = self._bs
            num_main = request.num_computed_tokens + num_new_computed_tokens
            if num_main > max_len:
                num_main = max_len
            num_main += num_new_tokens
            need = num_main + num_lookahead_tokens
            n_new = -(-(need if need < max_len else max_len) // bs) - len(table)  # cdiv
            watermark = 0
            if has_scheduled_reqs and request.status in _ADMITTING:
                watermark = self.watermark_blocks
            if (n_new if n_new > 0 else 0) + watermark > s.pool.num_free - reserved_blocks:
                return None
            if n_new > 0:
                new = s.allocate(n_new)
                table.extend(new.tolist())
            # (cache() does nothing unless a hash past the cached blocks exists)
            if (
                not delay_cache_blocks
                and self.enable_caching
                and len(request.block_hashes) > s.num_cached[rid]
            ):
                s.cache(request, min(num_main, request.num_tokens))
            if n_new > 0:
                return NativeKVCacheBlocks(s, (new,))
            return self.empty_kv_cache_blocks
        if new_computed_blocks is None or new_computed_blocks is self.empty_kv_cache_blocks:
            new_ids = _EMPTY_I32
        elif isinstance(new_computed_blocks, NativeKVCacheBlocks):
            new_ids = _ids_of(new_computed_blocks._ids[0])
        else:
            new_ids = _ids_of(new_computed_blocks.blocks[0])
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local + num_external_computed_tokens, self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in _ADMITTING:
            watermark = self.watermark_blocks
        if full_sequence_must_fit:
            full = min(request.num_tokens, self.max_model_len)
            if self._blocks_to_allocate(rid, full, new_ids) + watermark > s.pool.num_free:
                return None
        num_main = total_computed + num_new_tokens
        need = min(num_main + num_lookahead_tokens, self.max_model_len)
        if table is None:  # a new request (so not in num_cached): _blocks_to_allocate's rule
            n_alloc = -(-need // self._bs) - len(new_ids)
            if n_alloc < 0:
                n_alloc = 0
            if len(new_ids):
                n_alloc += s.pool.num_unreferenced(new_ids)
        else:
            n_alloc = self._blocks_to_allocate(rid, need, new_ids)
        if n_alloc + watermark > s.pool.num_free - reserved_blocks:
            return None
        if table is None:
            table = s.req[rid] = []
        adopt = (
            new_computed_blocks is not None
            and new_computed_blocks is not self.empty_kv_cache_blocks
        )
        if (adopt or num_external_computed_tokens > 0) and rid not in s.num_cached:
            if len(new_ids):
                if not self.enable_caching:
                    raise AssertionError(
                        "Computed blocks should be empty when prefix caching is disabled"
                    )
                s.pool.incref(new_ids)
                table.extend(new_ids.tolist())
            s.num_cached[rid] = len(table)
            if num_external_computed_tokens > 0:
                n_ext = max(
                    0, cdiv(num_local + num_external_computed_tokens, self._bs) - len(table)
                )
                table.extend(s.allocate(n_ext).tolist())
        n_new = -(-need // self._bs) - len(table)  # cdiv
        new = s.allocate(n_new) if n_new > 0 else _EMPTY_I32
        if len(new):
            table.extend(new.tolist())
        if not delay_cache_blocks and self.enable_caching:
            s.cache(request, min(total_computed + num_new_tokens, request.num_tokens))
        if not len(new):
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(s, (new,))

    def _free_id(self, request_id: str) -> None:
        s = self._native
        table = s.req.pop(request_id, None)
        c = s.num_cached.pop(request_id, 0)
        s.keys.pop(request_id, None)
        if not table:
            return
        if s.uncached_held:  # evict_blocks left a hole in a cached part: the general order
            s.free_in_order(table[::-1])
            return
        # vLLM frees the table in reverse: blocks without an entry (the table's tail past
        # its c cached blocks) to the free list's head in that order, cached ones to the
        # tail. The native free puts each uncached block at the head, so they go in forward
        # order, then the cached ones in reverse: one call (it takes them in order).
        s.pool.free(table[c:] + table[c - 1 :: -1] if c else table)

    def free(self, request: Any) -> None:
        if not self.native:
            return super().free(request)
        self._free_id(request.request_id)

    def pop_blocks_for_free(self, request: Any) -> list:
        if not self.native:
            return super().pop_blocks_for_free(request)
        s = self._native
        table = s.req.pop(request.request_id, None) or []
        s.num_cached.pop(request.request_id, None)
        s.keys.pop(request.request_id, None)
        return [s.view(b) for b in table]

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: Optional[int] = None,
    ) -> None:
        if not self.native:
            super().remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if not self.native:
            return super().cache_blocks(request, num_computed_tokens)
        if self.enable_caching:
            self._native.cache(request, num_computed_tokens)

    def get_blocks(self, request_id: str) -> Any:
        if not self.native:
            return super().get_blocks(request_id)
        table = self._native.req.get(request_id)
        if not table:
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._native, (table,))

    def get_block_ids(self, request_id: str) -> tuple:
        if not self.native:
            return super().get_block_ids(request_id)
        return (list(self._native.req.get(request_id) or ()),)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple:
        if not self.native:
            return super().get_block_ids_for_computed_tokens(request_id, num_computed_tokens)
        table = self._native.req.get(request_id) or []
        return (list(table[: cdiv(num_computed_tokens, self._bs)]),)

    def estimate_cached_tokens(self, request: Any) -> int:
        if not self.native:
            return super().estimate_cached_tokens(request)
        return self.get_num_cached_tokens(request)

    def create_kv_cache_blocks(self, blocks: tuple) -> Any:
        return VLLMKVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def take_new_block_ids(self) -> list:
        if not self.native:
            return super().take_new_block_ids()
        return []

    def take_boundary_state_offloads(self) -> dict:
        if not self.native:
            return super().take_boundary_state_offloads()
        return {}

    def finalize_partial_tail_offloads(self, request: Any) -> list:
        if not self.native:
            return super().finalize_partial_tail_offloads(request)
        return []

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        if not self.native:
            super().record_blocks_for_zeroing(request_id, start_token)

    def new_step_starts(self) -> None:
        if not self.native:
            super().new_step_starts()

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        if not self.native:
            return super().truncate_computed_blocks(blocks, num_computed_tokens)
        assert num_computed_tokens % self._bs == 0
        n = num_computed_tokens // self._bs
        ids = (
            blocks._ids[0] if isinstance(blocks, NativeKVCacheBlocks) else _ids_of(blocks.blocks[0])
        )
        assert n <= len(ids)
        if n == 0:
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(self._native, (np.asarray(ids[:n], dtype=np.int32),))
