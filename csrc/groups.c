/* groups.c -- KV cache groups: the lead, each group's tag, and the pool's eviction rule for
 * the groups. The calls over the groups are manager.c's; each group's rules are table.c's.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Group g's block hash is the record's chain hash of the block XOR a secret 128-bit tag,
 * SipHash(key, "kvblocks:group:" g): identical tokens in two groups never share a cache
 * entry, and the hash of a block is computed once for all groups (chain.c). In the
 * 256-bit modes the key is the engine's hash XOR the tag too (vLLM keys a block by its hash
 * and group id), one SHA-256 per block for all groups as well; the pools' events untag it
 * (kvb_pool_t.gtag). */
void kvb_group_tag(const uint8_t key[16], uint8_t gidx, kvb_hash_t *out) {
    if (!gidx) { out->lo = out->hi = 0; return; }
    uint8_t msg[16] = "kvblocks:group:";
    msg[15] = gidx;
    kvb_siphash128(key, msg, sizeof msg, out);
}

int kvb_grp_link(kvb_mgr_t *const *g, int32_t G) {
    int32_t anchor = -1, windowed = 0;
    kvb_mgr_t *L = g[0];
    L->hashing = 0;
    L->grp = g;
    L->ngrp = G;
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        m->lead = L; /* the sequences live in the lead's records; each group keeps rows */
        kvb_group_tag(L->key, m->gidx, &m->tag);
        L->hashing |= m->caching; /* one chain for every group: each XORs its tag */
        if (m->kind == KVB_G_FULL && anchor < 0) anchor = j;
        windowed |= m->kind == KVB_G_WINDOW || m->kind == KVB_G_CHUNK;
    }
    for (int32_t j = 1; j < G; j++) {
        kvb_mgr_t *m = g[j];
        int64_t cap = m->rcap, old = cap;
        if (kvb_grow((void **)&m->rows, &cap, L->scap, sizeof *m->rows)) return KVB_ENOMEM;
        if (cap > old) memset(m->rows + old, 0, (size_t)(cap - old) * sizeof *m->rows);
        m->rcap = (int32_t)cap;
    }
    kvb_pool_t *p = g[0]->pool;
    if (G > 1 && g[0]->hash_algo != KVB_HASH_SIPHASH) { /* keys (hash, group): events untag */
        kvb_pool_t *pools[2] = {p, g[0]->host};
        for (int i = 0; i < 2; i++) {
            if (!pools[i] || pools[i]->gtag) continue;
            pools[i]->gtag = calloc(256, sizeof *pools[i]->gtag);
            if (!pools[i]->gtag) return KVB_ENOMEM;
            for (int32_t j = 0; j < G; j++) pools[i]->gtag[g[j]->gidx] = g[j]->tag;
        }
    }
    if (!p->caching || anchor < 0 || !windowed) return KVB_OK;
    kvb_twins_t *tw = calloc(1, sizeof *tw);
    if (tw) tw->spent = calloc((size_t)p->num_blocks, 1);
    if (!tw || !tw->spent) {
        free(tw);
        return KVB_ENOMEM;
    }
    tw->anchor = g[anchor]->gidx;
    for (int32_t j = 0; j < G; j++) {
        tw->tag[g[j]->gidx] = g[j]->tag;
        tw->keep[g[j]->gidx] = g[j]->kind == KVB_G_WINDOW || g[j]->kind == KVB_G_CHUNK;
    }
    kvb_policy_twins(p, tw); /* the pool's eviction order from now on (policy.c) */
    return KVB_OK;
}

/* Every group's hash mode (kvb_mgr_set_hash), then the links (kvb_grp_link). */
int kvb_grp_set_hash(kvb_mgr_t *const *g, int32_t G, int32_t algo, const uint8_t none_hash[32]) {
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_set_hash(g[j], algo, none_hash);
        if (rc) {
            g[0]->err_a = g[j]->err_a;
            g[0]->err_b = g[j]->err_b;
            g[0]->err_what = g[j]->err_what;
            return rc;
        }
    }
    return kvb_grp_link(g, G);
}


/* ---- a manager's groups on the heap ------------------------------------------------------ */
/* The binding's handle: g[0..G) point into one array of G groups, each initialised over the
 * same pools (kvb_mgr_init); kinds and hashes come next (kvb_mgr_set_kind, kvb_grp_set_hash). */
int kvb_grp_new(kvb_mgr_t ***out, int32_t G, kvb_pool_t *pool, kvb_pool_t *host,
                int32_t block_size, const uint8_t key[16]) {
    *out = NULL;
    if (G < 1) return KVB_EINVAL;
    kvb_mgr_t **g = calloc((size_t)G, sizeof *g);
    kvb_mgr_t *a = calloc((size_t)G, sizeof *a);
    if (!g || !a) {
        free(g);
        free(a);
        return KVB_ENOMEM;
    }
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_init(&a[j], pool, host, block_size, key);
        if (rc) {
            while (j--) kvb_mgr_destroy(&a[j]);
            free(a);
            free(g);
            return rc;
        }
        g[j] = &a[j];
    }
    *out = g;
    return KVB_OK;
}

/* Free what kvb_grp_new made (g may be NULL); group 0 frees the host tier. */
void kvb_grp_delete(kvb_mgr_t **g, int32_t G) {
    if (!g) return;
    for (int32_t j = 0; j < G; j++) kvb_mgr_destroy(g[j]);
    free(g[0]);
    free(g);
}
