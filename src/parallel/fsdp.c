/* FSDP units over a process group. Each rank holds rows [row0, row1) of every
 * parameter's data, FP32 main param, main_grad and optimizer state. The
 * model's modules group into units (ht_fsdp_options); the hooks around each
 * module's forward and backward give a unit's params whole weights only
 * while its modules run, and a whole FP32 gradient only from its backward
 * until the reduce-scatter lands each rank's rows in main_grad.
 *
 * Per unit and step (reshard_after_forward, the default):
 *   forward:  all-gather (prefetched while the previous module computes),
 *             forward, drop the whole weights;
 *   backward: all-gather again (prefetched), backward into a zeroed whole
 *             FP32 gradient, reduce-scatter it (in flight while the next
 *             module computes), main_grad rows += the sum over ranks.
 * One collective per unit each way: an all-to-all of scattered memory
 * (ht_start_exchange), so that nothing is packed or unpacked: every rank
 * sends its compute_rows of each param straight into the others' whole
 * tensors, and each rank's rows of the whole gradients straight to it
 * (with a 16-bit reduce_dtype, from a copy rounded to it). */
#include "hypertrain/parallel.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "hypertrain/model.h"

/* ------------------------------------------------------------------ buffers */

/* Whole weights and gradients come from a pool of the kernels' memory: a
 * unit's buffer goes back when the unit is released and serves the next
 * unit of a size it fits (the layers share a few buffers between them). */
typedef struct pool_buf {
    void *ptr;
    size_t bytes;
    bool used;
} pool_buf;

typedef struct pool {
    const ht_kernel_ops *K; /* whose memory */
    pool_buf *bufs;
    int count, cap;
    size_t held, peak; /* bytes in use now, and at most */
    size_t bytes;      /* of every buffer it holds, used or not: what it allocated */
    bool dry;          /* buffers counted, not allocated (ht_fsdp_plan_bytes): each a distinct address never read */
} pool;

static void *pool_get(pool *pl, size_t bytes, bool zero) {
    int best = -1;
    for (int i = 0; i < pl->count; i++)
        if (!pl->bufs[i].used && pl->bufs[i].bytes >= bytes && (best < 0 || pl->bufs[i].bytes < pl->bufs[best].bytes))
            best = i;
    if (best < 0) {
        if (pl->count == pl->cap) {
            int cap = pl->cap ? 2 * pl->cap : 8;
            pool_buf *b = realloc(pl->bufs, (size_t)cap * sizeof(pool_buf));
            if (!b) return NULL;
            pl->bufs = b;
            pl->cap = cap;
        }
        void *ptr = pl->dry ? (void *)(uintptr_t)(64 * ((size_t)pl->count + 1)) : pl->K->alloc(bytes);
        if (!ptr) return NULL;
        pl->bytes += bytes;
        best = pl->count++;
        pl->bufs[best] = (pool_buf){ptr, bytes, false};
        zero = false; /* the backends' alloc zeroes */
    }
    pool_buf *b = &pl->bufs[best];
    b->used = true;
    pl->held += b->bytes;
    if (pl->held > pl->peak) pl->peak = pl->held;
    if (zero && !pl->dry) pl->K->zero(b->ptr, bytes);
    return b->ptr;
}

static void pool_put(pool *pl, void *ptr) {
    for (int i = 0; ptr && i < pl->count; i++)
        if (pl->bufs[i].ptr == ptr) {
            pl->bufs[i].used = false;
            pl->held -= pl->bufs[i].bytes;
            return;
        }
}

static void pool_free(pool *pl) {
    for (int i = 0; i < pl->count && !pl->dry; i++) pl->K->free(pl->bufs[i].ptr);
    free(pl->bufs);
    pl->bufs = NULL;
    pl->count = pl->cap = 0;
    pl->bytes = 0;
}

/* ------------------------------------------------------------------ units */

typedef struct unit {
    char name[HT_PARAM_NAME_MAX]; /* the module's name, or "root" */
    bool root;
    /* The ranks it gathers and reduces over: comm, whose rank 0 is rank
     * `first` of the FSDP group (the whole group; an expert unit's: the ranks
     * holding the same experts). Its whole tensors hold those ranks' rows,
     * from row0[i] of each param on. */
    ht_comm *comm;
    int first;
    bool experts;
    int64_t *row0;
    bool resident; /* unsharded: the params are whole already, nothing moves */
    int count;
    ht_param **params; /* (count) */
    size_t *woff;      /* (count) byte offset of each whole weight in the gathered buffer */
    size_t *goff;      /* (count) float offset of each whole gradient in the gradient buffer */
    size_t *soff;      /* (count) float offset of each param's rows in one rank's slice of the stage */
    size_t weight_bytes, grad_floats, rows_floats; /* whole weights, whole gradients, this rank's rows */
    int first_use, last_use;                       /* modules (forward order) reading it */
    /* state */
    void *weights;         /* the gathered whole weights, or NULL */
    ht_request *gathering; /* their all-gather, not waited for yet */
    float *grad;           /* the whole gradients while backward runs, or NULL */
    void *sent;            /* a whole gradient being reduced, in reduce_dtype (the previous backward's grad) */
    void *stage;           /* (world, rows_floats) in reduce_dtype: every rank's gradients of this rank's rows */
    ht_request *reducing;  /* the reduce-scatter of sent into stage */
    double gather_began, reduce_began; /* when they were started (training.trace's spans) */
} unit;

