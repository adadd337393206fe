/* Hugging Face PEFT's LoRA adapter directories (adapter_config.json +
 * adapter_model.safetensors, as PeftModel.save_pretrained writes them): read
 * into a model's adapter params after checking the settings agree with
 * model.lora, and written from them. tools/reference/README.md ("LoRA
 * layout") records the layout PEFT uses. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/hf_internal.h"
#include "hypertrain/ckpt.h"

#define PEFT_PATH_MAX 4096
#define PEFT_CONFIG "adapter_config.json"
#define PEFT_WEIGHTS "adapter_model.safetensors"

static ht_status join(char *buf, const char *dir, const char *name, ht_error *err) {
    if (snprintf(buf, PEFT_PATH_MAX, "%s/%s", dir, name) >= PEFT_PATH_MAX)
        return ht_fail(err, HT_ERR_INVALID, "%.200s...: directory name too long", dir);
    return HT_OK;
}

/* A field, or NULL when absent or null (PEFT writes null for "not used"). */
static const ht_json *field(const ht_json *root, const char *name) {
    const ht_json *v = ht_json_get(root, name);
    return v && v->type != HT_JSON_NULL ? v : NULL;
}

/* Whether a field asks for something: true, a non-empty string other than
 * `neutral`, a non-empty list or object, or any number. */
static bool field_set(const ht_json *v, const char *neutral) {
    if (!v) return false;
    switch (v->type) {
    case HT_JSON_BOOL: return v->boolean;
    case HT_JSON_STRING: return v->string[0] && (!neutral || strcmp(v->string, neutral) != 0);
    case HT_JSON_ARRAY:
    case HT_JSON_OBJECT: return v->count > 0;
    case HT_JSON_NUMBER: return true;
    default: return false;
    }
}

