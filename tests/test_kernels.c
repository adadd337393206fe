/* The kernels against plain references written for clarity, in double, on
 * odd sizes: the tiled causal attention (forward, backward, QK-clip's
 * maximum) at sequence lengths inside one tile, across tiles and ending
 * mid-tile, with grouped-query heads; RMSNorm, bias, rotary embedding,
 * SwiGLU, cross-entropy and the sum of squares, forward and backward, with
 * bf16 weights and outputs where the decoder uses them; the MoE block's,
 * the embedding's, dropout and scaling through the kernel table
 * (ht_kernels()), as a backend's would be tested. */
#include "harness.h"

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "hypertrain/kernels.h"
#include "kernels/cpu/ops.h"

static void fill_normal(float *x, size_t n, uint64_t seed, float std) {
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    for (size_t i = 0; i < n; i++) x[i] = std * ht_rng_normal(&rng);
}

/* Causal attention of one (batch, head) in double, the textbook way: the
 * whole (T, T) score matrix, softmax, then each gradient from its formula.
 * q, k rows have Dk values (strides qs, ks), v, dout rows Dv (strides vs,
 * os); out, dq, dk, dv are dense. dk and dv are added to (query heads share
 * a key head). */
typedef struct ref_shape {
    int T, Dk, Dv, qs, ks, vs, os;
    double scale;
} ref_shape;

static void reference_head(const float *q, const float *k, const float *v, const float *dout, ref_shape a, double *out,
                           double *dq, double *dk, double *dv, double *head_max) {
    const int T = a.T, Dk = a.Dk, Dv = a.Dv;
    double *p = malloc((size_t)T * T * sizeof(double)), *dp = malloc((size_t)T * T * sizeof(double));
    for (int i = 0; i < T; i++) {
        double mx = -INFINITY;
        for (int j = 0; j < T; j++) {
            double s = 0;
            for (int c = 0; c < Dk; c++) s += (double)q[i * a.qs + c] * k[j * a.ks + c];
            s *= a.scale;
            *head_max = s > *head_max ? s : *head_max; /* masked positions count (QK-clip) */
            p[i * T + j] = s;
            if (j <= i) mx = s > mx ? s : mx;
        }
        double sum = 0;
        for (int j = 0; j <= i; j++) sum += p[i * T + j] = exp(p[i * T + j] - mx);
        for (int j = 0; j < T; j++) p[i * T + j] = j <= i ? p[i * T + j] / sum : 0.0;
    }
    for (int i = 0; i < T; i++)
        for (int c = 0; c < Dv; c++) {
            double o = 0;
            for (int j = 0; j <= i; j++) o += p[i * T + j] * v[j * a.vs + c];
            out[i * Dv + c] = o;
        }
    /* dP = dO vᵀ, dS = P ∘ (dP − rowsum(P ∘ dP)). */
    for (int i = 0; i < T; i++) {
        double dot = 0;
        for (int j = 0; j <= i; j++) {
            double g = 0;
            for (int c = 0; c < Dv; c++) g += (double)dout[i * a.os + c] * v[j * a.vs + c];
            dp[i * T + j] = g;
            dot += p[i * T + j] * g;
        }
        for (int j = 0; j < T; j++) dp[i * T + j] = j <= i ? p[i * T + j] * (dp[i * T + j] - dot) : 0.0;
    }
    for (int i = 0; i < T; i++)
        for (int c = 0; c < Dk; c++) {
            double g = 0;
            for (int j = 0; j <= i; j++) g += dp[i * T + j] * k[j * a.ks + c];
            dq[i * Dk + c] = a.scale * g;
        }
    for (int j = 0; j < T; j++) {
        for (int c = 0; c < Dk; c++) {
            double gk = 0;
            for (int i = j; i < T; i++) gk += dp[i * T + j] * q[i * a.qs + c];
            dk[j * Dk + c] += a.scale * gk;
        }
        for (int c = 0; c < Dv; c++) {
            double gv = 0;
            for (int i = j; i < T; i++) gv += p[i * T + j] * dout[i * a.os + c];
            dv[j * Dv + c] += gv;
        }
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

/* scale 0: 1/sqrt(Dk), as plain attention has it. */
static void check_attention_shape(int B, int T, int H, int KV, int Dk, int Dv, float scale) {
    const ht_attention_shape a = {
        .B = B, .T = T, .H = H, .KV = KV, .Dk = Dk, .Dv = Dv, .scale = scale > 0 ? scale : 1.0f / sqrtf((float)Dk)};
    int64_t qs = (int64_t)H * Dk, ks = (int64_t)KV * Dk, vs = (int64_t)KV * Dv, os = (int64_t)H * Dv;
    int64_t nq = (int64_t)B * T * qs, nk = (int64_t)B * T * ks, nv = (int64_t)B * T * vs, no = (int64_t)B * T * os;
    float *q = malloc(nq * sizeof(float)), *k = malloc(nk * sizeof(float)), *v = malloc(nv * sizeof(float));
    float *dout = malloc(no * sizeof(float)), *out = malloc(no * sizeof(float)), *dq = malloc(nq * sizeof(float));
    float *dk = malloc(nk * sizeof(float)), *dv = malloc(nv * sizeof(float));
    float *lse = malloc((size_t)B * H * T * sizeof(float)), *head_max = malloc((size_t)B * H * sizeof(float));
    float *work = malloc((size_t)omp_get_max_threads() * ht_attention_workspace_floats(T, Dk, Dv) * sizeof(float));
    /* Scores of a few units: the softmax is neither flat nor one-hot. */
    fill_normal(q, nq, 1 + T, 1.5f);
    fill_normal(k, nk, 2 + T, 1.5f);
    fill_normal(v, nv, 3 + T, 1.0f);
    fill_normal(dout, no, 4 + T, 1.0f);
    ht_attention_forward(out, lse, head_max, q, k, v, &a, HT_DTYPE_F32, work);
    ht_attention_backward(dq, dk, dv, dout, out, lse, q, k, v, &a, HT_DTYPE_F32, work);

    const int wide = Dk > Dv ? Dk : Dv;
    double *ro = malloc((size_t)T * wide * sizeof(double)), *rq = malloc((size_t)T * wide * sizeof(double));
    double *rk = calloc((size_t)T * wide, sizeof(double)), *rv = calloc((size_t)T * wide, sizeof(double));
    const ref_shape r = {T, Dk, Dv, (int)qs, (int)ks, (int)vs, (int)os, a.scale};
    double worst[4] = {0};
    for (int b = 0; b < B; b++)
        for (int g = 0; g < KV; g++) {
            memset(rk, 0, (size_t)T * Dk * sizeof(double));
            memset(rv, 0, (size_t)T * Dv * sizeof(double));
            for (int h = g * (H / KV); h < (g + 1) * (H / KV); h++) {
                int64_t qo = (int64_t)b * T * qs + (int64_t)h * Dk, oo = (int64_t)b * T * os + (int64_t)h * Dv;
                double mx = -INFINITY;
                reference_head(q + qo, k + (int64_t)b * T * ks + (int64_t)g * Dk, v + (int64_t)b * T * vs + g * Dv,
                               dout + oo, r, ro, rq, rk, rv, &mx);
                worst[0] = fmax(worst[0], rel_err_double(out + oo, os, ro, T, Dv));
                worst[1] = fmax(worst[1], rel_err_double(dq + qo, qs, rq, T, Dk));
                if (fabs(head_max[b * H + h] - mx) > 1e-5 * fabs(mx))
                    fail_msg("B%d T%d H%d KV%d Dk%d Dv%d: head %d max logit %.9g, reference %.9g", B, T, H, KV, Dk, Dv,
                             h, head_max[b * H + h], mx);
            }
            worst[2] = fmax(worst[2], rel_err_double(dk + (int64_t)b * T * ks + (int64_t)g * Dk, ks, rk, T, Dk));
            worst[3] = fmax(worst[3], rel_err_double(dv + (int64_t)b * T * vs + (int64_t)g * Dv, vs, rv, T, Dv));
        }
    static const char *const names[] = {"out", "dq", "dk", "dv"};
    for (int i = 0; i < 4; i++)
        if (!(worst[i] <= 1e-5))
            fail_msg("B%d T%d H%d KV%d Dk%d Dv%d: %s off the reference by %.3g (bound 1e-5)", B, T, H, KV, Dk, Dv,
                     names[i], worst[i]);
    printf("attention B%d T%-4d H%d KV%d Dk%-3d Dv%-3d: out %.2g, dq %.2g, dk %.2g, dv %.2g of the double reference\n",
           B, T, H, KV, Dk, Dv, worst[0], worst[1], worst[2], worst[3]);

    /* Without QK-clip's maximum the same numbers come out (the masked tiles only feed it). */
    float *out2 = malloc(no * sizeof(float)), *lse2 = malloc((size_t)B * H * T * sizeof(float));
    ht_attention_forward(out2, lse2, NULL, q, k, v, &a, HT_DTYPE_F32, work);
    assert_memory_equal(out2, out, no * sizeof(float));
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

static void check_attention(int B, int T, int H, int KV, int D) { check_attention_shape(B, T, H, KV, D, D, 0); }

static void test_attention_against_reference(void **state) {
    (void)state;
    static const int T[] = {1, 37, 128, 129, 257};
    static const int D[] = {32, 64, 128};
    for (size_t t = 0; t < sizeof(T) / sizeof(T[0]); t++)
        for (size_t d = 0; d < sizeof(D) / sizeof(D[0]); d++) check_attention(2, T[t], 4, 2, D[d]);
    check_attention(1, 100, 3, 3, 16); /* multi-head, a head dim below every tile's */
    check_attention(3, 70, 6, 1, 8);   /* one key head for six query heads */
    /* Multi-Latent Attention's: values narrower or wider than the keys, a softmax scale of its own (YaRN's). */
    check_attention_shape(2, 37, 4, 4, 12, 8, 0.37f);
    check_attention_shape(1, 129, 3, 3, 24, 40, 0);
    check_attention_shape(2, 130, 4, 2, 192, 128, 0.1f);
}

static double max_abs(const float *x, size_t n) {
    double m = 0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs((double)x[i]));
    return m;
}

/* max |a - ref| / max |ref| over n floats. */
static double rel_err_float(const float *a, const float *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num = fmax(num, fabs((double)a[i] - ref[i]));
        den = fmax(den, fabs((double)ref[i]));
    }
    return den > 0 ? num / den : num;
}

/* Attention over blocks of keys at position offsets, as ring attention
 * runs it: the queries [q0, q0 + Tq) of a sequence of T against its keys cut
 * into blocks [k0, k0 + Tk); each block's partial output and lse merged
 * (ht_attention_merge) must be the whole causal attention of those queries,
 * and each block's backward (given the merged out and lse) its keys' dk, dv
 * and a share of dq that sums to the whole's. A query that sees no key of a
 * block gets out 0, lse -inf from it, and no share of the gradient. */
static void check_key_blocks(int B, int T, int H, int KV, int D, int q0, int Tq, const int *cuts, int ncuts) {
    const int64_t qs = (int64_t)H * D, ks = (int64_t)KV * D;
    const size_t nq = (size_t)B * T * qs, nk = (size_t)B * T * ks;
    float *q = malloc(nq * 4), *k = malloc(nk * 4), *v = malloc(nk * 4), *dout = malloc(nq * 4);
    fill_normal(q, nq, 51 + T, 1.5f);
    fill_normal(k, nk, 52 + T, 1.5f);
    fill_normal(v, nk, 53 + T, 1.0f);
    fill_normal(dout, nq, 54 + T, 1.0f);
    /* The whole attention of all T positions: the reference rows q0 .. q0 + Tq. */
    const ht_attention_shape whole = {.B = B, .T = T, .H = H, .KV = KV, .Dk = D, .Dv = D, .scale = 1.0f / sqrtf(D)};
    float *out = malloc(nq * 4), *lse = malloc((size_t)B * H * T * 4), *dq = malloc(nq * 4), *dk = malloc(nk * 4),
          *dv = malloc(nk * 4);
    float *work = malloc((size_t)omp_get_max_threads() * ht_attention_workspace_floats(T, D, D) * 4);
    ht_attention_forward(out, lse, NULL, q, k, v, &whole, HT_DTYPE_F32, work);
    ht_attention_backward(dq, dk, dv, dout, out, lse, q, k, v, &whole, HT_DTYPE_F32, work);
    /* The query block, and each key block, copied out as a rank would hold them. */
    const size_t bq = (size_t)B * Tq * qs;
    float *qb = malloc(bq * 4), *doutb = malloc(bq * 4), *ob = malloc(bq * 4), *lb = malloc((size_t)B * H * Tq * 4);
    float *o2 = malloc(bq * 4), *l2 = malloc((size_t)B * H * Tq * 4), *dqb = calloc(bq, 4), *dq2 = malloc(bq * 4);
    for (int b = 0; b < B; b++) {
        memcpy(qb + (size_t)b * Tq * qs, q + ((size_t)b * T + q0) * qs, (size_t)Tq * qs * 4);
        memcpy(doutb + (size_t)b * Tq * qs, dout + ((size_t)b * T + q0) * qs, (size_t)Tq * qs * 4);
    }
    double worst_out = 0, worst_dkv = 0;
    for (int pass = 0; pass < 2; pass++) { /* forward and merge, then backward with the merged out and lse */
        for (int c = 0; c < ncuts; c++) {
            const int k0 = cuts[c], Tk = (c + 1 < ncuts ? cuts[c + 1] : T) - k0;
            const size_t blk = (size_t)B * Tk * ks;
            float *kb = malloc(blk * 4), *vb = malloc(blk * 4), *dkb = malloc(blk * 4), *dvb = malloc(blk * 4);
            for (int b = 0; b < B; b++) {
                memcpy(kb + (size_t)b * Tk * ks, k + ((size_t)b * T + k0) * ks, (size_t)Tk * ks * 4);
                memcpy(vb + (size_t)b * Tk * ks, v + ((size_t)b * T + k0) * ks, (size_t)Tk * ks * 4);
            }
            const ht_attention_shape a = {.B = B,
                                          .T = Tq,
                                          .H = H,
                                          .KV = KV,
                                          .Dk = D,
                                          .Dv = D,
                                          .scale = 1.0f / sqrtf(D),
                                          .Tk = Tk,
                                          .q0 = q0,
                                          .k0 = k0};
            if (pass == 0) {
                ht_attention_forward(c == 0 ? ob : o2, c == 0 ? lb : l2, NULL, qb, kb, vb, &a, HT_DTYPE_F32, work);
                if (c > 0) ht_attention_merge(ob, lb, o2, l2, B, Tq, H, D);
            } else {
                ht_attention_backward(dq2, dkb, dvb, doutb, ob, lb, qb, kb, vb, &a, HT_DTYPE_F32, work);
                for (size_t i = 0; i < bq; i++) dqb[i] += dq2[i];
                /* The block's keys get every query's gradient, the ones outside the query block excepted: compare
                 * where the query block is the whole sequence's tail (all later queries are in it). */
                if (q0 + Tq == T && q0 <= k0)
                    for (int b = 0; b < B; b++)
                        worst_dkv =
                            fmax(worst_dkv, fmax(rel_err_float(dkb + (size_t)b * Tk * ks,
                                                               dk + ((size_t)b * T + k0) * ks, (size_t)Tk * ks),
                                                 rel_err_float(dvb + (size_t)b * Tk * ks,
                                                               dv + ((size_t)b * T + k0) * ks, (size_t)Tk * ks)));
            }
            free(kb), free(vb), free(dkb), free(dvb);
        }
        if (pass == 0)
            for (int b = 0; b < B; b++) {
                worst_out = fmax(worst_out, rel_err_float(ob + (size_t)b * Tq * qs, out + ((size_t)b * T + q0) * qs,
                                                          (size_t)Tq * qs));
                for (int h = 0; h < H; h++)
                    for (int t = 0; t < Tq; t++) {
                        float got = lb[((size_t)b * H + h) * Tq + t], want = lse[((size_t)b * H + h) * T + q0 + t];
                        if (!(fabsf(got - want) <= 1e-5f * fmaxf(1.0f, fabsf(want))))
                            fail_msg("key blocks: lse of query %d head %d: %.9g, whole %.9g", q0 + t, h, got, want);
                    }
            }
    }
    double worst_dq = 0;
    for (int b = 0; b < B; b++)
        worst_dq =
            fmax(worst_dq, rel_err_float(dqb + (size_t)b * Tq * qs, dq + ((size_t)b * T + q0) * qs, (size_t)Tq * qs));
    if (!(worst_out <= 1e-6) || !(worst_dq <= 1e-5) || !(worst_dkv <= 1e-5))
        fail_msg("key blocks T%d q0 %d Tq %d: out %.3g (bound 1e-6), dq %.3g, dk/dv %.3g (bound 1e-5) off the whole", T,
                 q0, Tq, worst_out, worst_dq, worst_dkv);
    printf("attention key blocks T%-3d queries [%d, %d) in %d key blocks: out %.2g, dq %.2g, dk/dv %.2g of the whole\n",
           T, q0, q0 + Tq, ncuts, worst_out, worst_dq, worst_dkv);
    free(q), free(k), free(v), free(dout), free(out), free(lse), free(dq), free(dk), free(dv), free(work);
    free(qb), free(doutb), free(ob), free(lb), free(o2), free(l2), free(dqb), free(dq2);
}

static void test_attention_key_blocks(void **state) {
    (void)state;
    const int two[] = {0, 77}, ring4[] = {0, 40, 80, 120}, uneven[] = {0, 3, 130};
    check_key_blocks(2, 150, 4, 2, 32, 0, 150, two, 2);    /* every query against two key blocks */
    check_key_blocks(1, 160, 3, 3, 16, 120, 40, ring4, 4); /* the last chunk against all four (ring) */
    check_key_blocks(2, 160, 4, 1, 24, 40, 40, ring4, 4);  /* a middle chunk: blocks after it unseen */
    check_key_blocks(1, 140, 2, 2, 8, 0, 140, uneven, 3);  /* a block of 3 keys, tiles cut mid-block */
    /* The merge of a block no query saw leaves the other's result as it was. */
    float o[4] = {1, 2, 3, 4}, l[2] = {0.5f, -1.0f}, o2[4] = {9, 9, 9, 9}, l2[2] = {-INFINITY, -INFINITY};
    ht_attention_merge(o, l, o2, l2, 1, 2, 1, 2);
    assert_true(o[0] == 1 && o[1] == 2 && o[2] == 3 && o[3] == 4 && l[0] == 0.5f && l[1] == -1.0f);
}

/* A 16-bit model's attention: its products take q, k, v, dout and the
 * probability tiles (P, then dS) rounded to `dtype`. Against the FP32
 * attention (checked above against double) on the same rounded q, k, v and
 * dout, what differs is the rounding of P and dS alone: each entry by at
 * most u/2 of itself (u = 2^-8 for bf16, 2^-11 for f16), so each output by
 * at most u/2 of the sum of its terms' magnitudes, which for these inputs
 * stays within 4u of the largest output. A tile read with the wrong stride
 * or left unconverted is off by O(1). */
static void check_attention_16bit(int B, int T, int H, int KV, int D, ht_dtype dtype) {
    int64_t nq = (int64_t)B * T * H * D, nk = (int64_t)B * T * KV * D;
    float *in[4], *ref[5], *got[5]; /* q k v dout; out dq dk dv lse */
    size_t n[5] = {(size_t)nq, (size_t)nq, (size_t)nk, (size_t)nk, (size_t)B * H * T};
    for (int i = 0; i < 4; i++) {
        in[i] = malloc((i == 1 || i == 2 ? nk : nq) * sizeof(float));
        fill_normal(in[i], i == 1 || i == 2 ? nk : nq, 11 + i + T, i < 2 ? 1.5f : 1.0f);
        ht_round_to(in[i], i == 1 || i == 2 ? nk : nq, dtype);
    }
    for (int i = 0; i < 5; i++) ref[i] = malloc(n[i] * sizeof(float)), got[i] = malloc(n[i] * sizeof(float));
    float *work = malloc((size_t)omp_get_max_threads() * ht_attention_workspace_floats(T, D, D) * sizeof(float));
    const ht_attention_shape a = {.B = B, .T = T, .H = H, .KV = KV, .Dk = D, .Dv = D, .scale = 1.0f / sqrtf((float)D)};
    float **o[2] = {ref, got};
    for (int r = 0; r < 2; r++) {
        ht_dtype dt = r == 0 ? HT_DTYPE_F32 : dtype;
        ht_attention_forward(o[r][0], o[r][4], NULL, in[0], in[1], in[2], &a, dt, work);
        ht_attention_backward(o[r][1], o[r][2], o[r][3], in[3], o[r][0], o[r][4], in[0], in[1], in[2], &a, dt, work);
    }
    const double u = dtype == HT_DTYPE_BF16 ? 0x1p-8 : 0x1p-11;
    static const char *const names[] = {"out", "dq", "dk", "dv"};
    double e[4];
    for (int i = 0; i < 4; i++) {
        /* With one key a query's scores have no gradient: dq and dk are rounding noise, compared absolutely. */
        e[i] = T == 1 && (i == 1 || i == 2) ? rel_err_float(got[i], ref[i], n[i]) * max_abs(ref[i], n[i])
                                            : rel_err_float(got[i], ref[i], n[i]);
        if (!(e[i] <= 4 * u))
            fail_msg("%s B%d T%d H%d KV%d D%d: %s off the FP32 attention by %.3g (bound 4u = %.3g)",
                     ht_dtype_name(dtype), B, T, H, KV, D, names[i], e[i], 4 * u);
    }
    /* dO reaches the gradients only rounded: the same bits from an unrounded
     * dout. delta (dO · O) must come from the dO the dP product reads, or
     * each dS row shifts by dO's rounding error · O, a shift the softmax's
     * gradient should cancel exactly (a k bias's gradient carries it). */
    float *raw = malloc(nq * sizeof(float)), *dq2 = malloc(n[1] * sizeof(float)), *dk2 = malloc(n[2] * sizeof(float)),
          *dv2 = malloc(n[3] * sizeof(float));
    fill_normal(raw, nq, 14 + T, 1.0f); /* in[3] before its rounding */
    ht_attention_backward(dq2, dk2, dv2, raw, got[0], got[4], in[0], in[1], in[2], &a, dtype, work);
    assert_memory_equal(dq2, got[1], n[1] * sizeof(float));
    assert_memory_equal(dk2, got[2], n[2] * sizeof(float));
    assert_memory_equal(dv2, got[3], n[3] * sizeof(float));
    free(raw), free(dq2), free(dk2), free(dv2);
    /* The rounding happened: a 16-bit path that ran in FP32 would match exactly. */
    assert_true(T == 1 || e[0] > 0);
    printf("attention %-8s B%d T%-4d H%d KV%d D%-3d: out %.2g, dq %.2g, dk %.2g, dv %.2g of FP32 (%.2g, %.2g u)\n",
           ht_dtype_name(dtype), B, T, H, KV, D, e[0], e[1], e[2], e[3], e[0] / u, fmax(fmax(e[1], e[2]), e[3]) / u);
    for (int i = 0; i < 5; i++) free(ref[i]), free(got[i]);
    for (int i = 0; i < 4; i++) free(in[i]);
    free(work);
}

static void test_attention_16bit_operands(void **state) {
    (void)state;
    static const int T[] = {1, 37, 257};
    static const int D[] = {32, 64, 128};
    for (size_t t = 0; t < sizeof(T) / sizeof(T[0]); t++)
        for (size_t d = 0; d < sizeof(D) / sizeof(D[0]); d++) {
            check_attention_16bit(2, T[t], 4, 2, D[d], HT_DTYPE_BF16);
            check_attention_16bit(2, T[t], 4, 2, D[d], HT_DTYPE_F16);
        }
    check_attention_16bit(3, 70, 6, 1, 8, HT_DTYPE_BF16);
}

/* max |a - ref| / max |ref|, float against double. */
static double err_vs(const float *a, const double *ref, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        num = fmax(num, fabs(a[i] - ref[i]));
        den = fmax(den, fabs(ref[i]));
    }
    return den > 0 ? num / den : num;
}

