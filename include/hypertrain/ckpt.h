/* Checkpoint files: the safetensors format (a validating reader over a
 * mapped file, and a streaming atomic writer), Hugging Face model
 * directories (config.json + model.safetensors, sharded with an index), and
 * training checkpoints (sharded, named, crash-safe, any-N-to-M reload). */
#ifndef HYPERTRAIN_CKPT_H
#define HYPERTRAIN_CKPT_H

#include <stdio.h>

#include "hypertrain/base.h"
#include "hypertrain/kernels.h"
#include "hypertrain/config.h"
#include "hypertrain/data.h"
#include "hypertrain/model.h"
#include "hypertrain/optimizer.h"
#include "hypertrain/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- safetensors */

#define HT_ST_MAX_DIMS 8
#define HT_ST_MAX_HEADER (100u * 1000u * 1000u) /* the reference implementation's limit */
/* Tensors one safetensors file may list: the largest released checkpoints
 * hold under 100,000 across all their shards. Raise it here and rebuild. */
#define HT_ST_MAX_TENSORS (1 << 20)

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
    /* The store whose memory src is (ht_st_writer_add_from): read through
     * its downloads in bounded blocks; NULL, host memory. */
    const struct ht_param_store *memory;
    /* ht_st_writer_add_main: this param's FP32 main params, rebuilt block by
     * block as they are written (ht_param_main_read); src unused. */
    const struct ht_param *main_of;
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
/* ht_st_writer_add of a tensor in the memory of `memory` (a param store's,
 * which may be a GPU's): it is downloaded block by block as it is written. */
ht_status ht_st_writer_add_from(ht_st_writer *w, const char *name, ht_dtype dtype, int ndim, const int64_t *shape,
                                const void *src, ht_dtype src_dtype, const struct ht_param_store *memory,
                                ht_error *err);
/* ht_st_writer_add of p's FP32 main params (shape: its local box), read
 * through ht_param_main_read as they are written: a residual16 param's are
 * rebuilt a block at a time, never whole in memory. */
ht_status ht_st_writer_add_main(ht_st_writer *w, const char *name, int ndim, const int64_t *shape,
                                const struct ht_param *p, ht_error *err);
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
 * an error (LoRA adapters are not looked for: they are not Hugging Face
 * weights); tensors the store lacks are listed in a warning (lm_head.weight of
 * a tied model is ignored silently). */
ht_status ht_hf_load_weights(const char *dir, ht_param_store *params, ht_error *err);
/* Creates dir and writes config.json and the weights in `dtype` (float
 * params; others keep theirs), metadata {"format": "pt"}. Above
 * max_shard_bytes of weights (0: no limit) the weights go to
 * model-0000i-of-0000N.safetensors with model.safetensors.index.json.
 * Single process: every param's local rows must be the whole tensor. */
ht_status ht_hf_save(const char *dir, const ht_model_config *cfg, const ht_param_store *params, ht_dtype dtype,
                     size_t max_shard_bytes, ht_error *err);

/* ---------------------------------------------------------------- PEFT adapters */

/* A LoRA adapter directory as Hugging Face PEFT's save_pretrained writes it:
 * adapter_config.json (peft_type LORA, r, lora_alpha, lora_dropout,
 * target_modules, use_rslora, ...) and adapter_model.safetensors, whose
 * tensors are "base_model.model." + the adapter param's name
 * (base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight). */
#define HT_PEFT_PREFIX "base_model.model."

/* Reads dir/adapter_config.json into *out (rank, alpha, dropout, use_rslora,
 * target_modules). Settings that change the adapted function in ways this
 * engine does not implement (DoRA, bias other than "none", fan_in_fan_out,
 * rank_pattern / alpha_pattern, layers_to_transform, modules_to_save, a
 * regular-expression target_modules) are refused by name. */
ht_status ht_peft_read_config(const char *dir, ht_lora_config *out, ht_error *err);
/* model.lora.from_pretrained: checks that dir's adapter_config.json agrees
 * with `want` (r, lora_alpha, use_rslora, and target_modules selecting the
 * same modules as the adapters `params` declares), then fills every adapter
 * param's local rows from dir/adapter_model.safetensors (converted to its
 * dtype). A missing adapter tensor, one of another shape, or a tensor the
 * model has no adapter for is an error naming it. */
