/* Causal attention on the device: kernels/cpu/attention.c's formulas and
 * roundings (docs/NUMERICS.md, "Attention"), one thread per query row (or,
 * for dK and dV, per key row), the other side's rows staged through shared
 * memory a tile at a time. Forward keeps each row's online softmax (running
 * max m, sum l, the output accumulator) and writes O and lse; backward
 * recomputes P from lse in two passes, dQ by query rows and dK, dV by key
 * rows, so that every gradient element is summed by one thread in a fixed
 * order: no atomics, a run repeats bit for bit.
 *
 * With 16-bit operands q, k, v and dO are rounded as they are loaded, P
 * before P V and Pᵀ dO, dS before its two products, δ taken from the
 * rounded dO: the CPU's roundings, so the two differ by summation order.
 * These are the plain kernels: FP32 FMA on CUDA cores, head dims up to
 * ATT_MAX_D, for FP32 and the shapes flash.cu's tensor-core kernels do not
 * take (they are tried first). With 16-bit operands cuDNN's fused attention
 * may run the call instead (cudnn_attention.cu, chosen per shape by time). */
#include <math.h>
#include <stdio.h>

#include "kernels/cuda/cuda.cuh"

enum {
    ATT_ROWS = 64, /* the rows a block's threads own: one each */
    ATT_TILE = 32, /* the rows of the other side staged at a time */
    ATT_MAX_D = 256
};

/* x[i] as the products see it: itself, or rounded to the 16-bit dtype. */
__device__ __forceinline__ float att_operand(float x, ht_dtype dtype) {
    if (dtype == HT_DTYPE_BF16) return dev_bf16_to_f32(dev_f32_to_bf16(x));
    if (dtype == HT_DTYPE_F16) return dev_f16_to_f32(dev_f32_to_f16(x));
    return x;
}

/* How many keys query i sees: keys j with k0 + j <= q0 + i, within [0, Tk]. */
__device__ __forceinline__ int64_t att_seen(const ht_attention_shape a, int64_t Tk, int64_t i) {
    int64_t n = a.q0 + i - a.k0 + 1;
    return n < 0 ? 0 : n > Tk ? Tk : n;
}

/* Stages rows [r0, r0 + n) of a (rows, D) head of row stride ld into s (n, D), rounded; zeros past `rows`. */
__device__ void att_stage(float *s, const float *x, int64_t ld, int64_t r0, int64_t n, int64_t rows, int64_t D,
                          ht_dtype dtype) {
    for (int64_t e = threadIdx.x; e < n * D; e += blockDim.x) {
        int64_t r = e / D, c = e % D;
        s[e] = r0 + r < rows ? att_operand(x[(r0 + r) * ld + c], dtype) : 0.0f;
    }
}

/* Stages keys [j0, j0 + n) of one key head's K and V into sk and sv, between
 * barriers: every thread of the block calls it. */
__device__ void att_stage_kv(float *sk, float *sv, const float *kh, const float *vh, const ht_attention_shape a,
                             int64_t Tk, int64_t j0, int64_t n, ht_dtype dtype) {
    __syncthreads();
    att_stage(sk, kh, a.KV * a.Dk, j0, n, Tk, a.Dk, dtype);
    att_stage(sv, vh, a.KV * a.Dv, j0, n, Tk, a.Dv, dtype);
    __syncthreads();
}

/* The keys any query of the block [i0, i0 + ATT_ROWS) sees. */
__device__ __forceinline__ int64_t att_block_keys(const ht_attention_shape a, int64_t Tk, int64_t i0) {
    return att_seen(a, Tk, (i0 + ATT_ROWS < a.T ? i0 + ATT_ROWS : a.T) - 1);
}

/* float max through the integer atomics: exact, so the order does not matter. */
__device__ __forceinline__ void att_atomic_max(float *addr, float v) {
    if (v >= 0.0f)
        atomicMax((int *)addr, __float_as_int(v));
    else
        atomicMin((unsigned int *)addr, __float_as_uint(v));
}

__global__ void att_fill_kernel(float *x, int64_t n, float value) { CUDA_FOR(i, n) x[i] = value; }

