/* internal.h -- helpers shared between the core's C files; not part of the public API. */
#ifndef KVBLOCKS_INTERNAL_H
#define KVBLOCKS_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core.h"

/* ---- the manager's structs (manager.c, table.c): private to csrc/ ---------------------- */
typedef struct {               /* per-sequence hash chain state beside hashes[] (chain.c) */
    kvb_digest_t start;        /* block 0's parent (start.h == root) */
    int32_t has_start;         /* 0: block 0 chains on nothing (SGLang without salt) */
    int32_t tag;               /* adapter tag the events of its stored blocks carry (0: none) */
    kvb_hash_t *ext;           /* [ecap] digests' other halves of hashes[] (256-bit modes) */
    int64_t ecap;              /* capacity of ext */
    uint8_t *ctx;              /* [ctx_cap] the chain context given at add (vLLM extra keys) */
    int64_t ctx_len, ctx_cap;  /* its bytes, capacity */
} kvb_chain_t;

/* One KV cache group's table of one sequence: the only per-group state a sequence has. */
struct kvb_row {
    int32_t *blocks;           /* [bcap] block table: physical ids in logical order */
    int32_t nblocks, bcap;     /* blocks held (committed + reserved), capacity */
    int32_t lo;                /* blocks[0..lo) were released (window / chunk groups): null */
    uint32_t tver;             /* bumped when an existing entry changes (not on growth) */
    int64_t done;              /* leading tokens whose K/V this group holds computed (a step
                                * declared for this group alone, metadata(group=), runs ahead
                                * of the others); the record's ncomputed is the fewest */
    int64_t drafted;           /* draft slots this group's last step declared (as the
                                * record's, which is the fewest) */
    int64_t room;              /* STATE: the blocks a token group's table of this sequence
                                * holds (its tokens' blocks, grown by reserve, cut by
                                * truncate), which its draft slots must lie within as in
                                * every kind; other kinds: unused (0) */
};

/* A sequence, once for all groups: its tokens, hash chain and counters, and group 0's row
 * (groups 1.. keep theirs in kvb_mgr_t.rows, at the same slot). */
struct kvb_seq {
    /* the first 64 bytes are what a decode step (append_batch) reads and writes of a record
     * with one group: one cache line */
    kvb_row_t row;             /* group 0's table */
    int32_t *tokens;           /* [tcap] committed token ids */
    kvb_hash_t *hashes;        /* [hcap] chain hashes of the leading full blocks (group j's
                                * cache key of block i: hashes[i] XOR its tag) */
    int64_t ntokens, tcap;     /* committed tokens, capacity */
    /* the rest */
    int32_t nhashed, hcap;     /* hashes known (<= ntokens / block_size), capacity */
    uint32_t stamp;            /* last batch call that touched it (duplicate check) */
    int32_t swapped;           /* every group's blocks refer to the host pool (swap_out) */
    int64_t ncomputed;         /* leading tokens whose K/V are written in every group (or
                                * promised by the last step); <= ntokens */
    int64_t drafted;           /* positions < drafted were scheduled as draft slots (in every
                                * group) since the last commit: append(computed=1) may commit
                                * up to here */
    uint32_t gen;              /* bumped when the slot is freed; odd = live */
    int32_t next_free;         /* free-slot stack link */
    kvb_hash_t root;           /* chain seed (salt folded in) */
    kvb_chain_t chain;         /* the rest of the hash chain's state (chain.c) */
};

/* A manager is G groups g[0..G) over one pool; g[0], the lead, holds the sequences (records,
 * slots); every group holds its kind, its tag and its rows. Every call takes (g, G). */
