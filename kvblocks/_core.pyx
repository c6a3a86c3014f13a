# cython: language_level=3
"""Thin Cython wrappers over the C core (csrc/): BlockPool, BlockManager, hash_blocks.

Each cdef class owns exactly one C object. C functions return 0 or a negative code;
``raise_code`` maps codes to the exceptions of kvblocks.errors with a message saying what was
asked and what was there.
"""
import os

import numpy as np

cimport numpy as cnp
from cpython.buffer cimport PyBUF_WRITABLE
from cpython.dict cimport PyDict_GetItem
from cpython.long cimport PyLong_AsLongAndOverflow
from cpython.object cimport PyObject
from libc.stdint cimport INT32_MAX, INT32_MIN, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

from kvblocks._core cimport *

from kvblocks.errors import (
    CorruptionError,
    DuplicateSequenceError,
    InvalidArgumentError,
    InvalidStateError,
    InvalidTypeError,
    KVBlocksError,
    OutOfBlocksError,
    UnknownSequenceError,
)
from kvblocks.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvblocks.metadata import AttentionMetadata
from kvblocks.stats import CacheStats

cnp.import_array()

_DEFAULT_KEY = os.urandom(16)  # per-process secret hash key
cdef Py_ssize_t _IMAP_LIMIT = 1 << 22  # int ids below this also get an array slot map


def default_hash_key():
    """The per-process random hash key used when ``hash_key``/``key`` is None."""
    return _DEFAULT_KEY


# ---------------------------------------------------------------------------------------------
# argument conversion
# ---------------------------------------------------------------------------------------------


cdef inline bint is_i32_vector(object obj):
    """True for a 1-D C-contiguous aligned int32 ndarray (the zero-conversion fast path)."""
    if not cnp.PyArray_Check(obj):
        return False
    cdef cnp.ndarray a = <cnp.ndarray>obj
    return (cnp.PyArray_TYPE(a) == cnp.NPY_INT32 and cnp.PyArray_NDIM(a) == 1
            and cnp.PyArray_ISCARRAY_RO(a))


cdef inline int32_t *i32_data(cnp.ndarray a):
    return <int32_t *>cnp.PyArray_DATA(a) if cnp.PyArray_DIM(a, 0) else NULL


cdef void *buf_ptr(object arr, int typenum, int ndim, Py_ssize_t rows, str name) except NULL:
    """Data pointer of a writable C-contiguous buffer of the given dtype, rank and rows."""
    if not cnp.PyArray_Check(arr):
        raise InvalidTypeError(f"metadata: buffer {name} must be a numpy array")
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if (cnp.PyArray_TYPE(a) != typenum or cnp.PyArray_NDIM(a) != ndim
            or not cnp.PyArray_ISCARRAY(a)):
        want = "int64" if typenum == cnp.NPY_INT64 else "int32"
        raise InvalidTypeError(f"metadata: buffer {name} must be a writable C-contiguous "
                               f"{ndim}-D {want} array, got {arr.dtype} {arr.shape}")
    if cnp.PyArray_DIM(a, 0) < rows:
        raise InvalidArgumentError(f"metadata: buffer {name} holds {cnp.PyArray_DIM(a, 0)} "
                                   f"rows, the batch needs {rows}")
    return cnp.PyArray_DATA(a)


cdef inline cnp.ndarray new_i32(Py_ssize_t n):
    cdef cnp.npy_intp dim = n
    return cnp.PyArray_EMPTY(1, &dim, cnp.NPY_INT32, 0)


cdef cnp.ndarray as_int32(object obj, str name):
    """A 1-D C-contiguous int32 array from an int array, list or range; checks the range."""
    if is_i32_vector(obj):
        return <cnp.ndarray>obj
    cdef object arr
    if type(obj) is np.ndarray:
        arr = obj
    else:
        try:
            arr = np.asarray(obj)
        except Exception as exc:
            raise InvalidTypeError(f"{name} must be a sequence of ints: {exc}") from None
        if arr.size == 0:
            arr = arr.astype(np.int32)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":  # bools, floats and objects are refused
        raise InvalidTypeError(f"{name} must hold integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < INT32_MIN or arr.max() > INT32_MAX):
        raise InvalidArgumentError(f"{name} holds values outside int32")
    return np.ascontiguousarray(arr, dtype=np.int32)


cdef object as_hashes(object obj, str name="hashes"):
    """An (n, 2) C-contiguous uint64 array of [lo, hi] 128-bit hashes."""
    cdef object arr
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], int):  # 128-bit ints
        if not all(isinstance(h, int) and 0 <= h < (1 << 128) for h in obj):
            raise InvalidArgumentError(f"{name}: 128-bit unsigned ints expected")
        arr = np.array([[h & 0xFFFFFFFFFFFFFFFF, h >> 64] for h in obj], dtype=np.uint64)
    else:
        arr = np.asarray(obj)
    if arr.size == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    if arr.dtype != np.uint64:
        raise InvalidTypeError(f"{name} must be uint64 [n, 2] (as from hash_blocks), "
                               f"got dtype {arr.dtype}")
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise InvalidArgumentError(f"{name} must have shape [n, 2], got {arr.shape}")
    return np.ascontiguousarray(arr)


cdef bytes as_key(object key):
    if key is None:
        return _DEFAULT_KEY
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidTypeError(f"hash key must be 16 bytes, got {type(key).__name__}")
    key = bytes(key)
    if len(key) != 16:
        raise InvalidArgumentError(f"hash key must be 16 bytes, got {len(key)}")
    return key


cdef bytes as_salt(object salt):
    if salt is None:
        return b""
    if isinstance(salt, str):
        return salt.encode()
    if isinstance(salt, int) and not isinstance(salt, bool):
        return str(salt).encode()
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return bytes(salt)
    raise InvalidTypeError(f"salt must be bytes, str or int, got {type(salt).__name__}")


