/* Attention under context parallelism (internal to the model layer): the
 * decoder hands it q, k, v of the tokens this rank holds (ht_context_parallel
 * says which) and gets their attention output, as if each query had seen
 * its whole sequence. Ulysses' all-to-alls and the ring's key/value blocks
 * go through the exchanges the model was given; the arithmetic is the
 * kernel table's (attention over a block of keys at position offsets, and
 * the merge of two partial results by their log-sum-exp). */
#ifndef HT_MODEL_CONTEXT_H
#define HT_MODEL_CONTEXT_H

#include "hypertrain/kernels.h"
#include "hypertrain/model.h"

typedef struct ht_cp_attention ht_cp_attention;

/* Scratch for attention calls of `local`'s shape (B, Tc tokens of each
 * sequence, H heads, KV key/value heads, Dk, Dv; the rest ignored) under cp:
 * sized again only when the shape changes. *a may be NULL (a new one). */
ht_status ht_cp_attention_size(ht_cp_attention **a, const ht_context_parallel *cp, const ht_attention_shape *local,
                               ht_error *err);
/* The bytes it holds. */
size_t ht_cp_attention_bytes(const ht_cp_attention *a);
/* What ht_cp_attention_bytes will be once ht_cp_attention_size sizes it
 * for `local` over cp's groups: for a plan before anything is sized. */
size_t ht_cp_attention_plan_bytes(const ht_context_parallel *cp, const ht_attention_shape *local);
void ht_cp_attention_free(ht_cp_attention *a);

/* In the shape `a` was sized for (ht_cp_attention_size):
 * out (B, Tc, H, Dv) = causal attention of the queries q (B, Tc, H, Dk)
 * over every key of their sequences, k and v (B, Tc, KV, Dk / Dv) being this
 * rank's share of them (rotated at their global positions). Afterwards q,
 * k, v and lse (B·H·Tc floats) hold what ht_cp_attention_backward reads:
 * under Ulysses, the whole ring-local sequences of this rank's H / U heads.
 * head_max (B, H), host memory, if not NULL: each head's largest logit
 * over every key (masked ones too), -inf for heads another Ulysses rank
 * computes. */
void ht_cp_attention_forward(ht_cp_attention *a, ht_context_parallel *cp, float *out, float *lse, float *head_max,
                             float *q, float *k, float *v, ht_dtype dtype);
/* dq, dk, dv (this rank's tokens, as q, k, v came into the forward) from
 * dout (B, Tc, H, Dv) and what the forward left: out (its output, as it
 * returned it), lse, q, k, v. */
void ht_cp_attention_backward(ht_cp_attention *a, ht_context_parallel *cp, float *dq, float *dk, float *dv,
                              const float *dout, const float *out, const float *lse, const float *q, const float *k,
                              const float *v, ht_dtype dtype);

#endif
