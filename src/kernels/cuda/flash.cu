/* Causal attention with 16-bit operands on tensor cores: the formulas and
 * roundings of kernels/cpu/attention.c (docs/NUMERICS.md, "Attention") as
 * FlashAttention-2 tiles them, each product mma.sync m16n8k16 of bf16 or
 * f16 operands into FP32 (tc.cuh), its fragments in registers.
 *
 * A block is four warps over a tile of 64 query rows (forward, dQ) or 64
 * key rows (dK, dV), each warp owning 16 of them; the other side comes
 * through shared memory 64 rows at a time, from 16-bit copies of q, k, v
 * and dO rounded once per call into the backend's scratch (the CPU's
 * roundings of them), eight values a load, and into the products by
 * ldmatrix. A warp's logits, probabilities and accumulators stay in its
 * registers: forward keeps each row's online softmax (m, l) in the four
 * lanes that hold the row and rescales its output there; P, rounded, is
 * the A operand of P V as it stands. Backward computes δ = rowsum(O ∘ dO)
 * once (from the rounded dO), then recomputes P from lse: dQ by query
 * tiles, dK and dV by key tiles of one query head each (Sᵀ and dPᵀ key
 * rows first, so Pᵀ and dSᵀ feed their products from registers too), the
 * heads of a GQA group then added in their order, so that every gradient
 * element is summed in a fixed order (no atomics: a run repeats bit for
 * bit); dS is rounded before its two products. Head dims (Dk, Dv) of
 * (32, 32), (64, 64), (128, 128) and Multi-Latent Attention's (192, 128)
 * take this path on a GPU of compute capability 8.0 or more; every other
 * call, and FP32, the plain kernels of attention.cu. test_kernels_emu runs
 * them on the host against the CPU's (docs/DESIGN.md, "The CUDA backend
 * without a GPU"). */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#include "kernels/cuda/cuda.cuh"
#include "kernels/cuda/tc.cuh"

enum {
    FA_ROWS = 64, /* a block's own rows, 16 a warp */
    FA_TILE = 64, /* the other side's rows staged at a time */
    FA_WARPS = 4,
    FA_THREADS = 32 * FA_WARPS
};

/* The 16-bit operand type: x rounded as the CPU rounds it (base/dtype.c). */
template <typename T16> __device__ __forceinline__ T16 fa_round(float x);
template <> __device__ __forceinline__ __nv_bfloat16 fa_round<__nv_bfloat16>(float x) {
    __nv_bfloat16_raw r;
    r.x = dev_f32_to_bf16(x);
    return __nv_bfloat16(r);
}
template <> __device__ __forceinline__ __half fa_round<__half>(float x) {
    __half_raw r;
    r.x = dev_f32_to_f16(x);
    return __half(r);
}

static_assert(FA_ROWS == FA_TILE, "the staging of either side's rows is one function");

/* Shared memory: a carve of 128-byte-aligned arrays (ldmatrix wants 16), the
 * same on the host (base 0: the bytes a launch asks for) as in the kernel. */
struct fa_carve {
    uintptr_t base;
    size_t at;
    template <typename X> __host__ __device__ X *take(size_t n) {
        X *p = (X *)(base + at);
        at += (n * sizeof(X) + 127) / 128 * 128;
        return p;
    }
};

/* The leading dimension of 16-bit rows of D in shared memory: padded by
 * 16 bytes, so that the eight rows an ldmatrix reads fall in distinct banks. */
template <int D> struct fa_ld {
    static constexpr int h = D + 8;
};

/* Eight 16-bit values: one 16-byte load or store. */
template <typename T16> struct alignas(16) fa_h8 { T16 x[8]; };

/* x (n floats) rounded to 16 bits, as the CPU rounds an operand: the
 * copies of q, k, v and dO the tiles are staged from. */
template <typename T16> __global__ void fa_round_kernel(T16 *dst, const float *x, int64_t n) {
    CUDA_FOR(i, n) dst[i] = fa_round<T16>(x[i]);
}

