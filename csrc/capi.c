/* capi.c -- libkvblocks' public API (include/kvblocks.h) over the core's internal functions.
 *
 * The pool handle is the core's own struct (kvb_pool_t), heap-allocated here; the pool calls
 * whose internal signature is fit for the public API (allocate, free, incref, reset_cache,
 * check) are exported as they are, the rest are wrappers below. The manager handle is a
 * struct of this file: its device and host pools, one core manager per KV cache group
 * (driven through manager.c's kvb_grp_* as the Cython layer drives them) and its last error.
 *
 * What the Python layer checks before calling into C (a live sequence before reading its
 * record, a host pool before a swap, the sizes of output buffers, the drain order of the
 * copy lists) is checked here too, first, so that every call stays all-or-nothing. Errors
 * detail in the handle (kvb_manager_t.err_*, the pool's err_*), cleared on entry.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "internal.h"

#define KVBLOCKS_STR2(x) #x
#define KVBLOCKS_STR(x) KVBLOCKS_STR2(x)

struct kvb_manager {
    kvb_pool_t pool;           /* device pool (owned) */
    kvb_pool_t host;           /* host pool (owned), valid iff has_host */
    int has_host;              /* a host pool was configured (num_host_blocks >= 2) */
    int32_t ng;                /* KV cache groups, >= 1 */
    kvb_mgr_t *g;              /* [ng] one core manager per group, over pool (and host) */
    kvb_mgr_t **gp;            /* [ng] &g[j], the form manager.c takes */
    int64_t err_a, err_b;      /* detail of the last error (meaning per code, kvblocks.h) */
    const char *err_what;      /* name of the failed check, or NULL */
    uint64_t epoch;            /* bumped by every call that may change tables (MUTATE): a plan
                                * taken at another epoch is stale */
};

struct kvb_plan {              /* a checked step (kvb_manager_plan_step) */
    kvb_manager_t *m;          /* its manager (the plan is deleted first) */
    uint64_t epoch;            /* m->epoch when it was planned or committed */
    int committed;             /* declared */
    int64_t B;                 /* sequences */
    int32_t *seqs, *qlens, *drafts; /* [B] copies of the batch (drafts NULL: none) */
    kvb_step_size_t *sizes;    /* [m->ng] per group */
};

/* ---- library ---------------------------------------------------------------------------- */
int kvb_version(int *major, int *minor, int *patch) {
    if (major) *major = KVBLOCKS_VERSION_MAJOR;
    if (minor) *minor = KVBLOCKS_VERSION_MINOR;
    if (patch) *patch = KVBLOCKS_VERSION_PATCH;
    return KVBLOCKS_ABI_VERSION;
}

const char *kvb_version_string(void) {
    return KVBLOCKS_STR(KVBLOCKS_VERSION_MAJOR) "." KVBLOCKS_STR(KVBLOCKS_VERSION_MINOR) "."
        KVBLOCKS_STR(KVBLOCKS_VERSION_PATCH);
}

const char *kvb_strerror(int code) {
    switch (code) {
    case KVB_OK: return "ok";
    case KVB_ENOMEM: return "out of memory";
    case KVB_EOUTOFBLOCKS: return "out of blocks";
    case KVB_EINVAL: return "invalid argument";
    case KVB_ERANGE: return "out of range";
    case KVB_ESTATE: return "not allowed in this state";
    case KVB_ECORRUPT: return "invariant violated";
    case KVB_EUNKNOWN: return "unknown sequence";
    case KVB_EDUP: return "given twice";
    case KVB_ESWAPPED: return "sequence swapped out";
    case KVB_EPENDING: return "copies pending";
    case KVB_EGAP: return "uncomputed tokens before the query";
    default: return "unknown error code";
    }
}

void kvb_free(void *data) { free(data); }

/* ---- pool ------------------------------------------------------------------------------- */
static int pool_fail(kvb_pool_t *p, int rc, int64_t a, int64_t b, const char *what) {
    p->err_a = a;
    p->err_b = b;
    p->err_what = what;
    return rc;
}

int kvb_pool_new(int32_t num_blocks, int caching, int events, kvb_pool_t **out) {
    if (!out) return KVB_EINVAL;
    *out = NULL;
    if (num_blocks < 2 || num_blocks == INT32_MAX) return KVB_EINVAL;
    kvb_pool_t *p = calloc(1, sizeof *p);
    if (!p) return KVB_ENOMEM;
    int rc = kvb_pool_init(p, num_blocks, caching != 0);
    if (rc) {
        free(p);
        return rc;
    }
    p->record_events = events != 0;
    *out = p;
    return KVB_OK;
}

void kvb_pool_delete(kvb_pool_t *p) {
    if (!p) return;
    kvb_pool_destroy(p);
    free(p);
}

int64_t kvb_pool_lookup_and_pin(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n,
                                int32_t *out) {
    KVB_CLEAR_ERR(p);
    if (n < 0 || (n && (!hashes || !out))) return pool_fail(p, KVB_EINVAL, 0, n, "n, hashes, out");
    return kvb_pool_lookup_pin(p, hashes, n, out);
}

int64_t kvb_pool_lookup(kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n, int32_t *out) {
    KVB_CLEAR_ERR(p);
    if (n < 0 || (n && !hashes)) return pool_fail(p, KVB_EINVAL, 0, n, "n, hashes");
    return kvb_cache_match(p, hashes, n, out);
}

