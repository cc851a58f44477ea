// Chapter 08's lesson, not on the engine's path: the grouped expert GEMV, the choices grouped by expert
// so that each selected expert's weights are read once (dsv2_lib/lessons/moe_grouped.py). The engine
// takes the per-choice GEMV (moe.cu) instead; benchmarks/bench_moe.py times both.
#include "moe_common.cuh"

// ------------------------------------------------------------------------------------------------
// Grouped GEMV path (a few tokens): the choices grouped by expert, so each selected expert's weight
// rows are read ONCE and applied to all its tokens (the engine's per-choice GEMV reads an expert once
// per (token, choice)). The shared experts are more work items of the same kernels.
//
// Work items (built on the GPU by build_items, no host sync): the valid choices sorted by expert
// (stable: by token) into sorted [n], then each expert's segment cut into items of at most GEMV_TB
// choices: items[3i..3i+2] = (expert, first position in sorted, count); *n_items = how many.
// Items are expert-major: item i's expert <= item i+1's. At most min(E, n) + n / GEMV_TB items.
//
// Launches (moe_grouped.py: gemv_grouped, moe_decode):
//   moe_route_gemv   block 0: router (route_token, one warp per token) + build_items;
//                    blocks 1..: the shared experts' gate|up (optional; overlaps the router's latency)
//   (or moe_gemv_items: build_items from given ids)
//   moe_gemv_grouped<T, true>   grid (slot, column chunk): h[c] for routed items, h_sh[t] for the
//                               shared slots (if not already done by moe_route_gemv)
//   moe_gemv_grouped<T, false>  grid (slot, column chunk): y[c] = round(h[c] W_d^T), y_sh[t] likewise
//   moe_combine (moe.cu)        out = round(sum_j w y) + y_sh (fixed order: deterministic)
// Slots: [0, max_items) routed items (slots >= *n_items exit at once), then the shared slots: for
// gate|up S parts (part s = intermediate columns [s I, s I + I) of the shared MLP) x ceil(T / GEMV_TB)
// token chunks, for down ceil(T / GEMV_TB) token chunks (K = S I).
// Block: nw = blockDim.x / 32 warps, each warp cpw output columns n = (chunk cpw + r) nw + warp.
// Each lane keeps GEMV_U 16-byte vectors per weight row in flight (v = base + 32 q + lane), then
// multiplies them by each of the item's (<= GEMV_TB) activation rows read from L1/L2.
// ------------------------------------------------------------------------------------------------
constexpr int GEMV_TB = DSV2_GROUPED_TB;  // choices per work item (set in dsv2_lib/lessons/moe_grouped.py)
constexpr int MAX_THREADS = 32 * DSV2_GROUPED_MAX_WARPS;  // the largest block (moe_grouped.py: MAX_WARPS)
constexpr int GEMV_U = 8;   // 16-byte vectors in flight per lane per K chunk, over all NR weight rows

// acc[j][r] += (this lane's share of) w[r] . a[arow[j]] over K, for j < cnt; rows of a are K long.
template <typename T, int NR>
__device__ __forceinline__ void gemv_rows(float (&acc)[GEMV_TB][NR], const T* const (&w)[NR], int K,
                                          const T* __restrict__ a, const int (&arow)[GEMV_TB], int cnt, int lane) {
    constexpr int N = Vec16<T>::N, U = GEMV_U / NR;  // U vectors per row: 8 (down) or 4 + 4 (gate|up)
    const int nvec = K / N;
    for (int base = 0; base < nvec; base += 32 * U) {
        Vec16<T> wv[NR][U];
#pragma unroll
        for (int q = 0; q < U; ++q) {
            const int v = base + q * 32 + lane;
#pragma unroll
            for (int r = 0; r < NR; ++r)
                if (v < nvec) wv[r][q] = load16(w[r] + (long long)v * N);
        }
#pragma unroll
        for (int j = 0; j < GEMV_TB; ++j) {
            if (j >= cnt) break;  // uniform over the warp
            const T* ar = a + (long long)arow[j] * K;
#pragma unroll
            for (int q = 0; q < U; ++q) {
                const int v = base + q * 32 + lane;
                if (v < nvec) {
                    const Vec16<T> av = load16(ar + (long long)v * N);
#pragma unroll
                    for (int e = 0; e < N; ++e) {
                        const float xe = to_float(av.v[e]);
#pragma unroll
                        for (int r = 0; r < NR; ++r) acc[j][r] = fmaf(to_float(wv[r][q].v[e]), xe, acc[j][r]);
                    }
                }
            }
        }
    }
}

