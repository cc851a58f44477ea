// Causal prefill attention over packed variable-length sequences (chapter 06): what the engine's
// kernel file (attention_prefill.cu) and the chapter's lesson kernels (lessons/attention_prefill.cu)
// share: the layout, the key reader and the tensor-core template (version 3), which each file's
// Python module instantiates for its own variants.
//
// Shapes (DeepSeek-V2-Lite: h = 16 heads; the head sizes are fixed here: 128 + 64 and 128):
//   q       [Tq, h, 192]  = [q_nope 128 | q_pe 64], token stride sq_t, head stride sq_h
//   k_nope  [Tk, h, 128]  token stride sk_t, head stride sk_h   (strided views of kv_b_proj's output)
//   k_pe    [Tk, 64]      token stride spe_t: ONE rotary key per token, shared by all heads
//   v       [Tk, h, 128]  token stride sv_t, head stride sv_h
//   out     [Tq, h, 128]  dense
//   cu_q [B+1], cu_k [B+1] int32 prefix sums: sequence b owns queries cu_q[b] .. cu_q[b+1]-1 and
//   keys cu_k[b] .. cu_k[b+1]-1. With nq = cu_q[b+1]-cu_q[b], nk = cu_k[b+1]-cu_k[b], the
//   sequence already had start = nk - nq cached tokens: query i sits at position start + i and
//   sees keys 0 .. start + i (the host checks 0 <= nq <= nk and that the sums end at Tq, Tk).
//   The key of head hd is [k_nope[t, hd] | k_pe[t]]: the kernels read k_pe directly instead of
//   materialising a [Tk, h, 192] copy (16x the bytes of the rope part).
//
// Scores are s = (q . k) * scale; all versions compute exp(s - m) as exp2(s * log2(e) - m'), with
// scale_log2 = scale * log2(e) folded in by the host. Arithmetic and accumulation are fp32.
#pragma once
#include "tensor_core.cuh"

// The head sizes (set in dsv2_lib/ops/attention.py, like BK and ROW_PAD below); the tensor-core kernel copies
// k_nope, k_pe and v rows as 16, 8 and 16 chunks of 8 values.
constexpr int D_NOPE = DSV2_ATTN_D_NOPE, D_ROPE = DSV2_ATTN_D_ROPE, D_QK = D_NOPE + D_ROPE, D_V = DSV2_ATTN_D_V;
static_assert(D_NOPE == 128 && D_ROPE == 64 && D_V == 128, "the head sizes the kernels are written for");

// Element d (< 192) of the key of token `row`, head `hd`: k_nope for d < 128, the shared k_pe after.
template <typename T>
__device__ __forceinline__ float key_at(const T* k_nope, const T* k_pe, long long row, int hd, int d,
                                        long long sk_t, long long sk_h, long long spe_t) {
    return d < D_NOPE ? to_float(k_nope[row * sk_t + hd * sk_h + d]) : to_float(k_pe[row * spe_t + d - D_NOPE]);
}

