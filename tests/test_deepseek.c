/* DeepSeek-V3 against Hugging Face transformers: small random
 * DeepseekV3ForCausalLM models (tools/reference/make_dsv3_fixtures.py)
 * that between them turn every switch of Multi-Latent Attention and
 * DeepSeekMoE: q_lora_rank set and null, rope_interleave both ways, YaRN on
 * and off, group-limited routing, 0 to 2 shared experts, norm_topk_prob both
 * ways, dense first layers. Logits, loss and every gradient must match
 * within docs/NUMERICS.md's bounds. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/model.h"
#include "hypertrain/optimizer.h"

static const ht_st_tensor *need(ht_safetensors *st, const char *name) {
    const ht_st_tensor *t = ht_safetensors_find(st, name);
    if (!t) fail_msg("the fixture has no %s", name);
    return t;
}

static ht_model *load_model(const char *dir, ht_dtype dtype) {
    ht_model_config cfg;
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_string_equal(cfg.name, "deepseek_v3");
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    assert_ht_ok(ht_hf_load_weights(dir, &m->params, &err), &err);
    if (dtype != HT_DTYPE_F32) assert_ht_ok(ht_params_convert(&m->params, dtype, &err), &err);
    return m;
}

/* The model with hypertrain's logits of its inputs, in Hugging Face's layout
 * as hypertrain writes it, into the build tree's scratch/export_<case>/:
 * tools/reference/check_hypertrain_exports.sh has transformers load it and
 * compare the logits. */
static void export_for_transformers(const char *name, ht_model *m, const ht_st_tensor *inputs) {
    const char *dir = export_with_logits(name, m, inputs->data, (int)inputs->shape[0], (int)inputs->shape[1]);
    /* What was written reads back as the same model, weights and all. */
    ht_model *back = load_model(dir, HT_DTYPE_F32);
    assert_int_equal(back->params.count, m->params.count);
    for (int i = 0; i < m->params.count; i++)
        assert_memory_equal(back->params.items[i].data, m->params.items[i].data,
                            (size_t)ht_param_numel(&m->params.items[i]) * sizeof(float));
    ht_model_free(back);
}

/* The fixture's batch through the model of case `name`: logits and loss
 * within tol_logits of transformers', every gradient within tol_grads of
 * its largest magnitude. */
static void check_case(const char *name, ht_dtype dtype, const char *prefix, double tol_logits, double tol_grads) {
    char rel[256], key[HT_PARAM_NAME_MAX + 32];
    ht_error err;
    ht_safetensors *st;
    snprintf(rel, sizeof(rel), "dsv3/%s", name);
    const char *dir = fixture_path(rel);
    char path[1024];
    snprintf(path, sizeof(path), "%s/fixture.safetensors", dir);
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    const ht_st_tensor *in = need(st, "inputs");
    const int32_t *targets = need(st, "targets")->data;
    snprintf(key, sizeof(key), "%slogits", prefix);
    const float *want_logits = need(st, key)->data;
    snprintf(key, sizeof(key), "%sloss", prefix);
    const float want_loss = *(const float *)need(st, key)->data;
    const int B = (int)in->shape[0], T = (int)in->shape[1];

    ht_model *m = load_model(dir, dtype);
    float loss;
    assert_ht_ok(ht_model_forward(m, in->data, targets, B, T, &loss, &err), &err);
    const size_t n = (size_t)B * T * m->config.vocab_size;
    double logits_err = rel_max_err(m->logits, want_logits, n);
    if (!(logits_err <= tol_logits))
        fail_msg("%s %s: logits differ by %.3g (allowed %.1g)", name, ht_dtype_name(dtype), logits_err, tol_logits);
    if (!(fabs(loss - want_loss) <= tol_logits * fabs(want_loss)))
        fail_msg("%s %s: loss %.8f, transformers %.8f", name, ht_dtype_name(dtype), loss, want_loss);
    double worst = 0;
    int checked = 0;
    if (dtype == HT_DTYPE_F32) export_for_transformers(name, m, in);
    if (dtype == HT_DTYPE_F32) {
        ht_params_zero_grad(&m->params);
        ht_model_backward(m, 1.0f);
        for (int i = 0; i < m->params.count; i++) {
            ht_param *p = &m->params.items[i];
            if (!p->main_grad) continue; /* never trained: the routers' correction biases */
            snprintf(key, sizeof(key), "grad.%s", p->name);
            const ht_st_tensor *g = need(st, key);
            assert_int_equal((int64_t)(g->nbytes / 4), ht_param_numel(p));
            double e = rel_max_err(p->main_grad, g->data, g->nbytes / 4);
            if (!(e <= tol_grads))
                fail_msg("%s: gradient of %s differs by %.3g of its largest magnitude (allowed %.1g)", name, p->name, e,
                         tol_grads);
            worst = e > worst ? e : worst;
            checked++;
        }
    }
    printf("%-10s %-8s logits %.2e, loss %.6f vs %.6f, worst gradient %.2e over %d tensors\n", name,
           ht_dtype_name(dtype), logits_err, loss, want_loss, worst, checked);
    ht_model_free(m);
    ht_safetensors_close(st);
}

