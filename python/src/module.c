/* hypertrain._C: the CPython binding of the kernels python/hypertrain/
 * computes with (the optimizers' passes, Newton-Schulz, the sum of squares,
 * the learning-rate schedules), of the trainer (one run in this process) and
 * of checkpoint reading.
 *
 * Tensors arrive as their data pointers (torch.Tensor.data_ptr()) with
 * their element counts: the Python side has checked that each is a
 * contiguous tensor of the dtype the kernel takes, so nothing is copied.
 * A kernel's `stream` argument says where it computes: None, the CPU's
 * table on CPU tensors; an int (a cudaStream_t, torch's current stream),
 * the CUDA backend's table on CUDA tensors, its work queued on that stream
 * (in a build without the backend: an error saying so). Every kernel runs
 * with the GIL released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "hypertrain/ckpt.h"
#include "hypertrain/config.h"
#include "hypertrain/kernels.h"
#include "hypertrain/optim.h"
#include "hypertrain/train.h"

/* A pointer from a Python int; NULL from 0 or None. */
static void *as_pointer(PyObject *o) {
    if (o == Py_None) return NULL;
    return PyLong_AsVoidPtr(o);
}

/* A dtype by its name; "" or None: none (HT_DTYPE_COUNT). */
static bool as_dtype(PyObject *o, ht_dtype *out) {
    *out = HT_DTYPE_COUNT;
    if (o == Py_None) return true;
    const char *name = PyUnicode_AsUTF8(o);
    if (!name) return false;
    if (!name[0]) return true;
    if (ht_dtype_from_name(name, out)) return true;
    PyErr_Format(PyExc_ValueError, "hypertrain: unknown dtype \"%s\"", name);
    return false;
}

/* Where a call computes (the module's comment): the table, and for CUDA the
 * caller's stream, the backend's own given back when the call is done. */
typedef struct py_device {
    const ht_kernel_ops *k;
    bool cuda;
    void *stream, *saved;
} py_device;

static bool device_of(PyObject *stream, py_device *d) {
    memset(d, 0, sizeof(*d));
    d->k = ht_kernels();
    if (!stream || stream == Py_None) return true;
    ht_error err;
    if (!(d->k = ht_kernels_cuda(&err))) {
        PyErr_Format(PyExc_RuntimeError, "hypertrain: a CUDA tensor needs hypertrain's CUDA backend: %s", err.msg);
        return false;
    }
    d->cuda = true;
    d->stream = PyLong_AsVoidPtr(stream);
    return !PyErr_Occurred();
}

/* With the GIL released: the call's stream in, and out again. */
static void device_enter(py_device *d) {
    if (d->cuda) d->saved = ht_kernels_cuda_stream(d->stream);
}
static void device_leave(py_device *d) {
    if (d->cuda) ht_kernels_cuda_stream(d->saved);
}

/* cuda_backend(): (device, why): the CUDA device hypertrain's CUDA backend
 * computes on and "", or (None, the reason there is none). */
static PyObject *py_cuda_backend(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    ht_error err;
    if (!ht_kernels_cuda(&err)) return Py_BuildValue("(Os)", Py_None, err.msg);
    return Py_BuildValue("(is)", ht_kernels_cuda_device(), "");
}

/* cuda_allocations(): the device blocks the CUDA backend has allocated so
 * far (0 without it), for the tests' count that a step allocates none. */
static PyObject *py_cuda_allocations(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    return PyLong_FromLongLong((long long)ht_kernels_cuda_allocations());
}

/* cuda_synchronize(stream): waits for the CUDA backend's work on `stream`
 * and raises the first failure of any of its kernels or products. */
static PyObject *py_cuda_synchronize(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *stream_o = Py_None;
    if (!PyArg_ParseTuple(args, "|O", &stream_o)) return NULL;
    py_device d;
    if (!device_of(stream_o, &d)) return NULL;
    ht_error err;
    ht_status st;
    PyThreadState *unlocked = PyEval_SaveThread();
    device_enter(&d);
    st = d.k->synchronize(&err);
    device_leave(&d);
    PyEval_RestoreThread(unlocked);
    if (st != HT_OK) return PyErr_Format(PyExc_RuntimeError, "hypertrain: %s", err.msg);
    Py_RETURN_NONE;
}

