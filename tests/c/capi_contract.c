/* capi_contract.c -- the promises of include/kvblocks.h, checked from C: hostile arguments get
 * their error code and change nothing (all-or-nothing), short output buffers are refused with
 * the capacity needed before anything is consumed, the detail of the last error is per handle
 * and cleared by the next call, and two managers run at once on two threads (no global
 * state). Run by tests/test_capi.py and, under ASan + UBSan, by .ci/capi. Exit 0: all held.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvblocks.h"

static int failures;

#define EXPECT(cond)                                                                       \
    do {                                                                                   \
        if (!(cond)) {                                                                     \
            fprintf(stderr, "%s:%d: expected %s\n", __FILE__, __LINE__, #cond);            \
            failures++;                                                                    \
        }                                                                                  \
    } while (0)

static kvb_manager_t *manager(int32_t nblocks, int32_t host) {
    kvb_manager_config_t c;
    kvb_manager_config_init(&c);
    c.num_blocks = nblocks;
    c.block_size = 4;
    c.num_host_blocks = host;
    c.kv_events = 1;
    c.has_hash_key = 1;
    memcpy(c.hash_key, "0123456789abcdef", 16);
    kvb_manager_t *m = NULL;
    if (kvb_manager_new(&c, &m)) {
        fprintf(stderr, "kvb_manager_new failed\n");
        exit(1);
    }
    return m;
}

static void library(void) {
    int major = -1;
    EXPECT(kvb_version(&major, NULL, NULL) == KVBLOCKS_ABI_VERSION);
    EXPECT(major == KVBLOCKS_VERSION_MAJOR);
    EXPECT(kvb_version_string() != NULL);
    for (int code = 1; code >= -12; code--) EXPECT(kvb_strerror(code) != NULL);
    EXPECT(strcmp(kvb_strerror(KVB_EOUTOFBLOCKS), "out of blocks") == 0);
}

static void configs(void) {
    kvb_manager_t *m = (kvb_manager_t *)&m; /* set to NULL on failure */
    kvb_manager_config_t c;
    EXPECT(kvb_manager_new(NULL, &m) == KVB_EINVAL && m == NULL);
    kvb_manager_config_init(&c);
    EXPECT(kvb_manager_new(&c, NULL) == KVB_EINVAL);
    c.size = 8; /* older than version 1 */
    EXPECT(kvb_manager_new(&c, &m) == KVB_EINVAL);
    kvb_manager_config_init(&c);
    c.num_blocks = 1;
    EXPECT(kvb_manager_new(&c, &m) == KVB_EINVAL);
    kvb_manager_config_init(&c);
    c.num_host_blocks = 1;
    EXPECT(kvb_manager_new(&c, &m) == KVB_EINVAL);
    kvb_manager_config_init(&c);
    c.host_prefix_cache = 1; /* without a host pool */
    EXPECT(kvb_manager_new(&c, &m) == KVB_EINVAL);
    kvb_group_spec_t g[2] = {{KVB_GROUP_FULL, 0}, {KVB_GROUP_WINDOW, 0}}; /* window 0 */
    kvb_manager_config_init(&c);
    c.num_groups = 2;
    c.groups = g;
    EXPECT(kvb_manager_new(&c, &m) == KVB_EINVAL);
    g[1].span = 8;
    EXPECT(kvb_manager_new(&c, &m) == KVB_OK && kvb_manager_num_groups(m) == 2);
    kvb_manager_delete(m);
    c.num_host_blocks = 8; /* the host tier and the 256-bit modes work with groups */
    c.host_prefix_cache = 1;
    c.hash_mode = KVB_HASH_MODE_VLLM_SHA256_CBOR;
    EXPECT(kvb_manager_new(&c, &m) == KVB_OK && kvb_manager_num_groups(m) == 2);
    kvb_manager_delete(m);
    c.prefix_caching = 0; /* but the tier still needs prefix caching */
    EXPECT(kvb_manager_new(&c, &m) == KVB_EINVAL && m == NULL);
    kvb_manager_delete(NULL);
    kvb_pool_delete(NULL);
}

