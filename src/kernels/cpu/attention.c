/* Causal self-attention, tiled in the manner of FlashAttention-2: the
 * scores of one query block against one key block at a time, an online
 * softmax across the key blocks, and only the output and each row's
 * log-sum-exp kept for backward, which recomputes the probabilities tile by
 * tile. Memory grows with T, not T²; key blocks wholly above the diagonal are
 * never computed (except, when asked, for the largest logit QK-clip needs,
 * which counts masked positions too: docs/NUMERICS.md). */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "kernels/cpu/exp.h"
#include "kernels/cpu/reduce.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

/* Query and key block sizes: 128 x 128 FP32 scores (64 KiB) and a 128 x D
 * block of each operand stay in L2; against 64 x 64 tiles the products run
 * 1.2-1.7x faster (fewer, larger GEMMs; bench_attention, bench/RESULTS.md). */
enum { BQ = 128, BK = 128 };

/* A thread's scratch: the FP32 tiles (scores and probabilities, or their
 * gradient; the output accumulator; the row statistics), then, for 16-bit
 * operands, one head's Q, K, V and dO in that dtype and the tile handed to
 * the second product of each pair (P, or dS) in it. Always sized for 16-bit
 * operands: a model's compute precision can change (ht_model_set_compute)
 * without its buffers being sized again. */
size_t ht_attention_workspace_floats(int64_t T, int64_t Dk, int64_t Dv) {
    size_t f32 = (size_t)(2 * BQ * BK + BQ * Dv + 2 * BQ), halves = (size_t)(2 * T * Dk + 2 * T * Dv + 2 * BQ * BK);
    return f32 + (halves + 1) / 2;
}

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* A GEMM operand: its first element, dtype and row stride. */
typedef struct operand {
    const void *p;
    ht_dtype dtype;
    int64_t ld;
} operand;

/* Row r of an operand. */
static inline const void *row_at(operand o, int64_t r) {
    return (const char *)o.p + (size_t)(r * o.ld) * ht_dtype_size(o.dtype);
}

/* One head's (T, D) rows of stride ld as a GEMM operand of `dtype`: the
 * FP32 rows themselves, or their copy rounded into buf (T x D, dense). */
static operand head_operand(const float *x, int64_t T, int64_t D, int64_t ld, ht_dtype dtype, uint16_t *buf) {
    if (dtype == HT_DTYPE_F32) return (operand){x, dtype, ld};
    for (int64_t t = 0; t < T; t++) ht_convert(buf + t * D, dtype, x + t * ld, HT_DTYPE_F32, (size_t)D);
    return (operand){buf, dtype, D};
}

/* The first cols columns of a (rows, BK) FP32 tile as the second product's
 * operand: the tile itself, or its rows rounded into buf (rows x BK). */
static operand tile_operand(const float *s, int64_t rows, int64_t cols, ht_dtype dtype, uint16_t *buf) {
    if (dtype == HT_DTYPE_F32) return (operand){s, dtype, BK};
    for (int64_t r = 0; r < rows; r++) ht_convert(buf + r * BK, dtype, s + r * BK, HT_DTYPE_F32, (size_t)cols);
    return (operand){buf, dtype, BK};
}

/* The largest entry of a (rows, cols) tile with row stride ld. */
static float tile_max(const float *s, int64_t rows, int64_t cols, int64_t ld) {
    float mx = -INFINITY;
    for (int64_t r = 0; r < rows; r++) mx = max_of(s + r * ld, cols, mx);
    return mx;
}

/* The scratch of one thread, carved. */
typedef struct scratch {
    float *s, *s2, *acc, *m, *l; /* s2 follows s: backward's dP */
    uint16_t *q, *k, *v, *dout, *tile;
} scratch;

static scratch scratch_carve(float *work, int64_t T, int64_t Dk, int64_t Dv) {
    scratch w;
    w.s = work, w.s2 = work + BQ * BK, w.acc = work + 2 * BQ * BK, w.m = w.acc + BQ * Dv, w.l = w.m + BQ;
    w.q = (uint16_t *)(w.l + BQ), w.k = w.q + T * Dk, w.v = w.k + T * Dk, w.dout = w.v + T * Dv;
    w.tile = w.dout + T * Dv;
    return w;
}

