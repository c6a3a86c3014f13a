"""The native state behind kvblocks' vLLM adapters (manager.py, hybrid.py): one
``kvblocks.BlockPool`` (duplicate entries under one key native), the mirrors of vLLM's
per-block hash and group, vLLM-shaped events, and the ``KVCacheBlock`` / ``KVCacheBlocks``
views handed to vLLM."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any, Optional

import numpy as np
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VLLMKVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    make_block_hash_with_group_id,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.request import RequestStatus

import kvblocks

logger = logging.getLogger("kvblocks.integrations.vllm.manager")  # one logger for the adapter

_EMPTY_I32 = np.empty(0, dtype=np.int32)
_ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)  # the watermark applies


class _BlockView:
    """A ``KVCacheBlock``-shaped view of one native block: ``block_id``, ``ref_cnt`` (read
    from and written to the native pool), ``block_hash`` (vLLM's hash + group id)."""

    __slots__ = ("_s", "block_id", "__weakref__")

    def __init__(self, state: _NativeState, block_id: int) -> None:
        self._s = state
        self.block_id = block_id

    @property
    def is_null(self) -> bool:
        return self.block_id == 0

    @property
    def ref_cnt(self) -> int:
        return 0 if self.block_id == 0 else int(self._s.pool.ref_count(self.block_id))

    @ref_cnt.setter
    def ref_cnt(self, value: int) -> None:
        cur = self.ref_cnt
        ids = np.array([self.block_id], dtype=np.int32)
        for _ in range(value - cur):
            self._s.pool.touch(ids)
        for _ in range(cur - value):
            self._s.release(ids)

    @property
    def block_hash(self) -> Optional[bytes]:
        h = self._s.hash_of.get(self.block_id)
        return (
            None if h is None else make_block_hash_with_group_id(h, int(self._s.gid[self.block_id]))
        )

    @property
    def block_hash_num_tokens(self) -> Optional[int]:
        b = self.block_id
        if b not in self._s.hash_of:
            return None
        ntok = self._s.ntok  # (groups of different block sizes: every entry's count)
        if ntok is not None:
            return int(ntok[b])
        e = self._s.hash_tokens.get(b)  # (group, tokens): current while the group matches
        return e[1] if e is not None and e[0] == int(self._s.gid[b]) else self._s.block_size

    @property
    def pool(self) -> Any:
        return None

    @property
    def next_free_block(self) -> Any:
        return self._s.free_queue._neighbour(self.block_id, +1)

    @property
    def prev_free_block(self) -> Any:
        return self._s.free_queue._neighbour(self.block_id, -1)

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"_block_hash={self.block_hash!r})"
        )


class NativeKVCacheBlocks(VLLMKVCacheBlocks):
    """vLLM's ``KVCacheBlocks`` over id arrays: ``get_block_ids`` reads the ids directly; the
    per-block views of ``blocks`` are made on first access."""

    _nulls: Optional[list] = None  # per group, how many leading ids are null (when known)

    def __init__(self, state: _NativeState, ids: Sequence[Any]) -> None:  # one array per group
        self._state = state
        self._ids = ids
        self._blocks: Optional[tuple] = None

    @property
    def blocks(self) -> tuple:
        if self._blocks is None:
            view = self._state.view
            self._blocks = tuple([view(int(b)) for b in ids] for ids in self._ids)
        return self._blocks

    def get_block_ids(self, allow_none: bool = False, *, group_ids: Any = None) -> Any:
        groups = self._ids if group_ids is None else tuple(self._ids[g] for g in group_ids)
        if allow_none and all(len(g) == 0 for g in groups):
            return None
        return tuple(g.tolist() if isinstance(g, np.ndarray) else list(g) for g in groups)

    def __len__(self) -> int:
        return len(self._ids)


_ZERO32 = bytes(32)  # a row of ``full`` without a hash


