/* The kernel table's rates on one backend (the CPU's or the CUDA one):
 * GEMM TFLOP/s for bf16, f16 and f32 on an 8192³ product and on the linear
 * layers of Qwen2.5-0.5B and Llama-3.2-1B at 8 × 1024 tokens (forward,
 * backward to the input, backward to the weight), then the fused passes'
 * memory rates (RMSNorm, SwiGLU, the cross-entropy over a chunk of rows,
 * AdamW with a bf16 model copy, the sum of squares) in GB/s of the bytes
 * each must read and write, and causal attention forward and backward on
 * both models' heads and Llama-3.1-8B's (head dim 128) in TFLOP/s (the
 * products' FLOPs below the diagonal: forward 2 B H T² D, backward 2.5 times
 * that; on CUDA the own kernels, cuDNN's fused attention and AUTO's choice).
 * On CUDA each product's line follows the log's of its cuBLASLt algorithm:
 * the candidate timed fastest and the heuristic's first, ms a run of each.
 * Usage: bench_kernels [--backend cpu|cuda] [--small] (sizes / 16 and / 64:
 * a quick pass on a CPU). */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"

static const ht_kernel_ops *K;
static int64_t shrink = 1; /* --small: the GEMM sizes / 16, the passes' / 64 */

static void *alloc_or_die(size_t bytes) {
    void *p = K->alloc(bytes);
    if (!p) {
        fprintf(stderr, "bench_kernels: %s could not allocate %zu bytes\n", K->name, bytes);
        exit(1);
    }
    return p;
}

/* n values uniform in [-1, 1) in dtype, in the backend's memory: one pool
 * of POOL host values per dtype, made once and uploaded tile by tile (the
 * products' rates depend on the data: zeros run faster). */
#define POOL ((size_t)1 << 24)

static void *random_buffer(size_t n, ht_dtype dtype) {
    static void *pools[HT_DTYPE_COUNT];
    const size_t es = ht_dtype_size(dtype);
    if (!pools[dtype]) {
        float *f = malloc(POOL * sizeof(float));
        pools[dtype] = malloc(POOL * es);
        if (!f || !pools[dtype]) {
            fprintf(stderr, "bench_kernels: out of host memory\n");
            exit(1);
        }
        ht_random_uniform(f, (int64_t)POOL, 0x6b65726e656c73ULL + (uint64_t)dtype, 0);
        for (size_t i = 0; i < POOL; i++) f[i] = 2.0f * f[i] - 1.0f;
        ht_convert(pools[dtype], dtype, f, HT_DTYPE_F32, POOL);
        free(f);
    }
    char *dev = alloc_or_die(n * es);
    for (size_t at = 0; at < n; at += POOL)
        K->upload(dev + at * es, pools[dtype], (n - at < POOL ? n - at : POOL) * es);
    return dev;
}

static void check_or_die(const char *what) {
    ht_error err = {0};
    if (K->synchronize(&err) != HT_OK) {
        fprintf(stderr, "bench_kernels: %s: %s\n", what, err.msg);
        exit(1);
    }
}

/* Seconds per call of fn(arg): two calls to warm up, then as many as fill
 * 0.3 s (at least 3), the backend synchronised around them. */
static double time_calls(void (*fn)(void *), void *arg, const char *what) {
    fn(arg);
    fn(arg);
    check_or_die(what);
    int reps = 0;
    double t0 = ht_time_seconds(), t = 0;
    do {
        fn(arg);
        reps++;
        if (reps % 4 == 0 || reps < 4) {
            check_or_die(what);
            t = ht_time_seconds() - t0;
        }
    } while (reps < 3 || t < 0.3);
    check_or_die(what);
    return (ht_time_seconds() - t0) / reps;
}

/* ---------------------------------------------------------------- GEMM */

typedef struct gemm_case {
    bool ta, tb;
    int64_t M, N, K;
    ht_dtype dtype;
    void *A, *B;
    float *C;
} gemm_case;