cdef inline object hash_int(kvb_hash_t h):
    return (<object>h.hi << 64) | <object>h.lo


def hash_blocks(token_ids, int block_size, *, parent=None, salt=None, key=None):
    """Chained 128-bit keyed hashes of the full blocks of ``token_ids``.

    ``h[i] = SipHash128_key(h[i-1] || tokens of block i)``; ``h[-1]`` is ``parent`` when given,
    else the root of ``salt`` (different salts never share a hash). Returns an ``(n, 2)``
    uint64 array of ``[lo, hi]`` halves; a trailing partial block is not hashed.

    >>> import kvblocks
    >>> h = kvblocks.hash_blocks(list(range(40)), 16, key=b"0123456789abcdef")
    >>> h.shape, h.dtype
    ((2, 2), dtype('uint64'))
    >>> h2 = kvblocks.hash_blocks(list(range(16, 32)), 16, parent=h[0], key=b"0123456789abcdef")
    >>> bool((h2[0] == h[1]).all())
    True
    """
    if block_size < 1:
        raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
    cdef bytes k = as_key(key)
    cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
    cdef int64_t n = cnp.PyArray_DIM(toks, 0) // block_size
    cdef cnp.ndarray out = np.empty((n, 2), dtype=np.uint64)
    cdef kvb_hash_t root
    cdef bytes s
    if parent is not None:
        if salt is not None:
            raise InvalidArgumentError("give either parent or salt: the salt only enters "
                                       "the first block of a chain")
        root = _parent_hash(parent)
    else:
        s = as_salt(salt)
        kvb_hash_root(<const uint8_t *>k, <const uint8_t *>s, len(s), &root)
    if n:
        kvb_hash_chain(<const uint8_t *>k, &root, i32_data(toks), n, block_size,
                       <kvb_hash_t *>cnp.PyArray_DATA(out))
    return out


cdef kvb_hash_t _parent_hash(object parent) except *:
    cdef kvb_hash_t h
    if isinstance(parent, int):
        if parent < 0 or parent >> 128:
            raise InvalidArgumentError("parent hash must be a 128-bit unsigned int")
        h.lo = parent & 0xFFFFFFFFFFFFFFFF
        h.hi = parent >> 64
        return h
    arr = np.asarray(parent)
    if arr.dtype != np.uint64 or arr.shape != (2,):
        raise InvalidArgumentError("parent must be a 128-bit int or a uint64 [lo, hi] pair, "
                                   f"got {arr.dtype} {arr.shape}")
    h.lo = arr[0]
    h.hi = arr[1]
    return h


# ---------------------------------------------------------------------------------------------
# zero-copy read-only views of C arrays
# ---------------------------------------------------------------------------------------------
cdef class _View:
    """Exports a read-only 1-D buffer over memory owned by ``owner`` (kept alive)."""
    cdef object owner
    cdef void *ptr
    cdef Py_ssize_t shape[1]
    cdef Py_ssize_t strides[1]
    cdef Py_ssize_t itemsize
    cdef bytes fmt

    def __getbuffer__(self, Py_buffer *buf, int flags):
        if flags & PyBUF_WRITABLE:
            raise BufferError("kvblocks views are read-only")
        buf.buf = self.ptr
        buf.obj = self
        buf.len = self.shape[0] * self.itemsize
        buf.readonly = 1
        buf.itemsize = self.itemsize
        buf.format = self.fmt
        buf.ndim = 1
        buf.shape = self.shape
        buf.strides = self.strides
        buf.suboffsets = NULL
        buf.internal = NULL

    def __releasebuffer__(self, Py_buffer *buf):
        pass


cdef object int32_view(object owner, int32_t *ptr, Py_ssize_t n):
    cdef _View v = _View.__new__(_View)
    v.owner = owner
    v.ptr = ptr
    v.shape[0] = n
    v.strides[0] = sizeof(int32_t)
    v.itemsize = sizeof(int32_t)
    v.fmt = b"i"
    return np.asarray(v)


# ---------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------
cdef int raise_code(int rc, str what, int64_t a, int64_t b) except -1:
    if rc == KVB_ENOMEM:
        raise MemoryError(f"{what}: out of host memory")
    if rc == KVB_EOUTOFBLOCKS:
        raise OutOfBlocksError(f"{what}: need {a} blocks, {b} free")
    if rc == KVB_ERANGE:
        raise InvalidArgumentError(f"{what}: value {b} at index {a} is out of range")
    if rc == KVB_EINVAL:
        raise InvalidArgumentError(f"{what}: invalid value {b}")
    if rc == KVB_ESTATE:
        raise InvalidStateError(f"{what}: not allowed in the current state (block or item {b} "
                                f"at index {a})")
    if rc == KVB_EDUP:
        raise InvalidArgumentError(f"{what}: duplicate or conflicting entry {b} at index {a}")
    if rc == KVB_ECORRUPT:
        raise CorruptionError(f"{what}: invariant violated (check {a}, item {b})")
    if rc == KVB_EUNKNOWN:
        raise UnknownSequenceError(f"{what}: unknown sequence")
    raise KVBlocksError(f"{what}: error {rc}")


