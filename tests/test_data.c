/* The data layer: text_bytes on files and folders (and the default fortunes
 * corpus when installed), token_bin round trips (versions 1 and 2, and a shard
 * that tools/prepare_data.py wrote) and every malformed shard, the split, the
 * vocabulary check, and the loader's determinism, rank split and exact resume. */
#include "harness.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "hypertrain/data.h"

static ht_data_config config(const char *type, const char *path, int seq_len, double valid_fraction) {
    ht_data_config cfg = {0};
    snprintf(cfg.dataset_type, sizeof(cfg.dataset_type), "%s", type);
    snprintf(cfg.path, sizeof(cfg.path), "%s", path);
    cfg.seq_len = seq_len;
    cfg.valid_fraction = valid_fraction;
    return cfg;
}

static const char *join(const char *dir, const char *name) {
    static char bufs[8][1200];
    static int next = 0;
    char *b = bufs[next++ % 8];
    snprintf(b, sizeof(bufs[0]), "%s/%s", dir, name);
    return b;
}

static void put_le32(unsigned char *p, int32_t v) {
    uint32_t u = (uint32_t)v;
    for (int i = 0; i < 4; i++) p[i] = (unsigned char)(u >> (8 * i));
}

/* An llm.c shard: header (magic, version, count, vocab as given) then `n`
 * tokens of `width` bytes (n may disagree with count, to make truncated or
 * padded files). */
static void write_shard_words(const char *path, int32_t magic, int32_t version, int32_t count, int32_t vocab,
                              const uint32_t *toks, size_t n, int width) {
    size_t bytes = 1024 + (size_t)width * n;
    unsigned char *buf = calloc(1, bytes);
    put_le32(buf, magic);
    put_le32(buf + 4, version);
    put_le32(buf + 8, count);
    put_le32(buf + 12, vocab);
    for (size_t i = 0; i < n; i++)
        for (int b = 0; b < width; b++) buf[1024 + (size_t)width * i + (size_t)b] = (unsigned char)(toks[i] >> (8 * b));
    write_file(path, buf, bytes);
    free(buf);
}

/* A version-1 shard (uint16 tokens), vocabulary unknown. */
static void write_shard(const char *path, int32_t magic, int32_t version, int32_t count, const uint16_t *toks,
                        size_t n) {
    uint32_t *wide = calloc(n ? n : 1, sizeof(uint32_t));
    for (size_t i = 0; i < n; i++) wide[i] = toks[i];
    write_shard_words(path, magic, version, count, 0, wide, n, 2);
    free(wide);
}

/* A version-2 shard (uint32 tokens) of `n` tokens, the count right, declaring `vocab`. */
static void write_shard_v2(const char *path, int32_t vocab, const uint32_t *toks, size_t n) {
    write_shard_words(path, 20240520, 2, (int32_t)n, vocab, toks, n, 4);
}

static void write_text(const char *path, const char *text) { write_file(path, text, strlen(text)); }

/* Opening must fail, with every `needles` (NULL-terminated) in the message. */
static void expect_open_error(const ht_data_config *cfg, const char *const *needles) {
    ht_dataset *ds = (ht_dataset *)1;
    ht_error err = {0};
    ht_status st = ht_dataset_open(cfg, &ds, &err);
    if (st == HT_OK) fail_msg("opening %s succeeded; expected an error", cfg->path);
    assert_null(ds);
    for (int i = 0; needles[i]; i++)
        if (!strstr(err.msg, needles[i])) fail_msg("error \"%s\" does not mention \"%s\"", err.msg, needles[i]);
}

static void assert_tokens_equal_bytes(const ht_dataset *ds, size_t start, const char *text) {
    for (size_t i = 0; text[i]; i++) assert_int_equal(ds->tokens[start + i], (unsigned char)text[i]);
}

/* ---------------------------------------------------------------- text_bytes */

static void test_text_file(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_text_file");
    const char *text = "The quick brown fox jumps over the lazy dog.\n";
    write_text(join(dir, "a.txt"), text);
    ht_data_config cfg = config("text_bytes", join(dir, "a.txt"), 8, 0.0);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ds->n_tokens, strlen(text));
    assert_tokens_equal_bytes(ds, 0, text);
    assert_int_equal(ht_dataset_vocab_size(ds), 256);
    assert_int_equal(ds->n_sources, 1);
    assert_int_equal(ht_dataset_split_tokens(ds, HT_SPLIT_TRAIN), strlen(text));
    assert_int_equal(ht_dataset_split_tokens(ds, HT_SPLIT_VALID), 0);
    ht_dataset_free(ds);

    /* A "text" file with a NUL byte is refused, naming the file and the offset. */
    write_file(join(dir, "b.txt"), "abc\0def", 7);
    cfg = config("text_bytes", join(dir, "b.txt"), 2, 0.0);
    expect_open_error(&cfg, (const char *[]){"b.txt", "offset 3", NULL});
    cfg = config("text_bytes", join(dir, "missing.txt"), 2, 0.0);
    expect_open_error(&cfg, (const char *[]){"missing.txt", NULL});
}

