/* groups.c -- KV cache groups: several managers (one per group of layers, table.c) over one
 * pool, driven in lock step so that a sequence has the same slot in every group.
 *
 * Each entry point validates in every group and counts the blocks all groups take together
 * before the first group mutates, so a failed call changes nothing (window release aside: it
 * drops only blocks no query can read, see table.c). Errors are reported in g[0]'s fields.
 * One group (the default) never comes here: BlockManager calls table.c directly.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

static int fail_from(kvb_mgr_t *const *g, int32_t k, int rc) {
    if (k) {
        g[0]->err_a = g[k]->err_a;
        g[0]->err_b = g[k]->err_b;
        g[0]->err_what = g[k]->err_what;
    }
    return rc;
}

static int out_of_blocks(kvb_mgr_t *m, int64_t need, int64_t have) {
    m->err_a = need;
    m->err_b = have;
    m->err_what = NULL;
    return KVB_EOUTOFBLOCKS;
}

KVB_INLINE int64_t add_sat(int64_t a, int64_t b) { /* a, b >= 0 */
    return b > INT64_MAX - a ? INT64_MAX : a + b;
}

/* Group g's block hash is the group-0 chain hash of the block XOR a secret 128-bit tag,
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
    const kvb_mgr_t *src = NULL;
    int32_t anchor = -1, windowed = 0;
    for (int32_t j = 0; j < G; j++) {
        kvb_mgr_t *m = g[j];
        kvb_group_tag(g[0]->key, m->gidx, &m->tag);
        m->hsrc = m->caching ? src : NULL; /* every mode: one chain, XOR each group's tag */
        if (m->hsrc) {
            m->hxor.lo = src->tag.lo ^ m->tag.lo;
            m->hxor.hi = src->tag.hi ^ m->tag.hi;
        }
        if (m->caching && !src) src = m;
        if (m->kind == KVB_G_FULL && anchor < 0) anchor = j;
        windowed |= m->kind == KVB_G_WINDOW || m->kind == KVB_G_CHUNK;
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

/* ---- add and probe: the longest prefix every group can serve ---------------------------- */
static int prepare_all(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                       const uint8_t *salt, size_t salt_len, int64_t *k_out, int64_t *need_out) {
    kvb_mgr_t *m = g[0];
    KVB_CLEAR_ERR(m);
    if (n < 0) { m->err_b = n; return KVB_EINVAL; }
    int64_t K = n > 0 ? blk_of(m, n - 1) : 0;
    uint8_t *ok = malloc((size_t)K + 1);
    if (!ok) return KVB_ENOMEM;
    memset(ok, 1, (size_t)K + 1);
    for (int32_t j = 0; j < G; j++)
        if (kvb_mgr_new_slot(g[j])) { free(ok); return KVB_ENOMEM; }
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_add_prepare(g[j], tokens, n, salt, salt_len, ok, K);
        if (rc) { free(ok); return fail_from(g, j, rc); }
    }
    int64_t k = K;
    while (k > 0 && !ok[k]) k--;
    free(ok);
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) need = add_sat(need, kvb_mgr_add_need(g[j], n, k));
    *k_out = k;
    *need_out = need;
    return KVB_OK;
}

static int grp_add(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                   const uint8_t *salt, size_t salt_len, int recompute, int32_t *slot_out,
                   int64_t *cached_out) {
    int64_t k, need;
    int rc = prepare_all(g, G, tokens, n, salt, salt_len, &k, &need);
    if (rc) return rc;
    kvb_pool_t *p = g[0]->pool;
    if (p->tier) { /* a longer hit with the host tier, when it fits (hosthits.c) */
        rc = kvb_hh_add(g, G, tokens, n, k, recompute, slot_out, cached_out);
        if (rc) return rc > 0 ? KVB_OK : rc;
    }
    if (need > p->num_free) return out_of_blocks(g[0], need, p->num_free);
    int32_t slot = 0;
    for (int32_t j = 0; j < G; j++) { /* every group pins its hits before any allocates */
        int32_t sj;
        kvb_mgr_add_pin(g[j], tokens, n, k, j == 0, recompute, &sj);
        KVB_ASSERT(j == 0 || sj == slot);
        slot = sj;
    }
    for (int32_t j = 0; j < G; j++) kvb_mgr_add_fill(g[j], slot);
    *slot_out = slot;
    *cached_out = k * g[0]->block_size;
    return KVB_OK;
}

