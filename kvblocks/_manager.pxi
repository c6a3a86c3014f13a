# BlockManager and SeqBatch (included by _core.pyx).
#
# Every public method follows the boundary rule of _convert.pxi: arguments are converted
# first (this may run Python code), then the call enters the manager (_enter: atomic with
# respect to other threads and refusing re-entry from a callback), validates and mutates in C.
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdio cimport fprintf, stderr
from libc.stdlib cimport abort, calloc, free


cdef extern from "<sched.h>" nogil:
    int sched_yield()


cdef bint _host_tier_args(object cache, object write_through, int64_t num_host_blocks,
                          bint device_caching) except -1:
    """Validate the host-tier keywords of BlockManager; True when the tier is on."""
    for name, v in (("host_prefix_cache", cache), ("host_write_through", write_through)):
        if type(v) is not bool:
            raise InvalidTypeError(f"{name} must be a bool, got {type(v).__name__}")
    if write_through and not cache:
        raise InvalidArgumentError("host_write_through needs host_prefix_cache=True")
    if cache and num_host_blocks == 0:
        raise InvalidArgumentError("host_prefix_cache needs host blocks: num_host_blocks >= 2 "
                                   "(block 0 is the host pool's null block)")
    if cache and not device_caching:
        raise InvalidArgumentError("host_prefix_cache needs enable_prefix_caching=True")
    return cache


cdef class SeqBatch:
    """Pre-resolved sequence handles for append_batch / metadata (a persistent batch).

    Built by BlockManager.batch(seq_ids); it stays valid while those sequences are live
    (a freed sequence is detected through its slot generation).
    """
    cdef readonly tuple seq_ids
    cdef cnp.ndarray _slots_arr
    cdef cnp.ndarray _gens_arr
    cdef int32_t *slots
    cdef uint32_t *gens
    cdef Py_ssize_t n
    cdef object owner

    def __len__(self):
        return self.n