/* Rows [r0, r0 + FA_TILE) of a head of those copies (row stride ld; rows
 * 16-byte aligned, as fa_launch carves them) into s (FA_TILE, D), zeros
 * past `rows`: eight values a load. Every thread of the block. */
template <typename T16, int D> __device__ void fa_stage(T16 *s, const T16 *x, int64_t ld, int64_t r0, int64_t rows) {
    static_assert(D % 8 == 0 && fa_ld<D>::h % 8 == 0, "rows of whole fa_h8");
    for (int e = threadIdx.x; e < FA_TILE * D / 8; e += FA_THREADS) {
        const int r = e / (D / 8), c = e % (D / 8) * 8;
        fa_h8<T16> v;
        if (r0 + r < rows)
            v = *(const fa_h8<T16> *)(x + (r0 + r) * ld + c);
        else
            for (int i = 0; i < 8; i++) v.x[i] = fa_round<T16>(0.0f);
        *(fa_h8<T16> *)(s + r * fa_ld<D>::h + c) = v;
    }
}

/* A query tile's index, the last first: causal tiles further down see more
 * keys, and the blocks with the most work start before the light ones. */
__device__ __forceinline__ int64_t fa_heavy_first(void) { return (int64_t)(gridDim.x - 1 - blockIdx.x); }

/* How many keys query i sees: keys j with k0 + j <= q0 + i, within [0, Tk]. */
__device__ __forceinline__ int64_t fa_seen(const ht_attention_shape &a, int64_t Tk, int64_t i) {
    const int64_t n = a.q0 + i - a.k0 + 1;
    return n < 0 ? 0 : n > Tk ? Tk : n;
}

__device__ __forceinline__ void fa_atomic_max(float *addr, float v) {
    if (v >= 0.0f)
        atomicMax((int *)addr, __float_as_int(v));
    else
        atomicMin((unsigned int *)addr, __float_as_uint(v));
}

/* ---------------------------------------------------------------- forward */

/* The forward's shared memory: the block's Q rows and a tile of K and V. */
template <typename T16, int DK, int DV> struct fa_forward_smem {
    T16 *q, *k, *v;
    size_t bytes;
    __host__ __device__ explicit fa_forward_smem(uintptr_t base) {
        fa_carve c{base, 0};
        q = c.take<T16>(FA_ROWS * fa_ld<DK>::h), k = c.take<T16>(FA_TILE * fa_ld<DK>::h);
        v = c.take<T16>(FA_TILE * fa_ld<DV>::h);
        bytes = c.at;
    }
};

/* The rows of a warp's D tiles this lane holds (tc.cuh): g and g + 8 of its 16. */
__device__ __forceinline__ int fa_row(int r) { return threadIdx.x / 32 * 16 + threadIdx.x % 32 / 4 + 8 * r; }
/* The column of element e of D tile n this lane holds. */
__device__ __forceinline__ int fa_col(int n, int e) { return n * 8 + 2 * (threadIdx.x % 4) + e % 2; }

/* grid (query tiles, H, B), FA_THREADS threads. A warp's 16 query rows:
 * their logits S, probabilities P and output O in its registers as D
 * tiles, the online softmax's (m, l) of rows g and g + 8 in the four lanes
 * that hold them (l each lane's part of the sum until the end). */
