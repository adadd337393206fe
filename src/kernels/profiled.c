/* The profiled table: another table's entries, each waited for and timed.
 *
 * Where a step's time goes on a device is not visible from the host: the
 * kernels are queued and the host waits only at the step's end. This table
 * passes every entry to the table it wraps, then waits for that table
 * (its synchronize) and adds the time from the call to the end of the work
 * to the entry's row: the products by dtype, transposes and shape, every
 * other entry by its name. What a step spends outside every entry (host
 * loops, collectives, waiting) is the step's time less the rows' sum.
 *
 * The wait after each entry costs what a synchronisation costs (a few
 * microseconds on a GPU) and removes the overlap of the host's launches
 * with the device's work, so a profiled step is slower than a plain one;
 * the rows say where the device's time goes, not how fast a step is.
 * An entry called inside another (a backend's entry that calls the table
 * in use) is the outer one's time, timed once. While training.trace
 * captures a step, each entry is also a span of the trace. */
#include "hypertrain/kernels.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROFILE_ROWS 512

static struct {
    pthread_mutex_t lock;
    const ht_kernel_ops *base;
    ht_kernel_profile_row rows[PROFILE_ROWS];
    int count; /* rows; past PROFILE_ROWS - 1 keys, the last is "(other)" */
} prof = {.lock = PTHREAD_MUTEX_INITIALIZER};

static _Thread_local int depth; /* entries running on this thread */

static void add(const char *key, double seconds) {
    pthread_mutex_lock(&prof.lock);
    int i = 0;
    while (i < prof.count && strcmp(prof.rows[i].entry, key) != 0) i++;
    if (i == prof.count && prof.count >= PROFILE_ROWS - 1) key = "(other)", i = PROFILE_ROWS - 1; /* the last row */
    if (i == prof.count) {
        prof.count++;
        memset(&prof.rows[i], 0, sizeof(prof.rows[i]));
        snprintf(prof.rows[i].entry, sizeof(prof.rows[i].entry), "%s", key);
    }
    prof.rows[i].calls++;
    prof.rows[i].seconds += seconds;
    pthread_mutex_unlock(&prof.lock);
}

/* The outermost entry of this thread starts timing; the others pass through. */
static double enter(void) { return depth++ == 0 ? ht_time_seconds() : -1.0; }
static void leave(const char *key, double t0) {
    if (--depth != 0 || t0 < 0) return;
    ht_error err;
    (void)prof.base->synchronize(&err); /* a failure stays the backend's, for the step's own wait */
    const double t1 = ht_time_seconds();
    add(key, t1 - t0);
    ht_trace_span("kernel", key, HT_TRACE_THREAD, t0, t1, -1, -1); /* training.trace */
}

static void *profiled_alloc(size_t bytes) { return prof.base->alloc(bytes); }
static void profiled_free(void *p) { prof.base->free(p); }
static bool profiled_owns(const void *p) { return prof.base->owns(p); }
static size_t profiled_peak_bytes(void) { return prof.base->peak_bytes(); }
static ht_status profiled_synchronize(ht_error *err) { return prof.base->synchronize(err); }

/* Every other entry timed, but a workspace's size (a host's answer): passed on as it is. */
#define PROFILED(kind, type, name, params, args, arrays) PROFILED_##kind(type, name, params, args)
#define PROFILED_OWN(type, name, params, args) /* above */
#define PROFILED_SIZE(type, name, params, args)                                                                        \
    static type profiled_##name params { return prof.base->name args; }
#define PROFILED_RUN(type, name, params, args)                                                                         \
    static void profiled_##name params {                                                                               \
        double began = enter();                                                                                        \
        prof.base->name args;                                                                                          \
        leave(#name, began);                                                                                           \
    }
#define PROFILED_GET(type, name, params, args)                                                                         \
    static type profiled_##name params {                                                                               \
        double began = enter();                                                                                        \
        type r = prof.base->name args;                                                                                 \
        leave(#name, began);                                                                                           \
        return r;                                                                                                      \
    }
/* The products by what their time depends on: "gemm bfloat16 NT 8192 x 4864 x 896". */
#define PROFILED_GEMM(type, name, params, args)                                                                        \
    static void profiled_##name params {                                                                               \
        double began = enter();                                                                                        \
        prof.base->name args;                                                                                          \
        if (began < 0) {                                                                                               \
            depth--;                                                                                                   \
            return;                                                                                                    \
        }                                                                                                              \
        char key[sizeof(((ht_kernel_profile_row *)0)->entry)];                                                         \
        snprintf(key, sizeof(key), "%s %s %c%c %lld x %lld x %lld", #name, ht_dtype_name(dtype), trans_a ? 'T' : 'N',  \
                 trans_b ? 'T' : 'N', (long long)M, (long long)N, (long long)K);                                       \
        leave(key, began);                                                                                             \
    }
HT_KERNEL_ENTRIES(PROFILED)

#define SLOT(kind, type, name, ...) .name = profiled_##name,
static ht_kernel_ops profiled = {HT_KERNEL_ENTRIES(SLOT)};

const ht_kernel_ops *ht_kernels_profiled(const ht_kernel_ops *base) {
    pthread_mutex_lock(&prof.lock);
    if (prof.base && prof.base != base) {
        pthread_mutex_unlock(&prof.lock);
        fprintf(stderr, "hypertrain: ht_kernels_profiled: already wrapping the %s table, asked to wrap %s\n",
                prof.base->name, base->name);
        abort();
    }
    prof.base = base;
    profiled.name = base->name;
    profiled.host_memory = base->host_memory;
    profiled.lm_head_chunk_bytes = base->lm_head_chunk_bytes;
    pthread_mutex_unlock(&prof.lock);
    return &profiled;
}

void ht_kernels_profile_reset(void) {
    pthread_mutex_lock(&prof.lock);
    prof.count = 0;
    pthread_mutex_unlock(&prof.lock);
}

static int by_seconds(const void *a, const void *b) {
    const ht_kernel_profile_row *x = a, *y = b;
    return x->seconds < y->seconds ? 1 : x->seconds > y->seconds ? -1 : strcmp(x->entry, y->entry);
}

int ht_kernels_profile(ht_kernel_profile_row *rows, int max) {
    pthread_mutex_lock(&prof.lock);
    int n = prof.count < max ? prof.count : max;
    ht_kernel_profile_row *all = malloc((size_t)(prof.count ? prof.count : 1) * sizeof(*all));
    if (!all)
        n = 0;
    else {
        memcpy(all, prof.rows, (size_t)prof.count * sizeof(*all));
        qsort(all, (size_t)prof.count, sizeof(*all), by_seconds);
        memcpy(rows, all, (size_t)n * sizeof(*rows));
    }
    free(all);
    pthread_mutex_unlock(&prof.lock);
    return n;
}
