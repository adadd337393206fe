/* LoRA against Hugging Face PEFT (tools/reference/make_lora_fixtures.py):
 * for three cases (Qwen2 tied with q/v adapters, Llama untied with all
 * seven projections, Qwen2 untied with rsLoRA on o/down), base/ + adapter/
 * loaded through the engine's own readers give PEFT's logits, loss and every
 * lora_A / lora_B gradient, with no gradient for the frozen base; the merge
 * gives merged/ and its logits; an adapter written and read back is the
 * same; and bad settings are refused by name. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/model.h"

static const char *const CASES[] = {"qwen2_tied_qv", "llama_untied_all", "qwen2_untied_rslora"};

typedef struct fixture {
    char base[600], adapter[600], merged[600];
    ht_safetensors *st;
    const int32_t *inputs, *targets;
    const float *logits, *merged_logits;
    float loss;
    int B, T;
} fixture;

static const float *tensor_f32(ht_safetensors *st, const char *name) {
    const ht_st_tensor *t = ht_safetensors_find(st, name);
    if (!t) fail_msg("%s has no tensor %s", ht_safetensors_path(st), name);
    assert_int_equal(t->dtype, HT_DTYPE_F32);
    return t->data;
}

static void open_fixture(const char *name, fixture *f) {
    char rel[256];
    ht_error err;
    snprintf(rel, sizeof(rel), "lora/%s/base", name);
    snprintf(f->base, sizeof(f->base), "%s", fixture_path(rel));
    snprintf(rel, sizeof(rel), "lora/%s/adapter", name);
    snprintf(f->adapter, sizeof(f->adapter), "%s", fixture_path(rel));
    snprintf(rel, sizeof(rel), "lora/%s/merged", name);
    snprintf(f->merged, sizeof(f->merged), "%s", fixture_path(rel));
    snprintf(rel, sizeof(rel), "lora/%s/fixture.safetensors", name);
    assert_ht_ok(ht_safetensors_open(fixture_path(rel), &f->st, &err), &err);
    const ht_st_tensor *in = ht_safetensors_find(f->st, "inputs");
    assert_non_null(in);
    f->inputs = in->data;
    f->targets = ht_safetensors_find(f->st, "targets")->data;
    f->logits = tensor_f32(f->st, "logits");
    f->merged_logits = tensor_f32(f->st, "merged_logits");
    f->loss = *tensor_f32(f->st, "loss");
    f->B = (int)in->shape[0];
    f->T = (int)in->shape[1];
}

/* base/ + adapter/ through the engine's readers: config.json, the adapter's
 * settings as model.lora, the base weights, then the adapters; the base frozen. */
static ht_model *load_lora_model(const fixture *f) {
    ht_model_config cfg;
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(f->base, &cfg, &err), &err);
    assert_ht_ok(ht_peft_read_config(f->adapter, &cfg.lora, &err), &err);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    assert_ht_ok(ht_hf_load_weights(f->base, &m->params, &err), &err);
    assert_ht_ok(ht_peft_load_adapter(f->adapter, &cfg.lora, &m->params, &err), &err);
    assert_ht_ok(ht_lora_freeze_base(&m->params, NULL, &err), &err);
    return m;
}

static void expect_close(const char *c, const char *what, const float *got, const float *want, size_t n, double tol,
                         double *worst) {
    double e = rel_max_err(got, want, n);
    if (!(e <= tol)) fail_msg("%s: %s differs by %.3g of its largest magnitude (allowed %.1g)", c, what, e, tol);
    if (e > *worst) *worst = e;
}

