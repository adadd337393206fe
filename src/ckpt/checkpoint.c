/* Training checkpoints (docs/DESIGN.md, Checkpoints): the save (one safetensors
 * file per rank, metadata.json last, directory rename, `latest`, pruning),
 * the verified open, the row-overlap planner that loads N ranks' chunks on M
 * ranks, the FP32 main-param branches, export to Hugging Face and inspect. */
#define _GNU_SOURCE /* renameat2 */
#include "hypertrain/ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAIN_PREFIX "_mixed_precision_optimizer.fp32_from_fp16_params."
#define OPT_PREFIX "optimizer.state."

typedef enum key_kind {
    KIND_MODEL = 0,
    KIND_MAIN,
    KIND_EXP_AVG,
    KIND_EXP_AVG_SQ,
    KIND_MOMENTUM,
    KIND_STEP,
    KIND_COUNT
} key_kind;

static const char *const KIND_NAMES[KIND_COUNT] = {"model",      "fp32_main_param", "exp_avg",
                                                   "exp_avg_sq", "momentum_buffer", "step"};

static void key_name(char *buf, key_kind kind, const char *fqn) {
    switch (kind) {
    case KIND_MODEL: snprintf(buf, HT_CKPT_KEY_MAX, "model.%s", fqn); break;
    case KIND_MAIN: snprintf(buf, HT_CKPT_KEY_MAX, MAIN_PREFIX "%s", fqn); break;
    default: snprintf(buf, HT_CKPT_KEY_MAX, OPT_PREFIX "%s.%s", fqn, KIND_NAMES[kind]); break;
    }
}

/* dir/name; a path that does not fit becomes "" (every later open then fails naming nothing worse). */
static void join(char *buf, size_t n, const char *dir, const char *name) {
    if (snprintf(buf, n, "%s/%s", dir, name) >= (int)n) buf[0] = '\0';
}

static void fsync_dir(const char *dir) {
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd); /* best effort: some file systems refuse to sync a directory */
        close(fd);
    }
}

