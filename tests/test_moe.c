/* Qwen2-MoE against Hugging Face transformers: small random models (8
 * experts, a shared expert, dense layers by mlp_only_layers and by
 * decoder_sparse_step, top-2 and top-3, norm_topk_prob off and on) whose
 * logits, loss, load-balancing loss and every gradient must match the
 * committed fixtures (tools/reference/make_moe_fixtures.py), including a
 * batch where some experts receive no token; and the refusals of bad MoE
 * configs and checkpoints. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/model.h"

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

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_moe_untied_f32),
        cmocka_unit_test(test_moe_tied_norm_f32),
        cmocka_unit_test(test_moe_experts_without_tokens),
        cmocka_unit_test(test_moe_bf16),
        cmocka_unit_test(test_moe_bad_configs),
        cmocka_unit_test(test_moe_checkpoints),
    };
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