static void run_gemm(void *arg) {
    gemm_case *g = arg;
    K->gemm(g->ta, g->tb, g->M, g->N, g->K, 1.0f, g->A, g->ta ? g->M : g->K, g->B, g->tb ? g->K : g->N, g->dtype, 0.0f,
            g->C, g->N);
}

static void bench_gemm(const char *label, bool ta, bool tb, int64_t M, int64_t N, int64_t Kd, ht_dtype dtype) {
    M = M / shrink > 0 ? M / shrink : 1, N = N / shrink > 0 ? N / shrink : 1, Kd = Kd / shrink > 0 ? Kd / shrink : 1;
    gemm_case g = {ta, tb, M, N, Kd, dtype, NULL, NULL, NULL};
    g.A = random_buffer((size_t)(M * Kd), dtype);
    g.B = random_buffer((size_t)(Kd * N), dtype);
    g.C = alloc_or_die((size_t)(M * N) * sizeof(float));
    /* the CUDA backend's choice of the shape's algorithm, timed at its first call, logged (debug) beside */
    const ht_log_level was = ht_log_get_level();
    ht_log_set_level(HT_LOG_DEBUG);
    run_gemm(&g);
    ht_log_set_level(was);
    double s = time_calls(run_gemm, &g, "gemm");
    printf("gemm %-8s %-26s M %6lld N %6lld K %6lld %c%c: %9.3f ms %8.1f TFLOP/s\n", ht_dtype_name(dtype), label,
           (long long)M, (long long)N, (long long)Kd, ta ? 'T' : 'N', tb ? 'T' : 'N', s * 1e3,
           2.0 * (double)M * (double)N * (double)Kd / s / 1e12);
    fflush(stdout);
    K->free(g.A), K->free(g.B), K->free(g.C);
}

/* A linear layer (in -> out) over `tokens` rows: its three products. */
static void bench_linear(const char *model, const char *layer, int64_t tokens, int64_t in, int64_t out,
                         ht_dtype dtype) {
    char label[64];
    snprintf(label, sizeof(label), "%s %s fwd", model, layer);
    bench_gemm(label, false, true, tokens, out, in, dtype); /* Y = X Wᵀ */
    snprintf(label, sizeof(label), "%s %s dx", model, layer);
    bench_gemm(label, false, false, tokens, in, out, dtype); /* dX = dY W */
    snprintf(label, sizeof(label), "%s %s dw", model, layer);
    bench_gemm(label, true, false, out, in, tokens, dtype); /* dW = dYᵀ X */
}

/* ---------------------------------------------------------------- the fused passes */

typedef struct pass_case {
    int64_t N, C, n;
    void *a, *b, *c, *d, *e;
    int32_t *ids;
    ht_softmax_row *rows;
    ht_adamw_hparams h;
} pass_case;

static void run_rmsnorm_forward(void *arg) {
    pass_case *p = arg;
    K->rmsnorm_forward(p->c, HT_DTYPE_BF16, p->d, p->a, p->b, HT_DTYPE_F32, p->N, p->C, 1e-6f);
}
static void run_rmsnorm_backward(void *arg) {
    pass_case *p = arg;
    K->rmsnorm_backward(p->e, p->b, p->a, p->a, p->b, HT_DTYPE_F32, p->d, p->N, p->C);
}
static void run_swiglu_forward(void *arg) {
    pass_case *p = arg;
    K->swiglu_forward(p->c, HT_DTYPE_BF16, p->a, p->b, p->n);
}
static void run_swiglu_backward(void *arg) {
    pass_case *p = arg;
    K->swiglu_backward(p->d, p->e, p->a, p->a, p->b, p->n);
}
static void run_cross_entropy(void *arg) {
    pass_case *p = arg;
    int64_t count;
    K->cross_entropy_forward(p->a, p->ids, p->N, p->C, &count, p->rows);
    K->cross_entropy_backward(p->a, p->ids, p->N, p->C, 0, 1.0f / (float)p->N, p->rows);
}
static void run_adamw(void *arg) {
    pass_case *p = arg;
    p->h.step++;
    K->adamw_pass(p->a, p->b, p->c, p->d, p->n, &p->h, p->e, HT_DTYPE_BF16, false, 0);
}
static void run_sum_squares(void *arg) {
    pass_case *p = arg;
    (void)K->sum_squares(p->a, p->n);
}

