/* Attention under context parallelism (docs/DESIGN.md, Context parallelism).
 *
 * Two layouts of the same q, k, v, out. The sequence layout is what the
 * decoder holds: this rank's Tc tokens of each of B sequences, every head.
 * The attention layout is what the kernels see: under Ulysses (U > 1) the
 * U·Tc tokens of the ring rank's two chunks (its ring-local sequence, in
 * position order within each chunk) for heads [u·H/U, (u+1)·H/U) and key
 * heads [u·KV/U, (u+1)·KV/U) (a query head's key head stays with it);
 * without Ulysses both layouts are one. One all-to-all goes from the first
 * to the second, and one back.
 *
 * The ring (R > 1): ring rank r holds chunks r and 2R - 1 - r of c = T / 2R
 * tokens. Step s attends its two query chunks to the key/value chunks of
 * ring rank r - s, whose block arrived during step s - 1 (the next one is
 * in flight while this one is computed); a key chunk after a query chunk is
 * skipped, the one equal to it is the causal diagonal, every other is seen
 * whole. Each query chunk's partial results merge by their log-sum-exp.
 * Backward goes round again with the key/value blocks, their gradient
 * accumulators travelling a step behind them and arriving home after R
 * steps. */
#include "model/context.h"

#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

struct ht_cp_attention {
    ht_attention_shape shape; /* the sequence-layout shape it was sized for */
    int U, R, threads;
    size_t bytes;
    void *block;
    /* Ulysses: the all-to-alls' blocks; out (forward) or the forward's out
     * (backward), dout, dq, dk, dv in the attention layout */
    float *send, *recv, *o_att, *dout_att, *dq_att, *dk_att, *dv_att;
    float *hm; /* (B, H/U) the attention layout's head maxima */
    /* the ring: the key/value block in hand [k | v] and the next; backward's
     * block gradients (two: one computed while the other travels) and the
     * accumulators arriving (two likewise) */
    float *kv, *kv_next, *dkv[2], *dkv_in[2];
    /* one block's partial out, lse and head maxima; each query chunk's lse (B, 2, H/U, c); one block's gradients */
    float *blk_out, *blk_lse, *blk_max, *acc_lse, *blk_dq, *blk_dk, *blk_dv;
    float *work; /* (threads, the attention kernel's workspace) */
    /* host memory (QK-clip's maxima are the host's): hm and one block's blk_max downloaded */
    float *hm_host, *blk_max_host;
};

/* The attention layout's shape: H / U heads over the ring-local sequence. */
static ht_attention_shape attention_layout(const ht_cp_attention *a) {
    ht_attention_shape s = a->shape;
    s.T *= a->U;
    s.H /= a->U;
    s.KV /= a->U;
    s.Tk = s.q0 = s.k0 = 0;
    return s;
}

static void carve(ht_cp_attention *a, ht_arena *ar) {
    const ht_attention_shape *l = &a->shape;
    const int64_t q = l->B * l->T * l->H * l->Dk, k = l->B * l->T * l->KV * l->Dk, v = l->B * l->T * l->KV * l->Dv,
                  o = l->B * l->T * l->H * l->Dv;
    const ht_attention_shape s = attention_layout(a);
    const int64_t c = a->R > 1 ? s.T / 2 : 0, longest = a->R > 1 ? c : s.T;
    const size_t f = sizeof(float), ulysses = a->U > 1, ring = a->R > 1;
    const int64_t exchanged = q + k + v > 2 * o ? q + k + v : 2 * o;
    a->send = ht_arena_take(ar, ulysses * exchanged * f);
    a->recv = ht_arena_take(ar, ulysses * exchanged * f);
    a->o_att = ht_arena_take(ar, ulysses * o * f);
    a->dout_att = ht_arena_take(ar, ulysses * o * f);
    a->dq_att = ht_arena_take(ar, ulysses * q * f);
    a->dk_att = ht_arena_take(ar, ulysses * k * f);
    a->dv_att = ht_arena_take(ar, ulysses * v * f);
    a->hm = ht_arena_take(ar, (size_t)(s.B * s.H) * f);
    a->kv = ht_arena_take(ar, ring * (k + v) * f);
    a->kv_next = ht_arena_take(ar, ring * (k + v) * f);
    for (int i = 0; i < 2; i++) {
        a->dkv[i] = ht_arena_take(ar, ring * (k + v) * f);
        a->dkv_in[i] = ht_arena_take(ar, ring * (k + v) * f);
    }
    a->blk_out = ht_arena_take(ar, ring * (size_t)(c * s.H * s.Dv) * f);
    a->blk_lse = ht_arena_take(ar, ring * (size_t)(c * s.H) * f);
    a->blk_max = ht_arena_take(ar, ring * (size_t)s.H * f);
    a->acc_lse = ht_arena_take(ar, ring * (size_t)(s.B * 2 * s.H * c) * f);
    a->blk_dq = ht_arena_take(ar, ring * (size_t)(c * s.H * s.Dk) * f);
    a->blk_dk = ht_arena_take(ar, ring * (size_t)(c * s.KV * s.Dk) * f);
    a->blk_dv = ht_arena_take(ar, ring * (size_t)(c * s.KV * s.Dv) * f);
    a->work = ht_arena_take(ar, (size_t)a->threads * ht_kernels()->attention_workspace_floats(longest, s.Dk, s.Dv) * f);
}