/* adamw(p, g, m, v, n, step, lr, beta1, beta2, eps, weight_decay, model=None, model_dtype=None, stream=None):
 * one AdamW step of n FP32 elements (docs/NUMERICS.md, AdamW: torch's fused
 * kernel's rounding), the rounded result written to a bf16/f16 model copy
 * in the same pass where one is given. */
static PyObject *py_adamw(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {
        "p",     "g",           "m",      "v", "n", "step", "lr", "beta1", "beta2", "eps", "weight_decay",
        "model", "model_dtype", "stream", NULL};
    PyObject *po, *go, *mo, *vo, *model_o = Py_None, *dtype_o = Py_None, *stream_o = Py_None;
    long long n, step;
    ht_adamw_hparams h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOLLddddd|OOO", names, &po, &go, &mo, &vo, &n, &step, &h.lr, &h.beta1,
                                     &h.beta2, &h.eps, &h.weight_decay, &model_o, &dtype_o, &stream_o))
        return NULL;
    py_device d;
    if (!device_of(stream_o, &d)) return NULL;
    h.step = step;
    float *p = as_pointer(po), *m = as_pointer(mo), *v = as_pointer(vo);
    const float *g = as_pointer(go);
    void *model = as_pointer(model_o);
    ht_dtype dtype;
    if (PyErr_Occurred() || !as_dtype(dtype_o, &dtype)) return NULL;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    device_enter(&d);
    d.k->adamw_pass(p, g, m, v, n, &h, model, dtype, false, 0);
    device_leave(&d);
    PyEval_RestoreThread(unlocked);
    Py_RETURN_NONE;
}

/* The Muon arithmetic a Python name spells: "plain" or "torch" (ht_muon_arith). */
static bool as_arith(const char *name, ht_muon_arith *out) {
    if (!strcmp(name, "plain") || !strcmp(name, "torch")) {
        *out = name[0] == 't' ? HT_MUON_ARITH_TORCH : HT_MUON_ARITH_PLAIN;
        return true;
    }
    PyErr_Format(PyExc_ValueError, "hypertrain: Muon arithmetic \"%s\"; expected \"plain\" or \"torch\"", name);
    return false;
}

/* muon_momentum(B, g, u, n, mu, gw, nesterov, arith="plain", stream=None): B <- mu B + gw g;
 * with nesterov u = gw g + mu B (else u is not written); arith "torch":
 * torch.optim.Muon's lerps, B.lerp_(g, gw) and u = g.lerp(B, mu). */
static PyObject *py_muon_momentum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *bo, *go, *uo;
    long long n;
    float mu, gw;
    int nesterov;
    const char *arith_name = "plain";
    PyObject *stream_o = Py_None;
    ht_muon_arith arith;
    py_device d;
    if (!PyArg_ParseTuple(args, "OOOLffp|sO", &bo, &go, &uo, &n, &mu, &gw, &nesterov, &arith_name, &stream_o))
        return NULL;
    if (!as_arith(arith_name, &arith) || !device_of(stream_o, &d)) return NULL;
    float *B = as_pointer(bo), *u = as_pointer(uo);
    const float *g = as_pointer(go);
    if (PyErr_Occurred()) return NULL;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    device_enter(&d);
    d.k->muon_momentum(B, g, u, n, mu, gw, nesterov != 0, arith);
    device_leave(&d);
    PyEval_RestoreThread(unlocked);
    Py_RETURN_NONE;
}

/* muon_apply(p, O, n, decay, step, model=None, model_dtype=None, arith="plain", stream=None):
 * p <- p decay - step O (arith "torch": p decay, then one FMA, as
 * torch.optim.Muon's add_), and the bf16/f16 model copy; O is scratch. */
