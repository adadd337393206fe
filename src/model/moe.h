/* The sparse MLP block of Qwen2-MoE and DeepSeek-V3 (internal to the model
 * layer): the router (softmax top-k, or DeepSeekMoE's grouped sigmoid
 * routing with its correction bias), the routed experts as grouped GEMMs
 * (the tokens sorted by expert, one GEMM per expert over its rows), the
 * shared expert (gated, or DeepSeek's ungated shared experts) and the
 * load-balancing loss, forward and hand-written backward. The decoder calls
 * it in place of the dense MLP of its sparse layers. */
#ifndef HT_MODEL_MOE_H
#define HT_MODEL_MOE_H

#include "hypertrain/model.h"

/* One sparse layer's params (Hugging Face names under model.layers.N.mlp). */
typedef struct ht_moe_params {
    ht_param *router;                    /* gate.weight (E, C); deepseek_v3: FP32 (keep_fp32) */
    ht_param *bias;                      /* deepseek_v3: gate.e_score_correction_bias (E) FP32, never trained */
    ht_param *gate_up, *down;            /* experts.gate_up_proj (E, 2I, C), experts.down_proj (E, C, I) */
    ht_param *sh_gate, *sh_up, *sh_down; /* shared_expert(s).{gate,up}_proj (S, C), down_proj (C, S); NULL: S = 0 */
    ht_param *sh_expert_gate;            /* qwen2_moe: shared_expert_gate.weight (1, C); NULL: ungated */
} ht_moe_params;

typedef struct ht_moe ht_moe;

/* The sparse layers' state for a model of config cfg; `layers` of them. */
ht_moe *ht_moe_new(const ht_model_config *cfg, int layers);
void ht_moe_free(ht_moe *moe);
/* Pipeline parallelism: only the sparse layers [first, end) (by their index among the sparse layers) run here,
 * and only they get activations. */
void ht_moe_set_layers(ht_moe *moe, int first, int end);
/* Another set of activations for the same experts (a micro-batch slot of pipeline parallelism): the same params
 * and layers, the token counts shared with `moe`'s (it must outlive the clone). */
ht_moe *ht_moe_clone(const ht_moe *moe);
/* Names and shapes of sparse layer l's params, declared in Hugging Face's
 * order into the store (module: "model.layers.N"). */
bool ht_moe_declare(ht_param_store *ps, const char *module, const ht_model_config *cfg, ht_dtype dtype);
/* Binds sparse layer `index` (0-based among the sparse layers) to its params. */
void ht_moe_bind(ht_moe *moe, int index, ht_param_store *ps, const char *module);
const ht_moe_params *ht_moe_params_of(const ht_moe *moe, int index);
/* Starts a forward of N tokens: buffers sized, the load-balancing sums
 * zeroed. ep: the model's expert parallelism (every expert here when its
 * size is <= 1). tp: the model's tensor parallelism (NULL or size <= 1:
 * none): the shared expert a dense MLP in Megatron's layout, under
 * sequence parallelism over every token of the group (N of them here). */
ht_status ht_moe_begin(ht_moe *moe, int64_t N, ht_expert_parallel *ep, const ht_tensor_parallel *tp, ht_error *err);
/* Context and sequence parallelism: the load-balancing loss's sums (each
 * expert's routed rows and router probabilities, and the rows) summed over
 * a group with `sum` (in rank order) after the last sparse layer's forward:
 * the loss is then the whole sequences', the same on every rank of it. */
void ht_moe_sum_routing(ht_moe *moe, void (*sum)(void *ctx, double *buf, int64_t n), void *ctx);
/* Those sums as ht_moe_routing_count doubles (each expert's routed rows,
 * then its router probabilities, then the rows): read, or set in place of
 * this forward's so far (pipeline stages pass them on: a stage's forward
 * adds its layers' to the earlier stages', in the order of one process). */
int ht_moe_routing_count(const ht_moe *moe);
void ht_moe_routing_get(const ht_moe *moe, double *sums);
void ht_moe_routing_set(ht_moe *moe, const double *sums);
/* y (N, C) FP32 = the block of sparse layer `index` applied to x (N, C) in
 * the compute dtype (x as the GEMMs read it); keeps what backward reads.
 * `round` is the precision FP32 operands are rounded to (F32: none). */
void ht_moe_forward(ht_moe *moe, int index, float *y, const void *x, int64_t N, ht_dtype round);
/* After every sparse layer's forward: the load-balancing loss of this
 * forward (transformers' load_balancing_loss_func). */
double ht_moe_aux_loss(const ht_moe *moe);
/* Given dy (N, C) FP32: every param's grad += its gradient, and dx (N, C)
 * FP32 = the gradient of x (overwritten). aux_scale: d loss / d aux (the
 * coefficient times the loss's scale; 0 without the aux loss). */
void ht_moe_backward(ht_moe *moe, int index, float *dx, const float *dy, const void *x, int64_t N, float aux_scale,
                     ht_dtype round);
/* The bytes the block keeps for backward and its scratch. */
size_t ht_moe_activation_bytes(const ht_moe *moe);
/* What ht_moe_activation_bytes will be once ht_moe_begin sizes the
 * buffers for N tokens of this rank on ep_size ranks of expert parallelism
 * and tp_size of tensor parallelism (sequence: sequence parallelism's),
 * operands of cd bytes: for a plan before the model has storage. */
size_t ht_moe_plan_bytes(const ht_moe *moe, int64_t N, int ep_size, int tp_size, bool sequence, size_t cd);
/* (sparse layers, E) the rows each expert of each sparse layer was routed in
 * the forwards since they were last zeroed (the decoder points
 * ht_model.expert_tokens at them). */
int64_t *ht_moe_expert_tokens(ht_moe *moe);

#endif
