/* The FP32 main-param wrapper around the chained Muon + AdamW: routing,
 * Megatron's three parameter groups, gradient preparation (fp16 unscaling,
 * non-finite checks), clipping, the two leaf steps (which cast the main
 * params back to the model dtype in the same pass, or without main params
 * update the model's values through FP32 blocks), and zeroing main_grad. */
#include "hypertrain/optimizer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"

/* ------------------------------------------------------------------ loss scaling */

void ht_loss_scaler_init(ht_loss_scaler *s, double initial, double growth_factor, double backoff_factor,
                         int growth_interval, int hysteresis, double min_scale) {
    s->scale = initial;
    s->growth_factor = growth_factor;
    s->backoff_factor = backoff_factor;
    s->min_scale = min_scale;
    s->growth_interval = growth_interval;
    s->hysteresis = hysteresis;
    s->growth_tracker = 0;
    s->hysteresis_tracker = hysteresis;
}

void ht_loss_scaler_update(ht_loss_scaler *s, bool found_inf) {
    if (found_inf) {
        s->growth_tracker = 0;
        s->hysteresis_tracker--;
        if (s->hysteresis_tracker <= 0) s->scale = fmax(s->scale * s->backoff_factor, s->min_scale);
        return;
    }
    s->growth_tracker++;
    if (s->growth_tracker == s->growth_interval) {
        s->growth_tracker = 0;
        s->hysteresis_tracker = s->hysteresis;
        s->scale *= s->growth_factor;
    }
}

/* ------------------------------------------------------------------ routing */

static bool matches_any(const char *name, const char *const *globs, int count) {
    for (int i = 0; i < count; i++)
        if (ht_name_match(globs[i], name)) return true;
    return false;
}

static bool goes_to_muon(const ht_param *p, const ht_optimizer_config *cfg) {
    return cfg->use_muon && p->ndim >= 2 && !matches_any(p->name, cfg->adamw_include, cfg->adamw_include_count);
}

size_t ht_optimizer_plan_bytes(const ht_param_store *params, const ht_optimizer_config *cfg) {
    size_t adamw = 0;
    int n_muon = 0;
    ht_param **to_muon = malloc((size_t)(params->count ? params->count : 1) * sizeof(ht_param *));
    for (int i = 0; i < params->count; i++) {
        ht_param *p = &params->items[i];
        if (!p->trainable) continue;
        if (to_muon && goes_to_muon(p, cfg))
            to_muon[n_muon++] = p;
        else
            adamw += 2 * (size_t)ht_param_local_numel(p);
    }
    size_t muon = n_muon ? ht_muon_plan_bytes(&cfg->muon, to_muon, n_muon, cfg->comm, cfg->replicas, cfg->tp) : 0;
    free(to_muon);
    return adamw * sizeof(float) + muon;
}

/* `wd`: each param's weight decay, or NULL when the leaf has one for all. */
static void log_routing(const char *leaf, ht_param **list, const double *wd, int n) {
    int64_t numel = 0;
    for (int i = 0; i < n; i++) numel += ht_param_numel(list[i]);
    ht_log_info("Parameter routing: %d parameters (%.2fM values) to %s", n, (double)numel / 1e6, leaf);
    for (int i = 0; i < n; i++) {
        char shape[64] = "", decay[32] = "";
        for (int d = 0; d < list[i]->ndim; d++)
            snprintf(shape + strlen(shape), sizeof(shape) - strlen(shape), "%s%lld", d ? "x" : "",
                     (long long)list[i]->shape[d]);
        if (wd) snprintf(decay, sizeof(decay), "weight decay %g", wd[i]);
        ht_log_info("  %-6s %-56s %-12s %-9s %s", leaf, list[i]->name, shape, ht_dtype_name(list[i]->dtype), decay);
    }
}

static const char *first_match(const char *name, const char *const *patterns, int count) {
    for (int i = 0; i < count; i++)
        if (ht_name_match(patterns[i], name)) return patterns[i];
    return NULL;
}

