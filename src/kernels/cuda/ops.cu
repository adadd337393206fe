/* The CUDA backend's decoder kernels, the formulas of kernels/cpu/ops.c and
 * base/dtype.c: dtype conversions, RMSNorm, bias, rotary embedding, SwiGLU,
 * the cross-entropy over a chunk of rows, the embedding, moving rows,
 * dropout and the elementwise passes and sum of squares. Every reduction
 * has a fixed shape and order (no atomics): a run repeats bit for bit. */
#include "kernels/cuda/cuda.cuh"

#include <math.h>

/* ---------------------------------------------------------------- dtypes */

__global__ void convert_kernel(void *dst, ht_dtype dd, const void *src, ht_dtype sd, int64_t n) {
    CUDA_FOR(i, n) dev_store(dst, dd, i, dev_load(src, sd, i)); /* bf16 <-> f16 through f32, which holds both */
}

void cuda_convert(void *dst, ht_dtype dst_dtype, const void *src, ht_dtype src_dtype, size_t n) {
    if (n == 0 || (dst == src && dst_dtype == src_dtype)) return;
    if (dst_dtype == src_dtype) {
        cuda_ok(cudaMemcpyAsync(dst, src, n * ht_dtype_size(dst_dtype), cudaMemcpyDeviceToDevice, cuda_ctx()->stream),
                "convert (copy)");
        return;
    }
    LAUNCH("convert", convert_kernel, cuda_blocks((int64_t)n), CUDA_THREADS, dst, dst_dtype, src, src_dtype,
           (int64_t)n);
}

__global__ void round_to_kernel(float *x, int64_t n, bool bf16) {
    CUDA_FOR(i, n) x[i] = dev_from16(dev_to16(x[i], bf16), bf16);
}

void cuda_round_to(float *x, size_t n, ht_dtype precision) {
    if (n == 0 || (precision != HT_DTYPE_BF16 && precision != HT_DTYPE_F16)) return;
    LAUNCH("round_to", round_to_kernel, cuda_blocks((int64_t)n), CUDA_THREADS, x, (int64_t)n,
           precision == HT_DTYPE_BF16);
}

/* ---------------------------------------------------------------- column sums */

/* Σ over rows of a (N, C), or of a · b · rstd[row] (RMSNorm's dweight), as
 * partial sums over COL_ROWS-row chunks, then the chunks in order: the
 * same bits on every run, and every multiprocessor busy when C is a hidden
 * size. */
#define COL_ROWS 64

__global__ void column_partials_kernel(float *partial, const float *a, const float *b, const float *rstd, int64_t N,
                                       int64_t C, int64_t rows_per_chunk) {
    const int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, chunk = blockIdx.y;
    if (c >= C) return;
    const int64_t n0 = chunk * rows_per_chunk, n1 = n0 + rows_per_chunk < N ? n0 + rows_per_chunk : N;
    float s = 0.0f;
    if (b)
        for (int64_t n = n0; n < n1; n++) s += a[n * C + c] * b[n * C + c] * rstd[n];
    else
        for (int64_t n = n0; n < n1; n++) s += a[n * C + c];
    partial[chunk * C + c] = s;
}

__global__ void column_finish_kernel(float *out, const float *partial, int64_t chunks, int64_t C) {
    CUDA_FOR(c, C) {
        float s = 0.0f;
        for (int64_t k = 0; k < chunks; k++) s += partial[k * C + c];
        out[c] += s;
    }
}

static void column_sums(float *out, const float *a, const float *b, const float *rstd, int64_t N, int64_t C) {
    if (N <= 0 || C <= 0) return;
    int64_t rows = COL_ROWS, chunks = (N + rows - 1) / rows;
    if (chunks > 65535) rows = (N + 65534) / 65535, chunks = (N + rows - 1) / rows; /* gridDim.y's limit */
    float *partial = (float *)cuda_scratch((size_t)(chunks * C) * sizeof(float));
    if (!partial) return;
    dim3 grid((unsigned)((C + CUDA_THREADS - 1) / CUDA_THREADS), (unsigned)chunks);
    LAUNCH("column sums", column_partials_kernel, grid, CUDA_THREADS, partial, a, b, rstd, N, C, rows);
    LAUNCH("column sums", column_finish_kernel, cuda_blocks(C), CUDA_THREADS, out, partial, chunks, C);
}

