/* bench_core.c -- the operations of `kvblocks bench alloc` / `prefix`, timed from C through
 * libkvblocks (include/kvblocks.h): beside the Python figures, the difference is the cost of
 * the Python boundary (argument conversion, the call guard, result arrays).
 *
 *   bench_core [--runs R] [--json FILE]
 *
 * Each operation is timed in samples of `inner` calls (a sample lasts >= ~20 us, so the clock's
 * own cost is small; it is printed), many samples per run; a run reports the p50 and p99 of
 * the per-call time, and the table gives the median over R runs (default 5) of each. Setup and
 * resets (truncate + reserve between decode samples) are outside the timed region.
 *
 *   allocate+free n=128          kvb_pool_allocate(128) + kvb_pool_free, pool of 65,536, caching
 *   append_batch 256 seqs        the decode step into reserved room (no block filled)
 *   append_batch+schedule 256    the decode step crossing block boundaries: each filled block
 *                                is hashed and, once the step is declared, cached
 *   lookup_and_pin+free 2048     longest cached prefix of 2,048 evictable blocks, pinned, freed
 */
#define _POSIX_C_SOURCE 199309L
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvblocks.h"

enum { NSEQ = 256, BS = 16, LOOKUP = 2048, MAXSAMPLES = 4000 };

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double quantile(double *v, int n, double q) { /* v sorted */
    int i = (int)(q * (n - 1) + 0.5);
    return v[i];
}

