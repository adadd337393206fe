/* Pipeline parallelism (docs/DESIGN.md, Pipeline parallelism): the order a
 * rank runs a step's micro-batches in, the slots it keeps their
 * activations in, and the messages between neighbouring stages.
 *
 * P ranks hold V model chunks each (virtual stages; V = 1 without), the
 * model stage of chunk c on rank r being c·P + r: a micro-batch's forward
 * runs chunk 0 on ranks 0 .. P - 1, then chunk 1 on them, and so on; its
 * backward the other way. Each rank has its list of operations, F (i, c)
 * micro-batch i's forward through chunk c and B (i, c) its backward:
 *   GPipe: every forward, then every backward (V = 1);
 *   1F1B: P - r - 1 forwards on rank r, then one forward and one backward
 *     in turn, then the backwards left (Megatron's, and V = 1 of the next);
 *   interleaved 1F1B (V > 1, Megatron's): the forwards in groups of P
 *     micro-batches, each group through chunk 0, then chunk 1, ...; the
 *     backwards the same way with the chunks reversed; (P - r - 1)·2 +
 *     (V - 1)·P forwards first, then one forward and one backward in turn.
 * A rank runs its list in order, each operation as soon as its input is
 * there: a forward receives the previous model stage's output of its
 * micro-batch, a backward the next model stage's gradient (blocking
 * receives, tagged by micro-batch and chunk), and each sends its own result
 * on without waiting (a started send, waited for before its buffer is
 * written again). Every chunk takes its backwards in micro-batch order, as
 * one process's accumulation does: the FP32 main_grad adds the same terms
 * in the same order. */
#include "hypertrain/parallel.h"

#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"

/* An operation: micro-batch i, chunk c, forward or backward. */
static int op_of(int V, int i, int c, bool backward) { return ((i * V + c) << 1) | backward; }

/* Rank r's operations, in its order (2 V m of them). */
static void rank_order(ht_pipe_schedule schedule, int P, int V, int r, int m, int *out) {
    int n = 0;
    if (schedule == HT_PIPE_GPIPE) {
        for (int i = 0; i < m; i++) out[n++] = op_of(V, i, 0, false);
        for (int i = 0; i < m; i++) out[n++] = op_of(V, i, 0, true);
        return;
    }
    /* The k-th forward and backward: groups of P micro-batches, each through every chunk in turn. */
    const int total = m * V;
    int warm = V > 1 ? (P - r - 1) * 2 + (V - 1) * P : P - r - 1;
    warm = warm < total ? warm : total;
#define MICRO(k) ((k) / (P * V) * P + (k) % P)
#define FCHUNK(k) ((k) % (P * V) / P)
    for (int k = 0; k < warm; k++) out[n++] = op_of(V, MICRO(k), FCHUNK(k), false);
    for (int k = 0; k < total - warm; k++) {
        out[n++] = op_of(V, MICRO(warm + k), FCHUNK(warm + k), false);
        out[n++] = op_of(V, MICRO(k), V - 1 - FCHUNK(k), true);
    }
    for (int k = total - warm; k < total; k++) out[n++] = op_of(V, MICRO(k), V - 1 - FCHUNK(k), true);
#undef MICRO
#undef FCHUNK
}

/* The model stage a micro-batch's tensors of chunk c come from before its
 * forward (backward false) or its backward, or go to after it; -1: none
 * (the model's first stage reads tokens, its last computes the loss). Its
 * rank is the stage mod P. */
static int peer(const ht_pipeline *p, int c, bool backward, bool sending) {
    const int P = p->stages, V = p->chunks, q = c * P + p->stage, other = q + (backward != sending ? 1 : -1);
    return other >= 0 && other < P * V ? other : -1;
}

/* Every rank's lists run with blocking receives and sends that never wait:
 * whether they finish, as a check of the schedule (a list that stalls is a
 * bug here, never the user's). done[rank][op]: the op ran. */
static bool finishes(const int *orders, int P, int V, int m) {
    const int n = 2 * V * m;
    int *next = calloc((size_t)P, sizeof(int));
    bool *done = calloc((size_t)P * (size_t)(4 * V * m), sizeof(bool)); /* op codes are below 4 V m */
    bool ok = next && done, moved = true;
    while (ok && moved) {
        moved = false;
        for (int r = 0; r < P; r++) {
            if (next[r] == n) continue;
            const int op = orders[(size_t)r * n + next[r]], c = (op >> 1) % V, i = (op >> 1) / V;
            const bool backward = op & 1;
            const int q = c * P + r, from = backward ? q + 1 : q - 1; /* the model stage it receives from */
            if (from >= 0 && from < P * V && !done[(size_t)(from % P) * 4 * V * m + op_of(V, i, from / P, backward)])
                continue;
            done[(size_t)r * 4 * V * m + op] = true;
            next[r]++, moved = true;
        }
    }
    for (int r = 0; ok && r < P; r++) ok = next[r] == n;
    free(next);
    free(done);
    return ok;
}

