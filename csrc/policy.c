/* policy.c -- eviction orders the pool is given: small functions over the pool's free list.
 *
 * The pool (pool.c) evicts in least-recently-released order on its own: a released cached
 * block joins the free list's tail and allocation pops the head. A policy changes only which
 * cached block the next allocation takes, through p->victim, called by the allocation loop
 * when the head is cached; it may reorder the list with the pool's primitives
 * (kvb_pool_requeue) and must return the (possibly new) head. Its per-block bit `chance` is
 * the pool's to clear: whenever a block leaves the free list, a new stay starts without it.
 *
 * The groups' second chance (kvb_twins_t, internal.h): a cached block of a sliding-window or
 * chunked-local group whose full-attention twin is still cached moves from the head to the
 * tail once per stay instead of being evicted (CLOCK-like, O(1) amortized per allocation).
 * This file calls down only (pool.c, cache.c); nothing below it names it.
 */
#include <stdlib.h>

#include "internal.h"

static int32_t twins_victim(kvb_pool_t *p) {
    const kvb_twins_t *tw = p->policy;
    const kvb_hash_t *anchor = &tw->tag[tw->anchor];
    for (;;) {
        int32_t b = p->free_head;
        uint8_t g = p->gid[b];
        if (!(p->flags[b] & KVB_F_CACHED) || !tw->keep[g] || p->chance[b] ||
            p->next[b] == KVB_NONE)
            break;
        kvb_hash_t twin = p->hash[b];
        twin.lo ^= tw->tag[g].lo ^ anchor->lo;
        twin.hi ^= tw->tag[g].hi ^ anchor->hi;
        if (kvb_cache_find(p, &twin) == KVB_NONE) break; /* useless now: evict */
        kvb_pool_requeue(p, b);
        p->chance[b] = 1;
    }
    return p->free_head;
}

void kvb_policy_twins(kvb_pool_t *p, kvb_twins_t *tw) {
    free(p->chance);
    free(p->policy);
    p->policy = tw;
    p->chance = tw->spent;
    p->victim = twins_victim;
}
