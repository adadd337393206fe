/* The learning-rate schedules of docs/NUMERICS.md and MindFormers
 * (mindformers/core/lr/lr_schedule.py), as pure functions of the 0-based step
 * index (MindFormers' global_step). Each leaf optimizer has its own instance. */
#include "hypertrain/optim.h"

#include <math.h>
#include <string.h>

static const char *lr_names[HT_LR_TYPE_COUNT] = {
    [HT_LR_CONSTANT_WARMUP] = "ConstantWarmUpLR",
    [HT_LR_LINEAR_WARMUP] = "LinearWithWarmUpLR",
    [HT_LR_COSINE_WARMUP] = "CosineWithWarmUpLR",
    [HT_LR_COSINE_RESTARTS] = "CosineWithRestartsAndWarmUpLR",
    [HT_LR_POLYNOMIAL_WARMUP] = "PolynomialWithWarmUpLR",
    [HT_LR_WSD] = "WarmUpStableDecayLR",
    [HT_LR_COSINE_ANNEALING] = "CosineAnnealingLR",
    [HT_LR_CONSTANT_COOLDOWN] = "ConstantWithCoolDownLR",
    [HT_LR_COSINE_WARM_RESTARTS] = "CosineAnnealingWarmRestarts",
    [HT_LR_WISE_LAYER] = "LearningRateWiseLayer",
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

/* MindFormers' CosineAnnealingWarmRestarts.construct: cycle i lasts t_0 · t_mult^i steps; within it
 * lr = eta_min + (η − eta_min) · max(0, ½(1 + cos(π · t_cur / T_i))), t_cur the steps since the restart.
 * The source finds the cycle as floor(log(s/t_0 · (t_mult − 1) + 1) / log(t_mult)), which rounding puts
 * one cycle early at some restarts (t_0 1, t_mult 3, s 121 gives 4, not 5: eta_min where the restart's
 * η_max belongs); here the same index is found exactly, in integers. */
static double warm_restarts(const ht_lr_schedule *sc, int64_t s) {
    if (sc->t_0 < 1 || sc->t_mult < 1) return NAN; /* MindFormers raises ValueError */
    int64_t t_cur = s, t_i = sc->t_0;
    if (s >= sc->t_0 && sc->t_mult == 1) {
        t_cur = s % sc->t_0;
    } else if (s >= sc->t_0) {
        int64_t start = 0; /* t_start = t_0 (1 − q^n) / (1 − t_mult), summed cycle by cycle */
        while (start + t_i <= s) {
            start += t_i;
            t_i *= sc->t_mult;
        }
        t_cur = s - start;
    }
    double pct = max_d(0.0, 0.5 * (1.0 + cos(M_PI * (double)t_cur / (double)t_i)));
    return sc->eta_min + (sc->base_lr - sc->eta_min) * pct;
}

/* MindFormers' ConstantWithCoolDownLR (DeepSeek-V3, p. 23): warmup to η over W steps, η for keep_steps K,
 * a cosine from η to lr_end1 over D = decay_steps, lr_end1 for final_steps F, then lr_end2:
 *   s < W + K → η;  s < W + K + D → lr_end1 + (η − lr_end1) · max(0, ½(1 + cos(2π · num_cycles · p))),
 *   p = (s − W − K) / max(1, D);  s < W + K + D + F → lr_end1;  else lr_end2. */
static double constant_cooldown(const ht_lr_schedule *sc, int64_t s) {
    const int64_t keep_end = sc->warmup_steps + sc->keep_steps, decay_end = keep_end + sc->decay_steps;
    const double eta = sc->base_lr, end1 = sc->lr_end1;
    if (s < keep_end) return eta;
    if (s < decay_end) {
        double p = (double)(s - keep_end) / max_d(1.0, (double)sc->decay_steps);
        return end1 + (eta - end1) * max_d(0.0, 0.5 * (1.0 + cos(2.0 * M_PI * sc->num_cycles * p)));
    }
    return s < decay_end + sc->final_steps ? end1 : sc->lr_end2;
}

double ht_lr_at(const ht_lr_schedule *sc, int64_t s) {
    const double eta = sc->base_lr, end = sc->lr_end;
    const double T = (double)sc->total_steps, W = (double)sc->warmup_steps, x = (double)s;
    if (sc->type == HT_LR_WISE_LAYER) {
        /* MindFormers' LearningRateWiseLayer.construct: lr_scale · base_lr(global_step). */
        if (sc->wrapped == HT_LR_WISE_LAYER || sc->wrapped >= HT_LR_TYPE_COUNT) return NAN;
        ht_lr_schedule base = *sc;
        base.type = sc->wrapped;
        return sc->lr_scale * ht_lr_at(&base, s);
    }
    if (sc->type == HT_LR_COSINE_WARM_RESTARTS) return warm_restarts(sc, s);
    if (sc->type == HT_LR_COSINE_ANNEALING) {
        double tmax = sc->t_max > 0 ? (double)sc->t_max : T;
        return sc->eta_min + (eta - sc->eta_min) * 0.5 * (1.0 + cos(M_PI * x / tmax));
    }
    if (s < sc->warmup_steps) return sc->warmup_lr_init + (eta - sc->warmup_lr_init) * x / W;
    switch (sc->type) {
    case HT_LR_CONSTANT_WARMUP: return eta;
    case HT_LR_CONSTANT_COOLDOWN: return constant_cooldown(sc, s);
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
        /* No clamp at W + D: docs/NUMERICS.md's formula as written (only s > T ends at lr_end). */
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