#define EXPECT_CLOSE(what, got, ref, n, tol)                                                                           \
    do {                                                                                                               \
        double e_ = err_vs(got, ref, n);                                                                               \
        if (!(e_ <= (tol))) fail_msg("%s: %.3g off the double reference (bound %g)", what, e_, (double)(tol));         \
    } while (0)

/* RMSNorm (Qwen2/Llama: w * x / sqrt(mean(x^2) + eps)) forward and backward,
 * FP32 and bf16 weights and output, dweight NULL (a frozen weight) too. */
static void test_rmsnorm_against_reference(void **state) {
    (void)state;
    const int64_t N = 37, C = 129;
    const float eps = 1e-6f;
    float *x = malloc(N * C * 4), *w = malloc(C * 4), *dy = malloc(N * C * 4), *y = malloc(N * C * 4);
    float *rstd = malloc(N * 4), *dx = calloc(N * C, 4), *dw = calloc(C, 4), *dx2 = calloc(N * C, 4);
    double *ry = malloc(N * C * 8), *rdx = calloc(N * C, 8), *rdw = calloc(C, 8);
    fill_normal(x, N * C, 11, 2.0f);
    fill_normal(w, C, 12, 0.5f);
    fill_normal(dy, N * C, 13, 1.0f);
    for (int64_t c = 0; c < C; c++) w[c] += 1.0f;
    for (int64_t n = 0; n < N; n++) {
        double ss = 0, dot = 0;
        for (int64_t c = 0; c < C; c++) ss += (double)x[n * C + c] * x[n * C + c];
        double r = 1.0 / sqrt(ss / C + eps);
        for (int64_t c = 0; c < C; c++) {
            ry[n * C + c] = w[c] * x[n * C + c] * r;
            rdw[c] += dy[n * C + c] * x[n * C + c] * r;
            dot += (double)w[c] * dy[n * C + c] * x[n * C + c];
        }
        for (int64_t c = 0; c < C; c++) rdx[n * C + c] = r * w[c] * dy[n * C + c] - x[n * C + c] * r * r * r * dot / C;
    }
    ht_rmsnorm_forward(y, HT_DTYPE_F32, rstd, x, w, HT_DTYPE_F32, N, C, eps);
    EXPECT_CLOSE("rmsnorm forward", y, ry, (size_t)(N * C), 1e-6);
    ht_rmsnorm_backward(dx, dw, dy, x, w, HT_DTYPE_F32, rstd, N, C);
    EXPECT_CLOSE("rmsnorm dx", dx, rdx, (size_t)(N * C), 1e-5);
    EXPECT_CLOSE("rmsnorm dweight", dw, rdw, (size_t)C, 1e-5);
    ht_rmsnorm_backward(dx2, NULL, dy, x, w, HT_DTYPE_F32, rstd, N, C);
    assert_memory_equal(dx2, dx, (size_t)(N * C) * 4);
    /* bf16 weights in, bf16 out: the reference on the weights' bf16 values, the output's rounding allowed. */
    uint16_t *wb = malloc(C * 2), *yb = malloc(N * C * 2);
    ht_convert(wb, HT_DTYPE_BF16, w, HT_DTYPE_F32, (size_t)C);
    ht_rmsnorm_forward(yb, HT_DTYPE_BF16, rstd, x, wb, HT_DTYPE_BF16, N, C, eps);
    float *yf = malloc(N * C * 4);
    ht_convert(yf, HT_DTYPE_F32, yb, HT_DTYPE_BF16, (size_t)(N * C));
    EXPECT_CLOSE("rmsnorm bf16", yf, ry, (size_t)(N * C), 1.0 / 64); /* weight and output each within 2^-9 */
    free(x), free(w), free(dy), free(y), free(rstd), free(dx), free(dw), free(dx2), free(ry), free(rdx), free(rdw);
    free(wb), free(yb), free(yf);
}

/* Bias add and its column sums; SwiGLU silu(g) * u and its two gradients. */
static void test_bias_and_swiglu_against_reference(void **state) {
    (void)state;
    const int64_t N = 53, C = 71, n = N * C;
    float *y = malloc(n * 4), *b = malloc(C * 4), *db = calloc(C, 4), *g = malloc(n * 4), *u = malloc(n * 4);
    float *dh = malloc(n * 4), *h = malloc(n * 4), *dg = malloc(n * 4), *du = malloc(n * 4);
    double *ry = malloc(n * 8), *rdb = calloc(C, 8), *rh = malloc(n * 8), *rdg = malloc(n * 8), *rdu = malloc(n * 8);
    fill_normal(y, n, 21, 1.0f);
    fill_normal(b, C, 22, 1.0f);
    fill_normal(g, n, 23, 3.0f);
    fill_normal(u, n, 24, 1.0f);
    fill_normal(dh, n, 25, 1.0f);
    for (int64_t i = 0; i < n; i++) {
        ry[i] = (double)y[i] + b[i % C];
        rdb[i % C] += y[i]; /* the column sums of y, used as dy below */
        double s = 1.0 / (1.0 + exp(-(double)g[i]));
        rh[i] = g[i] * s * u[i];
        rdu[i] = dh[i] * g[i] * s;
        rdg[i] = dh[i] * u[i] * s * (1.0 + g[i] * (1.0 - s));
    }
    ht_bias_backward(db, y, N, C);
    EXPECT_CLOSE("bias backward", db, rdb, (size_t)C, 1e-5);
    ht_add_bias(y, b, HT_DTYPE_F32, N, C);
    EXPECT_CLOSE("bias add", y, ry, (size_t)n, 1e-7);
    ht_swiglu_forward(h, HT_DTYPE_F32, g, u, n);
    EXPECT_CLOSE("swiglu forward", h, rh, (size_t)n, 1e-6);
    ht_swiglu_backward(dg, du, dh, g, u, n);
    EXPECT_CLOSE("swiglu dgate", dg, rdg, (size_t)n, 1e-6);
    EXPECT_CLOSE("swiglu dup", du, rdu, (size_t)n, 1e-6);
    free(y), free(b), free(db), free(g), free(u), free(dh), free(h), free(dg), free(du);
    free(ry), free(rdb), free(rh), free(rdg), free(rdu);
}

/* Rotary embedding, rotate-half form, against the rotation in double; its
 * backward is the inverse rotation. */
static void test_rope_against_reference(void **state) {
    (void)state;
    const int64_t B = 2, T = 19, H = 3, D = 10, half = D / 2, n = B * T * H * D;
    float *x = malloc(n * 4), *x0 = malloc(n * 4), *cs = malloc(T * half * 4), *sn = malloc(T * half * 4);
    double *rx = malloc(n * 8);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            double angle = t * pow(10000.0, -2.0 * i / D);
            cs[t * half + i] = (float)cos(angle);
            sn[t * half + i] = (float)sin(angle);
        }
    fill_normal(x, n, 31, 1.0f);
    memcpy(x0, x, n * 4);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                const float *v = x0 + ((b * T + t) * H + h) * D;
                double *r = rx + ((b * T + t) * H + h) * D;
                for (int64_t i = 0; i < half; i++) {
                    double c = cs[t * half + i], s = sn[t * half + i];
                    r[i] = v[i] * c - v[i + half] * s;
                    r[i + half] = v[i + half] * c + v[i] * s;
                }
            }
    const ht_rope_layout plain = {H * D, D, 0, H, D, false};
    ht_rope_forward(x, cs, sn, B, T, &plain);
    EXPECT_CLOSE("rope forward", x, rx, (size_t)n, 1e-6);
    ht_rope_backward(x, cs, sn, B, T, &plain);
    double *r0 = malloc(n * 8);
    for (int64_t i = 0; i < n; i++) r0[i] = x0[i];
    EXPECT_CLOSE("rope backward of forward", x, r0, (size_t)n, 1e-6);
    free(x), free(x0), free(cs), free(sn), free(rx), free(r0);
}

/* Multi-Latent Attention's rotary parts: the last R of each head's Dh
 * values (offset Dh - R), in rows with room after the heads (ld), pairs
 * interleaved (2i, 2i + 1) or halves; the other values untouched. */
