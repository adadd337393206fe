/* The MPI world behind ht_comm. Sums are never MPI's own reductions, whose
 * order MPI leaves to the algorithm: a reduce-scatter sends each rank the
 * slices it owns (all-to-all) and the owner adds them in rank order; an
 * all-reduce is that reduce-scatter followed by an all-gather of the sums.
 *
 * Started collectives (ht_start_exchange) belong to one progress thread per
 * process: it starts them in order and drives them (MPI_Test, sleeping
 * between polls) while the caller computes. Open MPI moves a large message
 * only when some thread is inside MPI, so without it a prefetch would wait
 * for the caller's next MPI call. The other collectives run on the caller's
 * thread once the progress thread is idle, started and then polled to
 * completion (below, the roll call): one thread is in MPI at a time
 * (MPI_THREAD_SERIALIZED). */
#include "comm/comm_internal.h"

#ifndef HT_NO_MPI /* else comm/no_mpi.c */

#include <limits.h>
#include <stdbool.h>
#include <mpi.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct mpi_comm {
    ht_comm base;
    MPI_Comm comm;
    bool world;       /* MPI_COMM_WORLD: freeing it finalizes MPI */
    int *world_ranks; /* (size): each member's rank in the world, for the roll call's message */
    uint64_t group;   /* a hash of world_ranks: which group a peer's answer is about */
    int64_t seq;      /* the watched collectives begun on it: where in the program a peer is */
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

/* ------------------------------------------------------------------ waiting, and the roll call */

/* Every wait on peers polls its request (MPI_Test) rather than blocking in
 * MPI, so that the waiting thread can notice a wait past the timeout
 * (training.distributed_timeout_minutes) and find out who is missing: a
 * peer that died is noticed by the launcher, but one that is stopped,
 * unreachable, stuck or waiting in another collective would leave every
 * rank waiting forever. The roll call: the rank that timed out asks every
 * other rank of its group, over a communicator of its own, where it is;
 * a rank waiting in any collective answers from its polling loop (it is in
 * MPI, by its polling thread, the progress thread or the caller), so a rank
 * that does not answer within a few seconds did not arrive. The message
 * names both kinds, then the world ends. */
enum { TAG_QUERY = 1, TAG_ANSWER = 2, ANSWER_TEXT = 112 };

typedef struct roll_answer {
    int world_rank;
    int group_size;
    uint64_t group; /* a hash of the group's world ranks */
    int64_t seq;    /* the collectives this rank began on that group */
    double waited;  /* seconds */
    char what[ANSWER_TEXT];
} roll_answer;

static struct {
    pthread_mutex_t lock;
    double timeout; /* seconds; 0: none */
    MPI_Comm roll;  /* the world, for the roll call only; MPI_COMM_NULL before init */
    int world_rank;
    /* The wait this rank is in, for the answers: set by the caller's thread. */
    double since; /* 0: not waiting */
    const char *what;
    const struct mpi_comm *comm;
    int64_t seq;
} watch = {.lock = PTHREAD_MUTEX_INITIALIZER, .roll = MPI_COMM_NULL};

void ht_comm_mpi_set_timeout(double seconds) {
    pthread_mutex_lock(&watch.lock);
    watch.timeout = seconds;
    pthread_mutex_unlock(&watch.lock);
}

static uint64_t group_hash(const int *ranks, int n) {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < n; i++) h = (h ^ (uint64_t)(uint32_t)ranks[i]) * 1099511628211ull;
    return h;
}

static roll_answer my_answer(void) {
    roll_answer a = {.world_rank = watch.world_rank};
    pthread_mutex_lock(&watch.lock);
    if (watch.since > 0 && watch.comm) {
        a.group_size = watch.comm->base.size;
        a.group = watch.comm->group;
        a.seq = watch.seq;
        a.waited = ht_time_seconds() - watch.since;
        snprintf(a.what, sizeof(a.what), "%s", watch.what);
    }
    pthread_mutex_unlock(&watch.lock);
    return a;
}

