/* manager.c -- a manager's calls: G KV cache groups over one pool, each sequence once.
 *
 * The lead g[0] holds the sequences: one record per slot (tokens, the hash chain, computed
 * count, drafts, generation, swapped state, adapter tag, and group 0's row); each group holds
 * only its rows (table.c) and its kind's rules. One group is the same code with G = 1.
 *
 * Every call runs in phases, so that the record changes once:
 *   1. validate the record and every group's row, count the blocks all groups take together
 *      and grow capacities (not observable): a failed call changes nothing;
 *   2. every group's table work on the record as it was (release, copy-on-write, growth);
 *   3. the record's update (tokens, hashes, counters);
 *   4. every group's work on the updated record (caching of newly computed blocks).
 * Release (window, chunk) runs in every group before any group allocates: a group that
 * allocates first must not depend on blocks a later group has not released yet. Errors are
 * reported in g[0]'s fields.
 */
#include <stdlib.h>
#include <string.h>

#include "table.h"

static int fail_from(kvb_mgr_t *const *g, int32_t k, int rc) {
    if (k) {
        g[0]->err_a = g[k]->err_a;
        g[0]->err_b = g[k]->err_b;
        g[0]->err_what = g[k]->err_what;
    }
    return rc;
}

KVB_NOINLINE static int out_of_blocks(kvb_mgr_t *m, int64_t need, int64_t have) {
    m->err_a = need;
    m->err_b = have;
    return KVB_EOUTOFBLOCKS;
}

/* Tokens no sequence can ever hold: more than the whole pool. Requests above it are refused
 * before any size arithmetic, so ntokens + n never overflows (both stay below 2^62). */
KVB_INLINE int64_t max_tokens(const kvb_mgr_t *m) {
    return (int64_t)m->pool->num_blocks * m->block_size;
}

/* The one preamble of every single-sequence call: the live sequence in slot, refused when
 * swapped out unless allow_swapped. Sets the error detail (index 0, the slot). */
static int get_seq(kvb_mgr_t *L, int32_t slot, int allow_swapped, kvb_seq_t **out) {
    kvb_seq_t *s = live_seq(L, slot);
    L->err_a = 0;
    L->err_b = slot;
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped && !allow_swapped) return KVB_ESWAPPED;
    *out = s;
    return KVB_OK;
}

static uint32_t next_stamp(kvb_mgr_t *L) {
    uint32_t stamp = ++L->stamp;
    if (KVB_UNLIKELY(stamp == 0)) { /* wrapped: clear old stamps */
        for (int32_t i = 0; i < L->scap; i++) L->seqs[i].stamp = 0;
        stamp = L->stamp = 1;
    }
    return stamp;
}

/* Capacity of a record for ntok tokens and, when hashing, nblk block hashes. */
static int rec_reserve(const kvb_mgr_t *L, kvb_seq_t *s, int64_t ntok, int64_t nblk) {
    if (kvb_grow((void **)&s->tokens, &s->tcap, ntok, sizeof *s->tokens)) return KVB_ENOMEM;
    if (!L->hashing || nblk <= s->hcap) return KVB_OK;
    int64_t cap = s->hcap;
    if (nblk > INT32_MAX || kvb_grow((void **)&s->hashes, &cap, nblk, sizeof *s->hashes))
        return KVB_ENOMEM;
    s->hcap = (int32_t)cap;
    return kvb_chain_reserve(L, s, nblk);
}

/* Hash the blocks that became full (from block nhashed to ntokens / bs), once for all
 * groups. They enter the prefix cache only once computed (tbl_computed). */
static void hash_new(const kvb_mgr_t *L, kvb_seq_t *s) {
    int64_t full = blk_of(L, s->ntokens);
    kvb_chain_hash(L, s, s->tokens + s->nhashed * (int64_t)L->block_size, s->nhashed, full);
    s->nhashed = (int32_t)full;
}

/* ---- lifecycle -------------------------------------------------------------------------- */
int kvb_mgr_init(kvb_mgr_t *m, kvb_pool_t *pool, kvb_pool_t *host, int32_t block_size,
                 const uint8_t key[16]) {
    memset(m, 0, sizeof *m);
    if (block_size < 1) { m->err_b = block_size; return KVB_EINVAL; }
    m->pool = pool;
    m->host = host;
    m->block_size = block_size;
    m->bs_shift = -1;
    if ((block_size & (block_size - 1)) == 0) {
        m->bs_shift = 0;
        while ((1 << m->bs_shift) < block_size) m->bs_shift++;
    }
    memcpy(m->key, key, 16);
    m->lead = m;
    m->grp = &m->lead; /* one group, itself, until kvb_grp_link */
    m->ngrp = 1;
    m->free_slot = KVB_NONE;
    m->kind = KVB_G_FULL;
    m->caching = pool->caching;
    m->hashing = m->caching;
    return KVB_OK;
}

int kvb_mgr_set_kind(kvb_mgr_t *m, int32_t kind, int64_t span, uint8_t gidx) {
    KVB_CLEAR_ERR(m);
    if (kind < KVB_G_FULL || kind > KVB_G_STATE) { m->err_b = kind; return KVB_EINVAL; }
    if (kind != KVB_G_FULL && (span < 1 || span > INT32_MAX)) {
        m->err_b = span;
        return KVB_EINVAL;
    }
    if (m->lead->nseqs) return KVB_ESTATE;
    m->kind = kind;
    m->span = kind == KVB_G_FULL ? 0 : span;
    m->gidx = gidx;
    m->caching = m->pool->caching && kind != KVB_G_STATE;
    if (m->lead == m) m->hashing = m->caching; /* kvb_grp_link sets it for the groups */
    return KVB_OK;
}

void kvb_mgr_destroy(kvb_mgr_t *m) {
    if (m->lead == m) {
        for (int32_t i = 0; i < m->scap; i++) {
            free(m->seqs[i].row.blocks);
            free(m->seqs[i].tokens);
            free(m->seqs[i].hashes);
            kvb_chain_destroy(&m->seqs[i]);
        }
        free(m->seqs);
    }
    for (int32_t i = 0; i < m->rcap; i++) free(m->rows[i].blocks);
    free(m->rows);
    free(m->copies);
    if (m->pool && m->pool->tier) kvb_tier_destroy(m->pool);
    memset(m, 0, sizeof *m);
}

/* ---- slots ------------------------------------------------------------------------------ */
/* Rows of every group for every slot of the lead (new rows empty). */
static int grow_rows(kvb_mgr_t *const *g, int32_t G) {
    for (int32_t j = 1; j < G; j++) {
        kvb_mgr_t *m = g[j];
        int64_t cap = m->rcap, old = cap;
        if (kvb_grow((void **)&m->rows, &cap, g[0]->scap, sizeof *m->rows)) return KVB_ENOMEM;
        if (cap > old) memset(m->rows + old, 0, (size_t)(cap - old) * sizeof *m->rows);
        m->rcap = (int32_t)cap;
    }
    return KVB_OK;
}

