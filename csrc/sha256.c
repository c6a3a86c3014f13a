/* sha256.c -- SHA-256 (FIPS 180-4), streaming, for the hash modes that must match another
 * engine's block hashes byte for byte (vLLM's sha256_cbor, SGLang's page hash; hash.c).
 *
 * Written from the standard: a 64-byte block buffer, eight 32-bit state words, 64 rounds per
 * block, big-endian message words and length. Portable C (no SHA extensions): the hash modes
 * that use it are opt-in, SipHash stays the default. kvb_sha256_update accepts any split of
 * the message; kvb_sha256_final pads and writes the 32-byte digest.
 */
#include <string.h>

#include "internal.h"

static const uint32_t K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
    0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
    0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
    0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
    0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
    0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
    0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
    0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
    0xc67178f2};

#define ROR32(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

KVB_INLINE uint32_t load32_be(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void compress(uint32_t st[8], const uint8_t *block) {
    uint32_t w[64];
    for (int i = 0; i < 16; i++) w[i] = load32_be(block + 4 * i);
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROR32(w[i - 15], 7) ^ ROR32(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROR32(w[i - 2], 17) ^ ROR32(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = st[0], b = st[1], c = st[2], d = st[3];
    uint32_t e = st[4], f = st[5], g = st[6], h = st[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = h + (ROR32(e, 6) ^ ROR32(e, 11) ^ ROR32(e, 25)) + ((e & f) ^ (~e & g)) +
                      K[i] + w[i];
        uint32_t t2 = (ROR32(a, 2) ^ ROR32(a, 13) ^ ROR32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g; g = f; f = e; e = d + t1;
        d = c; c = b; b = a; a = t1 + t2;
    }
    st[0] += a; st[1] += b; st[2] += c; st[3] += d;
    st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

void kvb_sha256_init(kvb_sha256_t *s) {
    static const uint32_t iv[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                   0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    memcpy(s->state, iv, sizeof iv);
    s->nbytes = 0;
    s->fill = 0;
}

void kvb_sha256_update(kvb_sha256_t *s, const void *data, size_t len) {
    const uint8_t *p = (const uint8_t *)data;
    s->nbytes += len;
    if (s->fill) { /* top up the partial block first */
        size_t take = 64 - s->fill < len ? 64 - s->fill : len;
        memcpy(s->buf + s->fill, p, take);
        s->fill += (uint32_t)take;
        p += take;
        len -= take;
        if (s->fill < 64) return;
        compress(s->state, s->buf);
        s->fill = 0;
    }
    for (; len >= 64; p += 64, len -= 64) compress(s->state, p);
    kvb_copy(s->buf, p, len);
    s->fill = (uint32_t)len;
}

void kvb_sha256_final(kvb_sha256_t *s, uint8_t out[32]) {
    uint64_t bits = s->nbytes * 8;
    s->buf[s->fill++] = 0x80;
    if (s->fill > 56) {
        memset(s->buf + s->fill, 0, 64 - s->fill);
        compress(s->state, s->buf);
        s->fill = 0;
    }
    memset(s->buf + s->fill, 0, 56 - s->fill);
    for (int i = 0; i < 8; i++) s->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    compress(s->state, s->buf);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(s->state[i] >> 24);
        out[4 * i + 1] = (uint8_t)(s->state[i] >> 16);
        out[4 * i + 2] = (uint8_t)(s->state[i] >> 8);
        out[4 * i + 3] = (uint8_t)s->state[i];
    }
}

void kvb_sha256(const void *data, size_t len, uint8_t out[32]) {
    kvb_sha256_t s;
    kvb_sha256_init(&s);
    kvb_sha256_update(&s, data, len);
    kvb_sha256_final(&s, out);
}