#define DIE(call)                                                                          \
    do {                                                                                   \
        int rc_ = (call);                                                                  \
        if (rc_) {                                                                         \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, kvb_strerror(rc_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

typedef struct {
    const char *id, *label, *unit;
    int per;                   /* units per call (blocks, sequences) */
    int inner;                 /* calls per sample */
    int samples;               /* samples per run */
    void (*call)(void);
    void (*reset)(void);       /* between samples, untimed (or NULL) */
    double p50[16], p99[16];   /* per run, ns per call */
} op_t;

/* ---- the operations ------------------------------------------------------------------- */
static kvb_pool_t *pool_af, *pool_lk;
static int32_t ids_af[128], ids_lk[LOOKUP], rev_lk[LOOKUP];
static kvb_hash_t hashes[LOOKUP];
static kvb_manager_t *mgr_ab, *mgr_fill;
static int32_t seqs[NSEQ], toks[NSEQ], ones[NSEQ], fill_rows[BS][NSEQ];
static int fill_k;
static uint64_t rng = 88172645463325252ull;

static uint32_t xorshift(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}

static void alloc_free(void) {
    DIE(kvb_pool_allocate(pool_af, 128, ids_af));
    DIE(kvb_pool_free(pool_af, ids_af, 128));
}

static void append_batch(void) { DIE(kvb_manager_append_batch(mgr_ab, seqs, toks, NSEQ)); }

static void append_batch_reset(void) {
    for (int i = 0; i < NSEQ; i++) {
        DIE(kvb_manager_truncate(mgr_ab, seqs[i], 3 * BS));
        DIE(kvb_manager_reserve(mgr_ab, seqs[i], BS));
    }
}

static void decode_fill(void) {
    DIE(kvb_manager_append_batch(mgr_fill, seqs, fill_rows[fill_k++], NSEQ));
    DIE(kvb_manager_schedule(mgr_fill, seqs, ones, NULL, NSEQ));
}

static void decode_fill_reset(void) {
    for (int i = 0; i < NSEQ; i++) DIE(kvb_manager_truncate(mgr_fill, seqs[i], 3 * BS));
    for (int k = 0; k < BS; k++)
        for (int i = 0; i < NSEQ; i++) fill_rows[k][i] = (int32_t)(xorshift() % 32000);
    fill_k = 0;
}

static void lookup_pin_free(void) {
    int64_t k = kvb_pool_lookup_and_pin(pool_lk, hashes, LOOKUP, ids_lk);
    if (k != LOOKUP) {
        fprintf(stderr, "lookup: %" PRId64 " hits\n", k);
        exit(1);
    }
    for (int i = 0; i < LOOKUP; i++) rev_lk[i] = ids_lk[LOOKUP - 1 - i];
    DIE(kvb_pool_free(pool_lk, rev_lk, LOOKUP));
}

static kvb_manager_t *decode_manager(int32_t nblocks, int reserve) {
    kvb_manager_config_t c;
    kvb_manager_config_init(&c);
    c.num_blocks = nblocks;
    c.block_size = BS;
    kvb_manager_t *m;
    DIE(kvb_manager_new(&c, &m));
    int32_t prompt[3 * BS], q[NSEQ];
    for (int i = 0; i < NSEQ; i++) {
        for (int t = 0; t < 3 * BS; t++) prompt[t] = i + t; /* 3 full blocks */
        DIE(kvb_manager_add(m, prompt, 3 * BS, NULL, 0, 0, &seqs[i], NULL));
        if (reserve) DIE(kvb_manager_reserve(m, seqs[i], BS));
        q[i] = 3 * BS;
    }
    DIE(kvb_manager_schedule(m, seqs, q, NULL, NSEQ));
    return m;
}

static void setup(void) {
    DIE(kvb_pool_new(1 << 16, 1, 0, &pool_af));
    DIE(kvb_pool_new(LOOKUP + 1, 1, 0, &pool_lk));
    for (int i = 0; i < LOOKUP; i++) {
        hashes[i].lo = 0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
        hashes[i].hi = ~(uint64_t)i;
    }
    DIE(kvb_pool_allocate(pool_lk, LOOKUP, ids_lk));
    DIE(kvb_pool_cache(pool_lk, ids_lk, hashes, LOOKUP, NULL, NULL, 0, NULL));
    for (int i = 0; i < LOOKUP; i++) rev_lk[i] = ids_lk[LOOKUP - 1 - i];
    DIE(kvb_pool_free(pool_lk, rev_lk, LOOKUP)); /* all cached and evictable */
    mgr_ab = decode_manager(NSEQ * 8 + 1, 1);
    mgr_fill = decode_manager(NSEQ * 40 + 1, 0);
    for (int i = 0; i < NSEQ; i++) {
        toks[i] = i;
        ones[i] = 1;
    }
    decode_fill_reset();
}

static void run_op(op_t *op, int run) {
    static double per_call[MAXSAMPLES];
    for (int w = 0; w < 3; w++) { /* warm-up samples */
        if (op->reset) op->reset();
        for (int i = 0; i < op->inner; i++) op->call();
    }
    for (int s = 0; s < op->samples; s++) {
        if (op->reset) op->reset();
        double t0 = now_ns();
        for (int i = 0; i < op->inner; i++) op->call();
        per_call[s] = (now_ns() - t0) / op->inner;
    }
    qsort(per_call, (size_t)op->samples, sizeof *per_call, cmp_d);
    op->p50[run] = quantile(per_call, op->samples, 0.50);
    op->p99[run] = quantile(per_call, op->samples, 0.99);
}

static double median(double *v, int n) {
    double tmp[16];
    memcpy(tmp, v, (size_t)n * sizeof *v);
    qsort(tmp, (size_t)n, sizeof *tmp, cmp_d);
    return n % 2 ? tmp[n / 2] : (tmp[n / 2 - 1] + tmp[n / 2]) / 2;
}

static void fmt_ns(double ns, char *out, size_t cap) {
    if (ns < 100) snprintf(out, cap, "%.1f ns", ns);
    else if (ns < 1e3) snprintf(out, cap, "%.0f ns", ns);
    else if (ns < 1e6) snprintf(out, cap, "%.2f us", ns / 1e3);
    else snprintf(out, cap, "%.2f ms", ns / 1e6);
}

int main(int argc, char **argv) {
    int runs = 5;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--runs") && i + 1 < argc) runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc) json = argv[++i];
        else {
            fprintf(stderr, "usage: bench_core [--runs R] [--json FILE]\n");
            return 2;
        }
    }
    if (runs < 1 || runs > 16) runs = 5;
    setup();
    op_t ops[] = {
        {"allocate_free/n=128", "allocate+free n=128", "block", 128, 64, 2000, alloc_free, NULL,
         {0}, {0}},
        {"append_batch/256", "append_batch 256 seqs (reserved room)", "seq", NSEQ, BS - 1, 1000,
         append_batch, append_batch_reset, {0}, {0}},
        {"decode_step/fills", "append_batch+schedule 256 seqs (block fills)", "seq", NSEQ, BS,
         300, decode_fill, decode_fill_reset, {0}, {0}},
        {"lookup_and_pin/2048", "lookup_and_pin + free 2,048 blocks", "block", LOOKUP, 4, 1000,
         lookup_pin_free, NULL, {0}, {0}},
    };
    int nops = (int)(sizeof ops / sizeof *ops);
    double t0 = now_ns();
    for (int i = 0; i < 1000; i++) (void)now_ns();
    double timer = (now_ns() - t0) / 1000;
    for (int r = 0; r < runs; r++)
        for (int k = 0; k < nops; k++) run_op(&ops[k], r);
    printf("libkvblocks %s, C, %d runs (median of the runs' p50 / p99); clock_gettime %.0f ns, "
           "once per sample of `inner` calls\n", kvb_version_string(), runs, timer);
    printf("%-48s %-6s %10s %10s %10s %6s\n", "operation", "unit", "p50/call", "p99/call",
           "per unit", "inner");
    for (int k = 0; k < nops; k++) {
        char a[32], b[32], c[32];
        double p50 = median(ops[k].p50, runs), p99 = median(ops[k].p99, runs);
        fmt_ns(p50, a, sizeof a);
        fmt_ns(p99, b, sizeof b);
        fmt_ns(p50 / ops[k].per, c, sizeof c);
        printf("%-48s %-6s %10s %10s %10s %6d\n", ops[k].label, ops[k].unit, a, b, c,
               ops[k].inner);
    }
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            perror(json);
            return 1;
        }
        fprintf(f, "{\"library\": \"libkvblocks %s\", \"runs\": %d, \"timer_ns\": %.1f, "
                "\"ops\": [", kvb_version_string(), runs, timer);
        for (int k = 0; k < nops; k++) {
            fprintf(f, "%s\n  {\"id\": \"%s\", \"label\": \"%s\", \"unit\": \"%s\", \"per\": %d, "
                    "\"inner\": %d, \"samples\": %d, \"p50_ns\": %.1f, \"p99_ns\": %.1f, "
                    "\"runs_p50_ns\": [", k ? "," : "", ops[k].id, ops[k].label, ops[k].unit,
                    ops[k].per, ops[k].inner, ops[k].samples, median(ops[k].p50, runs),
                    median(ops[k].p99, runs));
            for (int r = 0; r < runs; r++) fprintf(f, "%s%.1f", r ? ", " : "", ops[k].p50[r]);
            fprintf(f, "]}");
        }
        fprintf(f, "\n]}\n");
        fclose(f);
    }
    kvb_manager_delete(mgr_ab);
    kvb_manager_delete(mgr_fill);
    kvb_pool_delete(pool_af);
    kvb_pool_delete(pool_lk);
    return 0;
}
