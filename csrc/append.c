/* append.c -- a manager's growth: append, reserve, the decode step (append_batch), and the
 * step that declares committed tokens computed (schedule; step.c plans it). manager.h. */
#include <stdlib.h>
#include <string.h>

#include "manager.h"

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
        return mgr_out_of_blocks(L, need, p->num_free);
    }
    int64_t need = 0, have = p->num_free; /* release never touches the write block */
    for (int32_t j = 0; j < G; j++) {
        const kvb_row_t *r = row_of(g[j], slot);
        need = add_sat(need, tbl_need_for(g[j], s, r, n));
        if (tokens) have += tbl_gain(g[j], r, s->ntokens + n);
    }
    if (need > have) return mgr_out_of_blocks(L, need, have);
    if (mgr_rec_reserve(L, s, s->ntokens + tokens, blk_of(L, s->ntokens + tokens) + 1))
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
    uint32_t stamp = mgr_next_stamp(L);
    for (int64_t i = 0; i < n; i++) { /* the records: validation, capacity */
        kvb_seq_t *s;
        int rc = batch_seq(L, L, slots, i, stamp, &s);
        if (rc) return rc;
        int64_t w = blk_of(L, s->ntokens);
        if (KVB_UNLIKELY(s->ntokens + 1 > s->tcap || (L->hashing && w + 1 > s->hcap)) &&
            mgr_rec_reserve(L, s, s->ntokens + 1, w + 2))
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
        if (need > have) return mgr_out_of_blocks(L, need, have);
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
    uint32_t stamp = mgr_next_stamp(L);
    for (int64_t i = 0; i < B; i++) {
        kvb_seq_t *s;
        int rc = batch_seq(L, E, slots, i, stamp, &s);
        if (rc) return rc;
        int64_t q = qlens[i], d = drafts ? drafts[i] : 0;
        E->err_b = q;
        if (q < 0 || q > s->ntokens) return KVB_EINVAL;
        E->err_b = d;
        if (d < 0) return KVB_EINVAL;
        for (int32_t j = 0; j < G; j++) {
            kvb_mgr_t *m = g[j];
            m->err_b = slots[i];
            rc = tbl_step_check(m, s, row_of(m, slots[i]), q, d);
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
            mgr_sync_computed(L, s, slots[i]);
        }
    }
    return KVB_OK;
}

void kvb_grp_schedule_one(kvb_mgr_t *const *g, int32_t j, const int32_t *slots,
                          const int32_t *qlens, const int32_t *drafts, int64_t B) {
    KVB_MUST(kvb_grp_schedule(&g[j], 1, slots, qlens, drafts, B, 1));
}
