/* table.c -- one KV cache group's tables: the per-kind rules and the table work of every
 * manager call, on one group's row of a sequence (manager.c runs them over the groups and
 * updates the sequence's record once).
 *
 * A row holds blocks[0..nblocks): physical block ids; the first ceil(ntokens / block_size)
 * hold the record's committed tokens, the rest are reserved (lookahead) slots. A window or
 * chunk group's entries below lo were released (null block 0); a state group's row is its
 * span state blocks whatever the sequence's length.
 *
 * Functions here read the record (tokens, counters, hashes) as it was before the call: the
 * manager runs every group's table work first, then the record's update, then the work that
 * needs the updated record (caching of newly computed blocks).
 *
 * Writing rule: before tokens are written into block w = ntokens / block_size (append, or
 * reserve that hands out its slots), that block must be private. If other sequences use it
 * (a fork or a prefix-cache hit shares it), copy-on-write: take a fresh block, queue the
 * (old, new) copy when the old one holds committed tokens, drop one reference of the old one.
 * The last user writes in place. If it is private but still carries a prefix-cache entry
 * (after truncate), the entry is dropped. Fork shares only the committed blocks, so no later
 * block can be shared. Pending copies are described at tbl_queue_copy below.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "table.h"

int tbl_ensure_blocks(kvb_row_t *r, int64_t need) {
    int64_t cap = r->bcap;
    if (need > INT32_MAX) return KVB_ENOMEM;
    int rc = kvb_grow((void **)&r->blocks, &cap, need, sizeof *r->blocks);
    r->bcap = (int32_t)cap;
    return rc;
}

/* Room for `more` pending copy pairs. */
int tbl_ensure_copies(kvb_mgr_t *m, int64_t more) {
    return kvb_grow((void **)&m->copies, &m->ccap, 2 * (m->ncopies + more), sizeof *m->copies);
}

/* ---- pending copy-on-write pairs -------------------------------------------------------- *
 * A pair (src, dst) is queued when a write makes a private copy of a shared partial block.
 * Until take_copies() drains it, the pair holds one reference on src (flag COPY_SRC), so src
 * is never handed out, evicted or overwritten before the copy runs; dst is fresh and flagged
 * COPY_DST. A new pair whose source is itself a pending dst reads that pair's source instead
 * (chains collapse), so no block is both a source and a destination and one copy_blocks call
 * runs any drained list in any order. Writers ignore the holds: the last sequence using a
 * block writes in place (the pending copies run before the forward pass that writes). */
