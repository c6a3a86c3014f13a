/* tier.c -- the host pool as a second prefix-cache tier below the device pool.
 *
 * Layering. The device pool and its cache are plain data structures below this file: they
 * never call up into it. They keep a log (kvb_plog_t, internal.h) that this file asked for
 * (kvb_pool_log_on) and drains at its own layer: the evictions (lazily, kvb_tier_flush) and
 * the insertions (kvb_tier_absorb, which the layer that cached calls once that call returned).
 *
 * Demotion. When allocation pops a cached device block (lazy eviction, pool.c), the entry is
 * not simply dropped: the pool's log records its hash (and, for the host's events, its parent
 * and tokens), a few stores on the allocation path. kvb_tier_flush later gives each
 * recorded entry a host block (allocating from the host free list evicts the least recently
 * released host entry, LRU) and queues a (device, host) offload; the drain (take_offloads)
 * flushes first, and so does every host lookup (add, probe) and the host counters, so nothing
 * observable differs from demoting at once. The device block is handed out at once; the
 * engine runs the offloads first in the next drain, before anything can overwrite it (swap-in
 * pairs, onloads and copies come after, the forward pass after all of them). A hash already on
 * the host costs no copy. With no host block to take (every one referenced), or while the
 * block's own content is still in flight at eviction, the entry is dropped and counted.
 *
 * Host hits. add() continues its device prefix on the host: the host hits are pinned, fresh
 * device blocks are allocated for them and (host, device) onloads queued. Their tokens count
 * as cached and computed; the device blocks enter the device cache at once (a second prompt
 * in the same step shares them) and are flagged written, because every reader runs after the
 * drain that fills them.
 *
 * Write-through (optional). Each device block entering the device cache is copied to the host
 * at once (an offload queued, when the caching call returned: kvb_tier_absorb), so that its
 * eviction later costs no copy. The host's events of that copy take the stamp of the device's
 * BlockStored (events.c), so the merged log reads as if they had been recorded inside it.
 *
 * Holds. A pending offload holds one reference on its host block; a pending onload one on its
 * host block and one on its device block. Held blocks are never in a free list, so never
 * evicted, reused or demoted before the pair ran. Swapped-out sequences hold their host
 * blocks the same way: the host cache never evicts them (kvb_tier_check verifies that no
 * swapped block is a cache entry).
 *
 * One drain, in order: take_offloads, take_onloads, the swap pairs in the order returned,
 * take_copies, then the forward pass. take_offloads starts the drain: pairs queued after it
 * belong to the next one. The hazards across these lists are closed here, not by the engine:
 *   - a device block whose content arrives with this drain (a swap-in or onload destination,
 *     flagged KVB_F_INFLIGHT) is never an offload source before the drain starts, since the
 *     offload would read it before its content arrives;
 *   - host blocks released by swapped sequences (swap_in, free) are held until the drain
 *     starts (`deferred`), since an offload of this drain could otherwise write a block that a
 *     swap pair of this drain still reads;
 *   - a device block a swap-out pair of this drain reads (flagged KVB_F_SWAP_SRC), or one a
 *     swap-in pair writes (in flight, listed in swapdst) and that free, truncate or swap_out
 *     released, is never an onload destination, since the onloads run before the swap pairs:
 *     add() gives such blocks to the positions the forward computes, and ends the host hit
 *     early when it has too few other blocks. (Every other reuse of such a block is written
 *     after the swap pairs ran; docs/host-tier.md tabulates every pair kind and claimant.)
 * The step declared by schedule/metadata also settles all three (the drain has run by then).
 *
 * Events. The flush gives a batch's evictions their host blocks parent first: a sequence
 * frees its tail first, so one allocation evicts a chain child first, and a router that skips
 * a BlockStored whose parent it does not know (llm-d, Dynamo) would drop all but the chain's
 * first block. The offload pairs (and so the host's LRU order, set as take_offloads releases
 * them) stay in eviction order: the host still evicts a chain's tail first.
 *
 * Reset. kvb_mgr_reset_cache clears both tiers, all or nothing (refused while pairs are
 * pending). Both pools are flagged `tiered`: a reset of either records one BlockRemoved per
 * entry in its own medium, never AllBlocksCleared, which names no medium (cache.c).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- lifecycle -------------------------------------------------------------------------- */
