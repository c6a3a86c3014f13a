/* pool.c -- the physical block pool: ref counts and an intrusive doubly linked free list.
 *
 * Metadata is structure-of-arrays, one entry per block: ref_count, prev/next (the free-list
 * links, int32 block ids, KVB_NONE at the ends), hash and flags. A block is in the free list
 * iff its ref count is 0 (flag KVB_F_FREE), except the null block 0, which is never listed,
 * never handed out, freed or cached.
 *
 * The free list is ordered by reuse: allocate() pops from the head. A block whose last
 * reference goes away is pushed at the head when it holds no prefix-cache entry (so it is
 * reused first and does not flush real cache entries) and at the tail when it does (lazy
 * eviction in least-recently-released order). Popping a cached block evicts its entry. A
 * cache hit on an evictable block unlinks it from the middle: every list operation is O(1).
 *
 * A pool of the null block alone (num_blocks == 1, kvb_pool_init_any) has an empty free list:
 * nothing to allocate, free or cache.
 *
 * The pool is a plain data structure: it names no policy and no reader above it. Eviction
 * order is LRU by release unless a policy is given (p->victim, policy.c: the groups' second
 * chance); what leaves the cache is recorded in the pool's log (p->log, kept once a reader
 * asked for it), which the host tier drains at its own layer (tier.c).
 *
 * Invariants (kvb_pool_check verifies all of them):
 *   num_free == length of the list == #{b != 0 : ref_count[b] == 0}
 *   num_cached == #{b : flags[b] & CACHED}; num_cached + nx == entries in the hash table
 *   num_evictable == #{b : CACHED and FREE}
 *   every cached block is found in the table under its hash, every secondary record under
 *   its key, and a record is live iff its cached owner's list links it (cache.c).
 */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- free-list primitives --------------------------------------------------------------- */
KVB_INLINE void list_push_head(kvb_pool_t *p, int32_t b) {
    KVB_ASSERT(b > 0 && b < p->num_blocks && !(p->flags[b] & KVB_F_FREE) && p->ref_count[b] == 0);
    p->prev[b] = KVB_NONE;
    p->next[b] = p->free_head;
    if (p->free_head != KVB_NONE) p->prev[p->free_head] = b;
    else p->free_tail = b;
    p->free_head = b;
    p->flags[b] |= KVB_F_FREE;
    p->num_free++;
}

KVB_INLINE void list_push_tail(kvb_pool_t *p, int32_t b) {
    KVB_ASSERT(b > 0 && b < p->num_blocks && !(p->flags[b] & KVB_F_FREE) && p->ref_count[b] == 0);
    p->next[b] = KVB_NONE;
    p->prev[b] = p->free_tail;
    if (p->free_tail != KVB_NONE) p->next[p->free_tail] = b;
    else p->free_head = b;
    p->free_tail = b;
    p->flags[b] |= KVB_F_FREE;
    p->num_free++;
}

static void unlink_free(kvb_pool_t *p, int32_t b) {
    KVB_ASSERT(b > 0 && b < p->num_blocks && (p->flags[b] & KVB_F_FREE));
    int32_t pr = p->prev[b], nx = p->next[b];
    if (pr != KVB_NONE) p->next[pr] = nx; else p->free_head = nx;
    if (nx != KVB_NONE) p->prev[nx] = pr; else p->free_tail = pr;
    p->prev[b] = p->next[b] = KVB_NONE;
    p->flags[b] &= (uint8_t)~KVB_F_FREE;
    p->num_free--;
    if (p->chance) p->chance[b] = 0; /* a new stay in the list, a new chance */
}

static void move_to_head(kvb_pool_t *p, int32_t b) {
    unlink_free(p, b);
    list_push_head(p, b);
}

/* ---- lifecycle -------------------------------------------------------------------------- */
int kvb_pool_init(kvb_pool_t *p, int32_t num_blocks, int caching) {
    if (num_blocks < 2) {
        memset(p, 0, sizeof *p);
        return KVB_EINVAL;
    }
    return kvb_pool_init_any(p, num_blocks, caching);
}