int kvb_pool_cache(kvb_pool_t *p, const int32_t *ids, const kvb_hash_t *hashes, int64_t n,
                   const kvb_hash_t *parent, const int32_t *tokens, int32_t block_size,
                   int64_t *stored) {
    KVB_CLEAR_ERR(p);
    if (n < 0 || (n && (!ids || !hashes))) return pool_fail(p, KVB_EINVAL, 0, n, "n, ids, hashes");
    if (tokens && block_size < 1) return pool_fail(p, KVB_EINVAL, 0, block_size, "block_size");
    int rc = kvb_cache_insert(p, ids, hashes, n, parent, tokens, tokens ? block_size : 0, stored);
    if (p->tier) kvb_tier_absorb(p->tier); /* the insertions' records, at the tier's layer */
    return rc;
}

int kvb_pool_counts(const kvb_pool_t *p, kvb_pool_counts_t *out) {
    if (!p || !out) return KVB_EINVAL;
    out->num_blocks = p->num_blocks;
    out->num_free = p->num_free;
    out->num_cached = p->num_cached;
    out->num_evictable = p->num_evictable;
    return KVB_OK;
}

int kvb_pool_stats(const kvb_pool_t *p, kvb_cache_stats_t *out) {
    if (!p || !out) return KVB_EINVAL;
    const kvb_stats_t *s = &p->stats;
    out->queries = s->queries;
    out->query_blocks = s->query_blocks;
    out->hit_blocks = s->hit_blocks;
    out->query_tokens = s->query_tokens;
    out->hit_tokens = s->hit_tokens;
    out->recompute_query_tokens = s->recompute_query_tokens;
    out->recompute_hit_tokens = s->recompute_hit_tokens;
    out->evictions = s->evictions;
    out->allocations = s->allocations;
    out->frees = s->frees;
    out->stored = s->stored;
    return KVB_OK;
}

int32_t kvb_pool_ref_count(const kvb_pool_t *p, int32_t id) {
    if (!p || id < 0 || id >= p->num_blocks) return KVB_ERANGE;
    return p->ref_count[id];
}

int kvb_pool_pending_events(kvb_pool_t *p, int64_t *n_events, int64_t *n_tokens) {
    if (!p) return KVB_EINVAL;
    if (n_events) *n_events = p->events.n;
    if (n_tokens) *n_tokens = p->events.ntok;
    return KVB_OK;
}

uint64_t kvb_pool_events_dropped(const kvb_pool_t *p) { return p ? p->events.dropped : 0; }

int kvb_pool_take_events(kvb_pool_t *p, kvb_event_t *out, int64_t cap, int32_t *tokens,
                         int64_t tok_cap, int64_t *n_events, int64_t *n_tokens) {
    KVB_CLEAR_ERR(p);
    const kvb_events_t *ev = &p->events;
    if (cap < 0 || tok_cap < 0 || (cap && !out) || (tok_cap && !tokens))
        return pool_fail(p, KVB_EINVAL, cap, tok_cap, "cap, tok_cap");
    if (cap < ev->n || tok_cap < ev->ntok)
        return pool_fail(p, KVB_ERANGE, ev->n, ev->ntok, "event buffers too small");
    /* a stored block's tokens run up to the next recorded block's tokens (appended in order) */
    int64_t end = ev->ntok;
    for (int64_t i = ev->n - 1; i >= 0; i--) {
        kvb_event_t *e = &out[i];
        memset(e, 0, sizeof *e);
        e->kind = ev->kind[i];
        e->block = ev->block[i];
        e->hash = ev->hash[i];
        e->parent = ev->parent[i];
        e->group = ev->group[i];
        e->tag = ev->tag[i];
        e->tok_off = ev->tok_off[i];
        e->ntok = 0;
        if (e->tok_off >= 0) {
            e->ntok = end - e->tok_off;
            end = e->tok_off;
        }
    }
    kvb_copy(tokens, ev->tokens, (size_t)ev->ntok * sizeof *tokens);
    if (n_events) *n_events = ev->n;
    if (n_tokens) *n_tokens = ev->ntok;
    kvb_events_clear(&p->events);
    return KVB_OK;
}

int kvb_pool_take_events_wire(kvb_pool_t *p, double ts, int fmt, uint8_t **data, size_t *len) {
    KVB_CLEAR_ERR(p);
    if (!data || !len || (fmt != KVB_WIRE_MAP && fmt != KVB_WIRE_ARRAY))
        return pool_fail(p, KVB_EINVAL, 0, fmt, "fmt, data, len");
    *data = NULL;
    *len = 0;
    static const kvb_wire_tag_t no_tag; /* tag 0: no adapter, no salt (the only one here) */
    kvb_wire_group_t *groups = calloc(256, sizeof *groups); /* kind omitted */
    if (!groups) return KVB_ENOMEM;
    kvb_wire_opts_t w;
    memset(&w, 0, sizeof w);
    w.fmt = fmt;
    w.ts = ts;
    w.has_dp = 1;
    w.tags = &no_tag;
    w.ntags = 1;
    w.groups = groups;
    w.ngroups = 256;
    kvb_buf_t buf;
    memset(&buf, 0, sizeof buf);
    int64_t bad = -1;
    int rc = kvb_events_encode(&p->events, &w, &buf, &bad);
    free(groups);
    if (rc) {
        kvb_buf_free(&buf);
        return pool_fail(p, rc, bad, 0, rc == KVB_EINVAL ? "a stored block without tokens" : NULL);
    }
    *data = buf.data;
    *len = buf.len;
    kvb_events_clear(&p->events);
    return KVB_OK;
}

