/* Decoder-only language models: the architecture config, the model registry
 * (name -> builder) and the model interface (forward, backward) over a named
 * parameter store. The built-ins are "qwen2", "llama", "qwen2_moe" and
 * "deepseek_v3"; a plugin registers more. */
#ifndef HYPERTRAIN_MODEL_H
#define HYPERTRAIN_MODEL_H

#include "hypertrain/base.h"
#include "hypertrain/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* LoRA (model.lora, PEFT's LoraConfig): a low-rank update of chosen linear
 * layers, y = x Wᵀ (+ b) + scale · (dropout(x) Aᵀ) Bᵀ with lora_A (r, in) and
 * lora_B (out, r) ordinary parameters named <module>.lora_A.weight /
 * <module>.lora_B.weight; scale = alpha / r, or alpha / sqrt(r) with
 * use_rslora. Not part of config.json: a model with adapters saves to Hugging
 * Face with them merged into W, or as a PEFT adapter directory. */
#define HT_LORA_MAX_TARGETS 16
#define HT_LORA_TARGET_MAX 160
typedef struct ht_lora_config {
    int rank;       /* r; 0: no adapters */
    double alpha;   /* lora_alpha */
    double dropout; /* lora_dropout: on the adapter's input, in training forward passes only */
    bool use_rslora;
    /* target_modules as PEFT matches a list: a name matches a module whose
     * path is it or ends with "." + it ("q_proj", "self_attn.q_proj",
     * "model.layers.0.mlp.down_proj"), "{*}" / "*" standing for one dotted
     * component; "all-linear" is every projection (not lm_head). */
    int target_count;
    char targets[HT_LORA_MAX_TARGETS][HT_LORA_TARGET_MAX];
} ht_lora_config;

/* Qwen2-MoE's sparse MLP (transformers' Qwen2MoeSparseMoeBlock): a router
 * (mlp.gate.weight (E, C)) picks num_experts_per_tok of num_experts experts
 * per token by softmax probability; the routed experts are the 3-D
 * parameters mlp.experts.gate_up_proj (E, 2I, C) (gate rows first, then up)
 * and mlp.experts.down_proj (E, C, I); a shared expert (an MLP of
 * shared_expert_intermediate_size) is added, scaled by
 * sigmoid(mlp.shared_expert_gate.weight · x). Layer l is sparse when
 * num_experts > 0, (l + 1) % decoder_sparse_step == 0 and l is not in
 * mlp_only_layers; the other layers keep the dense MLP of intermediate_size. */
#define HT_LAYER_LIST_MAX 64
typedef struct ht_layer_list {
    int count;
    int items[HT_LAYER_LIST_MAX];
} ht_layer_list;
typedef struct ht_moe_config {
    int num_experts;         /* E; 0: no sparse layer */
    int num_experts_per_tok; /* k */
    int moe_intermediate_size;
    int shared_expert_intermediate_size;
    bool norm_topk_prob; /* the k chosen probabilities rescaled to sum to 1 */
    int decoder_sparse_step;
    ht_layer_list mlp_only_layers;
    /* The load-balancing loss (transformers' load_balancing_loss_func over
     * every sparse layer of one forward) is added to the loss times
     * router_aux_loss_coef when output_router_logits is true. */
    bool output_router_logits;
    double router_aux_loss_coef;
    /* deepseek_v3 (transformers' DeepseekV3MoE): sigmoid scores; the choice
     * adds mlp.gate.e_score_correction_bias (E) to them, keeps the topk_group
     * best of n_group groups of experts (a group scored by the sum of its two
     * best) and picks the top num_experts_per_tok there; the weights are the
     * unbiased scores (normalised to sum 1 when norm_topk_prob), times
     * routed_scaling_factor. mlp.shared_experts is an ungated MLP of
     * n_shared_experts x moe_intermediate_size (none when 0). Layer l is
     * sparse when l >= first_k_dense_replace. num_experts is config.json's
     * n_routed_experts. */
    int n_shared_experts;
    int n_group, topk_group;
    double routed_scaling_factor;
    int first_k_dense_replace;
    /* Aux-loss-free balancing (Megatron-Core's moe_router_bias_update_rate):
     * after every step each sparse layer's correction bias moves by
     * +rate toward the experts that got fewer than the mean count of tokens
     * over the global batch and by -rate away from those that got more. 0: off
     * (as transformers leaves the bias fixed). */
    double bias_update_rate;
} ht_moe_config;

/* DeepSeek-V3's Multi-Latent Attention (transformers' DeepseekV3Attention),
 * on when kv_lora_rank > 0. Queries: q_proj (H*(nope+rope), C), or with
 * q_lora_rank > 0 q_a_proj (q_lora_rank, C) -> q_a_layernorm -> q_b_proj.
 * Keys and values: kv_a_proj_with_mqa (kv_lora_rank + rope, C) gives a
 * latent and one rotary key shared by every head; kv_a_layernorm, then
 * kv_b_proj (H*(nope+v), kv_lora_rank) gives each head's k_nope and v.
 * A head's query and key are [nope | rope] (qk_nope_head_dim +
 * qk_rope_head_dim), its value v_head_dim wide; o_proj (C, H*v). */
typedef struct ht_mla_config {
    int q_lora_rank; /* 0 (config.json null): a plain q_proj */
    int kv_lora_rank;
    int qk_nope_head_dim, qk_rope_head_dim, v_head_dim;
    /* The rotary pairs are adjacent (x[2i], x[2i+1]) rather than halves
     * (x[i], x[i + rope/2]): DeepSeek's checkpoints are written that way. */
    bool rope_interleave;
} ht_mla_config;

