/* kvblocks.h -- libkvblocks, the public C API of kvblocks' block manager (C11; valid C++17).
 *
 * The same C core the Python package runs, as a library for engines written in C, C++ or Rust:
 * a pool of fixed-size KV-cache blocks (ref counts, a prefix cache keyed by block hashes, KV
 * events) and a manager of sequences on top of it (block tables, prefix reuse, copy-on-write
 * forks, swapping to a host pool, draft slots, attention metadata written into caller buffers).
 *
 * Conventions (docs/c-api.md):
 *   - Every function that can fail returns KVB_OK (0) or a negative KVB_E* code and changes
 *     nothing when it fails (all-or-nothing). kvb_strerror names a code; the handle's last
 *     error (kvb_pool_last_error / kvb_manager_last_error) gives its detail.
 *   - Handles are opaque and heap-allocated by kvb_*_new, freed by kvb_*_delete.
 *   - Sizes are checked: a negative size is KVB_EINVAL; buffers must hold what their size
 *     says (kvb_pool_allocate, _free, _incref take them unchecked, as the core does). Output buffers come with their capacity; too small is KVB_ERANGE with the
 *     capacity needed in the detail's `a`, and nothing is consumed.
 *   - Threads: no global mutable state (one atomic event clock aside). A handle (and the pool a
 *     manager owns) is used by one thread at a time: calls on one handle from two threads at
 *     once must be serialised by the caller; distinct handles need no locking.
 *   - Stability: within ABI version 1 (SONAME libkvblocks.so.1, symbol version KVBLOCKS_1)
 *     functions are only added, never changed or removed; structs passed by pointer that may
 *     grow carry their size in their first field.
 */
#ifndef KVBLOCKS_H
#define KVBLOCKS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KVBLOCKS_VERSION_MAJOR 0
#define KVBLOCKS_VERSION_MINOR 1
#define KVBLOCKS_VERSION_PATCH 0
#define KVBLOCKS_ABI_VERSION 1 /* the SONAME's number: libkvblocks.so.1 */

#if defined(KVBLOCKS_BUILD) && defined(__GNUC__)
#define KVB_API __attribute__((visibility("default")))
#else
#define KVB_API
#endif

/* ---- error codes ------------------------------------------------------------------------ *
 * The detail of the last error (a, b, what) per code, as kvb_*_last_error reports it. */
enum {
    KVB_OK = 0,
    KVB_ENOMEM = -1,        /* malloc failed */
    KVB_EOUTOFBLOCKS = -2,  /* not enough allocatable blocks; a / b: blocks needed / free */
    KVB_EINVAL = -3,        /* bad argument value (a: offending index, b: value) */
    KVB_ERANGE = -4,        /* block id out of range or the null block (a: index, b: id); an
                             * output buffer too small (a: capacity needed, b: given) */
    KVB_ESTATE = -5,        /* operation not allowed now (freeing a free block, ...) */
    KVB_ECORRUPT = -6,      /* an invariant does not hold (check functions only; what: which) */
    KVB_EUNKNOWN = -7,      /* sequence slot not live */
    KVB_EDUP = -8,          /* a block or sequence given twice where that is not allowed */
    KVB_ESWAPPED = -9,      /* the sequence is swapped out (a: index, b: slot) */
    KVB_EPENDING = -10,     /* copies are pending: drain them first (a: how many) */
    KVB_EGAP = -11,         /* a step would leave committed tokens uncomputed (a: index,
                             * b: tokens missing before the query) */
};

#define KVB_NULL_BLOCK 0 /* block 0 of every pool: reserved, never allocated (padding) */

/* A 128-bit block hash (the prefix cache's key; events carry it). */
typedef struct kvb_hash { uint64_t lo, hi; } kvb_hash_t;

/* Handles. */
typedef struct kvb_pool kvb_pool_t;       /* a block pool */
typedef struct kvb_manager kvb_manager_t; /* sequences (one block table per KV cache group) */

/* ---- library ------------------------------------------------------------------------------ */
/* The library's version (any pointer may be NULL); returns its ABI version (KVBLOCKS_ABI_VERSION
 * of the build), which an engine compares with the header's to detect a mismatched library. */
KVB_API int kvb_version(int *major, int *minor, int *patch);
KVB_API const char *kvb_version_string(void);
/* A static English name of an error code ("out of blocks", ...); never NULL. */
KVB_API const char *kvb_strerror(int code);