static ht_status read_fields(const char *path, const ht_json *root, ht_lora_config *out, ht_error *err) {
    if (root->type != HT_JSON_OBJECT) return ht_fail(err, HT_ERR_FORMAT, "%s: not a JSON object", path);
    const ht_json *type = field(root, "peft_type");
    if (!type || type->type != HT_JSON_STRING || strcmp(type->string, "LORA") != 0)
        return ht_fail(err, HT_ERR_FORMAT, "%s: expected \"peft_type\": \"LORA\", found %s", path,
                       type && type->type == HT_JSON_STRING ? type->string : "none");
    /* What would change the adapted function in ways not implemented here: refused, never ignored. */
    static const struct {
        const char *name, *neutral, *what;
    } refused[] = {
        {"use_dora", NULL, "DoRA"},
        {"bias", "none", "trained biases"},
        {"lora_bias", NULL, "a bias on lora_B"},
        {"fan_in_fan_out", NULL, "transposed (Conv1D) weights"},
        {"rank_pattern", NULL, "per-module ranks"},
        {"alpha_pattern", NULL, "per-module alphas"},
        {"layers_to_transform", NULL, "a subset of layers by index (list the modules in target_modules instead)"},
        {"exclude_modules", NULL, "excluded modules"},
        {"modules_to_save", NULL, "fully trained extra modules"},
        {"target_parameters", NULL, "adapters on parameters"},
        {"trainable_token_indices", NULL, "trainable token embeddings"},
        {"layer_replication", NULL, "replicated layers"},
    };
    for (size_t i = 0; i < sizeof(refused) / sizeof(refused[0]); i++)
        if (field_set(field(root, refused[i].name), refused[i].neutral))
            return ht_fail(err, HT_ERR_CONFIG, "%s: \"%s\" is set: %s is not supported", path, refused[i].name,
                           refused[i].what);
    const ht_json *r = field(root, "r");
    if (!r || r->type != HT_JSON_NUMBER || r->number != floor(r->number) || r->number < 1 || r->number > 1 << 20)
        return ht_fail(err, HT_ERR_FORMAT, "%s: \"r\" must be a positive integer", path);
    memset(out, 0, sizeof(*out));
    out->rank = (int)r->number;
    out->alpha = 8; /* PEFT's defaults */
    const ht_json *v = field(root, "lora_alpha");
    if (v && v->type != HT_JSON_NUMBER) return ht_fail(err, HT_ERR_FORMAT, "%s: \"lora_alpha\" must be a number", path);
    if (v) out->alpha = v->number;
    v = field(root, "lora_dropout");
    if (v && v->type != HT_JSON_NUMBER)
        return ht_fail(err, HT_ERR_FORMAT, "%s: \"lora_dropout\" must be a number", path);
    if (v) out->dropout = v->number;
    v = field(root, "use_rslora");
    if (v && v->type != HT_JSON_BOOL) return ht_fail(err, HT_ERR_FORMAT, "%s: \"use_rslora\" must be a boolean", path);
    out->use_rslora = v && v->boolean;
    v = field(root, "target_modules");
    if (!v) { /* PEFT's default for Qwen2 and Llama */
        out->target_count = 2;
        strcpy(out->targets[0], "q_proj");
        strcpy(out->targets[1], "v_proj");
        return HT_OK;
    }
    if (v->type == HT_JSON_STRING && strcmp(v->string, "all-linear") != 0)
        return ht_fail(err, HT_ERR_CONFIG,
                       "%s: \"target_modules\" is the regular expression \"%s\": not supported (a list of module "
                       "names is)",
                       path, v->string);
    if (v->type == HT_JSON_STRING) {
        out->target_count = 1;
        strcpy(out->targets[0], "all-linear");
        return HT_OK;
    }
    if (v->type != HT_JSON_ARRAY || v->count == 0 || v->count > HT_LORA_MAX_TARGETS)
        return ht_fail(err, HT_ERR_FORMAT, "%s: \"target_modules\" must be a list of 1 to %d module names", path,
                       HT_LORA_MAX_TARGETS);
    for (size_t i = 0; i < v->count; i++) {
        const ht_json *t = &v->items[i];
        if (t->type != HT_JSON_STRING || !t->string[0] || strlen(t->string) >= HT_LORA_TARGET_MAX)
            return ht_fail(err, HT_ERR_FORMAT, "%s: \"target_modules\" entry %zu must be a module name", path, i);
        strcpy(out->targets[out->target_count++], t->string);
    }
    return HT_OK;
}

ht_status ht_peft_read_config(const char *dir, ht_lora_config *out, ht_error *err) {
    char path[PEFT_PATH_MAX];
    ht_status s = join(path, dir, PEFT_CONFIG, err);
    if (s != HT_OK) return s;
    ht_json *root;
    s = ht_json_read_file(path, "a PEFT adapter_config.json", &root, err);
    if (s != HT_OK) return s;
    s = read_fields(path, root, out, err);
    ht_json_free(root);
    return s;
}

static bool selected(const ht_lora_config *c, const char *module) {
    for (int k = 0; k < c->target_count; k++)
        if (ht_lora_target_matches(c->targets[k], module)) return true;
    return false;
}

static void format_targets(const ht_lora_config *c, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "[");
    for (int k = 0; k < c->target_count && used < n; k++)
        used += (size_t)snprintf(buf + used, n - used, "%s%s", k ? ", " : "", c->targets[k]);
    if (used < n) snprintf(buf + used, n - used, "]");
}

