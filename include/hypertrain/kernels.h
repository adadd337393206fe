/* The math layer: the table of kernels the layers above call (every product,
 * elementwise pass and reduction of the model and the optimizers, and the
 * memory they work in), its backends (the CPU's, CUDA's) and the wrapping
 * tables, and the products' policy for 16-bit dtypes. */
#ifndef HYPERTRAIN_KERNELS_H
#define HYPERTRAIN_KERNELS_H

#include "hypertrain/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- the products' kernels */

/* How products of a 16-bit float dtype run. All three give the same
 * FP32-accumulated sums (products of 16-bit values are exact in FP32); they
 * differ in speed, which depends on the CPU, and in summation order. */
typedef enum ht_gemm_kernel {
    HT_GEMM_KERNEL_AUTO = 0,     /* the fastest of the three on this machine, measured */
    HT_GEMM_KERNEL_NATIVE,       /* oneDNN matmul on the 16-bit operands (AMX, AVX512-BF16, AVX512-FP16) */
    HT_GEMM_KERNEL_WIDENED,      /* 16-bit operands widened to FP32 tile by tile, then the FP32 matmul */
    HT_GEMM_KERNEL_FP32_ROUNDED, /* operands kept as FP32 values of that precision: the FP32 matmul */
    HT_GEMM_KERNEL_COUNT
} ht_gemm_kernel;

/* The kernels for bf16 and f16, and what they were chosen from. */
typedef struct ht_gemm_choice {
    ht_gemm_kernel bf16, f16; /* never AUTO */
    int64_t M, N, K;          /* the product timed: C (M, N) = A (M, K) · Bᵀ */
    double f32_rate;          /* GFLOP/s of the FP32 matmul; 0: nothing was timed */
    /* GFLOP/s of each kernel, indexed by ht_gemm_kernel; 0 where not timed
     * (a pinned kernel) or not offered (native without the ISA). */
    double bf16_rate[HT_GEMM_KERNEL_COUNT], f16_rate[HT_GEMM_KERNEL_COUNT];
    double seconds; /* what choosing cost */
} ht_gemm_choice;

const char *ht_gemm_kernel_label(ht_gemm_kernel kernel); /* "auto", "native", "widened", "fp32_rounded" */
bool ht_gemm_kernel_from_label(const char *label, ht_gemm_kernel *out);

/* The products' policy (kernels.bf16_gemm, kernels.f16_gemm): how products
 * of a 16-bit dtype run, and so which dtype the model keeps its matmul
 * operands in. The layers above ask these, never the CPU's GEMM itself
 * (kernels/cpu/gemm.h); today the CPU's policy holds for every backend. */

/* Resolves the requested kernels: a pinned one is checked to exist here
 * (native where oneDNN offers none is an error naming the CPU's ISA); AUTO
 * times every kernel on one (M, N, K) product, typically a linear layer's,
 * and takes the fastest (ht_gemm_choose). Does not apply the choice. */
ht_status ht_kernels_choose_gemm(ht_gemm_kernel bf16, ht_gemm_kernel f16, int64_t M, int64_t N, int64_t K,
                                 ht_gemm_choice *out, ht_error *err);
/* Makes `choice` the process's. Call it before products run on other threads. */
void ht_kernels_use_gemm(const ht_gemm_choice *choice);
/* One line for the run log: each kernel chosen and what it was chosen from. */
void ht_kernels_describe_gemm(const ht_gemm_choice *choice, char *buf, size_t n);
/* The kernel products of `dtype` run on now (NATIVE for F32), and a sentence naming it (for logs). */
ht_gemm_kernel ht_kernels_gemm_kernel(ht_dtype dtype);
const char *ht_kernels_gemm_name(ht_dtype dtype);
/* GFLOP/s of the kernel products of `dtype` run on now, on C (M, N) = A (M, K) · Bᵀ: the MFU's yardstick. */
double ht_kernels_gemm_rate(ht_dtype dtype, int64_t M, int64_t N, int64_t K);
/* The dtype the model keeps matmul operands of `precision` in: the precision itself (native,
 * widened), or F32 holding values of that precision (fp32_rounded). */
ht_dtype ht_kernels_storage(ht_dtype precision);

/* ---------------------------------------------------------------- the table */

/* AdamW's hyper-parameters for one param's step t (docs/NUMERICS.md, AdamW). */
typedef struct ht_adamw_hparams {
    int64_t step; /* t, from 1 */
    double lr, beta1, beta2, eps, weight_decay;
} ht_adamw_hparams;

/* One row of logits' softmax as the cross-entropy's forward leaves it for
 * its backward: the largest logit and Σ e^(x - max), so that backward reads
 * the row once. */
typedef struct ht_softmax_row {
    double sum;
    float max;
} ht_softmax_row;

/* Where the rotary dimensions of each head lie in a tensor of token rows:
 * row r starts at r x ld floats, head h of it h x head_stride after that,
 * and its D rotary dimensions (pairs: rotate-half (i, i + D/2), or
 * interleaved (2i, 2i + 1)) `offset` after that. A plain (B, T, heads, D)
 * tensor is {heads x D, D, 0, heads, D, false}. */
