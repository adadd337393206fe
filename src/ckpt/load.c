/* Loading a training checkpoint into a model and optimizer: the box-overlap
 * planner that reads the chunks of N ranks' boxes into any other layout of
 * boxes, the FP32 main-param branches and the optimizer state
 * (docs/DESIGN.md, Checkpoints). */
#include "ckpt/checkpoint_internal.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

ht_status ht_ckpt_read_box(const ht_checkpoint *ck, const char *name, const ht_box *box, void *dst, ht_dtype dst_dtype,
                           ht_error *err) {
    const ck_key *k = ht_ckpt_find_key(ck, name);
    if (!k) return ht_fail(err, HT_ERR_INVALID, "%s: key %s: not in the checkpoint", ck->dir, name);
    if (k->dtype != dst_dtype && !(ht_dtype_is_float(k->dtype) && ht_dtype_is_float(dst_dtype)))
        return ht_fail(err, HT_ERR_FORMAT, "%s: key %s: saved as %s, cannot be read as %s", ck->dir, name,
                       ht_dtype_name(k->dtype), ht_dtype_name(dst_dtype));
    for (int d = 0; d < k->ndim; d++)
        if (box->offset[d] < 0 || box->length[d] < 0 || box->offset[d] + box->length[d] > k->shape[d])
            return ht_fail(err, HT_ERR_INVALID, "%s: key %s: [%lld, %lld) of dim %d asked for, beyond its %lld",
                           ck->dir, name, (long long)box->offset[d], (long long)(box->offset[d] + box->length[d]), d,
                           (long long)k->shape[d]);
    /* The planner: the overlap of each saved chunk with the box asked for
     * (open checked that the chunks tile the shape, so every element is found once). */
    for (int j = 0; j < k->nchunks; j++)
        ht_box_copy(k->ndim, dst, dst_dtype, box, k->chunks[j].t->data, k->dtype, &k->chunks[j].box);
    return HT_OK;
}

/* ht_ckpt_read_box into the memory of `mem` (a param store's: a GPU's,
 * say): directly where the host may write it, else through a host buffer
 * of the box, uploaded. */
static ht_status read_box_into(const ht_checkpoint *ck, const ht_param_store *mem, const char *name, int ndim,
                               const ht_box *box, void *dst, ht_dtype dst_dtype, ht_error *err) {
    if (ht_params_host_memory(mem)) return ht_ckpt_read_box(ck, name, box, dst, dst_dtype, err);
    const size_t bytes = (size_t)ht_box_numel(ndim, box) * ht_dtype_size(dst_dtype);
    void *stage = malloc(bytes ? bytes : 1);
    if (!stage)
        return ht_fail(err, HT_ERR_OOM, "%s: key %s: cannot allocate %zu bytes to stage it", ck->dir, name, bytes);
    ht_status s = ht_ckpt_read_box(ck, name, box, stage, dst_dtype, err);
    if (s == HT_OK) ht_params_upload(mem, dst, stage, bytes);
    free(stage);
    return s;
}

