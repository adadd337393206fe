/* The optimizer layer: leaf optimizers that update FP32 buffers (AdamW now,
 * Muon next), learning-rate schedules and global gradient-norm clipping.
 * Leaf optimizers never see the model's dtype: they read main_grad and write
 * main_param, and the cast back to the model dtype is fused into their pass. */
#ifndef HYPERTRAIN_OPTIM_H
#define HYPERTRAIN_OPTIM_H

#include "hypertrain/base.h"
#include "hypertrain/param.h"

#ifdef __cplusplus
extern "C" {
#endif

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
    float *state_block; /* one allocation for every exp_avg and exp_avg_sq */
} ht_adamw;

/* One slot per entry of `params`, in order; each must have main_param and
 * main_grad (HT_ERR_INVALID naming the first that lacks them). Names
 * matching any of the `no_wd` glob patterns get zero weight decay. */
ht_status ht_adamw_init(ht_adamw *opt, const ht_adamw_config *cfg, ht_param **params, int count,
                        const char *const *no_wd, int no_wd_count, ht_error *err);
/* One update of every slot with learning rate `lr` (NUMERICS.md, AdamW). */
void ht_adamw_step(ht_adamw *opt, double lr);
void ht_adamw_free(ht_adamw *opt);

/* The fused kernel: updates p (FP32) in place from g and, when model != NULL,
 * writes the rounded result to model (HT_DTYPE_BF16 or HT_DTYPE_F16; other
 * dtypes write nothing) in the same pass. Every element takes PyTorch's
 * rounding sequence (mul, lerp as one FMA, mul + FMA, sqrt, div, add, mul,
 * div, add in FP32; scalars from double), identical on every path and for
 * any thread count. Threads: OpenMP, static split; n < 65536 runs serially. */
void ht_adamw_update(float *p, const float *g, float *m, float *v, int64_t n, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, void *model, ht_dtype model_dtype);

/* ---------------------------------------------------------------- LR schedules */

typedef enum ht_lr_type {
    HT_LR_CONSTANT_WARMUP = 0, /* ConstantWarmUpLR */
    HT_LR_LINEAR_WARMUP,       /* LinearWithWarmUpLR */
    HT_LR_COSINE_WARMUP,       /* CosineWithWarmUpLR */
    HT_LR_COSINE_RESTARTS,     /* CosineWithRestartsAndWarmUpLR */
    HT_LR_POLYNOMIAL_WARMUP,   /* PolynomialWithWarmUpLR */
    HT_LR_WSD,                 /* WarmUpStableDecayLR */
    HT_LR_COSINE_ANNEALING,    /* CosineAnnealingLR */
    HT_LR_TYPE_COUNT
} ht_lr_type;

typedef struct ht_lr_schedule {
    ht_lr_type type;
    double base_lr;        /* η */
    double warmup_lr_init; /* lr at step 0 of warmup */
    double lr_end;
    int64_t total_steps;  /* T = training.steps */
    int64_t warmup_steps; /* W, already resolved from warmup_ratio */
    double num_cycles;    /* cosine: 0.5 = a half cosine down to lr_end */
    int64_t decay_steps;  /* cosine D (0 = T) / polynomial D (0 = T − W) */
    double power;         /* polynomial */
    int64_t decay_start;  /* WSD: S, already resolved from decay_start_ratio */
    double eta_min;       /* CosineAnnealingLR */
    int64_t t_max;        /* CosineAnnealingLR; 0 = T */
} ht_lr_schedule;

const char *ht_lr_type_name(ht_lr_type type);
bool ht_lr_type_from_name(const char *name, ht_lr_type *out);
/* The lr of the step with 0-based index s (NUMERICS.md, learning-rate schedules,
 * as written: PolynomialWithWarmUpLR with W + D < T is not clamped at W + D). */
double ht_lr_at(const ht_lr_schedule *sched, int64_t s);

/* ---------------------------------------------------------------- clipping */

/* The global L2 norm of every trainable param's main_grad (accumulated in
 * double). A non-finite norm names the first parameter holding a non-finite
 * gradient in `bad` (when not NULL). */
double ht_grad_norm(const ht_param_store *params, const char **bad);
/* Scales every main_grad by max_norm / (norm + 1e-6) when norm > max_norm. */
void ht_clip_grads(ht_param_store *params, double norm, double max_norm);

/* fnmatch-style glob over parameter names ("*bias*", "model.layers.?.mlp.*"). */
bool ht_glob_match(const char *pattern, const char *name);

#ifdef __cplusplus
}
#endif
#endif
