/* The trainer's checkpoints: its view for the checkpoint layer, the save by
 * the first shard group's ranks, and the resume (the hyperparameters and global
 * batch that changed since, the data positions, the new lineage it may start). */
#include "hypertrain/train.h"

#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/parallel.h"
#include "hypertrain/kernels.h"

void ht_trainer_checkpoint_view(ht_trainer *t, ht_ckpt_view *v) {
    memset(v, 0, sizeof(*v));
    v->params = &t->model->params;
    v->optimizer = &t->optimizer;
    v->config = &t->config;
    v->model = &t->model->config;
    v->whole = t->whole ? &t->whole->params : NULL;
    v->state.step = t->step;
    v->state.schedule_step = t->optimizer.step;
    v->state.no_rng = t->config.training.no_save_rng;
    v->state.seed = t->config.training.seed;
    v->state.train_pos = ht_loader_position(&t->train_loader);
    v->state.valid_pos = ht_loader_position(&t->valid_loader);
    v->state.loss_scaling = t->optimizer.loss_scaling;
    v->state.scaler = t->optimizer.scaler;
    v->state.gemm_bf16 = ht_kernels_gemm_kernel(HT_DTYPE_BF16);
    v->state.gemm_f16 = ht_kernels_gemm_kernel(HT_DTYPE_F16);
}

/* What one rank wrote, as bytes for rank 0: the file's name, size and hash,
 * then its chunks. */
typedef struct rank_file_head {
    char file[64];
    uint64_t size, hash;
    int64_t count;
} rank_file_head;

/* Every rank's ht_ckpt_rank_file, on every rank (ranks[world]). */
static ht_status gather_rank_files(ht_comm *comm, const ht_ckpt_rank_file *mine, ht_ckpt_rank_file *ranks,
                                   ht_error *err) {
    int P = comm->size;
    int64_t my_bytes = (int64_t)sizeof(rank_file_head) + (int64_t)mine->count * (int64_t)sizeof(ht_ckpt_chunk);
    int64_t sizes[P], eight[P], total = 0;
    for (int r = 0; r < P; r++) eight[r] = sizeof(int64_t);
    ht_all_gather(comm, &my_bytes, sizes, eight);
    for (int r = 0; r < P; r++) total += sizes[r];
    char *all = malloc((size_t)total), *me = malloc((size_t)my_bytes);
    if (!all || !me) {
        free(all);
        free(me);
        return ht_fail(err, HT_ERR_OOM, "cannot gather the checkpoint's chunk lists");
    }
    rank_file_head head = {.size = mine->size, .hash = mine->hash, .count = mine->count};
    memcpy(head.file, mine->file, sizeof(head.file));
    memcpy(me, &head, sizeof(head));
    memcpy(me + sizeof(head), mine->chunks, (size_t)mine->count * sizeof(ht_ckpt_chunk));
    ht_all_gather(comm, me, all, sizes);
    const char *at = all;
    for (int r = 0; r < P; r++) {
        memcpy(&head, at, sizeof(head));
        memcpy(ranks[r].file, head.file, sizeof(ranks[r].file));
        ranks[r].size = head.size;
        ranks[r].hash = head.hash;
        ranks[r].count = ranks[r].capacity = (int)head.count;
        ranks[r].chunks = malloc((size_t)(head.count ? head.count : 1) * sizeof(ht_ckpt_chunk));
        if (ranks[r].chunks) memcpy(ranks[r].chunks, at + sizeof(head), (size_t)head.count * sizeof(ht_ckpt_chunk));
        at += sizes[r];
    }
    free(all);
    free(me);
    for (int r = 0; r < P; r++)
        if (!ranks[r].chunks) return ht_fail(err, HT_ERR_OOM, "cannot gather the checkpoint's chunk lists");
    return HT_OK;
}

