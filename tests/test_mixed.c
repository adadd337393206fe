/* The FP32 main-param wrapper: the seeds' core cases on one process. A bf16
 * model keeps an FP32 main param per weight, gradients land in FP32
 * main_grad, Muon and AdamW both update the main params and every model
 * param equals its main param rounded; an FP32 model is its own main param;
 * a tiny learning rate that bf16 alone rounds away still moves the model
 * with FP32 main params and never without. Without them no FP32 copy
 * exists and every leaf's path ends on the bits of main params reloaded
 * from the model before each step. Also QK-clip (with and without main
 * params), the fp16 loss scaler and model_init_dtype's conversion. */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/model.h"
#include "hypertrain/optimizer.h"

static ht_model_config tiny(int heads, int kv_heads) {
    ht_model_config c = {.name = "qwen2",
                         .vocab_size = 50,
                         .hidden_size = 32,
                         .intermediate_size = 48,
                         .num_hidden_layers = 2,
                         .num_attention_heads = heads,
                         .num_key_value_heads = kv_heads,
                         .max_position_embeddings = 32,
                         .rope_theta = 10000.0,
                         .rms_norm_eps = 1e-6,
                         .attention_bias = true,
                         .initializer_range = 0.1};
    return c;
}

static const char *no_wd[] = {"*bias*", "*norm*"};
static const char *adamw_include[] = {"*embed*", "*lm_head*"};

static ht_muon_config muon_config(double lr) {
    ht_muon_config mc;
    ht_muon_config_defaults(&mc);
    mc.lr = lr;
    return mc;
}

