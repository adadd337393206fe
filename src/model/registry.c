/* The model registry (name -> builder, on base's ht_registry) and the checks
 * on an architecture config that every builder shares. Built-ins register on
 * first use, before any plugin's. */
#include "hypertrain/model.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "model/decoder.h"

static void register_builtins(void);
static ht_registry models = {.what = "model", .register_builtins = register_builtins};

static void register_builtins(void) {
    ht_registry_add(&models, "qwen2", (ht_registry_fn)ht_decoder_build, NULL);
    ht_registry_add(&models, "llama", (ht_registry_fn)ht_decoder_build, NULL);
    ht_registry_add(&models, "qwen2_moe", (ht_registry_fn)ht_decoder_build, NULL);
    ht_registry_add(&models, "deepseek_v3", (ht_registry_fn)ht_decoder_build, NULL);
}

bool ht_model_config_is_deepseek(const ht_model_config *cfg) { return strcmp(cfg->name, "deepseek_v3") == 0; }
bool ht_model_config_has_mla(const ht_model_config *cfg) { return ht_model_config_is_deepseek(cfg); }

bool ht_model_config_layer_is_sparse(const ht_model_config *cfg, int l) {
    const ht_moe_config *mc = &cfg->moe;
    if (ht_model_config_is_deepseek(cfg)) return mc->num_experts > 0 && l >= mc->first_k_dense_replace;
    if (mc->num_experts <= 0 || mc->decoder_sparse_step <= 0 || (l + 1) % mc->decoder_sparse_step != 0) return false;
    for (int i = 0; i < mc->mlp_only_layers.count; i++)
        if (mc->mlp_only_layers.items[i] == l) return false;
    return true;
}

static bool is_moe(const ht_model_config *cfg) {
    return strcmp(cfg->name, "qwen2_moe") == 0 || ht_model_config_is_deepseek(cfg);
}

/* DeepSeekMoE's routing: groups that divide the experts, enough experts in
 * the groups kept, a scaling and a bias update rate that are numbers. */
static ht_status check_deepseek_moe(const ht_moe_config *mc, ht_error *err) {
    if (mc->n_shared_experts < 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.n_shared_experts must be >= 0 (0: no shared expert), found %d",
                       mc->n_shared_experts);
    if (mc->first_k_dense_replace < 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.first_k_dense_replace must be >= 0, found %d",
                       mc->first_k_dense_replace);
    if (mc->n_group < 1 || mc->num_experts % mc->n_group != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.n_group must be >= 1 and divide model.n_routed_experts (%d) into equal groups, found %d",
                       mc->num_experts, mc->n_group);
    if (mc->topk_group < 1 || mc->topk_group > mc->n_group)
        return ht_fail(err, HT_ERR_CONFIG, "model.topk_group must be between 1 and model.n_group (%d), found %d",
                       mc->n_group, mc->topk_group);
    const int per_group = mc->num_experts / mc->n_group;
    if (mc->n_group > 1 && per_group < 2)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.n_group %d leaves %d expert per group: a group is scored by its two best experts, so "
                       "each needs at least 2 (model.n_routed_experts %d)",
                       mc->n_group, per_group, mc->num_experts);
    if (mc->num_experts_per_tok > mc->topk_group * per_group)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_experts_per_tok (%d) is more than the experts the kept groups hold: model.topk_group "
                       "(%d) x %d experts per group (model.n_routed_experts %d / model.n_group %d)",
                       mc->num_experts_per_tok, mc->topk_group, per_group, mc->num_experts, mc->n_group);
    if (!(mc->routed_scaling_factor > 0) || !isfinite(mc->routed_scaling_factor))
        return ht_fail(err, HT_ERR_CONFIG, "model.routed_scaling_factor must be a number > 0, found %g",
                       mc->routed_scaling_factor);
    if (!(mc->bias_update_rate >= 0) || !isfinite(mc->bias_update_rate))
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.moe_router_bias_update_rate must be a number >= 0 (0: the correction bias stays as it "
                       "is), found %g",
                       mc->bias_update_rate);
    return HT_OK;
}

