/* The kernels against plain references written for clarity, in double, on
 * odd sizes: the tiled causal attention (forward, backward, QK-clip's
 * maximum) at sequence lengths inside one tile, across tiles and ending
 * mid-tile, with grouped-query heads. */
#include "harness.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/ops.h"

static void fill_normal(float *x, size_t n, uint64_t seed, float std) {
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) x[i] = std * ht_rng_normal(&rng);
}

/* Causal attention of one (batch, head) in double, the textbook way: the
 * whole (T, T) score matrix, softmax, then each gradient from its formula.
 * Rows of q, dout, out, dq have stride qs; rows of k, v, dk, dv stride ks.
 * dk and dv are added to (query heads share a key head). */
static void reference_head(const float *q, const float *k, const float *v, const float *dout, int T, int D, int qs,
                           int ks, double *out, double *dq, double *dk, double *dv, double *head_max) {
    double scale = 1.0 / sqrt((double)D);
    double *p = malloc((size_t)T * T * sizeof(double)), *dp = malloc((size_t)T * T * sizeof(double));
    for (int i = 0; i < T; i++) {
        double mx = -INFINITY;
        for (int j = 0; j < T; j++) {
            double s = 0;
            for (int c = 0; c < D; c++) s += (double)q[i * qs + c] * k[j * ks + c];
            s *= scale;
            *head_max = s > *head_max ? s : *head_max; /* masked positions count (QK-clip) */
            p[i * T + j] = s;
            if (j <= i) mx = s > mx ? s : mx;
        }
        double sum = 0;
        for (int j = 0; j <= i; j++) sum += p[i * T + j] = exp(p[i * T + j] - mx);
        for (int j = 0; j < T; j++) p[i * T + j] = j <= i ? p[i * T + j] / sum : 0.0;
    }
    for (int i = 0; i < T; i++)
        for (int c = 0; c < D; c++) {
            double o = 0;
            for (int j = 0; j <= i; j++) o += p[i * T + j] * v[j * ks + c];
            out[i * D + c] = o;
        }
    /* dP = dO vᵀ, dS = P ∘ (dP − rowsum(P ∘ dP)). */
    for (int i = 0; i < T; i++) {
        double dot = 0;
        for (int j = 0; j <= i; j++) {
            double g = 0;
            for (int c = 0; c < D; c++) g += (double)dout[i * qs + c] * v[j * ks + c];
            dp[i * T + j] = g;
            dot += p[i * T + j] * g;
        }
        for (int j = 0; j < T; j++) dp[i * T + j] = j <= i ? p[i * T + j] * (dp[i * T + j] - dot) : 0.0;
    }
    for (int i = 0; i < T; i++)
        for (int c = 0; c < D; c++) {
            double g = 0;
            for (int j = 0; j <= i; j++) g += dp[i * T + j] * k[j * ks + c];
            dq[i * D + c] = scale * g;
        }
    for (int j = 0; j < T; j++)
        for (int c = 0; c < D; c++) {
            double gk = 0, gv = 0;
            for (int i = j; i < T; i++) {
                gk += dp[i * T + j] * q[i * qs + c];
                gv += p[i * T + j] * dout[i * qs + c];
            }
            dk[j * D + c] += scale * gk;
            dv[j * D + c] += gv;
        }
    free(p);
    free(dp);
}

/* max |a - ref| / max |ref| over n values. */
static double rel_err_double(const float *a, int64_t stride_a, const double *ref, int64_t rows, int64_t cols) {
    double num = 0, den = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) {
            num = fmax(num, fabs(a[r * stride_a + c] - ref[r * cols + c]));
            den = fmax(den, fabs(ref[r * cols + c]));
        }
    return den > 0 ? num / den : num;
}

