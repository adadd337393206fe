/* The CUDA backend's optimizer passes, kernels/cpu/optim.c's formulas: AdamW's
 * fused update (each rounding step that of torch's fused AdamW, as on the
 * CPU, so the two give the same bits) with its rounding back to a bf16/f16
 * model copy, to nearest or stochastically; Muon's momentum and update;
 * the Newton-Schulz iteration on cuBLASLt's batched products. */
#include "kernels/cuda/cuda.cuh"

#include <math.h>

/* ---------------------------------------------------------------- AdamW */

/* The per-call scalars, computed in double on the host and rounded to FP32 (kernels/cpu/optim.c's). */
typedef struct adamw_scalars {
    float decay, w1, b2, c2, bc2_sqrt, eps, neg_step;
} adamw_scalars;

/* docs/NUMERICS.md, AdamW: p ← p·decay; m ← m + (1−β1)(g − m) (one FMA);
 * v ← fma((1−β2)g, g, β2·v); d = sqrt(v)/bc2_sqrt + eps; p ← p + (−step·m)/d.
 * Every step an intrinsic, so that the compiler fuses nothing else. p NULL:
 * the model copy holds the values (widened exactly, rounded back). */
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, adamw_scalars k, uint16_t *model,
                             bool bf16, bool stochastic, uint64_t stream) {
    CUDA_FOR(i, n) {
        const float x = p ? p[i] : dev_from16(model[i], bf16), gi = g[i], mo = m[i];
        const float pd = __fmul_rn(x, k.decay);
        const float mi = __fmaf_rn(k.w1, __fsub_rn(gi, mo), mo);
        const float vi = __fmaf_rn(__fmul_rn(k.c2, gi), gi, __fmul_rn(v[i], k.b2));
        const float d = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
        const float pi = __fadd_rn(pd, __fdiv_rn(__fmul_rn(k.neg_step, mi), d));
        m[i] = mi;
        v[i] = vi;
        if (p) p[i] = pi;
        if (model) model[i] = stochastic ? dev_round_stochastic(pi, bf16, stream, (uint64_t)i) : dev_to16(pi, bf16);
    }
}

void cuda_adamw_pass(float *p, const float *g, float *m, float *v, int64_t n, const ht_adamw_hparams *h, void *model,
                ht_dtype model_dtype, bool stochastic, uint64_t stream) {
    const adamw_scalars k = {
        (float)(1.0 - h->lr * h->weight_decay),
        (float)(1.0 - h->beta1),
        (float)h->beta2,
        (float)(1.0 - h->beta2),
        (float)sqrt(1.0 - pow(h->beta2, (double)h->step)),
        (float)h->eps,
        (float)(-(h->lr / (1.0 - pow(h->beta1, (double)h->step)))),
    };
    if (model_dtype != HT_DTYPE_BF16 && model_dtype != HT_DTYPE_F16) model = NULL;
    if ((!p && !model) || n <= 0) return;
    LAUNCH("adamw", adamw_kernel, cuda_blocks(n), CUDA_THREADS, p, g, m, v, n, k, (uint16_t *)model,
           model_dtype == HT_DTYPE_BF16, stochastic, stream);
}

/* ---------------------------------------------------------------- Muon */

/* torch's lerp as kernels/cpu/optim.c's torch_lerp: one FMA whose coefficient
 * (w, or w - 1) and base (start, or end) the weight chose once. */
__device__ __forceinline__ float torch_lerp_at(float coeff, bool small, float start, float end) {
    return __fmaf_rn(coeff, __fsub_rn(end, start), small ? start : end);
}

__global__ void muon_momentum_kernel(float *B, const float *g, float *u, int64_t n, float mu, float gw, bool torch) {
    const bool small_b = fabsf(gw) < 0.5f, small_u = fabsf(mu) < 0.5f;
    const float cb = small_b ? gw : __fsub_rn(gw, 1.0f), cu = small_u ? mu : __fsub_rn(mu, 1.0f);
    CUDA_FOR(i, n) {
        if (torch) {
            const float b = torch_lerp_at(cb, small_b, B[i], g[i]);
            B[i] = b;
            if (u) u[i] = torch_lerp_at(cu, small_u, g[i], b);
            continue;
        }
        const float b = mu * B[i] + gw * g[i];
        B[i] = b;
        if (u) u[i] = gw * g[i] + mu * b;
    }
}

void cuda_muon_momentum(float *B, const float *g, float *u, int64_t n, float mu, float gw, bool nesterov,
                        ht_muon_arith arith) {
    if (n <= 0) return;
    LAUNCH("muon_momentum", muon_momentum_kernel, cuda_blocks(n), CUDA_THREADS, B, g, nesterov ? u : NULL, n, mu, gw,
           arith == HT_MUON_ARITH_TORCH);
}

