/* The safetensors format: a reader that maps a file and validates every
 * claim of its header before any tensor is handed out, and a writer that
 * streams borrowed tensors (converting dtype on the fly) into an atomic file. */
#include "hypertrain/ckpt.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

struct ht_safetensors {
    char *path;
    void *map;
    size_t size;
    ht_st_tensor *tensors; /* in offset order */
    int count;
    const ht_st_tensor **by_name; /* sorted by name */
    char **meta_keys, **meta_values;
    int meta_count;
};

/* A parsed header entry before the layout checks. */
typedef struct st_info {
    ht_st_tensor t;
    uint64_t begin, end;
} st_info;

static const char *supported_dtypes(void) { return "F32, BF16, F16, I32, I64, U16, U8"; }

/* A JSON number that is a non-negative integer exactly representable in a double. */
static bool json_uint(const ht_json *v, uint64_t *out) {
    if (!v || v->type != HT_JSON_NUMBER) return false;
    double x = v->number;
    if (!(x >= 0 && x <= 9007199254740992.0) || x != (double)(uint64_t)x) return false;
    *out = (uint64_t)x;
    return true;
}

static void format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = (size_t)snprintf(buf, cap, "[");
    for (int d = 0; d < ndim && n < cap; d++)
        n += (size_t)snprintf(buf + n, cap - n, d ? ", %lld" : "%lld", (long long)shape[d]);
    if (n < cap) snprintf(buf + n, cap - n, "]");
}

static ht_status parse_tensor(const char *path, const ht_json *e, st_info *info, ht_error *err) {
    const char *name = e->key;
    if (e->type != HT_JSON_OBJECT)
        return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s': header entry is not an object", path, name);
    const ht_json *dtype = ht_json_get(e, "dtype");
    const ht_json *shape = ht_json_get(e, "shape");
    const ht_json *offsets = ht_json_get(e, "data_offsets");
    if (!dtype || dtype->type != HT_JSON_STRING)
        return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s': \"dtype\" is missing or not a string", path, name);
    if (!ht_dtype_from_safetensors_name(dtype->string, &info->t.dtype))
        return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s': unknown dtype \"%s\" (supported: %s)", path, name,
                       dtype->string, supported_dtypes());
    if (!shape || shape->type != HT_JSON_ARRAY)
        return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s': \"shape\" is missing or not an array", path, name);
    if (shape->count > HT_ST_MAX_DIMS)
        return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s': %zu dimensions, more than the %d supported", path, name,
                       shape->count, HT_ST_MAX_DIMS);
    info->t.ndim = (int)shape->count;
    uint64_t numel = 1;
    bool overflow = false;
    for (size_t d = 0; d < shape->count; d++) {
        uint64_t dim;
        if (!json_uint(&shape->items[d], &dim))
            return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s': shape entry %zu is not a non-negative integer", path,
                           name, d);
        info->t.shape[d] = (int64_t)dim;
        if (dim && numel > UINT64_MAX / dim) overflow = true;
        numel *= dim;
    }
    if (!offsets || offsets->type != HT_JSON_ARRAY || offsets->count != 2 ||
        !json_uint(&offsets->items[0], &info->begin) || !json_uint(&offsets->items[1], &info->end))
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: tensor '%s': \"data_offsets\" must be [begin, end] with non-negative integers", path, name);
    if (info->end < info->begin)
        return ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s': data_offsets [%llu, %llu] end before they begin", path,
                       name, (unsigned long long)info->begin, (unsigned long long)info->end);
    size_t esize = ht_dtype_size(info->t.dtype);
    if (overflow || numel > UINT64_MAX / esize || numel * esize != info->end - info->begin) {
        char sh[256];
        format_shape(sh, sizeof(sh), info->t.ndim, info->t.shape);
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: tensor '%s': data_offsets [%llu, %llu] hold %llu bytes but shape %s of %s needs %s%llu",
                       path, name, (unsigned long long)info->begin, (unsigned long long)info->end,
                       (unsigned long long)(info->end - info->begin), sh, dtype->string, overflow ? "over " : "",
                       overflow ? (unsigned long long)UINT64_MAX : (unsigned long long)(numel * esize));
    }
    info->t.nbytes = (size_t)(info->end - info->begin);
    return HT_OK;
}