/* grid (query blocks, H, B), ATT_ROWS threads; shared: K and V tiles. */
__global__ void att_forward_kernel(float *out, float *lse, float *head_max, const float *q, const float *k,
                                   const float *v, const ht_attention_shape a, ht_dtype dtype) {
    CUDA_DYNAMIC_SHARED(float, att_shared);
    const int64_t T = a.T, Tk = a.Tk > 0 ? a.Tk : a.T, Dk = a.Dk, D = a.Dv, b = blockIdx.z, h = blockIdx.y;
    const int64_t g = h / (a.H / a.KV), qs = a.H * Dk, ks = a.KV * Dk, vs = a.KV * D, os = a.H * D;
    const int64_t i0 = (int64_t)blockIdx.x * ATT_ROWS, i = i0 + threadIdx.x;
    const bool row = i < T;
    float *sk = att_shared, *sv = sk + ATT_TILE * Dk;
    const float *qh = q + b * T * qs + h * Dk, *kh = k + b * Tk * ks + g * Dk, *vh = v + b * Tk * vs + g * D;
    float qr[ATT_MAX_D], acc[ATT_MAX_D];
    for (int64_t c = 0; c < Dk; c++) qr[c] = row ? att_operand(qh[i * qs + c], dtype) : 0.0f;
    for (int64_t c = 0; c < D; c++) acc[c] = 0.0f;
    const int64_t keys = att_block_keys(a, Tk, i0), seen = row ? att_seen(a, Tk, i) : 0;
    const int64_t span = head_max ? Tk : keys; /* QK-clip's max counts the keys above the diagonal too */
    float m = -INFINITY, l = 0.0f, hmax = -INFINITY;
    for (int64_t j0 = 0; j0 < span; j0 += ATT_TILE) {
        const int64_t bk = j0 + ATT_TILE < span ? (int64_t)ATT_TILE : span - j0;
        att_stage_kv(sk, sv, kh, vh, a, Tk, j0, bk, dtype);
        if (!row) continue;
        float s[ATT_TILE];
        for (int64_t c = 0; c < bk; c++) {
            float dot = 0.0f;
            for (int64_t d = 0; d < Dk; d++) dot = fmaf(qr[d], sk[c * Dk + d], dot);
            s[c] = a.scale * dot;
            hmax = fmaxf(hmax, s[c]);
        }
        if (j0 >= keys) continue; /* only the max of these */
        const int64_t valid = seen - j0 < bk ? seen - j0 : bk;
        float mx = m;
        for (int64_t c = 0; c < valid; c++) mx = fmaxf(mx, s[c]);
        float sum = 0.0f;
        for (int64_t c = 0; c < bk; c++) {
            s[c] = c < valid ? dev_exp_nonpositive(s[c] - mx) : 0.0f;
            sum += s[c];
        }
        const float corr = j0 == 0 || m == -INFINITY ? 0.0f : dev_exp_nonpositive(m - mx);
        if (j0 > 0 && corr != 1.0f)
            for (int64_t d = 0; d < D; d++) acc[d] *= corr;
        l = l * corr + sum;
        m = mx;
        for (int64_t c = 0; c < valid; c++) {
            const float p = att_operand(s[c], dtype);
            for (int64_t d = 0; d < D; d++) acc[d] = fmaf(p, sv[c * D + d], acc[d]);
        }
    }
    if (head_max) {
        __shared__ float block_max[ATT_ROWS];
        block_max[threadIdx.x] = hmax;
        __syncthreads();
        if (threadIdx.x == 0) {
            float mx = -INFINITY;
            for (int r = 0; r < ATT_ROWS; r++) mx = fmaxf(mx, block_max[r]);
            att_atomic_max(head_max + b * a.H + h, mx);
        }
    }
    if (!row) return;
    float *o = out + b * T * os + i * os + h * D;
    if (!(l > 0.0f)) { /* no key of this block is seen: nothing, merged as nothing */
        for (int64_t d = 0; d < D; d++) o[d] = 0.0f;
        lse[(b * a.H + h) * T + i] = -INFINITY;
        return;
    }
    const float inv = 1.0f / l;
    for (int64_t d = 0; d < D; d++) o[d] = acc[d] * inv;
    lse[(b * a.H + h) * T + i] = m + logf(l);
}

/* δ_i = dO_i · O_i from the dO the dP product reads (rounded). */
__device__ __forceinline__ float att_delta(const float *dout_row, const float *out_row, int64_t D, ht_dtype dtype) {
    float dot = 0.0f;
    for (int64_t d = 0; d < D; d++) dot = fmaf(out_row[d], att_operand(dout_row[d], dtype), dot);
    return dot;
}