template <typename T16, int DK, int DV>
__global__ void __launch_bounds__(FA_THREADS)
    fa_forward_kernel(float *out, float *lse, float *head_max, const T16 *q, const T16 *k, const T16 *v,
                      const ht_attention_shape a) {
#if __CUDA_ARCH__ >= 800
    constexpr int LQ = fa_ld<DK>::h, LV = fa_ld<DV>::h, NS = FA_TILE / 8, NO = DV / 8;
    CUDA_DYNAMIC_SHARED(unsigned char, fa_shared);
    const fa_forward_smem<T16, DK, DV> sm((uintptr_t)fa_shared);
    const int64_t T = a.T, Tk = a.Tk > 0 ? a.Tk : a.T, b = blockIdx.z, h = blockIdx.y, g = h / (a.H / a.KV);
    const int64_t qs = a.H * DK, ks = a.KV * DK, vs = a.KV * DV, os = a.H * DV;
    const int64_t i0 = fa_heavy_first() * FA_ROWS;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int64_t row[2], seen[2];
    for (int r = 0; r < 2; r++) {
        row[r] = i0 + fa_row(r);
        seen[r] = row[r] < T ? fa_seen(a, Tk, row[r]) : 0;
    }
    const T16 *kh = k + b * Tk * ks + g * DK, *vh = v + b * Tk * vs + g * DV;
    fa_stage<T16, DK>(sm.q, q + b * T * qs + h * DK, qs, i0, T);
    const int64_t last = (i0 + FA_ROWS < T ? i0 + FA_ROWS : T) - 1, keys = fa_seen(a, Tk, last);
    const int64_t span = head_max ? Tk : keys; /* QK-clip's max counts the keys above the diagonal too */
    float o[NO][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f}, hmax = -INFINITY;
    for (int64_t j0 = 0; j0 < span; j0 += FA_TILE) {
        __syncthreads(); /* the last tile's K and V are read */
        fa_stage<T16, DK>(sm.k, kh, ks, j0, Tk);
        fa_stage<T16, DV>(sm.v, vh, vs, j0, Tk);
        __syncthreads();
        float s[NS][4] = {};
        tc_abt<T16, DK, FA_TILE>(s, sm.q + warp * 16 * LQ, LQ, sm.k, LQ);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e / 2;
                const int64_t j = j0 + fa_col(n, e);
                s[n][e] = a.scale * s[n][e];
                if (row[r] < T && j < Tk) hmax = fmaxf(hmax, s[n][e]);
                if (j < seen[r]) mx[r] = fmaxf(mx[r], s[n][e]);
            }
        if (j0 >= keys) continue; /* only the max of these (the same for the whole block) */
        float f[2];
#pragma unroll
        for (int r = 0; r < 2; r++) { /* the row's max over its four lanes, then the correction */
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(m[r], fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2)));
            f[r] = m[r] == -INFINITY ? 0.0f : dev_exp_nonpositive(m[r] - mx[r]);
            l[r] *= f[r];
            m[r] = mx[r];
        }
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e / 2;
                const float p = j0 + fa_col(n, e) < seen[r] ? dev_exp_nonpositive(s[n][e] - m[r]) : 0.0f;
                l[r] += p;
                s[n][e] = p;
            }
#pragma unroll
        for (int n = 0; n < NO; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[n][e] *= f[e / 2];
        uint32_t pa[FA_TILE / 16][4]; /* P rounded, as the A operand of P V */
#pragma unroll
        for (int kk = 0; kk < FA_TILE / 16; kk++) tc_pack_a<T16>(pa[kk], s[2 * kk], s[2 * kk + 1]);
        tc_pb<T16, FA_TILE, DV>(o, pa, sm.v, LV);
    }
    if (head_max) {
        for (int x = 16; x > 0; x >>= 1) hmax = fmaxf(hmax, __shfl_xor_sync(0xffffffffu, hmax, x));
        if (lane == 0) fa_atomic_max(head_max + b * a.H + h, hmax);
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
    for (int r = 0; r < 2; r++) {
        if (row[r] >= T) continue;
        float *orow = out + b * T * os + row[r] * os + h * DV;
        const bool any = l[r] > 0.0f; /* no key of this block seen: nothing, merged as nothing */
        const float inv = any ? 1.0f / l[r] : 0.0f;
#pragma unroll
        for (int n = 0; n < NO; n++)
            for (int c = 0; c < 2; c++) orow[fa_col(n, c)] = any ? o[n][2 * r + c] * inv : 0.0f;
        if (lane % 4 == 0) lse[(b * a.H + h) * T + row[r]] = any ? m[r] + logf(l[r]) : -INFINITY;
    }
#endif
}

/* ---------------------------------------------------------------- backward */

