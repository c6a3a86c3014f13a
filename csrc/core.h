/* core.h -- the C core's internal interface (plain C11, no Python headers): the data structures
 * and functions the Cython layer and libkvblocks' public API (include/kvblocks.h) are built on.
 * Not installed and not stable: C, C++ and Rust engines link against include/kvblocks.h.
 *
 * Three objects:
 *   kvb_pool_t  the physical block pool: structure-of-arrays metadata per block (ref count,
 *               free-list links, prefix-cache hash), an intrusive doubly linked free list,
 *               an open-addressing hash table from 128-bit block hash to block id, stats and
 *               an optional event log. Block 0 is the reserved null block.
 *   kvb_mgr_t   the sequence-level manager: one block table (and token ids) per sequence
 *               slot on top of a pool; fork, copy-on-write, truncate, batched decode step.
 *   hashing     keyed SipHash-2-4 with 128-bit output, chained per full block (default), or
 *               the block hashes of vLLM (sha256_cbor) or the SGLang router (sha256).
 *
 * Conventions: every function that can fail returns 0 or a negative KVB_E* code, validates
 * everything first and mutates only after validation succeeded (all-or-nothing). Nothing
 * prints or aborts in release builds; KVB_ASSERT is active only with -DKVB_DEBUG.
 */
#ifndef KVBLOCKS_CORE_H
#define KVBLOCKS_CORE_H

#include <stddef.h>
#include <stdint.h>

/* the public API: its declarations are checked against the definitions here (the handles
 * are these structs, the error codes, kvb_hash_t and the event kinds are defined there) */
#include "../include/kvblocks.h"

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define KVB_INLINE static inline __attribute__((always_inline))
#define KVB_NOINLINE __attribute__((noinline))
#define KVB_LIKELY(x) __builtin_expect(!!(x), 1)
#define KVB_UNLIKELY(x) __builtin_expect(!!(x), 0)
#else
#define KVB_INLINE static inline
#define KVB_NOINLINE
#define KVB_LIKELY(x) (x)
#define KVB_UNLIKELY(x) (x)
#endif

#ifdef KVB_DEBUG
#include <assert.h>
#define KVB_ASSERT(x) assert(x)
/* a call whose result was validated beforehand and cannot fail: checked in debug builds */
#define KVB_MUST(call) do { int kvb_rc_ = (call); assert(kvb_rc_ == 0); (void)kvb_rc_; } while (0)
#else
#define KVB_ASSERT(x) ((void)0)
#define KVB_MUST(call) ((void)(call))
#endif
/* KVB_DEBUG=2 (KVBLOCKS_DEBUG=2): the expensive level, the full invariant check after every
 * call into the manager (see kvb_debug_level and the Cython call guard). */
#ifndef KVB_DEBUG
#define KVB_DEBUG_LEVEL 0
#else
#define KVB_DEBUG_LEVEL KVB_DEBUG
#endif

/* ---- error codes: KVB_OK and the KVB_E* codes, in include/kvblocks.h -------------------- */

/* Error detail: every public function that returns an error sets err_a / err_b (meaning per
 * code above) and err_what (a static name of the failed check, or NULL); they are cleared on
 * entry, so a stale detail never leaks into a later error. */
#define KVB_CLEAR_ERR(o) ((o)->err_a = 0, (o)->err_b = 0, (o)->err_what = NULL)

#define KVB_NONE (-1) /* "no block" in free-list links and hash-table slots */

/* ---- hashing (hash.c) ------------------------------------------------------------------- */
/* kvb_hash_t (128 bits: lo, hi) is defined in include/kvblocks.h */

/* SipHash-2-4 with 128-bit output (Aumasson & Bernstein, 2012) of len bytes under key. */
void kvb_siphash128(const uint8_t key[16], const void *data, size_t len, kvb_hash_t *out);

/* Chain seed of a sequence: the hash every block 0 chains on. salt (tenant, LoRA adapter...)
 * is folded in here, so different salts never share a block. salt_len 0 = no salt. */
void kvb_hash_root(const uint8_t key[16], const uint8_t *salt, size_t salt_len, kvb_hash_t *out);

/* h[i] = SipHash128_key(h[i-1] || tokens of block i), h[-1] = *parent. Writes n_blocks hashes. */
void kvb_hash_chain(const uint8_t key[16], const kvb_hash_t *parent, const int32_t *tokens,
                    int64_t n_blocks, int32_t block_size, kvb_hash_t *out);

/* Hash modes. SipHash is kvblocks' own keyed hash (the default); the others reproduce another
 * engine's block hashes byte for byte, for routers that index blocks by those hashes. */
enum {
    KVB_HASH_SIPHASH = 0,          /* keyed SipHash-2-4-128 (above) */
    KVB_HASH_VLLM_SHA256_CBOR = 1, /* vLLM >= 0.31: sha256(cbor((parent, tokens, extra keys))),
                                    * tagged extra keys (("cache_salt", salt),) on block 0 */
    KVB_HASH_VLLM_SHA256_CBOR_V030 = 2, /* the same with vLLM 0.11.1-0.30's untagged extra
                                    * keys: (lora_name, salt) on block 0, (lora_name,) after */
    KVB_HASH_SGLANG_SHA256 = 3,    /* SGLang router: sha256(parent digest || tokens as LE u32) */
};
#define KVB_HASH_NMODES 4

/* A block's full digest. h: the 128 bits kvblocks keys a block on (prefix cache, events);
 * x: the rest of a 256-bit digest, needed only to continue a chain (0 for SipHash). The byte
 * split is chosen per mode so that h.lo is the 64-bit value the mode's routers carry on the
 * wire: vLLM digest bytes 24..31 big-endian (h = bytes 16..31), SGLang bytes 0..7 (h = bytes
 * 0..15, lo first). */
typedef struct { kvb_hash_t h, x; } kvb_digest_t;

typedef struct {               /* how one chain hashes: mode, key, start, extra keys */
    int32_t algo;              /* KVB_HASH_* */
    int32_t has_start;         /* 0: block 0 chains on nothing (SGLang without salt) */
    kvb_digest_t start;        /* block 0's parent: SipHash root, vLLM NONE_HASH, SGLang salt */
    const uint8_t *key;        /* [16] SipHash key */
    const uint8_t *extra0;     /* vLLM: CBOR of block 0's extra keys (f6: None) */
    const uint8_t *extra;      /* vLLM: CBOR of every later block's extra keys */
    int32_t extra0_len, extra_len; /* their bytes */
} kvb_hasher_t;

