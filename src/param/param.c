/* The named parameter store: declaration, one-block allocation, dtype
 * conversion that keeps each ht_param in place, and the FP32 masters. */
#include "hypertrain/param.h"
#include "hypertrain/kernels.h" /* the table type: the store allocates and converts through its memory entries */

#include <limits.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

int64_t ht_param_row_numel(const ht_param *p) {
    int64_t n = 1;
    for (int d = 1; d < p->ndim; d++) n *= p->shape[d];
    return n;
}

int64_t ht_param_numel(const ht_param *p) { return p->ndim == 0 ? 1 : p->shape[0] * ht_param_row_numel(p); }

int64_t ht_param_global_numel(const ht_param *p) {
    int64_t n = 1;
    for (int d = 0; d < p->ndim; d++) n *= p->global_shape[d];
    return n;
}

int64_t ht_param_local_numel(const ht_param *p) { return ht_box_numel(p->ndim, &p->box); }

int64_t ht_params_total_numel(const ht_param_store *store) {
    int64_t n = 0;
    for (int i = 0; i < store->count; i++) n += ht_param_numel(&store->items[i]);
    return n;
}

static size_t name_hash(const char *name) { return (size_t)ht_fnv1a64(name, strlen(name), HT_FNV64_INIT); }

/* Puts items[i] in its slot; a name already there keeps the first param of it. */
static void slot_insert(ht_param_store *store, int i) {
    size_t mask = store->slot_count - 1;
    for (size_t k = name_hash(store->items[i].name) & mask;; k = (k + 1) & mask) {
        int at = store->slots[k];
        if (at == 0) {
            store->slots[k] = i + 1;
            return;
        }
        if (strcmp(store->items[at - 1].name, store->items[i].name) == 0) return;
    }
}

/* Room in the hash table for one more name: twice as many slots when half full. */
static bool slots_reserve(ht_param_store *store) {
    if ((size_t)(store->count + 1) * 2 <= store->slot_count) return true;
    size_t n = store->slot_count ? 2 * store->slot_count : 128;
    int *slots = calloc(n, sizeof(int));
    if (!slots) return false;
    free(store->slots);
    store->slots = slots;
    store->slot_count = n;
    for (int i = 0; i < store->count; i++) slot_insert(store, i);
    return true;
}

ht_param *ht_params_add(ht_param_store *store, const char *name, int ndim, const int64_t *shape, ht_dtype dtype) {
    if (ndim < 1 || ndim > HT_PARAM_MAX_DIMS || strlen(name) >= HT_PARAM_NAME_MAX) return NULL;
    if (store->count == INT_MAX || !slots_reserve(store)) return NULL;
    if (store->count == store->capacity) {
        int cap = store->capacity ? (store->capacity > INT_MAX / 2 ? INT_MAX : 2 * store->capacity) : 64;
        ht_param *items = realloc(store->items, (size_t)cap * sizeof(ht_param));
        if (!items) return NULL;
        store->items = items;
        store->capacity = cap;
    }
    ht_param *p = &store->items[store->count++];
    memset(p, 0, sizeof(*p));
    strcpy(p->name, name);
    p->ndim = ndim;
    for (int d = 0; d < ndim; d++) p->shape[d] = p->global_shape[d] = shape[d];
    p->tp_dim = -1;
    p->dtype = dtype;
    ht_param_set_rows(p, 0, shape[0]);
    p->trainable = true;
    slot_insert(store, store->count - 1);
    return p;
}

/* One dotted component of a pattern against one of a path: its lengths. */
static bool component_matches(const char *pattern, size_t pl, const char *name, size_t nl) {
    bool wild = (pl == 3 && strncmp(pattern, "{*}", 3) == 0) || (pl == 1 && pattern[0] == '*');
    return wild || (pl == nl && strncmp(pattern, name, pl) == 0);
}

/* Whether the pattern matches the whole of `name` (prefix false) or a
 * dotted prefix of it (prefix true). */
static bool path_matches(const char *pattern, const char *name, bool prefix) {
    for (;;) {
        const char *pe = strchr(pattern, '.'), *ne = strchr(name, '.');
        size_t pl = pe ? (size_t)(pe - pattern) : strlen(pattern), nl = ne ? (size_t)(ne - name) : strlen(name);
        if (!component_matches(pattern, pl, name, nl)) return false;
        if (!pe) return !ne || prefix;
        if (!ne) return false;
        pattern = pe + 1;
        name = ne + 1;
    }
}