ht_status ht_cp_attention_size(ht_cp_attention **ap, const ht_context_parallel *cp, const ht_attention_shape *local,
                               ht_error *err) {
    ht_cp_attention *a = *ap;
    const int U = cp->ulysses > 1 ? cp->ulysses : 1, R = cp->ring > 1 ? cp->ring : 1;
    const ht_attention_shape *o = a ? &a->shape : NULL;
    if (a && a->U == U && a->R == R && a->threads >= omp_get_max_threads() && o->B == local->B && o->T == local->T &&
        o->H == local->H && o->KV == local->KV && o->Dk == local->Dk && o->Dv == local->Dv)
        return HT_OK;
    if (local->H % U || local->KV % U || (R > 1 && (local->T * U) % 2))
        return ht_fail(err, HT_ERR_INVALID,
                       "context parallelism: %lld heads, %lld key/value heads and %lld tokens a rank do not split "
                       "over Ulysses %d x ring %d",
                       (long long)local->H, (long long)local->KV, (long long)local->T, U, R);
    if (!a) {
        a = calloc(1, sizeof(*a));
        if (!a) return ht_fail(err, HT_ERR_OOM, "cannot allocate context-parallel attention state");
        *ap = a;
    }
    ht_kernels()->free(a->block);
    ht_free(a->hm_host);
    a->block = NULL;
    a->shape = *local;
    a->U = U, a->R = R, a->threads = omp_get_max_threads();
    ht_arena ar = {0};
    carve(a, &ar);
    a->bytes = ar.used;
    a->block = ht_kernels()->alloc(ar.used);
    if (!a->block)
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %.1f MiB for context-parallel attention",
                       (double)ar.used / (1 << 20));
    ar = (ht_arena){.base = a->block};
    carve(a, &ar);
    const int64_t Hu = local->H / U;
    if (!(a->hm_host = ht_alloc((size_t)(local->B * Hu + Hu) * sizeof(float))))
        return ht_fail(err, HT_ERR_OOM, "cannot allocate context-parallel attention state");
    a->blk_max_host = a->hm_host + local->B * Hu;
    return HT_OK;
}

size_t ht_cp_attention_bytes(const ht_cp_attention *a) { return a ? a->bytes : 0; }

size_t ht_cp_attention_plan_bytes(const ht_context_parallel *cp, const ht_attention_shape *local) {
    ht_cp_attention a = {.shape = *local,
                         .U = cp->ulysses > 1 ? cp->ulysses : 1,
                         .R = cp->ring > 1 ? cp->ring : 1,
                         .threads = omp_get_max_threads()};
    ht_arena ar = {0};
    carve(&a, &ar);
    return ar.used;
}

void ht_cp_attention_free(ht_cp_attention *a) {
    if (!a) return;
    ht_kernels()->free(a->block);
    ht_free(a->hm_host);
    free(a);
}

/* ------------------------------------------------------------------ Ulysses' layouts */

/* The rows of one tensor between a layout and the all-to-all's blocks: block
 * j (every `stride` floats, this tensor's part `offset` into it) holds
 * heads [j·H/U, (j+1)·H/U) of the Tc tokens of each sequence, (B, Tc, H/U, D).
 * seq: x is the sequence layout (B, Tc, H, D); otherwise the attention
 * layout (B, U·Tc, H/U, D), block j holding tokens [j·Tc, (j+1)·Tc) of it.
 * to_blocks: x into the blocks, else the blocks into x. */
