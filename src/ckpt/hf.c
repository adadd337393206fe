/* Hugging Face model directories: config.json <-> ht_model_config, and the
 * weights (model.safetensors, or shards listed in model.safetensors.index.json)
 * <-> a named parameter store, matched by name with exact shapes. */
#include "hypertrain/ckpt.h"
#include "ckpt/hf_internal.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define HF_PATH_MAX 4096
#define HF_SINGLE "model.safetensors"
#define HF_INDEX "model.safetensors.index.json"

/* Every public entry checks the directory name leaves room for the file names joined to it. */
static void join(char *buf, const char *dir, const char *name) { snprintf(buf, HF_PATH_MAX, "%s/%s", dir, name); }

static ht_status check_dir_name(const char *dir, ht_error *err) {
    if (strlen(dir) + 80 > HF_PATH_MAX)
        return ht_fail(err, HT_ERR_INVALID, "%.200s...: directory name longer than %d bytes", dir, HF_PATH_MAX - 80);
    return HT_OK;
}

static const char *json_type_name(const ht_json *v) {
    static const char *names[] = {"null", "a boolean", "a number", "a string", "an array", "an object"};
    return names[v->type];
}

/* ---------------------------------------------------------------- config.json */

/* A field, or NULL when it is absent or null (HF writes null for "use the default"). */
static const ht_json *field(const ht_json *root, const char *name) {
    const ht_json *v = ht_json_get(root, name);
    return v && v->type != HT_JSON_NULL ? v : NULL;
}

static ht_status get_int(const char *path, const ht_json *root, const char *name, bool required, int def, int *out,
                         ht_error *err) {
    const ht_json *v = field(root, name);
    if (!v) {
        if (required) return ht_fail(err, HT_ERR_CONFIG, "%s: required field \"%s\" is missing", path, name);
        *out = def;
        return HT_OK;
    }
    if (v->type != HT_JSON_NUMBER || v->number != floor(v->number) || v->number < 0 || v->number > INT_MAX)
        return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" must be a non-negative integer, not %s", path, name,
                       v->type == HT_JSON_NUMBER ? "a fraction or out of range" : json_type_name(v));
    *out = (int)v->number;
    return HT_OK;
}

static ht_status get_double(const char *path, const ht_json *root, const char *name, double def, double *out,
                            ht_error *err) {
    const ht_json *v = field(root, name);
    if (!v) {
        *out = def;
        return HT_OK;
    }
    if (v->type != HT_JSON_NUMBER)
        return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" must be a number, not %s", path, name, json_type_name(v));
    *out = v->number;
    return HT_OK;
}

static ht_status get_bool(const char *path, const ht_json *root, const char *name, bool def, bool *out, ht_error *err) {
    const ht_json *v = field(root, name);
    if (!v) {
        *out = def;
        return HT_OK;
    }
    if (v->type != HT_JSON_BOOL)
        return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" must be true or false, not %s", path, name,
                       json_type_name(v));
    *out = v->boolean;
    return HT_OK;
}

/* RoPE variants other than the plain one change the model; refuse them rather than load a different model. */
/* YaRN is read into rs (its fields named as "<name>.<field>" in errors). */
static ht_status check_rope(const char *path, const ht_json *root, const char *name, ht_rope_scaling *rs,
                            ht_error *err) {
    const ht_json *r = field(root, name);
    if (!r) return HT_OK;
    if (r->type != HT_JSON_OBJECT)
        return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" must be an object, not %s", path, name, json_type_name(r));
    const ht_json *type = field(r, "rope_type");
    if (!type) type = field(r, "type");
    if (!type || (type->type == HT_JSON_STRING && strcmp(type->string, "default") == 0)) return HT_OK;
    if (type->type != HT_JSON_STRING || strcmp(type->string, "yarn") != 0)
        return ht_fail(err, HT_ERR_CONFIG, "%s: %s type %s is not supported (the default RoPE and yarn are)", path,
                       name, type->type == HT_JSON_STRING ? type->string : json_type_name(type));
    snprintf(rs->type, sizeof(rs->type), "yarn");
    char where[HF_PATH_MAX + 64];
    snprintf(where, sizeof(where), "%s: %s", path, name);
    ht_status s;
    if ((s = get_double(where, r, "factor", 0, &rs->factor, err)) != HT_OK ||
        (s = get_int(where, r, "original_max_position_embeddings", true, 0, &rs->original_max_position_embeddings,
                     err)) != HT_OK ||
        (s = get_double(where, r, "beta_fast", 32, &rs->beta_fast, err)) != HT_OK ||
        (s = get_double(where, r, "beta_slow", 1, &rs->beta_slow, err)) != HT_OK ||
        (s = get_double(where, r, "mscale", 1, &rs->mscale, err)) != HT_OK ||
        (s = get_double(where, r, "mscale_all_dim", 0, &rs->mscale_all_dim, err)) != HT_OK)
        return s;
    if (!field(r, "factor")) return ht_fail(err, HT_ERR_CONFIG, "%s: required field \"factor\" is missing", where);
    /* What transformers' YaRN reads beyond these changes the frequencies: refuse rather than differ. */
    const char *other[] = {"attention_factor", "truncate"};
    for (size_t i = 0; i < sizeof(other) / sizeof(other[0]); i++)
        if (field(r, other[i]) && !(strcmp(other[i], "truncate") == 0 && field(r, other[i])->type == HT_JSON_BOOL &&
                                    field(r, other[i])->boolean))
            return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" is not supported", where, other[i]);
    return HT_OK;
}

/* config.json's architecture fields, from model.h's table (HT_ARCH_FIELDS): per
 * family (model_type), its name there and transformers' default as the table
 * writes it. */
