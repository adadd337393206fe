/* Pipeline parallelism (docs/DESIGN.md, Pipeline parallelism): the order a
 * stage runs a step's micro-batches in, laid out in ticks, and the
 * activations and gradients that cross between neighbouring stages after
 * each tick.
 *
 * Each stage has its list of operations, F i (micro-batch i's forward) and
 * B i (its backward): GPipe every forward, then every backward; 1F1B P - s
 * - 1 forwards on stage s, then one forward and one backward in turn, then
 * the backwards left. In ticks every stage takes its next operation once
 * what it needs arrived in an earlier tick (F i on stage s: stage s - 1's F
 * i; B i: stage s + 1's B i), or waits. After a tick, each forward's output
 * goes to the next stage and each backward's input gradient to the
 * previous, in one exchange over the pipeline group. The table is the same
 * on every rank, so every rank knows which ticks exchange and who sends
 * what. Both schedules take the backwards in micro-batch order, as one
 * process's accumulation does: the FP32 main_grad adds the same terms in the
 * same order. */
#include "hypertrain/parallel.h"

#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"

/* Stage s's operations, in its order: 2i forward of micro-batch i, 2i + 1 its backward. */
static void stage_order(ht_pipe_schedule schedule, int P, int s, int m, int *out) {
    int n = 0;
    if (schedule == HT_PIPE_GPIPE) {
        for (int i = 0; i < m; i++) out[n++] = 2 * i;
        for (int i = 0; i < m; i++) out[n++] = 2 * i + 1;
        return;
    }
    const int warm = P - s - 1 < m ? P - s - 1 : m;
    for (int i = 0; i < warm; i++) out[n++] = 2 * i;
    for (int i = 0; i < m - warm; i++) out[n++] = 2 * (warm + i), out[n++] = 2 * i + 1;
    for (int i = m - warm; i < m; i++) out[n++] = 2 * i + 1;
}

/* The smallest slot index free on a stage (used: its slots' owners, -1 free). */
static int take_slot(int *used, int cap, int micro) {
    for (int k = 0; k < cap; k++)
        if (used[k] < 0) {
            used[k] = micro;
            return k;
        }
    return -1;
}

ht_status ht_pipeline_init(ht_pipeline *p, ht_pipe_schedule schedule, ht_comm *comm, int micro, int64_t floats,
                           ht_error *err) {
    memset(p, 0, sizeof(*p));
    const int P = comm->size, m = micro, max_ticks = 2 * (m + P);
    p->comm = comm;
    p->stages = P;
    p->stage = comm->rank;
    p->micro = m;
    p->floats = floats;
    p->ops = malloc((size_t)max_ticks * (size_t)P * sizeof(int));
    p->slot_of = malloc((size_t)P * (size_t)m * sizeof(int));
    int *order = malloc((size_t)P * 2 * (size_t)m * sizeof(int)), *next = calloc((size_t)P, sizeof(int));
    int *done = malloc((size_t)P * 2 * (size_t)m * sizeof(int)); /* the tick each operation ran in, -1: not yet */
    int *used = malloc((size_t)P * (size_t)m * sizeof(int)), *most = calloc((size_t)P, sizeof(int));
    ht_status s = HT_OK;
    if (!p->ops || !p->slot_of || !order || !next || !done || !used || !most)
        s = ht_fail(err, HT_ERR_OOM, "cannot plan the pipeline schedule");
    for (int q = 0; s == HT_OK && q < P; q++) stage_order(schedule, P, q, m, order + (size_t)q * 2 * m);
    if (s == HT_OK) {
        for (int k = 0; k < P * 2 * m; k++) done[k] = -1;
        for (int k = 0; k < P * m; k++) used[k] = -1;
    }
    int finished = 0, k = 0;
    for (; s == HT_OK && finished < P; k++) {
        if (k == max_ticks) { /* a schedule that cannot finish: a bug here, never the user's */
            s = ht_fail(err, HT_ERR_INVALID, "pipeline schedule of %d stages and %d micro-batches does not finish", P,
                        m);
            break;
        }
        int *row = p->ops + (size_t)k * P;
        for (int q = 0; q < P; q++) {
            row[q] = -1;
            if (next[q] == 2 * m) continue;
            const int op = order[(size_t)q * 2 * m + next[q]], i = op / 2;
            const int before = op % 2 == 0 ? (q == 0 ? -2 : done[((size_t)q - 1) * 2 * m + 2 * i])
                                           : (q == P - 1 ? done[(size_t)q * 2 * m + 2 * i]
                                                         : done[((size_t)q + 1) * 2 * m + 2 * i + 1]);
            if (before == -1 || before >= k) continue; /* what it needs is not here yet */
            row[q] = op;
            done[(size_t)q * 2 * m + op] = k;
            finished += ++next[q] == 2 * m;
            if (op % 2 == 0 && q == 0) p->slot_of[i] = take_slot(used, m, i);
        }
        /* A slot is free once its backward ran, then the activations that arrive after the tick take theirs. */
        for (int q = 0; q < P; q++)
            if (row[q] >= 0 && row[q] % 2 == 1) used[(size_t)q * m + p->slot_of[(size_t)q * m + row[q] / 2]] = -1;
        for (int q = 1; q < P; q++)
            if (row[q - 1] >= 0 && row[q - 1] % 2 == 0) {
                const int i = row[q - 1] / 2;
                p->slot_of[(size_t)q * m + i] = take_slot(used + (size_t)q * m, m, i);
            }
        for (int q = 0; q < P; q++) {
            int n = 0;
            for (int j = 0; j < m; j++) n += used[(size_t)q * m + j] >= 0;
            if (n > most[q]) most[q] = n;
        }
    }
    p->ticks = k;
    p->slots = s == HT_OK ? most[p->stage] : 0;
    free(order);
    free(next);
    free(done);
    free(used);
    free(most);
    if (s != HT_OK) ht_pipeline_free(p);
    return s;
}

