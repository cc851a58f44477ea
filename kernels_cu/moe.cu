// DeepSeekMoE on the GPU: router, alignment by expert, grouped expert GEMMs, GEMV decode path, combine.
//
//   logits [T, E] fp32 --topk_softmax--> weights [T, k] fp32, ids [T, k] int64
//   ids --moe_align--> sorted_rows [cap] (choice c = t*k + j, or -1 = padding), slot_of [T*k],
//                      tile_expert [max_tiles] (expert of each BLOCK-row tile, -1 = unused), offsets [E+1]
//   x [T, H] --moe_gemm<GATE_UP>--> h [cap, I] = silu(x W_g^T) * (x W_u^T), rows in sorted order
//   h        --moe_gemm<DOWN>-----> y [cap, H] = h W_d^T
//   y --moe_combine--> out [T, H] = round(sum_j w[t, j] * y[slot_of[t*k + j]]) (+ shared [T, H])
// and for a few tokens (decode): moe_route_few (the router, and the shared experts' gate|up beside it),
// then moe_gemv_gate_up / moe_gemv_down_combine over the T*k choices directly, the shared experts as more
// choices of weight 1 (y rows in choice order; the down launch also does the combine); for tens of tokens moe_skinny<GATE_UP / DOWN> on
// tiles of 16 sorted rows (moe_align with BLOCK = 16), the tokens as the narrow side of the mma.
// The router of one token (route_token) and silu_mul live in moe_common.cuh, shared with chapter 08's
// lesson kernels (lessons/moe_grouped.cu).
//
// Rounding follows the PyTorch reference (dsv2_lib/ops/moe_experts.py: routed_experts): the gate|up GEMM output is
// rounded to T before SwiGLU, SwiGLU's output is rounded to T, the down GEMM output is rounded to T,
// the weighted sum is fp32 (products rounded, then added: no FMA), rounded to T, then the shared
// experts' output is added in T. All accumulation is fp32.
//
// Bounds: ids outside [0, E) are never used as an index: moe_align drops them (slot -1), the GEMV
// kernels write zeros for them, combine skips slot -1. Everything else (shapes, E <= 256, k <= 32,
// H and I multiples of 8, 16-byte alignment) the host checks before launch (dsv2_lib/ops/moe_routing.py,
// moe_experts.py).
#include "tensor_core.cuh"
#include "moe_common.cuh"

__global__ void topk_softmax(float* __restrict__ weights, long long* __restrict__ ids, const float* __restrict__ logits,
                             int T, int E, int k, int n_group, int topk_group, int renorm, float scale) {
    wait_for_prior_grids();
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T) return;  // whole warps leave together (t is uniform over a warp)
    route_and_store(weights, ids, nullptr, logits, t, E, k, n_group, topk_group, renorm, scale, threadIdx.x & 31);
}

// ------------------------------------------------------------------------------------------------
// Alignment. G blocks of ALIGN_THREADS = 1024 threads (32 warps), G = ceil(n / 2048) for the n = T*k
// choices (moe_routing.py): block g owns the contiguous range [g*C, g*C + C) of the choices
// (C = ceil(n / G)) and warp w of it the w-th of 32 equal parts of that range. Dynamic shared
// memory: cnt [32][E], tot [E], before [E] and seg [E+1] ints (32: the warps of a block). No atomics
// on global memory, no host synchronisation:
//   1. cnt[w][e] = how many of warp w's choices go to expert e;
//   2. cnt[w][e] := sum over w' < w of cnt[w'][e] (exclusive, per expert); with several blocks,
//      moe_align_count has run pass 1 over the same ranges and left each block's counts in
//      counts [G][E], from which every block takes tot[e] (all blocks) and before[e] (blocks < g);
//      seg[e] = padded start of expert e's segment: the sum over e' < e of ceil(tot[e'] / BLOCK) * BLOCK;
//   3. each warp walks its range in order, 32 choices at a time; lanes with the same expert find each
//      other with __match_any_sync, and the choice's position is seg[e] + before[e] + cnt[w][e] +
//      (number of lower lanes with the same expert). So positions are stable: by choice index, i.e. by token.
// Why G blocks: a block runs on one SM, whose load/store unit (the shared-memory atomics, the
// scattered stores) sets its pace, so 24,576 choices (8 x 512 tokens) in one block would take tens of
// microseconds; G blocks on G SMs share the work.
// Outputs are sized for the worst case by the host: max_tiles = (n + E*(BLOCK-1)) / BLOCK tiles,
// cap = max_tiles * BLOCK rows. sum_e ceil(c_e/BLOCK) <= (n + E*(BLOCK-1)) / BLOCK, so every write fits.
// Each row and tile is written once: a choice's row by its warp, expert e's padding rows and tiles by
// one thread of block e mod G, the rows and tiles past the last segment by all blocks.
// ------------------------------------------------------------------------------------------------
// This warp's part [lo, hi) of this block's range of the n choices (block g of gridDim.x).
__device__ __forceinline__ void align_range(int n, int& lo, int& hi) {
    const int C = (n + gridDim.x - 1) / gridDim.x, block_lo = blockIdx.x * C, block_hi = min(n, block_lo + C);
    const int nwarps = blockDim.x >> 5, L = (C + nwarps - 1) / nwarps;
    lo = min(block_hi, block_lo + (int)(threadIdx.x >> 5) * L);
    hi = min(block_hi, lo + L);
}

