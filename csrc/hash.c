/* hash.c -- keyed 128-bit block hashes.
 *
 * SipHash-2-4 with 128-bit output, written from the published specification (Aumasson and
 * Bernstein, "SipHash: a fast short-input PRF", 2012, and the 128-bit variant of the reference
 * implementation). It is a pseudo-random function under a secret 128-bit key: without the key
 * an attacker can neither craft colliding prompts (vLLM advisory GHSA-rm76-4mrf-v9r8, where a
 * predictable hash let one request poison another's cache) nor predict which prompts share a
 * block.
 *
 * Block hashes chain: h[i] = SipHash128_key(h[i-1] || tokens of block i), each token a
 * little-endian int32, and h[-1] is the sequence's root, SipHash128_key("kvb" 0x01 || salt)
 * (or "kvb" 0x00 without salt). A salt therefore changes every hash of the chain, so
 * sequences with different salts never share a block.
 *
 * The other modes reproduce another engine's block hashes byte for byte, for routers that
 * index blocks by the engine's own hash (kvb_hash_blocks dispatches on the mode):
 *   vLLM sha256_cbor   h[i] = sha256(cbor((h[i-1] or NONE_HASH, tuple(tokens), extra_keys)))
 *                      with canonical CBOR (RFC 8949 preferred serialization, which is all
 *                      these values need: ints in their shortest head, byte and text
 *                      strings, arrays, null). NONE_HASH = sha256(cbor(seed string)). Extra
 *                      keys: the salt on block 0 and the LoRA name on every block, tagged
 *                      (vLLM >= 0.31) or untagged (0.11.1 - 0.30), prebuilt per sequence by
 *                      kvb_vllm_context.
 *   SGLang sha256      h[i] = sha256(h[i-1] || tokens as little-endian uint32), block 0 with
 *                      no parent bytes (the SGLang router's page hash).
 * Both digests are 32 bytes; kvblocks keys a block on 16 of them (kvb_digest_t.h, the half
 * holding the router's wire value) and keeps the other 16 (x) to continue the chain.
 */
#include <string.h>

#include "internal.h"

#define ROTL(x, b) (uint64_t)(((x) << (b)) | ((x) >> (64 - (b))))

#define SIPROUND                                                                             \
    do {                                                                                     \
        v0 += v1; v1 = ROTL(v1, 13); v1 ^= v0; v0 = ROTL(v0, 32);                            \
        v2 += v3; v3 = ROTL(v3, 16); v3 ^= v2;                                               \
        v0 += v3; v3 = ROTL(v3, 21); v3 ^= v0;                                               \
        v2 += v1; v1 = ROTL(v1, 17); v1 ^= v2; v2 = ROTL(v2, 32);                            \
    } while (0)