static void check_attention(int B, int T, int H, int KV, int D) {
    int64_t qs = (int64_t)H * D, ks = (int64_t)KV * D, nq = (int64_t)B * T * qs, nk = (int64_t)B * T * ks;
    float *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float)), *v = malloc(nk * sizeof(float));
    float *dout = malloc(nq * sizeof(float)), *out = malloc(nq * sizeof(float)), *dq = malloc(nq * sizeof(float));
    float *dk = malloc(nk * sizeof(float)), *dv = malloc(nk * sizeof(float));
    float *lse = malloc((size_t)B * H * T * sizeof(float)), *head_max = malloc((size_t)B * H * sizeof(float));
    float *work = malloc((size_t)omp_get_max_threads() * ht_attention_workspace_floats(D) * sizeof(float));
    /* Scores of a few units: the softmax is neither flat nor one-hot. */
    fill_normal(q, nq, 1 + T, 1.5f);
    fill_normal(k, nk, 2 + T, 1.5f);
    fill_normal(v, nk, 3 + T, 1.0f);
    fill_normal(dout, nq, 4 + T, 1.0f);
    ht_attention_forward(out, lse, head_max, q, k, v, B, T, H, KV, D, work);
    ht_attention_backward(dq, dk, dv, dout, out, lse, q, k, v, B, T, H, KV, D, work);

    double *ro = malloc((size_t)T * D * sizeof(double)), *rq = malloc((size_t)T * D * sizeof(double));
    double *rk = calloc((size_t)T * D, sizeof(double)), *rv = calloc((size_t)T * D, sizeof(double));
    double worst[4] = {0};
    for (int b = 0; b < B; b++)
        for (int g = 0; g < KV; g++) {
            memset(rk, 0, (size_t)T * D * sizeof(double));
            memset(rv, 0, (size_t)T * D * sizeof(double));
            for (int h = g * (H / KV); h < (g + 1) * (H / KV); h++) {
                int64_t qo = (int64_t)b * T * qs + (int64_t)h * D, ko = (int64_t)b * T * ks + (int64_t)g * D;
                double mx = -INFINITY;
                reference_head(q + qo, k + ko, v + ko, dout + qo, T, D, (int)qs, (int)ks, ro, rq, rk, rv, &mx);
                worst[0] = fmax(worst[0], rel_err_double(out + qo, qs, ro, T, D));
                worst[1] = fmax(worst[1], rel_err_double(dq + qo, qs, rq, T, D));
                if (fabs(head_max[b * H + h] - mx) > 1e-5 * fabs(mx))
                    fail_msg("B%d T%d H%d KV%d D%d: head %d max logit %.9g, reference %.9g", B, T, H, KV, D, h,
                             head_max[b * H + h], mx);
            }
            int64_t ko = (int64_t)b * T * ks + (int64_t)g * D;
            worst[2] = fmax(worst[2], rel_err_double(dk + ko, ks, rk, T, D));
            worst[3] = fmax(worst[3], rel_err_double(dv + ko, ks, rv, T, D));
        }
    static const char *const names[] = {"out", "dq", "dk", "dv"};
    for (int i = 0; i < 4; i++)
        if (!(worst[i] <= 1e-5))
            fail_msg("B%d T%d H%d KV%d D%d: %s off the reference by %.3g (bound 1e-5)", B, T, H, KV, D, names[i],
                     worst[i]);
    printf("attention B%d T%-4d H%d KV%d D%-3d: out %.2g, dq %.2g, dk %.2g, dv %.2g of the double reference\n", B, T, H,
           KV, D, worst[0], worst[1], worst[2], worst[3]);

    /* Without QK-clip's maximum the same numbers come out (the masked tiles only feed it). */
    float *out2 = malloc(nq * sizeof(float)), *lse2 = malloc((size_t)B * H * T * sizeof(float));
    ht_attention_forward(out2, lse2, NULL, q, k, v, B, T, H, KV, D, work);
    assert_memory_equal(out2, out, nq * sizeof(float));
    assert_memory_equal(lse2, lse, (size_t)B * H * T * sizeof(float));
    free(out2);
    free(lse2);
    free(ro);
    free(rq);
    free(rk);
    free(rv);
    free(q);
    free(k);
    free(v);
    free(dout);
    free(out);
    free(dq);
    free(dk);
    free(dv);
    free(lse);
    free(head_max);
    free(work);
}

static void test_attention_against_reference(void **state) {
    (void)state;
    static const int T[] = {1, 37, 128, 129, 257};
    static const int D[] = {32, 64, 128};
    for (size_t t = 0; t < sizeof(T) / sizeof(T[0]); t++)
        for (size_t d = 0; d < sizeof(D) / sizeof(D[0]); d++) check_attention(2, T[t], 4, 2, D[d]);
    check_attention(1, 100, 3, 3, 16); /* multi-head, a head dim below every tile's */
    check_attention(3, 70, 6, 1, 8);   /* one key head for six query heads */
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_attention_against_reference),
    };
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
