// RoPE's rotation of interleaved pairs (rope.cu, and latent_rows.cu): (a, b) = (x[2i], x[2i+1]) turns by
// the angle whose cosine and sine are cs[i] and cs[d/2 + i], a row of the fp32 table rope_cos_sin_cache
// builds. Each product and sum is rounded in fp32 with __fmul_rn/__fadd_rn/__fsub_rn, which the
// compiler never contracts into an FMA, so the result matches PyTorch's separate multiplies bit for bit.
#pragma once
#include "common.cuh"

// Rotate the pair (a, b) by (c, s), with PyTorch's rounding order.
__device__ __forceinline__ void rotate_pair(float& a, float& b, float c, float s) {
    const float ra = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
    const float rb = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    a = ra;
    b = rb;
}

// Rotate the N / 2 pairs of one 16-byte vector v whose first value is element `first` (even) of its
// row, by the token's cos/sin row cs (`half` = d / 2 pairs); `valid = false` (a position outside the
// table) makes them NaN instead.
template <typename T>
__device__ __forceinline__ void rotate_vec(Vec16<T>& v, int first, const float* __restrict__ cs, int half, bool valid) {
    constexpr int N = Vec16<T>::N;
#pragma unroll
    for (int e = 0; e < N; e += 2) {
        float a = to_float(v.v[e]), b = to_float(v.v[e + 1]);
        if (valid) {
            const int i = (first + e) / 2;
            rotate_pair(a, b, cs[i], cs[half + i]);
        } else {
            a = b = __int_as_float(0x7fc00000);  // NaN
        }
        v.v[e] = from_float<T>(a);
        v.v[e + 1] = from_float<T>(b);
    }
}