bool ht_path_match(const char *pattern, const char *path) { return path_matches(pattern, path, false); }

bool ht_path_covers(const char *pattern, const char *name) { return path_matches(pattern, name, true); }

void ht_params_retain(ht_param_store *store, const bool *keep) {
    int n = 0;
    for (int i = 0; i < store->count; i++)
        if (keep[i]) store->items[n++] = store->items[i];
    store->count = n;
    memset(store->slots, 0, store->slot_count * sizeof(int));
    for (int i = 0; i < n; i++) slot_insert(store, i);
}

ht_param *ht_params_find(const ht_param_store *store, const char *name) {
    if (store->slot_count == 0) return NULL;
    size_t mask = store->slot_count - 1;
    for (size_t k = name_hash(name) & mask; store->slots[k]; k = (k + 1) & mask)
        if (strcmp(store->items[store->slots[k] - 1].name, name) == 0) return &store->items[store->slots[k] - 1];
    return NULL;
}

/* grad and compute as a param with no compute copy has them: its own
 * storage when it is whole, nothing (until parallel/ gathers) when sharded. */
static void reset_views(ht_param *p) {
    p->grad = p->sharded ? NULL : p->main_grad;
    p->compute = p->sharded ? NULL : p->data;
    p->compute_rows = p->data;
    p->compute_dtype = p->dtype;
    p->compute_precision = p->dtype;
}

/* ------------------------------------------------------------------ storage */

/* Storage lives in the memory of store->memory (a kernel table), or the
 * host's when it is NULL: every byte of it is reached through these. */
static void *mem_alloc(const ht_param_store *s, size_t bytes) {
    return s->memory ? s->memory->alloc(bytes ? bytes : 1) : ht_alloc(bytes);
}
static void mem_free(const ht_param_store *s, void *p) {
    if (s->memory)
        s->memory->free(p);
    else
        ht_free(p);
}
static void mem_convert(const ht_param_store *s, void *dst, ht_dtype dd, const void *src, ht_dtype sd, size_t n) {
    if (s->memory)
        s->memory->convert(dst, dd, src, sd, n);
    else
        ht_convert(dst, dd, src, sd, n);
}

void ht_params_upload(const ht_param_store *s, void *dst, const void *host, size_t bytes) {
    if (!bytes) return;
    if (s->memory)
        s->memory->upload(dst, host, bytes);
    else
        memcpy(dst, host, bytes);
}

void ht_params_download(const ht_param_store *s, void *host, const void *src, size_t bytes) {
    if (!bytes) return;
    if (s->memory)
        s->memory->download(host, src, bytes);
    else
        memcpy(host, src, bytes);
}

bool ht_params_host_memory(const ht_param_store *s) { return !s->memory || s->memory->host_memory; }

void ht_params_zero(const ht_param_store *s, void *dst, size_t bytes) {
    if (!bytes) return;
    if (s->memory)
        s->memory->zero(dst, bytes);
    else
        memset(dst, 0, bytes);
}

void ht_params_convert_into(const ht_param_store *s, void *dst, ht_dtype dst_dtype, const void *src, ht_dtype src_dtype,
                            size_t n) {
    mem_convert(s, dst, dst_dtype, src, src_dtype, n);
}

void ht_params_set_rows(ht_param_store *store, int rank, int world) {
    store->shard_rank = rank;
    store->shard_world = world;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        int64_t r0, r1;
        ht_param_rows_of(p->shape[0], rank, world, &r0, &r1);
        ht_param_set_rows(p, r0, r1);
        p->sharded = world > 1;
    }
}

/* The bytes each block gives a param: the one formula ht_params_plan and
 * the allocations below share, so a plan made before storage exists is
 * what storage then takes. */
static size_t data_size(const ht_param *p) {
    return ht_align64((size_t)ht_param_local_numel(p) * ht_dtype_size(p->dtype));
}
static size_t grad_size(const ht_param *p) {
    return p->trainable ? ht_align64((size_t)ht_param_local_numel(p) * sizeof(float)) : 0;
}
static size_t main_size(const ht_param *p, ht_main_storage storage) {
    if (!p->trainable || p->dtype == HT_DTYPE_F32 || storage == HT_MAIN_NONE) return 0;
    size_t per = storage == HT_MAIN_RESIDUAL16 ? sizeof(uint16_t) : sizeof(float);
    return ht_align64((size_t)ht_param_local_numel(p) * per);
}
/* Whether a param of this dtype can be read in place as (dtype, precision). */
static bool reads_in_place(ht_dtype have, ht_dtype dtype, ht_dtype precision) {
    return have == dtype && (precision == dtype || precision == HT_DTYPE_F32);
}
/* A copy where the param cannot be read in place: the whole tensor, or
 * for a sharded param its rows (parallel/ gathers the whole one when used). */
