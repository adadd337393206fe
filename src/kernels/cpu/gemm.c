/* GEMM over oneDNN: ht_gemm, the cache of matmul primitives it runs, and the
 * choice of kernel for bf16 and f16 products, made by timing each kernel on
 * this machine (ht_gemm_choose): oneDNN's native 16-bit matmul is twice its
 * F32 rate on some CPUs with AVX512-BF16 and 0.6x on others, so no CPU name
 * or ISA flag can decide it. */
#include "kernels/cpu/gemm.h"

#include <dnnl.h>
#include <dnnl_debug.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Everything that defines a primitive. nthr matters because oneDNN plans the
 * work split for omp_get_max_threads() when the primitive is created (see
 * gemm_matmul). No padding, so keys compare with memcmp. */
typedef struct gemm_key {
    int32_t dtype, trans_a, trans_b, nthr;
    int64_t M, N, K, lda, ldb, ldc;
    int64_t batch, stride_a, stride_b, stride_c; /* 1, 0, 0, 0 for one product */
    float alpha, beta;
} gemm_key;
_Static_assert(sizeof(gemm_key) == 4 * 4 + 10 * 8 + 2 * 4, "gemm_key must have no padding");

/* Open addressing over a power-of-two table. A model has tens of GEMM shapes;
 * past CACHE_MAX_ENTRIES a primitive is made for the call and destroyed after,
 * so a caller with ever-new shapes is slow but bounded in memory. Entries are
 * never evicted: another thread may be running them. */
#define CACHE_SLOTS 1024
#define CACHE_MAX_ENTRIES 512

typedef struct cache_slot {
    bool used;
    gemm_key key;
    dnnl_primitive_t prim;
} cache_slot;

/* The only global state of this file: created once, then guarded by `lock`. */
static struct {
    pthread_once_t once;
    pthread_mutex_t lock;
    dnnl_engine_t engine;
    pthread_key_t thread_key; /* each thread's thread_ctx */
    pthread_once_t choice_once;
    ht_gemm_choice choice; /* ht_gemm_use's, or measured at the first 16-bit product */
    bool chosen;
    size_t entries;
    bool warned_full;
    cache_slot slots[CACHE_SLOTS];
    char names[3][320]; /* ht_gemm_kernel_name, per dtype; empty until asked */
    bool have_thread_key;
    pthread_mutex_t fail_lock;      /* guards the two below (taken under `lock` too) */
    bool failed;                    /* a product could not run: ht_gemm_status reports it */
    char failure[HT_ERROR_MSG_MAX]; /* the first failure's message */
} g_gemm = {.once = PTHREAD_ONCE_INIT,
            .choice_once = PTHREAD_ONCE_INIT,
            .lock = PTHREAD_MUTEX_INITIALIZER,
            .fail_lock = PTHREAD_MUTEX_INITIALIZER};

/* ht_gemm has no error return (it sits in every kernel's inner loop): a
 * product that cannot run records the first failure, fills its C with NaN so
 * that nothing downstream looks right, and returns. Callers ask
 * ht_gemm_status at the end of a step and stop there with the message. */
static bool gemm_fail(const char *fmt, const char *detail) {
    char msg[HT_ERROR_MSG_MAX];
    snprintf(msg, sizeof(msg), fmt, detail);
    pthread_mutex_lock(&g_gemm.fail_lock);
    bool first = !g_gemm.failed;
    if (first) {
        snprintf(g_gemm.failure, sizeof(g_gemm.failure), "%s", msg);
        g_gemm.failed = true;
    }
    pthread_mutex_unlock(&g_gemm.fail_lock);
    if (first) ht_log(HT_LOG_ERROR, "ht_gemm: %s", msg);
    return false;
}

static bool dnnl_ok(dnnl_status_t status, const char *what) {
    if (status == dnnl_success) return true;
    char msg[256];
    snprintf(msg, sizeof(msg), "%s failed: %s", what, dnnl_status2str(status));
    return gemm_fail("%s", msg);
}

ht_status ht_gemm_status(ht_error *err) {
    pthread_mutex_lock(&g_gemm.fail_lock);
    bool failed = g_gemm.failed;
    char msg[sizeof(g_gemm.failure)];
    memcpy(msg, g_gemm.failure, sizeof(msg));
    pthread_mutex_unlock(&g_gemm.fail_lock);
    return failed ? ht_fail(err, HT_ERR_INVALID, "a matrix product could not run: %s", msg) : HT_OK;
}

/* What each thread that calls ht_gemm owns, released when the thread exits:
 * a CPU stream, since oneDNN does not promise that one stream may serve
 * several threads at once, and the scratchpad its primitives run with. The
 * scratchpad is ours (user mode) because with oneDNN 2.6's own, two threads
 * running the same primitive at once (attention heads) corrupted each other's
 * results (test_gemm_inside_parallel_region failed in 19 runs of 20). */
typedef struct thread_ctx {
    dnnl_stream_t stream;
    void *scratch;
    size_t scratch_bytes;
} thread_ctx;

static void thread_ctx_destroy(void *p) {
    thread_ctx *ctx = p;
    dnnl_stream_destroy(ctx->stream);
    ht_free(ctx->scratch);
    free(ctx);
}

static void gemm_init_once(void) {
    if (!dnnl_ok(dnnl_engine_create(&g_gemm.engine, dnnl_cpu, 0), "dnnl_engine_create")) g_gemm.engine = NULL;
    g_gemm.have_thread_key = pthread_key_create(&g_gemm.thread_key, thread_ctx_destroy) == 0;
    if (!g_gemm.have_thread_key) gemm_fail("%s", "pthread_key_create failed");
}

