/* Training data: the data registry (name -> opener) with the built-ins
 * "text_bytes" and "token_bin", the deterministic train/validation split, and
 * the loader that deals shuffled windows of T+1 tokens to data-parallel ranks
 * from a position that a checkpoint can save and restore. */
#ifndef HYPERTRAIN_DATA_H
#define HYPERTRAIN_DATA_H

#include "hypertrain/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The `data:` section of the config (docs/CONFIG.md). */
typedef struct ht_data_config {
    char dataset_type[64]; /* registry name: "text_bytes", "token_bin" */
    char path[1024];       /* text_bytes: a file or folder; token_bin: a .bin file or a glob of them */
    int seq_len;           /* tokens per training sequence (a window holds seq_len + 1) */
    double valid_fraction; /* in [0, 1): the tail of the token stream kept for validation */
} ht_data_config;

typedef enum ht_split { HT_SPLIT_TRAIN = 0, HT_SPLIT_VALID = 1 } ht_split;

/* One file the tokens came from: tokens [start, start + count) of the stream. */
typedef struct ht_data_source {
    char path[1024];
    size_t start, count;
    int vocab_size; /* the vocabulary the file says it was tokenized with; 0 = unknown */
} ht_data_source;

/* A dataset is one token stream held once, as uint32 (so vocabularies beyond
 * 65,536), plus where each token came from and how the stream is split. */
typedef struct ht_dataset {
    char type[64];
    uint32_t *tokens; /* (n_tokens,) malloc'ed; owned by the dataset */
    size_t n_tokens;
    ht_data_source *sources; /* (n_sources,) in stream order */
    int n_sources;
    int vocab_size; /* the opener's (256 for bytes, the shards' headers) or, when it leaves 0, max id + 1 */
    int seq_len;
    size_t split_start[2], split_count[2]; /* indexed by ht_split */
} ht_dataset;

/* An opener loads cfg->path into ds->tokens (malloc'ed), records the files
 * through ht_dataset_add_source (and may set each one's vocab_size) and may
 * set ds->vocab_size. The registry then checks the sizes and splits. On
 * failure the opener may leave partial state: the registry frees it. */
typedef ht_status (*ht_dataset_opener)(const ht_data_config *cfg, ht_dataset *ds, ht_error *err);

/* The registry. Built-ins register themselves on first use; plugins call
 * ht_dataset_register. Registering a name twice is an error. */
ht_status ht_dataset_register(const char *name, ht_dataset_opener opener, ht_error *err);
/* Comma-separated registered names, for error messages. */
const char *ht_dataset_registered_names(void);
/* Opens cfg->dataset_type on cfg->path and splits it: the last
 * valid_fraction of the stream (at least seq_len + 1 tokens when
 * valid_fraction > 0) is validation, the rest train. A stream too small for
 * one train sequence is an error that says how many tokens it has and needs. */
ht_status ht_dataset_open(const ht_data_config *cfg, ht_dataset **out, ht_error *err);
void ht_dataset_free(ht_dataset *ds);

/* For openers: appends a source covering the next `count` tokens of the stream. */
ht_status ht_dataset_add_source(ht_dataset *ds, const char *path, size_t count, ht_error *err);

/* The built-in openers, public so that a plugin can wrap them.
 * text_bytes: a file, or a folder's regular files (not recursive, symlinks
 * skipped, files with a NUL byte skipped as binary) in byte order of their
 * names, concatenated; the tokens are the bytes (vocab 256).
 * token_bin: llm.c token shards (header of 256 int32 LE: magic 20240520,
 * version, token count, vocabulary size or 0; then count LE tokens, uint16
 * for version 1, uint32 for version 2), one file or the glob(3) matches in
 * sorted order. A token at or above its shard's declared vocabulary is an error. */
ht_status ht_dataset_open_text_bytes(const ht_data_config *cfg, ht_dataset *ds, ht_error *err);
ht_status ht_dataset_open_token_bin(const ht_data_config *cfg, ht_dataset *ds, ht_error *err);

static inline int ht_dataset_vocab_size(const ht_dataset *ds) { return ds->vocab_size; }
static inline size_t ht_dataset_split_tokens(const ht_dataset *ds, ht_split split) { return ds->split_count[split]; }
/* Checks the data against the model's vocab_size: fails naming the first file
 * whose declared vocabulary is larger, or else the file and the token position
 * in it of the first token id >= vocab_size. `vocab_from` names where the
 * model's vocab_size came from in the messages ("model.vocab_size", a
 * config.json); NULL says "the model's vocab_size". */
ht_status ht_dataset_check_vocab(const ht_dataset *ds, int vocab_size, const char *vocab_from, ht_error *err);

