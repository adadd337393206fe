/* The save of a training checkpoint (docs/DESIGN.md, Checkpoints): one
 * safetensors file per rank, metadata.json last, the directory rename,
 * `latest`, pruning, and the symlink-safe removal of this engine's own
 * checkpoint directories. */
#define _GNU_SOURCE /* renameat2 */
#include "ckpt/checkpoint_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

static void fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd); /* best effort: some file systems refuse to sync a directory */
        close(fd);
    }
}

/* What a checkpoint directory holds: the files a save writes, and the
 * temporaries (NAME.tmp.<pid>) of one that was cut short. */
static bool checkpoint_file(const char *name) {
    char base[64];
    const char *dot = strstr(name, ".tmp.");
    size_t n = dot ? (size_t)(dot - name) : strlen(name);
    if (n >= sizeof(base)) return false;
    memcpy(base, name, n);
    base[n] = '\0';
    if (strcmp(base, "metadata.json") == 0 || strcmp(base, "config.json") == 0) return true;
    int rank = -1, used = 0;
    return sscanf(base, "rank_%d.safetensors%n", &rank, &used) == 1 && rank >= 0 && base[used] == '\0' &&
           strspn(base + 5, "0123456789") >= 5;
}

/* Whether the entry `name` of the directory `parent` is one this engine may
 * delete: a real directory (not a symlink to one) holding checkpoint files
 * only. Otherwise *why says what it is instead. Opening it with O_NOFOLLOW
 * pins the directory itself: nothing is ever removed through a link. */
static int open_own_dir(int parent, const char *name, char *why, size_t n) {
    struct stat sb;
    if (fstatat(parent, name, &sb, AT_SYMLINK_NOFOLLOW) != 0) {
        snprintf(why, n, "cannot be read: %s", strerror(errno));
        return -1;
    }
    if (S_ISLNK(sb.st_mode)) {
        char target[512] = "";
        ssize_t len = readlinkat(parent, name, target, sizeof(target) - 1);
        if (len > 0) target[len] = '\0';
        snprintf(why, n, "is a symbolic link (to %s)", target);
        return -1;
    }
    if (!S_ISDIR(sb.st_mode)) {
        snprintf(why, n, "is not a directory");
        return -1;
    }
    int fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, n, "cannot be opened: %s", strerror(errno));
        return -1;
    }
    int probe = dup(fd);
    DIR *d = probe >= 0 ? fdopendir(probe) : NULL;
    if (!d) {
        if (probe >= 0) close(probe);
        close(fd);
        snprintf(why, n, "cannot be listed: %s", strerror(errno));
        return -1;
    }
    rewinddir(d); /* the duplicate shares the descriptor's offset */
    why[0] = '\0';
    struct dirent *e;
    while (!why[0] && (e = readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        struct stat fb;
        if (fstatat(fd, e->d_name, &fb, AT_SYMLINK_NOFOLLOW) != 0 || !S_ISREG(fb.st_mode) ||
            !checkpoint_file(e->d_name))
            snprintf(why, n, "holds %.200s, which no checkpoint writes", e->d_name);
    }
    closedir(d);
    if (why[0]) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Removes the checkpoint directory `name` of `parent` if this engine may
 * (open_own_dir): metadata.json first, so that a crash half-way leaves
 * something that is never loaded, then the rest, then the directory. Every
 * unlink is relative to the pinned directory. Returns false, with the
 * reason in why, when the entry is left alone. */
static bool remove_own_dir(int parent, const char *name, char *why, size_t n) {
    int fd = open_own_dir(parent, name, why, n);
    if (fd < 0) return false;
    unlinkat(fd, "metadata.json", 0);
    int listing = dup(fd);
    DIR *d = listing >= 0 ? fdopendir(listing) : NULL;
    if (!d && listing >= 0) close(listing);
    if (d) rewinddir(d); /* open_own_dir read the shared offset to the end */
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0 && checkpoint_file(e->d_name))
            unlinkat(fd, e->d_name, 0);
    if (d) closedir(d);
    close(fd);
    if (unlinkat(parent, name, AT_REMOVEDIR) != 0) {
        snprintf(why, n, "could not be removed: %s", strerror(errno));
        return false;
    }
    return true;
}

