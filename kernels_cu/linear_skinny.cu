// A dense projection of 3 to 64 tokens (decode batches, chapter 14): y [T, N] = x [T, K] . W [N, K]^T on
// the tensor cores, the weight read once per 8 * NT tokens. The layout is chapter 08's skinny grouped
// GEMM (moe.cu: moe_skinny) with one matrix instead of an expert per tile: a warp's 16 weight rows are
// the mma's M side and groups of 8 tokens its N side, the weights loaded from global memory straight
// into A-fragment registers (skinny_step in tensor_core.cuh).
// Unlike an expert's tile, one matrix has too few rows to keep every SM busy with a warp per 16 rows
// over the whole K (576 rows are 36 warps), so the block's SKINNY_WARPS warps share its 16 rows and
// split K: warp w takes the 64-wide k-steps w, w + SKINNY_WARPS, ...; their partial sums meet in
// shared memory and are added in warp order (fixed: the same result on every run). Block (c, r):
// rows n0 = 16 c .. n0 + 15 of W, tokens 8 NT r .. 8 NT r + 8 NT - 1 of x (those past T read nothing
// and write nothing; T = tokens). fp32 accumulation, rounded once, as cuBLAS and linear_gemv do (in other orders).
// A third grid dimension runs one product per head (MLA's absorbed output, mla_absorb.py): block (c, r, h)
// reads x + h x_head, w + h w_head and writes y + h y_head; x may be fp32, each value rounded to T as it
// is read (load8 in tensor_core.cuh). A dense projection has one head.
// The host checks K % 64 == 0, N % 16 == 0, dtypes, strides and 16-byte alignment (gemv.py).
#include "tensor_core.cuh"

constexpr int SKINNY_WARPS = DSV2_GEMV_SKINNY_WARPS;  // warps per block, splitting K (set in dsv2_lib/ops/gemv.py)

template <typename T, typename X, int NT>
__global__ void __launch_bounds__(SKINNY_WARPS * 32)
linear_skinny(T* __restrict__ y, const X* __restrict__ x, const T* __restrict__ w, int tokens, int N, int K,
              long long x_stride, long long y_stride, long long x_head, long long y_head, long long w_head) {
    wait_for_prior_grids();
    constexpr int W = SKINNY_WARPS;
    __shared__ float part[W][NT * 4][32];  // warp w's partial C fragments, lane-minor (no bank conflicts)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.x * 16, t0 = blockIdx.y * 8 * NT;
    x += blockIdx.z * x_head;
    y += blockIdx.z * y_head;
    w += blockIdx.z * w_head;
    const X* xr[NT];  // this thread's input rows: tokens t0 + 8 nt + g (nullptr past T: zeros)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int t = t0 + 8 * nt + g;
        xr[nt] = t < tokens ? x + t * x_stride : nullptr;
    }
    const T* w_lo[1] = {w + (long long)(n0 + g) * K};
    const T* w_hi[1] = {w_lo[0] + 8LL * K};
    float acc[1][NT][4] = {};
#pragma unroll 2
    for (int k = 64 * warp + 16 * q; k < K; k += 64 * W) skinny_step<T, 1, NT>(acc, w_lo, w_hi, xr, k);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) part[warp][nt * 4 + c][lane] = acc[0][nt][c];
    __syncthreads();
    // Output (nt, c, lane) = C-fragment element c of group nt in lane (g, q): column n0 + g + 8 (c >> 1),
    // token t0 + 8 nt + 2q + (c & 1). The block's threads take the NT * 128 outputs in turn.
    for (int i = threadIdx.x; i < NT * 4 * 32; i += W * 32) {
        const int f = i >> 5, l = i & 31, c = f & 3;
        const int t = t0 + 8 * (f >> 2) + 2 * (l & 3) + (c & 1), n = n0 + (l >> 2) + 8 * (c >> 1);
        float s = 0.f;
#pragma unroll
        for (int v = 0; v < W; ++v) s += part[v][f][l];
        if (t < tokens) y[t * y_stride + n] = from_float<T>(s);
    }
}