/* dQ: grid (query blocks, H, B), a thread per query row; shared: K and V tiles. */
__global__ void att_dq_kernel(float *dq, const float *dout, const float *out, const float *lse, const float *q,
                              const float *k, const float *v, const ht_attention_shape a, ht_dtype dtype) {
    CUDA_DYNAMIC_SHARED(float, att_shared);
    const int64_t T = a.T, Tk = a.Tk > 0 ? a.Tk : a.T, Dk = a.Dk, D = a.Dv, b = blockIdx.z, h = blockIdx.y;
    const int64_t g = h / (a.H / a.KV), qs = a.H * Dk, ks = a.KV * Dk, vs = a.KV * D, os = a.H * D;
    const int64_t i0 = (int64_t)blockIdx.x * ATT_ROWS, i = i0 + threadIdx.x;
    const bool row = i < T;
    float *sk = att_shared, *sv = sk + ATT_TILE * Dk;
    const float *kh = k + b * Tk * ks + g * Dk, *vh = v + b * Tk * vs + g * D;
    float qr[ATT_MAX_D], gr[ATT_MAX_D], acc[ATT_MAX_D];
    float li = 0.0f, delta = 0.0f;
    if (row) {
        const float *qrow = q + b * T * qs + i * qs + h * Dk, *grow = dout + b * T * os + i * os + h * D;
        for (int64_t c = 0; c < Dk; c++) qr[c] = att_operand(qrow[c], dtype), acc[c] = 0.0f;
        for (int64_t c = 0; c < D; c++) gr[c] = att_operand(grow[c], dtype);
        delta = att_delta(grow, out + b * T * os + i * os + h * D, D, dtype);
        li = lse[(b * a.H + h) * T + i];
    }
    const int64_t keys = att_block_keys(a, Tk, i0), seen = row ? att_seen(a, Tk, i) : 0;
    for (int64_t j0 = 0; j0 < keys; j0 += ATT_TILE) {
        const int64_t bk = j0 + ATT_TILE < keys ? (int64_t)ATT_TILE : keys - j0;
        att_stage_kv(sk, sv, kh, vh, a, Tk, j0, bk, dtype);
        if (!row) continue;
        const int64_t valid = seen - j0 < bk ? seen - j0 : bk;
        float tile[ATT_MAX_D];
        for (int64_t d = 0; d < Dk; d++) tile[d] = 0.0f;
        for (int64_t c = 0; c < valid; c++) {
            float dot = 0.0f, dp = 0.0f;
            for (int64_t d = 0; d < Dk; d++) dot = fmaf(qr[d], sk[c * Dk + d], dot);
            for (int64_t d = 0; d < D; d++) dp = fmaf(gr[d], sv[c * D + d], dp);
            const float p = dev_exp_nonpositive(a.scale * dot - li);
            const float ds = att_operand(p * (dp - delta), dtype);
            for (int64_t d = 0; d < Dk; d++) tile[d] = fmaf(ds, sk[c * Dk + d], tile[d]);
        }
        for (int64_t d = 0; d < Dk; d++) acc[d] += a.scale * tile[d];
    }
    if (!row) return;
    float *o = dq + b * T * qs + i * qs + h * Dk;
    for (int64_t d = 0; d < Dk; d++) o[d] = acc[d];
}

/* dK, dV: grid (key blocks, KV, B), a thread per key row, over the query heads of its group in order;
 * shared: a tile of Q and dO rows, their lse and δ. */
