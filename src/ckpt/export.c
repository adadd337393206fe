/* A training checkpoint out to Hugging Face (the LoRA adapters merged, or
 * the PEFT adapter folder alone), into a model to run (generation, from a
 * checkpoint or a Hugging Face folder), and `hypertrain inspect`
 * (docs/DESIGN.md, Checkpoints). */
#include "ckpt/checkpoint_internal.h"
#include "ckpt/hf_internal.h"

#include <inttypes.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* model.lora as the run that saved ck had it (its effective config), for the
 * merge and the adapter's adapter_config.json; base: its model.from_pretrained. */
static ht_status saved_lora(const ht_checkpoint *ck, ht_lora_config *lc, char *base, size_t n, ht_error *err) {
    static const char *const keys[] = {"model.lora.rank", "model.lora.alpha", "model.lora.dropout",
                                       "model.lora.use_rslora", "model.from_pretrained"};
    ht_config *cfg = malloc(sizeof(ht_config));
    if (!cfg) return ht_fail(err, HT_ERR_OOM, "export: out of memory");
    ht_config_defaults(cfg);
    ht_status s = HT_OK;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]) && s == HT_OK; i++) {
        const char *v = ht_ckpt_config_value(ck, keys[i]);
        char set[HT_CONFIG_STR_MAX + 64];
        if (!v)
            s = ht_fail(err, HT_ERR_FORMAT,
                        "%s holds LoRA adapters but its metadata.json has no %s to merge or describe them with",
                        ck->dir, keys[i]);
        else if (snprintf(set, sizeof(set), "%s=%s", keys[i], v) >= (int)sizeof(set))
            s = ht_fail(err, HT_ERR_FORMAT, "%s: %s is too long", ck->dir, keys[i]);
        else
            s = ht_config_set(cfg, set, err);
    }
    if (s == HT_OK) {
        memset(lc, 0, sizeof(*lc));
        lc->rank = cfg->model.lora.rank;
        lc->alpha = cfg->model.lora.alpha;
        lc->dropout = cfg->model.lora.dropout;
        lc->use_rslora = cfg->model.lora.use_rslora;
        snprintf(base, n, "%s", cfg->model.from_pretrained);
    }
    free(cfg);
    return s;
}

static bool has_adapter(const ht_checkpoint *ck, const char *fqn) {
    size_t n = strlen(fqn);
    if (n < 7 || strcmp(fqn + n - 7, ".weight") != 0) return false;
    char name[HT_CKPT_KEY_MAX];
    snprintf(name, sizeof(name), "model.%.*s.lora_A.weight", (int)(n - 7), fqn);
    return ht_ckpt_find_key(ck, name) != NULL;
}

/* The model.* keys of ck as a whole-tensor store: `dtype` (HT_DTYPE_COUNT: the
 * checkpoint's), the adapters and the weights they adapt in FP32 for the
 * merge (or, adapters_only, the adapters alone). For a float32 export every
 * tensor comes from the FP32 main params where the checkpoint has them. */
