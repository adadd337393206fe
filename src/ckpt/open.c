/* Opening a training checkpoint and verifying it before any tensor is read
 * (docs/DESIGN.md, Checkpoints): metadata.json, every file's size and hash,
 * the chunks bound to their tensors; the accessors, and restore_from. */
#include "ckpt/checkpoint_internal.h"

#include <dirent.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static key_kind kind_of(const char *key) {
    if (strncmp(key, MAIN_PREFIX, strlen(MAIN_PREFIX)) == 0) return KIND_MAIN;
    if (strncmp(key, OPT_PREFIX, strlen(OPT_PREFIX)) == 0) {
        for (int k = KIND_EXP_AVG; k < KIND_COUNT; k++) {
            char suffix[32];
            snprintf(suffix, sizeof(suffix), ".%s", ht_ckpt_kind_names[k]);
            if (ht_ckpt_ends_with(key, suffix)) return (key_kind)k;
        }
    }
    return KIND_MODEL;
}

static int cmp_key(const void *a, const void *b) {
    return strcmp(((const ck_key *)a)->name, ((const ck_key *)b)->name);
}

const ck_key *ht_ckpt_find_key(const ht_checkpoint *ck, const char *name) {
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

int ht_ckpt_find_file(const ht_checkpoint *ck, const char *name) {
    for (int i = 0; i < ck->nfiles; i++)
        if (strcmp(ck->files[i].name, name) == 0) return i;
    return -1;
}

/* "[0, 4]": ndim ints, appended to buf at *used. */
static void format_list(char *buf, size_t n, size_t *used, int ndim, const int64_t *v) {
    const char *sep = "[";
    for (int d = 0; d < ndim && *used < n; d++, sep = ", ")
        *used += (size_t)snprintf(buf + *used, n - *used, "%s%lld", sep, (long long)v[d]);
    if (*used < n) *used += (size_t)snprintf(buf + *used, n - *used, ndim ? "]" : "[]");
}

/* "offsets [0, 4], lengths [3, 4]" of a chunk's box. */
static void format_box(char *buf, size_t n, int ndim, const ht_box *b) {
    size_t used = (size_t)snprintf(buf, n, "offsets ");
    format_list(buf, n, &used, ndim, b->offset);
    if (used < n) used += (size_t)snprintf(buf + used, n - used, ", lengths ");
    format_list(buf, n, &used, ndim, b->length);
}

/* A chunk's box: format 2's "offsets" and "lengths" (one per dim), or format
 * 1's "row_offset" and "rows" of whole rows (a scalar: row 0 of 1). */
static bool parse_box(const ht_json *c, const ck_key *k, ht_box *b) {
    const ht_json *offsets = ht_json_get(c, "offsets"), *lengths = ht_json_get(c, "lengths");
    *b = (ht_box){{0}, {0}};
    if (offsets || lengths) {
        if (!offsets || !lengths || offsets->type != HT_JSON_ARRAY || lengths->type != HT_JSON_ARRAY ||
            offsets->count != (size_t)k->ndim || lengths->count != (size_t)k->ndim)
            return false;
        for (int d = 0; d < k->ndim; d++)
            if (!json_int(&offsets->items[d], &b->offset[d]) || !json_int(&lengths->items[d], &b->length[d]))
                return false;
        return true;
    }
    int64_t row0, rows;
    if (!json_int(ht_json_get(c, "row_offset"), &row0) || !json_int(ht_json_get(c, "rows"), &rows)) return false;
    if (k->ndim == 0) return row0 == 0 && rows == 1;
    for (int d = 1; d < k->ndim; d++) b->length[d] = k->shape[d];
    b->offset[0] = row0;
    b->length[0] = rows;
    return true;
}

/* One element of the key's shape that no chunk holds, when the search is
 * small enough. Every coordinate of some uncovered element can be taken
 * from {0} and the chunks' ends in that dim (lowering one to the nearest
 * such value below keeps it uncovered), so only that grid is searched. */
static bool find_hole(const ck_key *k, int64_t *at) {
    int64_t *cand = malloc(((size_t)k->nchunks + 1) * HT_PARAM_MAX_DIMS * sizeof(int64_t));
    int count[HT_PARAM_MAX_DIMS], idx[HT_PARAM_MAX_DIMS] = {0};
    double points = 1;
    if (!cand) return false;
    for (int d = 0; d < k->ndim; d++) {
        int64_t *c = cand + (size_t)d * ((size_t)k->nchunks + 1);
        count[d] = 0;
        c[count[d]++] = 0;
        for (int j = 0; j < k->nchunks; j++) {
            int64_t e = k->chunks[j].box.offset[d] + k->chunks[j].box.length[d];
            if (e < k->shape[d]) c[count[d]++] = e;
        }
        points *= count[d];
    }
    bool found = false;
    while (!found && points * k->nchunks <= 1e8) {
        ht_box p = {{0}, {0}};
        for (int d = 0; d < k->ndim; d++) {
            p.offset[d] = cand[(size_t)d * ((size_t)k->nchunks + 1) + (size_t)idx[d]];
            p.length[d] = 1;
        }
        ht_box o;
        found = true;
        for (int j = 0; found && j < k->nchunks; j++) found = !ht_box_intersect(k->ndim, &p, &k->chunks[j].box, &o);
        if (found) memcpy(at, p.offset, sizeof(p.offset));
        int d = k->ndim - 1;
        while (d >= 0 && ++idx[d] == count[d]) idx[d--] = 0;
        if (d < 0) break;
    }
    free(cand);
    return found;
}

typedef struct chunk_start {
    int64_t at; /* offset in dim 0 */
    int chunk;
} chunk_start;

static int cmp_start(const void *a, const void *b) {
    const chunk_start *x = a, *y = b;
    return x->at != y->at ? (x->at < y->at ? -1 : 1) : x->chunk - y->chunk;
}

/* The chunks of a key tile its shape exactly: each inside it and not empty,
 * no two overlapping, and together as many elements as the shape (so no
 * hole). Checked before anything is read, so the planner can trust every
 * overlap it computes. */
static ht_status check_tiling(const ht_checkpoint *ck, const ck_key *k, ht_error *err) {
    char msg[HT_ERROR_MSG_MAX / 2], box[256], other[256];
    int64_t total = 1;
    for (int d = 0; d < k->ndim; d++) {
        if (k->shape[d] != 0 && total > INT64_MAX / k->shape[d]) {
            snprintf(msg, sizeof(msg), "key %.200s: its shape has more than 2^63 elements", k->name);
            return bad_meta(ck, msg, err);
        }
        total *= k->shape[d];
    }
    for (int j = 0; j < k->nchunks; j++) {
        const ht_box *b = &k->chunks[j].box;
        bool empty = false, inside = true;
        for (int d = 0; d < k->ndim; d++) {
            empty = empty || b->length[d] < 1;
            inside = inside && b->offset[d] >= 0 && b->length[d] <= k->shape[d] &&
                     b->offset[d] <= k->shape[d] - b->length[d];
        }
        if (empty || !inside) {
            size_t used = 0;
            format_box(box, sizeof(box), k->ndim, b);
            format_list(other, sizeof(other), &used, k->ndim, k->shape);
            snprintf(msg, sizeof(msg), "key %.200s: chunk %d (%s, %s) %s the shape %s", k->name, j,
                     ck->files[k->chunks[j].file].name, box, empty ? "holds no element of" : "lies outside", other);
            return bad_meta(ck, msg, err);
        }
    }
    /* Overlaps: a sweep along dim 0 in offset order, each chunk against
     * those still open there (one for FSDP's rows; a row of TP blocks). */
    chunk_start *order = malloc((size_t)k->nchunks * sizeof(chunk_start));
    int *open = malloc((size_t)k->nchunks * sizeof(int)), nopen = 0;
    if (!order || !open) {
        free(order);
        free(open);
        return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    }
    for (int j = 0; j < k->nchunks; j++) order[j] = (chunk_start){k->ndim ? k->chunks[j].box.offset[0] : 0, j};
    qsort(order, (size_t)k->nchunks, sizeof(chunk_start), cmp_start);
    int64_t covered = 0;
    for (int i = 0; i < k->nchunks; i++) {
        const ck_chunk *c = &k->chunks[order[i].chunk];
        int kept = 0;
        for (int j = 0; j < nopen; j++) {
            const ck_chunk *o = &k->chunks[open[j]];
            if (k->ndim > 0 && o->box.offset[0] + o->box.length[0] <= c->box.offset[0]) continue; /* closed */
            ht_box both;
            if (ht_box_intersect(k->ndim, &c->box, &o->box, &both)) {
                format_box(box, sizeof(box), k->ndim, &c->box);
                format_box(other, sizeof(other), k->ndim, &o->box);
                snprintf(msg, sizeof(msg), "key %.200s: chunk %d (%s, %s) overlaps chunk %d (%s, %s)", k->name,
                         order[i].chunk, ck->files[c->file].name, box, open[j], ck->files[o->file].name, other);
                free(order);
                free(open);
                return bad_meta(ck, msg, err);
            }
            open[kept++] = open[j];
        }
        nopen = kept;
        open[nopen++] = order[i].chunk;
        covered += ht_box_numel(k->ndim, &c->box); /* disjoint and inside: at most total */
    }
    free(order);
    free(open);
    if (covered != total) {
        int64_t at[HT_PARAM_MAX_DIMS];
        char where[160] = "";
        if (find_hole(k, at)) {
            size_t used = (size_t)snprintf(where, sizeof(where), ": element ");
            format_list(where, sizeof(where), &used, k->ndim, at);
            if (used < sizeof(where)) snprintf(where + used, sizeof(where) - used, " is in none");
        }
        snprintf(msg, sizeof(msg), "key %.200s: its chunks hold %lld of its %lld elements, leaving a hole%s", k->name,
                 (long long)covered, (long long)total, where);
        return bad_meta(ck, msg, err);
    }
    return HT_OK;
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
    if (chunks->count > INT_MAX / 2) {
        snprintf(msg, sizeof(msg), "key %.200s: %zu chunks, more than a checkpoint can hold", e->key, chunks->count);
        return bad_meta(ck, msg, err);
    }
    k->chunks = calloc(chunks->count, sizeof(ck_chunk));
    if (!k->chunks) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    k->nchunks = (int)chunks->count;
    for (int j = 0; j < k->nchunks; j++) {
        const ht_json *c = &chunks->items[j], *file = ht_json_get(c, "file");
        ck_chunk *ch = &k->chunks[j];
        ch->file = file && file->type == HT_JSON_STRING ? ht_ckpt_find_file(ck, file->string) : -1;
        if (ch->file < 0 || !ck->files[ch->file].is_rank || !parse_box(c, k, &ch->box)) {
            snprintf(msg, sizeof(msg),
                     "key %.200s: chunk %d names no listed rank file or has no offsets/lengths (one per dim of the "
                     "shape) nor row_offset/rows",
                     e->key, j);
            return bad_meta(ck, msg, err);
        }
    }
    return check_tiling(ck, k, err);
}

/* Reads and checks metadata.json into ck (files listed, keys parsed; nothing opened). */
ht_status ht_ckpt_load_metadata(const char *dir, ht_checkpoint *ck, ht_error *err) {
    snprintf(ck->dir, sizeof(ck->dir), "%s", dir);
    size_t n = strlen(ck->dir);
    while (n > 1 && ck->dir[n - 1] == '/') ck->dir[--n] = '\0';
    if (ht_ckpt_ends_with(ck->dir, ".tmp"))
        return ht_fail(err, HT_ERR_INVALID, "%s: a .tmp directory is a save that did not finish: never loaded", dir);
    char path[HT_CKPT_PATH_MAX];
    ht_ckpt_join(path, sizeof(path), ck->dir, "metadata.json");
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
        cf->is_rank = strncmp(cf->name, "rank_", 5) == 0 && ht_ckpt_ends_with(cf->name, ".safetensors");
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
ht_status ht_ckpt_verify_file(const ht_checkpoint *ck, int i, ht_error *err) {
    const ck_file *f = &ck->files[i];
    char path[HT_CKPT_PATH_MAX], held[512];
    ht_ckpt_join(path, sizeof(path), ck->dir, f->name);
    keys_in_file(ck, i, held, sizeof(held));
    struct stat sb;
    if (stat(path, &sb) != 0) return ht_fail(err, HT_ERR_IO, "%s: missing (metadata.json lists it, %s)", path, held);
    if ((uint64_t)sb.st_size != f->size)
        return ht_fail(err, HT_ERR_FORMAT, "%s: %lld bytes, metadata.json says %" PRIu64 " (truncated or changed; %s)",
                       path, (long long)sb.st_size, f->size, held);
    uint64_t size, hash;
    ht_status s = ht_ckpt_hash_file(path, &size, &hash, err);
    if (s != HT_OK) return s;
    if (hash != f->hash)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: content hash xxh64 %016" PRIx64 ", metadata.json says %016" PRIx64 " (damaged; %s)", path,
                       hash, f->hash, held);
    return HT_OK;
}

/* Opens the rank files and binds every chunk to its tensor, checking dtype and shape. */
ht_status ht_ckpt_bind_chunks(ht_checkpoint *ck, ht_error *err) {
    char path[HT_CKPT_PATH_MAX];
    for (int i = 0; i < ck->nfiles; i++) {
        if (!ck->files[i].is_rank) continue;
        ht_ckpt_join(path, sizeof(path), ck->dir, ck->files[i].name);
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
            bool same = t->ndim == key->ndim;
            for (int d = 0; same && d < key->ndim; d++) same = t->shape[d] == c->box.length[d];
            if (!same) {
                char box[256];
                format_box(box, sizeof(box), key->ndim, &c->box);
                return ht_fail(err, HT_ERR_FORMAT,
                               "%s/%s: key %s: shape in the file does not match its chunk in metadata.json (%s)",
                               ck->dir, file, key->name, box);
            }
            c->t = t;
        }
    }
    return HT_OK;
}