/* Answers the roll calls other ranks sent (the thread in MPI calls it while it polls). */
static void answer_roll_calls(void) {
    if (watch.roll == MPI_COMM_NULL) return;
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_QUERY, watch.roll, &flag, &st) != MPI_SUCCESS || !flag) return;
        int query;
        MPI_Recv(&query, 1, MPI_INT, st.MPI_SOURCE, TAG_QUERY, watch.roll, MPI_STATUS_IGNORE);
        roll_answer a = my_answer();
        MPI_Send(&a, (int)sizeof(a), MPI_BYTE, st.MPI_SOURCE, TAG_ANSWER, watch.roll);
    }
}

/* Appends rank r to a list of ranks in text. */
static void list_rank(char *list, size_t n, int r) {
    size_t at = strlen(list);
    if (at < n) snprintf(list + at, n - at, "%s%d", at ? ", " : "", r);
}

/* The wait of `what` on m has passed the timeout: ask every other rank of
 * the group where it is, name the ones that did not arrive, end the world. */
static void roll_call(const mpi_comm *m, const char *what, double waited) {
    int P = m->base.size, me = m->base.rank;
    roll_answer *answers = calloc((size_t)P, sizeof(roll_answer));
    MPI_Request *reqs = calloc((size_t)(2 * P), sizeof(MPI_Request));
    int query = 0;
    for (int r = 0; answers && reqs && r < P; r++) {
        reqs[2 * r] = reqs[2 * r + 1] = MPI_REQUEST_NULL;
        if (r == me) continue;
        int to = m->world_ranks[r];
        MPI_Irecv(&answers[r], (int)sizeof(roll_answer), MPI_BYTE, to, TAG_ANSWER, watch.roll, &reqs[2 * r + 1]);
        MPI_Isend(&query, 1, MPI_INT, to, TAG_QUERY, watch.roll, &reqs[2 * r]);
    }
    /* A few seconds for the answers, answering the others' calls meanwhile. */
    const double grace = 5.0, start = ht_time_seconds();
    bool *answered = calloc((size_t)P, sizeof(bool));
    while (answers && reqs && answered && ht_time_seconds() - start < grace) {
        int missing = 0;
        for (int r = 0; r < P; r++) {
            if (r == me || answered[r]) continue;
            int flag = 0;
            MPI_Test(&reqs[2 * r + 1], &flag, MPI_STATUS_IGNORE);
            answered[r] = flag;
            missing += !flag;
        }
        if (!missing) break;
        answer_roll_calls();
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    char absent[512] = "", same[512] = "", other[1024] = "";
    for (int r = 0; answers && answered && r < P; r++) {
        if (r == me) continue;
        const roll_answer *a = &answers[r];
        if (!answered[r] || !a->what[0]) { /* silent, or in no collective: busy elsewhere */
            list_rank(absent, sizeof(absent), m->world_ranks[r]);
        } else if (a->group == m->group && a->seq == m->seq) {
            list_rank(same, sizeof(same), m->world_ranks[r]);
        } else {
            size_t at = strlen(other);
            if (at < sizeof(other))
                snprintf(other + at, sizeof(other) - at, "; rank %d waits in %s on a group of %d ranks instead",
                         a->world_rank, a->what[0] ? a->what : "no collective", a->group_size);
        }
    }
    fprintf(stderr,
            "[hypertrain error rank %d] %s on a group of %d ranks has waited %.0f s for its peers "
            "(training.distributed_timeout_minutes %g): %s%s%s%s%s%s; ending the world\n",
            watch.world_rank, what, P, waited, watch.timeout / 60.0, absent[0] ? "rank(s) " : "", absent,
            absent[0] ? " did not arrive (no answer in 5 s: stopped, stuck, busy elsewhere or gone)" : "",
            same[0] ? (absent[0] ? "; rank(s) " : "rank(s) ") : "", same, same[0] ? " wait in it too" : "");
    if (other[0]) fprintf(stderr, "[hypertrain error rank %d] %s\n", watch.world_rank, other + 2);
    fflush(stderr);
    _exit(1); /* the launcher ends the other ranks */
}

/* Begins a watched wait of `what` on m (the caller's thread). */
static void watch_begin(mpi_comm *m, const char *what) {
    pthread_mutex_lock(&watch.lock);
    watch.since = ht_time_seconds();
    watch.what = what;
    watch.comm = m;
    watch.seq = ++m->seq;
    pthread_mutex_unlock(&watch.lock);
}

static void watch_end(void) {
    pthread_mutex_lock(&watch.lock);
    watch.since = 0;
    watch.comm = NULL;
    pthread_mutex_unlock(&watch.lock);
}

/* One look at a watched wait from the thread in MPI: answers the others'
 * roll calls, and makes one when the wait has passed the timeout. */
static void watch_poll(void) {
    answer_roll_calls();
    pthread_mutex_lock(&watch.lock);
    double waited = watch.since > 0 ? ht_time_seconds() - watch.since : 0.0;
    bool late = watch.timeout > 0 && waited > watch.timeout && watch.comm;
    const mpi_comm *m = watch.comm;
    const char *what = watch.what;
    pthread_mutex_unlock(&watch.lock);
    if (late) roll_call(m, what, waited);
}

/* Waits for req by polling, spinning for the first 2 ms (a short
 * collective's latency is unchanged), then yielding the core between looks. */
static void wait_polled(mpi_comm *m, MPI_Request *req, const char *what) {
    watch_begin(m, what);
    double start = ht_time_seconds();
    for (long polls = 0;; polls++) {
        int flag = 0;
        mpi_check(m, MPI_Test(req, &flag, MPI_STATUS_IGNORE), what);
        if (flag) break;
        if ((polls & 63) == 63) {
            watch_poll();
        }
        if (polls > 256 && ht_time_seconds() - start > 2e-3) sched_yield();
    }
    watch_end();
}

/* ------------------------------------------------------------------ started collectives */

struct ht_request {
    mpi_comm *m;
    /* point to point (peer >= 0): buf's bytes to or from peer, with tag; else the exchange below */
    int peer, tag;
    bool sending;
    void *buf;
    int64_t bytes;
    ht_span *spans;       /* the send spans, then the receive spans */
    int *first;           /* (2 (size + 1)): send, then receive */
    MPI_Datatype *types;  /* (2 size): send, then receive; MPI_DATATYPE_NULL until started */
    int *counts, *displs; /* (2 size) */
    MPI_Request req;
    double started, finished; /* seconds */
    bool done;
    struct ht_request *next; /* in the queue or the active list */
};

static struct {
    pthread_mutex_t lock;
    pthread_cond_t work, done;
    pthread_t thread;
    bool running, stop;
    ht_request *queue, *queue_tail; /* not started yet, in order */
    ht_request *active;             /* started, not complete */
} progress = {.lock = PTHREAD_MUTEX_INITIALIZER, .work = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* MPI's datatype for the bytes at spans[0 .. n) (absolute addresses, used with MPI_BOTTOM). */
static MPI_Datatype span_type(mpi_comm *m, const ht_span *spans, int n, int *count) {
    *count = 0;
    int used = 0;
    for (int i = 0; i < n; i++) used += spans[i].bytes > 0;
    if (used == 0) return MPI_BYTE;
    int lens[used];
    MPI_Aint addrs[used];
    for (int i = 0, k = 0; i < n; i++) {
        if (spans[i].bytes == 0) continue;
        lens[k] = as_int(m, spans[i].bytes);
        MPI_Get_address(spans[i].addr, &addrs[k]);
        k++;
    }
    MPI_Datatype t;
    mpi_check(m, MPI_Type_create_hindexed(used, lens, addrs, MPI_BYTE, &t), "MPI_Type_create_hindexed");
    mpi_check(m, MPI_Type_commit(&t), "MPI_Type_commit");
    *count = 1;
    return t;
}

static void request_start(ht_request *r) {
    mpi_comm *m = r->m;
    if (r->peer >= 0) {
        const int n = as_int(m, r->bytes);
        if (r->sending)
            mpi_check(m, MPI_Isend(r->buf, n, MPI_BYTE, r->peer, r->tag, m->comm, &r->req), "MPI_Isend");
        else
            mpi_check(m, MPI_Irecv(r->buf, n, MPI_BYTE, r->peer, r->tag, m->comm, &r->req), "MPI_Irecv");
        return;
    }
    int P = m->base.size;
    for (int side = 0; side < 2; side++) {
        const int *first = r->first + side * (P + 1);
        for (int q = 0; q < P; q++) {
            int k = side * P + q;
            r->types[k] = span_type(m, r->spans + first[q], first[q + 1] - first[q], &r->counts[k]);
            r->displs[k] = 0;
        }
    }
    mpi_check(m,
              MPI_Ialltoallw(MPI_BOTTOM, r->counts, r->displs, r->types, MPI_BOTTOM, r->counts + P, r->displs + P,
                             r->types + P, m->comm, &r->req),
              "MPI_Ialltoallw");
}

static void request_free(ht_request *r) {
    if (!r) return;
    for (int k = 0; r->types && k < 2 * r->m->base.size; k++)
        if (r->types[k] != MPI_BYTE && r->types[k] != MPI_DATATYPE_NULL) MPI_Type_free(&r->types[k]);
    free(r->spans);
    free(r->first);
    free(r->types);
    free(r->counts);
    free(r->displs);
    free(r);
}

/* The progress thread: starts queued requests in order, tests the started
 * ones, sleeps 20 µs between polls that found nothing new, and waits on a
 * condition variable when there is nothing to do. */
static void *progress_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&progress.lock);
    for (;;) {
        while (!progress.stop && !progress.queue && !progress.active) pthread_cond_wait(&progress.work, &progress.lock);
        if (progress.stop && !progress.queue && !progress.active) break;
        while (progress.queue) { /* start in order; the requests' own buffers are not the caller's now */
            ht_request *r = progress.queue;
            progress.queue = r->next;
            if (!progress.queue) progress.queue_tail = NULL;
            request_start(r);
            r->next = progress.active;
            progress.active = r;
        }
        bool any = false;
        for (ht_request **pp = &progress.active; *pp;) {
            ht_request *r = *pp;
            int flag = 0;
            mpi_check(r->m, MPI_Test(&r->req, &flag, MPI_STATUS_IGNORE), "MPI_Test");
            if (flag) {
                r->finished = ht_time_seconds();
                r->done = true;
                *pp = r->next;
                any = true;
            } else {
                pp = &r->next;
            }
        }
        if (any) pthread_cond_broadcast(&progress.done);
        if (progress.active) watch_poll(); /* the caller may wait in mpi_wait for these */
        if (!any && progress.active) {
            pthread_mutex_unlock(&progress.lock);
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
            pthread_mutex_lock(&progress.lock);
        }
    }
    pthread_mutex_unlock(&progress.lock);
    return NULL;
}

