/* table.h -- one group's table work (table.c), for the manager (manager.c) and the host-tier
 * hits (hosthits.c); not part of the public API. m is a group, s a sequence's record (as it
 * was before the call), r that group's row of it. */
#ifndef KVBLOCKS_TABLE_H
#define KVBLOCKS_TABLE_H

#include "internal.h"

int tbl_ensure_blocks(kvb_row_t *r, int64_t need);            /* KVB_ENOMEM */
int tbl_ensure_copies(kvb_mgr_t *m, int64_t more);            /* room for more pairs */
int32_t tbl_pending_src(const kvb_mgr_t *m, int32_t dst);     /* a pending dst's source */
void tbl_queue_copy(kvb_mgr_t *m, int32_t src, int32_t dst);  /* capacity reserved */
int64_t tbl_take_copies(kvb_mgr_t *m, int64_t *out);          /* drain, release holds */
void tbl_drop_dead_copies(kvb_mgr_t *m);                      /* dsts released: forget */

/* ---- the kinds' rules -------------------------------------------------------------------
 * The next step's first query is q0 = min(ncomputed, ntokens - 1): the first uncomputed
 * token, or the newest one when all are computed (a step may recompute it). A step that
 * recomputes from qstart < q0 starts there. A window group's query at q0 reads [q0 - W + 1,
 * q0], a chunk group's [q0 - q0 % C, q0]; whole blocks below that are released: their table
 * entries become the null block 0 (lo counts them) and their references are dropped, so a
 * cached one stays evictable for prefix reuse. Release runs when a sequence moves on (append,
 * append_batch, a step), before that call allocates, so the blocks the previous step read are
 * reused only by calls after it. The first position the next query reads: */
KVB_INLINE int64_t tbl_needed_from(const kvb_mgr_t *m, int64_t ncomputed, int64_t ntokens,
                                   int64_t qstart) {
    if (m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK) return 0;
    int64_t q0 = ncomputed < ntokens - 1 ? ncomputed : ntokens - 1;
    if (qstart < q0) q0 = qstart;
    if (q0 <= 0) return 0;
    if (m->kind == KVB_G_WINDOW) return q0 - m->span + 1 > 0 ? q0 - m->span + 1 : 0;
    return q0 - q0 % m->span;
}

/* Blocks a table of n tokens takes in this group. */
KVB_INLINE int64_t tbl_blocks(const kvb_mgr_t *m, int64_t n) {
    return m->kind == KVB_G_STATE ? m->span : blocks_for(m, n);
}

/* First block a k-block hit needs (the entries below it stay null): what the query at k * bs
 * reads, and at least block k - 1, whose cached chained hash proves the prefix was computed
 * (a chunk boundary or a window of one reads none of the prefix). */
KVB_INLINE int64_t tbl_hit_lo(const kvb_mgr_t *m, int64_t n, int64_t k) {
    if (!k) return 0;
    int64_t lo = blk_of(m, tbl_needed_from(m, k * m->block_size, n, INT64_MAX));
    return lo < k - 1 ? lo : k - 1;
}

/* growth and the write rule */
int64_t tbl_growth(const kvb_mgr_t *m, int64_t ntokens, int64_t n, int64_t base);
int64_t tbl_need_for(const kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r, int64_t n);
void tbl_make_writable(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r);
void tbl_grow(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t n);

/* caching of computed blocks (after the record's hashes are known) */
void tbl_cache(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t from, int64_t to);
void tbl_computed_blocks(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t from,
                         int64_t to);
/* Tokens [r->done, ncomputed) become computed in this group (the record is updated by the
 * caller): the blocks now fully computed are flagged written and cached. */
KVB_INLINE void tbl_computed(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t ncomputed) {
    int64_t from = blk_of(m, r->done), to = blk_of(m, ncomputed);
    r->done = ncomputed;
    if (to > from && m->kind != KVB_G_STATE) tbl_computed_blocks(m, s, r, from, to);
}

/* release */
void tbl_release_front(kvb_mgr_t *m, kvb_row_t *r, int64_t upto); /* [lo, upto), upto > lo */
/* Release what a sequence about to hold ntokens committed tokens no longer needs. */
KVB_INLINE void tbl_release_for(kvb_mgr_t *m, kvb_row_t *r, int64_t ntokens, int64_t qstart) {
    if (m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK) return;
    int64_t upto = blk_of(m, tbl_needed_from(m, r->done, ntokens, qstart));
    if (upto > r->lo) tbl_release_front(m, r, upto);
}
int64_t tbl_gain(const kvb_mgr_t *m, const kvb_row_t *r, int64_t ntokens);
void tbl_release_tail(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int32_t keep);

/* counting and checks */
int64_t tbl_swap_in_need(const kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r,
                         int32_t *hits_out);
int tbl_step_need(kvb_mgr_t *m, const int32_t *slots, const int64_t *ns, int64_t n,
                  const int64_t *cn, const int64_t *forks, int64_t count, int64_t *need_out);
int tbl_step_check_slow(kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r, int64_t q,
                        int64_t d);
/* What a step's sequence (query of q tokens, d draft slots) needs of this group's row: no
 * uncomputed gap before the query, the query's blocks not released, draft slots reserved
 * (every kind, state too) and private. */
KVB_INLINE int tbl_step_check(kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r, int64_t q,
                              int64_t d) {
    if (s->ntokens - q > r->done) {
        m->err_b = s->ntokens - q - r->done;
        return KVB_EGAP;
    }
    if (!r->lo && !d && m->kind != KVB_G_STATE) return KVB_OK; /* nothing released, no drafts */
    return tbl_step_check_slow(m, s, r, q, d);
}
int tbl_check(kvb_mgr_t *m, int32_t *refs, int32_t *hrefs);

#endif