// Pass 1: zero cnt [warps][E], count each warp's choices per expert into it (ids outside [0, E) are
// not counted), then synchronise the block.
__device__ __forceinline__ void align_count(int* cnt, const long long* __restrict__ ids, int n, int E) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int i = threadIdx.x; i < (int)(blockDim.x >> 5) * E; i += blockDim.x) cnt[i] = 0;
    __syncthreads();
    int lo, hi;
    align_range(n, lo, hi);
    for (int i = lo + lane; i < hi; i += 32) {
        const long long e = ids[i];
        if (e >= 0 && e < E) atomicAdd(&cnt[warp * E + (int)e], 1);  // shared-memory counter
    }
    __syncthreads();
}

// With G > 1 blocks: counts[g][e] = how many of block g's choices go to expert e.
__global__ void moe_align_count(int* __restrict__ counts, const long long* __restrict__ ids, int n, int E) {
    wait_for_prior_grids();
    extern __shared__ int smem[];
    int* cnt = smem;  // [warps][E]
    align_count(cnt, ids, n, E);
    for (int e = threadIdx.x; e < E; e += blockDim.x) {
        int c = 0;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) c += cnt[w * E + e];
        counts[blockIdx.x * E + e] = c;
    }
}

// counts: moe_align_count's [G][E] with G = gridDim.x > 1, or nullptr for one block.
__global__ void moe_align(int* __restrict__ sorted_rows, int* __restrict__ slot_of, int* __restrict__ tile_expert,
                          int* __restrict__ offsets, const long long* __restrict__ ids,
                          const int* __restrict__ counts, int n, int E, int block, int max_tiles, int cap) {
    wait_for_prior_grids();
    extern __shared__ int smem[];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5, g = blockIdx.x,
              G = gridDim.x;
    int* cnt = smem;             // [warps][E]
    int* tot = cnt + nwarps * E;  // [E]: choices per expert, all blocks
    int* before = tot + E;       // [E]: choices per expert in blocks < g
    int* seg = before + E;       // [E + 1]

    align_count(cnt, ids, n, E);  // pass 1
    for (int e = tid; e < E; e += blockDim.x) {  // pass 2: per expert, over warps
        int c = 0;
        for (int w = 0; w < nwarps; ++w) { const int x = cnt[w * E + e]; cnt[w * E + e] = c; c += x; }
        tot[e] = counts == nullptr ? c : 0;
        before[e] = 0;
    }
    __syncthreads();
    if (counts != nullptr) {  // the other blocks' counts (integer sums: the order of the atomics is immaterial)
        for (int j = tid; j < G * E; j += blockDim.x) {
            const int x = counts[j], e = j % E;
            atomicAdd(&tot[e], x);
            if (j / E < g) atomicAdd(&before[e], x);
        }
        __syncthreads();
    }
    if (warp == 0) {  // padded exclusive prefix sum over experts: lane l takes experts [l*P, l*P + P), E <= 256
        const int P = (E + 31) / 32, e0 = min(E, lane * P), e1 = min(E, e0 + P);
        int mine = 0;
        for (int e = e0; e < e1; ++e) mine += (tot[e] + block - 1) / block * block;
        int incl = mine;
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int y = __shfl_up_sync(FULL, incl, offset);
            if (lane >= offset) incl += y;
        }
        for (int e = e0, acc = incl - mine; e < e1; ++e) { seg[e] = acc; acc += (tot[e] + block - 1) / block * block; }
        if (lane == 31) seg[E] = incl;
    }
    __syncthreads();
    if (g == 0)
        for (int e = tid; e <= E; e += blockDim.x) offsets[e] = seg[e];
    for (int e = g + G * tid; e < E; e += G * blockDim.x) {  // expert e's padding rows and tiles
        for (int r = seg[e] + tot[e]; r < seg[e + 1]; ++r) sorted_rows[r] = -1;
        for (int t = seg[e] / block; t < seg[e + 1] / block; ++t) tile_expert[t] = e;
    }
    for (int r = seg[E] + g * blockDim.x + tid; r < cap; r += G * blockDim.x) sorted_rows[r] = -1;
    for (int t = seg[E] / block + g * blockDim.x + tid; t < max_tiles; t += G * blockDim.x) tile_expert[t] = -1;

    int lo, hi;
    align_range(n, lo, hi);
    for (int base = lo; base < hi; base += 32) {  // pass 3 (base is uniform over the warp)
        const int i = base + lane;
        const bool inside = i < hi;
        const long long e64 = inside ? ids[i] : -1;
        const bool valid = inside && e64 >= 0 && e64 < E;
        const int e = valid ? (int)e64 : 0;
        const unsigned peers = __match_any_sync(FULL, valid ? e : E + lane);  // invalid lanes: alone
        const int rank = __popc(peers & ((1u << lane) - 1u));
        int pos = -1;
        if (valid) {
            pos = seg[e] + before[e] + cnt[warp * E + e] + rank;
            sorted_rows[pos] = i;
        }
        if (inside) slot_of[i] = pos;
        __syncwarp();  // every lane has read cnt before the leader moves it on
        if (valid && rank == 0) cnt[warp * E + e] += __popc(peers);
        __syncwarp();
    }
}

