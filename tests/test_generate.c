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
#include "hypertrain/config.h"
#include "hypertrain/model.h"

/* The fixture's model folder (under tests/fixtures/) in float32, as `hypertrain generate` loads it. */
static ht_model *load_folder(const char *rel) {
    ht_ckpt_model_info info;
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_ckpt_load_model(fixture_path(rel), HT_DTYPE_F32, &m, &info, &err), &err);
    assert_int_equal(info.tokenizer[0], 0);
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

/* `hypertrain ARGS` with its stdout into dir/NAME.out and its stderr into dir/NAME.err (read into *out, *err,
 * malloc'ed); the exit status. */
static int run_cli(const char *dir, const char *name, const char *args, char **out, char **err) {
    const char *bin = getenv("HT_BIN");
    if (!bin) fail_msg("HT_BIN is not set: run this test through ctest");
    char cmd[8192], o[1200], e[1200];
    snprintf(o, sizeof(o), "%s/%s.out", dir, name);
    snprintf(e, sizeof(e), "%s/%s.err", dir, name);
    snprintf(cmd, sizeof(cmd), "cd '%s' && '%s' %s > '%s' 2> '%s'", dir, bin, args, o, e);
    int rc = run_logged(cmd, e, err);
    *out = read_text(o);
    return rc;
}

/* A byte-level model trained 6 steps with a sample every 3: samples.jsonl, which a resume from step 3 cuts back
 * to step 3's line before it samples step 6 again (the same file as before); then `hypertrain generate` from the
 * run's output_dir, from its checkpoint and from its export as a Hugging Face folder: one text. */
static void test_cli_from_a_run(void **state) {
    (void)state;
    const char *dir = scratch_dir("generate_run");
    harness_write_corpus(dir, two_cities, 8);
    write_run_yaml(dir,
                   "model:\n  name: qwen2\n%smodel_init_dtype: float32\n"
                   "data:\n  dataset_type: text_bytes\n  path: %s/corpus.txt\n  seq_len: 16\n"
                   "optimizer:\n  _target_: AdamW\n"
                   "training:\n  steps: 6\n  local_batch_size: 2\n  global_batch_size: 2\n  sample_interval: 3\n"
                   "  sample_prompt: \"It was\"\n  sample_tokens: 12\n"
                   "checkpoint:\n  output_dir: %s/out\n  save_interval: 3\n",
                   tiny_model_yaml((tiny_model){64, 1, 64}), dir, dir);
    char *out, *err;
    if (run_cli(dir, "train", "train run.yaml", &out, &err) != 0) fail_msg("training failed: %s", err);
    assert_non_null(strstr(err, "sample at step 3 (12 tokens after 6 of the prompt"));
    free(out), free(err);
    char path[1200];
    snprintf(path, sizeof(path), "%s/out/samples.jsonl", dir);
    char *samples = read_text(path);
    assert_non_null(strstr(samples, "{\"step\": 3, \"prompt\": \"It was\", \"text\": "));
    assert_non_null(strstr(samples, "{\"step\": 6, \"prompt\": \"It was\", \"text\": "));
    if (run_cli(dir, "resume", "train run.yaml --set checkpoint.restore_from=out/step_00000003", &out, &err) != 0)
        fail_msg("the resume failed: %s", err);
    free(out), free(err);
    char *again = read_text(path);
    assert_string_equal(again, samples);
    free(again);
    free(samples);
    const char *sources[] = {"out", "out/step_00000006", "hf"};
    char *texts[3];
    if (run_cli(dir, "export", "export out/step_00000006 hf", &out, &err) != 0) fail_msg("export failed: %s", err);
    free(out), free(err);
    for (int i = 0; i < 3; i++) {
        char args[256];
        snprintf(args, sizeof(args), "generate %s --prompt 'It was' --max-new-tokens 20", sources[i]);
        if (run_cli(dir, "generate", args, &texts[i], &err) != 0) fail_msg("generate %s failed: %s", sources[i], err);
        assert_int_equal(strncmp(texts[i], "It was", 6), 0);
        assert_non_null(strstr(err, "20 new tokens"));
        free(err);
    }
    assert_string_equal(texts[0], texts[1]);
    assert_string_equal(texts[0], texts[2]);
    for (int i = 0; i < 3; i++) free(texts[i]);
}

