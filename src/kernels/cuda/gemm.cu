/* The CUDA backend's products on cuBLASLt: ht_gemm's row-major C = alpha
 * op(A) op(B) + beta C as cuBLASLt's column-major Cᵀ = op(B)ᵀ op(A)ᵀ, bf16
 * and f16 operands on the tensor cores with FP32 accumulation and an FP32 C,
 * F32 operands in full FP32 (CUBLAS_COMPUTE_32F: no TF32). One plan
 * (descriptors and the heuristic's algorithm) per shape, cached; a product
 * no cuBLASLt algorithm takes runs on a plain kernel instead. */
#include "kernels/cuda/cuda.cuh"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* Everything a plan depends on; no padding, so keys compare with memcmp. */
typedef struct plan_key {
    int32_t dtype, trans_a, trans_b, align_a, align_b, align_c, pad_;
    int32_t used; /* a slot's mark, 1 in every key made */
    int64_t M, N, K, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
} plan_key;
static_assert(sizeof(plan_key) == 8 * 4 + 10 * 8, "plan_key must have no padding");

typedef struct plan {
    plan_key key;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c; /* cuBLASLt's A (our B), B (our A), C = D */
    cublasLtMatmulAlgo_t algo;
    bool plain; /* no cuBLASLt algorithm: gemm_plain_kernel */
} plan;

/* Open addressing; past PLAN_MAX a plan is made for the call and destroyed
 * after (a caller with ever-new shapes is slow, not unbounded). */
#define PLAN_SLOTS 1024
#define PLAN_MAX 512

static struct {
    pthread_mutex_t lock;
    size_t entries;
    plan slots[PLAN_SLOTS];
} g_plans = {PTHREAD_MUTEX_INITIALIZER, 0, {}};

static bool lt_ok(cublasStatus_t s, const char *what) {
    if (s == CUBLAS_STATUS_SUCCESS) return true;
    return cuda_fail(what, cublasLtGetStatusString(s));
}

/* The largest power of two (at most 256) dividing the address and every
 * batch stride: what cuBLASLt's kernels may assume of each matrix. */
static int32_t alignment_of(const void *p, int64_t stride_bytes) {
    uintptr_t u = (uintptr_t)p | (uintptr_t)stride_bytes | 256u;
    return (int32_t)(u & (~u + 1));
}

static void plan_destroy(plan *p) {
    if (p->c) cublasLtMatrixLayoutDestroy(p->c);
    if (p->b) cublasLtMatrixLayoutDestroy(p->b);
    if (p->a) cublasLtMatrixLayoutDestroy(p->a);
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    p->a = p->b = p->c = NULL;
    p->op = NULL;
}

static cudaDataType_t cuda_type(ht_dtype dtype) {
    return dtype == HT_DTYPE_BF16 ? CUDA_R_16BF : dtype == HT_DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

static bool layout(cublasLtMatrixLayout_t *l, cudaDataType_t type, int64_t rows, int64_t cols, int64_t ld,
                   int64_t batch, int64_t stride) {
    if (!lt_ok(cublasLtMatrixLayoutCreate(l, type, (uint64_t)rows, (uint64_t)cols, ld), "cublasLtMatrixLayoutCreate"))
        return false;
    if (batch == 1) return true;
    int32_t count = (int32_t)batch;
    return lt_ok(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count, sizeof(count)),
                 "batch count") &&
           lt_ok(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof(stride)),
                 "batch stride");
}

/* Makes the plan of p->key: row-major (M, N) = op(A) (M, K) · op(B) (K, N)
 * is column-major (N, M) = op(B)ᵀ · op(A)ᵀ, so cuBLASLt's first operand is
 * our B (transposed as trans_b says) and its second our A. */