// ------------------------------------------------------------------------------------------------
// Grouped GEMM on tensor cores: mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16 with floating point type"), with
// g = lane >> 2 (groupID) and q = lane & 3 (threadID_in_group); each .b32 register holds two
// consecutive 16-bit elements, the lower index in the low half:
//   A (16 x 16, row-major): a[0] = A[g][2q..2q+1],   a[1] = A[g+8][2q..2q+1],
//                           a[2] = A[g][2q+8..2q+9], a[3] = A[g+8][2q+8..2q+9]
//   B (16 x 8, "col"):      b[0] = B[2q..2q+1][g],   b[1] = B[2q+8..2q+9][g]
//                           B[k][n] = W[n][k] for a weight W [N, K] stored row-major (nn.Linear's
//                           layout), so each register is two consecutive k of one weight row.
//   C (16 x 8, fp32):       c[0] = C[g][2q], c[1] = C[g][2q+1], c[2] = C[g+8][2q], c[3] = C[g+8][2q+1]
//
// Block: 128 threads = 4 warps in a 2 x 2 grid; block tile BM = 64 rows x BN = 128 weight rows,
// K step BK = 32. Warp (wm, wn) owns rows wm*32 + [0, 32) and weight rows wn*64 + [0, 64): 2 x 8 mma
// tiles, 64 fp32 accumulators per thread. Shared tiles are row-major with a row pitch of
// BK + 8 = 40 elements (80 bytes): 16-byte stores stay aligned, and the 32 lanes' 4-byte fragment
// loads (row g, word q) hit banks (20 g + q) mod 32, all distinct: no bank conflicts.
// Global -> register -> shared double buffering: the next K step's loads are in flight while the
// tensor cores work on this one.
//
// GATE_UP: tile rows are the sorted choices (x[token] for a real choice, 0 for padding); weight row r
//   of the block's 128 maps to column n0 + (r / 64) * 32 + r % 32 of the gate (r % 64 < 32) or up
//   (r % 64 >= 32) half: so warp wn's mma tiles nj = 0..3 hold gate columns and nj + 4 the up columns
//   with the same index, in the same registers' positions, and SwiGLU fuses into the epilogue.
//   n0 = blockIdx.y * 64; out h [cap, I].
// DOWN: tile rows are rows of h; weight row r = output column n0 + r, n0 = blockIdx.y * 128; out y [cap, H].
// blockIdx.x = tile; tiles past the last expert's segment (tile_expert = -1) exit at once.
// ------------------------------------------------------------------------------------------------
// BM, BN and the block are set in dsv2_lib/ops/moe_routing.py (with the GEMV and skinny geometry below).
constexpr int BM = DSV2_MOE_GEMM_BM, BN = DSV2_MOE_GEMM_BN, BK = 32, PITCH = BK + 8;
constexpr int GEMM_THREADS = 32 * DSV2_MOE_GEMM_WARPS;
static_assert(BM == 64 && BN == 128 && GEMM_THREADS == 128, "a 2 x 2 grid of warps, 32 rows x 64 weight rows each");

__device__ __forceinline__ unsigned ld32(const void* p) { return *reinterpret_cast<const unsigned*>(p); }

