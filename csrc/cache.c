/* cache.c -- the prefix cache: an open-addressing hash table from block hash to block id.
 *
 * The table holds int32 entry ids only; the 128-bit keys live in the pool's hash[] array, so
 * a slot costs 4 bytes and the table stays at most half full (size >= 2 * num_blocks, each
 * block holds at most one primary entry; secondary keys, below, grow it). Linear probing
 * from hash.lo; deletion shifts the following run back (no tombstones), so lookups never
 * slow down as blocks churn.
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
 * Secondary keys (vLLM's partial-prefix hashes, kvb_cache_add_key): a cached block may hold
 * more keys than its primary. The table and dnext[] hold entry ids: e < num_blocks is block
 * e's primary, num_blocks + r is secondary record r (key hash[num_blocks + r], owner
 * xblock[r], the owner's next record xnext[r]: a per-block list in insertion order from
 * xhead[]). Entries, not blocks, are what the table, the chains and unlink/link move around;
 * lookups answer with the entry's owner (one predictable `e < num_blocks` test on a hit). A
 * record lives exactly as long as its owner's primary: every path that drops the primary
 * (eviction, uncache, reset) drops the records too, a move moves them. The table stays at
 * most half full: adding a record past num_blocks - 1 + nx > size / 2 rehashes into a bigger
 * one. xhead[] is NULL until the first secondary: a pool without them pays one NULL test per
 * removal and move, nothing on lookups.
 *
 * Eviction is lazy: a cached block whose ref count reaches 0 stays in the table and in the free
 * list (see pool.c) until allocation pops it, which drops its entry (kvb_cache_forget).
 */
#include <string.h>

#include "internal.h"

KVB_INLINE int hash_eq(const kvb_hash_t *a, const kvb_hash_t *b) {
    return a->lo == b->lo && a->hi == b->hi;
}

/* The block an entry belongs to: the entry itself, or a secondary record's owner (KVB_NONE
 * stays KVB_NONE: it is below num_blocks too). */
KVB_INLINE int32_t entry_owner(const kvb_pool_t *p, int32_t e) {
    return KVB_LIKELY(e < p->num_blocks) ? e : p->xblock[e - p->num_blocks];
}

KVB_INLINE int32_t find_entry(const kvb_pool_t *p, const kvb_hash_t *h) {
    uint64_t mask = p->table_mask, i = h->lo & mask;
    for (;;) {
        int32_t e = p->table[i];
        if (e == KVB_NONE || hash_eq(&p->hash[e], h)) return e;
        i = (i + 1) & mask;
    }
}

int32_t kvb_cache_find_entry(const kvb_pool_t *p, const kvb_hash_t *h) {
    return find_entry(p, h);
}

int32_t kvb_cache_find(const kvb_pool_t *p, const kvb_hash_t *h) {
    return entry_owner(p, find_entry(p, h));
}

