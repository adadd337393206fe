/* The optimizer layer against PyTorch and docs/NUMERICS.md: AdamW (FP32, and
 * Megatron-style bf16 model + FP32 master) vs torch.optim.AdamW for 10
 * steps, the fused kernel's vector, scalar and threaded paths bit for bit
 * (and without an FP32 main param, as with one), no_weight_decay routing, the LR schedules vs an independent Python
 * table, and clipping vs torch.nn.utils.clip_grad_norm_. Fixtures: tests/fixtures/optim, written by
 * tools/reference/make_optim_fixtures.py. */
#include "harness.h"

#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/optim.h"

#define STEPS 10
#define SAMPLE 32 /* per-step snapshots keep every 32nd element; step 10 is whole */

/* The fixture's gradients (make_optim_fixtures.py, grad_values): exact in FP32. */
static uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ULL;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

static void grad_values(float *g, int64_t n, uint64_t tensor_id, uint64_t step) {
    for (int64_t i = 0; i < n; i++) {
        uint64_t h = splitmix64(tensor_id << 48 | step << 32 | (uint64_t)i);
        int64_t k = (int64_t)(h >> 40) - (1 << 23);
        g[i] = ldexpf((float)k, -(23 + (int)(h & 7)));
    }
}

static const ht_st_tensor *need(const ht_safetensors *st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static const ht_st_tensor *need(const ht_safetensors *st, const char *fmt, ...) {
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof(name), fmt, ap);
    va_end(ap);
    const ht_st_tensor *t = ht_safetensors_find(st, name);
    if (!t) fail_msg("fixture %s has no tensor %s", ht_safetensors_path(st), name);
    return t;
}

/* rel_max_err of x against a snapshot: whole at the last step, else every SAMPLE-th element. */
static double snapshot_err(const float *x, int64_t n, const ht_st_tensor *ref, int step) {
    if (step == STEPS) {
        assert_int_equal(ref->nbytes, (size_t)n * 4);
        return rel_max_err(x, ref->data, (size_t)n);
    }
    int64_t k = (n + SAMPLE - 1) / SAMPLE;
    assert_int_equal(ref->nbytes, (size_t)k * 4);
    float *picked = malloc((size_t)k * sizeof(float));
    for (int64_t i = 0; i < k; i++) picked[i] = x[i * SAMPLE];
    double e = rel_max_err(picked, ref->data, (size_t)k);
    free(picked);
    return e;
}

static double meta_double(const ht_safetensors *st, const char *key) {
    const char *s = ht_safetensors_metadata_get(st, key);
    if (!s) fail_msg("fixture metadata has no %s", key);
    return strtod(s, NULL);
}

static const char *const default_no_wd[] = {"*bias*", "*norm*", "*ln_*"};

/* Builds a store from the fixture's init.<name> tensors (any shape, dtype as stored). */
static void store_from_fixture(ht_param_store *ps, const ht_safetensors *st, const char *const *names, int count) {
    ht_error err;
    memset(ps, 0, sizeof(*ps));
    for (int i = 0; i < count; i++) {
        const ht_st_tensor *t = need(st, "init.%s", names[i]);
        assert_non_null(ht_params_add(ps, names[i], t->ndim, t->shape, t->dtype));
    }
    assert_ht_ok(ht_params_allocate(ps, &err), &err);
    for (int i = 0; i < count; i++) {
        const ht_st_tensor *t = need(st, "init.%s", names[i]);
        memcpy(ps->items[i].data, t->data, t->nbytes);
    }
    assert_ht_ok(ht_params_create_main(ps, HT_MAIN_COPY, &err), &err);
}

static void make_optimizer(ht_adamw *opt, ht_param_store *ps, const ht_safetensors *st) {
    ht_error err;
    ht_adamw_config cfg = {.lr = meta_double(st, "lr"),
                           .beta1 = meta_double(st, "beta1"),
                           .beta2 = meta_double(st, "beta2"),
                           .eps = meta_double(st, "eps"),
                           .weight_decay = meta_double(st, "weight_decay")};
    ht_param *list[16];
    for (int i = 0; i < ps->count; i++) list[i] = &ps->items[i];
    assert_ht_ok(ht_adamw_init(opt, &cfg, list, ps->count, default_no_wd, 3, &err), &err);
}

