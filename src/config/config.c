/* The config key table and everything driven by it: defaults, loading a YAML
 * file (libyaml's document API, for line numbers), --set overrides, source
 * tracking, formatting values, and the "Trainer config" log. A new key or a
 * dialect alias is one line in a table below. Cross-field rules: validate.c. */
#include "hypertrain/config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <yaml.h>

/* ---------------------------------------------------------------- the table */

typedef enum key_type {
    KT_INT,    /* int */
    KT_I64,    /* int64_t */
    KT_FLOAT,  /* double */
    KT_BOOL,   /* bool: true | false */
    KT_STR,    /* char[size] */
    KT_ENUM,   /* an int-sized enum, by name */
    KT_DTYPE,  /* ht_dtype: float16 | bfloat16 | float32 */
    KT_STRS,   /* ht_config_strings */
    KT_FLOATS, /* double[size / sizeof(double)] */
    KT_LAYERS, /* ht_layer_list: a list of layer indices */
    KT_NS,     /* ht_config_ns_coefficients */
    KT_SHARD,  /* int: auto (0) or a positive integer */
    KT_REJECT, /* a key some dialects know that is an error here */
} key_type;

#define NULLABLE 1u
#define AUTO_OK 2u /* KT_REJECT: null or -1 ("derive it") is accepted and changes nothing */

typedef struct enum_name {
    const char *name;
    int value;
    bool hidden; /* accepted, but not listed in "expected one of" */
} enum_name;

typedef struct key_desc {
    const char *path; /* dotted, canonical */
    key_type type;
    size_t offset, size;
    const char *def;        /* default, as YAML text (NULL for KT_REJECT) */
    const enum_name *names; /* KT_ENUM; KT_REJECT: names[0].name is the message */
    unsigned flags;
} key_desc;

static const enum_name OPTIMIZERS[] = {
    {"Muon", HT_CONFIG_OPTIMIZER_MUON, false},
    {"AdamW", HT_CONFIG_OPTIMIZER_ADAMW, false},
    {"adamw", HT_CONFIG_OPTIMIZER_ADAMW, true}, /* MindSpeed-MM's training.optimizer */
    {"muon", HT_CONFIG_OPTIMIZER_MUON, true},
    {"hyper_parallel.auto_models.components.optim.optimizer.optimizer.Muon", HT_CONFIG_OPTIMIZER_MUON, true},
    {"hyper_parallel.auto_models.components.optim.optimizer.optimizer.AdamW", HT_CONFIG_OPTIMIZER_ADAMW, true},
    {NULL, 0, false},
};
static const enum_name LR_SCHEDULES[] = {
    {"ConstantWarmUpLR", HT_CONFIG_LR_CONSTANT_WARMUP, false},
    {"LinearWithWarmUpLR", HT_CONFIG_LR_LINEAR_WARMUP, false},
    {"CosineWithWarmUpLR", HT_CONFIG_LR_COSINE_WARMUP, false},
    {"CosineWithRestartsAndWarmUpLR", HT_CONFIG_LR_COSINE_RESTARTS, false},
    {"PolynomialWithWarmUpLR", HT_CONFIG_LR_POLYNOMIAL_WARMUP, false},
    {"WarmUpStableDecayLR", HT_CONFIG_LR_WARMUP_STABLE_DECAY, false},
    {"CosineAnnealingLR", HT_CONFIG_LR_COSINE_ANNEALING, false},
    {"ConstantWithCoolDownLR", HT_CONFIG_LR_CONSTANT_COOLDOWN, false},
    {"CosineAnnealingWarmRestarts", HT_CONFIG_LR_COSINE_WARM_RESTARTS, false},
    {"LearningRateWiseLayer", HT_CONFIG_LR_WISE_LAYER, false},
    /* HyperParallel's get_hyper_lr_scheduler and MindSpeed-MM's (Megatron's)
     * lr_decay_style names: after warmup, "constant" holds the base lr,
     * "linear" falls linearly to 0 at the last step (theirs stops at min_lr,
     * 1e-7 by default), "cosine" is a half cosine from the base lr to lr_end
     * over floor(steps * decay_ratio) steps (their min_lr is lr_end here, and
     * their lr_decay_ratio decay_ratio): the values of the schedules named. */
    {"constant", HT_CONFIG_LR_CONSTANT_WARMUP, true},
    {"linear", HT_CONFIG_LR_LINEAR_WARMUP, true},
    {"cosine", HT_CONFIG_LR_COSINE_WARMUP, true},
    {NULL, 0, false},
};
static const enum_name NS_VARIANTS[] = {
    {"legacy", HT_CONFIG_NS_LEGACY, false},
    {"asym5", HT_CONFIG_NS_ASYM5, false},
    {"polar_express", HT_CONFIG_NS_POLAR_EXPRESS, false},
    {"deepseek_v4", HT_CONFIG_NS_DEEPSEEK_V4, false},
    {"custom", HT_CONFIG_NS_CUSTOM, false},
    {NULL, 0, false},
};
static const enum_name MOMENTUM_STYLES[] = {
    {"sum", HT_CONFIG_MOMENTUM_SUM, false},
    {"ema", HT_CONFIG_MOMENTUM_EMA, false},
    {NULL, 0, false},
};
static const enum_name MUON_COMMS[] = {
    {"allgather", HT_CONFIG_MUON_COMM_ALLGATHER, false},
    {"deredundancy", HT_CONFIG_MUON_COMM_DEREDUNDANCY, false},
    {"allgather_deredundency", HT_CONFIG_MUON_COMM_DEREDUNDANCY, false}, /* MindFormers' spelling */
    {NULL, 0, false},
};
static const enum_name LOSS_TYPES[] = {
    {"raw", HT_CONFIG_LOSS_RAW, false},
    {NULL, 0, false},
};
static const enum_name NS_DTYPES[] = {
    {"float32", HT_DTYPE_F32, false},
    {"bfloat16", HT_DTYPE_BF16, false},
    {NULL, 0, false},
};
static const enum_name GEMM_KERNELS[] = {
    {"auto", HT_GEMM_KERNEL_AUTO, false},
    {"native", HT_GEMM_KERNEL_NATIVE, false},
    {"widened", HT_GEMM_KERNEL_WIDENED, false},
    {"fp32_rounded", HT_GEMM_KERNEL_FP32_ROUNDED, false},
    {NULL, 0, false},
};
static const enum_name TOTAL_STEPS_MSG[] = {
    {"total steps come from training.steps; remove this key or leave it -1 (MindFormers: derived), and set "
     "training.steps instead",
     0, true},
    {NULL, 0, false},
};

#define F(field) offsetof(ht_config, field), sizeof(((ht_config *)0)->field)
#define INT(path, field, def)                                                                                          \
    { path, KT_INT, F(field), def, NULL, 0 }
#define INT_OR_NULL(path, field, def)                                                                                  \
    { path, KT_INT, F(field), def, NULL, NULLABLE }
#define I64(path, field, def)                                                                                          \
    { path, KT_I64, F(field), def, NULL, 0 }
#define FLT(path, field, def)                                                                                          \
    { path, KT_FLOAT, F(field), def, NULL, 0 }
#define BOOL(path, field, def)                                                                                         \
    { path, KT_BOOL, F(field), def, NULL, 0 }
#define STR(path, field, def)                                                                                          \
    { path, KT_STR, F(field), def, NULL, 0 }
#define STR_OR_NULL(path, field, def)                                                                                  \
    { path, KT_STR, F(field), def, NULL, NULLABLE }
#define ENUM(path, field, names, def)                                                                                  \
    { path, KT_ENUM, F(field), def, names, 0 }
#define DTYPE(path, field, def)                                                                                        \
    { path, KT_DTYPE, F(field), def, NULL, 0 }
#define DTYPE_OR_NULL(path, field, def)                                                                                \
    { path, KT_DTYPE, F(field), def, NULL, NULLABLE }
#define STRS(path, field, def)                                                                                         \
    { path, KT_STRS, F(field), def, NULL, 0 }
#define FLOATS(path, field, def)                                                                                       \
    { path, KT_FLOATS, F(field), def, NULL, 0 }
#define LAYERS(path, field, def)                                                                                       \
    { path, KT_LAYERS, F(field), def, NULL, 0 }
#define NS(path, field, def)                                                                                           \
    { path, KT_NS, F(field), def, NULL, 0 }
#define SHARD(path, field, def)                                                                                        \
    { path, KT_SHARD, F(field), def, NULL, 0 }
#define REJECT_BUT_AUTO(path, msg)                                                                                     \
    { path, KT_REJECT, 0, 0, NULL, msg, AUTO_OK }

