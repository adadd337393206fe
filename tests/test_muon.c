/* Muon against the references of tools/reference/make_muon_fixtures.py:
 * torch.optim.Muon (FP32 Newton-Schulz) for 10 steps, a Megatron-style
 * bf16-model / FP32-master run with the sum momentum, and Newton-Schulz alone
 * for every schedule in float64; plus the schedule expansion and its errors,
 * the scale rules, 3-D params and the params Muon must refuse. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/optim.h"

#define STEPS 10
#define STRIDE 32
#define NPARAMS 4
static const char *const NAMES[NPARAMS] = {"square", "wide", "tall", "experts"};

static const ht_st_tensor *tensor(const ht_safetensors *st, const char *fmt, const char *name) {
    char key[128];
    snprintf(key, sizeof(key), fmt, name);
    const ht_st_tensor *t = ht_safetensors_find(st, key);
    if (!t) fail_msg("fixture has no tensor %s", key);
    return t;
}

static ht_muon_config base_config(ht_ns_variant variant, ht_muon_momentum_style style, bool nesterov, double rms) {
    ht_muon_config c = {.lr = 0.02,
                        .weight_decay = 0.1,
                        .momentum = 0.95,
                        .nesterov = nesterov,
                        .momentum_style = style,
                        .ns_eps = 1e-7,
                        .matched_adamw_rms = rms,
                        .ns_dtype = HT_DTYPE_F32};
    ht_error err;
    assert_ht_ok(ht_ns_schedule_expand(variant, 5, NULL, 0, &c.schedule, &err), &err);
    return c;
}

/* The fixture's four params in `dtype`, from init.<p>, with FP32 masters. */
static void make_params(const ht_safetensors *st, ht_dtype dtype, ht_param_store *store, ht_param **params) {
    ht_error err;
    memset(store, 0, sizeof(*store));
    for (int i = 0; i < NPARAMS; i++) {
        const ht_st_tensor *t = tensor(st, "init.%s", NAMES[i]);
        params[i] = ht_params_add(store, NAMES[i], t->ndim, t->shape, dtype);
    }
    assert_ht_ok(ht_params_allocate(store, &err), &err);
    for (int i = 0; i < NPARAMS; i++) {
        params[i] = ht_params_find(store, NAMES[i]); /* the array may have moved */
        const ht_st_tensor *t = tensor(st, "init.%s", NAMES[i]);
        ht_convert(params[i]->data, dtype, t->data, t->dtype, (size_t)ht_param_numel(params[i]));
    }
    assert_ht_ok(ht_params_create_main(store, HT_MAIN_COPY, &err), &err);
}

static void load_grads(const ht_safetensors *st, ht_param **params, int t) {
    for (int i = 0; i < NPARAMS; i++) {
        const ht_st_tensor *g = tensor(st, "grad.%s", NAMES[i]);
        size_t n = (size_t)ht_param_numel(params[i]);
        ht_convert(params[i]->main_grad, HT_DTYPE_F32, (const uint16_t *)g->data + (size_t)t * n, g->dtype, n);
    }
}

/* x at the flat indices the fixture samples after step t (1-based), as F32. */
static size_t gather(const void *x, ht_dtype dtype, size_t n, int t, float *out) {
    size_t k = 0;
    for (size_t i = (size_t)(7 * t) % STRIDE; i < n; i += STRIDE, k++)
        ht_convert(&out[k], HT_DTYPE_F32, (const char *)x + i * ht_dtype_size(dtype), dtype, 1);
    return k;
}

/* rel_max_err of our sampled x against row t-1 of the fixture's samples. */
static double sample_err(const ht_safetensors *st, const char *fmt, const char *name, const void *x, ht_dtype dtype,
                         size_t n, int t) {
    float got[4096], want[4096];
    size_t k = gather(x, dtype, n, t, got);
    const ht_st_tensor *ref = tensor(st, fmt, name);
    assert_int_equal(ref->shape[1], k);
    ht_convert(want, HT_DTYPE_F32, (const char *)ref->data + (size_t)(t - 1) * k * ht_dtype_size(ref->dtype),
               ref->dtype, k);
    return rel_max_err(got, want, k);
}

static double final_err(const ht_safetensors *st, const char *fmt, const char *name, const float *x, size_t n) {
    const ht_st_tensor *ref = tensor(st, fmt, name);
    assert_int_equal(ref->nbytes, n * sizeof(float));
    return rel_max_err(x, ref->data, n);
}

/* 10 steps of `cfg` against run `run` of muon_steps.safetensors: params and
 * momentum at every step (sampled), every element after the last. */
static void check_run(const char *run, const char *momentum, ht_muon_config cfg) {
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/muon_steps.safetensors"), &st, &err), &err);
    const float *lr = tensor(st, "%s", "lr")->data;
    ht_param_store store;
    ht_param *params[NPARAMS];
    make_params(st, HT_DTYPE_F32, &store, params);
    ht_muon opt;
    assert_ht_ok(ht_muon_init(&opt, &cfg, params, NPARAMS, &err), &err);
    char pfmt[64], mfmt[64];
    snprintf(pfmt, sizeof(pfmt), "%s.sample.%%s", run);
    snprintf(mfmt, sizeof(mfmt), "%s.sample.%%s", momentum);
    double worst_p = 0, worst_m = 0;
    for (int t = 1; t <= STEPS; t++) {
        load_grads(st, params, t - 1);
        ht_muon_step(&opt, lr[t - 1]);
        for (int i = 0; i < NPARAMS; i++) {
            size_t n = (size_t)ht_param_numel(params[i]);
            double ep = sample_err(st, pfmt, NAMES[i], params[i]->main_param, HT_DTYPE_F32, n, t);
            double em = sample_err(st, mfmt, NAMES[i], opt.slots[i].momentum_buffer, HT_DTYPE_F32, n, t);
            if (ep > 1e-6 || em > 1e-6)
                fail_msg("%s step %d %s: param err %.3g, momentum err %.3g (limit 1e-6)", run, t, NAMES[i], ep, em);
            worst_p = fmax(worst_p, ep);
            worst_m = fmax(worst_m, em);
        }
    }
    snprintf(pfmt, sizeof(pfmt), "%s.final.%%s", run);
    double worst_f = 0;
    for (int i = 0; i < NPARAMS; i++) {
        double e = final_err(st, pfmt, NAMES[i], params[i]->main_param, (size_t)ht_param_numel(params[i]));
        if (e > 1e-6) fail_msg("%s final %s: err %.3g (limit 1e-6)", run, NAMES[i], e);
        worst_f = fmax(worst_f, e);
        assert_int_equal(opt.slots[i].step, STEPS);
    }
    printf("%s: max rel err per step %.3g (params), %.3g (momentum); final params %.3g\n", run, worst_p, worst_m,
           worst_f);
    ht_muon_free(&opt);
    ht_params_free(&store);
    ht_safetensors_close(st);
}

