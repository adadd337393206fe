/* The token_bin dataset: llm.c token shards. A shard is a header of 256 int32
 * little-endian words ([0] magic 20240520, [1] version 1, [2] token count)
 * followed by `count` uint16 little-endian tokens, and nothing else. Every
 * header is checked before any token is read, and every error names the file. */
#include "hypertrain/data.h"

#include <errno.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define SHARD_MAGIC 20240520
#define SHARD_VERSION 1
#define SHARD_HEADER_BYTES 1024

static int32_t read_le32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

/* Opens a shard, checks its header against its size and returns its token count. */
static ht_status open_shard(const char *path, FILE **out, size_t *count, ht_error *err) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return ht_fail(err, HT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
        fclose(f);
        return ht_fail(err, HT_ERR_IO, "%s: not a regular file", path);
    }
    long long size = (long long)sb.st_size;
    unsigned char header[SHARD_HEADER_BYTES];
    if (size < SHARD_HEADER_BYTES || fread(header, 1, sizeof(header), f) != sizeof(header)) {
        fclose(f);
        return ht_fail(err, HT_ERR_FORMAT, "%s: %lld bytes, shorter than the %d-byte header of an llm.c token shard",
                       path, size, SHARD_HEADER_BYTES);
    }
    int32_t magic = read_le32(header), version = read_le32(header + 4), n = read_le32(header + 8);
    ht_status st = HT_OK;
    long long expected = SHARD_HEADER_BYTES + 2LL * n;
    if (magic != SHARD_MAGIC)
        st = ht_fail(err, HT_ERR_FORMAT, "%s: bad magic %d, expected %d (not an llm.c token shard)", path, magic,
                     SHARD_MAGIC);
    else if (version != SHARD_VERSION)
        st = ht_fail(err, HT_ERR_FORMAT, "%s: version %d, expected %d (uint16 tokens)%s", path, version, SHARD_VERSION,
                     version == 2 ? "; version 2 holds uint32 tokens, which token_bin does not read" : "");
    else if (n < 0)
        st = ht_fail(err, HT_ERR_FORMAT, "%s: the header's token count is negative (%d)", path, n);
    else if (size != expected)
        st = ht_fail(err, HT_ERR_FORMAT,
                     "%s: %s: the header says %d tokens (%lld bytes with the header), the file has %lld bytes", path,
                     size < expected ? "truncated" : "trailing bytes", n, expected, size);
    if (st != HT_OK) {
        fclose(f);
        return st;
    }
    *out = f;
    *count = (size_t)n;
    return HT_OK;
}

/* Reads `count` tokens that follow the header of an opened shard into dst. */
static ht_status read_tokens(FILE *f, const char *path, uint16_t *dst, size_t count, ht_error *err) {
    size_t got = fread(dst, sizeof(uint16_t), count, f);
    if (got != count) return ht_fail(err, HT_ERR_IO, "%s: read %zu of %zu tokens", path, got, count);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    for (size_t i = 0; i < count; i++) dst[i] = (uint16_t)(dst[i] >> 8 | dst[i] << 8);
#endif
    return HT_OK;
}

ht_status ht_dataset_open_token_bin(const ht_data_config *cfg, ht_dataset *ds, ht_error *err) {
    glob_t g;
    int rc = glob(cfg->path, 0, NULL, &g);
    if (rc == GLOB_NOMATCH) {
        globfree(&g);
        return ht_fail(err, HT_ERR_IO, "data.path %s: no file matches", cfg->path);
    }
    if (rc != 0) {
        globfree(&g);
        return ht_fail(err, HT_ERR_IO, "data.path %s: glob failed (%s)", cfg->path,
                       rc == GLOB_NOSPACE ? "out of memory" : "read error");
    }
    /* Pass 1 checks every header and sizes the stream; pass 2 reads it into one allocation. */
    ht_status st = HT_OK;
    size_t total = 0;
    for (size_t i = 0; i < g.gl_pathc && st == HT_OK; i++) {
        FILE *f;
        size_t count;
        st = open_shard(g.gl_pathv[i], &f, &count, err);
        if (st != HT_OK) break;
        fclose(f);
        st = ht_dataset_add_source(ds, g.gl_pathv[i], count, err);
        total += count;
    }
    if (st == HT_OK && !(ds->tokens = malloc((total ? total : 1) * sizeof(uint16_t))))
        st = ht_fail(err, HT_ERR_OOM, "data.path %s: cannot allocate %zu tokens", cfg->path, total);
    for (int i = 0; i < ds->n_sources && st == HT_OK; i++) {
        const ht_data_source *s = &ds->sources[i];
        FILE *f;
        size_t count;
        st = open_shard(s->path, &f, &count, err);
        if (st != HT_OK) break;
        if (count != s->count)
            st = ht_fail(err, HT_ERR_IO, "%s: changed while being read (%zu tokens, then %zu)", s->path, s->count,
                         count);
        else
            st = read_tokens(f, s->path, ds->tokens + s->start, count, err);
        fclose(f);
    }
    globfree(&g);
    if (st == HT_OK) ds->n_tokens = total;
    return st;
}
