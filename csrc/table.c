/* table.c -- block tables per sequence: add, append, batched decode step, reserve, truncate,
 * fork with copy-on-write, free, swap, and the step that marks committed tokens computed.
 *
 * A sequence lives in a slot of m->seqs (slots are recycled through a free-slot stack and keep
 * their arrays' capacity, so a steady-state engine never calls malloc). Each slot holds:
 *   blocks[0..nblocks)  physical block ids; the first ceil(ntokens / block_size) hold the
 *                       committed tokens, the rest are reserved (lookahead) slots;
 *   tokens[0..ntokens)  committed token ids (needed to hash blocks as they fill up);
 *   hashes[0..nhashed)  chained hashes of the leading full blocks; with prefix caching on,
 *                       nhashed == ntokens / block_size, otherwise 0.
 *
 *   ncomputed           leading tokens whose K/V are written: hits at add, then advanced to
 *                       ntokens by each step (kvb_mgr_schedule, called by metadata) or by an
 *                       append of computed drafts. Full blocks enter the prefix cache only
 *                       as they become computed, never at commit.
 *
 * Writing rule: before tokens are written into block w = ntokens / block_size (append, or
 * reserve that hands out its slots), that block must be private. If other sequences use it
 * (a fork or a prefix-cache hit shares it), copy-on-write: take a fresh block, queue the
 * (old, new) copy when the old one holds committed tokens, drop one reference of the old one.
 * The last user writes in place. If it is private but still carries a prefix-cache entry
 * (after truncate), the entry is dropped. Fork shares only the committed blocks, so no later
 * block can be shared. Pending copies are described at queue_copy below.
 *
 * Every entry point validates and counts the blocks it needs first, grows capacities (not
 * observable), and only then mutates: a failed call changes nothing.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- helpers ---------------------------------------------------------------------------- */
/* The one preamble of every single-sequence entry point: the live sequence in slot, refused
 * when swapped out unless allow_swapped. Sets the error detail (index 0, the slot). */
static int get_seq(kvb_mgr_t *m, int32_t slot, int allow_swapped, kvb_seq_t **out) {
    kvb_seq_t *s = live_seq(m, slot);
    m->err_a = 0;
    m->err_b = slot;
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped && !allow_swapped) return KVB_ESWAPPED;
    *out = s;
    return KVB_OK;
}

/* Tokens no sequence can ever hold: more than the whole pool. Requests above it are refused
 * before any size arithmetic, so ntokens + n never overflows (both stay below 2^62). */
