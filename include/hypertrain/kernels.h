/* The math layer: one GEMM entry point over oneDNN, and the elementwise and
 * reduction kernels of the decoder, all OpenMP-parallel; and the table of
 * kernels the layers above call, with its CPU and CUDA backends. */
#ifndef HYPERTRAIN_KERNELS_H
#define HYPERTRAIN_KERNELS_H

#include "hypertrain/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* C = alpha · op(A) · op(B) + beta · C, all row-major.
 *   op(A): (M, K); A is (M, K) with row stride lda, or (K, M) when trans_a.
 *   op(B): (K, N); B is (K, N) with row stride ldb, or (N, K) when trans_b.
 *   C: (M, N) FP32 with row stride ldc. A and B share `dtype`: F32, BF16 or F16
 *   (BF16/F16 multiply with FP32 accumulation). beta = 0 ignores C's old content.
 * Called inside an OpenMP parallel region it runs on the calling thread only.
 * A product that cannot run (oneDNN refuses it, memory runs out, a bad shape)
 * leaves NaN in C and is recorded: check ht_gemm_status after a step. */
void ht_gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
             const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc);

/* ht_gemm for a row count that changes from call to call (the rows one
 * expert receives): the rows are M, or K when trans_a (a sum over rows, as
 * in a weight gradient); one oneDNN primitive, made with that size left to
 * run time, serves every count, where ht_gemm would make one per count. */
void ht_gemm_ragged(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                    int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc);

/* ht_gemm on `batch` products of one shape: product e reads A + e·stride_a
 * and B + e·stride_b (in elements of dtype) and writes C + e·stride_c, the
 * outputs apart (stride_c >= M·ldc). Each product gives the bits it gives
 * alone (the CPU runs them one by one, on one cached primitive: oneDNN's
 * batched matmul orders its sums by the batch on some CPUs). */
void ht_gemm_batched(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                     const void *A, int64_t lda, int64_t stride_a, const void *B, int64_t ldb, int64_t stride_b,
                     ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t stride_c);

/* HT_OK, or the first product that could not run since the process started:
 * every later result is suspect, so a caller stops at the first failure. */
ht_status ht_gemm_status(ht_error *err);

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

/* Resolves the requested kernels: a pinned one is checked to exist here
 * (native where oneDNN offers none is an error naming the CPU's ISA); AUTO
 * times every kernel on one (M, N, K) product, typically a linear layer's,
 * and takes the fastest, where native or widened must beat fp32_rounded by 5%.
 * Costs a few hundred ms at most. Does not apply the choice: ht_gemm_use. */
ht_status ht_gemm_choose(ht_gemm_kernel bf16, ht_gemm_kernel f16, int64_t M, int64_t N, int64_t K, ht_gemm_choice *out,
                         ht_error *err);
/* GFLOP/s of `kernel` running products of `dtype` on C (M, N) = A (M, K) · Bᵀ
 * (F32: the FP32 matmul, whatever the kernel): the fastest of three calls
 * after a first, timed once per process and shape; 0 where the kernel is not
 * offered or the buffers cannot be had. The MFU's yardstick. */
double ht_gemm_rate(ht_dtype dtype, ht_gemm_kernel kernel, int64_t M, int64_t N, int64_t K);
/* Makes `choice` the process's: ht_gemm and ht_gemm_storage follow it. Call it
 * before products run on other threads. Without it, the first 16-bit product
 * chooses on a 1024³ product. */
void ht_gemm_use(const ht_gemm_choice *choice);
/* The kernel products of `dtype` run on now (NATIVE for F32). */
ht_gemm_kernel ht_gemm_kernel_of(ht_dtype dtype);
/* The dtype a caller keeps operands of `precision` in: the precision itself
 * (native, widened), or F32 holding values of that precision (fp32_rounded). */
ht_dtype ht_gemm_storage(ht_dtype precision);

const char *ht_gemm_kernel_label(ht_gemm_kernel kernel); /* "auto", "native", "widened", "fp32_rounded" */
bool ht_gemm_kernel_from_label(const char *label, ht_gemm_kernel *out);
/* One line for the run log: each kernel chosen, the rates it was chosen
 * from, the shape, the cost, oneDNN's version and the CPU's ISA. */
void ht_gemm_describe(const ht_gemm_choice *choice, char *buf, size_t n);
/* oneDNN's name for the CPU's instruction set ("avx512_core_bf16", ...). */
const char *ht_gemm_cpu_isa(void);

/* A sentence naming the kernel that runs GEMMs of this dtype now (for logs). */
const char *ht_gemm_kernel_name(ht_dtype dtype);

/* ---------------------------------------------------------------- the table */

/* AdamW's hyper-parameters for one param's step t (docs/NUMERICS.md, AdamW). */
typedef struct ht_adamw_hparams {
    int64_t step; /* t, from 1 */
    double lr, beta1, beta2, eps, weight_decay;
} ht_adamw_hparams;

