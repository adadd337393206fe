/* Causal attention with 16-bit operands on cuDNN's fused scaled-dot-product
 * attention, through its backend graph API (cudnn_graph.h) called by
 * function pointers from libcudnn.so.9, opened at run time: the build links
 * nothing of cuDNN and needs only its headers (HT_CUDNN), and a process
 * where the library does not open runs the own kernels (attention.cu,
 * flash.cu), logged once.
 *
 * The graphs are the ones cuDNN's engines recognise as SDPA. Forward:
 * S = scale Q Kᵀ, the causal mask (row index >= column index, else -inf),
 * softmax with its statistics (max, Σ exp, Stats = max + log Σ exp: the
 * own kernels' lse), O = P V with P in the operands' dtype. Backward:
 * δ = rowsum(dO ∘ O) (softmax_sum), P = exp(scale Q Kᵀ - Stats) masked,
 * dV = Pᵀ dO, dS = P ∘ (dO Vᵀ - δ) scale, dK = dSᵀ Q, dQ = dS K through an
 * FP32 accumulator (added with atomics: not bitwise repeatable, hence
 * HT_CUDA_ATTENTION_REPEATABLE), grouped-query heads summed by reductions.
 * q, k, v, dO (and O for backward) are rounded once a call into 16-bit
 * copies in the backend's scratch, as flash.cu's; O, dQ, dK and dV come out
 * in the operands' dtype and are widened to the entries' FP32, lse in FP32
 * (docs/NUMERICS.md, "Attention").
 *
 * One plan per shape (forward or backward, B, T, H, KV, Dk, Dv, dtype; the
 * scale is passed by value), made at the shape's first call; under
 * HT_CUDA_ATTENTION_AUTO that call also times cuDNN and the own kernels
 * (a warm-up each, then three calls each) and keeps the faster for the
 * process, logged. */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/cuda.cuh"

static ht_cuda_attention g_attention_policy = HT_CUDA_ATTENTION_AUTO;
static int64_t g_cudnn_calls;

extern "C" ht_cuda_attention ht_kernels_cuda_set_attention(ht_cuda_attention how) {
    ht_cuda_attention was = g_attention_policy;
    g_attention_policy = how;
    return was;
}

extern "C" int64_t ht_kernels_cuda_cudnn_calls(void) { return g_cudnn_calls; }

#if defined(HT_CUDNN) && !defined(HT_CUDA_EMU)

#include <cudnn_graph.h>
#include <dlfcn.h>

/* ---------------------------------------------------------------- the library */

static struct {
    bool tried, ok;
    char about[192]; /* the version, or why it did not open */
    void *lib;
    size_t version;
    cudnnHandle_t handle;
    decltype(&::cudnnGetVersion) get_version;
    decltype(&::cudnnGetErrorString) error_string;
    decltype(&::cudnnGetLastErrorString) last_error; /* may be NULL */
    decltype(&::cudnnCreate) create;
    decltype(&::cudnnSetStream) set_stream;
    decltype(&::cudnnBackendCreateDescriptor) create_desc;
    decltype(&::cudnnBackendDestroyDescriptor) destroy_desc;
    decltype(&::cudnnBackendSetAttribute) set_attr;
    decltype(&::cudnnBackendGetAttribute) get_attr;
    decltype(&::cudnnBackendFinalize) finalize;
    decltype(&::cudnnBackendExecute) execute;
} g_cudnn;

/* libcudnn.so.9 from the loader's search path (LD_LIBRARY_PATH, the system's;
 * PyTorch's wheel keeps it in nvidia/cudnn/lib), its entry points, a handle. */
static bool cd_open(void) {
    if (g_cudnn.tried) return g_cudnn.ok;
    g_cudnn.tried = true;
    const char *names[] = {"libcudnn.so.9", "libcudnn.so"};
    const char *why = "not found";
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !g_cudnn.lib; i++) {
        g_cudnn.lib = dlopen(names[i], RTLD_NOW | RTLD_GLOBAL);
        if (!g_cudnn.lib && dlerror() && i == 0) why = "libcudnn.so.9 is not on the loader's search path";
    }
    if (!g_cudnn.lib) {
        snprintf(g_cudnn.about, sizeof(g_cudnn.about), "cuDNN did not open: %s", why);
        ht_log_info("cuda: %s; attention runs on the own kernels", g_cudnn.about);
        return false;
    }
    bool all = true;
#define CD_SYM(field, name)                                                                                            \
    do {                                                                                                               \
        *(void **)&g_cudnn.field = dlsym(g_cudnn.lib, name);                                                           \
        if (!g_cudnn.field && strcmp(name, "cudnnGetLastErrorString") != 0) all = false;                               \
    } while (0)
    CD_SYM(get_version, "cudnnGetVersion");
    CD_SYM(error_string, "cudnnGetErrorString");
    CD_SYM(last_error, "cudnnGetLastErrorString");
    CD_SYM(create, "cudnnCreate");
    CD_SYM(set_stream, "cudnnSetStream");
    CD_SYM(create_desc, "cudnnBackendCreateDescriptor");
    CD_SYM(destroy_desc, "cudnnBackendDestroyDescriptor");
    CD_SYM(set_attr, "cudnnBackendSetAttribute");
    CD_SYM(get_attr, "cudnnBackendGetAttribute");
    CD_SYM(finalize, "cudnnBackendFinalize");
    CD_SYM(execute, "cudnnBackendExecute");
