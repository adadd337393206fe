/* Qwen2-MoE against Hugging Face transformers: small random models (8
 * experts, a shared expert, dense layers by mlp_only_layers and by
 * decoder_sparse_step, top-2 and top-3, norm_topk_prob off and on) whose
 * logits, loss, load-balancing loss and every gradient must match the
 * committed fixtures (tools/reference/make_moe_fixtures.py), including a
 * batch where some experts receive no token; and the refusals of bad MoE
 * configs and checkpoints.
 *
 * DeepSeekMoE (deepseek_v3's sparse block): the grouped sigmoid router
 * against a float64 reference written here (the group limit leaving out an
 * expert the plain top-k takes, the correction bias changing a choice, a
 * negative bias against masked groups, norm_topk_prob both ways, the
 * scaling); the block's forward and backward (ht_moe_*) against a float64
 * reference and its central differences, in FP32 and with bf16 weights
 * around the FP32 router; the parameters (the router and bias FP32 and the
 * bias never trained, no shared experts when n_shared_experts is 0); the
 * transformers fixtures' tokens per expert and their aux-loss-free bias
 * update (tools/reference/make_dsv3_fixtures.py); and a training run with
 * the bias update resumed from its checkpoint bit for bit, and exported. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/model.h"
#include "model/moe.h"

static const double bf16_u = 0x1p-9;

static const ht_st_tensor *need(ht_safetensors *st, const char *name) {
    const ht_st_tensor *t = ht_safetensors_find(st, name);
    if (!t) fail_msg("the fixture has no %s", name);
    return t;
}

static ht_model *load_model(const char *name, ht_dtype dtype, bool aux) {
    char rel[256];
    snprintf(rel, sizeof(rel), "moe/%s", name);
    const char *dir = fixture_path(rel);
    ht_model_config cfg;
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_string_equal(cfg.name, "qwen2_moe");
    cfg.moe.output_router_logits = aux;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    assert_ht_ok(ht_hf_load_weights(dir, &m->params, &err), &err);
    if (dtype != HT_DTYPE_F32) assert_ht_ok(ht_params_convert(&m->params, dtype, &err), &err);
    return m;
}

/* One batch of the fixture: `prefix` "" (2 x 13) or "small." (1 x 3, some
 * experts without a token); `grads` "grad." (the cross-entropy's) or
 * "grad_aux." (with router_aux_loss_coef x the load-balancing loss). */
static void check_case(const char *name, const char *prefix, bool aux, ht_dtype dtype, double tol_logits,
                       double tol_grads) {
    char path[512], key[HT_PARAM_NAME_MAX + 32];
    ht_error err;
    ht_safetensors *st;
    snprintf(path, sizeof(path), "moe/%s/fixture.safetensors", name);
    assert_ht_ok(ht_safetensors_open(fixture_path(path), &st, &err), &err);
    snprintf(key, sizeof(key), "%sinputs", prefix);
    const ht_st_tensor *in = need(st, key);
    snprintf(key, sizeof(key), "%stargets", prefix);
    const int32_t *targets = need(st, key)->data;
    snprintf(key, sizeof(key), "%slogits", prefix);
    const float *want_logits = need(st, key)->data;
    snprintf(key, sizeof(key), "%s%s", prefix, aux ? "loss_aux" : "loss");
    const float want_loss = *(const float *)need(st, key)->data;
    const int B = (int)in->shape[0], T = (int)in->shape[1];

    ht_model *m = load_model(name, dtype, aux);
    float loss;
    assert_ht_ok(ht_model_forward(m, in->data, targets, B, T, &loss, &err), &err);
    const size_t n = (size_t)B * T * m->config.vocab_size;
    double logits_err = rel_max_err(m->logits, want_logits, n);
    if (!(logits_err <= tol_logits))
        fail_msg("%s %s%s: logits differ by %.3g (allowed %.1g)", name, prefix, ht_dtype_name(dtype), logits_err,
                 tol_logits);
    if (!(fabs(loss - want_loss) <= tol_logits * fabs(want_loss)))
        fail_msg("%s %s: loss %.8f, transformers %.8f", name, prefix, loss, want_loss);
    if (aux) {
        float want_aux = *(const float *)need(st, "aux_loss")->data;
        if (!(fabs(m->aux_loss - want_aux) <= tol_logits * fabs(want_aux)))
            fail_msg("%s: load-balancing loss %.8f, transformers %.8f", name, m->aux_loss, want_aux);
    } else {
        assert_true(isnan(m->aux_loss));
    }
    ht_params_zero_grad(&m->params);
    ht_model_backward(m, 1.0f);
    double worst = 0;
    int checked = 0;
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        snprintf(key, sizeof(key), "%s%s%s", prefix, aux ? "grad_aux." : "grad.", p->name);
        const ht_st_tensor *g = need(st, key);
        assert_int_equal((int64_t)(g->nbytes / 4), ht_param_numel(p));
        double e = rel_max_err(p->main_grad, g->data, g->nbytes / 4);
        if (!(e <= tol_grads))
            fail_msg("%s %s%s: gradient of %s differs by %.3g of its largest magnitude (allowed %.1g)", name, prefix,
                     ht_dtype_name(dtype), p->name, e, tol_grads);
        worst = e > worst ? e : worst;
        checked++;
    }
    printf("%-14s %-6s %-8s %s logits %.2e, loss %.6f vs %.6f, worst gradient %.2e over %d tensors\n", name, prefix,
           ht_dtype_name(dtype), aux ? "+aux" : "    ", logits_err, loss, want_loss, worst, checked);
    ht_model_free(m);
    ht_safetensors_close(st);
}

/* FP32: docs/NUMERICS.md's 1e-5 of each tensor's largest magnitude. */
static void test_moe_untied_f32(void **s) {
    (void)s;
    check_case("moe_untied", "", false, HT_DTYPE_F32, 1e-5, 1e-5);
    check_case("moe_untied", "", true, HT_DTYPE_F32, 1e-5, 1e-5);
}

static void test_moe_tied_norm_f32(void **s) {
    (void)s;
    check_case("moe_tied_norm", "", false, HT_DTYPE_F32, 1e-5, 1e-5);
    check_case("moe_tied_norm", "", true, HT_DTYPE_F32, 1e-5, 1e-5);
}

/* 3 tokens x top-k < 8 experts: experts without a token (their gradients are zero). */
static void test_moe_experts_without_tokens(void **s) {
    (void)s;
    check_case("moe_untied", "small.", false, HT_DTYPE_F32, 1e-5, 1e-5);
    check_case("moe_tied_norm", "small.", false, HT_DTYPE_F32, 1e-5, 1e-5);
}