/* δ (B, H, T): δ_i = O_i · dO_i of every query row, from the rounded dO,
 * once for both backward kernels (which read it for each tile they
 * stage). A warp a row, FA_WARPS rows a block. */
template <typename T16, int DV>
__global__ void __launch_bounds__(FA_THREADS)
    fa_delta_kernel(float *delta, const T16 *dout, const float *out, const ht_attention_shape a) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int64_t row = (int64_t)blockIdx.x * FA_WARPS + warp, T = a.T, os = a.H * DV;
    if (row >= (int64_t)a.B * a.H * T) return;
    const int64_t b = row / (a.H * T), h = row / T % a.H, i = row % T;
    const float *o = out + b * T * os + i * os + h * DV;
    const T16 *g = dout + b * T * os + i * os + h * DV;
    float dot = 0.0f;
    for (int d = lane; d < DV; d += 32) dot = fmaf(o[d], (float)g[d], dot);
    for (int s = 16; s > 0; s >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, s);
    if (lane == 0) delta[row] = dot;
}

/* δ and lse of rows [i0, i0 + FA_ROWS) of one head into sd, sl (0 past T). */
__device__ void fa_stage_stats(float *sd, float *sl, const float *dh, const float *lh, int64_t i0, int64_t T) {
    for (int r = threadIdx.x; r < FA_ROWS; r += FA_THREADS) {
        const bool in = i0 + r < T;
        sd[r] = in ? dh[i0 + r] : 0.0f;
        sl[r] = in ? lh[i0 + r] : 0.0f;
    }
}

/* The backward's shared memory. dQ: its Q and dO rows (a, g), a tile of K
 * and V (b, w), the rows' δ and lse. dK, dV: its K and V rows (a, g), a
 * tile of Q and dO (b, w), the tile's δ and lse. */
template <typename T16, int DK, int DV> struct fa_backward_smem {
    T16 *a, *b, *g, *w;
    float *delta, *lse;
    size_t bytes;
    __host__ __device__ explicit fa_backward_smem(uintptr_t base) {
        fa_carve c{base, 0};
        a = c.take<T16>(FA_ROWS * fa_ld<DK>::h), b = c.take<T16>(FA_TILE * fa_ld<DK>::h);
        g = c.take<T16>(FA_ROWS * fa_ld<DV>::h), w = c.take<T16>(FA_TILE * fa_ld<DV>::h);
        delta = c.take<float>(FA_TILE), lse = c.take<float>(FA_TILE);
        bytes = c.at;
    }
};

/* acc (the warp's 16 rows x D) times k into rows [0, rows) of a head in
 * global memory (row stride ld), each lane its two columns of a tile. */
template <int D>
__device__ __forceinline__ void fa_store(float *dst, int64_t ld, int64_t rows, const float (&acc)[D / 8][4], float k) {
    for (int r = 0; r < 2; r++) {
        const int i = fa_row(r) % 16;
        if (i >= rows) continue;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
            for (int c = 0; c < 2; c++) dst[i * ld + fa_col(n, c)] = acc[n][2 * r + c] * k;
    }
}

/* dQ: grid (query tiles, H, B), FA_THREADS threads; a warp's 16 rows of dQ
 * in its registers across the key tiles, S and dP as D tiles, dS rounded
 * into the A operand of dS K. */
