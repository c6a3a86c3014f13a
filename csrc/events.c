/* events.c -- the KV event log of a pool: BlockStored / BlockRemoved / AllBlocksCleared
 * records in structure-of-arrays form, appended by cache.c as entries come and go and drained
 * by the Cython layer (take_events). Token ids of stored blocks go to one shared array; each
 * event keeps its offset into it (-1 when none were given).
 *
 * Order across pools: a host tier's two pools (tiered) stamp each record from one
 * process-wide clock, so kvb_events_merge can give both logs as one stream in the order the
 * records were made (a host BlockStored may name a parent the device pool stored, and that the
 * device evicts a moment later: only that order keeps every parent known when it is named).
 * A record made in answer to another pool's record (the host tier writing a device insertion
 * through, after the call that cached returned) takes that record's stamp (p->stamp_hold):
 * the merge puts it right after its cause, as if it had been made at once.
 *
 * Recording is best-effort: a full log (max_pending undrained events) or a failed allocation
 * drops the event and counts it in `dropped`; it never makes an allocator call fail after that
 * call changed state.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#ifndef __STDC_NO_ATOMICS__
#include <stdatomic.h>
static _Atomic uint64_t event_clock; /* stamps of tiered pools' records, from 1 */
KVB_INLINE uint64_t next_stamp(void) {
    return atomic_fetch_add_explicit(&event_clock, 1, memory_order_relaxed) + 1;
}
#else
static uint64_t event_clock; /* no C11 atomics: stamps may tie across threads (order kept
                              * within each log regardless) */
KVB_INLINE uint64_t next_stamp(void) { return ++event_clock; }
#endif

int kvb_events_reserve(kvb_events_t *ev, int64_t n_events, int64_t n_tokens) {
    int64_t need = ev->n + n_events;
    if (need > ev->cap) {
        int64_t c;
        c = ev->cap; if (kvb_grow((void **)&ev->kind, &c, need, sizeof *ev->kind)) return KVB_ENOMEM;
        c = ev->cap; if (kvb_grow((void **)&ev->hash, &c, need, sizeof *ev->hash)) return KVB_ENOMEM;
        c = ev->cap; if (kvb_grow((void **)&ev->parent, &c, need, sizeof *ev->parent)) return KVB_ENOMEM;
        c = ev->cap; if (kvb_grow((void **)&ev->block, &c, need, sizeof *ev->block)) return KVB_ENOMEM;
        c = ev->cap; if (kvb_grow((void **)&ev->group, &c, need, sizeof *ev->group)) return KVB_ENOMEM;
        c = ev->cap; if (kvb_grow((void **)&ev->tok_off, &c, need, sizeof *ev->tok_off)) return KVB_ENOMEM;
        c = ev->cap; if (kvb_grow((void **)&ev->tag, &c, need, sizeof *ev->tag)) return KVB_ENOMEM;
        c = ev->cap; if (kvb_grow((void **)&ev->stamp, &c, need, sizeof *ev->stamp)) return KVB_ENOMEM;
        ev->cap = c;
    }
    return kvb_grow((void **)&ev->tokens, &ev->tok_cap, ev->ntok + n_tokens, sizeof *ev->tokens);
}

void kvb_events_clear(kvb_events_t *ev) { ev->n = 0; ev->ntok = 0; }

void kvb_events_detach(kvb_events_t *ev, kvb_events_t *out) {
    *out = *ev;
    kvb_events_t keep = {0};
    keep.cur_tag = ev->cur_tag;
    keep.max_pending = ev->max_pending;
    keep.dropped = ev->dropped;
    *ev = keep;
}

void kvb_events_reattach(kvb_events_t *ev, kvb_events_t *snap) {
    if (ev->cap == 0 && ev->tok_cap == 0) { /* nothing recorded meanwhile: reuse the arrays */
        snap->n = snap->ntok = 0;
        snap->cur_tag = ev->cur_tag;
        snap->max_pending = ev->max_pending;
        snap->dropped = ev->dropped;
        *ev = *snap;
        memset(snap, 0, sizeof *snap);
    } else {
        kvb_events_destroy(snap);
    }
}