struct ht_fsdp {
    ht_model *model;
    ht_comm *comm;
    ht_fsdp_options opt;
    /* ht_fsdp_plan_bytes: the weights' dtype as ht_params_set_compute(plan_compute, plan_precision) will make it
     * (the declared params' compute_dtype is their own until then); HT_DTYPE_COUNT: the params' own now. */
    ht_dtype plan_compute, plan_precision;
    unit *units;
    int unit_count;
    int **uses; /* (module_count) the units each module reads, -1 ended */
    pool pool;
    int reducing; /* the unit whose reduce-scatter is in flight (one at a time); -1: none */
    ht_fsdp_stats stats;
    /* scratch for building span lists */
    ht_span *spans;
    int span_cap;
};

static ht_status add_unit(ht_fsdp *f, const char *name, bool root, ht_error *err) {
    unit *u = realloc(f->units, (size_t)(f->unit_count + 1) * sizeof(unit));
    if (!u) return ht_fail(err, HT_ERR_OOM, "cannot allocate FSDP units");
    f->units = u;
    u = &f->units[f->unit_count++];
    memset(u, 0, sizeof(*u));
    snprintf(u->name, sizeof(u->name), "%s", name);
    u->root = root;
    u->first_use = -1;
    u->comm = f->comm;
    return HT_OK;
}

/* The rows [r0, r1) of p's dim 0 that ranks [first, first + size) of the FSDP group hold. */
static void group_rows(const ht_fsdp *f, const ht_param *p, int first, int size, int64_t *r0, int64_t *r1) {
    int64_t a, b;
    ht_param_rows_of(p->shape[0], first, f->comm->size, r0, &a);
    ht_param_rows_of(p->shape[0], first + size - 1, f->comm->size, &b, r1);
}

/* Expert parallelism: whether p is an expert param (a 3-D param under a
 * module of the plan), and the unit of its module, made on first use. */
static ht_status expert_unit(ht_fsdp *f, const ht_param *p, int *unit_index, ht_error *err) {
    *unit_index = -1;
    if (!f->opt.expert_group || p->ndim != 3) return HT_OK;
    static const char *const by_default[] = {"model.layers.{*}.mlp.experts"};
    const char *const *patterns = f->opt.expert_count ? f->opt.expert_modules : by_default;
    int count = f->opt.expert_count ? f->opt.expert_count : 1;
    bool covered = false;
    for (int i = 0; i < count && !covered; i++) covered = ht_path_covers(patterns[i], p->name);
    if (!covered) return HT_OK;
    char module[HT_PARAM_NAME_MAX];
    snprintf(module, sizeof(module), "%s", p->name);
    char *dot = strrchr(module, '.');
    if (dot) *dot = 0;
    for (int ui = 0; ui < f->unit_count; ui++)
        if (f->units[ui].experts && strcmp(f->units[ui].name, module) == 0) {
            *unit_index = ui;
            return HT_OK;
        }
    ht_status s = add_unit(f, module, false, err);
    if (s != HT_OK) return s;
    unit *u = &f->units[f->unit_count - 1];
    u->experts = true;
    u->comm = f->opt.expert_group;
    u->first = f->opt.expert_first;
    *unit_index = f->unit_count - 1;
    return HT_OK;
}

/* Which unit every param goes to: the unit of the matched module(s) reading
 * it when they are one, else the root. */