static int grp_probe(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                     const uint8_t *salt, size_t salt_len, int64_t *cached_out,
                     int64_t *need_out) {
    int64_t k, need;
    int rc = prepare_all(g, G, tokens, n, salt, salt_len, &k, &need);
    if (rc) return rc;
    *cached_out = k * g[0]->block_size;
    *need_out = need;
    return g[0]->pool->tier ? kvb_hh_probe(g, G, n, k, cached_out, need_out) : KVB_OK;
}

/* ---- one group's add and probe (the public calls; the work is table.c's) ----------------- */
/* One group whose kind has window / chunk hits takes the grouped rule with the host tier
 * (host hits by its rule, hosthits.c); everything else is table.c's single-group path. */
int kvb_mgr_add(kvb_mgr_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                size_t salt_len, int recompute, int32_t *slot_out, int64_t *cached_out) {
    if (m->pool->tier && m->kind != KVB_G_FULL)
        return grp_add(&m, 1, tokens, n, salt, salt_len, recompute, slot_out, cached_out);
    return kvb_mgr_add_one(m, tokens, n, salt, salt_len, recompute, slot_out, cached_out);
}

int kvb_mgr_probe(kvb_mgr_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                  size_t salt_len, int64_t *cached_out, int64_t *need_out) {
    if (m->kind == KVB_G_FULL)
        return kvb_mgr_probe_one(m, tokens, n, salt, salt_len, cached_out, need_out);
    KVB_CLEAR_ERR(m);
    if (n < 0) { m->err_b = n; return KVB_EINVAL; }
    return grp_probe(&m, 1, tokens, n, salt, salt_len, cached_out, need_out);
}

/* ---- growth ----------------------------------------------------------------------------- */
/* Growth counts what window release frees (gain) but releases only once the call fits, and
 * then in every group before any group allocates: a group that allocates first must not
 * depend on blocks a later group has not released yet. */
static int grp_append(kvb_mgr_t *const *g, int32_t G, int32_t slot, const int32_t *tokens,
                      int64_t n, int computed) {
    int64_t need = 0, gain = 0;
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_append_check(g[j], slot, n, computed);
        if (rc) return fail_from(g, j, rc);
        need = add_sat(need, kvb_mgr_blocks_needed(g[j], slot, n));
        gain += kvb_mgr_release_gain(g[j], slot, n); /* at most the pool's blocks */
    }
    kvb_pool_t *p = g[0]->pool;
    if (need > p->num_free + gain) return out_of_blocks(g[0], need, p->num_free + gain);
    for (int32_t j = 0; j < G; j++) kvb_mgr_move_release(g[j], slot, n);
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_append(g[j], slot, tokens, n, computed);
        if (rc) return fail_from(g, j, rc); /* only from the first group (same state) */
    }
    return KVB_OK;
}

/* The decode step over every group. Every group releases (window, chunk) before any group
 * allocates, once the step is known to fit: validation first, then the fast bound (one token
 * takes at most one block per sequence and growing group: a new block or one copy-on-write
 * copy), and only when that bound does not fit an exact count with what release frees. */
/* Blocks appending n tokens to each of slots takes in all groups together: each group's
 * quick bound first; exact counts (kvb_mgr_batch_need is exact only against its own group's
 * share of the pool) when their sum exceeds `room`. */
static int need_all(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, int64_t count,
                    int64_t n, int64_t room, int64_t *need_out) {
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) {
        int64_t nj = 0;
        int rc = kvb_mgr_batch_need(g[j], slots, count, n, &nj);
        if (rc) return fail_from(g, j, rc);
        need = add_sat(need, nj);
    }
    if (need > room) {
        need = 0;
        for (int32_t j = 0; j < G; j++) {
            int64_t nj = 0;
            if (kvb_mgr_batch_need_exact(g[j], slots, count, n, &nj)) return KVB_ENOMEM;
            need = add_sat(need, nj);
        }
    }
    *need_out = need;
    return KVB_OK;
}

