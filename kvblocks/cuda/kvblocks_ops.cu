// kvblocks device block operations (compiled at first use by NVRTC through cupy.RawModule).
//
// Design. Every cache is one buffer seen as bytes [planes][num_blocks][block_bytes]: a plane is
// one layer (K and V joint) or one of K / V of one layer (split). Block copies move whole rows of
// that view: one thread block per (pair, plane, chunk), so one launch covers every pair of every
// layer. Token kernels (write_slots, gather) move rows of head_dim elements: one thread block per
// token, threads over (head, word). Host code picks the widest word type T (16, 8, 4, 2 or 1
// bytes) that divides every size, stride and pointer involved, so loads and stores are aligned
// 128-bit accesses in the common case (head_dim * itemsize % 16 == 0).
//
// Invariants the host side guarantees before launching (kvblocks/ops.py validates first):
//   * every index is in range; a destination appears once; in copy_blocks no destination is
//     also a source, so src and dst rows never overlap and __restrict__ holds;
//   * all byte sizes, strides and base pointers are multiples of sizeof(T);
//   * slot -1 means "skip this token" (padding).
// No kernel allocates, prints or traps. All offsets are 64-bit.

typedef long long i64;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- block copies --------------------------------------------------------------------------
// grid (num_pairs, num_planes, chunks); pairs is int64 [num_pairs][2] = (src block, dst block).
// No __restrict__ here: the copy kernels below add it to their parameters (read-only cache
// loads for device memory), the swap kernels do not (their source may be mapped pinned host
// memory, read with plain global loads).
template <typename T>
__device__ __forceinline__ void copy_blocks_impl(const char* src,
                                                 char* dst,
                                                 const i64* pairs,
                                                 i64 src_plane_stride,  // bytes between planes of src
                                                 i64 dst_plane_stride,  // bytes between planes of dst
                                                 i64 block_bytes)       // bytes of one block in one plane
{
    const i64 pair = blockIdx.x;
    const i64 plane = blockIdx.y;
    const i64 s = pairs[2 * pair];
    const i64 d = pairs[2 * pair + 1];
    const i64 words = block_bytes / (i64)sizeof(T);
    const i64 per_chunk = (words + gridDim.z - 1) / gridDim.z;
    const i64 begin = (i64)blockIdx.z * per_chunk;
    i64 end = begin + per_chunk;
    if (end > words) end = words;
    const T* sp = reinterpret_cast<const T*>(src + plane * src_plane_stride + s * block_bytes);
    T* dp = reinterpret_cast<T*>(dst + plane * dst_plane_stride + d * block_bytes);
    for (i64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
        dp[i] = sp[i];
    }
}

#define KVB_COPY_BLOCKS(NAME, T, RESTRICT)                                                  \
    extern "C" __global__ void NAME(const char* RESTRICT src, char* RESTRICT dst,               \
                                    const i64* RESTRICT pairs, i64 src_plane_stride,            \
                                    i64 dst_plane_stride, i64 block_bytes)                      \
    {                                                                                           \
        copy_blocks_impl<T>(src, dst, pairs, src_plane_stride, dst_plane_stride, block_bytes);  \
    }

// copy_blocks: within one device cache (src and dst rows disjoint, validated on the host)
KVB_COPY_BLOCKS(kvb_copy_blocks_16, uint4, __restrict__)
KVB_COPY_BLOCKS(kvb_copy_blocks_8, u64, __restrict__)
KVB_COPY_BLOCKS(kvb_copy_blocks_4, u32, __restrict__)
KVB_COPY_BLOCKS(kvb_copy_blocks_2, u16, __restrict__)
KVB_COPY_BLOCKS(kvb_copy_blocks_1, u8, __restrict__)
// swap_blocks (zero-copy): between caches, either side may be pinned host memory mapped into
// the device address space (UVA); PCIe-bound, so plain loads lose nothing
#define KVB_NO_RESTRICT
KVB_COPY_BLOCKS(kvb_swap_blocks_16, uint4, KVB_NO_RESTRICT)
KVB_COPY_BLOCKS(kvb_swap_blocks_8, u64, KVB_NO_RESTRICT)
KVB_COPY_BLOCKS(kvb_swap_blocks_4, u32, KVB_NO_RESTRICT)
KVB_COPY_BLOCKS(kvb_swap_blocks_2, u16, KVB_NO_RESTRICT)
KVB_COPY_BLOCKS(kvb_swap_blocks_1, u8, KVB_NO_RESTRICT)

// ---- token rows -----------------------------------------------------------------------------
// Geometry of one layer's K (or V) inside the cache, in bytes:
//   row_bytes    = head_dim * itemsize            (one head of one token, contiguous)
//   block_stride = bytes between consecutive blocks
//   token_stride = bytes between consecutive tokens of a block  (NHD: H*row, HND: row)
//   head_stride  = bytes between consecutive heads of a token   (NHD: row,   HND: bs*row)
// The token-side arrays (k, v inputs of write_slots; outputs of gather) are contiguous
// [num_tokens][num_heads][head_dim].

