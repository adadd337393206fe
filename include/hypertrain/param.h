/* The named parameter store: every tensor of a model's state, keyed by its
 * Hugging Face name, with its global shape, model dtype and this rank's shard.
 * Most are trainable; a buffer the model updates itself (DeepSeek-V3's
 * e_score_correction_bias) or a frozen param has trainable false and a NULL
 * main_grad. The optimizer, the checkpoint code and the logs iterate it by
 * name (the optimizer skips what is not trainable). */
#ifndef HYPERTRAIN_PARAM_H
#define HYPERTRAIN_PARAM_H

#include "hypertrain/base.h"
#include "hypertrain/comm.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HT_PARAM_NAME_MAX 160
#define HT_PARAM_MAX_DIMS 4

/* A box of a tensor: elements [offset[d], offset[d] + length[d]) of every dim
 * d < ndim, the ndim being the tensor's (PyTorch DCP's chunk offsets and
 * lengths). A box's values are laid out row-major, as a tensor of shape
 * length[0..ndim). */
typedef struct ht_box {
    int64_t offset[HT_PARAM_MAX_DIMS];
    int64_t length[HT_PARAM_MAX_DIMS];
} ht_box;

typedef struct ht_param {
    char name[HT_PARAM_NAME_MAX]; /* "model.layers.3.self_attn.q_proj.weight" */
    int ndim;
    /* The tensor this rank's model computes with: the global tensor, or
     * under tensor parallelism its slice [tp_offset, tp_offset +
     * shape[tp_dim]) of dim tp_dim (tp_dim -1: whole, the same on every rank
     * of the tensor-parallel group). Everything below the model (FSDP's
     * rows, gradients, the optimizers' state) is of that tensor;
     * global_shape is what checkpoints and Hugging Face files hold. */
    int64_t shape[HT_PARAM_MAX_DIMS];
    int64_t global_shape[HT_PARAM_MAX_DIMS];
    int tp_dim;
    int64_t tp_offset;
    ht_dtype dtype;     /* the model dtype of `data` */
    int64_t row0, row1; /* this rank's shard: rows [row0, row1) of dim 0 of `shape` */
    /* The region of the global tensor that `data` holds: the tensor-parallel
     * slice, then FSDP's rows [row0, row1) of it (box.length[0] is always
     * row1 - row0; box.offset[0] is row0 plus tp_offset when tp_dim is 0).
     * Set both through ht_param_set_rows or ht_param_set_box. */
    ht_box box;
    bool sharded; /* the rows are spread over the ranks of a group (even where this one holds all) */
    bool trainable;
    void *data;       /* (box.length[0..ndim)) in dtype: the model's weights; today (row1 - row0, shape[1:]) */
    float *main_grad; /* same layout in FP32: this rank's rows of the step's gradient, never rounded to dtype */
    /* The full (global shape) FP32 gradient that backward accumulates into.
     * Unsharded it IS main_grad; sharded, it is NULL except while parallel/'s
     * FSDP unit holding the param runs backward, which then sums it over the
     * ranks into each rank's main_grad rows. */
    float *grad;
    /* FP32 master of `data`; equals `data` itself when dtype is F32. NULL for
     * a bf16/f16 param of a run without FP32 copies (optimizer.fp32_main_params
     * false): the optimizer then updates `data` itself. */
    float *main_param;
    /* residual16 (optimizer.main_param_storage; a bfloat16 param, main_param
     * NULL): the FP32 main param kept as its low 16 bits beside `data`, which
     * is its high half rounded to nearest even. The high half is data's, one
     * less where data was rounded up: where the low bits are above 0x8000, or
     * exactly 0x8000 (a tie) at an element listed in main_ties. Read and
     * write it through ht_param_main_read / ht_param_main_write. */
    uint16_t *main_low;
    int64_t *main_ties; /* sorted local element indices, main_tie_count of them */
    int64_t main_tie_count, main_tie_capacity;
    /* What forward and backward read: the whole weights in the compute dtype
     * (fsdp_config.mix_precision.param_dtype). Unsharded: `data` when the
     * dtypes agree, otherwise a cast copy refreshed after every update.
     * Sharded: NULL except while parallel/'s FSDP unit holding the param has
     * gathered it from the ranks' compute_rows. */
    void *compute;
    void *compute_rows; /* this rank's rows in the compute dtype: `data` when the dtypes agree */
    ht_dtype compute_dtype;
    ht_dtype compute_precision; /* the values' precision: compute_dtype, or bf16/f16 held in FP32 */
    /* FP32 whatever the model dtype (transformers' _keep_in_fp32_modules_strict: DeepSeek-V3's routers and
     * their correction biases): ht_params_convert leaves it FP32, and forward and backward read it in FP32. */
    bool keep_fp32;
    /* Pipeline parallelism with tied embeddings: the embedding is held by
     * the first stage and, as the LM head, by the last (stage_tied on both):
     * its gradient is the sum of both stages'. stage_copy marks the last
     * stage's: the first's is the one saved and counted in the gradient norm. */
    bool stage_tied, stage_copy;
} ht_param;