template <typename T, bool GATE_UP>
__global__ void __launch_bounds__(GEMM_THREADS)
moe_gemm(T* __restrict__ out, const T* __restrict__ a_src, const T* __restrict__ w_all,
         const int* __restrict__ sorted_rows, const int* __restrict__ tile_expert,
         int n_out, int K, int topk) {
    wait_for_prior_grids();
    const int tile = blockIdx.x;
    const int e = tile_expert[tile];
    if (e < 0) return;  // uniform over the block, before any barrier
    __shared__ alignas(16) T As[BM][PITCH];
    __shared__ alignas(16) T Bs[BN][PITCH];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int wm = warp >> 1, wn = warp & 1, g = lane >> 2, q = lane & 3;
    const int n0 = blockIdx.y * (GATE_UP ? BN / 2 : BN);
    const long long w_rows = GATE_UP ? 2LL * n_out : (long long)n_out;
    const T* W = w_all + (long long)e * w_rows * K;

    // Each thread stages 2 vectors of A and 4 of B per K step: vector v covers row v / 4, k (v % 4) * 8.
    const T* a_ptr[2];
    const T* b_ptr[4];
#pragma unroll
    for (int l = 0; l < 2; ++l) {
        const int v = tid + l * GEMM_THREADS, r = v >> 2, kv = (v & 3) * 8;
        const long long p = (long long)tile * BM + r;
        const T* src = nullptr;
        if constexpr (GATE_UP) {
            const int c = sorted_rows[p];
            if (c >= 0) src = a_src + (long long)(c / topk) * K + kv;
        } else {
            src = a_src + p * K + kv;  // h rows of a used tile always exist (padding rows are 0)
        }
        a_ptr[l] = src;
    }
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const int v = tid + l * GEMM_THREADS, r = v >> 2, kv = (v & 3) * 8;
        int col;
        long long wrow;
        if constexpr (GATE_UP) {
            col = n0 + (r >> 6) * 32 + (r & 31);
            wrow = ((r >> 5) & 1) ? (long long)n_out + col : col;  // rows 32..63 of each 64: up
        } else {
            col = n0 + r;
            wrow = col;
        }
        b_ptr[l] = col < n_out ? W + wrow * K + kv : nullptr;
    }

    Vec16<T> ra[2], rb[4];
    Vec16<T> zero;
#pragma unroll
    for (int j = 0; j < Vec16<T>::N; ++j) zero.v[j] = from_float<T>(0.f);
    auto load = [&](int k0) {  // K % 8 == 0 (host check), so a vector is either all inside K or all outside
#pragma unroll
        for (int l = 0; l < 2; ++l) {
            const int kv = ((tid + l * GEMM_THREADS) & 3) * 8;
            ra[l] = (a_ptr[l] && k0 + kv < K) ? load16(a_ptr[l] + k0) : zero;
        }
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const int kv = ((tid + l * GEMM_THREADS) & 3) * 8;
            rb[l] = (b_ptr[l] && k0 + kv < K) ? load16(b_ptr[l] + k0) : zero;
        }
    };
    auto stage = [&]() {
#pragma unroll
        for (int l = 0; l < 2; ++l) { const int v = tid + l * GEMM_THREADS; store16(&As[v >> 2][(v & 3) * 8], ra[l]); }
#pragma unroll
        for (int l = 0; l < 4; ++l) { const int v = tid + l * GEMM_THREADS; store16(&Bs[v >> 2][(v & 3) * 8], rb[l]); }
    };

    float acc[2][8][4] = {};
    load(0);
    stage();
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += BK) {
        const bool more = k0 + BK < K;
        if (more) load(k0 + BK);  // in flight during the mma below
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            unsigned a[2][4], b[8][2];
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                const int r = wm * 32 + mi * 16 + g;
                a[mi][0] = ld32(&As[r][kk + 2 * q]);
                a[mi][1] = ld32(&As[r + 8][kk + 2 * q]);
                a[mi][2] = ld32(&As[r][kk + 2 * q + 8]);
                a[mi][3] = ld32(&As[r + 8][kk + 2 * q + 8]);
            }
#pragma unroll
            for (int nj = 0; nj < 8; ++nj) {
                const int c = wn * 64 + nj * 8 + g;
                b[nj][0] = ld32(&Bs[c][kk + 2 * q]);
                b[nj][1] = ld32(&Bs[c][kk + 2 * q + 8]);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi)
#pragma unroll
                for (int nj = 0; nj < 8; ++nj) mma16816<T>(acc[mi][nj], a[mi], b[nj][0], b[nj][1]);
        }
        __syncthreads();  // everyone is done with this K step's tiles
        if (more) {
            stage();
            __syncthreads();
        }
    }

    // Epilogue: C fragment element c of tile (mi, nj) is row wm*32 + mi*16 + g + 8*(c >> 1),
    // column (of the block's 128) wn*64 + nj*8 + 2q + (c & 1).
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const long long p = (long long)tile * BM + wm * 32 + mi * 16 + g + 8 * (c >> 1);
            if constexpr (GATE_UP) {
#pragma unroll
                for (int nj = 0; nj < 4; ++nj) {
                    const int n = n0 + wn * 32 + nj * 8 + 2 * q + (c & 1);
                    if (n < n_out)
                        out[p * n_out + n] = from_float<T>(silu_mul(round_to<T>(acc[mi][nj][c]), round_to<T>(acc[mi][nj + 4][c])));
                }
            } else {
#pragma unroll
                for (int nj = 0; nj < 8; ++nj) {
                    const int n = n0 + wn * 64 + nj * 8 + 2 * q + (c & 1);
                    if (n < n_out) out[p * n_out + n] = from_float<T>(acc[mi][nj][c]);
                }
            }
        }
}