static ht_optimizer_config optimizer_config(bool use_muon, bool fp32_main, double lr) {
    ht_optimizer_config oc = {0};
    oc.use_muon = use_muon;
    oc.fp32_main_params = fp32_main;
    oc.adamw = (ht_adamw_config){.lr = lr, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
    oc.no_weight_decay = no_wd;
    oc.no_weight_decay_count = 2;
    oc.adamw_include = adamw_include;
    oc.adamw_include_count = 2;
    oc.muon = muon_config(20 * lr);
    oc.adamw_schedule = (ht_lr_schedule){.type = HT_LR_CONSTANT_WARMUP, .base_lr = lr, .total_steps = 1000};
    oc.muon_schedule = (ht_lr_schedule){.type = HT_LR_CONSTANT_WARMUP, .base_lr = 20 * lr, .total_steps = 1000};
    oc.max_norm = 1.0;
    ht_loss_scaler_init(&oc.scaler, 65536.0, 2.0, 0.5, 1000, 2, 1.0);
    return oc;
}

static void batch(int32_t *in, int32_t *tg, int n, uint64_t seed) {
    ht_rng rng;
    ht_rng_seed(&rng, seed);
    for (int i = 0; i < n; i++) {
        in[i] = (int32_t)ht_rng_below(&rng, 50);
        tg[i] = (int32_t)ht_rng_below(&rng, 50);
    }
}

static void forward_backward(ht_model *m, uint64_t seed) {
    int32_t in[2 * 9], tg[2 * 9];
    batch(in, tg, 18, seed);
    float loss;
    ht_error err;
    assert_ht_ok(ht_model_forward(m, in, tg, 2, 9, &loss, &err), &err);
    ht_model_backward(m, 1.0f);
}

static bool model_equals_rounded_main(const ht_param *p) {
    const uint16_t *d = p->data;
    for (int64_t i = 0; i < ht_param_local_numel(p); i++)
        if (d[i] != ht_f32_to_bf16(p->main_param[i])) return false;
    return true;
}

/* bf16 model, Muon + AdamW, fp32_main_params: true. */
static void test_bf16_model_with_fp32_main_params(void **state) {
    (void)state;
    ht_model_config cfg = tiny(4, 2);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 3, &m, &err), &err);
    ht_param_store *ps = &m->params;
    ht_param *first = &ps->items[0];
    assert_ht_ok(ht_params_convert(ps, HT_DTYPE_BF16, &err), &err);
    assert_ptr_equal(first, &ps->items[0]); /* conversion keeps every ht_param in place */
    ht_optimizer opt;
    ht_optimizer_config oc = optimizer_config(true, true, 1e-3);
    assert_ht_ok(ht_optimizer_init(&opt, ps, &oc, &err), &err);

    /* Every float is bf16 and every trainable param has its own FP32 main param. */
    size_t main_bytes = 0;
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        assert_int_equal(p->dtype, HT_DTYPE_BF16);
        assert_non_null(p->main_param);
        assert_ptr_not_equal((void *)p->main_param, p->data);
        assert_true(model_equals_rounded_main(p));
        main_bytes += (size_t)ht_param_local_numel(p) * sizeof(float);
    }
    assert_true(ps->main_bytes >= main_bytes);
    assert_int_equal(opt.float16_count, ps->count);
    assert_int_equal(opt.fp32_count, 0);
    for (int i = 0; i < opt.float16_count; i++)
        assert_ptr_equal(opt.fp32_from_float16_groups[i], opt.float16_groups[i]->main_param);
    /* Both leaves exist and refer to the main params. */
    assert_non_null(opt.muon);
    assert_non_null(opt.adamw);
    assert_true(opt.muon->count > 0 && opt.adamw->count > 0);
    for (int i = 0; i < opt.muon->count; i++) {
        assert_true(opt.muon->slots[i].param->ndim >= 2);
        assert_null(strstr(opt.muon->slots[i].param->name, "embed"));
    }
    for (int i = 0; i < opt.adamw->count; i++) {
        const ht_param *p = opt.adamw->slots[i].param;
        assert_true(p->ndim == 1 || strstr(p->name, "embed") || strstr(p->name, "lm_head"));
    }

    float *before = malloc(ps->main_bytes);
    memcpy(before, ps->main_block, ps->main_bytes);
    for (int step = 0; step < 3; step++) {
        forward_backward(m, 10 + (uint64_t)step);
        /* Gradients are FP32 and land in main_grad. */
        double total = 0;
        for (int i = 0; i < ps->count; i++)
            for (int64_t k = 0; k < ht_param_local_numel(&ps->items[i]); k++) total += fabs(ps->items[i].main_grad[k]);
        assert_true(total > 0);
        ht_step_result r;
        assert_ht_ok(ht_optimizer_step(&opt, &r, &err), &err);
        assert_false(r.skipped);
        /* After each step every model param equals its main param cast to bf16, and grads are cleared. */
        for (int i = 0; i < ps->count; i++) {
            ht_param *p = &ps->items[i];
            if (!model_equals_rounded_main(p))
                fail_msg("step %d: %s differs from its rounded main param", step, p->name);
            for (int64_t k = 0; k < ht_param_local_numel(p); k++) assert_true(p->main_grad[k] == 0.0f);
        }
    }
    /* Both groups really moved their main params. */
    bool muon_moved = false, adamw_moved = false;
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        size_t off = (size_t)((char *)p->main_param - (char *)ps->main_block) / sizeof(float);
        bool moved = memcmp(before + off, p->main_param, (size_t)ht_param_local_numel(p) * 4) != 0;
        for (int k = 0; k < opt.muon->count; k++) muon_moved |= moved && opt.muon->slots[k].param == p;
        for (int k = 0; k < opt.adamw->count; k++) adamw_moved |= moved && opt.adamw->slots[k].param == p;
    }
    assert_true(muon_moved);
    assert_true(adamw_moved);
    free(before);
    ht_optimizer_free(&opt);
    ht_model_free(m);
}

/* A float32 model: main_param IS the param, and nothing extra is allocated. */
static void test_f32_model_is_its_own_main_param(void **state) {
    (void)state;
    ht_model_config cfg = tiny(4, 2);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 3, &m, &err), &err);
    ht_optimizer opt;
    ht_optimizer_config oc = optimizer_config(true, true, 1e-3);
    assert_ht_ok(ht_optimizer_init(&opt, &m->params, &oc, &err), &err);
    for (int i = 0; i < m->params.count; i++)
        assert_ptr_equal((void *)m->params.items[i].main_param, m->params.items[i].data);
    assert_int_equal(m->params.main_bytes, 0);
    assert_null(m->params.main_block);
    assert_int_equal(opt.float16_count, 0);
    assert_int_equal(opt.fp32_count, m->params.count);
    forward_backward(m, 1);
    ht_step_result r;
    assert_ht_ok(ht_optimizer_step(&opt, &r, &err), &err);
    ht_optimizer_free(&opt);
    ht_model_free(m);
}

/* bf16 weights of value 1 and a constant gradient: AdamW moves them by about
 * lr = 4e-4 a step, a fifth of bf16's half-ulp just below 1 (2^-9). */
