/* Global gradient-norm clipping over every trainable param's FP32 main_grad
 * (docs/NUMERICS.md, gradient clipping): the sum of squares accumulates in double. */
#include "hypertrain/optim.h"

#include <math.h>

#include "hypertrain/kernels.h"

double ht_grad_norm(const ht_param_store *params, const char **bad) {
    return sqrt(ht_grad_sum_squares(params, false, bad));
}

double ht_grad_sum_squares(const ht_param_store *params, bool split_only, const char **bad) {
    double total = 0.0;
    if (bad) *bad = NULL;
    for (int i = 0; i < params->count; i++) {
        const ht_param *p = &params->items[i];
        if (!p->trainable || !p->main_grad) continue;
        double s = ht_kernels()->sum_squares(p->main_grad, ht_param_local_numel(p));
        if (!isfinite(s) && bad && !*bad) *bad = p->name;
        if (split_only && p->tp_dim < 0) continue;
        total += s;
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