__global__ void att_dkv_kernel(float *dk, float *dv, const float *dout, const float *out, const float *lse,
                               const float *q, const float *k, const float *v, const ht_attention_shape a,
                               ht_dtype dtype) {
    CUDA_DYNAMIC_SHARED(float, att_shared);
    const int64_t T = a.T, Tk = a.Tk > 0 ? a.Tk : a.T, Dk = a.Dk, D = a.Dv, b = blockIdx.z, g = blockIdx.y;
    const int64_t group = a.H / a.KV, qs = a.H * Dk, ks = a.KV * Dk, vs = a.KV * D, os = a.H * D;
    const int64_t j = (int64_t)blockIdx.x * ATT_ROWS + threadIdx.x;
    const bool row = j < Tk;
    float *sq = att_shared, *sg = sq + ATT_TILE * Dk, *sl = sg + ATT_TILE * D, *sd = sl + ATT_TILE;
    float kr[ATT_MAX_D], vr[ATT_MAX_D], ak[ATT_MAX_D], av[ATT_MAX_D];
    if (row) {
        const float *krow = k + b * Tk * ks + j * ks + g * Dk, *vrow = v + b * Tk * vs + j * vs + g * D;
        for (int64_t c = 0; c < Dk; c++) kr[c] = att_operand(krow[c], dtype), ak[c] = 0.0f;
        for (int64_t c = 0; c < D; c++) vr[c] = att_operand(vrow[c], dtype), av[c] = 0.0f;
    }
    for (int64_t h = g * group; h < (g + 1) * group; h++) {
        const float *qh = q + b * T * qs + h * Dk, *gh = dout + b * T * os + h * D, *oh = out + b * T * os + h * D;
        const float *lh = lse + (b * a.H + h) * T;
        for (int64_t i0 = 0; i0 < T; i0 += ATT_TILE) {
            const int64_t bq = i0 + ATT_TILE < T ? (int64_t)ATT_TILE : T - i0;
            __syncthreads();
            att_stage(sq, qh, qs, i0, bq, T, Dk, dtype);
            att_stage(sg, gh, os, i0, bq, T, D, dtype);
            for (int64_t r = threadIdx.x; r < bq; r += blockDim.x) {
                sl[r] = lh[i0 + r];
                sd[r] = att_delta(gh + (i0 + r) * os, oh + (i0 + r) * os, D, dtype);
            }
            __syncthreads();
            if (!row) continue;
            float tk[ATT_MAX_D], tv[ATT_MAX_D];
            for (int64_t d = 0; d < Dk; d++) tk[d] = 0.0f;
            for (int64_t d = 0; d < D; d++) tv[d] = 0.0f;
            bool any = false;
            for (int64_t r = 0; r < bq; r++) {
                if (a.k0 + j > a.q0 + i0 + r) continue; /* query i0 + r does not see key j */
                any = true;
                float dot = 0.0f, dp = 0.0f;
                for (int64_t d = 0; d < Dk; d++) dot = fmaf(sq[r * Dk + d], kr[d], dot);
                for (int64_t d = 0; d < D; d++) dp = fmaf(sg[r * D + d], vr[d], dp);
                const float p = dev_exp_nonpositive(a.scale * dot - sl[r]);
                const float pr = att_operand(p, dtype), ds = att_operand(p * (dp - sd[r]), dtype);
                for (int64_t d = 0; d < D; d++) tv[d] = fmaf(pr, sg[r * D + d], tv[d]);
                for (int64_t d = 0; d < Dk; d++) tk[d] = fmaf(ds, sq[r * Dk + d], tk[d]);
            }
            if (!any) continue;
            for (int64_t d = 0; d < D; d++) av[d] += tv[d];
            for (int64_t d = 0; d < Dk; d++) ak[d] += a.scale * tk[d];
        }
    }
    if (!row) return;
    float *ko = dk + b * Tk * ks + j * ks + g * Dk, *vo = dv + b * Tk * vs + j * vs + g * D;
    for (int64_t d = 0; d < Dk; d++) ko[d] = ak[d];
    for (int64_t d = 0; d < D; d++) vo[d] = av[d];
}

__global__ void att_merge_kernel(float *out, float *lse, const float *out2, const float *lse2, int64_t B, int64_t T,
                                 int64_t H, int64_t Dv) {
    CUDA_FOR(e, B * T * H) {
        const int64_t h = e % H, t = (e / H) % T, b = e / (H * T);
        float *l1 = lse + (b * H + h) * T + t;
        const float l2 = lse2[(b * H + h) * T + t], mx = *l1 > l2 ? *l1 : l2;
        if (mx == -INFINITY) continue; /* neither block had a key for it */
        const float w1 = expf(*l1 - mx), w2 = expf(l2 - mx), sum = w1 + w2;
        float *o = out + e * Dv;
        const float *o2 = out2 + e * Dv;
        for (int64_t c = 0; c < Dv; c++) o[c] = (w1 * o[c] + w2 * o2[c]) / sum;
        *l1 = mx + logf(sum);
    }
}

/* The device kernels keep their state in registers and shared memory: no workspace. */
size_t cuda_attention_workspace_floats(int64_t T, int64_t Dk, int64_t Dv) {
    (void)T, (void)Dk, (void)Dv;
    return 0;
}

/* The shapes these kernels take, or false (recorded as the backend's failure). */
static bool att_shape_ok(const ht_attention_shape *a, const char *what) {
    if (a->Dk > ATT_MAX_D || a->Dv > ATT_MAX_D) {
        char detail[128];
        snprintf(detail, sizeof(detail), "head dims Dk %lld, Dv %lld; at most %d", (long long)a->Dk, (long long)a->Dv,
                 ATT_MAX_D);
        return cuda_fail(what, detail);
    }
    return a->B > 0 && a->T > 0 && a->H > 0;
}

