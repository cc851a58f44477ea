// Token embedding: a gather of table rows.
//
//   out[t, :] = weight[ids[t], :]        ids [T] int64, weight [V, H] (rows `stride` apart), out [T, H]
//
// One block per token (grid = T). The block's threads copy the row together, thread i taking
// chunk i, i + blockDim.x, ... so that the lanes of a warp touch consecutive chunks: a coalesced
// read of the table row and a coalesced write of the output row. Two variants:
//   VEC = true  : chunks of 16 bytes (8 bf16/fp16 or 4 fp32 values per load and store). The host
//                 picks it only when H and the row stride are whole 16-byte vectors and both
//                 pointers are 16-byte aligned.
//   VEC = false : one element per chunk; any H, stride and alignment.
// An id outside [0, V) is never used as an address: its output row is written as zeros and the
// smallest such position t is recorded with atomicMin in *bad_pos (which the host resets to
// INT_MAX before a checked call and reads afterwards).
#include "common.cuh"

template <typename T, bool VEC>
__global__ void embedding(T* __restrict__ out, const long long* __restrict__ ids, const T* __restrict__ weight,
                          int* __restrict__ bad_pos, int hidden, long long stride, long long vocab) {
    wait_for_prior_grids();
    const long long t = blockIdx.x;
    const long long id = ids[t];
    const bool valid = id >= 0 && id < vocab;
    if (!valid && threadIdx.x == 0) atomicMin(bad_pos, (int)t);
    const T* src = weight + (valid ? id : 0) * stride;  // never read when !valid
    T* dst = out + t * hidden;
    if constexpr (VEC) {
        constexpr int N = Vec16<T>::N;
        const int nvec = hidden / N;
        Vec16<T> zero;
#pragma unroll
        for (int j = 0; j < N; ++j) zero.v[j] = from_float<T>(0.f);
        for (int i = threadIdx.x; i < nvec; i += blockDim.x) store16(dst + i * N, valid ? load16(src + i * N) : zero);
    } else {
        const T zero = from_float<T>(0.f);
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = valid ? src[i] : zero;
    }
}
