/* The decoder's elementwise and reduction kernels, forward and backward.
 * Everything here computes in FP32; OpenMP splits rows across threads.
 * N is the number of rows (tokens), C the width of a row. */
#ifndef HT_KERNELS_OPS_H
#define HT_KERNELS_OPS_H

#include "hypertrain/base.h"
#include "hypertrain/kernels.h"

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

/* Rotary embedding in place on the rotary part of each head of x ((B, T)
 * token rows laid out as L says) with cos/sin tables (T, L->D/2). Backward
 * applies the inverse rotation to dx. */
void ht_rope_forward(float *x, const float *cos_t, const float *sin_t, int64_t B, int64_t T, const ht_rope_layout *L);
void ht_rope_backward(float *dx, const float *cos_t, const float *sin_t, int64_t B, int64_t T, const ht_rope_layout *L);

/* h = silu(gate) * up, written in hdtype. */
void ht_swiglu_forward(void *h, ht_dtype hdtype, const float *gate, const float *up, int64_t n);
/* dgate, dup from dh. */
void ht_swiglu_backward(float *dgate, float *dup, const float *dh, const float *gate, const float *up, int64_t n);

/* Mean cross-entropy over rows whose target is >= 0; returns the loss (double
 * accumulation). logits (N, V), read once. `count` gets the number of counted
 * rows; rows (N, or NULL) each counted row's softmax statistics. */
double ht_cross_entropy_forward(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t *count,
                                ht_softmax_row *rows);
/* In place: logits (N, V) becomes dlogits = scale * (softmax - onehot), rows
 * with target < 0 become 0. The columns are the vocabulary's [v0, v0 + V)
 * (tensor parallelism's slice; v0 0 and the whole vocabulary otherwise): a
 * target outside them has its one-hot on another rank. rows: the
 * statistics of the whole row (the forward's: each row then read and
 * written once), or NULL to find them again from these logits. */
void ht_cross_entropy_backward(float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0, float scale,
                               const ht_softmax_row *rows);
/* The vocabulary-parallel cross-entropy's local part over logits (N, V),
 * the vocabulary's columns [v0, v0 + V): each row's softmax statistics of
 * these columns (rows[n]; {0, -inf} for a target < 0) and the logit of its
 * target where this slice holds it (picked[n], else 0). */
void ht_softmax_partial(const float *logits, const int32_t *targets, int64_t N, int64_t V, int64_t v0,
                        ht_softmax_row *rows, float *picked);

/* Causal self-attention, tiled (kernels/cpu/attention.c), of the shape a says:
 * out (B, T, H, Dv) = softmax(scale q kᵀ, causal) v over q (B, T, H, Dk),
 * k (B, T, KV, Dk) and v (B, T, KV, Dv) (H a multiple of KV: grouped-query
 * heads share a key head), keeping only
 * lse (B, H, T), each row's log-sum-exp, for backward: no (T, T) tensor is
 * stored. head_max (B, H), when not NULL, gets each head's largest logit over
 * every position, masked ones included (QK-clip's S_h). The products take
 * their operands in `dtype` (q, k, v, dout and the probability tiles rounded
 * to it; float32: as they are) and accumulate in FP32; the softmax, out, lse
 * and every gradient are FP32. work: the threads' scratch,
 * omp_get_max_threads() x ht_attention_workspace_floats(T, Dk, Dv), T the
 * longer of the query and key blocks. */
size_t ht_attention_workspace_floats(int64_t T, int64_t Dk, int64_t Dv);
void ht_attention_forward(float *out, float *lse, float *head_max, const float *q, const float *k, const float *v,
                          const ht_attention_shape *a, ht_dtype dtype, float *work);
/* dq, dk, dv (the shapes of q, k, v) = the gradients (overwritten) given
 * dout and the forward's out and lse, recomputing the probabilities tile by
 * tile. For a block of keys (a->Tk, q0, k0) pass the whole attention's out
 * and lse (merged over every block): dk, dv are the block's keys' gradients,
 * dq the block's share of the queries' (sum the blocks' shares). */
void ht_attention_backward(float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse,
                           const float *q, const float *k, const float *v, const ht_attention_shape *a, ht_dtype dtype,
                           float *work);