static int cmp_offsets(const void *a, const void *b) {
    const st_info *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

static int cmp_by_name(const void *a, const void *b) {
    return strcmp((*(const ht_st_tensor *const *)a)->name, (*(const ht_st_tensor *const *)b)->name);
}

/* The offsets must tile [0, data_size) exactly, in some order. */
static ht_status check_layout(const char *path, st_info *infos, int n, uint64_t data_size, ht_error *err) {
    qsort(infos, (size_t)n, sizeof(st_info), cmp_offsets);
    uint64_t at = 0;
    for (int i = 0; i < n; i++) {
        const st_info *t = &infos[i];
        if (t->begin < at)
            return ht_fail(err, HT_ERR_FORMAT,
                           "%s: tensor '%s' at data offsets [%llu, %llu] overlaps tensor '%s' that ends at %llu", path,
                           t->t.name, (unsigned long long)t->begin, (unsigned long long)t->end, infos[i - 1].t.name,
                           (unsigned long long)at);
        if (t->begin > at) {
            if (i == 0)
                return ht_fail(err, HT_ERR_FORMAT,
                               "%s: the first tensor '%s' starts at data offset %llu, not 0: data is not contiguous",
                               path, t->t.name, (unsigned long long)t->begin);
            return ht_fail(err, HT_ERR_FORMAT,
                           "%s: tensor '%s' starts at data offset %llu but tensor '%s' ends at %llu: data is not "
                           "contiguous (a gap of %llu bytes)",
                           path, t->t.name, (unsigned long long)t->begin, infos[i - 1].t.name, (unsigned long long)at,
                           (unsigned long long)(t->begin - at));
        }
        at = t->end;
    }
    if (at > data_size)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: tensor '%s' ends at data offset %llu beyond the %llu bytes of data in the file "
                       "(truncated file?)",
                       path, infos[n - 1].t.name, (unsigned long long)at, (unsigned long long)data_size);
    if (at < data_size)
        return ht_fail(err, HT_ERR_FORMAT,
                       "%s: the tensors cover %llu bytes of data but the file holds %llu: %llu trailing bytes", path,
                       (unsigned long long)at, (unsigned long long)data_size, (unsigned long long)(data_size - at));
    return HT_OK;
}

static ht_status parse_metadata(const char *path, const ht_json *m, ht_safetensors *st, ht_error *err) {
    if (m->type != HT_JSON_OBJECT)
        return ht_fail(err, HT_ERR_FORMAT, "%s: \"__metadata__\" is not an object of strings", path);
    st->meta_keys = calloc(m->count + 1, sizeof(char *));
    st->meta_values = calloc(m->count + 1, sizeof(char *));
    if (!st->meta_keys || !st->meta_values) return ht_fail(err, HT_ERR_OOM, "%s: out of memory for metadata", path);
    for (size_t i = 0; i < m->count; i++) {
        const ht_json *v = &m->items[i];
        if (v->type != HT_JSON_STRING)
            return ht_fail(err, HT_ERR_FORMAT, "%s: metadata value of \"%s\" is not a string", path, v->key);
        st->meta_keys[st->meta_count] = strdup(v->key);
        st->meta_values[st->meta_count] = strdup(v->string);
        st->meta_count++;
        if (!st->meta_keys[st->meta_count - 1] || !st->meta_values[st->meta_count - 1])
            return ht_fail(err, HT_ERR_OOM, "%s: out of memory for metadata", path);
    }
    return HT_OK;
}

