/* The decoder's backward pass against central finite differences of its own
 * forward pass, for every kind of parameter, on tiny Qwen2- and Llama-shaped
 * models (GQA, biases on and off, tied and untied embeddings). */
#include "harness.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "hypertrain/model.h"
#include "hypertrain/optim.h"
#include "hypertrain/parallel.h"

#include <omp.h>

static ht_model_config tiny_config(const char *name, bool bias, bool tied) {
    ht_model_config c = {0};
    snprintf(c.name, sizeof(c.name), "%s", name);
    c.vocab_size = 37;
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 16;
    c.rope_theta = 10000.0;
    c.rms_norm_eps = 1e-6;
    c.attention_bias = bias;
    c.tie_word_embeddings = tied;
    c.initializer_range = 0.3; /* large weights: sharper softmaxes, a more sensitive check */
    return c;
}

static void check_gradients(const char *name, bool bias, bool tied) {
    ht_model_config cfg = tiny_config(name, bias, tied);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1234, &m, &err), &err);
    /* Non-trivial norm weights and biases so their gradients are exercised. */
    ht_rng rng;
    ht_rng_seed(&rng, 99);
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        if (p->ndim == 1) {
            float *w = p->data;
            for (int64_t k = 0; k < ht_param_local_numel(p); k++) w[k] += 0.2f * ht_rng_normal(&rng);
        }
    }
    enum { B = 2, T = 7 };
    int32_t in[B * T], tg[B * T];
    random_tokens(in, B * T, cfg.vocab_size, 5);
    random_tokens(tg, B * T, cfg.vocab_size, 6);
    tg[3] = -1; /* an ignored position */

    ht_params_zero_grad(&m->params);
    model_loss(m, in, tg, B, T);
    ht_model_backward(m, 1.0f);

    const float eps = 1e-2f;
    double worst = 0;
    for (int i = 0; i < m->params.count; i++) {
        ht_param *p = &m->params.items[i];
        float *w = p->data;
        int64_t n = ht_param_local_numel(p);
        for (int probe = 0; probe < 4; probe++) {
            int64_t k = (int64_t)ht_rng_below(&rng, (uint64_t)n);
            float orig = w[k];
            w[k] = orig + eps;
            double lp = model_loss(m, in, tg, B, T);
            w[k] = orig - eps;
            double lm = model_loss(m, in, tg, B, T);
            w[k] = orig;
            double fd = (lp - lm) / (2.0 * eps);
            double an = p->main_grad[k];
            double e = fabs(fd - an) / (1e-3 + fabs(fd));
            if (e > worst) worst = e;
            /* Central differences in FP32: O(eps^2) truncation plus ~1e-7/eps rounding of the loss. */
            if (fabs(fd - an) > 2e-3 + 2e-2 * fabs(fd))
                fail_msg("%s %s[%lld]: backward %.6g, finite difference %.6g", name, p->name, (long long)k, an, fd);
        }
    }
    printf("%s bias=%d tied=%d: worst relative gradient error %.3g\n", name, bias, tied, worst);
    ht_model_free(m);
}

static void test_grad_qwen2_untied(void **state) {
    (void)state;
    check_gradients("qwen2", true, false);
}

static void test_grad_llama_tied(void **state) {
    (void)state;
    check_gradients("llama", false, true);
}

static void test_unknown_model(void **state) {
    (void)state;
    ht_model_config cfg = tiny_config("gpt9", true, false);
    ht_model *m;
    ht_error err;
    assert_int_equal(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "gpt9"));
    assert_non_null(strstr(err.msg, "qwen2"));
}

/* Sizes whose tensors or whole model pass HT_MODEL_MAX_PARAMS (or int64 itself)
 * are refused by name before anything is allocated. */
