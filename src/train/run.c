/* The run loop: the steps, their progress lines and metrics.jsonl, periodic
 * evaluation and checkpoints, a requested stop; at the end the time, FSDP and
 * memory reports, the final weights (whole, Hugging Face format) and the plot. */
#include "hypertrain/train.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/parallel.h"
#include "hypertrain/optimizer.h"
#include "train/events.h"
#include "train/sample.h"

/* This process's resident bytes at most so far. */
static double rss_peak(void) {
    struct rusage u;
    return getrusage(RUSAGE_SELF, &u) == 0 ? (double)u.ru_maxrss * 1024.0 : 0.0;
}

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

/* path opened for writing ("w" or "a") without following a symlink: the
 * run writes into its own directory only. */
static FILE *open_own_file(const char *path, const char *mode) {
    int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_CLOEXEC | (mode[0] == 'a' ? O_APPEND : O_TRUNC);
    int fd = open(path, flags, 0644);
    FILE *f = fd >= 0 ? fdopen(fd, mode) : NULL;
    if (!f && fd >= 0) close(fd);
    return f;
}

/* A metrics file no checkpoint stands behind (a run stopped before its
 * first save) is history, not a run to protect: it is kept aside as
 * metrics.jsonl.<time> and this run starts from step 0. */
static ht_status set_aside(const char *path, ht_error *err) {
    char aside[HT_CONFIG_STR_MAX + 96], when[32];
    time_t now = time(NULL);
    struct tm tm;
    strftime(when, sizeof(when), "%Y%m%d-%H%M%S", localtime_r(&now, &tm));
    struct stat sb;
    snprintf(aside, sizeof(aside), "%s.%s", path, when);
    for (int k = 2; lstat(aside, &sb) == 0 && k < 1000; k++) snprintf(aside, sizeof(aside), "%s.%s-%d", path, when, k);
    if (rename(path, aside) != 0)
        return ht_fail(err, HT_ERR_IO, "%s: cannot keep it aside as %s: %s", path, aside, strerror(errno));
    ht_log_info("%s holds the metrics of a run that saved no checkpoint: kept as %s; this run starts from step 0", path,
                aside);
    return HT_OK;
}

/* path (metrics.jsonl, samples.jsonl: a JSON object with "step" a line)
 * opened for appending. step < 0: a fresh history, the file started anew.
 * Otherwise a resumed run's: the lines up to `step` are kept (a crashed run
 * may have written past its last checkpoint). The kept lines go to
 * path.tmp, fsynced, then renamed over the old file: a kill at any moment
 * leaves the whole old history or the whole kept one, never an empty or cut
 * file. */
static ht_status open_history(const char *path, int64_t step, FILE **out, ht_error *err) {
    char tmp[HT_CONFIG_STR_MAX + 80];
    char *old = NULL;
    size_t len = 0;
    if (step < 0 || ht_read_file(path, &old, &len, NULL) != HT_OK) {
        *out = open_own_file(path, "w");
        if (!*out) return ht_fail(err, HT_ERR_IO, "%s: cannot open for writing: %s", path, strerror(errno));
        return HT_OK;
    }
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = open_own_file(tmp, "w");
    if (!f) {
        free(old);
        return ht_fail(err, HT_ERR_IO, "%s: cannot open for writing: %s", tmp, strerror(errno));
    }
    /* Every line is kept or dropped for a reason: past the restored step, or
     * the last line cut by a kill mid-write. Any other line that is not JSON
     * stops the resume rather than vanish. */
    int number = 0;
    for (char *line = old; line && *line;) {
        char *end = strchr(line, '\n');
        size_t n = end ? (size_t)(end - line) : strlen(line);
        ht_json *obj;
        number++;
        if (n > 0 && ht_json_parse(line, n, path, &obj, NULL) == HT_OK) {
            const ht_json *at = ht_json_get(obj, "step");
            if (at && at->type == HT_JSON_NUMBER && at->number <= (double)step) fprintf(f, "%.*s\n", (int)n, line);
            ht_json_free(obj);
        } else if (!end) {
            ht_log_warn("%s: line %d was cut short (a kill while it was written): dropped", path, number);
        } else if (n > 0) {
            fclose(f);
            remove(tmp);
            free(old);
            return ht_fail(err, HT_ERR_FORMAT,
                           "%s: line %d is not a JSON object: fix or move the file before resuming (it is never "
                           "rewritten without its lines)",
                           path, number);
        }
        line = end ? end + 1 : NULL;
    }
    free(old);
    bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = fclose(f) == 0 && ok;
    if (!ok || rename(tmp, path) != 0) {
        remove(tmp);
        return ht_fail(err, HT_ERR_IO, "%s: cannot write the kept lines: %s", tmp, strerror(errno));
    }
    *out = open_own_file(path, "a");
    if (!*out) return ht_fail(err, HT_ERR_IO, "%s: cannot open for appending", path);
    return HT_OK;
}

/* A fresh run starts metrics.jsonl anew; a resumed one keeps the lines up to
 * the restored step and appends (open_history). */