static bool needs_compute_copy(const ht_param *p, ht_dtype dtype, ht_dtype precision) {
    return ht_dtype_is_float(p->dtype) && !p->keep_fp32 && !reads_in_place(p->dtype, dtype, precision);
}
static size_t compute_size(const ht_param *p, ht_dtype dtype, ht_dtype precision) {
    return needs_compute_copy(p, dtype, precision) ? ht_align64((size_t)ht_param_local_numel(p) * ht_dtype_size(dtype))
                                                   : 0;
}

ht_dtype ht_param_compute_dtype_for(const ht_param *p, ht_dtype dtype, ht_dtype precision) {
    return needs_compute_copy(p, dtype, precision) ? dtype : p->dtype;
}

ht_params_bytes ht_params_plan(const ht_param_store *store, ht_main_storage main, ht_dtype compute,
                               ht_dtype precision) {
    ht_params_bytes b = {0};
    for (int i = 0; i < store->count; i++) {
        const ht_param *p = &store->items[i];
        b.data += data_size(p);
        b.grad += grad_size(p);
        b.main += main_size(p, main);
        b.compute += compute_size(p, compute, precision);
    }
    return b;
}

ht_status ht_params_allocate(ht_param_store *store, ht_error *err) {
    size_t data_bytes = 0, grad_bytes = 0;
    for (int i = 0; i < store->count; i++) {
        data_bytes += data_size(&store->items[i]);
        grad_bytes += grad_size(&store->items[i]);
    }
    char *data = mem_alloc(store, data_bytes);
    char *grad = mem_alloc(store, grad_bytes);
    if (!data || !grad) {
        mem_free(store, data);
        mem_free(store, grad);
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes of parameters and %zu of gradients", data_bytes,
                       grad_bytes);
    }
    size_t doff = 0, goff = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        p->data = data + doff;
        doff += data_size(p);
        p->main_grad = p->trainable ? (float *)(grad + goff) : NULL;
        goff += grad_size(p);
        p->main_param = p->dtype == HT_DTYPE_F32 ? p->data : NULL;
        reset_views(p);
    }
    store->data_block = data;
    store->grad_block = (float *)grad;
    store->data_bytes = data_bytes;
    store->grad_bytes = grad_bytes;
    return HT_OK;
}

ht_status ht_params_convert(ht_param_store *store, ht_dtype dtype, ht_error *err) {
    if (!ht_dtype_is_float(dtype))
        return ht_fail(err, HT_ERR_INVALID, "cannot convert parameters to non-float dtype %s", ht_dtype_name(dtype));
    if (!store->data_block) { /* declared only: the storage to come is of the new dtype */
        for (int i = 0; i < store->count; i++) {
            ht_param *p = &store->items[i];
            if (ht_dtype_is_float(p->dtype) && !p->keep_fp32) p->dtype = dtype;
        }
        return HT_OK;
    }
    for (int i = 0; i < store->count; i++)
        if (store->items[i].main_low)
            return ht_fail(err, HT_ERR_INVALID,
                           "cannot convert parameters to %s: %s holds its FP32 main param as residual16 low bits of "
                           "its bfloat16 weight (convert before the main params exist)",
                           ht_dtype_name(dtype), store->items[i].name);
    size_t bytes = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        ht_dtype to = ht_dtype_is_float(p->dtype) && !p->keep_fp32 ? dtype : p->dtype;
        bytes += ht_align64((size_t)ht_param_local_numel(p) * ht_dtype_size(to));
    }
    char *block = mem_alloc(store, bytes);
    if (!block)
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes to convert parameters to %s", bytes,
                       ht_dtype_name(dtype));
    size_t off = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        ht_dtype to = ht_dtype_is_float(p->dtype) && !p->keep_fp32 ? dtype : p->dtype;
        size_t n = (size_t)ht_param_local_numel(p);
        mem_convert(store, block + off, to, p->data, p->dtype, n);
        bool main_was_data = p->main_param == p->data;
        p->data = block + off;
        p->dtype = to;
        off += ht_align64(n * ht_dtype_size(to));
        if (main_was_data) p->main_param = to == HT_DTYPE_F32 ? p->data : NULL;
        reset_views(p); /* a conversion resets the compute view: ht_params_set_compute again if needed */
    }
    mem_free(store, store->data_block);
    mem_free(store, store->compute_block);
    store->compute_block = NULL;
    store->compute_bytes = 0;
    store->data_block = block;
    store->data_bytes = bytes;
    return HT_OK;
}