static ht_status plan_units(ht_fsdp *f, ht_error *err) {
    ht_model *m = f->model;
    ht_param_store *ps = &m->params;
    int unit_of_module[m->module_count];
    bool matched[f->opt.apply_count > 0 ? f->opt.apply_count : 1];
    memset(matched, 0, sizeof(matched));
    ht_status s = add_unit(f, "root", true, err);
    for (int k = 0; s == HT_OK && k < m->module_count; k++) {
        unit_of_module[k] = 0;
        for (int i = 0; i < f->opt.apply_count; i++) {
            if (!ht_path_match(f->opt.apply_modules[i], m->modules[k].name)) continue;
            matched[i] = true;
            if (unit_of_module[k] == 0) {
                unit_of_module[k] = f->unit_count;
                s = add_unit(f, m->modules[k].name, false, err);
            }
        }
    }
    if (s != HT_OK) return s;
    for (int i = 0; i < f->opt.apply_count; i++) {
        if (matched[i]) continue;
        char list[1024];
        ht_model_module_list(m, list, sizeof(list));
        return ht_fail(err, HT_ERR_CONFIG,
                       "parallel.fsdp_plan.apply_modules: '%s' matches no module of this model (its modules: %s)",
                       f->opt.apply_modules[i], list);
    }
    /* Each param: the one unit all the modules reading it belong to, else the root. */
    int *owner = malloc((size_t)ps->count * sizeof(int));
    if (!owner) return ht_fail(err, HT_ERR_OOM, "cannot plan the FSDP units");
    for (int i = 0; i < ps->count; i++) owner[i] = -2; /* read by no module */
    for (int k = 0; k < m->module_count; k++)
        for (int j = 0; j < m->modules[k].param_count; j++) {
            int i = (int)(m->modules[k].params[j] - ps->items);
            owner[i] = owner[i] == -2 || owner[i] == unit_of_module[k] ? unit_of_module[k] : 0;
        }
    for (int i = 0; i < ps->count; i++) {
        if (owner[i] != -2) continue;
        free(owner);
        return ht_fail(err, HT_ERR_INVALID, "FSDP: parameter %s is read by no module of the model", ps->items[i].name);
    }
    for (int i = 0; i < ps->count; i++) {
        int ui;
        ht_status es = expert_unit(f, &ps->items[i], &ui, err);
        if (es == HT_OK && ui < 0 && f->opt.expert_group && strstr(ps->items[i].name, ".mlp.experts."))
            /* The model computes only its group's experts: every expert param must be gathered for them. */
            es = ht_fail(err, HT_ERR_CONFIG,
                         "parallel.ep_plan.apply_modules does not cover %s: with expert parallelism every sparse "
                         "layer's experts are split over the ranks (leave it empty, or list "
                         "\"model.layers.{*}.mlp.experts\")",
                         ps->items[i].name);
        if (es != HT_OK) {
            free(owner);
            return es;
        }
        if (ui >= 0) owner[i] = ui;
    }
    for (int k = 0; f->opt.expert_group && k < f->opt.expert_count; k++) {
        bool any = false;
        for (int i = 0; i < ps->count && !any; i++)
            any = ps->items[i].ndim == 3 && ht_path_covers(f->opt.expert_modules[k], ps->items[i].name);
        if (!any) {
            free(owner);
            return ht_fail(err, HT_ERR_CONFIG,
                           "parallel.ep_plan.apply_modules: '%s' covers no experts of this model (its experts are "
                           "model.layers.N.mlp.experts for the sparse layers N)",
                           f->opt.expert_modules[k]);
        }
    }
    for (int ui = 0; ui < f->unit_count; ui++) {
        unit *u = &f->units[ui];
        for (int i = 0; i < ps->count; i++) u->count += owner[i] == ui;
        u->params = calloc((size_t)(u->count ? u->count : 1), sizeof(ht_param *));
        u->woff = calloc((size_t)(u->count ? u->count : 1), sizeof(size_t));
        u->goff = calloc((size_t)(u->count ? u->count : 1), sizeof(size_t));
        u->soff = calloc((size_t)(u->count ? u->count : 1), sizeof(size_t));
        u->row0 = calloc((size_t)(u->count ? u->count : 1), sizeof(int64_t));
        if (!u->params || !u->woff || !u->goff || !u->soff || !u->row0) {
            free(owner);
            return ht_fail(err, HT_ERR_OOM, "cannot plan the FSDP units");
        }
        int n = 0;
        u->resident = true;
        for (int i = 0; i < ps->count; i++) {
            if (owner[i] != ui) continue;
            ht_param *p = &ps->items[i];
            int64_t r0 = 0, r1 = p->shape[0];
            if (u->experts) group_rows(f, p, u->first, u->comm->size, &r0, &r1);
            const int64_t whole = (r1 - r0) * ht_param_row_numel(p);
            u->params[n] = p;
            u->row0[n] = r0;
            u->woff[n] = u->weight_bytes;
            const ht_dtype wd = f->plan_compute == HT_DTYPE_COUNT
                                    ? p->compute_dtype
                                    : ht_param_compute_dtype_for(p, f->plan_compute, f->plan_precision);
            u->weight_bytes += ht_align64((size_t)whole * ht_dtype_size(wd));
            /* A frozen param (model.freeze) has no gradient: no buffer, nothing to reduce. */
            if (p->trainable) {
                u->goff[n] = u->grad_floats;
                u->soff[n] = u->rows_floats;
                u->grad_floats += ht_align64((size_t)whole * sizeof(float)) / sizeof(float);
                u->rows_floats += (size_t)ht_param_local_numel(p);
            }
            u->resident = u->resident && !p->sharded;
            n++;
        }
    }
    free(owner);
    /* Which units each module reads, and the first and last module reading each unit. */
    f->uses = calloc((size_t)m->module_count, sizeof(int *));
    if (!f->uses) return ht_fail(err, HT_ERR_OOM, "cannot plan the FSDP units");
    for (int k = 0; k < m->module_count; k++) {
        f->uses[k] = malloc((size_t)(f->unit_count + 1) * sizeof(int));
        if (!f->uses[k]) return ht_fail(err, HT_ERR_OOM, "cannot plan the FSDP units");
        int n = 0;
        for (int ui = 0; ui < f->unit_count; ui++) {
            unit *u = &f->units[ui];
            bool reads = false;
            for (int j = 0; j < m->modules[k].param_count && !reads; j++)
                for (int q = 0; q < u->count && !reads; q++) reads = m->modules[k].params[j] == u->params[q];
            if (!reads) continue;
            f->uses[k][n++] = ui;
            if (u->first_use < 0) u->first_use = k;
            u->last_use = k;
        }
        f->uses[k][n] = -1;
    }
    return HT_OK;
}

/* ------------------------------------------------------------------ collectives */

