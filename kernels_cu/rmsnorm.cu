// RMSNorm, and RMSNorm fused with the residual add that precedes it.
//
//   y = round_T(x * rsqrt(mean(x^2) + eps)) * w         (rounding as transformers does it)
//
// One block per row, fp32 arithmetic throughout, the sum of squares reduced across the block with
// warp shuffles (block_sum in common.cuh). Two variants:
//   VEC = true  : the row is read once, in 16-byte vectors (8 bf16 values per load), and each
//                 thread keeps its up to ROW_VECS vectors in registers between the reduction and
//                 the write. The host picks blockDim so that blockDim * ROW_VECS covers the row.
//   VEC = false : any dim and alignment; one element at a time, the row read twice (the second
//                 time from cache).
#include "rmsnorm.cuh"  // ROW_VECS and the register-cached row: load_weight_vecs, load_row_vecs, scale_cached_row

// out[r] = rms_norm(x[r]) for r < gridDim.x; rows are `stride` elements apart in x, `out_stride` in out.
// out may be x itself (in place), so the two are not __restrict__: each thread reads its elements of
// a row (into registers, or in the first pass) before the block's reduction, and writes only those.
template <typename T, bool VEC>
__global__ void rms_norm(T* out, const T* x, const T* __restrict__ w, int dim, long long stride,
                         long long out_stride, float eps) {
    wait_for_prior_grids();
    const T* row = x + blockIdx.x * stride;
    T* dst = out + blockIdx.x * out_stride;
    if constexpr (VEC) {
        constexpr int N = Vec16<T>::N;
        const int nvec = dim / N;
        Vec16<T> v[ROW_VECS], g[ROW_VECS];
        load_weight_vecs(g, w, nvec, threadIdx.x, blockDim.x);
        const float acc = load_row_vecs(v, row, nvec, threadIdx.x, blockDim.x);
        scale_cached_row(dst, v, g, nvec, rsqrtf(block_sum(acc) / dim + eps), threadIdx.x, blockDim.x);
    } else {
        float acc = 0.f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) { float f = to_float(row[i]); acc += f * f; }
        const float inv_rms = rsqrtf(block_sum(acc) / dim + eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            dst[i] = from_float<T>(round_to<T>(to_float(row[i]) * inv_rms) * to_float(w[i]));
    }
}

// residual[r] += x[r] (rounded to T, as `residual + x` in PyTorch), then out[r] = rms_norm(residual[r]).
// All three tensors are dense [rows, dim].
template <typename T, bool VEC>
__global__ void fused_add_rms_norm(T* __restrict__ out, T* __restrict__ residual, const T* __restrict__ x,
                                   const T* __restrict__ w, int dim, float eps) {
    wait_for_prior_grids();
    const long long base = (long long)blockIdx.x * dim;
    T* res = residual + base;
    const T* xr = x + base;
    T* dst = out + base;
    if constexpr (VEC) {
        constexpr int N = Vec16<T>::N;
        const int nvec = dim / N;
        Vec16<T> v[ROW_VECS], g[ROW_VECS];
        load_weight_vecs(g, w, nvec, threadIdx.x, blockDim.x);
        float acc = 0.f;
#pragma unroll
        for (int k = 0; k < ROW_VECS; ++k) {
            const int i = threadIdx.x + k * blockDim.x;
            if (i < nvec) {
                Vec16<T> a = load16(res + i * N), b = load16(xr + i * N);
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    a.v[j] = from_float<T>(to_float(a.v[j]) + to_float(b.v[j]));
                    float f = to_float(a.v[j]);
                    acc += f * f;
                }
                store16(res + i * N, a);
                v[k] = a;
            }
        }
        scale_cached_row(dst, v, g, nvec, rsqrtf(block_sum(acc) / dim + eps), threadIdx.x, blockDim.x);
    } else {
        float acc = 0.f;
        for (int i = threadIdx.x; i < dim; i += blockDim.x) {
            const T s = from_float<T>(to_float(res[i]) + to_float(xr[i]));
            res[i] = s;
            const float f = to_float(s);
            acc += f * f;
        }
        // Each thread re-reads only the elements it wrote itself, so no barrier is needed here.
        const float inv_rms = rsqrtf(block_sum(acc) / dim + eps);
        for (int i = threadIdx.x; i < dim; i += blockDim.x)
            dst[i] = from_float<T>(round_to<T>(to_float(res[i]) * inv_rms) * to_float(w[i]));
    }
}
