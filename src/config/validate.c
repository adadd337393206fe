/* Cross-field rules of docs/CONFIG.md ("errors before anything is built"): every
 * violation is listed, each naming its key and where the value came from.
 * Nothing here changes a value; a rule that fails is reported, never fixed. */
#include "hypertrain/config.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

_Static_assert(HT_CONFIG_LIST_MAX <= HT_LORA_MAX_TARGETS, "model.lora.target_modules fits ht_lora_config.targets");

typedef struct report {
    const ht_config *cfg;
    char msg[HT_ERROR_MSG_MAX];
    size_t used;
    int count;
    int world; /* the ranks of the run */
} report;

/* "f.yaml:12: training.max_norm", "training.max_norm (--set)" or "training.max_norm (default)";
 * set through an alias: "f.yaml:12: optimizer.muon_config.muon_lr (as lr_scheduler.learning_rate)". */
static const char *at(const ht_config *cfg, const char *key, char *buf, size_t n) {
    int line = 0;
    ht_config_source src = ht_config_key_source(cfg, key, &line);
    const char *spelling = ht_config_key_spelling(cfg, key);
    char as[300] = "";
    if (spelling && strcmp(spelling, key) != 0) snprintf(as, sizeof(as), " (as %s)", spelling);
    if (src == HT_CONFIG_SOURCE_FILE && line > 0)
        snprintf(buf, n, "%s:%d: %s%s", cfg->file, line, key, as);
    else if (src == HT_CONFIG_SOURCE_CLI)
        snprintf(buf, n, "%s%s (--set)", key, as);
    else
        snprintf(buf, n, "%s (default)", key);
    return buf;
}

