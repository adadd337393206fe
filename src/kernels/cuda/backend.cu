/* The CUDA backend of the kernel table (include/hypertrain/kernels.h): its
 * context (the current device, one stream, cuBLASLt's handle and workspace),
 * its memory entries and the callers' workspaces kept per stream, the first
 * failure, and the table ht_kernels_cuda() returns. The kernels are in
 * gemm.cu, ops.cu, moe.cu and optim.cu. */
#include "kernels/cuda/cuda.cuh"

#include <atomic>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The only global state of the backend: made once, as kernels/cpu/gemm.c's. */
static struct {
    pthread_once_t once;
    bool ready;
    char why_not[HT_ERROR_MSG_MAX]; /* when not ready */
    cuda_context ctx;
    ht_kernel_ops table;
    pthread_mutex_t fail_lock;
    bool failed;
    char failure[HT_ERROR_MSG_MAX];
} g_cuda = {PTHREAD_ONCE_INIT, false, "", {}, {}, PTHREAD_MUTEX_INITIALIZER, false, ""};

bool cuda_fail(const char *what, const char *detail) {
    pthread_mutex_lock(&g_cuda.fail_lock);
    bool first = !g_cuda.failed;
    if (first) {
        snprintf(g_cuda.failure, sizeof(g_cuda.failure), "%s: %s", what, detail);
        g_cuda.failed = true;
    }
    pthread_mutex_unlock(&g_cuda.fail_lock);
    if (first) ht_log(HT_LOG_ERROR, "cuda: %s: %s", what, detail);
    return false;
}

bool cuda_ok(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    return cuda_fail(what, cudaGetErrorString(e));
}

void cuda_check_launch(const char *what) { cuda_ok(cudaGetLastError(), what); }

ht_status cuda_status(ht_error *err) {
    pthread_mutex_lock(&g_cuda.fail_lock);
    bool failed = g_cuda.failed;
    char msg[sizeof(g_cuda.failure)];
    memcpy(msg, g_cuda.failure, sizeof(msg));
    pthread_mutex_unlock(&g_cuda.fail_lock);
    return failed ? ht_fail(err, HT_ERR_INVALID, "a CUDA kernel or product could not run: %s", msg) : HT_OK;
}

cuda_context *cuda_ctx(void) { return &g_cuda.ctx; }

/* ---------------------------------------------------------------- memory */

/* What alloc holds, for peak_bytes: each block's size by its address; and
 * how many blocks were ever held (ht_kernels_cuda_allocations). */
typedef struct held_block {
    void *p;
    size_t bytes;
} held_block;
static struct {
    pthread_mutex_t lock;
    held_block *blocks;
    size_t count, capacity, held, peak;
    int64_t made;
} g_held = {PTHREAD_MUTEX_INITIALIZER, NULL, 0, 0, 0, 0, 0};

static bool hold(void *p, size_t bytes) {
    pthread_mutex_lock(&g_held.lock);
    bool ok = g_held.count < g_held.capacity;
    if (!ok) {
        size_t cap = g_held.capacity ? 2 * g_held.capacity : 256;
        void *b = realloc(g_held.blocks, cap * sizeof(*g_held.blocks));
        if ((ok = b != NULL)) g_held.blocks = (held_block *)b, g_held.capacity = cap;
    }
    if (ok) {
        g_held.blocks[g_held.count++] = {p, bytes};
        g_held.made++;
        g_held.held += bytes;
        if (g_held.held > g_held.peak) g_held.peak = g_held.held;
    }
    pthread_mutex_unlock(&g_held.lock);
    return ok;
}

static void release(void *p) {
    pthread_mutex_lock(&g_held.lock);
    for (size_t i = 0; i < g_held.count; i++)
        if (g_held.blocks[i].p == p) {
            g_held.held -= g_held.blocks[i].bytes;
            g_held.blocks[i] = g_held.blocks[--g_held.count];
            break;
        }
    pthread_mutex_unlock(&g_held.lock);
}

void *cuda_block(size_t bytes) {
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError(); /* an allocation that fails is the caller's NULL, not a failed kernel */
        return NULL;
    }
    if (!hold(p, bytes)) {
        cudaFree(p);
        return NULL;
    }
    return p;
}

void cuda_block_free(void *p) {
    if (!p) return;
    release(p);
    cudaFree(p);
}

/* The kernels' scratch (reduction partials, attention's δ and GQA partials):
 * one block, grown as a call needs, never shrunk. */
void *cuda_scratch(size_t bytes) {
    cuda_context *c = &g_cuda.ctx;
    if (bytes <= c->scratch_bytes) return c->scratch;
    /* cudaFree waits for the device: no queued kernel still reads the old block. */
    if (c->scratch) release(c->scratch), cudaFree(c->scratch);
    size_t want = bytes < ((size_t)1 << 20) ? (size_t)1 << 20 : bytes;
    c->scratch = NULL;
    c->scratch_bytes = 0;
    if (!cuda_ok(cudaMalloc(&c->scratch, want), "cudaMalloc (scratch)")) return NULL;
    (void)hold(c->scratch, want); /* counted in peak_bytes, as alloc's blocks */
    c->scratch_bytes = want;
    return c->scratch;
}

