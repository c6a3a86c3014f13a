/* table.c -- block tables per sequence: add, append, batched decode step, reserve, truncate,
 * fork with copy-on-write, free, swap.
 *
 * A sequence lives in a slot of m->seqs (slots are recycled through a free-slot stack and keep
 * their arrays' capacity, so a steady-state engine never calls malloc). Each slot holds:
 *   blocks[0..nblocks)  physical block ids; the first ceil(ntokens / block_size) hold the
 *                       committed tokens, the rest are reserved (lookahead) slots;
 *   tokens[0..ntokens)  committed token ids (needed to hash blocks as they fill up);
 *   hashes[0..nhashed)  chained hashes of the leading full blocks; with prefix caching on,
 *                       nhashed == ntokens / block_size, otherwise 0.
 *
 * Writing rule: before tokens are written into block w = ntokens / block_size (append, or
 * reserve that hands out its slots), that block must be private. If other references exist
 * (a fork or a prefix-cache hit shares it), copy-on-write: take a fresh block, queue the
 * (old, new) copy when the old one holds committed tokens, drop one reference of the old one.
 * If it is private but still carries a prefix-cache entry (after truncate), the entry is dropped.
 * Fork shares only the committed blocks, so no later block can be shared.
 *
 * Every entry point validates and counts the blocks it needs first, grows capacities (not
 * observable), and only then mutates: a failed call changes nothing.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- helpers ---------------------------------------------------------------------------- */
KVB_INLINE int64_t blk_of(const kvb_mgr_t *m, int64_t t) {
    return m->bs_shift >= 0 ? t >> m->bs_shift : t / m->block_size;
}
KVB_INLINE int64_t off_in(const kvb_mgr_t *m, int64_t t) {
    return m->bs_shift >= 0 ? t & (m->block_size - 1) : t % m->block_size;
}
KVB_INLINE int64_t blocks_for(const kvb_mgr_t *m, int64_t t) {
    return blk_of(m, t + m->block_size - 1);
}

KVB_INLINE kvb_seq_t *live_seq(kvb_mgr_t *m, int32_t slot) {
    if (KVB_UNLIKELY(slot < 0 || slot >= m->scap || !(m->seqs[slot].gen & 1u))) return NULL;
    return &m->seqs[slot];
}

static int ensure_tokens(kvb_seq_t *s, int64_t need) {
    return kvb_grow((void **)&s->tokens, &s->tcap, need, sizeof *s->tokens);
}
static int ensure_blocks(kvb_seq_t *s, int64_t need) {
    int64_t cap = s->bcap;
    if (need > INT32_MAX) return KVB_ENOMEM;
    int rc = kvb_grow((void **)&s->blocks, &cap, need, sizeof *s->blocks);
    s->bcap = (int32_t)cap;
    return rc;
}
static int ensure_hashes(kvb_seq_t *s, int64_t need) {
    int64_t cap = s->hcap;
    int rc = kvb_grow((void **)&s->hashes, &cap, need, sizeof *s->hashes);
    s->hcap = (int32_t)cap;
    return rc;
}

KVB_NOINLINE static int out_of_blocks(kvb_mgr_t *m, int64_t need, int64_t have) {
    m->err_a = need;
    m->err_b = have;
    return KVB_EOUTOFBLOCKS;
}

/* Blocks taking n more written tokens would cost: growth plus copy-on-write of block w. */
static int64_t need_for(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t n) {
    if (n <= 0) return 0;
    int64_t grow = blocks_for(m, s->ntokens + n) - s->nblocks;
    if (grow < 0) grow = 0;
    int64_t w = blk_of(m, s->ntokens);
    if (w < s->nblocks && m->pool->ref_count[s->blocks[w]] > 1) grow++;
    return grow;
}

/* Make block w private (copy-on-write) and uncached; one free block is available if needed. */
static void make_writable(kvb_mgr_t *m, kvb_seq_t *s) {
    kvb_pool_t *p = m->pool;
    int64_t w = blk_of(m, s->ntokens);
    if (w >= s->nblocks) return;
    int32_t b = s->blocks[w];
    if (p->ref_count[b] > 1) {
        int32_t nb;
        kvb_pool_allocate(p, 1, &nb); /* cannot fail: counted by need_for */
        if (off_in(m, s->ntokens)) {
            m->copies[2 * m->ncopies] = b;
            m->copies[2 * m->ncopies + 1] = nb;
            m->ncopies++;
        }
        s->blocks[w] = nb;
        s->tver++;
        kvb_pool_release(p, b);
    } else if (p->flags[b] & KVB_F_CACHED) {
        kvb_cache_drop(p, b);
    }
}

