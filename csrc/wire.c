/* wire.c -- a pool's event log written straight to vLLM's msgpack KVEventBatch.
 *
 * The bytes are those msgspec writes for vLLM 0.34's structs (vllm/distributed/kv_events.py),
 * the same as kvblocks.events.encode_batch(pool.take_events(), ...): the batch
 * [ts float64, events, data_parallel_rank], each event in map form (vLLM >= 0.24: the tag,
 * then the fields in declaration order, those with a default omitted when None; BlockStored
 * has map16 `de 00 nn`, the others fixmap) or array form (0.22/0.23: every field). Scalars take
 * msgpack's smallest form, as msgspec's do.
 *
 * Events are grouped exactly as take_events groups them: a stored block whose parent is the
 * previous stored block's hash (same group, tag and tokens-per-block) extends that event;
 * consecutive removals of one group are one event. A stored block's extra keys are vLLM's
 * untagged event keys (to_event_extra_keys): nil without adapter or salt, else
 * (lora_name, salt) with the salt on a chain's first block only (parent nil).
 *
 * The writer reads the log and never changes it: the caller clears the log once the bytes
 * are taken (all-or-nothing: an event vLLM's consumers cannot take, a stored block without
 * tokens, fails the whole batch and leaves the log as it was).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

KVB_NOINLINE static int buf_grow(kvb_buf_t *b, size_t more) {
    int64_t cap = (int64_t)b->cap;
    if (more > (size_t)INT64_MAX - b->len) return KVB_ENOMEM;
    if (kvb_grow((void **)&b->data, &cap, (int64_t)(b->len + more), 1)) return KVB_ENOMEM;
    b->cap = (size_t)cap;
    return KVB_OK;
}

/* Room for `more` bytes; the writers below assume it was made. */
KVB_INLINE int buf_need(kvb_buf_t *b, size_t more) {
    return KVB_LIKELY(b->cap - b->len >= more) ? KVB_OK : buf_grow(b, more);
}

KVB_INLINE uint8_t *put_be(uint8_t *o, uint64_t v, int n) { /* n bytes, big-endian */
    for (int i = n - 1; i >= 0; i--) { o[i] = (uint8_t)v; v >>= 8; }
    return o + n;
}

/* Integers, msgspec's choice of form: fixint, cc cd ce cf for v >= 0; fixneg, d0 d1 d2 d3. */
KVB_INLINE uint8_t *put_uint(uint8_t *o, uint64_t v) {
    if (v < 128) { *o++ = (uint8_t)v; return o; }
    if (v <= 0xff) { *o++ = 0xcc; return put_be(o, v, 1); }
    if (v <= 0xffff) { *o++ = 0xcd; return put_be(o, v, 2); }
    if (v <= 0xffffffffu) { *o++ = 0xce; return put_be(o, v, 4); }
    *o++ = 0xcf;
    return put_be(o, v, 8);
}

KVB_INLINE uint8_t *put_int(uint8_t *o, int64_t v) {
    if (v >= 0) return put_uint(o, (uint64_t)v);
    if (v >= -32) { *o++ = (uint8_t)(0xe0 | (v + 32)); return o; }
    if (v >= INT8_MIN) { *o++ = 0xd0; return put_be(o, (uint64_t)v, 1); }
    if (v >= INT16_MIN) { *o++ = 0xd1; return put_be(o, (uint64_t)v, 2); }
    if (v >= INT32_MIN) { *o++ = 0xd2; return put_be(o, (uint64_t)v, 4); }
    *o++ = 0xd3;
    return put_be(o, (uint64_t)v, 8);
}

KVB_INLINE uint8_t *put_array(uint8_t *o, uint64_t n) { /* header of n elements */
    if (n < 16) { *o++ = (uint8_t)(0x90 | n); return o; }
    if (n <= 0xffff) { *o++ = 0xdc; return put_be(o, n, 2); }
    *o++ = 0xdd;
    return put_be(o, n, 4);
}

