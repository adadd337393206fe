/* Generation: a prompt's continuation token by token through the model's
 * key/value cache (the prompt in one forward, then one token a forward), and
 * the choice of each token from its logits: greedy, or sampled with
 * temperature, top-k and top-p as transformers' warpers apply them. */
#define _GNU_SOURCE /* qsort_r */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "hypertrain/model.h"

static int by_logit_desc(const void *a, const void *b, void *logits) {
    const float *l = logits, x = l[*(const int32_t *)a], y = l[*(const int32_t *)b];
    if (x != y) return x > y ? -1 : 1;
    return *(const int32_t *)a < *(const int32_t *)b ? -1 : 1; /* the lower id first among equals */
}

int32_t ht_sample(const float *logits, int64_t V, const ht_sampling *s, ht_rng *rng, int32_t *order) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; i++)
        if (logits[i] > logits[best]) best = i; /* torch.argmax: the first of equal maxima */
    if (!(s->temperature > 0)) return (int32_t)best;
    /* The candidates, most likely first: all of them, or top_k; then top_p's
     * fewest whose probabilities (at this temperature) sum to at least top_p. */
    for (int64_t i = 0; i < V; i++) order[i] = (int32_t)i;
    const bool cut = (s->top_k > 0 && s->top_k < V) || (s->top_p > 0 && s->top_p < 1);
    if (cut) qsort_r(order, (size_t)V, sizeof(int32_t), by_logit_desc, (void *)logits);
    int64_t n = s->top_k > 0 && s->top_k < V ? s->top_k : V;
    const double mx = logits[best], inv_t = 1.0 / s->temperature;
    double total = 0.0;
    for (int64_t i = 0; i < n; i++) total += exp(((double)logits[order[i]] - mx) * inv_t);
    if (s->top_p > 0 && s->top_p < 1) {
        double kept = 0.0;
        int64_t k = 0;
        while (k < n && kept < s->top_p * total) kept += exp(((double)logits[order[k++]] - mx) * inv_t);
        n = k > 0 ? k : 1, total = kept > 0 ? kept : total;
    }
    double u = (double)ht_rng_uniform(rng) * total, acc = 0.0;
    for (int64_t i = 0; i < n; i++) {
        acc += exp(((double)logits[order[i]] - mx) * inv_t);
        if (u < acc) return order[i];
    }
    return order[n - 1];
}

static bool stops(int32_t token, const int32_t *stop, int count) {
    for (int i = 0; i < count; i++)
        if (stop[i] == token) return true;
    return false;
}

ht_status ht_generate(ht_model *m, const int32_t *prompt, int n, int max_new, const ht_sampling *s, const int32_t *stop,
                      int stop_count, ht_generate_fn fn, void *ctx, int32_t *out, int *produced, ht_error *err) {
    *produced = 0;
    if (n <= 0) return ht_fail(err, HT_ERR_INVALID, "generate: the prompt is empty (at least one token is needed)");
    if (max_new < 0) return ht_fail(err, HT_ERR_INVALID, "generate: %d new tokens", max_new);
    const int64_t total = (int64_t)n + max_new, V = m->config.vocab_size;
    if (total > m->config.max_position_embeddings)
        return ht_fail(err, HT_ERR_INVALID,
                       "generate: the prompt's %d tokens and %d new ones are more than the model's "
                       "max_position_embeddings (%d)",
                       n, max_new, m->config.max_position_embeddings);
    float *row = malloc((size_t)V * sizeof(float));
    int32_t *order = malloc((size_t)V * sizeof(int32_t));
    ht_status st = row && order
                       ? ht_model_set_cache(m, total, err)
                       : ht_fail(err, HT_ERR_OOM, "generate: cannot allocate a row of %lld logits", (long long)V);
    const bool track = m->track_attn_max;
    m->track_attn_max = false;
    ht_rng rng;
    ht_rng_seed(&rng, s->seed);
    const int32_t *next = prompt;
    int feed = n;
    while (st == HT_OK && *produced < max_new) {
        st = ht_model_forward(m, next, NULL, 1, feed, NULL, err);
        if (st == HT_OK) st = ht_kernels()->synchronize(err);
        if (st != HT_OK) break;
        ht_kernels()->download(row, m->logits, (size_t)V * sizeof(float));
        const int32_t token = ht_sample(row, V, s, &rng, order);
        out[(*produced)++] = token;
        if ((fn && !fn(ctx, token, row, V)) || stops(token, stop, stop_count)) break;
        next = &out[*produced - 1], feed = 1;
    }
    m->track_attn_max = track;
    if (m->cache_capacity > 0) {
        ht_error ignored;
        (void)ht_model_set_cache(m, 0, &ignored);
    }
    free(row);
    free(order);
    return st;
}