const char *kvb_pool_last_error(const kvb_pool_t *p, int64_t *a, int64_t *b) {
    if (a) *a = p ? p->err_a : 0;
    if (b) *b = p ? p->err_b : 0;
    return p ? p->err_what : NULL;
}

/* ---- manager ---------------------------------------------------------------------------- */
/* The result of a call: its detail copied from group `from` (0: manager.c reports there). */
static int fin(kvb_manager_t *m, int rc, int32_t from) {
    if (rc) {
        m->err_a = m->gp[from]->err_a;
        m->err_b = m->gp[from]->err_b;
        m->err_what = m->gp[from]->err_what;
    }
    return rc;
}

static int fail(kvb_manager_t *m, int rc, int64_t a, int64_t b, const char *what) {
    m->err_a = a;
    m->err_b = b;
    m->err_what = what;
    return rc;
}

#define ENTER(m) ((m)->err_a = 0, (m)->err_b = 0, (m)->err_what = NULL)
/* a call that may change tables: every plan taken before it is stale */
#define MUTATE(m) (ENTER(m), (m)->epoch++)

/* the sequence record of a live slot, or NULL */
static const kvb_seq_t *seq_of(const kvb_manager_t *m, int32_t slot) {
    return live_seq(&m->g[0], slot);
}

void kvb_manager_config_init(kvb_manager_config_t *c) {
    if (!c) return;
    memset(c, 0, sizeof *c);
    c->size = sizeof *c;
    c->num_blocks = 1024;
    c->block_size = 16;
    c->prefix_caching = 1;
    c->hash_mode = KVB_HASH_MODE_SIPHASH;
    c->num_groups = 1;
}

/* a secret SipHash key when none is given (multi-tenant prefix caches: a block's hash must
 * not be predictable); without /dev/urandom, bits of the clock and of addresses */
static void random_key(uint8_t key[16]) {
    FILE *f = fopen("/dev/urandom", "rb");
    size_t got = f ? fread(key, 1, 16, f) : 0;
    if (f) fclose(f);
    if (got == 16) return;
    uint64_t a = (uint64_t)(uintptr_t)&got ^ (uint64_t)(uintptr_t)key;
    uint64_t b = (uint64_t)clock() * 0x9e3779b97f4a7c15ull ^ (uint64_t)time(NULL);
    memcpy(key, &a, 8);
    memcpy(key + 8, &b, 8);
}

/* The config of ABI version 1; a later, larger config is read as far as the caller's size
 * goes, the rest keeping its defaults (kvb_manager_config_init). */
#define KVB_CONFIG_V1_SIZE sizeof(kvb_manager_config_t)

int kvb_manager_new(const kvb_manager_config_t *given, kvb_manager_t **out) {
    if (!out) return KVB_EINVAL;
    *out = NULL;
    if (!given || given->size < KVB_CONFIG_V1_SIZE) return KVB_EINVAL;
    kvb_manager_config_t cfg;
    kvb_manager_config_init(&cfg);
    memcpy(&cfg, given, given->size < sizeof cfg ? given->size : sizeof cfg);
    const kvb_manager_config_t *c = &cfg;
    if (c->num_blocks < 2 || c->num_blocks == INT32_MAX || c->block_size < 1 ||
        c->num_host_blocks < 0 || c->num_host_blocks == 1 || c->num_host_blocks == INT32_MAX ||
        c->hash_mode < 0 || c->hash_mode >= KVB_HASH_NMODES || c->num_groups < 1 ||
        c->num_groups > 255 || (c->num_groups > 1 && !c->groups) ||
        (c->hash_seed_len && !c->hash_seed))
        return KVB_EINVAL;
    int tier = c->host_prefix_cache != 0;
    if (c->host_write_through && !tier) return KVB_EINVAL;
    if (tier && (!c->num_host_blocks || !c->prefix_caching)) return KVB_EINVAL;
    for (int32_t j = 0; c->groups && j < c->num_groups; j++) {
        int32_t k = c->groups[j].kind;
        if (k < KVB_GROUP_FULL || k > KVB_GROUP_STATE) return KVB_EINVAL;
        if (k != KVB_GROUP_FULL && (c->groups[j].span < 1 || c->groups[j].span > INT32_MAX))
            return KVB_EINVAL;
    }

    kvb_manager_t *m = calloc(1, sizeof *m);
    if (!m) return KVB_ENOMEM;
    m->ng = c->num_groups;
    m->g = calloc((size_t)m->ng, sizeof *m->g);
    m->gp = calloc((size_t)m->ng, sizeof *m->gp);
    int rc = KVB_ENOMEM;
    int pool_ok = 0, host_ok = 0;
    int32_t inited = 0;
    if (!m->g || !m->gp) goto fail;
    if ((rc = kvb_pool_init(&m->pool, c->num_blocks, c->prefix_caching != 0))) goto fail;
    pool_ok = 1;
    m->pool.record_events = c->kv_events != 0;
    if (c->num_host_blocks) {
        if ((rc = kvb_pool_init(&m->host, c->num_host_blocks, tier))) goto fail;
        host_ok = 1;
        m->has_host = 1;
        m->host.record_events = c->kv_events != 0 && tier;
    }
    uint8_t key[16];
    if (c->has_hash_key) memcpy(key, c->hash_key, 16);
    else random_key(key);
    uint8_t none_hash[32] = {0};
    if (c->hash_mode == KVB_HASH_MODE_VLLM_SHA256_CBOR ||
        c->hash_mode == KVB_HASH_MODE_VLLM_SHA256_CBOR_V030) {
        static const char dflt[] = "vllm-none-hash"; /* vLLM >= 0.29's default seed */
        if (c->hash_seed)
            kvb_vllm_none_hash(c->hash_seed, c->hash_seed_len, none_hash);
        else
            kvb_vllm_none_hash((const uint8_t *)dflt, sizeof dflt - 1, none_hash);
    }
    for (int32_t j = 0; j < m->ng; j++) {
        if ((rc = kvb_mgr_init(&m->g[j], &m->pool, m->has_host ? &m->host : NULL,
                               c->block_size, key)))
            goto fail;
        inited = j + 1;
        m->gp[j] = &m->g[j];
        int32_t kind = c->groups ? c->groups[j].kind : KVB_GROUP_FULL;
        int64_t span = c->groups ? c->groups[j].span : 0;
        if ((rc = kvb_mgr_set_kind(&m->g[j], kind, span, (uint8_t)j))) goto fail;
    }
    if ((rc = kvb_grp_set_hash(m->gp, m->ng, c->hash_mode, none_hash))) goto fail;
    if (tier && (rc = kvb_mgr_host_tier(&m->g[0], c->host_write_through != 0))) goto fail;
    *out = m;
    return KVB_OK;
fail:
    for (int32_t j = 0; j < inited; j++) kvb_mgr_destroy(&m->g[j]);
    if (host_ok) kvb_pool_destroy(&m->host);
    if (pool_ok) kvb_pool_destroy(&m->pool);
    free(m->gp);
    free(m->g);
    free(m);
    return rc;
}