int kvb_pool_init_any(kvb_pool_t *p, int32_t num_blocks, int caching) {
    memset(p, 0, sizeof *p);
    if (num_blocks < 1) return KVB_EINVAL;
    uint64_t tsize = 8;
    while (tsize < 2 * (uint64_t)num_blocks) tsize <<= 1;
    size_t n = (size_t)num_blocks;
    p->ref_count = calloc(n, sizeof *p->ref_count);
    p->prev = malloc(n * sizeof *p->prev);
    p->next = malloc(n * sizeof *p->next);
    p->hash = malloc(n * sizeof *p->hash);
    p->flags = calloc(n, sizeof *p->flags);
    p->gid = calloc(n, sizeof *p->gid);
    p->table = malloc(tsize * sizeof *p->table);
    if (!p->ref_count || !p->prev || !p->next || !p->hash || !p->flags || !p->gid || !p->table) {
        kvb_pool_destroy(p);
        return KVB_ENOMEM;
    }
    memset(p->table, 0xff, tsize * sizeof *p->table); /* all KVB_NONE */
    p->num_blocks = num_blocks;
    p->table_mask = tsize - 1;
    p->xfree = KVB_NONE; /* no secondary records until the first (cache.c) */
    p->events.max_pending = (int64_t)1 << 20;
    p->caching = caching;
    /* free list 1, 2, ..., N-1 in order; the null block 0 is never listed */
    for (int32_t b = 1; b < num_blocks; b++) {
        p->prev[b] = b - 1;
        p->next[b] = b + 1;
        p->flags[b] = KVB_F_FREE;
    }
    p->prev[0] = p->next[0] = KVB_NONE;
    if (num_blocks == 1) { /* the null block alone: an empty free list */
        p->free_head = p->free_tail = KVB_NONE;
        return KVB_OK;
    }
    p->prev[1] = KVB_NONE;
    p->next[num_blocks - 1] = KVB_NONE;
    p->free_head = 1;
    p->free_tail = num_blocks - 1;
    p->num_free = num_blocks - 1;
    return KVB_OK;
}

void kvb_pool_destroy(kvb_pool_t *p) {
    free(p->gtag);
    p->gtag = NULL;
    free(p->ref_count); free(p->prev); free(p->next); free(p->hash); free(p->flags);
    free(p->gid); free(p->table); free(p->dnext);
    free(p->xhead); free(p->xblock); free(p->xnext); free(p->xcheck);
    free(p->chance); free(p->policy);
    kvb_pool_log_off(p);
    kvb_events_destroy(&p->events);
    memset(p, 0, sizeof *p);
}

size_t kvb_pool_bytes(const kvb_pool_t *p) {
    size_t n = (size_t)p->num_blocks, x = (size_t)p->xcap; /* x: secondary records */
    return n * (sizeof *p->ref_count + sizeof *p->prev + sizeof *p->next + sizeof *p->hash +
                sizeof *p->flags + sizeof *p->gid) +
           (size_t)(p->table_mask + 1) * sizeof *p->table + sizeof *p +
           (p->dnext ? (n + x) * sizeof *p->dnext : 0) +
           (p->xhead ? n * sizeof *p->xhead : 0) +
           x * (sizeof *p->hash + sizeof *p->xblock + sizeof *p->xnext + 4 * sizeof *p->xcheck);
}

/* ---- the log: what leaves and enters the cache, for a reader above (internal.h) ------- */
int kvb_pool_log_on(kvb_pool_t *p, int32_t block_size, int inserts) {
    if (p->log) return KVB_OK;
    kvb_plog_t *lg = calloc(1, sizeof *lg);
    if (!lg) return KVB_ENOMEM;
    size_t n = (size_t)p->num_blocks, bs = (size_t)block_size;
    lg->block_size = block_size;
    lg->inserts = inserts != 0;
    lg->parent = calloc(n, sizeof *lg->parent);
    lg->has_tokens = calloc(n, sizeof *lg->has_tokens);
    lg->tokens = n <= SIZE_MAX / sizeof *lg->tokens / bs ? malloc(n * bs * sizeof *lg->tokens) : NULL;
    /* one eviction per block between drains on the manager's path fits without growing */
    lg->ev = malloc(n * sizeof *lg->ev);
    lg->evtok = lg->tokens ? malloc(n * bs * sizeof *lg->evtok) : NULL;
    lg->evcap = (int64_t)n;
    p->log = lg;
    if (!lg->parent || !lg->has_tokens || !lg->tokens || !lg->ev || !lg->evtok) {
        kvb_pool_log_off(p);
        return KVB_ENOMEM;
    }
    return KVB_OK;
}

