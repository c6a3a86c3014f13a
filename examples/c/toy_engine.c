/* toy_engine.c -- a toy inference engine over libkvblocks (include/kvblocks.h), in C11.
 *
 * Continuous batching with prefix reuse, parallel sampling by fork (copy-on-write), swapping
 * to a host pool, preemption by recompute and speculative decoding with draft slots, over a
 * byte-array "K/V store": the K/V of token p of a sequence is 8 bytes, a hash of the tokens
 * 0..p (so a block shared by two sequences holds the same bytes for both, and a stale or
 * foreign block reads back wrong). The "forward pass" writes each query token's K/V at the
 * slot the attention metadata gives; block copies, swap pairs and copy-on-write copies move
 * bytes as an engine's kernels would. After every step each sequence's K/V is read back
 * through its block table (device or host) and compared with what its own tokens give, and
 * the manager's invariants are checked.
 *
 * With the host tier (features bit 16) evicted cached blocks are demoted to the host pool and
 * prompts continue their prefix there: the drain runs, in order, the offloads, the onloads,
 * the swap pairs queued since the last drain and the copy-on-write copies.
 *
 *   toy_engine [steps] [seed] [features]   exit 0 and a summary line when every read-back
 *                                          matched (features: a mask, default 15)
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvblocks.h"

enum { BS = 4, NBLOCKS = 40, NHOST = 128, MAXSEQ = 48, MAXLEN = 96, MAXDRAFT = 3, SLOT = 8,
       PAIRS = 256 };

typedef struct {
    int live;                  /* in use */
    int32_t slot;              /* the manager's sequence */
    int32_t tokens[MAXLEN + MAXDRAFT + 1]; /* the engine's copy of its tokens */
    int64_t n;                 /* tokens */
    int64_t target;            /* length at which it finishes */
    int swapped;               /* on the host */
    int preempted;             /* freed under pressure: re-admitted with its tokens */
} req_t;

static uint8_t kv[NBLOCKS * BS * SLOT];     /* device K/V: SLOT bytes per token slot */
static uint8_t host_kv[NHOST * BS * SLOT];  /* host K/V */
static req_t reqs[MAXSEQ];
static uint64_t rng_state;
static unsigned features = 15; /* 1 fork, 2 swap, 4 drafts, 8 shared prefixes, 16 host tier */
static int64_t swapq[3 * 4096]; /* swap pairs queued for the drain: (src, dst, 1 = to host) */
static int64_t nswapq;
static long n_checked, n_forked, n_swaps, n_drafts, n_preempt, n_done, n_hits;
static int64_t n_offloads, n_onloads;

