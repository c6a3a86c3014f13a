# Declarations of csrc/core.h, the C core (declared once, here).
cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint8_t, uint32_t, uint64_t

cdef extern from "core.h" nogil:
    enum:
        KVB_OK
        KVB_ENOMEM
        KVB_EOUTOFBLOCKS
        KVB_EINVAL
        KVB_ERANGE
        KVB_ESTATE
        KVB_ECORRUPT
        KVB_EUNKNOWN
        KVB_EDUP
        KVB_ESWAPPED
        KVB_EPENDING
        KVB_EGAP
        KVB_EV_STORED
        KVB_EV_REMOVED
        KVB_EV_CLEARED
        KVB_DEBUG_LEVEL
        KVB_F_CACHED
        KVB_F_FREE
        KVB_NONE

    ctypedef struct kvb_hash_t:
        uint64_t lo
        uint64_t hi

    void kvb_siphash128(const uint8_t *key, const void *data, size_t len, kvb_hash_t *out)
    void kvb_hash_root(const uint8_t *key, const uint8_t *salt, size_t salt_len, kvb_hash_t *out)
    void kvb_hash_chain(const uint8_t *key, const kvb_hash_t *parent, const int32_t *tokens,
                        int64_t n_blocks, int32_t block_size, kvb_hash_t *out)

    enum:
        KVB_DBG_CACHE_SLOT
        KVB_DBG_TABLE_ENTRY
        KVB_DBG_UNWRITTEN
        KVB_DBG_FREE_LINK
        KVB_DBG_REF_COUNT
        KVB_DBG_SEQ_HASH
        KVB_DBG_COMPUTED
        KVB_DBG_TABLE_BLOCK
        KVB_DBG_STATE_ROOM

    enum:
        KVB_HASH_SIPHASH
        KVB_HASH_VLLM_SHA256_CBOR
        KVB_HASH_VLLM_SHA256_CBOR_V030
        KVB_HASH_SGLANG_SHA256

    ctypedef struct kvb_digest_t:
        kvb_hash_t h
        kvb_hash_t x

    ctypedef struct kvb_hasher_t:
        int32_t algo, has_start
        kvb_digest_t start

    int kvb_hasher_init(kvb_hasher_t *hs, int32_t algo, const uint8_t *key,
                        const uint8_t *none_hash, const uint8_t *ctx, size_t ctx_len)
    void kvb_hash_blocks(const kvb_hasher_t *hs, const kvb_digest_t *parent, int64_t first,
                         const int32_t *tokens, int64_t n, int32_t block_size, kvb_hash_t *out_h,
                         kvb_hash_t *out_x)
    int kvb_digest_size(int32_t algo)
    void kvb_digest_to_bytes(int32_t algo, const kvb_digest_t *d, uint8_t *out)
    void kvb_digest_from_bytes(int32_t algo, const uint8_t *inp, kvb_digest_t *d)
    void kvb_vllm_none_hash(const uint8_t *seed, size_t seed_len, uint8_t *out)
    int64_t kvb_vllm_context(int32_t algo, const uint8_t *salt, size_t salt_len,
                             const uint8_t *lora, size_t lora_len, uint8_t *out, size_t cap)
    void kvb_sha256(const void *data, size_t len, uint8_t *out)

    ctypedef struct kvb_stats_t:
        uint64_t queries, query_blocks, hit_blocks, query_tokens, hit_tokens
        uint64_t recompute_query_tokens, recompute_hit_tokens
        uint64_t evictions, allocations, frees, stored

    ctypedef struct kvb_events_t:
        int64_t n, cap
        uint8_t *kind
        kvb_hash_t *hash
        kvb_hash_t *parent
        int32_t *block
        uint8_t *group
        int64_t *tok_off
        int64_t ntok, tok_cap
        int32_t *tokens
        int32_t *tag
        int32_t cur_tag
        int64_t max_pending
        uint64_t dropped

    ctypedef struct kvb_tier_stats_t:
        uint64_t hit_blocks, hit_tokens, recompute_hit_tokens, demotions, offloads, onloads
        uint64_t dropped

    ctypedef struct kvb_tier_t:  # opaque: read through kvb_tier_pending, kvb_tier_stats
        pass

    ctypedef struct kvb_pool_t:
        int32_t num_blocks, num_free, num_cached, num_evictable, free_head, free_tail
        int32_t *ref_count
        int32_t *prev
        int32_t *next
        kvb_hash_t *hash
        uint8_t *flags
        uint8_t *gid
        int32_t *table
        uint64_t table_mask
        int caching, record_events
        kvb_stats_t stats
        kvb_events_t events
        int64_t err_a, err_b
        const char *err_what
        kvb_tier_t *tier
        int32_t *dnext
        int dup_insert
        int32_t nx, xcap
        int32_t *xhead
        int32_t *xblock
        int32_t *xnext
        uint64_t *xcheck

    int kvb_pool_init(kvb_pool_t *p, int32_t num_blocks, int caching)
    int kvb_pool_init_any(kvb_pool_t *p, int32_t num_blocks, int caching)
    int kvb_pool_try_reset_cache(kvb_pool_t *p, int keep_order)
    int kvb_pool_move_entry(kvb_pool_t *p, int32_t src, int32_t dst)
    void kvb_pool_destroy(kvb_pool_t *p)
    size_t kvb_pool_bytes(const kvb_pool_t *p)
    int kvb_pool_allocate(kvb_pool_t *p, int32_t n, int32_t *out)
    int kvb_pool_free(kvb_pool_t *p, const int32_t *ids, int64_t n)
    int kvb_pool_incref(kvb_pool_t *p, const int32_t *ids, int64_t n)
    int kvb_pool_check(kvb_pool_t *p)
    int kvb_pool_touch(kvb_pool_t *p, const int32_t *ids, int64_t n)
    int kvb_pool_reset_cache_keep_order(kvb_pool_t *p)
    int kvb_pool_free_placed(kvb_pool_t *p, const int32_t *ids, int64_t n, int where)
    int64_t kvb_pool_uncache_ids(kvb_pool_t *p, const int32_t *ids, int64_t n)
    enum:
        KVB_PLACE_HEAD
        KVB_PLACE_TAIL
        KVB_PLACE_VLLM
    int32_t kvb_cache_find(const kvb_pool_t *p, const kvb_hash_t *h)
    int32_t kvb_cache_find_entry(const kvb_pool_t *p, const kvb_hash_t *h)
    int kvb_cache_add_key(kvb_pool_t *p, int32_t b, const kvb_hash_t *h, const uint64_t *check4)
    int kvb_cache_insert(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes, int64_t n,
                         const kvb_hash_t *parent, const int32_t *tokens, int32_t block_size,
                         int64_t *stored)
    int64_t kvb_cache_lookup(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n, int32_t *out)
    int64_t kvb_pool_lookup_pin(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n, int32_t *out)
    int kvb_pool_reset_cache(kvb_pool_t *p)
    void kvb_events_clear(kvb_events_t *ev)
    void kvb_events_detach(kvb_events_t *ev, kvb_events_t *out)
    void kvb_events_reattach(kvb_events_t *ev, kvb_events_t *snap)
    void kvb_events_destroy(kvb_events_t *ev)
    int kvb_events_merge(const kvb_events_t *a, const kvb_events_t *b, kvb_events_t *out,
                         uint8_t *src)

    enum: KVB_WIRE_MAP, KVB_WIRE_ARRAY
    ctypedef struct kvb_wire_tag_t:
        const uint8_t *lora_name
        int32_t lora_name_len, has_lora_id
        int64_t lora_id
        const uint8_t *salt
        int32_t salt_len, salt_bin
    ctypedef struct kvb_wire_group_t:
        const uint8_t *kind
        int32_t kind_len, has_window
        int64_t window
    ctypedef struct kvb_wire_opts_t:
        int32_t fmt, hash_signed
        double ts
        int32_t has_dp
        int64_t dp
        const uint8_t *medium
        int32_t medium_len
        const kvb_wire_tag_t *tags
        int32_t ntags
        const kvb_wire_group_t *groups
        int32_t ngroups
        const uint8_t *src
        const kvb_wire_opts_t *alt
    ctypedef struct kvb_buf_t:
        uint8_t *data
        size_t len, cap
    int kvb_events_encode(const kvb_events_t *ev, const kvb_wire_opts_t *w, kvb_buf_t *out,
                          int64_t *bad)
    void kvb_buf_free(kvb_buf_t *b)

    enum:
        KVB_G_FULL
        KVB_G_WINDOW
        KVB_G_CHUNK
        KVB_G_STATE

    ctypedef struct kvb_mgr_t:  # opaque: one KV cache group (g[0] holds the sequences)
        pass

    void kvb_pool_event_hash(const kvb_pool_t *p, int32_t b, kvb_hash_t *out)
    int kvb_grp_new(kvb_mgr_t ***out, int32_t G, kvb_pool_t *pool, kvb_pool_t *host,
                    int32_t block_size, const uint8_t *key)
    void kvb_grp_delete(kvb_mgr_t **g, int32_t G)
    int kvb_mgr_set_kind(kvb_mgr_t *m, int32_t kind, int64_t span, uint8_t gidx)
    void kvb_group_tag(const uint8_t *key, uint8_t gidx, kvb_hash_t *out)
    int kvb_grp_set_hash(kvb_mgr_t **g, int32_t G, int32_t algo, const uint8_t *none_hash)
    int64_t kvb_grp_table_blocks(kvb_mgr_t **g, int32_t G, int64_t n)
    int64_t kvb_grp_held(kvb_mgr_t **g, int32_t G, int32_t slot)
    int64_t kvb_grp_num_computed(kvb_mgr_t **g, int32_t G, int32_t slot)
    int64_t kvb_grp_num_copies(kvb_mgr_t **g, int32_t G)
    enum:
        KVB_READ_TABLE
        KVB_READ_TOKENS
        KVB_READ_HASHES
    const char *kvb_mgr_err(const kvb_mgr_t *m, int64_t *a, int64_t *b)
    int32_t kvb_grp_nseqs(kvb_mgr_t **g)
    int32_t kvb_grp_block_size(kvb_mgr_t **g)
    int32_t kvb_grp_hash_algo(kvb_mgr_t **g)
    int32_t kvb_grp_kind(kvb_mgr_t **g, int32_t j)
    int kvb_grp_swapped(kvb_mgr_t **g, int32_t slot)
    int64_t kvb_grp_num_tokens(kvb_mgr_t **g, int32_t slot)
    void kvb_grp_gens(kvb_mgr_t **g, const int32_t *slots, int64_t n, uint32_t *out)
    int64_t kvb_grp_stale(kvb_mgr_t **g, const int32_t *slots, const uint32_t *gens, int64_t n)
    int64_t kvb_grp_read(kvb_mgr_t **g, int32_t j, int32_t slot, int32_t what, void *out)
    kvb_tier_t *kvb_grp_tier(kvb_mgr_t **g)
    void kvb_tier_pending(const kvb_tier_t *t, int64_t *noff, int64_t *non)
    int kvb_tier_write_through(const kvb_tier_t *t)
    const kvb_tier_stats_t *kvb_tier_stats(const kvb_tier_t *t)
    int kvb_grp_add(kvb_mgr_t **g, int32_t G, const int32_t *tokens, int64_t n,
                    const uint8_t *salt, size_t salt_len, int recompute, int32_t tag,
                    int32_t *slot_out, int64_t *cached_out)
    int kvb_grp_probe(kvb_mgr_t **g, int32_t G, const int32_t *tokens, int64_t n,
                      const uint8_t *salt, size_t salt_len, int64_t *cached_out,
                      int64_t *need_out)
    int kvb_grp_append(kvb_mgr_t **g, int32_t G, int32_t slot, const int32_t *tokens,
                       int64_t n, int computed)
    int kvb_grp_append_batch(kvb_mgr_t **g, int32_t G, const int32_t *slots,
                             const int32_t *tokens, int64_t n)
    int kvb_grp_reserve(kvb_mgr_t **g, int32_t G, int32_t slot, int64_t n)
    int kvb_grp_truncate(kvb_mgr_t **g, int32_t G, int32_t slot, int64_t ntokens)
    int kvb_grp_fork(kvb_mgr_t **g, int32_t G, int32_t parent, int32_t *child_out)
    int kvb_grp_free(kvb_mgr_t **g, int32_t G, int32_t slot)
    int64_t kvb_grp_blocks_needed(kvb_mgr_t **g, int32_t G, int32_t slot, int64_t n)
    int kvb_grp_batch_need(kvb_mgr_t **g, int32_t G, const int32_t *slots, int64_t count,
                           int64_t n, int64_t *need_out)
    int kvb_grp_swap_out(kvb_mgr_t **g, int32_t G, int32_t slot, int64_t *pairs_out,
                         int64_t *npairs)
    int kvb_grp_swap_in(kvb_mgr_t **g, int32_t G, int32_t slot, int64_t *pairs_out,
                        int64_t *npairs)
    int kvb_grp_take_copies(kvb_mgr_t **g, int32_t G, int64_t *out, int64_t cap,
                            int64_t *n_out)
    int kvb_grp_schedule(kvb_mgr_t **g, int32_t G, const int32_t *slots,
                         const int32_t *qlens, const int32_t *drafts, int64_t B, int apply)
    void kvb_grp_schedule_one(kvb_mgr_t **g, int32_t j, const int32_t *slots,
                              const int32_t *qlens, const int32_t *drafts, int64_t B)
    int kvb_grp_check(kvb_mgr_t **g, int32_t G)
    int kvb_debug_corrupt(kvb_mgr_t *m, int32_t what, int32_t slot)
    int kvb_grp_step_need(kvb_mgr_t **g, int32_t G, const int32_t *slots, const int64_t *ns,
                          const int64_t *cn, const int64_t *forks, int64_t count,
                          int64_t *need_out)
    int kvb_mgr_host_tier(kvb_mgr_t *m, int write_through)
    void kvb_tier_flush(kvb_tier_t *t)
    void kvb_tier_absorb(kvb_tier_t *t)
    int kvb_tier_cache_insert(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes,
                              int64_t n, const kvb_hash_t *parent, const int32_t *tokens,
                              int32_t block_size, uint8_t group, int32_t tag, int64_t *stored)
    int64_t kvb_tier_unflushed(const kvb_tier_t *t)
    int64_t kvb_tier_take_offloads(kvb_tier_t *t, int64_t *out)
    int kvb_tier_take_onloads(kvb_tier_t *t, int64_t *out, int64_t *n)
    int kvb_mgr_reset_cache(kvb_mgr_t *m)

    ctypedef struct kvb_meta_t:
        int64_t *slot_mapping
        int32_t *block_tables
        int32_t *seq_lens
        int32_t *qo_indptr
        int32_t *kv_indptr
        int32_t *kv_indices
        int32_t *kv_last_page_len
        int64_t cap_tokens, cap_indices
        int32_t max_blocks
        int64_t *row_cache
        int64_t cap_rows, valid_rows
        int64_t n_tokens, n_indices

    ctypedef struct kvb_rows_t:
        int64_t *read_index
        int64_t *write_index
        int32_t *read_offsets
        int32_t *write_offsets
        int32_t *block_tables
        int64_t cap_read, cap_write
        int32_t max_blocks
        int64_t stride, offset
        int64_t n_read, n_write

    ctypedef struct kvb_step_size_t:
        int64_t tokens, blocks, max_blocks, context

    int kvb_step_check_for(kvb_mgr_t **g, int32_t G, int32_t j, const int32_t *slots,
                           const int32_t *qlens, const int32_t *drafts, int64_t B,
                           kvb_step_size_t *sizes)
    void kvb_step_release(kvb_mgr_t **g, int32_t G, const int32_t *slots,
                          const int32_t *qlens, int64_t B)
    void kvb_step_commit(kvb_mgr_t **g, int32_t G, const int32_t *slots,
                         const int32_t *qlens, const int32_t *drafts, int64_t B)
    int kvb_meta_fits(kvb_mgr_t *m, const kvb_step_size_t *z, const kvb_meta_t *out)
    void kvb_meta_write(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                        const int32_t *drafts, int64_t B, kvb_meta_t *out)
    int kvb_rows_fits(kvb_mgr_t *m, const kvb_step_size_t *z, const kvb_rows_t *out)
    void kvb_rows_write(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                        const int32_t *drafts, int64_t B, kvb_rows_t *out)