/* Forward and backward against PEFT: FP32, 1e-5 of each tensor's largest magnitude (docs/NUMERICS.md). */
static void check_parity(const char *c) {
    fixture f;
    open_fixture(c, &f);
    ht_model *m = load_lora_model(&f);
    ht_error err;
    float loss;
    assert_ht_ok(ht_model_forward(m, f.inputs, f.targets, f.B, f.T, &loss, &err), &err);
    size_t nlogits = (size_t)f.B * f.T * (size_t)m->config.vocab_size;
    double logits_err = 0, grad_err = 0;
    expect_close(c, "logits", m->logits, f.logits, nlogits, 1e-5, &logits_err);
    if (!(fabs(loss - f.loss) <= 1e-5 * fabs(f.loss))) fail_msg("%s: loss %.8f, PEFT %.8f", c, loss, f.loss);
    ht_params_zero_grad(&m->params);
    ht_model_backward(m, 1.0f);
    int adapters = 0;
    for (int i = 0; i < m->params.count; i++) {
        const ht_param *p = &m->params.items[i];
        if (!ht_lora_kind(p->name)) { /* frozen: no gradient buffer at all */
            if (p->trainable || p->main_grad || p->grad) fail_msg("%s: base param %s has a gradient", c, p->name);
            continue;
        }
        char key[HT_PARAM_NAME_MAX + 32];
        snprintf(key, sizeof(key), "grad." HT_PEFT_PREFIX "%s", p->name);
        const ht_st_tensor *g = ht_safetensors_find(f.st, key);
        if (!g) fail_msg("%s: the fixture has no %s", c, key);
        assert_int_equal((int64_t)(g->nbytes / 4), ht_param_numel(p));
        expect_close(c, p->name, p->main_grad, g->data, g->nbytes / 4, 1e-5, &grad_err);
        adapters++;
    }
    int in_fixture = 0;
    for (int i = 0; i < ht_safetensors_count(f.st); i++)
        in_fixture += strncmp(ht_safetensors_tensor(f.st, i)->name, "grad.", 5) == 0;
    assert_int_equal(adapters, in_fixture);
    printf("%-20s logits error %.2e, loss %.7f vs PEFT %.7f, worst of %d adapter gradients %.2e\n", c, logits_err, loss,
           f.loss, adapters, grad_err);
    ht_model_free(m);
    ht_safetensors_close(f.st);
}

static void test_parity_qwen2_tied_qv(void **s) {
    (void)s;
    check_parity("qwen2_tied_qv");
}
static void test_parity_llama_untied_all(void **s) {
    (void)s;
    check_parity("llama_untied_all");
}
/* DeepSeek-V3's Multi-Latent Attention: adapters on q_a_proj, q_b_proj,
 * kv_a_proj_with_mqa, kv_b_proj and o_proj. */
static void test_parity_deepseek_mla(void **s) {
    (void)s;
    check_parity("deepseek_mla");
}
static void test_parity_qwen2_untied_rslora(void **s) {
    (void)s;
    check_parity("qwen2_untied_rslora");
}

/* bf16 adapters and base against PEFT's FP32 numbers, on the bf16 storage
 * path and on each kernel the trainer may pick (ht_model_set_compute): the
 * bounds of test_reference's bf16 cases (16u for the logits, 32u for the
 * gradients, u = 2^-9), since the adapters add GEMM stages of the same kind
 * (their h and dh are rounded to bf16 like every other GEMM operand). */
static void check_parity_bf16(const char *c, bool set_compute) {
    const double u = 0x1p-9;
    fixture f;
    open_fixture(c, &f);
    ht_model *m = load_lora_model(&f);
    ht_error err;
    assert_ht_ok(ht_params_convert(&m->params, HT_DTYPE_BF16, &err), &err);
    if (set_compute) assert_ht_ok(ht_model_set_compute(m, HT_DTYPE_BF16, &err), &err);
    float loss;
    assert_ht_ok(ht_model_forward(m, f.inputs, f.targets, f.B, f.T, &loss, &err), &err);
    double logits_err = 0, grad_err = 0;
    expect_close(c, "bf16 logits", m->logits, f.logits, (size_t)f.B * f.T * (size_t)m->config.vocab_size, 16 * u,
                 &logits_err);
    ht_params_zero_grad(&m->params);
    ht_model_backward(m, 1.0f);
    for (int i = 0; i < m->params.count; i++) {
        const ht_param *p = &m->params.items[i];
        if (!ht_lora_kind(p->name)) continue;
        char key[HT_PARAM_NAME_MAX + 32];
        snprintf(key, sizeof(key), "grad." HT_PEFT_PREFIX "%s", p->name);
        const ht_st_tensor *g = ht_safetensors_find(f.st, key);
        expect_close(c, p->name, p->main_grad, g->data, g->nbytes / 4, 32 * u, &grad_err);
    }
    printf("%-20s bf16%s: logits error %.2e (%.1fu), worst adapter gradient error %.2e (%.1fu)\n", c,
           set_compute ? " (set_compute)" : "", logits_err, logits_err / u, grad_err, grad_err / u);
    ht_model_free(m);
    ht_safetensors_close(f.st);
}