/* (a) torch.optim.Muon: ema momentum, legacy coefficients, both scale rules. */
static void test_torch_original_nesterov(void **state) {
    (void)state;
    check_run("torch_original", "momentum_ema", base_config(HT_NS_LEGACY, HT_MUON_MOMENTUM_EMA, true, 0.0));
}

static void test_torch_match_rms_plain(void **state) {
    (void)state;
    check_run("torch_rms_plain", "momentum_ema", base_config(HT_NS_LEGACY, HT_MUON_MOMENTUM_EMA, false, 0.2));
}

/* bf16 x equals bf16(ref), or ref sits within tol of a bf16 rounding boundary
 * (docs/NUMERICS.md, reference tolerances): returns false on a real mismatch. */
static bool bf16_matches(uint16_t x, uint16_t ref_bf16, float ref_master, float tol) {
    if (x == ref_bf16) return true;
    return ht_f32_to_bf16(ref_master - tol) != ht_f32_to_bf16(ref_master + tol);
}

/* (b) bf16 model params with FP32 masters, sum momentum, asym5, rms 0.2. */
static void test_bf16_master_sum(void **state) {
    (void)state;
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/muon_steps.safetensors"), &st, &err), &err);
    const float *lr = tensor(st, "%s", "lr")->data;
    ht_param_store store;
    ht_param *params[NPARAMS];
    make_params(st, HT_DTYPE_BF16, &store, params);
    ht_muon_config cfg = base_config(HT_NS_ASYM5, HT_MUON_MOMENTUM_SUM, true, 0.2);
    ht_muon opt;
    assert_ht_ok(ht_muon_init(&opt, &cfg, params, NPARAMS, &err), &err);
    double worst = 0, worst_m = 0;
    int boundary = 0;
    for (int t = 1; t <= STEPS; t++) {
        load_grads(st, params, t - 1);
        ht_muon_step(&opt, lr[t - 1]);
        for (int i = 0; i < NPARAMS; i++) {
            ht_param *p = params[i];
            size_t n = (size_t)ht_param_numel(p);
            double e = sample_err(st, "master_sum.sample.%s", NAMES[i], p->main_param, HT_DTYPE_F32, n, t);
            double em =
                sample_err(st, "momentum_sum.sample.%s", NAMES[i], opt.slots[i].momentum_buffer, HT_DTYPE_F32, n, t);
            if (e > 1e-6 || em > 1e-6)
                fail_msg("step %d %s: master err %.3g, momentum err %.3g (limit 1e-6)", t, NAMES[i], e, em);
            worst = fmax(worst, e);
            worst_m = fmax(worst_m, em);
            /* The fused cast: every model element is the rounding of its master. */
            const uint16_t *model = p->data;
            for (size_t j = 0; j < n; j++)
                if (model[j] != ht_f32_to_bf16(p->main_param[j]))
                    fail_msg("step %d %s[%zu]: model bf16 0x%04x is not bf16(master %a)", t, NAMES[i], j, model[j],
                             (double)p->main_param[j]);
            /* ... and equals the reference's model params. */
            float got[4096], ref_master[4096];
            uint16_t ref_model[4096];
            size_t k = gather(p->data, HT_DTYPE_BF16, n, t, got);
            const ht_st_tensor *rm = tensor(st, "model_bf16.sample.%s", NAMES[i]);
            const ht_st_tensor *rp = tensor(st, "master_sum.sample.%s", NAMES[i]);
            memcpy(ref_model, (const uint16_t *)rm->data + (size_t)(t - 1) * k, k * 2);
            memcpy(ref_master, (const float *)rp->data + (size_t)(t - 1) * k, k * 4);
            float tol = 1e-6f * (float)fabs(ref_master[0]);
            for (size_t j = 0; j < k; j++) tol = fmaxf(tol, 1e-6f * fabsf(ref_master[j]));
            for (size_t j = 0; j < k; j++) {
                uint16_t x = ht_f32_to_bf16(got[j]);
                if (!bf16_matches(x, ref_model[j], ref_master[j], tol))
                    fail_msg("step %d %s sample %zu: bf16 0x%04x, reference 0x%04x", t, NAMES[i], j, x, ref_model[j]);
                boundary += x != ref_model[j];
            }
        }
    }
    double worst_f = 0;
    for (int i = 0; i < NPARAMS; i++) {
        ht_param *p = params[i];
        size_t n = (size_t)ht_param_numel(p);
        double e = final_err(st, "master_sum.final.%s", NAMES[i], p->main_param, n);
        if (e > 1e-6) fail_msg("final %s: master err %.3g (limit 1e-6)", NAMES[i], e);
        worst_f = fmax(worst_f, e);
        const uint16_t *ref_model = tensor(st, "model_bf16.final.%s", NAMES[i])->data;
        const float *ref_master = tensor(st, "master_sum.final.%s", NAMES[i])->data;
        float maxabs = 0;
        for (size_t j = 0; j < n; j++) maxabs = fmaxf(maxabs, fabsf(ref_master[j]));
        const uint16_t *model = p->data;
        for (size_t j = 0; j < n; j++) {
            if (!bf16_matches(model[j], ref_model[j], ref_master[j], 1e-6f * maxabs))
                fail_msg("final %s[%zu]: bf16 0x%04x, reference 0x%04x", NAMES[i], j, model[j], ref_model[j]);
            boundary += model[j] != ref_model[j];
        }
    }
    printf("bf16/FP32 master: max rel err per step %.3g (master), %.3g (momentum); final master %.3g; "
           "bf16 model params differing from the reference's (rounding-boundary cases): %d\n",
           worst, worst_m, worst_f, boundary);
    ht_muon_free(&opt);
    ht_params_free(&store);
    ht_safetensors_close(st);
}

/* ---------------------------------------------------------------- Newton-Schulz */

typedef struct ns_case {
    const char *name;
    ht_ns_variant variant;
    int ns_steps;
    ht_ns_segment segments[2];
    int segment_count;
} ns_case;

static const ns_case NS_CASES[] = {
    {"legacy", HT_NS_LEGACY, 5, {{{0}, 0}}, 0},
    {"asym5", HT_NS_ASYM5, 5, {{{0}, 0}}, 0},
    {"polar_express", HT_NS_POLAR_EXPRESS, 7, {{{0}, 0}}, 0},
    {"deepseek_v4", HT_NS_DEEPSEEK_V4, 5, {{{0}, 0}}, 0},
    {"custom", HT_NS_CUSTOM, 4, {{{3.0, -3.2, 1.2}, 0}}, 1},
    {"segmented", HT_NS_CUSTOM, 5, {{{4.0848, -6.8946, 2.9270}, 2}, {{2.0, -1.5, 0.5}, 3}}, 2},
};
static const char *const NS_MATS[] = {"wide", "tall", "square"};