/* A fresh slot (its arrays keep their capacity), not yet marked live. */
static int new_slot(kvb_mgr_t *const *g, int32_t G, int32_t *slot) {
    kvb_mgr_t *L = g[0];
    if (L->free_slot == KVB_NONE) {
        int64_t cap = L->scap;
        if (cap >= INT32_MAX / 2) return KVB_ENOMEM;
        int64_t old = cap;
        if (kvb_grow((void **)&L->seqs, &cap, old + 1, sizeof *L->seqs)) return KVB_ENOMEM;
        memset(L->seqs + old, 0, (size_t)(cap - old) * sizeof *L->seqs);
        for (int64_t i = cap - 1; i >= old; i--) { /* push in reverse: lowest slot first */
            L->seqs[i].next_free = L->free_slot;
            L->free_slot = (int32_t)i;
        }
        L->scap = (int32_t)cap;
    }
    if (grow_rows(g, G)) return KVB_ENOMEM;
    *slot = L->free_slot;
    return KVB_OK;
}

static void take_slot(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    kvb_mgr_t *L = g[0];
    kvb_seq_t *s = &L->seqs[slot];
    L->free_slot = s->next_free;
    s->next_free = KVB_NONE;
    s->gen++; /* now odd: live */
    s->ntokens = 0;
    s->ncomputed = 0;
    s->drafted = 0;
    s->nhashed = 0;
    s->swapped = 0;
    s->chain.tag = 0;
    for (int32_t j = 0; j < G; j++) {
        kvb_row_t *r = row_of(g[j], slot);
        r->nblocks = 0;
        r->lo = 0;
        r->done = 0;
        r->drafted = 0;
        r->room = 0;
    }
    L->nseqs++;
}

/* The record's computed tokens and draft window: the fewest any group declared. */
static void sync_computed(const kvb_mgr_t *L, kvb_seq_t *s, int32_t slot) {
    int64_t nc = s->ntokens, dr = INT64_MAX;
    for (int32_t j = 0; j < L->ngrp; j++) {
        const kvb_row_t *r = row_of(L->grp[j], slot);
        if (r->done < nc) nc = r->done;
        if (r->drafted < dr) dr = r->drafted;
    }
    s->ncomputed = nc;
    s->drafted = dr;
}

/* No draft window any more (tokens committed or dropped), in the record and every group. */
static void clear_drafts(kvb_mgr_t *const *g, int32_t G, kvb_seq_t *s, int32_t slot) {
    s->drafted = 0;
    for (int32_t j = 0; j < G; j++) row_of(g[j], slot)->drafted = 0;
}

/* ---- add and probe: the longest prefix every group can serve ---------------------------- *
 * A hit of k full blocks means tokens [0, k * bs) are reused and computed; the step after
 * computes from position k * bs, so a group must hold the blocks that query reads: all k in a
 * full group, those from tbl_hit_lo(k) in a window or chunk group (the ones below are null
 * entries), none in a state group (no state snapshots: no hits). */

/* Which hit lengths k in [1, K] group m can serve for the prompt hashed in record s: entries
 * it cannot serve are cleared in ok. Its row gets the cached blocks found. */
static int group_hits(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t n, uint8_t *ok,
                      int64_t K) {
    kvb_pool_t *p = m->pool;
    if (!m->caching) { /* no hits */
        for (int64_t k = 1; k <= K; k++) ok[k] = 0;
        return KVB_OK;
    }
    if (m->kind == KVB_G_FULL) {
        int64_t run = 0;
        if (!(m->tag.lo | m->tag.hi)) {
            run = kvb_cache_match(p, s->hashes, K, r->blocks);
        } else {
            for (; run < K; run++) {
                kvb_hash_t h = gkey(m, s, run);
                int32_t b = kvb_cache_find(p, &h);
                if (b == KVB_NONE) break;
                r->blocks[run] = b;
            }
        }
        for (int64_t k = run + 1; k <= K; k++) ok[k] = 0;
        return KVB_OK;
    }
    /* window / chunk: a hit of k blocks needs blocks [hit_lo(k), k) cached */
    int64_t trail = 0; /* cached blocks ending at block k - 1 */
    for (int64_t k = 1; k <= K; k++) {
        kvb_hash_t h = gkey(m, s, k - 1);
        int32_t b = kvb_cache_find(p, &h);
        r->blocks[k - 1] = b == KVB_NONE ? 0 : b;
        trail = b == KVB_NONE ? 0 : trail + 1;
        if (trail < k - tbl_hit_lo(m, n, k)) ok[k] = 0;
    }
    return KVB_OK;
}

/* Phase 1 of add and probe: the prompt hashed once into the next free slot's record (not yet
 * live), each group's hits found (ok[1..K], all set by the caller), capacities grown. */
static int prepare(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                   const uint8_t *salt, size_t salt_len, uint8_t *ok, int64_t K) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool;
    int64_t full = blk_of(L, n);
    for (int32_t j = 0; j < G; j++) {
        int64_t total = tbl_blocks(g[j], n);
        if (total >= p->num_blocks) return out_of_blocks(L, total, p->num_free);
    }
    int32_t slot;
    if (new_slot(g, G, &slot)) return KVB_ENOMEM;
    kvb_seq_t *s = &L->seqs[slot];
    if (rec_reserve(L, s, n, full + 1)) return KVB_ENOMEM;
    for (int32_t j = 0; j < G; j++) {
        int64_t total = tbl_blocks(g[j], n);
        if (tbl_ensure_blocks(row_of(g[j], slot), total > full ? total : full)) return KVB_ENOMEM;
    }
    if (L->hashing) {
        int rc = kvb_chain_begin(L, s, salt, salt_len);
        if (rc) return rc;
        kvb_chain_hash(L, s, tokens, 0, full);
    }
    for (int32_t j = 0; j < G; j++) {
        int rc = group_hits(g[j], s, row_of(g[j], slot), n, ok, K);
        if (rc) return fail_from(g, j, rc);
    }
    return KVB_OK;
}

/* Blocks group m takes from the free pool for an n-token prompt with a k-block hit (its row
 * holds the hits found). */
static int64_t add_need(const kvb_mgr_t *m, const kvb_row_t *r, int64_t n, int64_t k) {
    if (m->kind == KVB_G_STATE) return m->span;
    int64_t need = tbl_blocks(m, n) - k;
    for (int64_t j = tbl_hit_lo(m, n, k); j < k; j++)
        need += m->pool->ref_count[r->blocks[j]] == 0; /* pinning an evictable hit */
    return need;
}

void mgr_add_stats(kvb_mgr_t *L, int64_t n, int64_t k, int recompute) {
    kvb_pool_t *p = L->pool;
    int64_t full = blk_of(L, n);
    if (p->caching) {
        p->stats.queries++;
        p->stats.query_blocks += (uint64_t)full;
        p->stats.hit_blocks += (uint64_t)k;
        if (recompute) {
            p->stats.recompute_query_tokens += (uint64_t)n;
            p->stats.recompute_hit_tokens += (uint64_t)(k * L->block_size);
        } else {
            p->stats.query_tokens += (uint64_t)n;
            p->stats.hit_tokens += (uint64_t)(k * L->block_size);
        }
    }
}