/* Folds a second block's partial result (out2 (B, T, H, Dv), lse2 (B, H, T))
 * into the first, in place: out = (e^lse out + e^lse2 out2) / (e^lse +
 * e^lse2), lse = log(e^lse + e^lse2), taken against the larger of the two
 * (a row that saw no key in either stays out 0, lse -inf). */
void ht_attention_merge(float *out, float *lse, const float *out2, const float *lse2, int64_t B, int64_t T, int64_t H,
                        int64_t Dv);

/* Σ x² in double, with each thread's share summed in thread order: the same
 * bits on every run with the same thread count (an OpenMP reduction combines
 * in arrival order, which breaks bitwise resume past two threads). */
double ht_sum_squares(const float *x, int64_t n);
/* sums[i] = ht_sum_squares(x[i], n[i]) for i < count. */
void ht_sum_squares_each(double *sums, const float *const *x, const int64_t *n, int count);

/* y = x + a elementwise (n). */
void ht_add(float *y, const float *x, const float *a, int64_t n);
/* y += x elementwise (n). */
void ht_accumulate(float *y, const float *x, int64_t n);
/* dst[r·dst_ld + c] = src[r·src_ld + c] (accumulate: +=) for r < rows, c < cols:
 * a column block of one row-major tensor into another's (dst and src apart). */
void ht_copy_rows(float *dst, int64_t dst_ld, const float *src, int64_t src_ld, int64_t rows, int64_t cols,
                  bool accumulate);

/* x (N, C) FP32 = rows ids[n] of table in dtype, which holds the
 * vocabulary's rows [v0, v0 + V) (all of it: v0 0; tensor parallelism's
 * slice otherwise): a token outside them gets a row of zeros (its row is
 * another rank's). */
void ht_embedding_forward(float *x, const void *table, ht_dtype dtype, const int32_t *ids, int64_t N, int64_t C,
                          int64_t v0, int64_t V);
/* dtable rows ids[n] - v0 += dx (N, C) for the tokens of [v0, v0 + V), every
 * row in token order (the same sums whatever the thread count). */
void ht_embedding_backward(float *dtable, const float *dx, const int32_t *ids, int64_t N, int64_t C, int64_t v0,
                           int64_t V);

/* Inverted dropout (torch.nn.Dropout's scaling 1 / (1 - p)) on x (N, cols)
 * FP32 in place: element (n, c) is dropped when a 24-bit uniform drawn from
 * (seed, site, token0 + n, c) by a counter-based hash falls below p. */
void ht_dropout(float *x, int64_t N, int64_t cols, float p, uint64_t seed, uint64_t site, int64_t token0);

/* x *= k elementwise (n). */
void ht_scale(float *x, int64_t n, float k);

/* ---------------------------------------------------------------- the optimizers' passes (kernels/cpu/optim.c) */

typedef struct ht_adamw_hparams ht_adamw_hparams;
/* One AdamW step over n elements (docs/NUMERICS.md, AdamW, in torch's op order):
 * p, m, v updated in place from g; model (bf16/f16, or NULL) gets the new p
 * rounded to nearest or, `stochastic`, from stream (element i draws number
 * i). p NULL: the model copy holds the values (widened exactly, updated,
 * rounded back). */
void ht_adamw_pass(float *p, const float *g, float *m, float *v, int64_t n, const ht_adamw_hparams *h, void *model,
                   ht_dtype model_dtype, bool stochastic, uint64_t stream);
/* B <- mu B + gw g; with nesterov u = gw g + mu B (else u is not written);
 * arith TORCH: torch's lerps, B.lerp_(g, gw) and u = g.lerp(B, mu). */
void ht_muon_momentum(float *B, const float *g, float *u, int64_t n, float mu, float gw, bool nesterov,
                      ht_muon_arith arith);
/* p <- p decay - step O (arith TORCH: p decay, then one FMA) for n elements, elements [first, first + n) of the
 * param's local rows, and the model copy from the new p in the same pass
 * when model != NULL, rounded to nearest or stochastically (stream). p
 * NULL: the model copy holds the values, widened (exactly) into O, which
 * takes the new values before they are rounded back; O is scratch either way. */
void ht_muon_apply(float *p, float *O, int64_t n, float decay, float step, ht_muon_arith arith, void *model,
                   ht_dtype dtype, bool stochastic, uint64_t stream, int64_t first);
