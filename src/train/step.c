/* One training step (the micro-batches with gradient accumulation into FP32
 * main_grad, the sums over the ranks, the chained Muon + AdamW step, QK-clip,
 * DeepSeekMoE's aux-loss-free bias update, training.dump_state's tensors) and
 * the evaluation on the validation split. */
#include "hypertrain/train.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/parallel.h"
#include "hypertrain/kernels.h"
#include "hypertrain/optimizer.h"

#define HT_MAX_DUMPED 4096 /* params */
/* training.dump_state: one step's tensors, kept until written (the writer borrows them). */
typedef struct state_dump {
    ht_st_writer w;
    void *bufs[2 * HT_MAX_DUMPED];
    int count;
} state_dump;

static void dump_free(state_dump *d) {
    if (!d) return;
    ht_st_writer_free(&d->w);
    for (int i = 0; i < d->count; i++) ht_free(d->bufs[i]);
    free(d);
}

/* Every param's whole main_grad ("main_grad.") or model values ("param."),
 * gathered from the shard group's rows and the tensor-parallel slices,
 * added to the dump on rank 0. Every rank takes part. */
static ht_status dump_tensors(ht_trainer *t, state_dump *d, const char *prefix, ht_error *err) {
    const bool grads = prefix[0] == 'm';
    ht_param_store *ps = &t->model->params;
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        if (grads && !p->main_grad) continue; /* frozen */
        const size_t elem = grads ? sizeof(float) : ht_dtype_size(p->dtype);
        void *whole = ht_alloc((size_t)ht_param_global_numel(p) * elem + 64);
        if (!whole || d->count == 2 * HT_MAX_DUMPED) {
            ht_free(whole);
            return ht_fail(err, HT_ERR_OOM, "training.dump_state: cannot hold %s", p->name);
        }
        d->bufs[d->count++] = whole;
        ht_dtype dt = grads ? HT_DTYPE_F32 : p->dtype;
        /* this rank's rows, through a host buffer where the kernels' memory is not the host's */
        const void *rows = grads ? (void *)p->main_grad : p->data;
        void *staged = NULL;
        if (!ht_params_host_memory(ps)) {
            const size_t n = (size_t)ht_param_local_numel(p) * elem;
            if (!(staged = malloc(n ? n : 1)))
                return ht_fail(err, HT_ERR_OOM, "training.dump_state: cannot stage %s", p->name);
            ht_params_download(ps, staged, rows, n);
            rows = staged;
        }
        ht_status s = ht_param_gather_global(p, t->par.shard, t->par.tp, rows, dt, whole, true, NULL, err);
        free(staged);
        if (s != HT_OK) return s;
        char name[HT_PARAM_NAME_MAX + 16];
        snprintf(name, sizeof(name), "%s%s", prefix, p->name);
        s = t->comm->rank == 0 ? ht_st_writer_add(&d->w, name, dt, p->ndim, p->global_shape, whole, dt, err) : HT_OK;
        if (s != HT_OK) return s;
    }
    return HT_OK;
}

static ht_status write_dump(ht_trainer *t, state_dump *d, ht_error *err) {
    if (t->comm->rank != 0) return HT_OK;
    char dir[HT_CONFIG_STR_MAX + 16], path[HT_CONFIG_STR_MAX + 64];
    snprintf(dir, sizeof(dir), "%s/state", t->config.checkpoint.output_dir);
    ht_status s = ht_make_dirs(dir, err);
    snprintf(path, sizeof(path), "%s/step_%08lld.safetensors", dir, (long long)t->step);
    return s == HT_OK ? ht_st_writer_write(&d->w, path, err) : s;
}

/* A MoE model's step: the tokens each routed expert of each sparse layer
 * was given (sparse layers, E), summed over every rank of the world (the
 * global batch: each rank routes its own tokens, before any expert-parallel
 * exchange, so each token is counted once; a double sum of integers,
 * exact). From them, the experts' load in the step's stats (the most and
 * fewest tokens an expert got over the mean of its layer, the extremes over
 * the layers), and with deepseek_v3's model.moe_router_bias_update_rate
 * every rank moves the rows of the correction biases it holds by the rule
 * (ht_model_update_expert_bias), so that every layout of the batch ends on
 * the same bits. */