ht_status ht_ckpt_open(const char *dir, ht_checkpoint **out, ht_error *err) {
    *out = NULL;
    ht_checkpoint *ck = calloc(1, sizeof(ht_checkpoint));
    if (!ck) return ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    ht_status s = ht_ckpt_load_metadata(dir, ck, err);
    for (int i = 0; s == HT_OK && i < ck->nfiles; i++) s = ht_ckpt_verify_file(ck, i, err);
    if (s == HT_OK) s = ht_ckpt_bind_chunks(ck, err);
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
int ht_ckpt_key_count(const ht_checkpoint *ck) { return ck->nkeys; }

const char *ht_ckpt_key(const ht_checkpoint *ck, int i, ht_dtype *dtype, int *ndim, int64_t *shape) {
    if (i < 0 || i >= ck->nkeys) return NULL;
    const ck_key *k = &ck->keys[i];
    if (dtype) *dtype = k->dtype;
    if (ndim) *ndim = k->ndim;
    if (shape) memcpy(shape, k->shape, (size_t)k->ndim * sizeof(int64_t));
    return k->name;
}

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
        long long step = ht_ckpt_step_of(e->d_name);
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
    ht_ckpt_join(path, sizeof(path), output_dir, "latest");
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
    } else if (ht_ckpt_step_of(text) < 0) {
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