/* A hasher from a chain context ctx (the `salt` argument of kvb_grp_add and kvb_grp_probe):
 *   SipHash  any bytes, folded into the root (kvb_hash_root);
 *   vLLM     empty (no extra keys) or what kvb_vllm_context wrote; none_hash: NONE_HASH;
 *   SGLang   empty (the router's own chain) or any bytes, hashed into a start digest.
 * The hasher points into key, none_hash and ctx. KVB_EINVAL for an unknown mode or a
 * malformed vLLM context. */
int kvb_hasher_init(kvb_hasher_t *hs, int32_t algo, const uint8_t key[16],
                    const uint8_t none_hash[32], const uint8_t *ctx, size_t ctx_len);
/* n full blocks of block_size tokens, the first being block `first` of its chain; parent is
 * the digest of block first - 1, NULL at a chain's start (then first must be 0). Writes n
 * hashes to out_h and, when out_x is not NULL, their digests' other halves to out_x. */
void kvb_hash_blocks(const kvb_hasher_t *hs, const kvb_digest_t *parent, int64_t first,
                     const int32_t *tokens, int64_t n, int32_t block_size, kvb_hash_t *out_h,
                     kvb_hash_t *out_x);
/* Bytes of a mode's digest (16 for SipHash, else 32) and the conversions to and from them. */
int kvb_digest_size(int32_t algo);
void kvb_digest_to_bytes(int32_t algo, const kvb_digest_t *d, uint8_t *out);
void kvb_digest_from_bytes(int32_t algo, const uint8_t *in, kvb_digest_t *d);
/* vLLM's NONE_HASH: sha256 of the CBOR text string seed (UTF-8, seed_len bytes). */
void kvb_vllm_none_hash(const uint8_t *seed, size_t seed_len, uint8_t out[32]);
/* The chain context of a vLLM mode for a cache salt and a LoRA adapter name (UTF-8; NULL:
 * none; an empty salt is no salt, as in vLLM): CBOR of block 0's extra keys and of the later
 * blocks'. Writes at most cap bytes to out (may be NULL) and returns the bytes needed, or
 * KVB_EINVAL (mode not vLLM, or a LoRA name in the tagged mode, whose key holds the adapter's
 * path). */
int64_t kvb_vllm_context(int32_t algo, const uint8_t *salt, size_t salt_len,
                         const uint8_t *lora, size_t lora_len, uint8_t *out, size_t cap);

/* SHA-256 (sha256.c), streaming. */
typedef struct {
    uint32_t state[8];         /* chaining value */
    uint64_t nbytes;           /* message bytes so far */
    uint8_t buf[64];           /* partial block */
    uint32_t fill;             /* bytes in buf, < 64 */
} kvb_sha256_t;
void kvb_sha256_init(kvb_sha256_t *s);
void kvb_sha256_update(kvb_sha256_t *s, const void *data, size_t len);
void kvb_sha256_final(kvb_sha256_t *s, uint8_t out[32]);
void kvb_sha256(const void *data, size_t len, uint8_t out[32]);

/* ---- stats and events (pool.c) ---------------------------------------------------------- */
typedef struct {
    uint64_t queries;          /* prefix-cache lookups (calls) */
    uint64_t query_blocks;     /* blocks asked for in lookups */
    uint64_t hit_blocks;       /* blocks found in lookups */
    uint64_t query_tokens;     /* tokens asked for (manager level, first admissions) */
    uint64_t hit_tokens;       /* tokens served from cache (manager level, first admissions) */
    uint64_t recompute_query_tokens; /* the same for re-admissions of preempted sequences */
    uint64_t recompute_hit_tokens;   /* (their own blocks coming back is not reuse) */
    uint64_t evictions;        /* cached blocks whose entry was dropped on reuse */
    uint64_t allocations;      /* blocks handed out */
    uint64_t frees;            /* blocks whose ref count reached zero */
    uint64_t stored;           /* blocks registered in the prefix cache */
} kvb_stats_t;

/* event kinds KVB_EV_STORED, KVB_EV_REMOVED, KVB_EV_CLEARED: include/kvblocks.h */

typedef struct {               /* struct-of-arrays event log, grown on demand */
    int64_t n, cap;            /* events recorded, capacity */
    uint8_t *kind;             /* [cap] KVB_EV_* */
    kvb_hash_t *hash;          /* [cap] block hash (STORED, REMOVED) */
    kvb_hash_t *parent;        /* [cap] parent hash (STORED); 0: a chain's first block */
    int32_t *block;            /* [cap] block id */
    uint8_t *group;            /* [cap] KV cache group of the block (pool->gid) */
    int64_t *tok_off;          /* [cap] offset of the block's tokens in tokens[], -1 if none */
    int64_t ntok, tok_cap;     /* token ids recorded, capacity */
    int32_t *tokens;           /* [tok_cap] token ids of stored blocks */
    int32_t *tag;              /* [cap] adapter tag of a stored block (0: none) */
    uint64_t *stamp;           /* [cap] recording order across pools (one process-wide clock;
                                * a tiered pool's events only, else 0): kvb_events_merge */
    int32_t cur_tag;           /* tag recorded with the next stored blocks (set by table.c) */
    int64_t max_pending;       /* events kept undrained at most; later ones are dropped */
    uint64_t dropped;          /* events dropped since creation (log full or out of memory) */
} kvb_events_t;

/* ---- pool (pool.c, cache.c) ------------------------------------------------------------- */
#define KVB_F_CACHED 1u        /* block holds a prefix-cache entry (hash is valid) */
#define KVB_F_FREE 2u          /* block is linked in the free list (ref count 0) */
#define KVB_F_MARK 4u          /* scratch bit of one validation pass, clear between calls */
#define KVB_F_COPY_DST 8u      /* destination of a pending copy-on-write pair (table.c) */
#define KVB_F_COPY_SRC 16u     /* source of a pending copy-on-write pair: held until drained */
#define KVB_F_WRITTEN 32u      /* every slot's K/V is written (a full block a step computed, or
                                * one registered through BlockPool.cache); cleared when the
                                * block is handed out again or rewritten. Cached => written. */
#define KVB_F_INFLIGHT 64u     /* device block whose content arrives with a pair of the coming
                                * drain (swap-in or onload destination): never an offload source
                                * before that drain starts (tier.c) */
#define KVB_F_SWAP_SRC 128u    /* device block a swap-out pair of the coming drain reads: never
                                * an onload destination before that drain starts (tier.c) */

struct kvb_tier;               /* the host tier of a device pool (tier.c) */