static void test_model_size_caps(void **state) {
    (void)state;
    static const struct {
        int vocab, hidden, inter, layers, heads, kv;
        const char *want;
    } cases[] = {
        {2000000000, 1048576, 64, 1, 8, 2, "the embedding (vocab_size x hidden_size) has 2000000000 x 1048576"},
        {256, 2000000000, 2000000000, 1, 8, 2, "has 2000000000 x 2000000000 elements"},
        {256, 4096, 11008, 2000000000, 32, 8, "2000000000 layers of"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ht_model_config cfg = tiny_config("qwen2", true, false);
        cfg.vocab_size = cases[i].vocab;
        cfg.hidden_size = cases[i].hidden;
        cfg.intermediate_size = cases[i].inter;
        cfg.num_hidden_layers = cases[i].layers;
        cfg.num_attention_heads = cases[i].heads;
        cfg.num_key_value_heads = cases[i].kv;
        cfg.head_dim = 0;
        ht_error err;
        assert_int_equal(ht_model_config_validate(&cfg, &err), HT_ERR_CONFIG);
        if (!strstr(err.msg, cases[i].want) || !strstr(err.msg, "HT_MODEL_MAX_PARAMS"))
            fail_msg("case %zu: '%s' lacks '%s' or the cap's name", i, err.msg, cases[i].want);
    }
    ht_model_config ok = tiny_config("qwen2", true, false);
    ht_error err;
    assert_ht_ok(ht_model_config_validate(&ok, &err), &err);
}

/* What a size implies is checked before anything is allocated, within a
 * second, naming the key: a million layers of the default architecture
 * (before: minutes of quadratic name lookups and gigabytes of records, then
 * out of memory), 2^31 - 1 positions (before: 64 GB tried for the rotary
 * tables, then "cannot allocate the model"). */
static void test_sizes_checked_before_allocating(void **state) {
    (void)state;
    static const struct {
        int layers, positions;
        const char *want;
    } cases[] = {
        {1000000, 512, "model.num_hidden_layers 1000000 x 6.927e+05 a layer"},
        {4, 2147483647, "model.max_position_embeddings is 2147483647, more than the 16777216 positions"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        ht_model_config cfg = tiny_config("qwen2", true, false); /* then configs/default.yaml's architecture */
        cfg.vocab_size = 256;
        cfg.hidden_size = 256;
        cfg.intermediate_size = 688;
        cfg.num_attention_heads = 8;
        cfg.num_key_value_heads = 2;
        cfg.num_hidden_layers = cases[i].layers;
        cfg.max_position_embeddings = cases[i].positions;
        ht_model *m = NULL;
        ht_error err = {0};
        double t0 = ht_time_seconds();
        watchdog(30, "ht_model_build of an oversized model");
        ht_status s = ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err);
        watchdog(0, NULL);
        double took = ht_time_seconds() - t0;
        if (s == HT_OK) ht_model_free(m);
        assert_int_equal(s, HT_ERR_CONFIG);
        if (!strstr(err.msg, cases[i].want)) fail_msg("case %zu: '%s' lacks '%s'", i, err.msg, cases[i].want);
        if (took > 5.0) fail_msg("case %zu took %.1f s", i, took);
        printf("  %.3f s: %s\n", took, err.msg);
    }
}

/* ht_params_find is a hash lookup: 200,000 names added and each found again
 * in well under the 5 s bound (the linear search took minutes here, and
 * on a million layers); a name added twice finds the first. */
static void test_param_names_are_hashed(void **state) {
    (void)state;
    enum { N = 200000 };
    ht_param_store store = {0};
    char name[64];
    int64_t shape[1] = {1};
    double t0 = ht_time_seconds();
    watchdog(60, "200,000 ht_params_find lookups");
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof(name), "model.layers.%d.mlp.up_proj.weight", i);
        assert_non_null(ht_params_add(&store, name, 1, shape, HT_DTYPE_F32));
    }
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof(name), "model.layers.%d.mlp.up_proj.weight", i);
        const ht_param *p = ht_params_find(&store, name);
        if (!p || p != &store.items[i]) fail_msg("%s: found %p, expected item %d", name, (const void *)p, i);
    }
    assert_null(ht_params_find(&store, "model.layers.200000.mlp.up_proj.weight"));
    assert_null(ht_params_find(&store, ""));
    double took = ht_time_seconds() - t0;
    watchdog(0, NULL);
    shape[0] = 7;
    ht_param *first = ht_params_add(&store, "dup", 1, shape, HT_DTYPE_F32);
    ht_params_add(&store, "dup", 1, shape, HT_DTYPE_F32);
    assert_ptr_equal(ht_params_find(&store, "dup"), first);
    printf("  %d names added and found in %.3f s\n", N, took);
    if (took > 5.0) fail_msg("%d lookups took %.1f s", N, took);
    ht_params_free(&store);
}

