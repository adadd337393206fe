/* The trainer loop: model, data and optimizer from one config; micro-batches
 * with gradient accumulation into FP32 main_grad; global-norm clipping; the
 * AdamW step on the FP32 main params (cast back to the model dtype in the
 * same pass); progress, metrics, evaluation, the final weights and the plot. */
#include "hypertrain/train.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/kernels.h"

/* ------------------------------------------------------------------ setup */

static ht_status build_model(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_model_config arch = c->model.arch;
    ht_status s;
    if (c->model.from_pretrained[0]) {
        s = ht_hf_read_config(c->model.from_pretrained, &arch, err);
        if (s != HT_OK) return s;
    }
    s = ht_model_build(&arch, HT_DTYPE_F32, (uint64_t)c->training.seed, &t->model, err);
    if (s != HT_OK) return s;
    if (c->model.from_pretrained[0]) {
        s = ht_hf_load_weights(c->model.from_pretrained, &t->model->params, err);
        if (s != HT_OK) return s;
        ht_log_info("loaded weights from %s", c->model.from_pretrained);
    }
    /* model_init_dtype converts every float parameter after the weights exist. */
    if (c->model_init_dtype != HT_CONFIG_DTYPE_NONE) {
        s = ht_params_convert(&t->model->params, c->model_init_dtype, err);
        if (s != HT_OK) return s;
    }
    const ht_model_config *a = &t->model->config;
    ht_log_info("Model config: %s, vocab %d, hidden %d, intermediate %d, %d layers, %d heads (%d KV, dim %d), "
                "max positions %d, rope theta %g, rms eps %g, attention bias %s, tied embeddings %s",
                a->name, a->vocab_size, a->hidden_size, a->intermediate_size, a->num_hidden_layers,
                a->num_attention_heads, a->num_key_value_heads, ht_model_config_head_dim(a), a->max_position_embeddings,
                a->rope_theta, a->rms_norm_eps, a->attention_bias ? "yes" : "no",
                a->tie_word_embeddings ? "yes" : "no");
    ht_dtype dtype = t->model->params.items[0].dtype;
    ht_log_info("Model: %.2fM parameters in %s; GEMM: %s", (double)ht_params_total_numel(&t->model->params) / 1e6,
                ht_dtype_name(dtype), ht_gemm_kernel_name(dtype));
    return HT_OK;
}

static ht_status open_data(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_data_config dc = {0};
    snprintf(dc.dataset_type, sizeof(dc.dataset_type), "%s", c->data.dataset_type);
    snprintf(dc.path, sizeof(dc.path), "%s", c->data.path);
    dc.seq_len = c->data.seq_len;
    dc.valid_fraction = c->data.valid_fraction;
    if (dc.seq_len > t->model->config.max_position_embeddings)
        return ht_fail(err, HT_ERR_CONFIG, "data.seq_len (%d) is longer than model.max_position_embeddings (%d)",
                       dc.seq_len, t->model->config.max_position_embeddings);
    ht_status s = ht_dataset_open(&dc, &t->data, err);
    if (s != HT_OK) return s;
    s = ht_dataset_check_vocab(t->data, t->model->config.vocab_size, err);
    if (s != HT_OK) return s;
    t->B = c->training.local_batch_size;
    t->T = c->data.seq_len;
    t->grad_accum = c->training.global_batch_size / c->training.local_batch_size;
    uint64_t seed = (uint64_t)c->training.seed;
    s = ht_loader_init(&t->train_loader, t->data, HT_SPLIT_TRAIN, t->B, t->T, 0, 1, seed, true, err);
    if (s != HT_OK) return s;
    if (ht_dataset_split_tokens(t->data, HT_SPLIT_VALID) > 0 && c->training.eval_batches > 0) {
        /* Validation may hold fewer windows than a batch: evaluate with a smaller one. */
        int eval_b = t->B;
        ht_error probe;
        while (eval_b > 0 && ht_loader_init(&t->valid_loader, t->data, HT_SPLIT_VALID, eval_b, t->T, 0, 1, seed, false,
                                            &probe) != HT_OK)
            eval_b /= 2;
        t->eval_B = eval_b;
        if (eval_b == 0) ht_log_warn("the validation split is too small for one sequence: no evaluation");
    }
    ht_log_info("Data: %s at %s: %zu train tokens, %zu validation tokens, vocab %d; %d x %d tokens per micro-batch, "
                "%d micro-batches per step",
                c->data.dataset_type, c->data.path, ht_dataset_split_tokens(t->data, HT_SPLIT_TRAIN),
                ht_dataset_split_tokens(t->data, HT_SPLIT_VALID), ht_dataset_vocab_size(t->data), t->B, t->T,
                t->grad_accum);
    size_t n = (size_t)t->B * (size_t)t->T;
    t->batch = ht_alloc((n + (size_t)t->B) * sizeof(int32_t));
    t->inputs = ht_alloc(n * sizeof(int32_t));
    t->targets = ht_alloc(n * sizeof(int32_t));
    if (!t->batch || !t->inputs || !t->targets) return ht_fail(err, HT_ERR_OOM, "cannot allocate batch buffers");
    return HT_OK;
}

