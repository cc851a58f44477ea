// MLA decode attention over the paged latent cache with the balanced split-KV schedule (chapter 13):
// the engine's decode attention. A schedule kernel deals the batch's 32-row tiles evenly over a wave
// of workers, each worker attends its segments with mla_decode.cuh's attend_rows, and a combine merges
// the partial results with its merge_partials (shapes, layouts and bounds: mla_decode.cuh).
#include "mla_decode.cuh"

constexpr int SCHEDULE_THREADS = DSV2_MLA_SCHEDULE_THREADS;  // mla_decode_schedule's block (set in mla_decode.py)
static_assert(SCHEDULE_THREADS == 32 * 32, "mla_decode_schedule: warp 0 scans the 32 warps' totals");

// ---- the balanced schedule (chapter 13) ---------------------------------------------------------
// Uniform splits cut every entry into the same number of chunks, sized for the longest: with mixed
// lengths most blocks of short entries have nothing to do, and a CUDA graph captured for a bound on
// the length cuts every step as if every entry had that length. The balanced schedule instead deals
// the batch's 32-row tiles, all entries end to end, evenly over a fixed number of workers (blocks):
// worker i takes global tiles [i * per, (i + 1) * per). A worker's range may cover the end of one
// entry and the start of the next; each such piece is a segment. The segment of entry b handled by
// worker i writes its partial result into slot i + b: walking the segments in order, neither b nor i
// ever decreases and at least one grows, so i + b never repeats, and B + workers - 1 slots suffice. A
// segment that is a whole entry writes `out` directly. The schedule is computed on the GPU from the
// lengths, so a decode step needs no host sync and a graph replays it with new lengths.
//
// mla_decode_schedule: one block of SCHEDULE_THREADS = 1024 threads; sched[0] = per (tiles per worker),
// sched[1 + b] = first tile of entry b (a prefix sum of its ceil(len / 32) tiles), sched[1 + B] = total
// tiles. An entry's length is clamped to max_length; <= 0 gives no tiles.
__global__ void __launch_bounds__(SCHEDULE_THREADS) mla_decode_schedule(
    int* __restrict__ sched, const int* __restrict__ lengths, int B, int max_length, int workers, int min_tiles) {
    wait_for_prior_grids();
    __shared__ int warp_sums[32];
    __shared__ int carry;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (threadIdx.x == 0) carry = 0;
    for (int base = 0; base < B; base += SCHEDULE_THREADS) {
        const int b = base + threadIdx.x;
        int tiles = 0;
        if (b < B) {
            const int len = min(lengths[b], max_length);
            tiles = len > 0 ? (len + mla::TILE - 1) / mla::TILE : 0;
        }
        int x = tiles;  // inclusive scan: within the warp, then over the warps' totals
#pragma unroll
        for (int offset = 1; offset < 32; offset <<= 1) {
            const int y = __shfl_up_sync(0xffffffffu, x, offset);
            if (lane >= offset) x += y;
        }
        if (lane == 31) warp_sums[warp] = x;
        __syncthreads();
        if (warp == 0) {
            int w = warp_sums[lane];
#pragma unroll
            for (int offset = 1; offset < 32; offset <<= 1) {
                const int y = __shfl_up_sync(0xffffffffu, w, offset);
                if (lane >= offset) w += y;
            }
            warp_sums[lane] = w;
        }
        __syncthreads();
        const int inclusive = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + x;
        if (b < B) sched[1 + b] = inclusive - tiles;
        __syncthreads();  // everyone has read carry and warp_sums
        if (threadIdx.x == SCHEDULE_THREADS - 1) carry = inclusive;
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        sched[1 + B] = carry;
        sched[0] = max(max(min_tiles, 1), (carry + workers - 1) / workers);
    }
}

// mla_decode_balanced: grid (workers, 1, head groups). Worker i walks its segments in order over the
// paged cache [num_rows, D] (block_table [B, table_width]).
template <typename T, int DL, int DR, int STAGES>
__global__ void __launch_bounds__(mla::THREADS) mla_decode_balanced(
    float* __restrict__ o_part,       // [B + workers - 1, H, DL]: a partial segment's result, slot i + b
    float* __restrict__ lse_part,     // [B + workers - 1, H]
    float* __restrict__ out,          // [B, H, DL]: a whole-entry segment's result
    const T* __restrict__ q, const T* __restrict__ cache, const int* __restrict__ lengths,
    const int* __restrict__ sched, int B, int H, int max_length, float scale_log2,
    const int* __restrict__ block_table, int table_width, int block_size, long long num_rows) {
    wait_for_prior_grids();
    using namespace mla;
    const int worker = blockIdx.x, h0 = blockIdx.z * HEADS;
    const int per = sched[0];
    const int* first = sched + 1;  // first[b]: entry b's first global tile; first[B]: the total
    const int a0 = worker * per, a1 = min(a0 + per, first[B]);
    if (a0 >= a1) return;
    int lo = 0, hi = B - 1;  // the last entry whose first tile is <= a0 (it holds tile a0)
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first[mid] <= a0) lo = mid; else hi = mid - 1;
    }
    for (int b = lo; b < B && first[b] < a1; ++b) {
        const int e0 = first[b], e1 = first[b + 1];
        if (e0 == e1) continue;  // an empty entry: no tiles (the combine writes its zeros)
        const int s0 = max(a0, e0), s1 = min(a1, e1);
        const int len = min(lengths[b], max_length);  // > 0: the entry has tiles
        const bool whole = s0 == e0 && s1 == e1;
        const long long slot = (long long)worker + b;
        attend_rows<T, DL, DR, STAGES, true>(
            whole ? out + (long long)b * H * DL : o_part + slot * H * DL, DL,
            whole ? nullptr : lse_part + slot * H, 1, q, cache,
            block_table + (long long)b * table_width, table_width, block_size, num_rows,
            b, h0, H, (s0 - e0) * TILE, min(len, (s1 - e0) * TILE), scale_log2);
    }
}

// Merge each entry's segments: grid (ceil(DL / 32V), H, B). Entry b's tiles [e0, e1) were handled
// by workers e0 / per .. (e1 - 1) / per, whose partials sit in slots i + b. One worker: it wrote
// `out` itself. No tiles: zeros.
template <int V>
__global__ void __launch_bounds__(COMBINE_WARPS * 32) mla_decode_combine_balanced(
    float* __restrict__ out, const float* __restrict__ o_part, const float* __restrict__ lse,
    const int* __restrict__ sched, int dl) {
    wait_for_prior_grids();
    const int h = blockIdx.y, b = blockIdx.z, H = gridDim.y;
    const int per = sched[0], e0 = sched[1 + b], e1 = sched[2 + b];
    float* out_row = out + ((long long)b * H + h) * dl;
    if (e0 == e1) {
        const int c = (blockIdx.x * 32 + (threadIdx.x & 31)) * V;
        const float zeros[V] = {};
        if (threadIdx.x < 32 && c < dl) store_cols<V>(out_row + c, zeros);
        return;
    }
    const int i0 = e0 / per, i1 = (e1 - 1) / per;
    if (i0 == i1) return;
    merge_partials<V>(out_row, o_part + ((long long)(i0 + b) * H + h) * dl, (long long)H * dl,
                      lse + (long long)(i0 + b) * H + h, H, i1 - i0 + 1, dl);
}