/* FP32 Newton-Schulz against float64 for every schedule, and each expanded
 * schedule against the script's. Each product rounds to FP32 (2^-24 relative
 * per term, sums of <= 24 terms) and each iteration multiplies what enters it
 * by at most the polynomial's slope (|a| + 3|b| + 5|c| at singular value 1:
 * ~30 for polar_express's first triple, 5-10 for the others), damped near the
 * fixed point: 1e-5 of the largest entry (docs/NUMERICS.md's FP32-vs-float64
 * tolerance) leaves room. Measured 0.7e-6 to 3.7e-6. A batch of three copies
 * gives each copy the one matrix's result bit for bit: the batched products
 * are the same products. */
static void test_newton_schulz_schedules(void **state) {
    (void)state;
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/muon_ns.safetensors"), &st, &err), &err);
    for (size_t c = 0; c < sizeof(NS_CASES) / sizeof(NS_CASES[0]); c++) {
        const ns_case *nc = &NS_CASES[c];
        ht_ns_schedule sched;
        assert_ht_ok(ht_ns_schedule_expand(nc->variant, nc->ns_steps, nc->segments, nc->segment_count, &sched, &err),
                     &err);
        const ht_st_tensor *coeffs = tensor(st, "%s.coeffs", nc->name);
        assert_int_equal(sched.steps, coeffs->shape[0]);
        assert_memory_equal(sched.coeffs, coeffs->data, (size_t)sched.steps * 3 * sizeof(double));
        double worst = 0;
        for (size_t m = 0; m < 3; m++) {
            const ht_st_tensor *in = tensor(st, "input.%s", NS_MATS[m]);
            char key[64];
            snprintf(key, sizeof(key), "%s.%%s", nc->name);
            int64_t rows = in->shape[0], cols = in->shape[1], n = rows * cols;
            float *out = malloc((size_t)n * sizeof(float));
            float *work = ht_alloc(ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_F32) * sizeof(float));
            ht_newton_schulz(in->data, out, rows, cols, &sched, 1e-7, HT_DTYPE_F32, work);
            double e = final_err(st, key, NS_MATS[m], out, (size_t)n);
            if (e > 1e-5) fail_msg("NS %s on %s: err %.3g (limit 1e-5)", nc->name, NS_MATS[m], e);
            worst = fmax(worst, e);
            float *copies = malloc(3 * (size_t)n * sizeof(float));
            float *work3 = ht_alloc(3 * ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_F32) * sizeof(float));
            for (int k = 0; k < 3; k++) memcpy(copies + k * n, in->data, (size_t)n * sizeof(float));
            ht_newton_schulz_batch(copies, copies, 3, rows, cols, &sched, 1e-7, HT_DTYPE_F32, work3);
            for (int k = 0; k < 3; k++)
                if (memcmp(copies + k * n, out, (size_t)n * sizeof(float)) != 0)
                    fail_msg("NS %s on %s: copy %d of a batch differs from the matrix alone", nc->name, NS_MATS[m], k);
            free(copies);
            ht_free(work3);
            free(out);
            ht_free(work);
        }
        printf("Newton-Schulz %-13s (K = %2d) vs float64: max rel err %.3g\n", nc->name, sched.steps, worst);
    }
    ht_safetensors_close(st);
}

/* The iteration in float64, written out (docs/NUMERICS.md): X = G / (|G| + eps)
 * with r <= c (a tall G transposed), then X <- a X + (b A + c A A) X with
 * A = X Xᵀ, every product whole. Returns X in G's orientation. */
static double *ns_float64(const float *G, int64_t rows, int64_t cols, const ht_ns_schedule *sched, double eps) {
    const bool tall = rows > cols;
    const int64_t r = tall ? cols : rows, c = tall ? rows : cols;
    double *X = calloc((size_t)(r * c), sizeof(double)), *A = calloc((size_t)(r * r), sizeof(double));
    double *B = calloc((size_t)(r * r), sizeof(double)), *Y = calloc((size_t)(r * c), sizeof(double));
    double norm = 0;
    for (int64_t i = 0; i < rows * cols; i++) norm += (double)G[i] * G[i];
    norm = sqrt(norm) + eps;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) X[tall ? j * c + i : i * c + j] = G[i * cols + j] / norm;
    for (int k = 0; k < sched->steps; k++) {
        const double a = sched->coeffs[k][0], b = sched->coeffs[k][1], cc = sched->coeffs[k][2];
        for (int64_t i = 0; i < r; i++)
            for (int64_t j = 0; j < r; j++) {
                double sum = 0;
                for (int64_t l = 0; l < c; l++) sum += X[i * c + l] * X[j * c + l];
                A[i * r + j] = sum;
            }
        for (int64_t i = 0; i < r; i++)
            for (int64_t j = 0; j < r; j++) {
                double sum = 0;
                for (int64_t l = 0; l < r; l++) sum += A[i * r + l] * A[l * r + j];
                B[i * r + j] = b * A[i * r + j] + cc * sum;
            }
        for (int64_t i = 0; i < r; i++) {
            double *y = Y + i * c;
            for (int64_t j = 0; j < c; j++) y[j] = a * X[i * c + j];
            for (int64_t l = 0; l < r; l++)
                for (int64_t j = 0; j < c; j++) y[j] += B[i * r + l] * X[l * c + j];
        }
        double *t = X;
        X = Y;
        Y = t;
    }
    double *out = malloc((size_t)(r * c) * sizeof(double));
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) out[i * cols + j] = X[tall ? j * c + i : i * c + j];
    free(X);
    free(Y);
    free(A);
    free(B);
    return out;
}

/* Matrices of 256 rows (of X) and more take the symmetric products, S = X Xᵀ
 * and S S, panel by panel over the upper triangle, mirrored below (ragged
 * last panels here: 272 and 300 rows in panels of 48). Against the float64
 * iteration with whole products: within test_newton_schulz_schedules' 1e-5
 * in FP32 (a missing mirror or a panel one row off is O(1) away), within
 * check_newton_schulz_bf16's 5e-2 with bf16 operands; a batch of two gives
 * each the matrix's own bits in FP32. */