# no_gc_clear: kvb_mgr_destroy reads the pool it manages (m->pool->tier); when the garbage
# collector breaks a cycle holding a manager, tp_clear must not free that pool first
@cython.no_gc_clear
cdef class BlockManager:
    """Block tables per sequence on top of a BlockPool: the KV memory manager of an engine.

    ``BlockManager(num_blocks, block_size, *, enable_prefix_caching=True, watermark=0.0,
    num_host_blocks=0, hash_key=None, enable_kv_events=False, host_prefix_cache=False,
    host_write_through=False, groups=None, hash_algo="siphash", hash_seed=None)``

    - ``num_blocks``: device blocks, including the null block 0 (so ``num_blocks - 1`` usable).
    - ``block_size``: tokens per block.
    - ``watermark``: fraction of the usable blocks that admission (``can_add``,
      ``can_swap_in``) keeps free for running sequences to grow into:
      ``ceil(watermark * (num_blocks - 1))`` blocks. Appends may use them.
    - ``num_host_blocks``: host (CPU) blocks for ``swap_out``, including the host pool's own
      null block 0; 0 disables swapping.
    - ``hash_key``: 16-byte key of the block hashes (per-process random when None).
    - ``hash_algo``: the block hash mode, ``"siphash"`` (default, keyed), or the hashes of
      another engine for routers that index by them: ``"vllm_sha256_cbor"``,
      ``"vllm_sha256_cbor_v030"``, ``"sglang_sha256"`` (see ``kvblocks.hash_blocks``);
      ``hash_seed`` is vLLM's NONE_HASH seed in the vLLM modes.
    - ``host_prefix_cache``: the host pool also becomes a second prefix-cache tier: evicted
      device entries are demoted to it (``take_offloads``) and prompts continue their cached
      prefix on it (``take_onloads``); see docs/host-tier.md. Needs ``num_host_blocks``.
      Works with any ``groups``: a host hit counts only as far as every group serves it
      (device and host together, by the device rule), each group onloads the blocks its next
      query reads, and a state group serves no hit on either tier.
    - ``host_write_through``: with the host tier, copy each newly cached device block to the
      host at once, so that its eviction later costs no copy.
    - ``groups``: KV cache groups of a hybrid model, a sequence of ``KVGroup`` (full
      attention, sliding window, chunked local, recurrent state) that share the pool; None
      is one full-attention group. See docs/hybrid-models.md.

    Sequence ids are ``int`` or ``str`` (numpy integers count as ints; bools and floats are
    refused). Each public call is atomic with respect to other threads; calling the manager
    from inside one of its own calls (a callback) raises InvalidStateError.

    Tokens are *committed* by add / append / append_batch and *computed* when a step's
    ``metadata`` (or ``schedule``) is built for them; only computed blocks enter the prefix
    cache. See docs/engine-integration.md for the one safe step order.

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

    def __cinit__(self, num_blocks, block_size, *, bint enable_prefix_caching=True,
                  watermark=0.0, num_host_blocks=0, hash_key=None,
                  bint enable_kv_events=False, groups=None, hash_algo="siphash",
                  hash_seed=None, host_prefix_cache=False, host_write_through=False):
        cdef int32_t bs = <int32_t>as_int(block_size, "block_size", 1, INT32_MAX)
        cdef int32_t nb = <int32_t>as_int(num_blocks, "num_blocks", 2, INT32_MAX - 1)
        cdef int64_t nh = as_int(num_host_blocks, "num_host_blocks", 0, INT32_MAX - 1)
        if nh == 1:
            raise InvalidArgumentError(
                "num_host_blocks must be 0 (no swapping) or >= 2 (block 0 is the null block)")
        if PyBool_Check(watermark) or not isinstance(
                watermark, (int, float, np.floating, np.integer)):
            raise InvalidTypeError(f"watermark must be a number, got {type(watermark).__name__}")
        wm = float(watermark)
        if not 0.0 <= wm < 1.0:  # also refuses nan
            raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark}")
        gs = _group_tuple(groups)
        cdef bint tier = _host_tier_args(host_prefix_cache, host_write_through, nh,
                                         enable_prefix_caching)
        self.pool = BlockPool(nb, enable_prefix_caching=enable_prefix_caching,
                              hash_key=hash_key, enable_kv_events=enable_kv_events,
                              block_size=bs, hash_algo=hash_algo, hash_seed=hash_seed)
        self.host_pool = (BlockPool(nh, enable_prefix_caching=tier, hash_key=hash_key,
                                    enable_kv_events=enable_kv_events and tier, block_size=bs,
                                    hash_algo=hash_algo, hash_seed=hash_seed)
                          if nh else None)
        if self.host_pool is not None:
            self.host_pool._medium = "CPU"
        self._watermark = wm
        self._watermark_blocks = <int64_t>math.ceil(wm * (nb - 1))
        cdef bytes key = self.pool._key
        rc = kvb_mgr_init(&self.m, &self.pool.p,
                          &self.host_pool.p if self.host_pool is not None else NULL,
                          bs, <const uint8_t *>key)
        if rc:
            raise_code(rc, "BlockManager", 0, bs)
        self._initialized = True
        self._init_groups(gs, key)
        rc = kvb_grp_set_hash(self.gp, self.ng, self.pool._algo,  # and the groups' links
                              <const uint8_t *><const char *>self.pool._none_hash)
        if rc:
            raise_code(rc, "BlockManager", 0, self.pool._algo)
        if tier:
            rc = kvb_mgr_host_tier(&self.m, host_write_through)
            if rc:
                raise_code(rc, "BlockManager: host tier", 0, nh, self.m.err_what)
            self.host_pool._tier_pool = self.pool  # its events flush the tier's demotions
        self._slots = {}
        self._ids = []
        self._buf = np.empty(64, dtype=np.int32)
        self._imap = np.zeros(64, dtype=np.int32)

    cdef _init_groups(self, tuple gs, bytes key):
        """One manager per group over the pool: self.m is group 0, self.gx the others."""
        cdef Py_ssize_t G = len(gs), j
        cdef kvb_mgr_t *m
        self.groups = gs
        self._gowners = [self] + [object() for j in range(1, G)]  # metadata row caches
        self.ng = <int32_t>G
        self.gp = <kvb_mgr_t **>calloc(G, sizeof(kvb_mgr_t *))
        self.gx = <kvb_mgr_t *>calloc(G - 1, sizeof(kvb_mgr_t)) if G > 1 else NULL
        if self.gp is NULL or (G > 1 and self.gx is NULL):
            raise MemoryError()
        self._zs = <kvb_step_size_t *>calloc(G, sizeof(kvb_step_size_t))
        if self._zs is NULL:
            raise MemoryError()
        self.gp[0] = &self.m
        for j in range(1, G):
            kvb_mgr_init(&self.gx[j - 1], self.m.pool, self.m.host, self.m.block_size,
                         <const uint8_t *>key)
            self.gp[j] = &self.gx[j - 1]
        for j in range(G):
            m = self.gp[j]
            rc = kvb_mgr_set_kind(m, (<object>gs[j]).code, (<object>gs[j]).span, <uint8_t>j)
            if rc:
                raise_code(rc, f"groups[{j}]", 0, m.err_b)
        self.pool._groups = gs

    def __dealloc__(self):
        cdef int32_t j
        if self._initialized:
            kvb_mgr_destroy(&self.m)
            for j in range(1, self.ng):
                kvb_mgr_destroy(&self.gx[j - 1])
        free(self.gx)
        free(self.gp)
        free(self._zs)

    def __reduce__(self):
        raise TypeError("BlockManager cannot be pickled")

    def __repr__(self):
        return (f"BlockManager(num_blocks={self.pool.p.num_blocks}, "
                f"block_size={self.m.block_size}, seqs={self.m.nseqs}, "
                f"free={self.pool.p.num_free})")

    # -- the call guard -------------------------------------------------------------------------
    cdef int _enter(self, bint mutates=True) except -1:
        """Enter a call: wait while another thread is inside one (it yielded the GIL, e.g.
        in a garbage-collector callback); refuse re-entry from this thread. A call that may
        change tables (``mutates``) makes every StepPlan taken before it stale."""
        cdef unsigned long me
        if self._busy:
            me = PyThread_get_thread_ident()
            if self._owner == me:
                raise InvalidStateError("BlockManager called re-entrantly (from a callback "
                                        "running inside one of its own calls)")
            while self._busy:
                with nogil:
                    sched_yield()
        self._busy = 1
        if mutates:
            self._epoch += 1
        self._owner = PyThread_get_thread_ident()
        return 0

    cdef void _leave(self) noexcept:
        cdef const char *what
        if KVB_DEBUG_LEVEL >= 2 and kvb_grp_check(self.gp, self.ng):  # expensive debug level
            what = self.m.err_what
            if what is NULL:
                what = "unnamed"
            fprintf(stderr, "kvblocks: invariant violated after a call: %s (item %lld)\n",
                    what, <long long>self.m.err_b)
            abort()
        self._busy = 0

    # -- helpers --------------------------------------------------------------------------------
    cdef int32_t _slot(self, object seq_id) except -1:
        """Slot of a normalized id (inside a call)."""
        cdef PyObject *o = PyDict_GetItem(self._slots, seq_id)
        if o is NULL:
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}")
        return <int32_t><object>o

    cdef object _id_list(self, object seq_ids):
        """Phase 1 for a batch of ids: a SeqBatch as is, else a list of normalized ids (a
        generator is consumed once; the caller's list is copied only if an id needs
        normalizing)."""
        cdef Py_ssize_t i, n
        cdef list ids
        if type(seq_ids) is SeqBatch:
            return seq_ids
        if type(seq_ids) is list:
            ids = <list>seq_ids
        elif isinstance(seq_ids, (str, bytes)):
            raise InvalidTypeError("seq_ids must be a list of ids, not one id")
        else:
            try:
                ids = list(seq_ids)
            except KVBlocksError:
                raise
            except Exception as exc:
                raise InvalidTypeError(f"seq_ids must be an iterable of ids: "
                                       f"{type(exc).__name__}") from None
        n = len(ids)
        for i in range(n):
            t = type(ids[i])
            if t is not int and t is not str:
                return [norm_id(x) for x in ids]
        return ids

    cdef cnp.ndarray _slots_of(self, object ids, Py_ssize_t *count):
        """Phase 2 (inside a call): slots of the ids from _id_list, written into a reused
        buffer, or those of a SeqBatch; the first *count entries are valid. No Python code
        runs here, so the list cannot change under the loop."""
        cdef SeqBatch sb
        cdef Py_ssize_t i, n
        cdef PyObject *o
        cdef int32_t *slots
        if type(ids) is SeqBatch:
            sb = <SeqBatch>ids
            if sb.owner is not self:
                raise InvalidArgumentError("this SeqBatch belongs to another BlockManager")
            n = sb.n
            for i in range(n):
                if self.m.seqs[sb.slots[i]].gen != sb.gens[i]:
                    raise UnknownSequenceError(
                        f"sequence {sb.seq_ids[i]!r} of this SeqBatch was freed")
            count[0] = n
            return sb._slots_arr
        n = len(<list>ids)
        if cnp.PyArray_DIM(self._buf, 0) < n:
            self._buf = new_i32(max(n, 2 * cnp.PyArray_DIM(self._buf, 0)))
            # that allocation may have run other threads: the caller's list may have changed
            if len(<list>ids) != n:
                raise InvalidArgumentError("seq_ids changed size during the call")
        slots = <int32_t *>cnp.PyArray_DATA(self._buf)
        cdef int32_t *imap = <int32_t *>cnp.PyArray_DATA(self._imap)
        cdef Py_ssize_t ilen = cnp.PyArray_DIM(self._imap, 0)
        cdef long v
        cdef int overflow
        cdef object sid
        for i in range(n):
            sid = (<list>ids)[i]
            if type(sid) is int:  # small int ids: an array lookup instead of a dict probe
                v = PyLong_AsLongAndOverflow(sid, &overflow)
                if not overflow and 0 <= v < ilen and imap[v]:
                    slots[i] = imap[v] - 1
                    continue
            elif type(sid) is not str:  # normalized in phase 1: only another thread did this
                raise InvalidArgumentError("seq_ids changed during the call")
            o = PyDict_GetItem(self._slots, sid)  # exact keys: no Python code runs
            if o is NULL:
                raise UnknownSequenceError(f"unknown sequence {sid!r}")
            slots[i] = <int32_t><object>o
        count[0] = n
        return self._buf

    cdef int _err(self, int rc, str what) except -1:
        cdef object seq = None
        cdef int64_t slot = self.m.err_b
        if rc == KVB_ESWAPPED or rc == KVB_EDUP or rc == KVB_EUNKNOWN or rc == KVB_EGAP:
            slot = self.m.err_b if rc != KVB_EGAP else -1
            if 0 <= slot < len(self._ids):
                seq = self._ids[slot]
        return raise_code(rc, what, self.m.err_a, self.m.err_b, self.m.err_what, seq)

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

    cdef _unregister(self, object seq_id, int32_t slot):
        del self._slots[seq_id]
        if type(seq_id) is int and 0 <= seq_id < cnp.PyArray_DIM(self._imap, 0):
            (<int32_t *>cnp.PyArray_DATA(self._imap))[<Py_ssize_t>seq_id] = 0
        self._ids[slot] = None

    # -- properties -----------------------------------------------------------------------------
    @property
    def block_size(self):
        return self.m.block_size

    @property
    def watermark(self):
        return self._watermark

    @property
    def watermark_blocks(self):
        """Blocks admission keeps free: ``ceil(watermark * (num_blocks - 1))``."""
        return self._watermark_blocks

    @property
    def num_seqs(self):
        return self.m.nseqs

    def __len__(self):
        return self.m.nseqs

    def __contains__(self, seq_id):
        try:
            seq_id = norm_id(seq_id)
        except InvalidTypeError:
            return False
        return seq_id in self._slots

    def seq_ids(self):
        """The live sequence ids (a list, in no particular order)."""
        return list(self._slots)

    # -- scheduling helpers ---------------------------------------------------------------------
    def blocks_for_tokens(self, num_tokens):
        """Blocks a table of ``num_tokens`` tokens takes (ceil division)."""
        cdef int64_t n = as_int(num_tokens, "num_tokens", 0, INT64_MAX)
        return (n - 1) // self.m.block_size + 1 if n else 0

    def can_add(self, num_tokens):
        """Whether a prompt of ``num_tokens`` fits now while keeping the watermark free.

        Conservative: prefix-cache hits are not counted (``can_add_prompt`` counts them).
        """
        need = self._table_blocks(as_int(num_tokens, "num_tokens", 0, INT64_MAX))
        return self.pool.p.num_free - need >= self._watermark_blocks

    cdef int64_t _table_blocks(self, int64_t n):
        """Blocks a new table of n tokens takes in all groups together."""
        return kvb_grp_table_blocks(self.gp, self.ng, n)

    def probe(self, token_ids, *, salt=None, lora_name=None):
        """What ``add(seq, token_ids, salt=salt, lora_name=lora_name)`` would find now,
        without pinning anything or counting stats: ``(cached_tokens, blocks_needed)``.
        Chunked prefill sizes its first chunk from ``cached_tokens``; ``blocks_needed``
        counts evictable hits, which pinning takes out of the free pool."""
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        cdef bytes s = chain_context(self.m.hash_algo, salt, lora_name)
        cdef int64_t cached = 0, need = 0
        self._enter(False)
        try:
            rc = kvb_grp_probe(self.gp, self.ng, i32_data(toks), cnp.PyArray_DIM(toks, 0),
                               <const uint8_t *>s, len(s), &cached, &need)
            if rc:
                self._err(rc, "probe")
        finally:
            self._leave()
        return cached, need

    def can_add_prompt(self, token_ids, *, salt=None, lora_name=None):
        """Whether ``add`` of this prompt fits now while keeping the watermark free,
        counting its prefix-cache hits (nothing is pinned)."""
        cached, need = self.probe(token_ids, salt=salt, lora_name=lora_name)
        return self.pool.p.num_free - need >= self._watermark_blocks

    def blocks_needed(self, seq_id, n=1):
        """Blocks appending ``n`` tokens to ``seq_id`` would take now (growth plus
        copy-on-write); for a swapped-out sequence, the blocks swap_in plus n tokens take."""
        seq_id = norm_id(seq_id)
        cdef int64_t k = as_int(n, "n", 0, INT64_MAX)
        self._enter(False)
        try:
            return kvb_grp_blocks_needed(self.gp, self.ng, self._slot(seq_id), k)
        finally:
            self._leave()

    def can_append(self, seq_ids, n=1):
        """Whether every sequence can take ``n`` more tokens at once (one decode step).

        Exact, as ``append_batch`` counts: growth, plus copy-on-write of a shared partly
        filled last block, where m sequences of the batch writing into one block that nothing
        else holds make m - 1 copies (the last one writes in place). False when one of them
        is swapped out."""
        cdef int64_t k = as_int(n, "n", 0, INT64_MAX)
        ids = self._id_list(seq_ids)
        cdef Py_ssize_t count
        cdef int64_t need = 0
        self._enter(False)
        try:
            arr = self._slots_of(ids, &count)
            rc = kvb_grp_batch_need(self.gp, self.ng, i32_data(arr), count, k, &need)
            if rc == KVB_ESWAPPED:
                return False
            if rc:
                self._err(rc, "can_append")
            return need <= self.pool.p.num_free
        finally:
            self._leave()

    def blocks_needed_batch(self, seq_ids, num_new_tokens=1, *, draft_lens=None, forks=None,
                            bint watermark=False):
        """Blocks a scheduler's step takes for a batch, counted exactly as the calls would
        take them: for each sequence in order, ``reserve(seq, num_new_tokens[i] +
        draft_lens[i])`` (its decode token or prefill chunk, and its draft slots), then
        ``forks[i]`` children forked from it, each reserving ``num_new_tokens[i]`` slots (the
        token it commits with the fork; a child's drafts come in a later step). The step fits
        when the result is at most ``pool.num_free`` (``watermark=True`` adds
        ``watermark_blocks``, for a step that must also keep the watermark).

        Counted in every KV cache group: growth, copy-on-write (k sequences of the batch
        writing into one shared block make min(k, holders - 1) copies), a child's copy of
        the partly filled write block it shares with its parent (or its first new block),
        and a state group's blocks, which a fork copies at once: with G groups a child takes
        up to G blocks, not one. Slots already in a table (reserved earlier) cost nothing,
        and what a sliding-window or chunked-local group's release returns is not counted
        (conservative, as ``blocks_needed``).

        ``num_new_tokens`` is an int for every sequence or one per sequence; ``draft_lens``
        and ``forks`` one per sequence (default 0). Raises UnknownSequenceError,
        InvalidArgumentError (a sequence twice, a negative count, lengths that differ) or
        InvalidStateError (a swapped-out sequence: ``blocks_needed(seq)`` counts its
        swap-in).
        """
        ids = self._id_list(seq_ids)
        scalar = np.ndim(num_new_tokens) == 0  # one count for every sequence (ints only)
        n_one = as_int(num_new_tokens, "num_new_tokens", 0, INT32_MAX) if scalar else 0
        arrays = []
        if not scalar:
            arrays.append(("num_new_tokens", as_int32(num_new_tokens, "num_new_tokens")))
        if draft_lens is not None:
            arrays.append(("draft_lens", as_int32(draft_lens, "draft_lens")))
        if forks is not None:
            arrays.append(("forks", as_int32(forks, "forks")))
        for name, arr in arrays:
            if len(arr) and arr.min() < 0:
                raise InvalidArgumentError(f"blocks_needed_batch: {name} must be >= 0")
        cdef int64_t need = 0
        cdef Py_ssize_t count
        cdef cnp.ndarray ns, cn, fk = None
        self._enter(False)
        try:
            slots = self._slots_of(ids, &count)
            for name, arr in arrays:
                if len(arr) != count:
                    raise InvalidArgumentError(f"blocks_needed_batch: {count} sequences but "
                                               f"{len(arr)} {name}")
            cn = np.full(count, n_one, dtype=np.int64)
            for name, arr in arrays:
                if name == "num_new_tokens":
                    cn += arr
            ns = cn.copy()
            for name, arr in arrays:
                if name == "forks":
                    fk = np.ascontiguousarray(arr, dtype=np.int64)
                elif name == "draft_lens":
                    ns += arr
            rc = kvb_grp_step_need(self.gp, self.ng, i32_data(slots),
                                   <int64_t *>cnp.PyArray_DATA(ns),
                                   <int64_t *>cnp.PyArray_DATA(cn),
                                   <int64_t *>cnp.PyArray_DATA(fk) if fk is not None else NULL,
                                   count, &need)
            if rc:
                self._err(rc, "blocks_needed_batch")
        finally:
            self._leave()
        if watermark and need < INT64_MAX:
            need += self._watermark_blocks
        return need

    def can_swap_out(self, seq_id):
        """Whether ``swap_out(seq_id)`` would succeed now (host blocks available)."""
        cdef kvb_seq_t *s
        seq_id = norm_id(seq_id)
        self._enter(False)
        try:
            s = &self.m.seqs[self._slot(seq_id)]
            return (self.host_pool is not None and not s.swapped
                    and self._held(self._slot(seq_id)) <= self.host_pool.p.num_free)
        finally:
            self._leave()

    def can_swap_in(self, seq_id):
        """Whether ``swap_in(seq_id)`` fits now while keeping the watermark free (blocks it
        would share again from the prefix cache are counted as such)."""
        cdef kvb_seq_t *s
        seq_id = norm_id(seq_id)
        self._enter(False)
        try:
            s = &self.m.seqs[self._slot(seq_id)]
            if not s.swapped:
                return False
            need = kvb_grp_blocks_needed(self.gp, self.ng, self._slot(seq_id), 0)
            return self.pool.p.num_free - need >= self._watermark_blocks
        finally:
            self._leave()

    @property
    def num_free_blocks(self):
        return self.pool.p.num_free

    # -- sequence lifecycle -------------------------------------------------------------------
    def add(self, seq_id, token_ids, *, salt=None, lora_name=None, lora_id=None,
            bint recompute=False):
        """Allocate a block table for a prompt; reuse cached full blocks.

        Returns how many prompt tokens are already in the cache (and computed): a multiple
        of block_size, at most ``len(token_ids) - 1`` so that at least one token is computed.
        The rest is computed by the steps whose ``metadata`` covers it; only then do its full
        blocks enter the prefix cache. ``salt`` (str or bytes: tenant, LoRA adapter, ...)
        isolates the cache: different salts never share. ``lora_name`` names the LoRA adapter
        the sequence runs with: it isolates like a salt (in the vLLM modes as vLLM's LoRA
        extra key) and the KV events of its blocks carry it, with ``lora_id`` (vLLM's adapter
        int id; needs ``lora_name``) and the salt (vLLM's event extra keys: the adapter name on
        every block, the salt on block 0). ``recompute=True`` marks the
        re-admission of a sequence preempted by ``free``: its hits (often its own blocks)
        are counted in ``stats.recompute_hit_tokens``, not as prefix reuse.
        """
        seq_id = norm_id(seq_id)
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        cdef bytes s = chain_context(self.m.hash_algo, salt, lora_name)
        cdef int32_t tag = self.pool._event_tag(as_lora(lora_name), lora_id, salt)
        cdef int32_t slot
        cdef int64_t cached
        cdef Py_ssize_t n = cnp.PyArray_DIM(toks, 0)
        self._enter()
        try:
            if seq_id in self._slots:
                raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")
            rc = kvb_grp_add(self.gp, self.ng, i32_data(toks), n, <const uint8_t *>s, len(s),
                             recompute, tag, &slot, &cached)
            if rc:
                self._err(rc, f"add({seq_id!r}, {n} tokens)")
            self._register(seq_id, slot)
            return cached
        finally:
            self._leave()

    def append(self, seq_id, token_ids, *, bint computed=False):
        """Commit tokens: grow the table, copy-on-write a shared last block.

        With ``computed=True`` the tokens are accepted speculative drafts whose K/V the last
        step already wrote into draft slots (``metadata(..., draft_lens=...)``): they count as
        computed at once (and their full blocks enter the prefix cache)."""
        seq_id = norm_id(seq_id)
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        cdef Py_ssize_t n = cnp.PyArray_DIM(toks, 0)
        self._enter()
        try:
            rc = kvb_grp_append(self.gp, self.ng, self._slot(seq_id), i32_data(toks), n,
                                computed)
            if rc:
                self._err(rc, f"append({seq_id!r}, {n} tokens)")
        finally:
            self._leave()

    def append_batch(self, seq_ids, token_ids):
        """One token for each sequence in one native call (the decode step).

        ``seq_ids`` is a list of ids or a SeqBatch from batch(); ``token_ids`` one token per
        sequence. All-or-nothing: if the step does not fit, nothing is appended.
        """
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        ids = self._id_list(seq_ids)
        cdef Py_ssize_t n
        self._enter()
        try:
            slots = self._slots_of(ids, &n)
            if cnp.PyArray_DIM(toks, 0) != n:
                raise InvalidArgumentError(
                    f"append_batch: {n} sequences but {cnp.PyArray_DIM(toks, 0)} tokens")
            if n == 0:
                return
            rc = kvb_grp_append_batch(self.gp, self.ng, i32_data(slots), i32_data(toks), n)
            if rc:
                self._err(rc, f"append_batch({n} sequences)")
        finally:
            self._leave()

    def batch(self, seq_ids):
        """Resolve sequence ids once into a SeqBatch for repeated append_batch / metadata."""
        ids = self._id_list(seq_ids)
        if type(ids) is SeqBatch:
            return ids
        ids = tuple(ids)
        cdef Py_ssize_t n, i
        cdef SeqBatch sb = SeqBatch.__new__(SeqBatch)
        sb._gens_arr = np.empty(len(ids), dtype=np.uint32)
        self._enter(False)
        try:
            slots = self._slots_of(list(ids), &n)
            sb.seq_ids = ids
            sb.n = n
            sb._slots_arr = new_i32(n)
            if n:
                memcpy(cnp.PyArray_DATA(sb._slots_arr), cnp.PyArray_DATA(slots),
                       n * sizeof(int32_t))
            sb.slots = <int32_t *>cnp.PyArray_DATA(sb._slots_arr)
            sb.gens = <uint32_t *>cnp.PyArray_DATA(sb._gens_arr)
            for i in range(n):
                sb.gens[i] = self.m.seqs[sb.slots[i]].gen
            sb.owner = self
            return sb
        finally:
            self._leave()

    def reserve(self, seq_id, n):
        """Ensure ``n`` more writable slots exist after the committed tokens (lookahead,
        speculative drafts); copy-on-write a shared last block."""
        seq_id = norm_id(seq_id)
        cdef int64_t k = as_int(n, "n", 0, INT64_MAX)
        self._enter()
        try:
            rc = kvb_grp_reserve(self.gp, self.ng, self._slot(seq_id), k)
            if rc:
                self._err(rc, f"reserve({seq_id!r}, {k})")
        finally:
            self._leave()

    def truncate(self, seq_id, num_tokens):
        """Roll back to ``num_tokens`` committed tokens (rejected drafts); frees the blocks
        past them, reserved ones included."""
        seq_id = norm_id(seq_id)
        cdef int64_t k = as_int(num_tokens, "num_tokens", 0, INT64_MAX)
        self._enter()
        try:
            rc = kvb_grp_truncate(self.gp, self.ng, self._slot(seq_id), k)
            if rc == KVB_EINVAL:
                raise_code(rc, "truncate", 0, 0,
                           NULL, None, f"truncate({seq_id!r}, {k}): must be in [0, {self.m.err_a}]")
            if rc:
                self._err(rc, f"truncate({seq_id!r}, {k})")
        finally:
            self._leave()

    def fork(self, parent_id, child_id):
        """Child shares every committed block of the parent (ref counts raised) and its
        computed count."""
        parent_id = norm_id(parent_id)
        child_id = norm_id(child_id)
        cdef int32_t slot
        self._enter()
        try:
            pslot = self._slot(parent_id)
            if child_id in self._slots:
                raise DuplicateSequenceError(f"sequence {child_id!r} already exists")
            rc = kvb_grp_fork(self.gp, self.ng, pslot, &slot)
            if rc:
                self._err(rc, f"fork({parent_id!r}, {child_id!r})")
            self._register(child_id, slot)
        finally:
            self._leave()

    def free(self, seq_id):
        """Release the sequence; its blocks return to the pool tail first (cached full
        blocks stay evictable, longest prefixes evicted first)."""
        seq_id = norm_id(seq_id)
        self._enter()
        try:
            slot = self._slot(seq_id)
            rc = kvb_grp_free(self.gp, self.ng, slot)
            if rc:
                self._err(rc, f"free({seq_id!r})")
            self._unregister(seq_id, slot)
        finally:
            self._leave()

    # -- queries --------------------------------------------------------------------------------
    # Queries copy out under the call guard: allocating the result may run a garbage-collector
    # callback (another thread, or code that frees or adds sequences and moves the slots).
    def block_table(self, seq_id, group=0):
        """Physical block ids in logical order (an int32 copy) of one KV cache group. For a
        swapped-out sequence these are host-pool ids (see ``is_swapped``). Entries whose blocks
        a sliding-window or chunked-local group released read the null block 0."""
        return self._copy_out(seq_id, 0, self._group(group))

    cdef int32_t _group(self, object group) except -1:
        return <int32_t>as_int(group, "group", 0, self.ng - 1)

    cdef int64_t _held(self, int32_t slot):
        """Blocks a sequence holds in all groups (released entries excluded)."""
        return kvb_grp_held(self.gp, self.ng, slot)

    def blocks_in_use(self, seq_id):
        """Distinct blocks the sequence holds now, all groups together (released entries of
        window groups excluded; shared blocks count once per sequence holding them)."""
        seq_id = norm_id(seq_id)
        self._enter(False)
        try:
            return self._held(self._slot(seq_id))
        finally:
            self._leave()

    def num_tokens(self, seq_id):
        """Committed tokens."""
        return self._field(seq_id, 0)

    def num_computed(self, seq_id):
        """Leading tokens whose K/V are written (or promised by the last metadata call), in
        every group (with several groups, the least of them)."""
        return self._field(seq_id, 1)

    def token_ids(self, seq_id):
        """Committed token ids (an int32 copy)."""
        return self._copy_out(seq_id, 1)

    def block_hashes(self, seq_id, group=0):
        """Hashes of the full blocks in one KV cache group, (n, 2) uint64 (empty without
        prefix caching, and in a state group): ``hash_blocks(tokens, block_size, salt=...,
        key=..., group=group)`` of the sequence's tokens. In the 256-bit modes every group
        shows the engine's own hashes, ``hash_blocks(..., algo=...)``: a group's blocks are
        keyed by (hash, group), as vLLM keys them, and their events carry the hash and
        ``group_idx``."""
        return self._copy_out(seq_id, 2, self._group(group))

    def is_swapped(self, seq_id):
        return bool(self._field(seq_id, 2))

    cdef int64_t _field(self, object seq_id, int which) except? -1:
        seq_id = norm_id(seq_id)
        cdef kvb_seq_t *s
        cdef int32_t slot
        self._enter(False)
        try:
            slot = self._slot(seq_id)
            s = &self.m.seqs[slot]
            if which == 1:
                return kvb_grp_num_computed(self.gp, self.ng, slot)
            return s.ntokens if which == 0 else s.swapped
        finally:
            self._leave()

    cdef object _copy_out(self, object seq_id, int which, int32_t group=0):
        """A copy of a sequence's block table (0), tokens (1) or hashes (2) in a group."""
        seq_id = norm_id(seq_id)
        cdef const kvb_seq_t *s
        cdef const kvb_row_t *r
        cdef int32_t slot
        cdef Py_ssize_t n
        self._enter(False)
        try:
            slot = self._slot(seq_id)
            s = kvb_grp_seq(self.gp, slot)
            r = kvb_grp_row(self.gp, group, slot)
            n = r.nblocks if which == 0 else (s.ntokens if which == 1 else
                                              s.nhashed if self.gp[group].caching else 0)
            out = np.empty((n, 2), dtype=np.uint64) if which == 2 else new_i32(n)
            s = kvb_grp_seq(self.gp, slot)  # guarded: the same sequence
            r = kvb_grp_row(self.gp, group, slot)
            if n and which == 2 and self.m.hash_algo == KVB_HASH_SIPHASH:
                kvb_grp_hashes(self.gp, group, slot,
                               <kvb_hash_t *>cnp.PyArray_DATA(<cnp.ndarray>out))  # group keys
            elif n:  # 256-bit modes: the engine's own hashes (key: hash, group)
                memcpy(cnp.PyArray_DATA(<cnp.ndarray>out),
                       r.blocks if which == 0 else (<void *>s.tokens if which == 1
                                                    else <void *>s.hashes),
                       n * (sizeof(kvb_hash_t) if which == 2 else sizeof(int32_t)))
            return out
        finally:
            self._leave()

    @property
    def num_pending_copies(self):
        """Copy-on-write copies queued and not yet drained by take_copies()."""
        return self._ncopies()

    cdef int64_t _ncopies(self):
        return kvb_grp_num_copies(self.gp, self.ng)

    def take_copies(self):
        """Drain the pending (src, dst) block copies from copy-on-write: int64 [n, 2].

        Run them (one ``ops.copy_blocks`` call; no block is both a source and a destination)
        after the swap pairs returned before this call and before the step's forward pass.
        Sources stay allocated until drained; a copy whose dst block is released first
        (free, truncate, swap_out) is dropped: nothing will read that block.
        """
        cdef int64_t k = 0
        cdef int rc
        self._enter()
        try:
            out = np.empty((self._ncopies(), 2), dtype=np.int64)  # block ids are pool-wide
            rc = kvb_grp_take_copies(self.gp, self.ng,
                                     <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out),
                                     cnp.PyArray_DIM(<cnp.ndarray>out, 0), &k)
            if rc == KVB_EPENDING:
                raise_code(rc, "take_copies", 0, 0, NULL, None, (
                    f"take_copies: {self.m.err_a} offloads and {self.m.err_b} onloads are "
                    f"pending; drain take_offloads() and take_onloads() first (a copy may "
                    f"overwrite a block an offload reads, or read one an onload fills)"))
            if rc:
                self._err(rc, "take_copies")
            return out
        finally:
            self._leave()

    # -- host tier ------------------------------------------------------------------------------
    @property
    def host_prefix_cache(self):
        """Whether the host pool is a second prefix-cache tier."""
        return self.pool.p.tier is not NULL

    @property
    def host_write_through(self):
        """Whether newly cached device blocks are copied to the host tier at once."""
        return self.pool.p.tier is not NULL and self.pool.p.tier.write_through != 0

    @property
    def num_pending_offloads(self):
        """(device, host) copies queued and not yet drained by take_offloads()."""
        if self.pool.p.tier is NULL:
            return 0
        kvb_tier_flush(self.pool.p.tier)  # evictions recorded since: their offloads now
        return self.pool.p.tier.noff

    @property
    def num_pending_onloads(self):
        """(host, device) copies queued and not yet drained by take_onloads()."""
        return self.pool.p.tier.non if self.pool.p.tier is not NULL else 0

    @property
    def host_stats(self):
        """Counters of the host tier since creation: a HostStats (zeros without a tier).
        Device-tier hits stay in ``pool.stats``; ``HostStats.hit_rate`` is the host share of
        the tokens asked for."""
        cdef kvb_tier_t *t = self.pool.p.tier
        if t is NULL:
            return HostStats()
        kvb_tier_flush(t)  # demotions recorded since the last flush are counted
        s = t.stats
        h = self.host_pool.p.stats
        return HostStats(hits=s.hit_blocks, hit_tokens=s.hit_tokens,
                         recompute_hit_tokens=s.recompute_hit_tokens,
                         query_tokens=self.pool.p.stats.query_tokens,
                         demotions=s.demotions, offloads=s.offloads, onloads=s.onloads,
                         dropped=s.dropped, evictions=h.evictions, stored=h.stored)

    def take_offloads(self):
        """Drain the pending (device block, host block) copies: int64 [n, 2], for one
        ``ops.swap_blocks(cache, host_cache, pairs)`` call. The first list of each drain:
        run it before the onloads, swap pairs and copies, which may overwrite its device
        blocks (an evicted block is handed out again at once). It starts the drain: pairs
        queued after it belong to the next one. Empty without a host tier.

        >>> from kvblocks import BlockManager
        >>> mgr = BlockManager(3, 2, num_host_blocks=4, host_prefix_cache=True)
        >>> mgr.add("a", [1, 2, 3]); _ = mgr.metadata(["a"], [3]); mgr.free("a")
        0
        >>> mgr.add("b", [7, 8, 9])  # evicts a's cached block: demoted to the host
        0
        >>> mgr.take_offloads().tolist()
        [[1, 1]]
        """
        cdef kvb_tier_t *t = self.pool.p.tier
        self._enter()
        try:
            if t is NULL:
                return np.empty((0, 2), dtype=np.int64)
            while True:  # size the list after a flush (the evictions get their host blocks)
                kvb_tier_flush(t)
                out = np.empty((t.noff, 2), dtype=np.int64)
                # np.empty may run Python (a GC callback): another thread's pool call may
                # have evicted meanwhile; take only into a list of the exact size
                if kvb_tier_unflushed(t) == 0 and cnp.PyArray_DIM(<cnp.ndarray>out, 0) == t.noff:
                    break
            kvb_tier_take_offloads(t, <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out))
            return out
        finally:
            self._leave()

    def take_onloads(self):
        """Drain the pending (host block, device block) copies of host-tier hits: int64
        [n, 2], for one ``ops.swap_blocks(host_cache, cache, pairs)`` call, after the
        offloads and before the swap pairs, copies and forward pass. Releases the host
        blocks the pairs held. Raises InvalidStateError while offloads are pending (an onload
        may read a host block one of them writes): drain take_offloads() first."""
        cdef kvb_tier_t *t = self.pool.p.tier
        cdef int64_t n = 0
        cdef int rc
        self._enter()
        try:
            out = np.empty((t.non if t is not NULL else 0, 2), dtype=np.int64)
            if t is not NULL:
                rc = kvb_tier_take_onloads(t, <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out),
                                           &n)
                if rc:
                    raise_code(rc, "take_onloads", 0, 0, NULL, None, (
                        f"take_onloads: {self.host_pool.p.err_a} offloads are pending; run "
                        f"take_offloads() first (an onload may read a host block an offload "
                        f"writes)"))
            return out
        finally:
            self._leave()

    def take_events(self):
        """Drain the KV events of ``pool`` and ``host_pool`` as one list, in the order they
        were recorded (``medium`` tells them apart: ``"GPU"``, ``"CPU"``); publish this list.

        With a host tier only this order keeps every ``BlockStored``'s parent known when it
        is named: a host entry may chain on a device block the device evicts a moment later
        (its ``BlockRemoved(medium="GPU")`` then comes after the host's ``BlockStored``), and
        a device block may be stored and evicted in one step before its host copy is stored.
        Draining the two pools separately loses that order: do not mix both ways of
        draining on one manager. Without a host tier this is ``pool.take_events()`` (the
        host pool of swapping records none).
        """
        cdef kvb_tier_t *t = self.pool.p.tier
        if t is NULL:
            return self.pool.take_events()
        cdef kvb_events_t a, b, merged
        cdef int rc
        self._enter(False)
        try:
            kvb_tier_flush(t)  # evictions since: their host entries are stored now
            if self.pool.p.events.n == 0 and self.host_pool.p.events.n == 0:
                return []
            src = np.empty(self.pool.p.events.n + self.host_pool.p.events.n, dtype=np.uint8)
            # moved out before Python objects are built (another thread may record meanwhile)
            kvb_events_detach(&self.pool.p.events, &a)
            kvb_events_detach(&self.host_pool.p.events, &b)
            memset(&merged, 0, sizeof(merged))
            try:
                if cnp.PyArray_DIM(<cnp.ndarray>src, 0) != a.n + b.n:
                    src = np.empty(a.n + b.n, dtype=np.uint8)
                rc = kvb_events_merge(&a, &b, &merged,
                                      <uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src))
                if rc:
                    raise MemoryError("take_events: out of memory merging the event logs")
                return self.pool._build_events(&merged,
                                               <uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src),
                                               [self.pool._medium, self.host_pool._medium])
            finally:
                kvb_events_destroy(&merged)
                kvb_events_reattach(&self.pool.p.events, &a)
                kvb_events_reattach(&self.host_pool.p.events, &b)
        finally:
            self._leave()

    def reset_prefix_cache(self):
        """Drop every prefix-cache entry, on the device and, with a host tier, on the host.

        Sequences keep their blocks (swapped-out ones their host blocks); only the cache
        entries go, so nothing is a prefix hit until blocks are cached again. All or nothing:
        raises InvalidStateError and changes nothing while a cached device block is
        referenced (a live sequence or a pending copy or onload holds it: free them first),
        or while host-tier copies are pending (drain take_offloads() and take_onloads()
        first). Evictions since the last drain are demoted first, so they are cleared too.

        KV events (docs/host-tier.md, "Events"): without a host tier the device pool records
        one ``AllBlocksCleared`` (as vLLM's reset does): a router drops every entry it holds
        for this engine. With a host tier no ``AllBlocksCleared`` is recorded, since it names
        no medium: ``pool`` records one ``BlockRemoved(medium="GPU")`` and ``host_pool`` one
        ``BlockRemoved(medium="CPU")`` listing every entry each dropped, so a router that
        removes those hashes from that medium ends empty, in whichever order it merges the
        two pools' events. (``pool.reset_prefix_cache()`` and
        ``host_pool.reset_prefix_cache()`` clear one tier each and record the same way.)

        >>> from kvblocks import BlockManager
        >>> mgr = BlockManager(3, 2, num_host_blocks=4, host_prefix_cache=True,
        ...                    enable_kv_events=True)
        >>> mgr.add("a", [1, 2, 3]); _ = mgr.metadata(["a"], [3]); mgr.free("a")
        0
        >>> mgr.add("b", [7, 8, 9]); mgr.free("b")  # a's block goes to the host
        0
        >>> _ = mgr.take_offloads(); _ = mgr.pool.take_events(); _ = mgr.host_pool.take_events()
        >>> mgr.reset_prefix_cache()
        >>> [(type(e).__name__, e.medium) for e in mgr.host_pool.take_events()]
        [('BlockRemoved', 'CPU')]
        >>> mgr.host_pool.num_cached, mgr.add("c", [1, 2, 3])
        (0, 0)
        """
        cdef int rc
        self._enter()
        try:
            rc = kvb_mgr_reset_cache(&self.m)
            if rc == KVB_EPENDING:
                raise_code(rc, "reset_prefix_cache", 0, 0, NULL, None, (
                    f"reset_prefix_cache: {self.m.err_a} offloads and {self.m.err_b} onloads "
                    f"are pending; drain take_offloads() and take_onloads() first (they hold "
                    f"cache entries)"))
            if rc:
                what = (<bytes>self.m.err_what).decode() if self.m.err_what else "cached blocks"
                raise_code(rc, "reset_prefix_cache", 0, 0, NULL, None, (
                    f"reset_prefix_cache: {self.m.err_a} of {self.m.err_b} {what} (free the "
                    f"sequences holding them, or drain the copies that hold them, first)"))
        finally:
            self._leave()

    # -- swap -----------------------------------------------------------------------------------
    def swap_out(self, seq_id):
        """Move a sequence's blocks to the host pool: (device block, host block) int64 pairs
        for ops.swap_blocks. Blocks shared with other sequences stay on the device for them
        (this sequence gets its own host copy); cached blocks stay evictable on the device.
        A block still waiting for its copy-on-write copy is read from the copy's source."""
        seq_id = norm_id(seq_id)
        if self.host_pool is None:
            raise InvalidStateError("swap_out: no host pool (num_host_blocks=0)")
        cdef int64_t npairs = 0
        self._enter()
        try:
            slot = self._slot(seq_id)
            out = np.empty((self._held(slot), 2), dtype=np.int64)
            rc = kvb_grp_swap_out(self.gp, self.ng, slot,
                                  <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out), &npairs)
            if rc == KVB_EOUTOFBLOCKS:
                raise_code(rc, "swap_out", 0, 0, NULL, None,
                           f"swap_out({seq_id!r}): need {self.m.err_a} host blocks, "
                           f"{self.m.err_b} free")
            if rc:
                self._err(rc, f"swap_out({seq_id!r})")
            return out[:npairs]
        finally:
            self._leave()

    def swap_in(self, seq_id):
        """Bring a swapped-out sequence back: (host block, device block) int64 pairs. Full
        computed blocks still cached on the device are shared again instead of copied; the
        sequence's computed full blocks serve prefix hits again."""
        seq_id = norm_id(seq_id)
        if self.host_pool is None:
            raise InvalidStateError("swap_in: no host pool (num_host_blocks=0)")
        cdef int64_t npairs = 0
        self._enter()
        try:
            slot = self._slot(seq_id)
            if not self.m.seqs[slot].swapped:
                raise InvalidStateError(f"swap_in: sequence {seq_id!r} is not swapped out")
            out = np.empty((self._held(slot), 2), dtype=np.int64)
            rc = kvb_grp_swap_in(self.gp, self.ng, slot,
                                 <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out), &npairs)
            if rc:
                self._err(rc, f"swap_in({seq_id!r})")
            return out[:npairs]
        finally:
            self._leave()

    # -- the step -------------------------------------------------------------------------------
    def schedule(self, seq_ids, query_lens, *, draft_lens=None):
        """Declare the step that computes, for each sequence, its last ``query_lens[i]``
        committed tokens (and ``draft_lens[i]`` reserved draft slots), without building
        metadata: for callers that build kernel arguments themselves. ``metadata`` does the
        same. Afterwards every committed token counts as computed, and full blocks that
        became computed enter the prefix cache.

        Raises InvalidStateError when copy-on-write copies are pending (drain take_copies()
        first), when committed tokens before the query were never computed, or for a
        swapped-out sequence; InvalidArgumentError for a sequence given twice.
        """
        cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
        cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
            else None
        ids = self._id_list(seq_ids)
        cdef Py_ssize_t B
        self._enter()
        try:
            slots = self._slots_of(ids, &B)
            self._check_step(slots, q_arr, d_arr, B, "schedule", -1)
            kvb_grp_schedule(self.gp, self.ng, i32_data(slots), i32_data(q_arr),
                             i32_data(d_arr) if d_arr is not None else NULL, B, 1)
        finally:
            self._leave()

    def plan_step(self, seq_ids, query_lens, *, draft_lens=None, bint commit=True):
        """Plan one forward step for every KV cache group at once and return a StepPlan.

        The step computes, for each sequence, its last ``query_lens[i]`` committed tokens and
        ``draft_lens[i]`` reserved draft slots. One native call validates it for every group
        (what ``schedule`` checks), sizes each group's buffers, applies what window and chunk
        groups release, and declares it (every committed token counts as computed; newly
        full blocks enter the prefix cache). The plan's writers (``StepPlan.metadata``,
        ``StepPlan.rows``) then build each group's kernel arguments without checking again.
        ``schedule``, ``metadata`` and ``row_indices`` are this plan for all groups or one.

        With ``commit=False`` the step is checked and released but not declared: the engine
        calls ``StepPlan.commit()`` once the forward wrote the K/V (so that a forward failing
        half-way leaves nothing in the prefix cache that was not written). Until then the
        sequences' computed counts stay where they were.

        Raises what ``schedule`` raises (pending copies or host-tier pairs, a gap before the
        query, a swapped, unknown or repeated sequence, drafts not reserved); a failed call
        changes nothing.
        """
        cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
        cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
            else None
        ids = self._id_list(seq_ids)
        cdef Py_ssize_t B, j
        cdef StepPlan plan = StepPlan.__new__(StepPlan)
        self._enter()
        try:
            slots = self._slots_of(ids, &B)
            self._check_step(slots, q_arr, d_arr, B, "plan_step", -1)
            plan._slots = new_i32(B)
            if B:
                memcpy(cnp.PyArray_DATA(plan._slots), cnp.PyArray_DATA(slots),
                       B * sizeof(int32_t))
            plan._q = new_i32(B)
            if B:
                memcpy(cnp.PyArray_DATA(plan._q), cnp.PyArray_DATA(q_arr), B * sizeof(int32_t))
            plan._d = None
            if d_arr is not None:
                plan._d = new_i32(B)
                if B:
                    memcpy(cnp.PyArray_DATA(plan._d), cnp.PyArray_DATA(d_arr),
                           B * sizeof(int32_t))
            plan._zs = <kvb_step_size_t *>malloc(self.ng * sizeof(kvb_step_size_t))
            if plan._zs is NULL:  # (before anything changes: all or nothing)
                raise MemoryError()
            memcpy(plan._zs, self._zs, self.ng * sizeof(kvb_step_size_t))
            plan._ng = self.ng
            sl, q = i32_data(plan._slots), i32_data(plan._q)
            d = i32_data(plan._d) if plan._d is not None else NULL
            kvb_step_release(self.gp, self.ng, sl, q, B)
            if commit:
                kvb_step_commit(self.gp, self.ng, sl, q, d, B)
            plan.committed = commit
            plan.manager = self
            plan.seq_ids = ids if type(ids) is SeqBatch else tuple(ids)
            plan._B = B
            plan._epoch = self._epoch
            return plan
        finally:
            self._leave()

    cdef object _step_commit(self, object step):
        cdef StepPlan plan = <StepPlan>step
        if plan.committed:
            raise InvalidStateError("StepPlan.commit: the step was committed already")
        self._step_enter(plan, 0, "commit")
        try:
            kvb_step_commit(self.gp, self.ng, i32_data(plan._slots), i32_data(plan._q),
                            i32_data(plan._d) if plan._d is not None else NULL, plan._B)
            plan.committed = True
            self._epoch += 1  # declared: the computed counts changed, the tables did not
            plan._epoch = self._epoch
        finally:
            self._leave()

    cdef int _step_enter(self, object step, int32_t g, str what) except -1:
        """Enter a writer of ``step`` (no table changes): refuse a stale plan; the group's
        sizes become the checked step's."""
        cdef StepPlan plan = <StepPlan>step
        self._enter(False)
        if plan.manager is not self or plan._epoch != self._epoch:
            self._leave()
            raise InvalidStateError(f"StepPlan.{what}: the manager changed since plan_step "
                                    f"(plan the step again)")
        self._zs[g] = plan._zs[g]
        return 0

    cdef object _step_metadata(self, object step, object group, object out):
        cdef StepPlan plan = <StepPlan>step
        cdef int32_t g = self._group(group)
        if out is not None:
            if not isinstance(out, AttentionMetadata):
                raise InvalidTypeError(f"StepPlan.metadata: out must be an AttentionMetadata "
                                       f"(from AttentionMetadata.allocate), got "
                                       f"{type(out).__name__}")
            out = out.buffers
        self._step_enter(plan, g, "metadata")
        cdef Py_ssize_t B = plan._B
        cdef int32_t *d = i32_data(plan._d) if plan._d is not None else NULL
        try:
            if out is None:
                out = AttentionMetadata.allocate(max(B, 1), self._zs[g].tokens,
                                                 max(self._zs[g].blocks, 1),
                                                 max(self._zs[g].max_blocks, 1))
            return self._fill_meta(out, i32_data(plan._slots), i32_data(plan._q), d, B, g,
                                   False)
        finally:
            self._leave()

    cdef object _step_rows(self, object step, object group, object stride, object offset,
                           bint block_tables, object max_blocks, object out):
        cdef StepPlan plan = <StepPlan>step
        cdef int32_t g = self._group(group)
        if self.gp[g].kind == KVB_G_STATE:
            raise InvalidArgumentError(f"StepPlan.rows: group {g} is a state group, which "
                                       f"has no per-token rows")
        cdef int64_t st = as_int(stride, "stride", 1, INT64_MAX)
        cdef int64_t off = as_int(offset, "offset", 0, INT64_MAX)
        cdef int64_t width = -1
        if max_blocks is not None:
            width = as_int(max_blocks, "max_blocks", 0, INT32_MAX)
        if out is not None and not isinstance(out, RowIndices):
            raise InvalidTypeError(f"StepPlan.rows: out must be a RowIndices, got "
                                   f"{type(out).__name__}")
        self._step_enter(plan, g, "rows")
        cdef int32_t *d = i32_data(plan._d) if plan._d is not None else NULL
        try:
            return self._fill_rows(out, i32_data(plan._slots), i32_data(plan._q), d,
                                   plan._B, g, st, off, width, block_tables, False)
        finally:
            self._leave()

    cdef int _check_step(self, cnp.ndarray slots, cnp.ndarray q, object d, Py_ssize_t B,
                         str what, int32_t group) except -1:
        """Validate a step for one group (group >= 0) or all (-1), once, and size it
        (self._zs[group], or every group's); copies pending in any group refuse it."""
        if cnp.PyArray_DIM(q, 0) != B:
            raise InvalidArgumentError(f"{what}: {B} sequences but {cnp.PyArray_DIM(q, 0)} "
                                       f"query_lens")
        if d is not None and cnp.PyArray_DIM(<cnp.ndarray>d, 0) != B:
            raise InvalidArgumentError(f"{what}: {B} sequences but "
                                       f"{cnp.PyArray_DIM(<cnp.ndarray>d, 0)} draft_lens")
        if self.ng > 1 and self._ncopies():
            raise_code(KVB_EPENDING, what, self._ncopies(), 0)
        cdef int32_t *dp = i32_data(<cnp.ndarray>d) if d is not None else NULL
        rc = (kvb_step_check(self.gp, self.ng, i32_data(slots), i32_data(q), dp, B, self._zs)
              if group < 0 else
              kvb_step_check(&self.gp[group], 1, i32_data(slots), i32_data(q), dp, B,
                             &self._zs[group]))
        if rc and group > 0:  # the details are in that group's fields
            _copy_err(&self.m, self.gp[group], rc)
        if rc == KVB_EINVAL:
            raise_code(rc, what, 0, 0, NULL, None, (
                f"{what}: query_lens[{self.m.err_a}] / draft_lens[{self.m.err_a}] = "
                f"{self.m.err_b} is not in [0, num_tokens] / >= 0"))
        if rc == KVB_EGAP:
            seq = self._ids[(<int32_t *>cnp.PyArray_DATA(slots))[self.m.err_a]]
            raise_code(rc, what, self.m.err_a, self.m.err_b, NULL, seq)
        if rc:
            self._err(rc, what)
        return 0

    def metadata(self, seq_ids, query_lens, *, draft_lens=None, out=None, group=0):
        """Attention metadata for one forward step, built natively; it also declares the
        step (see ``schedule``): the forward right after must write the K/V of the last
        ``query_lens[i]`` committed tokens of each sequence (and of ``draft_lens[i]`` draft
        slots after them, reserved beforehand with ``reserve``).

        With ``out`` (an AttentionMetadata from ``AttentionMetadata.allocate``, or one this
        method returned for it) the arrays are written into its fixed buffers (CUDA-graph
        friendly) and views of the used part are returned; otherwise fresh arrays are
        allocated. Raises InvalidStateError while copy-on-write copies are pending.

        With KV cache groups, ``group`` selects the group whose tables are built, and the step
        is declared for that group: build the metadata of every group each step (or call
        ``schedule`` once). Block tables keep null entries where a window group released
        blocks; the kernel applies the window.
        """
        cdef int32_t g = self._group(group)
        cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
        cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
            else None
        if out is not None:
            if not isinstance(out, AttentionMetadata):
                raise InvalidTypeError(f"metadata: out must be an AttentionMetadata (from "
                                       f"AttentionMetadata.allocate), got {type(out).__name__}")
            out = out.buffers  # a returned view: fill the buffers it came from
        ids = self._id_list(seq_ids)
        cdef Py_ssize_t B
        cdef int32_t *sl
        cdef int32_t *q = i32_data(q_arr)
        cdef int32_t *d = i32_data(d_arr) if d_arr is not None else NULL
        self._enter()
        try:
            slots = self._slots_of(ids, &B)
            self._check_step(slots, q_arr, d_arr, B, "metadata", g)  # sizes: self._zs[g]
            sl = i32_data(slots)
            if out is None:  # fresh buffers of the exact size (Python code runs, guarded)
                out = AttentionMetadata.allocate(max(B, 1), self._zs[g].tokens,
                                                 max(self._zs[g].blocks, 1),
                                                 max(self._zs[g].max_blocks, 1))
            meta = self._fill_meta(out, sl, q, d, B, g, True)
            kvb_grp_schedule_one(self.gp, g, sl, q, d, B)
            return meta
        finally:
            self._leave()

    cdef object _fill_meta(self, object out, int32_t *slots, int32_t *q, int32_t *d,
                           Py_ssize_t B, int32_t g, bint release):
        """Validate the buffers of ``out`` against the checked step's size (self._zs[g]),
        apply the group's release (``release``: a v1 call; a StepPlan released already),
        write the metadata into them and return an AttentionMetadata of views over the used
        part."""
        cdef kvb_meta_t meta
        memset(&meta, 0, sizeof(meta))
        sm, bt, sl = out.slot_mapping, out.block_tables, out.seq_lens
        qo, kvp, kvi, last = out.qo_indptr, out.kv_indptr, out.kv_indices, out.kv_last_page_len
        meta.slot_mapping = <int64_t *>buf_ptr(sm, cnp.NPY_INT64, 1, 0, "slot_mapping")
        meta.seq_lens = <int32_t *>buf_ptr(sl, cnp.NPY_INT32, 1, B, "seq_lens")
        meta.qo_indptr = <int32_t *>buf_ptr(qo, cnp.NPY_INT32, 1, B + 1, "qo_indptr")
        meta.kv_indptr = <int32_t *>buf_ptr(kvp, cnp.NPY_INT32, 1, B + 1, "kv_indptr")
        if kvi is not None:  # None: no FlashInfer page list (block_tables engines)
            meta.kv_indices = <int32_t *>buf_ptr(kvi, cnp.NPY_INT32, 1, 0, "kv_indices")
            meta.cap_indices = cnp.PyArray_DIM(<cnp.ndarray>kvi, 0)
        meta.kv_last_page_len = <int32_t *>buf_ptr(last, cnp.NPY_INT32, 1, B,
                                                   "kv_last_page_len")
        meta.cap_tokens = cnp.PyArray_DIM(<cnp.ndarray>sm, 0)
        if bt is not None:
            meta.block_tables = <int32_t *>buf_ptr(bt, cnp.NPY_INT32, 2, B, "block_tables")
            meta.max_blocks = <int32_t>cnp.PyArray_DIM(<cnp.ndarray>bt, 1)
        rows, valid = out.row_cache(self._gowners[g])
        if rows is not None:
            if not (cnp.PyArray_Check(rows) and cnp.PyArray_TYPE(<cnp.ndarray>rows) ==
                    cnp.NPY_INT64 and cnp.PyArray_ISCARRAY(<cnp.ndarray>rows)):
                raise InvalidTypeError("metadata: out has a corrupted row cache")
            meta.row_cache = <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>rows)
            meta.cap_rows = cnp.PyArray_DIM(<cnp.ndarray>rows, 0) // 4
            # first use, or another manager's buffers: start afresh
            meta.valid_rows = valid
        rc = kvb_meta_fits(self.gp[g], &self._zs[g], &meta)
        if rc:
            self._err(rc if g == 0 else _copy_err(&self.m, self.gp[g], rc), "metadata")
        if release:
            kvb_step_release(&self.gp[g], 1, slots, q, B)  # before the tables are written
        kvb_meta_write(self.gp[g], slots, q, d, B, &meta)
        if rows is not None:
            out.remember_rows(self._gowners[g], meta.valid_rows)
        cdef Py_ssize_t nt = meta.n_tokens, ni = meta.n_indices
        res = AttentionMetadata(sm[:nt], bt[:B] if bt is not None else None, sl[:B],
                                qo[:B + 1], kvp[:B + 1], kvi[:ni] if kvi is not None else None,
                                last[:B], nt, B)
        return res.view_of(out)

    def _debug_corrupt(self, what, seq_id=None, group=0):
        """Testing only, debug builds only (csrc/debug.c): break one invariant of kind
        ``what`` (a key of ``_DEBUG_CORRUPTIONS``) in group ``group``, of sequence ``seq_id``
        for the per-sequence kinds, so that a test can see ``check()`` name it. The manager
        is unusable afterwards. Raises InvalidStateError in a release build or when there is
        nothing of that kind to corrupt."""
        if what not in _DEBUG_CORRUPTIONS:
            raise InvalidArgumentError(f"_debug_corrupt: unknown kind {what!r}")
        if not KVB_DEBUG_LEVEL:
            raise InvalidStateError("_debug_corrupt: debug builds only (KVBLOCKS_DEBUG=1)")
        cdef int32_t g = self._group(group)
        cdef int32_t slot = -1 if seq_id is None else self._slot(seq_id)
        rc = kvb_debug_corrupt(self.gp[g], _DEBUG_CORRUPTIONS[what], slot)
        if rc:
            raise InvalidStateError(f"_debug_corrupt: nothing to corrupt as {what!r} here")

    def take_events_wire(self, *, ts, data_parallel_rank=0, fmt="map", hash_int="unsigned"):
        """Drain both pools' KV events into one vLLM msgpack ``KVEventBatch``, in the order
        they were recorded (the events of ``take_events``, written in C;
        ``pool.take_events_wire`` has the arguments). All or nothing: if either log holds an
        event that cannot go out, it raises and neither log is drained. Atomic with respect
        to the manager's other calls (no event recorded by another thread between the
        encoding and the drain is lost)."""
        cdef kvb_tier_t *t = self.pool.p.tier
        cdef kvb_wire_opts_t wd, wh
        cdef kvb_wire_group_t gd[256]
        cdef kvb_wire_group_t gh[256]
        cdef kvb_events_t merged
        cdef list keep = []
        cdef bytes out
        self._enter(False)
        try:
            if t is NULL:  # the host pool of swapping records no events
                out = self.pool._wire_bytes(ts, data_parallel_rank, fmt, hash_int)
                kvb_events_clear(&self.pool.p.events)
                return out
            kvb_tier_flush(t)  # evictions since: their host entries are stored now
            self.pool._wire_opts(&wd, gd, keep, ts, data_parallel_rank, fmt, hash_int)
            self.host_pool._wire_opts(&wh, gh, keep, ts, data_parallel_rank, fmt, hash_int)
            src = np.empty(self.pool.p.events.n + self.host_pool.p.events.n, dtype=np.uint8)
            memset(&merged, 0, sizeof(merged))
            try:
                if kvb_events_merge(&self.pool.p.events, &self.host_pool.p.events, &merged,
                                    <uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src)):
                    raise MemoryError("take_events_wire: out of memory merging the event logs")
                wd.src = <const uint8_t *>cnp.PyArray_DATA(<cnp.ndarray>src)
                wd.alt = &wh
                out = _encode_log(&merged, &wd)
            finally:
                kvb_events_destroy(&merged)
            kvb_events_clear(&self.pool.p.events)
            kvb_events_clear(&self.host_pool.p.events)
            return out
        finally:
            self._leave()

    def check(self):
        """Verify the pool, the host pool, every block table and the pending copies (ref
        counts equal the references held, hashes match the tokens, no cached block that
        nobody computed); raises CorruptionError naming the broken invariant."""
        self._enter(False)
        try:
            rc = kvb_grp_check(self.gp, self.ng)
            if rc:
                raise_code(rc, "BlockManager.check", self.m.err_a, self.m.err_b,
                           self.m.err_what)
        finally:
            self._leave()

    # -- row indices (csrc/rows.c) --------------------------------------------------------------
    def row_indices(self, seq_ids, query_lens, *, stride, offset=0, draft_lens=None,
                    bint block_tables=False, max_blocks=None, out=None, group=0):
        """Per-token cache rows of one step, built natively; it also declares the step, as
        ``metadata`` does (the forward right after writes the K/V of the last
        ``query_lens[i]`` committed tokens and of ``draft_lens[i]`` reserved draft slots).

        Token ``p`` of a sequence is row ``table[p // block_size] * stride + offset +
        p % block_size`` (``stride >= block_size``). Returns a :class:`RowIndices`:
        ``read_index`` (every context row), ``write_index`` (the query rows), their int32 CSR
        offsets, and with ``block_tables=True`` a page table of ``(block * stride + offset) //
        block_size`` entries (``max_blocks`` columns, default the longest table), padded with
        the null block's entry. With ``out`` (a RowIndices, e.g. from ``RowIndices.allocate``
        or over views of an engine's own index storage) the rows are written into its buffers
        and views of the used part are returned; its fields left None are not built.

        Raises InvalidArgumentError for a bad geometry or a buffer too small, and what
        ``metadata`` raises for the batch (pending copies, gaps, swapped or unknown sequences);
        a failed call writes nothing and declares nothing.

        With KV cache groups, ``group`` selects the group whose rows are built and declares
        the step for that group, as ``metadata(group=)`` does; positions a window group
        released map to the null block's rows (mask them, as the window does). A state
        group has no per-token rows: InvalidArgumentError.
        """
        cdef int32_t g = self._group(group)
        if self.gp[g].kind == KVB_G_STATE:
            raise InvalidArgumentError(f"row_indices: group {g} is a state group, which has "
                                       f"no per-token rows")
        cdef int64_t st = as_int(stride, "stride", 1, INT64_MAX)
        cdef int64_t off = as_int(offset, "offset", 0, INT64_MAX)
        cdef int64_t width = -1
        if max_blocks is not None:
            width = as_int(max_blocks, "max_blocks", 0, INT32_MAX)
        cdef cnp.ndarray q_arr = as_int32(query_lens, "query_lens")
        cdef cnp.ndarray d_arr = as_int32(draft_lens, "draft_lens") if draft_lens is not None \
            else None
        if out is not None and not isinstance(out, RowIndices):
            raise InvalidTypeError(f"row_indices: out must be a RowIndices, got "
                                   f"{type(out).__name__}")
        ids = self._id_list(seq_ids)
        cdef Py_ssize_t B
        cdef int32_t *sl
        cdef int32_t *q = i32_data(q_arr)
        cdef int32_t *d = i32_data(d_arr) if d_arr is not None else NULL
        self._enter()
        try:
            slots = self._slots_of(ids, &B)
            self._check_step(slots, q_arr, d_arr, B, "row_indices", g)  # sizes: self._zs[g]
            sl = i32_data(slots)
            res = self._fill_rows(out, sl, q, d, B, g, st, off, width, block_tables, True)
            kvb_grp_schedule_one(self.gp, g, sl, q, d, B)
            return res
        finally:
            self._leave()

    cdef object _fill_rows(self, object out, int32_t *slots, int32_t *q, int32_t *d,
                           Py_ssize_t B, int32_t g, int64_t st, int64_t off, int64_t width,
                           bint block_tables, bint release):
        """row_indices' writer: fresh buffers of the checked step's size (self._zs[g]) when
        ``out`` is None, the geometry and capacity checked, the group's release applied
        (``release``: a v1 call), the rows written; a RowIndices of views returned."""
        cdef kvb_rows_t r
        memset(&r, 0, sizeof(r))
        r.stride = st
        r.offset = off
        cdef kvb_step_size_t *z = &self._zs[g]
        if out is None:  # exact sizes (Python code runs, guarded)
            out = RowIndices(np.empty(z.context, dtype=np.int64),
                             np.empty(z.tokens, dtype=np.int64),
                             new_i32(B + 1), new_i32(B + 1),
                             np.empty((B, width if width >= 0 else z.max_blocks),
                                      dtype=np.int32)
                             if block_tables else None)
        ri, wi, ro, wo, bt = (out.read_index, out.write_index, out.read_offsets,
                              out.write_offsets, out.block_tables)
        r.read_offsets = <int32_t *>_rows_buf(ro, cnp.NPY_INT32, 1, B + 1, "read_offsets")
        r.write_offsets = <int32_t *>_rows_buf(wo, cnp.NPY_INT32, 1, B + 1, "write_offsets")
        if ri is not None:
            r.read_index = <int64_t *>_rows_buf(ri, cnp.NPY_INT64, 1, 0, "read_index")
            r.cap_read = cnp.PyArray_DIM(<cnp.ndarray>ri, 0)
        if wi is not None:
            r.write_index = <int64_t *>_rows_buf(wi, cnp.NPY_INT64, 1, 0, "write_index")
            r.cap_write = cnp.PyArray_DIM(<cnp.ndarray>wi, 0)
        if bt is not None:
            r.block_tables = <int32_t *>_rows_buf(bt, cnp.NPY_INT32, 2, B, "block_tables")
            r.max_blocks = <int32_t>cnp.PyArray_DIM(<cnp.ndarray>bt, 1)
        rc = kvb_rows_fits(self.gp[g], z, &r)
        if rc and g:
            _copy_err(&self.m, self.gp[g], rc)
        if rc == KVB_EINVAL and self.m.err_what is not NULL:
            raise_code(rc, "row_indices", 0, 0, NULL, None, (
                f"row_indices: {self.m.err_what.decode()} (stride={st}, offset={off}, "
                f"block_size={self.m.block_size})"))
        if rc == KVB_ERANGE:
            raise_code(rc, "row_indices", self.m.err_a, self.m.err_b, self.m.err_what)
        if rc:
            self._err(rc, "row_indices")
        if release:
            kvb_step_release(&self.gp[g], 1, slots, q, B)  # before the rows are written
        kvb_rows_write(self.gp[g], slots, q, d, B, &r)
        return RowIndices(ri[:r.n_read] if ri is not None else None,
                          wi[:r.n_write] if wi is not None else None,
                          ro[:B + 1], wo[:B + 1],
                          bt[:B] if bt is not None else None, r.n_read, r.n_write, B)