static ht_status read_store(const ht_checkpoint *ck, const ht_model_config *cfg, ht_dtype *dtype, bool adapters_only,
                            ht_param_store *store, int *adapters, ht_error *err) {
    ht_status s = HT_OK;
    *adapters = 0;
    for (int k = 0; s == HT_OK && k < ck->nkeys; k++) {
        const ck_key *key = &ck->keys[k];
        if (key->kind != KIND_MODEL) continue;
        if (*dtype == HT_DTYPE_COUNT) *dtype = key->dtype;
        const char *fqn = key->name + strlen("model.");
        bool adapter = ht_lora_kind(fqn) != 0;
        *adapters += adapter;
        if (adapters_only && !adapter) continue;
        ht_dtype dt = adapter || has_adapter(ck, fqn) ? HT_DTYPE_F32 : *dtype;
        if (adapters_only) dt = *dtype;
        const bool keep = cfg && ht_model_config_keeps_fp32(cfg, fqn); /* FP32 whatever the export's dtype */
        ht_param *p = ht_params_add(store, fqn, key->ndim, key->shape, keep ? HT_DTYPE_F32 : dt);
        if (!p) {
            s = ht_fail(err, HT_ERR_OOM, "export: cannot add %s", key->name);
        } else {
            p->trainable = false;
            p->keep_fp32 = keep;
        }
    }
    if (s == HT_OK) s = ht_params_allocate(store, err);
    for (int i = 0; s == HT_OK && i < store->count; i++) {
        ht_param *p = &store->items[i];
        char name[HT_CKPT_KEY_MAX];
        ht_ckpt_key_name(name, KIND_MAIN, p->name);
        /* float32 from a bf16/fp16 checkpoint: the FP32 main params are the precise weights (in another
         * dtype the model's values, widened to FP32 for a merge, as the run's final save merges them). */
        if (*dtype != HT_DTYPE_F32 || !ht_ckpt_find_key(ck, name)) ht_ckpt_key_name(name, KIND_MODEL, p->name);
        s = ht_ckpt_read_rows(ck, name, 0, p->shape[0], p->data, p->dtype, err);
    }
    if (s == HT_OK && store->count == 0) s = ht_fail(err, HT_ERR_FORMAT, "%s: no model.* keys to export", ck->dir);
    return s;
}

/* The model of an open checkpoint as whole tensors in `store` (*dtype:
 * theirs; HT_DTYPE_COUNT, the checkpoint's), its architecture in cfg, and
 * with LoRA adapters their merge in `merged` (*out: the one to read). */
static ht_status read_model(const ht_checkpoint *ck, ht_model_config *cfg, ht_dtype *dtype, ht_param_store *store,
                            ht_param_store *merged, const ht_param_store **out, int *adapters, ht_error *err) {
    ht_status s = HT_OK;
    *adapters = 0;
    if (ht_ckpt_find_file(ck, "config.json") < 0)
        s = ht_fail(err, HT_ERR_FORMAT, "%s: no config.json: saved without the model architecture", ck->dir);
    if (s == HT_OK) s = ht_hf_read_config(ck->dir, cfg, err);
    if (s == HT_OK) s = read_store(ck, cfg, dtype, false, store, adapters, err);
    *out = store;
    char base[HT_CONFIG_STR_MAX];
    if (s == HT_OK && *adapters) { /* model.lora: W + scale B A, so that transformers loads it as it is */
        s = saved_lora(ck, &cfg->lora, base, sizeof(base), err);
        if (s == HT_OK) s = ht_lora_merge(store, ht_lora_scale(&cfg->lora), merged, err);
        *out = merged;
    }
    return s;
}

ht_status ht_ckpt_export(const char *ckpt_dir, const char *out_dir, ht_dtype dtype, size_t max_shard_bytes,
                         ht_error *err) {
    ht_checkpoint *ck;
    ht_status s = ht_ckpt_open(ckpt_dir, &ck, err);
    if (s != HT_OK) return s;
    ht_model_config cfg;
    ht_param_store store = {0}, merged = {0};
    const ht_param_store *out;
    int adapters;
    s = read_model(ck, &cfg, &dtype, &store, &merged, &out, &adapters, err);
    if (s == HT_OK) s = ht_hf_save(out_dir, &cfg, out, dtype, max_shard_bytes, err);
    if (s == HT_OK)
        ht_log_info("exported %s (step %lld) to %s in %s%s", ck->dir, (long long)ck->step, out_dir,
                    ht_dtype_name(dtype), adapters ? ", the LoRA adapters merged into the weights" : "");
    ht_params_free(&merged);
    ht_params_free(&store);
    ht_ckpt_close(ck);
    return s;
}

/* A model of cfg (LoRA off: merged) in `dtype`, its params allocated and not drawn. */
static ht_status empty_model(ht_model_config *cfg, ht_dtype dtype, ht_model **out, ht_error *err) {
    cfg->lora.rank = 0;
    const ht_model_placement whole = {.shard_world = 1, .tp_size = 1, .pp_size = 1};
    ht_status s = ht_model_declare(cfg, dtype, &whole, out, err);
    if (s == HT_OK) s = ht_model_allocate(*out, &whole, 0, true, err);
    if (s != HT_OK) {
        ht_model_free(*out);
        *out = NULL;
    }
    return s;
}