static ht_status open_metrics(ht_trainer *t, ht_error *err) {
    char path[HT_CONFIG_STR_MAX + 32];
    ht_status s = ht_make_dirs(t->config.checkpoint.output_dir, err);
    if (s != HT_OK) return s;
    snprintf(path, sizeof(path), "%s/metrics.jsonl", t->config.checkpoint.output_dir);
    /* A run that starts from step 0 where another run left checkpoints
     * would replace them: only with checkpoint.overwrite. */
    char newest[64] = "";
    struct stat sb;
    bool has_metrics = stat(path, &sb) == 0 && sb.st_size > 0;
    bool new_lineage = t->step == 0 || t->resumed_from[0]; /* this run did not write what output_dir holds */
    bool has_checkpoint = new_lineage && ht_ckpt_newest(t->config.checkpoint.output_dir, newest, sizeof(newest));
    if (new_lineage && has_metrics && !has_checkpoint && t->step == 0 && !t->config.checkpoint.overwrite) {
        s = set_aside(path, err);
        if (s != HT_OK) return s;
        has_metrics = false;
    }
    if (new_lineage && (has_checkpoint || has_metrics)) {
        char what[160], how[HT_CKPT_PATH_MAX + 64];
        snprintf(what, sizeof(what), "%s%s%s", newest, newest[0] && has_metrics ? " and " : "",
                 has_metrics ? "metrics.jsonl" : "");
        if (t->step == 0)
            snprintf(how, sizeof(how), "this one starts from step 0");
        else
            snprintf(how, sizeof(how), "this one continues %s, a checkpoint of another directory", t->resumed_from);
        if (!t->config.checkpoint.overwrite)
            return ht_fail(err, HT_ERR_CONFIG,
                           "checkpoint.output_dir %s holds another run (%s) and %s: %s, choose another output_dir, or "
                           "set checkpoint.overwrite: true to replace it",
                           t->config.checkpoint.output_dir, what, how,
                           strcmp(t->config.checkpoint.restore_from, "latest") == 0
                               ? "resume one of its own checkpoints (checkpoint.restore_from)"
                               : "resume it (checkpoint.restore_from: latest)");
        ht_log_warn("checkpoint.overwrite: this run replaces the one in %s (%s)", t->config.checkpoint.output_dir,
                    what);
    }
    t->new_lineage = new_lineage;
    return open_history(path, new_lineage ? -1 : t->step, &t->metrics, err);
}

/* ", \"key\": value" in `fmt`; JSON has no NaN or Inf, so a non-finite value
 * (an fp16 step skipped on overflow has no gradient norm) is null. */
static void write_number(FILE *f, const char *key, const char *fmt, double v) {
    fprintf(f, ", \"%s\": ", key);
    if (isfinite(v))
        fprintf(f, fmt, v);
    else
        fputs("null", f);
}

/* One line of metrics.jsonl, flushed; a line the disk did not take stops the
 * run, naming the file, rather than leaving the history cut short unnoticed. */
static ht_status write_metrics(ht_trainer *t, const ht_step_stats *st, double eval_loss, ht_error *err) {
    FILE *f = t->metrics;
    if (!f) return HT_OK;
    fprintf(f, "{\"step\": %lld", (long long)(st ? st->step : t->step));
    if (st) {
        write_number(f, "loss", "%.6f", st->loss);
        write_number(f, "lr", "%.6e", st->lr);
        write_number(f, "muon_lr", "%.6e", st->muon_lr);
        write_number(f, "grad_norm", "%.6f", st->grad_norm);
        write_number(f, "loss_scale", "%g", st->loss_scale);
        fprintf(f, ", \"skipped\": %s, \"qk_clipped_heads\": %d", st->skipped ? "true" : "false", st->qk_clipped_heads);
        write_number(f, "tokens_per_s", "%.1f", st->tokens_per_s);
        if (st->mfu > 0 && st->mfu <= 1.0) write_number(f, "mfu", "%.4f", st->mfu); /* above 1: unreliable */
        if (st->mfu_with_ns > 0 && st->mfu_with_ns <= 1.0) write_number(f, "mfu_with_ns", "%.4f", st->mfu_with_ns);
        if (!isnan(st->qk_max_logit)) write_number(f, "qk_max_logit", "%.4f", st->qk_max_logit);
        if (!isnan(st->expert_load_max)) {
            write_number(f, "expert_load_max", "%.4f", st->expert_load_max);
            write_number(f, "expert_load_min", "%.4f", st->expert_load_min);
        }
    }
    if (isfinite(eval_loss)) write_number(f, "val_loss", "%.6f", eval_loss);
    fprintf(f, "}\n");
    if (fflush(f) != 0 || ferror(f))
        return ht_fail(err, HT_ERR_IO, "%s/metrics.jsonl: cannot write step %lld's line: %s",
                       t->config.checkpoint.output_dir, (long long)(st ? st->step : t->step), strerror(errno));
    return HT_OK;
}

/* training.tensorboard: rank 0's event file, in the directory given or
 * output_dir/tensorboard; a resumed run starts a new file. */
static ht_status open_events(ht_trainer *t, ht_error *err) {
    const ht_config_switch_path *tb = &t->config.training.tensorboard;
    if (!tb->on) return HT_OK;
    char dir[HT_CONFIG_STR_MAX + 16];
    if (tb->path[0])
        snprintf(dir, sizeof(dir), "%s", tb->path);
    else
        snprintf(dir, sizeof(dir), "%s/tensorboard", t->config.checkpoint.output_dir);
    ht_events *w = calloc(1, sizeof(*w));
    if (!w) return ht_fail(err, HT_ERR_OOM, "training.tensorboard: out of memory");
    ht_status s = ht_events_open(w, dir, t->step + 1, err);
    if (s != HT_OK) {
        free(w);
        return s;
    }
    t->events = w;
    ht_log_info("TensorBoard: %s (tensorboard --logdir %s)%s", w->path, dir,
                t->step > 0 ? "; from this step on it replaces what earlier files hold" : "");
    return HT_OK;
}

/* The event file synced and closed: an error if the disk did not take it. */
static ht_status close_events(ht_trainer *t, ht_error *err) {
    if (!t->events) return HT_OK;
    ht_status s = ht_events_close(t->events, err);
    free(t->events);
    t->events = NULL;
    return s;
}

/* A step's scalars as one TensorBoard event: metrics.jsonl's values, and at
 * a logged step (when it is flushed, so that a crash loses at most one log
 * interval) the largest peak resident memory of any rank. Every rank calls
 * it (the memory's maximum is a collective); rank 0 writes. */