/* ---- pool --------------------------------------------------------------------------------- */
typedef struct {               /* counters since creation */
    uint64_t queries;          /* prefix-cache lookups (calls) */
    uint64_t query_blocks;     /* blocks asked for in lookups */
    uint64_t hit_blocks;       /* blocks found in lookups */
    uint64_t query_tokens;     /* tokens asked for (manager adds, first admissions) */
    uint64_t hit_tokens;       /* tokens served from the cache (first admissions) */
    uint64_t recompute_query_tokens; /* the same for re-admissions of preempted sequences */
    uint64_t recompute_hit_tokens;
    uint64_t evictions;        /* cached blocks whose entry was dropped on reuse */
    uint64_t allocations;      /* blocks handed out */
    uint64_t frees;            /* blocks whose ref count reached zero */
    uint64_t stored;           /* blocks registered in the prefix cache */
} kvb_cache_stats_t;

typedef struct {               /* the pool's counts now */
    int32_t num_blocks;        /* total, including the null block 0 */
    int32_t num_free;          /* allocatable: never-cached free blocks and evictable ones */
    int32_t num_cached;        /* blocks holding a prefix-cache entry */
    int32_t num_evictable;     /* cached blocks nobody references (in the free list) */
} kvb_pool_counts_t;

enum { KVB_EV_STORED = 1, KVB_EV_REMOVED = 2, KVB_EV_CLEARED = 3 };

typedef struct {               /* one KV event */
    int32_t kind;              /* KVB_EV_*: block stored, removed, or all blocks cleared */
    int32_t block;             /* block id (STORED, REMOVED) */
    kvb_hash_t hash;           /* block hash (STORED, REMOVED) */
    kvb_hash_t parent;         /* parent block's hash (STORED; 0: a chain's first block) */
    int32_t group;             /* KV cache group of the block */
    int32_t tag;               /* adapter tag of a stored block (0: none) */
    int64_t tok_off;           /* STORED: offset of its tokens in the token buffer, -1: none */
    int64_t ntok;              /* STORED: its token ids there (block_size, or 0) */
} kvb_event_t;

/* A standalone pool of num_blocks blocks (>= 2; block 0 is the null block). caching: keep a
 * prefix cache; events: record KV events. */
KVB_API int kvb_pool_new(int32_t num_blocks, int caching, int events, kvb_pool_t **out);
KVB_API void kvb_pool_delete(kvb_pool_t *p); /* NULL: nothing */

/* Allocate n blocks into out (all-or-nothing; evicts least recently released cached blocks). */
KVB_API int kvb_pool_allocate(kvb_pool_t *p, int32_t n, int32_t *out);
/* Drop one reference of each id (an id may repeat). */
KVB_API int kvb_pool_free(kvb_pool_t *p, const int32_t *ids, int64_t n);
/* Add one reference to each id; an evictable cached block is pinned again. */
KVB_API int kvb_pool_incref(kvb_pool_t *p, const int32_t *ids, int64_t n);
/* Longest cached prefix of hashes[0..n): its length (>= 0) or a negative code; the hits' ids go
 * to out ([n]) and each is pinned (one reference added) in the same call. */
KVB_API int64_t kvb_pool_lookup_and_pin(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n,
                                        int32_t *out);
/* The same without pinning or stats; out may be NULL. */
KVB_API int64_t kvb_pool_lookup(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n,
                                int32_t *out);
/* Register referenced full blocks ids[i] under hashes[i] (a hash already cached keeps its
 * first block); parent: the hash block 0 chains on (NULL: none); tokens: [n * block_size]
 * their token ids for the events (NULL: none). *stored (may be NULL): entries added. */
KVB_API int kvb_pool_cache(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes,
                           int64_t n, const kvb_hash_t *parent, const int32_t *tokens,
                           int32_t block_size, int64_t *stored);