/* The adapter's settings against the run's: every difference is an error naming both. */
static ht_status check_agrees(const char *path, const ht_lora_config *want, const ht_lora_config *have,
                              const ht_param_store *params, ht_error *err) {
    const char *fix = "set model.lora to the adapter's settings, or start without model.lora.from_pretrained";
    if (want->rank != have->rank)
        return ht_fail(err, HT_ERR_CONFIG, "model.lora.rank is %d but %s has r %d: %s", want->rank, path, have->rank,
                       fix);
    if (want->alpha != have->alpha)
        return ht_fail(err, HT_ERR_CONFIG, "model.lora.alpha is %g but %s has lora_alpha %g: %s", want->alpha, path,
                       have->alpha, fix);
    if (want->use_rslora != have->use_rslora)
        return ht_fail(err, HT_ERR_CONFIG, "model.lora.use_rslora is %s but %s has use_rslora %s: %s",
                       want->use_rslora ? "true" : "false", path, have->use_rslora ? "true" : "false", fix);
    /* target_modules: the same modules, however each spells them. */
    for (int i = 0; i < params->count; i++) {
        const char *name = params->items[i].name;
        char module[HT_PARAM_NAME_MAX], adapter[HT_PARAM_NAME_MAX + 16];
        bool ours;
        if (ht_lora_kind(name) == 'A') {
            snprintf(module, sizeof(module), "%.*s", (int)(strlen(name) - strlen(".lora_A.weight")), name);
            ours = true;
        } else if (!ht_lora_kind(name) && params->items[i].ndim == 2 && strlen(name) > 7 &&
                   strcmp(name + strlen(name) - 7, ".weight") == 0) {
            snprintf(module, sizeof(module), "%.*s", (int)(strlen(name) - 7), name);
            snprintf(adapter, sizeof(adapter), "%s.lora_A.weight", module);
            ours = ht_params_find(params, adapter) != NULL;
        } else {
            continue;
        }
        if (ours == selected(have, module)) continue;
        char a[HT_LORA_MAX_TARGETS * (HT_LORA_TARGET_MAX + 2) + 4], b[sizeof(a)];
        format_targets(want, a, sizeof(a));
        format_targets(have, b, sizeof(b));
        return ht_fail(err, HT_ERR_CONFIG,
                       "model.lora.target_modules %s and the target_modules %s of %s select different modules: %s "
                       "is adapted by %s only; %s",
                       a, b, path, module, ours ? "model.lora" : "the adapter", fix);
    }
    return HT_OK;
}

ht_status ht_peft_load_adapter(const char *dir, const ht_lora_config *want, ht_param_store *params, ht_error *err) {
    char cfg_path[PEFT_PATH_MAX], path[PEFT_PATH_MAX];
    ht_lora_config have;
    ht_status s = join(cfg_path, dir, PEFT_CONFIG, err);
    if (s == HT_OK) s = join(path, dir, PEFT_WEIGHTS, err);
    if (s == HT_OK) s = ht_peft_read_config(dir, &have, err);
    if (s == HT_OK) s = check_agrees(cfg_path, want, &have, params, err);
    if (s != HT_OK) return s;
    ht_safetensors *st;
    s = ht_safetensors_open(path, &st, err);
    if (s != HT_OK) return s;
    char key[HT_PARAM_NAME_MAX + 32];
    int loaded = 0;
    for (int i = 0; i < params->count && s == HT_OK; i++) {
        ht_param *p = &params->items[i];
        if (!ht_lora_kind(p->name)) continue;
        snprintf(key, sizeof(key), HT_PEFT_PREFIX "%s", p->name);
        const ht_st_tensor *t = ht_safetensors_find(st, key);
        if (!t) {
            s = ht_fail(err, HT_ERR_FORMAT, "%s: no tensor '%s' for the adapter %s", path, key, p->name);
            break;
        }
        bool same = t->ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) same = t->shape[d] == p->shape[d];
        if (!same) {
            char a[128], b[128];
            ht_hf_format_dims(a, sizeof(a), t->ndim, t->shape);
            ht_hf_format_dims(b, sizeof(b), p->ndim, p->shape);
            s = ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s' has shape %s but the model's adapter expects %s", path,
                        key, a, b);
            break;
        }
        s = ht_hf_copy_rows_into(params, p, t, path, err);
        loaded++;
    }
    /* Every tensor of the file is one of ours: another would be a trained part of the model left out. */
    for (int i = 0; s == HT_OK && i < ht_safetensors_count(st); i++) {
        const char *name = ht_safetensors_tensor(st, i)->name;
        size_t pre = strlen(HT_PEFT_PREFIX);
        const ht_param *p = strncmp(name, HT_PEFT_PREFIX, pre) == 0 ? ht_params_find(params, name + pre) : NULL;
        if (!p || !ht_lora_kind(p->name))
            s = ht_fail(err, HT_ERR_FORMAT,
                        "%s: tensor '%s' is not an adapter of this model (expected only " HT_PEFT_PREFIX
                        "<module>.lora_A.weight / .lora_B.weight)",
                        path, name);
    }
    ht_safetensors_close(st);
    if (s == HT_OK) ht_log_info("model.lora.from_pretrained: %d adapter tensors from %s", loaded, path);
    return s;
}

