/* rows.c -- per-token row indices of one step, for engines whose cache tensor is a flat array
 * of rows (transformers' continuous batching: rows = block * stride + offset + position).
 *
 * For each sequence i of the batch, the context is its ntokens committed tokens plus drafts[i]
 * reserved draft slots; the query is the last qlens[i] committed tokens plus those drafts (the
 * same step model as meta.c). Token p of a sequence lives at row
 *     blocks[p / block_size] * stride + offset + p % block_size,
 * so a block's rows are contiguous and stride >= block_size keeps blocks apart. Written, in
 * caller-provided buffers: read_index (every context row, sequence after sequence),
 * write_index (every query row), their CSR offsets (int32, B + 1 each), and optionally a padded
 * page table whose entries are (block * stride + offset) / block_size, i.e. the page index of
 * the block's first row when the cache is viewed in pages of block_size rows (padding: the null
 * block's page). Any of read_index, write_index and block_tables may be NULL (not built).
 * The step is checked and sized once (step.c); kvb_rows_fits checks the geometry, the int64
 * range of the rows and the buffers' capacity before the first byte is written.
 */
#include "internal.h"

/* Rows of positions [from, to) of a table, written to out (no division per token). */
static int64_t put_rows(const kvb_mgr_t *m, const int32_t *blocks, int64_t from, int64_t to,
                        int64_t stride, int64_t offset, int64_t *out) {
    int64_t bs = m->block_size, t = 0, pos = from;
    while (pos < to) {
        int64_t off = off_in(m, pos), run = bs - off;
        if (run > to - pos) run = to - pos;
        int64_t base = (int64_t)blocks[blk_of(m, pos)] * stride + offset + off;
        for (int64_t j = 0; j < run; j++) out[t + j] = base + j;
        t += run;
        pos += run;
    }
    return t;
}

int kvb_rows_fits(kvb_mgr_t *m, const kvb_step_size_t *z, const kvb_rows_t *out) {
    int64_t bs = m->block_size, stride = out->stride, offset = out->offset;
    KVB_CLEAR_ERR(m);
    if (m->kind == KVB_G_STATE) { /* no per-token rows (the binding refuses it first) */
        m->err_what = "a state group has no per-token rows";
        return KVB_EINVAL;
    }
    /* geometry: blocks do not overlap and the last row of the last block fits in int64 */
    int64_t nblk = m->pool->num_blocks;
    if (stride < bs || offset < 0 ||
        stride > (INT64_MAX - offset - bs) / (nblk > 0 ? nblk : 1)) {
        m->err_a = 0; m->err_b = stride < bs ? stride : offset; m->err_what = "need stride >= block_size, offset >= 0 and every row within int64";
        return KVB_EINVAL;
    }
    if (out->block_tables && (stride % bs || offset % bs)) {
        m->err_a = 0; m->err_b = stride % bs ? stride : offset;
        m->err_what = "block_tables need stride and offset multiples of block_size";
        return KVB_EINVAL;
    }
    if (out->block_tables && (nblk - 1) * (stride / bs) + offset / bs > INT32_MAX) {
        m->err_a = 0; m->err_b = stride; m->err_what = "block_tables entries exceed int32";
        return KVB_EINVAL;
    }
    if (out->block_tables && z->max_blocks > out->max_blocks) {
        m->err_a = z->max_blocks; m->err_b = out->max_blocks; m->err_what = "block_tables";
        return KVB_ERANGE;
    }
    int64_t nread = z->context, nwrite = z->tokens;
    if (nread > INT32_MAX) { /* the CSR offsets are int32 */
        m->err_a = nread; m->err_b = INT32_MAX; m->err_what = "read_offsets";
        return KVB_ERANGE;
    }
    if (out->read_index && nread > out->cap_read) {
        m->err_a = nread; m->err_b = out->cap_read; m->err_what = "read_index";
        return KVB_ERANGE;
    }
    if (out->write_index && nwrite > out->cap_write) {
        m->err_a = nwrite; m->err_b = out->cap_write; m->err_what = "write_index";
        return KVB_ERANGE;
    }
    return KVB_OK;
}

void kvb_rows_write(const kvb_mgr_t *m, const int32_t *slots, const int32_t *qlens,
                    const int32_t *drafts, int64_t B, kvb_rows_t *out) {
    int64_t bs = m->block_size, stride = out->stride, offset = out->offset;
    int64_t r = 0, w = 0;
    out->read_offsets[0] = 0;
    out->write_offsets[0] = 0;
    for (int64_t i = 0; i < B; i++) {
        const kvb_seq_t *s = &m->lead->seqs[slots[i]];
        const int32_t *blocks = row_of(m, slots[i])->blocks;
        int64_t L = s->ntokens + (drafts ? drafts[i] : 0);
        int64_t start = L - qlens[i] - (drafts ? drafts[i] : 0);
        if (out->read_index) put_rows(m, blocks, 0, L, stride, offset, out->read_index + r);
        if (out->write_index)
            put_rows(m, blocks, start, L, stride, offset, out->write_index + w);
        r += L;
        w += L - start;
        out->read_offsets[i + 1] = (int32_t)r;
        out->write_offsets[i + 1] = (int32_t)w;
        if (out->block_tables) {
            int32_t *row = out->block_tables + i * (int64_t)out->max_blocks;
            int64_t nb = blocks_for(m, L), pages = stride / bs, first = offset / bs;
            for (int64_t b = 0; b < nb; b++) row[b] = (int32_t)(blocks[b] * pages + first);
            for (int64_t b = nb; b < out->max_blocks; b++) row[b] = (int32_t)first;
        }
    }
    out->n_read = r;
    out->n_write = w;
}