/* The row strides of one call's tensors: q (qs) and k (ks) rows of Dk, v
 * (vs) and out (os) rows of Dv. */
typedef struct strides {
    int64_t qs, ks, vs, os;
} strides;

static strides strides_of(const ht_attention_shape *a) {
    return (strides){a->H * a->Dk, a->KV * a->Dk, a->KV * a->Dv, a->H * a->Dv};
}

/* The keys of a call (Tk 0: the queries' count). */
static int64_t keys_of(const ht_attention_shape *a) { return a->Tk > 0 ? a->Tk : a->T; }

/* How many of the block's keys query i sees: keys j with k0 + j <= q0 + i,
 * clamped to [0, Tk]. */
static int64_t seen_keys(const ht_attention_shape *a, int64_t i) {
    int64_t n = a->q0 + i - a->k0 + 1, Tk = keys_of(a);
    return n < 0 ? 0 : n > Tk ? Tk : n;
}

/* One (batch, head). The products take their operands in `dtype`, accumulate in FP32. */
static void forward_head(float *out, float *lse, float *head_max, const float *q32, const float *k32, const float *v32,
                         const ht_attention_shape *a, strides st, ht_dtype dtype, scratch w) {
    const int64_t T = a->T, Tk = keys_of(a), Dk = a->Dk, D = a->Dv;
    float *s = w.s, *acc = w.acc, *m = w.m, *l = w.l;
    const operand q = head_operand(q32, T, Dk, st.qs, dtype, w.q), k = head_operand(k32, Tk, Dk, st.ks, dtype, w.k),
                  v = head_operand(v32, Tk, D, st.vs, dtype, w.v);
    const float scale = a->scale;
    float hmax = -INFINITY;
    for (int64_t i0 = 0; i0 < T; i0 += BQ) {
        int64_t bq = min64(BQ, T - i0), keys = seen_keys(a, i0 + bq - 1); /* the keys any query of the block sees */
        for (int64_t r = 0; r < bq; r++) m[r] = -INFINITY, l[r] = 0.0f;
        for (int64_t j0 = 0; j0 < keys; j0 += BK) {
            int64_t bk = min64(BK, keys - j0);
            ht_gemm(false, true, bq, bk, Dk, scale, row_at(q, i0), q.ld, row_at(k, j0), k.ld, dtype, 0.0f, s, BK);
            if (head_max) {
                float t = tile_max(s, bq, bk, BK);
                hmax = t > hmax ? t : hmax;
            }
            for (int64_t r = 0; r < bq; r++) {
                float *row = s + r * BK, *arow = acc + r * D;
                int64_t valid = min64(bk, seen_keys(a, i0 + r) - j0); /* keys j with k0 + j <= q0 + i */
                float mx = max_of(row, valid, m[r]);
                float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
                for (int64_t c = 0; c < valid; c++) {
                    row[c] = exp_nonpositive(row[c] - mx);
                    sum += row[c];
                }
                for (int64_t c = valid < 0 ? 0 : valid; c < bk; c++) row[c] = 0.0f;
                /* The running sums were taken against the old maximum (none while the row saw no key). */
                float corr = j0 == 0 || m[r] == -INFINITY ? 0.0f : exp_nonpositive(m[r] - mx);
                if (j0 > 0 && corr != 1.0f)
                    for (int64_t c = 0; c < D; c++) arow[c] *= corr;
                l[r] = l[r] * corr + sum;
                m[r] = mx;
            }
            operand p = tile_operand(s, bq, bk, dtype, w.tile);
            ht_gemm(false, false, bq, D, bk, 1.0f, p.p, p.ld, row_at(v, j0), v.ld, dtype, j0 == 0 ? 0.0f : 1.0f, acc,
                    D);
        }
        for (int64_t r = 0; r < bq; r++) {
            float *orow = out + (i0 + r) * st.os;
            if (!(l[r] > 0)) { /* no key of this block is seen: nothing, merged as nothing */
                memset(orow, 0, (size_t)D * sizeof(float));
                lse[i0 + r] = -INFINITY;
                continue;
            }
            float inv = 1.0f / l[r];
            for (int64_t c = 0; c < D; c++) orow[c] = acc[r * D + c] * inv;
            lse[i0 + r] = m[r] + logf(l[r]);
        }
        /* QK-clip's maximum also counts the keys above the diagonal. */
        for (int64_t j0 = keys; head_max && j0 < Tk; j0 += BK) {
            int64_t bk = min64(BK, Tk - j0);
            ht_gemm(false, true, bq, bk, Dk, scale, row_at(q, i0), q.ld, row_at(k, j0), k.ld, dtype, 0.0f, s, BK);
            float t = tile_max(s, bq, bk, BK);
            hmax = t > hmax ? t : hmax;
        }
    }
    if (head_max) *head_max = hmax;
}

