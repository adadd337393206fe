/* safetensors: a writer -> reader round trip over every dtype (with
 * conversion, a scalar and an empty tensor, metadata), and every kind of
 * malformed file rejected with a message naming the file and the problem. */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hypertrain/ckpt.h"

static void test_round_trip(void **state) {
    (void)state;
    const char *dir = scratch_dir("st_round_trip");
    char path[1200];
    snprintf(path, sizeof(path), "%s/rt.safetensors", dir);

    float f32[6] = {1.5f, -2.0f, 3.25f, 0.0f, -0.5f, 1e-3f};
    float to_bf16[5] = {1.0f, 1.00390625f, -3.0f, 65504.0f, 0.1f}; /* converted while writing */
    uint16_t f16[6];
    for (int i = 0; i < 6; i++) f16[i] = ht_f32_to_f16((float)i * 0.25f);
    int32_t i32[4] = {-1, 0, 1, 2147483647};
    int64_t i64[2] = {-5, 1LL << 40};
    uint16_t u16[3] = {0, 1, 65535};
    uint8_t u8[7] = {1, 2, 3, 4, 5, 6, 7}; /* an odd byte count: later tensors must stay aligned */
    float scalar = 42.0f;

    ht_st_writer w = {0};
    ht_error err = {0};
    int64_t s_f32[2] = {2, 3}, s_bf16[1] = {5}, s_f16[3] = {3, 1, 2}, s_i32[1] = {4}, s_i64[1] = {2}, s_u16[1] = {3},
            s_u8[2] = {7, 1}, s_empty[2] = {0, 4};
    assert_ht_ok(ht_st_writer_add(&w, "u8", HT_DTYPE_U8, 2, s_u8, u8, HT_DTYPE_U8, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "a.f32", HT_DTYPE_F32, 2, s_f32, f32, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "b.bf16", HT_DTYPE_BF16, 1, s_bf16, to_bf16, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "c.f16", HT_DTYPE_F16, 3, s_f16, f16, HT_DTYPE_F16, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "d.i32", HT_DTYPE_I32, 1, s_i32, i32, HT_DTYPE_I32, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "e.i64", HT_DTYPE_I64, 1, s_i64, i64, HT_DTYPE_I64, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "f.u16", HT_DTYPE_U16, 1, s_u16, u16, HT_DTYPE_U16, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "scalar", HT_DTYPE_F32, 0, NULL, &scalar, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "empty", HT_DTYPE_F32, 2, s_empty, NULL, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_add_metadata(&w, "format", "pt", &err), &err);
    assert_ht_ok(ht_st_writer_add_metadata(&w, "note", "a \"quoted\"\nline \xc3\xa9", &err), &err);
    assert_int_equal(ht_st_writer_data_bytes(&w), 24 + 10 + 12 + 16 + 16 + 6 + 7 + 4);
    assert_ht_ok(ht_st_writer_write(&w, path, &err), &err);
    ht_st_writer_free(&w);
    assert_int_not_equal(access(path, F_OK), -1);

    /* No temporary file is left behind. */
    char tmp[1300];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
    assert_int_equal(access(tmp, F_OK), -1);

    /* The header length is a multiple of 8 (padded with spaces, as the reference does). */
    char *bytes;
    size_t size;
    assert_ht_ok(ht_read_file(path, &bytes, &size, &err), &err);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | (unsigned char)bytes[i];
    assert_int_equal(n % 8, 0);
    free(bytes);

    ht_safetensors *st = NULL;
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    assert_int_equal(ht_safetensors_count(st), 9);
    assert_string_equal(ht_safetensors_metadata_get(st, "format"), "pt");
    assert_string_equal(ht_safetensors_metadata_get(st, "note"), "a \"quoted\"\nline \xc3\xa9");
    assert_null(ht_safetensors_metadata_get(st, "absent"));
    assert_null(ht_safetensors_find(st, "absent"));
    assert_string_equal(ht_safetensors_path(st), path);

    const ht_st_tensor *t = ht_safetensors_find(st, "a.f32");
    assert_non_null(t);
    assert_int_equal(t->dtype, HT_DTYPE_F32);
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 2);
    assert_int_equal(t->shape[1], 3);
    assert_int_equal(t->nbytes, sizeof(f32));
    assert_memory_equal(t->data, f32, sizeof(f32));

    t = ht_safetensors_find(st, "b.bf16");
    assert_int_equal(t->dtype, HT_DTYPE_BF16);
    assert_int_equal(t->nbytes, 10);
    for (int i = 0; i < 5; i++) assert_int_equal(((const uint16_t *)t->data)[i], ht_f32_to_bf16(to_bf16[i]));

    t = ht_safetensors_find(st, "c.f16");
    assert_int_equal(t->ndim, 3);
    assert_int_equal(t->shape[2], 2);
    assert_memory_equal(t->data, f16, sizeof(f16));
    assert_memory_equal(ht_safetensors_find(st, "d.i32")->data, i32, sizeof(i32));
    assert_memory_equal(ht_safetensors_find(st, "e.i64")->data, i64, sizeof(i64));
    assert_memory_equal(ht_safetensors_find(st, "f.u16")->data, u16, sizeof(u16));
    t = ht_safetensors_find(st, "u8");
    assert_int_equal(t->dtype, HT_DTYPE_U8);
    assert_memory_equal(t->data, u8, sizeof(u8));

    t = ht_safetensors_find(st, "scalar");
    assert_int_equal(t->ndim, 0);
    assert_int_equal(t->nbytes, 4);
    assert_memory_equal(t->data, &scalar, 4);
    t = ht_safetensors_find(st, "empty");
    assert_int_equal(t->ndim, 2);
    assert_int_equal(t->shape[0], 0);
    assert_int_equal(t->nbytes, 0);

    /* Iteration visits every tensor once, each aligned to its element size. */
    size_t total = 0;
    for (int i = 0; i < ht_safetensors_count(st); i++) {
        t = ht_safetensors_tensor(st, i);
        total += t->nbytes;
        assert_int_equal((uintptr_t)t->data % ht_dtype_size(t->dtype), 0);
        assert_ptr_equal(ht_safetensors_find(st, t->name), t);
    }
    assert_int_equal(total, 95);
    assert_null(ht_safetensors_tensor(st, 9));
    ht_safetensors_close(st);

    /* Rewriting replaces the file atomically; an empty file (no tensors) is valid. */
    ht_st_writer empty = {0};
    assert_ht_ok(ht_st_writer_write(&empty, path, &err), &err);
    assert_ht_ok(ht_safetensors_open(path, &st, &err), &err);
    assert_int_equal(ht_safetensors_count(st), 0);
    ht_safetensors_close(st);
}