static void test_text_folder(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_text_folder");
    write_text(join(dir, "b.txt"), "second file\n");
    write_text(join(dir, "a.txt"), "first file\n");
    write_file(join(dir, "a.dat"), "\x01\x00\x02\x03", 4);    /* binary: skipped */
    assert_int_equal(symlink("a.txt", join(dir, "a.u8")), 0); /* symlink: skipped */
    assert_int_equal(mkdir(join(dir, "sub"), 0755), 0);       /* subfolder: not read */
    write_text(join(dir, "sub/c.txt"), "nested\n");

    ht_data_config cfg = config("text_bytes", dir, 4, 0.0);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ds->n_sources, 2);
    assert_non_null(strstr(ds->sources[0].path, "a.txt"));
    assert_non_null(strstr(ds->sources[1].path, "b.txt"));
    assert_int_equal(ds->sources[1].start, strlen("first file\n"));
    assert_int_equal(ds->n_tokens, strlen("first file\nsecond file\n"));
    assert_tokens_equal_bytes(ds, 0, "first file\nsecond file\n");
    ht_dataset_free(ds);

    /* A folder with only binary files has nothing to train on. */
    const char *bin = scratch_dir("data_text_binary_only");
    write_file(join(bin, "x.dat"), "\0\0", 2);
    cfg = config("text_bytes", bin, 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"no text files", "1 binary", NULL});
}

/* The default corpus: Debian's fortunes, ~2.5 MB of text beside .dat indexes and .u8 symlinks. */
static void test_fortunes(void **state) {
    (void)state;
    const char *dir = "/usr/share/games/fortunes";
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
        skip();
        return;
    }
    ht_data_config cfg = config("text_bytes", dir, 256, 0.01);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_true(ds->n_tokens > 2000000 && ds->n_tokens < 4000000);
    for (int i = 0; i < ds->n_sources; i++) {
        size_t len = strlen(ds->sources[i].path);
        assert_false(len > 4 && strcmp(ds->sources[i].path + len - 4, ".dat") == 0);
        assert_false(len > 3 && strcmp(ds->sources[i].path + len - 3, ".u8") == 0);
    }
    for (size_t i = 0; i < ds->n_tokens; i++) assert_true(ds->tokens[i] > 0 && ds->tokens[i] < 256);
    assert_int_equal(ht_dataset_split_tokens(ds, HT_SPLIT_VALID), (size_t)(0.01 * (double)ds->n_tokens));
    ht_loader l;
    assert_ht_ok(ht_loader_init(&l, ds, HT_SPLIT_TRAIN, 4, 256, 0, 1, 42, true, &err), &err);
    int32_t batch[4 * 257];
    ht_loader_next(&l, batch);
    ht_loader_free(&l);
    ht_dataset_free(ds);
}

/* ---------------------------------------------------------------- token_bin */

static void test_token_bin_round_trip(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_token_bin");
    uint16_t a[100], b[50], c[30];
    for (int i = 0; i < 100; i++) a[i] = (uint16_t)(i * 7 % 1000);
    for (int i = 0; i < 50; i++) b[i] = (uint16_t)(60000 + i);
    for (int i = 0; i < 30; i++) c[i] = (uint16_t)i;
    /* Written out of order: the glob's sorted order decides the stream. */
    write_shard(join(dir, "shard_002.bin"), 20240520, 1, 30, c, 30);
    write_shard(join(dir, "shard_000.bin"), 20240520, 1, 100, a, 100);
    write_shard(join(dir, "shard_001.bin"), 20240520, 1, 50, b, 50);
    write_text(join(dir, "notes.txt"), "not a shard");

    ht_data_config cfg = config("token_bin", join(dir, "shard_*.bin"), 8, 0.0);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ds->n_tokens, 180);
    assert_int_equal(ds->n_sources, 3);
    assert_non_null(strstr(ds->sources[2].path, "shard_002.bin"));
    assert_int_equal(ds->sources[2].start, 150);
    for (int i = 0; i < 100; i++) assert_int_equal(ds->tokens[i], a[i]);
    for (int i = 0; i < 50; i++) assert_int_equal(ds->tokens[100 + i], b[i]);
    for (int i = 0; i < 30; i++) assert_int_equal(ds->tokens[150 + i], c[i]);
    assert_int_equal(ht_dataset_vocab_size(ds), 60050);
    assert_ht_ok(ht_dataset_check_vocab(ds, 60050, NULL, &err), &err);
    ht_dataset_free(ds);

    /* One file without a glob character. */
    cfg = config("token_bin", join(dir, "shard_002.bin"), 8, 0.0);
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ds->n_tokens, 30);
    assert_int_equal(ht_dataset_vocab_size(ds), 30);
    ht_dataset_free(ds);
}

