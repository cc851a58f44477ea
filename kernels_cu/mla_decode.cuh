// MLA decode attention on the latent cache, with the key and value up-projections absorbed: the
// block body (attend_rows) and the merge of partial results (merge_partials) that chapter 10's
// uniform split-KV kernel (lessons/mla_decode_split.cu) and chapter 13's balanced schedule over the
// paged cache (mla_decode.cu, the engine's) share. One query token per batch entry:
//
//   q      [B, H, D]            absorbed query [W_k^T q_nope | q_pe] in T (bf16 or fp16), D = DL + DR
//   rows   [.., D]              cache rows [latent (DL) | k_pe (DR)] in T: a slot of a contiguous
//                               cache [S, max_len, D], or the paged cache [num_rows, D]
//   out    [B, H, DL]  fp32     sum_t softmax_t(scale * q . row_t) * latent_t
//
// One thread block = 4 warps handles 16 heads (one head group) of one batch entry over a range of
// its context rows. It streams the range in tiles of 32 rows through shared memory
// (cp.async, 16-byte copies, STAGES buffers in flight), so every cache row is read from global
// memory once for all 16 heads. Both products run on the tensor cores (mma.sync m16n8k16, fp32
// accumulators); the 16 heads are the M = 16 rows of the MMA:
//
//   scores  S [16 heads, 32 tokens] = Q [16, D] . K^T   K = the tile's rows [32, D]
//   output  O [16 heads, DL]       += P [16, 32] . V    V = the tile's latents [32, DL]
//
// Work split inside the block. Scores: warp w multiplies the k-steps (16 columns of D each)
// w, w+4, w+8, ... for all 32 tokens, keeping its slice of Q in registers; the four partial score
// tiles are summed through shared memory in warp order (each warp finishes a quarter of the sums, then
// every warp reads them all), so all warps hold the same S and run the same online softmax
// (FlashAttention recurrence, log2 domain). Output: warp w owns columns [w*DL/4, (w+1)*DL/4) of O,
// 64 fp32 accumulators per thread for DL = 512.
//
// Split-KV. When several blocks share an entry's context, each writes its range's normalised partial
// o = O / l and lse = m + log2(l) (log2 domain), and merge_partials merges them:
// out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M). A range that is the whole context writes `out`
// directly (no lse). An empty range writes o = 0, lse = -inf (weight 0).
//
// What sets the pace (benchmarks/bench_mla_decode.py, benchmarks/bench_mla_decode_paged.py): a block's
// tile loop is serial — wait for tile it, score, reduce across warps, softmax, P.V, three block
// barriers — and it is the SM's work per tile, not the bytes in flight, that sets the pace: the
// pipeline depth hardly matters, and with two blocks per SM their phases overlap. With one warp per
// scheduler the block is bound by issuing its instructions, so the tile loop keeps its bookkeeping
// small: whole rows copied per warp, a two-step float4 exchange of partial scores, the rescale
// skipped once the running maxima settle.
//
// Paged (PAGED = true, chapter 13). `rows` is one layer of the paged cache, flat [num_rows, D], and
// entry b's context position p lives in row block_table[b][p / block_size] * block_size
// + p % block_size (block_table [B, table_width] int32, padded with -1; block_size a runtime int).
// Only the address of a staged row changes: lane l of every warp looks up token l of a tile in the
// table (one read per lane, issued a tile ahead) and the 16-byte copies get their row from it by a
// shuffle, so the arithmetic, and hence every result, is that of the contiguous kernel on the same rows.
// A table entry that is -1 or points past num_rows (or a position past the table) gives a zero row
// without any read (cp.async src-size 0). With PAGED = false nothing of this is compiled.
//
// Bounds. The host checks shapes, dtypes, alignment and max_length against the cache. On the device,
// a length is clamped to [0, max_length]; an entry with nothing to attend over gets zeros. Rows past
// the range are zero-filled by cp.async (src-size 0: nothing is read) and masked to -inf, so no NaN
// can enter through them.
//
// Fragment layouts relied on (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point
// type"; g = lane >> 2, t = lane & 3):
//   A (16x16, .bf16/.f16, 4 x .b32 regs): reg0 = (row g,   cols 2t, 2t+1)  reg1 = (row g+8, cols 2t, 2t+1)
//                                         reg2 = (row g,   cols 2t+8, +9)  reg3 = (row g+8, cols 2t+8, +9)
//   B (16x8, 2 x .b32 regs):              reg0 = (rows k = 2t, 2t+1; col n = g)  reg1 = (rows 2t+8, 2t+9; col g)
//   C/D (16x8, 4 x f32):                  c0, c1 = (row g, cols 2t, 2t+1)  c2, c3 = (row g+8, cols 2t, 2t+1)
//   In a .b32 register the lower column (or row, for B) is in the low 16 bits.
// ldmatrix.m8n8.x4.b16: lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (16 bytes each);
// register i of lane l receives matrix i's (row l/4, cols 2(l%4), 2(l%4)+1); with .trans it
// receives (rows 2(l%4), 2(l%4)+1; col l/4) instead, i.e. the transposed matrix's fragment.
//   * K as B of the score MMA: B(k = dim, n = token) = row `token`, column `dim` of the tile, so a
//     stored 8x8 block (8 tokens x 8 dims) read without .trans gives (token g, dims 2t, 2t+1) = reg0.
//   * V as B of the output MMA: B(k = token, n = dim) — the stored block (8 tokens x 8 dims) read
//     with .trans gives (tokens 2t, 2t+1; dim g) = reg0.
//   * P as A of the output MMA comes straight from the score accumulators: for k-step kk (tokens
//     16kk..16kk+15), reg0 = C-tile 2kk (c0, c1), reg1 = C-tile 2kk (c2, c3), reg2 = C-tile 2kk+1
//     (c0, c1), reg3 = C-tile 2kk+1 (c2, c3) — the columns line up exactly (FlashAttention-2's trick).
#pragma once
#include "tensor_core.cuh"