ht_status ht_trainer_save_checkpoint(ht_trainer *t, ht_error *err) {
    const ht_config *c = &t->config;
    ht_ckpt_view v;
    ht_trainer_checkpoint_view(t, &v);
    ht_ckpt_save_options o = {.save_optimizer = c->checkpoint.save_optimizer,
                              .keep_last = c->checkpoint.keep_last,
                              .tp_rank = t->par.tp->rank,
                              .steps_rank = t->par.pp_rank * (t->par.model->size / t->par.pp_size)};
    double t0 = ht_time_seconds();
    ht_comm *comm = t->comm;
    const bool root = comm->rank == 0;
    /* The first replica writes: its shard group of every tensor-parallel
     * place of every pipeline stage (the other replicas hold the same boxes; with shard_size 1 and
     * no tensor parallelism that is rank 0 alone, holding everything). Rank 0 opens
     * step_X.tmp/, every rank of the group writes its rows into its own file,
     * rank 0 writes metadata.json from every rank's chunk list and commits,
     * and the other ranks wait until it is complete. A rank that fails ends
     * the world (CLI), and the .tmp is never loaded. */
    ht_comm *group = t->par.model;
    if (t->par.mesh.model_group.color == 0) {
        char tmp[HT_CKPT_PATH_MAX] = "";
        ht_status s = root ? ht_ckpt_begin(c->checkpoint.output_dir, t->step, tmp, sizeof(tmp), err) : HT_OK;
        if (s != HT_OK) return s;
        ht_broadcast(group, tmp, (int64_t)sizeof(tmp), 0);
        ht_ckpt_rank_file mine = {0};
        s = ht_ckpt_write_rank(tmp, group->rank, &v, &o, &mine, err);
        if (s != HT_OK) return s;
        ht_ckpt_rank_file *ranks = calloc((size_t)group->size, sizeof(ht_ckpt_rank_file));
        s = ranks ? gather_rank_files(group, &mine, ranks, err) : ht_fail(err, HT_ERR_OOM, "out of memory");
        if (s == HT_OK && root) s = ht_ckpt_commit(c->checkpoint.output_dir, group->size, ranks, &v, &o, err);
        ht_ckpt_rank_file_free(&mine);
        for (int r = 0; ranks && r < group->size; r++) ht_ckpt_rank_file_free(&ranks[r]);
        free(ranks);
        if (s != HT_OK) return s;
        if (root)
            ht_log_info("saved checkpoint %s/step_%08lld (%d rank file%s) in %.2f s", c->checkpoint.output_dir,
                        (long long)t->step, group->size, group->size > 1 ? "s" : "", ht_time_seconds() - t0);
    }
    ht_barrier(comm);
    return HT_OK;
}

/* The optimizer and schedule settings the checkpoint was saved with, against
 * this run's: each difference is named, and this run's value is the one used
 * (as the seed systems do on a resume). */
static void log_changed_hyperparameters(const ht_trainer *t, const ht_checkpoint *ck) {
    int changed = 0;
    char now[4096];
    for (int i = 0; i < ht_config_key_count(); i++) {
        const char *key = ht_config_key_name(i);
        if (strncmp(key, "optimizer.", 10) != 0 && strncmp(key, "lr_scheduler.", 13) != 0 &&
            strcmp(key, "training.max_norm") != 0 && strcmp(key, "training.gradient_scaling_factor") != 0)
            continue;
        const char *then = ht_ckpt_config_value(ck, key);
        if (!then || !ht_config_format_value(&t->config, key, now, sizeof(now)) || strcmp(then, now) == 0) continue;
        ht_log_warn("resume: %s was %s in %s; this run uses %s (the config's value wins)", key, then, ht_ckpt_dir(ck),
                    now);
        changed++;
    }
    if (changed)
        ht_log_info("resume: %d optimizer setting%s changed since the checkpoint", changed, changed > 1 ? "s" : "");
}

/* Whether checkpoint.allow_changes names key (in any of its spellings). */
static bool change_allowed(const ht_config *c, const char *key) {
    for (int i = 0; i < c->checkpoint.allow_changes.count; i++) {
        int index = ht_config_key_index(c->checkpoint.allow_changes.items[i]);
        if (index >= 0 && strcmp(ht_config_key_name(index), key) == 0) return true;
    }
    return false;
}

/* Two spellings of one file (a relative path and its absolute one, a
 * symlink) are no change. */
static bool same_file(const char *a, const char *b) {
    char ra[PATH_MAX], rb[PATH_MAX];
    return a[0] && b[0] && realpath(a, ra) && realpath(b, rb) && strcmp(ra, rb) == 0;
}

/* A resume goes on with the model and the data it was saved with: a key
 * that says what the model computes or what data it reads
 * (ht_config_key_fixed_on_resume) and differs from the checkpoint's is an
 * error naming each such key with both values, unless
 * checkpoint.allow_changes names it (then it is logged). The same on every
 * rank (every rank holds the config and the checkpoint's), so said once. */