/* Size and XXH64 of a whole file (through a read-only mapping). */
static ht_status hash_file(const char *path, uint64_t *size, uint64_t *hash, ht_error *err) {
    int fd;
    size_t bytes;
    ht_status s = ht_open_file(path, &fd, &bytes, err); /* a FIFO listed in metadata.json must not block */
    if (s != HT_OK) return s;
    *size = (uint64_t)bytes;
    if (bytes == 0) {
        close(fd);
        *hash = ht_xxh64(NULL, 0, 0);
        return HT_OK;
    }
    void *map = mmap(NULL, bytes, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    if (map == MAP_FAILED) return ht_fail(err, HT_ERR_IO, "%s: cannot map: %s", path, strerror(errno));
    madvise(map, bytes, MADV_SEQUENTIAL);
    *hash = ht_xxh64(map, bytes, 0);
    munmap(map, bytes);
    return HT_OK;
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

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* ================================================================== save */

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
static key_kind state_kind(const char *key) {
    for (int k = KIND_EXP_AVG; k < KIND_COUNT; k++)
        if (strcmp(KIND_NAMES[k], key) == 0) return (key_kind)k;
    return KIND_COUNT;
}

/* The optimizer's state list (ht_optimizer_list_state), allocated; none without an optimizer. */
static ht_status optimizer_state(const ht_optimizer *opt, ht_opt_state **out, int *n, ht_error *err) {
    *out = NULL;
    *n = opt ? ht_optimizer_list_state(opt, NULL) : 0;
    if (*n == 0) return HT_OK;
    *out = malloc((size_t)*n * sizeof(ht_opt_state));
    if (!*out) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory for the optimizer's state list");
    ht_optimizer_list_state(opt, *out);
    for (int i = 0; i < *n; i++)
        if (state_kind((*out)[i].key) == KIND_COUNT) {
            ht_status s =
                ht_fail(err, HT_ERR_INVALID, "checkpoint: the optimizer lists state '%s' of %s, which has no key",
                        (*out)[i].key, (*out)[i].param->name);
            free(*out);
            *out = NULL;
            return s;
        }
    return HT_OK;
}

/* Adds rows [p->row0, p->row1) of a param-shaped tensor (or a scalar when
 * scalar != NULL) to the writer and the rank's chunk list. */
static ht_status add_chunk(ht_st_writer *w, ht_ckpt_rank_file *rf, const ht_ckpt_save_options *o, key_kind kind,
                           const ht_param *p, ht_dtype dtype, const void *src, ht_error *err) {
    ht_ckpt_chunk c = {0};
    key_name(c.key, kind, p->name);
    if (excluded(o, c.key)) return HT_OK;
    c.dtype = dtype;
    int64_t local[HT_PARAM_MAX_DIMS];
    if (kind == KIND_STEP) {
        c.ndim = 0;
        c.row0 = 0;
        c.rows = 1;
    } else {
        c.ndim = p->ndim;
        memcpy(c.shape, p->shape, sizeof(c.shape));
        c.row0 = p->row0;
        c.rows = p->row1 - p->row0;
        if (c.rows == 0) return HT_OK; /* this rank holds none of it */
        memcpy(local, p->shape, sizeof(local));
        local[0] = c.rows;
    }
    if (rf->count == rf->capacity) {
        int cap = rf->capacity ? 2 * rf->capacity : 64;
        ht_ckpt_chunk *chunks = realloc(rf->chunks, (size_t)cap * sizeof(ht_ckpt_chunk));
        if (!chunks) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory for %d chunks", cap);
        rf->chunks = chunks;
        rf->capacity = cap;
    }
    rf->chunks[rf->count++] = c;
    return ht_st_writer_add(w, c.key, dtype, c.ndim, local, src, dtype, err);
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
        s = add_chunk(&w, rf, o, KIND_MODEL, p, p->dtype, p->data, err);
        /* Only bf16/fp16 params have an FP32 master distinct from the model. */
        if (s == HT_OK && o->save_optimizer && p->trainable && p->main_param && (void *)p->main_param != p->data)
            s = add_chunk(&w, rf, o, KIND_MAIN, p, HT_DTYPE_F32, p->main_param, err);
    }
    /* The optimizer's own list of its state; a slot that never stepped has
     * none yet (PyTorch creates it at the first step); the step, one number
     * the ranks share, is written by rank 0. */
    ht_opt_state *state = NULL;
    int n = 0;
    s = s == HT_OK ? optimizer_state(o->save_optimizer ? v->optimizer : NULL, &state, &n, err) : s;
    for (int i = 0; s == HT_OK && i < n; i++) {
        const ht_opt_state *e = &state[i];
        key_kind kind = state_kind(e->key);
        if (*e->step == 0 || !e->data || (kind == KIND_STEP && rank != 0)) continue;
        s = add_chunk(&w, rf, o, kind, e->param, e->dtype, e->data, err);
    }
    free(state);
    char path[HT_CKPT_PATH_MAX];
    join(path, sizeof(path), tmp_dir, rf->file);
    if (s == HT_OK) s = ht_st_writer_add_metadata(&w, "format", "pt", err);
    if (s == HT_OK) s = ht_st_writer_write(&w, path, err); /* fsyncs the file */
    if (s == HT_OK) s = hash_file(path, &rf->size, &rf->hash, err);
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

static void write_shape(FILE *f, int ndim, const int64_t *shape) {
    fputc('[', f);
    for (int d = 0; d < ndim; d++) fprintf(f, d ? ", %lld" : "%lld", (long long)shape[d]);
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
        write_shape(f, c0->ndim, c0->shape);
        fputs(", \"chunks\": [", f);
        for (int j = 0; j < keys[k].count; j++) {
            const ht_ckpt_rank_file *rf = &ranks[keys[k].ranks[j]];
            const ht_ckpt_chunk *c = &rf->chunks[keys[k].index[j]];
            fprintf(f, "%s{\"file\": \"%s\", \"row_offset\": %lld, \"rows\": %lld}", j ? ", " : "", rf->file,
                    (long long)c->row0, (long long)c->rows);
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
    join(path, sizeof(path), output_dir, "latest");
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

/* A complete checkpoint's step from its directory name "step_XXXXXXXX", or -1. */
static long long step_of(const char *name) {
    long long step;
    int used = 0;
    if (sscanf(name, "step_%lld%n", &step, &used) != 1 || name[used] != '\0' || strlen(name) != 13) return -1;
    return step;
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
        bool tmp = ends_with(e->d_name, ".tmp");
        long long step = step_of(e->d_name);
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
    join(final_dir, sizeof(final_dir), output_dir, name);
    ht_ckpt_rank_file extra = {0};
    int n_extra = 0;
    ht_status s = HT_OK;
    if (v->model) {
        ht_dtype dtype = v->params->count ? v->params->items[0].dtype : HT_DTYPE_F32;
        s = ht_hf_write_config(tmp_dir, v->model, dtype, err);
        snprintf(extra.file, sizeof(extra.file), "config.json");
        join(path, sizeof(path), tmp_dir, extra.file);
        if (s == HT_OK) s = hash_file(path, &extra.size, &extra.hash, err);
        n_extra = 1;
    }
    char *text = NULL;
    size_t len = 0;
    if (s == HT_OK) s = build_metadata(world, ranks, &extra, n_extra, v, &text, &len, err);
    join(path, sizeof(path), tmp_dir, "metadata.json");
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

/* ================================================================== open */

typedef struct ck_file {
    char *name;
    uint64_t size, hash;
    bool is_rank;
    ht_safetensors *st; /* rank files, once opened */
} ck_file;

typedef struct ck_chunk {
    int file;
    int64_t row0, rows;
    const ht_st_tensor *t;
} ck_chunk;

typedef struct ck_key {
    const char *name; /* in the metadata tree */
    key_kind kind;
    ht_dtype dtype;
    int ndim;
    int64_t shape[HT_PARAM_MAX_DIMS];
    ck_chunk *chunks;
    int nchunks;
} ck_key;

struct ht_checkpoint {
    char dir[HT_CKPT_PATH_MAX];
    ht_json *meta;
    int version;
    int64_t step;
    int world;
    ht_ckpt_trainer_state state;
    ck_file *files;
    int nfiles;
    ck_key *keys; /* sorted by name */
    int nkeys;
};

static key_kind kind_of(const char *key) {
    if (strncmp(key, MAIN_PREFIX, strlen(MAIN_PREFIX)) == 0) return KIND_MAIN;
    if (strncmp(key, OPT_PREFIX, strlen(OPT_PREFIX)) == 0) {
        for (int k = KIND_EXP_AVG; k < KIND_COUNT; k++) {
            char suffix[32];
            snprintf(suffix, sizeof(suffix), ".%s", KIND_NAMES[k]);
            if (ends_with(key, suffix)) return (key_kind)k;
        }
    }
    return KIND_MODEL;
}

static int cmp_key(const void *a, const void *b) {
    return strcmp(((const ck_key *)a)->name, ((const ck_key *)b)->name);
}

static const ck_key *find_key(const ht_checkpoint *ck, const char *name) {
    ck_key probe = {.name = name};
    return bsearch(&probe, ck->keys, (size_t)ck->nkeys, sizeof(ck_key), cmp_key);
}

static bool json_int(const ht_json *v, int64_t *out) {
    /* In range before the cast (a double beyond int64 converts to undefined behaviour), then whole. */
    if (!v || v->type != HT_JSON_NUMBER || !(v->number >= -0x1p63 && v->number < 0x1p63) ||
        v->number != (double)(int64_t)v->number)
        return false;
    *out = (int64_t)v->number;
    return true;
}

static ht_status bad_meta(const ht_checkpoint *ck, const char *what, ht_error *err) {
    return ht_fail(err, HT_ERR_FORMAT, "%s/metadata.json: %s", ck->dir, what);
}

static ht_status parse_state(ht_checkpoint *ck, const ht_json *js, ht_error *err) {
    ht_ckpt_trainer_state *st = &ck->state;
    const ht_json *seed = ht_json_get(js, "seed"), *tl = ht_json_get(js, "train_loader"),
                  *vl = ht_json_get(js, "valid_loader"), *ls = ht_json_get(js, "loss_scaler");
    int64_t e0 = 0, i0 = 0, e1 = 0, i1 = 0;
    /* The seed and the data positions come together, or not at all (saved with training.no_save_rng). */
    st->no_rng = !seed && !tl && !vl;
    if (js->type != HT_JSON_OBJECT || !json_int(ht_json_get(js, "step"), &st->step) ||
        !json_int(ht_json_get(js, "schedule_step"), &st->schedule_step) || !ls ||
        (!st->no_rng && (!seed || seed->type != HT_JSON_STRING || !tl || !vl ||
                         !json_int(ht_json_get(tl, "epoch"), &e0) || !json_int(ht_json_get(tl, "index"), &i0) ||
                         !json_int(ht_json_get(vl, "epoch"), &e1) || !json_int(ht_json_get(vl, "index"), &i1))))
        return bad_meta(ck, "\"trainer_state\" is malformed", err);
    if (st->step < 0 || st->schedule_step < 0 || st->schedule_step > st->step)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s/metadata.json: trainer_state step %lld, schedule_step %lld: expected 0 <= schedule_step <= "
                       "step",
                       ck->dir, (long long)st->step, (long long)st->schedule_step);
    if (e0 < 0 || i0 < 0 || e1 < 0 || i1 < 0)
        return bad_meta(ck, "\"trainer_state\": a data loader position is negative", err);
    st->seed = seed ? strtoll(seed->string, NULL, 10) : 0;
    st->train_pos = (ht_loader_pos){(uint64_t)e0, (uint64_t)i0};
    st->valid_pos = (ht_loader_pos){(uint64_t)e1, (uint64_t)i1};
    st->loss_scaling = ls->type == HT_JSON_OBJECT;
    if (st->loss_scaling) {
        const ht_json *scale = ht_json_get(ls, "scale");
        int64_t g, h;
        if (!scale || scale->type != HT_JSON_NUMBER || !json_int(ht_json_get(ls, "growth_tracker"), &g) ||
            !json_int(ht_json_get(ls, "hysteresis_tracker"), &h))
            return bad_meta(ck, "\"trainer_state.loss_scaler\" is malformed", err);
        st->scaler.scale = scale->number;
        st->scaler.growth_tracker = (int)g;
        st->scaler.hysteresis_tracker = (int)h;
    }
    /* Absent in checkpoints older than the measured kernel choice. */
    const ht_json *gemm = ht_json_get(js, "gemm");
    st->gemm_bf16 = st->gemm_f16 = HT_GEMM_KERNEL_AUTO;
    if (gemm) {
        const ht_json *bf16 = ht_json_get(gemm, "bf16"), *f16 = ht_json_get(gemm, "f16");
        if (!bf16 || !f16 || bf16->type != HT_JSON_STRING || f16->type != HT_JSON_STRING ||
            !ht_gemm_kernel_from_label(bf16->string, &st->gemm_bf16) ||
            !ht_gemm_kernel_from_label(f16->string, &st->gemm_f16))
            return bad_meta(ck, "\"trainer_state.gemm\" is malformed", err);
    }
    return HT_OK;
}

static int find_file(const ht_checkpoint *ck, const char *name) {
    for (int i = 0; i < ck->nfiles; i++)
        if (strcmp(ck->files[i].name, name) == 0) return i;
    return -1;
}

static ht_status parse_key(ht_checkpoint *ck, const ht_json *e, ck_key *k, ht_error *err) {
    char msg[HT_ERROR_MSG_MAX / 2];
    k->name = e->key;
    k->kind = kind_of(e->key);
    const ht_json *dtype = ht_json_get(e, "dtype"), *shape = ht_json_get(e, "shape"),
                  *chunks = ht_json_get(e, "chunks");
    if (e->type != HT_JSON_OBJECT || !dtype || dtype->type != HT_JSON_STRING ||
        !ht_dtype_from_name(dtype->string, &k->dtype) || !shape || shape->type != HT_JSON_ARRAY ||
        shape->count > HT_PARAM_MAX_DIMS || !chunks || chunks->type != HT_JSON_ARRAY || chunks->count == 0) {
        snprintf(msg, sizeof(msg), "key %.200s: dtype, shape or chunks missing or malformed", e->key);
        return bad_meta(ck, msg, err);
    }
    k->ndim = (int)shape->count;
    for (int d = 0; d < k->ndim; d++)
        if (!json_int(&shape->items[d], &k->shape[d]) || k->shape[d] < 0) {
            snprintf(msg, sizeof(msg), "key %.200s: shape is not a list of sizes", e->key);
            return bad_meta(ck, msg, err);
        }
    int64_t total_rows = k->ndim ? k->shape[0] : 1;
    k->chunks = calloc(chunks->count, sizeof(ck_chunk));
    if (!k->chunks) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    k->nchunks = (int)chunks->count;
    int64_t next = 0;
    for (int j = 0; j < k->nchunks; j++) {
        const ht_json *c = &chunks->items[j], *file = ht_json_get(c, "file");
        ck_chunk *ch = &k->chunks[j];
        ch->file = file && file->type == HT_JSON_STRING ? find_file(ck, file->string) : -1;
        if (ch->file < 0 || !ck->files[ch->file].is_rank || !json_int(ht_json_get(c, "row_offset"), &ch->row0) ||
            !json_int(ht_json_get(c, "rows"), &ch->rows)) {
            snprintf(msg, sizeof(msg), "key %.200s: chunk %d names no listed rank file or has no row_offset/rows",
                     e->key, j);
            return bad_meta(ck, msg, err);
        }
        /* Chunks tile the rows in order: the planner can then trust any overlap it computes. */
        if (ch->row0 != next || ch->rows <= 0 || ch->row0 + ch->rows > total_rows) {
            snprintf(msg, sizeof(msg), "key %.200s: chunk %d (rows %lld + %lld) does not continue at row %lld of %lld",
                     e->key, j, (long long)ch->row0, (long long)ch->rows, (long long)next, (long long)total_rows);
            return bad_meta(ck, msg, err);
        }
        next = ch->row0 + ch->rows;
    }
    if (next != total_rows) {
        snprintf(msg, sizeof(msg), "key %.200s: chunks cover %lld of %lld rows", e->key, (long long)next,
                 (long long)total_rows);
        return bad_meta(ck, msg, err);
    }
    return HT_OK;
}

/* Reads and checks metadata.json into ck (files listed, keys parsed; nothing opened). */
static ht_status load_metadata(const char *dir, ht_checkpoint *ck, ht_error *err) {
    snprintf(ck->dir, sizeof(ck->dir), "%s", dir);
    size_t n = strlen(ck->dir);
    while (n > 1 && ck->dir[n - 1] == '/') ck->dir[--n] = '\0';
    if (ends_with(ck->dir, ".tmp"))
        return ht_fail(err, HT_ERR_INVALID, "%s: a .tmp directory is a save that did not finish: never loaded", dir);
    char path[HT_CKPT_PATH_MAX];
    join(path, sizeof(path), ck->dir, "metadata.json");
    struct stat sb;
    if (stat(ck->dir, &sb) != 0 || !S_ISDIR(sb.st_mode))
        return ht_fail(err, HT_ERR_IO, "%s: no such checkpoint directory", ck->dir);
    if (stat(path, &sb) != 0)
        return ht_fail(err, HT_ERR_FORMAT, "%s: no metadata.json: an incomplete checkpoint, never loaded", ck->dir);
    char *text;
    size_t len;
    ht_status s = ht_read_file_max(
        path, HT_JSON_FILE_MAX, "a checkpoint's metadata.json may have (HT_JSON_FILE_MAX in include/hypertrain/base.h)",
        &text, &len, err);
    if (s != HT_OK) return s;
    /* The last member is the hash of every byte before it. */
    const char *marker = ",\n  \"self_xxh64\": \"";
    char *at = NULL;
    for (char *p = strstr(text, marker); p; p = strstr(p + 1, marker)) at = p;
    uint64_t want = 0;
    if (!at || sscanf(at + strlen(marker), "%16" SCNx64, &want) != 1 ||
        ht_xxh64(text, (size_t)(at - text), 0) != want) {
        free(text);
        return bad_meta(ck, "its self_xxh64 does not match its content: the file was edited or damaged", err);
    }
    s = ht_json_parse(text, len, path, &ck->meta, err);
    free(text);
    if (s != HT_OK) return s;
    const ht_json *m = ck->meta, *fmt = ht_json_get(m, "format"), *hash = ht_json_get(m, "hash"),
                  *files = ht_json_get(m, "files"), *keys = ht_json_get(m, "keys"),
                  *st = ht_json_get(m, "trainer_state");
    int64_t version, world;
    if (!fmt || fmt->type != HT_JSON_STRING || strcmp(fmt->string, "hypertrain checkpoint") != 0 ||
        !json_int(ht_json_get(m, "format_version"), &version))
        return bad_meta(ck, "not a hypertrain checkpoint (\"format\" or \"format_version\" missing)", err);
    ck->version = (int)version;
    if (version > HT_CKPT_FORMAT_VERSION || version < 1) {
        char msg[160];
        snprintf(msg, sizeof(msg), "format_version %lld is from the future: this build reads versions 1 to %d",
                 (long long)version, HT_CKPT_FORMAT_VERSION);
        return bad_meta(ck, msg, err);
    }
    if (!json_int(ht_json_get(m, "step"), &ck->step)) return bad_meta(ck, "\"step\" missing", err);
    if (!json_int(ht_json_get(m, "world_size"), &world)) return bad_meta(ck, "\"world_size\" missing", err);
    if (world < 1 || world > INT_MAX) {
        char msg[160];
        snprintf(msg, sizeof(msg), "\"world_size\" must be >= 1 (the ranks that saved it), found %lld",
                 (long long)world);
        return bad_meta(ck, msg, err);
    }
    ck->world = (int)world;
    if (!hash || hash->type != HT_JSON_STRING || strcmp(hash->string, HT_CKPT_HASH) != 0)
        return bad_meta(ck, "\"hash\" is not \"" HT_CKPT_HASH "\"", err);
    if (!files || files->type != HT_JSON_ARRAY || !keys || keys->type != HT_JSON_OBJECT || !st)
        return bad_meta(ck, "\"files\", \"keys\" or \"trainer_state\" missing", err);
    s = parse_state(ck, st, err);
    if (s != HT_OK) return s;
    ck->files = calloc(files->count + 1, sizeof(ck_file));
    ck->keys = calloc(keys->count + 1, sizeof(ck_key));
    if (!ck->files || !ck->keys) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    for (size_t i = 0; i < files->count; i++) {
        const ht_json *f = &files->items[i], *name = ht_json_get(f, "name"), *h = ht_json_get(f, "xxh64");
        int64_t size;
        ck_file *cf = &ck->files[ck->nfiles];
        if (!name || name->type != HT_JSON_STRING || !h || h->type != HT_JSON_STRING ||
            sscanf(h->string, "%16" SCNx64, &cf->hash) != 1 || !json_int(ht_json_get(f, "size"), &size))
            return bad_meta(ck, "an entry of \"files\" lacks name, size or xxh64", err);
        /* Every file lies in the checkpoint's own directory. */
        if (!name->string[0] || strchr(name->string, '/') || strcmp(name->string, ".") == 0 ||
            strcmp(name->string, "..") == 0) {
            char msg[400];
            snprintf(msg, sizeof(msg),
                     "\"files\" names \"%.200s\", not a plain file name (a file of the checkpoint's directory, "
                     "without a '/')",
                     name->string);
            return bad_meta(ck, msg, err);
        }
        cf->name = name->string;
        cf->size = (uint64_t)size;
        cf->is_rank = strncmp(cf->name, "rank_", 5) == 0 && ends_with(cf->name, ".safetensors");
        ck->nfiles++;
    }
    for (size_t i = 0; i < keys->count; i++) {
        s = parse_key(ck, &keys->items[i], &ck->keys[ck->nkeys++], err);
        if (s != HT_OK) return s;
    }
    qsort(ck->keys, (size_t)ck->nkeys, sizeof(ck_key), cmp_key);
    return HT_OK;
}

/* Names up to a few keys stored in a file, for errors about the file as a whole. */
static void keys_in_file(const ht_checkpoint *ck, int file, char *buf, size_t n) {
    size_t used = (size_t)snprintf(buf, n, "holding");
    int listed = 0, more = 0;
    for (int k = 0; k < ck->nkeys; k++)
        for (int j = 0; j < ck->keys[k].nchunks; j++) {
            if (ck->keys[k].chunks[j].file != file) continue;
            if (listed < 3 && used < n)
                used += (size_t)snprintf(buf + used, n - used, "%s %s", listed ? "," : "", ck->keys[k].name);
            else
                more++;
            listed++;
        }
    if (more && used < n) snprintf(buf + used, n - used, " and %d more keys", more);
    if (listed == 0) snprintf(buf, n, "holding no tensor");
}

/* Checks one file's size and hash against metadata.json. */
static ht_status verify_file(const ht_checkpoint *ck, int i, ht_error *err) {
    const ck_file *f = &ck->files[i];
    char path[HT_CKPT_PATH_MAX], held[512];
    join(path, sizeof(path), ck->dir, f->name);
    keys_in_file(ck, i, held, sizeof(held));
    struct stat sb;
    if (stat(path, &sb) != 0) return ht_fail(err, HT_ERR_IO, "%s: missing (metadata.json lists it, %s)", path, held);
    if ((uint64_t)sb.st_size != f->size)
        return ht_fail(err, HT_ERR_FORMAT, "%s: %lld bytes, metadata.json says %" PRIu64 " (truncated or changed; %s)",
                       path, (long long)sb.st_size, f->size, held);
    uint64_t size, hash;
    ht_status s = hash_file(path, &size, &hash, err);
    if (s != HT_OK) return s;
    if (hash != f->hash)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: content hash xxh64 %016" PRIx64 ", metadata.json says %016" PRIx64 " (damaged; %s)", path,
                       hash, f->hash, held);
    return HT_OK;
}

/* Opens the rank files and binds every chunk to its tensor, checking dtype and shape. */
static ht_status bind_chunks(ht_checkpoint *ck, ht_error *err) {
    char path[HT_CKPT_PATH_MAX];
    for (int i = 0; i < ck->nfiles; i++) {
        if (!ck->files[i].is_rank) continue;
        join(path, sizeof(path), ck->dir, ck->files[i].name);
        ht_status s = ht_safetensors_open(path, &ck->files[i].st, err);
        if (s != HT_OK) return s;
    }
    for (int k = 0; k < ck->nkeys; k++) {
        ck_key *key = &ck->keys[k];
        for (int j = 0; j < key->nchunks; j++) {
            ck_chunk *c = &key->chunks[j];
            const char *file = ck->files[c->file].name;
            const ht_st_tensor *t = ht_safetensors_find(ck->files[c->file].st, key->name);
            if (!t)
                return ht_fail(err, HT_ERR_FORMAT, "%s/%s: key %s: not in the file (metadata.json lists a chunk there)",
                               ck->dir, file, key->name);
            if (t->dtype != key->dtype)
                return ht_fail(err, HT_ERR_FORMAT, "%s/%s: key %s: dtype %s in the file, metadata.json says %s",
                               ck->dir, file, key->name, ht_dtype_name(t->dtype), ht_dtype_name(key->dtype));
            bool same = t->ndim == key->ndim && (key->ndim == 0 || t->shape[0] == c->rows);
            for (int d = 1; same && d < key->ndim; d++) same = t->shape[d] == key->shape[d];
            if (!same)
                return ht_fail(err, HT_ERR_FORMAT,
                               "%s/%s: key %s: shape in the file does not match %lld rows of the global shape in "
                               "metadata.json",
                               ck->dir, file, key->name, (long long)c->rows);
            c->t = t;
        }
    }
    return HT_OK;
}

ht_status ht_ckpt_open(const char *dir, ht_checkpoint **out, ht_error *err) {
    *out = NULL;
    ht_checkpoint *ck = calloc(1, sizeof(ht_checkpoint));
    if (!ck) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    ht_status s = load_metadata(dir, ck, err);
    for (int i = 0; s == HT_OK && i < ck->nfiles; i++) s = verify_file(ck, i, err);
    if (s == HT_OK) s = bind_chunks(ck, err);
    if (s != HT_OK) {
        ht_ckpt_close(ck);
        return s;
    }
    *out = ck;
    return HT_OK;
}

void ht_ckpt_close(ht_checkpoint *ck) {
    if (!ck) return;
    for (int i = 0; i < ck->nfiles; i++)
        if (ck->files[i].st) ht_safetensors_close(ck->files[i].st);
    for (int k = 0; k < ck->nkeys; k++) free(ck->keys[k].chunks);
    free(ck->files);
    free(ck->keys);
    ht_json_free(ck->meta);
    free(ck);
}

int64_t ht_ckpt_step(const ht_checkpoint *ck) { return ck->step; }
int ht_ckpt_world_size(const ht_checkpoint *ck) { return ck->world; }
const char *ht_ckpt_dir(const ht_checkpoint *ck) { return ck->dir; }
const ht_ckpt_trainer_state *ht_ckpt_state(const ht_checkpoint *ck) { return &ck->state; }

const char *ht_ckpt_config_value(const ht_checkpoint *ck, const char *key) {
    const ht_json *v = ht_json_get(ht_json_get(ck->meta, "config"), key);
    return v && v->type == HT_JSON_STRING ? v->string : NULL;
}

/* The first complete checkpoint directory (step_X with a metadata.json) in
 * output_dir, into name; false when there is none. */
bool ht_ckpt_newest(const char *output_dir, char *name, size_t n) {
    DIR *d = opendir(output_dir);
    if (!d) return false;
    long long best = -1;
    char path[HT_CKPT_PATH_MAX];
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        long long step = step_of(e->d_name);
        if (step <= best) continue;
        snprintf(path, sizeof(path), "%s/%s/metadata.json", output_dir, e->d_name);
        struct stat sb;
        if (stat(path, &sb) == 0 && S_ISREG(sb.st_mode)) {
            snprintf(name, n, "%s", e->d_name);
            best = step;
        }
    }
    closedir(d);
    return best >= 0;
}

ht_status ht_ckpt_resolve(const char *restore_from, const char *output_dir, char *dir, size_t n, ht_error *err) {
    dir[0] = '\0';
    if (strcmp(restore_from, "latest") != 0) {
        snprintf(dir, n, "%s", restore_from);
        return HT_OK;
    }
    char path[HT_CKPT_PATH_MAX], any[256];
    join(path, sizeof(path), output_dir, "latest");
    struct stat sb;
    /* Only an output directory with no checkpoint at all starts fresh: a run
     * that cannot find the one it should resume must not overwrite the others. */
    if (lstat(path, &sb) != 0) {
        /* A save killed between its checkpoint's rename and latest's update leaves a complete checkpoint
         * and no latest (on the first save): the newest complete one is what latest would have named. */
        if (ht_ckpt_newest(output_dir, any, sizeof(any))) {
            ht_log_warn("checkpoint.restore_from latest: %s is missing, but %s holds complete checkpoints: resuming "
                        "the newest, %s (a save stopped before it could write latest?)",
                        path, output_dir, any);
            snprintf(dir, n, "%s/%s", output_dir, any);
            return HT_OK;
        }
        ht_log_info("checkpoint.restore_from latest: %s does not exist yet: starting from step 0", path);
        return HT_OK;
    }
    if (S_ISLNK(sb.st_mode) && stat(path, &sb) != 0) {
        char target[HT_CKPT_PATH_MAX] = "";
        ssize_t len = readlink(path, target, sizeof(target) - 1);
        if (len > 0) target[len] = '\0';
        return ht_fail(err, HT_ERR_IO, "checkpoint.restore_from latest: %s points to %s, which does not exist", path,
                       target);
    }
    char *text;
    size_t len;
    ht_status s = ht_read_file_max(path, 4096, "a latest file (one checkpoint name) may have", &text, &len, err);
    if (s != HT_OK) return s;
    while (len && (text[len - 1] == '\n' || text[len - 1] == ' ')) text[--len] = '\0';
    char meta[HT_CKPT_PATH_MAX + 64];
    snprintf(meta, sizeof(meta), "%s/%s/metadata.json", output_dir, text);
    bool printable = true;
    for (size_t i = 0; i < len; i++) printable = printable && text[i] >= 0x20 && text[i] < 0x7f;
    if (!printable) {
        s = ht_fail(err, HT_ERR_FORMAT,
                    "%s: holds %zu bytes that are not text (damaged?), where a checkpoint name (step_XXXXXXXX) "
                    "belongs; name the checkpoint to resume in checkpoint.restore_from",
                    path, len);
    } else if (step_of(text) < 0) {
        s = ht_fail(err, HT_ERR_FORMAT, "%s: names \"%.100s\", not a step_XXXXXXXX checkpoint", path, text);
    } else if (stat(meta, &sb) != 0) {
        s = ht_fail(err, HT_ERR_IO, "checkpoint.restore_from latest: %s names %s, but %s does not exist", path, text,
                    meta);
    } else {
        snprintf(dir, n, "%s/%s", output_dir, text);
    }
    free(text);
    return s;
}

/* ================================================================== load */

ht_status ht_ckpt_read_rows(const ht_checkpoint *ck, const char *name, int64_t row0, int64_t row1, void *dst,
                            ht_dtype dst_dtype, ht_error *err) {
    const ck_key *k = find_key(ck, name);
    if (!k) return ht_fail(err, HT_ERR_INVALID, "%s: key %s: not in the checkpoint", ck->dir, name);
    if (k->dtype != dst_dtype && !(ht_dtype_is_float(k->dtype) && ht_dtype_is_float(dst_dtype)))
        return ht_fail(err, HT_ERR_FORMAT, "%s: key %s: saved as %s, cannot be read as %s", ck->dir, name,
                       ht_dtype_name(k->dtype), ht_dtype_name(dst_dtype));
    int64_t row_numel = 1;
    for (int d = 1; d < k->ndim; d++) row_numel *= k->shape[d];
    size_t ssize = ht_dtype_size(k->dtype), dsize = ht_dtype_size(dst_dtype);
    /* The planner: the overlap of each saved chunk with the rows asked for. */
    for (int j = 0; j < k->nchunks; j++) {
        const ck_chunk *c = &k->chunks[j];
        int64_t a = row0 > c->row0 ? row0 : c->row0;
        int64_t b = row1 < c->row0 + c->rows ? row1 : c->row0 + c->rows;
        if (a >= b) continue;
        const char *src = (const char *)c->t->data + (size_t)((a - c->row0) * row_numel) * ssize;
        char *out = (char *)dst + (size_t)((a - row0) * row_numel) * dsize;
        ht_convert(out, dst_dtype, src, k->dtype, (size_t)((b - a) * row_numel));
    }
    return HT_OK;
}

/* The key must exist with the param's global shape (and be FP32 unless a model key). */
static ht_status check_key(const ht_checkpoint *ck, const ck_key *k, const ht_param *p, bool scalar, ht_error *err) {
    const char *file = ck->files[k->chunks[0].file].name;
    if (scalar) {
        if (k->ndim != 0 || k->dtype != HT_DTYPE_I64)
            return ht_fail(err, HT_ERR_FORMAT, "%s/%s: key %s: expected an int64 scalar, found %s with %d dims",
                           ck->dir, file, k->name, ht_dtype_name(k->dtype), k->ndim);
        return HT_OK;
    }
    bool same = k->ndim == p->ndim;
    for (int d = 0; same && d < p->ndim; d++) same = k->shape[d] == p->shape[d];
    if (!same) {
        char want[96] = "", got[96] = "";
        for (int d = 0; d < p->ndim; d++)
            snprintf(want + strlen(want), sizeof(want) - strlen(want), "%s%lld", d ? "x" : "", (long long)p->shape[d]);
        for (int d = 0; d < k->ndim; d++)
            snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%lld", d ? "x" : "", (long long)k->shape[d]);
        return ht_fail(err, HT_ERR_FORMAT, "%s/%s: key %s: shape %s in the checkpoint, the model's %s is %s", ck->dir,
                       file, k->name, got, p->name, want);
    }
    bool model = k->kind == KIND_MODEL;
    if (model ? !ht_dtype_is_float(k->dtype) : k->dtype != HT_DTYPE_F32)
        return ht_fail(err, HT_ERR_FORMAT, "%s/%s: key %s: dtype %s, expected %s", ck->dir, file, k->name,
                       ht_dtype_name(k->dtype), model ? "a float dtype" : "float32");
    return HT_OK;
}

static bool has_separate_main(const ht_param *p) {
    return p->trainable && p->main_param && (void *)p->main_param != p->data;
}

/* An optimizer tensor for a slot, when the checkpoint has it: checked, then returned. */
static ht_status slot_key(const ht_checkpoint *ck, const ht_param *p, key_kind kind, const ck_key **out,
                          ht_error *err) {
    char name[HT_CKPT_KEY_MAX];
    key_name(name, kind, p->name);
    *out = find_key(ck, name);
    return *out ? check_key(ck, *out, p, kind == KIND_STEP, err) : HT_OK;
}

/* Appends ", name" to a list that stays within cap (", ..." once it is full). */
static void append_name(char *buf, size_t cap, const char *name) {
    size_t used = strlen(buf);
    if (used + strlen(name) + 8 < cap)
        snprintf(buf + used, cap - used, "%s%s", used ? ", " : "", name);
    else if (!ends_with(buf, ", ..."))
        snprintf(buf + used, cap - used, ", ...");
}

/* The parameter name a key belongs to ("optimizer.state.<fqn>.exp_avg" -> fqn). */
static void key_fqn(const ck_key *k, char *out, size_t cap) {
    const char *at = k->name;
    size_t len = strlen(at);
    if (k->kind == KIND_MODEL) {
        at += strlen("model.");
    } else if (k->kind == KIND_MAIN) {
        at += strlen(MAIN_PREFIX);
    } else {
        at += strlen(OPT_PREFIX);
        len -= strlen(KIND_NAMES[k->kind]) + 1;
    }
    len -= (size_t)(at - k->name);
    snprintf(out, cap, "%.*s", (int)(len < cap ? len : cap - 1), at);
}

/* Whether the checkpoint lacks p's model tensor (a load_strict false load then keeps p as it is). */
static bool model_key_missing(const ht_checkpoint *ck, const ht_param *p) {
    char name[HT_CKPT_KEY_MAX];
    key_name(name, KIND_MODEL, p->name);
    return find_key(ck, name) == NULL;
}

/* Checks every optimizer key the view will read; loads them when apply is
 * set. Strict: once the saved optimizer has stepped, every state tensor this
 * run keeps must be there, and every one the checkpoint holds must have a
 * place here (a changed routing or optimizer would otherwise zero or drop
 * state without a word). restore_optimizer false loads the model alone.
 * Lenient (load_strict false): a param the checkpoint has no weights for
 * starts its state from zero, and state of params this model lacks is left. */
static ht_status optimizer_pass(const ht_checkpoint *ck, ht_ckpt_view *v, bool apply, int *loaded, ht_error *err) {
    ht_optimizer *opt = v->optimizer;
    ht_opt_state *state;
    int n;
    ht_status s = optimizer_state(opt, &state, &n, err);
    bool *used = s == HT_OK ? calloc((size_t)ck->nkeys + 1, sizeof(bool)) : NULL;
    if (s == HT_OK && !used) s = ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    char missing[1200] = "";
    int n_missing = 0;
    for (int i = 0; s == HT_OK && i < n; i++) {
        const ht_opt_state *e = &state[i];
        ht_param *p = e->param;
        key_kind kind = state_kind(e->key);
        const ck_key *k;
        s = slot_key(ck, p, kind, &k, err);
        if (s == HT_OK && k && !e->data)
            s = ht_fail(err, HT_ERR_INVALID, "%s: key %s: this run's optimizer keeps no %s to receive it", ck->dir,
                        k->name, e->key);
        if (k) used[k - ck->keys] = true;
        bool fresh = v->lenient && model_key_missing(ck, p);
        if (s == HT_OK && !k && e->data && ck->state.schedule_step > 0 && !fresh) {
            char name[HT_CKPT_KEY_MAX];
            key_name(name, kind, p->name);
            append_name(missing, sizeof(missing), name);
            n_missing++;
        }
        if (s != HT_OK || !apply || !e->data) continue;
        if (kind == KIND_STEP) {
            *(int64_t *)e->data = 0;
            if (k) s = ht_ckpt_read_rows(ck, k->name, 0, 1, e->data, HT_DTYPE_I64, err);
            continue;
        }
        if (k)
            s = ht_ckpt_read_rows(ck, k->name, p->row0, p->row1, e->data, HT_DTYPE_F32, err);
        else /* the saved optimizer never stepped: as fresh */
            memset(e->data, 0, (size_t)ht_param_local_numel(p) * sizeof(float));
        *loaded += k != NULL;
    }
    char extra[1200] = "";
    int n_extra = 0;
    for (int k = 0; s == HT_OK && k < ck->nkeys; k++) {
        if (ck->keys[k].kind < KIND_EXP_AVG || used[k]) continue;
        char fqn[HT_CKPT_KEY_MAX];
        key_fqn(&ck->keys[k], fqn, sizeof(fqn));
        const ht_param *p = ht_params_find(v->params, fqn);
        if (p && !p->trainable) continue; /* a param this run freezes (model.freeze): its state is not needed */
        if (!p && v->lenient) continue;   /* listed with the model tensors this model lacks */
        append_name(extra, sizeof(extra), ck->keys[k].name);
        n_extra++;
    }
    if (s == HT_OK && n_missing)
        s = ht_fail(err, HT_ERR_FORMAT,
                    "%s: the optimizer had taken %lld steps, but %d of the state tensors this run needs are missing "
                    "(saved with checkpoint.save_optimizer false, or another optimizer or routing): %s; refusing to "
                    "start them from zero: set checkpoint.restore_optimizer false to load the model alone",
                    ck->dir, (long long)ck->state.schedule_step, n_missing, missing);
    if (s == HT_OK && n_extra)
        s = ht_fail(err, HT_ERR_FORMAT,
                    "%s: %d optimizer state tensors have no place in this run (its optimizer or its Muon/AdamW "
                    "routing differs from the saved run's): %s; refusing to drop them: set "
                    "checkpoint.restore_optimizer false to load the model alone",
                    ck->dir, n_extra, extra);
    free(used);
    free(state);
    return s;
}

ht_status ht_ckpt_load(const ht_checkpoint *ck, ht_ckpt_view *v, bool restore_optimizer, ht_error *err) {
    ht_param_store *ps = v->params;
    int main_keys = 0;
    for (int k = 0; k < ck->nkeys; k++) main_keys += ck->keys[k].kind == KIND_MAIN;
    /* Check everything before touching anything. */
    char missing[1200] = "", unknown[1200] = "";
    int n_missing = 0, n_main_missing = 0, n_main_wanted = 0, n_unknown = 0;
    char main_missing[1200] = "";
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        char name[HT_CKPT_KEY_MAX];
        key_name(name, KIND_MODEL, p->name);
        const ck_key *k = find_key(ck, name);
        if (!k) {
            append_name(missing, sizeof(missing), name);
            n_missing++;
            continue;
        }
        ht_status s = check_key(ck, k, p, false, err);
        if (s != HT_OK) return s;
        /* A model saved in float32 carries no main params: it is its own. */
        if (!restore_optimizer || !has_separate_main(p) || k->dtype == HT_DTYPE_F32) continue;
        n_main_wanted++;
        key_name(name, KIND_MAIN, p->name);
        const ck_key *mk = find_key(ck, name);
        if (!mk) {
            append_name(main_missing, sizeof(main_missing), name);
            n_main_missing++;
        } else if ((s = check_key(ck, mk, p, false, err)) != HT_OK) {
            return s;
        }
    }
    for (int k = 0; k < ck->nkeys; k++) {
        char fqn[HT_CKPT_KEY_MAX];
        key_fqn(&ck->keys[k], fqn, sizeof(fqn));
        if (ck->keys[k].kind != KIND_MODEL || ht_params_find(ps, fqn)) continue;
        append_name(unknown, sizeof(unknown), ck->keys[k].name);
        n_unknown++;
    }
    if (!v->lenient && n_missing)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: %d model weights missing: %s (training.load_strict false loads the rest and keeps these "
                       "as initialised)",
                       ck->dir, n_missing, missing);
    if (!v->lenient && n_unknown)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: %d model tensors are not parameters of this model (another architecture or size?): %s "
                       "(training.load_strict false loads the rest and leaves these)",
                       ck->dir, n_unknown, unknown);
    if (n_missing)
        ht_log_warn("%s: training.load_strict false: %d model weights missing, kept as initialised (their optimizer "
                    "state starts from zero): %s",
                    ck->dir, n_missing, missing);
    if (n_unknown)
        ht_log_warn("%s: training.load_strict false: %d tensors of params this model lacks, left unloaded (with their "
                    "optimizer state): %s",
                    ck->dir, n_unknown, unknown);
    if (restore_optimizer && main_keys > 0 && n_main_missing > 0)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: refusing a partial set of FP32 main params: %d of %d missing (never filled in from the "
                       "model): %s",
                       ck->dir, n_main_missing, n_main_wanted, main_missing);
    int loaded = 0;
    if (restore_optimizer && v->optimizer) {
        ht_status s = optimizer_pass(ck, v, false, &loaded, err);
        if (s != HT_OK) return s;
    }

    /* Model weights, converted to each param's dtype: the run's model_init_dtype decides. */
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        char name[HT_CKPT_KEY_MAX];
        key_name(name, KIND_MODEL, p->name);
        if (!find_key(ck, name)) continue; /* load_strict false: kept */
        ht_status s = ht_ckpt_read_rows(ck, name, p->row0, p->row1, p->data, p->dtype, err);
        if (s != HT_OK) return s;
    }
    /* The FP32 main params. A run without them (optimizer.fp32_main_params
     * false) steps from the model weights just loaded, so the checkpoint's
     * stay unread. */
    int rebuilt = 0, ignored = 0;
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        char name[HT_CKPT_KEY_MAX];
        key_name(name, KIND_MAIN, p->name);
        if (restore_optimizer && p->trainable && !p->main_param && find_key(ck, name)) ignored++;
    }
    if (ignored)
        ht_log_info("%s: %d FP32 main params (_mixed_precision_optimizer) not loaded: this run keeps none "
                    "(optimizer.fp32_main_params false) and steps from the model weights as saved",
                    ck->dir, ignored);
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        if (!has_separate_main(p)) continue;
        char name[HT_CKPT_KEY_MAX];
        key_name(name, KIND_MODEL, p->name);
        const ck_key *mk = find_key(ck, name);
        if (!mk) { /* load_strict false: kept as initialised, its main param with it */
            ht_convert(p->main_param, HT_DTYPE_F32, p->data, p->dtype, (size_t)ht_param_local_numel(p));
            continue;
        }
        if (restore_optimizer && mk->dtype != HT_DTYPE_F32) {
            key_name(name, KIND_MAIN, p->name);
            mk = find_key(ck, name);
        }
        if (restore_optimizer && mk && mk->dtype == HT_DTYPE_F32) {
            ht_status s = ht_ckpt_read_rows(ck, mk->name, p->row0, p->row1, p->main_param, HT_DTYPE_F32, err);
            if (s != HT_OK) return s;
        } else {
            ht_convert(p->main_param, HT_DTYPE_F32, p->data, p->dtype, (size_t)ht_param_local_numel(p));
            rebuilt++;
        }
    }
    /* A run that kept no FP32 main params stepped from its model weights
     * alone: built from them, its main params lose nothing. */
    const char *saved_main = ht_ckpt_config_value(ck, "optimizer.fp32_main_params");
    if (rebuilt && restore_optimizer && saved_main && strcmp(saved_main, "false") == 0)
        ht_log_info("%s: saved with optimizer.fp32_main_params false: %d FP32 main params built from its %s model, "
                    "all the values that run kept",
                    ck->dir, rebuilt, ht_dtype_name(ps->items[0].dtype));
    else if (rebuilt && restore_optimizer)
        ht_log_warn("%s: no FP32 main params (_mixed_precision_optimizer) in the checkpoint: %d main params rebuilt "
                    "from the %s model; the FP32 tail the model dtype cannot hold is lost",
                    ck->dir, rebuilt, ht_dtype_name(ps->items[0].dtype));
    else if (rebuilt)
        ht_log_info("%s: checkpoint.restore_optimizer false: the model only; %d FP32 main params rebuilt from it",
                    ck->dir, rebuilt);
    ht_params_refresh_compute(ps);
    if (restore_optimizer && v->optimizer) {
        ht_status s = optimizer_pass(ck, v, true, &loaded, err);
        if (s != HT_OK) return s;
        v->optimizer->step = ck->state.schedule_step;
        if (v->optimizer->loss_scaling && ck->state.loss_scaling) {
            v->optimizer->scaler.scale = ck->state.scaler.scale;
            v->optimizer->scaler.growth_tracker = ck->state.scaler.growth_tracker;
            v->optimizer->scaler.hysteresis_tracker = ck->state.scaler.hysteresis_tracker;
        }
    }
    if (restore_optimizer) v->state = ck->state;
    ht_log_info("restored %s: step %lld, saved on %d rank(s); %d model tensors, %d optimizer tensors%s", ck->dir,
                (long long)ck->step, ck->world, ps->count, loaded,
                restore_optimizer ? "" : " (restore_optimizer false)");
    return HT_OK;
}