static void manager_errors(void) {
    kvb_manager_t *m = manager(8, 0); /* 7 usable blocks of 4 tokens */
    const int32_t toks[40] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    int32_t s = -1, s2 = -1;
    int64_t a, b, cached = -1;
    kvb_pool_counts_t before, after;

    EXPECT(kvb_manager_add(m, toks, -1, NULL, 0, 0, &s, NULL) == KVB_EINVAL);
    EXPECT(kvb_manager_add(m, NULL, 3, NULL, 0, 0, &s, NULL) == KVB_EINVAL);
    EXPECT(kvb_manager_add(m, toks, 3, NULL, 4, 0, &s, NULL) == KVB_EINVAL); /* salt NULL */
    EXPECT(kvb_manager_num_seqs(m) == 0);

    kvb_pool_counts(kvb_manager_pool(m), &before);
    EXPECT(kvb_manager_add(m, toks, 40, NULL, 0, 0, &s, &cached) == KVB_EOUTOFBLOCKS);
    kvb_manager_last_error(m, &a, &b);
    EXPECT(a == 10 && b == 7); /* needed, free */
    kvb_pool_counts(kvb_manager_pool(m), &after);
    EXPECT(memcmp(&before, &after, sizeof before) == 0 && kvb_manager_num_seqs(m) == 0);

    EXPECT(kvb_manager_add(m, toks, 9, NULL, 0, 0, &s, &cached) == KVB_OK && cached == 0);
    kvb_manager_last_error(m, &a, &b);
    EXPECT(a == 0 && b == 0); /* cleared on entry */
    EXPECT(kvb_manager_append(m, s + 7, toks, 1, 0) == KVB_EUNKNOWN);
    EXPECT(kvb_manager_append(m, s, toks, -2, 0) == KVB_EINVAL);
    EXPECT(kvb_manager_append(m, s, toks, 1, 1) == KVB_ESTATE); /* no draft slots */
    EXPECT(kvb_manager_num_tokens(m, s) == 9);
    int32_t dup[2] = {s, s}, two[2] = {5, 6};
    EXPECT(kvb_manager_append_batch(m, dup, two, 2) != KVB_OK);
    EXPECT(kvb_manager_num_tokens(m, s) == 9);
    EXPECT(kvb_manager_swap_out(m, s, NULL, 0, &a) == KVB_ESTATE); /* no host pool */
    EXPECT(kvb_manager_fork(m, s, NULL) == KVB_EINVAL);

    /* metadata: a short slot mapping is refused, the step is not declared */
    int32_t q = 9, sl[1], qo[2], kvp[2], kvi[4], last[1];
    int64_t sm[4];
    kvb_metadata_t md;
    memset(&md, 0, sizeof md);
    md.size = sizeof md;
    md.slot_mapping = sm;
    md.cap_tokens = 4;
    md.seq_lens = sl;
    md.qo_indptr = qo;
    md.kv_indptr = kvp;
    md.kv_indices = kvi;
    md.cap_indices = 4;
    md.kv_last_page_len = last;
    EXPECT(kvb_manager_metadata(m, 0, &s, &q, NULL, 1, &md) != KVB_OK);
    EXPECT(kvb_manager_num_computed(m, s) == 0);
    EXPECT(kvb_manager_metadata(m, 1, &s, &q, NULL, 1, &md) == KVB_EINVAL); /* no group 1 */
    md.size = 8;
    EXPECT(kvb_manager_metadata(m, 0, &s, &q, NULL, 1, &md) == KVB_EINVAL);
    q = 10; /* more than its tokens */
    EXPECT(kvb_manager_schedule(m, &s, &q, NULL, 1) == KVB_EINVAL);
    q = 9;
    EXPECT(kvb_manager_schedule(m, &s, &q, NULL, 1) == KVB_OK);
    EXPECT(kvb_manager_num_computed(m, s) == 9);

    /* fork + a write into the shared last block: one copy pending; a short buffer refused */
    EXPECT(kvb_manager_fork(m, s, &s2) == KVB_OK);
    EXPECT(kvb_manager_append(m, s2, toks, 1, 0) == KVB_OK);
    EXPECT(kvb_manager_pending_copies(m) == 1);
    int64_t pairs[8], n = -1;
    EXPECT(kvb_manager_take_copies(m, pairs, 0, &n) == KVB_ERANGE);
    kvb_manager_last_error(m, &a, &b);
    EXPECT(a == 1 && b == 0);
    EXPECT(kvb_manager_pending_copies(m) == 1);
    EXPECT(kvb_manager_schedule(m, &s, &q, NULL, 1) == KVB_EPENDING); /* drain first */
    EXPECT(kvb_manager_take_copies(m, pairs, 4, &n) == KVB_OK && n == 1);
    EXPECT(kvb_manager_pending_copies(m) == 0);

    int32_t table[2];
    EXPECT(kvb_manager_block_table(m, 0, s, table, 2, &n) == KVB_ERANGE); /* 3 blocks */
    EXPECT(kvb_manager_block_table(m, 0, 99, table, 2, &n) == KVB_EUNKNOWN);
    EXPECT(kvb_manager_free(m, s2) == KVB_OK);
    EXPECT(kvb_manager_free(m, s2) == KVB_EUNKNOWN);
    EXPECT(kvb_manager_check(m) == KVB_OK);
    kvb_manager_delete(m);
}

