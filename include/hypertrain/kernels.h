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

/* HT_OK, or the first product that could not run since the process started:
 * every later result is suspect, so a caller stops at the first failure. */
ht_status ht_gemm_status(ht_error *err);

/* How products of a 16-bit float dtype run. All three give the same
 * FP32-accumulated sums (products of 16-bit values are exact in FP32); they
 * differ in speed, which depends on the CPU, and in summation order. */
typedef enum ht_gemm_kernel {
    HT_GEMM_KERNEL_AUTO = 0,     /* the fastest of the three on this machine, measured */
    HT_GEMM_KERNEL_NATIVE,       /* oneDNN matmul on the 16-bit operands (AMX, AVX512-BF16, AVX512-FP16) */
    HT_GEMM_KERNEL_WIDENED,      /* 16-bit operands widened to FP32 tile by tile, then the FP32 matmul */
    HT_GEMM_KERNEL_FP32_ROUNDED, /* operands kept as FP32 values of that precision: the FP32 matmul */
    HT_GEMM_KERNEL_COUNT
} ht_gemm_kernel;

/* The kernels for bf16 and f16, and what they were chosen from. */
typedef struct ht_gemm_choice {
    ht_gemm_kernel bf16, f16; /* never AUTO */
    int64_t M, N, K;          /* the product timed: C (M, N) = A (M, K) · Bᵀ */
    double f32_rate;          /* GFLOP/s of the FP32 matmul; 0: nothing was timed */
    /* GFLOP/s of each kernel, indexed by ht_gemm_kernel; 0 where not timed
     * (a pinned kernel) or not offered (native without the ISA). */
    double bf16_rate[HT_GEMM_KERNEL_COUNT], f16_rate[HT_GEMM_KERNEL_COUNT];
    double seconds; /* what choosing cost */
} ht_gemm_choice;

/* Resolves the requested kernels: a pinned one is checked to exist here
 * (native where oneDNN offers none is an error naming the CPU's ISA); AUTO
 * times every kernel on one (M, N, K) product, typically a linear layer's,
 * and takes the fastest, where native or widened must beat fp32_rounded by 5%.
 * Costs a few hundred ms at most. Does not apply the choice: ht_gemm_use. */
ht_status ht_gemm_choose(ht_gemm_kernel bf16, ht_gemm_kernel f16, int64_t M, int64_t N, int64_t K, ht_gemm_choice *out,
                         ht_error *err);
/* Makes `choice` the process's: ht_gemm and ht_gemm_storage follow it. Call it
 * before products run on other threads. Without it, the first 16-bit product
 * chooses on a 1024³ product. */
void ht_gemm_use(const ht_gemm_choice *choice);
/* The kernel products of `dtype` run on now (NATIVE for F32). */
ht_gemm_kernel ht_gemm_kernel_of(ht_dtype dtype);
/* The dtype a caller keeps operands of `precision` in: the precision itself
 * (native, widened), or F32 holding values of that precision (fp32_rounded). */
ht_dtype ht_gemm_storage(ht_dtype precision);

const char *ht_gemm_kernel_label(ht_gemm_kernel kernel); /* "auto", "native", "widened", "fp32_rounded" */
bool ht_gemm_kernel_from_label(const char *label, ht_gemm_kernel *out);
/* One line for the run log: each kernel chosen, the rates it was chosen
 * from, the shape, the cost, oneDNN's version and the CPU's ISA. */
void ht_gemm_describe(const ht_gemm_choice *choice, char *buf, size_t n);
/* oneDNN's name for the CPU's instruction set ("avx512_core_bf16", ...). */
const char *ht_gemm_cpu_isa(void);

/* A sentence naming the kernel that runs GEMMs of this dtype now (for logs). */
const char *ht_gemm_kernel_name(ht_dtype dtype);

#ifdef __cplusplus
}
#endif
#endif