static PyObject *py_muon_apply(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"p", "O", "n", "decay", "step", "model", "model_dtype", "arith", "stream", NULL};
    PyObject *po, *oo, *model_o = Py_None, *dtype_o = Py_None, *stream_o = Py_None;
    long long n;
    float decay, step;
    const char *arith_name = "plain";
    ht_muon_arith arith;
    py_device d;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOLff|OOsO", names, &po, &oo, &n, &decay, &step, &model_o, &dtype_o,
                                     &arith_name, &stream_o))
        return NULL;
    if (!as_arith(arith_name, &arith) || !device_of(stream_o, &d)) return NULL;
    float *p = as_pointer(po), *O = as_pointer(oo);
    void *model = as_pointer(model_o);
    ht_dtype dtype;
    if (PyErr_Occurred() || !as_dtype(dtype_o, &dtype)) return NULL;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    device_enter(&d);
    d.k->muon_apply(p, O, n, decay, step, arith, model, dtype, false, 0, 0);
    device_leave(&d);
    PyEval_RestoreThread(unlocked);
    Py_RETURN_NONE;
}

/* The schedule a Python sequence of (a, b, c) triples spells, one per iteration. */
static bool as_schedule(PyObject *o, ht_ns_schedule *s) {
    PyObject *seq = PySequence_Fast(o, "hypertrain: Newton-Schulz coefficients must be a sequence of (a, b, c)");
    if (!seq) return false;
    const Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    bool ok = k >= 1 && k <= HT_NS_MAX_STEPS;
    if (!ok)
        PyErr_Format(PyExc_ValueError, "hypertrain: %zd Newton-Schulz iterations; expected 1 to %d", k,
                     HT_NS_MAX_STEPS);
    for (Py_ssize_t i = 0; ok && i < k; i++)
        ok = PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "ddd", &s->coeffs[i][0], &s->coeffs[i][1],
                              &s->coeffs[i][2]);
    s->steps = (int)k;
    Py_DECREF(seq);
    return ok;
}

/* newton_schulz(G, O, count, rows, cols, coeffs, eps, ns_dtype[, form[, stream]]):
 * Newton-Schulz of `count` (rows, cols) FP32 matrices side by side in G into
 * O (G may be O), each on its own (docs/NUMERICS.md, Muon), its products in
 * ns_dtype ("float32", or "bfloat16" operands with FP32 accumulation); form
 * "standard" (default), "gram" (float32) or "torch" (bfloat16: torch.optim.Muon's
 * roundings). */