ht_status ht_ckpt_read_rows(const ht_checkpoint *ck, const char *name, int64_t row0, int64_t row1, void *dst,
                            ht_dtype dst_dtype, ht_error *err) {
    const ck_key *k = ht_ckpt_find_key(ck, name);
    ht_box box = {{0}, {0}};
    for (int d = 1; k && d < k->ndim; d++) box.length[d] = k->shape[d];
    box.offset[0] = row0;
    box.length[0] = row1 - row0;
    if (k && k->ndim == 0 && (row0 != 0 || row1 != 1))
        return ht_fail(err, HT_ERR_INVALID, "%s: key %s: a scalar, read as rows [%lld, %lld)", ck->dir, name,
                       (long long)row0, (long long)row1);
    return ht_ckpt_read_box(ck, name, &box, dst, dst_dtype, err);
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
    for (int d = 0; same && d < p->ndim; d++) same = k->shape[d] == p->global_shape[d];
    if (!same) {
        char want[96] = "", got[96] = "";
        for (int d = 0; d < p->ndim; d++)
            snprintf(want + strlen(want), sizeof(want) - strlen(want), "%s%lld", d ? "x" : "",
                     (long long)p->global_shape[d]);
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

static bool has_separate_main(const ht_param *p) { return p->trainable && ht_param_has_main(p); }

/* A residual16 param's main params from the checkpoint's FP32 key, a block
 * of rows at a time (never whole in memory); its weights become them
 * rounded to nearest, which they are unless the run that saved them rounded
 * stochastically: `moved` counts the weights that changed. */
static ht_status read_residual_main(const ht_checkpoint *ck, ht_param *p, const char *name, int64_t *moved,
                                    ht_error *err) {
    const int64_t row = ht_param_row_numel(p), rows = p->box.length[0];
    if (row == 0 || rows == 0) return HT_OK;
    const int64_t per = row < ((int64_t)1 << 18) ? ((int64_t)1 << 18) / row : 1;
    float *x = malloc((size_t)(per * row) * sizeof(float));
    if (!x)
        return ht_fail(err, HT_ERR_OOM, "%s: key %s: cannot allocate %lld rows to read it", ck->dir, name,
                       (long long)per);
    const uint16_t *w = p->data;
    ht_status s = HT_OK;
    for (int64_t r = 0; s == HT_OK && r < rows; r += per) {
        ht_box b = p->box;
        b.offset[0] += r;
        b.length[0] = rows - r < per ? rows - r : per;
        s = ht_ckpt_read_box(ck, name, &b, x, HT_DTYPE_F32, err);
        if (s != HT_OK) break;
        const int64_t first = r * row, n = b.length[0] * row;
        for (int64_t i = 0; i < n; i++) *moved += ht_f32_to_bf16(x[i]) != w[first + i];
        ht_param_main_write(p, first, n, x);
    }
    free(x);
    return s;
}

/* An optimizer tensor for a slot, when the checkpoint has it: checked, then returned. */
static ht_status slot_key(const ht_checkpoint *ck, const ht_param *p, key_kind kind, const ck_key **out,
                          ht_error *err) {
    char name[HT_CKPT_KEY_MAX];
    ht_ckpt_key_name(name, kind, p->name);
    *out = ht_ckpt_find_key(ck, name);
    return *out ? check_key(ck, *out, p, kind == KIND_STEP, err) : HT_OK;
}

/* Appends ", name" to a list that stays within cap (", ..." once it is full). */
static void append_name(char *buf, size_t cap, const char *name) {
    size_t used = strlen(buf);
    if (used + strlen(name) + 8 < cap)
        snprintf(buf + used, cap - used, "%s%s", used ? ", " : "", name);
    else if (!ht_ckpt_ends_with(buf, ", ..."))
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
        len -= strlen(ht_ckpt_kind_names[k->kind]) + 1;
    }
    len -= (size_t)(at - k->name);
    snprintf(out, cap, "%.*s", (int)(len < cap ? len : cap - 1), at);
}

/* Whether the checkpoint lacks p's model tensor (a load_strict false load then keeps p as it is). */
static bool model_key_missing(const ht_checkpoint *ck, const ht_param *p) {
    char name[HT_CKPT_KEY_MAX];
    ht_ckpt_key_name(name, KIND_MODEL, p->name);
    return ht_ckpt_find_key(ck, name) == NULL;
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
    ht_status s = ht_ckpt_optimizer_state(opt, &state, &n, err);
    bool *used = s == HT_OK ? calloc((size_t)ck->nkeys + 1, sizeof(bool)) : NULL;
    if (s == HT_OK && !used) s = ht_fail(err, HT_ERR_OOM, "checkpoint: out of memory");
    char missing[1200] = "";
    int n_missing = 0;
    for (int i = 0; s == HT_OK && i < n; i++) {
        const ht_opt_state *e = &state[i];
        ht_param *p = e->param;
        key_kind kind = ht_ckpt_state_kind(e->key);
        const ck_key *k;
        s = slot_key(ck, p, kind, &k, err);
        if (s == HT_OK && k && !e->data)
            s = ht_fail(err, HT_ERR_INVALID, "%s: key %s: this run's optimizer keeps no %s to receive it", ck->dir,
                        k->name, e->key);
        if (k) used[k - ck->keys] = true;
        bool fresh = v->lenient && model_key_missing(ck, p);
        if (s == HT_OK && !k && e->data && ck->state.schedule_step > 0 && !fresh) {
            char name[HT_CKPT_KEY_MAX];
            ht_ckpt_key_name(name, kind, p->name);
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
            s = read_box_into(ck, v->params, k->name, p->ndim, &p->box, e->data, HT_DTYPE_F32, err);
        else /* the saved optimizer never stepped: as fresh */
            ht_params_zero(v->params, e->data, (size_t)ht_param_local_numel(p) * sizeof(float));
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
        if (!p && v->whole && ht_params_find(v->whole, fqn)) continue; /* another pipeline stage's */
        if (!p && v->lenient) continue; /* listed with the model tensors this model lacks */
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
        ht_ckpt_key_name(name, KIND_MODEL, p->name);
        const ck_key *k = ht_ckpt_find_key(ck, name);
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
        ht_ckpt_key_name(name, KIND_MAIN, p->name);
        const ck_key *mk = ht_ckpt_find_key(ck, name);
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
        if (v->whole && ht_params_find(v->whole, fqn)) continue; /* another pipeline stage's */
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
        ht_log_warn_once(
            "%s: training.load_strict false: %d model weights missing, kept as initialised (their optimizer "
            "state starts from zero): %s",
            ck->dir, n_missing, missing);
    if (n_unknown)
        ht_log_warn_once(
            "%s: training.load_strict false: %d tensors of params this model lacks, left unloaded (with their "
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
        ht_ckpt_key_name(name, KIND_MODEL, p->name);
        if (!ht_ckpt_find_key(ck, name)) continue; /* load_strict false: kept */
        ht_status s = read_box_into(ck, ps, name, p->ndim, &p->box, p->data, p->dtype, err);
        if (s != HT_OK) return s;
    }
    /* The FP32 main params. A run without them (optimizer.fp32_main_params
     * false) steps from the model weights just loaded, so the checkpoint's
     * stay unread. */
    int rebuilt = 0, ignored = 0;
    int64_t moved = 0;
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        char name[HT_CKPT_KEY_MAX];
        ht_ckpt_key_name(name, KIND_MAIN, p->name);
        if (restore_optimizer && p->trainable && !p->main_param && !p->main_low && ht_ckpt_find_key(ck, name))
            ignored++;
    }
    if (ignored)
        ht_log_info("%s: %d FP32 main params (_mixed_precision_optimizer) not loaded: this run keeps none "
                    "(optimizer.fp32_main_params false) and steps from the model weights as saved",
                    ck->dir, ignored);
    for (int i = 0; i < ps->count; i++) {
        ht_param *p = &ps->items[i];
        if (!has_separate_main(p)) continue;
        char name[HT_CKPT_KEY_MAX];
        ht_ckpt_key_name(name, KIND_MODEL, p->name);
        const ck_key *mk = ht_ckpt_find_key(ck, name);
        if (!mk) { /* load_strict false: kept as initialised, its main param with it */
            ht_param_reload_main(ps, p);
            continue;
        }
        if (restore_optimizer && mk->dtype != HT_DTYPE_F32) {
            ht_ckpt_key_name(name, KIND_MAIN, p->name);
            mk = ht_ckpt_find_key(ck, name);
        }
        if (restore_optimizer && mk && mk->dtype == HT_DTYPE_F32) {
            ht_status s = p->main_low
                              ? read_residual_main(ck, p, mk->name, &moved, err)
                              : read_box_into(ck, ps, mk->name, p->ndim, &p->box, p->main_param, HT_DTYPE_F32, err);
            if (s != HT_OK) return s;
        } else {
            ht_param_reload_main(ps, p);
            rebuilt++;
        }
    }
    if (moved)
        ht_log_warn("%s: %lld weights differ from their FP32 main params rounded to nearest (saved with "
                    "stochastic rounding?); optimizer.main_param_storage residual16 keeps them rounded to nearest",
                    ck->dir, (long long)moved);
    /* A run that kept no FP32 main params stepped from its model weights
     * alone: built from them, its main params lose nothing. */
    const char *saved_main = ht_ckpt_config_value(ck, "optimizer.fp32_main_params");
    if (rebuilt && restore_optimizer && saved_main && strcmp(saved_main, "false") == 0)
        ht_log_info("%s: saved with optimizer.fp32_main_params false: %d FP32 main params built from its %s model, "
                    "all the values that run kept",
                    ck->dir, rebuilt, ht_dtype_name(ps->items[0].dtype));
    else if (rebuilt && restore_optimizer)
        ht_log_warn_once(
            "%s: no FP32 main params (_mixed_precision_optimizer) in the checkpoint: %d main params rebuilt "
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
