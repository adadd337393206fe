/* The process group (docs/DESIGN.md, Processes): this process's rank among its
 * peers and the collectives the layers above use. One process uses the
 * trivial group, the same code path with nothing to exchange; `mpirun` gives
 * the MPI one. Every collective is called by every rank of the group, in the
 * same order; results are identical on every rank. */
#ifndef HYPERTRAIN_COMM_H
#define HYPERTRAIN_COMM_H

#include "hypertrain/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum ht_reduce_op { HT_REDUCE_SUM = 0, HT_REDUCE_MAX } ht_reduce_op;

typedef struct ht_comm ht_comm;

/* A run of bytes in this process's memory: one piece of what a rank sends or receives. */
typedef struct ht_span {
    void *addr;
    int64_t bytes;
} ht_span;

/* What one rank sends to (or receives from) every rank of a group, without
 * packing: the bytes for rank r are spans[first[r]] .. spans[first[r + 1] - 1]
 * laid end to end. */
typedef struct ht_spans {
    const ht_span *spans;
    const int *first; /* (size + 1) */
} ht_spans;

/* A collective started and not yet waited for. */
typedef struct ht_request ht_request;

/* Sums are taken in rank order, each by one rank or the same way on every
 * rank, so every rank gets the same bits, run after run (MPI's own reductions
 * promise neither). */
typedef struct ht_comm_ops {
    /* buf (n) ← op over the ranks of buf, in place. */
    void (*all_reduce_f64)(ht_comm *c, double *buf, int64_t n, ht_reduce_op op);
    void (*all_reduce_f32)(ht_comm *c, float *buf, int64_t n, ht_reduce_op op);
    /* send holds one slice per rank, counts[r] floats for rank r, in rank
     * order; recv (counts[rank]) ← the sum over ranks of this rank's slice. */
    void (*reduce_scatter_f32)(ht_comm *c, const float *send, float *recv, const int64_t *counts);
    /* buf (bytes) of `root` copied to every rank. */
    void (*broadcast)(ht_comm *c, void *buf, int64_t bytes, int root);
    /* recv ← the concatenation of every rank's send (bytes[r] from rank r), in rank order. */
    void (*all_gather)(ht_comm *c, const void *send, void *recv, const int64_t *bytes);
    /* recv on `root` ← every rank's send (bytes[r] from rank r), in rank order; recv is ignored elsewhere. */
    void (*gather)(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root);
    /* recv (bytes[rank]) on every rank ← its slice of `root`'s send, the slices in rank order. */
    void (*scatter)(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root);
    void (*barrier)(ht_comm *c);
    /* Starts an all-to-all of scattered memory (MPI_Ialltoallw): every rank
     * sends rank r its bytes for r and receives from rank r into its spans
     * for r; the byte counts of each pair agree. The spans' memory must stay
     * untouched until wait returns; the span lists themselves may go at
     * once. Collectives run in the order they were started, blocking ones
     * after every request started before them. */
    ht_request *(*start_exchange)(ht_comm *c, const ht_spans *send, const ht_spans *recv);
    /* Waits for a started request and frees it (NULL: nothing to wait for).
     * *seconds, if not NULL, gets the time it was in flight. */
    void (*wait)(ht_comm *c, ht_request *r, double *seconds);
    /* ht_comm_split and ht_comm_abort of this kind of group. */
    ht_status (*split)(ht_comm *c, int color, int key, ht_comm **out, ht_error *err);
    void (*abort)(ht_comm *c, int code);
    void (*free)(ht_comm *c);
    /* Point to point (pipeline parallelism's activations and gradients):
     * starts sending `bytes` at buf to rank `to` of c, or receiving them
     * from rank `from`, a message matched by its `tag` (two messages of one
     * tag between one pair arrive in the order started); buf stays
     * untouched until ht_wait. NULL: a group that cannot (one rank). */
    ht_request *(*start_send)(ht_comm *c, const void *buf, int64_t bytes, int to, int tag);
    ht_request *(*start_recv)(ht_comm *c, void *buf, int64_t bytes, int from, int tag);
} ht_comm_ops;