/* Register full blocks [from, to) of s, whose hashes are known, in the prefix cache. */
static void cache_blocks(kvb_mgr_t *m, kvb_seq_t *s, int64_t from, int64_t to) {
    kvb_pool_t *p = m->pool;
    for (int64_t i = from; i < to; i++) {
        int32_t b = s->blocks[i];
        if (!(p->flags[b] & KVB_F_CACHED))
            kvb_cache_put(p, b, &s->hashes[i], i ? &s->hashes[i - 1] : &s->root,
                          s->tokens + i * m->block_size, m->block_size);
    }
}

/* Hash and register the blocks that became full, from block nhashed to ntokens / bs. */
static void hash_full_blocks(kvb_mgr_t *m, kvb_seq_t *s) {
    int64_t full = blk_of(m, s->ntokens);
    int64_t from = s->nhashed;
    kvb_hash_chain(m->key, from ? &s->hashes[from - 1] : &s->root,
                   s->tokens + from * m->block_size, full - from, m->block_size,
                   s->hashes + from);
    cache_blocks(m, s, from, full);
    s->nhashed = (int32_t)full;
}

/* Capacity for up to n more tokens (and the blocks and hashes they may need). */
static int reserve_capacity(kvb_mgr_t *m, kvb_seq_t *s, int64_t n, int64_t extra_blocks) {
    if (ensure_tokens(s, s->ntokens + n)) return KVB_ENOMEM;
    if (ensure_blocks(s, s->nblocks + extra_blocks)) return KVB_ENOMEM;
    if (m->pool->caching && ensure_hashes(s, blk_of(m, s->ntokens + n) + 1)) return KVB_ENOMEM;
    /* ccap counts int64 entries: room for one more (src, dst) pair */
    return kvb_grow((void **)&m->copies, &m->ccap, 2 * (m->ncopies + 1), sizeof *m->copies);
}

/* ---- lifecycle -------------------------------------------------------------------------- */
int kvb_mgr_init(kvb_mgr_t *m, kvb_pool_t *pool, kvb_pool_t *host, int32_t block_size,
                 const uint8_t key[16]) {
    memset(m, 0, sizeof *m);
    if (block_size < 1) return KVB_EINVAL;
    m->pool = pool;
    m->host = host;
    m->block_size = block_size;
    m->bs_shift = -1;
    if ((block_size & (block_size - 1)) == 0) {
        m->bs_shift = 0;
        while ((1 << m->bs_shift) < block_size) m->bs_shift++;
    }
    memcpy(m->key, key, 16);
    m->free_slot = KVB_NONE;
    return KVB_OK;
}

void kvb_mgr_destroy(kvb_mgr_t *m) {
    for (int32_t i = 0; i < m->scap; i++) {
        free(m->seqs[i].blocks);
        free(m->seqs[i].tokens);
        free(m->seqs[i].hashes);
    }
    free(m->seqs);
    free(m->copies);
    memset(m, 0, sizeof *m);
}

/* A fresh slot (its arrays keep their capacity), not yet marked live. */
static int new_slot(kvb_mgr_t *m, int32_t *slot) {
    if (m->free_slot == KVB_NONE) {
        int64_t cap = m->scap;
        if (cap >= INT32_MAX / 2) return KVB_ENOMEM;
        int64_t old = cap;
        if (kvb_grow((void **)&m->seqs, &cap, old + 1, sizeof *m->seqs)) return KVB_ENOMEM;
        memset(m->seqs + old, 0, (size_t)(cap - old) * sizeof *m->seqs);
        for (int64_t i = cap - 1; i >= old; i--) { /* push in reverse: lowest slot first */
            m->seqs[i].next_free = m->free_slot;
            m->free_slot = (int32_t)i;
        }
        m->scap = (int32_t)cap;
    }
    *slot = m->free_slot;
    return KVB_OK;
}