ht_status ht_ckpt_model_from_params(const ht_model_config *cfg, const ht_param_store *from, ht_dtype dtype,
                                    ht_model **out, ht_error *err) {
    ht_model_config arch = *cfg;
    ht_status s = empty_model(&arch, dtype, out, err);
    void *host = NULL;
    for (int i = 0; s == HT_OK && i < (*out)->params.count; i++) {
        ht_param *p = &(*out)->params.items[i];
        const ht_param *q = ht_params_find(from, p->name);
        if (!q) {
            s = ht_fail(err, HT_ERR_FORMAT, "the weights hold no tensor %s, which the model has", p->name);
            break;
        }
        ht_st_tensor t = {.name = q->name, .dtype = q->dtype, .ndim = q->ndim, .data = q->data};
        memcpy(t.shape, q->shape, sizeof(int64_t) * (size_t)q->ndim);
        t.nbytes = (size_t)ht_param_numel(q) * ht_dtype_size(q->dtype);
        if (!ht_params_host_memory(from)) { /* staged through the host */
            free(host);
            if (!(host = malloc(t.nbytes ? t.nbytes : 1))) {
                s = ht_fail(err, HT_ERR_OOM, "cannot stage %s", q->name);
                break;
            }
            ht_params_download(from, host, q->data, t.nbytes);
            t.data = host;
        }
        s = ht_hf_copy_rows_into(&(*out)->params, p, &t, "the weights", err);
    }
    free(host);
    if (s != HT_OK) {
        ht_model_free(*out);
        *out = NULL;
    }
    return s;
}

static bool file_in(const char *dir, const char *name) {
    char path[HT_CKPT_PATH_MAX];
    struct stat sb;
    ht_ckpt_join(path, sizeof(path), dir, name);
    return stat(path, &sb) == 0;
}

/* eos_token_id (a number or a list) of dir/name into info; whether it had one. */
static bool read_eos(const char *dir, const char *name, ht_ckpt_model_info *info) {
    char path[HT_CKPT_PATH_MAX];
    ht_ckpt_join(path, sizeof(path), dir, name);
    ht_json *root;
    ht_error ignored;
    if (!file_in(dir, name) || ht_json_read_file(path, name, &root, &ignored) != HT_OK) return false;
    const ht_json *eos = ht_json_get(root, "eos_token_id");
    const ht_json *one[1] = {eos};
    const size_t n = eos && eos->type == HT_JSON_ARRAY ? eos->count : eos && eos->type == HT_JSON_NUMBER ? 1 : 0;
    const int cap = (int)(sizeof(info->eos) / sizeof(info->eos[0]));
    for (size_t i = 0; i < n && info->eos_count < cap; i++) {
        const ht_json *v = eos->type == HT_JSON_ARRAY ? &eos->items[i] : one[0];
        if (v->type == HT_JSON_NUMBER) info->eos[info->eos_count++] = (int32_t)v->number;
    }
    ht_json_free(root);
    return n > 0;
}

/* The saving run's data.tokenizer and whether it read bytes (its effective config). */
static void saved_text(const ht_checkpoint *ck, ht_ckpt_model_info *info) {
    const char *tok = ht_ckpt_config_value(ck, "data.tokenizer"), *type = ht_ckpt_config_value(ck, "data.dataset_type");
    if (tok && strcmp(tok, "null") != 0) snprintf(info->tokenizer, sizeof(info->tokenizer), "%s", tok);
    info->bytes = type && strcmp(type, "text_bytes") == 0;
}