/* ---------------------------------------------------------------- RMSNorm, bias */

/* One block per row. */
__global__ void rmsnorm_forward_kernel(void *out, ht_dtype odtype, float *rstd, const float *x, const void *weight,
                                       ht_dtype wdtype, int64_t C, float eps) {
    __shared__ float shared[32];
    const int64_t n = blockIdx.x;
    const float *xr = x + n * C;
    float ss = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) ss += xr[c] * xr[c];
    ss = block_sum(ss, shared);
    const float r = 1.0f / sqrtf(ss / (float)C + eps);
    if (threadIdx.x == 0) rstd[n] = r;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        dev_store(out, odtype, n * C + c, __fmul_rn(dev_load(weight, wdtype, c), __fmul_rn(xr[c], r)));
}

void cuda_rmsnorm_forward(void *out, ht_dtype odtype, float *rstd, const float *x, const void *weight, ht_dtype wdtype,
                          int64_t N, int64_t C, float eps) {
    if (N <= 0) return;
    LAUNCH("rmsnorm_forward", rmsnorm_forward_kernel, (unsigned)N, CUDA_THREADS, out, odtype, rstd, x, weight, wdtype,
           C, eps);
}

/* dx += r (w dy) - x r³ mean((w dy) x), one block per row (kernels/cpu/ops.c). */
__global__ void rmsnorm_backward_kernel(float *dx, const float *dout, const float *x, const void *weight,
                                        ht_dtype wdtype, const float *rstd, int64_t C) {
    __shared__ float shared[32];
    const int64_t n = blockIdx.x;
    const float *xr = x + n * C, *dy = dout + n * C;
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) dot += dev_load(weight, wdtype, c) * dy[c] * xr[c];
    dot = block_sum(dot, shared);
    const float r = rstd[n], k = dot / (float)C * r * r * r;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x)
        dx[n * C + c] += r * dev_load(weight, wdtype, c) * dy[c] - xr[c] * k;
}

void cuda_rmsnorm_backward(float *dx, float *dweight, const float *dout, const float *x, const void *weight,
                           ht_dtype wdtype, const float *rstd, int64_t N, int64_t C) {
    if (N <= 0) return;
    LAUNCH("rmsnorm_backward", rmsnorm_backward_kernel, (unsigned)N, CUDA_THREADS, dx, dout, x, weight, wdtype, rstd,
           C);
    if (dweight) column_sums(dweight, dout, x, rstd, N, C); /* dw += Σ dy x r */
}

__global__ void add_bias_kernel(float *y, const void *bias, ht_dtype bdtype, int64_t N, int64_t C) {
    CUDA_FOR(i, N * C) y[i] += dev_load(bias, bdtype, i % C);
}

void cuda_add_bias(float *y, const void *bias, ht_dtype bdtype, int64_t N, int64_t C) {
    if (N * C <= 0) return;
    LAUNCH("add_bias", add_bias_kernel, cuda_blocks(N * C), CUDA_THREADS, y, bias, bdtype, N, C);
}

void cuda_bias_backward(float *dbias, const float *dy, int64_t N, int64_t C) {
    column_sums(dbias, dy, NULL, NULL, N, C);
}

/* ---------------------------------------------------------------- rotary embedding, SwiGLU */

/* Every pair of the rotary part of every head of x rotated by sign · angle
 * (kernels/cpu/ops.c's rope_rotate): pair i is (v[i], v[i + D/2]) (rotate-half)
 * or (v[2i], v[2i + 1]) (interleaved), v the head's rotary part of token
 * row (b, t), laid out as L says. L is passed by value. */