/* Drop every prefix-cache entry (KVB_ESTATE while a cached block is referenced). */
KVB_API int kvb_pool_reset_cache(kvb_pool_t *p);
KVB_API int kvb_pool_counts(const kvb_pool_t *p, kvb_pool_counts_t *out);
KVB_API int kvb_pool_stats(const kvb_pool_t *p, kvb_cache_stats_t *out);
/* References held on block id (>= 0), or KVB_ERANGE. */
KVB_API int32_t kvb_pool_ref_count(const kvb_pool_t *p, int32_t id);
/* Drain the recorded events, all of them or none. Needs cap >= pending events and
 * tok_cap >= their token ids (KVB_ERANGE otherwise, a: events, b: token ids needed; the
 * log is left as it was); *n_events / *n_tokens get what was written. Events recorded beyond
 * the log's bound are dropped, counted by kvb_pool_events_dropped. */
KVB_API int kvb_pool_take_events(kvb_pool_t *p, kvb_event_t *out, int64_t cap, int32_t *tokens,
                                 int64_t tok_cap, int64_t *n_events, int64_t *n_tokens);
/* Events and token ids pending (any pointer may be NULL). */
KVB_API int kvb_pool_pending_events(kvb_pool_t *p, int64_t *n_events, int64_t *n_tokens);
KVB_API uint64_t kvb_pool_events_dropped(const kvb_pool_t *p);
/* The pending events as one vLLM msgpack KVEventBatch (ts: its timestamp, seconds; fmt 0: map
 * form, vLLM >= 0.24; 1: array form), drained: *data (free it with kvb_free) gets *len bytes. */
KVB_API int kvb_pool_take_events_wire(kvb_pool_t *p, double ts, int fmt, uint8_t **data,
                                      size_t *len);
KVB_API void kvb_free(void *data);
/* Verify every invariant of the pool (KVB_ECORRUPT with what naming it). */
KVB_API int kvb_pool_check(kvb_pool_t *p);
/* Detail of the pool's last error; a / b may be NULL; returns `what` (a static name, or NULL). */
KVB_API const char *kvb_pool_last_error(const kvb_pool_t *p, int64_t *a, int64_t *b);

/* ---- manager ------------------------------------------------------------------------------ */
enum { KVB_GROUP_FULL = 0, KVB_GROUP_WINDOW = 1, KVB_GROUP_CHUNK = 2, KVB_GROUP_STATE = 3 };
enum { KVB_HASH_MODE_SIPHASH = 0, KVB_HASH_MODE_VLLM_SHA256_CBOR = 1,
       KVB_HASH_MODE_VLLM_SHA256_CBOR_V030 = 2, KVB_HASH_MODE_SGLANG_SHA256 = 3 };

typedef struct {
    int32_t kind;              /* KVB_GROUP_* */
    int64_t span;              /* window / chunk tokens, state blocks; 0 for FULL */
} kvb_group_spec_t;

typedef struct {
    size_t size;               /* sizeof(kvb_manager_config_t): set by kvb_manager_config_init */
    int32_t num_blocks;        /* device blocks, >= 2 (block 0 is the null block) */
    int32_t block_size;        /* tokens per block, >= 1 */
    int32_t num_host_blocks;   /* host pool for swapping: 0 (none) or >= 2 */
    int32_t prefix_caching;    /* 1 (default): cache full computed blocks by hash */
    int32_t kv_events;         /* record KV events in the pools */
    int32_t host_prefix_cache; /* the host pool is a second prefix-cache tier (any groups) */
    int32_t host_write_through; /* with it: copy newly cached blocks to the host at once */
    int32_t hash_mode;         /* KVB_HASH_MODE_* (default SipHash) */
    int32_t has_hash_key;      /* 1: hash_key is the SipHash key; 0: the built-in default key */
    uint8_t hash_key[16];
    const uint8_t *hash_seed;  /* vLLM modes: NONE_HASH's seed (UTF-8; NULL: "") */
    size_t hash_seed_len;
    int32_t num_groups;        /* KV cache groups (>= 1); groups NULL: one FULL group */
    const kvb_group_spec_t *groups; /* [num_groups], copied */
} kvb_manager_config_t;

/* Defaults: one full-attention group, prefix caching on, no host pool, no events. */
KVB_API void kvb_manager_config_init(kvb_manager_config_t *c);
KVB_API int kvb_manager_new(const kvb_manager_config_t *c, kvb_manager_t **out);
KVB_API void kvb_manager_delete(kvb_manager_t *m); /* NULL: nothing */
/* The manager's device and host pools (host: NULL without one), owned by the manager: for
 * counts, stats, events and check; allocate / free on them only what the manager does not own.
 * With a host tier, the host pool's counts and events include the latest demotions once
 * kvb_manager_pending_offloads or kvb_manager_take_offloads has run (they place them). */
