/* The JSON reader: valid documents (escapes, unicode, numbers, nesting) parse
 * to the expected tree; each kind of invalid document is rejected with a
 * message naming the document and the byte offset. And the writer helpers. */
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static ht_json *parse_ok(const char *text) {
    ht_json *root = NULL;
    ht_error err = {0};
    assert_ht_ok(ht_json_parse(text, strlen(text), "doc.json", &root, &err), &err);
    return root;
}

/* Parses text, expects failure, and checks the message holds the name and "byte <offset>". */
static void parse_bad(const char *text, size_t len, size_t offset, const char *problem) {
    ht_json *root = (ht_json *)1;
    ht_error err = {0};
    ht_status s = ht_json_parse(text, len, "bad.json", &root, &err);
    if (s == HT_OK) fail_msg("accepted invalid JSON: %s", text);
    assert_int_equal(s, HT_ERR_FORMAT);
    assert_null(root);
    char want[64];
    snprintf(want, sizeof(want), "byte %zu ", offset);
    if (!strstr(err.msg, "bad.json") || !strstr(err.msg, want) || !strstr(err.msg, problem))
        fail_msg("for %s: message '%s' lacks the name, '%s' or '%s'", text, err.msg, want, problem);
}

static void test_scalars(void **state) {
    (void)state;
    ht_json *v = parse_ok(" true ");
    assert_int_equal(v->type, HT_JSON_BOOL);
    assert_true(v->boolean);
    ht_json_free(v);
    v = parse_ok("false");
    assert_int_equal(v->type, HT_JSON_BOOL);
    assert_false(v->boolean);
    ht_json_free(v);
    v = parse_ok("\n\tnull\r\n");
    assert_int_equal(v->type, HT_JSON_NULL);
    ht_json_free(v);

    static const struct {
        const char *text;
        double want;
    } nums[] = {
        {"0", 0.0},
        {"-0", -0.0},
        {"42", 42.0},
        {"-17", -17.0},
        {"3.25", 3.25},
        {"1e-06", 1e-6},
        {"1E+3", 1000.0},
        {"-2.5e2", -250.0},
        {"0.02", 0.02},
        {"1000000.0", 1e6},
        {"1e-400", 0.0},
        {"9007199254740993", 9007199254740992.0},
        {"123456789012", 123456789012.0},
    };
    for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++) {
        v = parse_ok(nums[i].text);
        assert_int_equal(v->type, HT_JSON_NUMBER);
        if (v->number != nums[i].want) fail_msg("%s parsed as %.17g", nums[i].text, v->number);
        ht_json_free(v);
    }
}

static void test_strings(void **state) {
    (void)state;
    static const struct {
        const char *text;
        const char *want;
    } strs[] = {
        {"\"\"", ""},
        {"\"plain\"", "plain"},
        {"\"q\\\"b\\\\s\\/n\\nt\\tr\\rb\\bf\\f\"", "q\"b\\s/n\nt\tr\rb\bf\f"},
        {"\"\\u0041\\u00e9\\u20AC\"", "A\xc3\xa9\xe2\x82\xac"},                 /* A é € */
        {"\"\\ud83d\\ude00\"", "\xf0\x9f\x98\x80"},                             /* U+1F600 from a surrogate pair */
        {"\"raw \xc3\xa9 \xf0\x9f\x98\x80\"", "raw \xc3\xa9 \xf0\x9f\x98\x80"}, /* UTF-8 passes through */
    };
    for (size_t i = 0; i < sizeof(strs) / sizeof(strs[0]); i++) {
        ht_json *v = parse_ok(strs[i].text);
        assert_int_equal(v->type, HT_JSON_STRING);
        assert_string_equal(v->string, strs[i].want);
        ht_json_free(v);
    }
}

static void test_containers(void **state) {
    (void)state;
    ht_json *v = parse_ok("{\"a\": [1, 2.5, \"x\", {\"b\": null}, [], {}], \"c\": {\"d\": true}, \"e\": -1}");
    assert_int_equal(v->type, HT_JSON_OBJECT);
    assert_int_equal(v->count, 3);
    const ht_json *a = ht_json_get(v, "a");
    assert_non_null(a);
    assert_int_equal(a->type, HT_JSON_ARRAY);
    assert_int_equal(a->count, 6);
    assert_true(a->items[1].number == 2.5);
    assert_string_equal(a->items[2].string, "x");
    assert_null(a->items[2].key);
    assert_int_equal(ht_json_get(&a->items[3], "b")->type, HT_JSON_NULL);
    assert_int_equal(a->items[4].count, 0);
    assert_int_equal(a->items[5].type, HT_JSON_OBJECT);
    assert_int_equal(a->items[5].count, 0);
    assert_true(ht_json_get(ht_json_get(v, "c"), "d")->boolean);
    assert_true(ht_json_get(v, "e")->number == -1.0);
    assert_null(ht_json_get(v, "missing"));
    assert_null(ht_json_get(a, "a")); /* not an object */
    ht_json_free(v);

    /* Duplicate keys parse; lookup gives the last, as Python's json does. */
    v = parse_ok("{\"k\": 1, \"k\": 2}");
    assert_int_equal(v->count, 2);
    assert_true(ht_json_get(v, "k")->number == 2.0);
    ht_json_free(v);

    /* 64 levels of nesting are fine; 65 are not. */
    char deep[200];
    memset(deep, '[', 64);
    memset(deep + 64, ']', 64);
    v = NULL;
    ht_error err = {0};
    assert_ht_ok(ht_json_parse(deep, 128, "deep.json", &v, &err), &err);
    ht_json_free(v);
    memset(deep, '[', 65);
    memset(deep + 65, ']', 65);
    parse_bad(deep, 130, 64, "nesting deeper than 64");

    /* Not NUL-terminated: only text[0, len) is read. */
    const char *text = "[1, 2]garbage";
    assert_ht_ok(ht_json_parse(text, 6, "slice.json", &v, &err), &err);
    assert_int_equal(v->count, 2);
    ht_json_free(v);
}

