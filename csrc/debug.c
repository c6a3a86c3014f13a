/* debug.c -- corruption hooks for testing the invariant check (kvb_grp_check).
 *
 * A check that never fires is untested: kvb_debug_corrupt breaks one invariant of one kind on
 * purpose, so that a test can assert that check() names it. Each kind touches the least state
 * that breaks exactly its invariant (e.g. KVB_DBG_CACHE_SLOT moves a cached block's hash-table
 * slot off its probe path: flags, counts and entries stay right, only the lookup of the block
 * under its own hash fails). The manager is unusable afterwards; tests only check and discard
 * it (its memory stays consistent enough to free).
 *
 * Compiled in KVB_DEBUG builds only: a release build has the entry point, which corrupts
 * nothing and returns KVB_ESTATE (the binding says "debug builds only").
 */
#include "internal.h"

#ifdef KVB_DEBUG
/* The first block b in [1, N) of pool p with (flags & want) == want and (flags & avoid) == 0,
 * and ref_count > 0 when held; KVB_NONE if none. */
static int32_t find_block(const kvb_pool_t *p, uint8_t want, uint8_t avoid, int held) {
    for (int32_t b = 1; b < p->num_blocks; b++)
        if ((p->flags[b] & want) == want && !(p->flags[b] & avoid) &&
            (!held || p->ref_count[b] > 0))
            return b;
    return KVB_NONE;
}

/* Move cached block b's table slot to an empty slot that no lookup of its hash reaches: the
 * empty slot just before its probe run (a lookup starts at the home slot and stops at the first
 * empty slot, so it never wraps back there while the run ends before it). */
static int move_slot(kvb_pool_t *p, int32_t b) {
    uint64_t mask = p->table_mask, home = p->hash[b].lo & mask, i = home;
    while (p->table[i] != b) i = (i + 1) & mask;
    uint64_t j = (home - 1) & mask;
    while (p->table[j] != KVB_NONE) j = (j - 1) & mask;
    uint64_t k = home; /* the run from home must end before j (the table is half empty) */
    while (p->table[k] != KVB_NONE && k != j) k = (k + 1) & mask;
    if (k == j) return KVB_ESTATE;
    p->table[j] = b;
    p->table[i] = KVB_NONE;
    return KVB_OK;
}
#endif

int kvb_debug_corrupt(kvb_mgr_t *m, int32_t what, int32_t slot) {
#ifndef KVB_DEBUG
    (void)m; (void)what; (void)slot;
    return KVB_ESTATE;
#else
    kvb_pool_t *p = m->pool;
    kvb_seq_t *s = live_seq(m, slot);
    kvb_row_t *r = s ? row_of(m, slot) : NULL;
    int32_t b;
    switch (what) {
    case KVB_DBG_CACHE_SLOT: /* "cached block not found under its hash" */
        b = find_block(p, KVB_F_CACHED, 0, 0);
        return b == KVB_NONE ? KVB_ESTATE : move_slot(p, b);
    case KVB_DBG_TABLE_ENTRY: { /* "hash table holds an uncached or bad block" */
        b = find_block(p, 0, KVB_F_CACHED | KVB_F_FREE, 1);
        if (b == KVB_NONE) return KVB_ESTATE;
        uint64_t j = 0;
        while (p->table[j] != KVB_NONE) j++;
        p->table[j] = b;
        return KVB_OK;
    }
    case KVB_DBG_UNWRITTEN: /* "cached block whose K/V were never written" */
        b = find_block(p, KVB_F_CACHED, 0, 0);
        if (b == KVB_NONE) return KVB_ESTATE;
        p->flags[b] &= (uint8_t)~KVB_F_WRITTEN;
        return KVB_OK;
    case KVB_DBG_FREE_LINK: /* "free list prev link broken" */
        if (p->free_head == KVB_NONE || p->next[p->free_head] == KVB_NONE) return KVB_ESTATE;
        p->prev[p->next[p->free_head]] = KVB_NONE;
        return KVB_OK;
    case KVB_DBG_REF_COUNT: /* "ref count != references held" */
        b = find_block(p, 0, KVB_F_FREE, 1);
        if (b == KVB_NONE) return KVB_ESTATE;
        p->ref_count[b]++;
        return KVB_OK;
    case KVB_DBG_SEQ_HASH: /* "block hash does not match its tokens" */
        if (!s || s->nhashed < 1) return KVB_ESTATE;
        s->hashes[0].hi ^= 1;
        return KVB_OK;
    case KVB_DBG_COMPUTED: /* "computed tokens outside [0, committed]" */
        if (!s) return KVB_ESTATE;
        s->ncomputed = s->ntokens + 1;
        return KVB_OK;
    case KVB_DBG_TABLE_BLOCK: /* "table holds an out-of-range block" */
        if (!s || r->nblocks <= r->lo) return KVB_ESTATE;
        r->blocks[r->nblocks - 1] = p->num_blocks;
        return KVB_OK;
    case KVB_DBG_STATE_ROOM: /* "a state group's room short of its tokens" */
        if (!s || m->kind != KVB_G_STATE || s->ntokens < 1) return KVB_ESTATE;
        r->room = 0;
        return KVB_OK;
    default:
        return KVB_EINVAL;
    }
#endif
}