struct ht_comm {
    const ht_comm_ops *ops;
    int rank, size;
    int local_size;   /* ranks on this node (threads per rank divide the node's cores) */
    const char *name; /* "single process", "MPI" */
    void *impl;
    size_t buffer_bytes; /* what the comm layer keeps for this group's collectives (MPI's sums' buffer) */
};

/* The one-process group: rank 0 of 1; every collective leaves its data as it is. */
ht_comm *ht_comm_single(void);
/* Rank `rank` of a world of `size` that does not run (`hypertrain plan`
 * declares each rank of N with one, in one process): every collective
 * leaves this rank's data as it is, as if every rank held the same; it is
 * not split (ht_parallel makes its groups virtual from the mesh). NULL when
 * out of memory; free it with ht_comm_free. */
ht_comm *ht_comm_virtual(int rank, int size);
bool ht_comm_is_virtual(const ht_comm *c);

/* The MPI world when this process was started by a launcher (mpirun, srun):
 * MPI is initialised and *out is the world. Started without one, *out is
 * ht_comm_single(). A process a launcher started that cannot join its world
 * is an error, never a silent run of one rank. */
ht_status ht_comm_init(int *argc, char ***argv, ht_comm **out, ht_error *err);
/* The ranks of c with the same `color`, ordered by `key` (MPI_Comm_split):
 * HSDP's shard and replicate groups. Every rank of c calls it. A group of
 * one rank is ht_comm_single(). Free it with ht_comm_free before its parent. */
ht_status ht_comm_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err);
/* A group over `inner` whose collectives also take memory of the kernel
 * backend K that the host cannot reach (K->owns): each such buffer is
 * downloaded into host memory before inner's collective and uploaded after,
 * so results are the host's bits. Its splits are staged groups too. With
 * owns_inner, freeing it frees inner. */
struct ht_kernel_ops;
ht_status ht_comm_staged(ht_comm *inner, const struct ht_kernel_ops *K, bool owns_inner, ht_comm **out, ht_error *err);
/* A group over `inner` (a staged group: ht_comm_staged with the CUDA
 * backend) whose collectives of CUDA device memory go over NCCL, GPU to
 * GPU, in order with the backend's kernels; sums in rank order as the
 * host's (an exchange of slices, then the backend's additions), so the
 * same bits. Host memory and mixed buffers go to inner. An error where
 * this build has no CUDA backend or NCCL cannot be opened (libnccl.so.2)
 * or joined. Its splits are NCCL groups too. With owns_inner, freeing it
 * frees inner. */
ht_status ht_comm_nccl(ht_comm *inner, bool owns_inner, ht_comm **out, ht_error *err);
/* Leaves the group (MPI_Finalize for the MPI world). */
void ht_comm_free(ht_comm *c);
/* A rank that waits in a collective longer than `seconds` (0: forever)
 * prints which one and ends the world: a stopped, unreachable or stuck peer
 * must not leave the others waiting. One setting for the whole process. */
void ht_comm_set_timeout(ht_comm *c, double seconds);
/* Ends every rank of the world at once (a fatal error on one rank, so that
 * no peer waits forever); the single-process group just returns. */
void ht_comm_abort(ht_comm *c, int code);

/* training.trace: each blocking collective of a group of more than one rank
 * is a span on the calling thread, named with the group's size, with the
 * bytes of its buffer on this rank (an all-reduce's or reduce-scatter's
 * input, an all-gather's whole result, a broadcast's payload, a gather's or
 * scatter's share of this rank); outside a capture, one branch. */