static int steps_until_model_moves(bool fp32_main, int max_steps, float *main_after) {
    ht_param_store ps = {0};
    ht_error err;
    int64_t shape[1] = {16};
    ht_params_add(&ps, "model.norm.weight", 1, shape, HT_DTYPE_F32);
    assert_ht_ok(ht_params_allocate(&ps, &err), &err);
    float *w = ps.items[0].data;
    for (int i = 0; i < 16; i++) w[i] = 1.0f;
    assert_ht_ok(ht_params_convert(&ps, HT_DTYPE_BF16, &err), &err);
    ht_optimizer opt;
    ht_optimizer_config oc = optimizer_config(false, fp32_main, 4e-4);
    oc.max_norm = 1e9;
    assert_ht_ok(ht_optimizer_init(&opt, &ps, &oc, &err), &err);
    int moved_at = -1;
    for (int step = 1; step <= max_steps && moved_at < 0; step++) {
        for (int i = 0; i < 16; i++) ps.items[0].main_grad[i] = 1.0f;
        ht_step_result r;
        assert_ht_ok(ht_optimizer_step(&opt, &r, &err), &err);
        if (((uint16_t *)ps.items[0].data)[0] != ht_f32_to_bf16(1.0f)) moved_at = step;
    }
    /* Without FP32 main params there is no copy: the value is the model's own. */
    assert_true(fp32_main == (ps.items[0].main_param != NULL));
    *main_after = fp32_main ? ps.items[0].main_param[0] : ht_bf16_to_f32(((uint16_t *)ps.items[0].data)[0]);
    ht_optimizer_free(&opt);
    ht_params_free(&ps);
    return moved_at;
}

static void test_tiny_updates_survive_only_with_fp32_main_params(void **state) {
    (void)state;
    float main_with, main_without;
    int with = steps_until_model_moves(true, 50, &main_with);
    int without = steps_until_model_moves(false, 50, &main_without);
    printf("bf16 weight 1.0, lr 4e-4: moves after %d steps with FP32 main params, %s without\n", with,
           without < 0 ? "never (50 steps)" : "early");
    assert_true(with > 1 && with <= 10); /* the FP32 main param accumulates until the rounding flips */
    assert_int_equal(without, -1);       /* bf16 alone rounds every update away */
    assert_true(main_with < 1.0f);
    assert_true(main_without == 1.0f);
}

/* ---------------------------------------------------------------- without FP32 main params */

/* Every path the leaves take: AdamW on an embedding big enough (76800
 * values) for the threads to split it and on a norm vector, Muon on a matrix
 * and on a stack of three (E, A, B) matrices, and a float32 matrix that is
 * its own main param; the low-precision ones in `dtype`. */
static void mixed_store(ht_param_store *ps, ht_dtype dtype) {
    ht_error err;
    memset(ps, 0, sizeof(*ps));
    ht_params_add(ps, "model.embed_tokens.weight", 2, (int64_t[]){300, 256}, dtype);
    ht_params_add(ps, "model.layers.0.mlp.up_proj.weight", 2, (int64_t[]){48, 32}, dtype);
    ht_params_add(ps, "model.layers.0.mlp.experts.weight", 3, (int64_t[]){3, 24, 40}, dtype);
    ht_params_add(ps, "model.norm.weight", 1, (int64_t[]){32}, dtype);
    ht_params_add(ps, "model.layers.0.self_attn.o_proj.weight", 2, (int64_t[]){32, 32}, HT_DTYPE_F32);
    assert_ht_ok(ht_params_allocate(ps, &err), &err);
    ht_rng rng;
    ht_rng_seed(&rng, 11);
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        size_t n = (size_t)ht_param_local_numel(p);
        float *x = malloc(n * sizeof(float));
        for (size_t k = 0; k < n; k++) x[k] = 0.05f * ht_rng_normal(&rng);
        ht_convert(p->data, p->dtype, x, HT_DTYPE_F32, n);
        free(x);
    }
}

static void random_grads(ht_param_store *ps, ht_rng *rng) {
    for (int i = 0; i < ps->count; i++)
        for (int64_t k = 0; k < ht_param_local_numel(&ps->items[i]); k++)
            ps->items[i].main_grad[k] = ht_rng_normal(rng);
}

/* A run without FP32 main params against what the option meant before it
 * dropped them: FP32 main params reloaded from the model before every step
 * (Megatron's reload_model_params), stepped, cast back. Six steps of Muon
 * and AdamW end on the same bits of every weight and every state tensor,
 * with no byte of main params and the optimizer's own bytes unchanged. */