/* A string (raw bytes under a str or bin header); NULL is nil. At most 5 + n bytes. */
static uint8_t *put_str(uint8_t *o, const uint8_t *s, size_t n, int bin) {
    if (!s) { *o++ = 0xc0; return o; }
    if (bin) {
        if (n <= 0xff) { *o++ = 0xc4; o = put_be(o, n, 1); }
        else if (n <= 0xffff) { *o++ = 0xc5; o = put_be(o, n, 2); }
        else { *o++ = 0xc6; o = put_be(o, n, 4); }
    } else if (n < 32) {
        *o++ = (uint8_t)(0xa0 | n);
    } else if (n <= 0xff) {
        *o++ = 0xd9; o = put_be(o, n, 1);
    } else if (n <= 0xffff) {
        *o++ = 0xda; o = put_be(o, n, 2);
    } else {
        *o++ = 0xdb; o = put_be(o, n, 4);
    }
    kvb_copy(o, s, n);
    return o + n;
}

#define KEY(o, lit) (memcpy((o), (lit), sizeof(lit) - 1), (o) + sizeof(lit) - 1)

/* a field name as msgpack fixstr, its bytes a literal */
#define K_TYPE "\xa4type"
#define K_HASHES "\xac" "block_hashes"
#define K_PARENT "\xb1" "parent_block_hash"
#define K_TOKENS "\xa9" "token_ids"
#define K_BS "\xaa" "block_size"
#define K_LORA_ID "\xa7" "lora_id"
#define K_MEDIUM "\xa6" "medium"
#define K_LORA_NAME "\xa9" "lora_name"
#define K_EXTRA "\xaa" "extra_keys"
#define K_GROUP "\xa9" "group_idx"
#define K_KIND "\xb2" "kv_cache_spec_kind"
#define K_WINDOW "\xbc" "kv_cache_spec_sliding_window"
#define T_STORED "\xab" "BlockStored"
#define T_REMOVED "\xac" "BlockRemoved"
#define T_CLEARED "\xb0" "AllBlocksCleared"

KVB_INLINE uint8_t *put_hash(uint8_t *o, const kvb_hash_t *h, int hash_signed) {
    return hash_signed ? put_int(o, (int64_t)h->lo) : put_uint(o, h->lo); /* the fold */
}

/* Bytes one extra-keys entry takes: nil, or an array of the adapter name and the salt. */
static size_t extra_len(const kvb_wire_tag_t *t, int first) {
    int n = (t->lora_name != NULL) + (first && t->salt != NULL);
    if (!n) return 1;
    return 1 + (t->lora_name ? 5 + (size_t)t->lora_name_len : 0) +
           (first && t->salt ? 5 + (size_t)t->salt_len : 0);
}

static uint8_t *put_extra(uint8_t *o, const kvb_wire_tag_t *t, int first) {
    int n = (t->lora_name != NULL) + (first && t->salt != NULL);
    if (!n) { *o++ = 0xc0; return o; }
    *o++ = (uint8_t)(0x90 | n);
    if (t->lora_name) o = put_str(o, t->lora_name, (size_t)t->lora_name_len, 0);
    if (first && t->salt) o = put_str(o, t->salt, (size_t)t->salt_len, t->salt_bin);
    return o;
}

