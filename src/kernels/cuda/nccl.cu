/* The CUDA backend's process group: the collectives of device memory over
 * NCCL, GPU to GPU, on the backend's stream (so in order with its kernels);
 * anything else (host buffers, a mix of both, double sums) goes to the group
 * inside, a staged group over MPI. Sums keep the CPU's rank order: NCCL's
 * own reductions promise no order, so a sum is an exchange of slices
 * (grouped sends and receives) and each owner adds them in rank order with
 * the backend's accumulate, the additions of the host's loop; maxima and
 * broadcasts, exact in any order, are NCCL's own. NCCL is opened at run
 * time (libnccl.so.2), so a build needs only its header. */
#include "kernels/cuda/cuda.cuh"
#include "hypertrain/comm.h"

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

static cudaStream_t stream(void) { return cuda_ctx()->stream; }

static bool on_device(const void *p) { return ht_kernels_cuda(NULL)->owns(p); }

/* Every buffer of a collective given (NULL or empty ones aside) is the device's. */
static bool all_device(const void *const *p, const int64_t *bytes, int n) {
    for (int i = 0; i < n; i++)
        if (p[i] && bytes[i] > 0 && !on_device(p[i])) return false;
    return true;
}

static char *scratch(nccl_group *g, size_t bytes) {
    if (bytes > g->scratch_bytes) {
        if (g->scratch) check_cuda(g, cudaFree(g->scratch), "cudaFree"); /* waits for what still reads it */
        g->scratch = NULL;
        check_cuda(g, cudaMalloc(&g->scratch, bytes), "cudaMalloc (collective scratch)");
        g->scratch_bytes = bytes;
    }
    return (char *)g->scratch;
}

static void copy(nccl_group *g, void *dst, const void *src, int64_t bytes) {
    if (bytes > 0 && dst != src)
        check_cuda(g, cudaMemcpyAsync(dst, src, (size_t)bytes, cudaMemcpyDeviceToDevice, stream()), "cudaMemcpyAsync");
}

/* One grouped round of point-to-point bytes: to[r] (send_bytes[r]) to rank
 * r and from[r] (recv_bytes[r]) from it; this rank's own pair is a copy. */
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

/* out (n) = slices[0] + slices[1] + ... in rank order (P slices of n floats, side by side). */
static void sum_in_order(float *out, const float *slices, int64_t n, int P) {
    const ht_kernel_ops *K = ht_kernels_cuda(NULL);
    K->copy(out, slices, (size_t)n * sizeof(float));
    for (int r = 1; r < P; r++) K->accumulate(out, slices + r * n, n);
}

/* The reduce-scatter every sum here is: rank q's slice of send (counts[q]
 * floats, the slices side by side) to rank q, which adds them in rank order
 * into recv. The stream runs the sends before the sum: recv may lie in send. */
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
    if (mine > 0) sum_in_order(recv, slices, mine, P);
}

static void all_gather_bytes(nccl_group *g, const void *send, void *recv, const int64_t *bytes) {
    int64_t at = 0;
    for (int r = 0; r < g->base.size; r++) {
        g->to[r] = send, g->sb[r] = bytes[g->base.rank];
        g->from[r] = (char *)recv + at, at += bytes[r];
    }
    sendrecv(g, g->to, g->sb, g->from, bytes);
}

static void nccl_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    nccl_group *g = of(c);
    const void *p[] = {buf};
    const int64_t b[] = {n * 4};
    if (c->size == 1) return;
    if (!all_device(p, b, 1) || n == 0) return ht_all_reduce_f32(g->inner, buf, n, op);
    if (op == HT_REDUCE_MAX) {
        check(g, nccl.AllReduce(buf, buf, (size_t)n, ncclFloat32, ncclMax, g->comm, stream()), "ncclAllReduce");
        return;
    }
    /* slices [n·r/P, n·(r+1)/P): each summed by its rank, then gathered */
    const int P = c->size, me = c->rank;
    for (int r = 0; r < P; r++) g->counts[r] = n * (r + 1) / P - n * r / P, g->bytes[r] = g->counts[r] * 4;
    float *sum = buf + n * me / P;
    reduce_scatter(g, buf, sum, g->counts); /* written after its sends, in stream order */
    all_gather_bytes(g, sum, buf, g->bytes);
}

static void nccl_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    nccl_group *g = of(c);
    const void *p[] = {buf};
    const int64_t b[] = {n * 8};
    if (c->size == 1) return;
    if (op == HT_REDUCE_MAX && n > 0 && all_device(p, b, 1)) {
        check(g, nccl.AllReduce(buf, buf, (size_t)n, ncclFloat64, ncclMax, g->comm, stream()), "ncclAllReduce");
        return;
    }
    ht_all_reduce_f64(g->inner, buf, n, op); /* sums of doubles: the host's, in rank order (staged) */
}

static void nccl_reduce_scatter_f32(ht_comm *c, const float *send, float *recv, const int64_t *counts) {
    nccl_group *g = of(c);
    int64_t all = 0;
    for (int r = 0; r < c->size; r++) all += counts[r];
    const void *p[] = {send, recv};
    const int64_t b[] = {all * 4, counts[c->rank] * 4};
    if (!all_device(p, b, 2)) return ht_reduce_scatter_f32(g->inner, send, recv, counts);
    reduce_scatter(g, send, recv, counts); /* recv (a part of send, it may be) written after the sends */
}