/* Every key of docs/CONFIG.md, in the order the log prints them. */
static const key_desc KEYS[] = {
    STR("model.name", model.arch.name, "qwen2"),
    STR_OR_NULL("model.from_pretrained", model.from_pretrained, "null"),
    INT("model.vocab_size", model.arch.vocab_size, "256"),
    INT("model.hidden_size", model.arch.hidden_size, "256"),
    INT("model.intermediate_size", model.arch.intermediate_size, "688"),
    INT("model.num_hidden_layers", model.arch.num_hidden_layers, "4"),
    INT("model.num_attention_heads", model.arch.num_attention_heads, "8"),
    INT("model.num_key_value_heads", model.arch.num_key_value_heads, "2"),
    INT("model.head_dim", model.arch.head_dim, "0"),
    INT("model.max_position_embeddings", model.arch.max_position_embeddings, "512"),
    FLT("model.rope_theta", model.arch.rope_theta, "10000.0"),
    FLT("model.rms_norm_eps", model.arch.rms_norm_eps, "1.0e-6"),
    BOOL("model.attention_bias", model.arch.attention_bias, "true"),
    BOOL("model.tie_word_embeddings", model.arch.tie_word_embeddings, "false"),
    FLT("model.initializer_range", model.arch.initializer_range, "0.02"),
    INT("model.num_experts", model.arch.moe.num_experts, "0"),
    INT("model.num_experts_per_tok", model.arch.moe.num_experts_per_tok, "4"),
    INT("model.moe_intermediate_size", model.arch.moe.moe_intermediate_size, "1408"),
    INT("model.shared_expert_intermediate_size", model.arch.moe.shared_expert_intermediate_size, "5632"),
    BOOL("model.norm_topk_prob", model.arch.moe.norm_topk_prob, "false"),
    INT("model.decoder_sparse_step", model.arch.moe.decoder_sparse_step, "1"),
    LAYERS("model.mlp_only_layers", model.arch.moe.mlp_only_layers, "[]"),
    BOOL("model.output_router_logits", model.arch.moe.output_router_logits, "false"),
    FLT("model.router_aux_loss_coef", model.arch.moe.router_aux_loss_coef, "0.001"),
    STRS("model.freeze", model.freeze, "[]"),
    BOOL("model.trust_remote_code", model.trust_remote_code, "false"),
    ENUM("model.loss_type", model.loss_type, LOSS_TYPES, "raw"),
    BOOL("model.recompute", model.recompute, "false"),
    STRS("model.recompute_plan.apply_modules", model.recompute_modules, "[]"),
    INT("model.lora.rank", model.lora.rank, "0"),
    FLT("model.lora.alpha", model.lora.alpha, "8.0"),
    FLT("model.lora.dropout", model.lora.dropout, "0.0"),
    STRS("model.lora.target_modules", model.lora.target_modules, "[q_proj, v_proj]"),
    BOOL("model.lora.use_rslora", model.lora.use_rslora, "false"),
    BOOL("model.lora.use_muon", model.lora.use_muon, "false"),
    STR_OR_NULL("model.lora.from_pretrained", model.lora.from_pretrained, "null"),
    DTYPE_OR_NULL("model_init_dtype", model_init_dtype, "float32"),

    STR("data.dataset_type", data.dataset_type, "text_bytes"),
    STR("data.path", data.path, "\"\""),
    INT("data.seq_len", data.seq_len, "256"),
    FLT("data.valid_fraction", data.valid_fraction, "0.01"),
    BOOL("data.shuffle", data.shuffle, "true"),
    BOOL("data.drop_last", data.drop_last, "true"),
    INT("data.num_workers", data.num_workers, "0"),
    BOOL("data.pin_memory", data.pin_memory, "false"),
    STR("data.dataloader_mode", data.dataloader_mode, "sampler"),
    STR("data.sampler_type", data.sampler_type, "BaseRandomBatchSampler"),
    STR("data.collate", data.collate, "llm_pretrain"),
    STR_OR_NULL("data.tokenizer", data.tokenizer, "null"),
    STR_OR_NULL("data.dataset_dir", data.dataset_dir, "null"),
    STR_OR_NULL("data.dataset", data.dataset, "null"),

    INT("parallel.tensor_parallel_size", parallel.tensor_parallel_size, "1"),
    INT("parallel.ring_attention_size", parallel.ring_attention_size, "1"),
    INT("parallel.ulysses_parallel_size", parallel.ulysses_parallel_size, "1"),
    INT("parallel.expert_parallel_size", parallel.expert_parallel_size, "1"),
    STRS("parallel.ep_plan.apply_modules", parallel.ep_modules, "[]"),

    ENUM("optimizer._target_", optimizer.type, OPTIMIZERS, "Muon"),
    BOOL("optimizer.fp32_main_params", optimizer.fp32_main_params, "true"),
    FLT("optimizer.muon_config.muon_lr", optimizer.muon.lr, "0.02"),
    FLT("optimizer.muon_config.muon_weight_decay", optimizer.muon.weight_decay, "0.1"),
    FLT("optimizer.muon_config.muon_momentum", optimizer.muon.momentum, "0.95"),
    BOOL("optimizer.muon_config.muon_nesterov", optimizer.muon.nesterov, "true"),
    INT("optimizer.muon_config.muon_ns_steps", optimizer.muon.ns_steps, "5"),
    ENUM("optimizer.muon_config.muon_ns_variant", optimizer.muon.ns_variant, NS_VARIANTS, "asym5"),
    NS("optimizer.muon_config.muon_ns_coefficients", optimizer.muon.ns_coefficients, "null"),
    FLT("optimizer.muon_config.muon_ns_eps", optimizer.muon.ns_eps, "1.0e-7"),
    FLT("optimizer.muon_config.muon_matched_adamw_rms", optimizer.muon.matched_adamw_rms, "0.2"),
    ENUM("optimizer.muon_config.muon_momentum_style", optimizer.muon.momentum_style, MOMENTUM_STYLES, "sum"),
    ENUM("optimizer.muon_config.muon_comm_strategy", optimizer.muon.comm_strategy, MUON_COMMS, "allgather"),
    STRS("optimizer.muon_config.adamw_include", optimizer.muon.adamw_include, "[\"*embed*\", \"*lm_head*\"]"),
    BOOL("optimizer.muon_config.qk_clip_enabled", optimizer.muon.qk_clip_enabled, "false"),
    FLT("optimizer.muon_config.qk_clip_threshold", optimizer.muon.qk_clip_threshold, "100"),
    ENUM("optimizer.muon_config.muon_ns_dtype", optimizer.muon.ns_dtype, NS_DTYPES, "float32"),
    FLT("optimizer.adamw_config.adamw_lr", optimizer.adamw.lr, "0.001"),
    FLT("optimizer.adamw_config.adamw_weight_decay", optimizer.adamw.weight_decay, "0.01"),
    FLOATS("optimizer.adamw_config.adamw_betas", optimizer.adamw.betas, "[0.9, 0.999]"),
    FLT("optimizer.adamw_config.adamw_eps", optimizer.adamw.eps, "1.0e-8"),
    STRS("optimizer.adamw_config.no_weight_decay", optimizer.adamw.no_weight_decay,
         "[\"*bias*\", \"*norm*\", \"*ln_*\"]"),
    STRS("optimizer.adamw_config.weight_decay_include", optimizer.adamw.weight_decay_include, "[]"),
    STRS("optimizer.adamw_config.weight_decay_exclude", optimizer.adamw.weight_decay_exclude, "[]"),
    BOOL("optimizer.accumulate_allreduce_grads_in_fp32", optimizer.accumulate_allreduce_grads_in_fp32, "true"),
    BOOL("optimizer.use_fused_adamw", optimizer.use_fused_adamw, "false"),
    BOOL("optimizer.stochastic_rounding", optimizer.stochastic_rounding, "false"),

    ENUM("lr_scheduler.type", lr_scheduler.type, LR_SCHEDULES, "CosineWithWarmUpLR"),
    FLT("lr_scheduler.warmup_ratio", lr_scheduler.warmup_ratio, "0.0"),
    INT("lr_scheduler.warmup_steps", lr_scheduler.warmup_steps, "0"),
    FLT("lr_scheduler.warmup_lr_init", lr_scheduler.warmup_lr_init, "0.0"),
    FLT("lr_scheduler.lr_end", lr_scheduler.lr_end, "0.0"),
    FLT("lr_scheduler.num_cycles", lr_scheduler.num_cycles, "0.5"),
    INT("lr_scheduler.decay_steps", lr_scheduler.decay_steps, "0"),
    FLT("lr_scheduler.decay_ratio", lr_scheduler.decay_ratio, "0.0"),
    FLT("lr_scheduler.power", lr_scheduler.power, "1.0"),
    INT("lr_scheduler.decay_start_steps", lr_scheduler.decay_start_steps, "0"),
    FLT("lr_scheduler.decay_start_ratio", lr_scheduler.decay_start_ratio, "0.8"),
    FLT("lr_scheduler.eta_min", lr_scheduler.eta_min, "0.0"),
    INT("lr_scheduler.t_max", lr_scheduler.t_max, "0"),
    INT("lr_scheduler.keep_steps", lr_scheduler.keep_steps, "0"),
    FLT("lr_scheduler.lr_end1", lr_scheduler.lr_end1, "0.0"),
    INT("lr_scheduler.final_steps", lr_scheduler.final_steps, "0"),
    FLT("lr_scheduler.lr_end2", lr_scheduler.lr_end2, "0.0"),
    INT("lr_scheduler.t_0", lr_scheduler.t_0, "0"),
    INT("lr_scheduler.t_mult", lr_scheduler.t_mult, "1"),
    REJECT_BUT_AUTO("lr_scheduler.total_steps", TOTAL_STEPS_MSG),

    INT("training.steps", training.steps, "1000"),
    INT("training.local_batch_size", training.local_batch_size, "8"),
    INT("training.global_batch_size", training.global_batch_size, "32"),
    FLT("training.max_norm", training.max_norm, "1.0"),
    FLT("training.gradient_scaling_factor", training.gradient_scaling_factor, "1.0"),
    I64("training.seed", training.seed, "42"),
    BOOL("training.deterministic", training.deterministic, "false"),
    BOOL("training.dump_state", training.dump_state, "false"),
    BOOL("training.init_model_with_meta_device", training.init_model_with_meta_device, "true"),
    INT_OR_NULL("training.gradient_accumulation_steps", training.gradient_accumulation_steps, "null"),
    BOOL("training.no_save_rng", training.no_save_rng, "false"),
    BOOL("training.no_load_rng", training.no_load_rng, "false"),
    BOOL("training.load_strict", training.load_strict, "true"),
    STR_OR_NULL("training.save", training.save, "null"),
    BOOL("tools.profile.enable", training.profile, "false"),
    BOOL("tools.memory_profile.enable", training.memory_profile, "false"),
    FLT("training.distributed_timeout_minutes", training.distributed_timeout_minutes, "10"),
    INT("training.log_interval", training.log_interval, "10"),
    INT("training.eval_interval", training.eval_interval, "100"),
    INT("training.eval_batches", training.eval_batches, "20"),
    STRS("training.plugin", training.plugin, "[]"),
    FLT("training.loss_scale_initial", training.loss_scale_initial, "65536.0"),
    INT("training.loss_scale_growth_interval", training.loss_scale_growth_interval, "1000"),
    FLT("training.loss_scale_growth_factor", training.loss_scale_growth_factor, "2.0"),
    FLT("training.loss_scale_backoff_factor", training.loss_scale_backoff_factor, "0.5"),
    INT("training.loss_scale_hysteresis", training.loss_scale_hysteresis, "2"),
    FLT("training.loss_scale_min", training.loss_scale_min, "1.0"),

    SHARD("fsdp_config.shard_size", fsdp.shard_size, "auto"),
    STRS("fsdp_config.apply_modules", fsdp.apply_modules, "[\"model.embed_tokens\", \"model.layers.{*}\"]"),
    STRS("fsdp_config.hook_modules", fsdp.hook_modules, "[]"),
    BOOL("fsdp_config.reshard_after_forward", fsdp.reshard_after_forward, "true"),
    BOOL("fsdp_config.prefetch", fsdp.prefetch, "true"),
    DTYPE("fsdp_config.mix_precision.param_dtype", fsdp.param_dtype, "bfloat16"),
    DTYPE_OR_NULL("fsdp_config.mix_precision.reduce_dtype", fsdp.reduce_dtype, "float32"),
    DTYPE("fsdp_config.mix_precision.output_dtype", fsdp.output_dtype, "bfloat16"),
    BOOL("fsdp_config.mix_precision.cast_forward_inputs", fsdp.cast_forward_inputs, "true"),

    ENUM("kernels.bf16_gemm", kernels.bf16_gemm, GEMM_KERNELS, "auto"),
    ENUM("kernels.f16_gemm", kernels.f16_gemm, GEMM_KERNELS, "auto"),
    INT("kernels.lm_head_chunk_mib", kernels.lm_head_chunk_mib, "64"),

    STR("checkpoint.output_dir", checkpoint.output_dir, "runs/default"),
    INT("checkpoint.save_interval", checkpoint.save_interval, "500"),
    BOOL("checkpoint.save_optimizer", checkpoint.save_optimizer, "true"),
    INT("checkpoint.keep_last", checkpoint.keep_last, "3"),
    STR_OR_NULL("checkpoint.restore_from", checkpoint.restore_from, "null"),
    BOOL("checkpoint.restore_optimizer", checkpoint.restore_optimizer, "true"),
    BOOL("checkpoint.overwrite", checkpoint.overwrite, "false"),
};
#define N_KEYS ((int)(sizeof(KEYS) / sizeof(KEYS[0])))
_Static_assert(sizeof(KEYS) / sizeof(KEYS[0]) <= HT_CONFIG_MAX_KEYS, "raise HT_CONFIG_MAX_KEYS");
_Static_assert(sizeof(ht_config_optimizer) == sizeof(int) && sizeof(ht_dtype) == sizeof(int) &&
                   sizeof(ht_gemm_kernel) == sizeof(int),
               "enums are stored as int");

/* Other dialects' names for keys (docs/CONFIG.md, Compatibility). An alias is
 * another spelling of one key (`key`: both spellings in one source are a
 * duplicate), and/or one value shared by several keys (`shared`, `implies`):
 * those are weak, so a key set by its own name in the same source (file, or
 * command line) wins over them whatever the order, and a higher source wins
 * over both. */
/* When an alias applies: one name may mean different keys in different blocks. */
typedef enum alias_when {
    WHEN_ALWAYS = 0,
    WHEN_MINDFORMERS_MUON,     /* a MindFormers optimizer block of type Muon */
    WHEN_NOT_MINDFORMERS_MUON, /* any other */
} alias_when;

typedef struct key_alias {
    const char *alias;
    const char *key;       /* the key this is another spelling of, or NULL */
    const char *shared[2]; /* keys that take this one value (weakly) */
    const char *implies;   /* "key=value" also set (weakly) when the value is not null */
    alias_when when;
    bool negated; /* a bool key set to the opposite of the alias's value (no_save_optim: save_optimizer) */
} key_alias;

#define RENAME(alias, key)                                                                                             \
    { alias, key, {NULL, NULL}, NULL, WHEN_ALWAYS, false }
#define RENAME_WHEN(alias, key, when)                                                                                  \
    { alias, key, {NULL, NULL}, NULL, when, false }
#define SHARED(alias, key1, key2)                                                                                      \
    { alias, NULL, {key1, key2}, NULL, WHEN_ALWAYS, false }
#define RENAME_IMPLYING(alias, key, implied)                                                                           \
    { alias, key, {NULL, NULL}, implied, WHEN_ALWAYS, false }
#define NEGATED(alias, key)                                                                                            \
    { alias, key, {NULL, NULL}, NULL, WHEN_ALWAYS, true }

