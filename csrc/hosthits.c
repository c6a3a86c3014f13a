/* hosthits.c -- host-tier prefix hits with KV cache groups (and one group that is not full).
 *
 * The rule is the device rule of manager.c on the union of the two tiers. Block i of group j is
 * available when the group's hash of it is cached on the device or on the host; a hit of k
 * blocks needs in each group what the query at k * bs reads (table.c, hit_lo): all of [0, k)
 * in a full group, [hit_lo(k), k) in a window or chunk group (the entries below stay null).
 * The joint hit is the longest k every group serves. A state group caches nothing and serves
 * no hit, on the device or on the host, so with one there is no host hit either.
 *
 * A joint hit longer than the device-only one is taken only when it fits, else add() and
 * probe() keep the device-only hit, decided before anything changes:
 *   - its blocks fit the free count: per group, fresh blocks for every position the group
 *     holds that is not cached on the device (the onloads' destinations among them), plus the
 *     evictable device hits pinned (they leave the free list);
 *   - every fresh block a swap pair of the coming drain reads or writes (KVB_F_NOT_ONLOAD,
 *     tier.c) can go to a position the forward computes: at most that many such blocks are
 *     free (counted from the tier's in-flight and swap-source lists), or at most as many as
 *     there are computed positions, over all groups together (fresh blocks of one pool trade
 *     places across groups).
 * Then, as on the device: every group pins its device hits, the host hits are pinned on the
 * host, every group allocates its fresh blocks, the trade, and one (host, device) onload per
 * host-only position of each group (the device blocks enter the cache at once, under the
 * group's hash and group id, flagged written and in flight). A window group onloads only the
 * blocks its window needs: the others are null entries, as they are for a device hit.
 *
 * Counters: the pool's query counters take the device-only hit (as with one group, where the
 * device prefix is the device's share); the tier's hit_blocks and hit tokens take the rest of
 * the joint hit, its onloads every copy queued (in all groups).
 */
#include <stdlib.h>
#include <string.h>

#include "table.h"

typedef struct {
    int64_t k, kdev, K;        /* the joint hit, the device-only one, the positions scanned */
    int64_t need;              /* blocks the joint hit takes from the free pool */
    int64_t fresh, onl;        /* fresh device blocks (all groups), onloads among them */
    int32_t *dev, *hst;        /* [G * K] group j's block i on the device / host, or KVB_NONE */
    int32_t *buf;              /* [fresh] allocation scratch */
    int32_t **pos;             /* [fresh] the table entries taking them: onloads first */
} plan_t;

static void plan_free(plan_t *pl) {
    free(pl->dev);
    free(pl->hst);
    free(pl->buf);
    free(pl->pos);
    pl->dev = pl->hst = pl->buf = NULL;
    pl->pos = NULL;
}

/* Free blocks (ref 0) a swap pair of the coming drain reads or writes: each is listed once in
 * the in-flight list, or in the swap-source list when not in flight. */
static int64_t free_not_onload(const kvb_tier_t *t) {
    const kvb_pool_t *p = t->pool;
    int64_t c = 0;
    for (int64_t i = 0; i < t->inflight.n; i++) c += p->ref_count[t->inflight.ids[i]] == 0;
    for (int64_t i = 0; i < t->swapsrc.n; i++) {
        int32_t b = t->swapsrc.ids[i];
        c += p->ref_count[b] == 0 && !(p->flags[b] & KVB_F_INFLIGHT);
    }
    return c;
}

/* The joint hit with the host for a prepared add (the prompt hashed in the free slot):
 * pl->k > kdev when a longer hit is taken, with everything add needs reserved; pl->k == kdev
 * otherwise. Only the tier's pending demotions are flushed (not observable). */
