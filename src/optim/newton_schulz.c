/* Newton-Schulz orthogonalization for Muon: the coefficient schedules and
 * their expansion into one (a, b, c) per iteration; the iteration itself is
 * a kernel (ht_kernels()->ns_iterate, kernels/cpu/optim.c). */
#include "hypertrain/kernels.h"
#include "hypertrain/optim.h"

#include <math.h>
#include <string.h>

#define NS_STEPS_KEY "optimizer.muon_config.muon_ns_steps"
#define NS_COEFFS_KEY "optimizer.muon_config.muon_ns_coefficients"

/* docs/NUMERICS.md, Muon: the tables of coefficients. */
static const double LEGACY[3] = {3.4445, -4.7750, 2.0315};
static const double ASYM5[5][3] = {{4.0848, -6.8946, 2.9270},
                                   {3.9505, -6.3029, 2.6377},
                                   {3.7418, -5.5913, 2.3037},
                                   {2.8769, -3.1427, 1.2046},
                                   {2.8366, -3.0525, 1.2012}};
static const double POLAR_EXPRESS[5][3] = {{8.156554524902461, -22.48329292557795, 15.878769915207462},
                                           {4.042929935166739, -2.808917465908714, 0.5000178451051316},
                                           {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
                                           {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
                                           {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};
static const double DEEPSEEK_V4_TAIL[3] = {2.0, -1.5, 0.5};

static const char *const VARIANT_NAMES[HT_NS_VARIANT_COUNT] = {"legacy", "asym5", "polar_express", "deepseek_v4",
                                                               "custom"};

const char *ht_ns_variant_name(ht_ns_variant variant) {
    return variant >= 0 && variant < HT_NS_VARIANT_COUNT ? VARIANT_NAMES[variant] : "unknown";
}

bool ht_ns_variant_from_name(const char *name, ht_ns_variant *out) {
    for (int v = 0; v < HT_NS_VARIANT_COUNT; v++)
        if (strcmp(name, VARIANT_NAMES[v]) == 0) {
            *out = (ht_ns_variant)v;
            return true;
        }
    return false;
}

static void push(ht_ns_schedule *s, const double abc[3]) { memcpy(s->coeffs[s->steps++], abc, sizeof(s->coeffs[0])); }

static ht_status expand_custom(int ns_steps, const ht_ns_segment *segments, int count, ht_ns_schedule *out,
                               ht_error *err) {
    if (!segments || count < 1)
        return ht_fail(err, HT_ERR_CONFIG, "%s: expected coefficients with muon_ns_variant custom, found none",
                       NS_COEFFS_KEY);
    int64_t total = 0;
    for (int i = 0; i < count; i++) {
        const ht_ns_segment *seg = &segments[i];
        for (int j = 0; j < 3; j++)
            if (!isfinite(seg->abc[j]))
                return ht_fail(err, HT_ERR_CONFIG, "%s: segment %d has a non-finite coefficient (%g, %g, %g)",
                               NS_COEFFS_KEY, i, seg->abc[0], seg->abc[1], seg->abc[2]);
        /* repeat 0 is the flat [a, b, c] form, which only stands alone. */
        if (seg->repeat < 0 || (seg->repeat == 0 && count > 1))
            return ht_fail(err, HT_ERR_CONFIG, "%s: segment %d repeats %d times; expected >= 1 ([[a, b, c], n])",
                           NS_COEFFS_KEY, i, seg->repeat);
        total += seg->repeat == 0 ? ns_steps : seg->repeat;
    }
    if (total < ns_steps)
        return ht_fail(err, HT_ERR_CONFIG, "%s: the schedule has %lld iterations, shorter than %s = %d", NS_COEFFS_KEY,
                       (long long)total, NS_STEPS_KEY, ns_steps);
    if (total > HT_NS_MAX_STEPS)
        return ht_fail(err, HT_ERR_CONFIG, "%s: the schedule has %lld iterations; at most %d are supported",
                       NS_COEFFS_KEY, (long long)total, HT_NS_MAX_STEPS);
    for (int i = 0; i < count; i++) {
        int n = segments[i].repeat == 0 ? ns_steps : segments[i].repeat;
        for (int k = 0; k < n; k++) push(out, segments[i].abc);
    }
    return HT_OK;
}

ht_status ht_ns_schedule_expand(ht_ns_variant variant, int ns_steps, const ht_ns_segment *segments, int segment_count,
                                ht_ns_schedule *out, ht_error *err) {
    memset(out, 0, sizeof(*out));
    if (ns_steps < 1)
        return ht_fail(err, HT_ERR_CONFIG, "%s: expected an integer >= 1, found %d", NS_STEPS_KEY, ns_steps);
    if (ns_steps > HT_NS_MAX_STEPS && variant != HT_NS_DEEPSEEK_V4 && variant != HT_NS_CUSTOM)
        return ht_fail(err, HT_ERR_CONFIG, "%s: expected at most %d, found %d", NS_STEPS_KEY, HT_NS_MAX_STEPS,
                       ns_steps);
    switch (variant) {
    case HT_NS_LEGACY:
        for (int k = 0; k < ns_steps; k++) push(out, LEGACY);
        return HT_OK;
    case HT_NS_ASYM5:
        /* Five triples: a sixth iteration would silently be none (docs/NUMERICS.md). */
        if (ns_steps > 5)
            return ht_fail(err, HT_ERR_CONFIG, "%s: expected at most 5 with muon_ns_variant asym5, found %d",
                           NS_STEPS_KEY, ns_steps);
        for (int k = 0; k < ns_steps; k++) push(out, ASYM5[k]);
        return HT_OK;
    case HT_NS_POLAR_EXPRESS:
        for (int k = 0; k < ns_steps; k++) push(out, POLAR_EXPRESS[k < 5 ? k : 4]);
        return HT_OK;
    case HT_NS_DEEPSEEK_V4:
        for (int k = 0; k < 8; k++) push(out, LEGACY);
        for (int k = 0; k < 2; k++) push(out, DEEPSEEK_V4_TAIL);
        return HT_OK;
    case HT_NS_CUSTOM: return expand_custom(ns_steps, segments, segment_count, out, err);
    default: return ht_fail(err, HT_ERR_CONFIG, "optimizer.muon_config.muon_ns_variant: unknown variant %d", variant);
    }
}

size_t ht_newton_schulz_workspace(int64_t rows, int64_t cols, const ht_ns_schedule *sched, ht_dtype ns_dtype) {
    return ht_kernels()->ns_workspace_floats(1, rows, cols, ns_dtype, sched->form);
}

void ht_newton_schulz(const float *G, float *O, int64_t rows, int64_t cols, const ht_ns_schedule *sched, double eps,
                      ht_dtype ns_dtype, float *work) {
    ht_newton_schulz_batch(G, O, 1, rows, cols, sched, eps, ns_dtype, work);
}

void ht_newton_schulz_batch(const float *G, float *O, int64_t count, int64_t rows, int64_t cols,
                            const ht_ns_schedule *sched, double eps, ht_dtype ns_dtype, float *work) {
    ht_kernels()->ns_iterate(G, O, count, rows, cols, sched->coeffs, sched->steps, eps, ns_dtype, sched->form, work);
}
