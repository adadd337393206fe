/* The optimizer passes, kernels behind the table as the rest: AdamW's
 * fused update with its cast back to a bf16/f16 model copy (AVX-512, or
 * AVX2 with FMA and F16C, where the build has them), Muon's momentum and
 * update, the Newton-Schulz iteration, and a scaling pass (gradient
 * clipping). The optimizers in
 * optim/ decide what runs on which rows; the arithmetic is here. */
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/ops.h"

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "hypertrain/kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#include <immintrin.h>
#endif

/* ------------------------------------------------------------------ Muon */

/* torch's lerp (at::native's lerp kernels, CPU and CUDA) with weight w:
 * start + w (end - start) for |w| < 0.5, else end + (w - 1)(end - start),
 * each one FMA. The weight's branch is the call's, not the element's: the
 * FMA's coefficient and base chosen once. */
typedef struct torch_lerp {
    float coeff; /* w, or w - 1 */
    bool small;  /* |w| < 0.5: the base is start, else end */
} torch_lerp;

static torch_lerp torch_lerp_of(float w) {
    const bool small = fabsf(w) < 0.5f;
    return (torch_lerp){small ? w : w - 1.0f, small};
}

static inline float torch_lerp_at(torch_lerp l, float start, float end) {
    return fmaf(l.coeff, end - start, l.small ? start : end);
}

/* B <- mu B + gw g (the momentum buffer) and, with nesterov, u = gw g + mu B
 * (the matrix Newton-Schulz takes); without nesterov u is B itself and
 * nothing is written to u. TORCH: B <- B.lerp(g, gw), u = g.lerp(B, mu),
 * torch.optim.Muon's (gw = 1 - mu rounded from double, as its weight). */
void ht_muon_momentum(float *B, const float *g, float *u, int64_t n, float mu, float gw, bool nesterov,
                      ht_muon_arith arith) {
    if (arith == HT_MUON_ARITH_TORCH) {
        const torch_lerp lb = torch_lerp_of(gw), lu = torch_lerp_of(mu);
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            const float b = torch_lerp_at(lb, B[i], g[i]);
            B[i] = b;
            if (nesterov) u[i] = torch_lerp_at(lu, g[i], b);
        }
    } else if (nesterov) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            float b = mu * B[i] + gw * g[i];
            B[i] = b;
            u[i] = gw * g[i] + mu * b;
        }
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) B[i] = mu * B[i] + gw * g[i];
    }
}

/* p (1 - lr wd) - lr scale O: one expression for every path below, so that
 * the values from a main param and from the model round alike, each FMA
 * written out (a contraction left to the compiler may differ from loop to
 * loop). PLAIN: p decay + (-(step O)), the product rounded first. TORCH:
 * param.mul_(decay) and then param.add_(O, alpha=-step), one FMA. */
static inline float decayed_step(float p, float o, float decay, float step, bool fused) {
    return fused ? fmaf(-step, o, p * decay) : fmaf(p, decay, -(step * o));
}

void ht_muon_apply(float *p, float *O, int64_t n, float decay, float step, ht_muon_arith arith, void *model,
                   ht_dtype dtype, bool stochastic, uint64_t stream, int64_t first) {
    uint16_t *out = model;
    const bool bf16 = dtype == HT_DTYPE_BF16, fused = arith == HT_MUON_ARITH_TORCH;
    if (!model) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) p[i] = decayed_step(p[i], O[i], decay, step, fused);
    } else if (stochastic) {
        float *x = p ? p : O;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++)
            x[i] = decayed_step(p      ? p[i]
                                : bf16 ? ht_bf16_to_f32(out[i])
                                       : ht_f16_to_f32(out[i]),
                                O[i], decay, step, fused);
        ht_convert_stochastic_at(out, dtype, x, (size_t)n, stream, (size_t)first);
    } else if (p) {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            p[i] = decayed_step(p[i], O[i], decay, step, fused);
            out[i] = bf16 ? ht_f32_to_bf16(p[i]) : ht_f32_to_f16(p[i]);
        }
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) {
            float x = decayed_step(bf16 ? ht_bf16_to_f32(out[i]) : ht_f16_to_f32(out[i]), O[i], decay, step, fused);
            out[i] = bf16 ? ht_f32_to_bf16(x) : ht_f32_to_f16(x);
        }
    }
}

