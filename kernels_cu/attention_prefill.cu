// The engine's prefill attention kernels (chapter 06). This file holds version 2, the tiled CUDA-core
// kernel (fp32, and 16-bit rows that are not 16-byte aligned); the tensor-core template (version 3)
// is in attention_prefill.cuh, instantiated by dsv2_lib/ops/attention.py for the variants the engine
// launches. Shapes, strides and the softmax's base-2 arithmetic: the header's opening comment.
#include "attention_prefill.cuh"

// ================================================================================================
// Version 2: tiles in shared memory and the online softmax (CUDA cores, any dtype; fp32 tiles).
// One block of 128 threads = one head and TQ = 16 consecutive queries of one sequence; the tile
// list tiles[2 * blockIdx.x + {0, 1}] = (sequence b, first query q0) comes from the host. The
// block walks over its keys in tiles of TK = 32: K tile -> shared, S = Q K^T (16 x 32, four scores
// per thread), online-softmax update, V tile -> shared (same buffer), O += P V.
//
// Thread layout: row r = threadIdx.x / 8 (0..15) of the query tile, lane c = threadIdx.x % 8 of its
// row group (the 8 threads of a row are 8 consecutive lanes of one warp). The thread owns scores
// (r, c + 8j), j < 4, and output dims c + 8j, j < 16. Row maxima and sums are reduced over the 8
// lanes with shuffles, so every thread of a row holds the row's m and l.
//
// Online softmax for row r, after tile j with scores x (already times log2 e):
//   m_new = max(m, max_k x_k);  corr = 2^(m - m_new);  p_k = 2^(x_k - m_new)
//   l     = l * corr + sum_k p_k;  acc = acc * corr + sum_k p_k v_k;     out = acc / l at the end.
// Each row sees key 0 in the first tile, so m is finite from then on; a later tile that is
// fully masked for the row gives max = -inf, m_new = m, corr = 1, p = 0.
// Padded rows (beyond the sequence's queries) load q = 0 and are never stored.
// ================================================================================================
// TQ and the block are set in dsv2_lib/ops/attention.py (TILED_BQ, TILED_THREADS).
constexpr int TQ = DSV2_ATTN_TILED_BQ, TK = 32, TILED_THREADS = DSV2_ATTN_TILED_THREADS;
static_assert(TILED_THREADS == 8 * TQ && TK == 4 * 8, "8 threads per query row, 4 scores each");
constexpr int QK_PAD = D_QK + 1;  // 193 floats per row: rows start in different banks

template <typename T>
__global__ void __launch_bounds__(TILED_THREADS) attention_prefill_tiled(
    T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_nope, const T* __restrict__ k_pe,
    const T* __restrict__ v, const int* __restrict__ cu_q, const int* __restrict__ cu_k, const int* __restrict__ tiles,
    long long sq_t, long long sq_h, long long sk_t, long long sk_h, long long spe_t, long long sv_t, long long sv_h,
    float scale_log2) {
    wait_for_prior_grids();
    __shared__ float sQ[TQ][QK_PAD];
    __shared__ float sKV[TK][QK_PAD];  // the K tile, then (columns 0..127) the V tile
    __shared__ float sP[TQ][TK + 1];  // +1: the 4 rows a warp reads at one kk fall in different banks

    const int b = tiles[2 * blockIdx.x], q0 = tiles[2 * blockIdx.x + 1], hd = blockIdx.y, h = gridDim.y;
    const int qbeg = cu_q[b], nq = cu_q[b + 1] - qbeg;
    const long long kbeg = cu_k[b];
    const int start = cu_k[b + 1] - cu_k[b] - nq;
    const int rows = min(TQ, nq - q0);
    const int n_keys = start + q0 + rows;  // keys 0 .. n_keys-1 are seen by some query of this tile
    const int r = threadIdx.x / 8, c = threadIdx.x % 8;
    const int pos = start + q0 + r;        // position of this thread's query row

    for (int e = threadIdx.x; e < TQ * D_QK; e += TILED_THREADS) {
        const int i = e / D_QK, d = e % D_QK;
        sQ[i][d] = i < rows ? to_float(q[(qbeg + q0 + i) * sq_t + hd * sq_h + d]) : 0.f;
    }
    float m = minus_inf(), l = 0.f, acc[D_V / 8];
#pragma unroll
    for (int j = 0; j < D_V / 8; ++j) acc[j] = 0.f;

    for (int k0 = 0; k0 < n_keys; k0 += TK) {
        for (int e = threadIdx.x; e < TK * D_QK; e += TILED_THREADS) {
            const int j = e / D_QK, d = e % D_QK;
            sKV[j][d] = k0 + j < n_keys ? key_at(k_nope, k_pe, kbeg + k0 + j, hd, d, sk_t, sk_h, spe_t) : 0.f;
        }
        __syncthreads();  // Q (first time) and K are in shared memory

        float x[4], mx = minus_inf();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int kk = c + 8 * j;
            float s = 0.f;
            for (int d = 0; d < D_QK; ++d) s = fmaf(sQ[r][d], sKV[kk][d], s);
            x[j] = k0 + kk <= pos ? s * scale_log2 : minus_inf();  // causal mask (also hides keys >= n_keys)
            mx = fmaxf(mx, x[j]);
        }
#pragma unroll
        for (int off = 4; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
        const float m_new = fmaxf(m, mx);  // finite: key 0 is in the first tile for every row
        const float corr = exp2f(m - m_new);
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float p = exp2f(x[j] - m_new);
            sP[r][c + 8 * j] = p;
            sum += p;
        }
#pragma unroll
        for (int off = 4; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
        l = l * corr + sum;
        m = m_new;
        __syncthreads();  // everyone is done with the K tile and sP is complete

        for (int e = threadIdx.x; e < TK * D_V; e += TILED_THREADS) {
            const int j = e / D_V, d = e % D_V;
            sKV[j][d] = k0 + j < n_keys ? to_float(v[(kbeg + k0 + j) * sv_t + hd * sv_h + d]) : 0.f;
        }
        __syncthreads();  // the V tile is in shared memory
#pragma unroll
        for (int j = 0; j < D_V / 8; ++j) acc[j] *= corr;
        for (int kk = 0; kk < TK; ++kk) {
            const float p = sP[r][kk];
#pragma unroll
            for (int j = 0; j < D_V / 8; ++j) acc[j] = fmaf(p, sKV[kk][c + 8 * j], acc[j]);
        }
        __syncthreads();  // done with V and sP before the next tile overwrites them
    }
    if (r < rows) {
        T* o = out + ((long long)(qbeg + q0 + r) * h + hd) * D_V;
#pragma unroll
        for (int j = 0; j < D_V / 8; ++j) o[c + 8 * j] = from_float<T>(acc[j] / l);
    }
}