static const char *const fp32_names[] = {
    "model.layers.0.mlp.up_proj.weight",      "model.layers.0.mlp.down_proj.weight",
    "model.layers.1.self_attn.o_proj.weight", "model.layers.1.mlp.experts.weight",
    "model.layers.0.self_attn.q_proj.bias",   "model.norm.weight",
};

/* 10 steps of AdamW on FP32 params vs torch.optim.AdamW: params and both moments. */
static void test_adamw_fp32_vs_torch(void **state) {
    (void)state;
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/adamw_fp32.safetensors"), &st, &err), &err);
    ht_param_store ps;
    store_from_fixture(&ps, st, fp32_names, 6);
    ht_adamw opt;
    make_optimizer(&opt, &ps, st);
    double lr = meta_double(st, "lr"), worst[3] = {0, 0, 0};
    const char *what[3] = {"param", "exp_avg", "exp_avg_sq"};
    for (int t = 1; t <= STEPS; t++) {
        for (int k = 0; k < ps.count; k++)
            grad_values(ps.items[k].main_grad, ht_param_local_numel(&ps.items[k]), (uint64_t)k, (uint64_t)t);
        ht_adamw_step(&opt, lr);
        for (int k = 0; k < opt.count; k++) {
            const ht_adamw_slot *s = &opt.slots[k];
            int64_t n = ht_param_local_numel(s->param);
            double e[3] = {snapshot_err(s->param->main_param, n, need(st, "p.%d.%s", t, s->param->name), t),
                           snapshot_err(s->exp_avg, n, need(st, "m.%d.%s", t, s->param->name), t),
                           snapshot_err(s->exp_avg_sq, n, need(st, "v.%d.%s", t, s->param->name), t)};
            for (int j = 0; j < 3; j++) {
                if (e[j] > 1e-6) fail_msg("step %d %s: %s rel err %.3g > 1e-6", t, s->param->name, what[j], e[j]);
                if (e[j] > worst[j]) worst[j] = e[j];
            }
        }
    }
    printf("# AdamW fp32 vs torch, 10 steps: max rel err p %.3g, exp_avg %.3g, exp_avg_sq %.3g\n", worst[0], worst[1],
           worst[2]);
    ht_adamw_free(&opt);
    ht_params_free(&ps);
    ht_safetensors_close(st);
}

static const char *const bf16_names[] = {"model.layers.0.mlp.gate_proj.weight",
                                         "model.layers.0.input_layernorm.weight"};

/* bf16 model + FP32 master (Megatron): the master within 1e-6 of torch's, the
 * bf16 params bitwise equal to the reference's cast, and to the cast of our
 * own master (the fused cast back is exact). */
static void test_adamw_bf16_master_vs_torch(void **state) {
    (void)state;
    ht_error err;
    ht_safetensors *st, *st32;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/adamw_bf16.safetensors"), &st, &err), &err);
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/adamw_fp32.safetensors"), &st32, &err), &err);
    ht_param_store ps;
    store_from_fixture(&ps, st, bf16_names, 2);
    for (int k = 0; k < ps.count; k++) {
        assert_int_equal(ps.items[k].dtype, HT_DTYPE_BF16);
        assert_ptr_not_equal(ps.items[k].main_param, ps.items[k].data);
    }
    ht_adamw opt;
    make_optimizer(&opt, &ps, st32); /* the same hyperparameters */
    assert_true(opt.slots[0].weight_decay > 0);
    assert_true(opt.slots[1].weight_decay == 0.0); /* input_layernorm: *norm* */
    double lr = meta_double(st32, "lr"), worst = 0;
    for (int t = 1; t <= STEPS; t++) {
        for (int k = 0; k < ps.count; k++)
            grad_values(ps.items[k].main_grad, ht_param_local_numel(&ps.items[k]), 100 + (uint64_t)k, (uint64_t)t);
        ht_adamw_step(&opt, lr);
        for (int k = 0; k < ps.count; k++) {
            const ht_param *p = &ps.items[k];
            int64_t n = ht_param_local_numel(p);
            double e = snapshot_err(p->main_param, n, need(st, "master.%d.%s", t, p->name), t);
            if (e > 1e-6) fail_msg("step %d %s: master rel err %.3g > 1e-6", t, p->name, e);
            if (e > worst) worst = e;
            const ht_st_tensor *ref = need(st, "bf16.%d.%s", t, p->name);
            assert_int_equal(ref->dtype, HT_DTYPE_BF16);
            const uint16_t *want = ref->data, *got = p->data;
            for (int64_t i = 0; i < n; i++) {
                if (got[i] != ht_f32_to_bf16(p->main_param[i]))
                    fail_msg("step %d %s[%lld]: bf16 0x%04x is not the cast of the master %a", t, p->name, (long long)i,
                             got[i], (double)p->main_param[i]);
                if (got[i] != want[i])
                    fail_msg("step %d %s[%lld]: bf16 0x%04x, torch 0x%04x", t, p->name, (long long)i, got[i], want[i]);
            }
        }
    }
    printf("# AdamW bf16 + FP32 master vs torch, 10 steps: master max rel err %.3g, bf16 params bitwise equal\n",
           worst);
    ht_adamw_free(&opt);
    ht_params_free(&ps);
    ht_safetensors_close(st);
    ht_safetensors_close(st32);
}