typedef struct ht_rope_layout {
    int64_t ld, head_stride, offset, heads, D;
    bool interleave;
} ht_rope_layout;

/* One attention call: q (B, T, H, Dk), k (B, Tk, KV, Dk), v (B, Tk, KV, Dv),
 * out (B, T, H, Dv); the logits are scale x q·k (1/sqrt(Dk) for plain
 * attention). The queries sit at positions q0 .. q0 + T - 1 of the sequence
 * and the keys at k0 .. k0 + Tk - 1; key j is seen by query i when
 * k0 + j <= q0 + i (causal). Zero Tk, q0, k0: the keys are the queries'
 * own positions, Tk = T. A block of keys at other positions gives a partial
 * result (a query that sees none of them: out 0, lse -inf) that
 * attention_merge folds into another. */
typedef struct ht_attention_shape {
    int64_t B, T, H, KV, Dk, Dv;
    float scale;
    int64_t Tk, q0, k0;
} ht_attention_shape;

/* How the ns_iterate entry computes the iteration (docs/NUMERICS.md,
 * Muon): STANDARD, the products as written, X kept in FP32 between them (a
 * 16-bit ns_dtype with one residual product); GRAM, on the min(A,B)² Gram
 * matrix where that takes fewer multiply-adds (FP32 ns_dtype); TORCH (16-bit
 * ns_dtype), torch.optim.Muon's iteration: X, S and T held in ns_dtype, each
 * product and its scaled sum rounded to it once, as its addmm calls round. */
typedef enum ht_ns_form { HT_NS_FORM_STANDARD = 0, HT_NS_FORM_GRAM, HT_NS_FORM_TORCH } ht_ns_form;

/* Muon's elementwise arithmetic (docs/NUMERICS.md, Muon: Momentum, Update
 * scale and step). PLAIN: B <- mu B + gw g, u = gw g + mu B, p <- p decay -
 * step O. TORCH, torch.optim.Muon's ops as torch's kernels round them:
 * B.lerp_(g, gw) and u = g.lerp(B, mu), one FMA each; p <- p decay, then
 * p + (-step) O in one FMA (add_ with alpha). */
typedef enum ht_muon_arith { HT_MUON_ARITH_PLAIN = 0, HT_MUON_ARITH_TORCH } ht_muon_arith;

/* Every compute kernel the layers above call (docs/DESIGN.md, "Seams for later
 * backends"): the model's forward and backward and the optimizers' passes
 * run through this table and nothing else, so a backend (a GPU's) provides
 * the same entries and is tested op by op against the CPU's
 * (tests/test_kernels.c).
 *
 * Each entry is written once, in this list: the table's members below, the
 * CPU's functions (ht_NAME, kernels/cpu/ops.h), the CUDA backend's
 * (cuda_NAME, kernels/cuda/cuda.cuh), the tables' initialisers and the
 * wrapping tables' entries (kernels/fenced.c, kernels/profiled.c) are made
 * from it. A row is X(kind, type, name, (params), (args), (arrays)):
 *   kind    OWN, the table's own (memory, the wait): each table writes it;
 *           SIZE, a workspace's size, answered on the host; GEMM, a product;
 *           RUN, a kernel that returns nothing (a backend may queue it);
 *           GET, one that returns a number (host memory), waited for
 *   type    what the entry returns
 *   params  its parameters; args the same names, passing them on
 *   arrays  the arguments that must be the backend's memory, each M(name);
 *           (NULL is allowed: an output not asked for)
 * Shapes are row-major; a tensor is FP32 unless a dtype says otherwise. */