static bool reserve_spans(ht_fsdp *f, int n) {
    if (n <= f->span_cap) return true;
    ht_span *s = realloc(f->spans, (size_t)n * sizeof(ht_span));
    if (!s) return false;
    f->spans = s;
    f->span_cap = n;
    return true;
}

static void fatal(ht_fsdp *f, const char *what, const unit *u) {
    fprintf(stderr, "[hypertrain error rank %d] FSDP unit %s: %s\n", f->comm->rank, u->name, what);
    ht_comm_abort(f->comm, 1);
    abort();
}

/* Starts the all-gather of u's whole weights: this rank's compute_rows of
 * every param to every rank, rank r's rows into their place. */
static void start_gather(ht_fsdp *f, unit *u) {
    if (u->resident || u->weights || u->gathering) return;
    int P = u->comm->size, W = f->comm->size, n = u->count;
    u->weights = pool_get(&f->pool, u->weight_bytes ? u->weight_bytes : 64, false);
    if (f->pool.dry) return;
    if (!u->weights || !reserve_spans(f, 2 * P * n + 2)) fatal(f, "out of memory for the gathered weights", u);
    ht_span *send = f->spans, *recv = f->spans + P * n;
    int sfirst[P + 1], rfirst[P + 1];
    for (int r = 0; r < P; r++) {
        sfirst[r] = r * n;
        rfirst[r] = r * n;
        for (int i = 0; i < n; i++) {
            ht_param *p = u->params[i];
            size_t es = ht_dtype_size(p->compute_dtype), row = (size_t)ht_param_row_numel(p) * es;
            int64_t r0, r1;
            ht_param_rows_of(p->shape[0], u->first + r, W, &r0, &r1);
            send[r * n + i] = (ht_span){p->compute_rows, (int64_t)((size_t)ht_param_local_numel(p) * es)};
            recv[r * n + i] = (ht_span){(char *)u->weights + u->woff[i] + (size_t)(r0 - u->row0[i]) * row,
                                        (int64_t)((size_t)(r1 - r0) * row)};
        }
    }
    sfirst[P] = rfirst[P] = P * n;
    ht_spans s = {send, sfirst}, rv = {recv, rfirst};
    u->gather_began = ht_time_seconds();
    u->gathering = ht_start_exchange(u->comm, &s, &rv);
    f->stats.gathers++;
    f->stats.gathered_bytes += (double)u->weight_bytes;
}

/* Waits for r; returns its time in flight. */
static double wait_timed(ht_fsdp *f, ht_comm *comm, ht_request *r) {
    double t0 = ht_time_seconds(), flight = 0.0;
    ht_wait(comm, r, &flight);
    f->stats.waited_seconds += ht_time_seconds() - t0;
    f->stats.in_flight_seconds += flight;
    return flight;
}

/* training.trace: a unit's exchange as a span of its own track, from its
 * start for its time in flight (it runs beside the compute). */
static void trace_exchange(const unit *u, int track, double began, double flight, double bytes) {
    if (!ht_trace_on) return;
    char name[HT_PARAM_NAME_MAX + 32];
    snprintf(name, sizeof(name), "%s %s", track == HT_TRACE_GATHERS ? "all-gather" : "reduce-scatter", u->name);
    ht_trace_span("fsdp", name, track, began, began + flight, (int64_t)bytes, -1);
}

/* u's whole weights, gathered and in place for its params' `compute`. */
static void use_weights(ht_fsdp *f, unit *u) {
    if (u->resident) return;
    start_gather(f, u);
    if (f->pool.dry) return;
    if (u->gathering) {
        trace_exchange(u, HT_TRACE_GATHERS, u->gather_began, wait_timed(f, u->comm, u->gathering),
                       (double)u->weight_bytes);
        u->gathering = NULL;
    }
    for (int i = 0; i < u->count; i++) u->params[i]->compute = (char *)u->weights + u->woff[i];
}

static void release_weights(ht_fsdp *f, unit *u) {
    if (u->resident || !u->weights) return;
    if (u->gathering) { /* a prefetch never used: it still has to complete */
        trace_exchange(u, HT_TRACE_GATHERS, u->gather_began, wait_timed(f, u->comm, u->gathering),
                       (double)u->weight_bytes);
        u->gathering = NULL;
    }
    for (int i = 0; i < u->count && !f->pool.dry; i++) u->params[i]->compute = NULL;
    pool_put(&f->pool, u->weights);
    u->weights = NULL;
}

static void use_grads(ht_fsdp *f, unit *u) {
    if (u->resident || u->grad || u->grad_floats == 0) return;
    u->grad = pool_get(&f->pool, u->grad_floats * sizeof(float) + 64, true);
    if (!u->grad) fatal(f, "out of memory for the whole gradients", u);
    for (int i = 0; i < u->count && !f->pool.dry; i++)
        if (u->params[i]->trainable) u->params[i]->grad = u->grad + u->goff[i];
}

/* Element i of gradients that travelled in `dtype`, widened to FP32. */
static inline float received(const void *v, ht_dtype dtype, size_t i) {
    if (dtype == HT_DTYPE_F32) return ((const float *)v)[i];
    return dtype == HT_DTYPE_BF16 ? ht_bf16_to_f32(((const uint16_t *)v)[i]) : ht_f16_to_f32(((const uint16_t *)v)[i]);
}

