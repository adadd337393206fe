/* The MPI world behind ht_comm. Sums are never MPI's own reductions, whose
 * order MPI leaves to the algorithm: a reduce-scatter sends each rank the
 * slices it owns (all-to-all) and the owner adds them in rank order; an
 * all-reduce is that reduce-scatter followed by an all-gather of the sums. */
#include "dist/comm_internal.h"

#include <limits.h>
#include <stdbool.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct mpi_comm {
    ht_comm base;
    MPI_Comm comm;
    bool world; /* MPI_COMM_WORLD: freeing it finalizes MPI */
    /* Scratch reused across calls: the slices received, counts and offsets. */
    void *scratch;
    size_t scratch_bytes;
    int *counts, *displs, *counts2, *displs2;
} mpi_comm;

/* A collective that fails, or a count beyond MPI's int, ends every rank: a
 * peer left half-way through a collective would otherwise wait forever. */
static void mpi_fatal(mpi_comm *m, const char *what) {
    fprintf(stderr, "[hypertrain error rank %d] %s\n", m->base.rank, what);
    MPI_Abort(m->comm, 1);
}

static void mpi_check(mpi_comm *m, int rc, const char *what) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING + 128], text[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, text, &len);
    snprintf(msg, sizeof(msg), "%s failed: %s", what, text);
    mpi_fatal(m, msg);
}

static int as_int(mpi_comm *m, int64_t n) {
    if (n < 0 || n > INT_MAX) mpi_fatal(m, "a collective of more than 2^31 - 1 elements (split it)");
    return (int)n;
}

static void *scratch(mpi_comm *m, size_t bytes) {
    if (bytes > m->scratch_bytes) {
        ht_free(m->scratch);
        m->scratch = ht_alloc(bytes);
        if (!m->scratch) mpi_fatal(m, "out of memory for a collective's buffer");
        m->scratch_bytes = bytes;
    }
    return m->scratch;
}

/* counts and displs of every rank's slice, in MPI's int, from the slices'
 * sizes laid end to end (in whatever unit the collective counts). */
static void layout(mpi_comm *m, const int64_t *sizes) {
    int64_t off = 0;
    for (int r = 0; r < m->base.size; r++) {
        m->counts[r] = as_int(m, sizes[r]);
        m->displs[r] = as_int(m, off);
        off += sizes[r];
    }
}

static void mpi_reduce_scatter_f32(ht_comm *c, const float *send, float *recv, const int64_t *counts) {
    mpi_comm *m = (mpi_comm *)c;
    int P = c->size, me = c->rank, mine = as_int(m, counts[me]);
    layout(m, counts);
    for (int r = 0; r < P; r++) {
        m->counts2[r] = mine;
        m->displs2[r] = as_int(m, (int64_t)r * mine);
    }
    float *slices = scratch(m, (size_t)P * (size_t)(mine ? mine : 1) * sizeof(float)); /* (P, mine) */
    mpi_check(m,
              MPI_Alltoallv(send, m->counts, m->displs, MPI_FLOAT, slices, m->counts2, m->displs2, MPI_FLOAT, m->comm),
              "MPI_Alltoallv");
    for (int i = 0; i < mine; i++) {
        float sum = slices[i];
        for (int r = 1; r < P; r++) sum += slices[(size_t)r * mine + i];
        recv[i] = sum;
    }
}

static void mpi_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    mpi_comm *m = (mpi_comm *)c;
    layout(m, bytes);
    /* In place when send already sits at this rank's offset in recv. */
    const void *src = (const char *)recv + m->displs[c->rank] == send ? MPI_IN_PLACE : send;
    mpi_check(m, MPI_Allgatherv(src, m->counts[c->rank], MPI_BYTE, recv, m->counts, m->displs, MPI_BYTE, m->comm),
              "MPI_Allgatherv");
}

static void mpi_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    mpi_comm *m = (mpi_comm *)c;
    layout(m, bytes);
    const void *src = c->rank == root && (const char *)recv + m->displs[root] == send ? MPI_IN_PLACE : send;
    mpi_check(m, MPI_Gatherv(src, m->counts[c->rank], MPI_BYTE, recv, m->counts, m->displs, MPI_BYTE, root, m->comm),
              "MPI_Gatherv");
}

static void mpi_scatter(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    mpi_comm *m = (mpi_comm *)c;
    layout(m, bytes);
    void *dst = c->rank == root && (const char *)send + m->displs[root] == recv ? MPI_IN_PLACE : recv;
    mpi_check(m, MPI_Scatterv(send, m->counts, m->displs, MPI_BYTE, dst, m->counts[c->rank], MPI_BYTE, root, m->comm),
              "MPI_Scatterv");
}

/* Balanced slices of n: rank r owns [n·r/P, n·(r+1)/P). */
static void mpi_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    mpi_comm *m = (mpi_comm *)c;
    if (op == HT_REDUCE_MAX) {
        mpi_check(m, MPI_Allreduce(MPI_IN_PLACE, buf, as_int(m, n), MPI_FLOAT, MPI_MAX, m->comm), "MPI_Allreduce");
        return;
    }
    int P = c->size;
    int64_t counts[P], bytes[P];
    for (int r = 0; r < P; r++) {
        counts[r] = n * (r + 1) / P - n * r / P;
        bytes[r] = counts[r] * (int64_t)sizeof(float);
    }
    float *mine = ht_alloc((size_t)(counts[c->rank] ? counts[c->rank] : 1) * sizeof(float));
    if (!mine) mpi_fatal(m, "out of memory for an all-reduce");
    mpi_reduce_scatter_f32(c, buf, mine, counts);
    memcpy(buf + n * c->rank / P, mine, (size_t)counts[c->rank] * sizeof(float));
    ht_free(mine);
    mpi_all_gather(c, buf + n * c->rank / P, buf, bytes);
}