/* Everything after the file is mapped: header, entries, layout. */
static ht_status parse_file(ht_safetensors *st, ht_error *err) {
    const char *path = st->path;
    const unsigned char *bytes = st->map;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = (n << 8) | bytes[i];
    if (n > HT_ST_MAX_HEADER)
        return ht_fail(err, HT_ERR_FORMAT, "%s: header length %llu exceeds the %u-byte limit (not a safetensors file?)",
                       path, (unsigned long long)n, HT_ST_MAX_HEADER);
    if (n > st->size - 8)
        return ht_fail(err, HT_ERR_FORMAT, "%s: header length %llu is larger than the %zu bytes after it (truncated?)",
                       path, (unsigned long long)n, st->size - 8);
    char what[1100];
    snprintf(what, sizeof(what), "%s header", path);
    ht_json *root = NULL;
    ht_status s = ht_json_parse((const char *)bytes + 8, (size_t)n, what, &root, err);
    if (s != HT_OK) return s;
    st_info *infos = NULL;
    if (root->type != HT_JSON_OBJECT) {
        s = ht_fail(err, HT_ERR_FORMAT, "%s: header is not a JSON object", path);
        goto done;
    }
    if (root->count > HT_ST_MAX_TENSORS) {
        s = ht_fail(err, HT_ERR_FORMAT,
                    "%s: the header lists %zu entries, more than the %d tensors a file may hold (HT_ST_MAX_TENSORS "
                    "in include/hypertrain/ckpt.h)",
                    path, root->count, HT_ST_MAX_TENSORS);
        goto done;
    }
    infos = calloc(root->count + 1, sizeof(st_info));
    if (!infos) {
        s = ht_fail(err, HT_ERR_OOM, "%s: out of memory for %zu header entries", path, root->count);
        goto done;
    }
    int count = 0;
    bool have_meta = false;
    for (size_t i = 0; i < root->count; i++) {
        const ht_json *e = &root->items[i];
        if (strcmp(e->key, "__metadata__") == 0) {
            if (have_meta) {
                s = ht_fail(err, HT_ERR_FORMAT, "%s: \"__metadata__\" appears twice", path);
                goto done;
            }
            have_meta = true;
            if ((s = parse_metadata(path, e, st, err)) != HT_OK) goto done;
            continue;
        }
        infos[count].t.name = e->key;
        if ((s = parse_tensor(path, e, &infos[count], err)) != HT_OK) goto done;
        count++;
    }
    uint64_t data_start = 8 + n;
    if ((s = check_layout(path, infos, count, st->size - data_start, err)) != HT_OK) goto done;

    st->tensors = calloc((size_t)count + 1, sizeof(ht_st_tensor));
    st->by_name = calloc((size_t)count + 1, sizeof(ht_st_tensor *));
    if (!st->tensors || !st->by_name) {
        s = ht_fail(err, HT_ERR_OOM, "%s: out of memory for %d tensors", path, count);
        goto done;
    }
    for (int i = 0; i < count; i++) {
        st->tensors[i] = infos[i].t;
        st->tensors[i].data = bytes + data_start + infos[i].begin;
        st->tensors[i].name = strdup(infos[i].t.name);
        st->by_name[i] = &st->tensors[i];
        st->count++;
        if (!st->tensors[i].name) {
            s = ht_fail(err, HT_ERR_OOM, "%s: out of memory for tensor names", path);
            goto done;
        }
    }
    qsort(st->by_name, (size_t)count, sizeof(ht_st_tensor *), cmp_by_name);
    for (int i = 1; i < count; i++) {
        const char *a = st->by_name[i - 1]->name, *b = st->by_name[i]->name;
        if (strcmp(a, b) == 0) {
            s = ht_fail(err, HT_ERR_FORMAT, "%s: tensor '%s' appears twice in the header", path, a);
            goto done;
        }
    }
done:
    free(infos);
    ht_json_free(root);
    return s;
}