static void test_rope_layouts(void **state) {
    (void)state;
    const int64_t B = 2, T = 11, H = 3, Dh = 7, R = 4, half = R / 2, ld = H * Dh + 5, n = B * T * ld;
    float *x = malloc(n * 4), *x0 = malloc(n * 4), *cs = malloc(T * half * 4), *sn = malloc(T * half * 4);
    double *rx = malloc(n * 8), *r0 = malloc(n * 8);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            double angle = t * pow(500.0, -2.0 * i / R);
            cs[t * half + i] = (float)(0.9 * cos(angle)); /* YaRN's tables carry a factor */
            sn[t * half + i] = (float)(0.9 * sin(angle));
        }
    for (int interleave = 0; interleave < 2; interleave++) {
        fill_normal(x, n, 37 + interleave, 1.0f);
        memcpy(x0, x, n * 4);
        for (int64_t i = 0; i < n; i++) rx[i] = x0[i], r0[i] = x0[i];
        for (int64_t row = 0; row < B * T; row++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t t = row % T, at = row * ld + h * Dh + (Dh - R);
                for (int64_t i = 0; i < half; i++) {
                    int64_t i1 = interleave ? at + 2 * i : at + i, i2 = interleave ? at + 2 * i + 1 : at + i + half;
                    double c = cs[t * half + i], sv = sn[t * half + i];
                    rx[i1] = x0[i1] * c - x0[i2] * sv;
                    rx[i2] = x0[i2] * c + x0[i1] * sv;
                }
            }
        const ht_rope_layout L = {ld, Dh, Dh - R, H, R, interleave != 0};
        ht_rope_forward(x, cs, sn, B, T, &L);
        EXPECT_CLOSE(interleave ? "rope interleaved" : "rope at an offset", x, rx, (size_t)n, 1e-6);
        /* Backward is the transpose: minus the angle, times the same factor. */
        for (int64_t i = 0; i < n; i++) x[i] = x0[i];
        ht_rope_backward(x, cs, sn, B, T, &L);
        for (int64_t row = 0; row < B * T; row++)
            for (int64_t h = 0; h < H; h++) {
                const int64_t t = row % T, at = row * ld + h * Dh + (Dh - R);
                for (int64_t i = 0; i < half; i++) {
                    int64_t i1 = interleave ? at + 2 * i : at + i, i2 = interleave ? at + 2 * i + 1 : at + i + half;
                    double c = cs[t * half + i], sv = sn[t * half + i];
                    r0[i1] = x0[i1] * c + x0[i2] * sv;
                    r0[i2] = x0[i2] * c - x0[i1] * sv;
                }
            }
        EXPECT_CLOSE(interleave ? "rope interleaved backward" : "rope at an offset backward", x, r0, (size_t)n, 1e-6);
    }
    free(x), free(x0), free(cs), free(sn), free(rx), free(r0);
}

/* Mean cross-entropy over the rows with a target (-1: ignored) and its
 * gradient scale (softmax - onehot), ignored rows zero; the sum of squares. */
static void test_cross_entropy_against_reference(void **state) {
    (void)state;
    const int64_t N = 29, V = 5003;
    float *logits = malloc(N * V * 4);
    int32_t targets[29];
    double *rgrad = calloc(N * V, 8), loss = 0;
    fill_normal(logits, N * V, 41, 4.0f);
    int64_t counted = 0;
    for (int64_t n = 0; n < N; n++) targets[n] = n % 7 == 3 ? -1 : (int32_t)((n * 131) % V);
    for (int64_t n = 0; n < N; n++) {
        if (targets[n] < 0) continue;
        counted++;
    }
    const float scale = 0.5f;
    for (int64_t n = 0; n < N; n++) {
        if (targets[n] < 0) continue;
        const float *row = logits + n * V;
        double mx = -INFINITY, sum = 0;
        for (int64_t v = 0; v < V; v++) mx = fmax(mx, row[v]);
        for (int64_t v = 0; v < V; v++) sum += exp(row[v] - mx);
        loss += log(sum) + mx - row[targets[n]];
        for (int64_t v = 0; v < V; v++) rgrad[n * V + v] = scale * (exp(row[v] - mx) / sum - (v == targets[n]));
    }
    loss /= (double)counted;
    int64_t count;
    ht_softmax_row *rows = malloc((size_t)N * sizeof(ht_softmax_row));
    double got = ht_cross_entropy_forward(logits, targets, N, V, &count, rows);
    assert_int_equal(count, counted);
    if (!(fabs(got - loss) <= 1e-6 * fabs(loss))) fail_msg("cross-entropy %.9g, reference %.9g", got, loss);
    double squares = 0;
    for (int64_t i = 0; i < N * V; i++) squares += (double)logits[i] * logits[i];
    double ss = ht_sum_squares(logits, N * V);
    if (!(fabs(ss - squares) <= 1e-12 * squares)) fail_msg("sum of squares %.17g, reference %.17g", ss, squares);
    /* Backward from the forward's statistics, and finding them itself: the same bits. */
    float *again = malloc((size_t)(N * V) * sizeof(float));
    memcpy(again, logits, (size_t)(N * V) * sizeof(float));
    /* The vocabulary-parallel form over three uneven slices of the columns:
     * each slice's statistics and target logit, combined as the ranks of a
     * tensor-parallel group combine them (max, then the rescaled sums), give
     * the loss, and each slice's backward from the combined statistics its
     * columns of the gradient. */
    const int64_t cuts[4] = {0, 1700, 1701, V};
    float *slice = malloc((size_t)(N * V) * sizeof(float)), *sgrad = malloc((size_t)(N * V) * sizeof(float));
    ht_softmax_row *part = malloc((size_t)N * sizeof(ht_softmax_row)),
                   *whole = malloc((size_t)N * sizeof(ht_softmax_row));
    float picked[29], total_picked[29] = {0};
    for (int64_t n = 0; n < N; n++) whole[n] = (ht_softmax_row){.sum = 0.0, .max = -INFINITY};
    for (int k = 0; k < 3; k++) {
        const int64_t v0 = cuts[k], w = cuts[k + 1] - v0;
        for (int64_t n = 0; n < N; n++) memcpy(slice + n * w, logits + n * V + v0, (size_t)w * sizeof(float));
        ht_softmax_partial(slice, targets, N, w, v0, part, picked);
        for (int64_t n = 0; n < N; n++) {
            total_picked[n] += picked[n];
            if (targets[n] < 0) continue;
            const float mx = fmaxf(whole[n].max, part[n].max);
            whole[n].sum = whole[n].sum * exp((double)whole[n].max - mx) + part[n].sum * exp((double)part[n].max - mx);
            whole[n].max = mx;
        }
    }
    double tp_loss = 0;
    for (int64_t n = 0; n < N; n++)
        if (targets[n] >= 0) tp_loss += log(whole[n].sum) + whole[n].max - total_picked[n];
    tp_loss /= (double)counted;
    if (!(fabs(tp_loss - loss) <= 1e-6 * fabs(loss)))
        fail_msg("vocabulary-parallel cross-entropy %.9g, reference %.9g", tp_loss, loss);
    for (int k = 0; k < 3; k++) {
        const int64_t v0 = cuts[k], w = cuts[k + 1] - v0;
        for (int64_t n = 0; n < N; n++) memcpy(slice + n * w, logits + n * V + v0, (size_t)w * sizeof(float));
        ht_cross_entropy_backward(slice, targets, N, w, v0, scale, whole);
        for (int64_t n = 0; n < N; n++) memcpy(sgrad + n * V + v0, slice + n * w, (size_t)w * sizeof(float));
    }
    EXPECT_CLOSE("vocabulary-parallel cross-entropy backward", sgrad, rgrad, (size_t)(N * V), 1e-5);
    free(slice), free(sgrad), free(part), free(whole);
    ht_cross_entropy_backward(logits, targets, N, V, 0, scale, rows);
    EXPECT_CLOSE("cross-entropy backward", logits, rgrad, (size_t)(N * V), 1e-5);
    ht_cross_entropy_backward(again, targets, N, V, 0, scale, NULL);
    assert_memory_equal(again, logits, (size_t)(N * V) * sizeof(float));
    free(again);
    free(rows);
    free(logits);
    free(rgrad);
}

/* The table's entries for the Qwen2-MoE block, through ht_kernels(), on odd
 * sizes (N 23 tokens, E 7 experts, k 3, C 13): the router's softmax and
 * top-k against a double softmax and a sort, with and without
 * norm_topk_prob; gathering and scattering rows; the combination and its
 * backward, and the router's backward, against finite differences of
 * plain double formulas. */
static void test_moe_kernels_against_reference(void **state) {
    (void)state;
    const ht_kernel_ops *K = ht_kernels();
    enum { N = 23, E = 7, k = 3, C = 13 };
    float logits[N * E], probs[N * E], weight[N * k], psum[N];
    int32_t sel[N * k];
    fill_normal(logits, N * E, 51, 1.5f);
    for (int norm = 0; norm < 2; norm++) {
        memcpy(probs, logits, sizeof(logits));
        K->moe_route(probs, sel, weight, psum, N, E, k, norm);
        for (int n = 0; n < N; n++) {
            double mx = -INFINITY, sum = 0, p[E];
            for (int e = 0; e < E; e++) mx = fmax(mx, logits[n * E + e]);
            for (int e = 0; e < E; e++) sum += exp(logits[n * E + e] - mx);
            for (int e = 0; e < E; e++) {
                p[e] = exp(logits[n * E + e] - mx) / sum;
                if (!(fabs(probs[n * E + e] - p[e]) <= 1e-6))
                    fail_msg("softmax (%d, %d) %g vs %g", n, e, probs[n * E + e], p[e]);
            }
            double chosen = 0;
            for (int j = 0; j < k; j++) {
                int rank = 0; /* how many experts have a larger probability */
                for (int e = 0; e < E; e++) rank += p[e] > p[sel[n * k + j]];
                assert_int_equal(rank, j);
                chosen += p[sel[n * k + j]];
            }
            for (int j = 0; j < k; j++) {
                double want = p[sel[n * k + j]] / (norm ? chosen : 1.0);
                if (!(fabs(weight[n * k + j] - want) <= 1e-6)) fail_msg("weight %g vs %g", weight[n * k + j], want);
            }
        }
    }
    /* Rows by an index: a permutation and back. */
    int32_t perm[N];
    for (int r = 0; r < N; r++) perm[r] = (r * 5 + 3) % N;
    float rows[N * C], moved[N * C], back[N * C];
    fill_normal(rows, N * C, 52, 1.0f);
    K->gather_rows(moved, rows, perm, N, C * sizeof(float));
    for (int r = 0; r < N; r++) assert_memory_equal(moved + r * C, rows + perm[r] * C, C * sizeof(float));
    K->scatter_rows(back, moved, perm, N, C * sizeof(float));
    assert_memory_equal(back, rows, sizeof(rows));

    /* y = sum_j w_j ye[pos] + sigmoid(z) so, and its backward against finite differences of a double loss L = sum(y *
     * r). */
    enum { A = N * k };
    static float ye[A * C], so[N * C], z[N], y[N * C], dy[N * C], dso[N * C], dz[N], dw[N * k], dye[A * C], dxs[A * C];
    int32_t pos[N * k];
    for (int i = 0; i < A; i++) pos[i] = (int32_t)((i * 7 + 2) % A);
    fill_normal(ye, A * C, 53, 1.0f);
    fill_normal(so, N * C, 54, 1.0f);
    fill_normal(z, N, 55, 1.0f);
    fill_normal(dy, N * C, 56, 1.0f);
    K->moe_combine(y, ye, pos, sel, weight, z, so, N, k, C);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            double want = so[n * C + c] / (1.0 + exp(-(double)z[n]));
            for (int j = 0; j < k; j++) want += (double)weight[n * k + j] * ye[pos[n * k + j] * C + c];
            if (!(fabs(y[n * C + c] - want) <= 1e-5 * (1 + fabs(want))))
                fail_msg("combine %g vs %g", y[n * C + c], want);
        }
    K->moe_combine_backward(dso, dz, dw, dye, dy, ye, so, z, pos, weight, N, k, C);
    for (int n = 0; n < N; n++) {
        double s = 1.0 / (1.0 + exp(-(double)z[n])), dot = 0;
        for (int c = 0; c < C; c++) {
            dot += (double)dy[n * C + c] * so[n * C + c];
            if (!(fabs(dso[n * C + c] - s * dy[n * C + c]) <= 1e-6)) fail_msg("dso");
        }
        if (!(fabs(dz[n] - dot * s * (1 - s)) <= 1e-5 * (1 + fabs(dot))))
            fail_msg("dz %g vs %g", dz[n], dot * s * (1 - s));
        for (int j = 0; j < k; j++) {
            double d = 0;
            for (int c = 0; c < C; c++) {
                d += (double)dy[n * C + c] * ye[pos[n * k + j] * C + c];
                if (!(fabs(dye[pos[n * k + j] * C + c] - weight[n * k + j] * dy[n * C + c]) <= 1e-6)) fail_msg("dye");
            }
            if (!(fabs(dw[n * k + j] - d) <= 1e-5 * (1 + fabs(d)))) fail_msg("dw %g vs %g", dw[n * k + j], d);
        }
    }
    /* The router's backward: dp against central differences of L(logits) = sum_j dw_j w_j(logits) + aux . p. */
    float dp[N * E], aux[E];
    fill_normal(aux, E, 57, 0.3f);
    memcpy(probs, logits, sizeof(logits));
    K->moe_route(probs, sel, weight, psum, N, E, k, true);
    K->moe_route_backward(dp, probs, sel, weight, dw, psum, aux, N, E, k, true);
    double worst = 0;
    for (int n = 0; n < N; n++)
        for (int e = 0; e < E; e++) {
            double Lpm[2];
            for (int side = 0; side < 2; side++) {
                double l[E], mx = -INFINITY, sum = 0, p[E], chosen = 0, L = 0;
                for (int f = 0; f < E; f++) l[f] = logits[n * E + f] + (f == e ? (side ? 1e-4 : -1e-4) : 0);
                for (int f = 0; f < E; f++) mx = fmax(mx, l[f]);
                for (int f = 0; f < E; f++) sum += exp(l[f] - mx);
                for (int f = 0; f < E; f++) p[f] = exp(l[f] - mx) / sum;
                for (int j = 0; j < k; j++) chosen += p[sel[n * k + j]]; /* the same choice: no tie within 1e-4 here */
                for (int j = 0; j < k; j++) L += (double)dw[n * k + j] * p[sel[n * k + j]] / chosen;
                for (int f = 0; f < E; f++) L += (double)aux[f] * p[f];
                Lpm[side] = L;
            }
            double fd = (Lpm[1] - Lpm[0]) / 2e-4;
            worst = fmax(worst, fabs(dp[n * E + e] - fd) / (1 + fabs(fd)));
        }
    if (!(worst <= 1e-3)) fail_msg("router backward %.3g off finite differences", worst);
    /* dx[n] += the rows of its choices. */
    float dx[N * C] = {0};
    fill_normal(dxs, A * C, 58, 1.0f);
    K->moe_scatter_add(dx, dxs, pos, N, k, C);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            double want = 0;
            for (int j = 0; j < k; j++) want += dxs[pos[n * k + j] * C + c];
            if (!(fabs(dx[n * C + c] - want) <= 1e-5)) fail_msg("scatter-add");
        }
    printf("MoE kernels: router backward within %.2g of finite differences\n", worst);
}

/* The embedding's gather and scatter-add, dropout's mask and scale, and the
 * scaling pass, through the table, against plain loops. */
/* The table's memory: zeroed and 64-byte aligned, as the kernels' vector loads and the layers' zero starts assume. */
static void test_table_memory(void **state) {
    (void)state;
    static const size_t sizes[] = {1, 63, 64, 4097, 1 << 20};
    for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
        unsigned char *p = ht_kernels()->alloc(sizes[i]);
        assert_non_null(p);
        assert_int_equal((uintptr_t)p % 64, 0);
        for (size_t j = 0; j < sizes[i]; j++)
            if (p[j] != 0) fail_msg("byte %zu of %zu not zero", j, sizes[i]);
        memset(p, 0xab, sizes[i]);
        ht_kernels()->free(p);
    }
    ht_kernels()->free(NULL);
}