size_t ht_pipeline_buffer_bytes(const ht_pipeline *p) {
    return p->stages > 1 ? 2 * (size_t)p->slots * (size_t)p->floats * sizeof(float) : 0;
}

ht_status ht_pipeline_allocate(ht_pipeline *p, ht_error *err) {
    if (p->stages <= 1) return HT_OK;
    const size_t bytes = ht_pipeline_buffer_bytes(p) / 2;
    if ((p->in = ht_kernels()->alloc(bytes)) && (p->grad = ht_kernels()->alloc(bytes))) return HT_OK;
    return ht_fail(err, HT_ERR_OOM, "cannot allocate the pipeline's %d slots of %.1f MiB", p->slots,
                   (double)p->floats * sizeof(float) / (1 << 20));
}

void ht_pipeline_free(ht_pipeline *p) {
    free(p->ops);
    free(p->slot_of);
    ht_kernels()->free(p->in);
    ht_kernels()->free(p->grad);
    memset(p, 0, sizeof(*p));
}

int ht_pipeline_op(const ht_pipeline *p, int tick, int stage) { return p->ops[(size_t)tick * p->stages + stage]; }

int ht_pipeline_slot(const ht_pipeline *p, int stage, int micro) {
    return p->slot_of[(size_t)stage * p->micro + micro];
}

float *ht_pipeline_input(const ht_pipeline *p, int slot) { return p->in ? p->in + (size_t)slot * p->floats : NULL; }

float *ht_pipeline_grad(const ht_pipeline *p, int slot) { return p->grad ? p->grad + (size_t)slot * p->floats : NULL; }

void ht_pipeline_exchange(const ht_pipeline *p, const int *row, const float *sent, int64_t floats) {
    const int P = p->stages, s = p->stage;
    if (P <= 1) return;
    bool any = false; /* the same answer on every rank: the row is */
    for (int q = 0; q < P && !any; q++) any = row[q] >= 0 && (row[q] % 2 == 0 ? q < P - 1 : q > 0);
    if (!any) return;
    const int64_t bytes = floats * (int64_t)sizeof(float);
    ht_span out = {(void *)sent, bytes}, in[2];
    int to = -1, n = 0, from[2];
    if (row[s] >= 0 && sent) to = row[s] % 2 == 0 ? (s < P - 1 ? s + 1 : -1) : (s > 0 ? s - 1 : -1);
    if (s > 0 && row[s - 1] >= 0 && row[s - 1] % 2 == 0) /* the previous stage's output: this stage's input */
        from[n] = s - 1, in[n++] = (ht_span){ht_pipeline_input(p, ht_pipeline_slot(p, s, row[s - 1] / 2)), bytes};
    if (s < P - 1 && row[s + 1] >= 0 && row[s + 1] % 2 == 1) /* the next stage's input gradient: this one's output's */
        from[n] = s + 1, in[n++] = (ht_span){ht_pipeline_grad(p, ht_pipeline_slot(p, s, row[s + 1] / 2)), bytes};
    int first_out[P + 1], first_in[P + 1];
    for (int q = 0, k = 0; q <= P; q++) {
        first_out[q] = q > to && to >= 0;
        first_in[q] = k;
        if (q < P && k < n && from[k] == q) k++;
    }
    const ht_spans send = {&out, first_out}, recv = {in, first_in};
    ht_wait(p->comm, ht_start_exchange(p->comm, &send, &recv), NULL);
}
