/* The Muon leaf optimizer (docs/NUMERICS.md, Muon): momentum, Newton-Schulz per
 * matrix (3-D params are stacks of matrices), decoupled weight decay and the
 * scaled update, with the cast back to the model dtype fused into that pass
 * (without an FP32 main param, the pass reads the model copy and writes it).
 * Matrices of one shape go through Newton-Schulz in batches, one batched
 * GEMM per product. It owns the momentum buffers and one workspace, sized
 * for the largest matrix or a batch. */
#include "hypertrain/optim.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/kernels.h"

double ht_muon_update_scale(int64_t rows, int64_t cols, double matched_adamw_rms) {
    if (matched_adamw_rms > 0) return matched_adamw_rms * sqrt((double)(rows > cols ? rows : cols));
    double ratio = (double)rows / (double)cols;
    return sqrt(ratio > 1.0 ? ratio : 1.0);
}

void ht_muon_config_defaults(ht_muon_config *cfg) {
    *cfg = (ht_muon_config){.lr = 0.02,
                            .weight_decay = 0.1,
                            .momentum = 0.95,
                            .nesterov = true,
                            .momentum_style = HT_MUON_MOMENTUM_SUM,
                            .ns_eps = 1e-7,
                            .matched_adamw_rms = 0.2,
                            .ns_dtype = HT_DTYPE_F32};
    ht_ns_schedule_expand(HT_NS_ASYM5, 5, NULL, 0, &cfg->schedule, NULL); /* cannot fail */
}

static ht_status check_config(const ht_muon_config *c, ht_error *err) {
    if (!(c->momentum >= 0 && c->momentum < 1))
        return ht_fail(err, HT_ERR_CONFIG, "optimizer.muon_config.muon_momentum: expected a number in [0, 1), found %g",
                       c->momentum);
    if (!(c->weight_decay >= 0))
        return ht_fail(err, HT_ERR_CONFIG, "optimizer.muon_config.muon_weight_decay: expected a number >= 0, found %g",
                       c->weight_decay);
    if (!(c->ns_eps > 0) || !isfinite(c->ns_eps))
        return ht_fail(err, HT_ERR_CONFIG, "optimizer.muon_config.muon_ns_eps: expected a number > 0, found %g",
                       c->ns_eps);
    if (!(c->matched_adamw_rms >= 0) || !isfinite(c->matched_adamw_rms))
        return ht_fail(err, HT_ERR_CONFIG,
                       "optimizer.muon_config.muon_matched_adamw_rms: expected a number >= 0 (0: the original scale "
                       "rule), found %g",
                       c->matched_adamw_rms);
    if (c->momentum_style != HT_MUON_MOMENTUM_SUM && c->momentum_style != HT_MUON_MOMENTUM_EMA)
        return ht_fail(err, HT_ERR_CONFIG, "optimizer.muon_config.muon_momentum_style: expected sum or ema");
    if (c->schedule.steps < 1 || c->schedule.steps > HT_NS_MAX_STEPS)
        return ht_fail(err, HT_ERR_INVALID, "Muon: the Newton-Schulz schedule has %d iterations (not expanded?)",
                       c->schedule.steps);
    for (int k = 0; k < c->schedule.steps; k++)
        for (int j = 0; j < 3; j++)
            if (!isfinite(c->schedule.coeffs[k][j]))
                return ht_fail(err, HT_ERR_CONFIG,
                               "optimizer.muon_config.muon_ns_coefficients: iteration %d has a non-finite coefficient",
                               k);
    if (c->ns_dtype != HT_DTYPE_F32 && c->ns_dtype != HT_DTYPE_BF16)
        return ht_fail(err, HT_ERR_CONFIG, "Muon: Newton-Schulz runs in float32 or bfloat16, not %s",
                       ht_dtype_name(c->ns_dtype));
    return HT_OK;
}