/* clang-format off */
#define HT_KERNEL_ENTRIES(X)                                                                                           \
    /* ---- memory: what the kernels read and write apart from the parameters (activations, the rotary tables,         \
     * optimizer state, workspaces), zeroed and 64-byte aligned: the CPU's ht_alloc / ht_free, the CUDA                \
     * backend's the device's (cudaMalloc). Every array an entry of this table takes is memory of this                 \
     * backend; scalars, the hyper-parameter structs, Newton-Schulz's coefficients and the cross-entropy's             \
     * row count are host values. */                                                                                   \
    X(OWN, void *, alloc, (size_t bytes), (bytes), ())                                                                 \
    X(OWN, void, free, (void *p), (p), ())                                                                             \
    /* whether p lies in memory of this backend that the host cannot reach (what a collective must stage               \
     * through host memory); the CPU's answers false for every pointer: its memory is the host's */                    \
    X(OWN, bool, owns, (const void *p), (p), ())                                                                       \
    /* the most bytes of this backend's memory held at once since the process started (alloc's blocks and              \
     * its kernels' own scratch); the CPU's answers 0: its memory is the process's, which the peak RSS tells */        \
    X(OWN, size_t, peak_bytes, (void), (), ())                                                                         \
    /* Moving bytes, ggml's buffer interface (memset_tensor, set_tensor, get_tensor, cpy_tensor): zero                 \
     * `bytes` of the backend's memory; upload from host memory into it, download from it into host memory;            \
     * copy within it (dst and src apart). On the CPU these are memset and memcpy. A backend that queues its           \
     * work (CUDA: one stream) runs them in order with the kernels; download returns once the host holds the           \
     * bytes, upload once the host buffer may be reused. */                                                            \
    X(RUN, void, zero, (void *dst, size_t bytes), (dst, bytes), (M(dst);))                                             \
    X(RUN, void, upload, (void *dst, const void *host_src, size_t bytes), (dst, host_src, bytes), (M(dst);))           \
    X(RUN, void, download, (void *host_dst, const void *src, size_t bytes), (host_dst, src, bytes), (M(src);))         \
    X(RUN, void, copy, (void *dst, const void *src, size_t bytes), (dst, src, bytes), (M(dst); M(src);))               \
    /* Waits for every entry called so far and returns HT_OK, or the first failure since the process started           \
     * (a product or a kernel that could not run; the entries themselves return nothing, as ht_gemm). The              \
     * CPU's runs synchronously: its failure is ht_gemm_status's. */                                                   \
    X(OWN, ht_status, synchronize, (ht_error *err), (err), ())                                                         \
    /* ---- products: C (M, N) FP32 = alpha op(A) op(B) + beta C, A and B in dtype, as kernels/cpu/gemm.h's ht_gemm says;           \
     * gemm_ragged: M (K when trans_a) changes from call to call; gemm_batched: `batch` products of one                \
     * shape, A, B and C stepping by stride_a, stride_b, stride_c elements */                                          \
    X(GEMM, void, gemm, (bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,      \
                         int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc),  \
      (trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, dtype, beta, C, ldc), (M(A); M(B); M(C);))                    \
    X(GEMM, void, gemm_ragged, (bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,              \
                                const void *A, int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta,    \
                                float *C, int64_t ldc),                                                                \
      (trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, dtype, beta, C, ldc), (M(A); M(B); M(C);))                    \
    X(GEMM, void, gemm_batched, (int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,           \
                                 float alpha, const void *A, int64_t lda, int64_t stride_a, const void *B,             \
                                 int64_t ldb, int64_t stride_b, ht_dtype dtype, float beta, float *C, int64_t ldc,     \
                                 int64_t stride_c),                                                                    \
      (batch, trans_a, trans_b, M, N, K, alpha, A, lda, stride_a, B, ldb, stride_b, dtype, beta, C, ldc, stride_c),    \
      (M(A); M(B); M(C);))                                                                                             \
    /* ---- dtypes: base.h's ht_convert (n elements between float dtypes) and ht_round_to (x rounded in place to       \
     * the nearest value of precision) */                                                                              \
    X(RUN, void, convert, (void *dst, ht_dtype dst_dtype, const void *src, ht_dtype src_dtype, size_t n),              \
      (dst, dst_dtype, src, src_dtype, n), (M(dst); M(src);))                                                          \
    X(RUN, void, round_to, (float *x, size_t n, ht_dtype precision), (x, n, precision), (M(x);))                       \
    /* ---- the decoder's; N rows (tokens) of C, FP32 unless a dtype says otherwise.                                   \
     * out (N, C) in odtype (the matmul input dtype) = x * rsqrt(mean(x^2) + eps) * weight (C, in wdtype),             \
     * per row; rstd (N) kept for backward */                                                                          \
    X(RUN, void, rmsnorm_forward, (void *out, ht_dtype odtype, float *rstd, const float *x, const void *weight,        \
                                   ht_dtype wdtype, int64_t N, int64_t C, float eps),                                  \
      (out, odtype, rstd, x, weight, wdtype, N, C, eps), (M(out); M(rstd); M(x); M(weight);))                          \
    /* dx += d/dx, dweight += d/dweight (FP32; NULL: a frozen weight, not computed), given dout (N, C) */              \
    X(RUN, void, rmsnorm_backward, (float *dx, float *dweight, const float *dout, const float *x, const void *weight,  \
                                    ht_dtype wdtype, const float *rstd, int64_t N, int64_t C),                         \
      (dx, dweight, dout, x, weight, wdtype, rstd, N, C), (M(dx); M(dweight); M(dout); M(x); M(weight); M(rstd);))     \
    /* y (N, C) += bias (C) in bdtype; dbias (C) += the column sums of dy (N, C) */                                    \
    X(RUN, void, add_bias, (float *y, const void *bias, ht_dtype bdtype, int64_t N, int64_t C),                        \
      (y, bias, bdtype, N, C), (M(y); M(bias);))                                                                       \
    X(RUN, void, bias_backward, (float *dbias, const float *dy, int64_t N, int64_t C), (dbias, dy, N, C),              \
      (M(dbias); M(dy);))                                                                                              \
    /* Rotary embedding in place on the rotary part of each head of x ((B, T) token rows laid out as `layout`          \
     * says) with cos/sin tables (T, layout->D/2); backward applies the inverse rotation to dx */                      \
    X(RUN, void, rope_forward, (float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T,                \
                                const ht_rope_layout *layout),                                                         \
      (x, cos_t, sin_t, B, T, layout), (M(x); M(cos_t); M(sin_t);))                                                    \
    X(RUN, void, rope_backward, (float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T,              \
                                 const ht_rope_layout *layout),                                                        \
      (dx, cos_t, sin_t, B, T, layout), (M(dx); M(cos_t); M(sin_t);))                                                  \
    /* h (n) = silu(gate) * up, written in hdtype; backward: dgate, dup from dh */                                     \
    X(RUN, void, swiglu_forward, (void *h, ht_dtype hdtype, const float *gate, const float *up, int64_t n),            \
      (h, hdtype, gate, up, n), (M(h); M(gate); M(up);))                                                               \
    X(RUN, void, swiglu_backward, (float *dgate, float *dup, const float *dh, const float *gate, const float *up,      \
                                   int64_t n),                                                                         \
      (dgate, dup, dh, gate, up, n), (M(dgate); M(dup); M(dh); M(gate); M(up);))                                       \
    /* The mean cross-entropy over the rows whose target is >= 0 (double accumulation) of logits (N, V), read          \
     * once; *count (host) gets the number of counted rows, rows (N, or NULL) each counted row's softmax               \
     * statistics */                                                                                                   \
    X(GET, double, cross_entropy_forward, (const float *logits, const int32_t *targets, int64_t N, int64_t V,          \
                                           int64_t *count, ht_softmax_row *rows),                                      \
      (logits, targets, N, V, count, rows), (M(logits); M(targets); M(rows);))                                         \
    /* In place: logits (N, V) becomes dlogits = scale * (softmax - onehot), rows with target < 0 become 0.            \
     * The columns are the vocabulary's [v0, v0 + V) (tensor parallelism's slice; v0 0 and the whole                   \
     * vocabulary otherwise): a target outside them has its one-hot on another rank. rows: the statistics of           \
     * the whole row (the forward's: each row then read and written once), or NULL to find them again */               \
    X(RUN, void, cross_entropy_backward, (float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0,     \
                                          float scale, const ht_softmax_row *rows),                                    \
      (logits, targets, N, V, v0, scale, rows), (M(logits); M(targets); M(rows);))                                     \
    /* The vocabulary-parallel cross-entropy's local part over logits (N, V), the vocabulary's columns                 \
     * [v0, v0 + V): each row's softmax statistics of these columns (rows[n]; {0, -inf} for a target < 0)              \
     * and the logit of its target where this slice holds it (picked[n], else 0) */                                    \
    X(RUN, void, softmax_partial, (const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0,      \
                                   ht_softmax_row *rows, float *picked),                                               \
      (logits, targets, N, V, v0, rows, picked), (M(logits); M(targets); M(rows); M(picked);))                         \
    /* ---- attention: causal self-attention, tiled, of the shape `a` says (ht_attention_shape): out (B, T, H, Dv)     \
     * = softmax(scale q kᵀ, causal) v over q (B, T, H, Dk), k (B, Tk, KV, Dk) and v (B, Tk, KV, Dv) (H a              \
     * multiple of KV: grouped-query heads share a key head), keeping only lse (B, H, T), each row's                   \
     * log-sum-exp, for backward: no (T, T) tensor is stored. head_max (B, H), when not NULL, gets each                \
     * head's largest logit over every position, masked ones included (QK-clip's S_h). The products take               \
     * their operands in `dtype` (q, k, v, dout and the probability tiles rounded to it; float32: as they              \
     * are) and accumulate in FP32; the softmax, out, lse and every gradient are FP32. work: the threads'              \
     * scratch, omp_get_max_threads() x attention_workspace_floats(T, Dk, Dv), T the longer of the query               \
     * and key blocks. */                                                                                              \
    X(SIZE, size_t, attention_workspace_floats, (int64_t T, int64_t Dk, int64_t Dv), (T, Dk, Dv), ())                  \
    X(RUN, void, attention_forward, (float *out, float *lse, float *head_max, const float *q, const float *k,          \
                                     const float *v, const ht_attention_shape *a, ht_dtype dtype, float *work),        \
      (out, lse, head_max, q, k, v, a, dtype, work), (M(out); M(lse); M(head_max); M(q); M(k); M(v); M(work);))        \
    /* dq, dk, dv (the shapes of q, k, v) = the gradients (overwritten) given dout and the forward's out and           \
     * lse, recomputing the probabilities tile by tile. For a block of keys (a->Tk, q0, k0) pass the whole             \
     * attention's out and lse (merged over every block): dk, dv are the block's keys' gradients, dq the               \
     * block's share of the queries' (sum the blocks' shares). */                                                      \
    X(RUN, void, attention_backward, (float *dq, float *dk, float *dv, const float *dout, const float *out,            \
                                      const float *lse, const float *q, const float *k, const float *v,                \
                                      const ht_attention_shape *a, ht_dtype dtype, float *work),                       \
      (dq, dk, dv, dout, out, lse, q, k, v, a, dtype, work),                                                           \
      (M(dq); M(dk); M(dv); M(dout); M(out); M(lse); M(q); M(k); M(v); M(work);))                                      \
    /* Folds a second block's partial result (out2 (B, T, H, Dv), lse2 (B, H, T)) into the first, in place:            \
     * out = (e^lse out + e^lse2 out2) / (e^lse + e^lse2), lse = log(e^lse + e^lse2), taken against the                \
     * larger of the two (a row that saw no key in either stays out 0, lse -inf) */                                    \
    X(RUN, void, attention_merge, (float *out, float *lse, const float *out2, const float *lse2, int64_t B, int64_t T, \
                                   int64_t H, int64_t Dv),                                                             \
      (out, lse, out2, lse2, B, T, H, Dv), (M(out); M(lse); M(out2); M(lse2);))                                        \
    /* ---- the embedding: x (N, C) FP32 = rows ids[n] of table in dtype, which holds the vocabulary's rows            \
     * [v0, v0 + V) (all of it: v0 0; tensor parallelism's slice otherwise): a token outside them gets a row           \
     * of zeros (its row is another rank's). Backward: dtable rows ids[n] - v0 += dx (N, C) for the tokens of          \
     * [v0, v0 + V), every row in token order (the same sums whatever the thread count). */                            \
    X(RUN, void, embedding_forward, (float *x, const void *table, ht_dtype dtype, const int32_t *ids, int64_t N,       \
                                     int64_t C, int64_t v0, int64_t V),                                                \
      (x, table, dtype, ids, N, C, v0, V), (M(x); M(table); M(ids);))                                                  \
    X(RUN, void, embedding_backward, (float *dtable, const float *dx, const int32_t *ids, int64_t N, int64_t C,        \
                                      int64_t v0, int64_t V),                                                          \
      (dtable, dx, ids, N, C, v0, V), (M(dtable); M(dx); M(ids);))                                                     \
    /* ---- moving rows by an index, rows of row_bytes: gather dst row r = src row idx[r]; scatter dst row idx[r]      \
     * = src row r (r < rows) */                                                                                       \
    X(RUN, void, gather_rows, (void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes),        \
      (dst, src, idx, rows, row_bytes), (M(dst); M(src); M(idx);))                                                     \
    X(RUN, void, scatter_rows, (void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes),       \
      (dst, src, idx, rows, row_bytes), (M(dst); M(src); M(idx);))                                                     \
    /* ---- Qwen2-MoE's sparse block. probs (N, E) in place from the router's logits (softmax as torch computes        \
     * it, exp(x - max) / sum), then each row's k largest (ties to the lower expert, in decreasing order):             \
     * sel (N, k) and weight (N, k) their probabilities, divided by their sum psum (N) when norm */                    \
    X(RUN, void, moe_route, (float *probs, int32_t *sel, float *weight, float *psum, int64_t N, int E, int k,          \
                             bool norm),                                                                               \
      (probs, sel, weight, psum, N, E, k, norm), (M(probs); M(sel); M(weight); M(psum);))                              \
    /* y (N, C) = the sum of weight[n, j] ye[pos[n, j]], added in increasing expert order (sel), plus                  \
     * sigmoid(z[n]) so[n]; z NULL: plus so[n] (ungated); so NULL: no shared expert */                                 \
    X(RUN, void, moe_combine, (float *y, const float *ye, const int32_t *pos, const int32_t *sel, const float *weight, \
                               const float *z, const float *so, int64_t N, int k, int64_t C),                          \
      (y, ye, pos, sel, weight, z, so, N, k, C), (M(y); M(ye); M(pos); M(sel); M(weight); M(z); M(so);))               \
    /* Its backward given dy (N, C): dso = sigmoid(z) dy (z NULL: dy), dz = the gate logit's gradient (z               \
     * NULL: untouched), dw[n, j] = dy · ye[pos], dye[pos] = weight dy; so NULL: neither dso nor dz */                 \
    X(RUN, void, moe_combine_backward, (float *dso, float *dz, float *dw, float *dye, const float *dy,                 \
                                        const float *ye, const float *so, const float *z, const int32_t *pos,          \
                                        const float *weight, int64_t N, int k, int64_t C),                             \
      (dso, dz, dw, dye, dy, ye, so, z, pos, weight, N, k, C),                                                         \
      (M(dso); M(dz); M(dw); M(dye); M(dy); M(ye); M(so); M(z); M(pos); M(weight);))                                   \
    /* dp (N, E): the router logits' gradient from the chosen probabilities' (dw, through the normalisation            \
     * when norm) and aux_grad (E, or NULL) on every probability, through the softmax */                               \
    X(RUN, void, moe_route_backward, (float *dp, const float *probs, const int32_t *sel, const float *weight,          \
                                      const float *dw, const float *psum, const float *aux_grad, int64_t N, int E,     \
                                      int k, bool norm),                                                               \
      (dp, probs, sel, weight, dw, psum, aux_grad, N, E, k, norm),                                                     \
      (M(dp); M(probs); M(sel); M(weight); M(dw); M(psum); M(aux_grad);))                                              \
    /* dx[n] += dxs[pos[n, j]] for every choice j */                                                                   \
    X(RUN, void, moe_scatter_add, (float *dx, const float *dxs, const int32_t *pos, int64_t N, int k, int64_t C),      \
      (dx, dxs, pos, N, k, C), (M(dx); M(dxs); M(pos);))                                                               \
    /* ---- DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): scores (N, E) in place from the logits,         \
     * sigmoid; the choice on scores + bias (E; NULL: none): each of n_group groups of E / n_group                     \
     * consecutive experts scored by the sum of its two largest biased scores, the topk_group best groups              \
     * kept (ties to the lower group), the k largest biased scores of their experts (ties to the lower                 \
     * expert, in decreasing order): sel (N, k); weight (N, k) the chosen experts' unbiased scores, divided            \
     * by psum (N) = their sum + 1e-20 when norm (psum: their sum otherwise), times scaling */                         \
    X(RUN, void, moe_route_grouped, (float *scores, int32_t *sel, float *weight, float *psum, const float *bias,       \
                                     int64_t N, int E, int k, int n_group, int topk_group, bool norm, float scaling),  \
      (scores, sel, weight, psum, bias, N, E, k, n_group, topk_group, norm, scaling),                                  \
      (M(scores); M(sel); M(weight); M(psum); M(bias);))                                                               \
    /* dz (N, E): the router logits' gradient from the chosen weights' dw, through the scaling, the                    \
     * normalisation when norm and the sigmoid; 0 for the experts not chosen */                                        \
    X(RUN, void, moe_route_grouped_backward, (float *dz, const float *scores, const int32_t *sel,                      \
                                              const float *weight, const float *dw, const float *psum, int64_t N,      \
                                              int E, int k, bool norm, float scaling),                                 \
      (dz, scores, sel, weight, dw, psum, N, E, k, norm, scaling),                                                     \
      (M(dz); M(scores); M(sel); M(weight); M(dw); M(psum);))                                                          \
    /* ---- LoRA's dropout: inverted dropout (torch.nn.Dropout's scaling 1 / (1 - p)) on x (N, cols) FP32 in           \
     * place: element (n, c) is dropped when a 24-bit uniform drawn from (seed, site, token0 + n, c) by a              \
     * counter-based hash falls below p */                                                                             \
    X(RUN, void, dropout, (float *x, int64_t N, int64_t cols, float p, uint64_t seed, uint64_t site, int64_t token0),  \
      (x, N, cols, p, seed, site, token0), (M(x);))                                                                    \
    /* ---- elementwise and reductions. Σ x² in double, with each thread's share summed in thread order: the           \
     * same bits on every run with the same thread count (an OpenMP reduction combines in arrival order,               \
     * which breaks bitwise resume past two threads) */                                                                \
    X(GET, double, sum_squares, (const float *x, int64_t n), (x, n), (M(x);))                                          \
    /* sums[i] (host memory) = sum_squares(x[i], n[i]) for i < count (x and n host arrays), bit for bit, in            \
     * one wait for the device */                                                                                      \
    X(RUN, void, sum_squares_each, (double *sums, const float *const *x, const int64_t *n, int count),                 \
      (sums, x, n, count), (for (int i_ = 0; i_ < count; i_++) M(x[i_]);))                                             \
    /* y = x + a; y += x (n elements) */                                                                               \
    X(RUN, void, add, (float *y, const float *x, const float *a, int64_t n), (y, x, a, n), (M(y); M(x); M(a);))        \
    X(RUN, void, accumulate, (float *y, const float *x, int64_t n), (y, x, n), (M(y); M(x);))                          \
    /* dst[r·dst_ld + c] = src[r·src_ld + c] (accumulate: +=) for r < rows, c < cols: a column block of one            \
     * row-major tensor into another's (dst and src apart) */                                                          \
    X(RUN, void, copy_rows, (float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows,               \
                             int64_t cols, bool accumulate),                                                           \
      (dst, dst_ld, src, src_ld, rows, cols, accumulate), (M(dst); M(src);))                                           \
    /* x *= k (n elements) */                                                                                          \
    X(RUN, void, scale, (float *x, int64_t n, float k), (x, n, k), (M(x);))                                            \
    /* ---- the optimizers' passes. One AdamW step over n elements (docs/NUMERICS.md, AdamW, in torch's op             \
     * order): p, m, v updated in place from g; model (bf16/f16, or NULL) gets the new p rounded to nearest            \
     * or, `stochastic`, from stream (element i draws number i). p NULL: the model copy holds the values               \
     * (widened exactly, updated, rounded back). */                                                                    \
    X(RUN, void, adamw_pass, (float *p, const float *g, float *m, float *v, int64_t n, const ht_adamw_hparams *h,      \
                              void *model, ht_dtype model_dtype, bool stochastic, uint64_t stream),                    \
      (p, g, m, v, n, h, model, model_dtype, stochastic, stream), (M(p); M(g); M(m); M(v); M(model);))                 \
    /* B <- mu B + gw g; with nesterov u = gw g + mu B (else u is not written); arith TORCH: torch's lerps,            \
     * B.lerp_(g, gw) and u = g.lerp(B, mu) */                                                                         \
    X(RUN, void, muon_momentum, (float *B, const float *g, float *u, int64_t n, float mu, float gw, bool nesterov,     \
                                 ht_muon_arith arith),                                                                 \
      (B, g, u, n, mu, gw, nesterov, arith), (M(B); M(g); M(u);))                                                      \
    /* p <- p decay - step O (arith TORCH: p decay, then one FMA) for n elements, elements [first, first + n)          \
     * of the param's local rows, and the model copy from the new p in the same pass when model != NULL,               \
     * rounded to nearest or stochastically (stream). p NULL: the model copy holds the values, widened                 \
     * (exactly) into O, which takes the new values before they are rounded back; O is scratch either way. */          \
    X(RUN, void, muon_apply, (float *p, float *O, int64_t n, float decay, float step, ht_muon_arith arith,             \
                              void *model, ht_dtype dtype, bool stochastic, uint64_t stream, int64_t first),           \
      (p, O, n, decay, step, arith, model, dtype, stochastic, stream, first), (M(p); M(O); M(model);))                 \
    /* Newton-Schulz (docs/NUMERICS.md, Muon): O = NS(G) for `count` (rows, cols) FP32 matrices, one after             \
     * the other in G and O, each normalized by its Frobenius norm (in double) + eps, then `steps`                     \
     * iterations of coeffs[k] = (a, b, c) (host), the products in ns_dtype with FP32 accumulation, batched            \
     * over the matrices, in the form `form` says (ht_ns_form). O may be G; work holds                                 \
     * ns_workspace_floats() floats (count times one matrix's). */                                                     \
    X(SIZE, size_t, ns_workspace_floats, (int64_t count, int64_t rows, int64_t cols, ht_dtype ns_dtype,                \
                                          ht_ns_form form),                                                            \
      (count, rows, cols, ns_dtype, form), ())                                                                         \
    X(RUN, void, ns_iterate, (const float *G, float *O, int64_t count, int64_t rows, int64_t cols,                     \
                              const double (*coeffs)[3], int steps, double eps, ht_dtype ns_dtype, ht_ns_form form,    \
                              float *work),                                                                            \
      (G, O, count, rows, cols, coeffs, steps, eps, ns_dtype, form, work), (M(G); M(O); M(work);))
