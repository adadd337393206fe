/* The optimizer layer's leaves: AdamW and Muon (with its Newton-Schulz
 * schedules), which update FP32 buffers, plus learning-rate schedules and
 * global gradient-norm clipping. optimizer.h wraps them for the trainer.
 * Leaf optimizers compute in FP32 only: they read main_grad and write
 * main_param, and the cast back to the model dtype is fused into their pass.
 * A bf16/f16 param without a main param (optimizer.fp32_main_params false)
 * is widened block by block into FP32 scratch, updated there by the same
 * formulas and rounded back: the bits of a main param reloaded from the
 * model before the step, without keeping one. */
#ifndef HYPERTRAIN_OPTIM_H
#define HYPERTRAIN_OPTIM_H

#include "hypertrain/base.h"
#include "hypertrain/comm.h"
#include "hypertrain/kernels.h" /* ht_ns_form */
#include "hypertrain/param.h"

#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- the cast back */

/* How a leaf rounds its FP32 results into a bf16/f16 model param (docs/NUMERICS.md,
 * floating-point formats): to nearest even, or stochastically from a stream
 * of (seed, the param's name, step), so that each step draws afresh. */
typedef struct ht_rounding {
    bool stochastic; /* false (the zeroed struct): to nearest even */
    uint64_t seed;   /* the run's seed */
    int64_t step;    /* the optimizer's step index (ht_optimizer.step) */
} ht_rounding;

/* The stochastic stream of one param in one step (ht_convert_stochastic_at's
 * seed; element i of the param's local rows draws number i of it). */
static inline uint64_t ht_rounding_stream(const ht_rounding *r, const char *name) {
    return r->seed ^ ht_fnv1a64(name, strlen(name), (uint64_t)r->step * 0x9e3779b97f4a7c15ULL);
}

/* ---------------------------------------------------------------- AdamW */

typedef struct ht_adamw_config {
    double lr; /* the base lr; each step takes the scheduled lr */
    double beta1, beta2;
    double eps;
    double weight_decay;
} ht_adamw_config;

/* One parameter as AdamW sees it. State is keyed by the parameter's name. */
typedef struct ht_adamw_slot {
    ht_param *param;
    double weight_decay; /* 0 for names matching no_weight_decay */
    float *exp_avg;      /* (local numel) FP32 */
    float *exp_avg_sq;   /* (local numel) FP32 */
    int64_t step;        /* updates taken so far */
} ht_adamw_slot;

typedef struct ht_adamw {
    ht_adamw_config config;
    ht_adamw_slot *slots;
    int count;
    float *state_block;   /* one allocation for every exp_avg and exp_avg_sq */
    ht_rounding rounding; /* into bf16/f16 params; the wrapper sets it before each step */
} ht_adamw;

/* One slot per entry of `params`, in order; each must have main_grad, and a
 * float32 param must be its own main_param (HT_ERR_INVALID naming the first
 * that is not); a bf16/f16 param without one is updated in its model dtype.
 * Names matching any of the `no_wd` patterns (ht_name_match) get zero weight
 * decay. */
ht_status ht_adamw_init(ht_adamw *opt, const ht_adamw_config *cfg, ht_param **params, int count,
                        const char *const *no_wd, int no_wd_count, ht_error *err);
/* One update of every slot with learning rate `lr` (docs/NUMERICS.md, AdamW). */
void ht_adamw_step(ht_adamw *opt, double lr);
void ht_adamw_free(ht_adamw *opt);

/* The fused kernel: updates p (FP32) in place from g and, when model != NULL,
 * writes the rounded result to model (HT_DTYPE_BF16 or HT_DTYPE_F16; other
 * dtypes write nothing) in the same pass. p NULL: model (bf16/f16) holds the
 * values, widened and rounded back to nearest block by block, the same bits
 * as a p loaded from model before the call. Every element takes PyTorch's
 * rounding sequence (mul, lerp as one FMA, mul + FMA, sqrt, div, add, mul,
 * div, add in FP32; scalars from double), identical on every path and for
 * any thread count. Threads: OpenMP, static split; n < 65536 runs serially. */