/* Small vectors (norms, flags, losses): every rank gathers every rank's
 * values and adds them in rank order itself. */
static void mpi_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    mpi_comm *m = (mpi_comm *)c;
    int P = c->size, count = as_int(m, n);
    if (op == HT_REDUCE_MAX) {
        mpi_check(m, MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_DOUBLE, MPI_MAX, m->comm), "MPI_Allreduce");
        return;
    }
    double *all = scratch(m, (size_t)P * (size_t)(count ? count : 1) * sizeof(double));
    mpi_check(m, MPI_Allgather(buf, count, MPI_DOUBLE, all, count, MPI_DOUBLE, m->comm), "MPI_Allgather");
    for (int i = 0; i < count; i++) {
        double sum = all[i];
        for (int r = 1; r < P; r++) sum += all[(size_t)r * count + i];
        buf[i] = sum;
    }
}

static void mpi_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    mpi_comm *m = (mpi_comm *)c;
    mpi_check(m, MPI_Bcast(buf, as_int(m, bytes), MPI_BYTE, root, m->comm), "MPI_Bcast");
}

static void mpi_barrier(ht_comm *c) {
    mpi_comm *m = (mpi_comm *)c;
    mpi_check(m, MPI_Barrier(m->comm), "MPI_Barrier");
}

static void mpi_free(ht_comm *c) {
    mpi_comm *m = (mpi_comm *)c;
    bool world = m->world;
    if (!world) MPI_Comm_free(&m->comm);
    ht_free(m->scratch);
    free(m->counts);
    free(m->displs);
    free(m->counts2);
    free(m->displs2);
    free(m);
    if (world) MPI_Finalize();
}

static const ht_comm_ops mpi_ops = {
    .all_reduce_f64 = mpi_all_reduce_f64,
    .all_reduce_f32 = mpi_all_reduce_f32,
    .reduce_scatter_f32 = mpi_reduce_scatter_f32,
    .broadcast = mpi_broadcast,
    .all_gather = mpi_all_gather,
    .gather = mpi_gather,
    .scatter = mpi_scatter,
    .barrier = mpi_barrier,
    .free = mpi_free,
};

/* The ht_comm of an MPI communicator (its rank, size, local size and buffers). */
static ht_status wrap(MPI_Comm comm, bool world, mpi_comm **out, ht_error *err) {
    mpi_comm *m = calloc(1, sizeof(*m));
    if (!m) return ht_fail(err, HT_ERR_OOM, "cannot allocate an MPI group");
    m->comm = comm;
    m->world = world;
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(comm, &m->base.rank);
    MPI_Comm_size(comm, &m->base.size);
    m->base.ops = &mpi_ops;
    m->base.name = "MPI";
    /* Ranks on this node: the shared-memory split of the group. */
    MPI_Comm node;
    MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, m->base.rank, MPI_INFO_NULL, &node);
    MPI_Comm_size(node, &m->base.local_size);
    MPI_Comm_free(&node);
    size_t P = (size_t)m->base.size;
    m->counts = calloc(P, sizeof(int));
    m->displs = calloc(P, sizeof(int));
    m->counts2 = calloc(P, sizeof(int));
    m->displs2 = calloc(P, sizeof(int));
    if (!m->counts || !m->displs || !m->counts2 || !m->displs2) {
        free(m->counts);
        free(m->displs);
        free(m->counts2);
        free(m->displs2);
        free(m);
        if (!world) MPI_Comm_free(&comm);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate an MPI group");
    }
    *out = m;
    return HT_OK;
}

ht_status ht_comm_mpi_init(int *argc, char ***argv, int announced, const char *which, ht_comm **out, ht_error *err) {
    int provided = 0;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
        return ht_fail(err, HT_ERR_INVALID, "%s=%d: started by a launcher, but MPI_Init failed", which, announced);
    int size = 0;
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size != announced) {
        MPI_Finalize();
        return ht_fail(err, HT_ERR_INVALID,
                       "%s=%d: the launcher started %d processes, but MPI's world has %d: this process cannot join "
                       "its world (an MPI library other than the one mpirun belongs to?)",
                       which, announced, announced, size);
    }
    mpi_comm *m;
    ht_status s = wrap(MPI_COMM_WORLD, true, &m, err);
    if (s != HT_OK) {
        MPI_Finalize();
        return s;
    }
    *out = &m->base;
    return HT_OK;
}

ht_status ht_comm_mpi_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err) {
    mpi_comm *parent = (mpi_comm *)c;
    MPI_Comm sub;
    mpi_check(parent, MPI_Comm_split(parent->comm, color, key, &sub), "MPI_Comm_split");
    int size = 0;
    MPI_Comm_size(sub, &size);
    if (size == 1) { /* a group of one: the single-process group, nothing to exchange */
        MPI_Comm_free(&sub);
        *out = ht_comm_single();
        return HT_OK;
    }
    mpi_comm *m;
    ht_status s = wrap(sub, false, &m, err);
    if (s != HT_OK) return s;
    *out = &m->base;
    return HT_OK;
}

void ht_comm_mpi_abort(ht_comm *c, int code) { MPI_Abort(((mpi_comm *)c)->comm, code); }