/* The callers' workspaces (ht_kernels_cuda_workspace): one block per stream,
 * grown as a call needs, never shrunk; a stream past the last slot takes
 * the slot used longest ago. Each is used by one stream's work only, so a
 * block is reused in stream order, without a wait. */
#define CUDA_WORKSPACES 8
typedef struct cuda_workspace {
    cudaStream_t stream;
    void *p;
    size_t bytes;
    uint64_t used; /* g_workspaces.clock at its last use */
} cuda_workspace;
static struct {
    cuda_workspace slot[CUDA_WORKSPACES];
    uint64_t clock;
} g_workspaces;

/* Stream s's slot, else a free one, else the one used longest ago. */
static int workspace_slot(cudaStream_t s) {
    int at = 0;
    for (int i = 0; i < CUDA_WORKSPACES; i++) {
        if (g_workspaces.slot[i].p && g_workspaces.slot[i].stream == s) return i;
        if (!g_workspaces.slot[at].p) continue; /* a free slot, unless s has one further on */
        if (!g_workspaces.slot[i].p || g_workspaces.slot[i].used < g_workspaces.slot[at].used) at = i;
    }
    return at;
}

extern "C" void *ht_kernels_cuda_workspace(size_t bytes) {
    if (!g_cuda.ready) return NULL;
    cudaStream_t s = g_cuda.ctx.stream;
    cuda_workspace *w = &g_workspaces.slot[workspace_slot(s)];
    if (w->p && w->stream == s && bytes <= w->bytes) {
        w->used = ++g_workspaces.clock;
        return w->p;
    }
    /* cudaFree waits for the device: no queued work still uses the old block. */
    cuda_block_free(w->p);
    *w = {s, NULL, 0, ++g_workspaces.clock};
    void *p = cuda_block(bytes);
    if (!p) return NULL;
    w->p = p;
    w->bytes = bytes;
    return p;
}

extern "C" void ht_kernels_cuda_free_workspaces(void) {
    for (int i = 0; i < CUDA_WORKSPACES; i++) {
        cuda_block_free(g_workspaces.slot[i].p);
        g_workspaces.slot[i] = {NULL, NULL, 0, 0};
    }
}

extern "C" int64_t ht_kernels_cuda_allocations(void) {
    pthread_mutex_lock(&g_held.lock);
    int64_t made = g_held.made;
    pthread_mutex_unlock(&g_held.lock);
    return made;
}

static size_t cuda_peak_bytes(void) {
    pthread_mutex_lock(&g_held.lock);
    size_t peak = g_held.peak;
    pthread_mutex_unlock(&g_held.lock);
    return peak;
}

static void *cuda_alloc(size_t bytes) {
    void *p = cuda_block(bytes);
    /* zeroed, as ht_alloc's; cudaMalloc's blocks are 256-byte aligned */
    if (p && !cuda_ok(cudaMemsetAsync(p, 0, bytes, g_cuda.ctx.stream), "cudaMemsetAsync (alloc)")) {
        cuda_block_free(p);
        return NULL;
    }
    return p;
}

static void cuda_free(void *p) {
    if (!p) return;
    release(p);
    cuda_ok(cudaFree(p), "cudaFree");
}

/* Device memory: what cudaMalloc gave (host and managed memory the host may touch itself). */
static bool cuda_owns(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError(); /* a pointer CUDA does not know: the host's */
        return false;
    }
    return a.type == cudaMemoryTypeDevice;
}

void cuda_zero(void *dst, size_t bytes) {
    if (bytes) cuda_ok(cudaMemsetAsync(dst, 0, bytes, g_cuda.ctx.stream), "cudaMemsetAsync");
}

/* The host's waits for the device (cuda_wait), for ht_kernels_cuda_waits. */
static std::atomic<int64_t> g_waits{0};

bool cuda_wait(cudaStream_t s, const char *what) {
    g_waits.fetch_add(1, std::memory_order_relaxed);
    return cuda_ok(cudaStreamSynchronize(s), what);
}

extern "C" int64_t ht_kernels_cuda_waits(void) { return g_waits.load(std::memory_order_relaxed); }

/* Whether host memory p is pinned (page-locked, registered or managed): a
 * copy from it queued on a stream reads it when the copy runs. From pageable
 * memory cudaMemcpyAsync has staged the bytes by the time it returns. An
 * address the runtime cannot place counts as pinned. */
static bool pinned(const void *p) {
    cudaPointerAttributes a;
    if (cudaPointerGetAttributes(&a, p) != cudaSuccess) {
        cudaGetLastError();
        return true;
    }
    return a.type != cudaMemoryTypeUnregistered;
}

/* The caller may reuse host_src on return: from pageable memory (a batch's
 * tokens, say) the copy has staged it, with no wait for the device; from
 * pinned memory the host waits for the copy. */