/* Multi-Latent Attention's widths, and YaRN's fields where it is asked for. */
static ht_status check_mla(const ht_model_config *cfg, ht_error *err) {
    const ht_mla_config *a = &cfg->mla;
    const struct {
        const char *field;
        int value;
    } positive[] = {
        {"kv_lora_rank", a->kv_lora_rank},
        {"qk_rope_head_dim", a->qk_rope_head_dim},
        {"v_head_dim", a->v_head_dim},
    };
    for (size_t i = 0; i < sizeof(positive) / sizeof(positive[0]); i++)
        if (positive[i].value <= 0)
            return ht_fail(err, HT_ERR_CONFIG, "model.%s must be positive, found %d", positive[i].field,
                           positive[i].value);
    if (a->q_lora_rank < 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.q_lora_rank must be > 0, or null for a plain q_proj; found %d",
                       a->q_lora_rank);
    if (a->qk_nope_head_dim < 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.qk_nope_head_dim must be >= 0, found %d", a->qk_nope_head_dim);
    if (a->qk_rope_head_dim % 2 != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.qk_rope_head_dim must be even (rotary embeddings turn pairs of dimensions), found %d",
                       a->qk_rope_head_dim);
    return HT_OK;
}

static double yarn_mscale(double scale, double m) { return scale <= 1 ? 1.0 : 0.1 * m * log(scale) + 1.0; }

static ht_status check_rope_scaling(const ht_model_config *cfg, ht_error *err) {
    const ht_rope_scaling *r = &cfg->rope_scaling;
    if (!r->type[0] || strcmp(r->type, "default") == 0) return HT_OK;
    if (strcmp(r->type, "yarn") != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.rope_scaling.type \"%s\" is not supported (supported: yarn, default or null)", r->type);
    if (!(r->factor >= 1) || !isfinite(r->factor))
        return ht_fail(err, HT_ERR_CONFIG, "model.rope_scaling.factor must be a number >= 1 for yarn, found %g",
                       r->factor);
    if (r->original_max_position_embeddings <= 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.rope_scaling.original_max_position_embeddings must be positive for yarn, found %d",
                       r->original_max_position_embeddings);
    if (!(r->beta_fast > 0) || !(r->beta_slow > 0) || !isfinite(r->beta_fast) || !(r->beta_fast > r->beta_slow))
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.rope_scaling.beta_fast (%g) and beta_slow (%g) must be positive numbers with beta_fast "
                       "> beta_slow (rotations: the ramp runs from the first to the second)",
                       r->beta_fast, r->beta_slow);
    if (!(r->mscale >= 0) || !(r->mscale_all_dim >= 0) || !isfinite(r->mscale) || !isfinite(r->mscale_all_dim))
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.rope_scaling.mscale (%g) and mscale_all_dim (%g) must be numbers >= 0", r->mscale,
                       r->mscale_all_dim);
    if (!(yarn_mscale(r->factor, r->mscale_all_dim) > 0))
        return ht_fail(err, HT_ERR_CONFIG, "model.rope_scaling: mscale_all_dim %g gives a softmax scale <= 0",
                       r->mscale_all_dim);
    return HT_OK;
}

bool ht_rope_is_yarn(const ht_rope_scaling *r) { return strcmp(r->type, "yarn") == 0; }

double ht_model_config_attention_scale(const ht_model_config *cfg) {
    const int dk = ht_model_config_has_mla(cfg) ? cfg->mla.qk_nope_head_dim + cfg->mla.qk_rope_head_dim
                                                : ht_model_config_head_dim(cfg);
    double scale = 1.0 / sqrt((double)dk);
    const ht_rope_scaling *r = &cfg->rope_scaling;
    /* transformers applies YaRN's softmax factor to MLA only (DeepseekV3Attention). */
    if (ht_model_config_has_mla(cfg) && ht_rope_is_yarn(r) && r->mscale_all_dim != 0) {
        const double m = yarn_mscale(r->factor, r->mscale_all_dim);
        scale *= m * m;
    }
    return scale;
}

/* The sparse MLP's fields: only qwen2_moe and deepseek_v3 have them, and they must fit together. */
static ht_status check_moe(const ht_model_config *cfg, ht_error *err) {
    const ht_moe_config *mc = &cfg->moe;
    if (!is_moe(cfg)) {
        if (mc->num_experts != 0)
            return ht_fail(err, HT_ERR_CONFIG,
                           "model.num_experts is %d, but model.name %s has no experts (model.name qwen2_moe and "
                           "deepseek_v3 have)",
                           mc->num_experts, cfg->name);
        return HT_OK;
    }
    if (mc->num_experts < 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.num_experts must be >= 0 (0: every layer dense), found %d",
                       mc->num_experts);
    if (mc->num_experts == 0) return HT_OK;
    if (mc->num_experts_per_tok < 1 || mc->num_experts_per_tok > mc->num_experts)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_experts_per_tok must be between 1 and model.num_experts (%d): each token picks "
                       "that many different experts; found %d",
                       mc->num_experts, mc->num_experts_per_tok);
    if (mc->moe_intermediate_size <= 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.moe_intermediate_size must be positive, found %d",
                       mc->moe_intermediate_size);
    if (ht_model_config_is_deepseek(cfg)) return check_deepseek_moe(mc, err);
    if (mc->shared_expert_intermediate_size <= 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.shared_expert_intermediate_size must be positive (Qwen2-MoE always has a shared "
                       "expert), found %d",
                       mc->shared_expert_intermediate_size);
    if (mc->decoder_sparse_step < 1)
        return ht_fail(err, HT_ERR_CONFIG, "model.decoder_sparse_step must be >= 1, found %d", mc->decoder_sparse_step);
    for (int i = 0; i < mc->mlp_only_layers.count; i++)
        if (mc->mlp_only_layers.items[i] < 0 || mc->mlp_only_layers.items[i] >= cfg->num_hidden_layers)
            return ht_fail(err, HT_ERR_CONFIG, "model.mlp_only_layers[%d] is %d: not a layer of this model (0 .. %d)",
                           i, mc->mlp_only_layers.items[i], cfg->num_hidden_layers - 1);
    if (!(mc->router_aux_loss_coef >= 0) || !isfinite(mc->router_aux_loss_coef))
        return ht_fail(err, HT_ERR_CONFIG, "model.router_aux_loss_coef must be a number >= 0, found %g",
                       mc->router_aux_loss_coef);
    return HT_OK;
}