int kvb_mgr_host_tier(kvb_mgr_t *m, int write_through) {
    KVB_CLEAR_ERR(m);
    kvb_pool_t *p = m->pool, *h = m->host;
    if (!h || !h->caching || !p->caching) {
        m->err_what = "a host tier needs prefix caching on the device and host pools";
        return KVB_ESTATE;
    }
    if (p->tier) {
        m->err_what = "the device pool already has a host tier";
        return KVB_ESTATE;
    }
    kvb_tier_t *t = calloc(1, sizeof *t);
    if (!t) return KVB_ENOMEM;
    size_t n = (size_t)p->num_blocks;
    t->pool = p;
    t->host = h;
    t->inflight.ids = malloc(n * sizeof *t->inflight.ids);
    t->swapsrc.ids = malloc(n * sizeof *t->swapsrc.ids);
    t->swapdst.ids = malloc(n * sizeof *t->swapdst.ids);
    t->srcafter = malloc(n * sizeof *t->srcafter);
    t->deferred = malloc((size_t)h->num_blocks * sizeof *t->deferred);
    /* a drain's offloads (each holds a host block) fit without growing */
    t->off = malloc(2 * (size_t)h->num_blocks * sizeof *t->off);
    t->offcap = 2 * (int64_t)h->num_blocks;
    p->tier = t; /* kvb_tier_destroy frees whatever was allocated */
    if (!t->inflight.ids || !t->swapsrc.ids || !t->swapdst.ids || !t->srcafter || !t->deferred ||
        !t->off || kvb_pool_log_on(p, m->block_size, write_through)) {
        kvb_tier_destroy(p);
        return KVB_ENOMEM;
    }
    t->block_size = m->block_size;
    t->write_through = write_through != 0;
    p->tiered = h->tiered = 1; /* their resets name their medium (cache.c) */
    return KVB_OK;
}

void kvb_tier_destroy(kvb_pool_t *p) {
    kvb_tier_t *t = p->tier;
    if (!t) return;
    free(t->off);
    free(t->on);
    free(t->inflight.ids);
    free(t->swapsrc.ids);
    free(t->swapdst.ids);
    free(t->srcafter);
    free(t->deferred);
    free(t->scratch);
    free(t->ord);
    free(t);
    kvb_pool_log_off(p); /* the log had one reader */
    p->tier = NULL;
    p->tiered = 0; /* (the host pool may be gone already: its flag is left alone) */
}

/* ---- offloads: demotion and write-through ----------------------------------------------- */
/* Give the entry (hash, parent, tokens) a host block, cached on the host and held for the
 * offload the caller queues (capacity for it reserved). Returns it, or 0 when no host block
 * is free (nothing changed then). */
static int32_t take_host_block(kvb_tier_t *t, const kvb_hash_t *hash, const kvb_hash_t *parent,
                               const int32_t *tokens, uint8_t gid) {
    kvb_pool_t *h = t->host;
    if (h->num_free == 0) return 0;
    int32_t hb;
    KVB_MUST(kvb_pool_allocate(h, 1, &hb)); /* may evict the LRU host entry; ref 1: the hold */
    h->flags[hb] |= KVB_F_WRITTEN;          /* promised by the offload, run before any read */
    h->gid[hb] = gid;                       /* the host entry's events name its group */
    kvb_cache_put(h, hb, hash, parent->lo | parent->hi ? parent : NULL, tokens, t->block_size);
    t->stats.offloads++;
    return hb;
}

KVB_INLINE void push_offload(kvb_tier_t *t, int32_t b, int32_t hb) {
    t->off[2 * t->noff] = b;
    t->off[2 * t->noff + 1] = hb;
    t->noff++;
}

/* Give the entry (device block b, hash, parent, tokens) a host block and queue (b, host
 * block). Returns 1 when queued, 0 when no host block is free or the queue cannot grow
 * (nothing changed then). */
static int queue_offload(kvb_tier_t *t, int32_t b, const kvb_hash_t *hash,
                         const kvb_hash_t *parent, const int32_t *tokens, uint8_t gid) {
    if (t->host->num_free == 0 ||
        kvb_grow((void **)&t->off, &t->offcap, 2 * (t->noff + 1), sizeof *t->off))
        return 0;
    push_offload(t, b, take_host_block(t, hash, parent, tokens, gid));
    return 1;
}

/* The first demotion of [0, n) under hash h (index: the log's eviction hashes, open addressing), or -1
 * (also for the zero hash: no parent). */