/* rope_scaling (rope_parameters in transformers 5) of rope_type "yarn"
 * (YaRN, as transformers' _compute_yarn_parameters computes it): the
 * frequencies blended between interpolated and extrapolated by a ramp
 * between beta_fast and beta_slow rotations over
 * original_max_position_embeddings, cos and sin multiplied by
 * mscale(factor, mscale) / mscale(factor, mscale_all_dim), and (MLA) the
 * softmax scale by mscale(factor, mscale_all_dim)^2, where
 * mscale(s, m) = 0.1 m ln(s) + 1 for s > 1, else 1. */
typedef struct ht_rope_scaling {
    char type[16]; /* "yarn"; "" or "default": the default RoPE */
    double factor;
    int original_max_position_embeddings;
    double beta_fast, beta_slow, mscale, mscale_all_dim;
} ht_rope_scaling;

/* The architecture, with the field names and meaning of Hugging Face's config.json. */
typedef struct ht_model_config {
    char name[32]; /* registry name: "qwen2", "llama", "qwen2_moe", "deepseek_v3" */
    int vocab_size;
    int hidden_size;
    int intermediate_size;
    int num_hidden_layers;
    int num_attention_heads;
    int num_key_value_heads;
    int head_dim; /* 0: hidden_size / num_attention_heads */
    int max_position_embeddings;
    double rope_theta;
    double rms_norm_eps;
    bool attention_bias; /* q/k/v biases: Qwen2 yes, Llama no */
    bool tie_word_embeddings;
    double initializer_range; /* std of the normal init of fresh weights (HF default 0.02) */
    ht_moe_config moe;        /* qwen2_moe and deepseek_v3 */
    ht_mla_config mla;        /* deepseek_v3 only */
    ht_rope_scaling rope_scaling;
    ht_lora_config lora; /* rank 0: none; never read from or written to config.json */
} ht_model_config;

/* Every scalar architecture field, declared once: config/keys.c makes its
 * YAML key from it and ckpt/hf.c reads and writes config.json by it, in this
 * order (the effective-config log's and config.json's). A row is
 *   X(member of ht_model_config, YAML key (model.<key>), config.json name,
 *     type, default of a model built from the YAML,
 *     transformers' default when config.json omits it: qwen2, llama, qwen2_moe, deepseek_v3)
 * with a transformers default of `req` (config.json must have it), `-` (that
 * family's config.json has no such field: 0 when read, not written), a value,
 * or another field's config.json name (that field's value). The two defaults
 * differ on purpose: the YAML's build a small model that trains in seconds
 * (kv_lora_rank 64), transformers' are the published model's
 * (DeepseekV3Config's kv_lora_rank 512).
 * Types: INT, FLT, BOOL; DIM, an int where 0 means derived (head_dim:
 * hidden_size / num_attention_heads), left out of config.json when 0;
 * INT_OR_NULL, where config.json's null is 0 and 0 itself an error
 * (q_lora_rank: null is a plain q_proj); LAYERS, a list of layer indices.
 * Not here, handled by hand: model.name (config.json's model_type), the RoPE
 * scaling (model.rope_scaling.*, config.json's rope_scaling and
 * rope_parameters objects, which also hold rope_theta in transformers 5),
 * LoRA (never in config.json), two config.json spellings
 * (HT_ARCH_SPELLINGS below) and the engine's defaults that depend on
 * model.name (config/dialects.c: deepseek_v3 has no attention bias and
 * normalises its top-k). */