ht_status ht_pipeline_init(ht_pipeline *p, ht_pipe_schedule schedule, ht_comm *comm, int chunks, int micro,
                           int64_t floats, int sums, ht_error *err) {
    memset(p, 0, sizeof(*p));
    const int P = comm->size, V = chunks > 1 ? chunks : 1, m = micro, n = 2 * V * m;
    p->comm = comm;
    p->stages = P;
    p->stage = comm->rank;
    p->chunks = V;
    p->micro = m;
    p->floats = floats;
    p->sums = P > 1 ? sums : 0;
    int *orders = malloc((size_t)P * (size_t)n * sizeof(int));
    p->order = malloc((size_t)n * sizeof(int));
    p->slot_of = malloc((size_t)V * (size_t)m * sizeof(int));
    int *used = malloc((size_t)V * (size_t)m * sizeof(int)), *held = calloc((size_t)V, sizeof(int));
    ht_status s = HT_OK;
    if (!orders || !p->order || !p->slot_of || !used || !held)
        s = ht_fail(err, HT_ERR_OOM, "cannot plan the pipeline schedule");
    for (int r = 0; s == HT_OK && r < P; r++) rank_order(schedule, P, V, r, m, orders + (size_t)r * n);
    if (s == HT_OK && !finishes(orders, P, V, m))
        s = ht_fail(err, HT_ERR_INVALID, "the pipeline schedule of %d ranks x %d chunks and %d micro-batches stalls", P,
                    V, m);
    if (s == HT_OK) {
        memcpy(p->order, orders + (size_t)p->stage * n, (size_t)n * sizeof(int));
        /* Per chunk, a forward takes the lowest free slot and its backward frees it: each chunk as many
         * slots as its micro-batches in flight; slot k of chunk c is c·slots_per_chunk + k. */
        int per_chunk = 0;
        for (int k = 0; k < V * m; k++) used[k] = -1;
        for (int k = 0; k < n; k++) {
            const int op = p->order[k], c = (op >> 1) % V, i = (op >> 1) / V;
            int *u = used + (size_t)c * m;
            if (op & 1) {
                u[p->slot_of[c * m + i]] = -1, held[c]--;
                continue;
            }
            int slot = 0;
            while (u[slot] >= 0) slot++;
            u[slot] = i, p->slot_of[c * m + i] = slot;
            if (++held[c] > per_chunk) per_chunk = held[c];
        }
        for (int k = 0; k < V * m; k++) p->slot_of[k] += k / m * per_chunk;
        p->slots = per_chunk * V;
    }
    free(orders);
    free(used);
    free(held);
    if (s != HT_OK) ht_pipeline_free(p);
    return s;
}

size_t ht_pipeline_buffer_bytes(const ht_pipeline *p) {
    return p->stages > 1 ? 3 * (size_t)p->slots * (size_t)p->floats * sizeof(float) : 0;
}

ht_status ht_pipeline_allocate(ht_pipeline *p, ht_error *err) {
    if (p->stages <= 1) return HT_OK;
    const size_t bytes = ht_pipeline_buffer_bytes(p) / 3, S = (size_t)p->slots;
    p->sends = calloc(2 * S, sizeof(ht_request *));
    bool sums = !p->sums || ((p->sum_sends = calloc(2 * S, sizeof(ht_request *))) &&
                             (p->sums_in = calloc(4 * S * (size_t)p->sums, sizeof(double))));
    if (sums && p->sums) {
        p->sums_grad = p->sums_in + S * (size_t)p->sums;
        p->sums_out = p->sums_grad + S * (size_t)p->sums;
    }
    if (p->sends && sums && (p->in = ht_kernels()->alloc(bytes)) && (p->grad = ht_kernels()->alloc(bytes)) &&
        (p->out = ht_kernels()->alloc(bytes)))
        return HT_OK;
    return ht_fail(err, HT_ERR_OOM, "cannot allocate the pipeline's %d slots of %.1f MiB", p->slots,
                   (double)p->floats * sizeof(float) / (1 << 20));
}

void ht_pipeline_free(ht_pipeline *p) {
    /* A step that failed may leave sends started (the run ends the world then): not waited for here. */
    free(p->order);
    free(p->slot_of);
    free(p->sends);
    free(p->sum_sends);
    free(p->sums_in);
    ht_kernels()->free(p->in);
    ht_kernels()->free(p->grad);
    ht_kernels()->free(p->out);
    memset(p, 0, sizeof(*p));
}

int ht_pipeline_slot(const ht_pipeline *p, int micro, int chunk) { return p->slot_of[chunk * p->micro + micro]; }

float *ht_pipeline_input(const ht_pipeline *p, int slot) { return p->in ? p->in + (size_t)slot * p->floats : NULL; }

float *ht_pipeline_grad(const ht_pipeline *p, int slot) { return p->grad ? p->grad + (size_t)slot * p->floats : NULL; }