/* This thread's context, with a scratchpad of at least scratch_bytes; NULL on failure (recorded). */
static thread_ctx *thread_ctx_get(size_t scratch_bytes) {
    if (!g_gemm.engine || !g_gemm.have_thread_key) return NULL;
    thread_ctx *ctx = pthread_getspecific(g_gemm.thread_key);
    if (!ctx) {
        ctx = calloc(1, sizeof(*ctx));
        if (!ctx) return gemm_fail("%s", "out of memory for a thread context"), NULL;
        if (!dnnl_ok(dnnl_stream_create(&ctx->stream, g_gemm.engine, dnnl_stream_default_flags),
                     "dnnl_stream_create")) {
            free(ctx);
            return NULL;
        }
        if (pthread_setspecific(g_gemm.thread_key, ctx) != 0) {
            thread_ctx_destroy(ctx);
            return gemm_fail("%s", "pthread_setspecific failed"), NULL;
        }
    }
    if (scratch_bytes > ctx->scratch_bytes) {
        ht_free(ctx->scratch);
        ctx->scratch_bytes = 0;
        ctx->scratch = ht_alloc(scratch_bytes);
        if (!ctx->scratch) return gemm_fail("%s", "out of memory for the scratchpad"), NULL;
        ctx->scratch_bytes = scratch_bytes;
    }
    return ctx;
}

/* One operand, (rows, cols) with row stride ld, transposed as a stride:
 * [r][c] is at r*ld + c, or c*ld + r when trans; behind a batch dimension
 * of its own stride when nd is 3. */
static dnnl_status_t operand_md(dnnl_memory_desc_t *md, int nd, int64_t batch, int64_t stride, int64_t rows,
                                int64_t cols, int64_t ld, bool trans, dnnl_data_type_t type) {
    dnnl_dims_t dims = {batch, rows, cols}, strides = {stride, trans ? 1 : ld, trans ? ld : 1};
    return dnnl_memory_desc_init_by_strides(md, nd, dims + 3 - nd, type, strides + 3 - nd);
}

/* op(A) (M, K), op(B) (K, N), C (M, N). M and K are the key's, or (a ragged
 * key's DNNL_RUNTIME_DIM_VAL) the call's. One product stays 2-D, so its
 * primitive is the one it always was; a batch is 3-D. */
static dnnl_status_t operand_mds(const gemm_key *k, int64_t M, int64_t K, dnnl_memory_desc_t *a_md,
                                 dnnl_memory_desc_t *b_md, dnnl_memory_desc_t *c_md) {
    const int nd = k->batch > 1 ? 3 : 2;
    dnnl_data_type_t in = k->dtype == HT_DTYPE_BF16 ? dnnl_bf16 : k->dtype == HT_DTYPE_F16 ? dnnl_f16 : dnnl_f32;
    dnnl_status_t s = operand_md(a_md, nd, k->batch, k->stride_a, M, K, k->lda, k->trans_a, in);
    if (s == dnnl_success) s = operand_md(b_md, nd, k->batch, k->stride_b, K, k->N, k->ldb, k->trans_b, in);
    if (s == dnnl_success) s = operand_md(c_md, nd, k->batch, k->stride_c, M, k->N, k->ldc, false, dnnl_f32);
    return s;
}

static dnnl_status_t matmul_pd_create(const gemm_key *k, dnnl_primitive_desc_t *pd) {
    dnnl_memory_desc_t a_md, b_md, c_md;
    dnnl_status_t s = operand_mds(k, k->M, k->K, &a_md, &b_md, &c_md);
    dnnl_matmul_desc_t desc;
    if (s == dnnl_success) s = dnnl_matmul_desc_init(&desc, &a_md, &b_md, NULL, &c_md);

    /* C = alpha·acc + beta·C: alpha is the output scale, beta a sum post-op,
     * which oneDNN applies after the scale. beta = 0 has no sum, so the old C
     * (NaN included) is never read. */
    dnnl_primitive_attr_t attr = NULL;
    dnnl_post_ops_t post_ops = NULL;
    if (s == dnnl_success) s = dnnl_primitive_attr_create(&attr);
    if (s == dnnl_success) s = dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user);
    if (s == dnnl_success && k->alpha != 1.0f) s = dnnl_primitive_attr_set_output_scales(attr, 1, 0, &k->alpha);
    if (s == dnnl_success && k->beta != 0.0f) {
        s = dnnl_post_ops_create(&post_ops);
        if (s == dnnl_success) s = dnnl_post_ops_append_sum(post_ops, k->beta);
        if (s == dnnl_success) s = dnnl_primitive_attr_set_post_ops(attr, post_ops);
    }
    if (s == dnnl_success) s = dnnl_primitive_desc_create(pd, &desc, attr, g_gemm.engine, NULL);
    if (post_ops) dnnl_post_ops_destroy(post_ops);
    if (attr) dnnl_primitive_attr_destroy(attr);
    return s;
}

/* NULL on failure (recorded). */
static dnnl_primitive_t matmul_create(const gemm_key *k) {
    dnnl_primitive_desc_t pd;
    dnnl_primitive_t prim = NULL;
    dnnl_status_t s = matmul_pd_create(k, &pd);
    if (s == dnnl_unimplemented) {
        char msg[160];
        snprintf(msg, sizeof(msg), "oneDNN offers no %s matmul on this CPU (ISA %s)", ht_dtype_name(k->dtype),
                 ht_gemm_cpu_isa());
        return gemm_fail("%s", msg), NULL;
    }
    if (!dnnl_ok(s, "matmul primitive descriptor")) return NULL;
    if (!dnnl_ok(dnnl_primitive_create(&prim, pd), "dnnl_primitive_create")) prim = NULL;
    dnnl_primitive_desc_destroy(pd);
    return prim;
}

/* The cached primitive for key, created on first use. *owned is set when the
 * cache is full and the caller must destroy the primitive after running it. */