/* Take the prepared slot: every group pins its k-block hit (the entries below its hit_lo
 * null, a 0 entry: a host hit's, hosthits.c), then the record. */
void mgr_add_pin(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n, int64_t k,
                 int32_t slot) {
    kvb_mgr_t *L = g[0];
    kvb_seq_t *s = &L->seqs[slot];
    take_slot(g, G, slot);
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        int64_t kk = m->kind == KVB_G_STATE ? 0 : k;
        r->lo = (int32_t)tbl_hit_lo(m, n, kk);
        for (int64_t i = 0; i < r->lo; i++) r->blocks[i] = KVB_NULL_BLOCK;
        for (int64_t i = r->lo, e; i < kk; i = e) {
            while (i < kk && !r->blocks[i]) i++;
            for (e = i; e < kk && r->blocks[e]; e++) {}
            kvb_pool_pin(m->pool, r->blocks + i, e - i);
        }
        r->nblocks = (int32_t)kk;
        r->done = kk * L->block_size; /* the rest enters the cache once computed */
    }
    kvb_copy(s->tokens, tokens, (size_t)n * sizeof *tokens);
    s->ntokens = n;
    sync_computed(L, s, slot);
    s->nhashed = L->hashing ? (int32_t)blk_of(L, n) : 0;
}

/* Every group allocates the rest of its table (after every group pinned). */
static void add_fill(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    const kvb_seq_t *s = &g[0]->seqs[slot];
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        int64_t total = tbl_blocks(m, s->ntokens);
        KVB_MUST(kvb_pool_allocate(m->pool, (int32_t)(total - r->nblocks), r->blocks + r->nblocks));
        r->nblocks = (int32_t)total;
        if (m->kind == KVB_G_STATE) r->room = blocks_for(m, s->ntokens);
    }
}

/* One full-attention group takes host hits continuing its device prefix here (fresh blocks
 * and onloads); any other shape takes the grouped rule of hosthits.c. */
KVB_INLINE int plain_host_hits(kvb_mgr_t *const *g, int32_t G) {
    return G == 1 && g[0]->kind == KVB_G_FULL;
}

static int add(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
               const uint8_t *salt, size_t salt_len, int recompute, int32_t *slot_out,
               int64_t *cached_out) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool;
    KVB_CLEAR_ERR(L);
    if (n < 0) { L->err_b = n; return KVB_EINVAL; }
    uint8_t small[64];
    int64_t K = n > 0 ? blk_of(L, n - 1) : 0; /* at least one token is computed */
    uint8_t *ok = K < 64 ? small : malloc((size_t)K + 1);
    if (!ok) return KVB_ENOMEM;
    memset(ok, 1, (size_t)K + 1);
    int rc = prepare(g, G, tokens, n, salt, salt_len, ok, K);
    int64_t k = K;
    while (k > 0 && !ok[k]) k--;
    if (ok != small) free(ok);
    if (rc) return rc;
    int32_t slot = L->free_slot;
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) need = add_sat(need, add_need(g[j], row_of(g[j], slot), n, k));
    kvb_tier_t *t = p->tier;
    if (t && !plain_host_hits(g, G)) { /* a longer hit with the host, when it fits */
        rc = kvb_hh_add(g, G, tokens, n, k, recompute, slot_out, cached_out);
        if (rc) return rc > 0 ? KVB_OK : rc;
        t = NULL; /* the device-only hit stands */
    }
    if (need > p->num_free) return out_of_blocks(L, need, p->num_free);
    kvb_seq_t *s = &L->seqs[slot];
    int64_t hh = 0;
    if (t && L->caching && k < K) { /* one full group: the prefix continues on the host */
        hh = kvb_tier_match(t, s->hashes + k, K - k); /* one group: keys are the chain */
        if (hh < 0) return KVB_ENOMEM;
    }
    mgr_add_pin(g, G, tokens, n, k, slot);
    mgr_add_stats(L, n, k, recompute);
    if (hh) kvb_pool_pin(L->host, t->scratch, hh); /* before demotions need room */
    add_fill(g, G, slot);
    if (hh) { /* host hits are computed like device ones; counted in the tier's stats */
        kvb_row_t *r = row_of(L, slot);
        int64_t got = kvb_tier_onload_targets(p, r, k, hh);
        for (int64_t i = got; i < hh; i++) kvb_pool_release(L->host, t->scratch[i]);
        if (got) {
            kvb_tier_onload(L, s, r, k, got);
            if (recompute) t->stats.recompute_hit_tokens += (uint64_t)(got * L->block_size);
            else t->stats.hit_tokens += (uint64_t)(got * L->block_size);
            s->ncomputed += got * L->block_size;
            r->done = s->ncomputed;
        }
    }
    *slot_out = slot;
    *cached_out = s->ncomputed;
    return KVB_OK;
}

int kvb_grp_add(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                const uint8_t *salt, size_t salt_len, int recompute, int32_t tag,
                int32_t *slot_out, int64_t *cached_out) {
    kvb_pool_t *p = g[0]->pool;
    p->events.cur_tag = tag; /* host-tier onloads cache blocks inside add */
    int rc = add(g, G, tokens, n, salt, salt_len, recompute, slot_out, cached_out);
    p->events.cur_tag = 0;
    if (!rc) g[0]->seqs[*slot_out].chain.tag = tag;
    return rc;
}

/* probe of one full-attention group: hashes block by block, stopping at the first miss. */
static int probe_full(kvb_mgr_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                      size_t salt_len, int64_t *cached_out, int64_t *need_out) {
    kvb_pool_t *p = m->pool;
    int64_t total = blocks_for(m, n), hits = 0, pinned_from_free = 0;
    if (p->tier) kvb_tier_flush(p->tier); /* recent evictions: on the host */
    if (m->caching && n > 1) {
        int64_t max_hits = blk_of(m, n - 1);
        kvb_hasher_t hs;
        kvb_digest_t d, parent;
        int rc = kvb_chain_probe(m, salt, salt_len, &hs);
        if (rc) return rc;
        int host = 0; /* 1 once the device prefix ended: it continues on the host tier */
        for (; hits < max_hits; hits++) { /* hash block by block: stop at the first miss */
            kvb_hash_blocks(&hs, hits ? &parent : NULL, hits, tokens + hits * m->block_size,
                            1, m->block_size, &d.h, &d.x);
            int32_t b = host ? KVB_NONE : kvb_cache_find(p, &d.h);
            if (b == KVB_NONE) {
                if (!p->tier || kvb_cache_find(p->tier->host, &d.h) == KVB_NONE) break;
                host = 1; /* a host hit takes a fresh device block all the same */
            }
            pinned_from_free += b == KVB_NONE || p->ref_count[b] == 0;
            parent = d;
        }
    }
    *cached_out = hits * m->block_size;
    *need_out = total - hits + pinned_from_free;
    return KVB_OK;
}

