// A dense projection of one or two tokens (chapter 14): y[t, n] = x[t] . W[n] for the T = TOKENS
// rows of x [T, K], with W [N, K] row-major (a Linear's weight) and y [T, N], all in T (bf16/fp16),
// accumulated in fp32 and rounded once, as cuBLAS does.
//
// At decode's batch 1 a projection reads its whole weight to produce a few thousand values: its time
// is the weight's bytes over the bandwidth the kernel reaches. This kernel reads the weight the way
// chapter 08's expert GEMVs do: each warp takes two adjacent output columns, streams their two weight
// rows with 16-byte loads, VECS per lane and row issued before the first is used (dot2_rows,
// common.cuh), against every input row (a few KB, which all blocks read, so from L2), and reduces with
// shuffles; lane 0 writes. Blocks of WARPS warps cover 2 * WARPS columns, so the weight is spread over
// N / 8 blocks: 256 and 384 for V2-Lite's o_proj and q_proj, more than the SMs, but 72 for kv_a_proj's
// 576 columns, which leave half the SMs idle. Both tokens share each weight load, so two tokens cost
// barely more than one; from three the skinny GEMM or cuBLAS takes over (gemv.py: GEMV_MAX_TOKENS).
//
// Bounds. The host checks dtypes, shapes, K % 8 == 0, 16-byte alignment of x, W and x's row stride.
// An odd N: the last warp's second row is its first (read twice, written once).
#include "common.cuh"

namespace gemv {
constexpr int WARPS = DSV2_GEMV_WARPS;  // warps per block, two output columns each (set in dsv2_lib/ops/gemv.py)
constexpr int VECS = 4;   // 16-byte vectors per lane and row in flight: K = 2048 in two trips
}  // namespace gemv

template <typename T, int TOKENS>
__global__ void __launch_bounds__(gemv::WARPS * 32)
linear_gemv(T* __restrict__ y, const T* __restrict__ x, const T* __restrict__ w, int N, int K, long long x_stride,
            long long y_stride) {
    wait_for_prior_grids();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * gemv::WARPS + warp) * 2;
    if (n0 >= N) return;  // no barrier in this kernel
    const int n1 = n0 + 1 < N ? n0 + 1 : n0;
    float s0[TOKENS], s1[TOKENS];
    dot2_rows<gemv::VECS, TOKENS>(w + (long long)n0 * K, w + (long long)n1 * K, x, x_stride, K, lane, s0, s1);
    if (lane == 0) {
#pragma unroll
        for (int t = 0; t < TOKENS; ++t) {
            y[t * y_stride + n0] = from_float<T>(s0[t]);
            if (n1 != n0) y[t * y_stride + n1] = from_float<T>(s1[t]);
        }
    }
}