# ---------------------------------------------------------------------------------------------
# BlockPool
# ---------------------------------------------------------------------------------------------
cdef class BlockPool:
    """A pool of ``num_blocks`` KV blocks with ref counts, a free list and a prefix cache.

    Block 0 is the reserved null block: it pads block tables and is never handed out.

    >>> from kvblocks import BlockPool
    >>> pool = BlockPool(8)
    >>> ids = pool.allocate(3)
    >>> ids.tolist(), pool.num_free
    ([1, 2, 3], 4)
    >>> pool.incref(ids[:1]); pool.ref_count(1)
    2
    >>> pool.free(ids); pool.free(ids[:1]); pool.num_free
    7
    """

    def __cinit__(self, int num_blocks, *, bint enable_prefix_caching=True, hash_key=None,
                  bint enable_kv_events=False):
        if num_blocks < 2:
            raise InvalidArgumentError(
                f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        self._key = as_key(hash_key)
        rc = kvb_pool_init(&self.p, num_blocks, enable_prefix_caching)
        if rc:
            raise_code(rc, "BlockPool", 0, num_blocks)
        self.p.record_events = enable_kv_events
        self._initialized = True

    def __dealloc__(self):
        if self._initialized:
            kvb_pool_destroy(&self.p)

    def __reduce__(self):
        raise TypeError("BlockPool cannot be pickled")

    def __repr__(self):
        return (f"BlockPool(num_blocks={self.p.num_blocks}, free={self.p.num_free}, "
                f"cached={self.p.num_cached}, evictable={self.p.num_evictable})")

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_blocks(self):
        """Total blocks, including the null block."""
        return self.p.num_blocks

    @property
    def num_free(self):
        """Allocatable now: never-cached free blocks plus evictable cached ones."""
        return self.p.num_free

    @property
    def num_evictable(self):
        """Cached blocks with no reference (free, but still holding a cache entry)."""
        return self.p.num_evictable

    @property
    def num_cached(self):
        """Blocks holding a prefix-cache entry, referenced or evictable."""
        return self.p.num_cached

    @property
    def num_used(self):
        """Blocks with at least one reference."""
        return self.p.num_blocks - 1 - self.p.num_free

    @property
    def usage(self):
        """Fraction of the non-null blocks that are referenced, 0..1."""
        return (self.p.num_blocks - 1 - self.p.num_free) / <double>(self.p.num_blocks - 1)

    @property
    def enable_prefix_caching(self):
        return bool(self.p.caching)

    @property
    def hash_key(self):
        """The 16-byte key of the block hashes this pool is used with."""
        return self._key

    @property
    def metadata_bytes(self):
        """Bytes of C metadata held (all per-block arrays and the hash table)."""
        return kvb_pool_bytes(&self.p)

    @property
    def record_events(self):
        """Whether KV events are recorded (off by default; then they cost nothing)."""
        return bool(self.p.record_events)

    @record_events.setter
    def record_events(self, bint on):
        self.p.record_events = on

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self, Py_ssize_t n):
        """Allocate ``n`` blocks (ref count 1 each), all-or-nothing; an int32 array of ids.

        Raises OutOfBlocksError when fewer than ``n`` blocks are free or evictable.
        """
        if n < 0 or n > INT32_MAX:
            raise InvalidArgumentError(f"allocate: n must be >= 0, got {n}")
        cdef cnp.ndarray out = new_i32(n)
        cdef int rc = kvb_pool_allocate(&self.p, <int32_t>n, i32_data(out))
        if rc:
            raise_code(rc, f"allocate({n})", self.p.err_a, self.p.err_b)
        return out

    def free(self, ids):
        """Drop one reference of each block; at 0 a block becomes free (evictable if cached).

        Blocks join the free list in the order given: pass a block table reversed so that
        the longest prefixes are evicted first.
        """
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef int rc = kvb_pool_free(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0))
        if rc:
            raise_code(rc, "free", self.p.err_a, self.p.err_b)

    def incref(self, ids):
        """Add one reference to each block (share it); pins evictable cached blocks."""
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef int rc = kvb_pool_incref(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0))
        if rc:
            raise_code(rc, "incref", self.p.err_a, self.p.err_b)

    def ref_count(self, int block_id):
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"ref_count: block {block_id} out of range "
                                       f"[0, {self.p.num_blocks})")
        return self.p.ref_count[block_id]

    def ref_counts(self):
        """All ref counts as a read-only int32 view (zero-copy, live)."""
        return int32_view(self, self.p.ref_count, self.p.num_blocks)

    def is_cached(self, int block_id):
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"is_cached: block {block_id} out of range")
        return bool(self.p.flags[block_id] & KVB_F_CACHED)

    def block_hash(self, int block_id):
        """The 128-bit hash a cached block is registered under, or None."""
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"block_hash: block {block_id} out of range")
        if not self.p.flags[block_id] & KVB_F_CACHED:
            return None
        return hash_int(self.p.hash[block_id])

    def free_list(self):
        """Block ids in the free list, next to be allocated first (a debugging aid)."""
        out = []
        cdef int32_t b = self.p.free_head
        while b != KVB_NONE:
            out.append(b)
            b = self.p.next[b]
        return np.asarray(out, dtype=np.int32)

    def check(self):
        """Verify every invariant in C; raises CorruptionError if one does not hold."""
        cdef int rc = kvb_pool_check(&self.p)
        if rc:
            raise_code(rc, "BlockPool.check", self.p.err_a, self.p.err_b)

    # -- prefix cache -------------------------------------------------------------------------
    def cache(self, ids, hashes, *, parent=None, token_ids=None):
        """Register referenced full blocks under their hashes (from hash_blocks).

        A hash that is already cached keeps its first block; the newcomer stays uncached.
        Returns how many entries were added. ``parent`` and ``token_ids`` (the blocks' tokens,
        concatenated) only feed the BlockStored event.
        """
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef uint64_t[:, ::1] h = as_hashes(hashes)
        cdef Py_ssize_t n = cnp.PyArray_DIM(v, 0)
        if h.shape[0] != n:
            raise InvalidArgumentError(f"cache: {n} ids but {h.shape[0]} hashes")
        if not self.p.caching:
            raise InvalidStateError("cache: prefix caching is disabled on this pool")
        cdef kvb_hash_t par
        cdef kvb_hash_t *ppar = NULL
        if parent is not None:
            par = _parent_hash(parent)
            ppar = &par
        cdef cnp.ndarray toks
        cdef const int32_t *tp = NULL
        cdef int32_t bs = 0
        if token_ids is not None:
            toks = as_int32(token_ids, "token_ids")
            if n == 0 or cnp.PyArray_DIM(toks, 0) % n:
                raise InvalidArgumentError("cache: token_ids must hold whole blocks")
            bs = cnp.PyArray_DIM(toks, 0) // n
            tp = i32_data(toks)
        cdef int64_t stored = 0
        cdef int rc = kvb_cache_insert(&self.p, i32_data(v),
                                       <kvb_hash_t *>&h[0, 0] if n else NULL, n, ppar, tp, bs,
                                       &stored)
        if rc:
            raise_code(rc, "cache", self.p.err_a, self.p.err_b)
        return stored

    def lookup(self, hashes):
        """Ids of the longest cached prefix of ``hashes`` (int32), NOT pinned."""
        cdef uint64_t[:, ::1] h = as_hashes(hashes)
        cdef Py_ssize_t n = h.shape[0]
        cdef cnp.ndarray out = new_i32(n)
        cdef int64_t k = kvb_cache_lookup(&self.p, <kvb_hash_t *>&h[0, 0] if n else NULL, n,
                                          i32_data(out))
        return out[:k]

    def lookup_and_pin(self, hashes):
        """Like lookup, and takes one reference to each hit in the same step (no window in
        which a hit can be evicted). Release them with free()."""
        cdef uint64_t[:, ::1] h = as_hashes(hashes)
        cdef Py_ssize_t n = h.shape[0]
        cdef cnp.ndarray out = new_i32(n)
        cdef int64_t k = kvb_cache_lookup_pin(&self.p, <kvb_hash_t *>&h[0, 0] if n else NULL,
                                              n, i32_data(out))
        return out[:k]

    def reset_prefix_cache(self):
        """Drop every cache entry. Only when no cached block is referenced (else raises)."""
        cdef int rc = kvb_cache_reset(&self.p)
        if rc:
            raise InvalidStateError(f"reset_prefix_cache: {self.p.err_a} of {self.p.err_b} "
                                    f"cached blocks are still referenced")

    @property
    def stats(self):
        """Counters since creation: a CacheStats (also readable like a dict)."""
        s = self.p.stats
        return CacheStats(queries=s.queries, query_blocks=s.query_blocks,
                          hit_blocks=s.hit_blocks, query_tokens=s.query_tokens,
                          hit_tokens=s.hit_tokens, evictions=s.evictions,
                          allocations=s.allocations, frees=s.frees, stored=s.stored)

    def take_events(self):
        """Drain recorded KV events: BlockStored, BlockRemoved and AllBlocksCleared.

        Consecutive stored blocks that chain on each other come as one BlockStored, the way
        vLLM publishes them to KV-aware routers.
        """
        cdef kvb_events_t *ev = &self.p.events
        cdef int64_t i, off
        out = []
        cur = None
        for i in range(ev.n):
            kind = ev.kind[i]
            if kind == KVB_EV_STORED:
                h = hash_int(ev.hash[i])
                par = hash_int(ev.parent[i])
                toks = _event_tokens(ev, i)
                if isinstance(cur, BlockStored) and cur.block_hashes[len(cur.block_hashes) - 1] == par:
                    cur.block_hashes.append(h)
                    cur.token_ids.extend(toks)
                else:
                    cur = BlockStored(block_hashes=[h], parent_block_hash=par,
                                      token_ids=toks, block_size=len(toks))
                    out.append(cur)
            elif kind == KVB_EV_REMOVED:
                h = hash_int(ev.hash[i])
                if isinstance(cur, BlockRemoved):
                    cur.block_hashes.append(h)
                else:
                    cur = BlockRemoved(block_hashes=[h])
                    out.append(cur)
            else:
                cur = AllBlocksCleared()
                out.append(cur)
        kvb_events_clear(ev)
        return out