/* clang-format off */
#define HT_ARCH_FIELDS(X)                                                                                              \
    X(vocab_size, vocab_size, vocab_size, INT, 256, req, req, req, req)                                                \
    X(hidden_size, hidden_size, hidden_size, INT, 256, req, req, req, req)                                             \
    X(intermediate_size, intermediate_size, intermediate_size, INT, 688, req, req, req, req)                           \
    X(num_hidden_layers, num_hidden_layers, num_hidden_layers, INT, 4, req, req, req, req)                             \
    X(num_attention_heads, num_attention_heads, num_attention_heads, INT, 8, req, req, req, req)                       \
    X(num_key_value_heads, num_key_value_heads, num_key_value_heads, INT, 2,                                           \
      num_attention_heads, num_attention_heads, num_attention_heads, num_attention_heads)                              \
    X(head_dim, head_dim, head_dim, DIM, 0, 0, 0, 0, 0)                                                                \
    X(max_position_embeddings, max_position_embeddings, max_position_embeddings, INT, 512, req, req, req, req)         \
    X(rope_theta, rope_theta, rope_theta, FLT, 10000.0, 10000.0, 10000.0, 10000.0, 10000.0)                            \
    X(rms_norm_eps, rms_norm_eps, rms_norm_eps, FLT, 1.0e-6, 1e-6, 1e-6, 1e-6, 1e-6)                                   \
    X(attention_bias, attention_bias, attention_bias, BOOL, true, true, false, true, false)                            \
    X(tie_word_embeddings, tie_word_embeddings, tie_word_embeddings, BOOL, false, false, false, false, false)          \
    X(initializer_range, initializer_range, initializer_range, FLT, 0.02, 0.02, 0.02, 0.02, 0.02)                      \
    /* Multi-Latent Attention (deepseek_v3) */                                                                         \
    X(mla.q_lora_rank, q_lora_rank, q_lora_rank, INT_OR_NULL, null, -, -, -, 1536)                                    \
    X(mla.kv_lora_rank, kv_lora_rank, kv_lora_rank, INT, 64, -, -, -, 512)                                             \
    X(mla.qk_nope_head_dim, qk_nope_head_dim, qk_nope_head_dim, INT, 32, -, -, -, 128)                                 \
    X(mla.qk_rope_head_dim, qk_rope_head_dim, qk_rope_head_dim, INT, 16, -, -, -, 64)                                  \
    X(mla.v_head_dim, v_head_dim, v_head_dim, INT, 32, -, -, -, 128)                                                   \
    X(mla.rope_interleave, rope_interleave, rope_interleave, BOOL, true, -, -, -, true)                                \
    /* The sparse MLP (qwen2_moe, deepseek_v3) */                                                                      \
    X(moe.num_experts, num_experts, num_experts, INT, 0, -, -, 60, 256)                                                \
    X(moe.n_shared_experts, n_shared_experts, n_shared_experts, INT, 1, -, -, -, 1)                                    \
    X(moe.num_experts_per_tok, num_experts_per_tok, num_experts_per_tok, INT, 4, -, -, 4, 8)                           \
    X(moe.moe_intermediate_size, moe_intermediate_size, moe_intermediate_size, INT, 1408, -, -, 1408, 2048)            \
    X(moe.shared_expert_intermediate_size, shared_expert_intermediate_size, shared_expert_intermediate_size, INT,      \
      5632, -, -, 5632, -)                                                                                             \
    X(moe.n_group, n_group, n_group, INT, 1, -, -, -, 8)                                                               \
    X(moe.topk_group, topk_group, topk_group, INT, 1, -, -, -, 4)                                                      \
    X(moe.routed_scaling_factor, routed_scaling_factor, routed_scaling_factor, FLT, 1.0, -, -, -, 2.5)                 \
    X(moe.norm_topk_prob, norm_topk_prob, norm_topk_prob, BOOL, false, -, -, false, true)                              \
    X(moe.decoder_sparse_step, decoder_sparse_step, decoder_sparse_step, INT, 1, -, -, 1, -)                           \
    X(moe.mlp_only_layers, mlp_only_layers, mlp_only_layers, LAYERS, [], -, -, [], -)                                  \
    X(moe.output_router_logits, output_router_logits, output_router_logits, BOOL, false, -, -, false, -)               \
    X(moe.router_aux_loss_coef, router_aux_loss_coef, router_aux_loss_coef, FLT, 0.001, -, -, 0.001, -)                \
    X(moe.first_k_dense_replace, first_k_dense_replace, first_k_dense_replace, INT, 0, -, -, -, 3)                     \
    X(moe.bias_update_rate, moe_router_bias_update_rate, -, FLT, 0.0, -, -, -, -)
/* A family whose config.json spells a field otherwise: X(family, member, name). */
#define HT_ARCH_SPELLINGS(X)                                                                                           \
    X(qwen2_moe, attention_bias, qkv_bias) /* transformers 5's; always on before it */                                 \
    X(deepseek_v3, moe.num_experts, n_routed_experts)
/* clang-format on */

/* Whether layer l of cfg has the sparse MLP. */
bool ht_model_config_layer_is_sparse(const ht_model_config *cfg, int l);
/* Whether cfg is DeepSeek-V3 (its routing), and whether its attention is MLA. */
bool ht_model_config_is_deepseek(const ht_model_config *cfg);
bool ht_model_config_has_mla(const ht_model_config *cfg);
bool ht_rope_is_yarn(const ht_rope_scaling *r);
/* What q·k is multiplied by before the softmax: 1/sqrt(the q/k head dim),
 * with MLA and YaRN times mscale(factor, mscale_all_dim)^2. */
double ht_model_config_attention_scale(const ht_model_config *cfg);

/* Checks the numbers hang together (heads divide, sizes positive); names the field. */
ht_status ht_model_config_validate(const ht_model_config *cfg, ht_error *err);
int ht_model_config_head_dim(const ht_model_config *cfg);

typedef struct ht_model ht_model;

/* Expert parallelism (parallel.expert_parallel_size): this rank computes
 * experts [rank·E/size, (rank + 1)·E/size) of every sparse layer, for the
 * tokens of every rank of its expert-parallel group, and the expert params'
 * `compute` and `grad` hold those experts only. `exchange` is the group's
 * all-to-all (parallel/ provides it): send_bytes[r] bytes of `send` (laid out
 * by destination rank) go to rank r, and recv_bytes[r] bytes from rank r
 * land in `recv`, in rank order. size <= 1: every expert here, nothing
 * exchanged. */
typedef struct ht_expert_parallel {
    int size, rank;
    void (*exchange)(void *ctx, const void *send, const int64_t *send_bytes, void *recv, const int64_t *recv_bytes);
    void *ctx;
    double seconds; /* in exchange since it was last zeroed */
} ht_expert_parallel;

/* Context parallelism (parallel.ulysses_parallel_size U x
 * parallel.ring_attention_size R; docs/DESIGN.md, Context parallelism): the
 * U x R ranks of a context-parallel group hold different tokens of the same
 * sequences, Tc = T / (U R) of each, and everything but attention is
 * token-wise. The ring cuts a sequence into 2R chunks of T / 2R and ring
 * rank r holds chunks r and 2R - 1 - r (the causal work balanced); Ulysses
 * cuts a ring rank's two chunks into U equal pieces, Ulysses rank u holding
 * piece u. Attention: one all-to-all over the Ulysses group turns q, k, v
 * into whole (ring-local) sequences of H / U heads, and the key/value
 * blocks go round the ring, the partial results merged by their
 * log-sum-exp; the output takes the same way back. parallel/ provides the
 * exchanges. ulysses and ring <= 1: the model sees whole sequences. */