typedef struct kvb_pool {
    int32_t num_blocks;        /* total, including the null block 0 */
    int32_t num_free;          /* blocks in the free list (never-cached free + evictable) */
    int32_t num_cached;        /* blocks with KVB_F_CACHED (referenced or evictable) */
    int32_t num_evictable;     /* cached blocks in the free list (ref count 0) */
    int32_t free_head;         /* next block allocate() pops; KVB_NONE if empty */
    int32_t free_tail;         /* last block of the free list; KVB_NONE if empty */
    int32_t *ref_count;        /* [num_blocks] references held; 0 <=> in the free list */
    int32_t *prev;             /* [num_blocks] free-list link toward head, KVB_NONE at head */
    int32_t *next;             /* [num_blocks] free-list link toward tail, KVB_NONE at tail */
    kvb_hash_t *hash;          /* [num_blocks + xcap] entry keys: block b's hash, valid iff
                                * flags & KVB_F_CACHED; then the secondary records' keys */
    uint8_t *flags;            /* [num_blocks] KVB_F_* bits */
    uint8_t *gid;              /* [num_blocks] KV cache group a cached block belongs to */
    int32_t *table;            /* [table_mask+1] open addressing slots: entry id (a block's
                                * primary, or num_blocks + a secondary record) or KVB_NONE */
    uint64_t table_mask;       /* table size - 1; size is a power of two >= 2 * num_blocks and
                                * >= 2 * (num_blocks - 1 + nx): at most half full */
    int caching;               /* prefix caching enabled */
    int record_events;         /* append to events when nonzero */
    kvb_stats_t stats;         /* counters since creation */
    kvb_events_t events;       /* pending events (drained by the caller) */
    int64_t err_a, err_b;      /* detail of the last error: need/have, or index/value */
    const char *err_what;      /* name of the failed invariant (check) or NULL */
    struct kvb_tier *tier;     /* host tier fed by this pool's log, or NULL (owned by the
                                * manager that attached it; read by tier.c and the layers
                                * above only: pool.c and cache.c never name it) */
    struct kvb_plog *log;      /* the record of entries leaving and entering the cache, drained
                                * by its reader (the host tier), or NULL: none kept (owned) */
    int32_t (*victim)(struct kvb_pool *p); /* eviction policy: the block allocation takes when
                                * the free list's head is cached (policy.c), or NULL: the head,
                                * LRU by release */
    void *policy;              /* the policy's state, or NULL (owned: freed with the pool) */
    uint8_t *chance;           /* [num_blocks] the policy's per-stay bit, or NULL: cleared by
                                * the pool whenever a block leaves the free list (owned) */
    uint64_t stamp_hold;       /* nonzero: the stamp this tiered pool's next records take (the
                                * reader of another pool's log records its follow-up events
                                * right after the record that caused them), else a fresh one */
    int tiered;                /* 1: one of a host tier's two pools (set by kvb_mgr_host_tier):
                                * a reset records a BlockRemoved per entry (the events carry
                                * the pool's medium), never the medium-less AllBlocksCleared */
    kvb_hash_t *gtag;          /* [256] each group's tag in a 256-bit hash mode with groups
                                * (kvb_grp_link), or NULL: a cached block's key is the engine's
                                * hash XOR its group's tag, and its events carry the engine's
                                * hash and the group (vLLM keys a block by (hash, group id)) */
    int32_t *dnext;            /* [num_blocks + xcap] duplicate entries (cache.c): the next entry
                                * under the same key, in insertion order, KVB_NONE at a chain's
                                * end; the table holds each chain's first entry. NULL until the
                                * first insertion with dup_insert or secondary key (owned) */
    int dup_insert;            /* per call, set and cleared by the caller: 1 makes
                                * kvb_cache_insert append a block whose key another block holds
                                * to that key's chain (vLLM's duplicates), 0 leaves it uncached */
    /* Secondary keys (cache.c, kvb_cache_add_key: vLLM's partial-prefix hashes of a block that
     * already has its primary). Entry ids: e < num_blocks is block e's primary, e = num_blocks
     * + r is record r. The table and dnext[] hold entry ids; hash[e] is entry e's key. All NULL
     * and 0 until the first secondary is added (owned). */
    int32_t nx;                /* live records (secondary entries) */
    int32_t xcap;              /* records allocated; hash[] and dnext[] hold num_blocks + xcap */
    int32_t xfree;             /* first free record (linked by xnext), KVB_NONE: none */
    int32_t *xhead;            /* [num_blocks] block's first secondary record, KVB_NONE: none;
                                * only a cached block has any */
    int32_t *xblock;           /* [xcap] owner block of a live record, KVB_NONE when free */
    int32_t *xnext;            /* [xcap] next record of the same owner (insertion order), or
                                * the next free record; KVB_NONE at the end */
    uint64_t *xcheck;          /* [4 * xcap] a record's full 32-byte key (lookup_bytes' check),
                                * zeros when none was given */
} kvb_pool_t;
/* The hash a cached block's events carry: its key, untagged in a 256-bit mode with groups. */
void kvb_pool_event_hash(const kvb_pool_t *p, int32_t b, kvb_hash_t *out);

int kvb_pool_init(kvb_pool_t *p, int32_t num_blocks, int caching); /* num_blocks >= 2 */
/* kvb_pool_init that also accepts a pool of the null block alone (num_blocks == 1: vLLM's
 * num_gpu_blocks == 1): nothing to allocate, free or cache, every allocation of n > 0 fails. */
int kvb_pool_init_any(kvb_pool_t *p, int32_t num_blocks, int caching);
void kvb_pool_destroy(kvb_pool_t *p);
size_t kvb_pool_bytes(const kvb_pool_t *p);  /* metadata bytes held */

/* Allocate n blocks into out (all-or-nothing). Never-cached free blocks come first (they sit
 * at the head of the free list), then the least recently released cached ones, whose entry is
 * evicted. */
int kvb_pool_allocate(kvb_pool_t *p, int32_t n, int32_t *out);
/* Drop one reference of each id; validated first (range, not null, enough references even
 * when an id repeats). A block reaching 0 joins the free list: cached blocks at the tail
 * (evicted last, LRU), never-cached ones at the head (reused first). */
int kvb_pool_free(kvb_pool_t *p, const int32_t *ids, int64_t n);
/* Add one reference to each id (validated first: range, not null, not free unless cached).
 * An evictable cached block leaves the free list (is pinned). */
int kvb_pool_incref(kvb_pool_t *p, const int32_t *ids, int64_t n);
int kvb_pool_check(kvb_pool_t *p);
/* vLLM's touch: kvb_pool_incref that also takes free never-cached blocks off the free list
 * (validated first: range, not null, no overflow). */