/* The directory that holds checkpoints, opened for the *at calls. */
static int open_parent(const char *output_dir) { return open(output_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC); }

bool ht_ckpt_is_own(const char *output_dir, const char *name, char *why, size_t n) {
    int parent = open_parent(output_dir);
    if (parent < 0) {
        snprintf(why, n, "cannot be checked: %s: %s", output_dir, strerror(errno));
        return false;
    }
    int fd = open_own_dir(parent, name, why, n);
    if (fd >= 0) close(fd);
    close(parent);
    return fd >= 0;
}

ht_status ht_ckpt_begin(const char *output_dir, int64_t step, char *tmp_dir, size_t n, ht_error *err) {
    ht_status s = ht_make_dirs(output_dir, err);
    if (s != HT_OK) return s;
    if (snprintf(tmp_dir, n, "%s/step_%08lld.tmp", output_dir, (long long)step) >= (int)n)
        return ht_fail(err, HT_ERR_INVALID, "%s: checkpoint path too long", output_dir);
    struct stat sb;
    if (lstat(tmp_dir, &sb) == 0) { /* a save that did not finish, or something that is not ours */
        char why[600];
        int parent = open_parent(output_dir);
        bool removed = parent >= 0 && remove_own_dir(parent, strrchr(tmp_dir, '/') + 1, why, sizeof(why));
        if (parent >= 0) close(parent);
        if (!removed)
            return ht_fail(err, HT_ERR_IO,
                           "%s %s: not a save of this engine's, so it is left alone; move it away to save step %lld "
                           "here",
                           tmp_dir, parent >= 0 ? why : "cannot be checked", (long long)step);
    }
    if (mkdir(tmp_dir, 0755) != 0) return ht_fail(err, HT_ERR_IO, "%s: cannot create: %s", tmp_dir, strerror(errno));
    return HT_OK;
}

void ht_ckpt_rank_file_free(ht_ckpt_rank_file *f) {
    free(f->chunks);
    memset(f, 0, sizeof(*f));
}

static bool excluded(const ht_ckpt_save_options *o, const char *key) {
    for (int i = 0; i < o->exclude_count; i++)
        if (ht_glob_match(o->exclude[i], key)) return true;
    return false;
}

/* The kind of an optimizer state key ("exp_avg", ...). */
key_kind ht_ckpt_state_kind(const char *key) {
    for (int k = KIND_EXP_AVG; k < KIND_COUNT; k++)
        if (strcmp(ht_ckpt_kind_names[k], key) == 0) return (key_kind)k;
    return KIND_COUNT;
}

/* The optimizer's state list (ht_optimizer_list_state), allocated; none without an optimizer. */
ht_status ht_ckpt_optimizer_state(const ht_optimizer *opt, ht_opt_state **out, int *n, ht_error *err) {
    *out = NULL;
    *n = opt ? ht_optimizer_list_state(opt, NULL) : 0;
    if (*n == 0) return HT_OK;
    *out = malloc((size_t)*n * sizeof(ht_opt_state));
    if (!*out) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory for the optimizer's state list");
    ht_optimizer_list_state(opt, *out);
    for (int i = 0; i < *n; i++)
        if (ht_ckpt_state_kind((*out)[i].key) == KIND_COUNT) {
            ht_status s =
                ht_fail(err, HT_ERR_INVALID, "checkpoint: the optimizer lists state '%s' of %s, which has no key",
                        (*out)[i].key, (*out)[i].param->name);
            free(*out);
            *out = NULL;
            return s;
        }
    return HT_OK;
}

/* Adds this rank's box of a param-shaped tensor (a scalar for the step) to
 * the writer and the rank's chunk list. */