int kvb_grp_probe(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                  const uint8_t *salt, size_t salt_len, int64_t *cached_out, int64_t *need_out) {
    kvb_mgr_t *L = g[0];
    KVB_CLEAR_ERR(L);
    if (n < 0) { L->err_b = n; return KVB_EINVAL; }
    if (plain_host_hits(g, G)) return probe_full(L, tokens, n, salt, salt_len, cached_out, need_out);
    int64_t K = n > 0 ? blk_of(L, n - 1) : 0;
    uint8_t *ok = malloc((size_t)K + 1);
    if (!ok) return KVB_ENOMEM;
    memset(ok, 1, (size_t)K + 1);
    int rc = prepare(g, G, tokens, n, salt, salt_len, ok, K);
    int64_t k = K;
    while (k > 0 && !ok[k]) k--;
    free(ok);
    if (rc) return rc;
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++)
        need = add_sat(need, add_need(g[j], row_of(g[j], L->free_slot), n, k));
    *cached_out = k * L->block_size;
    *need_out = need;
    return L->pool->tier ? kvb_hh_probe(g, G, n, k, cached_out, need_out) : KVB_OK;
}

/* ---- append / reserve ------------------------------------------------------------------- */
/* Make n slots after the committed tokens writable in every group (copy-on-write of the
 * write block, growth), with capacity for `tokens` more committed tokens; an append
 * (tokens > 0) first releases what the longer sequence no longer needs. */
static int make_room(kvb_mgr_t *const *g, int32_t G, kvb_seq_t *s, int32_t slot, int64_t n,
                     int64_t tokens) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool;
    if (n < 0) { L->err_b = n; return KVB_EINVAL; }
    if (n == 0) return KVB_OK;
    if (n > max_tokens(L)) {
        int64_t need = INT64_MAX; /* state groups only: the state does not grow */
        for (int32_t j = 0; j < G; j++)
            if (g[j]->kind != KVB_G_STATE) need = blocks_for(L, max_tokens(L)) + 1;
        return out_of_blocks(L, need, p->num_free);
    }
    int64_t need = 0, have = p->num_free; /* release never touches the write block */
    for (int32_t j = 0; j < G; j++) {
        const kvb_row_t *r = row_of(g[j], slot);
        need = add_sat(need, tbl_need_for(g[j], s, r, n));
        if (tokens) have += tbl_gain(g[j], r, s->ntokens + n);
    }
    if (need > have) return out_of_blocks(L, need, have);
    if (rec_reserve(L, s, s->ntokens + tokens, blk_of(L, s->ntokens + tokens) + 1))
        return KVB_ENOMEM;
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        if (m->kind == KVB_G_STATE) continue;
        if (tbl_ensure_blocks(r, r->nblocks + tbl_need_for(m, s, r, n)) ||
            tbl_ensure_copies(m, 1))
            return KVB_ENOMEM;
    }
    if (tokens) /* append: moving on */
        for (int32_t j = 0; j < G; j++)
            tbl_release_for(g[j], row_of(g[j], slot), s->ntokens + n, INT64_MAX);
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        if (m->kind == KVB_G_STATE) { /* the state blocks do not grow */
            if (blocks_for(m, s->ntokens + n) > r->room) r->room = blocks_for(m, s->ntokens + n);
            continue;
        }
        tbl_make_writable(m, s, r);
        tbl_grow(m, s, r, n);
    }
    return KVB_OK;
}

/* Append validation (unknown, swapped, n < 0, computed tokens without draft slots). */
static int append_check(kvb_mgr_t *L, int32_t slot, int64_t n, int computed, kvb_seq_t **out) {
    kvb_seq_t *s;
    int rc = get_seq(L, slot, 0, &s);
    if (rc) return rc;
    if (n < 0) { L->err_b = n; return KVB_EINVAL; }
    if (computed && n > 0 && (s->ncomputed != s->ntokens || n > s->drafted - s->ntokens)) {
        L->err_a = s->drafted > s->ntokens ? s->drafted - s->ntokens : 0;
        L->err_b = n;
        L->err_what = "computed tokens must fill draft slots the last step scheduled";
        return KVB_ESTATE;
    }
    *out = s;
    return KVB_OK;
}

int kvb_grp_append(kvb_mgr_t *const *g, int32_t G, int32_t slot, const int32_t *tokens,
                   int64_t n, int computed) {
    kvb_mgr_t *L = g[0];
    kvb_seq_t *s;
    KVB_CLEAR_ERR(L);
    int rc = append_check(L, slot, n, computed, &s);
    if (rc || n == 0) return rc;
    rc = make_room(g, G, s, slot, n, n);
    if (rc) return rc;
    memcpy(s->tokens + s->ntokens, tokens, (size_t)n * sizeof *tokens);
    s->ntokens += n;
    if (L->hashing) hash_new(L, s);
    if (computed) { /* every group is computed (append_check) */
        for (int32_t j = 0; j < G; j++) tbl_computed(g[j], s, row_of(g[j], slot), s->ntokens);
        s->ncomputed = s->ntokens;
    } else {
        clear_drafts(g, G, s, slot);
    }
    return KVB_OK;
}

int kvb_grp_reserve(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t n) {
    kvb_mgr_t *L = g[0];
    kvb_seq_t *s;
    KVB_CLEAR_ERR(L);
    int rc = get_seq(L, slot, 0, &s);
    return rc ? rc : make_room(g, G, s, slot, n, 0);
}

/* ---- the decode step -------------------------------------------------------------------- */
/* Validation of a batch (unknown, twice, swapped out), error detail (index, slot). */
static int batch_check(kvb_mgr_t *L, const int32_t *slots, int64_t n) {
    uint32_t stamp = next_stamp(L);
    for (int64_t i = 0; i < n; i++) {
        kvb_seq_t *s = live_seq(L, slots[i]);
        L->err_a = i;
        L->err_b = slots[i];
        if (KVB_UNLIKELY(!s)) return KVB_EUNKNOWN;
        if (KVB_UNLIKELY(s->stamp == stamp)) return KVB_EDUP;
        if (KVB_UNLIKELY(s->swapped)) return KVB_ESWAPPED;
        s->stamp = stamp;
    }
    L->err_a = L->err_b = 0;
    return KVB_OK;
}

/* One token for each of n sequences. The records are validated and their capacity grown; each
 * group bounds the blocks the step takes (one per sequence whose write block is missing or
 * shared) and grows its rows; only when that bound does not fit is the step counted exactly,
 * with what release frees. Then every window and chunk group releases, each group's table
 * takes the token's slot, and the records take the tokens. */