/* Newton-Schulz (docs/NUMERICS.md, Muon): O = NS(G) for `count` (rows, cols)
 * FP32 matrices, one after the other in G and O, each normalized by its
 * Frobenius norm (in double) + eps, then `steps` iterations of coeffs[k] =
 * (a, b, c), the products in ns_dtype with FP32 accumulation, batched over
 * the matrices. gram: the Gram form where it takes fewer multiply-adds
 * (FP32 operands only; kernels/cpu/optim.c). O may be G; work holds ht_ns_workspace_floats() floats
 * (count times one matrix's). */
size_t ht_ns_workspace_floats(int64_t count, int64_t rows, int64_t cols, ht_dtype ns_dtype, ht_ns_form form);
void ht_ns_iterate(const float *G, float *O, int64_t count, int64_t rows, int64_t cols, const double (*coeffs)[3],
                   int steps, double eps, ht_dtype ns_dtype, ht_ns_form form, float *work);

/* ---------------------------------------------------------------- the sparse blocks (kernels/cpu/moe.c) */

/* probs (N, E) in place from the router's logits (softmax as torch computes
 * it, exp(x - max) / sum), then each row's k largest (ties to the lower
 * expert, in decreasing order): sel (N, k) and weight (N, k) their
 * probabilities, divided by their sum psum (N) when norm. */
void ht_moe_route(float *probs, int32_t *sel, float *weight, float *psum, int64_t N, int E, int k, bool norm);
/* dst row r = src row idx[r], rows of row_bytes (rows r in [0, rows)). */
void ht_gather_rows(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes);
/* dst row idx[r] = src row r. */
void ht_scatter_rows(void *dst, const void *src, const int32_t *idx, int64_t rows, size_t row_bytes);
/* y (N, C) = the sum of weight[n, j] ye[pos[n, j]], added in increasing
 * expert order (sel), plus sigmoid(z[n]) so[n]; z NULL: plus so[n]
 * (ungated); so NULL: no shared expert. */
void ht_moe_combine(float *y, const float *ye, const int32_t *pos, const int32_t *sel, const float *weight,
                    const float *z, const float *so, int64_t N, int k, int64_t C);
/* Its backward given dy (N, C): dso = sigmoid(z) dy (z NULL: dy), dz = the
 * gate logit's gradient (z NULL: untouched), dw[n, j] = dy · ye[pos],
 * dye[pos] = weight dy; so NULL: neither dso nor dz. */
void ht_moe_combine_backward(float *dso, float *dz, float *dw, float *dye, const float *dy, const float *ye,
                             const float *so, const float *z, const int32_t *pos, const float *weight, int64_t N, int k,
                             int64_t C);
/* dp (N, E): the router logits' gradient from the chosen probabilities'
 * (dw, through the normalisation when norm) and aux_grad (E, or NULL) on
 * every probability, through the softmax. */
void ht_moe_route_backward(float *dp, const float *probs, const int32_t *sel, const float *weight, const float *dw,
                           const float *psum, const float *aux_grad, int64_t N, int E, int k, bool norm);
/* dx[n] += dxs[pos[n, j]] for every choice j. */
void ht_moe_scatter_add(float *dx, const float *dxs, const int32_t *pos, int64_t N, int k, int64_t C);
/* DeepSeek-V3's router (transformers' DeepseekV3TopkRouter): scores (N, E)
 * in place from the logits, sigmoid; the choice on scores + bias (E; NULL:
 * none): each of n_group groups of E / n_group consecutive experts scored by
 * the sum of its two largest biased scores, the topk_group best groups kept
 * (ties to the lower group), the k largest biased scores of their experts
 * (ties to the lower expert, in decreasing order): sel (N, k); weight (N, k)
 * the chosen experts' unbiased scores, divided by psum (N) = their sum +
 * 1e-20 when norm (psum: their sum otherwise), times scaling. */
void ht_moe_route_grouped(float *scores, int32_t *sel, float *weight, float *psum, const float *bias, int64_t N, int E,
                          int k, int n_group, int topk_group, bool norm, float scaling);
/* dz (N, E): the router logits' gradient from the chosen weights' dw,
 * through the scaling, the normalisation when norm and the sigmoid; 0 for
 * the experts not chosen. */
void ht_moe_route_grouped_backward(float *dz, const float *scores, const int32_t *sel, const float *weight,
                                   const float *dw, const float *psum, int64_t N, int E, int k, bool norm,
                                   float scaling);

#endif