/* FP32: docs/NUMERICS.md's 1e-5 of each tensor's largest magnitude. */
static void test_mla_dense_a_f32(void **s) {
    (void)s;
    check_case("mla_dense_a", HT_DTYPE_F32, "", 1e-5, 1e-5);
}
static void test_mla_dense_b_f32(void **s) {
    (void)s;
    check_case("mla_dense_b", HT_DTYPE_F32, "", 1e-5, 1e-5);
}

/* model.recompute on MLA's layers: the same gradients bit for bit, the
 * latents and rotary key rebuilt from the layer's input. */
static void test_mla_recompute_bitwise(void **s) {
    (void)s;
    ht_error err;
    ht_model *m = load_model(fixture_path("dsv3/mla_dense_a"), HT_DTYPE_F32);
    ht_safetensors *st;
    char path[1024];
    snprintf(path, sizeof(path), "%s/fixture.safetensors", fixture_path("dsv3/mla_dense_a"));
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    const ht_st_tensor *in = need(st, "inputs");
    const int32_t *targets = need(st, "targets")->data;
    const int B = (int)in->shape[0], T = (int)in->shape[1];
    float *kept[64] = {0};
    float loss[2];
    assert_true(m->params.count <= 64);
    for (int pass = 0; pass < 2; pass++) {
        const char *all[] = {"model.layers.{*}"};
        assert_ht_ok(ht_model_set_recompute(m, all, pass, &err), &err);
        assert_ht_ok(ht_model_forward(m, in->data, targets, B, T, &loss[pass], &err), &err);
        ht_params_zero_grad(&m->params);
        ht_model_backward(m, 1.0f);
        for (int i = 0; i < m->params.count; i++) {
            ht_param *p = &m->params.items[i];
            const size_t bytes = (size_t)ht_param_numel(p) * sizeof(float);
            if (pass == 0) {
                kept[i] = malloc(bytes);
                memcpy(kept[i], p->main_grad, bytes);
            } else if (memcmp(kept[i], p->main_grad, bytes) != 0) {
                fail_msg("recomputed: the gradient of %s differs", p->name);
            }
        }
    }
    assert_memory_equal(&loss[0], &loss[1], sizeof(float));
    for (int i = 0; i < m->params.count; i++) free(kept[i]);
    ht_model_free(m);
    ht_safetensors_close(st);
}

/* QK-clip on MLA against the rule in double (Kimi K2, MindFormers'
 * apply_qk_clip_scaling): for a head whose largest logit S passed tau,
 * gamma = tau / S; its q_nope rows times sqrt(gamma), its q_pe rows times
 * gamma, its k_nope rows of kv_b_proj times sqrt(gamma); its v rows, the
 * other heads' rows and kv_a_proj_with_mqa (the shared rotary key) unchanged. */