/* ================================================================== export and inspect */

/* model.lora as the run that saved ck had it (its effective config), for the
 * merge and the adapter's adapter_config.json; base: its model.from_pretrained. */
static ht_status saved_lora(const ht_checkpoint *ck, ht_lora_config *lc, char *base, size_t n, ht_error *err) {
    static const char *const keys[] = {"model.lora.rank", "model.lora.alpha", "model.lora.dropout",
                                       "model.lora.use_rslora", "model.from_pretrained"};
    ht_config *cfg = malloc(sizeof(ht_config));
    if (!cfg) return ht_fail(err, HT_ERR_OOM, "export: out of memory");
    ht_config_defaults(cfg);
    ht_status s = HT_OK;
    for (size_t i = 0; i < sizeof(keys) / sizeof(keys[0]) && s == HT_OK; i++) {
        const char *v = ht_ckpt_config_value(ck, keys[i]);
        char set[HT_CONFIG_STR_MAX + 64];
        if (!v)
            s = ht_fail(err, HT_ERR_FORMAT,
                        "%s holds LoRA adapters but its metadata.json has no %s to merge or describe them with",
                        ck->dir, keys[i]);
        else if (snprintf(set, sizeof(set), "%s=%s", keys[i], v) >= (int)sizeof(set))
            s = ht_fail(err, HT_ERR_FORMAT, "%s: %s is too long", ck->dir, keys[i]);
        else
            s = ht_config_set(cfg, set, err);
    }
    if (s == HT_OK) {
        memset(lc, 0, sizeof(*lc));
        lc->rank = cfg->model.lora.rank;
        lc->alpha = cfg->model.lora.alpha;
        lc->dropout = cfg->model.lora.dropout;
        lc->use_rslora = cfg->model.lora.use_rslora;
        snprintf(base, n, "%s", cfg->model.from_pretrained);
    }
    free(cfg);
    return s;
}