static void swaps(void) {
    kvb_manager_t *m = manager(16, 16);
    const int32_t toks[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    int32_t s;
    int64_t pairs[2 * 8], n = -1, a, b;
    EXPECT(kvb_manager_add(m, toks, 9, NULL, 0, 0, &s, NULL) == KVB_OK);
    EXPECT(kvb_manager_swap_pairs_max(m, s) == 3);
    EXPECT(kvb_manager_swap_in(m, s, pairs, 8, &n) == KVB_ESTATE); /* not swapped out */
    EXPECT(kvb_manager_swap_out(m, s, pairs, 2, &n) == KVB_ERANGE);
    kvb_manager_last_error(m, &a, &b);
    EXPECT(a == 3 && b == 2);
    EXPECT(kvb_manager_is_swapped(m, s) == 0);
    EXPECT(kvb_manager_swap_out(m, s, pairs, 8, &n) == KVB_OK && n == 3);
    EXPECT(kvb_manager_is_swapped(m, s) == 1);
    int32_t one = 1;
    EXPECT(kvb_manager_append_batch(m, &s, &one, 1) == KVB_ESWAPPED);
    EXPECT(kvb_manager_swap_in(m, s, pairs, 8, &n) == KVB_OK && n == 3);
    EXPECT(kvb_manager_check(m) == KVB_OK);
    kvb_manager_delete(m);
}

static void pools(void) {
    kvb_pool_t *p = NULL;
    EXPECT(kvb_pool_new(1, 1, 0, &p) == KVB_EINVAL && p == NULL);
    EXPECT(kvb_pool_new(9, 1, 1, &p) == KVB_OK);
    int32_t ids[8], zero = 0;
    kvb_pool_counts_t c;
    EXPECT(kvb_pool_allocate(p, 9, ids) == KVB_EOUTOFBLOCKS);
    kvb_pool_counts(p, &c);
    EXPECT(c.num_free == 8);
    EXPECT(kvb_pool_allocate(p, 4, ids) == KVB_OK);
    EXPECT(kvb_pool_free(p, &zero, 1) == KVB_ERANGE); /* the null block */
    EXPECT(kvb_pool_ref_count(p, 0) == 0 && kvb_pool_ref_count(p, 9) == KVB_ERANGE);
    kvb_hash_t h[4] = {{1, 1}, {2, 2}, {3, 3}, {4, 4}};
    int32_t tokens[16] = {0};
    int64_t stored = -1;
    EXPECT(kvb_pool_cache(p, ids, h, 4, NULL, tokens, 4, &stored) == KVB_OK && stored == 4);
    EXPECT(kvb_pool_free(p, ids, 4) == KVB_OK);
    EXPECT(kvb_pool_free(p, ids, 1) != KVB_OK); /* already free */
    int32_t hit[4];
    EXPECT(kvb_pool_lookup(p, h, 4, NULL) == 4);
    EXPECT(kvb_pool_lookup_and_pin(p, h, -1, hit) == KVB_EINVAL);
    EXPECT(kvb_pool_lookup_and_pin(p, h, 3, hit) == 3 && kvb_pool_ref_count(p, hit[0]) == 1);
    EXPECT(kvb_pool_reset_cache(p) == KVB_ESTATE); /* cached blocks referenced */
    EXPECT(kvb_pool_free(p, hit, 3) == KVB_OK);

    int64_t ne = -1, nt = -1;
    kvb_event_t ev[8];
    int32_t et[32];
    EXPECT(kvb_pool_pending_events(p, &ne, &nt) == KVB_OK && ne == 4 && nt == 16);
    EXPECT(kvb_pool_take_events(p, ev, 3, et, 32, &ne, &nt) == KVB_ERANGE);
    kvb_pool_pending_events(p, &ne, NULL);
    EXPECT(ne == 4); /* nothing drained */
    uint8_t *wire = NULL;
    size_t len = 0;
    EXPECT(kvb_pool_take_events_wire(p, 1.5, 7, &wire, &len) == KVB_EINVAL);
    EXPECT(kvb_pool_take_events_wire(p, 1.5, 0, &wire, &len) == KVB_OK && wire && len > 8);
    kvb_free(wire);
    kvb_pool_pending_events(p, &ne, NULL);
    EXPECT(ne == 0);
    EXPECT(kvb_pool_reset_cache(p) == KVB_OK);
    EXPECT(kvb_pool_take_events(p, ev, 8, et, 32, &ne, &nt) == KVB_OK && ne == 1);
    EXPECT(ev[0].kind == KVB_EV_CLEARED);
    EXPECT(kvb_pool_check(p) == KVB_OK);
    kvb_pool_delete(p);
}

/* the hashes kvb_manager_block_hashes gives are those the manager's events carry; rows */
static void hashes_rows(void) {
    kvb_manager_t *m = manager(32, 0);
    const int32_t toks[10] = {5, 4, 3, 2, 1, 0, 9, 8, 7, 6};
    const uint8_t salt[3] = {'t', '4', '2'};
    int32_t s;
    EXPECT(kvb_manager_add(m, toks, 10, salt, 3, 0, &s, NULL) == KVB_OK);
    int32_t q = 10, ro[2], wo[2];
    int64_t ri[16], wi[16];
    kvb_step_rows_t r;
    memset(&r, 0, sizeof r);
    r.size = sizeof r;
    r.read_index = ri;
    r.write_index = wi;
    r.read_offsets = ro;
    r.write_offsets = wo;
    r.cap_read = 16;
    r.cap_write = 16;
    r.stride = 8; /* two blocks' rows apart */
    r.offset = 1;
    EXPECT(kvb_manager_rows(m, 0, &s, &q, NULL, 1, &r) == KVB_OK);
    EXPECT(r.n_write == 10 && r.n_read == 10 && wo[1] == 10);
    int32_t table[4];
    int64_t n;
    EXPECT(kvb_manager_block_table(m, 0, s, table, 4, &n) == KVB_OK && n == 3);
    EXPECT(wi[5] == (int64_t)table[1] * 8 + 1 + 1); /* token 5: block 1, offset 1 */
    EXPECT(kvb_manager_num_computed(m, s) == 10);   /* rows declared the step */
    kvb_hash_t h[4];
    EXPECT(kvb_manager_block_hashes(m, toks, 10, salt, 3, h, 1, &n) == KVB_ERANGE);
    EXPECT(kvb_manager_block_hashes(m, toks, 10, salt, 3, h, 4, &n) == KVB_OK && n == 2);
    kvb_event_t ev[8];
    int32_t et[32];
    int64_t ne, nt;
    EXPECT(kvb_pool_take_events(kvb_manager_pool(m), ev, 8, et, 32, &ne, &nt) == KVB_OK);
    EXPECT(ne == 2 && ev[0].kind == KVB_EV_STORED && ev[1].kind == KVB_EV_STORED);
    EXPECT(ne == 2 && ev[0].hash.lo == h[0].lo && ev[0].hash.hi == h[0].hi);
    EXPECT(ne == 2 && ev[1].hash.lo == h[1].lo && ev[1].parent.lo == h[0].lo);
    EXPECT(ne == 2 && ev[1].ntok == 4 && et[ev[1].tok_off] == 1);
    kvb_hash_t other[2];
    EXPECT(kvb_manager_block_hashes(m, toks, 10, NULL, 0, other, 2, &n) == KVB_OK);
    EXPECT(other[0].lo != h[0].lo); /* the salt keys the chain apart */
    kvb_host_stats_t hs;
    EXPECT(kvb_manager_host_stats(m, &hs) == KVB_OK && hs.onloads == 0);
    kvb_manager_delete(m);
}

/* a step planned once for two groups: sizes, writers equal to the per-group calls, staleness,
 * deferred commit, failures that change nothing */
static void plans(void) {
    kvb_group_spec_t gs[2] = {{KVB_GROUP_FULL, 0}, {KVB_GROUP_WINDOW, 6}};
    kvb_manager_t *mm[2];
    for (int k = 0; k < 2; k++) {
        kvb_manager_config_t c;
        kvb_manager_config_init(&c);
        c.num_blocks = 64;
        c.block_size = 4;
        c.num_groups = 2;
        c.groups = gs;
        c.has_hash_key = 1;
        memcpy(c.hash_key, "0123456789abcdef", 16);
        EXPECT(kvb_manager_new(&c, &mm[k]) == KVB_OK);
    }
    kvb_manager_t *a = mm[0], *b = mm[1]; /* a: the plan; b: kvb_manager_metadata per group */
    const int32_t toks[13] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13};
    int32_t s[2], q[2] = {13, 7}, t;
    for (int k = 0; k < 2; k++) {
        EXPECT(kvb_manager_add(mm[k], toks, 13, NULL, 0, 0, &s[0], NULL) == KVB_OK);
        EXPECT(kvb_manager_add(mm[k], toks + 6, 7, NULL, 0, 0, &s[1], NULL) == KVB_OK);
    }
    kvb_plan_t *p = NULL;
    int32_t twice[2] = {s[0], s[0]};
    EXPECT(kvb_manager_plan_step(a, twice, q, NULL, 2, 1, &p) == KVB_EDUP && p == NULL);
    EXPECT(kvb_manager_num_computed(a, s[0]) == 0); /* the failure changed nothing */
    EXPECT(kvb_manager_plan_step(a, s, q, NULL, 2, 0, &p) == KVB_OK && p);
    EXPECT(kvb_manager_num_computed(a, s[0]) == 0); /* not committed yet */
    kvb_plan_size_t z;
    EXPECT(kvb_plan_size(p, 0, &z) == KVB_OK && z.tokens == 20 && z.max_blocks == 4);
    EXPECT(kvb_plan_size(p, 2, &z) == KVB_EINVAL);
    for (int32_t g = 0; g < 2; g++) {
        int64_t sm[2][32];
        int32_t bt[2][16], sl[2][2], qo[2][3], kp[2][3], ki[2][16], last[2][2];
        kvb_metadata_t md[2];
        for (int k = 0; k < 2; k++) {
            memset(&md[k], 0, sizeof md[k]);
            md[k].size = sizeof md[k];
            md[k].slot_mapping = sm[k];
            md[k].block_tables = bt[k];
            md[k].seq_lens = sl[k];
            md[k].qo_indptr = qo[k];
            md[k].kv_indptr = kp[k];
            md[k].kv_indices = ki[k];
            md[k].kv_last_page_len = last[k];
            md[k].cap_tokens = 32;
            md[k].cap_indices = 16;
            md[k].max_blocks = 8;
        }
        md[0].cap_tokens = 8; /* too small: refused with the size needed, nothing written */
        EXPECT(kvb_plan_metadata(p, g, &md[0]) == KVB_ERANGE);
        md[0].cap_tokens = 32;
        EXPECT(kvb_plan_metadata(p, g, &md[0]) == KVB_OK);
        EXPECT(kvb_manager_metadata(b, g, s, q, NULL, 2, &md[1]) == KVB_OK);
        EXPECT(md[0].n_tokens == md[1].n_tokens && md[0].n_indices == md[1].n_indices);
        EXPECT(memcmp(sm[0], sm[1], sizeof sm[0]) == 0);
        EXPECT(memcmp(bt[0], bt[1], 2 * 8 * sizeof(int32_t)) == 0);
        EXPECT(memcmp(ki[0], ki[1], (size_t)md[0].n_indices * sizeof(int32_t)) == 0);
    }
    EXPECT(kvb_plan_commit(p) == KVB_OK && kvb_manager_num_computed(a, s[0]) == 13);
    EXPECT(kvb_plan_commit(p) == KVB_ESTATE); /* once */
    EXPECT(!kvb_plan_stale(p));
    t = 99;
    EXPECT(kvb_manager_append(a, s[0], &t, 1, 0) == KVB_OK);
    EXPECT(kvb_plan_stale(p));
    kvb_step_rows_t r;
    int32_t ro[3], wo[3];
    int64_t wi[32];
    memset(&r, 0, sizeof r);
    r.size = sizeof r;
    r.write_index = wi;
    r.read_offsets = ro;
    r.write_offsets = wo;
    r.cap_write = 32;
    r.stride = 4;
    EXPECT(kvb_plan_rows(p, 0, &r) == KVB_ESTATE); /* stale */
    kvb_plan_delete(p);
    EXPECT(kvb_manager_check(a) == KVB_OK && kvb_manager_check(b) == KVB_OK);
    kvb_manager_delete(a);
    kvb_manager_delete(b);
}