KVB_NOINLINE int32_t tbl_pending_src(const kvb_mgr_t *m, int32_t dst) {
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
void tbl_queue_copy(kvb_mgr_t *m, int32_t src, int32_t dst) {
    kvb_pool_t *p = m->pool;
    if (KVB_UNLIKELY(p->flags[src] & KVB_F_COPY_DST)) src = tbl_pending_src(m, src);
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

int64_t tbl_take_copies(kvb_mgr_t *m, int64_t *out) {
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
void tbl_drop_dead_copies(kvb_mgr_t *m) {
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

/* ---- the write rule --------------------------------------------------------------------- */
/* Blocks beyond the first `base` that ntokens + n tokens cover, for any n in [0, INT64_MAX]:
 * exact, saturating at INT64_MAX (never fits) rather than overflowing. ntokens is below 2^62,
 * so only n's quotient can overflow, and it is added last. Subtracting `base` before the
 * quotient keeps the answer exact up to INT64_MAX itself (a fuzz finding: a saturated cover
 * less the table length answered INT64_MAX - nblocks for block_size 1). */
int64_t tbl_growth(const kvb_mgr_t *m, int64_t ntokens, int64_t n, int64_t base) {
    int64_t q = n / m->block_size;
    int64_t d = blocks_for(m, ntokens + n % m->block_size) - base;
    if (d > 0 && q > INT64_MAX - d) return INT64_MAX;
    return q + d > 0 ? q + d : 0;
}

/* Blocks taking n more written tokens would cost: growth plus copy-on-write of block w. */
int64_t tbl_need_for(const kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r, int64_t n) {
    if (n <= 0 || m->kind == KVB_G_STATE) return 0;
    int64_t grow = tbl_growth(m, s->ntokens, n, r->nblocks);
    int64_t w = blk_of(m, s->ntokens);
    return w < r->nblocks && users(m, r->blocks[w]) > 1 ? add_sat(grow, 1) : grow;
}

/* Make block w private (copy-on-write) and uncached; one free block is available if needed. */
void tbl_make_writable(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r) {
    kvb_pool_t *p = m->pool;
    int64_t w = blk_of(m, s->ntokens);
    if (w >= r->nblocks) return;
    int32_t b = r->blocks[w];
    if (users(m, b) > 1) {
        int32_t nb;
        KVB_MUST(kvb_pool_allocate(p, 1, &nb)); /* cannot fail: counted by tbl_need_for */
        if (off_in(m, s->ntokens)) tbl_queue_copy(m, b, nb);
        r->blocks[w] = nb;
        r->tver++;
        kvb_pool_release(p, b);
    } else if (p->flags[b] & (KVB_F_CACHED | KVB_F_WRITTEN)) {
        kvb_pool_uncache(p, b); /* its content is about to change */
        p->flags[b] &= (uint8_t)~KVB_F_WRITTEN;
    }
}

/* Grow the table so that it covers ntokens + n slots (blocks counted by tbl_need_for). */
void tbl_grow(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t n) {
    int64_t grow = blocks_for(m, s->ntokens + n) - r->nblocks;
    if (grow > 0) {
        KVB_MUST(kvb_pool_allocate(m->pool, (int32_t)grow, r->blocks + r->nblocks));
        r->nblocks += (int32_t)grow;
    }
}

/* ---- caching ---------------------------------------------------------------------------- */
/* Register full blocks [from, to) of the row, whose record hashes are known, in the prefix
 * cache under this group's keys. */
void tbl_cache(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t from, int64_t to) {
    kvb_pool_t *p = m->pool;
    p->events.cur_tag = s->chain.tag;
    for (int64_t i = from; i < to; i++) {
        int32_t b = r->blocks[i];
        if (!(p->flags[b] & KVB_F_CACHED)) {
            kvb_hash_t h = gkey(m, s, i), parent;
            if (i) parent = gkey(m, s, i - 1);
            p->gid[b] = m->gidx;
            kvb_cache_put(p, b, &h, i ? &parent : NULL, /* 1st: nil */
                          s->tokens + i * m->block_size, m->block_size);
        }
    }
    p->events.cur_tag = 0;
    if (p->tier) kvb_tier_absorb(p->tier); /* the cache's insertion records (write-through) */
}

/* Full blocks [from, to) became computed in this group (tbl_computed): flag them written and
 * cache them. */
void tbl_computed_blocks(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int64_t from, int64_t to) {
    for (int64_t i = from; i < to; i++) m->pool->flags[r->blocks[i]] |= KVB_F_WRITTEN;
    if (m->caching) tbl_cache(m, s, r, from, to);
}

/* ---- release (window, chunk) ------------------------------------------------------------ */
/* Release blocks [lo, upto) of a resident sequence's row (upto > lo: tbl_release_for). */
void tbl_release_front(kvb_mgr_t *m, kvb_row_t *r, int64_t upto) {
    KVB_ASSERT(upto <= r->nblocks);
    for (int32_t j = r->lo; j < upto; j++) {
        int32_t b = r->blocks[j];
        r->blocks[j] = KVB_NULL_BLOCK;
        kvb_pool_release(m->pool, b);
    }
    r->lo = (int32_t)upto;
    r->tver++;
    if (KVB_UNLIKELY(m->ncopies)) tbl_drop_dead_copies(m);
}

/* Blocks that tbl_release_for(ntokens) would return to the free pool: those this sequence
 * alone holds (a block shared with another sequence, or held by a pending copy, is not
 * counted). A call that may still be refused counts them instead of releasing first: what
 * it releases is chosen for the longer sequence, and a refused call must leave the block
 * the newest token's recompute reads. */
int64_t tbl_gain(const kvb_mgr_t *m, const kvb_row_t *r, int64_t ntokens) {
    if (m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK) return 0;
    int64_t upto = blk_of(m, tbl_needed_from(m, r->done, ntokens, INT64_MAX));
    int64_t gain = 0;
    for (int64_t j = r->lo; j < upto; j++) gain += m->pool->ref_count[r->blocks[j]] == 1;
    return gain;
}

/* Release the row's entries from `keep` on, last first (a swapped row to the host pool; with
 * a host tier held until the next drain, tier.c). */
void tbl_release_tail(kvb_mgr_t *m, const kvb_seq_t *s, kvb_row_t *r, int32_t keep) {
    int32_t stop = keep > r->lo ? keep : r->lo; /* entries below lo are null */
    if (s->swapped)
        for (int32_t i = r->nblocks - 1; i >= stop; i--) kvb_tier_release_host(m, &r->blocks[i], 1);
    else
        for (int32_t i = r->nblocks - 1; i >= stop; i--) kvb_pool_release(m->pool, r->blocks[i]);
    if (keep < r->nblocks) r->tver++;
    r->nblocks = keep;
    if (r->lo > keep) r->lo = keep;
    if (KVB_UNLIKELY(m->ncopies) && !s->swapped) tbl_drop_dead_copies(m);
}

/* ---- counting --------------------------------------------------------------------------- */
/* Device blocks swap_in takes: one per block, less the computed full blocks whose content is
 * still cached on the device (re-shared instead of copied; pinning an evictable one takes it
 * out of the free pool all the same). hits_out[i] is the cached block for block i or 0. */
int64_t tbl_swap_in_need(const kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r,
                         int32_t *hits_out) {
    const kvb_pool_t *p = m->pool;
    int64_t need = 0, ncached = m->caching ? blk_of(m, r->done) : 0;
    for (int32_t i = r->lo; i < r->nblocks; i++) {
        kvb_hash_t h;
        if (i < ncached) h = gkey(m, s, i);
        int32_t b = i < ncached ? kvb_cache_find(p, &h) : KVB_NONE;
        if (hits_out) hits_out[i] = b == KVB_NONE ? 0 : b;
        need += b == KVB_NONE || p->ref_count[b] == 0;
    }
    return need;
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

KVB_INLINE int64_t mul_sat(int64_t a, int64_t b) { /* a, b >= 0 */
    return a && b > INT64_MAX / a ? INT64_MAX : a * b;
}

/* A scheduler's step in this group, counted exactly: for each i in turn, ns[i] more slots
 * (growth, and copy-on-write where the k members writing into one shared block b make
 * min(k, users(b) - 1) copies), then forks[i] children of it, each taking cn[i] slots (the
 * tokens committed with the fork). A child shares its parent's committed blocks only: its
 * slots take a copy of a partly filled write block and the blocks beyond; a state group's
 * fork copies its span blocks at once. ns may be NULL (n slots each); forks may be NULL.
 * Window release is not counted (conservative). The slots were validated by the caller. */
int tbl_step_need(kvb_mgr_t *m, const int32_t *slots, const int64_t *ns, int64_t n,
                  const int64_t *cn, const int64_t *forks, int64_t count, int64_t *need_out) {
    int64_t need = 0;
    if (m->kind == KVB_G_STATE) {
        for (int64_t i = 0; forks && i < count; i++) need = add_sat(need, mul_sat(forks[i], m->span));
        *need_out = need;
        return KVB_OK;
    }
    const kvb_seq_t *seqs = m->lead->seqs;
    int32_t *shared = malloc((size_t)(count ? count : 1) * sizeof *shared);
    if (!shared) return KVB_ENOMEM;
    int64_t nshared = 0;
    for (int64_t i = 0; i < count; i++) {
        const kvb_seq_t *s = &seqs[slots[i]];
        const kvb_row_t *r = row_of(m, slots[i]);
        if (forks && forks[i] > 0 && cn[i] > 0) { /* each child: its write block, growth */
            int64_t full = blocks_for(m, s->ntokens) - (off_in(m, s->ntokens) != 0);
            int64_t child = tbl_growth(m, s->ntokens, cn[i], full);
            need = add_sat(need, mul_sat(forks[i], child));
        }
        int64_t ni = ns ? ns[i] : n;
        if (ni <= 0) continue;
        need = add_sat(need, tbl_growth(m, s->ntokens, ni, r->nblocks));
        int64_t w = blk_of(m, s->ntokens);
        if (w < r->nblocks && users(m, r->blocks[w]) > 1) shared[nshared++] = r->blocks[w];
    }
    need = add_sat(need, shared_copies(m, shared, nshared));
    free(shared);
    *need_out = need;
    return KVB_OK;
}

/* ---- step validation of one group ------------------------------------------------------- */
/* tbl_step_check past its fast path (table.h). */
int tbl_step_check_slow(kvb_mgr_t *m, const kvb_seq_t *s, const kvb_row_t *r, int64_t q,
                        int64_t d) {
    if (r->lo && blk_of(m, tbl_needed_from(m, r->done, s->ntokens, s->ntokens - q)) < r->lo) {
        m->err_what = "the query reads positions whose blocks were released (window)";
        return KVB_ESTATE;
    }
    if (blocks_for(m, s->ntokens + d) > table_room(m, r)) {
        m->err_b = d;
        m->err_what = "draft slots must be reserved first (reserve)";
        return KVB_ESTATE;
    }
    if (m->kind == KVB_G_STATE) return KVB_OK; /* its blocks are private and never cached */
    /* draft slots are written without being committed: their blocks must be this sequence's
     * alone (a truncate into a shared block leaves it shared until reserve copies it), or
     * the drafts would overwrite another sequence's K/V */
    for (int64_t j = blk_of(m, s->ntokens); d > 0 && j < blocks_for(m, s->ntokens + d); j++) {
        int32_t b = r->blocks[j];
        if (users(m, b) > 1 || (m->pool->flags[b] & KVB_F_CACHED)) {
            m->err_b = d;
            m->err_what = "draft slots are in a shared or cached block (reserve first)";
            return KVB_ESTATE;
        }
    }
    return KVB_OK;
}

/* ---- check ------------------------------------------------------------------------------ */
#define MFAIL(what, item) do { m->err_what = (what); m->err_a = i; m->err_b = (item); \
                               return KVB_ECORRUPT; } while (0)

/* One group's rows of the live sequences, and their references (tables, pending-copy holds)
 * added into refs (device) and hrefs (host, may be NULL). The records are checked by the
 * manager. */
int tbl_check(kvb_mgr_t *m, int32_t *refs, int32_t *hrefs) {
    kvb_pool_t *p = m->pool;
    const kvb_mgr_t *l = m->lead;
    int64_t i = 0;
    KVB_CLEAR_ERR(m);
    if (m != l && m->rcap < l->scap) MFAIL("a group has fewer rows than slots", m->rcap);
    for (i = 0; i < l->scap; i++) {
        const kvb_seq_t *s = &l->seqs[i];
        if (!(s->gen & 1u)) continue;
        const kvb_row_t *r = row_of(m, (int32_t)i);
        const kvb_pool_t *sp = s->swapped ? m->host : p;
        int32_t *rf = s->swapped ? hrefs : refs;
        if (s->swapped && !m->host) MFAIL("swapped sequence without a host pool", 0);
        int64_t want = tbl_blocks(m, s->ntokens);
        if (r->nblocks > r->bcap || (m->kind == KVB_G_STATE ? r->nblocks != want
                                                             : r->nblocks < want))
            MFAIL("table shorter than its tokens or beyond capacity", r->nblocks);
        if (r->done < s->ncomputed || r->done > s->ntokens)
            MFAIL("a group's computed tokens outside [computed, committed]", r->done);
        if (m->kind == KVB_G_STATE ? r->room < blocks_for(m, s->ntokens) : r->room != 0)
            MFAIL("a state group's room short of its tokens (or room outside one)", r->room);
        if (r->lo < 0 || r->lo > r->nblocks ||
            (r->lo && m->kind != KVB_G_WINDOW && m->kind != KVB_G_CHUNK))
            MFAIL("released blocks outside a window or chunk group's table", r->lo);
        if (r->lo && blk_of(m, tbl_needed_from(m, r->done, s->ntokens, INT64_MAX)) < r->lo)
            MFAIL("a block the next query reads was released", r->lo);
        for (int32_t j = 0; j < r->lo; j++)
            if (r->blocks[j] != KVB_NULL_BLOCK) MFAIL("released entry is not the null block", j);
        for (int32_t j = r->lo; j < r->nblocks; j++) {
            int32_t b = r->blocks[j];
            if (b <= 0 || b >= sp->num_blocks) MFAIL("table holds an out-of-range block", b);
            rf[b]++;
        }
        for (int32_t j = r->lo; m->caching && !s->swapped && j < s->nhashed; j++) {
            int32_t b = r->blocks[j]; /* a cached full block holds this very content */
            kvb_hash_t h = gkey(m, s, j);
            if ((p->flags[b] & KVB_F_CACHED) &&
                (p->hash[b].lo != h.lo || p->hash[b].hi != h.hi || p->gid[b] != m->gidx))
                MFAIL("cached full block registered under another hash or group", b);
        }
        /* blocks past the write block are private */
        for (int64_t j = blk_of(m, s->ntokens) + 1; m->kind != KVB_G_STATE && j < r->nblocks; j++)
            if (s->swapped ? sp->ref_count[r->blocks[j]] != 1 : users(m, r->blocks[j]) != 1)
                MFAIL("reserved block is shared", r->blocks[j]);
        /* no prefix hit can read an unwritten slot: a cached block is flagged written (pool
         * check), and a block is flagged written only once computed; a sequence's computed
         * full blocks are all flagged (a copy destination once its pending copy runs) */
        for (int64_t j = r->lo; !s->swapped && m->kind != KVB_G_STATE &&
                                j < blk_of(m, r->done); j++) {
            int32_t b = r->blocks[j];
            if (!(p->flags[b] & (KVB_F_WRITTEN | KVB_F_COPY_DST)))
                MFAIL("computed full block not flagged written", b);
        }
    }
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
    return KVB_OK;
}