int kvb_pool_touch(kvb_pool_t *p, const int32_t *ids, int64_t n);
/* kvb_pool_free placing every block that reaches 0 at the head (KVB_PLACE_HEAD, ids[0]
 * first: vLLM's evict_first) or at the tail (KVB_PLACE_TAIL, in order), cached or not. */
/* KVB_PLACE_VLLM: vLLM's free_blocks(ordered), each block by its entry: those reaching 0
 * without one go to the head as a batch (ids[0] ends first), cached ones to the tail in the
 * order they reach 0. */
enum { KVB_PLACE_HEAD = 1, KVB_PLACE_TAIL = 2, KVB_PLACE_VLLM = 3 };
int kvb_pool_free_placed(kvb_pool_t *p, const int32_t *ids, int64_t n, int where);
/* vLLM's evict_blocks: drop the listed blocks' cache entries; free ones keep their place in
 * the free list. Returns the entries dropped or a negative code (range, null block). */
int64_t kvb_pool_uncache_ids(kvb_pool_t *p, const int32_t *ids, int64_t n);
/* kvb_pool_reset_cache without moving the dropped blocks to the head: the free list keeps
 * its order (vLLM's reset_prefix_cache). */
int kvb_pool_reset_cache_keep_order(kvb_pool_t *p);
/* vLLM's reset_prefix_cache() -> bool: 1 and every entry dropped (kvb_pool_reset_cache, or
 * its keep_order variant) when no block but the null block is referenced; else 0, nothing
 * changed (vLLM's rule: any block in use, cached or not, refuses). Never an error. */
int kvb_pool_try_reset_cache(kvb_pool_t *p, int keep_order);
/* vLLM's move_block_hashes: src's cache entries (primary, then its secondary keys in order)
 * move to dst under the same keys and group (dst takes each key's last place among its
 * duplicates; src keeps its place in the free list
 * or table, without an entry), recording no event. Validated first: both in range and not
 * null, src cached, dst referenced and uncached, src != dst (KVB_ERANGE / KVB_ESTATE /
 * KVB_EINVAL, nothing changed). */
int kvb_pool_move_entry(kvb_pool_t *p, int32_t src, int32_t dst);

/* Prefix cache (cache.c). */
int32_t kvb_cache_find(const kvb_pool_t *p, const kvb_hash_t *h);         /* id or KVB_NONE */
/* Register referenced full blocks under their hashes. A hash already present keeps its first
 * block (the later block stays uncached, or with p->dup_insert joins the end of the key's
 * chain: a duplicate entry, KVB_ENOMEM if the chain links cannot be made); a block already
 * cached under another hash is an error. Returns 0 or error; *stored (may be NULL) gets how
 * many entries were added. */
int kvb_cache_insert(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes, int64_t n,
                     const kvb_hash_t *parent, const int32_t *tokens, int32_t block_size,
                     int64_t *stored);
/* Whether entry e (a block's primary or num_blocks + a record) is among the entries under
 * its key (the key's chain, cache.c). */
int kvb_cache_holds(const kvb_pool_t *p, int32_t e);
/* The first entry under h (a block id, or num_blocks + a secondary record), or KVB_NONE. */
int32_t kvb_cache_find_entry(const kvb_pool_t *p, const kvb_hash_t *h);
/* vLLM's _insert_block_hash onto a block that has its primary: b (in range, not null, cached:
 * else KVB_ERANGE / KVB_ESTATE) takes h as a secondary key, at the end of h's duplicates.
 * Returns 1, or 0 when h is already one of b's keys (nothing changed). check4 (4 words, may be
 * NULL: zeros) is kept with the key (the full 32-byte hash, xcheck). Records a BlockStored
 * (no parent, no tokens) when events are recorded; each secondary leaves with its block's
 * primary (a BlockRemoved after the primary's). KVB_ESTATE on a host tier's pool (p->log or
 * p->tiered), KVB_ENOMEM when growing fails; nothing changed on error. */
int kvb_cache_add_key(kvb_pool_t *p, int32_t b, const kvb_hash_t *h, const uint64_t *check4);
/* Longest cached prefix of hashes: returns its length; ids written to out (may be NULL). */
int64_t kvb_cache_lookup(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n, int32_t *out);
/* Same, and add one reference to each hit in the same step (pool.c). */
int64_t kvb_pool_lookup_pin(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n, int32_t *out);
/* Drop every entry; only when no cached block is referenced (else KVB_ESTATE) (pool.c). Its
 * event: AllBlocksCleared, or one BlockRemoved per entry on a tiered pool (p->tiered). */
int kvb_pool_reset_cache(kvb_pool_t *p);

/* the event log (events.c): grow, drain, free */
int kvb_events_reserve(kvb_events_t *ev, int64_t n_events, int64_t n_tokens);
void kvb_events_clear(kvb_events_t *ev);
void kvb_events_destroy(kvb_events_t *ev);
/* Move the recorded events out (ev is left empty, its settings kept), so that a reader can
 * run Python code while events go on being recorded; reattach gives the arrays back (emptied)
 * when nothing was recorded meanwhile, else frees them. */
void kvb_events_detach(kvb_events_t *ev, kvb_events_t *out);
void kvb_events_reattach(kvb_events_t *ev, kvb_events_t *snap);
/* The records of two detached logs (a host tier's two pools) as one log in the order they
 * were recorded (by stamp; a's first on ties): out (zeroed by the caller, freed with
 * kvb_events_destroy) gets them, src[i] (n_a + n_b bytes) 0 or 1 for the log record i came
 * from. KVB_ENOMEM leaves out empty. */
int kvb_events_merge(const kvb_events_t *a, const kvb_events_t *b, kvb_events_t *out,
                     uint8_t *src);

/* ---- the log on the wire (wire.c) ------------------------------------------------------- */
enum { KVB_WIRE_MAP = 0, KVB_WIRE_ARRAY = 1 };

typedef struct {               /* what the stored blocks of one event tag carry */
    const uint8_t *lora_name;  /* UTF-8 adapter name, NULL: none (lora_name nil) */
    int32_t lora_name_len;     /* its bytes */
    int32_t has_lora_id;       /* lora_id is an int (else nil) */
    int64_t lora_id;           /* vLLM's adapter int id */
    const uint8_t *salt;       /* cache salt, an extra key of a chain's first block; NULL: none */
    int32_t salt_len;          /* its bytes */
    int32_t salt_bin;          /* 1: msgpack bin (a bytes salt), 0: str */
} kvb_wire_tag_t;