enum { QWEN2, LLAMA, QWEN2_MOE, DEEPSEEK_V3, N_FAMILIES };
static const char *const FAMILIES[N_FAMILIES] = {"qwen2", "llama", "qwen2_moe", "deepseek_v3"};
typedef enum { ARCH_INT, ARCH_DIM, ARCH_INT_OR_NULL, ARCH_FLT, ARCH_BOOL, ARCH_LAYERS } arch_type;
typedef struct arch_field {
    const char *json;
    arch_type type;
    size_t offset;
    const char *def[N_FAMILIES]; /* "req", "-", a value, or another field's name */
} arch_field;
#define ARCH_FIELD(member, key, json, type, def, qwen2, llama, qwen2_moe, deepseek_v3)                                 \
    {#json, ARCH_##type, offsetof(ht_model_config, member), {#qwen2, #llama, #qwen2_moe, #deepseek_v3}},
static const arch_field ARCH[] = {HT_ARCH_FIELDS(ARCH_FIELD)};
#define N_ARCH ((int)(sizeof(ARCH) / sizeof(ARCH[0])))
#define ARCH_SPELLING(family, member, name) {FAMILY_##family, offsetof(ht_model_config, member), #name},
enum { FAMILY_qwen2 = QWEN2, FAMILY_llama = LLAMA, FAMILY_qwen2_moe = QWEN2_MOE, FAMILY_deepseek_v3 = DEEPSEEK_V3 };
static const struct {
    int family;
    size_t offset;
    const char *name;
} SPELLINGS[] = {HT_ARCH_SPELLINGS(ARCH_SPELLING)};

static const char *json_name(const arch_field *f, int family) {
    for (size_t i = 0; i < sizeof(SPELLINGS) / sizeof(SPELLINGS[0]); i++)
        if (SPELLINGS[i].family == family && SPELLINGS[i].offset == f->offset) return SPELLINGS[i].name;
    return f->json;
}

/* The value of a table default: a number, true or false, or an int field's (read before it). */
static double arch_default(const char *def, const ht_model_config *cfg) {
    if (strcmp(def, "true") == 0) return 1;
    if (strcmp(def, "false") == 0 || strcmp(def, "req") == 0) return 0;
    for (int i = 0; i < N_ARCH; i++)
        if (strcmp(ARCH[i].json, def) == 0) return *(const int *)((const char *)cfg + ARCH[i].offset);
    return strtod(def, NULL);
}

static ht_status get_layers(const char *path, const ht_json *root, const char *name, ht_layer_list *out,
                            ht_error *err) {
    const ht_json *list = field(root, name);
    out->count = 0;
    if (!list) return HT_OK;
    if (list->type != HT_JSON_ARRAY || list->count > (size_t)HT_LAYER_LIST_MAX)
        return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" must be a list of at most %d layer indices", path, name,
                       HT_LAYER_LIST_MAX);
    for (size_t i = 0; i < list->count; i++) {
        const ht_json *v = &list->items[i];
        if (v->type != HT_JSON_NUMBER || v->number != floor(v->number) || v->number < 0 || v->number > INT_MAX)
            return ht_fail(err, HT_ERR_CONFIG, "%s: %s[%zu] must be a layer index (an integer >= 0)", path, name, i);
        out->items[out->count++] = (int)v->number;
    }
    return HT_OK;
}

static ht_status read_arch_field(const char *path, const ht_json *root, int family, const arch_field *f,
                                 ht_model_config *cfg, ht_error *err) {
    const char *def = f->def[family], *name = json_name(f, family);
    if (strcmp(def, "-") == 0) return HT_OK; /* not this family's: stays 0 */
    void *out = (char *)cfg + f->offset;
    const double d = arch_default(def, cfg);
    if (strcmp(name, "rope_theta") == 0) {
        /* transformers 5 moved rope_theta into rope_parameters; older files have it at the top. */
        const ht_json *rope_params = field(root, "rope_parameters");
        if (!field(root, "rope_theta") && rope_params) root = rope_params;
    }
    switch (f->type) {
    case ARCH_INT:
    case ARCH_DIM: return get_int(path, root, name, strcmp(def, "req") == 0, (int)d, out, err);
    case ARCH_INT_OR_NULL: {
        /* Absent: the default; null: 0 (field() takes null for absent); 0 itself is neither. */
        const ht_json *v = ht_json_get(root, name);
        ht_status s = get_int(path, root, name, false, v ? 0 : (int)d, out, err);
        if (s == HT_OK && v && v->type == HT_JSON_NUMBER && *(int *)out == 0)
            return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" must be positive or null, not 0", path, name);
        return s;
    }
    case ARCH_FLT: return get_double(path, root, name, d, out, err);
    case ARCH_BOOL: return get_bool(path, root, name, d != 0, out, err);
    case ARCH_LAYERS: return get_layers(path, root, name, out, err);
    }
    return HT_OK;
}

/* DeepSeek-V3's fields whose other values change the model, beyond the table's. */
static ht_status check_deepseek_fields(const char *path, const ht_json *root, ht_error *err) {
    const char *unsupported[] = {"moe_layer_freq", "ep_size", "scoring_func", "topk_method"};
    for (size_t i = 0; i < sizeof(unsupported) / sizeof(unsupported[0]); i++) {
        const ht_json *v = field(root, unsupported[i]);
        /* The values transformers' DeepseekV3 implies are fine; others change the model. */
        bool same = v && ((v->type == HT_JSON_NUMBER && v->number == 1 && i < 2) ||
                          (v->type == HT_JSON_STRING && i == 2 && strcmp(v->string, "sigmoid") == 0) ||
                          (v->type == HT_JSON_STRING && i == 3 && strcmp(v->string, "noaux_tc") == 0));
        if (v && !same)
            return ht_fail(err, HT_ERR_CONFIG, "%s: field \"%s\" is not supported with that value", path,
                           unsupported[i]);
    }
    return HT_OK;
}