/* bf16 weights against the FP32 reference, with the dense model's bounds
 * (test_reference.c): 16 bf16 units for logits, 32 for gradients. They hold
 * because no token's choice of experts is near a tie (the fixture's router
 * margins), so bf16 rounding picks the same experts. */
static void test_moe_bf16(void **s) {
    (void)s;
    check_case("moe_untied", "", true, HT_DTYPE_BF16, 16 * bf16_u, 32 * bf16_u);
    check_case("moe_tied_norm", "", false, HT_DTYPE_BF16, 16 * bf16_u, 32 * bf16_u);
}

/* ---------------------------------------------------------------- bad input */

static ht_model_config moe_config(void) {
    ht_model_config c = {0};
    snprintf(c.name, sizeof(c.name), "qwen2_moe");
    c.vocab_size = 64;
    c.hidden_size = 32;
    c.intermediate_size = 48;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 32;
    c.rope_theta = 10000;
    c.rms_norm_eps = 1e-6;
    c.attention_bias = true;
    c.initializer_range = 0.02;
    c.moe.num_experts = 4;
    c.moe.num_experts_per_tok = 2;
    c.moe.moe_intermediate_size = 16;
    c.moe.shared_expert_intermediate_size = 24;
    c.moe.decoder_sparse_step = 1;
    c.moe.router_aux_loss_coef = 0.01;
    return c;
}

static void expect_build_refused(ht_model_config c, const char *needle) {
    ht_model *m = NULL;
    ht_error err;
    assert_int_not_equal(ht_model_build(&c, HT_DTYPE_F32, 1, &m, &err), HT_OK);
    assert_null(m);
    if (!strstr(err.msg, needle)) fail_msg("expected \"%s\" in: %s", needle, err.msg);
}

static void test_moe_bad_configs(void **s) {
    (void)s;
    ht_model_config c = moe_config();
    c.moe.num_experts_per_tok = 5;
    expect_build_refused(c, "model.num_experts_per_tok must be between 1 and model.num_experts (4)");
    c = moe_config();
    c.moe.mlp_only_layers.count = 1;
    c.moe.mlp_only_layers.items[0] = 2;
    expect_build_refused(c, "model.mlp_only_layers[0] is 2");
    c = moe_config();
    c.moe.moe_intermediate_size = 0;
    expect_build_refused(c, "model.moe_intermediate_size");
    c = moe_config();
    snprintf(c.name, sizeof(c.name), "qwen2");
    expect_build_refused(c, "model.num_experts is 4, but model.name qwen2 has no experts");
    c = moe_config();
    c.moe.num_experts = 1 << 20;
    c.moe.moe_intermediate_size = 1 << 20;
    expect_build_refused(c, "parameters a model may have");
}

/* Refused, naming `needle`: the weights of dir loaded into m. */
static void expect_load_refused(const char *dir, ht_model *m, const char *needle, const char *what) {
    ht_error err;
    assert_int_not_equal(ht_hf_load_weights(dir, &m->params, &err), HT_OK);
    if (!strstr(err.msg, needle)) fail_msg("%s: expected \"%s\" in: %s", what, needle, err.msg);
    printf("refused (%s): %s\n", what, err.msg);
}

/* Rewrites dir/model.safetensors from `src` without tensor `drop`, and with
 * tensor `reshape` (if any) given shape (a, b, c) of the same element count. */
static void rewrite(const char *path, ht_safetensors *src, const char *drop, const char *reshape,
                    const int64_t *shape) {
    ht_error err;
    ht_st_writer w = {0};
    for (int i = 0; i < ht_safetensors_count(src); i++) {
        const ht_st_tensor *t = ht_safetensors_tensor(src, i);
        if (drop && strcmp(t->name, drop) == 0) continue;
        bool other = reshape && strcmp(t->name, reshape) == 0;
        assert_ht_ok(ht_st_writer_add(&w, t->name, t->dtype, other ? 3 : t->ndim, other ? shape : t->shape, t->data,
                                      t->dtype, &err),
                     &err);
    }
    assert_ht_ok(ht_st_writer_write(&w, path, &err), &err);
    ht_st_writer_free(&w);
}

/* Hugging Face files hold one tensor per expert (what transformers writes)
 * or the 3-D tensors (save_original_format=False, as the fixtures): both
 * load. A missing expert tensor, or one of the wrong shape, is refused,
 * naming it. */
static void test_moe_checkpoints(void **s) {
    (void)s;
    ht_error err;
    ht_model_config c = moe_config();
    ht_model *m, *back;
    assert_ht_ok(ht_model_build(&c, HT_DTYPE_F32, 3, &m, &err), &err);
    assert_ht_ok(ht_model_build(&c, HT_DTYPE_F32, 4, &back, &err), &err);
    const char *dir = scratch_dir("moe_checkpoint");
    assert_ht_ok(ht_hf_save(dir, &m->config, &m->params, HT_DTYPE_F32, 0, &err), &err);
    ht_model_config cfg;
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_int_equal(cfg.moe.num_experts, 4);
    assert_int_equal(cfg.moe.shared_expert_intermediate_size, 24);
    assert_true(fabs(cfg.moe.router_aux_loss_coef - 0.01) < 1e-12);

    /* Written per expert, read back into the 3-D params, bit for bit. */
    char path[1200], moved[1300];
    snprintf(path, sizeof(path), "%s/model.safetensors", dir);
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    assert_non_null(ht_safetensors_find(st, "model.layers.1.mlp.experts.3.up_proj.weight"));
    assert_null(ht_safetensors_find(st, "model.layers.1.mlp.experts.gate_up_proj"));
    assert_ht_ok(ht_hf_load_weights(dir, &back->params, &err), &err);
    for (int i = 0; i < m->params.count; i++)
        assert_memory_equal(m->params.items[i].data, back->params.items[i].data,
                            (size_t)ht_param_numel(&m->params.items[i]) * sizeof(float));
    snprintf(moved, sizeof(moved), "%s/per_expert.safetensors", dir);
    assert_int_equal(rename(path, moved), 0);
    ht_safetensors_close(st);
    assert_ht_ok(ht_safetensors_open(moved, &st, &err), &err);
    rewrite(path, st, "model.layers.1.mlp.experts.2.down_proj.weight", NULL, NULL);
    expect_load_refused(dir, back,
                        "model.layers.1.mlp.experts.2.down_proj.weight (expert 2 of "
                        "model.layers.1.mlp.experts.down_proj)",
                        "an expert missing");
    rewrite(path, st, NULL, "model.layers.0.mlp.experts.1.gate_proj.weight", (int64_t[]){2, 8, 32});
    expect_load_refused(dir, back, "model.layers.0.mlp.experts.1.gate_proj.weight", "an expert of the wrong shape");
    ht_safetensors_close(st);

    /* The 3-D layout: the params as they are, then one 3-D tensor missing or of the wrong shape. */
    ht_st_writer w = {0};
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        assert_ht_ok(ht_st_writer_add(&w, p->name, HT_DTYPE_F32, p->ndim, p->shape, p->data, HT_DTYPE_F32, &err), &err);
    }
    assert_ht_ok(ht_st_writer_write(&w, moved, &err), &err);
    ht_st_writer_free(&w);
    assert_ht_ok(ht_safetensors_open(moved, &st, &err), &err);
    rewrite(path, st, NULL, NULL, NULL);
    assert_ht_ok(ht_hf_load_weights(dir, &back->params, &err), &err);
    rewrite(path, st, "model.layers.1.mlp.experts.down_proj", NULL, NULL);
    expect_load_refused(dir, back, "of model.layers.1.mlp.experts.down_proj", "a 3-D tensor missing");
    rewrite(path, st, NULL, "model.layers.1.mlp.experts.down_proj", (int64_t[]){2, 64, 16});
    expect_load_refused(dir, back, "tensor 'model.layers.1.mlp.experts.down_proj' has shape [2, 64, 16]",
                        "a 3-D tensor of the wrong shape");
    ht_safetensors_close(st);
    ht_model_free(back);
    ht_model_free(m);
}

