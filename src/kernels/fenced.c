/* The fenced backend: the CPU's kernels on memory the host cannot touch.
 *
 * A GPU's memory is reached from host code only through the table's memory
 * entries (upload, download, zero, copy); a stray memcpy or loop over it is
 * a crash there and nothing here, since the CPU's memory is the host's. This
 * table makes the CPU behave like a device in that one respect: every
 * allocation is its own anonymous mapping, kept PROT_NONE except while an
 * entry of this table runs, so host code that reads or writes backend memory
 * outside an entry faults at the line that did it. The kernels are the
 * CPU's, so a run on this table gives the CPU's bits: tests run the trainer
 * on it to prove the layers above keep to the seam, on any machine.
 *
 * Entries may be called from several threads (a fault would then be missed,
 * never invented): a count of running entries opens the fence on the first
 * and closes it after the last. */
#include "hypertrain/kernels.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef struct region {
    void *base;
    size_t bytes; /* whole pages */
} region;

static struct {
    pthread_mutex_t lock;
    region *regions;
    int count, capacity;
    int open;          /* entries running */
    size_t held, peak; /* bytes mapped now, and at most */
    struct sigaction previous;
} fence = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void protect_all(int prot) {
    for (int i = 0; i < fence.count; i++)
        if (mprotect(fence.regions[i].base, fence.regions[i].bytes, prot) != 0) {
            perror("hypertrain: fenced backend: mprotect");
            abort();
        }
}

static void enter(void) {
    pthread_mutex_lock(&fence.lock);
    if (fence.open++ == 0) protect_all(PROT_READ | PROT_WRITE);
    pthread_mutex_unlock(&fence.lock);
}

static void leave(void) {
    pthread_mutex_lock(&fence.lock);
    if (--fence.open == 0) protect_all(PROT_NONE);
    pthread_mutex_unlock(&fence.lock);
}

/* A fault inside a fenced region names it, then falls to the handler that
 * was there before (the default's core dump, or a sanitizer's stack trace):
 * returning re-runs the faulting access with that handler in place. */
static void on_fault(int sig, siginfo_t *info, void *ctx) {
    (void)ctx;
    const char *at = info->si_addr;
    for (int i = 0; i < fence.count; i++) {
        const char *b = fence.regions[i].base;
        if (at >= b && at < b + fence.regions[i].bytes) {
            char msg[192];
            int n = snprintf(msg, sizeof(msg),
                             "hypertrain: fenced backend: host code touched backend memory at %p, byte %zu of a "
                             "region of %zu bytes, outside the table's entries\n",
                             (const void *)at, (size_t)(at - b), fence.regions[i].bytes);
            if (n > 0) (void)!write(2, msg, (size_t)n < sizeof(msg) ? (size_t)n : sizeof(msg) - 1);
            break;
        }
    }
    sigaction(sig, &fence.previous, NULL);
}

static void *fenced_alloc(size_t bytes) {
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t len = ((bytes ? bytes : 1) + page - 1) / page * page;
    pthread_mutex_lock(&fence.lock);
    void *p = NULL;
    if (fence.count == fence.capacity) {
        int cap = fence.capacity ? 2 * fence.capacity : 64;
        region *r = realloc(fence.regions, (size_t)cap * sizeof(region));
        if (!r) goto out;
        fence.regions = r, fence.capacity = cap;
    }
    p = mmap(NULL, len, fence.open ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        p = NULL;
        goto out;
    }
    fence.regions[fence.count++] = (region){p, len};
    fence.held += len;
    if (fence.held > fence.peak) fence.peak = fence.held;
    /* the handler goes in front of whatever handles SIGSEGV now (installed again if someone replaced it) */
    struct sigaction now;
    if (sigaction(SIGSEGV, NULL, &now) == 0 && !((now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_fault)) {
        struct sigaction sa = {.sa_sigaction = on_fault, .sa_flags = SA_SIGINFO};
        sigemptyset(&sa.sa_mask);
        sigaction(SIGSEGV, &sa, &fence.previous);
    }
out:
    pthread_mutex_unlock(&fence.lock);
    return p;
}

static void fenced_free(void *p) {
    if (!p) return;
    pthread_mutex_lock(&fence.lock);
    for (int i = 0; i < fence.count; i++)
        if (fence.regions[i].base == p) {
            munmap(p, fence.regions[i].bytes);
            fence.held -= fence.regions[i].bytes;
            fence.regions[i] = fence.regions[--fence.count];
            pthread_mutex_unlock(&fence.lock);
            return;
        }
    pthread_mutex_unlock(&fence.lock);
    fprintf(stderr, "hypertrain: fenced backend: free of %p, which it did not allocate\n", p);
    abort();
}

static size_t fenced_peak_bytes(void) {
    pthread_mutex_lock(&fence.lock);
    size_t peak = fence.peak;
    pthread_mutex_unlock(&fence.lock);
    return peak;
}

static bool fenced_owns(const void *p) {
    const char *at = p;
    bool in = false;
    pthread_mutex_lock(&fence.lock);
    for (int i = 0; i < fence.count && !in; i++)
        in = at >= (const char *)fence.regions[i].base &&
             at < (const char *)fence.regions[i].base + fence.regions[i].bytes;
    pthread_mutex_unlock(&fence.lock);
    return in;
}

/* An array an entry is given must be this backend's memory (NULL: an
 * output not asked for): host memory handed to a GPU's kernel is a crash
 * there, so it is one here, naming the entry and the argument. */
static void owned(const char *entry, const char *arg, const void *p) {
    if (!p || fenced_owns(p)) return;
    fprintf(stderr, "hypertrain: fenced backend: %s was given %s = %p, which is not the backend's memory\n", entry, arg,
            p);
    abort();
}
#define UNPAREN(...) __VA_ARGS__

static ht_status fenced_synchronize(ht_error *err) { return ht_kernels_cpu()->synchronize(err); }

/* Every other entry: the CPU's, inside the fence, its arrays checked (a
 * workspace's size touches no memory: passed on as it is). */
#define CPU ht_kernels_cpu()
#define M(ptr) owned(__func__ + 7, #ptr, ptr)
#define FENCED(kind, type, name, params, args, arrays) FENCED_##kind(type, name, params, args, arrays)
#define FENCED_OWN(type, name, params, args, arrays) /* above */
#define FENCED_SIZE(type, name, params, args, arrays)                                                                  \
    static type fenced_##name params { return CPU->name args; }
#define FENCED_RUN(type, name, params, args, arrays)                                                                   \
    static void fenced_##name params {                                                                                 \
        enter();                                                                                                       \
        UNPAREN arrays;                                                                                                \
        CPU->name args;                                                                                                \
        leave();                                                                                                       \
    }
#define FENCED_GEMM FENCED_RUN
#define FENCED_GET(type, name, params, args, arrays)                                                                   \
    static type fenced_##name params {                                                                                 \
        enter();                                                                                                       \
        UNPAREN arrays;                                                                                                \
        type r = CPU->name args;                                                                                       \
        leave();                                                                                                       \
        return r;                                                                                                      \
    }
HT_KERNEL_ENTRIES(FENCED)

#define SLOT(kind, type, name, ...) .name = fenced_##name,
static const ht_kernel_ops fenced = {
    .name = "fenced", .host_memory = false, .lm_head_chunk_bytes = HT_CPU_LM_HEAD_CHUNK_BYTES, HT_KERNEL_ENTRIES(SLOT)};

const ht_kernel_ops *ht_kernels_fenced(void) { return &fenced; }