__global__ void rope_kernel(float *x, const float *cos_t, const float *sin_t, float sign, int64_t T, ht_rope_layout L,
                            int64_t pairs) {
    const int64_t half = L.D / 2, a = L.interleave ? 2 : 1, b_off = L.interleave ? 1 : half;
    CUDA_FOR(idx, pairs) {
        const int64_t i = idx % half, head = idx / half, h = head % L.heads, row = head / L.heads; /* row: (b, t) */
        const int64_t t = row % T;
        float *v = x + row * L.ld + h * L.head_stride + L.offset;
        const float c = cos_t[t * half + i], si = sign * sin_t[t * half + i];
        const float x1 = v[a * i], x2 = v[a * i + b_off];
        v[a * i] = x1 * c - x2 * si;
        v[a * i + b_off] = x2 * c + x1 * si;
    }
}

static void rope(float *x, const float *cos_t, const float *sin_t, float sign, int64_t B, int64_t T,
                 const ht_rope_layout *L, const char *what) {
    const int64_t pairs = B * T * L->heads * (L->D / 2);
    if (pairs <= 0) return;
    LAUNCH(what, rope_kernel, cuda_blocks(pairs), CUDA_THREADS, x, cos_t, sin_t, sign, T, *L, pairs);
}

void cuda_rope_forward(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                       const ht_rope_layout *layout) {
    rope(x, cos_t, sin_t, 1.0f, B, T, layout, "rope_forward");
}

void cuda_rope_backward(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                        const ht_rope_layout *layout) {
    rope(dx, cos_t, sin_t, -1.0f, B, T, layout, "rope_backward");
}

__global__ void swiglu_forward_kernel(void *h, ht_dtype hdtype, const float *gate, const float *up, int64_t n) {
    CUDA_FOR(i, n) {
        const float g = gate[i];
        dev_store(h, hdtype, i, __fmul_rn(__fmul_rn(g, dev_sigmoid_fast(g)), up[i]));
    }
}

void cuda_swiglu_forward(void *h, ht_dtype hdtype, const float *gate, const float *up, int64_t n) {
    if (n <= 0) return;
    LAUNCH("swiglu_forward", swiglu_forward_kernel, cuda_blocks(n), CUDA_THREADS, h, hdtype, gate, up, n);
}

/* h = g s(g) u: dh/du = g s(g); dh/dg = u s(g) (1 + g (1 - s(g))). */
__global__ void swiglu_backward_kernel(float *dgate, float *dup, const float *dh, const float *gate, const float *up,
                                       int64_t n) {
    CUDA_FOR(i, n) {
        const float g = gate[i], s = dev_sigmoid_fast(g);
        dup[i] = dh[i] * g * s;
        dgate[i] = dh[i] * up[i] * s * (1.0f + g * (1.0f - s));
    }
}

void cuda_swiglu_backward(float *dgate, float *dup, const float *dh, const float *gate, const float *up, int64_t n) {
    if (n <= 0) return;
    LAUNCH("swiglu_backward", swiglu_backward_kernel, cuda_blocks(n), CUDA_THREADS, dgate, dup, dh, gate, up, n);
}

/* ---------------------------------------------------------------- cross-entropy */

/* A row's largest logit and Σ e^(x - max) (in double) in one read of it:
 * each thread keeps its own pair, rescaling its sum when its maximum
 * rises, and the pairs meet in a fixed tree (every thread gets the row's). */
#define CE_THREADS 512

__device__ __forceinline__ void pair_merge(float &m, double &s, float m2, double s2) {
    const float mx = m2 > m ? m2 : m;
    const double a = m == -INFINITY ? 0.0 : s * exp((double)m - (double)mx);
    const double b = m2 == -INFINITY ? 0.0 : s2 * exp((double)m2 - (double)mx);
    m = mx;
    s = a + b; /* symmetric in the two pairs: lanes that swap them agree */
}

__device__ ht_softmax_row row_softmax(const float *row, int64_t V) {
    __shared__ float sm[32];
    __shared__ double ss[32];
    float m = -INFINITY;
    double s = 0.0;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
        const float x = row[v];
        if (x > m) {
            s = m == -INFINITY ? 0.0 : s * exp((double)m - (double)x);
            m = x;
        }
        s += (double)dev_exp_nonpositive(x - m);
    }
    for (int o = 16; o > 0; o >>= 1)
        pair_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) sm[warp] = m, ss[warp] = s;
    __syncthreads();
    m = lane < warps ? sm[lane] : -INFINITY;
    s = lane < warps ? ss[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1)
        pair_merge(m, s, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, s, o));
    ht_softmax_row r;
    r.sum = s;
    r.max = m;
    return r;
}