typedef struct ht_context_parallel {
    int ulysses, ring;           /* U, R */
    int ulysses_rank, ring_rank; /* this rank's place on each axis */
    /* Over the Ulysses group: U blocks of `bytes` each, block r of send to
     * rank r and block r of recv from it. */
    void (*all_to_all)(void *ctx, const void *send, void *recv, int64_t bytes);
    void *ulysses_ctx;
    /* Over the ring: starts sending `bytes` of send to the next ring rank
     * and receiving as many from the previous one into recv; wait ends it
     * (*seconds: the time it was in flight). */
    void *(*start_shift)(void *ctx, const void *send, void *recv, int64_t bytes);
    void (*wait)(void *ctx, void *request, double *seconds);
    void *ring_ctx;
    /* Over the whole context-parallel group: buf (n) <- its sum over the
     * ranks, in rank order (the same bits on every rank): Qwen2-MoE's
     * load-balancing sums, which are the sequences', not one rank's share's. */
    void (*sum)(void *ctx, double *buf, int64_t n);
    void *group_ctx;
    /* Since last zeroed: the all-to-alls' seconds; the ring steps' seconds in
     * flight, and the part of them attention stood waiting (the rest was
     * hidden behind the block in hand). */
    double all_to_all_seconds, ring_seconds, ring_waited_seconds;
} ht_context_parallel;

/* Tensor parallelism (parallel.tensor_parallel_size T; docs/DESIGN.md,
 * Tensor parallelism): the T ranks of a tensor-parallel group see the same
 * tokens and each holds a slice of the weights, Megatron's layout: q, k, v
 * (whole heads), gate and up column-parallel (a slice of their output
 * rows), o_proj and down row-parallel (a slice of their input columns), the
 * embedding and the LM head a slice of the vocabulary; the norms whole. A
 * row-parallel product, the embedding's rows and the gradient of a
 * column-parallel input are partial sums that `sum` completes; the loss is
 * the vocabulary-parallel cross-entropy (`max` and `sum_f64` combine each
 * row's statistics), so no rank holds a token's whole row of logits.
 * parallel/ provides the collectives. size <= 1: none. */
typedef struct ht_tensor_parallel {
    int size, rank;
    /* Over the tensor-parallel group, in rank order (the same bits on every
     * rank): buf (n) <- its elementwise sum, or max, over the ranks. */
    void (*sum)(void *ctx, float *buf, int64_t n);
    void (*max)(void *ctx, float *buf, int64_t n);
    void (*sum_f64)(void *ctx, double *buf, int64_t n);
    /* Sequence parallelism (parallel.sequence_parallel): the residual
     * stream and the norms hold N / size of the N tokens on each rank (the
     * ranks' rows in rank order); a norm's output is gathered to every token
     * before a column-parallel product (all_gather: each rank's `bytes` of
     * send side by side in recv), and a row-parallel product's partial sums
     * are summed onto each rank's rows (reduce_scatter: send (size x n), recv
     * (n) <- the sum over the ranks of their block `rank`, in rank order).
     * A param the group holds whole (ht_param.tp_dim < 0) then gets from
     * each rank its tokens' part of its gradient: the caller sums them over
     * the group after backward (the trainer does, once a step). */
    bool sequence;
    void (*all_gather)(void *ctx, const void *send, void *recv, int64_t bytes);
    void (*reduce_scatter)(void *ctx, const float *send, float *recv, int64_t n);
    void *ctx;
    void *owned; /* parallel/'s state behind ctx (ht_alloc), freed with the model */
    /* Since last zeroed: the seconds in those collectives (they block: the
     * layers wait for them), and the bytes each rank sent in them. */
    double seconds, bytes;
} ht_tensor_parallel;

/* The ranks of a context-parallel group (1: none). */
static inline int ht_context_size(const ht_context_parallel *cp) {
    return (cp->ulysses > 1 ? cp->ulysses : 1) * (cp->ring > 1 ? cp->ring : 1);
}

/* The position in its sequence of token t of the Tc this rank holds of it. */
static inline int64_t ht_context_position(const ht_context_parallel *cp, int64_t Tc, int64_t t) {
    const int64_t i = (cp->ulysses > 1 ? cp->ulysses_rank : 0) * Tc + t; /* in the ring rank's two chunks */
    if (cp->ring <= 1) return i;
    const int64_t c = Tc * (cp->ulysses > 1 ? cp->ulysses : 1) / 2,
                  chunk = i < c ? cp->ring_rank : 2 * cp->ring - 1 - cp->ring_rank;
    return chunk * c + i % c;
}

/* Parameters a model may have, and elements any one tensor may have: 2^40
 * (1.1 trillion), past every dense model this engine could hold in memory.
 * ht_model_config_validate refuses a config beyond it, naming the sizes. */
#define HT_MODEL_MAX_PARAMS ((int64_t)1 << 40)
/* Positions a model may have (model.max_position_embeddings): 2^24, past
 * every released model's context (10M); the rotary tables hold them all. */
#define HT_MODEL_MAX_POSITIONS (1 << 24)