static void test_parity_bf16(void **state) {
    (void)state;
    static const ht_gemm_kernel kernels[] = {HT_GEMM_KERNEL_NATIVE, HT_GEMM_KERNEL_WIDENED,
                                             HT_GEMM_KERNEL_FP32_ROUNDED};
    for (size_t c = 0; c < sizeof(CASES) / sizeof(CASES[0]); c++) check_parity_bf16(CASES[c], false);
    for (int k = 0; k < 3; k++)
        if (use_gemm_kernel(HT_DTYPE_BF16, kernels[k])) check_parity_bf16("llama_untied_all", true);
}

/* ht_lora_merge against merge_and_unload(): every weight of merged/ (the
 * untargeted ones bit for bit), saved as Hugging Face weights without any
 * lora tensor, and the saved folder, loaded as a plain model, gives
 * merged_logits. */
static void test_merge_matches_peft(void **state) {
    (void)state;
    for (size_t c = 0; c < sizeof(CASES) / sizeof(CASES[0]); c++) {
        fixture f;
        open_fixture(CASES[c], &f);
        ht_model *m = load_lora_model(&f);
        ht_error err;
        ht_param_store merged;
        assert_ht_ok(ht_lora_merge(&m->params, ht_lora_scale(&m->config.lora), &merged, &err), &err);
        char path[700];
        snprintf(path, sizeof(path), "%s/model.safetensors", f.merged);
        ht_safetensors *ref;
        assert_ht_ok(ht_safetensors_open(path, &ref, &err), &err);
        assert_int_equal(merged.count, ht_safetensors_count(ref));
        double worst = 0;
        int changed = 0;
        for (int i = 0; i < merged.count; i++) {
            const ht_param *p = &merged.items[i];
            assert_int_equal(ht_lora_kind(p->name), 0);
            const float *want = tensor_f32(ref, p->name);
            size_t n = (size_t)ht_param_numel(p);
            float *got = malloc(n * sizeof(float));
            ht_convert(got, HT_DTYPE_F32, p->data, p->dtype, n);
            const ht_param *orig = ht_params_find(&m->params, p->name);
            if (p->data == orig->data) { /* not adapted: borrowed as it is */
                if (memcmp(got, want, n * sizeof(float)) != 0) fail_msg("%s: %s changed", CASES[c], p->name);
            } else {
                expect_close(CASES[c], p->name, got, want, n, 1e-6, &worst);
                changed++;
            }
            free(got);
        }
        char sub[128];
        snprintf(sub, sizeof(sub), "merged_%s", CASES[c]);
        const char *dir = scratch_dir(sub);
        assert_ht_ok(ht_hf_save(dir, &m->config, &merged, HT_DTYPE_F32, 0, &err), &err);
        ht_params_free(&merged);
        ht_safetensors_close(ref);

        ht_model_config cfg;
        ht_model *plain;
        assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
        assert_int_equal(cfg.lora.rank, 0);
        assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &plain, &err), &err);
        assert_ht_ok(ht_hf_load_weights(dir, &plain->params, &err), &err);
        float loss;
        assert_ht_ok(ht_model_forward(plain, f.inputs, f.targets, f.B, f.T, &loss, &err), &err);
        double logits_err = 0;
        size_t nlogits = (size_t)f.B * f.T * (size_t)cfg.vocab_size;
        expect_close(CASES[c], "merged logits", plain->logits, f.merged_logits, nlogits, 1e-5, &logits_err);
        printf("%-20s merge: %d weights within %.2e of PEFT's, the rest identical; merged logits error %.2e\n",
               CASES[c], changed, worst, logits_err);
        ht_model_free(plain);
        ht_model_free(m);
        ht_safetensors_close(f.st);
    }
}