cdef list _event_tokens(kvb_events_t *ev, int64_t i):
    """Token ids recorded with event i (empty when none were given)."""
    cdef int64_t off = ev.tok_off[i], end = ev.ntok, j
    if off < 0:
        return []
    for j in range(i + 1, ev.n):  # the next event that recorded tokens ends this one's
        if ev.tok_off[j] >= 0:
            end = ev.tok_off[j]
            break
    return [ev.tokens[j] for j in range(off, end)]


# ---------------------------------------------------------------------------------------------
# BlockManager
# ---------------------------------------------------------------------------------------------
cdef class SeqBatch:
    """Pre-resolved sequence handles for append_batch / metadata (a persistent batch).

    Built by BlockManager.batch(seq_ids); it stays valid while those sequences are live
    (a freed sequence is detected through its slot generation).
    """
    cdef readonly object seq_ids
    cdef cnp.ndarray _slots_arr
    cdef cnp.ndarray _gens_arr
    cdef int32_t *slots
    cdef uint32_t *gens
    cdef Py_ssize_t n
    cdef object owner

    def __len__(self):
        return self.n


cdef class BlockManager:
    """Block tables per sequence on top of a BlockPool: the KV memory manager of an engine.

    Not thread-safe: call it from the scheduler thread (as engines do). Its ``pool`` is for
    reading state and prefix-cache statistics; blocks allocated there directly are not
    known to the manager (and ``check()`` would report them).

    >>> from kvblocks import BlockManager
    >>> mgr = BlockManager(num_blocks=16, block_size=4)
    >>> mgr.add("a", [1, 2, 3, 4, 5, 6])
    0
    >>> mgr.fork("a", "b")
    >>> mgr.append("b", [7])          # writes into the shared partial block: copy-on-write
    >>> mgr.take_copies().tolist()
    [[2, 3]]
    >>> mgr.block_table("a").tolist(), mgr.block_table("b").tolist()
    ([1, 2], [1, 3])
    >>> mgr.free("a"); mgr.free("b"); mgr.pool.num_free
    15
    """

    def __cinit__(self, int num_blocks, int block_size, *, bint enable_prefix_caching=True,
                  double watermark=0.0, int num_host_blocks=0, hash_key=None,
                  bint enable_kv_events=False):
        if block_size < 1:
            raise InvalidArgumentError(f"block_size must be >= 1, got {block_size}")
        if not 0.0 <= watermark < 1.0:
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark}")
        if num_host_blocks < 0 or num_host_blocks == 1:
            raise InvalidArgumentError(
                f"num_host_blocks must be 0 (no swapping) or >= 2, got {num_host_blocks}")
        self.pool = BlockPool(num_blocks, enable_prefix_caching=enable_prefix_caching,
                              hash_key=hash_key, enable_kv_events=enable_kv_events)
        self.host_pool = (BlockPool(num_host_blocks, enable_prefix_caching=False)
                          if num_host_blocks else None)
        self._watermark = watermark
        self._watermark_blocks = int(watermark * (num_blocks - 1))
        cdef bytes key = self.pool._key
        rc = kvb_mgr_init(&self.m, &self.pool.p,
                          &self.host_pool.p if self.host_pool is not None else NULL,
                          block_size, <const uint8_t *>key)
        if rc:
            raise_code(rc, "BlockManager", 0, block_size)
        self._initialized = True
        self._slots = {}
        self._ids = []
        self._buf = np.empty(64, dtype=np.int32)
        self._imap = np.zeros(64, dtype=np.int32)

    def __dealloc__(self):
        if self._initialized:
            kvb_mgr_destroy(&self.m)

    def __reduce__(self):
        raise TypeError("BlockManager cannot be pickled")

    def __repr__(self):
        return (f"BlockManager(num_blocks={self.pool.p.num_blocks}, "
                f"block_size={self.m.block_size}, seqs={self.m.nseqs}, "
                f"free={self.pool.p.num_free})")

    # -- helpers ------------------------------------------------------------------------------
    cdef int32_t _slot(self, object seq_id) except -1:
        cdef PyObject *o = PyDict_GetItem(self._slots, seq_id)
        if o is NULL:
            _check_id(seq_id)
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}")
        return <int32_t><object>o

    cdef cnp.ndarray _slots_of(self, object seq_ids, Py_ssize_t *count):
        """Slots of a list of sequence ids (written into a reused buffer) or of a SeqBatch;
        the first *count entries of the returned int32 array are valid."""
        cdef SeqBatch sb
        cdef Py_ssize_t i, n
        cdef PyObject *o
        cdef int32_t *slots
        if type(seq_ids) is SeqBatch:
            sb = <SeqBatch>seq_ids
            if sb.owner is not self:
                raise InvalidArgumentError("this SeqBatch belongs to another BlockManager")
            n = sb.n
            for i in range(n):
                if self.m.seqs[sb.slots[i]].gen != sb.gens[i]:
                    raise UnknownSequenceError(
                        f"sequence {sb.seq_ids[i]!r} of this SeqBatch was freed")
            count[0] = n
            return sb._slots_arr
        if not isinstance(seq_ids, list):
            seq_ids = list(seq_ids)
        n = len(<list>seq_ids)
        if cnp.PyArray_DIM(self._buf, 0) < n:
            self._buf = new_i32(max(n, 2 * cnp.PyArray_DIM(self._buf, 0)))
        slots = <int32_t *>cnp.PyArray_DATA(self._buf)
        cdef int32_t *imap = <int32_t *>cnp.PyArray_DATA(self._imap)
        cdef Py_ssize_t ilen = cnp.PyArray_DIM(self._imap, 0)
        cdef long v
        cdef int overflow
        cdef object sid
        for i in range(n):
            sid = (<list>seq_ids)[i]
            if type(sid) is int:  # small int ids: an array lookup instead of a dict probe
                v = PyLong_AsLongAndOverflow(sid, &overflow)
                if not overflow and 0 <= v < ilen and imap[v]:
                    slots[i] = imap[v] - 1
                    continue
            o = PyDict_GetItem(self._slots, sid)
            if o is NULL:
                _check_id(sid)
                raise UnknownSequenceError(f"unknown sequence {sid!r}")
            slots[i] = <int32_t><object>o
        count[0] = n
        return self._buf

    cdef int _err(self, int rc, str what) except -1:
        return raise_code(rc, what, self.m.err_a, self.m.err_b)

    # -- properties ---------------------------------------------------------------------------
    @property
    def block_size(self):
        return self.m.block_size

    @property
    def watermark(self):
        return self._watermark

    @property
    def num_seqs(self):
        return self.m.nseqs

    def __len__(self):
        return self.m.nseqs

    def __contains__(self, seq_id):
        return seq_id in self._slots

    def seq_ids(self):
        """The live sequence ids (a list, in no particular order)."""
        return list(self._slots)

    # -- scheduling helpers --------------------------------------------------------------------
    def blocks_for_tokens(self, Py_ssize_t num_tokens):
        """Blocks a table of ``num_tokens`` tokens takes (ceil division)."""
        if num_tokens < 0:
            raise InvalidArgumentError(f"num_tokens must be >= 0, got {num_tokens}")
        return (num_tokens + self.m.block_size - 1) // self.m.block_size

    def can_add(self, Py_ssize_t num_tokens):
        """Whether a prompt of ``num_tokens`` fits now while keeping the watermark free.

        Conservative: prefix-cache hits are not counted.
        """
        need = self.blocks_for_tokens(num_tokens)
        return self.pool.p.num_free - need >= self._watermark_blocks

    def blocks_needed(self, seq_id, Py_ssize_t n=1):
        """Blocks appending ``n`` tokens to ``seq_id`` would take now (growth plus
        copy-on-write); for a swapped-out sequence, the blocks swap_in + n tokens needs."""
        if n < 0:
            raise InvalidArgumentError(f"n must be >= 0, got {n}")
        return kvb_mgr_blocks_needed(&self.m, self._slot(seq_id), n)

    def can_append(self, seq_ids, Py_ssize_t n=1):
        """Whether every sequence can take ``n`` more tokens at once (one decode step)."""
        cdef Py_ssize_t count, i
        cdef cnp.ndarray arr = self._slots_of(seq_ids, &count)
        cdef int32_t *slots = i32_data(arr)
        cdef int64_t need = 0
        for i in range(count):
            need += kvb_mgr_blocks_needed(&self.m, slots[i], n)
        return need <= self.pool.p.num_free

    @property
    def num_free_blocks(self):
        return self.pool.p.num_free

    # -- sequence lifecycle ----------------------------------------------------------------------
    def add(self, seq_id, token_ids, *, salt=None):
        """Allocate a block table for a prompt; reuse cached full blocks.

        Returns how many prompt tokens are already in the cache: a multiple of block_size,
        at most ``len(token_ids) - 1`` so that at least one token is computed. Full blocks
        of the prompt are registered in the prefix cache at once: compute the prompt in the
        step it is added (for chunked prefill, add the first chunk and append the rest).
        ``salt`` (tenant, LoRA adapter, ...) isolates the cache: different salts never share.
        """
        _check_id(seq_id)
        if seq_id in self._slots:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        cdef bytes s = as_salt(salt)
        cdef int32_t slot
        cdef int64_t cached
        cdef Py_ssize_t n = cnp.PyArray_DIM(toks, 0)
        cdef int rc = kvb_mgr_add(&self.m, i32_data(toks), n, <const uint8_t *>s,
                                  len(s), &slot, &cached)
        if rc:
            self._err(rc, f"add({seq_id!r}, {n} tokens)")
        self._register(seq_id, slot)
        return cached

    cdef _register(self, object seq_id, int32_t slot):
        self._slots[seq_id] = slot
        cdef Py_ssize_t cap
        if type(seq_id) is int and 0 <= seq_id < _IMAP_LIMIT:
            cap = cnp.PyArray_DIM(self._imap, 0)
            if seq_id >= cap:
                while cap <= seq_id:
                    cap *= 2
                grown = np.zeros(cap, dtype=np.int32)
                grown[:cnp.PyArray_DIM(self._imap, 0)] = self._imap
                self._imap = grown
            (<int32_t *>cnp.PyArray_DATA(self._imap))[<Py_ssize_t>seq_id] = slot + 1
        while len(self._ids) <= slot:
            self._ids.append(None)
        self._ids[slot] = seq_id

    def append(self, seq_id, token_ids):
        """Commit tokens: grow the table, copy-on-write a shared last block, and register
        blocks that become full in the prefix cache."""
        cdef int32_t slot = self._slot(seq_id)
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        cdef Py_ssize_t n = cnp.PyArray_DIM(toks, 0)
        cdef int rc = kvb_mgr_append(&self.m, slot, i32_data(toks), n)
        if rc:
            self._err(rc, f"append({seq_id!r}, {n} tokens)")

    def append_batch(self, seq_ids, token_ids):
        """One token for each sequence in one native call (the decode step).

        ``seq_ids`` is a list of ids or a SeqBatch from batch(); ``token_ids`` one token per
        sequence. All-or-nothing: if the step does not fit, nothing is appended.
        """
        cdef Py_ssize_t n
        cdef cnp.ndarray slots = self._slots_of(seq_ids, &n)
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        if cnp.PyArray_DIM(toks, 0) != n:
            raise InvalidArgumentError(
                f"append_batch: {n} sequences but {cnp.PyArray_DIM(toks, 0)} tokens")
        if n == 0:
            return
        cdef int rc = kvb_mgr_append_batch(&self.m, i32_data(slots), i32_data(toks), n)
        if rc:
            if rc == KVB_EDUP:
                raise InvalidArgumentError(
                    f"append_batch: sequence {self._ids[self.m.err_b]!r} appears twice")
            if rc == KVB_EUNKNOWN:
                raise UnknownSequenceError("append_batch: unknown sequence")
            if rc == KVB_ESTATE:
                raise InvalidStateError(
                    f"append_batch: sequence {self._ids[self.m.err_b]!r} is swapped out")
            self._err(rc, f"append_batch({n} sequences)")

    def batch(self, seq_ids):
        """Resolve sequence ids once into a SeqBatch for repeated append_batch / metadata."""
        cdef Py_ssize_t n, i
        cdef cnp.ndarray slots = self._slots_of(seq_ids, &n)
        cdef SeqBatch sb = SeqBatch.__new__(SeqBatch)
        sb.seq_ids = tuple(seq_ids)
        sb.n = n
        sb._slots_arr = slots[:n].copy()
        sb._gens_arr = np.empty(n, dtype=np.uint32)
        sb.slots = <int32_t *>cnp.PyArray_DATA(sb._slots_arr)
        sb.gens = <uint32_t *>cnp.PyArray_DATA(sb._gens_arr)
        for i in range(n):
            sb.gens[i] = self.m.seqs[sb.slots[i]].gen
        sb.owner = self
        return sb

    def reserve(self, seq_id, Py_ssize_t n):
        """Ensure ``n`` more writable slots exist after the committed tokens (lookahead,
        speculative decoding); copy-on-write a shared last block."""
        cdef int32_t slot = self._slot(seq_id)
        cdef int rc = kvb_mgr_reserve(&self.m, slot, n)
        if rc:
            self._err(rc, f"reserve({seq_id!r}, {n})")

    def truncate(self, seq_id, Py_ssize_t num_tokens):
        """Roll back to ``num_tokens`` committed tokens (rejected drafts); frees the blocks
        past them, reserved ones included."""
        cdef int32_t slot = self._slot(seq_id)
        cdef int rc = kvb_mgr_truncate(&self.m, slot, num_tokens)
        if rc:
            if rc == KVB_EINVAL:
                raise InvalidArgumentError(
                    f"truncate({seq_id!r}, {num_tokens}): must be in [0, {self.m.err_a}]")
            self._err(rc, f"truncate({seq_id!r}, {num_tokens})")

    def fork(self, parent_id, child_id):
        """Child shares every committed block of the parent (ref counts raised)."""
        cdef int32_t pslot = self._slot(parent_id)
        _check_id(child_id)
        if child_id in self._slots:
            raise DuplicateSequenceError(f"sequence {child_id!r} already exists")
        cdef int32_t slot
        cdef int rc = kvb_mgr_fork(&self.m, pslot, &slot)
        if rc:
            self._err(rc, f"fork({parent_id!r}, {child_id!r})")
        self._register(child_id, slot)

    def free(self, seq_id):
        """Release the sequence; its blocks return to the pool tail first (cached full
        blocks stay evictable, longest prefixes evicted first)."""
        cdef int32_t slot = self._slot(seq_id)
        kvb_mgr_free(&self.m, slot)
        del self._slots[seq_id]
        if type(seq_id) is int and 0 <= seq_id < cnp.PyArray_DIM(self._imap, 0):
            (<int32_t *>cnp.PyArray_DATA(self._imap))[<Py_ssize_t>seq_id] = 0
        self._ids[slot] = None

    # -- queries ------------------------------------------------------------------------------
    def block_table(self, seq_id):
        """Physical block ids in logical order (an int32 copy)."""
        cdef int32_t slot = self._slot(seq_id)
        cdef kvb_seq_t *s = &self.m.seqs[slot]
        cdef cnp.ndarray out = new_i32(s.nblocks)
        if s.nblocks:
            memcpy(cnp.PyArray_DATA(out), s.blocks, s.nblocks * sizeof(int32_t))
        return out

    def num_tokens(self, seq_id):
        return self.m.seqs[self._slot(seq_id)].ntokens

    def token_ids(self, seq_id):
        """Committed token ids (an int32 copy)."""
        cdef kvb_seq_t *s = &self.m.seqs[self._slot(seq_id)]
        out = np.empty(s.ntokens, dtype=np.int32)
        cdef int32_t[::1] o = out
        if s.ntokens:
            memcpy(&o[0], s.tokens, s.ntokens * sizeof(int32_t))
        return out

    def block_hashes(self, seq_id):
        """Hashes of the full blocks, (n, 2) uint64 (empty without prefix caching)."""
        cdef kvb_seq_t *s = &self.m.seqs[self._slot(seq_id)]
        out = np.empty((s.nhashed, 2), dtype=np.uint64)
        cdef uint64_t[:, ::1] o = out
        if s.nhashed:
            memcpy(&o[0, 0], s.hashes, s.nhashed * sizeof(kvb_hash_t))
        return out

    def is_swapped(self, seq_id):
        return bool(self.m.seqs[self._slot(seq_id)].swapped)

    @property
    def num_pending_copies(self):
        """Copy-on-write copies queued and not yet drained by take_copies()."""
        return self.m.ncopies

    def take_copies(self):
        """Drain the pending (src, dst) block copies from copy-on-write: int64 [n, 2].

        Execute them (ops.copy_blocks) before the step writes any KV (and before swap pairs
        from the same step). A copy whose dst block is released before it is drained (free,
        truncate, swap_out) is dropped: nothing will read that block.
        """
        cdef int64_t n = self.m.ncopies
        out = np.empty((n, 2), dtype=np.int64)
        cdef int64_t[:, ::1] o = out
        if n:
            memcpy(&o[0, 0], self.m.copies, 2 * n * sizeof(int64_t))
        self.m.ncopies = 0
        return out

    # -- swap ---------------------------------------------------------------------------------
    def swap_out(self, seq_id):
        """Move a sequence's blocks to the host pool: (device block, host block) int64 pairs
        for ops.swap_blocks. Blocks shared with other sequences stay on the device for them
        (this sequence gets its own host copy); cached blocks stay evictable on the device."""
        if self.host_pool is None:
            raise InvalidStateError("swap_out: no host pool (num_host_blocks=0)")
        cdef int32_t slot = self._slot(seq_id)
        if self.m.seqs[slot].swapped:
            raise InvalidStateError(f"swap_out: sequence {seq_id!r} is already swapped out")
        out = np.empty((self.m.seqs[slot].nblocks, 2), dtype=np.int64)
        cdef int64_t[:, ::1] o = out
        cdef int rc = kvb_mgr_swap_out(&self.m, slot, &o[0, 0] if o.shape[0] else NULL)
        if rc:
            if rc == KVB_EOUTOFBLOCKS:
                raise OutOfBlocksError(f"swap_out({seq_id!r}): need {self.m.err_a} host "
                                       f"blocks, {self.m.err_b} free")
            self._err(rc, f"swap_out({seq_id!r})")
        return out

    def swap_in(self, seq_id):
        """Bring a swapped-out sequence back: (host block, device block) int64 pairs. Its
        full blocks are registered in the prefix cache again."""
        if self.host_pool is None:
            raise InvalidStateError("swap_in: no host pool (num_host_blocks=0)")
        cdef int32_t slot = self._slot(seq_id)
        if not self.m.seqs[slot].swapped:
            raise InvalidStateError(f"swap_in: sequence {seq_id!r} is not swapped out")
        out = np.empty((self.m.seqs[slot].nblocks, 2), dtype=np.int64)
        cdef int64_t[:, ::1] o = out
        cdef int rc = kvb_mgr_swap_in(&self.m, slot, &o[0, 0] if o.shape[0] else NULL)
        if rc:
            self._err(rc, f"swap_in({seq_id!r})")
        return out

    # -- metadata -----------------------------------------------------------------------------
    def metadata(self, seq_ids, query_lens, *, out=None):
        """Attention metadata for one forward step, built natively.

        For each sequence the last ``query_lens[i]`` committed tokens are this step's queries.
        With ``out`` (an AttentionMetadata from ``AttentionMetadata.allocate``) the arrays are
        written into its fixed buffers (CUDA-graph friendly) and views of the used part are
        returned; otherwise fresh arrays are allocated.
        """
        cdef Py_ssize_t B, i
        cdef cnp.ndarray slot_arr = self._slots_of(seq_ids, &B)
        cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
        if cnp.PyArray_DIM(q_arr, 0) != B:
            raise InvalidArgumentError(
                f"metadata: {B} sequences but {cnp.PyArray_DIM(q_arr, 0)} query_lens")
        cdef int32_t *slots = i32_data(slot_arr)
        cdef int32_t *q = i32_data(q_arr)
        cdef int64_t ntok = 0, nidx = 0, nb, maxb = 0
        cdef kvb_seq_t *s
        if out is None:
            for i in range(B):
                s = &self.m.seqs[slots[i]]
                nb = (s.ntokens + self.m.block_size - 1) // self.m.block_size
                nidx += nb
                maxb = nb if nb > maxb else maxb
                ntok += q[i] if q[i] > 0 else 0
            out = AttentionMetadata.allocate(max(B, 1), ntok, max(nidx, 1), max(maxb, 1))
        return self._fill_meta(out, slots, q, B)

    cdef object _fill_meta(self, object out, int32_t *slots, int32_t *q, Py_ssize_t B):
        """Validate the buffers of ``out``, run the native builder into them and return an
        AttentionMetadata of views over the used part."""
        cdef kvb_meta_t meta
        memset(&meta, 0, sizeof(meta))
        sm, bt, sl = out.slot_mapping, out.block_tables, out.seq_lens
        qo, kvp, kvi, last = out.qo_indptr, out.kv_indptr, out.kv_indices, out.kv_last_page_len
        meta.slot_mapping = <int64_t *>buf_ptr(sm, cnp.NPY_INT64, 1, 0, "slot_mapping")
        meta.seq_lens = <int32_t *>buf_ptr(sl, cnp.NPY_INT32, 1, B, "seq_lens")
        meta.qo_indptr = <int32_t *>buf_ptr(qo, cnp.NPY_INT32, 1, B + 1, "qo_indptr")
        meta.kv_indptr = <int32_t *>buf_ptr(kvp, cnp.NPY_INT32, 1, B + 1, "kv_indptr")
        meta.kv_indices = <int32_t *>buf_ptr(kvi, cnp.NPY_INT32, 1, 0, "kv_indices")
        meta.kv_last_page_len = <int32_t *>buf_ptr(last, cnp.NPY_INT32, 1, B,
                                                   "kv_last_page_len")
        meta.cap_tokens = cnp.PyArray_DIM(<cnp.ndarray>sm, 0)
        meta.cap_indices = cnp.PyArray_DIM(<cnp.ndarray>kvi, 0)
        if bt is not None:
            meta.block_tables = <int32_t *>buf_ptr(bt, cnp.NPY_INT32, 2, B, "block_tables")
            meta.max_blocks = <int32_t>cnp.PyArray_DIM(<cnp.ndarray>bt, 1)
        cdef cnp.ndarray rows = out._row_cache
        if rows is not None and out._owner is self:
            meta.row_cache = <int64_t *>cnp.PyArray_DATA(rows)
            meta.cap_rows = cnp.PyArray_DIM(rows, 0) // 4
            meta.valid_rows = out._valid_rows
        elif rows is not None:  # first use, or another manager's buffers: start afresh
            meta.row_cache = <int64_t *>cnp.PyArray_DATA(rows)
            meta.cap_rows = cnp.PyArray_DIM(rows, 0) // 4
            meta.valid_rows = 0
        cdef int rc = kvb_mgr_metadata(&self.m, slots, q, B, &meta)
        if rc:
            if rc == KVB_ERANGE:
                raise InvalidArgumentError(
                    f"metadata: needs {self.m.err_a}, buffer holds {self.m.err_b}")
            if rc == KVB_EINVAL:
                raise InvalidArgumentError(
                    f"metadata: query_lens[{self.m.err_a}] = {self.m.err_b} is not in "
                    f"[0, num_tokens]")
            if rc == KVB_ESTATE:
                raise InvalidStateError("metadata: a sequence is swapped out")
            self._err(rc, "metadata")
        if rows is not None:
            out._owner = self
            out._valid_rows = meta.valid_rows
        cdef Py_ssize_t nt = meta.n_tokens, ni = meta.n_indices
        return AttentionMetadata(sm[:nt], bt[:B] if bt is not None else None, sl[:B],
                                 qo[:B + 1], kvp[:B + 1], kvi[:ni], last[:B], nt, B)

    def check(self):
        """Verify the pool, the host pool and every block table (ref counts equal the
        references the tables hold, hashes match the tokens); raises CorruptionError."""
        cdef int rc = kvb_mgr_check(&self.m)
        if rc:
            raise_code(rc, "BlockManager.check", self.m.err_a, self.m.err_b)


cdef inline int _check_id(object seq_id) except -1:
    if type(seq_id) is int or type(seq_id) is str:
        return 0
    if isinstance(seq_id, (int, str)) and not isinstance(seq_id, bool):
        return 0
    raise InvalidTypeError(f"sequence ids must be int or str, got {type(seq_id).__name__}")


def siphash128(key, data) -> bytes:
    """SipHash-2-4 with 128-bit output of ``data`` under a 16-byte ``key`` (16 bytes out,
    the reference implementation's byte order). Exposed for known-answer tests.

    >>> siphash128(bytes(range(16)), b"").hex()
    'a3817f04ba25a8e66df67214c7550293'
    """
    cdef bytes k = as_key(key)
    cdef bytes d = bytes(data)
    cdef kvb_hash_t h
    kvb_siphash128(<const uint8_t *>k, <const char *>d, len(d), &h)
    return (<char *>&h)[:16]