static dnnl_primitive_t cache_get(const gemm_key *key, bool *owned) {
    uint64_t h = ht_fnv1a64(key, sizeof(*key), HT_FNV64_INIT);
    *owned = false;
    pthread_mutex_lock(&g_gemm.lock);
    size_t i = (size_t)h & (CACHE_SLOTS - 1);
    while (g_gemm.slots[i].used && memcmp(&g_gemm.slots[i].key, key, sizeof(*key)) != 0)
        i = (i + 1) & (CACHE_SLOTS - 1);
    cache_slot *slot = &g_gemm.slots[i];
    if (!slot->used && g_gemm.entries >= CACHE_MAX_ENTRIES) {
        if (!g_gemm.warned_full)
            ht_log_warn("ht_gemm: %d GEMM shapes cached; new shapes now pay primitive creation "
                        "on every call",
                        CACHE_MAX_ENTRIES);
        g_gemm.warned_full = true;
        pthread_mutex_unlock(&g_gemm.lock);
        *owned = true;
        return matmul_create(key);
    }
    if (!slot->used) {
        /* Created under the lock: it takes about a millisecond, happens once
         * per shape, and two threads never build the same primitive. */
        dnnl_primitive_t created = matmul_create(key);
        if (!created) { /* not cached: the next call tries again, and fails alike */
            pthread_mutex_unlock(&g_gemm.lock);
            return NULL;
        }
        slot->prim = created;
        slot->key = *key;
        slot->used = true;
        g_gemm.entries++;
    }
    dnnl_primitive_t prim = slot->prim;
    pthread_mutex_unlock(&g_gemm.lock);
    return prim;
}

/* The batch of a product: how many, and each operand's stride from one to the next (elements). */
typedef struct gemm_batch {
    int64_t count, a, b, c;
} gemm_batch;
static const gemm_batch ONE = {1, 0, 0, 0};

/* Runs one GEMM (or a batch of them) of F32 or BF16 operands through a cached matmul primitive; false on a failure
 * (recorded). */
static bool gemm_matmul(bool ragged, gemm_batch bt, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                        float alpha, const void *A, int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta,
                        float *C, int64_t ldc) {
    /* Inside an active parallel region oneDNN's OpenMP runtime runs every
     * parallel section on the calling thread alone, while a primitive plans
     * its work split for the thread count it is created under. 2.6 gives
     * right results either way (tested), but nothing in its API promises that
     * a primitive built for two threads is right when run on one. Asking for
     * one thread while nested builds nested primitives for exactly that, and
     * nthr in the key keeps them apart from the others. nthreads-var is per
     * task, so no other thread sees the change. */
    bool nested = omp_in_parallel();
    int saved_threads = omp_get_max_threads();
    if (nested) omp_set_num_threads(1);

    gemm_key key = {.dtype = (int32_t)dtype,
                    .trans_a = trans_a,
                    .trans_b = trans_b,
                    .nthr = omp_get_max_threads(),
                    .M = M,
                    .N = N,
                    .K = K,
                    .lda = lda,
                    .ldb = ldb,
                    .ldc = ldc,
                    .batch = bt.count,
                    .stride_a = bt.count > 1 ? bt.a : 0,
                    .stride_b = bt.count > 1 ? bt.b : 0,
                    .stride_c = bt.count > 1 ? bt.c : 0,
                    .alpha = alpha,
                    .beta = beta};
    /* Ragged: the row count (M, or K when trans_a) is a runtime size, one primitive for every count. */
    if (ragged && trans_a)
        key.K = DNNL_RUNTIME_DIM_VAL;
    else if (ragged)
        key.M = DNNL_RUNTIME_DIM_VAL;
    bool owned = false, ok = false;
    dnnl_primitive_t prim = g_gemm.engine ? cache_get(&key, &owned) : NULL;
    const_dnnl_primitive_desc_t pd;
    dnnl_exec_arg_t args[4];
    int nargs = 0, made = 0;
    thread_ctx *ctx = NULL;
    if (prim && dnnl_ok(dnnl_primitive_get_primitive_desc(prim, &pd), "dnnl_primitive_get_primitive_desc")) {
        size_t scratch_bytes = dnnl_memory_desc_get_size(dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0));
        ctx = thread_ctx_get(scratch_bytes);
        nargs = scratch_bytes ? 4 : 3;
    }
    if (ctx) {
        /* oneDNN takes non-const handles; it only reads src and weights. */
        void *handles[4] = {(void *)A, (void *)B, C, ctx->scratch};
        const dnnl_query_t queries[4] = {dnnl_query_src_md, dnnl_query_weights_md, dnnl_query_dst_md,
                                         dnnl_query_scratchpad_md};
        const int arg_names[4] = {DNNL_ARG_SRC, DNNL_ARG_WEIGHTS, DNNL_ARG_DST, DNNL_ARG_SCRATCHPAD};
        dnnl_memory_desc_t concrete[3];
        bool have_concrete = ragged && dnnl_ok(operand_mds(&key, M, K, &concrete[0], &concrete[1], &concrete[2]),
                                               "ragged memory descriptors");
        for (; made < nargs && (!ragged || have_concrete); made++) {
            args[made].arg = arg_names[made];
            const dnnl_memory_desc_t *md =
                ragged && made < 3 ? &concrete[made] : dnnl_primitive_desc_query_md(pd, queries[made], 0);
            if (!dnnl_ok(dnnl_memory_create(&args[made].memory, md, g_gemm.engine, handles[made]),
                         "dnnl_memory_create"))
                break;
        }
        ok = made == nargs &&
             dnnl_ok(dnnl_primitive_execute(prim, ctx->stream, nargs, args), "dnnl_primitive_execute") &&
             dnnl_ok(dnnl_stream_wait(ctx->stream), "dnnl_stream_wait");
    }
    for (int i = 0; i < made; i++) dnnl_memory_destroy(args[i].memory);
    if (owned) dnnl_primitive_destroy(prim);

    if (nested) omp_set_num_threads(saved_threads);
    return ok;
}

/* Tiles of the widened path: the F32 copies of an A and a B tile take at most
 * (WIDEN_TILE_MN + WIDEN_TILE_MN) · WIDEN_TILE_K floats = 16 MiB, and each
 * operand is widened ceil(N or M / WIDEN_TILE_MN) times, a few percent of the
 * GEMM for the decoder's shapes. */