static ht_status write_events(ht_trainer *t, const ht_step_stats *st, bool logged, ht_error *err) {
    if (!t->config.training.tensorboard.on) return HT_OK;
    double rss = 0;
    if (logged) {
        rss = rss_peak() / (1024.0 * 1024.0);
        if (t->comm->size > 1) ht_all_reduce_f64(t->comm, &rss, 1, HT_REDUCE_MAX);
    }
    ht_events *w = t->events;
    if (!w) return HT_OK;
    ht_events_begin(w, st->step);
    ht_events_scalar(w, "train/loss", st->loss);
    ht_events_scalar(w, "train/grad_norm", st->grad_norm);
    ht_events_scalar(w, "lr/adamw", st->lr);
    if (t->optimizer.muon) ht_events_scalar(w, "lr/muon", st->muon_lr);
    if (t->optimizer.loss_scaling) ht_events_scalar(w, "train/loss_scale", st->loss_scale);
    ht_events_scalar(w, "perf/tokens_per_s", st->tokens_per_s);
    if (st->mfu > 0 && st->mfu <= 1.0) ht_events_scalar(w, "perf/mfu", st->mfu);
    if (!isnan(st->qk_max_logit)) {
        ht_events_scalar(w, "qk_clip/max_logit", st->qk_max_logit);
        ht_events_scalar(w, "qk_clip/clipped_heads", st->qk_clipped_heads);
    }
    ht_events_scalar(w, "moe/expert_load_max", st->expert_load_max); /* NAN, left out, without experts */
    ht_events_scalar(w, "moe/expert_load_min", st->expert_load_min);
    if (logged) ht_events_scalar(w, "memory/peak_rss_mib", rss);
    ht_status s = ht_events_end(w, err);
    if (s == HT_OK && logged) s = ht_events_flush(w, err);
    return s;
}

static ht_status evaluate_and_log(ht_trainer *t, ht_error *err) {
    double vl;
    ht_status s = ht_trainer_evaluate(t, &vl, err);
    if (s != HT_OK) return s;
    if (isfinite(vl)) {
        ht_log_info("eval  step %5lld | validation loss %.4f (%.3f bits/token)", (long long)t->step, vl, vl / log(2.0));
        t->last_eval_loss = vl;
        s = write_metrics(t, NULL, vl, err);
        if (s == HT_OK && t->events) {
            ht_events_begin(t->events, t->step);
            ht_events_scalar(t->events, "val/loss", vl);
            s = ht_events_end(t->events, err);
            if (s == HT_OK) s = ht_events_flush(t->events, err);
        }
    }
    return s;
}

/* training.trace: whether the run traces step (true: every one). */
static bool traced(const ht_config *c, int64_t step) {
    const ht_config_steps *tr = &c->training.trace;
    if (!tr->on || tr->count == 0) return tr->on;
    for (int i = 0; i < tr->count; i++)
        if (tr->items[i] == step) return true;
    return false;
}

/* A traced step's spans appended to this rank's trace_rank{r}.json (opened
 * at the first, replacing an earlier run's), flushed: a crash loses the
 * step in hand, and leaves a file whose array is not closed. */