typedef struct {               /* what the events of one KV cache group carry */
    const uint8_t *kind;       /* kv_cache_spec_kind (UTF-8), NULL: none (omitted in map form) */
    int32_t kind_len;          /* its bytes */
    int32_t has_window;        /* kv_cache_spec_sliding_window is an int (else omitted / nil) */
    int64_t window;            /* tokens */
} kvb_wire_group_t;

typedef struct kvb_wire_opts { /* one batch's settings */
    int32_t fmt;               /* KVB_WIRE_MAP (vLLM >= 0.24) or KVB_WIRE_ARRAY (0.22/0.23) */
    int32_t hash_signed;       /* hashes as int64 (else uint64, vLLM's) */
    double ts;                 /* seconds, the batch's float64 */
    int32_t has_dp;            /* data_parallel_rank is an int (else nil) */
    int64_t dp;                /* the rank */
    const uint8_t *medium;     /* medium of every event (UTF-8), NULL: nil */
    int32_t medium_len;        /* its bytes */
    const kvb_wire_tag_t *tags; /* [ntags] by event tag (tag 0: no adapter, no salt) */
    int32_t ntags;
    const kvb_wire_group_t *groups; /* [ngroups] by group index */
    int32_t ngroups;
    const uint8_t *src;        /* [ev->n] a merged log's source of each record (kvb_events_merge):
                                * 1 takes medium, tags and groups from `alt`; NULL: all 0 */
    const struct kvb_wire_opts *alt; /* settings of records of source 1 (fmt, hash_signed, ts
                                * and the rank are this struct's) */
} kvb_wire_opts_t;

typedef struct { uint8_t *data; size_t len, cap; } kvb_buf_t; /* bytes written, capacity */

/* Write ev as vLLM's msgpack KVEventBatch into out (grown as needed; the caller frees it with
 * kvb_buf_free), grouped as take_events groups it. The log is only read. KVB_EINVAL when a
 * stored event has no tokens or a tag / group outside the tables (*bad: its index), else
 * KVB_ENOMEM or 0. */
int kvb_events_encode(const kvb_events_t *ev, const kvb_wire_opts_t *w, kvb_buf_t *out,
                      int64_t *bad);
void kvb_buf_free(kvb_buf_t *b);

/* ---- manager (manager.c over table.c's group tables) ----------------------------------- */
/* The manager's structs are private to csrc/ (internal.h): callers hold pointers. A manager
 * is G groups g[0..G) (kvb_mgr_t) over one pool; g[0], the lead, holds the sequences' records
 * (kvb_seq_t), every group its rows (kvb_row_t). */
typedef struct kvb_mgr kvb_mgr_t;
typedef struct kvb_seq kvb_seq_t;
typedef struct kvb_row kvb_row_t;

/* KV cache group kinds, each with its rules in table.c (hit span, blocks, release). */
enum {
    KVB_G_FULL = 0,    /* every position attends to all earlier ones */
    KVB_G_WINDOW = 1,  /* position p attends to [p - span + 1, p] (sliding window) */
    KVB_G_CHUNK = 2,   /* position p attends to [p - p % span, p] (chunked local) */
    KVB_G_STATE = 3,   /* span blocks per sequence whatever its length (recurrent state) */
};

int kvb_mgr_init(kvb_mgr_t *m, kvb_pool_t *pool, kvb_pool_t *host, int32_t block_size,
                 const uint8_t key[16]);
/* The hash mode (chain.c); only while no sequence is live. KVB_EINVAL: unknown mode. */
int kvb_mgr_set_hash(kvb_mgr_t *m, int32_t algo, const uint8_t none_hash[32]);
/* Make m a group of the given kind (after kvb_mgr_init, before any sequence): span is the
 * window, chunk or state blocks (> 0; ignored for FULL). */
int kvb_mgr_set_kind(kvb_mgr_t *m, int32_t kind, int64_t span, uint8_t gidx);
void kvb_mgr_destroy(kvb_mgr_t *m);

/* The tag of group gidx under key: group gidx's block hash is the chain hash XOR the tag (0
 * for group 0). */
void kvb_group_tag(const uint8_t key[16], uint8_t gidx, kvb_hash_t *out);
/* Link the groups (after kvb_mgr_set_kind and kvb_mgr_set_hash): the lead, each group's tag,
 * and the pool's eviction rule for the groups (a window or chunk block whose full-attention
 * twin is cached gets a second chance). */
int kvb_grp_link(kvb_mgr_t *const *g, int32_t G); /* KVB_ENOMEM */
/* Every group's hash mode (kvb_mgr_set_hash), then kvb_grp_link. */
int kvb_grp_set_hash(kvb_mgr_t *const *g, int32_t G, int32_t algo, const uint8_t none_hash[32]);

/* A manager's groups on the heap (groups.c): *out gets g[0..G), each group initialised over
 * pool and host (kvb_mgr_init), to be given kinds and the hash mode next; nothing is left
 * allocated on an error. kvb_grp_delete frees them (g may be NULL). */
int kvb_grp_new(kvb_mgr_t ***out, int32_t G, kvb_pool_t *pool, kvb_pool_t *host,
                int32_t block_size, const uint8_t key[16]);
void kvb_grp_delete(kvb_mgr_t **g, int32_t G);

/* What the Python binding reads of a manager (query.c), so that it names no struct field: a
 * group's error detail (returns err_what, a and b get err_a and err_b), counts, a live slot's
 * generation and swap state, and a row (group j's table), the tokens or the hashes (group j's
 * keys in the SipHash mode, the engine's hashes in the 256-bit ones; none in a group that
 * does not cache) copied into out (skipped when NULL); kvb_grp_read returns the entries. */
enum { KVB_READ_TABLE = 0, KVB_READ_TOKENS = 1, KVB_READ_HASHES = 2 };
const char *kvb_mgr_err(const kvb_mgr_t *m, int64_t *a, int64_t *b);
int32_t kvb_grp_nseqs(kvb_mgr_t *const *g);
int32_t kvb_grp_block_size(kvb_mgr_t *const *g);
int32_t kvb_grp_hash_algo(kvb_mgr_t *const *g);
int32_t kvb_grp_kind(kvb_mgr_t *const *g, int32_t j);
int kvb_grp_swapped(kvb_mgr_t *const *g, int32_t slot);
int64_t kvb_grp_num_tokens(kvb_mgr_t *const *g, int32_t slot);
/* the generations of n live slots; the first i whose slot's generation is not gens[i] (the
 * sequence was freed), or -1 */