// ================================================================================================
// Version 3: tensor cores. mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: D[16x8] += A[16x16] B[16x8],
// fp32 accumulators, for T = __nv_bfloat16 or __half (fp32 goes to version 2).
//
// One block of NW warps = one head and BQ = 16 NW queries of one sequence (tiles from the host);
// warp w owns query rows 16w .. 16w+15 of the tile. Keys come in tiles of BK = 64.
// Per key tile, each warp computes S = Q K^T (16 x 64: 8 n-tiles x 12 k-steps of 16 over the 192
// dims = 96 mma), the online-softmax update in registers, then O += P V (16 x 128: 16 n-tiles x
// 4 k-steps over the 64 keys = 64 mma). P never leaves registers: the accumulator layout of S
// is the A-operand layout of P V (below).
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 with floating point type").
// lane = 0..31, g = lane / 4 (groupID), t = lane % 4 (threadID_in_group). A 32-bit register holds
// two 16-bit values, the lower column index in the low half.
//   A (16 x 16, row-major):  a0 = A[g][2t, 2t+1]      a1 = A[g+8][2t, 2t+1]
//                            a2 = A[g][2t+8, 2t+9]    a3 = A[g+8][2t+8, 2t+9]
//   B (16 x 8, "col"):       b0 = B[2t, 2t+1][g]      b1 = B[2t+8, 2t+9][g]   (rows k, column n)
//   C/D (16 x 8, fp32):      c0, c1 = C[g][2t, 2t+1]  c2, c3 = C[g+8][2t, 2t+1]
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i .. 8i+7 give the addresses of rows
// 0..7 of 8x8 matrix i (16 bytes each); register ri of every lane receives, from matrix i,
//   without .trans: M[lane/4][2(lane%4), 2(lane%4)+1]     with .trans: M[2(lane%4), 2(lane%4)+1][lane/4]
//
// S = Q K^T: A = Q (rows = queries, columns = dims), loaded once from global memory into registers
// (12 k-steps x 4 registers). B[k][n] = K[key n][dim k], so b0 = K[n0+g][k0+2t, +1]: the
// non-transposed ldmatrix of the 8x8 blocks (keys n0..n0+7) x (dims k0..k0+7 | k0+8..k0+15)
// gives b0, b1 — one x4 load gives them for two key n-tiles.
// P as the A operand of P V, keys kk*16 .. kk*16+15: a0 = P[g][16kk + 2t, +1] = S n-tile 2kk's
// (c0, c1); a1 = its (c2, c3); a2 = n-tile (2kk+1)'s (c0, c1); a3 = its (c2, c3).
// B[k][n] = V[key k][dim n]: b0 = V[k0+2t, +1][n0+g] is a column pair, which ldmatrix.trans of
// the 8x8 block (keys k0..k0+7) x (dims n0..n0+7) delivers; x4 covers keys k0..k0+15 for two
// dim n-tiles.
//
// Q as the A operand, when it lives in shared memory (QS = true): a0..a3 are the 8x8 blocks
// (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15) of the
// warp's 16 x 16 slice, so lane address = row 16w + 8 (mi & 1) + mr, column 16 ks + 8 (mi >> 1).
//
// Template parameters (the variants the benchmark compares: dsv2_lib/ops/attention.py MMA_VARIANTS
// names those the engine launches, dsv2_lib/lessons/attention_prefill.py the others):
//   NW    warps per block: BQ = 16 NW queries share each K/V tile read from global memory (L2);
//   QS    Q fragments re-read from shared memory at every key tile (frees 48 registers per
//         thread, so more blocks fit per SM) instead of held in registers;
//   ST    1: one K and one V buffer (the copy of V(j) overlaps S(j), that of K(j+1) overlaps P V(j));
//         2: two of each, K(j+1) and V(j+1) are copied during the whole of tile j;
//   MINB  __launch_bounds__ minimum blocks per SM (caps the registers per thread).
// Pipeline, ST = 1 (cp.async 16-byte copies global -> shared; wait_group n: all but the n most
// recently committed groups have landed):
//   load K(0)
//   for each key tile j:  wait 0 + barrier   K(j) visible; every warp finished P V(j-1): sV free
//                         issue V(j);  S = Q K(j)^T;  softmax update
//                         wait 0 + barrier   V(j) visible; every warp finished reading K(j)
//                         issue K(j+1);  O += P V(j)
// ST = 2 (buffers j % 2):
//   load K(0); load V(0)
//   for each key tile j:  wait 1 + barrier   K(j) visible; every warp finished tile j-1: buffers (j+1) % 2 free
//                         issue K(j+1); issue V(j+1)   (empty groups past the end keep the counts)
//                         S = Q K(j)^T;  softmax update
//                         wait 2 + barrier   V(j) visible
//                         O += P V(j)
// Rows of shared tiles are padded (200 and 136 elements: 400 and 272 bytes, 100 and 68 words) so
// that the 8 row addresses of one ldmatrix phase fall in 8 different 4-bank groups.
// Keys beyond the sequence are zero-filled in shared memory (never read from global memory);
// rows beyond the sequence's queries load q = 0 and are never stored.
// Shared memory is dynamic: [sQ: BQ x 200 if QS][sK: ST x 64 x 200][sV: ST x 64 x 136] elements
// (MmaVariant.shared_bytes in attention.py computes it from the same constants; the launcher raises the 48 KB
// opt-in limit where needed).
//
// Softmax arithmetic: the row maximum is taken over the raw scores s, and p = 2^(s * scale_log2 - m)
// with m = max * scale_log2 is one FFMA + one exp2 per score.
// ================================================================================================
constexpr int BK = DSV2_ATTN_BK;      // keys per tile
constexpr int ROW_PAD = DSV2_ATTN_ROW_PAD;  // elements of padding per shared row (16 bytes of 16-bit values)
constexpr int K_STRIDE = D_QK + ROW_PAD, V_STRIDE = D_V + ROW_PAD;  // padded shared rows, in elements