static ht_status count_expert_tokens(ht_trainer *t, double *load_max, double *load_min, ht_error *err) {
    ht_model *m = t->model;
    const int E = m->config.moe.num_experts, layers = ht_model_config_sparse_layers(&m->config);
    const size_t n = (size_t)layers * (size_t)E;
    *load_max = *load_min = NAN;
    if (n == 0) return HT_OK;
    double *tokens = malloc(n * sizeof(double));
    if (!tokens) return ht_fail(err, HT_ERR_OOM, "cannot allocate the experts' token counts");
    for (size_t i = 0; i < n; i++) tokens[i] = (double)m->expert_tokens[i];
    ht_all_reduce_f64(t->comm, tokens, (int64_t)n, HT_REDUCE_SUM);
    for (int l = 0; l < layers; l++) {
        const double *x = tokens + (size_t)l * (size_t)E;
        double sum = 0, hi = 0, lo = INFINITY;
        for (int e = 0; e < E; e++) sum += x[e], hi = fmax(hi, x[e]), lo = fmin(lo, x[e]);
        if (sum <= 0) continue;
        *load_max = isnan(*load_max) ? hi * E / sum : fmax(*load_max, hi * E / sum);
        *load_min = isnan(*load_min) ? lo * E / sum : fmin(*load_min, lo * E / sum);
    }
    if (ht_model_config_is_deepseek(&m->config) && m->config.moe.bias_update_rate > 0)
        ht_model_update_expert_bias(m, tokens, m->config.moe.bias_update_rate);
    free(tokens);
    return HT_OK;
}

/* The B sequences of t->inputs and t->targets as the model takes them (this rank's share of their tokens). */
static void take_share(ht_trainer *t, int B, const int32_t **inputs, const int32_t **targets) {
    const ht_context_parallel *cp = &t->model->context;
    *inputs = ht_parallel_token_share(&t->par, cp, t->inputs, B, t->T, t->Tc, t->share_inputs);
    *targets = ht_parallel_token_share(&t->par, cp, t->targets, B, t->T, t->Tc, t->share_targets);
}

/* The step's micro-batches through this rank's stage in the pipeline's
 * order (one stage: each forward and its backward in turn), the loss of
 * each added to *loss_sum on the last stage. */
/* The floats of the hidden states a stage passes on for B sequences: this
 * rank's tokens of them (context parallelism: its share of each sequence;
 * sequence parallelism: its rows of those), each of hidden_size. */
static int64_t boundary_floats(const ht_trainer *t, int B) {
    const int64_t rows = (int64_t)B * t->Tc, sp = t->par.tp_size > 1 && t->config.parallel.sequence_parallel;
    return rows / (sp ? t->par.tp_size : 1) * t->model->config.hidden_size;
}