/* ------------------------------------------------------------------ Newton-Schulz */

size_t ht_ns_workspace_floats(int64_t count, int64_t rows, int64_t cols, ht_dtype ns_dtype, ht_ns_form form) {
    size_t rc = (size_t)rows * (size_t)cols, r = (size_t)(rows < cols ? rows : cols);
    size_t floats = rc + 2 * r * r; /* X (the other ping-pong buffer is O), S, T */
    if (ns_dtype != HT_DTYPE_F32)
        floats += rc + 2 * r * r; /* X, S and T in ns_dtype (ht_gemm_storage) */
    else if (form == HT_NS_FORM_GRAM)
        floats += 2 * r * r; /* the Gram form's R, P, Q and a product: 4 (r, r) */
    return (size_t)count * floats;
}

/* sum of squares in double (docs/NUMERICS.md: the norm is accumulated in double). */
static double frobenius(const float *x, int64_t n) { return sqrt(ht_sum_squares(x, n)); }

/* The operand of a product in ns_dtype, stored as the chosen kernel takes it
 * (`storage`): x itself for F32, else its rounding to ns_dtype in `b`, as
 * 16-bit values or as FP32 values of that precision. */
static const void *operand(const float *x, float *b, int64_t n, ht_dtype ns_dtype, ht_dtype storage) {
    if (ns_dtype == HT_DTYPE_F32) return x;
    if (storage == HT_DTYPE_F32) {
        memcpy(b, x, (size_t)n * sizeof(float));
        ht_round_to(b, (size_t)n, ns_dtype);
    } else {
        ht_convert(b, storage, x, HT_DTYPE_F32, (size_t)n);
    }
    return b;
}

/* In place on the operand `b` that operand() made of x: b becomes x − b (the
 * part of x that rounding to ns_dtype dropped), itself rounded to ns_dtype. */
static void residual_operand(const float *x, void *b, int64_t n, ht_dtype ns_dtype, ht_dtype storage) {
    if (storage == HT_DTYPE_F32) {
        float *f = b;
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) f[i] = x[i] - f[i];
        ht_round_to(f, (size_t)n, ns_dtype);
        return;
    }
    uint16_t *h = b;
    const bool bf16 = storage == HT_DTYPE_BF16;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        float kept = bf16 ? ht_bf16_to_f32(h[i]) : ht_f16_to_f32(h[i]);
        h[i] = bf16 ? ht_f32_to_bf16(x[i] - kept) : ht_f32_to_f16(x[i] - kept);
    }
}

/* The products of the iteration on `count` matrices at once: operand e of
 * each is `stride` elements past operand e - 1 (X n, S and T r²), so each
 * product is one batched GEMM, the same product per matrix as one GEMM. */
#define NS_GEMM(ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, beta, C, ldc, sc)                                      \
    ht_gemm_batched(count, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, st, beta, C, ldc, sc)

/* Y = M X + beta Y (wide) or X Mᵀ + beta Y (tall) for `count` (r, r) matrices M: how every form multiplies X (or
 * an operand of it) by an (r, r) polynomial. Needs tall, rows, cols, n and rr in scope, as NS_GEMM needs count. */
#define NS_APPLY(M, Xop, beta, Y)                                                                                      \
    do {                                                                                                               \
        if (tall)                                                                                                      \
            NS_GEMM(false, true, rows, cols, cols, 1.0f, Xop, cols, n, M, cols, rr, beta, Y, cols, n);                 \
        else                                                                                                           \
            NS_GEMM(false, false, rows, cols, rows, 1.0f, M, rows, rr, Xop, cols, n, beta, Y, cols, n);                \
    } while (0)

/* Rows of C a panel of sym_gemm holds: about an eighth of r, a multiple of
 * 16; below SYM_MIN_ROWS the whole product is one GEMM (the saving is
 * small there and a panel's GEMM too narrow to run at the full rate). */
#define SYM_PANELS 8
#define SYM_MIN_ROWS 256