static PyObject *py_newton_schulz(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *go, *oo, *coeffs, *dtype_o;
    long long count, rows, cols;
    double eps;
    const char *form_name = "standard";
    PyObject *stream_o = Py_None;
    if (!PyArg_ParseTuple(args, "OOLLLOdO|sO", &go, &oo, &count, &rows, &cols, &coeffs, &eps, &dtype_o, &form_name,
                          &stream_o))
        return NULL;
    ht_ns_schedule sched;
    ht_dtype dtype;
    const float *G = as_pointer(go);
    float *O = as_pointer(oo);
    if (PyErr_Occurred() || !as_schedule(coeffs, &sched) || !as_dtype(dtype_o, &dtype)) return NULL;
    if (dtype != HT_DTYPE_F32 && dtype != HT_DTYPE_BF16)
        return PyErr_Format(PyExc_ValueError, "hypertrain: Newton-Schulz runs in float32 or bfloat16, not %s",
                            dtype == HT_DTYPE_COUNT ? "nothing" : ht_dtype_name(dtype));
    ht_ns_form form;
    if (!strcmp(form_name, "standard"))
        form = HT_NS_FORM_STANDARD;
    else if (!strcmp(form_name, "gram") && dtype == HT_DTYPE_F32)
        form = HT_NS_FORM_GRAM;
    else if (!strcmp(form_name, "torch") && dtype == HT_DTYPE_BF16)
        form = HT_NS_FORM_TORCH;
    else
        return PyErr_Format(PyExc_ValueError,
                            "hypertrain: Newton-Schulz form '%s' with ns_dtype %s; expected 'standard', 'gram' (with "
                            "float32) or 'torch' (with bfloat16)",
                            form_name, ht_dtype_name(dtype));
    py_device d;
    if (!device_of(stream_o, &d)) return NULL;
    const ht_kernel_ops *k = d.k;
    float *work = NULL;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    device_enter(&d);
    const size_t bytes = k->ns_workspace_floats(count, rows, cols, dtype, form) * sizeof(float) + 64;
    /* On CUDA the stream's workspace, kept by the backend: a step allocates nothing, and waits for nothing */
    work = d.cuda ? ht_kernels_cuda_workspace(bytes) : k->alloc(bytes);
    if (work)
        k->ns_iterate(G, O, count, rows, cols, (const double(*)[3])sched.coeffs, sched.steps, eps, dtype, form, work);
    if (!d.cuda) k->free(work);
    device_leave(&d);
    PyEval_RestoreThread(unlocked);
    if (!work) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* ns_schedule(variant, ns_steps): the triples of a named schedule
 * ("legacy", "asym5", "polar_express", "deepseek_v4"), one per iteration. */
static PyObject *py_ns_schedule(PyObject *self, PyObject *args) {
    (void)self;
    const char *name;
    int steps;
    if (!PyArg_ParseTuple(args, "si", &name, &steps)) return NULL;
    ht_ns_variant variant;
    if (!ht_ns_variant_from_name(name, &variant) || variant == HT_NS_CUSTOM)
        return PyErr_Format(PyExc_ValueError,
                            "hypertrain: ns_variant \"%s\"; expected legacy, asym5, polar_express or deepseek_v4",
                            name);
    ht_ns_schedule s;
    ht_error err;
    if (ht_ns_schedule_expand(variant, steps, NULL, 0, &s, &err) != HT_OK)
        return PyErr_Format(PyExc_ValueError, "hypertrain: %s", err.msg);
    PyObject *list = PyList_New(s.steps);
    for (int i = 0; list && i < s.steps; i++)
        PyList_SET_ITEM(list, i, Py_BuildValue("(ddd)", s.coeffs[i][0], s.coeffs[i][1], s.coeffs[i][2]));
    return list;
}

/* sum_squares(x, n, stream=None): Σ x² of n FP32 elements, in double (on
 * CUDA: waits for it, and raises a failure of the backend's work). */
static PyObject *py_sum_squares(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo, *stream_o = Py_None;
    long long n;
    if (!PyArg_ParseTuple(args, "OL|O", &xo, &n, &stream_o)) return NULL;
    const float *x = as_pointer(xo);
    py_device d;
    if (PyErr_Occurred() || !device_of(stream_o, &d)) return NULL;
    double s;
    ht_error err;
    ht_status st = HT_OK;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    device_enter(&d);
    s = d.k->sum_squares(x, n);
    if (d.cuda) st = d.k->synchronize(&err);
    device_leave(&d);
    PyEval_RestoreThread(unlocked);
    if (st != HT_OK) return PyErr_Format(PyExc_RuntimeError, "hypertrain: %s", err.msg);
    return PyFloat_FromDouble(s);
}

/* lr_types(): the schedules' type names (MindFormers'), in ht_lr_type order. */
static PyObject *py_lr_types(PyObject *self, PyObject *unused) {
    (void)self, (void)unused;
    PyObject *list = PyList_New(HT_LR_TYPE_COUNT);
    for (int t = 0; list && t < HT_LR_TYPE_COUNT; t++)
        PyList_SET_ITEM(list, t, PyUnicode_FromString(ht_lr_type_name((ht_lr_type)t)));
    return list;
}

/* lr_at(type, step, **fields): the lr of the step with 0-based index `step`
 * of the schedule whose fields (ht_lr_schedule's names: base_lr,
 * warmup_steps, total_steps, ...) are given; the others 0, but
 * num_cycles 0.5, power 1, t_0 and t_mult 1 and lr_scale 1. */
static PyObject *py_lr_at(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    const char *type;
    long long step;
    if (!PyArg_ParseTuple(args, "sL", &type, &step)) return NULL;
    ht_lr_schedule s = {.num_cycles = 0.5, .power = 1.0, .t_0 = 1, .t_mult = 1, .lr_scale = 1.0};
    if (!ht_lr_type_from_name(type, &s.type))
        return PyErr_Format(PyExc_ValueError, "hypertrain: unknown learning-rate schedule \"%s\"", type);
    static const struct {
        const char *name;
        size_t offset;
        bool integer;
    } fields[] = {
        {"base_lr", offsetof(ht_lr_schedule, base_lr), false},
        {"warmup_lr_init", offsetof(ht_lr_schedule, warmup_lr_init), false},
        {"lr_end", offsetof(ht_lr_schedule, lr_end), false},
        {"total_steps", offsetof(ht_lr_schedule, total_steps), true},
        {"warmup_steps", offsetof(ht_lr_schedule, warmup_steps), true},
        {"num_cycles", offsetof(ht_lr_schedule, num_cycles), false},
        {"decay_steps", offsetof(ht_lr_schedule, decay_steps), true},
        {"power", offsetof(ht_lr_schedule, power), false},
        {"decay_start", offsetof(ht_lr_schedule, decay_start), true},
        {"eta_min", offsetof(ht_lr_schedule, eta_min), false},
        {"t_max", offsetof(ht_lr_schedule, t_max), true},
        {"keep_steps", offsetof(ht_lr_schedule, keep_steps), true},
        {"final_steps", offsetof(ht_lr_schedule, final_steps), true},
        {"lr_end1", offsetof(ht_lr_schedule, lr_end1), false},
        {"lr_end2", offsetof(ht_lr_schedule, lr_end2), false},
        {"t_0", offsetof(ht_lr_schedule, t_0), true},
        {"t_mult", offsetof(ht_lr_schedule, t_mult), true},
        {"lr_scale", offsetof(ht_lr_schedule, lr_scale), false},
    };
    PyObject *key, *value;
    Py_ssize_t at = 0;
    while (kw && PyDict_Next(kw, &at, &key, &value)) {
        const char *name = PyUnicode_AsUTF8(key);
        if (!name) return NULL;
        size_t i = 0, n = sizeof(fields) / sizeof(fields[0]);
        while (i < n && strcmp(fields[i].name, name) != 0) i++;
        if (i == n) {
            if (strcmp(name, "wrapped") == 0) {
                const char *w = PyUnicode_AsUTF8(value);
                if (!w || !ht_lr_type_from_name(w, &s.wrapped))
                    return PyErr_Format(PyExc_ValueError, "hypertrain: lr_at: wrapped schedule unknown");
                continue;
            }
            return PyErr_Format(PyExc_TypeError, "hypertrain: lr_at: unknown field \"%s\"", name);
        }
        char *field = (char *)&s + fields[i].offset;
        if (fields[i].integer) {
            const long long v = PyLong_AsLongLong(value);
            if (v == -1 && PyErr_Occurred()) return NULL;
            *(int64_t *)field = v;
        } else {
            const double v = PyFloat_AsDouble(value);
            if (v == -1.0 && PyErr_Occurred()) return NULL;
            *(double *)field = v;
        }
    }
    return PyFloat_FromDouble(ht_lr_at(&s, step));
}

/* A config of the defaults, the file at `path` (NULL: none) and `list`'s
 * overrides ("section.key=value", as --set), as the command line loads it,
 * into cfg (malloc'ed; the caller frees it). NULL with a Python error set:
 * TypeError/MemoryError for the list, ValueError with the config's sentence. */
static ht_config *load_config(const char *path, PyObject *list, const char *what) {
    PyObject *seq = PySequence_Fast(list, what);
    if (!seq) return NULL;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    char **overrides = calloc((size_t)n + 1, sizeof(char *));
    ht_config *cfg = malloc(sizeof(ht_config));
    bool ok = overrides && cfg;
    if (!ok) PyErr_NoMemory();
    for (Py_ssize_t i = 0; ok && i < n; i++) /* UTF-8 buffers the strings own: valid while seq holds them */
        ok = (overrides[i] = (char *)PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i))) != NULL;
    ht_error err = {0};
    if (ok && ht_config_load(path, (int)n, overrides, cfg, &err) != HT_OK) {
        PyErr_SetString(PyExc_ValueError, err.msg);
        ok = false;
    }
    Py_DECREF(seq);
    free(overrides);
    if (!ok) {
        free(cfg);
        return NULL;
    }
    return cfg;
}

