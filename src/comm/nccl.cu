/* The CUDA backend's process group: the collectives of device memory over
 * NCCL, GPU to GPU, on the backend's stream (so in order with its
 * kernels), over a group inside (a staged group over MPI). Sums keep the
 * CPU's rank order: NCCL's own reductions promise no order, so a sum is an
 * exchange of slices (grouped sends and receives) and each owner adds them
 * in rank order with the backend's accumulate, the additions of the host's
 * loop; maxima and broadcasts, exact in any order, are NCCL's own. Every
 * collective takes this path, host buffers through device blocks, so that
 * the ranks never part ways; only the barrier, the bootstrap and splits use
 * the group inside. NCCL is opened at run time (libnccl.so.2), so a build
 * needs only its header. */
#include "hypertrain/comm.h"
#include "hypertrain/kernels.h"

#include <cuda_runtime.h>

#include <dlfcn.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- NCCL, opened once */

static struct {
    bool tried, ready;
    char why_not[256];
    ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
    ncclResult_t (*CommInitRank)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
    ncclResult_t (*CommDestroy)(ncclComm_t comm);
    ncclResult_t (*CommAbort)(ncclComm_t comm);
    const char *(*GetErrorString)(ncclResult_t r);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    ncclResult_t (*Send)(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                         cudaStream_t stream);
    ncclResult_t (*Recv)(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*AllReduce)(const void *send, void *recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                              ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*Broadcast)(const void *send, void *recv, size_t count, ncclDataType_t type, int root,
                              ncclComm_t comm, cudaStream_t stream);
} nccl;

#define NCCL_FUNCTIONS(X)                                                                                              \
    X(GetUniqueId)                                                                                                     \
    X(CommInitRank)                                                                                                    \
    X(CommDestroy) X(CommAbort) X(GetErrorString) X(GroupStart) X(GroupEnd) X(Send) X(Recv) X(AllReduce) X(Broadcast)

