/* internal.h -- helpers shared between the core's C files; not part of the public API. */
#ifndef KVBLOCKS_INTERNAL_H
#define KVBLOCKS_INTERNAL_H

#include <string.h>

#include "kvblocks.h"

/* memcpy that accepts NULL pointers when n is 0 (memcpy itself does not: C11 7.24.1). */
KVB_INLINE void kvb_copy(void *dst, const void *src, size_t n) {
    if (n) memcpy(dst, src, n);
}

/* pool.c */
void kvb_pool_unlink(kvb_pool_t *p, int32_t b);   /* take a free block out of the list */
void kvb_pool_release(kvb_pool_t *p, int32_t b);  /* drop one (validated) reference */
void kvb_pool_move_to_head(kvb_pool_t *p, int32_t b); /* relink a free block at the head */
void kvb_pool_record(kvb_pool_t *p, int kind, int32_t b, const kvb_hash_t *h,
                     const kvb_hash_t *parent, const int32_t *tokens, int32_t ntok);
int kvb_grow(void **ptr, int64_t *cap, int64_t need, size_t elem);

/* cache.c */
int64_t kvb_cache_match(const kvb_pool_t *p, const kvb_hash_t *hashes, int64_t n,
                        int32_t *out);            /* kvb_cache_lookup without stats */
void kvb_cache_evict(kvb_pool_t *p, int32_t b);   /* drop the entry of a block being reused */
void kvb_cache_pin(kvb_pool_t *p, const int32_t *ids, int64_t n); /* +1 ref to cached hits */
int kvb_cache_put(kvb_pool_t *p, int32_t b, const kvb_hash_t *h, const kvb_hash_t *parent,
                  const int32_t *tokens, int32_t block_size); /* 1 stored, 0 hash present */

#endif