namespace mla {  // set in dsv2_lib/ops/mla_decode.py, which sizes the grid and the shared memory with them
constexpr int HEADS = DSV2_MLA_HEADS;  // heads per block: the M of the MMA
constexpr int WARPS = DSV2_MLA_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int TILE = DSV2_MLA_TILE;    // cache rows per pipeline stage
constexpr int ROW_PAD = DSV2_MLA_ROW_PAD;    // elements of padding per staged row
constexpr int SS_PITCH = DSV2_MLA_SS_PITCH;  // floats per lane of the partial-score exchange: 16 + 4 of padding
static_assert(HEADS == 16 && ROW_PAD % 8 == 0, "16 heads = the MMA's M; 16-byte aligned staged rows");
static_assert(SS_PITCH % 4 == 0 && SS_PITCH >= TILE / 2, "a lane's TILE / 2 partial scores, as float4s");
}  // namespace mla

// V consecutive floats (global or shared memory): a float2 for V = 2, else V/4 16-byte vectors
// (common.cuh's Vec16). Every caller takes V = 2 or a multiple of 4: the merge's widths (2 .. 16, and
// its shared-memory vectors of 2 or 4) and the score exchange's SF = 4 at 4 warps a block.
template <int V>
__device__ __forceinline__ void load_cols(float (&dst)[V], const float* __restrict__ src) {
    static_assert(V == 2 || (V > 0 && V % 4 == 0), "a float2 or 16-byte vectors: no width-1 path");
    if constexpr (V == 2) {
        const float2 v = *reinterpret_cast<const float2*>(src);
        dst[0] = v.x; dst[1] = v.y;
    } else {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            const Vec16<float> v = load16(src + k);
#pragma unroll
            for (int u = 0; u < 4; ++u) dst[k + u] = v.v[u];
        }
    }
}

template <int V>
__device__ __forceinline__ void store_cols(float* __restrict__ dst, const float (&src)[V]) {
    static_assert(V == 2 || (V > 0 && V % 4 == 0), "a float2 or 16-byte vectors: no width-1 path");
    if constexpr (V == 2) {
        *reinterpret_cast<float2*>(dst) = make_float2(src[0], src[1]);
    } else {
#pragma unroll
        for (int k = 0; k < V; k += 4) {
            Vec16<float> v;
#pragma unroll
            for (int u = 0; u < 4; ++u) v.v[u] = src[k + u];
            store16(dst + k, v);
        }
    }
}

