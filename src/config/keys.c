/* The key table (every key's path, type, field and default; other dialects' names for keys and
 * sections), lookups by name, and the values derived from keys left unset. A new key or a dialect
 * alias is one line in a table below. Cross-field rules: validate.c. */
#include "config/config_internal.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

/* ---------------------------------------------------------------- the table */

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
static const enum_name NS_FORMS[] = {
    {"standard", HT_CONFIG_NS_STANDARD, false},
    {"gram", HT_CONFIG_NS_GRAM, false},
    {"torch", HT_CONFIG_NS_TORCH, false},
    {NULL, 0, false},
};
static const enum_name MAIN_STORAGES[] = {
    {"fp32", HT_CONFIG_MAIN_FP32, false},
    {"residual16", HT_CONFIG_MAIN_RESIDUAL16, false},
    {NULL, 0, false},
};
static const enum_name NS_DTYPES[] = {
    {"float32", HT_DTYPE_F32, false},
    {"bfloat16", HT_DTYPE_BF16, false},
    {NULL, 0, false},
};
static const enum_name PP_SCHEDULES[] = {
    {"1f1b", HT_CONFIG_PP_1F1B, false},
    {"gpipe", HT_CONFIG_PP_GPIPE, false},
    {NULL, 0, false},
};
static const enum_name KERNEL_BACKENDS[] = {
    {"cpu", HT_KERNELS_CPU, false},
    {"fenced", HT_KERNELS_FENCED, false},
    {"cuda", HT_KERNELS_CUDA, false},
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
#define PATH(path, field, def)                                                                                         \
    { path, KT_STR, F(field), def, NULL, FS_PATH }
#define PATH_OR_NULL(path, field, def)                                                                                 \
    { path, KT_STR, F(field), def, NULL, NULLABLE | FS_PATH }
#define PATHS(path, field, def)                                                                                        \
    { path, KT_STRS, F(field), def, NULL, FS_PATH }
#define FLOATS(path, field, def)                                                                                       \
    { path, KT_FLOATS, F(field), def, NULL, 0 }
#define LAYERS(path, field, def)                                                                                       \
    { path, KT_LAYERS, F(field), def, NULL, 0 }
#define NS(path, field, def)                                                                                           \
    { path, KT_NS, F(field), def, NULL, 0 }
#define SHARD(path, field, def)                                                                                        \
    { path, KT_SHARD, F(field), def, NULL, 0 }
#define AUTO_INT(path, field, def)                                                                                     \
    { path, KT_AUTO_INT, F(field), def, NULL, 0 }
#define SWITCH_PATH(path, field, def)                                                                                  \
    { path, KT_SWITCH_PATH, F(field), def, NULL, FS_PATH }
#define STEPS(path, field, def)                                                                                        \
    { path, KT_STEPS, F(field), def, NULL, 0 }
#define REJECT_BUT_AUTO(path, msg)                                                                                     \
    { path, KT_REJECT, 0, 0, NULL, msg, AUTO_OK }

/* The architecture's keys, from model.h's table of its fields. */
#define ARCH_KEY(member, key, json, type, def, qwen2, llama, qwen2_moe, deepseek_v3)                                   \
    ARCH_##type("model." #key, model.arch.member, #def),
#define ARCH_INT INT
#define ARCH_DIM INT
#define ARCH_INT_OR_NULL INT_OR_NULL
#define ARCH_FLT FLT
#define ARCH_BOOL BOOL
#define ARCH_LAYERS LAYERS

/* Every key of docs/CONFIG.md, in the order the log prints them. */
const key_desc ht_config_keys[] = {
    STR("model.name", model.arch.name, "qwen2"),
    PATH_OR_NULL("model.from_pretrained", model.from_pretrained, "null"),
    HT_ARCH_FIELDS(ARCH_KEY) BOOL("model.multi_latent_attention", model.multi_latent_attention, "false"),
    STR_OR_NULL("model.rope_scaling.type", model.arch.rope_scaling.type, "null"),
    FLT("model.rope_scaling.factor", model.arch.rope_scaling.factor, "1.0"),
    INT("model.rope_scaling.original_max_position_embeddings", model.arch.rope_scaling.original_max_position_embeddings,
        "4096"),
    FLT("model.rope_scaling.beta_fast", model.arch.rope_scaling.beta_fast, "32.0"),
    FLT("model.rope_scaling.beta_slow", model.arch.rope_scaling.beta_slow, "1.0"),
    FLT("model.rope_scaling.mscale", model.arch.rope_scaling.mscale, "1.0"),
    FLT("model.rope_scaling.mscale_all_dim", model.arch.rope_scaling.mscale_all_dim, "0.0"),
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
    PATH_OR_NULL("model.lora.from_pretrained", model.lora.from_pretrained, "null"),
    DTYPE_OR_NULL("model_init_dtype", model_init_dtype, "float32"),

    STR("data.dataset_type", data.dataset_type, "text_bytes"),
    PATH("data.path", data.path, "\"\""),
    INT("data.seq_len", data.seq_len, "256"),
    FLT("data.valid_fraction", data.valid_fraction, "0.01"),
    BOOL("data.shuffle", data.shuffle, "true"),
    BOOL("data.drop_last", data.drop_last, "true"),
    INT("data.num_workers", data.num_workers, "0"),
    BOOL("data.pin_memory", data.pin_memory, "false"),
    STR("data.dataloader_mode", data.dataloader_mode, "sampler"),
    STR("data.sampler_type", data.sampler_type, "BaseRandomBatchSampler"),
    STR("data.collate", data.collate, "llm_pretrain"),
    PATH_OR_NULL("data.tokenizer", data.tokenizer, "null"),
    PATH_OR_NULL("data.dataset_dir", data.dataset_dir, "null"),
    STR_OR_NULL("data.dataset", data.dataset, "null"),

    INT("parallel.tensor_parallel_size", parallel.tensor_parallel_size, "1"),
    BOOL("parallel.sequence_parallel", parallel.sequence_parallel, "true"),
    INT("parallel.ring_attention_size", parallel.ring_attention_size, "1"),
    INT("parallel.ulysses_parallel_size", parallel.ulysses_parallel_size, "1"),
    INT("parallel.expert_parallel_size", parallel.expert_parallel_size, "1"),
    INT("parallel.pipeline_parallel_size", parallel.pipeline_parallel_size, "1"),
    ENUM("parallel.pipeline_schedule", parallel.pipeline_schedule, PP_SCHEDULES, "1f1b"),
    INT("parallel.virtual_pipeline_model_parallel_size", parallel.virtual_pipeline_model_parallel_size, "1"),
    STRS("parallel.ep_plan.apply_modules", parallel.ep_modules, "[]"),

    ENUM("optimizer._target_", optimizer.type, OPTIMIZERS, "Muon"),
    BOOL("optimizer.fp32_main_params", optimizer.fp32_main_params, "true"),
    ENUM("optimizer.main_param_storage", optimizer.main_param_storage, MAIN_STORAGES, "fp32"),
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
    ENUM("optimizer.muon_config.muon_ns_form", optimizer.muon.ns_form, NS_FORMS, "standard"),
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
    SWITCH_PATH("training.tensorboard", training.tensorboard, "false"),
    STEPS("training.trace", training.trace, "false"),
    FLT("training.distributed_timeout_minutes", training.distributed_timeout_minutes, "10"),
    INT("training.log_interval", training.log_interval, "10"),
    INT("training.eval_interval", training.eval_interval, "100"),
    INT("training.eval_batches", training.eval_batches, "20"),
    INT("training.sample_interval", training.sample_interval, "0"),
    STR_OR_NULL("training.sample_prompt", training.sample_prompt, "null"),
    INT("training.sample_tokens", training.sample_tokens, "64"),
    PATHS("training.plugin", training.plugin, "[]"),
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

    ENUM("kernels.backend", kernels.backend, KERNEL_BACKENDS, "cpu"),
    ENUM("kernels.bf16_gemm", kernels.bf16_gemm, GEMM_KERNELS, "auto"),
    ENUM("kernels.f16_gemm", kernels.f16_gemm, GEMM_KERNELS, "auto"),
    AUTO_INT("kernels.lm_head_chunk_mib", kernels.lm_head_chunk_mib, "auto"),

    PATH("checkpoint.output_dir", checkpoint.output_dir, "runs/default"),
    INT("checkpoint.save_interval", checkpoint.save_interval, "500"),
    BOOL("checkpoint.save_optimizer", checkpoint.save_optimizer, "true"),
    INT("checkpoint.keep_last", checkpoint.keep_last, "3"),
    PATH_OR_NULL("checkpoint.restore_from", checkpoint.restore_from, "null"),
    BOOL("checkpoint.restore_optimizer", checkpoint.restore_optimizer, "true"),
    BOOL("checkpoint.overwrite", checkpoint.overwrite, "false"),
    STRS("checkpoint.allow_changes", checkpoint.allow_changes, "[]"),
};
#define N_KEYS ((int)(sizeof(ht_config_keys) / sizeof(ht_config_keys[0])))
_Static_assert(sizeof(ht_config_keys) / sizeof(ht_config_keys[0]) <= HT_CONFIG_MAX_KEYS, "raise HT_CONFIG_MAX_KEYS");
_Static_assert(sizeof(ht_config_optimizer) == sizeof(int) && sizeof(ht_dtype) == sizeof(int) &&
                   sizeof(ht_gemm_kernel) == sizeof(int),
               "enums are stored as int");
const int ht_config_n_keys = N_KEYS;

/* Other dialects' names for keys (docs/CONFIG.md, Compatibility). An alias is
 * another spelling of one key (`key`: both spellings in one source are a
 * duplicate), and/or one value shared by several keys (`shared`, `implies`):
 * those are weak, so a key set by its own name in the same source (file, or
 * command line) wins over them whatever the order, and a higher source wins
 * over both. */
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

const key_alias ht_config_aliases[] = {
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
    /* DeepSeek-V3's config.json names, MindFormers' name for the bias update, and
     * transformers 5's rope_parameters. */
    RENAME("model.n_routed_experts", "model.num_experts"),
    RENAME("model.topk_bias_update_rate", "model.moe_router_bias_update_rate"),
    RENAME("model.rope_scaling.rope_type", "model.rope_scaling.type"),
    RENAME("model.rope_parameters.rope_type", "model.rope_scaling.type"),
    RENAME("model.rope_parameters.rope_theta", "model.rope_theta"),
    RENAME("model.rope_parameters.factor", "model.rope_scaling.factor"),
    RENAME("model.rope_parameters.original_max_position_embeddings",
           "model.rope_scaling.original_max_position_embeddings"),
    RENAME("model.rope_parameters.beta_fast", "model.rope_scaling.beta_fast"),
    RENAME("model.rope_parameters.beta_slow", "model.rope_scaling.beta_slow"),
    RENAME("model.rope_parameters.mscale", "model.rope_scaling.mscale"),
    RENAME("model.rope_parameters.mscale_all_dim", "model.rope_scaling.mscale_all_dim"),
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
#define N_ALIASES ((int)(sizeof(ht_config_aliases) / sizeof(ht_config_aliases[0])))
_Static_assert(sizeof(ht_config_aliases) / sizeof(ht_config_aliases[0]) <= HT_CONFIG_MAX_ALIASES,
               "ht_config.alias is a uint8_t");
const int ht_config_n_aliases = N_ALIASES;

/* Another dialect's name for a whole section. */
static const struct {
    const char *alias, *section;
} SECTION_ALIASES[] = {
    {"lr_schedule", "lr_scheduler"}, /* MindFormers */
};
#define N_SECTION_ALIASES ((int)(sizeof(SECTION_ALIASES) / sizeof(SECTION_ALIASES[0])))

/* `path` with a section alias at its front replaced by the section ("lr_schedule.type" -> "lr_scheduler.type"). */
const char *ht_config_canonical_path(const char *path, char *buf, size_t n) {
    for (int s = 0; s < N_SECTION_ALIASES; s++) {
        size_t len = strlen(SECTION_ALIASES[s].alias);
        if (strncmp(path, SECTION_ALIASES[s].alias, len) == 0 && (path[len] == '.' || path[len] == '\0')) {
            int w = snprintf(buf, n, "%s%s", SECTION_ALIASES[s].section, path + len);
            return w >= 0 && (size_t)w < n ? buf : path; /* too long to be a key either way */
        }
    }
    return path;
}

int ht_config_key_index_exact(const char *path) {
    for (int i = 0; i < N_KEYS; i++)
        if (strcmp(ht_config_keys[i].path, path) == 0) return i;
    return -1;
}

static bool alias_applies(const key_alias *A, const ht_config *cfg) {
    if (!cfg || A->when == WHEN_ALWAYS) return true;
    bool mf_muon = cfg->dialect == HT_CONFIG_DIALECT_MINDFORMERS && cfg->optimizer.type == HT_CONFIG_OPTIMIZER_MUON;
    return A->when == WHEN_MINDFORMERS_MUON ? mf_muon : !mf_muon;
}

/* The alias `path` names in cfg's dialect and block (cfg NULL: its first meaning); -1 if none. */
int ht_config_alias_index_in(const ht_config *cfg, const char *path) {
    char buf[256];
    path = ht_config_canonical_path(path, buf, sizeof(buf));
    for (int a = 0; a < N_ALIASES; a++)
        if (strcmp(ht_config_aliases[a].alias, path) == 0 && alias_applies(&ht_config_aliases[a], cfg)) return a;
    return -1;
}

static int alias_index(const char *path) { return ht_config_alias_index_in(NULL, path); }

int ht_config_key_index(const char *key) {
    char buf[256];
    int i = ht_config_key_index_exact(ht_config_canonical_path(key, buf, sizeof(buf)));
    if (i >= 0) return i;
    int a = alias_index(key);
    return a >= 0 && ht_config_aliases[a].key ? ht_config_key_index_exact(ht_config_aliases[a].key) : -1;
}

const char *ht_config_key_spelling(const ht_config *cfg, const char *key) {
    int i = ht_config_key_index(key);
    if (i < 0) return NULL;
    return cfg->alias[i] ? ht_config_aliases[cfg->alias[i] - 1].alias : ht_config_keys[i].path;
}

int ht_config_key_count(void) { return N_KEYS; }

const char *ht_config_key_name(int index) { return index >= 0 && index < N_KEYS ? ht_config_keys[index].path : NULL; }

/* ---------------------------------------------------------------- values derived from keys left unset */

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

bool ht_config_key_fixed_on_resume(const char *key) {
    /* Where the weights come from, recomputation and what is frozen; and
     * the sizes that shape the checkpoint's tensors, which the loader checks
     * tensor by tensor (training.load_strict: false loads across them on
     * purpose). num_attention_heads is not among them: it changes no shape. */
    static const char *const model_free[] = {"model.from_pretrained",
                                             "model.lora.from_pretrained",
                                             "model.recompute",
                                             "model.recompute_plan.apply_modules",
                                             "model.trust_remote_code",
                                             "model.initializer_range",
                                             "model.freeze",
                                             "model.vocab_size",
                                             "model.hidden_size",
                                             "model.intermediate_size",
                                             "model.num_hidden_layers",
                                             "model.num_key_value_heads",
                                             "model.head_dim",
                                             "model.attention_bias",
                                             "model.tie_word_embeddings",
                                             "model.num_experts",
                                             "model.moe_intermediate_size",
                                             "model.shared_expert_intermediate_size",
                                             "model.decoder_sparse_step",
                                             "model.mlp_only_layers",
                                             "model.n_shared_experts",
                                             "model.first_k_dense_replace",
                                             "model.multi_latent_attention",
                                             "model.kv_lora_rank",
                                             "model.q_lora_rank",
                                             "model.qk_nope_head_dim",
                                             "model.qk_rope_head_dim",
                                             "model.v_head_dim",
                                             "model.lora.rank",
                                             "model.lora.target_modules"};
    static const char *const data_fixed[] = {"data.path",           "data.dataset", "data.dataset_dir",
                                             "data.dataset_type",   "data.seq_len", "data.tokenizer",
                                             "data.valid_fraction", "data.shuffle", "data.drop_last",
                                             "data.sampler_type",   "data.collate"};
    int index = ht_config_key_index(key); /* another spelling of a key is that key */
    if (index < 0) return false;
    key = ht_config_keys[index].path;
    if (strncmp(key, "model.", 6) == 0) {
        for (size_t i = 0; i < sizeof(model_free) / sizeof(model_free[0]); i++)
            if (strcmp(key, model_free[i]) == 0) return false;
        return true;
    }
    for (size_t i = 0; i < sizeof(data_fixed) / sizeof(data_fixed[0]); i++)
        if (strcmp(key, data_fixed[i]) == 0) return true;
    return false;
}
