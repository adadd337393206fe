/* The seven learning-rate schedules of NUMERICS.md, as pure functions of the
 * 0-based step index. Each leaf optimizer has its own instance (own base lr). */
#include "hypertrain/optim.h"

#include <math.h>
#include <string.h>

static const char *lr_names[HT_LR_TYPE_COUNT] = {
    [HT_LR_CONSTANT_WARMUP] = "ConstantWarmUpLR",         [HT_LR_LINEAR_WARMUP] = "LinearWithWarmUpLR",
    [HT_LR_COSINE_WARMUP] = "CosineWithWarmUpLR",         [HT_LR_COSINE_RESTARTS] = "CosineWithRestartsAndWarmUpLR",
    [HT_LR_POLYNOMIAL_WARMUP] = "PolynomialWithWarmUpLR", [HT_LR_WSD] = "WarmUpStableDecayLR",
    [HT_LR_COSINE_ANNEALING] = "CosineAnnealingLR",
};

const char *ht_lr_type_name(ht_lr_type type) { return type < HT_LR_TYPE_COUNT ? lr_names[type] : "?"; }

bool ht_lr_type_from_name(const char *name, ht_lr_type *out) {
    for (int i = 0; i < HT_LR_TYPE_COUNT; i++) {
        if (strcmp(name, lr_names[i]) == 0) {
            *out = (ht_lr_type)i;
            return true;
        }
    }
    return false;
}

static double max_d(double a, double b) { return a > b ? a : b; }

double ht_lr_at(const ht_lr_schedule *sc, int64_t s) {
    const double eta = sc->base_lr, end = sc->lr_end;
    const double T = (double)sc->total_steps, W = (double)sc->warmup_steps, x = (double)s;
    if (sc->type == HT_LR_COSINE_ANNEALING) {
        double tmax = sc->t_max > 0 ? (double)sc->t_max : T;
        return sc->eta_min + (eta - sc->eta_min) * 0.5 * (1.0 + cos(M_PI * x / tmax));
    }
    if (s < sc->warmup_steps) return sc->warmup_lr_init + (eta - sc->warmup_lr_init) * x / W;
    switch (sc->type) {
    case HT_LR_CONSTANT_WARMUP: return eta;
    case HT_LR_LINEAR_WARMUP: return eta * max_d(0.0, (T - x) / max_d(1.0, T - W));
    case HT_LR_COSINE_WARMUP:
    case HT_LR_COSINE_RESTARTS: {
        double D = sc->decay_steps > 0 ? (double)sc->decay_steps : T;
        if (x >= D) return end;
        double p = (x - W) / max_d(1.0, D - W);
        if (sc->type == HT_LR_COSINE_WARMUP)
            return end + (eta - end) * max_d(0.0, 0.5 * (1.0 + cos(2.0 * M_PI * sc->num_cycles * p)));
        return end + (eta - end) * 0.5 * (1.0 + cos(M_PI * fmod(sc->num_cycles * p, 1.0)));
    }
    case HT_LR_POLYNOMIAL_WARMUP: {
        /* No clamp at W + D: NUMERICS.md's formula as written (only s > T ends at lr_end). */
        if (x > T) return end;
        double D = sc->decay_steps > 0 ? (double)sc->decay_steps : T - W;
        if (D <= 0) return end; /* T == W: no decay phase (the formula would be 0/0) */
        return end + (eta - end) * pow(1.0 - (x - W) / D, sc->power);
    }
    case HT_LR_WSD: {
        double S = (double)sc->decay_start;
        if (x < S) return eta;
        double span = T - S;
        double frac = span > 0 ? (x - S) / span : 1.0;
        return eta - (eta - end) * (frac < 1.0 ? frac : 1.0);
    }
    default: return eta;
    }
}