void ht_adamw_update(float *p, const float *g, float *m, float *v, int64_t n, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, void *model, ht_dtype model_dtype);

/* ---------------------------------------------------------------- Muon */

/* Newton-Schulz coefficient schedules (docs/NUMERICS.md, Muon). */
typedef enum ht_ns_variant {
    HT_NS_LEGACY = 0,    /* (3.4445, -4.7750, 2.0315) every iteration, K = ns_steps */
    HT_NS_ASYM5,         /* five triples, K = ns_steps <= 5 */
    HT_NS_POLAR_EXPRESS, /* five triples, the last repeated past 5, K = ns_steps */
    HT_NS_DEEPSEEK_V4,   /* legacy x 8, then (2, -1.5, 0.5) x 2: K = 10 whatever ns_steps says */
    HT_NS_CUSTOM,        /* the caller's segments */
    HT_NS_VARIANT_COUNT
} ht_ns_variant;

#define HT_NS_MAX_STEPS 100 /* longest expanded schedule (torch.optim.Muon's bound too) */

/* Names as the config spells them: "legacy", "asym5", "polar_express", ... */
const char *ht_ns_variant_name(ht_ns_variant variant);
bool ht_ns_variant_from_name(const char *name, ht_ns_variant *out);

/* One segment of a custom schedule: (a, b, c) for `repeat` iterations. As the
 * config reads muon_ns_coefficients: [a, b, c] is one segment with repeat 0,
 * meaning ns_steps times; [[a, b, c], ...] one segment per triple, repeat 1;
 * [[[a, b, c], n], ...] segments of n. */
typedef struct ht_ns_segment {
    double abc[3];
    int repeat;
} ht_ns_segment;

/* The expanded schedule: iteration k runs coeffs[k] = (a, b, c). */
typedef struct ht_ns_schedule {
    int steps; /* K */
    double coeffs[HT_NS_MAX_STEPS][3];
    /* muon_ns_form: standard; gram, the Gram form where it takes fewer
     * multiply-adds (a wide or tall matrix; FP32 operands), the same
     * iteration in exact arithmetic; torch, torch.optim.Muon's bf16 roundings
     * (docs/NUMERICS.md). */
    ht_ns_form form;
} ht_ns_schedule;

/* Expands (variant, ns_steps, custom segments) into one triple per iteration.
 * Segments are read only for HT_NS_CUSTOM, where a schedule expands to the
 * sum of its repeats (ns_steps is not a cap) and one shorter than ns_steps is
 * an error, as are asym5 with ns_steps > 5, ns_steps < 1, non-finite
 * coefficients and more than HT_NS_MAX_STEPS iterations. Errors name the
 * config key (optimizer.muon_config.muon_ns_steps, ..._ns_coefficients). */
ht_status ht_ns_schedule_expand(ht_ns_variant variant, int ns_steps, const ht_ns_segment *segments, int segment_count,
                                ht_ns_schedule *out, ht_error *err);

/* Floats of workspace ht_newton_schulz needs for one (rows, cols) matrix. */
size_t ht_newton_schulz_workspace(int64_t rows, int64_t cols, const ht_ns_schedule *sched, ht_dtype ns_dtype);
/* O = NS(G) for one (rows, cols) row-major FP32 matrix (docs/NUMERICS.md, Muon):
 * normalized by its Frobenius norm (accumulated in double) + eps, then
 * sched->steps iterations, every product on ht_gemm with FP32 accumulation.
 * ns_dtype F32 multiplies FP32 operands; BF16 rounds the operands of each
 * product to bf16 (for CPUs with fast bf16 GEMM). O may be G. `work` holds
 * ht_newton_schulz_workspace(rows, cols, sched, ns_dtype) floats. */
void ht_newton_schulz(const float *G, float *O, int64_t rows, int64_t cols, const ht_ns_schedule *sched, double eps,
                      ht_dtype ns_dtype, float *work);