KVB_INLINE uint64_t load64_le(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

typedef struct { uint64_t v0, v1, v2, v3; } sip_state;

KVB_INLINE void sip_init(sip_state *s, const uint8_t key[16]) {
    uint64_t k0 = load64_le(key), k1 = load64_le(key + 8);
    s->v0 = 0x736f6d6570736575ULL ^ k0;
    s->v1 = 0x646f72616e646f6dULL ^ k1 ^ 0xee; /* 0xee: 128-bit output variant */
    s->v2 = 0x6c7967656e657261ULL ^ k0;
    s->v3 = 0x7465646279746573ULL ^ k1;
}

KVB_INLINE void sip_word(sip_state *s, uint64_t m) {
    uint64_t v0 = s->v0, v1 = s->v1, v2 = s->v2, v3 = s->v3;
    v3 ^= m;
    SIPROUND;
    SIPROUND;
    v0 ^= m;
    s->v0 = v0; s->v1 = v1; s->v2 = v2; s->v3 = v3;
}

/* last: the final word, total length in its top byte and the 0..7 trailing bytes below. */
KVB_INLINE void sip_final(sip_state *s, uint64_t last, kvb_hash_t *out) {
    sip_word(s, last);
    uint64_t v0 = s->v0, v1 = s->v1, v2 = s->v2, v3 = s->v3;
    v2 ^= 0xee;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out->lo = v0 ^ v1 ^ v2 ^ v3;
    v1 ^= 0xdd;
    SIPROUND; SIPROUND; SIPROUND; SIPROUND;
    out->hi = v0 ^ v1 ^ v2 ^ v3;
}

void kvb_siphash128(const uint8_t key[16], const void *data, size_t len, kvb_hash_t *out) {
    const uint8_t *p = (const uint8_t *)data;
    sip_state s;
    sip_init(&s, key);
    size_t nw = len / 8;
    for (size_t i = 0; i < nw; i++) sip_word(&s, load64_le(p + 8 * i));
    uint64_t last = (uint64_t)len << 56;
    size_t rem = len & 7;
    for (size_t i = 0; i < rem; i++) last |= (uint64_t)p[8 * nw + i] << (8 * i);
    sip_final(&s, last, out);
}

void kvb_hash_root(const uint8_t key[16], const uint8_t *salt, size_t salt_len,
                   kvb_hash_t *out) {
    /* the message "kvb" tag || salt, fed a byte at a time (roots are hashed once per
     * sequence): any salt length follows the one formula */
    const uint8_t head[4] = {'k', 'v', 'b', salt_len ? 1 : 0};
    size_t len = 4 + salt_len;
    sip_state s;
    sip_init(&s, key);
    uint64_t word = 0;
    for (size_t i = 0; i < len; i++) {
        uint8_t byte = i < 4 ? head[i] : salt[i - 4];
        word |= (uint64_t)byte << (8 * (i & 7));
        if ((i & 7) == 7) {
            sip_word(&s, word);
            word = 0;
        }
    }
    sip_final(&s, word | (uint64_t)len << 56, out);
}

/* One block: message = parent.lo || parent.hi || tokens (4 bytes each, little-endian). */
static void hash_block(const uint8_t key[16], const kvb_hash_t *parent, const int32_t *tokens,
                       int32_t block_size, kvb_hash_t *out) {
    sip_state s;
    sip_init(&s, key);
    sip_word(&s, parent->lo);
    sip_word(&s, parent->hi);
    const uint8_t *p = (const uint8_t *)tokens;
    size_t nbytes = (size_t)block_size * 4;
    size_t nw = nbytes / 8;
    for (size_t i = 0; i < nw; i++) sip_word(&s, load64_le(p + 8 * i));
    uint64_t last = (uint64_t)(16 + nbytes) << 56;
    if (nbytes & 7) last |= (uint64_t)(uint32_t)tokens[block_size - 1];
    sip_final(&s, last, out);
}

void kvb_hash_chain(const uint8_t key[16], const kvb_hash_t *parent, const int32_t *tokens,
                    int64_t n_blocks, int32_t block_size, kvb_hash_t *out) {
    const kvb_hash_t *prev = parent;
    for (int64_t i = 0; i < n_blocks; i++) {
        hash_block(key, prev, tokens + i * (int64_t)block_size, block_size, &out[i]);
        prev = &out[i];
    }
}

/* ---- 256-bit modes ---------------------------------------------------------------------- */
KVB_INLINE uint64_t load64_be(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v = v << 8 | p[i];
    return v;
}
KVB_INLINE void store64_be(uint8_t *p, uint64_t v) {
    for (int i = 7; i >= 0; i--, v >>= 8) p[i] = (uint8_t)v;
}
KVB_INLINE void store64_le(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++, v >>= 8) p[i] = (uint8_t)v;
}

int kvb_digest_size(int32_t algo) { return algo == KVB_HASH_SIPHASH ? 16 : 32; }