static int64_t dem_find(const kvb_demotion_t *dem, const int64_t *index, uint64_t mask,
                        const kvb_hash_t *h) {
    if (!(h->lo | h->hi)) return -1;
    for (uint64_t s = h->lo & mask;; s = (s + 1) & mask) {
        int64_t i = index[s];
        if (i < 0 || (dem[i].hash.lo == h->lo && dem[i].hash.hi == h->hi)) return i;
    }
}

/* The order in which the flush stores demotions [0, n) on the host: each entry after the
 * entry of its parent hash when that one is in the batch too, else in eviction order (a walk
 * up each entry's ancestors in the batch; a cycle, possible only through pool.cache's caller
 * given parents, is cut where it closes). Returns ord (t->ord[0, n)), with room for each
 * entry's host block at ord + n; NULL when the scratch cannot grow. O(n). */
static int64_t *parents_first(kvb_tier_t *t, const kvb_demotion_t *dem, int64_t n) {
    uint64_t tsize = 8;
    while (tsize < 2 * (uint64_t)n) tsize <<= 1;
    if (n > (INT64_MAX - (int64_t)tsize) / 3 ||
        kvb_grow((void **)&t->ord, &t->ordcap, 3 * n + (int64_t)tsize, sizeof *t->ord))
        return NULL;
    int64_t *ord = t->ord, *state = ord + n, *stack = ord + 2 * n, *index = ord + 3 * n;
    uint64_t mask = tsize - 1;
    memset(index, 0xff, (size_t)tsize * sizeof *index); /* all -1 */
    for (int64_t i = 0; i < n; i++) {
        uint64_t s = dem[i].hash.lo & mask;
        while (index[s] >= 0 && (dem[index[s]].hash.lo != dem[i].hash.lo ||
                                 dem[index[s]].hash.hi != dem[i].hash.hi))
            s = (s + 1) & mask;
        if (index[s] < 0) index[s] = i;
        state[i] = 0; /* 0: not seen, 1: on the walk, 2: placed */
    }
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t top = 0, j = i;
        while (state[j] == 0) { /* climb to the first ancestor in the batch not placed yet */
            state[j] = 1;
            stack[top++] = j;
            int64_t a = dem_find(dem, index, mask, &dem[j].parent);
            if (a < 0 || state[a]) break;
            j = a;
        }
        while (top) { /* place the walk, ancestor first */
            int64_t e = stack[--top];
            state[e] = 2;
            ord[k++] = e;
        }
    }
    KVB_ASSERT(k == n);
    return ord;
}

void kvb_tier_flush(kvb_tier_t *t) {
    kvb_plog_t *lg = t->pool->log;
    if (lg->nins) kvb_tier_absorb(t); /* (the caching layer absorbed already: a safety net) */
    t->stats.dropped += (uint64_t)lg->lost; /* in flight at eviction, or no memory to record */
    lg->lost = 0;
    const kvb_demotion_t *dem = lg->ev;
    const int32_t *demtok = lg->evtok;
    int64_t n = lg->nev, *ord = NULL;
    if (!n) return;
    if (n > 1 && !kvb_grow((void **)&t->off, &t->offcap, 2 * (t->noff + n), sizeof *t->off))
        ord = parents_first(t, dem, n);
    if (!ord) { /* one entry, or no memory for the order: eviction order (events best-effort) */
        for (int64_t i = 0; i < n; i++) {
            const kvb_demotion_t *d = &dem[i];
            if (kvb_cache_find(t->host, &d->hash) != KVB_NONE ||
                queue_offload(t, d->block, &d->hash, &d->parent,
                              d->has_tokens ? demtok + i * t->block_size : NULL, d->gid))
                t->stats.demotions++;
            else
                t->stats.dropped++;
        }
        lg->nev = 0;
        return;
    }
    int64_t *hb = ord + n; /* each entry's host block, 0: none taken */
    for (int64_t k = 0; k < n; k++) { /* stored on the host (and its events) parent first */
        int64_t i = ord[k];
        const kvb_demotion_t *d = &dem[i];
        hb[i] = 0;
        if (kvb_cache_find(t->host, &d->hash) != KVB_NONE ||
            (hb[i] = take_host_block(t, &d->hash, &d->parent,
                                     d->has_tokens ? demtok + i * t->block_size : NULL,
                                     d->gid)))
            t->stats.demotions++;
        else
            t->stats.dropped++;
    }
    for (int64_t i = 0; i < n; i++) /* queued in eviction order: the host's LRU order */
        if (hb[i]) push_offload(t, dem[i].block, (int32_t)hb[i]);
    lg->nev = 0;
}