/* Blocks until every started request is complete and the progress thread is
 * out of MPI: a blocking collective may then run on this thread. */
static void drain(void) {
    if (!progress.running) return;
    pthread_mutex_lock(&progress.lock);
    while (progress.queue || progress.active) pthread_cond_wait(&progress.done, &progress.lock);
    pthread_mutex_unlock(&progress.lock);
}

/* A request started now, or queued for the progress thread to start in order. */
static ht_request *request_submit(ht_request *r);

static ht_request *mpi_start_point(ht_comm *c, void *buf, int64_t bytes, int peer, int tag, bool sending) {
    mpi_comm *m = (mpi_comm *)c;
    if (peer < 0 || peer >= c->size || peer == c->rank) mpi_fatal(m, "a message to or from an invalid rank");
    ht_request *r = calloc(1, sizeof(*r));
    if (!r) mpi_fatal(m, "out of memory for a message");
    *r = (ht_request){.m = m, .peer = peer, .tag = tag, .sending = sending, .buf = buf, .bytes = bytes};
    return request_submit(r);
}

static ht_request *mpi_start_send(ht_comm *c, const void *buf, int64_t bytes, int to, int tag) {
    return mpi_start_point(c, (void *)buf, bytes, to, tag, true);
}

static ht_request *mpi_start_recv(ht_comm *c, void *buf, int64_t bytes, int from, int tag) {
    return mpi_start_point(c, buf, bytes, from, tag, false);
}