static ht_status read_config_fields(const char *path, const ht_json *root, ht_model_config *cfg, ht_error *err) {
    if (root->type != HT_JSON_OBJECT) return ht_fail(err, HT_ERR_CONFIG, "%s: not a JSON object", path);
    const ht_json *type = field(root, "model_type");
    if (!type) return ht_fail(err, HT_ERR_CONFIG, "%s: required field \"model_type\" is missing", path);
    if (type->type != HT_JSON_STRING)
        return ht_fail(err, HT_ERR_CONFIG, "%s: field \"model_type\" must be a string, not %s", path,
                       json_type_name(type));
    int family = 0;
    while (family < N_FAMILIES && strcmp(type->string, FAMILIES[family]) != 0) family++;
    if (family == N_FAMILIES)
        return ht_fail(err, HT_ERR_CONFIG,
                       "%s: model_type \"%s\" is not supported (supported: qwen2, llama, qwen2_moe, deepseek_v3)", path,
                       type->string);
    snprintf(cfg->name, sizeof(cfg->name), "%s", type->string);

    const ht_json *act = field(root, "hidden_act");
    if (act && (act->type != HT_JSON_STRING || strcmp(act->string, "silu") != 0))
        return ht_fail(err, HT_ERR_CONFIG, "%s: hidden_act %s is not supported (only \"silu\")", path,
                       act->type == HT_JSON_STRING ? act->string : json_type_name(act));
    /* Quantized checkpoints (DeepSeek-V3's own is FP8 with block scales) hold other tensors than the model's. */
    const ht_json *quant = field(root, "quantization_config");
    if (quant) {
        const ht_json *method = quant->type == HT_JSON_OBJECT ? field(quant, "quant_method") : NULL;
        return ht_fail(err, HT_ERR_CONFIG,
                       "%s: quantization_config%s%s%s: quantized weights are not supported; convert the checkpoint "
                       "to bfloat16 or float32 first (for DeepSeek-V3's FP8 release, its fp8_cast_bf16 script)",
                       path, method && method->type == HT_JSON_STRING ? " (" : "",
                       method && method->type == HT_JSON_STRING ? method->string : "",
                       method && method->type == HT_JSON_STRING ? ")" : "");
    }
    bool sliding = false;
    ht_status s;
    if ((s = get_bool(path, root, "use_sliding_window", false, &sliding, err)) != HT_OK) return s;
    if (sliding) return ht_fail(err, HT_ERR_CONFIG, "%s: use_sliding_window true is not supported", path);
    if ((s = check_rope(path, root, "rope_scaling", &cfg->rope_scaling, err)) != HT_OK) return s;
    if ((s = check_rope(path, root, "rope_parameters", &cfg->rope_scaling, err)) != HT_OK) return s;
    for (int i = 0; i < N_ARCH; i++)
        if ((s = read_arch_field(path, root, family, &ARCH[i], cfg, err)) != HT_OK) return s;
    return family == DEEPSEEK_V3 ? check_deepseek_fields(path, root, err) : HT_OK;
}

ht_status ht_hf_read_config(const char *dir, ht_model_config *cfg, ht_error *err) {
    if (check_dir_name(dir, err) != HT_OK) return HT_ERR_INVALID;
    char path[HF_PATH_MAX];
    join(path, dir, "config.json");
    ht_json *root;
    ht_status s = ht_json_read_file(path, "a config.json", &root, err);
    if (s != HT_OK) return s;
    memset(cfg, 0, sizeof(*cfg));
    s = read_config_fields(path, root, cfg, err);
    ht_json_free(root);
    return s;
}

/* Writes text to path through path.tmp.<pid>, fsync and rename. */
ht_status ht_hf_write_text(const char *path, const char *text, size_t len, ht_error *err) {
    char tmp[HF_PATH_MAX + 32];
    snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid());
    FILE *f = fopen(tmp, "wb");
    if (!f) return ht_fail(err, HT_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno));
    bool ok = fwrite(text, 1, len, f) == len && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int saved = errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        saved = errno;
    }
    if (!ok || rename(tmp, path) != 0) {
        if (ok) saved = errno;
        remove(tmp);
        return ht_fail(err, HT_ERR_IO, "%s: write failed: %s", path, strerror(saved));
    }
    return HT_OK;
}

/* rope_parameters (transformers 5), and for YaRN rope_scaling too (transformers < 5). */
static void write_rope(FILE *f, const ht_model_config *cfg) {
    const ht_rope_scaling *r = &cfg->rope_scaling;
    const bool yarn = ht_rope_is_yarn(r);
    for (int spelling = 0; spelling < (yarn ? 2 : 1); spelling++) {
        fprintf(f, "  \"%s\": {\"rope_type\": \"%s\", \"rope_theta\": ", spelling ? "rope_scaling" : "rope_parameters",
                yarn ? "yarn" : "default");
        ht_json_write_number(f, cfg->rope_theta);
        if (yarn) {
            fputs(", \"factor\": ", f);
            ht_json_write_number(f, r->factor);
            fprintf(f,
                    ", \"original_max_position_embeddings\": %d, \"beta_fast\": ", r->original_max_position_embeddings);
            ht_json_write_number(f, r->beta_fast);
            fputs(", \"beta_slow\": ", f);
            ht_json_write_number(f, r->beta_slow);
            fputs(", \"mscale\": ", f);
            ht_json_write_number(f, r->mscale);
            fputs(", \"mscale_all_dim\": ", f);
            ht_json_write_number(f, r->mscale_all_dim);
        }
        fputs("},\n", f);
    }
}