/* One block per row: its term log Σ + max - x[target] (0 for an ignored row). */
__global__ void cross_entropy_rows_kernel(double *terms, const float *logits, const int32_t *targets, int64_t V,
                                          ht_softmax_row *rows) {
    const int64_t n = blockIdx.x;
    const int32_t target = targets[n];
    if (target < 0) {
        if (threadIdx.x == 0) terms[n] = 0.0;
        return;
    }
    const float *row = logits + n * V;
    const ht_softmax_row r = row_softmax(row, V);
    if (threadIdx.x == 0) {
        if (rows) rows[n] = r;
        terms[n] = log(r.sum) + (double)r.max - (double)row[target];
    }
}

/* The terms and the counted rows in one block, in a fixed order. */
__global__ void cross_entropy_total_kernel(double *result, const double *terms, const int32_t *targets, int64_t N) {
    __shared__ double shared[32];
    double t = 0.0, c = 0.0;
    for (int64_t n = threadIdx.x; n < N; n += blockDim.x) {
        t += terms[n];
        c += targets[n] >= 0 ? 1.0 : 0.0;
    }
    t = block_sum_double(t, shared);
    c = block_sum_double(c, shared);
    if (threadIdx.x == 0) result[0] = t, result[1] = c;
}

double cuda_cross_entropy_forward(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t *count,
                                  ht_softmax_row *rows) {
    if (count) *count = 0;
    if (N <= 0) return 0.0;
    double *scratch = (double *)cuda_scratch((size_t)(N + 32) * sizeof(double));
    if (!scratch) return NAN;
    double *result = scratch, *terms = scratch + 32;
    LAUNCH("cross_entropy_forward", cross_entropy_rows_kernel, (unsigned)N, CE_THREADS, terms, logits, targets, V,
           rows);
    LAUNCH("cross_entropy_forward", cross_entropy_total_kernel, 1, 1024, result, terms, targets, N);
    double host[2] = {NAN, 0.0};
    cudaStream_t s = cuda_ctx()->stream;
    if (!cuda_ok(cudaMemcpyAsync(host, result, sizeof(host), cudaMemcpyDeviceToHost, s), "cross_entropy_forward") ||
        !cuda_wait(s, "cross_entropy_forward"))
        return NAN;
    const int64_t counted = (int64_t)host[1];
    if (count) *count = counted;
    return counted ? host[0] / (double)counted : 0.0;
}

/* In place, one block per row: scale (softmax - onehot), ignored rows 0;
 * the columns are the vocabulary's [v0, v0 + V). */
__global__ void cross_entropy_backward_kernel(float *logits, const int32_t *targets, int64_t V, int64_t v0, float scale,
                                              const ht_softmax_row *rows) {
    const int64_t n = blockIdx.x;
    float *row = logits + n * V;
    const int32_t target = targets[n];
    if (target < 0) {
        for (int64_t v = threadIdx.x; v < V; v += blockDim.x) row[v] = 0.0f;
        return;
    }
    const ht_softmax_row r = rows ? rows[n] : row_softmax(row, V);
    __syncthreads(); /* every thread has read the row before any writes it */
    const float mx = r.max, k = (float)((double)scale / r.sum);
    const int64_t t = (int64_t)target - v0;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
        const float p = __fmul_rn(dev_exp_nonpositive(row[v] - mx), k);
        row[v] = v == t ? __fsub_rn(p, scale) : p;
    }
}

void cuda_cross_entropy_backward(float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0, float scale,
                                 const ht_softmax_row *rows) {
    if (N <= 0) return;
    LAUNCH("cross_entropy_backward", cross_entropy_backward_kernel, (unsigned)N, CE_THREADS, logits, targets, V, v0,
           scale, rows);
}