static void add(report *r, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(report *r, const char *fmt, ...) {
    r->count++;
    if (r->used + 1 >= sizeof(r->msg)) return;
    if (r->used) r->msg[r->used++] = '\n';
    va_list ap;
    va_start(ap, fmt);
    int w = vsnprintf(r->msg + r->used, sizeof(r->msg) - r->used, fmt, ap);
    va_end(ap);
    if (w > 0) r->used += (size_t)w < sizeof(r->msg) - r->used ? (size_t)w : sizeof(r->msg) - r->used - 1;
}

/* One-key rules: `ok` false -> "<where>: expected <want>, found <value>". */
static void check(report *r, bool ok, const char *key, const char *want) {
    if (ok) return;
    char where[HT_CONFIG_STR_MAX + 160], value[256];
    ht_config_format_value(r->cfg, key, value, sizeof(value));
    add(r, "%s: expected %s, found %s", at(r->cfg, key, where, sizeof(where)), want, value);
}

static bool is_float_dtype(ht_dtype dt) { return dt == HT_DTYPE_F32 || dt == HT_DTYPE_BF16 || dt == HT_DTYPE_F16; }

/* η ≤ lr_end for PolynomialWithWarmUpLR makes (η − lr_end)·(1 − x)^power grow or stall (docs/NUMERICS.md). */
static void check_polynomial(report *r, const char *lr_key, double lr) {
    const ht_config *cfg = r->cfg;
    if (cfg->lr_scheduler.type != HT_CONFIG_LR_POLYNOMIAL_WARMUP || lr > cfg->lr_scheduler.lr_end) return;
    char a[HT_CONFIG_STR_MAX + 160], b[HT_CONFIG_STR_MAX + 160];
    /* Named as the user wrote it: MindFormers' one lr_scheduler.learning_rate for both optimizers. */
    const char *spelling = ht_config_key_spelling(cfg, lr_key);
    add(r,
        "%s: PolynomialWithWarmUpLR decays from the base lr down to lr_end, so expected %s > lr_end, found %g <= %g "
        "(%s)",
        at(cfg, lr_key, a, sizeof(a)), spelling ? spelling : lr_key, lr, cfg->lr_scheduler.lr_end,
        at(cfg, "lr_scheduler.lr_end", b, sizeof(b)));
}

static bool same_strings(const ht_config_strings *a, const ht_config_strings *b) {
    if (a->count != b->count) return false;
    for (int i = 0; i < a->count; i++)
        if (strcmp(a->items[i], b->items[i]) != 0) return false;
    return true;
}

/* The mesh (docs/DESIGN.md, The mesh): the world is data parallel x context
 * parallel (parallel.ulysses_parallel_size U x parallel.ring_attention_size
 * R) x tensor parallel (parallel.tensor_parallel_size). Returns the
 * data-parallel size, 0 when the world does not factor. */
static int check_mesh(report *r, int world) {
    const ht_config *cfg = r->cfg;
    const int U = cfg->parallel.ulysses_parallel_size, R = cfg->parallel.ring_attention_size, T = cfg->data.seq_len;
    const int TP = cfg->parallel.tensor_parallel_size;
    char a[HT_CONFIG_STR_MAX + 160], b[HT_CONFIG_STR_MAX + 160], c[HT_CONFIG_STR_MAX + 160];
    check(r, U >= 1, "parallel.ulysses_parallel_size", "an integer >= 1");
    check(r, R >= 1, "parallel.ring_attention_size", "an integer >= 1");
    check(r, TP >= 1, "parallel.tensor_parallel_size", "an integer >= 1");
    const int PP = cfg->parallel.pipeline_parallel_size;
    check(r, PP >= 1, "parallel.pipeline_parallel_size", "an integer >= 1");
    if (U < 1 || R < 1 || TP < 1 || PP < 1 || world < 1) return 0;
    if (world % PP != 0) {
        add(r,
            "%s: %d does not divide the %d ranks: the world is pipeline stages x data parallel x context parallel x "
            "tensor parallel, so expected a world that is a multiple of %d",
            at(cfg, "parallel.pipeline_parallel_size", a, sizeof(a)), PP, world, PP);
        return 0;
    }
    world /= PP; /* the ranks of one stage */
    const int cp = U * R;
    if (world % (cp * TP) != 0) {
        add(r,
            "%s x %s x %s: context parallel %d x %d times tensor parallel %d = %d does not divide the %d ranks: the "
            "world is data parallel x context parallel x tensor parallel, so expected a world that is a multiple of "
            "%d",
            at(cfg, "parallel.ulysses_parallel_size", a, sizeof(a)),
            at(cfg, "parallel.ring_attention_size", b, sizeof(b)),
            at(cfg, "parallel.tensor_parallel_size", c, sizeof(c)), U, R, TP, cp * TP, world, cp * TP);
        return 0;
    }
    const ht_model_config *m = &cfg->model.arch;
    const int H = m->num_attention_heads, KV = ht_model_config_has_mla(m) ? H : m->num_key_value_heads;
    if (TP > 1 && !cfg->model.from_pretrained[0] && (H % TP != 0 || KV % TP != 0)) {
        char which[160];
        if (H % TP != 0 && KV % TP != 0)
            snprintf(which, sizeof(which), "it divides neither");
        else
            snprintf(which, sizeof(which), "it does not divide %s (%d)",
                     H % TP ? "model.num_attention_heads" : "model.num_key_value_heads", H % TP ? H : KV);
        add(r,
            "%s: %d: tensor parallelism gives each rank whole heads, so it must divide both "
            "model.num_attention_heads (%d) and model.num_key_value_heads (%d); %s",
            at(cfg, "parallel.tensor_parallel_size", a, sizeof(a)), TP, H, KV, which);
    }
    if (TP > 1 && cfg->parallel.sequence_parallel && T > 0 && (T % cp != 0 || (T / cp) % TP != 0))
        add(r,
            "%s: %d: under sequence parallelism each of the %d ranks of a tensor-parallel group holds as many of "
            "the %d tokens of every sequence a rank computes (data.seq_len / context parallel %d); expected a "
            "multiple of %d, or parallel.sequence_parallel false",
            at(cfg, "data.seq_len", a, sizeof(a)), T, TP, cp > 0 ? T / cp : T, cp, cp * TP);
    if (cp == 1) return world / TP;
    if (R > 1 && T > 0 && T % (2 * R) != 0)
        add(r,
            "%s: %d does not cut into 2 x parallel.ring_attention_size = %d chunks (ring attention's balanced layout: "
            "ring rank r holds chunks r and %d - r); expected a multiple of %d",
            at(cfg, "data.seq_len", a, sizeof(a)), T, 2 * R, 2 * R - 1, 2 * R);
    if (T > 0 && T % cp != 0)
        add(r,
            "%s: %d: each of the %d ranks of a context-parallel group (Ulysses %d x ring %d) holds as many tokens of "
            "every sequence; expected a multiple of %d",
            at(cfg, "data.seq_len", a, sizeof(a)), T, cp, U, R, cp);
    /* Ulysses splits the heads a tensor-parallel rank holds. */
    if (U > 1 && !cfg->model.from_pretrained[0] && H % TP == 0 && KV % TP == 0 &&
        ((H / TP) % U != 0 || (KV / TP) % U != 0))
        add(r,
            "%s: %d does not divide the %d attention heads and %d key/value heads %s: Ulysses gives each rank "
            "whole heads of every sequence",
            at(cfg, "parallel.ulysses_parallel_size", a, sizeof(a)), U, H / TP, KV / TP,
            TP > 1 ? "of a tensor-parallel rank" : "(model.num_attention_heads, model.num_key_value_heads)");
    return world / (cp * TP);
}

/* Pipeline parallelism (docs/DESIGN.md, Pipeline parallelism): stages of
 * whole decoder layers, the micro-batches of a step (the gradient
 * accumulation) flowing through them. What it does not compose with yet is
 * refused by name. */
static void check_pipeline(report *r, int accumulation) {
    const ht_config *cfg = r->cfg;
    const int PP = cfg->parallel.pipeline_parallel_size, V = cfg->parallel.virtual_pipeline_model_parallel_size;
    char a[HT_CONFIG_STR_MAX + 160], b[HT_CONFIG_STR_MAX + 160];
    const char *vkey = "parallel.virtual_pipeline_model_parallel_size";
    if (V < 1 || V > HT_PIPELINE_CHUNKS_MAX)
        add(r, "%s: %d; expected an integer from 1 to %d", at(cfg, vkey, a, sizeof(a)), V, HT_PIPELINE_CHUNKS_MAX);
    if (V > 1 && PP <= 1)
        add(r, "%s: %d model chunks a stage need pipeline stages; expected parallel.pipeline_parallel_size > 1 (%s)",
            at(cfg, vkey, a, sizeof(a)), V, at(cfg, "parallel.pipeline_parallel_size", b, sizeof(b)));
    if (PP <= 1 || V < 1) return;
    at(cfg, "parallel.pipeline_parallel_size", a, sizeof(a));
    const ht_model_config *m = &cfg->model.arch;
    if (!cfg->model.from_pretrained[0] && m->num_hidden_layers < PP * V)
        add(r,
            "%s: %d stages x %d chunks, but the model has %d layers (model.num_hidden_layers): each model stage holds "
            "at least one",
            a, PP, V, m->num_hidden_layers);
    if (V > 1 && cfg->parallel.pipeline_schedule == HT_CONFIG_PP_GPIPE)
        add(r, "%s: %d model chunks a stage run the interleaved 1F1B schedule; expected pipeline_schedule: 1f1b (%s)",
            at(cfg, vkey, b, sizeof(b)), V, a);
    if (V > 1 && accumulation > 0 && accumulation % PP != 0)
        add(r,
            "%s: %d: interleaved 1F1B takes the micro-batches in groups of the %d stages, and a step here has %d "
            "(the gradient accumulation); expected a multiple of %d",
            at(cfg, vkey, b, sizeof(b)), V, PP, accumulation, PP);
    const struct {
        bool on;
        const char *key, *what;
    } no[] = {
        {cfg->training.dump_state, "training.dump_state", "training.dump_state"},
        {cfg->kernels.backend != HT_KERNELS_CPU, "kernels.backend", "a kernel backend other than cpu"},
    };
    for (size_t i = 0; i < sizeof(no) / sizeof(no[0]); i++)
        if (no[i].on)
            add(r, "%s: not supported with %s yet (%s); expected parallel.pipeline_parallel_size 1", a, no[i].what,
                at(cfg, no[i].key, b, sizeof(b)));
    if (cfg->parallel.pipeline_schedule == HT_CONFIG_PP_1F1B && accumulation > 0 && accumulation < PP)
        add(r,
            "%s: 1f1b over %d stages needs at least %d micro-batches a step, and a step here has %d (the gradient "
            "accumulation: training.global_batch_size / (local_batch_size x data parallel)); raise the global batch "
            "or set parallel.pipeline_schedule: gpipe",
            at(cfg, "parallel.pipeline_schedule", b, sizeof(b)), PP, PP, accumulation);
}

/* MindSpeed-MM's keys whose other values ask for what hypertrain does not do
 * (yet): each refusal says why. docs/DIALECTS.md lists them. */
static void check_mindspeed(report *r) {
    const ht_config *cfg = r->cfg;
    char a[HT_CONFIG_STR_MAX + 160];
    /* Expert parallelism: P ranks split each sparse layer's experts; the
     * world is W / P groups of consecutive ranks holding the same experts. */
    const int pp = cfg->parallel.pipeline_parallel_size > 1 ? cfg->parallel.pipeline_parallel_size : 1;
    const int ep = cfg->parallel.expert_parallel_size, world = r->world / pp; /* a pipeline stage's ranks */
    if (ep < 1) {
        add(r, "%s: expected an integer >= 1, found %d", at(cfg, "parallel.expert_parallel_size", a, sizeof(a)), ep);
    } else if (ep > 1) {
        if (!cfg->model.from_pretrained[0] && strcmp(cfg->model.arch.name, "qwen2_moe") != 0 &&
            strcmp(cfg->model.arch.name, "deepseek_v3") != 0)
            add(r, "%s: %d, but model.name %s has no experts (model.name qwen2_moe and deepseek_v3 have)",
                at(cfg, "parallel.expert_parallel_size", a, sizeof(a)), ep, cfg->model.arch.name);
        const int tp = cfg->parallel.tensor_parallel_size > 0 ? cfg->parallel.tensor_parallel_size : 1;
        if ((world / tp) % ep != 0 && tp == 1)
            add(r, "%s: %d does not divide the %d ranks: each group of %d ranks splits the experts",
                at(cfg, "parallel.expert_parallel_size", a, sizeof(a)), ep, world, ep);
        else if ((world / tp) % ep != 0)
            add(r,
                "%s: %d does not divide the %d data x context-parallel ranks (%d ranks over tensor parallel %d): "
                "each group of %d of them splits the experts",
                at(cfg, "parallel.expert_parallel_size", a, sizeof(a)), ep, world / tp, world, tp, ep);
        if (cfg->fsdp.shard_size != 0 && cfg->fsdp.shard_size != world)
            add(r,
                "%s: not supported with parallel.expert_parallel_size %d: expert parallelism here shards over "
                "the whole world (auto or %d), not HSDP groups",
                at(cfg, "fsdp_config.shard_size", a, sizeof(a)), ep, world);
    }
    if (cfg->fsdp.hook_modules.count && !same_strings(&cfg->fsdp.hook_modules, &cfg->fsdp.apply_modules))
        add(r,
            "%s: not supported: other modules than the FSDP units; hypertrain hooks and prefetches unit by unit, so "
            "expected [] or the same list as fsdp_config.apply_modules",
            at(cfg, "fsdp_config.hook_modules", a, sizeof(a)));
    if (!cfg->data.drop_last)
        add(r,
            "%s: not supported: false asks for a last, smaller batch; every batch here is full, and the windows an "
            "epoch cannot fill a global batch with are skipped (true)",
            at(cfg, "data.drop_last", a, sizeof(a)));
    if (strcmp(cfg->data.dataloader_mode, "sampler") != 0)
        add(r, "%s: not supported: %s; expected sampler (the only mode here)",
            at(cfg, "data.dataloader_mode", a, sizeof(a)), cfg->data.dataloader_mode);
    if (strcmp(cfg->data.sampler_type, "BaseRandomBatchSampler") != 0)
        add(r,
            "%s: not supported: %s; expected BaseRandomBatchSampler (batches of windows in a seeded order per epoch, "
            "or in order with data.shuffle false)",
            at(cfg, "data.sampler_type", a, sizeof(a)), cfg->data.sampler_type);
    if (strcmp(cfg->data.collate, "llm_pretrain") != 0)
        add(r, "%s: not supported: %s; expected llm_pretrain (input ids and their next tokens: a text model's batch)",
            at(cfg, "data.collate", a, sizeof(a)), cfg->data.collate);
    if (cfg->data.tokenizer[0] && strcmp(cfg->data.dataset_type, "text_bytes") == 0)
        add(r,
            "%s: text_bytes reads text as bytes (a vocabulary of 256) and takes no tokenizer; tokenize with "
            "tools/prepare_data.py --tokenizer %s and read the shards with data.dataset_type token_bin",
            at(cfg, "data.tokenizer", a, sizeof(a)), cfg->data.tokenizer);
    if (cfg->data.num_workers < 0) check(r, false, "data.num_workers", "an integer >= 0");
    if (cfg->training.gradient_accumulation_steps < 0)
        check(r, false, "training.gradient_accumulation_steps", "an integer > 0 or null");
}

static bool given(const ht_config *cfg, const char *key) {
    int line = 0;
    return ht_config_key_source(cfg, key, &line) != HT_CONFIG_SOURCE_DEFAULT;
}

/* The architecture keys that only some models read: on another they would be
 * read by nothing. */
static void check_model_keys(report *r) {
    static const struct {
        const char *key, *models, *what;
    } keys[] = {
        {"model.num_experts", "qwen2_moe deepseek_v3", "the sparse MLP"},
        {"model.num_experts_per_tok", "qwen2_moe deepseek_v3", "the sparse MLP"},
        {"model.moe_intermediate_size", "qwen2_moe deepseek_v3", "the sparse MLP"},
        {"model.norm_topk_prob", "qwen2_moe deepseek_v3", "the sparse MLP"},
        {"model.shared_expert_intermediate_size", "qwen2_moe", "Qwen2-MoE's gated shared expert"},
        {"model.decoder_sparse_step", "qwen2_moe", "Qwen2-MoE's sparse layers"},
        {"model.mlp_only_layers", "qwen2_moe", "Qwen2-MoE's sparse layers"},
        {"model.output_router_logits", "qwen2_moe", "Qwen2-MoE's load-balancing loss"},
        {"model.router_aux_loss_coef", "qwen2_moe", "Qwen2-MoE's load-balancing loss"},
        {"model.n_shared_experts", "deepseek_v3", "DeepSeekMoE"},
        {"model.n_group", "deepseek_v3", "DeepSeekMoE's group-limited routing"},
        {"model.topk_group", "deepseek_v3", "DeepSeekMoE's group-limited routing"},
        {"model.routed_scaling_factor", "deepseek_v3", "DeepSeekMoE"},
        {"model.first_k_dense_replace", "deepseek_v3", "DeepSeekMoE"},
        {"model.moe_router_bias_update_rate", "deepseek_v3", "DeepSeekMoE's aux-loss-free balancing"},
        {"model.q_lora_rank", "deepseek_v3", "Multi-Latent Attention"},
        {"model.kv_lora_rank", "deepseek_v3", "Multi-Latent Attention"},
        {"model.qk_nope_head_dim", "deepseek_v3", "Multi-Latent Attention"},
        {"model.qk_rope_head_dim", "deepseek_v3", "Multi-Latent Attention"},
        {"model.v_head_dim", "deepseek_v3", "Multi-Latent Attention"},
        {"model.rope_interleave", "deepseek_v3", "Multi-Latent Attention's rotary key"},
    };
    const char *name = r->cfg->model.arch.name;
    char a[HT_CONFIG_STR_MAX + 160];
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]); i++) {
        const char *m = strstr(keys[i].models, name);
        size_t n = strlen(name);
        bool reads = n && m && (m == keys[i].models || m[-1] == ' ') && (m[n] == ' ' || m[n] == '\0');
        if (!reads && given(r->cfg, keys[i].key))
            add(r, "%s: applies to model.name %s (%s), not to %s", at(r->cfg, keys[i].key, a, sizeof(a)),
                keys[i].models, keys[i].what, name);
    }
    /* MindFormers' switch: Muon's recipe asks for MLA by it. */
    bool mla = strcmp(name, "deepseek_v3") == 0;
    if (given(r->cfg, "model.multi_latent_attention") && r->cfg->model.multi_latent_attention != mla)
        add(r, "%s: %s, but model.name %s %s Multi-Latent Attention (deepseek_v3 has it)",
            at(r->cfg, "model.multi_latent_attention", a, sizeof(a)),
            r->cfg->model.multi_latent_attention ? "true" : "false", name, mla ? "has" : "has no");
}

