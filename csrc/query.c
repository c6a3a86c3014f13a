/* query.c -- what the Python binding reads of a manager, as functions: the error detail of a
 * group, counts and a record's generation and swap state, a row, the tokens or the hashes of
 * a sequence copied out, and the host tier's pending pairs and counters. The binding names
 * no field of kvb_mgr_t, kvb_seq_t, kvb_row_t or kvb_tier_t (mimalloc's line between the
 * public functions and the internal structs); engines in C use capi.c instead.
 *
 * Nothing here changes state. The per-slot queries take a live slot (the binding resolved it
 * under its call guard) and do not check it, like the queries of manager.c.
 */
#include "internal.h"

const char *kvb_mgr_err(const kvb_mgr_t *m, int64_t *a, int64_t *b) {
    *a = m->err_a;
    *b = m->err_b;
    return m->err_what;
}

int32_t kvb_grp_nseqs(kvb_mgr_t *const *g) { return g[0]->nseqs; }
int32_t kvb_grp_block_size(kvb_mgr_t *const *g) { return g[0]->block_size; }
int32_t kvb_grp_hash_algo(kvb_mgr_t *const *g) { return g[0]->hash_algo; }
int32_t kvb_grp_kind(kvb_mgr_t *const *g, int32_t j) { return g[j]->kind; }
int kvb_grp_swapped(kvb_mgr_t *const *g, int32_t slot) { return g[0]->seqs[slot].swapped; }
int64_t kvb_grp_num_tokens(kvb_mgr_t *const *g, int32_t slot) {
    return g[0]->seqs[slot].ntokens;
}

void kvb_grp_gens(kvb_mgr_t *const *g, const int32_t *slots, int64_t n, uint32_t *out) {
    for (int64_t i = 0; i < n; i++) out[i] = g[0]->seqs[slots[i]].gen;
}

int64_t kvb_grp_stale(kvb_mgr_t *const *g, const int32_t *slots, const uint32_t *gens,
                      int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (g[0]->seqs[slots[i]].gen != gens[i]) return i;
    return -1;
}

int64_t kvb_grp_read(kvb_mgr_t *const *g, int32_t j, int32_t slot, int32_t what, void *out) {
    const kvb_seq_t *s = &g[0]->seqs[slot];
    if (what == KVB_READ_TABLE) {
        const kvb_row_t *r = row_of(g[j], slot);
        if (out) kvb_copy(out, r->blocks, (size_t)r->nblocks * sizeof *r->blocks);
        return r->nblocks;
    }
    if (what == KVB_READ_TOKENS) {
        if (out) kvb_copy(out, s->tokens, (size_t)s->ntokens * sizeof *s->tokens);
        return s->ntokens;
    }
    if (!g[j]->caching) return 0; /* KVB_READ_HASHES: none in a state group or without caching */
    if (out && g[0]->hash_algo == KVB_HASH_SIPHASH) {
        kvb_hash_t *h = out; /* the group's keys: the chain XOR its tag */
        for (int64_t i = 0; i < s->nhashed; i++) h[i] = gkey(g[j], s, i);
    } else if (out) { /* 256-bit modes: the engine's own hashes (a block's key: hash, group) */
        kvb_copy(out, s->hashes, (size_t)s->nhashed * sizeof *s->hashes);
    }
    return s->nhashed;
}

kvb_tier_t *kvb_grp_tier(kvb_mgr_t *const *g) { return g[0]->pool->tier; }

void kvb_tier_pending(const kvb_tier_t *t, int64_t *noff, int64_t *non) {
    *noff = t ? t->noff : 0;
    *non = t ? t->non : 0;
}

int kvb_tier_write_through(const kvb_tier_t *t) { return t && t->write_through; }

const kvb_tier_stats_t *kvb_tier_stats(const kvb_tier_t *t) { return &t->stats; }