static ht_status check_param(const ht_param *p, ht_error *err) {
    if (p->ndim != 2 && p->ndim != 3)
        return ht_fail(err, HT_ERR_INVALID,
                       "Muon: parameter %s has %d dims; Muon takes matrices (A, B) and stacks of them (E, A, B), "
                       "route it to AdamW",
                       p->name, p->ndim);
    if (!p->main_grad) return ht_fail(err, HT_ERR_INVALID, "Muon: parameter %s has no FP32 main grad", p->name);
    if (p->dtype != HT_DTYPE_F32 && p->dtype != HT_DTYPE_BF16 && p->dtype != HT_DTYPE_F16)
        return ht_fail(err, HT_ERR_INVALID, "Muon: parameter %s has dtype %s; expected a float dtype", p->name,
                       ht_dtype_name(p->dtype));
    /* A bf16/f16 param may have none (updated in its own dtype); a float32 one is its own. */
    if (!p->main_param && p->dtype == HT_DTYPE_F32)
        return ht_fail(err, HT_ERR_INVALID,
                       "Muon: parameter %s (float32) has no main param; only a bfloat16 or float16 param may go "
                       "without one",
                       p->name);
    return HT_OK;
}

/* Newton-Schulz batches take at most this many floats of updates and
 * workspace (16 MiB), or one matrix's where that is more: a few calls for
 * the small matrices of a layer stack (the default model's 8 gate_proj of
 * 688 x 256 in one), without the workspace growing with the model. */
#define BATCH_FLOATS ((size_t)4 << 20)

/* One (rows, cols) matrix's update plus its Newton-Schulz workspace. */
static size_t matrix_floats(int64_t rows, int64_t cols, const ht_muon_config *c) {
    return (size_t)(rows * cols) + ht_newton_schulz_workspace(rows, cols, &c->schedule, c->ns_dtype);
}

/* How many of the slots idx[0], idx[1], ... (n of them) form one batch: the
 * same shape, and together within the workspace. */
static int batch_length(const ht_muon *opt, const int *idx, int n) {
    const ht_muon_slot *s = &opt->slots[idx[0]];
    const size_t per = matrix_floats(s->rows, s->cols, &opt->config);
    int k = 1;
    while (k < n && (size_t)(k + 1) * per <= opt->work_floats && opt->slots[idx[k]].rows == s->rows &&
           opt->slots[idx[k]].cols == s->cols)
        k++;
    return k;
}

/* A matrix's sides: a tensor-parallel slice is orthogonalized whole (its
 * global shape), a stack (E, A, B) matrix by matrix. */
static void matrix_sides(const ht_param *p, int64_t *rows, int64_t *cols) {
    const int64_t *dims = p->ndim == 2 ? p->global_shape : p->shape;
    *rows = dims[p->ndim - 2];
    *cols = dims[p->ndim - 1];
}

/* The workspace: the largest batch the updates take, so that all of it is
 * used (memory never touched is still counted by the memory plan): the 2-D
 * matrices of one shape together (batch_length's runs), an (E, A, B)
 * stack's matrices on their own, each up to BATCH_FLOATS or one matrix
 * where that is more. Every batch is the one a workspace of min(all of
 * them, BATCH_FLOATS) gives. */
static size_t work_floats(ht_param *const *params, int count, const ht_muon_config *cfg) {
    size_t work = 0;
    for (int i = 0; i < count; i++) {
        const ht_param *p = params[i];
        int64_t rows, cols, r, c;
        matrix_sides(p, &rows, &cols);
        bool seen = false;
        size_t matrices = p->ndim == 3 ? (size_t)(p->row1 - p->row0) : 0;
        for (int j = 0; p->ndim == 2 && j < count && !seen; j++) {
            matrix_sides(params[j], &r, &c);
            if (params[j]->ndim != 2 || r != rows || c != cols) continue;
            seen = j < i; /* counted at the shape's first matrix */
            matrices++;
        }
        if (seen) continue;
        const size_t per = matrix_floats(rows, cols, cfg), fit = BATCH_FLOATS / per > 1 ? BATCH_FLOATS / per : 1;
        const size_t batch = (matrices < fit ? matrices : fit) * per;
        if (batch > work) work = batch;
    }
    return work;
}