/* The insertions since the last drain, in order: with write-through each is copied to the
 * host unless its content arrives with this drain (or a pending copy: written through once
 * evicted) or the host holds its hash. The host's records take the stamp of the device's
 * BlockStored, so the merged log reads as if written at once (events.c). */
void kvb_tier_absorb(kvb_tier_t *t) {
    kvb_pool_t *p = t->pool, *h = t->host;
    kvb_plog_t *lg = p->log;
    for (int64_t i = 0; i < lg->nins; i++) {
        int32_t b = lg->ins[i];
        if (!t->write_through || (p->flags[b] & (KVB_F_INFLIGHT | KVB_F_COPY_DST)) ||
            !(p->flags[b] & KVB_F_CACHED))
            continue;
        if (kvb_cache_find(h, &p->hash[b]) != KVB_NONE) continue;
        h->stamp_hold = lg->ins_stamp[i];
        t->nwt += queue_offload(t, b, &p->hash[b], &lg->parent[b],
                                lg->has_tokens[b] ? lg->tokens + (size_t)b * t->block_size : NULL,
                                p->gid[b]);
        h->stamp_hold = 0;
    }
    lg->nins = 0;
}

/* kvb_cache_insert from above the tier (BlockPool.cache): the blocks not cached yet take
 * KV cache group `group` for their events, the events the adapter tag `tag` (0: none), then
 * the tier (if any) absorbs the insertions. */
int kvb_tier_cache_insert(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes,
                          int64_t n, const kvb_hash_t *parent, const int32_t *tokens,
                          int32_t block_size, uint8_t group, int32_t tag, int64_t *stored) {
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (b > 0 && b < p->num_blocks && !(p->flags[b] & KVB_F_CACHED)) p->gid[b] = group;
    }
    p->events.cur_tag = tag;
    int rc = kvb_cache_insert(p, ids, hashes, n, parent, tokens, block_size, stored);
    p->events.cur_tag = 0;
    if (p->tier) kvb_tier_absorb(p->tier); /* the insertions' records, at the tier's layer */
    return rc;
}

int64_t kvb_tier_unflushed(const kvb_tier_t *t) {
    return t->pool->log->nev + t->pool->log->nins;
}

int64_t kvb_tier_busy(const kvb_tier_t *t) {
    return t->noff - t->nwt + t->non + t->pool->log->nev;
}

/* ---- onloads ---------------------------------------------------------------------------- */
int64_t kvb_tier_match(kvb_tier_t *t, const kvb_hash_t *hashes, int64_t n) {
    if (n <= 0) return 0;
    kvb_tier_flush(t); /* a prefix evicted a moment ago is on the host now */
    if (kvb_grow((void **)&t->scratch, &t->scap, n, sizeof *t->scratch)) return KVB_ENOMEM;
    int64_t k = kvb_cache_match(t->host, hashes, n, t->scratch);
    if (k && kvb_grow((void **)&t->on, &t->oncap, 2 * (t->non + k), sizeof *t->on))
        return KVB_ENOMEM;
    return k;
}

/* Drain-scoped flags (KVB_F_INFLIGHT, KVB_F_SWAP_SRC): set once per block and listed, so that
 * the drain's start clears them in time proportional to their number. */
static void mark(kvb_pool_t *p, kvb_marks_t *ms, uint8_t flag, int32_t b) {
    if (p->flags[b] & flag) return;
    KVB_ASSERT(ms->n < p->num_blocks);
    p->flags[b] |= flag;
    ms->ids[ms->n++] = b;
}

static void unmark_all(kvb_pool_t *p, kvb_marks_t *ms, uint8_t flag) {
    for (int64_t i = 0; i < ms->n; i++) p->flags[ms->ids[i]] &= (uint8_t)~flag;
    ms->n = 0;
}

/* The flagged blocks are exactly the listed ones (check). */
static int marks_agree(const kvb_pool_t *p, const kvb_marks_t *ms, uint8_t flag) {
    int64_t flagged = 0;
    for (int32_t b = 1; b < p->num_blocks; b++) flagged += (p->flags[b] & flag) != 0;
    if (flagged != ms->n) return 0;
    for (int64_t i = 0; i < ms->n; i++)
        if (!(p->flags[ms->ids[i]] & flag)) return 0;
    return 1;
}

