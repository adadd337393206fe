/* Train-step throughput on a benchmark model (bench_models.h: the 31M
 * model, default batch 8 x seq 256, or Qwen2.5-0.5B's architecture):
 * forward, backward and the AdamW step on FP32 main params. Prints one JSON
 * line, like bench/peers/torch_train_step.py, with the MFU against the
 * chosen kernel's measured rate, the peak RSS, and the memory the trainer's
 * formula predicts (weights, FP32 main params, main_grad, AdamW's two
 * moments, the activations the model sized, compute copies).
 * usage: bench_train_step [--dtype float32|bfloat16] [--steps N]
 *                         [--model 31m|qwen2.5-0.5b|llama-1b|moe|dsv3|dsv3-dense]
 *                         [--batch B] [--seq T]
 *                         [--recompute]: every layer recomputes its activations in backward
 *                         [--backend cpu|fenced|cuda]: the kernel table it runs on (cuda: the
 *                         MFU against that GPU's GEMM rate of the dtype measured first, on an
 *                         8192 x 8192 x 8192 product, and the peak of the backend's memory)
 *                         [--profile]: on the profiled table (kernels/profiled.c): a second JSON
 *                         line of where the timed steps' time went, entry by entry (the products
 *                         by shape), per step, and the time outside every entry; the same as a
 *                         table on stderr. A profiled step waits after every entry: its
 *                         tokens/s are not the plain run's
 * --steps 0 builds and initialises the model only and prints how long that took. */
#include <omp.h>
#include <stdio.h>
#include <sys/resource.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "bench_models.h"
#include "hypertrain/model.h"
#include "hypertrain/optim.h"

/* The backend's GEMM rate in dtype (GFLOP/s): the mean of ten 8192 x 8192 x
 * 8192 products after three, operands of random values (0 where memory
 * runs out). */
static double gemm_rate(const ht_kernel_ops *K, ht_dtype dtype) {
    const int64_t n = 8192;
    const size_t es = ht_dtype_size(dtype), elems = (size_t)(n * n);
    void *a = K->alloc(elems * es), *b = K->alloc(elems * es), *host = malloc(elems * es);
    float *c = K->alloc(elems * sizeof(float)), *f = malloc(elems * sizeof(float));
    double rate = 0.0;
    ht_error err;
    if (a && b && c && host && f) {
        ht_rng rng;
        ht_rng_seed(&rng, 7);
        for (size_t i = 0; i < elems; i++) f[i] = (float)ht_rng_uniform(&rng) * 2.0f - 1.0f;
        ht_convert(host, dtype, f, HT_DTYPE_F32, elems);
        K->upload(a, host, elems * es);
        K->upload(b, host, elems * es);
        double t0 = 0;
        for (int i = 0; i < 13; i++) {
            if (i == 3 && K->synchronize(&err) == HT_OK) t0 = ht_time_seconds();
            K->gemm(false, true, n, n, n, 1.0f, a, n, b, n, dtype, 0.0f, c, n);
        }
        if (K->synchronize(&err) == HT_OK) rate = 10 * 2.0 * (double)n * n * n / (ht_time_seconds() - t0) / 1e9;
    }
    K->free(a), K->free(b), K->free(c);
    free(host), free(f);
    return rate;
}

/* The profiled steps' rows (--profile): ms and calls per step, the longest
 * first, as a JSON line on stdout and a table on stderr, with the time
 * outside every entry (the step's less the rows'). */
static void print_profile(double step_seconds, int steps) {
    enum { MAX_ROWS = 512 };
    static ht_kernel_profile_row rows[MAX_ROWS];
    const int n = ht_kernels_profile(rows, MAX_ROWS);
    double inside = 0;
    for (int i = 0; i < n; i++) inside += rows[i].seconds / steps;
    fprintf(stderr, "profile: %.2f ms a step, %.2f ms in the entries below, %.2f ms outside them\n", step_seconds * 1e3,
            inside * 1e3, (step_seconds - inside) * 1e3);
    fprintf(stderr, "%10s %8s %6s  %s\n", "ms/step", "calls", "share", "entry");
    printf("{\"impl\": \"hypertrain-profile\", \"step_ms\": %.3f, \"inside_ms\": %.3f, \"outside_ms\": %.3f, "
           "\"entries\": [",
           step_seconds * 1e3, inside * 1e3, (step_seconds - inside) * 1e3);
    for (int i = 0; i < n; i++) {
        const double ms = rows[i].seconds / steps * 1e3, calls = (double)rows[i].calls / steps;
        fprintf(stderr, "%10.3f %8.1f %5.1f%%  %s\n", ms, calls, 100.0 * ms / (step_seconds * 1e3), rows[i].entry);
        printf("%s{\"entry\": \"%s\", \"ms\": %.4f, \"calls\": %.2f}", i ? ", " : "", rows[i].entry, ms, calls);
    }
    printf("]}\n");
}