#undef CD_SYM
    if (!all) {
        snprintf(g_cudnn.about, sizeof(g_cudnn.about), "libcudnn lacks the backend graph API's entry points");
    } else if ((g_cudnn.version = g_cudnn.get_version()) < 90000) {
        snprintf(g_cudnn.about, sizeof(g_cudnn.about), "cuDNN %zu is older than 9", g_cudnn.version);
    } else {
        cudnnStatus_t s = g_cudnn.create(&g_cudnn.handle);
        if (s == CUDNN_STATUS_SUCCESS) {
            snprintf(g_cudnn.about, sizeof(g_cudnn.about), "cuDNN %zu.%zu.%zu", g_cudnn.version / 10000,
                     g_cudnn.version / 100 % 100, g_cudnn.version % 100);
            g_cudnn.ok = true;
            ht_log_info("cuda: %s opened: attention with 16-bit operands may run on it", g_cudnn.about);
            return true;
        }
        snprintf(g_cudnn.about, sizeof(g_cudnn.about), "cudnnCreate: %s", g_cudnn.error_string(s));
    }
    ht_log_info("cuda: %s; attention runs on the own kernels", g_cudnn.about);
    return false;
}

extern "C" bool ht_kernels_cuda_cudnn(char *about, size_t n) {
    bool ok = cuda_context_get(NULL) != NULL && cd_open();
    if (n) snprintf(about, n, "%s", g_cudnn.tried ? g_cudnn.about : "no CUDA device");
    return ok;
}

/* ---------------------------------------------------------------- building a graph */

enum {
    CD_MAX_DESC = 160, /* the descriptors one graph keeps: tensors, operations, the plan's */
    CD_MAX_OPS = 48,
    CD_MAX_PLANS = 64, /* shapes with a plan (forward and backward apart) */
    CD_REPS = 3,       /* timed calls of each side */
};

/* The tensors' unique ids: the ones the variant pack binds; virtual tensors count up from CD_VIRTUAL. */
enum {
    CD_Q = 1,
    CD_K,
    CD_V,
    CD_O,
    CD_STATS,
    CD_SCALE,
    CD_NEG_INF,
    CD_DO,
    CD_DQ,
    CD_DK,
    CD_DV,
    CD_ONE,
    CD_SOFTMAX_SUM,
    CD_DQ_ACCUM,
    CD_VIRTUAL = 100
};

/* A graph under construction: every descriptor it made (kept while its plan
 * lives), its operations, and its first failure. */
typedef struct cd_graph {
    cudnnBackendDescriptor_t desc[CD_MAX_DESC];
    int ndesc;
    cudnnBackendDescriptor_t ops[CD_MAX_OPS];
    int nops;
    int64_t next_uid;
    cudnnStatus_t status;
    char failure[256];
} cd_graph;

typedef struct cd_tensor {
    cudnnBackendDescriptor_t desc;
    int64_t uid;
} cd_tensor;

static bool cd_check(cd_graph *g, cudnnStatus_t s, const char *what) {
    if (s == CUDNN_STATUS_SUCCESS || g->status != CUDNN_STATUS_SUCCESS) return g->status == CUDNN_STATUS_SUCCESS;
    g->status = s;
    char last[160] = "";
    if (g_cudnn.last_error) g_cudnn.last_error(last, sizeof(last));
    snprintf(g->failure, sizeof(g->failure), "%s: %s%s%s", what, g_cudnn.error_string(s), last[0] ? ": " : "", last);
    return false;
}

static cudnnBackendDescriptor_t cd_new(cd_graph *g, cudnnBackendDescriptorType_t type, const char *what) {
    cudnnBackendDescriptor_t d = NULL;
    if (g->status != CUDNN_STATUS_SUCCESS) return NULL;
    if (g->ndesc == CD_MAX_DESC) {
        cd_check(g, CUDNN_STATUS_NOT_SUPPORTED, "too many descriptors for one graph");
        return NULL;
    }
    if (!cd_check(g, g_cudnn.create_desc(type, &d), what)) return NULL;
    g->desc[g->ndesc++] = d;
    return d;
}

static void cd_set(cd_graph *g, cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name,
                   cudnnBackendAttributeType_t type, int64_t count, const void *value, const char *what) {
    if (g->status == CUDNN_STATUS_SUCCESS) cd_check(g, g_cudnn.set_attr(d, name, type, count, value), what);
}

static void cd_finalize(cd_graph *g, cudnnBackendDescriptor_t d, const char *what) {
    if (g->status == CUDNN_STATUS_SUCCESS) cd_check(g, g_cudnn.finalize(d), what);
}