/* A product known to be symmetric, C (r, r) = alpha op(A) op(B) + beta C on
 * `count` matrices (the operands as NS_GEMM takes them): panel by panel,
 * rows [i0, i1) by columns [i0, r), then the strict lower triangle copied
 * from the upper. About half the multiply-adds of the whole product
 * (9/16 with eight panels), and C exactly symmetric. */
static void sym_gemm(int64_t count, bool ta, bool tb, int64_t r, int64_t K, float alpha, const void *A, int64_t lda,
                     int64_t sa, const void *B, int64_t ldb, int64_t sb, ht_dtype st, float beta, float *C) {
    const int64_t rr = r * r;
    if (r < SYM_MIN_ROWS) {
        ht_gemm_batched(count, ta, tb, r, r, K, alpha, A, lda, sa, B, ldb, sb, st, beta, C, r, rr);
        return;
    }
    const size_t es = ht_dtype_size(st);
    const int64_t pb = ((r + SYM_PANELS - 1) / SYM_PANELS + 15) / 16 * 16;
    for (int64_t i0 = 0; i0 < r; i0 += pb) {
        const int64_t m = i0 + pb < r ? pb : r - i0;
        const char *a = (const char *)A + (size_t)(ta ? i0 : i0 * lda) * es; /* op(A)'s rows [i0, i0 + m) */
        const char *b = (const char *)B + (size_t)(tb ? i0 * ldb : i0) * es; /* op(B)'s columns [i0, r) */
        ht_gemm_batched(count, ta, tb, m, r - i0, K, alpha, a, lda, sa, b, ldb, sb, st, beta, C + i0 * r + i0, r, rr);
    }
    enum { TILE = 32 };
    const int64_t tiles = (r + TILE - 1) / TILE;
#pragma omp parallel for collapse(2) schedule(static)
    for (int64_t e = 0; e < count; e++) {
        for (int64_t ti = 0; ti < tiles; ti++) { /* tile row ti, columns up to its diagonal */
            float *c = C + e * rr;
            const int64_t i_end = (ti + 1) * TILE < r ? (ti + 1) * TILE : r;
            for (int64_t tj = 0; tj <= ti; tj++)
                for (int64_t i = ti * TILE; i < i_end; i++) {
                    const int64_t j_end = tj == ti ? i : (tj + 1) * TILE;
                    for (int64_t j = tj * TILE; j < j_end; j++) c[i * r + j] = c[j * r + i];
                }
        }
    }
}

/* ---------------------------------------------------------------- the Gram form
 *
 * docs/NUMERICS.md, Muon: the iteration X <- p(X Xᵀ) X, p(S) = a + b S +
 * c S², multiplies X by a polynomial of its own Gram matrix, so after k
 * iterations X_k = Q_k X_0 with Q_k an (r, r) product of polynomials. The
 * Gram form iterates on (r, r) matrices alone: R = X_0 X_0ᵀ, then each
 * iteration P = a I + b R + c R², Q <- P Q, R <- P R P (the Gram matrix of
 * P X), and X = Q X_0 once at the end. For an (r, c) matrix with c well
 * above r that is fewer multiply-adds (r³ products instead of r²c ones).
 * Rounding makes R drift from the Gram matrix of the X it stands for, and
 * the drift grows with every iteration: every GRAM_BLOCK iterations X is
 * formed (Q X_0) and R computed from it again, which keeps the result as
 * near float64's as the standard form's (bound and figures: docs/NUMERICS.md, The Gram form). */
#define GRAM_BLOCK 3

/* Multiply-adds of a product sym_gemm makes, (r, r) over K. */
static double sym_macs(int64_t r, int64_t K) { return (r >= SYM_MIN_ROWS ? 9.0 / 16.0 : 1.0) * (double)r * r * K; }

/* Whether the Gram form takes fewer multiply-adds than the standard one for
 * K iterations on (r, c), r <= c: a function of the shape, so each shape's
 * bits are fixed. */
