/* The tensor-core instructions flash.cu is written in, one warp at a time
 * (PTX ISA, "Warp-level matrix instructions"), with their fragments laid
 * out as the ISA lays them out, so that a kernel reads and writes its
 * products in registers:
 *
 * - tc_mma: D += A B, mma.sync m16n8k16 with bf16 or f16 operands and FP32
 *   accumulators. Lane l, g = l / 4 and t = l % 4, holds of A (16 x 16) the
 *   pairs (g, 2t..2t+1), (g + 8, 2t..), (g, 2t + 8..), (g + 8, 2t + 8..) in
 *   a[0..3]; of B (16 x 8) the pairs (2t..2t+1, g) and (2t + 8.., g) in
 *   b[0..1]; of C and D (16 x 8) (g, 2t), (g, 2t + 1), (g + 8, 2t),
 *   (g + 8, 2t + 1) in d[0..3]. Two D tiles side by side are, packed to 16
 *   bits, an A fragment (tc_pack_a): P and dS feed the next product from the
 *   registers that computed them.
 * - tc_ldsm, tc_ldsm_t: ldmatrix.x4 of four 8 x 8 matrices of 16-bit values
 *   from shared memory, lanes 8j..8j+7 naming the rows of matrix j; r[j] is
 *   matrix j's (g, 2t..2t+1), or of its transpose (.trans).
 *
 * On the host (HT_CUDA_EMU) the same functions are tests/emu/cuda_emu.h's:
 * the warp's lanes trade their registers and compute what the ISA says. */
#ifndef HT_KERNELS_CUDA_TC_CUH
#define HT_KERNELS_CUDA_TC_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include "kernels/cuda/cuda.cuh"

/* Two values rounded to 16 bits as the CPU rounds them (base/dtype.c),
 * lo in the low half. */
template <typename T16> __device__ __forceinline__ uint32_t tc_pack(float lo, float hi);
template <> __device__ __forceinline__ uint32_t tc_pack<__nv_bfloat16>(float lo, float hi) {
    return (uint32_t)dev_f32_to_bf16(lo) | (uint32_t)dev_f32_to_bf16(hi) << 16;
}
template <> __device__ __forceinline__ uint32_t tc_pack<__half>(float lo, float hi) {
    return (uint32_t)dev_f32_to_f16(lo) | (uint32_t)dev_f32_to_f16(hi) << 16;
}

/* The A fragment (16 x 16) of the D tiles c0 (columns 0..7) and c1 (8..15). */
template <typename T16>
__device__ __forceinline__ void tc_pack_a(uint32_t (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = tc_pack<T16>(c0[0], c0[1]);
    a[1] = tc_pack<T16>(c0[2], c0[3]);
    a[2] = tc_pack<T16>(c1[0], c1[1]);
    a[3] = tc_pack<T16>(c1[2], c1[3]);
}

#ifdef HT_CUDA_EMU
template <typename T16>
__device__ __forceinline__ void tc_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    emu_mma_m16n8k16(d, a, b0, b1, std::is_same<T16, __nv_bfloat16>::value);
}
__device__ __forceinline__ void tc_ldsm(uint32_t (&r)[4], const void *row) { emu_ldmatrix_x4(r, row, false); }
__device__ __forceinline__ void tc_ldsm_t(uint32_t (&r)[4], const void *row) { emu_ldmatrix_x4(r, row, true); }
#else
template <typename T16>
__device__ __forceinline__ void tc_mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);
template <>
__device__ __forceinline__ void tc_mma<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                      uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
template <>
__device__ __forceinline__ void tc_mma<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}
__device__ __forceinline__ void tc_ldsm(uint32_t (&r)[4], const void *row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    const unsigned s = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#endif
}
__device__ __forceinline__ void tc_ldsm_t(uint32_t (&r)[4], const void *row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 750
    const unsigned s = (unsigned)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
#endif
}
#endif

/* c (16 x N, N/8 D tiles) += A Bᵀ: A the warp's 16 rows of K values
 * (row-major at a, ld lda), B N rows of K values (row-major at b, ld ldb),
 * both in shared memory. S = Q Kᵀ, dP = dO Vᵀ and their transposes. */
template <typename T16, int K, int N>
__device__ __forceinline__ void tc_abt(float (&c)[N / 8][4], const T16 *a, int lda, const T16 *b, int ldb) {
    static_assert(K % 16 == 0 && N % 16 == 0, "whole 16 x 16 fragments");
    const int lane = threadIdx.x % 32;
    const T16 *arow = a + (lane % 16) * lda + (lane / 16) * 8;
    const T16 *brow = b + ((lane / 16) * 8 + lane % 8) * ldb + ((lane / 8) % 2) * 8;
#pragma unroll
    for (int k = 0; k < K / 16; k++) {
        uint32_t fa[4];
        tc_ldsm(fa, arow + k * 16);
#pragma unroll
        for (int n = 0; n < N / 16; n++) {
            uint32_t fb[4]; /* rows 16n..16n+7 (fb[0], fb[1]) and 16n+8.. (fb[2], fb[3]) of B */
            tc_ldsm(fb, brow + n * 16 * ldb + k * 16);
            tc_mma<T16>(c[2 * n], fa, fb[0], fb[1]);
            tc_mma<T16>(c[2 * n + 1], fa, fb[2], fb[3]);
        }
    }
}

/* c (16 x N) += P B: P (16 x K) the warp's registers (K/16 A fragments),
 * B K rows of N values (row-major at b, ld ldb) in shared memory. O = P V,
 * dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q. */
template <typename T16, int K, int N>
__device__ __forceinline__ void tc_pb(float (&c)[N / 8][4], const uint32_t (&p)[K / 16][4], const T16 *b, int ldb) {
    static_assert(K % 16 == 0 && N % 16 == 0, "whole 16 x 16 fragments");
    const int lane = threadIdx.x % 32;
    const T16 *brow = b + (((lane / 8) % 2) * 8 + lane % 8) * ldb + (lane / 16) * 8;
#pragma unroll
    for (int k = 0; k < K / 16; k++) {
#pragma unroll
        for (int n = 0; n < N / 16; n++) {
            uint32_t fb[4]; /* columns 16n..16n+7 (fb[0], fb[1]) and 16n+8.. (fb[2], fb[3]) of B */
            tc_ldsm_t(fb, brow + k * 16 * ldb + n * 16);
            tc_mma<T16>(c[2 * n], p[k], fb[0], fb[1]);
            tc_mma<T16>(c[2 * n + 1], p[k], fb[2], fb[3]);
        }
    }
}

#endif