struct kvb_mgr {
    kvb_pool_t *pool;          /* device pool (not owned) */
    kvb_pool_t *host;          /* host pool for swapping or NULL (not owned) */
    int32_t block_size;        /* tokens per block, >= 1 */
    int32_t bs_shift;          /* log2(block_size) when a power of two, else -1 */
    uint8_t key[16];           /* hash key */
    int32_t hash_algo;         /* KVB_HASH_* mode of the block hashes (kvb_mgr_set_hash) */
    uint8_t none_hash[32];     /* vLLM modes: NONE_HASH, block 0's parent */
    struct kvb_mgr *lead;      /* the group holding the sequences (itself for g[0]) */
    kvb_seq_t *seqs;           /* lead: [scap] sequence records */
    int32_t nseqs, scap;       /* lead: live sequences, capacity */
    int32_t free_slot;         /* lead: head of the free-slot stack, KVB_NONE if empty */
    uint32_t stamp;            /* lead: batch call counter */
    int32_t hashing;           /* lead: some group caches, so records keep chain hashes */
    struct kvb_mgr *const *grp; /* lead: every group, g[0..ngrp) (kvb_grp_link) */
    int32_t ngrp;
    kvb_row_t *rows;           /* groups 1..: [rcap] rows by slot (g[0]'s are in the records) */
    int32_t rcap;
    int32_t kind;              /* KVB_G_* */
    int64_t span;              /* window (WINDOW), chunk (CHUNK) or blocks (STATE); 0 (FULL) */
    uint8_t gidx;              /* group index (events) */
    kvb_hash_t tag;            /* XORed onto the chain hash: the key of the group's blocks (0
                                * in group 0; every hash mode) */
    int caching;               /* the pool caches and the kind can be cached (not STATE) */
    int64_t *copies;           /* [2 * ccap] pending (src, dst) copy-on-write pairs; each
                                * holds one reference on src until drained or dropped */
    int64_t ncopies, ccap;     /* pairs pending, capacity */
    int64_t err_a, err_b;      /* detail of the last error (g[0]'s for a call over groups) */
    const char *err_what;      /* name of the failed invariant (check) or NULL */
};

/* memcpy that accepts NULL pointers when n is 0 (memcpy itself does not: C11 7.24.1). */
KVB_INLINE void kvb_copy(void *dst, const void *src, size_t n) {
    if (n) memcpy(dst, src, n);
}

/* Size and slot helpers of the manager (table.c, meta.c). */
KVB_INLINE int64_t blk_of(const kvb_mgr_t *m, int64_t t) { /* block holding token t */
    return m->bs_shift >= 0 ? t >> m->bs_shift : t / m->block_size;
}
KVB_INLINE int64_t off_in(const kvb_mgr_t *m, int64_t t) { /* token t's offset in it */
    return m->bs_shift >= 0 ? t & (m->block_size - 1) : t % m->block_size;
}
KVB_INLINE int64_t blocks_for(const kvb_mgr_t *m, int64_t t) { /* blocks t tokens take */
    return blk_of(m, t + m->block_size - 1);
}
/* The record of a live slot (any group's view of it: the lead holds them), or NULL. */
KVB_INLINE kvb_seq_t *live_seq(const kvb_mgr_t *m, int32_t slot) {
    const kvb_mgr_t *l = m->lead;
    if (KVB_UNLIKELY(slot < 0 || slot >= l->scap || !(l->seqs[slot].gen & 1u))) return NULL;
    return &l->seqs[slot];
}
/* Group m's row of a slot (group 0's lives in the record). */
KVB_INLINE kvb_row_t *row_of(const kvb_mgr_t *m, int32_t slot) {
    return m->lead == m ? &m->seqs[slot].row : &m->rows[slot];
}
/* Group m's rows as a strided array, for loops over a batch: row of slot i is
 * rows_at(v, i) (group 0's rows are inside the records). */
typedef struct { char *base; size_t stride; } kvb_rows_view_t;
KVB_INLINE kvb_rows_view_t group_rows(const kvb_mgr_t *m) {
    kvb_rows_view_t v;
    if (m->lead == m) { /* no records yet: no row is read */
        v.base = m->seqs ? (char *)&m->seqs[0].row : NULL;
        v.stride = sizeof(kvb_seq_t);
    } else {
        v.base = (char *)m->rows;
        v.stride = sizeof(kvb_row_t);
    }
    return v;
}
KVB_INLINE kvb_row_t *rows_at(kvb_rows_view_t v, int32_t slot) {
    return (kvb_row_t *)(v.base + (size_t)slot * v.stride);
}
/* Group m's cache key of block i of a record: the chain hash XOR the group's tag. */
KVB_INLINE kvb_hash_t gkey(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t i) {
    kvb_hash_t h = s->hashes[i];
    h.lo ^= m->tag.lo;
    h.hi ^= m->tag.hi;
    return h;
}
/* Blocks a step's context (committed tokens and draft slots) may span: the table, or for a
 * state group the blocks a token group's table would hold (kvb_row_t.room). */
KVB_INLINE int64_t table_room(const kvb_mgr_t *m, const kvb_row_t *r) {
    return m->kind == KVB_G_STATE ? r->room : r->nblocks;
}
KVB_INLINE int64_t add_sat(int64_t a, int64_t b) { /* a, b >= 0; never fits beyond */
    return b > INT64_MAX - a ? INT64_MAX : a + b;
}

/* Grow *ptr to hold at least `need` elements of `elem` bytes (capacity doubles from 64); *cap is
 * updated. KVB_ENOMEM on overflow or allocation failure, leaving *ptr and *cap as they were. */
