/* The data registry (name -> opener) and what every dataset shares after its
 * opener has loaded the tokens: the size checks, the train/validation split,
 * the vocabulary and the bookkeeping of which file each token came from. */
#include "hypertrain/data.h"

#include <stdio.h>
#include <sys/stat.h>
#include <stdlib.h>
#include <string.h>

static void register_builtins(void);
static ht_registry datasets = {.what = "dataset", .register_builtins = register_builtins};

static void register_builtins(void) {
    ht_registry_add(&datasets, "text_bytes", (ht_registry_fn)ht_dataset_open_text_bytes, NULL);
    ht_registry_add(&datasets, "token_bin", (ht_registry_fn)ht_dataset_open_token_bin, NULL);
}

ht_status ht_dataset_register(const char *name, ht_dataset_opener opener, ht_error *err) {
    return ht_registry_add(&datasets, name, (ht_registry_fn)opener, err);
}

const char *ht_dataset_registered_names(void) { return ht_registry_names(&datasets); }

ht_status ht_dataset_add_source(ht_dataset *ds, const char *path, size_t count, ht_error *err) {
    ht_data_source *grown = realloc(ds->sources, (size_t)(ds->n_sources + 1) * sizeof(*grown));
    if (!grown) return ht_fail(err, HT_ERR_OOM, "%s: cannot record the data source", path);
    ds->sources = grown;
    ht_data_source *s = &ds->sources[ds->n_sources];
    size_t start = ds->n_sources ? s[-1].start + s[-1].count : 0;
    snprintf(s->path, sizeof(s->path), "%s", path);
    s->start = start;
    s->count = count;
    s->vocab_size = 0;
    ds->n_sources++;
    return HT_OK;
}

void ht_dataset_free(ht_dataset *ds) {
    if (!ds) return;
    free(ds->tokens);
    free(ds->sources);
    free(ds);
}

/* The validation tail: valid_fraction of the stream, but never less than one
 * window, so that evaluation always has something to measure. */
static ht_status split_dataset(const ht_data_config *cfg, ht_dataset *ds, ht_error *err) {
    size_t window = (size_t)cfg->seq_len + 1;
    size_t valid = 0;
    if (cfg->valid_fraction > 0) {
        valid = (size_t)(cfg->valid_fraction * (double)ds->n_tokens);
        if (valid < window) valid = window;
    }
    size_t needed = window + valid;
    if (ds->n_tokens < needed)
        return ht_fail(err, HT_ERR_CONFIG,
                       "data.path %s: the %s corpus has %zu tokens, but needs at least %zu "
                       "(%zu for one train sequence of seq_len %d + 1, %zu for validation)",
                       cfg->path, cfg->dataset_type, ds->n_tokens, needed, window, cfg->seq_len, valid);
    ds->split_start[HT_SPLIT_TRAIN] = 0;
    ds->split_count[HT_SPLIT_TRAIN] = ds->n_tokens - valid;
    ds->split_start[HT_SPLIT_VALID] = ds->n_tokens - valid;
    ds->split_count[HT_SPLIT_VALID] = valid;
    return HT_OK;
}

ht_status ht_dataset_open(const ht_data_config *cfg, ht_dataset **out, ht_error *err) {
    *out = NULL;
    ht_dataset_opener opener = (ht_dataset_opener)ht_registry_find(&datasets, cfg->dataset_type);
    if (!opener)
        return ht_fail(err, HT_ERR_CONFIG, "data.dataset_type '%s' is not registered; registered datasets: %s",
                       cfg->dataset_type, ht_dataset_registered_names());
    if (cfg->seq_len < 1) return ht_fail(err, HT_ERR_CONFIG, "data.seq_len must be at least 1, got %d", cfg->seq_len);
    if (!(cfg->valid_fraction >= 0 && cfg->valid_fraction < 1))
        return ht_fail(err, HT_ERR_CONFIG, "data.valid_fraction must be in [0, 1), got %g", cfg->valid_fraction);

    ht_dataset *ds = calloc(1, sizeof(*ds));
    if (!ds) return ht_fail(err, HT_ERR_OOM, "cannot allocate the dataset");
    snprintf(ds->type, sizeof(ds->type), "%s", cfg->dataset_type);
    ds->seq_len = cfg->seq_len;
    ht_status st = opener(cfg, ds, err);
    if (st == HT_OK) st = split_dataset(cfg, ds, err);
    if (st != HT_OK) {
        ht_dataset_free(ds);
        return st;
    }
    if (ds->vocab_size == 0) {
        uint32_t max = 0;
        for (size_t i = 0; i < ds->n_tokens; i++)
            if (ds->tokens[i] > max) max = ds->tokens[i];
        ds->vocab_size = max >= INT32_MAX ? INT32_MAX : (int)max + 1; /* check_vocab refuses ids that large */
    }
    ht_log_info("data: %s %s: %zu tokens from %d file%s (train %zu, validation %zu), vocab %d", ds->type, cfg->path,
                ds->n_tokens, ds->n_sources, ds->n_sources == 1 ? "" : "s", ds->split_count[HT_SPLIT_TRAIN],
                ds->split_count[HT_SPLIT_VALID], ds->vocab_size);
    *out = ds;
    return HT_OK;
}