void kvb_manager_delete(kvb_manager_t *m) {
    if (!m) return;
    for (int32_t j = 0; j < m->ng; j++) kvb_mgr_destroy(&m->g[j]); /* group 0 frees the tier */
    if (m->has_host) kvb_pool_destroy(&m->host);
    kvb_pool_destroy(&m->pool);
    free(m->gp);
    free(m->g);
    free(m);
}

kvb_pool_t *kvb_manager_pool(kvb_manager_t *m) { return m ? &m->pool : NULL; }
kvb_pool_t *kvb_manager_host_pool(kvb_manager_t *m) {
    return m && m->has_host ? &m->host : NULL;
}
int32_t kvb_manager_block_size(const kvb_manager_t *m) { return m->g[0].block_size; }
int32_t kvb_manager_num_groups(const kvb_manager_t *m) { return m->ng; }
int32_t kvb_manager_num_seqs(const kvb_manager_t *m) { return m->g[0].nseqs; }

int kvb_manager_add(kvb_manager_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                    size_t salt_len, int recompute, int32_t *seq_out, int64_t *cached_out) {
    MUTATE(m);
    if (n < 0 || (n && !tokens) || !seq_out || (salt_len && !salt))
        return fail(m, KVB_EINVAL, 0, n, "n, tokens, seq_out, salt");
    int64_t cached = 0;
    int rc = kvb_grp_add(m->gp, m->ng, tokens, n, salt, salt_len, recompute != 0, 0, seq_out,
                         &cached);
    if (!rc && cached_out) *cached_out = cached;
    return fin(m, rc, 0);
}

int kvb_manager_probe(kvb_manager_t *m, const int32_t *tokens, int64_t n, const uint8_t *salt,
                      size_t salt_len, int64_t *cached_out, int64_t *need_out) {
    ENTER(m);
    if (n < 0 || (n && !tokens) || (salt_len && !salt))
        return fail(m, KVB_EINVAL, 0, n, "n, tokens, salt");
    int64_t cached = 0, need = 0;
    int rc = kvb_grp_probe(m->gp, m->ng, tokens, n, salt, salt_len, &cached, &need);
    if (!rc) {
        if (cached_out) *cached_out = cached;
        if (need_out) *need_out = need;
    }
    return fin(m, rc, 0);
}

int kvb_manager_append(kvb_manager_t *m, int32_t seq, const int32_t *tokens, int64_t n,
                       int computed) {
    MUTATE(m);
    if (n < 0 || (n && !tokens)) return fail(m, KVB_EINVAL, 0, n, "n, tokens");
    return fin(m, kvb_grp_append(m->gp, m->ng, seq, tokens, n, computed != 0), 0);
}

int kvb_manager_append_batch(kvb_manager_t *m, const int32_t *seqs, const int32_t *tokens,
                             int64_t n) {
    MUTATE(m);
    if (n < 0 || (n && (!seqs || !tokens))) return fail(m, KVB_EINVAL, 0, n, "n, seqs, tokens");
    return fin(m, kvb_grp_append_batch(m->gp, m->ng, seqs, tokens, n), 0);
}

int kvb_manager_reserve(kvb_manager_t *m, int32_t seq, int64_t n) {
    MUTATE(m);
    return fin(m, kvb_grp_reserve(m->gp, m->ng, seq, n), 0);
}

int kvb_manager_truncate(kvb_manager_t *m, int32_t seq, int64_t ntokens) {
    MUTATE(m);
    return fin(m, kvb_grp_truncate(m->gp, m->ng, seq, ntokens), 0);
}

int kvb_manager_fork(kvb_manager_t *m, int32_t parent, int32_t *child_out) {
    MUTATE(m);
    if (!child_out) return fail(m, KVB_EINVAL, 0, 0, "child_out");
    return fin(m, kvb_grp_fork(m->gp, m->ng, parent, child_out), 0);
}

