/* The run configuration: one YAML file (sections model, data, optimizer,
 * lr_scheduler, training, fsdp_config, checkpoint; see docs/CONFIG.md) plus
 * `--set section.key=value` overrides, loaded into a typed struct that
 * remembers where each value came from; cross-field validation; the
 * "Trainer config" log. All of it is driven by one table of keys in
 * src/config/keys.c. */
#ifndef HYPERTRAIN_CONFIG_H
#define HYPERTRAIN_CONFIG_H

#include "hypertrain/base.h"
#include "hypertrain/kernels.h"
#include "hypertrain/model.h"

#ifdef __cplusplus
extern "C" {
#endif

#define HT_CONFIG_STR_MAX 1024 /* bytes of a string value, NUL included */
#define HT_CONFIG_LIST_MAX 16  /* items of a string list */
#define HT_CONFIG_NS_MAX 32    /* segments of muon_ns_coefficients */
#define HT_CONFIG_NS_MAX_REPEAT                                                                                        \
    100                          /* iterations a segment may repeat: the longest schedule (optim.h HT_NS_MAX_STEPS) */
#define HT_CONFIG_MAX_KEYS 200   /* capacity of the per-key source tracking */
#define HT_CONFIG_IGNORED_MAX 32 /* keys a section that allows extra keys may ignore */

/* A nullable dtype that is null: model_init_dtype "keep", reduce_dtype "missing". */
#define HT_CONFIG_DTYPE_NONE HT_DTYPE_COUNT

typedef enum ht_config_source {
    HT_CONFIG_SOURCE_DEFAULT = 0,
    HT_CONFIG_SOURCE_FILE,
    HT_CONFIG_SOURCE_CLI,        /* --set */
    HT_CONFIG_SOURCE_PRETRAINED, /* model.from_pretrained's config.json (ht_config_use_pretrained) */
} ht_config_source;

typedef enum ht_config_optimizer {
    HT_CONFIG_OPTIMIZER_MUON = 0, /* Muon for matrices + AdamW for the rest */
    HT_CONFIG_OPTIMIZER_ADAMW,
} ht_config_optimizer;

/* The seven schedules of docs/NUMERICS.md, in its order. */
typedef enum ht_config_lr_schedule {
    HT_CONFIG_LR_CONSTANT_WARMUP = 0,  /* ConstantWarmUpLR */
    HT_CONFIG_LR_LINEAR_WARMUP,        /* LinearWithWarmUpLR */
    HT_CONFIG_LR_COSINE_WARMUP,        /* CosineWithWarmUpLR */
    HT_CONFIG_LR_COSINE_RESTARTS,      /* CosineWithRestartsAndWarmUpLR */
    HT_CONFIG_LR_POLYNOMIAL_WARMUP,    /* PolynomialWithWarmUpLR */
    HT_CONFIG_LR_WARMUP_STABLE_DECAY,  /* WarmUpStableDecayLR */
    HT_CONFIG_LR_COSINE_ANNEALING,     /* CosineAnnealingLR */
    HT_CONFIG_LR_CONSTANT_COOLDOWN,    /* ConstantWithCoolDownLR */
    HT_CONFIG_LR_COSINE_WARM_RESTARTS, /* CosineAnnealingWarmRestarts */
    HT_CONFIG_LR_WISE_LAYER,           /* LearningRateWiseLayer: named only to be refused (validate.c says why) */
} ht_config_lr_schedule;

typedef enum ht_config_ns_variant {
    HT_CONFIG_NS_LEGACY = 0,
    HT_CONFIG_NS_ASYM5,
    HT_CONFIG_NS_POLAR_EXPRESS,
    HT_CONFIG_NS_DEEPSEEK_V4,
    HT_CONFIG_NS_CUSTOM,
} ht_config_ns_variant;

typedef enum ht_config_loss_type { HT_CONFIG_LOSS_RAW = 0 } ht_config_loss_type;

typedef enum ht_config_momentum_style { HT_CONFIG_MOMENTUM_SUM = 0, HT_CONFIG_MOMENTUM_EMA } ht_config_momentum_style;

/* muon_ns_form: how the Newton-Schulz iteration is computed (docs/NUMERICS.md). */
/* optimizer.main_param_storage: how a bfloat16 weight's FP32 main param is held (docs/NUMERICS.md). */
typedef enum ht_config_main_storage { HT_CONFIG_MAIN_FP32 = 0, HT_CONFIG_MAIN_RESIDUAL16 } ht_config_main_storage;
/* parallel.pipeline_schedule: the order each stage runs its micro-batches' forwards and backwards in. */
typedef enum ht_config_pp_schedule { HT_CONFIG_PP_1F1B = 0, HT_CONFIG_PP_GPIPE } ht_config_pp_schedule;
typedef enum ht_config_ns_form { HT_CONFIG_NS_STANDARD = 0, HT_CONFIG_NS_GRAM, HT_CONFIG_NS_TORCH } ht_config_ns_form;

typedef enum ht_config_muon_comm {
    HT_CONFIG_MUON_COMM_ALLGATHER = 0,
    HT_CONFIG_MUON_COMM_DEREDUNDANCY
} ht_config_muon_comm;

/* Whose YAML a file is, told from the file itself (docs/CONFIG.md, Compatibility):
 * each dialect keeps its own system's defaults for the keys it leaves unset. */
typedef enum ht_config_dialect {
    HT_CONFIG_DIALECT_HYPERTRAIN = 0,
    HT_CONFIG_DIALECT_HYPERPARALLEL, /* optimizer._target_: hyper_parallel.auto_models... */
    HT_CONFIG_DIALECT_MINDFORMERS,   /* optimizer: {type: AdamW | Muon, ...} */
    HT_CONFIG_DIALECT_MINDSPEED,     /* parallel:, data.dataset_param, training.* (MindSpeed-MM's FSDP2 trainer) */
} ht_config_dialect;

const char *ht_config_dialect_name(ht_config_dialect dialect); /* "hypertrain", "HyperParallel", ... */

typedef struct ht_config_strings {
    int count;
    char items[HT_CONFIG_LIST_MAX][HT_CONFIG_STR_MAX];
} ht_config_strings;

/* muon_ns_coefficients. count 0: null (the variant's own schedule).
 * [a, b, c] -> one segment with repeat 0 (meaning: ns_steps times);
 * [[a, b, c], ...] -> one segment per triple, repeat 1;
 * [[[a, b, c], n], ...] -> segments with repeat n, expanded in order. */
typedef struct ht_config_ns_coefficients {
    int count;
    double abc[HT_CONFIG_NS_MAX][3];
    int repeat[HT_CONFIG_NS_MAX];
} ht_config_ns_coefficients;

/* A switch that may name a directory (training.tensorboard): false, true
 * (the run's own place for it), or a directory (on). */
typedef struct ht_config_switch_path {
    bool on;
    char path[HT_CONFIG_STR_MAX]; /* "": the default place; else the directory given */
} ht_config_switch_path;

/* A switch that may name steps (training.trace): false, true (every step),
 * or a list of steps (on for those). */
#define HT_CONFIG_STEPS_MAX 64
typedef struct ht_config_steps {
    bool on;
    int count; /* 0: every step; else the steps in items */
    int64_t items[HT_CONFIG_STEPS_MAX];
} ht_config_steps;

/* model.lora (PEFT's LoraConfig names are aliases): the model's ht_lora_config comes from it. */
typedef struct ht_config_lora {
    int rank; /* 0: off */
    double alpha, dropout;
    ht_config_strings target_modules;
    bool use_rslora;
    bool use_muon;                           /* the adapters go to Muon (with _target_ Muon); false: AdamW */
    char from_pretrained[HT_CONFIG_STR_MAX]; /* a PEFT adapter directory to start from, or "" */
} ht_config_lora;

/* The whole run configuration. A plain value: no heap memory, copy it freely. */
typedef struct ht_config {
    struct {
        ht_model_config arch;                    /* model.name and the architecture keys */
        char from_pretrained[HT_CONFIG_STR_MAX]; /* "" (null): build from scratch */
        /* MindSpeed-MM's model keys (docs/DIALECTS.md). */
        ht_config_strings freeze;            /* module or param patterns taken out of training */
        bool trust_remote_code;              /* no remote code runs here: logged */
        int loss_type;                       /* HT_CONFIG_LOSS_RAW: the model's own mean cross-entropy */
        bool recompute;                      /* recompute_plan.apply_modules recompute in backward */
        ht_config_strings recompute_modules; /* recompute_plan.apply_modules: used with recompute only */
        ht_config_lora lora;
        /* MindFormers' switch for Multi-Latent Attention: true asks for a model
         * that has it (deepseek_v3), false for one that has not; unset: whichever
         * model.name is. */
        bool multi_latent_attention;
    } model;
    ht_dtype model_init_dtype; /* HT_CONFIG_DTYPE_NONE: keep */

    struct {
        char dataset_type[64]; /* data registry name */
        char path[HT_CONFIG_STR_MAX];
        int seq_len;
        double valid_fraction; /* [0, 1) */
        bool shuffle;          /* the training windows in a seeded order per epoch; false: in order */
        bool drop_last;        /* the windows an epoch cannot fill a global batch with are skipped (always) */
        int num_workers;       /* accepted, not applicable: batches are read in place from memory */
        bool pin_memory;       /* accepted, not applicable: no device memory */
        char dataloader_mode[64], sampler_type[64], collate[64]; /* the one mode, sampler and collator there is */
        char tokenizer[HT_CONFIG_STR_MAX];   /* the tokenizer folder token_bin shards were made with, or "" */
        char dataset_dir[HT_CONFIG_STR_MAX]; /* MindSpeed-MM's basic_parameters: path = dataset_dir/dataset */
        char dataset[HT_CONFIG_STR_MAX];
    } data;

    /* The mesh's axes beyond data (docs/DESIGN.md, The mesh): MindSpeed-MM's and Megatron's names. */
    struct {
        int tensor_parallel_size, ring_attention_size, ulysses_parallel_size, expert_parallel_size;
        int pipeline_parallel_size;               /* stages of whole decoder layers, the outermost axis */
        ht_config_pp_schedule pipeline_schedule;  /* with pipeline_parallel_size > 1 */
        int virtual_pipeline_model_parallel_size; /* model chunks a stage holds: > 1, interleaved 1F1B */
        bool sequence_parallel;       /* with tensor_parallel_size > 1: the residual stream split over its ranks */
        ht_config_strings ep_modules; /* ep_plan.apply_modules: used with expert_parallel_size > 1 only */
    } parallel;

    struct {
        ht_config_optimizer type; /* _target_ (HyperParallel) or type (MindFormers) */
        bool fp32_main_params;
        ht_config_main_storage main_param_storage;
        struct {
            double lr, weight_decay, momentum;
            bool nesterov;
            int ns_steps;
            ht_config_ns_variant ns_variant;
            ht_config_ns_coefficients ns_coefficients;
            double ns_eps;
            double matched_adamw_rms;
            ht_config_momentum_style momentum_style;
            ht_config_muon_comm comm_strategy;
            ht_config_strings adamw_include;
            bool qk_clip_enabled;
            double qk_clip_threshold;
            ht_dtype ns_dtype; /* the dtype the Newton-Schulz GEMMs run in: HT_DTYPE_F32 or HT_DTYPE_BF16 */
            ht_config_ns_form ns_form;
        } muon;
        struct {
            double lr, weight_decay;
            double betas[2];
            double eps;
            ht_config_strings no_weight_decay;
            ht_config_strings weight_decay_include; /* decayed even where no_weight_decay says otherwise */
            ht_config_strings weight_decay_exclude; /* never decayed */
        } adamw;
        bool accumulate_allreduce_grads_in_fp32; /* MindFormers' name for what is always true here */
        bool use_fused_adamw;                    /* accepted: the fused AdamW pass is the only one */
        bool stochastic_rounding; /* main_param -> model dtype cast rounds stochastically (docs/NUMERICS.md) */
    } optimizer;

    /* Total steps are training.steps; see docs/NUMERICS.md for the formulas. */
    struct {
        ht_config_lr_schedule type;
        double warmup_ratio; /* wins over warmup_steps when given: ht_config_warmup_steps */
        int warmup_steps;
        double warmup_lr_init;
        double lr_end;
        double num_cycles;
        int decay_steps;    /* 0: T (cosine) or T - W (polynomial); resolved by ht_config_decay_steps */
        double decay_ratio; /* wins over decay_steps when given: ht_config_decay_steps */
        double power;
        int decay_start_steps; /* WarmUpStableDecayLR: wins over decay_start_ratio when given */
        double decay_start_ratio;
        double eta_min;
        int t_max;       /* CosineAnnealingLR; 0: T */
        int keep_steps;  /* ConstantWithCoolDownLR */
        double lr_end1;  /* ConstantWithCoolDownLR */
        int final_steps; /* ConstantWithCoolDownLR */
        double lr_end2;  /* ConstantWithCoolDownLR; not given: lr_end1 (ht_config_lr_end2) */
        int t_0;         /* CosineAnnealingWarmRestarts */
        int t_mult;      /* CosineAnnealingWarmRestarts */
    } lr_scheduler;

    struct {
        int steps;
        int local_batch_size;  /* sequences per micro-batch per data-parallel rank */
        int global_batch_size; /* accumulation = global / (local * data_parallel) */
        double max_norm;
        double gradient_scaling_factor; /* every gradient times this before the reduction (HyperParallel's
                                           set_gradient_scaling_factor) */
        int64_t seed;
        bool deterministic;
        /* Every step's whole main_grads (before clipping) and params (after
         * the update, in the model's dtype) written by rank 0 to
         * <output_dir>/state/step_<n>.safetensors: for comparing runs. */
        bool dump_state;
        bool init_model_with_meta_device;   /* each rank builds only its rows */
        int gradient_accumulation_steps;    /* MindSpeed-MM's; 0 (null): derived from global_batch_size */
        bool no_save_rng, no_load_rng;      /* the seed and data positions: not saved / not restored */
        bool load_strict;                   /* false: missing or extra model tensors of a resume warn */
        char save[HT_CONFIG_STR_MAX];       /* MindSpeed-MM's training.save: the output_dir, or "" */
        bool profile;                       /* tools.profile: a per-phase timing table at the end */
        bool memory_profile;                /* tools.memory_profile: peak memory by category at the end */
        ht_config_switch_path tensorboard;  /* TensorBoard event files (rank 0): output_dir/tensorboard or path */
        ht_config_steps trace;              /* trace_rank{r}.json of these steps (every rank, its own) */
        double distributed_timeout_minutes; /* a collective waiting longer ends the world; 0: never */
        int log_interval;
        int eval_interval; /* 0: never */
        int eval_batches;  /* validation batches per evaluation */
        /* A sample of sample_tokens tokens continuing sample_prompt ("": a
         * newline) every sample_interval steps and at the end (0: never) */
        int sample_interval, sample_tokens;
        char sample_prompt[HT_CONFIG_STR_MAX];
        ht_config_strings plugin;
        /* fp16 dynamic loss scaling (docs/NUMERICS.md, Megatron's DynamicGradScaler). */
        double loss_scale_initial;
        int loss_scale_growth_interval; /* clean steps between growths */
        double loss_scale_growth_factor;
        double loss_scale_backoff_factor;
        int loss_scale_hysteresis; /* overflows tolerated before a backoff */
        double loss_scale_min;
    } training;

    struct {
        int shard_size;                  /* 0: auto */
        ht_config_strings apply_modules; /* the modules that are FSDP units (the rest: the root unit) */
        ht_config_strings hook_modules;  /* MindSpeed-MM's: [] or apply_modules (hooks follow the units) */
        bool reshard_after_forward;
        bool prefetch;
        ht_dtype param_dtype;
        ht_dtype reduce_dtype; /* HT_CONFIG_DTYPE_NONE: missing (only legal without fp32_main_params) */
        ht_dtype output_dtype;
        bool cast_forward_inputs;
    } fsdp;

    /* How bf16 and f16 products run (kernels.h): auto (measured at start), or pinned. */
    struct {
        /* The kernel table the run computes on: the CPU's, the fenced one
         * (the CPU's kernels on memory host code cannot touch: a check of the
         * seam), or CUDA's (one process). */
        ht_kernel_backend backend;
        ht_gemm_kernel bf16_gemm, f16_gemm;
        /* The LM head and the loss run over chunks of tokens whose FP32
         * logits hold at most this many MiB, backward computing them again
         * (one more head GEMM); 0: the whole logits at once (no recompute). */
        int lm_head_chunk_mib;
    } kernels;

    struct {
        char output_dir[HT_CONFIG_STR_MAX];
        int save_interval; /* 0: never */
        bool save_optimizer;
        int keep_last;                        /* 0: keep all */
        char restore_from[HT_CONFIG_STR_MAX]; /* "" (null), a directory, or "latest" */
        bool restore_optimizer;
        bool overwrite;                  /* a fresh run may replace the run already in output_dir */
        ht_config_strings allow_changes; /* keys fixed on resume that this resume may change */
    } checkpoint;

    /* The dialect the optimizer block is written in: its system's defaults
     * apply to the keys the run leaves unset (docs/CONFIG.md, Compatibility). */
    ht_config_dialect dialect;

    /* Keys of a section whose system accepts extra keys there (MindFormers'
     * optimizer and lr_scheduler: allow_extra), kept to be logged as ignored. */
    int ignored_count;
    char ignored[HT_CONFIG_IGNORED_MAX][256];
    int ignored_line[HT_CONFIG_IGNORED_MAX];

    /* Where each key's value came from, indexed like the key table. */
    char file[HT_CONFIG_STR_MAX]; /* the loaded file, "" if none */
    uint8_t source[HT_CONFIG_MAX_KEYS];
    int line[HT_CONFIG_MAX_KEYS];      /* 1-based line in `file`, 0 when not from the file */
    uint8_t alias[HT_CONFIG_MAX_KEYS]; /* 0: set by its own name; a + 1: by alias a (ht_config_key_spelling) */
    uint8_t dialect_default[HT_CONFIG_MAX_KEYS]; /* the value is the dialect's default, not hypertrain's */
} ht_config;

/* Every key at its default (all sources: default). */
void ht_config_defaults(ht_config *cfg);

/* Defaults, then the YAML file at `path` (NULL: none), then each "key=value"
 * override in order. Errors name the file (or the --set argument), the line,
 * the dotted key, what was expected and what was found. Does not validate
 * cross-field rules: call ht_config_validate. */
ht_status ht_config_load(const char *path, int n_overrides, char *const *overrides, ht_config *cfg, ht_error *err);

/* Applies one "section.key=value" override (value: a YAML scalar, or a flow
 * sequence for list keys; "null" or empty for null). Source: command line. */
ht_status ht_config_set(ht_config *cfg, const char *assignment, ht_error *err);

/* The cross-field rules of docs/CONFIG.md for a run on `world` ranks (the
 * data-parallel size is world / (ulysses x ring)); lists every violation,
 * one per line. Never changes a value. */
ht_status ht_config_validate(const ht_config *cfg, int world, ht_error *err);
/* ht_config_validate's rules for the learning-rate schedule alone (lr_scheduler.* and
 * training.steps): what hypertrain.lr_scheduler checks from Python. */
ht_status ht_config_validate_lr_scheduler(const ht_config *cfg, ht_error *err);
/* The data-parallel size of a valid config on `world` ranks. */
int ht_config_data_parallel_size(const ht_config *cfg, int world);

/* model.from_pretrained: the architecture in force is the folder's
 * config.json (`arch`, as ht_hf_read_config reads it), not the file's or the
 * defaults. Its values replace every model key it describes (model.lora.*
 * stays), with the source "config.json of <folder>"; a key the file or the
 * command line set to another value is named in a warning, as unused. */
void ht_config_use_pretrained(ht_config *cfg, const ht_model_config *arch);

/* Logs "Trainer config": every key, its final value, and its source. */
void ht_config_log(const ht_config *cfg);

/* Logs an "Effective <title> config" table of every key whose dotted name
 * starts with `prefix` (e.g. "optimizer.muon_config."): its default (the
 * table's text), the configured value ("-" when not configured) with where it
 * came from (file and line, or command line, and the spelling when an alias
 * set it), and the final value. */
void ht_config_log_section(const ht_config *cfg, const char *title, const char *prefix);

/* Whether a key says what the model computes or what data it reads, in a way
 * the checkpoint's tensors do not pin (every model.* key but where its weights
 * come from, recomputation, what is frozen and the sizes that shape tensors,
 * which the loader checks itself; the data's files, split, order and sequence
 * length): a resume refuses a change to one unless checkpoint.allow_changes
 * names it. */
bool ht_config_key_fixed_on_resume(const char *key);

/* The keys in table order (canonical dotted names), for dumps and tools. */
int ht_config_key_count(void);
const char *ht_config_key_name(int index);
/* Index of a dotted key or another spelling of it (an alias, or a section
 * alias such as MindFormers' lr_schedule for lr_scheduler); -1 if unknown,
 * and -1 for a shared alias (one value for several keys, such as MindFormers'
 * lr_scheduler.learning_rate), which is not one key. */
int ht_config_key_index(const char *key);
/* The name that set the key's current value: the canonical name, or the
 * alias used (e.g. "lr_scheduler.learning_rate" for muon_lr); NULL if the key
 * is unknown. */
const char *ht_config_key_spelling(const ht_config *cfg, const char *key);
/* Source of a key's value and, when from the file, its line (else 0). Unknown key: default, 0. */
ht_config_source ht_config_key_source(const ht_config *cfg, const char *key, int *line);
const char *ht_config_source_name(ht_config_source source);
/* The key's value as YAML text (e.g. `0.001`, `bfloat16`, `["*bias*", "*norm*"]`, `null`);
 * false if the key is unknown. Truncates to n bytes. */
bool ht_config_format_value(const ht_config *cfg, const char *key, char *buf, size_t n);

/* W of docs/NUMERICS.md: floor(steps * warmup_ratio) if warmup_ratio was given
 * (file or command line), else warmup_steps. */
int ht_config_warmup_steps(const ht_config *cfg);
/* S of WarmUpStableDecayLR: decay_start_steps if given, else floor(steps * decay_start_ratio). */
int ht_config_decay_start_steps(const ht_config *cfg);
/* D: floor(steps * decay_ratio) if decay_ratio was given, else decay_steps (as MindFormers
 * resolves warmup_ratio / warmup_steps, the ratio wins). */
int ht_config_decay_steps(const ht_config *cfg);
/* ConstantWithCoolDownLR's lr_end2: its value if given, else lr_end1 (MindFormers: None). */
double ht_config_lr_end2(const ht_config *cfg);

#ifdef __cplusplus
}
#endif
#endif
