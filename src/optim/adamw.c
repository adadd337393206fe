/* AdamW with PyTorch semantics (NUMERICS.md): decoupled weight decay, bias
 * correction, eps added after the bias-corrected square root. One fused pass
 * per parameter reads g, m, v, p and writes m, v, p and the model copy. */
#include "hypertrain/optim.h"

#include <fnmatch.h>
#include <math.h>
#include <string.h>

bool ht_glob_match(const char *pattern, const char *name) { return fnmatch(pattern, name, 0) == 0; }

/* One element of the update (NUMERICS.md, AdamW); returns the new p. */
static inline float adamw_element(float *p, float g, float *m, float *v, float decay, float b1, float b2,
                                  float step_size, float bc2_sqrt, float eps) {
    float mi = b1 * *m + (1.0f - b1) * g;
    float vi = b2 * *v + (1.0f - b2) * g * g;
    float pi = *p * decay - step_size * mi / (sqrtf(vi) / bc2_sqrt + eps);
    *m = mi;
    *v = vi;
    *p = pi;
    return pi;
}

void ht_adamw_update(float *p, const float *g, float *m, float *v, int64_t n, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, void *model, ht_dtype model_dtype) {
    /* Scalars in double as PyTorch computes them on the host, then FP32 per element. */
    const float decay = (float)(1.0 - lr * weight_decay);
    const float b1 = (float)beta1, b2 = (float)beta2;
    const float step_size = (float)(lr / (1.0 - pow(beta1, (double)step)));
    const float bc2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)step));
    const float e = (float)eps;
    uint16_t *out = model;
    /* One loop per destination so each vectorizes: the cast back is fused into the same pass. */
    if (!model) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) adamw_element(&p[i], g[i], &m[i], &v[i], decay, b1, b2, step_size, bc2_sqrt, e);
    } else if (model_dtype == HT_DTYPE_BF16) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++)
            out[i] = ht_f32_to_bf16(adamw_element(&p[i], g[i], &m[i], &v[i], decay, b1, b2, step_size, bc2_sqrt, e));
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++)
            out[i] = ht_f32_to_f16(adamw_element(&p[i], g[i], &m[i], &v[i], decay, b1, b2, step_size, bc2_sqrt, e));
    }
}

ht_status ht_adamw_init(ht_adamw *opt, const ht_adamw_config *cfg, ht_param **params, int count,
                        const char *const *no_wd, int no_wd_count, ht_error *err) {
    memset(opt, 0, sizeof(*opt));
    opt->config = *cfg;
    opt->slots = ht_alloc((size_t)(count > 0 ? count : 1) * sizeof(ht_adamw_slot));
    if (!opt->slots) return ht_fail(err, HT_ERR_OOM, "cannot allocate AdamW slots");
    size_t floats = 0;
    for (int i = 0; i < count; i++) floats += 2 * (size_t)ht_param_local_numel(params[i]);
    opt->state_block = ht_alloc(floats * sizeof(float));
    if (!opt->state_block) {
        ht_free(opt->slots);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes of AdamW state", floats * sizeof(float));
    }
    float *next = opt->state_block;
    for (int i = 0; i < count; i++) {
        ht_param *p = params[i];
        if (!p->main_param || !p->main_grad)
            return ht_fail(err, HT_ERR_INVALID, "AdamW: parameter %s has no FP32 main param or main grad", p->name);
        ht_adamw_slot *s = &opt->slots[opt->count++];
        s->param = p;
        s->weight_decay = cfg->weight_decay;
        for (int k = 0; k < no_wd_count; k++)
            if (ht_glob_match(no_wd[k], p->name)) s->weight_decay = 0.0;
        int64_t n = ht_param_local_numel(p);
        s->exp_avg = next;
        s->exp_avg_sq = next + n;
        next += 2 * n;
    }
    return HT_OK;
}

void ht_adamw_step(ht_adamw *opt, double lr) {
    const ht_adamw_config *c = &opt->config;
    for (int i = 0; i < opt->count; i++) {
        ht_adamw_slot *s = &opt->slots[i];
        ht_param *p = s->param;
        s->step++;
        bool separate = (void *)p->main_param != p->data;
        ht_adamw_update(p->main_param, p->main_grad, s->exp_avg, s->exp_avg_sq, ht_param_local_numel(p), s->step, lr,
                        c->beta1, c->beta2, c->eps, s->weight_decay, separate ? p->data : NULL, p->dtype);
    }
}

void ht_adamw_free(ht_adamw *opt) {
    ht_free(opt->state_block);
    ht_free(opt->slots);
    memset(opt, 0, sizeof(*opt));
}
