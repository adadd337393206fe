/* Global gradient-norm clipping over every trainable param's FP32 main_grad
 * (docs/NUMERICS.md, gradient clipping): the sum of squares accumulates in double. */
#include "hypertrain/optim.h"

#include <math.h>

#include "hypertrain/kernels.h"

double ht_grad_norm(const ht_param_store *params, const char **bad) {
    return sqrt(ht_grad_sum_squares(params, false, bad));
}

/* The trainable params' sums SUM_BATCH at a time (one wait each on a GPU),
 * added in param order. */
#define SUM_BATCH 256

double ht_grad_sum_squares(const ht_param_store *params, bool split_only, const char **bad) {
    if (bad) *bad = NULL;
    double total = 0.0;
    for (int i = 0; i < params->count;) {
        const float *x[SUM_BATCH];
        int64_t n[SUM_BATCH];
        int of[SUM_BATCH], count = 0;
        for (; i < params->count && count < SUM_BATCH; i++) {
            const ht_param *p = &params->items[i];
            if (!p->trainable || !p->main_grad) continue;
            x[count] = p->main_grad, n[count] = ht_param_local_numel(p), of[count++] = i;
        }
        double sums[SUM_BATCH];
        if (count) ht_kernels()->sum_squares_each(sums, x, n, count);
        for (int c = 0; c < count; c++) {
            const ht_param *p = &params->items[of[c]];
            if (!isfinite(sums[c]) && bad && !*bad) *bad = p->name;
            if (split_only && p->tp_dim < 0) continue;
            if (p->stage_copy) continue; /* the first pipeline stage counts a tied embedding */
            total += sums[c];
        }
    }
    return total;
}

void ht_clip_grads(ht_param_store *params, double norm, double max_norm) {
    if (!(norm > max_norm)) return;
    const float k = (float)(max_norm / (norm + 1e-6));
    for (int i = 0; i < params->count; i++) {
        ht_param *p = &params->items[i];
        if (!p->trainable || !p->main_grad) continue;
        ht_kernels()->scale(p->main_grad, ht_param_local_numel(p), k);
    }
}
