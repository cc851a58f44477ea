// RMSNorm's register-cached row (the VEC variants of rmsnorm.cu, and latent_rows.cu): thread `tid` of
// the `threads` that share a row holds its 16-byte vectors tid, tid + threads, ... (at most ROW_VECS
// of them) in registers, between the reduction and the write. Each thread sums its squares in vector
// order, so a row's total depends only on `threads` (and the reduction over them).
#pragma once
#include "common.cuh"

constexpr int ROW_VECS = DSV2_RMSNORM_ROW_VECS;  // 16-byte vectors per thread in the VEC variant (set in norm.py)

// g[k] = this thread's vectors of the weight w, loaded before the row's reduction so that their
// latency overlaps it instead of following it.
template <typename T>
__device__ __forceinline__ void load_weight_vecs(Vec16<T> (&g)[ROW_VECS], const T* __restrict__ w, int nvec, int tid,
                                                 int threads) {
    constexpr int N = Vec16<T>::N;
#pragma unroll
    for (int k = 0; k < ROW_VECS; ++k) {
        const int i = tid + k * threads;
        if (i < nvec) g[k] = load16(w + i * N);
    }
}

// v[k] = this thread's vectors of the row; returns the sum of their squares, in fp32.
template <typename T>
__device__ __forceinline__ float load_row_vecs(Vec16<T> (&v)[ROW_VECS], const T* row, int nvec, int tid, int threads) {
    constexpr int N = Vec16<T>::N;
    float acc = 0.f;
#pragma unroll
    for (int k = 0; k < ROW_VECS; ++k) {
        const int i = tid + k * threads;
        if (i < nvec) {
            v[k] = load16(row + i * N);
#pragma unroll
            for (int j = 0; j < N; ++j) { float f = to_float(v[k].v[j]); acc += f * f; }
        }
    }
    return acc;
}

// dst[i] = round_T(v * inv_rms) * g for the vectors this thread holds in registers.
template <typename T>
__device__ __forceinline__ void scale_cached_row(T* dst, const Vec16<T> (&v)[ROW_VECS], const Vec16<T> (&g)[ROW_VECS],
                                                 int nvec, float inv_rms, int tid, int threads) {
    constexpr int N = Vec16<T>::N;
#pragma unroll
    for (int k = 0; k < ROW_VECS; ++k) {
        const int i = tid + k * threads;
        if (i < nvec) {
            Vec16<T> o;
#pragma unroll
            for (int j = 0; j < N; ++j) o.v[j] = from_float<T>(round_to<T>(to_float(v[k].v[j]) * inv_rms) * to_float(g[k].v[j]));
            store16(dst + i * N, o);
        }
    }
}
