/* A group whose collectives also take the memory of a kernel backend the
 * host cannot reach (kernels.backend: fenced, cuda). Each buffer the
 * backend owns is downloaded into host memory before the collective of the
 * group inside and uploaded from it after, so the layers above hand a
 * collective whatever memory they hold. The group inside sums as before,
 * in rank order on the host: the results are the host's bits. */
#include "hypertrain/kernels.h"
#include "comm/comm_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct staged {
    ht_comm base;
    ht_comm *inner;
    bool owns_inner; /* a split's group: freed with this one */
    const ht_kernel_ops *K;
} staged;

/* A started exchange: the one inside, and where its bytes go once it lands. */
typedef struct staged_request {
    ht_request *inner;
    void *host;    /* every staged span's bytes, the sends then the receives */
    ht_span *back; /* (count) the backend's receive spans */
    char **landed; /* (count) where each one's bytes are in host */
    int count;
} staged_request;

static staged *of(ht_comm *c) { return (staged *)c; }

static bool backend_memory(const staged *s, const void *p, int64_t bytes) { return p && bytes > 0 && s->K->owns(p); }

static void fatal(staged *s, const char *what) {
    fprintf(stderr, "[hypertrain error rank %d] staging a collective through host memory: %s\n", s->base.rank, what);
    ht_comm_abort(s->inner, 1);
    abort();
}

/* A host buffer for `bytes` of p: p itself where it is host memory, else a
 * copy (downloaded when `fill`). */
static void *stage(staged *s, const void *p, int64_t bytes, bool fill) {
    if (!backend_memory(s, p, bytes)) return (void *)p;
    void *h = malloc((size_t)bytes);
    if (!h) fatal(s, "out of host memory");
    if (fill) s->K->download(h, p, (size_t)bytes);
    return h;
}

/* Ends a staging: the host copy h of p uploaded back (when `back`), then freed. */
static void unstage(staged *s, void *p, void *h, int64_t bytes, bool back) {
    if (h == p) return;
    if (back && bytes > 0) s->K->upload(p, h, (size_t)bytes);
    free(h);
}

/* A group of one's all-gather, gather, scatter or reduce-scatter: its send
 * is its receive. dst = src where each lies, with no wait on the host where
 * both are the backend's (a Muon matrix's rows gathered on one device, say);
 * host memory goes through upload or download as a staging would. */
static void copy_alone(staged *s, void *dst, const void *src, int64_t bytes) {
    if (bytes <= 0 || dst == src) return;
    const bool from = backend_memory(s, src, bytes), to = backend_memory(s, dst, bytes);
    if (from && to)
        s->K->copy(dst, src, (size_t)bytes);
    else if (from)
        s->K->download(dst, src, (size_t)bytes);
    else if (to)
        s->K->upload(dst, src, (size_t)bytes);
    else
        memmove(dst, src, (size_t)bytes);
}

static int64_t total(const int64_t *n, int P) {
    int64_t t = 0;
    for (int r = 0; r < P; r++) t += n[r];
    return t;
}

/* A group of one leaves an all-reduce's or a broadcast's data as it is: nothing staged. */
static void staged_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    staged *s = of(c);
    if (c->size == 1) return;
    double *h = stage(s, buf, n * 8, true);
    ht_all_reduce_f64(s->inner, h, n, op);
    unstage(s, buf, h, n * 8, true);
}

static void staged_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    staged *s = of(c);
    if (c->size == 1) return;
    float *h = stage(s, buf, n * 4, true);
    ht_all_reduce_f32(s->inner, h, n, op);
    unstage(s, buf, h, n * 4, true);
}

static void staged_reduce_scatter_f32(ht_comm *c, const float *send, float *recv, const int64_t *counts) {
    staged *s = of(c);
    const int64_t all = total(counts, c->size) * 4, mine = counts[c->rank] * 4;
    if (c->size == 1) {
        copy_alone(s, recv, send, mine);
        return;
    }
    float *hs = stage(s, send, all, true), *hr = stage(s, recv, mine, false);
    ht_reduce_scatter_f32(s->inner, hs, hr, counts);
    unstage(s, (void *)send, hs, all, false);
    unstage(s, recv, hr, mine, true);
}

static void staged_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    staged *s = of(c);
    if (c->size == 1) return;
    void *h = stage(s, buf, bytes, c->rank == root);
    ht_broadcast(s->inner, h, bytes, root);
    unstage(s, buf, h, bytes, c->rank != root);
}

static void staged_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    staged *s = of(c);
    const int64_t all = total(bytes, c->size), mine = bytes[c->rank];
    if (c->size == 1) {
        copy_alone(s, recv, send, mine);
        return;
    }
    void *hs = stage(s, send, mine, true), *hr = stage(s, recv, all, false);
    ht_all_gather(s->inner, hs, hr, bytes);
    unstage(s, (void *)send, hs, mine, false);
    unstage(s, recv, hr, all, true);
}

static void staged_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    staged *s = of(c);
    const int64_t all = c->rank == root ? total(bytes, c->size) : 0, mine = bytes[c->rank];
    if (c->size == 1) {
        copy_alone(s, recv, send, mine);
        return;
    }
    void *hs = stage(s, send, mine, true), *hr = stage(s, recv, all, false);
    ht_gather(s->inner, hs, hr, bytes, root);
    unstage(s, (void *)send, hs, mine, false);
    unstage(s, recv, hr, all, true);
}