int kvb_manager_free(kvb_manager_t *m, int32_t seq) {
    MUTATE(m);
    return fin(m, kvb_grp_free(m->gp, m->ng, seq), 0);
}

int kvb_manager_blocks_needed(kvb_manager_t *m, int32_t seq, int64_t n, int64_t *need_out) {
    ENTER(m);
    if (!need_out || n < 0) return fail(m, KVB_EINVAL, 0, n, "n, need_out");
    if (!seq_of(m, seq)) return fail(m, KVB_EUNKNOWN, 0, seq, NULL);
    int64_t k = kvb_grp_blocks_needed(m->gp, m->ng, seq, n);
    if (k < 0) return fin(m, (int)k, 0);
    *need_out = k;
    return KVB_OK;
}

int kvb_manager_batch_need(kvb_manager_t *m, const int32_t *seqs, int64_t count, int64_t n,
                           int64_t *need_out) {
    ENTER(m);
    if (!need_out || count < 0 || n < 0 || (count && !seqs))
        return fail(m, KVB_EINVAL, 0, count, "count, n, seqs, need_out");
    return fin(m, kvb_grp_batch_need(m->gp, m->ng, seqs, count, n, need_out), 0);
}

int64_t kvb_manager_swap_pairs_max(const kvb_manager_t *m, int32_t seq) {
    if (!seq_of(m, seq)) return KVB_EUNKNOWN;
    return kvb_grp_held(m->gp, m->ng, seq);
}

int kvb_manager_is_swapped(const kvb_manager_t *m, int32_t seq) {
    const kvb_seq_t *s = seq_of(m, seq);
    return s ? s->swapped != 0 : KVB_EUNKNOWN;
}

static int swap(kvb_manager_t *m, int32_t seq, int64_t *pairs, int64_t cap, int64_t *npairs,
                int in) {
    MUTATE(m);
    if (!npairs || cap < 0 || (cap && !pairs)) return fail(m, KVB_EINVAL, 0, cap, "cap, npairs");
    if (!m->has_host) return fail(m, KVB_ESTATE, 0, 0, "no host pool (num_host_blocks 0)");
    const kvb_seq_t *s = seq_of(m, seq);
    if (!s) return fail(m, KVB_EUNKNOWN, 0, seq, NULL);
    if (in && !s->swapped) return fail(m, KVB_ESTATE, 0, seq, "not swapped out");
    int64_t need = kvb_manager_swap_pairs_max(m, seq);
    if (cap < need) return fail(m, KVB_ERANGE, need, cap, "pair buffer too small");
    int64_t k = 0;
    int64_t one = 0;
    int rc = in ? kvb_grp_swap_in(m->gp, m->ng, seq, need ? pairs : &one, &k)
                : kvb_grp_swap_out(m->gp, m->ng, seq, need ? pairs : &one, &k);
    if (!rc) *npairs = k;
    return fin(m, rc, 0);
}

int kvb_manager_swap_out(kvb_manager_t *m, int32_t seq, int64_t *pairs, int64_t cap,
                         int64_t *npairs) {
    return swap(m, seq, pairs, cap, npairs, 0);
}

int kvb_manager_swap_in(kvb_manager_t *m, int32_t seq, int64_t *pairs, int64_t cap,
                        int64_t *npairs) {
    return swap(m, seq, pairs, cap, npairs, 1);
}

int64_t kvb_manager_num_tokens(const kvb_manager_t *m, int32_t seq) {
    const kvb_seq_t *s = seq_of(m, seq);
    return s ? s->ntokens : KVB_EUNKNOWN;
}

int64_t kvb_manager_num_computed(const kvb_manager_t *m, int32_t seq) {
    return seq_of(m, seq) ? kvb_grp_num_computed(m->gp, m->ng, seq) : KVB_EUNKNOWN;
}

int kvb_manager_block_table(const kvb_manager_t *m, int32_t group, int32_t seq, int32_t *out,
                            int64_t cap, int64_t *n) {
    if (!n || cap < 0 || (cap && !out) || group < 0 || group >= m->ng) return KVB_EINVAL;
    if (!seq_of(m, seq)) return KVB_EUNKNOWN;
    const kvb_row_t *r = kvb_grp_row(m->gp, group, seq);
    if (cap < r->nblocks) return KVB_ERANGE;
    for (int32_t i = 0; i < r->nblocks; i++) out[i] = i < r->lo ? KVB_NULL_BLOCK : r->blocks[i];
    *n = r->nblocks;
    return KVB_OK;
}

int64_t kvb_manager_pending_copies(kvb_manager_t *m) { return kvb_grp_num_copies(m->gp, m->ng); }

/* A step's one check (all groups: group < 0), the copies pending refusing it; with sizes
 * (one per group checked), the step is sized in the same pass (kvb_step_check). */
static int check_step(kvb_manager_t *m, const int32_t *seqs, const int32_t *qlens,
                      const int32_t *drafts, int64_t B, int32_t group, kvb_step_size_t *sizes) {
    if (B < 0 || (B && (!seqs || !qlens))) return fail(m, KVB_EINVAL, 0, B, "B, seqs, qlens");
    int64_t nc = kvb_manager_pending_copies(m);
    if (m->ng > 1 && nc) return fail(m, KVB_EPENDING, nc, 0, NULL);
    if (!sizes) return fin(m, kvb_grp_schedule(m->gp, m->ng, seqs, qlens, drafts, B, 0), 0);
    if (group < 0) return fin(m, kvb_step_check(m->gp, m->ng, seqs, qlens, drafts, B, sizes), 0);
    return fin(m, kvb_step_check(&m->gp[group], 1, seqs, qlens, drafts, B, sizes), group);
}