/* One block per row: the statistics of its columns, and its target's logit where they hold it. */
__global__ void softmax_partial_kernel(const float *logits, const int32_t *targets, int64_t V, int64_t v0,
                                       ht_softmax_row *rows, float *picked) {
    const int64_t n = blockIdx.x;
    const int32_t target = targets[n];
    const float *row = logits + n * V;
    if (target < 0) {
        if (threadIdx.x == 0) rows[n].sum = 0.0, rows[n].max = -INFINITY, picked[n] = 0.0f;
        return;
    }
    const ht_softmax_row r = row_softmax(row, V);
    if (threadIdx.x == 0) {
        const int64_t t = (int64_t)target - v0;
        rows[n] = r;
        picked[n] = t >= 0 && t < V ? row[t] : 0.0f;
    }
}

void cuda_softmax_partial(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0,
                          ht_softmax_row *rows, float *picked) {
    if (N <= 0) return;
    LAUNCH("softmax_partial", softmax_partial_kernel, (unsigned)N, CE_THREADS, logits, targets, V, v0, rows, picked);
}

/* ---------------------------------------------------------------- embedding, rows */

/* A token outside the table's rows [v0, v0 + V) gets zeros. */
__global__ void embedding_forward_kernel(float *x, const void *table, ht_dtype dtype, const int32_t *ids, int64_t N,
                                         int64_t C, int64_t v0, int64_t V) {
    CUDA_FOR(i, N * C) {
        const int64_t id = (int64_t)ids[i / C] - v0;
        x[i] = id >= 0 && id < V ? dev_load(table, dtype, id * C + i % C) : 0.0f;
    }
}

void cuda_embedding_forward(float *x, const void *table, ht_dtype dtype, const int32_t *ids, int64_t N, int64_t C,
                            int64_t v0, int64_t V) {
    if (N * C <= 0) return;
    LAUNCH("embedding_forward", embedding_forward_kernel, cuda_blocks(N * C), CUDA_THREADS, x, table, dtype, ids, N, C,
           v0, V);
}

/* The tokens of each id as a chain in token order: next[n], the next token
 * with n's id (-1: none), and first[n], whether n is its id's first. A
 * thread a token, every other token's id compared (N is a batch's tokens). */
__global__ void embedding_chains_kernel(int32_t *next, int32_t *first, const int32_t *ids, int64_t N) {
    CUDA_FOR(n, N) {
        const int32_t id = ids[n];
        int32_t after = -1, lead = 1;
        for (int64_t m = 0; m < n && lead; m++) lead = ids[m] != id;
        for (int64_t m = n + 1; m < N && after < 0; m++)
            if (ids[m] == id) after = (int32_t)m;
        next[n] = after;
        first[n] = lead;
    }
}

/* A thread per (first token of an id, column): the id's row of dtable plus
 * its tokens' rows in token order, the CPU's additions bit for bit, every
 * id's row at once. */
__global__ void embedding_backward_kernel(float *dtable, const float *dx, const int32_t *ids, const int32_t *next,
                                          const int32_t *first, int64_t N, int64_t C, int64_t v0, int64_t V) {
    CUDA_FOR(i, N * C) {
        const int64_t n = i / C, c = i % C, id = (int64_t)ids[n] - v0;
        if (!first[n] || id < 0 || id >= V) continue;
        float s = dtable[id * C + c];
        for (int64_t m = n; m >= 0; m = next[m]) s += dx[m * C + c];
        dtable[id * C + c] = s;
    }
}

void cuda_embedding_backward(float *dtable, const float *dx, const int32_t *ids, int64_t N, int64_t C, int64_t v0,
                             int64_t V) {
    if (N * C <= 0) return;
    int32_t *next = (int32_t *)cuda_scratch((size_t)(2 * N) * sizeof(int32_t)), *first = next + N;
    if (!next) return; /* the failure is the backend's */
    LAUNCH("embedding_backward (chains)", embedding_chains_kernel, cuda_blocks(N), CUDA_THREADS, next, first, ids, N);
    LAUNCH("embedding_backward", embedding_backward_kernel, cuda_blocks(N * C), CUDA_THREADS, dtable, dx, ids, next,
           first, N, C, v0, V);
}

