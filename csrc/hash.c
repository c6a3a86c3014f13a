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
 */
#include <string.h>

#include "kvblocks.h"

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