#define WIDEN_TILE_MN 2048
#define WIDEN_TILE_K 1024

/* Widens rows × cols of a row-major bf16/f16 matrix (row stride ld) into a
 * dense f32 block, on the calling thread: spread over both cores of our
 * shared 2-core machine, the widening made the bf16 path 1.3-2x slower. */
static void widen_block(float *dst, const uint16_t *src, ht_dtype dtype, int64_t ld, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) ht_convert(dst + r * cols, HT_DTYPE_F32, src + r * ld, dtype, (size_t)cols);
}

/* The widened kernel: 16-bit operands widened to F32 tile by tile, then the
 * F32 matmul. F32 holds every bf16 and f16 value and their products exactly,
 * so the result is the same FP32-accumulated sum as a native kernel's. It
 * serves callers that keep 16-bit operands where oneDNN has no native kernel
 * (f16 on most CPUs) or where the native one is slower. Each tile runs the
 * F32 path; over K the first tile applies beta and the next ones accumulate
 * with beta = 1. */
static bool gemm_widened(bool ragged, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const uint16_t *A, int64_t lda, const uint16_t *B, int64_t ldb, ht_dtype dtype, float beta,
                         float *C, int64_t ldc) {
    int64_t mt = M < WIDEN_TILE_MN ? M : WIDEN_TILE_MN, nt = N < WIDEN_TILE_MN ? N : WIDEN_TILE_MN;
    int64_t kt = K < WIDEN_TILE_K ? K : WIDEN_TILE_K;
    float *a32 = malloc((size_t)(mt * kt) * sizeof(float)), *b32 = malloc((size_t)(kt * nt) * sizeof(float));
    bool ok = a32 && b32;
    if (!ok) gemm_fail("%s", "out of memory for the widened tiles");
    for (int64_t m0 = 0; ok && m0 < M; m0 += mt) {
        int64_t mb = M - m0 < mt ? M - m0 : mt;
        for (int64_t n0 = 0; ok && n0 < N; n0 += nt) {
            int64_t nb = N - n0 < nt ? N - n0 : nt;
            for (int64_t k0 = 0; ok && k0 < K; k0 += kt) {
                int64_t kb = K - k0 < kt ? K - k0 : kt;
                /* Each block keeps its stored orientation, so the tile GEMM keeps the transposes. */
                if (trans_a)
                    widen_block(a32, A + k0 * lda + m0, dtype, lda, kb, mb);
                else
                    widen_block(a32, A + m0 * lda + k0, dtype, lda, mb, kb);
                if (trans_b)
                    widen_block(b32, B + n0 * ldb + k0, dtype, ldb, nb, kb);
                else
                    widen_block(b32, B + k0 * ldb + n0, dtype, ldb, kb, nb);
                ok = gemm_matmul(ragged, ONE, trans_a, trans_b, mb, nb, kb, alpha, a32, trans_a ? mb : kb, b32,
                                 trans_b ? kb : nb, HT_DTYPE_F32, k0 == 0 ? beta : 1.0f, C + m0 * ldc + n0, ldc);
            }
        }
    }
    free(a32);
    free(b32);
    return ok;
}

/* What a product that could not run leaves in C: NaN, so that no result built on it looks right. */
static void fill_nan(float *C, int64_t M, int64_t N, int64_t ldc) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) C[m * ldc + n] = NAN;
}

static void gemm_run(ht_gemm_path path, bool ragged, gemm_batch bt, bool trans_a, bool trans_b, int64_t M, int64_t N,
                     int64_t K, float alpha, const void *A, int64_t lda, const void *B, int64_t ldb, ht_dtype dtype,
                     float beta, float *C, int64_t ldc) {
    if (dtype != HT_DTYPE_F32 && dtype != HT_DTYPE_BF16 && dtype != HT_DTYPE_F16) {
        gemm_fail("dtype %s is not a GEMM dtype (float32, bfloat16 or float16)", ht_dtype_name(dtype));
        return; /* C's layout is unknown to trust: left as it is */
    }
    if (M < 0 || N < 0 || K < 0 || ldc < (N > 1 ? N : 1) || lda < ((trans_a ? M : K) > 1 ? (trans_a ? M : K) : 1) ||
        ldb < ((trans_b ? K : N) > 1 ? (trans_b ? K : N) : 1) || bt.count < 0 ||
        (bt.count > 1 && (bt.a < 0 || bt.b < 0 || bt.c < M * ldc))) {
        char shape[320];
        snprintf(shape, sizeof(shape),
                 "M=%lld N=%lld K=%lld lda=%lld ldb=%lld ldc=%lld trans_a=%d trans_b=%d batch=%lld strides %lld, "
                 "%lld, %lld",
                 (long long)M, (long long)N, (long long)K, (long long)lda, (long long)ldb, (long long)ldc, trans_a,
                 trans_b, (long long)bt.count, (long long)bt.a, (long long)bt.b, (long long)bt.c);
        gemm_fail("invalid shape or leading dimension: %s", shape);
        return; /* C's layout is unknown to trust: left as it is */
    }
    /* Before oneDNN, which divides by zero creating an M = 0 matmul. */
    if (M == 0 || N == 0 || bt.count == 0) return;
    if (K == 0) { /* an empty sum: C = beta·C, where beta = 0 must also clear NaN */
        for (int64_t e = 0; e < bt.count; e++)
            for (int64_t m = 0; m < M; m++)
                for (int64_t n = 0; n < N; n++) {
                    float *c = C + e * bt.c + m * ldc + n;
                    *c = beta == 0.0f ? 0.0f : beta * *c;
                }
        return;
    }
    pthread_once(&g_gemm.once, gemm_init_once);
    if (path == HT_GEMM_PATH_AUTO)
        path = dtype == HT_DTYPE_F32 || ht_gemm_kernel_of(dtype) == HT_GEMM_KERNEL_NATIVE ? HT_GEMM_PATH_MATMUL
                                                                                          : HT_GEMM_PATH_WIDEN;
    if (path == HT_GEMM_PATH_WIDEN && dtype != HT_DTYPE_F32) { /* tile by tile: one product at a time */
        for (int64_t e = 0; e < bt.count; e++) {
            float *c = C + e * bt.c;
            if (!gemm_widened(ragged, trans_a, trans_b, M, N, K, alpha, (const uint16_t *)A + e * bt.a, lda,
                              (const uint16_t *)B + e * bt.b, ldb, dtype, beta, c, ldc))
                fill_nan(c, M, N, ldc);
        }
        return;
    }
    /* One product at a time here too. oneDNN's matmul over a batch dimension
     * plans its work for the batch: on an AVX2 CPU without AVX-512 (an AMD
     * EPYC, 2026-12-02) a product's sums then ran in another order than the
     * same product alone, so a Muon matrix's update depended on which
     * matrices shared its shape (tests/test_muon.c); one batch-1 primitive,
     * cached, runs each of them as it would run alone. */
    const size_t esize = ht_dtype_size(dtype);
    for (int64_t e = 0; e < bt.count; e++) {
        float *c = C + e * bt.c;
        if (!gemm_matmul(ragged, ONE, trans_a, trans_b, M, N, K, alpha, (const char *)A + (size_t)(e * bt.a) * esize,
                         lda, (const char *)B + (size_t)(e * bt.b) * esize, ldb, dtype, beta, c, ldc))
            fill_nan(c, M, N, ldc);
    }
}