static ht_status add_chunk(ht_st_writer *w, ht_ckpt_rank_file *rf, const ht_ckpt_save_options *o,
                           const ht_param_store *memory, key_kind kind, const ht_param *p, ht_dtype dtype,
                           const void *src, ht_error *err) {
    ht_ckpt_chunk c = {0};
    ht_ckpt_key_name(c.key, kind, p->name);
    if (excluded(o, c.key)) return HT_OK;
    c.dtype = dtype;
    if (kind != KIND_STEP && p->tp_dim < 0 && o->tp_rank > 0) return HT_OK; /* place 0 writes it */
    if (kind != KIND_STEP) {
        c.ndim = p->ndim;
        memcpy(c.shape, p->global_shape, sizeof(c.shape));
        c.box = ht_param_box(p);
        /* A param whose rows were set without its box would save the wrong region. */
        const int64_t first = c.box.offset[0] - (p->tp_dim == 0 ? p->tp_offset : 0);
        if (first != p->row0 || first + c.box.length[0] != p->row1)
            return ht_fail(err, HT_ERR_INVALID,
                           "checkpoint: %s holds rows [%lld, %lld) but its box rows [%lld, %lld) (set them with "
                           "ht_param_set_rows or ht_param_set_box)",
                           p->name, (long long)p->row0, (long long)p->row1, (long long)c.box.offset[0],
                           (long long)(c.box.offset[0] + c.box.length[0]));
        if (ht_box_numel(c.ndim, &c.box) == 0) return HT_OK; /* this rank holds none of it */
    }
    if (rf->count == rf->capacity) {
        int cap = rf->capacity ? 2 * rf->capacity : 64;
        ht_ckpt_chunk *chunks = realloc(rf->chunks, (size_t)cap * sizeof(ht_ckpt_chunk));
        if (!chunks) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory for %d chunks", cap);
        rf->chunks = chunks;
        rf->capacity = cap;
    }
    rf->chunks[rf->count++] = c;
    if (kind == KIND_MAIN && p->main_low) return ht_st_writer_add_main(w, c.key, c.ndim, c.box.length, p, err);
    /* the step count is the host's; every tensor is in the store's memory */
    return ht_st_writer_add_from(w, c.key, dtype, c.ndim, c.box.length, src, dtype, kind == KIND_STEP ? NULL : memory,
                                 err);
}

ht_status ht_ckpt_write_rank(const char *tmp_dir, int rank, const ht_ckpt_view *v, const ht_ckpt_save_options *o,
                             ht_ckpt_rank_file *rf, ht_error *err) {
    memset(rf, 0, sizeof(*rf));
    snprintf(rf->file, sizeof(rf->file), "rank_%05d.safetensors", rank);
    ht_st_writer w = {0};
    ht_status s = HT_OK;
    const ht_param_store *ps = v->params;
    for (int i = 0; s == HT_OK && i < ps->count; i++) {
        const ht_param *p = &ps->items[i];
        if (p->stage_copy) continue; /* the first pipeline stage writes a tied embedding and its state */
        s = add_chunk(&w, rf, o, v->params, KIND_MODEL, p, p->dtype, p->data, err);
        /* Only bf16/fp16 params have an FP32 master distinct from the model. */
        if (s == HT_OK && o->save_optimizer && p->trainable && ht_param_has_main(p))
            s = add_chunk(&w, rf, o, v->params, KIND_MAIN, p, HT_DTYPE_F32, p->main_param, err);
    }
    /* The optimizer's own list of its state; a slot that never stepped has
     * none yet (PyTorch creates it at the first step); the step, one number
     * the ranks share, is written by one (o->steps_rank). */
    ht_opt_state *state = NULL;
    int n = 0;
    s = s == HT_OK ? ht_ckpt_optimizer_state(o->save_optimizer ? v->optimizer : NULL, &state, &n, err) : s;
    for (int i = 0; s == HT_OK && i < n; i++) {
        const ht_opt_state *e = &state[i];
        key_kind kind = ht_ckpt_state_kind(e->key);
        if (*e->step == 0 || !e->data || (kind == KIND_STEP && rank != o->steps_rank) || e->param->stage_copy) continue;
        s = add_chunk(&w, rf, o, v->params, kind, e->param, e->dtype, e->data, err);
    }
    free(state);
    char path[HT_CKPT_PATH_MAX];
    ht_ckpt_join(path, sizeof(path), tmp_dir, rf->file);
    if (s == HT_OK) s = ht_st_writer_add_metadata(&w, "format", "pt", err);
    if (s == HT_OK) s = ht_st_writer_write(&w, path, err); /* fsyncs the file */
    if (s == HT_OK) s = ht_ckpt_hash_file(path, &rf->size, &rf->hash, err);
    ht_st_writer_free(&w);
    if (s != HT_OK) ht_ckpt_rank_file_free(rf);
    return s;
}

/* ------------------------------------------------------------------ metadata.json */

