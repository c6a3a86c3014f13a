"""The executable specification of kvblocks' allocator: :class:`ReferencePool` and
:class:`ReferenceManager`, group-native (KV cache groups; one full-attention group, the
default, is G = 1 of the same rules).

This is the documented behaviour of :class:`kvblocks.BlockPool` and
:class:`kvblocks.BlockManager` (``shared/API.md``, ``docs/prefix-caching.md``,
``docs/engine-integration.md`` and the round-2 semantics: committed vs computed tokens,
copy-on-write pairs that hold their source, chain collapse, swap-out redirection, caching at
schedule time, speculative drafts), written as plain Python for people to read and for tests
to run side by side with the C core. It was written from those documents, not from the C
code, so that the two can disagree.

The policy is modelled exactly, so that block ids can be compared one for one:

* The free list is a list whose head (index 0) is allocated first. A block whose last
  reference goes away joins the HEAD if it holds no prefix-cache entry, the TAIL if it does
  (it is then *evictable*). Allocation pops from the head and drops (evicts) the cache entry of
  a cached block it takes. A block table is released tail first (last block first). With KV
  cache groups, a cached window or chunk block at the head whose
  full-attention twin is cached moves to the tail instead, once per stay in the free list
  (docs/hybrid-models.md, "Eviction across groups").
* Hashes are :func:`kvblocks.hash_blocks` (chained over full blocks, the salt in the root).
  A hash that is already cached keeps its block (first block wins).
* Where the documents leave an order open (which blocks :meth:`ReferencePool.reset_prefix_cache`
  puts where, or in which order the sources of dropped copies are released next to a table),
  the pool says so with ``free_order_known = False``: a test then compares the free list as a
  set and calls :meth:`ReferencePool.adopt_free_order` with the real order.

Errors are the types of :mod:`kvblocks.errors`. When a call breaks several rules at once the
documents do not say which one is reported; the reference raises the first it finds and lists
the types of the others in the exception's ``also_ok`` attribute (see :func:`same_error`).
Every failing call changes nothing (validate first, then mutate).

Choices where the round-2 text is open (each is repeated where it is made):

1. ``schedule`` / ``metadata`` refuse while ANY copy-on-write copy is pending (not only the
   copies of the scheduled sequences), and also for an empty batch.
2. Blocks become cached when computed: in ``schedule`` / ``metadata``, as ``add`` hits, at
   ``append(..., computed=True)`` (accepted drafts the last step wrote), and at ``swap_in``
   (computed full blocks; their content arrives with the swap pairs, which run before the
   next forward). ``swap_in`` shares again the computed full blocks still cached on the
   device instead of copying them.
3. Draft slots must exist (``reserve``) and lie in blocks the sequence may write in place
   (one holder, no cache entry), else ``InvalidStateError``; ``draft_lens[i] < 0`` is an
   ``InvalidArgumentError``. Any commit, ``truncate``, ``swap_out`` ends the draft window;
   ``fork`` children start without one.
4. "Shared" (a write needs copy-on-write) means held by more than one *sequence*: the
   references that pending copies hold on their source do not count. That is what makes
   "k sharers need k-1 copies" hold for sequential appends and for ``append_batch`` alike.
5. A pending copy is dropped when its destination block's reference count reaches 0. A copy
   whose destination another sequence still holds stays pending.
6. ``swap_out``'s pairs are in table order; for a block that is the destination of a pending
   copy the pair reads that copy's source (whether or not the copy is dropped).
7. ``blocks_needed`` of a swapped-out sequence is what swap_in takes (its blocks, less the
   ones shared again, plus evictable ones it pins) plus the growth for ``n`` tokens;
   ``can_append`` is False if any sequence is swapped out.
8. Sizes "beyond what can ever fit" (more than ``(num_blocks - 1) * block_size`` tokens in
   one sequence) make add / append / reserve raise ``OutOfBlocksError`` with ``also_ok`` =
   ``InvalidArgumentError`` (the spec allows either). Queries answer exactly (Python ints):
   ``blocks_needed`` / ``can_append`` / ``blocks_for_tokens`` of any size, ``can_add``
   inside int64 (beyond it: InvalidArgumentError, the spec's example); a core may refuse
   such sizes instead (tests allow InvalidArgumentError / OutOfBlocksError there).
9. An empty list is an empty token array; an empty ndarray must still have an integer dtype.

KV cache groups (``groups=``; ``shared/API.md`` "Hybrid models: KV cache groups",
``docs/hybrid-models.md``). The rules of a kind are stated once each (``_Kind`` for full
attention, sliding window and chunked local, which differ only in the first position a step
reads; ``_StateKind``); the manager runs them over every group, G = 1 included:

* One pool, one block size; a sequence has one table per group, all moved in lock step
  (same committed tokens). Each group keeps its own computed count, draft slots and
  pending copies (``metadata(group=g)`` declares the step for group g only).
* The release rule (``_Kind.keep_from``, applied by ``_release_skipped``): the next step's
  first query is ``q0 = min(computed, tokens - 1, query start)``. A sliding window W reads
  ``[q0 - W + 1, q0]``, a chunk C reads ``[q0 - q0 % C, q0]``, full attention and a state
  everything; whole blocks below that are released (entry -> null block 0, the reference
  dropped; a cached block stays evictable) when the sequence moves on: an append (for the
  longer sequence, only once the call is known to fit, in every group before any group
  allocates) and a step (``schedule`` / ``metadata``, with its query start).
* Blocks needed (``_Kind.need``): growth plus copy-on-write, every group. An append fits when
  they are at most the free blocks plus the blocks its release returns (entries this sequence
  alone holds); ``blocks_needed`` / ``can_append`` do not count that release (conservative).
* The longest cache hit (``_Kind.hit_from``): the longest block-aligned prefix (at most
  ``len - 1`` tokens) every group can serve. A full group needs all k blocks cached under its
  own group key; a window or chunk group the blocks from what the query at ``k * block_size``
  reads, and at least block k - 1; a state group no hit at all (no snapshots of the state).
* State groups: a fixed number of blocks per sequence, never released, no hashing; fork
  copies them at once (pairs in take_copies); truncate below the computed tokens and a step
  that reads released positions are refused. Draft slots are validated as in every kind:
  they must lie within the blocks a token group's table of the sequence holds (its tokens'
  blocks, grown by reserve, cut by truncate; a fork's child starts from its tokens' blocks).
* Order where ids depend on it: group after group, in the order given; within a group the
  single-group order above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import _core
from ..errors import (
    CorruptionError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from ..groups import KVGroup
from .readback import first_needed

__all__ = [
    "ReferencePool",
    "ReferenceManager",
    "ReferenceMetadata",
    "same_error",
    "seq_id_of",
    "scalar_of",
    "tokens_of",
]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MAX = 2**63 - 1


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
def _err(cls, msg, *also_ok):
    """An exception of ``cls``; ``also_ok`` lists other types the spec equally allows."""
    e = cls(msg)
    e.also_ok = tuple(also_ok)
    return e


def same_error(expected: BaseException, got: BaseException) -> bool:
    """Whether ``got`` (from the core) is an error the reference's ``expected`` allows."""
    return isinstance(got, (type(expected),) + tuple(getattr(expected, "also_ok", ())))


class _Rules:
    """Collects every rule a call breaks; ``check()`` raises the first one found and accepts
    the types of the others (the documents do not order them)."""

    def __init__(self) -> None:
        self.broken: List[BaseException] = []

    def add(self, cls, msg, *also_ok) -> None:
        self.broken.append(_err(cls, msg, *also_ok))

    def check(self) -> None:
        if self.broken:
            first: Any = self.broken[0]  # a kvblocks error carrying also_ok (see _err)
            first.also_ok = tuple(getattr(first, "also_ok", ())) + tuple(
                type(e) for e in self.broken[1:]
            )
            raise first


# ---------------------------------------------------------------------------------------------
# argument conversion: phase 1 of every call (the only phase that may run Python code)
# ---------------------------------------------------------------------------------------------
def seq_id_of(x):
    """A sequence id: ``int`` or ``str``. int subclasses and numpy integers become the exact
    int, str subclasses the exact str, without running any of their methods; bool, float,
    None, bytes and the rest raise InvalidTypeError."""
    t = type(x)
    if t is int or t is str:
        return x
    if isinstance(x, (bool, np.bool_)):
        raise _err(InvalidTypeError, f"sequence ids must be int or str, got {t.__name__}")
    if isinstance(x, int):
        return int.__index__(x)  # the base slot: the subclass' methods never run
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, str):
        return str.__str__(x)  # an exact copy; __hash__/__eq__ never run
    raise _err(InvalidTypeError, f"sequence ids must be int or str, got {t.__name__}")