/* ht_peft_save_adapter then ht_peft_read_config / ht_peft_load_adapter: the
 * same settings and target_modules PEFT wrote, the same tensors bit for bit
 * (FP32), and the same logits again. */
static void test_adapter_round_trip(void **state) {
    (void)state;
    for (size_t c = 0; c < sizeof(CASES) / sizeof(CASES[0]); c++) {
        fixture f;
        open_fixture(CASES[c], &f);
        ht_model *m = load_lora_model(&f);
        ht_error err;
        char sub[128];
        snprintf(sub, sizeof(sub), "adapter_%s", CASES[c]);
        const char *dir = scratch_dir(sub);
        assert_ht_ok(ht_peft_save_adapter(dir, &m->params, &m->config.lora, "Qwen/base", HT_DTYPE_F32, &err), &err);
        ht_lora_config back, peft;
        assert_ht_ok(ht_peft_read_config(dir, &back, &err), &err);
        assert_ht_ok(ht_peft_read_config(f.adapter, &peft, &err), &err);
        assert_int_equal(back.rank, peft.rank);
        assert_true(back.alpha == peft.alpha && back.dropout == peft.dropout);
        assert_int_equal(back.use_rslora, peft.use_rslora);
        assert_int_equal(back.target_count, peft.target_count);
        for (int k = 0; k < back.target_count; k++) assert_string_equal(back.targets[k], peft.targets[k]);
        char path[700], ours[700];
        snprintf(path, sizeof(path), "%s/adapter_model.safetensors", f.adapter);
        snprintf(ours, sizeof(ours), "%s/adapter_model.safetensors", dir);
        ht_safetensors *a, *b;
        assert_ht_ok(ht_safetensors_open(path, &a, &err), &err);
        assert_ht_ok(ht_safetensors_open(ours, &b, &err), &err);
        assert_int_equal(ht_safetensors_count(a), ht_safetensors_count(b));
        for (int i = 0; i < ht_safetensors_count(a); i++) {
            const ht_st_tensor *x = ht_safetensors_tensor(a, i), *y = ht_safetensors_find(b, x->name);
            if (!y) fail_msg("%s: the written adapter lacks %s", CASES[c], x->name);
            assert_int_equal(y->dtype, HT_DTYPE_F32);
            assert_int_equal(x->nbytes, y->nbytes);
            assert_memory_equal(x->data, y->data, x->nbytes);
        }
        assert_string_equal(ht_safetensors_metadata_get(b, "format"), "pt");
        ht_safetensors_close(a);
        ht_safetensors_close(b);
        char *text;
        size_t len;
        snprintf(path, sizeof(path), "%s/adapter_config.json", dir);
        assert_ht_ok(ht_read_file(path, &text, &len, &err), &err);
        const char *want[] = {"\"peft_type\": \"LORA\"",  "\"task_type\": \"CAUSAL_LM\"",
                              "\"bias\": \"none\"",       "\"fan_in_fan_out\": false",
                              "\"inference_mode\": true", "\"base_model_name_or_path\": \"Qwen/base\""};
        for (size_t k = 0; k < sizeof(want) / sizeof(want[0]); k++)
            if (!strstr(text, want[k])) fail_msg("%s: adapter_config.json lacks %s:\n%s", CASES[c], want[k], text);
        free(text);

        /* Read back into a fresh model: the same logits. */
        ht_model *again = load_lora_model(&f);
        assert_ht_ok(ht_peft_load_adapter(dir, &again->config.lora, &again->params, &err), &err);
        float l1, l2;
        assert_ht_ok(ht_model_forward(m, f.inputs, f.targets, f.B, f.T, &l1, &err), &err);
        assert_ht_ok(ht_model_forward(again, f.inputs, f.targets, f.B, f.T, &l2, &err), &err);
        assert_true(l1 == l2);
        ht_model_free(again);
        ht_model_free(m);
        ht_safetensors_close(f.st);
    }
}

/* ------------------------------------------------------------------ what is refused */

static void expect_build_error(ht_model_config *cfg, const char *a, const char *b) {
    ht_model *m = NULL;
    ht_error err = {0};
    if (ht_model_build(cfg, HT_DTYPE_F32, 1, &m, &err) == HT_OK) fail_msg("built a model with bad model.lora");
    if (!strstr(err.msg, a) || (b && !strstr(err.msg, b)))
        fail_msg("'%s' does not name '%s' / '%s'", err.msg, a, b ? b : "");
}