/* Row r of dst <- row idx[r] of src (gather), or row idx[r] of dst <- row r of src (scatter). */
template <typename word>
__global__ void move_rows_kernel(word *dst, const word *src, const int32_t *idx, int64_t rows, int64_t words,
                                 bool scatter) {
    CUDA_FOR(i, rows * words) {
        const int64_t r = i / words, w = i % words, other = idx[r];
        if (scatter)
            dst[other * words + w] = src[r * words + w];
        else
            dst[r * words + w] = src[other * words + w];
    }
}

static void move_rows(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes, bool scatter) {
    if (rows <= 0 || row_bytes == 0) return;
    if (row_bytes % 4 == 0 && (uintptr_t)dst % 4 == 0 && (uintptr_t)src % 4 == 0) {
        const int64_t words = (int64_t)(row_bytes / 4);
        LAUNCH("move rows", move_rows_kernel<uint32_t>, cuda_blocks(rows * words), CUDA_THREADS, (uint32_t *)dst,
               (const uint32_t *)src, idx, rows, words, scatter);
    } else {
        const int64_t words = (int64_t)row_bytes;
        LAUNCH("move rows", move_rows_kernel<uint8_t>, cuda_blocks(rows * words), CUDA_THREADS, (uint8_t *)dst,
               (const uint8_t *)src, idx, rows, words, scatter);
    }
}

void cuda_gather_rows(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes) {
    move_rows(dst, src, idx, rows, row_bytes, false);
}

void cuda_scatter_rows(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes) {
    move_rows(dst, src, idx, rows, row_bytes, true);
}

/* ---------------------------------------------------------------- dropout */

/* kernels/cpu/ops.c's mask: element (n, c) dropped when a 24-bit uniform from
 * (seed, site, token0 + n, c) falls below p. */
__global__ void dropout_kernel(float *x, int64_t N, int64_t cols, uint32_t threshold, float keep, uint64_t seed,
                               uint64_t site, int64_t token0) {
    CUDA_FOR(i, N * cols) {
        const int64_t n = i / cols, c = i % cols;
        const uint64_t row = dev_mix64(seed ^ dev_mix64(site | (uint64_t)(token0 + n)));
        x[i] = (uint32_t)(dev_mix64(row + (uint64_t)c) >> 40) < threshold ? 0.0f : x[i] * keep;
    }
}

void cuda_dropout(float *x, int64_t N, int64_t cols, float p, uint64_t seed, uint64_t site, int64_t token0) {
    if (N * cols <= 0) return;
    const uint32_t threshold = (uint32_t)(p * 16777216.0 + 0.5);
    const float keep = 1.0f / (1.0f - p);
    LAUNCH("dropout", dropout_kernel, cuda_blocks(N * cols), CUDA_THREADS, x, N, cols, threshold, keep, seed, site,
           token0);
}

/* ---------------------------------------------------------------- elementwise, sum of squares */

__global__ void add_kernel(float *y, const float *x, const float *a, int64_t n) { CUDA_FOR(i, n) y[i] = x[i] + a[i]; }
__global__ void accumulate_kernel(float *y, const float *x, int64_t n) { CUDA_FOR(i, n) y[i] += x[i]; }
__global__ void scale_kernel(float *x, int64_t n, float k) { CUDA_FOR(i, n) x[i] *= k; }

void cuda_add(float *y, const float *x, const float *a, int64_t n) {
    if (n > 0) LAUNCH("add", add_kernel, cuda_blocks(n), CUDA_THREADS, y, x, a, n);
}
void cuda_accumulate(float *y, const float *x, int64_t n) {
    if (n > 0) LAUNCH("accumulate", accumulate_kernel, cuda_blocks(n), CUDA_THREADS, y, x, n);
}
__global__ void copy_rows_kernel(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows,
                                 int64_t cols, bool accumulate) {
    CUDA_FOR(i, rows * cols) {
        const int64_t r = i / cols, c = i % cols;
        const float v = src[r * src_ld + c];
        dst[r * dst_ld + c] = accumulate ? dst[r * dst_ld + c] + v : v;
    }
}
void cuda_copy_rows(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows, int64_t cols,
                    bool accumulate) {
    if (rows > 0 && cols > 0)
        LAUNCH("copy_rows", copy_rows_kernel, cuda_blocks(rows * cols), CUDA_THREADS, dst, dst_ld, src, src_ld, rows,
               cols, accumulate);
}
void cuda_scale(float *x, int64_t n, float k) {
    if (n > 0) LAUNCH("scale", scale_kernel, cuda_blocks(n), CUDA_THREADS, x, n, k);
}

