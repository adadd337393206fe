/* Checkpoint files: the safetensors format (a validating reader over a
 * mapped file, and a streaming atomic writer), and Hugging Face model
 * directories (config.json + model.safetensors, sharded with an index). */
#ifndef HYPERTRAIN_CKPT_H
#define HYPERTRAIN_CKPT_H

#include "hypertrain/base.h"
#include "hypertrain/model.h"
#include "hypertrain/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- safetensors */

#define HT_ST_MAX_DIMS 8
#define HT_ST_MAX_HEADER (100u * 1000u * 1000u) /* the reference implementation's limit */

/* One tensor of an open file. `data` points into the mapping: valid until
 * close, read-only, aligned as the writer laid it out (this writer aligns
 * every tensor to its element size; other writers usually do too). */
typedef struct ht_st_tensor {
    const char *name;
    ht_dtype dtype;
    int ndim; /* 0 for a scalar */
    int64_t shape[HT_ST_MAX_DIMS];
    const void *data;
    size_t nbytes; /* numel * ht_dtype_size(dtype) */
} ht_st_tensor;

typedef struct ht_safetensors ht_safetensors;

/* Maps and validates the whole file: header length and JSON, dtypes, shapes,
 * byte lengths, and offsets that tile the data buffer exactly. Every error
 * names the file, the tensor when there is one, and the problem. */
ht_status ht_safetensors_open(const char *path, ht_safetensors **out, ht_error *err);
void ht_safetensors_close(ht_safetensors *st);
const char *ht_safetensors_path(const ht_safetensors *st);
/* Tensors in file (offset) order: for (i = 0; i < count; i++) tensor(st, i). */
int ht_safetensors_count(const ht_safetensors *st);
const ht_st_tensor *ht_safetensors_tensor(const ht_safetensors *st, int i);
/* By name, or NULL. */
const ht_st_tensor *ht_safetensors_find(const ht_safetensors *st, const char *name);
/* A "__metadata__" value by key, or NULL. */
const char *ht_safetensors_metadata_get(const ht_safetensors *st, const char *key);

/* The writer collects entries that BORROW their source data (nothing is
 * copied until write), so a caller can describe a whole rank's shard and the
 * bytes stream to disk one tensor at a time. Start from a zeroed struct:
 *     ht_st_writer w = {0};
 *     ht_st_writer_add(&w, name, HT_DTYPE_BF16, ndim, shape, src, HT_DTYPE_F32, err);
 *     ht_st_writer_add_metadata(&w, "format", "pt", err);
 *     ht_st_writer_write(&w, path, err);
 *     ht_st_writer_free(&w); */
typedef struct ht_st_entry {
    char *name;
    ht_dtype dtype; /* in the file */
    int ndim;
    int64_t shape[HT_ST_MAX_DIMS];
    const void *src; /* numel elements of src_dtype, borrowed */
    ht_dtype src_dtype;
} ht_st_entry;

typedef struct ht_st_writer {
    ht_st_entry *entries;
    int count, capacity;
    char **meta_keys, **meta_values; /* copies */
    int meta_count, meta_capacity;
} ht_st_writer;

/* Adds a tensor stored as `dtype`, read from `src` (of `src_dtype`) when the
 * file is written; the two dtypes must be equal or both float (converted
 * with round-to-nearest-even). Names must be unique. */
ht_status ht_st_writer_add(ht_st_writer *w, const char *name, ht_dtype dtype, int ndim, const int64_t *shape,
                           const void *src, ht_dtype src_dtype, ht_error *err);
ht_status ht_st_writer_add_metadata(ht_st_writer *w, const char *key, const char *value, ht_error *err);
/* Writes path atomically: path.tmp.<pid> is written, fsynced, renamed over
 * path, and the directory fsynced. The header is padded with spaces to a
 * multiple of 8 bytes and tensors are laid out by element size, largest
 * first, then by name, so every tensor is aligned to its element size. */
ht_status ht_st_writer_write(const ht_st_writer *w, const char *path, ht_error *err);
/* Total bytes of tensor data the writer will write. */
size_t ht_st_writer_data_bytes(const ht_st_writer *w);
void ht_st_writer_free(ht_st_writer *w);

/* ---------------------------------------------------------------- Hugging Face */

/* Reads dir/config.json ("qwen2" or "llama"). HF defaults apply to
 * num_key_value_heads, head_dim, rope_theta, rms_norm_eps, attention_bias,
 * tie_word_embeddings and initializer_range; every other field is required. */
ht_status ht_hf_read_config(const char *dir, ht_model_config *cfg, ht_error *err);
/* Writes dir/config.json as transformers' AutoConfig reads it. */
ht_status ht_hf_write_config(const char *dir, const ht_model_config *cfg, ht_dtype torch_dtype, ht_error *err);
/* Fills every param's local rows from dir/model.safetensors, or from the
 * shards listed in dir/model.safetensors.index.json, converting to the
 * param's dtype. Shapes must match exactly; a param missing from the files is
 * an error; tensors the store lacks are listed in a warning (lm_head.weight of
 * a tied model is ignored silently). */
ht_status ht_hf_load_weights(const char *dir, ht_param_store *params, ht_error *err);
/* Creates dir and writes config.json and the weights in `dtype` (float
 * params; others keep theirs), metadata {"format": "pt"}. Above
 * max_shard_bytes of weights (0: no limit) the weights go to
 * model-0000i-of-0000N.safetensors with model.safetensors.index.json.
 * Single process: every param's local rows must be the whole tensor. */
ht_status ht_hf_save(const char *dir, const ht_model_config *cfg, const ht_param_store *params, ht_dtype dtype,
                     size_t max_shard_bytes, ht_error *err);

#ifdef __cplusplus
}
#endif
#endif
