// The absorbed products of MLA decode for a few tokens, bf16 or fp16:
//
//   query[t, h] = [ round(q_nope[t, h] W_k[h]) | q_pe[t, h] ]      W_k[h] [NOPE, C]   (C = kv_lora_rank)
//   out[t, h]   = round( round(o[t, h]) W_v[h]^T )                 W_v[h] [V, C],  o fp32 [T, h, C]
//
// the two einsums around the decode attention kernel (dsv2_lib/ops/mla_absorb.py). At batch 1 each is
// 16 heads x a 128 x 512 matrix (2 MB): cuBLAS runs them as batched GEMMs of one row, which take
// about 4.4 us of GPU time on the H200 for what the bandwidth would move in 0.5 us; the query also
// needs a torch.cat and the output a dtype copy first. Here every thread issues all its loads at
// once (one trip to memory), and the query kernel writes q_pe beside q_lat, so the attention kernel's
// query is ready: 2.6 and 2.4 us at one token. Sums are fp32; the order differs from cuBLAS's, so
// results may differ from the einsums by one rounding of T (the tests bound both against exact sums).
// For more tokens than those kernels take (decode batches), the query is mla_absorb_query_mma below,
// on the tensor cores; the output is linear_skinny.cu's kernel with one product per head.
#include "tensor_core.cuh"

// QUERY_COLS, the query kernel's block and OUT_WARPS are set in dsv2_lib/ops/mla_absorb.py.
constexpr int QUERY_COLS = DSV2_ABSORB_QUERY_COLS;  // q_lat columns per block of mla_absorb_query: 16 groups of 8
constexpr int QUERY_SPLITS = DSV2_ABSORB_QUERY_THREADS / 16;  // row splits: thread (g, s) = (tid % 16, tid / 16)
static_assert(QUERY_SPLITS * 16 == DSV2_ABSORB_QUERY_THREADS && QUERY_SPLITS * 16 >= QUERY_COLS, "block shape");
constexpr int QUERY_ROWS_AT_ONCE = 8;   // W_k rows a thread loads before using them
constexpr int OUT_WARPS = DSV2_ABSORB_OUT_WARPS;  // warps per block of mla_absorb_output, two W_v rows each
constexpr int OUT_VECS = 4;             // 16-byte vectors per lane and row loaded at once
constexpr int QMMA_WARPS = DSV2_ABSORB_QMMA_WARPS;  // warps per block of mla_absorb_query_mma, 16 columns each

