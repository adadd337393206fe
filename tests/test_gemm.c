/* ht_gemm against a float64 reference: every transpose pair, odd shapes,
 * padded leading dimensions, alpha and beta, each dtype and both of BF16's
 * paths (native matmul, widened to F32); the widened path's tiling; zero-size
 * dims; concurrent calls from inside an OpenMP parallel region; and batches
 * of products. */
#include "harness.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "kernels/cpu/gemm.h"

/* A (rows, cols) matrix with row stride ld, in `dtype`, filled from rng with
 * values in [-1, 1). `vals` gets the same values as float (after rounding to
 * dtype), which is what the reference multiplies. */
typedef struct matrix {
    void *data;
    float *vals;
    int64_t rows, cols, ld;
} matrix;

static matrix matrix_random(ht_rng *rng, int64_t rows, int64_t cols, int64_t ld, ht_dtype dtype) {
    matrix m = {.rows = rows, .cols = cols, .ld = ld};
    size_t n = (size_t)(rows * ld);
    m.vals = ht_alloc(n * sizeof(float));
    m.data = ht_alloc(n * ht_dtype_size(dtype));
    assert_non_null(m.vals);
    assert_non_null(m.data);
    for (size_t i = 0; i < n; i++) m.vals[i] = 2.0f * ht_rng_uniform(rng) - 1.0f;
    ht_convert(m.data, dtype, m.vals, HT_DTYPE_F32, n);
    ht_convert(m.vals, HT_DTYPE_F32, m.data, dtype, n);
    return m;
}

static void matrix_free(matrix *m) {
    ht_free(m->data);
    ht_free(m->vals);
}

typedef struct problem {
    bool trans_a, trans_b;
    int64_t M, N, K, pad; /* pad: extra elements at the end of every row of A, B and C */
    float alpha, beta;
    ht_dtype dtype;
    ht_gemm_path path; /* AUTO: ht_gemm itself */
} problem;

/* Runs one problem through ht_gemm and checks every element of C.
 *
 * The bound: A and B hold values exact in dtype, and the reference computes
 * in float64 from those same values, so the only error is ht_gemm's FP32
 * arithmetic. A dot product of K terms in FP32 (whatever the summation order or
 * blocking, FMA or not) is within K·u·Σ|a·b| of the exact value, u = 2^-24
 * (Higham, Accuracy and Stability, 3.1); bf16·bf16 and f16·f16 products are
 * exact in FP32, so for them that covers the additions alone. On top come a
 * few roundings for alpha·acc, beta·C and their sum, and two more per K-tile
 * the widened path accumulates into C (tiles of 1024). (2K + 8)·u covers all of it; a
 * real bug (a result rounded to bf16, a skipped block) is off by 2^-9 or more. */