void kvb_events_destroy(kvb_events_t *ev) {
    free(ev->kind); free(ev->hash); free(ev->parent); free(ev->block); free(ev->group);
    free(ev->tok_off); free(ev->tokens); free(ev->tag); free(ev->stamp);
    memset(ev, 0, sizeof *ev);
}

/* Record one event; when the undrained log is full or memory runs out the event is dropped
 * and counted (recording is best-effort and must never make an allocator call fail after it
 * mutated state, nor grow without bound when nobody drains it). */
void kvb_pool_record(kvb_pool_t *p, int kind, int32_t b, const kvb_hash_t *h,
                     const kvb_hash_t *parent, const int32_t *tokens, int32_t ntok) {
    kvb_events_t *ev = &p->events;
    if (ev->n >= ev->max_pending || kvb_events_reserve(ev, 1, tokens ? ntok : 0)) {
        ev->dropped++;
        return;
    }
    int64_t i = ev->n++;
    ev->kind[i] = (uint8_t)kind;
    ev->block[i] = b;
    ev->group[i] = b > 0 && b < p->num_blocks ? p->gid[b] : 0;
    ev->tag[i] = kind == KVB_EV_STORED ? ev->cur_tag : 0;
    ev->stamp[i] = p->tiered ? (p->stamp_hold ? p->stamp_hold : next_stamp()) : 0;
    if (h) ev->hash[i] = *h; else ev->hash[i].lo = ev->hash[i].hi = 0;
    if (parent) ev->parent[i] = *parent; else ev->parent[i].lo = ev->parent[i].hi = 0;
    if (KVB_UNLIKELY(p->gtag != NULL)) { /* the engine's own hash and the group (pool.c) */
        const kvb_hash_t *t = &p->gtag[ev->group[i]];
        if (h) { ev->hash[i].lo ^= t->lo; ev->hash[i].hi ^= t->hi; }
        if (parent) { ev->parent[i].lo ^= t->lo; ev->parent[i].hi ^= t->hi; }
    }
    if (tokens) {
        ev->tok_off[i] = ev->ntok;
        memcpy(ev->tokens + ev->ntok, tokens, (size_t)ntok * sizeof *tokens);
        ev->ntok += ntok;
    } else {
        ev->tok_off[i] = -1;
    }
}


int kvb_events_merge(const kvb_events_t *a, const kvb_events_t *b, kvb_events_t *out,
                     uint8_t *src) {
    if (kvb_events_reserve(out, a->n + b->n, a->ntok + b->ntok)) {
        kvb_events_destroy(out);
        return KVB_ENOMEM;
    }
    int64_t i = 0, j = 0;
    while (i < a->n || j < b->n) {
        int from_b = i == a->n || (j < b->n && b->stamp[j] < a->stamp[i]);
        const kvb_events_t *e = from_b ? b : a;
        int64_t k = from_b ? j++ : i++, o = out->n++;
        src[o] = (uint8_t)from_b;
        out->kind[o] = e->kind[k];
        out->hash[o] = e->hash[k];
        out->parent[o] = e->parent[k];
        out->block[o] = e->block[k];
        out->group[o] = e->group[k];
        out->tag[o] = e->tag[k];
        out->stamp[o] = e->stamp[k];
        out->tok_off[o] = -1;
        if (e->tok_off[k] >= 0) { /* a record's tokens end where its log's next ones begin */
            int64_t end = e->ntok;
            for (int64_t q = k + 1; q < e->n; q++)
                if (e->tok_off[q] >= 0) { end = e->tok_off[q]; break; }
            out->tok_off[o] = out->ntok;
            kvb_copy(out->tokens + out->ntok, e->tokens + e->tok_off[k],
                     (size_t)(end - e->tok_off[k]) * sizeof *out->tokens);
            out->ntok += end - e->tok_off[k];
        }
    }
    return KVB_OK;
}
