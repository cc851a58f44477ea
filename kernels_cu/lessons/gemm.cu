// A naive tiled GEMM, written to be read: C[M, N] = A[M, K] @ B[K, N], all row-major and
// contiguous, inputs of type T (float, __half or __nv_bfloat16), fp32 accumulation, C stored in T.
//
// The engine does NOT call it: its dense projections call F.linear (cuBLAS) beyond a few tokens,
// which uses the H200's tensor cores and is many times faster. Chapter 05 measures both. This
// kernel shows the idea every fast GEMM starts from.
//
// Tiling. One block of 256 threads computes one BM x BN = 64 x 64 tile of C. It walks along K in
// steps of BK = 16: the block copies a 64 x 16 tile of A and a 16 x 64 tile of B from global
// memory into shared memory (each element once, as fp32), waits for everyone, then every thread
// multiplies out of shared memory, and the block waits again before the next copy overwrites the
// tiles. Each value of A loaded into shared memory is used 64 times (once per column of the C
// tile), each value of B 64 times: that reuse is what makes tiling faster than reading A and B
// from global memory for every multiply-add.
//
// Threads. Thread (ty, tx) = (threadIdx.x / 16, threadIdx.x % 16) owns a 4 x 4 sub-tile of the C
// tile: rows ty + 16*i and columns tx + 16*j (i, j < 4), i.e. strided by 16, so that the 16
// threads of a half-warp read 16 consecutive columns of B's tile (no shared-memory bank
// conflicts) and write 16 consecutive columns of C (coalesced). Its 16 accumulators live in
// registers; per k it loads 4 values of A and 4 of B from shared memory and does 16 FMAs.
//
// Bounds. Every global load is guarded: outside A or B it stores 0 in the tile, which adds
// nothing to the sums; every store is guarded by row < M && col < N. So any M, N, K works
// (K = 0 gives zeros). Scalar loads keep the kernel short; 16-byte loads, double buffering and
// tensor cores (mma / wgmma) are what separate it from cuBLAS.
#include "common.cuh"

constexpr int BM = DSV2_GEMM_BM, BN = DSV2_GEMM_BN, BK = 16;  // C tile (set in gemm.py) and K step
constexpr int TM = 4, TN = 4;                  // each thread's sub-tile of C
constexpr int THREADS = DSV2_GEMM_THREADS;     // threads per block (set in gemm.py)
static_assert(THREADS == (BM / TM) * (BN / TN), "one thread per TM x TN sub-tile: 16 x 16 = 256");

template <typename T>
__global__ void __launch_bounds__(THREADS)
tiled_matmul(T* __restrict__ C, const T* __restrict__ A, const T* __restrict__ B, int M, int N, int K) {
    // A's tile is stored transposed (k-major), the layout of kernels whose threads own contiguous rows
    // of C and read their values of A at one k as one vector (here a half-warp reads one broadcast
    // address either way); the +1 column shifts each k-row by one bank, so the transposed writes do
    // not all hit one bank.
    __shared__ float As[BK][BM + 1];
    __shared__ float Bs[BK][BN];

    const int tx = threadIdx.x % (BN / TN), ty = threadIdx.x / (BN / TN);
    const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;  // this block's tile of C
    float acc[TM][TN] = {};

    for (int k0 = 0; k0 < K; k0 += BK) {
        // Stage A[m0 : m0+64, k0 : k0+16] and B[k0 : k0+16, n0 : n0+64]: 1024 values each,
        // 4 per thread; consecutive threads read consecutive addresses in global memory.
#pragma unroll
        for (int l = 0; l < BM * BK / THREADS; ++l) {
            const int e = threadIdx.x + l * THREADS;
            const int r = e / BK, c = e % BK;           // row of A's tile, column (k)
            const int m = m0 + r, k = k0 + c;
            As[c][r] = (m < M && k < K) ? to_float(A[(long long)m * K + k]) : 0.f;
        }
#pragma unroll
        for (int l = 0; l < BK * BN / THREADS; ++l) {
            const int e = threadIdx.x + l * THREADS;
            const int r = e / BN, c = e % BN;           // row of B's tile (k), column
            const int k = k0 + r, n = n0 + c;
            Bs[r][c] = (k < K && n < N) ? to_float(B[(long long)k * N + n]) : 0.f;
        }
        __syncthreads();  // the tiles are complete before anyone reads them

#pragma unroll
        for (int k = 0; k < BK; ++k) {
            float a[TM], b[TN];
#pragma unroll
            for (int i = 0; i < TM; ++i) a[i] = As[k][ty + i * (BM / TM)];
#pragma unroll
            for (int j = 0; j < TN; ++j) b[j] = Bs[k][tx + j * (BN / TN)];
#pragma unroll
            for (int i = 0; i < TM; ++i)
#pragma unroll
                for (int j = 0; j < TN; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();  // everyone is done reading before the next iteration overwrites the tiles
    }

#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int m = m0 + ty + i * (BM / TM);
#pragma unroll
        for (int j = 0; j < TN; ++j) {
            const int n = n0 + tx + j * (BN / TN);
            if (m < M && n < N) C[(long long)m * N + n] = from_float<T>(acc[i][j]);
        }
    }
}