int kvb_manager_schedule(kvb_manager_t *m, const int32_t *seqs, const int32_t *qlens,
                         const int32_t *drafts, int64_t B) {
    MUTATE(m);
    int rc = check_step(m, seqs, qlens, drafts, B, -1, NULL);
    if (rc) return rc;
    kvb_step_commit(m->gp, m->ng, seqs, qlens, drafts, B);
    return KVB_OK;
}

/* Scratch targets for buffers a step of no tokens or no blocks may leave NULL. */
typedef struct { int32_t i32; int64_t i64; } zeros_t;

/* out's buffers checked and viewed as the core's kvb_meta_t (B sequences) */
static int meta_view(kvb_manager_t *m, int64_t B, const kvb_metadata_t *out, kvb_meta_t *meta,
                     zeros_t *z) {
    if (B && (!out->seq_lens || !out->qo_indptr || !out->kv_indptr || !out->kv_last_page_len))
        return fail(m, KVB_EINVAL, 0, B, "out's [B] buffers");
    if (out->cap_tokens < 0 || out->cap_indices < 0 || out->max_blocks < 0 ||
        (out->cap_tokens && !out->slot_mapping) || (out->cap_indices && !out->kv_indices) ||
        (out->max_blocks && !out->block_tables))
        return fail(m, KVB_EINVAL, 0, 0, "out's capacities");
    memset(meta, 0, sizeof *meta);
    meta->slot_mapping = out->slot_mapping ? out->slot_mapping : &z->i64;
    meta->block_tables = out->max_blocks ? out->block_tables : NULL;
    meta->seq_lens = out->seq_lens;
    meta->qo_indptr = out->qo_indptr ? out->qo_indptr : &z->i32;
    meta->kv_indptr = out->kv_indptr ? out->kv_indptr : &z->i32;
    meta->kv_indices = out->kv_indices ? out->kv_indices : &z->i32;
    meta->kv_last_page_len = out->kv_last_page_len;
    meta->cap_tokens = out->cap_tokens;
    meta->cap_indices = out->cap_indices;
    meta->max_blocks = out->max_blocks;
    return KVB_OK;
}

/* out's buffers checked and viewed as the core's kvb_rows_t */
static int rows_view(kvb_manager_t *m, int32_t group, const kvb_step_rows_t *out,
                     kvb_rows_t *r) {
    if (m->g[group].kind == KVB_G_STATE)
        return fail(m, KVB_EINVAL, 0, group, "a state group has no per-token rows");
    if (!out->read_offsets || !out->write_offsets || out->cap_read < 0 || out->cap_write < 0 ||
        out->max_blocks < 0 || (out->cap_read && !out->read_index) ||
        (out->cap_write && !out->write_index) || (out->max_blocks && !out->block_tables))
        return fail(m, KVB_EINVAL, 0, 0, "out's buffers and capacities");
    memset(r, 0, sizeof *r);
    r->read_index = out->cap_read ? out->read_index : NULL;
    r->write_index = out->cap_write ? out->write_index : NULL;
    r->read_offsets = out->read_offsets;
    r->write_offsets = out->write_offsets;
    r->block_tables = out->max_blocks ? out->block_tables : NULL;
    r->cap_read = out->cap_read;
    r->cap_write = out->cap_write;
    r->max_blocks = out->max_blocks;
    r->stride = out->stride;
    r->offset = out->offset;
    return KVB_OK;
}

int kvb_manager_metadata(kvb_manager_t *m, int32_t group, const int32_t *seqs,
                         const int32_t *qlens, const int32_t *drafts, int64_t B,
                         kvb_metadata_t *out) {
    MUTATE(m);
    if (!out || out->size < sizeof *out || group < 0 || group >= m->ng)
        return fail(m, KVB_EINVAL, 0, group, "out, group");
    kvb_meta_t meta;
    zeros_t z = {0, 0};
    kvb_step_size_t size;
    int rc = meta_view(m, B, out, &meta, &z);
    if (!rc) rc = check_step(m, seqs, qlens, drafts, B, group, &size);
    if (!rc) rc = fin(m, kvb_meta_fits(m->gp[group], &size, &meta), group);
    if (rc) return rc;
    kvb_step_release(&m->gp[group], 1, seqs, qlens, B); /* before the tables are written */
    kvb_meta_write(m->gp[group], seqs, qlens, drafts, B, &meta);
    out->n_tokens = meta.n_tokens;
    out->n_indices = meta.n_indices;
    kvb_step_commit(&m->gp[group], 1, seqs, qlens, drafts, B);
    return KVB_OK;
}

