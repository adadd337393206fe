/* The kernels of Qwen2-MoE's sparse block (model/moe.c decides what runs
 * where; the arithmetic is here): the router's softmax and top-k, moving
 * rows by an index, the weighted combination of the experts' outputs with
 * the gated shared expert, and their backward passes. */
#include "kernels/ops.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

static inline float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

void ht_moe_route(float *probs, int32_t *sel, float *weight, float *psum, int64_t N, int E, int k, bool norm) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *p = probs + n * E;
        float mx = p[0], sum = 0.0f;
        for (int e = 1; e < E; e++) mx = p[e] > mx ? p[e] : mx;
        for (int e = 0; e < E; e++) {
            p[e] = expf(p[e] - mx);
            sum += p[e];
        }
        for (int e = 0; e < E; e++) p[e] /= sum;
        int32_t *s = sel + n * k;
        float *w = weight + n * k, total = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++) {
                bool taken = false;
                for (int i = 0; i < j; i++) taken = taken || s[i] == e;
                if (!taken && (best < 0 || p[e] > p[best])) best = e;
            }
            s[j] = best;
            w[j] = p[best];
            total += p[best];
        }
        psum[n] = total;
        if (norm)
            for (int j = 0; j < k; j++) w[j] /= total;
    }
}

void ht_gather_rows(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        memcpy((char *)dst + (size_t)r * row_bytes, (const char *)src + (size_t)idx[r] * row_bytes, row_bytes);
}

void ht_scatter_rows(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        memcpy((char *)dst + (size_t)idx[r] * row_bytes, (const char *)src + (size_t)r * row_bytes, row_bytes);
}

void ht_moe_combine(float *y, const float *ye, const int32_t *pos, const int32_t *sel, const float *weight,
                    const float *z, const float *so, int64_t N, int k, int64_t C) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int32_t *s = sel + n * k;
        int order[k];
        for (int j = 0; j < k; j++) {
            int i = j;
            while (i > 0 && s[order[i - 1]] > s[j]) order[i] = order[i - 1], i--;
            order[i] = j;
        }
        float *yn = y + n * C;
        memset(yn, 0, (size_t)C * sizeof(float));
        for (int i = 0; i < k; i++) {
            const int j = order[i];
            const float w = weight[n * k + j];
            const float *e = ye + (int64_t)pos[n * k + j] * C;
            for (int64_t c = 0; c < C; c++) yn[c] += e[c] * w;
        }
        const float g = sigmoidf(z[n]);
        const float *sn = so + n * C;
        for (int64_t c = 0; c < C; c++) yn[c] += g * sn[c];
    }
}

void ht_moe_combine_backward(float *dso, float *dz, float *dw, float *dye, const float *dy, const float *ye,
                             const float *so, const float *z, const int32_t *pos, const float *weight, int64_t N, int k,
                             int64_t C) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float g = sigmoidf(z[n]);
        const float *dyn = dy + n * C, *sn = so + n * C;
        float *dsn = dso + n * C, dot = 0.0f;
        for (int64_t c = 0; c < C; c++) {
            dot += dyn[c] * sn[c];
            dsn[c] = g * dyn[c];
        }
        dz[n] = dot * g * (1.0f - g);
        for (int j = 0; j < k; j++) {
            const int64_t r = pos[n * k + j];
            const float w = weight[n * k + j], *e = ye + r * C;
            float *de = dye + r * C, d = 0.0f;
            for (int64_t c = 0; c < C; c++) {
                d += dyn[c] * e[c];
                de[c] = w * dyn[c];
            }
            dw[n * k + j] = d;
        }
    }
}

void ht_moe_route_backward(float *dp, const float *probs, const int32_t *sel, const float *weight, const float *dw,
                           const float *psum, const float *aux_grad, int64_t N, int E, int k, bool norm) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *pn = probs + n * E;
        float *d = dp + n * E;
        for (int e = 0; e < E; e++) d[e] = aux_grad ? aux_grad[e] : 0.0f;
        const float *w = weight + n * k, *dwn = dw + n * k;
        float inner = 0.0f;
        if (norm)
            for (int j = 0; j < k; j++) inner += dwn[j] * w[j];
        for (int j = 0; j < k; j++) d[sel[n * k + j]] += norm ? (dwn[j] - inner) / psum[n] : dwn[j];
        float dot = 0.0f;
        for (int e = 0; e < E; e++) dot += pn[e] * d[e];
        for (int e = 0; e < E; e++) d[e] = pn[e] * (d[e] - dot);
    }
}

void ht_moe_scatter_add(float *dx, const float *dxs, const int32_t *pos, int64_t N, int k, int64_t C) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *dxn = dx + n * C;
        for (int j = 0; j < k; j++) {
            const float *src = dxs + (int64_t)pos[n * k + j] * C;
            for (int64_t c = 0; c < C; c++) dxn[c] += src[c];
        }
    }
}