/* p (1 - lr wd) - lr scale O, as kernels/cpu/optim.c's decayed_step; fused
 * (TORCH): p decay, then one FMA. */
__device__ __forceinline__ float decayed_step(float p, float o, float decay, float step, bool fused) {
    return fused ? __fmaf_rn(-step, o, __fmul_rn(p, decay)) : __fsub_rn(__fmul_rn(p, decay), __fmul_rn(step, o));
}

/* Elements [first, first + n) of a param: p and the model copy from the new
 * value, or (p NULL) the copy widened, updated and rounded back; with
 * stochastic rounding O takes the new values first, as on the CPU. */
__global__ void muon_apply_kernel(float *p, float *O, int64_t n, float decay, float step, bool fused, uint16_t *model,
                                  bool bf16, bool stochastic, uint64_t stream, int64_t first) {
    CUDA_FOR(i, n) {
        const float x = decayed_step(p ? p[i] : dev_from16(model[i], bf16), O[i], decay, step, fused);
        if (!model) {
            p[i] = x;
        } else if (stochastic) {
            if (p)
                p[i] = x;
            else
                O[i] = x;
            model[i] = dev_round_stochastic(x, bf16, stream, (uint64_t)(first + i));
        } else {
            if (p) p[i] = x;
            model[i] = dev_to16(x, bf16);
        }
    }
}

void cuda_muon_apply(float *p, float *O, int64_t n, float decay, float step, ht_muon_arith arith, void *model,
                     ht_dtype dtype, bool stochastic, uint64_t stream, int64_t first) {
    if (n <= 0 || (!p && !model)) return;
    LAUNCH("muon_apply", muon_apply_kernel, cuda_blocks(n), CUDA_THREADS, p, O, n, decay, step,
           arith == HT_MUON_ARITH_TORCH, (uint16_t *)model, dtype == HT_DTYPE_BF16, stochastic, stream, first);
}

/* ---------------------------------------------------------------- Newton-Schulz */

/* kernels/cpu/optim.c's workspace (X, S, T in FP32, and their 16-bit operands),
 * then each matrix's sum of squares in double, 8-byte aligned. */
size_t cuda_ns_workspace_floats(int64_t count, int64_t rows, int64_t cols, ht_dtype ns_dtype, ht_ns_form form) {
    size_t rc = (size_t)rows * (size_t)cols, r = (size_t)(rows < cols ? rows : cols);
    size_t floats = rc + 2 * r * r;
    if (ns_dtype != HT_DTYPE_F32)
        floats += rc + 2 * r * r;
    else if (form == HT_NS_FORM_GRAM)
        floats += 2 * r * r; /* the Gram form's R, P, Q and a product */
    return (size_t)count * floats + 2 * (size_t)count + 2;
}

/* The Gram form (kernels/cpu/optim.c, docs/NUMERICS.md): R formed again every
 * NS_GRAM_BLOCK iterations, the same blocks as the CPU's. */
#define NS_GRAM_BLOCK 3

/* Whether the Gram form takes fewer multiply-adds than the standard one for
 * K iterations on (r, c), r <= c, every product whole (optim.c's count
 * without its symmetric panels). */
static bool ns_gram_pays(int64_t r, int64_t c, int K) {
    const double rrc = (double)r * r * c, r3 = (double)r * r * r;
    const double standard = K * (2 * rrc + r3);
    double gram = rrc;
    for (int k = 0; k < K; k++) {
        if (k % NS_GRAM_BLOCK == 0) gram += (k ? rrc : 0) + rrc;
        gram += r3;
        if (k % NS_GRAM_BLOCK) gram += r3;
        if ((k + 1) % NS_GRAM_BLOCK && k + 1 < K) gram += 2 * r3;
    }
    return gram < standard;
}

/* P = a I + b R + c R2 on (count, r, r). */
__global__ void ns_polynomial_kernel(float *P, const float *R, const float *R2, int64_t r, int64_t all, float a,
                                     float b, float c) {
    CUDA_FOR(i, all) {
        const int64_t at = i % (r * r);
        P[i] = b * R[i] + c * R2[i] + (at / r == at % r ? a : 0.0f);
    }
}

/* X[i] = G[i] / (‖G_e‖ + eps) with e the matrix of element i. */
__global__ void ns_normalize_kernel(float *X, const float *G, const double *squares, int64_t n, int64_t all,
                                    double eps) {
    CUDA_FOR(i, all) {
        const float inv = (float)(1.0 / (sqrt(squares[i / n]) + eps));
        X[i] = G[i] * inv;
    }
}

/* The torch form's start (optim.c): X holds G in the 16-bit dtype; each
 * element divided by the matrix's norm (its sum of squares in `squares`)
 * clamped at eps, the norm, eps and the quotient each rounded to that dtype. */
