/* The CUDA backend's kernels of Qwen2-MoE's sparse block, kernels/cpu/moe.c's
 * formulas in its orders: the router's softmax and top-k (a thread per
 * token: E and k are small), the combination of the experts' outputs with
 * the gated shared expert and the backward passes (a block per token). */
#include "kernels/cuda/cuda.cuh"

#include <math.h>
#include <stdio.h>

#define MOE_THREADS 128
#define MOE_MAX_K 32 /* the combination's order of the k choices lives in registers */

__device__ __forceinline__ float moe_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__global__ void moe_route_kernel(float *probs, int32_t *sel, float *weight, float *psum, int64_t N, int E, int k,
                                 bool norm) {
    CUDA_FOR(n, N) {
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

void cuda_moe_route(float *probs, int32_t *sel, float *weight, float *psum, int64_t N, int E, int k, bool norm) {
    if (N <= 0) return;
    LAUNCH("moe_route", moe_route_kernel, cuda_blocks(N), CUDA_THREADS, probs, sel, weight, psum, N, E, k, norm);
}

/* y[n] = Σ_j weight ye[pos] in increasing expert order, + sigmoid(z) so[n]. */
__global__ void moe_combine_kernel(float *y, const float *ye, const int32_t *pos, const int32_t *sel,
                                   const float *weight, const float *z, const float *so, int k, int64_t C) {
    const int64_t n = blockIdx.x;
    const int32_t *s = sel + n * k;
    int order[MOE_MAX_K];
    for (int j = 0; j < k; j++) {
        int i = j;
        while (i > 0 && s[order[i - 1]] > s[j]) order[i] = order[i - 1], i--;
        order[i] = j;
    }
    const float g = moe_sigmoid(z[n]);
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = 0.0f;
        for (int i = 0; i < k; i++) {
            const int j = order[i];
            acc += ye[(int64_t)pos[n * k + j] * C + c] * weight[n * k + j];
        }
        y[n * C + c] = acc + g * so[n * C + c];
    }
}

static bool k_fits(int k, const char *what) {
    if (k <= MOE_MAX_K) return true;
    char detail[64];
    snprintf(detail, sizeof(detail), "k %d above %d", k, MOE_MAX_K);
    return cuda_fail(what, detail);
}

void cuda_moe_combine(float *y, const float *ye, const int32_t *pos, const int32_t *sel, const float *weight,
                      const float *z, const float *so, int64_t N, int k, int64_t C) {
    if (N <= 0 || !k_fits(k, "moe_combine")) return;
    LAUNCH("moe_combine", moe_combine_kernel, (unsigned)N, MOE_THREADS, y, ye, pos, sel, weight, z, so, k, C);
}

/* dso = sigmoid(z) dy, dz = (dy · so) g (1 - g), dw[n, j] = dy · ye[pos], dye[pos] = weight dy. */
__global__ void moe_combine_backward_kernel(float *dso, float *dz, float *dw, float *dye, const float *dy,
                                            const float *ye, const float *so, const float *z, const int32_t *pos,
                                            const float *weight, int k, int64_t C) {
    __shared__ float shared[32];
    const int64_t n = blockIdx.x;
    const float g = moe_sigmoid(z[n]);
    const float *dyn = dy + n * C, *sn = so + n * C;
    float dot = 0.0f;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        dot += dyn[c] * sn[c];
        dso[n * C + c] = g * dyn[c];
    }
    dot = block_sum(dot, shared);
    if (threadIdx.x == 0) dz[n] = dot * g * (1.0f - g);
    for (int j = 0; j < k; j++) {
        const int64_t r = pos[n * k + j];
        const float w = weight[n * k + j], *e = ye + r * C;
        float d = 0.0f;
        for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
            d += dyn[c] * e[c];
            dye[r * C + c] = w * dyn[c];
        }
        d = block_sum(d, shared);
        if (threadIdx.x == 0) dw[n * k + j] = d;
    }
}

void cuda_moe_combine_backward(float *dso, float *dz, float *dw, float *dye, const float *dy, const float *ye,
                               const float *so, const float *z, const int32_t *pos, const float *weight, int64_t N,
                               int k, int64_t C) {
    if (N <= 0) return;
    LAUNCH("moe_combine_backward", moe_combine_backward_kernel, (unsigned)N, MOE_THREADS, dso, dz, dw, dye, dy, ye, so,
           z, pos, weight, k, C);
}

__global__ void moe_route_backward_kernel(float *dp, const float *probs, const int32_t *sel, const float *weight,
                                          const float *dw, const float *psum, const float *aux_grad, int64_t N, int E,
                                          int k, bool norm) {
    CUDA_FOR(n, N) {
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

void cuda_moe_route_backward(float *dp, const float *probs, const int32_t *sel, const float *weight, const float *dw,
                             const float *psum, const float *aux_grad, int64_t N, int E, int k, bool norm) {
    if (N <= 0) return;
    LAUNCH("moe_route_backward", moe_route_backward_kernel, cuda_blocks(N), CUDA_THREADS, dp, probs, sel, weight, dw,
           psum, aux_grad, N, E, k, norm);
}

/* dx[n] += dxs[pos[n, j]] for j in order. */
__global__ void moe_scatter_add_kernel(float *dx, const float *dxs, const int32_t *pos, int k, int64_t C) {
    const int64_t n = blockIdx.x;
    for (int64_t c = threadIdx.x; c < C; c += blockDim.x) {
        float acc = dx[n * C + c];
        for (int j = 0; j < k; j++) acc += dxs[(int64_t)pos[n * k + j] * C + c];
        dx[n * C + c] = acc;
    }
}

void cuda_moe_scatter_add(float *dx, const float *dxs, const int32_t *pos, int64_t N, int k, int64_t C) {
    if (N <= 0) return;
    LAUNCH("moe_scatter_add", moe_scatter_add_kernel, (unsigned)N, MOE_THREADS, dx, dxs, pos, k, C);
}
