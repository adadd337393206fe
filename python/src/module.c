/* hypertrain._C: the CPython binding of the kernels python/hypertrain/
 * computes with (the optimizers' passes, Newton-Schulz, the sum of squares,
 * the learning-rate schedules).
 *
 * Tensors arrive as their data pointers (torch.Tensor.data_ptr()) with
 * their element counts: the Python side has checked that each is a
 * contiguous CPU tensor of the dtype the kernel takes, so nothing is
 * copied. Every kernel runs with the GIL released. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "hypertrain/kernels.h"
#include "hypertrain/optim.h"

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

/* adamw(p, g, m, v, n, step, lr, beta1, beta2, eps, weight_decay, model=None, model_dtype=None):
 * one AdamW step of n FP32 elements (docs/NUMERICS.md, AdamW: torch's fused
 * kernel's rounding), the rounded result written to a bf16/f16 model copy
 * in the same pass where one is given. */
static PyObject *py_adamw(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {
        "p", "g", "m", "v", "n", "step", "lr", "beta1", "beta2", "eps", "weight_decay", "model", "model_dtype", NULL};
    PyObject *po, *go, *mo, *vo, *model_o = Py_None, *dtype_o = Py_None;
    long long n, step;
    ht_adamw_hparams h;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOLLddddd|OO", names, &po, &go, &mo, &vo, &n, &step, &h.lr, &h.beta1,
                                     &h.beta2, &h.eps, &h.weight_decay, &model_o, &dtype_o))
        return NULL;
    h.step = step;
    float *p = as_pointer(po), *m = as_pointer(mo), *v = as_pointer(vo);
    const float *g = as_pointer(go);
    void *model = as_pointer(model_o);
    ht_dtype dtype;
    if (PyErr_Occurred() || !as_dtype(dtype_o, &dtype)) return NULL;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    ht_kernels()->adamw(p, g, m, v, n, &h, model, dtype, false, 0);
    PyEval_RestoreThread(unlocked);
    Py_RETURN_NONE;
}

/* muon_momentum(B, g, u, n, mu, gw, nesterov): B <- mu B + gw g; with
 * nesterov u = gw g + mu B (else u is not written). */
static PyObject *py_muon_momentum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *bo, *go, *uo;
    long long n;
    float mu, gw;
    int nesterov;
    if (!PyArg_ParseTuple(args, "OOOLffp", &bo, &go, &uo, &n, &mu, &gw, &nesterov)) return NULL;
    float *B = as_pointer(bo), *u = as_pointer(uo);
    const float *g = as_pointer(go);
    if (PyErr_Occurred()) return NULL;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    ht_kernels()->muon_momentum(B, g, u, n, mu, gw, nesterov != 0);
    PyEval_RestoreThread(unlocked);
    Py_RETURN_NONE;
}

/* muon_apply(p, O, n, decay, step, model=None, model_dtype=None):
 * p <- p decay - step O (O is scratch), and the bf16/f16 model copy. */
static PyObject *py_muon_apply(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *names[] = {"p", "O", "n", "decay", "step", "model", "model_dtype", NULL};
    PyObject *po, *oo, *model_o = Py_None, *dtype_o = Py_None;
    long long n;
    float decay, step;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOLff|OO", names, &po, &oo, &n, &decay, &step, &model_o, &dtype_o))
        return NULL;
    float *p = as_pointer(po), *O = as_pointer(oo);
    void *model = as_pointer(model_o);
    ht_dtype dtype;
    if (PyErr_Occurred() || !as_dtype(dtype_o, &dtype)) return NULL;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    ht_kernels()->muon_apply(p, O, n, decay, step, model, dtype, false, 0, 0);
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

/* newton_schulz(G, O, count, rows, cols, coeffs, eps, ns_dtype): Newton-Schulz
 * of `count` (rows, cols) FP32 matrices side by side in G into O (G may be O),
 * each on its own (docs/NUMERICS.md, Muon), its products in ns_dtype
 * ("float32", or "bfloat16" operands with FP32 accumulation). */
static PyObject *py_newton_schulz(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *go, *oo, *coeffs, *dtype_o;
    long long count, rows, cols;
    double eps;
    if (!PyArg_ParseTuple(args, "OOLLLOdO", &go, &oo, &count, &rows, &cols, &coeffs, &eps, &dtype_o)) return NULL;
    ht_ns_schedule sched;
    ht_dtype dtype;
    const float *G = as_pointer(go);
    float *O = as_pointer(oo);
    if (PyErr_Occurred() || !as_schedule(coeffs, &sched) || !as_dtype(dtype_o, &dtype)) return NULL;
    if (dtype != HT_DTYPE_F32 && dtype != HT_DTYPE_BF16)
        return PyErr_Format(PyExc_ValueError, "hypertrain: Newton-Schulz runs in float32 or bfloat16, not %s",
                            dtype == HT_DTYPE_COUNT ? "nothing" : ht_dtype_name(dtype));
    const ht_kernel_ops *k = ht_kernels();
    float *work = k->alloc(k->ns_workspace_floats(count, rows, cols, dtype) * sizeof(float) + 64);
    if (!work) return PyErr_NoMemory();
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    k->newton_schulz(G, O, count, rows, cols, (const double(*)[3])sched.coeffs, sched.steps, eps, dtype, work);
    PyEval_RestoreThread(unlocked);
    k->free(work);
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

/* sum_squares(x, n): Σ x² of n FP32 elements, in double. */
static PyObject *py_sum_squares(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *xo;
    long long n;
    if (!PyArg_ParseTuple(args, "OL", &xo, &n)) return NULL;
    const float *x = as_pointer(xo);
    if (PyErr_Occurred()) return NULL;
    double s;
    PyThreadState *unlocked = PyEval_SaveThread(); /* the GIL released while the kernel runs */
    s = ht_kernels()->sum_squares(x, n);
    PyEval_RestoreThread(unlocked);
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

static PyMethodDef methods[] = {
    {"adamw", (PyCFunction)(void (*)(void))py_adamw, METH_VARARGS | METH_KEYWORDS, "one AdamW step (FP32)"},
    {"muon_momentum", py_muon_momentum, METH_VARARGS, "Muon's momentum step"},
    {"muon_apply", (PyCFunction)(void (*)(void))py_muon_apply, METH_VARARGS | METH_KEYWORDS, "p <- p decay - step O"},
    {"newton_schulz", py_newton_schulz, METH_VARARGS, "Newton-Schulz of a batch of matrices"},
    {"ns_schedule", py_ns_schedule, METH_VARARGS, "a named Newton-Schulz schedule's triples"},
    {"sum_squares", py_sum_squares, METH_VARARGS, "the sum of squares of FP32 elements, in double"},
    {"lr_types", py_lr_types, METH_NOARGS, "the learning-rate schedules' type names"},
    {"lr_at", (PyCFunction)(void (*)(void))py_lr_at, METH_VARARGS | METH_KEYWORDS, "a schedule's lr at a step"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_C", "hypertrain's C kernels", -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__C(void) { return PyModule_Create(&module); }
