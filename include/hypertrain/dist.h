/* The process group (docs/DESIGN.md, Processes): this process's rank among its
 * peers and the collectives the layers above use. One process uses the
 * trivial group, the same code path with nothing to exchange; `mpirun` gives
 * the MPI one. Every collective is called by every rank of the group, in the
 * same order; results are identical on every rank. */
#ifndef HYPERTRAIN_DIST_H
#define HYPERTRAIN_DIST_H

#include "hypertrain/base.h"
#include "hypertrain/param.h"

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
    void (*free)(ht_comm *c);
} ht_comm_ops;

struct ht_comm {
    const ht_comm_ops *ops;
    int rank, size;
    int local_size;   /* ranks on this node (threads per rank divide the node's cores) */
    const char *name; /* "single process", "MPI" */
    void *impl;
};

/* The one-process group: rank 0 of 1; every collective leaves its data as it is. */
ht_comm *ht_comm_single(void);

/* The MPI world when this process was started by a launcher (mpirun, srun):
 * MPI is initialised and *out is the world. Started without one, *out is
 * ht_comm_single(). A process a launcher started that cannot join its world
 * is an error, never a silent run of one rank. */
ht_status ht_comm_init(int *argc, char ***argv, ht_comm **out, ht_error *err);
/* The ranks of c with the same `color`, ordered by `key` (MPI_Comm_split):
 * HSDP's shard and replicate groups. Every rank of c calls it. A group of
 * one rank is ht_comm_single(). Free it with ht_comm_free before its parent. */
ht_status ht_comm_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err);
/* Leaves the group (MPI_Finalize for the MPI world). */
void ht_comm_free(ht_comm *c);
/* A rank that waits in a collective longer than `seconds` (0: forever)
 * prints which one and ends the world: a stopped, unreachable or stuck peer
 * must not leave the others waiting. One setting for the whole process. */
void ht_comm_set_timeout(ht_comm *c, double seconds);
/* Ends every rank of the world at once (a fatal error on one rank, so that
 * no peer waits forever); the single-process group just returns. */
void ht_comm_abort(ht_comm *c, int code);

static inline void ht_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    c->ops->all_reduce_f64(c, buf, n, op);
}
static inline void ht_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    c->ops->all_reduce_f32(c, buf, n, op);
}
static inline void ht_reduce_scatter_f32(ht_comm *c, const float *send, float *recv, const int64_t *counts) {
    c->ops->reduce_scatter_f32(c, send, recv, counts);
}
static inline void ht_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    c->ops->broadcast(c, buf, bytes, root);
}
static inline void ht_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    c->ops->all_gather(c, send, recv, bytes);
}
static inline void ht_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    c->ops->gather(c, send, recv, bytes, root);
}
static inline void ht_scatter(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    c->ops->scatter(c, send, recv, bytes, root);
}
static inline void ht_barrier(ht_comm *c) { c->ops->barrier(c); }
static inline ht_request *ht_start_exchange(ht_comm *c, const ht_spans *send, const ht_spans *recv) {
    return c->ops->start_exchange(c, send, recv);
}
static inline void ht_wait(ht_comm *c, ht_request *r, double *seconds) { c->ops->wait(c, r, seconds); }

/* ---------------------------------------------------------------- sharded parameters (FSDP) */

typedef struct ht_model ht_model;

/* How a model's params group into FSDP units. */
typedef struct ht_fsdp_options {
    /* Module patterns (parallel.fsdp_plan.apply_modules): each module they
     * match is a unit; "{*}" (or "*") stands for one dotted component, as in
     * "model.layers.{*}". The params no unit holds, and those read by modules
     * of two units (tied embeddings), form the root unit. */
    const char *const *apply_modules;
    int apply_count;
    /* A unit's gathered weights are dropped after its forward and gathered
     * again for its backward (false: kept until its backward). The root
     * unit keeps them from its first forward to the end of backward. */
    bool reshard_after_forward;
    /* The next module's units are gathered while the current one computes. */
    bool prefetch;
    /* Expert parallelism: the 3-D params under the modules expert_modules
     * match (parallel.ep_plan.apply_modules; none given: every
     * "model.layers.{*}.mlp.experts") form units of their own, one per
     * module, gathered and reduced over expert_group (the consecutive ranks
     * that hold the same experts, the first of them expert_first in the
     * group's numbering) instead of the whole group: a rank's gathered
     * tensors hold its group's experts only. NULL: no expert parallelism. */
    ht_comm *expert_group;
    int expert_first;
    const char *const *expert_modules;
    int expert_count;
    /* The precision gradients travel in (fsdp_config.mix_precision.
     * reduce_dtype): F32, or BF16 / F16, where each rank's FP32 gradient is
     * rounded to it before it is sent (half the bytes, as FSDP2's reduce_dtype)
     * and the receiving rank sums the contributions in FP32 in rank order,
     * into FP32 main_grad. FSDP2 sums in the 16-bit dtype and rounds the sum
     * to the gradient's dtype; this rounds each contribution once, nothing
     * else. */
    ht_dtype reduce_dtype;
} ht_fsdp_options;