/* One key of the merged table: its chunks from every rank. */
typedef struct merged_key {
    const ht_ckpt_chunk *first;
    int *ranks, *index, count; /* (rank, chunk index) of every chunk, in rank order */
} merged_key;

static void write_list(FILE *f, int ndim, const int64_t *v) {
    fputc('[', f);
    for (int d = 0; d < ndim; d++) fprintf(f, d ? ", %lld" : "%lld", (long long)v[d]);
    fputc(']', f);
}

static ht_status write_keys(FILE *f, int world, const ht_ckpt_rank_file *ranks, ht_error *err) {
    int total = 0;
    for (int r = 0; r < world; r++) total += ranks[r].count;
    merged_key *keys = calloc((size_t)total + 1, sizeof(merged_key));
    int *slots = malloc(2 * ((size_t)total + 1) * sizeof(int));
    if (!keys || !slots) {
        free(keys);
        free(slots);
        return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory for metadata");
    }
    int nkeys = 0;
    /* Every rank adds keys in the same order: search from the last hit. */
    for (int r = 0; r < world; r++) {
        int hint = 0;
        for (int c = 0; c < ranks[r].count; c++) {
            const ht_ckpt_chunk *ch = &ranks[r].chunks[c];
            int k = -1;
            for (int j = 0; j < nkeys && k < 0; j++) {
                int idx = (hint + j) % nkeys;
                if (strcmp(keys[idx].first->key, ch->key) == 0) k = idx;
            }
            if (k < 0) {
                k = nkeys++;
                keys[k].first = ch;
            } else if (keys[k].first->dtype != ch->dtype || keys[k].first->ndim != ch->ndim ||
                       memcmp(keys[k].first->shape, ch->shape, sizeof(ch->shape)) != 0) {
                free(keys);
                free(slots);
                return ht_fail(err, HT_ERR_INVALID, "checkpoint: key %s: rank %d saved a different shape or dtype",
                               ch->key, r);
            }
            hint = k + 1;
            keys[k].count++;
        }
    }
    /* Lay out each key's (rank, chunk) list. */
    int off = 0;
    for (int k = 0; k < nkeys; k++) {
        keys[k].ranks = slots + off;
        keys[k].index = slots + total + 1 + off;
        off += keys[k].count;
        keys[k].count = 0;
    }
    for (int r = 0; r < world; r++) {
        int hint = 0;
        for (int c = 0; c < ranks[r].count; c++) {
            int k = -1;
            for (int j = 0; j < nkeys && k < 0; j++) {
                int idx = (hint + j) % nkeys;
                if (strcmp(keys[idx].first->key, ranks[r].chunks[c].key) == 0) k = idx;
            }
            keys[k].ranks[keys[k].count] = r;
            keys[k].index[keys[k].count++] = c;
            hint = k + 1;
        }
    }
    fputs("  \"keys\": {", f);
    for (int k = 0; k < nkeys; k++) {
        const ht_ckpt_chunk *c0 = keys[k].first;
        fputs(k ? ",\n    " : "\n    ", f);
        ht_json_write_string(f, c0->key);
        fprintf(f, ": {\"dtype\": \"%s\", \"shape\": ", ht_dtype_name(c0->dtype));
        write_list(f, c0->ndim, c0->shape);
        fputs(", \"chunks\": [", f);
        for (int j = 0; j < keys[k].count; j++) {
            const ht_ckpt_rank_file *rf = &ranks[keys[k].ranks[j]];
            const ht_ckpt_chunk *c = &rf->chunks[keys[k].index[j]];
            fprintf(f, "%s{\"file\": \"%s\", \"offsets\": ", j ? ", " : "", rf->file);
            write_list(f, c->ndim, c->box.offset);
            fputs(", \"lengths\": ", f);
            write_list(f, c->ndim, c->box.length);
            fputc('}', f);
        }
        fputs("]}", f);
    }
    fputs("\n  }", f);
    free(keys);
    free(slots);
    return HT_OK;
}