/* One field of the table as `  "name": value,`; nothing where the family has no such field, or a DIM is 0. */
static void write_arch_field(FILE *f, const ht_model_config *cfg, int family, const arch_field *a) {
    const void *v = (const char *)cfg + a->offset;
    if (strcmp(a->def[family], "-") == 0 || (a->type == ARCH_DIM && *(const int *)v == 0)) return;
    fprintf(f, "  \"%s\": ", json_name(a, family));
    switch (a->type) {
    case ARCH_INT:
    case ARCH_DIM: fprintf(f, "%d", *(const int *)v); break;
    case ARCH_INT_OR_NULL:
        if (*(const int *)v > 0)
            fprintf(f, "%d", *(const int *)v);
        else
            fputs("null", f);
        break;
    case ARCH_FLT: ht_json_write_number(f, *(const double *)v); break;
    case ARCH_BOOL: fputs(*(const bool *)v ? "true" : "false", f); break;
    case ARCH_LAYERS: {
        const ht_layer_list *l = v;
        fputc('[', f);
        for (int i = 0; i < l->count; i++) fprintf(f, "%s%d", i ? ", " : "", l->items[i]);
        fputc(']', f);
        break;
    }
    }
    fputs(",\n", f);
}

ht_status ht_hf_write_config(const char *dir, const ht_model_config *cfg, ht_dtype torch_dtype, ht_error *err) {
    if (check_dir_name(dir, err) != HT_OK) return HT_ERR_INVALID;
    char path[HF_PATH_MAX];
    join(path, dir, "config.json");
    int family = 0;
    while (family < N_FAMILIES && strcmp(cfg->name, FAMILIES[family]) != 0) family++;
    if (family == N_FAMILIES)
        return ht_fail(err, HT_ERR_CONFIG,
                       "%s: model \"%s\" has no Hugging Face export (supported: qwen2, llama, qwen2_moe, deepseek_v3)",
                       path, cfg->name);
    if (family == QWEN2 && !cfg->attention_bias)
        return ht_fail(err, HT_ERR_CONFIG,
                       "%s: transformers' Qwen2 always has q/k/v biases; a qwen2 model without attention_bias "
                       "cannot be exported as qwen2",
                       path);
    if (!ht_dtype_is_float(torch_dtype))
        return ht_fail(err, HT_ERR_INVALID, "%s: torch_dtype %s is not a float dtype", path,
                       ht_dtype_name(torch_dtype));
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return ht_fail(err, HT_ERR_OOM, "%s: cannot build config.json", path);
    static const char *const architectures[N_FAMILIES] = {"Qwen2ForCausalLM", "LlamaForCausalLM", "Qwen2MoeForCausalLM",
                                                          "DeepseekV3ForCausalLM"};
    fprintf(f, "{\n  \"architectures\": [\"%s\"],\n", architectures[family]);
    fprintf(f, "  \"model_type\": \"%s\",\n  \"hidden_act\": \"silu\",\n", cfg->name);
    for (int i = 0; i < N_ARCH; i++) {
        write_arch_field(f, cfg, family, &ARCH[i]);
        /* Both spellings of rope_theta: transformers < 5 reads the top-level one, 5 reads rope_parameters. */
        if (strcmp(ARCH[i].json, "rope_theta") == 0) write_rope(f, cfg);
        /* What transformers writes after the dense model's fields, before the MLA's and the sparse MLP's. */
        if (strcmp(ARCH[i].json, "initializer_range") == 0) {
            fputs("  \"attention_dropout\": 0.0,\n  \"use_cache\": true,\n", f);
            if (family == QWEN2_MOE) fputs("  \"use_sliding_window\": false,\n", f);
        }
    }
    fprintf(f, "  \"torch_dtype\": \"%s\",\n  \"dtype\": \"%s\"\n}\n", ht_dtype_name(torch_dtype),
            ht_dtype_name(torch_dtype));
    if (fclose(f) != 0 || !text) {
        free(text);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot build config.json", path);
    }
    ht_status s = ht_hf_write_text(path, text, len, err);
    free(text);
    return s;
}

/* ---------------------------------------------------------------- weights */

/* The open weight files of a directory. */
typedef struct hf_files {
    ht_safetensors **files;
    int count;
} hf_files;

static void files_close(hf_files *fs) {
    for (int i = 0; i < fs->count; i++) ht_safetensors_close(fs->files[i]);
    free(fs->files);
    fs->files = NULL;
    fs->count = 0;
}

static ht_status files_add(hf_files *fs, const char *path, ht_error *err) {
    ht_safetensors **files = realloc(fs->files, ((size_t)fs->count + 1) * sizeof(*files));
    if (!files) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", path);
    fs->files = files;
    ht_status s = ht_safetensors_open(path, &fs->files[fs->count], err);
    if (s == HT_OK) fs->count++;
    return s;
}

static const ht_st_tensor *files_find(const hf_files *fs, const char *name, const ht_safetensors **in) {
    for (int i = 0; i < fs->count; i++) {
        const ht_st_tensor *t = ht_safetensors_find(fs->files[i], name);
        if (t) {
            *in = fs->files[i];
            return t;
        }
    }
    return NULL;
}