static const key_alias ALIASES[] = {
    /* MindFormers: one learning rate and one weight decay drive Muon and AdamW
     * alike (Muon's step is scaled by matched_adamw_rms to match AdamW's). */
    SHARED("lr_scheduler.learning_rate", "optimizer.muon_config.muon_lr", "optimizer.adamw_config.adamw_lr"),
    /* MindFormers' CosineAnnealingLR (and CosineAnnealingWarmRestarts) name it base_lr; both in one file is an error.
     */
    SHARED("lr_scheduler.base_lr", "optimizer.muon_config.muon_lr", "optimizer.adamw_config.adamw_lr"),
    SHARED("optimizer.weight_decay", "optimizer.muon_config.muon_weight_decay",
           "optimizer.adamw_config.adamw_weight_decay"),
    /* MindFormers has no variant key: coefficients given mean a custom schedule. */
    RENAME_IMPLYING("optimizer.ns_coefficients", "optimizer.muon_config.muon_ns_coefficients",
                    "optimizer.muon_config.muon_ns_variant=custom"),
    /* MindFormers optimizer: a flat block. betas and eps are AdamW's, except
     * that a Muon block's eps is its Newton-Schulz normalization epsilon
     * (its AdamW part has adamw_betas and adamw_eps). */
    RENAME("optimizer.type", "optimizer._target_"),
    RENAME("optimizer.betas", "optimizer.adamw_config.adamw_betas"),
    RENAME_WHEN("optimizer.eps", "optimizer.muon_config.muon_ns_eps", WHEN_MINDFORMERS_MUON),
    RENAME_WHEN("optimizer.eps", "optimizer.adamw_config.adamw_eps", WHEN_NOT_MINDFORMERS_MUON),
    RENAME("optimizer.weight_decay_include", "optimizer.adamw_config.weight_decay_include"),
    RENAME("optimizer.weight_decay_exclude", "optimizer.adamw_config.weight_decay_exclude"),
    RENAME("optimizer.momentum", "optimizer.muon_config.muon_momentum"),
    RENAME("optimizer.nesterov", "optimizer.muon_config.muon_nesterov"),
    RENAME("optimizer.ns_steps", "optimizer.muon_config.muon_ns_steps"),
    RENAME("optimizer.matched_adamw_rms", "optimizer.muon_config.muon_matched_adamw_rms"),
    RENAME("optimizer.adamw_betas", "optimizer.adamw_config.adamw_betas"),
    RENAME("optimizer.adamw_eps", "optimizer.adamw_config.adamw_eps"),
    RENAME("optimizer.qk_clip_enabled", "optimizer.muon_config.qk_clip_enabled"),
    RENAME("optimizer.qk_clip_threshold", "optimizer.muon_config.qk_clip_threshold"),
    RENAME("optimizer.comm_strategy", "optimizer.muon_config.muon_comm_strategy"),
    RENAME("optimizer.adamw_include", "optimizer.muon_config.adamw_include"),
    /* MindFormers: top-level seed, runner_config's per-device micro-batch. */
    RENAME("seed", "training.seed"),
    RENAME("runner_config.batch_size", "training.local_batch_size"),
    /* HyperParallel AutoModels' training section. */
    RENAME("training.max_steps", "training.steps"),
    RENAME("training.micro_batch_size", "training.local_batch_size"),
    RENAME("training.max_grad_norm", "training.max_norm"),
    /* MindSpeed-MM's parallel section: the FSDP shard group size (auto: the world). */
    RENAME("parallel.fully_shard_parallel_size", "fsdp_config.shard_size"),
    RENAME("parallel.fsdp_plan.apply_modules", "fsdp_config.apply_modules"),
    /* The rest of MindSpeed-MM's plugin FSDP2 trainer YAML (docs/DIALECTS.md). */
    RENAME("parallel.fsdp_plan.hook_modules", "fsdp_config.hook_modules"),
    RENAME("parallel.fsdp_plan.param_dtype", "fsdp_config.mix_precision.param_dtype"),
    RENAME("parallel.fsdp_plan.reduce_dtype", "fsdp_config.mix_precision.reduce_dtype"),
    RENAME("data.dataset_param.dataset_type", "data.dataset_type"),
    RENAME("data.dataset_param.preprocess_parameters.model_name_or_path", "data.tokenizer"),
    RENAME("data.dataset_param.basic_parameters.dataset_dir", "data.dataset_dir"),
    RENAME("data.dataset_param.basic_parameters.dataset", "data.dataset"),
    RENAME("data.dataloader_param.shuffle", "data.shuffle"),
    RENAME("data.dataloader_param.drop_last", "data.drop_last"),
    RENAME("data.dataloader_param.num_workers", "data.num_workers"),
    RENAME("data.dataloader_param.pin_memory", "data.pin_memory"),
    RENAME("data.dataloader_param.dataloader_mode", "data.dataloader_mode"),
    RENAME("data.dataloader_param.sampler_type", "data.sampler_type"),
    RENAME("data.dataloader_param.collate_param.model_name", "data.collate"),
    RENAME("model.model_id", "model.name"),
    RENAME("model.model_name_or_path", "model.from_pretrained"),
    RENAME("model.loss_cfg.loss_type", "model.loss_type"),
    /* PEFT's LoraConfig field names. */
    RENAME("model.lora.r", "model.lora.rank"),
    RENAME("model.lora.lora_alpha", "model.lora.alpha"),
    RENAME("model.lora.lora_dropout", "model.lora.dropout"),
    SHARED("training.lr", "optimizer.muon_config.muon_lr", "optimizer.adamw_config.adamw_lr"),
    SHARED("training.weight_decay", "optimizer.muon_config.muon_weight_decay",
           "optimizer.adamw_config.adamw_weight_decay"),
    RENAME("training.lr_decay_style", "lr_scheduler.type"),
    RENAME("training.lr_warmup_ratio", "lr_scheduler.warmup_ratio"),
    RENAME("training.train_iters", "training.steps"),
    RENAME("training.clip_grad", "training.max_norm"),
    RENAME("training.optimizer", "optimizer._target_"),
    RENAME("training.adam_fused", "optimizer.use_fused_adamw"),
    RENAME("training.save_interval", "checkpoint.save_interval"),
    RENAME("training.load", "checkpoint.restore_from"),
    NEGATED("training.no_save_optim", "checkpoint.save_optimizer"),
    NEGATED("training.no_load_optim", "checkpoint.restore_optimizer"),
    RENAME("training.use_deter_comp", "training.deterministic"),
};
#define N_ALIASES ((int)(sizeof(ALIASES) / sizeof(ALIASES[0])))
_Static_assert(sizeof(ALIASES) / sizeof(ALIASES[0]) < 255, "ht_config.alias is a uint8_t");

/* Another dialect's name for a whole section. */
static const struct {
    const char *alias, *section;
} SECTION_ALIASES[] = {
    {"lr_schedule", "lr_scheduler"}, /* MindFormers */
};
#define N_SECTION_ALIASES ((int)(sizeof(SECTION_ALIASES) / sizeof(SECTION_ALIASES[0])))

/* `path` with a section alias at its front replaced by the section ("lr_schedule.type" -> "lr_scheduler.type"). */
static const char *canonical_path(const char *path, char *buf, size_t n) {
    for (int s = 0; s < N_SECTION_ALIASES; s++) {
        size_t len = strlen(SECTION_ALIASES[s].alias);
        if (strncmp(path, SECTION_ALIASES[s].alias, len) == 0 && (path[len] == '.' || path[len] == '\0')) {
            int w = snprintf(buf, n, "%s%s", SECTION_ALIASES[s].section, path + len);
            return w >= 0 && (size_t)w < n ? buf : path; /* too long to be a key either way */
        }
    }
    return path;
}

static int key_index_exact(const char *path) {
    for (int i = 0; i < N_KEYS; i++)
        if (strcmp(KEYS[i].path, path) == 0) return i;
    return -1;
}

static bool alias_applies(const key_alias *A, const ht_config *cfg) {
    if (!cfg || A->when == WHEN_ALWAYS) return true;
    bool mf_muon = cfg->dialect == HT_CONFIG_DIALECT_MINDFORMERS && cfg->optimizer.type == HT_CONFIG_OPTIMIZER_MUON;
    return A->when == WHEN_MINDFORMERS_MUON ? mf_muon : !mf_muon;
}

/* The alias `path` names in cfg's dialect and block (cfg NULL: its first meaning); -1 if none. */
static int alias_index_in(const ht_config *cfg, const char *path) {
    char buf[256];
    path = canonical_path(path, buf, sizeof(buf));
    for (int a = 0; a < N_ALIASES; a++)
        if (strcmp(ALIASES[a].alias, path) == 0 && alias_applies(&ALIASES[a], cfg)) return a;
    return -1;
}

static int alias_index(const char *path) { return alias_index_in(NULL, path); }

int ht_config_key_index(const char *key) {
    char buf[256];
    int i = key_index_exact(canonical_path(key, buf, sizeof(buf)));
    if (i >= 0) return i;
    int a = alias_index(key);
    return a >= 0 && ALIASES[a].key ? key_index_exact(ALIASES[a].key) : -1;
}

/* Whether key i's current value was set by its own name or an alias that is another spelling of it (not weakly). */
static bool set_by_own_name(const ht_config *cfg, int i) {
    int a = cfg->alias[i] - 1;
    return a < 0 || (ALIASES[a].key && strcmp(ALIASES[a].key, KEYS[i].path) == 0);
}

const char *ht_config_key_spelling(const ht_config *cfg, const char *key) {
    int i = ht_config_key_index(key);
    if (i < 0) return NULL;
    return cfg->alias[i] ? ALIASES[cfg->alias[i] - 1].alias : KEYS[i].path;
}

int ht_config_key_count(void) { return N_KEYS; }

const char *ht_config_key_name(int index) { return index >= 0 && index < N_KEYS ? KEYS[index].path : NULL; }

static bool has_prefix_dot(const char *s, const char *prefix) {
    size_t n = strlen(prefix);
    return strncmp(s, prefix, n) == 0 && s[n] == '.';
}

/* A section is a proper dotted prefix of some key ("optimizer", "optimizer.muon_config"). */
static bool is_section(const char *path) {
    char buf[256];
    path = canonical_path(path, buf, sizeof(buf));
    for (int i = 0; i < N_KEYS; i++)
        if (has_prefix_dot(KEYS[i].path, path)) return true;
    for (int a = 0; a < N_ALIASES; a++)
        if (has_prefix_dot(ALIASES[a].alias, path)) return true;
    return false;
}

/* ---------------------------------------------------------------- messages */

/* Where a value came from, for the front of a message: "f.yaml:12: " or "--set k=v: ". */
typedef struct origin {
    const char *file;    /* the file, or NULL */
    const char *set_arg; /* the --set argument, or NULL */
    ht_config_source source;
} origin;

static void origin_prefix(const origin *o, int line, char *buf, size_t n) {
    if (o->set_arg)
        snprintf(buf, n, "--set %s: ", o->set_arg);
    else if (o->file && line > 0)
        snprintf(buf, n, "%s:%d: ", o->file, line);
    else if (o->file)
        snprintf(buf, n, "%s: ", o->file);
    else
        snprintf(buf, n, "default: ");
}

static int node_line(const yaml_node_t *node) { return (int)node->start_mark.line + 1; }

typedef enum scalar_kind { SC_NULL, SC_BOOL, SC_INT, SC_FLOAT, SC_STR } scalar_kind;

static const char *scalar_text(const yaml_node_t *node) { return (const char *)node->data.scalar.value; }

static bool all_digits(const char *s) {
    if (!*s) return false;
    for (; *s; s++)
        if (*s < '0' || *s > '9') return false;
    return true;
}

/* YAML core-schema resolution of a scalar (quoted scalars are always strings;
 * of the YAML 1.1 booleans only true/false count, so `yes` stays a string). */
static scalar_kind classify(const yaml_node_t *node, long long *iv, double *dv, bool *bv) {
    const char *s = scalar_text(node);
    if (node->data.scalar.style != YAML_PLAIN_SCALAR_STYLE) return SC_STR;
    if (!*s || !strcmp(s, "~") || !strcmp(s, "null") || !strcmp(s, "Null") || !strcmp(s, "NULL")) return SC_NULL;
    if (!strcmp(s, "true") || !strcmp(s, "True") || !strcmp(s, "TRUE")) return *bv = true, SC_BOOL;
    if (!strcmp(s, "false") || !strcmp(s, "False") || !strcmp(s, "FALSE")) return *bv = false, SC_BOOL;
    const char *body = (*s == '-' || *s == '+') ? s + 1 : s;
    if (all_digits(body)) {
        errno = 0;
        *iv = strtoll(s, NULL, 10);
        *dv = strtod(s, NULL);
        return errno == ERANGE ? SC_FLOAT : SC_INT;
    }
    if (!strcmp(body, ".inf") || !strcmp(body, ".Inf") || !strcmp(body, ".INF")) {
        *dv = *s == '-' ? -INFINITY : INFINITY;
        return SC_FLOAT;
    }
    if (!strcmp(s, ".nan") || !strcmp(s, ".NaN") || !strcmp(s, ".NAN")) return *dv = NAN, SC_FLOAT;
    bool digit = false;
    for (const char *p = body; *p; p++) {
        if (*p >= '0' && *p <= '9')
            digit = true;
        else if (!strchr(".eE+-", *p))
            return SC_STR;
    }
    if (!digit) return SC_STR;
    char *end;
    *dv = strtod(s, &end);
    return *end == '\0' ? SC_FLOAT : SC_STR;
}

