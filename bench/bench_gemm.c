/* GEMM throughput on the decoder's linear-layer shapes: 2048 tokens, hidden
 * 512, outputs 512 / 1408 / 8192, in the three forms a linear layer runs
 * (forward, backward to the input, backward to the weight): ht_gemm's f32
 * matmul (which fp32_rounded bf16 operands run on), dnnl_sgemm as a
 * yardstick, and bf16 natively (where oneDNN offers it) and widened. First
 * line: the kernels ht_gemm_choose picks here, with the rates it measured. */
#include <dnnl.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/gemm.h"

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

/* What runs a GEMM: ht_gemm on a path, or dnnl_sgemm directly. */
typedef struct runner {
    const char *name;
    ht_dtype dtype;
    ht_gemm_path path;
    bool sgemm;
} runner;

static void run_once(const gemm_shape *s, const operands *o, const runner *r) {
    if (r->sgemm)
        dnnl_sgemm(s->trans_a ? 'T' : 'N', s->trans_b ? 'T' : 'N', s->M, s->N, s->K, 1.0f, o->A, o->lda, o->B, o->ldb,
                   0.0f, o->C, s->N);
    else
        ht_gemm_on_path(r->path, s->trans_a, s->trans_b, s->M, s->N, s->K, 1.0f, o->A, o->lda, o->B, o->ldb, r->dtype,
                        0.0f, o->C, s->N);
}

/* GFLOP/s of each runner on one shape: the fastest of its calls, taken in
 * turns (one call of each runner per round, at least 5 rounds spanning at
 * least 1.5 s) after one untimed call that pays primitive creation and first
 * touch. Turns and the fastest call, because the 2-core machine is shared:
 * runners timed one after the other, or a mean, measure the neighbours too. */
enum { RUNNERS = 4 };
static void measure(const gemm_shape *s, const runner *runners, int n, double *gflops, ht_rng *rng) {
    operands o[RUNNERS];
    double best[RUNNERS];
    for (int r = 0; r < n; r++) {
        o[r] = operands_make(s, runners[r].dtype, rng);
        run_once(s, &o[r], &runners[r]);
        best[r] = INFINITY;
    }
    double start = ht_time_seconds();
    for (int round = 0; round < 5 || ht_time_seconds() - start < 1.5; round++) {
        for (int r = 0; r < n; r++) {
            double t0 = ht_time_seconds();
            run_once(s, &o[r], &runners[r]);
            double t = ht_time_seconds() - t0;
            if (t < best[r]) best[r] = t;
        }
    }
    for (int r = 0; r < n; r++) {
        gflops[r] = 2.0 * (double)s->M * (double)s->N * (double)s->K / best[r] * 1e-9;
        operands_free(&o[r]);
    }
}

int main(void) {
    const int64_t tokens = 2048, hidden = 512, outs[] = {512, 1408, 8192};
    ht_rng rng;
    ht_rng_seed(&rng, 42);
    ht_gemm_choice choice;
    ht_error err;
    if (ht_gemm_choose(HT_GEMM_KERNEL_AUTO, HT_GEMM_KERNEL_AUTO, tokens, hidden, hidden, &choice, &err) != HT_OK) {
        fprintf(stderr, "bench_gemm: %s\n", err.msg);
        return 1;
    }
    char line[512];
    ht_gemm_describe(&choice, line, sizeof(line));
    printf("%s\n\n", line);
    runner runners[RUNNERS];
    int n = 0;
    runners[n++] = (runner){"f32", HT_DTYPE_F32, HT_GEMM_PATH_MATMUL, false};
    runners[n++] = (runner){"sgemm", HT_DTYPE_F32, HT_GEMM_PATH_MATMUL, true};
    if (choice.bf16_rate[HT_GEMM_KERNEL_NATIVE] > 0) /* oneDNN offers it here */
        runners[n++] = (runner){"bf16 native", HT_DTYPE_BF16, HT_GEMM_PATH_MATMUL, false};
    runners[n++] = (runner){"bf16 widened", HT_DTYPE_BF16, HT_GEMM_PATH_WIDEN, false};
    printf("%-34s %18s", "GFLOP/s   form (op)", "M x N x K");
    for (int r = 0; r < n; r++) printf(" %12s", runners[r].name);
    printf("\n");
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
            double gflops[RUNNERS];
            snprintf(dims, sizeof(dims), "%lld x %lld x %lld", (long long)s->M, (long long)s->N, (long long)s->K);
            measure(s, runners, n, gflops, &rng);
            printf("%-34s %18s", s->form, dims);
            for (int r = 0; r < n; r++) printf(" %12.1f", gflops[r]);
            printf("\n");
            fflush(stdout);
        }
    }
    return 0;
}