// Attend rows [t_begin, t_end) of entry b (t_end <= its length) with heads h0 .. h0+15 and write
// head h's normalised o = O / l to o_dst + h * o_stride (DL fp32) and, if lse_dst is not nullptr,
// lse = m + log2(l) to lse_dst[h * lse_stride]. `rows` is the entry's slot (contiguous) or the whole
// paged cache with `table` the entry's block-table row. Called by every thread of the block with
// the same arguments; a block may call it several times (the balanced schedule does).
// Dynamic shared memory (_shared_bytes in dsv2_lib/ops/mla_decode.py sizes it from the same constants):
// STAGES * TILE rows of PITCH = D + ROW_PAD elements (the 16-byte pad puts the 8 rows an ldmatrix reads
// in 8 different bank groups), then WARPS x 32 lanes x SS_PITCH fp32 partial scores.
template <typename T, int DL, int DR, int STAGES, bool PAGED>
__device__ __forceinline__ void attend_rows(
    float* o_dst, long long o_stride, float* lse_dst, long long lse_stride, const T* __restrict__ q,
    const T* __restrict__ rows, const int* __restrict__ table, int table_width, int block_size, long long num_rows,
    int b, int h0, int H, int t_begin, int t_end, float scale_log2) {
    using namespace mla;
    constexpr int D = DL + DR, PITCH = D + ROW_PAD;
    constexpr int KS = D / 16;                 // k-steps of the score product
    constexpr int QKS = (KS + WARPS - 1) / WARPS;  // k-steps per warp (w, w + 4, ...)
    constexpr int NT_S = TILE / 8;             // score n-tiles (8 tokens each)
    constexpr int COLS = DL / WARPS;           // output columns per warp
    constexpr int NT_O = COLS / 8;             // output n-tiles per warp
    constexpr int VEC_PER_ROW = D / 8;         // 16-byte vectors per cache row
    constexpr int SF = NT_S * 4 / WARPS;       // summed partial scores each warp finishes, per lane
    static_assert(D % 16 == 0 && DL % (16 * WARPS) == 0 && TILE % 16 == 0 && TILE % WARPS == 0, "tile shapes");
    static_assert(NT_S * 4 % WARPS == 0 && (SF == 2 || SF % 4 == 0),  // 4 at 4 warps; 16 warps would make it 1
                  "the exchange's share per warp: 2 floats or a multiple of 4 (load_cols has no width 1)");

    extern __shared__ __align__(16) unsigned char smem_raw[];
    T* sk = reinterpret_cast<T*>(smem_raw);                                      // [STAGES][TILE][PITCH]
    float* ss = reinterpret_cast<float*>(smem_raw + sizeof(T) * STAGES * TILE * PITCH);  // [WARPS][32][SS_PITCH]
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;

    const int ntiles = t_end > t_begin ? (t_end - t_begin + TILE - 1) / TILE : 0;
    __syncthreads();  // the shared buffers of a previous call on this block are free

    // PAGED: lane l's cache row for token l of tile `it` (-1: past the chunk, or a bad table entry).
    // Every warp translates the tile's 32 tokens itself — one division and one table read per lane,
    // no synchronisation — and the loop below asks for a tile's rows one iteration before it stages
    // the tile, so the table read's latency hides behind a tile's arithmetic.
    auto tile_rows = [&](int it) -> long long {
        if constexpr (PAGED) {
            const int tok = t_begin + it * TILE + lane;
            if (it >= ntiles || tok >= t_end) return -1;
            const int blk_i = tok / block_size;
            const int blk = blk_i < table_width ? table[blk_i] : -1;
            const long long row = (long long)blk * block_size + (tok - blk_i * block_size);
            return blk >= 0 && row < num_rows ? row : -1;
        } else {
            return -1;
        }
    };
    // Stage tile `it` of this range into buffer `buf`: warp w copies rows w, w + WARPS, ...; lane l the
    // row's 16-byte vectors l, l + 32, ... (72 per row for D = 576: two for every lane, a third for lanes
    // 0-7). Row and column are compile-time offsets from (warp, lane), so a copy costs a few
    // instructions, where dealing the tile's vectors round-robin over the threads would cost a division
    // and tens of instructions per copy. PAGED: row r's address comes from lane r's `lane_row` (a
    // shuffle with the same source lane for the whole warp).
    auto load_tile = [&](int it, int buf, long long lane_row) {
        T* dst = sk + buf * TILE * PITCH;
#pragma unroll
        for (int i = 0; i < TILE / WARPS; ++i) {
            const int r = warp + i * WARPS;
            const T* src;
            bool in;
            if constexpr (PAGED) {
                // a position past the context is masked to -inf below; a bad table entry reads as zeros
                const long long row = __shfl_sync(0xffffffffu, lane_row, r);
                in = row >= 0;
                src = rows + (in ? row : 0) * D;
            } else {
                const int tok = t_begin + it * TILE + r;
                in = tok < t_end;
                src = rows + (long long)(in ? tok : t_begin) * D;
            }
#pragma unroll
            for (int j = 0; j < (VEC_PER_ROW + 31) / 32; ++j) {
                const int c = (lane + 32 * j) * 8;
                if (c < D) cp_async16(dst + r * PITCH + c, src + c, in ? 16 : 0);
            }
        }
    };

    // This warp's k-steps of Q as A fragments (rows = heads h0..h0+15; heads >= H are zero).
    unsigned qa[QKS][4];
    {
        const int hg = h0 + g, hg8 = h0 + g + 8;
        const T* q0 = q + ((long long)b * H + hg) * D;
        const T* q8 = q + ((long long)b * H + hg8) * D;
#pragma unroll
        for (int i = 0; i < QKS; ++i) {
            const int k0 = (warp + i * WARPS) * 16 + 2 * t;
            const bool ks_ok = warp + i * WARPS < KS;
            qa[i][0] = ks_ok && hg < H ? *reinterpret_cast<const unsigned*>(q0 + k0) : 0u;
            qa[i][1] = ks_ok && hg8 < H ? *reinterpret_cast<const unsigned*>(q8 + k0) : 0u;
            qa[i][2] = ks_ok && hg < H ? *reinterpret_cast<const unsigned*>(q0 + k0 + 8) : 0u;
            qa[i][3] = ks_ok && hg8 < H ? *reinterpret_cast<const unsigned*>(q8 + k0 + 8) : 0u;
        }
    }

    float o[NT_O][4];
#pragma unroll
    for (int n = 0; n < NT_O; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    float m0 = minus_inf(), m1 = minus_inf();  // running max of rows g and g+8 (log2 domain)
    float l0 = 0.f, l1 = 0.f;              // this thread's share of the running sums

    // Pipeline prologue: tiles 0 .. STAGES-2 in flight (always commit, so group counts match).
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ntiles) load_tile(s, s, tile_rows(s));
        cp_async_commit();
    }
    long long rows_ahead = tile_rows(STAGES - 1);  // PAGED: the rows of the next tile to stage

    for (int it = 0; it < ntiles; ++it) {
        cp_async_wait<STAGES - 2>();  // this thread's copies of tile `it` have landed
        __syncthreads();              // everyone's have; everyone is done with tile it-1 and with ss
        {
            const int next = it + STAGES - 1;  // refill the buffer tile it-1 used
            if (next < ntiles) load_tile(next, next % STAGES, rows_ahead);
            cp_async_commit();
            if constexpr (PAGED) rows_ahead = tile_rows(next + 1);
        }
        const T* tile = sk + (it % STAGES) * TILE * PITCH;
        const int tok0 = t_begin + it * TILE;

        // ---- partial scores over this warp's k-steps -------------------------------------------
        float s[NT_S][4];
#pragma unroll
        for (int j = 0; j < NT_S; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
        for (int i = 0; i < QKS; ++i) {
            const int ks = warp + i * WARPS;
            if (ks < KS) {
#pragma unroll
                for (int jp = 0; jp < NT_S / 2; ++jp) {
                    // matrices: (n-tile 2jp, dims lo), (2jp, hi), (2jp+1, lo), (2jp+1, hi)
                    const int mi = lane >> 3, r = lane & 7;
                    const int tok = 8 * (2 * jp + (mi >> 1)) + r, dim = ks * 16 + 8 * (mi & 1);
                    unsigned bf[4];
                    ldmatrix_x4(bf, tile + tok * PITCH + dim);
                    mma16816<T>(s[2 * jp], qa[i], bf[0], bf[1]);
                    mma16816<T>(s[2 * jp + 1], qa[i], bf[2], bf[3]);
                }
            }
        }
        // ---- sum the WARPS partial tiles, in two steps (same order everywhere: identical S in every warp) --
        // A lane's 16 partials are contiguous; lanes SS_PITCH floats apart, so the 8 lanes of each 128-bit
        // access phase hit 8 different groups of 4 banks. Step 1: warp w finishes floats [w·SF, (w+1)·SF) of
        // every lane's 16 — the sum over all warps' partials, in warp order — and leaves it in warp 0's slot
        // (only warp w reads or writes those floats). Step 2: every warp reads the 16 sums. Each warp loads
        // WARPS·SF + 16 floats a lane instead of WARPS·16, so the exchange does not grow with the block.
        float* my_ss = ss + (warp * 32 + lane) * SS_PITCH;
#pragma unroll
        for (int j = 0; j < NT_S; ++j)
            *reinterpret_cast<float4*>(my_ss + 4 * j) = make_float4(s[j][0], s[j][1], s[j][2], s[j][3]);
        __syncthreads();
        {
            float sum[SF] = {};
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                float v[SF];
                load_cols<SF>(v, ss + (w * 32 + lane) * SS_PITCH + warp * SF);
#pragma unroll
                for (int e = 0; e < SF; ++e) sum[e] += v[e];
            }
            store_cols<SF>(ss + lane * SS_PITCH + warp * SF, sum);
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < NT_S; ++j) {
            const float4 v = *reinterpret_cast<const float4*>(ss + lane * SS_PITCH + 4 * j);
            const float acc[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int tok = tok0 + 8 * j + 2 * t + (e & 1);
                s[j][e] = tok < t_end ? acc[e] * scale_log2 : minus_inf();
            }
        }

        // ---- online softmax (rows g: e = 0, 1; rows g+8: e = 2, 3) ----------------------------
        float mx0 = minus_inf(), mx1 = minus_inf();
#pragma unroll
        for (int j = 0; j < NT_S; ++j) {
            mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
        }
        // the 4 lanes of a quad (lanes 4g..4g+3) hold the 8 columns of rows g, g+8
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float new0 = fmaxf(m0, mx0), new1 = fmaxf(m1, mx1);  // finite: tile has a valid token
        const float alpha0 = exp2f(m0 - new0), alpha1 = exp2f(m1 - new1);  // exp2(-inf) = 0 at the start
        m0 = new0;
        m1 = new1;
        unsigned pa[NT_S / 2][4];  // P as A fragments, one per 16-token k-step
#pragma unroll
        for (int j = 0; j < NT_S; ++j) {
            // probabilities rounded to T: the MMA multiplies exactly these, and l sums exactly these
            const float p0 = round_to<T>(exp2f(s[j][0] - new0)), p1 = round_to<T>(exp2f(s[j][1] - new0));
            const float p2 = round_to<T>(exp2f(s[j][2] - new1)), p3 = round_to<T>(exp2f(s[j][3] - new1));
            l0 = l0 * (j == 0 ? alpha0 : 1.f) + p0 + p1;
            l1 = l1 * (j == 0 ? alpha1 : 1.f) + p2 + p3;
            pa[j >> 1][(j & 1) * 2 + 0] = pack2<T>(p0, p1);
            pa[j >> 1][(j & 1) * 2 + 1] = pack2<T>(p2, p3);
        }
        if (__any_sync(0xffffffffu, alpha0 != 1.f || alpha1 != 1.f)) {  // once the maxima settle, x * 1 is skipped
#pragma unroll
            for (int n = 0; n < NT_O; ++n) {
                o[n][0] *= alpha0; o[n][1] *= alpha0;
                o[n][2] *= alpha1; o[n][3] *= alpha1;
            }
        }

        // ---- O[:, this warp's columns] += P . V ------------------------------------------------
#pragma unroll
        for (int kk = 0; kk < TILE / 16; ++kk) {
#pragma unroll
            for (int np = 0; np < NT_O / 2; ++np) {
                // matrices: (tokens lo, n-tile 2np), (tokens hi, 2np), (lo, 2np+1), (hi, 2np+1)
                const int mi = lane >> 3, r = lane & 7;
                const int tok = 16 * kk + 8 * (mi & 1) + r, dim = warp * COLS + 16 * np + 8 * (mi >> 1);
                unsigned bf[4];
                ldmatrix_x4_trans(bf, tile + tok * PITCH + dim);
                mma16816<T>(o[2 * np], pa[kk], bf[0], bf[1]);
                mma16816<T>(o[2 * np + 1], pa[kk], bf[2], bf[3]);
            }
        }
    }
    cp_async_wait<0>();  // nothing may be in flight when the block exits

    // ---- normalise and write this split's result ---------------------------------------------
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const float inv0 = l0 > 0.f ? 1.f / l0 : 0.f, inv1 = l1 > 0.f ? 1.f / l1 : 0.f;
    const int hA = h0 + g, hB = h0 + g + 8;