/* What a node is, for "found ...": `1.5 (a float)`, `"ten" (a string)`, `a sequence`. */
static void describe(const yaml_node_t *node, char *buf, size_t n) {
    if (node->type == YAML_MAPPING_NODE) {
        snprintf(buf, n, "a mapping");
        return;
    }
    if (node->type == YAML_SEQUENCE_NODE) {
        snprintf(buf, n, "a sequence");
        return;
    }
    long long iv;
    double dv;
    bool bv;
    const char *s = scalar_text(node);
    int w = strlen(s) > 80 ? 77 : 80;
    const char *dots = strlen(s) > 80 ? "..." : "";
    switch (classify(node, &iv, &dv, &bv)) {
    case SC_NULL: snprintf(buf, n, "null"); break;
    case SC_BOOL: snprintf(buf, n, "%s (a bool)", s); break;
    case SC_INT: snprintf(buf, n, "%s (an integer)", s); break;
    case SC_FLOAT: snprintf(buf, n, "%s (a float)", s); break;
    case SC_STR: snprintf(buf, n, "\"%.*s%s\" (a string)", w, s, dots); break;
    }
}

static void expected_enum(const enum_name *names, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "one of");
    const char *sep = " ";
    for (const enum_name *e = names; e->name && used < n; e++) {
        if (e->hidden) continue;
        used += (size_t)snprintf(buf + used, n - used, "%s%s", sep, e->name);
        sep = ", ";
    }
}

static void expected(const key_desc *k, char *buf, size_t n) {
    const char *or_null = (k->flags & NULLABLE) ? " or null" : "";
    switch (k->type) {
    case KT_INT:
    case KT_I64: snprintf(buf, n, "an integer%s", or_null); break;
    case KT_FLOAT: snprintf(buf, n, "a finite number"); break;
    case KT_BOOL: snprintf(buf, n, "true or false"); break;
    case KT_STR: snprintf(buf, n, "a string of at most %zu bytes%s", k->size - 1, or_null); break;
    case KT_ENUM: expected_enum(k->names, buf, n); break;
    case KT_DTYPE:
        snprintf(buf, n, "one of float16, bfloat16, float32%s", (k->flags & NULLABLE) ? ", null" : "");
        break;
    case KT_STRS:
        snprintf(buf, n, "a list of at most %d strings of at most %d bytes", HT_CONFIG_LIST_MAX, HT_CONFIG_STR_MAX - 1);
        break;
    case KT_FLOATS: snprintf(buf, n, "a list of %zu numbers", k->size / sizeof(double)); break;
    case KT_LAYERS: snprintf(buf, n, "a list of at most %d layer indices (integers >= 0)", HT_LAYER_LIST_MAX); break;
    case KT_NS:
        snprintf(buf, n, "null, [a, b, c], [[a, b, c], ...] or [[[a, b, c], count], ...] (at most %d entries)",
                 HT_CONFIG_NS_MAX);
        break;
    case KT_SHARD: snprintf(buf, n, "auto or a positive integer"); break;
    case KT_REJECT: snprintf(buf, n, "nothing: %s", k->names[0].name); break;
    }
}

/* `why`: what is wrong with a value of the right form ("" when the form is wrong). */
static ht_status type_error(const key_desc *k, const origin *o, int line, const yaml_node_t *node, const char *why,
                            ht_error *err) {
    char where[HT_CONFIG_STR_MAX + 64], want[512], found[160];
    origin_prefix(o, line, where, sizeof(where));
    expected(k, want, sizeof(want));
    describe(node, found, sizeof(found));
    if (k->type == KT_REJECT) return ht_fail(err, HT_ERR_CONFIG, "%s%s: %s", where, k->path, k->names[0].name);
    if (why && why[0]) return ht_fail(err, HT_ERR_CONFIG, "%s%s: %s", where, k->path, why);
    return ht_fail(err, HT_ERR_CONFIG, "%s%s: expected %s, found %s", where, k->path, want, found);
}

/* ---------------------------------------------------------------- values */

static bool node_number(const yaml_node_t *node, double *out) {
    long long iv;
    double dv;
    bool bv;
    if (node->type != YAML_SCALAR_NODE) return false;
    scalar_kind kind = classify(node, &iv, &dv, &bv);
    if (kind != SC_INT && kind != SC_FLOAT) return false;
    *out = dv;
    return isfinite(dv);
}

static bool node_int(const yaml_node_t *node, long long lo, long long hi, long long *out) {
    long long iv;
    double dv;
    bool bv;
    if (node->type != YAML_SCALAR_NODE || classify(node, &iv, &dv, &bv) != SC_INT) return false;
    if (iv < lo || iv > hi) return false;
    *out = iv;
    return true;
}

static bool node_string(const yaml_node_t *node, char *dst, size_t size) {
    long long iv;
    double dv;
    bool bv;
    if (node->type != YAML_SCALAR_NODE || classify(node, &iv, &dv, &bv) == SC_NULL) return false;
    if (node->data.scalar.length >= size) return false;
    memcpy(dst, scalar_text(node), node->data.scalar.length + 1);
    return true;
}

static bool node_is_null(const yaml_node_t *node) {
    long long iv;
    double dv;
    bool bv;
    return node->type == YAML_SCALAR_NODE && classify(node, &iv, &dv, &bv) == SC_NULL;
}

static int seq_len(const yaml_node_t *node) {
    return (int)(node->data.sequence.items.top - node->data.sequence.items.start);
}

static yaml_node_t *seq_item(yaml_document_t *doc, const yaml_node_t *node, int i) {
    return yaml_document_get_node(doc, node->data.sequence.items.start[i]);
}

/* A sequence of exactly 3 finite numbers. */
static bool node_triple(yaml_document_t *doc, const yaml_node_t *node, double abc[3]) {
    if (node->type != YAML_SEQUENCE_NODE || seq_len(node) != 3) return false;
    for (int i = 0; i < 3; i++)
        if (!node_number(seq_item(doc, node, i), &abc[i])) return false;
    return true;
}

/* A Newton-Schulz schedule: null, [a, b, c], [[a, b, c], ...] or
 * [[[a, b, c], n], ...]. When the form is right but a value is not, `why`
 * says which (a non-finite coefficient, a count out of range). */
static bool node_ns(yaml_document_t *doc, const yaml_node_t *node, ht_config_ns_coefficients *ns, char *why,
                    size_t why_size) {
    memset(ns, 0, sizeof(*ns));
    if (node_is_null(node)) return true;
    if (node_triple(doc, node, ns->abc[0])) {
        ns->count = 1;
        ns->repeat[0] = 0;
        return true;
    }
    if (node->type != YAML_SEQUENCE_NODE || seq_len(node) == 0) return false;
    if (seq_len(node) > HT_CONFIG_NS_MAX) {
        snprintf(why, why_size, "%d segments; at most %d", seq_len(node), HT_CONFIG_NS_MAX);
        return false;
    }
    for (int i = 0; i < seq_len(node); i++) {
        yaml_node_t *item = seq_item(doc, node, i);
        long long count;
        bool pair = item->type == YAML_SEQUENCE_NODE && seq_len(item) == 2;
        yaml_node_t *abc = pair ? seq_item(doc, item, 0) : item;
        if (abc->type == YAML_SEQUENCE_NODE && seq_len(abc) == 3 && !node_triple(doc, abc, ns->abc[i])) {
            snprintf(why, why_size, "segment %d: every coefficient must be a finite number", i);
            return false;
        }
        if (!pair && node_triple(doc, item, ns->abc[i])) {
            ns->repeat[i] = 1;
        } else if (pair && node_triple(doc, abc, ns->abc[i])) {
            yaml_node_t *n = seq_item(doc, item, 1);
            if (!node_int(n, LLONG_MIN, LLONG_MAX, &count)) return false;
            if (count < 1 || count > HT_CONFIG_NS_MAX_REPEAT) {
                snprintf(why, why_size, "segment %d repeats %lld times; expected 1 to %d", i, count,
                         HT_CONFIG_NS_MAX_REPEAT);
                return false;
            }
            ns->repeat[i] = (int)count;
        } else {
            return false;
        }
    }
    ns->count = seq_len(node);
    return true;
}

/* Converts `node` to key k's type into dst (k->size bytes); false on a type mismatch. */
static bool convert(const key_desc *k, yaml_document_t *doc, const yaml_node_t *node, void *dst, char *why,
                    size_t why_size) {
    why[0] = '\0';
    long long iv;
    double dv;
    bool bv;
    switch (k->type) {
    case KT_INT:
        if ((k->flags & NULLABLE) &&
            node_is_null(node)) { /* null: not given, which the key's reader says how to fill */
            *(int *)dst = 0;
            return true;
        }
        if (!node_int(node, INT_MIN, INT_MAX, &iv)) return false;
        *(int *)dst = (int)iv;
        return true;
    case KT_I64:
        if (!node_int(node, INT64_MIN, INT64_MAX, &iv)) return false;
        *(int64_t *)dst = (int64_t)iv;
        return true;
    case KT_FLOAT: return node_number(node, (double *)dst);
    case KT_BOOL:
        if (node->type != YAML_SCALAR_NODE || classify(node, &iv, &dv, &bv) != SC_BOOL) return false;
        *(bool *)dst = bv;
        return true;
    case KT_STR:
        if ((k->flags & NULLABLE) && node_is_null(node)) {
            ((char *)dst)[0] = '\0';
            return true;
        }
        return node_string(node, dst, k->size);
    case KT_ENUM:
        if (node->type != YAML_SCALAR_NODE) return false;
        for (const enum_name *e = k->names; e->name; e++) {
            if (strcmp(e->name, scalar_text(node)) == 0) {
                memcpy(dst, &e->value, sizeof(int));
                return true;
            }
        }
        return false;
    case KT_DTYPE: {
        ht_dtype dt;
        if ((k->flags & NULLABLE) && node_is_null(node)) {
            dt = HT_CONFIG_DTYPE_NONE;
        } else {
            /* MindSpeed-MM spells them short. */
            static const struct {
                const char *name;
                ht_dtype dtype;
            } short_names[] = {{"bf16", HT_DTYPE_BF16}, {"fp16", HT_DTYPE_F16}, {"fp32", HT_DTYPE_F32}};
            bool known = false;
            for (size_t s = 0; node->type == YAML_SCALAR_NODE && s < sizeof(short_names) / sizeof(short_names[0]); s++)
                if (strcmp(scalar_text(node), short_names[s].name) == 0) {
                    dt = short_names[s].dtype;
                    known = true;
                }
            if (!known && (node->type != YAML_SCALAR_NODE || !ht_dtype_from_name(scalar_text(node), &dt))) return false;
            if (dt != HT_DTYPE_F32 && dt != HT_DTYPE_BF16 && dt != HT_DTYPE_F16) return false;
        }
        memcpy(dst, &dt, sizeof(dt));
        return true;
    }
    case KT_STRS: {
        ht_config_strings *list = dst;
        list->count = 0;
        if (node_is_null(node)) return true;
        if (node->type != YAML_SEQUENCE_NODE || seq_len(node) > HT_CONFIG_LIST_MAX) return false;
        for (int i = 0; i < seq_len(node); i++)
            if (!node_string(seq_item(doc, node, i), list->items[i], HT_CONFIG_STR_MAX)) return false;
        list->count = seq_len(node);
        return true;
    }
    case KT_FLOATS: {
        int n = (int)(k->size / sizeof(double));
        if (node->type != YAML_SEQUENCE_NODE || seq_len(node) != n) return false;
        for (int i = 0; i < n; i++)
            if (!node_number(seq_item(doc, node, i), (double *)dst + i)) return false;
        return true;
    }
    case KT_LAYERS: {
        ht_layer_list *list = dst;
        list->count = 0;
        if (node_is_null(node)) return true;
        if (node->type != YAML_SEQUENCE_NODE || seq_len(node) > HT_LAYER_LIST_MAX) return false;
        for (int i = 0; i < seq_len(node); i++) {
            if (!node_int(seq_item(doc, node, i), 0, INT_MAX, &iv)) return false;
            list->items[i] = (int)iv;
        }
        list->count = seq_len(node);
        return true;
    }
    case KT_NS: return node_ns(doc, node, dst, why, why_size);
    case KT_SHARD:
        if (node->type == YAML_SCALAR_NODE && strcmp(scalar_text(node), "auto") == 0) {
            *(int *)dst = 0;
            return true;
        }
        if (!node_int(node, 1, INT_MAX, &iv)) return false;
        *(int *)dst = (int)iv;
        return true;
    case KT_REJECT: return (k->flags & AUTO_OK) && (node_is_null(node) || node_int(node, -1, -1, &iv));
    }
    return false;
}