template <typename T16, int DK, int DV>
__global__ void __launch_bounds__(FA_THREADS)
    fa_dq_kernel(float *dq, const T16 *dout, const float *delta, const float *lse, const T16 *q, const T16 *k,
                 const T16 *v, const ht_attention_shape a) {
#if __CUDA_ARCH__ >= 800
    constexpr int LQ = fa_ld<DK>::h, LV = fa_ld<DV>::h, NS = FA_TILE / 8;
    CUDA_DYNAMIC_SHARED(unsigned char, fa_shared);
    const fa_backward_smem<T16, DK, DV> sm((uintptr_t)fa_shared);
    const int64_t T = a.T, Tk = a.Tk > 0 ? a.Tk : a.T, b = blockIdx.z, h = blockIdx.y, g = h / (a.H / a.KV);
    const int64_t qs = a.H * DK, ks = a.KV * DK, vs = a.KV * DV, os = a.H * DV;
    const int64_t i0 = fa_heavy_first() * FA_ROWS;
    const int warp = threadIdx.x / 32;
    const T16 *kh = k + b * Tk * ks + g * DK, *vh = v + b * Tk * vs + g * DV;
    fa_stage<T16, DK>(sm.a, q + b * T * qs + h * DK, qs, i0, T);
    fa_stage<T16, DV>(sm.g, dout + b * T * os + h * DV, os, i0, T);
    fa_stage_stats(sm.delta, sm.lse, delta + (b * a.H + h) * T, lse + (b * a.H + h) * T, i0, T);
    __syncthreads();
    int64_t seen[2];
    float li[2], di[2];
    for (int r = 0; r < 2; r++) {
        const int64_t i = i0 + fa_row(r);
        seen[r] = i < T ? fa_seen(a, Tk, i) : 0;
        li[r] = sm.lse[fa_row(r)], di[r] = sm.delta[fa_row(r)];
    }
    float acc[DK / 8][4] = {};
    const int64_t last = (i0 + FA_ROWS < T ? i0 + FA_ROWS : T) - 1, keys = fa_seen(a, Tk, last);
    for (int64_t j0 = 0; j0 < keys; j0 += FA_TILE) {
        __syncthreads();
        fa_stage<T16, DK>(sm.b, kh, ks, j0, Tk);
        fa_stage<T16, DV>(sm.w, vh, vs, j0, Tk);
        __syncthreads();
        float s[NS][4] = {}, dp[NS][4] = {};
        tc_abt<T16, DK, FA_TILE>(s, sm.a + warp * 16 * LQ, LQ, sm.b, LQ);
        tc_abt<T16, DV, FA_TILE>(dp, sm.g + warp * 16 * LV, LV, sm.w, LV);
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int r = e / 2;
                const bool valid = j0 + fa_col(n, e) < seen[r];
                const float p = valid ? dev_exp_nonpositive(a.scale * s[n][e] - li[r]) : 0.0f;
                s[n][e] = valid ? p * (dp[n][e] - di[r]) : 0.0f; /* dS */
            }
        uint32_t da[FA_TILE / 16][4];
#pragma unroll
        for (int kk = 0; kk < FA_TILE / 16; kk++) tc_pack_a<T16>(da[kk], s[2 * kk], s[2 * kk + 1]);
        tc_pb<T16, FA_TILE, DK>(acc, da, sm.b, LQ);
    }
    const int64_t r0 = i0 + warp * 16;
    fa_store<DK>(dq + b * T * qs + r0 * qs + h * DK, qs, T - r0, acc, a.scale);
#endif
}

/* dK, dV of one query head: grid (key tiles, H, B), FA_THREADS threads; a
 * warp's 16 key rows of dK and dV in its registers across the query tiles,
 * Sᵀ = K Qᵀ and dPᵀ = V dOᵀ computed key rows first, so that Pᵀ and dSᵀ
 * are the A operands of Pᵀ dO and dSᵀ Q as they stand. Where a KV head has
 * one query head (group 1) they are dk and dv; else each head's go to pk
 * (B, Tk, H, Dk) and pv (B, Tk, H, Dv), which fa_group_sum_kernel adds over
 * the group's heads in their order: a block a head, so that every head of
 * a group runs at once, and every sum is still in one order. */
