/* events.c -- the KV event log of a pool: BlockStored / BlockRemoved / AllBlocksCleared
 * records in structure-of-arrays form, appended by cache.c as entries come and go and drained
 * by the Cython layer (take_events). Token ids of stored blocks go to one shared array; each
 * event keeps its offset into it (-1 when none were given).
 *
 * Recording is best-effort: a full log (max_pending undrained events) or a failed allocation
 * drops the event and counts it in `dropped`; it never makes an allocator call fail after that
 * call changed state.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

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
    free(ev->tok_off); free(ev->tokens); free(ev->tag);
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
    if (h) ev->hash[i] = *h; else ev->hash[i].lo = ev->hash[i].hi = 0;
    if (parent) ev->parent[i] = *parent; else ev->parent[i].lo = ev->parent[i].hi = 0;
    if (tokens) {
        ev->tok_off[i] = ev->ntok;
        memcpy(ev->tokens + ev->ntok, tokens, (size_t)ntok * sizeof *tokens);
        ev->ntok += ntok;
    } else {
        ev->tok_off[i] = -1;
    }
}