ht_status ht_model_register(const char *name, ht_model_builder builder, ht_error *err) {
    return ht_registry_add(&models, name, (ht_registry_fn)builder, err);
}

const char *ht_model_registered_names(void) { return ht_registry_names(&models); }

int ht_model_config_head_dim(const ht_model_config *cfg) {
    if (cfg->head_dim > 0) return cfg->head_dim;
    return cfg->num_attention_heads > 0 ? cfg->hidden_size / cfg->num_attention_heads : 0;
}

/* The width of a sparse layer's shared experts: Qwen2-MoE's
 * shared_expert_intermediate_size, DeepSeek-V3's n_shared_experts x
 * moe_intermediate_size. */
static int64_t shared_width(const ht_model_config *cfg) {
    const ht_moe_config *mc = &cfg->moe;
    return ht_model_config_is_deepseek(cfg) ? (int64_t)mc->n_shared_experts * mc->moe_intermediate_size
                                            : (int64_t)mc->shared_expert_intermediate_size;
}

/* Every tensor's element count and the whole model's, overflow-checked in
 * int64, against HT_MODEL_MAX_PARAMS: a typo of a few digits in a size is a
 * sentence naming the sizes, not an allocation of exabytes. */
static ht_status check_model_size(const ht_model_config *cfg, int head_dim, ht_error *err) {
    const int64_t C = cfg->hidden_size, F = cfg->intermediate_size, V = cfg->vocab_size;
    const int64_t q = (int64_t)cfg->num_attention_heads * head_dim, kv = (int64_t)cfg->num_key_value_heads * head_dim;
    const struct {
        const char *what;
        int64_t rows, cols;
    } tensors[] = {
        {"the embedding (vocab_size x hidden_size)", V, C},
        {"q_proj (num_attention_heads * head_dim x hidden_size)", q, C},
        {"k_proj (num_key_value_heads * head_dim x hidden_size)", kv, C},
        {"each MLP matrix (intermediate_size x hidden_size)", F, C},
    };
    int64_t layer, total;
    for (size_t i = 0; i < sizeof(tensors) / sizeof(tensors[0]); i++) {
        int64_t n;
        if (__builtin_mul_overflow(tensors[i].rows, tensors[i].cols, &n) || n > HT_MODEL_MAX_PARAMS)
            return ht_fail(err, HT_ERR_CONFIG,
                           "%s has %lld x %lld elements, more than the %lld parameters a model may have "
                           "(HT_MODEL_MAX_PARAMS in include/hypertrain/model.h)",
                           tensors[i].what, (long long)tensors[i].rows, (long long)tensors[i].cols,
                           (long long)HT_MODEL_MAX_PARAMS);
    }
    /* One layer: q, k, v, o, three MLP matrices (biases and norms are smaller than any of them). */
    layer = 2 * q * C + 2 * kv * C + 3 * F * C + 2 * C + q + 2 * kv;
    /* A sparse layer adds its experts (E x 3I x C) and the rest of its MLP (counted with every layer: an upper bound).
     */
    const ht_moe_config *mc = &cfg->moe;
    int64_t experts = 0;
    bool over =
        mc->num_experts > 0 &&
        (__builtin_mul_overflow((int64_t)mc->num_experts * 3, (int64_t)mc->moe_intermediate_size, &experts) ||
         __builtin_mul_overflow(experts, C, &experts) ||
         __builtin_add_overflow(layer, experts + 3 * shared_width(cfg) * C + (int64_t)mc->num_experts * C + C, &layer));
    over = over || __builtin_mul_overflow(layer, (int64_t)cfg->num_hidden_layers, &total) ||
           __builtin_add_overflow(total, V * C * (cfg->tie_word_embeddings ? 1 : 2) + C, &total) ||
           total > HT_MODEL_MAX_PARAMS;
    if (over)
        return ht_fail(err, HT_ERR_CONFIG,
                       "the model would have more than the %lld parameters a model may have (%d layers of %lld; "
                       "HT_MODEL_MAX_PARAMS in include/hypertrain/model.h): check model.num_hidden_layers, "
                       "hidden_size, intermediate_size and vocab_size",
                       (long long)HT_MODEL_MAX_PARAMS, cfg->num_hidden_layers, (long long)layer);
    return HT_OK;
}