static void run_problem(ht_rng *rng, const problem *p) {
    int64_t a_rows = p->trans_a ? p->K : p->M, a_cols = p->trans_a ? p->M : p->K;
    int64_t b_rows = p->trans_b ? p->N : p->K, b_cols = p->trans_b ? p->K : p->N;
    matrix a = matrix_random(rng, a_rows, a_cols, a_cols + p->pad, p->dtype);
    matrix b = matrix_random(rng, b_rows, b_cols, b_cols + p->pad, p->dtype);
    int64_t ldc = p->N + p->pad;
    size_t c_size = (size_t)(p->M * ldc);
    float *c = ht_alloc((c_size ? c_size : 1) * sizeof(float));
    float *c_old = ht_alloc((c_size ? c_size : 1) * sizeof(float));
    for (size_t i = 0; i < c_size; i++)
        c[i] = c_old[i] = p->beta == 0.0f ? NAN : 2.0f * ht_rng_uniform(rng) - 1.0f; /* beta = 0 must not read C */

    if (p->path == HT_GEMM_PATH_AUTO)
        ht_gemm(p->trans_a, p->trans_b, p->M, p->N, p->K, p->alpha, a.data, a.ld, b.data, b.ld, p->dtype, p->beta, c,
                ldc);
    else
        ht_gemm_on_path(p->path, p->trans_a, p->trans_b, p->M, p->N, p->K, p->alpha, a.data, a.ld, b.data, b.ld,
                        p->dtype, p->beta, c, ldc);

    double u = 0x1p-24, max_ref = 0, max_err = 0;
    for (int64_t m = 0; m < p->M; m++) {
        for (int64_t n = 0; n < p->N; n++) {
            double dot = 0, abs_dot = 0;
            for (int64_t k = 0; k < p->K; k++) {
                double av = p->trans_a ? a.vals[k * a.ld + m] : a.vals[m * a.ld + k];
                double bv = p->trans_b ? b.vals[n * b.ld + k] : b.vals[k * b.ld + n];
                dot += av * bv;
                abs_dot += fabs(av * bv);
            }
            double c0 = p->beta == 0.0f ? 0.0 : (double)c_old[m * ldc + n];
            double ref = p->alpha * dot + p->beta * c0;
            double bound = (2.0 * (double)p->K + 8.0) * u * (fabs(p->alpha) * abs_dot + fabs(p->beta * c0));
            double err = fabs((double)c[m * ldc + n] - ref);
            if (!(err <= bound))
                fail_msg("%s trans=(%d,%d) M=%lld N=%lld K=%lld pad=%lld alpha=%g beta=%g: C[%lld,%lld] = %.9g, "
                         "reference %.9g, error %.3g > bound %.3g",
                         ht_dtype_name(p->dtype), p->trans_a, p->trans_b, (long long)p->M, (long long)p->N,
                         (long long)p->K, (long long)p->pad, (double)p->alpha, (double)p->beta, (long long)m,
                         (long long)n, (double)c[m * ldc + n], ref, err, bound);
            if (fabs(ref) > max_ref) max_ref = fabs(ref);
            if (err > max_err) max_err = err;
        }
        /* The padding of C's rows is not part of C and must be untouched. */
        for (int64_t n = p->N; n < ldc; n++) {
            float was = c_old[m * ldc + n], now = c[m * ldc + n];
            if (!(now == was || (isnan(now) && isnan(was))))
                fail_msg("C's row padding was written at [%lld,%lld]", (long long)m, (long long)n);
        }
    }
    if (p->dtype == HT_DTYPE_F32 && max_ref > 0 && max_err / max_ref > 1e-5)
        fail_msg("f32 error %.3g relative to max |ref| exceeds 1e-5", max_err / max_ref);

    matrix_free(&a);
    matrix_free(&b);
    ht_free(c);
    ht_free(c_old);
}

/* Shapes with sizes 1, 7, 33 and 130 in every role. */
static const int64_t shapes[][3] = {{1, 1, 1}, {7, 33, 130}, {130, 7, 33}, {33, 130, 7}, {1, 130, 33}, {130, 1, 7}};

static void check_all_shapes(ht_dtype dtype, ht_gemm_path path) {
    ht_rng rng;
    ht_rng_seed(&rng, 1234 + (uint64_t)dtype);
    const float betas[] = {0.0f, 1.0f, 0.5f};
    for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
        for (int t = 0; t < 4; t++)
            for (int bi = 0; bi < 3; bi++)
                for (int pad = 0; pad <= 5; pad += 5) {
                    problem p = {.trans_a = t & 1,
                                 .trans_b = t >> 1,
                                 .M = shapes[s][0],
                                 .N = shapes[s][1],
                                 .K = shapes[s][2],
                                 .pad = pad,
                                 .alpha = pad ? -0.75f : 1.0f,
                                 .beta = betas[bi],
                                 .dtype = dtype,
                                 .path = path};
                    run_problem(&rng, &p);
                }
}

static void test_gemm_f32(void **state) {
    (void)state;
    check_all_shapes(HT_DTYPE_F32, HT_GEMM_PATH_AUTO);
}

/* Where oneDNN offers a native bf16 matmul (AVX512-BF16, AMX). */
static void test_gemm_bf16_matmul(void **state) {
    (void)state;
    if (use_gemm_kernel(HT_DTYPE_BF16, HT_GEMM_KERNEL_NATIVE)) check_all_shapes(HT_DTYPE_BF16, HT_GEMM_PATH_MATMUL);
}