static void take_slot(kvb_mgr_t *m, int32_t slot) {
    kvb_seq_t *s = &m->seqs[slot];
    m->free_slot = s->next_free;
    s->next_free = KVB_NONE;
    s->gen++; /* now odd: live */
    s->nblocks = 0;
    s->ntokens = 0;
    s->nhashed = 0;
    s->swapped = 0;
    m->nseqs++;
}

/* ---- add -------------------------------------------------------------------------------- */
int kvb_mgr_add(kvb_mgr_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                size_t salt_len, int32_t *slot_out, int64_t *cached_out) {
    kvb_pool_t *p = m->pool;
    if (n < 0) { m->err_a = 0; m->err_b = n; return KVB_EINVAL; }
    int32_t slot;
    if (new_slot(m, &slot)) return KVB_ENOMEM;
    kvb_seq_t *s = &m->seqs[slot];
    int64_t total = blocks_for(m, n), full = blk_of(m, n);
    if (total > INT32_MAX) { m->err_a = 0; m->err_b = n; return KVB_EINVAL; }
    if (ensure_tokens(s, n) || ensure_blocks(s, total) ||
        (p->caching && ensure_hashes(s, full + 1)))
        return KVB_ENOMEM;

    int64_t hits = 0, pinned_from_free = 0;
    if (p->caching) {
        kvb_hash_root(m->key, salt, salt_len, &s->root);
        kvb_hash_chain(m->key, &s->root, tokens, full, m->block_size, s->hashes);
        int64_t max_hits = n > 0 ? blk_of(m, n - 1) : 0; /* at least one token is computed */
        hits = kvb_cache_match(p, s->hashes, full < max_hits ? full : max_hits, s->blocks);
        for (int64_t i = 0; i < hits; i++) pinned_from_free += p->ref_count[s->blocks[i]] == 0;
    }
    int64_t need = total - hits;
    if (need > p->num_free - pinned_from_free)
        return out_of_blocks(m, need, p->num_free - pinned_from_free);

    /* mutate: pin the hits first so that allocation cannot evict them */
    take_slot(m, slot);
    kvb_cache_pin(p, s->blocks, hits);
    kvb_pool_allocate(p, (int32_t)need, s->blocks + hits);
    s->nblocks = (int32_t)total;
    kvb_copy(s->tokens, tokens, (size_t)n * sizeof *tokens);
    s->ntokens = n;
    if (p->caching) {
        cache_blocks(m, s, hits, full); /* their hashes are known already */
        s->nhashed = (int32_t)full;
        p->stats.queries++;
        p->stats.query_blocks += (uint64_t)full;
        p->stats.hit_blocks += (uint64_t)hits;
        p->stats.query_tokens += (uint64_t)n;
        p->stats.hit_tokens += (uint64_t)(hits * m->block_size);
    }
    *slot_out = slot;
    *cached_out = hits * m->block_size;
    return KVB_OK;
}

/* ---- append / reserve ------------------------------------------------------------------- */
/* Grow the table so that it covers ntokens + n slots (blocks counted by need_for). */
static void grow_table(kvb_mgr_t *m, kvb_seq_t *s, int64_t n) {
    int64_t grow = blocks_for(m, s->ntokens + n) - s->nblocks;
    if (grow > 0) {
        kvb_pool_allocate(m->pool, (int32_t)grow, s->blocks + s->nblocks);
        s->nblocks += (int32_t)grow;
    }
}

/* Make n slots after the committed tokens writable (copy-on-write of the write block, growth),
 * with capacity for `tokens` more committed tokens. Shared by append and reserve. */
static int make_room(kvb_mgr_t *m, int32_t slot, int64_t n, int64_t tokens, kvb_seq_t **out) {
    kvb_seq_t *s = live_seq(m, slot);
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped) return KVB_ESTATE;
    if (n < 0) { m->err_a = 0; m->err_b = n; return KVB_EINVAL; }
    *out = s;
    if (n == 0) return KVB_OK;
    int64_t need = need_for(m, s, n);
    if (need > m->pool->num_free) return out_of_blocks(m, need, m->pool->num_free);
    if (reserve_capacity(m, s, tokens, need)) return KVB_ENOMEM;
    make_writable(m, s);
    grow_table(m, s, n);
    return KVB_OK;
}