/* Sets key i of cfg from node (its key on `line`), recording the source and
 * the alias `via` that named it (-1: its own name); cfg is unchanged on error. */
static ht_status assign(ht_config *cfg, int i, yaml_document_t *doc, const yaml_node_t *node, int line, const origin *o,
                        int via, ht_error *err) {
    const key_desc *k = &KEYS[i];
    void *tmp = k->size ? calloc(1, k->size) : NULL; /* zeroed: equal configs are equal bytes */
    if (k->size && !tmp) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", k->path);
    char why[256];
    bool ok = convert(k, doc, node, tmp, why, sizeof(why));
    if (ok && via >= 0 && ALIASES[via].negated && k->type == KT_BOOL) *(bool *)tmp = !*(bool *)tmp;
    if (ok) {
        if (k->size) memcpy((char *)cfg + k->offset, tmp, k->size);
        /* HyperParallel's spelling of the optimizer says whose defaults apply
         * (on the command line too); the other dialects are told by their files. */
        bool hp_name =
            strcmp(k->path, "optimizer._target_") == 0 && strncmp(scalar_text(node), "hyper_parallel.", 15) == 0;
        if (hp_name && cfg->dialect == HT_CONFIG_DIALECT_HYPERTRAIN) cfg->dialect = HT_CONFIG_DIALECT_HYPERPARALLEL;
        if (!hp_name && strcmp(k->path, "optimizer._target_") == 0 && cfg->dialect == HT_CONFIG_DIALECT_HYPERPARALLEL)
            cfg->dialect = HT_CONFIG_DIALECT_HYPERTRAIN;
        cfg->source[i] = (uint8_t)o->source;
        cfg->line[i] = o->source == HT_CONFIG_SOURCE_FILE ? line : 0;
        cfg->alias[i] = (uint8_t)(via + 1);
    }
    free(tmp);
    if (ok) return HT_OK;
    key_desc named = *k; /* the message names the key as it was written */
    if (via >= 0) named.path = ALIASES[via].alias;
    return type_error(&named, o, line, node, why, err);
}

static ht_status assign_text(ht_config *cfg, int i, const char *text, const origin *o, int via, ht_error *err);

/* A weak write (a shared value) loses to the key's own name in the same source, and to any higher source. */
static bool weak_may_set(const ht_config *cfg, int i, const origin *o) {
    if (cfg->source[i] != o->source) return cfg->source[i] < o->source;
    return !set_by_own_name(cfg, i);
}

/* Sets what alias a names from node: its key, its shared keys, what it implies. cfg is unchanged on error. */
static ht_status assign_alias(ht_config *cfg, int a, yaml_document_t *doc, const yaml_node_t *node, int line,
                              const origin *o, ht_error *err) {
    const key_alias *A = &ALIASES[a];
    /* Type-check against every shared key first, so that a failure leaves nothing half set. */
    for (int s = 0; s < 2 && A->shared[s]; s++) {
        const key_desc *k = &KEYS[key_index_exact(A->shared[s])];
        void *tmp = calloc(1, k->size);
        if (!tmp) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", A->alias);
        char why[256];
        bool ok = convert(k, doc, node, tmp, why, sizeof(why));
        free(tmp);
        if (!ok) {
            key_desc named = *k;
            named.path = A->alias;
            return type_error(&named, o, line, node, why, err);
        }
    }
    if (A->key) {
        ht_status st = assign(cfg, key_index_exact(A->key), doc, node, line, o, a, err);
        if (st != HT_OK) return st;
    }
    for (int s = 0; s < 2 && A->shared[s]; s++) {
        int i = key_index_exact(A->shared[s]);
        if (!weak_may_set(cfg, i, o)) continue;
        ht_status st = assign(cfg, i, doc, node, line, o, a, err);
        if (st != HT_OK) return st;
    }
    if (A->implies && !node_is_null(node)) {
        const char *eq = strchr(A->implies, '=');
        char key[256];
        snprintf(key, sizeof(key), "%.*s", (int)(eq - A->implies), A->implies);
        int i = key_index_exact(key);
        if (weak_may_set(cfg, i, o)) {
            ht_status st = assign_text(cfg, i, eq + 1, o, a, err);
            if (st != HT_OK) return st;
            cfg->line[i] = o->source == HT_CONFIG_SOURCE_FILE ? line : 0;
        }
    }
    return HT_OK;
}

/* Parses `text` as one YAML value (a scalar or a flow sequence) and assigns it to key i
 * (via: the alias that named it, or -1; i < 0: alias `via` names it). */
static ht_status assign_text(ht_config *cfg, int i, const char *text, const origin *o, int via, ht_error *err) {
    yaml_parser_t parser;
    yaml_document_t doc;
    char where[HT_CONFIG_STR_MAX + 64];
    origin_prefix(o, 0, where, sizeof(where));
    if (!yaml_parser_initialize(&parser)) return ht_fail(err, HT_ERR_OOM, "%scannot start the YAML parser", where);
    if (!*text) text = "null";
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, strlen(text));
    if (!yaml_parser_load(&parser, &doc)) {
        ht_fail(err, HT_ERR_CONFIG, "%s%s: the value is not valid YAML: %s", where,
                i >= 0     ? KEYS[i].path
                : via >= 0 ? ALIASES[via].alias
                           : "?",
                parser.problem ? parser.problem : "unknown problem");
        yaml_parser_delete(&parser);
        return HT_ERR_CONFIG;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    ht_status st;
    if (!root)
        st = ht_fail(err, HT_ERR_CONFIG, "%s%s: no value", where,
                     i >= 0     ? KEYS[i].path
                     : via >= 0 ? ALIASES[via].alias
                                : "?");
    else if (i >= 0)
        st = assign(cfg, i, &doc, root, 0, o, via, err);
    else
        st = assign_alias(cfg, via, &doc, root, 0, o, err);
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    return st;
}

void ht_config_defaults(ht_config *cfg) {
    memset(cfg, 0, sizeof(*cfg));
    origin o = {NULL, NULL, HT_CONFIG_SOURCE_DEFAULT};
    for (int i = 0; i < N_KEYS; i++) {
        if (!KEYS[i].def) continue;
        ht_error err;
        /* Only a broken table entry can fail; test_config checks every default loads. */
        if (assign_text(cfg, i, KEYS[i].def, &o, -1, &err) != HT_OK) ht_log(HT_LOG_ERROR, "config table: %s", err.msg);
    }
}

/* ---------------------------------------------------------------- unknown keys */

static int edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 200 || lb > 200) return INT_MAX;
    int row[201];
    for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

static void consider(const char *cand, const char *path, const char **best, int *best_d) {
    int d = edit_distance(path, cand);
    if (d < *best_d) {
        *best_d = d;
        *best = cand;
    }
}

/* The closest known key or section, when it is close enough to be a typo. */
static const char *suggest(const char *path, char *buf, size_t n) {
    const char *best = NULL;
    int best_d = INT_MAX;
    for (int i = 0; i < N_KEYS; i++) {
        consider(KEYS[i].path, path, &best, &best_d);
        /* Sections: every dotted prefix of the key. */
        char prefix[256];
        snprintf(prefix, sizeof(prefix), "%s", KEYS[i].path);
        for (char *dot = strrchr(prefix, '.'); dot; dot = strrchr(prefix, '.')) {
            *dot = '\0';
            int d = edit_distance(path, prefix);
            if (d < best_d) {
                best_d = d;
                snprintf(buf, n, "%s", prefix);
                best = buf;
            }
        }
    }
    for (int a = 0; a < N_ALIASES; a++) consider(ALIASES[a].alias, path, &best, &best_d);
    int limit = (int)strlen(path) / 4;
    if (limit < 1) limit = 1;
    if (limit > 3) limit = 3;
    if (!best || best_d > limit) return NULL;
    if (best != buf) snprintf(buf, n, "%s", best);
    return buf;
}

/* "the keys of training are: steps, local_batch_size, ..." (canonical, direct children). */
static void list_children(const char *section, char *buf, size_t n) {
    size_t used = 0;
    buf[0] = '\0';
    size_t plen = section ? strlen(section) + 1 : 0;
    for (int i = 0; i < N_KEYS && used + 1 < n; i++) {
        if (section && !has_prefix_dot(KEYS[i].path, section)) continue;
        if (KEYS[i].type == KT_REJECT) continue;
        const char *child = KEYS[i].path + plen;
        size_t clen = strcspn(child, ".");
        bool dup = false;
        for (int j = 0; j < i && !dup; j++) {
            if (section && !has_prefix_dot(KEYS[j].path, section)) continue;
            const char *other = KEYS[j].path + plen;
            dup = strcspn(other, ".") == clen && strncmp(other, child, clen) == 0;
        }
        if (dup) continue;
        used += (size_t)snprintf(buf + used, n - used, "%s%.*s", used ? ", " : "", (int)clen, child);
    }
}

static ht_status unknown_key(const char *where, const char *path, ht_error *err) {
    char hint[256], keys[1024];
    if (suggest(path, hint, sizeof(hint)))
        return ht_fail(err, HT_ERR_CONFIG, "%s%s: unknown key (did you mean %s?)", where, path, hint);
    char section[256];
    snprintf(section, sizeof(section), "%s", path);
    char *dot = strrchr(section, '.');
    if (dot) *dot = '\0';
    list_children(dot ? section : NULL, keys, sizeof(keys));
    return ht_fail(err, HT_ERR_CONFIG, "%s%s: unknown key; expected one of: %s", where, path, keys);
}

/* ---------------------------------------------------------------- loading a file */

typedef struct loader {
    ht_config *cfg;
    yaml_document_t *doc;
    origin origin;
    int seen_line[HT_CONFIG_MAX_KEYS]; /* where this file set each key by one of its names, for duplicates */
    char seen_as[HT_CONFIG_MAX_KEYS][256];
    int alias_line[N_ALIASES]; /* where this file used each alias, for two names of one shared value */
    char alias_as[N_ALIASES][256];
} loader;

/* Another alias for the same shared value as alias a (learning_rate and base_lr) already used in this file. */
static int seen_same_shared(const loader *L, int a) {
    const key_alias *A = &ALIASES[a];
    if (A->key || !A->shared[0]) return -1;
    for (int b = 0; b < N_ALIASES; b++) {
        const key_alias *B = &ALIASES[b];
        if (b != a && L->alias_line[b] && !B->key && B->shared[0] && strcmp(A->shared[0], B->shared[0]) == 0 &&
            strcmp(A->shared[1] ? A->shared[1] : "", B->shared[1] ? B->shared[1] : "") == 0)
            return b;
    }
    return -1;
}

/* MindFormers declares its optimizer and lr_scheduler sections allow_extra:
 * keys beyond its field tables are passed on (to an optimizer's or a
 * schedule's constructor) rather than refused. Here they have nothing to go
 * to: they are kept, and the log names each as ignored. */
static bool allows_extra_keys(const ht_config *cfg, const char *path) {
    char buf[256];
    path = canonical_path(path, buf, sizeof(buf));
    return cfg->dialect == HT_CONFIG_DIALECT_MINDFORMERS &&
           (has_prefix_dot(path, "optimizer") || has_prefix_dot(path, "lr_scheduler"));
}