static bool plan_make(plan *p) {
    const plan_key *k = &p->key;
    cuda_context *ctx = cuda_ctx();
    const cudaDataType_t in = cuda_type((ht_dtype)k->dtype);
    cublasOperation_t op_b = k->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = k->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    p->op = NULL;
    p->a = p->b = p->c = NULL;
    if (!lt_ok(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate") ||
        !lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)), "transa") ||
        !lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)), "transb") ||
        /* stored column-major: B (K, N) row-major is (N, K), B (N, K) is (K, N); likewise A */
        !layout(&p->a, in, k->trans_b ? k->K : k->N, k->trans_b ? k->N : k->K, k->ldb, k->batch, k->stride_b) ||
        !layout(&p->b, in, k->trans_a ? k->M : k->K, k->trans_a ? k->K : k->M, k->lda, k->batch, k->stride_a) ||
        !layout(&p->c, CUDA_R_32F, k->N, k->M, k->ldc, k->batch, k->stride_c)) {
        plan_destroy(p);
        return false;
    }
    cublasLtMatmulPreference_t pref;
    if (!lt_ok(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate")) {
        plan_destroy(p);
        return false;
    }
    uint32_t aa = (uint32_t)k->align_b, ab = (uint32_t)k->align_a, ac = (uint32_t)k->align_c;
    bool ok =
        lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                   &ctx->lt_workspace_bytes, sizeof(ctx->lt_workspace_bytes)),
              "workspace preference") &&
        lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aa, sizeof(aa)),
              "alignment preference") &&
        lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ab, sizeof(ab)),
              "alignment preference") &&
        lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ac, sizeof(ac)),
              "alignment preference") &&
        lt_ok(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ac, sizeof(ac)),
              "alignment preference");
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    if (ok)
        ok = lt_ok(cublasLtMatmulAlgoGetHeuristic(ctx->lt, p->op, p->a, p->b, p->c, p->c, pref, 1, &result, &found),
                   "cublasLtMatmulAlgoGetHeuristic");
    cublasLtMatmulPreferenceDestroy(pref);
    if (!ok) {
        plan_destroy(p);
        return false;
    }
    p->plain = found == 0;
    if (p->plain) {
        plan_destroy(p);
        ht_log_warn("cuda: no cuBLASLt algorithm for the %s product M %lld N %lld K %lld batch %lld (lda %lld ldb %lld "
                    "ldc %lld): it runs on a plain kernel, slowly",
                    ht_dtype_name((ht_dtype)k->dtype), (long long)k->M, (long long)k->N, (long long)k->K,
                    (long long)k->batch, (long long)k->lda, (long long)k->ldb, (long long)k->ldc);
        return true;
    }
    p->algo = result.algo;
    return true;
}

/* C = alpha op(A) op(B) + beta C with one thread per output, the sum in
 * FP32 in k's order: what runs where cuBLASLt has no algorithm. */
__global__ void gemm_plain_kernel(int64_t batch, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha,
                                  const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                                  ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t sc) {
    CUDA_FOR(i, batch * M * N) {
        const int64_t e = i / (M * N), r = (i / N) % M, c = i % N;
        float s = 0.0f;
        for (int64_t k = 0; k < K; k++)
            s += dev_load(A, dtype, e * sa + (ta ? k * lda + r : r * lda + k)) *
                 dev_load(B, dtype, e * sb + (tb ? c * ldb + k : k * ldb + c));
        float *x = C + e * sc + r * ldc + c;
        *x = beta == 0.0f ? alpha * s : alpha * s + beta * *x;
    }
}

static uint64_t key_hash(const plan_key *k) {
    const unsigned char *b = (const unsigned char *)k;
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < sizeof(*k); i++) h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

/* C (M, N) with row stride ldc, `batch` of them stride_c apart, set to NaN:
 * a product that could not run leaves nothing that looks right. */
__global__ void fill_nan_kernel(float *C, int64_t M, int64_t N, int64_t ldc, int64_t batch, int64_t stride_c) {
    CUDA_FOR(i, batch * M * N) {
        int64_t e = i / (M * N), r = (i / N) % M, c = i % N;
        C[e * stride_c + r * ldc + c] = __int_as_float(0x7fc00000);
    }
}