static void staged_scatter(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    staged *s = of(c);
    const int64_t all = c->rank == root ? total(bytes, c->size) : 0, mine = bytes[c->rank];
    if (c->size == 1) {
        copy_alone(s, recv, send, mine);
        return;
    }
    void *hs = stage(s, send, all, true), *hr = stage(s, recv, mine, false);
    ht_scatter(s->inner, hs, hr, bytes, root);
    unstage(s, (void *)send, hs, all, false);
    unstage(s, recv, hr, mine, true);
}

static void staged_barrier(ht_comm *c) { ht_barrier(of(c)->inner); }

static void staged_wait(ht_comm *c, ht_request *r, double *seconds) {
    staged *s = of(c);
    staged_request *q = (staged_request *)(void *)r;
    if (seconds) *seconds = 0.0;
    if (!q) return;
    ht_wait(s->inner, q->inner, seconds);
    for (int i = 0; i < q->count; i++) s->K->upload(q->back[i].addr, q->landed[i], (size_t)q->back[i].bytes);
    free(q->host);
    free(q->back);
    free(q->landed);
    free(q);
}

/* The spans of the backend's memory (sends downloaded now, receives
 * uploaded at the wait) point into one host buffer; the rest go as they are. */
static ht_request *staged_start_exchange(ht_comm *c, const ht_spans *send, const ht_spans *recv) {
    staged *s = of(c);
    const int P = c->size, s0 = send->first[0], ns = send->first[P] - s0, r0 = recv->first[0], nr = recv->first[P] - r0;
    staged_request *q = calloc(1, sizeof(*q));
    ht_span *spans = malloc((size_t)(ns + nr + 1) * sizeof(ht_span));
    int *first = malloc((size_t)(2 * (P + 1)) * sizeof(int));
    if (q) q->back = malloc((size_t)(nr + 1) * sizeof(ht_span));
    if (q) q->landed = malloc((size_t)(nr + 1) * sizeof(char *));
    if (!q || !spans || !first || !q->back || !q->landed) fatal(s, "out of host memory");
    int64_t bytes = 0;
    for (int i = 0; i < ns + nr; i++) {
        const ht_span *sp = i < ns ? &send->spans[s0 + i] : &recv->spans[r0 + i - ns];
        if (backend_memory(s, sp->addr, sp->bytes)) bytes += sp->bytes;
    }
    q->host = malloc((size_t)bytes + 1);
    if (!q->host) fatal(s, "out of host memory");
    char *at = q->host;
    for (int i = 0; i < ns + nr; i++) {
        const ht_span *sp = i < ns ? &send->spans[s0 + i] : &recv->spans[r0 + i - ns];
        spans[i] = *sp;
        if (!backend_memory(s, sp->addr, sp->bytes)) continue;
        spans[i].addr = at;
        if (i < ns) {
            s->K->download(at, sp->addr, (size_t)sp->bytes);
        } else {
            q->back[q->count] = *sp;
            q->landed[q->count++] = at;
        }
        at += sp->bytes;
    }
    for (int r = 0; r <= P; r++) first[r] = send->first[r] - s0, first[P + 1 + r] = ns + recv->first[r] - r0;
    const ht_spans hs = {spans, first}, hr = {spans, first + P + 1};
    q->inner = ht_start_exchange(s->inner, &hs, &hr); /* the span lists may go once it is started */
    free(spans);
    free(first);
    if (q->inner) return (ht_request *)(void *)q;
    staged_wait(c, (ht_request *)(void *)q, NULL); /* complete already (a group of one): nothing to wait for */
    return NULL;
}

static ht_status staged_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err) {
    staged *s = of(c);
    ht_comm *sub;
    ht_status st = ht_comm_split(s->inner, color, key, &sub, err);
    if (st != HT_OK) return st;
    st = ht_comm_staged(sub, s->K, true, out, err);
    if (st != HT_OK) ht_comm_free(sub);
    return st;
}

static void staged_abort(ht_comm *c, int code) { ht_comm_abort(of(c)->inner, code); }

static void staged_free(ht_comm *c) {
    staged *s = of(c);
    if (s->owns_inner) ht_comm_free(s->inner);
    free(s);
}

static const ht_comm_ops staged_ops = {
    .all_reduce_f64 = staged_all_reduce_f64,
    .all_reduce_f32 = staged_all_reduce_f32,
    .reduce_scatter_f32 = staged_reduce_scatter_f32,
    .broadcast = staged_broadcast,
    .all_gather = staged_all_gather,
    .gather = staged_gather,
    .scatter = staged_scatter,
    .barrier = staged_barrier,
    .start_exchange = staged_start_exchange,
    .wait = staged_wait,
    .split = staged_split,
    .abort = staged_abort,
    .free = staged_free,
};

ht_status ht_comm_staged(ht_comm *inner, const struct ht_kernel_ops *K, bool owns_inner, ht_comm **out, ht_error *err) {
    staged *s = calloc(1, sizeof(*s));
    if (!s) return ht_fail(err, HT_ERR_OOM, "cannot allocate a staged group");
    s->base = (ht_comm){.ops = &staged_ops,
                        .rank = inner->rank,
                        .size = inner->size,
                        .local_size = inner->local_size,
                        .name = inner->name};
    s->inner = inner;
    s->owns_inner = owns_inner;
    s->K = K;
    *out = &s->base;
    return HT_OK;
}