static void table_remove(kvb_pool_t *p, int32_t e) {
    uint64_t mask = p->table_mask, i = p->hash[e].lo & mask;
    while (p->table[i] != e) i = (i + 1) & mask;
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

/* The table slot holding entry e (e is a chain's first entry). */
static uint64_t table_slot(const kvb_pool_t *p, int32_t e) {
    uint64_t mask = p->table_mask, i = p->hash[e].lo & mask;
    while (p->table[i] != e) i = (i + 1) & mask;
    return i;
}

int kvb_cache_holds(const kvb_pool_t *p, int32_t e) {
    int32_t c = find_entry(p, &p->hash[e]);
    if (c == KVB_NONE || !p->dnext) return c == e;
    int64_t entries = (int64_t)p->num_blocks + p->xcap; /* a cycle ends the walk */
    for (int64_t k = 0; c != KVB_NONE && k < entries; c = p->dnext[c], k++)
        if (c == e) return 1;
    return 0;
}

/* Take entry e (live) out of the table or its key's chain; flags and counters untouched. */
static void entry_unlink(kvb_pool_t *p, int32_t e) {
    if (KVB_LIKELY(p->dnext == NULL)) {
        table_remove(p, e);
        return;
    }
    int32_t *dn = p->dnext;
    int32_t first = find_entry(p, &p->hash[e]);
    if (first == e) {
        if (dn[e] == KVB_NONE) table_remove(p, e);
        else p->table[table_slot(p, e)] = dn[e]; /* same key: same probe run */
    } else {
        int32_t c = first;
        while (dn[c] != e) c = dn[c];
        dn[c] = dn[e];
    }
    dn[e] = KVB_NONE;
}

/* dnext[] over every entry, all KVB_NONE, made on the first duplicate's or secondary's
 * request. */
static int dnext_make(kvb_pool_t *p) {
    if (p->dnext) return KVB_OK;
    size_t n = (size_t)p->num_blocks + (size_t)p->xcap;
    p->dnext = malloc(n * sizeof *p->dnext);
    if (!p->dnext) return KVB_ENOMEM;
    memset(p->dnext, 0xff, n * sizeof *p->dnext);
    return KVB_OK;
}

/* Put entry b (not linked, hash[b] set) under its key: into the table, or at the end of the
 * chain of the key's entries when dup and one holds it (dnext[] made). 0: the key is held and
 * not dup. */
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

/* b's secondary records leave with its primary (each a BlockRemoved after the primary's,
 * in insertion order) and go back to the free records. */
KVB_NOINLINE static void drop_secondaries(kvb_pool_t *p, int32_t b) {
    int32_t N = p->num_blocks, nxt;
    for (int32_t r = p->xhead[b]; r != KVB_NONE; r = nxt) {
        nxt = p->xnext[r];
        entry_unlink(p, N + r);
        if (p->record_events)
            kvb_pool_record(p, KVB_EV_REMOVED, b, &p->hash[N + r], NULL, NULL, 0);
        p->xblock[r] = KVB_NONE;
        p->xnext[r] = p->xfree;
        p->xfree = r;
        p->nx--;
    }
    p->xhead[b] = KVB_NONE;
}

void kvb_cache_forget(kvb_pool_t *p, int32_t b) {
    KVB_ASSERT(p->flags[b] & KVB_F_CACHED);
    entry_unlink(p, b);
    p->flags[b] &= (uint8_t)~KVB_F_CACHED;
    p->num_cached--;
    if (p->record_events) kvb_pool_record(p, KVB_EV_REMOVED, b, &p->hash[b], NULL, NULL, 0);
    if (KVB_UNLIKELY(p->xhead != NULL) && p->xhead[b] != KVB_NONE) drop_secondaries(p, b);
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
        int32_t e = find_entry(p, &hashes[k]);
        if (e == KVB_NONE) break;
        if (out) out[k] = entry_owner(p, e); /* a secondary key answers with its block */
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
    int32_t N = p->num_blocks;
    for (int32_t b = 1; b < N; b++) {
        if (each && (p->flags[b] & KVB_F_CACHED)) {
            kvb_pool_record(p, KVB_EV_REMOVED, b, &p->hash[b], NULL, NULL, 0);
            for (int32_t r = p->xhead ? p->xhead[b] : KVB_NONE; r != KVB_NONE; r = p->xnext[r])
                kvb_pool_record(p, KVB_EV_REMOVED, b, &p->hash[N + r], NULL, NULL, 0);
        }
        p->flags[b] &= (uint8_t)~KVB_F_CACHED;
    }
    memset(p->table, 0xff, (size_t)(p->table_mask + 1) * sizeof *p->table);
    if (p->dnext) memset(p->dnext, 0xff, ((size_t)N + (size_t)p->xcap) * sizeof *p->dnext);
    if (p->xhead) { /* every record free again, in index order */
        memset(p->xhead, 0xff, (size_t)N * sizeof *p->xhead);
        for (int32_t r = 0; r < p->xcap; r++) {
            p->xblock[r] = KVB_NONE;
            p->xnext[r] = r + 1 < p->xcap ? r + 1 : KVB_NONE;
        }
        p->xfree = p->xcap ? 0 : KVB_NONE;
        p->nx = 0;
    }
    p->num_cached = 0;
    if (p->record_events && !p->tiered)
        kvb_pool_record(p, KVB_EV_CLEARED, KVB_NONE, NULL, NULL, NULL, 0);
}

/* src's secondary records become dst's (same order), each at the end of its key's chain. */
KVB_NOINLINE static void move_secondaries(kvb_pool_t *p, int32_t src, int32_t dst) {
    int32_t N = p->num_blocks;
    for (int32_t r = p->xhead[src]; r != KVB_NONE; r = p->xnext[r]) {
        entry_unlink(p, N + r);
        p->xblock[r] = dst;
        entry_link(p, N + r, &p->hash[N + r], 1); /* records exist: dnext[] does */
    }
    p->xhead[dst] = p->xhead[src];
    p->xhead[src] = KVB_NONE;
}

/* vLLM's move_block_hashes (kvb_pool_move_entry, pool.c, validated it): dst takes src's keys
 * and group, each at the end of its key's chain; no event, no count changes (entries move). */
void kvb_cache_move(kvb_pool_t *p, int32_t src, int32_t dst) {
    kvb_hash_t h = p->hash[src];
    entry_unlink(p, src);
    p->flags[src] &= (uint8_t)~KVB_F_CACHED;
    p->hash[dst] = h;
    p->gid[dst] = p->gid[src];
    entry_link(p, dst, &h, 1); /* a chain only where dnext[] exists (else src was alone) */
    p->flags[dst] |= KVB_F_CACHED | KVB_F_WRITTEN; /* the caller's word: the copy is queued */
    if (KVB_UNLIKELY(p->xhead != NULL) && p->xhead[src] != KVB_NONE) move_secondaries(p, src, dst);
    kvb_plog_t *lg = p->log;
    if (KVB_UNLIKELY(lg != NULL)) { /* the entry's lineage follows it */
        lg->parent[dst] = lg->parent[src];
        lg->has_tokens[dst] = lg->has_tokens[src];
        memcpy(lg->tokens + (size_t)dst * (size_t)lg->block_size,
               lg->tokens + (size_t)src * (size_t)lg->block_size,
               (size_t)lg->block_size * sizeof *lg->tokens);
    }
}

/* ---- secondary keys (kvb_cache_add_key) ------------------------------------------------- */
/* Double the records (16 first): hash[] and dnext[] grow with them, the new ones join the
 * free records. Each array is grown on its own, the counts only once all are: a failure leaves
 * larger arrays and nothing else changed. */
static int grow_records(kvb_pool_t *p) {
    int64_t N = p->num_blocks, cap = p->xcap, nc = cap ? 2 * cap : 16;
    if (nc > INT32_MAX - N) nc = INT32_MAX - N; /* entry ids stay int32 */
    if (nc <= cap) return KVB_ENOMEM;
    size_t n = (size_t)nc, all = (size_t)(N + nc);
    void *q;
    if (!(q = realloc(p->hash, all * sizeof *p->hash))) return KVB_ENOMEM;
    p->hash = q;
    if (!(q = realloc(p->xblock, n * sizeof *p->xblock))) return KVB_ENOMEM;
    p->xblock = q;
    if (!(q = realloc(p->xnext, n * sizeof *p->xnext))) return KVB_ENOMEM;
    p->xnext = q;
    if (!(q = realloc(p->xcheck, 4 * n * sizeof *p->xcheck))) return KVB_ENOMEM;
    p->xcheck = q;
    if (p->dnext) {
        if (!(q = realloc(p->dnext, all * sizeof *p->dnext))) return KVB_ENOMEM;
        p->dnext = q;
        memset(p->dnext + N + cap, 0xff, (size_t)(nc - cap) * sizeof *p->dnext);
    }
    for (int64_t r = cap; r < nc; r++) {
        p->xblock[r] = KVB_NONE;
        p->xnext[r] = r + 1 < nc ? (int32_t)(r + 1) : p->xfree;
    }
    p->xfree = (int32_t)cap;
    p->xcap = (int32_t)nc;
    return KVB_OK;
}

/* Rebuild the table at `size` slots (a power of two): each chain's first entry moves, the
 * chains (dnext[]) stay as they are. */
static int rehash(kvb_pool_t *p, uint64_t size) {
    int32_t *t = malloc(size * sizeof *t);
    if (!t) return KVB_ENOMEM;
    memset(t, 0xff, size * sizeof *t);
    uint64_t mask = size - 1;
    for (uint64_t s = 0; s <= p->table_mask; s++) {
        int32_t e = p->table[s];
        if (e == KVB_NONE) continue;
        uint64_t i = p->hash[e].lo & mask;
        while (t[i] != KVB_NONE) i = (i + 1) & mask;
        t[i] = e;
    }
    free(p->table);
    p->table = t;
    p->table_mask = mask;
    return KVB_OK;
}

/* Everything one more record needs: xhead[], a free record, dnext[] and a table that stays
 * at most half full with every block cached (num_blocks - 1 primaries) and nx + 1 records. */
KVB_NOINLINE static int make_room(kvb_pool_t *p) {
    size_t N = (size_t)p->num_blocks;
    if (!p->xhead) {
        if (!(p->xhead = malloc(N * sizeof *p->xhead))) return KVB_ENOMEM;
        memset(p->xhead, 0xff, N * sizeof *p->xhead);
    }
    if (p->xfree == KVB_NONE && grow_records(p)) return KVB_ENOMEM;
    if (dnext_make(p)) return KVB_ENOMEM;
    uint64_t need = 2 * ((uint64_t)N - 1 + (uint64_t)p->nx + 1), size = p->table_mask + 1;
    if (need > size) {
        while (size < need) size <<= 1;
        if (rehash(p, size)) return KVB_ENOMEM;
    }
    return KVB_OK;
}

int kvb_cache_add_key(kvb_pool_t *p, int32_t b, const kvb_hash_t *h, const uint64_t *check4) {
    KVB_CLEAR_ERR(p);
    int32_t N = p->num_blocks;
    p->err_b = b;
    if (b <= 0 || b >= N) return KVB_ERANGE;
    if (!(p->flags[b] & KVB_F_CACHED) || p->log || p->tiered) return KVB_ESTATE;
    p->err_b = 0;
    kvb_hash_t key = *h; /* h may point into hash[], which growing moves */
    if (hash_eq(&p->hash[b], &key)) return 0;
    for (int32_t r = p->xhead ? p->xhead[b] : KVB_NONE; r != KVB_NONE; r = p->xnext[r])
        if (hash_eq(&p->hash[N + r], &key)) return 0;
    if (make_room(p)) return KVB_ENOMEM;
    int32_t r = p->xfree;
    p->xfree = p->xnext[r];
    p->hash[N + r] = key;
    p->xblock[r] = b;
    p->xnext[r] = KVB_NONE;
    if (check4) memcpy(&p->xcheck[4 * (size_t)r], check4, 4 * sizeof *p->xcheck);
    else memset(&p->xcheck[4 * (size_t)r], 0, 4 * sizeof *p->xcheck);
    if (p->xhead[b] == KVB_NONE) { /* the end of b's list: insertion order */
        p->xhead[b] = r;
    } else {
        int32_t c = p->xhead[b];
        while (p->xnext[c] != KVB_NONE) c = p->xnext[c];
        p->xnext[c] = r;
    }
    entry_link(p, N + r, &key, 1); /* vLLM always inserts: behind the key's other entries */
    p->nx++;
    if (p->record_events) kvb_pool_record(p, KVB_EV_STORED, b, &key, NULL, NULL, 0);
    return 1;
}