ht_status ht_muon_init(ht_muon *opt, const ht_muon_config *cfg, ht_param **params, int count, ht_error *err) {
    memset(opt, 0, sizeof(*opt));
    ht_status st = check_config(cfg, err);
    if (st != HT_OK) return st;
    size_t floats = 0;
    for (int i = 0; i < count; i++) {
        if ((st = check_param(params[i], err)) != HT_OK) return st;
        floats += (size_t)ht_param_local_numel(params[i]);
    }
    const size_t work = work_floats(params, count, cfg);
    opt->config = *cfg;
    opt->slots = ht_alloc((size_t)(count > 0 ? count : 1) * sizeof(ht_muon_slot));
    opt->order = malloc((size_t)(count > 0 ? count : 1) * sizeof(int));
    opt->state_block = ht_kernels()->alloc((floats > 0 ? floats : 1) * sizeof(float));
    opt->work = ht_kernels()->alloc((work > 0 ? work : 1) * sizeof(float));
    opt->work_floats = work;
    if (!opt->slots || !opt->order || !opt->state_block || !opt->work) {
        ht_muon_free(opt);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes of Muon state and workspace",
                       (floats + work) * sizeof(float));
    }
    float *next = opt->state_block;
    for (int i = 0; i < count; i++) {
        ht_param *p = params[i];
        ht_muon_slot *s = &opt->slots[opt->count++];
        s->param = p;
        s->matrices = p->ndim == 3 ? p->shape[0] : 1;
        matrix_sides(p, &s->rows, &s->cols);
        s->scale = ht_muon_update_scale(s->rows, s->cols, cfg->matched_adamw_rms);
        s->momentum_buffer = next;
        next += ht_param_local_numel(p);
    }
    /* By shape (stable): the batches are runs of this order, the same on every rank. */
    for (int i = 0; i < count; i++) {
        int k = i;
        const ht_muon_slot *s = &opt->slots[i];
        for (; k > 0; k--) {
            const ht_muon_slot *t = &opt->slots[opt->order[k - 1]];
            if (t->rows < s->rows || (t->rows == s->rows && t->cols <= s->cols)) break;
            opt->order[k] = opt->order[k - 1];
        }
        opt->order[k] = i;
    }
    return HT_OK;
}

/* The elementwise arithmetic of the momentum style: ema is torch.optim.Muon's,
 * rounded as its lerps and add_ round (docs/NUMERICS.md, Muon). */
static ht_muon_arith arith_of(const ht_muon_config *c) {
    return c->momentum_style == HT_MUON_MOMENTUM_EMA ? HT_MUON_ARITH_TORCH : HT_MUON_ARITH_PLAIN;
}

/* B <- momentum(B, g) and u, the matrix Newton-Schulz takes (docs/NUMERICS.md,
 * Muon), through the kernel table. */
static void momentum_update(float *B, const float *g, float *u, int64_t n, const ht_muon_config *c) {
    const float gw = c->momentum_style == HT_MUON_MOMENTUM_EMA ? (float)(1.0 - c->momentum) : 1.0f;
    ht_kernels()->muon_momentum(B, g, u, n, (float)c->momentum, gw, c->nesterov, arith_of(c));
}

/* Newton-Schulz FLOPs of an (A, B) matrix, up to the schedule's length:
 * per iteration X Xᵀ, S S and T X with r = min(A, B), c = max(A, B). */
static double ns_flops(int64_t rows, int64_t cols) {
    double r = (double)(rows < cols ? rows : cols), c = (double)(rows < cols ? cols : rows);
    return 2 * r * r * c + 2 * r * r * r + 2 * r * r * c;
}

/* deredundancy's owners: every sharded matrix, largest Newton-Schulz FLOPs
 * first (ties by index, so every rank computes the same table), to the
 * least loaded of the P = S x R (replica, shard rank) pairs; owner and
 * owner_replica -1 and 0 for the rest (a stack, an unsharded matrix). Fills
 * load and owned_count per pair; returns the floats of the matrices pair
 * `mine` owns, and the count of sharded matrices in *n. */
