/* Tensor parallelism's collectives: the model's ht_tensor_parallel sums and
 * maxima over its tensor-parallel group, on the ordered all-reduce (every
 * rank sums in rank order, so the group's ranks hold the same bits). */
#include "hypertrain/kernels.h"
#include "hypertrain/model.h"
#include "hypertrain/parallel.h"

#include <stdlib.h>

/* ctx is the model's ht_tensor_parallel, its group in `group`: each call
 * adds its time and the bytes this rank sends to the model's counters (a
 * ring's all-reduce sends about twice the buffer, an all-gather or a
 * reduce-scatter (size - 1) / size of the whole). */
typedef struct tp_ctx {
    ht_tensor_parallel *tp;
    ht_comm *group;
} tp_ctx;

static double started(void) { return ht_time_seconds(); }

static void done(tp_ctx *c, double t0, double bytes) {
    c->tp->seconds += ht_time_seconds() - t0;
    c->tp->bytes += bytes;
}

/* An all-reduce's share of bytes a rank sends: about twice the buffer's (size - 1) / size. */
static double all_reduce_bytes(const tp_ctx *c, int64_t n, size_t elem) {
    return 2.0 * (double)n * (double)elem * (c->group->size - 1) / c->group->size;
}

static void all_reduce_f32(void *ctx, float *buf, int64_t n, ht_reduce_op op) {
    tp_ctx *c = ctx;
    const double t0 = started();
    ht_all_reduce_f32(c->group, buf, n, op);
    done(c, t0, all_reduce_bytes(c, n, sizeof(float)));
}

static void sum(void *ctx, float *buf, int64_t n) { all_reduce_f32(ctx, buf, n, HT_REDUCE_SUM); }
static void max(void *ctx, float *buf, int64_t n) { all_reduce_f32(ctx, buf, n, HT_REDUCE_MAX); }

static void sum_f64(void *ctx, double *buf, int64_t n) {
    tp_ctx *c = ctx;
    const double t0 = started();
    ht_all_reduce_f64(c->group, buf, n, HT_REDUCE_SUM);
    done(c, t0, all_reduce_bytes(c, n, sizeof(double)));
}

static void all_gather(void *ctx, const void *send, void *recv, int64_t bytes) {
    tp_ctx *c = ctx;
    const double t0 = started();
    int64_t each[c->group->size];
    for (int r = 0; r < c->group->size; r++) each[r] = bytes;
    ht_all_gather(c->group, send, recv, each);
    done(c, t0, (double)bytes * (c->group->size - 1));
}

static void reduce_scatter(void *ctx, const float *send, float *recv, int64_t n) {
    tp_ctx *c = ctx;
    const double t0 = started();
    int64_t counts[c->group->size];
    for (int r = 0; r < c->group->size; r++) counts[r] = n;
    ht_reduce_scatter_f32(c->group, send, recv, counts);
    done(c, t0, (double)n * sizeof(float) * (c->group->size - 1));
}

ht_status ht_tensor_parallel_attach(ht_model *m, ht_comm *group, bool sequence, ht_error *err) {
    const int size = m->tensor.size > 1 ? m->tensor.size : 1;
    if (group->size != size || (size > 1 && group->rank != m->tensor.rank))
        return ht_fail(err, HT_ERR_INVALID,
                       "tensor parallelism: the model was built as rank %d of a group of %d, the group given is "
                       "rank %d of %d",
                       size > 1 ? m->tensor.rank : 0, size, group->rank, group->size);
    if (size <= 1) return HT_OK;
    tp_ctx *c = ht_alloc(sizeof(tp_ctx));
    if (!c) return ht_fail(err, HT_ERR_OOM, "cannot allocate the tensor-parallel state");
    *c = (tp_ctx){.tp = &m->tensor, .group = group};
    ht_free(m->tensor.owned);
    m->tensor.owned = c;
    m->tensor.sum = sum;
    m->tensor.max = max;
    m->tensor.sum_f64 = sum_f64;
    m->tensor.sequence = sequence;
    m->tensor.all_gather = all_gather;
    m->tensor.reduce_scatter = reduce_scatter;
    m->tensor.ctx = c;
    return HT_OK;
}