// Block (h, chunk, t), 256 threads: q_lat[t, h, chunk * 128 + 8g .. + 7]. Thread (g, s) sums the rows
// n = s, s + 16, ... of W_k[h] for its 8 columns; the 16 partial sums of a column are added in s order
// through shared memory. Block (h, 0, t) also copies q_pe[t, h] into query[t, h, C:]. One token per
// block: a token's W_k rows come from L2 after the first token's block read them, and a block's
// accumulators stay 8 floats a thread (a block looping over tokens would hold 8 per token).
// q_nope and q_pe are strided views (token stride, head stride; last dim contiguous); W_k[h] starts at
// w_k + h * w_head_stride, rows of C contiguous values; query [T, H, C + R] is contiguous. The host
// checks C % 128 == 0 and 16-byte aligned W_k rows.
template <typename T>
__global__ void __launch_bounds__(QUERY_SPLITS * 16)
mla_absorb_query(T* __restrict__ query, const T* __restrict__ q_nope, const T* __restrict__ q_pe, const T* __restrict__ w_k,
                 int NOPE, int C, int R, long long nope_t, long long nope_h, long long pe_t, long long pe_h,
                 long long w_head_stride) {
    wait_for_prior_grids();
    constexpr int N = Vec16<T>::N;  // 8: one thread's columns are one 16-byte vector of a W_k row
    static_assert(N * 16 == QUERY_COLS, "16 column groups of one vector each");
    __shared__ float red[QUERY_SPLITS][QUERY_COLS];
    const int h = blockIdx.x, t = blockIdx.z, g = threadIdx.x % 16, s = threadIdx.x / 16;
    const int col = blockIdx.y * QUERY_COLS + g * N;
    const T* W = w_k + h * w_head_stride + col;
    const T* qn = q_nope + t * nope_t + h * nope_h;
    float acc[N] = {};
    for (int n0 = s; n0 < NOPE; n0 += QUERY_SPLITS * QUERY_ROWS_AT_ONCE) {
        Vec16<T> w[QUERY_ROWS_AT_ONCE];
        float q[QUERY_ROWS_AT_ONCE];
#pragma unroll
        for (int i = 0; i < QUERY_ROWS_AT_ONCE; ++i) {
            const int n = n0 + QUERY_SPLITS * i;
            if (n < NOPE) {
                w[i] = load16(W + (long long)n * C);
                q[i] = to_float(qn[n]);
            }
        }
#pragma unroll
        for (int i = 0; i < QUERY_ROWS_AT_ONCE; ++i) {
            if (n0 + QUERY_SPLITS * i < NOPE) {
#pragma unroll
                for (int j = 0; j < N; ++j) acc[j] = fmaf(q[i], to_float(w[i].v[j]), acc[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < N; ++j) red[s][g * N + j] = acc[j];
    __syncthreads();
    T* q_out = query + ((long long)t * gridDim.x + h) * (C + R);
    if (threadIdx.x < QUERY_COLS) {
        float sum = 0.f;
        for (int k = 0; k < QUERY_SPLITS; ++k) sum += red[k][threadIdx.x];
        q_out[blockIdx.y * QUERY_COLS + threadIdx.x] = from_float<T>(sum);
    }
    if (blockIdx.y == 0)
        for (int r = threadIdx.x; r < R; r += blockDim.x) q_out[C + r] = q_pe[t * pe_t + h * pe_h + r];
}

// Block (h, slab, t), OUT_WARPS warps: out[t, h, v] for the slab's 2 * OUT_WARPS rows v of W_v[h], two
// per warp. Lane l takes the 16-byte vectors l, l + 32, ... of both rows (OUT_VECS at a time, all loaded
// first) and the matching 8 values of o[t, h] (fp32, rounded to T as the einsum's input is), the warp
// sums with shuffles, lane 0 writes. W_v[h] starts at w_v + h * w_head_stride, rows of C contiguous
// values; o [T, H, C] and out [T, H, V] are contiguous. The host checks C % 8 == 0, 16-byte aligned
// W_v rows and o.
template <typename T>
__global__ void __launch_bounds__(OUT_WARPS * 32)
mla_absorb_output(T* __restrict__ out, const float* __restrict__ o, const T* __restrict__ w_v, int V, int C,
                  long long w_head_stride) {
    wait_for_prior_grids();
    constexpr int N = Vec16<T>::N;
    const int h = blockIdx.x, H = gridDim.x, t = blockIdx.z, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int v0 = (blockIdx.y * OUT_WARPS + warp) * 2;
    if (v0 >= V) return;  // no barrier in this kernel
    const int v1 = v0 + 1 < V ? v0 + 1 : v0;  // past the edge: row v0 twice, written once
    const T* w0 = w_v + h * w_head_stride + (long long)v0 * C;
    const T* w1 = w_v + h * w_head_stride + (long long)v1 * C;
    const float* orow = o + ((long long)t * H + h) * C;
    const int nv = C / N;
    float a0 = 0.f, a1 = 0.f;
    for (int c0 = lane; c0 < nv; c0 += 32 * OUT_VECS) {
        Vec16<T> u0[OUT_VECS], u1[OUT_VECS];
        float4 lo[OUT_VECS], hi[OUT_VECS];
#pragma unroll
        for (int i = 0; i < OUT_VECS; ++i) {
            const int c = c0 + 32 * i;
            if (c < nv) {
                u0[i] = load16(w0 + c * N);
                u1[i] = load16(w1 + c * N);
                lo[i] = *reinterpret_cast<const float4*>(orow + c * N);
                hi[i] = *reinterpret_cast<const float4*>(orow + c * N + 4);
            }
        }
#pragma unroll
        for (int i = 0; i < OUT_VECS; ++i) {
            if (c0 + 32 * i < nv) {
                const float x[8] = {lo[i].x, lo[i].y, lo[i].z, lo[i].w, hi[i].x, hi[i].y, hi[i].z, hi[i].w};
#pragma unroll
                for (int j = 0; j < N; ++j) {
                    const float xj = round_to<T>(x[j]);
                    a0 = fmaf(xj, to_float(u0[i].v[j]), a0);
                    a1 = fmaf(xj, to_float(u1[i].v[j]), a1);
                }
            }
        }
    }
    const float s0 = warp_sum(a0), s1 = warp_sum(a1);
    if (lane == 0) {
        T* row = out + ((long long)t * H + h) * V;
        row[v0] = from_float<T>(s0);
        if (v1 != v0) row[v1] = from_float<T>(s1);
    }
}

// Many tokens: the query on the tensor cores. Block (chunk, r, h) of QMMA_WARPS warps; warp w computes
// q_lat[t, h, c0 .. c0 + 15], c0 = 16 (chunk QMMA_WARPS + w), for the tokens t0 .. t0 + 8 NT - 1 (t0 = 8 NT r)
// as q_lat^T = W_k[h]^T q_nope^T with mma.m16n8k16: 16 columns of W_k are the M side, the tokens (groups
// of 8) the N side, NOPE the K side, the weights read once per 8 NT tokens. An A-fragment register holds
// two k (rows of W_k) of one column, but W_k keeps a row's columns side by side: thread (g, q) loads the
// column pair c0 + 2g, c0 + 2g + 1 of rows k and k + 1 (two 4-byte loads) and swaps halves with
// __byte_perm, which gives column c0 + 2g at k, k + 1 (fragment row g) and column c0 + 2g + 1 (fragment
// row g + 8): the M side relabelled, the output written back to match. The B fragment is token g's row of
// q_nope at k = 2q, 2q + 1 and 2q + 8, 2q + 9, a 4-byte load each. fp32 accumulation, rounded once.
// The blocks also copy q_pe[t, h] beside q_lat. The host checks NOPE % 16 == 0, C % (16 QMMA_WARPS)
// == 0, even R and strides, and 4-byte aligned tensors.
template <typename T, int NT>
__global__ void __launch_bounds__(QMMA_WARPS * 32)
mla_absorb_query_mma(T* __restrict__ query, const T* __restrict__ q_nope, const T* __restrict__ q_pe,
                     const T* __restrict__ w_k, int tokens, int NOPE, int C, int R, long long nope_t,
                     long long nope_h, long long pe_t, long long pe_h, long long w_head_stride, int vec8) {
    wait_for_prior_grids();
    const int h = blockIdx.z, H = gridDim.z, lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    const int c0 = (blockIdx.x * QMMA_WARPS + (threadIdx.x >> 5)) * 16, t0 = blockIdx.y * 8 * NT;
    const T* W = w_k + h * w_head_stride + c0 + 2 * g;  // the column pair of row 0
    const T* xr[NT];  // this thread's q_nope rows: tokens t0 + 8 nt + g (nullptr past the last: zeros)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int t = t0 + 8 * nt + g;
        xr[nt] = t < tokens ? q_nope + t * nope_t + h * nope_h : nullptr;
    }
    float acc[NT][4] = {};
#pragma unroll 4
    for (int k = 0; k < NOPE; k += 16) {
        unsigned u[4], b[NT][2];
#pragma unroll
        for (int i = 0; i < 4; ++i)  // rows k + 2q, k + 2q + 1, k + 2q + 8, k + 2q + 9
            u[i] = *reinterpret_cast<const unsigned*>(W + (long long)(k + 2 * q + (i & 1) + 8 * (i >> 1)) * C);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                b[nt][j] = xr[nt] ? *reinterpret_cast<const unsigned*>(xr[nt] + k + 2 * q + 8 * j) : 0u;
        const unsigned a[4] = {__byte_perm(u[0], u[1], 0x5410), __byte_perm(u[0], u[1], 0x7632),
                               __byte_perm(u[2], u[3], 0x5410), __byte_perm(u[2], u[3], 0x7632)};
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) mma16816<T>(acc[nt], a, b[nt][0], b[nt][1]);
    }
    // C fragment of group nt: c = 0, 1 are column c0 + 2g (fragment row g) of tokens t0 + 8 nt + 2q + c,
    // c = 2, 3 column c0 + 2g + 1 of the same two tokens: a token's two columns are one 4-byte store.
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int t = t0 + 8 * nt + 2 * q + i;
            if (t < tokens)
                *reinterpret_cast<unsigned*>(query + ((long long)t * H + h) * (C + R) + c0 + 2 * g) =
                    pack2<T>(acc[nt][i], acc[nt][2 + i]);
        }
    // q_pe beside q_lat, so that the attention kernel's query is ready: the block group's 8 NT tokens'
    // R values, shared out over the gridDim.x blocks of the group, 16-byte vectors where R, the strides
    // and the addresses allow (vec8: checked by the host), else one value at a time. One pass, no loop
    // of dependent loads: a serial copy would cost more than the product.
    const int per_token = vec8 ? R / 8 : R, n = 8 * NT * per_token;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int t = t0 + i / per_token, r = (i % per_token) * (vec8 ? 8 : 1);
        if (t >= tokens) continue;
        T* dst = query + ((long long)t * H + h) * (C + R) + C + r;
        const T* src = q_pe + t * pe_t + h * pe_h + r;
        if (vec8)
            store16(dst, load16(src));
        else
            *dst = *src;
    }
}