/* The initialisation draws each element from (seed, name, element index)
 * alone: every rank of 2 and 3 builds exactly its rows of the one-process
 * model, in bf16 as well; matrices have the configured std, norms are 1 and
 * biases 0. */
static void test_init_is_the_same_on_every_world(void **state) {
    (void)state;
    ht_model_config cfg = tiny_config("qwen2", true, false);
    cfg.initializer_range = 0.02;
    ht_error err;
    for (int d = 0; d < 2; d++) {
        ht_dtype dtype = d == 0 ? HT_DTYPE_F32 : HT_DTYPE_BF16;
        ht_model *whole;
        assert_ht_ok(ht_model_build_shard(&cfg, dtype, 5, 0, 1, &whole, &err), &err);
        for (int world = 2; world <= 3; world++)
            for (int rank = 0; rank < world; rank++) {
                ht_model *shard;
                assert_ht_ok(ht_model_build_shard(&cfg, dtype, 5, rank, world, &shard, &err), &err);
                for (int i = 0; i < whole->params.count; i++) {
                    const ht_param *p = &whole->params.items[i], *q = &shard->params.items[i];
                    size_t row = (size_t)ht_param_row_numel(p) * ht_dtype_size(dtype);
                    assert_string_equal(p->name, q->name);
                    assert_memory_equal(q->data, (const char *)p->data + (size_t)q->row0 * row,
                                        (size_t)(q->row1 - q->row0) * row);
                }
                ht_model_free(shard);
            }
        if (dtype == HT_DTYPE_F32)
            for (int i = 0; i < whole->params.count; i++) {
                const ht_param *p = &whole->params.items[i];
                const float *w = p->data;
                int64_t n = ht_param_numel(p);
                double sum2 = 0;
                for (int64_t k = 0; k < n; k++) sum2 += (double)w[k] * w[k];
                if (p->ndim >= 2) {
                    /* var of n normal draws: within 5 standard errors sqrt(2/n) of std^2 */
                    double var = sum2 / n, want = cfg.initializer_range * cfg.initializer_range;
                    if (!(fabs(var / want - 1) < 5 * sqrt(2.0 / n)))
                        fail_msg("%s: variance %.4g, expected %.4g", p->name, var, want);
                } else {
                    float v = strstr(p->name, "norm") ? 1.0f : 0.0f;
                    for (int64_t k = 0; k < n; k++) assert_true(w[k] == v);
                }
            }
        ht_model_free(whole);
    }
}

static void test_sequence_too_long(void **state) {
    (void)state;
    ht_model_config cfg = tiny_config("qwen2", true, false);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    int32_t in[17] = {0}, tg[17] = {0};
    float loss;
    assert_int_equal(ht_model_forward(m, in, tg, 1, 17, &loss, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "max_position_embeddings"));
    in[3] = 37;
    assert_int_equal(ht_model_forward(m, in, tg, 1, 16, &loss, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "vocabulary"));
    ht_model_free(m);
}

/* Context parallelism's layout (docs/DESIGN.md, Context parallelism): the
 * positions each rank holds, and what a model refuses before any exchange. */