template <typename T16, int DK, int DV>
__global__ void __launch_bounds__(FA_THREADS)
    fa_dkv_kernel(float *dk, float *dv, float *pk, float *pv, const T16 *dout, const float *delta, const float *lse,
                  const T16 *q, const T16 *k, const T16 *v, const ht_attention_shape a) {
#if __CUDA_ARCH__ >= 800
    constexpr int LQ = fa_ld<DK>::h, LV = fa_ld<DV>::h, NS = FA_TILE / 8;
    CUDA_DYNAMIC_SHARED(unsigned char, fa_shared);
    const fa_backward_smem<T16, DK, DV> sm((uintptr_t)fa_shared);
    const int64_t T = a.T, Tk = a.Tk > 0 ? a.Tk : a.T, b = blockIdx.z, h = blockIdx.y, group = a.H / a.KV;
    const int64_t g = h / group, qs = a.H * DK, ks = a.KV * DK, vs = a.KV * DV, os = a.H * DV;
    const int64_t j0 = (int64_t)blockIdx.x * FA_ROWS;
    const int warp = threadIdx.x / 32;
    fa_stage<T16, DK>(sm.a, k + b * Tk * ks + g * DK, ks, j0, Tk);
    fa_stage<T16, DV>(sm.g, v + b * Tk * vs + g * DV, vs, j0, Tk);
    const int64_t key[2] = {j0 + fa_row(0), j0 + fa_row(1)};
    float ak[DK / 8][4] = {}, av[DV / 8][4] = {};
    const float *dh = delta + (b * a.H + h) * T, *lh = lse + (b * a.H + h) * T;
    for (int64_t i0 = 0; i0 < T; i0 += FA_TILE) {
        const int64_t last = (i0 + FA_TILE < T ? i0 + FA_TILE : T) - 1;
        if (a.k0 + j0 > a.q0 + last) continue; /* no query of the tile sees a key of the block */
        __syncthreads();
        fa_stage<T16, DK>(sm.b, q + b * T * qs + h * DK, qs, i0, T);
        fa_stage<T16, DV>(sm.w, dout + b * T * os + h * DV, os, i0, T);
        fa_stage_stats(sm.delta, sm.lse, dh, lh, i0, T);
        __syncthreads();
        float s[NS][4] = {};
        tc_abt<T16, DK, FA_TILE>(s, sm.a + warp * 16 * LQ, LQ, sm.b, LQ);
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t kj = key[e / 2], i = i0 + fa_col(n, e);
                const bool valid = kj < Tk && i < T && a.k0 + kj <= a.q0 + i;
                s[n][e] = valid ? dev_exp_nonpositive(a.scale * s[n][e] - sm.lse[fa_col(n, e)]) : 0.0f; /* Pᵀ */
            }
        uint32_t pa[FA_TILE / 16][4];
#pragma unroll
        for (int kk = 0; kk < FA_TILE / 16; kk++) tc_pack_a<T16>(pa[kk], s[2 * kk], s[2 * kk + 1]);
        tc_pb<T16, FA_TILE, DV>(av, pa, sm.w, LV);
        float dp[NS][4] = {};
        tc_abt<T16, DV, FA_TILE>(dp, sm.g + warp * 16 * LV, LV, sm.w, LV);
#pragma unroll
        for (int n = 0; n < NS; n++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int64_t kj = key[e / 2], i = i0 + fa_col(n, e);
                const bool valid = kj < Tk && i < T && a.k0 + kj <= a.q0 + i;
                s[n][e] = valid ? s[n][e] * (dp[n][e] - sm.delta[fa_col(n, e)]) : 0.0f; /* dSᵀ */
            }
#pragma unroll
        for (int kk = 0; kk < FA_TILE / 16; kk++) tc_pack_a<T16>(pa[kk], s[2 * kk], s[2 * kk + 1]);
        tc_pb<T16, FA_TILE, DK>(ak, pa, sm.b, LQ);
    }
    const int64_t r = j0 + warp * 16;
    float *ok = group == 1 ? dk + b * Tk * ks + r * ks + g * DK : pk + (b * Tk + r) * qs + h * DK;
    float *ov = group == 1 ? dv + b * Tk * vs + r * vs + g * DV : pv + (b * Tk + r) * os + h * DV;
    fa_store<DK>(ok, group == 1 ? ks : qs, Tk - r, ak, a.scale);
    fa_store<DV>(ov, group == 1 ? vs : os, Tk - r, av, 1.0f);
#endif
}

/* dk (B, Tk, KV, Dk) and dv (B, Tk, KV, Dv): each KV head's the sum of its
 * group's query heads' pk and pv, the first head first. */