static ht_status load_mapping(loader *L, const yaml_node_t *map, const char *prefix, ht_error *err) {
    char where[HT_CONFIG_STR_MAX + 64];
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *key = yaml_document_get_node(L->doc, p->key);
        yaml_node_t *value = yaml_document_get_node(L->doc, p->value);
        origin_prefix(&L->origin, node_line(key), where, sizeof(where));
        if (key->type != YAML_SCALAR_NODE) {
            char found[160];
            describe(key, found, sizeof(found));
            return ht_fail(err, HT_ERR_CONFIG, "%s%s: expected a key name, found %s", where,
                           *prefix ? prefix : "top level", found);
        }
        const char *name = scalar_text(key);
        char path[256];
        if (snprintf(path, sizeof(path), "%s%s%s", prefix, *prefix ? "." : "", name) >= (int)sizeof(path))
            return ht_fail(err, HT_ERR_CONFIG, "%s%.64s...: unknown key (too long)", where, path);
        /* The same name twice, or a section and its alias (lr_scheduler, lr_schedule). */
        char canon[256], prev_path[256], prev_canon[256];
        snprintf(canon, sizeof(canon), "%s", canonical_path(path, prev_canon, sizeof(prev_canon)));
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            yaml_node_t *prev = yaml_document_get_node(L->doc, q->key);
            if (prev->type != YAML_SCALAR_NODE) continue;
            snprintf(prev_path, sizeof(prev_path), "%s%s%s", prefix, *prefix ? "." : "", scalar_text(prev));
            if (strcmp(canonical_path(prev_path, prev_canon, sizeof(prev_canon)), canon) == 0)
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: duplicate key (first set on line %d%s%s)", where, path,
                               node_line(prev), strcmp(prev_path, path) ? " as " : "",
                               strcmp(prev_path, path) ? prev_path : "");
        }
        int i = key_index_exact(canon), a = i < 0 ? alias_index_in(L->cfg, path) : -1;
        if (i < 0 && a >= 0 && ALIASES[a].key) i = key_index_exact(ALIASES[a].key);
        if (i >= 0 || a >= 0) {
            /* Two names of one key in one file is a duplicate; a shared value is not (the key's own name wins). */
            if (i >= 0 && L->seen_line[i])
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: duplicate key: %s was already set on line %d as %s", where,
                               path, KEYS[i].path, L->seen_line[i], L->seen_as[i]);
            int other = a >= 0 ? seen_same_shared(L, a) : -1;
            if (other >= 0)
                return ht_fail(err, HT_ERR_CONFIG,
                               "%s%s: %s was already given on line %d; they are two names for one value (the "
                               "schedule's base lr), give one of them",
                               where, path, L->alias_as[other], L->alias_line[other]);
            ht_status st = a >= 0 ? assign_alias(L->cfg, a, L->doc, value, node_line(key), &L->origin, err)
                                  : assign(L->cfg, i, L->doc, value, node_line(key), &L->origin, -1, err);
            if (st != HT_OK) return st;
            if (a >= 0) {
                L->alias_line[a] = node_line(key);
                snprintf(L->alias_as[a], sizeof(L->alias_as[a]), "%s", path);
            }
            if (i >= 0) {
                L->seen_line[i] = node_line(key);
                snprintf(L->seen_as[i], sizeof(L->seen_as[i]), "%s", path);
            }
        } else if (is_section(path)) {
            if (node_is_null(value)) continue; /* an empty section */
            if (value->type != YAML_MAPPING_NODE) {
                char found[160];
                describe(value, found, sizeof(found));
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: expected a mapping (a section of keys), found %s", where,
                               path, found);
            }
            ht_status st = load_mapping(L, value, path, err);
            if (st != HT_OK) return st;
        } else if (allows_extra_keys(L->cfg, path)) {
            ht_config *cfg = L->cfg;
            if (cfg->ignored_count == HT_CONFIG_IGNORED_MAX)
                return ht_fail(err, HT_ERR_CONFIG, "%s%s: more than %d keys hypertrain does not use", where, path,
                               HT_CONFIG_IGNORED_MAX);
            snprintf(cfg->ignored[cfg->ignored_count], sizeof(cfg->ignored[0]), "%s", path);
            cfg->ignored_line[cfg->ignored_count++] = node_line(key);
        } else {
            return unknown_key(where, path, err);
        }
    }
    return HT_OK;
}

static ht_status yaml_problem(const char *path, const yaml_parser_t *parser, ht_error *err) {
    const char *problem = parser->problem ? parser->problem : "unknown problem";
    if (parser->error == YAML_MEMORY_ERROR) return ht_fail(err, HT_ERR_OOM, "%s: out of memory parsing YAML", path);
    if (parser->context)
        return ht_fail(err, HT_ERR_CONFIG, "%s:%zu: not valid YAML: %s (column %zu), %s (line %zu)", path,
                       parser->problem_mark.line + 1, problem, parser->problem_mark.column + 1, parser->context,
                       parser->context_mark.line + 1);
    return ht_fail(err, HT_ERR_CONFIG, "%s:%zu: not valid YAML: %s (column %zu)", path, parser->problem_mark.line + 1,
                   problem, parser->problem_mark.column + 1);
}

/* A configuration is a few kilobytes; these bounds keep a hostile file from
 * costing minutes: libyaml's time grows with the square of flow nesting
 * (100,000 levels of "[" took 20 s). */
#define CONFIG_FILE_MAX (1 << 20)
#define CONFIG_NESTING_MAX 64

/* The deepest flow nesting ([ and {) outside quotes and comments, and its line. */
static int flow_depth(const char *text, size_t size, size_t *line_out) {
    int depth = 0, deepest = 0;
    size_t line = 1;
    char quote = 0;
    for (size_t i = 0; i < size; i++) {
        char ch = text[i];
        if (ch == '\n') {
            line++;
            if (quote == '#') quote = 0;
            continue;
        }
        if (quote) {
            if (ch == quote && quote != '#')
                quote = 0;
            else if (quote == '"' && ch == '\\' && i + 1 < size)
                i++;
            continue;
        }
        if (ch == '"' || ch == '\'')
            quote = ch;
        else if (ch == '#' && (i == 0 || text[i - 1] == ' ' || text[i - 1] == '\t' || text[i - 1] == '\n'))
            quote = '#';
        else if (ch == '[' || ch == '{') {
            if (++depth > deepest) {
                deepest = depth;
                *line_out = line;
            }
            if (deepest > CONFIG_NESTING_MAX) return deepest;
        } else if ((ch == ']' || ch == '}') && depth > 0) {
            depth--;
        }
    }
    return deepest;
}

/* A mapping's value under `name`, or NULL. */
static yaml_node_t *map_get(yaml_document_t *doc, const yaml_node_t *map, const char *name) {
    if (!map || map->type != YAML_MAPPING_NODE) return NULL;
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top; p++) {
        yaml_node_t *key = yaml_document_get_node(doc, p->key);
        if (key->type == YAML_SCALAR_NODE && strcmp(scalar_text(key), name) == 0)
            return yaml_document_get_node(doc, p->value);
    }
    return NULL;
}

/* Whose YAML the file is, before any key is read, since a dialect decides
 * what some names mean (a MindFormers Muon block's eps) and which sections
 * take extra keys: MindSpeed-MM's top level (parallel:, data.dataset_param),
 * an optimizer _target_ of HyperParallel's, a MindFormers optimizer type (or
 * its lr_schedule section, or a learning_rate / base_lr in lr_scheduler,
 * which only MindFormers spells), else hypertrain's own. The MindFormers optimizer
 * type is noted too, for the same reason; its key is read in its turn. */
static void detect_dialect(yaml_document_t *doc, const yaml_node_t *root, ht_config *cfg) {
    yaml_node_t *opt = map_get(doc, root, "optimizer"), *target = map_get(doc, opt, "_target_"),
                *type = map_get(doc, opt, "type");
    if (map_get(doc, root, "parallel") || map_get(doc, map_get(doc, root, "data"), "dataset_param")) {
        cfg->dialect = HT_CONFIG_DIALECT_MINDSPEED;
    } else if (target && target->type == YAML_SCALAR_NODE && strncmp(scalar_text(target), "hyper_parallel.", 15) == 0) {
        cfg->dialect = HT_CONFIG_DIALECT_HYPERPARALLEL;
    } else if ((type && type->type == YAML_SCALAR_NODE) || map_get(doc, root, "lr_schedule") ||
               map_get(doc, map_get(doc, root, "lr_scheduler"), "learning_rate") ||
               map_get(doc, map_get(doc, root, "lr_scheduler"), "base_lr")) {
        cfg->dialect = HT_CONFIG_DIALECT_MINDFORMERS;
        cfg->optimizer.type = HT_CONFIG_OPTIMIZER_ADAMW; /* MindFormers' default type */
        if (type && type->type == YAML_SCALAR_NODE && strcmp(scalar_text(type), "Muon") == 0)
            cfg->optimizer.type = HT_CONFIG_OPTIMIZER_MUON;
    }
}

static ht_status load_file(ht_config *cfg, const char *path, ht_error *err) {
    char *text = NULL;
    size_t size = 0;
    ht_error io;
    /* The cap is checked on the file's size, before a byte is read. */
    ht_status read = ht_read_file_max(path, CONFIG_FILE_MAX, "a configuration may have", &text, &size, &io);
    if (read == HT_ERR_FORMAT)
        return ht_fail(err, HT_ERR_CONFIG, "%s: %zu bytes; expected a configuration of at most %d bytes", path, size,
                       CONFIG_FILE_MAX);
    if (read != HT_OK) return ht_fail(err, io.status, "config file %s (expected a readable YAML file)", io.msg);
    size_t deep_line = 0;
    if (flow_depth(text, size, &deep_line) > CONFIG_NESTING_MAX) {
        free(text);
        return ht_fail(err, HT_ERR_CONFIG, "%s:%zu: brackets nested deeper than %d levels; expected a configuration",
                       path, deep_line, CONFIG_NESTING_MAX);
    }
    if (strlen(path) >= sizeof(cfg->file)) {
        free(text);
        return ht_fail(err, HT_ERR_CONFIG, "%s: the path is longer than %d bytes", path, HT_CONFIG_STR_MAX - 1);
    }
    snprintf(cfg->file, sizeof(cfg->file), "%s", path);

    yaml_parser_t parser;
    yaml_document_t doc, extra;
    if (!yaml_parser_initialize(&parser)) {
        free(text);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot start the YAML parser", path);
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, size);
    ht_status st = HT_OK;
    if (!yaml_parser_load(&parser, &doc)) {
        st = yaml_problem(path, &parser, err);
        yaml_parser_delete(&parser);
        free(text);
        return st;
    }
    yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (!root || node_is_null(root)) {
        st = ht_fail(err, HT_ERR_CONFIG,
                     "%s: the file is empty; expected a mapping of sections (model:, data:, "
                     "optimizer:, lr_scheduler:, training:, fsdp_config:, checkpoint:)",
                     path);
    } else if (root->type != YAML_MAPPING_NODE) {
        char found[160];
        describe(root, found, sizeof(found));
        st = ht_fail(err, HT_ERR_CONFIG,
                     "%s:%d: top level: expected a mapping of sections (model:, data:, ...), "
                     "found %s",
                     path, node_line(root), found);
    } else {
        loader *L = calloc(1, sizeof(loader));
        if (!L) {
            st = ht_fail(err, HT_ERR_OOM, "%s: out of memory", path);
        } else {
            L->cfg = cfg;
            L->doc = &doc;
            L->origin = (origin){cfg->file, NULL, HT_CONFIG_SOURCE_FILE};
            detect_dialect(&doc, root, cfg);
            st = load_mapping(L, root, "", err);
            free(L);
        }
    }
    if (st == HT_OK) {
        /* A second document would be silently ignored otherwise. */
        if (!yaml_parser_load(&parser, &extra)) {
            st = yaml_problem(path, &parser, err);
        } else {
            yaml_node_t *second = yaml_document_get_root_node(&extra);
            if (second)
                st = ht_fail(err, HT_ERR_CONFIG, "%s:%d: a second YAML document; expected exactly one", path,
                             node_line(second));
            yaml_document_delete(&extra);
        }
    }
    yaml_document_delete(&doc);
    yaml_parser_delete(&parser);
    free(text);
    return st;
}

