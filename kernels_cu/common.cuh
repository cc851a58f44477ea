// Helpers every kernel of the course uses: dtype conversion, 16-byte vectors, warp/block sums.
// Compiled by NVRTC through CuPy (C++17); each kernel file includes this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// ---- scalar conversion: every kernel computes in fp32 and stores in the tensor's dtype ----------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// -inf as a bit pattern: NVRTC does not have to define <math.h>'s INFINITY.
__device__ __forceinline__ float minus_inf() { return __int_as_float(static_cast<int>(0xff800000u)); }

// Round an fp32 value to T and back: reproduces a PyTorch op that stores an intermediate in T.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// ---- 16-byte vectors: one load instruction moves 8 bf16/fp16 or 4 fp32 values ---------------
template <typename T> struct alignas(16) Vec16 {
    static constexpr int N = 16 / sizeof(T);
    T v[N];
};

template <typename T> __device__ __forceinline__ Vec16<T> load16(const T* p) {
    return *reinterpret_cast<const Vec16<T>*>(p);
}
template <typename T> __device__ __forceinline__ void store16(T* p, const Vec16<T>& v) {
    *reinterpret_cast<Vec16<T>*>(p) = v;
}

// ---- reductions ---------------------------------------------------------------------------------
// Sum over the 32 lanes of a warp: five butterfly shuffles, every lane ends with the total.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024): each warp reduces, warp
// totals go through shared memory, warp 0 reduces those. Every thread gets the total.
// Two barriers per call are enough even for calls in a row: the next call's first barrier cannot
// complete before every thread has read this call's `total`, and this call's second barrier puts
// warp 0's reads of warp_totals before any new writes to it.
__device__ __forceinline__ float block_sum(float x) {
    __shared__ float warp_totals[32];
    __shared__ float total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    x = warp_sum(x);
    if (lane == 0) warp_totals[warp] = x;
    __syncthreads();
    if (warp == 0) {
        x = lane < (blockDim.x >> 5) ? warp_totals[lane] : 0.f;
        x = warp_sum(x);
        if (lane == 0) total = x;
    }
    __syncthreads();
    return total;
}