void ht_gemm_on_path(ht_gemm_path path, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const void *A, int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C,
                     int64_t ldc) {
    gemm_run(path, false, ONE, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, dtype, beta, C, ldc);
}

void ht_gemm_ragged(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                    int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc) {
    gemm_run(HT_GEMM_PATH_AUTO, true, ONE, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, dtype, beta, C, ldc);
}

void ht_gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const void *A, int64_t lda, int64_t stride_a, const void *B, int64_t ldb, int64_t stride_b,
                     ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t stride_c) {
    gemm_run(HT_GEMM_PATH_AUTO, false, (gemm_batch){batch, stride_a, stride_b, stride_c}, trans_a, trans_b, M, N, K,
             alpha, A, lda, B, ldb, dtype, beta, C, ldc);
}

void ht_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
             const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc) {
    ht_gemm_on_path(HT_GEMM_PATH_AUTO, trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, dtype, beta, C, ldc);
}

/* ------------------------------------------------------------------ choosing the kernels */

static const char *const KERNEL_LABELS[HT_GEMM_KERNEL_COUNT] = {"auto", "native", "widened", "fp32_rounded"};

const char *ht_gemm_kernel_label(ht_gemm_kernel kernel) {
    return kernel >= 0 && kernel < HT_GEMM_KERNEL_COUNT ? KERNEL_LABELS[kernel] : "unknown";
}

bool ht_gemm_kernel_from_label(const char *label, ht_gemm_kernel *out) {
    for (int k = 0; k < HT_GEMM_KERNEL_COUNT; k++)
        if (strcmp(label, KERNEL_LABELS[k]) == 0) {
            *out = (ht_gemm_kernel)k;
            return true;
        }
    return false;
}

/* Whether oneDNN offers a matmul on `dtype` operands here: it answers
 * "unimplemented" for bf16 on CPUs without AVX512-BF16 or AMX (it would
 * otherwise emulate it slowly or not at all), and for f16 without AVX512-FP16. */
/* The key of C (M, N) = A (M, K) · B (K, N), dense, alpha 1, beta 0. */
static gemm_key plain_key(ht_dtype dtype, int64_t M, int64_t N, int64_t K) {
    return (gemm_key){.dtype = (int32_t)dtype,
                      .nthr = omp_get_max_threads(),
                      .M = M,
                      .N = N,
                      .K = K,
                      .lda = K,
                      .ldb = N,
                      .ldc = N,
                      .batch = 1,
                      .alpha = 1.0f};
}

static bool matmul_available(ht_dtype dtype) {
    gemm_key key = plain_key(dtype, 64, 64, 64);
    dnnl_primitive_desc_t pd;
    if (matmul_pd_create(&key, &pd) != dnnl_success) return false;
    dnnl_primitive_desc_destroy(pd);
    return true;
}

/* The five ways a product can run, timed against each other. */
enum { CAND_F32, CAND_BF16_NATIVE, CAND_BF16_WIDENED, CAND_F16_NATIVE, CAND_F16_WIDENED, CANDIDATES };

typedef struct candidate {
    ht_dtype storage; /* the operands' dtype */
    ht_gemm_path path;
    void *A, *B;
    double best; /* seconds of the fastest call */
} candidate;

static bool candidate_init(candidate *c, ht_dtype storage, ht_gemm_path path, int64_t M, int64_t N, int64_t K,
                           const float *vals) {
    c->storage = storage;
    c->path = path;
    c->best = INFINITY;
    c->A = ht_alloc((size_t)(M * K) * ht_dtype_size(storage));
    c->B = ht_alloc((size_t)(N * K) * ht_dtype_size(storage));
    if (!c->A || !c->B) return false;
    ht_convert(c->A, storage, vals, HT_DTYPE_F32, (size_t)(M * K));
    ht_convert(c->B, storage, vals, HT_DTYPE_F32, (size_t)(N * K));
    return true;
}

/* Times the candidates that `on` selects on C (M, N) = A (M, K) · Bᵀ, the
 * form of a linear layer's forward pass, and fills GFLOP/s (0 where not
 * timed). In rounds, one call of each candidate per round, keeping each one's
 * fastest call, at least 3 rounds and until `seconds` have passed: on a
 * shared machine load that comes and goes then weighs on all of them alike.
 * The first call of each creates its primitive and is not timed. Operands are
 * normal values exact in bf16 (and so in f16 as well, up to its range). */