int kvb_mgr_append(kvb_mgr_t *m, int32_t slot, const int32_t *tokens, int64_t n) {
    kvb_seq_t *s;
    int rc = make_room(m, slot, n, n, &s);
    if (rc || n == 0) return rc;
    memcpy(s->tokens + s->ntokens, tokens, (size_t)n * sizeof *tokens);
    s->ntokens += n;
    if (m->pool->caching) hash_full_blocks(m, s);
    return KVB_OK;
}

int kvb_mgr_reserve(kvb_mgr_t *m, int32_t slot, int64_t n) {
    kvb_seq_t *s;
    return make_room(m, slot, n, 0, &s);
}

int64_t kvb_mgr_blocks_needed(const kvb_mgr_t *m, int32_t slot, int64_t n) {
    kvb_seq_t *s = live_seq((kvb_mgr_t *)m, slot);
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped) return blocks_for(m, s->ntokens + n);
    return need_for(m, s, n);
}

/* The decode step: one token for each of n sequences, one call. */
int kvb_mgr_append_batch(kvb_mgr_t *m, const int32_t *slots, const int32_t *tokens, int64_t n) {
    kvb_pool_t *p = m->pool;
    uint32_t stamp = ++m->stamp;
    if (KVB_UNLIKELY(stamp == 0)) { /* wrapped: clear old stamps */
        for (int32_t i = 0; i < m->scap; i++) m->seqs[i].stamp = 0;
        stamp = m->stamp = 1;
    }
    int64_t need = 0;
    for (int64_t i = 0; i < n; i++) {
        kvb_seq_t *s = live_seq(m, slots[i]);
        if (KVB_UNLIKELY(!s)) { m->err_a = i; m->err_b = slots[i]; return KVB_EUNKNOWN; }
        if (KVB_UNLIKELY(s->stamp == stamp)) { m->err_a = i; m->err_b = slots[i]; return KVB_EDUP; }
        if (KVB_UNLIKELY(s->swapped)) { m->err_a = i; m->err_b = slots[i]; return KVB_ESTATE; }
        s->stamp = stamp;
        int64_t w = blk_of(m, s->ntokens);
        if (w >= s->nblocks || p->ref_count[s->blocks[w]] > 1) need++;
        if (KVB_UNLIKELY(s->ntokens + 1 > s->tcap || s->nblocks + 1 > s->bcap ||
                         (p->caching && w + 1 > s->hcap))) {
            if (reserve_capacity(m, s, 1, 1)) return KVB_ENOMEM;
        }
    }
    if (KVB_UNLIKELY(need > p->num_free)) return out_of_blocks(m, need, p->num_free);
    if (KVB_UNLIKELY(kvb_grow((void **)&m->copies, &m->ccap, 2 * (m->ncopies + n),
                              sizeof *m->copies)))
        return KVB_ENOMEM;
    for (int64_t i = 0; i < n; i++) {
        kvb_seq_t *s = &m->seqs[slots[i]];
        int64_t t = s->ntokens, w = blk_of(m, t);
        if (w >= s->nblocks) {
            kvb_pool_allocate(p, 1, s->blocks + s->nblocks);
            s->nblocks++;
        } else {
            int32_t b = s->blocks[w];
            if (KVB_UNLIKELY(p->ref_count[b] > 1 || (p->flags[b] & KVB_F_CACHED)))
                make_writable(m, s);
        }
        s->tokens[t] = tokens[i];
        s->ntokens = t + 1;
        if (off_in(m, t + 1) == 0 && p->caching) hash_full_blocks(m, s);
    }
    return KVB_OK;
}

/* ---- truncate / fork / free ------------------------------------------------------------- */
/* Forget pending copies whose destination block was just released: nothing will read it, and
 * once reallocated the late copy would overwrite its new owner's data. */
static void drop_dead_copies(kvb_mgr_t *m) {
    int64_t k = 0;
    for (int64_t i = 0; i < m->ncopies; i++) {
        if (m->pool->ref_count[m->copies[2 * i + 1]] == 0) continue;
        m->copies[2 * k] = m->copies[2 * i];
        m->copies[2 * k + 1] = m->copies[2 * i + 1];
        k++;
    }
    m->ncopies = k;
}

static void release_tail(kvb_mgr_t *m, kvb_seq_t *s, int32_t keep) {
    kvb_pool_t *p = s->swapped ? m->host : m->pool;
    for (int32_t i = s->nblocks - 1; i >= keep; i--) kvb_pool_release(p, s->blocks[i]);
    if (keep < s->nblocks) s->tver++;
    s->nblocks = keep;
    if (KVB_UNLIKELY(m->ncopies) && p == m->pool) drop_dead_copies(m);
}