static ht_status run_micro_batches(ht_trainer *t, float grad_scale, uint64_t dropout, double *loss_sum, ht_error *err) {
    ht_model *m = t->model;
    ht_pipeline *pipe = &t->pipe;
    const int64_t floats = boundary_floats(t, t->B);
    m->slots = pipe->slots;
    const size_t window = (size_t)t->B * (size_t)(t->T + 1); /* a micro-batch's tokens */
    if (!t->micro_tokens && !(t->micro_tokens = malloc((size_t)pipe->micro * window * sizeof(int32_t))))
        return ht_fail(err, HT_ERR_OOM, "cannot hold the tokens of a step's %d micro-batches", pipe->micro);
    const double start = ht_time_seconds();
    for (int k = 0; k < 2 * pipe->chunks * pipe->micro; k++) {
        const int op = pipe->order[k], micro = (op >> 1) / pipe->chunks, chunk = (op >> 1) % pipe->chunks;
        const bool backward = op & 1;
        m->slot = ht_pipeline_slot(pipe, micro, chunk);
        const double r0 = ht_time_seconds();
        ht_pipeline_receive(pipe, micro, chunk, backward, floats);
        /* The next operation's input, on its way as this one computes; not where a forward or backward holds
         * blocking collectives (tensor, context, expert parallelism): one waits for every message in flight
         * first, and this one's sender may send it only after a blocking collective of its own. */
        if (t->par.tp_size == 1 && t->par.cp_size == 1 && !t->par.ep && k + 1 < 2 * pipe->chunks * pipe->micro) {
            const int next = pipe->order[k + 1];
            ht_pipeline_post(pipe, (next >> 1) / pipe->chunks, (next >> 1) % pipe->chunks, next & 1, floats);
        }
        const double f0 = ht_time_seconds();
        const float *sent;
        if (!backward) {
            /* Every rank reads the micro-batches in order, at their first chunk's forwards (in micro-batch
             * order): the first model stage takes the inputs, the last the targets. */
            int32_t *tokens = t->micro_tokens + (size_t)micro * window;
            if (chunk == 0) ht_loader_next(&t->train_loader, tokens);
            ht_batch_split(tokens, t->B, t->T, t->inputs, t->targets);
            const int32_t *inputs, *targets;
            take_share(t, t->B, &inputs, &targets);
            m->dropout_seed = dropout;
            m->dropout_first_sequence = ((int64_t)micro * t->par.dp_size + t->par.dp_rank) * t->B;
            m->stage_in = ht_pipeline_input(pipe, m->slot);
            m->stage_sums_in = ht_pipeline_input_sums(pipe, m->slot);
            float loss;
            ht_status s = ht_model_forward(m, inputs, targets, t->B, t->Tc, &loss, err);
            if (s != HT_OK) return s;
            const double f1 = ht_time_seconds();
            t->forward_seconds += f1 - f0;
            ht_trace_span("phase", "forward", HT_TRACE_THREAD, f0, f1, -1, t->step + 1);
            if (m->stage.last && chunk == pipe->chunks - 1) *loss_sum += loss; /* the model's last stage's */
            sent = m->stage_out;
        } else {
            m->stage_out_grad = ht_pipeline_grad(pipe, m->slot);
            m->stage_sums_grad = ht_pipeline_grad_sums(pipe, m->slot);
            ht_model_backward(m, grad_scale);
            ht_trace_span("phase", "backward", HT_TRACE_THREAD, f0, ht_time_seconds(), -1, t->step + 1);
            sent = m->stage_in_grad;
        }
        const double x0 = ht_time_seconds();
        ht_pipeline_send(pipe, micro, chunk, backward, sent, floats, m->stage_sums);
        t->pipeline_busy_seconds += x0 - f0;
        t->pipeline_exchange_seconds += (f0 - r0) + (ht_time_seconds() - x0);
    }
    const double x0 = ht_time_seconds();
    ht_pipeline_finish(pipe);
    t->pipeline_exchange_seconds += ht_time_seconds() - x0;
    t->pipeline_seconds += ht_time_seconds() - start;
    return HT_OK;
}

