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

/* The bytes of each tensor-parallel rank's slice of p (elements of
 * elem_size): the global shape with dim tp_dim cut as ht_param_split cuts it. */
static void slice_bytes(const ht_param *p, int size, int64_t *bytes, size_t elem_size) {
    const int64_t whole = ht_param_global_numel(p), along = p->global_shape[p->tp_dim];
    for (int r = 0; r < size; r++) {
        int64_t first, end;
        ht_param_rows_of(along, r, size, &first, &end);
        bytes[r] = whole / along * (end - first) * (int64_t)elem_size;
    }
}

ht_status ht_param_gather_global(const ht_param *p, ht_comm *shard, ht_comm *tp, const void *rows, ht_dtype dtype,
                                 void *global, bool to_root, void *scratch, ht_error *err) {
    const size_t elem = ht_dtype_size(dtype);
    const bool split = tp && tp->size > 1 && p->tp_dim >= 0;
    int64_t bytes[shard->size > (tp ? tp->size : 1) ? shard->size : (tp ? tp->size : 1)];
    /* A param every place holds whole: the first place's rows are the tensor. */
    if (to_root && !split && tp && tp->size > 1 && tp->rank != 0) return HT_OK;
    void *slice = global, *stage = NULL, *owned = NULL;
    if (split) { /* the slice, then (dim 1) the slices side by side */
        owned = scratch ? NULL : malloc((size_t)(ht_param_numel(p) + ht_param_global_numel(p)) * elem + 1);
        if (!scratch && !owned)
            return ht_fail(err, HT_ERR_OOM, "cannot gather %s's %lld values", p->name,
                           (long long)ht_param_global_numel(p));
        slice = scratch ? scratch : owned;
        stage = p->tp_dim == 0 ? global : (char *)slice + (size_t)ht_param_numel(p) * elem;
    }
    ht_param_row_bytes(p, shard->size, bytes, elem);
    if (to_root)
        ht_gather(shard, rows, shard->rank == 0 ? slice : NULL, bytes, 0);
    else
        ht_all_gather(shard, rows, slice, bytes);
    /* The shard groups' first ranks of one data x context place are one
     * tensor-parallel group: they gather the slices. */
    const bool receives = !to_root || (shard->rank == 0 && (!split || tp->rank == 0));
    if (split && (!to_root || shard->rank == 0)) {
        slice_bytes(p, tp->size, bytes, elem);
        if (to_root)
            ht_gather(tp, slice, tp->rank == 0 ? stage : NULL, bytes, 0);
        else
            ht_all_gather(tp, slice, stage, bytes);
    }
    if (split && receives && stage != global) { /* slices of dim 1 side by side: each into its columns */
        const ht_kernel_ops *K = ht_kernels();
        if (K->owns(global)) { /* the kernels' memory (Muon's FP32 matrices): their row copies */
            if (p->ndim != 2 || dtype != HT_DTYPE_F32 || !K->owns(stage))
                return ht_fail(err, HT_ERR_INVALID, "cannot gather %s's slices in the %s backend's memory", p->name,
                               K->name);
            const int64_t rows = p->global_shape[0], cols = p->global_shape[1];
            const float *at = stage;
            for (int r = 0; r < tp->size; r++) {
                int64_t first, end;
                ht_param_rows_of(cols, r, tp->size, &first, &end);
                K->copy_rows((float *)global + first, cols, at, end - first, rows, end - first, false);
                at += rows * (end - first);
            }
            free(owned);
            return HT_OK;
        }
        ht_box whole = {{0}, {0}}, part = {{0}, {0}};
        for (int d = 0; d < p->ndim; d++) whole.length[d] = part.length[d] = p->global_shape[d];
        const char *at = stage;
        for (int r = 0; r < tp->size; r++) {
            int64_t first, end;
            ht_param_rows_of(p->global_shape[p->tp_dim], r, tp->size, &first, &end);
            part.offset[p->tp_dim] = first;
            part.length[p->tp_dim] = end - first;
            ht_box_copy(p->ndim, global, dtype, &whole, at, dtype, &part);
            at += (size_t)ht_box_numel(p->ndim, &part) * elem;
        }
    }
    free(owned);
    return HT_OK;
}
