/* TEMPORARY stub until the Muon branch lands (not committed). */
#include "hypertrain/optim.h"
#include <stdlib.h>
ht_status ht_ns_schedule_expand(ht_ns_variant variant, int ns_steps, const ht_ns_segment *segments, int segment_count,
                                ht_ns_schedule *out, ht_error *err) {
    (void)variant; (void)segments; (void)segment_count; (void)err;
    out->steps = ns_steps;
    for (int k = 0; k < ns_steps; k++) { out->coeffs[k][0] = 3.4445; out->coeffs[k][1] = -4.775; out->coeffs[k][2] = 2.0315; }
    return HT_OK;
}
ht_status ht_muon_init(ht_muon *opt, const ht_muon_config *cfg, ht_param **params, int count, ht_error *err) {
    (void)err;
    opt->config = *cfg;
    opt->slots = calloc((size_t)count + 1, sizeof(ht_muon_slot));
    opt->count = count;
    for (int i = 0; i < count; i++) opt->slots[i].param = params[i];
    return HT_OK;
}
void ht_muon_step(ht_muon *opt, double lr) {
    for (int i = 0; i < opt->count; i++) {
        ht_param *p = opt->slots[i].param;
        for (int64_t k = 0; k < ht_param_local_numel(p); k++) p->main_param[k] -= (float)lr * (p->main_grad[k] > 0 ? 1.f : -1.f);
        if ((void *)p->main_param != p->data) ht_convert(p->data, p->dtype, p->main_param, HT_DTYPE_F32, (size_t)ht_param_local_numel(p));
    }
}
void ht_muon_free(ht_muon *opt) { free(opt->slots); }
const char *ht_ns_variant_name(ht_ns_variant v) { (void)v; return "stub"; }