/* clang-format on */

typedef struct ht_kernel_ops {
    const char *name; /* "cpu", "cuda" */
    /* Whether the backend's memory is the host's: the CPU's is, so a caller
     * may read and write it directly; a GPU's is not, and is reached only
     * through the entries below (upload, download). */
    bool host_memory;
    /* kernels.lm_head_chunk_mib's auto: the FP32 logits, in bytes, above
     * which the LM head and the loss run in chunks of tokens. The CPU's
     * 64 MiB (a chunk's logits, written by the head and read by the loss,
     * stay a small part of the run's memory); a GPU's 1 GiB, so that each
     * chunk's products have rows enough for its tensor cores (about 1,700
     * at a vocabulary of 152k, where 64 MiB would give 110). */
    size_t lm_head_chunk_bytes;
#define HT_CPU_LM_HEAD_CHUNK_BYTES ((size_t)64 << 20) /* the CPU's (and the fenced table's, for its bits) */
#define HT_KERNEL_MEMBER(kind, type, name, params, args, arrays) type(*name) params;
    HT_KERNEL_ENTRIES(HT_KERNEL_MEMBER)
#undef HT_KERNEL_MEMBER
} ht_kernel_ops;

/* The tables a run may compute on (kernels.backend). */
typedef enum ht_kernel_backend { HT_KERNELS_CPU = 0, HT_KERNELS_FENCED, HT_KERNELS_CUDA } ht_kernel_backend;

