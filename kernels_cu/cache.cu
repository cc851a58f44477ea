// Cache write (chapter 12): scatter this step's new cache rows into one layer of the paged cache.
//
//   cache[slot_mapping[t], :] = rows[t, :]     rows [T, D] (rows `row_stride` apart), cache [R, D]
//                                              (rows `cache_stride` apart), slot_mapping [T] int64
//
// One warp per token (WARPS tokens per block, grid = ceil(T / WARPS)): the 32 lanes copy the row
// together, lane i taking chunks i, i + 32, ... — a coalesced read of the row and a coalesced
// write of the cache row. Two variants:
//   VEC = true  : chunks of 16 bytes (8 bf16/fp16 or 4 fp32 values per load and store). The host
//                 picks it only when D and both row strides are whole 16-byte vectors and both
//                 pointers are 16-byte aligned.
//   VEC = false : one element per chunk; any D, stride and alignment.
// A slot < 0 (-1: a CUDA graph's padding entry, which has no row to keep) is skipped; a slot >= num_rows, which
// the host refuses before the launch when it knows the slots, is skipped too: the kernel never
// writes outside the cache. No synchronisation and no host read: a CUDA graph can capture it.
#include "common.cuh"

namespace cache_write {
constexpr int WARPS = DSV2_CACHE_WRITE_WARPS;  // tokens per block (set in dsv2_lib/ops/cache_write.py)
}

template <typename T, bool VEC>
__global__ void __launch_bounds__(cache_write::WARPS * 32) write_cache_rows(
    T* __restrict__ cache, const T* __restrict__ rows, const long long* __restrict__ slot_mapping,
    int num_tokens, int dim, long long row_stride, long long cache_stride, long long num_rows) {
    wait_for_prior_grids();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const long long t = (long long)blockIdx.x * cache_write::WARPS + warp;
    if (t >= num_tokens) return;
    const long long slot = slot_mapping[t];
    if (slot < 0 || slot >= num_rows) return;  // warp-uniform: the whole warp leaves together
    const T* src = rows + t * row_stride;
    T* dst = cache + slot * cache_stride;
    if constexpr (VEC) {
        constexpr int N = Vec16<T>::N;
        const int nvec = dim / N;
        for (int i = lane; i < nvec; i += 32) store16(dst + i * N, load16(src + i * N));
    } else {
        for (int i = lane; i < dim; i += 32) dst[i] = src[i];
    }
}