static bool time_candidates(const bool *on, int64_t M, int64_t N, int64_t K, double seconds, double *gflops) {
    size_t n = (size_t)(M > N ? M : N) * (size_t)K;
    float *vals = ht_alloc(n * sizeof(float)), *C = ht_alloc((size_t)(M * N) * sizeof(float));
    if (!vals || !C) {
        ht_free(vals);
        ht_free(C);
        return false;
    }
    ht_rng rng;
    ht_rng_seed(&rng, 1);
    for (size_t i = 0; i < n; i++) vals[i] = ht_rng_normal(&rng);
    ht_round_to(vals, n, HT_DTYPE_BF16);
    static const ht_dtype storage[CANDIDATES] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_BF16, HT_DTYPE_F16,
                                                 HT_DTYPE_F16};
    static const ht_gemm_path path[CANDIDATES] = {HT_GEMM_PATH_MATMUL, HT_GEMM_PATH_MATMUL, HT_GEMM_PATH_WIDEN,
                                                  HT_GEMM_PATH_MATMUL, HT_GEMM_PATH_WIDEN};
    candidate cand[CANDIDATES] = {0};
    bool ok = true;
    for (int c = 0; c < CANDIDATES && ok; c++)
        if (on[c]) {
            ok = candidate_init(&cand[c], storage[c], path[c], M, N, K, vals);
            if (ok)
                ht_gemm_on_path(path[c], false, true, M, N, K, 1.0f, cand[c].A, K, cand[c].B, K, storage[c], 0.0f, C,
                                N);
        }
    double start = ht_time_seconds();
    for (int round = 0; ok && round < 100 && (round < 3 || ht_time_seconds() - start < seconds); round++)
        for (int c = 0; c < CANDIDATES; c++) {
            if (!on[c]) continue;
            double t0 = ht_time_seconds();
            ht_gemm_on_path(path[c], false, true, M, N, K, 1.0f, cand[c].A, K, cand[c].B, K, storage[c], 0.0f, C, N);
            double t = ht_time_seconds() - t0;
            cand[c].best = t < cand[c].best ? t : cand[c].best;
        }
    for (int c = 0; c < CANDIDATES; c++) {
        gflops[c] = on[c] ? 2.0 * (double)M * (double)N * (double)K / cand[c].best / 1e9 : 0.0;
        ht_free(cand[c].A);
        ht_free(cand[c].B);
    }
    ht_free(vals);
    ht_free(C);
    return ok;
}

/* Rates are timed once per shape in a process and kept: a second trainer in
 * the same process (a test, a resume) then makes the same choice, whatever
 * the machine's noise. */
#define SHAPES_KEPT 16
typedef struct kept_rates {
    int64_t M, N, K;
    double gflops[CANDIDATES];
} kept_rates;
static struct {
    int count;
    kept_rates items[SHAPES_KEPT];
} g_rates; /* guarded by g_gemm.lock */

/* False when the timing buffers cannot be allocated. */
static bool rates_for(int64_t M, int64_t N, int64_t K, double *gflops) {
    pthread_mutex_lock(&g_gemm.lock);
    for (int i = 0; i < g_rates.count; i++)
        if (g_rates.items[i].M == M && g_rates.items[i].N == N && g_rates.items[i].K == K) {
            memcpy(gflops, g_rates.items[i].gflops, sizeof(g_rates.items[i].gflops));
            pthread_mutex_unlock(&g_gemm.lock);
            return true;
        }
    pthread_mutex_unlock(&g_gemm.lock);
    const bool on[CANDIDATES] = {true, matmul_available(HT_DTYPE_BF16), true, matmul_available(HT_DTYPE_F16), true};
    if (!time_candidates(on, M, N, K, 0.3, gflops)) return false; /* unlocked: it runs ht_gemm */
    pthread_mutex_lock(&g_gemm.lock);
    if (g_rates.count < SHAPES_KEPT) {
        kept_rates *k = &g_rates.items[g_rates.count++];
        k->M = M;
        k->N = N;
        k->K = K;
        memcpy(k->gflops, gflops, sizeof(k->gflops));
    }
    pthread_mutex_unlock(&g_gemm.lock);
    return true;
}

/* The candidate that runs `kernel` for products of `dtype`, or -1 where there is none. */
static int candidate_of(ht_dtype dtype, ht_gemm_kernel kernel) {
    if (dtype == HT_DTYPE_F32 || kernel == HT_GEMM_KERNEL_FP32_ROUNDED) return CAND_F32;
    if (dtype != HT_DTYPE_BF16 && dtype != HT_DTYPE_F16) return -1;
    const bool bf16 = dtype == HT_DTYPE_BF16;
    if (kernel == HT_GEMM_KERNEL_NATIVE)
        return matmul_available(dtype) ? (bf16 ? CAND_BF16_NATIVE : CAND_F16_NATIVE) : -1;
    if (kernel == HT_GEMM_KERNEL_WIDENED) return bf16 ? CAND_BF16_WIDENED : CAND_F16_WIDENED;
    return -1;
}

typedef struct kept_rate {
    int cand;
    int64_t M, N, K;
    double gflops;
} kept_rate;