/* The kernels in use, the process's one table: the CPU's unless
 * ht_kernels_use chose another. Every layer above reaches its memory and
 * its kernels through it. */
const ht_kernel_ops *ht_kernels(void);
/* Makes `ops` the process's table (NULL: the CPU's again). Call it before
 * anything is allocated through the table, and free all of that before
 * switching again: memory belongs to the backend that allocated it. */
void ht_kernels_use(const ht_kernel_ops *ops);
/* The CPU's table (kernels/cpu/backend.c), whatever is in use. */
const ht_kernel_ops *ht_kernels_cpu(void);
/* The fenced backend (kernels/fenced.c): the CPU's kernels on memory that
 * host code cannot touch outside the table's entries (each allocation its
 * own mapping, PROT_NONE between entries; a stray access faults and names
 * the region). host_memory is false, as a GPU's: the trainer run on it
 * proves, on any machine, that the layers reach their memory only through
 * the entries, and gives the CPU's bits. */
const ht_kernel_ops *ht_kernels_fenced(void);

/* The profiled table (kernels/profiled.c): `base`'s entries, each waited
 * for (base's synchronize) and its time from call to end added to a row:
 * the products by entry, dtype, transposes and M x N x K, the rest by
 * name. Its memory is base's, its name and host_memory base's; one base
 * per process. A profiled run computes the same bits as base, slower (no
 * launch overlaps the device's work): the rows say where the time goes. */