/* A tensor of `nd` dims; uid 0: a virtual one with the next id. By-value tensors are host scalars. */
static cd_tensor cd_tensor_new(cd_graph *g, cudnnDataType_t type, int nd, const int64_t *dim, const int64_t *stride,
                               int64_t uid, bool by_value) {
    cd_tensor t = {cd_new(g, CUDNN_BACKEND_TENSOR_DESCRIPTOR, "tensor"), uid ? uid : g->next_uid++};
    const int64_t align = 16;
    const bool virt = uid == 0;
    cd_set(g, t.desc, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type, "tensor data type");
    cd_set(g, t.desc, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, nd, dim, "tensor dims");
    cd_set(g, t.desc, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, nd, stride, "tensor strides");
    cd_set(g, t.desc, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &t.uid, "tensor id");
    cd_set(g, t.desc, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align, "tensor alignment");
    if (virt) cd_set(g, t.desc, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt, "tensor virtual");
    if (by_value) cd_set(g, t.desc, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value, "tensor by value");
    cd_finalize(g, t.desc, "tensor");
    return t;
}

/* A (d0, d1, d2, d3) tensor of the given strides. */
static cd_tensor cd_tensor4(cd_graph *g, cudnnDataType_t type, int64_t d0, int64_t d1, int64_t d2, int64_t d3,
                            int64_t s0, int64_t s1, int64_t s2, int64_t s3, int64_t uid) {
    const int64_t dim[4] = {d0, d1, d2, d3}, stride[4] = {s0, s1, s2, s3};
    return cd_tensor_new(g, type, 4, dim, stride, uid, false);
}

/* A host FP32 scalar bound at each call (the scale, -inf, 1). */
static cd_tensor cd_scalar(cd_graph *g, int64_t uid) {
    const int64_t ones[4] = {1, 1, 1, 1}; /* as many dims as the tensors it meets */
    return cd_tensor_new(g, CUDNN_DATA_FLOAT, 4, ones, ones, uid, true);
}

static void cd_op(cd_graph *g, cudnnBackendDescriptor_t op, const char *what) {
    cd_finalize(g, op, what);
    if (g->status != CUDNN_STATUS_SUCCESS) return;
    if (g->nops == CD_MAX_OPS) {
        cd_check(g, CUDNN_STATUS_NOT_SUPPORTED, "too many operations for one graph");
        return;
    }
    g->ops[g->nops++] = op;
}

/* y = mode(x[, b][, t]) elementwise (b, t broadcast), computed in `math`; axis for GEN_INDEX. */
static void cd_pointwise(cd_graph *g, cudnnPointwiseMode_t mode, cudnnDataType_t math, cd_tensor x, const cd_tensor *b,
                         const cd_tensor *t, cd_tensor y, int64_t axis) {
    cudnnBackendDescriptor_t pw = cd_new(g, CUDNN_BACKEND_POINTWISE_DESCRIPTOR, "pointwise");
    cd_set(g, pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode, "pointwise mode");
    cd_set(g, pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &math, "pointwise precision");
    if (axis >= 0) cd_set(g, pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis, "pointwise axis");
    cd_finalize(g, pw, "pointwise");
    cudnnBackendDescriptor_t op = cd_new(g, CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, "pointwise operation");
    cd_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw, "pointwise op");
    cd_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, "pointwise x");
    if (b)
        cd_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b->desc, "pointwise b");
    if (t)
        cd_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t->desc, "pointwise t");
    cd_set(g, op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, "pointwise y");
    cd_op(g, op, "pointwise operation");
}

/* y = x reduced (ADD, MAX) over the dims where y has 1, in FP32. */
static void cd_reduction(cd_graph *g, cudnnReduceTensorOp_t how, cd_tensor x, cd_tensor y) {
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t r = cd_new(g, CUDNN_BACKEND_REDUCTION_DESCRIPTOR, "reduction");
    cd_set(g, r, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &how, "reduction operator");
    cd_set(g, r, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "reduction precision");
    cd_finalize(g, r, "reduction");
    cudnnBackendDescriptor_t op = cd_new(g, CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, "reduction operation");
    cd_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &r, "reduction op");
    cd_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, "reduction x");
    cd_set(g, op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, "reduction y");
    cd_op(g, op, "reduction operation");
}

/* c = a b over the last two dims (batch dims broadcast), accumulated in FP32. */
static void cd_matmul(cd_graph *g, cd_tensor a, cd_tensor b, cd_tensor c) {
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cudnnBackendDescriptor_t mm = cd_new(g, CUDNN_BACKEND_MATMUL_DESCRIPTOR, "matmul");
    cd_set(g, mm, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32, "matmul precision");
    cd_finalize(g, mm, "matmul");
    cudnnBackendDescriptor_t op = cd_new(g, CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, "matmul operation");
    cd_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a.desc, "matmul a");
    cd_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b.desc, "matmul b");
    cd_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c.desc, "matmul c");
    cd_set(g, op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &mm, "matmul op");
    cd_op(g, op, "matmul operation");
}

/* y = x seen through other dims and strides (a transpose), no data moved. */
static void cd_reshape(cd_graph *g, cd_tensor x, cd_tensor y) {
    cudnnBackendDescriptor_t op = cd_new(g, CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, "reshape operation");
    cd_set(g, op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x.desc, "reshape x");
    cd_set(g, op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y.desc, "reshape y");
    cd_op(g, op, "reshape operation");
}

/* The dims of one call: b, h (query heads), g (key heads), s (tokens), dk, dv. */
typedef struct cd_dims {
    int64_t b, h, g, s, dk, dv;
    cudnnDataType_t io;
} cd_dims;