/* Opens every shard the index names and checks each listed tensor is where the index says. */
static ht_status open_index(const char *dir, const char *index_path, hf_files *fs, ht_error *err) {
    ht_json *root;
    ht_status s = ht_json_read_file(index_path, "a model.safetensors.index.json", &root, err);
    if (s != HT_OK) return s;
    const ht_json *map = ht_json_get(root, "weight_map");
    const char **names = NULL; /* the file of each weight_map entry's shard, as listed */
    int *which = NULL;
    if (!map || map->type != HT_JSON_OBJECT) {
        s = ht_fail(err, HT_ERR_FORMAT, "%s: \"weight_map\" is missing or not an object", index_path);
        goto done;
    }
    names = calloc(map->count + 1, sizeof(char *));
    which = calloc(map->count + 1, sizeof(int));
    if (!names || !which) {
        s = ht_fail(err, HT_ERR_OOM, "%s: out of memory", index_path);
        goto done;
    }
    int nfiles = 0;
    for (size_t i = 0; i < map->count; i++) {
        const ht_json *e = &map->items[i];
        if (e->type != HT_JSON_STRING || !e->string[0] || strchr(e->string, '/')) {
            s = ht_fail(err, HT_ERR_FORMAT, "%s: weight_map entry \"%s\" must be a file name in the same directory",
                        index_path, e->key);
            goto done;
        }
        int f = 0;
        while (f < nfiles && strcmp(names[f], e->string) != 0) f++;
        if (f == nfiles) {
            char path[HF_PATH_MAX];
            join(path, dir, e->string);
            if ((s = files_add(fs, path, err)) != HT_OK) goto done;
            names[nfiles++] = e->string;
        }
        which[i] = f;
    }
    /* Each listed tensor must be where the index says, and nowhere else: a
     * second copy in another shard would otherwise be read in its place. */
    for (size_t i = 0; i < map->count; i++) {
        if (!ht_safetensors_find(fs->files[which[i]], map->items[i].key)) {
            s = ht_fail(err, HT_ERR_FORMAT, "%s: maps tensor '%s' to %s, which does not hold it", index_path,
                        map->items[i].key, names[which[i]]);
            goto done;
        }
        for (int f = 0; f < nfiles; f++)
            if (f != which[i] && ht_safetensors_find(fs->files[f], map->items[i].key)) {
                s = ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s' is in both %s (where the index maps it) and %s",
                            index_path, map->items[i].key, names[which[i]], names[f]);
                goto done;
            }
    }
done:
    free(names);
    free(which);
    ht_json_free(root);
    return s;
}

/* Opens model.safetensors, or the shards of the index, as transformers looks for them (single file first). */
static ht_status open_weights(const char *dir, hf_files *fs, ht_error *err) {
    char path[HF_PATH_MAX];
    join(path, dir, HF_SINGLE);
    if (access(path, F_OK) == 0) return files_add(fs, path, err);
    join(path, dir, HF_INDEX);
    if (access(path, F_OK) == 0) return open_index(dir, path, fs, err);
    return ht_fail(err, HT_ERR_IO, "%s: neither %s nor %s exists", dir, HF_SINGLE, HF_INDEX);
}

/* Appends `name` to a comma-separated list, stopping before the buffer fills; counts what did not fit. */
static void list_append(char *buf, size_t cap, const char *name, int *left_out) {
    size_t n = strlen(buf);
    if (n + strlen(name) + 16 > cap) {
        (*left_out)++;
        return;
    }
    snprintf(buf + n, cap - n, "%s%s", n ? ", " : "", name);
}

void ht_hf_format_dims(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

/* A tensor-parallel slice (and FSDP's rows of it): the param's box of the
 * whole tensor, converting to its dtype. */
static ht_status copy_box(ht_param *p, const ht_st_tensor *t, const char *file, ht_error *err) {
    const size_t esize = ht_dtype_size(t->dtype);
    if (ht_param_local_numel(p) == 0) return HT_OK;
    ht_box whole = {{0}, {0}};
    for (int d = 0; d < p->ndim; d++) whole.length[d] = p->global_shape[d];
    const void *src = t->data;
    void *aligned = NULL;
    if ((uintptr_t)src % esize != 0) { /* a writer that did not align its tensors */
        aligned = malloc((size_t)ht_param_global_numel(p) * esize + 1);
        if (!aligned) return ht_fail(err, HT_ERR_OOM, "%s: out of memory copying '%s'", file, t->name);
        memcpy(aligned, src, (size_t)ht_param_global_numel(p) * esize);
        src = aligned;
    }
    ht_box_copy(p->ndim, p->data, p->dtype, &p->box, src, t->dtype, &whole);
    free(aligned);
    return HT_OK;
}

/* Copies the param's local rows out of the tensor, converting to the param's dtype. */
ht_status ht_hf_copy_rows(ht_param *p, const ht_st_tensor *t, const char *file, ht_error *err) {
    if (p->tp_dim >= 0) {
        if (t->dtype != p->dtype && !(ht_dtype_is_float(t->dtype) && ht_dtype_is_float(p->dtype)))
            return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s' is %s and cannot be converted to the model's %s", file,
                           t->name, ht_dtype_safetensors_name(t->dtype), ht_dtype_name(p->dtype));
        return copy_box(p, t, file, err);
    }
    int64_t row_numel = ht_param_row_numel(p);
    int64_t r1 = p->row1 < p->shape[0] ? p->row1 : p->shape[0]; /* rows past the end are shard padding */
    size_t n = r1 > p->row0 ? (size_t)((r1 - p->row0) * row_numel) : 0;
    size_t esize = ht_dtype_size(t->dtype);
    if (t->dtype != p->dtype && !(ht_dtype_is_float(t->dtype) && ht_dtype_is_float(p->dtype)))
        return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s' is %s and cannot be converted to the model's %s", file,
                       t->name, ht_dtype_safetensors_name(t->dtype), ht_dtype_name(p->dtype));
    if (n == 0) return HT_OK;
    const char *src = (const char *)t->data + (size_t)p->row0 * (size_t)row_numel * esize;
    if (t->dtype == p->dtype) {
        memcpy(p->data, src, n * esize);
        return HT_OK;
    }
    if ((uintptr_t)src % esize == 0) {
        ht_convert(p->data, p->dtype, src, t->dtype, n);
        return HT_OK;
    }
    void *aligned = malloc(n * esize + 1); /* a writer that did not align its tensors */
    if (!aligned) return ht_fail(err, HT_ERR_OOM, "%s: out of memory copying '%s'", file, t->name);
    memcpy(aligned, src, n * esize);
    ht_convert(p->data, p->dtype, aligned, t->dtype, n);
    free(aligned);
    return HT_OK;
}