/* out (n floats) = the sum in rank order, in FP32, of P contributions in
 * `dtype` at stage + r x stride elements, with the kernels' entries where
 * their memory is not the host's: each contribution widened (`convert`)
 * and accumulated in turn, the host loop's additions in its order.
 * widened: n floats of scratch for 16-bit contributions. */
static void sum_contributions(float *out, const void *stage, ht_dtype dtype, size_t stride, size_t n, int P,
                              float *widened) {
    const ht_kernel_ops *K = ht_kernels();
    const size_t es = ht_dtype_size(dtype);
    K->convert(out, HT_DTYPE_F32, stage, dtype, n);
    for (int r = 1; r < P; r++) {
        const void *at = (const char *)stage + (size_t)r * stride * es;
        if (dtype != HT_DTYPE_F32) K->convert(widened, HT_DTYPE_F32, at, dtype, n);
        K->accumulate(out, dtype == HT_DTYPE_F32 ? at : widened, (int64_t)n);
    }
}

/* main_grad rows += the sum over ranks (in rank order, in FP32) of every
 * rank's gradient for them, once the reduce-scatter of u is complete. */
static void complete_reduce(ht_fsdp *f, unit *u) {
    if (!u->stage) return; /* none started (a group of one rank completes at once: no request) */
    if (u->reducing)
        trace_exchange(u, HT_TRACE_REDUCES, u->reduce_began, wait_timed(f, u->comm, u->reducing),
                       (double)u->grad_floats * (double)ht_dtype_size(f->opt.reduce_dtype));
    u->reducing = NULL;
    pool_put(&f->pool, u->sent);
    u->sent = NULL;
    int P = u->comm->size;
    const ht_dtype rd = f->opt.reduce_dtype;
    const ht_kernel_ops *K = ht_kernels();
    if (!K->host_memory && f->pool.dry) {
        pool_put(&f->pool, pool_get(&f->pool, u->rows_floats * sizeof(float) + 64, false));
        if (rd != HT_DTYPE_F32) pool_put(&f->pool, pool_get(&f->pool, u->rows_floats * sizeof(float) + 64, false));
    } else if (!K->host_memory) { /* the sums, then main_grad += them, with the kernels (the same y += x) */
        const size_t bytes = u->rows_floats * sizeof(float) + 64;
        float *sums = pool_get(&f->pool, bytes, false),
              *widened = rd == HT_DTYPE_F32 ? NULL : pool_get(&f->pool, bytes, false);
        if (!sums || (rd != HT_DTYPE_F32 && !widened)) fatal(f, "out of memory for the gradient sums", u);
        sum_contributions(sums, u->stage, rd, u->rows_floats, u->rows_floats, P, widened);
        for (int i = 0; i < u->count; i++)
            if (u->params[i]->trainable)
                K->accumulate(u->params[i]->main_grad, sums + u->soff[i], ht_param_local_numel(u->params[i]));
        pool_put(&f->pool, widened);
        pool_put(&f->pool, sums);
    }
    for (int i = 0; K->host_memory && !f->pool.dry && i < u->count; i++) {
        ht_param *p = u->params[i];
        if (!p->trainable) continue;
        int64_t n = ht_param_local_numel(p);
        const size_t at = u->soff[i], stride = u->rows_floats;
        float *mg = p->main_grad;
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < n; k++) {
            float sum = received(u->stage, rd, at + (size_t)k);
            for (int r = 1; r < P; r++) sum += received(u->stage, rd, (size_t)r * stride + at + (size_t)k);
            mg[k] += sum;
        }
    }
    pool_put(&f->pool, u->stage);
    u->stage = NULL;
}

/* Starts the reduce-scatter of u's whole gradients: rank r's rows of each to
 * rank r; this rank's rows from every rank into the stage. One is in flight
 * at a time (it overlaps the next module's backward): starting one completes
 * the last. With a 16-bit reduce_dtype each rank sends its whole gradient
 * rounded to it (FSDP2's MixedPrecisionPolicy(reduce_dtype=...): half the
 * bytes) and the FP32 one goes back to the pool at once. */