static void check_qk_clip(const char *name, const char *q_name) {
    ht_model *m = load_model(fixture_path(name), HT_DTYPE_F32);
    const ht_model_config *c = &m->config;
    const int H = c->num_attention_heads, Dn = c->mla.qk_nope_head_dim, Dr = c->mla.qk_rope_head_dim,
              Dv = c->mla.v_head_dim;
    ht_qk_layer q = {0};
    q.q_weight = ht_params_find(&m->params, q_name);
    q.kv_b = q.k_weight = ht_params_find(&m->params, "model.layers.1.self_attn.kv_b_proj.weight");
    ht_param *kva = ht_params_find(&m->params, "model.layers.1.self_attn.kv_a_proj_with_mqa.weight");
    assert_non_null(q.q_weight);
    assert_non_null(q.kv_b);
    assert_non_null(kva);
    q.num_heads = q.num_kv_heads = H, q.nope = Dn, q.rope = Dr, q.v_dim = Dv;
    ht_param *ps[3] = {q.q_weight, q.kv_b, kva};
    float *before[3];
    for (int i = 0; i < 3; i++) {
        size_t bytes = (size_t)ht_param_numel(ps[i]) * sizeof(float);
        before[i] = malloc(bytes);
        memcpy(before[i], ps[i]->data, bytes);
    }
    const double tau = 5.0;
    const float max_logit[4] = {3.0f, 20.0f, 5.0f, 7.5f}; /* heads 1 and 3 pass tau; 2 sits on it */
    assert_true(H == 4);
    assert_int_equal(ht_qk_clip(&q, max_logit, tau), 2);
    for (int i = 0; i < 3; i++) {
        const ht_param *p = ps[i];
        const int64_t cols = p->shape[1], rows = p->shape[0];
        const float *now = p->data;
        for (int64_t r = 0; r < rows; r++) {
            double k = 1.0;
            if (i == 0 || i == 1) {
                const int64_t per = i == 0 ? Dn + Dr : Dn + Dv, h = r / per, at = r % per;
                const double gamma = max_logit[h] > tau ? tau / max_logit[h] : 1.0;
                k = at < Dn ? sqrt(gamma) : i == 0 ? gamma : 1.0; /* q_nope, k_nope; q_pe; v */
            }
            for (int64_t col = 0; col < cols; col++) {
                const float was = before[i][r * cols + col], got = now[r * cols + col];
                if (k == 1.0 && memcmp(&was, &got, sizeof(float)) != 0)
                    fail_msg("%s: %s row %lld moved (%.9g -> %.9g)", name, p->name, (long long)r, was, got);
                if (k != 1.0 && !(fabs(got - was * k) <= 1e-6 * fabs(was * k)))
                    fail_msg("%s: %s row %lld: %.9g, the rule gives %.9g", name, p->name, (long long)r, got, was * k);
            }
        }
        free(before[i]);
    }
    ht_model_free(m);
}

static void test_qk_clip_on_mla(void **s) {
    (void)s;
    check_qk_clip("dsv3/mla_dense_a", "model.layers.1.self_attn.q_b_proj.weight");
    check_qk_clip("dsv3/mla_dense_b", "model.layers.1.self_attn.q_proj.weight");
}

/* config.json both ways: every case's fields read, written back and read
 * again to the same values (YaRN, MLA's widths, DeepSeekMoE's routing). */
static void test_config_round_trip(void **s) {
    (void)s;
    const char *cases[] = {"dsv3/mla_dense_a", "dsv3/mla_dense_b", "dsv3/dsv3_a", "dsv3/dsv3_b", "dsv3/dsv3_c"};
    const char *out = scratch_dir("dsv3_config");
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ht_model_config a, b;
        ht_error err;
        assert_ht_ok(ht_hf_read_config(fixture_path(cases[i]), &a, &err), &err);
        assert_ht_ok(ht_model_config_validate(&a, &err), &err);
        assert_ht_ok(ht_hf_write_config(out, &a, HT_DTYPE_BF16, &err), &err);
        assert_ht_ok(ht_hf_read_config(out, &b, &err), &err);
        assert_string_equal(b.name, "deepseek_v3");
        assert_memory_equal(&a.mla, &b.mla, sizeof(a.mla));
        assert_memory_equal(&a.rope_scaling, &b.rope_scaling, sizeof(a.rope_scaling));
        assert_memory_equal(&a.moe, &b.moe, sizeof(a.moe));
        assert_int_equal(a.hidden_size, b.hidden_size);
        assert_int_equal(a.intermediate_size, b.intermediate_size);
        assert_true(a.rope_theta == b.rope_theta && a.rms_norm_eps == b.rms_norm_eps);
        assert_int_equal(a.tie_word_embeddings, b.tie_word_embeddings);
        assert_false(b.attention_bias);
    }
    ht_model_config a;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(fixture_path("dsv3/mla_dense_a"), &a, &err), &err);
    assert_int_equal(a.mla.q_lora_rank, 24);
    assert_true(ht_rope_is_yarn(&a.rope_scaling) && a.rope_scaling.mscale_all_dim == 0.8);
    assert_int_equal(a.moe.first_k_dense_replace, 2);
    assert_ht_ok(ht_hf_read_config(fixture_path("dsv3/mla_dense_b"), &a, &err), &err);
    assert_int_equal(a.mla.q_lora_rank, 0); /* null: q_proj */
    assert_false(a.mla.rope_interleave);
}