/* One BlockStored of the run of stored events [i, j), ntok tokens per block. */
static int put_stored(kvb_buf_t *b, const kvb_events_t *ev, const kvb_wire_opts_t *w, int64_t i,
                      int64_t j, int64_t ntok) {
    int64_t n = j - i;
    const kvb_wire_tag_t *t = &w->tags[ev->tag[i]];
    const kvb_wire_group_t *g = &w->groups[ev->group[i]];
    int first = !(ev->parent[i].lo | ev->parent[i].hi);
    /* field names 163 bytes, headers and scalars under 100, then what varies */
    size_t need = 320 + (size_t)n * 9 + (size_t)(n * ntok) * 5 + (size_t)w->medium_len +
                  (t->lora_name ? (size_t)t->lora_name_len : 0) + extra_len(t, first) +
                  (size_t)(n - 1) * extra_len(t, 0) + (g->kind ? (size_t)g->kind_len : 0);
    if (buf_need(b, need)) return KVB_ENOMEM;
    uint8_t *o = b->data + b->len;
    int arr = w->fmt == KVB_WIRE_ARRAY;
    if (arr) {
        o = put_array(o, 12);
        o = KEY(o, T_STORED);
    } else { /* 15 declared fields + the tag: map16 with the count of those present */
        int nf = 10 + (g->kind != NULL) + g->has_window;
        *o++ = 0xde; *o++ = 0; *o++ = (uint8_t)nf;
        o = KEY(o, K_TYPE);
        o = KEY(o, T_STORED);
        o = KEY(o, K_HASHES);
    }
    o = put_array(o, (uint64_t)n);
    for (int64_t k = i; k < j; k++) o = put_hash(o, &ev->hash[k], w->hash_signed);
    if (!arr) o = KEY(o, K_PARENT);
    if (first) *o++ = 0xc0;
    else o = put_hash(o, &ev->parent[i], w->hash_signed);
    if (!arr) o = KEY(o, K_TOKENS);
    o = put_array(o, (uint64_t)(n * ntok));
    const int32_t *tok = ev->tokens + ev->tok_off[i]; /* the run's tokens are contiguous */
    for (int64_t k = 0; k < n * ntok; k++) o = put_int(o, tok[k]);
    if (!arr) o = KEY(o, K_BS);
    o = put_uint(o, (uint64_t)ntok);
    if (!arr) o = KEY(o, K_LORA_ID);
    if (t->has_lora_id) o = put_int(o, t->lora_id);
    else *o++ = 0xc0;
    if (!arr) o = KEY(o, K_MEDIUM);
    o = put_str(o, w->medium, (size_t)w->medium_len, 0);
    if (!arr) o = KEY(o, K_LORA_NAME);
    o = put_str(o, t->lora_name, (size_t)t->lora_name_len, 0);
    if (!arr) o = KEY(o, K_EXTRA);
    o = put_array(o, (uint64_t)n);
    o = put_extra(o, t, first);
    for (int64_t k = 1; k < n; k++) o = put_extra(o, t, 0);
    if (!arr) o = KEY(o, K_GROUP);
    o = put_uint(o, ev->group[i]);
    if (arr || g->kind) {
        if (!arr) o = KEY(o, K_KIND);
        o = put_str(o, g->kind, (size_t)g->kind_len, 0);
    }
    if (arr || g->has_window) {
        if (!arr) o = KEY(o, K_WINDOW);
        if (g->has_window) o = put_int(o, g->window);
        else *o++ = 0xc0;
    }
    b->len = (size_t)(o - b->data);
    return KVB_OK;
}

static int put_removed(kvb_buf_t *b, const kvb_events_t *ev, const kvb_wire_opts_t *w,
                       int64_t i, int64_t j) {
    if (buf_need(b, 96 + (size_t)(j - i) * 9 + (size_t)w->medium_len)) return KVB_ENOMEM;
    uint8_t *o = b->data + b->len;
    int arr = w->fmt == KVB_WIRE_ARRAY;
    if (arr) {
        o = put_array(o, 4);
        o = KEY(o, T_REMOVED);
    } else {
        *o++ = 0x84;
        o = KEY(o, K_TYPE);
        o = KEY(o, T_REMOVED);
        o = KEY(o, K_HASHES);
    }
    o = put_array(o, (uint64_t)(j - i));
    for (int64_t k = i; k < j; k++) o = put_hash(o, &ev->hash[k], w->hash_signed);
    if (!arr) o = KEY(o, K_MEDIUM);
    o = put_str(o, w->medium, (size_t)w->medium_len, 0);
    if (!arr) o = KEY(o, K_GROUP);
    o = put_uint(o, ev->group[i]);
    b->len = (size_t)(o - b->data);
    return KVB_OK;
}

/* Tokens of stored event i: up to the next event that has tokens (the log appends them in
 * order), or -1 when it was recorded without. */
KVB_INLINE int64_t ntok_of(const kvb_events_t *ev, int64_t i, const int64_t *next_off) {
    return ev->tok_off[i] < 0 ? -1 : next_off[i] - ev->tok_off[i];
}

/* Settings of record i: a merged log's host records take the host pool's tables. */
KVB_INLINE const kvb_wire_opts_t *opts_of(const kvb_wire_opts_t *w, const kvb_wire_opts_t *alt,
                                          int64_t i) {
    return w->src && w->src[i] ? alt : w;
}