/* Dynamic shared memory, raised past the 48 KiB default where the head dims need it. */
static bool att_shared_bytes(const void *kernel, size_t bytes, const char *what) {
    if (bytes <= 48 * 1024) return true;
    return cuda_ok(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes), what);
}

/* The own kernels of one call: tensor cores where flash.cu takes it, else the plain kernels. */
static void att_own_forward(const cuda_flash_call *fc) {
    const ht_attention_shape *a = fc->shape;
    if (cuda_flash_attention(fc)) return;
    const size_t bytes = (size_t)ATT_TILE * (size_t)(a->Dk + a->Dv) * sizeof(float);
    if (!att_shared_bytes((const void *)att_forward_kernel, bytes, "attention_forward")) return;
    dim3 grid((unsigned)((a->T + ATT_ROWS - 1) / ATT_ROWS), (unsigned)a->H, (unsigned)a->B);
    CUDA_LAUNCH(att_forward_kernel, grid, ATT_ROWS, bytes, fc->out, fc->lse, fc->head_max, fc->q, fc->k, fc->v, *a,
                fc->dtype);
    cuda_check_launch("attention_forward");
}

static void att_own_backward(const cuda_flash_call *fc) {
    const ht_attention_shape *a = fc->shape;
    if (cuda_flash_attention(fc)) return;
    const int64_t Tk = a->Tk > 0 ? a->Tk : a->T;
    const size_t dq_bytes = (size_t)ATT_TILE * (size_t)(a->Dk + a->Dv) * sizeof(float);
    const size_t dkv_bytes = (size_t)ATT_TILE * (size_t)(a->Dk + a->Dv + 2) * sizeof(float);
    if (!att_shared_bytes((const void *)att_dq_kernel, dq_bytes, "attention_backward") ||
        !att_shared_bytes((const void *)att_dkv_kernel, dkv_bytes, "attention_backward"))
        return;
    dim3 qgrid((unsigned)((a->T + ATT_ROWS - 1) / ATT_ROWS), (unsigned)a->H, (unsigned)a->B);
    CUDA_LAUNCH(att_dq_kernel, qgrid, ATT_ROWS, dq_bytes, fc->dq, fc->dout, fc->out, fc->lse, fc->q, fc->k, fc->v, *a,
                fc->dtype);
    cuda_check_launch("attention_backward (dq)");
    dim3 kgrid((unsigned)((Tk + ATT_ROWS - 1) / ATT_ROWS), (unsigned)a->KV, (unsigned)a->B);
    CUDA_LAUNCH(att_dkv_kernel, kgrid, ATT_ROWS, dkv_bytes, fc->dk, fc->dv, fc->dout, fc->out, fc->lse, fc->q, fc->k,
                fc->v, *a, fc->dtype);
    cuda_check_launch("attention_backward (dk, dv)");
}

void cuda_attention_forward(float *out, float *lse, float *head_max, const float *q, const float *k, const float *v,
                            const ht_attention_shape *a, ht_dtype dtype, float *work) {
    (void)work;
    if (!att_shape_ok(a, "attention_forward")) return;
    if (head_max) {
        CUDA_LAUNCH(att_fill_kernel, cuda_blocks(a->B * a->H), CUDA_THREADS, 0, head_max, a->B * a->H, -INFINITY);
        cuda_check_launch("attention_forward (head_max)");
    }
    cuda_flash_call fc = {a, dtype, true, out, lse, head_max, q, k, v, NULL, NULL, NULL, NULL};
    if (!cuda_cudnn_attention(&fc, att_own_forward)) att_own_forward(&fc);
}

void cuda_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                             const float *q, const float *k, const float *v, const ht_attention_shape *a,
                             ht_dtype dtype, float *work) {
    (void)work;
    if (!att_shape_ok(a, "attention_backward")) return;
    cuda_flash_call fc = {a, dtype, false, (float *)out, (float *)lse, NULL, q, k, v, dout, dq, dk, dv};
    if (!cuda_cudnn_attention(&fc, att_own_backward)) att_own_backward(&fc);
}

void cuda_attention_merge(float *out, float *lse, const float *out2, const float *lse2, int64_t B, int64_t T, int64_t H,
                          int64_t Dv) {
    if (B * T * H <= 0) return;
    LAUNCH("attention_merge", att_merge_kernel, cuda_blocks(B * T * H), CUDA_THREADS, out, lse, out2, lse2, B, T, H,
           Dv);
}