static void test_embedding_dropout_scale(void **state) {
    (void)state;
    const ht_kernel_ops *K = ht_kernels();
    enum { V = 11, C = 9, N = 31 };
    float table[V * C], x[N * C], dx[N * C], dtable[V * C] = {0}, want[V * C] = {0};
    uint16_t table16[V * C];
    int32_t ids[N];
    fill_normal(table, V * C, 61, 1.0f);
    fill_normal(dx, N * C, 62, 1.0f);
    for (int n = 0; n < N; n++) ids[n] = (n * 4) % V; /* repeated ids */
    ht_convert(table16, HT_DTYPE_BF16, table, HT_DTYPE_F32, V * C);
    K->embedding_forward(x, table16, HT_DTYPE_BF16, ids, N, C, 0, V);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) assert_true(x[n * C + c] == ht_bf16_to_f32(table16[ids[n] * C + c]));
    K->embedding_backward(dtable, dx, ids, N, C, 0, V);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) want[ids[n] * C + c] += dx[n * C + c];
    assert_memory_equal(dtable, want, sizeof(want)); /* token order: the same sums */
    /* A vocabulary slice, rows [4, 9) of the table (tensor parallelism's):
     * the tokens it holds get their rows, the others zeros, and only its
     * rows take gradients. */
    float sx[N * C], sd[5 * C] = {0};
    for (int i = 0; i < N * C; i++) sx[i] = 7.0f;
    K->embedding_forward(sx, table16 + 4 * C, HT_DTYPE_BF16, ids, N, C, 4, 5);
    K->embedding_backward(sd, dx, ids, N, C, 4, 5);
    for (int n = 0; n < N; n++) {
        const bool here = ids[n] >= 4 && ids[n] < 9;
        for (int c = 0; c < C; c++)
            if (sx[n * C + c] != (here ? x[n * C + c] : 0.0f))
                fail_msg("embedding_forward of rows [4, 9): token %d (id %d), column %d is %g", n, ids[n], c,
                         (double)sx[n * C + c]);
    }
    assert_memory_equal(sd, want + 4 * C, sizeof(sd));
    /* Dropout: p 0.3 drops about 30%, scales the rest by 1 / 0.7, and redraws the same mask. */
    float a[N * C], b[N * C];
    for (int i = 0; i < N * C; i++) a[i] = b[i] = 1.0f;
    K->dropout(a, N, C, 0.3f, 99, 5ull << 48, 7);
    K->dropout(b, N, C, 0.3f, 99, 5ull << 48, 7);
    assert_memory_equal(a, b, sizeof(a));
    int dropped = 0;
    for (int i = 0; i < N * C; i++) {
        assert_true(a[i] == 0.0f || a[i] == 1.0f / 0.7f);
        dropped += a[i] == 0.0f;
    }
    if (!(dropped > 0.2 * N * C && dropped < 0.4 * N * C)) fail_msg("dropout p 0.3 dropped %d of %d", dropped, N * C);
    K->dropout(b, N, C, 0.3f, 100, 5ull << 48, 7); /* another seed, another mask */
    assert_memory_not_equal(a, b, sizeof(a));
    float s[37];
    fill_normal(s, 37, 63, 1.0f);
    float t[37];
    memcpy(t, s, sizeof(s));
    K->scale(s, 37, 0.25f);
    for (int i = 0; i < 37; i++) assert_true(s[i] == t[i] * 0.25f);
}

/* ---------------------------------------------------------------- every backend against the CPU */

/* ggml's test-backend-ops: each table entry of every backend present (the
 * CPU's and the fenced one always, the CUDA one when this build has it and
 * a device answers) on the same inputs as the CPU's entry, its outputs downloaded and
 * compared with the CPU's: the same bits where both compute the same
 * roundings in the same order (conversions, moving rows, the embedding,
 * dropout, AdamW), else within a bound that names the reason (summation
 * order, a fused multiply-add). The CPU runs through the same upload,
 * download and copy entries, so the harness itself is checked on every
 * machine. The profiled table (kernels/profiled.c) runs over the fenced
 * one: every entry it passes on must give the fenced one's bits, which are
 * the CPU's. */
typedef const ht_kernel_ops *backend;
static backend backends[4];
static int nbackends;

static void find_backends(void) {
    backends[nbackends++] = ht_kernels_cpu();
    backends[nbackends++] = ht_kernels_fenced();
    backends[nbackends++] = ht_kernels_profiled(ht_kernels_fenced());
    ht_error err = {0};
    backend cuda = ht_kernels_cuda(&err);
    if (cuda)
        backends[nbackends++] = cuda;
    else
        printf("CUDA backend not present (the CPU's table alone is tested): %s\n", err.msg);
}

static void *dev_new(backend K, size_t bytes) {
    void *d = K->alloc(bytes ? bytes : 1);
    if (!d) fail_msg("%s: alloc of %zu bytes failed", K->name, bytes);
    return d;
}

/* bytes of host memory into new memory of K. */
static void *dev_copy(backend K, const void *host, size_t bytes) {
    void *d = dev_new(K, bytes);
    K->upload(d, host, bytes);
    return d;
}

/* bytes of K's memory into new host memory (malloc'ed). */
static void *host_copy(backend K, const void *dev, size_t bytes) {
    void *h = malloc(bytes ? bytes : 1);
    assert_non_null(h);
    K->download(h, dev, bytes);
    return h;
}

static void backend_ok(backend K, const char *what) {
    ht_error err = {0};
    if (K->synchronize(&err) != HT_OK) fail_msg("%s, %s: %s", K->name, what, err.msg);
}

/* n floats of K's memory against the CPU's: max |got - ref| / max |ref|
 * within tol, or (tol 0) the same bits. Returns the difference. */
static double against_cpu(backend K, const char *what, const void *dev, const float *ref, size_t n, double tol) {
    backend_ok(K, what);
    float *got = host_copy(K, dev, n * sizeof(float));
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        num = isnan(got[i]) != isnan(ref[i]) ? INFINITY : fmax(num, isnan(d) ? 0 : d);
        den = fmax(den, fabs((double)ref[i]));
        if (tol == 0 && memcmp(&got[i], &ref[i], sizeof(float)) != 0)
            fail_msg("%s, %s: element %zu is %.9g, the CPU's %.9g (the same bits expected)", K->name, what, i,
                     (double)got[i], (double)ref[i]);
    }
    double e = den > 0 ? num / den : num;
    if (!(e <= tol)) fail_msg("%s, %s: %.3g off the CPU's (bound %g)", K->name, what, e, tol);
    free(got);
    return e;
}

/* bytes of K's memory, the same as the CPU's. */
static void same_bytes(backend K, const char *what, const void *dev, const void *ref, size_t bytes) {
    backend_ok(K, what);
    unsigned char *got = host_copy(K, dev, bytes);
    for (size_t i = 0; i < bytes; i++)
        if (got[i] != ((const unsigned char *)ref)[i])
            fail_msg("%s, %s: byte %zu differs from the CPU's (the same bits expected)", K->name, what, i);
    free(got);
}

/* A 16-bit array of K's memory within one unit in the last place of the
 * CPU's (a rounding that an FP32 value one ulp apart may flip). */
static void within_one_ulp16(backend K, const char *what, const void *dev, const uint16_t *ref, size_t n) {
    backend_ok(K, what);
    uint16_t *got = host_copy(K, dev, n * 2);
    for (size_t i = 0; i < n; i++)
        if (abs((int)got[i] - (int)ref[i]) > 1)
            fail_msg("%s, %s: element %zu is 0x%04x, the CPU's 0x%04x", K->name, what, i, got[i], ref[i]);
    free(got);
}

static void summary(backend K, const char *group, double worst) {
    if (K != ht_kernels_cpu())
        printf("backend %s%s, %s: within %.2g of the CPU's\n", K == backends[2] ? "profiled " : "", K->name, group,
               worst);
}

static float *normal(size_t n, uint64_t seed, float std) {
    float *x = malloc(n * sizeof(float));
    assert_non_null(x);
    fill_normal(x, n, seed, std);
    return x;
}

/* The memory entries: alloc zeroed, upload and download, copy, zero, owns, peak_bytes. */
static void test_backend_memory(void **state) {
    (void)state;
    enum { N = 4097 };
    unsigned char a[N], back[N], zeros[N] = {0};
    for (int i = 0; i < N; i++) a[i] = (unsigned char)(i * 37 + 11);
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        unsigned char *d = dev_new(K, N), *e = dev_new(K, N);
        K->download(back, d, N);
        assert_memory_equal(back, zeros, N);
        K->upload(d, a, N);
        K->copy(e, d, N);
        K->zero(d + 100, 1000);
        K->download(back, e, N);
        assert_memory_equal(back, a, N);
        K->download(back, d, N);
        assert_memory_equal(back, a, 100);
        assert_memory_equal(back + 100, zeros, 1000);
        assert_memory_equal(back + 1100, a + 1100, N - 1100);
        /* owns: the backend's memory where the host cannot reach it (inside an allocation too), never the host's */
        assert_true(K->owns(d) == !K->host_memory);
        assert_true(K->owns(d + N - 1) == !K->host_memory);
        assert_false(K->owns(a));
        assert_false(K->owns(back + N / 2));
        /* peak_bytes: the backend's memory held at most, these two blocks counted (the CPU's: 0, the RSS tells) */
        assert_true(K->host_memory ? K->peak_bytes() == 0 : K->peak_bytes() >= 2 * (size_t)N);
        backend_ok(K, "memory");
        assert_true(K->host_memory == (K == ht_kernels_cpu()));
        K->free(d), K->free(e);
    }
}

/* The CUDA backend's workspaces (ht_kernels_cuda_workspace): one block per
 * stream, kept; asking no more than before allocates nothing, asking more
 * grows it, another stream has its own; freed, the next ask allocates. */
static void test_cuda_workspaces(void **state) {
    (void)state;
    ht_error err = {0};
    const ht_kernel_ops *K = ht_kernels_cuda(&err);
    if (!K) {
        assert_null(ht_kernels_cuda_workspace(64));
        assert_int_equal(ht_kernels_cuda_allocations(), 0);
        printf("CUDA workspaces: no CUDA backend (%s)\n", err.msg);
        return;
    }
    void *other = NULL; /* CUDA's default stream: not the backend's own, made non-blocking */
    assert_non_null(ht_kernels_cuda_current_stream());
    const int64_t start = ht_kernels_cuda_allocations();
    void *a = ht_kernels_cuda_workspace(1000);
    assert_non_null(a);
    assert_int_equal(ht_kernels_cuda_allocations(), start + 1);
    assert_ptr_equal(ht_kernels_cuda_workspace(1000), a); /* the second call allocates nothing */
    assert_ptr_equal(ht_kernels_cuda_workspace(10), a);
    assert_int_equal(ht_kernels_cuda_allocations(), start + 1);
    void *was = ht_kernels_cuda_stream(other);
    void *b = ht_kernels_cuda_workspace(1000);
    assert_non_null(b);
    assert_ptr_not_equal(b, a);
    assert_int_equal(ht_kernels_cuda_allocations(), start + 2);
    ht_kernels_cuda_stream(was);
    assert_ptr_equal(ht_kernels_cuda_workspace(1000), a); /* the first stream's, still */
    void *c = ht_kernels_cuda_workspace(1 << 20);         /* grown */
    assert_non_null(c);
    assert_int_equal(ht_kernels_cuda_allocations(), start + 3);
    assert_ptr_equal(ht_kernels_cuda_workspace(1 << 20), c);
    assert_true(K->owns(c));
    ht_kernels_cuda_free_workspaces();
    assert_non_null(ht_kernels_cuda_workspace(1000));
    assert_int_equal(ht_kernels_cuda_allocations(), start + 4);
    ht_kernels_cuda_free_workspaces();
}

/* The fenced backend's memory faults when host code touches it outside an
 * entry, and the fault names it (in a child: the fault ends it). */
static void test_fenced_memory_faults_on_host_access(void **state) {
    (void)state;
    const ht_kernel_ops *K = ht_kernels_fenced();
    int pipefd[2];
    assert_int_equal(pipe(pipefd), 0);
    fflush(stdout), fflush(stderr);
    pid_t child = fork();
    assert_true(child >= 0);
    if (child == 0) {
        dup2(pipefd[1], 2);
        signal(SIGSEGV, SIG_DFL); /* not the test runner's handler, which would carry on with the tests */
        unsigned char *p = K->alloc(100), one = 1;
        K->upload(p + 10, &one, 1); /* through an entry: fine */
        volatile unsigned char *q = p;
        q[10] = 2; /* from the host: the fault */
        _exit(0);
    }
    close(pipefd[1]);
    char text[512] = {0};
    size_t got = 0;
    ssize_t r;
    while (got < sizeof(text) - 1 && (r = read(pipefd[0], text + got, sizeof(text) - 1 - got)) > 0) got += (size_t)r;
    close(pipefd[0]);
    int status;
    assert_int_equal(waitpid(child, &status, 0), child);
    assert_true(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV);
    char want[64];
    snprintf(want, sizeof(want), "byte 10 of a region of %ld bytes", sysconf(_SC_PAGESIZE));
    if (!strstr(text, "host code touched backend memory") || !strstr(text, want))
        fail_msg("the fault was not named: \"%s\"", text);
}

/* The products on odd shapes, every transposition, padded strides, each
 * dtype, beta 0 over a C full of NaN (ignored) and beta 0.5; one ragged,
 * one batched, one large enough for the tensor cores' tiles. Products of
 * 16-bit values are exact in FP32: the backends differ only in summation
 * order, K · 2^-24 of the terms' magnitudes at most. */
typedef struct gemm_test {
    bool ta, tb;
    int64_t M, N, K, pad, batch;
    float beta;
} gemm_test;

static double check_gemm(backend K, const gemm_test *t, ht_dtype dtype, bool ragged) {
    const int64_t lda = (t->ta ? t->M : t->K) + t->pad, ldb = (t->tb ? t->K : t->N) + t->pad, ldc = t->N + t->pad;
    const int64_t arows = t->ta ? t->K : t->M, brows = t->tb ? t->N : t->K;
    const int64_t sa = arows * lda, sb = brows * ldb, sc = t->M * ldc, es = (int64_t)ht_dtype_size(dtype);
    float *a = normal((size_t)(t->batch * sa), 71 + t->M, 1.0f), *bm = normal((size_t)(t->batch * sb), 72 + t->N, 1.0f);
    float *c = normal((size_t)(t->batch * sc), 73, 1.0f), *ref = malloc((size_t)(t->batch * sc) * sizeof(float));
    if (t->beta == 0)
        for (int64_t i = 0; i < t->batch * sc; i++) c[i] = NAN;
    void *a16 = malloc((size_t)(t->batch * sa * es)), *b16 = malloc((size_t)(t->batch * sb * es));
    ht_convert(a16, dtype, a, HT_DTYPE_F32, (size_t)(t->batch * sa));
    ht_convert(b16, dtype, bm, HT_DTYPE_F32, (size_t)(t->batch * sb));
    memcpy(ref, c, (size_t)(t->batch * sc) * sizeof(float));
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    if (t->batch > 1)
        cpu->gemm_batched(t->batch, t->ta, t->tb, t->M, t->N, t->K, 0.75f, a16, lda, sa, b16, ldb, sb, dtype, t->beta,
                          ref, ldc, sc);
    else
        (ragged ? cpu->gemm_ragged : cpu->gemm)(t->ta, t->tb, t->M, t->N, t->K, 0.75f, a16, lda, b16, ldb, dtype,
                                                t->beta, ref, ldc);
    void *da = dev_copy(K, a16, (size_t)(t->batch * sa * es)), *db = dev_copy(K, b16, (size_t)(t->batch * sb * es));
    float *dc = dev_copy(K, c, (size_t)(t->batch * sc) * sizeof(float));
    if (t->batch > 1)
        K->gemm_batched(t->batch, t->ta, t->tb, t->M, t->N, t->K, 0.75f, da, lda, sa, db, ldb, sb, dtype, t->beta, dc,
                        ldc, sc);
    else
        (ragged ? K->gemm_ragged : K->gemm)(t->ta, t->tb, t->M, t->N, t->K, 0.75f, da, lda, db, ldb, dtype, t->beta, dc,
                                            ldc);
    /* the padding columns of C keep what they held: compare every element */
    for (int64_t i = 0; i < t->batch * sc; i++)
        if (t->beta == 0 && i % ldc >= t->N) ref[i] = 0; /* NaN in both, unread */
    float *got = host_copy(K, dc, (size_t)(t->batch * sc) * sizeof(float));
    for (int64_t i = 0; i < t->batch * sc; i++)
        if (t->beta == 0 && i % ldc >= t->N) got[i] = 0;
    K->upload(dc, got, (size_t)(t->batch * sc) * sizeof(float));
    char what[128];
    snprintf(what, sizeof(what), "%s%s %s M%lld N%lld K%lld %c%c beta %g", t->batch > 1 ? "gemm_batched" : "gemm",
             ragged ? "_ragged" : "", ht_dtype_name(dtype), (long long)t->M, (long long)t->N, (long long)t->K,
             t->ta ? 'T' : 'N', t->tb ? 'T' : 'N', (double)t->beta);
    double e = against_cpu(K, what, dc, ref, (size_t)(t->batch * sc), 2e-5);
    K->free(da), K->free(db), K->free(dc);
    free(a), free(bm), free(c), free(ref), free(a16), free(b16), free(got);
    return e;
}