KVB_INLINE int64_t max_tokens(const kvb_mgr_t *m) {
    return (int64_t)m->pool->num_blocks * m->block_size;
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
static int ensure_hashes(const kvb_mgr_t *m, kvb_seq_t *s, int64_t need) {
    int64_t cap = s->hcap;
    if (need > INT32_MAX) return KVB_ENOMEM;
    int rc = kvb_grow((void **)&s->hashes, &cap, need, sizeof *s->hashes);
    s->hcap = (int32_t)cap;
    return rc ? rc : kvb_chain_reserve(m, s, need);
}

KVB_NOINLINE static int out_of_blocks(kvb_mgr_t *m, int64_t need, int64_t have) {
    m->err_a = need;
    m->err_b = have;
    return KVB_EOUTOFBLOCKS;
}

static uint32_t next_stamp(kvb_mgr_t *m) {
    uint32_t stamp = ++m->stamp;
    if (KVB_UNLIKELY(stamp == 0)) { /* wrapped: clear old stamps */
        for (int32_t i = 0; i < m->scap; i++) m->seqs[i].stamp = 0;
        stamp = m->stamp = 1;
    }
    return stamp;
}

KVB_INLINE int64_t add_sat(int64_t a, int64_t b) { /* both >= 0; never fits beyond */
    return b > INT64_MAX - a ? INT64_MAX : a + b;
}

/* ---- pending copy-on-write pairs -------------------------------------------------------- *
 * A pair (src, dst) is queued when a write makes a private copy of a shared partial block.
 * Until take_copies() drains it, the pair holds one reference on src (flag COPY_SRC), so src
 * is never handed out, evicted or overwritten before the copy runs; dst is fresh and flagged
 * COPY_DST. A new pair whose source is itself a pending dst reads that pair's source instead
 * (chains collapse), so no block is both a source and a destination and one copy_blocks call
 * runs any drained list in any order. Writers ignore the holds: the last sequence using a
 * block writes in place (the pending copies run before the forward pass that writes). */
KVB_NOINLINE static int32_t pending_src(const kvb_mgr_t *m, int32_t dst) {
    for (int64_t i = 0; i < m->ncopies; i++)
        if (m->copies[2 * i + 1] == dst) return (int32_t)m->copies[2 * i];
    KVB_ASSERT(0);
    return dst;
}

KVB_NOINLINE static int32_t pending_holds(const kvb_mgr_t *m, int32_t src) {
    int32_t k = 0;
    for (int64_t i = 0; i < m->ncopies; i++) k += m->copies[2 * i] == src;
    return k;
}

/* References of block b held by sequences (its ref count less the pending-copy holds). */
KVB_INLINE int32_t users(const kvb_mgr_t *m, int32_t b) {
    int32_t r = m->pool->ref_count[b];
    if (KVB_UNLIKELY(m->pool->flags[b] & KVB_F_COPY_SRC)) r -= pending_holds(m, b);
    return r;
}

/* Queue (src, dst); capacity for one more pair was reserved by the caller. */
static void queue_copy(kvb_mgr_t *m, int32_t src, int32_t dst) {
    kvb_pool_t *p = m->pool;
    if (KVB_UNLIKELY(p->flags[src] & KVB_F_COPY_DST)) src = pending_src(m, src);
    p->ref_count[src]++; /* referenced already, so not in the free list */
    p->flags[src] |= KVB_F_COPY_SRC;
    p->flags[dst] |= KVB_F_COPY_DST;
    m->copies[2 * m->ncopies] = src;
    m->copies[2 * m->ncopies + 1] = dst;
    m->ncopies++;
}

/* Release what pairs [0, n) of `pairs` hold; the flags are recomputed from what remains. */
static void release_pairs(kvb_mgr_t *m, const int64_t *pairs, int64_t n) {
    kvb_pool_t *p = m->pool;
    for (int64_t i = 0; i < n; i++) {
        p->flags[pairs[2 * i]] &= (uint8_t)~KVB_F_COPY_SRC;
        p->flags[pairs[2 * i + 1]] &= (uint8_t)~KVB_F_COPY_DST;
    }
    for (int64_t i = 0; i < m->ncopies; i++) p->flags[m->copies[2 * i]] |= KVB_F_COPY_SRC;
    for (int64_t i = 0; i < n; i++) kvb_pool_release(p, (int32_t)pairs[2 * i]);
}

int64_t kvb_mgr_take_copies(kvb_mgr_t *m, int64_t *out) {
    int64_t n = m->ncopies;
    kvb_copy(out, m->copies, (size_t)(2 * n) * sizeof *out);
    m->ncopies = 0;
    release_pairs(m, out, n);
    return n;
}

/* Forget pending copies whose destination block was just released: nothing will read it, and
 * once reallocated the late copy would overwrite its new owner's data. A dead destination that
 * was already registered in the prefix cache (append of computed drafts) loses the entry: its
 * content will never arrive. */
static void drop_dead_copies(kvb_mgr_t *m) {
    kvb_pool_t *p = m->pool;
    int64_t k = 0;
    for (int64_t i = 0; i < m->ncopies; i++) {
        int32_t src = (int32_t)m->copies[2 * i], dst = (int32_t)m->copies[2 * i + 1];
        if (p->ref_count[dst] == 0) {
            kvb_pool_uncache(p, dst);
            p->flags[dst] &= (uint8_t)~KVB_F_COPY_DST;
            p->flags[src] &= (uint8_t)~KVB_F_COPY_SRC; /* set again below if still held */
            kvb_pool_release(p, src);
            continue;
        }
        m->copies[2 * k] = src;
        m->copies[2 * k + 1] = dst;
        k++;
    }
    m->ncopies = k;
    for (int64_t i = 0; i < k; i++) p->flags[m->copies[2 * i]] |= KVB_F_COPY_SRC;
}

/* ---- write rule ------------------------------------------------------------------------- */
/* Blocks beyond the first `base` that ntokens + n tokens cover, for any n in [0, INT64_MAX]:
 * exact, saturating at INT64_MAX (never fits) rather than overflowing. ntokens is below 2^62,
 * so only n's quotient can overflow, and it is added last. Subtracting `base` before the
 * quotient keeps the answer exact up to INT64_MAX itself (a fuzz finding: a saturated cover
 * less the table length answered INT64_MAX - nblocks for block_size 1). */
static int64_t growth(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t n, int64_t base) {
    int64_t q = n / m->block_size;
    int64_t d = blocks_for(m, s->ntokens + n % m->block_size) - base;
    if (d > 0 && q > INT64_MAX - d) return INT64_MAX;
    return q + d > 0 ? q + d : 0;
}

/* Blocks taking n more written tokens would cost: growth plus copy-on-write of block w. */
static int64_t need_for(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t n) {
    if (n <= 0 || m->kind == KVB_G_STATE) return 0;
    int64_t grow = growth(m, s, n, s->nblocks);
    int64_t w = blk_of(m, s->ntokens);
    return w < s->nblocks && users(m, s->blocks[w]) > 1 ? add_sat(grow, 1) : grow;
}

/* Make block w private (copy-on-write) and uncached; one free block is available if needed. */
static void make_writable(kvb_mgr_t *m, kvb_seq_t *s) {
    kvb_pool_t *p = m->pool;
    int64_t w = blk_of(m, s->ntokens);
    if (w >= s->nblocks) return;
    int32_t b = s->blocks[w];
    if (users(m, b) > 1) {
        int32_t nb;
        KVB_MUST(kvb_pool_allocate(p, 1, &nb)); /* cannot fail: counted by need_for */
        if (off_in(m, s->ntokens)) queue_copy(m, b, nb);
        s->blocks[w] = nb;
        s->tver++;
        kvb_pool_release(p, b);
    } else if (p->flags[b] & (KVB_F_CACHED | KVB_F_WRITTEN)) {
        kvb_pool_uncache(p, b); /* its content is about to change */
        p->flags[b] &= (uint8_t)~KVB_F_WRITTEN;
    }
}

/* Register full blocks [from, to) of s, whose hashes are known, in the prefix cache. */
static void cache_blocks(kvb_mgr_t *m, kvb_seq_t *s, int64_t from, int64_t to) {
    kvb_pool_t *p = m->pool;
    p->events.cur_tag = s->chain.tag;
    for (int64_t i = from; i < to; i++) {
        int32_t b = s->blocks[i];
        if (!(p->flags[b] & KVB_F_CACHED)) {
            p->gid[b] = m->gidx;
            kvb_cache_put(p, b, &s->hashes[i], i ? &s->hashes[i - 1] : NULL, /* 1st: nil */
                          s->tokens + i * m->block_size, m->block_size);
        }
    }
    p->events.cur_tag = 0;
    if (p->tier) kvb_tier_absorb(p->tier); /* the cache's insertion records (write-through) */
}

/* Tokens [old, ncomputed) became computed: cache the blocks that are now fully computed. */
static void computed_to(kvb_mgr_t *m, kvb_seq_t *s, int64_t ncomputed) {
    if (m->kind == KVB_G_STATE) { s->ncomputed = ncomputed; return; }
    int64_t from = blk_of(m, s->ncomputed), to = blk_of(m, ncomputed);
    s->ncomputed = ncomputed;
    for (int64_t i = from; i < to; i++) m->pool->flags[s->blocks[i]] |= KVB_F_WRITTEN;
    if (m->caching) cache_blocks(m, s, from, to);
}

/* The hashes m derives its own from (kvb_grp_link): its source group's, when that group
 * holds the same sequence at least as far (groups.c runs the groups of a call in order, so
 * the source has taken the same step) and has hashed blocks [0, to); else NULL (hash). */
KVB_INLINE const kvb_seq_t *src_hashes(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t to) {
    if (!m->hsrc) return NULL;
    const kvb_seq_t *b = &m->hsrc->seqs[s - m->seqs];
    return b->nhashed >= to && b->ntokens == s->ntokens ? b : NULL;
}

/* Hash the blocks that became full (from block nhashed to ntokens / bs). They enter the
 * prefix cache only once computed (computed_to). */
static void hash_new_blocks(kvb_mgr_t *m, kvb_seq_t *s) {
    int64_t full = blk_of(m, s->ntokens);
    int64_t from = s->nhashed;
    kvb_chain_hash(m, s, s->tokens + from * m->block_size, from, full, src_hashes(m, s, full));
    s->nhashed = (int32_t)full;
}

/* ---- window release (KVB_G_WINDOW, KVB_G_CHUNK) ------------------------------------------ *
 * The next step's first query is q0 = min(ncomputed, ntokens - 1): the first uncomputed
 * token, or the newest one when all are computed (a step may recompute it). A step that
 * recomputes from qstart < q0 starts there. A window group's query at q0 reads [q0 - W + 1,
 * q0], a chunk group's [q0 - q0 % C, q0]; whole blocks below that are released: their table
 * entries become the null block 0 (s->lo counts them) and their references are dropped, so a
 * cached one stays evictable for prefix reuse. Release runs when a sequence moves on (append,
 * append_batch, a step), before that call allocates, so the blocks the previous step read are
 * reused only by calls after it. */
static int64_t needed_from(const kvb_mgr_t *m, int64_t ncomputed, int64_t ntokens,
                           int64_t qstart) {
    if (m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK) return 0;
    int64_t q0 = ncomputed < ntokens - 1 ? ncomputed : ntokens - 1;
    if (qstart < q0) q0 = qstart;
    if (q0 <= 0) return 0;
    if (m->kind == KVB_G_WINDOW) return q0 - m->span + 1 > 0 ? q0 - m->span + 1 : 0;
    return q0 - q0 % m->span;
}

int64_t kvb_mgr_first_needed(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t qstart) {
    return needed_from(m, s->ncomputed, s->ntokens, qstart);
}

/* Release blocks [lo, upto) of a resident sequence. */
static void release_front(kvb_mgr_t *m, kvb_seq_t *s, int64_t upto) {
    if (upto <= s->lo) return;
    KVB_ASSERT(upto <= s->nblocks && !s->swapped);
    for (int32_t j = s->lo; j < upto; j++) {
        int32_t b = s->blocks[j];
        s->blocks[j] = KVB_NULL_BLOCK;
        kvb_pool_release(m->pool, b);
    }
    s->lo = (int32_t)upto;
    s->tver++;
    if (KVB_UNLIKELY(m->ncopies)) drop_dead_copies(m);
}

/* Release what a sequence about to hold ntokens committed tokens no longer needs. */
KVB_INLINE void release_for(kvb_mgr_t *m, kvb_seq_t *s, int64_t ntokens, int64_t qstart) {
    if (m->kind == KVB_G_WINDOW || m->kind == KVB_G_CHUNK)
        release_front(m, s, blk_of(m, needed_from(m, s->ncomputed, ntokens, qstart)));
}

/* Blocks that release_for(ntokens) would return to the free pool: those this sequence
 * alone holds (a block shared with another sequence, or held by a pending copy, is not
 * counted). A call that may still be refused counts them instead of releasing first: what
 * it releases is chosen for the longer sequence, and a refused call must leave the block
 * the newest token's recompute reads. */
static int64_t gain_for(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t ntokens) {
    if (m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK) return 0;
    int64_t upto = blk_of(m, needed_from(m, s->ncomputed, ntokens, INT64_MAX));
    int64_t gain = 0;
    for (int64_t j = s->lo; j < upto; j++) gain += m->pool->ref_count[s->blocks[j]] == 1;
    return gain;
}

int64_t kvb_mgr_release_gain(const kvb_mgr_t *m, int32_t slot, int64_t n) {
    const kvb_seq_t *s = live_seq(m, slot);
    if (!s || s->swapped || n <= 0) return 0;
    return gain_for(m, s, add_sat(s->ntokens, n));
}

void kvb_mgr_move_release(kvb_mgr_t *m, int32_t slot, int64_t n) {
    kvb_seq_t *s = live_seq(m, slot);
    if (s && !s->swapped && n > 0) release_for(m, s, add_sat(s->ntokens, n), INT64_MAX);
}

void kvb_mgr_step_release(kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens, int64_t B) {
    if (m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK) return;
    for (int64_t i = 0; i < B; i++) {
        kvb_seq_t *s = &m->seqs[slots[i]];
        release_for(m, s, s->ntokens, s->ntokens - qlens[i]);
    }
}

/* Capacity for up to n more tokens (and the blocks and hashes they may need). */
static int reserve_capacity(kvb_mgr_t *m, kvb_seq_t *s, int64_t n, int64_t extra_blocks) {
    if (ensure_tokens(s, s->ntokens + n)) return KVB_ENOMEM;
    if (ensure_blocks(s, s->nblocks + extra_blocks)) return KVB_ENOMEM;
    if (m->caching && ensure_hashes(m, s, blk_of(m, s->ntokens + n) + 1)) return KVB_ENOMEM;
    /* ccap counts int64 entries: room for one more (src, dst) pair */
    return kvb_grow((void **)&m->copies, &m->ccap, 2 * (m->ncopies + 1), sizeof *m->copies);
}

/* ---- lifecycle -------------------------------------------------------------------------- */
int kvb_mgr_init(kvb_mgr_t *m, kvb_pool_t *pool, kvb_pool_t *host, int32_t block_size,
                 const uint8_t key[16]) {
    memset(m, 0, sizeof *m);
    if (block_size < 1) { m->err_b = block_size; return KVB_EINVAL; }
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
    m->kind = KVB_G_FULL;
    m->caching = pool->caching;
    return KVB_OK;
}

int kvb_mgr_set_kind(kvb_mgr_t *m, int32_t kind, int64_t span, uint8_t gidx) {
    KVB_CLEAR_ERR(m);
    if (kind < KVB_G_FULL || kind > KVB_G_STATE) { m->err_b = kind; return KVB_EINVAL; }
    if (kind != KVB_G_FULL && (span < 1 || span > INT32_MAX)) {
        m->err_b = span;
        return KVB_EINVAL;
    }
    if (m->nseqs) return KVB_ESTATE;
    m->kind = kind;
    m->span = kind == KVB_G_FULL ? 0 : span;
    m->gidx = gidx;
    m->caching = m->pool->caching && kind != KVB_G_STATE;
    return KVB_OK;
}

void kvb_mgr_destroy(kvb_mgr_t *m) {
    for (int32_t i = 0; i < m->scap; i++) {
        free(m->seqs[i].blocks);
        free(m->seqs[i].tokens);
        free(m->seqs[i].hashes);
        kvb_chain_destroy(&m->seqs[i]);
    }
    free(m->seqs);
    free(m->copies);
    free(m->hit);
    if (m->pool && m->pool->tier) kvb_tier_destroy(m->pool);
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

int kvb_mgr_new_slot(kvb_mgr_t *m) {
    int32_t slot;
    return new_slot(m, &slot);
}

static void take_slot(kvb_mgr_t *m, int32_t slot) {
    kvb_seq_t *s = &m->seqs[slot];
    m->free_slot = s->next_free;
    s->next_free = KVB_NONE;
    s->gen++; /* now odd: live */
    s->nblocks = 0;
    s->ntokens = 0;
    s->ncomputed = 0;
    s->drafted = 0;
    s->nhashed = 0;
    s->swapped = 0;
    s->lo = 0;
    s->room = 0;
    m->nseqs++;
}

/* ---- add -------------------------------------------------------------------------------- *
 * In phases, so that groups.c can run them over several groups of one pool: prepare (hash,
 * find which hit lengths this group can serve), count, pin every group's hits, then allocate
 * (pinning first keeps one group's allocation from evicting another group's hits).
 * A hit of k full blocks means tokens [0, k * bs) are reused and computed; the step after
 * computes from position k * bs, so a group must hold the blocks that query reads: all k in a
 * full group, those from needed_from(k * bs) in a window or chunk group (the ones below are
 * null entries), none in a state group (no state snapshots: no hits). */

/* Blocks a table of n tokens takes in this group. */
KVB_INLINE int64_t table_blocks(const kvb_mgr_t *m, int64_t n) {
    return m->kind == KVB_G_STATE ? m->span : blocks_for(m, n);
}

/* First block a k-block hit needs (the entries below it stay null): what the query at k * bs
 * reads, and at least block k - 1, whose cached chained hash proves the prefix was computed
 * (a chunk boundary or a window of one reads none of the prefix). */
KVB_INLINE int64_t hit_lo(const kvb_mgr_t *m, int64_t n, int64_t k) {
    if (!k) return 0;
    int64_t lo = blk_of(m, needed_from(m, k * m->block_size, n, INT64_MAX));
    return lo < k - 1 ? lo : k - 1;
}

int64_t kvb_mgr_hit_lo(const kvb_mgr_t *m, int64_t n, int64_t k) { return hit_lo(m, n, k); }

int64_t kvb_mgr_table_blocks(const kvb_mgr_t *m, int64_t n) { return table_blocks(m, n); }

int kvb_mgr_add_prepare(kvb_mgr_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                        size_t salt_len, uint8_t *ok, int64_t kmax) {
    kvb_pool_t *p = m->pool;
    KVB_CLEAR_ERR(m);
    if (n < 0) { m->err_b = n; return KVB_EINVAL; }
    int64_t total = table_blocks(m, n), full = blk_of(m, n);
    if (total >= p->num_blocks) return out_of_blocks(m, total, p->num_free);
    int32_t slot;
    if (new_slot(m, &slot)) return KVB_ENOMEM;
    kvb_seq_t *s = &m->seqs[slot];
    if (ensure_tokens(s, n) || ensure_blocks(s, total > full ? total : full) ||
        (m->caching && ensure_hashes(m, s, full + 1)))
        return KVB_ENOMEM;
    int64_t K = n > 0 ? blk_of(m, n - 1) : 0; /* at least one token is computed */
    if (K > full) K = full;
    if (kmax < K) K = kmax;
    if (!m->caching) { /* no hits */
        for (int64_t k = 1; k <= kmax; k++) ok[k] = 0;
        return KVB_OK;
    }
    int rc = kvb_chain_begin(m, s, salt, salt_len);
    if (rc) return rc;
    /* groups.c prepares the groups in order: the source group hashed this prompt into
     * the same slot just before */
    kvb_chain_hash(m, s, tokens, 0, full, m->hsrc ? &m->hsrc->seqs[slot] : NULL);
    if (m->kind == KVB_G_FULL) {
        int64_t run = kvb_cache_match(p, s->hashes, K, s->blocks);
        for (int64_t k = run + 1; k <= kmax; k++) ok[k] = 0;
        return KVB_OK;
    }
    /* window / chunk: a hit of k blocks needs blocks [hit_lo(k), k) cached */
    if (kvb_grow((void **)&m->hit, &m->hitcap, K + 1, sizeof *m->hit)) return KVB_ENOMEM;
    int64_t trail = 0; /* cached blocks ending at block k - 1 */
    for (int64_t k = 1; k <= K; k++) {
        int32_t b = kvb_cache_find(p, &s->hashes[k - 1]);
        s->blocks[k - 1] = b == KVB_NONE ? 0 : b;
        trail = b == KVB_NONE ? 0 : trail + 1;
        if (trail < k - hit_lo(m, n, k)) ok[k] = 0;
    }
    for (int64_t k = K + 1; k <= kmax; k++) ok[k] = 0;
    return KVB_OK;
}

int64_t kvb_mgr_add_need(const kvb_mgr_t *m, int64_t n, int64_t k) {
    const kvb_seq_t *s = &m->seqs[m->free_slot];
    int64_t need = table_blocks(m, n) - (m->kind == KVB_G_STATE ? 0 : k);
    for (int64_t j = hit_lo(m, n, k); j < k && m->kind != KVB_G_STATE; j++)
        need += m->pool->ref_count[s->blocks[j]] == 0; /* pinning an evictable hit */
    return need;
}

void kvb_mgr_add_pin(kvb_mgr_t *m, const int32_t *tokens, int64_t n, int64_t k, int stats,
                     int recompute, int32_t *slot_out) {
    kvb_pool_t *p = m->pool;
    int32_t slot = m->free_slot;
    kvb_seq_t *s = &m->seqs[slot];
    int64_t full = blk_of(m, n);
    if (m->kind == KVB_G_STATE) k = 0;
    take_slot(m, slot);
    s->lo = (int32_t)hit_lo(m, n, k);
    for (int64_t j = 0; j < s->lo; j++) s->blocks[j] = KVB_NULL_BLOCK;
    for (int64_t j = s->lo, e; j < k; j = e) { /* 0: a host hit's entry (hosthits.c) */
        while (j < k && !s->blocks[j]) j++;
        for (e = j; e < k && s->blocks[e]; e++) {}
        kvb_pool_pin(p, s->blocks + j, e - j);
    }
    s->nblocks = (int32_t)k;
    kvb_copy(s->tokens, tokens, (size_t)n * sizeof *tokens);
    s->ntokens = n;
    s->ncomputed = k * m->block_size; /* the rest enters the cache once computed */
    if (m->caching) s->nhashed = (int32_t)full;
    if (stats) kvb_mgr_add_stats(m, n, k, recompute);
    *slot_out = slot;
}

void kvb_mgr_add_stats(kvb_mgr_t *m, int64_t n, int64_t k, int recompute) {
    kvb_pool_t *p = m->pool;
    int64_t full = blk_of(m, n);
    if (p->caching) {
        p->stats.queries++;
        p->stats.query_blocks += (uint64_t)full;
        p->stats.hit_blocks += (uint64_t)k;
        if (recompute) {
            p->stats.recompute_query_tokens += (uint64_t)n;
            p->stats.recompute_hit_tokens += (uint64_t)(k * m->block_size);
        } else {
            p->stats.query_tokens += (uint64_t)n;
            p->stats.hit_tokens += (uint64_t)(k * m->block_size);
        }
    }
}

void kvb_mgr_add_fill(kvb_mgr_t *m, int32_t slot) {
    kvb_seq_t *s = &m->seqs[slot];
    int64_t total = table_blocks(m, s->ntokens);
    KVB_MUST(kvb_pool_allocate(m->pool, (int32_t)(total - s->nblocks), s->blocks + s->nblocks));
    s->nblocks = (int32_t)total;
    if (m->kind == KVB_G_STATE) s->room = blocks_for(m, s->ntokens);
}

/* kvb_mgr_add of one group without a host tier, or one full group with it (groups.c's
 * kvb_mgr_add sends the other kinds with a tier to the host-hit rule, hosthits.c). */
int kvb_mgr_add_one(kvb_mgr_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                    size_t salt_len, int recompute, int32_t *slot_out, int64_t *cached_out) {
    uint8_t small[64];
    int64_t K = n > 0 ? blk_of(m, n - 1) : 0;
    uint8_t *ok = K < 64 ? small : malloc((size_t)K + 1);
    if (!ok) return KVB_ENOMEM;
    memset(ok, 1, (size_t)K + 1);
    int rc = kvb_mgr_add_prepare(m, tokens, n, salt, salt_len, ok, K);
    int64_t k = K;
    while (k > 0 && !ok[k]) k--;
    if (ok != small) free(ok);
    if (rc) return rc;
    int64_t need = kvb_mgr_add_need(m, n, k);
    if (need > m->pool->num_free) return out_of_blocks(m, need, m->pool->num_free);
    kvb_tier_t *t = m->pool->tier; /* one full group; other kinds: hosthits.c, via groups.c */
    int64_t hh = 0;
    if (t && m->caching && k < K) { /* the prefix continues on the host: fresh blocks + onloads */
        hh = kvb_tier_match(t, m->seqs[m->free_slot].hashes + k, K - k);
        if (hh < 0) return KVB_ENOMEM;
    }
    kvb_mgr_add_pin(m, tokens, n, k, 1, recompute, slot_out);
    if (hh) kvb_pool_pin(m->host, t->scratch, hh); /* before demotions need room */
    kvb_mgr_add_fill(m, *slot_out);
    kvb_seq_t *s = &m->seqs[*slot_out];
    if (hh) { /* host hits are computed like device ones; counted in the tier's stats */
        int64_t got = kvb_tier_onload_targets(m->pool, s, k, hh);
        for (int64_t i = got; i < hh; i++) kvb_pool_release(m->host, t->scratch[i]);
        hh = got;
    }
    if (hh) {
        kvb_tier_onload(m, s, k, hh);
        if (recompute) t->stats.recompute_hit_tokens += (uint64_t)(hh * m->block_size);
        else t->stats.hit_tokens += (uint64_t)(hh * m->block_size);
        s->ncomputed += hh * m->block_size;
    }
    *cached_out = s->ncomputed;
    return KVB_OK;
}

/* ---- append / reserve ------------------------------------------------------------------- */
/* Grow the table so that it covers ntokens + n slots (blocks counted by need_for). */
static void grow_table(kvb_mgr_t *m, kvb_seq_t *s, int64_t n) {
    int64_t grow = blocks_for(m, s->ntokens + n) - s->nblocks;
    if (grow > 0) {
        KVB_MUST(kvb_pool_allocate(m->pool, (int32_t)grow, s->blocks + s->nblocks));
        s->nblocks += (int32_t)grow;
    }
}

/* Make n slots after the committed tokens writable (copy-on-write of the write block, growth),
 * with capacity for `tokens` more committed tokens. Shared by append and reserve. */
static int make_room(kvb_mgr_t *m, kvb_seq_t *s, int64_t n, int64_t tokens) {
    if (n < 0) { m->err_b = n; return KVB_EINVAL; }
    if (n == 0) return KVB_OK;
    if (m->kind == KVB_G_STATE) { /* the state blocks do not grow */
        if (n > max_tokens(m)) return out_of_blocks(m, INT64_MAX, m->pool->num_free);
        if (ensure_tokens(s, s->ntokens + tokens)) return KVB_ENOMEM;
        if (blocks_for(m, s->ntokens + n) > s->room) s->room = blocks_for(m, s->ntokens + n);
        return KVB_OK;
    }
    if (n > max_tokens(m)) return out_of_blocks(m, blocks_for(m, max_tokens(m)) + 1,
                                                m->pool->num_free);
    int64_t need = need_for(m, s, n); /* release never touches the write block */
    int64_t have = m->pool->num_free + (tokens ? gain_for(m, s, s->ntokens + n) : 0);
    if (need > have) return out_of_blocks(m, need, have);
    if (reserve_capacity(m, s, tokens, need)) return KVB_ENOMEM;
    if (tokens) release_for(m, s, s->ntokens + n, INT64_MAX); /* append: moving on */
    make_writable(m, s);
    grow_table(m, s, n);
    return KVB_OK;
}

int kvb_mgr_append_check(kvb_mgr_t *m, int32_t slot, int64_t n, int computed) {
    kvb_seq_t *s;
    KVB_CLEAR_ERR(m);
    int rc = get_seq(m, slot, 0, &s);
    if (rc) return rc;
    if (n < 0) { m->err_b = n; return KVB_EINVAL; }
    if (computed && n > 0 && (s->ncomputed != s->ntokens || n > s->drafted - s->ntokens)) {
        m->err_a = s->drafted > s->ntokens ? s->drafted - s->ntokens : 0;
        m->err_b = n;
        m->err_what = "computed tokens must fill draft slots the last step scheduled";
        return KVB_ESTATE;
    }
    return KVB_OK;
}

int kvb_mgr_append(kvb_mgr_t *m, int32_t slot, const int32_t *tokens, int64_t n, int computed) {
    int rc = kvb_mgr_append_check(m, slot, n, computed);
    if (rc) return rc;
    kvb_seq_t *s = &m->seqs[slot];
    rc = make_room(m, s, n, n);
    if (rc || n == 0) return rc;
    memcpy(s->tokens + s->ntokens, tokens, (size_t)n * sizeof *tokens);
    s->ntokens += n;
    if (m->caching) hash_new_blocks(m, s);
    if (computed) computed_to(m, s, s->ntokens);
    else s->drafted = 0;
    return KVB_OK;
}

int kvb_mgr_reserve(kvb_mgr_t *m, int32_t slot, int64_t n) {
    kvb_seq_t *s;
    KVB_CLEAR_ERR(m);
    int rc = get_seq(m, slot, 0, &s);
    return rc ? rc : make_room(m, s, n, 0);
}

/* Device blocks swap_in takes: one per block, less the computed full blocks whose content is
 * still cached on the device (re-shared instead of copied; pinning an evictable one takes it
 * out of the free pool all the same). hits_out[i] is the cached block for block i or 0. */
static int64_t swap_in_need(const kvb_mgr_t *m, const kvb_seq_t *s, int32_t *hits_out) {
    const kvb_pool_t *p = m->pool;
    int64_t need = 0, ncached = m->caching ? blk_of(m, s->ncomputed) : 0;
    for (int32_t i = s->lo; i < s->nblocks; i++) {
        int32_t b = i < ncached ? kvb_cache_find(p, &s->hashes[i]) : KVB_NONE;
        if (hits_out) hits_out[i] = b == KVB_NONE ? 0 : b;
        need += b == KVB_NONE || p->ref_count[b] == 0;
    }
    return need;
}

int64_t kvb_mgr_blocks_needed(const kvb_mgr_t *m, int32_t slot, int64_t n) {
    const kvb_seq_t *s = live_seq(m, slot);
    if (!s) return KVB_EUNKNOWN;
    if (s->swapped) {
        int64_t grow = m->kind == KVB_G_STATE ? 0 : growth(m, s, n, s->nblocks);
        return add_sat(swap_in_need(m, s, NULL), grow);
    }
    return need_for(m, s, n);
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* Copy-on-write copies a step makes of shared write blocks shared[0, n) (one entry per member
 * writing into it; sorted here): the k members writing into block b make min(k, users(b) - 1)
 * copies (the last user writes in place). */
static int64_t shared_copies(const kvb_mgr_t *m, int32_t *shared, int64_t n) {
    qsort(shared, (size_t)n, sizeof *shared, cmp_i32);
    int64_t need = 0;
    for (int64_t i = 0; i < n;) {
        int64_t j = i;
        while (j < n && shared[j] == shared[i]) j++;
        int64_t k = j - i, copies = users(m, shared[i]) - 1;
        need = add_sat(need, k < copies ? k : copies);
        i = j;
    }
    return need;
}

/* Exact blocks for n tokens each: the k batch members writing into one shared block b make
 * min(k, users(b) - 1) copies (sequential appends: the last user writes in place). Out of
 * line: only asked when the fast upper bound does not fit. Scratch is O(batch): the shared
 * write blocks are sorted and counted in runs. */
KVB_NOINLINE static int exact_batch_need(kvb_mgr_t *m, const int32_t *slots, int64_t count,
                                         int64_t n, int64_t *need_out) {
    if (m->kind == KVB_G_STATE) { *need_out = 0; return KVB_OK; } /* the state does not grow */
    int32_t *shared = malloc((size_t)(count ? count : 1) * sizeof *shared);
    if (!shared) return KVB_ENOMEM;
    int64_t need = 0, nshared = 0;
    for (int64_t i = 0; i < count; i++) {
        const kvb_seq_t *s = &m->seqs[slots[i]];
        need = add_sat(need, growth(m, s, n, s->nblocks));
        int64_t w = blk_of(m, s->ntokens);
        if (w < s->nblocks && users(m, s->blocks[w]) > 1) shared[nshared++] = s->blocks[w];
    }
    need = add_sat(need, shared_copies(m, shared, nshared));
    free(shared);
    *need_out = need;
    return KVB_OK;
}

KVB_INLINE int64_t mul_sat(int64_t a, int64_t b) { /* a, b >= 0 */
    return a && b > INT64_MAX / a ? INT64_MAX : a * b;
}

/* A scheduler's step in this group, counted exactly (kvb_grp_step_need): for each i in turn,
 * reserve(slots[i], ns[i]) (its new tokens and draft slots: growth, and copy-on-write counted
 * as exact_batch_need does: the k members writing into one shared block b make
 * min(k, users(b) - 1) copies), then forks[i] children of it, each reserving cn[i] slots (the
 * tokens committed with the fork). A child shares its parent's committed blocks only: its
 * slots take a copy of a partly filled write block (the parent's reserve made that block
 * private, the fork shares it again) and the blocks beyond; a state group's fork copies its
 * span blocks at once. Window release is not counted (conservative, as blocks_needed). The
 * slots were validated by the caller (groups.c). */
int kvb_mgr_step_need(kvb_mgr_t *m, const int32_t *slots, const int64_t *ns,
                      const int64_t *cn, const int64_t *forks, int64_t count,
                      int64_t *need_out) {
    int64_t need = 0;
    if (m->kind == KVB_G_STATE) {
        for (int64_t i = 0; forks && i < count; i++) need = add_sat(need, mul_sat(forks[i], m->span));
        *need_out = need;
        return KVB_OK;
    }
    int32_t *shared = malloc((size_t)(count ? count : 1) * sizeof *shared);
    if (!shared) return KVB_ENOMEM;
    int64_t nshared = 0;
    for (int64_t i = 0; i < count; i++) {
        const kvb_seq_t *s = &m->seqs[slots[i]];
        if (forks && forks[i] > 0 && cn[i] > 0) { /* each child: its write block, growth */
            int64_t full = blocks_for(m, s->ntokens) - (off_in(m, s->ntokens) != 0);
            int64_t child = growth(m, s, cn[i], full);
            need = add_sat(need, mul_sat(forks[i], child));
        }
        if (ns[i] <= 0) continue;
        need = add_sat(need, growth(m, s, ns[i], s->nblocks));
        int64_t w = blk_of(m, s->ntokens);
        if (w < s->nblocks && users(m, s->blocks[w]) > 1) shared[nshared++] = s->blocks[w];
    }
    need = add_sat(need, shared_copies(m, shared, nshared));
    free(shared);
    *need_out = need;
    return KVB_OK;
}

int kvb_mgr_batch_need(kvb_mgr_t *m, const int32_t *slots, int64_t count, int64_t n,
                       int64_t *need_out) {
    KVB_CLEAR_ERR(m);
    if (n < 0) { m->err_b = n; return KVB_EINVAL; }
    int64_t need = 0;
    for (int64_t i = 0; i < count; i++) {
        kvb_seq_t *s;
        int rc = get_seq(m, slots[i], 0, &s);
        if (rc) { m->err_a = i; return rc; }
        need = add_sat(need, need_for(m, s, n)); /* saturates: never fits */
    }
    if (n > 0 && need > m->pool->num_free) return exact_batch_need(m, slots, count, n, need_out);
    *need_out = need;
    return KVB_OK;
}

int kvb_mgr_batch_need_exact(kvb_mgr_t *m, const int32_t *slots, int64_t count, int64_t n,
                             int64_t *need_out) {
    if (n <= 0) { *need_out = 0; return KVB_OK; }
    return exact_batch_need(m, slots, count, n, need_out);
}

int kvb_mgr_batch_check(kvb_mgr_t *m, const int32_t *slots, int64_t n) {
    KVB_CLEAR_ERR(m);
    uint32_t stamp = next_stamp(m);
    for (int64_t i = 0; i < n; i++) {
        kvb_seq_t *s = live_seq(m, slots[i]);
        m->err_a = i;
        m->err_b = slots[i];
        if (!s) return KVB_EUNKNOWN;
        if (s->stamp == stamp) return KVB_EDUP;
        if (s->swapped) return KVB_ESWAPPED;
        s->stamp = stamp;
    }
    m->err_a = m->err_b = 0;
    return KVB_OK;
}

/* append_batch's first pass over the batch: validation (unknown, twice, swapped out) when
 * `validate`, capacity for one more token, and in *need_out (unless NULL) an upper bound of the
 * blocks the step takes (one per sequence whose write block is missing or shared). With
 * `release` (groups.c, once the step is known to fit) a window / chunk group also releases,
 * sequence by sequence. */
static int batch_prepare(kvb_mgr_t *m, const int32_t *slots, int64_t n, int validate,
                         int release, int64_t *need_out) {
    kvb_pool_t *p = m->pool;
    uint32_t stamp = validate ? next_stamp(m) : 0;
    int64_t need = 0;
    for (int64_t i = 0; i < n; i++) {
        kvb_seq_t *s = validate ? live_seq(m, slots[i]) : &m->seqs[slots[i]];
        if (validate) {
            m->err_a = i;
            m->err_b = slots[i];
            if (KVB_UNLIKELY(!s)) return KVB_EUNKNOWN;
            if (KVB_UNLIKELY(s->stamp == stamp)) return KVB_EDUP;
            if (KVB_UNLIKELY(s->swapped)) return KVB_ESWAPPED;
            s->stamp = stamp;
        }
        int64_t w = blk_of(m, s->ntokens);
        if (need_out && (w >= s->nblocks || p->ref_count[s->blocks[w]] > 1)) need++; /* bound */
        if (KVB_UNLIKELY(s->ntokens + 1 > s->tcap || s->nblocks + 1 > s->bcap ||
                         (m->caching && w + 1 > s->hcap))) {
            if (reserve_capacity(m, s, 1, 1)) return KVB_ENOMEM;
        }
        if (release) release_for(m, s, s->ntokens + 1, INT64_MAX); /* never the write block */
    }
    m->err_a = m->err_b = 0;
    if (need_out) *need_out = need;
    return KVB_OK;
}

/* append_batch's mutation, once the step is known to fit: window release (with `release`;
 * groups.c releases in prepare), then one token per sequence. */
static int batch_commit(kvb_mgr_t *m, const int32_t *slots, const int32_t *tokens, int64_t n,
                        int release) {
    kvb_pool_t *p = m->pool;
    if (m->kind == KVB_G_STATE) { /* tokens only: the state blocks do not grow */
        for (int64_t i = 0; i < n; i++) {
            kvb_seq_t *s = &m->seqs[slots[i]];
            s->tokens[s->ntokens++] = tokens[i];
            s->drafted = 0;
            if (blocks_for(m, s->ntokens) > s->room) s->room = blocks_for(m, s->ntokens);
        }
        return KVB_OK;
    }
    if (KVB_UNLIKELY(kvb_grow((void **)&m->copies, &m->ccap, 2 * (m->ncopies + n),
                              sizeof *m->copies)))
        return KVB_ENOMEM;
    if (release && m->kind != KVB_G_FULL) /* window / chunk: release, then allocate */
        for (int64_t i = 0; i < n; i++) {
            kvb_seq_t *s = &m->seqs[slots[i]];
            release_for(m, s, s->ntokens + 1, INT64_MAX);
        }
    for (int64_t i = 0; i < n; i++) {
        kvb_seq_t *s = &m->seqs[slots[i]];
        int64_t t = s->ntokens, w = blk_of(m, t);
        if (w >= s->nblocks) {
            KVB_MUST(kvb_pool_allocate(p, 1, s->blocks + s->nblocks));
            s->nblocks++;
        } else {
            int32_t b = s->blocks[w];
            if (KVB_UNLIKELY(p->ref_count[b] > 1 || (p->flags[b] & KVB_F_CACHED)))
                make_writable(m, s);
        }
        s->tokens[t] = tokens[i];
        s->ntokens = t + 1;
        s->drafted = 0;
        if (off_in(m, t + 1) == 0 && m->caching) hash_new_blocks(m, s);
    }
    return KVB_OK;
}

/* The decode step: one token for each of n sequences, one call. */
int kvb_mgr_append_batch(kvb_mgr_t *m, const int32_t *slots, const int32_t *tokens, int64_t n) {
    kvb_pool_t *p = m->pool;
    KVB_CLEAR_ERR(m);
    int64_t need = 0;
    int rc = batch_prepare(m, slots, n, 1, 0, &need);
    if (rc) return rc;
    if (m->kind != KVB_G_STATE && KVB_UNLIKELY(need > p->num_free)) {
        /* count exactly, with what release frees */
        if (exact_batch_need(m, slots, n, 1, &need)) return KVB_ENOMEM;
        int64_t have = p->num_free;
        for (int64_t i = 0; m->kind != KVB_G_FULL && i < n; i++)
            have += gain_for(m, &m->seqs[slots[i]], m->seqs[slots[i]].ntokens + 1);
        if (need > have) return out_of_blocks(m, need, have);
    }
    return batch_commit(m, slots, tokens, n, 1);
}

int kvb_mgr_batch_prepare(kvb_mgr_t *m, const int32_t *slots, int64_t n, int validate) {
    KVB_CLEAR_ERR(m);
    int windowed = m->kind == KVB_G_WINDOW || m->kind == KVB_G_CHUNK;
    return batch_prepare(m, slots, n, validate, windowed, NULL);
}

int kvb_mgr_batch_commit(kvb_mgr_t *m, const int32_t *slots, const int32_t *tokens, int64_t n) {
    return batch_commit(m, slots, tokens, n, 0); /* prepare released */
}

/* ---- schedule: the step that computes committed tokens ---------------------------------- */
int kvb_mgr_schedule(kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                     const int32_t *drafts, int64_t B, int apply) {
    if (apply) {
        kvb_mgr_step_release(m, slots, qlens, B);
        if (m->pool->tier) kvb_tier_settle(m->pool->tier); /* the drain ran */
        for (int64_t i = 0; i < B; i++) {
            kvb_seq_t *s = &m->seqs[slots[i]];
            computed_to(m, s, s->ntokens);
            s->drafted = s->ntokens + (drafts ? drafts[i] : 0);
        }
        return KVB_OK;
    }
    KVB_CLEAR_ERR(m);
    if (m->ncopies) { m->err_a = m->ncopies; return KVB_EPENDING; }
    kvb_tier_t *t = m->pool->tier; /* the step's own write-through copies do not count */
    if (KVB_UNLIKELY(t && kvb_tier_busy(t))) {
        m->err_a = kvb_tier_busy(t);
        m->err_what = "host-tier offloads or onloads are pending (take_offloads, take_onloads)";
        return KVB_EPENDING;
    }
    uint32_t stamp = next_stamp(m);
    for (int64_t i = 0; i < B; i++) {
        kvb_seq_t *s = live_seq(m, slots[i]);
        int64_t q = qlens[i], d = drafts ? drafts[i] : 0;
        m->err_a = i;
        m->err_b = slots[i];
        if (!s) return KVB_EUNKNOWN;
        if (s->stamp == stamp) return KVB_EDUP;
        if (s->swapped) return KVB_ESWAPPED;
        s->stamp = stamp;
        m->err_b = q;
        if (q < 0 || q > s->ntokens) return KVB_EINVAL;
        if (s->ntokens - q > s->ncomputed) {
            m->err_b = s->ntokens - q - s->ncomputed;
            return KVB_EGAP;
        }
        if (s->lo && blk_of(m, needed_from(m, s->ncomputed, s->ntokens, s->ntokens - q)) < s->lo) {
            m->err_b = slots[i];
            m->err_what = "the query reads positions whose blocks were released (window)";
            return KVB_ESTATE;
        }
        m->err_b = d;
        if (d < 0) return KVB_EINVAL;
        if (blocks_for(m, s->ntokens + d) > table_room(m, s)) { /* every kind, state too */
            m->err_what = "draft slots must be reserved first (reserve)";
            return KVB_ESTATE;
        }
        if (m->kind == KVB_G_STATE) continue; /* its blocks are private and never cached */
        /* draft slots are written without being committed: their blocks must be this
         * sequence's alone (a truncate into a shared block leaves it shared until reserve
         * copies it), or the drafts would overwrite another sequence's K/V */
        for (int64_t j = blk_of(m, s->ntokens); d > 0 && j < blocks_for(m, s->ntokens + d); j++) {
            int32_t b = s->blocks[j];
            if (users(m, b) > 1 || (m->pool->flags[b] & KVB_F_CACHED)) {
                m->err_what = "draft slots are in a shared or cached block (reserve first)";
                return KVB_ESTATE;
            }
        }
    }
    m->err_a = m->err_b = 0;
    return KVB_OK;
}

/* ---- truncate / fork / free ------------------------------------------------------------- */
static void release_tail(kvb_mgr_t *m, kvb_seq_t *s, int32_t keep) {
    kvb_pool_t *p = s->swapped ? m->host : m->pool;
    int32_t stop = keep > s->lo ? keep : s->lo; /* entries below lo are null */
    if (s->swapped) /* tail first; with a host tier held until the next drain (tier.c) */
        for (int32_t i = s->nblocks - 1; i >= stop; i--) kvb_tier_release_host(m, &s->blocks[i], 1);
    else
        for (int32_t i = s->nblocks - 1; i >= stop; i--) kvb_pool_release(p, s->blocks[i]);
    if (keep < s->nblocks) s->tver++;
    s->nblocks = keep;
    if (s->lo > keep) s->lo = keep;
    if (KVB_UNLIKELY(m->ncopies) && p == m->pool) drop_dead_copies(m);
}

int kvb_mgr_truncate_check(kvb_mgr_t *m, int32_t slot, int64_t ntokens) {
    kvb_seq_t *s;
    KVB_CLEAR_ERR(m);
    int rc = get_seq(m, slot, 0, &s);
    if (rc) return rc;
    if (ntokens < 0 || ntokens > s->ntokens) {
        m->err_a = s->ntokens;
        m->err_b = ntokens;
        return KVB_EINVAL;
    }
    int64_t nc = s->ncomputed < ntokens ? s->ncomputed : ntokens;
    if (m->kind == KVB_G_STATE && ntokens < s->ncomputed) {
        m->err_a = s->ncomputed;
        m->err_what = "a recurrent state cannot drop computed tokens";
        return KVB_ESTATE;
    }
    if (s->lo && (ntokens == 0 || blk_of(m, needed_from(m, nc, ntokens, INT64_MAX)) < s->lo)) {
        m->err_a = (int64_t)s->lo * m->block_size;
        m->err_what = "the shorter sequence would read positions whose blocks were released";
        return KVB_ESTATE;
    }
    return KVB_OK;
}

int kvb_mgr_truncate(kvb_mgr_t *m, int32_t slot, int64_t ntokens) {
    int rc = kvb_mgr_truncate_check(m, slot, ntokens);
    if (rc) return rc;
    kvb_seq_t *s = &m->seqs[slot];
    if (m->kind != KVB_G_STATE) release_tail(m, s, (int32_t)blocks_for(m, ntokens));
    else if (s->room > blocks_for(m, ntokens)) s->room = blocks_for(m, ntokens); /* as a table */
    s->ntokens = ntokens;
    if (s->ncomputed > ntokens) s->ncomputed = ntokens;
    s->drafted = 0;
    if (s->nhashed > blk_of(m, ntokens)) s->nhashed = (int32_t)blk_of(m, ntokens);
    return KVB_OK;
}

int kvb_mgr_fork(kvb_mgr_t *m, int32_t parent, int32_t *child_out) {
    kvb_seq_t *ps;
    KVB_CLEAR_ERR(m);
    int rc = get_seq(m, parent, 0, &ps);
    if (rc) return rc;
    int32_t slot;
    if (new_slot(m, &slot)) return KVB_ENOMEM;
    ps = &m->seqs[parent]; /* new_slot may have moved the array */
    kvb_seq_t *s = &m->seqs[slot];
    int64_t nb = table_blocks(m, ps->ntokens);
    if (ensure_tokens(s, ps->ntokens) || ensure_blocks(s, nb) ||
        ensure_hashes(m, s, ps->nhashed + 1) || kvb_chain_fork(m, s, ps))
        return KVB_ENOMEM;
    if (m->kind == KVB_G_STATE) { /* the child's state is copied now: it diverges next step */
        if (nb > m->pool->num_free) return out_of_blocks(m, nb, m->pool->num_free);
        if (kvb_grow((void **)&m->copies, &m->ccap, 2 * (m->ncopies + nb), sizeof *m->copies))
            return KVB_ENOMEM;
        take_slot(m, slot);
        KVB_MUST(kvb_pool_allocate(m->pool, (int32_t)nb, s->blocks));
        for (int64_t i = 0; i < nb; i++) queue_copy(m, ps->blocks[i], s->blocks[i]);
        kvb_copy(s->tokens, ps->tokens, (size_t)ps->ntokens * sizeof *s->tokens);
        s->ntokens = ps->ntokens;
        s->ncomputed = ps->ncomputed;
        s->nblocks = (int32_t)nb;
        s->room = blocks_for(m, ps->ntokens); /* a token table's fork shares only these */
        *child_out = slot;
        return KVB_OK;
    }
    for (int64_t i = ps->lo; i < nb; i++) /* ref counts stay far below INT32_MAX */
        if (m->pool->ref_count[ps->blocks[i]] == INT32_MAX) return KVB_ENOMEM;
    take_slot(m, slot);
    kvb_copy(s->tokens, ps->tokens, (size_t)ps->ntokens * sizeof *s->tokens);
    kvb_copy(s->blocks, ps->blocks, (size_t)nb * sizeof *s->blocks);
    kvb_copy(s->hashes, ps->hashes, (size_t)ps->nhashed * sizeof *s->hashes);
    s->ntokens = ps->ntokens;
    s->ncomputed = ps->ncomputed;
    s->nblocks = (int32_t)nb;
    s->nhashed = ps->nhashed;
    s->root = ps->root;
    s->lo = ps->lo;
    for (int64_t i = s->lo; i < nb; i++) m->pool->ref_count[s->blocks[i]]++; /* referenced */
    *child_out = slot;
    return KVB_OK;
}

int kvb_mgr_free(kvb_mgr_t *m, int32_t slot) {
    kvb_seq_t *s;
    KVB_CLEAR_ERR(m);
    int rc = get_seq(m, slot, 1, &s);
    if (rc) return rc;
    release_tail(m, s, 0); /* tail first: the longest prefixes are evicted first */
    s->ntokens = 0;
    s->ncomputed = 0;
    s->drafted = 0;
    s->nhashed = 0;
    s->swapped = 0;
    s->gen++; /* even: free */
    s->next_free = m->free_slot;
    m->free_slot = slot;
    m->nseqs--;
    return KVB_OK;
}

/* ---- swap ------------------------------------------------------------------------------- */
int kvb_mgr_swap_out(kvb_mgr_t *m, int32_t slot, int64_t *pairs_out, int64_t *npairs) {
    kvb_seq_t *s;
    KVB_CLEAR_ERR(m);
    int rc = get_seq(m, slot, 0, &s);
    if (rc) return rc;
    if (!m->host) return KVB_ESTATE;
    kvb_pool_t *p = m->pool, *h = m->host;
    int32_t lo = s->lo, nb = s->nblocks - lo; /* released entries stay null */
    if (nb > h->num_free) return out_of_blocks(m, nb, h->num_free);
    int32_t *fresh = malloc((size_t)(nb ? nb : 1) * sizeof *fresh);
    if (!fresh) return KVB_ENOMEM;
    KVB_MUST(kvb_pool_allocate(h, nb, fresh));
    for (int32_t i = 0; i < nb; i++) {
        int32_t b = s->blocks[lo + i]; /* a pending copy's destination reads its source */
        pairs_out[2 * i] = (p->flags[b] & KVB_F_COPY_DST) ? pending_src(m, b) : b;
        pairs_out[2 * i + 1] = fresh[i];
        if (p->tier) kvb_tier_swap_src(p->tier, (int32_t)pairs_out[2 * i]);
    }
    for (int32_t i = s->nblocks - 1; i >= lo; i--) kvb_pool_release(p, s->blocks[i]);
    kvb_copy(s->blocks + lo, fresh, (size_t)nb * sizeof *fresh);
    free(fresh);
    *npairs = nb;
    s->tver++;
    s->swapped = 1;
    s->drafted = 0;
    if (KVB_UNLIKELY(m->ncopies)) drop_dead_copies(m);
    return KVB_OK;
}

int kvb_mgr_swap_in(kvb_mgr_t *m, int32_t slot, int64_t *pairs_out, int64_t *npairs) {
    kvb_seq_t *s;
    KVB_CLEAR_ERR(m);
    int rc = get_seq(m, slot, 1, &s);
    if (rc) return rc;
    if (!m->host || !s->swapped) return KVB_ESTATE;
    kvb_pool_t *p = m->pool;
    int32_t nb = s->nblocks;
    int32_t *dev = malloc((size_t)(nb ? nb : 1) * sizeof *dev);
    if (!dev) return KVB_ENOMEM;
    int64_t need = swap_in_need(m, s, dev);
    if (need > p->num_free) { free(dev); return out_of_blocks(m, need, p->num_free); }
    int64_t k = 0;
    for (int32_t i = 0; i < s->lo; i++) dev[i] = KVB_NULL_BLOCK;
    for (int32_t i = s->lo; i < nb; i++) { /* pin every hit before allocating the rest */
        if (dev[i]) kvb_pool_pin(p, &dev[i], 1);
    }
    for (int32_t i = s->lo; i < nb; i++) {
        if (!dev[i]) {
            KVB_MUST(kvb_pool_allocate(p, 1, &dev[i]));
            pairs_out[2 * k] = s->blocks[i];
            pairs_out[2 * k + 1] = dev[i];
            k++;
            if (p->tier) kvb_tier_swap_dst(p->tier, dev[i]); /* filled by the swap pair */
        }
    }
    for (int32_t i = nb - 1; i >= s->lo; i--) kvb_tier_release_host(m, &s->blocks[i], 1);
    kvb_copy(s->blocks, dev, (size_t)nb * sizeof *dev);
    free(dev);
    s->tver++;
    s->swapped = 0;
    int64_t ncomp = m->kind == KVB_G_STATE ? 0 : blk_of(m, s->ncomputed);
    for (int64_t i = s->lo; i < ncomp; i++) /* written by the swap pairs */
        p->flags[s->blocks[i]] |= KVB_F_WRITTEN;
    if (m->caching) cache_blocks(m, s, s->lo, ncomp); /* serve hits again */
    *npairs = k;
    return KVB_OK;
}

/* ---- check ------------------------------------------------------------------------------ */
#define MFAIL(what, item) do { m->err_what = (what); m->err_a = i; m->err_b = (item); \
                               rc = KVB_ECORRUPT; goto done; } while (0)

/* One group's tables: every invariant that involves only this manager, and its references
 * (tables, pending-copy holds) added into refs (device) and hrefs (host, may be NULL). */
int kvb_mgr_check_tables(kvb_mgr_t *m, int32_t *refs, int32_t *hrefs) {
    kvb_pool_t *p = m->pool;
    int rc;
    int64_t i = 0;
    KVB_CLEAR_ERR(m);
    int64_t live = 0, nfree = 0;
    for (i = 0; i < m->scap; i++) {
        const kvb_seq_t *s = &m->seqs[i];
        if (!(s->gen & 1u)) { nfree++; continue; }
        live++;
        const kvb_pool_t *sp = s->swapped ? m->host : p;
        int32_t *r = s->swapped ? hrefs : refs;
        if (s->swapped && !m->host) MFAIL("swapped sequence without a host pool", 0);
        int64_t want = m->kind == KVB_G_STATE ? m->span : blocks_for(m, s->ntokens);
        if (s->nblocks > s->bcap || (m->kind == KVB_G_STATE ? s->nblocks != want
                                                             : s->nblocks < want))
            MFAIL("table shorter than its tokens or beyond capacity", s->nblocks);
        if (s->ntokens > s->tcap) MFAIL("tokens beyond capacity", s->ntokens);
        if (m->kind == KVB_G_STATE ? s->room < blocks_for(m, s->ntokens) : s->room != 0)
            MFAIL("a state group's room short of its tokens (or room outside one)", s->room);
        if (s->ncomputed < 0 || s->ncomputed > s->ntokens)
            MFAIL("computed tokens outside [0, committed]", s->ncomputed);
        if (s->lo < 0 || s->lo > s->nblocks ||
            (s->lo && m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK))
            MFAIL("released blocks outside a window or chunk group's table", s->lo);
        if (s->lo && blk_of(m, needed_from(m, s->ncomputed, s->ntokens, INT64_MAX)) < s->lo)
            MFAIL("a block the next query reads was released", s->lo);
        for (int32_t j = 0; j < s->lo; j++)
            if (s->blocks[j] != KVB_NULL_BLOCK) MFAIL("released entry is not the null block", j);
        for (int32_t j = s->lo; j < s->nblocks; j++) {
            int32_t b = s->blocks[j];
            if (b <= 0 || b >= sp->num_blocks) MFAIL("table holds an out-of-range block", b);
            r[b]++;
        }
        int64_t full = blk_of(m, s->ntokens);
        if (s->nhashed != (m->caching ? full : 0)) MFAIL("hashes known != full blocks", s->nhashed);
        for (int32_t j = 0; j < s->nhashed; j++) {
            kvb_hash_t h;
            kvb_chain_block(m, s, j, &h);
            if (h.lo != s->hashes[j].lo || h.hi != s->hashes[j].hi)
                MFAIL("block hash does not match its tokens", j);
            int32_t b = s->blocks[j]; /* a cached full block holds this very content */
            if (j >= s->lo && !s->swapped && (p->flags[b] & KVB_F_CACHED) &&
                (p->hash[b].lo != h.lo || p->hash[b].hi != h.hi || p->gid[b] != m->gidx))
                MFAIL("cached full block registered under another hash or group", b);
        }
        /* blocks past the write block are private */
        for (int64_t j = blk_of(m, s->ntokens) + 1; m->kind != KVB_G_STATE && j < s->nblocks; j++)
            if (s->swapped ? sp->ref_count[s->blocks[j]] != 1 : users(m, s->blocks[j]) != 1)
                MFAIL("reserved block is shared", s->blocks[j]);
    }
    i = 0;
    if (live != m->nseqs) MFAIL("live slots != nseqs", live);
    int64_t stack = 0;
    for (int32_t k = m->free_slot; k != KVB_NONE; k = m->seqs[k].next_free) {
        if (m->seqs[k].gen & 1u) MFAIL("free-slot stack holds a live slot", k);
        if (++stack > m->scap) MFAIL("free-slot stack has a cycle", k);
    }
    if (stack != nfree) MFAIL("free-slot stack length != free slots", stack);
    for (i = 0; i < m->ncopies; i++) {
        int64_t src = m->copies[2 * i], dst = m->copies[2 * i + 1];
        if (src <= 0 || src >= p->num_blocks || dst <= 0 || dst >= p->num_blocks)
            MFAIL("pending copy holds an out-of-range block", src);
        if (!(p->flags[src] & KVB_F_COPY_SRC) || (p->flags[src] & KVB_F_COPY_DST))
            MFAIL("pending copy source not flagged, or also a destination", src);
        if (!(p->flags[dst] & KVB_F_COPY_DST) || (p->flags[dst] & KVB_F_COPY_SRC) ||
            p->ref_count[dst] == 0)
            MFAIL("pending copy destination not flagged, also a source, or free", dst);
        refs[src]++; /* the hold */
    }
    /* no prefix hit can read an unwritten slot: a cached block is flagged written (pool
     * check), and a block is flagged written only once computed; a sequence's computed full
     * blocks are all flagged (a copy destination once its pending copy runs) */
    for (i = 0; i < m->scap; i++) {
        const kvb_seq_t *s = &m->seqs[i];
        if (!(s->gen & 1u) || s->swapped || m->kind == KVB_G_STATE) continue;
        for (int64_t j = s->lo; j < blk_of(m, s->ncomputed); j++) {
            int32_t b = s->blocks[j];
            if (!(p->flags[b] & (KVB_F_WRITTEN | KVB_F_COPY_DST)))
                MFAIL("computed full block not flagged written", b);
        }
    }
    rc = KVB_OK;
done:
    return rc;
}

/* Pools first, then every group's tables; the ref counts must equal the sum of what all
 * groups hold. */
int kvb_grp_check(kvb_mgr_t *const *g, int32_t G) {
    kvb_mgr_t *m = g[0];
    kvb_pool_t *p = m->pool;
    int rc = kvb_pool_check(p);
    if (rc) { m->err_what = p->err_what; m->err_a = p->err_a; m->err_b = p->err_b; return rc; }
    if (m->host && (rc = kvb_pool_check(m->host))) {
        m->err_what = m->host->err_what; m->err_a = m->host->err_a; m->err_b = m->host->err_b;
        return rc;
    }
    KVB_CLEAR_ERR(m);
    int32_t *refs = calloc((size_t)p->num_blocks, sizeof *refs);
    int32_t *hrefs = m->host ? calloc((size_t)m->host->num_blocks, sizeof *hrefs) : NULL;
    if (!refs || (m->host && !hrefs)) {
        free(refs); free(hrefs);
        return KVB_ENOMEM;
    }
    int64_t ncopies = 0, i = 0;
    for (int32_t k = 0; k < G; k++) {
        ncopies += g[k]->ncopies;
        if ((rc = kvb_mgr_check_tables(g[k], refs, hrefs))) {
            if (k) { m->err_what = g[k]->err_what; m->err_a = g[k]->err_a; m->err_b = g[k]->err_b; }
            goto done;
        }
        if (g[k]->nseqs != m->nseqs || g[k]->free_slot != m->free_slot)
            MFAIL("groups disagree on the live sequences", k);
        /* lock step: one sequence, every group */
        for (i = 0; k && i < m->scap && i < g[k]->scap; i++) {
            const kvb_seq_t *a = &m->seqs[i], *b = &g[k]->seqs[i];
            if (a->gen != b->gen || ((a->gen & 1u) && (a->ntokens != b->ntokens ||
                                                       a->swapped != b->swapped)))
                MFAIL("groups disagree on a sequence's tokens", k);
        }
        i = 0;
    }
    if ((rc = kvb_tier_check(m, refs, hrefs))) goto done; /* host tier holds (tier.c) */
    for (int32_t b = 1; b < p->num_blocks; b++) {
        if (refs[b] != p->ref_count[b]) MFAIL("ref count != references held", b);
        if ((p->flags[b] & (KVB_F_COPY_SRC | KVB_F_COPY_DST)) && !ncopies)
            MFAIL("copy flag without a pending copy", b);
    }
    if (m->host)
        for (int32_t b = 1; b < m->host->num_blocks; b++)
            if (hrefs[b] != m->host->ref_count[b]) MFAIL("host ref count != references held", b);
    rc = KVB_OK;
done:
    free(refs);
    free(hrefs);
    return rc;
}

int kvb_mgr_check(kvb_mgr_t *m) {
    return kvb_grp_check(&m, 1);
}

/* ---- admission probe -------------------------------------------------------------------- */
/* kvb_mgr_probe of one full-attention group (groups.c's kvb_mgr_probe sends the other kinds
 * to kvb_grp_probe). */
int kvb_mgr_probe_one(kvb_mgr_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                      size_t salt_len, int64_t *cached_out, int64_t *need_out) {
    kvb_pool_t *p = m->pool;
    KVB_CLEAR_ERR(m);
    if (n < 0) { m->err_b = n; return KVB_EINVAL; }
    int64_t total = blocks_for(m, n), hits = 0, pinned_from_free = 0;
    if (p->tier) kvb_tier_flush(p->tier); /* recent evictions: on the host */
    if (m->caching && n > 1) {
        int64_t max_hits = blk_of(m, n - 1);
        kvb_hasher_t hs;
        kvb_digest_t d, parent;
        int rc = kvb_chain_probe(m, salt, salt_len, &hs);
        if (rc) return rc;
        int host = 0; /* 1 once the device prefix ended: it continues on the host tier */
        for (; hits < max_hits; hits++) { /* hash block by block: stop at the first miss */
            kvb_hash_blocks(&hs, hits ? &parent : NULL, hits, tokens + hits * m->block_size,
                            1, m->block_size, &d.h, &d.x);
            int32_t b = host ? KVB_NONE : kvb_cache_find(p, &d.h);
            if (b == KVB_NONE) {
                if (!p->tier || kvb_cache_find(p->tier->host, &d.h) == KVB_NONE) break;
                host = 1; /* a host hit takes a fresh device block all the same */
            }
            pinned_from_free += b == KVB_NONE || p->ref_count[b] == 0;
            parent = d;
        }
    }
    *cached_out = hits * m->block_size;
    *need_out = total - hits + pinned_from_free;
    return KVB_OK;
}