/* decay_ratio, ConstantWithCoolDownLR, CosineAnnealingWarmRestarts and LearningRateWiseLayer
 * (mindformers/core/lr/lr_schedule.py: what MindFormers refuses, and what hypertrain cannot do). */
static void check_new_schedules(report *r) {
    const ht_config *cfg = r->cfg;
    const ht_config_lr_schedule type = cfg->lr_scheduler.type;
    char a[HT_CONFIG_STR_MAX + 160], b[HT_CONFIG_STR_MAX + 160];
    double ratio = cfg->lr_scheduler.decay_ratio;
    check(r, ratio >= 0 && ratio <= 1, "lr_scheduler.decay_ratio", "a number in [0, 1]");
    /* For the cosine and polynomial schedules a D of 0 means "the default"; a ratio giving 0 steps would
     * silently mean the whole run. */
    bool zero_means_default = type == HT_CONFIG_LR_COSINE_WARMUP || type == HT_CONFIG_LR_COSINE_RESTARTS ||
                              type == HT_CONFIG_LR_POLYNOMIAL_WARMUP;
    if (given(cfg, "lr_scheduler.decay_ratio") && ratio >= 0 && ratio <= 1 && zero_means_default &&
        cfg->training.steps > 0)
        check(r, ht_config_decay_steps(cfg) >= 1, "lr_scheduler.decay_ratio",
              "a ratio giving at least one decay step (floor(training.steps * decay_ratio) >= 1)");
    check(r, cfg->lr_scheduler.keep_steps >= 0, "lr_scheduler.keep_steps", "an integer >= 0");
    check(r, cfg->lr_scheduler.final_steps >= 0, "lr_scheduler.final_steps", "an integer >= 0");
    check(r, cfg->lr_scheduler.lr_end1 >= 0, "lr_scheduler.lr_end1", "a number >= 0");
    check(r, cfg->lr_scheduler.lr_end2 >= 0, "lr_scheduler.lr_end2", "a number >= 0 (not given: lr_end1)");
    if (type == HT_CONFIG_LR_CONSTANT_COOLDOWN && !given(cfg, "lr_scheduler.decay_steps") &&
        !given(cfg, "lr_scheduler.decay_ratio"))
        add(r,
            "%s: ConstantWithCoolDownLR needs the length of its cosine phase: set lr_scheduler.decay_steps or "
            "lr_scheduler.decay_ratio (MindFormers has no default for it)",
            at(cfg, "lr_scheduler.type", a, sizeof(a)));
    if (type == HT_CONFIG_LR_COSINE_WARM_RESTARTS)
        check(r, cfg->lr_scheduler.t_0 >= 1, "lr_scheduler.t_0",
              "an integer >= 1 for CosineAnnealingWarmRestarts (the first cycle's length; MindFormers has no default)");
    else
        check(r, cfg->lr_scheduler.t_0 >= 0, "lr_scheduler.t_0", "an integer >= 1 (0: not given)");
    check(r, cfg->lr_scheduler.t_mult >= 1, "lr_scheduler.t_mult", "an integer >= 1");
    /* MindFormers' LearningRateWiseLayer(base_lr, lr_scale) returns lr_scale * base_lr(global_step), base_lr being
     * another schedule object: its layer-wise lr decay builds one per parameter group in code. */
    if (type == HT_CONFIG_LR_WISE_LAYER)
        add(r,
            "%s: LearningRateWiseLayer is not supported as a configured schedule: MindFormers' LearningRateWiseLayer "
            "wraps another schedule object (its base_lr) and multiplies it by a per-layer lr_scale, one instance per "
            "parameter group built by layer-wise lr decay code; hypertrain has no per-layer parameter groups, and "
            "its lr_scheduler.base_lr is a number (%s), not a schedule. Use the base schedule as lr_scheduler.type "
            "and scale its learning_rate instead",
            at(cfg, "lr_scheduler.type", a, sizeof(a)), at(cfg, "optimizer.adamw_config.adamw_lr", b, sizeof(b)));
}