static ht_status write_trace(ht_trainer *t, ht_error *err) {
    char path[HT_CONFIG_STR_MAX + 48];
    snprintf(path, sizeof(path), "%s/trace_rank%d.json", t->config.checkpoint.output_dir, t->comm->rank);
    const bool first = !t->trace;
    if (first) {
        t->trace = open_own_file(path, "w");
        if (!t->trace) return ht_fail(err, HT_ERR_IO, "%s: cannot open for writing: %s", path, strerror(errno));
        fprintf(t->trace, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n");
    }
    ht_trace_flush(t->trace, t->comm->rank, first);
    if (fflush(t->trace) != 0 || ferror(t->trace))
        return ht_fail(err, HT_ERR_IO, "%s: cannot write step %lld's trace: %s", path, (long long)t->step,
                       strerror(errno));
    return HT_OK;
}

/* The trace's array closed (the last event names the file's process
 * again, so that no comma is left hanging), synced and closed. */
static ht_status close_trace(ht_trainer *t, ht_error *err) {
    FILE *f = t->trace;
    if (!f) return HT_OK;
    t->trace = NULL;
    fprintf(f,
            "{\"name\": \"process_labels\", \"ph\": \"M\", \"pid\": %d, \"tid\": 0, \"args\": {\"labels\": "
            "\"hypertrain\"}}\n]}\n",
            t->comm->rank);
    bool kept = fflush(f) == 0 && !ferror(f) && fsync(fileno(f)) == 0;
    int e = errno;
    if (fclose(f) != 0 && kept) kept = false, e = errno;
    if (!kept)
        return ht_fail(err, HT_ERR_IO, "%s/trace_rank%d.json: cannot finish writing: %s",
                       t->config.checkpoint.output_dir, t->comm->rank, strerror(e));
    return HT_OK;
}

/* What the FSDP collectives cost a step over the run (evaluations included). */
static void log_fsdp_stats(ht_trainer *t, int64_t steps) {
    const ht_fsdp_stats *st = ht_fsdp_stats_get(t->fsdp);
    const ht_param_store *ps = &t->model->params;
    double weights = 0, grads = 0;
    for (int i = 0; i < ps->count; i++) {
        weights += (double)ht_param_numel(&ps->items[i]) * (double)ht_dtype_size(ps->items[i].compute_dtype);
        grads += (double)ht_param_numel(&ps->items[i]) * sizeof(float);
    }
    double n = (double)steps, mib = 1024.0 * 1024.0;
    double hidden = st->in_flight_seconds > 0 ? 100.0 * (1.0 - st->waited_seconds / st->in_flight_seconds) : 100.0;
    const bool f32 = st->reduce_dtype == HT_DTYPE_F32; /* else the reduce-scatters' bytes are 16-bit ones */
    ht_log_info("FSDP a step (over %lld steps, evaluations included): %.1f all-gathers (%.2f MiB), %.1f "
                "reduce-scatters (%.2f MiB%s%s); collectives in flight %.3f s, compute waited %.3f s of it (%.0f%% "
                "hidden); at most %.2f MiB of whole weights and gradients held at once (the whole model: %.2f MiB "
                "of weights, %.2f MiB of FP32 gradients)",
                (long long)steps, (double)st->gathers / n, st->gathered_bytes / n / mib,
                (double)st->reduce_scatters / n, st->reduced_bytes / n / mib, f32 ? "" : " of ",
                f32 ? "" : ht_dtype_name(st->reduce_dtype), st->in_flight_seconds / n, st->waited_seconds / n, hidden,
                st->pool_peak_bytes / mib, weights / mib, grads / mib);
}

/* The comm layer's buffers of every distinct group of the mesh and the world. */
static double collective_buffers(const ht_trainer *t) {
    const ht_parallel *p = &t->par;
    const ht_comm *groups[] = {t->comm, p->world, p->shard,  p->replica, p->cp, p->ulysses, p->ring,
                               p->tp,   p->model, p->expert, p->ep,      p->pp, p->tied};
    const int n = (int)(sizeof(groups) / sizeof(groups[0]));
    double bytes = 0;
    for (int i = 0; i < n; i++) {
        bool seen = !groups[i];
        for (int j = 0; j < i && !seen; j++) seen = groups[j] == groups[i];
        if (!seen) bytes += (double)groups[i]->buffer_bytes;
    }
    return bytes;
}

/* Every rank's peak resident memory against its plan: the process before
 * the trainer, its rows of the weights (and their compute copy), FP32 main
 * params, main_grad and optimizer state, the pool of FSDP's whole units,
 * the activations of a micro-batch, the comm layer's buffers and the
 * corpus, each measured, and the runtime: the peak less all of them. Rank 0
 * prints a line a rank. */
static void log_memory(ht_trainer *t) {
    const ht_param_store *ps = &t->model->params;
    const ht_memory_plan *plan = &t->memory_plan;
    enum { START, WEIGHTS, MAIN, GRAD, OPTIM, UNITS, ACTS, COMM, DATA, RUNTIME, PEAK, N };
    /* Each category measured, then as planned before allocation. */
    double v[2 * N] = {
        [START] = t->rss_at_start,
        [WEIGHTS] = (double)(ps->data_bytes + ps->compute_bytes),
        [MAIN] = (double)ps->main_bytes,
        [GRAD] = (double)ps->grad_bytes,
        [OPTIM] = (double)ht_optimizer_bytes(&t->optimizer),
        [UNITS] = ht_fsdp_stats_get(t->fsdp)->pool_bytes,
        [ACTS] = (double)t->model->activation_bytes +
                 (double)ht_pipeline_buffer_bytes(&t->pipe), /* and what crosses stages */
        [COMM] = collective_buffers(t),
        [DATA] = t->data ? (double)t->data->n_tokens * sizeof(*t->data->tokens) : 0.0,
        [PEAK] = rss_peak(),
        [N + START] = plan->process,
        [N + WEIGHTS] = plan->weights,
        [N + MAIN] = plan->main,
        [N + GRAD] = plan->grad,
        [N + OPTIM] = plan->optimizer,
        [N + UNITS] = plan->units,
        [N + ACTS] = plan->activations,
        [N + COMM] = plan->collectives,
        [N + DATA] = plan->corpus,
        [N + RUNTIME] = plan->runtime,
    };
    for (int k = START; k < RUNTIME; k++) v[RUNTIME] -= v[k];
    v[RUNTIME] += v[PEAK]; /* what the libraries took beyond the rest */
    int P = t->comm->size;
    double *all = t->comm->rank == 0 ? malloc((size_t)P * 2 * N * sizeof(double)) : NULL;
    int64_t bytes[P];
    for (int r = 0; r < P; r++) bytes[r] = 2 * N * (int64_t)sizeof(double);
    if (t->comm->rank == 0 && !all) return;
    ht_gather(t->comm, v, all, bytes, 0);
    const double mib = 1024.0 * 1024.0;
    for (int r = 0; all && r < P; r++) {
        const double *x = all + (size_t)r * 2 * N, *planned = x + N;
        double plan_sum = 0;
        for (int k = START; k < PEAK; k++) plan_sum += planned[k];
        ht_log_info("memory rank %d: peak RSS %.1f MiB (at start %.1f, weights %.1f, FP32 main params %.1f, "
                    "main_grad %.1f, optimizer %.1f, whole units %.1f, activations %.1f, collectives %.1f, corpus "
                    "%.1f, runtime %.1f); planned before allocating %.1f MiB (%+.1f%%)",
                    r, x[PEAK] / mib, x[START] / mib, x[WEIGHTS] / mib, x[MAIN] / mib, x[GRAD] / mib, x[OPTIM] / mib,
                    x[UNITS] / mib, x[ACTS] / mib, x[COMM] / mib, x[DATA] / mib, x[RUNTIME] / mib, plan_sum / mib,
                    x[PEAK] > 0 ? 100.0 * (plan_sum - x[PEAK]) / x[PEAK] : 0.0);
        if (!t->config.training.memory_profile) continue;
        const char *const names[] = {"at start (libraries, MPI, config)",
                                     "weights (model dtype)",
                                     !t->config.optimizer.fp32_main_params ? "FP32 main params (off: no copies)"
                                     : t->config.optimizer.main_param_storage == HT_CONFIG_MAIN_RESIDUAL16
                                         ? "FP32 main params (residual16 low halves)"
                                         : "FP32 main params",
                                     "main_grad (FP32)",
                                     "optimizer state",
                                     "whole FSDP units (their pool)",
                                     "activations",
                                     "collectives' buffers",
                                     "corpus tokens",
                                     "runtime (the rest of the peak)"};
        ht_log_info("Memory rank %d (tools.memory_profile): %-34s %10s %7s %12s", r, "category", "MiB", "share",
                    "planned MiB");
        for (int k = START; k < PEAK; k++)
            ht_log_info("Memory rank %d:   %-34s %10.1f %6.1f%% %12.1f", r, names[k - START], x[k] / mib,
                        x[PEAK] > 0 ? 100.0 * x[k] / x[PEAK] : 0.0, planned[k] / mib);
        ht_log_info("Memory rank %d:   %-34s %10.1f %7s %12.1f", r, "peak RSS", x[PEAK] / mib, "", plan_sum / mib);
    }
    free(all);
}

/* A whole, unsharded copy of the model's weights on rank 0, from the rows of
 * the first shard group's ranks (the others hold the same rows) of every
 * tensor-parallel place and every pipeline stage: each stage's first rank
 * gathers its params whole, then sends them to rank 0 (the first of the
 * stages' first ranks). The other ranks send theirs and hold nothing more. */
static ht_status gather_whole_model(ht_trainer *t, ht_param_store *whole, ht_error *err) {
    const ht_param_store *ps = &t->model->params;
    const ht_param_store *all = t->whole ? &t->whole->params : ps; /* every stage's params, in the model's order */
    bool root = t->comm->rank == 0;
    if (t->par.mesh.model_group.color != 0) return HT_OK; /* not the first replica */
    for (int i = 0; root && i < all->count; i++) {
        const ht_param *p = &all->items[i];
        ht_param *q = ht_params_add(whole, p->name, p->ndim, p->global_shape, p->dtype);
        if (!q) {
            ht_params_free(whole);
            return ht_fail(err, HT_ERR_OOM, "cannot gather %s", p->name);
        }
        q->trainable = false;
        q->keep_fp32 = p->keep_fp32; /* saved FP32 in a 16-bit model's final weights */
    }
    /* Every rank of the group learns whether rank 0 could hold the model before anyone sends. */
    int64_t ok = root ? ht_params_allocate(whole, err) == HT_OK : 1;
    ht_broadcast(t->par.model, &ok, (int64_t)sizeof(ok), 0);
    if (!ok) {
        ht_params_free(whole);
        return root ? HT_ERR_OOM : ht_fail(err, HT_ERR_OOM, "rank 0 cannot hold the whole model to save it");
    }
    /* A stage's first rank: its whole params there, then to rank 0 over the stages' first ranks. */
    const bool leader = t->par.shard->rank == 0 && t->par.tp->rank == 0, staged = t->par.pp_size > 1;
    for (int i = 0; i < all->count; i++) {
        const int owner =
            ht_pipeline_stage_holding(&t->model->config, t->par.pp_size, t->model->stage.chunks, all->items[i].name);
        const ht_param *p = owner == t->par.pp_rank ? ht_params_find(ps, all->items[i].name) : NULL;
        void *out = root ? whole->items[i].data : NULL;
        const size_t bytes = (size_t)ht_param_global_numel(&all->items[i]) * ht_dtype_size(all->items[i].dtype);
        void *mine = NULL;
        if (p && staged && leader && !root && !(mine = malloc(bytes ? bytes : 1)))
            return ht_fail(err, HT_ERR_OOM, "cannot gather %s to send it", p->name);
        ht_status s = p ? ht_param_gather_global(p, t->par.shard, t->par.tp, p->data, p->dtype, root ? out : mine, true,
                                                 NULL, err)
                        : HT_OK;
        if (s == HT_OK && staged && leader) { /* the stage holding it sends, the others send nothing */
            int64_t sizes[t->par.pp_size];
            for (int q = 0; q < t->par.pp_size; q++) sizes[q] = q == owner ? (int64_t)bytes : 0;
            if (owner != 0) ht_gather(t->par.pp, mine, out, sizes, 0);
        }
        free(mine);
        if (s != HT_OK) return s;
    }
    return HT_OK;
}

/* training.sample_interval: a sample from the whole weights (gathered on
 * rank 0 by every rank where they are sharded) into samples.jsonl, which a
 * fresh run starts anew and a resumed one appends to. */
static ht_status sample(ht_trainer *t, ht_error *err) {
    ht_param_store gathered = {0};
    const ht_param_store *whole = &t->model->params;
    if (t->par.sharded || t->par.tp_size > 1 || t->par.pp_size > 1) {
        ht_status s = gather_whole_model(t, &gathered, err);
        if (s != HT_OK) return s;
        whole = &gathered;
    }
    ht_status s = t->comm->rank == 0 ? ht_trainer_sample(t, whole, err) : HT_OK;
    ht_params_free(&gathered);
    return s;
}

/* tools.profile: where the training loop's time went, phase by phase. */
static void log_profile(const ht_trainer *t, int64_t steps, double total) {
    const struct {
        const char *phase;
        double seconds;
    } rows[] = {
        {"forward", t->forward_seconds},
        {"backward", t->forward_backward_seconds - t->forward_seconds},
        {"reduce (gradient sync)", t->sync_seconds},
        {"optimizer", t->optimizer_seconds},
        {"checkpoint", t->checkpoint_seconds},
        {"evaluation", t->eval_seconds},
    };
    double counted = 0;
    ht_log_info("Profile over %lld steps (tools.profile; backward includes FSDP's overlapped collectives):",
                (long long)steps);
    ht_log_info("  %-24s %10s %12s %7s", "phase", "total s", "per step ms", "share");
    for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
        counted += rows[i].seconds;
        ht_log_info("  %-24s %10.3f %12.2f %6.1f%%", rows[i].phase, rows[i].seconds, 1e3 * rows[i].seconds / steps,
                    total > 0 ? 100.0 * rows[i].seconds / total : 0.0);
    }
    ht_log_info("  %-24s %10.3f %12.2f %6.1f%%", "other (data, metrics, log)", total - counted,
                1e3 * (total - counted) / steps, total > 0 ? 100.0 * (total - counted) / total : 0.0);
}