/* lr_schedule(overrides): the schedule the trainer would follow under the
 * config of the defaults and `overrides` ("training.steps=T",
 * "lr_scheduler.type=...", "lr_scheduler.key=value", as --set): its type and
 * fields (ht_lr_schedule's names, the derived counts resolved) as a dict for
 * lr_at; ValueError with the config's sentence where the schedule's rules
 * (ht_config_validate_lr_scheduler) refuse it. One set of defaults, the
 * trainer's, for C and Python. */
static PyObject *py_lr_schedule(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "O", &list)) return NULL;
    ht_config *cfg = load_config(NULL, list, "hypertrain: lr_schedule's overrides must be a sequence of strings");
    if (!cfg) return NULL;
    PyObject *result = NULL;
    ht_error err = {0};
    if (ht_config_validate_lr_scheduler(cfg, &err) != HT_OK) {
        PyErr_SetString(PyExc_ValueError, err.msg);
        goto done;
    }
    ht_lr_schedule s;
    ht_train_lr_schedule(&s, cfg, 1.0);
    result = Py_BuildValue("{s:s,s:d,s:d,s:L,s:L,s:d,s:L,s:d,s:L,s:d,s:L,s:L,s:L,s:d,s:d,s:L,s:L}", "type",
                           ht_lr_type_name(s.type), "warmup_lr_init", s.warmup_lr_init, "lr_end", s.lr_end,
                           "total_steps", (long long)s.total_steps, "warmup_steps", (long long)s.warmup_steps,
                           "num_cycles", s.num_cycles, "decay_steps", (long long)s.decay_steps, "power", s.power,
                           "decay_start", (long long)s.decay_start, "eta_min", s.eta_min, "t_max", (long long)s.t_max,
                           "keep_steps", (long long)s.keep_steps, "final_steps", (long long)s.final_steps, "lr_end1",
                           s.lr_end1, "lr_end2", s.lr_end2, "t_0", (long long)s.t_0, "t_mult", (long long)s.t_mult);