static void test_invalid(void **state) {
    (void)state;
    static const struct {
        const char *text;
        size_t offset;
        const char *problem;
    } bad[] = {
        {"", 0, "unexpected end of input"},
        {"   ", 3, "unexpected end of input"},
        {"[1, 2", 5, "unexpected end of input"},
        {"[1 2]", 3, "expected ',' or ']'"},
        {"{\"a\" 1}", 5, "expected ':'"},
        {"{\"a\": 1,}", 8, "expected a string key"},
        {"{1: 2}", 1, "expected a string key"},
        {"[1,]", 3, "unexpected character ']'"},
        {"{\"a\": 1 \"b\": 2}", 8, "expected ',' or '}'"},
        {"tru", 0, "unexpected character 't'"},
        {"nul", 0, "unexpected character 'n'"},
        {"True", 0, "unexpected character 'T'"},
        {"[1] x", 4, "trailing characters"},
        {"{} {}", 3, "trailing characters"},
        {"01", 1, "trailing characters"},
        {"-", 1, "digit after '-'"},
        {"+1", 0, "unexpected character '+'"},
        {"1.", 2, "digit after '.'"},
        {".5", 0, "unexpected character '.'"},
        {"1e", 2, "exponent"},
        {"1e+", 3, "exponent"},
        {"1e999", 0, "out of the range"},
        {"NaN", 0, "unexpected character 'N'"},
        {"\"abc", 0, "unterminated string"},
        {"\"a\\qb\"", 2, "invalid escape"},
        {"\"\\u12G4\"", 1, "four hex digits"},
        {"\"\\ud800\"", 1, "high surrogate"},
        {"\"\\ud800\\u0041\"", 1, "high surrogate"},
        {"\"\\udc00\"", 1, "lone low surrogate"},
        {"\"\\u0000\"", 1, "\\u0000"},
        {"\"tab\there\"", 4, "control character 0x09"},
        {"\"bad \xff utf8\"", 5, "invalid UTF-8"},
        {"\"overlong \xc0\xaf\"", 10, "invalid UTF-8"},
        {"\"surrogate \xed\xa0\x80\"", 11, "invalid UTF-8"},
        {"[\"x\", \x01]", 6, "unexpected byte 0x01"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
        parse_bad(bad[i].text, strlen(bad[i].text), bad[i].offset, bad[i].problem);

    /* line:column counts newlines. */
    ht_json *v = NULL;
    ht_error err = {0};
    const char *text = "{\n  \"a\": 1,\n  \"b\": ?\n}";
    assert_int_equal(ht_json_parse(text, strlen(text), "lines.json", &v, &err), HT_ERR_FORMAT);
    if (!strstr(err.msg, "line 3, column 8")) fail_msg("no line:column in '%s'", err.msg);
}

static char *capture(void (*write)(FILE *, const void *), const void *arg) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_non_null(f);
    write(f, arg);
    fclose(f);
    return buf;
}

static void write_str(FILE *f, const void *s) { ht_json_write_string(f, s); }
static void write_num(FILE *f, const void *x) { ht_json_write_number(f, *(const double *)x); }

/* ht_read_file_max: a file at the cap reads, one byte more is refused naming the file and the cap. */
static void test_read_file_cap(void **state) {
    (void)state;
    char path[1200];
    snprintf(path, sizeof(path), "%s/ten.json", scratch_dir("json_cap"));
    write_file(path, "[1,2,3,45]", 10);
    char *text;
    size_t len;
    ht_error err;
    assert_ht_ok(ht_read_file_max(path, 10, "a test file may have", &text, &len, &err), &err);
    assert_int_equal(len, 10);
    free(text);
    assert_int_equal(ht_read_file_max(path, 9, "a test file may have", &text, &len, &err), HT_ERR_FORMAT);
    assert_null(text);
    if (!strstr(err.msg, path) || !strstr(err.msg, "10 bytes, more than the 9 bytes a test file may have"))
        fail_msg("message '%s'", err.msg);
}

static void test_writer(void **state) {
    (void)state;
    const char *s = "a\"b\\c\nd\te\x01 \xc3\xa9";
    char *out = capture(write_str, s);
    assert_string_equal(out, "\"a\\\"b\\\\c\\nd\\te\\u0001 \xc3\xa9\"");
    ht_json *v = parse_ok(out);
    assert_string_equal(v->string, s);
    ht_json_free(v);
    free(out);

    static const struct {
        double x;
        const char *want;
    } nums[] = {
        {10000.0, "10000"}, {1e-6, "1e-06"}, {0.02, "0.02"}, {-3.5, "-3.5"}, {0.1 + 0.2, "0.30000000000000004"}};
    for (size_t i = 0; i < sizeof(nums) / sizeof(nums[0]); i++) {
        out = capture(write_num, &nums[i].x);
        assert_string_equal(out, nums[i].want);
        free(out);
    }
    double inf = INFINITY;
    out = capture(write_num, &inf);
    assert_string_equal(out, "null");
    free(out);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalars), cmocka_unit_test(test_strings), cmocka_unit_test(test_containers),
        cmocka_unit_test(test_invalid), cmocka_unit_test(test_writer),  cmocka_unit_test(test_read_file_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