static bool gram_pays(int64_t r, int64_t c, int K) {
    const double rrc = (double)r * r * c, r3 = (double)r * r * r;
    const double standard = K * (sym_macs(r, c) + sym_macs(r, r) + rrc);
    double gram = rrc; /* X = Q X_0 at the end */
    for (int k = 0; k < K; k++) {
        if (k % GRAM_BLOCK == 0) gram += (k ? rrc : 0) + sym_macs(r, c);    /* X_0 <- Q X_0, R = X_0 X_0ᵀ */
        gram += sym_macs(r, r);                                             /* R² */
        if (k % GRAM_BLOCK) gram += r3;                                     /* Q <- P Q */
        if ((k + 1) % GRAM_BLOCK && k + 1 < K) gram += r3 + sym_macs(r, r); /* R <- P (R P) */
    }
    return gram < standard;
}

/* P = a I + b R + c R2 on `count` (r, r) matrices. */
static void gram_polynomial(float *P, const float *R, const float *R2, int64_t count, int64_t r, float a, float b,
                            float c) {
    const int64_t rr = r * r;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < count * rr; i++) {
        const int64_t at = i % rr;
        P[i] = b * R[i] + c * R2[i] + (at / r == at % r ? a : 0.0f);
    }
}

/* The Gram form on `count` normalized FP32 matrices X (each n = rows · cols,
 * r = min(rows, cols)) held in `work` or O (whichever the parity below
 * puts them in: `X`), the other of the two free; the result lands in O.
 * ws: 4 · count · r² floats. */
static void ns_gram(float *X, float *other, int64_t count, int64_t rows, int64_t cols, const double (*coeffs)[3], int K,
                    float *ws) {
    const bool tall = rows > cols;
    const int64_t r = tall ? cols : rows, n = rows * cols, rr = r * r;
    const ht_dtype st = HT_DTYPE_F32;
    float *R = ws, *P = R + count * rr, *Q = P + count * rr, *W = Q + count * rr;
    for (int k = 0; k < K; k++) {
        const float a = (float)coeffs[k][0], b = (float)coeffs[k][1], c = (float)coeffs[k][2];
        if (k % GRAM_BLOCK == 0) {
            if (k) { /* X <- Q X (wide) or X Qᵀ (tall), then its Gram matrix again */
                NS_APPLY(Q, X, 0.0f, other);
                float *swap = X;
                X = other;
                other = swap;
            }
            if (tall)
                sym_gemm(count, true, false, r, rows, 1.0f, X, cols, n, X, cols, n, st, 0.0f, R);
            else
                sym_gemm(count, false, true, r, cols, 1.0f, X, cols, n, X, cols, n, st, 0.0f, R);
        }
        sym_gemm(count, false, false, r, r, 1.0f, R, r, rr, R, r, rr, st, 0.0f, W); /* R² */
        gram_polynomial(P, R, W, count, r, a, b, c);
        if (k % GRAM_BLOCK == 0) {
            memcpy(Q, P, (size_t)(count * rr) * sizeof(float));
        } else { /* Q <- P Q, through W */
            NS_GEMM(false, false, r, r, r, 1.0f, P, r, rr, Q, r, rr, 0.0f, W, r, rr);
            float *swap = Q;
            Q = W;
            W = swap;
        }
        if ((k + 1) % GRAM_BLOCK && k + 1 < K) { /* R <- P (R P): the Gram matrix of P X, symmetric */
            NS_GEMM(false, false, r, r, r, 1.0f, R, r, rr, P, r, rr, 0.0f, W, r, rr);
            sym_gemm(count, false, false, r, r, 1.0f, P, r, rr, W, r, rr, st, 0.0f, R);
        }
    }
    NS_APPLY(Q, X, 0.0f, other);
}

/* The iteration works on X (r, c) with r <= c: a wide G as it is, a tall one
 * through transposed products (S = XᵀX, X <- a X + X Tᵀ), which is the
 * transposed iteration of docs/NUMERICS.md without copying Gᵀ. `count` matrices
 * of one shape, each n = rows · cols after the one before, iterate side by
 * side; the elementwise passes run over all of them as one array, the
 * norms matrix by matrix, so each matrix's result is what it would be alone. */
