"""The state of one ``transformers_cb.enabled()`` block: :class:`KVBlocksCB` (what it yields),
the active block (the caches transformers builds find it here) and the refusals recorded on it."""

from __future__ import annotations

import dataclasses
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from ... import BlockManager, BlockPool
from ...errors import NotSupportedError
from ...groups import UNSUPPORTED_LAYERS as _WHY
from ...stats import CacheStats
from .compat import FULL_ATTENTION, SLIDING_ATTENTION

if TYPE_CHECKING:  # annotations only
    from .pool import KVBlocksCachePool


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


_LOCK = threading.Lock()
_ACTIVE: Optional[KVBlocksCB] = None


def active() -> Optional[KVBlocksCB]:
    """The context of the ``enabled()`` block in force (None outside one)."""
    return _ACTIVE


def refused(message: str) -> NotSupportedError:
    """A :class:`NotSupportedError` for a cache kvblocks cannot build, recorded on the active
    context (transformers may build the cache in its own thread, where the error is only
    logged); leaving ``enabled()`` raises it."""
    exc = NotSupportedError(message)
    kb = _ACTIVE
    if kb is not None and kb.build_error is None:
        kb.build_error = exc
    return exc


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


def _refusals() -> Dict[str, type]:
    return {
        kind: type(f"_Refused_{kind}", (_RefusedLayers,), {"kind": kind})
        for kind in _WHY
        if kind not in (FULL_ATTENTION, SLIDING_ATTENTION)
    }
