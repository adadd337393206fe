/* The CUDA backend's products on cuBLASLt: ht_gemm's row-major C = alpha
 * op(A) op(B) + beta C as cuBLASLt's column-major Cᵀ = op(B)ᵀ op(A)ᵀ, bf16
 * and f16 operands on the tensor cores with FP32 accumulation and an FP32 C,
 * F32 operands in full FP32 (CUBLAS_COMPUTE_32F: no TF32). One plan
 * (descriptors and the heuristic's algorithm) per shape, cached; a product
 * no cuBLASLt algorithm takes runs on a plain kernel instead.
 *
 * The ragged products (an expert's rows, a count that changes every step)
 * share a plan per power of two of their rows: its algorithm, the
 * heuristic's for that many rows, runs each call on layouts of the call's
 * own size once cublasLtMatmulAlgoCheck says it can (else a plan of the
 * exact size, made for the call). One exact plan a row count would ask the
 * heuristic anew for nearly every call of a step, thousands of them in an
 * MoE model, once the cache is full; this way a row count always meets the
 * same algorithm, so a step repeats bit for bit.
 *
 * A shape's algorithm (ht_cuda_gemm): the fastest of the heuristic's first
 * GEMM_CANDIDATES, timed on the shape's first call, or the heuristic's
 * first (training.deterministic: every process the same). */
#include "kernels/cuda/cuda.cuh"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* Everything a plan depends on; no padding, so keys compare with memcmp. */
typedef struct plan_key {
    int32_t dtype, trans_a, trans_b, align_a, align_b, align_c;
    int32_t ragged; /* 1: the rows (M, or K when trans_a) are their power of two, the plan's layouts the call's */
    int32_t used;   /* a slot's mark, 1 in every key made */
    int64_t M, N, K, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
} plan_key;
static_assert(sizeof(plan_key) == 8 * 4 + 10 * 8, "plan_key must have no padding");