ht_status ht_params_set_compute(ht_param_store *store, ht_dtype dtype, ht_dtype precision, ht_error *err) {
    if (!ht_dtype_is_float(dtype) || !ht_dtype_is_float(precision))
        return ht_fail(err, HT_ERR_INVALID, "the compute dtype must be a float dtype, not %s / %s",
                       ht_dtype_name(dtype), ht_dtype_name(precision));
    if (dtype != precision && dtype != HT_DTYPE_F32)
        return ht_fail(err, HT_ERR_INVALID, "%s values cannot be held in %s", ht_dtype_name(precision),
                       ht_dtype_name(dtype));
    size_t bytes = 0;
    for (int i = 0; i < store->count; i++) bytes += compute_size(&store->items[i], dtype, precision);
    char *block = bytes ? mem_alloc(store, bytes) : NULL;
    if (bytes && !block)
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes of %s compute weights", bytes, ht_dtype_name(dtype));
    mem_free(store, store->compute_block);
    store->compute_block = block;
    store->compute_bytes = bytes;
    size_t off = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        reset_views(p);
        if (!needs_compute_copy(p, dtype, precision)) continue;
        p->compute_rows = block + off;
        if (!p->sharded) p->compute = p->compute_rows;
        p->compute_dtype = dtype;
        p->compute_precision = precision;
        off += compute_size(p, dtype, precision);
    }
    ht_params_refresh_compute(store);
    return HT_OK;
}

void ht_params_refresh_compute(ht_param_store *store) {
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        if (p->compute_rows == p->data) continue;
        size_t n = (size_t)ht_param_local_numel(p);
        mem_convert(store, p->compute_rows, p->compute_dtype, p->data, p->dtype, n);
        if (p->compute_dtype == HT_DTYPE_F32) {
            if (store->memory)
                store->memory->round_to((float *)p->compute_rows, n, p->compute_precision);
            else
                ht_round_to((float *)p->compute_rows, n, p->compute_precision);
        }
    }
}

void ht_param_reload_main(const ht_param_store *store, ht_param *p) {
    if (p->main_low) { /* the weight's own value: no low bits, no ties */
        memset(p->main_low, 0, (size_t)ht_param_local_numel(p) * sizeof(uint16_t));
        p->main_tie_count = 0;
    } else if (p->main_param && (void *)p->main_param != p->data) {
        mem_convert(store, p->main_param, HT_DTYPE_F32, p->data, p->dtype, (size_t)ht_param_local_numel(p));
    }
}

void ht_params_reload_main(ht_param_store *store) {
    for (int i = 0; i < store->count; i++) ht_param_reload_main(store, &store->items[i]);
}

static void drop_ties(ht_param *p) {
    free(p->main_ties);
    p->main_ties = NULL;
    p->main_tie_count = p->main_tie_capacity = 0;
}

