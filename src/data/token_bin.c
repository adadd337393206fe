/* The token_bin dataset: llm.c token shards. A shard is a header of 256 int32
 * little-endian words, then `count` little-endian tokens and nothing else:
 *   [0] magic 20240520
 *   [1] version: 1 = uint16 tokens (llm.c's), 2 = uint32 tokens (vocabularies
 *       beyond 65,536, such as Qwen2.5's 151,936)
 *   [2] token count
 *   [3] the tokenizer's vocabulary size (every id is below it), 0 = unknown;
 *       llm.c leaves it 0, tools/prepare_data.py writes it
 *   [4..255] 0, reserved.
 * Every header is checked before any token is read, and every error names the file. */
#include "hypertrain/data.h"

#include <errno.h>
#include <glob.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define SHARD_MAGIC 20240520
#define SHARD_HEADER_BYTES 1024

static int32_t read_le32(const unsigned char *p) {
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

/* What a checked header says. */
typedef struct shard_header {
    int token_bytes; /* 2 (version 1) or 4 (version 2) */
    size_t count;
    int vocab_size; /* 0 = unknown */
} shard_header;

/* Opens a shard and checks its header against its size. */
static ht_status open_shard(const char *path, FILE **out, shard_header *h, ht_error *err) {
    *out = NULL;
    int fd;
    size_t bytes;
    ht_status st = ht_open_file(path, &fd, &bytes, err);
    if (st != HT_OK) return st;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return ht_fail(err, HT_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    }
    long long size = (long long)bytes;
    unsigned char header[SHARD_HEADER_BYTES];
    if (size < SHARD_HEADER_BYTES || fread(header, 1, sizeof(header), f) != sizeof(header)) {
        fclose(f);
        return ht_fail(err, HT_ERR_FORMAT, "%s: %lld bytes, shorter than the %d-byte header of an llm.c token shard",
                       path, size, SHARD_HEADER_BYTES);
    }
    int32_t magic = read_le32(header), version = read_le32(header + 4), n = read_le32(header + 8);
    int32_t vocab = read_le32(header + 12);
    int width = version == 1 ? 2 : 4;
    long long expected = SHARD_HEADER_BYTES + (long long)width * n;
    if (magic != SHARD_MAGIC)
        st = ht_fail(err, HT_ERR_FORMAT, "%s: bad magic %d, expected %d (not an llm.c token shard)", path, magic,
                     SHARD_MAGIC);
    else if (version != 1 && version != 2)
        st = ht_fail(err, HT_ERR_FORMAT, "%s: version %d, expected 1 (uint16 tokens) or 2 (uint32 tokens)", path,
                     version);
    else if (n < 0)
        st = ht_fail(err, HT_ERR_FORMAT, "%s: the header's token count is negative (%d)", path, n);
    else if (vocab < 0)
        st = ht_fail(err, HT_ERR_FORMAT, "%s: the header's vocabulary size (word 3) is negative (%d)", path, vocab);
    else if (size != expected)
        st = ht_fail(err, HT_ERR_FORMAT,
                     "%s: %s: the header says %d tokens of %d bytes (version %d; %lld bytes with the header), the "
                     "file has %lld bytes",
                     path, size < expected ? "truncated" : "trailing bytes", n, width, version, expected, size);
    if (st != HT_OK) {
        fclose(f);
        return st;
    }
    *out = f;
    h->token_bytes = width;
    h->count = (size_t)n;
    h->vocab_size = vocab;
    return HT_OK;
}

/* Reads the tokens that follow the header of an opened shard into dst (count
 * of them), each checked against the vocabulary the header declares. */
static ht_status read_tokens(FILE *f, const char *path, const shard_header *h, uint32_t *dst, ht_error *err) {
    enum { CHUNK = 1 << 14 };
    unsigned char buf[CHUNK * 4];
    size_t done = 0;
    while (done < h->count) {
        size_t want = h->count - done < CHUNK ? h->count - done : CHUNK;
        size_t got = fread(buf, (size_t)h->token_bytes, want, f);
        if (got != want) return ht_fail(err, HT_ERR_IO, "%s: read %zu of %zu tokens", path, done + got, h->count);
        for (size_t i = 0; i < got; i++) {
            const unsigned char *p = buf + i * (size_t)h->token_bytes;
            dst[done + i] = h->token_bytes == 2 ? (uint32_t)p[0] | (uint32_t)p[1] << 8 : (uint32_t)read_le32(p);
        }
        if (h->vocab_size > 0)
            for (size_t i = 0; i < got; i++)
                if (dst[done + i] >= (uint32_t)h->vocab_size)
                    return ht_fail(err, HT_ERR_FORMAT,
                                   "%s: token at position %zu has id %u, but the header says the vocabulary has %d "
                                   "tokens (a corrupt shard?)",
                                   path, done + i, dst[done + i], h->vocab_size);
        done += got;
    }
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
        shard_header h;
        st = open_shard(g.gl_pathv[i], &f, &h, err);
        if (st != HT_OK) break;
        fclose(f);
        st = ht_dataset_add_source(ds, g.gl_pathv[i], h.count, err);
        if (st == HT_OK) ds->sources[ds->n_sources - 1].vocab_size = h.vocab_size;
        total += h.count;
    }
    if (st == HT_OK && !(ds->tokens = malloc((total ? total : 1) * sizeof(*ds->tokens))))
        st = ht_fail(err, HT_ERR_OOM, "data.path %s: cannot allocate %zu tokens", cfg->path, total);
    for (int i = 0; i < ds->n_sources && st == HT_OK; i++) {
        const ht_data_source *s = &ds->sources[i];
        FILE *f;
        shard_header h;
        st = open_shard(s->path, &f, &h, err);
        if (st != HT_OK) break;
        if (h.count != s->count || h.vocab_size != s->vocab_size)
            st = ht_fail(err, HT_ERR_IO, "%s: changed while being read (%zu tokens, then %zu)", s->path, s->count,
                         h.count);
        else
            st = read_tokens(f, s->path, &h, ds->tokens + s->start, err);
        fclose(f);
    }
    globfree(&g);
    if (st != HT_OK) return st;
    ds->n_tokens = total;
    /* The dataset's vocabulary is the shards' when every header declares one. */
    int vocab = 0;
    for (int i = 0; i < ds->n_sources && vocab >= 0; i++)
        vocab = ds->sources[i].vocab_size == 0      ? -1
                : vocab > ds->sources[i].vocab_size ? vocab
                                                    : ds->sources[i].vocab_size;
    if (vocab > 0) ds->vocab_size = vocab;
    return HT_OK;
}