static int grp_append_batch(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                            const int32_t *tokens, int64_t n) {
    kvb_pool_t *p = g[0]->pool;
    int64_t growing = 0;
    for (int32_t j = 0; j < G; j++) growing += g[j]->kind != KVB_G_STATE;
    /* One token takes at most one block per sequence and growing group (a new block or one
     * copy-on-write copy); only when that bound does not fit is the step counted exactly.
     * Then two passes per group: prepare (window groups release) in every group, commit in
     * every group, so every release comes before any allocation. Validation comes before any
     * release: in the first group's prepare, or on its own when that group releases or the
     * count needs it. */
    int tight = n > p->num_free / (growing ? growing : 1);
    int first_releases = g[0]->kind == KVB_G_WINDOW || g[0]->kind == KVB_G_CHUNK;
    int rc = first_releases || tight ? kvb_mgr_batch_check(g[0], slots, n) : KVB_OK;
    if (rc) return rc;
    if (tight) {
        int64_t need = 0, gain = 0;
        for (int32_t j = 0; j < G; j++)
            for (int64_t i = 0; i < n; i++) gain += kvb_mgr_release_gain(g[j], slots[i], 1);
        rc = need_all(g, G, slots, n, 1, p->num_free + gain, &need);
        if (rc) return rc;
        if (need > p->num_free + gain) return out_of_blocks(g[0], need, p->num_free + gain);
    }
    int validate = !first_releases && !tight;
    int32_t j = 0;
    for (; j < G && !rc; j++) rc = kvb_mgr_batch_prepare(g[j], slots, n, validate && !j);
    for (int32_t k = 0; k < G && !rc; k++) rc = kvb_mgr_batch_commit(g[k], slots, tokens, n);
    return rc ? fail_from(g, j - 1, rc) : KVB_OK; /* validation fails in the first group */
}

static int grp_reserve(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t n) {
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_append_check(g[j], slot, n, 0);
        if (rc) return fail_from(g, j, rc);
        need = add_sat(need, kvb_mgr_blocks_needed(g[j], slot, n));
    }
    kvb_pool_t *p = g[0]->pool;
    if (need > p->num_free) return out_of_blocks(g[0], need, p->num_free);
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_reserve(g[j], slot, n);
        if (rc) return fail_from(g, j, rc);
    }
    return KVB_OK;
}

int64_t kvb_grp_blocks_needed(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t n) {
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) {
        int64_t nj = kvb_mgr_blocks_needed(g[j], slot, n);
        if (nj < 0) return nj;
        need = add_sat(need, nj);
    }
    return need;
}

int kvb_grp_batch_need(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, int64_t count,
                       int64_t n, int64_t *need_out) {
    return need_all(g, G, slots, count, n, g[0]->pool->num_free, need_out);
}

/* Blocks a scheduler's step takes in all groups (BlockManager.blocks_needed_batch): for
 * each sequence ns[i] more slots (its new tokens and draft slots) and forks[i] children
 * (NULL: none) taking cn[i] slots each, counted exactly in each group (table.c,
 * kvb_mgr_step_need). Validation first: unknown, repeated or swapped-out sequences, negative
 * counts. */
int kvb_grp_step_need(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, const int64_t *ns,
                      const int64_t *cn, const int64_t *forks, int64_t count,
                      int64_t *need_out) {
    kvb_mgr_t *m = g[0];
    int rc = kvb_mgr_batch_check(m, slots, count);
    if (rc) return rc;
    for (int64_t i = 0; i < count; i++) {
        if (ns[i] < 0 || cn[i] < 0 || (forks && forks[i] < 0)) {
            m->err_a = i;
            m->err_b = ns[i] < 0 ? ns[i] : cn[i] < 0 ? cn[i] : forks[i];
            return KVB_EINVAL;
        }
    }
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) {
        int64_t nj = 0;
        rc = kvb_mgr_step_need(g[j], slots, ns, cn, forks, count, &nj);
        if (rc) return fail_from(g, j, rc);
        need = add_sat(need, nj);
    }
    *need_out = need;
    return KVB_OK;
}

/* ---- the entry points of a manager's calls: G = 1 is one group's path (table.c), G > 1
 * the lock step above; so the Cython layer and capi.c call one function per method ------- */