int kvb_mgr_truncate(kvb_mgr_t *m, int32_t slot, int64_t ntokens) {
    kvb_seq_t *s = live_seq(m, slot);
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped) return KVB_ESTATE;
    if (ntokens < 0 || ntokens > s->ntokens) {
        m->err_a = s->ntokens;
        m->err_b = ntokens;
        return KVB_EINVAL;
    }
    release_tail(m, s, (int32_t)blocks_for(m, ntokens));
    s->ntokens = ntokens;
    if (s->nhashed > blk_of(m, ntokens)) s->nhashed = (int32_t)blk_of(m, ntokens);
    return KVB_OK;
}

int kvb_mgr_fork(kvb_mgr_t *m, int32_t parent, int32_t *child_out) {
    kvb_seq_t *ps = live_seq(m, parent);
    if (!ps) return KVB_EUNKNOWN;
    if (ps->swapped) return KVB_ESTATE;
    int32_t slot;
    if (new_slot(m, &slot)) return KVB_ENOMEM;
    ps = &m->seqs[parent]; /* new_slot may have moved the array */
    kvb_seq_t *s = &m->seqs[slot];
    int64_t nb = blocks_for(m, ps->ntokens);
    if (ensure_tokens(s, ps->ntokens) || ensure_blocks(s, nb) ||
        ensure_hashes(s, ps->nhashed + 1))
        return KVB_ENOMEM;
    take_slot(m, slot);
    kvb_copy(s->tokens, ps->tokens, (size_t)ps->ntokens * sizeof *s->tokens);
    kvb_copy(s->blocks, ps->blocks, (size_t)nb * sizeof *s->blocks);
    kvb_copy(s->hashes, ps->hashes, (size_t)ps->nhashed * sizeof *s->hashes);
    s->ntokens = ps->ntokens;
    s->nblocks = (int32_t)nb;
    s->nhashed = ps->nhashed;
    s->root = ps->root;
    for (int64_t i = 0; i < nb; i++) m->pool->ref_count[s->blocks[i]]++; /* all referenced */
    *child_out = slot;
    return KVB_OK;
}

int kvb_mgr_free(kvb_mgr_t *m, int32_t slot) {
    kvb_seq_t *s = live_seq(m, slot);
    if (!s) return KVB_EUNKNOWN;
    release_tail(m, s, 0); /* tail first: the longest prefixes are evicted first */
    s->ntokens = 0;
    s->nhashed = 0;
    s->swapped = 0;
    s->gen++; /* even: free */
    s->next_free = m->free_slot;
    m->free_slot = slot;
    m->nseqs--;
    return KVB_OK;
}

/* ---- swap ------------------------------------------------------------------------------- */
/* Move a sequence's blocks from one pool to another: allocate in dst, release in src. */
static int move_blocks(kvb_mgr_t *m, kvb_seq_t *s, kvb_pool_t *src, kvb_pool_t *dst,
                       int64_t *pairs) {
    int32_t nb = s->nblocks;
    if (nb > dst->num_free) return out_of_blocks(m, nb, dst->num_free);
    int32_t *fresh = malloc((size_t)(nb ? nb : 1) * sizeof *fresh);
    if (!fresh) return KVB_ENOMEM;
    kvb_pool_allocate(dst, nb, fresh);
    for (int32_t i = 0; i < nb; i++) {
        pairs[2 * i] = s->blocks[i];
        pairs[2 * i + 1] = fresh[i];
    }
    for (int32_t i = nb - 1; i >= 0; i--) kvb_pool_release(src, s->blocks[i]);
    kvb_copy(s->blocks, fresh, (size_t)nb * sizeof *fresh);
    s->tver++;
    free(fresh);
    if (KVB_UNLIKELY(m->ncopies) && src == m->pool) drop_dead_copies(m);
    return KVB_OK;
}

int kvb_mgr_swap_out(kvb_mgr_t *m, int32_t slot, int64_t *pairs_out) {
    kvb_seq_t *s = live_seq(m, slot);
    if (!s) return KVB_EUNKNOWN;
    if (!m->host || s->swapped) return KVB_ESTATE;
    int rc = move_blocks(m, s, m->pool, m->host, pairs_out);
    if (rc == KVB_OK) s->swapped = 1;
    return rc;
}

