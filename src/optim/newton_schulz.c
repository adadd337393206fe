/* Newton-Schulz orthogonalization for Muon: the coefficient schedules and
 * their expansion into one (a, b, c) per iteration, and the iteration itself,
 * every product on ht_gemm with the scalings fused into its alpha and beta. */
#include "hypertrain/kernels.h"
#include "hypertrain/optim.h"
#include "kernels/ops.h"

#include <math.h>
#include <string.h>

#define NS_STEPS_KEY "optimizer.muon_config.muon_ns_steps"
#define NS_COEFFS_KEY "optimizer.muon_config.muon_ns_coefficients"

/* NUMERICS.md, Muon: the tables of coefficients. */
static const double LEGACY[3] = {3.4445, -4.7750, 2.0315};
static const double ASYM5[5][3] = {{4.0848, -6.8946, 2.9270},
                                   {3.9505, -6.3029, 2.6377},
                                   {3.7418, -5.5913, 2.3037},
                                   {2.8769, -3.1427, 1.2046},
                                   {2.8366, -3.0525, 1.2012}};
static const double POLAR_EXPRESS[5][3] = {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                                           {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                                           {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                                           {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                                           {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};
static const double DEEPSEEK_V4_TAIL[3] = {2.0, -1.5, 0.5};

static const char *const VARIANT_NAMES[HT_NS_VARIANT_COUNT] = {"legacy", "asym5", "polar_express", "deepseek_v4",
                                                               "custom"};

const char *ht_ns_variant_name(ht_ns_variant variant) {
    return variant >= 0 && variant < HT_NS_VARIANT_COUNT ? VARIANT_NAMES[variant] : "unknown";
}

bool ht_ns_variant_from_name(const char *name, ht_ns_variant *out) {
    for (int v = 0; v < HT_NS_VARIANT_COUNT; v++)
        if (strcmp(name, VARIANT_NAMES[v]) == 0) {
            *out = (ht_ns_variant)v;
            return true;
        }
    return false;
}

static void push(ht_ns_schedule *s, const double abc[3]) { memcpy(s->coeffs[s->steps++], abc, sizeof(s->coeffs[0])); }

static ht_status expand_custom(int ns_steps, const ht_ns_segment *segments, int count, ht_ns_schedule *out,
                               ht_error *err) {
    if (!segments || count < 1)
        return ht_fail(err, HT_ERR_CONFIG, "%s: expected coefficients with muon_ns_variant custom, found none",
                       NS_COEFFS_KEY);
    int64_t total = 0;
    for (int i = 0; i < count; i++) {
        const ht_ns_segment *seg = &segments[i];
        for (int j = 0; j < 3; j++)
            if (!isfinite(seg->abc[j]))
                return ht_fail(err, HT_ERR_CONFIG, "%s: segment %d has a non-finite coefficient (%g, %g, %g)",
                               NS_COEFFS_KEY, i, seg->abc[0], seg->abc[1], seg->abc[2]);
        /* repeat 0 is the flat [a, b, c] form, which only stands alone. */
        if (seg->repeat < 0 || (seg->repeat == 0 && count > 1))
            return ht_fail(err, HT_ERR_CONFIG, "%s: segment %d repeats %d times; expected >= 1 ([[a, b, c], n])",
                           NS_COEFFS_KEY, i, seg->repeat);
        total += seg->repeat == 0 ? ns_steps : seg->repeat;
    }
    if (total < ns_steps)
        return ht_fail(err, HT_ERR_CONFIG, "%s: the schedule has %lld iterations, shorter than %s = %d", NS_COEFFS_KEY,
                       (long long)total, NS_STEPS_KEY, ns_steps);
    if (total > HT_NS_MAX_STEPS)
        return ht_fail(err, HT_ERR_CONFIG, "%s: the schedule has %lld iterations; at most %d are supported",
                       NS_COEFFS_KEY, (long long)total, HT_NS_MAX_STEPS);
    for (int i = 0; i < count; i++) {
        int n = segments[i].repeat == 0 ? ns_steps : segments[i].repeat;
        for (int k = 0; k < n; k++) push(out, segments[i].abc);
    }
    return HT_OK;
}

ht_status ht_ns_schedule_expand(ht_ns_variant variant, int ns_steps, const ht_ns_segment *segments, int segment_count,
                                ht_ns_schedule *out, ht_error *err) {
    memset(out, 0, sizeof(*out));
    if (ns_steps < 1)
        return ht_fail(err, HT_ERR_CONFIG, "%s: expected an integer >= 1, found %d", NS_STEPS_KEY, ns_steps);
    if (ns_steps > HT_NS_MAX_STEPS && variant != HT_NS_DEEPSEEK_V4 && variant != HT_NS_CUSTOM)
        return ht_fail(err, HT_ERR_CONFIG, "%s: expected at most %d, found %d", NS_STEPS_KEY, HT_NS_MAX_STEPS,
                       ns_steps);
    switch (variant) {
    case HT_NS_LEGACY:
        for (int k = 0; k < ns_steps; k++) push(out, LEGACY);
        return HT_OK;
    case HT_NS_ASYM5:
        /* Five triples: a sixth iteration would silently be none (NUMERICS.md). */
        if (ns_steps > 5)
            return ht_fail(err, HT_ERR_CONFIG, "%s: expected at most 5 with muon_ns_variant asym5, found %d",
                           NS_STEPS_KEY, ns_steps);
        for (int k = 0; k < ns_steps; k++) push(out, ASYM5[k]);
        return HT_OK;
    case HT_NS_POLAR_EXPRESS:
        for (int k = 0; k < ns_steps; k++) push(out, POLAR_EXPRESS[k < 5 ? k : 4]);
        return HT_OK;
    case HT_NS_DEEPSEEK_V4:
        for (int k = 0; k < 8; k++) push(out, LEGACY);
        for (int k = 0; k < 2; k++) push(out, DEEPSEEK_V4_TAIL);
        return HT_OK;
    case HT_NS_CUSTOM: return expand_custom(ns_steps, segments, segment_count, out, err);
    default: return ht_fail(err, HT_ERR_CONFIG, "optimizer.muon_config.muon_ns_variant: unknown variant %d", variant);
    }
}

/* The iteration works on X (r, c) with r <= c: a wide G as it is, a tall one
 * through transposed products (S = XᵀX, X <- a X + X Tᵀ), which is the
 * transposed iteration of NUMERICS.md without copying Gᵀ. */
size_t ht_newton_schulz_workspace(int64_t rows, int64_t cols, ht_dtype ns_dtype) {
    size_t rc = (size_t)rows * (size_t)cols, r = (size_t)(rows < cols ? rows : cols);
    size_t floats = rc + 2 * r * r;                         /* X (the other ping-pong buffer is O), S, T */
    if (ns_dtype != HT_DTYPE_F32) floats += rc + 2 * r * r; /* X, S and T in ns_dtype (ht_gemm_storage) */
    return floats;
}

/* sum of squares in double (NUMERICS.md: the norm is accumulated in double). */
static double frobenius(const float *x, int64_t n) { return sqrt(ht_sum_squares(x, n)); }

/* The operand of a product in ns_dtype, stored as the chosen kernel takes it
 * (`storage`): x itself for F32, else its rounding to ns_dtype in `b`, as
 * 16-bit values or as FP32 values of that precision. */
static const void *operand(const float *x, float *b, int64_t n, ht_dtype ns_dtype, ht_dtype storage) {
    if (ns_dtype == HT_DTYPE_F32) return x;
    if (storage == HT_DTYPE_F32) {
        memcpy(b, x, (size_t)n * sizeof(float));
        ht_round_to(b, (size_t)n, ns_dtype);
    } else {
        ht_convert(b, storage, x, HT_DTYPE_F32, (size_t)n);
    }
    return b;
}

/* In place on the operand `b` that operand() made of x: b becomes x − b (the
 * part of x that rounding to ns_dtype dropped), itself rounded to ns_dtype. */
static void residual_operand(const float *x, void *b, int64_t n, ht_dtype ns_dtype, ht_dtype storage) {
    if (storage == HT_DTYPE_F32) {
        float *f = b;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) f[i] = x[i] - f[i];
        ht_round_to(f, (size_t)n, ns_dtype);
        return;
    }
    uint16_t *h = b;
    const bool bf16 = storage == HT_DTYPE_BF16;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float kept = bf16 ? ht_bf16_to_f32(h[i]) : ht_f16_to_f32(h[i]);
        h[i] = bf16 ? ht_f32_to_bf16(x[i] - kept) : ht_f32_to_f16(x[i] - kept);
    }
}

void ht_newton_schulz(const float *G, float *O, int64_t rows, int64_t cols, const ht_ns_schedule *sched, double eps,
                      ht_dtype ns_dtype, float *work) {
    const bool tall = rows > cols; /* NUMERICS.md transposes it so that r <= c */
    const int64_t r = tall ? cols : rows, n = rows * cols;
    const int K = sched->steps;
    float *S = work + n, *T = S + r * r; /* (r, r) each */
    float *Xb = T + r * r, *Sb = Xb + n, *Tb = Sb + r * r;
    const ht_dtype st = ht_gemm_storage(ns_dtype);

    /* X lives in O and `work` by turns, so that the last iteration lands in O. */
    float *X = K % 2 == 0 ? O : work, *Y = K % 2 == 0 ? work : O;
    const float inv = (float)(1.0 / (frobenius(G, n) + eps));
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) X[i] = G[i] * inv;

    for (int k = 0; k < K; k++) {
        const float a = (float)sched->coeffs[k][0], b = (float)sched->coeffs[k][1], c = (float)sched->coeffs[k][2];
        const void *x = operand(X, Xb, n, ns_dtype, st);
        /* S = X Xᵀ (wide) or XᵀX (tall): (r, r) */
        if (tall)
            ht_gemm(true, false, r, r, rows, 1.0f, x, cols, x, cols, st, 0.0f, S, r);
        else
            ht_gemm(false, true, r, r, cols, 1.0f, x, cols, x, cols, st, 0.0f, S, r);
        /* T = b S + c S S: S copied into T, scaled by beta. In a 16-bit
         * ns_dtype both terms take S rounded to it: the iteration is then one
         * polynomial of one matrix, whose contraction near singular value 1
         * damps the rounding; an FP32 S beside a rounded S·S leaves their
         * difference to be amplified by b (in a PyTorch emulation of this
         * iteration, 20% further from float64 on 48x160 to 96x96 matrices). */
        memcpy(T, S, (size_t)(r * r) * sizeof(float));
        if (ns_dtype != HT_DTYPE_F32) ht_round_to(T, (size_t)(r * r), ns_dtype);
        const void *s = operand(S, Sb, r * r, ns_dtype, st);
        ht_gemm(false, false, r, r, r, c, s, r, s, r, st, b, T, r);
        /* Y = a X + T X (wide) or a X + X Tᵀ (tall): X copied into Y, scaled by beta. */
        memcpy(Y, X, (size_t)n * sizeof(float));
        const void *t = operand(T, Tb, r * r, ns_dtype, st);
        if (tall)
            ht_gemm(false, true, rows, cols, cols, 1.0f, x, cols, t, cols, st, a, Y, cols);
        else
            ht_gemm(false, false, rows, cols, rows, 1.0f, t, rows, x, cols, st, a, Y, cols);
        /* In a 16-bit ns_dtype, a X takes the FP32 X but T X its rounding x:
         * the difference X − x is not contracted like the rest and, carried
         * by a, dominates the error. One more product, T (X − x), gives back
         * its first-order part (the residual itself rounded: a 2^-9 error of
         * a 2^-9 quantity). With both changes, measured on gradient-sized
         * matrices: 1.1-6x closer to float64 than before, and closer than
         * torch's bf16 iteration on each (tests/test_muon.c,
         * bench/RESULTS.md), for one product in four more. */
        if (ns_dtype != HT_DTYPE_F32) {
            residual_operand(X, Xb, n, ns_dtype, st);
            if (tall)
                ht_gemm(false, true, rows, cols, cols, 1.0f, Xb, cols, t, cols, st, 1.0f, Y, cols);
            else
                ht_gemm(false, false, rows, cols, rows, 1.0f, t, rows, Xb, cols, st, 1.0f, Y, cols);
        }
        float *swap = X;
        X = Y;
        Y = swap;
    }
}
