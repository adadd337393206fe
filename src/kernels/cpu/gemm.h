/* The CPU's products over oneDNN (gemm.c): the entries gemm, gemm_ragged
 * and gemm_batched, the choice of 16-bit kernel behind them (which the
 * layers above reach through kernels.h's ht_kernels_*_gemm and
 * ht_kernels_storage), and the two ways ht_gemm can run a product, so that
 * tests and the bench can reach the one this CPU does not pick. */
#ifndef HT_KERNELS_CPU_GEMM_H
#define HT_KERNELS_CPU_GEMM_H

#include "hypertrain/kernels.h"

/* C = alpha · op(A) · op(B) + beta · C, all row-major.
 *   op(A): (M, K); A is (M, K) with row stride lda, or (K, M) when trans_a.
 *   op(B): (K, N); B is (K, N) with row stride ldb, or (N, K) when trans_b.
 *   C: (M, N) FP32 with row stride ldc. A and B share `dtype`: F32, BF16 or F16
 *   (BF16/F16 multiply with FP32 accumulation). beta = 0 ignores C's old content.
 * Called inside an OpenMP parallel region it runs on the calling thread only.
 * A product that cannot run (oneDNN refuses it, memory runs out, a bad shape)
 * leaves NaN in C and is recorded: check ht_gemm_status after a step. */
void ht_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
             const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc);

/* ht_gemm for a row count that changes from call to call (the rows one
 * expert receives): the rows are M, or K when trans_a (a sum over rows, as
 * in a weight gradient); one oneDNN primitive, made with that size left to
 * run time, serves every count, where ht_gemm would make one per count. */
void ht_gemm_ragged(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                    int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc);

/* ht_gemm on `batch` products of one shape: product e reads A + e·stride_a
 * and B + e·stride_b (in elements of dtype) and writes C + e·stride_c, the
 * outputs apart (stride_c >= M·ldc). Each product gives the bits it gives
 * alone (the CPU runs them one by one, on one cached primitive: oneDNN's
 * batched matmul orders its sums by the batch on some CPUs). */
void ht_gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const void *A, int64_t lda, int64_t stride_a, const void *B, int64_t ldb, int64_t stride_b,
                     ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t stride_c);

/* HT_OK, or the first product that could not run since the process started:
 * every later result is suspect, so a caller stops at the first failure. */
ht_status ht_gemm_status(ht_error *err);

/* Resolves the requested kernels: a pinned one is checked to exist here
 * (native where oneDNN offers none is an error naming the CPU's ISA); AUTO
 * times every kernel on one (M, N, K) product, typically a linear layer's,
 * and takes the fastest, where native or widened must beat fp32_rounded by 5%.
 * Costs a few hundred ms at most. Does not apply the choice: ht_gemm_use. */
ht_status ht_gemm_choose(ht_gemm_kernel bf16, ht_gemm_kernel f16, int64_t M, int64_t N, int64_t K, ht_gemm_choice *out,
                         ht_error *err);
/* GFLOP/s of `kernel` running products of `dtype` on C (M, N) = A (M, K) · Bᵀ
 * (F32: the FP32 matmul, whatever the kernel): the fastest of three calls
 * after a first, timed once per process and shape; 0 where the kernel is not
 * offered or the buffers cannot be had. The MFU's yardstick. */
double ht_gemm_rate(ht_dtype dtype, ht_gemm_kernel kernel, int64_t M, int64_t N, int64_t K);
/* Makes `choice` the process's: ht_gemm and ht_gemm_storage follow it. Call it
 * before products run on other threads. Without it, the first 16-bit product
 * chooses on a 1024³ product. */
void ht_gemm_use(const ht_gemm_choice *choice);
/* The kernel products of `dtype` run on now (NATIVE for F32). */
ht_gemm_kernel ht_gemm_kernel_of(ht_dtype dtype);
/* The dtype a caller keeps operands of `precision` in: the precision itself
 * (native, widened), or F32 holding values of that precision (fp32_rounded). */
ht_dtype ht_gemm_storage(ht_dtype precision);

/* One line for the run log: each kernel chosen, the rates it was chosen
 * from, the shape, the cost, oneDNN's version and the CPU's ISA. */
void ht_gemm_describe(const ht_gemm_choice *choice, char *buf, size_t n);
/* oneDNN's name for the CPU's instruction set ("avx512_core_bf16", ...). */
const char *ht_gemm_cpu_isa(void);

/* A sentence naming the kernel that runs GEMMs of this dtype now (for logs). */
const char *ht_gemm_kernel_name(ht_dtype dtype);

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
