/* The decoder's elementwise and reduction kernels (forward and backward) in
 * FP32, matching Hugging Face's Qwen2/Llama definitions. Rows are split
 * across OpenMP threads; reductions accumulate in FP32 per row, as PyTorch does. */
#include "kernels/cpu/ops.h"

#include "kernels/cpu/exp.h"
#include "kernels/cpu/reduce.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Loads n weights of any float dtype into FP32 scratch (n is a row width: small). */
static void load_row_f32(float *dst, const void *src, ht_dtype dtype, int64_t n) {
    ht_convert(dst, HT_DTYPE_F32, src, dtype, (size_t)n);
}

static void store_row(void *dst, ht_dtype dtype, int64_t offset, const float *src, int64_t n) {
    if (dtype == HT_DTYPE_F32) {
        memcpy((float *)dst + offset, src, (size_t)n * sizeof(float));
        return;
    }
    ht_convert((uint16_t *)dst + offset, dtype, src, HT_DTYPE_F32, (size_t)n);
}

void ht_rmsnorm_forward(void *out, ht_dtype odtype, float *rstd, const float *x, const void *weight, ht_dtype wdtype,
                        int64_t N, int64_t C, float eps) {
#pragma omp parallel
    {
        float w[C], row[C]; /* C is a hidden size: small enough for the stack */
        load_row_f32(w, weight, wdtype, C);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *xr = x + n * C;
            float ss = 0.0f;
            for (int64_t c = 0; c < C; c++) ss += xr[c] * xr[c];
            float r = 1.0f / sqrtf(ss / (float)C + eps);
            rstd[n] = r;
            for (int64_t c = 0; c < C; c++) row[c] = w[c] * (xr[c] * r);
            store_row(out, odtype, n * C, row, C);
        }
    }
}

/* out[c] += Σ_t partial[t][c] over nt threads in thread order, this thread
 * (id) taking its share of the columns. Called inside the parallel region,
 * after a barrier: never a critical section's arrival order, so a run
 * repeats bit for bit. */
static void add_partials_in_thread_order(float *out, const float *partial, int nt, int id, int64_t C) {
    for (int64_t c = C * id / nt; c < C * (id + 1) / nt; c++)
        for (int t = 0; t < nt; t++) out[c] += partial[(size_t)t * (size_t)C + (size_t)c];
}

void ht_rmsnorm_backward(float *dx, float *dweight, const float *dout, const float *x, const void *weight,
                         ht_dtype wdtype, const float *rstd, int64_t N, int64_t C) {
    /* y = w * x * r with r = (mean(x^2) + eps)^-1/2:
     * dw += dy * x * r;  dx += r * (w*dy) - x * r^3 * mean((w*dy) * x). */
    /* Per-thread partial dw, summed in thread order. Without the memory for
     * them, one thread does it all, its partial on the stack. */
    float *partial = malloc((size_t)omp_get_max_threads() * (size_t)C * sizeof(float)), alone[partial ? 1 : C];
    float *partials = partial ? partial : alone;
#pragma omp parallel num_threads(partial ? omp_get_max_threads() : 1)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float w[C], *dw_local = partials + (size_t)id * (size_t)C;
        load_row_f32(w, weight, wdtype, C);
        memset(dw_local, 0, (size_t)C * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const float *xr = x + n * C, *dy = dout + n * C;
            float *dxr = dx + n * C;
            float r = rstd[n];
            float dot = 0.0f;
            for (int64_t c = 0; c < C; c++) dot += w[c] * dy[c] * xr[c];
            if (dweight)
                for (int64_t c = 0; c < C; c++) dw_local[c] += dy[c] * xr[c] * r;
            float k = dot / (float)C * r * r * r;
            for (int64_t c = 0; c < C; c++) dxr[c] += r * w[c] * dy[c] - xr[c] * k;
        }
        /* (the omp for ends with a barrier: every partial is complete) */
        if (dweight) add_partials_in_thread_order(dweight, partials, nt, id, C);
    }
    free(partial);
}

void ht_add_bias(float *y, const void *bias, ht_dtype bdtype, int64_t N, int64_t C) {
#pragma omp parallel
    {
        float b[C];
        load_row_f32(b, bias, bdtype, C);
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t c = 0; c < C; c++) y[n * C + c] += b[c];
    }
}

void ht_bias_backward(float *dbias, const float *dy, int64_t N, int64_t C) {
    /* Per-thread partials summed in thread order, as in ht_rmsnorm_backward (one thread without the memory). */
    float *partial = malloc((size_t)omp_get_max_threads() * (size_t)C * sizeof(float)), alone[partial ? 1 : C];
    float *partials = partial ? partial : alone;
#pragma omp parallel num_threads(partial ? omp_get_max_threads() : 1)
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        float *acc = partials + (size_t)id * (size_t)C;
        memset(acc, 0, (size_t)C * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++)
            for (int64_t c = 0; c < C; c++) acc[c] += dy[n * C + c];
        add_partials_in_thread_order(dbias, partials, nt, id, C);
    }
    free(partial);
}