int kvb_grp_append_batch(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                         const int32_t *tokens, int64_t n) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool;
    KVB_CLEAR_ERR(L);
    uint32_t stamp = next_stamp(L);
    for (int64_t i = 0; i < n; i++) { /* the records: validation, capacity */
        kvb_seq_t *s = live_seq(L, slots[i]);
        L->err_a = i;
        L->err_b = slots[i];
        if (KVB_UNLIKELY(!s)) return KVB_EUNKNOWN;
        if (KVB_UNLIKELY(s->stamp == stamp)) return KVB_EDUP;
        if (KVB_UNLIKELY(s->swapped)) return KVB_ESWAPPED;
        s->stamp = stamp;
        int64_t w = blk_of(L, s->ntokens);
        if (KVB_UNLIKELY(s->ntokens + 1 > s->tcap || (L->hashing && w + 1 > s->hcap)) &&
            rec_reserve(L, s, s->ntokens + 1, w + 2))
            return KVB_ENOMEM;
    }
    L->err_a = L->err_b = 0;
    int64_t need = 0;
    int windowed = 0;
    for (int32_t j = 0; j < G; j++) { /* each group: row capacity and the bound */
        kvb_mgr_t *m = g[j];
        if (m->kind == KVB_G_STATE) continue;
        windowed |= m->kind == KVB_G_WINDOW || m->kind == KVB_G_CHUNK;
        if (KVB_UNLIKELY(tbl_ensure_copies(m, n))) return KVB_ENOMEM;
        kvb_rows_view_t v = group_rows(m);
        for (int64_t i = 0; i < n; i++) {
            kvb_row_t *r = rows_at(v, slots[i]);
            int64_t w = blk_of(m, L->seqs[slots[i]].ntokens);
            if (w >= r->nblocks || p->ref_count[r->blocks[w]] > 1) need++;
            if (KVB_UNLIKELY(r->nblocks + 1 > r->bcap) && tbl_ensure_blocks(r, r->nblocks + 1))
                return KVB_ENOMEM;
        }
    }
    if (KVB_UNLIKELY(need > p->num_free)) { /* count exactly, with what release frees */
        int64_t have = p->num_free;
        need = 0;
        for (int32_t j = 0; j < G; j++) {
            kvb_mgr_t *m = g[j];
            int64_t nj;
            if (tbl_step_need(m, slots, NULL, 1, NULL, NULL, n, &nj)) return KVB_ENOMEM;
            need = add_sat(need, nj);
            for (int64_t i = 0; m->kind != KVB_G_FULL && i < n; i++)
                have += tbl_gain(m, row_of(m, slots[i]), L->seqs[slots[i]].ntokens + 1);
        }
        if (need > have) return out_of_blocks(L, need, have);
    }
    for (int32_t j = 0; windowed && j < G; j++) /* every release before any allocation */
        if (g[j]->kind == KVB_G_WINDOW || g[j]->kind == KVB_G_CHUNK)
            for (int64_t i = 0; i < n; i++)
                tbl_release_for(g[j], row_of(g[j], slots[i]), L->seqs[slots[i]].ntokens + 1,
                                INT64_MAX);
    for (int32_t j = 0; j < G; j++) { /* each group's table for one more token */
        kvb_mgr_t *m = g[j];
        kvb_rows_view_t v = group_rows(m);
        for (int64_t i = 0; i < n; i++) {
            kvb_row_t *r = rows_at(v, slots[i]);
            const kvb_seq_t *s = &L->seqs[slots[i]];
            int64_t w = blk_of(m, s->ntokens);
            r->drafted = 0;
            if (m->kind == KVB_G_STATE) { /* the state blocks do not grow */
                if (blocks_for(m, s->ntokens + 1) > r->room) r->room = blocks_for(m, s->ntokens + 1);
            } else if (w >= r->nblocks) {
                KVB_MUST(kvb_pool_allocate(p, 1, r->blocks + r->nblocks));
                r->nblocks++;
            } else {
                int32_t b = r->blocks[w];
                if (KVB_UNLIKELY(p->ref_count[b] > 1 || (p->flags[b] & KVB_F_CACHED)))
                    tbl_make_writable(m, s, r);
            }
        }
    }
    for (int64_t i = 0; i < n; i++) { /* the records */
        kvb_seq_t *s = &L->seqs[slots[i]];
        int64_t t = s->ntokens;
        s->tokens[t] = tokens[i];
        s->ntokens = t + 1;
        s->drafted = 0;
        if (off_in(L, t + 1) == 0 && L->hashing) hash_new(L, s);
    }
    return KVB_OK;
}

/* ---- the step that computes committed tokens -------------------------------------------- */
/* Release what the step's queries cannot read (window, chunk groups), every group. */
void mgr_step_release(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                      const int32_t *qlens, int64_t B) {
    const kvb_seq_t *seqs = g[0]->lead->seqs;
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        if (m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK) continue;
        for (int64_t i = 0; i < B; i++) {
            const kvb_seq_t *s = &seqs[slots[i]];
            tbl_release_for(m, row_of(m, slots[i]), s->ntokens, s->ntokens - qlens[i]);
        }
    }
}

/* A step's check in groups g[0..G) (all of the manager's, or one: metadata(group=)); errors
 * in g[0], the records are the lead's. */
static int schedule_check(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                          const int32_t *qlens, const int32_t *drafts, int64_t B) {
    kvb_mgr_t *E = g[0], *L = E->lead;
    KVB_CLEAR_ERR(E);
    for (int32_t j = 0; j < G; j++)
        if (g[j]->ncopies) { E->err_a = g[j]->ncopies; return KVB_EPENDING; }
    kvb_tier_t *t = E->pool->tier; /* the step's own write-through copies do not count */
    if (KVB_UNLIKELY(t && kvb_tier_busy(t))) {
        E->err_a = kvb_tier_busy(t);
        E->err_what = "host-tier offloads or onloads are pending (take_offloads, take_onloads)";
        return KVB_EPENDING;
    }
    uint32_t stamp = next_stamp(L);
    for (int64_t i = 0; i < B; i++) {
        kvb_seq_t *s = live_seq(L, slots[i]);
        int64_t q = qlens[i], d = drafts ? drafts[i] : 0;
        E->err_a = i;
        E->err_b = slots[i];
        if (!s) return KVB_EUNKNOWN;
        if (s->stamp == stamp) return KVB_EDUP;
        if (s->swapped) return KVB_ESWAPPED;
        s->stamp = stamp;
        E->err_b = q;
        if (q < 0 || q > s->ntokens) return KVB_EINVAL;
        E->err_b = d;
        if (d < 0) return KVB_EINVAL;
        for (int32_t j = 0; j < G; j++) {
            kvb_mgr_t *m = g[j];
            m->err_b = slots[i];
            int rc = tbl_step_check(m, s, row_of(m, slots[i]), q, d);
            if (rc) {
                m->err_a = i;
                return fail_from(g, j, rc);
            }
        }
    }
    E->err_a = E->err_b = 0;
    return KVB_OK;
}

