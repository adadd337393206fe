/* Generation: greedy continuations through the key/value cache token for
 * token equal to transformers' generate on the same weights, and the logits
 * of every new token within 1e-5 (tools/reference/make_generate_fixtures.py:
 * Qwen2, Llama, Qwen2-MoE, DeepSeek-V3); sampling; the errors. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/model.h"

/* The fixture's model folder (under tests/fixtures/) built in float32. */
static ht_model *load_folder(const char *rel) {
    const char *dir = fixture_path(rel);
    ht_model_config cfg;
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_hf_read_config(dir, &cfg, &err), &err);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    assert_ht_ok(ht_hf_load_weights(dir, &m->params, &err), &err);
    return m;
}

typedef struct recorded {
    float *logits; /* (count, V) */
    int count;
} recorded;

static bool record(void *ctx, int32_t token, const float *logits, int64_t V) {
    (void)token;
    recorded *r = ctx;
    memcpy(r->logits + (size_t)r->count++ * (size_t)V, logits, (size_t)V * sizeof(float));
    return true;
}

static void check_case(const char *name) {
    char rel[256];
    snprintf(rel, sizeof(rel), "generate/%s.safetensors", name);
    ht_safetensors *st;
    ht_error err;
    assert_ht_ok(ht_safetensors_open(fixture_path(rel), &st, &err), &err);
    const ht_st_tensor *prompt = ht_safetensors_find(st, "prompt"), *tokens = ht_safetensors_find(st, "tokens"),
                       *logits = ht_safetensors_find(st, "logits");
    assert_non_null(prompt);
    assert_non_null(tokens);
    assert_non_null(logits);
    ht_model *m = load_folder(ht_safetensors_metadata_get(st, "model"));
    const int n = (int)prompt->shape[0], new = (int)tokens->shape[0];
    const int64_t V = m->config.vocab_size;
    assert_int_equal(logits->shape[1], V);
    int32_t *out = malloc((size_t) new * sizeof(int32_t));
    recorded r = {malloc((size_t) new *(size_t)V * sizeof(float)), 0};
    const ht_sampling greedy = {0};
    int produced;
    assert_ht_ok(ht_generate(m, prompt->data, n, new, &greedy, NULL, 0, record, &r, out, &produced, &err), &err);
    assert_int_equal(produced, new);
    const int32_t *want = tokens->data;
    for (int i = 0; i < new; i++)
        if (out[i] != want[i]) fail_msg("%s: new token %d is %d, transformers' %d", name, i, out[i], want[i]);
    double worst = 0;
    const float *ref = logits->data;
    for (size_t i = 0; i < (size_t) new *(size_t)V; i++) worst = fmax(worst, fabs((double)r.logits[i] - ref[i]));
    printf("%-13s %d + %d tokens equal to transformers', logits within %.2e\n", name, n, new, worst);
    if (!(worst <= 1e-5)) fail_msg("%s: the logits differ by %.3g (allowed 1e-5)", name, worst);
    /* The cache is freed after, and the model computes whole sequences again. */
    assert_int_equal(m->cache_capacity, 0);
    free(r.logits);
    free(out);
    ht_model_free(m);
    ht_safetensors_close(st);
}

static void test_greedy_qwen2(void **state) {
    (void)state;
    check_case("qwen2_untied");
}
static void test_greedy_llama(void **state) {
    (void)state;
    check_case("llama_tied");
}
static void test_greedy_qwen2_moe(void **state) {
    (void)state;
    check_case("moe_untied");
}
static void test_greedy_deepseek_v3(void **state) {
    (void)state;
    check_case("dsv3_a");
    check_case("dsv3_b");
}

/* The cache's logits equal the training forward's over the whole sequence
 * (their last row), position by position: the prefix is not recomputed but
 * gives the same numbers. */
static void test_cache_matches_whole_forward(void **state) {
    (void)state;
    ht_model *m = load_folder("model/qwen2_untied");
    ht_error err;
    const int32_t seq[] = {5, 17, 3, 99, 42, 8, 61, 23};
    const int n = 8, V = m->config.vocab_size;
    float *cached = malloc((size_t)n * V * sizeof(float));
    assert_ht_ok(ht_model_set_cache(m, n, &err), &err);
    assert_ht_ok(ht_model_forward(m, seq, NULL, 1, 3, NULL, &err), &err); /* a prefix of 3, then one by one */
    memcpy(cached + 2 * V, m->logits, (size_t)V * sizeof(float));
    for (int t = 3; t < n; t++) {
        assert_ht_ok(ht_model_forward(m, seq + t, NULL, 1, 1, NULL, &err), &err);
        memcpy(cached + (size_t)t * V, m->logits, (size_t)V * sizeof(float));
    }
    assert_int_equal(m->cache_tokens, n);
    /* full: one more token is refused */
    assert_int_equal(ht_model_forward(m, seq, NULL, 1, 1, NULL, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "8 tokens in all"));
    assert_ht_ok(ht_model_set_cache(m, 0, &err), &err);
    assert_ht_ok(ht_model_forward(m, seq, NULL, 1, n, NULL, &err), &err);
    for (int t = 2; t < n; t++) {
        double e = rel_max_err(cached + (size_t)t * V, m->logits + (size_t)t * V, (size_t)V);
        if (!(e <= 1e-6)) fail_msg("position %d: the cached logits differ by %.3g", t, e);
    }
    free(cached);
    ht_model_free(m);
}