static void test_backend_gemm(void **state) {
    (void)state;
    static const ht_dtype dtypes[] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_F16};
    for (int b = 0; b < nbackends; b++) {
        double worst = 0;
        for (int d = 0; d < 3; d++) {
            for (int ta = 0; ta < 2; ta++)
                for (int tb = 0; tb < 2; tb++) {
                    gemm_test t = {ta, tb, 37, 53, 71, 0, 1, 0.0f};
                    worst = fmax(worst, check_gemm(backends[b], &t, dtypes[d], false));
                    t.pad = 3, t.beta = 0.5f;
                    worst = fmax(worst, check_gemm(backends[b], &t, dtypes[d], false));
                }
            /* ragged: an expert's rows, M (its outputs) or K (a weight's gradient); counts that share a
             * plan (a power of two of rows: 1 .. 64, 65 .. 128) and counts either side of a boundary */
            static const int64_t counts[] = {13, 1, 64, 65, 100, 200};
            for (size_t r = 0; r < sizeof(counts) / sizeof(counts[0]); r++) {
                gemm_test ragged = {false, true, counts[r], 64, 96, 0, 1, 0.0f};
                gemm_test weight = {true, false, 64, 96, counts[r], 0, 1, 1.0f};
                worst = fmax(worst, check_gemm(backends[b], &ragged, dtypes[d], true));
                worst = fmax(worst, check_gemm(backends[b], &weight, dtypes[d], true));
            }
            gemm_test batched = {false, true, 24, 40, 40, 0, 3, 0.0f}, big = {false, true, 256, 384, 512, 0, 1, 0.0f};
            worst = fmax(worst, check_gemm(backends[b], &batched, dtypes[d], false));
            batched.ta = true, batched.tb = false, batched.beta = 1.0f;
            worst = fmax(worst, check_gemm(backends[b], &batched, dtypes[d], false));
            worst = fmax(worst, check_gemm(backends[b], &big, dtypes[d], false));
        }
        summary(backends[b], "gemm, gemm_ragged, gemm_batched (f32, bf16, f16)", worst);
    }
}

/* The CUDA backend's choice of a product's cuBLASLt algorithm
 * (ht_kernels_cuda_set_gemm): under TIMED a new shape's candidates are
 * timed on its first call (on the host emulator, with its first algorithm
 * made slow, another is chosen), under HEURISTIC none are; the products as
 * the CPU's either way, a C that beta reads left as the call alone leaves
 * it (check_gemm compares every element, the padding included). */
static void test_cuda_gemm_choice(void **state) {
    (void)state;
    ht_error err = {0};
    const ht_kernel_ops *K = ht_kernels_cuda(&err);
    int64_t timed, not_first, timed2, not_first2;
    if (!K) {
        ht_kernels_cuda_gemm_choices(&timed, &not_first);
        assert_true(timed == 0 && not_first == 0);
        printf("cuBLASLt algorithm choice: no CUDA backend (%s)\n", err.msg);
        return;
    }
#ifdef HT_CUDA_EMU
    setenv("HT_EMU_SLOW_GEMM_ALGO", "0", 1); /* the emulator's first algorithm waits 5 ms a call */
#endif
    assert_int_equal(ht_kernels_cuda_set_gemm(HT_CUDA_GEMM_TIMED), HT_CUDA_GEMM_TIMED);
    ht_kernels_cuda_gemm_choices(&timed, &not_first);
    gemm_test t = {false, true, 29, 31, 43, 2, 1, 0.5f}; /* shapes no other test plans */
    check_gemm(K, &t, HT_DTYPE_BF16, false);
    ht_kernels_cuda_gemm_choices(&timed2, &not_first2);
#ifdef HT_CUDA_EMU
    assert_int_equal(timed2, timed + 1); /* the emulator offers three candidates */
    assert_int_equal(not_first2, not_first + 1);
#else
    assert_true(timed2 == timed || timed2 == timed + 1); /* a shape the heuristic offers one candidate is not timed */
#endif
    check_gemm(K, &t, HT_DTYPE_BF16, false); /* planned: nothing timed again */
    ht_kernels_cuda_gemm_choices(&timed, &not_first);
    assert_int_equal(timed, timed2);
    assert_int_equal(ht_kernels_cuda_set_gemm(HT_CUDA_GEMM_HEURISTIC), HT_CUDA_GEMM_TIMED);
    gemm_test u = {true, false, 27, 33, 45, 0, 1, 0.0f};
    check_gemm(K, &u, HT_DTYPE_F32, false);
    ht_kernels_cuda_gemm_choices(&timed2, &not_first2);
    assert_int_equal(timed2, timed);
    assert_int_equal(ht_kernels_cuda_set_gemm(HT_CUDA_GEMM_TIMED), HT_CUDA_GEMM_HEURISTIC);
#ifdef HT_CUDA_EMU
    unsetenv("HT_EMU_SLOW_GEMM_ALGO");
#endif
    printf("cuBLASLt algorithm choice: a new shape timed once (%lld of %lld shapes timed chose another than the "
           "heuristic's first), none under the heuristic policy\n",
           (long long)not_first2, (long long)timed2);
}

/* convert between every pair of float dtypes and round_to, on normal
 * values, ties, subnormals, overflow, infinities and NaNs: the same bits. */
static void test_backend_dtypes(void **state) {
    (void)state;
    enum { N = 1000 };
    float x[N];
    fill_normal(x, N, 81, 3.0f);
    static const float special[] = {
        0.0f,   -0.0f,   INFINITY,       -INFINITY,       NAN,   65504.0f, 65519.0f, 65520.0f, 1e-8f,
        -3e-7f, 6.1e-5f, 1.0f + 0x1p-8f, 1.0f + 0x1p-11f, 1e38f, 3.4e38f,  1e-40f};
    memcpy(x, special, sizeof(special));
    for (int i = 16; i < 64; i++) x[i] = ldexpf(x[i], (i % 40) - 30); /* a spread of exponents */
    static const ht_dtype dt[] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_F16};
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        float *dx = dev_copy(K, x, sizeof(x));
        for (int s = 0; s < 3; s++) {
            /* the source in dtype s, from x */
            uint32_t src[N], ref[N];
            ht_convert(src, dt[s], x, HT_DTYPE_F32, N);
            void *dsrc = dev_copy(K, src, N * ht_dtype_size(dt[s]));
            for (int d = 0; d < 3; d++) {
                if (d == s) continue;
                ht_convert(ref, dt[d], src, dt[s], N);
                void *ddst = dev_new(K, N * ht_dtype_size(dt[d]));
                K->convert(ddst, dt[d], dsrc, dt[s], N);
                char what[64];
                snprintf(what, sizeof(what), "convert %s -> %s", ht_dtype_name(dt[s]), ht_dtype_name(dt[d]));
                same_bytes(K, what, ddst, ref, N * ht_dtype_size(dt[d]));
                K->free(ddst);
            }
            K->free(dsrc);
        }
        for (int p = 1; p < 3; p++) {
            float r[N];
            memcpy(r, x, sizeof(x));
            ht_round_to(r, N, dt[p]);
            K->upload(dx, x, sizeof(x));
            K->round_to(dx, N, dt[p]);
            same_bytes(K, dt[p] == HT_DTYPE_BF16 ? "round_to bfloat16" : "round_to float16", dx, r, sizeof(r));
        }
        K->free(dx);
        summary(K, "convert, round_to", 0);
    }
}

/* RMSNorm, bias, rotary embedding and SwiGLU with FP32 and bf16 weights and
 * outputs. A row's sums (mean(x²), the backward's dot) are FP32 in another
 * order on each backend, typically sqrt(C) 2^-24 apart (2e-6 for a row of
 * 1029): RMSNorm's bound, 1e-5, is five times that. */
static void test_backend_decoder(void **state) {
    (void)state;
    const int64_t N = 37, C = 1029; /* a row wider than a block of threads */
    const size_t nc = (size_t)(N * C);
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    float *x = normal(nc, 91, 2.0f), *w = normal((size_t)C, 92, 0.5f), *dy = normal(nc, 93, 1.0f);
    float *dx0 = normal(nc, 94, 0.1f), *dw0 = normal((size_t)C, 95, 0.1f);
    uint16_t *w16 = malloc((size_t)C * 2);
    ht_convert(w16, HT_DTYPE_BF16, w, HT_DTYPE_F32, (size_t)C);
    /* the CPU's */
    float *y = malloc(nc * 4), *rstd = malloc((size_t)N * 4), *dx = malloc(nc * 4), *dw = malloc((size_t)C * 4);
    uint16_t *y16 = malloc(nc * 2);
    cpu->rmsnorm_forward(y, HT_DTYPE_F32, rstd, x, w, HT_DTYPE_F32, N, C, 1e-6f);
    cpu->rmsnorm_forward(y16, HT_DTYPE_BF16, rstd, x, w16, HT_DTYPE_BF16, N, C, 1e-6f);
    memcpy(dx, dx0, nc * 4), memcpy(dw, dw0, (size_t)C * 4);
    cpu->rmsnorm_backward(dx, dw, dy, x, w16, HT_DTYPE_BF16, rstd, N, C);
    float *yb = malloc(nc * 4), *db = malloc((size_t)C * 4);
    memcpy(yb, x, nc * 4), memcpy(db, dw0, (size_t)C * 4);
    cpu->add_bias(yb, w16, HT_DTYPE_BF16, N, C);
    cpu->bias_backward(db, dy, N, C);
    /* rotary embedding on 2 x 7 token rows of 3 heads, 98 rotary dimensions from the same x: plain (B, T, H,
     * D), within wider heads at an offset in wider rows (Multi-Latent Attention's), and interleaved pairs */
    const int64_t B = 2, T = 7, H = 3, D = 98, half = D / 2, nr = B * T * (H * 160 + 30);
    const ht_rope_layout layouts[3] = {
        {H * D, D, 0, H, D, false}, {H * 160 + 30, 160, 62, H, D, false}, {H * D, D, 0, H, D, true}};
    float *cs = malloc((size_t)(T * half) * 4), *sn = malloc((size_t)(T * half) * 4);
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < half; i++) {
            cs[t * half + i] = (float)cos(t * pow(10000.0, -2.0 * i / D));
            sn[t * half + i] = (float)sin(t * pow(10000.0, -2.0 * i / D));
        }
    float *rf = malloc((size_t)(3 * nr) * 4), *rb = malloc((size_t)(3 * nr) * 4);
    for (int l = 0; l < 3; l++) {
        memcpy(rf + l * nr, x, (size_t)nr * 4), memcpy(rb + l * nr, dy, (size_t)nr * 4);
        cpu->rope_forward(rf + l * nr, cs, sn, B, T, &layouts[l]);
        cpu->rope_backward(rb + l * nr, cs, sn, B, T, &layouts[l]);
    }
    /* SwiGLU on x (gate) and dy (up), dx0 as dh */
    float *h = malloc(nc * 4), *dg = malloc(nc * 4), *du = malloc(nc * 4);
    uint16_t *h16 = malloc(nc * 2);
    cpu->swiglu_forward(h, HT_DTYPE_F32, x, dy, (int64_t)nc);
    cpu->swiglu_forward(h16, HT_DTYPE_BF16, x, dy, (int64_t)nc);
    cpu->swiglu_backward(dg, du, dx0, x, dy, (int64_t)nc);

    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        double worst = 0;
        float *kx = dev_copy(K, x, nc * 4), *kw = dev_copy(K, w, (size_t)C * 4), *kdy = dev_copy(K, dy, nc * 4);
        uint16_t *kw16 = dev_copy(K, w16, (size_t)C * 2), *k16 = dev_new(K, nc * 2);
        float *ky = dev_new(K, nc * 4), *krstd = dev_new(K, (size_t)N * 4), *kdx = dev_copy(K, dx0, nc * 4);
        float *kdw = dev_copy(K, dw0, (size_t)C * 4);
        K->rmsnorm_forward(ky, HT_DTYPE_F32, krstd, kx, kw, HT_DTYPE_F32, N, C, 1e-6f);
        worst = fmax(worst, against_cpu(K, "rmsnorm_forward f32", ky, y, nc, 1e-5));
        K->rmsnorm_forward(k16, HT_DTYPE_BF16, krstd, kx, kw16, HT_DTYPE_BF16, N, C, 1e-6f);
        within_one_ulp16(K, "rmsnorm_forward bf16", k16, y16, nc);
        worst = fmax(worst, against_cpu(K, "rmsnorm_forward rstd", krstd, rstd, (size_t)N, 1e-5));
        K->upload(krstd, rstd, (size_t)N * 4); /* backward from the CPU's rstd */
        K->rmsnorm_backward(kdx, kdw, kdy, kx, kw16, HT_DTYPE_BF16, krstd, N, C);
        worst = fmax(worst, against_cpu(K, "rmsnorm_backward dx", kdx, dx, nc, 1e-5));
        worst = fmax(worst, against_cpu(K, "rmsnorm_backward dweight", kdw, dw, (size_t)C, 1e-5));
        K->upload(kdx, dx0, nc * 4);
        K->rmsnorm_backward(kdx, NULL, kdy, kx, kw16, HT_DTYPE_BF16, krstd, N, C); /* a frozen weight */
        worst = fmax(worst, against_cpu(K, "rmsnorm_backward dx (frozen weight)", kdx, dx, nc, 1e-5));

        K->upload(ky, x, nc * 4);
        K->add_bias(ky, kw16, HT_DTYPE_BF16, N, C);
        against_cpu(K, "add_bias", ky, yb, nc, 0);
        K->upload(kdw, dw0, (size_t)C * 4);
        K->bias_backward(kdw, kdy, N, C);
        worst = fmax(worst, against_cpu(K, "bias_backward", kdw, db, (size_t)C, 1e-5));

        float *kcs = dev_copy(K, cs, (size_t)(T * half) * 4), *ksn = dev_copy(K, sn, (size_t)(T * half) * 4);
        static const char *const rope_names[3][2] = {{"rope_forward", "rope_backward"},
                                                     {"rope_forward at an offset", "rope_backward at an offset"},
                                                     {"rope_forward interleaved", "rope_backward interleaved"}};
        for (int l = 0; l < 3; l++) {
            K->upload(ky, x, (size_t)nr * 4);
            K->rope_forward(ky, kcs, ksn, B, T, &layouts[l]);
            worst = fmax(worst, against_cpu(K, rope_names[l][0], ky, rf + l * nr, (size_t)nr, 1e-6));
            K->upload(ky, dy, (size_t)nr * 4);
            K->rope_backward(ky, kcs, ksn, B, T, &layouts[l]);
            worst = fmax(worst, against_cpu(K, rope_names[l][1], ky, rb + l * nr, (size_t)nr, 1e-6));
        }

        float *kdh = dev_copy(K, dx0, nc * 4), *kdg = dev_new(K, nc * 4);
        K->swiglu_forward(ky, HT_DTYPE_F32, kx, kdy, (int64_t)nc);
        worst = fmax(worst, against_cpu(K, "swiglu_forward f32", ky, h, nc, 1e-6));
        K->swiglu_forward(k16, HT_DTYPE_BF16, kx, kdy, (int64_t)nc);
        within_one_ulp16(K, "swiglu_forward bf16", k16, h16, nc);
        K->swiglu_backward(kdg, kdx, kdh, kx, kdy, (int64_t)nc);
        worst = fmax(worst, against_cpu(K, "swiglu_backward dgate", kdg, dg, nc, 1e-6));
        worst = fmax(worst, against_cpu(K, "swiglu_backward dup", kdx, du, nc, 1e-6));
        summary(K, "rmsnorm, bias, rope, swiglu", worst);
        K->free(kx), K->free(kw), K->free(kdy), K->free(kw16), K->free(k16), K->free(ky), K->free(krstd);
        K->free(kdx), K->free(kdw), K->free(kcs), K->free(ksn), K->free(kdh), K->free(kdg);
    }
    free(x), free(w), free(dy), free(dx0), free(dw0), free(w16), free(y), free(rstd), free(dx), free(dw), free(y16);
    free(yb), free(db), free(cs), free(sn), free(rf), free(rb), free(h), free(dg), free(du), free(h16);
}

/* The cross-entropy over a chunk of rows (some ignored), forward with its
 * statistics and backward from them or finding them again. */