static void fill_schedule(ht_lr_schedule *sc, const ht_config *c, double base_lr) {
    memset(sc, 0, sizeof(*sc));
    sc->type = (ht_lr_type)c->lr_scheduler.type; /* both enums follow NUMERICS.md's order */
    sc->base_lr = base_lr;
    sc->warmup_lr_init = c->lr_scheduler.warmup_lr_init;
    sc->lr_end = c->lr_scheduler.lr_end;
    sc->total_steps = c->training.steps;
    sc->warmup_steps = ht_config_warmup_steps(c);
    sc->num_cycles = c->lr_scheduler.num_cycles;
    sc->decay_steps = c->lr_scheduler.decay_steps;
    sc->power = c->lr_scheduler.power;
    sc->decay_start = ht_config_decay_start_steps(c);
    sc->eta_min = c->lr_scheduler.eta_min;
    sc->t_max = c->lr_scheduler.t_max;
}

static ht_status build_optimizer(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_param_store *ps = &t->model->params;
    ht_status s = ht_params_create_main(ps, err);
    if (s != HT_OK) return s;
    ht_param *list[ps->count];
    int n = 0;
    for (int i = 0; i < ps->count; i++)
        if (ps->items[i].trainable) list[n++] = &ps->items[i];
    const char *no_wd[HT_CONFIG_LIST_MAX];
    for (int i = 0; i < c->optimizer.adamw.no_weight_decay.count; i++)
        no_wd[i] = c->optimizer.adamw.no_weight_decay.items[i];
    ht_adamw_config ac = {
        .lr = c->optimizer.adamw.lr,
        .beta1 = c->optimizer.adamw.betas[0],
        .beta2 = c->optimizer.adamw.betas[1],
        .eps = c->optimizer.adamw.eps,
        .weight_decay = c->optimizer.adamw.weight_decay,
    };
    s = ht_adamw_init(&t->adamw, &ac, list, n, no_wd, c->optimizer.adamw.no_weight_decay.count, err);
    if (s != HT_OK) return s;
    fill_schedule(&t->adamw_schedule, c, ac.lr);
    ht_log_info("Optimizer: AdamW on %d parameters (lr %g, betas (%g, %g), eps %g, weight decay %g), schedule %s "
                "with %lld warmup steps of %d",
                n, ac.lr, ac.beta1, ac.beta2, ac.eps, ac.weight_decay, ht_lr_type_name(t->adamw_schedule.type),
                (long long)t->adamw_schedule.warmup_steps, c->training.steps);
    return HT_OK;
}

ht_status ht_trainer_init(ht_trainer *t, const ht_config *cfg, ht_error *err) {
    memset(t, 0, sizeof(*t));
    t->config = *cfg;
    t->last_eval_loss = NAN;
    ht_status s = ht_config_validate(cfg, 1, err);
    if (s == HT_OK) s = build_model(t, err);
    if (s == HT_OK) s = open_data(t, err);
    if (s == HT_OK) s = build_optimizer(t, err);
    if (s != HT_OK) ht_trainer_free(t);
    return s;
}

