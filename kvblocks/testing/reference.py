"""The executable specification of kvblocks' allocator: :class:`ReferencePool` and
:class:`ReferenceManager`.

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
  cache groups (GroupedReference), a cached window or chunk block at the head whose
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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
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


INT64_MAX = (1 << 63) - 1


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

    Block 0 is the null block: never handed out, freed or cached.
    """

    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        num_blocks = scalar_of(num_blocks, "num_blocks")
        if num_blocks < 2:
            raise _err(InvalidArgumentError, f"num_blocks must be >= 2, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = bool(enable_prefix_caching)
        self._ref = [0] * num_blocks
        self._free: List[int] = list(range(1, num_blocks))  # index 0 is allocated first
        self._block_of: Dict[int, int] = {}  # hash -> cached block
        self._hash_of: Dict[int, int] = {}  # cached block -> hash
        self.evictions = 0  # cache entries dropped because allocation reused the block
        #: False after an operation whose free-list order the documents leave open
        self.free_order_known = True
        #: KV cache groups' eviction rule (set by GroupedReference): True when the cached block
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

    def free(self, ids) -> None:
        """Drop one reference of each block, in the order given."""
        blocks = self._blocks_arg(ids)
        rules = _Rules()
        held: Dict[int, int] = {}
        for b in blocks:
            held[b] = held.get(b, 0) + 1
            if held[b] > self._ref[b]:
                rules.add(InvalidStateError, f"free: block {b} is not referenced")
        rules.check()
        for b in blocks:
            self._release(b)

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

    def cache(self, ids, hashes, **_event_fields) -> int:
        """Register referenced blocks under their hashes; a hash already cached keeps its
        first block. Returns how many entries were added."""
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
        return sum(self._register(b, h, group) for b, h in zip(blocks, hs))

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
        self._hash_of.clear()

    def check(self) -> None:
        """The pool's own invariants (raises CorruptionError)."""
        free = set(self._free)
        ok = (
            len(free) == len(self._free)
            and 0 not in free
            and self._ref[0] == 0
            and all((self._ref[b] == 0) == (b in free) for b in range(1, self.num_blocks))
            and all(self._block_of[h] == b for b, h in self._hash_of.items())
            and len(self._block_of) == len(self._hash_of)
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
            del self._block_of[self._hash_of.pop(b)]
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

    def _register(self, b: int, h: int, group: int = 0) -> int:
        """Cache block ``b`` under ``h`` (of KV cache group ``group``) unless either already
        has an entry (first wins)."""
        if not self.enable_prefix_caching or b in self._hash_of or h in self._block_of:
            return 0
        self._block_of[h] = b
        self._hash_of[b] = h
        self._group_of[h] = group
        return 1

    def _uncache(self, b: int) -> None:
        if b in self._hash_of:
            del self._block_of[self._hash_of.pop(b)]

    def _lookup(self, hashes: Sequence[int]) -> List[int]:
        hits: List[int] = []
        if self.enable_prefix_caching:
            for h in hashes:
                if h not in self._block_of:
                    break
                hits.append(self._block_of[h])
        return hits


# ---------------------------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------------------------
@dataclass
class _Seq:
    tokens: List[int]  # committed tokens
    blocks: List[int]  # device block table, or the host table while swapped out
    salt: Union[None, str, bytes]
    num_computed: int = 0  # tokens whose K/V are written (a prefix of tokens)
    num_offered: int = 0  # full blocks already offered to the prefix cache
    drafts: int = 0  # draft slots scheduled since the last commit
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
    """Block tables per sequence on a :class:`ReferencePool`: the spec of BlockManager.

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

    def __new__(cls, *args, groups=None, **kw):
        """With ``groups`` other than one full-attention group: a
        :class:`~kvblocks.testing.reference_groups.GroupedReference` (KV cache groups)."""
        if cls is ReferenceManager and _group_tuple(groups) != (KVGroup("full"),):
            from .reference_groups import GroupedReference

            return super().__new__(GroupedReference)
        return super().__new__(cls)

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
        self._seqs: Dict[object, _Seq] = {}
        self._copies: List[Tuple[int, int]] = []  # pending copy-on-write (src, dst)

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
        return len(self._copies)

    def pending_copies(self) -> List[Tuple[int, int]]:
        """The pending (src, dst) pairs, without draining them."""
        return list(self._copies)

    def seq_ids(self) -> list:
        return list(self._seqs)

    def block_table(self, seq_id, group=0) -> np.ndarray:
        scalar_of(group, "group", 0, 0)
        return np.array(self._seq(seq_id_of(seq_id)).blocks, dtype=np.int32)

    def blocks_in_use(self, seq_id) -> int:
        """Blocks the sequence holds (all groups together)."""
        return len(self._seq(seq_id_of(seq_id)).blocks)

    def num_tokens(self, seq_id) -> int:
        return len(self._seq(seq_id_of(seq_id)).tokens)

    def num_computed(self, seq_id) -> int:
        return self._seq(seq_id_of(seq_id)).num_computed

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
        if n > INT64_MAX:
            raise _err(InvalidArgumentError, f"num_tokens {n} beyond int64", OutOfBlocksError)
        return self.pool.num_free - _ceil_div(n, self.block_size) >= self._watermark_blocks

    def blocks_needed(self, seq_id, n=1) -> int:
        """Blocks appending ``n`` tokens takes now (growth plus copy-on-write); for a
        swapped-out sequence, what swap_in takes plus the growth."""
        sid = seq_id_of(seq_id)
        n = scalar_of(n, "n", 0, INT64_MAX)
        s = self._seq(sid)
        if n < 0:
            raise _err(InvalidArgumentError, f"n must be >= 0, got {n}")
        # a count that never fits saturates at 2**63 - 1, as the core's int64 answer does
        if s.swapped:  # choice 7: what swap_in takes, plus the growth
            return min(
                INT64_MAX,
                self._swap_in_plan(s)[1]
                + max(0, _ceil_div(len(s.tokens) + n, self.block_size) - len(s.blocks)),
            )
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
        need = min(INT64_MAX, self._step_need(seqs, ns, n, f))
        if watermark and need < INT64_MAX:
            need += self._watermark_blocks
        return need

    def _child_need(self, s, n: int) -> int:
        """A token table's blocks for a child of s reserving n slots."""
        if n <= 0:
            return 0
        bs, t = self.block_size, len(s.tokens)
        return _ceil_div(t + n, bs) - _ceil_div(t, bs) + (1 if t % bs else 0)

    def _step_need(self, seqs, ns, cn, forks) -> int:
        return self._need(list(zip(seqs, ns))) + sum(
            k * self._child_need(s, n) for s, n, k in zip(seqs, cn, forks)
        )

    # -- lifecycle ----------------------------------------------------------------------------
    def add(self, seq_id, token_ids, *, salt=None) -> int:
        """Allocate a table for a prompt, reusing cached full blocks (pinned before anything
        is allocated). Returns the cached tokens: whole blocks, at most ``len - 1``. Those are
        computed; the rest is committed and waits for a schedule."""
        sid = seq_id_of(seq_id)
        toks = tokens_of(token_ids).tolist()
        salt_b = salt_of(salt)
        if sid in self._seqs:
            raise _err(DuplicateSequenceError, f"sequence {sid!r} already exists")
        n, bs = len(toks), self.block_size
        self._check_fits(None, n)
        hashes = self._hashes(toks, salt_b)
        hashes = hashes[: (n - 1) // bs if n else 0]  # keep one token to compute
        hits = self.pool._lookup(hashes)
        need = _ceil_div(n, bs) - len(hits)
        pinned_from_free = sum(1 for b in hits if self.pool._ref[b] == 0)
        if need > self.pool.num_free - pinned_from_free:
            raise _err(
                OutOfBlocksError,
                f"add({sid!r}): need {need} blocks, {self.pool.num_free - pinned_from_free} free",
            )
        for b in hits:  # lookup_and_pin, then allocate
            self.pool._pin(b)
        blocks = hits + self.pool._allocate(need)
        cached = len(hits) * bs
        self._seqs[sid] = _Seq(toks, blocks, salt_b, num_computed=cached, num_offered=len(hits))
        return cached

    def append(self, seq_id, token_ids, *, computed=False) -> None:
        """Commit tokens: copy-on-write of a shared block, drop the entry of a private cached
        block about to change, grow. ``computed=True`` commits accepted drafts whose K/V the
        last scheduled step wrote (only within that step's draft slots)."""
        sid = seq_id_of(seq_id)
        toks = tokens_of(token_ids).tolist()
        if not isinstance(computed, (bool, np.bool_)):
            raise _err(InvalidTypeError, f"computed must be a bool, got {type(computed).__name__}")
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"append: sequence {sid!r} is swapped out")
        if computed and len(toks) > s.drafts:
            rules.add(
                InvalidStateError,
                f"append(computed=True): {len(toks)} tokens, "
                f"{s.drafts} draft slots scheduled since the last commit",
            )
        rules.check()
        if not toks:
            return
        self._check_fits(s, len(toks))
        need = self._need([(s, len(toks))])
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"append: need {need}, {self.pool.num_free} free")
        drafts_left = s.drafts - len(toks)
        freed = self._commit(s, toks)
        if computed:  # accepted drafts: computed, cached at once, the rest of the window stays
            s.num_computed = len(s.tokens)
            s.drafts = drafts_left
            self._offer(s)
        self._settle(freed)

    def _batch_args(self, seq_ids, token_ids) -> Tuple[List[Any], List[int]]:
        """append_batch's validation (also GroupedReference's): the sequences and tokens, or
        the error. Unknown ids first, then the rest element by element."""
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
        the order given (so k sharers of a partial block make k-1 copies)."""
        seqs, toks = self._batch_args(seq_ids, token_ids)
        need = self._need([(s, 1) for s in seqs])
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"append_batch: need {need}, {self.pool.num_free} free")
        freed: List[int] = []
        for s, t in zip(seqs, toks):
            freed += self._commit(s, [t])
        self._settle(freed)

    def _reserve_args(self, seq_id, n) -> Tuple[Any, int]:
        """reserve's validation (also GroupedReference's): the sequence and n, or the error."""
        sid = seq_id_of(seq_id)
        n = scalar_of(n, "n", 0, INT64_MAX)
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"reserve: {sid!r} is swapped out")
        if n < 0:
            rules.add(InvalidArgumentError, f"reserve: n must be >= 0, got {n}")
        rules.check()
        if n:
            self._check_fits(s, n)
        return s, n

    def reserve(self, seq_id, n) -> None:
        """Ensure ``n`` writable slots after the committed tokens (lookahead, drafts)."""
        s, n = self._reserve_args(seq_id, n)
        if n == 0:
            return
        need = self._need([(s, n)])
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"reserve: need {need}, {self.pool.num_free} free")
        freed = self._make_writable(s)
        self._grow(s, len(s.tokens) + n)
        self._settle(freed)

    def truncate(self, seq_id, num_tokens) -> None:
        """Roll back to ``num_tokens`` committed tokens; blocks past them (reserved ones too)
        are released tail first. Computed tokens past the cut are forgotten."""
        sid = seq_id_of(seq_id)
        n = scalar_of(num_tokens, "num_tokens", 0, INT64_MAX)
        s = self._seq(sid)
        rules = _Rules()
        if s.swapped:
            rules.add(InvalidStateError, f"truncate: {sid!r} is swapped out")
        if not 0 <= n <= len(s.tokens):
            rules.add(InvalidArgumentError, f"truncate: {n} not in [0, {len(s.tokens)}]")
        rules.check()
        keep = _ceil_div(n, self.block_size)
        freed = [b for b in reversed(s.blocks[keep:]) if self.pool._release(b)]
        del s.blocks[keep:]
        del s.tokens[n:]
        s.num_computed = min(s.num_computed, n)
        s.num_offered = min(s.num_offered, n // self.block_size)
        s.drafts = 0
        self._settle(freed)

    def fork(self, parent_id, child_id) -> None:
        """The child shares every block holding the parent's committed tokens and inherits
        its computed count (not its draft slots or reserved blocks)."""
        pid, cid = seq_id_of(parent_id), seq_id_of(child_id)
        p = self._seq(pid)
        rules = _Rules()
        if cid in self._seqs:
            rules.add(DuplicateSequenceError, f"sequence {cid!r} already exists")
        if p.swapped:
            rules.add(InvalidStateError, f"fork: {pid!r} is swapped out")
        rules.check()
        shared = p.blocks[: _ceil_div(len(p.tokens), self.block_size)]
        for b in shared:
            self.pool._pin(b)
        self._seqs[cid] = _Seq(
            list(p.tokens),
            list(shared),
            p.salt,
            num_computed=p.num_computed,
            num_offered=min(p.num_offered, len(shared)),
        )

    def free(self, seq_id) -> None:
        """Release the sequence's blocks tail first (cached ones stay evictable)."""
        sid = seq_id_of(seq_id)
        s = self._seq(sid)
        del self._seqs[sid]
        pool = self.host_pool if s.swapped else self.pool
        assert pool is not None  # a swapped-out sequence implies a host pool
        freed = [b for b in reversed(s.blocks) if pool._release(b)]
        self._settle(freed if not s.swapped else [])

    def take_copies(self) -> np.ndarray:
        """Drain the pending (src, dst) copies; each releases the reference it held on its
        src. Safe for one ``ops.copy_blocks`` call: no block is both a src and a dst."""
        pairs, self._copies = self._copies, []
        freed = [src for src, _ in pairs if self.pool._release(src)]
        if len(freed) > 1:
            self.pool.free_order_known = False  # the release order of sources is open
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    # -- swap ---------------------------------------------------------------------------------
    def swap_out(self, seq_id) -> np.ndarray:
        """Move the table to fresh host blocks: (device block, host block) pairs in table
        order. A block still waiting for its copy-on-write copy reads the copy's source."""
        sid = seq_id_of(seq_id)
        if self.host_pool is None:
            raise _err(InvalidStateError, "swap_out: no host pool (num_host_blocks=0)")
        s = self._seq(sid)
        if s.swapped:
            raise _err(InvalidStateError, f"swap_out: {sid!r} is already swapped out")
        if len(s.blocks) > self.host_pool.num_free:
            raise _err(
                OutOfBlocksError,
                f"swap_out: need {len(s.blocks)} host blocks, {self.host_pool.num_free} free",
            )
        host = self.host_pool._allocate(len(s.blocks))
        pairs = [(self._copy_source(b), h) for b, h in zip(s.blocks, host)]  # choice 6
        freed = [b for b in reversed(s.blocks) if self.pool._release(b)]
        s.blocks, s.swapped = host, True
        s.num_offered = 0  # host blocks are not cached; offered again after swap_in
        s.drafts = 0
        self._settle(freed)
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def swap_in(self, seq_id) -> np.ndarray:
        """Bring a swapped-out sequence back: its computed full blocks whose content is still
        cached on the device are shared again (pinned, no pair); the others get fresh device
        blocks and (host, device) pairs, in table order. Its computed full blocks serve
        prefix hits again at once (their content arrives with the pairs)."""
        sid = seq_id_of(seq_id)
        if self.host_pool is None:
            raise _err(InvalidStateError, "swap_in: no host pool (num_host_blocks=0)")
        s = self._seq(sid)
        if not s.swapped:
            raise _err(InvalidStateError, f"swap_in: {sid!r} is not swapped out")
        hits, need = self._swap_in_plan(s)
        if need > self.pool.num_free:
            raise _err(OutOfBlocksError, f"swap_in: need {need}, {self.pool.num_free} free")
        for i in sorted(hits):  # pin every hit before allocating the rest
            self.pool._pin(hits[i])
        dev, pairs = [], []
        for i, h in enumerate(s.blocks):
            if i in hits:
                dev.append(hits[i])
            else:
                dev.append(self.pool._allocate(1)[0])
                pairs.append((h, dev[-1]))
        for h in reversed(s.blocks):
            self.host_pool._release(h)
        s.blocks, s.swapped = dev, False
        self._offer(s)
        return np.array(pairs, dtype=np.int64).reshape(-1, 2)

    def _swap_in_plan(self, s: _Seq) -> Tuple[Dict[int, int], int]:
        """Blocks swap_in shares again ({table index: device block}) and the device blocks it
        takes from the free pool (fresh ones, plus evictable hits it pins)."""
        full = s.num_computed // self.block_size
        hashes = self._hashes(s.tokens[: full * self.block_size], s.salt)
        hits = {i: self.pool._block_of[h] for i, h in enumerate(hashes) if h in self.pool._block_of}
        need = len(s.blocks) - len(hits) + sum(1 for b in hits.values() if self.pool._ref[b] == 0)
        return hits, need

    # -- the step ------------------------------------------------------------------------------
    def schedule(self, seq_ids, query_lens, draft_lens=None) -> None:
        """The engine's promise that the next forward writes the K/V of the last
        ``query_lens[i]`` committed tokens (and of ``draft_lens[i]`` draft slots after them).
        Every row becomes fully computed; its full blocks enter the prefix cache."""
        self._step(self._validate_step(seq_ids, query_lens, draft_lens))

    def metadata(
        self, seq_ids, query_lens, *, draft_lens=None, out=None, group=0
    ) -> ReferenceMetadata:
        """``schedule`` plus the arrays of the step (no fixed buffers: ``out`` is ignored).

        Row i's queries are positions ``[num_tokens - q, num_tokens + d)``; its sequence
        length is ``num_tokens + d``; slot = block * block_size + offset.
        """
        scalar_of(group, "group", 0, 0)
        rows = self._validate_step(seq_ids, query_lens, draft_lens)
        bs = self.block_size
        slots, tables, lens, indptr, indices, last = [], [], [], [0], [], []
        for s, q, d in rows:
            n = len(s.tokens)
            slots += [s.blocks[p // bs] * bs + p % bs for p in range(n - q, n + d)]
            used = s.blocks[: _ceil_div(n + d, bs)]
            tables.append(used)
            lens.append(n + d)
            indices += used
            indptr.append(len(indices))
            last.append(n + d - (len(used) - 1) * bs if n + d else 0)
        bt = np.zeros((len(rows), max([len(t) for t in tables] + [1])), dtype=np.int32)
        for i, t in enumerate(tables):
            bt[i, : len(t)] = t
        self._step(rows)
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
        """The manager's invariants: every reference is held by a table or a pending copy."""
        self.pool.check()
        refs = [0] * self.pool.num_blocks
        host_refs = [0] * (self.host_pool.num_blocks if self.host_pool else 0)
        for s in self._seqs.values():
            for b in s.blocks:
                (host_refs if s.swapped else refs)[b] += 1
            if not (
                0 <= s.num_computed <= len(s.tokens)
                and len(s.blocks) >= _ceil_div(len(s.tokens), self.block_size)
            ):
                raise CorruptionError("reference sequence invariant violated")
        for src, _dst in self._copies:
            refs[src] += 1
        srcs = {src for src, _ in self._copies}
        if (
            refs != self.pool._ref
            or any(dst in srcs for _, dst in self._copies)
            or (self.host_pool and host_refs != self.host_pool._ref)
        ):
            raise CorruptionError("reference counts differ from the references held")

    # -- internals ------------------------------------------------------------------------------
    def _seq(self, sid) -> _Seq:
        s = self._seqs.get(sid)
        if s is None:
            raise _err(UnknownSequenceError, f"unknown sequence {sid!r}")
        return s

    def _hashes(self, tokens: Sequence[int], salt: Union[None, str, bytes]) -> List[int]:
        """Chained hashes of the full blocks of ``tokens`` (empty without caching)."""
        full = len(tokens) // self.block_size
        if not self.pool.enable_prefix_caching or not full:
            return []
        h = _core.hash_blocks(
            np.array(tokens[: full * self.block_size], dtype=np.int32),
            self.block_size,
            salt=salt,
            key=self.hash_key,
        )
        return [int(lo) | (int(hi) << 64) for lo, hi in h.tolist()]

    def _check_fits(self, s: Optional[_Seq], n: int) -> None:
        """Sizes beyond what can ever fit (choice 8)."""
        total = (len(s.tokens) if s is not None else 0) + n
        if total > (self.pool.num_blocks - 1) * self.block_size or total > INT64_MAX:
            raise _err(OutOfBlocksError, f"{total} tokens can never fit", InvalidArgumentError)

    def _seq_refs(self, b: int) -> int:
        """References on ``b`` held by sequences (a pending copy's hold on its src excluded)."""
        return self.pool._ref[b] - sum(1 for src, _ in self._copies if src == b)

    def _copy_source(self, b: int) -> int:
        """What to read for block ``b``: the source of the pending copy into it, if any."""
        for src, dst in self._copies:
            if dst == b:
                return src
        return b

    def _need(self, appends: List[Tuple[_Seq, int]]) -> int:
        """Blocks that appending ``n`` tokens to each sequence in turn takes: growth, plus a
        copy for each write into a block that other sequences still hold at that point."""
        bs, need = self.block_size, 0
        holders: Dict[int, int] = {}
        for s, n in appends:
            if n <= 0:
                continue
            w = len(s.tokens) // bs
            if w < len(s.blocks):
                b = s.blocks[w]
                k = holders.get(b, self._seq_refs(b))
                if k > 1:
                    need += 1
                    holders[b] = k - 1
            need += max(0, _ceil_div(len(s.tokens) + n, bs) - len(s.blocks))
        return need

    def _make_writable(self, s: _Seq) -> List[int]:
        """Before a write at offset ``len(tokens)``: copy-on-write a block other sequences
        hold, or drop the cache entry of a private block. Returns blocks that became free."""
        bs = self.block_size
        w = len(s.tokens) // bs
        if w >= len(s.blocks):
            return []
        b = s.blocks[w]
        if self._seq_refs(b) <= 1:
            self.pool._uncache(b)  # private: its content is about to change
            return []
        (new,) = self.pool._allocate(1)
        s.blocks[w] = new
        if len(s.tokens) % bs == 0:  # no committed token in it: nothing to copy
            return [b] if self.pool._release(b) else []
        src = self._copy_source(b)  # chain collapse: read the original source
        self._copies.append((src, new))
        if src != b:
            self.pool._pin(src)  # the copy holds its source ...
            self.pool._release(b)  # ... and our reference on b goes (b stays held)
        # else: our reference on b is now the copy's
        return []

    def _grow(self, s: _Seq, total_tokens: int) -> None:
        more = _ceil_div(total_tokens, self.block_size) - len(s.blocks)
        if more > 0:
            s.blocks += self.pool._allocate(more)

    def _commit(self, s: _Seq, toks: List[int]) -> List[int]:
        freed = self._make_writable(s)
        self._grow(s, len(s.tokens) + len(toks))
        s.tokens += toks
        s.drafts = 0  # a commit ends the draft window
        return freed

    def _settle(self, freed: List[int]) -> None:
        """Drop copies whose destination was released (choice 5); each releases its src."""
        kept, freed_src = [], []
        for src, dst in self._copies:
            if self.pool._ref[dst] > 0:
                kept.append((src, dst))
            elif self.pool._release(src):
                freed_src.append(src)
        self._copies = kept
        if freed_src and len(freed) + len(freed_src) > 1:
            self.pool.free_order_known = False  # sources vs. table: order not documented

    def _step_args(self, seq_ids, query_lens, draft_lens):
        """A step's rows (also GroupedReference's): ids, sequences, query and draft lengths."""
        sids = seq_ids_of(seq_ids)
        q = tokens_of(query_lens, "query_lens").tolist()
        d = None if draft_lens is None else tokens_of(draft_lens, "draft_lens").tolist()
        seqs = [self._seq(sid) for sid in sids]
        if len(q) != len(sids) or (d is not None and len(d) != len(sids)):
            raise _err(InvalidArgumentError, "metadata: one query_len (and draft_len) per row")
        return sids, seqs, q, d if d is not None else [0] * len(sids)

    def _validate_step(self, seq_ids, query_lens, draft_lens):
        sids, seqs, q, d = self._step_args(seq_ids, query_lens, draft_lens)
        rules, seen, bs = _Rules(), set(), self.block_size
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
            elif n - qi > s.num_computed:
                rules.add(
                    InvalidStateError,
                    f"metadata: {sid!r} has {s.num_computed} computed "
                    f"of {n} tokens; a query of {qi} leaves a gap",
                )
            if di < 0:
                rules.add(InvalidArgumentError, f"metadata: draft_len {di} < 0")
            elif (
                di
                and (
                    n + di > len(s.blocks) * bs
                    or any(  # choice 3
                        self.pool._ref[b] != 1 or b in self.pool._hash_of
                        for b in s.blocks[n // bs : _ceil_div(n + di, bs)]
                    )
                )
            ):
                rules.add(
                    InvalidStateError,
                    f"metadata: {di} draft slots of {sid!r} are not "
                    "reserved and writable (call reserve)",
                )
        if self._copies:  # choice 1
            rules.add(
                InvalidStateError,
                f"metadata: {len(self._copies)} copy-on-write "
                "copies are pending: drain them with take_copies() first",
            )
        rules.check()
        return list(zip(seqs, q, d))

    def _step(self, rows) -> None:
        for s, _q, d in rows:
            s.num_computed = len(s.tokens)
            s.drafts = d
            self._offer(s)

    def _offer(self, s: _Seq) -> None:
        """Offer the full, computed blocks not offered yet to the prefix cache."""
        full = s.num_computed // self.block_size
        if full > s.num_offered:
            hashes = self._hashes(s.tokens[: full * self.block_size], s.salt)
            for i in range(s.num_offered, min(full, len(hashes))):
                self.pool._register(s.blocks[i], hashes[i])
        s.num_offered = max(s.num_offered, full)
