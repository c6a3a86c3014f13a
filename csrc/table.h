/* table.h -- one group's table work (table.c), for the manager (manager.c) and the host-tier
 * hits (hosthits.c); not part of the public API. m is a group, s a sequence's record (as it
 * was before the call), r that group's row of it. */
#ifndef KVBLOCKS_TABLE_H
#define KVBLOCKS_TABLE_H

#include "internal.h"

int tbl_ensure_blocks(kvb_row_t *r, int64_t need);            /* KVB_ENOMEM */
int tbl_ensure_copies(kvb_mgr_t *m, int64_t more);            /* room for more pairs */
int32_t tbl_users(const kvb_mgr_t *m, int32_t b);             /* refs less copy holds */
int32_t tbl_pending_src(const kvb_mgr_t *m, int32_t dst);     /* a pending dst's source */
void tbl_queue_copy(kvb_mgr_t *m, int32_t src, int32_t dst);  /* capacity reserved */
int64_t tbl_take_copies(kvb_mgr_t *m, int64_t *out);          /* drain, release holds */
void tbl_drop_dead_copies(kvb_mgr_t *m);                      /* dsts released: forget */

/* the kinds' rules */
int64_t tbl_needed_from(const kvb_mgr_t *m, int64_t ncomputed, int64_t ntokens, int64_t qstart);
int64_t tbl_blocks(const kvb_mgr_t *m, int64_t n);            /* table of n tokens */
int64_t tbl_hit_lo(const kvb_mgr_t *m, int64_t n, int64_t k); /* a k-block hit's first */

/* growth and the write rule */
int64_t tbl_growth(const kvb_mgr_t *m, int64_t ntokens, int64_t n, int64_t base);
int64_t tbl_need_for(const kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r, int64_t n);
void tbl_make_writable(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r);
void tbl_grow(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t n);

/* caching of computed blocks (after the record's hashes are known) */
void tbl_cache(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t from, int64_t to);
void tbl_computed(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t ncomputed);

/* release */
void tbl_release_for(kvb_mgr_t *m, kvb_row_t *r, int64_t ntokens,
                     int64_t qstart);
int64_t tbl_gain(const kvb_mgr_t *m, const kvb_row_t *r, int64_t ntokens);
void tbl_release_tail(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int32_t keep);

/* counting and checks */
int64_t tbl_swap_in_need(const kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r,
                         int32_t *hits_out);
int tbl_step_need(kvb_mgr_t *m, const int32_t *slots, const int64_t *ns, int64_t n,
                  const int64_t *cn, const int64_t *forks, int64_t count, int64_t *need_out);
int tbl_step_check(kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r, int64_t q, int64_t d);
int tbl_check(kvb_mgr_t *m, int32_t *refs, int32_t *hrefs);

#endif
