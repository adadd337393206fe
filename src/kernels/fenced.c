/* The fenced backend: the CPU's kernels on memory the host cannot touch.
 *
 * A GPU's memory is reached from host code only through the table's memory
 * entries (upload, download, zero, copy); a stray memcpy or loop over it is
 * a crash there and nothing here, since the CPU's memory is the host's. This
 * table makes the CPU behave like a device in that one respect: every
 * allocation is its own anonymous mapping, kept PROT_NONE except while an
 * entry of this table runs, so host code that reads or writes backend memory
 * outside an entry faults at the line that did it. The kernels are the
 * CPU's, so a run on this table gives the CPU's bits: tests run the trainer
 * on it to prove the layers above keep to the seam, on any machine.
 *
 * Entries may be called from several threads (a fault would then be missed,
 * never invented): a count of running entries opens the fence on the first
 * and closes it after the last. */
#include "hypertrain/kernels.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct region {
    void *base;
    size_t bytes; /* whole pages */
} region;

static struct {
    pthread_mutex_t lock;
    region *regions;
    int count, capacity;
    int open;          /* entries running */
    size_t held, peak; /* bytes mapped now, and at most */
    struct sigaction previous;
} fence = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void protect_all(int prot) {
    for (int i = 0; i < fence.count; i++)
        if (mprotect(fence.regions[i].base, fence.regions[i].bytes, prot) != 0) {
            perror("hypertrain: fenced backend: mprotect");
            abort();
        }
}

static void enter(void) {
    pthread_mutex_lock(&fence.lock);
    if (fence.open++ == 0) protect_all(PROT_READ | PROT_WRITE);
    pthread_mutex_unlock(&fence.lock);
}

static void leave(void) {
    pthread_mutex_lock(&fence.lock);
    if (--fence.open == 0) protect_all(PROT_NONE);
    pthread_mutex_unlock(&fence.lock);
}

/* A fault inside a fenced region names it, then falls to the handler that
 * was there before (the default's core dump, or a sanitizer's stack trace):
 * returning re-runs the faulting access with that handler in place. */
static void on_fault(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    const char *at = info->si_addr;
    for (int i = 0; i < fence.count; i++) {
        const char *b = fence.regions[i].base;
        if (at >= b && at < b + fence.regions[i].bytes) {
            char msg[192];
            int n = snprintf(msg, sizeof(msg),
                             "hypertrain: fenced backend: host code touched backend memory at %p, byte %zu of a "
                             "region of %zu bytes, outside the table's entries\n",
                             (const void *)at, (size_t)(at - b), fence.regions[i].bytes);
            if (n > 0) (void)!write(2, msg, (size_t)n < sizeof(msg) ? (size_t)n : sizeof(msg) - 1);
            break;
        }
    }
    sigaction(sig, &fence.previous, NULL);
}

static void *fenced_alloc(size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = ((bytes ? bytes : 1) + page - 1) / page * page;
    pthread_mutex_lock(&fence.lock);
    void *p = NULL;
    if (fence.count == fence.capacity) {
        int cap = fence.capacity ? 2 * fence.capacity : 64;
        region *r = realloc(fence.regions, (size_t)cap * sizeof(region));
        if (!r) goto out;
        fence.regions = r, fence.capacity = cap;
    }
    p = mmap(NULL, len, fence.open ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        p = NULL;
        goto out;
    }
    fence.regions[fence.count++] = (region){p, len};
    fence.held += len;
    if (fence.held > fence.peak) fence.peak = fence.held;
    /* the handler goes in front of whatever handles SIGSEGV now (installed again if someone replaced it) */
    struct sigaction now;
    if (sigaction(SIGSEGV, NULL, &now) == 0 && !((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_fault)) {
        struct sigaction sa = {.sa_sigaction = on_fault, .sa_flags = SA_SIGINFO};
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &fence.previous);
    }
out:
    pthread_mutex_unlock(&fence.lock);
    return p;
}

static void fenced_free(void *p) {
    if (!p) return;
    pthread_mutex_lock(&fence.lock);
    for (int i = 0; i < fence.count; i++)
        if (fence.regions[i].base == p) {
            munmap(p, fence.regions[i].bytes);
            fence.held -= fence.regions[i].bytes;
            fence.regions[i] = fence.regions[--fence.count];
            pthread_mutex_unlock(&fence.lock);
            return;
        }
    pthread_mutex_unlock(&fence.lock);
    fprintf(stderr, "hypertrain: fenced backend: free of %p, which it did not allocate\n", p);
    abort();
}

static size_t fenced_peak_bytes(void) {
    pthread_mutex_lock(&fence.lock);
    size_t peak = fence.peak;
    pthread_mutex_unlock(&fence.lock);
    return peak;
}