KVB_API kvb_pool_t *kvb_manager_pool(kvb_manager_t *m);
KVB_API kvb_pool_t *kvb_manager_host_pool(kvb_manager_t *m);
KVB_API int32_t kvb_manager_block_size(const kvb_manager_t *m);
KVB_API int32_t kvb_manager_num_groups(const kvb_manager_t *m);
KVB_API int32_t kvb_manager_num_seqs(const kvb_manager_t *m);

/* Sequences are named by slots (int32 >= 0), reused after kvb_manager_free. */

/* Add a prompt of n tokens as a new sequence (*seq_out): its longest cached prefix (full blocks,
 * at most (n - 1) / block_size) is pinned, the rest allocated; *cached_out (may be NULL) gets
 * the cached tokens, which count as computed. salt (tenant, adapter; may be NULL) keys the
 * hash chain apart. recompute != 0: re-admission of a preempted sequence (stats only). */
KVB_API int kvb_manager_add(kvb_manager_t *m, const int32_t *tokens, int64_t n,
                            const uint8_t *salt, size_t salt_len, int recompute,
                            int32_t *seq_out, int64_t *cached_out);
/* What add would find now, without pinning or stats: cached tokens and blocks it would take. */
KVB_API int kvb_manager_probe(kvb_manager_t *m, const int32_t *tokens, int64_t n,
                              const uint8_t *salt, size_t salt_len, int64_t *cached_out,
                              int64_t *need_out);
/* Commit n tokens to seq (growing its table). computed != 0: they fill draft slots the last
 * step computed (speculative decoding: the accepted drafts plus the bonus token). */
KVB_API int kvb_manager_append(kvb_manager_t *m, int32_t seq, const int32_t *tokens, int64_t n,
                               int computed);
/* The decode step: one token for each of n distinct live, resident sequences. */
KVB_API int kvb_manager_append_batch(kvb_manager_t *m, const int32_t *seqs,
                                     const int32_t *tokens, int64_t n);
/* Reserve n slots after the committed tokens (draft tokens of the next step). */
KVB_API int kvb_manager_reserve(kvb_manager_t *m, int32_t seq, int64_t n);
/* Keep the first ntokens committed tokens (rejected drafts, rollback). */
KVB_API int kvb_manager_truncate(kvb_manager_t *m, int32_t seq, int64_t ntokens);
/* A child sharing every block of parent (copy-on-write of the shared last block on write). */
KVB_API int kvb_manager_fork(kvb_manager_t *m, int32_t parent, int32_t *child_out);
KVB_API int kvb_manager_free(kvb_manager_t *m, int32_t seq);
/* Blocks appending n tokens to seq would take now (swapped out: what swap_in takes too). */
KVB_API int kvb_manager_blocks_needed(kvb_manager_t *m, int32_t seq, int64_t n,
                                      int64_t *need_out);
/* Blocks appending n tokens to each of count sequences at once would take. */
KVB_API int kvb_manager_batch_need(kvb_manager_t *m, const int32_t *seqs, int64_t count,
                                   int64_t n, int64_t *need_out);
/* Move seq's blocks to the host pool: (device, host) block pairs to copy, int64 [2 * npairs]
 * into pairs (cap pairs). Run them before the copies of the same drain. */
KVB_API int kvb_manager_swap_out(kvb_manager_t *m, int32_t seq, int64_t *pairs, int64_t cap,
                                 int64_t *npairs);
/* Bring seq back: (host, device) pairs; blocks still cached on the device are shared again. */
KVB_API int kvb_manager_swap_in(kvb_manager_t *m, int32_t seq, int64_t *pairs, int64_t cap,
                                int64_t *npairs);
/* Pairs a swap of seq writes at most (size the buffer with it). */
KVB_API int64_t kvb_manager_swap_pairs_max(const kvb_manager_t *m, int32_t seq);
KVB_API int kvb_manager_is_swapped(const kvb_manager_t *m, int32_t seq); /* 1, 0 or < 0 */
/* Committed tokens, and computed tokens (the fewest any KV cache group holds computed, as
 * BlockManager.num_computed), of seq; < 0: error code. */
