// Rotary position embedding, in place, on DeepSeek-V2's interleaved pairs:
//
//   (a, b) = (x[2i], x[2i+1])  ->  (a*cos - b*sin, a*sin + b*cos),   cos/sin = cache[pos][i], cache[pos][d/2 + i]
//
// for every head of q_pe [T, h, d] and for the single k_pe [T, d] shared by all heads. Both are
// strided views (q_pe of q [T, h, 192], k_pe of kv_a's output [T, 576]): the kernel takes base
// pointers and row/head strides in elements; the d values of one head are dense.
//
// One block per token: it reads the token's position once, then its threads sweep the (h + 1)
// rows of d values (h query heads, then k_pe). cos/sin come from the fp32 table [P, d] that
// rope_cos_sin_cache builds; all h + 1 rows use the token's same d floats (each thread reads those
// of its own pairs), so after the first row they come from L1.
// The rotation itself, rounded as PyTorch rounds it, is rope.cuh's rotate_pair (rotate_vec: a vector's pairs).
//   VEC = true  : each thread moves one 16-byte vector (8 bf16/fp16 or 4 fp32 values = 4 or 2
//                 pairs); the host checks pointers are 16-byte aligned and d and all strides are
//                 multiples of the vector width.
//   VEC = false : one pair per thread, any alignment.
// A position outside 0..P-1 is never looked up: that token's rows are set to NaN instead.
#include "rope.cuh"  // rotate_pair, rotate_vec

template <typename T, bool VEC>
__global__ void rope(T* __restrict__ q, long long q_row_stride, long long q_head_stride, int heads,
                     T* __restrict__ k, long long k_row_stride, const long long* __restrict__ positions,
                     const float* __restrict__ cache, long long num_positions, int dim) {
    wait_for_prior_grids();
    const long long t = blockIdx.x;
    const long long pos = positions[t];
    const bool valid = pos >= 0 && pos < num_positions;
    const float* cs = cache + (valid ? pos : 0) * dim;  // row 0 is never read for an invalid position
    const int half = dim / 2;
    const float nan = __int_as_float(0x7fc00000);
    // Row r < heads is query head r, row `heads` is k_pe.
    auto row_ptr = [&](int r) -> T* {
        return r < heads ? q + t * q_row_stride + r * q_head_stride : k + t * k_row_stride;
    };
    if constexpr (VEC) {
        constexpr int N = Vec16<T>::N;  // values per vector, N / 2 pairs
        const int per_row = dim / N;
        const int items = (heads + 1) * per_row;
        for (int w = threadIdx.x; w < items; w += blockDim.x) {
            const int r = w / per_row, j = w % per_row;
            T* p = row_ptr(r) + j * N;
            Vec16<T> v = load16(p);
            rotate_vec(v, j * N, cs, half, valid);
            store16(p, v);
        }
    } else {
        const int items = (heads + 1) * half;
        for (int w = threadIdx.x; w < items; w += blockDim.x) {
            const int r = w / half, i = w % half;
            T* p = row_ptr(r) + 2 * i;
            float a = to_float(p[0]), b = to_float(p[1]);
            if (valid) {
                rotate_pair(a, b, cs[i], cs[half + i]);
            } else {
                a = b = nan;
            }
            p[0] = from_float<T>(a);
            p[1] = from_float<T>(b);
        }
    }
}