static bool nccl_open(ht_error *err) {
    if (!nccl.tried) {
        nccl.tried = true;
        void *lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
        if (!lib) lib = dlopen("libnccl.so", RTLD_NOW | RTLD_GLOBAL);
        if (!lib) {
            snprintf(nccl.why_not, sizeof(nccl.why_not), "cannot open libnccl.so.2: %s", dlerror());
        } else {
            nccl.ready = true;
#define LOAD(name)                                                                                                     \
    if (nccl.ready && !(*(void **)&nccl.name = dlsym(lib, "nccl" #name))) {                                            \
        snprintf(nccl.why_not, sizeof(nccl.why_not), "libnccl.so.2 has no nccl" #name);                                \
        nccl.ready = false;                                                                                            \
    }
            NCCL_FUNCTIONS(LOAD)
#undef LOAD
        }
    }
    if (!nccl.ready) ht_fail(err, HT_ERR_INVALID, "%s", nccl.why_not);
    return nccl.ready;
}

/* ---------------------------------------------------------------- the group */

typedef struct nccl_group {
    ht_comm base;
    ht_comm *inner; /* host memory and the bootstrap: a staged group over MPI */
    bool owns_inner;
    ncclComm_t comm; /* NULL in a group of one: everything is a copy */
    void *scratch;   /* device: slices to sum, packed sends and receives */
    size_t scratch_bytes;
    /* (size) each: one round's buffers and bytes per peer, and a sum's slices */
    const void **to;
    void **from;
    int64_t *sb, *rb, *counts, *bytes;
} nccl_group;

static nccl_group *of(ht_comm *c) { return (nccl_group *)c; }

static void fatal(nccl_group *g, const char *what, const char *detail) {
    fprintf(stderr, "[hypertrain error rank %d] NCCL: %s: %s\n", g->base.rank, what, detail);
    if (g->comm) nccl.CommAbort(g->comm);
    ht_comm_abort(g->inner, 1);
    abort();
}

static void check(nccl_group *g, ncclResult_t r, const char *what) {
    if (r != ncclSuccess) fatal(g, what, nccl.GetErrorString(r));
}

static void check_cuda(nccl_group *g, cudaError_t e, const char *what) {
    if (e != cudaSuccess) fatal(g, what, cudaGetErrorString(e));
}

static cudaStream_t stream(void) { return (cudaStream_t)ht_kernels_cuda_current_stream(); }
static const ht_kernel_ops *kernels(void) { return ht_kernels_cuda(NULL); }

static char *scratch(nccl_group *g, size_t bytes) {
    if (bytes > g->scratch_bytes) {
        if (g->scratch) check_cuda(g, cudaFree(g->scratch), "cudaFree"); /* waits for what still reads it */
        g->scratch = NULL;
        check_cuda(g, cudaMalloc(&g->scratch, bytes), "cudaMalloc (collective scratch)");
        g->scratch_bytes = bytes;
    }
    return (char *)g->scratch;
}

/* Bytes between any two of the device's and the host's memory, in stream
 * order (to pageable host memory it returns once they are there). */
static void copy(nccl_group *g, void *dst, const void *src, int64_t bytes) {
    if (bytes > 0 && dst != src)
        check_cuda(g, cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDefault, stream()), "cudaMemcpyAsync");
}

/* Every collective of the group goes over NCCL, whatever memory a rank
 * hands it (the ranks must take the same path, and a rank's buffers may be
 * empty or the host's where another's are the device's): a host buffer
 * passes through a device block of its own, uploaded before, downloaded
 * after. */
typedef struct view {
    void *host; /* the caller's host buffer, or NULL: p was the device's */
    void *dev;
    int64_t bytes;
} view;

static void *view_in(nccl_group *g, view *v, const void *p, int64_t bytes, bool upload) {
    *v = view{NULL, (void *)p, bytes};
    if (!p || bytes <= 0 || kernels()->owns(p)) return v->dev;
    if (!(v->dev = kernels()->alloc((size_t)bytes))) fatal(g, "staging host memory", "out of device memory");
    v->host = (void *)p;
    if (upload) kernels()->upload(v->dev, p, (size_t)bytes);
    return v->dev;
}

static void view_out(view *v, bool download) {
    if (!v->host) return;
    if (download) kernels()->download(v->host, v->dev, (size_t)v->bytes);
    kernels()->free(v->dev);
}

/* One grouped round of point-to-point bytes on the device: to[r]
 * (send_bytes[r]) to rank r and from[r] (recv_bytes[r]) from it, each
 * pair's counts agreeing between the two ranks; this rank's own is a copy. */
static void sendrecv(nccl_group *g, const void *const *to, const int64_t *send_bytes, void *const *from,
                     const int64_t *recv_bytes) {
    const int P = g->base.size, me = g->base.rank;
    if (recv_bytes[me] > 0) copy(g, from[me], to[me], recv_bytes[me]);
    if (P == 1) return;
    check(g, nccl.GroupStart(), "ncclGroupStart");
    for (int r = 0; r < P; r++) {
        if (r == me) continue;
        if (send_bytes[r] > 0)
            check(g, nccl.Send(to[r], (size_t)send_bytes[r], ncclUint8, r, g->comm, stream()), "ncclSend");
        if (recv_bytes[r] > 0)
            check(g, nccl.Recv(from[r], (size_t)recv_bytes[r], ncclUint8, r, g->comm, stream()), "ncclRecv");
    }
    check(g, nccl.GroupEnd(), "ncclGroupEnd");
}

/* The reduce-scatter every float sum here is: rank q's slice of send
 * (counts[q] floats, side by side) to rank q, which adds them in rank order
 * into recv with the backend's copy and accumulate, the host loop's
 * additions. The stream runs the sends before the sum: recv may lie in send. */
static void reduce_scatter(nccl_group *g, const float *send, float *recv, const int64_t *counts) {
    const int P = g->base.size, me = g->base.rank;
    const int64_t mine = counts[me];
    float *slices = (float *)scratch(g, (size_t)(P * mine + 1) * sizeof(float));
    int64_t at = 0;
    for (int r = 0; r < P; r++) {
        g->to[r] = send + at, g->sb[r] = counts[r] * 4, at += counts[r];
        g->from[r] = slices + r * mine, g->rb[r] = mine * 4;
    }
    sendrecv(g, g->to, g->sb, g->from, g->rb);
    if (mine == 0) return;
    kernels()->copy(recv, slices, (size_t)mine * sizeof(float));
    for (int r = 1; r < P; r++) kernels()->accumulate(recv, slices + r * mine, mine);
}

static void all_gather_bytes(nccl_group *g, const void *send, void *recv, const int64_t *bytes) {
    int64_t at = 0;
    for (int r = 0; r < g->base.size; r++) {
        g->to[r] = send, g->sb[r] = bytes[g->base.rank];
        g->from[r] = (char *)recv + at, at += bytes[r];
    }
    sendrecv(g, g->to, g->sb, g->from, bytes);
}

static int64_t total(const int64_t *n, int P) {
    int64_t t = 0;
    for (int r = 0; r < P; r++) t += n[r];
    return t;
}

static void nccl_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    nccl_group *g = of(c);
    if (c->size == 1 || n == 0) return;
    view v;
    float *d = (float *)view_in(g, &v, buf, n * 4, true);
    if (op == HT_REDUCE_MAX) { /* exact in any order */
        check(g, nccl.AllReduce(d, d, (size_t)n, ncclFloat32, ncclMax, g->comm, stream()), "ncclAllReduce");
    } else { /* slices [n·r/P, n·(r+1)/P): each summed by its rank, then gathered */
        const int P = c->size, me = c->rank;
        for (int r = 0; r < P; r++) g->counts[r] = n * (r + 1) / P - n * r / P, g->bytes[r] = g->counts[r] * 4;
        float *sum = d + n * me / P;
        reduce_scatter(g, d, sum, g->counts);
        all_gather_bytes(g, sum, d, g->bytes);
    }
    view_out(&v, true);
}

/* Doubles (the losses' and counts' sums, a few values): every rank's values
 * to every rank, each element then summed in rank order on the host. */
static void nccl_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    nccl_group *g = of(c);
    if (c->size == 1 || n == 0) return;
    const int P = c->size;
    view v;
    double *d = (double *)view_in(g, &v, buf, n * 8, true);
    if (op == HT_REDUCE_MAX) {
        check(g, nccl.AllReduce(d, d, (size_t)n, ncclFloat64, ncclMax, g->comm, stream()), "ncclAllReduce");
        view_out(&v, true);
        return;
    }
    double *every = (double *)malloc((size_t)(P * n) * sizeof(double)), *sums = (double *)malloc((size_t)n * 8);
    char *all = scratch(g, (size_t)(P * n) * sizeof(double));
    if (!every || !sums) fatal(g, "a sum of doubles", "out of host memory");
    for (int r = 0; r < P; r++) g->bytes[r] = n * 8;
    all_gather_bytes(g, d, all, g->bytes);
    kernels()->download(every, all, (size_t)(P * n) * sizeof(double));
    for (int64_t i = 0; i < n; i++) {
        double x = every[i];
        for (int r = 1; r < P; r++) x += every[r * n + i];
        sums[i] = x;
    }
    kernels()->upload(d, sums, (size_t)n * 8);
    view_out(&v, true);
    free(every);
    free(sums);
}