static void set_targets(ht_lora_config *lc, const char *const *t, int n) {
    lc->target_count = n;
    for (int i = 0; i < n; i++) snprintf(lc->targets[i], HT_LORA_TARGET_MAX, "%s", t[i]);
}

static void test_bad_targets_refused(void **state) {
    (void)state;
    fixture f;
    open_fixture("qwen2_tied_qv", &f);
    ht_model_config cfg;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(f.base, &cfg, &err), &err);
    cfg.lora.rank = 4;
    cfg.lora.alpha = 8;
    const char *typo[] = {"q_proj", "v_prj"};
    set_targets(&cfg.lora, typo, 2);
    expect_build_error(&cfg, "\"v_prj\" matches no linear layer", "model.layers.{0..1}.self_attn.{q_proj");
    const char *head[] = {"lm_head"};
    set_targets(&cfg.lora, head, 1);
    expect_build_error(&cfg, "\"lm_head\" selects lm_head: not supported", NULL);
    const char *embed[] = {"embed_tokens"};
    set_targets(&cfg.lora, embed, 1);
    expect_build_error(&cfg, "selects model.embed_tokens: not supported", NULL);
    const char *any[] = {"{*}"};
    set_targets(&cfg.lora, any, 1);
    expect_build_error(&cfg, "\"{*}\" selects lm_head", NULL);
    const char *norm[] = {"input_layernorm"};
    set_targets(&cfg.lora, norm, 1);
    expect_build_error(&cfg, "not a linear layer", NULL);
    set_targets(&cfg.lora, typo, 0);
    expect_build_error(&cfg, "model.lora.rank 4 needs model.lora.target_modules", NULL);
    set_targets(&cfg.lora, typo, 1);
    cfg.lora.dropout = 1.0;
    expect_build_error(&cfg, "model.lora.dropout must be in [0, 1)", NULL);
    cfg.lora.dropout = 0;
    cfg.lora.alpha = 0;
    expect_build_error(&cfg, "model.lora.alpha must be a positive number", NULL);
    cfg.lora.alpha = 8;
    cfg.lora.rank = -1;
    expect_build_error(&cfg, "model.lora.rank must be >= 0", NULL);
    /* Rank 0: off, whatever the targets say. */
    cfg.lora.rank = 0;
    set_targets(&cfg.lora, typo, 2);
    ht_model *m;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    for (int i = 0; i < m->params.count; i++) assert_int_equal(ht_lora_kind(m->params.items[i].name), 0);
    ht_model_free(m);
    /* A path selects one module; all-linear all seven of every layer. */
    cfg.lora.rank = 2;
    const char *one[] = {"model.layers.1.mlp.down_proj"};
    set_targets(&cfg.lora, one, 1);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    int adapters = 0;
    for (int i = 0; i < m->params.count; i++) adapters += ht_lora_kind(m->params.items[i].name) != 0;
    assert_int_equal(adapters, 2);
    assert_non_null(ht_params_find(&m->params, "model.layers.1.mlp.down_proj.lora_B.weight"));
    ht_model_free(m);
    const char *all[] = {"all-linear"};
    set_targets(&cfg.lora, all, 1);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    adapters = 0;
    for (int i = 0; i < m->params.count; i++) adapters += ht_lora_kind(m->params.items[i].name) != 0;
    assert_int_equal(adapters, 2 * 7 * 2);
    ht_model_free(m);
    ht_safetensors_close(f.st);
}

/* model.lora.from_pretrained whose adapter_config.json disagrees with
 * model.lora: each setting named with both values; a missing tensor named. */