static ht_status check_fixed_keys(const ht_trainer *t, const ht_checkpoint *ck, ht_error *err) {
    char now[1024], unquoted_then[1024], unquoted_now[1024], list[HT_ERROR_MSG_MAX / 2] = "", names[512] = "";
    int changed = 0;
    for (int i = 0; i < ht_config_key_count(); i++) {
        const char *key = ht_config_key_name(i);
        if (!ht_config_key_fixed_on_resume(key)) continue;
        const char *then = ht_ckpt_config_value(ck, key);
        if (!then || !ht_config_format_value(&t->config, key, now, sizeof(now)) || strcmp(then, now) == 0) continue;
        if (strcmp(key, "data.path") == 0 || strcmp(key, "data.dataset_dir") == 0 ||
            strcmp(key, "data.tokenizer") == 0) {
            /* the formatted values are YAML strings: compare the paths they spell */
            snprintf(unquoted_then, sizeof(unquoted_then), "%s", then[0] == '"' ? then + 1 : then);
            snprintf(unquoted_now, sizeof(unquoted_now), "%s", now[0] == '"' ? now + 1 : now);
            unquoted_then[strcspn(unquoted_then, "\"")] = unquoted_now[strcspn(unquoted_now, "\"")] = '\0';
            if (same_file(unquoted_then, unquoted_now)) continue;
        }
        if (change_allowed(&t->config, key)) {
            if (t->comm->rank == 0)
                ht_log_warn("resume: %s was %s in %s; this run uses %s (checkpoint.allow_changes names it)", key, then,
                            ht_ckpt_dir(ck), now);
            continue;
        }
        size_t at = strlen(list), at_names = strlen(names);
        int n = snprintf(list + at, sizeof(list) - at, "%s%s: %.300s in the checkpoint, %.300s in this run",
                         changed ? "; " : "", key, then, now);
        n += snprintf(names + at_names, sizeof(names) - at_names, "%s%s", changed ? ", " : "", key);
        (void)n; /* a list too long for the message ends cut: the first keys are named */
        changed++;
    }
    if (!changed) return HT_OK;
    ht_fail(err, HT_ERR_CONFIG,
            "resume from %s: %d key%s that say%s what the model computes or what data it reads changed since the "
            "checkpoint (%s): a resume goes on with the model and data it was saved with. Put the checkpoint's "
            "value%s back, or, to change %s on purpose, set checkpoint.allow_changes: [%s]",
            ht_ckpt_dir(ck), changed, changed > 1 ? "s" : "", changed > 1 ? "" : "s", list, changed > 1 ? "s" : "",
            changed > 1 ? "them" : "it", names);
    err->everywhere = true;
    return HT_ERR_CONFIG;
}

/* A checkpoint config's integer (0: absent or null). */
static long long saved_int(const ht_checkpoint *ck, const char *key) {
    const char *v = ht_ckpt_config_value(ck, key);
    return v ? strtoll(v, NULL, 10) : 0;
}

/* The data-parallel ranks a checkpoint was written by: its writers over its
 * context- and tensor-parallel sizes (1 where its config has none). */
static long long saved_data_parallel(const ht_checkpoint *ck) {
    long long u = saved_int(ck, "parallel.ulysses_parallel_size"), r = saved_int(ck, "parallel.ring_attention_size"),
              tp = saved_int(ck, "parallel.tensor_parallel_size");
    return ht_ckpt_world_size(ck) / ((u > 0 ? u : 1) * (r > 0 ? r : 1) * (tp > 0 ? tp : 1));
}

/* The global batch, in sequences per step, and what sets it: the
 * accumulation count when given (MindSpeed-MM's: it follows the ranks), else
 * training.global_batch_size. */
static long long describe_batch(long long local, long long accum, long long world, long long global, char *buf,
                                size_t n) {
    if (accum > 0) {
        snprintf(buf, n,
                 "training.local_batch_size %lld x training.gradient_accumulation_steps %lld x %lld data-parallel "
                 "rank%s",
                 local, accum, world, world == 1 ? "" : "s");
        return local * accum * world;
    }
    snprintf(buf, n, "training.global_batch_size");
    return global;
}

/* A resume with another global batch keeps the data position and the step
 * count: said once, with what it does to both. */
static void warn_changed_batch(const ht_trainer *t, const ht_checkpoint *ck, const ht_ckpt_trainer_state *st) {
    const ht_config *c = &t->config;
    char then_how[256], now_how[256], data[256];
    long long then = describe_batch(saved_int(ck, "training.local_batch_size"),
                                    saved_int(ck, "training.gradient_accumulation_steps"), saved_data_parallel(ck),
                                    saved_int(ck, "training.global_batch_size"), then_how, sizeof(then_how));
    long long now = describe_batch(t->B, c->training.gradient_accumulation_steps, t->par.dp_size,
                                   (long long)t->B * t->grad_accum * t->par.dp_size, now_how, sizeof(now_how));
    if (then <= 0 || then == now) return;
    if (st->no_rng || c->training.no_load_rng)
        snprintf(data, sizeof(data), "starts again from its beginning (no data position is restored)");
    else
        snprintf(data, sizeof(data), "continues at the saved position (epoch %llu, window %llu)",
                 (unsigned long long)st->train_pos.epoch, (unsigned long long)st->train_pos.index);
    long long step = st->step, steps = c->training.steps, left = steps > step ? steps - step : 0;
    ht_log_warn("resume: the global batch was %lld sequences in %s (%s); this run's is %lld (%s). The data %s, %lld "
                "windows a step from here; the LR schedules count steps, not sequences, so each of steps %lld to %lld "
                "takes %.3g times the sequences it would have had at its learning rate, and the run sees %lld "
                "sequences in all instead of %lld",
                then, ht_ckpt_dir(ck), then_how, now, now_how, data, now, step + 1, steps, (double)now / (double)then,
                step * then + left * now, steps * then);
}