static void test_gemm_bf16_widened(void **state) {
    (void)state;
    check_all_shapes(HT_DTYPE_BF16, HT_GEMM_PATH_WIDEN);
}

/* f16 widened always; natively where oneDNN offers an f16 matmul (AVX512-FP16). */
static void test_gemm_f16(void **state) {
    (void)state;
    check_all_shapes(HT_DTYPE_F16, HT_GEMM_PATH_WIDEN);
    if (use_gemm_kernel(HT_DTYPE_F16, HT_GEMM_KERNEL_NATIVE)) check_all_shapes(HT_DTYPE_F16, HT_GEMM_PATH_MATMUL);
    if (use_gemm_kernel(HT_DTYPE_F16, HT_GEMM_KERNEL_WIDENED)) check_all_shapes(HT_DTYPE_F16, HT_GEMM_PATH_AUTO);
}

/* ht_gemm_choose: measured kernels follow the rule (the fastest, where native
 * or widened must beat fp32_rounded by 5%); native is timed exactly where
 * oneDNN offers it, and pinning it there works while elsewhere it is an error
 * naming the CPU's ISA; a pinned kernel is not timed; ht_gemm follows
 * ht_gemm_use. */
static void check_choice(ht_gemm_kernel chosen, const double *rates, double f32_rate) {
    assert_true(chosen != HT_GEMM_KERNEL_AUTO);
    assert_true(rates[HT_GEMM_KERNEL_WIDENED] > 0);
    assert_true(rates[HT_GEMM_KERNEL_FP32_ROUNDED] == f32_rate);
    double best = f32_rate * 1.05;
    ht_gemm_kernel want = HT_GEMM_KERNEL_FP32_ROUNDED;
    for (ht_gemm_kernel k = HT_GEMM_KERNEL_NATIVE; k <= HT_GEMM_KERNEL_WIDENED; k++)
        if (rates[k] > best) {
            best = rates[k];
            want = k;
        }
    assert_int_equal(chosen, want);
}

static void test_gemm_choose(void **state) {
    (void)state;
    ht_gemm_choice c;
    ht_error err;
    assert_ht_ok(ht_gemm_choose(HT_GEMM_KERNEL_AUTO, HT_GEMM_KERNEL_AUTO, 512, 256, 256, &c, &err), &err);
    char line[512];
    ht_gemm_describe(&c, line, sizeof(line));
    printf("%s\n", line);
    assert_true(c.f32_rate > 0 && c.seconds > 0 && c.seconds < 1.0);
    check_choice(c.bf16, c.bf16_rate, c.f32_rate);
    check_choice(c.f16, c.f16_rate, c.f32_rate);
    assert_non_null(strstr(line, ht_gemm_kernel_label(c.bf16)));

    for (int d = 0; d < 2; d++) {
        bool offered = (d ? c.f16_rate : c.bf16_rate)[HT_GEMM_KERNEL_NATIVE] > 0;
        ht_gemm_choice pinned;
        ht_status s = ht_gemm_choose(d ? HT_GEMM_KERNEL_AUTO : HT_GEMM_KERNEL_NATIVE,
                                     d ? HT_GEMM_KERNEL_NATIVE : HT_GEMM_KERNEL_AUTO, 64, 64, 64, &pinned, &err);
        if (offered) {
            assert_ht_ok(s, &err);
            assert_int_equal(d ? pinned.f16 : pinned.bf16, HT_GEMM_KERNEL_NATIVE);
            assert_true((d ? pinned.f16_rate : pinned.bf16_rate)[HT_GEMM_KERNEL_NATIVE] == 0); /* not timed */
        } else {
            assert_int_equal(s, HT_ERR_CONFIG);
            assert_non_null(strstr(err.msg, d ? "kernels.f16_gemm" : "kernels.bf16_gemm"));
            assert_non_null(strstr(err.msg, ht_gemm_cpu_isa()));
        }
    }

    assert_ht_ok(ht_gemm_choose(HT_GEMM_KERNEL_FP32_ROUNDED, HT_GEMM_KERNEL_WIDENED, 64, 64, 64, &c, &err), &err);
    assert_true(c.f32_rate == 0 && c.bf16_rate[HT_GEMM_KERNEL_WIDENED] == 0);
    ht_gemm_use(&c);
    assert_int_equal(ht_gemm_kernel_of(HT_DTYPE_BF16), HT_GEMM_KERNEL_FP32_ROUNDED);
    assert_int_equal(ht_gemm_storage(HT_DTYPE_BF16), HT_DTYPE_F32);
    assert_int_equal(ht_gemm_storage(HT_DTYPE_F16), HT_DTYPE_F16);
    assert_int_equal(ht_gemm_storage(HT_DTYPE_F32), HT_DTYPE_F32);
    assert_non_null(strstr(ht_gemm_kernel_name(HT_DTYPE_BF16), "f32 operands holding values"));
    assert_non_null(strstr(ht_gemm_kernel_name(HT_DTYPE_F16), "widened"));
    assert_int_equal(ht_gemm_choose(HT_GEMM_KERNEL_AUTO, HT_GEMM_KERNEL_AUTO, 0, 64, 64, &c, &err), HT_ERR_INVALID);
}

