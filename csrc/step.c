/* step.c -- a forward step planned once: validated for every KV cache group, sized, released
 * and declared, with metadata (meta.c) and row indices (rows.c) written from the plan.
 *
 * One step, in order:
 *   check    every group validates the batch (kvb_grp_schedule's checks: live, unique, not
 *            swapped, no gap before the query, drafts reserved and private, nothing pending)
 *            and the sizes of each group's buffers are counted: nothing changes;
 *   release  window and chunk groups free what the step's queries cannot read (their table
 *            entries become the null block 0), before any table is written;
 *   write    metadata and rows, per group, into buffers checked to fit (kvb_meta_fits,
 *            kvb_rows_fits): pure writers of the checked step;
 *   commit   every committed token counts as computed; full blocks enter the prefix cache.
 * kvblocks' plan_step (Cython, and kvb_manager_plan_step in capi.c) runs check and release
 * (and commit, unless deferred to after the forward) and writes afterwards, as often as
 * asked, until the manager next changes (the tables written are the same before and after
 * the commit: it caches blocks, it never moves them). The v1 calls
 * (schedule, metadata, row_indices, in the Cython layer and in capi.c) are this sequence for
 * one group or all, checking the buffers before the release and writing between release and
 * commit, so that a buffer too small fails before anything changes.
 */
#include "internal.h"

static void step_size(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                      const int32_t *drafts, int64_t B, kvb_step_size_t *z) {
    int state = m->kind == KVB_G_STATE;
    memset(z, 0, sizeof *z);
    for (int64_t i = 0; i < B; i++) {
        const kvb_seq_t *s = &m->lead->seqs[slots[i]];
        int64_t d = drafts ? drafts[i] : 0, L = s->ntokens + d;
        int64_t nb = state ? row_of(m, slots[i])->nblocks : blocks_for(m, L);
        z->tokens += qlens[i] + d;
        z->blocks += nb;
        if (nb > z->max_blocks) z->max_blocks = nb;
        z->context += L;
    }
}

int kvb_step_check(kvb_mgr_t *const *g, int32_t G, const int32_t *slots, const int32_t *qlens,
                   const int32_t *drafts, int64_t B, kvb_step_size_t *sizes) {
    int rc = kvb_grp_schedule(g, G, slots, qlens, drafts, B, 0);
    if (rc) return rc;
    for (int32_t j = 0; j < G; j++) step_size(g[j], slots, qlens, drafts, B, &sizes[j]);
    return KVB_OK;
}

void kvb_step_release(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                      const int32_t *qlens, int64_t B) {
    mgr_step_release(g, G, slots, qlens, B);
}

void kvb_step_commit(kvb_mgr_t *const *g, int32_t G, const int32_t *slots,
                     const int32_t *qlens, const int32_t *drafts, int64_t B) {
    KVB_MUST(kvb_grp_schedule(g, G, slots, qlens, drafts, B, 1)); /* applying cannot fail */
}

/* The binding's check of a step for every group (j < 0) or for group j alone (a v1
 * metadata / row_indices call): pending copies in any group refuse either (err_a: how many),
 * and the detail of a failure is in g[0]'s fields whichever group failed; a length out of
 * range (KVB_EINVAL) is named "query_lens / draft_lens" (err_a: the index, err_b: the value). */
int kvb_step_check_for(kvb_mgr_t *const *g, int32_t G, int32_t j, const int32_t *slots,
                       const int32_t *qlens, const int32_t *drafts, int64_t B,
                       kvb_step_size_t *sizes) {
    int rc;
    if (j < 0) {
        rc = kvb_step_check(g, G, slots, qlens, drafts, B, sizes);
    } else {
        int64_t pending = kvb_grp_num_copies(g, G);
        if (G > 1 && pending) {
            KVB_CLEAR_ERR(g[0]);
            g[0]->err_a = pending;
            return KVB_EPENDING;
        }
        rc = kvb_step_check(&g[j], 1, slots, qlens, drafts, B, &sizes[j]);
        if (rc && j) {
            g[0]->err_a = g[j]->err_a;
            g[0]->err_b = g[j]->err_b;
            g[0]->err_what = g[j]->err_what;
        }
    }
    if (rc == KVB_EINVAL) g[0]->err_what = "query_lens / draft_lens";
    return rc;
}