void ht_ns_iterate(const float *G, float *O, int64_t count, int64_t rows, int64_t cols, const double (*coeffs)[3],
                   int steps, double eps, ht_dtype ns_dtype, ht_ns_form form, float *work) {
    const bool tall = rows > cols; /* docs/NUMERICS.md transposes it so that r <= c */
    const int64_t r = tall ? cols : rows, n = rows * cols, rr = r * r, all = count * n;
    const int K = steps;
    float *S = work + all, *T = S + count * rr; /* (count, r, r) each */
    float *Xb = T + count * rr, *Sb = Xb + all, *Tb = Sb + count * rr;
    const ht_dtype st = ht_gemm_storage(ns_dtype);
    const bool gram = form == HT_NS_FORM_GRAM && ns_dtype == HT_DTYPE_F32 && gram_pays(r, tall ? rows : cols, K);
    const bool torch = form == HT_NS_FORM_TORCH && ns_dtype != HT_DTYPE_F32;

    /* X lives in O and `work` by turns, so that the last iteration lands in
     * O: the standard form writes X K times, the Gram form once a block. */
    const int writes = gram ? (K - 1) / GRAM_BLOCK + 1 : K;
    float *X = writes % 2 == 0 ? O : work, *Y = writes % 2 == 0 ? work : O;
    for (int64_t e = 0; e < count; e++) {
        const float *g = G + e * n;
        float *x = X + e * n;
        if (torch) { /* G in ns_dtype, divided by its norm clamped at eps, each rounded to ns_dtype */
            memcpy(x, g, (size_t)n * sizeof(float));
            ht_round_to(x, (size_t)n, ns_dtype);
            float norm = (float)frobenius(x, n), floor = (float)eps;
            ht_round_to(&norm, 1, ns_dtype);
            ht_round_to(&floor, 1, ns_dtype);
            norm = norm > floor ? norm : floor;
#pragma omp parallel for schedule(static)
            for (int64_t i = 0; i < n; i++) x[i] = x[i] / norm;
            ht_round_to(x, (size_t)n, ns_dtype);
            continue;
        }
        const float inv = (float)(1.0 / (frobenius(g, n) + eps));
#pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) x[i] = g[i] * inv;
    }
    if (gram) {
        ns_gram(X, Y, count, rows, cols, coeffs, K, S);
        return;
    }

    for (int k = 0; k < K; k++) {
        const float a = (float)coeffs[k][0], b = (float)coeffs[k][1], c = (float)coeffs[k][2];
        const void *x = operand(X, Xb, all, ns_dtype, st);
        /* S = X Xᵀ (wide) or XᵀX (tall): (r, r), symmetric */
        if (tall)
            sym_gemm(count, true, false, r, rows, 1.0f, x, cols, n, x, cols, n, st, 0.0f, S);
        else
            sym_gemm(count, false, true, r, cols, 1.0f, x, cols, n, x, cols, n, st, 0.0f, S);
        /* T = b S + c S S: S copied into T, scaled by beta. In a 16-bit
         * ns_dtype both terms take S rounded to it: the iteration is then one
         * polynomial of one matrix, whose contraction near singular value 1
         * damps the rounding; an FP32 S beside a rounded S·S leaves their
         * difference to be amplified by b (in a PyTorch emulation of this
         * iteration, 20% further from float64 on 48x160 to 96x96 matrices). */
        if (torch) ht_round_to(S, (size_t)(count * rr), ns_dtype); /* torch's S = X @ X.T, in ns_dtype */
        memcpy(T, S, (size_t)(count * rr) * sizeof(float));
        if (ns_dtype != HT_DTYPE_F32 && !torch) ht_round_to(T, (size_t)(count * rr), ns_dtype);
        const void *s = operand(S, Sb, count * rr, ns_dtype, st);
        sym_gemm(count, false, false, r, r, c, s, r, rr, s, r, rr, st, b, T); /* S S is symmetric too */
        if (torch) ht_round_to(T, (size_t)(count * rr), ns_dtype); /* torch's addmm(S, S, S, beta=b, alpha=c) */
        /* Y = a X + T X (wide) or a X + X Tᵀ (tall): X copied into Y, scaled by beta. */
        memcpy(Y, X, (size_t)all * sizeof(float));
        const void *t = operand(T, Tb, count * rr, ns_dtype, st);
        NS_APPLY(t, x, a, Y);
        /* In a 16-bit ns_dtype, a X takes the FP32 X but T X its rounding x:
         * the difference X − x is not contracted like the rest and, carried
         * by a, dominates the error. One more product, T (X − x), gives back
         * its first-order part (the residual itself rounded: a 2^-9 error of
         * a 2^-9 quantity). With both changes, measured on gradient-sized
         * matrices: 1.1-6x closer to float64 than before, and closer than
         * torch's bf16 iteration on each (tests/test_muon.c,
         * bench/RESULTS.md), for one product in four more. */
        if (torch) {
            ht_round_to(Y, (size_t)all, ns_dtype); /* torch's addmm(X, T, X, beta=a) */
        } else if (ns_dtype != HT_DTYPE_F32) {
            residual_operand(X, Xb, all, ns_dtype, st);
            NS_APPLY(t, Xb, 1.0f, Y);
        }
        float *swap = X;
        X = Y;
        Y = swap;
    }
}