// One (slot, column chunk) unit of the grouped GEMV. GATE_UP: out rows h[c] (routed) / h_sh[t] (shared),
// h = round(silu(round(x W_g^T)) * round(x W_u^T)); else y[c] / y_sh[t] = round(h W_d^T).
// w: routed experts' gate_up [E, 2I, H] or down [E, H, I]; w_sh: the shared MLP's gate_up [2 S I, H]
// or down [H, S I] (nullptr: no shared slots). n_items: nullptr = no routed slots (router kernel).
template <typename T, bool GATE_UP>
__device__ __forceinline__ void gemv_unit(int slot, int chunk, int cpw, T* __restrict__ out, T* __restrict__ out_sh,
                                          const T* __restrict__ a, const T* __restrict__ a_sh,
                                          const T* __restrict__ w, const T* __restrict__ w_sh,
                                          const int* __restrict__ sorted, const int* __restrict__ items,
                                          const int* __restrict__ n_items, int max_items,
                                          int T_, int k, int H, int I, int S) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int arow[GEMV_TB], orow[GEMV_TB];
    int cnt;
    const T* w0;        // row 0 of this unit's weight (gate rows / down rows)
    const T* w1 = nullptr;  // GATE_UP: row 0 of the up rows
    const T* act;
    T* dst;
    long long ldo;      // output row stride
    int K, n_cols;      // reduction length, output columns of this unit
    if (slot < max_items) {  // a routed item
        if (slot >= *n_items) return;  // uniform over the block; no barrier follows
        const int e = items[3 * slot], start = items[3 * slot + 1];
        cnt = items[3 * slot + 2];
#pragma unroll
        for (int j = 0; j < GEMV_TB; ++j) {
            const int c = j < cnt ? sorted[start + j] : 0;
            arow[j] = GATE_UP ? c / k : c;  // gate|up reads x[token], down reads h[choice]
            orow[j] = c;
        }
        if constexpr (GATE_UP) {
            w0 = w + (long long)e * 2 * I * H;
            w1 = w0 + (long long)I * H;
        } else {
            w0 = w + (long long)e * H * I;
        }
        act = a;
        dst = out;
        ldo = GATE_UP ? I : H;
        K = GATE_UP ? H : I;
        n_cols = GATE_UP ? I : H;
    } else {  // a shared slot
        const int nchunk = (T_ + GEMV_TB - 1) / GEMV_TB;
        const int p = slot - max_items;
        const int part = GATE_UP ? p / nchunk : 0, q = GATE_UP ? p % nchunk : p;
        if (w_sh == nullptr || part >= S || q >= nchunk) return;
        cnt = min(GEMV_TB, T_ - q * GEMV_TB);
#pragma unroll
        for (int j = 0; j < GEMV_TB; ++j) arow[j] = orow[j] = q * GEMV_TB + (j < cnt ? j : 0);
        if constexpr (GATE_UP) {
            w0 = w_sh + (long long)part * I * H;
            w1 = w_sh + ((long long)S * I + (long long)part * I) * H;
            dst = out_sh + (long long)part * I;
            ldo = (long long)S * I;
            K = H;
            n_cols = I;
        } else {
            w0 = w_sh;
            dst = out_sh;
            ldo = H;
            K = S * I;
            n_cols = H;
        }
        act = a_sh;
    }
#pragma unroll 1
    for (int r = 0; r < cpw; ++r) {
        const int n = (chunk * cpw + r) * nw + warp;
        if (n >= n_cols) break;  // uniform over the warp
        if constexpr (GATE_UP) {
            const T* wr[2] = {w0 + (long long)n * K, w1 + (long long)n * K};
            float acc[GEMV_TB][2] = {};
            gemv_rows<T, 2>(acc, wr, K, act, arow, cnt, lane);
#pragma unroll
            for (int j = 0; j < GEMV_TB; ++j) {
                if (j >= cnt) break;
                const float g = warp_sum(acc[j][0]), u = warp_sum(acc[j][1]);
                if (lane == 0) dst[(long long)orow[j] * ldo + n] = from_float<T>(silu_mul(round_to<T>(g), round_to<T>(u)));
            }
        } else {
            const T* wr[1] = {w0 + (long long)n * K};
            float acc[GEMV_TB][1] = {};
            gemv_rows<T, 1>(acc, wr, K, act, arow, cnt, lane);
#pragma unroll
            for (int j = 0; j < GEMV_TB; ++j) {
                if (j >= cnt) break;
                const float y = warp_sum(acc[j][0]);
                if (lane == 0) dst[(long long)orow[j] * ldo + n] = from_float<T>(y);
            }
        }
    }
}

// grid (max_items + shared slots, column chunks), see above.
template <typename T, bool GATE_UP>
__global__ void __launch_bounds__(MAX_THREADS)
moe_gemv_grouped(T* __restrict__ out, T* __restrict__ out_sh, const T* __restrict__ a, const T* __restrict__ a_sh,
                 const T* __restrict__ w, const T* __restrict__ w_sh, const int* __restrict__ sorted,
                 const int* __restrict__ items, const int* __restrict__ n_items, int max_items,
                 int T_, int k, int H, int I, int S, int cpw) {
    gemv_unit<T, GATE_UP>(blockIdx.x, blockIdx.y, cpw, out, out_sh, a, a_sh, w, w_sh, sorted, items, n_items, max_items,
                          T_, k, H, I, S);
}