cdef class BlockPool:
    cdef kvb_pool_t p
    cdef object _groups
    cdef int64_t _in_group(self, cnp.ndarray ids, int64_t k, uint8_t g)
    cdef bytes _key
    cdef object _block_size
    cdef BlockPool _tier_pool  # a host pool: the device pool whose tier feeds it
    cdef void _sync(self) noexcept
    cdef int _key_error(self, int rc, str what, int32_t b) except -1
    cdef list _build_events(self, kvb_events_t *ev, const uint8_t *src=*, list media=*)
    cdef object _stored_event(self, kvb_hash_t h, kvb_hash_t parent, uint8_t g, int32_t tag,
                              bint has, int64_t ntok, str medium)
    cdef object _extra_keys(self, int32_t tag, bint first)
    cdef bytes _wire_bytes(self, ts, data_parallel_rank, fmt, hash_int)
    cdef int _wire_opts(self, kvb_wire_opts_t *w, kvb_wire_group_t *gt, list keep, ts,
                        data_parallel_rank, fmt, hash_int) except -1
    cdef bint _initialized
    cdef int32_t _algo
    cdef str _seed
    cdef bytes _none_hash
    cdef list _tag_ctx        # [tag] (lora_name, lora_id, salt) the events of a tag carry
    cdef dict _tags           # (lora_name, lora_id, salt) -> tag
    cdef list _wire_keep      # the bytes _wire_tags points into
    cdef kvb_wire_tag_t *_wire_tags  # [len(_tag_ctx)] the same, for the C writer
    cdef int32_t _wire_cap
    cdef int32_t _event_tag(self, object lora_name, object lora_id, object salt) except -1
    cdef str _medium
    cdef uint64_t *_full_ptr(self, object full, str what) except? NULL


cdef class BlockManager:
    cdef kvb_mgr_t **gp  # [ng] the KV cache groups (csrc/groups.c: kvb_grp_new)
    cdef int32_t ng
    cdef readonly tuple groups
    cdef list _gowners
    cdef readonly BlockPool pool
    cdef readonly BlockPool host_pool
    cdef double _watermark
    cdef int64_t _watermark_blocks
    cdef dict _slots
    cdef list _ids
    cdef cnp.ndarray _buf
    cdef cnp.ndarray _imap
    cdef int _busy
    cdef unsigned long _owner
    cdef kvb_step_size_t *_zs  # [ng] the sizes of the last checked step, per group
    cdef uint64_t _epoch  # bumped by every call that may change tables (StepPlan staleness)
    cdef int _enter(self, bint mutates=*) except -1
    cdef void _leave(self) noexcept