/* A (b, heads, s, s) FP32 score tensor, row-major. */
static cd_tensor cd_scores(cd_graph *g, const cd_dims &d, cudnnDataType_t type) {
    return cd_tensor4(g, type, d.b, d.h, d.s, d.s, d.h * d.s * d.s, d.s * d.s, d.s, 1, 0);
}

/* A (b, h, s, 1) FP32 row statistic. */
static cd_tensor cd_rows(cd_graph *g, const cd_dims &d, int64_t uid) {
    return cd_tensor4(g, CUDNN_DATA_FLOAT, d.b, d.h, d.s, 1, d.h * d.s, d.s, 1, 1, uid);
}

/* The causal mask on scores x (keep key j of query i where i >= j, else -inf): y. */
static cd_tensor cd_causal(cd_graph *g, const cd_dims &d, cd_tensor x, cd_tensor neg_inf) {
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT, boolean = CUDNN_DATA_BOOLEAN;
    cd_tensor row = cd_scores(g, d, CUDNN_DATA_INT32), col = cd_scores(g, d, CUDNN_DATA_INT32);
    cd_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, f32, x, NULL, NULL, row, 2);
    cd_pointwise(g, CUDNN_POINTWISE_GEN_INDEX, f32, x, NULL, NULL, col, 3);
    cd_tensor keep = cd_scores(g, d, CUDNN_DATA_BOOLEAN), y = cd_scores(g, d, CUDNN_DATA_FLOAT);
    cd_pointwise(g, CUDNN_POINTWISE_CMP_GE, boolean, row, &col, NULL, keep, -1);
    cd_pointwise(g, CUDNN_POINTWISE_BINARY_SELECT, f32, x, &neg_inf, &keep, y, -1);
    return y;
}

/* Q (b, h, s, dk), K (b, g, s, dk), V (b, g, s, dv), O and dO (b, h, s, dv) over the entries' (B, T, heads, D) rows. */
static cd_tensor cd_rows_of(cd_graph *g, const cd_dims &d, int64_t heads, int64_t D, int64_t uid) {
    return cd_tensor4(g, d.io, d.b, heads, d.s, D, d.s * heads * D, D, heads * D, 1, uid);
}
/* The same rows seen transposed: (b, heads, D, s). */
static cd_tensor cd_rows_t(cd_graph *g, const cd_dims &d, int64_t heads, int64_t D, int64_t uid) {
    return cd_tensor4(g, d.io, d.b, heads, D, d.s, d.s * heads * D, D, 1, heads * D, uid);
}

static void cd_forward_graph(cd_graph *g, const cd_dims &d) {
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cd_tensor q = cd_rows_of(g, d, d.h, d.dk, CD_Q), kt = cd_rows_t(g, d, d.g, d.dk, CD_K);
    cd_tensor v = cd_rows_of(g, d, d.g, d.dv, CD_V), o = cd_rows_of(g, d, d.h, d.dv, CD_O);
    cd_tensor stats = cd_rows(g, d, CD_STATS), scale = cd_scalar(g, CD_SCALE), neg_inf = cd_scalar(g, CD_NEG_INF);
    cd_tensor s = cd_scores(g, d, f32), ss = cd_scores(g, d, f32);
    cd_matmul(g, q, kt, s);
    cd_pointwise(g, CUDNN_POINTWISE_MUL, f32, s, &scale, NULL, ss, -1);
    cd_tensor masked = cd_causal(g, d, ss, neg_inf);
    cd_tensor mx = cd_rows(g, d, 0), shifted = cd_scores(g, d, f32), e = cd_scores(g, d, f32), sum = cd_rows(g, d, 0);
    cd_tensor logsum = cd_rows(g, d, 0), p = cd_scores(g, d, d.io);
    cd_reduction(g, CUDNN_REDUCE_TENSOR_MAX, masked, mx);
    cd_pointwise(g, CUDNN_POINTWISE_SUB, f32, masked, &mx, NULL, shifted, -1);
    cd_pointwise(g, CUDNN_POINTWISE_EXP, f32, shifted, NULL, NULL, e, -1);
    cd_reduction(g, CUDNN_REDUCE_TENSOR_ADD, e, sum);
    cd_pointwise(g, CUDNN_POINTWISE_LOG, f32, sum, NULL, NULL, logsum, -1);
    cd_pointwise(g, CUDNN_POINTWISE_ADD, f32, mx, &logsum, NULL, stats, -1);
    cd_pointwise(g, CUDNN_POINTWISE_DIV, f32, e, &sum, NULL, p, -1);
    cd_matmul(g, p, v, o);
}

/* dX (b, g, s, D) from the query heads' (b, h, s, D) product: itself (g == h) or the group's sum. */
static void cd_head_sum(cd_graph *g, const cd_dims &d, cd_tensor a, cd_tensor b, int64_t D, cd_tensor out) {
    if (d.g == d.h) {
        cd_matmul(g, a, b, out);
        return;
    }
    cd_tensor full = cd_tensor4(g, d.io, d.b, d.h, d.s, D, d.h * d.s * D, d.s * D, D, 1, 0);
    cd_matmul(g, a, b, full);
    cd_reduction(g, CUDNN_REDUCE_TENSOR_ADD, full, out);
}