static void test_newton_schulz_symmetric_products(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{272, 400}, {400, 272}, {300, 300}};
    ht_error err;
    ht_ns_schedule sched;
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_ASYM5, 5, NULL, 0, &sched, &err), &err);
    for (size_t m = 0; m < sizeof(shapes) / sizeof(shapes[0]); m++) {
        const int64_t rows = shapes[m][0], cols = shapes[m][1], n = rows * cols;
        float *g = malloc(2 * (size_t)n * sizeof(float)), *out = malloc(2 * (size_t)n * sizeof(float));
        ht_random_normal(g, n, 7 + m, 0, 1.0f);
        memcpy(g + n, g, (size_t)n * sizeof(float));
        double *ref = ns_float64(g, rows, cols, &sched, 1e-7);
        float *ref32 = malloc((size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++) ref32[i] = (float)ref[i];
        float *work = ht_alloc(2 * ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_BF16) * sizeof(float));
        ht_newton_schulz(g, out, rows, cols, &sched, 1e-7, HT_DTYPE_F32, work);
        const double e32 = rel_max_err(out, ref32, (size_t)n);
        ht_newton_schulz_batch(g, out, 2, rows, cols, &sched, 1e-7, HT_DTYPE_F32, work);
        const double batch = fmax(rel_max_err(out, ref32, (size_t)n), rel_max_err(out + n, ref32, (size_t)n));
        assert_memory_equal(out, out + n, (size_t)n * sizeof(float));
        ht_newton_schulz(g, out, rows, cols, &sched, 1e-7, HT_DTYPE_BF16, work);
        const double e16 = rel_max_err(out, ref32, (size_t)n);
        printf("  %3lld x %3lld: Newton-Schulz with symmetric products %.3g from float64 (FP32), %.3g batched, "
               "%.3g with bf16 operands\n",
               (long long)rows, (long long)cols, e32, batch, e16);
        if (e32 > 1e-5 || batch > 1e-5 || e16 > 5e-2)
            fail_msg("%lld x %lld: %.3g / %.3g batched (limit 1e-5), %.3g bf16 (limit 5e-2) from float64",
                     (long long)rows, (long long)cols, e32, batch, e16);
        free(g);
        free(out);
        free(ref);
        free(ref32);
        ht_free(work);
    }
}

/* muon_ns_form gram: the iteration on (r, r) Gram matrices, X formed again
 * every three iterations (kernels/cpu/optim.c). On wide and tall matrices where
 * it takes fewer multiply-adds, against the float64 iteration (the standard
 * form, whole products), for three schedules (deepseek_v4's ten iterations
 * cross three blocks), on random matrices (a flat spectrum) and
 * gradient-like ones (rank 16 plus 10% noise): within docs/NUMERICS.md's
 * rule, max(GRAM_LIMIT, 2 x the floor), the floor being FP32's own: the
 * standard form's largest distance from float64 over these shapes, for the
 * schedule and kind of matrix (the standard form itself is up to 2.1e-5
 * away on the gradient-like ones; measured, the Gram form at most 2.3x the
 * standard form's distance on one matrix, at most 1.02x its largest); a batch of two
 * gives each matrix its own bits. Where the Gram form does not pay (a
 * square matrix) the result is the standard form's, bit for bit. */
#define GRAM_LIMIT 1e-5
static void test_newton_schulz_gram_form(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{48, 160}, {160, 48}, {272, 1100}, {1100, 272}, {300, 300}};
    static const ht_ns_variant variants[] = {HT_NS_ASYM5, HT_NS_POLAR_EXPRESS, HT_NS_DEEPSEEK_V4};
    enum { SHAPES = sizeof(shapes) / sizeof(shapes[0]) };
    double e_gram[3][SHAPES][2], e_standard[3][SHAPES][2];
    ht_error err;
    for (size_t v = 0; v < sizeof(variants) / sizeof(variants[0]); v++) {
        ht_ns_schedule standard, gram;
        assert_ht_ok(ht_ns_schedule_expand(variants[v], 5, NULL, 0, &standard, &err), &err);
        gram = standard;
        gram.form = HT_NS_FORM_GRAM;
        for (size_t m = 0; m < sizeof(shapes) / sizeof(shapes[0]); m++) {
            for (int low_rank = 0; low_rank < 2; low_rank++) {
                const int64_t rows = shapes[m][0], cols = shapes[m][1], n = rows * cols;
                float *g = malloc(2 * (size_t)n * sizeof(float)), *out = malloc(2 * (size_t)n * sizeof(float));
                float *plain = malloc((size_t)n * sizeof(float));
                ht_random_normal(g, n, 11 + m, 0, low_rank ? 0.1f : 1.0f);
                if (low_rank) { /* + U V, U (rows, 16), V (16, cols) */
                    float *u = malloc((size_t)(rows + cols) * 16 * sizeof(float)), *w = u + rows * 16;
                    ht_random_normal(u, (rows + cols) * 16, 23 + m, 0, 1.0f);
                    for (int64_t i = 0; i < rows; i++)
                        for (int k = 0; k < 16; k++)
                            for (int64_t j = 0; j < cols; j++) g[i * cols + j] += u[i * 16 + k] * w[k * cols + j];
                    free(u);
                }
                memcpy(g + n, g, (size_t)n * sizeof(float));
                double *ref = ns_float64(g, rows, cols, &standard, 1e-7);
                float *ref32 = malloc((size_t)n * sizeof(float));
                for (int64_t i = 0; i < n; i++) ref32[i] = (float)ref[i];
                float *work = ht_alloc(2 * ht_newton_schulz_workspace(rows, cols, &gram, HT_DTYPE_F32) * sizeof(float));
                ht_newton_schulz(g, plain, rows, cols, &standard, 1e-7, HT_DTYPE_F32, work);
                ht_newton_schulz(g, out, rows, cols, &gram, 1e-7, HT_DTYPE_F32, work);
                const double e_std = rel_max_err(plain, ref32, (size_t)n), e = rel_max_err(out, ref32, (size_t)n);
                const bool same = memcmp(out, plain, (size_t)n * sizeof(float)) == 0;
                printf("  %-13s %4lld x %4lld %s: Gram form %.3g from float64%s, the standard form %.3g\n",
                       ht_ns_variant_name(variants[v]), (long long)rows, (long long)cols,
                       low_rank ? "gradient-like" : "random       ", e, same ? " (the standard form's bits)" : "",
                       e_std);
                e_gram[v][m][low_rank] = e;
                e_standard[v][m][low_rank] = e_std;
                if ((rows == cols) != same)
                    fail_msg("%lld x %lld: the Gram form %s the standard form's bits", (long long)rows, (long long)cols,
                             same ? "gave" : "did not give");
                ht_newton_schulz_batch(g, g, 2, rows, cols, &gram, 1e-7, HT_DTYPE_F32, work);
                assert_memory_equal(g, out, (size_t)n * sizeof(float));
                assert_memory_equal(g + n, out, (size_t)n * sizeof(float));
                free(g);
                free(out);
                free(plain);
                free(ref);
                free(ref32);
                ht_free(work);
            }
        }
    }
    for (size_t v = 0; v < sizeof(variants) / sizeof(variants[0]); v++)
        for (int kind = 0; kind < 2; kind++) {
            double floor = 0;
            for (int m = 0; m < SHAPES; m++) floor = fmax(floor, e_standard[v][m][kind]);
            const double limit = fmax(GRAM_LIMIT, 2 * floor);
            for (int m = 0; m < SHAPES; m++)
                if (e_gram[v][m][kind] > limit)
                    fail_msg("%s %lld x %lld: the Gram form is %.3g from float64 (limit %.3g)",
                             ht_ns_variant_name(variants[v]), (long long)shapes[m][0], (long long)shapes[m][1],
                             e_gram[v][m][kind], limit);
        }
}

