/* One AdamW step with the cast back to the bf16 model: 48 tensors of
 * 1024x1024 (50.3M params), bf16 model + FP32 main_param, main_grad and both
 * moments. Times the fused pass (ht_adamw_step) and, for comparison, the same
 * update followed by a separate cast pass. Prints one JSON line: ns/param and
 * the bandwidth implied by the bytes a fused step must move (p, g, m, v read;
 * p, m, v, model written: 30 bytes a param), and the same step with the main
 * params held as residual16 (optimizer.main_param_storage: the low 16 bits
 * beside the bf16 weight: p read and written as 2 + 2 bytes, 26 a param,
 * through 1 MiB blocks). Peer: bench/peers/torch_adamw_step.py;
 * bench/run_adamw.sh runs both.
 * usage: bench_adamw [--tensors 48] [--rows 1024] [--steps 5] */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/optim.h"

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    ht_openmp_settle(argv);
    int tensors = 48, rows = 1024, steps = 5, warmup = 2;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (strcmp(argv[i], "--tensors") == 0) tensors = atoi(argv[i + 1]);
        if (strcmp(argv[i], "--rows") == 0) rows = atoi(argv[i + 1]);
        if (strcmp(argv[i], "--steps") == 0) steps = atoi(argv[i + 1]);
    }
    ht_error err;
    ht_param_store ps = {0};
    int64_t shape[2] = {rows, 1024}; /* (rows, 1024) each */
    for (int i = 0; i < tensors; i++) {
        char name[64];
        snprintf(name, sizeof(name), "model.layers.%d.mlp.up_proj.weight", i);
        ht_params_add(&ps, name, 2, shape, HT_DTYPE_BF16);
    }
    if (ht_params_allocate(&ps, &err) != HT_OK || ht_params_create_main(&ps, HT_MAIN_COPY, &err) != HT_OK) {
        fprintf(stderr, "bench_adamw: %s\n", err.msg);
        return 1;
    }
    int64_t n = ht_params_total_numel(&ps);
    ht_param *list[tensors];
    for (int i = 0; i < tensors; i++) {
        ht_param *p = list[i] = &ps.items[i];
        int64_t k = ht_param_local_numel(p);
#pragma omp parallel for schedule(static)
        for (int64_t j = 0; j < k; j++) { /* cheap deterministic values, |g| in [2^-12, 1) */
            uint32_t h = (uint32_t)(j + (int64_t)i * k) * 2654435761u;
            p->main_param[j] = (float)(h >> 8) * 0x1p-25f - 0.25f;
            p->main_grad[j] = ((float)(h & 0xffff) - 32768.0f) * 0x1p-15f;
        }
    }
    /* The same params and gradients again, their main params as residual16. */
    ht_param_store rs = {0};
    for (int i = 0; i < tensors; i++) ht_params_add(&rs, ps.items[i].name, 2, shape, HT_DTYPE_BF16);
    if (ht_params_allocate(&rs, &err) != HT_OK || ht_params_create_main(&rs, HT_MAIN_RESIDUAL16, &err) != HT_OK) {
        fprintf(stderr, "bench_adamw: %s\n", err.msg);
        return 1;
    }
    ht_param *rlist[tensors];
    for (int i = 0; i < tensors; i++) {
        ht_param *p = rlist[i] = &rs.items[i];
        int64_t k = ht_param_local_numel(p);
        ht_param_main_write(p, 0, k, list[i]->main_param);
        memcpy(p->main_grad, list[i]->main_grad, (size_t)k * sizeof(float));
    }
    ht_adamw_config ac = {.lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    ht_adamw opt, ropt;
    if (ht_adamw_init(&opt, &ac, list, tensors, NULL, 0, &err) != HT_OK ||
        ht_adamw_init(&ropt, &ac, rlist, tensors, NULL, 0, &err) != HT_OK) {
        fprintf(stderr, "bench_adamw: %s\n", err.msg);
        return 1;
    }
    double fused[64], split[64], residual[64];
    if (steps > 64) steps = 64;
    for (int s = -warmup; s < steps; s++) {
        double t0 = ht_time_seconds();
        ht_adamw_step(&opt, 1e-4);
        double t1 = ht_time_seconds();
        /* The two-pass form: update the FP32 master, then cast it in a second pass. */
        for (int i = 0; i < opt.count; i++) {
            ht_adamw_slot *sl = &opt.slots[i];
            ht_param *p = sl->param;
            int64_t k = ht_param_local_numel(p);
            sl->step++;
            ht_adamw_update(p->main_param, p->main_grad, sl->exp_avg, sl->exp_avg_sq, k, sl->step, 1e-4, ac.beta1,
                            ac.beta2, ac.eps, ac.weight_decay, NULL, HT_DTYPE_F32);
            ht_convert(p->data, HT_DTYPE_BF16, p->main_param, HT_DTYPE_F32, (size_t)k);
        }
        double t2 = ht_time_seconds();
        ht_adamw_step(&ropt, 1e-4);
        double t3 = ht_time_seconds();
        if (s >= 0) {
            fused[s] = t1 - t0;
            split[s] = t2 - t1;
            residual[s] = t3 - t2;
        }
    }
    qsort(fused, (size_t)steps, sizeof(double), cmp_double);
    qsort(split, (size_t)steps, sizeof(double), cmp_double);
    qsort(residual, (size_t)steps, sizeof(double), cmp_double);
    double med = fused[steps / 2], best = fused[0], med2 = split[steps / 2], med3 = residual[steps / 2];
    const double bytes = 30.0 * (double)n;
#ifdef __AVX512F__
    const char *path = "avx512";
#else
    const char *path = "scalar";
#endif
    printf("{\"engine\": \"hypertrain\", \"params\": %lld, \"threads\": %d, \"path\": \"%s\", \"steps\": %d, "
           "\"ms_per_step\": %.2f, \"ns_per_param\": %.3f, \"best_ns_per_param\": %.3f, \"gb_per_s\": %.1f, "
           "\"two_pass_ns_per_param\": %.3f, \"residual16_ns_per_param\": %.3f}\n",
           (long long)n, omp_get_max_threads(), path, steps, med * 1e3, med * 1e9 / (double)n, best * 1e9 / (double)n,
           bytes / med / 1e9, med2 * 1e9 / (double)n, med3 * 1e9 / (double)n);
    ht_adamw_free(&opt);
    ht_adamw_free(&ropt);
    ht_params_free(&ps);
    ht_params_free(&rs);
    return 0;
}