ht_status ht_peft_save_adapter(const char *dir, const ht_param_store *params, const ht_lora_config *lora,
                               const char *base_model, ht_dtype dtype, ht_error *err) {
    char path[PEFT_PATH_MAX];
    if (!ht_dtype_is_float(dtype))
        return ht_fail(err, HT_ERR_INVALID, "%s: cannot save adapters as %s", dir, ht_dtype_name(dtype));
    ht_status s = ht_make_dirs(dir, err);
    if (s != HT_OK) return s;
    ht_st_writer w = {0};
    char key[HT_PARAM_NAME_MAX + 32];
    int count = 0;
    s = ht_st_writer_add_metadata(&w, "format", "pt", err);
    for (int i = 0; i < params->count && s == HT_OK; i++) {
        const ht_param *p = &params->items[i];
        if (!ht_lora_kind(p->name)) continue;
        if (!p->data || p->row0 != 0 || p->row1 != p->shape[0])
            s = ht_fail(err, HT_ERR_INVALID, "%s: adapter %s is not a whole tensor here (gather the shards first)", dir,
                        p->name);
        snprintf(key, sizeof(key), HT_PEFT_PREFIX "%s", p->name);
        if (s == HT_OK) s = ht_st_writer_add_from(&w, key, dtype, p->ndim, p->shape, p->data, p->dtype, params, err);
        count++;
    }
    if (s == HT_OK && count == 0) s = ht_fail(err, HT_ERR_INVALID, "%s: the model has no LoRA adapters to save", dir);
    if (s == HT_OK) s = join(path, dir, PEFT_WEIGHTS, err);
    if (s == HT_OK) s = ht_st_writer_write(&w, path, err);
    ht_st_writer_free(&w);
    if (s != HT_OK) return s;

    char(*targets)[HT_PARAM_NAME_MAX];
    int n_targets = ht_lora_target_names(params, &targets);
    if (n_targets < 0) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", dir);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) {
        free(targets);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot build " PEFT_CONFIG, dir);
    }
    /* PEFT's own key order (json.dumps(sort_keys=True)); the keys it needs and
     * the ones that say how the adapter applies, the rest at PEFT's defaults. */
    fputs("{\n  \"base_model_name_or_path\": ", f);
    if (base_model && base_model[0])
        ht_json_write_string(f, base_model);
    else
        fputs("null", f);
    fputs(",\n  \"bias\": \"none\",\n  \"fan_in_fan_out\": false,\n  \"inference_mode\": true,\n  \"lora_alpha\": ", f);
    ht_json_write_number(f, lora->alpha);
    fputs(",\n  \"lora_dropout\": ", f);
    ht_json_write_number(f, lora->dropout);
    fprintf(f, ",\n  \"peft_type\": \"LORA\",\n  \"r\": %d,\n  \"target_modules\": [", lora->rank);
    for (int k = 0; k < n_targets; k++) {
        fputs(k ? ",\n    " : "\n    ", f);
        ht_json_write_string(f, targets[k]);
    }
    fprintf(f, "\n  ],\n  \"task_type\": \"CAUSAL_LM\",\n  \"use_rslora\": %s\n}\n",
            lora->use_rslora ? "true" : "false");
    free(targets);
    if (fclose(f) != 0 || !text) {
        free(text);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot build " PEFT_CONFIG, dir);
    }
    s = join(path, dir, PEFT_CONFIG, err);
    if (s == HT_OK) s = ht_hf_write_text(path, text, len, err);
    free(text);
    return s;
}