static void cd_backward_graph(cd_graph *g, const cd_dims &d) {
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    cd_tensor q = cd_rows_of(g, d, d.h, d.dk, CD_Q), kt = cd_rows_t(g, d, d.g, d.dk, CD_K);
    cd_tensor vt = cd_rows_t(g, d, d.g, d.dv, CD_V), o = cd_rows_of(g, d, d.h, d.dv, CD_O);
    cd_tensor dout = cd_rows_of(g, d, d.h, d.dv, CD_DO), stats = cd_rows(g, d, CD_STATS);
    cd_tensor dq = cd_rows_of(g, d, d.h, d.dk, CD_DQ), dk = cd_rows_of(g, d, d.g, d.dk, CD_DK);
    cd_tensor dv = cd_rows_of(g, d, d.g, d.dv, CD_DV);
    cd_tensor scale = cd_scalar(g, CD_SCALE), neg_inf = cd_scalar(g, CD_NEG_INF), one = cd_scalar(g, CD_ONE);
    /* δ = rowsum(dO ∘ O), into the workspace's softmax_sum */
    cd_tensor prod = cd_tensor4(g, f32, d.b, d.h, d.s, d.dv, d.h * d.s * d.dv, d.s * d.dv, d.h * d.dv, 1, 0);
    cd_tensor rowsum = cd_rows(g, d, 0), delta = cd_rows(g, d, CD_SOFTMAX_SUM);
    cd_pointwise(g, CUDNN_POINTWISE_MUL, f32, dout, &o, NULL, prod, -1);
    cd_reduction(g, CUDNN_REDUCE_TENSOR_ADD, prod, rowsum);
    cd_pointwise(g, CUDNN_POINTWISE_MUL, f32, rowsum, &one, NULL, delta, -1);
    /* P = exp(scale Q Kᵀ - Stats), masked */
    cd_tensor s = cd_scores(g, d, f32), ss = cd_scores(g, d, f32), sm = cd_scores(g, d, f32);
    cd_matmul(g, q, kt, s);
    cd_pointwise(g, CUDNN_POINTWISE_MUL, f32, s, &scale, NULL, ss, -1);
    cd_pointwise(g, CUDNN_POINTWISE_SUB, f32, ss, &stats, NULL, sm, -1);
    cd_tensor masked = cd_causal(g, d, sm, neg_inf), p = cd_scores(g, d, f32);
    cd_pointwise(g, CUDNN_POINTWISE_EXP, f32, masked, NULL, NULL, p, -1);
    /* dV = Pᵀ dO */
    const int64_t hss = d.h * d.s * d.s, sss = d.s * d.s;
    cd_tensor pt = cd_tensor4(g, d.io, d.b, d.h, d.s, d.s, hss, sss, 1, d.s, 0);
    cd_reshape(g, p, pt);
    cd_head_sum(g, d, pt, dout, d.dv, dv);
    /* dS = P ∘ (dO Vᵀ - δ) scale */
    cd_tensor dp = cd_scores(g, d, f32), dpd = cd_scores(g, d, f32), dsp = cd_scores(g, d, f32);
    cd_tensor ds = cd_scores(g, d, f32);
    cd_matmul(g, dout, vt, dp);
    cd_pointwise(g, CUDNN_POINTWISE_SUB, f32, dp, &delta, NULL, dpd, -1);
    cd_pointwise(g, CUDNN_POINTWISE_MUL, f32, dpd, &p, NULL, dsp, -1);
    cd_pointwise(g, CUDNN_POINTWISE_MUL, f32, dsp, &scale, NULL, ds, -1);
    /* dK = dSᵀ Q */
    cd_tensor dst = cd_tensor4(g, d.io, d.b, d.h, d.s, d.s, hss, sss, 1, d.s, 0);
    cd_reshape(g, ds, dst);
    cd_head_sum(g, d, dst, q, d.dk, dk);
    /* dQ = dS K through the FP32 accumulator in the workspace */
    cd_tensor k = cd_tensor4(g, d.io, d.b, d.g, d.s, d.dk, d.s * d.g * d.dk, d.dk, d.g * d.dk, 1, 0);
    cd_reshape(g, kt, k);
    cd_tensor acc = cd_tensor4(g, f32, d.b, d.h, d.s, d.dk, d.h * d.s * d.dk, d.s * d.dk, d.dk, 1, CD_DQ_ACCUM);
    cd_matmul(g, ds, k, acc);
    cd_pointwise(g, CUDNN_POINTWISE_IDENTITY, f32, acc, NULL, NULL, dq, -1);
}

/* The operation graph, the heuristics' engine configurations in their order,
 * and the first that makes an execution plan: *plan and its workspace bytes. */
