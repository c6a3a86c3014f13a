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
sliding layers, see :mod:`kvblocks.integrations.transformers_cb.window`). Other layer types
(chunked local attention, linear attention / recurrent state, ...) are refused with
:class:`~kvblocks.errors.NotSupportedError` naming them.

Modules: :mod:`.compat` (supported versions, transformers' private names), :mod:`.context` (the
state of one ``enabled()`` block), :mod:`.pool` (the block pool), :mod:`.allocator` (stage 1),
:mod:`.step` (stage 2, the step protocol: indices from ``plan_step``), :mod:`.window`
(sliding-window layers); this module installs them. Layer types map onto KV cache groups through
:mod:`kvblocks.groups`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator

from ...errors import InvalidStateError, NotSupportedError
from . import context, step
from .allocator import KVBlocksAllocator
from .compat import (
    _IMPORT_PROBLEM,
    FULL_ATTENTION,
    SLIDING_ATTENTION,
    SUPPORTED_TRANSFORMERS,
    _cb_cache,
    _cb_init,
    check_version,
)
from .context import KVBlocksCB, refused
from .pool import KVBlocksCachePool
from .window import KVBlocksWindowAllocator

__all__ = ["KVBlocksCB", "SUPPORTED_TRANSFORMERS", "check_version", "enabled"]
__all__ += ["KVBlocksAllocator", "KVBlocksCachePool", "refused"]  # the seam's classes


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
    one native plan (``plan_step``, then ``StepPlan.rows`` per group) instead of transformers' per-request Python loop (see
    :mod:`kvblocks.integrations.transformers_cb.step`). ``native_step=False`` is stage 1:
    kvblocks hands out, shares, caches and frees the blocks; transformers builds the indices.
    """
    check_version()
    if _IMPORT_PROBLEM is not None:  # pragma: no cover - version patched after import
        raise NotSupportedError(_IMPORT_PROBLEM)
    kb = KVBlocksCB(enable_prefix_caching, hash_key, enable_kv_events, native_step)
    with context._LOCK:
        if context._ACTIVE is not None:
            raise InvalidStateError(
                "transformers_cb.enabled() is already active (contexts do not nest)"
            )
        saved = (_cb_cache.ATTN_TYPE_TO_ALLOCATOR, _cb_cache.CachePool)
        saved_init_table = _cb_init.ATTN_TYPE_TO_ALLOCATOR
        saved_prepare = step.ContinuousBatchingIOs.prepare_batch_tensors
        table: Dict[str, Any] = dict(saved[0])
        table.update(context._refusals())
        table[FULL_ATTENTION] = step.KVBlocksStepAllocator if native_step else KVBlocksAllocator
        table[SLIDING_ATTENTION] = KVBlocksWindowAllocator
        _cb_cache.ATTN_TYPE_TO_ALLOCATOR = table
        _cb_init.ATTN_TYPE_TO_ALLOCATOR = table  # read there for supports_block_table
        _cb_cache.CachePool = KVBlocksCachePool  # type: ignore[misc]  # the seam
        step.ContinuousBatchingIOs.prepare_batch_tensors = step.prepare_batch_tensors  # type: ignore[method-assign]  # the step seam
        context._ACTIVE = kb
    raised = False
    try:
        yield kb
    except BaseException:
        raised = True
        raise
    finally:
        with context._LOCK:
            _cb_cache.ATTN_TYPE_TO_ALLOCATOR, _cb_cache.CachePool = saved  # type: ignore[misc]
            _cb_init.ATTN_TYPE_TO_ALLOCATOR = saved_init_table
            step.ContinuousBatchingIOs.prepare_batch_tensors = saved_prepare  # type: ignore[method-assign]
            context._ACTIVE = None
        if not raised and kb.build_error is not None:
            raise kb.build_error