/* Rotates the rotary part of every head of x by +-angle: the forward pass
 * rotates by the angle, its backward by minus it. Pair i is (v[i],
 * v[i + D/2]) (rotate-half form) or (v[2i], v[2i + 1]) (interleaved). */
static void rope_rotate(float *x, const float *cos_t, const float *sin_t, float sign, int64_t B, int64_t T,
                        const ht_rope_layout *L) {
    const int64_t half = L->D / 2, a = L->interleave ? 2 : 1, b_off = L->interleave ? 1 : half;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; b++) {
        for (int64_t t = 0; t < T; t++) {
            const float *c = cos_t + t * half, *s = sin_t + t * half;
            for (int64_t h = 0; h < L->heads; h++) {
                float *v = x + (b * T + t) * L->ld + h * L->head_stride + L->offset;
                for (int64_t i = 0; i < half; i++) {
                    float x1 = v[a * i], x2 = v[a * i + b_off], si = sign * s[i];
                    v[a * i] = x1 * c[i] - x2 * si;
                    v[a * i + b_off] = x2 * c[i] + x1 * si;
                }
            }
        }
    }
}

void ht_rope_forward(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T, const ht_rope_layout *L) {
    rope_rotate(x, cos_t, sin_t, 1.0f, B, T, L);
}

void ht_rope_backward(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                      const ht_rope_layout *L) {
    rope_rotate(dx, cos_t, sin_t, -1.0f, B, T, L);
}

static inline float sigmoidf(float x) { return sigmoid_fast(x); }

void ht_swiglu_forward(void *h, ht_dtype hdtype, const float *gate, const float *up, int64_t n) {
    const int64_t chunk = 4096;
#pragma omp parallel for schedule(static)
    for (int64_t start = 0; start < n; start += chunk) {
        float tmp[4096];
        int64_t len = n - start < chunk ? n - start : chunk;
        for (int64_t i = 0; i < len; i++) {
            float g = gate[start + i];
            tmp[i] = g * sigmoidf(g) * up[start + i];
        }
        store_row(h, hdtype, start, tmp, len);
    }
}

void ht_swiglu_backward(float *dgate, float *dup, const float *dh, const float *gate, const float *up, int64_t n) {
    /* h = g s(g) u: dh/du = g s(g); dh/dg = u s(g) (1 + g (1 - s(g))). */
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float g = gate[i], s = sigmoidf(g);
        dup[i] = dh[i] * g * s;
        dgate[i] = dh[i] * up[i] * s * (1.0f + g * (1.0f - s));
    }
}

/* Per-thread double partials are combined in thread order (see ht_sum_squares);
 * at most this many threads take part. */
#define HT_MAX_THREADS 256

/* A row's largest logit and Σ e^(x - max) in one pass over it: block by
 * block (4 KiB, in L1 for the second look), the running sum rescaled when a
 * block raises the maximum. Each term within 2 ulp of expf, summed in
 * double: the sum within 2.4e-7 of itself. */
enum { SOFTMAX_BLOCK = 1024 };

static ht_softmax_row softmax_row(const float *row, int64_t V) {
    float mx = -INFINITY;
    double sum = 0.0;
    for (int64_t v0 = 0; v0 < V; v0 += SOFTMAX_BLOCK) {
        const int64_t len = V - v0 < SOFTMAX_BLOCK ? V - v0 : SOFTMAX_BLOCK;
        const float *x = row + v0;
        float bm = max_of(x, len, mx);
        if (bm > mx) {
            sum = mx == -INFINITY ? 0.0 : sum * exp((double)mx - (double)bm);
            mx = bm;
        }
        double s = 0.0;
#pragma omp simd reduction(+ : s)
        for (int64_t v = 0; v < len; v++) s += (double)exp_nonpositive(x[v] - mx);
        sum += s;
    }
    return (ht_softmax_row){.sum = sum, .max = mx};
}

double ht_cross_entropy_forward(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t *count,
                                ht_softmax_row *rows) {
    double partial[HT_MAX_THREADS] = {0};
    int64_t counted = 0, nthreads = 1;
    int threads = omp_get_max_threads() < HT_MAX_THREADS ? omp_get_max_threads() : HT_MAX_THREADS;
#pragma omp parallel num_threads(threads) reduction(+ : counted)
    {
        int id = omp_get_thread_num();
#pragma omp single
        nthreads = omp_get_num_threads();
        double total = 0.0;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            if (targets[n] < 0) continue;
            const float *row = logits + n * V;
            ht_softmax_row r = softmax_row(row, V);
            if (rows) rows[n] = r;
            total += log(r.sum) + (double)r.max - (double)row[targets[n]];
            counted++;
        }
        partial[id] = total;
    }
    double total = 0.0;
    for (int64_t t = 0; t < nthreads; t++) total += partial[t];
    if (count) *count = counted;
    return counted ? total / (double)counted : 0.0;
}

