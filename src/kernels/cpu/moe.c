/* The kernels of the sparse blocks (model/moe.c decides what runs where;
 * the arithmetic is here): Qwen2-MoE's softmax top-k router and DeepSeek-V3's
 * grouped sigmoid router, moving rows by an index, the weighted combination
 * of the experts' outputs with the shared expert (gated or not), and their
 * backward passes. */
#include "kernels/cpu/ops.h"

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
        if (!so) continue; /* no shared expert */
        const float *sn = so + n * C;
        if (!z) { /* ungated (DeepSeek-V3): added as it is */
            for (int64_t c = 0; c < C; c++) yn[c] += sn[c];
            continue;
        }
        const float g = sigmoidf(z[n]);
        for (int64_t c = 0; c < C; c++) yn[c] += g * sn[c];
    }
}

void ht_moe_combine_backward(float *dso, float *dz, float *dw, float *dye, const float *dy, const float *ye,
                             const float *so, const float *z, const int32_t *pos, const float *weight, int64_t N, int k,
                             int64_t C) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *dyn = dy + n * C;
        if (so && z) {
            const float g = sigmoidf(z[n]), *sn = so + n * C;
            float *dsn = dso + n * C, dot = 0.0f;
            for (int64_t c = 0; c < C; c++) {
                dot += dyn[c] * sn[c];
                dsn[c] = g * dyn[c];
            }
            dz[n] = dot * g * (1.0f - g);
        } else if (so) {
            memcpy(dso + n * C, dyn, (size_t)C * sizeof(float));
        }
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

void ht_moe_route_grouped(float *scores, int32_t *sel, float *weight, float *psum, const float *bias, int64_t N, int E,
                          int k, int n_group, int topk_group, bool norm, float scaling) {
    const int per = E / n_group;
    const bool every_group = topk_group >= n_group; /* nothing to leave out: the group scores do not matter */
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float *s = scores + n * E, b[E];
        bool allowed[E];
        for (int e = 0; e < E; e++) {
            s[e] = sigmoidf(s[e]);
            b[e] = bias ? s[e] + bias[e] : s[e];
            allowed[e] = every_group;
        }
        if (!every_group) {
            float g[n_group];
            bool kept[n_group];
            for (int q = 0; q < n_group; q++) {
                float m1 = -INFINITY, m2 = -INFINITY; /* the group's two largest, m1 >= m2 */
                for (int e = q * per; e < (q + 1) * per; e++) {
                    if (b[e] > m1) {
                        m2 = m1;
                        m1 = b[e];
                    } else if (b[e] > m2) {
                        m2 = b[e];
                    }
                }
                g[q] = m1 + m2;
                kept[q] = false;
            }
            for (int t = 0; t < topk_group; t++) {
                int best = -1;
                for (int q = 0; q < n_group; q++)
                    if (!kept[q] && (best < 0 || g[q] > g[best])) best = q;
                kept[best] = true;
            }
            for (int e = 0; e < E; e++) allowed[e] = kept[e / per];
        }
        int32_t *sn = sel + n * k;
        float *w = weight + n * k, total = 0.0f;
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < E; e++)
                if (allowed[e] && (best < 0 || b[e] > b[best])) best = e;
            allowed[best] = false; /* taken */
            sn[j] = best;
            w[j] = s[best];
            total += s[best];
        }
        psum[n] = norm ? total + 1e-20f : total;
        for (int j = 0; j < k; j++) w[j] = (norm ? w[j] / psum[n] : w[j]) * scaling;
    }
}

/* With c = scaling and D = psum (the chosen scores' sum + 1e-20), the
 * weights are w_j = c s_j / D (norm) or c s_j, so
 *   dL/ds_i = sum_j dw_j dw_j/ds_i = (c dw_i - sum_j dw_j w_j) / D   (norm)
 *           = c dw_i                                                 (otherwise)
 * for each chosen expert i, and dz = ds s (1 - s) through the sigmoid. The
 * choice (groups, top-k, the correction bias) is a step function of the
 * scores: no gradient through it, and none into the bias. */
void ht_moe_route_grouped_backward(float *dz, const float *scores, const int32_t *sel, const float *weight,
                                   const float *dw, const float *psum, int64_t N, int E, int k, bool norm,
                                   float scaling) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *s = scores + n * E, *w = weight + n * k, *dwn = dw + n * k;
        float *d = dz + n * E, inner = 0.0f;
        memset(d, 0, (size_t)E * sizeof(float));
        if (norm)
            for (int j = 0; j < k; j++) inner += dwn[j] * w[j];
        for (int j = 0; j < k; j++) {
            const int e = sel[n * k + j];
            const float ds = norm ? (scaling * dwn[j] - inner) / psum[n] : scaling * dwn[j];
            d[e] = ds * s[e] * (1.0f - s[e]);
        }
    }
}
