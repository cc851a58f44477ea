// Chapter 10's split-KV decode kernel: uniform splits, every entry's context cut into the same number
// of chunks of whole 32-row tiles, one block each, merged by a second kernel or by the last block to
// finish (fused combine). The engine runs chapter 13's balanced schedule instead (mla_decode.cu); this
// kernel is kept to be taught and measured against it, over a contiguous cache and (PAGED = true) over
// the paged one. The block body and the merge are mla_decode.cuh's (shapes, layouts, bounds there).
//
// Fused combine (counters != nullptr): instead of a second launch, the last block of each (entry,
// head group) to finish — found with an atomic ticket — merges the splits itself, in the fixed
// order 0, 1, ... (deterministic), writes `final_out` and resets its counter to 0.
#include "mla_decode.cuh"

// Floats per lane of mla_decode_combine's merge: 64 columns a block (set in dsv2_lib/lessons/mla_decode_split.py).
constexpr int COMBINE_WIDTH = DSV2_MLA_SPLIT_COMBINE_WIDTH;

// Uniform split-KV: block (split, b, head group) attends chunk [split * chunk, (split + 1) * chunk)
// of entry b's context (contiguous: rows of slot slots[b]; an entry whose slot is outside
// [0, num_slots) attends over nothing). Dynamic shared memory: attend_rows's (mla_decode.cuh).
template <typename T, int DL, int DR, int STAGES, bool PAGED>
__global__ void __launch_bounds__(mla::THREADS) mla_decode_split(
    float* __restrict__ o_part,       // [B, H, splits, DL]; == out [B, H, DL] when splits == 1
    float* __restrict__ lse_part,     // [B, H, splits], or nullptr when splits == 1
    float* __restrict__ final_out,    // [B, H, DL]: written by the fused combine (counters != nullptr)
    const T* __restrict__ q,          // [B, H, D]
    const T* __restrict__ cache,      // [num_slots, max_len, D]; PAGED: [num_rows, D]
    const int* __restrict__ slots,    // [B]
    const int* __restrict__ lengths,  // [B]
    int* __restrict__ counters,       // [B, head groups] tickets (all 0) for the fused combine, or nullptr
    int H, int num_slots, int max_len, int max_length, int chunk, float scale_log2,
    const int* __restrict__ block_table,  // PAGED: [B, table_width]; else unused (nullptr)
    int table_width, int block_size, long long num_rows) {
    using namespace mla;
    constexpr int D = DL + DR;
    const int split = blockIdx.x, b = blockIdx.y, h0 = blockIdx.z * HEADS, splits = gridDim.x;
    int len = min(lengths[b], max_length);
    int slot = 0;
    if constexpr (!PAGED) {
        slot = slots[b];
        if (slot < 0 || slot >= num_slots) len = 0;
    }
    const int t_begin = split * chunk;
    const int t_end = min(len, t_begin + chunk);
    const T* rows = PAGED || t_end <= t_begin ? cache : cache + (long long)slot * max_len * D;
    attend_rows<T, DL, DR, STAGES, PAGED>(
        o_part + ((long long)b * H * splits + split) * DL, (long long)splits * DL,
        lse_part == nullptr ? nullptr : lse_part + (long long)b * H * splits + split, splits, q, rows,
        PAGED ? block_table + (long long)b * table_width : nullptr, table_width, block_size, num_rows,
        b, h0, H, t_begin, t_end, scale_log2);
    if (counters == nullptr || lse_part == nullptr) return;

    // ---- fused combine: the last block of (entry, head group) to finish merges all its splits ------
    // Every thread's partial writes are made visible device-wide before thread 0 takes a ticket; the
    // block that draws ticket splits-1 knows all others have written theirs. It merges the splits in
    // the fixed order 0, 1, ..., so the result does not depend on which block came last, then puts
    // the counter back to 0 for the next launch.
    __shared__ int s_last;
    __shared__ float s_max[HEADS], s_inv[HEADS];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* ticket = counters + (long long)b * gridDim.z + blockIdx.z;
        s_last = atomicAdd(ticket, 1) == splits - 1;
        if (s_last) *ticket = 0;  // every other block of this group has taken its ticket already
    }
    __syncthreads();
    if (!s_last) return;
    __threadfence();
    if (threadIdx.x < HEADS) {  // per head: M = max_s lse_s and 1 / sum_s 2^(lse_s - M)
        const int h = h0 + threadIdx.x;
        float M = minus_inf(), den = 0.f;
        if (h < H) {
            const float* L = lse_part + ((long long)b * H + h) * splits;
            for (int s = 0; s < splits; ++s) M = fmaxf(M, __ldcg(L + s));
            if (M != minus_inf())
                for (int s = 0; s < splits; ++s) den += exp2f(__ldcg(L + s) - M);
        }
        s_max[threadIdx.x] = M;
        s_inv[threadIdx.x] = den > 0.f ? 1.f / den : 0.f;
    }
    __syncthreads();
    constexpr int V4 = DL / 4;  // float4 columns per head
    for (int i = threadIdx.x; i < HEADS * V4; i += THREADS) {
        const int hh = i / V4, c = (i % V4) * 4, h = h0 + hh;
        if (h >= H) continue;
        const float M = s_max[hh];
        const long long row = (long long)b * H + h;
        float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
        if (M != minus_inf()) {
            const float* L = lse_part + row * splits;
            for (int s = 0; s < splits; ++s) {
                const float w = exp2f(__ldcg(L + s) - M);
                const float4 v = __ldcg(reinterpret_cast<const float4*>(o_part + (row * splits + s) * DL + c));
                acc.x += w * v.x; acc.y += w * v.y; acc.z += w * v.z; acc.w += w * v.w;
            }
        }
        const float r = s_inv[hh];
        *reinterpret_cast<float4*>(final_out + row * DL + c) = make_float4(acc.x * r, acc.y * r, acc.z * r, acc.w * r);
    }
}

// The uniform splits of each (entry, head): grid (ceil(DL / 64), H, B), 256 threads; for B = 1 and
// 16 heads that is 128 blocks, about one per SM, since at batch 1 the partials (splits x 16 x 512
// fp32; 8.4 MB for 256 splits, against 37.7 MB of cache at 32,768 rows) must stream as fast.
__global__ void __launch_bounds__(COMBINE_WARPS * 32) mla_decode_combine(
    float* __restrict__ out, const float* __restrict__ o_part, const float* __restrict__ lse, int splits, int dl) {
    const long long row = (long long)blockIdx.z * gridDim.y + blockIdx.y;  // b * H + h
    merge_partials<COMBINE_WIDTH>(out + row * dl, o_part + row * splits * dl, dl, lse + row * splits, 1, splits, dl);
}