static bool has_adapter(const ht_checkpoint *ck, const char *fqn) {
    size_t n = strlen(fqn);
    if (n < 7 || strcmp(fqn + n - 7, ".weight") != 0) return false;
    char name[HT_CKPT_KEY_MAX];
    snprintf(name, sizeof(name), "model.%.*s.lora_A.weight", (int)(n - 7), fqn);
    return find_key(ck, name) != NULL;
}

/* The model.* keys of ck as a whole-tensor store: `dtype` (HT_DTYPE_COUNT: the
 * checkpoint's), the adapters and the weights they adapt in FP32 for the
 * merge (or, adapters_only, the adapters alone). For a float32 export every
 * tensor comes from the FP32 main params where the checkpoint has them. */
static ht_status read_store(const ht_checkpoint *ck, ht_dtype *dtype, bool adapters_only, ht_param_store *store,
                            int *adapters, ht_error *err) {
    ht_status s = HT_OK;
    *adapters = 0;
    for (int k = 0; s == HT_OK && k < ck->nkeys; k++) {
        const ck_key *key = &ck->keys[k];
        if (key->kind != KIND_MODEL) continue;
        if (*dtype == HT_DTYPE_COUNT) *dtype = key->dtype;
        const char *fqn = key->name + strlen("model.");
        bool adapter = ht_lora_kind(fqn) != 0;
        *adapters += adapter;
        if (adapters_only && !adapter) continue;
        ht_dtype dt = adapter || has_adapter(ck, fqn) ? HT_DTYPE_F32 : *dtype;
        if (adapters_only) dt = *dtype;
        ht_param *p = ht_params_add(store, fqn, key->ndim, key->shape, dt);
        if (!p)
            s = ht_fail(err, HT_ERR_OOM, "export: cannot add %s", key->name);
        else
            p->trainable = false;
    }
    if (s == HT_OK) s = ht_params_allocate(store, err);
    for (int i = 0; s == HT_OK && i < store->count; i++) {
        ht_param *p = &store->items[i];
        char name[HT_CKPT_KEY_MAX];
        key_name(name, KIND_MAIN, p->name);
        /* float32 from a bf16/fp16 checkpoint: the FP32 main params are the precise weights (in another
         * dtype the model's values, widened to FP32 for a merge, as the run's final save merges them). */
        if (*dtype != HT_DTYPE_F32 || !find_key(ck, name)) key_name(name, KIND_MODEL, p->name);
        s = ht_ckpt_read_rows(ck, name, 0, p->shape[0], p->data, p->dtype, err);
    }
    if (s == HT_OK && store->count == 0) s = ht_fail(err, HT_ERR_FORMAT, "%s: no model.* keys to export", ck->dir);
    return s;
}

