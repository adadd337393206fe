/* Inside the GEMM: the two ways ht_gemm can run a product, so that tests and
 * the bench can reach the one this CPU does not pick. */
#ifndef HT_KERNELS_GEMM_INTERNAL_H
#define HT_KERNELS_GEMM_INTERNAL_H

#include "hypertrain/kernels.h"

typedef enum ht_gemm_path {
    HT_GEMM_PATH_AUTO = 0, /* what ht_gemm runs (ht_gemm_kernel_name says which) */
    HT_GEMM_PATH_MATMUL,   /* oneDNN matmul on the operands as given: F32 or BF16 */
    HT_GEMM_PATH_WIDEN,    /* BF16 or F16 widened to F32 in bounded tiles, then the F32 matmul */
} ht_gemm_path;

/* ht_gemm on a chosen path; same contract. */
void ht_gemm_on_path(ht_gemm_path path, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const void *A, int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C,
                     int64_t ldc);

#endif