ht_status ht_params_create_main(ht_param_store *store, ht_main_storage storage, ht_error *err) {
    if (storage == HT_MAIN_NONE) {
        ht_params_drop_main(store);
        return HT_OK;
    }
    const bool residual = storage == HT_MAIN_RESIDUAL16;
    for (int i = 0; residual && i < store->count; i++) {
        const ht_param *p = &store->items[i];
        if (!ht_params_host_memory(store))
            return ht_fail(err, HT_ERR_CONFIG,
                           "optimizer.main_param_storage: residual16 keeps the main params in host memory; this "
                           "run's parameters are a device's (kernels.backend): use main_param_storage: fp32");
        if (p->trainable && p->dtype != HT_DTYPE_F32 && p->dtype != HT_DTYPE_BF16)
            return ht_fail(err, HT_ERR_CONFIG,
                           "optimizer.main_param_storage: residual16 holds the low 16 bits of bfloat16 weights, and "
                           "%s is %s (a float16 value is not the high half of its FP32 value): use "
                           "main_param_storage: fp32",
                           p->name, ht_dtype_name(p->dtype));
    }
    ht_params_drop_main(store);
    size_t bytes = 0;
    for (int i = 0; i < store->count; i++) bytes += main_size(&store->items[i], storage);
    char *block = bytes ? mem_alloc(store, bytes) : NULL;
    if (bytes && !block)
        return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes of FP32 main params%s", bytes,
                       residual ? " (their residual16 low halves)" : "");
    size_t off = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        if (!p->trainable) continue;
        if (p->dtype == HT_DTYPE_F32) {
            p->main_param = p->data;
            continue;
        }
        size_t n = (size_t)ht_param_local_numel(p);
        if (residual) { /* the weight's own value: all low bits zero */
            p->main_low = (uint16_t *)(block + off);
            memset(p->main_low, 0, n * sizeof(uint16_t));
        } else {
            p->main_param = (float *)(block + off);
            mem_convert(store, p->main_param, HT_DTYPE_F32, p->data, p->dtype, n);
        }
        off += main_size(p, storage);
    }
    store->main_block = block;
    store->main_bytes = bytes;
    return HT_OK;
}

void ht_params_drop_main(ht_param_store *store) {
    mem_free(store, store->main_block);
    store->main_block = NULL;
    store->main_bytes = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        p->main_param = p->dtype == HT_DTYPE_F32 ? p->data : NULL;
        p->main_low = NULL;
        drop_ties(p);
    }
}

/* ------------------------------------------------------------------ residual16 */

/* A tie rounded up: low half exactly 0x8000 under an odd high half, which
 * rounding to nearest even carried into the weight. */
static inline bool tie_rounded_up(uint32_t bits) { return (bits & 0x1ffffu) == 0x18000u; }