static void move_blocks(float *x, float *blocks, int64_t stride, int64_t offset, int64_t B, int64_t Tc, int64_t H,
                        int64_t D, int U, bool seq, bool to_blocks) {
    const int64_t Hu = H / U;
    const size_t row = (size_t)(Hu * D) * sizeof(float);
    for (int j = 0; j < U; j++)
        for (int64_t b = 0; b < B; b++)
            for (int64_t t = 0; t < Tc; t++) {
                float *xs = seq ? x + ((b * Tc + t) * H + j * Hu) * D : x + (b * U * Tc + j * Tc + t) * Hu * D;
                float *bl = blocks + j * stride + offset + (b * Tc + t) * Hu * D;
                if (to_blocks)
                    ht_kernels()->copy(bl, xs, row);
                else
                    ht_kernels()->copy(xs, bl, row);
            }
}

/* One all-to-all over the Ulysses group of `n` tensors: each from the
 * layout `from_seq` says into the other; x[i] (heads H[i], dims D[i]) is
 * read from `src[i]` and written to `dst[i]` (the same memory is fine). */
static void ulysses_exchange(ht_cp_attention *a, ht_context_parallel *cp, int n, float *const *src, float *const *dst,
                             const int64_t *H, const int64_t *D, bool from_seq) {
    const int64_t B = a->shape.B, Tc = a->shape.T;
    int64_t stride = 0, offset[4];
    for (int i = 0; i < n; i++) offset[i] = stride, stride += B * Tc * (H[i] / a->U) * D[i];
    for (int i = 0; i < n; i++)
        move_blocks(src[i], a->send, stride, offset[i], B, Tc, H[i], D[i], a->U, from_seq, true);
    double t0 = ht_time_seconds();
    cp->all_to_all(cp->ulysses_ctx, a->send, a->recv, stride * (int64_t)sizeof(float));
    cp->all_to_all_seconds += ht_time_seconds() - t0;
    for (int i = 0; i < n; i++)
        move_blocks(dst[i], a->recv, stride, offset[i], B, Tc, H[i], D[i], a->U, !from_seq, false);
}

/* ------------------------------------------------------------------ the ring */

static void ring_wait(ht_context_parallel *cp, void *request) {
    if (!request) return;
    double t0 = ht_time_seconds(), flight = 0.0;
    cp->wait(cp->ring_ctx, request, &flight);
    cp->ring_waited_seconds += ht_time_seconds() - t0;
    cp->ring_seconds += flight;
}

/* Query chunk qa (0 or 1) and key chunk e of the block from ring rank src,
 * as global chunk numbers. */
static int64_t chunk_of(int R, int rank, int half) { return half ? 2 * R - 1 - rank : rank; }

static ht_attention_shape block_shape(const ht_attention_shape *s, int64_t c, int64_t qchunk, int64_t kchunk) {
    return (ht_attention_shape){.B = 1,
                                .T = c,
                                .H = s->H,
                                .KV = s->KV,
                                .Dk = s->Dk,
                                .Dv = s->Dv,
                                .scale = s->scale,
                                .Tk = c,
                                .q0 = qchunk * c,
                                .k0 = kchunk * c};
}

/* The attention layout's forward over the ring (s: that layout's shape;
 * hm (B, H) of it, host memory, or NULL). */