static void write_state(FILE *f, const ht_ckpt_trainer_state *st) {
    fprintf(f, "  \"trainer_state\": {\"step\": %lld, \"schedule_step\": %lld, ", (long long)st->step,
            (long long)st->schedule_step);
    if (!st->no_rng)
        fprintf(f,
                "\"seed\": \"%lld\", \"train_loader\": {\"epoch\": %" PRIu64 ", \"index\": %" PRIu64 "}, "
                "\"valid_loader\": {\"epoch\": %" PRIu64 ", \"index\": %" PRIu64 "}, ",
                (long long)st->seed, st->train_pos.epoch, st->train_pos.index, st->valid_pos.epoch,
                st->valid_pos.index);
    fputs("\"loss_scaler\": ", f);
    if (st->loss_scaling) {
        fputs("{\"scale\": ", f);
        ht_json_write_number(f, st->scaler.scale);
        fprintf(f, ", \"growth_tracker\": %d, \"hysteresis_tracker\": %d}", st->scaler.growth_tracker,
                st->scaler.hysteresis_tracker);
    } else {
        fputs("null", f);
    }
    if (st->gemm_bf16 != HT_GEMM_KERNEL_AUTO && st->gemm_f16 != HT_GEMM_KERNEL_AUTO)
        fprintf(f, ", \"gemm\": {\"bf16\": \"%s\", \"f16\": \"%s\"}", ht_gemm_kernel_label(st->gemm_bf16),
                ht_gemm_kernel_label(st->gemm_f16));
    fputs("}", f);
}

static void write_config(FILE *f, const ht_config *cfg) {
    fputs("  \"config\": {", f);
    if (cfg) {
        char value[4096];
        for (int i = 0; i < ht_config_key_count(); i++) {
            const char *key = ht_config_key_name(i);
            if (!ht_config_format_value(cfg, key, value, sizeof(value))) continue;
            fputs(i ? ",\n    " : "\n    ", f);
            ht_json_write_string(f, key);
            fputs(": ", f);
            ht_json_write_string(f, value);
        }
        fputs("\n  ", f);
    }
    fputs("}", f);
}

/* The whole metadata.json text: everything, then its own hash as the last member. */
static ht_status build_metadata(int world, const ht_ckpt_rank_file *ranks, const ht_ckpt_rank_file *extra, int n_extra,
                                const ht_ckpt_view *v, char **out, size_t *out_len, ht_error *err) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return ht_fail(err, HT_ERR_OOM, "checkpoint: cannot build metadata.json");
    fprintf(f, "{\n  \"format\": \"hypertrain checkpoint\",\n  \"format_version\": %d,\n", HT_CKPT_FORMAT_VERSION);
    fprintf(f, "  \"step\": %lld,\n  \"world_size\": %d,\n  \"hash\": \"%s\",\n", (long long)v->state.step, world,
            HT_CKPT_HASH);
    fputs("  \"files\": [", f);
    for (int i = 0; i < world + n_extra; i++) {
        const ht_ckpt_rank_file *rf = i < world ? &ranks[i] : &extra[i - world];
        fprintf(f, "%s\n    {\"name\": \"%s\", \"size\": %" PRIu64 ", \"xxh64\": \"%016" PRIx64 "\"}", i ? "," : "",
                rf->file, rf->size, rf->hash);
    }
    fputs("\n  ],\n", f);
    write_state(f, &v->state);
    fputs(",\n", f);
    ht_status s = write_keys(f, world, ranks, err);
    fputs(",\n", f);
    write_config(f, v->config);
    if (fclose(f) != 0 || !buf) {
        free(buf);
        return ht_fail(err, HT_ERR_OOM, "checkpoint: cannot build metadata.json");
    }
    if (s != HT_OK) {
        free(buf);
        return s;
    }
    char tail[64];
    int k = snprintf(tail, sizeof(tail), ",\n  \"self_xxh64\": \"%016" PRIx64 "\"\n}\n", ht_xxh64(buf, len, 0));
    char *whole = realloc(buf, len + (size_t)k + 1);
    if (!whole) {
        free(buf);
        return ht_fail(err, HT_ERR_OOM, "checkpoint: cannot build metadata.json");
    }
    memcpy(whole + len, tail, (size_t)k + 1);
    *out = whole;
    *out_len = len + (size_t)k;
    return HT_OK;
}