int kvb_grp_schedule(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                     const int32_t *qlens, const int32_t *drafts, int64_t B, int apply) {
    if (!apply) return schedule_check(g, G, slots, qlens, drafts, B);
    kvb_mgr_t *L = g[0]->lead;
    mgr_step_release(g, G, slots, qlens, B);
    if (L->pool->tier) kvb_tier_settle(L->pool->tier); /* the drain ran */
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_rows_view_t v = group_rows(m);
        for (int64_t i = 0; i < B; i++) {
            const kvb_seq_t *s = &L->seqs[slots[i]];
            kvb_row_t *r = rows_at(v, slots[i]);
            tbl_computed(m, s, r, s->ntokens);
            r->drafted = s->ntokens + (drafts ? drafts[i] : 0);
        }
    }
    for (int64_t i = 0; i < B; i++) {
        kvb_seq_t *s = &L->seqs[slots[i]];
        if (G == L->ngrp) {
            s->ncomputed = s->ntokens;
            s->drafted = s->ntokens + (drafts ? drafts[i] : 0);
        } else {
            sync_computed(L, s, slots[i]);
        }
    }
    return KVB_OK;
}

void kvb_grp_schedule_one(kvb_mgr_t *const *g, int32_t j, const int32_t *slots,
                          const int32_t *qlens, const int32_t *drafts, int64_t B) {
    KVB_MUST(kvb_grp_schedule(&g[j], 1, slots, qlens, drafts, B, 1));
}

/* ---- truncate / fork / free ------------------------------------------------------------- */
int kvb_grp_truncate(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t ntokens) {
    kvb_mgr_t *L = g[0];
    kvb_seq_t *s;
    KVB_CLEAR_ERR(L);
    int rc = get_seq(L, slot, 0, &s);
    if (rc) return rc;
    if (ntokens < 0 || ntokens > s->ntokens) {
        L->err_a = s->ntokens;
        L->err_b = ntokens;
        return KVB_EINVAL;
    }
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        const kvb_row_t *r = row_of(m, slot);
        int64_t nc = r->done < ntokens ? r->done : ntokens;
        if (m->kind == KVB_G_STATE && ntokens < r->done) {
            L->err_a = r->done;
            L->err_what = "a recurrent state cannot drop computed tokens";
            return KVB_ESTATE;
        }
        if (r->lo && (ntokens == 0 || blk_of(m, tbl_needed_from(m, nc, ntokens, INT64_MAX)) < r->lo)) {
            L->err_a = (int64_t)r->lo * m->block_size;
            L->err_what = "the shorter sequence would read positions whose blocks were released";
            return KVB_ESTATE;
        }
    }
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        if (m->kind != KVB_G_STATE) tbl_release_tail(m, s, r, (int32_t)blocks_for(m, ntokens));
        else if (r->room > blocks_for(m, ntokens)) r->room = blocks_for(m, ntokens); /* as a table */
        if (r->done > ntokens) r->done = ntokens;
    }
    s->ntokens = ntokens;
    if (s->ncomputed > ntokens) s->ncomputed = ntokens;
    clear_drafts(g, G, s, slot);
    if (s->nhashed > blk_of(L, ntokens)) s->nhashed = (int32_t)blk_of(L, ntokens);
    return KVB_OK;
}

/* A child shares the parent's committed blocks in every token group (a state group copies
 * its state now: the child diverges next step), and a copy of its record. */
int kvb_grp_fork(kvb_mgr_t *const *g, int32_t G, int32_t parent, int32_t *child_out) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool;
    kvb_seq_t *ps;
    KVB_CLEAR_ERR(L);
    int rc = get_seq(L, parent, 0, &ps);
    if (rc) return rc;
    int64_t need = 0; /* state groups copy the state at once */
    for (int32_t j = 0; j < G; j++) if (g[j]->kind == KVB_G_STATE) need += g[j]->span;
    if (need > p->num_free) return out_of_blocks(L, need, p->num_free);
    int32_t slot;
    if (new_slot(g, G, &slot)) return KVB_ENOMEM;
    ps = &L->seqs[parent]; /* new_slot may have moved the arrays */
    kvb_seq_t *s = &L->seqs[slot];
    if (rec_reserve(L, s, ps->ntokens, (int64_t)ps->nhashed + 1) || kvb_chain_fork(L, s, ps))
        return KVB_ENOMEM;
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        const kvb_row_t *pr = row_of(m, parent);
        int64_t nb = tbl_blocks(m, ps->ntokens);
        if (tbl_ensure_blocks(row_of(m, slot), nb)) return KVB_ENOMEM;
        if (m->kind == KVB_G_STATE) {
            if (tbl_ensure_copies(m, nb)) return KVB_ENOMEM;
            continue;
        }
        for (int64_t i = pr->lo; i < nb; i++) /* ref counts stay far below INT32_MAX */
            if (p->ref_count[pr->blocks[i]] == INT32_MAX) return KVB_ENOMEM;
    }
    take_slot(g, G, slot);
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        const kvb_row_t *pr = row_of(m, parent);
        kvb_row_t *r = row_of(m, slot);
        int64_t nb = tbl_blocks(m, ps->ntokens);
        if (m->kind == KVB_G_STATE) {
            KVB_MUST(kvb_pool_allocate(p, (int32_t)nb, r->blocks));
            for (int64_t i = 0; i < nb; i++) tbl_queue_copy(m, pr->blocks[i], r->blocks[i]);
            r->room = blocks_for(m, ps->ntokens); /* a token table's fork shares only these */
        } else {
            kvb_copy(r->blocks, pr->blocks, (size_t)nb * sizeof *r->blocks);
            r->lo = pr->lo;
            for (int64_t i = r->lo; i < nb; i++) p->ref_count[r->blocks[i]]++; /* referenced */
        }
        r->nblocks = (int32_t)nb;
        r->done = pr->done;
    }
    kvb_copy(s->tokens, ps->tokens, (size_t)ps->ntokens * sizeof *s->tokens);
    kvb_copy(s->hashes, ps->hashes, (size_t)ps->nhashed * sizeof *s->hashes);
    s->ntokens = ps->ntokens;
    s->ncomputed = ps->ncomputed;
    s->nhashed = ps->nhashed;
    s->root = ps->root;
    s->chain.tag = ps->chain.tag;
    *child_out = slot;
    return KVB_OK;
}

int kvb_grp_free(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    kvb_mgr_t *L = g[0];
    kvb_seq_t *s;
    KVB_CLEAR_ERR(L);
    int rc = get_seq(L, slot, 1, &s);
    if (rc) return rc;
    for (int32_t j = 0; j < G; j++) /* tail first: the longest prefixes are evicted first */
        tbl_release_tail(g[j], s, row_of(g[j], slot), 0);
    s->ntokens = 0;
    s->ncomputed = 0;
    s->drafted = 0;
    s->nhashed = 0;
    s->swapped = 0;
    s->gen++; /* even: free */
    s->next_free = L->free_slot;
    L->free_slot = slot;
    L->nseqs--;
    return KVB_OK;
}

