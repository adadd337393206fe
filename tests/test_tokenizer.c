/* The byte-level BPE tokenizer: encodings equal to the tokenizers package's
 * for tokenizers with Qwen2's, Llama 3's and GPT-2's pipelines
 * (tools/reference/make_tokenizer_fixtures.py), every encoding decoding back
 * to its text, and the tokenizer.json files it refuses. */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/data.h"

static void check_tokenizer(const char *name) {
    ht_error err;
    ht_json *cases;
    assert_ht_ok(ht_json_read_file(fixture_path("tokenizer/cases.json"), "cases.json", &cases, &err), &err);
    char rel[128];
    snprintf(rel, sizeof(rel), "tokenizer/%s.json", name);
    ht_tokenizer *t;
    assert_ht_ok(ht_tokenizer_load(fixture_path(rel), &t, &err), &err);
    const ht_json *texts = ht_json_get(cases, "texts"), *want = ht_json_get(cases, name);
    assert_non_null(want);
    assert_int_equal(texts->count, want->count);
    int total = 0;
    for (size_t c = 0; c < texts->count; c++) {
        const char *text = texts->items[c].string;
        int32_t *ids;
        int n;
        assert_ht_ok(ht_tokenizer_encode(t, text, strlen(text), &ids, &n, &err), &err);
        const ht_json *w = &want->items[c];
        bool same = (size_t)n == w->count;
        for (int i = 0; same && i < n; i++) same = ids[i] == (int32_t)w->items[i].number;
        if (!same) {
            printf("%s: text %zu \"%s\":\n  ours:", name, c, text);
            for (int i = 0; i < n; i++) printf(" %d", ids[i]);
            printf("\n  tokenizers':");
            for (size_t i = 0; i < w->count; i++) printf(" %d", (int)w->items[i].number);
            printf("\n");
            fail_msg("%s: text %zu encodes otherwise than the tokenizers package", name, c);
        }
        /* Decoding gives the text back (Llama 3's leading <|begin_of_text|> aside). */
        char back[4096];
        size_t len = 0;
        for (int i = 0; i < n; i++) len += ht_tokenizer_decode(t, ids[i], back + len, sizeof(back) - len);
        const char *bos = "<|begin_of_text|>";
        size_t skip = strcmp(name, "llama3") == 0 ? strlen(bos) : 0;
        assert_true(len >= skip);
        if (len - skip != strlen(text) || memcmp(back + skip, text, len - skip) != 0)
            fail_msg("%s: text %zu decodes to \"%.*s\"", name, c, (int)(len - skip), back + skip);
        total += n;
        free(ids);
    }
    printf("%-7s %zu texts, %d ids, as the tokenizers package encodes them\n", name, texts->count, total);
    ht_tokenizer_free(t);
    ht_json_free(cases);
}

static void test_qwen2(void **state) {
    (void)state;
    check_tokenizer("qwen2");
}
static void test_llama3(void **state) {
    (void)state;
    check_tokenizer("llama3");
}
static void test_gpt2(void **state) {
    (void)state;
    check_tokenizer("gpt2");
}

/* tokenizer.json files that are not byte-level BPE, or of a pattern it does not know, are refused by name. */
static void test_refusals(void **state) {
    (void)state;
    const char *dir = scratch_dir("tokenizer_refusals");
    char path[1024];
    ht_tokenizer *t;
    ht_error err;
    struct {
        const char *json, *expect;
    } cases[] = {
        {"{\"model\": {\"type\": \"Unigram\", \"vocab\": [[\"a\", 0.0]]}}", "not a BPE model"},
        {"{\"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": [], \"byte_fallback\": true}}",
         "byte_fallback"},
        {"{\"normalizer\": {\"type\": \"NFKC\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": "
         "[]}}",
         "normalizer NFKC"},
        {"{\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": "
         "{\"Regex\": \"\\\\w+\"}, \"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", "
         "\"use_regex\": false}]}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, \"merges\": []}}",
         "splits by \"\\w+\""},
        {"{\"pre_tokenizer\": {\"type\": \"Whitespace\"}, \"model\": {\"type\": \"BPE\", \"vocab\": {\"a\": 0}, "
         "\"merges\": []}}",
         "pre-tokenizer Whitespace"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(path, sizeof(path), "%s/t%zu.json", dir, i);
        write_file(path, cases[i].json, strlen(cases[i].json));
        assert_int_not_equal(ht_tokenizer_load(path, &t, &err), HT_OK);
        if (!strstr(err.msg, cases[i].expect)) fail_msg("case %zu: \"%s\" lacks \"%s\"", i, err.msg, cases[i].expect);
    }
    snprintf(path, sizeof(path), "%s/missing", dir);
    assert_int_not_equal(ht_tokenizer_load(path, &t, &err), HT_OK);
    assert_non_null(strstr(err.msg, "missing"));
    /* Text that is not UTF-8 is an error, not a guess. */
    assert_ht_ok(ht_tokenizer_load(fixture_path("tokenizer/qwen2.json"), &t, &err), &err);
    int32_t *ids;
    int n;
    assert_int_equal(ht_tokenizer_encode(t, "ab\xff", 3, &ids, &n, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "not UTF-8"));
    ht_tokenizer_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_qwen2),
        cmocka_unit_test(test_llama3),
        cmocka_unit_test(test_gpt2),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