static void check_without_main_params(ht_dtype dtype, bool stochastic, uint16_t *weights_out) {
    ht_param_store with, without;
    mixed_store(&with, dtype);
    mixed_store(&without, dtype);
    ht_error err;
    ht_optimizer a, b;
    ht_optimizer_config oc = optimizer_config(true, true, 1e-3);
    oc.stochastic_rounding = stochastic;
    oc.seed = 5;
    assert_ht_ok(ht_optimizer_init(&a, &with, &oc, &err), &err);
    oc.fp32_main_params = false;
    assert_ht_ok(ht_optimizer_init(&b, &without, &oc, &err), &err);

    assert_true(with.main_bytes > 0);
    assert_int_equal(without.main_bytes, 0);
    assert_null(without.main_block);
    for (int i = 0; i < without.count; i++) {
        ht_param *p = &without.items[i];
        if (p->dtype == HT_DTYPE_F32)
            assert_ptr_equal((void *)p->main_param, p->data); /* a float32 param is still its own */
        else
            assert_null(p->main_param);
    }
    assert_int_equal(b.float16_count, 4);
    assert_int_equal(b.fp32_count, 1);
    assert_non_null(b.muon);
    assert_int_equal(b.muon->count, 3);
    assert_int_equal(b.adamw->count, 2);
    assert_int_equal(ht_optimizer_bytes(&b), ht_optimizer_bytes(&a));

    void *initial = malloc(with.data_bytes);
    memcpy(initial, with.data_block, with.data_bytes);
    ht_rng ga, gb;
    ht_rng_seed(&ga, 3);
    ht_rng_seed(&gb, 3);
    for (int step = 0; step < 6; step++) {
        random_grads(&with, &ga);
        random_grads(&without, &gb);
        ht_params_reload_main(&with);
        ht_step_result ra, rb;
        assert_ht_ok(ht_optimizer_step(&a, &ra, &err), &err);
        assert_ht_ok(ht_optimizer_step(&b, &rb, &err), &err);
        assert_true(ra.grad_norm == rb.grad_norm);
        for (int i = 0; i < with.count; i++) {
            const ht_param *x = &with.items[i], *y = &without.items[i];
            if (memcmp(x->data, y->data, (size_t)ht_param_local_numel(x) * ht_dtype_size(x->dtype)) != 0)
                fail_msg("%s%s, step %d: %s differs from the reloaded main param's run", ht_dtype_name(dtype),
                         stochastic ? " (stochastic rounding)" : "", step + 1, x->name);
        }
    }
    for (int i = 0; i < a.adamw->count; i++) {
        const ht_adamw_slot *x = &a.adamw->slots[i], *y = &b.adamw->slots[i];
        size_t n = (size_t)ht_param_local_numel(x->param) * sizeof(float);
        assert_memory_equal(x->exp_avg, y->exp_avg, n);
        assert_memory_equal(x->exp_avg_sq, y->exp_avg_sq, n);
    }
    for (int i = 0; i < a.muon->count; i++)
        assert_memory_equal(a.muon->slots[i].momentum_buffer, b.muon->slots[i].momentum_buffer,
                            (size_t)ht_param_local_numel(a.muon->slots[i].param) * sizeof(float));
    /* Every weight moved: the updates are larger than half an ulp of most values. */
    for (int i = 0; i < without.count; i++) {
        const ht_param *p = &without.items[i];
        size_t off = (size_t)((char *)p->data - (char *)without.data_block);
        if (memcmp((char *)initial + off, p->data, (size_t)ht_param_local_numel(p) * ht_dtype_size(p->dtype)) == 0)
            fail_msg("%s did not move", p->name);
    }
    const ht_param *embed = &without.items[0];
    memcpy(weights_out, embed->data, (size_t)ht_param_local_numel(embed) * 2);
    printf("%s%s: 6 steps without FP32 main params bitwise equal to main params reloaded every step; main params "
           "%zu -> %zu bytes, optimizer %zu bytes either way\n",
           ht_dtype_name(dtype), stochastic ? ", stochastic rounding" : "", with.main_bytes, without.main_bytes,
           ht_optimizer_bytes(&b));
    free(initial);
    ht_optimizer_free(&a);
    ht_optimizer_free(&b);
    ht_params_free(&with);
    ht_params_free(&without);
}