ht_status ht_safetensors_open(const char *path, ht_safetensors **out, ht_error *err) {
    *out = NULL;
    ht_safetensors *st = calloc(1, sizeof(*st));
    if (!st || !(st->path = strdup(path))) {
        free(st);
        return ht_fail(err, HT_ERR_OOM, "%s: out of memory", path);
    }
    int fd;
    size_t size;
    ht_status s = ht_open_file(path, &fd, &size, err);
    if (s != HT_OK) {
        ht_safetensors_close(st);
        return s;
    }
    if (size < 8) {
        s = ht_fail(err, HT_ERR_FORMAT, "%s: file is %zu bytes, too short for the 8-byte header length (truncated?)",
                    path, size);
    } else {
        st->size = size;
        st->map = mmap(NULL, st->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (st->map == MAP_FAILED) {
            st->map = NULL;
            s = ht_fail(err, HT_ERR_IO, "%s: cannot map %zu bytes: %s", path, st->size, strerror(errno));
        }
    }
    close(fd);
    if (s == HT_OK) s = parse_file(st, err);
    if (s != HT_OK) {
        ht_safetensors_close(st);
        return s;
    }
    *out = st;
    return HT_OK;
}

void ht_safetensors_close(ht_safetensors *st) {
    if (!st) return;
    if (st->map) munmap(st->map, st->size);
    for (int i = 0; i < st->count; i++) free((char *)st->tensors[i].name);
    for (int i = 0; i < st->meta_count; i++) {
        free(st->meta_keys[i]);
        free(st->meta_values[i]);
    }
    free(st->meta_keys);
    free(st->meta_values);
    free(st->tensors);
    free(st->by_name);
    free(st->path);
    free(st);
}

const char *ht_safetensors_path(const ht_safetensors *st) { return st->path; }
int ht_safetensors_count(const ht_safetensors *st) { return st->count; }

const ht_st_tensor *ht_safetensors_tensor(const ht_safetensors *st, int i) {
    return i >= 0 && i < st->count ? &st->tensors[i] : NULL;
}

const ht_st_tensor *ht_safetensors_find(const ht_safetensors *st, const char *name) {
    int lo = 0, hi = st->count;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        const ht_st_tensor *t = st->by_name[mid];
        int c = strcmp(name, t->name);
        if (c == 0) return t;
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const char *ht_safetensors_metadata_get(const ht_safetensors *st, const char *key) {
    for (int i = 0; i < st->meta_count; i++)
        if (strcmp(st->meta_keys[i], key) == 0) return st->meta_values[i];
    return NULL;
}

/* ---------------------------------------------------------------- writer */

static size_t entry_bytes(const ht_st_entry *e) {
    size_t n = ht_dtype_size(e->dtype);
    for (int d = 0; d < e->ndim; d++) n *= (size_t)e->shape[d];
    return n;
}

static size_t entry_numel(const ht_st_entry *e) { return entry_bytes(e) / ht_dtype_size(e->dtype); }

ht_status ht_st_writer_add(ht_st_writer *w, const char *name, ht_dtype dtype, int ndim, const int64_t *shape,
                           const void *src, ht_dtype src_dtype, ht_error *err) {
    return ht_st_writer_add_from(w, name, dtype, ndim, shape, src, src_dtype, NULL, err);
}

ht_status ht_st_writer_add_from(ht_st_writer *w, const char *name, ht_dtype dtype, int ndim, const int64_t *shape,
                                const void *src, ht_dtype src_dtype, const ht_param_store *memory, ht_error *err) {
    if (dtype >= HT_DTYPE_COUNT || src_dtype >= HT_DTYPE_COUNT)
        return ht_fail(err, HT_ERR_INVALID, "safetensors writer: tensor '%s': invalid dtype", name);
    if (dtype != src_dtype && !(ht_dtype_is_float(dtype) && ht_dtype_is_float(src_dtype)))
        return ht_fail(err, HT_ERR_INVALID, "safetensors writer: tensor '%s': cannot convert %s to %s", name,
                       ht_dtype_name(src_dtype), ht_dtype_name(dtype));
    if (ndim < 0 || ndim > HT_ST_MAX_DIMS)
        return ht_fail(err, HT_ERR_INVALID, "safetensors writer: tensor '%s': %d dimensions (0 to %d supported)", name,
                       ndim, HT_ST_MAX_DIMS);
    if (strcmp(name, "__metadata__") == 0 || name[0] == '\0')
        return ht_fail(err, HT_ERR_INVALID, "safetensors writer: '%s' cannot name a tensor", name);
    uint64_t bytes = ht_dtype_size(dtype);
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return ht_fail(err, HT_ERR_INVALID, "safetensors writer: tensor '%s': negative dimension %lld", name,
                           (long long)shape[d]);
        if (shape[d] && bytes > (uint64_t)SIZE_MAX / (uint64_t)shape[d])
            return ht_fail(err, HT_ERR_INVALID, "safetensors writer: tensor '%s' is too large", name);
        bytes *= (uint64_t)shape[d];
    }
    if (bytes && !src) return ht_fail(err, HT_ERR_INVALID, "safetensors writer: tensor '%s' has no data", name);
    if (w->count == w->capacity) {
        int cap = w->capacity ? 2 * w->capacity : 16;
        ht_st_entry *e = realloc(w->entries, (size_t)cap * sizeof(ht_st_entry));
        if (!e) return ht_fail(err, HT_ERR_OOM, "safetensors writer: out of memory for %d entries", cap);
        w->entries = e;
        w->capacity = cap;
    }
    ht_st_entry *e = &w->entries[w->count];
    memset(e, 0, sizeof(*e));
    if (!(e->name = strdup(name))) return ht_fail(err, HT_ERR_OOM, "safetensors writer: out of memory");
    e->dtype = dtype;
    e->ndim = ndim;
    for (int d = 0; d < ndim; d++) e->shape[d] = shape[d];
    e->src = src;
    e->src_dtype = src_dtype;
    e->memory = memory && !ht_params_host_memory(memory) ? memory : NULL;
    w->count++;
    return HT_OK;
}

ht_status ht_st_writer_add_metadata(ht_st_writer *w, const char *key, const char *value, ht_error *err) {
    if (w->meta_count == w->meta_capacity) {
        int cap = w->meta_capacity ? 2 * w->meta_capacity : 8;
        char **k = realloc(w->meta_keys, (size_t)cap * sizeof(char *));
        if (k) w->meta_keys = k;
        char **v = realloc(w->meta_values, (size_t)cap * sizeof(char *));
        if (v) w->meta_values = v;
        if (!k || !v) return ht_fail(err, HT_ERR_OOM, "safetensors writer: out of memory for metadata");
        w->meta_capacity = cap;
    }
    char *k = strdup(key), *v = strdup(value);
    if (!k || !v) {
        free(k);
        free(v);
        return ht_fail(err, HT_ERR_OOM, "safetensors writer: out of memory for metadata");
    }
    w->meta_keys[w->meta_count] = k;
    w->meta_values[w->meta_count] = v;
    w->meta_count++;
    return HT_OK;
}

size_t ht_st_writer_data_bytes(const ht_st_writer *w) {
    size_t n = 0;
    for (int i = 0; i < w->count; i++) n += entry_bytes(&w->entries[i]);
    return n;
}

void ht_st_writer_free(ht_st_writer *w) {
    for (int i = 0; i < w->count; i++) free(w->entries[i].name);
    for (int i = 0; i < w->meta_count; i++) {
        free(w->meta_keys[i]);
        free(w->meta_values[i]);
    }
    free(w->entries);
    free(w->meta_keys);
    free(w->meta_values);
    memset(w, 0, sizeof(*w));
}

/* Largest elements first keeps every tensor aligned to its element size. */
static int cmp_layout(const void *a, const void *b) {
    const ht_st_entry *x = *(const ht_st_entry *const *)a, *y = *(const ht_st_entry *const *)b;
    size_t sx = ht_dtype_size(x->dtype), sy = ht_dtype_size(y->dtype);
    if (sx != sy) return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int cmp_by_entry_name(const void *a, const void *b) {
    return strcmp((*(const ht_st_entry *const *)a)->name, (*(const ht_st_entry *const *)b)->name);
}

/* The header JSON, padded with spaces to a multiple of 8 bytes. */
static ht_status build_header(const ht_st_writer *w, const ht_st_entry *const *order, char **out, size_t *out_len,
                              const char *path, ht_error *err) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (!f) return ht_fail(err, HT_ERR_OOM, "%s: cannot build the header: %s", path, strerror(errno));
    fputc('{', f);
    bool first = true;
    if (w->meta_count) {
        fputs("\"__metadata__\":{", f);
        for (int i = 0; i < w->meta_count; i++) {
            if (i) fputc(',', f);
            ht_json_write_string(f, w->meta_keys[i]);
            fputc(':', f);
            ht_json_write_string(f, w->meta_values[i]);
        }
        fputc('}', f);
        first = false;
    }
    size_t offset = 0;
    for (int i = 0; i < w->count; i++) {
        const ht_st_entry *e = order[i];
        size_t nbytes = entry_bytes(e);
        if (!first) fputc(',', f);
        first = false;
        ht_json_write_string(f, e->name);
        fprintf(f, ":{\"dtype\":\"%s\",\"shape\":[", ht_dtype_safetensors_name(e->dtype));
        for (int d = 0; d < e->ndim; d++) fprintf(f, d ? ",%lld" : "%lld", (long long)e->shape[d]);
        fprintf(f, "],\"data_offsets\":[%zu,%zu]}", offset, offset + nbytes);
        offset += nbytes;
    }
    fputc('}', f);
    while (ftell(f) % 8) fputc(' ', f);
    if (fclose(f) != 0 || !buf) {
        free(buf);
        return ht_fail(err, HT_ERR_OOM, "%s: cannot build the header", path);
    }
    *out = buf;
    *out_len = len;
    return HT_OK;
}

ht_status ht_st_writer_add_main(ht_st_writer *w, const char *name, int ndim, const int64_t *shape, const ht_param *p,
                                ht_error *err) {
    ht_status s = ht_st_writer_add_from(w, name, HT_DTYPE_F32, ndim, shape, p->data, HT_DTYPE_F32, NULL, err);
    if (s == HT_OK) w->entries[w->count - 1].main_of = p;
    return s;
}

/* Streams one entry, converting in bounded chunks when the dtypes differ;
 * one in a store's memory that the host cannot read is downloaded into
 * `stage` (chunk_elems elements of any dtype) a chunk at a time. */
static bool write_entry(FILE *f, const ht_st_entry *e, void *chunk, void *stage, size_t chunk_elems) {
    size_t n = entry_numel(e);
    if (n == 0) return true;
    if (e->main_of) { /* FP32, each block rebuilt into `chunk` (chunk_elems floats) */
        for (size_t i = 0; i < n; i += chunk_elems) {
            size_t k = n - i < chunk_elems ? n - i : chunk_elems;
            ht_param_main_read(e->main_of, (int64_t)i, (int64_t)k, chunk);
            if (fwrite(chunk, sizeof(float), k, f) != k) return false;
        }
        return true;
    }
    if (e->dtype == e->src_dtype && !e->memory) return fwrite(e->src, ht_dtype_size(e->dtype), n, f) == n;
    const char *src = e->src;
    size_t ssize = ht_dtype_size(e->src_dtype), dsize = ht_dtype_size(e->dtype);
    for (size_t i = 0; i < n; i += chunk_elems) {
        size_t k = n - i < chunk_elems ? n - i : chunk_elems;
        const void *from = src + i * ssize;
        if (e->memory) {
            ht_params_download(e->memory, stage, from, k * ssize);
            from = stage;
        }
        const void *out = from;
        if (e->dtype != e->src_dtype) {
            ht_convert(chunk, e->dtype, from, e->src_dtype, k);
            out = chunk;
        }
        if (fwrite(out, dsize, k, f) != k) return false;
    }
    return true;
}

static void fsync_parent_dir(const char *path) {
    char dir[4096];
    const char *slash = strrchr(path, '/');
    if (!slash)
        snprintf(dir, sizeof(dir), ".");
    else if (slash == path)
        snprintf(dir, sizeof(dir), "/");
    else
        snprintf(dir, sizeof(dir), "%.*s", (int)(slash - path), path);
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd); /* best effort: some file systems refuse to sync a directory */
        close(fd);
    }
}