int kvb_events_encode(const kvb_events_t *ev, const kvb_wire_opts_t *w, kvb_buf_t *out,
                      int64_t *bad) {
    int64_t n = ev->n;
    out->len = 0;
    *bad = -1;
    kvb_wire_opts_t alt = w->alt ? *w->alt : *w; /* the batch's own format for both sources */
    alt.fmt = w->fmt;
    alt.hash_signed = w->hash_signed;
    for (int64_t i = 0; i < n; i++) { /* validate first: tags, groups, tokens */
        if (ev->kind[i] != KVB_EV_STORED) continue;
        const kvb_wire_opts_t *wi = opts_of(w, &alt, i);
        if (ev->tok_off[i] < 0 || ev->tag[i] < 0 || ev->tag[i] >= wi->ntags ||
            ev->group[i] >= wi->ngroups) {
            *bad = i;
            return KVB_EINVAL;
        }
    }
    int64_t *next_off = malloc((size_t)(n ? n : 1) * sizeof *next_off);
    if (!next_off) return KVB_ENOMEM;
    int64_t end = ev->ntok;
    for (int64_t i = n - 1; i >= 0; i--) {
        next_off[i] = end;
        if (ev->tok_off[i] >= 0) end = ev->tok_off[i];
    }
    int rc = buf_need(out, 16 + 5);
    if (rc) goto done;
    uint8_t *o = out->data;
    *o++ = 0x93;
    *o++ = 0xcb;
    uint64_t ts;
    memcpy(&ts, &w->ts, sizeof ts);
    o = put_be(o, ts, 8);
    size_t hdr = (size_t)(o - out->data); /* the events' array header goes here */
    out->len = hdr + 5;                   /* room for its widest form, moved up at the end */
    int64_t nevents = 0;
    for (int64_t i = 0, j; i < n; i = j, nevents++) {
        j = i + 1;
        const kvb_wire_opts_t *wi = opts_of(w, &alt, i);
        if (ev->kind[i] == KVB_EV_STORED) {
            int64_t nt = ntok_of(ev, i, next_off);
            while (j < n && ev->kind[j] == KVB_EV_STORED && ev->parent[j].lo == ev->hash[j - 1].lo &&
                   ev->parent[j].hi == ev->hash[j - 1].hi && (ev->hash[j - 1].lo | ev->hash[j - 1].hi) &&
                   ev->group[j] == ev->group[i] && ev->tag[j] == ev->tag[i] &&
                   ntok_of(ev, j, next_off) == nt && opts_of(w, &alt, j) == wi)
                j++;
            rc = put_stored(out, ev, wi, i, j, nt);
        } else if (ev->kind[i] == KVB_EV_REMOVED) {
            while (j < n && ev->kind[j] == KVB_EV_REMOVED && ev->group[j] == ev->group[i] &&
                   opts_of(w, &alt, j) == wi)
                j++;
            rc = put_removed(out, ev, wi, i, j);
        } else {
            rc = buf_need(out, 24);
            if (!rc) {
                uint8_t *p = out->data + out->len;
                if (w->fmt == KVB_WIRE_ARRAY) *p++ = 0x91;
                else { *p++ = 0x81; p = KEY(p, K_TYPE); }
                p = KEY(p, T_CLEARED);
                out->len = (size_t)(p - out->data);
            }
        }
        if (rc) goto done;
    }
    rc = buf_need(out, 9);
    if (rc) goto done;
    o = out->data + out->len;
    if (w->has_dp) o = put_int(o, w->dp);
    else *o++ = 0xc0;
    out->len = (size_t)(o - out->data);
    uint8_t h[5];
    size_t hl = (size_t)(put_array(h, (uint64_t)nevents) - h);
    memmove(out->data + hdr + hl, out->data + hdr + 5, out->len - hdr - 5);
    memcpy(out->data + hdr, h, hl);
    out->len -= 5 - hl;
done:
    free(next_off);
    return rc;
}

void kvb_buf_free(kvb_buf_t *b) {
    free(b->data);
    memset(b, 0, sizeof *b);
}