ht_status ht_config_set(ht_config *cfg, const char *assignment, ht_error *err) {
    origin o = {NULL, assignment, HT_CONFIG_SOURCE_CLI};
    char where[HT_CONFIG_STR_MAX + 64];
    origin_prefix(&o, 0, where, sizeof(where));
    const char *eq = strchr(assignment, '=');
    if (!eq || eq == assignment)
        return ht_fail(err, HT_ERR_CONFIG, "%sexpected section.key=value, found %s", where,
                       eq ? "no key before '='" : "no '='");
    char path[256];
    size_t klen = (size_t)(eq - assignment);
    if (klen >= sizeof(path)) return ht_fail(err, HT_ERR_CONFIG, "%sunknown key (too long)", where);
    memcpy(path, assignment, klen);
    path[klen] = '\0';
    char buf[256];
    int i = key_index_exact(canonical_path(path, buf, sizeof(buf))), a = i < 0 ? alias_index_in(cfg, path) : -1;
    if (a >= 0) return assign_text(cfg, -1, eq + 1, &o, a, err);
    if (i < 0) {
        if (is_section(path)) {
            char keys[1024];
            list_children(path, keys, sizeof(keys));
            return ht_fail(err, HT_ERR_CONFIG, "%s%s is a section; set one of its keys (%s.KEY=VALUE): %s", where, path,
                           path, keys);
        }
        return unknown_key(where, path, err);
    }
    return assign_text(cfg, i, eq + 1, &o, -1, err);
}

const char *ht_config_dialect_name(ht_config_dialect dialect) {
    switch (dialect) {
    case HT_CONFIG_DIALECT_HYPERTRAIN: return "hypertrain";
    case HT_CONFIG_DIALECT_HYPERPARALLEL: return "HyperParallel";
    case HT_CONFIG_DIALECT_MINDFORMERS: return "MindFormers";
    case HT_CONFIG_DIALECT_MINDSPEED: return "MindSpeed-MM";
    }
    return "?";
}

/* The other systems' defaults where they differ from hypertrain's, for the
 * keys a run in their dialect leaves unset (their documents, ../shared/seeds). */
typedef enum default_when {
    IF_ALWAYS,
    IF_MUON,         /* optimizer type Muon */
    IF_ADAMW,        /* optimizer type AdamW */
    IF_POLY_OR_WSD,  /* lr_scheduler PolynomialWithWarmUpLR or WarmUpStableDecayLR */
    IF_COS_RESTARTS, /* lr_scheduler CosineWithRestartsAndWarmUpLR */
} default_when;

static const struct {
    ht_config_dialect dialect;
    default_when when;
    const char *key, *value;
} DIALECT_DEFAULTS[] = {
    /* HyperParallel AutoModels: no FP32 main params, and no reduce_dtype (with
     * fp32_main_params true it must be given as float32: "never silently filled in"). */
    {HT_CONFIG_DIALECT_HYPERPARALLEL, IF_ALWAYS, "optimizer.fp32_main_params", "false"},
    {HT_CONFIG_DIALECT_HYPERPARALLEL, IF_ALWAYS, "fsdp_config.mix_precision.reduce_dtype", "null"},
    /* MindFormers (its field tables): AdamW by default; the base lr 1e-5 from
     * lr_scheduler.learning_rate; AdamW betas [0.9, 0.95]; a Muon block's
     * weight_decay 0.1 for both parts, its AdamW betas (0.95, 0.95), the flat
     * (3.4445, -4.7750, 2.0315) triple ns_steps times, QK-clip on, embeddings
     * and the output layer to AdamW; batch sizes 1; lr_end 1e-7 where its
     * schedules have it; restarts num_cycles 1. */
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_ALWAYS, "optimizer._target_", "AdamW"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_ALWAYS, "optimizer.muon_config.muon_lr", "1.0e-5"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_ALWAYS, "optimizer.adamw_config.adamw_lr", "1.0e-5"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_ADAMW, "optimizer.adamw_config.adamw_betas", "[0.9, 0.95]"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_MUON, "optimizer.adamw_config.adamw_betas", "[0.95, 0.95]"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_MUON, "optimizer.adamw_config.adamw_weight_decay", "0.1"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_MUON, "optimizer.muon_config.muon_ns_variant", "legacy"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_MUON, "optimizer.muon_config.qk_clip_enabled", "true"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_MUON, "optimizer.muon_config.adamw_include",
     "[\"word_embeddings\", \"output_layer\"]"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_ALWAYS, "training.local_batch_size", "1"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_ALWAYS, "training.global_batch_size", "1"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_POLY_OR_WSD, "lr_scheduler.lr_end", "1.0e-7"},
    {HT_CONFIG_DIALECT_MINDFORMERS, IF_COS_RESTARTS, "lr_scheduler.num_cycles", "1.0"},
    /* MindSpeed-MM's plugin trainer: training.optimizer adamw. */
    {HT_CONFIG_DIALECT_MINDSPEED, IF_ALWAYS, "optimizer._target_", "AdamW"},
};
#define N_DIALECT_DEFAULTS ((int)(sizeof(DIALECT_DEFAULTS) / sizeof(DIALECT_DEFAULTS[0])))

static bool default_applies(const ht_config *cfg, default_when when) {
    switch (when) {
    case IF_ALWAYS: return true;
    case IF_MUON: return cfg->optimizer.type == HT_CONFIG_OPTIMIZER_MUON;
    case IF_ADAMW: return cfg->optimizer.type == HT_CONFIG_OPTIMIZER_ADAMW;
    case IF_POLY_OR_WSD:
        return cfg->lr_scheduler.type == HT_CONFIG_LR_POLYNOMIAL_WARMUP ||
               cfg->lr_scheduler.type == HT_CONFIG_LR_WARMUP_STABLE_DECAY;
    case IF_COS_RESTARTS: return cfg->lr_scheduler.type == HT_CONFIG_LR_COSINE_RESTARTS;
    }
    return false;
}

/* Each dialect default whose key the run left unset. The type default comes
 * first: the others depend on it. They stay "default" as sources. */
static void apply_dialect_defaults(ht_config *cfg) {
    origin o = {NULL, NULL, HT_CONFIG_SOURCE_DEFAULT};
    for (int d = 0; d < N_DIALECT_DEFAULTS; d++) {
        int i = key_index_exact(DIALECT_DEFAULTS[d].key);
        if (DIALECT_DEFAULTS[d].dialect != cfg->dialect || cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT ||
            !default_applies(cfg, DIALECT_DEFAULTS[d].when))
            continue;
        ht_error err;
        /* Only a broken table entry can fail; test_config loads every dialect's defaults. */
        if (assign_text(cfg, i, DIALECT_DEFAULTS[d].value, &o, -1, &err) != HT_OK)
            ht_log(HT_LOG_ERROR, "config table: %s", err.msg);
        cfg->dialect_default[i] = 1;
    }
}

/* Sets key `to` from key `from`'s value, with its source: one key a dialect
 * spells as parts of another (MindSpeed-MM's dataset_dir + dataset). */
static void take_source(ht_config *cfg, const char *to, const char *from) {
    int t = key_index_exact(to), f = key_index_exact(from);
    cfg->source[t] = cfg->source[f];
    cfg->line[t] = cfg->line[f];
    cfg->alias[t] = cfg->alias[f];
}

/* MindSpeed-MM's keys that are parts or switches of hypertrain's: the data
 * path as basic_parameters' dataset_dir and dataset; training.save, the
 * checkpoint root (null: no checkpoints are saved). A hypertrain key given
 * alongside is an error rather than a silent choice. */
static ht_status resolve_parts(ht_config *cfg, ht_error *err) {
    int line;
    if (ht_config_key_source(cfg, "data.dataset", &line) != HT_CONFIG_SOURCE_DEFAULT && cfg->data.dataset[0]) {
        if (ht_config_key_source(cfg, "data.path", &line) != HT_CONFIG_SOURCE_DEFAULT)
            return ht_fail(err, HT_ERR_CONFIG,
                           "%s: data.path and data.dataset (basic_parameters.dataset) both name the data: give one",
                           cfg->file[0] ? cfg->file : "--set");
        int w =
            cfg->data.dataset_dir[0] && cfg->data.dataset[0] != '/'
                ? snprintf(cfg->data.path, sizeof(cfg->data.path), "%s/%s", cfg->data.dataset_dir, cfg->data.dataset)
                : snprintf(cfg->data.path, sizeof(cfg->data.path), "%s", cfg->data.dataset);
        if (w < 0 || (size_t)w >= sizeof(cfg->data.path))
            return ht_fail(err, HT_ERR_CONFIG, "data.dataset_dir/data.dataset: the path is longer than %d bytes",
                           HT_CONFIG_STR_MAX - 1);
        take_source(cfg, "data.path", "data.dataset");
    }
    if (ht_config_key_source(cfg, "training.save", &line) != HT_CONFIG_SOURCE_DEFAULT) {
        if (cfg->training.save[0]) {
            if (ht_config_key_source(cfg, "checkpoint.output_dir", &line) != HT_CONFIG_SOURCE_DEFAULT &&
                strcmp(cfg->checkpoint.output_dir, cfg->training.save) != 0)
                return ht_fail(err, HT_ERR_CONFIG,
                               "training.save (%s) and checkpoint.output_dir (%s) both name where checkpoints go: "
                               "give one",
                               cfg->training.save, cfg->checkpoint.output_dir);
            snprintf(cfg->checkpoint.output_dir, sizeof(cfg->checkpoint.output_dir), "%s", cfg->training.save);
            take_source(cfg, "checkpoint.output_dir", "training.save");
        } else {
            cfg->checkpoint.save_interval = 0; /* MindSpeed-MM: no save root, nothing saved */
            take_source(cfg, "checkpoint.save_interval", "training.save");
        }
    }
    return HT_OK;
}

ht_status ht_config_load(const char *path, int n_overrides, char *const *overrides, ht_config *cfg, ht_error *err) {
    ht_config_defaults(cfg);
    if (path) {
        ht_status st = load_file(cfg, path, err);
        if (st != HT_OK) return st;
    }
    for (int i = 0; i < n_overrides; i++) {
        ht_status st = ht_config_set(cfg, overrides[i], err);
        if (st != HT_OK) return st;
    }
    apply_dialect_defaults(cfg);
    return resolve_parts(cfg, err);
}

/* ---------------------------------------------------------------- sources, formatting, the log */

ht_config_source ht_config_key_source(const ht_config *cfg, const char *key, int *line) {
    int i = ht_config_key_index(key);
    if (line) *line = i >= 0 ? cfg->line[i] : 0;
    return i >= 0 ? (ht_config_source)cfg->source[i] : HT_CONFIG_SOURCE_DEFAULT;
}

const char *ht_config_source_name(ht_config_source source) {
    switch (source) {
    case HT_CONFIG_SOURCE_DEFAULT: return "default";
    case HT_CONFIG_SOURCE_FILE: return "file";
    case HT_CONFIG_SOURCE_CLI: return "command line";
    case HT_CONFIG_SOURCE_PRETRAINED: return "model.from_pretrained's config.json";
    }
    return "?";
}