#: BlockManager._debug_corrupt's kinds (csrc/debug.c) and the check each must trip
_DEBUG_CORRUPTIONS = {
    "cache_slot": KVB_DBG_CACHE_SLOT,
    "table_entry": KVB_DBG_TABLE_ENTRY,
    "unwritten": KVB_DBG_UNWRITTEN,
    "free_link": KVB_DBG_FREE_LINK,
    "ref_count": KVB_DBG_REF_COUNT,
    "seq_hash": KVB_DBG_SEQ_HASH,
    "computed": KVB_DBG_COMPUTED,
    "table_block": KVB_DBG_TABLE_BLOCK,
    "state_room": KVB_DBG_STATE_ROOM,
}


cdef int _copy_err(kvb_mgr_t *dst, kvb_mgr_t *src, int rc) noexcept:
    dst.err_a = src.err_a
    dst.err_b = src.err_b
    dst.err_what = src.err_what
    return rc


cdef tuple _group_tuple(object groups):
    """The groups argument of BlockManager as a tuple of KVGroup (default: one full group)."""
    if groups is None:
        return (KVGroup("full"),)
    if isinstance(groups, (str, bytes, KVGroup)):
        raise InvalidTypeError("groups must be a sequence of KVGroup")
    try:
        gs = tuple(groups)
    except TypeError:
        raise InvalidTypeError(f"groups must be a sequence of KVGroup, got "
                               f"{type(groups).__name__}") from None
    if not gs:
        raise InvalidArgumentError("groups must hold at least one KVGroup")
    if len(gs) > 255:
        raise InvalidArgumentError(f"at most 255 groups, got {len(gs)}")
    for g in gs:
        if type(g) is not KVGroup:
            raise InvalidTypeError(f"groups must hold KVGroup, got {type(g).__name__}")
    return gs


cdef void *_rows_buf(object arr, int typenum, int ndim, Py_ssize_t rows,
                     str name) except NULL:
    """Data pointer of a writable C-contiguous buffer of row_indices' ``out``."""
    if not cnp.PyArray_Check(arr):
        raise InvalidTypeError(f"row_indices: out.{name} must be a numpy array, got "
                               f"{type(arr).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>arr
    if (cnp.PyArray_TYPE(a) != typenum or cnp.PyArray_NDIM(a) != ndim
            or not cnp.PyArray_ISCARRAY(a)):
        want = "int64" if typenum == cnp.NPY_INT64 else "int32"
        raise InvalidTypeError(f"row_indices: out.{name} must be a writable C-contiguous "
                               f"{ndim}-D {want} array, got {arr.dtype} {arr.shape}")
    if cnp.PyArray_DIM(a, 0) < rows:
        raise InvalidArgumentError(f"row_indices: out.{name} holds {cnp.PyArray_DIM(a, 0)} "
                                   f"rows, the batch needs {rows}")
    return cnp.PyArray_DATA(a)