static void test_context_parallel_layout(void **state) {
    (void)state;
    /* Ring 2 over 16 tokens: 4 chunks of 4, rank 0 holding chunks 0 and 3, rank 1 chunks 1 and 2. */
    const int64_t ring2[2][8] = {{0, 1, 2, 3, 12, 13, 14, 15}, {4, 5, 6, 7, 8, 9, 10, 11}};
    /* Ulysses 2 x ring 2: each ring rank's 8 tokens in two pieces of 4. */
    const int64_t hybrid[4][4] = {{0, 1, 2, 3}, {12, 13, 14, 15}, {4, 5, 6, 7}, {8, 9, 10, 11}};
    for (int r = 0; r < 2; r++)
        for (int t = 0; t < 8; t++) {
            ht_context_parallel cp = {.ulysses = 1, .ring = 2, .ring_rank = r};
            assert_int_equal(ht_context_position(&cp, 8, t), ring2[r][t]);
        }
    for (int w = 0; w < 4; w++)
        for (int t = 0; t < 4; t++) {
            ht_context_parallel cp = {.ulysses = 2, .ring = 2, .ulysses_rank = w % 2, .ring_rank = w / 2};
            assert_int_equal(ht_context_position(&cp, 4, t), hybrid[w][t]);
        }
    ht_context_parallel ulysses = {.ulysses = 4, .ring = 1, .ulysses_rank = 3};
    assert_int_equal(ht_context_position(&ulysses, 4, 1), 13);

    ht_model_config cfg = tiny_config("qwen2", true, false);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    ht_comm two = {.rank = 1, .size = 2, .name = "a group of two"}; /* sizes only: nothing is exchanged */
    assert_ht_ok(ht_context_parallel_attach(m, &two, ht_comm_single(), &two, &err), &err);
    assert_int_equal(ht_context_size(&m->context), 2);
    /* 9 tokens a rank are sequences of 18, past the model's 16 positions. */
    int32_t in[9] = {0}, tg[9] = {0};
    float loss;
    assert_int_equal(ht_model_forward(m, in, tg, 1, 9, &loss, &err), HT_ERR_INVALID);
    assert_non_null(strstr(err.msg, "sequence length 18 is longer than model.max_position_embeddings (16)"));
    /* A model whose builder does not declare it cannot be split. */
    m->context_capable = false;
    assert_int_equal(ht_context_parallel_attach(m, &two, &two, ht_comm_single(), &err), HT_ERR_CONFIG);
    assert_non_null(strstr(err.msg, "cannot split its sequences"));
    ht_model_free(m);
}

/* fsdp_config.mix_precision.output_dtype: bf16 logits are the FP32 logits rounded. */
static void test_output_dtype_rounds_logits(void **state) {
    (void)state;
    ht_model_config cfg = tiny_config("qwen2", true, false);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    int32_t in[10], tg[10];
    random_tokens(in, 10, cfg.vocab_size, 1);
    random_tokens(tg, 10, cfg.vocab_size, 2);
    float loss;
    assert_ht_ok(ht_model_forward(m, in, tg, 2, 5, &loss, &err), &err);
    size_t n = (size_t)10 * cfg.vocab_size;
    float *full = malloc(n * sizeof(float));
    memcpy(full, m->logits, n * sizeof(float));
    m->output_dtype = HT_DTYPE_BF16;
    assert_ht_ok(ht_model_forward(m, in, tg, 2, 5, &loss, &err), &err);
    for (size_t i = 0; i < n; i++) assert_true(m->logits[i] == ht_bf16_to_f32(ht_f32_to_bf16(full[i])));
    free(full);
    ht_model_free(m);
}

/* Resume is bitwise only if a step repeats bit for bit: every reduction must
 * combine in a fixed order, whatever order the threads arrive in. */