def seq_ids_of(xs) -> List:
    """Sequence ids from any iterable (a generator is consumed exactly once)."""
    try:
        items = list(xs)
    except Exception as exc:  # the iterable's own code raised: any KVBlocksError will do
        raise _err(
            InvalidTypeError, f"seq_ids must be an iterable of ids: {exc!r}", KVBlocksError
        ) from None
    return [seq_id_of(x) for x in items]


def scalar_of(x, name: str, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
    """A count or size: int (or subclass, read without running its methods) or numpy integer;
    bool, float and anything else raise InvalidTypeError. With ``lo``/``hi``, a value outside
    them is refused at conversion (InvalidArgumentError), before any state is looked at: a
    count is never negative nor beyond int64. Other range checks are the caller's."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
        raise _err(InvalidTypeError, f"{name} must be an int, got {type(x).__name__}")
    v = x if type(x) is int else (int.__index__(x) if isinstance(x, int) else int(x))
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _err(InvalidArgumentError, f"{name} must be in [{lo}, {hi}], got {v}")
    return v


def tokens_of(x, name: str = "token_ids") -> np.ndarray:
    """A 1-D int32 array (a private copy) from an integer array, list or range, converted as
    ``numpy.asarray`` does (this runs ``__array__``: conversion phase). 2-D, bool, float and
    object arrays, and values outside int32, are refused (InvalidTypeError or
    InvalidArgumentError: either is allowed)."""
    bad = (InvalidTypeError, InvalidArgumentError)
    try:
        arr = np.asarray(x)
    except Exception as exc:  # e.g. __array__ raised: any KVBlocksError will do
        raise _err(
            InvalidTypeError, f"{name} must be a sequence of ints: {exc!r}", KVBlocksError
        ) from None
    if arr.ndim != 1:
        raise _err(InvalidArgumentError, f"{name} must be 1-D, got shape {arr.shape}", *bad)
    if arr.size == 0 and arr.dtype.kind in "iu":
        return np.zeros(0, dtype=np.int32)
    if arr.size == 0 and not isinstance(x, np.ndarray):
        return np.zeros(0, dtype=np.int32)  # [] has no dtype of its own
    if arr.dtype.kind not in "iu":
        raise _err(InvalidTypeError, f"{name} must hold integers, got {arr.dtype}", *bad)
    if int(arr.min()) < INT32_MIN or int(arr.max()) > INT32_MAX:
        raise _err(InvalidArgumentError, f"{name} holds values outside int32", *bad)
    return arr.astype(np.int32)


def salt_of(x) -> Union[None, str, bytes]:
    """The salt, normalized: None (no salt), an exact ``str`` (hashed as UTF-8 under the tag
    "s") or ``bytes`` (tag "b"). So "7" and b"7" are different salts and "" is not None.
    Anything else (ints included) is refused."""
    if x is None:
        return None
    if isinstance(x, str):
        text = str.__str__(x)
        try:
            text.encode()
        except UnicodeError as exc:
            raise _err(InvalidArgumentError, f"salt: {exc}", InvalidTypeError) from None
        return text
    if isinstance(x, (bytes, bytearray, memoryview)):
        return bytes(x)
    raise _err(InvalidTypeError, f"salt must be str or bytes, got {type(x).__name__}")


def hashes_of(x) -> List[int]:
    """128-bit block hashes from an ``(n, 2)`` uint64 array of [lo, hi] or a list of ints."""
    if isinstance(x, (list, tuple)) and x and isinstance(x[0], int):
        if any(isinstance(h, bool) or not isinstance(h, int) for h in x):
            raise _err(
                InvalidTypeError, "hashes: 128-bit unsigned ints expected", InvalidArgumentError
            )
        if not all(0 <= h < (1 << 128) for h in x):
            raise _err(InvalidArgumentError, "hashes: 128-bit unsigned ints expected")
        return [int(h) for h in x]
    try:
        arr = np.asarray(x)
    except Exception as exc:
        raise _err(InvalidTypeError, f"hashes: {exc!r}") from None
    if arr.size == 0:
        return []
    if arr.dtype != np.uint64:
        raise _err(InvalidTypeError, f"hashes must be uint64 [n, 2], got {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise _err(InvalidArgumentError, f"hashes must have shape [n, 2], got {arr.shape}")
    return [int(lo) | (int(hi) << 64) for lo, hi in arr.tolist()]


def _group_tuple(groups) -> Tuple[KVGroup, ...]:
    """The ``groups`` argument as BlockManager takes it (default: one full group)."""
    if groups is None:
        return (KVGroup("full"),)
    if isinstance(groups, (str, bytes, KVGroup)):
        raise _err(InvalidTypeError, "groups must be a sequence of KVGroup")
    try:
        gs = tuple(groups)
    except TypeError:
        raise _err(InvalidTypeError, "groups must be a sequence of KVGroup") from None
    if not gs or len(gs) > 255:
        raise _err(InvalidArgumentError, f"groups: 1 to 255 KVGroup, got {len(gs)}")
    if not all(isinstance(g, KVGroup) for g in gs):
        raise _err(InvalidTypeError, "groups must hold KVGroup")
    return gs


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------------------------
# the pool
# ---------------------------------------------------------------------------------------------
class ReferencePool:
    """Blocks with reference counts, one free list and a prefix cache (hash -> block).

    Block 0 is the null block: never handed out, freed or cached (a pool of the null block
    alone, ``num_blocks=1``, has nothing to allocate). A hash may hold several blocks when
    they were cached with ``dup=True`` (vLLM's duplicates): lookups give the earliest.
    """

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        num_blocks = scalar_of(num_blocks, "num_blocks")
        if num_blocks < 1:
            raise _err(InvalidArgumentError, f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref = [0] * num_blocks
        self._free: List[int] = list(range(1, num_blocks))  # index 0 is allocated first
        self._block_of: Dict[int, int] = {}  # hash -> cached block (the earliest cached)
        self._later: Dict[int, List[int]] = {}  # hash -> its duplicates after the earliest
        self._hash_of: Dict[int, int] = {}  # cached block -> hash
        self.evictions = 0  # cache entries dropped because allocation reused the block
        #: False after an operation whose free-list order the documents leave open
        self.free_order_known = True
        #: KV cache groups' eviction rule (set by the manager): True when the cached block
        #: at the head of the free list gets a second chance (moves to the tail) instead of
        #: being evicted, once per stay in the free list (``_spent``)
        self.second_chance: Optional[Callable[[int], bool]] = None
        self._spent: set = set()
        self._group_of: Dict[int, int] = {}  # hash -> the KV cache group that cached it

    # -- what tests compare -------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Allocatable now: never-cached free blocks plus evictable cached ones."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    @property
    def num_evictable(self) -> int:
        return sum(1 for b in self._hash_of if self._ref[b] == 0)

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - len(self._free)

    def ref_count(self, block_id) -> int:
        b = self._block_arg(block_id)
        return self._ref[b]

    def ref_counts(self) -> np.ndarray:
        return np.array(self._ref, dtype=np.int32)

    def free_list(self) -> np.ndarray:
        """Free blocks, next to be allocated first."""
        return np.array(self._free, dtype=np.int32)

    def is_cached(self, block_id) -> bool:
        return self._block_arg(block_id) in self._hash_of

    def block_hash(self, block_id) -> Optional[int]:
        return self._hash_of.get(self._block_arg(block_id))

    def cached(self) -> Dict[int, int]:
        """The prefix cache: ``{block: hash}``."""
        return dict(self._hash_of)

    def cached_blocks(self, h) -> np.ndarray:
        """Every block cached under hash ``h`` (an int or a ``[lo, hi]`` row), earliest
        first."""
        hv = h if isinstance(h, int) else int(hashes_of(np.asarray(h)[None])[0])
        first = self._block_of.get(hv)
        out = [] if first is None else [first, *self._later.get(hv, ())]
        return np.array(out, dtype=np.int32)

    def adopt_free_order(self, order: Iterable[int]) -> None:
        """Take the real pool's free-list order where the documents leave it open; the
        blocks must be the same set."""
        order = [int(b) for b in order]
        assert sorted(order) == sorted(self._free), (
            f"free blocks differ: real {sorted(order)}, reference {sorted(self._free)}"
        )
        self._free = order
        self.free_order_known = True

    # -- public calls -------------------------------------------------------------------------
    def allocate(self, n) -> np.ndarray:
        """``n`` blocks with one reference each, from the head of the free list."""
        n = scalar_of(n, "n", 0, INT64_MAX)
        if n < 0:
            raise _err(InvalidArgumentError, f"allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise _err(
                OutOfBlocksError,
                f"allocate({n}): {len(self._free)} free",
                *((InvalidArgumentError,) if n > INT32_MAX else ()),
            )
        return np.array(self._allocate(n), dtype=np.int32)

    def free(self, ids, order=None) -> None:
        """Drop one reference of each block, in the order given. ``order="vllm"``: vLLM's
        free_blocks: the blocks reaching 0 without an entry go to the head as one batch in
        the order they reach 0, cached ones to the tail in that order."""
        if order not in (None, "vllm"):
            raise _err(InvalidArgumentError, f"free: order must be None or 'vllm', not {order!r}")
        blocks = self._blocks_arg(ids)
        rules = _Rules()
        held: Dict[int, int] = {}
        for b in blocks:
            held[b] = held.get(b, 0) + 1
            if held[b] > self._ref[b]:
                rules.add(InvalidStateError, f"free: block {b} is not referenced")
        rules.check()
        if order is None:
            for b in blocks:
                self._release(b)
            return
        front: List[int] = []
        for b in blocks:
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self._hash_of:
                    self._free.append(b)
                else:
                    front.append(b)
        self._free[:0] = front

    def uncache(self, ids) -> int:
        """vLLM's evict_blocks: drop the entries of the listed blocks that have one (free ones
        keep their place in the free list); returns how many were dropped."""
        blocks = self._blocks_arg(ids)
        dropped = 0
        for b in blocks:
            if b in self._hash_of:
                self._drop_entry(b)
                dropped += 1
        return dropped

    def move_entry(self, src, dst) -> None:
        """vLLM's move_block_hashes: src's entry moves to dst (last among the hash's
        duplicates); no event."""
        s, d = self._blocks_arg([src, dst])
        rules = _Rules()
        if s == d:
            rules.add(InvalidArgumentError, "move_entry: src == dst")
        elif s not in self._hash_of or d in self._hash_of or self._ref[d] == 0:
            rules.add(InvalidStateError, "move_entry: src uncached, or dst cached or free")
        rules.check()
        h = self._hash_of[s]
        group = self._group_of.get(h, 0)
        self._drop_entry(s)
        self._register(d, h, group, dup=True)

    def try_reset_prefix_cache(self, *, keep_order: bool = False) -> bool:
        """vLLM's reset_prefix_cache: False (nothing changed) while any block is referenced,
        else every entry dropped and True."""
        if self.num_used:
            return False
        if self._hash_of and not keep_order:
            self.free_order_known = False
        self._block_of.clear()
        self._later.clear()
        self._hash_of.clear()
        return True

    def incref(self, ids) -> None:
        """One more reference on each block; an evictable cached block is pinned (leaves the
        free list). A free block without a cache entry cannot be shared."""
        blocks = self._blocks_arg(ids)
        rules = _Rules()
        for b in blocks:
            if self._ref[b] == 0 and b not in self._hash_of:
                rules.add(InvalidStateError, f"incref: block {b} is free")
        rules.check()
        for b in blocks:
            self._pin(b)

    def cache(self, ids, hashes, *, dup: bool = False, **_event_fields) -> int:
        """Register referenced blocks under their hashes; a hash already cached keeps its
        first block (``dup``: the later block is cached too, behind it). Returns how many
        entries were added."""
        blocks = self._blocks_arg(ids)
        hs = hashes_of(hashes)
        rules = _Rules()
        if not self.enable_prefix_caching:
            rules.add(InvalidStateError, "cache: prefix caching is disabled")
        if len(hs) != len(blocks):
            rules.add(InvalidArgumentError, f"cache: {len(blocks)} ids, {len(hs)} hashes")
            rules.check()
        given: Dict[int, int] = {}
        for b, h in zip(blocks, hs):
            if self._ref[b] == 0:
                rules.add(InvalidStateError, f"cache: block {b} is not referenced")
            if self._hash_of.get(b, h) != h or given.setdefault(b, h) != h:
                rules.add(InvalidArgumentError, f"cache: block {b} under two hashes")
        rules.check()
        group = int(_event_fields.get("group", 0))
        return sum(self._register(b, h, group, dup) for b, h in zip(blocks, hs))

    def lookup(self, hashes) -> np.ndarray:
        """Blocks of the longest cached prefix of ``hashes``, not pinned."""
        return np.array(self._lookup(hashes_of(hashes)), dtype=np.int32)

    def lookup_and_pin(self, hashes) -> np.ndarray:
        """The same, with one reference taken on each hit in the same step."""
        hits = self._lookup(hashes_of(hashes))
        for b in hits:
            self._pin(b)
        return np.array(hits, dtype=np.int32)

    def reset_prefix_cache(self) -> None:
        """Drop every cache entry; refused while any cached block is referenced.

        Documented: no entry is left and the blocks stay free. Not documented: where in the
        free list the formerly evictable blocks go, so the order becomes unknown.
        """
        held = [b for b in self._hash_of if self._ref[b] > 0]
        if held:
            raise _err(
                InvalidStateError, f"reset_prefix_cache: {len(held)} cached blocks are referenced"
            )
        if self._hash_of:
            self.free_order_known = False
        self._block_of.clear()
        self._later.clear()
        self._hash_of.clear()

    def check(self) -> None:
        """The pool's own invariants (raises CorruptionError)."""
        free = set(self._free)
        ok = (
            len(free) == len(self._free)
            and 0 not in free
            and self._ref[0] == 0
            and all((self._ref[b] == 0) == (b in free) for b in range(1, self.num_blocks))
            and all(
                self._block_of[h] == b or b in self._later.get(h, ())
                for b, h in self._hash_of.items()
            )
            and len(self._block_of) + sum(map(len, self._later.values())) == len(self._hash_of)
        )
        if not ok:
            raise CorruptionError("reference pool invariant violated")

    # -- internals (no validation: the manager calls these after validating) -----------------
    def _block_arg(self, block_id) -> int:
        b = scalar_of(block_id, "block_id")
        if not 0 <= b < self.num_blocks:
            raise _err(InvalidArgumentError, f"block {b} out of range [0, {self.num_blocks})")
        return b

    def _blocks_arg(self, ids) -> List[int]:
        blocks = tokens_of(ids, "ids").tolist()
        for b in blocks:
            if not 0 < b < self.num_blocks:
                raise _err(
                    InvalidArgumentError,
                    f"block {b} out of range [1, {self.num_blocks})",
                    InvalidStateError,
                )
        return blocks

    def _allocate(self, n: int) -> List[int]:
        """``n`` blocks from the head of the free list. Each block's cache entry goes as the
        block is taken (lazy eviction), before the next block is chosen: with KV cache
        groups' second chances, whether a later window block's full twin is still cached
        depends on the entries this same allocation already evicted."""
        if self.second_chance is None:  # no choice depends on the entries: one slice
            out = self._free[:n]
            del self._free[:n]
            for b in out:
                self._take(b)
            return out
        out = []
        for _ in range(n):
            while True:
                b = self._free[0]
                if (
                    b not in self._hash_of
                    or b in self._spent
                    or len(self._free) == 1
                    or not self.second_chance(b)
                ):
                    break
                self._free.append(self._free.pop(0))
                self._spent.add(b)
            b = self._free.pop(0)
            self._spent.discard(b)
            self._take(b)
            out.append(b)
        return out

    def _take(self, b: int) -> None:
        if b in self._hash_of:  # lazy eviction: the entry goes when reused
            self._drop_entry(b)
            self.evictions += 1
        self._ref[b] = 1

    def _release(self, b: int) -> bool:
        """Drop one reference; True if the block became free."""
        assert self._ref[b] > 0, f"release of free block {b}"
        self._ref[b] -= 1
        if self._ref[b]:
            return False
        if b in self._hash_of:
            self._free.append(b)  # evictable: least recently released goes first
        else:
            self._free.insert(0, b)  # never cached: reused before any cached block
        return True

    def _pin(self, b: int) -> None:
        if self._ref[b] == 0:
            self._free.remove(b)
            self._spent.discard(b)
        self._ref[b] += 1

    def _register(self, b: int, h: int, group: int = 0, dup: bool = False) -> int:
        """Cache block ``b`` under ``h`` (of KV cache group ``group``) unless either already
        has an entry (first wins; ``dup``: b joins h's blocks, last)."""
        if not self.enable_prefix_caching or b in self._hash_of:
            return 0
        if h in self._block_of:
            if not dup:
                return 0
            self._later.setdefault(h, []).append(b)
            self._hash_of[b] = h
            return 1
        self._block_of[h] = b
        self._hash_of[b] = h
        self._group_of[h] = group
        return 1

    def _uncache(self, b: int) -> None:
        if b in self._hash_of:
            self._drop_entry(b)

    def _drop_entry(self, b: int) -> None:
        """Forget cached block b's entry; the next earliest block under its hash answers."""
        h = self._hash_of.pop(b)
        later = self._later.get(h)
        if self._block_of[h] == b:
            if later:
                self._block_of[h] = later.pop(0)
            else:
                del self._block_of[h]
        else:
            assert later is not None
            later.remove(b)
        if later is not None and not later:
            del self._later[h]

    def _lookup(self, hashes: Sequence[int]) -> List[int]:
        hits: List[int] = []
        if self.enable_prefix_caching:
            for h in hashes:
                if h not in self._block_of:
                    break
                hits.append(self._block_of[h])
        return hits


# ---------------------------------------------------------------------------------------------
# the per-kind rules, each stated once (docs/hybrid-models.md)
# ---------------------------------------------------------------------------------------------
class _Kind:
    """The rules of a token group: full attention, sliding window, chunked local. They differ
    only in the first position a step reads (``first_needed``: 0 for full attention), from
    which the release rule and the longest cache hit follow."""

    tokens = True  # per-token slots: the table grows with the tokens, is hashed and copied

    def __init__(self, group: KVGroup, block_size: int) -> None:
        self.group, self.bs = group, block_size

    def table_blocks(self, n: int) -> int:
        """The entries of a table of ``n`` tokens."""
        return _ceil_div(n, self.bs)

    def keep_from(self, computed: int, n: int, query_start: Optional[int] = None) -> int:
        """The release rule (skipped blocks): the first entry the next step still reads
        (``q0 = min(computed, n - 1, query start)``); the whole blocks below it go."""
        return first_needed(self.group, computed, n, query_start=query_start) // self.bs

    def hit_from(self, n: int, k: int) -> Optional[int]:
        """The longest cache hit: the first of the ``k`` leading blocks of a prompt of ``n``
        tokens that must be cached for a hit of ``k`` blocks (what the query at ``k *
        block_size`` reads, and at least block ``k - 1``); None: no such hit."""
        return min(self.keep_from(k * self.bs, n), k - 1) if k else 0

    def need(self, appends: List[Tuple[int, _Tab, int]], users: Callable[[int], int]) -> int:
        """Blocks needed: appending ``n`` tokens to each (tokens, table, n) in turn takes the
        growth, plus a copy for each write into a block that other sequences (``users``)
        still hold at that point."""
        bs, need = self.bs, 0
        holders: Dict[int, int] = {}
        for ntok, t, n in appends:
            if n <= 0:
                continue
            w = ntok // bs
            if w < len(t.blocks):
                b = t.blocks[w]
                k = holders.get(b, users(b))
                if k > 1:
                    need += 1
                    holders[b] = k - 1
            need += max(0, _ceil_div(ntok + n, bs) - len(t.blocks))
        return need

    def child_need(self, ntok: int, n: int) -> int:
        """Blocks a fork's child reserving ``n`` slots takes: it shares the committed blocks
        only, so it copies a partly filled write block (or takes a new one) plus the growth."""
        if n <= 0:
            return 0
        bs = self.bs
        return _ceil_div(ntok + n, bs) - _ceil_div(ntok, bs) + (1 if ntok % bs else 0)


class _StateKind(_Kind):
    """A state group: a fixed number of blocks per sequence, never released, not hashed, no
    prefix hits; a fork copies them at once."""

    tokens = False

    def table_blocks(self, n: int) -> int:
        return self.group.span

    def keep_from(self, computed: int, n: int, query_start: Optional[int] = None) -> int:
        return 0

    def hit_from(self, n: int, k: int) -> Optional[int]:
        return None if k else 0

    def need(self, appends, users) -> int:
        return 0

    def child_need(self, ntok: int, n: int) -> int:
        return self.group.span  # the child's state is copied at fork, whatever n is


def _kind_of(group: KVGroup, block_size: int) -> _Kind:
    return (_StateKind if group.kind == "state" else _Kind)(group, block_size)


# ---------------------------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------------------------
@dataclass
class _Tab:
    """One group's table of one sequence."""

    blocks: List[int]  # device block table, or the host table while swapped out
    lo: int = 0  # released leading entries (the null block 0)
    num_computed: int = 0  # tokens whose K/V this group holds (a prefix of the tokens)
    num_offered: int = 0  # leading full blocks already offered to the prefix cache
    drafts: int = 0  # draft slots the last step of this group scheduled since a commit
    room: int = 0  # state: the blocks a token group's table would hold (drafts lie within)


@dataclass
class _Seq:
    tokens: List[int]  # committed tokens
    salt: Union[None, str, bytes]
    tabs: List[_Tab] = field(default_factory=list)  # one per group
    swapped: bool = False


@dataclass
class ReferenceMetadata:
    """What ``BlockManager.metadata`` returns, as plain numpy arrays."""

    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    num_tokens: int = 0
    num_seqs: int = 0


class ReferenceManager:
    """Block tables per sequence and group on a :class:`ReferencePool`: the spec of
    BlockManager. One full-attention group (the default) is G = 1 of the same rules.

    >>> m = ReferenceManager(num_blocks=16, block_size=4)
    >>> m.add("a", [1, 2, 3, 4, 5, 6])            # committed, not computed yet
    0
    >>> m.schedule(["a"], [6])                    # the step that computes them
    >>> m.fork("a", "b")
    >>> m.append("b", [7])                        # copy-on-write of the shared partial block
    >>> m.pending_copies(), m.pool.ref_count(2)   # the copy holds its source
    ([(2, 3)], 2)
    >>> m.add("c", [1, 2, 3, 4, 9])               # block 1 was cached by the schedule
    4
    """

    def __init__(
        self,
        num_blocks,
        block_size,
        *,
        enable_prefix_caching=True,
        watermark=0.0,
        num_host_blocks=0,
        hash_key=None,
        groups=None,
    ) -> None:
        self.groups = _group_tuple(groups)
        block_size = scalar_of(block_size, "block_size")
        if block_size < 1:
            raise _err(InvalidArgumentError, f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise _err(InvalidArgumentError, f"watermark must be in [0, 1), got {watermark}")
        num_host_blocks = scalar_of(num_host_blocks, "num_host_blocks")
        if num_host_blocks < 0 or num_host_blocks == 1:
            raise _err(InvalidArgumentError, "num_host_blocks must be 0 or >= 2")
        self.pool = ReferencePool(num_blocks, enable_prefix_caching=enable_prefix_caching)
        self.host_pool = (
            ReferencePool(num_host_blocks, enable_prefix_caching=False) if num_host_blocks else None
        )
        self.block_size = block_size
        self.watermark = watermark
        # the documented rule: admission keeps ceil(watermark * usable blocks) free
        self._watermark_blocks = math.ceil(watermark * (self.pool.num_blocks - 1))
        self.hash_key = _core.default_hash_key() if hash_key is None else hash_key
        self._kinds = [_kind_of(g, block_size) for g in self.groups]
        self._seqs: Dict[object, _Seq] = {}
        self._copies: List[List[Tuple[int, int]]] = [[] for _ in self.groups]  # (src, dst)
        full = [j for j, g in enumerate(self.groups) if g.kind == "full"]
        if full and any(self._windowed(j) for j in range(len(self.groups))):
            self._anchor = full[0]
            self.pool.second_chance = self._twin_cached

    # -- queries ------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id) -> bool:
        try:
            return seq_id_of(seq_id) in self._seqs
        except KVBlocksError:
            return False

    @property
    def num_seqs(self) -> int:
        return len(self._seqs)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_pending_copies(self) -> int:
        return sum(len(c) for c in self._copies)

    def pending_copies(self) -> List[Tuple[int, int]]:
        """The pending (src, dst) pairs, group after group, without draining them."""
        return [p for c in self._copies for p in c]

    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id, group=0) -> np.ndarray:
        j = self._group(group)
        return np.array(self._seq(seq_id_of(seq_id)).tabs[j].blocks, dtype=np.int32)

    def blocks_in_use(self, seq_id) -> int:
        """Blocks the sequence holds (all groups together)."""
        return sum(len(t.blocks) - t.lo for t in self._seq(seq_id_of(seq_id)).tabs)

    def num_tokens(self, seq_id) -> int:
        return len(self._seq(seq_id_of(seq_id)).tokens)

    def num_computed(self, seq_id) -> int:
        return min(t.num_computed for t in self._seq(seq_id_of(seq_id)).tabs)

    def token_ids(self, seq_id) -> np.ndarray:
        return np.array(self._seq(seq_id_of(seq_id)).tokens, dtype=np.int32)

    def is_swapped(self, seq_id) -> bool:
        return self._seq(seq_id_of(seq_id)).swapped

    def blocks_for_tokens(self, num_tokens) -> int:
        n = scalar_of(num_tokens, "num_tokens", 0, INT64_MAX)
        if n < 0:
            raise _err(InvalidArgumentError, f"num_tokens must be >= 0, got {n}")
        return _ceil_div(n, self.block_size)

    def can_add(self, num_tokens) -> bool:
        """Whether a prompt of ``num_tokens`` fits while keeping the watermark free (prefix
        hits are not counted)."""
        n = scalar_of(num_tokens, "num_tokens", 0, INT64_MAX)
        if n < 0:
            raise _err(InvalidArgumentError, f"num_tokens must be >= 0, got {n}")
        need = sum(k.table_blocks(n) for k in self._kinds)
        return self.pool.num_free - need >= self._watermark_blocks

    def blocks_needed(self, seq_id, n=1) -> int:
        """Blocks appending ``n`` tokens takes now (growth plus copy-on-write, every group;
        the blocks a window's release would return are not counted); for a swapped-out
        sequence, what swap_in takes plus the growth."""
        sid = seq_id_of(seq_id)
        n = scalar_of(n, "n", 0, INT64_MAX)
        s = self._seq(sid)
        if n < 0:
            raise _err(InvalidArgumentError, f"n must be >= 0, got {n}")
        # a count that never fits saturates at 2**63 - 1, as the core's int64 answer does
        if s.swapped:  # choice 7: what swap_in takes, plus the growth
            grow = sum(
                max(0, _ceil_div(len(s.tokens) + n, self.block_size) - len(t.blocks))
                for k, t in zip(self._kinds, s.tabs)
                if k.tokens
            )
            return min(INT64_MAX, self._swap_in_plan(s)[1] + grow)
        return min(INT64_MAX, self._need([(s, n)]))

    def can_append(self, seq_ids, n=1) -> bool:
        """Whether every sequence can take ``n`` more tokens at once (False if any is
        swapped out). Sharers of one block count as sequential appends would (choice 4)."""
        sids = seq_ids_of(seq_ids)
        n = scalar_of(n, "n", 0, INT64_MAX)
        seqs = [self._seq(sid) for sid in sids]
        if n < 0:
            raise _err(InvalidArgumentError, f"n must be >= 0, got {n}")
        if any(s.swapped for s in seqs):
            return False
        return self._need([(s, n) for s in seqs]) <= self.pool.num_free

    def blocks_needed_batch(
        self, seq_ids, num_new_tokens=1, *, draft_lens=None, forks=None, watermark=False
    ) -> int:
        """Blocks a scheduler's step takes: for each sequence in order ``reserve(seq, n_i +
        d_i)``, then ``forks[i]`` children of it, each reserving ``n_i`` slots (a child
        shares its parent's committed blocks only: it copies a partly filled write block, or
        takes a new one, plus the growth; a state group's fork copies its blocks at once).
        Saturates at 2**63 - 1; ``watermark=True`` adds the watermark blocks."""
        sids = seq_ids_of(seq_ids)
        B = len(sids)
        if np.ndim(num_new_tokens) == 0:  # one count for every sequence (ints only)
            n = [scalar_of(num_new_tokens, "num_new_tokens", 0, INT32_MAX)] * B
        else:
            n = tokens_of(num_new_tokens, "num_new_tokens").tolist()
        d = [0] * B if draft_lens is None else tokens_of(draft_lens, "draft_lens").tolist()
        f = [0] * B if forks is None else tokens_of(forks, "forks").tolist()
        for name, xs in (("num_new_tokens", n), ("draft_lens", d), ("forks", f)):
            if any(x < 0 for x in xs):
                raise _err(InvalidArgumentError, f"blocks_needed_batch: {name} < 0")
        for name, xs in (("num_new_tokens", n), ("draft_lens", d), ("forks", f)):
            if len(xs) != B:
                raise _err(InvalidArgumentError, f"blocks_needed_batch: {len(xs)} {name}")
        seen = set()
        for sid in sids:
            s = self._seq(sid)
            if sid in seen:
                raise _err(InvalidArgumentError, f"blocks_needed_batch: {sid!r} twice")
            seen.add(sid)
            if s.swapped:
                raise _err(InvalidStateError, f"blocks_needed_batch: {sid!r} is swapped out")
        seqs = [self._seq(sid) for sid in sids]
        ns = [a + b for a, b in zip(n, d)]
        need = self._need(list(zip(seqs, ns))) + sum(
            k * kind.child_need(len(s.tokens), c)
            for kind in self._kinds
            for s, c, k in zip(seqs, n, f)
        )
        need = min(INT64_MAX, need)
        if watermark and need < INT64_MAX:
            need += self._watermark_blocks
        return need

    # -- lifecycle ----------------------------------------------------------------------------
    def add(self, seq_id, token_ids, *, salt=None) -> int:
        """Allocate the tables of a prompt, reusing the longest cached prefix every group can
        serve (whole blocks, at most ``len - 1`` tokens; every group pins its hits before any
        group allocates). Returns the cached tokens: those are computed; the rest is
        committed and waits for a schedule."""
        sid = seq_id_of(seq_id)
        toks = tokens_of(token_ids).tolist()
        salt_b = salt_of(salt)
        if sid in self._seqs:
            raise _err(DuplicateSequenceError, f"sequence {sid!r} already exists")
        n, bs = len(toks), self.block_size
        if any(k.table_blocks(n) >= self.pool.num_blocks for k in self._kinds):  # choice 8
            raise _err(OutOfBlocksError, f"add: {n} tokens can never fit", InvalidArgumentError)
        K = (n - 1) // bs if n else 0  # keep one token to compute
        hashes = [self._hashes(toks, salt_b, j)[:K] for j in range(len(self.groups))]
        k = self._longest_hit(n, K, hashes)
        lo = [kind.hit_from(n, k) or 0 for kind in self._kinds]
        cached = self.pool._block_of
        hits = [[cached[h] for h in hs[lo_j:k]] for hs, lo_j in zip(hashes, lo)]
        need = sum(kind.table_blocks(n) - (k if kind.tokens else 0) for kind in self._kinds)
        need += sum(1 for hj in hits for b in hj if self.pool._ref[b] == 0)
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"add({sid!r}): need {need}, {self.pool.num_free} free")
        s = _Seq(toks, salt_b)
        for hj, lo_j in zip(hits, lo):  # lookup_and_pin in every group, then allocate
            for b in hj:
                self.pool._pin(b)
            s.tabs.append(_Tab([0] * lo_j + hj, lo_j, k * bs, k, room=_ceil_div(n, bs)))
        for kind, t in zip(self._kinds, s.tabs):
            t.blocks += self.pool._allocate(kind.table_blocks(n) - len(t.blocks))
        self._seqs[sid] = s
        return k * bs

    def _longest_hit(self, n: int, K: int, hashes: List[List[int]]) -> int:
        """The longest prefix hit of k <= K blocks that every group can serve."""
        cached = self.pool._block_of
        if not self.pool.enable_prefix_caching:
            return 0
        for k in range(K, 0, -1):
            los = [kind.hit_from(n, k) for kind in self._kinds]
            if all(
                lo is not None and all(h in cached for h in hs[lo:k]) for hs, lo in zip(hashes, los)
            ):
                return k
        return 0

    def append(self, seq_id, token_ids, *, computed=False) -> None:
        """Commit tokens: release what every group no longer reads (only once the call is
        known to fit: its release counts), copy-on-write of a shared block, drop the entry of
        a private cached block about to change, grow. ``computed=True`` commits accepted
        drafts whose K/V the last scheduled step of every group wrote (within its slots)."""
        sid = seq_id_of(seq_id)
        toks = tokens_of(token_ids).tolist()
        if not isinstance(computed, (bool, np.bool_)):
            raise _err(InvalidTypeError, f"computed must be a bool, got {type(computed).__name__}")
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"append: sequence {sid!r} is swapped out")
        if (
            computed
            and toks
            and any(t.num_computed != len(s.tokens) or len(toks) > t.drafts for t in s.tabs)
        ):
            rules.add(
                InvalidStateError,
                f"append(computed=True): {len(toks)} tokens, not within the draft slots "
                "every group scheduled since the last commit",
            )
        rules.check()
        if not toks:
            return
        self._check_fits(s, len(toks))
        need, gain = self._need([(s, len(toks))]), self._gain(s, len(toks))
        if need > self.pool.num_free + gain:
            raise _err(OutOfBlocksError, f"append: need {need}, {self.pool.num_free + gain} free")
        self._move(s, len(toks))
        for j in range(len(self.groups)):
            self._make_writable(j, s)
            self._grow(j, s, len(s.tokens) + len(toks))
        s.tokens += toks
        for j, t in enumerate(s.tabs):
            if computed:  # accepted drafts: computed, cached at once, the rest stays
                t.num_computed, t.drafts = len(s.tokens), t.drafts - len(toks)
                self._offer(j, s)
            else:
                t.drafts = 0  # a commit ends the draft window
        self._settle()

    def _batch_args(self, seq_ids, token_ids) -> Tuple[List[_Seq], List[int]]:
        """append_batch's validation: the sequences and tokens, or the error. Unknown ids
        first, then the rest element by element."""
        sids = seq_ids_of(seq_ids)
        toks = tokens_of(token_ids).tolist()
        for sid in sids:
            self._seq(sid)
        if len(toks) != len(sids):
            raise _err(
                InvalidArgumentError, f"append_batch: {len(sids)} sequences, {len(toks)} tokens"
            )
        rules, seen = _Rules(), set()
        for sid in sids:
            if sid in seen:
                rules.add(InvalidArgumentError, f"append_batch: {sid!r} appears twice")
            elif self._seqs[sid].swapped:
                rules.add(InvalidStateError, f"append_batch: {sid!r} is swapped out")
            seen.add(sid)
        rules.check()
        seqs = [self._seqs[sid] for sid in sids]
        for s in seqs:
            self._check_fits(s, 1)
        return seqs, toks

    def append_batch(self, seq_ids, token_ids) -> None:
        """One token for each sequence, all or nothing; the same as appending one by one in
        the order given (so k sharers of a partial block make k-1 copies). Every group
        releases before any group allocates."""
        seqs, toks = self._batch_args(seq_ids, token_ids)
        need = self._need([(s, 1) for s in seqs])
        if need > self.pool.num_free:
            have = self.pool.num_free + sum(self._gain(s, 1) for s in seqs)
            if need > have:
                raise _err(OutOfBlocksError, f"append_batch: need {need}, {have} free")
        for j in range(len(self.groups)):
            for s in seqs:
                self._release_skipped(j, s, 1)
        for j in range(len(self.groups)):
            for s in seqs:
                self._make_writable(j, s)
                self._grow(j, s, len(s.tokens) + 1)
        for s, tok in zip(seqs, toks):
            s.tokens.append(tok)
            for t in s.tabs:
                t.drafts = 0
        self._settle()

    def reserve(self, seq_id, n) -> None:
        """Ensure ``n`` writable slots after the committed tokens (lookahead, drafts)."""
        sid = seq_id_of(seq_id)
        n = scalar_of(n, "n", 0, INT64_MAX)
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"reserve: {sid!r} is swapped out")
        if n < 0:
            rules.add(InvalidArgumentError, f"reserve: n must be >= 0, got {n}")
        rules.check()
        if n == 0:
            return
        self._check_fits(s, n)
        need = self._need([(s, n)])
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"reserve: need {need}, {self.pool.num_free} free")
        for j in range(len(self.groups)):
            self._make_writable(j, s)
            self._grow(j, s, len(s.tokens) + n)
        self._settle()

    def truncate(self, seq_id, num_tokens) -> None:
        """Roll back to ``num_tokens`` committed tokens; blocks past them (reserved ones too)
        are released tail first. Computed tokens past the cut are forgotten. Refused where a
        group would then read released positions, or a state drop computed tokens."""
        sid = seq_id_of(seq_id)
        n = scalar_of(num_tokens, "num_tokens", 0, INT64_MAX)
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"truncate: {sid!r} is swapped out")
        if not 0 <= n <= len(s.tokens):
            rules.add(InvalidArgumentError, f"truncate: {n} not in [0, {len(s.tokens)}]")
        elif not s.swapped:
            for kind, t in zip(self._kinds, s.tabs):
                if not kind.tokens and n < t.num_computed:
                    rules.add(InvalidStateError, "truncate: a state cannot drop computed tokens")
                elif t.lo and (n == 0 or kind.keep_from(min(t.num_computed, n), n) < t.lo):
                    rules.add(InvalidStateError, "truncate: would read released positions")
        rules.check()
        keep = _ceil_div(n, self.block_size)
        for kind, t in zip(self._kinds, s.tabs):
            freed = 0
            if kind.tokens:
                for i in range(len(t.blocks) - 1, max(keep, t.lo) - 1, -1):
                    freed += self.pool._release(t.blocks[i])
                del t.blocks[keep:]
                t.lo = min(t.lo, keep)
            t.room = min(t.room, keep)
            t.num_computed = min(t.num_computed, n)
            t.num_offered = min(t.num_offered, n // self.block_size)
            t.drafts = 0
            self._settle(freed)
        del s.tokens[n:]

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block holding the parent's committed tokens and inherits
        its computed counts (not its draft slots or reserved blocks); a state group's blocks
        are copied at once (pairs in take_copies)."""
        pid, cid = seq_id_of(parent_id), seq_id_of(child_id)
        p = self._seq(pid)
        rules = _Rules()
        if cid in self._seqs:
            rules.add(DuplicateSequenceError, f"sequence {cid!r} already exists")
        if p.swapped:
            rules.add(InvalidStateError, f"fork: {pid!r} is swapped out")
        rules.check()
        need = sum(k.child_need(len(p.tokens), 0) for k in self._kinds)
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"fork: the state takes {need}, {self.pool.num_free} free")
        c = _Seq(list(p.tokens), p.salt)
        nb = _ceil_div(len(p.tokens), self.block_size)
        for j, (kind, t) in enumerate(zip(self._kinds, p.tabs)):
            if not kind.tokens:  # the child's state is copied now
                fresh = self.pool._allocate(len(t.blocks))
                for b, d in zip(t.blocks, fresh):
                    src = self._copy_source(j, b)
                    self._copies[j].append((src, d))
                    self.pool._pin(src)
                c.tabs.append(_Tab(fresh, 0, t.num_computed, 0, room=nb))
                continue
            shared = t.blocks[:nb]
            for b in shared[t.lo :]:
                self.pool._pin(b)
            c.tabs.append(_Tab(list(shared), t.lo, t.num_computed, min(t.num_offered, nb)))
        self._seqs[cid] = c

    def free(self, seq_id) -> None:
        """Release the sequence's tables tail first, group after group (cached blocks stay
        evictable)."""
        sid = seq_id_of(seq_id)
        s = self._seq(sid)
        del self._seqs[sid]
        pool = self.host_pool if s.swapped else self.pool
        assert pool is not None  # a swapped-out sequence implies a host pool
        for t in s.tabs:
            freed = sum(pool._release(t.blocks[i]) for i in range(len(t.blocks) - 1, t.lo - 1, -1))
            if not s.swapped:
                self._settle(freed)

    def take_copies(self) -> np.ndarray:
        """Drain the pending (src, dst) copies; each releases the reference it held on its
        src. Safe for one ``ops.copy_blocks`` call: no block is both a src and a dst."""
        pairs = [p for c in self._copies for p in c]
        self._copies = [[] for _ in self.groups]
        freed = sum(self.pool._release(src) for src, _ in pairs)
        if freed > 1:
            self.pool.free_order_known = False  # the release order of sources is open
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    # -- swap ---------------------------------------------------------------------------------
    def swap_out(self, seq_id) -> np.ndarray:
        """Move the tables to fresh host blocks: (device block, host block) pairs in table
        order, group after group. A block still waiting for its copy-on-write copy reads the
        copy's source."""
        sid = seq_id_of(seq_id)
        if self.host_pool is None:
            raise _err(InvalidStateError, "swap_out: no host pool (num_host_blocks=0)")
        s = self._seq(sid)
        if s.swapped:
            raise _err(InvalidStateError, f"swap_out: {sid!r} is already swapped out")
        need = sum(len(t.blocks) - t.lo for t in s.tabs)
        if need > self.host_pool.num_free:
            raise _err(OutOfBlocksError, f"swap_out: need {need}, {self.host_pool.num_free} free")
        pairs = []
        for j, t in enumerate(s.tabs):
            host = self.host_pool._allocate(len(t.blocks) - t.lo)
            pairs += [(self._copy_source(j, b), h) for b, h in zip(t.blocks[t.lo :], host)]
            freed = sum(
                self.pool._release(t.blocks[i]) for i in range(len(t.blocks) - 1, t.lo - 1, -1)
            )
            t.blocks[t.lo :] = host
            t.num_offered = 0  # host blocks are not cached; offered again after swap_in
            t.drafts = 0
            self._settle(freed)
        s.swapped = True
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def swap_in(self, seq_id) -> np.ndarray:
        """Bring a swapped-out sequence back: its computed full blocks whose content is still
        cached on the device are shared again (pinned, no pair); the others get fresh device
        blocks and (host, device) pairs, in table order, group after group. Its computed full
        blocks serve prefix hits again at once (their content arrives with the pairs)."""
        sid = seq_id_of(seq_id)
        if self.host_pool is None:
            raise _err(InvalidStateError, "swap_in: no host pool (num_host_blocks=0)")
        s = self._seq(sid)
        if not s.swapped:
            raise _err(InvalidStateError, f"swap_in: {sid!r} is not swapped out")
        plans, need = self._swap_in_plan(s)
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"swap_in: need {need}, {self.pool.num_free} free")
        pairs = []
        for j, (t, hits) in enumerate(zip(s.tabs, plans)):
            for i in sorted(hits):  # pin every hit before allocating the rest
                self.pool._pin(hits[i])
            dev = [0] * t.lo
            for i in range(t.lo, len(t.blocks)):
                if i in hits:
                    dev.append(hits[i])
                else:
                    dev.append(self.pool._allocate(1)[0])
                    pairs.append((t.blocks[i], dev[-1]))
            for i in range(len(t.blocks) - 1, t.lo - 1, -1):
                self.host_pool._release(t.blocks[i])
            t.blocks = dev
            self._offer(j, s)
        s.swapped = False
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def _swap_in_plan(self, s: _Seq) -> Tuple[List[Dict[int, int]], int]:
        """Per group the blocks swap_in shares again ({table index: device block}), and the
        device blocks it takes from the free pool (fresh ones, plus evictable hits it pins)."""
        plans, need, bo = [], 0, self.pool._block_of
        for j, t in enumerate(s.tabs):
            full = t.num_computed // self.block_size
            hashes = self._hashes(s.tokens[: full * self.block_size], s.salt, j)
            hits = {i: bo[hashes[i]] for i in range(t.lo, len(hashes)) if hashes[i] in bo}
            need += len(t.blocks) - t.lo - len(hits)
            need += sum(1 for b in hits.values() if self.pool._ref[b] == 0)
            plans.append(hits)
        return plans, need

    # -- the step ------------------------------------------------------------------------------
    def schedule(self, seq_ids, query_lens, draft_lens=None) -> None:
        """The engine's promise that the next forward writes the K/V of the last
        ``query_lens[i]`` committed tokens (and of ``draft_lens[i]`` draft slots after them)
        in every group. Every row becomes fully computed; its full blocks enter the prefix
        cache; each group releases what the step cannot read."""
        rows = self._validate_step(seq_ids, query_lens, draft_lens, range(len(self.groups)))
        for j in range(len(self.groups)):
            self._step(rows, j)

    def metadata(
        self, seq_ids, query_lens, *, draft_lens=None, out=None, group=0
    ) -> ReferenceMetadata:
        """``schedule`` for group ``group`` only, plus the arrays of the step (no fixed
        buffers: ``out`` is ignored).

        Row i's queries are positions ``[num_tokens - q, num_tokens + d)``; its sequence
        length is ``num_tokens + d``; slot = block * block_size + offset (-1 in a state
        group, whose table is its blocks).
        """
        g = self._group(group)
        rows = self._validate_step(seq_ids, query_lens, draft_lens, [g])
        bs, tokens = self.block_size, self._kinds[g].tokens
        for s, q, _d in rows:  # a window group releases what this step cannot read
            self._release_skipped(g, s, 0, len(s.tokens) - q)
        slots, tables, lens, indptr, indices, last = [], [], [], [0], [], []
        for s, q, d in rows:
            n, t = len(s.tokens), s.tabs[g]
            if tokens:
                slots += [t.blocks[p // bs] * bs + p % bs for p in range(n - q, n + d)]
                used = t.blocks[: _ceil_div(n + d, bs)]
            else:
                slots += [-1] * (q + d)
                used = list(t.blocks)
            tables.append(used)
            lens.append(n + d)
            indices += used
            indptr.append(len(indices))
            last.append(bs if not tokens else (n + d - (len(used) - 1) * bs if n + d else 0))
        bt = np.zeros((len(rows), max([len(t) for t in tables] + [1])), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        self._step(rows, g)
        return ReferenceMetadata(
            np.array(slots, dtype=np.int64),
            bt,
            np.array(lens, dtype=np.int32),
            np.array(indptr, dtype=np.int32),
            np.array(indices, dtype=np.int32),
            np.array(last, dtype=np.int32),
            num_tokens=len(slots),
            num_seqs=len(rows),
        )

    def check(self) -> None:
        """The manager's invariants: every reference is held by a table entry at or above lo
        or by a pending copy; released entries are the null block; no group released what
        its next query reads; no block is both a copy's src and a copy's dst."""
        self.pool.check()
        refs = [0] * self.pool.num_blocks
        host_refs = [0] * (self.host_pool.num_blocks if self.host_pool else 0)
        for s in self._seqs.values():
            for kind, t in zip(self._kinds, s.tabs):
                n = len(s.tokens)
                if not 0 <= t.num_computed <= n or (
                    kind.tokens and len(t.blocks) < _ceil_div(n, self.block_size)
                ):
                    raise CorruptionError("reference sequence invariant violated")
                if any(t.blocks[: t.lo]) or (t.lo and kind.keep_from(t.num_computed, n) < t.lo):
                    raise CorruptionError("reference: a released entry is wrong")
                for b in t.blocks[t.lo :]:
                    (host_refs if s.swapped else refs)[b] += 1
        copies = self.pending_copies()
        for src, _dst in copies:
            refs[src] += 1
        srcs = {src for src, _ in copies}
        if (
            refs != self.pool._ref
            or any(dst in srcs for _, dst in copies)
            or (self.host_pool and host_refs != self.host_pool._ref)
        ):
            raise CorruptionError("reference counts differ from the references held")

    # -- internals ------------------------------------------------------------------------------
    def _seq(self, sid) -> _Seq:
        s = self._seqs.get(sid)
        if s is None:
            raise _err(UnknownSequenceError, f"unknown sequence {sid!r}")
        return s

    def _group(self, group) -> int:
        return scalar_of(group, "group", 0, len(self.groups) - 1)

    def _windowed(self, j: int) -> bool:
        return self.groups[j].kind in ("sliding_window", "chunked_local")

    @staticmethod
    def _tag(key: bytes, j: int) -> int:
        """Group j's hash tag (docs/hybrid-models.md): SipHash-128(key, "kvblocks:group:" j)."""
        if not j:
            return 0
        raw = _core.siphash128(key, b"kvblocks:group:" + bytes([j]))
        return int.from_bytes(raw[:8], "little") | int.from_bytes(raw[8:], "little") << 64

    def _twin_cached(self, b: int) -> bool:
        """The eviction rule (docs/hybrid-models.md): a window or chunk group's cached block
        whose full-attention twin (same tokens and position) is cached gets a second chance."""
        h = self.pool._hash_of[b]
        j = self.pool._group_of[h]
        if j >= len(self.groups) or not self._windowed(j):  # (pool.cache(group=) may say any)
            return False
        twin = h ^ self._tag(self.hash_key, j) ^ self._tag(self.hash_key, self._anchor)
        return twin in self.pool._block_of

    def _hashes(self, tokens: Sequence[int], salt: Union[None, str, bytes], j: int) -> List[int]:
        """Group j's chained hashes of the full blocks of ``tokens`` (none without caching,
        none for a state group)."""
        full = len(tokens) // self.block_size
        if not self.pool.enable_prefix_caching or not full or not self._kinds[j].tokens:
            return []
        h = _core.hash_blocks(
            np.array(tokens[: full * self.block_size], dtype=np.int32),
            self.block_size,
            salt=salt,
            key=self.hash_key,
            group=j,
        )
        return [int(lo) | (int(hi) << 64) for lo, hi in h.tolist()]

    def _check_fits(self, s: _Seq, n: int) -> None:
        """Sizes beyond what can ever fit (choice 8): a table that is never released (full
        attention) past every usable block, or one call's tokens past every block of the
        pool (a window's table may outgrow the pool: its released entries)."""
        total = len(s.tokens) + n
        if (
            total > INT64_MAX
            or n > self.pool.num_blocks * self.block_size
            or any(
                g.kind == "full" and k.table_blocks(total) >= self.pool.num_blocks
                for g, k in zip(self.groups, self._kinds)
            )
        ):
            raise _err(OutOfBlocksError, f"{total} tokens can never fit", InvalidArgumentError)

    def _users(self, j: int, b: int) -> int:
        """References on ``b`` held by sequences (a pending copy's hold on its src excluded:
        choice 4)."""
        return self.pool._ref[b] - sum(1 for src, _ in self._copies[j] if src == b)

    def _copy_source(self, j: int, b: int) -> int:
        """What to read for block ``b``: the source of the pending copy into it, if any."""
        for src, dst in self._copies[j]:
            if dst == b:
                return src
        return b

    def _need(self, appends: List[Tuple[_Seq, int]]) -> int:
        """Blocks that appending ``n`` tokens to each sequence in turn takes, every group."""
        return sum(
            kind.need([(len(s.tokens), s.tabs[j], n) for s, n in appends], partial(self._users, j))
            for j, kind in enumerate(self._kinds)
        )

    def _gain(self, s: _Seq, n: int) -> int:
        """Blocks the release for ``n`` more tokens returns (entries this sequence alone
        holds)."""
        gain = 0
        for kind, t in zip(self._kinds, s.tabs):
            upto = kind.keep_from(t.num_computed, len(s.tokens) + n)
            gain += sum(1 for b in t.blocks[t.lo : upto] if self.pool._ref[b] == 1)
        return gain

    def _release_skipped(self, j: int, s: _Seq, n: int, query_start: Optional[int] = None):
        """The release rule, in its one form: once the sequence holds ``n`` more tokens (and
        the next step starts at ``query_start``), group j's entries below what that step reads
        become the null block and drop their reference (a cached block stays evictable)."""
        t = s.tabs[j]
        upto = self._kinds[j].keep_from(t.num_computed, len(s.tokens) + n, query_start)
        if upto <= t.lo:
            return
        freed = 0
        for i in range(t.lo, upto):
            b, t.blocks[i] = t.blocks[i], 0
            freed += self.pool._release(b)
        t.lo = upto
        self._settle(freed)

    def _move(self, s: _Seq, n: int) -> None:
        """Release what every group no longer needs once the sequence holds n more tokens."""
        for j in range(len(self.groups)):
            self._release_skipped(j, s, n)

    def _make_writable(self, j: int, s: _Seq) -> None:
        """Before a write at offset ``len(tokens)`` in group j: copy-on-write a block other
        sequences hold (chain collapse: the copy reads the original source, which it holds),
        or drop the cache entry of a private block."""
        bs, t = self.block_size, s.tabs[j]
        w = len(s.tokens) // bs
        if not self._kinds[j].tokens or w >= len(t.blocks):
            return
        b = t.blocks[w]
        if self._users(j, b) <= 1:
            self.pool._uncache(b)  # private: its content is about to change
            return
        (new,) = self.pool._allocate(1)
        t.blocks[w] = new
        if len(s.tokens) % bs:  # committed tokens in it: copy them
            src = self._copy_source(j, b)
            self._copies[j].append((src, new))
            self.pool._pin(src)
        self.pool._release(b)  # others still hold b: it stays referenced

    def _grow(self, j: int, s: _Seq, total: int) -> None:
        t = s.tabs[j]
        if not self._kinds[j].tokens:
            t.room = max(t.room, _ceil_div(total, self.block_size))
            return
        more = _ceil_div(total, self.block_size) - len(t.blocks)
        if more > 0:
            t.blocks += self.pool._allocate(more)

    def _settle(self, freed: int = 0) -> None:
        """Drop copies whose destination was released (choice 5); each releases its src. A
        dropped copy's destination never got its content: its cache entry goes."""
        freed_src = 0
        for j, pairs in enumerate(self._copies):
            kept = []
            for src, dst in pairs:
                if self.pool._ref[dst] > 0:
                    kept.append((src, dst))
                    continue
                if dst in self.pool._hash_of:
                    self.pool._uncache(dst)
                    self.pool.free_order_known = False  # where an uncached free block goes
                freed_src += self.pool._release(src)
            self._copies[j] = kept
        if freed_src and freed + freed_src > 1:
            self.pool.free_order_known = False  # sources vs. table: order not documented

    def _validate_step(self, seq_ids, query_lens, draft_lens, groups):
        """A step's rows (sequence, query length, draft length) for ``groups``, or the
        error."""
        sids = seq_ids_of(seq_ids)
        q = tokens_of(query_lens, "query_lens").tolist()
        d = None if draft_lens is None else tokens_of(draft_lens, "draft_lens").tolist()
        seqs = [self._seq(sid) for sid in sids]
        if len(q) != len(sids) or (d is not None and len(d) != len(sids)):
            raise _err(InvalidArgumentError, "metadata: one query_len (and draft_len) per row")
        d = d if d is not None else [0] * len(sids)
        rules, seen = _Rules(), set()
        for sid, s, qi, di in zip(sids, seqs, q, d):
            n = len(s.tokens)
            if sid in seen:
                rules.add(InvalidArgumentError, f"metadata: {sid!r} appears twice")
            seen.add(sid)
            if s.swapped:
                rules.add(InvalidStateError, f"metadata: {sid!r} is swapped out")
                continue
            if not 0 <= qi <= n:
                rules.add(InvalidArgumentError, f"metadata: query_len {qi} not in [0, {n}]")
            else:
                for j in groups:
                    t = s.tabs[j]
                    if n - qi > t.num_computed:
                        rules.add(
                            InvalidStateError,
                            f"metadata: {sid!r} has {t.num_computed} computed "
                            f"of {n} tokens; a query of {qi} leaves a gap",
                        )
                    elif t.lo and self._kinds[j].keep_from(t.num_computed, n, n - qi) < t.lo:
                        rules.add(InvalidStateError, f"metadata: {sid!r} reads released positions")
            if di < 0:
                rules.add(InvalidArgumentError, f"metadata: draft_len {di} < 0")
            elif di and not all(self._draftable(j, s, di) for j in groups):  # choice 3
                rules.add(
                    InvalidStateError,
                    f"metadata: {di} draft slots of {sid!r} are not "
                    "reserved and writable (call reserve)",
                )
        if self.num_pending_copies:  # choice 1
            rules.add(
                InvalidStateError,
                f"metadata: {self.num_pending_copies} copy-on-write "
                "copies are pending: drain them with take_copies() first",
            )
        rules.check()
        return list(zip(seqs, q, d))

    def _draftable(self, j: int, s: _Seq, d: int) -> bool:
        """Choice 3: ``d`` draft slots after the tokens lie in blocks group j's table holds
        (a state group: the blocks a token table would hold) and may write in place."""
        bs, n, t = self.block_size, len(s.tokens), s.tabs[j]
        if not self._kinds[j].tokens:
            return _ceil_div(n + d, bs) <= t.room
        return n + d <= len(t.blocks) * bs and not any(
            self._users(j, b) != 1 or b in self.pool._hash_of
            for b in t.blocks[n // bs : _ceil_div(n + d, bs)]
        )

    def _step(self, rows, j: int) -> None:
        """Group j's step: release what it cannot read, then every row is computed and its
        full blocks are offered to the prefix cache."""
        for s, q, _d in rows:
            self._release_skipped(j, s, 0, len(s.tokens) - q)
        for s, _q, d in rows:
            t = s.tabs[j]
            t.num_computed, t.drafts = len(s.tokens), d
            self._offer(j, s)

    def _offer(self, j: int, s: _Seq) -> None:
        """Offer group j's full, computed blocks not offered yet to the prefix cache."""
        t = s.tabs[j]
        full = t.num_computed // self.block_size
        if self._kinds[j].tokens and full > t.num_offered:
            hashes = self._hashes(s.tokens[: full * self.block_size], s.salt, j)
            for i in range(max(t.num_offered, t.lo), min(full, len(hashes))):
                self.pool._register(t.blocks[i], hashes[i], j)
        t.num_offered = max(t.num_offered, full)
