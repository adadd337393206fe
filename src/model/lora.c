/* LoRA's model-level rules, shared by the decoder, the trainer and the
 * Hugging Face export: the scale, adapter names, PEFT's target_modules
 * matching, and folding adapters into the weights they adapt. */
#include "hypertrain/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"

double ht_lora_scale(const ht_lora_config *c) {
    if (c->rank <= 0) return 0.0;
    return c->use_rslora ? c->alpha / sqrt((double)c->rank) : c->alpha / (double)c->rank;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

char ht_lora_kind(const char *param_name) {
    if (ends_with(param_name, ".lora_A.weight")) return 'A';
    if (ends_with(param_name, ".lora_B.weight")) return 'B';
    return 0;
}

/* The projections a decoder layer has, by their Hugging Face module names. */
static const char *const PROJECTIONS[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

bool ht_lora_target_matches(const char *target, const char *path) {
    if (strcmp(target, "all-linear") == 0) { /* PEFT's shorthand: every linear layer but the output one */
        const char *last = strrchr(path, '.');
        last = last ? last + 1 : path;
        for (size_t i = 0; i < sizeof(PROJECTIONS) / sizeof(PROJECTIONS[0]); i++)
            if (strcmp(last, PROJECTIONS[i]) == 0) return true;
        return false;
    }
    /* PEFT's list rule: the whole path, or a dotted suffix of it. */
    for (const char *s = path; s; s = strchr(s, '.') ? strchr(s, '.') + 1 : NULL)
        if (ht_path_match(target, s)) return true;
    return false;
}

ht_status ht_lora_freeze_base(ht_param_store *params, int *frozen, ht_error *err) {
    const char **names = malloc(((size_t)params->count + 1) * sizeof(char *));
    if (!names) return ht_fail(err, HT_ERR_OOM, "cannot list the parameters to freeze");
    int n = 0, adapters = 0;
    for (int i = 0; i < params->count; i++) {
        const ht_param *p = &params->items[i];
        if (ht_lora_kind(p->name))
            adapters++;
        else if (p->trainable)
            names[n++] = p->name;
    }
    ht_status s = adapters ? ht_params_freeze(params, names, n, frozen, err)
                           : ht_fail(err, HT_ERR_CONFIG, "model.lora: the model has no adapters to train");
    free(names);
    return s;
}

/* The base weight an adapter belongs to: "<module>.lora_A.weight" -> "<module>.weight". */
static void base_name(const char *adapter, char *out) {
    size_t n = strlen(adapter) - strlen(".lora_A.weight");
    snprintf(out, HT_PARAM_NAME_MAX, "%.*s.weight", (int)n, adapter);
}

ht_status ht_lora_merge(const ht_param_store *in, double scale, ht_param_store *out, ht_error *err) {
    memset(out, 0, sizeof(*out));
    /* First the layout: every param but the adapters, and the bytes of the merged copies. */
    size_t bytes = 0;
    for (int i = 0; i < in->count; i++) {
        const ht_param *p = &in->items[i];
        if (!p->data || p->row0 != 0 || p->row1 != p->shape[0])
            return ht_fail(err, HT_ERR_INVALID, "LoRA merge: %s holds rows [%lld, %lld) of %lld, not the whole tensor",
                           p->name, (long long)p->row0, (long long)p->row1, (long long)p->shape[0]);
        if (ht_lora_kind(p->name) != 'A') continue;
        char name[HT_PARAM_NAME_MAX];
        base_name(p->name, name);
        const ht_param *w = ht_params_find(in, name);
        if (!w || w->ndim != 2)
            return ht_fail(err, HT_ERR_INVALID, "LoRA merge: %s has no weight matrix %s to merge into", p->name, name);
        bytes += ht_align64((size_t)ht_param_numel(w) * sizeof(float));
    }
    /* The merged copies in the memory of the weights they come from (the kernels', or the host's). */
    const ht_kernel_ops *K = in->memory ? in->memory : ht_kernels_cpu();
    out->memory = in->memory;
    char *block = bytes ? K->alloc(bytes) : NULL;
    if (bytes && !block) return ht_fail(err, HT_ERR_OOM, "LoRA merge: cannot allocate %zu bytes", bytes);
    out->data_block = block;
    out->data_bytes = bytes;
    size_t off = 0;
    ht_status s = HT_OK;
    for (int i = 0; i < in->count && s == HT_OK; i++) {
        const ht_param *p = &in->items[i];
        if (ht_lora_kind(p->name)) continue;
        ht_param *q = ht_params_add(out, p->name, p->ndim, p->shape, p->dtype);
        if (!q) {
            s = ht_fail(err, HT_ERR_OOM, "LoRA merge: cannot add %s", p->name);
            break;
        }
        q->trainable = false;
        q->keep_fp32 = p->keep_fp32;
        q->data = p->data;
        char a_name[HT_PARAM_NAME_MAX + 16], b_name[HT_PARAM_NAME_MAX + 16];
        size_t stem = strlen(p->name) - (ends_with(p->name, ".weight") ? strlen(".weight") : 0);
        snprintf(a_name, sizeof(a_name), "%.*s.lora_A.weight", (int)stem, p->name);
        snprintf(b_name, sizeof(b_name), "%.*s.lora_B.weight", (int)stem, p->name);
        const ht_param *a = ht_params_find(in, a_name), *b = ht_params_find(in, b_name);
        if (!a || !ends_with(p->name, ".weight")) continue;
        int64_t rows = p->shape[0], cols = p->shape[1], r = a->shape[0];
        if (!b || a->ndim != 2 || b->ndim != 2 || a->shape[1] != cols || b->shape[0] != rows || b->shape[1] != r) {
            s = ht_fail(err, HT_ERR_INVALID,
                        "LoRA merge: %s [%lld, %lld] needs %s [r, %lld] and %s [%lld, r]: the adapter's shapes do "
                        "not fit",
                        p->name, (long long)rows, (long long)cols, a_name, (long long)cols, b_name, (long long)rows);
            break;
        }
        /* W' = W + scale · B A in FP32 (docs/NUMERICS.md's FP32 path), rounded to the output dtype when written. */
        float *merged = (float *)(block + off), *fa = K->alloc((size_t)(r * cols) * sizeof(float));
        float *fb = K->alloc((size_t)(rows * r) * sizeof(float));
        off += ht_align64((size_t)(rows * cols) * sizeof(float));
        if (!fa || !fb) {
            K->free(fa);
            K->free(fb);
            s = ht_fail(err, HT_ERR_OOM, "LoRA merge: out of memory merging %s", p->name);
            break;
        }
        K->convert(merged, HT_DTYPE_F32, p->data, p->dtype, (size_t)(rows * cols));
        K->convert(fa, HT_DTYPE_F32, a->data, a->dtype, (size_t)(r * cols));
        K->convert(fb, HT_DTYPE_F32, b->data, b->dtype, (size_t)(rows * r));
        K->gemm(false, false, rows, cols, r, (float)scale, fb, r, fa, cols, HT_DTYPE_F32, 1.0f, merged, cols);
        s = K->synchronize(err);
        K->free(fa);
        K->free(fb);
        q->data = merged;
        q->dtype = HT_DTYPE_F32;
    }
    if (s != HT_OK) ht_params_free(out);
    return s;
}

static int compare_names(const void *a, const void *b) { return strcmp(a, b); }

int ht_lora_target_names(const ht_param_store *params, char (**out)[HT_PARAM_NAME_MAX]) {
    char(*names)[HT_PARAM_NAME_MAX] = malloc(((size_t)params->count + 1) * sizeof(*names));
    *out = names;
    if (!names) return -1;
    int n = 0;
    for (int i = 0; i < params->count; i++) {
        const char *name = params->items[i].name;
        if (ht_lora_kind(name) != 'A') continue;
        char module[HT_PARAM_NAME_MAX];
        snprintf(module, sizeof(module), "%.*s", (int)(strlen(name) - strlen(".lora_A.weight")), name);
        const char *dot = strrchr(module, '.');
        const char *bare = dot ? dot + 1 : module;
        /* The bare name when every weight of a module so named has an adapter. */
        bool every = true;
        char suffix[HT_PARAM_NAME_MAX + 16], adapter[HT_PARAM_NAME_MAX + 16];
        snprintf(suffix, sizeof(suffix), ".%s.weight", bare);
        for (int j = 0; j < params->count && every; j++) {
            const char *w = params->items[j].name;
            if (!ends_with(w, suffix) && strcmp(w, suffix + 1) != 0) continue; /* another module's weight */
            snprintf(adapter, sizeof(adapter), "%.*s.lora_A.weight", (int)(strlen(w) - strlen(".weight")), w);
            every = ht_params_find(params, adapter) != NULL;
        }
        const char *entry = every ? bare : module;
        bool seen = false;
        for (int k = 0; k < n && !seen; k++) seen = strcmp(names[k], entry) == 0;
        if (!seen) snprintf(names[n++], HT_PARAM_NAME_MAX, "%s", entry);
    }
    qsort(names, (size_t)n, sizeof(*names), compare_names);
    return n;
}