static bool fenced_owns(const void *p) {
    const char *at = p;
    bool in = false;
    pthread_mutex_lock(&fence.lock);
    for (int i = 0; i < fence.count && !in; i++)
        in = at >= (const char *)fence.regions[i].base &&
             at < (const char *)fence.regions[i].base + fence.regions[i].bytes;
    pthread_mutex_unlock(&fence.lock);
    return in;
}

/* An array an entry is given must be this backend's memory (NULL: an
 * output not asked for): host memory handed to a GPU's kernel is a crash
 * there, so it is one here, naming the entry and the argument. */
static void owned(const char *entry, const char *arg, const void *p) {
    if (!p || fenced_owns(p)) return;
    fprintf(stderr, "hypertrain: fenced backend: %s was given %s = %p, which is not the backend's memory\n", entry, arg,
            p);
    abort();
}
#define UNPAREN(...) __VA_ARGS__

/* Every other entry: the CPU's, inside the fence, its arrays checked. */
#define CPU ht_kernels_cpu()
#define M(ptr) owned(__func__ + 7, #ptr, ptr)
#define FENCED(name, params, args, checks)                                                                             \
    static void fenced_##name params {                                                                                 \
        enter();                                                                                                       \
        UNPAREN checks;                                                                                                \
        CPU->name args;                                                                                                \
        leave();                                                                                                       \
    }
#define FENCED_RET(type, name, params, args, checks)                                                                   \
    static type fenced_##name params {                                                                                 \
        enter();                                                                                                       \
        UNPAREN checks;                                                                                                \
        type r = CPU->name args;                                                                                       \
        leave();                                                                                                       \
        return r;                                                                                                      \
    }

FENCED(zero, (void *dst, size_t bytes), (dst, bytes), (M(dst);))
FENCED(upload, (void *dst, const void *src, size_t bytes), (dst, src, bytes), (M(dst);))
FENCED(download, (void *dst, const void *src, size_t bytes), (dst, src, bytes), (M(src);))
FENCED(copy, (void *dst, const void *src, size_t bytes), (dst, src, bytes), (M(dst); M(src);))
static ht_status fenced_synchronize(ht_error *err) { return CPU->synchronize(err); }
FENCED(gemm,
       (bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda, const void *B,
        int64_t ldb, ht_dtype dt, float beta, float *C, int64_t ldc),
       (ta, tb, M, N, K, alpha, A, lda, B, ldb, dt, beta, C, ldc), (M(A); M(B); M(C);))
FENCED(gemm_ragged,
       (bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda, const void *B,
        int64_t ldb, ht_dtype dt, float beta, float *C, int64_t ldc),
       (ta, tb, M, N, K, alpha, A, lda, B, ldb, dt, beta, C, ldc), (M(A); M(B); M(C);))
FENCED(gemm_batched,
       (int64_t batch, bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, const void *A, int64_t lda,
        int64_t sa, const void *B, int64_t ldb, int64_t sb, ht_dtype dt, float beta, float *C, int64_t ldc, int64_t sc),
       (batch, ta, tb, M, N, K, alpha, A, lda, sa, B, ldb, sb, dt, beta, C, ldc, sc), (M(A); M(B); M(C);))
FENCED(convert, (void *dst, ht_dtype dd, const void *src, ht_dtype sd, size_t n), (dst, dd, src, sd, n),
       (M(dst); M(src);))
FENCED(round_to, (float *x, size_t n, ht_dtype p), (x, n, p), (M(x);))
FENCED(rmsnorm_forward,
       (void *out, ht_dtype od, float *rstd, const float *x, const void *w, ht_dtype wd, int64_t N, int64_t C,
        float eps),
       (out, od, rstd, x, w, wd, N, C, eps), (M(out); M(rstd); M(x); M(w);))
FENCED(rmsnorm_backward,
       (float *dx, float *dw, const float *dout, const float *x, const void *w, ht_dtype wd, const float *rstd,
        int64_t N, int64_t C),
       (dx, dw, dout, x, w, wd, rstd, N, C), (M(dx); M(dw); M(dout); M(x); M(w); M(rstd);))
FENCED(add_bias, (float *y, const void *b, ht_dtype bd, int64_t N, int64_t C), (y, b, bd, N, C), (M(y); M(b);))
FENCED(bias_backward, (float *db, const float *dy, int64_t N, int64_t C), (db, dy, N, C), (M(db); M(dy);))
FENCED(rope_forward, (float *x, const float *c, const float *s, int64_t B, int64_t T, const ht_rope_layout *l),
       (x, c, s, B, T, l), (M(x); M(c); M(s);))
FENCED(rope_backward, (float *x, const float *c, const float *s, int64_t B, int64_t T, const ht_rope_layout *l),
       (x, c, s, B, T, l), (M(x); M(c); M(s);))
