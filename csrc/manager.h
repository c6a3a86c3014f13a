/* manager.h -- what the manager's files (manager.c, admit.c, append.c) share; private to
 * csrc/. g[0..G) are a manager's groups, L = g[0] the lead holding the records. */
#ifndef KVBLOCKS_MANAGER_H
#define KVBLOCKS_MANAGER_H

#include "table.h"

/* A call over groups reports in g[0]: the detail of group k's failure moves there. */
KVB_INLINE int fail_from(kvb_mgr_t *const *g, int32_t k, int rc) {
    if (k) {
        g[0]->err_a = g[k]->err_a;
        g[0]->err_b = g[k]->err_b;
        g[0]->err_what = g[k]->err_what;
    }
    return rc;
}

/* KVB_EOUTOFBLOCKS with the detail (blocks needed, blocks there). */
int mgr_out_of_blocks(kvb_mgr_t *m, int64_t need, int64_t have);

/* Tokens no sequence can ever hold: more than the whole pool. Requests above it are refused
 * before any size arithmetic, so ntokens + n never overflows (both stay below 2^62). */
KVB_INLINE int64_t max_tokens(const kvb_mgr_t *m) {
    return (int64_t)m->pool->num_blocks * m->block_size;
}

/* The one preamble of every single-sequence call: the live sequence in slot, refused when
 * swapped out unless allow_swapped. Sets the error detail (index 0, the slot). */
KVB_INLINE int get_seq(kvb_mgr_t *L, int32_t slot, int allow_swapped, kvb_seq_t **out) {
    kvb_seq_t *s = live_seq(L, slot);
    L->err_a = 0;
    L->err_b = slot;
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped && !allow_swapped) return KVB_ESWAPPED;
    *out = s;
    return KVB_OK;
}

/* The next batch call's stamp (duplicate checks); a wrap clears the old ones. */
uint32_t mgr_next_stamp(kvb_mgr_t *L);

/* The preamble of entry i of a batch call (stamp: the call's mgr_next_stamp): the live
 * sequence in slots[i], refused when unknown, listed twice in the call or swapped out.
 * Sets E's error detail (index i, the slot) and marks the record with the stamp. */
KVB_INLINE int batch_seq(kvb_mgr_t *L, kvb_mgr_t *E, const int32_t *slots, int64_t i,
                         uint32_t stamp, kvb_seq_t **out) {
    kvb_seq_t *s = live_seq(L, slots[i]);
    E->err_a = i;
    E->err_b = slots[i];
    if (KVB_UNLIKELY(!s)) return KVB_EUNKNOWN;
    if (KVB_UNLIKELY(s->stamp == stamp)) return KVB_EDUP;
    if (KVB_UNLIKELY(s->swapped)) return KVB_ESWAPPED;
    s->stamp = stamp;
    *out = s;
    return KVB_OK;
}

/* Capacity of a record for ntok tokens and, when hashing, nblk block hashes. */
int mgr_rec_reserve(const kvb_mgr_t *L, kvb_seq_t *s, int64_t ntok, int64_t nblk);

/* Hash the blocks that became full (from block nhashed to ntokens / bs), once for all
 * groups. They enter the prefix cache only once computed (tbl_computed). */
KVB_INLINE void hash_new(const kvb_mgr_t *L, kvb_seq_t *s) {
    int64_t full = blk_of(L, s->ntokens);
    kvb_chain_hash(L, s, s->tokens + s->nhashed * (int64_t)L->block_size, s->nhashed, full);
    s->nhashed = (int32_t)full;
}

/* Slots: a fresh one (capacity only, not yet live: *slot is the free-slot stack's head, and
 * every group has a row for it), and taking it (live, empty record and rows). */
int mgr_new_slot(kvb_mgr_t *const *g, int32_t G, int32_t *slot);
void mgr_take_slot(kvb_mgr_t *const *g, int32_t G, int32_t slot);

/* The record's computed tokens and draft window: the fewest any group declared. */
void mgr_sync_computed(const kvb_mgr_t *L, kvb_seq_t *s, int32_t slot);

/* No draft window any more (tokens committed or dropped), in the record and every group. */
KVB_INLINE void clear_drafts(kvb_mgr_t *const *g, int32_t G, kvb_seq_t *s, int32_t slot) {
    s->drafted = 0;
    for (int32_t j = 0; j < G; j++) row_of(g[j], slot)->drafted = 0;
}

#endif