/* Writes and fsyncs path (a fresh file: the caller makes it visible by a rename). */
static ht_status write_synced(const char *path, const char *text, size_t len, ht_error *err) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return ht_fail(err, HT_ERR_IO, "%s: cannot create: %s", path, strerror(errno));
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, text + done, len - done);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = errno;
            close(fd);
            return ht_fail(err, HT_ERR_IO, "%s: write failed: %s", path, strerror(e));
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0) {
        int e = errno;
        close(fd);
        return ht_fail(err, HT_ERR_IO, "%s: fsync failed: %s", path, strerror(e));
    }
    close(fd);
    return HT_OK;
}

/* Points output_dir/latest at name: a temp file, fsync, rename, fsync the directory. */
static ht_status update_latest(const char *output_dir, const char *name, ht_error *err) {
    char tmp[HT_CKPT_PATH_MAX], path[HT_CKPT_PATH_MAX], text[128];
    snprintf(tmp, sizeof(tmp), "%s/latest.tmp.%ld", output_dir, (long)getpid());
    ht_ckpt_join(path, sizeof(path), output_dir, "latest");
    int n = snprintf(text, sizeof(text), "%s\n", name);
    ht_status s = write_synced(tmp, text, (size_t)n, err);
    if (s != HT_OK) return s;
    if (rename(tmp, path) != 0) {
        s = ht_fail(err, HT_ERR_IO, "%s: cannot rename %s into place: %s", path, tmp, strerror(errno));
        unlink(tmp);
        return s;
    }
    fsync_dir(output_dir);
    return HT_OK;
}