static ht_request *mpi_start_exchange(ht_comm *c, const ht_spans *send, const ht_spans *recv) {
    mpi_comm *m = (mpi_comm *)c;
    int P = c->size, ns = send->first[P] - send->first[0], nr = recv->first[P] - recv->first[0];
    ht_request *r = calloc(1, sizeof(*r));
    if (r) r->peer = -1;
    if (r) {
        r->spans = malloc((size_t)(ns + nr + 1) * sizeof(ht_span));
        r->first = malloc((size_t)(2 * (P + 1)) * sizeof(int));
        r->types = malloc((size_t)(2 * P) * sizeof(MPI_Datatype));
        r->counts = malloc((size_t)(2 * P) * sizeof(int));
        r->displs = malloc((size_t)(2 * P) * sizeof(int));
    }
    if (!r || !r->spans || !r->first || !r->types || !r->counts || !r->displs)
        mpi_fatal(m, "out of memory for a collective");
    r->m = m;
    memcpy(r->spans, send->spans + send->first[0], (size_t)ns * sizeof(ht_span));
    memcpy(r->spans + ns, recv->spans + recv->first[0], (size_t)nr * sizeof(ht_span));
    for (int q = 0; q <= P; q++) {
        r->first[q] = send->first[q] - send->first[0];
        r->first[P + 1 + q] = ns + recv->first[q] - recv->first[0];
    }
    for (int k = 0; k < 2 * P; k++) r->types[k] = MPI_DATATYPE_NULL;
    return request_submit(r);
}

