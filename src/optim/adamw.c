/* AdamW with PyTorch semantics (docs/NUMERICS.md): decoupled weight decay, bias
 * correction, eps added after the bias-corrected square root. One fused pass
 * per parameter reads g, m, v, p and writes m, v, p and the model copy (or,
 * without an FP32 main param, reads and writes the model copy alone). */
#include "hypertrain/optim.h"

#include <fnmatch.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#include "hypertrain/kernels.h"

bool ht_glob_match(const char *pattern, const char *name) { return fnmatch(pattern, name, 0) == 0; }

void ht_megatron_name(const char *name, char *out, size_t n) {
    static const char *const renames[][2] = {
        {"model.embed_tokens", "embedding.word_embeddings"},
        {"model.layers.", "decoder.layers."},
        {"self_attn.q_proj", "self_attention.linear_qkv"},
        {"self_attn.k_proj", "self_attention.linear_qkv"},
        {"self_attn.v_proj", "self_attention.linear_qkv"},
        {"self_attn.o_proj", "self_attention.linear_proj"},
        {"mlp.gate_proj", "mlp.linear_fc1"},
        {"mlp.up_proj", "mlp.linear_fc1"},
        {"mlp.down_proj", "mlp.linear_fc2"},
        {"post_attention_layernorm", "pre_mlp_layernorm"},
        {"model.norm", "decoder.final_layernorm"},
        {"lm_head", "output_layer"},
    };
    size_t used = 0;
    if (n == 0) return;
    while (*name && used + 1 < n) {
        size_t r = 0, count = sizeof(renames) / sizeof(renames[0]);
        while (r < count && strncmp(name, renames[r][0], strlen(renames[r][0])) != 0) r++;
        if (r < count) {
            int w = snprintf(out + used, n - used, "%s", renames[r][1]);
            used += (size_t)w < n - used ? (size_t)w : n - used - 1;
            name += strlen(renames[r][0]);
        } else {
            out[used++] = *name++;
        }
    }
    out[used] = '\0';
}

bool ht_name_match(const char *pattern, const char *name) {
    char other[HT_PARAM_NAME_MAX * 2];
    ht_megatron_name(name, other, sizeof(other));
    if (strpbrk(pattern, "*?[")) return fnmatch(pattern, name, 0) == 0 || fnmatch(pattern, other, 0) == 0;
    return strstr(name, pattern) != NULL || strstr(other, pattern) != NULL;
}

void ht_adamw_update(float *p, const float *g, float *m, float *v, int64_t n, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, void *model, ht_dtype model_dtype) {
    const ht_adamw_hparams h = {step, lr, beta1, beta2, eps, weight_decay};
    ht_kernels()->adamw_pass(p, g, m, v, n, &h, model, model_dtype, false, 0);
}

ht_status ht_adamw_init(ht_adamw *opt, const ht_adamw_config *cfg, ht_param **params, int count,
                        const char *const *no_wd, int no_wd_count, ht_error *err) {
    memset(opt, 0, sizeof(*opt));
    opt->config = *cfg;
    for (int i = 0; i < count; i++) {
        const ht_param *p = params[i];
        if (!p->main_grad) return ht_fail(err, HT_ERR_INVALID, "AdamW: parameter %s has no FP32 main grad", p->name);
        /* A bf16/f16 param may have none (updated in its own dtype); a float32 one is its own. */
        if (!p->main_param && p->dtype != HT_DTYPE_BF16 && p->dtype != HT_DTYPE_F16)
            return ht_fail(err, HT_ERR_INVALID,
                           "AdamW: parameter %s (%s) has no main param; only a bfloat16 or float16 param may go "
                           "without one",
                           p->name, ht_dtype_name(p->dtype));
    }
    opt->slots = ht_alloc((size_t)(count > 0 ? count : 1) * sizeof(ht_adamw_slot));
    if (!opt->slots) return ht_fail(err, HT_ERR_OOM, "cannot allocate AdamW slots");
    size_t floats = 0;
    for (int i = 0; i < count; i++) floats += 2 * (size_t)ht_param_local_numel(params[i]);
    opt->state_block = ht_kernels()->alloc((floats > 0 ? floats : 1) * sizeof(float));
    if (!opt->state_block) {
        ht_free(opt->slots);
        opt->slots = NULL;
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes of AdamW state", floats * sizeof(float));
    }
    float *next = opt->state_block; /* exp_avg (n) then exp_avg_sq (n), param after param */
    for (int i = 0; i < count; i++) {
        ht_param *p = params[i];
        ht_adamw_slot *s = &opt->slots[opt->count++];
        s->param = p;
        s->weight_decay = cfg->weight_decay;
        for (int k = 0; k < no_wd_count; k++)
            if (ht_name_match(no_wd[k], p->name)) s->weight_decay = 0.0;
        int64_t n = ht_param_local_numel(p);
        s->exp_avg = next;
        s->exp_avg_sq = next + n;
        next += 2 * n;
    }
    return HT_OK;
}

/* One block of a residual16 param's main params (ht_param_main_pass): the
 * pass of an FP32 param, whose values are written back to the weight after. */
typedef struct residual_step {
    const ht_adamw_slot *slot;
    const ht_adamw_hparams *h;
} residual_step;

static void residual_block(float *x, int64_t at, int64_t len, void *ctx) {
    const residual_step *r = ctx;
    const ht_adamw_slot *s = r->slot;
    ht_kernels()->adamw_pass(x, s->param->main_grad + at, s->exp_avg + at, s->exp_avg_sq + at, len, r->h, NULL,
                             HT_DTYPE_F32, false, 0);
}

void ht_adamw_step(ht_adamw *opt, double lr) {
    const ht_adamw_config *c = &opt->config;
    for (int i = 0; i < opt->count; i++) {
        ht_adamw_slot *s = &opt->slots[i];
        ht_param *p = s->param;
        s->step++;
        bool separate = (void *)p->main_param != p->data;
        const ht_adamw_hparams h = {s->step, lr, c->beta1, c->beta2, c->eps, s->weight_decay};
        if (p->main_low) {
            ht_param_main_pass(p, 0, ht_param_local_numel(p), residual_block, &(residual_step){s, &h});
            continue;
        }
        ht_kernels()->adamw_pass(p->main_param, p->main_grad, s->exp_avg, s->exp_avg_sq, ht_param_local_numel(p), &h,
                                 separate ? p->data : NULL, p->dtype, opt->rounding.stochastic,
                                 opt->rounding.stochastic ? ht_rounding_stream(&opt->rounding, p->name) : 0);
    }
}

void ht_adamw_free(ht_adamw *opt) {
    ht_kernels()->free(opt->state_block);
    ht_free(opt->slots);
    memset(opt, 0, sizeof(*opt));
}