/* The final weights as a Hugging Face folder. With model.lora the adapters
 * are merged into the weights they adapt (transformers loads the folder as
 * it is), and written alone as a PEFT adapter directory in dir/adapter/. */
static ht_status save_final(ht_trainer *t, const char *dir, const ht_param_store *model, ht_error *err) {
    const ht_model_config *a = &t->model->config;
    ht_dtype dtype = t->model->params.items[0].dtype;
    if (a->lora.rank <= 0) {
        ht_status s = ht_hf_save(dir, a, model, dtype, (size_t)2 << 30, err);
        if (s == HT_OK)
            ht_log_info("saved the final weights (Hugging Face format, %s) to %s", ht_dtype_name(dtype), dir);
        return s;
    }
    ht_param_store merged;
    ht_status s = ht_lora_merge(model, ht_lora_scale(&a->lora), &merged, err);
    if (s != HT_OK) return s;
    s = ht_hf_save(dir, a, &merged, dtype, (size_t)2 << 30, err);
    ht_params_free(&merged);
    if (s != HT_OK) return s;
    ht_log_info("saved the final weights (Hugging Face format, %s, the LoRA adapters merged: W + scale B A) to %s",
                ht_dtype_name(dtype), dir);
    char adapter[HT_CONFIG_STR_MAX + 48];
    snprintf(adapter, sizeof(adapter), "%s/adapter", dir);
    /* In the model dtype, as PEFT's save_pretrained saves its params. */
    s = ht_peft_save_adapter(adapter, model, &a->lora, t->config.model.from_pretrained, dtype, err);
    if (s == HT_OK)
        ht_log_info("saved the LoRA adapters alone (PEFT's layout, %s) to %s", ht_dtype_name(dtype), adapter);
    return s;
}

