/* Every entry of the kernel table (include/hypertrain/kernels.h) that
 * computes or moves bytes, written once for the tables that wrap another
 * table's entries (kernels/fenced.c, kernels/profiled.c): its name, its
 * parameters, the arguments that pass them on, and the arrays among them
 * that must be the backend's memory (`checks`, each as M(array);).
 *
 * A wrapper defines
 *   HT_ENTRY(name, params, args, checks)            an entry returning nothing
 *   HT_ENTRY_RET(type, name, params, args, checks)  one returning `type`
 * and expands HT_KERNEL_ENTRIES(HT_ENTRY, HT_ENTRY_RET). The table's own
 * entries (alloc, free, owns, peak_bytes, synchronize and the workspace
 * sizes) are each wrapper's to write. An entry added to the table is added
 * here, or test_kernels finds the wrappers' slot empty. */
#ifndef HT_KERNELS_ENTRIES_H
#define HT_KERNELS_ENTRIES_H

#define HT_KERNEL_GEMM_ENTRIES(HT_ENTRY)                                                                               \
    HT_ENTRY(gemm,                                                                                                     \
             (bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,              \
              const void *B, int64_t ldb, ht_dtype dt, float beta, float *C, int64_t ldc),                             \
             (ta, tb, M, N, K, alpha, A, lda, B, ldb, dt, beta, C, ldc), (M(A); M(B); M(C);))                          \
    HT_ENTRY(gemm_ragged,                                                                                              \
             (bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,              \
              const void *B, int64_t ldb, ht_dtype dt, float beta, float *C, int64_t ldc),                             \
             (ta, tb, M, N, K, alpha, A, lda, B, ldb, dt, beta, C, ldc), (M(A); M(B); M(C);))                          \
    HT_ENTRY(gemm_batched,                                                                                             \
             (int64_t batch, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A,            \
              int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb, ht_dtype dt, float beta, float *C,      \
              int64_t ldc, int64_t sc),                                                                                \
             (batch, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, dt, beta, C, ldc, sc), (M(A); M(B); M(C);))

#define HT_KERNEL_ENTRIES(HT_ENTRY, HT_ENTRY_RET)                                                                      \
    HT_KERNEL_GEMM_ENTRIES(HT_ENTRY) HT_KERNEL_OTHER_ENTRIES(HT_ENTRY, HT_ENTRY_RET)

