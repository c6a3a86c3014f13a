# BlockPool and the read-only views it exports (included by _core.pyx).
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

    def __cinit__(self, num_blocks, *, bint enable_prefix_caching=True, hash_key=None,
                  bint enable_kv_events=False, block_size=None, hash_algo="siphash",
                  hash_seed=None):
        cdef int32_t nb = <int32_t>as_int(num_blocks, "num_blocks (block 0 is the null block)",
                                          2, INT32_MAX - 1)
        self._algo = as_algo(hash_algo)
        if hash_key is not None and self._algo != KVB_HASH_SIPHASH:
            raise InvalidArgumentError(f"hash_key applies to the siphash mode only, not "
                                       f"{hash_algo!r}")
        self._seed = effective_seed(self._algo, hash_seed)
        self._none_hash = none_hash_of(self._algo, self._seed)
        self._lora_names = [None]
        self._lora_tags = {}
        self._key = as_key(hash_key)
        self._block_size = (None if block_size is None else
                            as_int(block_size, "block_size", 1, INT32_MAX))
        rc = kvb_pool_init(&self.p, nb, enable_prefix_caching)
        if rc:
            raise_code(rc, "BlockPool", 0, num_blocks)
        self.p.record_events = enable_kv_events
        self._medium = "GPU"
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

    cdef int32_t _lora_tag(self, object name) except -1:
        """The event tag of an adapter name (0: None), registered on first use."""
        if name is None:
            return 0
        cdef object t = self._lora_tags.get(name)
        if t is None:
            if len(self._lora_names) >= INT32_MAX:
                raise InvalidArgumentError("too many distinct LoRA adapter names")
            t = len(self._lora_names)
            self._lora_names.append(name)
            self._lora_tags[name] = t
        return <int32_t>t

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
        cdef int64_t k = as_int(n, "allocate: n", 0, INT32_MAX)
        cdef cnp.ndarray out = new_i32(k)
        cdef int rc = kvb_pool_allocate(&self.p, <int32_t>k, i32_data(out))
        if rc:
            raise_code(rc, f"allocate({k})", self.p.err_a, self.p.err_b)
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

    def ref_count(self, block_id):
        block_id = as_int(block_id, "block_id", INT32_MIN, INT32_MAX)
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"ref_count: block {block_id} out of range "
                                       f"[0, {self.p.num_blocks})")
        return self.p.ref_count[block_id]

    def ref_counts(self):
        """All ref counts as a read-only int32 view (zero-copy, live)."""
        return int32_view(self, self.p.ref_count, self.p.num_blocks)

    def is_cached(self, block_id):
        block_id = as_int(block_id, "block_id", INT32_MIN, INT32_MAX)
        if block_id < 0 or block_id >= self.p.num_blocks:
            raise InvalidArgumentError(f"is_cached: block {block_id} out of range")
        return bool(self.p.flags[block_id] & KVB_F_CACHED)

    def block_hash(self, block_id):
        block_id = as_int(block_id, "block_id", INT32_MIN, INT32_MAX)
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
            raise_code(rc, "BlockPool.check", self.p.err_a, self.p.err_b, self.p.err_what)

    # -- prefix cache -------------------------------------------------------------------------
    def cache(self, ids, hashes, *, parent=None, token_ids=None, lora_name=None,
              group=0):
        """Register referenced full blocks under their hashes (from hash_blocks).

        Call it once the blocks' K/V are written: a cached block serves prefix hits at once.
        A hash that is already cached keeps its first block; the newcomer stays uncached.
        Returns how many entries were added. ``parent`` (None for the first block of a
        sequence), ``token_ids`` (the blocks' tokens, concatenated) and ``lora_name`` (the
        adapter they were computed with) only feed the BlockStored event; while events are
        recorded ``token_ids`` is required, since routers drop a BlockStored without its
        tokens. ``group`` is the KV cache group the blocks belong to (hash them with
        ``hash_blocks(..., group=group)``); events carry it.
        """
        lora = as_lora(lora_name)
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
        cdef Py_ssize_t i
        cdef int32_t b
        for i in range(n):  # the group of the blocks about to be cached (events)
            b = i32_data(v)[i]
            if 0 < b < self.p.num_blocks and not (self.p.flags[b] & KVB_F_CACHED):
                self.p.gid[b] = g
        self.p.events.cur_tag = self._lora_tag(lora)
        cdef int rc = kvb_cache_insert(&self.p, i32_data(v),
                                       <kvb_hash_t *>&h[0, 0] if n else NULL, n, ppar, tp, bs,
                                       &stored)
        self.p.events.cur_tag = 0
        if rc:
            raise_code(rc, "cache", self.p.err_a, self.p.err_b)
        return stored

    def lookup(self, hashes, *, group=0):
        """Ids of the longest cached prefix of ``hashes`` (int32), NOT pinned; only blocks
        cached for KV cache group ``group`` count."""
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

    cdef int64_t _in_group(self, cnp.ndarray ids, int64_t k, uint8_t g):
        """Leading hits among ids[:k] that are cached for group g."""
        cdef int64_t i
        for i in range(k):
            if self.p.gid[i32_data(ids)[i]] != g:
                return i
        return k

    def reset_prefix_cache(self):
        """Drop every cache entry. Only when no cached block is referenced (else raises)."""
        cdef int rc = kvb_pool_reset_cache(&self.p)
        if rc:
            raise InvalidStateError(f"reset_prefix_cache: {self.p.err_a} of {self.p.err_b} "
                                    f"cached blocks are still referenced")

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
        if self._tier_pool is not None and self._tier_pool.p.tier is not NULL:
            kvb_tier_flush(self._tier_pool.p.tier)  # demotions recorded since: stored now
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

    cdef list _build_events(self, kvb_events_t *ev):
        """The events of a detached log, merged in one pass (see take_events)."""
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
        for i in range(n):
            kind = ev.kind[i]
            if kind == KVB_EV_STORED:
                has = ev.tok_off[i] >= 0
                if (last == KVB_EV_STORED and ev.parent[i].lo == last_h.lo and
                        ev.parent[i].hi == last_h.hi and (last_h.lo or last_h.hi) and
                        ev.group[i] == last_g and ev.tag[i] == last_tag and has == last_toks
                        and (not has or e_end[i] - ev.tok_off[i] == last_ntok)):
                    run.block_hashes.append(hash_int(ev.hash[i]))
                    t1 = e_end[i]
                else:
                    if last == KVB_EV_STORED and last_toks:
                        run.token_ids = toks_all[t0:t1].tolist()
                    run = self._stored_event(ev.hash[i], ev.parent[i], ev.group[i], ev.tag[i],
                                             has, e_end[i] - ev.tok_off[i] if has else 0)
                    out.append(run)
                    t0 = ev.tok_off[i]
                    t1 = e_end[i]
                last, last_h, last_g = KVB_EV_STORED, ev.hash[i], ev.group[i]
                last_tag, last_toks = ev.tag[i], has
                last_ntok = e_end[i] - ev.tok_off[i] if has else 0
                continue
            if last == KVB_EV_STORED and last_toks:
                run.token_ids = toks_all[t0:t1].tolist()
            if kind == KVB_EV_REMOVED:
                if last == KVB_EV_REMOVED and ev.group[i] == last_g:
                    run.block_hashes.append(hash_int(ev.hash[i]))
                else:
                    run = BlockRemoved(block_hashes=[hash_int(ev.hash[i])],
                                       group_idx=ev.group[i], medium=self._medium)
                    out.append(run)
                last, last_g = KVB_EV_REMOVED, ev.group[i]
            else:
                out.append(AllBlocksCleared())
                last = -1
        if last == KVB_EV_STORED and last_toks:
            run.token_ids = toks_all[t0:t1].tolist()
        return out

    cdef object _stored_event(self, kvb_hash_t h, kvb_hash_t parent, uint8_t g, int32_t tag,
                              bint has, int64_t ntok):
        """A one-block BlockStored (its tokens are filled in by take_events)."""
        spec = self._groups[g] if self._groups is not None and g < len(self._groups) else None
        return BlockStored(block_hashes=[hash_int(h)],
                           parent_block_hash=hash_int(parent) if parent.lo or parent.hi
                           else None,
                           token_ids=[],
                           block_size=ntok if has and ntok else self._block_size,
                           group_idx=g,
                           kv_cache_spec_kind=(spec.spec_kind if spec is not None
                                               else "full_attention"),
                           kv_cache_spec_sliding_window=spec.window if spec is not None else None,
                           lora_name=self._lora_names[tag],
                           medium=self._medium)
