/* One Muon optimizer step on 48 matrices of 1024 x 1024 (~50M params), bf16
 * model params with FP32 masters, next to torch.optim.Muon doing the same
 * (bench/peers/torch_muon_step.py, run by this program after its own
 * figures). Reports ms/step, and Newton-Schulz GFLOP/s against what ht_gemm
 * reaches on 1024 x 1024 x 1024 f32 products (goal: NS >= 80% of it).
 *
 * usage: OMP_NUM_THREADS=2 bench_muon [--steps N] [--params N] [--size N]
 *                                     [--no-peer] [--peer-ns bf16|fp32]
 *                                     [--rows R]: params of R x size (R != size:
 *                                     the step alone, no yardstick and no peer)
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "hypertrain/optim.h"
#include "kernels/cpu/gemm.h"

static void die(const char *what) {
    fprintf(stderr, "bench_muon: %s\n", what);
    exit(1);
}

static void load_average(char *buf, size_t n) {
    FILE *f = fopen("/proc/loadavg", "r");
    buf[0] = 0;
    if (f) {
        if (!fgets(buf, (int)n, f)) buf[0] = 0;
        fclose(f);
    }
    buf[strcspn(buf, "\n")] = 0;
}

/* Seconds of the fastest of `reps` calls of ht_gemm (NN or NT) on (n, n, n) f32. */
static double gemm_best(int64_t n, bool trans_b, int reps, const float *A, const float *B, float *C) {
    double best = INFINITY;
    for (int r = 0; r < reps; r++) {
        double t0 = ht_time_seconds();
        ht_gemm(false, trans_b, n, n, n, 1.0f, A, n, B, n, HT_DTYPE_F32, 0.0f, C, n);
        best = fmin(best, ht_time_seconds() - t0);
    }
    return best;
}

/* Newton-Schulz of one (n, n) matrix next to the 15 GEMMs of the same FLOPs,
 * taken in turns (one of each per round, fastest of `rounds`): on the shared
 * 2-core machine, figures timed minutes apart measure the neighbours. */
static void ns_vs_gemm(int64_t n, const ht_ns_schedule *sched, int rounds, const float *G, float *O, double *gemm15,
                       double *ns32, double *ns16) {
    float *work = ht_alloc(ht_newton_schulz_workspace(n, n, sched, HT_DTYPE_BF16) * sizeof(float));
    if (!work) die("out of memory");
    ht_newton_schulz(G, O, n, n, sched, 1e-7, HT_DTYPE_F32, work); /* primitives created here */
    ht_newton_schulz(G, O, n, n, sched, 1e-7, HT_DTYPE_BF16, work);
    *gemm15 = *ns32 = *ns16 = INFINITY;
    for (int r = 0; r < rounds; r++) {
        double t0 = ht_time_seconds();
        for (int k = 0; k < 15; k++) ht_gemm(false, false, n, n, n, 1.0f, G, n, G, n, HT_DTYPE_F32, 0.0f, O, n);
        double t1 = ht_time_seconds();
        ht_newton_schulz(G, O, n, n, sched, 1e-7, HT_DTYPE_F32, work);
        double t2 = ht_time_seconds();
        ht_newton_schulz(G, O, n, n, sched, 1e-7, HT_DTYPE_BF16, work);
        double t3 = ht_time_seconds();
        *gemm15 = fmin(*gemm15, t1 - t0);
        *ns32 = fmin(*ns32, t2 - t1);
        *ns16 = fmin(*ns16, t3 - t2);
    }
    ht_free(work);
}

/* Newton-Schulz of `count` (rows, cols) matrices one call at a time, next to
 * batches of as many as Muon's workspace holds (its batching), in turns,
 * fastest of `rounds` each. */
static void ns_one_vs_batched(int count, int64_t rows, int64_t cols, const ht_ns_schedule *sched, size_t work_floats,
                              int rounds, const float *G, double *one, double *batched) {
    const int64_t n = rows * cols;
    const size_t ws = ht_newton_schulz_workspace(rows, cols, sched, HT_DTYPE_F32);
    const int per = work_floats / (n + ws) > 1 ? (int)(work_floats / (n + ws)) : 1;
    float *O = ht_alloc((size_t)(count * n) * sizeof(float)), *work = ht_alloc((size_t)per * ws * sizeof(float));
    if (!O || !work) die("out of memory");
    *one = *batched = INFINITY;
    for (int r = 0; r <= rounds; r++) { /* round 0 creates the primitives */
        double t0 = ht_time_seconds();
        for (int i = 0; i < count; i++)
            ht_newton_schulz(G + i * n, O + i * n, rows, cols, sched, 1e-7, HT_DTYPE_F32, work);
        double t1 = ht_time_seconds();
        for (int i = 0; i < count; i += per)
            ht_newton_schulz_batch(G + i * n, O + i * n, count - i < per ? count - i : per, rows, cols, sched, 1e-7,
                                   HT_DTYPE_F32, work);
        double t2 = ht_time_seconds();
        if (r > 0) *one = fmin(*one, t1 - t0), *batched = fmin(*batched, t2 - t1);
    }
    ht_free(O);
    ht_free(work);
}