/* A module in the sense of Hugging Face's named_modules(), at the grain the
 * model runs them: "model.embed_tokens", "model.layers.3", "model.norm",
 * "lm_head". FSDP units are made of modules (parallel.h). */
#define HT_MODULE_MAX_PARAMS 48 /* a layer: up to 18 weights, biases and norms, 8 of experts, 22 adapters */
typedef struct ht_module {
    char name[HT_PARAM_NAME_MAX];
    int param_count;
    ht_param *params[HT_MODULE_MAX_PARAMS]; /* every param it reads (the tied lm_head reads the embedding) */
    bool recomputable;                      /* backward can recompute what its forward keeps (ht_model_set_recompute) */
    const char *why_not; /* when not: why, for the error (NULL: it keeps too little to be worth it) */
} ht_module;

typedef enum ht_module_event {
    HT_BEFORE_FORWARD = 0,
    HT_AFTER_FORWARD,
    HT_BEFORE_BACKWARD,
    HT_AFTER_BACKWARD,
} ht_module_event;

/* Called around every module's forward and backward, in the order they run:
 * forward in module order, backward in reverse. Before a module runs, its
 * params' `compute` (and in backward `grad`) must point at whole tensors;
 * what happens in between is the hook's business (parallel/ gathers shards). */
typedef struct ht_module_hook {
    void (*fn)(void *ctx, int module, ht_module_event event);
    void *ctx;
} ht_module_hook;

/* A pipeline rank's part of a model (docs/DESIGN.md, Pipeline parallelism):
 * of `ranks` P ranks with `chunks` V model chunks each (virtual stages),
 * the L decoder layers split into P·V model stages of whole layers (L /
 * (P·V) each, the first L mod (P·V) one more), chunk c of rank r being
 * model stage c·P + r. `first`: rank 0, holding the embedding (its chunk 0
 * reads the token ids); `last`: rank P - 1, holding the final norm, the LM
 * head and the loss (its chunk V - 1 computes it). The whole model: one
 * rank, one chunk. */
#define HT_PIPELINE_CHUNKS_MAX 16
typedef struct ht_pipeline_stage {
    int layers, ranks, chunks, rank;
    bool first, last;
} ht_pipeline_stage;

/* Rank r of P's part, V chunks each, of L layers. */
ht_pipeline_stage ht_pipeline_stage_of(int L, int P, int V, int r);
/* Chunk c's layers [*first, *end). */
void ht_pipeline_chunk_layers(const ht_pipeline_stage *st, int c, int *first, int *end);
/* Whether any chunk of st holds layer l. */
bool ht_pipeline_holds_layer(const ht_pipeline_stage *st, int l);
/* The rank of P (V chunks each) holding the param `name` of a decoder of cfg: its layer's, the embedding's rank 0,
 * the rest rank P - 1. */
int ht_pipeline_stage_holding(const ht_model_config *cfg, int P, int V, const char *name);

typedef struct ht_model_ops {
    /* inputs, targets: (B, T) token ids. Computes logits and the mean
     * cross-entropy over all B*T positions (targets < 0 are ignored). */
    ht_status (*forward)(ht_model *m, const int32_t *inputs, const int32_t *targets, int B, int T, float *loss,
                         ht_error *err);
    /* Back-propagates the last forward's mean loss, scaled by `scale` (e.g.
     * 1/accumulation steps), accumulating (+=) into every param's full FP32
     * grad (its main_grad unless the store is sharded). */
    void (*backward)(ht_model *m, float scale);
    void (*free)(ht_model *m);
    /* Optional: the bytes forward and backward's buffers take for (B, T)
     * with matmul operands of `operand_bytes`, as the model is set (+inf:
     * beyond 64 bits). NULL: the model cannot tell. */
    double (*activation_bytes)(const ht_model *m, int B, int T, size_t operand_bytes);
    /* Optional, the model's tensor-parallel plan: makes the declared (not yet
     * allocated) model the share of rank `rank` of a tensor-parallel group of
     * `size` (ht_tensor_parallel): each param its slice (ht_param_split) and
     * the model's own sizes those of the slices. An error naming the sizes
     * when they do not divide. NULL: the model has no tensor-parallel plan. */
    ht_status (*set_tensor_parallel)(ht_model *m, int size, int rank, ht_error *err);
    /* Optional, generation: gives the model a key/value cache of
     * `max_tokens` positions of one sequence (ht_model_set_cache; 0: none,
     * freed). NULL: the model cannot generate. */
    ht_status (*set_cache)(ht_model *m, int64_t max_tokens, ht_error *err);
    /* Optional, pipeline parallelism: makes the declared (not yet allocated)
     * model the part `stage` names (its layers' params, the embedding on the
     * first stage, the final norm and LM head on the last), with forward and
     * backward taking and giving the stage's boundary tensors (ht_model's
     * stage_in ... stage_in_grad). NULL: the model cannot be split. */
    ht_status (*set_pipeline_stage)(ht_model *m, const ht_pipeline_stage *stage, ht_error *err);
} ht_model_ops;