/* two managers, two threads, at once: each runs decode steps on its own handle */
static void *worker(void *arg) {
    kvb_manager_t *m = manager(64, 0);
    int32_t seqs[8], toks[8], q[8];
    int32_t prompt[6] = {1, 2, 3, 4, 5, (int32_t)(intptr_t)arg};
    for (int i = 0; i < 8; i++) {
        if (kvb_manager_add(m, prompt, 6, NULL, 0, 0, &seqs[i], NULL)) return (void *)1;
        q[i] = (int32_t)(kvb_manager_num_tokens(m, seqs[i]) - kvb_manager_num_computed(m, seqs[i]));
    }
    if (kvb_manager_schedule(m, seqs, q, NULL, 8)) return (void *)1;
    for (int step = 0; step < 20; step++) {
        for (int i = 0; i < 8; i++) {
            toks[i] = step;
            q[i] = 1;
        }
        if (kvb_manager_append_batch(m, seqs, toks, 8)) return (void *)1;
        int64_t pairs[32], n;
        if (kvb_manager_take_copies(m, pairs, 16, &n)) return (void *)1;
        if (kvb_manager_schedule(m, seqs, q, NULL, 8)) return (void *)1;
    }
    void *bad = (void *)(intptr_t)(kvb_manager_check(m) != KVB_OK ||
                                   kvb_manager_num_tokens(m, seqs[7]) != 26);
    kvb_manager_delete(m);
    return bad;
}

static void threads(void) {
    pthread_t t[4];
    for (intptr_t i = 0; i < 4; i++) EXPECT(pthread_create(&t[i], NULL, worker, (void *)i) == 0);
    for (int i = 0; i < 4; i++) {
        void *r = (void *)1;
        pthread_join(t[i], &r);
        EXPECT(r == NULL);
    }
}

int main(void) {
    library();
    configs();
    manager_errors();
    swaps();
    pools();
    hashes_rows();
    plans();
    threads();
    if (failures) {
        fprintf(stderr, "capi_contract: %d failures\n", failures);
        return 1;
    }
    printf("capi_contract: OK\n");
    return 0;
}
