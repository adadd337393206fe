/* The one-process group, and the choice between it and the MPI world at
 * start: a process that a launcher started joins MPI, any other is rank 0 of 1. */
#include "comm/comm_internal.h"

#include <stdlib.h>
#include <string.h>

static void single_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    (void)c, (void)buf, (void)n, (void)op;
}
static void single_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    (void)c, (void)buf, (void)n, (void)op;
}
static void single_reduce_scatter_f32(ht_comm *c, const float *send, float *recv, const int64_t *counts) {
    (void)c;
    if (recv != send) memmove(recv, send, (size_t)counts[0] * sizeof(float));
}
static void single_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    (void)c, (void)buf, (void)bytes, (void)root;
}
static void single_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    (void)c;
    if (recv != send) memmove(recv, send, (size_t)bytes[0]);
}
static void single_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    (void)root;
    single_all_gather(c, send, recv, bytes);
}
static void single_barrier(ht_comm *c) { (void)c; }
/* One rank sends only to itself: its send spans copied into its receive spans, in order. */
static ht_request *single_start_exchange(ht_comm *c, const ht_spans *send, const ht_spans *recv) {
    (void)c;
    int si = send->first[0], ri = recv->first[0];
    int64_t soff = 0, roff = 0;
    while (si < send->first[1] && ri < recv->first[1]) {
        const ht_span *a = &send->spans[si], *b = &recv->spans[ri];
        int64_t n = a->bytes - soff < b->bytes - roff ? a->bytes - soff : b->bytes - roff;
        memmove((char *)b->addr + roff, (const char *)a->addr + soff, (size_t)n);
        soff += n;
        roff += n;
        if (soff == a->bytes) si++, soff = 0;
        if (roff == b->bytes) ri++, roff = 0;
    }
    return NULL;
}
static void single_wait(ht_comm *c, ht_request *r, double *seconds) {
    (void)c, (void)r;
    if (seconds) *seconds = 0.0;
}
/* These collectives serve the one-process group (the static `single`
 * below) and every virtual rank (ht_comm_virtual, allocated): only the
 * split and the free tell them apart. */
static ht_comm single;

static ht_status single_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err) {
    (void)color, (void)key;
    if (c != &single)
        return ht_fail(err, HT_ERR_INVALID,
                       "the virtual rank %d of %d cannot split a group (its groups come from the mesh)", c->rank,
                       c->size);
    *out = c;
    return HT_OK;
}
static void single_abort(ht_comm *c, int code) { (void)c, (void)code; }
static void single_free(ht_comm *c) {
    if (c != &single) free(c);
}

ht_request *ht_start_shift(ht_comm *c, const void *send, void *recv, int64_t bytes, int offset) {
    const int P = c->size, to = ((c->rank + offset) % P + P) % P, from = ((c->rank - offset) % P + P) % P;
    /* first[q] = 0 up to the peer, 1 after it: the one span is the peer's, every other rank's list is empty. */
    int first[2 * (P + 1)];
    for (int q = 0; q <= P; q++) first[q] = q > to, first[P + 1 + q] = q > from;
    const ht_span out = {(void *)send, bytes}, in = {recv, bytes};
    const ht_spans s = {&out, first}, r = {&in, first + P + 1};
    return ht_start_exchange(c, &s, &r); /* the span lists may go once it is started */
}

struct ht_all_reduce {
    ht_comm *c;
    float *buf;
    int64_t n;
    float *slices;   /* (P, this rank's count): every rank's values of this rank's slice */
    ht_request *req; /* their exchange, in flight */
};

/* Rank r's slice of n: [n·r/P, n·(r+1)/P). */
static int64_t slice_at(int64_t n, int r, int P) { return n * r / P; }

ht_all_reduce *ht_start_all_reduce_f32(ht_comm *c, float *buf, int64_t n) {
    const int P = c->size, me = c->rank;
    ht_all_reduce *a = calloc(1, sizeof(*a));
    const int64_t mine = slice_at(n, me + 1, P) - slice_at(n, me, P);
    if (a) a->slices = malloc((size_t)(P * mine + 1) * sizeof(float));
    if (!a || !a->slices) { /* no memory to start it with: summed now, blocking, nothing to wait for */
        free(a);
        ht_all_reduce_f32(c, buf, n, HT_REDUCE_SUM);
        return NULL;
    }
    a->c = c, a->buf = buf, a->n = n;
    ht_span out[P], in[P];
    int first[P + 1];
    for (int q = 0; q < P; q++) {
        out[q] = (ht_span){buf + slice_at(n, q, P), (slice_at(n, q + 1, P) - slice_at(n, q, P)) * 4};
        in[q] = (ht_span){a->slices + q * mine, mine * 4};
        first[q] = q;
    }
    first[P] = P;
    const ht_spans s = {out, first}, r = {in, first};
    a->req = ht_start_exchange(c, &s, &r);
    return a;
}