struct ht_model {
    const ht_model_ops *ops;
    ht_model_config config;
    ht_param_store params;
    float *logits; /* (B, T, V) FP32, valid after forward; backward turns them into their gradient */
    /* Whether forward keeps the whole logits in `logits` (true when built).
     * false (the trainer): where they would pass head_chunk_bytes of FP32,
     * the LM head and the loss run over chunks of tokens of at most that
     * size, `logits` is NULL, and backward computes each chunk's logits
     * again: no (B, T, V) buffer. */
    bool keep_logits;
    int64_t head_chunk_bytes; /* the table's lm_head_chunk_bytes when built; 0: never chunked */
    ht_dtype output_dtype;    /* the precision the logits are rounded to (F32: none); F32 when built */
    /* (module_count) or NULL (a builder without it): the precision each
     * module's FP32 input is rounded to as the module starts (F32, as built:
     * none). The trainer sets an FSDP unit's to param_dtype under
     * fsdp_config.mix_precision.cast_forward_inputs; a decoder rounds its
     * layers' and its final norm's inputs, the hidden states. */
    ht_dtype *input_dtype;
    ht_dtype compute_precision; /* the precision of every matmul operand (param_dtype); F32 when built */
    /* (L, H): the largest attention logit q·k/sqrt(D) of each head (over
     * batch and positions, before masking) since the last reset: QK-clip's S_h. */
    float *attn_max_logit;
    /* Whether forward keeps attn_max_logit (true when built). It costs the
     * scores above the diagonal, which causal attention otherwise skips: a
     * trainer without QK-clip turns it off. */
    bool track_attn_max;
    /* qwen2_moe with output_router_logits: the last forward's load-balancing
     * loss, before router_aux_loss_coef (the loss forward returns includes
     * coef x aux_loss); NAN otherwise. */
    float aux_loss;
    ht_expert_parallel experts;  /* zero: none */
    ht_context_parallel context; /* zero: none; set only on a model whose builder can (context_capable) */
    ht_tensor_parallel tensor;   /* size and rank from ht_model_build_parallel; parallel/ attaches the rest */
    bool context_capable;        /* the builder's forward takes a context-parallel share of each sequence */
    int B, T;                    /* the shapes of the last forward */
    size_t activation_bytes;     /* what forward keeps for backward, and backward's scratch, for (B, T) */
    ht_module *modules;          /* (module_count) in forward order */
    int module_count;
    ht_module_hook hook; /* fn NULL: none */
    /* (module_count) or NULL: modules whose forward keeps only their input,
     * backward recomputing the rest (ht_model_set_recompute). */
    bool *recompute;
    int recompute_generation; /* bumped by every ht_model_set_recompute: the activations are sized again */
    /* model.lora.dropout: the stream the next forward's dropout masks are
     * drawn from (0: no dropout, as in evaluation) and the index of its first
     * sequence in the step's global batch, so that every split of a global
     * batch over ranks and micro-batches draws the same masks. Backward
     * regenerates the last forward's. */
    uint64_t dropout_seed;
    int64_t dropout_first_sequence;
    void *impl; /* the builder's own state */
    /* (sparse layers, E), the rows each routed expert of each sparse layer
     * (in layer order) was given by this rank's forwards since the last
     * ht_model_reset_expert_tokens: the counts the aux-loss-free bias update
     * (deepseek_v3) and the experts' load in the metrics sum over the ranks.
     * NULL: no sparse block. */
    int64_t *expert_tokens;
    /* Generation's key/value cache (ht_model_set_cache): room for
     * cache_capacity positions of one sequence (0: no cache), of which the
     * first cache_tokens are filled. With the cache, forward takes B = 1 and
     * no targets, its T tokens take positions cache_tokens .. cache_tokens +
     * T - 1 and attend to every cached token and to themselves (none
     * recomputed), their keys and values join the cache, cache_tokens grows
     * by T, and `logits` holds the last token's row alone (V). A caller sets
     * cache_tokens to 0 to start a new sequence. */
    int64_t cache_capacity, cache_tokens;
    /* Pipeline parallelism (ops.set_pipeline_stage; zero: the whole model).
     * A stage keeps the activations of `slots` micro-batches at once (1 as
     * built; set before a forward sizes them), forward writes slot `slot`'s
     * and backward reads them. On a stage that is not the first, forward
     * reads its input hidden states (B·T, C) FP32 from stage_in and backward
     * leaves their gradient in stage_in_grad (the model's, valid until the
     * next backward); on one that is not the last, forward leaves its output
     * (B·T, C) in stage_out (the slot's, valid until the slot's next
     * forward) and computes no loss, and backward reads the gradient of that
     * output from stage_out_grad. */
    ht_pipeline_stage stage;
    int slots, slot; /* slots of every chunk: slot s is chunk s / (slots / stage.chunks)'s, which it runs */
    const float *stage_in, *stage_out_grad;
    const float *stage_out, *stage_in_grad;
    /* What a stage passes on beside the hidden states: stage_sums_count
     * doubles (0: nothing), set with the stage (Qwen2-MoE's load-balancing
     * loss: the routing sums over every layer, which the loss multiplies).
     * Forward on a stage that is not the first starts from stage_sums_in
     * (the earlier stages' sums) and, on one that is not the last, leaves
     * its own added in stage_sums; backward on a stage that is not the last
     * reads the whole model's from stage_sums_grad and, on one that is not
     * the first, leaves them in stage_sums for the stage before (the model's,
     * valid until its next forward or backward). */
    int stage_sums_count;
    const double *stage_sums_in, *stage_sums_grad;
    double *stage_sums;
};

static inline void ht_model_event(ht_model *m, int module, ht_module_event event) {
    if (m->hook.fn) m->hook.fn(m->hook.ctx, module, event);
}

