/* The decoder's elementwise and reduction kernels, forward and backward.
 * Everything here computes in FP32; OpenMP splits rows across threads.
 * N is the number of rows (tokens), C the width of a row. */
#ifndef HT_KERNELS_OPS_H
#define HT_KERNELS_OPS_H

#include "hypertrain/base.h"

/* out = x * rsqrt(mean(x^2) + eps) * weight, per row; rstd (N) kept for backward.
 * x (N, C) f32, weight (C) in wdtype, out (N, C) in odtype (the matmul input dtype). */
void ht_rmsnorm_forward(void *out, ht_dtype odtype, float *rstd, const float *x, const void *weight, ht_dtype wdtype,
                        int64_t N, int64_t C, float eps);
/* dx += d/dx, dweight += d/dweight (FP32; NULL: a frozen weight, not computed), given dout (N, C). */
void ht_rmsnorm_backward(float *dx, float *dweight, const float *dout, const float *x, const void *weight,
                         ht_dtype wdtype, const float *rstd, int64_t N, int64_t C);

/* y (N, C) += bias (C) in bdtype. */
void ht_add_bias(float *y, const void *bias, ht_dtype bdtype, int64_t N, int64_t C);
/* dbias (C) += column sums of dy (N, C). */
void ht_bias_backward(float *dbias, const float *dy, int64_t N, int64_t C);

/* Rotary embedding, rotate-half form, in place on x (B, T, nheads, D) with
 * cos/sin tables (T, D/2). Backward applies the inverse rotation to dx. */
void ht_rope_forward(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t nheads, int64_t D);
void ht_rope_backward(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T, int64_t nheads,
                      int64_t D);

/* h = silu(gate) * up, written in hdtype. */
void ht_swiglu_forward(void *h, ht_dtype hdtype, const float *gate, const float *up, int64_t n);
/* dgate, dup from dh. */
void ht_swiglu_backward(float *dgate, float *dup, const float *dh, const float *gate, const float *up, int64_t n);

/* Mean cross-entropy over rows whose target is >= 0; returns the loss (double
 * accumulation). logits (N, V). `count` gets the number of counted rows. */
double ht_cross_entropy_forward(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t *count);
/* In place: logits (N, V) becomes dlogits = scale * (softmax - onehot), rows with target < 0 become 0. */
void ht_cross_entropy_backward(float *logits, const int32_t *targets, int64_t N, int64_t V, float scale);

/* Causal self-attention, tiled (kernels/attention.c): out (B, T, H, D) =
 * softmax(q kᵀ / sqrt(D), causal) v over q (B, T, H, D) and k, v (B, T, KV, D)
 * (H a multiple of KV: grouped-query heads share a key head), keeping only
 * lse (B, H, T), each row's log-sum-exp, for backward: no (T, T) tensor is
 * stored. head_max (B, H), when not NULL, gets each head's largest logit over
 * every position, masked ones included (QK-clip's S_h). work: the threads'
 * scratch, omp_get_max_threads() x ht_attention_workspace_floats(D). */
size_t ht_attention_workspace_floats(int64_t D);
void ht_attention_forward(float *out, float *lse, float *head_max, const float *q, const float *k, const float *v,
                          int64_t B, int64_t T, int64_t H, int64_t KV, int64_t D, float *work);
/* dq (B, T, H, D), dk, dv (B, T, KV, D) = the gradients (overwritten) given
 * dout and the forward's out and lse, recomputing the probabilities tile by tile. */
void ht_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                           const float *q, const float *k, const float *v, int64_t B, int64_t T, int64_t H, int64_t KV,
                           int64_t D, float *work);

/* Σ x² in double, with each thread's share summed in thread order: the same
 * bits on every run with the same thread count (an OpenMP reduction combines
 * in arrival order, which breaks bitwise resume past two threads). */
double ht_sum_squares(const float *x, int64_t n);

/* y = x + a elementwise (n). */
void ht_add(float *y, const float *x, const float *a, int64_t n);
/* y += x elementwise (n). */
void ht_accumulate(float *y, const float *x, int64_t n);

#endif
