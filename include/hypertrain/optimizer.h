/* The optimizer the trainer drives (optim layer): the FP32 main-param wrapper
 * around the chained Muon + AdamW. It routes parameters to the two leaf
 * optimizers, owns their LR schedules, prepares gradients (fp16 loss
 * scaling, non-finite checks), clips, steps both leaves on the FP32 main
 * params and has them cast the result back to the model dtype (or, without
 * FP32 main params, update the model's own values through FP32 blocks). */
#ifndef HYPERTRAIN_OPTIMIZER_H
#define HYPERTRAIN_OPTIMIZER_H

#include "hypertrain/optim.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- fp16 loss scaling */

/* Megatron's DynamicGradScaler (docs/NUMERICS.md, fp16 loss scaling). */
typedef struct ht_loss_scaler {
    double scale;
    double growth_factor, backoff_factor, min_scale;
    int growth_interval, hysteresis;
    int growth_tracker;     /* clean steps since the last change */
    int hysteresis_tracker; /* overflows still tolerated before backing off */
} ht_loss_scaler;

void ht_loss_scaler_init(ht_loss_scaler *s, double initial, double growth_factor, double backoff_factor,
                         int growth_interval, int hysteresis, double min_scale);
void ht_loss_scaler_update(ht_loss_scaler *s, bool found_inf);

/* ---------------------------------------------------------------- the chained optimizer */

typedef struct ht_optimizer_config {
    bool use_muon; /* Muon for matrices; false: every parameter goes to AdamW */
    /* false: bf16/f16 params get no FP32 copy (main_param NULL, main_bytes 0);
     * the leaves update the model's own values, each step from them. */
    bool fp32_main_params;
    /* with fp32_main_params: a bfloat16 param's main param held as the low
     * 16 bits beside its weight (HT_MAIN_RESIDUAL16), bit for bit the copy's
     * values at half its bytes */
    bool residual16;
    ht_adamw_config adamw;
    const char *const *no_weight_decay; /* patterns (ht_name_match): AdamW weight decay 0 */
    int no_weight_decay_count;
    /* MindFormers' overrides of that: included names decay whatever no_weight_decay
     * says, excluded ones never do; a name in both is an error. */
    const char *const *weight_decay_include;
    int weight_decay_include_count;
    const char *const *weight_decay_exclude;
    int weight_decay_exclude_count;
    ht_muon_config muon;
    const char *const *adamw_include; /* patterns (ht_name_match): matrices that still go to AdamW */
    int adamw_include_count;
    ht_lr_schedule adamw_schedule; /* base_lr = adamw.lr */
    ht_lr_schedule muon_schedule;  /* base_lr = muon.lr */
    double max_norm;
    bool loss_scaling; /* dynamic loss scaling (float16 models) */
    ht_loss_scaler scaler;
    bool stochastic_rounding; /* round updates into bf16/f16 params stochastically (docs/NUMERICS.md) */
    uint64_t seed;            /* its random stream */
    ht_comm *comm;            /* the ranks a sharded store is spread over; NULL: one process */
    ht_comm *replicas;        /* HSDP: the ranks holding the same rows as this one (Muon splits its work over them) */
    /* Tensor parallelism: the ranks holding the other slices of the split
     * params (ht_param.tp_dim; NULL: none). The gradient norm sums over them
     * (a param not split counted once), Muon gathers each split matrix whole. */
    ht_comm *tp;
    /* Pipeline parallelism: the ranks holding the other stages' params
     * (NULL: none). The gradient norm sums over them. */
    ht_comm *stages;
} ht_optimizer_config;

typedef struct ht_optimizer {
    ht_param_store *params;
    bool fp32_main_params;
    double max_norm;
    /* Megatron's three groups, named for what they hold. */
    ht_param **float16_groups; /* bf16/fp16 model params */
    /* their FP32 main params, in the same order (NULL without fp32_main_params, or held as residual16:
     * ht_param_main_read) */
    float **fp32_from_float16_groups;
    int float16_count;
    ht_param **fp32_from_fp32_groups; /* float32 params: their own main params */
    int fp32_count;
    ht_muon *muon;   /* NULL when no parameter goes to Muon */
    ht_adamw *adamw; /* NULL when no parameter goes to AdamW */
    ht_lr_schedule muon_schedule, adamw_schedule;
    bool loss_scaling;
    ht_loss_scaler scaler;
    bool stochastic_rounding;
    uint64_t seed;
    int64_t step; /* successful steps: the schedules' step index */
    ht_comm *comm, *tp, *stages;
} ht_optimizer;