static void test_backward_repeats_bitwise_with_3_threads(void **state) {
    (void)state;
    int saved = omp_get_max_threads();
    omp_set_num_threads(3);
    ht_model_config cfg = tiny_config("qwen2", true, false);
    ht_model *m;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err), &err);
    enum { B = 4, T = 15 };
    int32_t in[B * T], tg[B * T];
    random_tokens(in, B * T, cfg.vocab_size, 11);
    random_tokens(tg, B * T, cfg.vocab_size, 12);
    float *first = malloc(m->params.grad_bytes);
    float loss0 = 0;
    double norm0 = 0;
    for (int rep = 0; rep < 6; rep++) {
        float loss;
        ht_params_zero_grad(&m->params);
        assert_ht_ok(ht_model_forward(m, in, tg, B, T, &loss, &err), &err);
        ht_model_backward(m, 1.0f);
        double norm = ht_grad_norm(&m->params, NULL);
        if (rep == 0) {
            memcpy(first, m->params.grad_block, m->params.grad_bytes);
            loss0 = loss;
            norm0 = norm;
            continue;
        }
        assert_true(loss == loss0);
        assert_true(norm == norm0);
        assert_memory_equal(first, m->params.grad_block, m->params.grad_bytes);
    }
    free(first);
    ht_model_free(m);
    omp_set_num_threads(saved);
}

/* keep_logits false (the trainer's): with logits of more than 64 MiB the LM
 * head and the loss run over chunks of tokens and backward computes each
 * chunk's logits again. The loss and every gradient are those of the whole
 * logits (up to the GEMMs' sums over other row counts), the memory holds
 * one chunk, and a second backward repeats the first bit for bit. Tied
 * embeddings: the head's gradient lands in the embedding's. */
static void test_chunked_lm_head(void **s) {
    (void)s;
    ht_model_config cfg = tiny_config("qwen2", true, true);
    cfg.vocab_size = 40000; /* 8 x 160 tokens x 40000 x 4 bytes = 195 MiB: 4 chunks of up to 419 rows */
    cfg.max_position_embeddings = 160;
    const int B = 8, T = 160, N = B * T;
    ht_model *whole, *chunked;
    ht_error err;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 7, &whole, &err), &err);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 7, &chunked, &err), &err);
    chunked->keep_logits = false;
    int32_t *in = malloc(N * sizeof(int32_t)), *tg = malloc(N * sizeof(int32_t));
    random_tokens(in, N, cfg.vocab_size, 11);
    random_tokens(tg, N, cfg.vocab_size, 12);
    for (int i = 0; i < N; i += 7) tg[i] = -100; /* ignored targets in every chunk */
    float lw, lc;
    assert_ht_ok(ht_model_forward(whole, in, tg, B, T, &lw, &err), &err);
    assert_ht_ok(ht_model_forward(chunked, in, tg, B, T, &lc, &err), &err);
    assert_non_null(whole->logits);
    assert_null(chunked->logits);
    const double full_logits = (double)N * cfg.vocab_size * 4;
    printf("activations: %.1f MiB with the whole logits, %.1f MiB in chunks; loss %.7f vs %.7f\n",
           whole->activation_bytes / 1048576.0, chunked->activation_bytes / 1048576.0, lw, lc);
    /* The logits and their gradient as a GEMM operand, N x V each, against one chunk of each. */
    assert_true((double)whole->activation_bytes - (double)chunked->activation_bytes > 1.0 * full_logits);
    assert_true(fabs(lw - lc) <= 1e-6 * fabs(lw));
    ht_params_zero_grad(&whole->params);
    ht_params_zero_grad(&chunked->params);
    ht_model_backward(whole, 0.5f);
    ht_model_backward(chunked, 0.5f);
    double worst = 0;
    for (int i = 0; i < whole->params.count; i++) {
        const ht_param *a = &whole->params.items[i], *b = &chunked->params.items[i];
        double e = rel_max_err(b->main_grad, a->main_grad, (size_t)ht_param_numel(a));
        if (!(e <= 1e-5)) fail_msg("%s: chunked gradient differs by %.3g", a->name, e);
        worst = fmax(worst, e);
    }
    printf("chunked LM head: every gradient within %.2g of the whole logits'\n", worst);
    /* Backward again from the same forward: the chunks' logits are computed again, the same bits. */
    const ht_param *embed = &chunked->params.items[0];
    size_t n = (size_t)ht_param_numel(embed);
    float *first = malloc(n * sizeof(float));
    memcpy(first, embed->main_grad, n * sizeof(float));
    ht_params_zero_grad(&chunked->params);
    ht_model_backward(chunked, 0.5f);
    assert_memory_equal(first, embed->main_grad, n * sizeof(float));
    free(first);
    free(in);
    free(tg);
    ht_model_free(whole);
    ht_model_free(chunked);
}