ht_status ht_peft_load_adapter(const char *dir, const ht_lora_config *want, ht_param_store *params, ht_error *err);
/* Creates dir and writes the adapters of `params` (whole tensors) there in
 * `dtype`, with a minimal adapter_config.json: peft_type LORA, task_type
 * CAUSAL_LM, r, lora_alpha, lora_dropout, target_modules
 * (ht_lora_target_names), use_rslora, bias none, fan_in_fan_out false,
 * base_model_name_or_path (NULL or "": null), inference_mode true. */
ht_status ht_peft_save_adapter(const char *dir, const ht_param_store *params, const ht_lora_config *lora,
                               const char *base_model, ht_dtype dtype, ht_error *err);

/* ---------------------------------------------------------------- training checkpoints */

/* A checkpoint is a directory output_dir/step_XXXXXXXX/ (docs/DESIGN.md, Checkpoints):
 *   rank_RRRRR.safetensors  one per rank: that rank's box of every key
 *   config.json             the model architecture (what export writes)
 *   metadata.json           written last: the commit point
 * Keys: model.<fqn> (model dtype), optimizer.state.<fqn>.exp_avg / .exp_avg_sq
 * / .momentum_buffer (FP32, row-sharded like the param), optimizer.state.<fqn>.step
 * (int64 scalar, rank 0), _mixed_precision_optimizer.fp32_from_fp16_params.<fqn>
 * (FP32, only for params whose model dtype is not float32). metadata.json
 * holds the format version, step, world size, the trainer state, the
 * effective config, every key's global shape, dtype and chunks (file, and
 * the N-D box: offsets, lengths; version 1 had row_offset, rows), the size
 * and XXH64 of every file, and its own XXH64. */
#define HT_CKPT_FORMAT_VERSION 2
#define HT_CKPT_HASH "xxh64"
#define HT_CKPT_KEY_MAX (HT_PARAM_NAME_MAX + 64)
#define HT_CKPT_PATH_MAX 4096

/* Where training stands, besides the tensors. */
typedef struct ht_ckpt_trainer_state {
    int64_t step;          /* optimizer steps the trainer took: the global step */
    int64_t schedule_step; /* successful steps: every LR schedule's step index (ht_optimizer.step) */
    /* The random state: every stream derives from the seed (the loaders' order
     * from (seed, epoch)) and the data positions. no_rng: not saved
     * (training.no_save_rng), and then neither is there. */
    bool no_rng;
    int64_t seed; /* training.seed */
    ht_loader_pos train_pos, valid_pos;
    bool loss_scaling; /* the fp16 loss scaler below is live */
    ht_loss_scaler scaler;
    /* The bf16 and f16 GEMM kernels the run used: a resumed run keeps them, so
     * that it sums in the same order (AUTO: not recorded). */
    ht_gemm_kernel gemm_bf16, gemm_f16;
} ht_ckpt_trainer_state;

/* One rank's view of what a save reads and a load fills. */
typedef struct ht_ckpt_view {
    ht_param_store *params;       /* this rank's box of every param (ht_param_box) */
    ht_optimizer *optimizer;      /* its muon/adamw slots; NULL: no optimizer state */
    ht_ckpt_trainer_state state;  /* saved from rank 0's view; filled by a load */
    const ht_config *config;      /* saved as the effective config; NULL: none */
    const ht_model_config *model; /* saved as config.json; NULL: none (export then cannot run) */
    /* training.load_strict false (a load): model tensors the checkpoint lacks,
     * and tensors it has for params this model lacks, are warnings, listed,
     * not refusals. A param without its tensor keeps its value here, and its
     * optimizer state starts from zero. */
    bool lenient;
    /* Pipeline parallelism: every stage's params (declared, no storage), of
     * which `params` holds one stage's: tensors of the others' are the
     * checkpoint's, not unknown ones. NULL: params is the whole model. */
    const ht_param_store *whole;
} ht_ckpt_view;

typedef struct ht_ckpt_save_options {
    bool save_optimizer; /* optimizer state and FP32 main params; false: model and trainer state only */
    int keep_last;       /* complete checkpoints kept after a save; 0: all */
    /* Globs of keys not written (a plain optimizer checkpoint without the
     * mixed-precision block is "_mixed_precision_optimizer.*"). */
    const char *const *exclude;
    int exclude_count;
    /* Tensor parallelism: this rank's place in its group. A param the group
     * holds whole on every place (ht_param.tp_dim < 0), and its state, is
     * written by place 0 alone: the boxes of a checkpoint never overlap. */
    int tp_rank;
    /* The rank of the writing group that writes the optimizer's step counts
     * of this rank's params, which every rank holding them shares: 0, or
     * with pipeline parallelism the first rank of this rank's stage. */
    int steps_rank;
} ht_ckpt_save_options;