struct ht_kernel_ops;

typedef struct ht_param_store {
    /* The kernel table whose memory holds every block below (data, main_grad,
     * main params, compute copies): set before ht_params_allocate and kept
     * for the store's life; NULL, the host's (ht_alloc). The store reaches
     * that memory only through the table's memory and conversion entries, and
     * other code through ht_params_upload / ht_params_download, so the
     * blocks may be a GPU's. */
    const struct ht_kernel_ops *memory;
    ht_param *items;
    int count;
    int capacity;
    void *data_block;    /* one allocation carved into every param's data */
    float *grad_block;   /* one allocation carved into every main_grad */
    void *main_block;    /* one allocation for the FP32 masters of non-F32 params, or their low halves (NULL if none) */
    void *compute_block; /* the compute copies of params whose dtype differs from the compute dtype */
    size_t data_bytes, grad_bytes, main_bytes, compute_bytes;
    int shard_rank, shard_world; /* the rows this store holds: ht_param_rows_of(rank, world); world 0 or 1: all */
    /* ht_params_find's hash table over the names: open addressing, each slot
     * an index into items plus one (0: empty), a power of two at least twice
     * the count; kept by ht_params_add. */
    int *slots;
    size_t slot_count;
} ht_param_store;

/* Module path patterns (MindSpeed-MM's fsdp_plan and freeze): "{*}" or "*"
 * stands for one dotted component, anything else for itself.
 * ht_path_match: the whole path matches ("model.layers.{*}" matches
 * "model.layers.3"). ht_path_covers: the name or one of its dotted prefixes
 * does, so a module's pattern covers its params ("model.layers.{*}.mlp"
 * covers "model.layers.3.mlp.up_proj.weight"). */
bool ht_path_match(const char *pattern, const char *path);
bool ht_path_covers(const char *pattern, const char *name);

/* Declares a parameter (no storage yet). Shard is the whole tensor until
 * set; tp_dim -1 (no tensor-parallel slice) until ht_param_split. */
ht_param *ht_params_add(ht_param_store *store, const char *name, int ndim, const int64_t *shape, ht_dtype dtype);
/* Keeps the declared (not yet allocated) params for which keep[i] is true,
 * in their order, and drops the rest (a pipeline stage's part of a model):
 * pointers into the store taken before are stale. */
void ht_params_retain(ht_param_store *store, const bool *keep);
/* The first param of that name, or NULL: a hash lookup, constant time in the count. */
ht_param *ht_params_find(const ht_param_store *store, const char *name);
/* Allocates data (zeroed) and, for trainable params, main_grad, in one block each. */
ht_status ht_params_allocate(ht_param_store *store, ht_error *err);
/* The bytes of each block the store's params take, declared or allocated,
 * as they are now (dtypes, rows, trainable): data and main_grad
 * (ht_params_allocate), the FP32 main params (ht_params_create_main; 0
 * without them) and the compute copies (ht_params_set_compute with `compute`
 * and `precision`). The formula those allocations use: a plan made before
 * storage exists is what it takes. */
typedef struct ht_params_bytes {
    size_t data, grad, main, compute;
} ht_params_bytes;

/* How a bf16/f16 param's FP32 main param is held. */
typedef enum ht_main_storage {
    HT_MAIN_NONE = 0,   /* none (optimizer.fp32_main_params false): updates go through the model's own values */
    HT_MAIN_COPY,       /* an FP32 copy beside the weight: 4 more bytes a value */
    HT_MAIN_RESIDUAL16, /* bfloat16 params: the FP32 value's low 16 bits (main_low): 2 more bytes a value */
} ht_main_storage;

ht_params_bytes ht_params_plan(const ht_param_store *store, ht_main_storage main, ht_dtype compute, ht_dtype precision);
/* The dtype p's compute weights take once ht_params_set_compute(dtype, precision) has run: dtype where it makes
 * them a copy, else p's own (read in place). */
ht_dtype ht_param_compute_dtype_for(const ht_param *p, ht_dtype dtype, ht_dtype precision);
/* Tensor parallelism, before storage: p's model tensor becomes slice `rank`
 * of `size` of dim `dim` of the global tensor (ht_param_rows_of's balanced
 * split of that dim), and its shard the whole slice. */