/* Whether any rank was asked to stop (t->stop_request): every rank asks at
 * the same step boundary, and all learn the same answer, the largest value. */
static int stop_agreed(ht_trainer *t) {
    double v = t->stop_request ? (double)*t->stop_request : 0.0;
    if (t->comm->size > 1) ht_all_reduce_f64(t->comm, &v, 1, HT_REDUCE_MAX);
    return (int)v;
}

/* metrics.jsonl synced and closed: an error if the disk did not take it. */
static ht_status close_metrics(ht_trainer *t, ht_error *err) {
    FILE *metrics = t->metrics;
    if (!metrics) return HT_OK;
    t->metrics = NULL;
    bool kept = fflush(metrics) == 0 && fsync(fileno(metrics)) == 0;
    int e = errno;
    if (fclose(metrics) != 0 && kept) kept = false, e = errno;
    if (!kept)
        return ht_fail(err, HT_ERR_IO, "%s/metrics.jsonl: cannot finish writing: %s", t->config.checkpoint.output_dir,
                       strerror(e));
    return HT_OK;
}

/* A run asked to stop (a preemption's SIGTERM): the step in progress was
 * finished; what it trained since the newest checkpoint is saved, so that
 * the same command resumes where it stopped. */
static ht_status stop_run(ht_trainer *t, int64_t saved_step, ht_error *err) {
    const ht_config *c = &t->config;
    const bool root = t->comm->rank == 0;
    if (root)
        ht_log_warn("stop requested (signal %d) at step %lld of %d: saving a checkpoint and stopping", t->stopped_by,
                    (long long)t->step, c->training.steps);
    ht_status s = HT_OK;
    if (c->checkpoint.save_interval > 0 && t->step != saved_step) s = ht_trainer_save_checkpoint(t, err);
    if (s == HT_OK && root) s = close_metrics(t, err);
    if (s == HT_OK && root) s = close_events(t, err);
    if (s != HT_OK || !root) return s;
    if (c->checkpoint.save_interval <= 0)
        ht_log_warn("stopped at step %lld: checkpoint.save_interval is 0, so no checkpoint was saved; the %lld steps "
                    "of this run are lost",
                    (long long)t->step, (long long)t->step);
    else if (t->step == 0)
        ht_log_info("stopped before step 1: nothing was trained, so no checkpoint was saved; the same command starts "
                    "the run");
    else if (t->step == saved_step && t->resumed_from[0])
        ht_log_info("stopped at step %lld, before training a step: no checkpoint was saved, as %s (which this run "
                    "resumed) holds step %lld; the same command resumes it from there",
                    (long long)t->step, t->resumed_from, (long long)t->step);
    else
        ht_log_info("stopped at step %lld with checkpoint %s/step_%08lld%s; the same command with "
                    "checkpoint.restore_from: latest resumes it",
                    (long long)t->step, c->checkpoint.output_dir, (long long)t->step,
                    t->step == saved_step ? " (resumed, nothing trained since: not saved again)" : "");
    return HT_OK;
}