/* ------------------------------------------------------------------ scaling */

void ht_scale(float *x, int64_t n, float k) {
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] *= k;
}

/* ------------------------------------------------------------------ AdamW */

/* Each rounding step of AdamW's is one step of PyTorch's fused CPU AdamW kernel
 * (torch.optim.AdamW(fused=True)), whose results these match bit for bit as
 * measured; torch's single-tensor path differs from both by one ulp of sqrt
 * on about a fifth of the elements. So the compiler must not
 * fuse a multiply into the following add (from here to the end of the file:
 * AdamW comes last): the only FMAs are the ones torch's
 * kernel uses (lerp, addcmul). */
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off", "no-math-errno")
#endif

/* The per-call scalars, computed once in double as PyTorch does on the host,
 * then rounded to FP32 as its kernels do. */
typedef struct adamw_scalars {
    float decay;    /* 1 − lr·wd */
    float w1;       /* 1 − β1: exp_avg.lerp_(g, 1 − β1) */
    float b2, c2;   /* β2 and 1 − β2: exp_avg_sq.mul_(β2).addcmul_(g, g, 1 − β2) */
    float bc2_sqrt; /* sqrt(1 − β2^t) */
    float eps;      /* added after the division by bc2_sqrt */
    float neg_step; /* −lr / (1 − β1^t): p.addcdiv_(m, denom, −step_size) */
} adamw_scalars;

/* One element (docs/NUMERICS.md, AdamW), written as torch's op sequence:
 *   p ← p·decay;  m ← m + (1−β1)(g − m) (one FMA);  v ← fma((1−β2)g, g, β2·v);
 *   d = sqrt(v)/bc2_sqrt + eps;  p ← p + (−step_size·m)/d.
 * The vector path below performs the same roundings in the same order. */
static inline float adamw_element(float *p, float g, float *m, float *v, const adamw_scalars *k) {
    float pd = *p * k->decay;
    float mi = fmaf(k->w1, g - *m, *m);
    float vi = fmaf(k->c2 * g, g, *v * k->b2);
    float d = sqrtf(vi) / k->bc2_sqrt + k->eps;
    float pi = pd + (k->neg_step * mi) / d;
    *m = mi;
    *v = vi;
    *p = pi;
    return pi;
}

static inline void store_model(void *model, ht_dtype dtype, int64_t i, float x) {
    ((uint16_t *)model)[i] = dtype == HT_DTYPE_BF16 ? ht_f32_to_bf16(x) : ht_f32_to_f16(x);
}

#ifdef __AVX512F__
/* ht_f32_to_bf16 on 16 lanes: round to nearest even by integer add; NaN stays quiet NaN. */
static inline __m256i bf16_round16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i abs = _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(abs, _mm512_set1_epi32(0x7f800000));
    __m512i q = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, r, q));
}