static void test_without_main_params_bitwise_as_reloaded(void **state) {
    (void)state;
    enum { EMBED = 300 * 256 };
    uint16_t *nearest = malloc(EMBED * 2), *stochastic = malloc(EMBED * 2);
    const ht_dtype dtypes[] = {HT_DTYPE_BF16, HT_DTYPE_F16};
    for (int d = 0; d < 2; d++) {
        check_without_main_params(dtypes[d], false, nearest);
        check_without_main_params(dtypes[d], true, stochastic);
        /* Stochastic rounding really rounded otherwise (and the same way on both runs). */
        int differ = 0;
        for (int i = 0; i < EMBED; i++) differ += nearest[i] != stochastic[i];
        assert_true(differ > EMBED / 10);
    }
    free(nearest);
    free(stochastic);
}

/* QK-clip without main params scales the model's own rows: the bits it
 * leaves are those of the same clip on main params loaded from the model,
 * for both head layouts, and the rows of other heads are untouched. */
static void check_qk_clip_without_main_params(int kv_heads) {
    enum { H = 4, D = 8, C = 32 };
    ht_param_store with = {0}, without = {0};
    ht_param_store *stores[2] = {&with, &without};
    ht_error err;
    for (int s = 0; s < 2; s++) {
        ht_param_store *ps = stores[s];
        ht_params_add(ps, "q.weight", 2, (int64_t[]){H * D, C}, HT_DTYPE_BF16);
        ht_params_add(ps, "q.bias", 1, (int64_t[]){H * D}, HT_DTYPE_BF16);
        ht_params_add(ps, "k.weight", 2, (int64_t[]){kv_heads * D, C}, HT_DTYPE_BF16);
        ht_params_add(ps, "k.bias", 1, (int64_t[]){kv_heads * D}, HT_DTYPE_BF16);
        assert_ht_ok(ht_params_allocate(ps, &err), &err);
        ht_rng rng;
        ht_rng_seed(&rng, 9);
        for (int i = 0; i < ps->count; i++) {
            uint16_t *d = ps->items[i].data;
            for (int64_t k = 0; k < ht_param_local_numel(&ps->items[i]); k++)
                d[k] = ht_f32_to_bf16(ht_rng_normal(&rng));
        }
    }
    assert_ht_ok(ht_params_create_main(&with, HT_MAIN_COPY, &err), &err);
    assert_int_equal(without.main_bytes, 0);
    uint16_t before[H * D * C];
    memcpy(before, ht_params_find(&without, "q.weight")->data, sizeof(before));
    float max_logit[H] = {1.0f, 400.0f, 1.0f, 1.0f};
    for (int s = 0; s < 2; s++) {
        ht_param_store *ps = stores[s];
        ht_qk_layer layer = {ht_params_find(ps, "q.weight"),
                             ht_params_find(ps, "q.bias"),
                             ht_params_find(ps, "k.weight"),
                             ht_params_find(ps, "k.bias"),
                             H,
                             kv_heads,
                             D,
                             NULL,
                             0,
                             0,
                             0};
        assert_int_equal(ht_qk_clip(&layer, max_logit, 100.0), 1);
    }
    for (int i = 0; i < with.count; i++)
        assert_memory_equal(with.items[i].data, without.items[i].data,
                            (size_t)ht_param_local_numel(&with.items[i]) * 2);
    const uint16_t *q = ht_params_find(&without, "q.weight")->data;
    float k = (float)(kv_heads == H ? sqrt(0.25) : 0.25);
    for (int i = 0; i < H * D * C; i++) {
        bool head1 = i / C / D == 1;
        uint16_t want = head1 ? ht_f32_to_bf16(ht_bf16_to_f32(before[i]) * k) : before[i];
        if (q[i] != want) fail_msg("q.weight[%d]: %04x, expected %04x", i, q[i], want);
    }
    ht_params_free(&with);
    ht_params_free(&without);
}

static void test_qk_clip_without_main_params(void **state) {
    (void)state;
    check_qk_clip_without_main_params(4); /* MHA: q and k rows by sqrt(gamma) */
    check_qk_clip_without_main_params(2); /* GQA: q rows by gamma */
}

static void test_non_float_trainable_param_is_an_error(void **state) {
    (void)state;
    ht_param_store ps = {0};
    ht_error err;
    int64_t shape[1] = {4};
    ht_params_add(&ps, "model.weird.index", 1, shape, HT_DTYPE_I32);
    assert_ht_ok(ht_params_allocate(&ps, &err), &err);
    ht_optimizer opt;
    ht_optimizer_config oc = optimizer_config(true, true, 1e-3);
    assert_int_equal(ht_optimizer_init(&opt, &ps, &oc, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "model.weird.index"));
    ht_params_free(&ps);
}