void ht_attention_forward(float *out, float *lse, float *head_max, const float *q, const float *k, const float *v,
                          const ht_attention_shape *a, ht_dtype dtype, float *work) {
    const int64_t B = a->B, T = a->T, Tk = keys_of(a), H = a->H, group = a->H / a->KV, Dk = a->Dk, Dv = a->Dv;
    const int64_t longest = T > Tk ? T : Tk;
    const strides st = strides_of(a);
    size_t per_thread = ht_attention_workspace_floats(longest, Dk, Dv);
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++) {
            int64_t g = h / group;
            forward_head(out + b * T * st.os + h * Dv, lse + (b * H + h) * T, head_max ? head_max + b * H + h : NULL,
                         q + b * T * st.qs + h * Dk, k + b * Tk * st.ks + g * Dk, v + b * Tk * st.vs + g * Dv, a, st,
                         dtype, scratch_carve(work + (size_t)omp_get_thread_num() * per_thread, longest, Dk, Dv));
        }
}

/* One query head's share of the gradients: dq for its rows, += into the dk
 * and dv of its key head, whose operands k and v the caller rounded. */
static void backward_head(float *dq, float *dk, float *dv, const float *dout32, const float *out, const float *lse,
                          const float *q32, operand k, operand v, const ht_attention_shape *a, strides st, scratch w) {
    const ht_dtype dtype = k.dtype;
    const int64_t T = a->T, Dk = a->Dk, D = a->Dv, qs = st.qs, ks = st.ks;
    float *p = w.s, *dp = w.s2, *delta = w.acc;
    const operand q = head_operand(q32, T, Dk, qs, dtype, w.q), dout = head_operand(dout32, T, D, st.os, dtype, w.dout);
    const float scale = a->scale;
    for (int64_t i0 = 0; i0 < T; i0 += BQ) {
        int64_t bq = min64(BQ, T - i0), keys = seen_keys(a, i0 + bq - 1);
        if (keys == 0) { /* the block's keys are all after these queries: no share of their gradient */
            for (int64_t r = 0; r < bq; r++) memset(dq + (i0 + r) * qs, 0, (size_t)Dk * sizeof(float));
            continue;
        }
        /* delta_i = dO_i · O_i = Σ_j P_ij dP_ij, the softmax backward's row term,
         * from the dO the dP product reads: with dO rounded for it and delta
         * not, every dS row would be shifted by dO's rounding error · O_i, and
         * a shift common to a row is exactly what the softmax's gradient
         * cancels (a k bias's gradient, say, then carries it). */
        for (int64_t r = 0; r < bq; r++) {
            const float *o = out + (i0 + r) * st.os, *g = dout32 + (i0 + r) * st.os;
            if (dtype != HT_DTYPE_F32) {
                ht_convert(p, HT_DTYPE_F32, row_at(dout, i0 + r), dtype, (size_t)D); /* p: free until the tiles */
                g = p;
            }
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t c = 0; c < D; c++) dot += o[c] * g[c];
            delta[r] = dot;
        }
        for (int64_t j0 = 0; j0 < keys; j0 += BK) {
            int64_t bk = min64(BK, keys - j0);
            ht_gemm(false, true, bq, bk, Dk, scale, row_at(q, i0), q.ld, row_at(k, j0), k.ld, dtype, 0.0f, p, BK);
            for (int64_t r = 0; r < bq; r++) {
                float *row = p + r * BK, li = lse[i0 + r];
                int64_t valid = min64(bk, seen_keys(a, i0 + r) - j0);
#pragma omp simd
                for (int64_t c = 0; c < valid; c++) row[c] = exp_nonpositive(row[c] - li);
                for (int64_t c = valid < 0 ? 0 : valid; c < bk; c++) row[c] = 0.0f;
            }
            /* dV_j += Pᵀ dO_i;  dP = dO_i V_jᵀ;  dS = P ∘ (dP − delta). */
            operand pt = tile_operand(p, bq, bk, dtype, w.tile);
            ht_gemm(true, false, bk, D, bq, 1.0f, pt.p, pt.ld, row_at(dout, i0), dout.ld, dtype, 1.0f, dv + j0 * st.vs,
                    st.vs);
            ht_gemm(false, true, bq, bk, D, 1.0f, row_at(dout, i0), dout.ld, row_at(v, j0), v.ld, dtype, 0.0f, dp, BK);
            for (int64_t r = 0; r < bq; r++)
#pragma omp simd
                for (int64_t c = 0; c < bk; c++) dp[r * BK + c] = p[r * BK + c] * (dp[r * BK + c] - delta[r]);
            /* dQ_i += scale dS K_j;  dK_j += scale dSᵀ Q_i. */
            operand ds = tile_operand(dp, bq, bk, dtype, w.tile);
            ht_gemm(false, false, bq, Dk, bk, scale, ds.p, ds.ld, row_at(k, j0), k.ld, dtype, j0 == 0 ? 0.0f : 1.0f,
                    dq + i0 * qs, qs);
            ht_gemm(true, false, bk, Dk, bq, scale, ds.p, ds.ld, row_at(q, i0), q.ld, dtype, 1.0f, dk + j0 * ks, ks);
        }
    }
}