static void start_reduce(ht_fsdp *f, int ui) {
    unit *u = &f->units[ui];
    if (u->resident || !u->grad) return;
    int P = u->comm->size, W = f->comm->size, n = u->count;
    const ht_dtype rd = f->opt.reduce_dtype;
    const int64_t es = (int64_t)ht_dtype_size(rd);
    if (f->reducing >= 0) complete_reduce(f, &f->units[f->reducing]);
    u->stage = pool_get(&f->pool, (size_t)P * u->rows_floats * (size_t)es + 64, false);
    if (!u->stage || !reserve_spans(f, P * n + P + 2)) fatal(f, "out of memory for the gradient reduction", u);
    void *grad = u->grad;
    if (rd != HT_DTYPE_F32) {
        grad = pool_get(&f->pool, u->grad_floats * (size_t)es + 64, false);
        if (!grad) fatal(f, "out of memory for the gradient reduction", u);
        if (!f->pool.dry) ht_kernels()->convert(grad, rd, u->grad, HT_DTYPE_F32, u->grad_floats);
        pool_put(&f->pool, u->grad);
    }
    if (f->pool.dry) { /* the buffers' lives without the exchange */
        f->reducing = ui;
        u->sent = grad;
        u->grad = NULL;
        return;
    }
    ht_span *send = f->spans, *recv = f->spans + P * n;
    int sfirst[P + 1], rfirst[P + 1];
    for (int r = 0; r < P; r++) {
        sfirst[r] = r * n;
        rfirst[r] = r;
        for (int i = 0; i < n; i++) {
            ht_param *p = u->params[i];
            int64_t r0, r1, row = ht_param_row_numel(p);
            ht_param_rows_of(p->shape[0], u->first + r, W, &r0, &r1);
            if (!p->trainable) r1 = r0; /* frozen: nothing sent */
            send[r * n + i] =
                (ht_span){(char *)grad + ((int64_t)u->goff[i] + (r0 - u->row0[i]) * row) * es, (r1 - r0) * row * es};
        }
        recv[r] = (ht_span){(char *)u->stage + (size_t)r * u->rows_floats * (size_t)es, (int64_t)u->rows_floats * es};
    }
    sfirst[P] = P * n;
    rfirst[P] = P;
    ht_spans s = {send, sfirst}, rv = {recv, rfirst};
    u->reduce_began = ht_time_seconds();
    u->reducing = ht_start_exchange(u->comm, &s, &rv);
    f->reducing = ui;
    /* The whole gradient goes back to the pool once sent. */
    u->sent = grad;
    u->grad = NULL;
    for (int i = 0; i < n; i++) u->params[i]->grad = NULL;
    f->stats.reduce_scatters++;
    f->stats.reduced_bytes += (double)u->grad_floats * (double)es;
}

void ht_fsdp_finish_backward(ht_fsdp *f) {
    if (f->reducing >= 0) complete_reduce(f, &f->units[f->reducing]);
    f->reducing = -1;
    f->stats.pool_peak_bytes = (double)f->pool.peak;
    f->stats.pool_bytes = (double)f->pool.bytes;
}

void ht_fsdp_reduce_replicas(ht_fsdp *f, ht_comm *c, float *block, int64_t n) {
    const ht_dtype rd = f->opt.reduce_dtype;
    if (rd == HT_DTYPE_F32 || c->size == 1) {
        if (!f->pool.dry) ht_all_reduce_f32(c, block, n, HT_REDUCE_SUM);
        return;
    }
    /* Replica q sums piece q (its 1/P of the block) of every replica's
     * block rounded to reduce_dtype, in FP32 in rank order, and sends the
     * FP32 sum back to all: the contributions travel in 16 bits, the sums
     * in 32 (rounding them would round every rank's main_grad). */
    const int P = c->size, me = c->rank;
    const size_t es = ht_dtype_size(rd);
    int64_t off[P + 1], bytes[P];
    for (int q = 0; q <= P; q++) off[q] = n * q / P;
    const int64_t mine = off[me + 1] - off[me];
    const ht_kernel_ops *K = ht_kernels();
    void *low = pool_get(&f->pool, (size_t)n * es + 64, false);
    void *stage = pool_get(&f->pool, (size_t)P * (size_t)mine * es + 64, false);
    float *widened = K->host_memory ? NULL : pool_get(&f->pool, (size_t)mine * sizeof(float) + 64, false);
    if (f->pool.dry) {
        pool_put(&f->pool, widened);
        pool_put(&f->pool, stage);
        pool_put(&f->pool, low);
        return;
    }
    ht_span *spans = reserve_spans(f, 2 * P) ? f->spans : NULL;
    if (!low || !stage || (!K->host_memory && !widened) || !spans) {
        fprintf(stderr, "[hypertrain error rank %d] FSDP: out of memory for the replicas' reduction\n", f->comm->rank);
        ht_comm_abort(c, 1);
        abort();
    }
    K->convert(low, rd, block, HT_DTYPE_F32, (size_t)n);
    int sfirst[P + 1], rfirst[P + 1];
    for (int q = 0; q < P; q++) {
        spans[q] = (ht_span){(char *)low + (size_t)off[q] * es, (off[q + 1] - off[q]) * (int64_t)es};
        spans[P + q] = (ht_span){(char *)stage + (size_t)q * (size_t)mine * es, mine * (int64_t)es};
        sfirst[q] = q;
        rfirst[q] = P + q;
        bytes[q] = (off[q + 1] - off[q]) * (int64_t)sizeof(float);
    }
    sfirst[P] = P;
    rfirst[P] = 2 * P;
    ht_spans s = {spans, sfirst}, rv = {spans, rfirst};
    wait_timed(f, c, ht_start_exchange(c, &s, &rv));
    float *sum = block + off[me];
    if (!K->host_memory) {
        sum_contributions(sum, stage, rd, (size_t)mine, (size_t)mine, P, widened);
    } else {
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < mine; k++) {
            float v = received(stage, rd, (size_t)k);
            for (int q = 1; q < P; q++) v += received(stage, rd, (size_t)q * (size_t)mine + (size_t)k);
            sum[k] = v;
        }
    }
    ht_all_gather(c, sum, block, bytes);
    pool_put(&f->pool, widened);
    pool_put(&f->pool, stage);
    pool_put(&f->pool, low);
}