typedef struct plan {
    plan_key key;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c; /* cuBLASLt's A (our B), B (our A), C = D; NULL in a ragged plan */
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

/* The policy and its count (ht_kernels_cuda_gemm_choices), under g_plans.lock. */
static struct {
    ht_cuda_gemm how;
    int64_t timed, not_first;
} g_choice = {HT_CUDA_GEMM_TIMED, 0, 0};

/* What a shape's first call brings for its candidates' timing. */
typedef struct gemm_operands {
    const void *A, *B;
    float *C;
    float alpha, beta;
} gemm_operands;

#define GEMM_CANDIDATES 4
#define GEMM_TIMED_RUNS 3
/* The largest C a call with nonzero beta is timed on: the candidates write a copy of that size, not C */
#define GEMM_TIMING_COPY_MAX ((size_t)64 << 20)

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

/* The layouts of k's product: row-major (M, N) = op(A) (M, K) · op(B) (K, N)
 * is column-major (N, M) = op(B)ᵀ · op(A)ᵀ, so cuBLASLt's first operand is
 * our B (transposed as trans_b says) and its second our A. */
static bool layouts_make(const plan_key *k, cublasLtMatrixLayout_t *a, cublasLtMatrixLayout_t *b,
                         cublasLtMatrixLayout_t *c) {
    const cudaDataType_t in = cuda_type((ht_dtype)k->dtype);
    *a = *b = *c = NULL;
    /* stored column-major: B (K, N) row-major is (N, K), B (N, K) is (K, N); likewise A */
    return layout(a, in, k->trans_b ? k->K : k->N, k->trans_b ? k->N : k->K, k->ldb, k->batch, k->stride_b) &&
           layout(b, in, k->trans_a ? k->M : k->K, k->trans_a ? k->K : k->M, k->lda, k->batch, k->stride_a) &&
           layout(c, CUDA_R_32F, k->N, k->M, k->ldc, k->batch, k->stride_c);
}

static void layouts_destroy(cublasLtMatrixLayout_t *a, cublasLtMatrixLayout_t *b, cublasLtMatrixLayout_t *c) {
    if (*c) cublasLtMatrixLayoutDestroy(*c);
    if (*b) cublasLtMatrixLayoutDestroy(*b);
    if (*a) cublasLtMatrixLayoutDestroy(*a);
    *a = *b = *c = NULL;
}

static void plan_destroy(plan *p) {
    layouts_destroy(&p->a, &p->b, &p->c);
    if (p->op) cublasLtMatmulDescDestroy(p->op);
    p->op = NULL;
}

/* The bytes from C's first element to its last (batch strides and row pitch included). */
static size_t c_extent_bytes(const plan_key *k) {
    return (size_t)((k->batch - 1) * k->stride_c + (k->M - 1) * k->ldc + k->N) * sizeof(float);
}

/* Which of the n candidates runs p's product fastest on the call's operands:
 * each once to warm up, then GEMM_TIMED_RUNS times between two events. The
 * output is C where beta is 0 (the call writes it afterwards), else a copy
 * of C's extent (C only read): a call whose C is larger than
 * GEMM_TIMING_COPY_MAX, or where the copy or the events cannot be had,
 * takes the first. A candidate that fails to run is passed over; nothing is
 * recorded as the backend's failure. */
static int fastest(const plan *p, const cublasLtMatmulHeuristicResult_t *r, int n, const gemm_operands *o) {
    cuda_context *ctx = cuda_ctx();
    float *D = o->C;
    void *copy = NULL;
    if (o->beta != 0.0f) {
        const size_t bytes = c_extent_bytes(&p->key);
        if (bytes > GEMM_TIMING_COPY_MAX || !(copy = cuda_block(bytes))) return 0;
        D = (float *)copy;
    }
    cudaEvent_t ev[2] = {NULL, NULL};
    int pick = 0;
    float best = INFINITY, first = NAN;
    if (cudaEventCreate(&ev[0]) == cudaSuccess && cudaEventCreate(&ev[1]) == cudaSuccess) {
        for (int i = 0; i < n; i++) {
            if (r[i].state != CUBLAS_STATUS_SUCCESS || r[i].workspaceSize > ctx->lt_workspace_bytes) continue;
            bool ran = true;
            for (int run = 0; run <= GEMM_TIMED_RUNS && ran; run++) {
                if (run == 1) cudaEventRecord(ev[0], ctx->stream);
                ran = cublasLtMatmul(ctx->lt, p->op, &o->alpha, o->B, p->a, o->A, p->b, &o->beta, o->C, p->c, D, p->c,
                                     &r[i].algo, ctx->lt_workspace, ctx->lt_workspace_bytes,
                                     ctx->stream) == CUBLAS_STATUS_SUCCESS;
            }
            float ms = INFINITY;
            if (ran && cudaEventRecord(ev[1], ctx->stream) == cudaSuccess &&
                cudaEventSynchronize(ev[1]) == cudaSuccess && cudaEventElapsedTime(&ms, ev[0], ev[1]) == cudaSuccess) {
                if (i == 0) first = ms;
                if (ms < best) best = ms, pick = i;
            }
            cudaGetLastError(); /* a candidate that did not run is no failure of the backend's */
        }
    }
    cudaGetLastError();
    for (int i = 0; i < 2; i++)
        if (ev[i]) cudaEventDestroy(ev[i]);
    cuda_block_free(copy); /* waits for the timed runs */
    const plan_key *k = &p->key;
    g_choice.timed++;
    if (pick != 0) g_choice.not_first++;
    ht_log_debug("cuda: %s product M %lld N %lld K %lld batch %lld: cuBLASLt candidate %d of %d, %.4f ms a run "
                 "(the heuristic's first %.4f)",
                 ht_dtype_name((ht_dtype)k->dtype), (long long)k->M, (long long)k->N, (long long)k->K,
                 (long long)k->batch, pick + 1, n, best / GEMM_TIMED_RUNS, first / GEMM_TIMED_RUNS);
    return pick;
}

/* Makes the plan of p->key (a ragged key: its operation and algorithm, the
 * layouts made for the heuristic only); the algorithm timed on ops (the
 * call's operands) under HT_CUDA_GEMM_TIMED where ops is given. */
static bool plan_make(plan *p, const gemm_operands *ops) {
    const plan_key *k = &p->key;
    cuda_context *ctx = cuda_ctx();
    cublasOperation_t op_b = k->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = k->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    p->op = NULL;
    p->a = p->b = p->c = NULL;
    if (!lt_ok(cublasLtMatmulDescCreate(&p->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate") ||
        !lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof(op_b)), "transa") ||
        !lt_ok(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof(op_a)), "transb") ||
        !layouts_make(k, &p->a, &p->b, &p->c)) {
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
    cublasLtMatmulHeuristicResult_t results[GEMM_CANDIDATES];
    const bool timed = ops && !k->ragged && g_choice.how == HT_CUDA_GEMM_TIMED;
    int found = 0;
    if (ok)
        ok = lt_ok(cublasLtMatmulAlgoGetHeuristic(ctx->lt, p->op, p->a, p->b, p->c, p->c, pref,
                                                  timed ? GEMM_CANDIDATES : 1, results, &found),
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
    p->algo = results[timed && found > 1 ? fastest(p, results, found, ops) : 0].algo;
    if (k->ragged) layouts_destroy(&p->a, &p->b, &p->c);
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

/* What became of a product: run by cuBLASLt, left to the plain kernel (no
 * algorithm takes it), or failed. */
typedef enum { GEMM_RAN, GEMM_PLAIN, GEMM_FAILED } gemm_outcome;

/* p's product of the call's operands; `exact` is the call's own key. A
 * ragged plan's algorithm runs on layouts of the call's size where
 * cublasLtMatmulAlgoCheck takes them (within the workspace), else a plan of
 * the exact size is made for the call. */
static gemm_outcome plan_run(cuda_context *ctx, plan *p, const plan_key *exact, float alpha, const void *A,
                             const void *B, float beta, float *C) {
    if (p->plain) return GEMM_PLAIN;
    if (!p->key.ragged) {
        cublasStatus_t s = cublasLtMatmul(ctx->lt, p->op, &alpha, B, p->a, A, p->b, &beta, C, p->c, C, p->c, &p->algo,
                                          ctx->lt_workspace, ctx->lt_workspace_bytes, ctx->stream);
        return lt_ok(s, "cublasLtMatmul") ? GEMM_RAN : GEMM_FAILED;
    }
    cublasLtMatrixLayout_t a, b, c;
    if (!layouts_make(exact, &a, &b, &c)) {
        layouts_destroy(&a, &b, &c);
        return GEMM_FAILED;
    }
    cublasLtMatmulHeuristicResult_t check;
    memset(&check, 0, sizeof(check));
    gemm_outcome out;
    if (cublasLtMatmulAlgoCheck(ctx->lt, p->op, a, b, c, c, &p->algo, &check) == CUBLAS_STATUS_SUCCESS &&
        check.workspaceSize <= ctx->lt_workspace_bytes) {
        cublasStatus_t s = cublasLtMatmul(ctx->lt, p->op, &alpha, B, a, A, b, &beta, C, c, C, c, &p->algo,
                                          ctx->lt_workspace, ctx->lt_workspace_bytes, ctx->stream);
        out = lt_ok(s, "cublasLtMatmul") ? GEMM_RAN : GEMM_FAILED;
    } else {
        plan own;
        memset(&own, 0, sizeof(own));
        own.key = *exact;
        out = plan_make(&own, NULL) ? plan_run(ctx, &own, exact, alpha, A, B, beta, C) : GEMM_FAILED;
        plan_destroy(&own);
    }
    layouts_destroy(&a, &b, &c);
    return out;
}

/* The power of two at least `rows` (64 at least) that a ragged product's rows share a plan under. */
static int64_t ragged_rows(int64_t rows) {
    int64_t r = 64;
    while (r < rows) r *= 2;
    return r;
}

/* ht_gemm_batched's contract; `ragged`: ht_gemm_ragged's (one product, the
 * rows M, or K when trans_a, a count that changes from call to call). */
static void gemm_run(bool ragged, int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                     float alpha, const void *A, int64_t lda, int64_t stride_a, const void *B, int64_t ldb,
                     int64_t stride_b, ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t stride_c) {
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
    plan_key exact;
    memset(&exact, 0, sizeof(exact));
    exact.dtype = dtype;
    exact.trans_a = trans_a;
    exact.trans_b = trans_b;
    exact.align_a = alignment_of(A, batch > 1 ? stride_a * es : 0);
    exact.align_b = alignment_of(B, batch > 1 ? stride_b * es : 0);
    exact.align_c = alignment_of(C, batch > 1 ? stride_c * 4 : 0);
    exact.used = 1;
    exact.M = M, exact.N = N, exact.K = K, exact.lda = lda, exact.ldb = ldb, exact.ldc = ldc, exact.batch = batch;
    exact.stride_a = batch > 1 ? stride_a : 0;
    exact.stride_b = batch > 1 ? stride_b : 0;
    exact.stride_c = batch > 1 ? stride_c : 0;
    plan_key key = exact;
    if (ragged && batch == 1) {
        key.ragged = 1;
        if (trans_a)
            key.K = ragged_rows(K);
        else
            key.M = ragged_rows(M);
    }

    pthread_mutex_lock(&g_plans.lock);
    plan *p = NULL, local;
    size_t slot = key_hash(&key) & (PLAN_SLOTS - 1);
    while (g_plans.slots[slot].key.used && memcmp(&g_plans.slots[slot].key, &key, sizeof(key)) != 0)
        slot = (slot + 1) & (PLAN_SLOTS - 1);
    gemm_outcome out = GEMM_FAILED;
    if (g_plans.slots[slot].key.used) {
        p = &g_plans.slots[slot];
    } else {
        p = g_plans.entries < PLAN_MAX ? &g_plans.slots[slot] : &local;
        p->key = key;
        const gemm_operands ops = {A, B, C, alpha, beta};
        if (plan_make(p, &ops)) {
            if (p != &local) g_plans.entries++;
        } else {
            memset(&p->key, 0, sizeof(p->key)); /* the slot stays free */
            p = NULL;
        }
    }
    if (p) out = plan_run(ctx, p, &exact, alpha, A, B, beta, C);
    if (p == &local) plan_destroy(p);
    pthread_mutex_unlock(&g_plans.lock);
    if (out == GEMM_PLAIN)
        LAUNCH("gemm (plain kernel)", gemm_plain_kernel, cuda_blocks(elems), CUDA_THREADS, batch, trans_a, trans_b, M,
               N, K, alpha, A, lda, stride_a, B, ldb, stride_b, dtype, beta, C, ldc, stride_c);
    if (out == GEMM_FAILED)
        CUDA_LAUNCH(fill_nan_kernel, cuda_blocks(elems), CUDA_THREADS, 0, C, M, N, ldc, batch, stride_c);
}

extern "C" ht_cuda_gemm ht_kernels_cuda_set_gemm(ht_cuda_gemm how) {
    pthread_mutex_lock(&g_plans.lock);
    const ht_cuda_gemm was = g_choice.how;
    g_choice.how = how;
    pthread_mutex_unlock(&g_plans.lock);
    return was;
}

extern "C" void ht_kernels_cuda_gemm_choices(int64_t *timed, int64_t *not_first) {
    pthread_mutex_lock(&g_plans.lock);
    *timed = g_choice.timed;
    *not_first = g_choice.not_first;
    pthread_mutex_unlock(&g_plans.lock);
}

void cuda_gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                       const void *A, int64_t lda, int64_t stride_a, const void *B, int64_t ldb, int64_t stride_b,
                       ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t stride_c) {
    gemm_run(false, batch, trans_a, trans_b, M, N, K, alpha, A, lda, stride_a, B, ldb, stride_b, dtype, beta, C, ldc,
             stride_c);
}

/* the rows (M, or K when trans_a) a count that changes from call to call: one plan per power of two of them */
void cuda_gemm_ragged(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                      int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc) {
    gemm_run(true, 1, trans_a, trans_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, dtype, beta, C, ldc, 0);
}

void cuda_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
               const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc) {
    gemm_run(false, 1, trans_a, trans_b, M, N, K, alpha, A, lda, 0, B, ldb, 0, dtype, beta, C, ldc, 0);
}
