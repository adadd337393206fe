/* GEMM throughput on the decoder's linear-layer shapes: 2048 tokens, hidden
 * 512, outputs 512 / 1408 / 8192, in the three forms a linear layer runs
 * (forward, backward to the input, backward to the weight). dnnl_sgemm is
 * timed next to ht_gemm's f32 path as the yardstick that path has to beat. */
#include <dnnl.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "hypertrain/kernels.h"

typedef struct gemm_shape {
    const char *form;
    bool trans_a, trans_b;
    int64_t M, N, K;
} gemm_shape;

typedef struct operands {
    void *A, *B;
    float *C;
    int64_t lda, ldb;
} operands;

static operands operands_make(const gemm_shape *s, ht_dtype dtype, ht_rng *rng) {
    operands o;
    size_t a_n = (size_t)(s->M * s->K), b_n = (size_t)(s->K * s->N);
    float *tmp = malloc((a_n > b_n ? a_n : b_n) * sizeof(float));
    o.A = ht_alloc(a_n * ht_dtype_size(dtype));
    o.B = ht_alloc(b_n * ht_dtype_size(dtype));
    o.C = ht_alloc((size_t)(s->M * s->N) * sizeof(float));
    if (!tmp || !o.A || !o.B || !o.C) {
        fprintf(stderr, "bench_gemm: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < a_n; i++) tmp[i] = ht_rng_normal(rng);
    ht_convert(o.A, dtype, tmp, HT_DTYPE_F32, a_n);
    for (size_t i = 0; i < b_n; i++) tmp[i] = ht_rng_normal(rng);
    ht_convert(o.B, dtype, tmp, HT_DTYPE_F32, b_n);
    free(tmp);
    o.lda = s->trans_a ? s->M : s->K;
    o.ldb = s->trans_b ? s->K : s->N;
    return o;
}

static void operands_free(operands *o) {
    ht_free(o->A);
    ht_free(o->B);
    ht_free(o->C);
}

/* One GEMM, through ht_gemm or (use_sgemm) straight through dnnl_sgemm. */
static void run_once(const gemm_shape *s, const operands *o, ht_dtype dtype, bool use_sgemm) {
    if (use_sgemm)
        dnnl_sgemm(s->trans_a ? 'T' : 'N', s->trans_b ? 'T' : 'N', s->M, s->N, s->K, 1.0f, o->A, o->lda, o->B, o->ldb,
                   0.0f, o->C, s->N);
    else
        ht_gemm(s->trans_a, s->trans_b, s->M, s->N, s->K, 1.0f, o->A, o->lda, o->B, o->ldb, dtype, 0.0f, o->C, s->N);
}

/* GFLOP/s of the fastest of at least 5 calls spanning at least 0.5 s, after
 * one untimed call that pays primitive creation and first touch. The fastest,
 * not the mean, because the 2-core machine is shared and a mean measures the
 * neighbours too. */
static double gflops(const gemm_shape *s, ht_dtype dtype, bool use_sgemm, ht_rng *rng) {
    operands o = operands_make(s, dtype, rng);
    run_once(s, &o, dtype, use_sgemm);
    double best = INFINITY, start = ht_time_seconds();
    for (int reps = 0; reps < 5 || ht_time_seconds() - start < 0.5; reps++) {
        double t0 = ht_time_seconds();
        run_once(s, &o, dtype, use_sgemm);
        double t = ht_time_seconds() - t0;
        if (t < best) best = t;
    }
    operands_free(&o);
    return 2.0 * (double)s->M * (double)s->N * (double)s->K / best * 1e-9;
}

int main(void) {
    const int64_t tokens = 2048, hidden = 512, outs[] = {512, 1408, 8192};
    ht_rng rng;
    ht_rng_seed(&rng, 42);
    printf("threads: %d\nf32:  %s\nbf16: %s\nf16:  %s\n\n", omp_get_max_threads(), ht_gemm_kernel_name(HT_DTYPE_F32),
           ht_gemm_kernel_name(HT_DTYPE_BF16), ht_gemm_kernel_name(HT_DTYPE_F16));
    printf("%-34s %18s %10s %10s %10s\n", "GFLOP/s   form (op)", "M x N x K", "f32", "sgemm", "bf16");
    for (int i = 0; i < 3; i++) {
        int64_t out = outs[i];
        /* Y = X·W^T with the weight stored (out, hidden); dX = dY·W; dW = dY^T·X. */
        const gemm_shape shapes[] = {{"forward        Y = X W^T  (NT)", false, true, tokens, out, hidden},
                                     {"forward        Y = X W    (NN)", false, false, tokens, out, hidden},
                                     {"backward input dX = dY W  (NN)", false, false, tokens, hidden, out},
                                     {"backward wgt   dW = dY^T X(TN)", true, false, out, hidden, tokens}};
        for (size_t j = 0; j < sizeof(shapes) / sizeof(shapes[0]); j++) {
            const gemm_shape *s = &shapes[j];
            char dims[64];
            snprintf(dims, sizeof(dims), "%lld x %lld x %lld", (long long)s->M, (long long)s->N, (long long)s->K);
            double f32 = gflops(s, HT_DTYPE_F32, false, &rng);
            double sgemm = gflops(s, HT_DTYPE_F32, true, &rng);
            double bf16 = gflops(s, HT_DTYPE_BF16, false, &rng);
            printf("%-34s %18s %10.1f %10.1f %10.1f\n", s->form, dims, f32, sgemm, bf16);
            fflush(stdout);
        }
    }
    return 0;
}