/* model_init_dtype: float params and buffers change dtype, integer ones do not, nothing moves. */
static void test_convert_keeps_identity_and_layout(void **state) {
    (void)state;
    ht_param_store ps = {0};
    ht_error err;
    int64_t s2[2] = {6, 4}, s1[1] = {5};
    ht_params_add(&ps, "w", 2, s2, HT_DTYPE_F32);
    ht_param *buf = ht_params_add(&ps, "buffer.inv_freq", 1, s1, HT_DTYPE_F32);
    buf->trainable = false;
    ht_param *idx = ht_params_add(&ps, "buffer.positions", 1, s1, HT_DTYPE_I32);
    idx->trainable = false;
    assert_ht_ok(ht_params_allocate(&ps, &err), &err);
    ps.items[0].row0 = 0;
    for (int i = 0; i < 5; i++) ((int32_t *)ps.items[2].data)[i] = 100 + i;
    ht_param *before[3] = {&ps.items[0], &ps.items[1], &ps.items[2]};
    assert_ht_ok(ht_params_convert(&ps, HT_DTYPE_F16, &err), &err);
    for (int i = 0; i < 3; i++) assert_ptr_equal(before[i], &ps.items[i]);
    assert_int_equal(ps.items[0].dtype, HT_DTYPE_F16);
    assert_int_equal(ps.items[1].dtype, HT_DTYPE_F16);
    assert_int_equal(ps.items[2].dtype, HT_DTYPE_I32);
    for (int i = 0; i < 5; i++) assert_int_equal(((int32_t *)ps.items[2].data)[i], 100 + i);
    assert_int_equal(ps.items[0].row0, 0);
    assert_int_equal(ps.items[0].row1, 6);
    ht_params_free(&ps);
}

/* Megatron's DynamicGradScaler: hysteresis 2, backoff 0.5, growth x2 after 1000 clean steps, floor 1. */
static void test_loss_scaler(void **state) {
    (void)state;
    ht_loss_scaler s;
    ht_loss_scaler_init(&s, 65536.0, 2.0, 0.5, 1000, 2, 1.0);
    ht_loss_scaler_update(&s, true);
    assert_true(s.scale == 65536.0); /* the first overflow is tolerated */
    ht_loss_scaler_update(&s, true);
    assert_true(s.scale == 32768.0);
    for (int i = 0; i < 999; i++) ht_loss_scaler_update(&s, false);
    assert_true(s.scale == 32768.0);
    ht_loss_scaler_update(&s, false);
    assert_true(s.scale == 65536.0);
    for (int i = 0; i < 40; i++) ht_loss_scaler_update(&s, true);
    assert_true(s.scale == 1.0);
}

/* A float16 model whose gradients overflow: the step is skipped, nothing changes, the scale backs off. */
static void test_fp16_overflow_skips_the_step(void **state) {
    (void)state;
    ht_model_config cfg = tiny(4, 2);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 3, &m, &err), &err);
    assert_ht_ok(ht_params_convert(&m->params, HT_DTYPE_F16, &err), &err);
    ht_optimizer opt;
    ht_optimizer_config oc = optimizer_config(true, true, 1e-3);
    oc.loss_scaling = true;
    ht_loss_scaler_init(&oc.scaler, 1e30, 2.0, 0.5, 1000, 1, 1.0); /* no hysteresis: back off at once */
    assert_ht_ok(ht_optimizer_init(&opt, &m->params, &oc, &err), &err);
    size_t bytes = m->params.data_bytes;
    void *before = malloc(bytes);
    memcpy(before, m->params.data_block, bytes);
    int32_t in[18], tg[18];
    batch(in, tg, 18, 4);
    float loss;
    assert_ht_ok(ht_model_forward(m, in, tg, 2, 9, &loss, &err), &err);
    ht_model_backward(m, (float)ht_optimizer_loss_scale(&opt));
    ht_step_result r;
    assert_ht_ok(ht_optimizer_step(&opt, &r, &err), &err);
    assert_true(r.skipped);
    assert_memory_equal(before, m->params.data_block, bytes);
    assert_true(opt.scaler.scale == 5e29);
    assert_int_equal(opt.step, 0);
    free(before);
    ht_optimizer_free(&opt);
    ht_model_free(m);
}