ht_status ht_model_config_validate(const ht_model_config *cfg, ht_error *err) {
    const struct {
        const char *field;
        int value;
    } positive[] = {
        {"vocab_size", cfg->vocab_size},
        {"hidden_size", cfg->hidden_size},
        {"intermediate_size", cfg->intermediate_size},
        {"num_hidden_layers", cfg->num_hidden_layers},
        {"num_attention_heads", cfg->num_attention_heads},
        {"num_key_value_heads", cfg->num_key_value_heads},
        {"max_position_embeddings", cfg->max_position_embeddings},
    };
    for (size_t i = 0; i < sizeof(positive) / sizeof(positive[0]); i++)
        if (positive[i].value <= 0)
            return ht_fail(err, HT_ERR_CONFIG, "model.%s must be positive, found %d", positive[i].field,
                           positive[i].value);
    if (cfg->head_dim < 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.head_dim must be >= 0 (0: hidden_size / num_attention_heads), found %d", cfg->head_dim);
    if (!(cfg->initializer_range > 0) || !isfinite(cfg->initializer_range))
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.initializer_range must be a positive number (the std of the normal init), found %g",
                       cfg->initializer_range);
    if (cfg->num_attention_heads % cfg->num_key_value_heads != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.num_attention_heads (%d) must be a multiple of model.num_key_value_heads (%d)",
                       cfg->num_attention_heads, cfg->num_key_value_heads);
    if (cfg->head_dim <= 0 && cfg->hidden_size % cfg->num_attention_heads != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.hidden_size (%d) must be a multiple of model.num_attention_heads (%d) "
                       "unless model.head_dim is set",
                       cfg->hidden_size, cfg->num_attention_heads);
    if (cfg->max_position_embeddings > HT_MODEL_MAX_POSITIONS)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.max_position_embeddings is %d, more than the %d positions a model may have "
                       "(HT_MODEL_MAX_POSITIONS in include/hypertrain/model.h; the rotary tables hold every one)",
                       cfg->max_position_embeddings, HT_MODEL_MAX_POSITIONS);
    ht_status s = check_rope_scaling(cfg, err);
    if (s == HT_OK && ht_model_config_has_mla(cfg)) s = check_mla(cfg, err);
    if (s != HT_OK) return s;
    if (ht_model_config_has_mla(cfg) && cfg->attention_bias)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.attention_bias: true is not supported for deepseek_v3 (biases on q_a_proj, "
                       "kv_a_proj_with_mqa and o_proj); set it false, as DeepSeek-V3 has it");
    int d = ht_model_config_head_dim(cfg);
    if (!ht_model_config_has_mla(cfg) && d % 2 != 0)
        return ht_fail(err, HT_ERR_CONFIG, "the head dimension (%d) must be even for rotary embeddings", d);
    if (!(cfg->rope_theta > 0)) return ht_fail(err, HT_ERR_CONFIG, "model.rope_theta must be positive");
    if (!(cfg->rms_norm_eps > 0)) return ht_fail(err, HT_ERR_CONFIG, "model.rms_norm_eps must be positive");
    const ht_lora_config *lc = &cfg->lora;
    if (lc->rank < 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.lora.rank must be >= 0 (0: no adapters), found %d", lc->rank);
    if (lc->rank > 0) {
        if (lc->target_count <= 0)
            return ht_fail(err, HT_ERR_CONFIG,
                           "model.lora.rank %d needs model.lora.target_modules: the linear layers to adapt "
                           "(e.g. [q_proj, v_proj]), found none",
                           lc->rank);
        if (!(lc->alpha > 0) || !isfinite(lc->alpha))
            return ht_fail(err, HT_ERR_CONFIG,
                           "model.lora.alpha must be a positive number (the update is scaled by alpha / r), found %g",
                           lc->alpha);
        if (!(lc->dropout >= 0 && lc->dropout < 1))
            return ht_fail(err, HT_ERR_CONFIG, "model.lora.dropout must be in [0, 1), found %g", lc->dropout);
    }
    s = check_moe(cfg, err);
    return s != HT_OK ? s : check_model_size(cfg, d, err);
}

/* Hugging Face's initialisation: matrices ~ normal(0, std), norm weights 1,
 * biases 0; PEFT's for LoRA: lora_A as torch's kaiming_uniform_(a = sqrt(5)),
 * i.e. uniform(-1/sqrt(in), 1/sqrt(in)), and lora_B zero, so that a fresh
 * adapter leaves the model unchanged. Each tensor has its own counter-based
 * stream keyed by (seed, name), value i for its element i, so values do not
 * depend on parameter order, on how rows are sharded or on the thread count,
 * and a rank draws its own rows without drawing the ones before them. */
/* A 16-bit param's values pass through FP32 in chunks of this many (4 MiB);
 * a float32 param's are drawn in place. */
#define INIT_CHUNK ((int64_t)1 << 20)

/* The runs of p's local values that are contiguous in the global tensor:
 * the whole box unless tensor parallelism cut a dim after the first (then
 * one run per index of the dims before it). init_runs: their count, each
 * *len values (the local ones from r x len); init_run_first: where run r
 * starts in the global tensor. */
static int64_t init_runs(const ht_param *p, int64_t *len) {
    const int cut = p->tp_dim > 0 ? p->tp_dim : 0;
    int64_t runs = 1;
    *len = 1;
    for (int d = 0; d < p->ndim; d++) *(d < cut ? &runs : len) *= p->box.length[d];
    return runs;
}