void ht_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                           const float *q, const float *k, const float *v, const ht_attention_shape *a, ht_dtype dtype,
                           float *work) {
    const int64_t B = a->B, T = a->T, Tk = keys_of(a), H = a->H, KV = a->KV, group = H / KV, Dk = a->Dk, Dv = a->Dv;
    const int64_t longest = T > Tk ? T : Tk;
    const strides st = strides_of(a);
    size_t per_thread = ht_attention_workspace_floats(longest, Dk, Dv);
    memset(dk, 0, (size_t)(B * Tk * st.ks) * sizeof(float));
    memset(dv, 0, (size_t)(B * Tk * st.vs) * sizeof(float));
    /* A task owns one key head, so the query heads sharing it add into its dk and dv without races. */
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
    for (int64_t b = 0; b < B; b++)
        for (int64_t g = 0; g < KV; g++) {
            scratch w = scratch_carve(work + (size_t)omp_get_thread_num() * per_thread, longest, Dk, Dv);
            const float *kb = k + b * Tk * st.ks + g * Dk, *vb = v + b * Tk * st.vs + g * Dv;
            operand ko = head_operand(kb, Tk, Dk, st.ks, dtype, w.k), vo = head_operand(vb, Tk, Dv, st.vs, dtype, w.v);
            for (int64_t h = g * group; h < (g + 1) * group; h++)
                backward_head(dq + b * T * st.qs + h * Dk, dk + b * Tk * st.ks + g * Dk, dv + b * Tk * st.vs + g * Dv,
                              dout + b * T * st.os + h * Dv, out + b * T * st.os + h * Dv, lse + (b * H + h) * T,
                              q + b * T * st.qs + h * Dk, ko, vo, a, st, w);
        }
}

void ht_attention_merge(float *out, float *lse, const float *out2, const float *lse2, int64_t B, int64_t T, int64_t H,
                        int64_t Dv) {
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                float *l1 = lse + (b * H + h) * T + t, l2 = lse2[(b * H + h) * T + t];
                const float mx = *l1 > l2 ? *l1 : l2;
                if (mx == -INFINITY) continue; /* neither block had a key for it */
                const float w1 = expf(*l1 - mx), w2 = expf(l2 - mx), sum = w1 + w2;
                float *o = out + ((b * T + t) * H + h) * Dv;
                const float *o2 = out2 + ((b * T + t) * H + h) * Dv;
                for (int64_t c = 0; c < Dv; c++) o[c] = (w1 * o[c] + w2 * o2[c]) / sum;
                *l1 = mx + logf(sum);
            }
}