ht_status ht_ckpt_load_model(const char *path, ht_dtype dtype, ht_model **out, ht_ckpt_model_info *info,
                             ht_error *err) {
    *out = NULL;
    memset(info, 0, sizeof(*info));
    char *dir = info->dir;
    const size_t n = sizeof(info->dir);
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return ht_fail(err, HT_ERR_IO,
                       "%s: no such folder (a training checkpoint, a run's output_dir or a Hugging Face model folder)",
                       path);
    snprintf(dir, n, "%s", path);
    ht_status s = HT_OK;
    if (!file_in(path, "metadata.json") && file_in(path, "latest")) { /* a run's output_dir: its newest */
        s = ht_ckpt_resolve("latest", path, dir, n, err);
        if (s != HT_OK) return s;
    }
    ht_model_config cfg;
    if (!file_in(dir, "metadata.json")) {
        if (!file_in(dir, "config.json"))
            return ht_fail(err, HT_ERR_FORMAT,
                           "%s is neither a training checkpoint (no metadata.json) nor a Hugging Face model folder "
                           "(no config.json)",
                           dir);
        s = ht_hf_read_config(dir, &cfg, err);
        if (s == HT_OK) s = empty_model(&cfg, dtype, out, err);
        if (s == HT_OK) s = ht_hf_load_weights(dir, &(*out)->params, err);
        if (file_in(dir, "tokenizer.json"))
            ht_ckpt_join(info->tokenizer, sizeof(info->tokenizer), dir, "tokenizer.json");
    } else {
        ht_checkpoint *ck;
        if ((s = ht_ckpt_open(dir, &ck, err)) != HT_OK) return s;
        ht_param_store store = {0}, merged = {0};
        const ht_param_store *weights;
        int adapters;
        ht_dtype read = dtype; /* float32: the FP32 main params where the checkpoint has them */
        s = read_model(ck, &cfg, &read, &store, &merged, &weights, &adapters, err);
        if (s == HT_OK) s = ht_ckpt_model_from_params(&cfg, weights, dtype, out, err);
        saved_text(ck, info);
        ht_params_free(&merged);
        ht_params_free(&store);
        ht_ckpt_close(ck);
    }
    if (!read_eos(dir, "generation_config.json", info)) read_eos(dir, "config.json", info);
    if (s != HT_OK) {
        ht_model_free(*out);
        *out = NULL;
    }
    return s;
}

ht_status ht_ckpt_export_adapter(const char *ckpt_dir, const char *out_dir, ht_dtype dtype, ht_error *err) {
    ht_checkpoint *ck;
    ht_status s = ht_ckpt_open(ckpt_dir, &ck, err);
    if (s != HT_OK) return s;
    if (dtype == HT_DTYPE_COUNT) dtype = HT_DTYPE_F32;
    ht_param_store store = {0};
    int adapters = 0;
    ht_lora_config lc;
    char base[HT_CONFIG_STR_MAX];
    s = read_store(ck, NULL, &dtype, true, &store, &adapters, err);
    if (s == HT_OK && adapters == 0)
        s = ht_fail(err, HT_ERR_FORMAT, "%s holds no LoRA adapters (a run with model.lora.rank > 0 saves them)",
                    ck->dir);
    if (s == HT_OK) s = saved_lora(ck, &lc, base, sizeof(base), err);
    /* The base weights by name alone (no storage): target_modules is written
     * from which modules of each name have adapters. */
    for (int k = 0; s == HT_OK && k < ck->nkeys; k++) {
        const ck_key *key = &ck->keys[k];
        const char *fqn = key->name + strlen("model.");
        if (key->kind == KIND_MODEL && !ht_lora_kind(fqn) &&
            !ht_params_add(&store, fqn, key->ndim, key->shape, key->dtype))
            s = ht_fail(err, HT_ERR_OOM, "export: cannot add %s", key->name);
    }
    for (int i = 0; s == HT_OK && i < store.count; i++) {
        const ht_param *p = &store.items[i];
        if (ht_lora_kind(p->name) == 'A' && p->shape[0] != lc.rank)
            s = ht_fail(err, HT_ERR_FORMAT, "%s: %s has %lld rows but model.lora.rank was %d", ck->dir, p->name,
                        (long long)p->shape[0], lc.rank);
    }
    if (s == HT_OK) s = ht_peft_save_adapter(out_dir, &store, &lc, base, dtype, err);
    if (s == HT_OK)
        ht_log_info("exported the %d LoRA adapter tensors of %s (step %lld) to %s in %s (PEFT's layout)", adapters,
                    ck->dir, (long long)ck->step, out_dir, ht_dtype_name(dtype));
    ht_params_free(&store);
    ht_ckpt_close(ck);
    return s;
}

