/* The host side of cuda_emu.h: the fibers a launch runs a block's threads
 * on, and the CUDA runtime and cuBLASLt calls the backend makes, on host
 * memory (one emulated device of compute capability 9.0; every copy and
 * fill done when called, so a stream is always synchronised). Device
 * memory is tracked by address, so cudaPointerGetAttributes tells it from
 * the host's. cublasLtMatmul computes D = alpha op(A) op(B) + beta C
 * column-major from its descriptors' transposes, layouts and batches, each
 * sum in FP32 in k order (the tensor cores' order is not modelled).
 *
 * HT_EMU_ORDER sets the order the scheduler runs a block's threads in,
 * each until it waits: "forward" (the default: thread 0 first, every warp
 * one barrier at a time, in step), "reverse" (the last thread first, and
 * the grid's blocks from the last), or "warps" (the last warp first, each
 * running on past its own barriers, shuffles and tensor-core instructions
 * until it waits at the block's, before the next starts: warps out of step,
 * as a GPU's are). A missing __syncthreads is a wrong result in forward or
 * in warps: of the backend's 19, each removed in turn, forward caught 9 and
 * warps 16, together the 17 that guard anything (docs/DESIGN.md, "The CUDA
 * backend without a GPU"; scripts/emu-barriers.sh).
 *
 * The heuristic offers EMU_ALGORITHMS cuBLASLt algorithms, each computing
 * the same; HT_EMU_SLOW_GEMM_ALGO=i makes algorithm i wait 5 ms a call (a
 * slower kernel, for the tests of the choice by timing). Events read the
 * host's clock: the emulated work is done by the time a call returns. */
#undef _FORTIFY_SOURCE /* its longjmp refuses to jump to another stack, as the fibers do */
#include "cuda_emu.h"

#include <setjmp.h>
#include <ucontext.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sys/mman.h>
#include <thread>
#include <vector>