ht_status ht_hf_copy_rows_into(const ht_param_store *store, ht_param *p, const ht_st_tensor *t, const char *file,
                               ht_error *err) {
    if (ht_params_host_memory(store)) return ht_hf_copy_rows(p, t, file, err);
    /* The kernels' memory: the rows into a host buffer of the param's, then uploaded. */
    const size_t bytes = (size_t)ht_param_local_numel(p) * ht_dtype_size(p->dtype);
    ht_param staged = *p;
    if (!(staged.data = calloc(1, bytes ? bytes : 1)))
        return ht_fail(err, HT_ERR_OOM, "%s: cannot allocate %zu bytes to stage '%s'", file, bytes, t->name);
    ht_status s = ht_hf_copy_rows(&staged, t, file, err);
    if (s == HT_OK) ht_params_upload(store, p->data, staged.data, bytes);
    free(staged.data);
    return s;
}

/* ---------------------------------------------------------------- experts, one tensor each */

/* transformers keeps Qwen2-MoE's routed experts as 3-D params (E, 2I, C)
 * "<layer>.mlp.experts.gate_up_proj" and (E, C, I) ".down_proj", but its
 * files, and every checkpoint on the Hub, hold one tensor per expert:
 * "<layer>.mlp.experts.<e>.gate_proj.weight" and ".up_proj.weight" (I, C),
 * ".down_proj.weight" (C, I). Loading takes either; saving writes the
 * per-expert form that transformers writes. */
typedef enum expert_kind { NOT_EXPERTS = 0, GATE_UP, DOWN } expert_kind;

/* Whether p is a 3-D expert param; prefix gets its name up to ".experts." included. */
static expert_kind expert_param(const char *name, int ndim, char *prefix, size_t cap) {
    static const char *const tails[] = {".experts.gate_up_proj", ".experts.down_proj"};
    size_t n = strlen(name);
    for (int k = 0; k < 2 && ndim == 3; k++) {
        size_t t = strlen(tails[k]);
        if (n > t && strcmp(name + n - t, tails[k]) == 0) {
            snprintf(prefix, cap, "%.*s.experts.", (int)(n - t), name);
            return k == 0 ? GATE_UP : DOWN;
        }
    }
    return NOT_EXPERTS;
}

/* Whether a file tensor's name is one expert's matrix of a 3-D param of the store. */
static bool is_expert_tensor(const char *name, const ht_param_store *params) {
    const char *at = strstr(name, ".experts.");
    if (!at) return false;
    const char *e = at + strlen(".experts.");
    char *end;
    (void)strtol(e, &end, 10);
    if (end == e || *end != '.') return false;
    char whole[HT_PARAM_NAME_MAX + 32];
    bool down = strcmp(end, ".down_proj.weight") == 0;
    if (!down && strcmp(end, ".gate_proj.weight") != 0 && strcmp(end, ".up_proj.weight") != 0) return false;
    snprintf(whole, sizeof(whole), "%.*s.experts.%s", (int)(at - name), name, down ? "down_proj" : "gate_up_proj");
    return ht_params_find(params, whole) != NULL;
}

/* p's local experts [row0, row1) from the per-expert tensors; the ones
 * missing are added to the list. */
static ht_status load_experts(const ht_param_store *params, ht_param *p, expert_kind kind, const char *prefix,
                              const hf_files *fs, char *missing, size_t cap, int *n_missing, int *left_out,
                              ht_error *err) {
    const int64_t rows = kind == GATE_UP ? p->shape[1] / 2 : p->shape[1], cols = p->shape[2];
    const int64_t r1 = p->row1 < p->shape[0] ? p->row1 : p->shape[0];
    static const char *const parts[2][2] = {{"gate_proj", "up_proj"}, {"down_proj", NULL}};
    const size_t esize = ht_dtype_size(p->dtype);
    for (int64_t e = p->row0; e < r1; e++)
        for (int part = 0; part < 2 && parts[kind - 1][part]; part++) {
            char name[HT_PARAM_NAME_MAX + 64];
            snprintf(name, sizeof(name), "%s%lld.%s.weight", prefix, (long long)e, parts[kind - 1][part]);
            const ht_safetensors *in = NULL;
            const ht_st_tensor *t = files_find(fs, name, &in);
            if (!t) { /* named with the 3-D param it belongs to */
                char both[2 * HT_PARAM_NAME_MAX + 96];
                snprintf(both, sizeof(both), "%s (expert %lld of %s)", name, (long long)e, p->name);
                (*n_missing)++;
                list_append(missing, cap, both, left_out);
                continue;
            }
            if (t->ndim != 2 || t->shape[0] != rows || t->shape[1] != cols)
                return ht_fail(err, HT_ERR_FORMAT,
                               "%s: tensor '%s' has the wrong shape for %s's expert %lld: expected [%lld, %lld]; "
                               "the weights do not match config.json",
                               ht_safetensors_path(in), name, p->name, (long long)e, (long long)rows, (long long)cols);
            /* One expert's matrix through the row copier: a view of p holding that block alone. */
            ht_param view = *p;
            view.ndim = 2;
            view.shape[0] = rows;
            view.shape[1] = cols;
            ht_param_set_rows(&view, 0, rows);
            view.data = (char *)p->data + (size_t)(((e - p->row0) * p->shape[1] + part * rows) * cols) * esize;
            ht_status s = ht_hf_copy_rows_into(params, &view, t, ht_safetensors_path(in), err);
            if (s != HT_OK) return s;
        }
    return HT_OK;
}

/* Tensors of the files that no param asked for; lm_head.weight of a tied
 * model is expected, and so are empty tensors (transformers' DeepSeek-V3
 * with n_shared_experts 0 saves its shared experts as (0, C) and (C, 0)). */
