/* cache.c -- the prefix cache: an open-addressing hash table from block hash to block id.
 *
 * The table holds int32 block ids only; the 128-bit keys live in the pool's hash[] array, so
 * a slot costs 4 bytes and the table stays at most half full (size >= 2 * num_blocks, each
 * block holds at most one entry). Linear probing from hash.lo; deletion shifts the following
 * run back (no tombstones), so lookups never slow down as blocks churn.
 *
 * Ownership: this file owns the table, the CACHED bit and num_cached. It never touches the free
 * list or its counters (num_free, num_evictable: pool.c), so pool.c calls in here and never
 * the other way round. With the pool's log kept (p->log, internal.h) it also owns the log's
 * lineage (each entry's parent and tokens) and its insertion records, which the log's reader
 * (the host tier) drains after the call that cached returned: nothing here names the reader.
 *
 * Policy: a hash maps to one block for lookups. Registering a hash that is already present
 * keeps the first block (the newcomer stays an ordinary uncached block and is reused first once
 * freed), so lookups stay deterministic. With p->dup_insert the newcomer is cached too, as a
 * duplicate entry (vLLM keeps several blocks per key and lookups return the earliest): the
 * table holds the key's first block, and dnext[] chains the others in insertion order; a
 * removal unlinks the block from its chain (the table slot takes the next block when the first
 * goes), so the earliest remaining block always answers. dnext[] exists only once a duplicate
 * was asked for: a pool without duplicates pays one NULL test per removal.
 *
 * Eviction is lazy: a cached block whose ref count reaches 0 stays in the table and in the free
 * list (see pool.c) until allocation pops it, which drops its entry (kvb_cache_forget).
 */
#include <string.h>

#include "internal.h"

KVB_INLINE int hash_eq(const kvb_hash_t *a, const kvb_hash_t *b) {
    return a->lo == b->lo && a->hi == b->hi;
}

int32_t kvb_cache_find(const kvb_pool_t *p, const kvb_hash_t *h) {
    uint64_t mask = p->table_mask, i = h->lo & mask;
    for (;;) {
        int32_t b = p->table[i];
        if (b == KVB_NONE || hash_eq(&p->hash[b], h)) return b;
        i = (i + 1) & mask;
    }
}

static void table_remove(kvb_pool_t *p, int32_t b) {
    uint64_t mask = p->table_mask, i = p->hash[b].lo & mask;
    while (p->table[i] != b) i = (i + 1) & mask;
    /* backward-shift deletion */
    uint64_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        int32_t c = p->table[j];
        if (c == KVB_NONE) break;
        uint64_t home = p->hash[c].lo & mask;
        /* c may move to i iff its home is not cyclically within (i, j] */
        int stays = (i <= j) ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            p->table[i] = c;
            i = j;
        }
    }
    p->table[i] = KVB_NONE;
}

/* The table slot holding block b (b is a chain's first block). */
static uint64_t table_slot(const kvb_pool_t *p, int32_t b) {
    uint64_t mask = p->table_mask, i = p->hash[b].lo & mask;
    while (p->table[i] != b) i = (i + 1) & mask;
    return i;
}

int kvb_cache_holds(const kvb_pool_t *p, int32_t b) {
    int32_t c = kvb_cache_find(p, &p->hash[b]);
    if (c == KVB_NONE || !p->dnext) return c == b;
    for (int32_t k = 0; c != KVB_NONE && k < p->num_blocks; c = p->dnext[c], k++)
        if (c == b) return 1;
    return 0;
}

/* Take b (cached) out of the table or its key's chain; flags and counters untouched. */
static void entry_unlink(kvb_pool_t *p, int32_t b) {
    if (KVB_LIKELY(p->dnext == NULL)) {
        table_remove(p, b);
        return;
    }
    int32_t *dn = p->dnext;
    int32_t first = kvb_cache_find(p, &p->hash[b]);
    if (first == b) {
        if (dn[b] == KVB_NONE) table_remove(p, b);
        else p->table[table_slot(p, b)] = dn[b]; /* same key: same probe run */
    } else {
        int32_t c = first;
        while (dn[c] != b) c = dn[c];
        dn[c] = dn[b];
    }
    dn[b] = KVB_NONE;
}

