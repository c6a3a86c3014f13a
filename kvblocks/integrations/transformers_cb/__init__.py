"""kvblocks as the block allocator of transformers' continuous batching.

``model.generate_batch(...)`` and the manager API (``model.init_continuous_batching()``,
``add_request``, ``get_result``, ``stop``) run transformers' own paged engine: its scheduler, its
cache tensor, its attention paths (including, on CUDA with FlashAttention, the decode kernel that
reads K/V in place through block tables). Inside :func:`enabled`, every continuous-batching cache
built takes its blocks from a :class:`kvblocks.BlockPool` instead of transformers' allocator:

>>> from kvblocks.integrations import transformers_cb          # doctest: +SKIP
>>> with transformers_cb.enabled(enable_prefix_caching=True) as kb:   # doctest: +SKIP
...     out = model.generate_batch(prompts, generation_config=cfg)
>>> kb.stats.hit_blocks, kb.stats.evictions                        # doctest: +SKIP

What kvblocks owns (stage 1 of issue 13, "allocation"):

* **block ids**: kvblocks' ids are the ids in transformers' block tables, unchanged. The pool spans
  transformers' whole cache tensor; its null block 0 and the other blocks of transformers' two
  trash sectors are held by the pool from the start (:attr:`KVBlocksCB.reserved_blocks`) and never
  handed out, so the decode fast path reads the blocks kvblocks allocated, in place;
* **reference counts** (forks share full blocks with ``incref``), **frees** (tail first, so the
  longest prefixes are evicted first);
* **prefix hashing and lookup**: ``hash_blocks`` (keyed SipHash-128, chained) and
  ``lookup_and_pin`` (no window in which a hit can be evicted);
* **eviction**: lazy LRU, one block at a time, only when an allocation needs it. transformers'
  own allocator drops every cached block at once under memory pressure; here its
  "evict the cache" call is a no-op and the free count it sees already includes evictable blocks;
* **only computed blocks become prefix hits**: a full block is registered (``pool.cache``) in
  transformers' ``mark_complete_blocks``, which its batch processor calls in ``update_batch``,
  after the forward pass that wrote the block's K/V has returned its tokens. This is the
  block-level form of ``mgr.schedule`` "after the K/V are written" (see *Committed vs computed*
  in docs/engine-integration.md): registering at scheduling time would let a request admitted
  in the same step hit a block whose K/V the step has not written yet, and a request preempted
  (offloaded) between scheduling and its forward would leave a hash on unwritten slots.

The seam: transformers 5.24 builds a ``PagedAttentionCache`` by looking up two module-level names
of ``transformers.generation.continuous_batching.cache``, ``ATTN_TYPE_TO_ALLOCATOR`` (the class per
attention type) and ``CachePool`` (the block pool). :func:`enabled` replaces both for the duration
of the ``with`` block and puts transformers' own objects back on exit, whatever happens inside.
Caches built inside keep working after the block (a persistent manager). transformers builds the
cache when the manager first needs it: in ``generate_batch`` (warmup on) or ``manager.warmup()``
in the calling thread, else in the manager's thread at ``start()``; keep that inside the block.

Supported: transformers 5.24.x (these are private names that change between minor versions),
models whose layers are full attention, sliding-window attention (Mistral, Qwen2 with
``use_sliding_window``) or both (Gemma 2/3, gpt-oss ``layer_types``). transformers keeps one
allocator per attention type; here each becomes a KV cache group of one
:class:`kvblocks.BlockManager` (``KVGroup("sliding_window", window=config.sliding_window)`` for the
sliding layers, see :mod:`kvblocks.integrations.transformers_cb_window`). Other layer types
(chunked local attention, linear attention / recurrent state, ...) are refused with
:class:`~kvblocks.errors.NotSupportedError` naming them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Dict, Iterator, List, Optional

import numpy as np

from ... import BlockManager, BlockPool, KVGroup, hash_blocks
from ...errors import InvalidStateError, NotSupportedError
from ...stats import CacheStats
from .._layer_groups import _WHY

__all__ = ["KVBlocksCB", "SUPPORTED_TRANSFORMERS", "check_version", "enabled"]

#: the transformers versions this module is written and tested for (``major.minor``)
SUPPORTED_TRANSFORMERS = ("5.24",)


def _version_problem(version: str) -> Optional[str]:
    """Why ``version`` of transformers is not supported, or None."""
    parts = version.split(".")
    if ".".join(parts[:2]) in SUPPORTED_TRANSFORMERS:
        return None
    return (
        f"kvblocks.integrations.transformers_cb supports transformers "
        f"{', '.join(v + '.x' for v in SUPPORTED_TRANSFORMERS)} (its continuous-batching "
        f"internals change between minor versions); found transformers {version}. "
        f"Install a supported one: pip install 'kvblocks[transformers-cb]'"
    )


def _installed_version() -> str:
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise NotSupportedError(
            "kvblocks.integrations.transformers_cb needs transformers "
            f"{SUPPORTED_TRANSFORMERS[0]}.x (not installed)"
        ) from exc
    return transformers.__version__


def check_version(version: Optional[str] = None) -> None:
    """Raise :class:`NotSupportedError` unless ``version`` (default: the installed transformers)
    is one this module supports (:data:`SUPPORTED_TRANSFORMERS`)."""
    if version is None:
        version = _installed_version()
    problem = _version_problem(version)
    if problem is not None:
        raise NotSupportedError(problem)


# transformers' classes: imported only when the installed version is supported, so importing this
# module never fails; enabled() refuses unsupported versions before touching anything.
try:
    import transformers as _tf

    _IMPORT_PROBLEM = _version_problem(_tf.__version__)
except ImportError:  # pragma: no cover - depends on the environment
    _IMPORT_PROBLEM = "transformers is not installed"

if _IMPORT_PROBLEM is None:
    from transformers.generation.continuous_batching import cache as _cb_cache
    from transformers.generation.continuous_batching import initialization as _cb_init
    from transformers.generation.continuous_batching.cache_allocators import (
        FULL_ATTENTION,
        SLIDING_ATTENTION,
        CachePool,
        FullAttentionCacheAllocator,
    )
else:  # pragma: no cover - depends on the installed version
    _cb_cache = _cb_init = None  # type: ignore[assignment]
    FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
    CachePool = FullAttentionCacheAllocator = object  # type: ignore[misc,assignment]


class KVBlocksCB:
    """What :func:`enabled` yields: the kvblocks side of the caches built inside the block.

    ``manager`` is the :class:`kvblocks.BlockPool` behind the last cache built (None before the
    first), ``stats`` its :class:`kvblocks.CacheStats`, ``pools`` every pool built in the block.
    """

    def __init__(
        self,
        enable_prefix_caching: bool,
        hash_key: Any,
        enable_kv_events: bool,
        native_step: bool = True,
    ) -> None:
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self.native_step = bool(native_step)
        self.hash_key = hash_key
        self.enable_kv_events = bool(enable_kv_events)
        self.pools: List["KVBlocksCachePool"] = []
        self.build_error: Optional[BaseException] = None  # a refusal raised while building a cache

    @property
    def cache_pool(self) -> Optional["KVBlocksCachePool"]:
        """The transformers-side pool (``cache.pool``) of the last cache built."""
        return self.pools[-1] if self.pools else None

    @property
    def manager(self) -> Optional[BlockPool]:
        """The kvblocks :class:`BlockPool` behind the last cache built."""
        p = self.cache_pool
        return None if p is None else p.kv

    @property
    def block_manager(self) -> Optional[BlockManager]:
        """The :class:`kvblocks.BlockManager` holding the block tables of the last cache built
        (stage 2, ``native_step=True``); None with ``native_step=False`` or before a cache."""
        p = self.cache_pool
        return None if p is None else p.mgr

    @property
    def steps(self) -> int:
        """Steps of the last cache whose index tensors kvblocks built natively."""
        p = self.cache_pool
        return 0 if p is None else max((getattr(a, "steps", 0) for a in p.allocators), default=0)

    @property
    def stats(self) -> CacheStats:
        """The :class:`CacheStats` of :attr:`manager` (all zero before a cache is built).

        ``queries`` / ``query_blocks`` / ``hit_blocks`` count prompt lookups only: the one-block
        lookups made to de-duplicate (:attr:`deduplicated`) are taken out. transformers looks a
        waiting prompt up again at every step until it is scheduled, so a prompt that missed can
        count several queries; :attr:`hit_tokens` counts each hit once."""
        m = self.manager
        if m is None:
            return CacheStats()
        st = m.stats
        allocators = self.cache_pool.allocators if self.cache_pool is not None else []
        n = sum(a.dedup_lookups[0] for a in allocators)
        hits = sum(a.dedup_lookups[1] for a in allocators)
        return dataclasses.replace(
            st,
            queries=st.queries - n,
            query_blocks=st.query_blocks - n,
            hit_blocks=st.hit_blocks - hits,
        )

    @property
    def hit_tokens(self) -> int:
        """Prompt tokens of the last cache served from the prefix cache (not computed)."""
        p = self.cache_pool
        return 0 if p is None else sum(a.hit_tokens for a in p.allocators)

    @property
    def reserved_blocks(self) -> int:
        """Blocks of the pool held for transformers' trash sectors (never handed out)."""
        p = self.cache_pool
        return 0 if p is None else len(p.reserved)

    @property
    def blocks_in_use(self) -> int:
        """Blocks referenced by requests of the last cache (reserved blocks not counted)."""
        p = self.cache_pool
        return 0 if p is None or p.kv is None else p.kv.num_used - len(p.reserved)

    @property
    def peak_blocks_in_use(self) -> int:
        """The most blocks requests of the last cache held at once (sampled when a step's blocks
        are allocated; reserved blocks not counted). With sliding-window layers it shows the
        window saving: a window group holds a bounded number of blocks per request."""
        p = self.cache_pool
        return 0 if p is None else p.peak

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of the last cache (K and V of ``page_size`` tokens for as many layers
        as the model's largest attention kind has: every allocator's blocks have this size)."""
        p = self.cache_pool
        return 0 if p is None or not p.allocators else int(p.allocators[0].bytes_per_block)

    @property
    def groups(self) -> tuple:
        """The KV cache groups of the last cache, one per transformers allocator, in allocator
        order (``()`` before a cache is built or for a pool without a manager)."""
        p = self.cache_pool
        return () if p is None or p.mgr is None else p.mgr.groups

    @property
    def deduplicated(self) -> int:
        """Computed blocks of the last cache replaced by an identical cached block (two requests
        computed the same prefix in one step), so their K/V are held once."""
        p = self.cache_pool
        return 0 if p is None else sum(a.deduplicated for a in p.allocators)

    def check(self) -> None:
        """Check every pool built: kvblocks' invariants (``BlockPool.check``) and that each block's
        reference count equals the references transformers' block tables hold (plus one for the
        reserved blocks). Raises :class:`InvalidStateError` on a mismatch."""
        for p in self.pools:
            p.check()

    def __repr__(self) -> str:
        m = self.manager
        if m is None:
            return "KVBlocksCB(no cache built)"
        return (
            f"KVBlocksCB(blocks={m.num_blocks}, in_use={self.blocks_in_use}, "
            f"cached={m.num_cached}, hits={m.stats.hit_blocks}, evictions={m.stats.evictions})"
        )


class KVBlocksCachePool(CachePool):
    """transformers' ``CachePool`` backed by a :class:`kvblocks.BlockPool`.

    transformers hands sectors to allocators and blocks out of sectors. Here the kvblocks pool spans
    every block of the cache tensor: all sectors count as assigned from the start (none is ever
    "free" at sector level), ``get_free_blocks`` allocates, ``free_blocks`` frees and
    ``count_free_blocks`` is kvblocks' ``num_free`` (never-cached free blocks plus evictable
    cached ones: allocation evicts those lazily, in LRU order, one at a time).

    With several allocators (full and sliding-window layers) every allocator's block holds the
    same number of pages (:func:`_pad_block`), so one kvblocks pool serves them all: the block
    tables live in one :class:`kvblocks.BlockManager`, one KV cache group per allocator.
    """

    def __init__(
        self, num_sectors: int, num_allocators: int, num_reserved_sectors: int = 2
    ) -> None:
        kb = _ACTIVE
        if kb is None:
            raise InvalidStateError(
                "a kvblocks cache pool was built outside "
                "transformers_cb.enabled() (the block was left while "
                "transformers was building its cache)"
            )
        self.kb = kb
        self.peak = 0  # most blocks held by requests at once (KVBlocksCB.peak_blocks_in_use)
        self.kv: Optional[BlockPool] = None
        self.mgr: Optional[BlockManager] = None  # stage 2: the block tables' manager
        self.page_size = 0  # tokens per block, set by the allocator before the pool is built
        self.sharing = True  # transformers' allow_block_sharing (stage 2 reads it)
        self.reserved = np.empty(0, dtype=np.int32)
        self.allocators: List["KVBlocksAllocator"] = []
        super().__init__(num_sectors, num_allocators, num_reserved_sectors)

    def reset(self) -> None:
        """transformers' reset (after warmup, on ``cache.reset()``): every request is freed first.
        The prefix cache is kept: cached blocks still hold their K/V."""
        self.free_sectors = []  # every sector belongs to kvblocks from the start
        if self.kv is not None and self.kv.num_used != len(self.reserved):
            held = self.kv.num_used - len(self.reserved)
            raise InvalidStateError(f"cache pool reset while {held} blocks are still referenced")

    def set_blocks_per_sector(self, index: int, blocks_per_sector: int) -> None:
        """Called by each allocator once the cache tensor is registered; after the last one, builds
        the kvblocks pool over the whole tensor (every allocator's blocks have the same size)."""
        if self.kv is not None:
            raise InvalidStateError("the kvblocks cache pool is already set up")
        if any(b not in (0, blocks_per_sector) for b in self.blocks_per_sector):
            raise InvalidStateError(
                f"transformers_cb: allocators of one cache cut {self.blocks_per_sector} and "
                f"{blocks_per_sector} blocks per sector (their blocks must have one size)"
            )
        self.blocks_per_sector[index] = blocks_per_sector
        if len(self.allocators) == self.num_allocators:
            self._build(blocks_per_sector)

    def _build(self, blocks_per_sector: int) -> None:
        num_blocks = (self.num_sectors + self.num_reserved_sectors) * blocks_per_sector
        kb = self.kb
        kwargs: Dict[str, Any] = {
            "enable_prefix_caching": kb.enable_prefix_caching,
            "enable_kv_events": kb.enable_kv_events,
        }
        if kb.hash_key is not None:
            kwargs["hash_key"] = kb.hash_key
        allocators = sorted(self.allocators, key=lambda a: a.index)
        groups = tuple(a.kv_group for a in allocators)
        # the trash sectors' blocks keep transformers' ids: hold them (block 0 is kvblocks' null)
        n_trash = self.num_reserved_sectors * blocks_per_sector
        if kb.native_step or groups != (KVGroup("full"),):
            # stage 2, or any sliding-window layer: the block tables (one group per allocator) live
            # in a BlockManager; the trash is held by a sequence, split evenly over the groups
            from .step import TRASH_SEQ

            kwargs["enable_prefix_caching"] = kb.enable_prefix_caching and self.sharing
            mgr = BlockManager(num_blocks, self.page_size, groups=groups, **kwargs)
            mgr.add(TRASH_SEQ, [])
            per_group = -(-(n_trash - 1) // len(groups))
            mgr.reserve(TRASH_SEQ, per_group * self.page_size)
            kv, self.mgr = mgr.pool, mgr
            reserved = np.sort(
                np.concatenate([mgr.block_table(TRASH_SEQ, group=g) for g in range(len(groups))])
            )
        else:
            kv = BlockPool(num_blocks, **kwargs)
            reserved = kv.allocate(n_trash - 1) if n_trash > 1 else np.empty(0, dtype=np.int32)
        if not np.array_equal(reserved, np.arange(1, len(reserved) + 1, dtype=np.int32)) or (
            len(reserved) < n_trash - 1
        ):
            raise InvalidStateError("kvblocks did not hand out the trash blocks first")
        self.kv, self.reserved = kv, reserved
        kb.pools.append(self)

    def note_usage(self) -> None:
        """Sample the blocks held by requests (for :attr:`KVBlocksCB.peak_blocks_in_use`)."""
        if self.kv is not None:
            self.peak = max(self.peak, self.kv.num_used - len(self.reserved))

    # sector level: nothing to do, kvblocks owns every block
    def allocate_sector(self, index: int) -> None:
        raise InvalidStateError("kvblocks cache pool: no sector is ever free")

    def try_to_free_sectors(self) -> None:
        pass

    # block level
    @property
    def _pool(self) -> BlockPool:
        assert self.kv is not None, "the pool is built with the cache tensor"
        return self.kv

    def get_free_blocks(self, index: int, num_blocks: int) -> List[int]:
        ids = self._pool.allocate(num_blocks).tolist()
        self.note_usage()
        return ids

    def free_blocks(self, index: int, block_ids: List[int]) -> None:
        if len(block_ids):
            self._pool.free(np.asarray(block_ids[::-1], dtype=np.int32))

    def count_free_blocks(self, index: int) -> int:
        """kvblocks' free blocks, given to allocator 0; the others see none (their needs are
        counted by allocator 0, which allocates for every group), so transformers' free-capacity
        sum over allocators counts each block once."""
        return self._pool.num_free if index == 0 else 0

    def check(self) -> None:
        """kvblocks' invariants, and reference counts equal to the block tables' references."""
        kv = self.kv
        if kv is None:
            return
        kv.check()
        if self.mgr is not None:
            self.mgr.check()
            if self.mgr.num_pending_copies:  # their sources hold a reference until drained
                return
        expected = np.zeros(kv.num_blocks, dtype=np.int64)
        expected[self.reserved] += 1
        for alloc in self.allocators:
            for table in alloc.block_table.values():
                t = np.asarray(table, dtype=np.int64)
                np.add.at(expected, t[t != 0], 1)  # 0: a window group's released entries
        actual = kv.ref_counts().astype(np.int64)
        bad = np.flatnonzero(expected != actual)
        if bad.size:
            b = int(bad[0])
            raise InvalidStateError(
                f"block {b}: ref count {int(actual[b])} but block tables hold "
                f"{int(expected[b])} references ({bad.size} blocks differ)"
            )

    def __repr__(self) -> str:
        return f"KVBlocksCachePool({self.kv!r})"


class _NoLedger:
    """Stands in for transformers' ``BlockLedger``: kvblocks keeps ref counts, hashes and the
    cached-block LRU, and evicts lazily, so "evict every cached block" returns nothing."""

    def reset(self) -> None:
        pass

    def evict_cached_blocks(self) -> List[int]:
        return []


class KVBlocksAllocator(FullAttentionCacheAllocator):
    """transformers' full-attention allocator whose block bookkeeping is kvblocks'.

    transformers keeps the block tables (``block_table[request_id]``, lists of kvblocks ids) and
    computes the physical rows from them; kvblocks hands out, shares, caches and frees the ids.
    ``_chains[request_id]`` holds the hashes of the request's leading blocks registered so far
    (``(n, 2)`` uint64), so a newly computed block is hashed on its parent in one native call.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "KVBlocksAllocator":
        # stage 1 keeps block tables in Python over a BlockPool; a model with sliding-window layers
        # needs KV cache groups, which live in a BlockManager: its full-attention allocator is the
        # manager-backed one then (transformers still builds the indices, from kvblocks' tables)
        if cls is KVBlocksAllocator and len(_attention_kinds(kwargs.get("config"))) > 1:
            from .step import KVBlocksStepAllocator

            cls = KVBlocksStepAllocator
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _pad_block(self, kwargs.get("config"))
        self.ledger = _NoLedger()  # type: ignore[assignment]  # transformers' ledger, unused
        self._chains: Dict[str, np.ndarray] = {}
        self.deduplicated = 0  # computed blocks replaced by an identical cached block
        self.dedup_lookups = [0, 0]  # [lookups, hits] made to de-duplicate (not prefix queries)
        self.hit_tokens = 0  # prompt tokens served from the prefix cache

    def _after_cache_tensor_init(
        self, non_trash_bytes: int, bytes_per_sector: int, cache_tensor: Any, pool: Any
    ) -> None:
        if not isinstance(pool, KVBlocksCachePool):
            raise InvalidStateError(
                "transformers_cb: the cache was built while leaving "
                "enabled(); build it inside the block"
            )
        pool.allocators.append(self)  # first: the last allocator's registration builds the pool
        super()._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)

    @property
    def kv_group(self) -> KVGroup:
        """The KV cache group holding this allocator's block tables."""
        return KVGroup("full")

    @property
    def kv(self) -> BlockPool:
        return self.pool.kv  # type: ignore[attr-defined]  # a KVBlocksCachePool (checked at init)

    def _caching(self) -> bool:
        return self.use_block_sharing and self.kv.enable_prefix_caching

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        """Release the request's blocks, tail first. ``no_cache`` (transformers' offload) is not
        needed: a cached block holds computed K/V, it stays a valid (evictable) prefix entry."""
        table = self.block_table.pop(request_id, [])
        self._chains.pop(request_id, None)
        if table:
            self.kv.free(np.asarray(table[::-1], dtype=np.int32))

    def fork_blocks(self, source_request_id: str, dest_request_id: str, past_length: int) -> tuple:
        """A child shares the parent's full blocks (``incref``) and gets fresh blocks for the rest,
        which transformers copies (the partial tail block)."""
        source = self.block_table[source_request_id]
        num_shared = self.count_shareable_blocks(source_request_id, past_length)
        shared, to_copy = source[:num_shared], source[num_shared:]
        fresh = self.kv.allocate(len(to_copy)).tolist()  # first: all or nothing
        if shared:
            self.kv.incref(np.asarray(shared, dtype=np.int32))
        self.block_table[dest_request_id] = shared + fresh
        chain = self._chains.get(source_request_id)
        if chain is not None:
            self._chains[dest_request_id] = chain[:num_shared].copy()
        return to_copy, fresh

    def match_prefix_blocks(self, prompt_ids: List[int]) -> List[int]:
        """Hash the prompt's full blocks (keeping at least one token to compute) and look them up
        and pin them in one native call. transformers acquires them next
        (:meth:`acquire_prefix_blocks`)."""
        if not self._caching():
            return []
        n = (len(prompt_ids) - 1) // self.tokens_per_page
        if n <= 0:
            return []
        hashes = hash_blocks(
            prompt_ids[: n * self.tokens_per_page], self.tokens_per_page, key=self.kv.hash_key
        )
        hit = self.kv.lookup_and_pin(hashes)
        if len(hit):
            self._pending_hit = (hit, hashes[: len(hit)])
        return hit.tolist()

    def acquire_prefix_blocks(self, request_id: str, prefix_len: int, block_ids: List[int]) -> None:
        """The request's table starts with the blocks :meth:`match_prefix_blocks` pinned."""
        hit, hashes = self.__dict__.pop("_pending_hit", (np.empty(0, np.int32), None))
        if hit.tolist() != list(block_ids) or self.block_table.get(request_id):
            if len(hit):
                self.kv.free(hit[::-1])
            raise InvalidStateError(
                f"prefix hit for request {request_id!r} does not match the blocks just looked up"
            )
        kept = prefix_len // self.tokens_per_page
        if kept < len(hit):  # another allocator matched less (not the case with one allocator)
            self.kv.free(hit[kept:][::-1])
        self.block_table[request_id] = hit[:kept].tolist()
        self._chains[request_id] = hashes[:kept].copy()
        self.hit_tokens += kept * self.tokens_per_page

    def mark_complete_blocks(
        self, request_id: str, token_ids: List[int], new_new_blocks: int
    ) -> None:
        """The forward pass that just returned computed ``new_new_blocks`` more full blocks of the
        request: hash them on their parent and register them in the prefix cache.

        A block whose hash is already cached under another block (two requests computed the same
        prefix in one step) is replaced by that block in the table and released, as transformers
        does, so identical K/V are held once."""
        if not self._caching():
            return
        table = self.block_table.get(request_id)
        if table is None:
            return
        chain = self._chains.get(request_id)
        done = 0 if chain is None else len(chain)
        ps = self.tokens_per_page
        end = min(done + new_new_blocks, len(token_ids) // ps, len(table))
        if end <= done:
            return
        parent = None if chain is None or done == 0 else chain[done - 1]
        tokens = np.asarray(token_ids[done * ps : end * ps], dtype=np.int32)
        new = hash_blocks(tokens, ps, parent=parent, key=self.kv.hash_key)
        ids = np.asarray(table[done:end], dtype=np.int32)
        kv = self.kv
        kv.cache(ids, new, parent=parent, token_ids=tokens if kv.record_events else None)
        for i, block in enumerate(ids.tolist()):
            if kv.is_cached(block):
                continue
            existing = kv.lookup(new[i : i + 1])  # same thread, nothing between lookup and incref
            self.dedup_lookups[0] += 1
            self.dedup_lookups[1] += len(existing)
            if len(existing) and int(existing[0]) != block:
                kv.incref(existing)
                table[done + i] = int(existing[0])
                kv.free(ids[i : i + 1])
                self.deduplicated += 1
        self._chains[request_id] = new if chain is None else np.concatenate([chain, new])


def _attention_kinds(config: Any) -> Dict[str, List[int]]:
    """transformers' grouping of the model's layers by attention type (its allocators)."""
    if config is None or _cb_cache is None:
        return {FULL_ATTENTION: []}
    return _cb_cache.group_layers_by_attn_type(config)


def _pad_block(alloc: Any, config: Any) -> None:
    """Give every allocator of the model blocks of the same size: as many pages as the largest
    attention kind has layers. transformers sizes each kind's block to its own layers and carves
    sectors into blocks of different sizes; kvblocks has one pool of one block size, shared by its
    groups. A kind with fewer layers leaves its extra pages unused (none when the kinds have equal
    layer counts: Gemma 2, gpt-oss, or a single kind)."""
    pages = max(len(v) for v in _attention_kinds(config).values()) if config is not None else 0
    if pages <= alloc.pages_per_block:
        return
    alloc.pages_per_block = pages
    alloc.tokens_per_block = alloc.tokens_per_page * pages
    alloc.block_physical_stride = alloc.rows_per_token * alloc.tokens_per_block
    alloc.bytes_per_block = alloc.bytes_per_page * pages


class _RefusedLayers:
    """An entry of the allocator table for a layer type kvblocks cannot hold: building it raises
    :class:`NotSupportedError` naming the type, and records the refusal on the active context
    (transformers may build the cache in its own thread, where the error is only logged)."""

    kind = ""
    supports_block_table = False  # read by transformers before the cache is built
    supports_block_sharing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise refused(
            "transformers_cb serves full-attention and sliding-window layers; this model has "
            f"{self.kind!r} layers ({_WHY.get(self.kind, 'unknown to kvblocks')}), which it "
            "cannot hold; run this model without transformers_cb.enabled()"
        )


def refused(message: str) -> NotSupportedError:
    """A :class:`NotSupportedError` for a cache kvblocks cannot build, recorded on the active
    context (transformers may build the cache in its own thread, where the error is only
    logged); leaving ``enabled()`` raises it."""
    exc = NotSupportedError(message)
    kb = _ACTIVE
    if kb is not None and kb.build_error is None:
        kb.build_error = exc
    return exc


def _refusals() -> Dict[str, type]:
    return {
        kind: type(f"_Refused_{kind}", (_RefusedLayers,), {"kind": kind})
        for kind in _WHY
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION)
    }


_LOCK = threading.Lock()
_ACTIVE: Optional[KVBlocksCB] = None


@contextlib.contextmanager
def enabled(
    enable_prefix_caching: bool = True,
    *,
    hash_key: Any = None,
    enable_kv_events: bool = False,
    native_step: bool = True,
) -> Iterator[KVBlocksCB]:
    """Inside the ``with`` block, every transformers continuous-batching cache built allocates its
    blocks through kvblocks; transformers' own classes are restored on exit, also on an error.

    ``enable_prefix_caching`` turns kvblocks' prefix cache on (transformers'
    ``ContinuousBatchingConfig.allow_block_sharing=False`` turns it off too); ``hash_key`` (16
    bytes) and ``enable_kv_events`` go to the :class:`kvblocks.BlockPool`. Raises
    :class:`NotSupportedError` for an unsupported transformers version and
    :class:`InvalidStateError` when nested. If a cache build was refused inside the block (a
    model with chunked-attention or linear-attention layers), leaving the block raises that
    error, even where transformers only logged it in its generation thread.

    ``native_step`` (default) is stage 2: a :class:`kvblocks.BlockManager` holds the block
    tables and each step's ``read_index`` / ``write_index`` (or decode block table) come from
    one native ``row_indices`` call instead of transformers' per-request Python loop (see
    :mod:`kvblocks.integrations.transformers_cb_step`). ``native_step=False`` is stage 1:
    kvblocks hands out, shares, caches and frees the blocks; transformers builds the indices.
    """
    global _ACTIVE
    check_version()
    if _IMPORT_PROBLEM is not None:  # pragma: no cover - version patched after import
        raise NotSupportedError(_IMPORT_PROBLEM)
    kb = KVBlocksCB(enable_prefix_caching, hash_key, enable_kv_events, native_step)
    from . import step
    from .window import KVBlocksWindowAllocator

    with _LOCK:
        if _ACTIVE is not None:
            raise InvalidStateError(
                "transformers_cb.enabled() is already active (contexts do not nest)"
            )
        saved = (_cb_cache.ATTN_TYPE_TO_ALLOCATOR, _cb_cache.CachePool)
        saved_init_table = _cb_init.ATTN_TYPE_TO_ALLOCATOR
        saved_prepare = step.ContinuousBatchingIOs.prepare_batch_tensors
        table: Dict[str, Any] = dict(saved[0])
        table.update(_refusals())
        table[FULL_ATTENTION] = step.KVBlocksStepAllocator if native_step else KVBlocksAllocator
        table[SLIDING_ATTENTION] = KVBlocksWindowAllocator
        _cb_cache.ATTN_TYPE_TO_ALLOCATOR = table
        _cb_init.ATTN_TYPE_TO_ALLOCATOR = table  # read there for supports_block_table
        _cb_cache.CachePool = KVBlocksCachePool  # type: ignore[misc]  # the seam
        step.ContinuousBatchingIOs.prepare_batch_tensors = step.prepare_batch_tensors  # type: ignore[method-assign]  # the step seam
        _ACTIVE = kb
    raised = False
    try:
        yield kb
    except BaseException:
        raised = True
        raise
    finally:
        with _LOCK:
            _cb_cache.ATTN_TYPE_TO_ALLOCATOR, _cb_cache.CachePool = saved  # type: ignore[misc]
            _cb_init.ATTN_TYPE_TO_ALLOCATOR = saved_init_table
            step.ContinuousBatchingIOs.prepare_batch_tensors = saved_prepare  # type: ignore[method-assign]
            _ACTIVE = None
        if not raised and kb.build_error is not None:
            raise kb.build_error