class _HashMirror:
    """Block id -> vLLM block hash (group 0) of the blocks whose hash vLLM would show: read
    from ``full`` (32-byte hashes, written natively) or, for other widths, a dict. A block
    has one while it holds a native entry (``hashed``) that ``evict`` did not drop."""

    def __init__(self, state: _NativeState) -> None:
        self._s = state
        self._other: dict[int, bytes] = {}  # hashes of other widths than 32

    def get(self, b: int, default: Optional[bytes] = None) -> Optional[bytes]:
        s = self._s
        if not s.hashed[b]:
            return default
        h = self._other.get(b)
        if h is not None:
            return h
        h = s.full[b].tobytes()  # (a bytes compare: cheaper than ndarray.any())
        return h if h != _ZERO32 else default

    def __contains__(self, b: object) -> bool:
        return isinstance(b, (int, np.integer)) and self.get(int(b)) is not None

    def pop(self, b: int, default: Optional[bytes] = None) -> Optional[bytes]:
        h = self.get(b)
        self._other.pop(b, None)
        self._s.full[b] = 0
        return default if h is None else h

    def update(self, pairs: Iterable[tuple]) -> None:
        self._other.update(pairs)

    def clear(self) -> None:
        self._other.clear()
        self._s.full[:] = 0

    def items(self) -> list:
        out = []
        for b in np.flatnonzero(self._s.hashed).tolist():
            h = self.get(b)
            if h is not None:
                out.append((b, h))
        return out

    def __len__(self) -> int:
        return len(self.items())