void kvb_tier_inflight(kvb_tier_t *t, int32_t b) { mark(t->pool, &t->inflight, KVB_F_INFLIGHT, b); }

void kvb_tier_onload_at(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t i, int32_t hb) {
    kvb_pool_t *p = m->pool;
    kvb_tier_t *t = p->tier;
    int32_t d = r->blocks[i];
    kvb_hash_t h = gkey(m, s, i), parent;
    if (i) parent = gkey(m, s, i - 1);
    p->ref_count[d]++;              /* the onload's hold (fresh: not in the free list) */
    p->flags[d] |= KVB_F_WRITTEN;   /* filled by the onload, before any reader runs */
    kvb_tier_inflight(t, d);
    p->gid[d] = m->gidx;
    kvb_cache_put(p, d, &h, i ? &parent : NULL, s->tokens + i * m->block_size, m->block_size);
    kvb_tier_absorb(t); /* in flight: not written through, its record drained */
    t->on[2 * t->non] = hb;
    t->on[2 * t->non + 1] = d;
    t->non++;
    t->stats.onloads++;
}

void kvb_tier_onload(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t from, int64_t n) {
    kvb_tier_t *t = m->pool->tier;
    for (int64_t i = from; i < from + n; i++) kvb_tier_onload_at(m, s, r, i, t->scratch[i - from]);
    t->stats.hit_blocks += (uint64_t)n;
}

void kvb_tier_swap_src(kvb_tier_t *t, int32_t b) {
    if (t->pool->flags[b] & KVB_F_SWAP_SRC) return; /* listed already, with an earlier count */
    t->srcafter[t->swapsrc.n] = t->non;
    mark(t->pool, &t->swapsrc, KVB_F_SWAP_SRC, b);
}

/* A swap-in pair of the coming drain writes b (a fresh block of swap_in). Listed once: a block
 * already in flight when handed out was released by a swap-in (onload destinations are held
 * until take_onloads), so only that rare case scans the list. */
void kvb_tier_swap_dst(kvb_tier_t *t, int32_t b) {
    kvb_marks_t *ms = &t->swapdst;
    if (KVB_UNLIKELY(t->pool->flags[b] & KVB_F_INFLIGHT))
        for (int64_t i = 0; i < ms->n; i++)
            if (ms->ids[i] == b) return;
    KVB_ASSERT(ms->n < t->pool->num_blocks); /* each listed block once */
    ms->ids[ms->n++] = b;
    kvb_tier_inflight(t, b);
}

/* Blocks a pair of the coming drain reads or writes after the onloads ran: a swap-out source
 * (KVB_F_SWAP_SRC) would copy the onload's bytes instead of its own; a released swap-in
 * destination (KVB_F_INFLIGHT on a block handed out again) would be overwritten by its swap
 * pair after the onload filled it. Neither may be an onload destination (KVB_F_NOT_ONLOAD,
 * internal.h). */

/* Onload destinations for host hits [from, from + n) of a fresh sequence: blocks no swap pair
 * of the coming drain reads or writes (KVB_F_NOT_ONLOAD). Such a block trades places with
 * another one of a position the forward computes (the forward runs after every swap pair);
 * returns how many leading host hits got a destination. */
int64_t kvb_tier_onload_targets(const kvb_pool_t *p, kvb_row_t *r, int64_t from, int64_t n) {
    int64_t j = from + n; /* the next computed position to trade with */
    for (int64_t i = from; i < from + n; i++) {
        if (!(p->flags[r->blocks[i]] & KVB_F_NOT_ONLOAD)) continue;
        while (j < r->nblocks && (p->flags[r->blocks[j]] & KVB_F_NOT_ONLOAD)) j++;
        if (j == r->nblocks) return i - from;
        int32_t b = r->blocks[i];
        r->blocks[i] = r->blocks[j];
        r->blocks[j++] = b;
    }
    return n;
}

/* ---- the drain -------------------------------------------------------------------------- */
void kvb_tier_settle(kvb_tier_t *t) {
    unmark_all(t->pool, &t->inflight, KVB_F_INFLIGHT);
    unmark_all(t->pool, &t->swapsrc, KVB_F_SWAP_SRC);
    t->swapdst.n = 0; /* their flag is KVB_F_INFLIGHT, cleared above */
    for (int64_t i = 0; i < t->ndeferred; i++) kvb_pool_release(t->host, t->deferred[i]);
    t->ndeferred = 0;
}