FENCED(swiglu_forward, (void *h, ht_dtype hd, const float *g, const float *u, int64_t n), (h, hd, g, u, n),
       (M(h); M(g); M(u);))
FENCED(swiglu_backward, (float *dg, float *du, const float *dh, const float *g, const float *u, int64_t n),
       (dg, du, dh, g, u, n), (M(dg); M(du); M(dh); M(g); M(u);))
FENCED_RET(double, cross_entropy_forward,
           (const float *logits, const int32_t *t, int64_t N, int64_t V, int64_t *count, ht_softmax_row *rows),
           (logits, t, N, V, count, rows), (M(logits); M(t); M(rows);))
FENCED(cross_entropy_backward,
       (float *logits, const int32_t *t, int64_t N, int64_t V, int64_t v0, float scale, const ht_softmax_row *rows),
       (logits, t, N, V, v0, scale, rows), (M(logits); M(t); M(rows);))
FENCED(softmax_partial,
       (const float *logits, const int32_t *t, int64_t N, int64_t V, int64_t v0, ht_softmax_row *rows, float *picked),
       (logits, t, N, V, v0, rows, picked), (M(logits); M(t); M(rows); M(picked);))
static size_t fenced_attention_workspace_floats(int64_t T, int64_t Dk, int64_t Dv) {
    return CPU->attention_workspace_floats(T, Dk, Dv);
}
FENCED(attention_forward,
       (float *out, float *lse, float *hm, const float *q, const float *k, const float *v, const ht_attention_shape *s,
        ht_dtype dt, float *work),
       (out, lse, hm, q, k, v, s, dt, work), (M(out); M(lse); M(hm); M(q); M(k); M(v); M(work);))
FENCED(attention_backward,
       (float *dq, float *dk, float *dv, const float *dout, const float *out, const float *lse, const float *q,
        const float *k, const float *v, const ht_attention_shape *s, ht_dtype dt, float *work),
       (dq, dk, dv, dout, out, lse, q, k, v, s, dt, work),
       (M(dq); M(dk); M(dv); M(dout); M(out); M(lse); M(q); M(k); M(v); M(work);))
FENCED(attention_merge,
       (float *out, float *lse, const float *o2, const float *l2, int64_t B, int64_t T, int64_t H, int64_t Dv),
       (out, lse, o2, l2, B, T, H, Dv), (M(out); M(lse); M(o2); M(l2);))
FENCED(embedding_forward,
       (float *x, const void *t, ht_dtype dt, const int32_t *ids, int64_t N, int64_t C, int64_t v0, int64_t V),
       (x, t, dt, ids, N, C, v0, V), (M(x); M(t); M(ids);))
FENCED(embedding_backward,
       (float *dt, const float *dx, const int32_t *ids, int64_t N, int64_t C, int64_t v0, int64_t V),
       (dt, dx, ids, N, C, v0, V), (M(dt); M(dx); M(ids);))
FENCED(gather_rows, (void *dst, const void *src, const int32_t *idx, int64_t rows, size_t rb),
       (dst, src, idx, rows, rb), (M(dst); M(src); M(idx);))
FENCED(scatter_rows, (void *dst, const void *src, const int32_t *idx, int64_t rows, size_t rb),
       (dst, src, idx, rows, rb), (M(dst); M(src); M(idx);))
FENCED(moe_route, (float *probs, int32_t *sel, float *w, float *psum, int64_t N, int E, int k, bool norm),
       (probs, sel, w, psum, N, E, k, norm), (M(probs); M(sel); M(w); M(psum);))
FENCED(moe_combine,
       (float *y, const float *ye, const int32_t *pos, const int32_t *sel, const float *w, const float *z,
        const float *so, int64_t N, int k, int64_t C),
       (y, ye, pos, sel, w, z, so, N, k, C), (M(y); M(ye); M(pos); M(sel); M(w); M(z); M(so);))
FENCED(moe_combine_backward,
       (float *dso, float *dz, float *dw, float *dye, const float *dy, const float *ye, const float *so, const float *z,
        const int32_t *pos, const float *w, int64_t N, int k, int64_t C),
       (dso, dz, dw, dye, dy, ye, so, z, pos, w, N, k, C),
       (M(dso); M(dz); M(dw); M(dye); M(dy); M(ye); M(so); M(z); M(pos); M(w);))
FENCED(moe_route_backward,
       (float *dp, const float *probs, const int32_t *sel, const float *w, const float *dw, const float *psum,
        const float *aux, int64_t N, int E, int k, bool norm),
       (dp, probs, sel, w, dw, psum, aux, N, E, k, norm), (M(dp); M(probs); M(sel); M(w); M(dw); M(psum); M(aux);))
