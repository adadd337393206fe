/* Inside ckpt/: what the training checkpoint's save.c, open.c, load.c and
 * export.c share: the key kinds and names, the opened checkpoint's tables,
 * and the path and hash helpers of checkpoint.c. */
#ifndef HT_CKPT_CHECKPOINT_INTERNAL_H
#define HT_CKPT_CHECKPOINT_INTERNAL_H

#include "hypertrain/ckpt.h"

#define MAIN_PREFIX "_mixed_precision_optimizer.fp32_from_fp16_params."
#define OPT_PREFIX "optimizer.state."

typedef enum key_kind {
    KIND_MODEL = 0,
    KIND_MAIN,
    KIND_EXP_AVG,
    KIND_EXP_AVG_SQ,
    KIND_MOMENTUM,
    KIND_STEP,
    KIND_COUNT
} key_kind;

extern const char *const ht_ckpt_kind_names[KIND_COUNT];

/* The key of a param's tensor of that kind ("model.<fqn>", ...), into buf (HT_CKPT_KEY_MAX). */
void ht_ckpt_key_name(char *buf, key_kind kind, const char *fqn);
/* dir/name; a path that does not fit becomes "". */
void ht_ckpt_join(char *buf, size_t n, const char *dir, const char *name);
/* Size and XXH64 of a whole file. */
ht_status ht_ckpt_hash_file(const char *path, uint64_t *size, uint64_t *hash, ht_error *err);
bool ht_ckpt_ends_with(const char *s, const char *suffix);
/* A complete checkpoint's step from its directory name "step_XXXXXXXX", or -1. */
long long ht_ckpt_step_of(const char *name);

/* save.c: the kind of an optimizer state key ("exp_avg", ...), KIND_COUNT if none. */
key_kind ht_ckpt_state_kind(const char *key);
/* save.c: the optimizer's state list (ht_optimizer_list_state), allocated; none without an optimizer. */
ht_status ht_ckpt_optimizer_state(const ht_optimizer *opt, ht_opt_state **out, int *n, ht_error *err);

/* ------------------------------------------------------------------ an opened checkpoint (open.c) */

typedef struct ck_file {
    char *name;
    uint64_t size, hash;
    bool is_rank;
    ht_safetensors *st; /* rank files, once opened */
} ck_file;

typedef struct ck_chunk {
    int file;
    ht_box box; /* of the key's global shape; a format 1 chunk's rows of whole rows */
    const ht_st_tensor *t;
} ck_chunk;

typedef struct ck_key {
    const char *name; /* in the metadata tree */
    key_kind kind;
    ht_dtype dtype;
    int ndim;
    int64_t shape[HT_PARAM_MAX_DIMS];
    ck_chunk *chunks;
    int nchunks;
} ck_key;

struct ht_checkpoint {
    char dir[HT_CKPT_PATH_MAX];
    ht_json *meta;
    int version;
    int64_t step;
    int world;
    ht_ckpt_trainer_state state;
    ck_file *files;
    int nfiles;
    ck_key *keys; /* sorted by name */
    int nkeys;
};

/* The key of that name, or NULL. */
const ck_key *ht_ckpt_find_key(const ht_checkpoint *ck, const char *name);
/* The index of the listed file of that name, or -1. */
int ht_ckpt_find_file(const ht_checkpoint *ck, const char *name);
/* Reads and checks metadata.json into ck (files listed, keys parsed; nothing opened). */
ht_status ht_ckpt_load_metadata(const char *dir, ht_checkpoint *ck, ht_error *err);
/* Checks file i's size and hash against metadata.json. */
ht_status ht_ckpt_verify_file(const ht_checkpoint *ck, int i, ht_error *err);
/* Opens the rank files and binds every chunk to its tensor, checking dtype and shape. */
ht_status ht_ckpt_bind_chunks(ht_checkpoint *ck, ht_error *err);

#endif