ht_status ht_ckpt_export(const char *ckpt_dir, const char *out_dir, ht_dtype dtype, size_t max_shard_bytes,
                         ht_error *err) {
    ht_checkpoint *ck;
    ht_status s = ht_ckpt_open(ckpt_dir, &ck, err);
    if (s != HT_OK) return s;
    ht_model_config cfg;
    if (find_file(ck, "config.json") < 0)
        s = ht_fail(err, HT_ERR_FORMAT, "%s: no config.json: saved without the model architecture", ck->dir);
    if (s == HT_OK) s = ht_hf_read_config(ck->dir, &cfg, err);
    ht_param_store store = {0}, merged = {0};
    int adapters = 0;
    if (s == HT_OK) s = read_store(ck, &dtype, false, &store, &adapters, err);
    const ht_param_store *out = &store;
    char base[HT_CONFIG_STR_MAX];
    if (s == HT_OK && adapters) { /* model.lora: W + scale B A, so that transformers loads it as it is */
        s = saved_lora(ck, &cfg.lora, base, sizeof(base), err);
        if (s == HT_OK) s = ht_lora_merge(&store, ht_lora_scale(&cfg.lora), &merged, err);
        out = &merged;
    }
    if (s == HT_OK) s = ht_hf_save(out_dir, &cfg, out, dtype, max_shard_bytes, err);
    if (s == HT_OK)
        ht_log_info("exported %s (step %lld) to %s in %s%s", ck->dir, (long long)ck->step, out_dir,
                    ht_dtype_name(dtype), adapters ? ", the LoRA adapters merged into the weights" : "");
    ht_params_free(&merged);
    ht_params_free(&store);
    ht_ckpt_close(ck);
    return s;
}