void ht_trainer_free(ht_trainer *t) {
    if (t->metrics) fclose(t->metrics);
    ht_adamw_free(&t->adamw);
    ht_loader_free(&t->train_loader);
    ht_loader_free(&t->valid_loader);
    ht_dataset_free(t->data);
    ht_model_free(t->model);
    ht_free(t->batch);
    ht_free(t->inputs);
    ht_free(t->targets);
    memset(t, 0, sizeof(*t));
}

/* ------------------------------------------------------------------ steps */

ht_status ht_trainer_step(ht_trainer *t, ht_step_stats *stats, ht_error *err) {
    double t0 = ht_time_seconds();
    ht_param_store *ps = &t->model->params;
    ht_params_zero_grad(ps);
    double loss_sum = 0.0;
    for (int micro = 0; micro < t->grad_accum; micro++) {
        ht_loader_next(&t->train_loader, t->batch);
        ht_batch_split(t->batch, t->B, t->T, t->inputs, t->targets);
        float loss;
        ht_status s = ht_model_forward(t->model, t->inputs, t->targets, t->B, t->T, &loss, err);
        if (s != HT_OK) return s;
        ht_model_backward(t->model, 1.0f / (float)t->grad_accum);
        loss_sum += loss;
    }
    const char *bad = NULL;
    double norm = ht_grad_norm(ps, &bad);
    if (!isfinite(norm))
        return ht_fail(err, HT_ERR_NUMERIC, "step %lld: the gradient norm is not finite; first non-finite gradient: %s",
                       (long long)t->step + 1, bad ? bad : "(none found)");
    ht_clip_grads(ps, norm, t->config.training.max_norm);
    double lr = ht_lr_at(&t->adamw_schedule, t->step);
    ht_adamw_step(&t->adamw, lr);
    t->step++;
    double dt = ht_time_seconds() - t0;
    if (stats) {
        stats->step = t->step;
        stats->loss = loss_sum / t->grad_accum;
        stats->lr = lr;
        stats->grad_norm = norm;
        stats->seconds = dt;
        stats->tokens_per_s = (double)t->grad_accum * t->B * t->T / dt;
    }
    return HT_OK;
}

ht_status ht_trainer_evaluate(ht_trainer *t, double *loss, ht_error *err) {
    *loss = NAN;
    if (t->eval_B == 0) return HT_OK;
    ht_loader_reset(&t->valid_loader);
    int b = t->eval_B;
    uint64_t batches = ht_loader_batches_per_epoch(&t->valid_loader);
    if (batches > (uint64_t)t->config.training.eval_batches) batches = (uint64_t)t->config.training.eval_batches;
    double sum = 0.0;
    for (uint64_t i = 0; i < batches; i++) {
        ht_loader_next(&t->valid_loader, t->batch);
        ht_batch_split(t->batch, b, t->T, t->inputs, t->targets);
        float l;
        ht_status s = ht_model_forward(t->model, t->inputs, t->targets, b, t->T, &l, err);
        if (s != HT_OK) return s;
        sum += l;
    }
    if (batches) *loss = sum / (double)batches;
    return HT_OK;
}

/* ------------------------------------------------------------------ the run */

static void format_duration(char *buf, size_t n, double seconds) {
    if (!(seconds >= 0) || seconds > 1e7) {
        snprintf(buf, n, "?");
        return;
    }
    int s = (int)(seconds + 0.5);
    if (s >= 3600)
        snprintf(buf, n, "%dh%02dm", s / 3600, s % 3600 / 60);
    else if (s >= 60)
        snprintf(buf, n, "%dm%02ds", s / 60, s % 60);
    else
        snprintf(buf, n, "%ds", s);
}

static ht_status open_metrics(ht_trainer *t, ht_error *err) {
    char path[HT_CONFIG_STR_MAX + 32];
    ht_status s = ht_make_dirs(t->config.checkpoint.output_dir, err);
    if (s != HT_OK) return s;
    snprintf(path, sizeof(path), "%s/metrics.jsonl", t->config.checkpoint.output_dir);
    t->metrics = fopen(path, "w");
    if (!t->metrics) return ht_fail(err, HT_ERR_IO, "%s: cannot open for writing", path);
    return HT_OK;
}