/* ------------------------------------------------------------------ hooks */

static void prefetch(ht_fsdp *f, int module) {
    if (!f->opt.prefetch || module < 0 || module >= f->model->module_count) return;
    for (const int *ui = f->uses[module]; *ui >= 0; ui++) start_gather(f, &f->units[*ui]);
}

static void on_event(void *ctx, int module, ht_module_event ev) {
    ht_fsdp *f = ctx;
    const int *uses = f->uses[module];
    switch (ev) {
    case HT_BEFORE_FORWARD:
        for (const int *ui = uses; *ui >= 0; ui++) use_weights(f, &f->units[*ui]);
        prefetch(f, module + 1);
        break;
    case HT_AFTER_FORWARD:
        for (const int *ui = uses; *ui >= 0; ui++) {
            unit *u = &f->units[*ui];
            if (!u->root && f->opt.reshard_after_forward && u->last_use == module) release_weights(f, u);
        }
        break;
    case HT_BEFORE_BACKWARD:
        for (const int *ui = uses; *ui >= 0; ui++) {
            use_weights(f, &f->units[*ui]);
            use_grads(f, &f->units[*ui]);
        }
        prefetch(f, module - 1);
        break;
    case HT_AFTER_BACKWARD:
        for (const int *ui = uses; *ui >= 0; ui++) {
            unit *u = &f->units[*ui];
            if (u->first_use != module) continue; /* later modules (earlier in backward) still read it */
            start_reduce(f, *ui);
            release_weights(f, u);
        }
        break;
    }
}

/* ------------------------------------------------------------------ life */

ht_status ht_fsdp_create(ht_model *m, ht_comm *comm, const ht_fsdp_options *opt, ht_fsdp **out, ht_error *err) {
    *out = NULL;
    if (m->module_count == 0) return ht_fail(err, HT_ERR_INVALID, "FSDP: model %s declares no modules", m->config.name);
    ht_fsdp *f = calloc(1, sizeof(*f));
    if (!f) return ht_fail(err, HT_ERR_OOM, "cannot allocate FSDP");
    f->model = m;
    f->comm = comm;
    f->opt = *opt;
    f->reducing = -1;
    f->pool.K = ht_kernels();
    f->plan_compute = f->plan_precision = HT_DTYPE_COUNT;
    f->stats.reduce_dtype = opt->reduce_dtype;
    ht_status s = plan_units(f, err);
    if (s != HT_OK) {
        ht_fsdp_free(f);
        return s;
    }
    m->hook = (ht_module_hook){on_event, f};
    *out = f;
    return HT_OK;
}

double ht_fsdp_plan_bytes(ht_model *m, ht_comm *comm, const ht_fsdp_options *opt, ht_dtype compute, ht_dtype precision,
                          ht_comm *replicas, int64_t grad_floats, int micro, bool evaluates, ht_error *err) {
    if (m->module_count == 0) return 0.0;
    ht_fsdp *f = calloc(1, sizeof(*f));
    if (!f) return ht_fail(err, HT_ERR_OOM, "cannot plan FSDP"), -1.0;
    f->model = m;
    f->comm = comm;
    f->opt = *opt;
    f->reducing = -1;
    f->pool.K = ht_kernels();
    f->pool.dry = true;
    f->plan_compute = compute;
    f->plan_precision = precision;
    if (plan_units(f, err) != HT_OK) {
        ht_fsdp_free(f);
        return -1.0;
    }
    /* The hooks in the order the run calls them (the modules in forward order), twice over: an evaluation's
     * forwards where the run evaluates (before the first step and after the last), a step's micro-batches'
     * forward and backward, the gradients' completion, the update's release of every gathered unit. The pool
     * reuses its buffers by size, so the order they are asked for in decides how many it allocates. */
    for (int pass = 0; pass < 2; pass++) {
        for (int k = 0; evaluates && k < m->module_count; k++) {
            on_event(f, k, HT_BEFORE_FORWARD);
            on_event(f, k, HT_AFTER_FORWARD);
        }
        for (int mb = 0; mb < micro; mb++) {
            for (int k = 0; k < m->module_count; k++) {
                on_event(f, k, HT_BEFORE_FORWARD);
                on_event(f, k, HT_AFTER_FORWARD);
            }
            for (int k = m->module_count - 1; k >= 0; k--) {
                on_event(f, k, HT_BEFORE_BACKWARD);
                on_event(f, k, HT_AFTER_BACKWARD);
            }
        }
        ht_fsdp_finish_backward(f);
        ht_fsdp_reduce_replicas(f, replicas, NULL, grad_floats);
        for (int ui = 0; ui < f->unit_count; ui++) release_weights(f, &f->units[ui]);
    }
    const double bytes = (double)f->pool.bytes;
    ht_fsdp_free(f);
    return bytes;
}

/* Whether unit names a and b are one name numbered differently: they differ
 * in one dotted component only, a number in both ("model.layers.1.mlp.experts",
 * "model.layers.2.mlp.experts"). *at: where that component starts; *na, *nb: the numbers. */