/* ns_dtype BF16: the operands of each product rounded to bf16 (8 significant
 * bits, <= 2^-9 relative), FP32 accumulation. Near singular value 1 the
 * iteration contracts what rounding adds, so errors do not compound over the
 * iterations; what remains is a few bf16 ulps of the largest entry, each
 * multiplied by the polynomial's slope. The bound, 5e-2 relative to the
 * largest entry, is the one torch.optim.Muon itself lives with: its stock
 * all-bf16 Newton-Schulz lands 0.9e-2, 1.2e-2 and 6.7e-2 from float64 on
 * these three matrices (asym5); this path measured 0.59e-2, 0.85e-2, 0.97e-2
 * (2.0e-2, 2.5e-2, 1.5e-2 before S entered both terms of T rounded alike and
 * the residual product T (X − x) was added).
 * It runs in place (O = G) too, on every GEMM kernel this machine offers,
 * and in a batch of two copies, each within the same bound. A batch may
 * differ from one matrix by bf16 rounding flips: oneDNN can run a batched
 * product on another kernel (AMX where one small product runs on
 * AVX512-BF16), which sums in another order. */
static void check_newton_schulz_bf16(void) {
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/muon_ns.safetensors"), &st, &err), &err);
    ht_ns_schedule sched;
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_ASYM5, 5, NULL, 0, &sched, &err), &err);
    double worst = 0, worst32 = 0;
    for (size_t m = 0; m < 3; m++) {
        const ht_st_tensor *in = tensor(st, "input.%s", NS_MATS[m]);
        int64_t rows = in->shape[0], cols = in->shape[1], n = rows * cols;
        float *x = malloc((size_t)n * sizeof(float)), *x32 = malloc((size_t)n * sizeof(float));
        float *work = ht_alloc(ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_BF16) * sizeof(float));
        memcpy(x, in->data, (size_t)n * sizeof(float));
        ht_newton_schulz(x, x, rows, cols, &sched, 1e-7, HT_DTYPE_BF16, work);
        ht_newton_schulz(in->data, x32, rows, cols, &sched, 1e-7, HT_DTYPE_F32, work);
        double e = final_err(st, "asym5.%s", NS_MATS[m], x, (size_t)n);
        printf("  %-6s bf16 Newton-Schulz %.3g from float64\n", NS_MATS[m], e);
        if (e > 5e-2) fail_msg("bf16 NS on %s: err %.3g vs float64 (limit 5e-2)", NS_MATS[m], e);
        worst = fmax(worst, e);
        float *pair = malloc(2 * (size_t)n * sizeof(float));
        float *work2 = ht_alloc(2 * ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_BF16) * sizeof(float));
        for (int k = 0; k < 2; k++) memcpy(pair + k * n, in->data, (size_t)n * sizeof(float));
        ht_newton_schulz_batch(pair, pair, 2, rows, cols, &sched, 1e-7, HT_DTYPE_BF16, work2);
        for (int k = 0; k < 2; k++) {
            double eb = final_err(st, "asym5.%s", NS_MATS[m], pair + k * n, (size_t)n);
            if (eb > 5e-2) fail_msg("bf16 NS batch on %s: err %.3g vs float64 (limit 5e-2)", NS_MATS[m], eb);
            worst = fmax(worst, eb);
        }
        free(pair);
        ht_free(work2);
        worst32 = fmax(worst32, rel_max_err(x, x32, (size_t)n));
        free(x);
        free(x32);
        ht_free(work);
    }
    printf("Newton-Schulz bf16 operands (asym5, %s kernel): max rel err %.3g vs float64, %.3g vs the FP32 path\n",
           ht_gemm_kernel_label(ht_kernels_gemm_kernel(HT_DTYPE_BF16)), worst, worst32);
    assert_true(worst32 > 0 && worst32 < 5e-2); /* it did round, within the bound of the FP32 path too */
    ht_safetensors_close(st);
}

/* At least as accurate as torch.optim.Muon's own bf16 Newton-Schulz, on
 * gradient-sized matrices (muon_ns_bf16.safetensors, written by
 * tools/reference/make_ns_bf16_fixtures.py): per matrix, the distance from
 * the float64 iteration is no larger than torch's. torch keeps X in bf16
 * between steps, so every step's rounding of X is then multiplied by a; here
 * X stays FP32 and only the operands of each product are rounded. */
/* The matrices of muon_ns_bf16.safetensors. */
static const char *const BF16_FIXTURES[] = {"gauss_48x160",   "gauss_160x48",   "gauss_96x96",
                                            "lowrank_48x160", "lowrank_160x48", "lowrank_96x96"};

static void check_newton_schulz_bf16_against_torch(void) {
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/muon_ns_bf16.safetensors"), &st, &err), &err);
    ht_ns_schedule sched;
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_ASYM5, 5, NULL, 0, &sched, &err), &err);
    double ours_sum = 0, torch_sum = 0;
    for (size_t m = 0; m < sizeof(BF16_FIXTURES) / sizeof(BF16_FIXTURES[0]); m++) {
        const ht_st_tensor *in = tensor(st, "input.%s", BF16_FIXTURES[m]);
        int64_t rows = in->shape[0], cols = in->shape[1], n = rows * cols;
        float *x = malloc((size_t)n * sizeof(float));
        float *work = ht_alloc(ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_BF16) * sizeof(float));
        ht_newton_schulz(in->data, x, rows, cols, &sched, 1e-7, HT_DTYPE_BF16, work);
        double ours = final_err(st, "f64.%s", BF16_FIXTURES[m], x, (size_t)n);
        double theirs = rel_max_err(tensor(st, "torch.%s", BF16_FIXTURES[m])->data,
                                    tensor(st, "f64.%s", BF16_FIXTURES[m])->data, (size_t)n);
        printf("  %-15s bf16 Newton-Schulz %.3g from float64, torch's %.3g\n", BF16_FIXTURES[m], ours, theirs);
        if (!(ours <= theirs))
            fail_msg("%s: %.3g from float64, torch's bf16 iteration %.3g", BF16_FIXTURES[m], ours, theirs);
        /* and each matrix of a batch of two copies (check_newton_schulz_bf16 says why it may differ) */
        float *pair = malloc(2 * (size_t)n * sizeof(float));
        float *work2 = ht_alloc(2 * ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_BF16) * sizeof(float));
        for (int k = 0; k < 2; k++) memcpy(pair + k * n, in->data, (size_t)n * sizeof(float));
        ht_newton_schulz_batch(pair, pair, 2, rows, cols, &sched, 1e-7, HT_DTYPE_BF16, work2);
        for (int k = 0; k < 2; k++) {
            double ob = final_err(st, "f64.%s", BF16_FIXTURES[m], pair + k * n, (size_t)n);
            if (!(ob <= theirs))
                fail_msg("%s batched: %.3g from float64, torch's bf16 iteration %.3g", BF16_FIXTURES[m], ob, theirs);
        }
        free(pair);
        ht_free(work2);
        ours_sum += ours;
        torch_sum += theirs;
        free(x);
        ht_free(work);
    }
    printf("bf16 Newton-Schulz (%s kernel): mean %.3g from float64, torch's %.3g\n",
           ht_gemm_kernel_label(ht_kernels_gemm_kernel(HT_DTYPE_BF16)), ours_sum / 6, torch_sum / 6);
    ht_safetensors_close(st);
}