ht_status ht_trainer_run(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    const bool root = t->comm->rank == 0; /* rank 0 writes the metrics, the final weights and the plot */
    ht_status s = root ? open_metrics(t, err) : HT_OK;
    if (s == HT_OK && root && c->training.sample_interval > 0) {
        char path[HT_CONFIG_STR_MAX + 32];
        snprintf(path, sizeof(path), "%s/samples.jsonl", c->checkpoint.output_dir);
        s = open_history(path, t->new_lineage ? -1 : t->step, &t->samples, err); /* as metrics.jsonl */
    }
    if (s == HT_OK && root) s = open_events(t, err);
    if (s != HT_OK) return s;
    int steps = c->training.steps;
    s = evaluate_and_log(t, err);
    if (s != HT_OK) return s;
    double first_eval = t->last_eval_loss;
    ht_fsdp_stats_reset(t->fsdp);
    t->forward_backward_seconds = t->sync_seconds = t->optimizer_seconds = 0.0;
    t->pipeline_seconds = t->pipeline_busy_seconds = t->pipeline_exchange_seconds = 0.0;
    t->forward_seconds = t->checkpoint_seconds = t->eval_seconds = 0.0;
    double start = ht_time_seconds(), tokens_per_s = 0.0, mfu = 0.0, mfu_ns = 0.0;
    bool mfu_said = false;        /* an MFU above 100% was said to be unreliable */
    int64_t first_step = t->step; /* > 0 when resumed: the ETA counts this run's steps only */
    int64_t saved_step = t->step; /* the step the newest checkpoint holds: resumed from, or saved */
    while (t->step < steps) {
        if ((t->stopped_by = stop_agreed(t)) != 0) break;
        const bool tracing = traced(c, t->step + 1);
        if (tracing) ht_trace_start();
        ht_step_stats st;
        const double s0 = ht_time_seconds();
        s = ht_trainer_step(t, &st, err);
        if (s != HT_OK) return s;
        const double s1 = ht_time_seconds();
        ht_trace_span("phase", "step", HT_TRACE_THREAD, s0, s1, -1, t->step);
        tokens_per_s = tokens_per_s == 0.0 ? st.tokens_per_s : 0.9 * tokens_per_s + 0.1 * st.tokens_per_s;
        mfu = mfu == 0.0 ? st.mfu : 0.9 * mfu + 0.1 * st.mfu;
        mfu_ns = mfu_ns == 0.0 ? st.mfu_with_ns : 0.9 * mfu_ns + 0.1 * st.mfu_with_ns;
        const bool logged = t->step % c->training.log_interval == 0 || t->step == 1 || t->step == steps;
        s = write_metrics(t, &st, NAN, err);
        if (s == HT_OK) s = write_events(t, &st, logged, err);
        if (s != HT_OK) return s;
        if (logged) {
            double elapsed = ht_time_seconds() - start;
            char eta[32], el[32];
            format_duration(eta, sizeof(eta), elapsed / (double)(t->step - first_step) * (double)(steps - t->step));
            format_duration(el, sizeof(el), elapsed);
            char scale[48] = "";
            if (t->optimizer.loss_scaling)
                snprintf(scale, sizeof(scale), " | loss scale %g%s", st.loss_scale, st.skipped ? " (skipped)" : "");
            char util[64] = "";
            if (mfu > 1.0 && !mfu_said)
                ht_log_warn("MFU: this run's steps compute faster than the matrix-product rate measured at start "
                            "(%.0f GFLOP/s a rank), which was measured on a busy machine or is not what these "
                            "products reach: the MFU is unreliable, shown as n/a",
                            t->gemm_gflops);
            mfu_said |= mfu > 1.0;
            if (mfu > 1.0)
                snprintf(util, sizeof(util), " | MFU n/a");
            else if (mfu > 0 && mfu_ns > 0 && mfu_ns <= 1.0) /* Muon's Newton-Schulz is GEMM work too */
                snprintf(util, sizeof(util), " | MFU %4.1f%% (%.1f%% with Newton-Schulz)", 100.0 * mfu, 100.0 * mfu_ns);
            else if (mfu > 0)
                snprintf(util, sizeof(util), " | MFU %4.1f%%", 100.0 * mfu);
            ht_log_info("step %5lld/%d | loss %.4f | lr %.3e | grad norm %7.4f%s | %8.0f tok/s%s | %s elapsed, ETA %s",
                        (long long)t->step, steps, st.loss, st.lr, st.grad_norm, scale, tokens_per_s, util, el, eta);
        }
        double p0 = ht_time_seconds();
        const bool saving = c->checkpoint.save_interval > 0 && t->step % c->checkpoint.save_interval == 0;
        const bool evaluating =
            c->training.eval_interval > 0 && t->step % c->training.eval_interval == 0 && t->step != steps;
        if (saving) {
            s = ht_trainer_save_checkpoint(t, err);
            if (s != HT_OK) return s;
            saved_step = t->step;
        }
        double p1 = ht_time_seconds();
        if (evaluating) {
            s = evaluate_and_log(t, err);
            if (s != HT_OK) return s;
        }
        const int every = c->training.sample_interval;
        if (every > 0 && (t->step % every == 0 || t->step == steps) && (s = sample(t, err)) != HT_OK) return s;
        const double p2 = ht_time_seconds();
        t->checkpoint_seconds += p1 - p0;
        t->eval_seconds += p2 - p1;
        if (tracing) {
            ht_trace_span("phase", "metrics and log", HT_TRACE_THREAD, s1, p0, -1, t->step);
            if (saving) ht_trace_span("phase", "checkpoint", HT_TRACE_THREAD, p0, p1, -1, t->step);
            if (evaluating) ht_trace_span("phase", "evaluation", HT_TRACE_THREAD, p1, p2, -1, t->step);
            ht_trace_stop();
            s = write_trace(t, err);
            if (s != HT_OK) return s;
        }
    }
    s = close_trace(t, err);
    if (s != HT_OK) return s;
    if (t->stopped_by) return stop_run(t, saved_step, err);
    if (c->training.profile && t->step > first_step) log_profile(t, t->step - first_step, ht_time_seconds() - start);
    if (t->step > first_step) {
        double n = (double)(t->step - first_step);
        char a2a[96] = "";
        if (t->par.ep)
            snprintf(a2a, sizeof(a2a), " (the experts' all-to-all %.3f s of it, %.0f%%)", t->all_to_all_seconds / n,
                     100.0 * t->all_to_all_seconds / fmax(t->forward_backward_seconds, 1e-12));
        ht_log_info("time a step (over %lld steps): forward + backward %.3f s%s, gradient sync %.3f s, optimizer %.3f "
                    "s (Muon and AdamW with their collectives, the clip, the cast back)",
                    (long long)(t->step - first_step), t->forward_backward_seconds / n, a2a, t->sync_seconds / n,
                    t->optimizer_seconds / n);
    }
    if (t->par.pp_size > 1 && t->step > first_step) {
        /* Each stage's share of the schedules it spent computing, exchanging and waiting: the bubble measured. */
        const int P = t->par.pp_size, m = t->grad_accum;
        double mine[3] = {t->pipeline_busy_seconds, t->pipeline_exchange_seconds, t->pipeline_seconds}, all[3 * P];
        int64_t bytes[P];
        for (int q = 0; q < P; q++) bytes[q] = (int64_t)sizeof(mine);
        ht_all_gather(t->par.pp, mine, all, bytes);
        char line[1024] = "";
        for (int q = 0; q < P && strlen(line) + 96 < sizeof(line); q++) {
            const double *a = all + 3 * q, busy = a[0] / fmax(a[2], 1e-12);
            snprintf(line + strlen(line), sizeof(line) - strlen(line), "%sstage %d %.0f%% computing, %.0f%% exchanging",
                     q ? "; " : "", q, 100.0 * busy, 100.0 * a[1] / fmax(a[2], 1e-12));
        }
        double idle = 0;
        for (int q = 0; q < P; q++) idle += 1.0 - all[3 * q] / fmax(all[3 * q + 2], 1e-12);
        const int V = t->pipe.chunks;
        ht_log_info("pipeline a step (%s%s): %.3f s of micro-batches; %s; bubble measured %.1f%% (the stages' mean "
                    "idle share, exchanges included), the schedule's (P - 1) / (V m + P - 1) = %.1f%%",
                    t->config.parallel.pipeline_schedule == HT_CONFIG_PP_GPIPE ? "gpipe" : "1f1b",
                    V > 1 ? " interleaved" : "", t->pipeline_seconds / (double)(t->step - first_step), line,
                    100.0 * idle / P, 100.0 * (P - 1) / (V * m + P - 1));
    }
    if (t->par.cp_size > 1 && t->step > first_step) {
        /* This rank's (rank 0's) exchanges, evaluation forwards included. */
        const ht_context_parallel *cp = &t->model->context;
        const double n = (double)(t->step - first_step), flight = cp->ring_seconds;
        ht_log_info("context parallelism a step: Ulysses all-to-all %.3f s; ring traffic %.3f s in flight, %.0f%% of "
                    "it hidden behind the attention of the block in hand",
                    cp->all_to_all_seconds / n, flight / n,
                    flight > 0 ? 100.0 * fmax(0.0, 1.0 - cp->ring_waited_seconds / flight) : 0.0);
    }
    if (t->par.tp_size > 1 && t->step > first_step) {
        /* Rank 0's, evaluation forwards included; they block the layers, nothing overlaps them yet. */
        const ht_tensor_parallel *tp = &t->model->tensor;
        const double n = (double)(t->step - first_step);
        ht_log_info("tensor parallelism a step: %.3f s in its collectives (%.0f%% of forward + backward; none of it "
                    "overlapped), %.1f MiB sent a rank",
                    tp->seconds / n, 100.0 * tp->seconds / fmax(t->forward_backward_seconds, 1e-12),
                    tp->bytes / n / (1 << 20));
    }
    if (t->par.sharded && t->step > first_step) log_fsdp_stats(t, t->step - first_step);
    log_memory(t);
    if (c->checkpoint.save_interval > 0 && t->step % c->checkpoint.save_interval != 0 && t->step != saved_step) {
        s = ht_trainer_save_checkpoint(t, err); /* the end of the run */
        if (s != HT_OK) return s;
    }
    s = evaluate_and_log(t, err);
    if (s != HT_OK) return s;
    if (isfinite(first_eval) && isfinite(t->last_eval_loss))
        ht_log_info("validation loss: %.4f before training, %.4f after %d steps", first_eval, t->last_eval_loss, steps);

    /* The final weights, whole: a sharded run gathers every param's rows first. */
    ht_param_store gathered = {0};
    const ht_param_store *model = &t->model->params;
    if (t->par.sharded || t->par.tp_size > 1 || t->par.pp_size > 1) {
        s = gather_whole_model(t, &gathered, err);
        if (s != HT_OK) return s;
        model = &gathered;
    }
    if (!root) {
        ht_params_free(&gathered);
        return HT_OK;
    }
    char dir[HT_CONFIG_STR_MAX + 32], path[HT_CONFIG_STR_MAX + 64];
    snprintf(dir, sizeof(dir), "%s/final", c->checkpoint.output_dir);
    s = save_final(t, dir, model, err);
    ht_params_free(&gathered);
    if (s != HT_OK) return s;
    /* The metrics are complete: synced and closed, an error if the disk did not take them. */
    snprintf(path, sizeof(path), "%s/metrics.jsonl", c->checkpoint.output_dir);
    s = close_metrics(t, err);
    if (s == HT_OK) s = close_events(t, err);
    if (s != HT_OK) return s;
    char svg[HT_CONFIG_STR_MAX + 64];
    snprintf(svg, sizeof(svg), "%s/loss.svg", c->checkpoint.output_dir);
    s = ht_plot_metrics(path, svg, err);
    if (s != HT_OK) return s;
    ht_log_info("metrics: %s; loss curve: %s", path, svg);
    return HT_OK;
}