void kvb_grp_gens(kvb_mgr_t *const *g, const int32_t *slots, int64_t n, uint32_t *out);
int64_t kvb_grp_stale(kvb_mgr_t *const *g, const int32_t *slots, const uint32_t *gens,
                      int64_t n);
int64_t kvb_grp_read(kvb_mgr_t *const *g, int32_t j, int32_t slot, int32_t what, void *out);
/* the host tier of the groups' pool or NULL; its pending pairs (0 without one), whether it
 * writes through, its counters */
struct kvb_tier *kvb_grp_tier(kvb_mgr_t *const *g);
void kvb_tier_pending(const struct kvb_tier *t, int64_t *noff, int64_t *non);
int kvb_tier_write_through(const struct kvb_tier *t);

/* The calls of a manager of groups g[0..G) (manager.c). Every call validates and counts the
 * blocks of all groups before anything changes, so a failed call changes nothing (window
 * release aside: it drops only blocks no query can read); errors are reported in g[0]'s err
 * fields.
 * add: a prompt of n tokens in a new slot (*slot_out): its longest prefix every group can
 * serve from the cache (at most (n - 1) / block_size blocks) is pinned, the rest allocated;
 * *cached_out gets the cached tokens, which count as computed. recompute != 0 marks the
 * re-admission of a preempted sequence (its hits count in the recompute_* stats). `tag` is
 * the adapter tag the KV events of the sequence's stored blocks carry (0: none).
 * probe: what add would find now, without pinning or stats: cached tokens and the blocks it
 * would take from the free pool (evictable hits included).
 * append: computed != 0: the tokens fill draft slots that the last step scheduled.
 * append_batch: the decode step, one token for each of n distinct live, resident slots.
 * blocks_needed: blocks appending n tokens to slot would take now (growth + copy-on-write;
 * swapped out: what swap_in takes plus that growth); saturates, never wraps.
 * batch_need: the same for n tokens to each of count slots at once (shared write blocks: one
 * copy per sharer but the last). */
int kvb_grp_add(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                const uint8_t *salt, size_t salt_len, int recompute, int32_t tag,
                int32_t *slot_out, int64_t *cached_out);
int kvb_grp_probe(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                  const uint8_t *salt, size_t salt_len, int64_t *cached_out, int64_t *need_out);
int kvb_grp_append(kvb_mgr_t *const *g, int32_t G, int32_t slot, const int32_t *tokens,
                   int64_t n, int computed);
int kvb_grp_append_batch(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                         const int32_t *tokens, int64_t n);
int kvb_grp_reserve(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t n);
int kvb_grp_truncate(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t ntokens);
int kvb_grp_fork(kvb_mgr_t *const *g, int32_t G, int32_t parent, int32_t *child_out);
int kvb_grp_free(kvb_mgr_t *const *g, int32_t G, int32_t slot);
int64_t kvb_grp_blocks_needed(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t n);
int kvb_grp_batch_need(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, int64_t count,
                       int64_t n, int64_t *need_out);
/* Swap a sequence's blocks (every group's) to the host pool and back; it keeps its tokens.
 * swap_out writes one (device, host) pair per held block, group after group (a pending
 * copy's destination is read from its source); swap_in re-shares computed full blocks still
 * cached on the device and writes (host, device) pairs for the others. */
int kvb_grp_swap_out(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t *pairs_out,
                     int64_t *npairs);
int kvb_grp_swap_in(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t *pairs_out,
                    int64_t *npairs);
/* A step computes, for each slots[i], its last qlens[i] committed tokens and drafts[i]
 * (drafts may be NULL) reserved draft slots after them. Validation only when apply == 0:
 * live, not swapped, no sequence twice, 0 <= qlens[i] <= ntokens, no uncomputed gap before
 * the query, draft slots reserved and private, no pending copies. apply != 0 (after a
 * successful check) releases what the queries cannot read (window, chunk), marks every
 * committed token computed and caches the blocks that became fully computed. */
int kvb_grp_schedule(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                     const int32_t *qlens, const int32_t *drafts, int64_t B, int apply);
/* The step applied in group g[j] alone (a v1 metadata / row_indices call of one group, after
 * its check): that group's release and computed tokens; the record's computed count is the
 * fewest of all groups. */
void kvb_grp_schedule_one(kvb_mgr_t *const *g, int32_t j, const int32_t *slots,
                          const int32_t *qlens, const int32_t *drafts, int64_t B);
int kvb_grp_check(kvb_mgr_t *const *g, int32_t G);
/* Queries over all groups of a live slot (not checked): table entries of an n-token sequence,
 * blocks held (released entries excluded), computed tokens; pending copy-on-write pairs. */
int64_t kvb_grp_table_blocks(kvb_mgr_t *const *g, int32_t G, int64_t n);
int64_t kvb_grp_held(kvb_mgr_t *const *g, int32_t G, int32_t slot);
int64_t kvb_grp_num_computed(kvb_mgr_t *const *g, int32_t G, int32_t slot);
int64_t kvb_grp_num_copies(kvb_mgr_t *const *g, int32_t G);
/* Group j's row of a live slot (not checked; capi.c's block tables). */
const kvb_row_t *kvb_grp_row(kvb_mgr_t *const *g, int32_t j, int32_t slot);
/* Every group's pending copies into out ([2 * cap] int64 (src, dst) pairs; *n_out pairs), in
 * group order, after the drain-order check: KVB_EPENDING while host-tier offloads or onloads are
 * pending (g[0]'s err_a: offloads, err_b: onloads, err_what says so; a copy may overwrite a
 * block an offload reads, or read one an onload fills), KVB_ERANGE when cap is too small
 * (err_a: needed). Nothing is drained on an error. */
int kvb_grp_take_copies(kvb_mgr_t *const *g, int32_t G, int64_t *out, int64_t cap,
                        int64_t *n_out);
/* Blocks a scheduler's step takes: ns[i] more slots for each sequence and forks[i] children
 * of it (forks may be NULL) taking cn[i] slots each, exactly; *need_out saturates at
 * INT64_MAX. */
int kvb_grp_step_need(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, const int64_t *ns,
                      const int64_t *cn, const int64_t *forks, int64_t count,
                      int64_t *need_out);
/* Testing only (debug.c): break one invariant of kind KVB_DBG_* in group g[j] (slot: a live
 * sequence for the per-sequence kinds) so that a test can see kvb_grp_check name it. Corrupts
 * only in KVB_DEBUG builds; release builds return KVB_ESTATE. KVB_ESTATE also when the group
 * holds nothing of that kind to corrupt; KVB_EINVAL for an unknown kind. */