static uint64_t rnd(void) { /* splitmix64 */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t kv_of(const int32_t *tokens, int64_t p) { /* K/V bytes of token p */
    uint64_t h = 1469598103934665603ull;
    for (int64_t i = 0; i <= p; i++) h = (h ^ (uint32_t)tokens[i]) * 1099511628211ull;
    return h;
}

#define CHECK(call)                                                                        \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            int64_t a_, b_;                                                                \
            const char *w_ = kvb_manager_last_error(mgr, &a_, &b_);                        \
            fprintf(stderr, "%s:%d: %s: %s (a=%" PRId64 " b=%" PRId64 " %s)\n", __FILE__,  \
                    __LINE__, #call, kvb_strerror(rc_), a_, b_, w_ ? w_ : "");             \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

static kvb_manager_t *mgr;

static void copy_pairs(const int64_t *pairs, int64_t n, uint8_t *dst_store,
                       const uint8_t *src_store) {
    for (int64_t i = 0; i < n; i++)
        memmove(dst_store + pairs[2 * i + 1] * BS * SLOT, src_store + pairs[2 * i] * BS * SLOT,
                BS * SLOT);
}

/* every computed token of r reads back its own K/V through its block table */
static void verify(const req_t *r) {
    int32_t table[MAXLEN / BS + 4];
    int64_t nb = 0;
    CHECK(kvb_manager_block_table(mgr, 0, r->slot, table, MAXLEN / BS + 4, &nb));
    int64_t ntok = kvb_manager_num_tokens(mgr, r->slot);
    int64_t nc = kvb_manager_num_computed(mgr, r->slot);
    if (ntok != r->n || nc < 0 || nc > ntok) {
        fprintf(stderr, "slot %d: %" PRId64 " tokens (engine %" PRId64 "), %" PRId64
                " computed\n", r->slot, ntok, r->n, nc);
        exit(1);
    }
    const uint8_t *store = r->swapped ? host_kv : kv;
    for (int64_t p = 0; p < nc; p++) {
        uint64_t want = kv_of(r->tokens, p), got;
        memcpy(&got, store + ((int64_t)table[p / BS] * BS + p % BS) * SLOT, SLOT);
        if (got != want) {
            fprintf(stderr, "read-back mismatch: slot %d token %" PRId64 " (block %d, %s)\n",
                    r->slot, p, table[p / BS], r->swapped ? "host" : "device");
            exit(1);
        }
        n_checked++;
    }
}

static req_t *pick_live(void) { /* a random admitted sequence, or NULL */
    int start = (int)(rnd() % MAXSEQ);
    for (int k = 0; k < MAXSEQ; k++) {
        req_t *r = &reqs[(start + k) % MAXSEQ];
        if (r->live && !r->preempted) return r;
    }
    return NULL;
}

static req_t *new_req(void) {
    for (int i = 0; i < MAXSEQ; i++)
        if (!reqs[i].live) {
            memset(&reqs[i], 0, sizeof reqs[i]);
            reqs[i].live = 1;
            return &reqs[i];
        }
    return NULL;
}

static int admit(req_t *r, int recompute) { /* 0: admitted, else out of blocks */
    int64_t cached = 0;
    int rc = kvb_manager_add(mgr, r->tokens, r->n, NULL, 0, recompute, &r->slot, &cached);
    if (rc == KVB_EOUTOFBLOCKS) return rc;
    CHECK(rc);
    n_hits += cached;
    r->preempted = 0;
    return 0;
}

static void preempt(req_t *r) { /* free under pressure; re-admitted later (recompute) */
    CHECK(kvb_manager_free(mgr, r->slot));
    r->preempted = 1;
    n_preempt++;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 400;
    rng_state = argc > 2 ? strtoull(argv[2], NULL, 10) : 1;
    if (argc > 3) features = (unsigned)strtoul(argv[3], NULL, 0);
    int major, minor, patch;
    if (kvb_version(&major, &minor, &patch) != KVBLOCKS_ABI_VERSION) {
        fprintf(stderr, "libkvblocks ABI %d, header %d\n", kvb_version(0, 0, 0),
                KVBLOCKS_ABI_VERSION);
        return 1;
    }
    kvb_manager_config_t cfg;
    kvb_manager_config_init(&cfg);
    cfg.num_blocks = NBLOCKS;
    cfg.block_size = BS;
    cfg.num_host_blocks = NHOST;
    cfg.kv_events = 1;
    cfg.host_prefix_cache = (features & 16) != 0;
    CHECK(kvb_manager_new(&cfg, &mgr));
    static const int32_t prefixes[3][8] = {{11, 12, 13, 14, 15, 16, 17, 18},
                                           {21, 22, 23, 24, 25, 26, 27, 28},
                                           {31, 32, 33, 34, 35, 36, 37, 38}};
    int64_t pairs[2 * PAIRS];
    int32_t seqs[MAXSEQ], qlens[MAXSEQ], drafts[MAXSEQ], toks[MAXSEQ];
    int idx[MAXSEQ];
    int32_t dtok[MAXSEQ][MAXDRAFT];
    int64_t slot_mapping[MAXSEQ * (MAXLEN + MAXDRAFT)];
    int32_t seq_lens[MAXSEQ], qo[MAXSEQ + 1], kvp[MAXSEQ + 1], kvi[MAXSEQ * (MAXLEN / BS + 2)];
    int32_t last[MAXSEQ];
    kvb_event_t events[4096];
    int32_t ev_tokens[4096 * BS];
    int64_t n_events_total = 0;

    for (int step = 0; step < steps; step++) {
        /* 1. admissions: new requests sharing a prefix, re-admissions of preempted ones */
        for (int i = 0; i < MAXSEQ; i++)
            if (reqs[i].live && reqs[i].preempted && admit(&reqs[i], 1)) break;
        if (rnd() % 2 == 0) {
            req_t *r = new_req();
            if (r) {
                const int32_t *pre = prefixes[rnd() % 3];
                if (!(features & 8)) pre = prefixes[0];
                int64_t plen = 1 + (int64_t)(rnd() % 8);
                memcpy(r->tokens, pre, (size_t)plen * sizeof *pre);
                int64_t extra = (int64_t)(rnd() % 6);
                for (int64_t j = 0; j < extra; j++) r->tokens[plen + j] = 100 + (int32_t)(rnd() % 50);
                r->n = plen + extra;
                r->target = r->n + 4 + (int64_t)(rnd() % 24);
                if (admit(r, 0)) r->preempted = 1; /* waits in the queue */
            }
        }
        /* 2. parallel sampling: fork a resident sequence */
        if ((features & 1) && rnd() % 7 == 0) {
            req_t *p = pick_live(), *c;
            if (p && !p->swapped && (c = new_req())) {
                int32_t child;
                CHECK(kvb_manager_fork(mgr, p->slot, &child));
                *c = *p;
                c->slot = child;
                n_forked++;
            }
        }
        /* 3. swap a resident sequence out, or a swapped one back in */
        if ((features & 2) && rnd() % 5 == 0) {
            req_t *r = pick_live();
            if (r) {
                int64_t np = 0;
                int rc = r->swapped
                    ? kvb_manager_swap_in(mgr, r->slot, pairs, PAIRS, &np)
                    : kvb_manager_swap_out(mgr, r->slot, pairs, PAIRS, &np);
                if (rc == 0) { /* the pairs run with the next drain, after its onloads */
                    for (int64_t j = 0; j < np; j++) {
                        swapq[3 * nswapq] = pairs[2 * j];
                        swapq[3 * nswapq + 1] = pairs[2 * j + 1];
                        swapq[3 * nswapq + 2] = !r->swapped;
                        nswapq++;
                    }
                    r->swapped = !r->swapped;
                    n_swaps++;
                } else if (rc != KVB_EOUTOFBLOCKS && rc != KVB_EPENDING) {
                    CHECK(rc);
                }
            }
        }
        /* 4. the batch: resident sequences; some get draft slots */
        int64_t B = 0, ntok = 0;
        for (int i = 0; i < MAXSEQ; i++) {
            req_t *r = &reqs[i];
            if (!r->live || r->swapped || r->preempted) continue;
            int64_t nc = kvb_manager_num_computed(mgr, r->slot);
            int32_t d = 0;
            if ((features & 4) && nc == r->n - 1 && r->n + MAXDRAFT < r->target && rnd() % 4 == 0) {
                d = 1 + (int32_t)(rnd() % MAXDRAFT);
                int rc = kvb_manager_reserve(mgr, r->slot, d);
                if (rc == KVB_EOUTOFBLOCKS) d = 0;
                else CHECK(rc);
            }
            idx[B] = i;
            seqs[B] = r->slot;
            qlens[B] = (int32_t)(r->n - nc);
            drafts[B] = d;
            for (int32_t j = 0; j < d; j++) dtok[B][j] = 200 + (int32_t)(rnd() % 4);
            ntok += qlens[B] + d;
            B++;
        }
        /* 5. drain: offloads, onloads (host tier), swap pairs, then copy-on-write copies */
        static int64_t tier_pairs[2 * 4096];
        int64_t ntp = 0;
        CHECK(kvb_manager_take_offloads(mgr, tier_pairs, 4096, &ntp));
        copy_pairs(tier_pairs, ntp, host_kv, kv);
        n_offloads += ntp;
        CHECK(kvb_manager_take_onloads(mgr, tier_pairs, 4096, &ntp));
        copy_pairs(tier_pairs, ntp, kv, host_kv);
        n_onloads += ntp;
        for (int64_t j = 0; j < nswapq; j++) {
            int64_t pr[2] = {swapq[3 * j], swapq[3 * j + 1]};
            if (swapq[3 * j + 2]) copy_pairs(pr, 1, host_kv, kv);
            else copy_pairs(pr, 1, kv, host_kv);
        }
        nswapq = 0;
        int64_t nc_pairs = 0;
        CHECK(kvb_manager_take_copies(mgr, pairs, PAIRS, &nc_pairs));
        copy_pairs(pairs, nc_pairs, kv, kv);
        /* 6. metadata into our buffers, and the forward pass writing each query's K/V */
        kvb_metadata_t md;
        memset(&md, 0, sizeof md);
        md.size = sizeof md;
        md.slot_mapping = slot_mapping;
        md.seq_lens = seq_lens;
        md.qo_indptr = qo;
        md.kv_indptr = kvp;
        md.kv_indices = kvi;
        md.kv_last_page_len = last;
        md.cap_tokens = (int64_t)(sizeof slot_mapping / sizeof *slot_mapping);
        md.cap_indices = (int64_t)(sizeof kvi / sizeof *kvi);
        CHECK(kvb_manager_metadata(mgr, 0, seqs, qlens, drafts, B, &md));
        if (md.n_tokens != ntok) {
            fprintf(stderr, "metadata: %" PRId64 " query tokens, want %" PRId64 "\n",
                    md.n_tokens, ntok);
            return 1;
        }
        for (int64_t b = 0; b < B; b++) {
            req_t *r = &reqs[idx[b]];
            int32_t row[MAXLEN + MAXDRAFT + 1];
            memcpy(row, r->tokens, (size_t)r->n * sizeof *row);
            memcpy(row + r->n, dtok[b], (size_t)drafts[b] * sizeof *row);
            int64_t q0 = r->n - qlens[b];
            for (int64_t t = 0; t < qlens[b] + drafts[b]; t++) {
                int64_t slot = slot_mapping[qo[b] + t];
                uint64_t v = kv_of(row, q0 + t);
                memcpy(kv + slot * SLOT, &v, SLOT);
            }
        }
        /* 7. read back every sequence's K/V (resident: every token computed now; swapped
         * out: the host copy), after the drain and the forward, before sampling appends */
        for (int i = 0; i < MAXSEQ; i++)
            if (reqs[i].live && !reqs[i].preempted) verify(&reqs[i]);
        /* 8. sampling: accepted drafts (computed) and one new token each (the decode step) */
        int64_t nb = 0;
        for (int64_t b = 0; b < B; b++) {
            req_t *r = &reqs[idx[b]];
            if (drafts[b]) {
                int64_t a = (int64_t)(rnd() % (uint64_t)(drafts[b] + 1));
                if (a) {
                    CHECK(kvb_manager_append(mgr, r->slot, dtok[b], a, 1));
                    memcpy(r->tokens + r->n, dtok[b], (size_t)a * sizeof *dtok[b]);
                    r->n += a;
                    n_drafts += a;
                }
            }
            int32_t t = 1 + (int32_t)(rnd() % 97);
            seqs[nb] = r->slot;
            toks[nb] = t;
            idx[nb] = idx[b];
            nb++;
        }
        for (;;) {
            int rc = kvb_manager_append_batch(mgr, seqs, toks, nb);
            if (rc != KVB_EOUTOFBLOCKS) {
                CHECK(rc);
                break;
            }
            preempt(&reqs[idx[nb - 1]]); /* the youngest leaves the batch; all-or-nothing */
            nb--;
        }
        for (int64_t b = 0; b < nb; b++) {
            req_t *r = &reqs[idx[b]];
            r->tokens[r->n++] = toks[b];
        }
        /* 9. finished sequences leave */
        for (int i = 0; i < MAXSEQ; i++) {
            req_t *r = &reqs[i];
            if (!r->live || r->preempted) continue;
            if (r->n >= r->target && !r->swapped) {
                CHECK(kvb_manager_free(mgr, r->slot));
                r->live = 0;
                n_done++;
            }
        }
        CHECK(kvb_manager_check(mgr));
        int64_t ne = 0, nt = 0;
        if (kvb_pool_take_events(kvb_manager_pool(mgr), events, 4096, ev_tokens, 4096 * BS, &ne,
                                 &nt) == 0)
            n_events_total += ne;
    }
    kvb_cache_stats_t st;
    kvb_pool_stats(kvb_manager_pool(mgr), &st);
    printf("toy_engine (C, libkvblocks %s): %d steps, %ld tokens read back, %ld finished, "
           "%ld forks, %ld swaps, %ld accepted drafts, %ld preemptions, %ld cached prompt "
           "tokens, %" PRId64 " offloads, %" PRId64 " onloads, %" PRId64 " events, %" PRIu64
           " blocks stored: OK\n",
           kvb_version_string(), steps, n_checked, n_done, n_forked, n_swaps, n_drafts,
           n_preempt, n_hits, n_offloads, n_onloads, n_events_total, st.stored);
    kvb_manager_delete(mgr);
    return 0;
}