static int64_t init_run_first(const ht_param *p, int64_t r) {
    const int cut = p->tp_dim > 0 ? p->tp_dim : 0;
    int64_t idx[HT_PARAM_MAX_DIMS] = {0};
    for (int d = cut - 1; d >= 0; d--) {
        idx[d] = p->box.offset[d] + r % p->box.length[d];
        r /= p->box.length[d];
    }
    for (int d = cut; d < p->ndim; d++) idx[d] = p->box.offset[d];
    int64_t first = 0;
    for (int d = 0; d < p->ndim; d++) first = first * p->global_shape[d] + idx[d];
    return first;
}

/* adapters_only: every param but the LoRA adapters will be loaded over what
 * this draws, so they are left as allocated (zero) and only the adapters drawn. */
static ht_status init_weights(ht_param_store *params, double std, uint64_t seed, bool adapters_only, ht_error *err) {
    float *chunk = NULL;
    void *staged = NULL; /* a chunk in the model dtype, uploaded where the store is not host memory */
    const bool host = ht_params_host_memory(params);
    ht_status s = HT_OK;
    for (int i = 0; i < params->count && s == HT_OK; i++) {
        ht_param *p = &params->items[i];
        int64_t len;
        const int64_t runs = init_runs(p, &len);
        uint64_t key = seed ^ ht_fnv1a64(p->name, strlen(p->name), HT_FNV64_INIT);
        char lora = ht_lora_kind(p->name);
        if (adapters_only && !lora) continue;
        if ((p->dtype != HT_DTYPE_F32 || !host) && !chunk && !(chunk = ht_alloc((size_t)INIT_CHUNK * sizeof(float))))
            return ht_fail(err, HT_ERR_OOM, "cannot allocate %.1f MiB to initialise %s",
                           (double)INIT_CHUNK * sizeof(float) / (1 << 20), p->name);
        if (!host && p->dtype != HT_DTYPE_F32 && !staged && !(staged = ht_alloc((size_t)INIT_CHUNK * sizeof(float)))) {
            s = ht_fail(err, HT_ERR_OOM, "cannot allocate %.1f MiB to initialise %s",
                        (double)INIT_CHUNK * sizeof(float) / (1 << 20), p->name);
            break;
        }
        for (int64_t r = 0; r < runs; r++) {
            const int64_t first = init_run_first(p, r), base = r * len;
            for (int64_t c = 0; c < len; c += INIT_CHUNK) {
                int64_t m = len - c < INIT_CHUNK ? len - c : INIT_CHUNK;
                float *vals = p->dtype == HT_DTYPE_F32 && host ? (float *)p->data + base + c : chunk;
                if (lora == 'A' && p->ndim == 2) {
                    float bound = (float)(1.0 / sqrt((double)p->global_shape[1]));
                    ht_random_uniform(vals, m, key, first + c);
                    for (int64_t k = 0; k < m; k++) vals[k] = bound * (2.0f * vals[k] - 1.0f);
                } else if (lora != 'B' && p->ndim >= 2) {
                    ht_random_normal(vals, m, key, first + c, (float)std);
                } else {
                    float v = lora != 'B' && strstr(p->name, "norm") ? 1.0f : 0.0f;
                    for (int64_t k = 0; k < m; k++) vals[k] = v;
                }
                char *at = (char *)p->data + (size_t)(base + c) * ht_dtype_size(p->dtype);
                if (vals != chunk) continue;
                if (host) {
                    ht_convert(at, p->dtype, chunk, HT_DTYPE_F32, (size_t)m);
                } else if (p->dtype == HT_DTYPE_F32) {
                    ht_params_upload(params, at, chunk, (size_t)m * sizeof(float));
                } else {
                    ht_convert(staged, p->dtype, chunk, HT_DTYPE_F32, (size_t)m);
                    ht_params_upload(params, at, staged, (size_t)m * ht_dtype_size(p->dtype));
                }
            }
        }
    }
    ht_free(chunk);
    ht_free(staged);
    return s;
}

static double gib(double bytes) { return bytes / (double)(1 << 30); }

/* What building the model takes at least, against this machine's memory,
 * before anything is allocated: the weights in `dtype` and their FP32
 * gradients (this rank's rows of them: 1 / world), the rotary tables and a
 * record per tensor. Biases and adapters are left out: a lower bound, so a
 * model refused here could not be built. In double: only compared. */