const ht_kernel_ops *ht_kernels_profiled(const ht_kernel_ops *base);
typedef struct ht_kernel_profile_row {
    char entry[80];
    int64_t calls;
    double seconds;
} ht_kernel_profile_row;
/* The rows so far, the longest first, at most max of them; their count. */
int ht_kernels_profile(ht_kernel_profile_row *rows, int max);
void ht_kernels_profile_reset(void);

/* The CUDA backend's table (kernels/cuda/, built with cmake -DHT_CUDA=ON):
 * the same entries on the process's current CUDA device, or NULL with the
 * reason in err when this build has no CUDA backend or no device and
 * driver answer (cudaGetDeviceCount fails or finds none), so that a caller
 * on a machine without a GPU goes on with the CPU's. Its entries are
 * called from one host thread at a time and queue their work on one
 * stream. */
const ht_kernel_ops *ht_kernels_cuda(ht_error *err);
/* The stream the CUDA backend's entries queue their work on from now on (a
 * cudaStream_t; NULL is CUDA's default stream), returning the one it
 * replaces, which the caller gives back when done. For a caller whose
 * tensors live on its own stream (the Python package: torch's current
 * stream), so that the backend's work and its own stay in order without a
 * wait. Call it after ht_kernels_cuda succeeded; NULL, and nothing done,
 * in a build without the CUDA backend. */
