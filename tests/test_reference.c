/* Exactness against Hugging Face transformers: for small random Qwen2 and
 * Llama models (GQA 2:1, biases on and off, tied and untied embeddings,
 * T = 13), logits, loss and the gradient of every parameter must match the
 * committed fixtures (tools/reference/make_model_fixtures.py). */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/model.h"

typedef struct reference {
    ht_safetensors *st;
    const int32_t *inputs, *targets;
    const float *logits;
    float loss;
    int B, T;
} reference;

static void open_reference(const char *name, reference *r) {
    char path[512];
    ht_error err;
    snprintf(path, sizeof(path), "model/%s/fixture.safetensors", name);
    assert_ht_ok(ht_safetensors_open(fixture_path(path), &r->st, &err), &err);
    const ht_st_tensor *in = ht_safetensors_find(r->st, "inputs"), *tg = ht_safetensors_find(r->st, "targets");
    const ht_st_tensor *lg = ht_safetensors_find(r->st, "logits"), *ls = ht_safetensors_find(r->st, "loss");
    assert_non_null(in);
    assert_non_null(tg);
    assert_non_null(lg);
    assert_non_null(ls);
    assert_int_equal(in->dtype, HT_DTYPE_I32);
    r->inputs = in->data;
    r->targets = tg->data;
    r->logits = lg->data;
    r->loss = *(const float *)ls->data;
    r->B = (int)in->shape[0];
    r->T = (int)in->shape[1];
}

/* Builds the fixture's model from its config.json and model.safetensors, in `dtype`. */
static ht_model *load_model(const char *name, ht_dtype dtype, bool set_compute) {
    char rel[256];
    snprintf(rel, sizeof(rel), "model/%s", name);
    const char *dir = fixture_path(rel);
    ht_model_config cfg;
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    assert_ht_ok(ht_hf_load_weights(dir, &m->params, &err), &err);
    if (dtype != HT_DTYPE_F32) assert_ht_ok(ht_params_convert(&m->params, dtype, &err), &err);
    /* As the trainer does for param_dtype: without a native kernel, FP32 operands of dtype's precision. */
    if (set_compute) assert_ht_ok(ht_model_set_compute(m, dtype, &err), &err);
    return m;
}

/* Saves the model as Hugging Face weights plus our logits on the fixture's
 * inputs, into the build tree's scratch/export_<case>/: tools/reference/
 * check_hypertrain_exports.sh then has transformers load the folder and
 * compare its logits with ours. Here the folder must at least load back. */
static void export_for_transformers(const char *name, ht_model *m, const reference *r) {
    ht_error err;
    const char *dir = export_with_logits(name, m, r->inputs, r->B, r->T);
    ht_model_config cfg;
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_int_equal(cfg.hidden_size, m->config.hidden_size);
    assert_int_equal(cfg.tie_word_embeddings, m->config.tie_word_embeddings);
}

static const char *check_case_name;

static void expect_close(const char *what, const float *got, const float *want, size_t n, double tol) {
    double e = rel_max_err(got, want, n);
    if (!(e <= tol))
        fail_msg("%s: %s differs by %.3g of its largest magnitude (allowed %.1g)", check_case_name, what, e, tol);
}

/* tol_logits, tol_grads: the per-tensor bound, relative to the tensor's largest magnitude. */
static void check_against_transformers(const char *name, ht_dtype dtype, bool set_compute, double tol_logits,
                                       double tol_grads) {
    check_case_name = name;
    reference r;
    open_reference(name, &r);
    ht_model *m = load_model(name, dtype, set_compute);
    ht_error err;
    float loss;
    assert_ht_ok(ht_model_forward(m, r.inputs, r.targets, r.B, r.T, &loss, &err), &err);
    size_t V = (size_t)m->config.vocab_size;
    double logits_err = rel_max_err(m->logits, r.logits, (size_t)r.B * r.T * V);
    if (dtype == HT_DTYPE_F32) export_for_transformers(name, m, &r);
    expect_close("logits", m->logits, r.logits, (size_t)r.B * r.T * V, tol_logits);
    if (!(fabs(loss - r.loss) <= tol_logits * fabs(r.loss)))
        fail_msg("%s: loss %.8f, transformers %.8f", name, loss, r.loss);
    ht_params_zero_grad(&m->params);
    ht_model_backward(m, 1.0f);
    int checked = 0;
    double worst = 0;
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        char key[HT_PARAM_NAME_MAX + 8];
        snprintf(key, sizeof(key), "grad.%s", p->name);
        const ht_st_tensor *g = ht_safetensors_find(r.st, key);
        if (!g) fail_msg("%s: the fixture has no %s", name, key);
        assert_int_equal((int64_t)(g->nbytes / 4), ht_param_numel(p));
        double e = rel_max_err(p->main_grad, g->data, g->nbytes / 4);
        if (e > worst) worst = e;
        expect_close(p->name, p->main_grad, g->data, g->nbytes / 4, tol_grads);
        checked++;
    }
    /* Every gradient in the fixture belongs to a parameter of the model. */
    int in_fixture = 0;
    for (int i = 0; i < ht_safetensors_count(r.st); i++)
        in_fixture += strncmp(ht_safetensors_tensor(r.st, i)->name, "grad.", 5) == 0;
    assert_int_equal(checked, in_fixture);
    printf("%-13s %-8s logits error %.2e, loss %.6f vs %.6f, worst gradient error %.2e over %d tensors\n", name,
           ht_dtype_name(dtype), logits_err, loss, r.loss, worst, checked);
    ht_model_free(m);
    ht_safetensors_close(r.st);
}