static size_t assign_owners(ht_param *const *params, int count, int S, int R, int mine, int *owner, int *owner_replica,
                            double *load, int *owned_count, int *order, int *n_out) {
    const int P = S * R;
    for (int r = 0; r < P; r++) load[r] = 0, owned_count[r] = 0;
    int n = 0;
    for (int i = 0; i < count; i++) {
        owner[i] = -1;
        owner_replica[i] = 0;
        if (params[i]->ndim == 2 && ht_param_is_sharded(params[i])) order[n++] = i;
    }
    int64_t rows[count > 0 ? count : 1], cols[count > 0 ? count : 1];
    for (int i = 0; i < count; i++) matrix_sides(params[i], &rows[i], &cols[i]);
    for (int a = 1; a < n; a++)
        for (int b = a; b > 0; b--) {
            const int x = order[b - 1], y = order[b];
            if (ns_flops(rows[x], cols[x]) >= ns_flops(rows[y], cols[y])) break;
            order[b - 1] = y;
            order[b] = x;
        }
    size_t floats = 0;
    for (int k = 0; k < n; k++) {
        const int i = order[k];
        int best = 0;
        for (int r = 1; r < P; r++)
            if (load[r] < load[best]) best = r;
        owner[i] = best % S;
        owner_replica[i] = best / S;
        load[best] += ns_flops(rows[i], cols[i]);
        owned_count[best]++;
        if (best == mine) floats += (size_t)(rows[i] * cols[i]);
    }
    *n_out = n;
    return floats;
}

ht_status ht_muon_set_comm(ht_muon *opt, ht_comm *comm, ht_comm *replicas, ht_error *err) {
    opt->comm = comm;
    if (opt->config.comm_strategy != HT_MUON_COMM_DEREDUNDANCY || comm->size == 1) return HT_OK;
    /* Owners are (replica, shard rank) pairs: P ranks a group, R groups. */
    int S = comm->size, R = replicas ? replicas->size : 1, P = S * R, me = replicas ? replicas->rank : 0;
    opt->replicas = R > 1 ? replicas : NULL;
    const size_t slots = (size_t)(opt->count ? opt->count : 1);
    opt->owner = malloc(slots * sizeof(int));
    opt->owner_replica = malloc(slots * sizeof(int));
    opt->owned = calloc(slots, sizeof(float *));
    int *order = malloc(slots * sizeof(int));
    ht_param **params = malloc(slots * sizeof(ht_param *));
    double load[P], total = 0;
    int owned_count[P], n = 0;
    if (!opt->owner || !opt->owner_replica || !opt->owned || !order || !params) {
        free(order);
        free(params);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate Muon's owner table");
    }
    for (int i = 0; i < opt->count; i++) params[i] = opt->slots[i].param;
    size_t floats = assign_owners(params, opt->count, S, R, me * S + comm->rank, opt->owner, opt->owner_replica, load,
                                  owned_count, order, &n);
    for (int r = 0; r < P; r++) total += load[r];
    free(params);
    free(order);
    opt->owned_block = ht_kernels()->alloc((floats ? floats : 1) * sizeof(float));
    if (!opt->owned_block) return ht_fail(err, HT_ERR_OOM, "cannot allocate Muon's owned matrices");
    float *next = opt->owned_block; /* in opt->order: the owned matrices of one shape side by side, a batch */
    for (int k = 0; k < opt->count; k++) {
        int i = opt->order[k];
        if (opt->owner[i] == comm->rank && opt->owner_replica[i] == me) {
            opt->owned[i] = next;
            next += opt->slots[i].rows * opt->slots[i].cols;
        }
    }
    char line[1024] = "";
    for (int r = 0; r < P && strlen(line) + 64 < sizeof(line); r++)
        snprintf(line + strlen(line), sizeof(line) - strlen(line), "%srank %d: %d (%.0f%%)", r ? ", " : "", r,
                 owned_count[r], total > 0 ? 100.0 * load[r] / total : 0.0);
    ht_log_info("Muon deredundancy: %d sharded matrices, one owner each by Newton-Schulz FLOPs%s: %s", n,
                R > 1 ? " over every rank (HSDP: one replica computes each, the others receive its rows)" : "", line);
    return HT_OK;
}