void ht_param_split(ht_param *p, int dim, int rank, int size);
/* Rows [row0, row1) of a dim-0 size for rank `rank` of `world`: balanced, a
 * rank may hold none. */
void ht_param_rows_of(int64_t rows, int rank, int world, int64_t *row0, int64_t *row1);
/* This rank holds rows [row0, row1) of dim 0 of p, every other dim whole:
 * row0, row1 and the box. */
void ht_param_set_rows(ht_param *p, int64_t row0, int64_t row1);
/* This rank holds `box` of p (inside its shape): the box, row0 and row1. */
void ht_param_set_box(ht_param *p, const ht_box *box);
static inline ht_box ht_param_box(const ht_param *p) { return p->box; }
/* Declares that this store holds only rank `rank`'s rows of every param (of
 * `world`), before ht_params_allocate: storage is then for those rows only. */
void ht_params_set_rows(ht_param_store *store, int rank, int world);
/* Keeps only rank `rank`'s rows of every param (of `world`) of an allocated,
 * unsharded store: data and main_grad shrink to them. Call it before
 * ht_params_convert, ht_params_create_main and ht_params_set_compute. world 1
 * changes nothing. */
ht_status ht_params_shard(ht_param_store *store, int rank, int world, ht_error *err);
static inline bool ht_param_is_sharded(const ht_param *p) { return p->sharded; }
/* Converts every float param's data to `dtype` (but those that keep_fp32) in
 * place of the old storage: the ht_param structs (their identity) and shard
 * layout do not change. On a store declared but not allocated it sets the
 * dtypes storage will have: nothing is converted, nothing rounded twice. */
ht_status ht_params_convert(ht_param_store *store, ht_dtype dtype, ht_error *err);
/* Gives every non-F32 trainable param an FP32 main param equal to its data:
 * a copy (main_param), or with HT_MAIN_RESIDUAL16 a bf16 param's low halves
 * (main_low, zero; host memory only, and every trainable non-F32 param must
 * be bf16). An F32 param's main_param is its data pointer: no extra bytes.
 * HT_MAIN_NONE is ht_params_drop_main. */
ht_status ht_params_create_main(ht_param_store *store, ht_main_storage storage, ht_error *err);
/* Whether p has an FP32 main param apart from its data (a copy or residual16). */
static inline bool ht_param_has_main(const ht_param *p) {
    return p->main_low || (p->main_param && (void *)p->main_param != p->data);
}
/* p's FP32 main params [first, first + n) (local elements) into x (host
 * memory): the copy's, residual16's rebuilt bit for bit, or without either
 * data widened. */
void ht_param_main_read(const ht_param *p, int64_t first, int64_t n, float *x);
/* Sets p's FP32 main params [first, first + n) to x, and its data there to
 * x rounded to nearest even (a float32 param's data to x). Host memory. */
void ht_param_main_write(ht_param *p, int64_t first, int64_t n, const float *x);
/* fn over p's FP32 main params [first, first + n), a block of them at a time
 * in host scratch: read (ht_param_main_read), fn(x, at, len, ctx) with x
 * holding elements [at, at + len), written back (ht_param_main_write). For
 * the passes that update residual16 main params (host memory). */
typedef void ht_main_fn(float *x, int64_t at, int64_t len, void *ctx);
void ht_param_main_pass(ht_param *p, int64_t first, int64_t n, ht_main_fn *fn, void *ctx);
/* Makes forward and backward read every float param stored in `dtype` with
 * values of `precision` (its own precision or a coarser one: FP32 storage of
 * bf16 values runs bf16 numerics on FP32 GEMM kernels). Params already in that
 * form are read in place, the others through a cast (and rounded) copy; a
 * keep_fp32 param is read in place, in FP32. */
ht_status ht_params_set_compute(ht_param_store *store, ht_dtype dtype, ht_dtype precision, ht_error *err);
/* Re-casts data into the compute copies (after the weights changed); for a
 * sharded param its compute_rows, which parallel/ gathers when they are used. */
void ht_params_refresh_compute(ht_param_store *store);
/* Frees every FP32 copy: a bf16/f16 param's main_param becomes NULL (the
 * optimizer then updates its data in place), an F32 param stays its own. */
void ht_params_drop_main(ht_param_store *store);
/* Copies every model param into its FP32 main_param (Megatron's reload_model_params:
 * used when a checkpoint holds no main params). */
