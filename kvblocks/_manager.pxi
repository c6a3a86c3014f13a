# BlockManager (included by _core.pyx): convert, guard, call, raise.
#
# Every public method follows the boundary rule of _convert.pxi: arguments are converted
# first (this may run Python code), then the call enters the manager (_enter: atomic with
# respect to other threads and refusing re-entry from a callback), validates and mutates in C.
# The longer calls live beside it as functions taking the manager: ids and slots
# (_seqmap.pxi), the step and its writers (_step.pxi, _writers.pxi), the host tier and the
# events (_tier.pxi). The manager is read through functions (csrc/query.c), not struct fields.
from cpython.pythread cimport PyThread_get_thread_ident
from libc.stdio cimport fprintf, stderr
from libc.stdlib cimport abort, calloc, free


cdef extern from "<sched.h>" nogil:
    int sched_yield()


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
        cdef int64_t a, b
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
        _init_groups(self, gs, bs, self.pool._key)
        if tier:
            rc = kvb_mgr_host_tier(self.gp[0], host_write_through)
            if rc:
                raise_code(rc, "BlockManager: host tier", 0, nh, kvb_mgr_err(self.gp[0], &a, &b))
            self.host_pool._tier_pool = self.pool  # its events flush the tier's demotions
        self._slots = {}
        self._ids = []
        self._buf = np.empty(64, dtype=np.int32)
        self._imap = np.zeros(64, dtype=np.int32)

    def __dealloc__(self):
        kvb_grp_delete(self.gp, self.ng)
        free(self._zs)

    def __reduce__(self):
        raise TypeError("BlockManager cannot be pickled")

    def __repr__(self):
        return (f"BlockManager(num_blocks={self.pool.p.num_blocks}, "
                f"block_size={kvb_grp_block_size(self.gp)}, seqs={kvb_grp_nseqs(self.gp)}, "
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
        cdef int64_t a, b
        if KVB_DEBUG_LEVEL >= 2 and kvb_grp_check(self.gp, self.ng):  # expensive debug level
            what = kvb_mgr_err(self.gp[0], &a, &b)
            if what is NULL:
                what = "unnamed"
            fprintf(stderr, "kvblocks: invariant violated after a call: %s (item %lld)\n",
                    what, <long long>b)
            abort()
        self._busy = 0

    # -- properties -----------------------------------------------------------------------------
    @property
    def block_size(self):
        return kvb_grp_block_size(self.gp)

    @property
    def watermark(self):
        return self._watermark

    @property
    def watermark_blocks(self):
        """Blocks admission keeps free: ``ceil(watermark * (num_blocks - 1))``."""
        return self._watermark_blocks

    @property
    def num_seqs(self):
        return kvb_grp_nseqs(self.gp)

    def __len__(self):
        return kvb_grp_nseqs(self.gp)

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
        return (n - 1) // kvb_grp_block_size(self.gp) + 1 if n else 0

    def can_add(self, num_tokens):
        """Whether a prompt of ``num_tokens`` fits now while keeping the watermark free.

        Conservative: prefix-cache hits are not counted (``can_add_prompt`` counts them).
        """
        need = kvb_grp_table_blocks(self.gp, self.ng, as_int(num_tokens, "num_tokens", 0,
                                                             INT64_MAX))
        return self.pool.p.num_free - need >= self._watermark_blocks

    def probe(self, token_ids, *, salt=None, lora_name=None):
        """What ``add(seq, token_ids, salt=salt, lora_name=lora_name)`` would find now,
        without pinning anything or counting stats: ``(cached_tokens, blocks_needed)``.
        Chunked prefill sizes its first chunk from ``cached_tokens``; ``blocks_needed``
        counts evictable hits, which pinning takes out of the free pool."""
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        cdef bytes s = chain_context(kvb_grp_hash_algo(self.gp), salt, lora_name)
        cdef int64_t cached = 0, need = 0
        self._enter(False)
        try:
            rc = kvb_grp_probe(self.gp, self.ng, i32_data(toks), cnp.PyArray_DIM(toks, 0),
                               <const uint8_t *>s, len(s), &cached, &need)
            if rc:
                raise_mgr(self, rc, "probe")
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
            return kvb_grp_blocks_needed(self.gp, self.ng, slot_of(self, seq_id), k)
        finally:
            self._leave()

    def can_append(self, seq_ids, n=1):
        """Whether every sequence can take ``n`` more tokens at once (one decode step).

        Exact, as ``append_batch`` counts: growth, plus copy-on-write of a shared partly
        filled last block, where m sequences of the batch writing into one block that nothing
        else holds make m - 1 copies (the last one writes in place). False when one of them
        is swapped out."""
        cdef int64_t k = as_int(n, "n", 0, INT64_MAX)
        ids = ids_of(seq_ids)
        cdef Py_ssize_t count
        cdef int64_t need = 0
        self._enter(False)
        try:
            arr = slots_of(self, ids, &count)
            rc = kvb_grp_batch_need(self.gp, self.ng, i32_data(arr), count, k, &need)
            if rc == KVB_ESWAPPED:
                return False
            if rc:
                raise_mgr(self, rc, "can_append")
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
        need = step_need(self, seq_ids, num_new_tokens, draft_lens, forks)
        if watermark and need < INT64_MAX:
            need += self._watermark_blocks
        return need

    def can_swap_out(self, seq_id):
        """Whether ``swap_out(seq_id)`` would succeed now (host blocks available)."""
        seq_id = norm_id(seq_id)
        self._enter(False)
        try:
            slot = slot_of(self, seq_id)
            return (self.host_pool is not None and not kvb_grp_swapped(self.gp, slot)
                    and kvb_grp_held(self.gp, self.ng, slot) <= self.host_pool.p.num_free)
        finally:
            self._leave()

    def can_swap_in(self, seq_id):
        """Whether ``swap_in(seq_id)`` fits now while keeping the watermark free (blocks it
        would share again from the prefix cache are counted as such)."""
        seq_id = norm_id(seq_id)
        self._enter(False)
        try:
            slot = slot_of(self, seq_id)
            if not kvb_grp_swapped(self.gp, slot):
                return False
            need = kvb_grp_blocks_needed(self.gp, self.ng, slot, 0)
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
        cdef bytes s = chain_context(kvb_grp_hash_algo(self.gp), salt, lora_name)
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
                raise_mgr(self, rc, f"add({seq_id!r}, {n} tokens)")
            register(self, seq_id, slot)
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
            rc = kvb_grp_append(self.gp, self.ng, slot_of(self, seq_id), i32_data(toks), n,
                                computed)
            if rc:
                raise_mgr(self, rc, f"append({seq_id!r}, {n} tokens)")
        finally:
            self._leave()

    def append_batch(self, seq_ids, token_ids):
        """One token for each sequence in one native call (the decode step).

        ``seq_ids`` is a list of ids or a SeqBatch from batch(); ``token_ids`` one token per
        sequence. All-or-nothing: if the step does not fit, nothing is appended.
        """
        cdef cnp.ndarray toks = as_int32(token_ids, "token_ids")
        ids = ids_of(seq_ids)
        cdef Py_ssize_t n
        self._enter()
        try:
            slots = slots_of(self, ids, &n)
            if cnp.PyArray_DIM(toks, 0) != n:
                raise InvalidArgumentError(
                    f"append_batch: {n} sequences but {cnp.PyArray_DIM(toks, 0)} tokens")
            if n == 0:
                return
            rc = kvb_grp_append_batch(self.gp, self.ng, i32_data(slots), i32_data(toks), n)
            if rc:
                raise_mgr(self, rc, f"append_batch({n} sequences)")
        finally:
            self._leave()

    def batch(self, seq_ids):
        """Resolve sequence ids once into a SeqBatch for repeated append_batch / metadata."""
        return make_batch(self, seq_ids)

    def reserve(self, seq_id, n):
        """Ensure ``n`` more writable slots exist after the committed tokens (lookahead,
        speculative drafts); copy-on-write a shared last block."""
        seq_id = norm_id(seq_id)
        cdef int64_t k = as_int(n, "n", 0, INT64_MAX)
        self._enter()
        try:
            rc = kvb_grp_reserve(self.gp, self.ng, slot_of(self, seq_id), k)
            if rc:
                raise_mgr(self, rc, f"reserve({seq_id!r}, {k})")
        finally:
            self._leave()

    def truncate(self, seq_id, num_tokens):
        """Roll back to ``num_tokens`` committed tokens (rejected drafts); frees the blocks
        past them, reserved ones included."""
        seq_id = norm_id(seq_id)
        cdef int64_t k = as_int(num_tokens, "num_tokens", 0, INT64_MAX)
        self._enter()
        try:
            rc = kvb_grp_truncate(self.gp, self.ng, slot_of(self, seq_id), k)
            if rc:
                raise_mgr(self, rc, f"truncate({seq_id!r}, {k})")
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
            pslot = slot_of(self, parent_id)
            if child_id in self._slots:
                raise DuplicateSequenceError(f"sequence {child_id!r} already exists")
            rc = kvb_grp_fork(self.gp, self.ng, pslot, &slot)
            if rc:
                raise_mgr(self, rc, f"fork({parent_id!r}, {child_id!r})")
            register(self, child_id, slot)
        finally:
            self._leave()

    def free(self, seq_id):
        """Release the sequence; its blocks return to the pool tail first (cached full
        blocks stay evictable, longest prefixes evicted first)."""
        seq_id = norm_id(seq_id)
        self._enter()
        try:
            slot = slot_of(self, seq_id)
            rc = kvb_grp_free(self.gp, self.ng, slot)
            if rc:
                raise_mgr(self, rc, f"free({seq_id!r})")
            unregister(self, seq_id, slot)
        finally:
            self._leave()

    # -- queries --------------------------------------------------------------------------------
    # Queries copy out under the call guard: allocating the result may run a garbage-collector
    # callback (another thread, or code that frees or adds sequences and moves the slots).
    def block_table(self, seq_id, group=0):
        """Physical block ids in logical order (an int32 copy) of one KV cache group. For a
        swapped-out sequence these are host-pool ids (see ``is_swapped``). Entries whose blocks
        a sliding-window or chunked-local group released read the null block 0."""
        return read_seq(self, seq_id, KVB_READ_TABLE, group_of(self, group))

    def blocks_in_use(self, seq_id):
        """Distinct blocks the sequence holds now, all groups together (released entries of
        window groups excluded; shared blocks count once per sequence holding them)."""
        return seq_count(self, seq_id, 3)

    def num_tokens(self, seq_id):
        """Committed tokens."""
        return seq_count(self, seq_id, 0)

    def num_computed(self, seq_id):
        """Leading tokens whose K/V are written (or promised by the last metadata call), in
        every group (with several groups, the least of them)."""
        return seq_count(self, seq_id, 1)

    def token_ids(self, seq_id):
        """Committed token ids (an int32 copy)."""
        return read_seq(self, seq_id, KVB_READ_TOKENS, 0)

    def block_hashes(self, seq_id, group=0):
        """Hashes of the full blocks in one KV cache group, (n, 2) uint64 (empty without
        prefix caching, and in a state group): ``hash_blocks(tokens, block_size, salt=...,
        key=..., group=group)`` of the sequence's tokens. In the 256-bit modes every group
        shows the engine's own hashes, ``hash_blocks(..., algo=...)``: a group's blocks are
        keyed by (hash, group), as vLLM keys them, and their events carry the hash and
        ``group_idx``."""
        return read_seq(self, seq_id, KVB_READ_HASHES, group_of(self, group))

    def is_swapped(self, seq_id):
        return bool(seq_count(self, seq_id, 2))

    @property
    def num_pending_copies(self):
        """Copy-on-write copies queued and not yet drained by take_copies()."""
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
        try:  # block ids are pool-wide; the drain order is checked in C
            out = np.empty((kvb_grp_num_copies(self.gp, self.ng), 2), dtype=np.int64)
            rc = kvb_grp_take_copies(self.gp, self.ng,
                                     <int64_t *>cnp.PyArray_DATA(<cnp.ndarray>out),
                                     cnp.PyArray_DIM(<cnp.ndarray>out, 0), &k)
            if rc:
                raise_mgr(self, rc, "take_copies")
            return out
        finally:
            self._leave()

    # -- host tier and events (_tier.pxi) -------------------------------------------------------
    @property
    def host_prefix_cache(self):
        """Whether the host pool is a second prefix-cache tier."""
        return kvb_grp_tier(self.gp) is not NULL

    @property
    def host_write_through(self):
        """Whether newly cached device blocks are copied to the host tier at once."""
        return kvb_tier_write_through(kvb_grp_tier(self.gp)) != 0

    @property
    def num_pending_offloads(self):
        """(device, host) copies queued and not yet drained by take_offloads()."""
        return tier_pending(self, True)

    @property
    def num_pending_onloads(self):
        """(host, device) copies queued and not yet drained by take_onloads()."""
        return tier_pending(self, False)

    @property
    def host_stats(self):
        """Counters of the host tier since creation: a HostStats (zeros without a tier).
        Device-tier hits stay in ``pool.stats``; ``HostStats.hit_rate`` is the host share of
        the tokens asked for."""
        return tier_stats(self)

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
        return take_offloads(self)

    def take_onloads(self):
        """Drain the pending (host block, device block) copies of host-tier hits: int64
        [n, 2], for one ``ops.swap_blocks(host_cache, cache, pairs)`` call, after the
        offloads and before the swap pairs, copies and forward pass. Releases the host
        blocks the pairs held. Raises InvalidStateError while offloads are pending (an onload
        may read a host block one of them writes): drain take_offloads() first."""
        return take_onloads(self)

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
        return take_events(self)

    def take_events_wire(self, *, ts, data_parallel_rank=0, fmt="map", hash_int="unsigned"):
        """Drain both pools' KV events into one vLLM msgpack ``KVEventBatch``, in the order
        they were recorded (the events of ``take_events``, written in C;
        ``pool.take_events_wire`` has the arguments). All or nothing: if either log holds an
        event that cannot go out, it raises and neither log is drained. Atomic with respect
        to the manager's other calls (no event recorded by another thread between the
        encoding and the drain is lost)."""
        return take_events_wire(self, ts, data_parallel_rank, fmt, hash_int)

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
        reset_cache(self)

    # -- swap -----------------------------------------------------------------------------------
    def swap_out(self, seq_id):
        """Move a sequence's blocks to the host pool: (device block, host block) int64 pairs
        for ops.swap_blocks. Blocks shared with other sequences stay on the device for them
        (this sequence gets its own host copy); cached blocks stay evictable on the device.
        A block still waiting for its copy-on-write copy is read from the copy's source."""
        return swap(self, seq_id, False)

    def swap_in(self, seq_id):
        """Bring a swapped-out sequence back: (host block, device block) int64 pairs. Full
        computed blocks still cached on the device are shared again instead of copied; the
        sequence's computed full blocks serve prefix hits again."""
        return swap(self, seq_id, True)

    # -- the step (_step.pxi, _writers.pxi) -----------------------------------------------------
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
        schedule(self, seq_ids, query_lens, draft_lens)

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
        return plan_step(self, seq_ids, query_lens, draft_lens, commit)

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
        return metadata(self, seq_ids, query_lens, draft_lens, out, group)

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
        return row_indices(self, seq_ids, query_lens, stride, offset, draft_lens,
                           block_tables, max_blocks, out, group)

    # -- checks ---------------------------------------------------------------------------------
    def check(self):
        """Verify the pool, the host pool, every block table and the pending copies (ref
        counts equal the references held, hashes match the tokens, no cached block that
        nobody computed); raises CorruptionError naming the broken invariant."""
        self._enter(False)
        try:
            rc = kvb_grp_check(self.gp, self.ng)
            if rc:
                raise_mgr(self, rc, "BlockManager.check")
        finally:
            self._leave()

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
        cdef int32_t g = group_of(self, group)
        cdef int32_t slot = -1 if seq_id is None else slot_of(self, seq_id)
        rc = kvb_debug_corrupt(self.gp[g], _DEBUG_CORRUPTIONS[what], slot)
        if rc:
            raise InvalidStateError(f"_debug_corrupt: nothing to corrupt as {what!r} here")


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


cdef int32_t group_of(BlockManager mgr, object group) except -1:
    """A checked KV cache group index."""
    return <int32_t>as_int(group, "group", 0, mgr.ng - 1)