void ht_wait_all_reduce(ht_all_reduce *a, double *seconds) {
    if (seconds) *seconds = 0.0;
    if (!a) return;
    ht_comm *c = a->c;
    const int P = c->size, me = c->rank;
    const int64_t n = a->n, lo = slice_at(n, me, P), mine = slice_at(n, me + 1, P) - lo;
    double flight = 0.0;
    ht_wait(c, a->req, &flight);
    /* The sums of this rank's slice in rank order, as ht_all_reduce_f32 adds them. */
    for (int64_t i = 0; i < mine; i++) {
        float sum = a->slices[i];
        for (int r = 1; r < P; r++) sum += a->slices[r * mine + i];
        a->buf[lo + i] = sum;
    }
    int64_t bytes[P];
    for (int q = 0; q < P; q++) bytes[q] = (slice_at(n, q + 1, P) - slice_at(n, q, P)) * 4;
    ht_all_gather(c, a->buf + lo, a->buf, bytes);
    if (seconds) *seconds = flight;
    free(a->slices);
    free(a);
}

static const ht_comm_ops single_ops = {
    .all_reduce_f64 = single_all_reduce_f64,
    .all_reduce_f32 = single_all_reduce_f32,
    .reduce_scatter_f32 = single_reduce_scatter_f32,
    .broadcast = single_broadcast,
    .all_gather = single_all_gather,
    .gather = single_gather,
    .scatter = single_gather, /* one rank: both are a copy */
    .barrier = single_barrier,
    .start_exchange = single_start_exchange,
    .wait = single_wait,
    .split = single_split,
    .abort = single_abort,
    .free = single_free,
};

static ht_comm single = {.ops = &single_ops, .rank = 0, .size = 1, .local_size = 1, .name = "single process"};

ht_comm *ht_comm_single(void) { return &single; }

ht_comm *ht_comm_virtual(int rank, int size) {
    ht_comm *c = calloc(1, sizeof(*c));
    if (c) *c = (ht_comm){.ops = &single_ops, .rank = rank, .size = size, .local_size = size, .name = "virtual"};
    return c;
}

bool ht_comm_is_virtual(const ht_comm *c) { return c && c->ops == &single_ops && c != &single; }

/* The world size a launcher announced in the environment, or 0 when none did. */
static int launcher_world_size(const char **which) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE", "SLURM_NTASKS"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char *v = getenv(vars[i]);
        /* srun sets SLURM_NTASKS for the job; only a step it launched also has SLURM_PROCID. */
        if (v && atoi(v) > 0 && (strcmp(vars[i], "SLURM_NTASKS") != 0 || getenv("SLURM_PROCID"))) {
            *which = vars[i];
            return atoi(v);
        }
    }
    return 0;
}

ht_status ht_comm_init(int *argc, char ***argv, ht_comm **out, ht_error *err) {
    const char *which = NULL;
    int announced = launcher_world_size(&which);
    *out = ht_comm_single();
    if (announced == 0) return HT_OK;
    return ht_comm_mpi_init(argc, argv, announced, which, out, err);
}

ht_status ht_comm_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err) {
    *out = ht_comm_single();
    return c->ops->split(c, color, key, out, err);
}

void ht_comm_free(ht_comm *c) {
    if (c) c->ops->free(c);
}

void ht_comm_abort(ht_comm *c, int code) {
    if (c) c->ops->abort(c, code);
}

void ht_comm_set_timeout(ht_comm *c, double seconds) {
    if (c && c->size > 1) ht_comm_mpi_set_timeout(seconds);
}

#ifndef HT_CUDA /* else comm/nccl.cu */
ht_status ht_comm_nccl(ht_comm *inner, bool owns_inner, ht_comm **out, ht_error *err) {
    (void)inner, (void)owns_inner, (void)out;
    return ht_fail(err, HT_ERR_INVALID, "this build has no CUDA backend, so no NCCL (cmake -DHT_CUDA=ON)");
}
#endif