static int plan(kvb_mgr_t *const *g, int32_t G, int64_t n, int64_t kdev, plan_t *pl) {
    kvb_pool_t *p = g[0]->pool;
    kvb_tier_t *t = p->tier;
    memset(pl, 0, sizeof *pl);
    pl->k = pl->kdev = kdev;
    int64_t K = n > 0 ? blk_of(g[0], n - 1) : 0;
    if (!t || K <= kdev) return KVB_OK;
    for (int32_t j = 0; j < G; j++)
        if (!g[j]->caching) return KVB_OK; /* a state group: no hit at all */
    kvb_tier_flush(t); /* a prefix evicted a moment ago is on the host now */
    size_t cells = (size_t)G * (size_t)K;
    uint8_t *ok = malloc((size_t)K + 1);
    pl->dev = malloc(cells * sizeof *pl->dev);
    pl->hst = malloc(cells * sizeof *pl->hst);
    if (!ok || !pl->dev || !pl->hst) {
        free(ok);
        plan_free(pl);
        return KVB_ENOMEM;
    }
    pl->K = K;
    memset(ok, 1, (size_t)K + 1);
    const kvb_seq_t *s = &g[0]->seqs[g[0]->free_slot]; /* the prepared record */
    for (int32_t j = 0; j < G; j++) {
        const kvb_mgr_t *m = g[j];
        int32_t *dv = pl->dev + (size_t)j * (size_t)K, *hv = pl->hst + (size_t)j * (size_t)K;
        int64_t trail = 0; /* available blocks ending at block i */
        for (int64_t i = 0; i < K; i++) {
            kvb_hash_t h = gkey(m, s, i);
            dv[i] = kvb_cache_find(p, &h);
            hv[i] = dv[i] == KVB_NONE ? kvb_cache_find(t->host, &h) : KVB_NONE;
            trail = dv[i] == KVB_NONE && hv[i] == KVB_NONE ? 0 : trail + 1;
            if (trail < i + 1 - tbl_hit_lo(m, n, i + 1)) ok[i + 1] = 0;
        }
    }
    int64_t k = K;
    while (k > kdev && !ok[k]) k--;
    free(ok);
    int64_t need = 0, fresh = 0, onl = 0;
    for (int32_t j = 0; j < G && k > kdev; j++) {
        const kvb_mgr_t *m = g[j];
        const int32_t *dv = pl->dev + (size_t)j * (size_t)K;
        int64_t h = 0, ev = 0;
        for (int64_t i = tbl_hit_lo(m, n, k); i < k; i++) {
            if (dv[i] != KVB_NONE) ev += p->ref_count[dv[i]] == 0;
            else h++;
        }
        int64_t fj = tbl_blocks(m, n) - k + h;
        fresh += fj;
        onl += h;
        need = add_sat(need, add_sat(fj, ev));
    }
    int64_t bad = k > kdev ? free_not_onload(t) : 0;
    if (k <= kdev || need > p->num_free || (bad < fresh ? bad : fresh) > fresh - onl) {
        plan_free(pl); /* the device-only hit stands */
        return KVB_OK;
    }
    pl->buf = malloc((size_t)fresh * sizeof *pl->buf + 1);
    pl->pos = malloc((size_t)fresh * sizeof *pl->pos + 1);
    if (!pl->buf || !pl->pos ||
        kvb_grow((void **)&t->on, &t->oncap, 2 * (t->non + onl), sizeof *t->on)) {
        plan_free(pl);
        return KVB_ENOMEM;
    }
    pl->k = k;
    pl->need = need;
    pl->fresh = fresh;
    pl->onl = onl;
    return KVB_OK;
}

int kvb_hh_probe(kvb_mgr_t *const *g, int32_t G, int64_t n, int64_t kdev, int64_t *cached_out,
                 int64_t *need_out) {
    plan_t pl;
    int rc = plan(g, G, n, kdev, &pl);
    if (rc) return rc;
    if (pl.k > kdev) {
        *cached_out = pl.k * g[0]->block_size;
        *need_out = pl.need;
    }
    plan_free(&pl);
    return KVB_OK;
}