static void test_writer_errors(void **state) {
    (void)state;
    const char *dir = scratch_dir("st_writer_errors");
    char path[1200];
    snprintf(path, sizeof(path), "%s/dup.safetensors", dir);
    float x[2] = {1, 2};
    int64_t shape[1] = {2};
    ht_st_writer w = {0};
    ht_error err = {0};
    assert_ht_ok(ht_st_writer_add(&w, "x", HT_DTYPE_F32, 1, shape, x, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "x", HT_DTYPE_BF16, 1, shape, x, HT_DTYPE_F32, &err), &err);
    assert_int_equal(ht_st_writer_write(&w, path, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "'x' added twice"));
    assert_int_equal(access(path, F_OK), -1);
    assert_int_equal(ht_st_writer_add(&w, "y", HT_DTYPE_I32, 1, shape, x, HT_DTYPE_F32, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "cannot convert"));
    assert_int_equal(ht_st_writer_add(&w, "__metadata__", HT_DTYPE_F32, 1, shape, x, HT_DTYPE_F32, &err),
                     HT_ERR_INVALID);
    ht_st_writer_free(&w);

    snprintf(path, sizeof(path), "%s/no/such/dir/x.safetensors", dir);
    assert_int_equal(ht_st_writer_write(&w, path, &err), HT_ERR_IO);
    assert_non_null(strstr(err.msg, "no/such/dir"));
}

/* Writes an 8-byte length (header_len, or strlen(header) when negative), the header, then `data_len` zero bytes. */
static void write_raw(const char *path, const char *header, long long header_len, size_t data_len) {
    size_t hl = strlen(header);
    uint64_t n = header_len < 0 ? hl : (uint64_t)header_len;
    size_t total = 8 + hl + data_len;
    unsigned char *buf = calloc(1, total);
    for (int i = 0; i < 8; i++) buf[i] = (unsigned char)(n >> (8 * i));
    memcpy(buf + 8, header, hl);
    write_file(path, buf, total);
    free(buf);
}