int kvb_mgr_swap_in(kvb_mgr_t *m, int32_t slot, int64_t *pairs_out) {
    kvb_seq_t *s = live_seq(m, slot);
    if (!s) return KVB_EUNKNOWN;
    if (!m->host || !s->swapped) return KVB_ESTATE;
    int rc = move_blocks(m, s, m->host, m->pool, pairs_out);
    if (rc != KVB_OK) return rc;
    s->swapped = 0;
    if (m->pool->caching) cache_blocks(m, s, 0, s->nhashed); /* fresh copies serve hits again */
    return KVB_OK;
}

/* ---- check ------------------------------------------------------------------------------ */
#define MFAIL(a, b) do { ((kvb_mgr_t *)m)->err_a = (a); ((kvb_mgr_t *)m)->err_b = (b); \
                         rc = KVB_ECORRUPT; goto done; } while (0)

int kvb_mgr_check(const kvb_mgr_t *m) {
    const kvb_pool_t *p = m->pool;
    int rc = kvb_pool_check(p);
    if (rc) return rc;
    if (m->host && (rc = kvb_pool_check(m->host))) return rc;
    int32_t *refs = calloc((size_t)p->num_blocks, sizeof *refs);
    int32_t *hrefs = m->host ? calloc((size_t)m->host->num_blocks, sizeof *hrefs) : NULL;
    if (!refs || (m->host && !hrefs)) { free(refs); free(hrefs); return KVB_ENOMEM; }
    int64_t live = 0, nfree = 0;
    for (int32_t i = 0; i < m->scap; i++) {
        const kvb_seq_t *s = &m->seqs[i];
        if (!(s->gen & 1u)) { nfree++; continue; }
        live++;
        const kvb_pool_t *sp = s->swapped ? m->host : p;
        int32_t *r = s->swapped ? hrefs : refs;
        if (s->swapped && !m->host) MFAIL(100, i);
        if (s->nblocks < blocks_for(m, s->ntokens) || s->nblocks > s->bcap) MFAIL(101, i);
        if (s->ntokens > s->tcap) MFAIL(102, i);
        for (int32_t j = 0; j < s->nblocks; j++) {
            int32_t b = s->blocks[j];
            if (b <= 0 || b >= sp->num_blocks) MFAIL(103, i);
            r[b]++;
        }
        int64_t full = blk_of(m, s->ntokens);
        if (s->nhashed != (p->caching ? full : 0)) MFAIL(104, i);
        for (int32_t j = 0; j < s->nhashed; j++) {
            kvb_hash_t h;
            kvb_hash_chain(m->key, j ? &s->hashes[j - 1] : &s->root,
                           s->tokens + (int64_t)j * m->block_size, 1, m->block_size, &h);
            if (h.lo != s->hashes[j].lo || h.hi != s->hashes[j].hi) MFAIL(105, i);
            int32_t b = s->blocks[j]; /* a cached full block holds this very content */
            if (!s->swapped && (p->flags[b] & KVB_F_CACHED) &&
                (p->hash[b].lo != h.lo || p->hash[b].hi != h.hi))
                MFAIL(106, i);
        }
        /* blocks past the write block are private */
        for (int64_t j = blk_of(m, s->ntokens) + 1; j < s->nblocks; j++)
            if (sp->ref_count[s->blocks[j]] != 1) MFAIL(107, i);
    }
    if (live != m->nseqs) MFAIL(108, live);
    int64_t stack = 0;
    for (int32_t i = m->free_slot; i != KVB_NONE; i = m->seqs[i].next_free) {
        if (m->seqs[i].gen & 1u) MFAIL(109, i);
        if (++stack > m->scap) MFAIL(110, i);
    }
    if (stack != nfree) MFAIL(111, stack);
    for (int32_t b = 1; b < p->num_blocks; b++)
        if (refs[b] != p->ref_count[b]) MFAIL(112, b);
    if (m->host)
        for (int32_t b = 1; b < m->host->num_blocks; b++)
            if (hrefs[b] != m->host->ref_count[b]) MFAIL(113, b);
    rc = KVB_OK;
done:
    free(refs);
    free(hrefs);
    return rc;
}