enum {
    KVB_DBG_CACHE_SLOT = 1,   /* a cached block's table slot off its probe path */
    KVB_DBG_TABLE_ENTRY = 2,  /* a held uncached block in the hash table */
    KVB_DBG_UNWRITTEN = 3,    /* a cached block's written flag cleared */
    KVB_DBG_FREE_LINK = 4,    /* the free list's second prev link */
    KVB_DBG_REF_COUNT = 5,    /* one reference too many on a held block */
    KVB_DBG_SEQ_HASH = 6,     /* a bit of a sequence's first block hash */
    KVB_DBG_COMPUTED = 7,     /* computed tokens past the committed ones */
    KVB_DBG_TABLE_BLOCK = 8,  /* a table entry out of the pool's range */
    KVB_DBG_STATE_ROOM = 9,   /* a state group's room below its tokens' blocks */
};
int kvb_debug_corrupt(kvb_mgr_t *m, int32_t what, int32_t slot);

/* Attention metadata (meta.c). For sequences slots[0..B), the last qlens[i] committed tokens
 * are computed this step. Output arrays are caller-provided with the capacities given. */
typedef struct {
    int64_t *slot_mapping;     /* [cap_tokens] slot of each query token; -1 pads */
    int32_t *block_tables;     /* [B * max_blocks] padded with the null block */
    int32_t *seq_lens;         /* [B] tokens in context after this step */
    int32_t *qo_indptr;        /* [B + 1] query offsets */
    int32_t *kv_indptr;        /* [B + 1] FlashInfer CSR offsets into kv_indices */
    int32_t *kv_indices;       /* [cap_indices] FlashInfer page ids, or NULL: not built */
    int32_t *kv_last_page_len; /* [B] tokens in each sequence's last page, 1..block_size */
    int64_t cap_tokens;        /* capacity of slot_mapping */
    int64_t cap_indices;       /* capacity of kv_indices */
    int32_t max_blocks;        /* row width of block_tables */
    int64_t *row_cache;        /* optional [4 * cap_rows]: per row, what the last call wrote
                                * (slot, gen << 32 | tver, blocks, kv offset), so rows whose
                                * table only grew rewrite just their new entries */
    int64_t cap_rows;          /* rows the row cache holds */
    int64_t valid_rows;        /* in/out: leading rows of the row cache that are valid */
    int64_t n_tokens;          /* out: query tokens written */
    int64_t n_indices;         /* out: kv_indices written */
} kvb_meta_t; /* written by kvb_meta_write for a step kvb_step_check checked (step.c) */

/* Per-token row indices of a step (rows.c), for a cache laid out as rows: token p of a sequence
 * is row blocks[p / block_size] * stride + offset + p % block_size. Same step model as the
 * metadata (written by kvb_rows_write for a checked step); NULL read_index / write_index /
 * block_tables are skipped. */
typedef struct {
    int64_t *read_index;       /* [cap_read] rows of every context token, sequence by sequence */
    int64_t *write_index;      /* [cap_write] rows of every query token */
    int32_t *read_offsets;     /* [B + 1] CSR offsets into read_index */
    int32_t *write_offsets;    /* [B + 1] CSR offsets into write_index */
    int32_t *block_tables;     /* [B * max_blocks] (block * stride + offset) / block_size,
                                * padded with the null block's entry; or NULL */
    int64_t cap_read;          /* capacity of read_index */
    int64_t cap_write;         /* capacity of write_index */
    int32_t max_blocks;        /* row width of block_tables */
    int64_t stride;            /* rows from one block's first row to the next's, >= block_size */
    int64_t offset;            /* rows added to every index, >= 0 */
    int64_t n_read;            /* out: read rows written */
    int64_t n_write;           /* out: write rows written */
} kvb_rows_t;

/* ---- a step planned once (step.c) ------------------------------------------------------- *
 * A forward step over sequences slots[0..B): each computes its last qlens[i] committed tokens
 * and drafts[i] reserved draft slots (drafts may be NULL). kvb_step_check validates the step
 * for every group of g[0..G) (the checks of kvb_grp_schedule) and writes each group's sizes;
 * nothing changes, and a failure's detail is in g[0]'s fields. kvb_step_release applies what
 * the step frees (window and chunk groups), kvb_step_commit declares it (computed counts,
 * newly full blocks into the prefix cache). In between, metadata and rows are written from
 * the checked step by kvb_meta_write / kvb_rows_write, after kvb_meta_fits / kvb_rows_fits
 * said the caller's buffers hold it: the batch is validated once, sized once. */
typedef struct {
    int64_t tokens;            /* query slots: sum of qlens[i] + drafts[i] (slot_mapping) */
    int64_t blocks;            /* table entries of every context (kv_indices) */
    int64_t max_blocks;        /* the longest context's table (block_tables columns) */
    int64_t context;           /* context positions: sum of ntokens + drafts[i] (read rows) */
} kvb_step_size_t;

int kvb_step_check(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, const int32_t *qlens,
                   const int32_t *drafts, int64_t B, kvb_step_size_t *sizes /* [G] */);
void kvb_step_release(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                      const int32_t *qlens, int64_t B);
void kvb_step_commit(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                     const int32_t *qlens, const int32_t *drafts, int64_t B);
/* KVB_ERANGE (err_a: needed, err_b: held, err_what: the buffer) when out cannot hold a step
 * of size z; KVB_OK otherwise. Nothing is written. */
int kvb_meta_fits(kvb_mgr_t *m, const kvb_step_size_t *z, const kvb_meta_t *out);
void kvb_meta_write(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                    const int32_t *drafts, int64_t B, kvb_meta_t *out);
/* the geometry and capacity checks of rows (KVB_EINVAL: geometry, KVB_ERANGE: a buffer) */
int kvb_rows_fits(kvb_mgr_t *m, const kvb_step_size_t *z, const kvb_rows_t *out);
void kvb_rows_write(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                    const int32_t *drafts, int64_t B, kvb_rows_t *out);
/* kvb_step_check as the binding calls it (step.c): all groups (j < 0) or group j alone, with
 * every group's pending copies refusing it, the detail in g[0]'s fields. */
int kvb_step_check_for(kvb_mgr_t *const *g, int32_t G, int32_t j, const int32_t *slots,
                       const int32_t *qlens, const int32_t *drafts, int64_t B,
                       kvb_step_size_t *sizes /* [G] */);