/* Every compute kernel the layers above call (docs/DESIGN.md, "Seams for later
 * backends"): the model's forward and backward and the optimizers' passes
 * run through this table and nothing else, so a backend (a GPU's) provides
 * the same entries and is tested op by op against the CPU's
 * (tests/test_kernels.c). Shapes, dtypes and semantics are those of the
 * CPU functions each entry names (kernels/cpu/ops.h, ht_gemm above,
 * ht_convert / ht_round_to in base.h). */
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

/* How the newton_schulz entry computes the iteration (docs/NUMERICS.md,
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
    /* memory: what the kernels read and write apart from the parameters
     * (activations, the rotary tables, optimizer state, workspaces),
     * zeroed and 64-byte aligned. The CPU's is ht_alloc / ht_free; the
     * CUDA backend's is the device's (cudaMalloc). Every array an entry
     * of this table takes is memory of this backend; scalars, the
     * hyper-parameter structs, Newton-Schulz's coefficients and the
     * cross-entropy's row count are host values. */
    void *(*alloc)(size_t bytes);
    void (*free)(void *p);
    /* Whether p lies in memory of this backend that the host cannot reach
     * (what a collective must stage through host memory). The CPU's answers
     * false for every pointer: its memory is the host's. */
    bool (*owns)(const void *p);
    /* The most bytes of this backend's memory held at once since the
     * process started (alloc's blocks and its kernels' own scratch). The CPU's answers
     * 0: its memory is the process's, which the peak RSS tells. */
    size_t (*peak_bytes)(void);
    /* Moving bytes, ggml's buffer interface (memset_tensor, set_tensor,
     * get_tensor, cpy_tensor): zero `bytes` of the backend's memory; upload
     * from host memory into it, download from it into host memory; copy
     * within it (dst and src apart). On the CPU these are memset and
     * memcpy. A backend that queues its work (CUDA: one stream) runs them
     * in order with the kernels; download returns once the host holds the
     * bytes, upload once the host buffer may be reused. */
    void (*zero)(void *dst, size_t bytes);
    void (*upload)(void *dst, const void *host_src, size_t bytes);
    void (*download)(void *host_dst, const void *src, size_t bytes);
    void (*copy)(void *dst, const void *src, size_t bytes);
    /* Waits for every entry called so far and returns HT_OK, or the first
     * failure since the process started (a product or a kernel that could
     * not run; the entries themselves return nothing, as ht_gemm). The
     * CPU's runs synchronously: its failure is ht_gemm_status's. */
    ht_status (*synchronize)(ht_error *err);
    /* products: ht_gemm, ht_gemm_ragged, ht_gemm_batched */
    void (*gemm)(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
                 const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc);
    void (*gemm_ragged)(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void *A,
                        int64_t lda, const void *B, int64_t ldb, ht_dtype dtype, float beta, float *C, int64_t ldc);
    void (*gemm_batched)(int64_t batch, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                         const void *A, int64_t lda, int64_t stride_a, const void *B, int64_t ldb, int64_t stride_b,
                         ht_dtype dtype, float beta, float *C, int64_t ldc, int64_t stride_c);
    /* dtypes: ht_convert, ht_round_to */
    void (*convert)(void *dst, ht_dtype dst_dtype, const void *src, ht_dtype src_dtype, size_t n);
    void (*round_to)(float *x, size_t n, ht_dtype precision);
    /* the decoder's: ht_rmsnorm_*, ht_add_bias, ht_bias_backward, ht_rope_*, ht_swiglu_*, ht_cross_entropy_*,
     * ht_softmax_partial */
    void (*rmsnorm_forward)(void *out, ht_dtype odtype, float *rstd, const float *x, const void *weight,
                            ht_dtype wdtype, int64_t N, int64_t C, float eps);
    void (*rmsnorm_backward)(float *dx, float *dweight, const float *dout, const float *x, const void *weight,
                             ht_dtype wdtype, const float *rstd, int64_t N, int64_t C);
    void (*add_bias)(float *y, const void *bias, ht_dtype bdtype, int64_t N, int64_t C);
    void (*bias_backward)(float *dbias, const float *dy, int64_t N, int64_t C);
    void (*rope_forward)(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                         const ht_rope_layout *layout);
    void (*rope_backward)(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T,
                          const ht_rope_layout *layout);
    void (*swiglu_forward)(void *h, ht_dtype hdtype, const float *gate, const float *up, int64_t n);
    void (*swiglu_backward)(float *dgate, float *dup, const float *dh, const float *gate, const float *up, int64_t n);
    double (*cross_entropy_forward)(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t *count,
                                    ht_softmax_row *rows);
    void (*cross_entropy_backward)(float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0, float scale,
                                   const ht_softmax_row *rows);
    void (*softmax_partial)(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0,
                            ht_softmax_row *rows, float *picked);
    /* attention: ht_attention_* */
    size_t (*attention_workspace_floats)(int64_t T, int64_t Dk, int64_t Dv);
    void (*attention_forward)(float *out, float *lse, float *head_max, const float *q, const float *k, const float *v,
                              const ht_attention_shape *shape, ht_dtype dtype, float *work);
    void (*attention_backward)(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                               const float *q, const float *k, const float *v, const ht_attention_shape *shape,
                               ht_dtype dtype, float *work);
    void (*attention_merge)(float *out, float *lse, const float *out2, const float *lse2, int64_t B, int64_t T,
                            int64_t H, int64_t Dv);
    /* the embedding: ht_embedding_forward, ht_embedding_backward */
    void (*embedding_forward)(float *x, const void *table, ht_dtype dtype, const int32_t *ids, int64_t N, int64_t C,
                              int64_t v0, int64_t V);
    void (*embedding_backward)(float *dtable, const float *dx, const int32_t *ids, int64_t N, int64_t C, int64_t v0,
                               int64_t V);
    /* moving rows by an index: ht_gather_rows, ht_scatter_rows */
    void (*gather_rows)(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes);
    void (*scatter_rows)(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes);
    /* Qwen2-MoE's: ht_moe_route, ht_moe_combine, ht_moe_combine_backward, ht_moe_route_backward, ht_moe_scatter_add */
    void (*moe_route)(float *probs, int32_t *sel, float *weight, float *psum, int64_t N, int E, int k, bool norm);
    void (*moe_combine)(float *y, const float *ye, const int32_t *pos, const int32_t *sel, const float *weight,
                        const float *z, const float *so, int64_t N, int k, int64_t C);
    void (*moe_combine_backward)(float *dso, float *dz, float *dw, float *dye, const float *dy, const float *ye,
                                 const float *so, const float *z, const int32_t *pos, const float *weight, int64_t N,
                                 int k, int64_t C);
    void (*moe_route_backward)(float *dp, const float *probs, const int32_t *sel, const float *weight, const float *dw,
                               const float *psum, const float *aux_grad, int64_t N, int E, int k, bool norm);
    void (*moe_scatter_add)(float *dx, const float *dxs, const int32_t *pos, int64_t N, int k, int64_t C);
    /* DeepSeek-V3's: ht_moe_route_grouped, ht_moe_route_grouped_backward */
    void (*moe_route_grouped)(float *scores, int32_t *sel, float *weight, float *psum, const float *bias, int64_t N,
                              int E, int k, int n_group, int topk_group, bool norm, float scaling);
    void (*moe_route_grouped_backward)(float *dz, const float *scores, const int32_t *sel, const float *weight,
                                       const float *dw, const float *psum, int64_t N, int E, int k, bool norm,
                                       float scaling);
    /* LoRA's dropout: ht_dropout */
    void (*dropout)(float *x, int64_t N, int64_t cols, float p, uint64_t seed, uint64_t site, int64_t token0);
    /* elementwise and reductions: ht_sum_squares, ht_sum_squares_each, ht_add, ht_accumulate, ht_copy_rows, ht_scale */
    double (*sum_squares)(const float *x, int64_t n);
    /* sums[i] (host memory) = sum_squares(x[i], n[i]) for i < count, bit for bit, in one wait for the device */
    void (*sum_squares_each)(double *sums, const float *const *x, const int64_t *n, int count);
    void (*add)(float *y, const float *x, const float *a, int64_t n);
    void (*accumulate)(float *y, const float *x, int64_t n);
    /* rows of floats between strided layouts: ht_copy_rows */
    void (*copy_rows)(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows, int64_t cols,
                      bool accumulate);
    void (*scale)(float *x, int64_t n, float k);
    /* the optimizers': ht_adamw_pass, ht_muon_momentum, ht_muon_apply, ht_ns_* */
    void (*adamw)(float *p, const float *g, float *m, float *v, int64_t n, const ht_adamw_hparams *h, void *model,
                  ht_dtype model_dtype, bool stochastic, uint64_t stream);
    void (*muon_momentum)(float *B, const float *g, float *u, int64_t n, float mu, float gw, bool nesterov,
                          ht_muon_arith arith);
    void (*muon_apply)(float *p, float *O, int64_t n, float decay, float step, ht_muon_arith arith, void *model,
                       ht_dtype dtype, bool stochastic, uint64_t stream, int64_t first);
    size_t (*ns_workspace_floats)(int64_t count, int64_t rows, int64_t cols, ht_dtype ns_dtype, ht_ns_form form);
    void (*newton_schulz)(const float *G, float *O, int64_t count, int64_t rows, int64_t cols,
                          const double (*coeffs)[3], int steps, double eps, ht_dtype ns_dtype, ht_ns_form form,
                          float *work);
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
/* The CUDA device the backend's table runs on (-1 without one). */
int ht_kernels_cuda_device(void);

#ifdef __cplusplus
}
#endif
#endif