namespace emu {
uint3 thread_idx, block_idx;
dim3 block_dim, grid_dim;
alignas(128) static unsigned char shared_buffer[SHARED_BYTES];
unsigned char *dynamic_shared = shared_buffer;

enum state { RUNNING, AT_BLOCK_BARRIER, AT_WARP_BARRIER, DONE };
/* A thread's fiber: its own stack, entered once through swapcontext, then
 * switched with _setjmp/_longjmp, which leave the signal mask alone (the
 * system call swapcontext makes for it took most of a launch's time). Its
 * loop parks after each body, so one fiber runs thread t of every block. */
struct fiber {
    jmp_buf at_now; /* where it waits: parked, or at a barrier */
    state at;
};
static jmp_buf scheduler;
static std::vector<fiber> fibers;
static std::vector<void *> stacks;
static const size_t STACK_BYTES = 256 << 10;
static unsigned current;
static const std::function<void()> *body_now;
static double slots[32][32];
alignas(16) static unsigned char exchange[32][WARP_EXCHANGE_BYTES];
static cudaError_t pending = cudaSuccess; /* cudaGetLastError's */

/* Back to the scheduler, to be resumed where fiber `current` stands now. */
static void yield_fiber() {
    if (_setjmp(fibers[current].at_now) == 0) _longjmp(scheduler, 1);
}

static void fiber_loop() {
    for (;;) {
        fibers[current].at = DONE;
        yield_fiber(); /* parked until start(): then the next block's body */
        (*body_now)();
    }
}

/* A new fiber on stack t, parked (the one swapcontext of its life). */
__attribute__((noinline)) static void create(unsigned t) {
    static ucontext_t from, entry;
    getcontext(&entry);
    entry.uc_stack.ss_sp = stacks[t];
    entry.uc_stack.ss_size = STACK_BYTES;
    entry.uc_link = nullptr; /* the loop never returns */
    makecontext(&entry, fiber_loop, 0);
    current = t;
    if (_setjmp(scheduler) == 0) swapcontext(&from, &entry);
}

/* Runs fiber t until it waits or ends. */
__attribute__((noinline)) static void resume(unsigned t) {
    current = t;
    if (_setjmp(scheduler) == 0) _longjmp(fibers[t].at_now, 1);
}

/* Fiber t, ready to run the body from its start. */
static void start(unsigned t) { fibers[t].at = RUNNING; }

static void wait_at(state s) {
    fibers[current].at = s;
    yield_fiber();
}
void block_barrier() { wait_at(AT_BLOCK_BARRIER); }
void warp_barrier() { wait_at(AT_WARP_BARRIER); }
double *warp_slots() { return slots[(current / 32) % 32]; }
unsigned char *warp_exchange() { return exchange[(current / 32) % 32]; }

/* Releases warp w's lanes (of a block of n threads) if every live one waits
 * at its barrier. */
static bool release_warp(unsigned w, unsigned n) {
    unsigned waiting = 0, live = 0;
    for (unsigned t = w * 32; t < n && t < w * 32 + 32; t++) {
        if (fibers[t].at != DONE) live++;
        if (fibers[t].at == AT_WARP_BARRIER) waiting++;
    }
    if (waiting == 0 || waiting != live) return false;
    for (unsigned t = w * 32; t < n && t < w * 32 + 32; t++)
        if (fibers[t].at == AT_WARP_BARRIER) fibers[t].at = RUNNING;
    return true;
}

/* Releases the threads whose barrier every live thread it names has
 * reached; false if none could be (a deadlock). */
static bool release(unsigned n) {
    bool any = false;
    for (unsigned w = 0; w * 32 < n; w++) any |= release_warp(w, n);
    if (any) return true;
    unsigned waiting = 0, live = 0;
    for (unsigned t = 0; t < n; t++) {
        if (fibers[t].at != DONE) live++;
        if (fibers[t].at == AT_BLOCK_BARRIER) waiting++;
    }
    if (waiting == 0 || waiting != live) return false;
    for (unsigned t = 0; t < n; t++)
        if (fibers[t].at == AT_BLOCK_BARRIER) fibers[t].at = RUNNING;
    return true;
}

enum order { FORWARD, REVERSE, WARPS };
static order order_from_env() {
    const char *o = getenv("HT_EMU_ORDER");
    if (!o || !*o || strcmp(o, "forward") == 0) return FORWARD;
    if (strcmp(o, "reverse") == 0) return REVERSE;
    if (strcmp(o, "warps") == 0) return WARPS;
    fprintf(stderr, "emu: HT_EMU_ORDER=%s: expected forward, reverse or warps\n", o);
    abort();
}

/* The order of the passes over a block's n threads. */
static void draw_order(std::vector<unsigned> &perm, unsigned n, order o) {
    perm.resize(n);
    for (unsigned t = 0; t < n; t++) perm[t] = o == REVERSE ? n - 1 - t : t;
    if (o == WARPS) /* the last warp first, each warp's lanes in order */
        for (unsigned k = 0, w = (n + 31) / 32; w-- > 0;)
            for (unsigned t = w * 32; t < n && t < w * 32 + 32; t++) perm[k++] = t;
}

void launch(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()> &body) {
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> hold(one_at_a_time);
    const unsigned n = block.x * block.y * block.z;
    if (n == 0 || n > 1024 || shared_bytes > SHARED_BYTES || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
        grid.y > 65535 || grid.z > 65535) {
        pending = cudaErrorInvalidConfiguration;
        return;
    }
    while (stacks.size() < n) {
        void *s = mmap(nullptr, STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (s == MAP_FAILED) abort();
        stacks.push_back(s);
        fibers.emplace_back();
        create((unsigned)stacks.size() - 1);
    }
    grid_dim = grid, block_dim = block, body_now = &body;
    static const order o = order_from_env();
    static std::vector<unsigned> perm;
    draw_order(perm, n, o);
    const uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
    for (uint64_t i = 0; i < nblocks; i++) {
        const uint64_t b = o == REVERSE ? nblocks - 1 - i : i;
        const unsigned x = (unsigned)(b % grid.x), y = (unsigned)(b / grid.x % grid.y),
                       z = (unsigned)(b / grid.x / grid.y);
        block_idx = {x, y, z};
        std::memset(shared_buffer, 0xff, shared_bytes);
        for (unsigned t = 0; t < n; t++) start(t);
        for (;;) {
            bool ran = false, left = false;
            for (unsigned k = 0; k < n; k++) {
                const unsigned t = perm[k];
                if (fibers[t].at == RUNNING) {
                    current = t;
                    thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
                    resume(t);
                    ran = true;
                }
                /* warps: a warp's last lane run, the warp goes on past its own barriers until it
                 * waits at the block's (or ends) before the next warp starts */
                if (o == WARPS && (k + 1 == n || perm[k + 1] / 32 != t / 32) && release_warp(t / 32, n))
                    k -= t % 32 + 1; /* this warp's first lane next */
                left |= fibers[t].at != DONE;
            }
            if (!left) break;
            if (!ran && !release(n)) {
                unsigned at[4] = {0, 0, 0, 0};
                for (unsigned t = 0; t < n; t++) at[fibers[t].at]++;
                fprintf(stderr,
                        "emu: block (%u, %u, %u) of (%u, %u, %u) deadlocks: %u threads at __syncthreads, %u "
                        "at __syncwarp (a warp's lanes not all there), %u done\n",
                        x, y, z, grid.x, grid.y, grid.z, at[1], at[2], at[3]);
                abort();
            }
        }
    }
}

/* device memory: each block's size by its address */
static std::map<uintptr_t, size_t> blocks;
static bool on_device(const void *p) {
    auto it = blocks.upper_bound((uintptr_t)p);
    if (it == blocks.begin()) return false;
    --it;
    return (uintptr_t)p < it->first + it->second;
}
static cudaError_t fail(cudaError_t e) {
    pending = e;
    return e;
}
} // namespace emu

using emu::fail;

extern "C" {
cudaError_t cudaGetDeviceCount(int *count) {
    *count = 1;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : fail(cudaErrorInvalidDevice); }
cudaError_t cudaGetDevice(int *device) {
    *device = 0;
    return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
    (void)device;
    std::memset(prop, 0, sizeof(*prop));
    std::snprintf(prop->name, sizeof(prop->name), "emulated device (tests/emu)");
    prop->major = 9, prop->minor = 0, prop->totalGlobalMem = (size_t)1 << 34, prop->multiProcessorCount = 132;
    prop->sharedMemPerBlockOptin = emu::SHARED_BYTES;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    (void)device;
    *value = attr == cudaDevAttrComputeCapabilityMajor ? 9 : attr == cudaDevAttrComputeCapabilityMinor ? 0 : 0;
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned flags) {
    (void)flags;
    static int the_stream;
    *stream = (cudaStream_t)&the_stream;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    (void)stream;
    return cudaSuccess;
}
/* An event: the host's clock when it was last recorded (0: never). */
struct emu_event {
    double ms;
};
cudaError_t cudaEventCreate(cudaEvent_t *e) {
    *e = (cudaEvent_t) new emu_event{0.0};
    return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete (emu_event *)e;
    return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t stream) {
    (void)stream;
    const auto now = std::chrono::steady_clock::now().time_since_epoch();
    ((emu_event *)e)->ms = std::chrono::duration<double, std::milli>(now).count();
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    return ((emu_event *)e)->ms > 0 ? cudaSuccess : fail(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    const emu_event *a = (const emu_event *)start, *b = (const emu_event *)end;
    if (!(a->ms > 0) || !(b->ms > 0)) return fail(cudaErrorInvalidResourceHandle);
    *ms = (float)(b->ms - a->ms);
    return cudaSuccess;
}
cudaError_t cudaMalloc(void **p, size_t bytes) {
    void *b = nullptr;
    if (posix_memalign(&b, 256, bytes ? bytes : 1) != 0) return fail(cudaErrorMemoryAllocation);
    std::memset(b, 0xa5, bytes); /* not zeroed, as the device's */
    emu::blocks[(uintptr_t)b] = bytes ? bytes : 1;
    *p = b;
    return cudaSuccess;
}
cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    auto it = emu::blocks.find((uintptr_t)p);
    if (it == emu::blocks.end()) return fail(cudaErrorInvalidValue);
    emu::blocks.erase(it);
    free(p);
    return cudaSuccess;
}
/* Both ends must be what the kind says: device memory is device memory. */
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    (void)stream;
    const bool dd = emu::on_device(dst), sd = emu::on_device(src);
    const bool ok = kind == cudaMemcpyDefault || (kind == cudaMemcpyHostToDevice && dd && !sd) ||
                    (kind == cudaMemcpyDeviceToHost && !dd && sd) || (kind == cudaMemcpyDeviceToDevice && dd && sd) ||
                    (kind == cudaMemcpyHostToHost && !dd && !sd);
    if (!ok) return fail(cudaErrorInvalidValue);
    if (bytes && dst != src) std::memmove(dst, src, bytes);
    return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream) {
    (void)stream;
    if (bytes && !emu::on_device(p)) return fail(cudaErrorInvalidValue);
    std::memset(p, value, bytes);
    return cudaSuccess;
}
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *a, const void *p) {
    std::memset(a, 0, sizeof(*a));
    a->type = emu::on_device(p) ? cudaMemoryTypeDevice : cudaMemoryTypeUnregistered;
    return cudaSuccess;
}
cudaError_t cudaFuncSetAttribute(const void *func, cudaFuncAttribute attr, int value) {
    (void)func;
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize && value > emu::SHARED_BYTES)
        return fail(cudaErrorInvalidValue);
    return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
    cudaError_t e = emu::pending;
    emu::pending = cudaSuccess;
    return e;
}
const char *cudaGetErrorString(cudaError_t e) {
    return e == cudaSuccess                     ? "no error"
           : e == cudaErrorInvalidValue         ? "invalid argument (emulated)"
           : e == cudaErrorMemoryAllocation     ? "out of memory (emulated)"
           : e == cudaErrorInvalidConfiguration ? "invalid launch configuration (emulated)"
                                                : "error (emulated)";
}
}