static ht_request *request_submit(ht_request *r) {
    r->started = ht_time_seconds();
    if (!progress.running) { /* no progress thread: MPI moves it when waited for */
        request_start(r);
        return r;
    }
    pthread_mutex_lock(&progress.lock);
    if (progress.queue_tail)
        progress.queue_tail->next = r;
    else
        progress.queue = r;
    progress.queue_tail = r;
    pthread_cond_signal(&progress.work);
    pthread_mutex_unlock(&progress.lock);
    return r;
}

#define EXCHANGE "an FSDP all-to-all (a gather of weights or a reduce-scatter of gradients)"
#define MESSAGE "a pipeline stage's activations or gradients from or to its neighbour"

static void mpi_wait(ht_comm *c, ht_request *r, double *seconds) {
    (void)c;
    if (seconds) *seconds = 0.0;
    if (!r) return;
    if (progress.running) { /* the progress thread polls it, and watches this wait */
        watch_begin(r->m, r->peer >= 0 ? MESSAGE : EXCHANGE);
        pthread_mutex_lock(&progress.lock);
        while (!r->done) pthread_cond_wait(&progress.done, &progress.lock);
        pthread_mutex_unlock(&progress.lock);
        watch_end();
    } else {
        wait_polled(r->m, &r->req, r->peer >= 0 ? MESSAGE : EXCHANGE);
        r->finished = ht_time_seconds();
    }
    if (seconds) *seconds = r->finished - r->started;
    request_free(r);
}

static void progress_stop(void) {
    if (!progress.running) return;
    pthread_mutex_lock(&progress.lock);
    progress.stop = true;
    pthread_cond_signal(&progress.work);
    pthread_mutex_unlock(&progress.lock);
    pthread_join(progress.thread, NULL);
    progress.running = false;
}

/* ------------------------------------------------------------------ blocking collectives */

static void *scratch(mpi_comm *m, size_t bytes) {
    if (bytes > m->scratch_bytes) {
        ht_free(m->scratch);
        m->scratch = ht_alloc(bytes);
        if (!m->scratch) mpi_fatal(m, "out of memory for a collective's buffer");
        m->scratch_bytes = bytes;
        m->base.buffer_bytes = ht_align64(bytes) + 64; /* as ht_alloc takes it */
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
    drain();
    mpi_comm *m = (mpi_comm *)c;
    int P = c->size, me = c->rank, mine = as_int(m, counts[me]);
    layout(m, counts);
    for (int r = 0; r < P; r++) {
        m->counts2[r] = mine;
        m->displs2[r] = as_int(m, (int64_t)r * mine);
    }
    float *slices = scratch(m, (size_t)P * (size_t)(mine ? mine : 1) * sizeof(float)); /* (P, mine) */
    MPI_Request req;
    mpi_check(
        m,
        MPI_Ialltoallv(send, m->counts, m->displs, MPI_FLOAT, slices, m->counts2, m->displs2, MPI_FLOAT, m->comm, &req),
        "MPI_Ialltoallv");
    wait_polled(m, &req, "a reduce-scatter");
    for (int i = 0; i < mine; i++) {
        float sum = slices[i];
        for (int r = 1; r < P; r++) sum += slices[(size_t)r * mine + i];
        recv[i] = sum;
    }
}

static void mpi_all_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    layout(m, bytes);
    /* In place when send already sits at this rank's offset in recv. */
    const void *src = (const char *)recv + m->displs[c->rank] == send ? MPI_IN_PLACE : send;
    MPI_Request req;
    mpi_check(m,
              MPI_Iallgatherv(src, m->counts[c->rank], MPI_BYTE, recv, m->counts, m->displs, MPI_BYTE, m->comm, &req),
              "MPI_Iallgatherv");
    wait_polled(m, &req, "an all-gather");
}