ht_status ht_ckpt_export_adapter(const char *ckpt_dir, const char *out_dir, ht_dtype dtype, ht_error *err) {
    ht_checkpoint *ck;
    ht_status s = ht_ckpt_open(ckpt_dir, &ck, err);
    if (s != HT_OK) return s;
    if (dtype == HT_DTYPE_COUNT) dtype = HT_DTYPE_F32;
    ht_param_store store = {0};
    int adapters = 0;
    ht_lora_config lc;
    char base[HT_CONFIG_STR_MAX];
    s = read_store(ck, &dtype, true, &store, &adapters, err);
    if (s == HT_OK && adapters == 0)
        s = ht_fail(err, HT_ERR_FORMAT, "%s holds no LoRA adapters (a run with model.lora.rank > 0 saves them)",
                    ck->dir);
    if (s == HT_OK) s = saved_lora(ck, &lc, base, sizeof(base), err);
    /* The base weights by name alone (no storage): target_modules is written
     * from which modules of each name have adapters. */
    for (int k = 0; s == HT_OK && k < ck->nkeys; k++) {
        const ck_key *key = &ck->keys[k];
        const char *fqn = key->name + strlen("model.");
        if (key->kind == KIND_MODEL && !ht_lora_kind(fqn) &&
            !ht_params_add(&store, fqn, key->ndim, key->shape, key->dtype))
            s = ht_fail(err, HT_ERR_OOM, "export: cannot add %s", key->name);
    }
    for (int i = 0; s == HT_OK && i < store.count; i++) {
        const ht_param *p = &store.items[i];
        if (ht_lora_kind(p->name) == 'A' && p->shape[0] != lc.rank)
            s = ht_fail(err, HT_ERR_FORMAT, "%s: %s has %lld rows but model.lora.rank was %d", ck->dir, p->name,
                        (long long)p->shape[0], lc.rank);
    }
    if (s == HT_OK) s = ht_peft_save_adapter(out_dir, &store, &lc, base, dtype, err);
    if (s == HT_OK)
        ht_log_info("exported the %d LoRA adapter tensors of %s (step %lld) to %s in %s (PEFT's layout)", adapters,
                    ck->dir, (long long)ck->step, out_dir, ht_dtype_name(dtype));
    ht_params_free(&store);
    ht_ckpt_close(ck);
    return s;
}