/* A DeepSeek-V3 config.json with one field made wrong: each a clear error
 * naming the field (read, or the architecture checks that follow). */
static void test_bad_config_json(void **s) {
    (void)s;
    char *base;
    char path[1200];
    ht_error err;
    snprintf(path, sizeof(path), "%s/config.json", fixture_path("dsv3/dsv3_a"));
    assert_ht_ok(ht_read_file(path, &base, NULL, &err), &err);
    const struct {
        const char *from, *to, *needle;
    } cases[] = {
        {"\"qk_rope_head_dim\": 4", "\"qk_rope_head_dim\": 5", "model.qk_rope_head_dim must be even"},
        {"\"n_routed_experts\": 8", "\"n_routed_experts\": 9", "divide model.n_routed_experts (9)"},
        {"\"topk_group\": 2", "\"topk_group\": 5", "model.topk_group must be between 1 and model.n_group (4)"},
        {"\"num_experts_per_tok\": 2", "\"num_experts_per_tok\": 5", "more than the experts the kept groups hold"},
        {"\"factor\": 4.0", "\"factor\": 0.5", "model.rope_scaling.factor must be a number >= 1"},
        {"\"original_max_position_embeddings\": 16", "\"original_max_position_embeddings\": -3",
         "\"original_max_position_embeddings\" must be a non-negative integer"},
        {"\"rope_type\": \"yarn\"", "\"rope_type\": \"longrope\"", "type longrope is not supported"},
        {"\"q_lora_rank\": 24", "\"q_lora_rank\": 0", "\"q_lora_rank\" must be positive or null"},
        {"\"kv_lora_rank\": 16", "\"kv_lora_rank\": \"16\"", "\"kv_lora_rank\" must be a non-negative integer"},
        {"\"kv_lora_rank\": 16", "\"kv_lora_rank\": 16, \"quantization_config\": {\"quant_method\": \"fp8\"}",
         "quantization_config (fp8): quantized weights are not supported"},
    };
    const char *dir = scratch_dir("dsv3_bad_config");
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        const char *at = strstr(base, cases[i].from);
        if (!at) fail_msg("dsv3_a's config.json has no %s", cases[i].from);
        char text[8192];
        snprintf(text, sizeof(text), "%.*s%s%s", (int)(at - base), base, cases[i].to, at + strlen(cases[i].from));
        snprintf(path, sizeof(path), "%s/config.json", dir);
        FILE *f = fopen(path, "w");
        assert_non_null(f);
        fputs(text, f);
        fclose(f);
        ht_model_config cfg;
        ht_status st = ht_hf_read_config(dir, &cfg, &err);
        if (st == HT_OK) st = ht_model_config_validate(&cfg, &err);
        if (st == HT_OK) fail_msg("no error for %s", cases[i].to);
        if (!strstr(err.msg, cases[i].needle))
            fail_msg("%s: expected \"%s\" in: %s", cases[i].to, cases[i].needle, err.msg);
    }
    free(base);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mla_dense_a_f32),       cmocka_unit_test(test_mla_dense_b_f32),
        cmocka_unit_test(test_mla_recompute_bitwise), cmocka_unit_test(test_qk_clip_on_mla),
        cmocka_unit_test(test_config_round_trip),     cmocka_unit_test(test_bad_config_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