/* Sampling: the same seed, the same tokens; top_k 1 and a tiny top_p are greedy. */
static void test_sampling(void **state) {
    (void)state;
    ht_model *m = load_folder("model/llama_untied");
    ht_error err;
    const int32_t prompt[] = {1, 2, 3};
    int32_t a[20], b[20], c[20], g[20];
    int na, nb, nc, ng;
    const ht_sampling hot = {.temperature = 1.5, .seed = 7}, other = {.temperature = 1.5, .seed = 8}, greedy = {0},
                      top1 = {.temperature = 1.0, .top_k = 1, .seed = 3},
                      nucleus = {.temperature = 1.0, .top_p = 1e-6, .seed = 4};
    assert_ht_ok(ht_generate(m, prompt, 3, 20, &hot, NULL, 0, NULL, NULL, a, &na, &err), &err);
    assert_ht_ok(ht_generate(m, prompt, 3, 20, &hot, NULL, 0, NULL, NULL, b, &nb, &err), &err);
    assert_ht_ok(ht_generate(m, prompt, 3, 20, &other, NULL, 0, NULL, NULL, c, &nc, &err), &err);
    assert_int_equal(na, 20);
    assert_memory_equal(a, b, sizeof(a));
    assert_memory_not_equal(a, c, sizeof(a));
    assert_ht_ok(ht_generate(m, prompt, 3, 20, &greedy, NULL, 0, NULL, NULL, g, &ng, &err), &err);
    assert_ht_ok(ht_generate(m, prompt, 3, 20, &top1, NULL, 0, NULL, NULL, a, &na, &err), &err);
    assert_memory_equal(a, g, sizeof(a));
    assert_ht_ok(ht_generate(m, prompt, 3, 20, &nucleus, NULL, 0, NULL, NULL, a, &na, &err), &err);
    assert_memory_equal(a, g, sizeof(a));
    /* A stop token ends it, and is kept. */
    const int32_t stop = g[4];
    int first = 0;
    while (g[first] != stop) first++;
    assert_ht_ok(ht_generate(m, prompt, 3, 20, &greedy, &stop, 1, NULL, NULL, a, &na, &err), &err);
    assert_int_equal(na, first + 1);
    ht_model_free(m);
}

/* The sampler alone: temperature and top-k over a row of known logits. */
static void test_sample_distribution(void **state) {
    (void)state;
    const float logits[4] = {0.0f, logf(2.0f), logf(3.0f), logf(4.0f)}; /* p = 0.1, 0.2, 0.3, 0.4 */
    int32_t order[4];
    int counts[4] = {0}, top2[4] = {0};
    ht_rng rng;
    ht_rng_seed(&rng, 1);
    const ht_sampling s = {.temperature = 1.0}, k2 = {.temperature = 1.0, .top_k = 2},
                      p5 = {.temperature = 1.0, .top_p = 0.5};
    for (int i = 0; i < 20000; i++) counts[ht_sample(logits, 4, &s, &rng, order)]++;
    for (int i = 0; i < 4; i++) assert_true(fabs(counts[i] / 20000.0 - 0.1 * (i + 1)) < 0.015);
    for (int i = 0; i < 20000; i++) top2[ht_sample(logits, 4, &k2, &rng, order)]++;
    assert_int_equal(top2[0] + top2[1], 0);
    assert_true(fabs(top2[3] / 20000.0 - 4.0 / 7.0) < 0.015);
    memset(top2, 0, sizeof(top2)); /* top_p 0.5: 0.4 is short of it, 0.4 + 0.3 reaches it */
    for (int i = 0; i < 20000; i++) top2[ht_sample(logits, 4, &p5, &rng, order)]++;
    assert_int_equal(top2[0] + top2[1], 0);
    assert_true(top2[2] > 0);
}

static void test_errors(void **state) {
    (void)state;
    ht_model *m = load_folder("model/qwen2_tied");
    ht_error err;
    int32_t prompt[64] = {0}, out[64];
    int produced;
    const ht_sampling greedy = {0};
    const int max = m->config.max_position_embeddings;
    assert_int_equal(ht_generate(m, prompt, max - 2, 3, &greedy, NULL, 0, NULL, NULL, out, &produced, &err),
                     HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "max_position_embeddings"));
    assert_int_equal(ht_generate(m, prompt, 0, 3, &greedy, NULL, 0, NULL, NULL, out, &produced, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "empty"));
    prompt[1] = m->config.vocab_size; /* outside the vocabulary */
    assert_int_equal(ht_generate(m, prompt, 4, 3, &greedy, NULL, 0, NULL, NULL, out, &produced, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "outside the vocabulary"));
    assert_int_equal(m->cache_capacity, 0);
    assert_int_equal(ht_model_set_cache(m, max + 1, &err), HT_ERR_INVALID);
    ht_model_free(m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_qwen2),
        cmocka_unit_test(test_greedy_llama),
        cmocka_unit_test(test_greedy_qwen2_moe),
        cmocka_unit_test(test_greedy_deepseek_v3),
        cmocka_unit_test(test_cache_matches_whole_forward),
        cmocka_unit_test(test_sampling),
        cmocka_unit_test(test_sample_distribution),
        cmocka_unit_test(test_errors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