void kvb_tier_release_host(kvb_mgr_t *m, const int32_t *ids, int64_t n) {
    kvb_tier_t *t = m->pool->tier;
    for (int64_t i = 0; i < n; i++) {
        if (!t) {
            kvb_pool_release(m->host, ids[i]);
            continue;
        }
        /* a swapped sequence's block is private (ref count 1) and deferred at most once */
        KVB_ASSERT(t->ndeferred < m->host->num_blocks && m->host->ref_count[ids[i]] == 1);
        t->deferred[t->ndeferred++] = ids[i];
    }
}

int64_t kvb_tier_take_offloads(kvb_tier_t *t, int64_t *out) {
    kvb_tier_flush(t); /* before settle: no deferred host block may take a demotion */
    int64_t n = t->noff;
    kvb_copy(out, t->off, (size_t)(2 * n) * sizeof *out);
    t->noff = t->nwt = 0;
    for (int64_t i = 0; i < n; i++) kvb_pool_release(t->host, (int32_t)out[2 * i + 1]);
    kvb_tier_settle(t);
    return n;
}

int kvb_tier_take_onloads(kvb_tier_t *t, int64_t *out, int64_t *n) {
    int64_t ndem = t->pool->log->nev;
    if (t->noff || ndem) { /* an onload may read a host block a pending offload writes */
        t->host->err_a = t->noff + ndem;
        return KVB_EPENDING;
    }
    *n = t->non;
    kvb_copy(out, t->on, (size_t)(2 * t->non) * sizeof *out);
    for (int64_t i = 0; i < t->non; i++) {
        kvb_pool_release(t->host, (int32_t)t->on[2 * i]);
        kvb_pool_release(t->pool, (int32_t)t->on[2 * i + 1]);
    }
    t->non = 0;
    for (int64_t i = 0; i < t->swapsrc.n; i++) t->srcafter[i] = 0; /* later onloads come after */
    return KVB_OK;
}

/* ---- reset ------------------------------------------------------------------------------ */
int kvb_mgr_reset_cache(kvb_mgr_t *m) {
    KVB_CLEAR_ERR(m);
    kvb_pool_t *p = m->pool, *h = m->host;
    kvb_tier_t *t = p->tier;
    if (t) {
        kvb_tier_flush(t); /* evictions since the last flush are host entries (not observable) */
        if (t->noff || t->non) { /* they hold host entries, and an onload a device entry */
            m->err_a = t->noff;
            m->err_b = t->non;
            m->err_what = "host-tier copies are pending";
            return KVB_EPENDING;
        }
    }
    if (p->num_cached != p->num_evictable) {
        m->err_a = p->num_cached - p->num_evictable;
        m->err_b = p->num_cached;
        m->err_what = "cached device blocks are referenced";
        return KVB_ESTATE;
    }
    if (t && h->num_cached != h->num_evictable) { /* only pending pairs hold host entries */
        m->err_a = h->num_cached - h->num_evictable;
        m->err_b = h->num_cached;
        m->err_what = "cached host blocks are referenced";
        return KVB_ESTATE;
    }
    KVB_MUST(kvb_pool_reset_cache(p)); /* validated above: cannot fail */
    if (t) KVB_MUST(kvb_pool_reset_cache(h));
    return KVB_OK;
}

/* ---- check ------------------------------------------------------------------------------ */
#define TFAIL(what, item) do { m->err_what = (what); m->err_b = (item); \
                               return KVB_ECORRUPT; } while (0)