/* FP32: the contract of docs/NUMERICS.md, 1e-5 of each tensor's largest magnitude. */
static void test_qwen2_untied_f32(void **s) {
    (void)s;
    check_against_transformers("qwen2_untied", HT_DTYPE_F32, false, 1e-5, 1e-5);
}
static void test_qwen2_tied_f32(void **s) {
    (void)s;
    check_against_transformers("qwen2_tied", HT_DTYPE_F32, false, 1e-5, 1e-5);
}
static void test_llama_untied_f32(void **s) {
    (void)s;
    check_against_transformers("llama_untied", HT_DTYPE_F32, false, 1e-5, 1e-5);
}
static void test_llama_tied_f32(void **s) {
    (void)s;
    check_against_transformers("llama_tied", HT_DTYPE_F32, false, 1e-5, 1e-5);
}

/* bf16 weights against the FP32 reference. bf16 keeps 8 significant bits:
 * every rounding is a relative perturbation of at most u = 2^-9. Here the
 * weights and every GEMM input (normed activations, attention output, MLP
 * hidden, final norm) are rounded: about 2L + 2 = 6 stages on the forward
 * path, each adding up to ~u of relative error to its GEMM's output, while
 * norms and softmax do not amplify it. So the logits stay within a small
 * multiple of u: we allow 16u (3.1e-2; measured 8u). Gradients pass the
 * rounded stages twice (the forward activations and the backward GEMMs):
 * we allow 32u (6.3e-2; measured 15u). A wrong formula errs by O(1). */
static const double bf16_u = 0x1p-9;
static void test_qwen2_untied_bf16(void **s) {
    (void)s;
    check_against_transformers("qwen2_untied", HT_DTYPE_BF16, false, 16 * bf16_u, 32 * bf16_u);
}
static void test_llama_tied_bf16(void **s) {
    (void)s;
    check_against_transformers("llama_tied", HT_DTYPE_BF16, false, 16 * bf16_u, 32 * bf16_u);
}

/* The same bf16 numerics through ht_model_set_compute (the trainer's path),
 * on each GEMM kernel this machine offers: native bf16 operands, bf16
 * operands widened per GEMM, FP32 operands of bf16 precision. */
static const ht_gemm_kernel KERNELS[] = {HT_GEMM_KERNEL_NATIVE, HT_GEMM_KERNEL_WIDENED, HT_GEMM_KERNEL_FP32_ROUNDED};

static void test_qwen2_untied_bf16_compute(void **s) {
    (void)s;
    for (int k = 0; k < 3; k++)
        if (use_gemm_kernel(HT_DTYPE_BF16, KERNELS[k]))
            check_against_transformers("qwen2_untied", HT_DTYPE_BF16, true, 16 * bf16_u, 32 * bf16_u);
}

/* Every kernel multiplies the same bf16 values: they differ only in FP32
 * summation order. Widened and fp32_rounded run the same FP32 matmul, so
 * they agree to FP32 precision (1e-5). The native kernel sums in another
 * order, and a last-bit difference before an activation is rounded to bf16
 * can flip that rounding: the activation moves by one bf16 ulp (2^-8
 * relative), one term among the hundreds of each later dot product. Its
 * logits stay within 2^-12 of the others (measured 1.4e-5 = 2^-16); a
 * kernel that rounded its result to bf16 or dropped a block would be off by
 * 2^-9 of the whole sum or more. */
static void test_bf16_kernels_agree(void **s) {
    (void)s;
    reference r;
    open_reference("llama_untied", &r);
    ht_model *base = load_model("llama_untied", HT_DTYPE_BF16, false); /* bf16 widened on every GEMM */
    ht_error err;
    float l0, l;
    assert_ht_ok(ht_model_forward(base, r.inputs, r.targets, r.B, r.T, &l0, &err), &err);
    size_t n = (size_t)r.B * r.T * (size_t)base->config.vocab_size;
    int ran = 0;
    for (int k = 0; k < 3; k++) {
        if (!use_gemm_kernel(HT_DTYPE_BF16, KERNELS[k])) continue;
        ht_model *m = load_model("llama_untied", HT_DTYPE_BF16, true);
        assert_ht_ok(ht_model_forward(m, r.inputs, r.targets, r.B, r.T, &l, &err), &err);
        double e = rel_max_err(m->logits, base->logits, n);
        printf("bf16 %s vs widened without set_compute: logits differ by %.2e, loss %.7g vs %.7g\n",
               ht_gemm_kernel_label(KERNELS[k]), e, (double)l, (double)l0);
        double bound = KERNELS[k] == HT_GEMM_KERNEL_NATIVE ? 0x1p-12 : 1e-5;
        assert_true(e <= bound);
        assert_true(fabs((double)l - (double)l0) <= bound * fabs((double)l0));
        ht_model_free(m);
        ran++;
    }
    assert_true(ran >= 2);
    ht_model_free(base);
    ht_safetensors_close(r.st);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen2_untied_f32),          cmocka_unit_test(test_qwen2_tied_f32),
        cmocka_unit_test(test_llama_untied_f32),          cmocka_unit_test(test_llama_tied_f32),
        cmocka_unit_test(test_qwen2_untied_bf16),         cmocka_unit_test(test_llama_tied_bf16),
        cmocka_unit_test(test_qwen2_untied_bf16_compute), cmocka_unit_test(test_bf16_kernels_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