KVB_API int64_t kvb_manager_num_tokens(const kvb_manager_t *m, int32_t seq);
KVB_API int64_t kvb_manager_num_computed(const kvb_manager_t *m, int32_t seq);
/* seq's block table in group into out (cap entries); *n gets its length. Released entries
 * (window groups) read as the null block. */
KVB_API int kvb_manager_block_table(const kvb_manager_t *m, int32_t group, int32_t seq,
                                    int32_t *out, int64_t cap, int64_t *n);

/* The step: for each seqs[i] the forward computes its last qlens[i] committed tokens and
 * drafts[i] (drafts may be NULL) reserved draft slots after them. kvb_manager_schedule
 * declares it (validated first: live, resident, distinct, no gap, drafts reserved, no
 * pending copies); afterwards every committed token counts as computed and full blocks that
 * became computed enter the prefix cache. */
KVB_API int kvb_manager_schedule(kvb_manager_t *m, const int32_t *seqs, const int32_t *qlens,
                                 const int32_t *drafts, int64_t B);

typedef struct {               /* attention metadata written into caller buffers */
    size_t size;               /* sizeof(kvb_metadata_t) */
    int64_t *slot_mapping;     /* [cap_tokens] slot (block * block_size + offset) per query
                                * token, -1 pads */
    int32_t *block_tables;     /* [B * max_blocks] padded with the null block, or NULL */
    int32_t *seq_lens;         /* [B] tokens in context after the step */
    int32_t *qo_indptr;        /* [B + 1] query offsets */
    int32_t *kv_indptr;        /* [B + 1] FlashInfer CSR offsets into kv_indices */
    int32_t *kv_indices;       /* [cap_indices] FlashInfer page ids */
    int32_t *kv_last_page_len; /* [B] tokens in each sequence's last page */
    int64_t cap_tokens;        /* capacity of slot_mapping */
    int64_t cap_indices;       /* capacity of kv_indices */
    int32_t max_blocks;        /* row width of block_tables */
    int64_t n_tokens;          /* out: query tokens written */
    int64_t n_indices;         /* out: kv_indices written */
} kvb_metadata_t;

/* Metadata of group's tables for the step (as kvb_manager_schedule describes it), written into
 * out's buffers, and the step declared for that group (build every group's each step, or
 * call kvb_manager_schedule once). */
KVB_API int kvb_manager_metadata(kvb_manager_t *m, int32_t group, const int32_t *seqs,
                                 const int32_t *qlens, const int32_t *drafts, int64_t B,
                                 kvb_metadata_t *out);

typedef struct {               /* per-token row indices of a step, for a cache laid out as rows:
                                * token p of a sequence is row
                                * blocks[p / block_size] * stride + offset + p % block_size */
    size_t size;               /* sizeof(kvb_step_rows_t) */
    int64_t *read_index;       /* [cap_read] rows of every context token, or NULL */
    int64_t *write_index;      /* [cap_write] rows of every query token, or NULL */
    int32_t *read_offsets;     /* [B + 1] CSR offsets into read_index */
    int32_t *write_offsets;    /* [B + 1] CSR offsets into write_index */
    int32_t *block_tables;     /* [B * max_blocks] (block * stride + offset) / block_size,
                                * or NULL */
    int64_t cap_read;          /* capacity of read_index */
    int64_t cap_write;         /* capacity of write_index */
    int32_t max_blocks;        /* row width of block_tables */
    int64_t stride;            /* rows from one block's first row to the next's, >= block_size */
    int64_t offset;            /* rows added to every index, >= 0 */
    int64_t n_read;            /* out: read rows written */
    int64_t n_write;           /* out: write rows written */
} kvb_step_rows_t;

/* The step's row indices (a flat cache: transformers' continuous batching) for group, written
 * into out's buffers; declares the step for that group as kvb_manager_metadata does. */
KVB_API int kvb_manager_rows(kvb_manager_t *m, int32_t group, const int32_t *seqs,
                             const int32_t *qlens, const int32_t *drafts, int64_t B,
                             kvb_step_rows_t *out);

/* ---- a step planned once ----------------------------------------------------------------
 * kvb_manager_plan_step checks a step (the checks of kvb_manager_schedule) for every group at
 * once, sizes each group's buffers, applies what window and chunk groups release and, with
 * commit != 0, declares the step. The plan's writers (kvb_plan_metadata, kvb_plan_rows) then
 * write any group's arguments without checking the batch again, as often as asked; with
 * commit == 0, kvb_plan_commit declares the step once the forward wrote its K/V. A plan is
 * stale once its manager changed (any call that may change tables: add, append, free, another
 * plan, ...): its writers and commit fail with KVB_ESTATE. A plan belongs to its manager:
 * delete it first. Errors are reported in the manager's last-error detail. */