/* A builder declares the model's params (ht_params_add) and its modules, and
 * leaves them without storage: ht_model_build gives each rank storage for
 * its own rows only. (A builder that allocates still works: its store is
 * sharded afterwards, costing the whole model's memory once.) */
typedef ht_status (*ht_model_builder)(const ht_model_config *cfg, ht_dtype dtype, ht_model **out, ht_error *err);

/* The registry. Built-ins register themselves on first use; plugins call ht_model_register. */
ht_status ht_model_register(const char *name, ht_model_builder builder, ht_error *err);
/* Builds cfg->name with parameters of `dtype`, initialised from `seed`
 * (normal(0, initializer_range) for matrices, ones for norms, zeros for biases). */
ht_status ht_model_build(const ht_model_config *cfg, ht_dtype dtype, uint64_t seed, ht_model **out, ht_error *err);
/* The same with only rows [row0, row1) of each param's dim 0 for rank
 * `rank` of `world` (ht_param_rows_of) allocated and initialised: the values
 * are those rows of ht_model_build's (FSDP's meta-device init). */
ht_status ht_model_build_shard(const ht_model_config *cfg, ht_dtype dtype, uint64_t seed, int rank, int world,
                               ht_model **out, ht_error *err);
/* Where a rank's model sits: FSDP's rows (shard_rank of shard_world) of its
 * tensor-parallel slices (tp_rank of tp_size). World or size <= 1: whole. */
typedef struct ht_model_placement {
    int shard_rank, shard_world;
    int tp_rank, tp_size;
    int pp_rank, pp_size; /* pipeline stage pp_rank of pp_size (ht_pipeline_stage_of) */
    int pp_chunks;        /* model chunks (virtual stages) a pipeline rank holds: 0 or 1, one */
} ht_model_placement;
/* ht_model_build_shard's with tensor parallelism: the model is the share of
 * tp_rank (ht_model_ops.set_tensor_parallel; an error for a model without
 * the plan), its values those slices of ht_model_build's. */
ht_status ht_model_build_parallel(const ht_model_config *cfg, ht_dtype dtype, uint64_t seed,
                                  const ht_model_placement *at, ht_model **out, ht_error *err);
/* ht_model_build_parallel in two halves, for a caller that plans memory in
 * between: ht_model_declare builds the model with its params declared (this
 * placement's slices and rows, storage not yet allocated, unless the model's
 * builder allocates as it builds), so dtypes (ht_params_convert), what
 * trains (ht_params_freeze), the recompute plan and the bytes all of it
 * will take (ht_params_plan, ht_model_activation_bytes) are known first;
 * ht_model_allocate then gives the params storage and their values from
 * `seed` (ht_model_build_parallel's), or, `pretrained`, the LoRA adapters
 * theirs and every other param zeros: values a caller loads over them
 * (ht_hf_load_weights, which refuses a folder missing any), not drawn to be
 * overwritten. */
ht_status ht_model_declare(const ht_model_config *cfg, ht_dtype dtype, const ht_model_placement *at, ht_model **out,
                           ht_error *err);
ht_status ht_model_allocate(ht_model *m, const ht_model_placement *at, uint64_t seed, bool pretrained, ht_error *err);
/* Model FLOPs of one training token (forward and backward) at sequence
 * length T, counted the standard way: 6 per weight of every matmul (the LM
 * head included, the embedding lookup not) plus attention's two products,
 * 6 x L x T x heads x head_dim, the causal half only (the half computed; MLA:
 * the mean of its q/k and v head dims for head_dim). */
double ht_model_flops_per_token(const ht_model_config *cfg, int T);
/* The bytes the activations of a (B, T) micro-batch take with matmul
 * operands stored in `compute` (the ops' activation_bytes): checked against
 * the machine's memory before the first forward allocates them. 0: the
 * model cannot tell; +inf: beyond 64 bits. */
double ht_model_activation_bytes(const ht_model *m, int B, int T, ht_dtype compute);
/* Comma-separated registered names, for error messages. */
const char *ht_model_registered_names(void);

static inline ht_status ht_model_forward(ht_model *m, const int32_t *inputs, const int32_t *targets, int B, int T,
                                         float *loss, ht_error *err) {
    return m->ops->forward(m, inputs, targets, B, T, loss, err);
}
static inline void ht_model_backward(ht_model *m, float scale) { m->ops->backward(m, scale); }
void ht_model_free(ht_model *m);
/* fsdp_config.mix_precision.param_dtype: every matmul operand (weights and
 * activations) carries `dtype` precision. Where the CPU has no native kernel
 * for it, operands are FP32 values rounded to it: the same numbers, on the
 * FP32 kernels, without widening on every GEMM. */
ht_status ht_model_set_compute(ht_model *m, ht_dtype dtype, ht_error *err);
/* The modules for a message, numbered runs folded:
 * "model.embed_tokens, model.layers.{0..3}, model.norm, lm_head". */
void ht_model_module_list(const ht_model *m, char *out, size_t cap);
/* model.recompute: the modules whose names match one of `patterns`
 * (ht_path_match: "model.layers.{*}") keep only their input in forward and
 * recompute the rest at the start of their backward, from the same weights
 * with the same kernels: the same gradients bit for bit, one more forward of
 * those modules, and their activations gone. count 0 turns it off. A pattern
 * that matches no module, or one matching a module that cannot recompute, is
 * an error naming the model's modules. Call it between steps, not between a
 * forward and its backward. */
