"""vLLM's ``BlockPool`` surface over kvblocks' native pool: what vLLM's scheduler and
tests read of the pool (``block_pool.blocks[i]``, ``free_block_queue``, the prefix-cache map,
``get_cached_block``, ``touch``, ``free_blocks``, ``cache_full_blocks``, events), for the
adapters in manager.py and hybrid.py. Views only: every call goes to the adapter's state."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

import kvblocks

if TYPE_CHECKING:
    from .state import _BlockView, _NativeState


class _FreeEnd:
    """vLLM's ``fake_free_list_head`` / ``fake_free_list_tail`` over the native free list."""

    def __init__(self, q: _FreeQueueView, head: bool) -> None:
        self._q = q
        self._head = head

    @property
    def next_free_block(self) -> Any:
        return self._q._neighbour(None, +1) if self._head else None

    @property
    def prev_free_block(self) -> Any:
        return None if self._head else self._q._neighbour(None, -1)


class _FreeQueueView:
    """vLLM's ``free_block_queue``, read from the native free list (O(free) per walk
    step: for tests and debugging, not the scheduler's path)."""

    def __init__(self, state: _NativeState) -> None:
        self._s = state
        self.fake_free_list_head = _FreeEnd(self, True)
        self.fake_free_list_tail = _FreeEnd(self, False)

    def _neighbour(self, block_id: Optional[int], step: int) -> Any:
        order = self._s.pool.free_list().tolist()
        if block_id is None:
            i = -1 if step > 0 else len(order)
        elif block_id in order:
            i = order.index(block_id)
        else:
            return None
        j = i + step
        if j < 0:
            return self.fake_free_list_head
        if j >= len(order):
            return self.fake_free_list_tail
        return self._s.view(order[j])

    @property
    def num_free_blocks(self) -> int:
        return int(self._s.pool.num_free)

    def get_all_free_blocks(self) -> list:
        return [self._s.view(b) for b in self._s.pool.free_list().tolist()]


class _CacheMapView:
    """Read-only view of vLLM's ``cached_block_hash_to_block``."""

    def __init__(self, state: _NativeState) -> None:
        self._s = state

    def _key(self, key: bytes) -> Optional[int]:
        return self._s.lookup_one(bytes(key[:-4]), int.from_bytes(key[-4:], "big"))

    def get_one_block(self, key: bytes) -> Optional[_BlockView]:
        b = self._key(key)
        return None if b is None else self._s.view(b)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, bytes) and self._key(key) is not None

    def __len__(self) -> int:
        return len(self._s.hash_of)

    def pop(self, key: bytes, block_id: int) -> Optional[_BlockView]:
        """vLLM's ``BlockHashToBlockMap.pop(key, block_id)``: hides block_id's entry under
        key when it holds it (as ``del _cache[key]``: the native entry stays, lookups and
        the block's ``block_hash`` miss it, no event); None otherwise."""
        s, b = self._s, int(block_id)
        if not 0 < b < s.num_blocks or s.hash_of.get(b) != bytes(key[:-4]):
            return None
        if int(s.gid[b]) != int.from_bytes(key[-4:], "big"):
            return None
        s.hash_of.pop(b)
        return s.view(b)

    @property
    def _cache(self) -> Any:
        # an empty map is a plain (empty, so untracked by the cyclic GC) dict, as vLLM's
        return _CacheDict(self._s) if len(self._s.hash_of) else {}


class _CacheDict(MutableMapping):
    """vLLM's ``cached_block_hash_to_block._cache`` (hash + group id -> block id, as vLLM
    0.34 keeps it) over the native table. vLLM's tests pop entries to stage a miss and put
    them back: ``pop`` hides
    the entry (the block keeps its native entry and place; lookups and its ``block_hash``
    miss it, no event) and setting the key to the same block shows it again. ``copy.copy``
    gives a plain dict snapshot."""

    def __init__(self, state: _NativeState) -> None:
        self._s = state

    def _items(self) -> dict:
        """hash + group id -> the block lookups return for it (the earliest of a key's
        duplicates: vLLM's ``_cache`` holds that one, its ``_dup_ids`` the others)."""
        s = self._s
        gid = s.gid
        out: dict = {}
        for b, h in s.hash_of.items():
            g = int(gid[b])
            key = make_block_hash_with_group_id(h, g)
            if key not in out:
                first = s.lookup_one(h, g)
                out[key] = b if first is None else first
        return out

    def __getitem__(self, key: bytes) -> int:
        b = self._s.lookup_one(bytes(key[:-4]), int.from_bytes(key[-4:], "big"))
        if b is None:
            raise KeyError(key)
        return b

    def __setitem__(self, key: bytes, block: Any) -> None:  # a block id (or a block)
        """Shows a popped entry again: the block must still hold the key natively (its
        first key, with the group's salt); anything else is refused, nothing changed."""
        s, h = self._s, bytes(key[:-4])
        b = int(getattr(block, "block_id", block))
        g = int.from_bytes(key[-4:], "big")
        if not 0 < b < s.num_blocks or not s.hashed[b] or int(s.gid[b]) != g:
            raise NotImplementedError("kvblocks' vLLM pool: only a popped entry can be set back")
        own = s.to_keys([h])[0].copy()
        salt = getattr(s, "salt", None)  # (hybrid states key group g with its salt)
        if salt is not None:
            own[1] ^= salt[g]
        if not (s.pool.keys_of(b)[0] == own).all():
            raise NotImplementedError("kvblocks' vLLM pool: only a popped entry can be set back")
        if len(h) == 32:
            s.full[b] = np.frombuffer(h, dtype=np.uint64)
        else:
            s.hash_of.update([(b, h)])

    def __delitem__(self, key: bytes) -> None:
        b = self[key]
        self._s.hash_of.pop(b)  # hidden: the native entry stays (as evict_blocks)

    def __iter__(self) -> Iterator:
        return iter(self._items())

    def __len__(self) -> int:
        return len(self._s.hash_of)

    def __copy__(self) -> dict:
        return self._items()