/* The widened path cuts M and N into tiles of 2048 and K into tiles of 1024,
 * accumulating the K-tiles into C. */
static void test_gemm_widened_tiles(void **state) {
    (void)state;
    ht_rng rng;
    ht_rng_seed(&rng, 99);
    const int64_t sizes[][3] = {{9, 17, 2100}, {2050, 3, 5}, {3, 2050, 5}};
    for (int d = 0; d < 2; d++)
        for (size_t s = 0; s < 3; s++)
            for (int t = 0; t < 4; t++) {
                problem p = {.trans_a = t & 1,
                             .trans_b = t >> 1,
                             .M = sizes[s][0],
                             .N = sizes[s][1],
                             .K = sizes[s][2],
                             .pad = 3,
                             .alpha = 0.5f,
                             .beta = t == 0 ? 0.0f : 0.5f,
                             .dtype = d ? HT_DTYPE_BF16 : HT_DTYPE_F16,
                             .path = HT_GEMM_PATH_WIDEN};
                run_problem(&rng, &p);
            }
}

/* M, N or K = 0: nothing to do, or (K = 0) C = beta·C, NaN cleared by beta = 0. */
static void test_gemm_zero_sizes(void **state) {
    (void)state;
    ht_rng rng;
    ht_rng_seed(&rng, 7);
    const int64_t sizes[][3] = {{0, 5, 3}, {5, 0, 3}, {5, 3, 0}, {0, 0, 0}};
    for (size_t s = 0; s < 4; s++)
        for (int d = 0; d < 3; d++)
            for (int bi = 0; bi < 2; bi++) {
                problem p = {.M = sizes[s][0],
                             .N = sizes[s][1],
                             .K = sizes[s][2],
                             .pad = 2,
                             .alpha = 1.0f,
                             .beta = bi ? 0.5f : 0.0f,
                             .dtype = (ht_dtype[]){HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_F16}[d]};
                run_problem(&rng, &p);
            }
}

/* A product that cannot run is recorded, not fatal: the process lives, C is
 * left alone (its layout is not to be trusted), ht_gemm_status names the
 * failure from then on, and valid products still compute. In a child, since
 * the failure is sticky for the process. */
static void test_gemm_failure_is_reported(void **state) {
    (void)state;
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        ht_error err;
        float A[6] = {1, 2, 3, 4, 5, 6}, B[6] = {1, 0, 0, 1, 1, 1}, C[4] = {7, 7, 7, 7};
        bool ok = ht_gemm_status(&err) == HT_OK;
        ht_gemm(false, false, 2, 2, 3, 1.0f, A, 3, B, 2, HT_DTYPE_F32, 0.0f, C, 1); /* ldc 1 < N 2 */
        ok = ok && C[0] == 7 && C[3] == 7;
        ok = ok && ht_gemm_status(&err) != HT_OK && strstr(err.msg, "invalid shape") && strstr(err.msg, "ldc=1");
        ht_gemm(false, false, 2, 2, 3, 1.0f, A, 3, B, 2, HT_DTYPE_F32, 0.0f, C, 2);
        ok = ok && C[0] == 4 && C[1] == 5 && C[2] == 10 && C[3] == 11;
        ok = ok && ht_gemm_status(&err) != HT_OK; /* still reported */
        if (!ok) fprintf(stderr, "failure path: C = %g %g %g %g, status '%s'\n", C[0], C[1], C[2], C[3], err.msg);
        _exit(ok ? 0 : 1);
    }
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    if (!WIFEXITED(status))
        fail_msg("the child died of signal %d: a failed product must not end the process",
                 WIFSIGNALED(status) ? WTERMSIG(status) : -1);
    assert_int_equal(WEXITSTATUS(status), 0);
}

