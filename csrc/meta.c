/* meta.c -- attention metadata for one forward step, written into caller-provided buffers.
 *
 * For each sequence i of the batch, the last qlens[i] committed tokens are the queries of this
 * step (a prefill chunk or one decode token), followed by drafts[i] speculative draft slots
 * (reserved, not committed); the context is ntokens + drafts[i] positions. Outputs follow
 * what the kernels take: vLLM-style slot_mapping (int64, block * block_size + offset), padded
 * FlashAttention block tables (int32, null block 0 as padding), and FlashInfer's CSR page
 * layout (kv_indptr, kv_indices, kv_last_page_len, qo_indptr; int32). Buffers have fixed
 * capacity (CUDA graphs replay them): unused slot_mapping entries are set to -1.
 *
 * Reused buffers are updated incrementally when a row cache is given: a row that holds the
 * same sequence as in the last call, whose table entries did not change since (its row's
 * tver), only gets its new blocks written, in block_tables always and in kv_indices when its
 * CSR offset did not move. In a decode step most tables only grow, so most of the
 * O(total blocks) copying is skipped.
 * The step is checked and sized once (step.c); kvb_meta_fits checks the buffers' capacity
 * against its size before the first byte is written.
 *
 * KV cache groups: m is one group. A window or chunk group first releases what this step's
 * queries cannot read (their entries read the null block 0; kernels apply the window); a
 * state group's row is its fixed state blocks and its query tokens have no slot (-1).
 */
#include <string.h>

#include "internal.h"

int kvb_meta_fits(kvb_mgr_t *m, const kvb_step_size_t *z, const kvb_meta_t *out) {
    KVB_CLEAR_ERR(m);
    if (out->block_tables && z->max_blocks > out->max_blocks) {
        m->err_a = z->max_blocks; m->err_b = out->max_blocks; m->err_what = "block_tables";
        return KVB_ERANGE;
    }
    if (z->tokens > out->cap_tokens) {
        m->err_a = z->tokens; m->err_b = out->cap_tokens; m->err_what = "slot_mapping";
        return KVB_ERANGE;
    }
    if (out->kv_indices && z->blocks > out->cap_indices) { /* NULL: no page list */
        m->err_a = z->blocks; m->err_b = out->cap_indices; m->err_what = "kv_indices";
        return KVB_ERANGE;
    }
    return KVB_OK;
}

void kvb_meta_write(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                    const int32_t *drafts, int64_t B, kvb_meta_t *out) {
    int32_t bs = m->block_size;
    int state = m->kind == KVB_G_STATE;
    const kvb_seq_t *seqs = m->lead->seqs;
    kvb_rows_view_t v = group_rows(m);
    int64_t t = 0, k = 0;
    int64_t *rc = out->row_cache;
    int64_t valid = rc ? out->valid_rows : 0;
    out->qo_indptr[0] = 0;
    out->kv_indptr[0] = 0;
    for (int64_t i = 0; i < B; i++) {
        const kvb_seq_t *s = &seqs[slots[i]];
        const kvb_row_t *rw = rows_at(v, slots[i]);
        int64_t L = s->ntokens + (drafts ? drafts[i] : 0);
        int64_t nb = state ? rw->nblocks : blocks_for(m, L);
        int64_t start = s->ntokens - qlens[i];
        const int32_t *blocks = rw->blocks;
        /* entries [0, same_bt) of the block-table row and [0, same_kv) of the kv_indices
         * segment are still in the buffers from the last call */
        int64_t same_bt = 0, same_kv = 0;
        if (i < valid) {
            int64_t *r = rc + 4 * i;
            int64_t version = ((int64_t)s->gen << 32) | rw->tver;
            if (r[0] == slots[i] && r[1] == version && r[2] <= nb) {
                same_bt = r[2];
                same_kv = r[3] == k ? r[2] : 0;
            }
        }
        /* slot mapping: walk block by block, no division per token */
        int64_t pos = start;
        if (state) { /* no per-token slots: the kernel updates the state blocks */
            for (; pos < L; pos++) out->slot_mapping[t++] = -1;
        }
        while (pos < L) {
            int64_t blk = blk_of(m, pos), off = off_in(m, pos);
            int64_t run = bs - off;
            if (run > L - pos) run = L - pos;
            int64_t base = (int64_t)blocks[blk] * bs + off;
            for (int64_t j = 0; j < run; j++) out->slot_mapping[t + j] = base + j;
            t += run;
            pos += run;
        }
        if (out->block_tables) {
            int32_t *row = out->block_tables + i * (int64_t)out->max_blocks;
            kvb_copy(row + same_bt, blocks + same_bt, (size_t)(nb - same_bt) * sizeof *row);
            if (!same_bt) /* a row written for this table already has its zero padding */
                memset(row + nb, 0, (size_t)(out->max_blocks - nb) * sizeof *row);
        }
        if (out->kv_indices)
            kvb_copy(out->kv_indices + k + same_kv, blocks + same_kv,
                     (size_t)(nb - same_kv) * sizeof *blocks);
        if (rc && i < out->cap_rows) {
            int64_t *r = rc + 4 * i;
            r[0] = slots[i];
            r[1] = ((int64_t)s->gen << 32) | rw->tver;
            r[2] = nb;
            r[3] = k;
        }
        k += nb;
        out->seq_lens[i] = (int32_t)L;
        out->qo_indptr[i + 1] = (int32_t)t;
        out->kv_indptr[i + 1] = (int32_t)k;
        out->kv_last_page_len[i] = (int32_t)(state ? bs : nb ? L - (nb - 1) * bs : 0);
    }
    for (int64_t j = t; j < out->cap_tokens; j++) out->slot_mapping[j] = -1;
    out->n_tokens = t;
    out->n_indices = k;
    if (rc) out->valid_rows = B < out->cap_rows ? B : out->cap_rows;
}