/* A non-finite gradient in a bf16/fp32 model stops with the parameter's name. */
static void test_non_finite_gradient_names_the_parameter(void **state) {
    (void)state;
    ht_model_config cfg = tiny(4, 2);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 3, &m, &err), &err);
    ht_optimizer opt;
    ht_optimizer_config oc = optimizer_config(true, true, 1e-3);
    assert_ht_ok(ht_optimizer_init(&opt, &m->params, &oc, &err), &err);
    ht_param *p = ht_params_find(&m->params, "model.layers.1.mlp.up_proj.weight");
    p->main_grad[5] = NAN;
    ht_step_result r;
    assert_int_equal(ht_optimizer_step(&opt, &r, &err), HT_ERR_NUMERIC);
    assert_non_null(strstr(err.msg, "model.layers.1.mlp.up_proj.weight"));
    ht_optimizer_free(&opt);
    ht_model_free(m);
}

/* QK-clip: the offending head is brought under the threshold on the next
 * forward; every other head's logits and weights are untouched. */
static void check_qk_clip(int heads, int kv_heads) {
    ht_model_config cfg = tiny(heads, kv_heads);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 3, &m, &err), &err);
    int D = ht_model_config_head_dim(&cfg), H = heads;
    ht_param *qw = ht_params_find(&m->params, "model.layers.0.self_attn.q_proj.weight");
    ht_param *qb = ht_params_find(&m->params, "model.layers.0.self_attn.q_proj.bias");
    ht_param *kw = ht_params_find(&m->params, "model.layers.0.self_attn.k_proj.weight");
    ht_param *kb = ht_params_find(&m->params, "model.layers.0.self_attn.k_proj.bias");
    float *q = qw->data;
    for (int64_t i = (int64_t)1 * D * cfg.hidden_size; i < (int64_t)2 * D * cfg.hidden_size; i++) q[i] *= 40.0f;
    int32_t in[18], tg[18];
    batch(in, tg, 18, 8);
    float loss;
    ht_model_reset_attn_max(m);
    assert_ht_ok(ht_model_forward(m, in, tg, 2, 9, &loss, &err), &err);
    float s0[64];
    memcpy(s0, m->attn_max_logit, sizeof(float) * 2 * H);
    double tau = 0.5 * s0[1];
    for (int h = 0; h < H; h++)
        if (h != 1) assert_true(s0[h] < tau); /* only head 1 of layer 0 offends */
    for (int h = 0; h < H; h++) assert_true(s0[H + h] < tau);
    size_t qbytes = (size_t)ht_param_local_numel(qw) * 4, kbytes = (size_t)ht_param_local_numel(kw) * 4;
    float *q_before = malloc(qbytes), *k_before = malloc(kbytes);
    memcpy(q_before, qw->data, qbytes);
    memcpy(k_before, kw->data, kbytes);
    ht_qk_layer layer = {qw, qb, kw, kb, H, kv_heads, D, NULL, 0, 0, 0};
    assert_int_equal(ht_qk_clip(&layer, m->attn_max_logit, tau), 1);
    ht_model_reset_attn_max(m);
    assert_ht_ok(ht_model_forward(m, in, tg, 2, 9, &loss, &err), &err);
    printf("QK-clip %d/%d heads: head 1 logit %.3f -> %.3f (threshold %.3f)\n", H, kv_heads, s0[1],
           m->attn_max_logit[1], tau);
    assert_true(m->attn_max_logit[1] <= tau * (1 + 1e-5));
    assert_true(m->attn_max_logit[1] >= tau * (1 - 1e-3));
    for (int h = 0; h < H; h++) /* the layer's other heads (later layers see a changed input) */
        if (h != 1) assert_true(m->attn_max_logit[h] == s0[h]);
    /* Rows of other heads are bitwise unchanged; k changes only with multi-head attention. */
    int64_t row = cfg.hidden_size;
    assert_memory_equal(q_before, qw->data, (size_t)D * row * 4);
    assert_memory_equal(q_before + 2 * D * row, (float *)qw->data + 2 * D * row, qbytes - (size_t)2 * D * row * 4);
    if (kv_heads < heads)
        assert_memory_equal(k_before, kw->data, kbytes);
    else
        assert_memory_not_equal(k_before, kw->data, kbytes);
    free(q_before);
    free(k_before);
    ht_model_free(m);
}

static void test_qk_clip_gqa(void **state) {
    (void)state;
    check_qk_clip(4, 2);
}

static void test_qk_clip_mha(void **state) {
    (void)state;
    check_qk_clip(4, 4);
}

/* residual16's values: element i of version v, a finite FP32 value whose low
 * half is a tie (0x8000) at every 5th element, over an odd high half (the
 * weight rounded up) at every other of those. */