/* The first listed tie at or after element i. */
static int64_t first_tie(const ht_param *p, int64_t i) {
    int64_t lo = 0, hi = p->main_tie_count;
    while (lo < hi) {
        int64_t mid = lo + (hi - lo) / 2;
        if (p->main_ties[mid] < i)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

void ht_param_main_read(const ht_param *p, int64_t first, int64_t n, float *x) {
    if (p->main_low) {
        const uint16_t *w = (const uint16_t *)p->data + first, *low = p->main_low + first;
        uint32_t *bits = (uint32_t *)x;
#pragma omp parallel for schedule(static) if (n >= 65536)
        for (int64_t i = 0; i < n; i++)
            bits[i] = (uint32_t)(w[i] - (low[i] > 0x8000u)) << 16 | low[i]; /* a tie: data's own high half */
        for (int64_t t = first_tie(p, first); t < p->main_tie_count && p->main_ties[t] < first + n; t++) {
            int64_t i = p->main_ties[t] - first;
            bits[i] = (uint32_t)(w[i] - 1u) << 16 | 0x8000u;
        }
    } else if (p->main_param) {
        memcpy(x, p->main_param + first, (size_t)n * sizeof(float));
    } else {
        ht_convert(x, HT_DTYPE_F32, (const char *)p->data + (size_t)first * ht_dtype_size(p->dtype), p->dtype,
                   (size_t)n);
    }
}

/* Element indices in order, grown as they come (ties are rare: most lists
 * stay empty and allocate nothing). */
typedef struct tie_list {
    int64_t *at;
    int64_t count, capacity;
} tie_list;

static void grow_to(int64_t **at, int64_t *capacity, int64_t count, const char *name) {
    if (count <= *capacity) return;
    int64_t cap = count > 2 * *capacity ? count : 2 * *capacity;
    int64_t *grown = realloc(*at, (size_t)cap * sizeof(int64_t));
    if (!grown) {
        ht_log(HT_LOG_ERROR, "out of memory listing %lld residual16 ties of %s", (long long)count, name);
        abort();
    }
    *at = grown;
    *capacity = cap;
}

/* Data (rounded to nearest even) and low halves of elements [first,
 * first + n) from x; the ties rounded up appended to l. */
static void write_halves(ht_param *p, int64_t first, int64_t n, const float *x, tie_list *l) {
    uint16_t *w = (uint16_t *)p->data + first, *low = p->main_low + first;
    const uint32_t *bits = (const uint32_t *)x;
    int64_t ties = 0;
    for (int64_t i = 0; i < n; i++) {
        w[i] = ht_f32_to_bf16(x[i]);
        low[i] = (uint16_t)bits[i];
        ties += tie_rounded_up(bits[i]);
    }
    if (!ties) return;
    grow_to(&l->at, &l->capacity, l->count + ties, p->name);
    for (int64_t i = 0; i < n; i++)
        if (tie_rounded_up(bits[i])) l->at[l->count++] = first + i;
}

/* The param's listed ties in [first, first + n) give way to those of
 * lists[0..count), which are in order and inside that range. */
static void replace_ties(ht_param *p, int64_t first, int64_t n, const tie_list *lists, int count) {
    int64_t ties = 0;
    for (int k = 0; k < count; k++) ties += lists[k].count;
    int64_t a = first_tie(p, first), e = first_tie(p, first + n);
    if (ties == 0 && a == e) return;
    int64_t total = p->main_tie_count - (e - a) + ties;
    grow_to(&p->main_ties, &p->main_tie_capacity, total, p->name);
    memmove(p->main_ties + a + ties, p->main_ties + e, (size_t)(p->main_tie_count - e) * sizeof(int64_t));
    for (int k = 0, at = 0; k < count; k++) {
        memcpy(p->main_ties + a + at, lists[k].at, (size_t)lists[k].count * sizeof(int64_t));
        at += (int)lists[k].count;
    }
    p->main_tie_count = total;
}

/* A thread's block of a main-param pass: 32 KiB on its stack, in the core's
 * L1 between the read, the update and the write. */
#define MAIN_PASS_BLOCK 8192

void ht_param_main_pass(ht_param *p, int64_t first, int64_t n, ht_main_fn *fn, void *ctx) {
    if (n <= 0) return;
    const int threads = n >= 65536 ? omp_get_max_threads() : 1;
    tie_list *lists = calloc((size_t)threads, sizeof(tie_list));
    if (!lists) {
        ht_log(HT_LOG_ERROR, "out of memory for %d tie lists of %s", threads, p->name);
        abort();
    }
    /* Each thread its own range (64-value aligned), a block at a time; fn
     * runs inside it (a kernel's own parallel region then runs on the
     * calling thread). The old list is only read until every thread is done. */
#pragma omp parallel num_threads(threads)
    {
        const int nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t chunk = ((n + nt - 1) / nt + 63) & ~(int64_t)63;
        const int64_t lo = first + (chunk * t < n ? chunk * t : n),
                      hi = lo + chunk < first + n ? lo + chunk : first + n;
        _Alignas(64) float x[MAIN_PASS_BLOCK];
        for (int64_t at = lo; at < hi; at += MAIN_PASS_BLOCK) {
            const int64_t len = hi - at < MAIN_PASS_BLOCK ? hi - at : MAIN_PASS_BLOCK;
            ht_param_main_read(p, at, len, x);
            fn(x, at, len, ctx);
            write_halves(p, at, len, x, &lists[t]);
        }
    }
    replace_ties(p, first, n, lists, threads);
    for (int t = 0; t < threads; t++) free(lists[t].at);
    free(lists);
}

void ht_param_main_write(ht_param *p, int64_t first, int64_t n, const float *x) {
    if (!p->main_low) {
        if (p->main_param && (void *)p->main_param != p->data)
            memcpy(p->main_param + first, x, (size_t)n * sizeof(float));
        ht_convert((char *)p->data + (size_t)first * ht_dtype_size(p->dtype), p->dtype, x, HT_DTYPE_F32, (size_t)n);
        return;
    }
    tie_list l = {0};
    write_halves(p, first, n, x, &l);
    replace_ties(p, first, n, &l, 1);
    free(l.at);
}

void ht_params_cast_main_to_model(ht_param_store *store) {
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        if (p->trainable && p->main_param && p->main_param != p->data)
            mem_convert(store, p->data, p->dtype, p->main_param, HT_DTYPE_F32, (size_t)ht_param_local_numel(p));
    }
}

void ht_params_zero_grad(ht_param_store *store) {
    if (store->grad_block) ht_params_zero(store, store->grad_block, store->grad_bytes);
}

ht_status ht_params_freeze(ht_param_store *store, const char *const *patterns, int count, int *frozen, ht_error *err) {
    if (frozen) *frozen = 0;
    if (count == 0) return HT_OK;
    if (store->main_block)
        return ht_fail(err, HT_ERR_INVALID, "ht_params_freeze: freeze parameters before their FP32 main params exist");
    for (int k = 0; k < count; k++) {
        bool hit = false;
        for (int i = 0; i < store->count && !hit; i++) hit = ht_path_covers(patterns[k], store->items[i].name);
        if (!hit)
            return ht_fail(err, HT_ERR_CONFIG,
                           "model.freeze: \"%s\" covers no parameter of this model (a pattern names a module or a "
                           "parameter, '{*}' or '*' standing for one dotted component: model.embed_tokens, "
                           "model.layers.{*}.self_attn, %s)",
                           patterns[k], store->count ? store->items[store->count - 1].name : "lm_head.weight");
    }
    int n = 0, left = 0;
    size_t bytes = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        for (int k = 0; k < count && p->trainable; k++)
            if (ht_path_covers(patterns[k], p->name)) {
                p->trainable = false;
                n++;
            }
        bytes += grad_size(p);
        left += p->trainable;
    }
    if (left == 0)
        return ht_fail(err, HT_ERR_CONFIG, "model.freeze freezes all %d parameters: nothing is left to train",
                       store->count);
    if (!store->data_block) { /* declared only: ht_params_allocate gives the trainable ones gradients */
        if (frozen) *frozen = n;
        return HT_OK;
    }
    /* The gradient block again, for the trainable params alone. */
    char *block = mem_alloc(store, bytes);
    if (!block) return ht_fail(err, HT_ERR_OOM, "cannot allocate %zu bytes of gradients", bytes);
    size_t off = 0;
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &store->items[i];
        p->main_grad = p->trainable ? (float *)(block + off) : NULL;
        off += grad_size(p);
        p->grad = p->sharded ? NULL : p->main_grad;
        if (!p->trainable && p->main_param != p->data) p->main_param = NULL;
    }
    mem_free(store, store->grad_block);
    store->grad_block = (float *)block;
    store->grad_bytes = bytes;
    if (frozen) *frozen = n;
    return HT_OK;
}