/* Tensor parallelism's gather of a split matrix: a box's update, and the
 * staging of its rows and slices; returns how many matrices are split. */
static int tp_floats(ht_param *const *params, int count, size_t *box, size_t *stage) {
    int split = 0;
    *box = *stage = 0;
    for (int i = 0; i < count; i++) {
        const ht_param *p = params[i];
        if (p->ndim != 2 || p->tp_dim < 0) continue;
        split++;
        if ((size_t)ht_param_local_numel(p) > *box) *box = (size_t)ht_param_local_numel(p);
        const size_t n = (size_t)(ht_param_numel(p) + ht_param_global_numel(p));
        if (n > *stage) *stage = n;
    }
    return split;
}

size_t ht_muon_plan_bytes(const ht_muon_config *cfg, ht_param *const *params, int count, const ht_comm *comm,
                          const ht_comm *replicas, const ht_comm *tp) {
    size_t floats = work_floats(params, count, cfg);
    for (int i = 0; i < count; i++) floats += (size_t)ht_param_local_numel(params[i]);
    if (cfg->comm_strategy == HT_MUON_COMM_DEREDUNDANCY && comm && comm->size > 1 && count > 0) {
        const int S = comm->size, R = replicas ? replicas->size : 1, me = replicas ? replicas->rank : 0;
        int *ints = malloc((size_t)(3 * count + 2 * S * R) * sizeof(int)), n;
        double *load = malloc((size_t)(S * R) * sizeof(double));
        if (ints && load)
            floats += assign_owners(params, count, S, R, me * S + comm->rank, ints, ints + count, load,
                                    ints + 3 * count, ints + 2 * count, &n);
        free(ints);
        free(load);
    }
    size_t box, stage;
    if (tp && tp->size > 1 && tp_floats(params, count, &box, &stage) > 0)
        floats += (box ? box : 1) + (stage ? stage : 1);
    return floats * sizeof(float);
}

ht_status ht_muon_set_tensor_parallel(ht_muon *opt, ht_comm *tp, ht_error *err) {
    if (!tp || tp->size <= 1) return HT_OK;
    size_t box, stage;
    ht_param **params = malloc((size_t)(opt->count ? opt->count : 1) * sizeof(ht_param *));
    if (!params) return ht_fail(err, HT_ERR_OOM, "cannot allocate Muon's tensor-parallel table");
    for (int i = 0; i < opt->count; i++) params[i] = opt->slots[i].param;
    const int split = tp_floats(params, opt->count, &box, &stage);
    free(params);
    if (split && opt->owner)
        return ht_fail(err, HT_ERR_CONFIG,
                       "optimizer.muon_config.muon_comm_strategy deredundancy: not supported yet with "
                       "parallel.tensor_parallel_size %d (its owners would have to span the tensor-parallel group); "
                       "expected allgather",
                       tp->size);
    opt->tp = tp;
    opt->tp_box = ht_kernels()->alloc((box ? box : 1) * sizeof(float));
    opt->tp_scratch = ht_kernels()->alloc((stage ? stage : 1) * sizeof(float));
    opt->tp_floats = (box ? box : 1) + (stage ? stage : 1);
    if (!opt->tp_box || !opt->tp_scratch)
        return ht_fail(err, HT_ERR_OOM, "cannot allocate Muon's tensor-parallel gather (%zu floats)", box + stage);
    return HT_OK;
}

/* Whether p is a matrix tensor parallelism split over opt->tp. */
static bool tp_split(const ht_muon *opt, const ht_param *p) { return opt->tp && p->ndim == 2 && p->tp_dim >= 0; }

/* This rank's rows of a sharded matrix's update: the momentum step on its
 * rows of B and g, and u (nesterov) or B itself in `mine` (its box's values). */
static void update_rows(const ht_muon_slot *s, const ht_muon_config *c, float *mine) {
    const ht_param *p = s->param;
    const int64_t local = ht_param_local_numel(p);
    momentum_update(s->momentum_buffer, p->main_grad, mine, local, c);
    if (!c->nesterov) ht_kernels()->copy(mine, s->momentum_buffer, (size_t)local * sizeof(float));
}