/* weight_decay_include and weight_decay_exclude over what no_weight_decay decided. */
static ht_status apply_decay_overrides(ht_adamw *adamw, const ht_optimizer_config *cfg, ht_error *err) {
    for (int i = 0; i < adamw->count; i++) {
        ht_adamw_slot *s = &adamw->slots[i];
        const char *in = first_match(s->param->name, cfg->weight_decay_include, cfg->weight_decay_include_count);
        const char *out = first_match(s->param->name, cfg->weight_decay_exclude, cfg->weight_decay_exclude_count);
        if (in && out)
            return ht_fail(err, HT_ERR_CONFIG,
                           "%s matches weight_decay_include \"%s\" and weight_decay_exclude \"%s\": decay it or "
                           "not, one of the two",
                           s->param->name, in, out);
        if (in) s->weight_decay = cfg->adamw.weight_decay;
        if (out) s->weight_decay = 0.0;
    }
    return HT_OK;
}

ht_status ht_optimizer_init(ht_optimizer *opt, ht_param_store *params, const ht_optimizer_config *cfg, ht_error *err) {
    memset(opt, 0, sizeof(*opt));
    opt->params = params;
    opt->fp32_main_params = cfg->fp32_main_params;
    opt->max_norm = cfg->max_norm;
    opt->muon_schedule = cfg->muon_schedule;
    opt->adamw_schedule = cfg->adamw_schedule;
    opt->loss_scaling = cfg->loss_scaling;
    opt->scaler = cfg->scaler;
    opt->stochastic_rounding = cfg->stochastic_rounding;
    opt->seed = cfg->seed;
    opt->comm = cfg->comm ? cfg->comm : ht_comm_single();
    opt->tp = cfg->tp ? cfg->tp : ht_comm_single();
    opt->stages = cfg->stages ? cfg->stages : ht_comm_single();
    for (int i = 0; i < params->count; i++) {
        ht_param *p = &params->items[i];
        if (p->trainable && !ht_dtype_is_float(p->dtype))
            return ht_fail(err, HT_ERR_INVALID,
                           "trainable parameter %s has dtype %s: the optimizer updates float16, bfloat16 and "
                           "float32 parameters only",
                           p->name, ht_dtype_name(p->dtype));
    }
    /* With fp32_main_params every low-precision param gets its own FP32 main
     * param; without, it has none and the leaves update its model values
     * (each step starts from them). An FP32 param is its own either way. */
    ht_status s = ht_params_create_main(params,
                                        !opt->fp32_main_params ? HT_MAIN_NONE
                                        : cfg->residual16      ? HT_MAIN_RESIDUAL16
                                                               : HT_MAIN_COPY,
                                        err);
    if (s != HT_OK) return s;

    size_t n = (size_t)params->count;
    opt->float16_groups = calloc(n + 1, sizeof(ht_param *));
    opt->fp32_from_float16_groups = calloc(n + 1, sizeof(float *));
    opt->fp32_from_fp32_groups = calloc(n + 1, sizeof(ht_param *));
    ht_param **to_muon = calloc(n + 1, sizeof(ht_param *)), **to_adamw = calloc(n + 1, sizeof(ht_param *));
    if (!opt->float16_groups || !opt->fp32_from_float16_groups || !opt->fp32_from_fp32_groups || !to_muon ||
        !to_adamw) {
        free(to_muon);
        free(to_adamw);
        ht_optimizer_free(opt);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate the optimizer's parameter groups");
    }
    int n_muon = 0, n_adamw = 0;
    for (int i = 0; i < params->count; i++) {
        ht_param *p = &params->items[i];
        if (!p->trainable) continue;
        if (p->dtype == HT_DTYPE_F32) {
            opt->fp32_from_fp32_groups[opt->fp32_count++] = p;
        } else {
            opt->float16_groups[opt->float16_count] = p;
            opt->fp32_from_float16_groups[opt->float16_count++] = p->main_param;
        }
        if (goes_to_muon(p, cfg))
            to_muon[n_muon++] = p;
        else
            to_adamw[n_adamw++] = p;
    }
    /* A leaf with no parameters is not created. */
    if (n_muon > 0) {
        opt->muon = calloc(1, sizeof(ht_muon));
        s = opt->muon ? ht_muon_init(opt->muon, &cfg->muon, to_muon, n_muon, err)
                      : ht_fail(err, HT_ERR_OOM, "cannot allocate Muon");
        if (s == HT_OK) s = ht_muon_set_comm(opt->muon, opt->comm, cfg->replicas, err);
        if (s == HT_OK) s = ht_muon_set_tensor_parallel(opt->muon, opt->tp, err);
    }
    if (s == HT_OK && n_adamw > 0) {
        opt->adamw = calloc(1, sizeof(ht_adamw));
        s = opt->adamw ? ht_adamw_init(opt->adamw, &cfg->adamw, to_adamw, n_adamw, cfg->no_weight_decay,
                                       cfg->no_weight_decay_count, err)
                       : ht_fail(err, HT_ERR_OOM, "cannot allocate AdamW");
        if (s == HT_OK) s = apply_decay_overrides(opt->adamw, cfg, err);
    }
    if (s == HT_OK) {
        double *wd = calloc((size_t)n_adamw + 1, sizeof(double));
        for (int i = 0; wd && i < n_adamw; i++) wd[i] = opt->adamw->slots[i].weight_decay;
        log_routing("Muon", to_muon, NULL, n_muon);
        log_routing("AdamW", to_adamw, wd, n_adamw);
        free(wd);
        if (opt->fp32_main_params && cfg->residual16)
            ht_log_info("FP32 main params: on, residual16; %d bfloat16 params with the low 16 bits of their FP32 "
                        "values beside them (%.1f MiB), %d float32 params that are their own",
                        opt->float16_count, (double)params->main_bytes / (1 << 20), opt->fp32_count);
        else if (opt->fp32_main_params)
            ht_log_info("FP32 main params: on; %d low-precision params with their own FP32 copy (%.1f MiB), %d "
                        "float32 params that are their own",
                        opt->float16_count, (double)params->main_bytes / (1 << 20), opt->fp32_count);
        else
            ht_log_info("FP32 main params: off (optimizer.fp32_main_params false): no FP32 copies (%.1f MiB); %d "
                        "low-precision params updated in their own dtype, each step from their rounded values through "
                        "FP32 blocks; %d float32 params that are their own",
                        (double)params->main_bytes / (1 << 20), opt->float16_count, opt->fp32_count);
    }
    free(to_muon);
    free(to_adamw);
    if (s != HT_OK) ht_optimizer_free(opt);
    return s;
}