/* A FIFO as a token shard or as the text corpus is an error naming the file
 * and what it is, at once (opened plainly it waits for a writer forever; the
 * watchdog fails the test instead); a FIFO inside a text folder is skipped
 * with the other entries that are not regular files. */
static void test_data_that_is_not_a_file(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_fifo");
    assert_int_equal(mkfifo(join(dir, "shard_000000.bin"), 0600), 0);
    ht_data_config cfg = config("token_bin", join(dir, "shard_*.bin"), 4, 0.0);
    watchdog(5, "ht_dataset_open of a FIFO token shard");
    expect_open_error(&cfg, (const char *[]){"shard_000000.bin: expected a file, found a FIFO (named pipe)", NULL});
    cfg = config("text_bytes", join(dir, "shard_000000.bin"), 4, 0.0);
    watchdog(5, "ht_dataset_open of a FIFO text corpus");
    expect_open_error(&cfg, (const char *[]){"shard_000000.bin: expected a file, found a FIFO (named pipe)", NULL});
    watchdog(0, NULL);
    write_text(join(dir, "a.txt"), "some text for the folder\n");
    cfg = config("text_bytes", dir, 4, 0.0);
    ht_dataset *ds;
    ht_error err;
    watchdog(5, "ht_dataset_open of a folder holding a FIFO");
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    watchdog(0, NULL);
    assert_int_equal(ds->n_sources, 1);
    ht_dataset_free(ds);
}