int main(int argc, char **argv) {
    ht_openmp_settle(argv);
    ht_dtype dtype = HT_DTYPE_F32;
    int steps = 10, B = 8, T = 256;
    bool recompute = false, profile = false;
    int head_chunk_mib = -1; /* the trainer's default (kernels.lm_head_chunk_mib: auto, the backend's) */
    ht_model_config cfg = bench_model_31m();
    const ht_kernel_ops *K = ht_kernels_cpu();
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc) {
            ht_error why;
            const char *b = argv[++i];
            K = strcmp(b, "cuda") == 0     ? ht_kernels_cuda(&why)
                : strcmp(b, "fenced") == 0 ? ht_kernels_fenced()
                : strcmp(b, "cpu") == 0    ? ht_kernels_cpu()
                                           : NULL;
            if (!K) {
                fprintf(stderr, "--backend %s: %s\n", b,
                        strcmp(b, "cuda") == 0 ? why.msg : "expected cpu, fenced or cuda");
                return 2;
            }
        } else if (strcmp(argv[i], "--dtype") == 0 && i + 1 < argc) {
            if (!ht_dtype_from_name(argv[++i], &dtype)) {
                fprintf(stderr, "unknown dtype %s\n", argv[i]);
                return 2;
            }
        } else if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
            steps = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--head-chunk-mib") == 0 && i + 1 < argc) {
            head_chunk_mib = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--recompute") == 0) {
            recompute = true;
        } else if (strcmp(argv[i], "--profile") == 0) {
            profile = true;
        } else if (strcmp(argv[i], "--batch") == 0 && i + 1 < argc) {
            B = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--seq") == 0 && i + 1 < argc) {
            T = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc && strcmp(argv[i + 1], "31m") == 0) {
            cfg = bench_model_31m();
            i++;
        } else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc && strcmp(argv[i + 1], "qwen2.5-0.5b") == 0) {
            cfg = bench_model_qwen25_05b();
            i++;
        } else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc && strcmp(argv[i + 1], "llama-1b") == 0) {
            cfg = bench_model_llama_1b();
            i++;
        } else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc && strcmp(argv[i + 1], "moe") == 0) {
            cfg = bench_model_moe();
            i++;
        } else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc && strcmp(argv[i + 1], "dsv3") == 0) {
            cfg = bench_model_dsv3(false);
            i++;
        } else if (strcmp(argv[i], "--model") == 0 && i + 1 < argc && strcmp(argv[i + 1], "dsv3-dense") == 0) {
            cfg = bench_model_dsv3(true);
            i++;
        } else {
            fprintf(
                stderr,
                "usage: %s [--dtype float32|bfloat16] [--steps N] [--model "
                "31m|qwen2.5-0.5b|llama-1b|moe|dsv3|dsv3-dense] "
                "[--batch B] [--seq T] [--recompute] [--head-chunk-mib M] [--backend cpu|fenced|cuda] [--profile]\n",
                argv[0]);
            return 2;
        }
    }
    if (B < 1 || T < 1 || steps < 0) {
        fprintf(stderr, "--batch and --seq must be positive, --steps >= 0\n");
        return 2;
    }
    if (T > cfg.max_position_embeddings) cfg.max_position_embeddings = T;
    if (profile) K = ht_kernels_profiled(K);
    ht_error err;
    /* The kernels the trainer would choose: timed on the model's own linear layer. */
    ht_gemm_choice choice;
    if (ht_kernels_choose_gemm(HT_GEMM_KERNEL_AUTO, HT_GEMM_KERNEL_AUTO, (int64_t)B * T, cfg.hidden_size,
                               cfg.hidden_size, &choice, &err) != HT_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    ht_kernels_use_gemm(&choice);
    char choice_line[512];
    ht_kernels_describe_gemm(&choice, choice_line, sizeof(choice_line));
    ht_kernels_use(K);
    ht_model *m;
    double init0 = ht_time_seconds();
    if (ht_model_build(&cfg, HT_DTYPE_F32, 1, &m, &err) != HT_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    double init_s = ht_time_seconds() - init0; /* allocation and the weights' initialisation */
    if (steps == 0) {
        printf("{\"impl\": \"hypertrain\", \"threads\": %d, \"params\": %lld, \"init_s\": %.3f}\n",
               omp_get_max_threads(), (long long)ht_params_total_numel(&m->params), init_s);
        ht_model_free(m);
        return 0;
    }
    if (ht_params_convert(&m->params, dtype, &err) != HT_OK || ht_model_set_compute(m, dtype, &err) != HT_OK ||
        ht_params_create_main(&m->params, HT_MAIN_COPY, &err) != HT_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    m->keep_logits = false; /* as the trainer: the LM head and the loss in chunks where the logits are large */
    /* as the trainer without QK-clip (AdamW's runs): no attention maxima, which
     * would cost every key tile above the diagonal and a download a layer */
    m->track_attn_max = false;
    if (head_chunk_mib >= 0) m->head_chunk_bytes = (int64_t)head_chunk_mib << 20;
    const char *every_layer[] = {"model.layers.{*}"};
    if (recompute && ht_model_set_recompute(m, every_layer, 1, &err) != HT_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    /* deepseek_v3's correction biases are params of the store that no gradient trains (transformers' buffers). */
    ht_param *list[m->params.count];
    int trained = 0;
    int64_t trained_numel = 0;
    for (int i = 0; i < m->params.count; i++)
        if (m->params.items[i].trainable) {
            list[trained++] = &m->params.items[i];
            trained_numel += ht_param_numel(&m->params.items[i]);
        }
    ht_adamw opt;
    ht_adamw_config ac = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01};
    if (ht_adamw_init(&opt, &ac, list, trained, NULL, 0, &err) != HT_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    int32_t *in = malloc(sizeof(int32_t) * B * T), *tg = malloc(sizeof(int32_t) * B * T);
    ht_rng rng;
    ht_rng_seed(&rng, 1);
    for (int i = 0; i < B * T; i++) {
        in[i] = (int32_t)ht_rng_below(&rng, (uint64_t)cfg.vocab_size);
        tg[i] = (int32_t)ht_rng_below(&rng, (uint64_t)cfg.vocab_size);
    }
    double t0 = 0, fwd = 0, bwd = 0, upd = 0;
    float loss = 0;
    for (int s = 0; s < steps + 2; s++) {
        if (s == 2) t0 = ht_time_seconds(), fwd = bwd = upd = 0, ht_kernels_profile_reset(); /* two warmup steps */
        double a = ht_time_seconds();
        ht_params_zero_grad(&m->params);
        if (ht_model_forward(m, in, tg, B, T, &loss, &err) != HT_OK || K->synchronize(&err) != HT_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        double b = ht_time_seconds();
        ht_model_backward(m, 1.0f);
        (void)K->synchronize(&err); /* each phase's time its own (a device queues its work) */
        double c = ht_time_seconds();
        ht_adamw_step(&opt, 1e-4);
        ht_params_refresh_compute(&m->params);
        if (K->synchronize(&err) != HT_OK) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
        double d = ht_time_seconds();
        fwd += b - a;
        bwd += c - b;
        upd += d - c;
    }
    double dt = (ht_time_seconds() - t0) / steps;
    if (profile) print_profile(dt, steps);
    /* MFU against the rate the chosen kernel of this dtype reached on the model's linear-layer product. */
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    const ht_param_store *ps = &m->params;
    size_t moments = 2 * sizeof(float) * (size_t)trained_numel;
    double formula =
        (double)(ps->data_bytes + ps->main_bytes + ps->grad_bytes + ps->compute_bytes + moments + m->activation_bytes);
    /* A device's peak before its GEMM rate is measured (on blocks of its own), in this run */
    const double peak_backend_mib = (double)K->peak_bytes() / (double)(1 << 20);
    const double device_rate = K->host_memory ? 0.0 : gemm_rate(K, dtype);
    if (device_rate > 0)
        snprintf(choice_line, sizeof(choice_line), "%s: %.0f GFLOP/s on 8192 x 8192 x 8192 in %s", K->name, device_rate,
                 ht_dtype_name(dtype));
    double flops = ht_model_flops_per_token(&cfg, T), rate = device_rate > 0          ? device_rate
                                                             : dtype == HT_DTYPE_F32  ? choice.f32_rate
                                                             : dtype == HT_DTYPE_BF16 ? choice.bf16_rate[choice.bf16]
                                                                                      : choice.f16_rate[choice.f16];
    printf("{\"impl\": \"hypertrain\", \"dtype\": \"%s\", \"threads\": %d, \"tokens_per_s\": %.1f, \"step_ms\": %.1f, "
           "\"forward_ms\": %.1f, \"backward_ms\": %.1f, \"update_ms\": %.1f, \"init_s\": %.3f, \"params\": %lld, "
           "\"trained_params\": %lld, \"loss\": %.4f, "
           "\"model_gflop_per_token\": %.4f, \"gemm_gflops\": %.1f, \"mfu\": %.3f, \"batch\": %d, \"seq\": %d, "
           "\"recompute\": %s, \"peak_rss_mib\": %.1f, \"formula_mib\": %.1f, \"activations_mib\": %.1f, \"gemm\": "
           "\"%s\", "
           "\"choice\": \"%s\", \"backend\": \"%s\", \"peak_backend_mib\": %.1f}\n",
           ht_dtype_name(dtype), omp_get_max_threads(), B * T / dt, dt * 1e3, fwd / steps * 1e3, bwd / steps * 1e3,
           upd / steps * 1e3, init_s, (long long)ht_params_total_numel(&m->params), (long long)trained_numel, loss,
           flops / 1e9, rate, rate > 0 ? B * T / dt * flops / (rate * 1e9) : 0.0, B, T, recompute ? "true" : "false",
           ru.ru_maxrss / 1024.0, formula / (1 << 20), m->activation_bytes / (double)(1 << 20),
           K->host_memory ? ht_kernels_gemm_name(m->params.items[0].compute_precision) : K->name, choice_line, K->name,
           peak_backend_mib);
    ht_adamw_free(&opt);
    ht_model_free(m);
    ht_kernels_use(NULL);
    free(in);
    free(tg);
    return 0;
}