__global__ void ns_normalize_torch_kernel(float *X, const double *squares, int64_t n, int64_t all, double eps,
                                          bool bf16) {
    CUDA_FOR(i, all) {
        const float norm = dev_from16(dev_to16((float)sqrt(squares[i / n]), bf16), bf16);
        const float floor = dev_from16(dev_to16((float)eps, bf16), bf16);
        X[i] = dev_from16(dev_to16(__fdiv_rn(X[i], fmaxf(norm, floor)), bf16), bf16);
    }
}

/* b = x − (what b holds of x), rounded to the 16-bit dtype (optim.c's residual_operand). */
__global__ void ns_residual_kernel(uint16_t *b, const float *x, int64_t n, bool bf16) {
    CUDA_FOR(i, n) b[i] = dev_to16(__fsub_rn(x[i], dev_from16(b[i], bf16)), bf16);
}

/* The products of the iteration on `count` matrices at once, in ns_dtype. */
#define NS_GEMM(ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc)                                      \
    cuda_gemm_batched(count, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, ns_dtype, beta, C, ldc, sc)

/* Y = M X + beta Y (wide) or X Mᵀ + beta Y (tall) for `count` (r, r) matrices M: how every form multiplies X (or
 * an operand of it) by an (r, r) polynomial. Needs tall, rows, cols, n and rr in scope, as NS_GEMM needs count. */
#define NS_APPLY(M, Xop, beta, Y)                                                                                      \
    do {                                                                                                               \
        if (tall)                                                                                                      \
            NS_GEMM(false, true, rows, cols, cols, 1.0f, Xop, cols, n, M, cols, rr, beta, Y, cols, n);                 \
        else                                                                                                           \
            NS_GEMM(false, false, rows, cols, rows, 1.0f, M, rows, rr, Xop, cols, n, beta, Y, cols, n);                \
    } while (0)

/* kernels/cpu/optim.c's ht_ns_iterate (docs/NUMERICS.md, Newton–Schulz iteration), step for step, the
 * 16-bit operands always held as 16-bit values (the GPU's products take them natively). */
/* optim.c's ns_gram: X normalized in X, `other` free, the result in O (the caller's parity). */
static void ns_gram(float *X, float *other, int64_t count, int64_t rows, int64_t cols, const double (*coeffs)[3], int K,
                    float *ws) {
    const ht_dtype ns_dtype = HT_DTYPE_F32;
    cudaStream_t stream = cuda_ctx()->stream;
    const bool tall = rows > cols;
    const int64_t r = tall ? cols : rows, n = rows * cols, rr = r * r;
    float *R = ws, *P = R + count * rr, *Q = P + count * rr, *W = Q + count * rr;
    for (int k = 0; k < K; k++) {
        const float a = (float)coeffs[k][0], b = (float)coeffs[k][1], c = (float)coeffs[k][2];
        if (k % NS_GRAM_BLOCK == 0) {
            if (k) {
                NS_APPLY(Q, X, 0.0f, other);
                float *swap = X;
                X = other;
                other = swap;
            }
            if (tall)
                NS_GEMM(true, false, r, r, rows, 1.0f, X, cols, n, X, cols, n, 0.0f, R, r, rr);
            else
                NS_GEMM(false, true, r, r, cols, 1.0f, X, cols, n, X, cols, n, 0.0f, R, r, rr);
        }
        NS_GEMM(false, false, r, r, r, 1.0f, R, r, rr, R, r, rr, 0.0f, W, r, rr);
        LAUNCH("newton_schulz", ns_polynomial_kernel, cuda_blocks(count * rr), CUDA_THREADS, P, R, W, r, count * rr, a,
               b, c);
        if (k % NS_GRAM_BLOCK == 0) {
            cuda_ok(cudaMemcpyAsync(Q, P, (size_t)(count * rr) * sizeof(float), cudaMemcpyDeviceToDevice, stream),
                    "newton_schulz (copy)");
        } else {
            NS_GEMM(false, false, r, r, r, 1.0f, P, r, rr, Q, r, rr, 0.0f, W, r, rr);
            float *swap = Q;
            Q = W;
            W = swap;
        }
        if ((k + 1) % NS_GRAM_BLOCK && k + 1 < K) {
            NS_GEMM(false, false, r, r, r, 1.0f, R, r, rr, P, r, rr, 0.0f, W, r, rr);
            NS_GEMM(false, false, r, r, r, 1.0f, P, r, rr, W, r, rr, 0.0f, R, r, rr);
        }
    }
    NS_APPLY(Q, X, 0.0f, other);
}