static inline int kvb_grow(void **ptr, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return KVB_OK;
    /* checked size arithmetic: the doubling and the byte count never overflow */
    int64_t limit = (int64_t)(PTRDIFF_MAX / (ptrdiff_t)elem) / 2;
    if (need < 0 || need > limit) return KVB_ENOMEM;
    int64_t nc = *cap ? *cap : 64;
    while (nc < need) nc *= 2;
    void *np_ = realloc(*ptr, (size_t)nc * elem);
    if (!np_) return KVB_ENOMEM;
    *ptr = np_;
    *cap = nc;
    return KVB_OK;
}

/* The pool's log (pool.c writes evictions, cache.c insertions and lineage; the reader, the
 * host tier, drains both at its own layer: nothing below it names it). Kept only once a reader
 * asked for it (kvb_pool_log_on). Evictions are recorded oldest first with what the reader
 * needs after the block is reused (hash, group, parent, tokens); insertions as block ids with
 * the stamp of their BlockStored, only when the reader wants them (write-through). */
typedef struct kvb_plog {
    int32_t block_size;        /* tokens per block (rows of tokens and evtok) */
    int inserts;               /* 1: record insertions too */
    kvb_hash_t *parent;        /* [num_blocks] lineage: each cached entry's parent hash (0: a
                                * chain's first), for the reader's BlockStored events */
    int32_t *tokens;           /* [num_blocks * block_size] its token ids, valid where has_tokens */
    uint8_t *has_tokens;       /* [num_blocks] 1 when tokens were given at caching */
    kvb_demotion_t *ev;        /* [evcap] evictions since the reader drained, oldest first */
    int64_t nev, evcap;        /* entries used, capacity */
    int32_t *evtok;            /* [num_blocks * block_size] tokens of evictions [0, num_blocks) */
    int64_t lost;              /* evictions not recorded: content in flight (KVB_F_INFLIGHT, so
                                * nothing to copy) or no memory; the reader counts them */
    int32_t *ins;              /* [inscap] insertions since the reader drained: block ids */
    uint64_t *ins_stamp;       /* [inscap] their BlockStored's stamp, 0: none recorded */
    int64_t nins, inscap;      /* entries used, capacity */
} kvb_plog_t;
int kvb_pool_log_on(kvb_pool_t *p, int32_t block_size, int inserts); /* 0 or KVB_ENOMEM */
void kvb_pool_log_off(kvb_pool_t *p);             /* free p->log, keep no record */

/* pool.c */
void kvb_pool_release(kvb_pool_t *p, int32_t b);  /* drop one (validated) reference */
void kvb_pool_requeue(kvb_pool_t *p, int32_t b);  /* a free block moves to the list's tail */
void kvb_pool_pin(kvb_pool_t *p, const int32_t *ids, int64_t n); /* +1 ref, unlinks evictable */
void kvb_pool_uncache(kvb_pool_t *p, int32_t b);  /* drop b's entry; an evictable b moves to
                                                   * the head as never-cached */
/* events.c */
void kvb_pool_record(kvb_pool_t *p, int kind, int32_t b, const kvb_hash_t *h,
                     const kvb_hash_t *parent, const int32_t *tokens, int32_t ntok);

/* cache.c */
int64_t kvb_cache_match(const kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n,
                        int32_t *out);            /* kvb_cache_lookup without stats */
void kvb_cache_forget(kvb_pool_t *p, int32_t b);  /* drop a cached block's entries (any state) */
void kvb_cache_clear(kvb_pool_t *p);              /* drop every entry (free list untouched) */
void kvb_cache_move(kvb_pool_t *p, int32_t src, int32_t dst); /* src's entries to dst (checked) */
int kvb_cache_put(kvb_pool_t *p, int32_t b, const kvb_hash_t *h, const kvb_hash_t *parent,
                  const int32_t *tokens, int32_t block_size); /* 1 stored, 0 hash present */

/* chain.c: a sequence's hash chain in the manager's mode (see there); m is the lead */
int kvb_chain_begin(const kvb_mgr_t *m, kvb_seq_t *s, const uint8_t *ctx, size_t ctx_len);
int kvb_chain_reserve(const kvb_mgr_t *m, kvb_seq_t *s, int64_t nblocks); /* ext capacity */
void kvb_chain_hash(const kvb_mgr_t *m, kvb_seq_t *s, const int32_t *tokens, int64_t from,
                    int64_t to); /* hashes[from..to) from the tokens of those blocks */