/* The kernel's per-element math in double with an explicit rounding to FP32
 * after every op (exact: double holds every FP32 sum, product, quotient and
 * root to within a correctly rounded result), in torch's op order. */
static float reference_element(float *p, float g, float *m, float *v, int64_t step, double lr, double b1, double b2,
                               double eps, double wd) {
    float decay = (float)(1.0 - lr * wd), w1 = (float)(1.0 - b1), fb2 = (float)b2, c2 = (float)(1.0 - b2);
    float bc2 = (float)sqrt(1.0 - pow(b2, (double)step)), feps = (float)eps;
    float neg = (float)(-(lr / (1.0 - pow(b1, (double)step))));
    float pd = (float)((double)*p * decay);
    float mi = fmaf(w1, (float)((double)g - *m), *m);
    float vi = fmaf((float)((double)c2 * g), g, (float)((double)*v * fb2));
    float q = (float)((double)sqrtf(vi) / bc2);
    float d = (float)((double)q + feps);
    float num = (float)((double)neg * mi);
    float pi = (float)((double)pd + (float)((double)num / d));
    *m = mi;
    *v = vi;
    *p = pi;
    return pi;
}

/* Vector body, scalar head and tail, streaming and plain stores, 1 and 2
 * threads, bf16 / f16 / no model copy: all bit-identical to the reference. */