static void test_token_bin_malformed(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_token_bin_bad");
    uint16_t toks[64];
    for (int i = 0; i < 64; i++) toks[i] = (uint16_t)i;
    ht_data_config cfg;

    write_file(join(dir, "short.bin"), "tiny", 4);
    cfg = config("token_bin", join(dir, "short.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"short.bin", "4 bytes", "header", NULL});

    write_shard(join(dir, "magic.bin"), 12345, 1, 64, toks, 64);
    cfg = config("token_bin", join(dir, "magic.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"magic.bin", "12345", "20240520", NULL});

    write_shard(join(dir, "version.bin"), 20240520, 3, 64, toks, 64);
    cfg = config("token_bin", join(dir, "version.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"version.bin", "version 3", "expected 1", "or 2", NULL});

    write_shard(join(dir, "truncated.bin"), 20240520, 1, 64, toks, 60);
    cfg = config("token_bin", join(dir, "truncated.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"truncated.bin", "truncated", "64 tokens", NULL});

    write_shard(join(dir, "trailing.bin"), 20240520, 1, 60, toks, 64);
    cfg = config("token_bin", join(dir, "trailing.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"trailing.bin", "trailing bytes", NULL});

    write_shard(join(dir, "negative.bin"), 20240520, 1, -5, toks, 0);
    cfg = config("token_bin", join(dir, "negative.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"negative.bin", "negative", NULL});

    cfg = config("token_bin", join(dir, "nothing_*.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"nothing_*.bin", "no file matches", NULL});

    /* One bad shard among good ones is named. */
    const char *mix = scratch_dir("data_token_bin_mixed");
    write_shard(join(mix, "s0.bin"), 20240520, 1, 64, toks, 64);
    write_shard(join(mix, "s1.bin"), 20240520, 1, 64, toks, 63);
    write_shard(join(mix, "s2.bin"), 20240520, 1, 64, toks, 64);
    cfg = config("token_bin", join(mix, "s*.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"s1.bin", "truncated", NULL});
}

static void test_check_vocab(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_vocab");
    uint16_t a[40], b[40];
    for (int i = 0; i < 40; i++) a[i] = b[i] = (uint16_t)(i % 10);
    b[7] = 500;
    b[20] = 700;
    write_shard(join(dir, "p0.bin"), 20240520, 1, 40, a, 40);
    write_shard(join(dir, "p1.bin"), 20240520, 1, 40, b, 40);
    ht_data_config cfg = config("token_bin", join(dir, "p*.bin"), 4, 0.0);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ht_dataset_vocab_size(ds), 701);
    assert_ht_ok(ht_dataset_check_vocab(ds, 701, NULL, &err), &err);
    assert_int_not_equal(ht_dataset_check_vocab(ds, 300, NULL, &err), HT_OK);
    assert_non_null(strstr(err.msg, "p1.bin"));
    assert_non_null(strstr(err.msg, "position 7 "));
    assert_non_null(strstr(err.msg, "id 500"));
    assert_non_null(strstr(err.msg, "300"));
    ht_dataset_free(ds);
}

/* Version 2: uint32 tokens beyond 65,535 (Qwen2.5's vocabulary is 151,936),
 * the header's vocabulary, and a glob that mixes both versions. */
static void test_token_bin_v2_round_trip(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_token_bin_v2");
    uint32_t a[100], b[70];
    uint16_t c[30];
    for (int i = 0; i < 100; i++) a[i] = (uint32_t)(i * 1511 % 151665);
    for (int i = 0; i < 70; i++) b[i] = (uint32_t)(151664 - i);
    for (int i = 0; i < 30; i++) c[i] = (uint16_t)(65535 - i);
    write_shard_v2(join(dir, "v2_000.bin"), 151665, a, 100);
    write_shard_v2(join(dir, "v2_001.bin"), 151665, b, 70);

    ht_data_config cfg = config("token_bin", join(dir, "v2_*.bin"), 8, 0.0);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ds->n_tokens, 170);
    for (int i = 0; i < 100; i++) assert_int_equal(ds->tokens[i], a[i]);
    for (int i = 0; i < 70; i++) assert_int_equal(ds->tokens[100 + i], b[i]);
    assert_int_equal(ds->sources[1].vocab_size, 151665);
    assert_int_equal(ht_dataset_vocab_size(ds), 151665); /* every header declares it: theirs, not max id + 1 */
    assert_ht_ok(ht_dataset_check_vocab(ds, 151936, "model.vocab_size", &err), &err);
    ht_loader l;
    assert_ht_ok(ht_loader_init(&l, ds, HT_SPLIT_TRAIN, 1, 8, 0, 1, 1, false, &err), &err);
    int32_t row[9];
    for (int k = 0; k <= 12; k++) ht_loader_next(&l, row); /* window 12 starts at token 96 */
    for (int t = 0; t < 9; t++) assert_int_equal(row[t], (int32_t)(96 + t < 100 ? a[96 + t] : b[96 + t - 100]));
    ht_loader_free(&l);
    ht_dataset_free(ds);

    /* A version-1 shard among them, vocabulary unknown: max id + 1 again. */
    write_shard(join(dir, "v2_002.bin"), 20240520, 1, 30, c, 30);
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ds->n_tokens, 200);
    for (int i = 0; i < 30; i++) assert_int_equal(ds->tokens[170 + i], c[i]);
    assert_int_equal(ds->sources[2].vocab_size, 0);
    assert_int_equal(ht_dataset_vocab_size(ds), 151665);
    ht_dataset_free(ds);
}

static void test_token_bin_v2_malformed(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_token_bin_v2_bad");
    uint32_t toks[64];
    for (int i = 0; i < 64; i++) toks[i] = (uint32_t)(100000 + i);
    ht_data_config cfg;

    write_shard_words(join(dir, "truncated.bin"), 20240520, 2, 64, 0, toks, 60, 4);
    cfg = config("token_bin", join(dir, "truncated.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"truncated.bin", "truncated", "64 tokens of 4 bytes", "version 2", NULL});

    /* 64 uint16 tokens under a version-2 header: half the bytes it needs. */
    write_shard_words(join(dir, "narrow.bin"), 20240520, 2, 64, 0, toks, 64, 2);
    cfg = config("token_bin", join(dir, "narrow.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"narrow.bin", "truncated", "1280 bytes", "1152 bytes", NULL});

    write_shard_words(join(dir, "oversized.bin"), 20240520, 2, 60, 0, toks, 64, 4);
    cfg = config("token_bin", join(dir, "oversized.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"oversized.bin", "trailing bytes", "60 tokens", NULL});

    write_shard_words(join(dir, "version0.bin"), 20240520, 0, 64, 0, toks, 64, 4);
    cfg = config("token_bin", join(dir, "version0.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"version0.bin", "version 0", "expected 1", NULL});

    write_shard_words(join(dir, "vocab.bin"), 20240520, 2, 64, -7, toks, 64, 4);
    cfg = config("token_bin", join(dir, "vocab.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"vocab.bin", "vocabulary size", "negative (-7)", NULL});

    /* A token at or above the vocabulary its own header declares. */
    write_shard_v2(join(dir, "corrupt.bin"), 100050, toks, 64);
    cfg = config("token_bin", join(dir, "corrupt.bin"), 4, 0.0);
    expect_open_error(&cfg, (const char *[]){"corrupt.bin", "position 50", "id 100050", "100050 tokens", NULL});
}

/* Shards that tools/prepare_data.py wrote (tools/test_prepare_data.py
 * --write-fixtures): a 70,000-word tokenizer, so version 2; EOS 69999 after
 * each of four documents, the third empty; 4 tokens a shard. */
static void test_token_bin_prepared(void **state) {
    (void)state;
    ht_data_config cfg = config("token_bin", fixture_path("data/prepared_v2_*.bin"), 4, 0.0);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    const uint32_t want[] = {1, 65536, 69998, 69999, 7, 69999, 69999, 65535, 2, 69999};
    assert_int_equal(ds->n_tokens, 10);
    for (int i = 0; i < 10; i++) assert_int_equal(ds->tokens[i], want[i]);
    assert_int_equal(ds->n_sources, 3);
    assert_int_equal(ht_dataset_vocab_size(ds), 70000);
    assert_ht_ok(ht_dataset_check_vocab(ds, 70000, NULL, &err), &err);
    assert_int_not_equal(ht_dataset_check_vocab(ds, 65536, "model.vocab_size", &err), HT_OK);
    assert_non_null(strstr(err.msg, "prepared_v2_000000.bin"));
    ht_dataset_free(ds);
}

/* The model's vocabulary against version-2 data: a header that declares more,
 * or (header silent) a token id at or above it, is refused, naming the shard. */
static void test_check_vocab_v2(void **state) {
    (void)state;
    const char *dir = scratch_dir("data_vocab_v2");
    uint32_t toks[40];
    for (int i = 0; i < 40; i++) toks[i] = (uint32_t)(i * 3000);
    write_shard_v2(join(dir, "qwen.bin"), 151665, toks, 40);
    ht_data_config cfg = config("token_bin", join(dir, "qwen.bin"), 4, 0.0);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    /* Every id (at most 117,000) fits 128,256, but the tokenizer's vocabulary does not. */
    assert_int_not_equal(ht_dataset_check_vocab(ds, 128256, "model.vocab_size", &err), HT_OK);
    const char *want[] = {"qwen.bin", "vocabulary of 151665 tokens", "but model.vocab_size is 128256", NULL};
    for (int i = 0; want[i]; i++)
        if (!strstr(err.msg, want[i])) fail_msg("error \"%s\" does not mention \"%s\"", err.msg, want[i]);
    assert_ht_ok(ht_dataset_check_vocab(ds, 151665, "model.vocab_size", &err), &err);
    ht_dataset_free(ds);

    write_shard_v2(join(dir, "silent.bin"), 0, toks, 40);
    cfg = config("token_bin", join(dir, "silent.bin"), 4, 0.0);
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ht_dataset_vocab_size(ds), 117001);
    assert_int_not_equal(ht_dataset_check_vocab(ds, 100000, "the vocab_size of hf/config.json", &err), HT_OK);
    const char *want2[] = {"silent.bin", "position 34 ", "id 102000", "the vocab_size of hf/config.json is 100000",
                           NULL};
    for (int i = 0; want2[i]; i++)
        if (!strstr(err.msg, want2[i])) fail_msg("error \"%s\" does not mention \"%s\"", err.msg, want2[i]);
    ht_dataset_free(ds);

    /* An id beyond INT32_MAX is still an id >= vocab_size, not a negative int. */
    toks[5] = 0xfffffff0u;
    write_shard_v2(join(dir, "huge.bin"), 0, toks, 40);
    cfg = config("token_bin", join(dir, "huge.bin"), 4, 0.0);
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_not_equal(ht_dataset_check_vocab(ds, 151936, NULL, &err), HT_OK);
    assert_non_null(strstr(err.msg, "id 4294967280"));
    ht_dataset_free(ds);
}

/* ---------------------------------------------------------------- split */

static ht_dataset *open_counting_shard(const char *name, size_t n, int seq_len, double valid_fraction) {
    const char *dir = scratch_dir(name);
    uint16_t *toks = malloc(n * sizeof(uint16_t));
    for (size_t i = 0; i < n; i++) toks[i] = (uint16_t)(i % 65536);
    write_shard(join(dir, "t.bin"), 20240520, 1, (int32_t)n, toks, n);
    free(toks);
    ht_data_config cfg = config("token_bin", join(dir, "t.bin"), seq_len, valid_fraction);
    ht_dataset *ds;
    ht_error err;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    return ds;
}

static void test_split(void **state) {
    (void)state;
    ht_dataset *ds = open_counting_shard("data_split_a", 1000, 16, 0.1);
    assert_int_equal(ds->split_count[HT_SPLIT_TRAIN], 900);
    assert_int_equal(ds->split_count[HT_SPLIT_VALID], 100);
    assert_int_equal(ds->split_start[HT_SPLIT_VALID], 900);
    ht_dataset_free(ds);

    /* A tiny fraction still keeps one full window for validation. */
    ds = open_counting_shard("data_split_b", 1000, 16, 0.001);
    assert_int_equal(ds->split_count[HT_SPLIT_VALID], 17);
    assert_int_equal(ds->split_count[HT_SPLIT_TRAIN], 983);
    ht_dataset_free(ds);

    ds = open_counting_shard("data_split_c", 1000, 16, 0.0);
    assert_int_equal(ds->split_count[HT_SPLIT_VALID], 0);
    assert_int_equal(ds->split_count[HT_SPLIT_TRAIN], 1000);
    ht_dataset_free(ds);

    /* Too small: 20 tokens cannot hold a train and a validation window of 17. */
    const char *dir = scratch_dir("data_split_small");
    uint16_t toks[20] = {0};
    write_shard(join(dir, "t.bin"), 20240520, 1, 20, toks, 20);
    ht_data_config cfg = config("token_bin", join(dir, "t.bin"), 16, 0.1);
    expect_open_error(&cfg, (const char *[]){"t.bin", "has 20 tokens", "at least 34", NULL});
    cfg.valid_fraction = 0.0;
    cfg.seq_len = 20;
    expect_open_error(&cfg, (const char *[]){"has 20 tokens", "at least 21", NULL});
    cfg.seq_len = 16;
    cfg.valid_fraction = 1.0;
    expect_open_error(&cfg, (const char *[]){"valid_fraction", NULL});
}

/* ---------------------------------------------------------------- loader */

enum { NTOK = 2000, SEQ = 8 };

/* The window a batch row came from, given the counting stream token[i] = i. */
static int window_of(const int32_t *row) { return row[0] / SEQ; }

static void test_loader_windows(void **state) {
    (void)state;
    ht_dataset *ds = open_counting_shard("data_loader_windows", NTOK, SEQ, 0.1);
    ht_error err;
    ht_loader l;
    /* Validation, not shuffled: consecutive windows overlapping by one token. */
    assert_ht_ok(ht_loader_init(&l, ds, HT_SPLIT_VALID, 2, SEQ, 0, 1, 1, false, &err), &err);
    size_t n_valid = ds->split_count[HT_SPLIT_VALID];
    assert_int_equal(l.n_windows, (n_valid - 1) / SEQ);
    assert_int_equal(ht_loader_batches_per_epoch(&l), l.n_windows / 2);
    int32_t batch[2 * (SEQ + 1)], first[2 * (SEQ + 1)];
    int32_t expect = (int32_t)ds->split_start[HT_SPLIT_VALID];
    for (uint64_t k = 0; k < ht_loader_batches_per_epoch(&l); k++) {
        ht_loader_next(&l, batch);
        if (k == 0) memcpy(first, batch, sizeof(batch));
        for (int b = 0; b < 2; b++) {
            for (int t = 0; t <= SEQ; t++) assert_int_equal(batch[b * (SEQ + 1) + t], expect + t);
            expect += SEQ;
        }
    }
    ht_loader_reset(&l);
    ht_loader_next(&l, batch);
    assert_memory_equal(batch, first, sizeof(batch));

    int32_t inputs[2 * SEQ], targets[2 * SEQ];
    ht_batch_split(batch, 2, SEQ, inputs, targets);
    for (int b = 0; b < 2; b++)
        for (int t = 0; t < SEQ; t++) {
            assert_int_equal(inputs[b * SEQ + t], batch[b * (SEQ + 1) + t]);
            assert_int_equal(targets[b * SEQ + t], batch[b * (SEQ + 1) + t + 1]);
        }
    ht_loader_free(&l);

    /* A global batch larger than the split is refused. */
    assert_int_not_equal(ht_loader_init(&l, ds, HT_SPLIT_VALID, 100, SEQ, 0, 1, 1, false, &err), HT_OK);
    assert_non_null(strstr(err.msg, "validation"));
    ht_dataset_free(ds);
}

/* One shuffled epoch visits every window at most once and never leaves the train split. */
static void test_loader_epoch_is_permutation(void **state) {
    (void)state;
    ht_dataset *ds = open_counting_shard("data_loader_perm", NTOK, SEQ, 0.1);
    ht_error err;
    ht_loader l;
    assert_ht_ok(ht_loader_init(&l, ds, HT_SPLIT_TRAIN, 4, SEQ, 0, 1, 7, true, &err), &err);
    size_t nw = l.n_windows;
    int *seen = calloc(nw, sizeof(int));
    int32_t batch[4 * (SEQ + 1)];
    bool in_order = true;
    for (uint64_t k = 0; k < ht_loader_batches_per_epoch(&l); k++) {
        ht_loader_next(&l, batch);
        for (int b = 0; b < 4; b++) {
            int w = window_of(batch + b * (SEQ + 1));
            assert_true(w >= 0 && (size_t)w < nw);
            assert_int_equal(seen[w]++, 0);
            if ((uint64_t)w != k * 4 + (uint64_t)b) in_order = false;
            assert_true(batch[b * (SEQ + 1) + SEQ] < (int32_t)ds->split_count[HT_SPLIT_TRAIN]);
        }
    }
    assert_false(in_order);
    assert_int_equal(ht_loader_position(&l).epoch, 0);
    ht_loader_next(&l, batch);
    assert_int_equal(ht_loader_position(&l).epoch, 1);
    assert_int_equal(ht_loader_position(&l).index, 4);
    free(seen);
    ht_loader_free(&l);
    ht_dataset_free(ds);
}

static void test_loader_determinism(void **state) {
    (void)state;
    ht_dataset *ds = open_counting_shard("data_loader_det", NTOK, SEQ, 0.1);
    ht_error err;
    ht_loader a, b, c;
    assert_ht_ok(ht_loader_init(&a, ds, HT_SPLIT_TRAIN, 4, SEQ, 0, 1, 42, true, &err), &err);
    assert_ht_ok(ht_loader_init(&b, ds, HT_SPLIT_TRAIN, 4, SEQ, 0, 1, 42, true, &err), &err);
    assert_ht_ok(ht_loader_init(&c, ds, HT_SPLIT_TRAIN, 4, SEQ, 0, 1, 43, true, &err), &err);
    int32_t ba[4 * (SEQ + 1)], bb[4 * (SEQ + 1)], bc[4 * (SEQ + 1)];
    int differ = 0;
    for (int k = 0; k < 150; k++) { /* 150 > 2 epochs of 56 batches */
        ht_loader_next(&a, ba);
        ht_loader_next(&b, bb);
        ht_loader_next(&c, bc);
        assert_memory_equal(ba, bb, sizeof(ba));
        differ += memcmp(ba, bc, sizeof(ba)) != 0;
    }
    assert_true(differ > 100);
    ht_loader_free(&a);
    ht_loader_free(&b);
    ht_loader_free(&c);
    ht_dataset_free(ds);
}

/* world = 3 ranks of B = 2 split the world = 1, B = 6 batch without overlap. */
static void test_loader_ranks(void **state) {
    (void)state;
    ht_dataset *ds = open_counting_shard("data_loader_ranks", NTOK, SEQ, 0.1);
    ht_error err;
    enum { B = 2, W = 3, ROW = SEQ + 1 };
    ht_loader global, ranks[W];
    assert_ht_ok(ht_loader_init(&global, ds, HT_SPLIT_TRAIN, B * W, SEQ, 0, 1, 5, true, &err), &err);
    for (int r = 0; r < W; r++)
        assert_ht_ok(ht_loader_init(&ranks[r], ds, HT_SPLIT_TRAIN, B, SEQ, r, W, 5, true, &err), &err);
    assert_int_equal(ht_loader_batches_per_epoch(&global), ht_loader_batches_per_epoch(&ranks[0]));
    int32_t g[B * W * ROW], part[W][B * ROW];
    for (int k = 0; k < 100; k++) { /* crosses epochs */
        ht_loader_next(&global, g);
        for (int r = 0; r < W; r++) {
            ht_loader_next(&ranks[r], part[r]);
            assert_memory_equal(part[r], g + r * B * ROW, sizeof(part[r]));
        }
        for (int i = 0; i < W * B; i++)
            for (int j = i + 1; j < W * B; j++) assert_int_not_equal(window_of(g + i * ROW), window_of(g + j * ROW));
    }
    ht_loader_free(&global);
    for (int r = 0; r < W; r++) ht_loader_free(&ranks[r]);
    ht_dataset_free(ds);
}

/* A fresh loader resumed at a saved position gives exactly the next batches,
 * whether the position is mid-epoch, at an epoch's end or past it. */
static void test_loader_resume(void **state) {
    (void)state;
    ht_dataset *ds = open_counting_shard("data_loader_resume", NTOK, SEQ, 0.1);
    ht_error err;
    enum { B = 3, ROW = SEQ + 1 };
    ht_loader ref;
    assert_ht_ok(ht_loader_init(&ref, ds, HT_SPLIT_TRAIN, B, SEQ, 1, 2, 99, true, &err), &err);
    uint64_t per_epoch = ht_loader_batches_per_epoch(&ref);
    int32_t want[B * ROW], got[B * ROW];
    const uint64_t saves[] = {0, 5, per_epoch - 1, per_epoch, per_epoch + 3, 2 * per_epoch};
    uint64_t done = 0;
    for (size_t s = 0; s < sizeof(saves) / sizeof(saves[0]); s++) {
        for (; done < saves[s]; done++) ht_loader_next(&ref, want);
        ht_loader_pos pos = ht_loader_position(&ref);
        ht_loader fresh;
        assert_ht_ok(ht_loader_init(&fresh, ds, HT_SPLIT_TRAIN, B, SEQ, 1, 2, 99, true, &err), &err);
        assert_ht_ok(ht_loader_resume(&fresh, pos, &err), &err);
        ht_loader copy = ref; /* the reference continues independently of this check */
        copy.perm = malloc(ref.n_windows * sizeof(uint32_t));
        memcpy(copy.perm, ref.perm, ref.n_windows * sizeof(uint32_t));
        for (uint64_t k = 0; k < per_epoch + 2; k++) { /* always across an epoch boundary */
            ht_loader_next(&copy, want);
            ht_loader_next(&fresh, got);
            assert_memory_equal(got, want, sizeof(got));
        }
        assert_int_equal(ht_loader_position(&fresh).epoch, ht_loader_position(&copy).epoch);
        assert_int_equal(ht_loader_position(&fresh).index, ht_loader_position(&copy).index);
        ht_loader_free(&copy);
        ht_loader_free(&fresh);
    }
    ht_loader_pos bad = {0, ref.n_windows + 1};
    assert_int_not_equal(ht_loader_resume(&ref, bad, &err), HT_OK);
    ht_loader_free(&ref);
    ht_dataset_free(ds);
}

/* ---------------------------------------------------------------- registry */

static ht_status open_constant(const ht_data_config *cfg, ht_dataset *ds, ht_error *err) {
    size_t n = 100;
    ds->tokens = malloc(n * sizeof(*ds->tokens));
    if (!ds->tokens) return ht_fail(err, HT_ERR_OOM, "oom");
    for (size_t i = 0; i < n; i++) ds->tokens[i] = 3;
    ds->n_tokens = n;
    return ht_dataset_add_source(ds, cfg->path, n, err);
}

static void test_registry(void **state) {
    (void)state;
    ht_data_config cfg = config("parquet", "/nowhere", 8, 0.0);
    expect_open_error(&cfg, (const char *[]){"parquet", "text_bytes", "token_bin", NULL});

    ht_error err;
    assert_ht_ok(ht_dataset_register("constant", open_constant, &err), &err);
    assert_int_not_equal(ht_dataset_register("constant", open_constant, &err), HT_OK);
    assert_non_null(strstr(err.msg, "already registered"));
    assert_int_not_equal(ht_dataset_register("text_bytes", open_constant, &err), HT_OK);
    assert_non_null(strstr(ht_dataset_registered_names(), "constant"));

    cfg = config("constant", "memory", 8, 0.0);
    ht_dataset *ds;
    assert_ht_ok(ht_dataset_open(&cfg, &ds, &err), &err);
    assert_int_equal(ht_dataset_vocab_size(ds), 4);
    assert_int_equal(ds->n_tokens, 100);
    ht_dataset_free(ds);

    cfg = config("constant", "memory", 0, 0.0);
    expect_open_error(&cfg, (const char *[]){"seq_len", NULL});
}

int main(void) {
    ht_log_set_level(HT_LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_text_file),
        cmocka_unit_test(test_text_folder),
        cmocka_unit_test(test_fortunes),
        cmocka_unit_test(test_token_bin_round_trip),
        cmocka_unit_test(test_token_bin_malformed),
        cmocka_unit_test(test_data_that_is_not_a_file),
        cmocka_unit_test(test_check_vocab),
        cmocka_unit_test(test_token_bin_v2_round_trip),
        cmocka_unit_test(test_token_bin_v2_malformed),
        cmocka_unit_test(test_token_bin_prepared),
        cmocka_unit_test(test_check_vocab_v2),
        cmocka_unit_test(test_split),
        cmocka_unit_test(test_loader_windows),
        cmocka_unit_test(test_loader_epoch_is_permutation),
        cmocka_unit_test(test_loader_determinism),
        cmocka_unit_test(test_loader_ranks),
        cmocka_unit_test(test_loader_resume),
        cmocka_unit_test(test_registry),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