/* Σ x² in double: SS_BLOCKS blocks (a number fixed here, not by the device,
 * so every GPU sums in the same order), each over a fixed stride, then
 * their partials in one block. sum_squares_each does the same for up to
 * SS_GROUP tensors a launch (blockIdx.y the tensor), the same partials in
 * the same order: each tensor's sum is sum_squares's bits. */
#define SS_BLOCKS 512
#define SS_GROUP 32

struct ss_group {
    const float *x[SS_GROUP];
    int64_t n[SS_GROUP];
};

__global__ void sum_squares_partials_kernel(double *partial, const ss_group g) {
    __shared__ double shared[32];
    const float *x = g.x[blockIdx.y];
    const int64_t n = g.n[blockIdx.y];
    double s = 0.0;
    CUDA_FOR(i, n) s += (double)x[i] * (double)x[i];
    s = block_sum_double(s, shared);
    if (threadIdx.x == 0) partial[blockIdx.y * SS_BLOCKS + blockIdx.x] = s;
}

/* out[b] = the sum of partial row b's SS_BLOCKS: a block a tensor. */
__global__ void sum_squares_total_kernel(double *out, const double *partial) {
    __shared__ double shared[32];
    double s = block_sum_double(partial[blockIdx.x * SS_BLOCKS + threadIdx.x], shared);
    if (threadIdx.x == 0) out[blockIdx.x] = s;
}

/* out[i] (device memory) = Σ x[i]², i < count <= SS_GROUP, queued; partial
 * holds SS_GROUP * SS_BLOCKS doubles. */
static void sum_squares_group(double *out, double *partial, const float *const *x, const int64_t *n, int count) {
    ss_group g = {};
    for (int i = 0; i < count; i++) g.x[i] = x[i], g.n[i] = n[i];
    LAUNCH("sum_squares", sum_squares_partials_kernel, dim3(SS_BLOCKS, (unsigned)count), CUDA_THREADS, partial, g);
    LAUNCH("sum_squares", sum_squares_total_kernel, (unsigned)count, SS_BLOCKS, out, partial);
}

void cuda_sum_squares_into(double *out, const float *x, int64_t n) {
    double *partial = (double *)cuda_scratch(SS_GROUP * SS_BLOCKS * sizeof(double));
    if (partial) sum_squares_group(out, partial, &x, &n, 1);
}

/* Every tensor's sum into the scratch after the partials, then one wait. */
void cuda_sum_squares_each(double *sums, const float *const *x, const int64_t *n, int count) {
    if (count <= 0) return;
    double *partial = (double *)cuda_scratch((SS_GROUP * SS_BLOCKS + (size_t)count) * sizeof(double));
    if (!partial) {
        for (int i = 0; i < count; i++) sums[i] = NAN;
        return;
    }
    double *out = partial + SS_GROUP * SS_BLOCKS;
    for (int i = 0; i < count; i += SS_GROUP)
        sum_squares_group(out + i, partial, x + i, n + i, count - i < SS_GROUP ? count - i : SS_GROUP);
    cudaStream_t s = cuda_ctx()->stream;
    if (!cuda_ok(cudaMemcpyAsync(sums, out, (size_t)count * sizeof(double), cudaMemcpyDeviceToHost, s),
                 "sum_squares") ||
        !cuda_wait(s, "sum_squares"))
        for (int i = 0; i < count; i++) sums[i] = NAN;
}

double cuda_sum_squares(const float *x, int64_t n) {
    double s = 0.0;
    if (n > 0) cuda_sum_squares_each(&s, &x, &n, 1);
    return s;
}