static void write_metrics(ht_trainer *t, const ht_step_stats *st, double eval_loss) {
    if (!t->metrics) return;
    if (st)
        fprintf(t->metrics,
                "{\"step\": %lld, \"loss\": %.6f, \"lr\": %.6e, \"grad_norm\": %.6f, \"tokens_per_s\": %.1f",
                (long long)st->step, st->loss, st->lr, st->grad_norm, st->tokens_per_s);
    else
        fprintf(t->metrics, "{\"step\": %lld", (long long)t->step);
    if (isfinite(eval_loss)) fprintf(t->metrics, ", \"val_loss\": %.6f", eval_loss);
    fprintf(t->metrics, "}\n");
    fflush(t->metrics);
}

static ht_status evaluate_and_log(ht_trainer *t, ht_error *err) {
    double vl;
    ht_status s = ht_trainer_evaluate(t, &vl, err);
    if (s != HT_OK) return s;
    if (isfinite(vl)) {
        ht_log_info("eval  step %5lld | validation loss %.4f (%.3f bits/token)", (long long)t->step, vl, vl / log(2.0));
        t->last_eval_loss = vl;
        write_metrics(t, NULL, vl);
    }
    return HT_OK;
}

ht_status ht_trainer_run(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_status s = open_metrics(t, err);
    if (s != HT_OK) return s;
    int steps = c->training.steps;
    s = evaluate_and_log(t, err);
    if (s != HT_OK) return s;
    double first_eval = t->last_eval_loss;
    double start = ht_time_seconds(), tokens_per_s = 0.0;
    while (t->step < steps) {
        ht_step_stats st;
        s = ht_trainer_step(t, &st, err);
        if (s != HT_OK) return s;
        tokens_per_s = tokens_per_s == 0.0 ? st.tokens_per_s : 0.9 * tokens_per_s + 0.1 * st.tokens_per_s;
        write_metrics(t, &st, NAN);
        if (t->step % c->training.log_interval == 0 || t->step == 1 || t->step == steps) {
            double elapsed = ht_time_seconds() - start;
            char eta[32], el[32];
            format_duration(eta, sizeof(eta), elapsed / (double)t->step * (double)(steps - t->step));
            format_duration(el, sizeof(el), elapsed);
            ht_log_info("step %5lld/%d | loss %.4f | lr %.3e | grad norm %7.4f | %8.0f tok/s | %s elapsed, ETA %s",
                        (long long)t->step, steps, st.loss, st.lr, st.grad_norm, tokens_per_s, el, eta);
        }
        if (c->training.eval_interval > 0 && t->step % c->training.eval_interval == 0 && t->step != steps) {
            s = evaluate_and_log(t, err);
            if (s != HT_OK) return s;
        }
    }
    s = evaluate_and_log(t, err);
    if (s != HT_OK) return s;
    if (isfinite(first_eval) && isfinite(t->last_eval_loss))
        ht_log_info("validation loss: %.4f before training, %.4f after %d steps", first_eval, t->last_eval_loss, steps);

    char dir[HT_CONFIG_STR_MAX + 32], path[HT_CONFIG_STR_MAX + 64];
    snprintf(dir, sizeof(dir), "%s/final", c->checkpoint.output_dir);
    ht_dtype dtype = t->model->params.items[0].dtype;
    s = ht_hf_save(dir, &t->model->config, &t->model->params, dtype, (size_t)2 << 30, err);
    if (s != HT_OK) return s;
    ht_log_info("saved the final weights (Hugging Face format, %s) to %s", ht_dtype_name(dtype), dir);
    fflush(t->metrics);
    snprintf(path, sizeof(path), "%s/metrics.jsonl", c->checkpoint.output_dir);
    char svg[HT_CONFIG_STR_MAX + 64];
    snprintf(svg, sizeof(svg), "%s/loss.svg", c->checkpoint.output_dir);
    s = ht_plot_metrics(path, svg, err);
    if (s != HT_OK) return s;
    ht_log_info("metrics: %s; loss curve: %s", path, svg);
    return HT_OK;
}
