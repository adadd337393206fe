/* training.sample_interval: what the model writes, every so many steps, as
 * llm.c prints during training: a sample continuing training.sample_prompt
 * on a copy of the whole weights (rank 0), logged and written beside the
 * metrics (output_dir/samples.jsonl). */
#include "train/sample.h"

#include <stdlib.h>
#include <string.h>

/* s (n bytes) with every byte that is not part of valid UTF-8 as U+FFFD, NUL-terminated (malloc'ed). */
static char *valid_utf8(const char *s, size_t n) {
    char *out = malloc(3 * n + 1), *o = out;
    for (size_t i = 0; out && i < n;) {
        const unsigned char b = (unsigned char)s[i];
        size_t k = b < 0x80                          ? 1
                   : (b & 0xE0) == 0xC0 && b >= 0xC2 ? 2
                   : (b & 0xF0) == 0xE0              ? 3
                   : (b & 0xF8) == 0xF0 && b <= 0xF4 ? 4
                                                     : 0;
        for (size_t j = 1; k && j < k; j++)
            if (i + j >= n || ((unsigned char)s[i + j] & 0xC0) != 0x80) k = 0;
        if (b == 0) k = 0; /* a NUL byte would end the string */
        if (k) {
            memcpy(o, s + i, k), o += k, i += k;
        } else {
            memcpy(o, "\xEF\xBF\xBD", 3), o += 3, i++;
        }
    }
    if (out) *o = '\0';
    return out;
}

/* The prompt's tokens: data.tokenizer's, or its bytes. */
static ht_status prompt_tokens(ht_trainer *t, const char *prompt, int32_t **ids, int *n, ht_error *err) {
    const ht_config *c = &t->config;
    if (c->data.tokenizer[0] && !t->sample_tokenizer) {
        ht_status s = ht_tokenizer_load(c->data.tokenizer, &t->sample_tokenizer, err);
        if (s != HT_OK) return s;
    }
    if (t->sample_tokenizer) return ht_tokenizer_encode(t->sample_tokenizer, prompt, strlen(prompt), ids, n, err);
    *n = (int)strlen(prompt);
    if (!(*ids = malloc(((size_t)*n + 1) * sizeof(int32_t)))) return ht_fail(err, HT_ERR_OOM, "out of memory");
    for (int i = 0; i < *n; i++) (*ids)[i] = (unsigned char)prompt[i];
    return HT_OK;
}

/* The text of `ids` (malloc'ed bytes, *len of them). */
static char *tokens_text(const ht_trainer *t, const int32_t *ids, int n, size_t *len) {
    char *text = malloc((size_t)n * 64 + 1);
    *len = 0;
    for (int i = 0; text && i < n; i++) {
        if (t->sample_tokenizer)
            *len += ht_tokenizer_decode(t->sample_tokenizer, ids[i], text + *len, 64);
        else
            text[(*len)++] = (char)ids[i];
    }
    return text;
}

ht_status ht_trainer_sample(ht_trainer *t, const ht_param_store *whole, ht_error *err) {
    const ht_config *c = &t->config;
    const char *prompt = c->training.sample_prompt[0] ? c->training.sample_prompt : "\n";
    const double t0 = ht_time_seconds();
    int32_t *ids = NULL, *out = malloc((size_t)c->training.sample_tokens * sizeof(int32_t));
    int n = 0, produced = 0;
    ht_status s = out ? prompt_tokens(t, prompt, &ids, &n, err) : ht_fail(err, HT_ERR_OOM, "out of memory");
    ht_param_store merged = {0};
    ht_model *m = NULL;
    const ht_model_config *arch = &t->model->config;
    if (s == HT_OK && arch->lora.rank > 0) { /* the adapters folded in, as the final weights are */
        s = ht_lora_merge(whole, ht_lora_scale(&arch->lora), &merged, err);
        whole = &merged;
    }
    if (s == HT_OK) s = ht_ckpt_model_from_params(arch, whole, HT_DTYPE_F32, &m, err);
    const ht_sampling how = {.temperature = 1.0, .seed = (uint64_t)c->training.seed + (uint64_t)t->step};
    if (s == HT_OK)
        s = ht_generate(m, ids, n, c->training.sample_tokens, &how, NULL, 0, NULL, NULL, out, &produced, err);
    if (s != HT_OK) {
        char why[sizeof(err->msg)];
        snprintf(why, sizeof(why), "%s", err->msg);
        ht_fail(err, s, "training.sample_interval: %s", why);
    } else {
        size_t len;
        char *raw = tokens_text(t, out, produced, &len), *text = raw ? valid_utf8(raw, len) : NULL,
             *shown = valid_utf8(prompt, strlen(prompt));
        if (!text || !shown) {
            s = ht_fail(err, HT_ERR_OOM, "out of memory");
        } else {
            ht_log_info("sample at step %lld (%d tokens after %d of the prompt, %.2f s):", (long long)t->step, produced,
                        n, ht_time_seconds() - t0);
            for (char *line = text, *next; line; line = next) { /* a log line per line of text */
                next = strchr(line, '\n');
                ht_log_info("  | %.*s", next ? (int)(next - line) : (int)strlen(line), line);
                if (next) next++;
            }
            fprintf(t->samples, "{\"step\": %lld, \"prompt\": ", (long long)t->step);
            ht_json_write_string(t->samples, shown);
            fputs(", \"text\": ", t->samples);
            ht_json_write_string(t->samples, text);
            fputs(", \"tokens\": [", t->samples);
            for (int i = 0; i < produced; i++) fprintf(t->samples, "%s%d", i ? ", " : "", out[i]);
            fputs("]}\n", t->samples);
            if (fflush(t->samples) != 0)
                s = ht_fail(err, HT_ERR_IO, "%s/samples.jsonl: cannot write", c->checkpoint.output_dir);
        }
        free(raw), free(text), free(shown);
    }
    ht_model_free(m);
    ht_params_free(&merged);
    free(ids);
    free(out);
    return s;
}