void kvb_pool_log_off(kvb_pool_t *p) {
    kvb_plog_t *lg = p->log;
    if (!lg) return;
    free(lg->parent); free(lg->has_tokens); free(lg->tokens); free(lg->ev); free(lg->evtok);
    free(lg->ins); free(lg->ins_stamp);
    free(lg);
    p->log = NULL;
}

/* Record the eviction of b's entry (before it is forgotten): what a reader needs once b is
 * reused. Content in flight has nothing to copy: counted, not recorded (as a full log). */
KVB_NOINLINE static void log_eviction(kvb_pool_t *p, int32_t b) {
    kvb_plog_t *lg = p->log;
    if ((p->flags[b] & KVB_F_INFLIGHT) ||
        (KVB_UNLIKELY(lg->nev == lg->evcap) &&
         kvb_grow((void **)&lg->ev, &lg->evcap, lg->nev + 1, sizeof *lg->ev))) {
        lg->lost++;
        return;
    }
    kvb_demotion_t *d = &lg->ev[lg->nev];
    d->hash = p->hash[b];
    d->block = b;
    d->gid = p->gid[b];
    d->has_tokens = 0;
    d->parent = lg->parent[b];
    if (lg->has_tokens[b] && lg->nev < (int64_t)p->num_blocks) { /* evtok's rows */
        memcpy(lg->evtok + lg->nev * lg->block_size, lg->tokens + (size_t)b * lg->block_size,
               (size_t)lg->block_size * sizeof *lg->evtok);
        d->has_tokens = 1;
    }
    lg->nev++;
}

/* A free block goes to the tail of the free list (an eviction policy's second chance). */
void kvb_pool_requeue(kvb_pool_t *p, int32_t b) {
    KVB_ASSERT(p->flags[b] & KVB_F_FREE);
    unlink_free(p, b);
    list_push_tail(p, b);
}

/* ---- allocate / free / incref ----------------------------------------------------------- */
/* A popped block's cached entry goes now (lazy eviction), recorded in the log if one is kept. */
KVB_NOINLINE static void evict_popped(kvb_pool_t *p, int32_t b) {
    if (p->log) log_eviction(p, b); /* a reader above drains it (the host tier) */
    kvb_cache_forget(p, b);
    p->num_evictable--;
    p->stats.evictions++;
}

/* Allocation under an eviction policy (p->victim may reorder the list's head). */
KVB_NOINLINE static void allocate_policy(kvb_pool_t *p, int32_t n, int32_t *out) {
    for (int32_t i = 0; i < n; i++) {
        int32_t b = p->free_head;
        if (p->flags[b] & KVB_F_CACHED) b = p->victim(p);
        int32_t nx = p->next[b];
        p->free_head = nx;
        if (nx != KVB_NONE) p->prev[nx] = KVB_NONE;
        uint8_t f = p->flags[b];
        p->flags[b] = f & (uint8_t)~(KVB_F_FREE | KVB_F_WRITTEN);
        if (f & KVB_F_CACHED) evict_popped(p, b);
        p->ref_count[b] = 1;
        if (p->chance) p->chance[b] = 0;
        out[i] = b;
    }
}

