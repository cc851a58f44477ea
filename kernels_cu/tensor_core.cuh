// Tensor-core and asynchronous-copy building blocks for sm_80+ (inline PTX; NVRTC needs no headers
// for them), shared by the attention (chapters 06, 10) and MoE (chapter 08) kernels.
//
// mma.sync.m16n8k16 with 16-bit inputs and fp32 accumulators (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"); lane = 4 * g + t, g = lane / 4, t = lane % 4:
//   A (16 x 16, row-major), 4 registers of 2 values: a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..),
//     a2 = (g, 2t + 8..), a3 = (g + 8, 2t + 8..);
//   B (16 x 8, "col": stored as 8 rows of 16 k-values), 2 registers: b0 = (k = 2t..2t+1, n = g),
//     b1 = (k = 2t + 8.., n = g);
//   C/D (16 x 8, fp32), 4 registers: c0, c1 = (g, 2t..2t+1), c2, c3 = (g + 8, 2t..2t+1).
// ldmatrix.x4 loads four 8 x 8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i,
// and register i of every lane receives matrix i's (row g, columns 2t..2t+1); .trans transposes.
#pragma once
#include "common.cuh"

// The 32-bit shared-memory address of a generic pointer into shared memory (PTX operands want it).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy that bypasses registers (L2 only: .cg).
__device__ __forceinline__ void cp_async16(void* dst_smem, const void* src_gmem) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(dst_smem)), "l"(src_gmem));
}
// The same, reading only src_bytes (0 or 16) and filling the rest with zeros: out-of-range rows
// become zeros without a read.
__device__ __forceinline__ void cp_async16(void* dst_smem, const void* src_gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst_smem)), "l"(src_gmem),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Wait until at most N of this thread's committed groups are still in flight.
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row_addr)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row_addr)));
}

// c += a · b for one m16n8k16 tile (T = __nv_bfloat16 or __half).
template <typename T> __device__ __forceinline__ void mma16816(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1);
template <> __device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <> __device__ __forceinline__ void mma16816<__half>(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 values -> one register of two T values, lo in the low half (an A or B fragment register).
template <typename T> __device__ __forceinline__ unsigned pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned pack2<__nv_bfloat16>(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
template <> __device__ __forceinline__ unsigned pack2<__half>(float lo, float hi) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// Eight consecutive input values as one 16-byte vector of T (a B-fragment source of skinny_step): one load
// of T, or two of fp32 rounded to T (round to nearest even, as a .to(T) copy would round them).
template <typename T> __device__ __forceinline__ uint4 load8(const T* p) { return *reinterpret_cast<const uint4*>(p); }
template <typename T> __device__ __forceinline__ uint4 load8(const float* p) {
    const float4 lo = *reinterpret_cast<const float4*>(p), hi = *reinterpret_cast<const float4*>(p + 4);
    return make_uint4(pack2<T>(lo.x, lo.y), pack2<T>(lo.z, lo.w), pack2<T>(hi.x, hi.y), pack2<T>(hi.z, hi.w));
}

// ---- skinny products: weights straight from memory into A fragments --------------------------------
// One 64-wide k-step of out^T += W x^T for a warp's 16 weight rows (the mma's M side; NM matrices of
// them sharing the inputs, e.g. an expert's gate and up rows) and NT groups of 8 tokens (its 8-wide N
// side): chapter 08's skinny grouped GEMM (moe.cu) and the dense projections' (linear_skinny.cu). No
// shared memory, no barrier: thread (g, q) of the warp (g = lane / 4, q = lane % 4), called with
// k = k0 + 16q, loads 32 contiguous bytes, k .. k + 15, of weight rows g and g + 8 of each matrix
// (w_lo[m], w_hi[m]: the warp reads 128 contiguous bytes of each of its rows) and the same 16 k of the
// input rows xr[nt] of tokens g of each group (nullptr: zeros). A sum over k does not depend on the
// order of the k, so those registers serve as the fragments of four m16n8k16 mmas per group with the k
// relabelled: mma (j, half) takes k + 8j + 4 half + {0, 1, 2, 3} as its k = {2q, 2q+1, 2q+8, 2q+9} (the
// layout above). A and B are relabelled alike, so every product is a weight times its own input, and a
// token's sums run in the same order whatever NT. All loads of the step are issued before the first mma.
// The input rows are T, or fp32 rounded to T as they are read (load8: the absorbed output's o, mla_absorb.py).
template <typename T, int NM, int NT, typename X = T>
__device__ __forceinline__ void skinny_step(float (&acc)[NM][NT][4], const T* const (&w_lo)[NM],
                                            const T* const (&w_hi)[NM], const X* const (&xr)[NT], int k) {
    uint4 lo[NM][2], hi[NM][2], b[NT][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            lo[m][j] = *reinterpret_cast<const uint4*>(w_lo[m] + k + 8 * j);
            hi[m][j] = *reinterpret_cast<const uint4*>(w_hi[m] + k + 8 * j);
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
            b[nt][j] = xr[nt] ? load8<T>(xr[nt] + k + 8 * j) : make_uint4(0u, 0u, 0u, 0u);
    }
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int m = 0; m < NM; ++m) {
            const unsigned a0[4] = {lo[m][j].x, hi[m][j].x, lo[m][j].y, hi[m][j].y};
            const unsigned a1[4] = {lo[m][j].z, hi[m][j].z, lo[m][j].w, hi[m][j].w};
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                mma16816<T>(acc[m][nt], a0, b[nt][j].x, b[nt][j].y);
                mma16816<T>(acc[m][nt], a1, b[nt][j].z, b[nt][j].w);
            }
        }
}