/* dnext[], all KVB_NONE, made on the first duplicate's request. */
static int dnext_make(kvb_pool_t *p) {
    if (p->dnext) return KVB_OK;
    p->dnext = malloc((size_t)p->num_blocks * sizeof *p->dnext);
    if (!p->dnext) return KVB_ENOMEM;
    memset(p->dnext, 0xff, (size_t)p->num_blocks * sizeof *p->dnext);
    return KVB_OK;
}

/* Put b (uncached, hash[b] set) under its key: into the table, or at the end of the chain of
 * the key's blocks when dup and one holds it (dnext[] made). 0: the key is held and not dup. */
static int entry_link(kvb_pool_t *p, int32_t b, const kvb_hash_t *h, int dup) {
    uint64_t mask = p->table_mask, i = h->lo & mask;
    for (;;) {
        int32_t c = p->table[i];
        if (c == KVB_NONE) break;
        if (hash_eq(&p->hash[c], h)) {
            if (!dup) return 0;
            int32_t *dn = p->dnext;
            while (dn[c] != KVB_NONE) c = dn[c];
            dn[c] = b;
            dn[b] = KVB_NONE;
            return 1;
        }
        i = (i + 1) & mask;
    }
    p->table[i] = b;
    return 1;
}

void kvb_cache_forget(kvb_pool_t *p, int32_t b) {
    KVB_ASSERT(p->flags[b] & KVB_F_CACHED);
    entry_unlink(p, b);
    p->flags[b] &= (uint8_t)~KVB_F_CACHED;
    p->num_cached--;
    if (p->record_events) kvb_pool_record(p, KVB_EV_REMOVED, b, &p->hash[b], NULL, NULL, 0);
}

/* b just entered the cache: its lineage (parent, tokens) is kept for the log's evictions, and
 * an insertion record (with its BlockStored's stamp) when the reader wants them. */
KVB_NOINLINE static void log_insertion(kvb_pool_t *p, int32_t b, const kvb_hash_t *parent,
                                       const int32_t *tokens, uint64_t stamp) {
    kvb_plog_t *lg = p->log;
    if (parent) lg->parent[b] = *parent;
    else lg->parent[b].lo = lg->parent[b].hi = 0;
    lg->has_tokens[b] = tokens != NULL;
    if (tokens)
        memcpy(lg->tokens + (size_t)b * (size_t)lg->block_size, tokens,
               (size_t)lg->block_size * sizeof *tokens);
    if (!lg->inserts) return;
    int64_t cap = lg->inscap;
    if (kvb_grow((void **)&lg->ins, &cap, lg->nins + 1, sizeof *lg->ins) ||
        kvb_grow((void **)&lg->ins_stamp, &lg->inscap, lg->nins + 1, sizeof *lg->ins_stamp)) {
        return; /* no memory (inscap stays what both hold): not written through, as a full host */
    }
    lg->ins[lg->nins] = b;
    lg->ins_stamp[lg->nins++] = stamp;
}

int kvb_cache_put(kvb_pool_t *p, int32_t b, const kvb_hash_t *h, const kvb_hash_t *parent,
                  const int32_t *tokens, int32_t block_size) {
    /* the first block keeps the entry; a later one joins its chain only with dup_insert */
    if (!entry_link(p, b, h, p->dup_insert && p->dnext)) return 0;
    p->hash[b] = *h;
    p->flags[b] |= KVB_F_CACHED;
    p->num_cached++;
    p->stats.stored++;
    int64_t nev = p->events.n;
    if (p->record_events)
        kvb_pool_record(p, KVB_EV_STORED, b, h, parent, tokens, tokens ? block_size : 0);
    if (KVB_UNLIKELY(p->log != NULL))
        log_insertion(p, b, parent, tokens, p->events.n > nev ? p->events.stamp[nev] : 0);
    return 1;
}

