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
 *
 * This file: the lifecycle, slots and records, truncate, fork, free, swap, the counts, the
 * queries, the drain and the check. admit.c: add and probe. append.c: append, reserve, the
 * decode step and the step that computes committed tokens.
 */
#include <stdlib.h>
#include <string.h>

#include "manager.h"

int mgr_out_of_blocks(kvb_mgr_t *m, int64_t need, int64_t have) {
    m->err_a = need;
    m->err_b = have;
    return KVB_EOUTOFBLOCKS;
}

uint32_t mgr_next_stamp(kvb_mgr_t *L) {
    uint32_t stamp = ++L->stamp;
    if (KVB_UNLIKELY(stamp == 0)) { /* wrapped: clear old stamps */
        for (int32_t i = 0; i < L->scap; i++) L->seqs[i].stamp = 0;
        stamp = L->stamp = 1;
    }
    return stamp;
}

int mgr_rec_reserve(const kvb_mgr_t *L, kvb_seq_t *s, int64_t ntok, int64_t nblk) {
    if (kvb_grow((void **)&s->tokens, &s->tcap, ntok, sizeof *s->tokens)) return KVB_ENOMEM;
    if (!L->hashing || nblk <= s->hcap) return KVB_OK;
    int64_t cap = s->hcap;
    if (nblk > INT32_MAX || kvb_grow((void **)&s->hashes, &cap, nblk, sizeof *s->hashes))
        return KVB_ENOMEM;
    s->hcap = (int32_t)cap;
    return kvb_chain_reserve(L, s, nblk);
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
int mgr_new_slot(kvb_mgr_t *const *g, int32_t G, int32_t *slot) {
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

void mgr_take_slot(kvb_mgr_t *const *g, int32_t G, int32_t slot) {
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
void mgr_sync_computed(const kvb_mgr_t *L, kvb_seq_t *s, int32_t slot) {
    int64_t nc = s->ntokens, dr = INT64_MAX;
    for (int32_t j = 0; j < L->ngrp; j++) {
        const kvb_row_t *r = row_of(L->grp[j], slot);
        if (r->done < nc) nc = r->done;
        if (r->drafted < dr) dr = r->drafted;
    }
    s->ncomputed = nc;
    s->drafted = dr;
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
    if (need > p->num_free) return mgr_out_of_blocks(L, need, p->num_free);
    int32_t slot;
    if (mgr_new_slot(g, G, &slot)) return KVB_ENOMEM;
    ps = &L->seqs[parent]; /* new_slot may have moved the arrays */
    kvb_seq_t *s = &L->seqs[slot];
    if (mgr_rec_reserve(L, s, ps->ntokens, (int64_t)ps->nhashed + 1) || kvb_chain_fork(L, s, ps))
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
    mgr_take_slot(g, G, slot);
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
    if (need > h->num_free) return mgr_out_of_blocks(L, need, h->num_free);
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
    if (need > p->num_free) return mgr_out_of_blocks(L, need, p->num_free);
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

/* Validation of a batch (unknown, twice, swapped out), error detail (index, slot). */
static int batch_check(kvb_mgr_t *L, const int32_t *slots, int64_t n) {
    uint32_t stamp = mgr_next_stamp(L);
    kvb_seq_t *s;
    for (int64_t i = 0; i < n; i++) {
        int rc = batch_seq(L, L, slots, i, stamp, &s);
        if (rc) return rc;
    }
    L->err_a = L->err_b = 0;
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

const kvb_row_t *kvb_grp_row(kvb_mgr_t *const *g, int32_t j, int32_t slot) {
    return row_of(g[j], slot);
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