/* muon_ns_form torch: torch.optim.Muon's own bf16 iteration (X, S and T
 * held in bf16, each product with its scaled sum rounded once, as its addmm
 * calls round) against torch's results in muon_ns_bf16.safetensors: the
 * elements equal bit for bit but those a product's summation order (the
 * kernel's blocking against torch's) tips to the neighbouring bf16 value,
 * which the iteration then carries. Measured on this suite's CPUs: all six
 * bit for bit with the native bf16 kernel; with the widened and
 * fp32_rounded ones five bit for bit and 160 x 48 3.1e-3 away (89% of its
 * elements torch's bits). TORCH_FORM_LIMIT, relative to the largest entry:
 * a tipped element is one bf16 ulp (2^-8 of it) that the iterations left
 * carry; 0.02 holds several such, and stays under torch's own 0.008-0.21
 * from float64, so an iteration that is not torch's (the standard bf16 form
 * is ~0.2 from torch's results on the low-rank matrices) fails it. */
#define TORCH_FORM_LIMIT 0.02
static void check_newton_schulz_torch_form(void) {
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/muon_ns_bf16.safetensors"), &st, &err), &err);
    ht_ns_schedule sched;
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_ASYM5, 5, NULL, 0, &sched, &err), &err);
    sched.form = HT_NS_FORM_TORCH;
    for (size_t m = 0; m < sizeof(BF16_FIXTURES) / sizeof(BF16_FIXTURES[0]); m++) {
        const ht_st_tensor *in = tensor(st, "input.%s", BF16_FIXTURES[m]);
        const float *theirs = tensor(st, "torch.%s", BF16_FIXTURES[m])->data,
                    *f64 = tensor(st, "f64.%s", BF16_FIXTURES[m])->data;
        int64_t rows = in->shape[0], cols = in->shape[1], n = rows * cols;
        float *x = malloc((size_t)n * sizeof(float));
        float *work = ht_alloc(ht_newton_schulz_workspace(rows, cols, &sched, HT_DTYPE_BF16) * sizeof(float));
        ht_newton_schulz(in->data, x, rows, cols, &sched, 1e-7, HT_DTYPE_BF16, work);
        int64_t same = 0, bf16 = 0;
        for (int64_t i = 0; i < n; i++) {
            same += x[i] == theirs[i];
            bf16 += ht_bf16_to_f32(ht_f32_to_bf16(x[i])) == x[i];
        }
        const double e = rel_max_err(x, theirs, (size_t)n), torch_f64 = rel_max_err(theirs, f64, (size_t)n);
        printf("  %-15s torch form: %.1f%% of the elements torch's bits, %.3g from torch's (torch %.3g from "
               "float64)\n",
               BF16_FIXTURES[m], 100.0 * (double)same / (double)n, e, torch_f64);
        if (bf16 != n) fail_msg("%s: %lld elements are not bf16 values", BF16_FIXTURES[m], (long long)(n - bf16));
        if (e > TORCH_FORM_LIMIT)
            fail_msg("%s: %.3g from torch's iteration (limit %g)", BF16_FIXTURES[m], e, TORCH_FORM_LIMIT);
        free(x);
        ht_free(work);
    }
    ht_safetensors_close(st);
}

static void test_newton_schulz_bf16(void **state) {
    (void)state;
    const ht_gemm_kernel kernels[] = {HT_GEMM_KERNEL_NATIVE, HT_GEMM_KERNEL_WIDENED, HT_GEMM_KERNEL_FP32_ROUNDED};
    for (int k = 0; k < 3; k++)
        if (use_gemm_kernel(HT_DTYPE_BF16, kernels[k])) {
            check_newton_schulz_bf16();
            check_newton_schulz_bf16_against_torch();
            check_newton_schulz_torch_form();
        }
}

/* A zero matrix stays zero: eps keeps 0 / 0 away. */
static void test_newton_schulz_zero(void **state) {
    (void)state;
    ht_error err;
    ht_ns_schedule sched;
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_POLAR_EXPRESS, 5, NULL, 0, &sched, &err), &err);
    float g[6 * 10] = {0};
    float work[6 * 10 + 2 * 36];
    assert_int_equal(ht_newton_schulz_workspace(6, 10, &sched, HT_DTYPE_F32), sizeof(work) / sizeof(float));
    ht_newton_schulz(g, g, 6, 10, &sched, 1e-7, HT_DTYPE_F32, work);
    for (int i = 0; i < 60; i++) assert_true(g[i] == 0.0f);
}

/* ---------------------------------------------------------------- schedules */

static void expect_error(ht_ns_variant v, int ns_steps, const ht_ns_segment *seg, int count, const char *key) {
    ht_error err = {0};
    ht_ns_schedule sched;
    ht_status s = ht_ns_schedule_expand(v, ns_steps, seg, count, &sched, &err);
    if (s != HT_ERR_CONFIG) fail_msg("%s with ns_steps %d: expected a config error", ht_ns_variant_name(v), ns_steps);
    if (!strstr(err.msg, key)) fail_msg("error \"%s\" does not name %s", err.msg, key);
    printf("  rejected: %s\n", err.msg);
}