/* ht_newton_schulz on `count` matrices of one shape, each rows · cols floats
 * after the one before in G and in O, every product one batched GEMM over
 * them: each matrix's result is its own, computed as ht_newton_schulz
 * computes it. `work` holds count · ht_newton_schulz_workspace() floats. */
void ht_newton_schulz_batch(const float *G, float *O, int64_t count, int64_t rows, int64_t cols,
                            const ht_ns_schedule *sched, double eps, ht_dtype ns_dtype, float *work);

typedef enum ht_muon_momentum_style {
    HT_MUON_MOMENTUM_SUM = 0, /* B <- mu B + g; nesterov u = g + mu B (HyperParallel, Moonlight) */
    HT_MUON_MOMENTUM_EMA,     /* B <- mu B + (1 - mu) g; nesterov u = (1 - mu) g + mu B (PyTorch): torch's
                                 lerps and its update's FMA, bit for bit (HT_MUON_ARITH_TORCH) */
} ht_muon_momentum_style;

/* How a sharded matrix reaches Newton-Schulz (muon_comm_strategy). */
typedef enum ht_muon_comm {
    HT_MUON_COMM_ALLGATHER = 0, /* every rank gathers every matrix and orthogonalizes it */
    HT_MUON_COMM_DEREDUNDANCY,  /* each matrix has one owner rank that gathers, orthogonalizes and scatters it */
} ht_muon_comm;

typedef struct ht_muon_config {
    double lr; /* the base lr; each step takes the scheduled lr */
    double weight_decay;
    double momentum; /* mu, in [0, 1) */
    bool nesterov;
    ht_muon_momentum_style momentum_style;
    ht_ns_schedule schedule;  /* from ht_ns_schedule_expand */
    double ns_eps;            /* > 0 */
    double matched_adamw_rms; /* > 0: scale = rms sqrt(max(A, B)); 0: sqrt(max(1, A / B)) */
    ht_dtype ns_dtype;        /* F32, or BF16 operands with FP32 accumulation */
    ht_muon_comm comm_strategy;
} ht_muon_config;

/* One parameter as Muon sees it: `matrices` (A, B) matrices, E of a 3-D
 * (E, A, B) param or 1 of a 2-D (A, B) one. State is keyed by the name. */
typedef struct ht_muon_slot {
    ht_param *param;
    int64_t matrices, rows, cols; /* E, A, B */
    double scale;                 /* the update scale of an (A, B) matrix */
    float *momentum_buffer;       /* (E, A, B) FP32, the param's layout */
    int64_t step;                 /* updates taken so far */
} ht_muon_slot;

typedef struct ht_muon {
    ht_muon_config config;
    ht_muon_slot *slots;
    int count;
    float *state_block; /* one allocation for every momentum_buffer */
    float *work;        /* whole matrices' updates + their Newton-Schulz workspace: the largest, or a batch */
    size_t work_floats;
    int *order; /* the slots by shape (rows, cols): Newton-Schulz batches are runs of it */
    /* The ranks a sharded matrix's rows are spread over (ht_comm_single() by
     * default): each rank's momentum-updated rows are gathered into the whole
     * matrix, every rank runs Newton-Schulz on it and keeps its own rows (the
     * allgather strategy). A stack (E, A, B) is sharded by whole matrices:
     * each rank orthogonalizes its own, with no communication. */
    ht_comm *comm;
    /* deredundancy: each sharded matrix's owner rank (-1: none, a stack or
     * unsharded), and this rank's owned matrices, whole, at owned[i]. */
    int *owner;
    float **owned;
    float *owned_block;
    /* HSDP: the replica (shard group) whose owner computes each matrix; the
     * other replicas receive its rows over `replicas`. */
    ht_comm *replicas;
    int *owner_replica;
    /* Tensor parallelism (NULL: none): a matrix split over it (tp_dim) is
     * gathered whole, its FSDP rows and then its slices (ht_param_gather_
     * global), before Newton-Schulz, and each rank keeps its own box of the
     * result: the iteration is of the whole matrix, never of a slice.
     * tp_box holds a box's update, tp_scratch the gather's staging. */
    ht_comm *tp;
    float *tp_box, *tp_scratch;
    size_t tp_floats;     /* both together */
    ht_rounding rounding; /* into bf16/f16 params; the wrapper sets it before each step */
} ht_muon;