/* One chunk of one key that a rank wrote: the box of the global tensor it holds. */
typedef struct ht_ckpt_chunk {
    char key[HT_CKPT_KEY_MAX];
    ht_dtype dtype;
    int ndim;                         /* 0 for a scalar (one element, an empty box) */
    int64_t shape[HT_PARAM_MAX_DIMS]; /* global */
    ht_box box;                       /* the param's box (ht_param_box) */
} ht_ckpt_chunk;

/* What one rank wrote: rank 0 gathers these to write metadata.json. */
typedef struct ht_ckpt_rank_file {
    char file[64]; /* "rank_00003.safetensors" */
    uint64_t size, hash;
    ht_ckpt_chunk *chunks;
    int count, capacity;
} ht_ckpt_rank_file;

/* The save, in three phases so that each rank writes its own file:
 * begin (rank 0) makes output_dir/step_X.tmp/ (removing a stale one),
 * write_rank (every rank) writes and fsyncs rank_R.safetensors into it,
 * commit (rank 0) writes config.json and metadata.json, fsyncs the directory,
 * renames it to step_X/, atomically points `latest` at it and only then
 * prunes beyond keep_last. A crash at any point leaves the previous
 * checkpoint loadable. The step is view->state.step. */
ht_status ht_ckpt_begin(const char *output_dir, int64_t step, char *tmp_dir, size_t n, ht_error *err);
ht_status ht_ckpt_write_rank(const char *tmp_dir, int rank, const ht_ckpt_view *view, const ht_ckpt_save_options *opts,
                             ht_ckpt_rank_file *out, ht_error *err);
ht_status ht_ckpt_commit(const char *output_dir, int world, const ht_ckpt_rank_file *ranks, const ht_ckpt_view *view,
                         const ht_ckpt_save_options *opts, ht_error *err);
void ht_ckpt_rank_file_free(ht_ckpt_rank_file *f);
/* All three as rank 0 of 1. `saved` (may be NULL) receives the checkpoint's path. */
ht_status ht_ckpt_save(const char *output_dir, const ht_ckpt_view *view, const ht_ckpt_save_options *opts, char *saved,
                       size_t n, ht_error *err);

/* Whether the entry `name` of output_dir is a checkpoint directory this
 * engine wrote and so may replace or delete: a real directory (a symlink to
 * one is not) holding only the files a save writes. Otherwise why (n bytes)
 * says what it is. Saving and pruning delete nothing else. */
bool ht_ckpt_is_own(const char *output_dir, const char *name, char *why, size_t n);

/* The newest complete checkpoint (step_XXXXXXXX with its metadata.json) in
 * output_dir: its directory name in name, false when there is none. */
bool ht_ckpt_newest(const char *output_dir, char *name, size_t n);

/* restore_from ("latest" or a checkpoint directory) -> the directory to load.
 * "latest" reads output_dir/latest; when there is none yet, dir is "" and the
 * run starts fresh. A .tmp directory is refused. */
ht_status ht_ckpt_resolve(const char *restore_from, const char *output_dir, char *dir, size_t n, ht_error *err);

typedef struct ht_checkpoint ht_checkpoint;

/* Reads metadata.json (format, version, self hash), checks every file's
 * size and XXH64, opens the rank files and checks that every chunk is there
 * with its dtype and shape. Errors name the file and the key. */
ht_status ht_ckpt_open(const char *dir, ht_checkpoint **out, ht_error *err);
void ht_ckpt_close(ht_checkpoint *ck);
int64_t ht_ckpt_step(const ht_checkpoint *ck);
int ht_ckpt_world_size(const ht_checkpoint *ck);
const char *ht_ckpt_dir(const ht_checkpoint *ck);
/* The value a config key had in the run that saved ck, as its log printed it
 * (ht_config_format_value); NULL if the checkpoint holds no such key. */
const char *ht_ckpt_config_value(const ht_checkpoint *ck, const char *key);
const ht_ckpt_trainer_state *ht_ckpt_state(const ht_checkpoint *ck);
/* The keys, sorted by name (model weights by their Hugging Face names, main
 * params and optimizer state under theirs): key i's name, with its saved
 * dtype, ndim and global shape (HT_PARAM_MAX_DIMS values at most) where the
 * pointers are not NULL; NULL past the end. */