void cuda_ns_iterate(const float *G, float *O, int64_t count, int64_t rows, int64_t cols, const double (*coeffs)[3],
                        int steps, double eps, ht_dtype ns_dtype, ht_ns_form form, float *work) {
    if (count <= 0 || rows <= 0 || cols <= 0) return;
    cudaStream_t stream = cuda_ctx()->stream;
    const bool tall = rows > cols, half = ns_dtype != HT_DTYPE_F32, bf16 = ns_dtype == HT_DTYPE_BF16;
    const int64_t r = tall ? cols : rows, n = rows * cols, rr = r * r, all = count * n;
    const int K = steps;
    float *S = work + all, *T = S + count * rr;
    uint16_t *Xb = (uint16_t *)(T + count * rr), *Sb = (uint16_t *)((float *)Xb + all),
             *Tb = (uint16_t *)((float *)Sb + count * rr);
    const bool gram = form == HT_NS_FORM_GRAM && !half && ns_gram_pays(r, tall ? rows : cols, K);
    const bool torch = form == HT_NS_FORM_TORCH && half;
    size_t used = (size_t)(all + 2 * count * rr) * (half ? 2 : 1) + (gram ? 2 * count * rr : 0);
    used += used & 1; /* the doubles 8-byte aligned */
    double *squares = (double *)(work + used);

    const int writes = gram ? (K - 1) / NS_GRAM_BLOCK + 1 : K; /* optim.c's parity: the last write lands in O */
    float *X = writes % 2 == 0 ? O : work, *Y = writes % 2 == 0 ? work : O;
    if (torch) {
        cuda_ok(cudaMemcpyAsync(X, G, (size_t)all * sizeof(float), cudaMemcpyDeviceToDevice, stream),
                "newton_schulz (copy)");
        cuda_round_to(X, (size_t)all, ns_dtype);
        for (int64_t e = 0; e < count; e++) cuda_sum_squares_into(squares + e, X + e * n, n);
        LAUNCH("newton_schulz", ns_normalize_torch_kernel, cuda_blocks(all), CUDA_THREADS, X, squares, n, all, eps,
               bf16);
    } else {
        for (int64_t e = 0; e < count; e++) cuda_sum_squares_into(squares + e, G + e * n, n);
        LAUNCH("newton_schulz", ns_normalize_kernel, cuda_blocks(all), CUDA_THREADS, X, G, squares, n, all, eps);
    }
    if (gram) {
        ns_gram(X, Y, count, rows, cols, coeffs, K, S);
        return;
    }

    for (int k = 0; k < K; k++) {
        const float a = (float)coeffs[k][0], b = (float)coeffs[k][1], c = (float)coeffs[k][2];
        const void *x = X;
        if (half) cuda_convert(Xb, ns_dtype, X, HT_DTYPE_F32, (size_t)all), x = Xb;
        /* S = X Xᵀ (wide) or XᵀX (tall): (r, r) */
        if (tall)
            NS_GEMM(true, false, r, r, rows, 1.0f, x, cols, n, x, cols, n, 0.0f, S, r, rr);
        else
            NS_GEMM(false, true, r, r, cols, 1.0f, x, cols, n, x, cols, n, 0.0f, S, r, rr);
        /* T = b S + c S S, both terms on S rounded to ns_dtype (optim.c says why) */
        if (torch) cuda_round_to(S, (size_t)(count * rr), ns_dtype);
        cuda_ok(cudaMemcpyAsync(T, S, (size_t)(count * rr) * sizeof(float), cudaMemcpyDeviceToDevice, stream),
                "newton_schulz (copy)");
        const void *s = S;
        if (half) {
            cuda_round_to(T, (size_t)(count * rr), ns_dtype);
            cuda_convert(Sb, ns_dtype, S, HT_DTYPE_F32, (size_t)(count * rr));
            s = Sb;
        }
        NS_GEMM(false, false, r, r, r, c, s, r, rr, s, r, rr, b, T, r, rr);
        if (torch) cuda_round_to(T, (size_t)(count * rr), ns_dtype);
        /* Y = a X + T X (wide) or a X + X Tᵀ (tall) */
        cuda_ok(cudaMemcpyAsync(Y, X, (size_t)all * sizeof(float), cudaMemcpyDeviceToDevice, stream),
                "newton_schulz (copy)");
        const void *t = T;
        if (half) cuda_convert(Tb, ns_dtype, T, HT_DTYPE_F32, (size_t)(count * rr)), t = Tb;
        NS_APPLY(t, x, a, Y);
        /* In a 16-bit ns_dtype, T (X − x) gives back the first-order part of X's rounding; the torch form
         * rounds Y instead. */
        if (torch) {
            cuda_round_to(Y, (size_t)all, ns_dtype);
        } else if (half) {
            LAUNCH("newton_schulz", ns_residual_kernel, cuda_blocks(all), CUDA_THREADS, Xb, X, all, bf16);
            NS_APPLY(t, Xb, 1.0f, Y);
        }
        float *swap = X;
        X = Y;
        Y = swap;
    }
}