/* The download rows of the profiled table since its last reset. */
static int64_t downloads(void) {
    ht_kernel_profile_row rows[256];
    const int n = ht_kernels_profile(rows, 256);
    for (int i = 0; i < n; i++)
        if (strcmp(rows[i].entry, "download") == 0) return rows[i].calls;
    return 0;
}

/* QK-clip's maxima on a table whose memory the host cannot read: every
 * layer's into its own slot, downloaded once after the last layer (a GPU
 * waits once a forward, not once a layer), the CPU's bits; a layer
 * recomputed in backward leaves them alone (no scores above the diagonal
 * again, no download); untracked, nothing is downloaded. */
static void test_attention_maxima_one_download(void **state) {
    (void)state;
    ht_model_config cfg = tiny_config("qwen2", true, false);
    cfg.num_hidden_layers = 3;
    enum { B = 2, T = 9 };
    int32_t in[B * T], tg[B * T];
    random_tokens(in, B * T, cfg.vocab_size, 21);
    random_tokens(tg, B * T, cfg.vocab_size, 22);
    ht_model *cpu, *dev;
    ht_error err;
    float loss_cpu, loss_dev;
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 5, &cpu, &err), &err);
    ht_model_reset_attn_max(cpu);
    assert_ht_ok(ht_model_forward(cpu, in, tg, B, T, &loss_cpu, &err), &err);
    const ht_kernel_ops *K = ht_kernels_profiled(ht_kernels_fenced());
    ht_kernels_use(K);
    assert_ht_ok(ht_model_build(&cfg, HT_DTYPE_F32, 5, &dev, &err), &err);
    const char *all[] = {"model.layers.{*}"};
    assert_ht_ok(ht_model_set_recompute(dev, all, 1, &err), &err);
    ht_model_reset_attn_max(dev);
    ht_kernels_profile_reset();
    assert_ht_ok(ht_model_forward(dev, in, tg, B, T, &loss_dev, &err), &err);
    assert_int_equal(downloads(), 1);
    const size_t n = (size_t)cfg.num_hidden_layers * cfg.num_attention_heads;
    for (size_t i = 0; i < n; i++) {
        assert_true(isfinite(cpu->attn_max_logit[i]));
        assert_true(dev->attn_max_logit[i] == cpu->attn_max_logit[i]);
    }
    assert_true(loss_dev == loss_cpu);
    ht_params_zero_grad(&dev->params);
    ht_model_backward(dev, 1.0f);
    assert_int_equal(downloads(), 1);
    for (size_t i = 0; i < n; i++) assert_true(dev->attn_max_logit[i] == cpu->attn_max_logit[i]);
    dev->track_attn_max = false;
    ht_kernels_profile_reset();
    assert_ht_ok(ht_model_forward(dev, in, tg, B, T, &loss_dev, &err), &err);
    assert_int_equal(downloads(), 0);
    assert_true(loss_dev == loss_cpu);
    ht_model_free(dev);
    ht_kernels_use(NULL);
    ht_model_free(cpu);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_chunked_lm_head),
        cmocka_unit_test(test_grad_qwen2_untied),
        cmocka_unit_test(test_grad_llama_tied),
        cmocka_unit_test(test_unknown_model),
        cmocka_unit_test(test_sequence_too_long),
        cmocka_unit_test(test_context_parallel_layout),
        cmocka_unit_test(test_init_is_the_same_on_every_world),
        cmocka_unit_test(test_model_size_caps),
        cmocka_unit_test(test_sizes_checked_before_allocating),
        cmocka_unit_test(test_param_names_are_hashed),
        cmocka_unit_test(test_output_dtype_rounds_logits),
        cmocka_unit_test(test_backward_repeats_bitwise_with_3_threads),
        cmocka_unit_test(test_attention_maxima_one_download),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