static void nccl_reduce_scatter_f32(ht_comm *c, const float *send, float *recv, const int64_t *counts) {
    nccl_group *g = of(c);
    const int64_t all = total(counts, c->size), mine = counts[c->rank];
    view vs, vr;
    const float *ds = (const float *)view_in(g, &vs, send, all * 4, true);
    float *dr = (float *)view_in(g, &vr, recv, mine * 4, false);
    reduce_scatter(g, ds, dr, counts);
    view_out(&vr, true);
    view_out(&vs, false);
}

static void nccl_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    nccl_group *g = of(c);
    if (c->size == 1 || bytes == 0) return;
    view v;
    void *d = view_in(g, &v, buf, bytes, c->rank == root);
    check(g, nccl.Broadcast(d, d, (size_t)bytes, ncclUint8, root, g->comm, stream()), "ncclBroadcast");
    view_out(&v, c->rank != root);
}

static void nccl_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    nccl_group *g = of(c);
    const int64_t all = total(bytes, c->size), mine = bytes[c->rank];
    view vs, vr;
    const void *ds = view_in(g, &vs, send, mine, true);
    void *dr = view_in(g, &vr, recv, all, false);
    all_gather_bytes(g, ds, dr, bytes);
    view_out(&vr, true);
    view_out(&vs, false);
}