static void nccl_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    nccl_group *g = of(c);
    const void *p[] = {buf};
    if (c->size == 1) return;
    if (!all_device(p, &bytes, 1) || bytes == 0) return ht_broadcast(g->inner, buf, bytes, root);
    check(g, nccl.Broadcast(buf, buf, (size_t)bytes, ncclUint8, root, g->comm, stream()), "ncclBroadcast");
}

static int64_t total(const int64_t *n, int P) {
    int64_t t = 0;
    for (int r = 0; r < P; r++) t += n[r];
    return t;
}

static void nccl_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    nccl_group *g = of(c);
    const void *p[] = {send, recv};
    const int64_t b[] = {bytes[c->rank], total(bytes, c->size)};
    if (!all_device(p, b, 2)) return ht_all_gather(g->inner, send, recv, bytes);
    all_gather_bytes(g, send, recv, bytes);
}

static void nccl_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    nccl_group *g = of(c);
    const int P = c->size, me = c->rank;
    const void *p[] = {send, recv};
    const int64_t b[] = {bytes[me], me == root ? total(bytes, P) : 0};
    if (!all_device(p, b, 2)) return ht_gather(g->inner, send, recv, bytes, root);
    int64_t at = 0;
    for (int r = 0; r < P; r++) {
        g->to[r] = send, g->sb[r] = r == root ? bytes[me] : 0;
        g->from[r] = me == root ? (char *)recv + at : NULL, g->rb[r] = me == root ? bytes[r] : 0;
        at += bytes[r];
    }
    sendrecv(g, g->to, g->sb, g->from, g->rb);
}

static void nccl_scatter(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    nccl_group *g = of(c);
    const int P = c->size, me = c->rank;
    const void *p[] = {send, recv};
    const int64_t b[] = {me == root ? total(bytes, P) : 0, bytes[me]};
    if (!all_device(p, b, 2)) return ht_scatter(g->inner, send, recv, bytes, root);
    int64_t at = 0;
    for (int r = 0; r < P; r++) {
        g->to[r] = me == root ? (const char *)send + at : NULL, g->sb[r] = me == root ? bytes[r] : 0;
        g->from[r] = recv, g->rb[r] = r == root ? bytes[me] : 0;
        at += bytes[r];
    }
    sendrecv(g, g->to, g->sb, g->from, g->rb);
}

static void nccl_barrier(ht_comm *c) { ht_barrier(of(c)->inner); }

/* An exchange of the device's memory: each peer's spans packed into one
 * block of scratch (where they are more than one), one send and one
 * receive a peer, the received blocks unpacked into the spans. It is queued
 * on the stream and complete, for the kernels after it, when start returns:
 * there is nothing to wait for. Spans of host memory go to the inner group. */
static ht_request *nccl_start_exchange(ht_comm *c, const ht_spans *send, const ht_spans *recv) {
    nccl_group *g = of(c);
    const int P = c->size;
    for (int side = 0; side < 2; side++) {
        const ht_spans *sp = side ? recv : send;
        for (int i = sp->first[0]; i < sp->first[P]; i++)
            if (sp->spans[i].bytes > 0 && !on_device(sp->spans[i].addr)) {
                ht_wait(g->inner, ht_start_exchange(g->inner, send, recv), NULL);
                return NULL;
            }
    }
    int64_t *sb = g->sb, *rb = g->rb, packed = 0;
    for (int r = 0; r < P; r++) {
        sb[r] = rb[r] = 0;
        for (int i = send->first[r]; i < send->first[r + 1]; i++) sb[r] += send->spans[i].bytes;
        for (int i = recv->first[r]; i < recv->first[r + 1]; i++) rb[r] += recv->spans[i].bytes;
        if (send->first[r + 1] - send->first[r] > 1) packed += (sb[r] + 255) / 256 * 256;
        if (recv->first[r + 1] - recv->first[r] > 1) packed += (rb[r] + 255) / 256 * 256;
    }
    char *at = packed ? scratch(g, (size_t)packed) : NULL;
    const void **to = g->to;
    void **from = g->from;
    for (int r = 0; r < P; r++) {
        const int s0 = send->first[r], s1 = send->first[r + 1], r0 = recv->first[r], r1 = recv->first[r + 1];
        to[r] = s1 - s0 == 1 ? send->spans[s0].addr : at;
        for (int64_t off = 0, i = s0; s1 - s0 > 1 && i < s1; off += send->spans[i].bytes, i++)
            copy(g, at + off, send->spans[i].addr, send->spans[i].bytes);
        if (s1 - s0 > 1) at += (sb[r] + 255) / 256 * 256;
        from[r] = r1 - r0 == 1 ? recv->spans[r0].addr : at;
        if (r1 - r0 > 1) at += (rb[r] + 255) / 256 * 256;
    }
    sendrecv(g, to, sb, from, rb);
    for (int r = 0; r < P; r++) {
        const int r0 = recv->first[r], r1 = recv->first[r + 1];
        for (int64_t off = 0, i = r0; r1 - r0 > 1 && i < r1; off += recv->spans[i].bytes, i++)
            copy(g, recv->spans[i].addr, (char *)from[r] + off, recv->spans[i].bytes);
    }
    return NULL;
}

static void nccl_wait(ht_comm *c, ht_request *r, double *seconds) { ht_wait(of(c)->inner, r, seconds); }

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
    g->base = ht_comm{&nccl_ops, inner->rank, inner->size, inner->local_size, "NCCL", NULL};
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