static void test_adamw_kernel_bitwise(void **state) {
    (void)state;
    const int64_t sizes[] = {1, 37, 70001, 600017}; /* 600017: the bf16 copy is over 1 MB, so it streams */
    const ht_dtype dtypes[] = {HT_DTYPE_F32, HT_DTYPE_BF16, HT_DTYPE_F16};
    ht_rng rng;
    ht_rng_seed(&rng, 7);
    for (int si = 0; si < 4; si++) {
        int64_t n = sizes[si];
        float *base = malloc((size_t)n * 4 * sizeof(float) + 64);
        float *buf = malloc((size_t)(n + 1) * 4 * sizeof(float));
        float *ref = malloc((size_t)n * 3 * sizeof(float));
        uint16_t *model = malloc((size_t)(n + 1) * sizeof(uint16_t));
        for (int64_t i = 0; i < n; i++) {
            base[i] = ht_rng_normal(&rng);                                         /* p */
            base[n + i] = ht_rng_normal(&rng) * ldexpf(1.0f, -(int)(i % 20));      /* g */
            base[2 * n + i] = ht_rng_normal(&rng) * 0.1f;                          /* m */
            base[3 * n + i] = ht_rng_uniform(&rng) * ldexpf(1.0f, -(int)(i % 30)); /* v */
        }
        for (int di = 0; di < 3; di++) {
            for (int threads = 1; threads <= 2; threads++) {
                omp_set_num_threads(threads);
                /* Offsets by one element: unaligned p, g, m, v and model copy. */
                int off = (threads == 2 && di > 0) ? 1 : 0;
                float *p = buf + off, *g = p + n, *m = g + n, *v = m + n;
                memcpy(p, base, (size_t)n * 4 * sizeof(float));
                memcpy(ref, base, (size_t)n * sizeof(float));
                memcpy(ref + n, base + 2 * n, (size_t)n * 2 * sizeof(float));
                uint16_t *out = model + off;
                ht_adamw_update(p, g, m, v, n, 3, 1e-3, 0.9, 0.999, 1e-8, 0.1, di ? out : NULL, dtypes[di]);
                for (int64_t i = 0; i < n; i++) {
                    float pr = reference_element(&ref[i], base[n + i], &ref[n + i], &ref[2 * n + i], 3, 1e-3, 0.9,
                                                 0.999, 1e-8, 0.1);
                    if (memcmp(&p[i], &pr, 4) || memcmp(&m[i], &ref[n + i], 4) || memcmp(&v[i], &ref[2 * n + i], 4))
                        fail_msg("n %lld, %s, %d threads, element %lld: p %a m %a v %a, reference %a %a %a",
                                 (long long)n, ht_dtype_name(dtypes[di]), threads, (long long)i, (double)p[i],
                                 (double)m[i], (double)v[i], (double)pr, (double)ref[n + i], (double)ref[2 * n + i]);
                    if (di) {
                        uint16_t want = dtypes[di] == HT_DTYPE_BF16 ? ht_f32_to_bf16(pr) : ht_f32_to_f16(pr);
                        if (out[i] != want)
                            fail_msg("n %lld, %s, %d threads, element %lld: model 0x%04x, want 0x%04x", (long long)n,
                                     ht_dtype_name(dtypes[di]), threads, (long long)i, out[i], want);
                    }
                }
            }
        }
        free(base);
        free(buf);
        free(ref);
        free(model);
    }
    omp_set_num_threads(2);
}

/* p NULL: the bf16/f16 copy is the param, widened and rounded back block
 * by block; the same bits as an FP32 p loaded from it, for sizes around the
 * block and the thread split, 1 and 2 threads, unaligned buffers. */
static void test_adamw_kernel_without_main_param(void **state) {
    (void)state;
    const int64_t sizes[] = {1, 1023, 1025, 70001, 600017};
    const ht_dtype dtypes[] = {HT_DTYPE_BF16, HT_DTYPE_F16};
    ht_rng rng;
    ht_rng_seed(&rng, 13);
    for (int si = 0; si < 5; si++) {
        int64_t n = sizes[si];
        float *p = malloc((size_t)n * sizeof(float)), *g = malloc((size_t)n * sizeof(float));
        float *m = malloc((size_t)n * 4 * sizeof(float)), *v = m + 2 * n;
        uint16_t *with = malloc((size_t)(n + 1) * 2), *without = malloc((size_t)(n + 1) * 2);
        for (int di = 0; di < 2; di++)
            for (int threads = 1; threads <= 2; threads++) {
                omp_set_num_threads(threads);
                uint16_t *a = with, *b = without + (threads == 2); /* one of them unaligned */
                for (int64_t i = 0; i < n; i++) {
                    float x = ht_rng_normal(&rng) * 0.05f;
                    a[i] = b[i] = dtypes[di] == HT_DTYPE_BF16 ? ht_f32_to_bf16(x) : ht_f32_to_f16(x);
                    g[i] = ht_rng_normal(&rng) * ldexpf(1.0f, -(int)(i % 20));
                    m[i] = m[n + i] = ht_rng_normal(&rng) * 0.01f;
                    v[i] = v[n + i] = ht_rng_uniform(&rng) * 1e-4f;
                }
                ht_convert(p, HT_DTYPE_F32, a, dtypes[di], (size_t)n);
                ht_adamw_update(p, g, m, v, n, 4, 1e-3, 0.9, 0.999, 1e-8, 0.1, a, dtypes[di]);
                ht_adamw_update(NULL, g, m + n, v + n, n, 4, 1e-3, 0.9, 0.999, 1e-8, 0.1, b, dtypes[di]);
                if (memcmp(a, b, (size_t)n * 2) || memcmp(m, m + n, (size_t)n * 4) || memcmp(v, v + n, (size_t)n * 4))
                    fail_msg("n %lld, %s, %d threads: without a main param the update differs", (long long)n,
                             ht_dtype_name(dtypes[di]), threads);
            }
        free(p);
        free(g);
        free(m);
        free(with);
        free(without);
    }
    omp_set_num_threads(2);
}