static void test_backend_cross_entropy(void **state) {
    (void)state;
    const int64_t N = 29, V = 5003;
    const size_t nv = (size_t)(N * V);
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    float *logits = normal(nv, 101, 4.0f), *grad = malloc(nv * 4);
    int32_t targets[29];
    for (int64_t n = 0; n < N; n++) targets[n] = n % 7 == 3 ? -1 : (int32_t)((n * 131) % V);
    ht_softmax_row rows[29];
    memset(rows, 0, sizeof(rows));
    int64_t count;
    const double loss = cpu->cross_entropy_forward(logits, targets, N, V, &count, rows);
    memcpy(grad, logits, nv * 4);
    cpu->cross_entropy_backward(grad, targets, N, V, 0, 0.5f, rows);
    /* a vocabulary slice: columns [1000, 3000) of every row, as its own (N, 2000) logits */
    const int64_t v0 = 1000, W = 2000;
    float *slice = malloc((size_t)(N * W) * 4), *sgrad = malloc((size_t)(N * W) * 4), picked[29];
    for (int64_t n = 0; n < N; n++) memcpy(slice + n * W, logits + n * V + v0, (size_t)W * 4);
    ht_softmax_row part[29];
    cpu->softmax_partial(slice, targets, N, W, v0, part, picked);
    memcpy(sgrad, slice, (size_t)(N * W) * 4);
    cpu->cross_entropy_backward(sgrad, targets, N, W, v0, 0.5f, rows);
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        float *kl = dev_copy(K, logits, nv * 4), *kl2 = dev_copy(K, logits, nv * 4);
        int32_t *kt = dev_copy(K, targets, sizeof(targets));
        ht_softmax_row *kr = dev_new(K, sizeof(rows));
        int64_t kcount = -1;
        const double kloss = K->cross_entropy_forward(kl, kt, N, V, &kcount, kr);
        assert_int_equal(kcount, count);
        double worst = fabs(kloss - loss) / fabs(loss);
        if (!(worst <= 1e-6)) fail_msg("%s, cross_entropy_forward: loss %.12g, the CPU's %.12g", K->name, kloss, loss);
        ht_softmax_row got[29];
        backend_ok(K, "cross_entropy_forward");
        K->download(got, kr, sizeof(got));
        for (int64_t n = 0; n < N; n++) {
            if (targets[n] < 0) continue;
            if (got[n].max != rows[n].max || !(fabs(got[n].sum - rows[n].sum) <= 1e-6 * rows[n].sum))
                fail_msg("%s, cross_entropy_forward row %lld: max %.9g sum %.12g, the CPU's %.9g %.12g", K->name,
                         (long long)n, (double)got[n].max, got[n].sum, (double)rows[n].max, rows[n].sum);
        }
        K->cross_entropy_backward(kl, kt, N, V, 0, 0.5f, kr);
        worst = fmax(worst, against_cpu(K, "cross_entropy_backward", kl, grad, nv, 1e-5));
        /* finding the statistics again: the same bits as from the forward's */
        K->cross_entropy_backward(kl2, kt, N, V, 0, 0.5f, NULL);
        float *a = host_copy(K, kl, nv * 4), *c = host_copy(K, kl2, nv * 4);
        assert_memory_equal(a, c, nv * 4);
        free(a), free(c);
        summary(K, "cross_entropy_forward/backward", worst);
        /* the vocabulary slice: its statistics, its target logits, its backward from the whole rows' statistics */
        float *ks = dev_copy(K, slice, (size_t)(N * W) * 4), *kp = dev_new(K, sizeof(picked));
        ht_softmax_row *kpart = dev_new(K, sizeof(part)), gpart[29];
        K->softmax_partial(ks, kt, N, W, v0, kpart, kp);
        backend_ok(K, "softmax_partial");
        K->download(gpart, kpart, sizeof(gpart));
        for (int64_t n = 0; n < N; n++)
            if (targets[n] >= 0 &&
                (gpart[n].max != part[n].max || !(fabs(gpart[n].sum - part[n].sum) <= 1e-6 * part[n].sum)))
                fail_msg("%s, softmax_partial row %lld: max %.9g sum %.12g, the CPU's %.9g %.12g", K->name,
                         (long long)n, (double)gpart[n].max, gpart[n].sum, (double)part[n].max, part[n].sum);
        same_bytes(K, "softmax_partial (target logits)", kp, picked, sizeof(picked));
        K->upload(kr, rows, sizeof(rows));
        K->cross_entropy_backward(ks, kt, N, W, v0, 0.5f, kr);
        summary(K, "softmax_partial, cross_entropy_backward of a slice",
                against_cpu(K, "cross_entropy_backward (a vocabulary slice)", ks, sgrad, (size_t)(N * W), 1e-5));
        K->free(ks), K->free(kp), K->free(kpart);
        K->free(kl), K->free(kl2), K->free(kt), K->free(kr);
    }
    free(logits), free(grad), free(slice), free(sgrad);
    /* Rows enough for every warp of a block that sums them (2500 of a narrow vocabulary): the loss and
     * the count, whichever rows each thread's share holds. */
    enum { MANY = 2500, NARROW = 40 };
    float *many = normal((size_t)MANY * NARROW, 103, 3.0f);
    int32_t *mt = malloc(MANY * sizeof(int32_t));
    for (int n = 0; n < MANY; n++) mt[n] = n % 11 == 5 ? -100 : (int32_t)((n * 7) % NARROW);
    int64_t mcount;
    const double mloss = cpu->cross_entropy_forward(many, mt, MANY, NARROW, &mcount, NULL);
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        float *km = dev_copy(K, many, (size_t)MANY * NARROW * 4);
        int32_t *kt = dev_copy(K, mt, MANY * sizeof(int32_t));
        int64_t kcount = -1;
        const double kloss = K->cross_entropy_forward(km, kt, MANY, NARROW, &kcount, NULL);
        backend_ok(K, "cross_entropy_forward (2500 rows)");
        assert_int_equal(kcount, mcount);
        if (!(fabs(kloss - mloss) <= 1e-6 * fabs(mloss)))
            fail_msg("%s, cross_entropy_forward of %d rows: loss %.12g, the CPU's %.12g", K->name, MANY, kloss, mloss);
        K->free(km), K->free(kt);
    }
    free(many), free(mt);
}

/* The embedding (repeated ids), moving rows (4-byte and 2-byte rows),
 * dropout, add, accumulate, strided rows, scale and the sum of squares. */
static void test_backend_rows_and_elementwise(void **state) {
    (void)state;
    enum { V = 11, C = 37, N = 31 };
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    float *table = normal(V * C, 111, 1.0f), *dx = normal(N * C, 112, 1.0f), *a = normal(N * C, 113, 1.0f);
    uint16_t table16[V * C];
    ht_convert(table16, HT_DTYPE_BF16, table, HT_DTYPE_F32, V * C);
    int32_t ids[N], perm[N];
    for (int n = 0; n < N; n++) ids[n] = (n * 4) % V, perm[n] = (n * 5 + 3) % N;
    float x[N * C], dtable[V * C], moved[N * C], drop[N * C], sum[N * C], acc[N * C], scaled[N * C];
    uint16_t moved16[N * 3];
    cpu->embedding_forward(x, table16, HT_DTYPE_BF16, ids, N, C, 0, V);
    memcpy(dtable, table, sizeof(dtable));
    cpu->embedding_backward(dtable, dx, ids, N, C, 0, V);
    /* a vocabulary slice, rows [3, 8) */
    float sx[N * C], sdt[5 * C];
    cpu->embedding_forward(sx, table16 + 3 * C, HT_DTYPE_BF16, ids, N, C, 3, 5);
    memcpy(sdt, table + 3 * C, sizeof(sdt));
    cpu->embedding_backward(sdt, dx, ids, N, C, 3, 5);
    cpu->gather_rows(moved, dx, perm, N, C * 4);
    cpu->scatter_rows(moved16, table16, perm, N, 3 * 2); /* 6-byte rows */
    memcpy(drop, dx, sizeof(drop));
    cpu->dropout(drop, N, C, 0.3f, 99, 5ull << 48, 7);
    cpu->add(sum, dx, a, N * C);
    memcpy(acc, dx, sizeof(acc));
    cpu->accumulate(acc, a, N * C);
    memcpy(scaled, dx, sizeof(scaled));
    cpu->scale(scaled, N * C, 0.37f);
    /* columns [3, 3 + 20) of dx's rows into columns [5, 25) of a's, then added once more */
    float strided[N * C];
    memcpy(strided, a, sizeof(strided));
    cpu->copy_rows(strided + 5, C, dx + 3, C, N, 20, false);
    cpu->copy_rows(strided + 5, C, dx + 3, C, N, 20, true);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            const float want = c >= 5 && c < 25 ? dx[n * C + c - 2] + dx[n * C + c - 2] : a[n * C + c];
            if (strided[n * C + c] != want)
                fail_msg("copy_rows: (%d, %d) is %g, expected %g", n, c, strided[n * C + c], want);
        }
    const size_t big = 3000017;
    float *many = normal(big, 114, 1.0f);
    const double squares = cpu->sum_squares(many, (int64_t)big);
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        uint16_t *kt16 = dev_copy(K, table16, sizeof(table16)), *km16 = dev_new(K, sizeof(moved16));
        int32_t *kids = dev_copy(K, ids, sizeof(ids)), *kperm = dev_copy(K, perm, sizeof(perm));
        float *kx = dev_new(K, sizeof(x)), *kdt = dev_copy(K, table, sizeof(dtable)), *kdx = dev_copy(K, dx, sizeof(x));
        float *ka = dev_copy(K, a, sizeof(x)), *ky = dev_new(K, sizeof(x));
        K->embedding_forward(kx, kt16, HT_DTYPE_BF16, kids, N, C, 0, V);
        against_cpu(K, "embedding_forward", kx, x, N * C, 0);
        K->embedding_backward(kdt, kdx, kids, N, C, 0, V);
        against_cpu(K, "embedding_backward", kdt, dtable, V * C, 0); /* token order: the same sums */
        K->embedding_forward(kx, kt16 + 3 * C, HT_DTYPE_BF16, kids, N, C, 3, 5);
        against_cpu(K, "embedding_forward (a vocabulary slice)", kx, sx, N * C, 0);
        K->upload(kdt, table + 3 * C, sizeof(sdt));
        K->embedding_backward(kdt, kdx, kids, N, C, 3, 5);
        against_cpu(K, "embedding_backward (a vocabulary slice)", kdt, sdt, 5 * C, 0);
        K->gather_rows(ky, kdx, kperm, N, C * 4);
        against_cpu(K, "gather_rows", ky, moved, N * C, 0);
        K->scatter_rows(km16, kt16, kperm, N, 3 * 2);
        same_bytes(K, "scatter_rows (6-byte rows)", km16, moved16, sizeof(moved16));
        K->copy(ky, kdx, sizeof(x));
        K->dropout(ky, N, C, 0.3f, 99, 5ull << 48, 7);
        against_cpu(K, "dropout", ky, drop, N * C, 0);
        K->add(ky, kdx, ka, N * C);
        against_cpu(K, "add", ky, sum, N * C, 0);
        K->copy(ky, kdx, sizeof(x));
        K->accumulate(ky, ka, N * C);
        against_cpu(K, "accumulate", ky, acc, N * C, 0);
        K->copy(ky, kdx, sizeof(x));
        K->scale(ky, N * C, 0.37f);
        against_cpu(K, "scale", ky, scaled, N * C, 0);
        K->copy(ky, ka, sizeof(x));
        K->copy_rows(ky + 5, C, kdx + 3, C, N, 20, false);
        K->copy_rows(ky + 5, C, kdx + 3, C, N, 20, true);
        against_cpu(K, "copy_rows", ky, strided, N * C, 0);
        float *kmany = dev_copy(K, many, big * 4);
        const double ks = K->sum_squares(kmany, (int64_t)big);
        backend_ok(K, "sum_squares");
        if (!(fabs(ks - squares) <= 1e-12 * squares))
            fail_msg("%s, sum_squares: %.17g, the CPU's %.17g", K->name, ks, squares);
        /* 37 pieces of it (more than a CUDA launch's 32), of 0 to ~400k values: each sum sum_squares's bits */
        enum { PIECES = 37 };
        const float *piece[PIECES];
        int64_t len[PIECES];
        double each[PIECES];
        for (int i = 0, at = 0; i < PIECES; i++) {
            len[i] = i == 3 ? 0 : i == 5 ? (int64_t)big - at : (i * 7919) % 20011 + 1;
            piece[i] = kmany + at, at += (int)len[i];
            if (i == 5) at = 0;
        }
        K->sum_squares_each(each, piece, len, PIECES);
        backend_ok(K, "sum_squares_each");
        for (int i = 0; i < PIECES; i++) {
            const double one = K->sum_squares(piece[i], len[i]),
                         cpu_one = cpu->sum_squares(many + (piece[i] - kmany), len[i]);
            if (memcmp(&one, &each[i], sizeof(one)) != 0 || !(fabs(one - cpu_one) <= 1e-12 * cpu_one))
                fail_msg("%s, sum_squares_each: piece %d of %lld values %.17g, sum_squares %.17g, the CPU's %.17g",
                         K->name, i, (long long)len[i], each[i], one, cpu_one);
        }
        summary(K, "embedding, rows, dropout, add, accumulate, copy_rows, scale, sum_squares, sum_squares_each",
                fabs(ks - squares) / squares);
        K->free(kt16), K->free(km16), K->free(kids), K->free(kperm), K->free(kx), K->free(kdt), K->free(kdx);
        K->free(ka), K->free(ky), K->free(kmany);
    }
    free(table), free(dx), free(a), free(many);
}

/* Qwen2-MoE's entries: route, combine and their backward, scatter-add. */
/* lse of K against the CPU's: a row that saw no key is -inf on both, the
 * others within tol of the largest finite one. */
static double lse_against_cpu(backend K, const char *what, const float *dev, const float *ref, size_t n, double tol) {
    backend_ok(K, what);
    float *got = host_copy(K, dev, n * sizeof(float));
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (isinf(ref[i]) || isinf(got[i])) {
            if (got[i] != ref[i]) fail_msg("%s, %s: row %zu is %g, the CPU's %g", K->name, what, i, got[i], ref[i]);
            continue;
        }
        num = fmax(num, isnan(got[i]) ? INFINITY : fabs((double)got[i] - ref[i]));
        den = fmax(den, fabs((double)ref[i]));
    }
    double e = den > 0 ? num / den : num;
    if (!(e <= tol)) fail_msg("%s, %s: %.3g off the CPU's (bound %g)", K->name, what, e, tol);
    free(got);
    return e;
}

/* One attention call (forward with QK-clip's maximum, backward) on K
 * against the CPU's, in `dtype`. The bounds: in FP32 each is within 1e-5 of
 * the double reference (test_attention_against_reference), so 2e-5 apart;
 * with 16-bit operands each is within 4u of the FP32 attention on the same
 * rounded inputs (test_attention_16bit_operands), so 8u apart (a P or dS
 * whose rounding flips with the summation order). The maximum logit is one
 * FP32 dot product summed in another order: 1e-5. */
/* n floats of host memory into K's memory `skew` floats past the start of
 * a new block (skew 1: rows no longer 16-byte aligned); the block is the
 * result minus skew. */
static float *dev_copy_skewed(backend K, const float *host, int64_t n, int64_t skew) {
    float *d = (float *)dev_new(K, (size_t)(n + skew) * 4) + skew;
    K->upload(d, host, (size_t)n * 4);
    return d;
}

/* One shape and dtype on K against the CPU; q, k, v and dO `skew` floats
 * into their blocks. */
static double check_backend_attention(backend K, ht_attention_shape a, ht_dtype dtype, int64_t skew) {
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    const int64_t Tk = a.Tk > 0 ? a.Tk : a.T, nq = a.B * a.T * a.H * a.Dk, nk = a.B * Tk * a.KV * a.Dk;
    const int64_t nv = a.B * Tk * a.KV * a.Dv, no = a.B * a.T * a.H * a.Dv, nl = a.B * a.H * a.T;
    float *q = normal(nq, 131 + a.T, 1.5f), *k = normal(nk, 132 + a.T, 1.5f), *v = normal(nv, 133 + a.T, 1.0f);
    float *dout = normal(no, 134 + a.T, 1.0f), *out = malloc(no * 4), *lse = malloc(nl * 4);
    float *hmax = malloc(a.B * a.H * 4), *dq = malloc(nq * 4), *dk = malloc(nk * 4), *dv = malloc(nv * 4);
    const int64_t longest = a.T > Tk ? a.T : Tk;
    float *work = malloc((size_t)omp_get_max_threads() * cpu->attention_workspace_floats(longest, a.Dk, a.Dv) * 4);
    cpu->attention_forward(out, lse, hmax, q, k, v, &a, dtype, work);
    cpu->attention_backward(dq, dk, dv, dout, out, lse, q, k, v, &a, dtype, work);
    const double u = dtype == HT_DTYPE_BF16 ? 1.0 / 256 : dtype == HT_DTYPE_F16 ? 1.0 / 2048 : 0.0;
    const double tol = dtype == HT_DTYPE_F32 ? 2e-5 : 8 * u;
    float *kq = dev_copy_skewed(K, q, nq, skew), *kk = dev_copy_skewed(K, k, nk, skew);
    float *kv = dev_copy_skewed(K, v, nv, skew), *kdout = dev_copy_skewed(K, dout, no, skew);
    float *kout = dev_new(K, no * 4), *klse = dev_new(K, nl * 4);
    float *khmax = dev_new(K, a.B * a.H * 4), *kdq = dev_new(K, nq * 4), *kdk = dev_new(K, nk * 4);
    float *kdv = dev_new(K, nv * 4);
    size_t wf = (size_t)omp_get_max_threads() * K->attention_workspace_floats(longest, a.Dk, a.Dv);
    float *kwork = dev_new(K, wf * 4);
    K->attention_forward(kout, klse, khmax, kq, kk, kv, &a, dtype, kwork);
    double worst = against_cpu(K, "attention_forward out", kout, out, no, tol);
    worst = fmax(worst, lse_against_cpu(K, "attention_forward lse", klse, lse, nl, 1e-5));
    worst = fmax(worst, against_cpu(K, "attention_forward head_max", khmax, hmax, a.B * a.H, 1e-5));
    /* backward from the CPU's O and lse: the gradients' own differences, not the forward's */
    K->upload(kout, out, no * 4), K->upload(klse, lse, nl * 4);
    K->attention_backward(kdq, kdk, kdv, kdout, kout, klse, kq, kk, kv, &a, dtype, kwork);
    worst = fmax(worst, against_cpu(K, "attention_backward dq", kdq, dq, nq, tol));
    worst = fmax(worst, against_cpu(K, "attention_backward dk", kdk, dk, nk, tol));
    worst = fmax(worst, against_cpu(K, "attention_backward dv", kdv, dv, nv, tol));
    float *bufs[] = {q, k, v, dout, out, lse, hmax, dq, dk, dv, work};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) free(bufs[i]);
    float *dbufs[] = {kq - skew, kk - skew, kv - skew, kdout - skew, kout, klse, khmax, kdq, kdk, kdv, kwork};
    for (size_t i = 0; i < sizeof(dbufs) / sizeof(dbufs[0]); i++) K->free(dbufs[i]);
    return worst;
}