static void test_adapter_mismatch_refused(void **state) {
    (void)state;
    fixture f;
    open_fixture("qwen2_tied_qv", &f);
    ht_model_config cfg;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(f.base, &cfg, &err), &err);
    assert_ht_ok(ht_peft_read_config(f.adapter, &cfg.lora, &err), &err);
    const struct {
        const char *field;
        const char *a, *b;
    } cases[] = {
        {"rank", "model.lora.rank is 8", "has r 4"},
        {"alpha", "model.lora.alpha is 16", "has lora_alpha 8"},
        {"rslora", "model.lora.use_rslora is true", "has use_rslora false"},
        {"targets", "select different modules", "model.layers.0.self_attn.k_proj is adapted by model.lora only"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ht_model_config c = cfg;
        if (i == 0) c.lora.rank = 8;
        if (i == 1) c.lora.alpha = 16;
        if (i == 2) c.lora.use_rslora = true;
        if (i == 3) {
            const char *t[] = {"q_proj", "k_proj", "v_proj"};
            set_targets(&c.lora, t, 3);
        }
        ht_model *m;
        assert_ht_ok(ht_model_build(&c, HT_DTYPE_F32, 1, &m, &err), &err);
        ht_error e = {0};
        assert_int_equal(ht_peft_load_adapter(f.adapter, &c.lora, &m->params, &e), HT_ERR_CONFIG);
        if (!strstr(e.msg, cases[i].a) || !strstr(e.msg, cases[i].b) || !strstr(e.msg, "adapter_config.json"))
            fail_msg("%s: '%s'", cases[i].field, e.msg);
        ht_model_free(m);
    }
    /* The same modules spelled otherwise agree. */
    ht_model_config c = cfg;
    const char *paths[] = {"model.layers.{*}.self_attn.v_proj", "self_attn.q_proj"};
    set_targets(&c.lora, paths, 2);
    ht_model *m;
    assert_ht_ok(ht_model_build(&c, HT_DTYPE_F32, 1, &m, &err), &err);
    assert_ht_ok(ht_peft_load_adapter(f.adapter, &c.lora, &m->params, &err), &err);
    ht_model_free(m);

    /* An adapter file without one of the tensors, or with a stranger. */
    const char *dir = scratch_dir("adapter_broken");
    char cmd[2400];
    snprintf(cmd, sizeof(cmd), "cp '%s/adapter_config.json' '%s/'", f.adapter, dir);
    assert_int_equal(system(cmd), 0);
    ht_safetensors *src;
    char path[700];
    snprintf(path, sizeof(path), "%s/adapter_model.safetensors", f.adapter);
    assert_ht_ok(ht_safetensors_open(path, &src, &err), &err);
    for (int pass = 0; pass < 2; pass++) {
        ht_st_writer w = {0};
        for (int i = pass == 0 ? 1 : 0; i < ht_safetensors_count(src); i++) {
            const ht_st_tensor *t = ht_safetensors_tensor(src, i);
            assert_ht_ok(ht_st_writer_add(&w, t->name, t->dtype, t->ndim, t->shape, t->data, t->dtype, &err), &err);
        }
        if (pass == 1) {
            const ht_st_tensor *t = ht_safetensors_tensor(src, 0);
            assert_ht_ok(ht_st_writer_add(&w, "base_model.model.lm_head.lora_A.weight", t->dtype, t->ndim, t->shape,
                                          t->data, t->dtype, &err),
                         &err);
        }
        snprintf(path, sizeof(path), "%s/adapter_model.safetensors", dir);
        assert_ht_ok(ht_st_writer_write(&w, path, &err), &err);
        ht_st_writer_free(&w);
        assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
        ht_error e = {0};
        assert_int_not_equal(ht_peft_load_adapter(dir, &cfg.lora, &m->params, &e), HT_OK);
        const char *want = pass == 0 ? "no tensor 'base_model.model."
                                     : "'base_model.model.lm_head.lora_A.weight' is "
                                       "not an adapter of this model";
        if (!strstr(e.msg, want)) fail_msg("pass %d: '%s'", pass, e.msg);
        ht_model_free(m);
    }
    ht_safetensors_close(src);
    /* Settings PEFT has that this engine does not implement are refused, not ignored. */
    snprintf(cmd, sizeof(cmd), "sed -i 's/\"use_dora\": false/\"use_dora\": true/' '%s/adapter_config.json'", dir);
    assert_int_equal(system(cmd), 0);
    ht_lora_config lc;
    ht_error e = {0};
    assert_int_equal(ht_peft_read_config(dir, &lc, &e), HT_ERR_CONFIG);
    assert_non_null(strstr(e.msg, "\"use_dora\" is set: DoRA is not supported"));
    ht_safetensors_close(f.st);
}