static ht_status check_memory(const ht_model_config *cfg, ht_dtype dtype, int world, ht_error *err) {
    const ht_moe_config *mc = &cfg->moe;
    const double C = cfg->hidden_size, F = cfg->intermediate_size, V = cfg->vocab_size,
                 D = ht_model_config_head_dim(cfg);
    const double q = cfg->num_attention_heads * D, kv = cfg->num_key_value_heads * D, L = cfg->num_hidden_layers;
    int sparse = 0;
    for (int l = 0; l < cfg->num_hidden_layers; l++) sparse += ht_model_config_layer_is_sparse(cfg, l);
    const double attention = 2 * q * C + 2 * kv * C + 2 * C; /* q, o, k, v and the two norms */
    const double experts =
        mc->num_experts * (3.0 * mc->moe_intermediate_size * C + C) + 3.0 * (double)shared_width(cfg) * C + C;
    const double layers = L * attention + (L - sparse) * 3 * F * C + sparse * experts;
    const double outer = V * C * (cfg->tie_word_embeddings ? 1 : 2) + C;
    const double tables = 2.0 * cfg->max_position_embeddings * (D / 2) * sizeof(float);
    const double params = layers + outer, records = (3 + 9 * L) * sizeof(ht_param);
    const double bytes = params * (double)(ht_dtype_size(dtype) + sizeof(float)) / world + tables + records;
    const double have = (double)ht_physical_memory();
    if (tables > have)
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.max_position_embeddings %d: the rotary tables (2 x max_position_embeddings x head_dim "
                       "%g / 2 floats) would take %.1f GiB, more than this machine's %.1f GiB of memory",
                       cfg->max_position_embeddings, D, gib(tables), gib(have));
    if (bytes > have)
        return ht_fail(err, HT_ERR_CONFIG,
                       "the model has at least %.4g parameters: model.num_hidden_layers %d x %.4g a layer (of "
                       "hidden_size %d, intermediate_size %d), and %.4g in the embedding%s (vocab_size %d x "
                       "hidden_size); building it takes at least %.1f GiB (%s weights and FP32 gradients%s), more than "
                       "this machine's %.1f GiB of memory",
                       params, cfg->num_hidden_layers, L > 0 ? layers / L : 0.0, cfg->hidden_size,
                       cfg->intermediate_size, outer, cfg->tie_word_embeddings ? "" : " and the LM head",
                       cfg->vocab_size, gib(bytes), ht_dtype_name(dtype), world > 1 ? ", this rank's rows" : "",
                       gib(have));
    return HT_OK;
}

ht_status ht_model_declare(const ht_model_config *cfg, ht_dtype dtype, const ht_model_placement *at, ht_model **out,
                           ht_error *err) {
    *out = NULL;
    ht_model_builder builder = (ht_model_builder)ht_registry_find(&models, cfg->name);
    if (!builder)
        return ht_fail(err, HT_ERR_CONFIG, "unknown model.name '%s'; registered models: %s", cfg->name,
                       ht_model_registered_names());
    ht_status s = ht_model_config_validate(cfg, err);
    if (s != HT_OK) return s;
    if (!ht_dtype_is_float(dtype))
        return ht_fail(err, HT_ERR_CONFIG, "model parameters must be float16, bfloat16 or float32, not %s",
                       ht_dtype_name(dtype));
    const int rank = at->shard_rank, world = at->shard_world > 1 ? at->shard_world : 1;
    const int tp = at->tp_size > 1 ? at->tp_size : 1, pp = at->pp_size > 1 ? at->pp_size : 1;
    s = check_memory(cfg, dtype, world * tp * pp, err);
    if (s != HT_OK) return s;
    s = builder(cfg, dtype, out, err);
    if (s != HT_OK) return s;
    ht_model *m = *out;
    ht_param_store *ps = &m->params;
    if (tp > 1) {
        if (!m->ops->set_tensor_parallel)
            s = ht_fail(err, HT_ERR_CONFIG,
                        "parallel.tensor_parallel_size %d: model %s declares no tensor-parallel plan (which dim of "
                        "which weight each rank holds); expected 1",
                        tp, cfg->name);
        else if (ps->data_block)
            s = ht_fail(err, HT_ERR_CONFIG,
                        "parallel.tensor_parallel_size %d: model %s allocates its weights as it builds them, so "
                        "they cannot be sliced; expected 1",
                        tp, cfg->name);
        else
            s = m->ops->set_tensor_parallel(m, tp, at->tp_rank, err);
        m->tensor = (ht_tensor_parallel){.size = tp, .rank = at->tp_rank};
    }
    if (s == HT_OK && pp > 1) {
        const int V = at->pp_chunks > 1 ? at->pp_chunks : 1;
        const ht_pipeline_stage stage = ht_pipeline_stage_of(cfg->num_hidden_layers, pp, V, at->pp_rank);
        if (!m->ops->set_pipeline_stage)
            s = ht_fail(err, HT_ERR_CONFIG,
                        "parallel.pipeline_parallel_size %d: model %s cannot be split into stages; expected 1", pp,
                        cfg->name);
        else if (ps->data_block)
            s = ht_fail(err, HT_ERR_CONFIG,
                        "parallel.pipeline_parallel_size %d: model %s allocates its weights as it builds them, so "
                        "they cannot be split into stages; expected 1",
                        pp, cfg->name);
        else if (cfg->num_hidden_layers < pp * V)
            s = ht_fail(err, HT_ERR_CONFIG,
                        "parallel.pipeline_parallel_size %d x virtual_pipeline_model_parallel_size %d: more model "
                        "stages than the model's %d layers (num_hidden_layers): each holds at least one",
                        pp, V, cfg->num_hidden_layers);
        else
            s = m->ops->set_pipeline_stage(m, &stage, err);
    }
    if (s == HT_OK && ps->data_block && !ps->memory && !ht_kernels()->host_memory)
        s = ht_fail(err, HT_ERR_CONFIG,
                    "model %s allocated its weights in host memory as it built them; the %s kernels need them in "
                    "their own (declare the params and leave their storage to the registry)",
                    cfg->name, ht_kernels()->name);
    if (s == HT_OK && !ps->data_block) { /* declared only: storage for this rank's rows, the kernels' memory */
        ps->memory = ht_kernels();
        if (world > 1) ht_params_set_rows(ps, rank, world);
    }
    if (s != HT_OK) {
        ht_model_free(m);
        *out = NULL;
    }
    return s;
}