// ------------------------------------------------------------------------------------------------
// GEMV path (a few tokens). Gate|up: blockIdx.x = choice c = t*k + j (expert ids[c]), blockIdx.y = a slab
// of GEMV_WARPS * GATE_UP_COLS output columns; moe_route_few's shared blocks the same over the shared
// experts. Down (moe_gemv_down_combine): one block per (token, DOWN_COLS columns), all of the token's
// choices. 4 warps a block. Each warp streams two weight rows at a time with 16-byte loads (lane l
// reads vectors l, l+32, ...) and the input row (x[t] or h[c], a few KB that every block reads, so
// from L2) the same way, reduces with shuffles, lane 0 writes. So the selected experts' weights are
// spread over thousands of blocks, i.e. over every SM of the GPU.
// What sets the time is how many trips to memory a warp makes one after another, and how many warps
// an SM holds to cover them: dot2 issues all the loads of a row pair (VECS vectors per lane and row)
// before using any, and VECS trades those trips against registers (more vectors in flight, fewer
// warps per SM): GATE_UP_VECS and DOWN_VECS are set by timing the launches on the H200.
// ------------------------------------------------------------------------------------------------
constexpr int GEMV_WARPS = DSV2_MOE_GEMV_WARPS, GEMV_THREADS = 32 * GEMV_WARPS;
constexpr int GATE_UP_COLS = DSV2_MOE_GATE_UP_COLS;  // gate|up columns per warp (a gate and an up row each), in turn
constexpr int DOWN_COLS = DSV2_MOE_DOWN_COLS;        // down columns per block, two at a time per warp
constexpr int GATE_UP_VECS = 4, DOWN_VECS = 3;  // VECS of dot2: K = 2048 in two trips, K = 1408 in two

// dot2 (common.cuh) streams a pair of weight rows against the input row.

// The gate|up columns of one block: h_row[n] = round(silu(round(x . gate[n])) * round(x . up[n])) for
// the slab's GEMV_WARPS * COLS columns n (COLS per warp); row n of the gate and up matrices starts at
// gate_rows + n * H and up_rows + n * H. valid = false writes zeros without reading any weight.
template <int COLS, int VECS, typename T>
__device__ __forceinline__ void gate_up_columns(T* __restrict__ h_row, const T* __restrict__ x,
                                                const T* __restrict__ gate_rows, const T* __restrict__ up_rows,
                                                bool valid, int H, int I, int slab, int warp, int lane) {
#pragma unroll 1
    for (int r = 0; r < COLS; ++r) {
        const int n = (slab * COLS + r) * GEMV_WARPS + warp;
        if (n >= I) break;  // uniform over the warp
        float out = 0.f;
        if (valid) {
            float gate, up;
            dot2<VECS>(gate_rows + (long long)n * H, up_rows + (long long)n * H, x, H, lane, gate, up);
            out = silu_mul(round_to<T>(gate), round_to<T>(up));
        }
        if (lane == 0) h_row[n] = from_float<T>(out);
    }
}

// h[c, n] for choice c = t*topk + j of expert ids[c] (zeros for an id outside [0, E)): block (c, slab).
template <typename T, int COLS = GATE_UP_COLS, int VECS = GATE_UP_VECS>
__global__ void __launch_bounds__(GEMV_THREADS)
moe_gemv_gate_up(T* __restrict__ h, const T* __restrict__ x, const T* __restrict__ w_all, const long long* __restrict__ ids,
                 int topk, int E, int H, int I) {
    wait_for_prior_grids();
    const int c = blockIdx.x;
    const long long e = ids[c];
    const bool valid = e >= 0 && e < E;
    const T* gate_rows = w_all + (valid ? e : 0) * 2LL * I * H;
    gate_up_columns<COLS, VECS>(h + (long long)c * I, x + (long long)(c / topk) * H, gate_rows, gate_rows + (long long)I * H, valid, H, I, blockIdx.y,
                    threadIdx.x >> 5, threadIdx.x & 31);
}