int kvb_manager_rows(kvb_manager_t *m, int32_t group, const int32_t *seqs,
                     const int32_t *qlens, const int32_t *drafts, int64_t B,
                     kvb_step_rows_t *out) {
    MUTATE(m);
    if (!out || out->size < sizeof *out || group < 0 || group >= m->ng)
        return fail(m, KVB_EINVAL, 0, group, "out, group");
    kvb_rows_t r;
    kvb_step_size_t size;
    int rc = rows_view(m, group, out, &r);
    if (!rc) rc = check_step(m, seqs, qlens, drafts, B, group, &size);
    if (!rc) rc = fin(m, kvb_rows_fits(m->gp[group], &size, &r), group);
    if (rc) return rc;
    kvb_step_release(&m->gp[group], 1, seqs, qlens, B); /* before the rows are written */
    kvb_rows_write(m->gp[group], seqs, qlens, drafts, B, &r);
    out->n_read = r.n_read;
    out->n_write = r.n_write;
    kvb_step_commit(&m->gp[group], 1, seqs, qlens, drafts, B);
    return KVB_OK;
}

/* ---- a step planned once ---------------------------------------------------------------- */
void kvb_plan_delete(kvb_plan_t *p) {
    if (!p) return;
    free(p->seqs);
    free(p->qlens);
    free(p->drafts);
    free(p->sizes);
    free(p);
}

int kvb_manager_plan_step(kvb_manager_t *m, const int32_t *seqs, const int32_t *qlens,
                          const int32_t *drafts, int64_t B, int commit, kvb_plan_t **out) {
    if (!m) return KVB_EINVAL;
    MUTATE(m);
    if (!out) return fail(m, KVB_EINVAL, 0, 0, "out");
    *out = NULL;
    if (B < 0 || B > INT32_MAX) return fail(m, KVB_EINVAL, 0, B, "B");
    kvb_plan_t *p = calloc(1, sizeof *p);
    size_t nb = (size_t)(B ? B : 1) * sizeof(int32_t);
    if (p) {
        p->seqs = malloc(nb);
        p->qlens = malloc(nb);
        p->drafts = drafts ? malloc(nb) : NULL;
        p->sizes = calloc((size_t)m->ng, sizeof *p->sizes);
    }
    if (!p || !p->seqs || !p->qlens || (drafts && !p->drafts) || !p->sizes) {
        kvb_plan_delete(p);
        return fail(m, KVB_ENOMEM, 0, 0, NULL);
    }
    int rc = check_step(m, seqs, qlens, drafts, B, -1, p->sizes); /* once, every group */
    if (rc) { kvb_plan_delete(p); return rc; }
    kvb_copy(p->seqs, seqs, (size_t)B * sizeof(int32_t));
    kvb_copy(p->qlens, qlens, (size_t)B * sizeof(int32_t));
    if (drafts) kvb_copy(p->drafts, drafts, (size_t)B * sizeof(int32_t));
    kvb_step_release(m->gp, m->ng, p->seqs, p->qlens, B);
    if (commit) kvb_step_commit(m->gp, m->ng, p->seqs, p->qlens, p->drafts, B);
    p->m = m;
    p->B = B;
    p->committed = commit != 0;
    p->epoch = m->epoch;
    *out = p;
    return KVB_OK;
}

/* a writer or commit of p, for group (-1: no group) */
static int plan_enter(const kvb_plan_t *p, int32_t group) {
    kvb_manager_t *m = p->m;
    ENTER(m);
    if (p->epoch != m->epoch)
        return fail(m, KVB_ESTATE, 0, 0, "the manager changed since the plan (plan again)");
    if (group < -1 || group >= m->ng) return fail(m, KVB_EINVAL, 0, group, "group");
    return KVB_OK;
}

int kvb_plan_stale(const kvb_plan_t *p) { return !p || p->epoch != p->m->epoch; }

int kvb_plan_size(const kvb_plan_t *p, int32_t group, kvb_plan_size_t *out) {
    if (!p || !out) return KVB_EINVAL;
    if (group < 0 || group >= p->m->ng) return KVB_EINVAL;
    out->tokens = p->sizes[group].tokens;
    out->blocks = p->sizes[group].blocks;
    out->max_blocks = p->sizes[group].max_blocks;
    out->context = p->sizes[group].context;
    return KVB_OK;
}

int kvb_plan_metadata(kvb_plan_t *p, int32_t group, kvb_metadata_t *out) {
    if (!p) return KVB_EINVAL;
    kvb_manager_t *m = p->m;
    int rc = plan_enter(p, group);
    if (rc) return rc;
    if (!out || out->size < sizeof *out || group < 0)
        return fail(m, KVB_EINVAL, 0, group, "out, group");
    kvb_meta_t meta;
    zeros_t z = {0, 0};
    rc = meta_view(m, p->B, out, &meta, &z);
    if (rc) return rc;
    rc = kvb_meta_fits(m->gp[group], &p->sizes[group], &meta);
    if (rc) return fin(m, rc, group);
    kvb_meta_write(m->gp[group], p->seqs, p->qlens, p->drafts, p->B, &meta);
    out->n_tokens = meta.n_tokens;
    out->n_indices = meta.n_indices;
    return KVB_OK;
}

int kvb_plan_rows(kvb_plan_t *p, int32_t group, kvb_step_rows_t *out) {
    if (!p) return KVB_EINVAL;
    kvb_manager_t *m = p->m;
    int rc = plan_enter(p, group);
    if (rc) return rc;
    if (!out || out->size < sizeof *out || group < 0)
        return fail(m, KVB_EINVAL, 0, group, "out, group");
    kvb_rows_t r;
    rc = rows_view(m, group, out, &r);
    if (rc) return rc;
    rc = kvb_rows_fits(m->gp[group], &p->sizes[group], &r);
    if (rc) return fin(m, rc, group);
    kvb_rows_write(m->gp[group], p->seqs, p->qlens, p->drafts, p->B, &r);
    out->n_read = r.n_read;
    out->n_write = r.n_write;
    return KVB_OK;
}