static void warn_unused(const hf_files *fs, const ht_param_store *params, const char *dir) {
    char list[1024] = "";
    int unused = 0, left_out = 0;
    for (int f = 0; f < fs->count; f++) {
        for (int i = 0; i < ht_safetensors_count(fs->files[f]); i++) {
            const ht_st_tensor *t = ht_safetensors_tensor(fs->files[f], i);
            const char *name = t->name;
            if (ht_params_find(params, name) || strcmp(name, "lm_head.weight") == 0 || is_expert_tensor(name, params) ||
                t->nbytes == 0)
                continue;
            unused++;
            list_append(list, sizeof(list), name, &left_out);
        }
    }
    if (!unused) return;
    if (left_out)
        ht_log_warn_once("%s: %d tensors in the weight files are not model parameters and were ignored: %s and %d more",
                         dir, unused, list, left_out);
    else
        ht_log_warn_once("%s: %d tensors in the weight files are not model parameters and were ignored: %s", dir,
                         unused, list);
}

ht_status ht_hf_load_weights(const char *dir, ht_param_store *params, ht_error *err) {
    if (check_dir_name(dir, err) != HT_OK) return HT_ERR_INVALID;
    hf_files fs = {0};
    ht_status s = open_weights(dir, &fs, err);
    if (s != HT_OK) {
        files_close(&fs);
        return s;
    }
    char missing[1024] = "";
    int n_missing = 0, left_out = 0;
    for (int i = 0; i < params->count && s == HT_OK; i++) {
        ht_param *p = &params->items[i];
        if (!p->data) {
            s = ht_fail(err, HT_ERR_INVALID, "%s: parameter '%s' has no storage (ht_params_allocate first)", dir,
                        p->name);
            break;
        }
        /* LoRA adapters are not Hugging Face weights: fresh ones are
         * initialised, trained ones come from a PEFT adapter directory. */
        if (ht_lora_kind(p->name)) continue;
        const ht_safetensors *in = NULL;
        const ht_st_tensor *t = files_find(&fs, p->name, &in);
        char prefix[HT_PARAM_NAME_MAX];
        expert_kind kind = expert_param(p->name, p->ndim, prefix, sizeof(prefix));
        if (!t && kind != NOT_EXPERTS) {
            s = load_experts(params, p, kind, prefix, &fs, missing, sizeof(missing), &n_missing, &left_out, err);
            continue;
        }
        if (!t) {
            n_missing++;
            list_append(missing, sizeof(missing), p->name, &left_out);
            continue;
        }
        bool same = t->ndim == p->ndim;
        for (int d = 0; same && d < p->ndim; d++) same = t->shape[d] == p->global_shape[d];
        if (!same) {
            char have[256], want[256];
            ht_hf_format_dims(have, sizeof(have), t->ndim, t->shape);
            ht_hf_format_dims(want, sizeof(want), p->ndim, p->global_shape);
            s = ht_fail(err, HT_ERR_FORMAT,
                        "%s: tensor '%s' has shape %s but the model (from its config) expects %s; the weights "
                        "do not match config.json",
                        ht_safetensors_path(in), p->name, have, want);
            break;
        }
        s = ht_hf_copy_rows_into(params, p, t, ht_safetensors_path(in), err);
    }
    if (s == HT_OK && n_missing) {
        char more[64] = "";
        if (left_out) snprintf(more, sizeof(more), " and %d more", left_out);
        s = ht_fail(err, HT_ERR_FORMAT, "%s: %d model parameters are missing from the weight files: %s%s", dir,
                    n_missing, missing, more);
    }
    if (s == HT_OK) warn_unused(&fs, params, dir);
    files_close(&fs);
    return s;
}

static ht_status make_dirs(const char *dir, ht_error *err) {
    char path[HF_PATH_MAX];
    snprintf(path, sizeof(path), "%s", dir);
    for (char *c = path + 1;; c++) {
        if (*c != '/' && *c != '\0') continue;
        char saved = *c;
        *c = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            return ht_fail(err, HT_ERR_IO, "%s: cannot create directory: %s", path, strerror(errno));
        *c = saved;
        if (!saved) break;
    }
    struct stat sb;
    if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return ht_fail(err, HT_ERR_IO, "%s: exists and is not a directory", dir);
    return HT_OK;
}

/* A keep_fp32 param (DeepSeek-V3's routers and correction biases) is written in FP32 whatever the dtype, as
 * transformers' save_pretrained writes its _keep_in_fp32_modules_strict. */
static ht_dtype save_dtype(const ht_param *p, ht_dtype dtype) {
    return p->keep_fp32 ? HT_DTYPE_F32 : ht_dtype_is_float(p->dtype) ? dtype : p->dtype;
}

/* One tensor of the files: a whole param, or one expert's matrix of a 3-D expert param. */
typedef struct hf_tensor {
    char name[HT_PARAM_NAME_MAX + 64];
    int ndim;
    int64_t shape[HT_PARAM_MAX_DIMS];
    const void *data;
    ht_dtype src, dst;
    size_t bytes; /* as saved */
} hf_tensor;

/* The tensors a save writes, in param order, experts one by one. */
static hf_tensor *save_list(const ht_param_store *params, ht_dtype dtype, int *count) {
    int n = 0;
    char prefix[HT_PARAM_NAME_MAX];
    for (int i = 0; i < params->count; i++) {
        const ht_param *p = &params->items[i];
        expert_kind kind = expert_param(p->name, p->ndim, prefix, sizeof(prefix));
        n += kind == GATE_UP ? 2 * (int)p->shape[0] : kind == DOWN ? (int)p->shape[0] : 1;
    }
    hf_tensor *list = calloc((size_t)n + 1, sizeof(hf_tensor));
    if (!list) return NULL;
    n = 0;
    for (int i = 0; i < params->count; i++) {
        const ht_param *p = &params->items[i];
        const ht_dtype dst = save_dtype(p, dtype);
        expert_kind kind = expert_param(p->name, p->ndim, prefix, sizeof(prefix));
        if (kind == NOT_EXPERTS) {
            hf_tensor *t = &list[n++];
            snprintf(t->name, sizeof(t->name), "%s", p->name);
            t->ndim = p->ndim;
            memcpy(t->shape, p->shape, sizeof(t->shape));
            t->data = p->data;
            t->src = p->dtype;
            t->dst = dst;
            t->bytes = (size_t)ht_param_numel(p) * ht_dtype_size(dst);
            continue;
        }
        const int64_t rows = kind == GATE_UP ? p->shape[1] / 2 : p->shape[1], cols = p->shape[2];
        static const char *const parts[2][2] = {{"gate_proj", "up_proj"}, {"down_proj", NULL}};
        for (int64_t e = 0; e < p->shape[0]; e++)
            for (int part = 0; part < 2 && parts[kind - 1][part]; part++) {
                hf_tensor *t = &list[n++];
                snprintf(t->name, sizeof(t->name), "%s%lld.%s.weight", prefix, (long long)e, parts[kind - 1][part]);
                t->ndim = 2;
                t->shape[0] = rows;
                t->shape[1] = cols;
                t->data =
                    (const char *)p->data + (size_t)((e * p->shape[1] + part * rows) * cols) * ht_dtype_size(p->dtype);
                t->src = p->dtype;
                t->dst = dst;
                t->bytes = (size_t)(rows * cols) * ht_dtype_size(dst);
            }
    }
    *count = n;
    return list;
}