done:
    free(cfg);
    return result;
}

/* SIGINT and SIGTERM while train() runs: the first asks the trainer to stop
 * at the next step boundary, saving a checkpoint; a second ends the process
 * at once, by that signal (as `hypertrain train` does). */
static volatile sig_atomic_t train_stop = 0;

static void on_train_signal(int sig) {
    if (train_stop) {
        signal(sig, SIG_DFL);
        raise(sig);
        return;
    }
    train_stop = sig;
}

/* train(config, overrides): one run of the trainer in this process, one
 * rank: the config loaded with the overrides ("section.key=value", as
 * --set) and validated, then ht_train with the GIL released, the log sink's
 * level `log_level` (0 debug .. 3 error; -1: as it is) for the call. Returns
 * (output_dir, stopped_by): stopped_by the signal that stopped it after its
 * checkpoint, else 0. A bad config raises ValueError (whether loading,
 * validating or building finds it), a failed run RuntimeError, each with
 * the engine's sentence. */
static PyObject *py_train(PyObject *self, PyObject *args) {
    (void)self;
    const char *path;
    PyObject *list;
    int log_level = -1;
    if (!PyArg_ParseTuple(args, "sO|i", &path, &list, &log_level)) return NULL;
    if (log_level < -1 || log_level > HT_LOG_ERROR) {
        PyErr_Format(PyExc_ValueError, "hypertrain: train's log level %d; expected 0 (debug) to 3 (error)", log_level);
        return NULL;
    }
    const ht_log_level old_level = ht_log_get_level();
    if (log_level >= 0) ht_log_set_level((ht_log_level)log_level);
    PyObject *result = NULL;
    ht_config *cfg = load_config(path, list, "hypertrain: train's overrides must be a sequence of strings");
    if (!cfg) goto done;
    ht_error err = {0};
    if (ht_config_validate(cfg, 1, &err) != HT_OK) {
        PyErr_SetString(PyExc_ValueError, err.msg);
        goto done;
    }
    struct sigaction sa, old_int, old_term;
    memset(&sa, 0, sizeof(sa));
    sa.sa_handler = on_train_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    train_stop = 0;
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
    /* blocked by the caller, they would never stop the run; one already pending stops it before step 1 */
    sigset_t stops, old_mask;
    sigemptyset(&stops);
    sigaddset(&stops, SIGINT);
    sigaddset(&stops, SIGTERM);
    pthread_sigmask(SIG_UNBLOCK, &stops, &old_mask);
    int stopped_by = 0;
    ht_status s;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the whole run without the GIL */
    s = ht_train(cfg, ht_comm_single(), &train_stop, &stopped_by, &err);
    PyEval_RestoreThread(unlocked);
    pthread_sigmask(SIG_SETMASK, &old_mask, NULL);
    sigaction(SIGINT, &old_int, NULL);
    sigaction(SIGTERM, &old_term, NULL);
    if (s != HT_OK) /* a config the trainer refuses as it builds (HT_ERR_CONFIG) is a bad config too */
        PyErr_SetString(s == HT_ERR_CONFIG ? PyExc_ValueError : PyExc_RuntimeError, err.msg);
    else
        result = Py_BuildValue("(si)", cfg->checkpoint.output_dir, stopped_by);
done:
    ht_log_set_level(old_level);
    free(cfg);
    return result;
}