/* ---- host tier (tier.c) ------------------------------------------------------------------ *
 * The host pool as a second prefix-cache tier below the device pool. Evicting a cached device
 * block demotes it: a host block (LRU among evictable host entries) takes its hash and a
 * (device, host) offload is queued. add() continues a device prefix on the host: fresh device
 * blocks and (host, device) onloads. Pending pairs hold their host blocks (and an onload its
 * device block) until drained. Drain order: take_offloads, take_onloads, swap pairs, copies. */
typedef struct {
    uint64_t hit_blocks;       /* blocks add() served from the host (onloads queued) */
    uint64_t hit_tokens;       /* their tokens, first admissions */
    uint64_t recompute_hit_tokens; /* their tokens, re-admissions of preempted sequences */
    uint64_t demotions;        /* evicted device entries kept on the host (copied or present) */
    uint64_t offloads;         /* (device, host) copies queued: demotions and write-through */
    uint64_t onloads;          /* (host, device) copies queued */
    uint64_t dropped;          /* evicted device entries lost: no host block free, content in
                                * flight, or no memory for the queue */
} kvb_tier_stats_t;

typedef struct {               /* an evicted entry in the pool's log (kvb_plog_t), on its way
                                * to the host (tier.c) */
    kvb_hash_t hash;           /* its hash (the device block is reused at once) */
    kvb_hash_t parent;         /* its parent hash, for the host's events (0: none) */
    int32_t block;             /* the device block, the offload's source */
    int32_t has_tokens;        /* its tokens were kept (the log's evtok), for the host's events */
    uint8_t gid;               /* its KV cache group (the host entry's, for events) */
} kvb_demotion_t;

typedef struct {               /* the device blocks carrying one drain-scoped flag (tier.c) */
    int32_t *ids;              /* [pool->num_blocks] each flagged block once */
    int64_t n;                 /* entries used */
} kvb_marks_t;

typedef struct kvb_tier {
    kvb_pool_t *pool;          /* device pool (not owned); pool->tier points back here */
    kvb_pool_t *host;          /* host pool, caching on (not owned) */
    int write_through;         /* copy each newly cached device block to the host at once */
    int64_t *off;              /* [2 * offcap] pending (device, host) offloads; each holds one
                                * reference on its host block */
    int64_t noff, offcap;      /* pairs pending, capacity (int64 pairs) */
    int64_t nwt;               /* of them, write-through copies queued since the drain started:
                                * the step's own blocks, run by the next drain (schedule and
                                * metadata do not wait for them) */
    int64_t *on;               /* [2 * oncap] pending (host, device) onloads; each holds one
                                * reference on both blocks */
    int64_t non, oncap;        /* pairs pending, capacity (int64 pairs) */
    kvb_marks_t inflight;      /* device blocks flagged KVB_F_INFLIGHT */
    kvb_marks_t swapsrc;       /* device blocks flagged KVB_F_SWAP_SRC */
    int64_t *srcafter;         /* [pool->num_blocks] per swapsrc entry: the onloads pending when
                                * it was marked (those run before its swap pair reads the block
                                * they fill, the order a swap_out of an onloaded block needs) */
    kvb_marks_t swapdst;       /* device blocks a swap-in pair of the coming drain writes
                                * (flagged KVB_F_INFLIGHT; no flag of their own): check() proves
                                * none of them is a pending onload's destination */
    int32_t *deferred;         /* [host->num_blocks] host blocks released by swapped sequences
                                * (swap_in, free): held until the next drain starts, so no
                                * offload of this drain writes a block a swap pair reads */
    int64_t ndeferred;         /* entries used */
    int32_t block_size;        /* tokens per block */
    int32_t *scratch;          /* [scap] host hits of one add */
    int64_t scap;              /* capacity */
    int64_t *ord;              /* [ordcap] flush scratch: the demotions' parent-first order,
                                * each one's host block, the walk's stack and a hash index */
    int64_t ordcap;            /* capacity (int64s) */
    kvb_tier_stats_t stats;    /* counters since creation */
} kvb_tier_t;

const kvb_tier_stats_t *kvb_tier_stats(const kvb_tier_t *t); /* query.c */
/* Attach a host tier to m (its host pool must cache); freed by kvb_mgr_destroy. */
int kvb_mgr_host_tier(kvb_mgr_t *m, int write_through);
/* Drain the pool's log: the evictions since the last flush get their host blocks (offloads
 * queued) after the insertions are written through: take_offloads, host lookups and the host
 * counters call it first. */
void kvb_tier_flush(kvb_tier_t *t);
/* Drain the pool's insertion records (write-through): the layer that cached blocks in a
 * tiered pool calls it once that call returned, before anything else touches the host. */
void kvb_tier_absorb(kvb_tier_t *t);
/* kvb_cache_insert for the layers above the tier (BlockPool.cache): the new blocks' group and
 * the events' adapter tag, then kvb_tier_absorb. */
int kvb_tier_cache_insert(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes,
                          int64_t n, const kvb_hash_t *parent, const int32_t *tokens,
                          int32_t block_size, uint8_t group, int32_t tag, int64_t *stored);
/* Pairs and evictions that hold a step back (schedule): pending offloads other than this
 * step's write-through copies, onloads, and evictions not yet flushed. */
int64_t kvb_tier_busy(const kvb_tier_t *t);
/* Records of the pool's log not drained yet (evictions and insertions): 0 right after a flush. */
int64_t kvb_tier_unflushed(const kvb_tier_t *t);
/* Drain the pending offloads (2 * n int64 into out; flush first, n = noff); releases their
 * host holds and starts the drain (in-flight flags and deferred host blocks are settled).
 * Returns n. */
int64_t kvb_tier_take_offloads(kvb_tier_t *t, int64_t *out);
/* Drain the pending onloads; KVB_EPENDING while offloads are pending (err_a: how many).
 * *n gets the pairs written. */
int kvb_tier_take_onloads(kvb_tier_t *t, int64_t *out, int64_t *n);
/* Drop every prefix-cache entry of m's pool and, with a host tier, of the host pool (tier.c).
 * All or nothing: KVB_EPENDING while offloads or onloads are pending (err_a, err_b: how many;
 * evictions since the last flush are flushed first), KVB_ESTATE while a cached device block
 * is referenced (err_a: how many, err_b: cached). */
int kvb_mgr_reset_cache(kvb_mgr_t *m);
/* Verify m's tier (holds, flags, counts; none flagged without one); refs / hrefs (device, host)
 * get the references its pairs and deferred blocks hold. Detail in m->err_*. */
int kvb_tier_check(kvb_mgr_t *const *g, int32_t G, int32_t *refs, int32_t *hrefs);

#ifdef __cplusplus
}
#endif
#endif /* KVBLOCKS_CORE_H */