static void nccl_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    nccl_group *g = of(c);
    const int P = c->size, me = c->rank;
    view vs, vr;
    const void *ds = view_in(g, &vs, send, bytes[me], true);
    void *dr = view_in(g, &vr, recv, me == root ? total(bytes, P) : 0, false);
    int64_t at = 0;
    for (int r = 0; r < P; r++) {
        g->to[r] = ds, g->sb[r] = r == root ? bytes[me] : 0;
        g->from[r] = me == root ? (char *)dr + at : NULL, g->rb[r] = me == root ? bytes[r] : 0;
        at += bytes[r];
    }
    sendrecv(g, g->to, g->sb, g->from, g->rb);
    view_out(&vr, true);
    view_out(&vs, false);
}

static void nccl_scatter(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    nccl_group *g = of(c);
    const int P = c->size, me = c->rank;
    view vs, vr;
    const void *ds = view_in(g, &vs, send, me == root ? total(bytes, P) : 0, true);
    void *dr = view_in(g, &vr, recv, bytes[me], false);
    int64_t at = 0;
    for (int r = 0; r < P; r++) {
        g->to[r] = me == root ? (const char *)ds + at : NULL, g->sb[r] = me == root ? bytes[r] : 0;
        g->from[r] = dr, g->rb[r] = r == root ? bytes[me] : 0;
        at += bytes[r];
    }
    sendrecv(g, g->to, g->sb, g->from, g->rb);
    view_out(&vr, true);
    view_out(&vs, false);
}

/* The host's barrier, once this rank's queued collectives are done. */
static void nccl_barrier(ht_comm *c) {
    check_cuda(of(c), cudaStreamSynchronize(stream()), "cudaStreamSynchronize");
    ht_barrier(of(c)->inner);
}

/* A peer's spans go as they are where they are one span of the device's
 * memory; otherwise they are packed into one block of scratch (host spans
 * too, copied in and out). One send and one receive a peer. The exchange is
 * queued on the stream and complete, for the kernels after it, when start
 * returns (host spans are filled by then): there is nothing to wait for. */
static bool direct(const ht_spans *sp, int r) {
    return sp->first[r + 1] - sp->first[r] == 1 && kernels()->owns(sp->spans[sp->first[r]].addr);
}

static ht_request *nccl_start_exchange(ht_comm *c, const ht_spans *send, const ht_spans *recv) {
    nccl_group *g = of(c);
    const int P = c->size;
    int64_t *sb = g->sb, *rb = g->rb, packed = 0;
    for (int r = 0; r < P; r++) {
        sb[r] = rb[r] = 0;
        for (int i = send->first[r]; i < send->first[r + 1]; i++) sb[r] += send->spans[i].bytes;
        for (int i = recv->first[r]; i < recv->first[r + 1]; i++) rb[r] += recv->spans[i].bytes;
        if (!direct(send, r)) packed += (sb[r] + 255) / 256 * 256;
        if (!direct(recv, r)) packed += (rb[r] + 255) / 256 * 256;
    }
    char *at = scratch(g, (size_t)packed + 256);
    const void **to = g->to;
    void **from = g->from;
    for (int r = 0; r < P; r++) {
        const int s0 = send->first[r], s1 = send->first[r + 1], r0 = recv->first[r];
        to[r] = direct(send, r) ? send->spans[s0].addr : at;
        for (int64_t off = 0, i = s0; !direct(send, r) && i < s1; off += send->spans[i].bytes, i++)
            copy(g, at + off, send->spans[i].addr, send->spans[i].bytes);
        if (!direct(send, r)) at += (sb[r] + 255) / 256 * 256;
        from[r] = direct(recv, r) ? recv->spans[r0].addr : at;
        if (!direct(recv, r)) at += (rb[r] + 255) / 256 * 256;
    }
    sendrecv(g, to, sb, from, rb);
    for (int r = 0; r < P; r++) {
        const int r0 = recv->first[r], r1 = recv->first[r + 1];
        for (int64_t off = 0, i = r0; !direct(recv, r) && i < r1; off += recv->spans[i].bytes, i++)
            copy(g, recv->spans[i].addr, (char *)from[r] + off, recv->spans[i].bytes);
    }
    return NULL;
}