static void expect_bad(const char *path, const char *p1, const char *p2) {
    ht_safetensors *st = (ht_safetensors *)1;
    ht_error err = {0};
    ht_status s = ht_safetensors_open(path, &st, &err);
    if (s == HT_OK) fail_msg("%s was accepted (expected '%s')", path, p1);
    assert_null(st);
    if (!strstr(err.msg, path) || !strstr(err.msg, p1) || (p2 && !strstr(err.msg, p2)))
        fail_msg("message '%s' lacks the path, '%s' or '%s'", err.msg, p1, p2 ? p2 : "");
}

/* A FIFO as a safetensors file (a Hugging Face model's, a PEFT adapter's, a
 * checkpoint's rank file) is an error naming it, at once (watchdog). */
static void test_fifo_is_not_a_file(void **state) {
    (void)state;
    char path[1200];
    snprintf(path, sizeof(path), "%s/model.safetensors", scratch_dir("st_fifo"));
    assert_int_equal(mkfifo(path, 0600), 0);
    watchdog(5, "ht_safetensors_open of a FIFO");
    expect_bad(path, "expected a file, found a FIFO (named pipe)", NULL);
    watchdog(0, NULL);
}

static void test_malformed(void **state) {
    (void)state;
    const char *dir = scratch_dir("st_malformed");
    char path[1200];
    static const struct {
        const char *name;
        const char *header;
        size_t data_len;
        const char *p1, *p2;
    } cases[] = {
        {"not_json", "{\"a\": ", 0, "invalid JSON at byte 6", "header"},
        {"not_object", "[1, 2]", 0, "not a JSON object", NULL},
        {"bad_dtype", "{\"w\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, "unknown dtype \"F64\"",
         "'w'"},
        {"no_dtype", "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, "\"dtype\" is missing", "'w'"},
        {"neg_shape", "{\"w\":{\"dtype\":\"F32\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 0,
         "shape entry 0 is not a non-negative integer", "'w'"},
        {"frac_shape", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2, 1.5],\"data_offsets\":[0,12]}}", 12,
         "shape entry 1 is not a non-negative integer", "'w'"},
        {"str_shape", "{\"w\":{\"dtype\":\"F32\",\"shape\":\"2\",\"data_offsets\":[0,8]}}", 8, "not an array", "'w'"},
        {"no_offsets", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "\"data_offsets\" must be", "'w'"},
        {"backwards", "{\"w\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[8,0]}}", 8, "end before they begin",
         "'w'"},
        {"wrong_len", "{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 12,
         "hold 12 bytes but shape [2, 2] of F32 needs 16", "'w'"},
        {"overlap",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, "tensor 'b' at data offsets [4, 12] overlaps tensor 'a'", NULL},
        {"gap",
         "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
         "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
         12, "not contiguous", "'b'"},
        {"late_start", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", 8, "not 0", "'a'"},
        {"trailing", "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 8, "4 trailing bytes", NULL},
        {"short_data", "{\"a\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", 8,
         "ends at data offset 16 beyond the 8 bytes", "'a'"},
        {"meta_number", "{\"__metadata__\":{\"format\":\"pt\",\"step\":3}}", 0, "metadata value of \"step\"",
         "not a string"},
        {"meta_array", "{\"__metadata__\":[\"pt\"]}", 0, "\"__metadata__\" is not an object", NULL},
        {"duplicate",
         "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
         "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
         2, "tensor 'a' appears twice", NULL},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        snprintf(path, sizeof(path), "%s/%s.safetensors", dir, cases[i].name);
        write_raw(path, cases[i].header, -1, cases[i].data_len);
        expect_bad(path, cases[i].p1, cases[i].p2);
    }

    /* The header length field: past the end of the file, past the 100 MB limit. */
    const char *ok_header = "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}";
    snprintf(path, sizeof(path), "%s/len_past_end.safetensors", dir);
    write_raw(path, ok_header, 1000, 4);
    expect_bad(path, "header length 1000 is larger than the", "truncated");
    snprintf(path, sizeof(path), "%s/len_huge.safetensors", dir);
    write_raw(path, ok_header, 200000000, 4);
    expect_bad(path, "header length 200000000 exceeds the 100000000-byte limit", NULL);
    /* More entries than HT_ST_MAX_TENSORS: refused before any is read (the same key will do). */
    size_t n_entries = (size_t)HT_ST_MAX_TENSORS + 1;
    char *many = malloc(6 * n_entries + 2);
    assert_non_null(many);
    size_t at = 0;
    many[at++] = '{';
    for (size_t i = 0; i < n_entries; i++) {
        memcpy(many + at, "\"a\":0,", 6);
        at += 6;
    }
    many[at - 1] = '}';
    many[at] = '\0';
    snprintf(path, sizeof(path), "%s/many.safetensors", dir);
    write_raw(path, many, -1, 0);
    free(many);
    expect_bad(path, "1048577 entries, more than the 1048576 tensors", "HT_ST_MAX_TENSORS");
    snprintf(path, sizeof(path), "%s/tiny.safetensors", dir);
    write_file(path, "\x05\x00\x00", 3);
    expect_bad(path, "too short", NULL);

    /* A good file cut short anywhere in its data is rejected. */
    snprintf(path, sizeof(path), "%s/good.safetensors", dir);
    float x[64] = {0};
    int64_t shape[2] = {8, 8};
    ht_st_writer w = {0};
    ht_error err = {0};
    assert_ht_ok(ht_st_writer_add(&w, "x", HT_DTYPE_F32, 2, shape, x, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_write(&w, path, &err), &err);
    ht_st_writer_free(&w);
    char *bytes;
    size_t size;
    assert_ht_ok(ht_read_file(path, &bytes, &size, &err), &err);
    snprintf(path, sizeof(path), "%s/truncated.safetensors", dir);
    write_file(path, bytes, size - 10);
    expect_bad(path, "tensor 'x' ends at data offset 256 beyond the 246 bytes", "truncated file");
    write_file(path, bytes, 20); /* inside the header */
    expect_bad(path, "is larger than the 12 bytes after it", NULL);
    free(bytes);

    snprintf(path, sizeof(path), "%s/absent.safetensors", dir);
    expect_bad(path, "cannot open", NULL);
}

/* Every single-byte corruption of a small file opens cleanly or fails with a
 * message: never a crash, never a tensor outside the file (run under ASan). */
static void test_corruption(void **state) {
    (void)state;
    const char *dir = scratch_dir("st_corruption");
    char path[1200];
    snprintf(path, sizeof(path), "%s/good.safetensors", dir);
    float x[6] = {1, 2, 3, 4, 5, 6};
    int64_t s2[2] = {2, 3}, s1[1] = {6};
    ht_st_writer w = {0};
    ht_error err = {0};
    assert_ht_ok(ht_st_writer_add(&w, "w", HT_DTYPE_F32, 2, s2, x, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_add(&w, "h", HT_DTYPE_BF16, 1, s1, x, HT_DTYPE_F32, &err), &err);
    assert_ht_ok(ht_st_writer_add_metadata(&w, "format", "pt", &err), &err);
    assert_ht_ok(ht_st_writer_write(&w, path, &err), &err);
    ht_st_writer_free(&w);
    char *bytes;
    size_t size;
    assert_ht_ok(ht_read_file(path, &bytes, &size, &err), &err);
    snprintf(path, sizeof(path), "%s/bad.safetensors", dir);
    static const unsigned char values[] = {0x00, '9', '"', '}', ',', 0xff};
    size_t header_end = 8 + (size_t)(unsigned char)bytes[0] + 256u * (unsigned char)bytes[1];
    for (size_t i = 0; i < header_end; i++) {
        for (size_t v = 0; v < sizeof(values); v++) {
            char saved = bytes[i];
            bytes[i] = (char)values[v];
            write_file(path, bytes, size);
            bytes[i] = saved;
            ht_safetensors *st = NULL;
            if (ht_safetensors_open(path, &st, &err) != HT_OK) {
                assert_null(st);
                assert_non_null(strstr(err.msg, path));
                continue;
            }
            for (int k = 0; k < ht_safetensors_count(st); k++) {
                const ht_st_tensor *t = ht_safetensors_tensor(st, k);
                size_t sum = 0; /* touch every byte: ASan flags any tensor outside the mapping */
                for (size_t b = 0; b < t->nbytes; b++) sum += ((const unsigned char *)t->data)[b];
                assert_true(sum <= 255 * t->nbytes);
            }
            ht_safetensors_close(st);
        }
    }
    free(bytes);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trip), cmocka_unit_test(test_writer_errors),
        cmocka_unit_test(test_malformed),  cmocka_unit_test(test_fifo_is_not_a_file),
        cmocka_unit_test(test_corruption),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