typedef struct kvb_plan kvb_plan_t;
typedef struct {               /* a group's share of a planned step: buffer sizes */
    int64_t tokens;            /* query slots: slot_mapping / write_index entries */
    int64_t blocks;            /* table entries of every context: kv_indices entries */
    int64_t max_blocks;        /* the longest table: block_tables columns */
    int64_t context;           /* context positions: read_index entries */
} kvb_plan_size_t;

KVB_API int kvb_manager_plan_step(kvb_manager_t *m, const int32_t *seqs, const int32_t *qlens,
                                  const int32_t *drafts, int64_t B, int commit,
                                  kvb_plan_t **out);
KVB_API int kvb_plan_size(const kvb_plan_t *p, int32_t group, kvb_plan_size_t *out);
KVB_API int kvb_plan_metadata(kvb_plan_t *p, int32_t group, kvb_metadata_t *out);
KVB_API int kvb_plan_rows(kvb_plan_t *p, int32_t group, kvb_step_rows_t *out);
KVB_API int kvb_plan_commit(kvb_plan_t *p);
KVB_API int kvb_plan_stale(const kvb_plan_t *p);     /* 1 stale, 0 usable */
KVB_API void kvb_plan_delete(kvb_plan_t *p);

/* The block hashes this manager gives the full blocks of tokens[0..n) under salt (as add
 * would: its key, hash mode and block size; group 0): n / block_size hashes into out (cap);
 * *n_out gets how many. What its KV events carry, for an engine or router keyed by them. */
KVB_API int kvb_manager_block_hashes(const kvb_manager_t *m, const int32_t *tokens, int64_t n,
                                     const uint8_t *salt, size_t salt_len, kvb_hash_t *out,
                                     int64_t cap, int64_t *n_out);

typedef struct {               /* the host tier's counters since creation */
    uint64_t hit_blocks;       /* blocks add() served from the host (onloads queued) */
    uint64_t hit_tokens;       /* their tokens, first admissions */
    uint64_t recompute_hit_tokens; /* their tokens, re-admissions of preempted sequences */
    uint64_t demotions;        /* evicted device entries kept on the host */
    uint64_t offloads;         /* (device, host) copies queued */
    uint64_t onloads;          /* (host, device) copies queued */
    uint64_t dropped;          /* evicted device entries lost (no host block free, ...) */
} kvb_host_stats_t;

/* The host tier's counters (zeros without a tier). */
KVB_API int kvb_manager_host_stats(kvb_manager_t *m, kvb_host_stats_t *out);

/* Copy lists, drained in this order each step: offloads, onloads (host tier), swap pairs (as
 * swap_out / swap_in returned them), copies; then the forward pass. Each writes int64 pairs
 * [2 * n] into out (cap pairs) and *n the pairs; KVB_ERANGE if cap is short. */
KVB_API int64_t kvb_manager_pending_copies(kvb_manager_t *m);
KVB_API int kvb_manager_take_copies(kvb_manager_t *m, int64_t *out, int64_t cap, int64_t *n);
KVB_API int64_t kvb_manager_pending_offloads(kvb_manager_t *m);
KVB_API int kvb_manager_take_offloads(kvb_manager_t *m, int64_t *out, int64_t cap,
                                      int64_t *n);
KVB_API int64_t kvb_manager_pending_onloads(kvb_manager_t *m);
KVB_API int kvb_manager_take_onloads(kvb_manager_t *m, int64_t *out, int64_t cap, int64_t *n);
/* Drop every prefix-cache entry (device and host tier). */
KVB_API int kvb_manager_reset_cache(kvb_manager_t *m);
/* Verify every invariant of the manager, its groups and pools (KVB_ECORRUPT, what says which). */
KVB_API int kvb_manager_check(kvb_manager_t *m);
KVB_API const char *kvb_manager_last_error(const kvb_manager_t *m, int64_t *a, int64_t *b);

#ifdef __cplusplus
}
#endif
#endif /* KVBLOCKS_H */