static void nccl_wait(ht_comm *c, ht_request *r, double *seconds) {
    (void)c, (void)r;
    if (seconds) *seconds = 0.0;
}

static ht_status nccl_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err) {
    ht_comm *sub;
    ht_status s = ht_comm_split(of(c)->inner, color, key, &sub, err);
    if (s == HT_OK && (s = ht_comm_nccl(sub, true, out, err)) != HT_OK) ht_comm_free(sub);
    return s;
}

static void nccl_abort(ht_comm *c, int code) {
    nccl_group *g = of(c);
    if (g->comm) nccl.CommAbort(g->comm);
    ht_comm_abort(g->inner, code);
}

static void group_free(nccl_group *g) {
    free(g->to);
    free(g->from);
    free(g->sb);
    free(g);
}

static void nccl_free(ht_comm *c) {
    nccl_group *g = of(c);
    cudaStreamSynchronize(stream());
    if (g->comm) nccl.CommDestroy(g->comm);
    if (g->scratch) cudaFree(g->scratch);
    if (g->owns_inner) ht_comm_free(g->inner);
    group_free(g);
}

static const ht_comm_ops nccl_ops = {
    nccl_all_reduce_f64, nccl_all_reduce_f32, nccl_reduce_scatter_f32, nccl_broadcast, nccl_all_gather, nccl_gather,
    nccl_scatter,        nccl_barrier,        nccl_start_exchange,     nccl_wait,      nccl_split,      nccl_abort,
    nccl_free,
    nullptr, /* point to point: pipeline parallelism is refused on this backend */
    nullptr,
};

extern "C" ht_status ht_comm_nccl(ht_comm *inner, bool owns_inner, ht_comm **out, ht_error *err) {
    /* every rank of inner calls it: all go on, or all fail */
    ht_error here;
    memset(&here, 0, sizeof(here));
    bool ok = ht_kernels_cuda(&here) && nccl_open(&here);
    double failed = ok ? 0.0 : 1.0;
    if (inner->size > 1) ht_all_reduce_f64(inner, &failed, 1, HT_REDUCE_MAX);
    if (ok && failed > 0) ht_fail(&here, HT_ERR_INVALID, "another rank cannot open NCCL");
    if (failed > 0) return ht_fail(err, HT_ERR_INVALID, "%s", here.msg);
    nccl_group *g = (nccl_group *)calloc(1, sizeof(*g));
    if (!g) return ht_fail(err, HT_ERR_OOM, "cannot allocate an NCCL group");
    g->base = ht_comm{&nccl_ops, inner->rank, inner->size, inner->local_size, "NCCL", NULL, 0};
    const size_t P = (size_t)inner->size;
    g->to = (const void **)calloc(P, sizeof(void *));
    g->from = (void **)calloc(P, sizeof(void *));
    g->sb = (int64_t *)calloc(4 * P, sizeof(int64_t));
    if (!g->to || !g->from || !g->sb) {
        group_free(g);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate an NCCL group");
    }
    g->rb = g->sb + P, g->counts = g->sb + 2 * P, g->bytes = g->sb + 3 * P;
    g->inner = inner;
    g->owns_inner = owns_inner;
    if (inner->size > 1) { /* rank 0's id to every rank, over the host */
        ncclUniqueId id;
        memset(&id, 0, sizeof(id));
        ncclResult_t r = inner->rank == 0 ? nccl.GetUniqueId(&id) : ncclSuccess;
        int64_t ok = r == ncclSuccess;
        ht_broadcast(inner, &ok, sizeof(ok), 0);
        if (ok) ht_broadcast(inner, &id, sizeof(id), 0);
        if (ok) r = nccl.CommInitRank(&g->comm, inner->size, id, inner->rank);
        /* every rank learns whether all could join, and all fail together */
        double failed = ok && r == ncclSuccess ? 0.0 : 1.0;
        ht_all_reduce_f64(inner, &failed, 1, HT_REDUCE_MAX);
        if (failed > 0) {
            if (g->comm) nccl.CommDestroy(g->comm);
            group_free(g);
            return ht_fail(err, HT_ERR_INVALID, "NCCL could not join %d ranks: %s", inner->size,
                           r != ncclSuccess ? nccl.GetErrorString(r) : "another rank failed");
        }
    }
    *out = &g->base;
    return HT_OK;
}
