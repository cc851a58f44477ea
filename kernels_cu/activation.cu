// SwiGLU's activation on the output of the fused gate|up GEMM.
//
//   x   [rows, 2I] = [gate | up]      (row r starts at x + r * stride; the two halves are contiguous)
//   out [rows, I]  = round_T(silu(gate) * up),   silu(g) = g / (1 + exp(-g)),   all in fp32
//
// Grid: blockIdx.x = row, blockIdx.y = a slice of that row; the threads of the gridDim.y blocks of
// a row stride over it together. Two variants:
//   VEC = true  : one 16-byte vector of gate, one of up and one of out per step (8 bf16 values).
//                 The host picks it only when I and the row stride are multiples of the vector
//                 width and both pointers are 16-byte aligned, so every vector is aligned.
//   VEC = false : one element per step; any I, stride and alignment.
// expf, not __expf: the kernel is memory-bound, so the accurate exp (<= 2 ulp) costs no time, and
// it keeps fp32 results within a few ulps of PyTorch's silu; __expf's error grows with |g|.
#include "common.cuh"

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }

template <typename T, bool VEC>
__global__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ x, int inter, long long stride) {
    wait_for_prior_grids();
    const T* gate = x + (long long)blockIdx.x * stride;
    const T* up = gate + inter;
    T* dst = out + (long long)blockIdx.x * inter;
    const int step = gridDim.y * blockDim.x;  // host guarantees inter + step fits in an int
    if constexpr (VEC) {
        constexpr int N = Vec16<T>::N;
        for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < inter / N; i += step) {
            const Vec16<T> g = load16(gate + i * N), u = load16(up + i * N);
            Vec16<T> o;
#pragma unroll
            for (int j = 0; j < N; ++j) o.v[j] = from_float<T>(silu_mul(to_float(g.v[j]), to_float(u.v[j])));
            store16(dst + i * N, o);
        }
    } else {
        for (int i = blockIdx.y * blockDim.x + threadIdx.x; i < inter; i += step)
            dst[i] = from_float<T>(silu_mul(to_float(gate[i]), to_float(up[i])));
    }
}