static int cmp_desc(const void *a, const void *b) {
    long long x = *(const long long *)a, y = *(const long long *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

/* Deletes complete checkpoints beyond the newest keep_last (never `current`),
 * the .tmp directories of saves that did not finish and the latest.tmp.<pid>
 * files of processes that are gone. Only what this engine writes is deleted
 * (open_own_dir): an entry named like a checkpoint that is a symlink, not a
 * directory, or holds other files is left alone and does not count towards
 * keep_last. */
static void prune(const char *output_dir, int keep_last, long long current) {
    int parent = open_parent(output_dir);
    int listing = parent >= 0 ? dup(parent) : -1;
    DIR *d = listing >= 0 ? fdopendir(listing) : NULL;
    if (!d) {
        if (listing >= 0) close(listing);
        if (parent >= 0) close(parent);
        return;
    }
    long long *steps = NULL;
    int n = 0, cap = 0;
    char why[600];
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        /* A latest.tmp.<pid> of a process that is gone (killed between its write and its rename). */
        long pid = 0;
        int used = 0;
        struct stat sb;
        if (sscanf(e->d_name, "latest.tmp.%ld%n", &pid, &used) == 1 && e->d_name[used] == '\0' && pid > 0 &&
            pid != (long)getpid() && kill((pid_t)pid, 0) != 0 && errno == ESRCH &&
            fstatat(parent, e->d_name, &sb, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(sb.st_mode)) {
            unlinkat(parent, e->d_name, 0);
            continue;
        }
        if (strncmp(e->d_name, "step_", 5) != 0) continue;
        bool tmp = ht_ckpt_ends_with(e->d_name, ".tmp");
        long long step = ht_ckpt_step_of(e->d_name);
        if (!tmp && step < 0) continue;
        /* What is not ours was named once, when the run began (ht_rundir_check). */
        if (tmp) {
            remove_own_dir(parent, e->d_name, why, sizeof(why));
            continue;
        }
        int fd = open_own_dir(parent, e->d_name, why, sizeof(why));
        if (fd < 0) continue;
        close(fd);
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            long long *grown = realloc(steps, (size_t)cap * sizeof(long long));
            if (!grown) break;
            steps = grown;
        }
        steps[n++] = step;
    }
    closedir(d);
    if (keep_last > 0 && n > keep_last) {
        qsort(steps, (size_t)n, sizeof(long long), cmp_desc);
        for (int i = keep_last; i < n; i++) {
            if (steps[i] == current) continue;
            char name[32];
            snprintf(name, sizeof(name), "step_%08lld", steps[i]);
            if (remove_own_dir(parent, name, why, sizeof(why)))
                ht_log_info("checkpoint: removed %s/%s (checkpoint.keep_last %d)", output_dir, name, keep_last);
            else
                ht_log_warn("checkpoint: %s/%s %s: left alone", output_dir, name, why);
        }
        fsync(parent);
    }
    close(parent);
    free(steps);
}

ht_status ht_ckpt_commit(const char *output_dir, int world, const ht_ckpt_rank_file *ranks, const ht_ckpt_view *v,
                         const ht_ckpt_save_options *o, ht_error *err) {
    long long step = (long long)v->state.step;
    char tmp_dir[HT_CKPT_PATH_MAX], final_dir[HT_CKPT_PATH_MAX], path[HT_CKPT_PATH_MAX], name[32];
    snprintf(name, sizeof(name), "step_%08lld", step);
    snprintf(tmp_dir, sizeof(tmp_dir), "%s/%s.tmp", output_dir, name);
    ht_ckpt_join(final_dir, sizeof(final_dir), output_dir, name);
    ht_ckpt_rank_file extra = {0};
    int n_extra = 0;
    ht_status s = HT_OK;
    if (v->model) {
        ht_dtype dtype = v->params->count ? v->params->items[0].dtype : HT_DTYPE_F32;
        s = ht_hf_write_config(tmp_dir, v->model, dtype, err);
        snprintf(extra.file, sizeof(extra.file), "config.json");
        ht_ckpt_join(path, sizeof(path), tmp_dir, extra.file);
        if (s == HT_OK) s = ht_ckpt_hash_file(path, &extra.size, &extra.hash, err);
        n_extra = 1;
    }
    char *text = NULL;
    size_t len = 0;
    if (s == HT_OK) s = build_metadata(world, ranks, &extra, n_extra, v, &text, &len, err);
    ht_ckpt_join(path, sizeof(path), tmp_dir, "metadata.json");
    if (s == HT_OK) s = write_synced(path, text, len, err);
    free(text);
    if (s != HT_OK) return s;
    fsync_dir(tmp_dir);
    struct stat sb;
    if (lstat(final_dir, &sb) == 0) {
        /* The same step saved again (a resumed run that ends where it began):
         * swap atomically so that `latest` never names a missing directory,
         * and only over a checkpoint of this engine's. */
        char why[600];
        int parent = open_parent(output_dir), fd = parent >= 0 ? open_own_dir(parent, name, why, sizeof(why)) : -1;
        if (fd >= 0) close(fd);
        if (fd < 0) {
            if (parent >= 0) close(parent);
            return ht_fail(err, HT_ERR_IO,
                           "%s %s: not a checkpoint of this engine's, so it is not replaced; move it away to save "
                           "step %lld here",
                           final_dir, parent >= 0 ? why : "cannot be checked", step);
        }
        if (renameat2(parent, strrchr(tmp_dir, '/') + 1, parent, name, RENAME_EXCHANGE) != 0) {
            close(parent);
            return ht_fail(err, HT_ERR_IO, "%s: cannot replace it with %s: %s", final_dir, tmp_dir, strerror(errno));
        }
        if (!remove_own_dir(parent, strrchr(tmp_dir, '/') + 1, why, sizeof(why)))
            ht_log_warn("checkpoint: the replaced %s %s: left alone", tmp_dir, why);
        close(parent);
    } else if (rename(tmp_dir, final_dir) != 0) {
        return ht_fail(err, HT_ERR_IO, "%s: cannot rename %s into place: %s", final_dir, tmp_dir, strerror(errno));
    }
    fsync_dir(output_dir);
    s = update_latest(output_dir, name, err);
    if (s != HT_OK) return s;
    prune(output_dir, o->keep_last, step);
    return HT_OK;
}

ht_status ht_ckpt_save(const char *output_dir, const ht_ckpt_view *v, const ht_ckpt_save_options *o, char *saved,
                       size_t n, ht_error *err) {
    char tmp_dir[HT_CKPT_PATH_MAX];
    ht_status s = ht_ckpt_begin(output_dir, v->state.step, tmp_dir, sizeof(tmp_dir), err);
    if (s != HT_OK) return s;
    ht_ckpt_rank_file rf;
    s = ht_ckpt_write_rank(tmp_dir, 0, v, o, &rf, err);
    if (s != HT_OK) return s;
    s = ht_ckpt_commit(output_dir, 1, &rf, v, o, err);
    ht_ckpt_rank_file_free(&rf);
    if (s == HT_OK && saved) snprintf(saved, n, "%s/step_%08lld", output_dir, (long long)v->state.step);
    return s;
}