int kvb_hh_add(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n, int64_t kdev,
               int recompute, int32_t *slot_out, int64_t *cached_out) {
    plan_t pl;
    int rc = plan(g, G, n, kdev, &pl);
    if (rc) return rc;
    if (pl.k <= kdev) return 0;
    kvb_pool_t *p = g[0]->pool;
    kvb_tier_t *t = p->tier;
    int64_t k = pl.k, K = pl.K;
    int32_t slot = g[0]->free_slot;
    for (int32_t j = 0; j < G; j++) { /* device hits in the table, 0 for the host's */
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        const int32_t *dv = pl.dev + (size_t)j * (size_t)K;
        for (int64_t i = tbl_hit_lo(m, n, k); i < k; i++)
            r->blocks[i] = dv[i] != KVB_NONE ? dv[i] : 0;
    }
    mgr_add_pin(g, G, tokens, n, k, slot); /* every group pins its device hits */
    mgr_add_stats(g[0], n, kdev, recompute);
    const kvb_seq_t *s = &g[0]->seqs[slot];
    for (int32_t j = 0; j < G; j++) { /* and the host hits, before demotions need room */
        const int32_t *hv = pl.hst + (size_t)j * (size_t)K;
        const kvb_row_t *r = row_of(g[j], slot);
        for (int64_t i = tbl_hit_lo(g[j], n, k); i < k; i++)
            if (!r->blocks[i]) kvb_pool_pin(g[j]->host, &hv[i], 1);
    }
    int64_t a = 0, c = pl.onl; /* pos: onload entries [0, onl), computed ones after */
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        int64_t lo = tbl_hit_lo(m, n, k), total = tbl_blocks(m, n), h = 0;
        for (int64_t i = lo; i < k; i++) h += !r->blocks[i];
        KVB_MUST(kvb_pool_allocate(p, (int32_t)(total - k + h), pl.buf));
        int64_t u = 0;
        for (int64_t i = lo; i < k; i++)
            if (!r->blocks[i]) {
                r->blocks[i] = pl.buf[u++];
                pl.pos[a++] = &r->blocks[i];
            }
        for (int64_t i = k; i < total; i++) {
            r->blocks[i] = pl.buf[u++];
            pl.pos[c++] = &r->blocks[i];
        }
        r->nblocks = (int32_t)total;
    }
    KVB_ASSERT(a == pl.onl && c == pl.fresh);
    for (int64_t i = 0, x = pl.onl; i < pl.onl; i++) { /* the trade (counted in plan) */
        if (!(p->flags[*pl.pos[i]] & KVB_F_NOT_ONLOAD)) continue;
        while (x < pl.fresh && (p->flags[*pl.pos[x]] & KVB_F_NOT_ONLOAD)) x++;
        KVB_ASSERT(x < pl.fresh);
        int32_t b = *pl.pos[i];
        *pl.pos[i] = *pl.pos[x];
        *pl.pos[x++] = b;
    }
    for (int32_t j = 0; j < G; j++) { /* the onloads, group after group, in table order */
        kvb_mgr_t *m = g[j];
        kvb_row_t *r = row_of(m, slot);
        const int32_t *dv = pl.dev + (size_t)j * (size_t)K, *hv = pl.hst + (size_t)j * (size_t)K;
        for (int64_t i = tbl_hit_lo(m, n, k); i < k; i++)
            if (dv[i] == KVB_NONE) kvb_tier_onload_at(m, s, r, i, hv[i]);
    }
    int64_t tokens_hit = (k - kdev) * g[0]->block_size;
    t->stats.hit_blocks += (uint64_t)(k - kdev);
    if (recompute) t->stats.recompute_hit_tokens += (uint64_t)tokens_hit;
    else t->stats.hit_tokens += (uint64_t)tokens_hit;
    plan_free(&pl);
    *slot_out = slot;
    *cached_out = k * g[0]->block_size;
    return 1;
}