static void mpi_gather(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    layout(m, bytes);
    const void *src = c->rank == root && (const char *)recv + m->displs[root] == send ? MPI_IN_PLACE : send;
    MPI_Request req;
    mpi_check(
        m, MPI_Igatherv(src, m->counts[c->rank], MPI_BYTE, recv, m->counts, m->displs, MPI_BYTE, root, m->comm, &req),
        "MPI_Igatherv");
    wait_polled(m, &req, "a gather");
}

static void mpi_scatter(ht_comm *c, const void *send, void *recv, const int64_t *bytes, int root) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    layout(m, bytes);
    void *dst = c->rank == root && (const char *)send + m->displs[root] == recv ? MPI_IN_PLACE : recv;
    MPI_Request req;
    mpi_check(
        m, MPI_Iscatterv(send, m->counts, m->displs, MPI_BYTE, dst, m->counts[c->rank], MPI_BYTE, root, m->comm, &req),
        "MPI_Iscatterv");
    wait_polled(m, &req, "a scatter");
}

/* Balanced slices of n: rank r owns [n·r/P, n·(r+1)/P); a long vector goes
 * in pieces of 4M floats, so that the buffers stay small (each element is
 * still the sum of every rank's value in rank order). */
static void mpi_all_reduce_f32(ht_comm *c, float *buf, int64_t n, ht_reduce_op op) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    if (op == HT_REDUCE_MAX) {
        MPI_Request req;
        mpi_check(m, MPI_Iallreduce(MPI_IN_PLACE, buf, as_int(m, n), MPI_FLOAT, MPI_MAX, m->comm, &req),
                  "MPI_Iallreduce");
        wait_polled(m, &req, "an all-reduce");
        return;
    }
    const int64_t piece = (int64_t)1 << 22;
    int P = c->size;
    int64_t counts[P], bytes[P];
    float *mine = ht_alloc((size_t)((n < piece ? n : piece) / P + 1) * sizeof(float));
    if (!mine) mpi_fatal(m, "out of memory for an all-reduce");
    for (int64_t at = 0; at < n; at += piece) {
        int64_t len = n - at < piece ? n - at : piece;
        float *x = buf + at;
        for (int r = 0; r < P; r++) {
            counts[r] = len * (r + 1) / P - len * r / P;
            bytes[r] = counts[r] * (int64_t)sizeof(float);
        }
        mpi_reduce_scatter_f32(c, x, mine, counts);
        memcpy(x + len * c->rank / P, mine, (size_t)counts[c->rank] * sizeof(float));
        mpi_all_gather(c, x + len * c->rank / P, x, bytes);
    }
    ht_free(mine);
}

/* Small vectors (norms, flags, losses): every rank gathers every rank's
 * values and adds them in rank order itself. */
static void mpi_all_reduce_f64(ht_comm *c, double *buf, int64_t n, ht_reduce_op op) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    int P = c->size, count = as_int(m, n);
    MPI_Request req;
    if (op == HT_REDUCE_MAX) {
        mpi_check(m, MPI_Iallreduce(MPI_IN_PLACE, buf, count, MPI_DOUBLE, MPI_MAX, m->comm, &req), "MPI_Iallreduce");
        wait_polled(m, &req, "an all-reduce");
        return;
    }
    double *all = scratch(m, (size_t)P * (size_t)(count ? count : 1) * sizeof(double));
    mpi_check(m, MPI_Iallgather(buf, count, MPI_DOUBLE, all, count, MPI_DOUBLE, m->comm, &req), "MPI_Iallgather");
    wait_polled(m, &req, "an all-reduce");
    for (int i = 0; i < count; i++) {
        double sum = all[i];
        for (int r = 1; r < P; r++) sum += all[(size_t)r * count + i];
        buf[i] = sum;
    }
}