/* ---- swap: every group's blocks, group after group -------------------------------------- */
int kvb_grp_swap_out(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t *pairs_out,
                     int64_t *npairs) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool, *h = L->host;
    kvb_seq_t *s;
    KVB_CLEAR_ERR(L);
    int rc = get_seq(L, slot, 0, &s);
    if (rc) return rc;
    if (!h) return KVB_ESTATE;
    int64_t need = 0; /* released entries stay null */
    for (int32_t j = 0; j < G; j++) need += row_of(g[j], slot)->nblocks - row_of(g[j], slot)->lo;
    if (need > h->num_free) return out_of_blocks(L, need, h->num_free);
    int32_t *fresh = malloc((size_t)(need ? need : 1) * sizeof *fresh);
    if (!fresh) return KVB_ENOMEM;
    KVB_MUST(kvb_pool_allocate(h, (int32_t)need, fresh));
    int64_t k = 0;
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        int32_t lo = r->lo, nb = r->nblocks - lo;
        for (int32_t i = 0; i < nb; i++) {
            int32_t b = r->blocks[lo + i]; /* a pending copy's destination reads its source */
            pairs_out[2 * (k + i)] = (p->flags[b] & KVB_F_COPY_DST) ? tbl_pending_src(m, b) : b;
            pairs_out[2 * (k + i) + 1] = fresh[k + i];
            if (p->tier) kvb_tier_swap_src(p->tier, (int32_t)pairs_out[2 * (k + i)]);
        }
        for (int32_t i = r->nblocks - 1; i >= lo; i--) kvb_pool_release(p, r->blocks[i]);
        kvb_copy(r->blocks + lo, fresh + k, (size_t)nb * sizeof *fresh);
        k += nb;
        r->tver++;
        if (KVB_UNLIKELY(m->ncopies)) tbl_drop_dead_copies(m);
    }
    free(fresh);
    *npairs = k;
    s->swapped = 1;
    clear_drafts(g, G, s, slot);
    return KVB_OK;
}

int kvb_grp_swap_in(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t *pairs_out,
                    int64_t *npairs) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool;
    kvb_seq_t *s;
    KVB_CLEAR_ERR(L);
    int rc = get_seq(L, slot, 1, &s);
    if (rc) return rc;
    if (!L->host || !s->swapped) return KVB_ESTATE;
    int64_t need = 0, nbmax = 1;
    for (int32_t j = 0; j < G; j++) {
        const kvb_row_t *r = row_of(g[j], slot);
        need = add_sat(need, tbl_swap_in_need(g[j], s, r, NULL));
        if (r->nblocks > nbmax) nbmax = r->nblocks;
    }
    if (need > p->num_free) return out_of_blocks(L, need, p->num_free);
    int32_t *dev = malloc((size_t)nbmax * sizeof *dev);
    if (!dev) return KVB_ENOMEM;
    int64_t k = 0;
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        int32_t nb = r->nblocks;
        tbl_swap_in_need(m, s, r, dev);
        for (int32_t i = 0; i < r->lo; i++) dev[i] = KVB_NULL_BLOCK;
        for (int32_t i = r->lo; i < nb; i++) /* pin every hit before allocating the rest */
            if (dev[i]) kvb_pool_pin(p, &dev[i], 1);
        for (int32_t i = r->lo; i < nb; i++) {
            if (dev[i]) continue;
            KVB_MUST(kvb_pool_allocate(p, 1, &dev[i]));
            pairs_out[2 * k] = r->blocks[i];
            pairs_out[2 * k + 1] = dev[i];
            k++;
            if (p->tier) kvb_tier_swap_dst(p->tier, dev[i]); /* filled by the swap pair */
        }
        for (int32_t i = nb - 1; i >= r->lo; i--) kvb_tier_release_host(m, &r->blocks[i], 1);
        kvb_copy(r->blocks, dev, (size_t)nb * sizeof *dev);
        r->tver++;
        int64_t ncomp = m->kind == KVB_G_STATE ? 0 : blk_of(m, r->done);
        for (int64_t i = r->lo; i < ncomp; i++) /* written by the swap pairs */
            p->flags[r->blocks[i]] |= KVB_F_WRITTEN;
        if (m->caching) tbl_cache(m, s, r, r->lo, ncomp); /* serve hits again */
    }
    free(dev);
    s->swapped = 0;
    *npairs = k;
    return KVB_OK;
}

/* ---- counting ---------------------------------------------------------------------------- */
int64_t kvb_grp_blocks_needed(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t n) {
    const kvb_seq_t *s = live_seq(g[0], slot);
    if (!s) return KVB_EUNKNOWN;
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) {
        const kvb_mgr_t *m = g[j];
        const kvb_row_t *r = row_of(m, slot);
        int64_t nj;
        if (s->swapped) {
            int64_t grow = m->kind == KVB_G_STATE ? 0 : tbl_growth(m, s->ntokens, n, r->nblocks);
            nj = add_sat(tbl_swap_in_need(m, s, r, NULL), grow);
        } else {
            nj = tbl_need_for(m, s, r, n);
        }
        need = add_sat(need, nj);
    }
    return need;
}

int kvb_grp_batch_need(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, int64_t count,
                       int64_t n, int64_t *need_out) {
    kvb_mgr_t *L = g[0];
    KVB_CLEAR_ERR(L);
    if (n < 0) { L->err_b = n; return KVB_EINVAL; }
    int64_t need = 0;
    for (int64_t i = 0; i < count; i++) {
        kvb_seq_t *s;
        int rc = get_seq(L, slots[i], 0, &s);
        if (rc) { L->err_a = i; return rc; }
        for (int32_t j = 0; j < G; j++)  /* saturates: never fits */
            need = add_sat(need, tbl_need_for(g[j], s, row_of(g[j], slots[i]), n));
    }
    L->err_a = L->err_b = 0;
    if (n > 0 && need > L->pool->num_free) { /* the quick bound does not fit: count exactly */
        need = 0;
        for (int32_t j = 0; j < G; j++) {
            int64_t nj;
            if (tbl_step_need(g[j], slots, NULL, n, NULL, NULL, count, &nj)) return KVB_ENOMEM;
            need = add_sat(need, nj);
        }
    }
    *need_out = need;
    return KVB_OK;
}

/* Blocks a scheduler's step takes in all groups (BlockManager.blocks_needed_batch). Validation
 * first: unknown, repeated or swapped-out sequences, negative counts. */
int kvb_grp_step_need(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, const int64_t *ns,
                      const int64_t *cn, const int64_t *forks, int64_t count,
                      int64_t *need_out) {
    kvb_mgr_t *L = g[0];
    KVB_CLEAR_ERR(L);
    int rc = batch_check(L, slots, count);
    if (rc) return rc;
    for (int64_t i = 0; i < count; i++) {
        if (ns[i] < 0 || cn[i] < 0 || (forks && forks[i] < 0)) {
            L->err_a = i;
            L->err_b = ns[i] < 0 ? ns[i] : cn[i] < 0 ? cn[i] : forks[i];
            return KVB_EINVAL;
        }
    }
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) {
        int64_t nj = 0;
        if (tbl_step_need(g[j], slots, ns, 0, cn, forks, count, &nj)) return KVB_ENOMEM;
        need = add_sat(need, nj);
    }
    *need_out = need;
    return KVB_OK;
}