ht_status ht_st_writer_write(const ht_st_writer *w, const char *path, ht_error *err) {
    const ht_st_entry **order = malloc(((size_t)w->count + 1) * sizeof(ht_st_entry *));
    if (!order) return ht_fail(err, HT_ERR_OOM, "%s: out of memory", path);
    for (int i = 0; i < w->count; i++) order[i] = &w->entries[i];
    qsort(order, (size_t)w->count, sizeof(ht_st_entry *), cmp_by_entry_name);
    for (int i = 1; i < w->count; i++)
        if (strcmp(order[i - 1]->name, order[i]->name) == 0) {
            ht_status s = ht_fail(err, HT_ERR_INVALID, "%s: tensor '%s' added twice", path, order[i]->name);
            free(order);
            return s;
        }
    qsort(order, (size_t)w->count, sizeof(ht_st_entry *), cmp_layout);
    char *header = NULL;
    size_t header_len = 0;
    ht_status s = build_header(w, order, &header, &header_len, path, err);
    if (s != HT_OK) {
        free(order);
        return s;
    }

    char tmp[4200];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof(tmp)) {
        s = ht_fail(err, HT_ERR_INVALID, "%.200s...: path too long", path);
        free(header);
        free(order);
        return s;
    }
    size_t chunk_elems = (size_t)1 << 18;
    void *chunk = malloc(chunk_elems * 4), *stage = malloc(chunk_elems * 8);
    FILE *f = chunk && stage ? fopen(tmp, "wb") : NULL;
    if (!f) {
        s = chunk && stage ? ht_fail(err, HT_ERR_IO, "%s: cannot create: %s", tmp, strerror(errno))
                           : ht_fail(err, HT_ERR_OOM, "%s: out of memory", path);
        goto done;
    }
    unsigned char len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (unsigned char)((uint64_t)header_len >> (8 * i));
    bool ok = fwrite(len8, 1, 8, f) == 8 && fwrite(header, 1, header_len, f) == header_len;
    for (int i = 0; ok && i < w->count; i++) ok = write_entry(f, order[i], chunk, stage, chunk_elems);
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    int saved = errno;
    if (fclose(f) != 0 && ok) {
        ok = false;
        saved = errno;
    }
    if (!ok) {
        s = ht_fail(err, HT_ERR_IO, "%s: write failed: %s", tmp, strerror(saved));
        remove(tmp);
        goto done;
    }
    if (rename(tmp, path) != 0) {
        s = ht_fail(err, HT_ERR_IO, "%s: cannot rename %s into place: %s", path, tmp, strerror(errno));
        remove(tmp);
        goto done;
    }
    fsync_parent_dir(path);
done:
    free(chunk);
    free(stage);
    free(header);
    free(order);
    return s;
}