/* As the model's attention does: 16 independent problems from a parallel for.
 * Each call must run whole on its thread; a GEMM that split its work for two
 * threads but ran on one would leave part of C unwritten (NaN here). */
static void test_gemm_inside_parallel_region(void **state) {
    (void)state;
    enum { PROBLEMS = 16, M = 96, N = 80, K = 64 };
    /* ht_gemm in f32 and bf16 (the kernel chosen here), and bf16 on the native matmul. */
    const ht_dtype dtypes[] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_BF16};
    const ht_gemm_path paths[] = {HT_GEMM_PATH_AUTO, HT_GEMM_PATH_AUTO, HT_GEMM_PATH_MATMUL};
    bool native = use_gemm_kernel(HT_DTYPE_BF16, HT_GEMM_KERNEL_NATIVE);
    for (int d = 0; d < (native ? 3 : 2); d++) {
        ht_dtype dtype = dtypes[d];
        ht_rng rng;
        ht_rng_seed(&rng, 31 + (uint64_t)d);
        matrix a[PROBLEMS], b[PROBLEMS];
        float *c[PROBLEMS];
        for (int i = 0; i < PROBLEMS; i++) {
            a[i] = matrix_random(&rng, M, K, K, dtype);
            b[i] = matrix_random(&rng, N, K, K, dtype); /* (N, K): used transposed, as K^T in Q·K^T */
            c[i] = ht_alloc(M * N * sizeof(float));
            for (int j = 0; j < M * N; j++) c[i][j] = NAN;
        }
        int threads_seen = 0;
        /* 4 threads whatever OMP_NUM_THREADS says, so that calls overlap. */
#pragma omp parallel for num_threads(4) schedule(dynamic, 1) reduction(max : threads_seen)
        for (int i = 0; i < PROBLEMS; i++) {
            ht_gemm_on_path(paths[d], false, true, M, N, K, 0.125f, a[i].data, K, b[i].data, K, dtype, 0.0f, c[i], N);
            threads_seen = omp_get_num_threads();
        }
        assert_true(threads_seen > 1);
        for (int i = 0; i < PROBLEMS; i++) {
            for (int m = 0; m < M; m++)
                for (int n = 0; n < N; n++) {
                    double dot = 0, abs_dot = 0;
                    for (int k = 0; k < K; k++) {
                        dot += (double)a[i].vals[m * K + k] * b[i].vals[n * K + k];
                        abs_dot += fabs((double)a[i].vals[m * K + k] * b[i].vals[n * K + k]);
                    }
                    double err = fabs((double)c[i][m * N + n] - 0.125 * dot);
                    if (!(err <= (2.0 * K + 8.0) * 0x1p-24 * 0.125 * abs_dot))
                        fail_msg("%s path %d problem %d: C[%d,%d] = %g, reference %g", ht_dtype_name(dtype), paths[d],
                                 i, m, n, (double)c[i][m * N + n], 0.125 * dot);
                }
            matrix_free(&a[i]);
            matrix_free(&b[i]);
            ht_free(c[i]);
        }
    }
}

/* ht_gemm_batched: 3 products of one shape, each operand `gap` elements
 * past the one before's end, every transpose pair, f32 and bf16 on the
 * native matmul (where this CPU has one) and widened (one product at a
 * time); each product within run_problem's bound of float64, and the gaps
 * between the outputs untouched. */
