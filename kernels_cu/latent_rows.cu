// The step's cache rows in one launch (chapter 04): for each token t, what chapters 03, 04 and 12 do
// in three kernels, with their device functions, so the bits are the same:
//
//   kv[t, :R] = rms_norm(kv[t, :R]) * w             kv_a_layernorm on the latent, in place   (rmsnorm.cuh)
//   kv[t, R:], q[t, head, :] for every head         rotated by the token's position, in place (rope.cuh)
//   cache[slot_mapping[t]] = kv[t]                   the row [latent | k_pe]                  (cache.cu's rule)
//
// kv [T, R + d] is kv_a_proj_with_mqa's output (rows `kv_stride` apart), q the queries viewed at their
// rotary part (rows `q_row_stride` apart, heads `q_head_stride`), cache one layer [num_rows, R + d].
// One block per token. Warp 0 normalises the latent, a row of at most 32 * ROW_VECS vectors, as
// rms_norm's block of 32 threads does (warp_sum is that block's block_sum); the other warps rotate
// the heads + 1 rows of d values (q's heads, then k_pe), one 16-byte vector per thread and step. The
// parts write disjoint memory, so no barrier separates them. A slot < 0 (a graph's padding entry) or
// >= num_rows writes no cache row; a position outside 0..num_positions-1 makes the rotated rows NaN.
// Only 16-byte vectors: the host checks alignment and widths, and takes the three kernels otherwise.
#include "rmsnorm.cuh"  // ROW_VECS, load_weight_vecs, load_row_vecs, scale_cached_row
#include "rope.cuh"     // rotate_vec

template <typename T>
__global__ void latent_rows(T* __restrict__ kv, long long kv_stride, const T* __restrict__ w, int latent_dim, float eps,
                            T* __restrict__ q, long long q_row_stride, long long q_head_stride, int heads, int rope_dim,
                            const long long* __restrict__ positions, const float* __restrict__ cos_sin,
                            long long num_positions, T* __restrict__ cache, long long cache_stride,
                            const long long* __restrict__ slot_mapping, long long num_rows) {
    wait_for_prior_grids();
    constexpr int N = Vec16<T>::N;
    const long long t = blockIdx.x;
    T* row = kv + t * kv_stride;
    const long long slot = slot_mapping[t];
    T* dst = slot >= 0 && slot < num_rows ? cache + slot * cache_stride : nullptr;
    if (threadIdx.x < 32) {  // warp 0: the latent
        const int lane = threadIdx.x, nvec = latent_dim / N;
        Vec16<T> v[ROW_VECS], g[ROW_VECS];
        load_weight_vecs(g, w, nvec, lane, 32);
        const float inv_rms = rsqrtf(warp_sum(load_row_vecs(v, row, nvec, lane, 32)) / latent_dim + eps);
        scale_cached_row(row, v, g, nvec, inv_rms, lane, 32);
        if (dst) scale_cached_row(dst, v, g, nvec, inv_rms, lane, 32);
        return;
    }
    const long long pos = positions[t];
    const bool valid = pos >= 0 && pos < num_positions;
    const float* cs = cos_sin + (valid ? pos : 0) * rope_dim;  // row 0 is never read for an invalid position
    const int per_row = rope_dim / N, items = (heads + 1) * per_row;
    for (int i = threadIdx.x - 32; i < items; i += blockDim.x - 32) {
        const int r = i / per_row, j = i % per_row;  // row r < heads: query head r; row `heads`: k_pe
        T* p = r < heads ? q + t * q_row_stride + r * q_head_stride + j * N : row + latent_dim + j * N;
        Vec16<T> x = load16(p);
        rotate_vec(x, j * N, cs, rope_dim / 2, valid);
        store16(p, x);
        if (r == heads && dst) store16(dst + latent_dim + j * N, x);
    }
}