ht_status ht_ckpt_inspect(const char *dir, FILE *out, ht_error *err) {
    ht_checkpoint *ck = calloc(1, sizeof(ht_checkpoint));
    if (!ck) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    ht_status s = load_metadata(dir, ck, err);
    if (s != HT_OK) {
        ht_ckpt_close(ck);
        return s;
    }
    const ht_ckpt_trainer_state *st = &ck->state;
    fprintf(out, "checkpoint %s\n", ck->dir);
    fprintf(out, "  format version %d, step %lld, saved on %d rank(s), hash %s\n", ck->version, (long long)ck->step,
            ck->world, HT_CKPT_HASH);
    fprintf(out, "  trainer state: step %lld, schedule step %lld, ", (long long)st->step, (long long)st->schedule_step);
    if (!st->no_rng)
        fprintf(out,
                "seed %lld, train loader epoch %" PRIu64 " window %" PRIu64 ", validation loader epoch %" PRIu64
                " window %" PRIu64,
                (long long)st->seed, st->train_pos.epoch, st->train_pos.index, st->valid_pos.epoch,
                st->valid_pos.index);
    else
        fputs("no seed or data positions (saved with training.no_save_rng)", out);
    if (st->loss_scaling) fprintf(out, ", loss scale %g", st->scaler.scale);
    fputc('\n', out);
    uint64_t numel[KIND_COUNT] = {0}, bytes[KIND_COUNT] = {0};
    int count[KIND_COUNT] = {0};
    ht_dtype dt[KIND_COUNT];
    for (int k = 0; k < ck->nkeys; k++) {
        const ck_key *key = &ck->keys[k];
        uint64_t n = 1;
        for (int d = 0; d < key->ndim; d++) n *= (uint64_t)key->shape[d];
        count[key->kind]++;
        numel[key->kind] += n;
        bytes[key->kind] += n * ht_dtype_size(key->dtype);
        dt[key->kind] = key->dtype;
    }
    fprintf(out, "  keys by kind:\n");
    static const char *const labels[KIND_COUNT] = {"model.*",
                                                   MAIN_PREFIX "*",
                                                   OPT_PREFIX "*.exp_avg",
                                                   OPT_PREFIX "*.exp_avg_sq",
                                                   OPT_PREFIX "*.momentum_buffer",
                                                   OPT_PREFIX "*.step"};
    for (int k = 0; k < KIND_COUNT; k++)
        if (count[k])
            fprintf(out, "    %-58s %5d keys %12" PRIu64 " values %10.2f MiB %s\n", labels[k], count[k], numel[k],
                    (double)bytes[k] / (1 << 20), ht_dtype_name(dt[k]));
        else
            fprintf(out, "    %-58s     none\n", labels[k]);
    fprintf(out, "  files:\n");
    int bad = 0;
    ht_error first = {0};
    for (int i = 0; i < ck->nfiles; i++) {
        ht_error e = {0};
        ht_status fs = verify_file(ck, i, &e);
        fprintf(out, "    %-26s %12" PRIu64 " bytes  xxh64 %016" PRIx64 "  %s\n", ck->files[i].name, ck->files[i].size,
                ck->files[i].hash, fs == HT_OK ? "OK" : "MISMATCH");
        if (fs != HT_OK && bad++ == 0) first = e;
    }
    if (bad == 0) s = bind_chunks(ck, &first);
    if (bad == 0 && s == HT_OK)
        fprintf(out, "  hashes: all %d files OK\n", ck->nfiles);
    else if (bad)
        s = ht_fail(err, first.status, "%d of %d files do not match metadata.json; first: %s", bad, ck->nfiles,
                    first.msg);
    else
        *err = first;
    ht_ckpt_close(ck);
    return s;
}