void ht_optimizer_free(ht_optimizer *opt) {
    if (opt->muon) ht_muon_free(opt->muon);
    if (opt->adamw) ht_adamw_free(opt->adamw);
    free(opt->muon);
    free(opt->adamw);
    free(opt->float16_groups);
    free(opt->fp32_from_float16_groups);
    free(opt->fp32_from_fp32_groups);
    memset(opt, 0, sizeof(*opt));
}

double ht_optimizer_loss_scale(const ht_optimizer *opt) { return opt->loss_scaling ? opt->scaler.scale : 1.0; }

/* ------------------------------------------------------------------ the step */

static void scale_grads(ht_param_store *params, float k) {
    for (int i = 0; i < params->count; i++) {
        ht_param *p = &params->items[i];
        if (!p->trainable || !p->main_grad) continue;
        ht_kernels()->scale(p->main_grad, ht_param_local_numel(p), k);
    }
}

ht_status ht_optimizer_step(ht_optimizer *opt, ht_step_result *r, ht_error *err) {
    ht_param_store *ps = opt->params;
    memset(r, 0, sizeof(*r));
    r->loss_scale = ht_optimizer_loss_scale(opt);

    /* Prepare the gradients: with loss scaling they carry the scale. */
    if (opt->loss_scaling) scale_grads(ps, (float)(1.0 / opt->scaler.scale));
    /* One all-reduce of the ranks' sums of squares (rank order: every rank
     * gets the same norm), then one over the tensor-parallel slices, where a
     * param not split (the same gradient on every rank of the group) is
     * counted by the group's first rank alone. */
    const char *bad = NULL;
    double squares = ht_grad_sum_squares(ps, opt->tp->size > 1 && opt->tp->rank > 0, &bad);
    ht_all_reduce_f64(opt->comm, &squares, 1, HT_REDUCE_SUM);
    if (opt->tp->size > 1) ht_all_reduce_f64(opt->tp, &squares, 1, HT_REDUCE_SUM);
    if (opt->stages->size > 1) ht_all_reduce_f64(opt->stages, &squares, 1, HT_REDUCE_SUM); /* each stage its params' */
    double norm = sqrt(squares);
    r->grad_norm = norm;
    if (!isfinite(norm)) {
        if (!opt->loss_scaling) {
            return ht_fail(err, HT_ERR_NUMERIC,
                           "step %lld: non-finite gradient (norm %g); first parameter with a non-finite gradient: %s",
                           (long long)opt->step + 1, norm, bad ? bad : "(none found)");
        }
        /* fp16 overflow: skip the update, back off the scale. */
        ht_loss_scaler_update(&opt->scaler, true);
        /* Each rank names the first of its own params that overflowed; a rank with none stays silent. */
        if (bad)
            ht_log_warn("update skipped: gradient overflow at loss scale %g (first in %s), on every rank; the scale "
                        "is now %g, %lld updates taken so far",
                        r->loss_scale, bad, opt->scaler.scale, (long long)opt->step);
        r->skipped = true;
        ht_params_zero_grad(ps);
        return HT_OK;
    }
    ht_clip_grads(ps, norm, opt->max_norm);

    /* Without FP32 main params the leaves start each step from the model's
     * own rounded values, so an update below half an ulp is lost (unless
     * stochastic rounding keeps it in expectation). */
    r->muon_lr = ht_lr_at(&opt->muon_schedule, opt->step);
    r->adamw_lr = ht_lr_at(&opt->adamw_schedule, opt->step);
    const ht_rounding rounding = {.stochastic = opt->stochastic_rounding, .seed = opt->seed, .step = opt->step};
    if (opt->muon) {
        opt->muon->rounding = rounding;
        ht_muon_step(opt->muon, r->muon_lr);
    }
    if (opt->adamw) {
        opt->adamw->rounding = rounding;
        ht_adamw_step(opt->adamw, r->adamw_lr);
    }
    if (opt->loss_scaling) ht_loss_scaler_update(&opt->scaler, false);
    opt->step++;
    ht_params_zero_grad(ps);
    return HT_OK;
}