/* A checkpoint opened by ckpt_open, as a capsule that closes it. */
static const char ckpt_capsule[] = "hypertrain.checkpoint";

static void close_ckpt(PyObject *capsule) { ht_ckpt_close(PyCapsule_GetPointer(capsule, ckpt_capsule)); }

/* ckpt_open(dir): a checkpoint directory opened (metadata, every file's size
 * and hash, every chunk checked: ht_ckpt_open); OSError with its sentence. */
static PyObject *py_ckpt_open(PyObject *self, PyObject *args) {
    (void)self;
    const char *dir;
    if (!PyArg_ParseTuple(args, "s", &dir)) return NULL;
    ht_checkpoint *ck = NULL;
    ht_error err = {0};
    ht_status s;
    PyThreadState *unlocked = PyEval_SaveThread(); /* hashing the files takes a while */
    s = ht_ckpt_open(dir, &ck, &err);
    PyEval_RestoreThread(unlocked);
    if (s != HT_OK) return PyErr_Format(PyExc_OSError, "%s", err.msg);
    PyObject *capsule = PyCapsule_New(ck, ckpt_capsule, close_ckpt);
    if (!capsule) ht_ckpt_close(ck);
    return capsule;
}

/* ckpt_keys(ck): [(name, dtype name, shape tuple)] sorted by name, and the step. */
static PyObject *py_ckpt_keys(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule;
    if (!PyArg_ParseTuple(args, "O", &capsule)) return NULL;
    ht_checkpoint *ck = PyCapsule_GetPointer(capsule, ckpt_capsule);
    if (!ck) return NULL;
    const int n = ht_ckpt_key_count(ck);
    PyObject *list = PyList_New(n);
    for (int i = 0; list && i < n; i++) {
        ht_dtype dtype;
        int ndim;
        int64_t shape[HT_PARAM_MAX_DIMS];
        const char *name = ht_ckpt_key(ck, i, &dtype, &ndim, shape);
        PyObject *dims = PyTuple_New(ndim);
        for (int d = 0; dims && d < ndim; d++) PyTuple_SET_ITEM(dims, d, PyLong_FromLongLong(shape[d]));
        PyObject *item = dims ? Py_BuildValue("(ssN)", name, ht_dtype_name(dtype), dims) : NULL;
        if (!item) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, i, item);
    }
    return list ? Py_BuildValue("(NL)", list, (long long)ht_ckpt_step(ck)) : NULL;
}