void kvb_digest_to_bytes(int32_t algo, const kvb_digest_t *d, uint8_t *out) {
    if (algo == KVB_HASH_SIPHASH) {
        store64_le(out, d->h.lo);
        store64_le(out + 8, d->h.hi);
    } else if (algo == KVB_HASH_SGLANG_SHA256) {
        store64_be(out, d->h.lo);
        store64_be(out + 8, d->h.hi);
        store64_be(out + 16, d->x.lo);
        store64_be(out + 24, d->x.hi);
    } else { /* vLLM: the kept half is the digest's tail, read as one big-endian int */
        store64_be(out, d->x.hi);
        store64_be(out + 8, d->x.lo);
        store64_be(out + 16, d->h.hi);
        store64_be(out + 24, d->h.lo);
    }
}

void kvb_digest_from_bytes(int32_t algo, const uint8_t *in, kvb_digest_t *d) {
    if (algo == KVB_HASH_SIPHASH) {
        d->h.lo = load64_le(in);
        d->h.hi = load64_le(in + 8);
        d->x.lo = d->x.hi = 0;
    } else if (algo == KVB_HASH_SGLANG_SHA256) {
        d->h.lo = load64_be(in);
        d->h.hi = load64_be(in + 8);
        d->x.lo = load64_be(in + 16);
        d->x.hi = load64_be(in + 24);
    } else {
        d->x.hi = load64_be(in);
        d->x.lo = load64_be(in + 8);
        d->h.hi = load64_be(in + 16);
        d->h.lo = load64_be(in + 24);
    }
}

/* CBOR head of major type `major` and argument v, shortest form; returns its length. */
static size_t cbor_head(uint8_t *out, int major, uint64_t v) {
    uint8_t mt = (uint8_t)(major << 5);
    if (v < 24) { out[0] = mt | (uint8_t)v; return 1; }
    if (v <= 0xff) { out[0] = mt | 24; out[1] = (uint8_t)v; return 2; }
    if (v <= 0xffff) { out[0] = mt | 25; out[1] = (uint8_t)(v >> 8); out[2] = (uint8_t)v; return 3; }
    if (v <= 0xffffffffu) {
        out[0] = mt | 26;
        for (int i = 0; i < 4; i++) out[1 + i] = (uint8_t)(v >> (24 - 8 * i));
        return 5;
    }
    out[0] = mt | 27;
    store64_be(out + 1, v);
    return 9;
}

/* A token as a CBOR integer: major type 0 for t >= 0, 1 (encoding -1 - t) below. */
KVB_INLINE size_t cbor_int(uint8_t *out, int32_t t) {
    return t >= 0 ? cbor_head(out, 0, (uint64_t)t) : cbor_head(out, 1, (uint64_t)(-1 - (int64_t)t));
}

void kvb_vllm_none_hash(const uint8_t *seed, size_t seed_len, uint8_t out[32]) {
    kvb_sha256_t s;
    uint8_t head[9];
    kvb_sha256_init(&s);
    kvb_sha256_update(&s, head, cbor_head(head, 3, seed_len));
    kvb_sha256_update(&s, seed, seed_len);
    kvb_sha256_final(&s, out);
}

/* Appends a CBOR text string to out (when it fits in cap); returns its length. */
static size_t cbor_text(uint8_t *out, size_t at, size_t cap, const uint8_t *s, size_t len) {
    uint8_t head[9];
    size_t h = cbor_head(head, 3, len);
    if (out && at + h + len <= cap) {
        memcpy(out + at, head, h);
        kvb_copy(out + at + h, s, len);
    }
    return h + len;
}