static void ring_forward(ht_cp_attention *a, ht_context_parallel *cp, const ht_attention_shape *s, float *out,
                         float *lse, float *hm, const float *q, const float *k, const float *v, ht_dtype dtype) {
    const int R = a->R, r = cp->ring_rank;
    const int64_t B = s->B, Tr = s->T, c = Tr / 2, H = s->H, KV = s->KV, Dk = s->Dk, Dv = s->Dv;
    const int64_t kz = B * Tr * KV * Dk, vz = B * Tr * KV * Dv;
    const ht_kernel_ops *K = ht_kernels();
    float *cur = a->kv, *next = a->kv_next;
    K->copy(cur, k, (size_t)kz * sizeof(float));
    K->copy(cur + kz, v, (size_t)vz * sizeof(float));
    for (int64_t i = 0; hm && i < B * H; i++) hm[i] = -INFINITY;
    for (int step = 0; step < R; step++) {
        const int src = (r - step + R) % R;
        void *req = step + 1 < R ? cp->start_shift(cp->ring_ctx, cur, next, (kz + vz) * (int64_t)sizeof(float)) : NULL;
        for (int64_t b = 0; b < B; b++)
            for (int qh = 0; qh < 2; qh++)
                for (int kh = 0; kh < 2; kh++) {
                    const int64_t qa = chunk_of(R, r, qh), kb = chunk_of(R, src, kh);
                    if (kb > qa && !hm) continue; /* every key after every query; QK-clip's max still counts them */
                    /* The first block of each query chunk (step 0's first key chunk, which
                     * every query chunk sees) writes its accumulators; the others merge in. */
                    const bool first = step == 0 && kh == 0;
                    const ht_attention_shape blk = block_shape(s, c, qa, kb);
                    float *o = out + (b * Tr + qh * c) * H * Dv, *l = a->acc_lse + (b * 2 + qh) * H * c;
                    K->attention_forward(first ? o : a->blk_out, first ? l : a->blk_lse, hm ? a->blk_max : NULL,
                                         q + (b * Tr + qh * c) * H * Dk, cur + (b * Tr + kh * c) * KV * Dk,
                                         cur + kz + (b * Tr + kh * c) * KV * Dv, &blk, dtype, a->work);
                    if (!first) K->attention_merge(o, l, a->blk_out, a->blk_lse, 1, c, H, Dv);
                    if (!hm) continue;
                    const float *bm = a->blk_max_host;
                    K->download(a->blk_max_host, a->blk_max, (size_t)H * sizeof(float));
                    for (int64_t h = 0; h < H; h++) hm[b * H + h] = bm[h] > hm[b * H + h] ? bm[h] : hm[b * H + h];
                }
        ring_wait(cp, req);
        float *t = cur;
        cur = next, next = t;
    }
    /* Each query chunk's (H, c) log-sum-exp into lse (B, H, Tr). */
    for (int64_t b = 0; b < B; b++)
        for (int qh = 0; qh < 2; qh++)
            for (int64_t h = 0; h < H; h++)
                K->copy(lse + (b * H + h) * Tr + qh * c, a->acc_lse + ((b * 2 + qh) * H + h) * c,
                        (size_t)c * sizeof(float));
}

/* Step s computes the gradients of block src(s) into dkv[s % 2] while the
 * accumulator of that block (the gradients ranks r - s .. r - 1 found for
 * it) travels from rank r - 1, then adds the two and sends the sum on while
 * step s + 1 computes; the last sum's trip brings each block's whole
 * gradient home. */
static void ring_backward(ht_cp_attention *a, ht_context_parallel *cp, const ht_attention_shape *s, float *dq,
                          float *dk, float *dv, const float *dout, const float *out, const float *lse, const float *q,
                          const float *k, const float *v, ht_dtype dtype) {
    const int R = a->R, r = cp->ring_rank;
    const int64_t B = s->B, Tr = s->T, c = Tr / 2, H = s->H, KV = s->KV, Dk = s->Dk, Dv = s->Dv;
    const int64_t kz = B * Tr * KV * Dk, vz = B * Tr * KV * Dv, bytes = (kz + vz) * (int64_t)sizeof(float);
    const ht_kernel_ops *K = ht_kernels();
    float *cur = a->kv, *next = a->kv_next;
    K->copy(cur, k, (size_t)kz * sizeof(float));
    K->copy(cur + kz, v, (size_t)vz * sizeof(float));
    K->zero(dq, (size_t)(B * Tr * H * Dk) * sizeof(float));
    void *travelling = NULL; /* the accumulator sent at the end of the last step */
    for (int step = 0; step < R; step++) {
        const int src = (r - step + R) % R;
        float *g = a->dkv[step % 2];
        void *req = step + 1 < R ? cp->start_shift(cp->ring_ctx, cur, next, bytes) : NULL;
        K->zero(g, (size_t)bytes);
        for (int64_t b = 0; b < B; b++)
            for (int qh = 0; qh < 2; qh++) {
                /* The merged lse of the query chunk, (H, c). */
                for (int64_t h = 0; h < H; h++)
                    K->copy(a->blk_lse + h * c, lse + (b * H + h) * Tr + qh * c, (size_t)c * sizeof(float));
                for (int kh = 0; kh < 2; kh++) {
                    const int64_t qa = chunk_of(R, r, qh), kb = chunk_of(R, src, kh);
                    if (kb > qa) continue;
                    const ht_attention_shape blk = block_shape(s, c, qa, kb);
                    const int64_t qrow = b * Tr + qh * c, krow = b * Tr + kh * c;
                    K->attention_backward(a->blk_dq, a->blk_dk, a->blk_dv, dout + qrow * H * Dv, out + qrow * H * Dv,
                                          a->blk_lse, q + qrow * H * Dk, cur + krow * KV * Dk,
                                          cur + kz + krow * KV * Dv, &blk, dtype, a->work);
                    K->accumulate(dq + qrow * H * Dk, a->blk_dq, c * H * Dk);
                    K->accumulate(g + krow * KV * Dk, a->blk_dk, c * KV * Dk);
                    K->accumulate(g + kz + krow * KV * Dv, a->blk_dv, c * KV * Dv);
                }
            }
        if (travelling) { /* the block's accumulator so far, from rank r - 1 */
            ring_wait(cp, travelling);
            K->accumulate(g, a->dkv_in[(step - 1) % 2], kz + vz);
        }
        travelling = cp->start_shift(cp->ring_ctx, g, a->dkv_in[step % 2], bytes);
        ring_wait(cp, req);
        float *t = cur;
        cur = next, next = t;
    }
    ring_wait(cp, travelling); /* this rank's own block, summed over every query chunk of the ring */
    const float *home = a->dkv_in[(R - 1) % 2];
    K->copy(dk, home, (size_t)kz * sizeof(float));
    K->copy(dv, home + kz, (size_t)vz * sizeof(float));
}