static void cd_plan(cd_graph *g, cudnnBackendDescriptor_t *plan, int64_t *workspace) {
    *plan = NULL;
    cudnnBackendDescriptor_t graph = cd_new(g, CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR, "operation graph");
    cd_set(g, graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, g->nops, g->ops, "graph ops");
    if (g_cudnn.handle)
        cd_set(g, graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &g_cudnn.handle, "graph handle");
    cd_finalize(g, graph, "operation graph");
    const cudnnBackendHeurMode_t mode = CUDNN_HEUR_MODE_A;
    cudnnBackendDescriptor_t heur = cd_new(g, CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR, "heuristics");
    cd_set(g, heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph, "heur graph");
    cd_set(g, heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode, "heur mode");
    cd_finalize(g, heur, "heuristics (no engine for this graph)");
    int64_t count = 0;
    if (g->status == CUDNN_STATUS_SUCCESS)
        cd_check(g,
                 g_cudnn.get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, NULL),
                 "heuristics' count");
    if (g->status != CUDNN_STATUS_SUCCESS) return;
    if (count <= 0) {
        cd_check(g, CUDNN_STATUS_NOT_SUPPORTED, "heuristics: no engine configuration for this graph");
        return;
    }
    if (count > 8) count = 8;
    cudnnBackendDescriptor_t cfg[8];
    for (int64_t i = 0; i < count; i++) cfg[i] = cd_new(g, CUDNN_BACKEND_ENGINECFG_DESCRIPTOR, "engine config");
    int64_t got = 0;
    if (g->status == CUDNN_STATUS_SUCCESS)
        cd_check(g,
                 g_cudnn.get_attr(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, cfg),
                 "heuristics' results");
    char first[256] = "";
    for (int64_t i = 0; i < got && g->status == CUDNN_STATUS_SUCCESS; i++) {
        cudnnBackendDescriptor_t p = cd_new(g, CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, "execution plan");
        cd_set(g, p, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &g_cudnn.handle, "plan handle");
        cd_set(g, p, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &cfg[i], "plan config");
        cd_finalize(g, p, "execution plan");
        int64_t n = 0;
        if (g->status == CUDNN_STATUS_SUCCESS)
            cd_check(g,
                     g_cudnn.get_attr(p, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &n, workspace),
                     "plan workspace");
        if (g->status == CUDNN_STATUS_SUCCESS) {
            *plan = p;
            return;
        }
        /* this configuration does not build here (an engine that needs NVRTC, say): the next one */
        if (!first[0]) memcpy(first, g->failure, sizeof(first));
        g->status = CUDNN_STATUS_SUCCESS;
    }
    if (g->status == CUDNN_STATUS_SUCCESS) {
        cd_check(g, CUDNN_STATUS_NOT_SUPPORTED, "no engine configuration made a plan");
        if (first[0]) snprintf(g->failure, sizeof(g->failure), "no configuration made a plan: %.200s", first);
    }
}

/* ---------------------------------------------------------------- plans per shape, and the choice */

typedef enum cd_choice { CD_UNTIMED = 0, CD_USE_CUDNN, CD_USE_OWN } cd_choice;

typedef struct cd_entry {
    bool forward;
    int64_t B, T, H, KV, Dk, Dv;
    ht_dtype dtype;
    cd_graph *graph;               /* its descriptors, kept while the plan lives */
    cudnnBackendDescriptor_t plan; /* NULL: cuDNN does not take this shape */
    int64_t workspace;
    cd_choice choice;
} cd_entry;

static cd_entry g_plans[CD_MAX_PLANS];
static int g_nplans;

static const char *cd_dtype_name(ht_dtype t) { return t == HT_DTYPE_BF16 ? "bf16" : "f16"; }

static void cd_describe(const cd_entry *e, char *buf, size_t n) {
    snprintf(buf, n, "attention %s B %lld T %lld H %lld KV %lld Dk %lld Dv %lld %s",
             e->forward ? "forward" : "backward", (long long)e->B, (long long)e->T, (long long)e->H, (long long)e->KV,
             (long long)e->Dk, (long long)e->Dv, cd_dtype_name(e->dtype));
}

/* The shape's entry, its plan made on first sight; NULL when the table is full. */
static cd_entry *cd_entry_of(const cuda_flash_call *c) {
    const ht_attention_shape *a = c->shape;
    for (int i = 0; i < g_nplans; i++) {
        cd_entry *e = &g_plans[i];
        if (e->forward == c->forward && e->B == a->B && e->T == a->T && e->H == a->H && e->KV == a->KV &&
            e->Dk == a->Dk && e->Dv == a->Dv && e->dtype == c->dtype)
            return e;
    }
    if (g_nplans == CD_MAX_PLANS) {
        static bool said;
        if (!said)
            ht_log_info("cuda: cuDNN attention keeps %d shapes' plans; further shapes run the own kernels",
                        CD_MAX_PLANS);
        said = true;
        return NULL;
    }
    cd_entry *e = &g_plans[g_nplans++];
    *e = cd_entry{c->forward, a->B, a->T, a->H, a->KV, a->Dk, a->Dv, c->dtype, NULL, NULL, 0, CD_UNTIMED};
    cd_graph *g = (cd_graph *)calloc(1, sizeof(cd_graph));
    if (!g) return e; /* no plan: the own kernels */
    g->next_uid = CD_VIRTUAL;
    const cd_dims d = {
        a->B, a->H, a->KV, a->T, a->Dk, a->Dv, c->dtype == HT_DTYPE_BF16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF};
    if (c->forward)
        cd_forward_graph(g, d);
    else
        cd_backward_graph(g, d);
    cd_plan(g, &e->plan, &e->workspace);
    e->graph = g;
    char what[160];
    cd_describe(e, what, sizeof(what));
    if (!e->plan)
        ht_log_info("cuda: cuDNN does not take %s (%s): the own kernels run it", what, g->failure);
    else
        ht_log_debug("cuda: cuDNN plan for %s, workspace %lld bytes", what, (long long)e->workspace);
    return e;
}