/* ================================================================ DeepSeekMoE */

/* A float64 reference of DeepseekV3TopkRouter as transformers 5.24 writes it
 * (models/deepseek_v3/modeling_deepseek_v3.py): s = sigmoid(z); the choice
 * on s + bias; the groups of E / G consecutive experts scored by the sum of
 * their two largest biased scores, the tg best kept and the others' scores
 * masked to -inf (masked_fill(~mask, -inf): transformers 4.x filled 0.0,
 * which lets a masked expert beat allowed negative scores), then the top k;
 * the weights the unbiased s, / (sum + 1e-20) with norm, x scaling. Ties to
 * the lower index. margin (if not NULL): the smallest gap, over the token's
 * decisions, between what was taken and what was not. */
typedef struct ds_route {
    int E, k, G, tg;
    bool norm;
    double scaling;
} ds_route;

static void ref_route(const ds_route *r, const double *z, const double *bias, int *sel, double *w, double *s,
                      double *margin) {
    const int E = r->E, per = E / r->G;
    double b[256], g[64];
    bool allowed[256], kept[64];
    for (int e = 0; e < E; e++) {
        s[e] = 1.0 / (1.0 + exp(-z[e]));
        b[e] = s[e] + (bias ? bias[e] : 0.0);
    }
    double gap = INFINITY;
    for (int q = 0; q < r->G; q++) {
        double m1 = -INFINITY, m2 = -INFINITY;
        for (int e = q * per; e < (q + 1) * per; e++) {
            if (b[e] > m1) {
                m2 = m1;
                m1 = b[e];
            } else if (b[e] > m2) {
                m2 = b[e];
            }
        }
        g[q] = m1 + m2;
        kept[q] = r->tg >= r->G;
    }
    if (r->tg < r->G) {
        for (int t = 0; t < r->tg; t++) {
            int best = -1;
            for (int q = 0; q < r->G; q++)
                if (!kept[q] && (best < 0 || g[q] > g[best])) best = q;
            kept[best] = true;
        }
        double lo = INFINITY, hi = -INFINITY;
        for (int q = 0; q < r->G; q++) {
            if (kept[q]) lo = fmin(lo, g[q]);
            if (!kept[q]) hi = fmax(hi, g[q]);
        }
        gap = fmin(gap, lo - hi);
    }
    for (int e = 0; e < E; e++) allowed[e] = kept[e / per];
    double total = 0;
    for (int j = 0; j < r->k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++)
            if (allowed[e] && (best < 0 || b[e] > b[best])) best = e;
        allowed[best] = false;
        sel[j] = best;
        w[j] = s[best];
        total += s[best];
    }
    double next = -INFINITY; /* the best allowed expert not taken */
    for (int e = 0; e < E; e++)
        if (allowed[e]) next = fmax(next, b[e]);
    gap = fmin(gap, b[sel[r->k - 1]] - next);
    for (int j = 0; j < r->k; j++) w[j] = (r->norm ? w[j] / (total + 1e-20) : w[j]) * r->scaling;
    if (margin) *margin = gap;
}

static bool same_set(const int *a, const int *b, int k) {
    for (int i = 0; i < k; i++) {
        bool found = false;
        for (int j = 0; j < k; j++) found = found || a[i] == b[j];
        if (!found) return false;
    }
    return true;
}

/* The kernel on N tokens of random logits (std 3, the fixtures' spread)
 * and bias (bias0 + std 0.1), against the reference: the same experts in
 * the same order, weights within 1e-6 of their largest. Returns how many
 * tokens change their set without the bias, and without the group limit. */