/* ------------------------------------------------------------------ forward and backward */

void ht_cp_attention_forward(ht_cp_attention *a, ht_context_parallel *cp, float *out, float *lse, float *head_max,
                             float *q, float *k, float *v, ht_dtype dtype) {
    const ht_attention_shape s = attention_layout(a);
    const int64_t H = a->shape.H, KV = a->shape.KV, Dk = a->shape.Dk, Dv = a->shape.Dv;
    float *o = a->U > 1 ? a->o_att : out, *hm = head_max ? a->hm_host : NULL;
    if (a->U > 1) {
        float *const x[] = {q, k, v};
        const int64_t heads[] = {H, KV, KV}, dims[] = {Dk, Dk, Dv};
        ulysses_exchange(a, cp, 3, x, x, heads, dims, true);
    }
    if (a->R > 1) {
        ring_forward(a, cp, &s, o, lse, hm, q, k, v, dtype);
    } else {
        ht_kernels()->attention_forward(o, lse, hm ? a->hm : NULL, q, k, v, &s, dtype, a->work);
        if (hm) ht_kernels()->download(hm, a->hm, (size_t)(s.B * s.H) * sizeof(float));
    }
    if (a->U > 1) {
        float *const src[] = {o}, *const dst[] = {out};
        const int64_t heads[] = {H}, dims[] = {Dv};
        ulysses_exchange(a, cp, 1, src, dst, heads, dims, false);
    }
    if (!head_max) return;
    /* This rank's heads, [u·H/U, (u+1)·H/U), into (B, H). */
    const int64_t B = s.B, Hu = s.H, h0 = (a->U > 1 ? cp->ulysses_rank : 0) * Hu;
    for (int64_t i = 0; i < B * H; i++) head_max[i] = -INFINITY;
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < Hu; h++) head_max[b * H + h0 + h] = hm[b * Hu + h];
}

void ht_cp_attention_backward(ht_cp_attention *a, ht_context_parallel *cp, float *dq, float *dk, float *dv,
                              const float *dout, const float *out, const float *lse, const float *q, const float *k,
                              const float *v, ht_dtype dtype) {
    const ht_attention_shape s = attention_layout(a);
    const int64_t H = a->shape.H, KV = a->shape.KV, Dk = a->shape.Dk, Dv = a->shape.Dv;
    const bool U = a->U > 1;
    const float *dout_a = dout, *out_a = out;
    if (U) { /* dout and the forward's out to the attention layout */
        float *const src[] = {(float *)dout, (float *)out}, *const dst[] = {a->dout_att, a->o_att};
        const int64_t heads[] = {H, H}, dims[] = {Dv, Dv};
        ulysses_exchange(a, cp, 2, src, dst, heads, dims, true);
        dout_a = a->dout_att, out_a = a->o_att;
    }
    float *gq = U ? a->dq_att : dq, *gk = U ? a->dk_att : dk, *gv = U ? a->dv_att : dv;
    if (a->R > 1)
        ring_backward(a, cp, &s, gq, gk, gv, dout_a, out_a, lse, q, k, v, dtype);
    else
        ht_kernels()->attention_backward(gq, gk, gv, dout_a, out_a, lse, q, k, v, &s, dtype, a->work);
    if (U) {
        float *const src[] = {gq, gk, gv}, *const dst[] = {dq, dk, dv};
        const int64_t heads[] = {H, KV, KV}, dims[] = {Dk, Dk, Dv};
        ulysses_exchange(a, cp, 3, src, dst, heads, dims, false);
    }
}