/* docs/NUMERICS.md's defaults: lr 0.02, momentum 0.95 (sum style, Nesterov), weight
 * decay 0.1, asym5 with 5 steps, ns_eps 1e-7, matched_adamw_rms 0.2, FP32. */
void ht_muon_config_defaults(ht_muon_config *cfg);

/* Takes every param in `params`: each must be 2-D or 3-D and have a
 * main_grad; a float32 one must be its own main_param, a bf16/f16 one without
 * a main param is updated in its model dtype. A sharded matrix is gathered
 * whole over the comm (ht_muon_set_comm). Errors name the param or the
 * config key. */
ht_status ht_muon_init(ht_muon *opt, const ht_muon_config *cfg, ht_param **params, int count, ht_error *err);
/* One update of every slot with learning rate `lr` (docs/NUMERICS.md, Muon):
 * momentum, Newton-Schulz per matrix, decoupled weight decay, the scaled
 * step, and the cast back to the model dtype fused into the last pass. */
/* Spreads the matrices over the ranks of `comm` (ht_muon.comm): with the
 * deredundancy strategy every sharded matrix gets an owner, greedily by
 * Newton-Schulz FLOPs (largest first, to the least loaded rank), logged.
 * Under HSDP `replicas` (NULL: none) are the ranks of the other shard groups
 * that hold this rank's rows: the owners are then drawn from every rank of
 * the world, one shard group computes each matrix and its replicas receive
 * the result rows instead of repeating the work. */
ht_status ht_muon_set_comm(ht_muon *opt, ht_comm *comm, ht_comm *replicas, ht_error *err);
/* Tensor parallelism: the ranks holding the other slices of the split
 * matrices (ht_muon.tp), after ht_muon_set_comm. The deredundancy strategy
 * does not take them yet (an error saying so). */
ht_status ht_muon_set_tensor_parallel(ht_muon *opt, ht_comm *tp, ht_error *err);
/* The bytes ht_muon_init, _set_comm and _set_tensor_parallel would give
 * these params, before they have storage: the momentum buffers, the
 * workspace, deredundancy's whole matrices this rank owns and tensor
 * parallelism's gather (comm, replicas, tp as those calls take them). */
size_t ht_muon_plan_bytes(const ht_muon_config *cfg, ht_param *const *params, int count, const ht_comm *comm,
                          const ht_comm *replicas, const ht_comm *tp);
void ht_muon_step(ht_muon *opt, double lr);
void ht_muon_free(ht_muon *opt);

/* The update scale of an (rows, cols) matrix (docs/NUMERICS.md, Muon). */
double ht_muon_update_scale(int64_t rows, int64_t cols, double matched_adamw_rms);

/* ---------------------------------------------------------------- LR schedules */

typedef enum ht_lr_type {
    HT_LR_CONSTANT_WARMUP = 0,  /* ConstantWarmUpLR */
    HT_LR_LINEAR_WARMUP,        /* LinearWithWarmUpLR */
    HT_LR_COSINE_WARMUP,        /* CosineWithWarmUpLR */
    HT_LR_COSINE_RESTARTS,      /* CosineWithRestartsAndWarmUpLR */
    HT_LR_POLYNOMIAL_WARMUP,    /* PolynomialWithWarmUpLR */
    HT_LR_WSD,                  /* WarmUpStableDecayLR */
    HT_LR_COSINE_ANNEALING,     /* CosineAnnealingLR */
    HT_LR_CONSTANT_COOLDOWN,    /* ConstantWithCoolDownLR */
    HT_LR_COSINE_WARM_RESTARTS, /* CosineAnnealingWarmRestarts */
    HT_LR_WISE_LAYER,           /* LearningRateWiseLayer: lr_scale times the schedule `wrapped` */
    HT_LR_TYPE_COUNT
} ht_lr_type;