/* Newton-Schulz of one (rows, cols) matrix in each form (muon_ns_form,
 * muon_ns_dtype): FP32 standard, FP32 Gram, bf16 standard, bf16 torch, in
 * turns, fastest of `rounds` each, into seconds[4]. */
static void ns_forms(int64_t rows, int64_t cols, const ht_ns_schedule *sched, int rounds, const float *G,
                     double seconds[4]) {
    static const ht_ns_form forms[4] = {HT_NS_FORM_STANDARD, HT_NS_FORM_GRAM, HT_NS_FORM_STANDARD, HT_NS_FORM_TORCH};
    ht_ns_schedule s[4];
    size_t ws = 0;
    for (int f = 0; f < 4; f++) {
        s[f] = *sched;
        s[f].form = forms[f];
        size_t w = ht_newton_schulz_workspace(rows, cols, &s[f], f < 2 ? HT_DTYPE_F32 : HT_DTYPE_BF16);
        ws = w > ws ? w : ws;
    }
    float *O = ht_alloc((size_t)(rows * cols) * sizeof(float)), *work = ht_alloc(ws * sizeof(float));
    if (!O || !work) die("out of memory");
    for (int f = 0; f < 4; f++) seconds[f] = INFINITY;
    for (int r = 0; r <= rounds; r++) /* round 0 creates the primitives */
        for (int f = 0; f < 4; f++) {
            double t0 = ht_time_seconds();
            ht_newton_schulz(G, O, rows, cols, &s[f], 1e-7, f < 2 ? HT_DTYPE_F32 : HT_DTYPE_BF16, work);
            if (r > 0) seconds[f] = fmin(seconds[f], ht_time_seconds() - t0);
        }
    ht_free(O);
    ht_free(work);
}