int kvb_plan_commit(kvb_plan_t *p) {
    if (!p) return KVB_EINVAL;
    kvb_manager_t *m = p->m;
    int rc = plan_enter(p, -1);
    if (rc) return rc;
    if (p->committed) return fail(m, KVB_ESTATE, 0, 0, "the plan was committed already");
    kvb_step_commit(m->gp, m->ng, p->seqs, p->qlens, p->drafts, p->B);
    p->committed = 1;
    p->epoch = ++m->epoch; /* declared: computed counts changed, tables did not */
    return KVB_OK;
}

int kvb_manager_block_hashes(const kvb_manager_t *m, const int32_t *tokens, int64_t n,
                             const uint8_t *salt, size_t salt_len, kvb_hash_t *out, int64_t cap,
                             int64_t *n_out) {
    if (!m || !n_out || n < 0 || cap < 0 || (n && !tokens) || (cap && !out) ||
        (salt_len && !salt))
        return KVB_EINVAL;
    const kvb_mgr_t *g = &m->g[0];
    int64_t nb = n / g->block_size;
    if (cap < nb) return KVB_ERANGE;
    kvb_hasher_t hs;
    int rc = kvb_hasher_init(&hs, g->hash_algo, g->key, g->none_hash, salt, salt_len);
    if (rc) return rc;
    if (nb) kvb_hash_blocks(&hs, NULL, 0, tokens, nb, g->block_size, out, NULL);
    *n_out = nb;
    return KVB_OK;
}

int kvb_manager_host_stats(kvb_manager_t *m, kvb_host_stats_t *out) {
    if (!m || !out) return KVB_EINVAL;
    memset(out, 0, sizeof *out);
    kvb_tier_t *t = m->pool.tier;
    if (!t) return KVB_OK;
    kvb_tier_flush(t); /* demotions recorded since the last flush are counted */
    out->hit_blocks = t->stats.hit_blocks;
    out->hit_tokens = t->stats.hit_tokens;
    out->recompute_hit_tokens = t->stats.recompute_hit_tokens;
    out->demotions = t->stats.demotions;
    out->offloads = t->stats.offloads;
    out->onloads = t->stats.onloads;
    out->dropped = t->stats.dropped;
    return KVB_OK;
}

/* the tier's pending offloads after placing the evictions since the last flush */
int64_t kvb_manager_pending_offloads(kvb_manager_t *m) {
    kvb_tier_t *t = m->pool.tier;
    if (!t) return 0;
    kvb_tier_flush(t);
    return t->noff;
}

int64_t kvb_manager_pending_onloads(kvb_manager_t *m) {
    return m->pool.tier ? m->pool.tier->non : 0;
}

static int pairs_args(kvb_manager_t *m, int64_t *out, int64_t cap, int64_t *n) {
    if (!n || cap < 0 || (cap && !out)) return fail(m, KVB_EINVAL, 0, cap, "cap, n");
    *n = 0;
    return KVB_OK;
}

int kvb_manager_take_copies(kvb_manager_t *m, int64_t *out, int64_t cap, int64_t *n) {
    MUTATE(m);
    int rc = pairs_args(m, out, cap, n);
    if (rc) return rc;
    int64_t none = 0; /* (out may be NULL when cap is 0) */
    return fin(m, kvb_grp_take_copies(m->gp, m->ng, out ? out : &none, cap, n), 0);
}

int kvb_manager_take_offloads(kvb_manager_t *m, int64_t *out, int64_t cap, int64_t *n) {
    ENTER(m);
    int rc = pairs_args(m, out, cap, n);
    if (rc) return rc;
    kvb_tier_t *t = m->pool.tier;
    if (!t) return KVB_OK;
    kvb_tier_flush(t);
    if (cap < t->noff) return fail(m, KVB_ERANGE, t->noff, cap, "pair buffer too small");
    int64_t one[2];
    *n = kvb_tier_take_offloads(t, t->noff ? out : one);
    return KVB_OK;
}

int kvb_manager_take_onloads(kvb_manager_t *m, int64_t *out, int64_t cap, int64_t *n) {
    ENTER(m);
    int rc = pairs_args(m, out, cap, n);
    if (rc) return rc;
    kvb_tier_t *t = m->pool.tier;
    if (!t) return KVB_OK;
    if (t->noff || m->pool.log->nev)
        return fail(m, KVB_EPENDING, t->noff + m->pool.log->nev, 0,
                    "offloads pending: take them first");
    if (cap < t->non) return fail(m, KVB_ERANGE, t->non, cap, "pair buffer too small");
    int64_t one[2], k = 0;
    rc = kvb_tier_take_onloads(t, t->non ? out : one, &k);
    if (rc) return fail(m, rc, t->noff, 0, "offloads pending: take them first");
    *n = k;
    return KVB_OK;
}

int kvb_manager_reset_cache(kvb_manager_t *m) {
    MUTATE(m);
    return fin(m, kvb_mgr_reset_cache(&m->g[0]), 0);
}

int kvb_manager_check(kvb_manager_t *m) {
    ENTER(m);
    return fin(m, kvb_grp_check(m->gp, m->ng), 0);
}

const char *kvb_manager_last_error(const kvb_manager_t *m, int64_t *a, int64_t *b) {
    if (a) *a = m ? m->err_a : 0;
    if (b) *b = m ? m->err_b : 0;
    return m ? m->err_what : NULL;
}
