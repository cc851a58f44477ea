// Device helpers shared by the MoE kernels of the engine (moe.cu) and of chapter 08's lesson
// (lessons/moe_grouped.cu): the router of one token (one warp) and SwiGLU's product.
#pragma once
#include "common.cuh"

constexpr unsigned FULL = 0xffffffffu;
// Experts per lane: E <= 32 * ROUTER_PER_LANE = MAX_EXPERTS (both set in dsv2_lib/ops/moe_routing.py).
constexpr int ROUTER_PER_LANE = DSV2_MOE_ROUTER_PER_LANE;

// ------------------------------------------------------------------------------------------------
// Router. One warp per token; expert e lives in lane e % 32, slot e / 32.
// Ties: among equal scores the LOWEST expert id wins (and the lowest group id among equal groups),
// the rule the reference implements with a stable descending sort.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ bool better(float v, int i, float w, int j) { return v > w || (v == w && i < j); }

// (v, i) := the best pair over the warp; `better` is a strict total order on distinct ids, so the
// butterfly leaves every lane with the same answer.
__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float ov = __shfl_xor_sync(FULL, v, off);
        const int oi = __shfl_xor_sync(FULL, i, off);
        if (better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, off));
    return x;
}

// weights[t, j], ids[t, j] for the j-th pick, in pick order (descending score).
// n_group = 0: greedy. n_group > 0: group-limited greedy (E % n_group == 0, n_group <= 32): keep the
// topk_group groups with the best single expert, others score 0 (as in the reference), then top-k.
// renorm: w / (sum of the k picks + 1e-20); else w * scale.
// route_token: one warp routes token t; lane j < k returns pick j in (w, id) (id -1 if out of range).
__device__ __forceinline__ void route_token(const float* __restrict__ row, int E, int k, int n_group, int topk_group,
                                            int renorm, float scale, int lane, float& w_out, int& id_out) {

    float p[ROUTER_PER_LANE];
    float m = minus_inf();
#pragma unroll
    for (int s = 0; s < ROUTER_PER_LANE; ++s) {
        const int e = lane + 32 * s;
        p[s] = e < E ? row[e] : minus_inf();
        m = fmaxf(m, p[s]);
    }
    m = warp_max(m);
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < ROUTER_PER_LANE; ++s) {
        const int e = lane + 32 * s;
        p[s] = e < E ? expf(p[s] - m) : 0.f;
        sum += p[s];
    }
    sum = warp_sum(sum);
#pragma unroll
    for (int s = 0; s < ROUTER_PER_LANE; ++s) {
        const int e = lane + 32 * s;
        p[s] = e < E ? p[s] / sum : minus_inf();  // empty slots can never be picked (k <= E)
    }

    if (n_group > 0) {
        const int gsize = E / n_group;
        float gbest = minus_inf();  // lane g holds group g's best score
        for (int g = 0; g < n_group; ++g) {
            float b = minus_inf();
#pragma unroll
            for (int s = 0; s < ROUTER_PER_LANE; ++s) {
                const int e = lane + 32 * s;
                if (e < E && e / gsize == g) b = fmaxf(b, p[s]);
            }
            b = warp_max(b);
            if (lane == g) gbest = b;
        }
        unsigned keep = 0;  // bit g: group g kept (the same in every lane)
        for (int r = 0; r < topk_group; ++r) {
            float v = gbest;
            int g = lane < n_group ? lane : 0x7fffffff;
            if (lane >= n_group) v = minus_inf();
            warp_argmax(v, g);
            if (g < n_group) keep |= 1u << g;
            if (lane == g) gbest = minus_inf();  // taken
        }
#pragma unroll
        for (int s = 0; s < ROUTER_PER_LANE; ++s) {
            const int e = lane + 32 * s;
            if (e < E && !((keep >> (e / gsize)) & 1u)) p[s] = 0.f;  // masked to 0, like the reference
        }
    }

    float mine_w = 0.f, total = 0.f;
    int mine_id = 0;
    for (int j = 0; j < k; ++j) {
        float v = minus_inf();
        int i = 0x7fffffff;
#pragma unroll
        for (int s = 0; s < ROUTER_PER_LANE; ++s) {
            const int e = lane + 32 * s;
            if (better(p[s], e, v, i)) { v = p[s]; i = e; }
        }
        warp_argmax(v, i);
        total += v;  // same order in every lane: pick order
        if (lane == j) { mine_w = v; mine_id = i; }
        if ((i & 31) == lane) {  // the owner marks it taken: -1 is below every score (scores >= 0)
#pragma unroll
            for (int s = 0; s < ROUTER_PER_LANE; ++s)
                if (lane + 32 * s == i) p[s] = -1.f;
        }
    }
    w_out = renorm ? mine_w / (total + 1e-20f) : mine_w * scale;
    id_out = (mine_id >= 0 && mine_id < E) ? mine_id : -1;
}

// Route token t (the calling warp) and store its k picks: lane j < k writes pick j to weights/ids
// [t, j] (and, if s_ids is not nullptr, the id to s_ids[t * k + j]).
__device__ __forceinline__ void route_and_store(float* __restrict__ weights, long long* __restrict__ ids,
                                                int* s_ids, const float* __restrict__ logits, int t, int E, int k,
                                                int n_group, int topk_group, int renorm, float scale, int lane) {
    float w;
    int id;
    route_token(logits + (long long)t * E, E, k, n_group, topk_group, renorm, scale, lane, w, id);
    if (lane < k) {
        weights[(long long)t * k + lane] = w;
        ids[(long long)t * k + lane] = id;
        if (s_ids != nullptr) s_ids[t * k + lane] = id;
    }
}

// SwiGLU of one column: silu(g) * u in fp32 (the callers round g and u to T first).
__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.f + expf(-g)) * u; }