double ht_gemm_rate(ht_dtype dtype, ht_gemm_kernel kernel, int64_t M, int64_t N, int64_t K) {
    enum { KEPT = 8 };
    static kept_rate kept[KEPT]; /* guarded by g_gemm.lock */
    static int count;
    if (M < 1 || N < 1 || K < 1) return 0.0;
    pthread_once(&g_gemm.once, gemm_init_once);
    const int c = candidate_of(dtype, kernel);
    if (c < 0 || !matmul_available(HT_DTYPE_F32)) return 0.0;
    pthread_mutex_lock(&g_gemm.lock);
    for (int i = 0; i < count; i++)
        if (kept[i].cand == c && kept[i].M == M && kept[i].N == N && kept[i].K == K) {
            double r = kept[i].gflops;
            pthread_mutex_unlock(&g_gemm.lock);
            return r;
        }
    pthread_mutex_unlock(&g_gemm.lock);
    bool on[CANDIDATES] = {false};
    on[c] = true;
    double gflops[CANDIDATES] = {0};
    if (!time_candidates(on, M, N, K, 0.0, gflops)) return 0.0; /* unlocked: it runs ht_gemm */
    pthread_mutex_lock(&g_gemm.lock);
    if (count < KEPT) kept[count++] = (kept_rate){c, M, N, K, gflops[c]};
    pthread_mutex_unlock(&g_gemm.lock);
    return gflops[c];
}

/* A kernel other than fp32_rounded must beat it by this factor to be chosen:
 * a near tie would otherwise flip between runs with the machine's noise. */
#define CHOICE_MARGIN 1.05

/* `rates` (indexed by ht_gemm_kernel) from the timed candidates of one dtype;
 * the fastest kernel, or the pinned one after checking that it exists. */
static ht_status choose_dtype(ht_dtype dtype, ht_gemm_kernel requested, const double *gflops, double *rates,
                              ht_gemm_kernel *out, ht_error *err) {
    if (requested == HT_GEMM_KERNEL_NATIVE && !matmul_available(dtype))
        return ht_fail(err, HT_ERR_CONFIG,
                       "kernels.%s_gemm: native: oneDNN %d.%d offers no %s matmul on this CPU (ISA %s); use auto, "
                       "widened or fp32_rounded",
                       dtype == HT_DTYPE_BF16 ? "bf16" : "f16", dnnl_version()->major, dnnl_version()->minor,
                       ht_dtype_name(dtype), ht_gemm_cpu_isa());
    if (requested != HT_GEMM_KERNEL_AUTO) {
        *out = requested;
        return HT_OK;
    }
    bool bf16 = dtype == HT_DTYPE_BF16;
    rates[HT_GEMM_KERNEL_NATIVE] = gflops[bf16 ? CAND_BF16_NATIVE : CAND_F16_NATIVE];
    rates[HT_GEMM_KERNEL_WIDENED] = gflops[bf16 ? CAND_BF16_WIDENED : CAND_F16_WIDENED];
    rates[HT_GEMM_KERNEL_FP32_ROUNDED] = gflops[CAND_F32];
    *out = HT_GEMM_KERNEL_FP32_ROUNDED;
    double best = gflops[CAND_F32] * CHOICE_MARGIN;
    for (ht_gemm_kernel k = HT_GEMM_KERNEL_NATIVE; k <= HT_GEMM_KERNEL_WIDENED; k++)
        if (rates[k] > best) {
            best = rates[k];
            *out = k;
        }
    return HT_OK;
}

ht_status ht_gemm_choose(ht_gemm_kernel bf16, ht_gemm_kernel f16, int64_t M, int64_t N, int64_t K, ht_gemm_choice *out,
                         ht_error *err) {
    memset(out, 0, sizeof(*out));
    if (M < 1 || N < 1 || K < 1)
        return ht_fail(err, HT_ERR_INVALID, "ht_gemm_choose: shape %lld x %lld x %lld", (long long)M, (long long)N,
                       (long long)K);
    pthread_once(&g_gemm.once, gemm_init_once);
    if (!matmul_available(HT_DTYPE_F32))
        return ht_fail(err, HT_ERR_INVALID, "oneDNN %d.%d offers no f32 matmul on this CPU (ISA %s)",
                       dnnl_version()->major, dnnl_version()->minor, ht_gemm_cpu_isa());
    double t0 = ht_time_seconds(), gflops[CANDIDATES] = {0};
    out->M = M;
    out->N = N;
    out->K = K;
    if (bf16 == HT_GEMM_KERNEL_AUTO || f16 == HT_GEMM_KERNEL_AUTO) {
        if (!rates_for(M, N, K, gflops))
            return ht_fail(err, HT_ERR_OOM, "out of memory timing the GEMM kernels on %lld x %lld x %lld", (long long)M,
                           (long long)N, (long long)K);
        ht_status st = ht_gemm_status(err); /* a product that could not run while timed */
        if (st != HT_OK) return st;
        out->f32_rate = gflops[CAND_F32];
    }
    ht_status s = choose_dtype(HT_DTYPE_BF16, bf16, gflops, out->bf16_rate, &out->bf16, err);
    if (s == HT_OK) s = choose_dtype(HT_DTYPE_F16, f16, gflops, out->f16_rate, &out->f16, err);
    out->seconds = ht_time_seconds() - t0;
    return s;
}

/* Before any ht_gemm_use: the choice ht_gemm_choose makes on a mid-sized product. */
static void choose_default(void) {
    ht_gemm_choice c;
    ht_error err;
    if (ht_gemm_choose(HT_GEMM_KERNEL_AUTO, HT_GEMM_KERNEL_AUTO, 1024, 1024, 1024, &c, &err) != HT_OK) {
        gemm_fail("%s", err.msg); /* the products that follow run on fp32_rounded, and ht_gemm_status says why */
        memset(&c, 0, sizeof(c));
        c.bf16 = c.f16 = HT_GEMM_KERNEL_FP32_ROUNDED;
    }
    pthread_mutex_lock(&g_gemm.lock);
    if (!g_gemm.chosen) {
        g_gemm.choice = c;
        g_gemm.chosen = true;
    }
    pthread_mutex_unlock(&g_gemm.lock);
}

void ht_gemm_use(const ht_gemm_choice *choice) {
    pthread_mutex_lock(&g_gemm.lock);
    g_gemm.choice = *choice;
    g_gemm.chosen = true;
    pthread_mutex_unlock(&g_gemm.lock);
}