static void mpi_broadcast(ht_comm *c, void *buf, int64_t bytes, int root) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    MPI_Request req;
    mpi_check(m, MPI_Ibcast(buf, as_int(m, bytes), MPI_BYTE, root, m->comm, &req), "MPI_Ibcast");
    wait_polled(m, &req, "a broadcast");
}

static void mpi_barrier(ht_comm *c) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    MPI_Request req;
    mpi_check(m, MPI_Ibarrier(m->comm, &req), "MPI_Ibarrier");
    wait_polled(m, &req, "a barrier");
}

static void mpi_free(ht_comm *c) {
    drain();
    mpi_comm *m = (mpi_comm *)c;
    bool world = m->world;
    if (!world) MPI_Comm_free(&m->comm);
    ht_free(m->scratch);
    free(m->counts);
    free(m->displs);
    free(m->counts2);
    free(m->displs2);
    free(m->world_ranks);
    free(m);
    if (world) {
        if (watch.roll != MPI_COMM_NULL) MPI_Comm_free(&watch.roll);
        progress_stop();
        MPI_Finalize();
    }
}

static void mpi_abort(ht_comm *c, int code) { MPI_Abort(((mpi_comm *)c)->comm, code); }

static ht_status mpi_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err);

static const ht_comm_ops mpi_ops = {
    .all_reduce_f64 = mpi_all_reduce_f64,
    .all_reduce_f32 = mpi_all_reduce_f32,
    .reduce_scatter_f32 = mpi_reduce_scatter_f32,
    .broadcast = mpi_broadcast,
    .all_gather = mpi_all_gather,
    .gather = mpi_gather,
    .scatter = mpi_scatter,
    .barrier = mpi_barrier,
    .start_exchange = mpi_start_exchange,
    .wait = mpi_wait,
    .split = mpi_split,
    .abort = mpi_abort,
    .free = mpi_free,
    .start_send = mpi_start_send,
    .start_recv = mpi_start_recv,
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
    m->world_ranks = calloc(P, sizeof(int));
    if (!m->counts || !m->displs || !m->counts2 || !m->displs2 || !m->world_ranks) {
        free(m->counts);
        free(m->displs);
        free(m->counts2);
        free(m->displs2);
        free(m->world_ranks);
        free(m);
        if (!world) MPI_Comm_free(&comm);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate an MPI group");
    }
    /* Who is who in the world, for the roll call's message. */
    MPI_Group mine, everyone;
    MPI_Comm_group(comm, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &everyone);
    for (int r = 0; r < m->base.size; r++) m->counts[r] = r;
    MPI_Group_translate_ranks(mine, m->base.size, m->counts, everyone, m->world_ranks);
    MPI_Group_free(&mine);
    MPI_Group_free(&everyone);
    m->group = group_hash(m->world_ranks, m->base.size);
    *out = m;
    return HT_OK;
}

ht_status ht_comm_mpi_init(int *argc, char ***argv, int announced, const char *which, ht_comm **out, ht_error *err) {
    int provided = 0;
    if (MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS)
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
    MPI_Comm_rank(MPI_COMM_WORLD, &watch.world_rank);
    MPI_Comm_dup(MPI_COMM_WORLD, &watch.roll);
    /* The progress thread, where MPI allows a second thread in it. */
    if (provided >= MPI_THREAD_SERIALIZED && pthread_create(&progress.thread, NULL, progress_main, NULL) == 0)
        progress.running = true;
    *out = &m->base;
    return HT_OK;
}

static ht_status mpi_split(ht_comm *c, int color, int key, ht_comm **out, ht_error *err) {
    mpi_comm *parent = (mpi_comm *)c;
    MPI_Comm sub;
    drain();
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

#endif /* HT_NO_MPI */