/* ---- queries ----------------------------------------------------------------------------- */
int64_t kvb_grp_table_blocks(kvb_mgr_t *const *g, int32_t G, int64_t n) {
    int64_t b = n > 0 ? blk_of(g[0], n - 1) + 1 : 0, total = 0; /* no overflow up to INT64_MAX */
    for (int32_t j = 0; j < G; j++) total = add_sat(total, g[j]->kind == KVB_G_STATE ? g[j]->span : b);
    return total;
}

int64_t kvb_grp_held(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    int64_t n = 0;
    for (int32_t j = 0; j < G; j++) n += row_of(g[j], slot)->nblocks - row_of(g[j], slot)->lo;
    return n;
}

int64_t kvb_grp_num_computed(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    (void)G;
    return g[0]->seqs[slot].ncomputed;
}

int64_t kvb_grp_num_copies(kvb_mgr_t *const *g, int32_t G) {
    int64_t n = 0;
    for (int32_t j = 0; j < G; j++) n += g[j]->ncopies;
    return n;
}

const kvb_seq_t *kvb_grp_seq(kvb_mgr_t *const *g, int32_t slot) { return &g[0]->seqs[slot]; }

const kvb_row_t *kvb_grp_row(kvb_mgr_t *const *g, int32_t j, int32_t slot) {
    return row_of(g[j], slot);
}

int64_t kvb_grp_hashes(kvb_mgr_t *const *g, int32_t j, int32_t slot, kvb_hash_t *out) {
    const kvb_seq_t *s = &g[0]->seqs[slot];
    for (int64_t i = 0; i < s->nhashed; i++) out[i] = gkey(g[j], s, i);
    return s->nhashed;
}

/* ---- the drain --------------------------------------------------------------------------- */
int kvb_grp_take_copies(kvb_mgr_t *const *g, int32_t G, int64_t *out, int64_t cap,
                        int64_t *n_out) {
    kvb_mgr_t *m = g[0];
    KVB_CLEAR_ERR(m);
    kvb_tier_t *t = m->pool->tier;
    if (t && (t->noff || t->non || kvb_tier_unflushed(t))) {
        m->err_a = t->noff + t->pool->log->nev;
        m->err_b = t->non;
        m->err_what = "host-tier offloads or onloads are pending (take_offloads, take_onloads)";
        return KVB_EPENDING;
    }
    int64_t need = kvb_grp_num_copies(g, G);
    if (cap < need) {
        m->err_a = need;
        m->err_b = cap;
        m->err_what = "copy pairs";
        return KVB_ERANGE;
    }
    int64_t k = 0;
    for (int32_t j = 0; j < G; j++)
        if (g[j]->ncopies) k += tbl_take_copies(g[j], out + 2 * k);
    *n_out = k;
    return KVB_OK;
}

/* ---- check ------------------------------------------------------------------------------- */
#define MFAIL(what, item) do { L->err_what = (what); L->err_a = i; L->err_b = (item); \
                               rc = KVB_ECORRUPT; goto done; } while (0)

/* The records once: capacities, counts, each hash against its tokens, the slot stack. */
static int check_records(kvb_mgr_t *L) {
    int rc;
    int64_t i = 0, live = 0, nfree = 0;
    for (i = 0; i < L->scap; i++) {
        const kvb_seq_t *s = &L->seqs[i];
        if (!(s->gen & 1u)) { nfree++; continue; }
        live++;
        if (s->ntokens > s->tcap) MFAIL("tokens beyond capacity", s->ntokens);
        if (s->ncomputed < 0 || s->ncomputed > s->ntokens)
            MFAIL("computed tokens outside [0, committed]", s->ncomputed);
        if (s->nhashed != (L->hashing ? blk_of(L, s->ntokens) : 0))
            MFAIL("hashes known != full blocks", s->nhashed);
        for (int32_t j = 0; j < s->nhashed; j++) {
            kvb_hash_t h;
            kvb_chain_block(L, s, j, &h);
            if (h.lo != s->hashes[j].lo || h.hi != s->hashes[j].hi)
                MFAIL("block hash does not match its tokens", j);
        }
    }
    i = 0;
    if (live != L->nseqs) MFAIL("live slots != nseqs", live);
    int64_t stack = 0;
    for (int32_t k = L->free_slot; k != KVB_NONE; k = L->seqs[k].next_free) {
        if (L->seqs[k].gen & 1u) MFAIL("free-slot stack holds a live slot", k);
        if (++stack > L->scap) MFAIL("free-slot stack has a cycle", k);
    }
    if (stack != nfree) MFAIL("free-slot stack length != free slots", stack);
    rc = KVB_OK;
done:
    return rc;
}

/* Pools first, then the records, then every group's rows; the ref counts must equal the sum
 * of what all groups hold. */
int kvb_grp_check(kvb_mgr_t *const *g, int32_t G) {
    kvb_mgr_t *L = g[0];
    kvb_pool_t *p = L->pool;
    int rc = kvb_pool_check(p);
    if (rc) { L->err_what = p->err_what; L->err_a = p->err_a; L->err_b = p->err_b; return rc; }
    if (L->host && (rc = kvb_pool_check(L->host))) {
        L->err_what = L->host->err_what; L->err_a = L->host->err_a; L->err_b = L->host->err_b;
        return rc;
    }
    KVB_CLEAR_ERR(L);
    if ((rc = check_records(L))) return rc;
    int32_t *refs = calloc((size_t)p->num_blocks, sizeof *refs);
    int32_t *hrefs = L->host ? calloc((size_t)L->host->num_blocks, sizeof *hrefs) : NULL;
    if (!refs || (L->host && !hrefs)) {
        free(refs); free(hrefs);
        return KVB_ENOMEM;
    }
    int64_t ncopies = 0, i = 0;
    for (int32_t k = 0; k < G; k++) {
        ncopies += g[k]->ncopies;
        if (g[k]->lead != L) MFAIL("a group is not linked to the lead", k);
        if ((rc = tbl_check(g[k], refs, hrefs))) {
            fail_from(g, k, rc);
            goto done;
        }
    }
    if ((rc = kvb_tier_check(g, G, refs, hrefs))) goto done; /* host tier holds (tier.c) */
    for (int32_t b = 1; b < p->num_blocks; b++) {
        if (refs[b] != p->ref_count[b]) MFAIL("ref count != references held", b);
        if ((p->flags[b] & (KVB_F_COPY_SRC | KVB_F_COPY_DST)) && !ncopies)
            MFAIL("copy flag without a pending copy", b);
    }
    if (L->host)
        for (int32_t b = 1; b < L->host->num_blocks; b++)
            if (hrefs[b] != L->host->ref_count[b]) MFAIL("host ref count != references held", b);
    rc = KVB_OK;
done:
    free(refs);
    free(hrefs);
    return rc;
}
