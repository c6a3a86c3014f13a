/* chain.c -- a sequence's hash chain in the manager, in the manager's hash mode.
 *
 * A sequence's record keeps the 128-bit hashes of its leading full blocks (hashes[]; a
 * group's cache key is the hash XOR the group's tag) and manager.c calls here to extend them
 * as blocks fill up, once for all groups. Everything else
 * the chain needs lives in the sequence's kvb_chain_t:
 *   start, has_start  block 0's parent (SipHash: the salted root, also kept in seq.root;
 *                     vLLM: NONE_HASH; SGLang: nothing, or a digest of the salt);
 *   ctx               the chain context given at add (vLLM: the CBOR of the extra keys of
 *                     block 0 and of the later blocks, so a prompt shorter than one block
 *                     still gets its salt when block 0 fills during decode);
 *   ext[0..nhashed)   in the 256-bit modes, the other 16 bytes of each block's digest. With
 *                     hashes[j] they make block j's full digest, which block j + 1 hashes:
 *                     a chain continues exactly across append, truncate and fork however it
 *                     was grown. SipHash needs none (ext stays unallocated).
 * tag is the adapter tag the events of the sequence's stored blocks carry.
 *
 * Functions that can fail (begin, reserve, fork) touch only the sequence's own slot, so the
 * manager calls them in its validation phase, before the slot is live or anything shared changes.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int kvb_mgr_set_hash(kvb_mgr_t *m, int32_t algo, const uint8_t none_hash[32]) {
    KVB_CLEAR_ERR(m);
    if (algo < 0 || algo >= KVB_HASH_NMODES) { m->err_b = algo; return KVB_EINVAL; }
    if (m->lead->nseqs) { m->err_what = "hash mode changed with live sequences"; return KVB_ESTATE; }
    m->hash_algo = algo;
    if (none_hash) memcpy(m->none_hash, none_hash, 32);
    else memset(m->none_hash, 0, 32);
    return KVB_OK;
}

/* The hasher of a sequence (points into m and s). */
static void seq_hasher(const kvb_mgr_t *m, const kvb_seq_t *s, kvb_hasher_t *hs) {
    const kvb_chain_t *c = &s->chain;
    KVB_MUST(kvb_hasher_init(hs, m->hash_algo, m->key, m->none_hash, c->ctx,
                             (size_t)c->ctx_len)); /* validated by kvb_chain_begin */
    hs->start = c->start; /* no rehash of the salt per call */
    hs->has_start = c->has_start;
}

int kvb_chain_begin(const kvb_mgr_t *m, kvb_seq_t *s, const uint8_t *ctx, size_t ctx_len) {
    kvb_chain_t *c = &s->chain;
    kvb_hasher_t hs;
    if (ctx_len > INT32_MAX) return KVB_EINVAL;
    int rc = kvb_hasher_init(&hs, m->hash_algo, m->key, m->none_hash, ctx, ctx_len);
    if (rc) return rc;
    if (m->hash_algo == KVB_HASH_VLLM_SHA256_CBOR ||
        m->hash_algo == KVB_HASH_VLLM_SHA256_CBOR_V030) { /* the others fold it into start */
        if (kvb_grow((void **)&c->ctx, &c->ctx_cap, (int64_t)ctx_len, 1)) return KVB_ENOMEM;
        kvb_copy(c->ctx, ctx, ctx_len);
        c->ctx_len = (int64_t)ctx_len;
    } else {
        c->ctx_len = 0;
    }
    c->start = hs.start;
    c->has_start = hs.has_start;
    c->tag = 0;
    s->root = hs.start.h;
    return KVB_OK;
}

int kvb_chain_reserve(const kvb_mgr_t *m, kvb_seq_t *s, int64_t nblocks) {
    if (m->hash_algo == KVB_HASH_SIPHASH) return KVB_OK;
    return kvb_grow((void **)&s->chain.ext, &s->chain.ecap, nblocks, sizeof *s->chain.ext);
}

/* The chain's hashes[from..to) from the tokens of those blocks: one SipHash or SHA-256 per
 * block for all groups (a group's key is the chain hash XOR its tag, kvb_group_tag). */
void kvb_chain_hash(const kvb_mgr_t *m, kvb_seq_t *s, const int32_t *tokens, int64_t from,
                    int64_t to) {
    if (to <= from) return;
    if (m->hash_algo == KVB_HASH_SIPHASH) { /* the default path, as before the modes */
        kvb_hash_chain(m->key, from ? &s->hashes[from - 1] : &s->root, tokens, to - from,
                       m->block_size, s->hashes + from);
        return;
    }
    kvb_hasher_t hs;
    kvb_digest_t parent;
    seq_hasher(m, s, &hs);
    if (from) {
        parent.h = s->hashes[from - 1];
        parent.x = s->chain.ext[from - 1];
    }
    kvb_hash_blocks(&hs, from ? &parent : NULL, from, tokens, to - from, m->block_size,
                    s->hashes + from, s->chain.ext + from);
}

void kvb_chain_block(const kvb_mgr_t *m, const kvb_seq_t *s, int64_t j, kvb_hash_t *out) {
    kvb_hasher_t hs;
    kvb_digest_t parent;
    const int32_t *tokens = s->tokens + j * (int64_t)m->block_size;
    if (m->hash_algo == KVB_HASH_SIPHASH) {
        kvb_hash_chain(m->key, j ? &s->hashes[j - 1] : &s->root, tokens, 1, m->block_size, out);
        return;
    }
    seq_hasher(m, s, &hs);
    if (j) {
        parent.h = s->hashes[j - 1];
        parent.x = s->chain.ext[j - 1];
    }
    kvb_hash_blocks(&hs, j ? &parent : NULL, j, tokens, 1, m->block_size, out, NULL);
}

int kvb_chain_fork(const kvb_mgr_t *m, kvb_seq_t *child, const kvb_seq_t *parent) {
    kvb_chain_t *c = &child->chain;
    const kvb_chain_t *pc = &parent->chain;
    if (kvb_chain_reserve(m, child, (int64_t)parent->nhashed + 1) ||
        kvb_grow((void **)&c->ctx, &c->ctx_cap, pc->ctx_len, 1))
        return KVB_ENOMEM;
    kvb_copy(c->ctx, pc->ctx, (size_t)pc->ctx_len);
    c->ctx_len = pc->ctx_len;
    c->start = pc->start;
    c->has_start = pc->has_start;
    c->tag = pc->tag;
    if (m->hash_algo != KVB_HASH_SIPHASH)
        kvb_copy(c->ext, pc->ext, (size_t)parent->nhashed * sizeof *c->ext);
    return KVB_OK;
}

void kvb_chain_destroy(kvb_seq_t *s) {
    free(s->chain.ext);
    free(s->chain.ctx);
    memset(&s->chain, 0, sizeof s->chain);
}

int kvb_chain_probe(const kvb_mgr_t *m, const uint8_t *ctx, size_t ctx_len,
                    kvb_hasher_t *hs) {
    if (ctx_len > INT32_MAX) return KVB_EINVAL;
    return kvb_hasher_init(hs, m->hash_algo, m->key, m->none_hash, ctx, ctx_len);
}