ht_status ht_model_set_recompute(ht_model *m, const char *const *patterns, int count, ht_error *err);
/* Generation: a key/value cache of max_tokens positions (ht_model.cache_capacity
 * says how forward then runs), cache_tokens 0; max_tokens 0 frees it and
 * forward is the training forward again. An error for a model without one
 * (ht_model_ops.set_cache NULL), under tensor or context parallelism, or
 * beyond model.max_position_embeddings. */
ht_status ht_model_set_cache(ht_model *m, int64_t max_tokens, ht_error *err);
/* Starts a new window for attn_max_logit (every entry -Inf). */
void ht_model_reset_attn_max(ht_model *m);

/* ------------------------------------------------------------------ generation */

/* How each new token is chosen from its logits, in transformers' order:
 * temperature, then top-k, then top-p. */
typedef struct ht_sampling {
    double temperature; /* <= 0: greedy, the largest logit (the lowest id of equal ones, as torch.argmax) */
    int top_k;          /* keep the k largest logits (0: all) */
    double top_p;       /* then the fewest most likely tokens whose probabilities sum to >= top_p (0 or 1: all) */
    uint64_t seed;      /* of the draws (ht_rng) */
} ht_sampling;

/* One token from a row of V logits (host memory) by `s`, drawing from rng;
 * order (V) is scratch. */
int32_t ht_sample(const float *logits, int64_t V, const ht_sampling *s, ht_rng *rng, int32_t *order);

/* Called with each token as it is chosen and the logits it was chosen from
 * (V, host memory); false stops the generation after it. */
typedef bool (*ht_generate_fn)(void *ctx, int32_t token, const float *logits, int64_t V);

/* Continues `prompt` (n tokens) by up to max_new tokens on one process
 * through the model's key/value cache (ht_model_set_cache of n + max_new,
 * freed after): the prompt in one forward, then one forward per token, none
 * recomputed. Stops after a token of `stop` (stop_count of them; it is kept),
 * or when fn (NULL: none) returns false. out (max_new) gets the tokens,
 * *produced their count. The model computes as it is set (its dtype,
 * ht_model_set_compute). */
ht_status ht_generate(ht_model *m, const int32_t *prompt, int n, int max_new, const ht_sampling *s, const int32_t *stop,
                      int stop_count, ht_generate_fn fn, void *ctx, int32_t *out, int *produced, ht_error *err);

/* ------------------------------------------------------------------ LoRA */

/* scale = alpha / r, or alpha / sqrt(r) with use_rslora (PEFT's `scaling`). */
double ht_lora_scale(const ht_lora_config *c);
/* Whether a parameter name is an adapter's ("...q_proj.lora_A.weight"); 'A',
 * 'B' or 0. The module it adapts is the name without ".lora_A.weight". */
char ht_lora_kind(const char *param_name);
/* Whether target_modules entry `target` selects the module at `path`
 * (ht_lora_config.targets says how). */
bool ht_lora_target_matches(const char *target, const char *path);
/* Takes every param that is not an adapter out of training
 * (ht_params_freeze): LoRA trains the adapters alone. `frozen` (may be NULL)
 * gets the number of params it froze. An error when there is no adapter. */
ht_status ht_lora_freeze_base(ht_param_store *params, int *frozen, ht_error *err);
/* A store's params with every adapter folded into the weight it adapts:
 * W' = W + scale · B A, computed in FP32 (the merged weights are FP32 copies
 * in `out`'s own storage, the other params borrow `in`'s data), and no
 * lora_A / lora_B. `in` must hold whole tensors. Free `out` with
 * ht_params_free (it frees only what it owns). */
ht_status ht_lora_merge(const ht_param_store *in, double scale, ht_param_store *out, ht_error *err);
/* target_modules as PEFT's adapter_config.json should list them for the
 * adapters `params` holds: a bare name ("q_proj") where every module of
 * that name has an adapter, otherwise each adapted module's path; sorted.
 * *out is malloc'ed (free it); returns the count, -1 when out of memory. */
int ht_lora_target_names(const ht_param_store *params, char (**out)[HT_PARAM_NAME_MAX]);

/* ------------------------------------------------------------------ DeepSeekMoE's aux-loss-free balancing */

/* The sparse layers of cfg (their count: the rows of ht_model.expert_tokens). */
int ht_model_config_sparse_layers(const ht_model_config *cfg);
/* Whether cfg's param `name` is held in FP32 whatever the model dtype
 * (ht_param.keep_fp32): deepseek_v3's routers and correction biases, as
 * transformers' _keep_in_fp32_modules_strict keeps them, so that saves and
 * exports of a 16-bit model write them in FP32 as save_pretrained does. */
bool ht_model_config_keeps_fp32(const ht_model_config *cfg, const char *name);
/* Zeroes m->expert_tokens (nothing without it): the trainer, as each step starts. */
void ht_model_reset_expert_tokens(ht_model *m);
/* Megatron-Core's get_updated_expert_bias, once per global batch, on every
 * sparse layer: given `tokens` (sparse layers, E), the counts of the whole
 * batch (every rank's expert_tokens summed), each expert's
 * model.layers.N.mlp.gate.e_score_correction_bias moves by
 * rate · sign(mean − tokens_e) in FP32, mean = Σ_e tokens_e / E: the rows of
 * it this rank holds (its FP32 data is its main param and what forward
 * reads), so every layout of the same batch ends on the same bits. */
void ht_model_update_expert_bias(ht_model *m, const double *tokens, double rate);

#ifdef __cplusplus
}
#endif
#endif