static void report(const char *what, double s, double bytes) {
    printf("%-44s %9.3f ms %8.1f GB/s\n", what, s * 1e3, bytes / s / 1e9);
    fflush(stdout);
}

static void bench_passes(void) {
    pass_case p;
    memset(&p, 0, sizeof(p));
    char what[96];

    /* RMSNorm on (8192 tokens, 2048): x f32 in, bf16 out, rstd */
    p.N = 8192 / (shrink > 1 ? 64 : 1), p.C = 2048;
    p.a = random_buffer((size_t)(p.N * p.C), HT_DTYPE_F32);
    p.b = random_buffer((size_t)p.C, HT_DTYPE_F32);
    p.c = alloc_or_die((size_t)(p.N * p.C) * 2);
    p.d = alloc_or_die((size_t)p.N * 4);
    p.e = alloc_or_die((size_t)(p.N * p.C) * 4);
    snprintf(what, sizeof(what), "rmsnorm forward (%lld, %lld) f32 -> bf16", (long long)p.N, (long long)p.C);
    report(what, time_calls(run_rmsnorm_forward, &p, "rmsnorm"), (double)(p.N * p.C) * 6);
    snprintf(what, sizeof(what), "rmsnorm backward (%lld, %lld) + dweight", (long long)p.N, (long long)p.C);
    report(what, time_calls(run_rmsnorm_backward, &p, "rmsnorm"), (double)(p.N * p.C) * 16); /* dy x read, dx rw */
    K->free(p.a), K->free(p.b), K->free(p.c), K->free(p.d), K->free(p.e);

    /* SwiGLU on 8192 x 8192 (Llama-3.2-1B's MLP width) */
    p.n = (int64_t)8192 * 8192 / (shrink > 1 ? 64 : 1);
    p.a = random_buffer((size_t)p.n, HT_DTYPE_F32);
    p.b = random_buffer((size_t)p.n, HT_DTYPE_F32);
    p.c = alloc_or_die((size_t)p.n * 2);
    p.d = alloc_or_die((size_t)p.n * 4);
    p.e = alloc_or_die((size_t)p.n * 4);
    snprintf(what, sizeof(what), "swiglu forward %lld -> bf16", (long long)p.n);
    report(what, time_calls(run_swiglu_forward, &p, "swiglu"), (double)p.n * 10);
    snprintf(what, sizeof(what), "swiglu backward %lld", (long long)p.n);
    report(what, time_calls(run_swiglu_backward, &p, "swiglu"), (double)p.n * 20);
    K->free(p.a), K->free(p.b), K->free(p.c), K->free(p.d), K->free(p.e);

    /* The cross-entropy over a chunk of 1024 rows of Qwen2.5's vocabulary: forward then backward in place */
    p.N = 1024 / (shrink > 1 ? 64 : 1), p.C = 151936;
    p.a = random_buffer((size_t)(p.N * p.C), HT_DTYPE_F32);
    int32_t *ids = malloc((size_t)p.N * sizeof(int32_t));
    for (int64_t i = 0; i < p.N; i++) ids[i] = (int32_t)((i * 7919) % p.C);
    p.ids = alloc_or_die((size_t)p.N * sizeof(int32_t));
    K->upload(p.ids, ids, (size_t)p.N * sizeof(int32_t));
    free(ids);
    p.rows = alloc_or_die((size_t)p.N * sizeof(ht_softmax_row));
    snprintf(what, sizeof(what), "cross-entropy fwd + bwd (%lld, %lld)", (long long)p.N, (long long)p.C);
    report(what, time_calls(run_cross_entropy, &p, "cross-entropy"), (double)(p.N * p.C) * 12);
    K->free(p.a), K->free(p.ids), K->free(p.rows);

    /* AdamW on 100M elements (p, g, m, v f32 and a bf16 model copy) */
    p.n = 100000000 / (shrink > 1 ? 64 : 1);
    p.a = random_buffer((size_t)p.n, HT_DTYPE_F32);
    p.b = random_buffer((size_t)p.n, HT_DTYPE_F32);
    p.c = alloc_or_die((size_t)p.n * 4);
    p.d = alloc_or_die((size_t)p.n * 4);
    p.e = alloc_or_die((size_t)p.n * 2);
    p.h = (ht_adamw_hparams){.step = 0, .lr = 1e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
    snprintf(what, sizeof(what), "adamw %lld, bf16 model copy", (long long)p.n);
    report(what, time_calls(run_adamw, &p, "adamw"), (double)p.n * 30);
    snprintf(what, sizeof(what), "sum of squares %lld", (long long)p.n);
    report(what, time_calls(run_sum_squares, &p, "sum_squares"), (double)p.n * 4);
    K->free(p.a), K->free(p.b), K->free(p.c), K->free(p.d), K->free(p.e);
}

/* ---------------------------------------------------------------- attention */

typedef struct attention_case {
    ht_attention_shape a;
    ht_dtype dtype;
    float *q, *k, *v, *out, *lse, *dout, *dq, *dk, *dv, *work;
} attention_case;

static void run_attention_forward(void *arg) {
    attention_case *c = arg;
    K->attention_forward(c->out, c->lse, NULL, c->q, c->k, c->v, &c->a, c->dtype, c->work);
}

static void run_attention_backward(void *arg) {
    attention_case *c = arg;
    K->attention_backward(c->dq, c->dk, c->dv, c->dout, c->out, c->lse, c->q, c->k, c->v, &c->a, c->dtype, c->work);
}

/* Causal attention of B sequences of T tokens, H query heads over KV, head dim D, operands rounded to dtype. */
static void bench_attention(const char *model, int64_t B, int64_t T, int H, int KV, int D, ht_dtype dtype) {
    if (shrink > 1) B = 1, T /= 4;
    attention_case c = {.a = {.B = B, .T = T, .H = H, .KV = KV, .Dk = D, .Dv = D, .scale = 1.0f / sqrtf((float)D)},
                        .dtype = dtype};
    const size_t nq = (size_t)(B * T * H * D), nk = (size_t)(B * T * KV * D);
    c.q = random_buffer(nq, HT_DTYPE_F32), c.k = random_buffer(nk, HT_DTYPE_F32);
    c.v = random_buffer(nk, HT_DTYPE_F32), c.dout = random_buffer(nq, HT_DTYPE_F32);
    c.out = alloc_or_die(nq * 4), c.lse = alloc_or_die((size_t)(B * H * T) * 4);
    c.dq = alloc_or_die(nq * 4), c.dk = alloc_or_die(nk * 4), c.dv = alloc_or_die(nk * 4);
    /* the CPU's workspace is per thread (the decoder sizes it so); a device's is one */
    const size_t threads = K->host_memory ? (size_t)omp_get_max_threads() : 1;
    c.work = alloc_or_die(threads * K->attention_workspace_floats(T, D, D) * 4 + 64);
    const double flops = 2.0 * (double)B * H * (double)T * (double)T * D;
    char what[96];
    snprintf(what, sizeof(what), "%s B %lld T %lld H %d KV %d D %d %s", model, (long long)B, (long long)T, H, KV, D,
             ht_dtype_name(dtype));
    /* On CUDA: the own kernels, cuDNN's fused attention (where it opens), and AUTO's choice between them */
    const bool cuda = strcmp(K->name, "cuda") == 0;
    char about[160] = "";
    const bool cudnn = cuda && ht_kernels_cuda_cudnn(about, sizeof(about));
    static const ht_cuda_attention paths[] = {HT_CUDA_ATTENTION_OWN, HT_CUDA_ATTENTION_CUDNN, HT_CUDA_ATTENTION_AUTO};
    static const char *const labels[] = {"own", "cudnn", "auto"};
    for (int p = 0; p < (cuda ? 3 : 1); p++) {
        if (paths[p] == HT_CUDA_ATTENTION_CUDNN && !cudnn) {
            printf("attention %-44s [cudnn] not run: %s\n", what, about);
            continue;
        }
        const ht_cuda_attention was = ht_kernels_cuda_set_attention(cuda ? paths[p] : HT_CUDA_ATTENTION_AUTO);
        const int64_t calls = ht_kernels_cuda_cudnn_calls();
        const double f = time_calls(run_attention_forward, &c, "attention_forward");
        const double b = time_calls(run_attention_backward, &c, "attention_backward");
        const bool on_cudnn = ht_kernels_cuda_cudnn_calls() > calls;
        ht_kernels_cuda_set_attention(was);
        printf("attention %-44s fwd %8.3f ms %7.1f TFLOP/s  bwd %8.3f ms %7.1f TFLOP/s%s%s%s\n", what, f * 1e3,
               flops / f / 1e12, b * 1e3, 2.5 * flops / b / 1e12, cuda ? " [" : "", cuda ? labels[p] : "",
               !cuda                               ? ""
               : paths[p] == HT_CUDA_ATTENTION_OWN ? "]"
               : on_cudnn                          ? ", cuDNN ran]"
                                                   : ", cuDNN did not run]");
        fflush(stdout);
    }
    float *bufs[] = {c.q, c.k, c.v, c.out, c.lse, c.dout, c.dq, c.dk, c.dv, c.work};
    for (size_t i = 0; i < sizeof(bufs) / sizeof(bufs[0]); i++) K->free(bufs[i]);
}

int main(int argc, char **argv) {
    const char *backend = "cuda";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--backend") == 0 && i + 1 < argc)
            backend = argv[++i];
        else if (strcmp(argv[i], "--small") == 0)
            shrink = 16;
        else {
            fprintf(stderr, "usage: bench_kernels [--backend cpu|cuda] [--small]\n");
            return 2;
        }
    }
    ht_error err = {0};
    K = strcmp(backend, "cpu") == 0 ? ht_kernels() : strcmp(backend, "cuda") == 0 ? ht_kernels_cuda(&err) : NULL;
    if (!K) {
        fprintf(stderr, "bench_kernels: no backend %s%s%s\n", backend, err.msg[0] ? ": " : "", err.msg);
        return 1;
    }
    printf("bench_kernels: backend %s%s\n", K->name, shrink > 1 ? " (--small)" : "");
    static const ht_dtype dtypes[] = {HT_DTYPE_BF16, HT_DTYPE_F16, HT_DTYPE_F32};
    for (int d = 0; d < 3; d++) bench_gemm("square", false, true, 8192, 8192, 8192, dtypes[d]);
    /* Qwen2.5-0.5B: hidden 896, MLP 4864, vocabulary 151936; Llama-3.2-1B: 2048, 8192, 128256 */
    const int64_t tokens = 8 * 1024;
    bench_linear("qwen0.5b", "mlp up", tokens, 896, 4864, HT_DTYPE_BF16);
    bench_linear("qwen0.5b", "mlp down", tokens, 4864, 896, HT_DTYPE_BF16);
    bench_linear("qwen0.5b", "lm head", tokens, 896, 151936, HT_DTYPE_BF16);
    bench_linear("llama1b", "qkv", tokens, 2048, 3072, HT_DTYPE_BF16);
    bench_linear("llama1b", "mlp up", tokens, 2048, 8192, HT_DTYPE_BF16);
    bench_linear("llama1b", "mlp down", tokens, 8192, 2048, HT_DTYPE_BF16);
    bench_linear("llama1b", "lm head", tokens, 2048, 128256, HT_DTYPE_BF16);
    bench_passes();
    bench_attention("qwen0.5b", 8, 1024, 14, 2, 64, HT_DTYPE_BF16);
    bench_attention("llama1b", 8, 1024, 32, 8, 64, HT_DTYPE_BF16);
    bench_attention("llama8b", 2, 4096, 32, 8, 128, HT_DTYPE_BF16);
    return 0;
}