static inline void ht_comm_trace(const ht_comm *c, const char *what, double t0, int64_t bytes) {
    char name[64];
    snprintf(name, sizeof(name), "%s (%d ranks)", what, c->size);
    ht_trace_span("comm", name, HT_TRACE_THREAD, t0, ht_time_seconds(), bytes, -1);
}
static inline int64_t ht_comm_sum_counts(const ht_comm *c, const int64_t *counts, int64_t elem) {
    int64_t sum = 0;
    for (int r = 0; r < c->size; r++) sum += counts[r] * elem;
    return sum;
}
#define HT_COMM_TRACED(c, what, bytes, call)                                                                           \
    do {                                                                                                               \
        if (!ht_trace_on || (c)->size == 1) {                                                                          \
            call;                                                                                                      \
        } else {                                                                                                       \
            const double traced_t0 = ht_time_seconds();                                                                \
            call;                                                                                                      \
            ht_comm_trace(c, what, traced_t0, bytes);                                                                  \
        }                                                                                                              \
    } while (0)

static inline void ht_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    HT_COMM_TRACED(c, "all_reduce_f64", n * 8, c->ops->all_reduce_f64(c, buf, n, op));
}
static inline void ht_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    HT_COMM_TRACED(c, "all_reduce_f32", n * 4, c->ops->all_reduce_f32(c, buf, n, op));
}
static inline void ht_reduce_scatter_f32(ht_comm *c, const float *send, float *recv, const int64_t *counts) {
    HT_COMM_TRACED(c, "reduce_scatter_f32", ht_comm_sum_counts(c, counts, 4),
                   c->ops->reduce_scatter_f32(c, send, recv, counts));
}
static inline void ht_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    HT_COMM_TRACED(c, "broadcast", bytes, c->ops->broadcast(c, buf, bytes, root));
}
static inline void ht_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    HT_COMM_TRACED(c, "all_gather", ht_comm_sum_counts(c, bytes, 1), c->ops->all_gather(c, send, recv, bytes));
}
static inline void ht_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    HT_COMM_TRACED(c, "gather", bytes[c->rank], c->ops->gather(c, send, recv, bytes, root));
}
static inline void ht_scatter(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    HT_COMM_TRACED(c, "scatter", bytes[c->rank], c->ops->scatter(c, send, recv, bytes, root));
}
static inline void ht_barrier(ht_comm *c) { HT_COMM_TRACED(c, "barrier", 0, c->ops->barrier(c)); }
static inline ht_request *ht_start_exchange(ht_comm *c, const ht_spans *send, const ht_spans *recv) {
    return c->ops->start_exchange(c, send, recv);
}
static inline ht_request *ht_start_send(ht_comm *c, const void *buf, int64_t bytes, int to, int tag) {
    return c->ops->start_send(c, buf, bytes, to, tag);
}
static inline ht_request *ht_start_recv(ht_comm *c, void *buf, int64_t bytes, int from, int tag) {
    return c->ops->start_recv(c, buf, bytes, from, tag);
}
/* Starts one step of a ring (context parallelism's key/value blocks going
 * round): `bytes` of send go to rank (rank + offset) mod size and recv gets
 * `bytes` from rank (rank - offset) mod size, every rank of c calling it
 * with the same bytes and offset; wait with ht_wait. An exchange with one
 * peer each way. */
ht_request *ht_start_shift(ht_comm *c, const void *send, void *recv, int64_t bytes, int offset);
static inline void ht_wait(ht_comm *c, ht_request *r, double *seconds) { c->ops->wait(c, r, seconds); }

/* A started FP32 all-reduce (tensor parallelism's, overlapped with compute). */
typedef struct ht_all_reduce ht_all_reduce;
/* Starts buf (n, host memory) <- its sum over the ranks of c, every rank of c calling it
 * in the same order as its other collectives: the slices of buf go to the
 * ranks that sum them (one started exchange, in flight until the wait);
 * buf must stay untouched until ht_wait_all_reduce. The result is the bits
 * of ht_all_reduce_f32's (each element the sum in rank order). Out of
 * memory to start it: summed at once, blocking, and NULL (nothing to wait
 * for). */
ht_all_reduce *ht_start_all_reduce_f32(ht_comm *c, float *buf, int64_t n);
/* Completes it: this rank's slice summed, then every rank's sums gathered
 * into buf. *seconds (if not NULL): the exchange's time in flight. */
void ht_wait_all_reduce(ht_all_reduce *a, double *seconds);

#ifdef __cplusplus
}
#endif
#endif