static float residual_value(int64_t i, uint32_t v) {
    uint32_t h = (uint32_t)(i * 2654435761u) ^ (v * 0x9e3779b9u);
    h = (h ^ (h >> 15)) * 0x85ebca6bu;
    uint32_t bits = (h & 0x3effffffu) | 0x3a000000u; /* |x| in [2^-11, 2) */
    if ((i + v) % 5 == 0) bits = (bits & 0xfffe0000u) | ((uint32_t)((i + v) / 5 % 2) << 16) | 0x8000u;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

static void next_version(float *x, int64_t at, int64_t len, void *v) {
    for (int64_t k = 0; k < len; k++) {
        float want = residual_value(at + k, *(uint32_t *)v - 1);
        if (memcmp(&x[k], &want, 4) != 0) fail_msg("the pass read element %lld wrong", (long long)(at + k));
        x[k] = residual_value(at + k, *(uint32_t *)v);
    }
}

static void expect_version(const ht_param *p, int64_t n, const uint32_t *version) {
    float *x = malloc((size_t)n * sizeof(float));
    ht_param_main_read(p, 0, n, x);
    int64_t ties = 0;
    for (int64_t i = 0; i < n; i++) {
        float want = residual_value(i, version[i]);
        uint32_t bits;
        memcpy(&bits, &want, 4);
        ties += (bits & 0x1ffff) == 0x18000;
        if (memcmp(&x[i], &want, 4) != 0) fail_msg("element %lld: %a, expected %a", (long long)i, x[i], want);
        if (((uint16_t *)p->data)[i] != ht_f32_to_bf16(want))
            fail_msg("element %lld: weight not rounded", (long long)i);
    }
    assert_int_equal(p->main_tie_count, ties);
    free(x);
}

/* residual16's low halves rebuild every value exactly, ties both ways
 * included, through whole writes, a pass over a middle range on two
 * threads in blocks (the range's ties replaced, the rest kept) and a write
 * of a few elements. */
static void test_residual16_ties(void **state) {
    (void)state;
    ht_error err;
    ht_param_store ps = {0};
    const int64_t n = 300007;
    ht_params_add(&ps, "w", 2, (int64_t[]){n, 1}, HT_DTYPE_BF16);
    assert_ht_ok(ht_params_allocate(&ps, &err), &err);
    assert_ht_ok(ht_params_create_main(&ps, HT_MAIN_RESIDUAL16, &err), &err);
    ht_param *p = &ps.items[0];
    assert_null(p->main_param);
    assert_int_equal(ps.main_bytes, ht_align64((size_t)n * 2));
    uint32_t *version = calloc((size_t)n, sizeof(uint32_t));
    float *x = malloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = residual_value(i, 0);
    ht_param_main_write(p, 0, n, x);
    expect_version(p, n, version);
    assert_true(p->main_tie_count > 20000);
    uint32_t v = 1;
    ht_param_main_pass(p, 1000, 250001, next_version, &v);
    for (int64_t i = 1000; i < 251001; i++) version[i] = 1;
    expect_version(p, n, version);
    for (int64_t i = 0; i < 11; i++) x[i] = residual_value(123456 + i, 2);
    ht_param_main_write(p, 123456, 11, x);
    for (int64_t i = 123456; i < 123467; i++) version[i] = 2;
    expect_version(p, n, version);
    ht_params_reload_main(&ps);
    assert_int_equal(p->main_tie_count, 0);
    ht_param_main_read(p, 0, n, x);
    for (int64_t i = 0; i < n; i++)
        if (x[i] != ht_bf16_to_f32(((uint16_t *)p->data)[i]))
            fail_msg("reloaded element %lld is not its weight", (long long)i);
    free(x);
    free(version);
    ht_params_free(&ps);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_bf16_model_with_fp32_main_params),
        cmocka_unit_test(test_residual16_ties),
        cmocka_unit_test(test_f32_model_is_its_own_main_param),
        cmocka_unit_test(test_tiny_updates_survive_only_with_fp32_main_params),
        cmocka_unit_test(test_without_main_params_bitwise_as_reloaded),
        cmocka_unit_test(test_qk_clip_without_main_params),
        cmocka_unit_test(test_non_float_trainable_param_is_an_error),
        cmocka_unit_test(test_convert_keeps_identity_and_layout),
        cmocka_unit_test(test_loss_scaler),
        cmocka_unit_test(test_fp16_overflow_skips_the_step),
        cmocka_unit_test(test_non_finite_gradient_names_the_parameter),
        cmocka_unit_test(test_qk_clip_gqa),
        cmocka_unit_test(test_qk_clip_mha),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
