# BlockPool and the read-only views it exports (included by _core.pyx).

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_Check, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.string cimport memcmp

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
# BlockPool
# ---------------------------------------------------------------------------------------------
# no_gc_clear: __dealloc__ must find the objects it points into (a host pool's device pool)
# still alive when a reference cycle holding it is collected
@cython.no_gc_clear
cdef class BlockPool:
    """A pool of ``num_blocks`` KV blocks with ref counts, a free list and a prefix cache.

    Block 0 is the reserved null block: it pads block tables and is never handed out. A
    pool of the null block alone (``num_blocks=1``, vLLM's ``num_gpu_blocks == 1``) is
    valid: it has nothing to allocate.

    A BlockManager's host pool (``mgr.host_pool``) with a host tier is always current: every
    call and property first demotes the evictions the device pool made since (the tier
    records them on the allocation path and flushes them lazily), so counters, lookups and
    events never lag behind the manager.

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

    def __cinit__(self, num_blocks, *, bint enable_prefix_caching=True, hash_key=None,
                  bint enable_kv_events=False, block_size=None, hash_algo="siphash",
                  hash_seed=None):
        cdef int32_t nb = <int32_t>as_int(num_blocks, "num_blocks (block 0 is the null block)",
                                          1, INT32_MAX - 1)
        self._algo = as_algo(hash_algo)
        if hash_key is not None and self._algo != KVB_HASH_SIPHASH:
            raise InvalidArgumentError(f"hash_key applies to the siphash mode only, not "
                                       f"{hash_algo!r}")
        self._seed = effective_seed(self._algo, hash_seed)
        self._none_hash = none_hash_of(self._algo, self._seed)
        self._tag_ctx = [(None, None, None)]
        self._tags = {}
        self._wire_keep = []
        self._wire_cap = 16
        self._wire_tags = <kvb_wire_tag_t *>calloc(self._wire_cap, sizeof(kvb_wire_tag_t))
        if self._wire_tags is NULL:
            raise MemoryError()
        self._key = as_key(hash_key)
        self._block_size = (None if block_size is None else
                            as_int(block_size, "block_size", 1, INT32_MAX))
        rc = kvb_pool_init_any(&self.p, nb, enable_prefix_caching)
        if rc:
            raise_code(rc, "BlockPool", 0, num_blocks)
        self.p.record_events = enable_kv_events
        self._medium = "GPU"
        self._initialized = True

    def __dealloc__(self):
        if self._initialized:
            kvb_pool_destroy(&self.p)
        free(self._wire_tags)

    def __reduce__(self):
        raise TypeError("BlockPool cannot be pickled")

    cdef void _sync(self) noexcept:
        """A host pool of a tier: give the device evictions recorded since the last flush
        their host blocks (kvb_tier_flush), so that what this pool reports is current."""
        if self._tier_pool is not None and self._tier_pool.p.tier is not NULL:
            kvb_tier_flush(self._tier_pool.p.tier)

    def __repr__(self):
        self._sync()
        return (f"BlockPool(num_blocks={self.p.num_blocks}, free={self.p.num_free}, "
                f"cached={self.p.num_cached}, evictable={self.p.num_evictable})")

    # -- sizes ------------------------------------------------------------------------------
    @property
    def num_blocks(self):
        """Total blocks, including the null block."""
        return self.p.num_blocks

    @property
    def num_free(self):
        """Allocatable now: never-cached free blocks plus evictable cached ones (current
        on a host tier's pool: the device's evictions since are demoted first)."""
        self._sync()
        return self.p.num_free

    @property
    def num_evictable(self):
        """Cached blocks with no reference (free, but still holding a cache entry)."""
        self._sync()
        return self.p.num_evictable

    @property
    def num_cached(self):
        """Blocks holding a prefix-cache entry, referenced or evictable (current on a host
        tier's pool: the device's evictions since are demoted first)."""
        self._sync()
        return self.p.num_cached

    @property
    def num_used(self):
        """Blocks with at least one reference."""
        self._sync()
        return self.p.num_blocks - 1 - self.p.num_free

    @property
    def usage(self):
        """Fraction of the non-null blocks that are referenced, 0..1."""
        self._sync()
        if self.p.num_blocks == 1:  # the null block alone
            return 0.0
        return (self.p.num_blocks - 1 - self.p.num_free) / <double>(self.p.num_blocks - 1)

    @property
    def enable_prefix_caching(self):
        return bool(self.p.caching)

    @property
    def hash_key(self):
        """The 16-byte key of the block hashes this pool is used with."""
        return self._key

    @property
    def hash_algo(self):
        """The hash mode of this pool's block hashes (see ``kvblocks.hash_blocks``)."""
        return HASH_ALGOS[self._algo]

    @property
    def hash_seed(self):
        """vLLM's NONE_HASH seed in the vLLM modes (the one given, else PYTHONHASHSEED at
        creation, else "vllm-none-hash"); None in the other modes."""
        return self._seed

    def hash_blocks(self, token_ids, *, parent=None, salt=None, lora_name=None,
                    bint digests=False):
        """``kvblocks.hash_blocks`` in this pool's mode, key, seed and block size.

        >>> from kvblocks import BlockPool
        >>> pool = BlockPool(8, block_size=4, hash_algo="sglang_sha256")
        >>> int(pool.hash_blocks([1, 2, 3, 4])[0, 0]) - (1 << 64)  # the router's int64
        -3488128144981237669
        """
        if self._block_size is None:
            raise InvalidStateError("hash_blocks: this pool has no block_size (give "
                                    "BlockPool(..., block_size=) or use kvblocks.hash_blocks)")
        return hash_blocks(token_ids, self._block_size, parent=parent, salt=salt,
                           key=self._key if self._algo == KVB_HASH_SIPHASH else None,
                           algo=HASH_ALGOS[self._algo], seed=self._seed,
                           lora_name=lora_name, digests=digests)

    cdef int32_t _event_tag(self, object lora_name, object lora_id, object salt) except -1:
        """The event tag of what a request's stored blocks carry (0: no adapter, no salt),
        registered on first use: the adapter's name and int id, and the cache salt (vLLM's
        extra key of a chain's first block; an empty salt is none, as in vLLM). One entry per
        distinct (adapter, id, salt) seen, kept for the pool's life."""
        if lora_id is not None:
            lora_id = as_int(lora_id, "lora_id", 0, INT64_MAX)
            if lora_name is None:
                raise InvalidArgumentError("lora_id needs lora_name (vLLM's adapter has both)")
        if salt is not None:
            if isinstance(salt, (bytearray, memoryview)):
                salt = bytes(salt)
            elif not isinstance(salt, (str, bytes)):
                raise InvalidTypeError(f"salt must be str or bytes, got {type(salt).__name__}")
            if not salt:
                salt = None
        if lora_name is None and salt is None:
            return 0
        cdef tuple k = (lora_name, lora_id, salt)
        cdef object t = self._tags.get(k)
        if t is not None:
            return <int32_t>t
        if len(self._tag_ctx) >= INT32_MAX:
            raise InvalidArgumentError("too many distinct (LoRA adapter, salt) pairs")
        cdef int32_t n = <int32_t>len(self._tag_ctx)
        cdef kvb_wire_tag_t *grown
        if n >= self._wire_cap:
            grown = <kvb_wire_tag_t *>realloc(self._wire_tags,
                                              2 * self._wire_cap * sizeof(kvb_wire_tag_t))
            if grown is NULL:
                raise MemoryError()
            self._wire_tags = grown
            self._wire_cap *= 2
        cdef bytes ln = lora_name.encode() if lora_name is not None else None
        cdef bytes sb = (salt.encode() if isinstance(salt, str) else salt) if salt is not None \
            else None
        cdef kvb_wire_tag_t *w = &self._wire_tags[n]
        memset(w, 0, sizeof(kvb_wire_tag_t))
        if ln is not None:
            w.lora_name = <const uint8_t *><char *>ln
            w.lora_name_len = <int32_t>len(ln)
        if lora_id is not None:
            w.has_lora_id = 1
            w.lora_id = lora_id
        if sb is not None:
            w.salt = <const uint8_t *><char *>sb
            w.salt_len = <int32_t>len(sb)
            w.salt_bin = not isinstance(salt, str)
        self._wire_keep.append((ln, sb))
        self._tag_ctx.append(k)
        self._tags[k] = n
        return n

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
    def allocate(self, n):
        """Allocate ``n`` blocks (ref count 1 each), all-or-nothing; an int32 array of ids.

        Raises OutOfBlocksError when fewer than ``n`` blocks are free or evictable.
        """
        self._sync()
        cdef int64_t k = as_int(n, "allocate: n", 0, INT32_MAX)
        cdef cnp.ndarray out = new_i32(k)
        cdef int rc = kvb_pool_allocate(&self.p, <int32_t>k, i32_data(out))
        if rc:
            raise_code(rc, f"allocate({k})", self.p.err_a, self.p.err_b)
        return out

    def free(self, ids, order=None):
        """Drop one reference of each block; at 0 a block becomes free (evictable if cached).

        Blocks join the free list in the order given: pass a block table reversed so that
        the longest prefixes are evicted first. By default each block reaching 0 without a
        cache entry is pushed at the head (the last given ends first) and a cached one joins
        the tail. ``order="vllm"`` is vLLM's ``free_blocks(ordered)`` instead: those without
        an entry go to the head as one batch in the order given (the first given ends
        first), cached ones to the tail in the order they reach 0. Raises
        InvalidArgumentError for another ``order``, an id out of range or the null block,
        InvalidStateError for a free block (nothing changed).

        >>> pool = BlockPool(6)
        >>> ids = pool.allocate(5)
        >>> pool.cache(ids[2:4], hash_blocks(range(8), 4))
        2
        >>> pool.free([5, 3, 1, 4, 2], order="vllm"); pool.free_list().tolist()
        [5, 1, 2, 3, 4]
        """
        self._sync()
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef int rc
        if order is None:
            rc = kvb_pool_free(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0))
        elif order == "vllm":
            rc = kvb_pool_free_placed(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0),
                                      KVB_PLACE_VLLM)
        else:
            raise InvalidArgumentError(f"free: order must be None or 'vllm', not {order!r}")
        if rc:
            raise_code(rc, "free", self.p.err_a, self.p.err_b)

    def allocate_one(self):
        """Allocate one block (ref count 1) and return its id as an int: ``allocate(1)``
        without the one-element array (the scalar path of an engine that grows one table at
        a time). Raises OutOfBlocksError when no block is free or evictable.

        >>> pool = BlockPool(4)
        >>> b = pool.allocate_one(); pool.ref_count(b)
        1
        >>> pool.free_one(b); pool.num_free
        3
        """
        self._sync()
        cdef int32_t b
        cdef int rc = kvb_pool_allocate(&self.p, 1, &b)
        if rc:
            raise_code(rc, "allocate_one()", self.p.err_a, self.p.err_b)
        return b

    def free_one(self, block_id):
        """Drop one reference of one block: ``free([block_id])`` for an int (numpy integers
        too), with free's checks and errors."""
        self._sync()
        cdef int32_t b = <int32_t>as_int(block_id, "block_id", INT32_MIN, INT32_MAX)
        cdef int rc = kvb_pool_free(&self.p, &b, 1)
        if rc:
            raise_code(rc, "free_one", self.p.err_a, self.p.err_b)

    def incref(self, ids):
        """Add one reference to each block (share it); pins evictable cached blocks."""
        self._sync()
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef int rc = kvb_pool_incref(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0))
        if rc:
            raise_code(rc, "incref", self.p.err_a, self.p.err_b)

    def touch(self, ids):
        """vLLM's ``BlockPool.touch``: add one reference to each block, where a free block
        (cached or not) leaves the free list from wherever it is; ``incref`` refuses a free
        block without a cache entry. Raises InvalidArgumentError for an id out of range or the
        null block (nothing changed).

        >>> pool = BlockPool(4)
        >>> pool.touch([2]); pool.ref_count(2), pool.free_list().tolist()
        (1, [1, 3])
        """
        self._sync()
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef int rc = kvb_pool_touch(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0))
        if rc:
            raise_code(rc, "touch", self.p.err_a, self.p.err_b)

    def free_to(self, ids, where):
        """``free`` with the placement chosen here instead of by the cache entry: every
        block reaching 0 references goes to the free list's ``"head"`` (reused first, the
        batch in the order given: vLLM's ``free_blocks(..., evict_first=True)``) or to its
        ``"tail"`` (reused last, in the order given); a cached block keeps its entry and is
        evictable. Raises InvalidArgumentError for another ``where``, and free's errors
        (nothing changed).

        >>> pool = BlockPool(5)
        >>> ids = pool.allocate(3); pool.free_to(ids, "tail"); pool.free_list().tolist()
        [4, 1, 2, 3]
        >>> ids = pool.allocate(4); pool.free_to(ids[:2], "head"); pool.free_list().tolist()
        [4, 1]
        """
        self._sync()
        cdef int w
        if where == "head":
            w = KVB_PLACE_HEAD
        elif where == "tail":
            w = KVB_PLACE_TAIL
        else:
            raise InvalidArgumentError(f"free_to: where must be 'head' or 'tail', not {where!r}")
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef int rc = kvb_pool_free_placed(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0), w)
        if rc:
            raise_code(rc, "free_to", self.p.err_a, self.p.err_b)

    def uncache(self, ids):
        """vLLM's ``evict_blocks``: drop the cache entry of each listed block that has one
        (referenced or not; with every key ``add_key`` gave it) and return how many blocks
        were dropped. A free block keeps its place
        in the free list (no longer evictable); a referenced one, once freed, goes to the
        head as a block without an entry. Raises InvalidArgumentError for an id out of range
        or the null block (nothing changed).
        """
        self._sync()
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef int64_t rc = kvb_pool_uncache_ids(&self.p, i32_data(v), cnp.PyArray_DIM(v, 0))
        if rc < 0:
            raise_code(<int>rc, "uncache", self.p.err_a, self.p.err_b)
        return rc

    def move_entry(self, src, dst):
        """vLLM's ``BlockPool.move_block_hashes``: block ``src``'s cache entry moves to
        block ``dst`` (a copy of it), under the same hash and group, with every key
        ``add_key`` gave it (in the same order). ``dst`` takes the last place among each
        key's duplicates; ``src`` keeps its place (in a table, or in the
        free list, where it is no longer evictable) without an entry. No event is recorded:
        the cache holds the same hashes. Raises InvalidArgumentError for an id out of range,
        the null block or ``src == dst``, InvalidStateError when ``src`` holds no entry or
        ``dst`` holds one or is free (nothing changed).

        >>> pool = BlockPool(4)
        >>> ids = pool.allocate(2)
        >>> pool.cache(ids[:1], hash_blocks(range(4), 4))
        1
        >>> pool.move_entry(1, 2); pool.is_cached(1), pool.is_cached(2)
        (False, True)
        """
        self._sync()
        cdef int32_t s = <int32_t>as_int(src, "src", INT32_MIN, INT32_MAX)
        cdef int32_t d = <int32_t>as_int(dst, "dst", INT32_MIN, INT32_MAX)
        cdef int rc = kvb_pool_move_entry(&self.p, s, d)
        if rc:
            raise_code(rc, "move_entry", self.p.err_a, self.p.err_b)

    def cached_blocks(self, hash):
        """Every block cached under ``hash`` (one ``[lo, hi]`` uint64 row, or a 128-bit
        int), the earliest first (the one lookups return); a hash has several only through
        ``cache(..., dup=True)`` or ``add_key`` (a block holding it as a secondary key counts
        in its place). An empty int32 array when none. Raises InvalidTypeError /
        InvalidArgumentError for a bad hash."""
        self._sync()
        cdef kvb_hash_t h = _parent_hash(hash)
        cdef int32_t e = kvb_cache_find_entry(&self.p, &h) if self.p.caching else KVB_NONE
        cdef int32_t nb = self.p.num_blocks
        out = []
        while e != KVB_NONE:  # entries: a block's primary, or nb + a secondary record
            out.append(e if e < nb else self.p.xblock[e - nb])
            e = self.p.dnext[e] if self.p.dnext is not NULL else KVB_NONE
        return np.asarray(out, dtype=np.int32)

    # -- secondary keys (vLLM's cached_block_hashes_by_block) --------------------------------
    def add_key(self, block, key):
        """Give cached block ``block`` one more key (vLLM's ``_insert_block_hash`` onto a
        block that has its hash: a "partial-prefix" key): ``key`` (one ``[lo, hi]`` uint64
        row or a 128-bit int) then finds the block too, behind any blocks already under it
        (lookups return the earliest). Returns True when added, False when the block
        already holds that key (its own hash, or an earlier ``add_key``).

        The keys live and leave with the block's entry: evicting it (allocation),
        ``uncache`` and ``reset_prefix_cache`` drop them all, ``move_entry`` moves them all.
        While events are recorded each key gets a BlockStored (no parent, no tokens) and a
        BlockRemoved when it leaves, after its block's. Raises InvalidArgumentError for a
        block out of range, the null block or a bad key, InvalidTypeError for a non-int
        block or key of another type, InvalidStateError for a block without a cache entry
        or a pool of a host tier (nothing changed).

        >>> pool = BlockPool(8)
        >>> h = hash_blocks(range(8), 4)
        >>> pool.cache(pool.allocate(1), h[:1])
        1
        >>> pool.add_key(1, h[1]), pool.add_key(1, h[1]), pool.add_key(1, h[0])
        (True, False, False)
        >>> pool.lookup(h[1:]).tolist(), pool.num_cached, pool.num_entries
        ([1], 1, 2)
        >>> pool.uncache([1]), pool.lookup(h[1:]).tolist(), pool.num_entries
        (1, [], 0)
        """
        self._sync()
        cdef int32_t b = <int32_t>as_int(block, "add_key: block", INT32_MIN, INT32_MAX)
        cdef kvb_hash_t h = _one_key(key, "add_key: key")
        cdef int rc = kvb_cache_add_key(&self.p, b, &h, NULL)
        if rc < 0:
            self._key_error(rc, "add_key", b)
        return rc == 1

    def add_key_bytes(self, block, hash, *, group=0, uint64_t key_salt=0):
        """``add_key`` with the key of one of vLLM's bytes hashes, as ``cache_bytes`` keys
        blocks: its first 16 bytes (zero-padded when shorter), ``key_salt`` XORed into the
        second 8. A 32-byte hash is kept whole with the key: ``lookup_bytes(..., full=)``
        checks a hit through this key against those 32 bytes (not against ``full[block]``,
        the block's own hash); a shorter one keeps zeros, which never match. ``group`` must
        be the group the block was cached for. As ``cache_bytes``, it records no event:
        raises InvalidStateError while this pool records events. Other errors as
        ``add_key``, and InvalidTypeError for a hash that is not bytes, InvalidArgumentError
        for another ``group`` (nothing changed).

        >>> pool = BlockPool(8)
        >>> h = [bytes([i]) * 32 for i in (1, 2)]
        >>> full = np.zeros((8, 4), dtype=np.uint64)
        >>> pool.cache_bytes(pool.allocate(1), h, full=full)
        1
        >>> pool.add_key_bytes(1, h[1]), pool.lookup_bytes(h[1:], full=full).tolist()
        (True, [1])
        >>> pool.keys_of(1).shape
        (2, 2)
        """
        self._sync()
        cdef int32_t b = <int32_t>as_int(block, "add_key_bytes: block", INT32_MIN, INT32_MAX)
        if not PyBytes_Check(hash):
            raise InvalidTypeError(f"add_key_bytes: hash is {type(hash).__name__}, not bytes")
        cdef uint8_t g = <uint8_t>as_int(group, "group", 0, 254)
        if self.p.record_events:
            raise InvalidStateError("add_key_bytes: records no events; this pool records "
                                    "them (use add_key)")
        if (0 < b < self.p.num_blocks and self.p.flags[b] & KVB_F_CACHED
                and self.p.gid[b] != g):
            raise InvalidArgumentError(f"add_key_bytes: block {b} is cached for group "
                                       f"{self.p.gid[b]}, not {g}")
        cdef kvb_hash_t h
        cdef Py_ssize_t w = PyBytes_GET_SIZE(hash)
        memset(&h, 0, sizeof(h))
        memcpy(&h, PyBytes_AS_STRING(hash), min(w, 16))
        h.hi ^= key_salt
        cdef const uint64_t *full = (<const uint64_t *>PyBytes_AS_STRING(hash)) if w == 32 \
            else NULL
        cdef int rc = kvb_cache_add_key(&self.p, b, &h, full)
        if rc < 0:
            self._key_error(rc, "add_key_bytes", b)
        return rc == 1

    cdef int _key_error(self, int rc, str what, int32_t b) except -1:
        """Raise for add_key's code rc on block b."""
        msg = None
        if rc == KVB_ESTATE:
            msg = (f"{what}: block {b} holds no cache entry" if not self.p.flags[b] & KVB_F_CACHED
                   else f"{what}: a host tier's pool takes no secondary keys")
        elif rc == KVB_ERANGE:
            msg = f"{what}: block {b} out of range [1, {self.p.num_blocks})"
        return raise_code(rc, what, self.p.err_a, self.p.err_b, NULL, None, msg)

    def keys_of(self, block):
        """Every key block ``block`` holds, as an (n, 2) uint64 array of ``[lo, hi]`` rows:
        its hash first (``block_hash``), then the keys ``add_key`` gave it, in the order
        given; (0, 2) when it holds no cache entry. Raises InvalidArgumentError for an id
        outside ``[0, num_blocks)``, InvalidTypeError for a non-int.

        >>> pool = BlockPool(4)
        >>> pool.keys_of(1).shape
        (0, 2)
        >>> pool.cache(pool.allocate(1), [5]); pool.add_key(1, 7)
        1
        True
        >>> pool.keys_of(1).tolist()
        [[5, 0], [7, 0]]
        """
        cdef int64_t b = as_int(block, "keys_of: block", INT32_MIN, INT32_MAX)
        self._sync()
        if b < 0 or b >= self.p.num_blocks:
            raise InvalidArgumentError(f"keys_of: block {b} out of range "
                                       f"[0, {self.p.num_blocks})")
        cdef int32_t nb = self.p.num_blocks, r
        cdef list keys = []
        if self.p.flags[b] & KVB_F_CACHED:
            keys.append((self.p.hash[b].lo, self.p.hash[b].hi))
            r = self.p.xhead[b] if self.p.xhead is not NULL else KVB_NONE
            while r != KVB_NONE:
                keys.append((self.p.hash[nb + r].lo, self.p.hash[nb + r].hi))
                r = self.p.xnext[r]
        return np.array(keys, dtype=np.uint64).reshape(len(keys), 2)

    @property
    def num_entries(self):
        """Keys the prefix cache holds: ``num_cached`` blocks' hashes plus the keys
        ``add_key`` gave them."""
        self._sync()
        return self.p.num_cached + self.p.nx

    def ref_count(self, block_id):
        block_id = as_int(block_id, "block_id", INT32_MIN, INT32_MAX)
        self._sync()
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"ref_count: block {block_id} out of range "
                                       f"[0, {self.p.num_blocks})")
        return self.p.ref_count[block_id]

    def ref_counts(self):
        """All ref counts as a read-only int32 view (zero-copy, live)."""
        self._sync()
        return int32_view(self, self.p.ref_count, self.p.num_blocks)

    def is_cached(self, block_id):
        """Whether block ``block_id`` holds a prefix-cache entry (current on a host tier's
        pool: the device's evictions since are demoted first)."""
        block_id = as_int(block_id, "block_id", INT32_MIN, INT32_MAX)
        self._sync()
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"is_cached: block {block_id} out of range")
        return bool(self.p.flags[block_id] & KVB_F_CACHED)

    def block_hash(self, block_id):
        """The hash a cached block is registered under, as one 128-bit int
        ``(hi << 64) | lo`` (``kvblocks.hash_to_int`` of its ``[lo, hi]`` row), or None when
        the block holds no cache entry. Its KV events name it by ``h & (2**64 - 1)``
        (``kvblocks.events.fold_hash``). Raises InvalidArgumentError for an id outside
        ``[0, num_blocks)`` and InvalidTypeError for a non-int."""
        block_id = as_int(block_id, "block_id", INT32_MIN, INT32_MAX)
        self._sync()
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"block_hash: block {block_id} out of range")
        if not self.p.flags[block_id] & KVB_F_CACHED:
            return None
        return hash_int(self.p.hash[block_id])

    def cached_hashes(self, *, group=None, bint wire=False):
        """Every hash this pool's prefix cache holds now, in block-id order: an (n, 2)
        uint64 array of ``[lo, hi]`` rows (the form of ``hash_blocks``), or with
        ``wire=True`` the (n,) uint64 values its KV events carry (the low halves). For a
        router consistency check: a router that applied every event of this pool holds
        exactly ``set(pool.cached_hashes(wire=True))`` for it (per medium; per group with
        ``group=``, the KV cache group index). Raises InvalidTypeError / InvalidArgumentError
        for a bad ``group``.

        >>> from kvblocks import BlockPool, hash_blocks
        >>> pool = BlockPool(8)
        >>> h = hash_blocks(range(8), 4)
        >>> pool.cache(pool.allocate(2), h)
        2
        >>> bool((pool.cached_hashes() == h).all()), pool.cached_hashes(wire=True).shape
        (True, (2,))
        """
        cdef int g = -1
        if group is not None:
            g = <int>as_int(group, "group", 0, 254)
        cdef int32_t b, n = 0
        for b in range(1, self.p.num_blocks):
            if self.p.flags[b] & KVB_F_CACHED and (g < 0 or self.p.gid[b] == g):
                n += 1
        cdef cnp.ndarray out = np.empty((n, 2), dtype=np.uint64)
        cdef uint64_t *o = <uint64_t *>cnp.PyArray_DATA(out)
        cdef int32_t k = 0
        cdef kvb_hash_t h
        for b in range(1, self.p.num_blocks):
            if self.p.flags[b] & KVB_F_CACHED and (g < 0 or self.p.gid[b] == g):
                kvb_pool_event_hash(&self.p, b, &h)  # as its events carry it
                o[2 * k] = h.lo
                o[2 * k + 1] = h.hi
                k += 1
        return out[:, 0].copy() if wire else out

    def free_list(self):
        """Block ids in the free list, next to be allocated first (a debugging aid)."""
        self._sync()
        out = []
        cdef int32_t b = self.p.free_head
        while b != KVB_NONE:
            out.append(b)
            b = self.p.next[b]
        return np.asarray(out, dtype=np.int32)

    def check(self):
        """Verify every invariant in C; raises CorruptionError if one does not hold."""
        self._sync()
        cdef int rc = kvb_pool_check(&self.p)
        if rc:
            raise_code(rc, "BlockPool.check", self.p.err_a, self.p.err_b, self.p.err_what)

    # -- prefix cache -------------------------------------------------------------------------
    def cache(self, ids, hashes, *, parent=None, token_ids=None, lora_name=None,
              lora_id=None, salt=None, group=0, bint dup=False):
        """Register referenced full blocks under their hashes (from hash_blocks).

        Call it once the blocks' K/V are written: a cached block serves prefix hits at once.
        A hash that is already cached keeps its first block; the newcomer stays uncached.
        Returns how many entries were added. ``parent`` (None for the first block of a
        sequence), ``token_ids`` (the blocks' tokens, concatenated) and ``lora_name`` (the
        adapter they were computed with; ``lora_id`` its int id) and ``salt`` (the request's
        cache salt: vLLM's extra key of a chain's first block, sent when ``parent`` is None)
        only feed the BlockStored event; while events are
        recorded ``token_ids`` is required, since routers drop a BlockStored without its
        tokens. ``group`` is the KV cache group the blocks belong to (hash them with
        ``hash_blocks(..., group=group)``); events carry it.

        ``dup=True`` keeps duplicates as vLLM does: a block whose hash another block holds
        is cached too (counted, its own BlockStored and, once evicted, BlockRemoved), behind
        the blocks already under that hash. Lookups return the earliest cached block of each
        hash; removing one (eviction, ``uncache``) leaves the others, and the next earliest
        answers (``cached_blocks`` lists them).

        >>> pool = BlockPool(8)
        >>> h = hash_blocks(range(4), 4)
        >>> pool.cache(pool.allocate(1), h), pool.cache(pool.allocate(1), h, dup=True)
        (1, 1)
        >>> pool.cached_blocks(h[0]).tolist(), pool.lookup(h).tolist()
        ([1, 2], [1])
        >>> pool.uncache([1]), pool.lookup(h).tolist()
        (1, [2])
        """
        self._sync()
        lora = as_lora(lora_name)
        cdef int32_t tag = self._event_tag(lora, lora_id, salt)
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef uint8_t g = <uint8_t>as_int(group, "group", 0, 254)
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
        if token_ids is None and self.p.record_events and n:
            raise InvalidArgumentError("cache: token_ids are required while KV events are "
                                       "recorded (a BlockStored carries the blocks' tokens)")
        if token_ids is not None:
            toks = as_int32(token_ids, "token_ids")
            if n == 0 or cnp.PyArray_DIM(toks, 0) % n or (
                    self._block_size is not None and
                    cnp.PyArray_DIM(toks, 0) != n * self._block_size):
                raise InvalidArgumentError("cache: token_ids must hold whole blocks")
            bs = cnp.PyArray_DIM(toks, 0) // n
            tp = i32_data(toks)
        cdef int64_t stored = 0
        self.p.dup_insert = dup
        cdef int rc = kvb_tier_cache_insert(&self.p, i32_data(v),
                                            <kvb_hash_t *>&h[0, 0] if n else NULL, n, ppar, tp,
                                            bs, g, tag, &stored)
        self.p.dup_insert = 0
        if rc:
            raise_code(rc, "cache", self.p.err_a, self.p.err_b)
        return stored

    def lookup(self, hashes, *, group=0):
        """Ids of the longest cached prefix of ``hashes`` (int32), NOT pinned; only blocks
        cached for KV cache group ``group`` count."""
        self._sync()
        cdef uint64_t[:, ::1] h = as_hashes(hashes)
        cdef uint8_t g = <uint8_t>as_int(group, "group", 0, 254)
        cdef Py_ssize_t n = h.shape[0]
        cdef cnp.ndarray out = new_i32(n)
        cdef int64_t k = kvb_cache_lookup(&self.p, <kvb_hash_t *>&h[0, 0] if n else NULL, n,
                                          i32_data(out))
        return out[:self._in_group(out, k, g)]

    def lookup_and_pin(self, hashes, *, group=0):
        """Like lookup, and takes one reference to each hit in the same step (no window in
        which a hit can be evicted). Release them with free()."""
        self._sync()
        cdef uint64_t[:, ::1] h = as_hashes(hashes)
        cdef uint8_t g = <uint8_t>as_int(group, "group", 0, 254)
        cdef Py_ssize_t n = h.shape[0]
        cdef cnp.ndarray out = new_i32(n)
        cdef int64_t k = kvb_pool_lookup_pin(&self.p, <kvb_hash_t *>&h[0, 0] if n else NULL,
                                             n, i32_data(out))
        cdef int64_t keep = self._in_group(out, k, g)
        if keep < k:  # hits of another group: not this group's prefix, unpin them
            kvb_pool_free(&self.p, i32_data(out) + keep, k - keep)
        return out[:keep]

    # -- vLLM's bytes block hashes --------------------------------------------------------
    def lookup_bytes(self, hashes, stop=None, *, Py_ssize_t start=0, full=None, group=0,
                     uint64_t key_salt=0):
        """Ids of the longest cached prefix of ``hashes[start:stop]`` (int32), NOT pinned,
        for hashes given as vLLM keeps them: a list of ``bytes`` (one per block). The key
        of a hash is its first 16 bytes (zero-padded when shorter), read as ``lookup`` reads
        an (n, 2) uint64 row; only blocks cached for ``group`` count.

        ``full`` (an (num_blocks, 4) uint64 C-contiguous array kept by the caller, which
        ``cache_bytes(..., full=)`` fills with each block's whole hash) checks the full width
        too: every hash must then be 32 bytes, and a hit stops at the first block whose row
        is not the hash's 32 bytes (so a 128-bit key collision, or a row the caller zeroed,
        never hits). A hit through a key ``add_key_bytes`` gave is checked against the 32
        bytes kept with that key instead.

        ``key_salt`` is XORed into the second 8 bytes of every key (so one hash can key one
        entry per salt: the vLLM adapter gives each KV cache group its own salt, as vLLM's
        keys carry the group id); ``cache_bytes`` must have used the same salt.

        Raises InvalidTypeError when ``hashes`` is not a list of bytes, InvalidArgumentError
        for a bad range, a hash of another width than 32 with ``full``, or a bad ``full``.

        >>> pool = BlockPool(8)
        >>> h = [bytes([i]) * 32 for i in (1, 2, 3)]
        >>> full = np.zeros((8, 4), dtype=np.uint64)
        >>> pool.cache_bytes(pool.allocate(2), h, full=full)
        2
        >>> pool.lookup_bytes(h, full=full).tolist()
        [1, 2]
        """
        self._sync()
        if type(hashes) is not list:
            raise InvalidTypeError(f"lookup_bytes: hashes must be a list of bytes, got "
                                   f"{type(hashes).__name__}")
        cdef list hs = <list>hashes
        cdef Py_ssize_t end = len(hs)
        if stop is not None:
            end = as_int(stop, "lookup_bytes: stop", 0, len(hs))
        if start < 0 or start > end:
            raise InvalidArgumentError(f"lookup_bytes: start {start} not in [0, {end}]")
        cdef uint8_t g = <uint8_t>as_int(group, "group", 0, 254)
        cdef const uint64_t *tl = self._full_ptr(full, "lookup_bytes")
        cdef Py_ssize_t n = end - start
        cdef kvb_hash_t *keys = _bytes_keys(hs, start, n, tl != NULL, "lookup_bytes",
                                            key_salt)
        cdef cnp.ndarray out = new_i32(n)
        cdef int32_t *o = i32_data(out)
        cdef int64_t k, i
        cdef int32_t b
        cdef const uint64_t *row
        cdef int32_t e
        try:
            k = kvb_cache_lookup(&self.p, keys, n, o)
            for i in range(k):
                b = o[i]
                if self.p.gid[b] != g:
                    k = i
                    break
                if tl == NULL:
                    continue
                row = &tl[4 * <int64_t>b]
                if self.p.nx:  # the hit may be a secondary key: its own 32 bytes
                    e = kvb_cache_find_entry(&self.p, &keys[i])
                    if e >= self.p.num_blocks:
                        row = &self.p.xcheck[4 * <int64_t>(e - self.p.num_blocks)]
                if memcmp(row, PyBytes_AS_STRING(hs[start + i]), 32):
                    k = i
                    break
        finally:
            PyMem_Free(keys)
        return out[:k]

    def cache_bytes(self, ids, hashes, Py_ssize_t start=0, *, full=None, mark=None,
                    group=0, uint64_t key_salt=0, bint dup=False):
        """``cache(ids, keys)`` with the keys of vLLM's bytes hashes: block ``ids[i]`` is
        registered under ``hashes[start + i]`` (its first 16 bytes, as in lookup_bytes).
        Returns how many entries were added (a key already cached keeps its first block).
        ``key_salt``: as in lookup_bytes (the full hash written to ``full`` is unsalted).
        No BlockStored is recorded (the caller publishes its own events): raises
        InvalidStateError while this pool records events or when caching is disabled.

        On success only, ``full[ids[i]]`` (see lookup_bytes) gets the hash's 32 bytes (every
        hash must be 32 bytes then) and ``mark[ids[i]]`` (a (num_blocks,) bool or uint8 array)
        is set to 1, for every id, stored or not. All-or-nothing: bad ids, hashes, ``full`` or
        ``mark`` raise InvalidTypeError / InvalidArgumentError / InvalidStateError (as
        ``cache``) and change nothing. ``dup=True``: a key another block holds caches the
        block too, as a duplicate behind it (as ``cache(..., dup=True)``).

        >>> pool = BlockPool(8)
        >>> h = [bytes([1]) * 32]
        >>> full = np.zeros((8, 4), dtype=np.uint64)
        >>> [pool.cache_bytes(pool.allocate(1), h, full=full, dup=True) for _ in range(2)]
        [1, 1]
        >>> pool.lookup_bytes(h, full=full).tolist(), pool.num_cached
        ([1], 2)
        """
        self._sync()
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef Py_ssize_t n = cnp.PyArray_DIM(v, 0), i
        if type(hashes) is not list:
            raise InvalidTypeError(f"cache_bytes: hashes must be a list of bytes, got "
                                   f"{type(hashes).__name__}")
        cdef list hs = <list>hashes
        if start < 0 or start + n > len(hs):
            raise InvalidArgumentError(f"cache_bytes: {n} ids from hash {start}, but "
                                       f"{len(hs)} hashes")
        cdef uint8_t g = <uint8_t>as_int(group, "group", 0, 254)
        cdef uint64_t *tl = self._full_ptr(full, "cache_bytes")
        cdef uint8_t *mk = NULL
        cdef int mtype
        if mark is not None:
            mtype = cnp.PyArray_TYPE(<cnp.ndarray>mark) if cnp.PyArray_Check(mark) else -1
            if (mtype not in (cnp.NPY_BOOL, cnp.NPY_UINT8)
                    or cnp.PyArray_NDIM(<cnp.ndarray>mark) != 1
                    or not cnp.PyArray_ISCARRAY(<cnp.ndarray>mark)
                    or cnp.PyArray_DIM(<cnp.ndarray>mark, 0) != self.p.num_blocks):
                raise InvalidArgumentError(f"cache_bytes: mark must be a writable "
                                           f"C-contiguous ({self.p.num_blocks},) bool array")
            mk = <uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>mark)
        if not self.p.caching:
            raise InvalidStateError("cache_bytes: prefix caching is disabled on this pool")
        if self.p.record_events:
            raise InvalidStateError("cache_bytes: records no events; this pool records "
                                    "them (use cache() with token_ids)")
        cdef kvb_hash_t *keys = _bytes_keys(hs, start, n, tl != NULL, "cache_bytes",
                                            key_salt)
        cdef int32_t *d = i32_data(v)
        cdef int32_t b
        cdef int64_t stored = 0
        cdef int rc
        try:
            for i in range(n):  # the group of the blocks about to be cached (as cache())
                b = d[i]
                if 0 < b < self.p.num_blocks and not (self.p.flags[b] & KVB_F_CACHED):
                    self.p.gid[b] = g
            self.p.dup_insert = dup
            rc = kvb_cache_insert(&self.p, d, keys, n, NULL, NULL, 0, &stored)
            self.p.dup_insert = 0
            if self.p.tier is not NULL:  # the insertions' records, at the tier's layer
                kvb_tier_absorb(self.p.tier)
            if rc == 0:
                for i in range(n):
                    b = d[i]
                    if tl != NULL:
                        memcpy(&tl[4 * <int64_t>b], PyBytes_AS_STRING(hs[start + i]), 32)
                    if mk != NULL:
                        mk[b] = 1
        finally:
            PyMem_Free(keys)
        if rc:
            raise_code(rc, "cache_bytes", self.p.err_a, self.p.err_b)
        return stored

    cdef uint64_t *_full_ptr(self, object full, str what) except? NULL:
        """The data of a (num_blocks, 4) uint64 C-contiguous writable array, NULL for
        None."""
        if full is None:
            return NULL
        if (not cnp.PyArray_Check(full) or cnp.PyArray_NDIM(<cnp.ndarray>full) != 2
                or cnp.PyArray_TYPE(<cnp.ndarray>full) != cnp.NPY_UINT64
                or not cnp.PyArray_ISCARRAY(<cnp.ndarray>full)
                or cnp.PyArray_DIM(<cnp.ndarray>full, 0) != self.p.num_blocks
                or cnp.PyArray_DIM(<cnp.ndarray>full, 1) != 4):
            raise InvalidArgumentError(f"{what}: full must be a writable C-contiguous "
                                       f"({self.p.num_blocks}, 4) uint64 array")
        return <uint64_t *>cnp.PyArray_DATA(<cnp.ndarray>full)

    def num_unreferenced(self, ids):
        """How many of ``ids`` have ref count 0 (free blocks, cached or not); the null block
        counts as referenced. Raises InvalidArgumentError for an id out of range.

        >>> pool = BlockPool(8)
        >>> pool.num_unreferenced([1, 2, 0])
        2
        """
        self._sync()
        cdef cnp.ndarray v = as_int32(ids, "ids")
        cdef Py_ssize_t n = cnp.PyArray_DIM(v, 0), i
        cdef int32_t *d = i32_data(v)
        cdef int64_t count = 0
        for i in range(n):
            if d[i] < 0 or d[i] >= self.p.num_blocks:
                raise InvalidArgumentError(f"num_unreferenced: block {d[i]} out of range "
                                           f"[0, {self.p.num_blocks})")
            if d[i] and self.p.ref_count[d[i]] == 0:
                count += 1
        return count

    cdef int64_t _in_group(self, cnp.ndarray ids, int64_t k, uint8_t g):
        """Leading hits among ids[:k] that are cached for group g."""
        cdef int64_t i
        for i in range(k):
            if self.p.gid[i32_data(ids)[i]] != g:
                return i
        return k

    def reset_prefix_cache(self, *, bint keep_order=False):
        """Drop every cache entry. Only when no cached block is referenced (else raises
        InvalidStateError, nothing changed). The dropped blocks move to the free list's head
        (reused first), or, with ``keep_order``, stay where they are (vLLM's reset). Its
        event is one ``AllBlocksCleared``, except on either pool of a BlockManager with a
        host tier: there the other tier keeps its entries, so this pool records one
        ``BlockRemoved`` of its own ``medium`` listing every entry it dropped
        (``BlockManager.reset_prefix_cache()`` clears both tiers)."""
        self._sync()
        cdef int rc = (kvb_pool_reset_cache_keep_order(&self.p) if keep_order
                       else kvb_pool_reset_cache(&self.p))
        if rc:
            raise InvalidStateError(f"reset_prefix_cache: {self.p.err_a} of {self.p.err_b} "
                                    f"cached blocks are still referenced")

    def try_reset_prefix_cache(self, *, bint keep_order=False):
        """vLLM's ``reset_prefix_cache() -> bool``: ``reset_prefix_cache(keep_order=...)``
        when no block but the null block is referenced (returns True), else False with
        nothing changed (vLLM's rule: a block in use, cached or not, refuses; the raising
        ``reset_prefix_cache`` refuses only referenced cached blocks). Never raises.

        >>> pool = BlockPool(4)
        >>> ids = pool.allocate(1)
        >>> pool.try_reset_prefix_cache()
        False
        >>> pool.free(ids); pool.try_reset_prefix_cache()
        True
        """
        self._sync()
        return kvb_pool_try_reset_cache(&self.p, keep_order) == 1

    @property
    def events_dropped(self):
        """KV events dropped because more than ``max_pending_events`` were left undrained
        (or memory ran out). Nonzero means a router listening to this pool is out of date."""
        return self.p.events.dropped

    @property
    def max_pending_events(self):
        """Undrained events kept at most (default 2**20); later ones are dropped and
        counted in ``events_dropped`` rather than growing memory without bound."""
        return self.p.events.max_pending

    @max_pending_events.setter
    def max_pending_events(self, value):
        self.p.events.max_pending = as_int(value, "max_pending_events", 0, 1 << 40)

    @property
    def block_size(self):
        """Tokens per block, when known (set by BlockManager); used for KV events."""
        return self._block_size

    @property
    def medium(self):
        """Where the blocks live, as KV events name it: ``"GPU"``, or ``"CPU"`` for a
        BlockManager's host pool."""
        return self._medium

    @property
    def stats(self):
        """Counters since creation: a CacheStats (also readable like a dict)."""
        self._sync()
        s = self.p.stats
        return CacheStats(queries=s.queries, query_blocks=s.query_blocks,
                          hit_blocks=s.hit_blocks, query_tokens=s.query_tokens,
                          hit_tokens=s.hit_tokens,
                          recompute_query_tokens=s.recompute_query_tokens,
                          recompute_hit_tokens=s.recompute_hit_tokens, evictions=s.evictions,
                          allocations=s.allocations, frees=s.frees, stored=s.stored)

    def take_events(self):
        """Drain recorded KV events: BlockStored, BlockRemoved and AllBlocksCleared.

        Consecutive stored blocks that chain on each other come as one BlockStored, the way
        vLLM publishes them to KV-aware routers; a chain that starts a sequence has
        ``parent_block_hash=None``. Hashes are 128-bit ints; ``kvblocks.events.encode_batch``
        and ``ZmqEventPublisher`` put them on the wire as vLLM does.
        """
        self._sync()  # demotions recorded since: stored now
        if self.p.events.n == 0:
            return []
        # the events are moved out first: building the Python objects runs Python code, during
        # which another thread may record (and grow the log's arrays) on this pool
        cdef kvb_events_t snap
        kvb_events_detach(&self.p.events, &snap)
        try:
            return self._build_events(&snap)
        finally:
            kvb_events_reattach(&self.p.events, &snap)

    cdef list _build_events(self, kvb_events_t *ev, const uint8_t *src=NULL, list media=None):
        """The events of a detached log, merged in one pass (see take_events). With ``src``
        (a merged log of a host tier's two pools), record i is of medium ``media[src[i]]``
        and runs never merge across media."""
        cdef int64_t n = ev.n
        # one pass, merging in C what coalesce() would merge: a stored block whose parent is
        # the previous stored block's hash (same group, adapter and token-ness) extends its
        # run, whose tokens are contiguous in the log; removals of one group merge likewise
        cdef cnp.ndarray ends = np.empty(n, dtype=np.int64)
        cdef int64_t *e_end = <int64_t *>cnp.PyArray_DATA(ends)
        cdef int64_t i, j, end = ev.ntok, t0 = 0, t1 = 0
        for i in range(n - 1, -1, -1):  # each event's tokens end where the next one's begin
            e_end[i] = end
            if ev.tok_off[i] >= 0:
                end = ev.tok_off[i]
        toks_all = (np.asarray(<int32_t[:ev.ntok]>ev.tokens) if ev.ntok
                    else np.empty(0, dtype=np.int32))
        out = []
        cdef object run = None  # the BlockStored or BlockRemoved being extended
        cdef int last = -1      # kind of run
        cdef kvb_hash_t last_h
        cdef uint8_t last_g = 0
        cdef int32_t last_tag = 0
        cdef bint last_toks = False, has
        cdef int64_t last_ntok = 0
        cdef uint8_t s = 0, last_s = 0
        for i in range(n):
            kind = ev.kind[i]
            if src != NULL:
                s = src[i]
            if kind == KVB_EV_STORED:
                has = ev.tok_off[i] >= 0
                if (last == KVB_EV_STORED and s == last_s and ev.parent[i].lo == last_h.lo and
                        ev.parent[i].hi == last_h.hi and (last_h.lo or last_h.hi) and
                        ev.group[i] == last_g and ev.tag[i] == last_tag and has == last_toks
                        and (not has or e_end[i] - ev.tok_off[i] == last_ntok)):
                    run.block_hashes.append(hash_int(ev.hash[i]))
                    if run.extra_keys is not None:
                        run.extra_keys.append(self._extra_keys(ev.tag[i], False))
                    t1 = e_end[i]
                else:
                    if last == KVB_EV_STORED and last_toks:
                        run.token_ids = toks_all[t0:t1].tolist()
                    run = self._stored_event(ev.hash[i], ev.parent[i], ev.group[i], ev.tag[i],
                                             has, e_end[i] - ev.tok_off[i] if has else 0,
                                             self._medium if src == NULL else media[s])
                    out.append(run)
                    t0 = ev.tok_off[i]
                    t1 = e_end[i]
                last, last_h, last_g, last_s = KVB_EV_STORED, ev.hash[i], ev.group[i], s
                last_tag, last_toks = ev.tag[i], has
                last_ntok = e_end[i] - ev.tok_off[i] if has else 0
                continue
            if last == KVB_EV_STORED and last_toks:
                run.token_ids = toks_all[t0:t1].tolist()
            if kind == KVB_EV_REMOVED:
                if last == KVB_EV_REMOVED and ev.group[i] == last_g and s == last_s:
                    run.block_hashes.append(hash_int(ev.hash[i]))
                else:
                    run = BlockRemoved(block_hashes=[hash_int(ev.hash[i])],
                                       group_idx=ev.group[i],
                                       medium=self._medium if src == NULL else media[s])
                    out.append(run)
                last, last_g, last_s = KVB_EV_REMOVED, ev.group[i], s
            else:
                out.append(AllBlocksCleared())
                last = -1
        if last == KVB_EV_STORED and last_toks:
            run.token_ids = toks_all[t0:t1].tolist()
        return out

    cdef object _extra_keys(self, int32_t tag, bint first):
        """vLLM's event extra keys of one stored block (to_event_extra_keys): None, or the
        adapter name and, on a chain's first block, the cache salt."""
        if tag == 0:
            return None
        lora, _, salt = self._tag_ctx[tag]
        keys = ((lora,) if lora is not None else ()) + (
            (salt,) if first and salt is not None else ())
        return keys or None

    cdef object _stored_event(self, kvb_hash_t h, kvb_hash_t parent, uint8_t g, int32_t tag,
                              bint has, int64_t ntok, str medium):
        """A one-block BlockStored (its tokens are filled in by take_events)."""
        spec = self._groups[g] if self._groups is not None and g < len(self._groups) else None
        cdef bint first = not (parent.lo or parent.hi)
        lora, lora_id, _ = self._tag_ctx[tag]
        return BlockStored(block_hashes=[hash_int(h)],
                           parent_block_hash=None if first else hash_int(parent),
                           token_ids=[],
                           block_size=ntok if has and ntok else self._block_size,
                           group_idx=g,
                           kv_cache_spec_kind=(spec.spec_kind if spec is not None
                                               else "full_attention"),
                           kv_cache_spec_sliding_window=spec.window if spec is not None else None,
                           lora_name=lora, lora_id=lora_id,
                           extra_keys=None if tag == 0 else [self._extra_keys(tag, first)],
                           medium=medium)

    def take_events_wire(self, *, ts, data_parallel_rank=0, fmt="map", hash_int="unsigned"):
        """Drain the recorded KV events straight to vLLM's msgpack ``KVEventBatch``: the bytes
        of ``kvblocks.events.encode_batch(pool.take_events(), ts=ts, ...)``, written in C
        from the event log (no Python event objects), several times faster.

        ``fmt`` "map" (vLLM >= 0.24) or "array" (0.22/0.23); ``hash_int`` "unsigned" (vLLM's)
        or "signed". An empty log gives an empty batch. Raises InvalidArgumentError /
        InvalidTypeError for bad arguments and for a stored block recorded without its
        tokens; then nothing is drained.
        """
        out = self._wire_bytes(ts, data_parallel_rank, fmt, hash_int)
        kvb_events_clear(&self.p.events)
        return out

    cdef bytes _wire_bytes(self, ts, data_parallel_rank, fmt, hash_int):
        """The log as a batch (take_events_wire), the log left as it was."""
        cdef kvb_wire_opts_t w
        cdef kvb_wire_group_t gt[256]
        cdef list keep = []
        self._wire_opts(&w, gt, keep, ts, data_parallel_rank, fmt, hash_int)
        return _encode_log(&self.p.events, &w)

    cdef int _wire_opts(self, kvb_wire_opts_t *w, kvb_wire_group_t *gt, list keep, ts,
                        data_parallel_rank, fmt, hash_int) except -1:
        """Fill w (and gt[256], the group table; ``keep`` holds the bytes they point into)
        with this pool's settings for kvb_events_encode; bad arguments raise."""
        memset(w, 0, sizeof(w[0]))
        if fmt == "map":
            w[0].fmt = KVB_WIRE_MAP
        elif fmt == "array":
            w[0].fmt = KVB_WIRE_ARRAY
        else:
            raise InvalidArgumentError(f"fmt must be one of ('map', 'array'), got {fmt!r}")
        if hash_int not in ("unsigned", "signed"):
            raise InvalidArgumentError(f"hash_int must be one of ('unsigned', 'signed'), got "
                                       f"{hash_int!r}")
        w[0].hash_signed = hash_int == "signed"
        if data_parallel_rank is not None:
            if type(data_parallel_rank) is not int or data_parallel_rank < 0:
                raise InvalidArgumentError(f"data_parallel_rank must be an int >= 0, got "
                                           f"{data_parallel_rank!r}")
            w[0].dp = as_int(data_parallel_rank, "data_parallel_rank", 0, INT64_MAX)
            w[0].has_dp = 1
        try:
            w[0].ts = float(ts)
        except (TypeError, ValueError):
            raise InvalidTypeError(f"ts must be a number (seconds), got {ts!r}") from None
        if self._tier_pool is not None and self._tier_pool.p.tier is not NULL:
            kvb_tier_flush(self._tier_pool.p.tier)  # demotions recorded since: stored now
        cdef bytes medium = self._medium.encode() if self._medium is not None else None
        if medium is not None:
            keep.append(medium)
            w[0].medium = <const uint8_t *><char *>medium
            w[0].medium_len = <int32_t>len(medium)
        cdef bytes kb
        cdef int32_t ng = 1 if self._groups is None else <int32_t>len(self._groups)
        cdef int32_t g
        memset(gt, 0, 256 * sizeof(gt[0]))
        for g in range(ng):
            spec = self._groups[g] if self._groups is not None else None
            kb = (spec.spec_kind if spec is not None else "full_attention").encode()
            keep.append(kb)
            gt[g].kind = <const uint8_t *><char *>kb
            gt[g].kind_len = <int32_t>len(kb)
            if spec is not None and spec.window is not None:
                gt[g].has_window = 1
                gt[g].window = spec.window
        w[0].groups = gt
        w[0].ngroups = ng
        w[0].tags = self._wire_tags
        w[0].ntags = <int32_t>len(self._tag_ctx)
        return 0