int kvb_pool_allocate(kvb_pool_t *p, int32_t n, int32_t *out) {
    if (KVB_UNLIKELY(n < 0)) { p->err_a = 0; p->err_b = n; return KVB_EINVAL; }
    if (KVB_UNLIKELY(n > p->num_free)) {
        p->err_a = n;
        p->err_b = p->num_free;
        return KVB_EOUTOFBLOCKS;
    }
    if (KVB_UNLIKELY(p->victim != NULL)) {
        allocate_policy(p, n, out);
    } else {
        /* the hot loop: pop n from the head, kept in a register. Only the output is restrict
         * (it could otherwise alias the links and counts); the arrays are not, since the
         * eviction path writes them through p. */
        int32_t *next = p->next;
        int32_t *ref = p->ref_count;
        uint8_t *flags = p->flags;
        int32_t *restrict o = out;
        int32_t b = p->free_head;
        for (int32_t i = 0; i < n; i++) {
            uint8_t f = flags[b];
            flags[b] = f & (uint8_t)~(KVB_F_FREE | KVB_F_WRITTEN);
            ref[b] = 1;
            o[i] = b;
            if (KVB_UNLIKELY(f & KVB_F_CACHED)) evict_popped(p, b);
            b = next[b];
        }
        p->free_head = b;
        if (b != KVB_NONE) p->prev[b] = KVB_NONE;
    }
    if (p->free_head == KVB_NONE) p->free_tail = KVB_NONE;
    p->num_free -= n;
    p->stats.allocations += (uint64_t)n;
    return KVB_OK;
}

/* A block whose ref count just reached 0 joins the free list: cached ones at the tail
 * (evicted last, least recently released first), the others at the head (reused first). */
KVB_INLINE void link_free(kvb_pool_t *p, int32_t b) {
    if (p->flags[b] & KVB_F_CACHED) {
        list_push_tail(p, b);
        p->num_evictable++;
    } else {
        list_push_head(p, b);
    }
    p->stats.frees++;
}

void kvb_pool_release(kvb_pool_t *p, int32_t b) {
    KVB_ASSERT(b > 0 && b < p->num_blocks && p->ref_count[b] > 0);
    if (--p->ref_count[b] == 0) link_free(p, b);
}

/* Undo the first n drops of kvb_pool_free, last first: a block that reached 0 is the one most
 * recently linked (at the head if never cached, else at the tail), so unlinking it restores
 * the list exactly. */
KVB_NOINLINE static void unfree(kvb_pool_t *p, const int32_t *ids, int64_t n) {
    for (int64_t j = n - 1; j >= 0; j--) {
        int32_t b = ids[j];
        if (p->ref_count[b] == 0) {
            unlink_free(p, b);
            if (p->flags[b] & KVB_F_CACHED) p->num_evictable--;
            p->stats.frees--;
        }
        p->ref_count[b]++;
    }
}

int kvb_pool_free(kvb_pool_t *p, const int32_t *ids, int64_t n) {
    /* one pass: drop each reference and link the block when it reaches 0; a bad id undoes
     * the drops before it (all-or-nothing). Never-cached blocks are pushed at the head inline,
     * with the head in a register: prev[] of a pushed block is written by the next push, so
     * only the final head's is set (fix_head), also before any helper reads the list. The
     * loop walks a pointer (no index beside it) to keep the four arrays in registers. */
    int32_t *ref = p->ref_count; /* (not restrict: list_push_tail writes them through p) */
    int32_t *next = p->next;
    int32_t *prev = p->prev;
    uint8_t *flags = p->flags;
    const uint32_t last = (uint32_t)p->num_blocks - 1u;
    int32_t head = p->free_head, pushed = 0;
#define fix_head() do { p->free_head = head; if (head != KVB_NONE) prev[head] = KVB_NONE; \
                        p->num_free += pushed; p->stats.frees += (uint64_t)pushed; \
                        pushed = 0; } while (0)
    const int32_t *end = ids + (n > 0 ? n : 0);
    for (const int32_t *q = ids; q < end; q++) {
        int32_t b = *q;
        int32_t r = KVB_LIKELY((uint32_t)b - 1u < last) ? ref[b] - 1 : -1;
        if (KVB_UNLIKELY(r < 0)) {
            int64_t i = q - ids;
            fix_head();
            unfree(p, ids, i);
            p->err_a = i;
            p->err_b = b;
            return ((uint32_t)b - 1u >= last) ? KVB_ERANGE : KVB_ESTATE;
        }
        ref[b] = r;
        if (r) continue;
        uint8_t f = flags[b];
        if (KVB_UNLIKELY(f & KVB_F_CACHED)) { /* the tail, through the helper */
            fix_head();
            list_push_tail(p, b);
            p->num_evictable++;
            head = p->free_head;
            p->stats.frees++;
        } else { /* the head, inline */
            next[b] = head;
            if (KVB_LIKELY(head != KVB_NONE)) prev[head] = b;
            else p->free_tail = b;
            head = b;
            flags[b] = f | KVB_F_FREE;
            pushed++;
        }
    }
    fix_head();