/* ------------------------------------------------------------------ QK-clip */

static void scale_block(float *x, int64_t at, int64_t len, void *k) {
    (void)at;
    ht_kernels()->scale(x, len, *(const float *)k);
}

/* Multiplies rows [r0, r1) of a param's main copy by k (those of them this
 * rank holds) and writes them back to the model dtype. Without a main param
 * the model's own values are scaled, through FP32 blocks, and rounded back. */
static void scale_rows(ht_param *p, int64_t r0, int64_t r1, float k) {
    if (!p) return;
    r0 = r0 > p->row0 ? r0 : p->row0;
    r1 = r1 < p->row1 ? r1 : p->row1;
    if (r0 >= r1) return;
    int64_t row = ht_param_row_numel(p), n = (r1 - r0) * row;
    char *model = (char *)p->data + (size_t)((r0 - p->row0) * row) * ht_dtype_size(p->dtype);
    if (p->main_low) {
        ht_param_main_pass(p, (r0 - p->row0) * row, n, scale_block, &k);
        return;
    }
    if (!p->main_param) {
        /* FP32 blocks in the kernels' memory; where even one block cannot be had, the values stay unscaled and
         * the log says so */
        const int64_t block = n < ((int64_t)1 << 16) ? n : ((int64_t)1 << 16);
        float *x = ht_kernels()->alloc((size_t)block * sizeof(float));
        if (!x) {
            ht_log_warn("QK-clip: no memory to rescale %s by %.6g; it is left as it was", p->name, (double)k);
            return;
        }
        for (int64_t b = 0; b < n; b += block) {
            size_t len = (size_t)(n - b < block ? n - b : block);
            char *at = model + (size_t)b * ht_dtype_size(p->dtype);
            ht_kernels()->convert(x, HT_DTYPE_F32, at, p->dtype, len);
            ht_kernels()->scale(x, (int64_t)len, k);
            ht_kernels()->convert(at, p->dtype, x, HT_DTYPE_F32, len);
        }
        ht_kernels()->free(x);
        return;
    }
    float *m = p->main_param + (r0 - p->row0) * row;
    ht_kernels()->scale(m, n, k);
    if ((void *)p->main_param != p->data) ht_kernels()->convert(model, p->dtype, m, HT_DTYPE_F32, (size_t)n);
}