/* Extra keys of one block as CBOR: None (f6) or the array of its keys. */
static size_t vllm_extra(int tagged, const uint8_t *salt, size_t salt_len, const uint8_t *lora,
                         size_t lora_len, uint8_t *out, size_t at, size_t cap) {
    size_t n = (salt != NULL) + (lora != NULL), len = 0;
    static const uint8_t tag_salt[] = "cache_salt";
    uint8_t head[9];
    if (n == 0) {
        if (out && at < cap) out[at] = 0xf6;
        return 1;
    }
    size_t h = cbor_head(head, 4, n);
    if (out && at + h <= cap) memcpy(out + at, head, h);
    len += h;
    if (lora) len += cbor_text(out, at + len, cap, lora, lora_len); /* untagged only */
    if (salt) {
        if (tagged) { /* ("cache_salt", salt) */
            if (out && at + len < cap) out[at + len] = 0x82;
            len += 1;
            len += cbor_text(out, at + len, cap, tag_salt, sizeof tag_salt - 1);
        }
        len += cbor_text(out, at + len, cap, salt, salt_len);
    }
    return len;
}

int64_t kvb_vllm_context(int32_t algo, const uint8_t *salt, size_t salt_len,
                         const uint8_t *lora, size_t lora_len, uint8_t *out, size_t cap) {
    int tagged = algo == KVB_HASH_VLLM_SHA256_CBOR;
    if (!tagged && algo != KVB_HASH_VLLM_SHA256_CBOR_V030) return KVB_EINVAL;
    if (tagged && lora) return KVB_EINVAL;
    if (salt && salt_len == 0) salt = NULL; /* vLLM: an empty cache_salt is no salt */
    if (!salt && !lora) return 0;
    if (salt_len > INT32_MAX / 4 || lora_len > INT32_MAX / 4) return KVB_EINVAL;
    /* layout: extra0_len as 4 bytes little-endian, block 0's extra keys, the later ones' */
    size_t n0 = vllm_extra(tagged, salt, salt_len, lora, lora_len, out, 4, cap);
    size_t n1 = vllm_extra(tagged, NULL, 0, lora, lora_len, out, 4 + n0, cap);
    if (out && cap >= 4)
        for (int i = 0; i < 4; i++) out[i] = (uint8_t)(n0 >> (8 * i));
    return (int64_t)(4 + n0 + n1);
}

int kvb_hasher_init(kvb_hasher_t *hs, int32_t algo, const uint8_t key[16],
                    const uint8_t none_hash[32], const uint8_t *ctx, size_t ctx_len) {
    static const uint8_t none[1] = {0xf6};
    memset(hs, 0, sizeof *hs);
    hs->algo = algo;
    hs->key = key;
    hs->has_start = 1;
    switch (algo) {
    case KVB_HASH_SIPHASH:
        kvb_hash_root(key, ctx, ctx_len, &hs->start.h);
        return KVB_OK;
    case KVB_HASH_VLLM_SHA256_CBOR:
    case KVB_HASH_VLLM_SHA256_CBOR_V030:
        kvb_digest_from_bytes(algo, none_hash, &hs->start);
        hs->extra0 = hs->extra = none;
        hs->extra0_len = hs->extra_len = 1;
        if (ctx_len) {
            if (ctx_len < 6 || ctx_len > INT32_MAX) return KVB_EINVAL;
            size_t n0 = (size_t)ctx[0] | (size_t)ctx[1] << 8 | (size_t)ctx[2] << 16 |
                        (size_t)ctx[3] << 24;
            if (n0 < 1 || n0 > ctx_len - 5) return KVB_EINVAL;
            hs->extra0 = ctx + 4;
            hs->extra0_len = (int32_t)n0;
            hs->extra = ctx + 4 + n0;
            hs->extra_len = (int32_t)(ctx_len - 4 - n0);
        }
        return KVB_OK;
    case KVB_HASH_SGLANG_SHA256:
        if (ctx_len) { /* salted: block 0 chains on sha256("kvb" 0x01 || ctx) */
            kvb_sha256_t s;
            uint8_t d[32];
            static const uint8_t head[4] = {'k', 'v', 'b', 1};
            kvb_sha256_init(&s);
            kvb_sha256_update(&s, head, 4);
            kvb_sha256_update(&s, ctx, ctx_len);
            kvb_sha256_final(&s, d);
            kvb_digest_from_bytes(algo, d, &hs->start);
        } else {
            hs->has_start = 0;
        }
        return KVB_OK;
    default:
        return KVB_EINVAL;
    }
}