typedef struct ht_lr_schedule {
    ht_lr_type type;
    double base_lr;        /* η */
    double warmup_lr_init; /* lr at step 0 of warmup */
    double lr_end;
    int64_t total_steps;     /* T = training.steps */
    int64_t warmup_steps;    /* W, already resolved from warmup_ratio */
    double num_cycles;       /* cosine: 0.5 = a half cosine down to lr_end */
    int64_t decay_steps;     /* cosine D (0 = T) / polynomial D (0 = T − W) */
    double power;            /* polynomial */
    int64_t decay_start;     /* WSD: S, already resolved from decay_start_ratio */
    double eta_min;          /* CosineAnnealingLR */
    int64_t t_max;           /* CosineAnnealingLR; 0 = T */
    int64_t keep_steps;      /* ConstantWithCoolDownLR: steps held at η after warmup */
    int64_t final_steps;     /* ConstantWithCoolDownLR: steps held at lr_end1 after the decay (D = decay_steps) */
    double lr_end1, lr_end2; /* ConstantWithCoolDownLR; lr_end2 already resolved (MindFormers: None = lr_end1) */
    int64_t t_0, t_mult;     /* CosineAnnealingWarmRestarts, both >= 1 */
    double lr_scale;         /* LearningRateWiseLayer */
    ht_lr_type wrapped;      /* LearningRateWiseLayer: the base schedule (any type but LearningRateWiseLayer) */
} ht_lr_schedule;

const char *ht_lr_type_name(ht_lr_type type);
bool ht_lr_type_from_name(const char *name, ht_lr_type *out);
/* The lr of the step with 0-based index s (docs/NUMERICS.md, learning-rate schedules,
 * as written: PolynomialWithWarmUpLR with W + D < T is not clamped at W + D). */
double ht_lr_at(const ht_lr_schedule *sched, int64_t s);

/* ---------------------------------------------------------------- clipping */

/* The global L2 norm of every trainable param's main_grad (accumulated in
 * double). A non-finite norm names the first parameter holding a non-finite
 * gradient in `bad` (when not NULL). */
double ht_grad_norm(const ht_param_store *params, const char **bad);
/* The sum of squares behind it, of this rank's rows only (a sharded store's
 * norm all-reduces it), in double. split_only: of the params tensor
 * parallelism splits alone (a rank of a tensor-parallel group but its
 * first leaves out the params every rank of it holds whole); `bad` still
 * looks at all of them. */
double ht_grad_sum_squares(const ht_param_store *params, bool split_only, const char **bad);
/* Scales every main_grad by max_norm / (norm + 1e-6) when norm > max_norm. */
void ht_clip_grads(ht_param_store *params, double norm, double max_norm);

/* fnmatch-style glob over parameter names ("*bias*", "model.layers.?.mlp.*"). */
bool ht_glob_match(const char *pattern, const char *name);

/* How routing and weight-decay lists match a parameter: a pattern with a glob
 * character (* ? [) is a glob; a bare name matches where it is a substring, as
 * MindFormers matches its module names. Either kind is tried on the
 * parameter's own (Hugging Face) name and on its Megatron/MindFormers
 * spelling, so "word_embeddings" and "output_layer" find model.embed_tokens
 * and lm_head (ht_megatron_name). */
bool ht_name_match(const char *pattern, const char *name);
/* The Megatron/MindFormers spelling of a decoder parameter's name:
 * model.embed_tokens -> embedding.word_embeddings, model.layers.N ->
 * decoder.layers.N, self_attn.{q,k,v}_proj -> self_attention.linear_qkv,
 * o_proj -> self_attention.linear_proj, mlp.{gate,up}_proj -> mlp.linear_fc1,
 * down_proj -> mlp.linear_fc2, post_attention_layernorm -> pre_mlp_layernorm,
 * model.norm -> decoder.final_layernorm, lm_head -> output_layer. */
void ht_megatron_name(const char *name, char *out, size_t n);

#ifdef __cplusplus
}
#endif
#endif
