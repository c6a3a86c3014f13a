/* meta.c -- attention metadata for one forward step, written into caller-provided buffers.
 *
 * For each sequence i of the batch, the last qlens[i] committed tokens are the queries of this
 * step (a prefill chunk or one decode token) and all ntokens are the context. Outputs follow
 * what the kernels take: vLLM-style slot_mapping (int64, block * block_size + offset), padded
 * FlashAttention block tables (int32, null block 0 as padding), and FlashInfer's CSR page
 * layout (kv_indptr, kv_indices, kv_last_page_len, qo_indptr; int32). Buffers have fixed
 * capacity (CUDA graphs replay them): unused slot_mapping entries are set to -1.
 * Validation covers every sequence and capacity before the first byte is written.
 */
#include <string.h>

#include "internal.h"

int kvb_mgr_metadata(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens, int64_t B,
                     kvb_meta_t *out) {
    kvb_mgr_t *mm = (kvb_mgr_t *)m;
    int32_t bs = m->block_size;
    int64_t ntok = 0, nidx = 0;
    for (int64_t i = 0; i < B; i++) {
        int32_t slot = slots[i];
        if (slot < 0 || slot >= m->scap || !(m->seqs[slot].gen & 1u)) {
            mm->err_a = i; mm->err_b = slot;
            return KVB_EUNKNOWN;
        }
        const kvb_seq_t *s = &m->seqs[slot];
        if (s->swapped) { mm->err_a = i; mm->err_b = slot; return KVB_ESTATE; }
        if (qlens[i] < 0 || qlens[i] > s->ntokens) {
            mm->err_a = i; mm->err_b = qlens[i];
            return KVB_EINVAL;
        }
        int64_t nb = (s->ntokens + bs - 1) / bs;
        if (out->block_tables && nb > out->max_blocks) {
            mm->err_a = nb; mm->err_b = out->max_blocks;
            return KVB_ERANGE;
        }
        ntok += qlens[i];
        nidx += nb;
    }
    if (ntok > out->cap_tokens) { mm->err_a = ntok; mm->err_b = out->cap_tokens; return KVB_ERANGE; }
    if (nidx > out->cap_indices) { mm->err_a = nidx; mm->err_b = out->cap_indices; return KVB_ERANGE; }

    int64_t t = 0, k = 0;
    out->qo_indptr[0] = 0;
    out->kv_indptr[0] = 0;
    for (int64_t i = 0; i < B; i++) {
        const kvb_seq_t *s = &m->seqs[slots[i]];
        int64_t L = s->ntokens, nb = (L + bs - 1) / bs, start = L - qlens[i];
        const int32_t *blocks = s->blocks;
        /* slot mapping: walk block by block, no division per token */
        int64_t pos = start;
        while (pos < L) {
            int64_t blk = pos / bs, off = pos - blk * bs;
            int64_t run = bs - off;
            if (run > L - pos) run = L - pos;
            int64_t base = (int64_t)blocks[blk] * bs + off;
            for (int64_t j = 0; j < run; j++) out->slot_mapping[t + j] = base + j;
            t += run;
            pos += run;
        }
        if (out->block_tables) {
            int32_t *row = out->block_tables + i * (int64_t)out->max_blocks;
            kvb_copy(row, blocks, (size_t)nb * sizeof *row);
            memset(row + nb, 0, (size_t)(out->max_blocks - nb) * sizeof *row);
        }
        kvb_copy(out->kv_indices + k, blocks, (size_t)nb * sizeof *blocks);
        k += nb;
        out->seq_lens[i] = (int32_t)L;
        out->qo_indptr[i + 1] = (int32_t)t;
        out->kv_indptr[i + 1] = (int32_t)k;
        out->kv_last_page_len[i] = (int32_t)(nb ? L - (nb - 1) * bs : 0);
    }
    for (int64_t j = t; j < out->cap_tokens; j++) out->slot_mapping[j] = -1;
    out->n_tokens = t;
    out->n_indices = k;
    return KVB_OK;
}
