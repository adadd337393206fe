/* The math layer: one GEMM entry point over oneDNN, and the elementwise and
 * reduction kernels of the decoder. All of it is OpenMP-parallel. */
#ifndef HYPERTRAIN_KERNELS_H
#define HYPERTRAIN_KERNELS_H

#include "hypertrain/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* C = alpha · op(A) · op(B) + beta · C, all row-major.
 *   op(A): (M, K); A is (M, K) with row stride lda, or (K, M) when trans_a.
 *   op(B): (K, N); B is (K, N) with row stride ldb, or (N, K) when trans_b.
 *   C: (M, N) FP32 with row stride ldc. A and B share `dtype`: F32, BF16 or F16
 *   (BF16/F16 multiply with FP32 accumulation). beta = 0 ignores C's old content.
 * Called inside an OpenMP parallel region it runs on the calling thread only. */
void ht_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
             const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc);

/* Whether this CPU multiplies `dtype` operands natively (F32 always; BF16 with
 * AMX). Otherwise ht_gemm widens them to F32 on every call, and a caller that
 * keeps its operands as FP32 values of that precision skips the widening. */
bool ht_gemm_is_native(ht_dtype dtype);

/* A sentence naming the kernel that runs GEMMs of this dtype (for the run log). */
const char *ht_gemm_kernel_name(ht_dtype dtype);

#ifdef __cplusplus
}
#endif
#endif