/* lora_A starts as PEFT's kaiming_uniform(a = sqrt(5)): within ±1/sqrt(in),
 * spread over it; lora_B at zero, so a fresh adapter changes nothing; a
 * sharded build holds the same rows. */
static void test_fresh_adapters(void **state) {
    (void)state;
    fixture f;
    open_fixture("llama_untied_all", &f);
    ht_model_config cfg;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(f.base, &cfg, &err), &err);
    ht_model *plain, *m, *shard;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 5, &plain, &err), &err);
    assert_ht_ok(ht_peft_read_config(f.adapter, &cfg.lora, &err), &err);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 5, &m, &err), &err);
    assert_ht_ok(ht_model_build_shard(&cfg, HT_DTYPE_F32, 5, 1, 3, &shard, &err), &err);
    for (int i = 0; i < m->params.count; i++) {
        const ht_param *p = &m->params.items[i], *q = &shard->params.items[i];
        const float *w = p->data;
        int64_t n = ht_param_numel(p);
        if (ht_lora_kind(p->name) == 'A') {
            float bound = 1.0f / sqrtf((float)p->shape[1]), lo = 0, hi = 0;
            for (int64_t k = 0; k < n; k++) {
                assert_true(fabsf(w[k]) <= bound);
                lo = fminf(lo, w[k]);
                hi = fmaxf(hi, w[k]);
            }
            assert_true(lo < -0.9f * bound && hi > 0.9f * bound);
        } else if (ht_lora_kind(p->name) == 'B') {
            for (int64_t k = 0; k < n; k++) assert_true(w[k] == 0.0f);
        } else {
            const ht_param *o = ht_params_find(&plain->params, p->name);
            assert_memory_equal(o->data, p->data, (size_t)n * sizeof(float));
        }
        int64_t row = ht_param_row_numel(p);
        assert_memory_equal(q->data, w + q->row0 * row, (size_t)ht_param_local_numel(q) * sizeof(float));
    }
    float l1, l2;
    assert_ht_ok(ht_model_forward(plain, f.inputs, f.targets, f.B, f.T, &l1, &err), &err);
    assert_ht_ok(ht_model_forward(m, f.inputs, f.targets, f.B, f.T, &l2, &err), &err);
    assert_true(l1 == l2);
    ht_model_free(plain);
    ht_model_free(m);
    ht_model_free(shard);
    ht_safetensors_close(f.st);
}

/* ------------------------------------------------------------------ dropout */

static ht_model *tiny_lora_model(double dropout) {
    ht_model_config c = {0};
    snprintf(c.name, sizeof(c.name), "qwen2");
    c.vocab_size = 37;
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 16;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    c.attention_bias = true;
    c.initializer_range = 0.3;
    c.lora.rank = 3;
    c.lora.alpha = 6;
    c.lora.dropout = dropout;
    const char *all[] = {"all-linear"};
    set_targets(&c.lora, all, 1);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&c, HT_DTYPE_F32, 3, &m, &err), &err);
    ht_rng rng; /* lora_B away from zero, so that every product is exercised */
    ht_rng_seed(&rng, 17);
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        if (ht_lora_kind(p->name) != 'B') continue;
        float *w = p->data;
        for (int64_t k = 0; k < ht_param_numel(p); k++) w[k] = 0.3f * ht_rng_normal(&rng);
    }
    return m;
}

/* With a dropout stream set, forward is a fixed function of the weights
 * (the masks come from the stream and the positions): backward, which
 * redraws the masks, is its gradient, checked against central differences
 * for the adapters and for the base params the adapters' dx reaches. */