void ht_param_rows_of(int64_t rows, int rank, int world, int64_t *row0, int64_t *row1) {
    *row0 = rows * rank / world;
    *row1 = rows * (rank + 1) / world;
}

ht_status ht_params_shard(ht_param_store *store, int rank, int world, ht_error *err) {
    if (world == 1) return HT_OK;
    if (store->main_block || store->compute_block || store->shard_world > 1)
        return ht_fail(err, HT_ERR_INVALID,
                       "ht_params_shard: shard a whole store before its main params and compute copies");
    ht_param *items = store->items; /* whole: every param's rows start at 0 */
    /* On the heap: a model of a million params would overflow the stack. */
    void **old_ptrs = malloc((size_t)(store->count ? store->count : 1) * sizeof(void *));
    if (!old_ptrs) return ht_fail(err, HT_ERR_OOM, "ht_params_shard: cannot allocate %d pointers", store->count);
    ht_params_set_rows(store, rank, world);
    void *old_data = store->data_block, *old_grad = store->grad_block;
    for (int i = 0; i < store->count; i++) old_ptrs[i] = items[i].data;
    store->data_block = NULL;
    store->grad_block = NULL;
    ht_status s = ht_params_allocate(store, err);
    if (s != HT_OK) { /* the whole store as it was */
        ht_params_set_rows(store, 0, 1);
        store->data_block = old_data;
        store->grad_block = old_grad;
        free(old_ptrs);
        return s;
    }
    for (int i = 0; i < store->count; i++) {
        ht_param *p = &items[i];
        size_t es = ht_dtype_size(p->dtype), row = (size_t)ht_param_row_numel(p);
        const char *from = (const char *)old_ptrs[i] + (size_t)p->row0 * row * es;
        size_t n = (size_t)ht_param_local_numel(p) * es;
        if (!n) continue;
        if (store->memory)
            store->memory->copy(p->data, from, n);
        else
            memcpy(p->data, from, n);
    }
    free(old_ptrs);
    mem_free(store, old_data);
    mem_free(store, old_grad);
    return HT_OK;
}

void ht_params_free(ht_param_store *store) {
    for (int i = 0; i < store->count; i++) drop_ties(&store->items[i]);
    mem_free(store, store->data_block);
    mem_free(store, store->grad_block);
    mem_free(store, store->main_block);
    mem_free(store, store->compute_block);
    free(store->items);
    free(store->slots);
    memset(store, 0, sizeof(*store));
}