static inline __m512 adamw_vec16(float *p, const float *g, float *m, float *v, const adamw_scalars *k) {
    __m512 gi = _mm512_loadu_ps(g), mi = _mm512_loadu_ps(m), vi = _mm512_loadu_ps(v);
    __m512 pd = _mm512_mul_ps(_mm512_loadu_ps(p), _mm512_set1_ps(k->decay));
    mi = _mm512_fmadd_ps(_mm512_set1_ps(k->w1), _mm512_sub_ps(gi, mi), mi);
    vi = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_set1_ps(k->c2), gi), gi, _mm512_mul_ps(vi, _mm512_set1_ps(k->b2)));
    __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(k->bc2_sqrt)), _mm512_set1_ps(k->eps));
    __m512 pi = _mm512_add_ps(pd, _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(k->neg_step), mi), d));
    _mm512_storeu_ps(m, mi);
    _mm512_storeu_ps(v, vi);
    _mm512_storeu_ps(p, pi);
    return pi;
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define ADAMW_AVX2 1
/* ht_f32_to_bf16 on 8 lanes, as bf16_round16 above. */
static inline __m128i bf16_round8(__m256 x) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000)); /* both non-negative as int32 */
    __m256i q = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    __m256i h = _mm256_blendv_epi8(r, q, nan); /* each lane <= 0xffff */
    /* packus works within each 128-bit half: lanes 0-3 land in qword 0, lanes 4-7 in qword 2 */
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
}

/* adamw_element on 8 lanes: the same operations in the same order. */
static inline __m256 adamw_vec8(float *p, const float *g, float *m, float *v, const adamw_scalars *k) {
    __m256 gi = _mm256_loadu_ps(g), mi = _mm256_loadu_ps(m), vi = _mm256_loadu_ps(v);
    __m256 pd = _mm256_mul_ps(_mm256_loadu_ps(p), _mm256_set1_ps(k->decay));
    mi = _mm256_fmadd_ps(_mm256_set1_ps(k->w1), _mm256_sub_ps(gi, mi), mi);
    vi = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(k->c2), gi), gi, _mm256_mul_ps(vi, _mm256_set1_ps(k->b2)));
    __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(k->bc2_sqrt)), _mm256_set1_ps(k->eps));
    __m256 pi = _mm256_add_ps(pd, _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(k->neg_step), mi), d));
    _mm256_storeu_ps(m, mi);
    _mm256_storeu_ps(v, vi);
    _mm256_storeu_ps(p, pi);
    return pi;
}
#endif

/* Model copies at least this large bypass the cache on the way out (they are
 * not read again until the next forward pass). */
#define STREAM_MIN_BYTES (1 << 20)

/* Elements [lo, hi) of one parameter. */
static void adamw_range(float *p, const float *g, float *m, float *v, int64_t lo, int64_t hi, const adamw_scalars *k,
                        void *model, ht_dtype dtype) {
    int64_t i = lo;
#ifdef __AVX512F__
    if (!model) {
        for (; i + 16 <= hi; i += 16) adamw_vec16(p + i, g + i, m + i, v + i, k);
    } else if (dtype == HT_DTYPE_BF16 || dtype == HT_DTYPE_F16) {
        uint16_t *out = model;
        bool stream = (hi - lo) * 2 >= STREAM_MIN_BYTES;
        /* Scalar head up to a 32-byte boundary of the model copy, for the streaming stores. */
        if (stream)
            for (; i < hi && ((uintptr_t)(out + i) & 31) != 0; i++)
                store_model(model, dtype, i, adamw_element(&p[i], g[i], &m[i], &v[i], k));
        for (; i + 16 <= hi; i += 16) {
            __m512 x = adamw_vec16(p + i, g + i, m + i, v + i, k);
            __m256i h = dtype == HT_DTYPE_BF16 ? bf16_round16(x)
                                               : _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            if (stream)
                _mm256_stream_si256((__m256i *)(out + i), h);
            else
                _mm256_storeu_si256((__m256i *)(out + i), h);
        }
        if (stream) _mm_sfence();
    }
#elif defined(ADAMW_AVX2)
    if (!model) {
        for (; i + 8 <= hi; i += 8) adamw_vec8(p + i, g + i, m + i, v + i, k);
    } else if (dtype == HT_DTYPE_BF16 || dtype == HT_DTYPE_F16) {
        uint16_t *out = model;
        bool stream = (hi - lo) * 2 >= STREAM_MIN_BYTES;
        /* Scalar head up to a 16-byte boundary of the model copy, for the streaming stores. */
        if (stream)
            for (; i < hi && ((uintptr_t)(out + i) & 15) != 0; i++)
                store_model(model, dtype, i, adamw_element(&p[i], g[i], &m[i], &v[i], k));
        for (; i + 8 <= hi; i += 8) {
            __m256 x = adamw_vec8(p + i, g + i, m + i, v + i, k);
            __m128i h = dtype == HT_DTYPE_BF16 ? bf16_round8(x)
                                               : _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            if (stream)
                _mm_stream_si128((__m128i *)(out + i), h);
            else
                _mm_storeu_si128((__m128i *)(out + i), h);
        }
        if (stream) _mm_sfence();
    }
#endif
    for (; i < hi; i++) {
        float x = adamw_element(&p[i], g[i], &m[i], &v[i], k);
        if (model) store_model(model, dtype, i, x);
    }
}