ht_status ht_dataset_check_vocab(const ht_dataset *ds, int vocab_size, const char *vocab_from, ht_error *err) {
    if (!vocab_from) vocab_from = "the model's vocab_size";
    for (int k = 0; k < ds->n_sources; k++)
        if (ds->sources[k].vocab_size > vocab_size)
            return ht_fail(err, HT_ERR_CONFIG,
                           "%s: tokenized with a vocabulary of %d tokens, but %s is %d "
                           "(the data was made with another model's tokenizer?)",
                           ds->sources[k].path, ds->sources[k].vocab_size, vocab_from, vocab_size);
    for (size_t i = 0; i < ds->n_tokens; i++) {
        if ((int64_t)ds->tokens[i] < vocab_size) continue;
        const ht_data_source *s = NULL;
        for (int k = 0; k < ds->n_sources; k++)
            if (i >= ds->sources[k].start && i < ds->sources[k].start + ds->sources[k].count) s = &ds->sources[k];
        return ht_fail(err, HT_ERR_CONFIG,
                       "%s: token at position %zu has id %u, but %s is %d "
                       "(ids must be below it; position %zu of the whole %s stream)",
                       s ? s->path : ds->type, s ? i - s->start : i, ds->tokens[i], vocab_from, vocab_size, i,
                       ds->type);
    }
    return HT_OK;
}

ht_status ht_tokenizer_vocab_size(const char *path, int *vocab_size, char *file, size_t n, ht_error *err) {
    struct stat sb;
    bool dir = stat(path, &sb) == 0 && S_ISDIR(sb.st_mode);
    if (snprintf(file, n, "%s%s", path, dir ? "/tokenizer.json" : "") >= (int)n)
        return ht_fail(err, HT_ERR_CONFIG, "%s: the path is too long", path);
    ht_json *root;
    ht_status s = ht_json_read_file(file, "a tokenizer.json", &root, err);
    if (s != HT_OK) return s;
    const ht_json *vocab = ht_json_get(ht_json_get(root, "model"), "vocab"), *added = ht_json_get(root, "added_tokens");
    double top = -1;
    /* WordLevel, WordPiece and BPE: {token: id}; Unigram: [[token, score], ...], ids by position. */
    if (vocab && vocab->type == HT_JSON_OBJECT) {
        for (size_t i = 0; i < vocab->count; i++)
            if (vocab->items[i].type == HT_JSON_NUMBER && vocab->items[i].number > top) top = vocab->items[i].number;
    } else if (vocab && vocab->type == HT_JSON_ARRAY) {
        top = (double)vocab->count - 1;
    } else {
        s = ht_fail(err, HT_ERR_FORMAT, "%s: no model.vocab (not a Hugging Face tokenizer.json?)", file);
    }
    for (size_t i = 0; s == HT_OK && added && added->type == HT_JSON_ARRAY && i < added->count; i++) {
        const ht_json *id = ht_json_get(&added->items[i], "id");
        if (id && id->type == HT_JSON_NUMBER && id->number > top) top = id->number;
    }
    ht_json_free(root);
    if (s != HT_OK) return s;
    if (!(top >= 0 && top < 2147483647.0))
        return ht_fail(err, HT_ERR_FORMAT, "%s: token ids out of range (largest %.0f)", file, top);
    *vocab_size = (int)top + 1;
    return HT_OK;
}