void *ht_kernels_cuda_stream(void *stream);
/* The stream the CUDA backend's entries queue their work on now (NULL: the
 * default stream, or no backend): for work of its own that must stay in
 * order with the entries' (comm/nccl.cu's collectives). */
void *ht_kernels_cuda_current_stream(void);
/* The CUDA device the backend's table runs on (-1 without one). */
int ht_kernels_cuda_device(void);
/* At least `bytes` of the CUDA backend's device memory for work queued on
 * its current stream (ht_kernels_cuda_stream) that outlives an entry's call
 * (the Python package's Newton-Schulz workspace): one block per stream,
 * kept and grown as asked, so that a caller asking no more than before
 * allocates nothing. Valid until the next call for the same stream, or
 * ht_kernels_cuda_free_workspaces; NULL when it cannot be had (or in a
 * build without the backend). Called from one host thread at a time, as the
 * entries are. */
void *ht_kernels_cuda_workspace(size_t bytes);
/* Frees the workspaces, after the device is done with them (the Python
 * package calls it when the interpreter ends). */
void ht_kernels_cuda_free_workspaces(void);
/* The times the host has waited for the CUDA backend's stream so far (its
 * synchronize, upload and download, a loss or a sum of squares read back;
 * 0 without the backend): what a step costs in round trips, each a gap in
 * the device's queue. */