/* Appends with truncation; `used` never passes n - 1. */
static void put(char *buf, size_t n, size_t *used, const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void put(char *buf, size_t n, size_t *used, const char *fmt, ...) {
    if (*used + 1 >= n) return;
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(buf + *used, n - *used, fmt, ap);
    va_end(ap);
    if (w > 0) *used += (size_t)w < n - *used ? (size_t)w : n - *used - 1;
}

/* Shortest text that reads back as the same double. */
static void put_double(char *buf, size_t n, size_t *used, double x) {
    char tmp[48];
    int prec = 1;
    for (; prec <= 17; prec++) {
        snprintf(tmp, sizeof(tmp), "%.*g", prec, x);
        if (strtod(tmp, NULL) == x) break;
    }
    /* Positional, not exponent, notation in Python's repr range: 500000.0, not 5e+05. */
    double ax = fabs(x);
    if (strchr(tmp, 'e') && ax >= 1e-4 && ax < 1e16) {
        int decimals = prec - 1 - (int)floor(log10(ax));
        snprintf(tmp, sizeof(tmp), "%.*f", decimals > 0 ? decimals : 0, x);
    }
    /* Keep it a YAML 1.1 float (PyYAML wants the dot): 10000 -> 10000.0, 1e-06 -> 1.0e-06. */
    char *e = strchr(tmp, 'e');
    if (e && !memchr(tmp, '.', (size_t)(e - tmp))) {
        memmove(e + 2, e, strlen(e) + 1);
        memcpy(e, ".0", 2);
    } else if (!strpbrk(tmp, ".en")) {
        strcat(tmp, ".0");
    }
    put(buf, n, used, "%s", tmp);
}

/* A double-quoted YAML string, escaped. */
static void put_quoted(char *buf, size_t n, size_t *used, const char *s) {
    put(buf, n, used, "\"");
    for (; *s; s++) {
        if (*s == '"' || *s == '\\')
            put(buf, n, used, "\\%c", *s);
        else if (*s == '\n' || *s == '\t')
            put(buf, n, used, "\\%c", *s == '\n' ? 'n' : 't');
        else
            put(buf, n, used, "%c", *s);
    }
    put(buf, n, used, "\"");
}

/* A string as a YAML scalar: plain when it reads back as the same string, else double-quoted. */
static void put_string(char *buf, size_t n, size_t *used, const char *s) {
    bool plain = *s && !strchr(" \t-?:,[]{}#&*!|>'\"%@`~", s[0]) && s[strlen(s) - 1] != ' ' && !strstr(s, ": ") &&
                 !strstr(s, " #") && !strpbrk(s, "\n\t\r");
    if (plain) {
        yaml_node_t fake = {0};
        fake.type = YAML_SCALAR_NODE;
        fake.data.scalar.value = (yaml_char_t *)s;
        fake.data.scalar.style = YAML_PLAIN_SCALAR_STYLE;
        long long iv;
        double dv;
        bool bv;
        plain = classify(&fake, &iv, &dv, &bv) == SC_STR;
    }
    if (plain)
        put(buf, n, used, "%s", s);
    else
        put_quoted(buf, n, used, s);
}

static void put_triple(char *buf, size_t n, size_t *used, const double abc[3]) {
    put(buf, n, used, "[");
    for (int j = 0; j < 3; j++) {
        if (j) put(buf, n, used, ", ");
        put_double(buf, n, used, abc[j]);
    }
    put(buf, n, used, "]");
}

static void format_value(const ht_config *cfg, int i, char *buf, size_t n) {
    const key_desc *k = &KEYS[i];
    const void *src = (const char *)cfg + k->offset;
    size_t used = 0;
    buf[0] = '\0';
    switch (k->type) {
    case KT_INT:
        if ((k->flags & NULLABLE) && *(const int *)src == 0)
            put(buf, n, &used, "null");
        else
            put(buf, n, &used, "%d", *(const int *)src);
        break;
    case KT_I64: put(buf, n, &used, "%lld", (long long)*(const int64_t *)src); break;
    case KT_FLOAT: put_double(buf, n, &used, *(const double *)src); break;
    case KT_BOOL: put(buf, n, &used, "%s", *(const bool *)src ? "true" : "false"); break;
    case KT_STR:
        if ((k->flags & NULLABLE) && !*(const char *)src)
            put(buf, n, &used, "null");
        else
            put_string(buf, n, &used, src);
        break;
    case KT_ENUM: {
        int v;
        memcpy(&v, src, sizeof(v));
        const char *name = "?";
        for (const enum_name *e = k->names; e->name; e++)
            if (e->value == v) {
                name = e->name;
                break;
            }
        put(buf, n, &used, "%s", name);
        break;
    }
    case KT_DTYPE: {
        ht_dtype dt;
        memcpy(&dt, src, sizeof(dt));
        put(buf, n, &used, "%s", dt == HT_CONFIG_DTYPE_NONE ? "null" : ht_dtype_name(dt));
        break;
    }
    case KT_STRS: {
        const ht_config_strings *list = src;
        put(buf, n, &used, "[");
        for (int j = 0; j < list->count; j++) {
            if (j) put(buf, n, &used, ", ");
            put_quoted(buf, n, &used, list->items[j]);
        }
        put(buf, n, &used, "]");
        break;
    }
    case KT_FLOATS:
        put(buf, n, &used, "[");
        for (size_t j = 0; j < k->size / sizeof(double); j++) {
            if (j) put(buf, n, &used, ", ");
            put_double(buf, n, &used, ((const double *)src)[j]);
        }
        put(buf, n, &used, "]");
        break;
    case KT_LAYERS: {
        const ht_layer_list *list = src;
        put(buf, n, &used, "[");
        for (int j = 0; j < list->count; j++) put(buf, n, &used, "%s%d", j ? ", " : "", list->items[j]);
        put(buf, n, &used, "]");
        break;
    }
    case KT_NS: {
        const ht_config_ns_coefficients *ns = src;
        if (ns->count == 0) {
            put(buf, n, &used, "null");
        } else if (ns->count == 1 && ns->repeat[0] == 0) {
            put_triple(buf, n, &used, ns->abc[0]);
        } else {
            put(buf, n, &used, "[");
            for (int j = 0; j < ns->count; j++) {
                if (j) put(buf, n, &used, ", ");
                if (ns->repeat[j] != 1) put(buf, n, &used, "[");
                put_triple(buf, n, &used, ns->abc[j]);
                if (ns->repeat[j] != 1) put(buf, n, &used, ", %d]", ns->repeat[j]);
            }
            put(buf, n, &used, "]");
        }
        break;
    }
    case KT_SHARD:
        if (*(const int *)src == 0)
            put(buf, n, &used, "auto");
        else
            put(buf, n, &used, "%d", *(const int *)src);
        break;
    case KT_REJECT: put(buf, n, &used, "null"); break;
    }
}

bool ht_config_format_value(const ht_config *cfg, const char *key, char *buf, size_t n) {
    int i = ht_config_key_index(key);
    if (i < 0 || n == 0) return false;
    format_value(cfg, i, buf, n);
    return true;
}

/* "MindFormers'", "HyperParallel's". */
static const char *dialect_possessive(ht_config_dialect d) {
    switch (d) {
    case HT_CONFIG_DIALECT_HYPERTRAIN: return "hypertrain's";
    case HT_CONFIG_DIALECT_HYPERPARALLEL: return "HyperParallel's";
    case HT_CONFIG_DIALECT_MINDFORMERS: return "MindFormers'";
    case HT_CONFIG_DIALECT_MINDSPEED: return "MindSpeed-MM's";
    }
    return "?";
}

/* "file, line 12", "command line", "default"; ", as <alias>" when an alias set it. */
static void describe_source(const ht_config *cfg, int i, char *buf, size_t n) {
    const char *as = cfg->alias[i] ? ALIASES[cfg->alias[i] - 1].alias : NULL;
    if (cfg->source[i] == HT_CONFIG_SOURCE_DEFAULT && cfg->dialect_default[i])
        snprintf(buf, n, "%s default", dialect_possessive(cfg->dialect));
    else if (cfg->source[i] == HT_CONFIG_SOURCE_PRETRAINED)
        snprintf(buf, n, "config.json of %s", cfg->model.from_pretrained);
    else if (cfg->source[i] == HT_CONFIG_SOURCE_FILE && cfg->line[i] > 0)
        snprintf(buf, n, "file, line %d%s%s", cfg->line[i], as ? ", as " : "", as ? as : "");
    else
        snprintf(buf, n, "%s%s%s", ht_config_source_name((ht_config_source)cfg->source[i]), as ? ", as " : "",
                 as ? as : "");
}

void ht_config_use_pretrained(ht_config *cfg, const ht_model_config *arch) {
    const size_t first = offsetof(ht_config, model.arch), end = first + sizeof(ht_model_config);
    const size_t lora = offsetof(ht_config, model.arch.lora), lora_end = lora + sizeof(ht_lora_config);
    char before[1024], now[1024], where[HT_CONFIG_STR_MAX + 64];
    for (int i = 0; i < N_KEYS; i++) {
        const key_desc *k = &KEYS[i];
        if (k->type == KT_REJECT || k->offset < first || k->offset >= end ||
            (k->offset >= lora && k->offset < lora_end))
            continue;
        format_value(cfg, i, before, sizeof(before));
        describe_source(cfg, i, where, sizeof(where));
        memcpy((char *)cfg + k->offset, (const char *)arch + (k->offset - first), k->size);
        format_value(cfg, i, now, sizeof(now));
        if (cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT && strcmp(before, now) != 0)
            ht_log_warn("%s: %s (%s) is not used: the model is %s/config.json's, which says %s",
                        ht_config_key_spelling(cfg, k->path), before, where, cfg->model.from_pretrained, now);
        cfg->source[i] = HT_CONFIG_SOURCE_PRETRAINED;
        cfg->line[i] = 0;
        cfg->alias[i] = 0;
        cfg->dialect_default[i] = 0;
    }
    ht_lora_config keep = cfg->model.arch.lora; /* never in config.json */
    cfg->model.arch = *arch;
    cfg->model.arch.lora = keep;
}

void ht_config_log(const ht_config *cfg) {
    int key_w = 3, val_w = 5;
    char value[1024];
    for (int i = 0; i < N_KEYS; i++) {
        if (KEYS[i].type == KT_REJECT) continue;
        int kl = (int)strlen(KEYS[i].path);
        if (kl > key_w) key_w = kl;
        format_value(cfg, i, value, sizeof(value));
        int vl = (int)strlen(value);
        if (vl > val_w && vl <= 40) val_w = vl;
    }
    ht_log_info("Trainer config%s%s (%s dialect)", cfg->file[0] ? " from " : "", cfg->file,
                dialect_possessive(cfg->dialect));
    ht_log_info("  %-*s  %-*s  %s", key_w, "key", val_w, "value", "source");
    for (int i = 0; i < N_KEYS; i++) {
        if (KEYS[i].type == KT_REJECT) continue;
        format_value(cfg, i, value, sizeof(value));
        char source[HT_CONFIG_STR_MAX + 64];
        describe_source(cfg, i, source, sizeof(source));
        ht_log_info("  %-*s  %-*s  %s", key_w, KEYS[i].path, val_w, value, source);
    }
    for (int j = 0; j < cfg->ignored_count; j++) {
        char hint[256];
        bool close = suggest(cfg->ignored[j], hint, sizeof(hint)) != NULL;
        ht_log_warn("%s:%d: %s is not a key hypertrain uses; ignored (%s allows extra keys in this section)%s%s%s",
                    cfg->file, cfg->ignored_line[j], cfg->ignored[j], ht_config_dialect_name(cfg->dialect),
                    close ? "; did you mean " : "", close ? hint : "", close ? "?" : "");
    }
}

void ht_config_log_section(const ht_config *cfg, const char *title, const char *prefix) {
    size_t plen = strlen(prefix);
    int key_w = 3, def_w = 7, conf_w = 10;
    char value[1024], conf[2 * HT_CONFIG_STR_MAX + 96], source[HT_CONFIG_STR_MAX + 64];
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            ht_log_info("Effective %s config", title);
            ht_log_info("  %-*s  %-*s  %-*s  %s", key_w, "key", def_w, "default", conf_w, "configured", "final");
        }
        for (int i = 0; i < N_KEYS; i++) {
            if (KEYS[i].type == KT_REJECT || strncmp(KEYS[i].path, prefix, plen) != 0) continue;
            const char *name = KEYS[i].path[plen] ? KEYS[i].path + plen : KEYS[i].path;
            format_value(cfg, i, value, sizeof(value));
            if (cfg->source[i] == HT_CONFIG_SOURCE_DEFAULT) {
                snprintf(conf, sizeof(conf), "-");
            } else {
                describe_source(cfg, i, source, sizeof(source));
                snprintf(conf, sizeof(conf), "%s (%s)", value, source);
            }
            if (pass == 0) {
                int kl = (int)strlen(name), dl = (int)strlen(KEYS[i].def), cl = (int)strlen(conf);
                if (kl > key_w) key_w = kl;
                if (dl > def_w && dl <= 40) def_w = dl;
                if (cl > conf_w && cl <= 60) conf_w = cl;
                continue;
            }
            ht_log_info("  %-*s  %-*s  %-*s  %s", key_w, name, def_w, KEYS[i].def, conf_w, conf, value);
        }
    }
}

int ht_config_warmup_steps(const ht_config *cfg) {
    int i = ht_config_key_index("lr_scheduler.warmup_ratio");
    if (cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT)
        return (int)floor((double)cfg->training.steps * cfg->lr_scheduler.warmup_ratio);
    return cfg->lr_scheduler.warmup_steps;
}

int ht_config_decay_steps(const ht_config *cfg) {
    int i = ht_config_key_index("lr_scheduler.decay_ratio");
    if (cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT)
        return (int)floor((double)cfg->training.steps * cfg->lr_scheduler.decay_ratio);
    return cfg->lr_scheduler.decay_steps;
}

double ht_config_lr_end2(const ht_config *cfg) {
    int i = ht_config_key_index("lr_scheduler.lr_end2");
    return cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT ? cfg->lr_scheduler.lr_end2 : cfg->lr_scheduler.lr_end1;
}

int ht_config_decay_start_steps(const ht_config *cfg) {
    int i = ht_config_key_index("lr_scheduler.decay_start_steps");
    if (cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT) return cfg->lr_scheduler.decay_start_steps;
    return (int)floor((double)cfg->training.steps * cfg->lr_scheduler.decay_start_ratio);
}