// write_slots: grid (num_tokens); cache[slot] <- k[t], v[t]; slot < 0 skipped.
template <typename T>
__device__ __forceinline__ void write_slots_impl(const char* __restrict__ k, const char* __restrict__ v,
                                                 char* __restrict__ k_cache, char* __restrict__ v_cache,
                                                 const i64* __restrict__ slots, i64 block_size,
                                                 i64 num_heads, i64 row_bytes, i64 block_stride,
                                                 i64 token_stride, i64 head_stride)
{
    const i64 t = blockIdx.x;
    const i64 slot = slots[t];
    if (slot < 0) return;
    const i64 blk = slot / block_size;
    const i64 off = slot - blk * block_size;
    const i64 words = row_bytes / (i64)sizeof(T);
    const i64 total = num_heads * words;
    const i64 head_words = head_stride / (i64)sizeof(T);
    const T* ks = reinterpret_cast<const T*>(k + t * num_heads * row_bytes);
    const T* vs = reinterpret_cast<const T*>(v + t * num_heads * row_bytes);
    const i64 base = blk * block_stride + off * token_stride;
    T* kd = reinterpret_cast<T*>(k_cache + base);
    T* vd = reinterpret_cast<T*>(v_cache + base);
    for (i64 i = threadIdx.x; i < total; i += blockDim.x) {
        const i64 h = i / words;
        const i64 w = i - h * words;
        const i64 o = h * head_words + w;
        kd[o] = ks[i];
        vd[o] = vs[i];
    }
}

// gather: grid (num_tokens); k_out[t], v_out[t] <- cache[block_table[t / bs], t % bs].
template <typename T>
__device__ __forceinline__ void gather_impl(const char* __restrict__ k_cache, const char* __restrict__ v_cache,
                                            char* __restrict__ k_out, char* __restrict__ v_out,
                                            const i64* __restrict__ block_table, i64 block_size,
                                            i64 num_heads, i64 row_bytes, i64 block_stride,
                                            i64 token_stride, i64 head_stride)
{
    const i64 t = blockIdx.x;
    const i64 blk = block_table[t / block_size];
    const i64 off = t - (t / block_size) * block_size;
    const i64 words = row_bytes / (i64)sizeof(T);
    const i64 total = num_heads * words;
    const i64 head_words = head_stride / (i64)sizeof(T);
    const i64 base = blk * block_stride + off * token_stride;
    const T* ks = reinterpret_cast<const T*>(k_cache + base);
    const T* vs = reinterpret_cast<const T*>(v_cache + base);
    T* kd = reinterpret_cast<T*>(k_out + t * num_heads * row_bytes);
    T* vd = reinterpret_cast<T*>(v_out + t * num_heads * row_bytes);
    for (i64 i = threadIdx.x; i < total; i += blockDim.x) {
        const i64 h = i / words;
        const i64 w = i - h * words;
        const i64 o = h * head_words + w;
        kd[i] = ks[o];
        vd[i] = vs[o];
    }
}

#define KVB_TOKEN_KERNELS(SUFFIX, T)                                                              \
    extern "C" __global__ void kvb_write_slots_##SUFFIX(                                          \
        const char* __restrict__ k, const char* __restrict__ v, char* __restrict__ k_cache,      \
        char* __restrict__ v_cache, const i64* __restrict__ slots, i64 block_size, i64 num_heads, \
        i64 row_bytes, i64 block_stride, i64 token_stride, i64 head_stride)                      \
    {                                                                                             \
        write_slots_impl<T>(k, v, k_cache, v_cache, slots, block_size, num_heads, row_bytes,     \
                            block_stride, token_stride, head_stride);                            \
    }                                                                                             \
    extern "C" __global__ void kvb_gather_##SUFFIX(                                               \
        const char* __restrict__ k_cache, const char* __restrict__ v_cache, char* __restrict__ k_out, \
        char* __restrict__ v_out, const i64* __restrict__ block_table, i64 block_size,           \
        i64 num_heads, i64 row_bytes, i64 block_stride, i64 token_stride, i64 head_stride)       \
    {                                                                                             \
        gather_impl<T>(k_cache, v_cache, k_out, v_out, block_table, block_size, num_heads,       \
                       row_bytes, block_stride, token_stride, head_stride);                      \
    }

KVB_TOKEN_KERNELS(16, uint4)
KVB_TOKEN_KERNELS(8, u64)
KVB_TOKEN_KERNELS(4, u32)
KVB_TOKEN_KERNELS(2, u16)
KVB_TOKEN_KERNELS(1, u8)