/* no_weight_decay globs route each name to weight decay 0 or the configured one. */
static void test_adamw_no_wd_routing(void **state) {
    (void)state;
    ht_error err;
    ht_param_store ps = {0};
    const char *names[] = {"model.layers.0.self_attn.q_proj.weight",
                           "model.layers.0.self_attn.q_proj.bias",
                           "model.layers.0.input_layernorm.weight",
                           "model.norm.weight",
                           "transformer.h.0.ln_1.weight",
                           "lm_head.weight",
                           "model.embed_tokens.weight"};
    const bool decays[] = {true, false, false, false, false, true, true};
    int64_t shape[1] = {8};
    for (int i = 0; i < 7; i++) assert_non_null(ht_params_add(&ps, names[i], 1, shape, HT_DTYPE_F32));
    assert_ht_ok(ht_params_allocate(&ps, &err), &err);
    assert_ht_ok(ht_params_create_main(&ps, HT_MAIN_COPY, &err), &err);
    ht_param *list[7];
    for (int i = 0; i < 7; i++) list[i] = &ps.items[i];
    ht_adamw_config cfg = {.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
    ht_adamw opt;
    assert_ht_ok(ht_adamw_init(&opt, &cfg, list, 7, default_no_wd, 3, &err), &err);
    assert_int_equal(opt.count, 7);
    for (int i = 0; i < 7; i++) {
        assert_ptr_equal(opt.slots[i].param, list[i]);
        if (opt.slots[i].weight_decay != (decays[i] ? 0.01 : 0.0))
            fail_msg("%s: weight decay %g", names[i], opt.slots[i].weight_decay);
    }
    ht_adamw_free(&opt);
    /* A narrower list: only embeddings are exempt. */
    const char *only_embed[] = {"*embed_tokens*"};
    assert_ht_ok(ht_adamw_init(&opt, &cfg, list, 7, only_embed, 1, &err), &err);
    for (int i = 0; i < 7; i++) assert_true(opt.slots[i].weight_decay == (i == 6 ? 0.0 : 0.01));
    ht_adamw_free(&opt);
    /* A parameter without a main grad is an error that names it (and leaks nothing). */
    ps.items[3].main_grad = NULL;
    assert_int_equal(ht_adamw_init(&opt, &cfg, list, 7, default_no_wd, 3, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "model.norm.weight"));
    ht_params_free(&ps);
}

/* Case c of a schedule fixture: every listed step's lr against ht_lr_at,
 * 1e-12 relative (floored for lr = 0); the worst error is kept, the points counted. */
static int check_schedule_case(const ht_json *j, size_t c, const char *type, const ht_lr_schedule *sc, double *worst) {
    const ht_json *steps = ht_json_get(j, "steps"), *lrs = ht_json_get(j, "lr");
    assert_int_equal(steps->count, lrs->count);
    for (size_t i = 0; i < steps->count; i++) {
        int64_t s = (int64_t)steps->items[i].number;
        double want = lrs->items[i].number, got = ht_lr_at(sc, s);
        double scale = fmax(fabs(want), 1e-6 * sc->base_lr);
        double e = fabs(got - want) / scale;
        if (!(e <= 1e-12))
            fail_msg("case %zu %s (T %lld, W %lld): step %lld lr %.17g, want %.17g", c, type,
                     (long long)sc->total_steps, (long long)sc->warmup_steps, (long long)s, got, want);
        if (e > *worst) *worst = e;
    }
    return (int)steps->count;
}

/* A committed JSON fixture, parsed (the caller frees the tree). */
static ht_json *read_json_fixture(const char *name) {
    ht_error err;
    char *text;
    size_t len;
    ht_json *root;
    assert_ht_ok(ht_read_file(fixture_path(name), &text, &len, &err), &err);
    assert_ht_ok(ht_json_parse(text, len, name, &root, &err), &err);
    free(text);
    return root;
}

/* Every schedule vs lr_schedules.json (written from docs/NUMERICS.md's table in Python). */
static void test_lr_schedules_vs_table(void **state) {
    (void)state;
    ht_json *root = read_json_fixture("optim/lr_schedules.json");
    const ht_json *cases = ht_json_get(root, "cases");
    assert_non_null(cases);
    int seen[HT_LR_TYPE_COUNT] = {0}, points = 0;
    double worst = 0;
    for (size_t c = 0; c < cases->count; c++) {
        const ht_json *j = &cases->items[c];
        ht_lr_schedule sc = {0};
        const char *type = ht_json_get(j, "type")->string;
        assert_true(ht_lr_type_from_name(type, &sc.type));
        assert_string_equal(ht_lr_type_name(sc.type), type);
        seen[sc.type]++;
        sc.base_lr = ht_json_get(j, "base_lr")->number;
        sc.warmup_lr_init = ht_json_get(j, "warmup_lr_init")->number;
        sc.lr_end = ht_json_get(j, "lr_end")->number;
        sc.total_steps = (int64_t)ht_json_get(j, "total_steps")->number;
        sc.warmup_steps = (int64_t)ht_json_get(j, "warmup_steps")->number;
        sc.num_cycles = ht_json_get(j, "num_cycles")->number;
        sc.decay_steps = (int64_t)ht_json_get(j, "decay_steps")->number;
        sc.power = ht_json_get(j, "power")->number;
        sc.decay_start = (int64_t)ht_json_get(j, "decay_start")->number;
        sc.eta_min = ht_json_get(j, "eta_min")->number;
        sc.t_max = (int64_t)ht_json_get(j, "t_max")->number;
        points += check_schedule_case(j, c, type, &sc, &worst);
    }
    for (int t = 0; t <= HT_LR_COSINE_ANNEALING; t++) /* docs/NUMERICS.md's seven; the rest: mindformers_lr.json */
        if (seen[t] < 2) fail_msg("%s: only %d cases in the table", ht_lr_type_name((ht_lr_type)t), seen[t]);
    ht_lr_type unused;
    assert_false(ht_lr_type_from_name("cosine", &unused));
    printf("# LR schedules: %d points in %zu cases, max rel err %.3g\n", points, cases->count, worst);
    ht_json_free(root);
}

static double json_number(const ht_json *j, const char *key) {
    const ht_json *v = ht_json_get(j, key);
    if (!v) fail_msg("mindformers_lr.json: a case without %s", key);
    return v->number;
}

/* Every schedule, docs/NUMERICS.md's seven and MindFormers' three more, vs mindformers_lr.json: MindFormers'
 * lr_schedule.py transcribed into Python (tools/reference/make_lr_fixtures.py), 1e-12 relative. */
static void test_lr_schedules_vs_mindformers(void **state) {
    (void)state;
    ht_json *root = read_json_fixture("lr/mindformers_lr.json");
    const ht_json *cases = ht_json_get(root, "cases");
    assert_non_null(cases);
    int seen[HT_LR_TYPE_COUNT] = {0}, points = 0;
    double worst = 0;
    for (size_t c = 0; c < cases->count; c++) {
        const ht_json *j = &cases->items[c];
        const char *type = ht_json_get(j, "type")->string;
        ht_lr_schedule sc = {
            .base_lr = json_number(j, "base_lr"),
            .warmup_lr_init = json_number(j, "warmup_lr_init"),
            .lr_end = json_number(j, "lr_end"),
            .total_steps = (int64_t)json_number(j, "total_steps"),
            .warmup_steps = (int64_t)json_number(j, "warmup_steps"),
            .num_cycles = json_number(j, "num_cycles"),
            .decay_steps = (int64_t)json_number(j, "decay_steps"),
            .power = json_number(j, "power"),
            .decay_start = (int64_t)json_number(j, "decay_start"),
            .eta_min = json_number(j, "eta_min"),
            .t_max = (int64_t)json_number(j, "t_max"),
            .keep_steps = (int64_t)json_number(j, "keep_steps"),
            .final_steps = (int64_t)json_number(j, "final_steps"),
            .lr_end1 = json_number(j, "lr_end1"),
            .lr_end2 = json_number(j, "lr_end2"),
            .t_0 = (int64_t)json_number(j, "t_0"),
            .t_mult = (int64_t)json_number(j, "t_mult"),
            .lr_scale = json_number(j, "lr_scale"),
        };
        assert_true(ht_lr_type_from_name(type, &sc.type));
        assert_string_equal(ht_lr_type_name(sc.type), type);
        assert_true(ht_lr_type_from_name(ht_json_get(j, "wrapped")->string, &sc.wrapped));
        seen[sc.type]++;
        points += check_schedule_case(j, c, type, &sc, &worst);
    }
    for (int t = 0; t < HT_LR_TYPE_COUNT; t++)
        if (seen[t] < 2) fail_msg("%s: only %d cases in mindformers_lr.json", ht_lr_type_name((ht_lr_type)t), seen[t]);
    /* A wrapper around itself, or a restart schedule without a first cycle, is no schedule. */
    ht_lr_schedule bad = {.type = HT_LR_WISE_LAYER, .wrapped = HT_LR_WISE_LAYER, .base_lr = 1e-3, .lr_scale = 1};
    assert_true(isnan(ht_lr_at(&bad, 0)));
    bad = (ht_lr_schedule){.type = HT_LR_COSINE_WARM_RESTARTS, .base_lr = 1e-3, .t_0 = 0, .t_mult = 1};
    assert_true(isnan(ht_lr_at(&bad, 5)));
    printf("# MindFormers LR schedules: %d points in %zu cases, max rel err %.3g\n", points, cases->count, worst);
    ht_json_free(root);
}

/* A store of F32 trainable params with the given shapes, main_grad filled from the fixture. */
static void clip_store(ht_param_store *ps, const ht_safetensors *st, const char *which) {
    ht_error err;
    memset(ps, 0, sizeof(*ps));
    for (int i = 0; i < 3; i++) {
        const ht_st_tensor *t = need(st, "%s.grad.%d", which, i);
        char name[64];
        snprintf(name, sizeof(name), "layers.%d.weight", i);
        assert_non_null(ht_params_add(ps, name, t->ndim, t->shape, HT_DTYPE_F32));
    }
    assert_ht_ok(ht_params_allocate(ps, &err), &err);
    for (int i = 0; i < 3; i++) {
        const ht_st_tensor *t = need(st, "%s.grad.%d", which, i);
        memcpy(ps->items[i].main_grad, t->data, t->nbytes);
    }
}

/* ht_grad_norm / ht_clip_grads vs torch.nn.utils.clip_grad_norm_ (same formula,
 * max_norm / (N + 1e-6); torch sums in FP32, docs/NUMERICS.md in double). */
static void test_clip_vs_torch(void **state) {
    (void)state;
    ht_error err;
    ht_safetensors *st;
    assert_ht_ok(ht_safetensors_open(fixture_path("optim/clip.safetensors"), &st, &err), &err);
    const char *cases[] = {"above", "below"};
    for (int c = 0; c < 2; c++) {
        ht_param_store ps;
        clip_store(&ps, st, cases[c]);
        const char *bad = "unset";
        double norm = ht_grad_norm(&ps, &bad);
        assert_null(bad);
        char key[64];
        snprintf(key, sizeof(key), "%s.norm_f64", cases[c]);
        double f64 = meta_double(st, key);
        double f32 = *(const float *)need(st, "%s.norm_torch", cases[c])->data;
        snprintf(key, sizeof(key), "%s.max_norm", cases[c]);
        double max_norm = meta_double(st, key);
        assert_true(fabs(norm - f64) <= 1e-12 * f64);
        assert_true(fabs(norm - f32) <= 1e-6 * f32);
        ht_clip_grads(&ps, norm, max_norm);
        for (int i = 0; i < 3; i++) {
            const ht_st_tensor *want = need(st, "%s.clipped.%d", cases[c], i);
            double e = rel_max_err(ps.items[i].main_grad, want->data, want->nbytes / 4);
            if (e > 1e-6) fail_msg("%s, tensor %d: clipped grad rel err %.3g", cases[c], i, e);
            if (c == 1) assert_memory_equal(ps.items[i].main_grad, need(st, "below.grad.%d", i)->data, want->nbytes);
        }
        if (c == 0) { /* clipped to max_norm (just under: the 1e-6) */
            double after = ht_grad_norm(&ps, NULL);
            assert_true(after < max_norm && after > max_norm * (1 - 1e-5));
        }
        ht_params_free(&ps);
    }
    ht_safetensors_close(st);
}

/* A non-finite norm names the first parameter (store order) with a non-finite gradient. */
static void test_grad_norm_names_nonfinite(void **state) {
    (void)state;
    ht_error err;
    ht_param_store ps = {0};
    int64_t shape[2] = {300, 300};
    const char *names[] = {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                           "model.layers.1.mlp.up_proj.weight", "lm_head.weight"};
    for (int i = 0; i < 4; i++) assert_non_null(ht_params_add(&ps, names[i], 2, shape, HT_DTYPE_F32));
    assert_ht_ok(ht_params_allocate(&ps, &err), &err);
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 90000; j++) ps.items[i].main_grad[j] = 0.5f;
    const char *bad = NULL;
    assert_true(fabs(ht_grad_norm(&ps, &bad) - sqrt(4 * 90000 * 0.25)) < 1e-9);
    assert_null(bad);
    ps.items[3].main_grad[17] = INFINITY;
    ps.items[1].main_grad[89999] = NAN;
    assert_false(isfinite(ht_grad_norm(&ps, &bad)));
    assert_string_equal(bad, names[1]);
    assert_false(isfinite(ht_grad_norm(&ps, NULL))); /* bad is optional */
    ps.items[1].main_grad[89999] = 0.5f;
    assert_false(isfinite(ht_grad_norm(&ps, &bad)));
    assert_string_equal(bad, names[3]);
    ps.items[3].main_grad[17] = 0.5f;
    ps.items[0].main_grad[0] = -INFINITY;
    ps.items[0].trainable = false; /* frozen params are not counted */
    assert_true(isfinite(ht_grad_norm(&ps, &bad)));
    assert_null(bad);
    ps.items[0].trainable = true;
    ht_params_free(&ps);
}