static void test_schedule_expansion(void **state) {
    (void)state;
    ht_error err;
    ht_ns_schedule s;
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_LEGACY, 3, NULL, 0, &s, &err), &err);
    assert_int_equal(s.steps, 3);
    assert_true(s.coeffs[2][0] == 3.4445 && s.coeffs[2][1] == -4.7750 && s.coeffs[2][2] == 2.0315);
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_ASYM5, 3, NULL, 0, &s, &err), &err);
    assert_int_equal(s.steps, 3);
    assert_true(s.coeffs[0][0] == 4.0848 && s.coeffs[2][2] == 2.3037);
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_POLAR_EXPRESS, 8, NULL, 0, &s, &err), &err);
    assert_int_equal(s.steps, 8);
    assert_memory_equal(s.coeffs[7], s.coeffs[4], sizeof(s.coeffs[0]));
    assert_true(s.coeffs[0][0] == 8.156554524902461);
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_DEEPSEEK_V4, 5, NULL, 0, &s, &err), &err);
    assert_int_equal(s.steps, 10);
    assert_true(s.coeffs[7][0] == 3.4445 && s.coeffs[8][0] == 2.0 && s.coeffs[9][2] == 0.5);
    /* [[a,b,c], ...]: one iteration per triple; longer than ns_steps is fine. */
    ht_ns_segment list[6];
    for (int i = 0; i < 6; i++) list[i] = (ht_ns_segment){{3.0 + i, -4.0, 1.0}, 1};
    assert_ht_ok(ht_ns_schedule_expand(HT_NS_CUSTOM, 5, list, 6, &s, &err), &err);
    assert_int_equal(s.steps, 6);
    assert_true(s.coeffs[5][0] == 8.0);

    expect_error(HT_NS_ASYM5, 6, NULL, 0, "optimizer.muon_config.muon_ns_steps");
    expect_error(HT_NS_LEGACY, 0, NULL, 0, "optimizer.muon_config.muon_ns_steps");
    expect_error(HT_NS_CUSTOM, 5, list, 4, "optimizer.muon_config.muon_ns_coefficients"); /* 4 < 5 */
    ht_ns_segment seg[2] = {{{3.0, -4.0, 1.0}, 2}, {{2.0, -1.5, 0.5}, 2}};
    expect_error(HT_NS_CUSTOM, 5, seg, 2, "optimizer.muon_config.muon_ns_coefficients");
    seg[1].abc[1] = NAN;
    seg[1].repeat = 3;
    expect_error(HT_NS_CUSTOM, 5, seg, 2, "optimizer.muon_config.muon_ns_coefficients");
    seg[1].abc[1] = INFINITY;
    expect_error(HT_NS_CUSTOM, 5, seg, 2, "optimizer.muon_config.muon_ns_coefficients");
    expect_error(HT_NS_CUSTOM, 5, NULL, 0, "optimizer.muon_config.muon_ns_coefficients");
    ht_ns_segment many = {{3.0, -4.0, 1.0}, 1000};
    expect_error(HT_NS_CUSTOM, 5, &many, 1, "optimizer.muon_config.muon_ns_coefficients");

    for (int v = 0; v < HT_NS_VARIANT_COUNT; v++) {
        ht_ns_variant back;
        assert_true(ht_ns_variant_from_name(ht_ns_variant_name((ht_ns_variant)v), &back));
        assert_int_equal(back, v);
    }
    ht_ns_variant back;
    assert_false(ht_ns_variant_from_name("asym6", &back));
}

/* ---------------------------------------------------------------- scale, 3-D, refusals */

static void test_update_scale(void **state) {
    (void)state;
    assert_true(fabs(ht_muon_update_scale(64, 64, 0.2) - 1.6) < 1e-15);
    assert_true(fabs(ht_muon_update_scale(32, 96, 0.2) - 0.2 * sqrt(96.0)) < 1e-15);
    assert_true(fabs(ht_muon_update_scale(96, 32, 0.3) - 0.3 * sqrt(96.0)) < 1e-15);
    assert_true(ht_muon_update_scale(32, 96, 0.0) == 1.0); /* original: sqrt(max(1, A/B)) */
    assert_true(fabs(ht_muon_update_scale(96, 32, 0.0) - sqrt(3.0)) < 1e-15);
    /* A 3-D (E, A, B) param takes the scale of its (A, B) matrices. */
    ht_param_store store = {0};
    ht_error err;
    ht_param *p = ht_params_add(&store, "experts", 3, (int64_t[]){3, 24, 40}, HT_DTYPE_F32);
    assert_ht_ok(ht_params_allocate(&store, &err), &err);
    p = ht_params_find(&store, "experts");
    assert_ht_ok(ht_params_create_main(&store, HT_MAIN_COPY, &err), &err);
    ht_muon_config cfg = base_config(HT_NS_ASYM5, HT_MUON_MOMENTUM_SUM, true, 0.2);
    ht_muon opt;
    assert_ht_ok(ht_muon_init(&opt, &cfg, &p, 1, &err), &err);
    assert_int_equal(opt.slots[0].matrices, 3);
    assert_int_equal(opt.slots[0].rows, 24);
    assert_int_equal(opt.slots[0].cols, 40);
    assert_true(fabs(opt.slots[0].scale - 0.2 * sqrt(40.0)) < 1e-15);
    ht_muon_free(&opt);
    ht_params_free(&store);
}

/* A 3-D param is E independent matrices: the same result, bit for bit, as E
 * 2-D params holding its slices. */
static void test_3d_equals_slices(void **state) {
    (void)state;
    enum { E = 3, A = 20, B = 12 };
    ht_param_store store = {0};
    ht_error err;
    ht_params_add(&store, "stack", 3, (int64_t[]){E, A, B}, HT_DTYPE_BF16);
    char names[E][16];
    for (int e = 0; e < E; e++) {
        snprintf(names[e], sizeof(names[e]), "slice%d", e);
        ht_params_add(&store, names[e], 2, (int64_t[]){A, B}, HT_DTYPE_BF16);
    }
    assert_ht_ok(ht_params_allocate(&store, &err), &err);
    ht_param *stack = ht_params_find(&store, "stack"), *slices[E];
    ht_rng rng;
    ht_rng_seed(&rng, 7);
    uint16_t *sd = stack->data;
    for (int i = 0; i < E * A * B; i++) sd[i] = ht_f32_to_bf16(0.05f * ht_rng_normal(&rng));
    for (int e = 0; e < E; e++) {
        slices[e] = ht_params_find(&store, names[e]);
        memcpy(slices[e]->data, sd + e * A * B, A * B * 2);
    }
    assert_ht_ok(ht_params_create_main(&store, HT_MAIN_COPY, &err), &err);
    ht_muon_config cfg = base_config(HT_NS_POLAR_EXPRESS, HT_MUON_MOMENTUM_SUM, true, 0.2);
    ht_muon a, b;
    assert_ht_ok(ht_muon_init(&a, &cfg, &stack, 1, &err), &err);
    assert_ht_ok(ht_muon_init(&b, &cfg, slices, E, &err), &err);
    for (int t = 0; t < 3; t++) {
        for (int i = 0; i < E * A * B; i++) stack->main_grad[i] = ht_rng_normal(&rng);
        for (int e = 0; e < E; e++) memcpy(slices[e]->main_grad, stack->main_grad + e * A * B, A * B * 4);
        ht_muon_step(&a, 0.02);
        ht_muon_step(&b, 0.02);
    }
    for (int e = 0; e < E; e++) {
        assert_memory_equal(slices[e]->main_param, stack->main_param + e * A * B, A * B * 4);
        assert_memory_equal(slices[e]->data, sd + e * A * B, A * B * 2);
        assert_memory_equal(b.slots[e].momentum_buffer, a.slots[0].momentum_buffer + e * A * B, A * B * 4);
    }
    ht_muon_free(&a);
    ht_muon_free(&b);
    ht_params_free(&store);
}

/* Matrices of one shape share their Newton-Schulz products in batches:
 * every param's update is the one it gets alone, bit for bit (FP32
 * Newton-Schulz). Twelve 512 x 256 matrices (393 Ki floats of update and
 * workspace each) overflow one 4 Mi-float batch and split in two; so does
 * the 24-matrix stack; smaller shapes interleave in param order. */
