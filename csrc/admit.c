/* admit.c -- a manager's add and probe: a prompt's longest prefix every KV cache group can
 * serve from the cache (the device's; with a host tier, hosthits.c's joint hit on both),
 * pinned, and the rest allocated (manager.h). */
#include <stdlib.h>
#include <string.h>

#include "manager.h"

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
        if (total >= p->num_blocks) return mgr_out_of_blocks(L, total, p->num_free);
    }
    int32_t slot;
    if (mgr_new_slot(g, G, &slot)) return KVB_ENOMEM;
    kvb_seq_t *s = &L->seqs[slot];
    if (mgr_rec_reserve(L, s, n, full + 1)) return KVB_ENOMEM;
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
    mgr_take_slot(g, G, slot);
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
    mgr_sync_computed(L, s, slot);
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
    if (need > p->num_free) return mgr_out_of_blocks(L, need, p->num_free);
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