static void check_route_kernel(const ds_route *r, double bias0, uint64_t seed, int *by_bias, int *by_groups) {
    enum { N = 256 };
    const int E = r->E, k = r->k;
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    float *scores = malloc(sizeof(float) * N * E), *weight = malloc(sizeof(float) * N * k), psum[N], bias[256];
    int32_t *sel = malloc(sizeof(int32_t) * N * k);
    double *z = malloc(sizeof(double) * N * E), biasd[256];
    for (int e = 0; e < E; e++) {
        bias[e] = (float)(bias0 + 0.1 * ht_rng_normal(&rng));
        biasd[e] = bias[e];
    }
    for (int i = 0; i < N * E; i++) {
        scores[i] = 3.0f * ht_rng_normal(&rng);
        z[i] = scores[i];
    }
    ht_kernels()->moe_route_grouped(scores, sel, weight, psum, bias, N, E, k, r->G, r->tg, r->norm, (float)r->scaling);
    *by_bias = *by_groups = 0;
    double worst = 0, wmax = 0, smallest = INFINITY;
    for (int n = 0; n < N; n++) {
        int ref[64], plain[64], nobias[64];
        double w[64], s[256], margin;
        ref_route(r, z + n * E, biasd, ref, w, s, &margin);
        smallest = fmin(smallest, margin);
        if (!(margin > 1e-5)) continue; /* a near tie: FP32 may take either (none at these seeds, see below) */
        for (int j = 0; j < k; j++) {
            if (sel[n * k + j] != ref[j])
                fail_msg("token %d, choice %d: expert %d, the reference %d (E %d, groups %d/%d, k %d)", n, j,
                         sel[n * k + j], ref[j], E, r->tg, r->G, k);
            worst = fmax(worst, fabs(weight[n * k + j] - w[j]));
            wmax = fmax(wmax, fabs(w[j]));
        }
        for (int e = 0; e < E; e++)
            if (fabs(scores[n * E + e] - s[e]) > 1e-6) fail_msg("token %d: score %d off", n, e);
        /* A chosen expert is always in a kept group, whatever the sign of the scores. */
        ds_route all = *r;
        all.tg = all.G;
        ref_route(&all, z + n * E, biasd, plain, w, s, NULL);
        *by_groups += !same_set(plain, ref, k);
        ref_route(r, z + n * E, NULL, nobias, w, s, NULL);
        *by_bias += !same_set(nobias, ref, k);
    }
    assert_true(smallest > 1e-5); /* every token compared */
    if (!(worst <= 1e-6 * wmax)) fail_msg("weights differ by %.3g of %.3g", worst, wmax);
    printf("route E %d, groups %d of %d, k %d, norm %d, scaling %g, bias %+g: %d tokens as the float64 reference "
           "(weights within %.2g); the bias changes %d sets, the group limit %d; smallest margin %.2g\n",
           E, r->tg, r->G, k, r->norm, r->scaling, bias0, N, worst / wmax, *by_bias, *by_groups, smallest);
    free(scores);
    free(weight);
    free(sel);
    free(z);
}

static void test_deepseek_routing(void **s) {
    (void)s;
    int by_bias, by_groups;
    /* DeepSeek-V3's shape at small size: 4 groups of 2, the best 2 kept, top-2, normalised, x 2.5. */
    check_route_kernel(&(ds_route){8, 2, 4, 2, true, 2.5}, 0.0, 11, &by_bias, &by_groups);
    assert_true(by_bias > 0 && by_groups > 0);
    /* One group (no limit), top-3 of 13, not normalised, x 1.5. */
    check_route_kernel(&(ds_route){13, 3, 1, 1, false, 1.5}, 0.0, 12, &by_bias, &by_groups);
    assert_true(by_bias > 0 && by_groups == 0);
    /* 2 groups of 8, one kept, top-4. */
    check_route_kernel(&(ds_route){16, 4, 2, 1, true, 1.0}, 0.0, 13, &by_bias, &by_groups);
    assert_true(by_bias > 0 && by_groups > 0);
    /* A bias below -1: every biased score is negative, and an expert of a
     * masked group must still never be chosen (masked to -inf, not 0.0). */
    check_route_kernel(&(ds_route){8, 3, 4, 2, false, 1.0}, -1.5, 14, &by_bias, &by_groups);
    assert_true(by_groups > 0);
}

/* ---------------------------------------------------------------- the block against float64 */

typedef struct ds_block {
    ds_route r;
    int C, I, shared; /* n_shared_experts */
    int N;
} ds_block;

static ht_model_config ds_config(const ds_block *b) {
    ht_model_config c = {0};
    snprintf(c.name, sizeof(c.name), "deepseek_v3");
    c.hidden_size = b->C;
    c.moe.num_experts = b->r.E;
    c.moe.num_experts_per_tok = b->r.k;
    c.moe.moe_intermediate_size = b->I;
    c.moe.n_shared_experts = b->shared;
    c.moe.n_group = b->r.G;
    c.moe.topk_group = b->r.tg;
    c.moe.norm_topk_prob = b->r.norm;
    c.moe.routed_scaling_factor = b->r.scaling;
    c.moe.shared_expert_intermediate_size = 5632; /* the key's default: deepseek_v3 must not read it */
    return c;
}

/* The block's params as doubles, by name. */
typedef struct ds_weights {
    const ds_block *b;
    double *router, *bias, *gate_up, *down, *sg, *su, *sd; /* NULL: no shared experts */
} ds_weights;

static double silu(double v) { return v / (1.0 + exp(-v)); }

/* The block's output y (N, C) for x (N, C), in float64; margin: the smallest routing margin. */
static void ref_block(const ds_weights *W, const double *x, double *y, double *margin) {
    const ds_block *b = W->b;
    const int C = b->C, I = b->I, E = b->r.E, k = b->r.k, S = b->shared * b->I;
    *margin = INFINITY;
    for (int n = 0; n < b->N; n++) {
        const double *xn = x + (size_t)n * C;
        double z[256], s[256], w[64], m, h[1024];
        int sel[64];
        for (int e = 0; e < E; e++) {
            z[e] = 0;
            for (int c = 0; c < C; c++) z[e] += W->router[e * C + c] * xn[c];
        }
        ref_route(&b->r, z, W->bias, sel, w, s, &m);
        *margin = fmin(*margin, m);
        double *yn = y + (size_t)n * C;
        for (int c = 0; c < C; c++) yn[c] = 0;
        for (int j = 0; j < k; j++) {
            const double *gu = W->gate_up + (size_t)sel[j] * 2 * I * C, *dn = W->down + (size_t)sel[j] * C * I;
            for (int i = 0; i < I; i++) {
                double g = 0, u = 0;
                for (int c = 0; c < C; c++) {
                    g += gu[i * C + c] * xn[c];
                    u += gu[(I + i) * C + c] * xn[c];
                }
                h[i] = silu(g) * u;
            }
            for (int c = 0; c < C; c++) {
                double o = 0;
                for (int i = 0; i < I; i++) o += dn[c * I + i] * h[i];
                yn[c] += w[j] * o;
            }
        }
        for (int i = 0; i < S; i++) {
            double g = 0, u = 0;
            for (int c = 0; c < C; c++) {
                g += W->sg[i * C + c] * xn[c];
                u += W->su[i * C + c] * xn[c];
            }
            h[i] = silu(g) * u;
        }
        for (int c = 0; c < C && S > 0; c++)
            for (int i = 0; i < S; i++) yn[c] += W->sd[c * S + i] * h[i];
    }
}