class _NativeState:
    """The native pool and the request tables of one full-attention group."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        enable_events: bool,
        medium: str,
    ) -> None:
        self.pool = kvblocks.BlockPool(num_blocks, enable_prefix_caching=enable_caching)
        self.refs = self.pool.ref_counts()  # live read-only view of the native ref counts
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.enable_events = enable_events
        self.medium = medium
        self.req: dict[str, list[int]] = {}  # request id -> block ids, in order
        self.num_cached: dict[str, int] = {}  # request id -> leading cached blocks
        # request id -> (request, keys, tails): the native keys (n, 2) of the request's block
        # hashes and, for 32-byte hashes, their other 16 bytes (n, 2), which every hit is
        # checked against; rebuilt when another Request object comes under the same id
        self.keys: dict[str, tuple] = {}
        # block -> its 32-byte vLLM hash (0 when it has none, or it was evicted): written by
        # the native cache_bytes, checked by the native lookup_bytes
        self.full = np.zeros((num_blocks, 4), dtype=np.uint64)
        self.hashed = np.zeros(num_blocks, dtype=np.bool_)  # mirror: native cache entry
        self.hash_of = _HashMirror(self)  # block id -> vLLM block hash (group 0)
        # vLLM lets several blocks hold one hash (a prompt computed again while its blocks are
        # cached: the hit stops one block short of the prompt); lookups return the earliest.
        # The native pool keeps them so (cache(..., dup=True), cache_bytes(..., dup=True)):
        # every block has its own entry and events, and lookups give the earliest remaining.
        # block -> the KV cache group its cache entry belongs to (vLLM's group id in the key)
        self.gid = np.zeros(num_blocks, dtype=np.uint8)
        # blocks evict() uncached while requests held them: while any is, frees take the
        # general path (free_in_order), since a table's cached part may have a hole
        self.uncached_held: set[int] = set()
        # block -> (group, the tokens its entry covers: vLLM's block_hash_num_tokens), kept
        # for the groups whose rules read it (Mamba in align mode: hybrid_state.py); a block
        # cached since in another group reads block_size, as every other block
        self.hash_tokens: dict[int, tuple[int, int]] = {}
        # block -> the tokens its first entry covers, for every block, when the groups have
        # different block sizes (hybrid_state.py: a partial prompt tail's entry reads its
        # boundary); None otherwise
        self.ntok: Optional[np.ndarray] = None
        # vLLM's num_hash_lookahead_tokens: each block hash covers this many tokens past
        # the block (the events carry them and their extra keys)
        self.lookahead = 0
        # block -> its keys after the first (vLLM's partial-prefix entries, hybrid_state.py)
        self.sec: dict[int, list[bytes]] = {}
        self.events: list[Any] = []
        self._views: dict[int, _BlockView] = {}
        self.free_queue: Any = None  # the _FreeQueueView, set by NativeBlockPoolView

    # -- views --------------------------------------------------------------------------------
    def view(self, block_id: int) -> _BlockView:
        v = self._views.get(block_id)
        if v is None:
            v = self._views[block_id] = _BlockView(self, block_id)
        return v

    # -- keys ---------------------------------------------------------------------------------
    @staticmethod
    def to_keys(hashes: Sequence[bytes]) -> np.ndarray:
        """Native 128-bit keys of vLLM's bytes hashes: their first 16 bytes."""
        n = len(hashes)
        if n == 0:
            return np.empty((0, 2), dtype=np.uint64)
        width = len(hashes[0])
        raw = b"".join(hashes)
        if width >= 16 and width % 8 == 0 and len(raw) == n * width:
            return np.array(np.frombuffer(raw, dtype=np.uint64).reshape(n, width // 8)[:, :2])
        if width >= 16 and len(raw) == n * width:
            b = np.frombuffer(raw, dtype=np.uint8).reshape(n, width)[:, :16]
        else:  # short or mixed widths: pad each to 16 bytes
            b = np.frombuffer(
                b"".join(bytes(h[:16]).ljust(16, b"\0") for h in hashes), dtype=np.uint8
            ).reshape(n, 16)
        return b.copy().view(np.uint64)  # a writable, contiguous copy

    @staticmethod
    def to_keys_tails(hashes: Sequence[bytes]) -> tuple:
        """(keys, tails) of 32-byte hashes (tails: bytes 16..31); (keys, None) otherwise."""
        n = len(hashes)
        if n and len(hashes[0]) == 32:
            raw = b"".join(hashes)
            if len(raw) == 32 * n:
                w = np.frombuffer(raw, dtype=np.uint64).reshape(n, 4)
                return np.array(w[:, :2]), np.array(w[:, 2:])
        return _NativeState.to_keys(hashes), None

    def request_keys(self, request: Any, n: int) -> tuple:
        """(keys, tails) of the request's first n block hashes (kept per request, extended
        as its hashes grow)."""
        kt = self.keys.get(request.request_id)
        if kt is not None and kt[0] is not request:  # another request under the same id
            kt = None
        if kt is None or len(kt[1]) < n:
            start = 0 if kt is None else len(kt[1])
            k, t = self.to_keys_tails(request.block_hashes[start:n])
            if kt is not None:
                k = np.concatenate((kt[1], k))
                t = None if t is None or kt[2] is None else np.concatenate((kt[2], t))
            kt = self.keys[request.request_id] = (request, k, t)
        return kt[1][:n], None if kt[2] is None else kt[2][:n]

    # -- pool operations ----------------------------------------------------------------------
    def lookup(
        self,
        hashes: Sequence[bytes],
        n: int,
        keys: Optional[np.ndarray] = None,
        tails: Optional[np.ndarray] = None,
    ) -> np.ndarray:
        """Ids of the longest cached prefix of hashes[:n], not pinned (vLLM's phase 1);
        ``keys`` their native keys when known."""
        if n <= 0 or not self.enable_caching:
            return _EMPTY_I32
        if keys is None and type(hashes) is list and len(hashes[0]) == 32:
            try:
                return self._lookup32(hashes, n)
            except kvblocks.InvalidArgumentError:  # mixed widths: the general path
                pass
        if keys is None:
            keys = self.to_keys(hashes[:n])
        hit = self.pool.lookup(keys)  # the earliest block of each key (duplicates natively)
        k = len(hit)
        if tails is not None:  # the other half of each hit's hash (0 once evicted)
            ok = (self.full[hit, 2:] == tails[:k]).all(axis=1)
            if not ok.all():
                k = int(np.argmin(ok))
        else:
            hash_of = self.hash_of
            for i, b in enumerate(hit.tolist()):  # exact bytes check (and evict_blocks)
                if hash_of.get(b) != hashes[i]:
                    k = i
                    break
        return hit[:k]

    def cache_ids(self, request: Any, g: int, ids_l: list, c: int, num_full: int) -> None:
        """vLLM's BlockPool.cache_full_blocks (the group pools of hybrid.py have it)."""
        raise NotImplementedError("kvblocks' vLLM pool: cache_full_blocks on a one-group pool")

    def lookup_one(self, h: bytes, g: int) -> Optional[int]:
        """The block vLLM's map gives for hash h in group g (the earliest), or None."""
        if g != 0:
            return None
        hit = self.lookup([h], 1)
        return int(hit[0]) if len(hit) else None

    def _lookup32(self, hashes: list, n: int) -> np.ndarray:
        """``lookup`` of 32-byte hashes: keys and the full-width check in one native call."""
        return self.pool.lookup_bytes(hashes, n, full=self.full)

    def allocate(self, n: int) -> np.ndarray:
        """n new blocks (ref 1), popping the free list's head; evicted entries leave the
        table (with their BlockRemoved events, in pop order)."""
        if n <= 0:
            return _EMPTY_I32
        if n > self.pool.num_free:
            raise ValueError(f"Cannot get {n} free blocks from the pool")
        evictable = self.pool.num_evictable  # none: no popped block can hold an entry
        ids = self.pool.allocate(n)
        # a popped block that held an entry lowers num_evictable: none did when it is equal
        if evictable and self.enable_caching and self.pool.num_evictable != evictable:
            was = self.hashed[ids]
            if was.any():
                for b in ids[was].tolist():  # (the mirror reads hashed: clear it after)
                    self._forget(b)
                self.hashed[ids] = False
        return ids

    def _forget(self, b: int) -> None:
        """Drop block b's entry on this side (its mirrored hash, a BlockRemoved event)."""
        h = self.hash_of.pop(b, None)
        if h is None:
            return
        other = self.sec.pop(b, None) if self.sec else None  # its other keys (hybrid_state)
        if self.enable_events:
            g = int(self.gid[b])
            self.events.append(self._removed(h, g))
            if other:
                self.events.extend(self._removed(h2, g) for h2 in other)

    def _removed(self, h: bytes, g: int = 0) -> BlockRemoved:
        return BlockRemoved(
            block_hashes=[maybe_convert_block_hash(h)], medium=self.medium, group_idx=g
        )

    def release(self, ids_in_eviction_order: np.ndarray) -> None:
        """vLLM's ``free_blocks``: one reference less each; blocks reaching 0 without a cache
        entry go to the free list's front in the given order, cached ones to its back."""
        if len(ids_in_eviction_order):
            self.pool.free(ids_in_eviction_order, order="vllm")

    def cache(self, request: Any, num_tokens: int) -> None:
        """vLLM's ``cache_blocks`` for full attention: register the request's newly full
        blocks under its block hashes (one native call) and record one BlockStored."""
        rid = request.request_id
        num_cached = self.num_cached.get(rid, 0)
        hashes = request.block_hashes
        num_full = min(num_tokens, len(hashes) * self.block_size) // self.block_size
        if num_cached >= num_full:
            return
        # blocks past num_cached are the request's own (allocated, so without an entry)
        ids_l = self.req[rid][num_cached:num_full]
        hs = hashes[num_cached:num_full]
        if type(hashes) is list and len(hashes[0]) == 32:
            try:  # a key another block holds caches this one too, behind it (dup)
                self.pool.cache_bytes(
                    ids_l, hashes, num_cached, full=self.full, mark=self.hashed, dup=True
                )
            except kvblocks.InvalidArgumentError:  # mixed widths: the general path
                pass
            else:
                self.num_cached[rid] = num_full
                if self.enable_events:
                    self.events.append(self._stored(request, num_cached, num_full))
                return
        ids = np.array(ids_l, dtype=np.int32)
        keys, tails = self.request_keys(request, num_full)
        keys = keys[num_cached:num_full]
        if tails is not None:
            self.full[ids, :2] = keys
            self.full[ids, 2:] = tails[num_cached:num_full]
        self.pool.cache(ids, keys, dup=True)  # duplicates behind the keys' earlier blocks
        self.hashed[ids] = True
        self.hash_of.update(zip(ids.tolist(), hs))
        self.num_cached[rid] = num_full
        if self.enable_events:
            self.events.append(self._stored(request, num_cached, num_full))

    def _stored(
        self,
        request: Any,
        num_cached: int,
        num_full: int,
        group: int = 0,
        ids: Optional[Sequence[int]] = None,
        bs: int = 0,
        hashes: Optional[Sequence[bytes]] = None,
    ) -> BlockStored:
        """vLLM's BlockStored for blocks [num_cached, num_full) of a request in KV cache
        group ``group`` (the shape of BlockPool._build_block_stored_event); ``ids`` (the
        blocks of that range) leaves out the null blocks' hashes and extra keys, as vLLM's
        ``cache_full_blocks`` does for sliding-window tables; ``bs`` and ``hashes``: the
        group's block size and its hashes when they are not the pool's (groups of
        different block sizes)."""
        bs = bs or self.block_size
        if hashes is None:
            hashes = request.block_hashes
        extra: list = []
        mm_idx = 0
        if ids is None:
            pos: Sequence[int] = range(num_cached, num_full)
        else:
            pos = [num_cached + j for j, b in enumerate(ids) if b]
        la = self.lookahead
        for i in pos:
            if la:  # (vLLM's generate_event_extra_keys: the hash covers L tokens more)
                keys, mm_idx = generate_lookahead_block_hash_extra_keys(
                    request, i * bs, (i + 1) * bs, (i + 1) * bs + la, mm_idx
                )
            else:
                keys, mm_idx = generate_block_hash_extra_keys(request, i * bs, (i + 1) * bs, mm_idx)
            extra.append(keys)
        lora = request.lora_request
        return BlockStored(
            block_hashes=[maybe_convert_block_hash(hashes[i]) for i in pos],
            parent_block_hash=(
                None if num_cached == 0 else maybe_convert_block_hash(hashes[num_cached - 1])
            ),
            token_ids=request.all_token_ids[num_cached * bs : num_full * bs],
            block_size=bs,
            lora_id=lora.adapter_id if lora else None,
            medium=self.medium,
            lora_name=lora.name if lora else None,
            extra_keys=to_event_extra_keys(extra),
            group_idx=group,
            session_id=request.session_id,
            lookahead_token_ids=(
                [request.all_token_ids[(i + 1) * bs : (i + 1) * bs + la] for i in pos]
                if la
                else None
            ),
        )

    def evict(self, block_ids: Iterable[int]) -> None:
        """vLLM's ``evict_blocks``: drop the blocks' cache entries (in use or not), with a
        BlockRemoved each in the order given. A free block keeps its place in the free list;
        a referenced one, once freed, goes to the head as a block without an entry
        (``uncached_held`` lists them until then: the free paths take vLLM's general order
        while it is not empty). Every id is checked first (nothing changes on a bad one)."""
        ids = list(block_ids)
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise AssertionError(f"Invalid block_id {b} >= {self.num_blocks}.")
        for b in ids:
            self._forget(b)
        ids = [b for b in ids if b > 0 and self.pool.is_cached(b)]
        if not ids:
            return
        self.pool.uncache(ids)
        self.hashed[ids] = False
        self.uncached_held.update(b for b in ids if self.refs[b] > 0)

    def move(self, src: int, dst: int) -> None:
        """vLLM's ``move_block_hashes``: block src's cache entry moves to dst (a fresh copy of
        it, last among the key's duplicates), natively and in the mirrors; no event. A block
        without an entry moves nothing. A src a request still holds is listed in
        ``uncached_held`` (its table's cached part now has a hole)."""
        if self.hash_of.get(dst) is not None:  # vLLM asserts it first
            raise AssertionError(f"move_block_hashes: block {dst} already has a hash")
        if self.hash_of.get(src) is None:
            return
        self.pool.move_entry(src, dst)
        other = self.hash_of._other.pop(src, None)
        if other is not None:
            self.hash_of._other[dst] = other
        self.full[dst] = self.full[src]
        self.full[src] = 0
        n = self.hash_tokens.pop(src, None)
        if n is not None:
            self.hash_tokens[dst] = n
        if self.ntok is not None:
            self.ntok[dst] = self.ntok[src]
        keys = self.sec.pop(src, None)  # (natively move_entry moves every key)
        if keys is not None:
            self.sec[dst] = keys
        self.gid[dst] = self.gid[src]
        self.hashed[src] = False
        self.hashed[dst] = True
        if self.refs[src] > 0:
            self.uncached_held.add(src)

    def free_in_order(self, ordered: Sequence[int]) -> None:
        """vLLM's ``free_blocks(ordered)`` by the native cache entries, one native call
        (``free(..., order="vllm")``): blocks reaching 0 without an entry go to the free
        list's head as a batch in the given order, cached ones to its tail in that order.
        Forgets the ``uncached_held`` blocks it frees."""
        if not len(ordered):
            return
        self.pool.free(ordered, order="vllm")  # (a list or an int32 array, as given)
        if self.uncached_held:
            refs = self.refs
            self.uncached_held = {b for b in self.uncached_held if refs[b] > 0}

    def reset(self) -> bool:
        # vLLM's rule natively: False (nothing changed) while any block is in use; the free
        # list keeps its order
        if not self.pool.try_reset_prefix_cache(keep_order=True):
            logger.warning(
                "Failed to reset prefix cache because some blocks (%d) are not freed yet",
                self.num_blocks - 1 - self.pool.num_free,
            )
            return False
        self.hash_of.clear()
        self.hashed[:] = False
        self.sec.clear()
        self.uncached_held.clear()
        logger.info("Successfully reset prefix cache")
        if self.enable_events:
            self.events.append(AllBlocksCleared())
        return True


def _ids_of(blocks: Any) -> np.ndarray:
    """int32 ids of one group's computed blocks (a native array or KVCacheBlock objects)."""
    if isinstance(blocks, np.ndarray):
        return blocks
    if len(blocks) == 0:
        return _EMPTY_I32
    return np.array([b.block_id for b in blocks], dtype=np.int32)