/* Attention on every backend: grouped-query heads, head dims 64 and 128,
 * Multi-Latent Attention's Dk 192 / Dv 128 with its own scale, odd sizes,
 * three query tiles of 64 with a ragged last, blocks of keys at other
 * positions (rows that see none: lse -inf; keys past every query's), each
 * dtype; and attention_merge of two blocks' partial results. */
static void test_backend_attention(void **state) {
    (void)state;
    const ht_attention_shape shapes[] = {
        {.B = 2, .T = 100, .H = 4, .KV = 2, .Dk = 64, .Dv = 64, .scale = 0.125f},
        {.B = 1, .T = 70, .H = 2, .KV = 1, .Dk = 128, .Dv = 128, .scale = 0.08838834764831845f},
        {.B = 1, .T = 37, .H = 3, .KV = 3, .Dk = 24, .Dv = 40, .scale = 0.2f},
        {.B = 1, .T = 45, .H = 2, .KV = 1, .Dk = 192, .Dv = 128, .scale = 0.1f},
        {.B = 2, .T = 64, .H = 2, .KV = 2, .Dk = 32, .Dv = 32, .scale = 0.17f, .Tk = 96, .q0 = 64, .k0 = 32},
        {.B = 1, .T = 64, .H = 2, .KV = 1, .Dk = 32, .Dv = 32, .scale = 0.17f, .Tk = 64, .q0 = 0, .k0 = 40},
        {.B = 1, .T = 130, .H = 2, .KV = 2, .Dk = 64, .Dv = 64, .scale = 0.125f},
        {.B = 1, .T = 70, .H = 3, .KV = 1, .Dk = 32, .Dv = 32, .scale = 0.17f, .Tk = 150, .q0 = 200, .k0 = 10},
        /* ten key tiles: late in a row the running maxima settle (the forward's rescale skipped) */
        {.B = 1, .T = 640, .H = 2, .KV = 1, .Dk = 32, .Dv = 32, .scale = 0.17f},
    };
    const ht_dtype dtypes[] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_F16};
    /* the own kernels here; cuDNN's fused attention has a test of its own below */
    const ht_cuda_attention was = ht_kernels_cuda_set_attention(HT_CUDA_ATTENTION_OWN);
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        if (!K->attention_forward || !K->attention_backward || !K->attention_merge)
            fail_msg("backend %s has no attention entries", K->name);
        double worst = 0;
        for (size_t s = 0; s < sizeof(shapes) / sizeof(shapes[0]); s++)
            for (int d = 0; d < 3; d++) worst = fmax(worst, check_backend_attention(K, shapes[s], dtypes[d], 0));
        /* rows that are not 16-byte aligned (the tensor-core kernels stage from 16-bit copies of their own) */
        for (int d = 1; d < 3; d++) worst = fmax(worst, check_backend_attention(K, shapes[0], dtypes[d], 1));
        summary(K, "attention_forward, attention_backward (f32, bf16, f16)", worst);
        enum { B = 2, T = 40, H = 3, Dv = 24 };
        float *o1 = normal(B * T * H * Dv, 141, 1.0f), *o2 = normal(B * T * H * Dv, 142, 1.0f);
        float *l1 = normal(B * H * T, 143, 2.0f), *l2 = normal(B * H * T, 144, 2.0f);
        l1[3] = -INFINITY, l2[5] = -INFINITY, l1[7] = l2[7] = -INFINITY; /* blocks that saw no key */
        float *ko = dev_copy(K, o1, sizeof(float) * B * T * H * Dv), *kl = dev_copy(K, l1, sizeof(float) * B * H * T);
        float *ko2 = dev_copy(K, o2, sizeof(float) * B * T * H * Dv), *kl2 = dev_copy(K, l2, sizeof(float) * B * H * T);
        ht_kernels()->attention_merge(o1, l1, o2, l2, B, T, H, Dv);
        K->attention_merge(ko, kl, ko2, kl2, B, T, H, Dv);
        double m = against_cpu(K, "attention_merge out", ko, o1, B * T * H * Dv, 1e-6);
        m = fmax(m, lse_against_cpu(K, "attention_merge lse", kl, l1, B * H * T, 1e-6));
        summary(K, "attention_merge", m);
        float *bufs[] = {o1, o2, l1, l2};
        for (int i = 0; i < 4; i++) free(bufs[i]);
        float *dbufs[] = {ko, kl, ko2, kl2};
        for (int i = 0; i < 4; i++) K->free(dbufs[i]);
    }
    ht_kernels_cuda_set_attention(was);
}

/* cuDNN's fused attention (kernels/cuda/cudnn_attention.cu) against the own
 * kernels on the same device and inputs. The bounds, in units u of the
 * dtype (2^-8 bf16, 2^-11 f16), of max |own|: each side is within 4u of the
 * FP32 attention on the same rounded operands (P and dS rounded against
 * their tiles' running maxima, which differ: docs/NUMERICS.md, "Attention"),
 * so 8u apart; cuDNN's O, dQ, dK and dV are also rounded to the dtype
 * (0.5u of each element), and its δ = rowsum(dO ∘ O) is taken from the
 * rounded O (a row's dS shifts by P times 0.5u |dO| |O|, not cancelled):
 * out within 9u, dQ, dK, dV within 10u. lse is the FP32 log-sum-exp of the
 * same FP32 scores in another order: 1e-5 of its largest. Every difference
 * is printed before any bound is asserted, so that one run on a GPU
 * reports them all. */
typedef struct cudnn_case {
    ht_attention_shape a;
    ht_dtype dtype;
    bool required; /* a shape cuDNN 9 takes on Hopper (else: reported, not failed) */
} cudnn_case;

/* n floats of K's memory: max |got - ref| / max |ref| (both K's). */
static double dev_rel_diff(backend K, const float *dev_got, const float *dev_ref, size_t n) {
    float *got = host_copy(K, dev_got, n * 4), *ref = host_copy(K, dev_ref, n * 4);
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)got[i] - (double)ref[i]);
        num = isnan(got[i]) != isnan(ref[i]) || isnan(d) ? INFINITY : fmax(num, d);
        den = fmax(den, fabs((double)ref[i]));
    }
    free(got), free(ref);
    return den > 0 ? num / den : num;
}

static bool check_cudnn_case(backend K, const cudnn_case *c) {
    const ht_attention_shape a = c->a;
    const int64_t nq = a.B * a.T * a.H * a.Dk, nk = a.B * a.T * a.KV * a.Dk, nv = a.B * a.T * a.KV * a.Dv;
    const int64_t no = a.B * a.T * a.H * a.Dv, nl = a.B * a.H * a.T;
    float *q = normal(nq, 151 + a.T, 1.5f), *k = normal(nk, 152 + a.T, 1.5f), *v = normal(nv, 153 + a.T, 1.0f);
    float *g = normal(no, 154 + a.T, 1.0f);
    float *kq = dev_copy(K, q, nq * 4), *kk = dev_copy(K, k, nk * 4), *kv = dev_copy(K, v, nv * 4);
    float *kg = dev_copy(K, g, no * 4);
    /* [0] the own kernels', [1] cuDNN's: out, lse, dq, dk, dv */
    float *r[2][5];
    const int64_t len[5] = {no, nl, nq, nk, nv};
    const ht_cuda_attention policy[2] = {HT_CUDA_ATTENTION_OWN, HT_CUDA_ATTENTION_CUDNN};
    int64_t ran = 0;
    for (int p = 0; p < 2; p++) {
        for (int i = 0; i < 5; i++) r[p][i] = dev_new(K, (size_t)len[i] * 4);
        const ht_cuda_attention was = ht_kernels_cuda_set_attention(policy[p]);
        const int64_t before = ht_kernels_cuda_cudnn_calls();
        K->attention_forward(r[p][0], r[p][1], NULL, kq, kk, kv, &a, c->dtype, NULL);
        /* backward from the own kernels' O and lse, as test_backend_attention takes the CPU's */
        K->attention_backward(r[p][2], r[p][3], r[p][4], kg, r[0][0], r[0][1], kq, kk, kv, &a, c->dtype, NULL);
        backend_ok(K, "attention (cuDNN against the own kernels)");
        if (p == 1) ran = ht_kernels_cuda_cudnn_calls() - before;
        ht_kernels_cuda_set_attention(was);
    }
    const double u = c->dtype == HT_DTYPE_BF16 ? 1.0 / 256 : 1.0 / 2048;
    const char *names[5] = {"out", "lse", "dq", "dk", "dv"};
    const double bound[5] = {9 * u, 1e-5, 10 * u, 10 * u, 10 * u};
    bool ok = ran == 2;
    printf(
        "cuDNN attention %s B%lld T%-4lld H%lld KV%lld Dk%-3lld Dv%-3lld: ", c->dtype == HT_DTYPE_BF16 ? "bf16" : "f16",
        (long long)a.B, (long long)a.T, (long long)a.H, (long long)a.KV, (long long)a.Dk, (long long)a.Dv);
    if (ran != 2) {
        printf("cuDNN ran %lld of the 2 calls (it does not take this shape here: see the log)%s\n", (long long)ran,
               c->required ? "" : ", not required");
        ok = !c->required;
    } else {
        for (int i = 0; i < 5; i++) {
            const double d = dev_rel_diff(K, r[1][i], r[0][i], (size_t)len[i]);
            printf("%s %.2g%s (bound %.2g)%s", names[i], d, d <= bound[i] ? "" : " OVER", bound[i],
                   i < 4 ? ", " : "\n");
            ok = ok && d <= bound[i];
        }
    }
    float *bufs[] = {q, k, v, g};
    for (int i = 0; i < 4; i++) free(bufs[i]);
    float *dbufs[] = {kq, kk, kv, kg};
    for (int i = 0; i < 4; i++) K->free(dbufs[i]);
    for (int p = 0; p < 2; p++)
        for (int i = 0; i < 5; i++) K->free(r[p][i]);
    return ok;
}

/* AUTO chooses per shape at its first call and keeps the choice: a forward
 * called again gives the same bits. */
static void check_cudnn_auto_repeats(backend K) {
    const ht_attention_shape a = {.B = 2, .T = 256, .H = 8, .KV = 2, .Dk = 64, .Dv = 64, .scale = 0.125f};
    const int64_t nq = a.B * a.T * a.H * a.Dk, nk = a.B * a.T * a.KV * a.Dk, nl = a.B * a.H * a.T;
    float *q = normal(nq, 161, 1.5f), *k = normal(nk, 162, 1.5f), *v = normal(nk, 163, 1.0f);
    float *kq = dev_copy(K, q, nq * 4), *kk = dev_copy(K, k, nk * 4), *kv = dev_copy(K, v, nk * 4);
    float *o[2], *l[2];
    const ht_cuda_attention was = ht_kernels_cuda_set_attention(HT_CUDA_ATTENTION_AUTO);
    for (int i = 0; i < 2; i++) {
        o[i] = dev_new(K, nq * 4), l[i] = dev_new(K, nl * 4);
        K->attention_forward(o[i], l[i], NULL, kq, kk, kv, &a, HT_DTYPE_BF16, NULL);
    }
    ht_kernels_cuda_set_attention(was);
    float *first = host_copy(K, o[0], nq * 4);
    same_bytes(K, "attention_forward under AUTO, called again", o[1], first, nq * 4);
    printf("cuDNN attention AUTO: the forward's choice repeats bit for bit\n");
    free(first), free(q), free(k), free(v);
    float *dbufs[] = {kq, kk, kv, o[0], o[1], l[0], l[1]};
    for (int i = 0; i < 7; i++) K->free(dbufs[i]);
}

static void test_backend_attention_cudnn(void **state) {
    (void)state;
    backend K = NULL;
    for (int b = 0; b < nbackends; b++)
        if (strcmp(backends[b]->name, "cuda") == 0) K = backends[b];
    char about[256];
    if (!K) {
        printf("cuDNN attention not tested: no CUDA backend here\n");
        return;
    }
    if (!ht_kernels_cuda_cudnn(about, sizeof(about))) {
        printf("cuDNN attention not tested: %s\n", about);
        return;
    }
    printf("cuDNN attention against the own kernels on %s\n", about);
    const cudnn_case cases[] = {
        {{.B = 2, .T = 100, .H = 4, .KV = 2, .Dk = 64, .Dv = 64, .scale = 0.125f}, HT_DTYPE_BF16, true},
        {{.B = 2, .T = 100, .H = 4, .KV = 2, .Dk = 64, .Dv = 64, .scale = 0.125f}, HT_DTYPE_F16, true},
        {{.B = 1, .T = 130, .H = 2, .KV = 2, .Dk = 128, .Dv = 128, .scale = 0.08838834764831845f}, HT_DTYPE_BF16, true},
        {{.B = 2, .T = 512, .H = 8, .KV = 2, .Dk = 128, .Dv = 128, .scale = 0.08838834764831845f}, HT_DTYPE_BF16, true},
        /* Multi-Latent Attention's head dims: cuDNN 9.19 and later on Hopper */
        {{.B = 1, .T = 45, .H = 2, .KV = 1, .Dk = 192, .Dv = 128, .scale = 0.1f}, HT_DTYPE_BF16, false},
    };
    bool ok = true;
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) ok = check_cudnn_case(K, &cases[i]) && ok;
    check_cudnn_auto_repeats(K);
    if (!ok)
        fail_msg("cuDNN's attention: a required shape did not run on it, or a difference is over its bound (above)");
}