/* muon_ns_coefficients (docs/NUMERICS.md, custom / segmented): finite, and not shorter than ns_steps. */
static void check_ns_coefficients(report *r) {
    const ht_config *cfg = r->cfg;
    const char *key = "optimizer.muon_config.muon_ns_coefficients", *steps_key = "optimizer.muon_config.muon_ns_steps";
    const ht_config_ns_coefficients *ns = &cfg->optimizer.muon.ns_coefficients;
    char a[HT_CONFIG_STR_MAX + 160], b[HT_CONFIG_STR_MAX + 160];
    if (ns->count < 0 || ns->count > HT_CONFIG_NS_MAX) {
        add(r, "%s: expected at most %d entries, found %d", at(cfg, key, a, sizeof(a)), HT_CONFIG_NS_MAX, ns->count);
        return;
    }
    long long length = 0;
    for (int j = 0; j < ns->count; j++) {
        const double *abc = ns->abc[j];
        if (!isfinite(abc[0]) || !isfinite(abc[1]) || !isfinite(abc[2]))
            add(r, "%s: expected finite coefficients, found [%g, %g, %g] in entry %d", at(cfg, key, a, sizeof(a)),
                abc[0], abc[1], abc[2], j + 1);
        bool repeat_ok = ns->repeat[j] >= 1 || (ns->repeat[j] == 0 && ns->count == 1);
        if (!repeat_ok)
            add(r, "%s: expected a count >= 1, found %d in entry %d", at(cfg, key, a, sizeof(a)), ns->repeat[j], j + 1);
        length += ns->repeat[j];
    }
    /* [a, b, c] alone (repeat 0) runs ns_steps times. A segmented schedule runs its own length; when ns_steps
     * was also given, a shorter schedule would silently run fewer steps than asked for. */
    int line = 0;
    bool steps_given = ht_config_key_source(cfg, steps_key, &line) != HT_CONFIG_SOURCE_DEFAULT;
    bool segmented = !(ns->count == 1 && ns->repeat[0] == 0);
    if (ns->count > 0 && segmented && steps_given && length < cfg->optimizer.muon.ns_steps)
        add(r, "%s: expected a schedule of at least muon_ns_steps = %d steps (%s), found %lld",
            at(cfg, key, a, sizeof(a)), cfg->optimizer.muon.ns_steps, at(cfg, steps_key, b, sizeof(b)), length);
}