/* ---------------------------------------------------------------- cuBLASLt */

namespace {
struct lt_desc {
    cublasOperation_t ta = CUBLAS_OP_N, tb = CUBLAS_OP_N;
};
struct lt_layout {
    cudaDataType_t type;
    uint64_t rows, cols;
    int64_t ld;
    int32_t batch = 1;
    int64_t stride = 0;
};
float load(const void *p, cudaDataType_t t, int64_t i) {
    if (t == CUDA_R_32F) return ((const float *)p)[i];
    if (t == CUDA_R_16BF) return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    return __half2float(((const __half *)p)[i]);
}
} // namespace

extern "C" {
cublasStatus_t cublasLtCreate(cublasLtHandle_t *h) {
    static int the_handle;
    *h = (cublasLtHandle_t)&the_handle;
    return CUBLAS_STATUS_SUCCESS;
}
size_t cublasLtGetVersion(void) { return 0; }
const char *cublasLtGetStatusString(cublasStatus_t s) {
    return s == CUBLAS_STATUS_SUCCESS ? "success (emulated)" : "failure (emulated)";
}
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *d, cublasComputeType_t compute, cudaDataType_t scale) {
    if (compute != CUBLAS_COMPUTE_32F || scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    *d = (cublasLtMatmulDesc_t) new lt_desc;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t d) {
    delete (lt_desc *)d;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t a, const void *buf,
                                              size_t bytes) {
    lt_desc *x = (lt_desc *)d;
    if (bytes != sizeof(cublasOperation_t)) return CUBLAS_STATUS_INVALID_VALUE;
    if (a == CUBLASLT_MATMUL_DESC_TRANSA)
        std::memcpy(&x->ta, buf, bytes);
    else if (a == CUBLASLT_MATMUL_DESC_TRANSB)
        std::memcpy(&x->tb, buf, bytes);
    else
        return CUBLAS_STATUS_NOT_SUPPORTED;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *l, cudaDataType type, uint64_t rows, uint64_t cols,
                                          int64_t ld) {
    if (ld < (int64_t)rows) return CUBLAS_STATUS_INVALID_VALUE; /* column-major: ld at least the rows */
    lt_layout *x = new lt_layout;
    x->type = type, x->rows = rows, x->cols = cols, x->ld = ld;
    *l = (cublasLtMatrixLayout_t)x;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t l) {
    delete (lt_layout *)l;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutSetAttribute(cublasLtMatrixLayout_t l, cublasLtMatrixLayoutAttribute_t a,
                                                const void *buf, size_t bytes) {
    lt_layout *x = (lt_layout *)l;
    if (a == CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT && bytes == 4)
        std::memcpy(&x->batch, buf, 4);
    else if (a == CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET && bytes == 8)
        std::memcpy(&x->stride, buf, 8);
    else
        return CUBLAS_STATUS_NOT_SUPPORTED;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *p) {
    static int the_preference;
    *p = (cublasLtMatmulPreference_t)&the_preference;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t p) {
    (void)p;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t a, const void *buf,
                                                    size_t bytes) {
    (void)p, (void)a, (void)buf, (void)bytes;
    return CUBLAS_STATUS_SUCCESS;
}
/* Whether a product's descriptors agree: op(A) (m, k), op(B) (k, n), C (m, n), one batch count. */
static bool lt_shapes_agree(cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
                            cublasLtMatrixLayout_t c) {
    const lt_desc *x = (const lt_desc *)d;
    const lt_layout *A = (const lt_layout *)a, *B = (const lt_layout *)b, *C = (const lt_layout *)c;
    const uint64_t m = x->ta == CUBLAS_OP_N ? A->rows : A->cols, k = x->ta == CUBLAS_OP_N ? A->cols : A->rows;
    const uint64_t kb = x->tb == CUBLAS_OP_N ? B->rows : B->cols, n = x->tb == CUBLAS_OP_N ? B->cols : B->rows;
    return k == kb && C->rows == m && C->cols == n && A->batch == C->batch && B->batch == C->batch;
}
/* Every algorithm takes every product whose shapes agree, in no workspace. */
cublasStatus_t cublasLtMatmulAlgoCheck(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                       cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c, cublasLtMatrixLayout_t dl,
                                       const cublasLtMatmulAlgo_t *algo, cublasLtMatmulHeuristicResult_t *result) {
    (void)h, (void)dl;
    if (!lt_shapes_agree(d, a, b, c)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memset(result, 0, sizeof(*result));
    result->algo = *algo;
    result->state = CUBLAS_STATUS_SUCCESS;
    return CUBLAS_STATUS_SUCCESS;
}
/* EMU_ALGORITHMS algorithms (data[0] their index) for every product whose shapes agree. */
static const int EMU_ALGORITHMS = 3;
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t a,
                                              cublasLtMatrixLayout_t b, cublasLtMatrixLayout_t c,
                                              cublasLtMatrixLayout_t dl, cublasLtMatmulPreference_t p, int requested,
                                              cublasLtMatmulHeuristicResult_t *results, int *found) {
    (void)h, (void)p, (void)dl;
    if (!lt_shapes_agree(d, a, b, c)) return CUBLAS_STATUS_INVALID_VALUE;
    *found = 0;
    for (int i = 0; i < requested && i < EMU_ALGORITHMS; i++) {
        std::memset(&results[i], 0, sizeof(results[i]));
        results[i].algo.data[0] = (uint64_t)i;
        results[i].state = CUBLAS_STATUS_SUCCESS;
        *found = i + 1;
    }
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t a, const void *B, cublasLtMatrixLayout_t b, const void *beta,
                              const void *C, cublasLtMatrixLayout_t c, void *D, cublasLtMatrixLayout_t dl,
                              const cublasLtMatmulAlgo_t *algo, void *work, size_t work_bytes, cudaStream_t s) {
    (void)h, (void)work, (void)work_bytes, (void)s;
    if (algo->data[0] >= (uint64_t)EMU_ALGORITHMS) return CUBLAS_STATUS_INVALID_VALUE;
    const char *slow = getenv("HT_EMU_SLOW_GEMM_ALGO");
    if (slow && *slow && std::strtoull(slow, nullptr, 10) == algo->data[0])
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    const lt_desc *x = (const lt_desc *)d;
    const lt_layout *la = (const lt_layout *)a, *lb = (const lt_layout *)b, *lc = (const lt_layout *)c;
    const lt_layout *ld = (const lt_layout *)dl;
    if (!emu::on_device(A) || !emu::on_device(B) || !emu::on_device(C) || !emu::on_device(D))
        return CUBLAS_STATUS_INVALID_VALUE;
    const bool ta = x->ta != CUBLAS_OP_N, tb = x->tb != CUBLAS_OP_N;
    const int64_t m = (int64_t)lc->rows, n = (int64_t)lc->cols, k = (int64_t)(ta ? la->rows : la->cols);
    const float al = *(const float *)alpha, be = *(const float *)beta;
    for (int32_t e = 0; e < lc->batch; e++)
        for (int64_t j = 0; j < n; j++)
            for (int64_t i = 0; i < m; i++) {
                float sum = 0.0f;
                for (int64_t l = 0; l < k; l++) {
                    const int64_t ia = e * la->stride + (ta ? i * la->ld + l : l * la->ld + i);
                    const int64_t ib = e * lb->stride + (tb ? l * lb->ld + j : j * lb->ld + l);
                    sum += load(A, la->type, ia) * load(B, lb->type, ib);
                }
                const float cv = be == 0.0f ? 0.0f : ((const float *)C)[e * lc->stride + j * lc->ld + i];
                ((float *)D)[e * ld->stride + j * ld->ld + i] = al * sum + be * cv;
            }
    return CUBLAS_STATUS_SUCCESS;
}
}
