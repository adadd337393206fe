/* Pipeline parallelism (docs/DESIGN.md, Pipeline parallelism): the order a
 * stage runs a step's micro-batches in, the slots it keeps their
 * activations in, and the messages between neighbouring stages.
 *
 * Each stage has its list of operations, F i (micro-batch i's forward) and
 * B i (its backward): GPipe every forward, then every backward; 1F1B P - s
 * - 1 forwards on stage s, then one forward and one backward in turn, then
 * the backwards left. A stage runs its list in order, each operation as
 * soon as its input is there: F i receives stage s - 1's output of i, B i
 * stage s + 1's gradient of it (blocking receives, tagged by micro-batch),
 * and each sends its own result on without waiting (a started send, waited
 * for before its buffer is written again). Both schedules take the
 * backwards in micro-batch order, as one process's accumulation does: the
 * FP32 main_grad adds the same terms in the same order. */
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

ht_status ht_pipeline_init(ht_pipeline *p, ht_pipe_schedule schedule, ht_comm *comm, int micro, int64_t floats,
                           ht_error *err) {
    memset(p, 0, sizeof(*p));
    const int P = comm->size, m = micro;
    p->comm = comm;
    p->stages = P;
    p->stage = comm->rank;
    p->micro = m;
    p->floats = floats;
    p->order = malloc((size_t)2 * (size_t)m * sizeof(int));
    p->slot_of = malloc((size_t)m * sizeof(int));
    int *used = malloc((size_t)m * sizeof(int)); /* each slot's micro-batch, -1: free */
    if (!p->order || !p->slot_of || !used) {
        free(used);
        ht_pipeline_free(p);
        return ht_fail(err, HT_ERR_OOM, "cannot plan the pipeline schedule");
    }
    stage_order(schedule, P, p->stage, m, p->order);
    /* A forward takes the lowest free slot, its backward frees it: as many slots as micro-batches in flight. */
    for (int k = 0; k < m; k++) used[k] = -1;
    for (int k = 0, held = 0; k < 2 * m; k++) {
        const int i = p->order[k] / 2;
        if (p->order[k] % 2 == 0) {
            int slot = 0;
            while (used[slot] >= 0) slot++;
            used[slot] = i, p->slot_of[i] = slot;
            if (++held > p->slots) p->slots = held;
        } else {
            used[p->slot_of[i]] = -1, held--;
        }
    }
    free(used);
    return HT_OK;
}

size_t ht_pipeline_buffer_bytes(const ht_pipeline *p) {
    return p->stages > 1 ? 3 * (size_t)p->slots * (size_t)p->floats * sizeof(float) : 0;
}

ht_status ht_pipeline_allocate(ht_pipeline *p, ht_error *err) {
    if (p->stages <= 1) return HT_OK;
    const size_t bytes = ht_pipeline_buffer_bytes(p) / 3;
    p->sends = calloc(2 * (size_t)p->slots, sizeof(ht_request *));
    if (p->sends && (p->in = ht_kernels()->alloc(bytes)) && (p->grad = ht_kernels()->alloc(bytes)) &&
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
    ht_kernels()->free(p->in);
    ht_kernels()->free(p->grad);
    ht_kernels()->free(p->out);
    memset(p, 0, sizeof(*p));
}

float *ht_pipeline_input(const ht_pipeline *p, int slot) { return p->in ? p->in + (size_t)slot * p->floats : NULL; }

float *ht_pipeline_grad(const ht_pipeline *p, int slot) { return p->grad ? p->grad + (size_t)slot * p->floats : NULL; }

/* Tags: micro-batch i's activations 2i, its gradient 2i + 1 (MPI's tags go to 32767 at least). */
static int tag_of(int micro, bool grad) { return (2 * micro + grad) % 32768; }

/* A started send of a slot (0: its forward output, 1: its input gradient) waited for. */
static void wait_send(ht_pipeline *p, int slot, int which) {
    ht_request **r = &p->sends[2 * slot + which];
    if (*r) ht_wait(p->comm, *r, NULL);
    *r = NULL;
}

void ht_pipeline_receive(ht_pipeline *p, int micro, bool grad, int64_t floats) {
    const int slot = p->slot_of[micro];
    if (p->stages <= 1 || (grad ? p->stage == p->stages - 1 : p->stage == 0)) return;
    /* The next stage has this slot's forward output once it sends its gradient: that send is done. */
    if (grad) wait_send(p, slot, 0);
    float *into = grad ? ht_pipeline_grad(p, slot) : ht_pipeline_input(p, slot);
    const int from = grad ? p->stage + 1 : p->stage - 1;
    ht_wait(p->comm, ht_start_recv(p->comm, into, floats * (int64_t)sizeof(float), from, tag_of(micro, grad)), NULL);
}

void ht_pipeline_send(ht_pipeline *p, int micro, bool grad, const float *sent, int64_t floats) {
    const int slot = p->slot_of[micro];
    if (p->stages <= 1 || (grad ? p->stage == 0 : p->stage == p->stages - 1)) return;
    /* A forward's output stays in the model's slot until the slot's next forward; an input gradient is
     * the model's until its next backward, so it goes from a copy. */
    wait_send(p, slot, grad);
    if (grad) {
        float *copy = p->out + (size_t)slot * p->floats;
        ht_kernels()->copy(copy, sent, (size_t)floats * sizeof(float));
        sent = copy;
    }
    const int to = grad ? p->stage - 1 : p->stage + 1;
    p->sends[2 * slot + grad] = ht_start_send(p->comm, sent, floats * (int64_t)sizeof(float), to, tag_of(micro, grad));
}

void ht_pipeline_finish(ht_pipeline *p) {
    for (int slot = 0; p->sends && slot < p->slots; slot++) wait_send(p, slot, 0), wait_send(p, slot, 1);
}