void ht_params_reload_main(ht_param_store *store);
/* The same for one param of the store. */
void ht_param_reload_main(const ht_param_store *store, ht_param *p);
/* Writes every main_param back into data, rounding to the model dtype. */
void ht_params_cast_main_to_model(ht_param_store *store);
void ht_params_zero_grad(ht_param_store *store);
/* Takes every param covered by one of `patterns` (ht_path_covers) out of
 * training: not trainable, no main_grad (the gradient block shrinks to the
 * trainable ones), so no main param or optimizer state follows. Call it
 * before ht_params_create_main; on a store not yet allocated it only marks
 * them (ht_params_allocate then gives gradients to the trainable ones). A
 * pattern that covers nothing, or a freeze that leaves nothing to train, is
 * an error naming it. `frozen` (may be NULL) gets the number of params
 * taken out. */
ht_status ht_params_freeze(ht_param_store *store, const char *const *patterns, int count, int *frozen, ht_error *err);
void ht_params_free(ht_param_store *store);
/* Bytes between host memory and the store's (store->memory's, or the
 * host's: a memcpy): what checkpoints, Hugging Face files, initialisers and
 * the collectives stage through. */
void ht_params_upload(const ht_param_store *store, void *dst, const void *host, size_t bytes);
void ht_params_download(const ht_param_store *store, void *host, const void *src, size_t bytes);
/* Whether host code may read and write the store's blocks directly. */
bool ht_params_host_memory(const ht_param_store *store);
/* Zeroes bytes of the store's memory; converts n values within it (ht_convert). */
void ht_params_zero(const ht_param_store *store, void *dst, size_t bytes);
void ht_params_convert_into(const ht_param_store *store, void *dst, ht_dtype dst_dtype, const void *src,
                            ht_dtype src_dtype, size_t n);

int64_t ht_param_numel(const ht_param *p);        /* the model tensor's elements (shape) */
int64_t ht_param_global_numel(const ht_param *p); /* the global tensor's (global_shape) */
int64_t ht_param_row_numel(const ht_param *p);    /* elements per dim-0 row */
int64_t ht_param_local_numel(const ht_param *p);  /* the box's: (row1 - row0) * row_numel today */
int64_t ht_params_total_numel(const ht_param_store *store);
/* The bytes of each rank's rows of p (bytes[world]) over `world` ranks
 * (ht_param_rows_of), elements of elem_size: what FSDP's and Muon's gathers
 * of whole tensors receive from each rank. */
void ht_param_row_bytes(const ht_param *p, int world, int64_t *bytes, size_t elem_size);

/* Elements of a box of an ndim tensor. */
int64_t ht_box_numel(int ndim, const ht_box *box);
/* The overlap of a and b into *out; false when they share no element. */
bool ht_box_intersect(int ndim, const ht_box *a, const ht_box *b, ht_box *out);
/* Copies the elements that the boxes `dst_box` and `src_box` of one ndim
 * tensor share from src (src_box's values, row-major) to their places in dst
 * (dst_box's), converting src_dtype to dst_dtype (ht_convert). Returns the
 * elements copied: 0 when the boxes do not overlap. */
int64_t ht_box_copy(int ndim, void *dst, ht_dtype dst_dtype, const ht_box *dst_box, const void *src, ht_dtype src_dtype,
                    const ht_box *src_box);

/* ------------------------------------------------------------------ whole tensors (src/param/gather.c) */

/* A param's global tensor (global_shape, in dtype) from every rank's box:
 * its FSDP rows over `shard` (`rows`: this rank's, in dtype), then its
 * tensor-parallel slices over `tp` (NULL or size 1, or a param not split:
 * none). to_root: only rank 0 of both groups gets it (global may be NULL
 * elsewhere); otherwise every rank does. Every rank of both groups takes
 * part. A split param passes through `scratch` (numel + global numel
 * elements; NULL: allocated here, an error when it cannot be). `global`
 * may be the kernels' memory (where it is not the host's) for a 2-D FP32
 * param, with a scratch of it too. */
ht_status ht_param_gather_global(const ht_param *p, ht_comm *shard, ht_comm *tp, const void *rows, ht_dtype dtype,
                                 void *global, bool to_root, void *scratch, ht_error *err);

/* A param's full tensor from its rows on every rank (`rows` holds this
 * rank's (row1 - row0) x row_numel values; full gets the whole tensor): an
 * all-gather of ht_param_row_bytes (param.h) over comm. */
void ht_param_gather_rows(const ht_param *p, ht_comm *comm, const void *rows, void *full, size_t elem_size);

#ifdef __cplusplus
}
#endif
#endif