/* The vocabulary size of a Hugging Face tokenizer: `path` is a tokenizer.json
 * or a folder holding one; the size is one more than the largest id of its
 * model's vocab and its added_tokens. `file` gets the file read. */
ht_status ht_tokenizer_vocab_size(const char *path, int *vocab_size, char *file, size_t n, ht_error *err);

/* A byte-level BPE tokenizer from a Hugging Face tokenizer.json (`path`: the
 * file or a folder holding it), as GPT-2, Qwen2 and Llama 3 have: a BPE
 * model (vocab, merges, ignore_merges) over GPT-2's byte alphabet, the
 * added tokens, and a pre-tokenizer of GPT-2's, Qwen2's or Llama 3's
 * pattern (written out by hand: src/data/tokenizer.c); another model,
 * pre-tokenizer or normalizer is an error naming it. An NFC normalizer is
 * taken as the identity: text already in NFC (nearly all typed text)
 * encodes as the tokenizers package encodes it. */
typedef struct ht_tokenizer ht_tokenizer;
ht_status ht_tokenizer_load(const char *path, ht_tokenizer **out, ht_error *err);
void ht_tokenizer_free(ht_tokenizer *t);
/* text (len bytes of UTF-8) -> *ids (malloc'ed, *count of them) as the
 * tokenizers package's encode(text) with its special tokens added (the
 * post-processor's before the text, as Llama 3's <|begin_of_text|>). */
ht_status ht_tokenizer_encode(const ht_tokenizer *t, const char *text, size_t len, int32_t **ids, int *count,
                              ht_error *err);
/* The bytes of token `id` into out (at most cap), their count (0: no such
 * token); an added token's text as it is. */
size_t ht_tokenizer_decode(const ht_tokenizer *t, int32_t id, char *out, size_t cap);
/* The ids [0, n) the tokenizer has; a token's id by its text (-1: none). */
int32_t ht_tokenizer_vocab(const ht_tokenizer *t);
int32_t ht_tokenizer_find(const ht_tokenizer *t, const char *token);

/* Where a loader stands: the next global batch starts at window perm[index]
 * of epoch `epoch`. It does not depend on B or the world size, so a
 * checkpoint resumes on a different process count at the same place. */
typedef struct ht_loader_pos {
    uint64_t epoch;
    uint64_t index;
} ht_loader_pos;

/* Window w of a split is its tokens [w*T, w*T + T + 1); consecutive windows
 * overlap by one token. An epoch is a permutation of the windows (identity
 * without shuffle; with shuffle Fisher-Yates seeded from (seed, epoch)). A
 * step's global batch is the next world*B windows of the permutation, of
 * which rank r takes [r*B, (r+1)*B). An epoch drops the tail that does not
 * fill a global batch. The loader borrows the dataset's tokens: keep the
 * dataset alive while the loader is. */
typedef struct ht_loader {
    const uint32_t *tokens; /* the split's first token, borrowed */
    int B, T, rank, world;
    uint64_t seed;
    bool shuffle;
    size_t n_windows;
    uint32_t *perm; /* (n_windows,) this epoch's order; NULL without shuffle */
    ht_loader_pos pos;
} ht_loader;

/* Fails when the split has fewer windows than one global batch (world*B). */
ht_status ht_loader_init(ht_loader *l, const ht_dataset *ds, ht_split split, int B, int T, int rank, int world,
                         uint64_t seed, bool shuffle, ht_error *err);
/* Fills tokens (B, T+1), row b = one window, and advances; at the end of an
 * epoch it moves on to the next one. */
void ht_loader_next(ht_loader *l, int32_t *tokens);
static inline ht_loader_pos ht_loader_position(const ht_loader *l) { return l->pos; }
/* Restores a position saved by ht_loader_position (fails if it is out of range). */
ht_status ht_loader_resume(ht_loader *l, ht_loader_pos pos, ht_error *err);
/* Back to the start of epoch 0 (an evaluation pass starts here). */
void ht_loader_reset(ht_loader *l);
/* Full global batches in one epoch: n_windows / (world * B). */
static inline uint64_t ht_loader_batches_per_epoch(const ht_loader *l) {
    return l->n_windows / ((size_t)l->world * (size_t)l->B);
}
void ht_loader_free(ht_loader *l);

/* Splits tokens (B, T+1) into inputs (B, T) = columns [0, T) and targets (B, T) = columns [1, T+1). */
void ht_batch_split(const int32_t *tokens, int B, int T, int32_t *inputs, int32_t *targets);

#ifdef __cplusplus
}
#endif
#endif