int64_t ht_kernels_cuda_waits(void);
/* The device blocks the CUDA backend has allocated so far (alloc, its
 * scratch, the workspaces; 0 without the backend): a test's count that a
 * step allocates nothing. */
int64_t ht_kernels_cuda_allocations(void);

/* How the CUDA backend runs attention with bf16 or f16 operands: its own
 * kernels (kernels/cuda/flash.cu, attention.cu) or cuDNN's fused
 * scaled-dot-product attention (kernels/cuda/cudnn_attention.cu; libcudnn
 * opened at run time), for causal self-attention without QK-clip's maximum
 * (a block of keys at other positions, FP32 and QK-clip stay on the own
 * kernels). A shape cuDNN does not take, or a process where libcudnn does
 * not open, runs the own kernels (logged once). */
typedef enum ht_cuda_attention {
    HT_CUDA_ATTENTION_AUTO = 0,   /* per shape, forward and backward apart: the faster of the two, timed at its
                                     first call and kept for the process (logged) */
    HT_CUDA_ATTENTION_REPEATABLE, /* AUTO's forward; backward always the own kernels, which repeat bit for bit
                                     (cuDNN's adds dQ with atomics) */
    HT_CUDA_ATTENTION_OWN,        /* the own kernels only */
    HT_CUDA_ATTENTION_CUDNN       /* cuDNN wherever it takes the call */
} ht_cuda_attention;
/* Makes `how` the process's policy from the next call on, returning the one
 * it replaces (AUTO at start). Choices already timed are kept. */
ht_cuda_attention ht_kernels_cuda_set_attention(ht_cuda_attention how);
/* Whether cuDNN opened in this process (trying once, at the first call of
 * this or of an attention entry): true with its version in `about`, or
 * false with the reason (no libcudnn.so.9 on the search path, a build
 * without cuDNN's headers, the host emulator). */
bool ht_kernels_cuda_cudnn(char *about, size_t n);
/* The attention calls (forward and backward) cuDNN ran in this process. */
int64_t ht_kernels_cuda_cudnn_calls(void);

/* How the CUDA backend picks a product's cuBLASLt algorithm, once per shape
 * (the plan kept for the process, so a shape meets one algorithm and a step
 * repeats bit for bit within the process). */
typedef enum ht_cuda_gemm {
    HT_CUDA_GEMM_TIMED = 0, /* the fastest of the heuristic's first candidates (up to 4), each timed on the
                               shape's first call (its operands; its output kept apart where beta reads it);
                               the heuristic's first where one candidate is offered, for ragged (expert)
                               products, and where beta is nonzero and C is over 64 MiB */
    HT_CUDA_GEMM_HEURISTIC  /* the heuristic's first: the same algorithm in every process of a machine
                               (training.deterministic) */
} ht_cuda_gemm;
/* Makes `how` the process's policy for the shapes planned from now on,
 * returning the one it replaces (TIMED at start). */
ht_cuda_gemm ht_kernels_cuda_set_gemm(ht_cuda_gemm how);
/* The shapes whose algorithm was chosen by timing, and of them those where a
 * candidate other than the heuristic's first was the fastest (0 without the
 * backend). */
void ht_kernels_cuda_gemm_choices(int64_t *timed, int64_t *not_first);

#ifdef __cplusplus
}
#endif
#endif