#undef fix_head
    return KVB_OK;
}

int kvb_pool_incref(kvb_pool_t *p, const int32_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (KVB_UNLIKELY(b <= 0 || b >= p->num_blocks)) {
            p->err_a = i; p->err_b = b;
            return KVB_ERANGE;
        }
        if (KVB_UNLIKELY(p->ref_count[b] == 0 && !(p->flags[b] & KVB_F_CACHED))) {
            p->err_a = i; p->err_b = b;
            return KVB_ESTATE;
        }
        if (KVB_UNLIKELY(p->ref_count[b] > INT32_MAX - n)) { /* even if b repeats n times */
            p->err_a = i; p->err_b = b;
            return KVB_EINVAL;
        }
    }
    kvb_pool_pin(p, ids, n); /* pins evictable cached blocks too */
    return KVB_OK;
}

/* vLLM's BlockPool.touch: one reference more for each id; a free block, cached or not, leaves
 * the free list (its flags and any entry stay). Validated first (range, not null, no ref count
 * overflow even when an id repeats): all-or-nothing. */
int kvb_pool_touch(kvb_pool_t *p, const int32_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (KVB_UNLIKELY(b <= 0 || b >= p->num_blocks)) {
            p->err_a = i; p->err_b = b;
            return KVB_ERANGE;
        }
        if (KVB_UNLIKELY(p->ref_count[b] > INT32_MAX - n)) {
            p->err_a = i; p->err_b = b;
            return KVB_EINVAL;
        }
    }
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (p->ref_count[b]++ == 0) { /* free: leaves the list, at any place in it */
            unlink_free(p, b);
            if (p->flags[b] & KVB_F_CACHED) p->num_evictable--;
        }
    }
    return KVB_OK;
}

/* kvb_pool_free with the placement chosen by the caller instead of by the cache entry
 * (vLLM's free_blocks(evict_first=True), and release to the tail): every block reaching 0
 * goes to the head (KVB_PLACE_HEAD: ids[0] ends first, as a batch put in front) or to the
 * tail (KVB_PLACE_TAIL, in the order given); a cached one keeps its entry and is evictable.
 * All-or-nothing: the drops are made first and undone on a bad id; a repeated id is linked
 * once, where its last drop brings it to 0. */