const double *ht_pipeline_input_sums(const ht_pipeline *p, int slot) {
    return p->sums_in ? p->sums_in + (size_t)slot * (size_t)p->sums : NULL;
}

const double *ht_pipeline_grad_sums(const ht_pipeline *p, int slot) {
    return p->sums_grad ? p->sums_grad + (size_t)slot * (size_t)p->sums : NULL;
}

/* Tags: micro-batch i's activations or gradient from model stage `from` (MPI's tags go to 32767 at least). */
static int tag_of(const ht_pipeline *p, int micro, int from, bool grad) {
    return ((micro * p->stages * p->chunks + from) * 2 + grad) % 32768;
}

/* A started send of a slot (0: its forward output, 1: its input gradient) waited for. */
static void wait_send(ht_pipeline *p, int slot, int which) {
    ht_request **r = &p->sends[2 * slot + which];
    if (*r) ht_wait(p->comm, *r, NULL);
    *r = NULL;
    if (!p->sum_sends) return;
    r = &p->sum_sends[2 * slot + which];
    if (*r) ht_wait(p->comm, *r, NULL);
    *r = NULL;
}

/* The receives of an operation's input and its sums (*sums NULL: none), started: MPI matches messages of one
 * sender and tag in the order they were sent, so the sums' receive, started second, takes the second message. */
static ht_request *start_receive(ht_pipeline *p, int micro, int chunk, bool grad, int64_t floats, int from,
                                 ht_request **sums) {
    const int slot = ht_pipeline_slot(p, micro, chunk), tag = tag_of(p, micro, from, grad);
    float *into = grad ? ht_pipeline_grad(p, slot) : ht_pipeline_input(p, slot);
    ht_request *r = ht_start_recv(p->comm, into, floats * (int64_t)sizeof(float), from % p->stages, tag);
    *sums = NULL;
    if (p->sums) {
        double *at = (grad ? p->sums_grad : p->sums_in) + (size_t)slot * (size_t)p->sums;
        *sums = ht_start_recv(p->comm, at, (int64_t)p->sums * (int64_t)sizeof(double), from % p->stages, tag);
    }
    return r;
}

void ht_pipeline_post(ht_pipeline *p, int micro, int chunk, bool grad, int64_t floats) {
    const int from = p->stages > 1 ? peer(p, chunk, grad, false) : -1;
    if (from < 0 || p->posted) return;
    p->posted = start_receive(p, micro, chunk, grad, floats, from, &p->posted_sums);
    p->posted_op = op_of(p->chunks, micro, chunk, grad);
}

void ht_pipeline_receive(ht_pipeline *p, int micro, int chunk, bool grad, int64_t floats) {
    const int from = p->stages > 1 ? peer(p, chunk, grad, false) : -1, slot = ht_pipeline_slot(p, micro, chunk);
    if (from < 0) return;
    ht_request *r = NULL, *sums = NULL;
    if (p->posted && p->posted_op == op_of(p->chunks, micro, chunk, grad)) /* started during the last operation */
        r = p->posted, sums = p->posted_sums, p->posted = p->posted_sums = NULL;
    else
        r = start_receive(p, micro, chunk, grad, floats, from, &sums);
    /* The next model stage has this slot's forward output once it sends its gradient: that send is done. */
    if (grad) wait_send(p, slot, 0);
    ht_wait(p->comm, r, NULL);
    if (sums) ht_wait(p->comm, sums, NULL);
}

void ht_pipeline_send(ht_pipeline *p, int micro, int chunk, bool grad, const float *sent, int64_t floats,
                      const double *sums) {
    const int to = p->stages > 1 ? peer(p, chunk, grad, true) : -1, slot = ht_pipeline_slot(p, micro, chunk);
    if (to < 0) return;
    /* A forward's output stays in the model's slot until the slot's next forward; an input gradient is
     * the model's until its next backward, so it goes from a copy. */
    wait_send(p, slot, grad);
    if (grad) {
        float *copy = p->out + (size_t)slot * p->floats;
        ht_kernels()->copy(copy, sent, (size_t)floats * sizeof(float));
        sent = copy;
    }
    const int tag = tag_of(p, micro, chunk * p->stages + p->stage, grad);
    p->sends[2 * slot + grad] = ht_start_send(p->comm, sent, floats * (int64_t)sizeof(float), to % p->stages, tag);
    if (!p->sums) return;
    double *copy = p->sums_out + (size_t)(2 * slot + grad) * (size_t)p->sums;
    memcpy(copy, sums, (size_t)p->sums * sizeof(double));
    p->sum_sends[2 * slot + grad] =
        ht_start_send(p->comm, copy, (int64_t)p->sums * (int64_t)sizeof(double), to % p->stages, tag);
}

void ht_pipeline_finish(ht_pipeline *p) {
    for (int slot = 0; p->sends && slot < p->slots; slot++) wait_send(p, slot, 0), wait_send(p, slot, 1);
}