#pragma unroll
    for (int n = 0; n < NT_O; ++n) {
        const int col = warp * COLS + 8 * n + 2 * t;
        if (hA < H) *reinterpret_cast<float2*>(o_dst + hA * o_stride + col) = make_float2(o[n][0] * inv0, o[n][1] * inv0);
        if (hB < H) *reinterpret_cast<float2*>(o_dst + hB * o_stride + col) = make_float2(o[n][2] * inv1, o[n][3] * inv1);
    }
    if (lse_dst != nullptr && warp == 0 && t == 0) {
        if (hA < H) lse_dst[hA * lse_stride] = l0 > 0.f ? m0 + log2f(l0) : minus_inf();
        if (hB < H) lse_dst[hB * lse_stride] = l1 > 0.f ? m1 + log2f(l1) : minus_inf();
    }
}

// Merge `count` partial results of one (entry, head) into out_row: partial s is o_first + s * o_stride
// (DL fp32) with lse lse_first[s * lse_stride]. Block of COMBINE_WARPS warps, 32 * V columns (blockIdx.x
// picks them; lane l owns V consecutive ones, loaded as float2 for V = 2, else as V/4 float4). Every warp
// first finds M = max_s lse_s with its lanes striding over the partials and a shuffle reduction (a serial
// loop over hundreds of them would cost microseconds); then warp w sums the partials w, w+8, ... and the
// 8 warps' sums meet in shared memory. out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M); all partials
// empty (M = -inf) gives zeros. The order of the sums is fixed and the same for every V: the result is
// deterministic, bit for bit whatever the width. V = 2 (64 columns) makes many blocks for a few rows of
// many partials (batch 1, long context); a wide V makes few blocks for many rows of a few partials (large
// batches), where most of a narrow block's time would be its fixed cost.
constexpr int COMBINE_WARPS = DSV2_MLA_COMBINE_WARPS;  // set in dsv2_lib/ops/mla_decode.py

