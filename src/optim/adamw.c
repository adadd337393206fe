/* AdamW with PyTorch semantics (NUMERICS.md): decoupled weight decay, bias
 * correction, eps added after the bias-corrected square root. One fused pass
 * per parameter reads g, m, v, p and writes m, v, p and the model copy (or,
 * without an FP32 main param, reads and writes the model copy alone). */
#include "hypertrain/optim.h"

#include <fnmatch.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <string.h>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

/* Each rounding step below is one step of PyTorch's fused CPU AdamW kernel
 * (torch.optim.AdamW(fused=True)), whose results these match bit for bit as
 * measured; torch's single-tensor path differs from both by one ulp of sqrt
 * on about a fifth of the elements. So the compiler must not
 * fuse a multiply into the following add: the only FMAs are the ones torch's
 * kernel uses (lerp, addcmul). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-math-errno")
#endif

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

/* The per-call scalars, computed once in double as PyTorch does on the host,
 * then rounded to FP32 as its kernels do. */
typedef struct adamw_scalars {
    float decay;    /* 1 − lr·wd */
    float w1;       /* 1 − β1: exp_avg.lerp_(g, 1 − β1) */
    float b2, c2;   /* β2 and 1 − β2: exp_avg_sq.mul_(β2).addcmul_(g, g, 1 − β2) */
    float bc2_sqrt; /* sqrt(1 − β2^t) */
    float eps;      /* added after the division by bc2_sqrt */
    float neg_step; /* −lr / (1 − β1^t): p.addcdiv_(m, denom, −step_size) */
} adamw_scalars;

/* One element (NUMERICS.md, AdamW), written as torch's op sequence:
 *   p ← p·decay;  m ← m + (1−β1)(g − m) (one FMA);  v ← fma((1−β2)g, g, β2·v);
 *   d = sqrt(v)/bc2_sqrt + eps;  p ← p + (−step_size·m)/d.
 * The vector path below performs the same roundings in the same order. */
static inline float adamw_element(float *p, float g, float *m, float *v, const adamw_scalars *k) {
    float pd = *p * k->decay;
    float mi = fmaf(k->w1, g - *m, *m);
    float vi = fmaf(k->c2 * g, g, *v * k->b2);
    float d = sqrtf(vi) / k->bc2_sqrt + k->eps;
    float pi = pd + (k->neg_step * mi) / d;
    *m = mi;
    *v = vi;
    *p = pi;
    return pi;
}

static inline void store_model(void *model, ht_dtype dtype, int64_t i, float x) {
    ((uint16_t *)model)[i] = dtype == HT_DTYPE_BF16 ? ht_f32_to_bf16(x) : ht_f32_to_f16(x);
}

#ifdef __AVX512F__
/* ht_f32_to_bf16 on 16 lanes: round to nearest even by integer add; NaN stays quiet NaN. */
static inline __m256i bf16_round16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
}

static inline __m512 adamw_vec16(float *p, const float *g, float *m, float *v, const adamw_scalars *k) {
    __m512 gi = _mm512_loadu_ps(g), mi = _mm512_loadu_ps(m), vi = _mm512_loadu_ps(v);
    __m512 pd = _mm512_mul_ps(_mm512_loadu_ps(p), _mm512_set1_ps(k->decay));
    mi = _mm512_fmadd_ps(_mm512_set1_ps(k->w1), _mm512_sub_ps(gi, mi), mi);
    vi = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(k->c2), gi), gi, _mm512_mul_ps(vi, _mm512_set1_ps(k->b2)));
    __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(k->bc2_sqrt)), _mm512_set1_ps(k->eps));
    __m512 pi = _mm512_add_ps(pd, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(k->neg_step), mi), d));
    _mm512_storeu_ps(m, mi);
    _mm512_storeu_ps(v, vi);
    _mm512_storeu_ps(p, pi);
    return pi;
}
#endif

/* Model copies at least this large bypass the cache on the way out (they are
 * not read again until the next forward pass). */
#define STREAM_MIN_BYTES (1 << 20)

/* Elements [lo, hi) of one parameter. */
static void adamw_range(float *p, const float *g, float *m, float *v, int64_t lo, int64_t hi, const adamw_scalars *k,
                        void *model, ht_dtype dtype) {
    int64_t i = lo;
#ifdef __AVX512F__
    if (!model) {
        for (; i + 16 <= hi; i += 16) adamw_vec16(p + i, g + i, m + i, v + i, k);
    } else if (dtype == HT_DTYPE_BF16 || dtype == HT_DTYPE_F16) {
        uint16_t *out = model;
        bool stream = (hi - lo) * 2 >= STREAM_MIN_BYTES;
        /* Scalar head up to a 32-byte boundary of the model copy, for the streaming stores. */
        if (stream)
            for (; i < hi && ((uintptr_t)(out + i) & 31) != 0; i++)
                store_model(model, dtype, i, adamw_element(&p[i], g[i], &m[i], &v[i], k));
        for (; i + 16 <= hi; i += 16) {
            __m512 x = adamw_vec16(p + i, g + i, m + i, v + i, k);
            __m256i h = dtype == HT_DTYPE_BF16 ? bf16_round16(x)
                                               : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            if (stream)
                _mm256_stream_si256((__m256i *)(out + i), h);
            else
                _mm256_storeu_si256((__m256i *)(out + i), h);
        }
        if (stream) _mm_sfence();
    }
#endif
    for (; i < hi; i++) {
        float x = adamw_element(&p[i], g[i], &m[i], &v[i], k);
        if (model) store_model(model, dtype, i, x);
    }
}