int kvb_pool_free_placed(kvb_pool_t *p, const int32_t *ids, int64_t n, int where) {
    if (KVB_UNLIKELY(where != KVB_PLACE_HEAD && where != KVB_PLACE_TAIL &&
                     where != KVB_PLACE_VLLM)) {
        p->err_a = 0; p->err_b = where;
        return KVB_EINVAL;
    }
    const uint32_t last = (uint32_t)p->num_blocks - 1u;
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (KVB_UNLIKELY((uint32_t)b - 1u >= last || p->ref_count[b] <= 0)) {
            for (int64_t j = 0; j < i; j++) p->ref_count[ids[j]]++;
            p->err_a = i; p->err_b = b;
            return ((uint32_t)b - 1u >= last) ? KVB_ERANGE : KVB_ESTATE;
        }
        p->ref_count[b]--;
    }
    /* link each block that reached 0 once: walking from the end, its first sight is its
     * last drop; the head takes them last first so that ids[0] ends in front */
    if (where == KVB_PLACE_VLLM) { /* vLLM's order: uncached to the head, cached to the tail */
        for (int64_t i = n - 1; i >= 0; i--) { /* the uncached, a batch in front */
            int32_t b = ids[i];
            if (p->ref_count[b] || (p->flags[b] & (KVB_F_FREE | KVB_F_CACHED))) continue;
            list_push_head(p, b);
            p->stats.frees++;
        }
        for (int64_t i = 0; i < n; i++) /* the cached: where each last reaches 0, in order */
            if (p->flags[ids[i]] & KVB_F_CACHED) p->ref_count[ids[i]]++;
        for (int64_t i = 0; i < n; i++) {
            int32_t b = ids[i];
            if (!(p->flags[b] & KVB_F_CACHED) || --p->ref_count[b]) continue;
            list_push_tail(p, b);
            p->num_evictable++;
            p->stats.frees++;
        }
    } else if (where == KVB_PLACE_HEAD) {
        for (int64_t i = n - 1; i >= 0; i--) {
            int32_t b = ids[i];
            if (p->ref_count[b] || (p->flags[b] & KVB_F_FREE)) continue;
            list_push_head(p, b);
            if (p->flags[b] & KVB_F_CACHED) p->num_evictable++;
            p->stats.frees++;
        }
    } else { /* validated: drop again in order, each linked as its count reaches 0 */
        for (int64_t i = 0; i < n; i++) p->ref_count[ids[i]]++;
        for (int64_t i = 0; i < n; i++) {
            int32_t b = ids[i];
            if (--p->ref_count[b]) continue;
            list_push_tail(p, b);
            if (p->flags[b] & KVB_F_CACHED) p->num_evictable++;
            p->stats.frees++;
        }
    }
    return KVB_OK;
}

/* vLLM's evict_blocks: drop the cache entry of each listed block that has one (validated
 * first: range, not null). A free block keeps its place in the free list (now never-cached:
 * it is no longer counted evictable); a referenced one joins the head when freed, as any
 * block without an entry. Returns the entries dropped, or a negative code. */
int64_t kvb_pool_uncache_ids(kvb_pool_t *p, const int32_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (KVB_UNLIKELY(b <= 0 || b >= p->num_blocks)) {
            p->err_a = i; p->err_b = b;
            return KVB_ERANGE;
        }
    }
    int64_t dropped = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        if (!(p->flags[b] & KVB_F_CACHED)) continue;
        kvb_cache_forget(p, b);
        if (p->flags[b] & KVB_F_FREE) p->num_evictable--;
        dropped++;
    }
    return dropped;
}

void kvb_pool_pin(kvb_pool_t *p, const int32_t *ids, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        int32_t b = ids[i];
        KVB_ASSERT(b > 0 && b < p->num_blocks);
        if (p->ref_count[b]++ == 0) { /* evictable: leaves the free list */
            KVB_ASSERT(p->flags[b] & KVB_F_CACHED);
            unlink_free(p, b);
            p->num_evictable--;
        }
    }
}

void kvb_pool_uncache(kvb_pool_t *p, int32_t b) {
    if (!(p->flags[b] & KVB_F_CACHED)) return;
    kvb_cache_forget(p, b);
    if (p->flags[b] & KVB_F_FREE) { /* was evictable: now never-cached, reused first */
        p->num_evictable--;
        move_to_head(p, b);
    }
}

int64_t kvb_pool_lookup_pin(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n, int32_t *out) {
    int64_t k = kvb_cache_lookup(p, hashes, n, out);
    kvb_pool_pin(p, out, k);
    return k;
}

int kvb_pool_reset_cache(kvb_pool_t *p) {
    KVB_CLEAR_ERR(p);
    if (p->num_cached != p->num_evictable) {
        p->err_a = p->num_cached - p->num_evictable;
        p->err_b = p->num_cached;
        return KVB_ESTATE;
    }
    for (int32_t b = 1; b < p->num_blocks; b++) /* every cached block is free: reused first */
        if (p->flags[b] & KVB_F_CACHED) move_to_head(p, b);
    kvb_cache_clear(p);
    p->num_evictable = 0;
    return KVB_OK;
}

/* kvb_pool_reset_cache leaving every block where it is in the free list (vLLM's
 * reset_prefix_cache): the same check and events, no block moved. */