/* What the collectives cost, summed since the last ht_fsdp_stats_reset. */
typedef struct ht_fsdp_stats {
    int64_t gathers, reduce_scatters;
    double gathered_bytes, reduced_bytes;
    double in_flight_seconds; /* the collectives' time from start to completion */
    double waited_seconds;    /* the part of it compute stood waiting: the rest was hidden */
    double pool_peak_bytes;   /* the largest memory of gathered weights and unit gradients held at once */
    ht_dtype reduce_dtype;    /* what the gradients travel in (reduced_bytes counts them so) */
} ht_fsdp_stats;

typedef struct ht_fsdp ht_fsdp;

/* Groups the model's params into units and hooks the model, so that each
 * unit's whole weights exist only around its modules' forward and backward
 * (one all-gather of every rank's compute_rows), and its whole FP32
 * gradient only from its backward until one reduce-scatter adds each rank's
 * rows into main_grad (FP32, in rank order, += across micro-batches). A
 * store that is not sharded (one rank, or shard_size 1) has nothing to
 * gather: the same hooks run and move nothing. */
ht_status ht_fsdp_create(ht_model *m, ht_comm *comm, const ht_fsdp_options *opt, ht_fsdp **out, ht_error *err);
/* One log line per unit kind and the plan in force. */
void ht_fsdp_log_plan(const ht_fsdp *f);
/* After the last micro-batch's backward: every reduce-scatter complete, every
 * rank's main_grad rows final. */
void ht_fsdp_finish_backward(ht_fsdp *f);
/* HSDP: block (n floats, each rank's main_grad rows) ← its sum over the
 * replicas `c`, in rank order, every replica getting the same bits. In
 * FP32, an all-reduce; with a 16-bit reduce_dtype each replica's block is
 * rounded to it before it is sent, as in the reduce-scatter, and the FP32
 * sums come back. Every rank of c calls it. */
void ht_fsdp_reduce_replicas(ht_fsdp *f, ht_comm *c, float *block, int64_t n);
/* After the weights changed (an update, a load): gathered copies are stale
 * and dropped; the compute_rows are refreshed from data. */
void ht_fsdp_weights_changed(ht_fsdp *f);
/* Whether the model's module `module` is an FSDP unit of its own (not the root). */
bool ht_fsdp_module_is_unit(const ht_fsdp *f, int module);
const ht_fsdp_stats *ht_fsdp_stats_get(const ht_fsdp *f);
void ht_fsdp_stats_reset(ht_fsdp *f);
void ht_fsdp_free(ht_fsdp *f);

/* Expert parallelism: the model's sparse layers exchange their rows over
 * `group` (the ranks that split the experts: group rank q computes experts
 * [q·E/size, (q + 1)·E/size)). The group must outlive the model's use of it. */
void ht_expert_parallel_attach(ht_model *m, ht_comm *group);

/* The bytes of each rank's rows of p (bytes[world]), elements of elem_size. */
void ht_fsdp_row_bytes(const ht_param *p, int world, int64_t *bytes, size_t elem_size);
/* A param's full tensor from its rows on every rank (`rows` holds this
 * rank's (row1 - row0) x row_numel values; full gets the whole tensor). */
void ht_fsdp_gather_rows(const ht_param *p, ht_comm *comm, const void *rows, void *full, size_t elem_size);

#ifdef __cplusplus
}
#endif
#endif
