/* The tiled causal attention alone (kernels/cpu/attention.c), forward and
 * backward, at one shape: GFLOP/s counted as the causal half of its products
 * (forward 2, backward 5 of T²/2 x D each per head: QK, PV; QK again, dV, dP,
 * dQ, dK), against the FP32 GEMM rate on a (T, D) x (D, T) product.
 * --dtype bfloat16 / float16: the products on operands of that dtype, as a
 * 16-bit model's attention runs them.
 * usage: bench_attention [--seq T] [--dim D] [--heads H] [--kv KV] [--batch B] [--reps N] [--dtype D] */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

int main(int argc, char **argv) {
    ht_openmp_settle(argv);
    int64_t T = 2048, D = 64, H = 8, KV = 2, B = 1;
    int reps = 3;
    ht_dtype dtype = HT_DTYPE_F32;
    for (int i = 1; i + 1 < argc; i += 2) {
        int64_t v = atoll(argv[i + 1]);
        if (strcmp(argv[i], "--dtype") == 0 && ht_dtype_from_name(argv[i + 1], &dtype) && ht_dtype_is_float(dtype))
            continue;
        if (strcmp(argv[i], "--seq") == 0)
            T = v;
        else if (strcmp(argv[i], "--dim") == 0)
            D = v;
        else if (strcmp(argv[i], "--heads") == 0)
            H = v;
        else if (strcmp(argv[i], "--kv") == 0)
            KV = v;
        else if (strcmp(argv[i], "--batch") == 0)
            B = v;
        else if (strcmp(argv[i], "--reps") == 0)
            reps = (int)v;
        else {
            fprintf(stderr,
                    "usage: %s [--seq T] [--dim D] [--heads H] [--kv KV] [--batch B] [--reps N] "
                    "[--dtype float32|bfloat16|float16]\n",
                    argv[0]);
            return 2;
        }
    }
    size_t nq = (size_t)(B * T * H * D), nk = (size_t)(B * T * KV * D);
    float *q = ht_alloc(nq * 4), *k = ht_alloc(nk * 4), *v = ht_alloc(nk * 4), *o = ht_alloc(nq * 4);
    float *dout = ht_alloc(nq * 4), *dq = ht_alloc(nq * 4), *dk = ht_alloc(nk * 4), *dv = ht_alloc(nk * 4);
    float *lse = ht_alloc((size_t)(B * H * T) * 4);
    float *work = ht_alloc((size_t)omp_get_max_threads() * ht_attention_workspace_floats(T, D, D) * 4);
    if (!q || !k || !v || !o || !dout || !dq || !dk || !dv || !lse || !work) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    ht_rng rng;
    ht_rng_seed(&rng, 1);
    for (size_t i = 0; i < nq; i++) q[i] = ht_rng_normal(&rng), dout[i] = ht_rng_normal(&rng);
    for (size_t i = 0; i < nk; i++) k[i] = ht_rng_normal(&rng), v[i] = ht_rng_normal(&rng);
    const ht_attention_shape shape = {
        .B = B, .T = T, .H = H, .KV = KV, .Dk = D, .Dv = D, .scale = 1.0f / sqrtf((float)D)};
    double fwd = 1e30, bwd = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = ht_time_seconds();
        ht_attention_forward(o, lse, NULL, q, k, v, &shape, dtype, work);
        double t1 = ht_time_seconds();
        ht_attention_backward(dq, dk, dv, dout, o, lse, q, k, v, &shape, dtype, work);
        double t2 = ht_time_seconds();
        fwd = t1 - t0 < fwd ? t1 - t0 : fwd;
        bwd = t2 - t1 < bwd ? t2 - t1 : bwd;
    }
    double half = (double)B * H * T * T / 2 * D * 2; /* one causal-half product, all heads */
    /* The FP32 GEMM rate on a score-sized product for comparison. */
    float *c = ht_alloc((size_t)(T * T) * 4);
    double g = 1e30;
    for (int r = 0; r < reps && c; r++) {
        double t0 = ht_time_seconds();
        ht_gemm(false, true, T, T, D, 1.0f, q, H * D, k, KV * D, HT_DTYPE_F32, 0.0f, c, T);
        g = ht_time_seconds() - t0 < g ? ht_time_seconds() - t0 : g;
    }
    printf("{\"bench\": \"attention\", \"dtype\": \"%s\", \"threads\": %d, \"B\": %lld, \"T\": %lld, \"H\": %lld, "
           "\"KV\": %lld, \"D\": %lld, "
           "\"forward_ms\": %.2f, \"backward_ms\": %.2f, \"forward_gflops\": %.1f, \"backward_gflops\": %.1f, "
           "\"gemm_gflops\": %.1f}\n",
           ht_dtype_name(dtype), omp_get_max_threads(), (long long)B, (long long)T, (long long)H, (long long)KV,
           (long long)D, fwd * 1e3, bwd * 1e3, 2 * half / fwd / 1e9, 5 * half / bwd / 1e9, 2.0 * T * T * D / g / 1e9);
    return 0;
}