// Rows k0 .. k0 + BK - 1 of a key slab (`src` at row k0, `stride` elements per row, CHUNKS 16-byte
// chunks per row) into a shared tile of DST_STRIDE elements per row; rows at or past n_keys are
// zero-filled. A thread keeps one chunk column and steps down the rows, so each next address is one
// add away (few registers held across the key loop).
template <int CHUNKS, int DST_STRIDE, int THREADS, typename T>
__device__ __forceinline__ void load_rows(T* dst, const T* src, long long stride, int k0, int n_keys) {
    constexpr int STEP = THREADS / CHUNKS;
    const int c = threadIdx.x % CHUNKS, j0 = threadIdx.x / CHUNKS;
    src += j0 * stride + c * 8;
    dst += j0 * DST_STRIDE + c * 8;
#pragma unroll 4
    for (int j = j0; j < BK; j += STEP, src += STEP * stride, dst += STEP * DST_STRIDE) {
        if (k0 + j < n_keys) cp_async16(dst, src);
        else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
}

template <typename T, int NW, bool QS, int ST, int MINB>
__global__ void __launch_bounds__(32 * NW, MINB) attention_prefill_mma(
    T* __restrict__ out, const T* __restrict__ q, const T* __restrict__ k_nope, const T* __restrict__ k_pe,
    const T* __restrict__ v, const int* __restrict__ cu_q, const int* __restrict__ cu_k, const int* __restrict__ tiles,
    long long sq_t, long long sq_h, long long sk_t, long long sk_h, long long spe_t, long long sv_t, long long sv_h,
    float scale_log2) {
    wait_for_prior_grids();
    static_assert(ST == 1 || ST == 2, "one or two K/V buffers");
    constexpr int BQ = 16 * NW, THREADS = 32 * NW;
    extern __shared__ uint4 smem_u4[];  // uint4: 16-byte aligned for cp.async and ldmatrix
    T* const sQ = reinterpret_cast<T*>(smem_u4);
    T* const sK = sQ + (QS ? BQ * K_STRIDE : 0);
    T* const sV = sK + ST * BK * K_STRIDE;

    const int b = tiles[2 * blockIdx.x], q0 = tiles[2 * blockIdx.x + 1], hd = blockIdx.y, h = gridDim.y;
    const int qbeg = cu_q[b], nq = cu_q[b + 1] - qbeg;
    const long long kbeg = cu_k[b];
    const int start = cu_k[b + 1] - cu_k[b] - nq;
    const int rows = min(BQ, nq - q0);
    const int n_keys = start + q0 + rows;
    const int n_tiles = (n_keys + BK - 1) / BK;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int r0 = 16 * warp + g, r1 = r0 + 8;  // this thread's two query rows in the tile
    const int pos0 = start + q0 + r0, pos1 = pos0 + 8;

    // K tile at key k0 -> buffer: 64 keys x 24 chunks of 8 elements (16 chunks of k_nope, 8 of the shared
    // k_pe); V tile: 64 keys x 16 chunks. Each goes through load_rows: a thread keeps one chunk column
    // and steps down the rows.
    auto load_k = [&](int k0, T* buf) {
        load_rows<16, K_STRIDE, THREADS>(buf, k_nope + (kbeg + k0) * sk_t + hd * sk_h, sk_t, k0, n_keys);
        load_rows<8, K_STRIDE, THREADS>(buf + D_NOPE, k_pe + (kbeg + k0) * spe_t, spe_t, k0, n_keys);
        cp_async_commit();
    };
    auto load_v = [&](int k0, T* buf) {
        load_rows<16, V_STRIDE, THREADS>(buf, v + (kbeg + k0) * sv_t + hd * sv_h, sv_t, k0, n_keys);
        cp_async_commit();
    };

    // Q: either fragments straight from global memory into registers (once per block: 12 k-steps x
    // a0..a3), or the tile into sQ with the first K group.
    unsigned qf[QS ? 1 : D_QK / 16][4];
    if constexpr (QS) {
        for (int e = threadIdx.x; e < BQ * (D_QK / 8); e += THREADS) {
            const int i = e / (D_QK / 8), part = e % (D_QK / 8);
            T* dst = sQ + i * K_STRIDE + part * 8;
            if (i < rows) cp_async16(dst, q + (long long)(qbeg + q0 + i) * sq_t + hd * sq_h + part * 8);
            else *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
        }
    }
    load_k(0, sK);  // commits Q (if QS) and K(0) as one group
    if constexpr (ST == 2) load_v(0, sV);
    if constexpr (!QS) {
        const T* q_r0 = q + (long long)(qbeg + q0 + r0) * sq_t + hd * sq_h;
        const T* q_r1 = q + (long long)(qbeg + q0 + r1) * sq_t + hd * sq_h;
        const bool ok0 = r0 < rows, ok1 = r1 < rows;
#pragma unroll
        for (int ks = 0; ks < D_QK / 16; ++ks) {
            const int col = 16 * ks + 2 * t;
            qf[ks][0] = ok0 ? *reinterpret_cast<const unsigned*>(q_r0 + col) : 0u;
            qf[ks][1] = ok1 ? *reinterpret_cast<const unsigned*>(q_r1 + col) : 0u;
            qf[ks][2] = ok0 ? *reinterpret_cast<const unsigned*>(q_r0 + col + 8) : 0u;
            qf[ks][3] = ok1 ? *reinterpret_cast<const unsigned*>(q_r1 + col + 8) : 0u;
        }
    }

    float o[D_V / 8][4];
#pragma unroll
    for (int n = 0; n < D_V / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = minus_inf(), m1 = minus_inf(), l0 = 0.f, l1 = 0.f;  // rows r0 and r1 (m: scaled); l: partial sums

    // ldmatrix row addresses: lane -> (matrix i = lane / 8, row lane % 8)
    const int mi = lane / 8, mr = lane % 8;

    for (int jt = 0; jt < n_tiles; ++jt) {
        const int k0 = jt * BK;
        const T* kb = sK + (ST == 2 ? (jt & 1) * BK * K_STRIDE : 0);
        const T* vb = sV + (ST == 2 ? (jt & 1) * BK * V_STRIDE : 0);
        if constexpr (ST == 1) {
            cp_async_wait<0>();
            __syncthreads();  // K(jt) visible to all; all warps done with P V(jt-1): sV is free
            load_v(k0, sV);
        } else {
            cp_async_wait<1>();
            __syncthreads();  // K(jt) visible; all warps done with tile jt-1: the other buffers are free
            T* kn = sK + ((jt + 1) & 1) * BK * K_STRIDE;
            T* vn = sV + ((jt + 1) & 1) * BK * V_STRIDE;
            if (jt + 1 < n_tiles) {
                load_k(k0 + BK, kn);
                load_v(k0 + BK, vn);
            } else {
                cp_async_commit();  // two empty groups: the wait counts stay the same
                cp_async_commit();
            }
        }

        float s[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D_QK / 16; ++ks) {
            unsigned qa[4];
            if constexpr (QS) {
                ldmatrix_x4(qa, sQ + (16 * warp + 8 * (mi & 1) + mr) * K_STRIDE + 16 * ks + 8 * (mi >> 1));
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) qa[i] = qf[QS ? 0 : ks][i];
            }
#pragma unroll
            for (int n = 0; n < BK / 8; n += 2) {
                // matrices: (keys 8n.., dims 16ks..) (keys 8n.., dims 16ks+8..) (keys 8n+8.., 16ks..) (keys 8n+8.., 16ks+8..)
                unsigned bk[4];
                ldmatrix_x4(bk, kb + (8 * (n + (mi >> 1)) + mr) * K_STRIDE + 16 * ks + 8 * (mi & 1));
                mma16816<T>(s[n], qa, bk[0], bk[1]);
                mma16816<T>(s[n + 1], qa, bk[2], bk[3]);
            }
        }

        // Online softmax (log2 domain). Thread holds row r0: s[n][0..1], row r1: s[n][2..3], keys 8n + 2t + {0,1}.
        const bool diag = k0 + BK - 1 > start + q0;  // some key of this tile is later than the tile's first query
        float mx0 = minus_inf(), mx1 = minus_inf();
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                if (diag) {
                    const int key = k0 + 8 * n + 2 * t + e;
                    if (key > pos0) s[n][e] = minus_inf();
                    if (key > pos1) s[n][2 + e] = minus_inf();
                }
                mx0 = fmaxf(mx0, s[n][e]);
                mx1 = fmaxf(mx1, s[n][2 + e]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0 * scale_log2), mn1 = fmaxf(m1, mx1 * scale_log2);  // finite: key 0 is in tile 0
        const float c0 = exp2f(m0 - mn0), c1 = exp2f(m1 - mn1);
        m0 = mn0;
        m1 = mn1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
            s[n][0] = exp2f(fmaf(s[n][0], scale_log2, -mn0));
            s[n][1] = exp2f(fmaf(s[n][1], scale_log2, -mn0));
            s[n][2] = exp2f(fmaf(s[n][2], scale_log2, -mn1));
            s[n][3] = exp2f(fmaf(s[n][3], scale_log2, -mn1));
            sum0 += s[n][0] + s[n][1];
            sum1 += s[n][2] + s[n][3];
        }
        l0 = l0 * c0 + sum0;
        l1 = l1 * c1 + sum1;
#pragma unroll
        for (int n = 0; n < D_V / 8; ++n) {
            o[n][0] *= c0;
            o[n][1] *= c0;
            o[n][2] *= c1;
            o[n][3] *= c1;
        }

        if constexpr (ST == 1) {
            cp_async_wait<0>();
            __syncthreads();  // V(jt) visible to all; all warps done reading K(jt): sK is free
            if (jt + 1 < n_tiles) load_k(k0 + BK, sK);
        } else {
            cp_async_wait<2>();
            __syncthreads();  // V(jt) visible to all
        }

#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            const unsigned pa[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                    pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                    pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
            for (int n = 0; n < D_V / 8; n += 2) {
                // matrices: (keys 16kk.., dims 8n..) (keys 16kk+8.., dims 8n..) (keys 16kk.., 8n+8..) (keys 16kk+8.., 8n+8..)
                unsigned bv[4];
                ldmatrix_x4_trans(bv, vb + (16 * kk + 8 * (mi & 1) + mr) * V_STRIDE + 8 * (n + (mi >> 1)));
                mma16816<T>(o[n], pa, bv[0], bv[1]);
                mma16816<T>(o[n + 1], pa, bv[2], bv[3]);
            }
        }
    }

    // Row sums: the four threads t = 0..3 of a row each hold a part.
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = 1.f / l0, inv1 = 1.f / l1;
    T* o0 = out + ((long long)(qbeg + q0 + r0) * h + hd) * D_V;
    T* o1 = out + ((long long)(qbeg + q0 + r1) * h + hd) * D_V;
#pragma unroll
    for (int n = 0; n < D_V / 8; ++n) {
        const int d = 8 * n + 2 * t;
        if (r0 < rows) *reinterpret_cast<unsigned*>(o0 + d) = pack2<T>(o[n][0] * inv0, o[n][1] * inv0);
        if (r1 < rows) *reinterpret_cast<unsigned*>(o1 + d) = pack2<T>(o[n][2] * inv1, o[n][3] * inv1);
    }
}