ht_pipeline_stage ht_pipeline_stage_of(int L, int P, int V, int r) {
    return (ht_pipeline_stage){.layers = L, .ranks = P, .chunks = V, .rank = r, .first = r == 0, .last = r == P - 1};
}

void ht_pipeline_chunk_layers(const ht_pipeline_stage *st, int c, int *first, int *end) {
    const int S = st->ranks * st->chunks, q = c * st->ranks + st->rank; /* model stage q of S */
    const int base = st->layers / S, extra = st->layers % S;
    *first = q * base + (q < extra ? q : extra);
    *end = *first + base + (q < extra);
}

bool ht_pipeline_holds_layer(const ht_pipeline_stage *st, int l) {
    for (int c = 0; c < st->chunks; c++) {
        int first, end;
        ht_pipeline_chunk_layers(st, c, &first, &end);
        if (l >= first && l < end) return true;
    }
    return false;
}

int ht_pipeline_stage_holding(const ht_model_config *cfg, int P, int V, const char *name) {
    int l = -1;
    if (sscanf(name, "model.layers.%d.", &l) == 1) {
        for (int r = 0; r < P; r++) {
            const ht_pipeline_stage st = ht_pipeline_stage_of(cfg->num_hidden_layers, P, V, r);
            if (ht_pipeline_holds_layer(&st, l)) return r;
        }
        return P - 1;
    }
    return strcmp(name, "model.embed_tokens.weight") == 0 ? 0 : P - 1;
}

ht_status ht_model_allocate(ht_model *m, const ht_model_placement *at, uint64_t seed, bool pretrained, ht_error *err) {
    ht_param_store *ps = &m->params;
    const int world = at->shard_world > 1 ? at->shard_world : 1;
    ht_status s = ps->data_block ? ht_params_shard(ps, at->shard_rank, world, err) : ht_params_allocate(ps, err);
    if (s == HT_OK) s = init_weights(ps, m->config.initializer_range, seed, pretrained, err);
    return s;
}

ht_status ht_model_build_parallel(const ht_model_config *cfg, ht_dtype dtype, uint64_t seed,
                                  const ht_model_placement *at, ht_model **out, ht_error *err) {
    ht_status s = ht_model_declare(cfg, dtype, at, out, err);
    if (s == HT_OK) s = ht_model_allocate(*out, at, seed, false, err);
    if (s != HT_OK) {
        ht_model_free(*out);
        *out = NULL;
    }
    return s;
}

ht_status ht_model_build_shard(const ht_model_config *cfg, ht_dtype dtype, uint64_t seed, int rank, int world,
                               ht_model **out, ht_error *err) {
    const ht_model_placement at = {.shard_rank = rank, .shard_world = world};
    return ht_model_build_parallel(cfg, dtype, seed, &at, out, err);
}

ht_status ht_model_build(const ht_model_config *cfg, ht_dtype dtype, uint64_t seed, ht_model **out, ht_error *err) {
    return ht_model_build_shard(cfg, dtype, seed, 0, 1, out, err);
}

double ht_model_flops_per_token(const ht_model_config *cfg, int T) {
    double C = cfg->hidden_size, F = cfg->intermediate_size, V = cfg->vocab_size, L = cfg->num_hidden_layers;
    double qd = (double)cfg->num_attention_heads * ht_model_config_head_dim(cfg);
    double kvd = (double)cfg->num_key_value_heads * ht_model_config_head_dim(cfg);
    double matmul = L * (C * qd + 2 * C * kvd + qd * C) + V * C, attention = qd;
    if (ht_model_config_has_mla(cfg)) {
        /* MLA: the query path, kv_a_proj_with_mqa, kv_b_proj and o_proj; the
         * products q·k over nope + rope and p·v over v_head_dim per head. */
        const ht_mla_config *a = &cfg->mla;
        const double H = cfg->num_attention_heads, Dk = a->qk_nope_head_dim + a->qk_rope_head_dim;
        const double q = a->q_lora_rank > 0 ? C * a->q_lora_rank + (double)a->q_lora_rank * H * Dk : C * H * Dk;
        matmul = L * (q + C * (a->kv_lora_rank + a->qk_rope_head_dim) +
                      (double)a->kv_lora_rank * H * (a->qk_nope_head_dim + a->v_head_dim) + H * a->v_head_dim * C) +
                 V * C;
        attention = H * (Dk + a->v_head_dim) / 2;
    }
    /* The MLPs: a sparse layer's active weights are its router, k experts,
     * the shared experts (and Qwen2-MoE's gate of them). */
    const ht_moe_config *mc = &cfg->moe;
    const bool deepseek = ht_model_config_is_deepseek(cfg);
    const double shared = (double)shared_width(cfg);
    for (int l = 0; l < cfg->num_hidden_layers; l++)
        matmul += ht_model_config_layer_is_sparse(cfg, l)
                      ? C * mc->num_experts + 3.0 * C * mc->moe_intermediate_size * mc->num_experts_per_tok +
                            3.0 * C * shared + (deepseek ? 0 : C)
                      : 3 * C * F;
    return 6.0 * matmul + 6.0 * L * T * attention;
}