#define HT_KERNEL_OTHER_ENTRIES(HT_ENTRY, HT_ENTRY_RET)                                                                \
    HT_ENTRY(zero, (void *dst, size_t bytes), (dst, bytes), (M(dst);))                                                 \
    HT_ENTRY(upload, (void *dst, const void *src, size_t bytes), (dst, src, bytes), (M(dst);))                         \
    HT_ENTRY(download, (void *dst, const void *src, size_t bytes), (dst, src, bytes), (M(src);))                       \
    HT_ENTRY(copy, (void *dst, const void *src, size_t bytes), (dst, src, bytes), (M(dst); M(src);))                   \
    HT_ENTRY(convert, (void *dst, ht_dtype dd, const void *src, ht_dtype sd, size_t n), (dst, dd, src, sd, n),         \
             (M(dst); M(src);))                                                                                        \
    HT_ENTRY(round_to, (float *x, size_t n, ht_dtype p), (x, n, p), (M(x);))                                           \
    HT_ENTRY(rmsnorm_forward,                                                                                          \
             (void *out, ht_dtype od, float *rstd, const float *x, const void *w, ht_dtype wd, int64_t N, int64_t C,   \
              float eps),                                                                                              \
             (out, od, rstd, x, w, wd, N, C, eps), (M(out); M(rstd); M(x); M(w);))                                     \
    HT_ENTRY(rmsnorm_backward,                                                                                         \
             (float *dx, float *dw, const float *dout, const float *x, const void *w, ht_dtype wd, const float *rstd,  \
              int64_t N, int64_t C),                                                                                   \
             (dx, dw, dout, x, w, wd, rstd, N, C), (M(dx); M(dw); M(dout); M(x); M(w); M(rstd);))                      \
    HT_ENTRY(add_bias, (float *y, const void *b, ht_dtype bd, int64_t N, int64_t C), (y, b, bd, N, C), (M(y); M(b);))  \
    HT_ENTRY(bias_backward, (float *db, const float *dy, int64_t N, int64_t C), (db, dy, N, C), (M(db); M(dy);))       \
    HT_ENTRY(rope_forward, (float *x, const float *c, const float *s, int64_t B, int64_t T, const ht_rope_layout *l),  \
             (x, c, s, B, T, l), (M(x); M(c); M(s);))                                                                  \
    HT_ENTRY(rope_backward, (float *x, const float *c, const float *s, int64_t B, int64_t T, const ht_rope_layout *l), \
             (x, c, s, B, T, l), (M(x); M(c); M(s);))                                                                  \
    HT_ENTRY(swiglu_forward, (void *h, ht_dtype hd, const float *g, const float *u, int64_t n), (h, hd, g, u, n),      \
             (M(h); M(g); M(u);))                                                                                      \
    HT_ENTRY(swiglu_backward, (float *dg, float *du, const float *dh, const float *g, const float *u, int64_t n),      \
             (dg, du, dh, g, u, n), (M(dg); M(du); M(dh); M(g); M(u);))                                                \
    HT_ENTRY_RET(double, cross_entropy_forward,                                                                        \
                 (const float *logits, const int32_t *t, int64_t N, int64_t V, int64_t *count, ht_softmax_row *rows),  \
                 (logits, t, N, V, count, rows), (M(logits); M(t); M(rows);))                                          \
    HT_ENTRY(                                                                                                          \
        cross_entropy_backward,                                                                                        \
        (float *logits, const int32_t *t, int64_t N, int64_t V, int64_t v0, float scale, const ht_softmax_row *rows),  \
        (logits, t, N, V, v0, scale, rows), (M(logits); M(t); M(rows);))                                               \
    HT_ENTRY(softmax_partial,                                                                                          \
             (const float *logits, const int32_t *t, int64_t N, int64_t V, int64_t v0, ht_softmax_row *rows,           \
              float *picked),                                                                                          \
             (logits, t, N, V, v0, rows, picked), (M(logits); M(t); M(rows); M(picked);))                              \
    HT_ENTRY(attention_forward,                                                                                        \
             (float *out, float *lse, float *hm, const float *q, const float *k, const float *v,                       \
              const ht_attention_shape *s, ht_dtype dt, float *work),                                                  \
             (out, lse, hm, q, k, v, s, dt, work), (M(out); M(lse); M(hm); M(q); M(k); M(v); M(work);))                \
    HT_ENTRY(attention_backward,                                                                                       \
             (float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse, const float *q,  \
              const float *k, const float *v, const ht_attention_shape *s, ht_dtype dt, float *work),                  \
             (dq, dk, dv, dout, out, lse, q, k, v, s, dt, work),                                                       \
             (M(dq); M(dk); M(dv); M(dout); M(out); M(lse); M(q); M(k); M(v); M(work);))                               \
    HT_ENTRY(attention_merge,                                                                                          \
             (float *out, float *lse, const float *o2, const float *l2, int64_t B, int64_t T, int64_t H, int64_t Dv),  \
             (out, lse, o2, l2, B, T, H, Dv), (M(out); M(lse); M(o2); M(l2);))                                         \
    HT_ENTRY(embedding_forward,                                                                                        \
             (float *x, const void *t, ht_dtype dt, const int32_t *ids, int64_t N, int64_t C, int64_t v0, int64_t V),  \
             (x, t, dt, ids, N, C, v0, V), (M(x); M(t); M(ids);))                                                      \
    HT_ENTRY(embedding_backward,                                                                                       \
             (float *dt, const float *dx, const int32_t *ids, int64_t N, int64_t C, int64_t v0, int64_t V),            \
             (dt, dx, ids, N, C, v0, V), (M(dt); M(dx); M(ids);))                                                      \
    HT_ENTRY(gather_rows, (void *dst, const void *src, const int32_t *idx, int64_t rows, size_t rb),                   \
             (dst, src, idx, rows, rb), (M(dst); M(src); M(idx);))                                                     \
    HT_ENTRY(scatter_rows, (void *dst, const void *src, const int32_t *idx, int64_t rows, size_t rb),                  \
             (dst, src, idx, rows, rb), (M(dst); M(src); M(idx);))                                                     \
    HT_ENTRY(moe_route, (float *probs, int32_t *sel, float *w, float *psum, int64_t N, int E, int k, bool norm),       \
             (probs, sel, w, psum, N, E, k, norm), (M(probs); M(sel); M(w); M(psum);))                                 \
    HT_ENTRY(moe_combine,                                                                                              \
             (float *y, const float *ye, const int32_t *pos, const int32_t *sel, const float *w, const float *z,       \
              const float *so, int64_t N, int k, int64_t C),                                                           \
             (y, ye, pos, sel, w, z, so, N, k, C), (M(y); M(ye); M(pos); M(sel); M(w); M(z); M(so);))                  \
    HT_ENTRY(moe_combine_backward,                                                                                     \
             (float *dso, float *dz, float *dw, float *dye, const float *dy, const float *ye, const float *so,         \
              const float *z, const int32_t *pos, const float *w, int64_t N, int k, int64_t C),                        \
             (dso, dz, dw, dye, dy, ye, so, z, pos, w, N, k, C),                                                       \
             (M(dso); M(dz); M(dw); M(dye); M(dy); M(ye); M(so); M(z); M(pos); M(w);))                                 \
    HT_ENTRY(moe_route_backward,                                                                                       \
             (float *dp, const float *probs, const int32_t *sel, const float *w, const float *dw, const float *psum,   \
              const float *aux, int64_t N, int E, int k, bool norm),                                                   \
             (dp, probs, sel, w, dw, psum, aux, N, E, k, norm),                                                        \
             (M(dp); M(probs); M(sel); M(w); M(dw); M(psum); M(aux);))                                                 \
    HT_ENTRY(moe_scatter_add, (float *dx, const float *dxs, const int32_t *pos, int64_t N, int k, int64_t C),          \
             (dx, dxs, pos, N, k, C), (M(dx); M(dxs); M(pos);))                                                        \
    HT_ENTRY(moe_route_grouped,                                                                                        \
             (float *sc, int32_t *sel, float *w, float *psum, const float *bias, int64_t N, int E, int k, int ng,      \
              int tg, bool norm, float scaling),                                                                       \
             (sc, sel, w, psum, bias, N, E, k, ng, tg, norm, scaling), (M(sc); M(sel); M(w); M(psum); M(bias);))       \
    HT_ENTRY(moe_route_grouped_backward,                                                                               \
             (float *dz, const float *sc, const int32_t *sel, const float *w, const float *dw, const float *psum,      \
              int64_t N, int E, int k, bool norm, float scaling),                                                      \
             (dz, sc, sel, w, dw, psum, N, E, k, norm, scaling), (M(dz); M(sc); M(sel); M(w); M(dw); M(psum);))        \
    HT_ENTRY(dropout, (float *x, int64_t N, int64_t cols, float p, uint64_t seed, uint64_t site, int64_t t0),          \
             (x, N, cols, p, seed, site, t0), (M(x);))                                                                 \
    HT_ENTRY_RET(double, sum_squares, (const float *x, int64_t n), (x, n), (M(x);))                                    \
    HT_ENTRY(sum_squares_each, (double *sums, const float *const *x, const int64_t *n, int count),                     \
             (sums, x, n, count), (for (int i_ = 0; i_ < count; i_++) M(x[i_]);))                                      \
    HT_ENTRY(add, (float *y, const float *x, const float *a, int64_t n), (y, x, a, n), (M(y); M(x); M(a);))            \
    HT_ENTRY(accumulate, (float *y, const float *x, int64_t n), (y, x, n), (M(y); M(x);))                              \
    HT_ENTRY(copy_rows, (float *dst, int64_t dl, const float *src, int64_t sl, int64_t rows, int64_t cols, bool acc),  \
             (dst, dl, src, sl, rows, cols, acc), (M(dst); M(src);))                                                   \
    HT_ENTRY(scale, (float *x, int64_t n, float k), (x, n, k), (M(x);))                                                \
    HT_ENTRY(adamw,                                                                                                    \
             (float *p, const float *g, float *m, float *v, int64_t n, const ht_adamw_hparams *h, void *model,         \
              ht_dtype md, bool sr, uint64_t stream),                                                                  \
             (p, g, m, v, n, h, model, md, sr, stream), (M(p); M(g); M(m); M(v); M(model);))                           \
    HT_ENTRY(muon_momentum,                                                                                            \
             (float *B, const float *g, float *u, int64_t n, float mu, float gw, bool nesterov, ht_muon_arith ar),     \
             (B, g, u, n, mu, gw, nesterov, ar), (M(B); M(g); M(u);))                                                  \
    HT_ENTRY(muon_apply,                                                                                               \
             (float *p, float *O, int64_t n, float decay, float step, ht_muon_arith ar, void *model, ht_dtype dt,      \
              bool sr, uint64_t stream, int64_t first),                                                                \
             (p, O, n, decay, step, ar, model, dt, sr, stream, first), (M(p); M(O); M(model);))                        \
    HT_ENTRY(newton_schulz,                                                                                            \
             (const float *G, float *O, int64_t count, int64_t rows, int64_t cols, const double(*coeffs)[3],           \
              int steps, double eps, ht_dtype dt, ht_ns_form form, float *work),                                       \
             (G, O, count, rows, cols, coeffs, steps, eps, dt, form, work), (M(G); M(O); M(work);))

#endif
