/* Decoder-only language models: the architecture config, the model registry
 * (name -> builder) and the model interface (forward, backward) over a named
 * parameter store. The built-ins are "qwen2" and "llama". */
#ifndef HYPERTRAIN_MODEL_H
#define HYPERTRAIN_MODEL_H

#include "hypertrain/base.h"
#include "hypertrain/param.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The architecture, with the field names and meaning of Hugging Face's config.json. */
typedef struct ht_model_config {
    char name[32]; /* registry name: "qwen2", "llama" */
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
} ht_model_config;

/* Checks the numbers hang together (heads divide, sizes positive); names the field. */
ht_status ht_model_config_validate(const ht_model_config *cfg, ht_error *err);
int ht_model_config_head_dim(const ht_model_config *cfg);

typedef struct ht_model ht_model;

/* Parameters a model may have, and elements any one tensor may have: 2^40
 * (1.1 trillion), past every dense model this engine could hold in memory.
 * ht_model_config_validate refuses a config beyond it, naming the sizes. */
#define HT_MODEL_MAX_PARAMS ((int64_t)1 << 40)

/* A module in the sense of Hugging Face's named_modules(), at the grain the
 * model runs them: "model.embed_tokens", "model.layers.3", "model.norm",
 * "lm_head". FSDP units are made of modules (dist.h). */
#define HT_MODULE_MAX_PARAMS 16
typedef struct ht_module {
    char name[HT_PARAM_NAME_MAX];
    int param_count;
    ht_param *params[HT_MODULE_MAX_PARAMS]; /* every param it reads (the tied lm_head reads the embedding) */
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
 * what happens in between is the hook's business (dist/ gathers shards). */
typedef struct ht_module_hook {
    void (*fn)(void *ctx, int module, ht_module_event event);
    void *ctx;
} ht_module_hook;

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
} ht_model_ops;

struct ht_model {
    const ht_model_ops *ops;
    ht_model_config config;
    ht_param_store params;
    float *logits;              /* (B, T, V) FP32, valid after forward; backward turns them into their gradient */
    ht_dtype output_dtype;      /* the precision the logits are rounded to (F32: none); F32 when built */
    ht_dtype compute_precision; /* the precision of every matmul operand (param_dtype); F32 when built */
    /* (L, H): the largest attention logit q·k/sqrt(D) of each head (over
     * batch and positions, before masking) since the last reset: QK-clip's S_h. */
    float *attn_max_logit;
    /* Whether forward keeps attn_max_logit (true when built). It costs the
     * scores above the diagonal, which causal attention otherwise skips: a
     * trainer without QK-clip turns it off. */
    bool track_attn_max;
    int B, T;                /* the shapes of the last forward */
    size_t activation_bytes; /* what forward keeps for backward, and backward's scratch, for (B, T) */
    ht_module *modules;      /* (module_count) in forward order */
    int module_count;
    ht_module_hook hook; /* fn NULL: none */
    void *impl;          /* the builder's own state */
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
/* Model FLOPs of one training token (forward and backward) at sequence
 * length T, counted the standard way: 6 per weight of every matmul (the LM
 * head included, the embedding lookup not) plus attention's two products,
 * 6 x L x T x heads x head_dim, the causal half only (the half computed). */
double ht_model_flops_per_token(const ht_model_config *cfg, int T);
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
/* Starts a new window for attn_max_logit (every entry -Inf). */
void ht_model_reset_attn_max(ht_model *m);

#ifdef __cplusplus
}
#endif
#endif