/* The learning-rate schedule's rules (lr_scheduler.* and training.steps): the trainer's, and
 * hypertrain.lr_scheduler's from Python (ht_config_validate_lr_scheduler). */
static void check_lr_scheduler(report *r) {
    const ht_config *cfg = r->cfg;
    check(r, cfg->lr_scheduler.warmup_ratio >= 0 && cfg->lr_scheduler.warmup_ratio <= 1, "lr_scheduler.warmup_ratio",
          "a number in [0, 1]");
    check(r, cfg->lr_scheduler.warmup_steps >= 0, "lr_scheduler.warmup_steps", "an integer >= 0");
    /* The derived count is checked only from valid parts (a bad ratio is its own error, not a second one). */
    bool ratio_ok = cfg->lr_scheduler.warmup_ratio >= 0 && cfg->lr_scheduler.warmup_ratio <= 1;
    if (cfg->lr_scheduler.warmup_steps >= 0 && cfg->training.steps > 0 && ratio_ok)
        check(r, ht_config_warmup_steps(cfg) <= cfg->training.steps, "lr_scheduler.warmup_steps",
              "at most training.steps");
    check(r, cfg->lr_scheduler.warmup_lr_init >= 0, "lr_scheduler.warmup_lr_init", "a number >= 0");
    check(r, cfg->lr_scheduler.lr_end >= 0, "lr_scheduler.lr_end", "a number >= 0");
    check(r, cfg->lr_scheduler.num_cycles > 0, "lr_scheduler.num_cycles", "a number > 0");
    check(r, cfg->lr_scheduler.decay_steps >= 0, "lr_scheduler.decay_steps", "an integer >= 0 (0: training.steps)");
    check(r, cfg->lr_scheduler.power > 0, "lr_scheduler.power", "a number > 0");
    check(r, cfg->lr_scheduler.decay_start_steps >= 0, "lr_scheduler.decay_start_steps", "an integer >= 0");
    check(r, cfg->lr_scheduler.decay_start_ratio >= 0 && cfg->lr_scheduler.decay_start_ratio <= 1,
          "lr_scheduler.decay_start_ratio", "a number in [0, 1]");
    check(r, cfg->lr_scheduler.t_max >= 0, "lr_scheduler.t_max", "an integer >= 0 (0: training.steps)");
    check_new_schedules(r);
    /* PolynomialWithWarmUpLR runs (1 - (s - W)/D)^power up to s = T: with W + D < T the base turns negative
     * (a negative lr, or NaN for a fractional power), so D must cover the rest of the run. */
    if (cfg->lr_scheduler.type == HT_CONFIG_LR_POLYNOMIAL_WARMUP && ht_config_decay_steps(cfg) > 0)
        check(r, ht_config_warmup_steps(cfg) + ht_config_decay_steps(cfg) >= cfg->training.steps,
              "lr_scheduler.decay_steps",
              "at least training.steps minus the warmup steps for PolynomialWithWarmUpLR (past W + D its formula "
              "goes negative)");
}