int ht_ckpt_key_count(const ht_checkpoint *ck);
const char *ht_ckpt_key(const ht_checkpoint *ck, int i, ht_dtype *dtype, int *ndim, int64_t *shape);
/* A box of a key (inside its shape; ndim the key's) into dst, laid out
 * row-major as the box, converted to dst_dtype (float <-> float only): the
 * planner copies the overlap of every saved chunk with it, so a checkpoint
 * saved in one layout of boxes loads into any other. */
ht_status ht_ckpt_read_box(const ht_checkpoint *ck, const char *key, const ht_box *box, void *dst, ht_dtype dst_dtype,
                           ht_error *err);
/* Rows [row0, row1) of dim 0 of a key, every other dim whole (a scalar: rows
 * [0, 1)): ht_ckpt_read_box of that box. */
ht_status ht_ckpt_read_rows(const ht_checkpoint *ck, const char *key, int64_t row0, int64_t row1, void *dst,
                            ht_dtype dst_dtype, ht_error *err);
/* Fills a rank's view: model weights (converted to each param's dtype, so
 * the run's model_init_dtype decides), then the FP32 main params: all
 * present -> bit-for-bit; none -> rebuilt from the model with a warning that
 * the FP32 tail is lost (an info line instead when the saving run kept none:
 * optimizer.fp32_main_params false); some -> refused before anything is
 * touched, listing every missing name. A run without main params
 * (main_param NULL) reads none of the checkpoint's and says so in one line.
 * With restore_optimizer, the optimizer state (absent state = never created:
 * zero, step 0) and view->state; without, the model only, main params
 * rebuilt from it, view->state untouched. */
ht_status ht_ckpt_load(const ht_checkpoint *ck, ht_ckpt_view *view, bool restore_optimizer, ht_error *err);

/* Writes out_dir/config.json + model.safetensors (sharded with an index
 * above max_shard_bytes; 0: no limit) from a checkpoint, in `dtype`
 * (HT_DTYPE_COUNT: the checkpoint's model dtype). float32 from a checkpoint
 * with FP32 main params exports the main params. LoRA adapters (a run with
 * model.lora) are merged into the weights they adapt, W + scale · B A in FP32
 * (the adapters from their FP32 main params), with the scale of the run's
 * model.lora: the folder has the base model's tensors only. */
ht_status ht_ckpt_export(const char *ckpt_dir, const char *out_dir, ht_dtype dtype, size_t max_shard_bytes,
                         ht_error *err);
/* Writes a checkpoint's LoRA adapters alone as a PEFT adapter directory
 * (ht_peft_save_adapter) in `dtype` (HT_DTYPE_COUNT: float32, from the FP32
 * main params where the checkpoint has them). */
ht_status ht_ckpt_export_adapter(const char *ckpt_dir, const char *out_dir, ht_dtype dtype, ht_error *err);
/* What generation needs to know of a model's folder besides its weights. */
typedef struct ht_ckpt_model_info {
    char dir[HT_CKPT_PATH_MAX]; /* the folder read (a run's output_dir: its newest checkpoint) */
    /* The text's tokenizer: the saving run's data.tokenizer, or the folder's
     * own tokenizer.json; "" none. */
    char tokenizer[HT_CKPT_PATH_MAX];
    bool bytes; /* the saving run read text_bytes: a token is a byte */
    /* The tokens that end a text: generation_config.json's eos_token_id, else config.json's (none: 0). */
    int32_t eos[8];
    int eos_count;
} ht_ckpt_model_info;
/* A model to run (generation) from `path`: a training checkpoint (any
 * layout: the boxes are read whole, LoRA adapters merged as export merges
 * them), a run's output_dir (its `latest`), or a Hugging Face model folder;
 * its params in `dtype` (float32 from a bf16/fp16 checkpoint: its FP32 main
 * params where it has them), on one process. Errors name the folder and
 * what it lacks. */
ht_status ht_ckpt_load_model(const char *path, ht_dtype dtype, ht_model **out, ht_ckpt_model_info *info, ht_error *err);
/* A model of cfg (its LoRA adapters off: `from` holds them merged, or none)
 * in `dtype` on one process, every param from the whole tensor of its name
 * in `from` (any dtype, converted; in any memory, staged through the host):
 * the training's samples run on it. */
ht_status ht_ckpt_model_from_params(const ht_model_config *cfg, const ht_param_store *from, ht_dtype dtype,
                                    ht_model **out, ht_error *err);
/* Prints step, world size, trainer state, every file with its hash check and
 * the keys by kind. Fails (after printing) when a file does not match. */
ht_status ht_ckpt_inspect(const char *dir, FILE *out, ht_error *err);

#ifdef __cplusplus
}
#endif
#endif