FENCED(moe_scatter_add, (float *dx, const float *dxs, const int32_t *pos, int64_t N, int k, int64_t C),
       (dx, dxs, pos, N, k, C), (M(dx); M(dxs); M(pos);))
FENCED(moe_route_grouped,
       (float *sc, int32_t *sel, float *w, float *psum, const float *bias, int64_t N, int E, int k, int ng, int tg,
        bool norm, float scaling),
       (sc, sel, w, psum, bias, N, E, k, ng, tg, norm, scaling), (M(sc); M(sel); M(w); M(psum); M(bias);))
FENCED(moe_route_grouped_backward,
       (float *dz, const float *sc, const int32_t *sel, const float *w, const float *dw, const float *psum, int64_t N,
        int E, int k, bool norm, float scaling),
       (dz, sc, sel, w, dw, psum, N, E, k, norm, scaling), (M(dz); M(sc); M(sel); M(w); M(dw); M(psum);))
FENCED(dropout, (float *x, int64_t N, int64_t cols, float p, uint64_t seed, uint64_t site, int64_t t0),
       (x, N, cols, p, seed, site, t0), (M(x);))
FENCED_RET(double, sum_squares, (const float *x, int64_t n), (x, n), (M(x);))
FENCED(add, (float *y, const float *x, const float *a, int64_t n), (y, x, a, n), (M(y); M(x); M(a);))
FENCED(accumulate, (float *y, const float *x, int64_t n), (y, x, n), (M(y); M(x);))
FENCED(copy_rows, (float *dst, int64_t dl, const float *src, int64_t sl, int64_t rows, int64_t cols, bool acc),
       (dst, dl, src, sl, rows, cols, acc), (M(dst); M(src);))
FENCED(scale, (float *x, int64_t n, float k), (x, n, k), (M(x);))
FENCED(adamw,
       (float *p, const float *g, float *m, float *v, int64_t n, const ht_adamw_hparams *h, void *model, ht_dtype md,
        bool sr, uint64_t stream),
       (p, g, m, v, n, h, model, md, sr, stream), (M(p); M(g); M(m); M(v); M(model);))
FENCED(muon_momentum, (float *B, const float *g, float *u, int64_t n, float mu, float gw, bool nesterov),
       (B, g, u, n, mu, gw, nesterov), (M(B); M(g); M(u);))
FENCED(muon_apply,
       (float *p, float *O, int64_t n, float decay, float step, void *model, ht_dtype dt, bool sr, uint64_t stream,
        int64_t first),
       (p, O, n, decay, step, model, dt, sr, stream, first), (M(p); M(O); M(model);))
static size_t fenced_ns_workspace_floats(int64_t count, int64_t rows, int64_t cols, ht_dtype dt) {
    return CPU->ns_workspace_floats(count, rows, cols, dt);
}
FENCED(newton_schulz,
       (const float *G, float *O, int64_t count, int64_t rows, int64_t cols, const double (*coeffs)[3], int steps,
        double eps, ht_dtype dt, float *work),
       (G, O, count, rows, cols, coeffs, steps, eps, dt, work), (M(G); M(O); M(work);))

#define E(name) .name = fenced_##name
static const ht_kernel_ops fenced = {
    .name = "fenced",
    .host_memory = false,
    .alloc = fenced_alloc,
    .free = fenced_free,
    .owns = fenced_owns,
    .peak_bytes = fenced_peak_bytes,
    E(zero),
    E(upload),
    E(download),
    E(copy),
    E(synchronize),
    E(gemm),
    E(gemm_ragged),
    E(gemm_batched),
    E(convert),
    E(round_to),
    E(rmsnorm_forward),
    E(rmsnorm_backward),
    E(add_bias),
    E(bias_backward),
    E(rope_forward),
    E(rope_backward),
    E(swiglu_forward),
    E(swiglu_backward),
    E(cross_entropy_forward),
    E(cross_entropy_backward),
    E(softmax_partial),
    E(attention_workspace_floats),
    E(attention_forward),
    E(attention_backward),
    E(attention_merge),
    E(embedding_forward),
    E(embedding_backward),
    E(gather_rows),
    E(scatter_rows),
    E(moe_route),
    E(moe_combine),
    E(moe_combine_backward),
    E(moe_route_backward),
    E(moe_scatter_add),
    E(moe_route_grouped),
    E(moe_route_grouped_backward),
    E(dropout),
    E(sum_squares),
    E(add),
    E(accumulate),
    E(copy_rows),
    E(scale),
    E(adamw),
    E(muon_momentum),
    E(muon_apply),
    E(ns_workspace_floats),
    E(newton_schulz),
};

const ht_kernel_ops *ht_kernels_fenced(void) { return &fenced; }