static void test_gemm_batched(void **state) {
    (void)state;
    enum { BATCH = 3, GAP = 11 };
    static const int64_t dims[][3] = {{7, 33, 130}, {130, 7, 33}, {24, 24, 300}};
    const ht_dtype dtypes[] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_BF16};
    const ht_gemm_kernel kernels[] = {HT_GEMM_KERNEL_NATIVE, HT_GEMM_KERNEL_NATIVE, HT_GEMM_KERNEL_WIDENED};
    ht_rng rng;
    ht_rng_seed(&rng, 77);
    for (int d = 0; d < 3; d++) {
        if (d > 0 && !use_gemm_kernel(HT_DTYPE_BF16, kernels[d])) continue;
        for (size_t s = 0; s < sizeof(dims) / sizeof(dims[0]); s++)
            for (int t = 0; t < 4; t++) {
                const bool ta = t & 1, tb = t >> 1;
                const int64_t M = dims[s][0], N = dims[s][1], K = dims[s][2];
                const int64_t sa = M * K + GAP, sb = K * N + GAP, sc = M * N + GAP;
                const float alpha = 0.5f, beta = t == 3 ? 0.25f : 0.0f;
                matrix a = matrix_random(&rng, BATCH, sa, sa, dtypes[d]),
                       b = matrix_random(&rng, BATCH, sb, sb, dtypes[d]);
                float *c = ht_alloc((size_t)(BATCH * sc) * sizeof(float)),
                      *c_old = ht_alloc((size_t)(BATCH * sc) * sizeof(float));
                for (int64_t i = 0; i < BATCH * sc; i++) c[i] = c_old[i] = 2.0f * ht_rng_uniform(&rng) - 1.0f;
                ht_gemm_batched(BATCH, ta, tb, M, N, K, alpha, a.data, ta ? M : K, sa, b.data, tb ? K : N, sb,
                                dtypes[d], beta, c, N, sc);
                for (int e = 0; e < BATCH; e++) {
                    const float *av = a.vals + e * sa, *bv = b.vals + e * sb, *ce = c + e * sc, *co = c_old + e * sc;
                    for (int64_t m = 0; m < M; m++)
                        for (int64_t n = 0; n < N; n++) {
                            double dot = 0, abs_dot = 0;
                            for (int64_t k = 0; k < K; k++) {
                                double x = ta ? av[k * M + m] : av[m * K + k], y = tb ? bv[n * K + k] : bv[k * N + n];
                                dot += x * y;
                                abs_dot += fabs(x * y);
                            }
                            double c0 = beta == 0.0f ? 0.0 : co[m * N + n], ref = alpha * dot + beta * c0;
                            double bound = (2.0 * K + 8.0) * 0x1p-24 * (alpha * abs_dot + fabs(beta * c0));
                            if (!(fabs(ce[m * N + n] - ref) <= bound))
                                fail_msg(
                                    "%s trans=(%d,%d) %lldx%lldx%lld product %d: C[%lld,%lld] = %.9g, reference %.9g",
                                    ht_dtype_name(dtypes[d]), ta, tb, (long long)M, (long long)N, (long long)K, e,
                                    (long long)m, (long long)n, (double)ce[m * N + n], ref);
                        }
                    for (int64_t i = M * N; i < sc; i++) assert_true(ce[i] == co[i]); /* the gap */
                }
                matrix_free(&a);
                matrix_free(&b);
                ht_free(c);
                ht_free(c_old);
            }
    }
}

static void test_gemm_kernel_names(void **state) {
    (void)state;
    const ht_dtype dtypes[] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_F16};
    for (int d = 0; d < 3; d++) {
        const char *name = ht_gemm_kernel_name(dtypes[d]);
        assert_non_null(strstr(name, "oneDNN"));
        ht_log_info("%s GEMM: %s", ht_dtype_name(dtypes[d]), name);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gemm_f32),
        cmocka_unit_test(test_gemm_bf16_matmul),
        cmocka_unit_test(test_gemm_bf16_widened),
        cmocka_unit_test(test_gemm_f16),
        cmocka_unit_test(test_gemm_widened_tiles),
        cmocka_unit_test(test_gemm_zero_sizes),
        cmocka_unit_test(test_gemm_inside_parallel_region),
        cmocka_unit_test(test_gemm_kernel_names),
        cmocka_unit_test(test_gemm_batched),
        cmocka_unit_test(test_gemm_failure_is_reported),
        cmocka_unit_test(test_gemm_choose),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