template <int V>
__device__ __forceinline__ void merge_partials(float* __restrict__ out_row, const float* __restrict__ o_first,
                                               long long o_stride, const float* __restrict__ lse_first,
                                               long long lse_stride, int count, int dl) {
    constexpr int U = V == 2 ? 2 : 4;  // floats per shared-memory vector: lane l's k-th vector sits at
                                        // [warp][k][l], so a warp's 32 vectors are contiguous (no conflicts)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float M = minus_inf();
    for (int s = lane; s < count; s += 32) M = fmaxf(M, lse_first[s * lse_stride]);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, offset));
    const int c = (blockIdx.x * 32 + lane) * V;
    float acc[V];
#pragma unroll
    for (int u = 0; u < V; ++u) acc[u] = 0.f;
    float den = 0.f;
    if (M != minus_inf()) {
#pragma unroll 4
        for (int s = warp; s < count; s += COMBINE_WARPS) {
            const float w = exp2f(lse_first[s * lse_stride] - M);  // an empty partial: exp2(-inf) = 0
            den += w;
            if (c < dl) {
                float v[V];
                load_cols<V>(v, o_first + s * o_stride + c);
#pragma unroll
                for (int u = 0; u < V; ++u) acc[u] += w * v[u];
            }
        }
    }
    __shared__ __align__(16) float sacc[COMBINE_WARPS * 32 * V];
    __shared__ float sden[COMBINE_WARPS];
#pragma unroll
    for (int k = 0; k < V; k += U) {
        float part[U];
#pragma unroll
        for (int u = 0; u < U; ++u) part[u] = acc[k + u];
        store_cols<U>(sacc + ((warp * (V / U) + k / U) * 32 + lane) * U, part);
    }
    if (lane == 0) sden[warp] = den;
    __syncthreads();
    if (warp == 0 && c < dl) {
        float sum[V], part[U];
#pragma unroll
        for (int u = 0; u < V; ++u) sum[u] = 0.f;
        float d = 0.f;
#pragma unroll
        for (int w = 0; w < COMBINE_WARPS; ++w) {
#pragma unroll
            for (int k = 0; k < V; k += U) {
                load_cols<U>(part, sacc + ((w * (V / U) + k / U) * 32 + lane) * U);
#pragma unroll
                for (int u = 0; u < U; ++u) sum[k + u] += part[u];
            }
            d += sden[w];
        }
        const float r = d > 0.f ? 1.f / d : 0.f;
#pragma unroll
        for (int u = 0; u < V; ++u) sum[u] *= r;
        store_cols<V>(out_row + c, sum);
    }
}