static void test_batches_equal_one_at_a_time(void **state) {
    (void)state;
    enum { P = 17 };
    static const int64_t shapes[P][3] = {{0, 512, 256}, {0, 24, 100},  {0, 512, 256}, {0, 30, 20},   {0, 512, 256},
                                         {0, 24, 100},  {0, 512, 256}, {0, 512, 256}, {0, 512, 256}, {0, 512, 256},
                                         {0, 512, 256}, {0, 512, 256}, {0, 512, 256}, {0, 512, 256}, {0, 24, 100},
                                         {0, 512, 256}, {24, 512, 256}};
    ht_param_store store = {0};
    ht_error err;
    char names[P][16];
    for (int i = 0; i < P; i++) {
        snprintf(names[i], sizeof(names[i]), "m%d", i);
        if (shapes[i][0])
            ht_params_add(&store, names[i], 3, shapes[i], HT_DTYPE_BF16);
        else
            ht_params_add(&store, names[i], 2, shapes[i] + 1, HT_DTYPE_BF16);
    }
    assert_ht_ok(ht_params_allocate(&store, &err), &err);
    ht_param *params[P];
    for (int i = 0; i < P; i++) {
        params[i] = ht_params_find(&store, names[i]);
        int64_t n = ht_param_numel(params[i]);
        float *w = malloc((size_t)n * sizeof(float));
        ht_random_normal(w, n, (uint64_t)i, 0, 0.05f);
        ht_convert(params[i]->data, HT_DTYPE_BF16, w, HT_DTYPE_F32, (size_t)n);
        free(w);
    }
    assert_ht_ok(ht_params_create_main(&store, HT_MAIN_COPY, &err), &err);
    /* The same params twice over: one optimizer for all, one per param. */
    ht_param_store twin = {0};
    for (int i = 0; i < P; i++) ht_params_add(&twin, names[i], params[i]->ndim, params[i]->shape, HT_DTYPE_BF16);
    assert_ht_ok(ht_params_allocate(&twin, &err), &err);
    ht_param *alone[P];
    for (int i = 0; i < P; i++) {
        alone[i] = ht_params_find(&twin, names[i]);
        memcpy(alone[i]->data, params[i]->data, (size_t)ht_param_numel(params[i]) * 2);
    }
    assert_ht_ok(ht_params_create_main(&twin, HT_MAIN_COPY, &err), &err);
    ht_muon_config cfg = base_config(HT_NS_ASYM5, HT_MUON_MOMENTUM_SUM, true, 0.2);
    ht_muon all, one[P];
    assert_ht_ok(ht_muon_init(&all, &cfg, params, P, &err), &err);
    for (int i = 0; i < P; i++) assert_ht_ok(ht_muon_init(&one[i], &cfg, &alone[i], 1, &err), &err);
    for (int t = 0; t < 2; t++) {
        for (int i = 0; i < P; i++) {
            int64_t n = ht_param_numel(params[i]);
            ht_random_normal(params[i]->main_grad, n, (uint64_t)(100 * t + i), 0, 1.0f);
            memcpy(alone[i]->main_grad, params[i]->main_grad, (size_t)n * sizeof(float));
            ht_muon_step(&one[i], 0.02);
        }
        ht_muon_step(&all, 0.02);
    }
    for (int i = 0; i < P; i++) {
        size_t n = (size_t)ht_param_numel(params[i]);
        if (memcmp(params[i]->main_param, alone[i]->main_param, n * sizeof(float)) != 0 ||
            memcmp(params[i]->data, alone[i]->data, n * 2) != 0 ||
            memcmp(all.slots[i].momentum_buffer, one[i].slots[0].momentum_buffer, n * sizeof(float)) != 0)
            fail_msg("%s: batched update differs from the param's own", names[i]);
        ht_muon_free(&one[i]);
    }
    ht_muon_free(&all);
    ht_params_free(&store);
    ht_params_free(&twin);
}

static void expect_refused(ht_param *p, const ht_muon_config *cfg, const char *what) {
    ht_muon opt;
    ht_error err = {0};
    ht_status s = ht_muon_init(&opt, cfg, &p, 1, &err);
    assert_int_not_equal(s, HT_OK);
    if (!strstr(err.msg, p->name) || !strstr(err.msg, what))
        fail_msg("error \"%s\" does not name %s and say \"%s\"", err.msg, p->name, what);
    printf("  refused: %s\n", err.msg);
}

static void test_refusals(void **state) {
    (void)state;
    ht_param_store store = {0};
    ht_error err;
    ht_params_add(&store, "model.norm.weight", 1, (int64_t[]){64}, HT_DTYPE_F32);
    ht_params_add(&store, "conv.weight", 4, (int64_t[]){2, 3, 4, 5}, HT_DTYPE_F32);
    ht_params_add(&store, "model.layers.0.mlp.up_proj.weight", 2, (int64_t[]){16, 8}, HT_DTYPE_F32);
    assert_ht_ok(ht_params_allocate(&store, &err), &err);
    assert_ht_ok(ht_params_create_main(&store, HT_MAIN_COPY, &err), &err);
    ht_muon_config cfg = base_config(HT_NS_ASYM5, HT_MUON_MOMENTUM_SUM, true, 0.2);
    expect_refused(ht_params_find(&store, "model.norm.weight"), &cfg, "1 dims");
    expect_refused(ht_params_find(&store, "conv.weight"), &cfg, "4 dims");
    ht_param *up = ht_params_find(&store, "model.layers.0.mlp.up_proj.weight");
    /* A shard of a matrix is no longer refused: Muon gathers the whole matrix
     * over its comm (test_dist checks sharded runs against one process). */
    float *main = up->main_param;
    up->main_param = NULL;
    expect_refused(up, &cfg, "main param");
    up->main_param = main;

    ht_muon opt;
    ht_muon_config bad = cfg;
    bad.ns_dtype = HT_DTYPE_F16;
    assert_int_equal(ht_muon_init(&opt, &bad, &up, 1, &err), HT_ERR_CONFIG);
    bad = cfg;
    bad.momentum = 1.0;
    assert_int_equal(ht_muon_init(&opt, &bad, &up, 1, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "optimizer.muon_config.muon_momentum"));
    bad = cfg;
    bad.ns_eps = 0;
    assert_int_equal(ht_muon_init(&opt, &bad, &up, 1, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "optimizer.muon_config.muon_ns_eps"));
    bad = cfg;
    bad.schedule.coeffs[1][2] = NAN;
    assert_int_equal(ht_muon_init(&opt, &bad, &up, 1, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "optimizer.muon_config.muon_ns_coefficients"));
    ht_params_free(&store);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_torch_original_nesterov),
        cmocka_unit_test(test_torch_match_rms_plain),
        cmocka_unit_test(test_bf16_master_sum),
        cmocka_unit_test(test_newton_schulz_schedules),
        cmocka_unit_test(test_newton_schulz_bf16),
        cmocka_unit_test(test_newton_schulz_symmetric_products),
        cmocka_unit_test(test_newton_schulz_gram_form),
        cmocka_unit_test(test_newton_schulz_zero),
        cmocka_unit_test(test_schedule_expansion),
        cmocka_unit_test(test_update_scale),
        cmocka_unit_test(test_3d_equals_slices),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_batches_equal_one_at_a_time),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