static void test_glob_match(void **state) {
    (void)state;
    assert_true(ht_glob_match("*bias*", "model.layers.0.self_attn.q_proj.bias"));
    assert_true(ht_glob_match("*norm*", "model.layers.3.post_attention_layernorm.weight"));
    assert_true(ht_glob_match("*norm*", "model.norm.weight"));
    assert_true(ht_glob_match("*ln_*", "transformer.h.0.ln_1.weight"));
    assert_false(ht_glob_match("*ln_*", "model.layers.0.mlp.down_proj.weight"));
    assert_false(ht_glob_match("*bias*", "model.layers.0.self_attn.q_proj.weight"));
    assert_true(ht_glob_match("model.layers.?.mlp.*", "model.layers.7.mlp.up_proj.weight"));
    assert_false(ht_glob_match("model.layers.?.mlp.*", "model.layers.12.mlp.up_proj.weight"));
    assert_true(ht_glob_match("model.layers.[0-3].*", "model.layers.2.self_attn.k_proj.weight"));
    assert_false(ht_glob_match("model.layers.[0-3].*", "model.layers.4.self_attn.k_proj.weight"));
    assert_true(ht_glob_match("lm_head.weight", "lm_head.weight"));
    assert_false(ht_glob_match("lm_head", "lm_head.weight")); /* the whole name must match */
    assert_true(ht_glob_match("*", "model.embed_tokens.weight"));
    assert_false(ht_glob_match("", "x"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_adamw_fp32_vs_torch),         cmocka_unit_test(test_adamw_bf16_master_vs_torch),
        cmocka_unit_test(test_adamw_kernel_bitwise),        cmocka_unit_test(test_adamw_kernel_without_main_param),
        cmocka_unit_test(test_adamw_no_wd_routing),         cmocka_unit_test(test_lr_schedules_vs_table),
        cmocka_unit_test(test_lr_schedules_vs_mindformers), cmocka_unit_test(test_clip_vs_torch),
        cmocka_unit_test(test_grad_norm_names_nonfinite),   cmocka_unit_test(test_glob_match),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