static bool numbered_alike(const char *a, const char *b, size_t *at, long *na, long *nb) {
    size_t i = 0;
    while (a[i] && a[i] == b[i]) i++;
    while (i > 0 && a[i - 1] != '.') i--;
    char *ea, *eb;
    if (a[i] < '0' || a[i] > '9' || b[i] < '0' || b[i] > '9') return false;
    *na = strtol(a + i, &ea, 10);
    *nb = strtol(b + i, &eb, 10);
    if ((*ea && *ea != '.') || strcmp(ea, eb) != 0) return false;
    *at = i;
    return true;
}

void ht_fsdp_log_plan(const ht_fsdp *f) {
    char list[2048];
    size_t len = 0;
    list[0] = 0;
    int shown = 0;
    for (int ui = 0; ui < f->unit_count; ui++) {
        const unit *u = &f->units[ui];
        if (u->count == 0) continue;
        /* Consecutive units of the same size and numbered names are one entry:
         * "model.layers.0..23 (24 x 2.36M)", "model.layers.{1..23}.mlp.experts (23 x 0.52M)". */
        int run = ui;
        size_t at = 0;
        long first = 0, last = 0, next;
        while (run + 1 < f->unit_count && !f->units[run + 1].root && f->units[run + 1].grad_floats == u->grad_floats &&
               f->units[run + 1].count == u->count &&
               numbered_alike(u->name, f->units[run + 1].name, &at, &first, &next) && next == first + (run - ui) + 1) {
            last = next;
            run++;
        }
        int64_t numel = 0;
        for (int i = 0; i < u->count; i++) numel += ht_param_numel(u->params[i]);
        const char *rest = u->name + at;
        while (*rest >= '0' && *rest <= '9') rest++;
        if (run > ui && !*rest)
            len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%.*s%ld..%ld (%d x %.2fM)", shown ? ", " : "",
                                    (int)at, u->name, first, last, run - ui + 1, (double)numel / 1e6);
        else if (run > ui)
            len +=
                (size_t)snprintf(list + len, sizeof(list) - len, "%s%.*s{%ld..%ld}%s (%d x %.2fM)", shown ? ", " : "",
                                 (int)at, u->name, first, last, rest, run - ui + 1, (double)numel / 1e6);
        else
            len += (size_t)snprintf(list + len, sizeof(list) - len, "%s%s (%.2fM)", shown ? ", " : "", u->name,
                                    (double)numel / 1e6);
        if (len >= sizeof(list)) break;
        shown++;
        ui = run;
    }
    bool resident = true;
    for (int ui = 0; ui < f->unit_count; ui++) resident = resident && f->units[ui].resident;
    if (f->opt.reduce_dtype != HT_DTYPE_F32)
        ht_log_info("FSDP gradients: reduced in %s (fsdp_config.mix_precision.reduce_dtype): each rank's FP32 "
                    "gradients rounded to it and sent so (half the bytes), the contributions summed in FP32 in rank "
                    "order into FP32 main_grad",
                    ht_dtype_name(f->opt.reduce_dtype));
    ht_log_info("FSDP units: %s; %s", list,
                resident                       ? "whole on every rank (nothing gathered)"
                : f->opt.reshard_after_forward ? "gathered for forward, dropped, gathered again for backward"
                                               : "gathered for forward and kept until backward");
    if (!resident)
        ht_log_info("FSDP prefetch: %s", f->opt.prefetch ? "the next module's units gather while one computes"
                                                         : "off (each unit gathers when its module starts)");
}

void ht_fsdp_weights_changed(ht_fsdp *f) {
    ht_params_refresh_compute(&f->model->params);
    for (int ui = 0; ui < f->unit_count; ui++) release_weights(f, &f->units[ui]);
}

bool ht_fsdp_module_is_unit(const ht_fsdp *f, int module) {
    for (int ui = 0; ui < f->unit_count; ui++)
        if (!f->units[ui].root && !f->units[ui].experts &&
            strcmp(f->units[ui].name, f->model->modules[module].name) == 0)
            return true;
    return false;
}

const ht_fsdp_stats *ht_fsdp_stats_get(const ht_fsdp *f) { return &f->stats; }

void ht_fsdp_stats_reset(ht_fsdp *f) {
    memset(&f->stats, 0, sizeof(f->stats));
    f->stats.reduce_dtype = f->opt.reduce_dtype;
    f->pool.peak = f->pool.held;
}

void ht_fsdp_free(ht_fsdp *f) {
    if (!f) return;
    ht_fsdp_finish_backward(f);
    for (int ui = 0; ui < f->unit_count; ui++) {
        unit *u = &f->units[ui];
        release_weights(f, u);
        for (int i = 0; i < u->count; i++)
            if (u->params[i]->sharded) u->params[i]->grad = NULL;
        free(u->params);
        free(u->woff);
        free(u->goff);
        free(u->soff);
        free(u->row0);
    }
    if (f->model && f->model->hook.ctx == f) f->model->hook = (ht_module_hook){NULL, NULL};
    for (int k = 0; f->uses && f->model && k < f->model->module_count; k++) free(f->uses[k]);
    free(f->uses);
    free(f->units);
    free(f->spans);
    pool_free(&f->pool);
    free(f);
}