/* One block of a residual16 param's main params (ht_param_main_pass), as
 * an FP32 param's: update holds elements [first, first + n). */
typedef struct residual_apply {
    float *update;
    int64_t first;
    float decay, step;
    ht_muon_arith arith;
} residual_apply;

static void residual_block(float *x, int64_t at, int64_t len, void *ctx) {
    const residual_apply *r = ctx;
    ht_kernels()->muon_apply(x, r->update + (at - r->first), len, r->decay, r->step, r->arith, NULL, HT_DTYPE_F32,
                             false, 0, 0);
}

/* p's elements [first, first + n) <- p decay - step update (update: n values,
 * scratch), and the model's copy from the main params in the same pass. */
static void apply_update(const ht_muon *opt, ht_param *p, float *update, int64_t first, int64_t n, float decay,
                         float step) {
    const ht_muon_arith arith = arith_of(&opt->config);
    if (p->main_low) {
        ht_param_main_pass(p, first, n, residual_block, &(residual_apply){update, first, decay, step, arith});
        return;
    }
    const bool separate = (void *)p->main_param != p->data, stochastic = opt->rounding.stochastic;
    ht_kernels()->muon_apply(p->main_param ? p->main_param + first : NULL, update, n, decay, step, arith,
                             separate ? (char *)p->data + (size_t)first * ht_dtype_size(p->dtype) : NULL, p->dtype,
                             stochastic, stochastic ? ht_rounding_stream(&opt->rounding, p->name) : 0, first);
}

