/* The dialects: whose YAML a file is (hypertrain's, HyperParallel's,
 * MindFormers', MindSpeed-MM's), each one's defaults for the keys a run
 * leaves unset, and the keys MindSpeed-MM spells as parts of hypertrain's. */
#include "config/config_internal.h"

#include <stdio.h>
#include <string.h>

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
void ht_config_detect_dialect(yaml_document_t *doc, const yaml_node_t *root, ht_config *cfg) {
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
/* Defaults that depend on model.name: DeepSeek-V3's attention has no biases
 * and its routing normalises the chosen weights (DeepseekV3Config's defaults). */
static const struct {
    const char *model, *key, *value;
} MODEL_DEFAULTS[] = {
    {"deepseek_v3", "model.attention_bias", "false"},
    {"deepseek_v3", "model.norm_topk_prob", "true"},
};

/* Defaults that depend on lr_scheduler.type, in every dialect: CosineWithRestartsAndWarmUpLR's
 * cycles are whole (MindFormers' default 1.0; 0.5, the cosine's half wave, would end it at 0.54x
 * the base lr). */
static const struct {
    ht_config_lr_schedule type;
    const char *key, *value;
} SCHEDULE_DEFAULTS[] = {
    {HT_CONFIG_LR_COSINE_RESTARTS, "lr_scheduler.num_cycles", "1.0"},
};

void ht_config_apply_dialect_defaults(ht_config *cfg) {
    origin o = {NULL, NULL, HT_CONFIG_SOURCE_DEFAULT};
    for (size_t d = 0; d < sizeof(SCHEDULE_DEFAULTS) / sizeof(SCHEDULE_DEFAULTS[0]); d++) {
        int i = ht_config_key_index_exact(SCHEDULE_DEFAULTS[d].key);
        if (cfg->lr_scheduler.type != SCHEDULE_DEFAULTS[d].type || cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT) continue;
        ht_error err;
        if (ht_config_assign_text(cfg, i, SCHEDULE_DEFAULTS[d].value, &o, -1, &err) != HT_OK)
            ht_log(HT_LOG_ERROR, "config table: %s", err.msg);
    }
    for (size_t d = 0; d < sizeof(MODEL_DEFAULTS) / sizeof(MODEL_DEFAULTS[0]); d++) {
        int i = ht_config_key_index_exact(MODEL_DEFAULTS[d].key);
        if (strcmp(cfg->model.arch.name, MODEL_DEFAULTS[d].model) != 0 || cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT)
            continue;
        ht_error err;
        if (ht_config_assign_text(cfg, i, MODEL_DEFAULTS[d].value, &o, -1, &err) != HT_OK)
            ht_log(HT_LOG_ERROR, "config table: %s", err.msg);
    }
    for (int d = 0; d < N_DIALECT_DEFAULTS; d++) {
        int i = ht_config_key_index_exact(DIALECT_DEFAULTS[d].key);
        if (DIALECT_DEFAULTS[d].dialect != cfg->dialect || cfg->source[i] != HT_CONFIG_SOURCE_DEFAULT ||
            !default_applies(cfg, DIALECT_DEFAULTS[d].when))
            continue;
        ht_error err;
        /* Only a broken table entry can fail; test_config loads every dialect's defaults. */
        if (ht_config_assign_text(cfg, i, DIALECT_DEFAULTS[d].value, &o, -1, &err) != HT_OK)
            ht_log(HT_LOG_ERROR, "config table: %s", err.msg);
        cfg->dialect_default[i] = 1;
    }
}

/* Sets key `to` from key `from`'s value, with its source: one key a dialect
 * spells as parts of another (MindSpeed-MM's dataset_dir + dataset). */
static void take_source(ht_config *cfg, const char *to, const char *from) {
    int t = ht_config_key_index_exact(to), f = ht_config_key_index_exact(from);
    cfg->source[t] = cfg->source[f];
    cfg->line[t] = cfg->line[f];
    cfg->alias[t] = cfg->alias[f];
}

/* MindSpeed-MM's keys that are parts or switches of hypertrain's: the data
 * path as basic_parameters' dataset_dir and dataset; training.save, the
 * checkpoint root (null: no checkpoints are saved). A hypertrain key given
 * alongside is an error rather than a silent choice. */
ht_status ht_config_resolve_parts(ht_config *cfg, ht_error *err) {
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