/* The 16-bit copies the graphs read and write. */
__global__ void cd_round_kernel(uint16_t *dst, const float *x, int64_t n, bool bf16) {
    CUDA_FOR(i, n) dst[i] = dev_to16(x[i], bf16);
}
__global__ void cd_widen_kernel(float *dst, const uint16_t *x, int64_t n, bool bf16) {
    CUDA_FOR(i, n) dst[i] = dev_from16(x[i], bf16);
}

static size_t cd_block(size_t bytes) { return (bytes + 255) / 256 * 256; }
static char *cd_take(char *&at, size_t bytes) {
    char *p = at;
    at += cd_block(bytes);
    return p;
}
static uint16_t *cd_round(char *&at, const float *x, int64_t n, bool bf16) {
    uint16_t *d = (uint16_t *)cd_take(at, (size_t)n * 2);
    LAUNCH("attention (cuDNN's 16-bit operands)", cd_round_kernel, cuda_blocks(n), CUDA_THREADS, d, x, n, bf16);
    return d;
}
static void cd_widen(float *dst, const uint16_t *x, int64_t n, bool bf16) {
    LAUNCH("attention (cuDNN's results)", cd_widen_kernel, cuda_blocks(n), CUDA_THREADS, dst, x, n, bf16);
}

/* One call on the entry's plan: false (logged) when cuDNN refused to run it. */
static bool cd_run(const cuda_flash_call *c, cd_entry *e) {
    const ht_attention_shape *a = c->shape;
    const bool bf16 = c->dtype == HT_DTYPE_BF16;
    const int64_t nq = a->B * a->T * a->H * a->Dk, nk = a->B * a->T * a->KV * a->Dk;
    const int64_t nv = a->B * a->T * a->KV * a->Dv, no = a->B * a->T * a->H * a->Dv, nl = a->B * a->H * a->T;
    size_t bytes = cd_block(nq * 2) + cd_block(nk * 2) + cd_block(nv * 2) + cd_block(no * 2) + cd_block(nl * 4);
    if (!c->forward) /* dO, dQ, dK, dV, softmax_sum, the dQ accumulator */
        bytes += cd_block(no * 2) + cd_block(nq * 2) + cd_block(nk * 2) + cd_block(nv * 2) + cd_block(nl * 4) +
                 cd_block(nq * 4);
    bytes += cd_block((size_t)e->workspace);
    char *at = (char *)cuda_scratch(bytes);
    if (!at) return true; /* the failure is the backend's */
    const float scale = a->scale, neg_inf = g_cudnn.version < 91000 ? -FLT_MAX : -INFINITY, one = 1.0f;
    uint16_t *q16 = cd_round(at, c->q, nq, bf16), *k16 = cd_round(at, c->k, nk, bf16);
    uint16_t *v16 = cd_round(at, c->v, nv, bf16);
    uint16_t *o16 = c->forward ? (uint16_t *)cd_take(at, (size_t)no * 2) : cd_round(at, c->out, no, bf16);
    /* lse through a block of its own: the graph's rows want 16-byte alignment, the caller's need not have it */
    float *stats = (float *)cd_take(at, (size_t)nl * 4);
    if (!c->forward) cuda_copy(stats, c->lse, (size_t)nl * 4);
    int64_t uids[16];
    void *ptrs[16];
    int n = 0;
    uids[n] = CD_Q, ptrs[n++] = q16;
    uids[n] = CD_K, ptrs[n++] = k16;
    uids[n] = CD_V, ptrs[n++] = v16;
    uids[n] = CD_O, ptrs[n++] = o16;
    uids[n] = CD_STATS, ptrs[n++] = stats;
    uids[n] = CD_SCALE, ptrs[n++] = (void *)&scale;
    uids[n] = CD_NEG_INF, ptrs[n++] = (void *)&neg_inf;
    uint16_t *dq16 = NULL, *dk16 = NULL, *dv16 = NULL;
    if (!c->forward) {
        uids[n] = CD_DO, ptrs[n++] = cd_round(at, c->dout, no, bf16);
        uids[n] = CD_DQ, ptrs[n++] = dq16 = (uint16_t *)cd_take(at, (size_t)nq * 2);
        uids[n] = CD_DK, ptrs[n++] = dk16 = (uint16_t *)cd_take(at, (size_t)nk * 2);
        uids[n] = CD_DV, ptrs[n++] = dv16 = (uint16_t *)cd_take(at, (size_t)nv * 2);
        uids[n] = CD_ONE, ptrs[n++] = (void *)&one;
        uids[n] = CD_SOFTMAX_SUM, ptrs[n++] = cd_take(at, (size_t)nl * 4);
        float *acc = (float *)cd_take(at, (size_t)nq * 4);
        cuda_zero(acc, (size_t)nq * 4); /* cuDNN before 9.6 adds into it as it is */
        uids[n] = CD_DQ_ACCUM, ptrs[n++] = acc;
    }
    void *workspace = e->workspace > 0 ? cd_take(at, (size_t)e->workspace) : NULL;
    cd_graph g = {};
    cudnnBackendDescriptor_t pack = cd_new(&g, CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, "variant pack");
    cd_set(&g, pack, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids, "pack ids");
    cd_set(&g, pack, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs, "pack pointers");
    cd_set(&g, pack, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &workspace, "pack workspace");
    cd_finalize(&g, pack, "variant pack");
    if (g.status == CUDNN_STATUS_SUCCESS)
        cd_check(&g, g_cudnn.set_stream(g_cudnn.handle, cuda_ctx()->stream), "stream");
    if (g.status == CUDNN_STATUS_SUCCESS) cd_check(&g, g_cudnn.execute(g_cudnn.handle, e->plan, pack), "execute");
    for (int i = 0; i < g.ndesc; i++) g_cudnn.destroy_desc(g.desc[i]);
    if (g.status != CUDNN_STATUS_SUCCESS) {
        char what[160];
        cd_describe(e, what, sizeof(what));
        ht_log_warn("cuda: cuDNN could not run %s (%s): the own kernels run it from now on", what, g.failure);
        e->plan = NULL;
        return false;
    }
    g_cudnn_calls++;
    if (c->forward) {
        cd_widen(c->out, o16, no, bf16);
        cuda_copy(c->lse, stats, (size_t)nl * 4);
    } else {
        cd_widen(c->dq, dq16, nq, bf16);
        cd_widen(c->dk, dk16, nk, bf16);
        cd_widen(c->dv, dv16, nv, bf16);
    }
    return true;
}