// The router of a few tokens in one launch, with the shared experts' gate|up beside it (it does not
// depend on the routing, so it streams its weights while the router works).
// Blocks [0, T*RB), RB = ceil(E / GEMV_WARPS): block (t, r) computes logits[t, e] = x[t] . gate_w[e] in fp32 for
// its GEMV_WARPS experts e = GEMV_WARPS * r + warp (gate_w [E, H] fp32; each lane sums its strided share, then the warp),
// then counts itself on arrivals[t]; the last of token t's RB blocks resets the counter, reads the row
// back through L2 into shared memory and routes it with route_token (topk_softmax's rule: the picks
// are those topk_softmax gives on these logits, bit for bit), writing weights[t, :k], ids[t, :k].
// Blocks [T*RB, T*RB + T*P*slabs), P > 0: block (s = t*P + p, slab) computes row T*topk + s of h, part
// p of token t's shared experts (sh_gate_up = the shared MLP's [2*P*I, H] weight: P*I gate rows, then
// P*I up rows; part p = the intermediate columns [p*I, (p+1)*I), gate row p*I + n, up row (P + p)*I + n),
// the rows moe_gemv_down_combine reads as the shared choices.
template <typename T>
__global__ void __launch_bounds__(GEMV_THREADS)
moe_route_few(float* __restrict__ weights, long long* __restrict__ ids, float* __restrict__ logits,
              const T* __restrict__ x, const float* __restrict__ gate_w, int T_, int E, int H, int topk, int n_group,
              int topk_group, int renorm, float scale, unsigned* __restrict__ arrivals, T* __restrict__ h,
              const T* __restrict__ sh_gate_up, int I, int P) {
    wait_for_prior_grids();
    __shared__ float row[32 * ROUTER_PER_LANE];
    __shared__ bool last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rb = (E + GEMV_WARPS - 1) / GEMV_WARPS;
    if (blockIdx.x >= T_ * rb) {  // the shared experts' gate|up
        constexpr int BC = GEMV_WARPS * GATE_UP_COLS;
        const int slabs = (I + BC - 1) / BC, b = blockIdx.x - T_ * rb, s = b / slabs;
        const int t = s / P, p = s % P;
        gate_up_columns<GATE_UP_COLS, GATE_UP_VECS>(h + ((long long)T_ * topk + s) * I, x + (long long)t * H, sh_gate_up + (long long)p * I * H,
                        sh_gate_up + (long long)(P + p) * I * H, true, H, I, b % slabs, warp, lane);
        return;
    }
    const int t = blockIdx.x / rb, e = (blockIdx.x % rb) * GEMV_WARPS + warp;
    if (e < E) {
        constexpr int N = Vec16<T>::N;  // 16 bytes of x: N values, N fp32 weights (N % 4 == 0)
        const T* xr = x + (long long)t * H;
        const float* wr = gate_w + (long long)e * H;
        float acc = 0.f;
#pragma unroll 4
        for (int v = lane; v < H / N; v += 32) {
            const Vec16<T> xv = load16(xr + v * N);
#pragma unroll
            for (int j = 0; j < N; j += 4) {
                const float4 w4 = *reinterpret_cast<const float4*>(wr + v * N + j);
                acc = fmaf(to_float(xv.v[j]), w4.x, acc);
                acc = fmaf(to_float(xv.v[j + 1]), w4.y, acc);
                acc = fmaf(to_float(xv.v[j + 2]), w4.z, acc);
                acc = fmaf(to_float(xv.v[j + 3]), w4.w, acc);
            }
        }
        acc = warp_sum(acc);
        if (lane == 0) {
            logits[(long long)t * E + e] = acc;
            __threadfence();  // the logit visible GPU-wide before the block counts itself
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(arrivals + t, 1u) == (unsigned)rb - 1;
        if (last) arrivals[t] = 0u;
    }
    __syncthreads();
    if (!last || warp != 0) return;
    __threadfence();
    for (int i = lane; i < E; i += 32) row[i] = __ldcg(logits + (long long)t * E + i);
    __syncwarp();
    route_and_store(weights + (long long)t * topk, ids + (long long)t * topk, nullptr, row, 0, E, topk, n_group,
                    topk_group, renorm, scale, lane);
}

// Down projection and combine in one launch. Block (t, slab): the slab's COLS columns n of out[t].
// Warp w computes, for the choices j = w, w + GEMV_WARPS, ... of token t, y[j, n] = h[row j] . W_j[n]
// (two columns per dot2) into shared memory: j < topk is pick j (expert ids[t, j], h row t*topk + j,
// rounded to T as a stored GEMM output would be); with P > 0, j = topk + p is part p of the shared
// experts (h row T*topk + t*P + p, written by moe_route_few; the shared down weight's columns [p*I,
// (p+1)*I) of sh_down [H, P*I]; kept in fp32). Then thread i < COLS sums column n = slab*COLS + i
// exactly as moe_combine does: the picks in order j = 0 .. topk-1, products rounded before the add,
// the sum rounded to T (ids outside [0, E) dropped), plus the shared experts in T: round(sum over p)
// (the MLP's down projection summed in fp32 and rounded once), or `shared` [T, H] (their MLP's output).
// A token's choices meet in one block, so the combine needs a barrier, not a count of blocks across
// the GPU (one block per choice would need the last of a slab's blocks, found with __threadfence and
// atomicAdd, to combine).
// Dynamic shared memory: (topk + P) * COLS floats.
template <typename T, int COLS = DOWN_COLS, int VECS = DOWN_VECS>
__global__ void __launch_bounds__(GEMV_THREADS)
moe_gemv_down_combine(T* __restrict__ out, const T* __restrict__ h, const T* __restrict__ w_all,
                      const long long* __restrict__ ids, const float* __restrict__ weights, const T* __restrict__ shared,
                      const T* __restrict__ sh_down, int topk, int E, int H, int I, int P) {
    wait_for_prior_grids();
    static_assert(COLS % 2 == 0 && COLS <= GEMV_THREADS, "column pairs; one combining thread per column");
    extern __shared__ float ys[];  // [topk + P][COLS]
    const int t = blockIdx.x, T_ = gridDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_first = blockIdx.y * COLS;
    for (int j = warp; j < topk + P; j += GEMV_WARPS) {
        const T* W = nullptr;  // row n of choice j's down matrix: W + n * stride (I contiguous values)
        long long stride = I, row;
        if (j < topk) {
            const long long e = ids[(long long)t * topk + j];
            if (e >= 0 && e < E) W = w_all + e * H * I;
            row = (long long)t * topk + j;
        } else {
            W = sh_down + (long long)(j - topk) * I;
            stride = (long long)P * I;
            row = (long long)T_ * topk + (long long)t * P + (j - topk);
        }
#pragma unroll 1
        for (int r = 0; r < COLS; r += 2) {
            const int n0 = n_first + r;
            if (n0 >= H) break;  // uniform over the warp
            const int n1 = n0 + 1 < H ? n0 + 1 : n0;  // past the edge: read row n0 twice
            float s0 = 0.f, s1 = 0.f;
            if (W) dot2<VECS>(W + n0 * stride, W + n1 * stride, h + row * I, I, lane, s0, s1);
            if (lane == 0) {
                ys[j * COLS + r] = j < topk ? round_to<T>(s0) : s0;
                ys[j * COLS + r + 1] = j < topk ? round_to<T>(s1) : s1;
            }
        }
    }
    __syncthreads();
    const int n = n_first + threadIdx.x;
    if (threadIdx.x >= COLS || n >= H) return;
    float acc = 0.f;
    for (int j = 0; j < topk; ++j) {
        const long long cj = (long long)t * topk + j;
        if (!(ids[cj] >= 0 && ids[cj] < E)) continue;
        acc = __fadd_rn(acc, __fmul_rn(weights[cj], ys[j * COLS + threadIdx.x]));
    }
    float v = round_to<T>(acc);
    if (P) {
        float s = 0.f;
        for (int p = 0; p < P; ++p) s += ys[(topk + p) * COLS + threadIdx.x];
        v = v + round_to<T>(s);
    } else if (shared) {
        v = v + to_float(shared[(long long)t * H + n]);
    }
    out[(long long)t * H + n] = from_float<T>(v);
}

// ------------------------------------------------------------------------------------------------
// Skinny grouped GEMM (decode batches of tens of tokens, bf16/fp16). moe_align with BLOCK = ROWS
// (16 in the engine) groups the choices by expert into tiles of ROWS sorted rows, one expert per tile, so
// each expert's weights are read once per tile (the per-choice GEMV reads them once per choice). The
// tile's few tokens are the short side: the mma's 16-row M side takes 16 weight rows (16 output
// columns) and its 8-wide N side 8 of the tile's tokens, out^T = W x^T; the tile's NT = ROWS / 8 groups
// of 8 tokens are NT mmas on the same weight registers.
// The weights go from global memory straight into registers, the k relabelled (skinny_step in
// tensor_core.cuh): a token's sums run in the same order whatever NT, so its result does not depend on
// its tile's size.
// 32 bytes per thread and step (128 per row and warp) keep enough loads in flight (chapter 08's
// exercise 5 weighs 16 against 32). Tiles of 16 rather than 8 tokens halve the weight reads of an
// expert that gets 9 to 16 choices (most of them from batch 128 on); 32 need too many registers
// (benchmarks/bench_moe.py weighs 8, 16 and 32).
// One warp owns 16 output columns over the whole K (GATE_UP: 16 gate rows and the 16 matching up rows,
// sharing the input registers); blockIdx.x = tile, blockIdx.y = a slab of SKINNY_WARPS x 16 columns.
// The host checks K % 64 == 0 and n_out % 16 == 0.
// GATE_UP: out = h [tiles * ROWS, I], a_src = x [T, H] (slot s reads token sorted_rows[s] / topk; padding
//          slots read nothing and get h = 0), w_all = gate_up [E, 2I, H].
// DOWN:    out = y [tiles * ROWS, H], a_src = h (slot s reads row s), w_all = down [E, H, I].
// ------------------------------------------------------------------------------------------------
constexpr int SKINNY_WARPS = DSV2_MOE_SKINNY_WARPS;  // set in moe_routing.py

template <typename T, bool GATE_UP, int ROWS>
__global__ void __launch_bounds__(SKINNY_WARPS * 32)
moe_skinny(T* __restrict__ out, const T* __restrict__ a_src, const T* __restrict__ w_all, const int* __restrict__ sorted_rows,
           const int* __restrict__ tile_expert, int n_out, int K, int topk) {
    wait_for_prior_grids();
    constexpr int NM = GATE_UP ? 2 : 1;   // weight matrices sharing the input: gate and up, or down
    constexpr int NT = ROWS / 8;          // groups of 8 tokens sharing the weights
    static_assert(ROWS % 8 == 0, "a tile's tokens are groups of 8, the 8-wide N side of the mma");
    const int tile = blockIdx.x, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int e = tile_expert[tile];
    const int n0 = (blockIdx.y * SKINNY_WARPS + (threadIdx.x >> 5)) * 16;
    if (e < 0 || n0 >= n_out) return;  // an unused tile, or past the last column; no barrier follows
    const T* xr[NT];  // this thread's input rows: slots tile * ROWS + 8 nt + g (token g of group nt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const long long s = (long long)tile * ROWS + 8 * nt + g;
        const int c = GATE_UP ? sorted_rows[s] : 0;  // GATE_UP: the slot's choice, -1 for padding
        xr[nt] = GATE_UP ? (c >= 0 ? a_src + (long long)(c / topk) * K : nullptr) : a_src + s * K;
    }
    const T *w_lo[NM], *w_hi[NM];
#pragma unroll
    for (int m = 0; m < NM; ++m) {  // GATE_UP: m = 0 gate rows, m = 1 up rows (I further on)
        const T* W = w_all + (long long)e * NM * n_out * K + (long long)(m * n_out + n0 + g) * K;
        w_lo[m] = W;
        w_hi[m] = W + 8LL * K;
    }
    float acc[NM][NT][4] = {};
#pragma unroll 2
    for (int k = 16 * q; k < K; k += 64) skinny_step<T, NM, NT>(acc, w_lo, w_hi, xr, k);
    // C fragment of group nt: c = 0..3 is output column n0 + g + 8 (c >> 1) of slot tile * ROWS + 8 nt + 2q + (c & 1).
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const long long slot = (long long)tile * ROWS + 8 * nt + 2 * q + (c & 1);
            const int n = n0 + g + 8 * (c >> 1);
            if constexpr (GATE_UP) {
                const bool valid = sorted_rows[slot] >= 0;
                out[slot * n_out + n] =
                    from_float<T>(valid ? silu_mul(round_to<T>(acc[0][nt][c]), round_to<T>(acc[1][nt][c])) : 0.f);
            } else {
                out[slot * n_out + n] = from_float<T>(acc[0][nt][c]);
            }
        }
}