ht_status ht_ckpt_inspect(const char *dir, FILE *out, ht_error *err) {
    ht_checkpoint *ck = calloc(1, sizeof(ht_checkpoint));
    if (!ck) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    ht_status s = ht_ckpt_load_metadata(dir, ck, err);
    if (s != HT_OK) {
        ht_ckpt_close(ck);
        return s;
    }
    const ht_ckpt_trainer_state *st = &ck->state;
    fprintf(out, "checkpoint %s\n", ck->dir);
    fprintf(out, "  format version %d, step %lld, saved on %d rank(s), hash %s\n", ck->version, (long long)ck->step,
            ck->world, HT_CKPT_HASH);
    fprintf(out, "  trainer state: step %lld, schedule step %lld, ", (long long)st->step, (long long)st->schedule_step);
    if (!st->no_rng)
        fprintf(out,
                "seed %lld, train loader epoch %" PRIu64 " window %" PRIu64 ", validation loader epoch %" PRIu64
                " window %" PRIu64,
                (long long)st->seed, st->train_pos.epoch, st->train_pos.index, st->valid_pos.epoch,
                st->valid_pos.index);
    else
        fputs("no seed or data positions (saved with training.no_save_rng)", out);
    if (st->loss_scaling) fprintf(out, ", loss scale %g", st->scaler.scale);
    fputc('\n', out);
    uint64_t numel[KIND_COUNT] = {0}, bytes[KIND_COUNT] = {0};
    int count[KIND_COUNT] = {0};
    ht_dtype dt[KIND_COUNT];
    for (int k = 0; k < ck->nkeys; k++) {
        const ck_key *key = &ck->keys[k];
        uint64_t n = 1;
        for (int d = 0; d < key->ndim; d++) n *= (uint64_t)key->shape[d];
        count[key->kind]++;
        numel[key->kind] += n;
        bytes[key->kind] += n * ht_dtype_size(key->dtype);
        dt[key->kind] = key->dtype;
    }
    fprintf(out, "  keys by kind:\n");
    static const char *const labels[KIND_COUNT] = {"model.*",
                                                   MAIN_PREFIX "*",
                                                   OPT_PREFIX "*.exp_avg",
                                                   OPT_PREFIX "*.exp_avg_sq",
                                                   OPT_PREFIX "*.momentum_buffer",
                                                   OPT_PREFIX "*.step"};
    for (int k = 0; k < KIND_COUNT; k++)
        if (count[k])
            fprintf(out, "    %-58s %5d keys %12" PRIu64 " values %10.2f MiB %s\n", labels[k], count[k], numel[k],
                    (double)bytes[k] / (1 << 20), ht_dtype_name(dt[k]));
        else
            fprintf(out, "    %-58s     none\n", labels[k]);
    fprintf(out, "  files:\n");
    int bad = 0;
    ht_error first = {0};
    for (int i = 0; i < ck->nfiles; i++) {
        ht_error e = {0};
        ht_status fs = ht_ckpt_verify_file(ck, i, &e);
        fprintf(out, "    %-26s %12" PRIu64 " bytes  xxh64 %016" PRIx64 "  %s\n", ck->files[i].name, ck->files[i].size,
                ck->files[i].hash, fs == HT_OK ? "OK" : "MISMATCH");
        if (fs != HT_OK && bad++ == 0) first = e;
    }
    if (bad == 0) s = ht_ckpt_bind_chunks(ck, &first);
    if (bad == 0 && s == HT_OK)
        fprintf(out, "  hashes: all %d files OK\n", ck->nfiles);
    else if (bad)
        s = ht_fail(err, first.status, "%d of %d files do not match metadata.json; first: %s", bad, ck->nfiles,
                    first.msg);
    else
        *err = first;
    ht_ckpt_close(ck);
    return s;
}