/* C = beta C (K = 0: an empty sum); beta 0 writes zeros whatever C held. */
__global__ void scale_c_kernel(float *C, int64_t M, int64_t N, int64_t ldc, int64_t batch, int64_t stride_c,
                               float beta) {
    CUDA_FOR(i, batch * M * N) {
        int64_t e = i / (M * N), r = (i / N) % M, c = i % N;
        float *x = C + e * stride_c + r * ldc + c;
        *x = beta == 0.0f ? 0.0f : beta * *x;
    }
}

void cuda_gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const void *A, int64_t lda, int64_t stride_a, const void *B, int64_t ldb, int64_t stride_b,
                       ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t stride_c) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    cuda_context *ctx = cuda_ctx();
    const int64_t elems = batch * M * N;
    if (K <= 0) {
        CUDA_LAUNCH(scale_c_kernel, cuda_blocks(elems), CUDA_THREADS, 0, C, M, N, ldc, batch, stride_c, beta);
        cuda_check_launch("gemm (K 0)");
        return;
    }
    if (dtype != HT_DTYPE_F32 && dtype != HT_DTYPE_BF16 && dtype != HT_DTYPE_F16) {
        cuda_fail("gemm", "operands must be float32, bfloat16 or float16");
        CUDA_LAUNCH(fill_nan_kernel, cuda_blocks(elems), CUDA_THREADS, 0, C, M, N, ldc, batch, stride_c);
        return;
    }
    const int64_t es = (int64_t)ht_dtype_size(dtype);
    plan_key key;
    memset(&key, 0, sizeof(key));
    key.dtype = dtype;
    key.trans_a = trans_a;
    key.trans_b = trans_b;
    key.align_a = alignment_of(A, batch > 1 ? stride_a * es : 0);
    key.align_b = alignment_of(B, batch > 1 ? stride_b * es : 0);
    key.align_c = alignment_of(C, batch > 1 ? stride_c * 4 : 0);
    key.used = 1;
    key.M = M, key.N = N, key.K = K, key.lda = lda, key.ldb = ldb, key.ldc = ldc, key.batch = batch;
    key.stride_a = batch > 1 ? stride_a : 0;
    key.stride_b = batch > 1 ? stride_b : 0;
    key.stride_c = batch > 1 ? stride_c : 0;

    pthread_mutex_lock(&g_plans.lock);
    plan *p = NULL, local;
    size_t slot = key_hash(&key) & (PLAN_SLOTS - 1);
    while (g_plans.slots[slot].key.used && memcmp(&g_plans.slots[slot].key, &key, sizeof(key)) != 0)
        slot = (slot + 1) & (PLAN_SLOTS - 1);
    bool made = true;
    if (g_plans.slots[slot].key.used) {
        p = &g_plans.slots[slot];
    } else {
        p = g_plans.entries < PLAN_MAX ? &g_plans.slots[slot] : &local;
        p->key = key;
        made = plan_make(p);
        if (made && p != &local) g_plans.entries++;
        if (!made) memset(&p->key, 0, sizeof(p->key)); /* the slot stays free */
    }
    const bool plain = made && p->plain;
    if (made && !plain) {
        cublasStatus_t s = cublasLtMatmul(ctx->lt, p->op, &alpha, B, p->a, A, p->b, &beta, C, p->c, C, p->c, &p->algo,
                                          ctx->lt_workspace, ctx->lt_workspace_bytes, ctx->stream);
        made = lt_ok(s, "cublasLtMatmul");
        if (p == &local) plan_destroy(p);
    }
    pthread_mutex_unlock(&g_plans.lock);
    if (plain)
        LAUNCH("gemm (plain kernel)", gemm_plain_kernel, cuda_blocks(elems), CUDA_THREADS, batch, trans_a, trans_b, M,
               N, K, alpha, A, lda, stride_a, B, ldb, stride_b, dtype, beta, C, ldc, stride_c);
    if (!made) CUDA_LAUNCH(fill_nan_kernel, cuda_blocks(elems), CUDA_THREADS, 0, C, M, N, ldc, batch, stride_c);
}

void cuda_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
               const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc) {
    cuda_gemm_batched(1, trans_a, trans_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, dtype, beta, C, ldc, 0);
}