// ------------------------------------------------------------------------------------------------
// Combine. Block (t, chunk): token t, columns [chunk * blockDim.x * VEC, ...) with VEC = 16 bytes of T
// per thread (one 16-byte load per weighted row; H is a multiple of 8 and the tensors 16-byte aligned,
// checked by the host). For each column the k weighted rows are summed in pick order j = 0..k-1
// (fixed: the same result on every run, no atomics), each product rounded before the add
// (__fmul_rn/__fadd_rn: no FMA contraction, as the reference's y * w then index_add). slot_of = nullptr
// means y is in choice order (GEMV paths); slot -1 = dropped. ids != nullptr: choices whose id is
// outside [0, E) are dropped too (chapter 08's grouped GEMV never writes their y rows). shared = nullptr
// means no shared experts.
// ------------------------------------------------------------------------------------------------
template <typename T>
__global__ void moe_combine(T* __restrict__ out, const T* __restrict__ y, const float* __restrict__ weights,
                            const int* __restrict__ slot_of, const T* __restrict__ shared, int topk, int H,
                            const long long* __restrict__ ids, int E) {
    wait_for_prior_grids();
    constexpr int VEC = Vec16<T>::N;
    const long long t = blockIdx.x;
    const int n = (blockIdx.y * blockDim.x + threadIdx.x) * VEC;
    if (n >= H) return;
    float acc[VEC];
#pragma unroll
    for (int u = 0; u < VEC; ++u) acc[u] = 0.f;
#pragma unroll 4
    for (int j = 0; j < topk; ++j) {
        const long long c = t * topk + j;
        long long s = slot_of ? (long long)slot_of[c] : c;
        if (ids && !(ids[c] >= 0 && ids[c] < E)) s = -1;
        if (s < 0) continue;
        const float w = weights[c];
        const Vec16<T> v = load16(y + s * H + n);
#pragma unroll
        for (int u = 0; u < VEC; ++u) acc[u] = __fadd_rn(acc[u], __fmul_rn(w, to_float(v.v[u])));
    }
    Vec16<T> res;
    const Vec16<T> sh = shared ? load16(shared + t * H + n) : Vec16<T>{};
#pragma unroll
    for (int u = 0; u < VEC; ++u) {
        float x = round_to<T>(acc[u]);
        if (shared) x = x + to_float(sh.v[u]);
        res.v[u] = from_float<T>(x);
    }
    store16(out + t * H + n, res);
}