/* vLLM: sha256(cbor((parent, tuple(tokens), extra))), the CBOR streamed through a buffer. */
static void vllm_block(const kvb_hasher_t *hs, const uint8_t parent[32], const uint8_t *extra,
                       size_t extra_len, const int32_t *tokens, int32_t bs, uint8_t out[32]) {
    uint8_t buf[512];
    size_t n = 0;
    kvb_sha256_t s;
    kvb_sha256_init(&s);
    buf[0] = 0x83; /* array(3) */
    buf[1] = 0x58; /* bytes, 1-byte length */
    buf[2] = 0x20; /* 32 */
    memcpy(buf + 3, parent, 32);
    n = 35 + cbor_head(buf + 35, 4, (uint64_t)bs);
    for (int32_t i = 0; i < bs; i++) {
        if (n > sizeof buf - 9) {
            kvb_sha256_update(&s, buf, n);
            n = 0;
        }
        n += cbor_int(buf + n, tokens[i]);
    }
    kvb_sha256_update(&s, buf, n);
    kvb_sha256_update(&s, extra, extra_len);
    kvb_sha256_final(&s, out);
    (void)hs;
}

/* SGLang: sha256(parent (none for the first page) || tokens as little-endian uint32). */
static void sglang_block(const uint8_t *parent, const int32_t *tokens, int32_t bs,
                         uint8_t out[32]) {
    kvb_sha256_t s;
    kvb_sha256_init(&s);
    if (parent) kvb_sha256_update(&s, parent, 32);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (int32_t i = 0; i < bs; i++) {
        uint8_t le[4];
        uint32_t t = (uint32_t)tokens[i];
        for (int k = 0; k < 4; k++) le[k] = (uint8_t)(t >> (8 * k));
        kvb_sha256_update(&s, le, 4);
    }
#else
    kvb_sha256_update(&s, tokens, (size_t)bs * 4);
#endif
    kvb_sha256_final(&s, out);
}

void kvb_hash_blocks(const kvb_hasher_t *hs, const kvb_digest_t *parent, int64_t first,
                     const int32_t *tokens, int64_t n, int32_t block_size, kvb_hash_t *out_h,
                     kvb_hash_t *out_x) {
    const int32_t algo = hs->algo;
    if (n <= 0) return;
    if (algo == KVB_HASH_SIPHASH) { /* the default: no digest bytes, no other half */
        kvb_hash_chain(hs->key, parent ? &parent->h : &hs->start.h, tokens, n, block_size,
                       out_h);
        if (out_x) memset(out_x, 0, (size_t)n * sizeof *out_x);
        return;
    }
    uint8_t prev[32], d[32];
    int have = parent != NULL || hs->has_start;
    if (parent) kvb_digest_to_bytes(algo, parent, prev);
    else if (hs->has_start) kvb_digest_to_bytes(algo, &hs->start, prev);
    for (int64_t i = 0; i < n; i++) {
        const int32_t *t = tokens + i * (int64_t)block_size;
        if (algo == KVB_HASH_SGLANG_SHA256) {
            sglang_block(have ? prev : NULL, t, block_size, d);
        } else {
            int b0 = first + i == 0;
            vllm_block(hs, prev, b0 ? hs->extra0 : hs->extra,
                       (size_t)(b0 ? hs->extra0_len : hs->extra_len), t, block_size, d);
        }
        kvb_digest_t dg;
        kvb_digest_from_bytes(algo, d, &dg);
        out_h[i] = dg.h;
        if (out_x) out_x[i] = dg.x;
        memcpy(prev, d, 32);
        have = 1;
    }
}