ht_gemm_kernel ht_gemm_kernel_of(ht_dtype dtype) {
    if (dtype != HT_DTYPE_BF16 && dtype != HT_DTYPE_F16) return HT_GEMM_KERNEL_NATIVE;
    pthread_mutex_lock(&g_gemm.lock);
    bool chosen = g_gemm.chosen;
    pthread_mutex_unlock(&g_gemm.lock);
    if (!chosen) pthread_once(&g_gemm.choice_once, choose_default);
    pthread_mutex_lock(&g_gemm.lock);
    ht_gemm_kernel k = dtype == HT_DTYPE_BF16 ? g_gemm.choice.bf16 : g_gemm.choice.f16;
    pthread_mutex_unlock(&g_gemm.lock);
    return k;
}

ht_dtype ht_gemm_storage(ht_dtype precision) {
    return ht_gemm_kernel_of(precision) == HT_GEMM_KERNEL_FP32_ROUNDED ? HT_DTYPE_F32 : precision;
}

static const char *isa_name(dnnl_cpu_isa_t isa) {
    switch (isa) {
    case dnnl_cpu_isa_sse41: return "sse41";
    case dnnl_cpu_isa_avx: return "avx";
    case dnnl_cpu_isa_avx2: return "avx2";
    case dnnl_cpu_isa_avx2_vnni: return "avx2_vnni";
    case dnnl_cpu_isa_avx512_mic: return "avx512_mic";
    case dnnl_cpu_isa_avx512_mic_4ops: return "avx512_mic_4ops";
    case dnnl_cpu_isa_avx512_core: return "avx512_core";
    case dnnl_cpu_isa_avx512_core_vnni: return "avx512_core_vnni";
    case dnnl_cpu_isa_avx512_core_bf16: return "avx512_core_bf16";
    case dnnl_cpu_isa_avx512_core_amx: return "avx512_core_amx";
    default: return "unknown";
    }
}

const char *ht_gemm_cpu_isa(void) { return isa_name(dnnl_get_effective_cpu_isa()); }

static void describe_rates(char *buf, size_t n, const char *dtype, ht_gemm_kernel chosen, const double *rates,
                           bool measured) {
    if (!measured) {
        snprintf(buf, n, "%s %s (pinned, not measured)", dtype, KERNEL_LABELS[chosen]);
        return;
    }
    char native[32];
    if (rates[HT_GEMM_KERNEL_NATIVE] > 0)
        snprintf(native, sizeof(native), "%.0f", rates[HT_GEMM_KERNEL_NATIVE]);
    else
        snprintf(native, sizeof(native), "none");
    snprintf(buf, n, "%s %s (native %s, widened %.0f, fp32_rounded %.0f)", dtype, KERNEL_LABELS[chosen], native,
             rates[HT_GEMM_KERNEL_WIDENED], rates[HT_GEMM_KERNEL_FP32_ROUNDED]);
}

void ht_gemm_describe(const ht_gemm_choice *c, char *buf, size_t n) {
    char bf16[160], f16[160], shape[128] = "";
    describe_rates(bf16, sizeof(bf16), "bf16", c->bf16, c->bf16_rate, c->bf16_rate[HT_GEMM_KERNEL_WIDENED] > 0);
    describe_rates(f16, sizeof(f16), "f16", c->f16, c->f16_rate, c->f16_rate[HT_GEMM_KERNEL_WIDENED] > 0);
    if (c->f32_rate > 0)
        snprintf(shape, sizeof(shape), "; GFLOP/s on %lld x %lld x %lld, f32 %.0f, measured in %.2f s", (long long)c->M,
                 (long long)c->N, (long long)c->K, c->f32_rate, c->seconds);
    const dnnl_version_t *v = dnnl_version();
    snprintf(buf, n, "GEMM kernels: %s, %s%s; oneDNN %d.%d.%d, CPU ISA %s, %d threads", bf16, f16, shape, v->major,
             v->minor, v->patch, ht_gemm_cpu_isa(), omp_get_max_threads());
}

const char *ht_gemm_kernel_name(ht_dtype dtype) {
    if (dtype != HT_DTYPE_F32 && dtype != HT_DTYPE_BF16 && dtype != HT_DTYPE_F16)
        return "no GEMM kernel for this dtype";
    ht_gemm_kernel kernel = ht_gemm_kernel_of(dtype);
    pthread_mutex_lock(&g_gemm.lock);
    char *name = g_gemm.names[dtype];
    /* The implementation oneDNN picks for a typical decoder shape (2048
     * tokens × 512 hidden × 512); others may differ at the edges. */
    bool native = dtype == HT_DTYPE_F32 || kernel == HT_GEMM_KERNEL_NATIVE;
    gemm_key key = plain_key(native ? dtype : HT_DTYPE_F32, 2048, 512, 512);
    dnnl_primitive_desc_t pd;
    const char *impl = "?";
    dnnl_status_t s = matmul_pd_create(&key, &pd);
    if (s == dnnl_success) dnnl_primitive_desc_query(pd, dnnl_query_impl_info_str, 0, &impl);
    const char *what = dtype == HT_DTYPE_F32 ? "f32 x f32 -> f32"
                       : kernel == HT_GEMM_KERNEL_NATIVE
                           ? (dtype == HT_DTYPE_BF16 ? "bf16 x bf16 -> f32" : "f16 x f16 -> f32")
                       : kernel == HT_GEMM_KERNEL_WIDENED ? "widened to f32 in tiles, f32 x f32 -> f32"
                                                          : "f32 operands holding values of that precision, "
                                                            "f32 x f32 -> f32";
    const dnnl_version_t *v = dnnl_version();
    snprintf(name, sizeof(g_gemm.names[0]), "oneDNN %d.%d.%d matmul (%s), %s, CPU ISA %s", v->major, v->minor, v->patch,
             impl, what, ht_gemm_cpu_isa());
    if (s == dnnl_success) dnnl_primitive_desc_destroy(pd);
    pthread_mutex_unlock(&g_gemm.lock);
    return name;
}