ht_status ht_trainer_step(ht_trainer *t, ht_step_stats *stats, ht_error *err) {
    double t0 = ht_time_seconds();
    ht_model *m = t->model;
    /* The loss scale multiplies the gradients; 1/(accumulation × data ranks)
     * averages the global batch's micro-batches, once, before the sum over
     * the ranks (data x context parallel: the ranks of a tensor-parallel
     * group hold the same tokens, each its slices' whole gradient; the
     * stages of a pipeline each their layers'). */
    float grad_scale = (float)(ht_optimizer_loss_scale(&t->optimizer) * t->config.training.gradient_scaling_factor /
                               ((double)t->grad_accum * t->par.dp_size * t->par.cp_size));
    ht_model_reset_attn_max(m);
    ht_model_reset_expert_tokens(m); /* this step's tokens alone (evaluation forwards counted too) */
    double loss_sum = 0.0;
    /* model.lora.dropout: this step's masks, drawn from (seed, step) and each
     * sequence's place in the global batch: a resumed run, and any split of
     * the batch over ranks and micro-batches, drop the same elements. The
     * constant keeps the stream apart from the others derived from the seed;
     * the low bit keeps it nonzero (0 means no dropout). */
    uint64_t dropout = ht_fnv1a64(&t->step, sizeof(t->step), (uint64_t)t->config.training.seed ^ 0x6c6f7261ULL) | 1;
    const double exchanged = m->experts.seconds;
    ht_status ms = run_micro_batches(t, grad_scale, dropout, &loss_sum, err);
    if (ms != HT_OK) return ms;
    m->dropout_seed = 0;                           /* forwards outside a training step (evaluation) drop nothing */
    ht_status gs = ht_kernels()->synchronize(err); /* before any rank sums this rank's gradients */
    if (gs != HT_OK) return gs;
    double t1 = ht_time_seconds();
    ht_parallel_finish_grads(&t->par, t->fsdp, &m->params, t->config.parallel.sequence_parallel);
    ht_all_reduce_f64(t->comm, &loss_sum, 1, HT_REDUCE_SUM);
    if (t->qk_layers)
        ht_parallel_max_logits(&t->par, m->attn_max_logit,
                               (int64_t)m->config.num_hidden_layers * t->qk_layers[0].num_heads);
    double t2 = ht_time_seconds();
    ht_trace_span("phase", "gradient sync", HT_TRACE_THREAD, t1, t2, -1, t->step + 1);
    ht_step_result r;
    state_dump *dump = t->config.training.dump_state ? calloc(1, sizeof(state_dump)) : NULL;
    ht_status s = HT_OK;
    if (t->config.training.dump_state)
        s = dump ? dump_tensors(t, dump, "main_grad.", err)
                 : ht_fail(err, HT_ERR_OOM, "training.dump_state: out of memory");
    if (s == HT_OK) s = ht_optimizer_step(&t->optimizer, &r, err);
    if (s == HT_OK) s = ht_kernels()->synchronize(err); /* Newton-Schulz */
    if (s != HT_OK) {
        dump_free(dump);
        return s;
    }
    const double updated = ht_time_seconds();
    ht_trace_span("phase", "optimizer", HT_TRACE_THREAD, t2, updated, -1, t->step + 1);
    int clipped = 0;
    double max_logit = NAN;
    if (t->qk_layers) { /* the step's largest logit, over every head: each rank of a tensor-parallel group has its
                         * own, each pipeline stage its layers' */
        const int64_t n = (int64_t)m->config.num_hidden_layers * t->qk_layers[0].num_heads;
        for (int64_t i = 0; i < n; i++)
            max_logit = isnan(max_logit) ? m->attn_max_logit[i] : fmax(max_logit, m->attn_max_logit[i]);
        if (t->par.tp_size > 1) ht_all_reduce_f64(t->par.tp, &max_logit, 1, HT_REDUCE_MAX);
        if (t->par.pp_size > 1) ht_all_reduce_f64(t->par.pp, &max_logit, 1, HT_REDUCE_MAX);
    }
    if (t->qk_layers && !r.skipped) {
        for (int l = 0; l < m->config.num_hidden_layers; l++)
            if (ht_pipeline_holds_layer(&m->stage, l))
                clipped += ht_qk_clip(&t->qk_layers[l], m->attn_max_logit + (size_t)l * t->qk_layers[l].num_heads,
                                      t->config.optimizer.muon.qk_clip_threshold);
        /* each rank rescaled its own heads of its own layers: the count is the group's and the stages' */
        ht_comm *groups[] = {t->par.tp, t->par.pp};
        for (size_t g = 0; g < 2; g++) {
            if (groups[g]->size <= 1) continue;
            double heads = clipped;
            ht_all_reduce_f64(groups[g], &heads, 1, HT_REDUCE_SUM);
            clipped = (int)heads;
        }
    }
    /* Whether or not the optimizer stepped (an fp16 overflow skips it): the
     * routing of the step's tokens happened, and Megatron-Core updates the
     * bias in finalize_model_grads, before the optimizer looks at the grads. */
    double load_max = NAN, load_min = NAN;
    if (m->expert_tokens) s = count_expert_tokens(t, &load_max, &load_min, err);
    if (s != HT_OK) {
        dump_free(dump);
        return s;
    }
    ht_fsdp_weights_changed(t->fsdp);
    ht_trace_span("phase", "after the update (QK-clip, expert counts)", HT_TRACE_THREAD, updated, ht_time_seconds(), -1,
                  t->step + 1);
    t->step++;
    if (t->config.training.dump_state) {
        s = dump_tensors(t, dump, "param.", err);
        if (s == HT_OK) s = write_dump(t, dump, err);
        dump_free(dump);
        if (s != HT_OK) return s;
    }
    double t3 = ht_time_seconds(), dt = t3 - t0;
    t->forward_backward_seconds += t1 - t0;
    t->all_to_all_seconds += m->experts.seconds - exchanged;
    t->sync_seconds += t2 - t1;
    t->optimizer_seconds += t3 - t2;
    if (stats) {
        stats->step = t->step;
        stats->loss = loss_sum / ((double)t->grad_accum * t->comm->size / t->par.pp_size); /* the last stage's */
        stats->lr = r.adamw_lr;
        stats->muon_lr = r.muon_lr;
        stats->grad_norm = r.grad_norm;
        stats->loss_scale = r.loss_scale;
        stats->skipped = r.skipped;
        stats->qk_clipped_heads = clipped;
        stats->qk_max_logit = max_logit;
        stats->expert_load_max = load_max;
        stats->expert_load_min = load_min;
        stats->seconds = dt;
        stats->tokens_per_s = (double)t->grad_accum * t->par.dp_size * t->B * t->T / dt;
        if (t->gemm_gflops > 0) {
            stats->mfu = stats->tokens_per_s / t->comm->size * ht_model_flops_per_token(&m->config, t->T) /
                         (t->gemm_gflops * 1e9);
            const double ns = ht_optimizer_ns_flops(&t->optimizer);
            stats->mfu_with_ns = ns > 0 ? stats->mfu + ns / dt / (t->gemm_gflops * 1e9) : 0.0;
        }
    }
    return HT_OK;
}