// The items of the n choices whose expert ids (-1 = dropped) are in shared memory s_ids [n]; scratch
// s_cnt, s_start, s_istart [E] in shared memory. Called by the whole block (it has barriers).
__device__ void build_items(const int* __restrict__ s_ids, int n, int E, int* s_cnt, int* s_start, int* s_istart,
                            int* __restrict__ sorted, int* __restrict__ items, int* __restrict__ n_items) {
    const int tid = threadIdx.x;
    for (int e = tid; e < E; e += blockDim.x) s_cnt[e] = 0;
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x)
        if (s_ids[i] >= 0) atomicAdd(&s_cnt[s_ids[i]], 1);  // counts: order-independent
    __syncthreads();
    if (tid < 32) {  // warp 0: exclusive prefix sums over experts of the counts and of the items
        int run_c = 0, run_i = 0;
        for (int e0 = 0; e0 < E; e0 += 32) {
            const int e = e0 + tid;
            const int c = e < E ? s_cnt[e] : 0, it = (c + GEMV_TB - 1) / GEMV_TB;
            int sc = c, si = it;  // inclusive scan over the 32 lanes
#pragma unroll
            for (int off = 1; off < 32; off <<= 1) {
                const int pc = __shfl_up_sync(FULL, sc, off), pi = __shfl_up_sync(FULL, si, off);
                if (tid >= off) { sc += pc; si += pi; }
            }
            if (e < E) { s_start[e] = run_c + sc - c; s_istart[e] = run_i + si - it; }
            run_c += __shfl_sync(FULL, sc, 31);
            run_i += __shfl_sync(FULL, si, 31);
        }
        if (tid == 0) *n_items = run_i;
    }
    __syncthreads();
    for (int i = tid; i < n; i += blockDim.x) {  // stable scatter: rank = earlier choices of the same expert
        const int e = s_ids[i];
        if (e < 0) continue;
        int rank = 0;
        for (int j = 0; j < i; ++j) rank += s_ids[j] == e;  // all lanes read the same j: a broadcast
        sorted[s_start[e] + rank] = i;
    }
    for (int e = tid; e < E; e += blockDim.x) {
        const int c = s_cnt[e];
        for (int q = 0; q * GEMV_TB < c; ++q) {
            int* it = items + 3 * (s_istart[e] + q);
            it[0] = e;
            it[1] = s_start[e] + q * GEMV_TB;
            it[2] = min(GEMV_TB, c - q * GEMV_TB);
        }
    }
}

// One block: the items of given ids [n] (int64; outside [0, E) = dropped). Dynamic shared memory (n + 3E) ints.
__global__ void moe_gemv_items(int* __restrict__ sorted, int* __restrict__ items, int* __restrict__ n_items,
                               const long long* __restrict__ ids, int n, int E) {
    extern __shared__ int ismem[];
    int* s_ids = ismem;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const long long e = ids[i];
        s_ids[i] = (e >= 0 && e < E) ? (int)e : -1;
    }
    __syncthreads();
    build_items(s_ids, n, E, ismem + n, ismem + n + E, ismem + n + 2 * E, sorted, items, n_items);
}

// Block 0: the router for all T_ tokens (one warp per token, as topk_softmax) and build_items.
// Blocks 1..: the shared slots of the gate|up GEMV (gemv_unit with no routed slots), if w_sh != nullptr;
// unit u = (slot u / n_chunks, chunk u % n_chunks). Dynamic shared memory (T_ k + 3E) ints.
template <typename T>
__global__ void __launch_bounds__(MAX_THREADS)
moe_route_gemv(float* __restrict__ weights, long long* __restrict__ ids, const float* __restrict__ logits,
               int T_, int E, int k, int n_group, int topk_group, int renorm, float scale,
               int* __restrict__ sorted, int* __restrict__ items, int* __restrict__ n_items,
               T* __restrict__ h_sh, const T* __restrict__ x, const T* __restrict__ w_sh, int H, int I, int S,
               int cpw, int n_chunks) {
    if (blockIdx.x > 0) {
        const int u = blockIdx.x - 1;
        gemv_unit<T, true>(u / n_chunks, u % n_chunks, cpw, nullptr, h_sh, nullptr, x, nullptr, w_sh, nullptr,
                           nullptr, nullptr, 0, T_, k, H, I, S);
        return;  // uniform over the block
    }
    extern __shared__ int rsmem[];
    int* s_ids = rsmem;
    const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    for (int t = threadIdx.x >> 5; t < T_; t += nw)
        route_and_store(weights, ids, s_ids, logits, t, E, k, n_group, topk_group, renorm, scale, lane);
    __syncthreads();
    const int n = T_ * k;
    build_items(s_ids, n, E, rsmem + n, rsmem + n + E, rsmem + n + 2 * E, sorted, items, n_items);
}