cdef bytes _encode_log(const kvb_events_t *ev, const kvb_wire_opts_t *w):
    """kvb_events_encode of a log (not drained) as bytes; raises on an event that cannot go
    out."""
    cdef kvb_buf_t buf
    memset(&buf, 0, sizeof(buf))
    cdef int64_t bad = -1
    cdef int rc = kvb_events_encode(ev, w, &buf, &bad)
    if rc:
        kvb_buf_free(&buf)
        if rc == KVB_EINVAL:
            raise_code(rc, "take_events_wire", 0, 0, NULL, None, (
                f"take_events_wire: logged event {bad} is a BlockStored without its "
                f"token_ids (give token_ids to pool.cache()); nothing was drained"))
        raise_code(rc, "take_events_wire", 0, 0)
    try:
        return PyBytes_FromStringAndSize(<char *>buf.data, <Py_ssize_t>buf.len)
    finally:
        kvb_buf_free(&buf)


cdef kvb_hash_t *_bytes_keys(list hs, Py_ssize_t start, Py_ssize_t n, bint full,
                             str what, uint64_t salt=0) except NULL:
    """The native keys of hs[start:start + n] (bytes hashes: the first 16 bytes of each,
    zero-padded, ``salt`` XORed into bytes 8..15), in a PyMem_Malloc'd array the caller
    frees; with ``full`` every hash must be 32 bytes. Raises InvalidTypeError /
    InvalidArgumentError (nothing allocated then)."""
    cdef kvb_hash_t *keys = <kvb_hash_t *>PyMem_Malloc(max(n, 1) * sizeof(kvb_hash_t))
    if keys is NULL:
        raise MemoryError()
    cdef Py_ssize_t i, w
    cdef object h
    for i in range(n):
        h = hs[start + i]
        if not PyBytes_Check(h):
            PyMem_Free(keys)
            raise InvalidTypeError(f"{what}: hash {start + i} is {type(h).__name__}, not bytes")
        w = PyBytes_GET_SIZE(h)
        if full and w != 32:
            PyMem_Free(keys)
            raise InvalidArgumentError(f"{what}: hash {start + i} is {w} bytes; full needs "
                                       f"32-byte hashes")
        if w >= 16:
            memcpy(&keys[i], PyBytes_AS_STRING(h), 16)
        else:
            memset(&keys[i], 0, 16)
            memcpy(&keys[i], PyBytes_AS_STRING(h), w)
        if salt:
            (<uint64_t *>&keys[i])[1] ^= salt
    return keys