/* One forward of `count` sequences through every pipeline stage in turn
 * (one stage: the model's forward); *loss the last stage's, NAN elsewhere. */
static ht_status evaluate_forward(ht_trainer *t, const int32_t *inputs, const int32_t *targets, int count, float *loss,
                                  ht_error *err) {
    ht_model *m = t->model;
    ht_pipeline *pipe = &t->pipe;
    const int64_t floats = boundary_floats(t, count);
    *loss = NAN;
    for (int c = 0; c < pipe->chunks; c++) { /* micro-batch 0's slots of each chunk, in turn */
        m->slot = ht_pipeline_slot(pipe, 0, c);
        m->stage_in = ht_pipeline_input(pipe, m->slot);
        m->stage_sums_in = ht_pipeline_input_sums(pipe, m->slot);
        ht_pipeline_receive(pipe, 0, c, false, floats);
        ht_status s = ht_model_forward(m, inputs, targets, count, t->Tc, loss, err);
        if (s == HT_OK) s = ht_kernels()->synchronize(err);
        if (s != HT_OK) return s;
        ht_pipeline_send(pipe, 0, c, false, m->stage_out, floats, m->stage_sums);
        ht_pipeline_finish(pipe);
    }
    return HT_OK;
}

ht_status ht_trainer_evaluate(ht_trainer *t, double *loss, ht_error *err) {
    *loss = NAN;
    if (t->eval_B == 0) return HT_OK;
    /* The first eval_batches x B windows of the validation split (all of
     * them if it holds fewer), in groups of B consecutive windows; rank
     * g mod world forwards group g. A forward then sees the same sequences
     * on any rank count, so its loss (and a load-balancing term, which is the
     * forward's) is the same computation: only the double sum's order
     * depends on the rank count. */
    const uint64_t B = (uint64_t)t->eval_B, world = (uint64_t)t->par.dp_size, rank = (uint64_t)t->par.dp_rank;
    uint64_t n = (uint64_t)t->config.training.eval_batches * B;
    if (n > t->valid_loader.n_windows) n = t->valid_loader.n_windows;
    const uint64_t groups = (n + B - 1) / B, rounds = (groups + world - 1) / world;
    double sum = 0.0;
    for (uint64_t r = 0; r < rounds; r++) {
        /* A rank with no group left in the last round forwards the first
         * one and drops its loss: FSDP's gathers and the experts' exchanges
         * need every rank's forward. */
        const uint64_t g = r * world + rank, first = g < groups ? g * B : 0;
        const int count = (int)(n - first < B ? n - first : B);
        ht_loader_resume(&t->valid_loader, (ht_loader_pos){.epoch = 0, .index = first}, NULL);
        for (int b = 0; b < count; b++) ht_loader_next(&t->valid_loader, t->batch + (size_t)b * (size_t)(t->T + 1));
        ht_batch_split(t->batch, count, t->T, t->inputs, t->targets);
        const int32_t *inputs, *targets;
        take_share(t, count, &inputs, &targets);
        float l;
        ht_status s = evaluate_forward(t, inputs, targets, count, &l, err);
        if (s != HT_OK) return s;
        /* Every window has T targets: the mean over its tokens (context
         * parallelism: each rank's share of them, the shares of one size). */
        if (g < groups && t->model->stage.last) sum += (double)l * count; /* its last chunk's loss */
    }
    ht_all_reduce_f64(t->comm, &sum, 1, HT_REDUCE_SUM);
    sum /= (double)t->par.cp_size * t->par.tp_size; /* a tensor-parallel group's ranks hold the same loss */
    if (n) *loss = sum / (double)n;
    return HT_OK;
}