/* A param without an FP32 main param goes through FP32 scratch in blocks
 * of this many elements (4 KiB a thread, on its stack). */
#define MODEL_BLOCK 1024

/* Elements [lo, hi) of one parameter, rounded into the model copy
 * stochastically or (fused into the update) to nearest. p NULL: the model copy
 * holds the values: each block is widened (exactly), updated as p would be
 * and rounded back. */
static void adamw_block(float *p, const float *g, float *m, float *v, int64_t lo, int64_t hi, const adamw_scalars *k,
                        void *model, ht_dtype dtype, bool stochastic, uint64_t stream) {
    uint16_t *out = model;
    if (p && (!model || !stochastic)) {
        adamw_range(p, g, m, v, lo, hi, k, model, dtype);
    } else if (p) {
        adamw_range(p, g, m, v, lo, hi, k, NULL, dtype);
        ht_convert_stochastic_at(out + lo, dtype, p + lo, (size_t)(hi - lo), stream, (size_t)lo);
    } else {
        _Alignas(64) float x[MODEL_BLOCK];
        for (int64_t b = lo; b < hi; b += MODEL_BLOCK) {
            int64_t n = hi - b < MODEL_BLOCK ? hi - b : MODEL_BLOCK;
            ht_convert(x, HT_DTYPE_F32, out + b, dtype, (size_t)n);
            if (stochastic) {
                adamw_range(x, g + b, m + b, v + b, 0, n, k, NULL, dtype);
                ht_convert_stochastic_at(out + b, dtype, x, (size_t)n, stream, (size_t)b);
            } else {
                adamw_range(x, g + b, m + b, v + b, 0, n, k, out + b, dtype);
            }
        }
    }
}

void ht_adamw_pass(float *p, const float *g, float *m, float *v, int64_t n, const ht_adamw_hparams *h, void *model,
                   ht_dtype model_dtype, bool stochastic, uint64_t stream) {
    const adamw_scalars k = {
        .decay = (float)(1.0 - h->lr * h->weight_decay),
        .w1 = (float)(1.0 - h->beta1),
        .b2 = (float)h->beta2,
        .c2 = (float)(1.0 - h->beta2),
        .bc2_sqrt = (float)sqrt(1.0 - pow(h->beta2, (double)h->step)),
        .eps = (float)h->eps,
        .neg_step = (float)(-(h->lr / (1.0 - pow(h->beta1, (double)h->step)))),
    };
    if (model_dtype != HT_DTYPE_BF16 && model_dtype != HT_DTYPE_F16) model = NULL;
    /* p NULL with no bf16/f16 copy: nothing holds the values (ht_adamw_init refuses such a param). */
    if (!p && !model) return;
        /* Static split in 64-element blocks: every thread's range starts on a
         * cache line of p, g, m, v (and of a bf16/f16 copy) when the base does. */
#pragma omp parallel if (n >= 65536)
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int64_t chunk = ((n + nt - 1) / nt + 63) & ~(int64_t)63;
        int64_t lo = chunk * t < n ? chunk * t : n;
        int64_t hi = lo + chunk < n ? lo + chunk : n;
        adamw_block(p, g, m, v, lo, hi, &k, model, model_dtype, stochastic, stream);
    }
}