double ht_model_activation_bytes(const ht_model *m, int B, int T, ht_dtype compute) {
    return m->ops->activation_bytes ? m->ops->activation_bytes(m, B, T, ht_dtype_size(compute)) : 0.0;
}

ht_status ht_model_set_compute(ht_model *m, ht_dtype dtype, ht_error *err) {
    ht_dtype storage = ht_kernels_storage(dtype);
    ht_status s = ht_params_set_compute(&m->params, storage, dtype, err);
    if (s == HT_OK) m->compute_precision = dtype;
    return s;
}

void ht_model_module_list(const ht_model *m, char *out, size_t cap) {
    size_t len = 0;
    out[0] = 0;
    for (int k = 0; k < m->module_count && len < cap; k++) {
        const char *name = m->modules[k].name;
        const char *dot = strrchr(name, '.');
        int run = k;
        if (dot && dot[1] >= '0' && dot[1] <= '9') { /* a numbered run: prefix.{a..b} */
            size_t plen = (size_t)(dot - name) + 1;
            while (run + 1 < m->module_count && strncmp(m->modules[run + 1].name, name, plen) == 0) run++;
            len += (size_t)snprintf(out + len, cap - len, "%s%.*s{%s..%s}", k ? ", " : "", (int)plen, name, dot + 1,
                                    strrchr(m->modules[run].name, '.') + 1);
        } else {
            len += (size_t)snprintf(out + len, cap - len, "%s%s", k ? ", " : "", name);
        }
        k = run;
    }
}

ht_status ht_model_set_recompute(ht_model *m, const char *const *patterns, int count, ht_error *err) {
    bool *chosen = ht_alloc((size_t)(m->module_count > 0 ? m->module_count : 1) * sizeof(bool));
    if (!chosen) return ht_fail(err, HT_ERR_OOM, "cannot allocate the recompute plan");
    char names[1024];
    ht_model_module_list(m, names, sizeof(names));
    for (int i = 0; i < count; i++) {
        bool hit = false;
        for (int k = 0; k < m->module_count; k++) {
            if (!ht_path_match(patterns[i], m->modules[k].name)) continue;
            if (!m->modules[k].recomputable) {
                ht_free(chosen);
                char can[1024] = "";
                for (int j = 0; j < m->module_count; j++)
                    if (m->modules[j].recomputable && strlen(can) + strlen(m->modules[j].name) + 4 < sizeof(can))
                        snprintf(can + strlen(can), sizeof(can) - strlen(can), "%s%s", can[0] ? ", " : "",
                                 m->modules[j].name);
                return ht_fail(err, HT_ERR_CONFIG,
                               "model.recompute_plan.apply_modules: \"%s\" selects %s, which cannot be recomputed "
                               "(%s): not supported; the modules that can: %s",
                               patterns[i], m->modules[k].name,
                               m->modules[k].why_not ? m->modules[k].why_not
                                                     : "it keeps too little for backward to be worth recomputing",
                               can[0] ? can : "none");
            }
            chosen[k] = hit = true;
        }
        if (!hit) {
            ht_free(chosen);
            return ht_fail(err, HT_ERR_CONFIG,
                           "model.recompute_plan.apply_modules: \"%s\" matches no module of this model (its modules: "
                           "%s)",
                           patterns[i], names);
        }
    }
    ht_free(m->recompute);
    m->recompute = count > 0 ? chosen : NULL;
    if (count == 0) ht_free(chosen);
    m->recompute_generation++;
    return HT_OK;
}

ht_status ht_model_set_cache(ht_model *m, int64_t max_tokens, ht_error *err) {
    if (!m->ops->set_cache)
        return ht_fail(err, HT_ERR_INVALID, "model %s has no key/value cache: it cannot generate", m->config.name);
    if (max_tokens > 0 && (m->tensor.size > 1 || ht_context_size(&m->context) > 1))
        return ht_fail(err, HT_ERR_INVALID,
                       "generation runs on one process: the model is a share of a tensor- or context-parallel group");
    if (max_tokens > m->config.max_position_embeddings)
        return ht_fail(err, HT_ERR_INVALID,
                       "%lld tokens are more than the model's max_position_embeddings (%d): it has no position for "
                       "the rest",
                       (long long)max_tokens, m->config.max_position_embeddings);
    ht_status s = m->ops->set_cache(m, max_tokens > 0 ? max_tokens : 0, err);
    m->cache_capacity = s == HT_OK && max_tokens > 0 ? max_tokens : 0;
    m->cache_tokens = 0;
    return s;
}

void ht_model_reset_attn_max(ht_model *m) {
    int n = m->config.num_hidden_layers * m->config.num_attention_heads;
    for (int i = 0; i < n; i++) m->attn_max_logit[i] = -INFINITY;
}

void ht_model_free(ht_model *m) {
    if (!m) return;
    ht_free(m->tensor.owned);
    m->ops->free(m);
}