int kvb_cache_insert(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes, int64_t n,
                     const kvb_hash_t *parent, const int32_t *tokens, int32_t block_size,
                     int64_t *stored) {
    if (!p->caching) return KVB_ESTATE;
    if (p->dup_insert && n > 0 && dnext_make(p)) return KVB_ENOMEM;
    /* Validate in O(n). An uncached block seen for the first time is marked and its hash
     * parked in hash[] (meaningless while the CACHED bit is clear), so the same block given
     * again under another hash is caught; the marks are cleared whatever the outcome. */
    int rc = KVB_OK;
    int64_t i = 0;
    for (; i < n; i++) {
        int32_t b = ids[i];
        if (b <= 0 || b >= p->num_blocks) { rc = KVB_ERANGE; break; }
        if (p->ref_count[b] <= 0) { rc = KVB_ESTATE; break; }
        if (p->flags[b] & (KVB_F_CACHED | KVB_F_MARK)) {
            if (!hash_eq(&p->hash[b], &hashes[i])) { rc = KVB_EDUP; break; }
        } else {
            p->flags[b] |= KVB_F_MARK;
            p->hash[b] = hashes[i];
        }
    }
    if (rc) {
        p->err_a = i;
        p->err_b = ids[i];
    }
    for (int64_t j = 0; j < i; j++) p->flags[ids[j]] &= (uint8_t)~KVB_F_MARK;
    if (rc) return rc;
    int64_t count = 0;
    for (i = 0; i < n; i++) {
        if (p->flags[ids[i]] & KVB_F_CACHED) continue;
        const kvb_hash_t *par = i ? &hashes[i - 1] : parent;
        p->flags[ids[i]] |= KVB_F_WRITTEN; /* the caller's word: call cache() once written */
        count += kvb_cache_put(p, ids[i], &hashes[i], par,
                               tokens ? tokens + i * (int64_t)block_size : NULL, block_size);
    }
    if (stored) *stored = count;
    return KVB_OK;
}

int64_t kvb_cache_match(const kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n,
                        int32_t *out) {
    int64_t k = 0;
    if (!p->caching) return 0;
    for (; k < n; k++) {
        int32_t b = kvb_cache_find(p, &hashes[k]);
        if (b == KVB_NONE) break;
        if (out) out[k] = b;
    }
    return k;
}

int64_t kvb_cache_lookup(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n, int32_t *out) {
    int64_t k = kvb_cache_match(p, hashes, n, out);
    p->stats.queries++;
    p->stats.query_blocks += (uint64_t)n;
    p->stats.hit_blocks += (uint64_t)k;
    return k;
}

/* Events: AllBlocksCleared, which names no medium (vLLM's has none), so a router drops every
 * entry of the engine on it. One of a host tier's pools (p->tiered) records a BlockRemoved per
 * entry instead, in its own medium: the other tier keeps its entries (and a reset of both
 * pools is one removal list per medium, whatever order a router merges them in). */
void kvb_cache_clear(kvb_pool_t *p) {
    int each = p->record_events && p->tiered;
    for (int32_t b = 1; b < p->num_blocks; b++) {
        if (each && (p->flags[b] & KVB_F_CACHED))
            kvb_pool_record(p, KVB_EV_REMOVED, b, &p->hash[b], NULL, NULL, 0);
        p->flags[b] &= (uint8_t)~KVB_F_CACHED;
    }
    memset(p->table, 0xff, (size_t)(p->table_mask + 1) * sizeof *p->table);
    if (p->dnext) memset(p->dnext, 0xff, (size_t)p->num_blocks * sizeof *p->dnext);
    p->num_cached = 0;
    if (p->record_events && !p->tiered)
        kvb_pool_record(p, KVB_EV_CLEARED, KVB_NONE, NULL, NULL, NULL, 0);
}

/* vLLM's move_block_hashes (kvb_pool_move_entry, pool.c, validated it): dst takes src's key
 * and group, at the end of the key's chain; no event, no count changes (an entry moves). */
void kvb_cache_move(kvb_pool_t *p, int32_t src, int32_t dst) {
    kvb_hash_t h = p->hash[src];
    entry_unlink(p, src);
    p->flags[src] &= (uint8_t)~KVB_F_CACHED;
    p->hash[dst] = h;
    p->gid[dst] = p->gid[src];
    entry_link(p, dst, &h, 1); /* a chain only where dnext[] exists (else src was alone) */
    p->flags[dst] |= KVB_F_CACHED | KVB_F_WRITTEN; /* the caller's word: the copy is queued */
    kvb_plog_t *lg = p->log;
    if (KVB_UNLIKELY(lg != NULL)) { /* the entry's lineage follows it */
        lg->parent[dst] = lg->parent[src];
        lg->has_tokens[dst] = lg->has_tokens[src];
        memcpy(lg->tokens + (size_t)dst * (size_t)lg->block_size,
               lg->tokens + (size_t)src * (size_t)lg->block_size,
               (size_t)lg->block_size * sizeof *lg->tokens);
    }
}