/* Whether cuDNN's graphs express this call: causal self-attention (no block
 * of keys at other positions), no QK-clip maximum, 16-bit operands, whole
 * query groups, head dims that are multiples of 8 (cuDNN refuses the rest
 * itself, at its plan). */
static bool cd_eligible(const cuda_flash_call *c) {
    const ht_attention_shape *a = c->shape;
    const bool self = (a->Tk == 0 || a->Tk == a->T) && a->q0 == a->k0;
    return (c->dtype == HT_DTYPE_BF16 || c->dtype == HT_DTYPE_F16) && !c->head_max && self && a->KV > 0 &&
           a->H % a->KV == 0 && a->Dk % 8 == 0 && a->Dv % 8 == 0 && a->Dk <= 256 && a->Dv <= 256;
}

/* The entry's first call under AUTO: a warm-up of each side, CD_REPS calls of
 * each timed on the stream, the faster kept (cuDNN's last call's results
 * are recomputed by the winner, which runs once more). */
static void cd_time(const cuda_flash_call *c, cd_entry *e, cuda_attention_fn own) {
    cudaStream_t stream = cuda_ctx()->stream;
    cudaEvent_t ev[3];
    for (int i = 0; i < 3; i++)
        if (!cuda_ok(cudaEventCreate(&ev[i]), "attention (timing events)")) return;
    bool ok = cd_run(c, e);
    own(c);
    cudaEventRecord(ev[0], stream);
    for (int r = 0; r < CD_REPS && ok; r++) ok = cd_run(c, e);
    cudaEventRecord(ev[1], stream);
    for (int r = 0; r < CD_REPS; r++) own(c);
    cudaEventRecord(ev[2], stream);
    float ms_cudnn = 0, ms_own = 0;
    if (cuda_ok(cudaEventSynchronize(ev[2]), "attention (timing)")) {
        cudaEventElapsedTime(&ms_cudnn, ev[0], ev[1]);
        cudaEventElapsedTime(&ms_own, ev[1], ev[2]);
    }
    for (int i = 0; i < 3; i++) cudaEventDestroy(ev[i]);
    e->choice = ok && ms_cudnn < ms_own ? CD_USE_CUDNN : CD_USE_OWN;
    char what[160];
    cd_describe(e, what, sizeof(what));
    if (ok)
        ht_log_info("cuda: %s: cuDNN %.3f ms, own kernels %.3f ms: %s", what, ms_cudnn / CD_REPS, ms_own / CD_REPS,
                    e->choice == CD_USE_CUDNN ? "cuDNN" : "the own kernels");
}

bool cuda_cudnn_attention(const cuda_flash_call *c, cuda_attention_fn own) {
    const ht_cuda_attention policy = g_attention_policy;
    if (policy == HT_CUDA_ATTENTION_OWN || !cd_eligible(c)) return false;
    if (!c->forward && policy == HT_CUDA_ATTENTION_REPEATABLE) return false;
    if (!cd_open()) return false;
    cd_entry *e = cd_entry_of(c);
    if (!e || !e->plan) return false;
    if (policy == HT_CUDA_ATTENTION_CUDNN) return cd_run(c, e);
    if (e->choice == CD_UNTIMED) cd_time(c, e, own);
    return e->choice == CD_USE_CUDNN && cd_run(c, e);
}

#else /* no cuDNN headers in this build, or the host emulator */

extern "C" bool ht_kernels_cuda_cudnn(char *about, size_t n) {
#ifdef HT_CUDA_EMU
    const char *why = "the host emulator has no cuDNN";
#else
    const char *why = "this build has no cuDNN headers (HT_CUDNN: cudnn_graph.h not found by CMake)";
#endif
    if (n) snprintf(about, n, "%s", why);
    return false;
}

bool cuda_cudnn_attention(const cuda_flash_call *c, cuda_attention_fn own) {
    (void)c, (void)own;
    return false;
}

#endif