typedef struct ht_step_result {
    bool skipped;     /* fp16 overflow: no update, the scale backs off */
    double grad_norm; /* of the unscaled gradients, before clipping */
    double muon_lr, adamw_lr;
    double loss_scale; /* the scale the step's gradients carried (1 without scaling) */
} ht_step_result;

/* Routes every trainable param (Muon iff >= 2 dims and no adamw_include
 * match), creates the FP32 main params (or, without fp32_main_params, frees
 * any the store holds) and both leaves, and logs the routing.
 * A trainable param whose dtype is not a float dtype is an error naming it. */
ht_status ht_optimizer_init(ht_optimizer *opt, ht_param_store *params, const ht_optimizer_config *cfg, ht_error *err);
/* The factor the loss is multiplied by before backward (the loss scale, or 1). */
double ht_optimizer_loss_scale(const ht_optimizer *opt);
/* One step: unscale and check (fp16) -> clip -> Muon and AdamW on the main
 * params -> cast back to the model dtype -> zero main_grad. A non-finite
 * gradient without loss scaling is an error naming the first such param. */
ht_status ht_optimizer_step(ht_optimizer *opt, ht_step_result *result, ht_error *err);
void ht_optimizer_free(ht_optimizer *opt);
/* One tensor of optimizer state as the checkpoint code sees it: the param
 * it belongs to, its PyTorch state key, and this rank's rows of it (FP32, the
 * param's layout) or, for "step", one int64 every rank shares. */
typedef struct ht_opt_state {
    ht_param *param;
    const char *key; /* "exp_avg", "exp_avg_sq", "momentum_buffer" or "step" */
    void *data;      /* NULL: this run keeps no such tensor (Muon without momentum) */
    ht_dtype dtype;  /* HT_DTYPE_F32 rows, or HT_DTYPE_I64 for the step */
    int64_t *step;   /* the slot's step count: 0 until its first update (PyTorch creates state then) */
} ht_opt_state;
/* The optimizer's state tensors, Muon's slots then AdamW's, into out (NULL:
 * just count them); returns the count. */
int ht_optimizer_list_state(const ht_optimizer *opt, ht_opt_state *out);

/* The bytes this rank's optimizer holds: AdamW's moments, Muon's momentum,
 * its workspace, (deredundancy) the whole matrices it owns and (tensor
 * parallelism) its gather of a split matrix. */
size_t ht_optimizer_bytes(const ht_optimizer *opt);
/* What ht_optimizer_init with cfg would give this rank's params in state,
 * before it exists (the store declared or allocated), as ht_optimizer_bytes
 * counts it: AdamW's two moments and Muon's state (ht_muon_plan_bytes),
 * routed as ht_optimizer_init routes. */
size_t ht_optimizer_plan_bytes(const ht_param_store *params, const ht_optimizer_config *cfg);
/* This rank's Newton-Schulz FLOPs a step, counted nominally as the standard
 * form's 4 r² c + 2 r³ an iteration (r <= c the matrix's sides, whatever
 * muon_ns_form computes): every matrix it orthogonalizes (under
 * deredundancy, the ones it owns; of a stack, its own experts). 0 without Muon. */
double ht_optimizer_ns_flops(const ht_optimizer *opt);

/* ---------------------------------------------------------------- QK-clip */

/* One attention layer's q/k projections as QK-clip sees them (biases may be
 * NULL). Multi-Latent Attention (kv_b set): q_weight is q_b_proj or q_proj,
 * head h's rows [h Dk, h Dk + nope) its q_nope and the next `rope` its q_pe
 * (Dk = nope + rope); kv_b is kv_b_proj, head h's rows [h (nope + v_dim),
 * h (nope + v_dim) + nope) its k_nope, the v_dim after them its v. */
typedef struct ht_qk_layer {
    ht_param *q_weight, *q_bias, *k_weight, *k_bias;
    int num_heads, num_kv_heads, head_dim;
    ht_param *kv_b;
    int nope, rope, v_dim;
} ht_qk_layer;

/* MuonClip (docs/NUMERICS.md): for each head whose max logit exceeds tau,
 * gamma = tau / max logit; plain attention scales its q rows (and k rows for
 * MHA, each by sqrt(gamma)); MLA scales q_nope and k_nope by sqrt(gamma) and
 * q_pe by gamma, and never v or the shared rotary key (kv_a_proj_with_mqa),
 * as Kimi K2 and MindFormers' apply_qk_clip_scaling define it. The FP32 main
 * params are scaled and written back to the model dtype (without main
 * params: the model's rows, widened, scaled and rounded back to nearest).
 * max_logit: (num_heads). Returns heads clipped. */
int ht_qk_clip(const ht_qk_layer *layer, const float *max_logit, double tau);

#ifdef __cplusplus
}
#endif
#endif