/* A param without an FP32 main param goes through FP32 scratch in blocks
 * of this many elements (4 KiB a thread, on its stack). */
#define MODEL_BLOCK 1024

/* Elements [lo, hi) of one parameter, rounded into the model copy as `r`
 * says (NULL: to nearest, fused into the update). p NULL: the model copy
 * holds the values: each block is widened (exactly), updated as p would be
 * and rounded back. */
static void adamw_pass(float *p, const float *g, float *m, float *v, int64_t lo, int64_t hi, const adamw_scalars *k,
                       void *model, ht_dtype dtype, const ht_rounding *r, uint64_t stream) {
    uint16_t *out = model;
    if (p && (!model || !r || !r->stochastic)) {
        adamw_range(p, g, m, v, lo, hi, k, model, dtype);
    } else if (p) {
        adamw_range(p, g, m, v, lo, hi, k, NULL, dtype);
        ht_convert_stochastic_at(out + lo, dtype, p + lo, (size_t)(hi - lo), stream, (size_t)lo);
    } else {
        _Alignas(64) float x[MODEL_BLOCK];
        for (int64_t b = lo; b < hi; b += MODEL_BLOCK) {
            int64_t n = hi - b < MODEL_BLOCK ? hi - b : MODEL_BLOCK;
            ht_convert(x, HT_DTYPE_F32, out + b, dtype, (size_t)n);
            if (r && r->stochastic) {
                adamw_range(x, g + b, m + b, v + b, 0, n, k, NULL, dtype);
                ht_convert_stochastic_at(out + b, dtype, x, (size_t)n, stream, (size_t)b);
            } else {
                adamw_range(x, g + b, m + b, v + b, 0, n, k, out + b, dtype);
            }
        }
    }
}

static void adamw_update(float *p, const float *g, float *m, float *v, int64_t n, int64_t step, double lr, double beta1,
                         double beta2, double eps, double weight_decay, void *model, ht_dtype model_dtype,
                         const ht_rounding *r, uint64_t stream) {
    const adamw_scalars k = {
        .decay = (float)(1.0 - lr * weight_decay),
        .w1 = (float)(1.0 - beta1),
        .b2 = (float)beta2,
        .c2 = (float)(1.0 - beta2),
        .bc2_sqrt = (float)sqrt(1.0 - pow(beta2, (double)step)),
        .eps = (float)eps,
        .neg_step = (float)(-(lr / (1.0 - pow(beta1, (double)step)))),
    };
    if (model_dtype != HT_DTYPE_BF16 && model_dtype != HT_DTYPE_F16) model = NULL;
    /* p NULL with no bf16/f16 copy: nothing holds the values (ht_adamw_init refuses such a param). */
    if (!p && !model) return;
        /* Static split in 64-element blocks: every thread's range starts on a
         * cache line of p, g, m, v (and of a bf16/f16 copy) when the base does. */
#pragma omp parallel if (n >= 65536)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t chunk = ((n + nt - 1) / nt + 63) & ~(int64_t)63;
        int64_t lo = chunk * t < n ? chunk * t : n;
        int64_t hi = lo + chunk < n ? lo + chunk : n;
        adamw_pass(p, g, m, v, lo, hi, &k, model, model_dtype, r, stream);
    }
}

void ht_adamw_update(float *p, const float *g, float *m, float *v, int64_t n, int64_t step, double lr, double beta1,
                     double beta2, double eps, double weight_decay, void *model, ht_dtype model_dtype) {
    adamw_update(p, g, m, v, n, step, lr, beta1, beta2, eps, weight_decay, model, model_dtype, NULL, 0);
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
    opt->state_block = ht_alloc((floats > 0 ? floats : 1) * sizeof(float));
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

void ht_adamw_step(ht_adamw *opt, double lr) {
    const ht_adamw_config *c = &opt->config;
    for (int i = 0; i < opt->count; i++) {
        ht_adamw_slot *s = &opt->slots[i];
        ht_param *p = s->param;
        s->step++;
        bool separate = (void *)p->main_param != p->data;
        adamw_update(p->main_param, p->main_grad, s->exp_avg, s->exp_avg_sq, ht_param_local_numel(p), s->step, lr,
                     c->beta1, c->beta2, c->eps, s->weight_decay, separate ? p->data : NULL, p->dtype, &opt->rounding,
                     opt->rounding.stochastic ? ht_rounding_stream(&opt->rounding, p->name) : 0);
    }
}

void ht_adamw_free(ht_adamw *opt) {
    ht_free(opt->state_block);
    ht_free(opt->slots);
    memset(opt, 0, sizeof(*opt));
}