void cuda_upload(void *dst, const void *host_src, size_t bytes) {
    if (!bytes) return;
    cuda_ok(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, g_cuda.ctx.stream), "upload");
    if (pinned(host_src)) cuda_wait(g_cuda.ctx.stream, "upload (synchronize)");
}

void cuda_download(void *host_dst, const void *src, size_t bytes) {
    if (!bytes) return;
    cuda_ok(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, g_cuda.ctx.stream), "download");
    cuda_wait(g_cuda.ctx.stream, "download (synchronize)");
}

void cuda_copy(void *dst, const void *src, size_t bytes) {
    if (bytes) cuda_ok(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, g_cuda.ctx.stream), "copy");
}

static ht_status cuda_synchronize(ht_error *err) {
    cuda_wait(g_cuda.ctx.stream, "synchronize");
    return cuda_status(err);
}

/* ---------------------------------------------------------------- the table */

/* DeepSeek-V3's routing has no CUDA kernels yet: its two slots stay NULL
 * (docs/EXTENDING.md, "A new kernel backend"). */
#define cuda_moe_route_grouped NULL
#define cuda_moe_route_grouped_backward NULL

static void fill_table(ht_kernel_ops *t) {
    t->name = "cuda";
    t->host_memory = false;
    t->lm_head_chunk_bytes = (size_t)1 << 30;
#define SLOT(kind, type, name, ...) t->name = cuda_##name;
    HT_KERNEL_ENTRIES(SLOT)
#undef SLOT
}

/* cuBLASLt's workspace: 32 MiB, what NVIDIA advises for Hopper. */
#define LT_WORKSPACE_BYTES ((size_t)32 << 20)

static bool init_step(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return true;
    snprintf(g_cuda.why_not, sizeof(g_cuda.why_not), "%s: %s", what, cudaGetErrorString(e));
    cudaGetLastError();
    return false;
}

/* This process's rank among those a launcher started on this machine
 * (Open MPI, MPICH, Slurm, torchrun), or -1. */
static int launcher_local_rank(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"};
    for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
        const char *v = getenv(vars[i]);
        if (v && *v >= '0' && *v <= '9') return atoi(v);
    }
    return -1;
}

static void cuda_init_once(void) {
    cuda_context *c = &g_cuda.ctx;
    int count = 0;
    if (!init_step(cudaGetDeviceCount(&count), "cudaGetDeviceCount")) return;
    if (count == 0) {
        snprintf(g_cuda.why_not, sizeof(g_cuda.why_not), "cudaGetDeviceCount found no CUDA device");
        return;
    }
    /* The ranks of one machine spread over its GPUs, one each in turn; a
     * process no launcher started keeps the current one (CUDA_VISIBLE_DEVICES). */
    const int local = launcher_local_rank();
    if (local >= 0 && count > 1 && !init_step(cudaSetDevice(local % count), "cudaSetDevice")) return;
    if (!init_step(cudaGetDevice(&c->device), "cudaGetDevice")) return;
    cudaDeviceProp prop;
    if (!init_step(cudaGetDeviceProperties(&prop, c->device), "cudaGetDeviceProperties")) return;
    snprintf(c->name, sizeof(c->name), "%.200s (sm_%d%d, %.0f GiB)", prop.name, prop.major, prop.minor,
             (double)prop.totalGlobalMem / (double)(1 << 30));
    if (!init_step(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "cudaStreamCreate")) return;
    cublasStatus_t s = cublasLtCreate(&c->lt);
    if (s != CUBLAS_STATUS_SUCCESS) {
        snprintf(g_cuda.why_not, sizeof(g_cuda.why_not), "cublasLtCreate: %s", cublasLtGetStatusString(s));
        return;
    }
    if (!init_step(cudaMalloc(&c->lt_workspace, LT_WORKSPACE_BYTES), "cudaMalloc (cuBLASLt workspace)")) return;
    c->lt_workspace_bytes = LT_WORKSPACE_BYTES;
    fill_table(&g_cuda.table);
    g_cuda.ready = true;
    ht_log_debug("cuda: %s, cuBLASLt %zu", c->name, cublasLtGetVersion());
}

cuda_context *cuda_context_get(ht_error *err) {
    pthread_once(&g_cuda.once, cuda_init_once);
    if (!g_cuda.ready) {
        ht_fail(err, HT_ERR_INVALID, "no CUDA backend here: %s", g_cuda.why_not);
        return NULL;
    }
    return &g_cuda.ctx;
}

extern "C" const ht_kernel_ops *ht_kernels_cuda(ht_error *err) { return cuda_context_get(err) ? &g_cuda.table : NULL; }

extern "C" void *ht_kernels_cuda_stream(void *stream) {
    if (!g_cuda.ready) return NULL;
    void *was = (void *)g_cuda.ctx.stream;
    g_cuda.ctx.stream = (cudaStream_t)stream;
    return was;
}

extern "C" void *ht_kernels_cuda_current_stream(void) { return g_cuda.ready ? (void *)g_cuda.ctx.stream : NULL; }

extern "C" int ht_kernels_cuda_device(void) { return g_cuda.ready ? g_cuda.ctx.device : -1; }