/* The directory that holds a checkpoint's entry, as its path names it (not
 * where a symlink points): a symlinked checkpoint in output_dir is output_dir's. */
static void holding_dir(const char *dir, char *out, size_t n) {
    snprintf(out, n, "%s", dir);
    size_t len = strlen(out);
    while (len > 1 && out[len - 1] == '/') out[--len] = '\0';
    char *slash = strrchr(out, '/');
    const char *last = slash ? slash + 1 : out;
    if (strcmp(last, ".") == 0 || strcmp(last, "..") == 0)
        snprintf(out, n, "%s/..", dir); /* no entry to name: the directory above, as realpath finds it */
    else if (!slash)
        snprintf(out, n, ".");
    else if (slash == out)
        out[1] = '\0'; /* "/step_1" is held by "/" */
    else
        *slash = '\0';
}

ht_status ht_trainer_restore(ht_trainer *t, const char *restore_from, bool restore_optimizer, ht_error *err) {
    char dir[HT_CKPT_PATH_MAX];
    ht_status s = ht_ckpt_resolve(restore_from, t->config.checkpoint.output_dir, dir, sizeof(dir), err);
    if (s != HT_OK || !dir[0]) return s;
    ht_checkpoint *ck;
    s = ht_ckpt_open(dir, &ck, err);
    if (s != HT_OK) return s;
    /* A checkpoint of another directory starts a new lineage in output_dir:
     * what output_dir holds already is another run's (open_metrics). */
    char parent[HT_CKPT_PATH_MAX + 8], here[PATH_MAX], there[PATH_MAX];
    holding_dir(dir, parent, sizeof(parent));
    t->resumed_from[0] = '\0';
    if (!realpath(parent, there) || !realpath(t->config.checkpoint.output_dir, here) || strcmp(here, there) != 0)
        snprintf(t->resumed_from, sizeof(t->resumed_from), "%s", dir);
    if (restore_optimizer && (s = check_fixed_keys(t, ck, err)) != HT_OK) {
        ht_ckpt_close(ck);
        return s;
    }
    ht_ckpt_view v;
    ht_trainer_checkpoint_view(t, &v);
    v.lenient = !t->config.training.load_strict;
    s = ht_ckpt_load(ck, &v, restore_optimizer, err);
    if (s == HT_OK && restore_optimizer && t->comm->rank == 0) {
        log_changed_hyperparameters(t, ck);
        warn_changed_batch(t, ck, &v.state);
    }
    ht_ckpt_close(ck);
    if (s != HT_OK) return s;
    if (t->fsdp) ht_fsdp_weights_changed(t->fsdp); /* gathered copies of the old weights are stale */
    if (!restore_optimizer) return HT_OK;
    /* The schedules' step and the loss scaler came with the optimizer; the rest is the trainer's. */
    t->step = v.state.step;
    /* The random state (training.no_save_rng / no_load_rng, MindSpeed-MM's):
     * without it the data starts from its beginning in this run's order. */
    bool root = t->comm->rank == 0;
    if (v.state.no_rng || t->config.training.no_load_rng) {
        if (root)
            ht_log_warn("resume: %s; the data starts again from its beginning in the order of training.seed %lld, "
                        "at step %lld",
                        !v.state.no_rng
                            ? "training.no_load_rng: the checkpoint's seed and data positions are not loaded"
                            : "the checkpoint holds no seed or data positions (saved with "
                              "training.no_save_rng)",
                        (long long)t->config.training.seed, (long long)t->step);
        return HT_OK;
    }
    if (root && v.state.seed != t->config.training.seed)
        ht_log_warn("resume: training.seed was %lld in the checkpoint; this run uses %lld, so the data after the saved "
                    "position follows another order (and so do the other seeded streams)",
                    (long long)v.state.seed, (long long)t->config.training.seed);
    s = ht_loader_resume(&t->train_loader, v.state.train_pos, err);
    if (s == HT_OK && t->eval_B > 0) s = ht_loader_resume(&t->valid_loader, v.state.valid_pos, err);
    return s;
}