class _BlocksView(Sequence):
    def __init__(self, state: _NativeState) -> None:
        self._s = state

    def __len__(self) -> int:
        return self._s.num_blocks

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self._s.view(b) for b in range(*i.indices(self._s.num_blocks))]
        if i < 0:
            i += self._s.num_blocks
        if not 0 <= i < self._s.num_blocks:
            raise IndexError(i)
        return self._s.view(i)

    def __iter__(self) -> Iterator[_BlockView]:
        return (self._s.view(b) for b in range(self._s.num_blocks))


class NativeBlockPoolView:
    """The ``BlockPool`` surface the scheduler and vLLM's tests read, over the native pool."""

    def __init__(self, state: _NativeState, hash_block_size: int) -> None:
        self._s = state
        self.num_gpu_blocks = state.num_blocks
        self.enable_caching = state.enable_caching
        self.enable_kv_cache_events = state.enable_events
        self.hash_block_size = hash_block_size
        self.medium = state.medium
        self.null_block = state.view(0)
        self.blocks = _BlocksView(state)
        self.free_block_queue = state.free_queue = _FreeQueueView(state)
        self.cached_block_hash_to_block = _CacheMapView(state)

    @property
    def native(self) -> kvblocks.BlockPool:
        """The kvblocks pool behind this view."""
        return self._s.pool

    def get_num_free_blocks(self) -> int:
        return int(self._s.pool.num_free)

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        return 0 if not total else 1.0 - self._s.pool.num_free / total

    def get_new_blocks(self, num_blocks: int) -> list:
        return [self._s.view(b) for b in self._s.allocate(num_blocks).tolist()]

    def touch(self, blocks: Sequence[Any]) -> None:
        ids = np.array([b.block_id for b in blocks if not b.is_null], dtype=np.int32)
        if len(ids):
            self._s.pool.touch(ids)  # vLLM's touch: free blocks too, cached or not

    def free_blocks(self, ordered_blocks: Iterable[Any], evict_first: bool = False) -> None:
        ids = np.array([b.block_id for b in ordered_blocks if not b.is_null], dtype=np.int32)
        if evict_first:  # every block reaching 0 to the head, the batch in the given order
            self._s.pool.free_to(ids, "head")
        else:
            self._s.release(ids)

    def get_cached_block(self, block_hash: bytes, kv_cache_group_ids: list) -> Any:
        out = []
        for g in kv_cache_group_ids:
            b = self._s.lookup_one(block_hash, g)
            if b is None:
                return None
            out.append(self._s.view(b))
        return out

    def evict_blocks(self, block_ids: set) -> None:
        self._s.evict(block_ids)

    def move_block_hashes(self, src_block: Any, dst_block: Any) -> None:
        """vLLM's ``BlockPool.move_block_hashes``: src's entry re-pointed to dst, one native
        call (``BlockPool.move_entry``); no event."""
        self._s.move(int(src_block.block_id), int(dst_block.block_id))

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Sequence[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Optional[list] = None,
    ) -> None:
        """vLLM's ``BlockPool.cache_full_blocks`` (hybrid pools: the per-group cache)."""
        if num_cached_blocks >= num_full_blocks:
            return
        ids = [b.block_id for b in blocks[num_cached_blocks:num_full_blocks]]
        if block_mask is not None:
            ids = [b if keep else 0 for b, keep in zip(ids, block_mask)]
        self._s.cache_ids(request, kv_cache_group_id, ids, num_cached_blocks, num_full_blocks)

    def cache_partial_block(
        self,
        request: Any,
        block: Any,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Any:
        """vLLM's ``BlockPool.cache_partial_block`` (pools whose entries carry token counts:
        groups of different block sizes, partial hash hits): block keyed at a hash-block
        boundary inside it, its entries dropped first when ``replace_existing_hashes``."""
        s: Any = self._s  # (a hybrid state: the only kind whose ntok is kept)
        b = int(block.block_id)
        if b == 0:
            return None
        if s.ntok is None:
            raise NotImplementedError("kvblocks: partial entries among one block size")
        if replace_existing_hashes and s.hashed[b]:
            s.drop_entries(b)
        h = s.cache_partial(request, kv_cache_group_id, b, num_tokens)
        return make_block_hash_with_group_id(h, kv_cache_group_id)

    def reset_prefix_cache(self) -> bool:
        return self._s.reset()

    def take_events(self) -> list:
        if not self._s.enable_events:
            return []
        ev, self._s.events = self._s.events, []
        return ev

    @property
    def kv_event_queue(self) -> list:
        return self._s.events
