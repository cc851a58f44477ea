// Prefill attention as chapter 06 teaches it, never on the engine's path: version 1, one thread per
// (query, head). The lesson's other tensor-core configurations are instantiations of the template in
// attention_prefill.cuh (dsv2_lib/lessons/attention_prefill.py declares them). Shapes, strides and the
// softmax's base-2 arithmetic: the header's opening comment.
#include "attention_prefill.cuh"

// Sequence of packed query token t: the b with cu_q[b] <= t < cu_q[b+1] (binary search; B >= 1).
__device__ __forceinline__ int sequence_of(const int* cu_q, int B, int t) {
    int lo = 0, hi = B - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (cu_q[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// ================================================================================================
// Version 1: one thread per (query, head). Thread g = blockIdx.x * blockDim.x + threadIdx.x takes
// query token t = g / h and head hd = g % h. Pass 1 finds the row maximum m of the scores; pass 2
// recomputes each score, adds p = exp(s - m) to the sum l and p * v to 128 accumulators. Every
// thread reads all its keys and values from global memory: the key in both passes and the value once,
// (2 * 192 + 128) * 2 bytes per key for 2 * 320 FLOPs; no reuse at all between the 16 heads' or the
// neighbouring queries' threads.
// ================================================================================================
template <typename T>
__global__ void attention_prefill_naive(
    T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_nope, const T* __restrict__ k_pe,
    const T* __restrict__ v, const int* __restrict__ cu_q, const int* __restrict__ cu_k, int B, int Tq, int h,
    long long sq_t, long long sq_h, long long sk_t, long long sk_h, long long spe_t, long long sv_t, long long sv_h,
    float scale_log2) {
    const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= (long long)Tq * h) return;
    const int t = (int)(g / h), hd = (int)(g % h);
    const int b = sequence_of(cu_q, B, t);
    const int nq = cu_q[b + 1] - cu_q[b], nk = cu_k[b + 1] - cu_k[b];
    const int pos = nk - nq + (t - cu_q[b]);  // this query's position = the last key it sees
    const T* qr = q + t * sq_t + hd * sq_h;
    const long long k0 = cu_k[b];

    float m = minus_inf();
    for (int j = 0; j <= pos; ++j) {
        float s = 0.f;
        for (int d = 0; d < D_QK; ++d) s += to_float(qr[d]) * key_at(k_nope, k_pe, k0 + j, hd, d, sk_t, sk_h, spe_t);
        m = fmaxf(m, s * scale_log2);
    }
    float acc[D_V];
#pragma unroll
    for (int d = 0; d < D_V; ++d) acc[d] = 0.f;
    float l = 0.f;
    for (int j = 0; j <= pos; ++j) {
        float s = 0.f;
        for (int d = 0; d < D_QK; ++d) s += to_float(qr[d]) * key_at(k_nope, k_pe, k0 + j, hd, d, sk_t, sk_h, spe_t);
        const float p = exp2f(s * scale_log2 - m);
        l += p;
        const T* vr = v + (k0 + j) * sv_t + hd * sv_h;
#pragma unroll
        for (int d = 0; d < D_V; ++d) acc[d] += p * to_float(vr[d]);
    }
    T* o = out + g * D_V;
#pragma unroll
    for (int d = 0; d < D_V; ++d) o[d] = from_float<T>(acc[d] / l);
}