int main(int argc, char **argv) {
    ht_openmp_settle(argv);
    int steps = 2, count = 48;
    int64_t n = 1024, rows = 0;
    bool peer = true;
    const char *peer_ns = "bf16";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--params") && i + 1 < argc)
            count = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--size") && i + 1 < argc)
            n = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc)
            rows = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--peer-ns") && i + 1 < argc)
            peer_ns = argv[++i];
        else if (!strcmp(argv[i], "--no-peer"))
            peer = false;
        else
            die("usage: bench_muon [--steps N] [--params N] [--size N] [--rows R] [--no-peer] [--peer-ns bf16|fp32]");
    }
    if (rows == 0) rows = n;
    if (steps < 1 || count < 1 || n < 1 || rows < 1) die("--steps, --params, --size and --rows must be >= 1");
    const bool square = rows == n;
    char load[128];
    load_average(load, sizeof(load));
    printf("threads %d, %d params of %lld x %lld, bf16 model + FP32 main, asym5 x 5, load average %s\nf32 GEMM: %s\n",
           omp_get_max_threads(), count, (long long)rows, (long long)n, load, ht_gemm_kernel_name(HT_DTYPE_F32));

    ht_error err;
    ht_param_store store = {0};
    for (int i = 0; i < count; i++) {
        char name[64];
        snprintf(name, sizeof(name), "model.layers.%d.weight", i);
        ht_params_add(&store, name, 2, (int64_t[]){rows, n}, HT_DTYPE_BF16);
    }
    if (ht_params_allocate(&store, &err) != HT_OK) die(err.msg);
    ht_rng rng;
    ht_rng_seed(&rng, 42);
    size_t total = (size_t)count * (size_t)(rows * n);
    uint16_t *data = store.data_block;
    for (size_t i = 0; i < total; i++) data[i] = ht_f32_to_bf16(0.02f * ht_rng_normal(&rng));
    if (ht_params_create_main(&store, HT_MAIN_COPY, &err) != HT_OK) die(err.msg);
    for (size_t i = 0; i < total; i++) store.grad_block[i] = ht_rng_normal(&rng);

    ht_muon_config cfg;
    ht_muon_config_defaults(&cfg);
    ht_param **params = malloc((size_t)count * sizeof(*params));
    if (!params) die("out of memory");
    for (int i = 0; i < count; i++) params[i] = &store.items[i];
    ht_muon opt;
    if (ht_muon_init(&opt, &cfg, params, count, &err) != HT_OK) die(err.msg);

    /* GEMM yardstick, then the NS of one matrix alone, then whole steps. */
    float *A = store.grad_block, *B = store.grad_block + n * n, *C = NULL;
    const double gemm_flop = 2.0 * (double)n * (double)n * (double)n;
    /* per matrix, r <= c: S = X Xᵀ, S S, T X per iteration */
    const double r = (double)(rows < n ? rows : n), c = (double)(rows < n ? n : rows);
    const double ns_flop = 5 * (4 * r * r * c + 2 * r * r * r);
    double nn = 0, nt = 0, gemm15 = 0, ns32 = 0, ns16 = 0;
    if (square) {
        if (!(C = ht_alloc((size_t)(n * n) * sizeof(float)))) die("out of memory");
        gemm_best(n, false, 1, A, B, C);
        gemm_best(n, true, 1, A, B, C);
        nn = gemm_best(n, false, 5, A, B, C), nt = gemm_best(n, true, 5, A, B, C);
        ns_vs_gemm(n, &cfg.schedule, 4, A, C, &gemm15, &ns32, &ns16);
        nn = fmin(nn, gemm15 / 15);
    }

    ht_muon_step(&opt, 0.02); /* warmup: first touch of the state */
    double best = INFINITY, sum = 0;
    for (int s = 0; s < steps; s++) {
        double t0 = ht_time_seconds();
        ht_muon_step(&opt, 0.02);
        double t = ht_time_seconds() - t0;
        best = fmin(best, t);
        sum += t;
    }
    double step_gflops = count * ns_flop / best * 1e-9;
    double one, batched;
    ns_one_vs_batched(count, rows, n, &cfg.schedule, opt.work_floats, 5, store.grad_block, &one, &batched);
    printf("Newton-Schulz of the %d matrices: one call each %.1f ms, batched as Muon does %.1f ms (%.2fx)\n", count,
           one * 1e3, batched * 1e3, one / batched);
    double forms[4];
    ns_forms(rows, n, &cfg.schedule, 5, store.grad_block, forms);
    printf("Newton-Schulz of one %lld x %lld matrix: FP32 standard form %.1f ms, Gram form (muon_ns_form gram) %.1f "
           "ms (%.2fx); bf16 standard %.1f ms, torch form (muon_ns_form torch) %.1f ms\n",
           (long long)rows, (long long)n, forms[0] * 1e3, forms[1] * 1e3, forms[0] / forms[1], forms[2] * 1e3,
           forms[3] * 1e3);
    if (!square) {
        printf("{\"engine\": \"hypertrain\", \"ns\": \"fp32\", \"threads\": %d, \"params\": %d, \"rows\": %lld, "
               "\"size\": %lld, \"ms_per_step_best\": %.1f, \"ms_per_step_mean\": %.1f, \"ns_gflops_step\": %.1f}\n",
               omp_get_max_threads(), count, (long long)rows, (long long)n, best * 1e3, sum / steps * 1e3, step_gflops);
        ht_muon_free(&opt);
        free(params);
        ht_params_free(&store);
        return 0;
    }
    /* The yardstick again: the machine is shared, take its better figure. */
    nn = fmin(nn, gemm_best(n, false, 5, A, B, C));
    double gemm_gflops = gemm_flop / nn * 1e-9;
    printf("ht_gemm f32 %lldx%lldx%lld: NN %.1f GFLOP/s, NT %.1f GFLOP/s\n", (long long)n, (long long)n, (long long)n,
           gemm_gflops, gemm_flop / nt * 1e-9);
    printf("Newton-Schulz alone, one matrix: f32 %.1f ms = %.1f GFLOP/s, %.0f%% of the same FLOPs of GEMM timed in "
           "turns with it (%.1f ms); bf16 operands %.1f ms = %.1f GFLOP/s\n",
           ns32 * 1e3, ns_flop / ns32 * 1e-9, 100 * gemm15 / ns32, gemm15 * 1e3, ns16 * 1e3, ns_flop / ns16 * 1e-9);
    load_average(load, sizeof(load));
    printf("{\"engine\": \"hypertrain\", \"ns\": \"fp32\", \"threads\": %d, \"params\": %d, \"size\": %lld, "
           "\"ms_per_step_best\": %.1f, \"ms_per_step_mean\": %.1f, \"ns_gflops_step\": %.1f}\n",
           omp_get_max_threads(), count, (long long)n, best * 1e3, sum / steps * 1e3, step_gflops);
    printf("whole step: %.1f GFLOP/s of Newton-Schulz = %.0f%% of GEMM (load average now %s)\n", step_gflops,
           100 * step_gflops / gemm_gflops, load);
    fflush(stdout);

    ht_muon_free(&opt);
    ht_free(C);
    free(params);
    ht_params_free(&store);
    if (!peer) return 0;
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "python3 %s/bench/peers/torch_muon_step.py --threads %d --params %d --size %lld --steps %d --ns %s",
             HT_SOURCE_DIR, omp_get_max_threads(), count, (long long)n, steps, peer_ns);
    FILE *p = popen(cmd, "r");
    if (!p) die("cannot run the PyTorch peer");
    char line[1024];
    double peer_ms = 0;
    while (fgets(line, sizeof(line), p)) {
        fputs(line, stdout);
        const char *k = strstr(line, "\"ms_per_step_best\": ");
        if (k) peer_ms = atof(k + strlen("\"ms_per_step_best\": "));
    }
    if (pclose(p) != 0 || peer_ms <= 0) die("the PyTorch peer failed");
    printf("ratio (PyTorch ms / hypertrain ms, best step): %.2fx\n", peer_ms / (best * 1e3));
    return 0;
}