/* Writes the tensors whose shard[i] == k into path. */
static ht_status write_shard(const char *path, const ht_param_store *params, const hf_tensor *list, int count,
                             const int *shard, int k, ht_error *err) {
    ht_st_writer w = {0};
    ht_status s = ht_st_writer_add_metadata(&w, "format", "pt", err);
    for (int i = 0; i < count && s == HT_OK; i++) {
        const hf_tensor *t = &list[i];
        if (shard[i] != k) continue;
        s = ht_st_writer_add_from(&w, t->name, t->dst, t->ndim, t->shape, t->data, t->src, params, err);
    }
    if (s == HT_OK) s = ht_st_writer_write(&w, path, err);
    ht_st_writer_free(&w);
    return s;
}

static ht_status write_index(const char *dir, const hf_tensor *list, int count, const int *shard, int nshards,
                             size_t total, ht_error *err) {
    char path[HF_PATH_MAX], file[64];
    join(path, dir, HF_INDEX);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return ht_fail(err, HT_ERR_OOM, "%s: cannot build the index", path);
    fprintf(f, "{\n  \"metadata\": {\n    \"total_size\": %zu\n  },\n  \"weight_map\": {", total);
    for (int i = 0; i < count; i++) {
        snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", shard[i] + 1, nshards);
        fputs(i ? ",\n    " : "\n    ", f);
        ht_json_write_string(f, list[i].name);
        fprintf(f, ": \"%s\"", file);
    }
    fputs("\n  }\n}\n", f);
    if (fclose(f) != 0 || !text) {
        free(text);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot build the index", path);
    }
    ht_status s = ht_hf_write_text(path, text, len, err);
    free(text);
    return s;
}

ht_status ht_hf_save(const char *dir, const ht_model_config *cfg, const ht_param_store *params, ht_dtype dtype,
                     size_t max_shard_bytes, ht_error *err) {
    if (check_dir_name(dir, err) != HT_OK) return HT_ERR_INVALID;
    if (!ht_dtype_is_float(dtype))
        return ht_fail(err, HT_ERR_INVALID, "%s: cannot save weights as %s (not a float dtype)", dir,
                       ht_dtype_name(dtype));
    for (int i = 0; i < params->count; i++) {
        const ht_param *p = &params->items[i];
        if (!p->data || p->row0 != 0 || p->row1 != p->shape[0])
            return ht_fail(err, HT_ERR_INVALID,
                           "%s: parameter '%s' holds rows [%lld, %lld) of %lld; a Hugging Face save needs whole "
                           "tensors (gather the shards first)",
                           dir, p->name, (long long)p->row0, (long long)p->row1, (long long)p->shape[0]);
    }
    ht_status s = make_dirs(dir, err);
    if (s == HT_OK) s = ht_hf_write_config(dir, cfg, dtype, err);
    if (s != HT_OK) return s;
    int count = 0;
    hf_tensor *list = save_list(params, dtype, &count);
    if (!list) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", dir);
    size_t total = 0;
    for (int i = 0; i < count; i++) total += list[i].bytes;

    /* Greedy shards in tensor order, a new one when the next tensor would overflow (as transformers does). */
    int *shard = calloc((size_t)count + 1, sizeof(int));
    if (!shard) {
        free(list);
        return ht_fail(err, HT_ERR_OOM, "%s: out of memory", dir);
    }
    int nshards = 1;
    if (max_shard_bytes && total > max_shard_bytes) {
        size_t in_shard = 0;
        for (int i = 0; i < count; i++) {
            size_t b = list[i].bytes;
            if (in_shard > 0 && in_shard + b > max_shard_bytes) {
                nshards++;
                in_shard = 0;
            }
            shard[i] = nshards - 1;
            in_shard += b;
        }
    }
    char path[HF_PATH_MAX], stale[HF_PATH_MAX];
    if (nshards == 1) {
        join(path, dir, HF_SINGLE);
        s = write_shard(path, params, list, count, shard, 0, err);
        join(stale, dir, HF_INDEX);
    } else {
        for (int k = 0; k < nshards && s == HT_OK; k++) {
            char file[64];
            snprintf(file, sizeof(file), "model-%05d-of-%05d.safetensors", k + 1, nshards);
            join(path, dir, file);
            s = write_shard(path, params, list, count, shard, k, err);
        }
        if (s == HT_OK) s = write_index(dir, list, count, shard, nshards, total, err);
        join(stale, dir, HF_SINGLE);
    }
    /* A leftover of the other layout would shadow (or confuse) the new weights. */
    if (s == HT_OK && remove(stale) != 0 && errno != ENOENT)
        s = ht_fail(err, HT_ERR_IO, "%s: cannot remove the stale file: %s", stale, strerror(errno));
    free(shard);
    free(list);
    return s;
}