int kvb_pool_reset_cache_keep_order(kvb_pool_t *p) {
    KVB_CLEAR_ERR(p);
    if (p->num_cached != p->num_evictable) {
        p->err_a = p->num_cached - p->num_evictable;
        p->err_b = p->num_cached;
        return KVB_ESTATE;
    }
    kvb_cache_clear(p);
    p->num_evictable = 0;
    return KVB_OK;
}

int kvb_pool_try_reset_cache(kvb_pool_t *p, int keep_order) {
    KVB_CLEAR_ERR(p);
    if (p->num_free != p->num_blocks - 1) return 0; /* a block is in use: vLLM's False */
    int rc = keep_order ? kvb_pool_reset_cache_keep_order(p) : kvb_pool_reset_cache(p);
    KVB_ASSERT(rc == KVB_OK); /* every cached block is free */
    (void)rc;
    return 1;
}

int kvb_pool_move_entry(kvb_pool_t *p, int32_t src, int32_t dst) {
    KVB_CLEAR_ERR(p);
    const uint32_t last = (uint32_t)p->num_blocks - 1u;
    if (KVB_UNLIKELY((uint32_t)src - 1u >= last || (uint32_t)dst - 1u >= last)) {
        p->err_a = src; p->err_b = dst;
        return KVB_ERANGE;
    }
    if (KVB_UNLIKELY(src == dst)) {
        p->err_a = src; p->err_b = dst;
        return KVB_EINVAL;
    }
    if (KVB_UNLIKELY(!(p->flags[src] & KVB_F_CACHED) || (p->flags[dst] & KVB_F_CACHED) ||
                     p->ref_count[dst] <= 0)) {
        p->err_a = src; p->err_b = dst;
        return KVB_ESTATE;
    }
    if (p->flags[src] & KVB_F_FREE) p->num_evictable--; /* src stays listed, never-cached */
    kvb_cache_move(p, src, dst);
    return KVB_OK;
}

/* ---- invariant check -------------------------------------------------------------------- */
#define FAIL(what, item) do { p->err_what = (what); p->err_a = 0; p->err_b = (item); \
                             return KVB_ECORRUPT; } while (0)

/* A live entry: a cached block's primary, or a live secondary record of a cached block. */
static int entry_ok(const kvb_pool_t *p, int32_t e) {
    int32_t N = p->num_blocks;
    if (e >= N && e - N < p->xcap) e = p->xblock[e - N];
    else if (e >= N) return 0;
    return e > 0 && e < N && (p->flags[e] & KVB_F_CACHED);
}

/* The secondary records: each owner's list (only cached blocks have one) links live records
 * it owns, each found in the table under its key; the free records are the rest. */
static int check_secondaries(kvb_pool_t *p) {
    int32_t N = p->num_blocks;
    if (!p->xhead) {
        if (p->nx || p->xcap) FAIL("secondary records without their lists", p->nx);
        return KVB_OK;
    }
    int64_t listed = 0, live = 0, nfree = 0;
    for (int32_t b = 0; b < N; b++) {
        int32_t r = p->xhead[b];
        if (r != KVB_NONE && (b == 0 || !(p->flags[b] & KVB_F_CACHED))) FAIL("uncached block holds secondary keys", b);
        for (; r != KVB_NONE; r = p->xnext[r]) {
            if (r < 0 || r >= p->xcap || p->xblock[r] != b) FAIL("secondary list links a record of another owner", r);
            if (!kvb_cache_holds(p, N + r)) FAIL("secondary key not found under its key", r);
            if (p->hash[N + r].lo == p->hash[b].lo && p->hash[N + r].hi == p->hash[b].hi) FAIL("secondary key repeats its block's primary", r);
            if (++listed > p->xcap) FAIL("secondary list has a cycle", b);
        }
    }
    for (int32_t r = 0; r < p->xcap; r++) live += p->xblock[r] != KVB_NONE;
    for (int32_t r = p->xfree; r != KVB_NONE; r = p->xnext[r]) {
        if (r < 0 || r >= p->xcap || p->xblock[r] != KVB_NONE) FAIL("free secondary records hold a live one", r);
        if (++nfree > p->xcap) FAIL("free secondary records have a cycle", r);
    }
    if (listed != p->nx || live != p->nx) FAIL("secondary records listed or live != nx", listed);
    if (nfree + p->nx != p->xcap) FAIL("secondary records free + live != allocated", nfree);
    return KVB_OK;
}