double ht_sum_squares(const float *x, int64_t n) {
    double partial[HT_MAX_THREADS] = {0};
    int nthreads = 1;
    int threads = omp_get_max_threads() < HT_MAX_THREADS ? omp_get_max_threads() : HT_MAX_THREADS;
#pragma omp parallel num_threads(threads) if (n > 65536)
    {
        int id = omp_get_thread_num();
#pragma omp single
        nthreads = omp_get_num_threads();
        double sum = 0.0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n; i++) sum += (double)x[i] * (double)x[i];
        partial[id] = sum;
    }
    double total = 0.0;
    for (int t = 0; t < nthreads; t++) total += partial[t];
    return total;
}

void ht_sum_squares_each(double *sums, const float *const *x, const int64_t *n, int count) {
    for (int i = 0; i < count; i++) sums[i] = ht_sum_squares(x[i], n[i]);
}

void ht_cross_entropy_backward(float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0, float scale,
                               const ht_softmax_row *rows) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *row = logits + n * V;
        if (targets[n] < 0) {
            memset(row, 0, (size_t)V * sizeof(float));
            continue;
        }
        const ht_softmax_row r = rows ? rows[n] : softmax_row(row, V);
        const float mx = r.max, k = (float)(scale / r.sum);
#pragma omp simd
        for (int64_t v = 0; v < V; v++) row[v] = exp_nonpositive(row[v] - mx) * k;
        const int64_t t = (int64_t)targets[n] - v0;
        if (t >= 0 && t < V) row[t] -= scale;
    }
}

void ht_softmax_partial(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0,
                        ht_softmax_row *rows, float *picked) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *row = logits + n * V;
        const int64_t t = (int64_t)targets[n] - v0;
        rows[n] = targets[n] < 0 ? (ht_softmax_row){.sum = 0.0, .max = -INFINITY} : softmax_row(row, V);
        picked[n] = targets[n] >= 0 && t >= 0 && t < V ? row[t] : 0.0f;
    }
}

void ht_add(float *y, const float *x, const float *a, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) y[i] = x[i] + a[i];
}

void ht_accumulate(float *y, const float *x, int64_t n) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

void ht_copy_rows(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows, int64_t cols,
                  bool accumulate) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        float *d = dst + r * dst_ld;
        const float *s = src + r * src_ld;
        if (accumulate) {
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) d[c] += s[c];
        } else {
            memcpy(d, s, (size_t)cols * sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------ embedding */

void ht_embedding_forward(float *x, const void *table, ht_dtype dtype, const int32_t *ids, int64_t N, int64_t C,
                          int64_t v0, int64_t V) {
    const size_t row = (size_t)C * ht_dtype_size(dtype);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int64_t id = (int64_t)ids[n] - v0;
        if (id >= 0 && id < V)
            ht_convert(x + n * C, HT_DTYPE_F32, (const char *)table + (size_t)id * row, dtype, (size_t)C);
        else
            memset(x + n * C, 0, (size_t)C * sizeof(float));
    }
}

/* Threads split the columns, so that no two write the same float (ids repeat). */
void ht_embedding_backward(float *dtable, const float *dx, const int32_t *ids, int64_t N, int64_t C, int64_t v0,
                           int64_t V) {
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), id = omp_get_thread_num();
        int64_t c0 = C * id / nt, c1 = C * (id + 1) / nt;
        for (int64_t n = 0; n < N; n++) {
            const int64_t row = (int64_t)ids[n] - v0;
            if (row < 0 || row >= V) continue;
            float *dst = dtable + row * C;
            const float *src = dx + n * C;
            for (int64_t c = c0; c < c1; c++) dst[c] += src[c];
        }
    }
}

/* ------------------------------------------------------------------ dropout */

/* splitmix64's finaliser: a counter-based stream, so that backward and a
 * resumed run redraw any mask from its coordinates alone. */
static inline uint64_t mix64(uint64_t z) {
    z += 0x9e3779b97f4a7c15ULL;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

void ht_dropout(float *x, int64_t N, int64_t cols, float p, uint64_t seed, uint64_t site, int64_t token0) {
    const uint32_t threshold = (uint32_t)(p * 16777216.0 + 0.5);
    const float keep = 1.0f / (1.0f - p);
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        uint64_t row = mix64(seed ^ mix64(site | (uint64_t)(token0 + n)));
        float *xr = x + n * cols;
        for (int64_t c = 0; c < cols; c++)
            xr[c] = (uint32_t)(mix64(row + (uint64_t)c) >> 40) < threshold ? 0.0f : xr[c] * keep;
    }
}