__global__ void fa_group_sum_kernel(float *dk, float *dv, const float *pk, const float *pv, int64_t B, int64_t Tk,
                                    int64_t H, int64_t KV, int64_t DK, int64_t DV) {
    const int64_t group = H / KV, per = KV * (DK + DV);
    CUDA_FOR(e, B * Tk * per) {
        const int64_t bj = e / per, x = e % per;
        const bool is_k = x < KV * DK;
        const int64_t D = is_k ? DK : DV, y = is_k ? x : x - KV * DK, g = y / D, d = y % D;
        const float *p = (is_k ? pk : pv) + bj * H * D + g * group * D + d;
        float s = p[0];
        for (int64_t m = 1; m < group; m++) s += p[m * D];
        (is_k ? dk : dv)[bj * KV * D + g * D + d] = s;
    }
}

/* ---------------------------------------------------------------- dispatch */

/* Whether the device has tensor cores for bf16 and f16 (compute capability 8.0+). */
static bool fa_device_ok(void) {
    static int major = -1;
    if (major < 0) {
        int dev = 0;
        if (cudaGetDevice(&dev) != cudaSuccess ||
            cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess)
            major = 0;
    }
    return major >= 8;
}

/* The backend's scratch, carved a block at a time (256-byte aligned). */
static size_t fa_block(size_t bytes) { return (bytes + 255) / 256 * 256; }
static char *fa_take(char *&at, size_t bytes) {
    char *p = at;
    at += fa_block(bytes);
    return p;
}

/* n floats of x rounded into a 16-bit copy taken from the scratch at `at`. */
template <typename T16> static const T16 *fa_copy16(char *&at, const float *x, int64_t n) {
    T16 *d = (T16 *)fa_take(at, (size_t)n * sizeof(T16));
    if (n > 0) LAUNCH("attention (16-bit operands)", fa_round_kernel<T16>, cuda_blocks(n), CUDA_THREADS, d, x, n);
    return d;
}

