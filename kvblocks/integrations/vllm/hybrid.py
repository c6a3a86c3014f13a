"""kvblocks' KV cache manager for vLLM's hybrid models (groups of full attention, sliding
window, chunked local attention and Mamba state) and models of one such group.

A model whose layers attend differently (gpt-oss, Gemma 2/3, Mistral with a window, Llama 4
with chunked local attention) has several KV cache groups; vLLM's
``HybridKVCacheCoordinator`` drives one single-type manager per group over one shared
``BlockPool``. ``HybridKVCacheManager`` answers the same calls over one native
``kvblocks.BlockPool`` (the state and vLLM's per-kind rules: hybrid_state.py): hits by vLLM's
fixed point over the groups, skipped blocks freed and made null before each allocation,
allocation, caching and free group by group in vLLM's order (one native call each where
vLLM makes one per group: new blocks for all groups in one ``allocate``, popped in the order
vLLM pops them; a request's blocks freed in one ``free`` in vLLM's placement).

Served natively: every group ``FullAttentionSpec`` or ``MLAAttentionSpec``,
``SlidingWindowSpec`` or ``SlidingWindowMLASpec`` (window > 1), ``ChunkedLocalAttentionSpec``,
``MambaSpec`` (vLLM's Mamba rules: mamba.py; one window, chunk or Mamba group alone too,
under vLLM's unitary coordinator) or ``CrossAttentionSpec`` (without prefix caching); one
block size equal to the scheduler block size (and the hash block size with caching), or
full-attention and window groups of different block sizes (hashes at their gcd, hits and
caching aligned to their lcm: ``_mixed_unsupported``); prefix caching on or off; EAGLE / MTP
over full attention and windows of one block size; lookahead block hashes beside no Mamba
group; partial hash hits over full attention and align-mode Mamba, checkpoint and
speculative blocks included (``_fine_unsupported``); no context parallelism, prefill lookahead,
metrics collector or a window group's sparse retention (a retention interval of full attention, chunk and
Mamba groups is served, set at construction or afterwards, as vLLM's tests do). Mamba
prefill checkpoint blocks are served (mamba.py). Anything else (R-SWA, sink, hisparse roles,
index rings, ...) runs on vLLM's own managers (``hybrid_unsupported`` says why).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any, Optional, cast

import numpy as np
from vllm.utils.math_utils import cdiv
from vllm.v1.core.kv_cache_coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)
from vllm.v1.core.kv_cache_manager import KVCacheManager as VLLMKVCacheManager
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    MambaSpec,
)

from . import mamba
from .builds import FALLBACK_REASONS, NATIVE_BUILDS
from .hybrid_state import _FULL, _KINDS, _MAMBA, _WINDOW, _HybridState
from .pool_view import NativeBlockPoolView
from .state import _ADMITTING, _EMPTY_I32, NativeKVCacheBlocks, _ids_of

logger = logging.getLogger(__name__)


def hybrid_unsupported(mgr: VLLMKVCacheManager, opts: dict) -> Optional[str]:
    """Why a hybrid configuration runs on vLLM's own managers, or None when kvblocks
    serves it natively."""
    coord: Any = mgr.coordinator
    groups = mgr.kv_cache_config.kv_cache_groups
    for g in groups:
        spec = g.kv_cache_spec
        if type(spec) not in _KINDS:
            return f"attention kind {type(spec).__name__} in a hybrid model"
        if str(getattr(g, "role", "default")) != "default":
            return f"KV cache group role {g.role}"
        if not getattr(spec, "prefix_cacheable", True):
            return "a group outside prefix caching"
        if _KINDS[type(spec)] == _WINDOW and spec.sliding_window <= 1:
            return "sliding window of one token"
        if type(spec) is ChunkedLocalAttentionSpec and spec.attention_chunk_size <= 0:
            return "attention chunk of no tokens"
        if type(spec) is MambaSpec:
            why = mamba.unsupported(spec, mgr.enable_caching)
            if why is not None:
                return why
        if type(spec) is CrossAttentionSpec and mgr.enable_caching:
            return "cross-attention with prefix caching"
    if not mgr.enable_caching:
        want: type = KVCacheCoordinatorNoPrefixCache
    elif len(groups) > 1:
        want = HybridKVCacheCoordinator
    else:
        want = UnitaryKVCacheCoordinator
    coord_cls: Any = type(coord)
    if coord_cls is not want:
        return f"coordinator {coord_cls.__name__}"
    sizes = {stm.block_size for stm in coord.single_type_managers}
    fine = bool(getattr(coord, "enable_partial_hash_hits", False))
    if fine:  # (sub-block hits: a Mamba group's blocks longer than a hash block)
        why = _fine_unsupported(coord, groups)
        if why is not None:
            return why
    elif len(sizes) != 1:
        why = _mixed_unsupported(mgr, coord, groups)
        if why is not None:
            return why
    else:
        (bs,) = sizes
        if bs != coord.scheduler_block_size or (
            bs != coord.block_pool.hash_block_size and mgr.enable_caching
        ):  # (without caching the hashes are not used)
            return "hash or scheduler block size differs from the block size"
    if opts.get("dcp_world_size", 1) != 1 or opts.get("pcp_world_size", 1) != 1:
        return "decode/prefill context parallelism"
    kinds = {_KINDS[type(g.kv_cache_spec)] for g in groups}
    if getattr(coord, "drop_eagle_group_ids", ()):  # (served: full attention and windows
        if not kinds <= {_FULL, _WINDOW} or len(sizes) != 1:  # of one block size)
            return "EAGLE / MTP lookahead"
    elif coord.eagle_group_ids and _MAMBA in kinds:  # (flagged groups that drop nothing
        return "EAGLE groups beside a Mamba group"  # act as others but for Mamba's rules)
    if opts.get("num_prefill_lookahead", 0):
        return "prefill lookahead (multi-module MTP)"
    if opts.get("num_hash_lookahead_tokens", 0) and any(
        type(g.kv_cache_spec) is MambaSpec for g in groups
    ):
        return "lookahead block hashes with a Mamba group"
    if getattr(coord, "num_reprefillable_tokens", 0):
        return "re-prefillable tokens (multi-module MTP)"
    if opts.get("metrics_collector") is not None:
        return "KV cache residency metrics"
    if getattr(coord, "retention_interval", None) is not None and any(
        _KINDS[type(g.kv_cache_spec)] == _WINDOW for g in groups
    ):  # (full attention and chunks keep every block; Mamba's masks: mamba.py)
        return "sparse retention interval of a sliding-window group"
    if getattr(mgr, "retained_hit_group_ids", ()):
        return "groups retaining longer hits"
    return None


def _mixed_unsupported(mgr: VLLMKVCacheManager, coord: Any, groups: Sequence[Any]) -> Optional[str]:
    """Why groups of different block sizes run on vLLM's managers, or None: served are
    full-attention and sliding-window groups (vLLM's hashes at the sizes' gcd, hits and
    caching aligned to their lcm), without a retention interval."""
    for g in groups:
        if _KINDS[type(g.kv_cache_spec)] not in (_FULL, _WINDOW):
            return f"groups of different block sizes with {type(g.kv_cache_spec).__name__}"
    sbs, hbs = coord.scheduler_block_size, coord.block_pool.hash_block_size
    for stm in coord.single_type_managers:
        if sbs % stm.block_size or (mgr.enable_caching and stm.block_size % hbs):
            return "groups of different block sizes off the scheduler / hash block grid"
    if getattr(coord, "retention_interval", None) is not None:
        return "groups of different block sizes with a retention interval"
    return None


def _fine_unsupported(coord: Any, groups: Sequence[Any]) -> Optional[str]:
    """Why vLLM's fine-grained partial hash hits (an align-mode Mamba group whose blocks
    are longer than a hash block: hits on hash-block boundaries inside blocks, shared tail
    blocks copied on write) run on vLLM's managers, or None: served are full-attention and
    align-mode Mamba groups (prefill checkpoint and speculative blocks too), on vLLM's
    block grid, without a retention interval (EAGLE and lookahead hashes beside Mamba are
    refused by ``hybrid_unsupported`` itself)."""
    for g in groups:
        spec = g.kv_cache_spec
        kind = _KINDS[type(spec)]
        if kind not in (_FULL, _MAMBA):
            return f"partial hash hits with {type(spec).__name__}"
    sbs, hbs = coord.scheduler_block_size, coord.block_pool.hash_block_size
    for stm in coord.single_type_managers:
        if sbs % stm.block_size or stm.block_size % hbs or stm.dcp_world_size != 1:
            return "partial hash hits off the scheduler / hash block grid"
    if getattr(coord, "retention_interval", None) is not None:
        return "partial hash hits with a retention interval"
    return None


def _prefill_end(request: Any) -> int:
    """The token index the request's prefill ends at (vLLM's allocate_slots)."""
    return max(request.num_prompt_tokens, request.num_tokens - 1)


class _LiveBlocks(Sequence):
    """A request's table of one group as block views, read live (vLLM's req_to_blocks
    lists are the manager's own: a Mamba table's entries change in place)."""

    def __init__(self, view: Any, ids: list) -> None:
        self._view = view
        self._ids = ids

    def __len__(self) -> int:
        return len(self._ids)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._view(b) for b in self._ids[i]]
        return self._view(self._ids[i])

    def __eq__(self, other: object) -> bool:
        return list(self) == other

    def __repr__(self) -> str:
        return repr(list(self))


def _late_setting(view: Any, name: str, value: Any) -> None:
    """An attribute set on a group or coordinator view (vLLM's tests set ``use_eagle``, a
    retention interval or a spy on a built manager): a manager that served nothing yet
    hands the model to vLLM's own managers and the setting goes to vLLM's object; one that
    served requests keeps it on the view (logged: the native path does not read it)."""
    mgr = object.__getattribute__(view, "_m")
    inner = object.__getattribute__(view, "_inner")
    if mgr.native and mgr._pristine():
        mgr._to_vllm(f"{name} set on a built manager's {type(inner).__name__}")
    if mgr.native:
        logger.warning("kvblocks: %s set on a native manager's view after it served requests", name)
        object.__setattr__(view, name, value)
    else:
        setattr(inner, name, value)


class _HybridGroupView:
    """vLLM's single-type manager of group g, with the native request tables; once the
    manager went to vLLM's managers (``_late_setting``), vLLM's manager itself."""

    _OWN = frozenset(("_inner", "_s", "_g", "_m", "block_pool", "__class__", "__dict__"))

    def __init__(self, inner: Any, state: _HybridState, g: int, pool: Any, mgr: Any) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_s", state)
        object.__setattr__(self, "_g", g)
        object.__setattr__(self, "_m", mgr)
        object.__setattr__(self, "block_pool", pool)

    def __getattribute__(self, name: str) -> Any:
        if name in _HybridGroupView._OWN or object.__getattribute__(self, "_m").native:
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_inner"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        _late_setting(self, name, value)

    def __delattr__(self, name: str) -> None:
        if object.__getattribute__(self, "_m").native:
            object.__delattr__(self, name)
        else:
            delattr(object.__getattribute__(self, "_inner"), name)

    @property
    def _null_block(self) -> Any:
        return self.block_pool.null_block

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() of vLLM's manager class holds (vLLM's
        return type(self._inner)  # code and tests find the cross-attention group so)

    @property
    def req_to_blocks(self) -> dict:
        view, g = self._s.view, self._g
        if self._s.fine:  # (tables that change in place: read live, as vLLM's lists)
            return {rid: _LiveBlocks(view, t[g]) for rid, t in self._s.tables.items()}
        return {rid: [view(b) for b in t[g]] for rid, t in self._s.tables.items()}

    @property
    def num_cached_block(self) -> dict:
        g = self._g
        return {rid: nc[g] for rid, nc in self._s.ncached.items()}

    @property
    def _checkpoints(self) -> dict:  # MambaManager's reserved (position, table index)
        align = self._s.align
        if align is None or not self._s.is_align[self._g]:
            return self._inner._checkpoints
        return dict(align.checkpoints[self._g])


class _HybridCoordinatorView:
    """vLLM's hybrid coordinator, with the calls that touch blocks answered natively."""

    _OWN = frozenset(
        ("_inner", "_m", "block_pool", "single_type_managers", "__class__", "__dict__")
    )

    def __init__(self, inner: Any, mgr: HybridKVCacheManager) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_m", mgr)
        s = mgr._native
        object.__setattr__(self, "block_pool", mgr.block_pool)
        views = tuple(
            _HybridGroupView(stm, s, g, mgr.block_pool, mgr)
            for g, stm in enumerate(inner.single_type_managers)
        )
        object.__setattr__(self, "single_type_managers", views)

    def __getattribute__(self, name: str) -> Any:
        if object.__getattribute__(self, "_m").native or name in ("_inner", "_m"):
            return object.__getattribute__(self, name)
        return getattr(object.__getattribute__(self, "_inner"), name)  # (gone to vLLM's)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "retention_interval" and self._m.native:
            object.__setattr__(self, name, value)  # (the property below)
        else:
            _late_setting(self, name, value)

    @property
    def retention_interval(self) -> Optional[int]:
        return self._m._native.retention

    @retention_interval.setter
    def retention_interval(self, value: Optional[int]) -> None:
        """vLLM's tests set the interval on a built manager: a Mamba group's masks and
        checkpoints follow it (mamba.py); a window group's sparse retention is not
        served natively, so it is refused rather than ignored."""
        s = self._m._native
        why = None
        if value is not None and any(s.window):
            why = "sparse retention of a sliding-window group"
        elif value is not None and s.fine:
            why = "a retention interval under partial hash hits"
        if why is not None:  # (not served natively: vLLM's managers take it, or it is
            if not self._m._pristine():  # refused once requests ran)
                raise NotImplementedError(f"kvblocks: {why} set after requests were served")
            self._m._to_vllm(f"{why} set on a built manager")
            self._inner.retention_interval = value
            return
        s.retention = value
        if s.align is not None:
            s.align.retention = value

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
        return self._m._to_allocate(
            request_id,
            num_tokens,
            [_ids_of(b) for b in new_computed_blocks],
            total_computed_tokens,
            apply_admission_cap,
            num_tokens_main_model,
            prefill_end,
            num_encoder_tokens,
        )

    def get_blocks(self, request_id: str) -> tuple:
        s = self._m._native
        t = s.tables.get(request_id)
        if t is None:
            return tuple([] for _ in range(s.num_groups))
        return tuple([s.view(b) for b in ids] for ids in t)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple:
        s = self._m._native
        hk = s.hash_keys(block_hashes, len(block_hashes))
        blocks, hit, uncached, _ = s.find(hk, max_cache_hit_length)
        return tuple([s.view(b) for b in ids] for ids in blocks), hit, uncached

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple:
        s = self._m._native
        hk = s.hash_keys(block_hashes, len(block_hashes))
        blocks, hits = s.find_per_group(hk, max_cache_hit_length)
        return tuple([s.view(b) for b in ids] for ids in blocks), tuple(hits)

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # isinstance() of vLLM's coordinator class holds (the
        return type(self._inner)  # scheduler's per-group connector path checks it)

    def free(self, request_id: str) -> None:
        self._m._native.free_request(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list:
        s = self._m._native
        return [s.view(b) for b in s.pop(request_id)]

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._m.cache_blocks(request, num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        return self._m._native.reset()

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: Any = None
    ) -> None:
        self._m._native.remove_skipped(request_id, processed_computed_tokens)

    def new_step_starts(self) -> None:
        align = self._m._native.align
        if align is not None:
            align.new_step()


class HybridKVCacheManager(VLLMKVCacheManager):
    """``KVCacheManager`` of a hybrid model (full attention, window and chunk groups) on
    kvblocks' native pool; ``KVCacheManager.__init__`` turns an instance into this class
    when ``hybrid_unsupported`` finds nothing against it."""

    native: bool = True  # (manager.KVCacheManager's flag: True until _to_vllm)
    _fallback_cls: type  # the class this instance was built as (manager.KVCacheManager)
    _native: _HybridState
    _bs: int
    block_pool: Any  # NativeBlockPoolView
    coordinator: Any  # _HybridCoordinatorView

    def _init_hybrid(self) -> None:
        coord = self.coordinator
        self._native = _HybridState(self, coord)
        self._bs = self._native.block_size
        self.block_pool = NativeBlockPoolView(self._native, coord.block_pool.hash_block_size)
        self._vllm_coordinator = coord
        self.coordinator = _HybridCoordinatorView(coord, self)
        self.coordinator.retention_interval = getattr(coord, "retention_interval", None)
        self._empty_groups = tuple(_EMPTY_I32 for _ in range(self._native.num_groups))

    def _pristine(self) -> bool:
        """Whether the native state never served a request (no table, no entry, no event,
        every block free): the model can still go to vLLM's own managers exactly."""
        s = self._native
        p = s.pool
        return (
            not s.tables and not s.events and p.num_cached == 0 and p.num_free == s.num_blocks - 1
        )

    def _to_vllm(self, why: str) -> None:
        """Hand this (pristine) manager to vLLM's own coordinator, single-type managers and
        block pool, which ``KVCacheManager.__init__`` built and kept unused: from here it is
        the fallback manager (``manager.KVCacheManager`` with ``native`` False), logged."""
        self.coordinator = self._vllm_coordinator
        self.block_pool = self._vllm_coordinator.block_pool
        self.native = False
        self.__class__ = self._fallback_cls
        NATIVE_BUILDS["hybrid"] -= 1
        NATIVE_BUILDS["fallback"] += 1
        FALLBACK_REASONS[why] += 1
        logger.info("kvblocks: vLLM's own KV cache managers serve this model (%s)", why)

    def _blocks(self, per_group: Sequence[Any]) -> Any:
        if any(len(b) for b in per_group):
            return NativeKVCacheBlocks(self._native, per_group)
        return self.empty_kv_cache_blocks

    # -- lookups ------------------------------------------------------------------------------
    def _find(self, request: Any, max_length: int) -> tuple:
        s = self._native
        hashes = request.block_hashes
        n = min(max_length // (s.hbs if s.mixed else self._bs), len(hashes))
        if n <= 0 or not s.attn:
            return [[] for _ in range(s.num_groups)], 0, 0, None
        return s.find(s.hash_keys(hashes, n, request), max_length)

    def get_computed_blocks(
        self, request: Any, max_cache_hit_length: Optional[int] = None
    ) -> tuple:
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        max_len = request.get_max_cache_hit_length(max_cache_hit_length)
        blocks, hit, uncached, nulls = self._find(request, max_len)
        s = self._native
        if (
            hit > 0
            and self.enable_kv_cache_events
            and getattr(request, "kv_cache_report_mode", "incremental") == "full"
        ):
            for g, b in enumerate(blocks):
                if len(b):
                    hs = s.gview((request.block_hashes, None, None), g)[0]
                    s.events.append(s._stored(request, 0, len(b), g, None, s.bsz[g], hs))
        out = self._blocks(blocks)
        if nulls is not None and out is not self.empty_kv_cache_blocks:
            out._nulls = nulls
        return out, hit, (hit + uncached if uncached else 0)

    def get_num_cached_tokens(self, request: Any) -> int:
        if not self.prefix_cache_lookup_enabled(request):
            return 0
        return self._find(request, request.num_tokens - 1)[1]

    def estimate_cached_tokens(self, request: Any) -> int:
        s = self._native
        tables = s.tables.get(request.request_id)
        if not tables:
            return 0
        out: Optional[int] = None
        for g, t in enumerate(tables):
            n = 0
            for i in range(len(t) - 1, -1, -1):
                if t[i] and t[i] in s.hash_of:
                    n = int(s.ntok[t[i]]) if s.ntok is not None else (i + 1) * s.bsz[g]
                    break
            out = n if out is None else min(out, n)
        return out or 0

    # -- allocation ---------------------------------------------------------------------------
    def _to_allocate(
        self,
        rid: str,
        num_tokens: int,
        new_lists: Sequence[Any],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        num_tokens_main: Optional[int] = None,
        prefill_end: int = 0,
        num_encoder_tokens: int = 0,
        num_local: int = -1,
    ) -> int:
        """vLLM's coordinator get_num_blocks_to_allocate, summed over the groups
        (``prefill_end``: the request's, for Mamba checkpoints under sparse retention;
        ``num_encoder_tokens``: what a cross-attention group needs; ``num_local``: the
        local computed tokens, whose hit may end inside a block under partial hash
        hits, -1: ``total_computed_tokens``)."""
        s = self._native
        tables = s.tables.get(rid)
        running = rid in s.ncached
        required = cdiv(num_tokens, self._bs)
        total = 0
        for g in range(s.num_groups):
            bs = s.bsz[g]
            if s.mixed:
                required = cdiv(num_tokens, bs)
            if s.is_align[g]:
                total += cast(Any, s.align).to_allocate(
                    g,
                    rid,
                    num_tokens if num_tokens_main is None else num_tokens_main,
                    new_lists[g],
                    len(tables[g]) if tables is not None else 0,
                    total_computed_tokens,
                    prefill_end,
                    not apply_admission_cap,
                    num_local,
                )
                continue
            req = required
            if s.spec_tokens[g]:
                req = cdiv(num_tokens + s.spec_tokens[g], bs)
            elif s.cross[g]:  # the encoder's tokens, no hit, nothing skipped
                req = cdiv(num_encoder_tokens, bs)
                cap = s.cap[g]
                if apply_admission_cap and cap is not None and cap < req:
                    req = cap
                have = len(tables[g]) if tables is not None else 0
                total += max(req - have, 0)
                continue
            cap = s.cap[g]
            if apply_admission_cap and cap is not None and cap < req:
                req = cap
            have = len(tables[g]) if tables is not None else 0
            if running:
                total += max(req - have, 0)
                continue
            nsb = s.skipped(g, total_computed_tokens) // bs
            new_g = new_lists[g]
            n = max(req - max(nsb, len(new_g) + have), 0)
            tail = new_g[max(0, nsb - have) :]
            if len(tail):
                n += s.pool.num_unreferenced(np.asarray(tail, dtype=np.int32))
            if s.fine and len(new_g):  # a hit ending inside a block: its copy
                if (total_computed_tokens if num_local < 0 else num_local) % bs:
                    n += 1
            total += n
        return total

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
        ng = s.num_groups
        adopt = (
            new_computed_blocks is not None
            and new_computed_blocks is not self.empty_kv_cache_blocks
        )
        if (
            not adopt
            and num_external_computed_tokens == 0
            and not full_sequence_must_fit
            and rid in s.ncached
            and not s.cross_any
        ):  # a running request (decode, next chunk): the same rules, fewer steps
            return self._allocate_running(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                delay_cache_blocks,
                reserved_blocks,
                has_scheduled_reqs,
            )
        if not adopt:
            new_lists: Sequence[Any] = self._empty_groups
        elif isinstance(new_computed_blocks, NativeKVCacheBlocks):
            new_lists = new_computed_blocks._ids
        else:
            new_lists = [_ids_of(b) for b in new_computed_blocks.blocks]
        ext = num_external_computed_tokens
        num_local = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local + ext, self.max_model_len)
        watermark = 0
        if has_scheduled_reqs and request.status in _ADMITTING:
            watermark = self.watermark_blocks
        if full_sequence_must_fit:
            full_n = min(request.num_tokens, self.max_model_len)
            n = self._to_allocate(
                rid,
                full_n,
                new_lists,
                total_computed,
                True,
                full_n,
                _prefill_end(request),
                num_encoder_tokens,
                num_local,
            )
            if n + watermark > s.pool.num_free:
                return None
        num_main = total_computed + num_new_tokens
        need = min(num_main + num_lookahead_tokens, self.max_model_len)
        if s.sw_groups:
            s.remove_skipped(rid, max(0, total_computed - request.num_in_flight_tokens))
        n = self._to_allocate(
            rid,
            need,
            new_lists,
            num_local + ext,
            False,
            num_main,
            _prefill_end(request),
            num_encoder_tokens,
            num_local,
        )
        if n + watermark > s.pool.num_free - reserved_blocks:
            return None
        tables = s.tables.get(rid)
        if tables is None:
            tables = s.tables[rid] = [[] for _ in range(ng)]
            s.nulls[rid] = [0] * ng
        if (adopt or ext > 0) and rid not in s.ncached:
            nulls = s.nulls[rid]
            hit_nulls = getattr(new_computed_blocks, "_nulls", None)
            nc = [0] * ng
            touch: list = []
            for g in range(ng):
                nsb = s.skipped(g, num_local + ext) // s.bsz[g]
                blocks = new_lists[g]
                blocks = blocks[nsb:] if nsb else blocks
                ids = blocks.tolist() if isinstance(blocks, np.ndarray) else list(blocks)
                if hit_nulls is not None:  # leading nulls of the hit past the skipped ones
                    nl = hit_nulls[g] - nsb if hit_nulls[g] > nsb else 0
                else:
                    nl = bisect_left(ids, True, key=bool)  # nulls lead a table, then blocks
                if nl < len(ids):
                    if not self.enable_caching:
                        raise AssertionError(
                            "Computed blocks should be empty when prefix caching is disabled"
                        )
                    touch += ids[nl:] if nl else ids
                t = tables[g]
                if nsb:
                    t.extend([0] * nsb)
                t.extend(ids)
                nc[g] = len(t)
                nulls[g] = nsb + nl
                if s.fine and ids and num_local % s.bsz[g]:  # the hit ends inside its
                    i = num_local // s.bsz[g]  # last block: copied at the allocation below
                    s.phit[g][rid] = (i, ids[-1])
                    nc[g] = i
            if touch:
                s.pool.touch(touch)
            s.ncached[rid] = nc
            if ext > 0:
                num_total = num_local + ext
                for g in range(ng):
                    if s.cross[g]:  # (vLLM's CrossAttentionManager loads nothing)
                        continue
                    sk = s.skipped(g, num_total)
                    e = min(num_total - sk, ext) if sk > 0 else ext
                    if e <= 0:
                        continue
                    k = cdiv(num_total, s.bsz[g]) - len(tables[g])
                    if k > 0:
                        ext_ids = s.allocate(k).tolist()
                        tables[g].extend(ext_ids)
                        zero = s.zeroing[g]
                        if zero is not None and g not in skip_zeroing_group_ids:
                            zero.new_block_ids.extend(ext_ids)
        out, n_new = self._grow(tables, rid, need, num_main, num_encoder_tokens)
        if not delay_cache_blocks and self.enable_caching:
            s.cache_groups(request, min(total_computed + num_new_tokens, request.num_tokens))
        if not n_new:
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(s, out)

    def _grow(
        self, tables: list, rid: str, need: int, num_main: int, num_encoder_tokens: int = 0
    ) -> tuple[list, int]:
        """vLLM's coordinator allocate_new_blocks: each group's table grown to ``need``
        tokens (a Mamba group's by its rules, mamba.py), the new blocks popped in one
        native call in vLLM's group order; (the entries returned per group, whether any)."""
        s = self._native
        required = cdiv(need, self._bs)
        counts = []
        heads: list = []
        was: list = []
        for g, t in enumerate(tables):
            if s.is_align[g]:
                c, head = cast(Any, s.align).prepare(g, rid, t, num_main)
                counts.append(c)
                heads.append(head)
                was.append(cast(Any, s.align).was)
                continue
            r = cdiv(need + s.spec_tokens[g], self._bs) if s.spec_tokens[g] else required
            if s.mixed:
                r = cdiv(need, s.bsz[g])
            elif s.cross[g]:
                r = cdiv(num_encoder_tokens, self._bs)
            if s.fine and rid in s.phit[g]:  # the hit's copy, popped first
                counts.append(max(r - len(t), 0) + 1)
            else:
                counts.append(r - len(t))
            heads.append(None)
            was.append(False)
        n_new = sum(c for c in counts if c > 0)
        if s.fine:
            return self._grow_fine(tables, rid, counts, heads, was, n_new)
        out: list = []
        new = s.allocate(n_new).tolist() if n_new else []
        pos = 0
        any_out = False
        for t, c, head, zero in zip(tables, counts, heads, s.zeroing):
            part = new[pos : pos + c] if c > 0 else []
            pos += len(part)
            t.extend(part)
            if zero is not None and part:  # the worker zeroes new attention blocks
                zero.new_block_ids.extend(part)
            if head:
                part = head + part
            out.append(part)
            any_out = any_out or bool(part)
        return out, any_out

    def _grow_fine(
        self, tables: list, rid: str, counts: list, heads: list, was: list, n_new: int
    ) -> tuple[list, int]:
        """``_grow``'s popping under partial hash hits: a group with a pending copy takes
        the first of its blocks for it (vLLM's allocate_new_blocks with _partial_hit_reqs:
        a full-attention group's copy replaces the hit block and is recorded as new, a
        Mamba group's by mamba.py's copy_on_write)."""
        s = self._native
        new = s.allocate(n_new).tolist() if n_new else []
        pos = 0
        out: list = []
        any_out = False
        for g, (t, c, head) in enumerate(zip(tables, counts, heads)):
            part = new[pos : pos + c] if c > 0 else []
            pos += len(part)
            lead: list = []
            if part and rid in s.phit[g]:
                cow = part[0]
                part = part[1:]
                if s.is_align[g]:
                    if cast(Any, s.align).copy_on_write(g, rid, t, cow, was[g]):
                        lead = [cow]
                else:
                    i, src = s.phit[g].pop(rid)
                    t[i] = cow
                    s.cow[g].append((src, cow))
                    s.pool.incref([cow])
                    s.stms[g].new_block_ids.append(cow)  # (vLLM records it in any case)
                    lead = [cow]
            t.extend(part)
            zero = s.zeroing[g]
            if zero is not None and part and not s.is_align[g]:
                zero.new_block_ids.extend(part)
            o = lead + (head or []) + part
            out.append(o)
            any_out = any_out or bool(o)
        return out, any_out

    def finalize_partial_tail_offloads(self, request: Any) -> list:
        align = self._native.align
        if align is None or not self._native.fine:
            return super().finalize_partial_tail_offloads(request)
        return align.finalize(
            request.request_id, request.num_computed_tokens, request.num_in_flight_tokens
        )

    def take_kv_cache_block_copies(self) -> tuple:
        """vLLM's pending copy-on-write copies of partial hits (source, copy), group by
        group, and both ends of each (the scheduler frees them once the copy has run)."""
        s = self._native
        if not s.fine:
            return super().take_kv_cache_block_copies()
        pairs = [p for c in s.cow for p in c]
        for c in s.cow:
            c.clear()
        copies = [KVCacheBlockCopy(src_block_id=a, dst_block_id=b) for a, b in pairs]
        return copies, [s.view(b) for p in pairs for b in p]

    def _allocate_running(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        num_lookahead_tokens: int,
        delay_cache_blocks: bool,
        reserved_blocks: int,
        has_scheduled_reqs: bool,
    ) -> Any:
        """allocate_slots of a request vLLM's managers track as running (in
        num_cached_block: no new hits; each group needs its table grown to the tokens)."""
        s = self._native
        rid = request.request_id
        max_len = self.max_model_len
        total = request.num_computed_tokens + num_new_computed_tokens
        if total > max_len:
            total = max_len
        num_main = total + num_new_tokens
        need = num_main + num_lookahead_tokens
        if need > max_len:
            need = max_len
        if s.sw_groups:
            done = total - request.num_in_flight_tokens
            s.remove_skipped(rid, done if done > 0 else 0)
        tables = s.tables[rid]
        required = -(-need // self._bs)  # cdiv
        n_new = 0
        if s.mamba_any:  # per-group rules (mamba.py; spec blocks in "none" mode)
            n_new = self._to_allocate(
                rid, need, self._empty_groups, total, False, num_main, _prefill_end(request)
            )
        else:
            if s.mixed:  # each group's blocks for the tokens, at its block size
                reqs = [-(-need // bs) for bs in s.bsz]
            else:
                reqs = [required] * len(tables)
            for t, r in zip(tables, reqs):
                if r > len(t):
                    n_new += r - len(t)
        watermark = 0
        if has_scheduled_reqs and request.status in _ADMITTING:
            watermark = self.watermark_blocks
        if n_new + watermark > s.pool.num_free - reserved_blocks:
            return None
        out: list = []
        if s.mamba_any:
            out, any_new = self._grow(tables, rid, need, num_main)
            n_new = int(any_new)
        elif n_new:
            new = s.allocate(n_new).tolist()
            pos = 0
            for t, zero, r in zip(tables, s.zeroing, reqs):
                c = r - len(t)
                if c > 0:
                    part = new[pos : pos + c]
                    pos += c
                    t.extend(part)
                    if zero is not None:
                        zero.new_block_ids.extend(part)
                    out.append(part)
                else:
                    out.append([])
        if (
            not delay_cache_blocks
            and self.enable_caching
            and (len(request.block_hashes) > min(s.ncached[rid]) or s.align is not None or s.mixed)
        ):
            s.cache_groups(request, min(num_main, request.num_tokens))
        if not n_new:
            return self.empty_kv_cache_blocks
        return NativeKVCacheBlocks(s, out)

    # -- the rest of the scheduler's API ------------------------------------------------------
    def new_step_starts(self) -> None:
        align = self._native.align
        if align is not None:  # hits on blocks cached in the step before wait no more
            align.new_step()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        s = self._native
        tables = s.tables.get(request_id)
        for g, zero in enumerate(s.zeroing):
            if zero is not None:
                assert start_token % s.bsz[g] == 0
                if tables is not None:
                    zero.new_block_ids.extend(tables[g][start_token // s.bsz[g] :])

    def take_boundary_state_offloads(self) -> dict:
        align = self._native.align
        return {} if align is None else align.take_offloads()

    def free(self, request: Any) -> None:
        self._native.free_request(request.request_id)

    def pop_blocks_for_free(self, request: Any) -> list:
        s = self._native
        return [s.view(b) for b in s.pop(request.request_id)]

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: Optional[int] = None,
    ) -> None:
        self._native.remove_skipped(request_id, processed_computed_tokens)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self._native.cache_groups(request, num_computed_tokens)

    def get_blocks(self, request_id: str) -> Any:
        t = self._native.tables.get(request_id)
        if not t:
            return self.empty_kv_cache_blocks
        return self._blocks(tuple(t))

    def get_block_ids(self, request_id: str) -> tuple:
        t = self._native.tables.get(request_id)
        if t is None:
            return tuple([] for _ in range(self._native.num_groups))
        return tuple(list(ids) for ids in t)

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> tuple:
        s = self._native
        return tuple(
            ids if s.cross[g] or s.mamba[g] else ids[: cdiv(num_computed_tokens, s.bsz[g])]
            for g, ids in enumerate(self.get_block_ids(request_id))
        )

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        s = self._native
        groups = (
            blocks._ids
            if isinstance(blocks, NativeKVCacheBlocks)
            else [_ids_of(b) for b in blocks.blocks]
        )
        out = []
        for g, ids in enumerate(groups):
            assert num_computed_tokens % s.bsz[g] == 0
            n = num_computed_tokens // s.bsz[g]
            if s.mamba[g]:  # (an external hit can supply the last Mamba state)
                n = min(n, len(ids))
            assert n <= len(ids)
            out.append(list(ids[:n]))
        return self._blocks(out)