/* ckpt_read(ck, name, dst, dtype): the whole of key `name` into dst (its
 * global shape, row-major, converted to dtype: ht_ckpt_read_box). */
static PyObject *py_ckpt_read(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *capsule, *dst_o, *dtype_o;
    const char *name;
    if (!PyArg_ParseTuple(args, "OsOO", &capsule, &name, &dst_o, &dtype_o)) return NULL;
    ht_checkpoint *ck = PyCapsule_GetPointer(capsule, ckpt_capsule);
    void *dst = as_pointer(dst_o);
    ht_dtype dtype;
    if (!ck || PyErr_Occurred() || !as_dtype(dtype_o, &dtype)) return NULL;
    ht_box box = {0};
    const int n = ht_ckpt_key_count(ck);
    int i = 0;
    while (i < n && strcmp(ht_ckpt_key(ck, i, NULL, NULL, NULL), name) != 0) i++;
    if (i == n) return PyErr_Format(PyExc_KeyError, "%s", name);
    int ndim;
    ht_ckpt_key(ck, i, NULL, &ndim, box.length); /* the whole key: offsets 0 */
    ht_error err = {0};
    ht_status s;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the chunks are copied */
    s = ht_ckpt_read_box(ck, name, &box, dst, dtype, &err);
    PyEval_RestoreThread(unlocked);
    if (s != HT_OK) return PyErr_Format(PyExc_OSError, "%s", err.msg);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"train", py_train, METH_VARARGS, "one run of the trainer in this process"},
    {"ckpt_open", py_ckpt_open, METH_VARARGS, "open a checkpoint directory"},
    {"ckpt_keys", py_ckpt_keys, METH_VARARGS, "a checkpoint's keys, dtypes and shapes, and its step"},
    {"ckpt_read", py_ckpt_read, METH_VARARGS, "a checkpoint key, whole, into a buffer"},
    {"adamw", (PyCFunction)(void (*)(void))py_adamw, METH_VARARGS | METH_KEYWORDS, "one AdamW step (FP32)"},
    {"muon_momentum", py_muon_momentum, METH_VARARGS, "Muon's momentum step"},
    {"muon_apply", (PyCFunction)(void (*)(void))py_muon_apply, METH_VARARGS | METH_KEYWORDS,
     "p <- p decay - step O, and the model copy"},
    {"newton_schulz", py_newton_schulz, METH_VARARGS, "Newton-Schulz of a batch of matrices"},
    {"ns_schedule", py_ns_schedule, METH_VARARGS, "a named Newton-Schulz schedule's triples"},
    {"sum_squares", py_sum_squares, METH_VARARGS, "the sum of squares of FP32 elements, in double"},
    {"cuda_backend", py_cuda_backend, METH_NOARGS, "the CUDA backend's device, or None and why"},
    {"cuda_allocations", py_cuda_allocations, METH_NOARGS, "the device blocks the CUDA backend has allocated"},
    {"cuda_synchronize", py_cuda_synchronize, METH_VARARGS, "waits for the CUDA backend and raises its failure"},
    {"lr_types", py_lr_types, METH_NOARGS, "the learning-rate schedules' type names"},
    {"lr_at", (PyCFunction)(void (*)(void))py_lr_at, METH_VARARGS | METH_KEYWORDS, "a schedule's lr at a step"},
    {"lr_schedule", py_lr_schedule, METH_VARARGS, "the trainer's schedule under a config's lr_scheduler keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_C", "hypertrain's C kernels", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) {
    /* The CUDA backend's workspaces given back when the interpreter ends, before the CUDA runtime's own exit
     * (where Python's table of exit functions is full, the process's end frees them) */
    (void)Py_AtExit(ht_kernels_cuda_free_workspaces);
    return PyModule_Create(&module);
}