/* L = sum(y * dy) in float64. */
static double ref_loss(const ds_weights *W, const double *x, const double *dy, double *y) {
    double m, L = 0;
    ref_block(W, x, y, &m);
    for (int i = 0; i < W->b->N * W->b->C; i++) L += y[i] * dy[i];
    return L;
}

/* Central differences of the reference's L in every element of v (n of them): grad. */
static void ref_grad(const ds_weights *W, double *x, const double *dy, double *v, int64_t n, double *grad, double *y) {
    const double h = 1e-6;
    for (int64_t i = 0; i < n; i++) {
        const double keep = v[i];
        v[i] = keep + h;
        double up = ref_loss(W, x, dy, y);
        v[i] = keep - h;
        double down = ref_loss(W, x, dy, y);
        v[i] = keep;
        grad[i] = (up - down) / (2 * h);
    }
}

static double rel_err_d(const float *a, const double *b, int64_t n) {
    double d = 0, m = 0;
    for (int64_t i = 0; i < n; i++) {
        d = fmax(d, fabs((double)a[i] - b[i]));
        m = fmax(m, fabs(b[i]));
    }
    return m > 0 ? d / m : d;
}

static double *param_doubles(const ht_param *p) {
    const int64_t n = ht_param_numel(p);
    double *v = malloc(sizeof(double) * (size_t)(n ? n : 1));
    float *f = malloc(sizeof(float) * (size_t)(n ? n : 1));
    ht_convert(f, HT_DTYPE_F32, p->data, p->dtype, (size_t)n);
    for (int64_t i = 0; i < n; i++) v[i] = f[i];
    free(f);
    return v;
}

/* The block built through ht_moe_* on its own store (as the decoder builds
 * it, whole on one rank), weights drawn so that routing is non-trivial
 * (router logits of std ~3, bias std 0.1), run forward and backward in
 * `dtype` (bf16: weights and x rounded, the router and bias kept FP32), and
 * compared with the float64 reference on the same values: y, dx and every
 * gradient within tol of their largest; the bias without a gradient. */
static void check_block(const ds_block *b, ht_dtype dtype, uint64_t seed, double tol_y, double tol_g) {
    ht_error err;
    ht_model_config cfg = ds_config(b);
    ht_param_store ps = {0};
    const char *module = "model.layers.3";
    assert_true(ht_moe_declare(&ps, module, &cfg, HT_DTYPE_F32));
    assert_int_equal(ps.count, b->shared ? 7 : 4);
    assert_ht_ok(ht_params_allocate(&ps, &err), &err);
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    const int C = b->C, N = b->N;
    for (int i = 0; i < ps.count; i++) {
        ht_param *p = &ps.items[i];
        float *v = p->data;
        const bool router = strstr(p->name, "gate.weight") != NULL, bias = strstr(p->name, "correction") != NULL;
        const double std = bias ? 0.1 : router ? 3.0 / sqrt(C) : 1.0 / sqrt((double)p->shape[p->ndim - 1]);
        for (int64_t j = 0; j < ht_param_numel(p); j++) v[j] = (float)(std * ht_rng_normal(&rng));
    }
    if (dtype != HT_DTYPE_F32) assert_ht_ok(ht_params_convert(&ps, dtype, &err), &err);
    assert_ht_ok(ht_params_set_compute(&ps, dtype, dtype, &err), &err);
    char name[HT_PARAM_NAME_MAX];
    snprintf(name, sizeof(name), "%s.mlp.gate.e_score_correction_bias", module);
    const ht_param *bias = ht_params_find(&ps, name);
    snprintf(name, sizeof(name), "%s.mlp.gate.weight", module);
    const ht_param *router = ht_params_find(&ps, name);
    assert_non_null(bias);
    assert_true(bias->dtype == HT_DTYPE_F32 && router->dtype == HT_DTYPE_F32); /* whatever the model dtype */
    assert_true(bias->compute_dtype == HT_DTYPE_F32 && router->compute_precision == HT_DTYPE_F32);
    assert_false(bias->trainable);
    assert_null(bias->main_grad);
    ht_moe *moe = ht_moe_new(&cfg, 1);
    ht_moe_bind(moe, 0, &ps, module);
    const ht_moe_params *mp = ht_moe_params_of(moe, 0);
    assert_ptr_equal(mp->bias, bias);
    assert_null(mp->sh_expert_gate);
    assert_true((mp->sh_gate != NULL) == (b->shared > 0));
    assert_ht_ok(ht_moe_begin(moe, N, NULL, NULL, &err), &err);

    /* x and dy; x as the compute dtype holds it. */
    const size_t es = ht_dtype_size(dtype);
    float *xf = malloc(sizeof(float) * N * C), *y = malloc(sizeof(float) * N * C), *dy = malloc(sizeof(float) * N * C),
          *dx = malloc(sizeof(float) * N * C);
    void *x = malloc(es * N * C);
    for (int i = 0; i < N * C; i++) {
        xf[i] = ht_rng_normal(&rng);
        dy[i] = ht_rng_normal(&rng);
    }
    ht_convert(x, dtype, xf, HT_DTYPE_F32, (size_t)N * C);
    ht_convert(xf, HT_DTYPE_F32, x, dtype, (size_t)N * C);
    ht_moe_forward(moe, 0, y, x, N, HT_DTYPE_F32);
    int64_t *tokens = ht_moe_expert_tokens(moe), total = 0;
    for (int e = 0; e < b->r.E; e++) total += tokens[e];
    assert_int_equal(total, (int64_t)N * b->r.k);
    ht_params_zero_grad(&ps);
    ht_moe_backward(moe, 0, dx, dy, x, N, 0.0f, HT_DTYPE_F32);

    /* The reference on the same (rounded) values. */
    ds_weights W = {.b = b};
    double **slot[] = {&W.gate_up, &W.down, &W.router, &W.bias, &W.sg, &W.su, &W.sd};
    const ht_param *ordered[7];
    for (int i = 0; i < ps.count; i++) {
        ordered[i] = &ps.items[i];
        *slot[i] = param_doubles(&ps.items[i]);
    }
    double *xd = malloc(sizeof(double) * N * C), *dyd = malloc(sizeof(double) * N * C),
           *yd = malloc(sizeof(double) * N * C), *scratch = malloc(sizeof(double) * N * C), margin;
    for (int i = 0; i < N * C; i++) {
        xd[i] = xf[i];
        dyd[i] = dy[i];
    }
    ref_block(&W, xd, yd, &margin);
    assert_true(margin > 1e-3); /* no choice flips under the differences' steps, nor by FP32 rounding */
    double ey = rel_err_d(y, yd, (int64_t)N * C);
    if (!(ey <= tol_y)) fail_msg("%s: y differs by %.3g (allowed %.1g)", ht_dtype_name(dtype), ey, tol_y);
    double *g = malloc(sizeof(double) * 65536);
    ref_grad(&W, xd, dyd, xd, (int64_t)N * C, g, scratch);
    double edx = rel_err_d(dx, g, (int64_t)N * C), worst = edx;
    if (!(edx <= tol_g)) fail_msg("%s: dx differs by %.3g (allowed %.1g)", ht_dtype_name(dtype), edx, tol_g);
    for (int i = 0; i < ps.count; i++) {
        const ht_param *p = ordered[i];
        if (p == bias) continue;
        const int64_t n = ht_param_numel(p);
        assert_true(n <= 65536);
        ref_grad(&W, xd, dyd, *slot[i], n, g, scratch);
        double e = rel_err_d(p->main_grad, g, n);
        if (!(e <= tol_g))
            fail_msg("%s: the gradient of %s differs by %.3g (allowed %.1g)", ht_dtype_name(dtype), p->name, e, tol_g);
        worst = fmax(worst, e);
    }
    printf("block E %d, groups %d/%d, k %d, norm %d, x %g, %d shared, %s: y within %.2g, dx and %d gradients within "
           "%.2g of float64 central differences; routing margin %.2g\n",
           b->r.E, b->r.tg, b->r.G, b->r.k, b->r.norm, b->r.scaling, b->shared, ht_dtype_name(dtype), ey, ps.count - 1,
           worst, margin);
    for (int i = 0; i < ps.count; i++) free(*slot[i]);
    free(g);
    free(xd);
    free(dyd);
    free(yd);
    free(scratch);
    free(xf);
    free(x);
    free(y);
    free(dy);
    free(dx);
    ht_moe_free(moe);
    ht_params_free(&ps);
}