int kvb_pool_check(kvb_pool_t *p) {
    KVB_CLEAR_ERR(p);
    int32_t N = p->num_blocks;
    if (p->ref_count[0] != 0 || p->flags[0] != 0) FAIL("null block 0 is referenced or flagged", 0);
    /* walk the list */
    int64_t len = 0, evictable = 0;
    int32_t prev = KVB_NONE;
    for (int32_t b = p->free_head; b != KVB_NONE; b = p->next[b]) {
        if (b <= 0 || b >= N) FAIL("free list holds an out-of-range id", b);
        if (p->prev[b] != prev) FAIL("free list prev link broken", b);
        if (p->ref_count[b] != 0 || !(p->flags[b] & KVB_F_FREE)) FAIL("listed block is referenced or not flagged free", b);
        if (p->flags[b] & KVB_F_CACHED) evictable++;
        prev = b;
        if (++len > N) FAIL("free list has a cycle", len); /* cycle */
    }
    if (prev != p->free_tail) FAIL("free list tail is wrong", prev);
    if (len != p->num_free) FAIL("free list length != num_free", len);
    if (evictable != p->num_evictable) FAIL("evictable count != num_evictable", evictable);
    int64_t free_blocks = 0, cached = 0;
    for (int32_t b = 1; b < N; b++) {
        if (p->ref_count[b] < 0 || (p->flags[b] & KVB_F_MARK)) FAIL("negative ref count or stale mark bit", b);
        if ((p->ref_count[b] == 0) != ((p->flags[b] & KVB_F_FREE) != 0)) FAIL("ref count 0 <=> flagged free does not hold", b);
        free_blocks += p->ref_count[b] == 0;
        if (p->flags[b] & KVB_F_CACHED) {
            cached++;
            if (!(p->flags[b] & KVB_F_WRITTEN)) FAIL("cached block whose K/V were never written", b);
            if (!p->caching) FAIL("block cached while caching is off", b);
            if (!kvb_cache_holds(p, b)) FAIL("cached block not found under its hash", b);
        }
    }
    if (free_blocks != p->num_free) FAIL("free blocks != num_free", free_blocks);
    if (cached != p->num_cached) FAIL("cached blocks != num_cached", cached);
    int64_t entries = 0, all = p->num_cached + (int64_t)p->nx;
    if (2 * ((int64_t)N - 1 + p->nx) > (int64_t)(p->table_mask + 1)) FAIL("hash table more than half full", p->nx);
    for (uint64_t s = 0; s <= p->table_mask; s++) {
        int32_t b = p->table[s];
        if (b == KVB_NONE) continue;
        if (!entry_ok(p, b)) FAIL("hash table holds an uncached or bad block", b);
        entries++;
        for (int32_t c = p->dnext ? p->dnext[b] : KVB_NONE; c != KVB_NONE; c = p->dnext[c]) {
            if (!entry_ok(p, c)) FAIL("duplicate chain holds an uncached or bad block", c);
            if (p->hash[c].lo != p->hash[b].lo || p->hash[c].hi != p->hash[b].hi) FAIL("duplicate chain mixes keys", c);
            if (++entries > all) FAIL("duplicate chain has a cycle or extra blocks", c);
        }
    }
    if (entries != p->num_cached + (int64_t)p->nx) FAIL("hash table entries (with duplicates) != num_cached + secondaries", entries);
    return check_secondaries(p);
}

void kvb_pool_event_hash(const kvb_pool_t *p, int32_t b, kvb_hash_t *out) {
    *out = p->hash[b];
    if (p->gtag) {
        out->lo ^= p->gtag[p->gid[b]].lo;
        out->hi ^= p->gtag[p->gid[b]].hi;
    }
}