int ht_qk_clip(const ht_qk_layer *l, const float *max_logit, double tau) {
    int clipped = 0;
    bool mha = l->num_heads == l->num_kv_heads;
    for (int h = 0; h < l->num_heads; h++) {
        if (!(max_logit[h] > tau)) continue;
        double gamma = tau / max_logit[h];
        if (l->kv_b) {
            const int64_t q0 = (int64_t)h * (l->nope + l->rope), k0 = (int64_t)h * (l->nope + l->v_dim);
            const float root = (float)sqrt(gamma);
            scale_rows(l->q_weight, q0, q0 + l->nope, root);
            scale_rows(l->q_weight, q0 + l->nope, q0 + l->nope + l->rope, (float)gamma);
            scale_rows(l->kv_b, k0, k0 + l->nope, root);
            clipped++;
            continue;
        }
        /* MHA: q and k share the factor; GQA: the shared key head stays, the query head takes all of it. */
        float kq = (float)(mha ? sqrt(gamma) : gamma);
        int64_t r0 = (int64_t)h * l->head_dim, r1 = r0 + l->head_dim;
        scale_rows(l->q_weight, r0, r1, kq);
        scale_rows(l->q_bias, r0, r1, kq);
        if (mha) {
            scale_rows(l->k_weight, r0, r1, kq);
            scale_rows(l->k_bias, r0, r1, kq);
        }
        clipped++;
    }
    return clipped;
}

size_t ht_optimizer_bytes(const ht_optimizer *opt) {
    size_t floats = 0;
    for (int i = 0; opt->adamw && i < opt->adamw->count; i++)
        floats += 2 * (size_t)ht_param_local_numel(opt->adamw->slots[i].param);
    const ht_muon *mu = opt->muon;
    for (int i = 0; mu && i < mu->count; i++) {
        floats += (size_t)ht_param_local_numel(mu->slots[i].param);
        if (mu->owned && mu->owned[i]) floats += (size_t)(mu->slots[i].rows * mu->slots[i].cols);
    }
    if (mu) floats += mu->work_floats + mu->tp_floats;
    return floats * sizeof(float);
}

double ht_optimizer_ns_flops(const ht_optimizer *opt) {
    const ht_muon *mu = opt->muon;
    double flops = 0;
    for (int i = 0; mu && i < mu->count; i++) {
        const ht_muon_slot *s = &mu->slots[i];
        if (mu->owner && mu->owner[i] >= 0 && !(mu->owned && mu->owned[i])) continue; /* another rank's to compute */
        const double r = (double)(s->rows < s->cols ? s->rows : s->cols),
                     c = (double)(s->rows < s->cols ? s->cols : s->rows);
        const double matrices =
            s->param->ndim == 3 ? (double)ht_param_local_numel(s->param) / ((double)s->rows * (double)s->cols) : 1.0;
        flops += matrices * mu->config.schedule.steps * (4 * r * r * c + 2 * r * r * r);
    }
    return flops;
}

int ht_optimizer_list_state(const ht_optimizer *opt, ht_opt_state *out) {
    int n = 0;
#define ENTRY(p, k, d, t, s)                                                                                           \
    do {                                                                                                               \
        if (out) out[n] = (ht_opt_state){p, k, d, t, s};                                                               \
        n++;                                                                                                           \
    } while (0)
    for (int i = 0; opt->muon && i < opt->muon->count; i++) {
        ht_muon_slot *sl = &opt->muon->slots[i];
        ENTRY(sl->param, "momentum_buffer", sl->momentum_buffer, HT_DTYPE_F32, &sl->step);
        ENTRY(sl->param, "step", &sl->step, HT_DTYPE_I64, &sl->step);
    }
    for (int i = 0; opt->adamw && i < opt->adamw->count; i++) {
        ht_adamw_slot *sl = &opt->adamw->slots[i];
        ENTRY(sl->param, "exp_avg", sl->exp_avg, HT_DTYPE_F32, &sl->step);
        ENTRY(sl->param, "exp_avg_sq", sl->exp_avg_sq, HT_DTYPE_F32, &sl->step);
        ENTRY(sl->param, "step", &sl->step, HT_DTYPE_I64, &sl->step);
    }
#undef ENTRY
    return n;
}