int kvb_grp_add(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                const uint8_t *salt, size_t salt_len, int recompute, int32_t tag,
                int32_t *slot_out, int64_t *cached_out) {
    kvb_pool_t *p = g[0]->pool;
    p->events.cur_tag = tag; /* host-tier onloads cache blocks inside add */
    int rc = G == 1 ? kvb_mgr_add(g[0], tokens, n, salt, salt_len, recompute, slot_out,
                                  cached_out)
                    : grp_add(g, G, tokens, n, salt, salt_len, recompute, slot_out, cached_out);
    p->events.cur_tag = 0;
    if (!rc)
        for (int32_t j = 0; j < G; j++) g[j]->seqs[*slot_out].chain.tag = tag;
    return rc;
}

int kvb_grp_probe(kvb_mgr_t *const *g, int32_t G, const int32_t *tokens, int64_t n,
                  const uint8_t *salt, size_t salt_len, int64_t *cached_out, int64_t *need_out) {
    return G == 1 ? kvb_mgr_probe(g[0], tokens, n, salt, salt_len, cached_out, need_out)
                  : grp_probe(g, G, tokens, n, salt, salt_len, cached_out, need_out);
}

int kvb_grp_append(kvb_mgr_t *const *g, int32_t G, int32_t slot, const int32_t *tokens,
                   int64_t n, int computed) {
    return G == 1 ? kvb_mgr_append(g[0], slot, tokens, n, computed)
                  : grp_append(g, G, slot, tokens, n, computed);
}

int kvb_grp_append_batch(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                         const int32_t *tokens, int64_t n) {
    return G == 1 ? kvb_mgr_append_batch(g[0], slots, tokens, n)
                  : grp_append_batch(g, G, slots, tokens, n);
}

int kvb_grp_reserve(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t n) {
    return G == 1 ? kvb_mgr_reserve(g[0], slot, n) : grp_reserve(g, G, slot, n);
}

/* Table entries of an n-token sequence in all groups (a state group: its span). */
int64_t kvb_grp_table_blocks(kvb_mgr_t *const *g, int32_t G, int64_t n) {
    int64_t b = n > 0 ? blk_of(g[0], n - 1) + 1 : 0, total = 0; /* no overflow up to INT64_MAX */
    for (int32_t j = 0; j < G; j++) total = add_sat(total, g[j]->kind == KVB_G_STATE ? g[j]->span : b);
    return total;
}

/* Blocks a live sequence holds in all groups (released entries excluded). */
int64_t kvb_grp_held(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    int64_t n = 0;
    for (int32_t j = 0; j < G; j++) n += g[j]->seqs[slot].nblocks - g[j]->seqs[slot].lo;
    return n;
}

/* A live sequence's computed tokens: the fewest any group holds computed. */
int64_t kvb_grp_num_computed(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    int64_t nc = g[0]->seqs[slot].ncomputed;
    for (int32_t j = 1; j < G; j++)
        if (g[j]->seqs[slot].ncomputed < nc) nc = g[j]->seqs[slot].ncomputed;
    return nc;
}

/* Copy-on-write pairs pending in all groups. */
int64_t kvb_grp_num_copies(kvb_mgr_t *const *g, int32_t G) {
    int64_t n = 0;
    for (int32_t j = 0; j < G; j++) n += g[j]->ncopies;
    return n;
}

/* Every group's hash mode (kvb_mgr_set_hash), then the links (kvb_grp_link). */
int kvb_grp_set_hash(kvb_mgr_t *const *g, int32_t G, int32_t algo, const uint8_t none_hash[32]) {
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_set_hash(g[j], algo, none_hash);
        if (rc) return fail_from(g, j, rc);
    }
    return kvb_grp_link(g, G);
}

/* ---- truncate, fork, free --------------------------------------------------------------- */
int kvb_grp_truncate(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t ntokens) {
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_truncate_check(g[j], slot, ntokens);
        if (rc) return fail_from(g, j, rc);
    }
    for (int32_t j = 0; j < G; j++) KVB_MUST(kvb_mgr_truncate(g[j], slot, ntokens));
    return KVB_OK;
}