template <typename T16, int DK, int DV> static bool fa_launch(const cuda_flash_call &c) {
    const ht_attention_shape &a = *c.shape;
    const int64_t Tk = a.Tk > 0 ? a.Tk : a.T;
    const dim3 qgrid((unsigned)((a.T + FA_ROWS - 1) / FA_ROWS), (unsigned)a.H, (unsigned)a.B);
    /* q, k, v (and dO) rounded once into the scratch, the tiles staged from those copies */
    const int64_t nq = (int64_t)a.B * a.T * a.H * DK, nk = (int64_t)a.B * Tk * a.KV * DK;
    const int64_t nv = (int64_t)a.B * Tk * a.KV * DV, ng = (int64_t)a.B * a.T * a.H * DV;
    const size_t copies = fa_block((size_t)nq * 2) + fa_block((size_t)nk * 2) + fa_block((size_t)nv * 2);
    if (c.forward) {
        char *at = (char *)cuda_scratch(copies);
        if (!at) return true; /* the failure is the backend's */
        const T16 *q16 = fa_copy16<T16>(at, c.q, nq), *k16 = fa_copy16<T16>(at, c.k, nk);
        const T16 *v16 = fa_copy16<T16>(at, c.v, nv);
        const size_t bytes = fa_forward_smem<T16, DK, DV>(0).bytes;
        if (!cuda_ok(cudaFuncSetAttribute((const void *)fa_forward_kernel<T16, DK, DV>,
                                          cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes),
                     "attention_forward (shared memory)"))
            return true;
        auto *forward = fa_forward_kernel<T16, DK, DV>;
        CUDA_LAUNCH(forward, qgrid, FA_THREADS, bytes, c.out, c.lse, c.head_max, q16, k16, v16, a);
        cuda_check_launch("attention_forward (tensor cores)");
        return true;
    }
    const size_t qbytes = fa_backward_smem<T16, DK, DV>(0).bytes, kbytes = qbytes;
    if (!cuda_ok(cudaFuncSetAttribute((const void *)fa_dq_kernel<T16, DK, DV>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)qbytes),
                 "attention_backward (shared memory)") ||
        !cuda_ok(cudaFuncSetAttribute((const void *)fa_dkv_kernel<T16, DK, DV>,
                                      cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kbytes),
                 "attention_backward (shared memory)"))
        return true;
    /* and δ (B, H, T), and where a group has several heads their partial dK, dV (B, Tk, H, D) */
    const int64_t group = a.H / a.KV, rows = (int64_t)a.B * a.H * a.T;
    const size_t npk = group > 1 ? (size_t)(a.B * Tk * a.H * DK) : 0,
                 npv = group > 1 ? (size_t)(a.B * Tk * a.H * DV) : 0;
    char *at = (char *)cuda_scratch(copies + fa_block((size_t)ng * 2) + fa_block((size_t)rows * 4) + fa_block(npk * 4) +
                                    fa_block(npv * 4));
    if (!at) return true; /* the failure is the backend's */
    const T16 *q16 = fa_copy16<T16>(at, c.q, nq), *k16 = fa_copy16<T16>(at, c.k, nk);
    const T16 *v16 = fa_copy16<T16>(at, c.v, nv), *g16 = fa_copy16<T16>(at, c.dout, ng);
    float *delta = (float *)fa_take(at, (size_t)rows * 4);
    float *pk = group > 1 ? (float *)fa_take(at, npk * 4) : NULL,
          *pv = group > 1 ? (float *)fa_take(at, npv * 4) : NULL;
    auto *dl = fa_delta_kernel<T16, DV>;
    CUDA_LAUNCH(dl, (unsigned)((rows + FA_WARPS - 1) / FA_WARPS), FA_THREADS, 0, delta, g16, c.out, a);
    cuda_check_launch("attention_backward (delta)");
    auto *dq = fa_dq_kernel<T16, DK, DV>;
    CUDA_LAUNCH(dq, qgrid, FA_THREADS, qbytes, c.dq, g16, delta, c.lse, q16, k16, v16, a);
    cuda_check_launch("attention_backward (dq, tensor cores)");
    const dim3 kgrid((unsigned)((Tk + FA_ROWS - 1) / FA_ROWS), (unsigned)a.H, (unsigned)a.B);
    auto *dkv = fa_dkv_kernel<T16, DK, DV>;
    CUDA_LAUNCH(dkv, kgrid, FA_THREADS, kbytes, c.dk, c.dv, pk, pv, g16, delta, c.lse, q16, k16, v16, a);
    cuda_check_launch("attention_backward (dk, dv, tensor cores)");
    if (group > 1) {
        CUDA_LAUNCH(fa_group_sum_kernel, cuda_blocks(a.B * Tk * a.KV * (DK + DV)), CUDA_THREADS, 0, c.dk, c.dv, pk, pv,
                    (int64_t)a.B, Tk, (int64_t)a.H, (int64_t)a.KV, (int64_t)DK, (int64_t)DV);
        cuda_check_launch("attention_backward (the groups' dk, dv)");
    }
    return true;
}

template <typename T16> static bool fa_dims(const cuda_flash_call &c) {
    const int64_t Dk = c.shape->Dk, Dv = c.shape->Dv;
    if (Dk == 64 && Dv == 64) return fa_launch<T16, 64, 64>(c);
    if (Dk == 128 && Dv == 128) return fa_launch<T16, 128, 128>(c);
    if (Dk == 192 && Dv == 128) return fa_launch<T16, 192, 128>(c);
    if (Dk == 32 && Dv == 32) return fa_launch<T16, 32, 32>(c);
    return false;
}

bool cuda_flash_attention(const cuda_flash_call *c) {
    if (!fa_device_ok() || c->shape->H % c->shape->KV != 0) return false;
    if (c->dtype == HT_DTYPE_BF16) return fa_dims<__nv_bfloat16>(*c);
    if (c->dtype == HT_DTYPE_F16) return fa_dims<__half>(*c);
    return false;
}