/* Ids in and out where the folder has no tokenizer: the fixture's greedy continuation. */
static void test_cli_ids(void **state) {
    (void)state;
    const char *dir = scratch_dir("generate_ids");
    char args[1200], *out, *err;
    snprintf(args, sizeof(args), "generate '%s' --prompt-ids 44,39,33,60,63,79,27,3,97 --max-new-tokens 16",
             fixture_path("model/qwen2_untied"));
    if (run_cli(dir, "ids", args, &out, &err) != 0) fail_msg("generate failed: %s", err);
    assert_string_equal(out, "67,81,31,50,59,31,59,31,59,31,59,31,59,31,59,31\n"); /* transformers' (the fixture) */
    free(out), free(err);
}

/* Bad input: each a sentence naming what was wrong, exit status 2 for the command line, 1 for the rest. */
static void test_cli_errors(void **state) {
    (void)state;
    const char *dir = scratch_dir("generate_errors");
    char model[1200];
    snprintf(model, sizeof(model), "'%s'", fixture_path("model/llama_untied"));
    const struct {
        const char *args, *expect;
        int rc;
    } cases[] = {
        {"generate missing --prompt x", "missing: no such folder", 1},
        {"generate . --prompt x", "neither a training checkpoint (no metadata.json) nor a Hugging Face", 1},
        {"generate MODEL", "give the prompt as --prompt TEXT or as --prompt-ids", 2},
        {"generate MODEL --prompt a --prompt-ids 1", "(one of them)", 2},
        {"generate MODEL --prompt-ids 1 --top-p 2", "--top-p 2: expected a number in [0, 1]", 2},
        {"generate MODEL --prompt-ids 1 --temperature -1", "--temperature -1: expected a number", 2},
        {"generate MODEL --prompt-ids 1 --max-new-tokens 2.5", "expected a whole number", 2},
        {"generate MODEL --prompt-ids 1 --dtype int8", "--dtype int8: expected float32, bfloat16 or float16", 2},
        {"generate MODEL --prompt-ids 1 --sampling", "no value after '--sampling'", 2},
        {"generate MODEL --prompt-ids 1 --bogus 3", "unexpected argument '--bogus'", 2},
        {"generate MODEL --prompt-ids 1,100", "--prompt-ids 1,100: expected ids in [0, 100)", 2},
        {"generate MODEL --prompt-ids 1,x", "expected ids in [0, 100)", 2},
        {"generate MODEL --prompt hello", "no tokenizer", 1},
        {"generate MODEL --prompt-ids 1,2,3 --max-new-tokens 62", "the prompt's 3 tokens and 62 new ones are more", 1},
        {"generate MODEL --prompt hi --tokenizer TOKENIZER", "the tokenizer has 1000 tokens, more than the model's", 1},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        char args[4096], *out, *err;
        const char *m = strstr(cases[i].args, "MODEL"), *tk = strstr(cases[i].args, "TOKENIZER");
        if (m)
            snprintf(args, sizeof(args), "%.*s%s%.*s%s", (int)(m - cases[i].args), cases[i].args, model,
                     (int)(tk ? tk - (m + 5) : (long)strlen(m + 5)), m + 5,
                     tk ? fixture_path("tokenizer/qwen2.json") : "");
        else
            snprintf(args, sizeof(args), "%s", cases[i].args);
        int rc = run_cli(dir, "err", args, &out, &err);
        if (rc != cases[i].rc || !strstr(err, cases[i].expect))
            fail_msg("`hypertrain %s`: exit %d (expected %d), stderr \"%s\" (expected \"%s\")", args, rc, cases[i].rc,
                     err, cases[i].expect);
        free(out), free(err);
    }
}

/* training.sample_*: the keys' own errors. */
static void test_sample_keys(void **state) {
    (void)state;
    ht_config *cfg = malloc(sizeof(ht_config));
    ht_error err;
    const struct {
        const char *set, *expect;
    } cases[] = {
        {"training.sample_interval=-1", "training.sample_interval"},
        {"training.sample_tokens=0", "training.sample_tokens"},
        {"data.dataset_type=token_bin", "samples are text"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ht_config_defaults(cfg);
        assert_ht_ok(ht_config_set(cfg, "training.sample_interval=10", &err), &err);
        assert_ht_ok(ht_config_set(cfg, cases[i].set, &err), &err);
        assert_int_not_equal(ht_config_validate(cfg, 1, &err), HT_OK);
        if (!strstr(err.msg, cases[i].expect))
            fail_msg("%s: \"%s\" does not name %s", cases[i].set, err.msg, cases[i].expect);
    }
    free(cfg);
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
        cmocka_unit_test(test_cli_from_a_run),
        cmocka_unit_test(test_cli_ids),
        cmocka_unit_test(test_cli_errors),
        cmocka_unit_test(test_sample_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