void kvb_chain_block(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t j, kvb_hash_t *out);
int kvb_chain_fork(const kvb_mgr_t *m, kvb_seq_t *child, const kvb_seq_t *parent);
void kvb_chain_destroy(kvb_seq_t *s);
int kvb_chain_probe(const kvb_mgr_t *m, const uint8_t *ctx, size_t ctx_len, kvb_hasher_t *hs);
/* KV cache groups' eviction rule (groups.c builds it in kvb_grp_link, policy.c applies it). A
 * cached block of a sliding-window or chunked-local group serves prefix hits only together
 * with the same block of the full-attention groups: its twin, whose hash is the block's XOR
 * tag[its group] XOR tag[anchor]. While that twin is cached (held or evictable), the block
 * gets a second chance: allocation moves it from the free list's head to the tail instead of
 * evicting it, once per stay in the free list (CLOCK-like: each release pays for at most one
 * move, so allocation stays O(1) amortized). */
typedef struct kvb_twins {
    uint8_t anchor;            /* the first full-attention group */
    uint8_t keep[256];         /* 1: a window or chunk group, whose blocks get second chances */
    kvb_hash_t tag[256];       /* each group's hash tag (kvb_group_tag) */
    uint8_t *spent;            /* [pool->num_blocks] 1: the block had its second chance since
                                * it joined the free list (the pool's `chance`, cleared by it) */
} kvb_twins_t;
/* policy.c: eviction orders the pool is given (LRU by release needs none). Installs the groups'
 * second chance on p (owning tw and tw->spent; an earlier policy is freed). */
void kvb_policy_twins(kvb_pool_t *p, kvb_twins_t *tw);

/* tier.c: the host tier's helpers for the layers above it (table.c, manager.c, hosthits.c) */
/* Host hits continuing a device prefix: hashes[0..n) matched on the host, ids into
 * t->scratch; returns the count, or KVB_ENOMEM. Capacity for as many onloads is reserved. */
int64_t kvb_tier_match(kvb_tier_t *t, const kvb_hash_t *hashes, int64_t n);
/* Queue onloads for blocks [from, from + n) of s (host ids in t->scratch, pinned already). */
void kvb_tier_onload(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t from, int64_t n);
void kvb_tier_settle(kvb_tier_t *t);             /* a drain started: clear in-flight flags,
                                                  * release deferred host blocks */
void kvb_tier_release_host(kvb_mgr_t *m, const int32_t *ids, int64_t n); /* a swapped
                                                  * sequence's host blocks: deferred or freed */
void kvb_tier_inflight(kvb_tier_t *t, int32_t b); /* b's content arrives with the drain */
void kvb_tier_swap_dst(kvb_tier_t *t, int32_t b); /* a swap-in pair of the drain writes b */
void kvb_tier_swap_src(kvb_tier_t *t, int32_t b); /* a swap-out pair of the drain reads b */
int64_t kvb_tier_onload_targets(const kvb_pool_t *p, kvb_row_t *r, int64_t from, int64_t n);
/* Queue the onload of host block hb into block i of group m's row r of s (fresh, pinned). */
void kvb_tier_onload_at(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t i, int32_t hb);
/* Blocks a swap pair of the coming drain reads (swap-out source) or writes (released swap-in
 * destination, in flight): never an onload destination (tier.c). */
#define KVB_F_NOT_ONLOAD (KVB_F_SWAP_SRC | KVB_F_INFLIGHT)

/* manager.c, for hosthits.c and step.c: an add's pin phase (take the prepared slot, pin
 * every group's k-block hit, fill the record), its query counters, and a step's release. */
void mgr_add_pin(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n, int64_t k,
                 int32_t slot);
void mgr_add_stats(kvb_mgr_t *L, int64_t n, int64_t k, int recompute);
void mgr_step_release(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                      const int32_t *qlens, int64_t B);

/* hosthits.c: host-tier hits for KV cache groups (manager.c's add and probe, after prepare).
 * kdev: the device-only joint hit. add: 1 when it took a longer hit with the host (slot and
 * cached tokens set), 0 when the device-only hit stands (nothing changed), or an error code
 * (negative, nothing changed). probe: the joint hit's cached tokens and need, when longer. */
int kvb_hh_add(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n, int64_t kdev,
               int recompute, int32_t *slot_out, int64_t *cached_out);
int kvb_hh_probe(kvb_mgr_t *const *g, int32_t G, int64_t n, int64_t kdev, int64_t *cached_out,
                 int64_t *need_out);
void kvb_tier_destroy(kvb_pool_t *p);            /* free p->tier and detach it */

#endif