void ht_muon_step(ht_muon *opt, double lr) {
    const ht_muon_config *c = &opt->config;
    ht_comm *comm = opt->comm ? opt->comm : ht_comm_single();
    /* Scalars in double, then FP32 per element, as PyTorch does. */
    const float decay = (float)(1.0 - lr * c->weight_decay);
    int64_t bytes[comm->size];
    const int my_replica = opt->replicas ? opt->replicas->rank : 0;
    for (int i = 0; i < opt->count; i++) opt->slots[i].step++;
    /* deredundancy, phase 1: every matrix's momentum-updated rows to its owner. */
    if (opt->owner)
        for (int i = 0; i < opt->count; i++) {
            ht_muon_slot *s = &opt->slots[i];
            ht_param *p = s->param;
            if (opt->owner[i] < 0) continue;
            update_rows(s, c, opt->work); /* every replica keeps its own momentum */
            if (opt->owner_replica[i] != my_replica) continue;
            ht_param_row_bytes(p, comm->size, bytes, sizeof(float));
            ht_gather(comm, opt->work, opt->owned[i], bytes, opt->owner[i]);
        }
    /* Phase 2: each owner orthogonalizes its matrices in place, a batch of
     * one shape at a time (they lie side by side in owned_block); its peers
     * go on to theirs. */
    int list[opt->count > 0 ? opt->count : 1], listed = 0;
    for (int k = 0; opt->owner && k < opt->count; k++)
        if (opt->owned[opt->order[k]]) list[listed++] = opt->order[k];
    for (int k = 0, nb; k < listed; k += nb) {
        nb = batch_length(opt, list + k, listed - k);
        const ht_muon_slot *s = &opt->slots[list[k]];
        float *G = opt->owned[list[k]];
        ht_newton_schulz_batch(G, G, nb, s->rows, s->cols, &c->schedule, c->ns_eps, c->ns_dtype, opt->work);
    }
    /* allgather: each matrix's rows of the update from every rank, gathered
     * into the whole matrix that Newton-Schulz needs, a batch of one shape
     * at a time; each rank then applies its own rows. */
    listed = 0;
    for (int k = 0; k < opt->count; k++) {
        int i = opt->order[k];
        if (opt->slots[i].param->ndim == 2 && !(opt->owner && opt->owner[i] >= 0)) list[listed++] = i;
    }
    for (int k = 0, nb; k < listed; k += nb) {
        nb = batch_length(opt, list + k, listed - k);
        const int64_t rows = opt->slots[list[k]].rows, cols = opt->slots[list[k]].cols, n = rows * cols;
        for (int j = 0; j < nb; j++) {
            ht_muon_slot *s = &opt->slots[list[k + j]];
            float *u = opt->work + j * n, *mine = u + s->param->row0 * cols;
            if (tp_split(opt, s->param)) { /* its box, gathered over the shard group and the slices */
                update_rows(s, c, opt->tp_box);
                (void)ht_param_gather_global(s->param, comm, opt->tp, opt->tp_box, HT_DTYPE_F32, u, false,
                                             opt->tp_scratch, NULL);
                continue;
            }
            update_rows(s, c, mine);
            ht_param_gather_rows(s->param, comm, mine, u, sizeof(float));
        }
        ht_newton_schulz_batch(opt->work, opt->work, nb, rows, cols, &c->schedule, c->ns_eps, c->ns_dtype,
                               opt->work + nb * n);
        for (int j = 0; j < nb; j++) {
            ht_muon_slot *s = &opt->slots[list[k + j]];
            ht_param *p = s->param;
            float *update = opt->work + j * n + p->row0 * cols;
            if (tp_split(opt, p)) { /* this rank's box of the whole matrix's result */
                const int64_t *at = p->box.offset, *len = p->box.length;
                ht_kernels()->copy_rows(opt->tp_box, len[1], opt->work + j * n + at[0] * cols + at[1], cols, len[0],
                                        len[1], false);
                update = opt->tp_box;
            }
            apply_update(opt, p, update, 0, ht_param_local_numel(p), decay, (float)(lr * s->scale));
        }
    }
    /* (E, A, B): this rank's whole matrices [row0, row1) of E, as many at once as the workspace holds. */
    for (int i = 0; i < opt->count; i++) {
        ht_muon_slot *s = &opt->slots[i];
        ht_param *p = s->param;
        if (p->ndim != 3) continue;
        const int64_t n = s->rows * s->cols, local = p->row1 - p->row0;
        const size_t per = matrix_floats(s->rows, s->cols, c);
        const int64_t batch = opt->work_floats / per > 1 ? (int64_t)(opt->work_floats / per) : 1;
        for (int64_t e = 0; e < local; e += batch) {
            const int64_t m = local - e < batch ? local - e : batch;
            float *B = s->momentum_buffer + e * n, *u = opt->work;
            momentum_update(B, p->main_grad + e * n, u, m * n, c);
            ht_newton_schulz_batch(c->nesterov ? u : B, u, m, s->rows, s->cols, &c->schedule, c->ns_eps, c->ns_dtype,
                                   u + m * n);
            apply_update(opt, p, u, e * n, m * n, decay, (float)(lr * s->scale));
        }
    }
    /* deredundancy, phase 3: each owner's result rows back to their ranks, applied there. */
    if (opt->owner)
        for (int i = 0; i < opt->count; i++) {
            ht_muon_slot *s = &opt->slots[i];
            ht_param *p = s->param;
            if (opt->owner[i] < 0) continue;
            const int64_t local = (p->row1 - p->row0) * s->cols;
            float *mine = opt->work;
            if (opt->owner_replica[i] == my_replica) {
                ht_param_row_bytes(p, comm->size, bytes, sizeof(float));
                ht_scatter(comm, opt->owned[i], mine, bytes, opt->owner[i]);
            }
            if (opt->replicas) /* the computing replica's rows to the others */
                ht_broadcast(opt->replicas, mine, local * (int64_t)sizeof(float), opt->owner_replica[i]);
            apply_update(opt, p, mine, 0, local, decay, (float)(lr * s->scale));
        }
}

void ht_muon_free(ht_muon *opt) {
    free(opt->owner);
    free(opt->owner_replica);
    free(opt->owned);
    free(opt->order);
    ht_kernels()->free(opt->owned_block);
    ht_kernels()->free(opt->tp_box);
    ht_kernels()->free(opt->tp_scratch);
    ht_kernels()->free(opt->work);
    ht_kernels()->free(opt->state_block);
    ht_free(opt->slots);
    memset(opt, 0, sizeof(*opt));
}