ht_status ht_config_validate(const ht_config *cfg, int world, ht_error *err) {
    static report zero;
    report r = zero;
    r.cfg = cfg;
    r.world = world;
    /* The global batch is split over the data-parallel ranks. */
    const int data_parallel_size = check_mesh(&r, world);
    char a[HT_CONFIG_STR_MAX + 160], b[HT_CONFIG_STR_MAX + 160];

    /* FP32 main params take their gradients from the reduce-scatter: anything
     * but a float32 reduction has already lost the bits they exist to keep. */
    if (cfg->optimizer.fp32_main_params && cfg->fsdp.reduce_dtype != HT_DTYPE_F32) {
        char value[64];
        ht_config_format_value(cfg, "fsdp_config.mix_precision.reduce_dtype", value, sizeof(value));
        add(&r,
            "%s: expected float32 because optimizer.fp32_main_params is true (%s), found %s%s; set "
            "fsdp_config.mix_precision.reduce_dtype: float32 or optimizer.fp32_main_params: false (the value is "
            "never rewritten)",
            at(cfg, "fsdp_config.mix_precision.reduce_dtype", a, sizeof(a)),
            at(cfg, "optimizer.fp32_main_params", b, sizeof(b)), value,
            cfg->fsdp.reduce_dtype == HT_CONFIG_DTYPE_NONE ? " (missing)" : "");
    }

    /* residual16 rebuilds each FP32 main param from its weight rounded to
     * nearest: there must be main params, weights rounded to nearest, and
     * host memory to hold their low halves. */
    if (cfg->optimizer.main_param_storage == HT_CONFIG_MAIN_RESIDUAL16) {
        at(cfg, "optimizer.main_param_storage", a, sizeof(a));
        if (!cfg->optimizer.fp32_main_params)
            add(&r, "%s: residual16 is a way to hold FP32 main params, and optimizer.fp32_main_params is false (%s)", a,
                at(cfg, "optimizer.fp32_main_params", b, sizeof(b)));
        if (cfg->optimizer.stochastic_rounding)
            add(&r,
                "%s: residual16 needs every weight rounded to nearest even from its main param, and "
                "optimizer.stochastic_rounding is true (%s): use main_param_storage: fp32 with stochastic rounding",
                a, at(cfg, "optimizer.stochastic_rounding", b, sizeof(b)));
        if (cfg->kernels.backend == HT_KERNELS_CUDA)
            add(&r, "%s: residual16 is not supported on kernels.backend cuda yet (%s): use main_param_storage: fp32", a,
                at(cfg, "kernels.backend", b, sizeof(b)));
        if (cfg->model_init_dtype == HT_DTYPE_F16)
            add(&r,
                "%s: residual16 holds the low 16 bits of bfloat16 weights, and model_init_dtype is float16 (%s): a "
                "float16 value is not the high half of its FP32 value; use main_param_storage: fp32",
                a, at(cfg, "model_init_dtype", b, sizeof(b)));
    }

    /* MindFormers' switch for FP32 gradient accumulation and reduction: here
     * gradients always accumulate in FP32 main_grad and reduce in FP32 when
     * main params are FP32, so false would be a promise the engine cannot keep. */
    if (!cfg->optimizer.accumulate_allreduce_grads_in_fp32)
        add(&r,
            "%s: not supported: false asks for gradients accumulated in the model's dtype; hypertrain always "
            "accumulates them in FP32 (main_grad). Leave it true or remove it",
            at(cfg, "optimizer.accumulate_allreduce_grads_in_fp32", a, sizeof(a)));

    check(&r, cfg->training.gradient_scaling_factor > 0, "training.gradient_scaling_factor", "a number > 0");
    check_mindspeed(&r);
    check_model_keys(&r);
    check(&r, cfg->kernels.lm_head_chunk_mib >= -1, "kernels.lm_head_chunk_mib",
          "auto (-1) or an integer >= 0 (0: no chunks)");

    /* Dtypes (the loader enforces them; a struct filled in code may not). */
    const char *dtypes = "one of float16, bfloat16, float32";
    check(&r, is_float_dtype(cfg->model_init_dtype) || cfg->model_init_dtype == HT_CONFIG_DTYPE_NONE,
          "model_init_dtype", "one of float16, bfloat16, float32, null");
    check(&r, is_float_dtype(cfg->fsdp.param_dtype), "fsdp_config.mix_precision.param_dtype", dtypes);
    check(&r, is_float_dtype(cfg->fsdp.reduce_dtype) || cfg->fsdp.reduce_dtype == HT_CONFIG_DTYPE_NONE,
          "fsdp_config.mix_precision.reduce_dtype", dtypes);
    check(&r, is_float_dtype(cfg->fsdp.output_dtype), "fsdp_config.mix_precision.output_dtype", dtypes);

    /* model.lora (the model builder checks target_modules against its linear layers). */
    const ht_config_lora *lora = &cfg->model.lora;
    check(&r, lora->rank >= 0, "model.lora.rank", "an integer >= 0 (0: no adapters)");
    if (lora->rank > 0) {
        check(&r, lora->target_modules.count > 0, "model.lora.target_modules",
              "the linear layers to adapt (e.g. [q_proj, v_proj]) because model.lora.rank > 0");
        check(&r, lora->alpha > 0 && isfinite(lora->alpha), "model.lora.alpha",
              "a number > 0 (the update is scaled by alpha / r)");
        check(&r, lora->dropout >= 0 && lora->dropout < 1, "model.lora.dropout", "a number in [0, 1)");
        for (int i = 0; i < lora->target_modules.count; i++)
            if (strlen(lora->target_modules.items[i]) >= HT_LORA_TARGET_MAX)
                add(&r, "%s: entry %d is longer than %d bytes: no module has such a name",
                    at(cfg, "model.lora.target_modules", a, sizeof(a)), i, HT_LORA_TARGET_MAX - 1);
    } else if (lora->from_pretrained[0]) {
        add(&r, "%s: an adapter to start from needs model.lora.rank > 0 (%s) and the adapter's other settings",
            at(cfg, "model.lora.from_pretrained", a, sizeof(a)), at(cfg, "model.lora.rank", b, sizeof(b)));
    }

    /* Data. */
    check(&r, cfg->data.seq_len > 0, "data.seq_len", "an integer > 0");
    check(&r, !(cfg->model.from_pretrained[0] == '\0' && cfg->data.seq_len > cfg->model.arch.max_position_embeddings),
          "data.seq_len", "at most model.max_position_embeddings");
    check(&r, cfg->data.valid_fraction >= 0 && cfg->data.valid_fraction < 1, "data.valid_fraction",
          "a number in [0, 1)");

    /* Training. */
    const char *pos = "an integer > 0";
    check(&r, cfg->training.steps > 0, "training.steps", pos);
    check(&r, cfg->training.local_batch_size > 0, "training.local_batch_size", pos);
    check(&r, cfg->training.global_batch_size > 0, "training.global_batch_size", pos);
    if (world < 1) {
        add(&r, "the ranks: expected an integer > 0, found %d", world);
    } else if (data_parallel_size < 1) {
        /* the mesh's error says why */
    } else if (cfg->training.gradient_accumulation_steps > 0) {
        /* MindSpeed-MM's way: the global batch is what micro batch x accumulation x data parallel make. */
        long long global =
            (long long)cfg->training.local_batch_size * cfg->training.gradient_accumulation_steps * data_parallel_size;
        if (given(cfg, "training.global_batch_size") && global != cfg->training.global_batch_size)
            add(&r,
                "%s: %d, but training.gradient_accumulation_steps (%s) makes it local %d x accumulation %d x "
                "data-parallel %d = %lld: give one of the two",
                at(cfg, "training.global_batch_size", a, sizeof(a)), cfg->training.global_batch_size,
                at(cfg, "training.gradient_accumulation_steps", b, sizeof(b)), cfg->training.local_batch_size,
                cfg->training.gradient_accumulation_steps, data_parallel_size, global);
    } else if (cfg->training.local_batch_size > 0 && cfg->training.global_batch_size > 0) {
        long long per_step = (long long)cfg->training.local_batch_size * data_parallel_size;
        if (cfg->training.global_batch_size % per_step != 0)
            add(&r,
                "%s: expected a multiple of training.local_batch_size x data-parallel size = %d x %d = %lld "
                "(%s), found %d",
                at(cfg, "training.global_batch_size", a, sizeof(a)), cfg->training.local_batch_size, data_parallel_size,
                per_step, at(cfg, "training.local_batch_size", b, sizeof(b)), cfg->training.global_batch_size);
    }
    if (data_parallel_size > 0 && cfg->training.local_batch_size > 0)
        check_pipeline(&r,
                       cfg->training.gradient_accumulation_steps > 0
                           ? cfg->training.gradient_accumulation_steps
                           : cfg->training.global_batch_size / (cfg->training.local_batch_size * data_parallel_size));
    check(&r, cfg->training.max_norm > 0, "training.max_norm", "a number > 0");
    check(&r, cfg->training.distributed_timeout_minutes >= 0 && isfinite(cfg->training.distributed_timeout_minutes),
          "training.distributed_timeout_minutes", "minutes >= 0 (0: wait forever)");
    check(&r, cfg->training.log_interval > 0, "training.log_interval", pos);
    check(&r, cfg->training.eval_interval >= 0, "training.eval_interval", "an integer >= 0 (0: never)");
    check(&r, cfg->training.eval_interval == 0 || cfg->training.eval_batches > 0, "training.eval_batches", pos);
    check(&r, cfg->training.sample_interval >= 0, "training.sample_interval", "an integer >= 0 (0: never)");
    check(&r, cfg->training.sample_interval == 0 || cfg->training.sample_tokens > 0, "training.sample_tokens", pos);
    if (cfg->training.sample_interval > 0 && strcmp(cfg->data.dataset_type, "text_bytes") != 0 &&
        !cfg->data.tokenizer[0])
        add(&r,
            "%s: samples are text, and data.dataset_type %s has no text without data.tokenizer (the tokenizer.json "
            "its shards were made with); set it, or sample_interval 0",
            at(cfg, "training.sample_interval", a, sizeof(a)), cfg->data.dataset_type);
    /* fp16 loss scaling (docs/NUMERICS.md): checked whatever the dtype, so that a later switch to
     * fp16 cannot fail late. */
    check(&r, cfg->training.loss_scale_min > 0, "training.loss_scale_min", "a number > 0");
    if (cfg->training.loss_scale_min > 0 && cfg->training.loss_scale_initial < cfg->training.loss_scale_min)
        add(&r, "%s: expected at least training.loss_scale_min = %g (%s), found %g",
            at(cfg, "training.loss_scale_initial", a, sizeof(a)), cfg->training.loss_scale_min,
            at(cfg, "training.loss_scale_min", b, sizeof(b)), cfg->training.loss_scale_initial);
    check(&r, cfg->training.loss_scale_growth_interval > 0, "training.loss_scale_growth_interval", pos);
    check(&r, cfg->training.loss_scale_growth_factor > 1, "training.loss_scale_growth_factor", "a number > 1");
    check(&r, cfg->training.loss_scale_backoff_factor > 0 && cfg->training.loss_scale_backoff_factor < 1,
          "training.loss_scale_backoff_factor", "a number in (0, 1)");
    check(&r, cfg->training.loss_scale_hysteresis > 0, "training.loss_scale_hysteresis", pos);

    /* Optimizer. */
    check(&r, cfg->optimizer.adamw.lr >= 0, "optimizer.adamw_config.adamw_lr", "a number >= 0");
    check(&r, cfg->optimizer.adamw.weight_decay >= 0, "optimizer.adamw_config.adamw_weight_decay", "a number >= 0");
    check(&r,
          cfg->optimizer.adamw.betas[0] >= 0 && cfg->optimizer.adamw.betas[0] < 1 &&
              cfg->optimizer.adamw.betas[1] >= 0 && cfg->optimizer.adamw.betas[1] < 1,
          "optimizer.adamw_config.adamw_betas", "two numbers in [0, 1)");
    check(&r, cfg->optimizer.adamw.eps > 0, "optimizer.adamw_config.adamw_eps", "a number > 0");
    check(&r, cfg->optimizer.muon.ns_dtype == HT_DTYPE_F32 || cfg->optimizer.muon.ns_dtype == HT_DTYPE_BF16,
          "optimizer.muon_config.muon_ns_dtype", "one of float32, bfloat16");
    check(&r, cfg->optimizer.muon.ns_form != HT_CONFIG_NS_GRAM || cfg->optimizer.muon.ns_dtype == HT_DTYPE_F32,
          "optimizer.muon_config.muon_ns_form",
          "standard with muon_ns_dtype bfloat16 (the Gram form runs on FP32 operands only: not supported in bf16)");
    check(&r, cfg->optimizer.muon.ns_form != HT_CONFIG_NS_TORCH || cfg->optimizer.muon.ns_dtype == HT_DTYPE_BF16,
          "optimizer.muon_config.muon_ns_form",
          "torch with muon_ns_dtype bfloat16 (torch.optim.Muon's iteration is a bf16 one)");
    if (cfg->optimizer.type == HT_CONFIG_OPTIMIZER_MUON) {
        const char *ns_key = "optimizer.muon_config.muon_ns_steps";
        check(&r, cfg->optimizer.muon.lr >= 0, "optimizer.muon_config.muon_lr", "a number >= 0");
        check(&r, cfg->optimizer.muon.weight_decay >= 0, "optimizer.muon_config.muon_weight_decay", "a number >= 0");
        check(&r, cfg->optimizer.muon.momentum >= 0 && cfg->optimizer.muon.momentum < 1,
              "optimizer.muon_config.muon_momentum", "a number in [0, 1)");
        check(&r, cfg->optimizer.muon.ns_steps > 0, ns_key, pos);
        check(&r, cfg->optimizer.muon.matched_adamw_rms >= 0 && isfinite(cfg->optimizer.muon.matched_adamw_rms),
              "optimizer.muon_config.muon_matched_adamw_rms", "a number >= 0 (0: the original scale rule)");
        check(&r, cfg->optimizer.muon.ns_eps > 0, "optimizer.muon_config.muon_ns_eps", "a number > 0");
        /* asym5 has five triples; running "6" of them would silently be 5 (docs/NUMERICS.md). */
        if (cfg->optimizer.muon.ns_variant == HT_CONFIG_NS_ASYM5 && cfg->optimizer.muon.ns_steps > 5)
            add(&r, "%s: expected at most 5 with muon_ns_variant asym5 (%s), found %d", at(cfg, ns_key, a, sizeof(a)),
                at(cfg, "optimizer.muon_config.muon_ns_variant", b, sizeof(b)), cfg->optimizer.muon.ns_steps);
        bool custom = cfg->optimizer.muon.ns_variant == HT_CONFIG_NS_CUSTOM;
        bool given = cfg->optimizer.muon.ns_coefficients.count > 0;
        if (custom != given)
            add(&r, "%s: expected %s with muon_ns_variant %s (%s)",
                at(cfg, "optimizer.muon_config.muon_ns_coefficients", a, sizeof(a)),
                custom ? "coefficients" : "null (coefficients are only used)", custom ? "custom" : "other than custom",
                at(cfg, "optimizer.muon_config.muon_ns_variant", b, sizeof(b)));
        check_ns_coefficients(&r);
        check(&r, !cfg->optimizer.muon.qk_clip_enabled || cfg->optimizer.muon.qk_clip_threshold > 0,
              "optimizer.muon_config.qk_clip_threshold", "a number > 0");
    }

    /* Learning-rate schedule. */
    check_lr_scheduler(&r);
    check_polynomial(&r, "optimizer.adamw_config.adamw_lr", cfg->optimizer.adamw.lr);
    /* One shared learning_rate that set both is one error, not two. */
    const char *muon_as = ht_config_key_spelling(cfg, "optimizer.muon_config.muon_lr");
    bool one_lr = strcmp(muon_as, ht_config_key_spelling(cfg, "optimizer.adamw_config.adamw_lr")) == 0 &&
                  cfg->optimizer.muon.lr == cfg->optimizer.adamw.lr;
    if (cfg->optimizer.type == HT_CONFIG_OPTIMIZER_MUON && !one_lr)
        check_polynomial(&r, "optimizer.muon_config.muon_lr", cfg->optimizer.muon.lr);

    /* Sharding and checkpoints. */
    if (cfg->fsdp.shard_size < 0 ||
        (cfg->fsdp.shard_size > 0 && data_parallel_size > 0 && data_parallel_size % cfg->fsdp.shard_size != 0)) {
        char want[96];
        snprintf(want, sizeof(want), "auto or a divisor of the data-parallel size %d", data_parallel_size);
        check(&r, false, "fsdp_config.shard_size", want);
    }
    check(&r, cfg->checkpoint.save_interval >= 0, "checkpoint.save_interval", "an integer >= 0 (0: never)");
    check(&r, cfg->checkpoint.keep_last >= 0, "checkpoint.keep_last", "an integer >= 0 (0: keep all)");
    check(&r, cfg->checkpoint.save_interval == 0 || cfg->checkpoint.output_dir[0] != '\0', "checkpoint.output_dir",
          "a directory when checkpoint.save_interval > 0");
    for (int i = 0; i < cfg->checkpoint.allow_changes.count; i++) {
        const char *key = cfg->checkpoint.allow_changes.items[i];
        if (ht_config_key_fixed_on_resume(key)) continue;
        char a[HT_CONFIG_STR_MAX + 160];
        add(&r,
            "%s: item %d, %s, is not a key a resume refuses to change (those are the model.* keys that say what "
            "the model computes, and data.path, data.dataset, data.dataset_dir, data.dataset_type, data.seq_len, "
            "data.tokenizer, data.valid_fraction, data.shuffle, data.drop_last, data.sampler_type, data.collate; "
            "any other key may change on a resume as it is)",
            at(cfg, "checkpoint.allow_changes", a, sizeof(a)), i, key);
    }

    if (r.count == 0) {
        int ri = ht_config_key_index("lr_scheduler.warmup_ratio"),
            si = ht_config_key_index("lr_scheduler.warmup_steps");
        if (cfg->source[ri] != HT_CONFIG_SOURCE_DEFAULT && cfg->source[si] != HT_CONFIG_SOURCE_DEFAULT)
            ht_log_warn_once(
                "lr_scheduler: both warmup_ratio and warmup_steps are set; warmup_ratio wins (%d warmup steps)",
                ht_config_warmup_steps(cfg));
        return HT_OK;
    }
    if (r.count > 1) return ht_fail(err, HT_ERR_CONFIG, "%d configuration errors:\n%s", r.count, r.msg);
    return ht_fail(err, HT_ERR_CONFIG, "%s", r.msg);
}

int ht_config_data_parallel_size(const ht_config *cfg, int world) {
    const int cp = cfg->parallel.ulysses_parallel_size * cfg->parallel.ring_attention_size,
              tp = cfg->parallel.tensor_parallel_size, pp = cfg->parallel.pipeline_parallel_size;
    return cp > 0 && tp > 0 && pp > 0 ? world / (cp * tp * pp) : world;
}

ht_status ht_config_validate_lr_scheduler(const ht_config *cfg, ht_error *err) {
    report r = {.cfg = cfg, .world = 1};
    check(&r, cfg->training.steps >= 1, "training.steps", "an integer >= 1");
    check_lr_scheduler(&r);
    if (r.count == 0) return HT_OK;
    if (r.count > 1) return ht_fail(err, HT_ERR_CONFIG, "%d configuration errors:\n%s", r.count, r.msg);
    return ht_fail(err, HT_ERR_CONFIG, "%s", r.msg);
}