static void test_backend_moe(void **state) {
    (void)state;
    enum { N = 23, E = 7, k = 3, C = 130, A = N * k };
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    float *logits = normal(N * E, 121, 1.5f), *ye = normal(A * C, 122, 1.0f), *so = normal(N * C, 123, 1.0f);
    float *z = normal(N, 124, 1.0f), *dy = normal(N * C, 125, 1.0f), *aux = normal(E, 126, 0.3f);
    float *dxs = normal(A * C, 127, 1.0f), *dx0 = normal(N * C, 128, 1.0f);
    int32_t pos[A];
    for (int i = 0; i < A; i++) pos[i] = (int32_t)((i * 7 + 2) % A);
    float probs[N * E], weight[N * k], psum[N], y[N * C], dp[N * E];
    float *dso = malloc(N * C * 4), *dz = malloc(N * 4), *dw = malloc(A * 4), *dye = malloc(A * C * 4);
    float *dx = malloc(N * C * 4);
    int32_t sel[A];
    memcpy(probs, logits, sizeof(probs));
    cpu->moe_route(probs, sel, weight, psum, N, E, k, true);
    cpu->moe_combine(y, ye, pos, sel, weight, z, so, N, k, C);
    cpu->moe_combine_backward(dso, dz, dw, dye, dy, ye, so, z, pos, weight, N, k, C);
    cpu->moe_route_backward(dp, probs, sel, weight, dw, psum, aux, N, E, k, true);
    memcpy(dx, dx0, N * C * 4);
    cpu->moe_scatter_add(dx, dxs, pos, N, k, C);
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        double worst = 0;
        float *kp = dev_copy(K, logits, sizeof(probs)), *kw = dev_new(K, sizeof(weight)),
              *ks = dev_new(K, sizeof(psum));
        int32_t *ksel = dev_new(K, sizeof(sel)), *kpos = dev_copy(K, pos, sizeof(pos));
        K->moe_route(kp, ksel, kw, ks, N, E, k, true);
        worst = fmax(worst, against_cpu(K, "moe_route probs", kp, probs, N * E, 1e-6));
        same_bytes(K, "moe_route sel", ksel, sel, sizeof(sel));
        worst = fmax(worst, against_cpu(K, "moe_route weight", kw, weight, A, 1e-6));
        worst = fmax(worst, against_cpu(K, "moe_route psum", ks, psum, N, 1e-6));
        K->upload(kp, probs, sizeof(probs)), K->upload(kw, weight, sizeof(weight)), K->upload(ks, psum, sizeof(psum));
        float *kye = dev_copy(K, ye, A * C * 4), *kso = dev_copy(K, so, N * C * 4), *kz = dev_copy(K, z, N * 4);
        float *ky = dev_new(K, N * C * 4), *kdy = dev_copy(K, dy, N * C * 4), *kdso = dev_new(K, N * C * 4);
        float *kdz = dev_new(K, N * 4), *kdw = dev_new(K, A * 4), *kdye = dev_new(K, A * C * 4);
        float *kaux = dev_copy(K, aux, E * 4), *kdp = dev_new(K, sizeof(dp)), *kdxs = dev_copy(K, dxs, A * C * 4);
        K->moe_combine(ky, kye, kpos, ksel, kw, kz, kso, N, k, C);
        worst = fmax(worst, against_cpu(K, "moe_combine", ky, y, N * C, 1e-5));
        K->moe_combine_backward(kdso, kdz, kdw, kdye, kdy, kye, kso, kz, kpos, kw, N, k, C);
        worst = fmax(worst, against_cpu(K, "moe_combine_backward dso", kdso, dso, N * C, 1e-6));
        worst = fmax(worst, against_cpu(K, "moe_combine_backward dz", kdz, dz, N, 1e-5));
        worst = fmax(worst, against_cpu(K, "moe_combine_backward dw", kdw, dw, A, 1e-5));
        worst = fmax(worst, against_cpu(K, "moe_combine_backward dye", kdye, dye, A * C, 1e-6));
        K->upload(kdw, dw, A * 4);
        K->moe_route_backward(kdp, kp, ksel, kw, kdw, ks, kaux, N, E, k, true);
        worst = fmax(worst, against_cpu(K, "moe_route_backward", kdp, dp, N * E, 1e-5));
        K->upload(ky, dx0, N * C * 4);
        K->moe_scatter_add(ky, kdxs, kpos, N, k, C);
        against_cpu(K, "moe_scatter_add", ky, dx, N * C, 0); /* the choices in order: the same sums */
        summary(K, "moe_route, moe_combine, their backward, moe_scatter_add", worst);
        K->free(kp), K->free(kw), K->free(ks), K->free(ksel), K->free(kpos), K->free(kye), K->free(kso), K->free(kz);
        K->free(ky), K->free(kdy), K->free(kdso), K->free(kdz), K->free(kdw), K->free(kdye), K->free(kaux);
        K->free(kdp), K->free(kdxs);
    }
    free(logits), free(ye), free(so), free(z), free(dy), free(aux), free(dxs), free(dx0);
    free(dso), free(dz), free(dw), free(dye), free(dx);
}

/* AdamW on every path (FP32 main param alone; with a bf16 / f16 copy
 * rounded to nearest or stochastically; the copy alone), the same bits as
 * the CPU's; Muon's momentum and update; Newton-Schulz, FP32 and bf16. */
static void test_backend_optimizers(void **state) {
    (void)state;
    enum { N = 5000 };
    const ht_kernel_ops *cpu = ht_kernels_cpu();
    float *p0 = normal(N, 131, 1.0f), *g = normal(N, 132, 0.1f), *m0 = normal(N, 133, 0.01f);
    float *v0 = malloc(N * 4);
    for (int i = 0; i < N; i++) v0[i] = 1e-4f * fabsf(g[i]) + 1e-6f;
    const ht_adamw_hparams h = {.step = 7, .lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    struct {
        bool main;
        ht_dtype model;
        bool stochastic;
    } paths[] = {{true, HT_DTYPE_F32, false},   {true, HT_DTYPE_BF16, false}, {true, HT_DTYPE_F16, true},
                 {false, HT_DTYPE_BF16, false}, {false, HT_DTYPE_BF16, true}, {false, HT_DTYPE_F16, false}};
    float p[N], m[N], v[N], B[N], u[N];
    uint16_t model[N], model0[N];
    for (int b = 0; b < nbackends; b++) {
        backend K = backends[b];
        double worst = 0;
        float *kp = dev_new(K, N * 4), *kg = dev_copy(K, g, N * 4), *km = dev_new(K, N * 4), *kv = dev_new(K, N * 4);
        uint16_t *kmodel = dev_new(K, N * 2);
        for (size_t t = 0; t < sizeof(paths) / sizeof(paths[0]); t++) {
            const bool half = paths[t].model != HT_DTYPE_F32;
            memcpy(p, p0, sizeof(p)), memcpy(m, m0, sizeof(m)), memcpy(v, v0, sizeof(v));
            if (half) ht_convert(model0, paths[t].model, p0, HT_DTYPE_F32, N);
            memcpy(model, model0, sizeof(model));
            cpu->adamw_pass(paths[t].main ? p : NULL, g, m, v, N, &h, half ? model : NULL, paths[t].model,
                            paths[t].stochastic, 1234);
            K->upload(kp, p0, N * 4), K->upload(km, m0, N * 4), K->upload(kv, v0, N * 4);
            K->upload(kmodel, model0, sizeof(model0));
            K->adamw_pass(paths[t].main ? kp : NULL, kg, km, kv, N, &h, half ? kmodel : NULL, paths[t].model,
                          paths[t].stochastic, 1234);
            char what[96];
            snprintf(what, sizeof(what), "adamw (%s main param, %s copy%s)", paths[t].main ? "an FP32" : "no",
                     half ? ht_dtype_name(paths[t].model) : "no", paths[t].stochastic ? ", stochastic" : "");
            if (paths[t].main) against_cpu(K, what, kp, p, N, 0);
            against_cpu(K, what, km, m, N, 0);
            against_cpu(K, what, kv, v, N, 0);
            if (half) same_bytes(K, what, kmodel, model, sizeof(model));
        }
        /* Muon: momentum with and without Nesterov, summed (plain) and as torch's lerps, on either side of
         * their weight's 0.5 (one FMA each: the same bits), then the update on each path, plain and fused */
        static const struct {
            float mu, gw;
            ht_muon_arith arith;
        } moms[] = {{0.95f, 1.0f, HT_MUON_ARITH_PLAIN},
                    {0.95f, (float)(1.0 - 0.95), HT_MUON_ARITH_TORCH},
                    {0.3f, (float)(1.0 - 0.3), HT_MUON_ARITH_TORCH}};
        for (size_t k = 0; k < sizeof(moms) / sizeof(moms[0]); k++)
            for (int nesterov = 0; nesterov < 2; nesterov++) {
                const double tol = moms[k].arith == HT_MUON_ARITH_TORCH ? 0 : 1e-6;
                memcpy(B, m0, sizeof(B));
                cpu->muon_momentum(B, g, u, N, moms[k].mu, moms[k].gw, nesterov, moms[k].arith);
                K->upload(km, m0, N * 4);
                K->muon_momentum(km, kg, kv, N, moms[k].mu, moms[k].gw, nesterov, moms[k].arith);
                worst = fmax(worst, against_cpu(K, "muon_momentum B", km, B, N, tol));
                if (nesterov) worst = fmax(worst, against_cpu(K, "muon_momentum u", kv, u, N, tol));
            }
        for (int a = 0; a < 2; a++) {
            const ht_muon_arith arith = a ? HT_MUON_ARITH_TORCH : HT_MUON_ARITH_PLAIN;
            for (size_t t = 1; t < sizeof(paths) / sizeof(paths[0]); t++) {
                memcpy(p, p0, sizeof(p)), memcpy(u, g, sizeof(u));
                ht_convert(model0, paths[t].model, p0, HT_DTYPE_F32, N);
                memcpy(model, model0, sizeof(model));
                cpu->muon_apply(paths[t].main ? p : NULL, u, N, 0.999f, 0.02f, arith, model, paths[t].model,
                                paths[t].stochastic, 77, 1000);
                K->upload(kp, p0, N * 4), K->upload(kv, g, N * 4), K->upload(kmodel, model0, sizeof(model0));
                K->muon_apply(paths[t].main ? kp : NULL, kv, N, 0.999f, 0.02f, arith, kmodel, paths[t].model,
                              paths[t].stochastic, 77, 1000);
                if (paths[t].main) worst = fmax(worst, against_cpu(K, "muon_apply p", kp, p, N, a ? 0 : 1e-6));
                if (a) /* a product and an FMA, rounded alike everywhere: the copy is the same rounding */
                    same_bytes(K, "muon_apply model copy (fused)", kmodel, model, sizeof(model));
                else
                    within_one_ulp16(K, "muon_apply model copy", kmodel, model, N);
            }
            K->upload(kp, p0, N * 4);
            cpu->muon_apply(memcpy(p, p0, sizeof(p)), u, N, 0.999f, 0.02f, arith, NULL, HT_DTYPE_F32, false, 0, 0);
            K->upload(kv, u, N * 4);
            K->muon_apply(kp, kv, N, 0.999f, 0.02f, arith, NULL, HT_DTYPE_F32, false, 0, 0);
            worst = fmax(worst, against_cpu(K, "muon_apply (no model copy)", kp, p, N, a ? 0 : 1e-6));
        }
        K->free(kp), K->free(kg), K->free(km), K->free(kv), K->free(kmodel);

        /* Newton-Schulz: two wide and two tall matrices, five steps of the legacy quintic, in FP32, with bf16
         * operands and in the Gram form (which both backends take on these shapes) */
        static const double coeffs[5][3] = {{3.4445, -4.7750, 2.0315},
                                            {3.4445, -4.7750, 2.0315},
                                            {3.4445, -4.7750, 2.0315},
                                            {3.4445, -4.7750, 2.0315},
                                            {3.4445, -4.7750, 2.0315}};
        static const int64_t shapes[2][2] = {{24, 40}, {48, 20}};
        for (int s = 0; s < 2; s++)
            for (int d = 0; d < 4; d++) {
                const ht_dtype ns = d == 1 || d == 3 ? HT_DTYPE_BF16 : HT_DTYPE_F32;
                const ht_ns_form form = d == 2 ? HT_NS_FORM_GRAM : d == 3 ? HT_NS_FORM_TORCH : HT_NS_FORM_STANDARD;
                const int64_t rows = shapes[s][0], cols = shapes[s][1], count = 2, all = count * rows * cols;
                float *G = normal((size_t)all, 141 + s, 1.0f), *O = malloc((size_t)all * 4);
                float *work = malloc(cpu->ns_workspace_floats(count, rows, cols, ns, form) * 4);
                cpu->ns_iterate(G, O, count, rows, cols, coeffs, 5, 1e-7, ns, form, work);
                float *kG = dev_copy(K, G, (size_t)all * 4), *kO = dev_new(K, (size_t)all * 4);
                float *kwork = dev_new(K, K->ns_workspace_floats(count, rows, cols, ns, form) * 4);
                K->ns_iterate(kG, kO, count, rows, cols, coeffs, 5, 1e-7, ns, form, kwork);
                char what[64];
                snprintf(what, sizeof(what), "newton_schulz %s%s %lldx%lld", ht_dtype_name(ns),
                         form == HT_NS_FORM_GRAM    ? " gram"
                         : form == HT_NS_FORM_TORCH ? " torch"
                                                    : "",
                         (long long)rows, (long long)cols);
                /* FP32: summation order alone, grown by five steps of a = 3.4; bf16 (either form): two
                 * iterations each within 5e-2 of float64 (test_muon.c's bound) are within 1e-1 of each other */
                worst = fmax(worst, against_cpu(K, what, kO, O, (size_t)all, ns != HT_DTYPE_F32 ? 1e-1 : 1e-3));
                K->free(kG), K->free(kO), K->free(kwork);
                free(G), free(O), free(work);
            }
        summary(K, "adamw (the same bits), muon_momentum, muon_apply, newton_schulz", worst);
    }
    free(p0), free(g), free(m0), free(v0);
}

/* The profiled table: every slot the CPU's table fills is filled (the
 * wrapping tables' own entries are written by hand), and each call is
 * one row's count, the products by dtype, transposes and shape, with the
 * rows' time no more than the time they were called in. */
static void test_profiled_table(void **state) {
    (void)state;
    const ht_kernel_ops *tables[2] = {ht_kernels_fenced(), backends[2]}, *cpu = ht_kernels_cpu();
    for (int t = 0; t < 2; t++)
        for (size_t at = offsetof(ht_kernel_ops, alloc); at + sizeof(void (*)(void)) <= sizeof(ht_kernel_ops);
             at += sizeof(void (*)(void))) {
            void (*mine)(void), (*theirs)(void);
            memcpy(&mine, (const char *)tables[t] + at, sizeof(mine));
            memcpy(&theirs, (const char *)cpu + at, sizeof(theirs));
            if (!mine != !theirs)
                fail_msg("table %d: the slot at byte %zu is %sset, the CPU's %sset", t, at, mine ? "" : "not ",
                         theirs ? "" : "not ");
        }
    backend K = backends[2];
    assert_string_equal(K->name, "fenced");
    assert_false(K->host_memory);
    ht_kernels_profile_reset();
    const float a[6] = {1, 2, 3, 4, 5, 6}, b[12] = {1, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1, 1};
    float *ka = dev_copy(K, a, sizeof(a)), *kb = dev_copy(K, b, sizeof(b)), *kc = dev_new(K, 8 * sizeof(float));
    const double t0 = ht_time_seconds();
    for (int i = 0; i < 3; i++) K->gemm(false, true, 2, 4, 3, 1.0f, ka, 3, kb, 3, HT_DTYPE_F32, 0.0f, kc, 4);
    K->zero(kc, 4 * sizeof(float));
    const double s = K->sum_squares(ka, 6);
    const double wall = ht_time_seconds() - t0;
    assert_true(s == 91.0);
    float c[8];
    K->download(c, kc, sizeof(c));
    /* row 0 zeroed; row 1 = (4 5 6) times b's rows (1 0 0), (1 1 0), (0 1 1), (1 1 1) */
    const float want[8] = {0, 0, 0, 0, 4, 9, 11, 15};
    assert_memory_equal(c, want, sizeof(c));
    ht_kernel_profile_row rows[8];
    const int n = ht_kernels_profile(rows, 8);
    assert_int_equal(n, 5); /* the uploads and the download before and after the clock count too */
    const char *names[5] = {"gemm float32 NT 2 x 4 x 3", "zero", "sum_squares", "upload", "download"};
    const int64_t calls[5] = {3, 1, 1, 2, 1};
    double sum = 0;
    for (int k = 0; k < 5; k++) {
        int i = 0;
        while (i < n && strcmp(rows[i].entry, names[k]) != 0) i++;
        if (i == n) fail_msg("no row %s among the profile's %d", names[k], n);
        assert_int_equal(rows[i].calls, calls[k]);
        assert_true(rows[i].seconds >= 0);
        if (k < 3) sum += rows[i].seconds;
    }
    for (int i = 1; i < n; i++) assert_true(rows[i - 1].seconds >= rows[i].seconds); /* the longest first */
    assert_true(sum <= wall);
    K->free(ka), K->free(kb), K->free(kc);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moe_kernels_against_reference),
        cmocka_unit_test(test_embedding_dropout_scale),
        cmocka_unit_test(test_table_memory),
        cmocka_unit_test(test_attention_against_reference),
        cmocka_unit_test(test_attention_16bit_operands),
        cmocka_unit_test(test_rmsnorm_against_reference),
        cmocka_unit_test(test_bias_and_swiglu_against_reference),
        cmocka_unit_test(test_rope_against_reference),
        cmocka_unit_test(test_rope_layouts),
        cmocka_unit_test(test_attention_key_blocks),
        cmocka_unit_test(test_cross_entropy_against_reference),
        cmocka_unit_test(test_backend_memory),
        cmocka_unit_test(test_cuda_workspaces),
        cmocka_unit_test(test_fenced_memory_faults_on_host_access),
        cmocka_unit_test(test_backend_gemm),
        cmocka_unit_test(test_cuda_gemm_choice),
        cmocka_unit_test(test_backend_dtypes),
        cmocka_unit_test(test_backend_decoder),
        cmocka_unit_test(test_backend_cross_entropy),
        cmocka_unit_test(test_backend_rows_and_elementwise),
        cmocka_unit_test(test_backend_attention),
        cmocka_unit_test(test_backend_attention_cudnn),
        cmocka_unit_test(test_backend_moe),
        cmocka_unit_test(test_backend_optimizers),
        cmocka_unit_test(test_profiled_table),
    };
    find_backends();
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