static void test_dropout_gradients(void **state) {
    (void)state;
    ht_model *m = tiny_lora_model(0.25);
    enum { B = 2, T = 7 };
    int32_t in[B * T], tg[B * T];
    random_tokens(in, B * T, 37, 5);
    random_tokens(tg, B * T, 37, 6);
    m->dropout_seed = 0x5eed;
    m->dropout_first_sequence = 3;
    double with = model_loss(m, in, tg, B, T);
    ht_params_zero_grad(&m->params);
    model_loss(m, in, tg, B, T);
    ht_model_backward(m, 1.0f);
    ht_rng rng;
    ht_rng_seed(&rng, 99);
    const float eps = 1e-2f;
    double worst = 0;
    int probes = 0;
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        bool base = !ht_lora_kind(p->name);
        if (base && !strstr(p->name, "embed_tokens") && !strstr(p->name, "layernorm") &&
            !strstr(p->name, "layers.0.self_attn.q_proj.weight"))
            continue;
        float *w = p->data;
        for (int probe = 0; probe < 4; probe++) {
            int64_t k = (int64_t)ht_rng_below(&rng, (uint64_t)ht_param_numel(p));
            float orig = w[k];
            w[k] = orig + eps;
            double lp = model_loss(m, in, tg, B, T);
            w[k] = orig - eps;
            double lm = model_loss(m, in, tg, B, T);
            w[k] = orig;
            double fd = (lp - lm) / (2.0 * eps), an = p->main_grad[k];
            worst = fmax(worst, fabs(fd - an) / (1e-3 + fabs(fd)));
            if (fabs(fd - an) > 2e-3 + 2e-2 * fabs(fd))
                fail_msg("%s[%lld]: backward %.6g, finite difference %.6g", p->name, (long long)k, an, fd);
            probes++;
        }
    }
    /* Without the stream (evaluation) nothing is dropped: another loss. */
    m->dropout_seed = 0;
    double without = model_loss(m, in, tg, B, T);
    assert_true(fabs(with - without) > 1e-4);
    printf("dropout 0.25: %d probes, worst relative gradient error %.3g; loss %.6f with the masks, %.6f without\n",
           probes, worst, with, without);
    ht_model_free(m);
}

/* A sequence's masks depend on its place in the global batch, not on the
 * micro-batch it travels in: sequence 1 of a batch of 2 from position 4 is
 * sequence 0 of a batch of 1 from position 5. */
static void test_dropout_masks_follow_the_sequence(void **state) {
    (void)state;
    ht_model *m = tiny_lora_model(0.5);
    enum { T = 9 };
    int32_t in[2 * T], tg[2 * T];
    random_tokens(in, 2 * T, 37, 7);
    random_tokens(tg, 2 * T, 37, 8);
    size_t V = 37, row = (size_t)T * V;
    float *both = malloc(2 * row * sizeof(float));
    m->dropout_seed = 42;
    m->dropout_first_sequence = 4;
    model_loss(m, in, tg, 2, T);
    memcpy(both, m->logits, 2 * row * sizeof(float));
    m->dropout_first_sequence = 5;
    model_loss(m, in + T, tg + T, 1, T);
    double e = rel_max_err(m->logits, both + row, row);
    assert_true(e <= 1e-6);
    m->dropout_first_sequence = 4; /* another place: other masks */
    model_loss(m, in + T, tg + T, 1, T);
    assert_true(rel_max_err(m->logits, both + row, row) > 1e-3);
    m->dropout_seed = 43; /* another step */
    m->dropout_first_sequence = 5;
    model_loss(m, in + T, tg + T, 1, T);
    assert_true(rel_max_err(m->logits, both + row, row) > 1e-3);
    printf("the same sequence in two micro-batches: logits within %.2g\n", e);
    free(both);
    ht_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parity_qwen2_tied_qv),
        cmocka_unit_test(test_parity_llama_untied_all),
        cmocka_unit_test(test_parity_qwen2_untied_rslora),
        cmocka_unit_test(test_parity_deepseek_mla),
        cmocka_unit_test(test_parity_bf16),
        cmocka_unit_test(test_merge_matches_peft),
        cmocka_unit_test(test_adapter_round_trip),
        cmocka_unit_test(test_bad_targets_refused),
        cmocka_unit_test(test_adapter_mismatch_refused),
        cmocka_unit_test(test_fresh_adapters),
        cmocka_unit_test(test_dropout_gradients),
        cmocka_unit_test(test_dropout_masks_follow_the_sequence),
    };
    if (getenv("HT_TEST_FILTER")) cmocka_set_test_filter(getenv("HT_TEST_FILTER"));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