int kvb_grp_fork(kvb_mgr_t *const *g, int32_t G, int32_t parent, int32_t *child_out) {
    kvb_mgr_t *m = g[0];
    KVB_CLEAR_ERR(m);
    const kvb_seq_t *ps = live_seq(m, parent);
    m->err_b = parent;
    if (!ps) return KVB_EUNKNOWN;
    if (ps->swapped) return KVB_ESWAPPED;
    int64_t need = 0; /* state groups copy the state at once */
    for (int32_t j = 0; j < G; j++) if (g[j]->kind == KVB_G_STATE) need += g[j]->span;
    if (need > m->pool->num_free) return out_of_blocks(m, need, m->pool->num_free);
    int32_t slot = 0;
    for (int32_t j = 0; j < G; j++) {
        int32_t sj;
        int rc = kvb_mgr_fork(g[j], parent, &sj);
        if (rc) return fail_from(g, j, rc); /* ENOMEM only, before the first mutation */
        KVB_ASSERT(j == 0 || sj == slot);
        slot = sj;
    }
    *child_out = slot;
    return KVB_OK;
}

int kvb_grp_free(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_free(g[j], slot);
        if (rc) return fail_from(g, j, rc);
    }
    return KVB_OK;
}

/* ---- swap: pairs of all groups, group after group --------------------------------------- */
typedef int (*swap_fn)(kvb_mgr_t *, int32_t, int64_t *, int64_t *);

static int each_group_pairs(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t *pairs_out,
                            int64_t *npairs, swap_fn swap) {
    int64_t k = 0;
    for (int32_t j = 0; j < G; j++) {
        int64_t nj = 0;
        int rc = swap(g[j], slot, pairs_out + 2 * k, &nj);
        if (rc) return fail_from(g, j, rc); /* counted beforehand: the first group only */
        k += nj;
    }
    *npairs = k;
    return KVB_OK;
}

int kvb_grp_swap_out(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t *pairs_out,
                     int64_t *npairs) {
    kvb_mgr_t *m = g[0];
    KVB_CLEAR_ERR(m);
    const kvb_seq_t *s = live_seq(m, slot);
    m->err_b = slot;
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped) return KVB_ESWAPPED;
    if (!m->host) return KVB_ESTATE;
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) {
        const kvb_seq_t *sj = &g[j]->seqs[slot];
        need += sj->nblocks - sj->lo;
    }
    if (need > m->host->num_free) return out_of_blocks(m, need, m->host->num_free);
    return each_group_pairs(g, G, slot, pairs_out, npairs, kvb_mgr_swap_out);
}

int kvb_grp_swap_in(kvb_mgr_t *const *g, int32_t G, int32_t slot, int64_t *pairs_out,
                    int64_t *npairs) {
    kvb_mgr_t *m = g[0];
    KVB_CLEAR_ERR(m);
    const kvb_seq_t *s = live_seq(m, slot);
    m->err_b = slot;
    if (!s) return KVB_EUNKNOWN;
    if (!m->host || !s->swapped) return KVB_ESTATE;
    int64_t need = kvb_grp_blocks_needed(g, G, slot, 0);
    if (need > m->pool->num_free) return out_of_blocks(m, need, m->pool->num_free);
    return each_group_pairs(g, G, slot, pairs_out, npairs, kvb_mgr_swap_in);
}

/* ---- the step ---------------------------------------------------------------------------- */
int kvb_grp_schedule(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                     const int32_t *qlens, const int32_t *drafts, int64_t B, int apply) {
    for (int32_t j = 0; j < G; j++) {
        int rc = kvb_mgr_schedule(g[j], slots, qlens, drafts, B, apply);
        if (rc) return fail_from(g, j, rc);
    }
    return KVB_OK;
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
    int64_t need = 0;
    for (int32_t j = 0; j < G; j++) need += g[j]->ncopies;
    if (cap < need) {
        m->err_a = need;
        m->err_b = cap;
        m->err_what = "copy pairs";
        return KVB_ERANGE;
    }
    int64_t k = 0;
    for (int32_t j = 0; j < G; j++)
        if (g[j]->ncopies) k += kvb_mgr_take_copies(g[j], out + 2 * k);
    *n_out = k;
    return KVB_OK;
}
