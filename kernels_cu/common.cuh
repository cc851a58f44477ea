// Helpers every kernel of the course uses: dtype conversion, 16-byte vectors, warp/block sums.
// Compiled by NVRTC through CuPy (C++17); each kernel file includes this header.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// ---- programmatic dependent launch (Hopper and later; chapter 14) -------------------------------
// Every engine kernel begins with this call. The engine launches a kernel whose body calls it with
// the programmatic-dependent-launch attribute: the GPU may then schedule the kernel's blocks while the
// kernel before it on the stream is still finishing, instead of after it has drained. Each block waits
// here until that kernel has completed and its writes are visible (its predecessor had waited for its
// own, so everything earlier on the stream is done too), then lets the next kernel's blocks be
// scheduled in turn: they wait in their own call. Nothing before the call may read memory that an
// earlier kernel writes, or write memory that one reads or writes. Launched the ordinary way, or on
// an older GPU, the call does nothing.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// ---- GEMV rows: a pair of weight rows against a few input rows ----------------------------------
// (s0[t], s1[t]) = (w0 . x_t, w1 . x_t) over K (a multiple of the vector width) for the TOKENS input
// rows x_t = x + t * x_stride, each summed over the warp. Lane l takes the 16-byte vectors l, l + 32,
// ... of both weight rows and of every x_t, VECS of each at a time, all loaded before the first is
// used: a warp makes one trip to memory per 32 * VECS vectors, and each weight row is read once for
// all TOKENS rows. Each lane adds its products in vector order, so the sums do not depend on VECS.
// The MoE GEMVs (chapter 08) and the dense one (gemv.cu, chapter 14) use it.
template <int VECS, int TOKENS, typename T>
__device__ __forceinline__ void dot2_rows(const T* __restrict__ w0, const T* __restrict__ w1, const T* __restrict__ x,
                                          long long x_stride, int K, int lane, float (&s0)[TOKENS],
                                          float (&s1)[TOKENS]) {
    constexpr int N = Vec16<T>::N;
    const int nv = K / N;
    float a0[TOKENS], a1[TOKENS];
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) a0[t] = a1[t] = 0.f;
    for (int v0 = lane; v0 < nv; v0 += 32 * VECS) {
        Vec16<T> u0[VECS], u1[VECS], xv[TOKENS][VECS];
#pragma unroll
        for (int i = 0; i < VECS; ++i) {
            const int v = v0 + 32 * i;
            if (v < nv) {
                u0[i] = load16(w0 + v * N);
                u1[i] = load16(w1 + v * N);
#pragma unroll
                for (int t = 0; t < TOKENS; ++t) xv[t][i] = load16(x + t * x_stride + v * N);
            }
        }
#pragma unroll
        for (int i = 0; i < VECS; ++i) {
            if (v0 + 32 * i < nv) {
#pragma unroll
                for (int j = 0; j < N; ++j) {
#pragma unroll
                    for (int t = 0; t < TOKENS; ++t) {
                        const float xj = to_float(xv[t][i].v[j]);
                        a0[t] = fmaf(to_float(u0[i].v[j]), xj, a0[t]);
                        a1[t] = fmaf(to_float(u1[i].v[j]), xj, a1[t]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int t = 0; t < TOKENS; ++t) {
        s0[t] = warp_sum(a0[t]);
        s1[t] = warp_sum(a1[t]);
    }
}

// One input row: (s0, s1) = (w0 . x, w1 . x).
template <int VECS, typename T>
__device__ __forceinline__ void dot2(const T* __restrict__ w0, const T* __restrict__ w1, const T* __restrict__ x,
                                     int K, int lane, float& s0, float& s1) {
    float r0[1], r1[1];
    dot2_rows<VECS, 1>(w0, w1, x, 0, K, lane, r0, r1);
    s0 = r0[0];
    s1 = r1[0];
}