/* FP32: 1e-5, the bound docs/NUMERICS.md sets FP32 sums of a few dozen
 * terms against float64; bf16 weights and x, FP32 router: the reference takes the same
 * rounded values, and the block rounds its activations (SwiGLU's output,
 * the output gradients) once each: 16 / 32 bf16 units, the dense bounds. */
static void test_deepseek_block(void **s) {
    (void)s;
    const ds_block a = {{8, 2, 4, 2, true, 2.5}, 24, 8, 1, 12};
    const ds_block b = {{6, 3, 1, 1, false, 1.5}, 16, 8, 2, 10};
    const ds_block c = {{8, 3, 2, 1, true, 1.0}, 20, 6, 0, 12};
    check_block(&a, HT_DTYPE_F32, 21, 1e-5, 1e-5);
    check_block(&b, HT_DTYPE_F32, 22, 1e-5, 1e-5);
    check_block(&c, HT_DTYPE_F32, 23, 1e-5, 1e-5);
    check_block(&a, HT_DTYPE_BF16, 21, 16 * bf16_u, 32 * bf16_u);
}

/* ---------------------------------------------------------------- the transformers fixtures */

/* A deepseek_v3 model with sparse layers, FP32. */
static ht_model *deepseek_model(const ht_model_config *cfg) {
    ht_model *m = NULL;
    ht_error err;
    assert_ht_ok(ht_model_build(cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    return m;
}

/* Each MoE layer's tokens per expert over the fixture's batch as
 * transformers routed them (expert_tokens after one forward), and the
 * aux-loss-free update of its e_score_correction_bias with those counts at
 * rate 1e-3 bit for bit as Megatron-Core's lines computed it
 * (bias_after.<l>; dsv3_b has experts exactly at the mean: sign 0). The
 * loss, logits and every gradient against transformers, FP32 1e-5; and with
 * bf16 weights (the routers and biases kept FP32, as from_pretrained keeps
 * them) the same experts' counts as transformers' bf16 model
 * (bf16_load.routing) and the logits within the dense bound of the FP32
 * reference. */
static void check_dsv3_fixture(const char *name) {
    char rel[256], key[HT_PARAM_NAME_MAX + 32], path[1200];
    ht_error err;
    snprintf(rel, sizeof(rel), "dsv3/%s", name);
    const char *dir = fixture_path(rel);
    ht_model_config cfg;
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    ht_safetensors *st;
    snprintf(path, sizeof(path), "%s/fixture.safetensors", dir);
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    const ht_st_tensor *in = need(st, "inputs");
    const int32_t *targets = need(st, "targets")->data;
    const int B = (int)in->shape[0], T = (int)in->shape[1], E = cfg.moe.num_experts, L = cfg.num_hidden_layers;
    const int sparse = ht_model_config_sparse_layers(&cfg);
    for (int pass = 0; pass < 2; pass++) {
        const ht_dtype dtype = pass ? HT_DTYPE_BF16 : HT_DTYPE_F32;
        ht_model *m = deepseek_model(&cfg);
        assert_ht_ok(ht_hf_load_weights(dir, &m->params, &err), &err);
        if (pass) assert_ht_ok(ht_params_convert(&m->params, dtype, &err), &err);
        assert_non_null(m->expert_tokens);
        ht_model_reset_expert_tokens(m);
        float loss;
        assert_ht_ok(ht_model_forward(m, in->data, targets, B, T, &loss, &err), &err);
        const size_t n = (size_t)B * T * cfg.vocab_size;
        const double le = rel_max_err(m->logits, need(st, "logits")->data, n);
        const float want_loss = *(const float *)need(st, "loss")->data;
        double *tokens = malloc(sizeof(double) * (size_t)sparse * E);
        int64_t moved = 0; /* bf16: routed rows on other experts than transformers' bf16 model's */
        for (int l = 0, i = 0; l < L; l++) {
            if (!ht_model_config_layer_is_sparse(&cfg, l)) continue;
            snprintf(key, sizeof(key), pass ? "bf16_load.routing.%d" : "tokens_per_expert.%d", l);
            const ht_st_tensor *t = need(st, key);
            int32_t want[256] = {0};
            if (pass) /* the fixture keeps bf16's expert sets: count them */
                for (int64_t r = 0; r < t->shape[0] * t->shape[1]; r++) want[((const int32_t *)t->data)[r]]++;
            else
                memcpy(want, t->data, sizeof(int32_t) * E);
            for (int e = 0; e < E; e++) {
                const int64_t got = m->expert_tokens[i * E + e];
                if (got != want[e] && !pass)
                    fail_msg("%s layer %d: expert %d got %lld tokens, transformers %d", name, l, e, (long long)got,
                             want[e]);
                moved += got > want[e] ? got - want[e] : 0;
                tokens[i * E + e] = (double)got;
            }
            i++;
        }
        /* bf16: the fixtures keep every token's k-th and next biased score, and the groups', 5e-3 apart
         * (make_dsv3_fixtures.py), past what another bf16 rounding of the router's input moves (this engine
         * rounds once where transformers' bf16 rounds twice, and keeps the residual stream FP32; at 1e-3
         * two routed rows of dsv3_b changed experts): every choice must be transformers' bf16 model's, and
         * the logits within the dense bf16 bound of FP32's. */
        const double tol = pass ? 16 * bf16_u : 1e-5;
        if (moved) fail_msg("%s bf16: %lld routed rows on other experts than transformers'", name, (long long)moved);
        if (!(le <= tol) || !(fabs(loss - want_loss) <= tol * want_loss))
            fail_msg("%s %s: logits differ by %.3g, loss %.7f vs %.7f", name, ht_dtype_name(dtype), le, loss,
                     want_loss);
        if (pass) {
            char rname[HT_PARAM_NAME_MAX];
            snprintf(rname, sizeof(rname), "model.layers.%d.mlp.gate.weight", L - 1);
            const ht_param *router = ht_params_find(&m->params, rname);
            snprintf(rname, sizeof(rname), "model.layers.%d.mlp.gate.e_score_correction_bias", L - 1);
            const ht_param *bias = ht_params_find(&m->params, rname);
            assert_true(router->dtype == HT_DTYPE_F32 && bias->dtype == HT_DTYPE_F32);
            assert_true(m->params.items[0].dtype == HT_DTYPE_BF16);
        }
        if (!pass) {
            ht_params_zero_grad(&m->params);
            ht_model_backward(m, 1.0f);
            double worst = 0;
            int checked = 0;
            for (int i = 0; i < m->params.count; i++) {
                ht_param *p = &m->params.items[i];
                if (!p->main_grad) continue; /* the correction biases */
                snprintf(key, sizeof(key), "grad.%s", p->name);
                const ht_st_tensor *g = need(st, key);
                assert_int_equal((int64_t)(g->nbytes / 4), ht_param_numel(p));
                double e = rel_max_err(p->main_grad, g->data, g->nbytes / 4);
                if (!(e <= 1e-5)) fail_msg("%s: the gradient of %s differs by %.3g", name, p->name, e);
                worst = fmax(worst, e);
                checked++;
            }
            /* The bias update, then each layer's bias against bias_after bit for bit. */
            ht_model_update_expert_bias(m, tokens, 1e-3);
            int moved = 0, zero = 0;
            for (int l = 0, i = 0; l < L; l++) {
                if (!ht_model_config_layer_is_sparse(&cfg, l)) continue;
                snprintf(key, sizeof(key), "model.layers.%d.mlp.gate.e_score_correction_bias", l);
                const ht_param *p = ht_params_find(&m->params, key);
                assert_non_null(p);
                assert_false(p->trainable);
                snprintf(key, sizeof(key), "bias_after.%d", l);
                const float *want = need(st, key)->data;
                if (memcmp(p->data, want, sizeof(float) * E) != 0)
                    fail_msg("%s layer %d: the updated correction bias differs from Megatron-Core's", name, l);
                double sum = 0;
                for (int e = 0; e < E; e++) sum += tokens[i * E + e];
                for (int e = 0; e < E; e++) zero += tokens[i * E + e] * E == sum;
                moved += E;
                i++;
            }
            printf("%s: logits %.2e, loss %.6f vs %.6f, worst of %d gradients %.2e; tokens per expert as "
                   "transformers' in %d layers; %d biases updated as Megatron-Core (%d at the mean)\n",
                   name, le, loss, want_loss, checked, worst, sparse, moved, zero);
        } else {
            printf("%s bf16 (routers and biases FP32): logits %.2e of FP32's (bound %.2g), %lld routed rows on "
                   "other experts than transformers' bf16 model's (logits %.2e of its)\n",
                   name, le, tol, (long long)moved, rel_max_err(m->logits, need(st, "bf16_load.logits")->data, n));
        }
        free(tokens);
        ht_model_free(m);
    }
    ht_safetensors_close(st);
}

static void test_deepseek_fixtures(void **s) {
    (void)s;
    check_dsv3_fixture("dsv3_a");
    check_dsv3_fixture("dsv3_b");
    check_dsv3_fixture("dsv3_c");
}

/* ---------------------------------------------------------------- training: the bias update, resumed and exported */

/* A tiny byte-level DeepSeek-V3 (MLA with q LoRA; 8 experts in 4 groups,
 * the best 2 kept, top-2, one shared expert, layer 0 dense) trained with the
 * aux-loss-free bias update at rate `rate`, in `dtype`. */
static void write_deepseek_run(const char *dir, const char *dtype, double rate, int steps) {
    harness_write_corpus(dir, two_cities, 20);
    write_run_yaml(dir,
                   "model:\n  name: deepseek_v3\n  vocab_size: 256\n  hidden_size: 32\n  intermediate_size: 48\n"
                   "  num_hidden_layers: 3\n  num_attention_heads: 4\n  num_key_value_heads: 4\n"
                   "  max_position_embeddings: 32\n  attention_bias: false\n"
                   "  q_lora_rank: 16\n  kv_lora_rank: 16\n  qk_nope_head_dim: 8\n  qk_rope_head_dim: 4\n"
                   "  v_head_dim: 8\n  num_experts: 8\n  num_experts_per_tok: 2\n  moe_intermediate_size: 16\n"
                   "  n_shared_experts: 1\n  n_group: 4\n  topk_group: 2\n  routed_scaling_factor: 2.5\n"
                   "  norm_topk_prob: true\n  first_k_dense_replace: 1\n  moe_router_bias_update_rate: %g\n"
                   "model_init_dtype: %s\n"
                   "data:\n  path: %s/corpus.txt\n  seq_len: 16\n  valid_fraction: 0.1\n"
                   "optimizer:\n  _target_: Muon\n"
                   "training:\n  steps: %d\n  local_batch_size: 2\n  global_batch_size: 4\n  eval_interval: 0\n"
                   "  log_interval: 1\n"
                   "fsdp_config:\n  mix_precision:\n    param_dtype: %s\n"
                   "kernels:\n  bf16_gemm: fp32_rounded\n"
                   "checkpoint:\n  save_interval: 2\n  keep_last: 0\n",
                   rate, dtype, dir, steps, dtype);
}

static int train_in(const char *dir, const char *out, const char *extra, char **log) {
    char args[4096], path[1300];
    snprintf(path, sizeof(path), "%s/%s.log", dir, out);
    snprintf(args, sizeof(args), "train '%s/run.yaml' --set checkpoint.output_dir='%s/%s' %s", dir, dir, out,
             extra ? extra : "");
    return run_hypertrain(NULL, args, path, false, log);
}

/* The correction bias of layer l in a safetensors file (`prefix` before the name), into b (E floats). */
static void read_bias(const char *path, const char *prefix, int l, float *b, int E, ht_dtype *dtype) {
    ht_error err;
    ht_safetensors *st;
    char key[HT_PARAM_NAME_MAX + 32];
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    snprintf(key, sizeof(key), "%smodel.layers.%d.mlp.gate.e_score_correction_bias", prefix, l);
    const ht_st_tensor *t = need(st, key);
    assert_int_equal(t->ndim, 1);
    assert_int_equal(t->shape[0], E);
    *dtype = t->dtype;
    ht_convert(b, HT_DTYPE_F32, t->data, t->dtype, (size_t)E);
    ht_safetensors_close(st);
}

/* 4 steps saving at 2 and 4, against the same run resumed from step 2: the
 * final weights (the correction biases among them) bit for bit. The biases
 * moved: every element a sum of +-rate steps, at most 4 of them, some not 0.
 * Then the checkpoint exported as transformers loads it (the biases under
 * their names, FP32 also from the bf16 model) and read back. */
static void check_deepseek_resume(const char *dtype) {
    char name[64], a[1300], b[1300], *log;
    snprintf(name, sizeof(name), "dsv3_resume_%s", dtype);
    const char *dir = scratch_dir(name);
    const double rate = 0.01;
    write_deepseek_run(dir, dtype, rate, 4);
    ht_model_config probe = {0};
    snprintf(probe.name, sizeof(probe.name), "deepseek_v3");
    int rc = train_in(dir, "full", NULL, &log);
    if (rc != 0) fail_msg("the 4-step run failed:\n%s", log);
    assert_non_null(strstr(log, "deepseek_v3: aux-loss-free balancing, rate 0.01, over the global batch"));
    assert_non_null(strstr(log, "AdamW  model.layers.1.mlp.gate.weight"));
    assert_null(strstr(log, "model.layers.1.mlp.gate.e_score_correction_bias ")); /* no optimizer */
    free(log);
    char extra[1600];
    snprintf(extra, sizeof(extra), "--set checkpoint.restore_from='%s/full/step_00000002'", dir);
    rc = train_in(dir, "resumed", extra, &log);
    if (rc != 0) fail_msg("the resumed run failed:\n%s", log);
    assert_null(strstr(log, "step     2/4"));
    assert_non_null(strstr(log, "step     4/4"));
    free(log);
    snprintf(a, sizeof(a), "%s/full/final/model.safetensors", dir);
    snprintf(b, sizeof(b), "%s/resumed/final/model.safetensors", dir);
    assert_same_tensors(a, b);
    float bias[8], saved[8], exported[8];
    ht_dtype dt;
    int moved = 0;
    for (int l = 1; l < 3; l++) {
        read_bias(a, "", l, bias, 8, &dt);
        assert_int_equal(dt, HT_DTYPE_F32);
        snprintf(b, sizeof(b), "%s/full/step_00000004/rank_00000.safetensors", dir);
        read_bias(b, "model.", l, saved, 8, &dt);
        assert_int_equal(dt, HT_DTYPE_F32); /* FP32 in the checkpoint whatever the model dtype */
        assert_memory_equal(bias, saved, sizeof(bias));
        for (int e = 0; e < 8; e++) {
            const double steps = bias[e] / rate;
            if (!(fabs(steps) <= 4 + 1e-4 && fabs(steps - round(steps)) < 1e-4))
                fail_msg("layer %d expert %d: bias %.9g is not a sum of at most 4 steps of %g", l, e, bias[e], rate);
            moved += bias[e] != 0;
        }
    }
    assert_true(moved > 0);
    /* Exported (the checkpoint's dtype), then loaded into the model the export's config.json builds. */
    ht_error err;
    snprintf(a, sizeof(a), "%s/full/step_00000004", dir);
    snprintf(b, sizeof(b), "%s/exported", dir);
    assert_ht_ok(ht_ckpt_export(a, b, HT_DTYPE_COUNT, 0, &err), &err);
    ht_model_config cfg;
    assert_ht_ok(ht_hf_read_config(b, &cfg, &err), &err);
    assert_true(ht_model_config_is_deepseek(&cfg));
    ht_model *m = deepseek_model(&cfg);
    assert_ht_ok(ht_hf_load_weights(b, &m->params, &err), &err);
    snprintf(a, sizeof(a), "%s/exported/model.safetensors", dir);
    for (int l = 1; l < 3; l++) {
        snprintf(b, sizeof(b), "%s/full/final/model.safetensors", dir);
        read_bias(b, "", l, bias, 8, &dt);
        read_bias(a, "", l, exported, 8, &dt);
        assert_int_equal(dt, HT_DTYPE_F32);
        assert_memory_equal(bias, exported, sizeof(bias));
        char key[HT_PARAM_NAME_MAX];
        snprintf(key, sizeof(key), "model.layers.%d.mlp.gate.e_score_correction_bias", l);
        assert_memory_equal(ht_params_find(&m->params, key)->data, bias, sizeof(bias));
    }
    ht_model_free(m);
    printf("deepseek_v3 %s, rate %g: 4 steps and the run resumed from step 2 end on the same bits; %d of 16 "
           "correction biases moved; exported and read back in FP32\n",
           dtype, rate, moved);
}

static void test_deepseek_bias_resume(void **s) {
    (void)s;
    check_deepseek_resume("float32");
    check_deepseek_resume("bfloat16");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moe_untied_f32),
        cmocka_unit_test(test_moe_tied_norm_f32),
        cmocka_unit_test(test_moe_experts_without_tokens),
        cmocka_unit_test(test_moe_bf16),
        cmocka_unit_test(test_moe_bad_configs),
        cmocka_unit_test(test_moe_checkpoints),
        cmocka_unit_test(test_deepseek_routing),
        cmocka_unit_test(test_deepseek_block),
        cmocka_unit_test(test_deepseek_fixtures),
        cmocka_unit_test(test_deepseek_bias_resume),
    };
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