int kvb_tier_check(kvb_mgr_t *const *g, int32_t G, int32_t *refs, int32_t *hrefs) {
    kvb_mgr_t *m = g[0];
    kvb_tier_t *t = m->pool->tier;
    kvb_pool_t *p = m->pool, *h = m->host;
    if (!t) {
        for (int32_t b = 1; b < p->num_blocks; b++)
            if (p->flags[b] & (KVB_F_INFLIGHT | KVB_F_SWAP_SRC))
                TFAIL("in-flight or swap-source flag without a host tier", b);
        if (p->tiered || (h && h->tiered)) TFAIL("pool flagged tiered without a host tier", 0);
        if (p->log) TFAIL("pool keeps a log without a host tier to drain it", 0);
        return KVB_OK;
    }
    if (t->pool != p || t->host != h || !h->caching) TFAIL("host tier not wired to the pools", 0);
    if (!p->tiered || !h->tiered) TFAIL("host tier's pools not flagged tiered", 0);
    for (int64_t i = 0; i < t->noff; i++) {
        int64_t d = t->off[2 * i], hb = t->off[2 * i + 1];
        if (d <= 0 || d >= p->num_blocks || hb <= 0 || hb >= h->num_blocks)
            TFAIL("pending offload holds an out-of-range block", d);
        if (!(h->flags[hb] & KVB_F_CACHED)) TFAIL("offload destination not in the host cache", hb);
        hrefs[hb]++;
    }
    for (int64_t i = 0; i < t->non; i++) {
        int64_t hb = t->on[2 * i], d = t->on[2 * i + 1];
        if (d <= 0 || d >= p->num_blocks || hb <= 0 || hb >= h->num_blocks)
            TFAIL("pending onload holds an out-of-range block", d);
        if (!(h->flags[hb] & KVB_F_CACHED)) TFAIL("onload source not in the host cache", hb);
        if (!(p->flags[d] & KVB_F_WRITTEN)) TFAIL("onload destination not flagged written", d);
        /* the onloads run before the swap pairs: a block one of them reads or writes later in
         * the drain is never an onload's destination */
        if (p->flags[d] & KVB_F_SWAP_SRC) /* fine if the onload was queued first */
            for (int64_t j = 0; j < t->swapsrc.n; j++)
                if (t->swapsrc.ids[j] == d && i >= t->srcafter[j])
                    TFAIL("onload destination is a released swap-out source", d);
        for (int64_t j = 0; j < t->swapdst.n; j++)
            if (t->swapdst.ids[j] == d) TFAIL("onload destination is a swap-in destination", d);
        hrefs[hb]++;
        refs[d]++;
    }
    for (int64_t i = 0; i < t->ndeferred; i++) {
        int32_t hb = t->deferred[i];
        if (hb <= 0 || hb >= h->num_blocks || (h->flags[hb] & KVB_F_CACHED))
            TFAIL("deferred host block out of range or cached", hb);
        hrefs[hb]++;
    }
    const kvb_plog_t *lg = p->log;
    if (!lg) TFAIL("host tier without the device pool's log", 0);
    if (lg->nev < 0 || lg->nev > lg->evcap) TFAIL("pending demotions beyond capacity", lg->nev);
    if (lg->nins) TFAIL("insertion records not drained by the tier (absorb)", lg->ins[0]);
    if (lg->inserts != t->write_through) TFAIL("log keeps insertions without write-through", 0);
    if (t->nwt < 0 || t->nwt > t->noff) TFAIL("write-through count beyond the offloads", t->nwt);
    for (int64_t i = 0; i < lg->nev; i++)
        if (lg->ev[i].block <= 0 || lg->ev[i].block >= p->num_blocks)
            TFAIL("pending demotion of an out-of-range block", lg->ev[i].block);
    if (!marks_agree(p, &t->inflight, KVB_F_INFLIGHT)) TFAIL("in-flight flags != list", 0);
    if (!marks_agree(p, &t->swapsrc, KVB_F_SWAP_SRC)) TFAIL("swap-source flags != list", 0);
    for (int64_t i = 0; i < t->swapdst.n; i++) {
        int32_t b = t->swapdst.ids[i];
        if (b <= 0 || b >= p->num_blocks || !(p->flags[b] & KVB_F_INFLIGHT))
            TFAIL("swap-in destination out of range or not in flight", b);
        for (int64_t j = 0; j < i; j++)
            if (t->swapdst.ids[j] == b) TFAIL("swap-in destination listed twice", b);
    }
    /* swapped sequences and the host cache share the pool: a swapped block is referenced (never
     * evicted) and never a cache entry */
    for (int32_t i = 0; i < m->scap; i++) {
        const kvb_seq_t *s = &m->seqs[i];
        if (!(s->gen & 1u) || !s->swapped) continue;
        for (int32_t k = 0; k < G; k++) {
            const kvb_row_t *r = row_of(g[k], i);
            for (int32_t j = r->lo; j < r->nblocks; j++)
                if (h->flags[r->blocks[j]] & (KVB_F_CACHED | KVB_F_FREE))
                    TFAIL("swapped sequence's host block is cached or free", r->blocks[j]);
        }
    }
    return KVB_OK;
}
